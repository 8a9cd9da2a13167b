/*
 * Chapter 05's native FP8 expert layer (lib/lowp.h, lib/mlp.c): the routed experts' forward
 * and dgrad GEMMs in our FP8 grouped kernel on FP8 codes, wgrad in bf16 on the dequantized
 * operands or (MOE_FP8_WGRAD, lib/fp8_wgrad.h; both are run) in the FP8 wgrad kernel on
 * token-wise codes, against the emulated recipe on the CPU (quantize → dequantize → fp32
 * GEMMs, the wgrad's operands QDQ'd as the native path quantizes them) — the same
 * quantization points, so the two differ only by the GPU's bf16 activations and its
 * summation order.
 *
 * First its two quantizers, byte for byte against the CPU (no tolerance): the 1×128 quantizer
 * of bf16 activations (codes, scales and the dequantized bf16 copy, which must equal
 * moe_cpu_qdq rounded to bf16) and the fused per-expert quantize+transpose of the bf16 expert
 * weights (codes, transposed codes and both scale grids, each expert as
 * moe_cpu_quant_blockwise_t). Then the grouped SwiGLU MLP forward and backward on ragged
 * groups (empty ones, a single row, sizes around 128, a last group ending mid-tile, 40
 * groups), every output poisoned first; the saved SwiGLU output in a buffer of the size the
 * model gives it (moe_mlp_act_bytes(): its FP8 codes and scales alone under the fused passes,
 * which must run there, and give the separate passes' bits). Under the FP8 wgrad the fused
 * passes run as well (the fused SwiGLU ops counted, in their y_raw form: they keep the bf16
 * output and dgu), on a bf16 `act`, and must give MOE_FP8_FUSED=0's bits too (passed on an
 * H100 at 3d50c58).
 *
 * The bound. The GPU rounds fc1's output and the SwiGLU to bf16 (the CPU keeps fp32), and the
 * next quantizer then picks the neighbouring E4M3 code for the few elements that sit near a
 * midpoint: about 1 % of relative error per GEMM, which the GPU's EMULATED path has as well.
 * So each output's worst-group relative error is printed for the native path and for the
 * GPU's emulation, and the native one must stay within 1.5× the emulation's + 0.01 and
 * below 0.06 (a wrong index, scale or transpose is O(1)).
 * Without a GPU the runner (tests/gpu_main.c) prints "skipped: no GPU"; on a GPU that is not
 * Hopper this suite says "skipped: not a Hopper GPU".
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cuda_ops.h"
#include "helpers.h"
#include "lowp.h"
#include "mlp.h"
#include "suites.h"
#include "trainer.h"

static int hopper(const char *what) {
    if (moe_cuda_grouped_sm90_available())
        return 1;
    printf("  %s: skipped: not a Hopper GPU (our FP8 grouped kernel is sm_90a only)\n", what);
    return 0;
}

/* the blockwise E4M3 recipe with power-of-two scales, as --fp8-format e4m3 --fp8-recipe
 * blockwise gives it, with buffers for @p cap elements on @p be */
static void lowp_blockwise(moe_lowp *lp, const moe_backend *be, size_t cap) {
    moe_config c;
    moe_config_defaults(&c);
    snprintf(c.fp8_format, sizeof c.fp8_format, "e4m3");
    snprintf(c.fp8_recipe, sizeof c.fp8_recipe, "blockwise");
    moe_error err;
    ck_assert_int_eq(moe_lowp_from_config(lp, &c, &err), MOE_OK);
    ck_assert(lp->spec[MOE_LOWP_ACTIVATION].pow2 == 1);
    ck_assert(moe_lowp_alloc(be, lp, cap));
}

/* a device buffer of @p bytes filled with 0xAB */
static void *dpoison(size_t bytes) {
    void *h = malloc(bytes);
    ck_assert_ptr_nonnull(h);
    memset(h, 0xAB, bytes);
    void *d = moe_cuda_alloc(bytes);
    moe_cuda_from_host(d, h, bytes);
    free(h);
    return d;
}

/* the device bytes equal the host's */
static int same(const char *what, const void *dev, const void *host, size_t bytes) {
    unsigned char *got = malloc(bytes);
    moe_cuda_to_host(got, dev, bytes);
    size_t diff = 0, first = 0;
    for (size_t i = 0; i < bytes; i++)
        if (got[i] != ((const unsigned char *)host)[i] && diff++ == 0)
            first = i;
    if (diff)
        printf("  %s: %zu of %zu bytes differ; the first at byte %zu: 0x%02x, want 0x%02x\n",
               what, diff, bytes, first, got[first], ((const unsigned char *)host)[first]);
    free(got);
    return diff == 0;
}

START_TEST(test_gpu_fp8_layer_quantizers) {
    if (!hopper("FP8 layer quantizers"))
        return;
    const moe_backend *g = moe_backend_cuda();
    moe_error err;
    /* activations: 300 rows (not a multiple of anything) × 384 */
    const int R = 300, C = 384, nb = C / 128;
    const size_t n = (size_t)R * C;
    moe_real *x = malloc(sizeof(moe_real) * n);
    void *dx = moe_test_upload(g, x, n, 71, 3.0);
    x[5] = 0; /* (a few exact values among the normals) */
    g->write_act(dx, x, n);
    uint8_t *q = malloc(n), *dq = dpoison(n);
    float *s = malloc(sizeof(float) * R * nb), *ds = dpoison(sizeof(float) * R * nb);
    void *dy = dpoison(2 * n), *want = g->alloc(2 * n);
    float *xf = malloc(sizeof(float) * n), *yf = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++)
        xf[i] = (float)x[i];
    ck_assert_int_eq(moe_cpu_quant_blockwise(q, s, xf, R, C, MOE_FP8_E4M3, 0, 1, &err), MOE_OK);
    ck_assert_int_eq(moe_cpu_dequant_blockwise(yf, q, s, R, C, MOE_FP8_E4M3, 0, &err), MOE_OK);
    for (size_t i = 0; i < n; i++)
        x[i] = yf[i];
    g->write_act(want, x, n); /* the CPU's QDQ, rounded to bf16 */
    unsigned char *hwant = malloc(2 * n);
    moe_cuda_to_host(hwant, want, 2 * n);
    ck_assert_int_eq(g->fp8_quant_act(dq, ds, dy, dx, R, C, MOE_FP8_E4M3, 1, &err), MOE_OK);
    ck_assert(same("1x128 codes", dq, q, n));
    ck_assert(same("1x128 scales", ds, s, sizeof(float) * R * nb));
    ck_assert(same("1x128 dequantized bf16", dy, hwant, 2 * n));
    /* chapter 05's FP8 dispatch: the received codes and scales (here the CPU's, on the
     * device) dequantized to bf16 are the QDQ's bytes; a fresh poisoned output */
    void *dy2 = dpoison(2 * n);
    ck_assert_int_eq(g->fp8_dequant_act(dy2, dq, ds, R, C, MOE_FP8_E4M3, &err), MOE_OK);
    ck_assert(same("1x128 dequantize to bf16 (FP8 dispatch)", dy2, hwant, 2 * n));
    g->free(dy2);
    /* weights: 3 experts of [256, 384], each with its transpose */
    const int G = 3, O = 256, I = 384, ns = (O / 128) * (I / 128);
    const size_t nw = (size_t)G * O * I;
    moe_real *w = malloc(sizeof(moe_real) * nw);
    void *dw = moe_test_upload(g, w, nw, 72, 0.05);
    float *wf = malloc(sizeof(float) * nw);
    for (size_t i = 0; i < nw; i++)
        wf[i] = (float)w[i];
    uint8_t *wq = malloc(nw), *wqt = malloc(nw);
    float *ws = malloc(sizeof(float) * G * ns), *wst = malloc(sizeof(float) * G * ns);
    for (int e = 0; e < G; e++)
        ck_assert_int_eq(moe_cpu_quant_blockwise_t(wq + (size_t)e * O * I, ws + (size_t)e * ns,
                                                   wqt + (size_t)e * O * I, wst + (size_t)e * ns,
                                                   wf + (size_t)e * O * I, O, I, MOE_FP8_E4M3, 1,
                                                   1, &err),
                         MOE_OK);
    moe_lowp lp;
    lowp_blockwise(&lp, g, 1024);
    moe_fp8_weight fw;
    ck_assert(moe_fp8_weight_alloc(g, &fw, G, O, I));
    uint8_t *p = malloc(nw);
    memset(p, 0xAB, nw);
    moe_cuda_from_host(fw.q, p, nw);
    moe_cuda_from_host(fw.qt, p, nw);
    moe_cuda_from_host(fw.s, p, sizeof(float) * G * ns);
    moe_cuda_from_host(fw.st, p, sizeof(float) * G * ns);
    moe_lowp_quantize_experts(g, &lp, &fw, dw, G, O, I, 0, 1);
    ck_assert(same("weight codes", fw.q, wq, nw));
    ck_assert(same("weight scales", fw.s, ws, sizeof(float) * G * ns));
    ck_assert(same("transposed weight codes", fw.qt, wqt, nw));
    ck_assert(same("transposed weight scales", fw.st, wst, sizeof(float) * G * ns));
    printf("  FP8 layer quantizers: 1x128 of bf16 [%d, %d] (codes, scales, QDQ bytes) and %d "
           "experts' [%d, %d] weights with their transposes: CUDA == CPU byte for byte\n",
           R, C, G, O, I);
    moe_fp8_weight_free(g, &fw);
    moe_lowp_free(g, &lp);
    free(x), free(q), free(s), free(xf), free(yf), free(hwant), free(w), free(wf), free(wq);
    free(wqt), free(ws), free(wst), free(p);
    g->free(dx), g->free(dq), g->free(ds), g->free(dy), g->free(want), g->free(dw);
}
END_TEST

/* relative Frobenius error of rows off[e] .. off[e+1] of a [*, cols] tensor, worst group */
static double worst_group(const moe_real *a, const moe_real *b, const int *off, int G, int cols) {
    double worst = 0;
    for (int e = 0; e < G; e++) {
        double num = 0, den = 0;
        for (size_t i = (size_t)off[e] * cols; i < (size_t)off[e + 1] * cols; i++) {
            num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
            den += (double)b[i] * b[i];
        }
        const double r = isfinite(num) ? sqrt(num / (den > 0 ? den : 1e-30)) : INFINITY;
        worst = r > worst ? r : worst;
    }
    return worst;
}

static double rel_all(const moe_real *a, const moe_real *b, size_t n) {
    const int off[2] = {0, 1};
    return worst_group(a, b, off, 1, (int)n);
}

enum { OUT, DX, DROW, DW1, DW2, NOUT };

/* run_mlp() calls that ran the fused passes (`act` sized for the FP8 codes alone, or in bf16
 * under the FP8 wgrad) */
static int g_fused_runs;
/* ... of which those that kept x's token-wise copy and poisoned x before the backward */
static int g_x_t_runs;

/* the fused SwiGLU ops that really ran, [0 forward, 1 backward][y_raw]: the CUDA backend's
 * ops, counted (counting_cuda()), so a test sees which arrangement ran and not only which
 * one moe_mlp_fp8_fused() promised */
static int g_swiglu_q[2][2];
static int g_swiglu_bwd_t; /* ... and the tiled backward (the FP8 wgrad's, MOE_FP8_FUSED_T) */
static int g_swiglu_fwd_t; /* ... and the tiled forward (the FP8 wgrad's, MOE_FP8_SAVE_T) */

static moe_status counted_swiglu_fwd_t(uint8_t *q, float *s, uint8_t *qt, float *st,
                                       const void *gu, const moe_real *row_scale,
                                       const int *dev_off, int G, int N, int F, size_t kpad,
                                       moe_fp8_format f, int pow2, moe_error *err) {
    g_swiglu_fwd_t++;
    return moe_backend_cuda()->fp8_swiglu_forward_quant_t(q, s, qt, st, gu, row_scale, dev_off,
                                                          G, N, F, kpad, f, pow2, err);
}

static moe_status counted_swiglu_fwd_q(uint8_t *q, float *s, void *y, int y_raw, const void *gu,
                                       const moe_real *row_scale, int N, int F, moe_fp8_format f,
                                       int pow2, moe_error *err) {
    g_swiglu_q[0][y_raw != 0]++;
    return moe_backend_cuda()->fp8_swiglu_forward_quant(q, s, y, y_raw, gu, row_scale, N, F, f,
                                                        pow2, err);
}

static moe_status counted_swiglu_bwd_q(uint8_t *q, float *s, void *y, int y_raw,
                                       moe_real *drow_scale, const void *dout, const void *gu,
                                       const moe_real *row_scale, int N, int F, moe_fp8_format f,
                                       int pow2, moe_error *err) {
    g_swiglu_q[1][y_raw != 0]++;
    return moe_backend_cuda()->fp8_swiglu_backward_quant(q, s, y, y_raw, drow_scale, dout, gu,
                                                         row_scale, N, F, f, pow2, err);
}

static moe_status counted_swiglu_bwd_t(uint8_t *q, float *s, uint8_t *qt, float *st, float *part,
                                       moe_real *drow_scale, const void *dout, const void *gu,
                                       const moe_real *row_scale, const int *dev_off, int G,
                                       int N, int F, size_t kpad, moe_fp8_format f, int pow2,
                                       moe_error *err) {
    g_swiglu_bwd_t++;
    return moe_backend_cuda()->fp8_swiglu_backward_quant_t(q, s, qt, st, part, drow_scale, dout,
                                                           gu, row_scale, dev_off, G, N, F, kpad,
                                                           f, pow2, err);
}

/* the CUDA backend with its fused SwiGLU ops counted in g_swiglu_q, g_swiglu_bwd_t and
 * g_swiglu_fwd_t */
static const moe_backend *counting_cuda(void) {
    static moe_backend b;
    b = *moe_backend_cuda();
    b.fp8_swiglu_forward_quant = counted_swiglu_fwd_q;
    b.fp8_swiglu_backward_quant = counted_swiglu_bwd_q;
    b.fp8_swiglu_backward_quant_t = counted_swiglu_bwd_t;
    b.fp8_swiglu_forward_quant_t = counted_swiglu_fwd_t;
    return &b;
}
static const char *const g_names[NOUT] = {"output", "dgrad dx", "routing-weight grad",
                                          "wgrad fc1", "wgrad fc2"};

/* One grouped MLP forward + backward on @p be; @p fw NULL: emulated. Writes the five
 * outputs to host buffers @p res (each sized by the caller). */
static void run_mlp(const moe_backend *be, moe_lowp *lp, const moe_fp8_weight *fw, const int *off,
                    int G, int H, int F, const moe_real *hx, const moe_real *hw1,
                    const moe_real *hw2, const moe_real *hrs, const moe_real *hdy,
                    moe_real *res[NOUT]) {
    const int N = off[G];
    const size_t S = be->act_size, n1 = (size_t)G * 2 * F * H, n2 = (size_t)G * H * F;
    void *x = be->alloc(S * N * H), *w1 = be->alloc(S * n1), *w2 = be->alloc(S * n2);
    void *dy = be->alloc(S * N * H);
    moe_real *rs = be->alloc(sizeof(moe_real) * N), *drs = be->alloc(sizeof(moe_real) * N);
    be->write_act(x, hx, (size_t)N * H);
    be->write_act(w1, hw1, n1);
    be->write_act(w2, hw2, n2);
    be->write_act(dy, hdy, (size_t)N * H);
    be->from_host(rs, hrs, sizeof(moe_real) * N);
    be->zero(drs, sizeof(moe_real) * N); /* (accumulates) */
    if (!fw) { /* the emulation quantizes the compute copy in place */
        moe_lowp_quantize_experts(be, lp, NULL, w1, G, 2 * F, H, 0, 1);
        moe_lowp_quantize_experts(be, lp, NULL, w2, G, H, F, 0, 1);
    }
    int *doff = be->alloc(sizeof(int) * (G + 1));
    be->from_host(doff, off, sizeof(int) * (G + 1));
    /* outputs and scratch poisoned (fp32 NaN bit patterns, or bf16 0xFFFF); the saved SwiGLU
     * output at the size the model gives it (FP8 codes and scales under the fused passes:
     * moe_mlp_act_bytes()), so a pass writing bf16 there would run past its end */
    moe_groups grp = {off, doff, G, MOE_EXPERTS_KERNEL, MOE_DW_STORE, NULL, 1, N, lp,
                      fw, fw ? fw + 1 : NULL, 0, 0, NULL, NULL, NULL, NULL, 0};
    /* in the token-wise form the layer keeps x's token-wise copy too, as the local
     * dispatcher's layer does (moe_layer_keeps_x_t()), after the SwiGLU output's */
    const moe_mlp_saved form = moe_mlp_saved_form(be, lp);
    const int fused = moe_mlp_fp8_fused(be, &grp);
    grp.keep_x_t = fused && form == MOE_MLP_SAVED_FP8_TOKEN;
    const size_t act_bytes = moe_mlp_act_bytes(be, lp, (size_t)N, G, F, grp.keep_x_t ? H : 0);
    void *out = be->alloc(S * N * H), *gu = be->alloc(S * N * 2 * F), *act = be->alloc(act_bytes);
    void *dx = be->alloc(S * N * H), *dh = be->alloc(S * N * F), *dgu = be->alloc(S * N * 2 * F);
    moe_real *dw1 = be->alloc(sizeof(moe_real) * n1), *dw2 = be->alloc(sizeof(moe_real) * n2);
    void *const poison[] = {out, gu, act, dx, dh, dgu, dw1, dw2};
    const size_t pbytes[] = {S * N * H, S * N * 2 * F, act_bytes, S * N * H, S * N * F,
                             S * N * 2 * F, sizeof(moe_real) * n1, sizeof(moe_real) * n2};
    for (int i = 0; i < 8; i++) {
        unsigned char *h = malloc(pbytes[i] ? pbytes[i] : 1);
        memset(h, 0xFF, pbytes[i]);
        be->from_host(poison[i], h, pbytes[i]);
        free(h);
    }
    /* the buffer's size and the path agree: FP8 exactly where the fused passes run, the
     * row-wise codes without the FP8 wgrad, under it the token-wise copies (the tiled
     * forward, MOE_FP8_SAVE_T: the SwiGLU output's and x's) or else the bf16 output (its
     * token-wise copy's source) */
    ck_assert_int_eq(moe_mlp_fp8_saves_codes(be, lp), fused && form != MOE_MLP_SAVED_ACT);
    if (fused) {
        if (form == MOE_MLP_SAVED_FP8_TOKEN) {
            ck_assert(lp->fp8_wgrad && lp->fp8_save_t);
            ck_assert_uint_eq(act_bytes, moe_mlp_fp8_act_t_bytes((size_t)N, G, F) +
                                             moe_mlp_fp8_act_t_bytes((size_t)N, G, H));
        } else if (lp->fp8_wgrad) {
            ck_assert(!lp->fp8_save_t);
            ck_assert_uint_eq(act_bytes, S * N * F);
        } else {
            ck_assert_uint_eq(act_bytes, (size_t)N * F + (size_t)N * (F / 128) * sizeof(float));
            ck_assert(N == 0 || act_bytes < S * N * F);
        }
        g_fused_runs++;
    }
    moe_mlp_forward_grouped(be, out, gu, act, x, rs, w1, w2, &grp, H, F);
    if (grp.keep_x_t) { /* x is not kept: poisoned before the backward, which must read its
                         * copy (a read of x would put NaN in dw1) */
        unsigned char *h = malloc(S * N * H + 1);
        memset(h, 0xFF, S * N * H);
        be->from_host(x, h, S * N * H);
        free(h);
        g_x_t_runs++;
    }
    moe_mlp_backward_grouped(be, dx, dw1, dw2, drs, dy, x, gu, act, rs, w1, w2, dh, dgu, &grp, H,
                             F, 0);
    be->read_act(res[OUT], out, (size_t)N * H);
    be->read_act(res[DX], dx, (size_t)N * H);
    be->to_host(res[DROW], drs, sizeof(moe_real) * N);
    be->to_host(res[DW1], dw1, sizeof(moe_real) * n1);
    be->to_host(res[DW2], dw2, sizeof(moe_real) * n2);
    void *const all[] = {x, w1, w2, dy, rs, drs, doff, out, gu, act, dx, dh, dgu, dw1, dw2};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        be->free(all[i]);
}

static int check_layer(const int *sizes, int G, int H, int F, int wgrad) {
    const moe_backend *g = moe_backend_cuda(), *c = moe_backend_cpu();
    int off[65];
    off[0] = 0;
    for (int e = 0; e < G; e++)
        off[e + 1] = off[e] + sizes[e];
    const int N = off[G];
    const size_t n1 = (size_t)G * 2 * F * H, n2 = (size_t)G * H * F;
    const size_t cnt[NOUT] = {(size_t)N * H, (size_t)N * H, (size_t)N, n1, n2};
    /* inputs rounded to bf16, so both sides start from the same values */
    moe_real *x = malloc(sizeof(moe_real) * N * H), *w1 = malloc(sizeof(moe_real) * n1);
    moe_real *w2 = malloc(sizeof(moe_real) * n2), *dy = malloc(sizeof(moe_real) * N * H);
    moe_real *rs = malloc(sizeof(moe_real) * (N + 1));
    g->free(moe_test_upload(g, x, (size_t)N * H, 81, 1.0));
    g->free(moe_test_upload(g, w1, n1, 82, 0.05));
    g->free(moe_test_upload(g, w2, n2, 83, 0.05));
    g->free(moe_test_upload(g, dy, (size_t)N * H, 84, 1.0));
    for (int i = 0; i < N; i++)
        rs[i] = (moe_real)(0.25 + 0.5 * ((i * 37) % 101) / 101.0);
    moe_real *ref[NOUT], *nat[NOUT], *emu[NOUT], *unf[NOUT], *again[NOUT], *rw[NOUT];
    for (int k = 0; k < NOUT; k++) {
        ref[k] = malloc(sizeof(moe_real) * (cnt[k] + 1));
        nat[k] = malloc(sizeof(moe_real) * (cnt[k] + 1));
        emu[k] = malloc(sizeof(moe_real) * (cnt[k] + 1));
        unf[k] = malloc(sizeof(moe_real) * (cnt[k] + 1));
        again[k] = malloc(sizeof(moe_real) * (cnt[k] + 1));
        rw[k] = malloc(sizeof(moe_real) * (cnt[k] + 1));
    }
    const size_t cap = (size_t)(N > 2 * F ? N : 2 * F) * (H > 2 * F ? H : 2 * F);
    moe_lowp lc, lg, le;
    lowp_blockwise(&lc, c, cap);
    lowp_blockwise(&lg, g, cap);
    lowp_blockwise(&le, g, cap);
    ck_assert(moe_lowp_native(g, &lg));
    /* the wgrad's operands: token-wise (the FP8 wgrad, lib/fp8_wgrad.h) or row-wise (bf16),
     * the same on all three sides whatever MOE_FP8_WGRAD says */
    lc.fp8_wgrad = lg.fp8_wgrad = le.fp8_wgrad = wgrad;
    ck_assert(moe_lowp_alloc_fp8_wgrad(g, &lg, off[G], G, 2 * F + H));
    moe_fp8_weight fw[2];
    ck_assert(moe_fp8_weight_alloc(g, &fw[0], G, 2 * F, H));
    ck_assert(moe_fp8_weight_alloc(g, &fw[1], G, H, F));
    lg.native = 1; /* as the model sets it, with its FP8 weights (lowp.h) */
    { /* the native path's FP8 weights, from the bf16 weights on the device */
        void *d1 = g->alloc(2 * n1), *d2 = g->alloc(2 * n2);
        g->write_act(d1, w1, n1);
        g->write_act(d2, w2, n2);
        moe_lowp_quantize_experts(g, &lg, &fw[0], d1, G, 2 * F, H, 0, 1);
        moe_lowp_quantize_experts(g, &lg, &fw[1], d2, G, H, F, 0, 1);
        g->free(d1), g->free(d2);
    }
    run_mlp(c, &lc, NULL, off, G, H, F, x, w1, w2, rs, dy, ref);
    run_mlp(g, &lg, fw, off, G, H, F, x, w1, w2, rs, dy, nat);
    run_mlp(g, &le, NULL, off, G, H, F, x, w1, w2, rs, dy, emu);
    /* the fused passes (lib/mlp.c, MOE_FP8_FUSED) against the separate ones: the same bits,
     * provided the GEMMs repeat themselves bit for bit (checked by running fused twice) */
    /* (the switches are the context's, latched from MOE_FP8_FUSED, MOE_FP8_FUSED_T and
     * MOE_FP8_SAVE_T when it is made: set here on lg as a model made with them would have
     * them). Under the FP8 wgrad the fused passes run too, in two forms: tiled, the forward
     * keeping the SwiGLU output's token-wise copy (fp8_save_t) and the backward writing
     * dgu's (fp8_fused_t): nat and again; and row-wise, both passes writing the bf16 output
     * and dgu (y_raw) for the token-wise quantizer, the output kept in bf16 (rw). The fused
     * ops must have run, in those forms, as many times as asked */
    const moe_backend *cg = counting_cuda();
    lg.fp8_fused = 1;
    lg.fp8_fused_t = 1;
    lg.fp8_save_t = 1;
    ck_assert(moe_mlp_fp8_fused(cg, &(moe_groups){.fp8_w1 = &fw[0], .fp8_w2 = &fw[1],
                                                   .lowp = &lg}));
    const int fused_before = g_fused_runs, t0 = g_swiglu_bwd_t, f0 = g_swiglu_fwd_t,
              x0 = g_x_t_runs;
    int q0[2][2];
    memcpy(q0, g_swiglu_q, sizeof q0);
    run_mlp(cg, &lg, fw, off, G, H, F, x, w1, w2, rs, dy, nat);
    run_mlp(cg, &lg, fw, off, G, H, F, x, w1, w2, rs, dy, again);
    if (wgrad) { /* the row-wise fused passes (MOE_FP8_FUSED_T=0, MOE_FP8_SAVE_T=0) */
        lg.fp8_fused_t = 0;
        lg.fp8_save_t = 0;
        run_mlp(cg, &lg, fw, off, G, H, F, x, w1, w2, rs, dy, rw);
    }
    const int runs = wgrad ? 3 : 2, rowwise = wgrad ? 1 : 2; /* (the row-wise ops' runs) */
    ck_assert_int_eq(g_fused_runs - fused_before, runs); /* they ran on `act` of the right size */
    ck_assert_int_eq(g_swiglu_q[0][wgrad] - q0[0][wgrad], rowwise);
    ck_assert_int_eq(g_swiglu_q[0][!wgrad] - q0[0][!wgrad], 0);
    ck_assert_int_eq(g_swiglu_q[1][wgrad] - q0[1][wgrad], rowwise);
    ck_assert_int_eq(g_swiglu_q[1][!wgrad] - q0[1][!wgrad], 0);
    ck_assert_int_eq(g_swiglu_bwd_t - t0, wgrad ? 2 : 0);
    ck_assert_int_eq(g_swiglu_fwd_t - f0, wgrad ? 2 : 0);
    lg.fp8_fused = 0;
    run_mlp(cg, &lg, fw, off, G, H, F, x, w1, w2, rs, dy, unf);
    ck_assert_int_eq(g_fused_runs - fused_before, runs);
    for (int dir = 0; dir < 2; dir++) /* the separate passes: no fused op since those */
        ck_assert_int_eq(g_swiglu_q[dir][0] + g_swiglu_q[dir][1] - q0[dir][0] - q0[dir][1],
                         rowwise);
    ck_assert_int_eq(g_swiglu_bwd_t - t0, wgrad ? 2 : 0);
    ck_assert_int_eq(g_swiglu_fwd_t - f0, wgrad ? 2 : 0);
    /* the tiled forms kept x's copy (nat, again), and their backward never read x: the
     * row-wise and separate passes (rw, unf), which read x, give the same bits below */
    ck_assert_int_eq(g_x_t_runs - x0, wgrad ? 2 : 0);
    int ok = 1;
    /* every output bit for bit, but the tiled backward's routing-weight gradient: its sum
     * over F runs in 128-channel blocks, so it agrees to fp32 rounding */
    for (int form = 0; form < (wgrad ? 2 : 1); form++) {
        moe_real *const *fz = form ? rw : nat;
        for (int k = 0; k < NOUT; k++) {
            const int repeat = memcmp(nat[k], again[k], sizeof(moe_real) * cnt[k]) == 0;
            const int rounding = wgrad && !form && k == DROW;
            size_t diff = 0, first = cnt[k];
            double worst = 0, big = 0;
            for (size_t i = 0; i < cnt[k]; i++) {
                big = fmax(big, fabs((double)unf[k][i]));
                if (memcmp(&fz[k][i], &unf[k][i], sizeof(moe_real)) != 0) {
                    diff++;
                    first = first == cnt[k] ? i : first;
                    const double d = fabs((double)fz[k][i] - (double)unf[k][i]);
                    worst = d > worst || d != d ? d : worst;
                }
            }
            if (rounding) { /* within fp32 rounding of the largest, not bit for bit */
                const int pass = !(worst > 1e-5 * big) && worst == worst;
                printf("  FP8 layer %s, tiled backward vs separate passes: %zu of %zu differ, "
                       "max |diff| %.3g = %.2g of the largest (bound 1e-5)%s\n",
                       g_names[k], diff, cnt[k], worst, big > 0 ? worst / big : 0.0,
                       pass ? "" : " TOO LARGE");
                ok &= pass;
                continue;
            }
            if (diff)
                printf("  FP8 layer %s: fused (%s) vs separate passes: %zu of %zu differ, first "
                       "at %zu (fused %.9g, separate %.9g), max |diff| %.3g%s\n",
                       g_names[k], form ? "row-wise" : "default", diff, cnt[k], first,
                       (double)fz[k][first], (double)unf[k][first], worst,
                       repeat ? "" : " (but the fused run does not repeat itself either: "
                                    "not counted as a failure)");
            ok &= !diff || !repeat;
        }
    }
    printf("  FP8 layer G=%d rows=%d: fused quantize passes == separate passes: %s%s", G, N,
           ok ? "bit for bit" : "DIFFER",
           wgrad ? " (FP8 wgrad: tiled, the forward keeping the SwiGLU output's token-wise copy "
                   "and the backward writing dgu's; and row-wise, keeping the bf16 output and "
                   "dgu)\n"
                 : "");
    if (!wgrad) /* the fused runs kept the SwiGLU output in a buffer of the codes' size */
        printf(", the SwiGLU output kept in %zu bytes (bf16: %zu)\n",
               moe_mlp_fp8_act_bytes((size_t)N, F), (size_t)2 * N * F);
    printf("  FP8 layer G=%d rows=%d H=%d F=%d, %s wgrad, relative error vs the CPU's "
           "emulation (native | GPU emulated):", G, N, H, F, wgrad ? "FP8" : "bf16");
    for (int k = 0; k < NOUT; k++) {
        const int per_row = k == OUT || k == DX;
        const double en = per_row ? worst_group(nat[k], ref[k], off, G, H)
                                  : rel_all(nat[k], ref[k], cnt[k]);
        const double ee = per_row ? worst_group(emu[k], ref[k], off, G, H)
                                  : rel_all(emu[k], ref[k], cnt[k]);
        const int pass = en <= 1.5 * ee + 0.01 && en <= 0.06;
        printf(" %s %.2e | %.2e%s;", g_names[k], en, ee, pass ? "" : " TOO LARGE");
        ok &= pass;
    }
    printf("\n");
    for (int k = 0; k < NOUT; k++)
        free(ref[k]), free(nat[k]), free(emu[k]), free(unf[k]), free(again[k]), free(rw[k]);
    moe_fp8_weight_free(g, &fw[0]), moe_fp8_weight_free(g, &fw[1]);
    moe_lowp_free(c, &lc), moe_lowp_free(g, &lg), moe_lowp_free(g, &le);
    free(x), free(w1), free(w2), free(dy), free(rs);
    return ok;
}

/* the native FP8 expert MLP against the CPU's emulation, on ragged groups */
START_TEST(test_gpu_fp8_layer_vs_cpu) {
    if (!hopper("FP8 layer"))
        return;
    static const int s0[] = {0, 1, 127, 128, 129, 0, 255, 64};  /* around 128, empty, one row */
    static const int s1[] = {1, 0, 0};                          /* one row in all */
    static int s2[40];                                          /* many groups */
    for (int e = 0; e < 40; e++)
        s2[e] = e % 7 == 3 ? 0 : (e * 53) % 190; /* 0 to 189 rows */
    int ok = 1;
    for (int wgrad = 0; wgrad < 2; wgrad++) { /* MOE_FP8_WGRAD=0, then 1 */
        ok &= check_layer(s0, 8, 256, 384, wgrad);
        ok &= check_layer(s1, 3, 128, 128, wgrad);
        ok &= check_layer(s2, 40, 256, 128, wgrad);
    }
    ck_assert_msg(ok, "the native FP8 expert layer differs from the CPU's emulation");
}
END_TEST

/* The whole model with the native FP8 path (--fp8-format e4m3 --fp8-recipe blockwise, our
 * grouped kernel): with the fused passes its MoE layers keep the SwiGLU output as FP8 codes in
 * buffers of that size (moe_mlp_act_bytes(); experts.c asserts at every step that the fused
 * passes run on them), and its training losses are those of MOE_FP8_FUSED=0 bit for bit,
 * provided the fused run repeats itself (checked by running it twice). Passed on an H100
 * (ad0b47d, and with the FP8 wgrad's arrangement at 3d50c58). */
#define FP8_MODEL                                                                               \
    "--num-layers 2 --hidden-size 128 --num-attention-heads 4 --num-query-groups 4 "           \
    "--seq-length 64 --micro-batch-size 8 --global-batch-size 16 --num-experts 8 "             \
    "--moe-ffn-hidden-size 128 --ffn-hidden-size 256 --moe-layer-freq 0,1 --lr 2e-3 "          \
    "--lr-warmup-iters 2 --train-iters 6 --fp8-format e4m3 --fp8-recipe blockwise "            \
    "--moe-expert-backend grouped --device cuda"
enum { FP8_STEPS = 6 };

/* FP8_STEPS training losses of the FP8_MODEL under MOE_FP8_FUSED=@p fused,
 * MOE_FP8_WGRAD=@p wgrad, MOE_FP8_SAVE_T=@p save_t and MOE_FP8_FUSED_T=@p fused_t; 1 when its
 * MoE layers kept the SwiGLU output as FP8 codes (either form) */
static int fp8_model_losses_of(const char *flags, const char *fused, const char *wgrad,
                               const char *save_t, const char *fused_t, double *loss,
                               long long *fp8_act);

static int fp8_model_losses(const char *fused, const char *wgrad, const char *save_t,
                            const char *fused_t, double *loss, long long *fp8_act) {
    return fp8_model_losses_of(FP8_MODEL, fused, wgrad, save_t, fused_t, loss, fp8_act);
}

/* ... of the model @p flags */
static int fp8_model_losses_of(const char *flags, const char *fused, const char *wgrad,
                               const char *save_t, const char *fused_t, double *loss,
                               long long *fp8_act) {
    moe_bench_env env = moe_bench_env_set("MOE_FP8_FUSED", fused);
    moe_bench_env wg = moe_bench_env_set("MOE_FP8_WGRAD", wgrad);
    moe_bench_env st = moe_bench_env_set("MOE_FP8_SAVE_T", save_t);
    moe_bench_env ft = moe_bench_env_set("MOE_FP8_FUSED_T", fused_t);
    moe_trainer *t = moe_test_trainer(flags, NULL, 1);
    moe_bench_env_restore(&env); /* (latched by the model: lowp.h) */
    moe_bench_env_restore(&wg);
    moe_bench_env_restore(&st);
    moe_bench_env_restore(&ft);
    const moe_model *m = t->model;
    ck_assert(m->lowp && m->lowp->native);
    ck_assert_int_eq(m->lowp->fp8_wgrad, *wgrad == '1');
    /* the fused passes run where the latch says (lib/mlp.c: the FP8 wgrad no longer stops
     * them), on the model's FP8 expert weights */
    ck_assert_ptr_nonnull(m->fp8w[2].q); /* layer 1, the MoE one: fc1, fc2 (model.c) */
    ck_assert_int_eq(moe_mlp_fp8_fused(m->be, &(moe_groups){.fp8_w1 = &m->fp8w[2],
                                                             .fp8_w2 = &m->fp8w[3],
                                                             .lowp = m->lowp}),
                     *fused == '1');
    const int codes = moe_mlp_fp8_saves_codes(m->be, m->lowp);
    /* the token-wise form keeps the experts' input as its token-wise copy too, and the
     * permuted rows are scratch (moe_layer_keeps_x_t()): the runs below compare its losses
     * with those of the forms that keep the rows */
    ck_assert_int_eq(moe_model_keeps_x_t(m), *fused == '1' && *wgrad == '1' && *save_t == '1');
    *fp8_act = m->mem.fp8_act_bytes;
    for (int s = 0; s < FP8_STEPS; s++)
        loss[s] = moe_test_step(t);
    moe_trainer_free(t);
    return codes;
}

START_TEST(test_gpu_fp8_model_fused_saved_codes) {
    if (!hopper("FP8 model, saved SwiGLU output in FP8"))
        return;
    double fused[FP8_STEPS], again[FP8_STEPS], sep[FP8_STEPS];
    long long act_fused, act_sep, act_again;
    ck_assert(fp8_model_losses("1", "0", "1", "0", fused, &act_fused));
    ck_assert(!fp8_model_losses("0", "0", "1", "0", sep, &act_sep));
    ck_assert(fp8_model_losses("1", "0", "1", "0", again, &act_again));
    /* the one MoE layer's N·k = 8·64·2 rows of F = 128: codes + scales in the estimate */
    const long long rows = 8 * 64 * 2;
    ck_assert_int_eq(act_fused, rows * 128 + rows * 4);
    ck_assert_int_eq(act_sep, 0);
    const int repeat = memcmp(fused, again, sizeof fused) == 0;
    const int same = memcmp(fused, sep, sizeof fused) == 0;
    printf("  FP8 model, %d steps: fused passes (SwiGLU output kept in %lld bytes of FP8 codes, "
           "bf16 %lld) %.6f -> %.6f, separate passes %.6f -> %.6f: %s\n", FP8_STEPS, act_fused,
           rows * 128 * 2, fused[0], fused[FP8_STEPS - 1], sep[0], sep[FP8_STEPS - 1],
           same ? "the same bits"
                : repeat ? "DIFFER" : "differ, but the fused run does not repeat itself either");
    ck_assert_msg(same || !repeat, "the fused FP8 model's losses differ from the separate "
                  "passes'");
    ck_assert(fused[FP8_STEPS - 1] < fused[0]);
}
END_TEST

/* ... and with the FP8 wgrad (MOE_FP8_WGRAD=1, the default): the tiled fused forward keeps
 * the SwiGLU output as its token-wise FP8 copy, and the experts' input likewise in place of
 * the permuted rows (MOE_FP8_SAVE_T=1, the default: in the
 * estimate's FP8 line at moe_mlp_fp8_act_t_bytes()), the row-wise fused passes keep it in bf16
 * (MOE_FP8_SAVE_T=0: nothing in the FP8 line), and both give MOE_FP8_FUSED=0's losses bit for
 * bit (the same proviso) with the row-wise backward (MOE_FP8_FUSED_T=0). The tiled backward
 * (MOE_FP8_FUSED_T=1, the default; measured faster: results 05) sums the routing weight's
 * gradient in 128-channel blocks, another order where F > 128, so its losses are held to a
 * relative 1e-4 (a wrong dgu or copy moves them by far more; at this model's F = 128 there is
 * one block and they came out equal; gpu_fp8_fused covers F > 128 at the kernel), and its
 * launches are counted. Passed on an H100 (a6f2b19: the same bits, the bf16 form; 04162aa:
 * the token-wise form; eb6afaa: the MOE_FP8_FUSED_T=1 run, worst relative difference 0 over
 * its steps). */
/* The FP8 model's losses in the tiled form (@p tiled, and @p again: a second run) against the
 * row-wise fused (@p rowwise) and the separate passes (@p sep): the same bits, provided the
 * tiled run repeats itself; @p what names the tiled run in the printed line. And it trains. */
static void tiled_forms_agree(const char *what, const double *tiled, const double *rowwise,
                              const double *again, const double *sep) {
    const size_t bytes = sizeof(double) * FP8_STEPS;
    const int repeat = memcmp(tiled, again, bytes) == 0;
    const int same = memcmp(tiled, sep, bytes) == 0 && memcmp(rowwise, sep, bytes) == 0;
    printf("  FP8 model %s %.6f -> %.6f, row-wise fused %.6f -> %.6f, separate passes %.6f -> "
           "%.6f: %s\n", what, tiled[0], tiled[FP8_STEPS - 1], rowwise[0],
           rowwise[FP8_STEPS - 1], sep[0], sep[FP8_STEPS - 1],
           same ? "the same bits"
                : repeat ? "DIFFER" : "differ, but the fused run does not repeat itself either");
    ck_assert_msg(same || !repeat, "the FP8 model %s: its losses differ from the separate "
                  "passes'", what);
    ck_assert(tiled[FP8_STEPS - 1] < tiled[0]);
}

START_TEST(test_gpu_fp8_model_fused_fp8_wgrad) {
    if (!hopper("FP8 model with the FP8 wgrad, fused passes"))
        return;
    double tiled[FP8_STEPS], rowwise[FP8_STEPS], again[FP8_STEPS], sep[FP8_STEPS];
    double both[FP8_STEPS];
    long long act_tiled, act_row, act_sep, act_again, act_both;
    const long long bwd_t0 = moe_cuda_swiglu_backward_quant_t_calls();
    ck_assert(fp8_model_losses("1", "1", "1", "0", tiled, &act_tiled));
    ck_assert(!fp8_model_losses("1", "1", "0", "0", rowwise, &act_row));
    ck_assert(!fp8_model_losses("0", "1", "1", "0", sep, &act_sep));
    ck_assert(fp8_model_losses("1", "1", "1", "0", again, &act_again));
    const long long bwd_t1 = moe_cuda_swiglu_backward_quant_t_calls();
    ck_assert(fp8_model_losses("1", "1", "1", "1", both, &act_both)); /* the tiled backward */
    /* the pinned runs never launched it, the last one did, at least once a step */
    ck_assert_int_eq(bwd_t1 - bwd_t0, 0);
    ck_assert_int_ge(moe_cuda_swiglu_backward_quant_t_calls() - bwd_t1, FP8_STEPS);
    ck_assert_int_eq(act_both, act_tiled);
    double worst = 0;
    for (int s = 0; s < FP8_STEPS; s++) {
        const double d = fabs(both[s] - sep[s]) / fabs(sep[s]);
        worst = d > worst || d != d ? d : worst;
    }
    printf("  FP8 model with the FP8 wgrad and both tiled passes (MOE_FP8_FUSED_T=1): %.6f -> "
           "%.6f, worst relative difference from the separate passes %.2g (bound 1e-4)\n",
           both[0], both[FP8_STEPS - 1], worst);
    ck_assert_msg(worst <= 1e-4, "the tiled backward's losses are %.3g from the separate passes'",
                  worst);
    /* the one MoE layer's N·k = 8·64·2 rows of F = 128, and of its input (H = 128), in its 8
     * experts' padded blocks */
    const long long t_bytes = 2 * (long long)moe_mlp_fp8_act_t_bytes(8 * 64 * 2, 8, 128);
    ck_assert_int_eq(act_tiled, t_bytes);
    ck_assert_int_eq(act_row, 0);
    ck_assert_int_eq(act_sep, 0);
    char what[160];
    snprintf(what, sizeof what, "with the FP8 wgrad, %d steps: tiled fused passes (SwiGLU output "
             "and input kept as their token-wise copies, %lld bytes; bf16 %d)", FP8_STEPS,
             act_tiled, 2 * 8 * 64 * 2 * 128 * 2);
    tiled_forms_agree(what, tiled, rowwise, again, sep);
}
END_TEST

/* ... and on the expert side: with a capacity the one rank's tokens go through the alltoall
 * dispatcher into expert-side rows (a->xe), which the token-wise form also replaces by their
 * token-wise copy (moe_layer_keeps_x_t(); the rows are the workspace's scratch,
 * moe_layer_xe()). The row-wise fused and the separate passes keep the rows: the same losses
 * bit for bit (the same proviso) with the row-wise backward. */
START_TEST(test_gpu_fp8_model_expert_side_x_t) {
    if (!hopper("FP8 model, expert-side rows kept as their token-wise copy"))
        return;
    const char *flags = FP8_MODEL " --moe-expert-capacity-factor 1.5";
    double tiled[FP8_STEPS], rowwise[FP8_STEPS], again[FP8_STEPS], sep[FP8_STEPS];
    long long act_tiled, act_row, act_sep, act_again;
    ck_assert(fp8_model_losses_of(flags, "1", "1", "1", "0", tiled, &act_tiled));
    ck_assert(!fp8_model_losses_of(flags, "1", "1", "0", "0", rowwise, &act_row));
    ck_assert(!fp8_model_losses_of(flags, "0", "1", "1", "0", sep, &act_sep));
    ck_assert(fp8_model_losses_of(flags, "1", "1", "1", "0", again, &act_again));
    /* the estimate: the expert side's inputs and SwiGLU outputs as their copies (8 experts) */
    const long long t_bytes = 2 * (long long)moe_mlp_fp8_act_t_bytes(8 * 64 * 2, 8, 128);
    ck_assert_int_eq(act_tiled, t_bytes);
    ck_assert_int_eq(act_row, 0);
    tiled_forms_agree("with a capacity (the expert side): tiled fused passes (inputs "
                      "kept as their token-wise copy)", tiled, rowwise, again, sep);
}
END_TEST

/* ------------------------------------------------------------ native FP8 dense linears */

/* Chapter 05's native FP8 dense linears (lowp.h, "Native FP8 dense linears",
 * MOE_FP8_NATIVE_DENSE=1; passed on an H100 at 8868409, opt-in as measured slower): forward and
 * dgrad in cuBLASLt's blockwise FP8 GEMM against the GPU's emulation (QDQ, then the bf16 GEMM) at
 * the same quantization points. The products are the same exact values, so only the summation
 * order and the bf16 output's rounding differ: a relative (Frobenius) error of a few 1e-3; the
 * bound is 1e-2 (a wrong scale layout, transpose or missing accumulate is O(1)). */

/* ‖a − b‖ / ‖b‖ over n activations on the device */
static double dev_rel(const void *a, const void *b, size_t n) {
    const moe_backend *g = moe_backend_cuda();
    moe_real *ha = malloc(sizeof(moe_real) * n), *hb = malloc(sizeof(moe_real) * n);
    g->read_act(ha, a, n);
    g->read_act(hb, b, n);
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        const double d = (double)ha[i] - hb[i];
        num += d * d;
        den += (double)hb[i] * hb[i];
    }
    free(ha), free(hb);
    return isfinite(num) ? sqrt(num / (den + 1e-300)) : INFINITY;
}

/* one dense linear [O, I] on @p rows tokens: 1 when within the bound */
static int check_dense(int rows, int I, int O) {
    const moe_backend *g = moe_backend_cuda();
    const size_t nx = (size_t)rows * I, ny = (size_t)rows * O, nw = (size_t)O * I;
    moe_lowp lp;
    lowp_blockwise(&lp, g, (nx > ny ? nx : ny) > nw ? (nx > ny ? nx : ny) : nw);
    lp.native_dense = 1; /* the request MOE_FP8_NATIVE_DENSE=1 makes (lowp.c) */
    ck_assert(moe_lowp_native_dense(g, &lp));
    moe_real *hx = malloc(sizeof(moe_real) * nx), *hy = malloc(sizeof(moe_real) * ny);
    moe_real *hw = malloc(sizeof(moe_real) * nw), *hb = malloc(sizeof(moe_real) * nx);
    void *x = moe_test_upload(g, hx, nx, 301 + (uint64_t)rows, 1.0);
    void *dy = moe_test_upload(g, hy, ny, 302 + (uint64_t)rows, 1e-2);
    void *w = moe_test_upload(g, hw, nw, 303 + (uint64_t)O, 0.05);
    /* dx's prior contents, of the product's size (about sqrt(O)·1e-2·0.05): the accumulate
     * must keep them */
    void *base = moe_test_upload(g, hb, nx, 304, 5e-3);
    moe_fp8_weight fw;
    ck_assert(moe_fp8_weight_alloc(g, &fw, 1, O, I));
    moe_lowp_quantize_dense(g, &lp, &fw, w, O, I, 0, 1); /* codes, then w = Q(w) in place */
    const moe_fp8_weight *fwp = &fw;
    /* forward */
    void *yn = dpoison(2 * ny), *ye = dpoison(2 * ny);
    const unsigned long long c0 = lp.dense_gemms;
    moe_lowp_dense_forward(g, &lp, &yn, &fwp, 1, x, rows, I);
    ck_assert_int_eq(lp.dense_gemms, c0 + 1); /* the native GEMM ran */
    g->matmul_forward(ye, moe_lowp_qdq(g, &lp, x, rows, I, MOE_LOWP_ACTIVATION, 0), w, rows, I,
                      O);
    const double ef = dev_rel(yn, ye, ny);
    /* dgrad, overwriting (into poison) and accumulating (onto base) */
    void *dn = dpoison(2 * nx), *da = g->alloc(2 * nx), *de = g->alloc(2 * nx);
    void *qn = g->alloc(2 * ny);
    g->copy(da, base, 2 * nx);
    g->copy(de, base, 2 * nx);
    moe_lowp_dense_dgrad(g, &lp, dn, 0, &fw, dy, rows);
    const void *gq = moe_lowp_dense_dgrad(g, &lp, da, 1, &fw, dy, rows);
    ck_assert_int_eq(lp.dense_gemms, c0 + 3);
    g->copy(qn, gq, 2 * ny); /* Q(dy) of the native pass, before the emulation's QDQ */
    const void *ge = moe_lowp_qdq(g, &lp, dy, rows, O, MOE_LOWP_GRADIENT, 0);
    unsigned char *hq = malloc(2 * ny);
    moe_cuda_to_host(hq, ge, 2 * ny);
    const int qsame = same("Q(dy): the dgrad's dequantized copy vs the emulation's QDQ", qn, hq,
                           2 * ny);
    g->matmul_backward(de, NULL, ge, NULL, w, rows, I, O); /* de = base + Q(dy)·Q(w) */
    const double ea = dev_rel(da, de, nx);
    /* the overwriting one against the emulation's product alone: de − base */
    void *pe = g->alloc(2 * nx);
    g->zero(pe, 2 * nx);
    g->matmul_backward(pe, NULL, ge, NULL, w, rows, I, O);
    const double ed = dev_rel(dn, pe, nx);
    const int pass = ef <= 1e-2 && ed <= 1e-2 && ea <= 1e-2 && qsame;
    printf("  FP8 dense linear rows=%d I=%d O=%d, native vs the GPU's emulation: forward %.2e, "
           "dgrad %.2e, dgrad accumulated %.2e%s\n", rows, I, O, ef, ed, ea,
           pass ? "" : " TOO LARGE");
    free(hx), free(hy), free(hw), free(hb), free(hq);
    g->free(x), g->free(dy), g->free(w), g->free(base), g->free(yn), g->free(ye);
    g->free(dn), g->free(da), g->free(de), g->free(qn), g->free(pe);
    moe_fp8_weight_free(g, &fw);
    moe_lowp_free(g, &lp);
    return pass;
}

START_TEST(test_gpu_fp8_dense_linear) {
    if (!hopper("FP8 dense linear"))
        return;
    moe_bench_env env = moe_bench_env_set("MOE_FP8_NATIVE", "1");
    int ok = 1;
    ok &= check_dense(256, 128, 128);
    ok &= check_dense(300, 384, 256);  /* rows not a multiple of 128; I ≠ O */
    ok &= check_dense(1000, 256, 640);
    ok &= check_dense(4, 128, 384);    /* the fewest rows cuBLASLt's blockwise GEMM takes */
    /* rows that are not a multiple of 4 fall back to the emulation (moe_lowp_dense_fits()) */
    moe_lowp lp;
    lowp_blockwise(&lp, moe_backend_cuda(), 1);
    lp.native_dense = 1;
    moe_fp8_weight fw = {.q = (uint8_t *)&fw, .G = 1, .O = 128, .I = 128};
    ck_assert(moe_lowp_dense_fits(&lp, &fw, 8));
    ck_assert(!moe_lowp_dense_fits(&lp, &fw, 6) && !moe_lowp_dense_fits(&lp, &fw, 301));
    ck_assert(!moe_lowp_dense_fits(&lp, NULL, 8));
    moe_lowp_free(moe_backend_cuda(), &lp);
    moe_bench_env_restore(&env);
    ck_assert_msg(ok, "the native FP8 dense linear differs from the emulation");
}
END_TEST

/* The whole model with the native dense path (MOE_FP8_NATIVE_DENSE=1) against the emulated
 * dense linears (=0), the routed experts native in both: a dense layer and a MoE layer with a
 * shared expert, so attention, the dense FFN and the shared expert all run it. The native
 * dense GEMMs must have run (the context's counter) and the losses stay within 1 % of the
 * emulation's at every step. */
#define FP8_DENSE_MODEL FP8_MODEL " --moe-shared-expert-intermediate-size 128"

static void fp8_dense_losses(const char *on, double *loss, unsigned long long *gemms) {
    moe_bench_env env = moe_bench_env_set("MOE_FP8_NATIVE_DENSE", on);
    moe_trainer *t = moe_test_trainer(FP8_DENSE_MODEL, NULL, 1);
    moe_bench_env_restore(&env); /* (latched by the model: lowp.h) */
    const moe_model *m = t->model;
    ck_assert(m->lowp && m->lowp->native);
    ck_assert_int_eq(m->lowp->native_dense, *on == '1');
    ck_assert(*on == '1' ? m->fp8d && m->fp8d[0].q && m->fp8d[4].q &&
                               m->fp8d[MOE_FP8_DENSE_SLOTS + 4].q
                         : !m->fp8d);
    for (int s = 0; s < FP8_STEPS; s++)
        loss[s] = moe_test_step(t);
    *gemms = m->lowp->dense_gemms;
    moe_trainer_free(t);
}

START_TEST(test_gpu_fp8_model_dense_native) {
    if (!hopper("FP8 model, native dense linears"))
        return;
    double nat[FP8_STEPS], emu[FP8_STEPS];
    unsigned long long gn, ge;
    fp8_dense_losses("1", nat, &gn);
    fp8_dense_losses("0", emu, &ge);
    double worst = 0;
    for (int s = 0; s < FP8_STEPS; s++) {
        const double e = fabs(nat[s] - emu[s]) / fabs(emu[s]);
        worst = e > worst || isnan(e) ? e : worst;
    }
    printf("  FP8 model, %d steps: native dense linears %.6f -> %.6f (%llu native dense GEMMs), "
           "emulated %.6f -> %.6f; worst relative loss difference %.2e\n", FP8_STEPS, nat[0],
           nat[FP8_STEPS - 1], gn, emu[0], emu[FP8_STEPS - 1], worst);
    ck_assert_msg(gn > 0, "the native dense GEMMs did not run");
    ck_assert_msg(ge == 0, "native dense GEMMs ran with MOE_FP8_NATIVE_DENSE=0");
    ck_assert_msg(worst <= 1e-2, "the native dense path's losses differ from the emulation's");
    ck_assert(nat[FP8_STEPS - 1] < nat[0]);
}
END_TEST

Suite *suite_gpu_fp8_layer(void) {
    const TTest *const tests[] = {test_gpu_fp8_layer_quantizers, test_gpu_fp8_layer_vs_cpu,
                                  test_gpu_fp8_model_fused_saved_codes,
                                  test_gpu_fp8_model_fused_fp8_wgrad,
                                  test_gpu_fp8_model_expert_side_x_t, test_gpu_fp8_dense_linear,
                                  test_gpu_fp8_model_dense_native};
    return moe_test_chapter_suite("gpu_fp8_layer", "ch05", tests, 7);
}
