/*
 * Chapter 01 benchmark: the naive MoE layer (router → permute → loop over experts →
 * unpermute), forward + backward, on the layer shapes of two real models:
 *
 *   qwen3    Qwen3-30B-A3B:  T=16384 tokens, H=2048, F=768,   E=128 experts, top-8
 *   mixtral  Mixtral-8x7B:   T=8192  tokens, H=4096, F=14336, E=8 experts,   top-2
 *   small    a CPU-sized shape (T=2048, H=256, F=256, E=16, top-4), the default on CPU
 *
 * TFLOP/s counts the expert GEMMs only, 6·T·k·3·H·F per forward+backward, so
 * the number is comparable with PyTorch's loop and torch._grouped_mm on the same shapes
 * (chapters/01-naive-moe/torch_moe_layer.py, run in the same device call by bench.sh).
 *
 * Before timing a shape, the backend's layer is checked against the CPU reference on the
 * same weights (the counter-based RNG fills both) with the full H, F, E, k and 256 tokens.
 *
 * `--precision bf16,fp8` (chapter 05) also times the layer in FP8 blockwise (lib/lowp.h): on
 * Hopper with our grouped kernel the native path (forward and dgrad in our FP8 grouped
 * kernel, wgrad in bf16), elsewhere the emulation; its check is against the CPU running the
 * same recipe emulated, and the line after it gives its ratio to the bf16 layer of the same
 * run. The experts' weights are quantized once before timing, as the bf16 layer's cast is
 * (once per optimizer step, not per micro-batch); that time is printed on its own.
 * Timing: the backend's timer (CUDA events on the GPU), warm-up, median of repeats.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "bench.h"
#include "flags.h"
#include "log.h"
#include "lowp.h"
#include "moe/layer.h"
#include "profile.h"

typedef struct opts {
    char device[MOE_FLAG_STR_LEN];
    char shape[MOE_FLAG_STR_LEN];
    int warmup, repeats, check, breakdown;
    char impl[MOE_FLAG_STR_LEN];
    char expert_dw[MOE_FLAG_STR_LEN];
    char permute_fusion[MOE_FLAG_STR_LEN];
    char precision[MOE_FLAG_STR_LEN];
} opts;

#define OF(name, type, field, def, help, choices) \
    { name, type, offsetof(opts, field), def, help, choices, "benchmark" }
static const moe_flag g_flags[] = {
    OF("device", MOE_FLAG_CHOICE, device, "auto", "backend (auto = cuda when a GPU is present)",
       "auto|cpu|cuda"),
    OF("shape", MOE_FLAG_CHOICE, shape, "auto",
       "layer shape (auto = qwen3 and mixtral on a GPU, small on the CPU)",
       "auto|all|models|sweep|big|qwen3|mixtral|qwen3-235b|dsv2-lite|sweep64|sweep128|"
       "sweep256|sweep512|sweep1024|sweep2048|sweep4096|sweep8192|small|preset"),
    OF("warmup", MOE_FLAG_INT, warmup, "2", "untimed iterations first", NULL),
    OF("repeats", MOE_FLAG_INT, repeats, "7", "timed iterations (the median is reported)", NULL),
    OF("check", MOE_FLAG_BOOL, check, "1", "check against the CPU reference before timing", NULL),
    OF("breakdown", MOE_FLAG_BOOL, breakdown, "0",
       "after timing, one profiled run: the time share of each stage of the layer", NULL),
    OF("impl", MOE_FLAG_STRING, impl, "loop,cublas-grouped,grouped",
       "comma-separated expert backends to time: loop (chapter 01), cublas-grouped and "
       "grouped (chapter 03's own kernel)", NULL),
    OF("expert-dw", MOE_FLAG_STRING, expert_dw, "add",
       "comma-separated ways the grouped kernel writes the expert weight gradients: add (fp32 "
       "+=, every micro-batch but a step's first), store (fp32 =, the first) and bf16 (=, as "
       "torch._grouped_mm; our kernel only)", NULL),
    OF("permute-fusion", MOE_FLAG_STRING, permute_fusion, "off",
       "comma-separated: off (permute, the grouped GEMMs, unpermute), gather (fc1 gathers its "
       "rows from the tokens: no permuted copy of them), scatter (fc2 stores its rows in their "
       "tokens' slots: no permuted copy of the outputs) and on (both: --moe-permute-fusion); "
       "our kernel only", NULL),
    OF("precision", MOE_FLAG_STRING, precision, "bf16",
       "comma-separated: bf16 (the backend's activations) and fp8 (chapter 05's blockwise "
       "E4M3 recipe: native FP8 expert GEMMs on Hopper with our kernel, the wgrad too unless "
       "MOE_FP8_WGRAD=0, else emulated); fp8-unfused: fp8 with MOE_FP8_FUSED=0 (the separate "
       "quantize passes, lib/mlp.c), timed before fp8 for a before/after in one run; "
       "fp8-bf16wgrad: fp8 with MOE_FP8_WGRAD=0 (the routed experts' wgrad a bf16 GEMM on "
       "the dequantized operands, the course's first arrangement), timed before fp8; "
       "fp8-wgrad: fp8 with MOE_FP8_WGRAD=1 whatever the environment says (its tile width "
       "from MOE_FP8_WGRAD_BN), timed after fp8", NULL),
};

typedef moe_bench_shape shape;

/* Everything one layer needs on one backend. */
typedef struct layer {
    const moe_backend *be;
    moe_layer_dims d;
    moe_layer_weights w;
    moe_layer_grads g;
    moe_layer_acts a;
    moe_layer_workspace ws;
    void *x, *out, *dout, *dx, *wbuf;
    moe_real *gbuf;
    moe_lowp lp;          /* chapter 05's recipe (lp.on = 0: bf16) */
    moe_fp8_weight fw[2]; /* fc1's and fc2's FP8 codes on the native path */
} layer;

/* Chapter 05: the experts' weights quantized for the step (lowp.h) — into their FP8 codes on
 * the native path, else QDQ in place (the emulation) */
static void layer_quantize_weights(layer *L) {
    const moe_layer_dims *d = &L->d;
    moe_fp8_weight *fw = L->w.fc1_fp8 ? L->fw : NULL;
    moe_lowp_quantize_experts(L->be, &L->lp, fw, (void *)L->w.fc1, d->E, 2 * d->F, d->H, 0,
                              1);
    moe_lowp_quantize_experts(L->be, &L->lp, fw ? fw + 1 : NULL, (void *)L->w.fc2, d->E, d->H,
                              d->F, 0, 1);
}

/* the FP8 blockwise recipe (--fp8-format e4m3 --fp8-recipe blockwise) for a layer of shape
 * @p s on T tokens, its buffers, and the native path's FP8 weights where it runs */
static void layer_lowp(layer *L, const shape *s, int T) {
    moe_config c;
    moe_config_defaults(&c);
    snprintf(c.fp8_format, sizeof c.fp8_format, "e4m3");
    snprintf(c.fp8_recipe, sizeof c.fp8_recipe, "blockwise");
    c.hidden_size = s->H;
    c.moe_ffn_hidden_size = s->F;
    moe_error err;
    MOE_ASSERT(moe_lowp_from_config(&L->lp, &c, &err) == MOE_OK);
    MOE_ASSERT(moe_lowp_alloc(L->be, &L->lp, moe_lowp_cap(&c, (size_t)T, (size_t)T * s->k)));
    L->d.lowp = &L->lp;
    if (moe_lowp_native(L->be, &L->lp) && L->d.experts == MOE_EXPERTS_KERNEL) {
        MOE_ASSERT(moe_fp8_weight_alloc(L->be, &L->fw[0], s->E, 2 * s->F, s->H) &&
                   moe_fp8_weight_alloc(L->be, &L->fw[1], s->E, s->H, s->F));
        L->lp.native = 1;
        /* MOE_FP8_WGRAD=1: the FP8 wgrad's token-wise copies (lib/fp8_wgrad.h) */
        MOE_ASSERT(moe_lowp_alloc_fp8_wgrad(L->be, &L->lp, moe_layer_permuted_rows(&L->d),
                                            s->E, 2 * s->F + s->H));
        L->w.fc1_fp8 = &L->fw[0];
        L->w.fc2_fp8 = &L->fw[1];
    }
    layer_quantize_weights(L);
}

/* The fused permutation's halves, as a bit mask: FUSE_GATHER (fc1), FUSE_SCATTER (fc2). */
enum { FUSE_GATHER = 1, FUSE_SCATTER = 2 };

/* Weights drawn from the counter-based RNG: the same values on every backend. @p fused: the
 * halves of the fused permutation (FUSE_*) */
static void layer_init(layer *L, const moe_backend *be, const shape *s, int T,
                       moe_expert_impl impl, int fused, int fp8) {
    memset(L, 0, sizeof *L);
    L->be = be;
    moe_layer_dims d = {.N = T, .T = T, .H = s->H, .E = s->E, .k = s->k, .F = s->F, .Fs = 0,
                        .router = {s->E, s->k, MOE_SCORE_SOFTMAX, 0, 0, 0, 0},
                        .lb_type = MOE_LB_AUX, .aux_coeff = 0.01, .z_coeff = 0.001,
                        .experts = impl, .permute_fusion = (fused & FUSE_GATHER) != 0,
                        .permute_scatter = (fused & FUSE_SCATTER) != 0};
    L->d = d;
    const size_t H = s->H, F = s->F, E = s->E, S = be->act_size;
    const size_t nr = E * H, n1 = E * 2 * F * H, n2 = E * H * F, n = nr + n1 + n2;
    L->wbuf = be->alloc(S * n);
    L->gbuf = be->alloc(sizeof(moe_real) * n);
    moe_real *tmp = be->alloc(sizeof(moe_real) * n);
    MOE_ASSERT(L->wbuf && L->gbuf && tmp);
    be->fill_normal(tmp, nr, 1, 1, 0.02);
    be->fill_normal(tmp + nr, n1, 1, 2, 0.02);
    be->fill_normal(tmp + nr + n1, n2, 1, 3, 0.02);
    be->cast_to_act(L->wbuf, tmp, n);
    be->free(tmp);
    L->w.router = L->wbuf;
    L->w.fc1 = MOE_ACT(be, L->wbuf, nr);
    L->w.fc2 = MOE_ACT(be, L->wbuf, nr + n1);
    L->g.router = L->gbuf;
    L->g.fc1 = L->gbuf + nr;
    L->g.fc2 = L->gbuf + nr + n1;
    /* the recipe before the buffers: on the native path the saved SwiGLU output's buffer
     * is sized for its FP8 codes (moe_mlp_act_bytes()) */
    if (fp8)
        layer_lowp(L, s, T);
    moe_layer_acts_alloc(be, &L->a, &L->d);
    moe_layer_workspace_alloc(be, &L->ws, &L->d);
    L->x = be->alloc(S * T * H);
    L->out = be->alloc(S * T * H);
    L->dout = be->alloc(S * T * H);
    L->dx = be->alloc(S * T * H);
    moe_real *t2 = be->alloc(sizeof(moe_real) * T * H);
    be->fill_normal(t2, (size_t)T * H, 1, 4, 1.0);
    be->cast_to_act(L->x, t2, (size_t)T * H);
    be->fill_normal(t2, (size_t)T * H, 1, 5, 1.0);
    be->cast_to_act(L->dout, t2, (size_t)T * H);
    be->free(t2);
}

static void layer_free(layer *L) {
    const moe_backend *be = L->be;
    moe_layer_acts_free(be, &L->a);
    moe_layer_workspace_free(be, &L->ws);
    be->free(L->wbuf); be->free(L->gbuf); be->free(L->x); be->free(L->out);
    be->free(L->dout); be->free(L->dx);
    moe_fp8_weight_free(be, &L->fw[0]);
    moe_fp8_weight_free(be, &L->fw[1]);
    moe_lowp_free(be, &L->lp);
}

/* @p dst (CPU) takes @p src's weights, input and output gradient, as @p src's backend holds
 * them (bf16 on CUDA), and quantizes its weights again */
static void layer_copy_inputs(layer *dst, const layer *src) {
    const moe_layer_dims *d = &src->d;
    const size_t H = d->H, nw = (size_t)d->E * H * (1 + 3 * (size_t)d->F), nx = (size_t)d->N * H;
    src->be->read_act(dst->wbuf, src->wbuf, nw);
    src->be->read_act(dst->x, src->x, nx);
    src->be->read_act(dst->dout, src->dout, nx);
    layer_quantize_weights(dst);
}

static void layer_step(layer *L) {
    const moe_backend *be = L->be;
    moe_layer_forward(be, L->out, L->x, &L->w, NULL, &L->d, &L->a, &L->ws);
    be->zero(L->dx, be->act_size * (size_t)L->d.N * L->d.H);
    moe_layer_backward(be, L->dx, &L->g, L->dout, L->x, &L->w, &L->d, &L->a, &L->ws, 1.0);
}

/* ‖a − b‖ / ‖b‖ over the rows (tokens) where same[row] is set, for two activation
 * buffers of rows × C elements read to the host. */
static double rel_err(const layer *a, const void *pa, const layer *b, const void *pb, int rows,
                      int C, const char *same) {
    size_t n = (size_t)rows * C;
    moe_real *ha = malloc(sizeof(moe_real) * n), *hb = malloc(sizeof(moe_real) * n);
    a->be->read_act(ha, pa, n);
    b->be->read_act(hb, pb, n);
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (!same[i / C])
            continue;
        num += ((double)ha[i] - hb[i]) * ((double)ha[i] - hb[i]);
        den += (double)hb[i] * hb[i];
    }
    free(ha);
    free(hb);
    return isfinite(num) ? sqrt(num / (den > 0 ? den : 1e-30)) : INFINITY;
}

/* Tokens whose k experts are the same on both backends. bf16 inputs and weights move the
 * logits by ~0.5%, which flips near-tied choices (with 128 experts and top-8 the 8th and 9th
 * logits are often close): a flipped token legitimately gets a different output, so the
 * comparison is over the tokens routed identically, and the flips are counted. */
static int same_routing(const layer *a, const layer *b, int N, int k, char *same) {
    int *ia = malloc(sizeof(int) * N * k), *ib = malloc(sizeof(int) * N * k), n_same = 0;
    a->be->to_host(ia, a->a.topk_idx, sizeof(int) * N * k);
    b->be->to_host(ib, b->a.topk_idx, sizeof(int) * N * k);
    for (int t = 0; t < N; t++) {
        same[t] = 1;
        for (int j = 0; j < k; j++)
            same[t] &= ia[t * k + j] == ib[t * k + j];
        n_same += same[t];
    }
    free(ia);
    free(ib);
    return n_same;
}

static const char *const g_impl_names[] = {"loop", "cublas-grouped", "grouped"};
static const char *const g_dw_names[] = {"add", "store", "bf16"};

/* the median ms of the last bf16 run, for the fp8 run of the same configuration after it */
static double g_bf16_ms = -1;
/* the fp8 run's tag: "+fp8", "+fp8-unfused" for --precision fp8-unfused (MOE_FP8_FUSED=0
 * for that run: chapter 05's separate quantize passes, the before of lib/mlp.c's fusion),
 * "+fp8-bf16wgrad" for --precision fp8-bf16wgrad (MOE_FP8_WGRAD=0) or "+fp8-wgrad" for
 * --precision fp8-wgrad (MOE_FP8_WGRAD=1 for that run) */
static const char *g_fp8_tag = "+fp8";

static int run_shape(const moe_backend *be, const shape *s, const opts *o, moe_expert_impl impl,
                     moe_dw_mode dw, int fused, int fp8) {
    if (fp8 && (s->H % 128 || s->F % 128)) {
        printf("  %s: fp8 skipped: the blockwise recipe needs H and F multiples of 128\n",
               s->name);
        return 0;
    }
    /* the expert backend; "-fused" under the whole fused permutation, "-gather" or
     * "-scatter" under one half; "+fp8" (or "+fp8-unfused", "+fp8-bf16wgrad", "+fp8-wgrad") */
    static const char *const fuse_names[4] = {"", "-gather", "-scatter", "-fused"};
    char name[40];
    snprintf(name, sizeof name, "%s%s%s", g_impl_names[impl], fuse_names[fused & 3],
             fp8 ? g_fp8_tag : "");
    if (o->check && be->device != MOE_DEVICE_CPU) {
        /* the same layer, 256 tokens, on this backend and on the CPU reference */
        layer A, C;
        layer_init(&A, be, s, 256, impl, fused, fp8);
        layer_init(&C, moe_backend_cpu(), s, 256, MOE_EXPERTS_LOOP, 0, fp8);
        if (fp8) /* the same recipe on the same (bf16) numbers: else a weight or input that
                  * bf16 moved across an E4M3 rounding midpoint adds ~2 % per GEMM */
            layer_copy_inputs(&C, &A);
        layer_step(&A);
        layer_step(&C);
        char same[256];
        int n_same = same_routing(&A, &C, 256, s->k, same);
        double eo = rel_err(&A, A.out, &C, C.out, 256, s->H, same);
        double ex = rel_err(&A, A.dx, &C, C.dx, 256, s->H, same);
        layer_free(&A);
        layer_free(&C);
        printf("check %-8s %s %s vs cpu%s at 256 tokens: %d routed identically; on those, "
               "output rel err %.2e, dgrad rel err %.2e\n",
               s->name, be->name, name, fp8 ? " (the same recipe, emulated)" : "", n_same, eo,
               ex);
        /* FP8: the GPU's bf16 activations move a few elements across an E4M3 rounding
         * midpoint before each quantizer, ~1 % per GEMM (tests/gpu_fp8_layer.c) */
        if (!(n_same >= 200 && eo < (fp8 ? 5e-2 : 2e-2) && ex < (fp8 ? 8e-2 : 3e-2))) {
            moe_log_error("%s layer disagrees with the CPU reference: not timing it", be->name);
            return 1;
        }
    }
    layer L;
    layer_init(&L, be, s, s->T, impl, fused, fp8);
    L.g.expert_dw = dw; /* the fp32 gradient views have room for a bf16 dw */
    double wq_ms = 0;
    if (fp8) { /* the weights' quantization, once per optimizer step */
        layer_quantize_weights(&L);
        be->timer_begin();
        layer_quantize_weights(&L);
        wq_ms = be->timer_end_ms();
    }
    for (int i = 0; i < o->warmup; i++)
        layer_step(&L);
    double *ms = malloc(sizeof(double) * o->repeats);
    for (int r = 0; r < o->repeats; r++) {
        be->timer_begin();
        layer_step(&L);
        ms[r] = be->timer_end_ms();
    }
    const double med = moe_median(ms, o->repeats);
    double flop = 6.0 * s->T * s->k * 3.0 * s->H * s->F;
    long long cmin = -1, cmax = 0;
    for (int e = 0; e < s->E; e++) {
        cmin = cmin < 0 || L.a.counts[e] < cmin ? L.a.counts[e] : cmin;
        cmax = L.a.counts[e] > cmax ? L.a.counts[e] : cmax;
    }
    printf("| %-10s | %5d | %4d | %5d | %3d | %d | %-4s %-14s | %-5s | %9.2f | %8.2f | %lld/%lld "
           "|\n", s->name, s->T, s->H, s->F, s->E, s->k, be->name, name,
           g_dw_names[dw], med, flop / (med * 1e-3) / 1e12, cmin, cmax);
    /* one line for torch_moe_layer.py --ours, which prints the comparison with ratios */
    printf("RESULT layer shape=%s impl=%s dw=%s ms=%.4f\n", s->name, name, g_dw_names[dw], med);
    if (fp8) {
        printf("  %s %s: %s; experts' weight quantization %.3f ms per optimizer step (not in "
               "the layer's time)",
               s->name, name,
               !L.lp.native ? "FP8 emulated (quantize -> dequantize -> the usual GEMMs)"
               : L.lp.fp8_wgrad
                   ? "native FP8 forward + dgrad + wgrad (our FP8 grouped kernels)"
                   : "native FP8 forward + dgrad (our FP8 grouped kernel), bf16 wgrad "
                     "(MOE_FP8_WGRAD=0)",
               wq_ms);
        if (g_bf16_ms > 0)
            printf("; fp8 vs bf16 layer: %.2f ms vs %.2f ms = %.2fx", med, g_bf16_ms,
                   g_bf16_ms / med);
        printf("\n");
        /* what the layer keeps of the SwiGLU output [rows, F] (and, in the token-wise form,
         * of its input x [rows, H]) for the backward (lib/mlp.c, moe/layer.c) */
        const moe_groups probe = {.fp8_w1 = L.w.fc1_fp8, .fp8_w2 = L.w.fc2_fp8,
                                  .lowp = &L.lp};
        const size_t rows = (size_t)moe_layer_permuted_rows(&L.d);
        const int x_t = moe_layer_keeps_x_t(be, &L.d);
        const double nf = (double)rows * s->F + (x_t ? (double)rows * s->H : 0);
        const int tiled = L.lp.fp8_fused_t && be->fp8_swiglu_backward_quant_t;
        const moe_mlp_saved form = moe_mlp_saved_form(be, &L.lp);
        const double kept =
            form == MOE_MLP_SAVED_ACT
                ? nf * 2
                : (double)moe_mlp_act_bytes(be, &L.lp, rows, s->E, s->F, x_t ? s->H : 0);
        if (moe_mlp_fp8_fused(be, &probe)) {
            printf("  %s %s: fused quantize passes (MOE_FP8_FUSED)%s; the SwiGLU output%s "
                   "kept for the backward %s: %.1f MB, against %.1f MB in bf16 (%.1f MB "
                   "saved)\n",
                   s->name, name, L.lp.fp8_wgrad ? " with the FP8 wgrad" : "",
                   x_t ? " and the experts' input x are" : " is",
                   form == MOE_MLP_SAVED_FP8_TOKEN
                       ? "as the FP8 wgrad's token-wise copies, written by the tiled forward "
                         "and x's quantizer (MOE_FP8_SAVE_T)"
                   : form == MOE_MLP_SAVED_FP8_ROW ? "as FP8 codes + 1x128 scales"
                                                   : "in bf16, written next to fc2's codes "
                                                     "(MOE_FP8_SAVE_T=0)",
                   kept / 1e6, nf * 2 / 1e6, (nf * 2 - kept) / 1e6);
            if (L.lp.fp8_wgrad)
                printf("  %s %s: dgu: %s\n", s->name, name,
                       tiled ? "the tiled backward (MOE_FP8_FUSED_T) writes its row-wise codes "
                               "and token-wise copy, never dgu"
                             : "the fused backward writes dgu next to its row-wise codes, its "
                               "token-wise copy is a pass of its own (MOE_FP8_FUSED_T=0)");
        }
        else if (L.lp.native)
            printf("  %s %s: separate quantize passes (MOE_FP8_FUSED=0); the SwiGLU output is "
                   "kept in bf16, %.1f MB, and quantized again in the backward\n",
                   s->name, name, nf * 2 / 1e6);
    }
    if (!fp8)
        g_bf16_ms = med;
    free(ms);
    if (o->breakdown) { /* one more step with a device sync at every stage boundary */
        moe_prof_start(be);
        layer_step(&L);
        moe_prof_start(NULL);
        const double *st = moe_prof_ms();
        double tot = 0;
        for (int i = 0; i < MOE_PROF_STAGES; i++)
            tot += st[i];
        printf("  %s %s stages (one profiled step, %.2f ms with a sync per stage):", s->name,
               name, tot);
        for (int i = 0; i < MOE_PROF_STAGES; i++)
            if (st[i] > 0)
                printf(" %s %.2f ms (%.0f%%);", moe_prof_stage_names[i], st[i],
                       100.0 * st[i] / tot);
        printf(" expert GEMMs at %.1f TFLOP/s\n", flop / (st[MOE_PROF_GEMM] * 1e-3) / 1e12);
    }
    layer_free(&L);
    return 0;
}

/* is @p name one of the comma-separated entries of @p list? */
static int impl_wanted(const char *list, const char *name) {
    const size_t n = strlen(name);
    for (const char *p = list; *p;) {
        const char *end = strchr(p, ',');
        const size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len == n && !strncmp(p, name, n))
            return 1;
        p += len + (end ? 1 : 0);
    }
    return 0;
}

int main(int argc, char **argv) {
    opts o;
    moe_error err;
    const int nflags = (int)(sizeof g_flags / sizeof g_flags[0]);
    moe_flags_set_defaults(g_flags, nflags, &o);
    moe_status st = moe_flags_parse(g_flags, nflags, &o, argc, argv, &err);
    if (st == MOE_ERR_HELP) {
        moe_flags_print_help(stdout, "ch01_moe_layer_bench",
                             "Chapter 01: the naive MoE layer, forward + backward, timed.", g_flags,
                             nflags);
        return 0;
    }
    if (st != MOE_OK) {
        moe_log_error("%s", err.msg);
        return 2;
    }
    if (o.repeats < 1 || o.warmup < 0) {
        moe_log_error("--repeats must be >= 1 and --warmup >= 0");
        return 2;
    }
    int n_impl = 0, n_dw = 0;
    for (int i = 0; i < 3; i++) {
        n_impl += impl_wanted(o.impl, g_impl_names[i]);
        n_dw += impl_wanted(o.expert_dw, g_dw_names[i]);
    }
    /* the fused permutation's variants, in the order they run: none, gather, scatter, both */
    const int fuse[4] = {impl_wanted(o.permute_fusion, "off"),
                         impl_wanted(o.permute_fusion, "gather"),
                         impl_wanted(o.permute_fusion, "scatter"),
                         impl_wanted(o.permute_fusion, "on")};
    const int prec[5] = {impl_wanted(o.precision, "bf16"), impl_wanted(o.precision, "fp8"),
                         impl_wanted(o.precision, "fp8-unfused"),
                         impl_wanted(o.precision, "fp8-wgrad"),
                         impl_wanted(o.precision, "fp8-bf16wgrad")};
    if (!prec[0] && !prec[1] && !prec[2] && !prec[3] && !prec[4]) {
        moe_log_error("--precision '%s': give a comma-separated list of bf16, fp8, fp8-unfused, "
                      "fp8-bf16wgrad, fp8-wgrad",
                      o.precision);
        return 2;
    }
    if (!fuse[0] && !fuse[1] && !fuse[2] && !fuse[3]) {
        moe_log_error("--permute-fusion '%s': give a comma-separated list of off, gather, "
                      "scatter, on", o.permute_fusion);
        return 2;
    }
    if (n_dw == 0) {
        moe_log_error("--expert-dw '%s': give a comma-separated list of add, store, bf16",
                      o.expert_dw);
        return 2;
    }
    if (n_impl == 0 || strspn(o.impl, "abcdefghijklmnopqrstuvwxyz-,") != strlen(o.impl)) {
        moe_log_error("--impl '%s': give a comma-separated list of loop, cublas-grouped, grouped",
                      o.impl);
        return 2;
    }
    const moe_backend *be = NULL;
    if (moe_backend_select(o.device, &be, &err) != MOE_OK) {
        moe_log_error("%s", err.msg);
        return 2;
    }
    char dev[256];
    be->device_name(dev, sizeof dev);
    moe_bench_header("ch01 naive MoE layer, forward+backward", dev);
    printf("TFLOP/s counts the expert GEMMs only: 6*T*k*3*H*F. Median of %d after %d warm-up.\n\n",
           o.repeats, o.warmup);
    printf("| shape      |     T |    H |     F |   E | k | dev  experts | dw    |   ms/iter |  "
           "TFLOP/s | tokens/expert min/max |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
    int fails = 0, n_shapes;
    const moe_bench_shape *shapes = moe_bench_shapes(&n_shapes);
    for (int i = 0; i < n_shapes; i++) {
        const shape *s = &shapes[i];
        if (!moe_bench_shape_wanted(o.shape, s->name, be->device != MOE_DEVICE_CPU))
            continue;
        for (int impl = 0; impl < 3; impl++)
            for (int dw = 0; dw < 3; dw++) /* bf16 dw: our kernel only */
                if (impl_wanted(o.impl, g_impl_names[impl]) &&
                    impl_wanted(o.expert_dw, g_dw_names[dw]) &&
                    (dw != MOE_DW_ACT || impl == MOE_EXPERTS_KERNEL))
                    for (int f = 0; f < 4; f++) { /* the fused permutation: our kernel only */
                        g_bf16_ms = -1;
                        /* bf16, fp8-unfused, fp8-bf16wgrad, fp8, then fp8-wgrad (lowp.h
                         * refuses the fused permutation) */
                        const int order[5] = {0, 2, 4, 1, 3};
                        for (int j = 0; j < 5; j++) {
                            const int p = order[j];
                            if (!(fuse[f] && (!f || impl == MOE_EXPERTS_KERNEL) &&
                                  prec[p] && !(p && f)))
                                continue;
                            /* fp8-unfused: MOE_FP8_FUSED=0 for this run, fp8-wgrad:
                             * MOE_FP8_WGRAD=1, fp8-bf16wgrad: MOE_FP8_WGRAD=0 (each read
                             * once, when its layer's recipe is made: lowp.c), restored after */
                            static const char *const tags[5] = {
                                "+fp8", "+fp8", "+fp8-unfused", "+fp8-wgrad", "+fp8-bf16wgrad"};
                            moe_bench_env env;
                            if (p == 2)
                                env = moe_bench_env_set("MOE_FP8_FUSED", "0");
                            if (p >= 3)
                                env = moe_bench_env_set("MOE_FP8_WGRAD", p == 3 ? "1" : "0");
                            g_fp8_tag = tags[p];
                            fails += run_shape(be, s, &o, (moe_expert_impl)impl,
                                               (moe_dw_mode)dw, f, p != 0);
                            if (p >= 2)
                                moe_bench_env_restore(&env);
                        }
                    }
    }
    return fails ? 1 : 0;
}
