/*
 * Chapter 05's measurement: the dense low-precision GEMMs of kernels/fp8_gemm.cu against the
 * bf16 cuBLAS GEMM of kernels/matmul.cu, in one run, on one GPU.
 *
 * D[M,N] = A[M,K]·B[N,K]ᵀ (a Linear layer's forward: A the tokens' activations, B the weight),
 * for a dense 8192³ GEMM, Mixtral-8x7B's expert fc1 (16384 × 14336 × 4096) and fc2
 * (16384 × 4096 × 14336) as one dense GEMM of 16384 tokens, and a Qwen3-like narrow expert
 * (16384 × 1536 × 4096). Rows:
 *
 *   bf16 cuBLAS            cublasGemmEx, bf16 in, fp32 accumulation, bf16 out: the baseline
 *   FP8 tensorwise         cuBLASLt FP8 E4M3 x E4M3, one fp32 scale per operand
 *   FP8 tensorwise hybrid  E5M2 (A, as a gradient would be) x E4M3
 *   FP8 blockwise          1x128 activation scales x 128x128 weight scales (DeepSeek-V3's
 *                          recipe), the scales' layout conversion included
 *   + quantize A / A+B     the same plus the CUDA quantizers of A (every step) or of both
 *                          operands (the weights: once per step in training), from fp32
 *   MXFP8 / NVFP4          emulated on Hopper (dequantize → bf16 GEMM): what it costs to run
 *                          the recipes' numerics on a GPU without block-scaled tensor cores
 *
 * The MoE expert GEMMs (--shape moe, or one of qwen3-fc1, qwen3-fc2, mixtral-fc1, mixtral-fc2,
 * qwen3-235b-fc1, qwen3-235b-fc2):
 * the forward of every expert at once, Y_g = X_g·W_gᵀ over ragged groups whose offsets stay in
 * device memory, for Qwen3-30B-A3B (128 experts, H = 2048, F = 768, top-8, T = 4096 tokens:
 * 32768 rows; fc1 is gate and up fused, N = 2F) and Mixtral-8x7B (8 experts, H = 4096,
 * F = 14336, top-2, T = 8192: 16384 rows), and Qwen3-235B-A22B (128 experts, H = 4096,
 * F = 1536, top-8, T = 8192: 65536 rows, 512 an expert). Group sizes are imbalanced (0.5x to
 * 1.5x the mean, multiples of 16, the rule of group_sizes(), which torch_fp8_gemm.py
 * repeats). Rows:
 *
 *   bf16 grouped (ours)        chapter 03's sm_90a kernel (kernels/grouped_gemm_sm90.cu)
 *   FP8 grouped (ours)         our sm_90a FP8 kernel (kernels/grouped_gemm_fp8_sm90.cu):
 *                              1x128 activation x 128x128 weight scales, E4M3, bf16 out
 *   + quantize A               the same plus the 1x128 quantizer of the activations (fp32 in)
 *   variant                    the kernel's other variant (its consumer warpgroups issue
 *                              their MMAs in turn, or together: grouped_gemm_fp8_sm90.cu)
 *   128x128 tile (variant)     the kernel's other tile width, the default issue order: the
 *                              default is 128 x 256 (two 128-column halves promoted per
 *                              k-block), so this row is the 128 x 128 tile; with
 *                              MOE_FP8_GROUPED_BN=128 the rows swap and it reads "128x256
 *                              tile (BN=256)"; after the ceiling row, one line gives both
 *                              tile widths' fraction of the ceiling
 *   FP8 dense ceiling          cuBLASLt's blockwise FP8 GEMM on the same rows x N x K as one
 *                              dense GEMM (one expert's weights): what a grouped GEMM can
 *                              at best approach
 * and the same shape's weight gradient dW_g[N, K] = dY_gᵀ·X_g (dY: the forward's output,
 * as bf16 values; the ratio column of these rows is against the bf16 wgrad):
 *   bf16 wgrad grouped (ours)  chapter 03's kernel, fp32 dW stored (MOE_DW_STORE)
 *   FP8 wgrad grouped,         kernels/grouped_gemm_fp8_wgrad_sm90.cu on the token-wise
 *     pipelined (ours)         FP8 copies of dY and X (lib/fp8_wgrad.h), fp32 dW stored;
 *                              its consumer loop with two accumulator sets (MMAs of k-block
 *                              j + 1 run while j is promoted; MOE_FP8_WGRAD_PIPE=1), each
 *                              k-block's scales brought into shared memory with its stage
 *   pipelined, global scales   the same loop with the consumers loading the scales from
 *     (var.)                   global memory, as the kernel first did (6 stages instead of
 *                              5; MOE_FP8_WGRAD_SCALES=global)
 *   first loop (variant)       the same kernel with its first loop (each k-block waited for
 *                              before its promotion; MOE_FP8_WGRAD_PIPE=0), shared-memory
 *                              scales
 *   128x256 tile               the same kernel's 128 × 256 tile (split promotion: each
 *                              k-block in two 128-column halves; MOE_FP8_WGRAD_BN=256),
 *                              shared-memory scales: all four timed in every run, the
 *                              first three at 128 columns, whatever the variables say
 *   128x256, direct epilogue   the same tile writing fp32 dW straight from registers
 *                              (red.global.add.v4.f32 or 16-byte stores) instead of staging
 *                              it through shared memory for TMA (MOE_FP8_WGRAD_EPI=direct);
 *                              the tile's own row above is staged (MOE_FP8_WGRAD_EPI=tma)
 *   128x256 by quarters        the same tile promoting each k-block in four 64-column
 *                              quarters with two accumulator sets (MOE_FP8_WGRAD_QUARTERS=1)
 *   bf16 wgrad ... +=,         the same with fp32 dW ADDED to (MOE_DW_ACCUMULATE, a step's
 *   FP8 wgrad 128x256 +=,      later micro-batches): the bf16 wgrad, the wide tile staged
 *     staged / direct /        through TMA (reduce-add), direct (vector reds), by quarters,
 *     by quarters / rmw /      read + add + write from registers (MOE_FP8_WGRAD_EPI=rmw) and
 *     auto epilogue            the default, auto (rmw for tiles of at most 8 k-blocks, else
 *                              staged)
 *   + token-wise quantize      the default loop plus the two quantize+transpose passes
 *   token-wise quantize dY/X   one quantize+transpose pass alone (kernels/quantize_group_t.cu),
 *     (C=...), v1              then its first kernel (MOE_QUANT_GROUP_T_V1): ms, and GB/s of
 *                              bytes read (bf16) + written (codes, scales), next to a D2D
 *                              copy of as many bytes in the same run (cudaMemcpyAsync)
 *   (no sampled check on these rows: tests/gpu_fp8_wgrad.c holds the kernel to its twin)
 *   1x128 quantize X+y / dY+y  the native FP8 layer's 1x128 quantize (lib/mlp.c) of X
 *     (C=...) v3 hw, v3, vec  [rows, K] and of dY [rows, N], each with its dequantized bf16
 *                              copy, by the three kernels of kernels/quantize.cu (v3 with the
 *                              hardware's casts, v3, the vectorized one: MOE_QUANT_VEC=3, 2,
 *                              1): ms and GB/s of bytes read (bf16) + written (codes, scales,
 *                              copy) next to a D2D copy of as many bytes (no check here:
 *                              tests/gpu_fp8_fused.c holds them to the CPU byte for byte)
 *   SwiGLU forward, row-wise   the FP8 layer's SwiGLU forward under the FP8 wgrad, with the
 *     + y / token-wise copy,   N columns of the GEMM output as [g | u] (F = N/2): the fused
 *     tiled (MOE_FP8_SAVE_T)   row-wise pass writing fc2's codes and the bf16 output, then
 *     2, 3, 4 blocks per SM    the token-wise copy made from that output (what runs with
 *                              MOE_FP8_SAVE_T=0), against the tiled forward writing both
 *                              sets of codes (kernels/swiglu_quant.cu) at 2, 3 and 4 blocks
 *                              per SM: GB/s of its own bytes next to a D2D copy of as many
 *                              (tests/gpu_fp8_fused.c holds the bytes to the separate passes)
 *   SwiGLU backward, row-wise  ... and the backward with dout = that output: the row-wise
 *     + dgu / token-wise copy, pass writing dgu's codes and dgu, then dgu's token-wise copy
 *     tiled (MOE_FP8_FUSED_T)  (MOE_FP8_FUSED_T=0), against the tiled backward writing both
 *                              (MOE_FP8_FUSED_T=1); both directions with the routing weight
 *                              and (backward) its gradient, as the layer runs them
 * --shape q1x128 (also in all): those rows alone for Qwen3-235B's permuted x, 65536 x 4096,
 * with and without the copy (ch01_moe_layer_bench --shape qwen3-235b --precision fp8's
 * largest quantize).
 *
 * Timing: CUDA events around `inner` back-to-back calls (inner chosen so one sample lasts
 * ~3 ms), after warm-up; the median of --repeats samples. Before timing, every output is
 * checked: 64 random elements against Σ_k deq(a)·deq(b) computed on the host from the
 * operands' codes and scales (tolerance 1e-2·|ref| + 1e-4·Σ|a·b|: bf16 output rounding); the
 * bf16 baseline against the product of its bf16 inputs.
 *
 *   bin/ch05_fp8_gemm_bench [--repeats 15] [--warmup 5] [--tsv file]
 *                           [--shape all|dense|fc1|fc2|qwen|moe|qwen3-fc1|qwen3-fc2|
 *                                    mixtral-fc1|mixtral-fc2|qwen3-235b-fc1|qwen3-235b-fc2|
 *                                    q1x128]
 *   (all: the dense shapes, then the MoE ones; --tsv: one line per measurement, for the
 *   PyTorch script)
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cuda_ops.h"
#include "fp8_gemm.h"
#include "fp8_wgrad.h"
#include "rng.h"

typedef struct shape {
    const char *name;
    int M, N, K;
} shape;

static const shape g_shapes[] = {
    {"dense", 8192, 8192, 8192},
    {"fc1", 16384, 14336, 4096}, /* Mixtral-8x7B expert fc1 (w1/w3: 4096 -> 14336) */
    {"fc2", 16384, 4096, 14336}, /* Mixtral-8x7B expert fc2 (w2: 14336 -> 4096) */
    {"qwen", 16384, 1536, 4096}, /* a Qwen3-style narrow expert (4096 -> 1536) */
};

static int g_repeats = 15, g_warmup = 5;
static FILE *g_tsv = NULL;

static void die(const char *what, const moe_error *err) {
    fprintf(stderr, "ch05_fp8_gemm_bench: %s: %s\n", what, err ? err->msg : "");
    exit(1);
}

static void *dalloc(size_t bytes) {
    void *p = moe_cuda_alloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "ch05_fp8_gemm_bench: out of device memory (%zu bytes)\n", bytes);
        exit(1);
    }
    return p;
}

/* ------------------------------------------------------------------ timing */

typedef void (*work_fn)(void *ctx);

/* median ms of one call of fn */
static double time_ms(work_fn fn, void *ctx) {
    for (int i = 0; i < g_warmup; i++)
        fn(ctx);
    moe_cuda_timer_begin();
    fn(ctx);
    const double once = moe_cuda_timer_end_ms();
    int inner = (int)ceil(3.0 / (once > 1e-3 ? once : 1e-3));
    inner = inner < 1 ? 1 : inner > 50 ? 50 : inner;
    double *t = malloc(sizeof(double) * (size_t)g_repeats);
    for (int r = 0; r < g_repeats; r++) {
        moe_cuda_timer_begin();
        for (int i = 0; i < inner; i++)
            fn(ctx);
        t[r] = moe_cuda_timer_end_ms() / inner;
    }
    const double med = moe_median(t, g_repeats);
    free(t);
    return med;
}

/* ------------------------------------------------------------------ operands */

/* one quantized operand on the device, with what the quantizer needs to run again */
typedef struct qop {
    moe_qmatrix q;
    const float *x; /* the fp32 source [rows, K] */
    int rows, K, block_2d;
    moe_nvfp4_opts nv;
} qop;

static void quantize(qop *o) {
    moe_error err;
    moe_status s;
    uint8_t *codes = (uint8_t *)o->q.codes;
    moe_quant_scalars *sc = (moe_quant_scalars *)o->q.scalars;
    switch (o->q.recipe) {
    case MOE_QUANT_TENSORWISE:
        s = moe_cuda_quant_tensorwise(codes, sc, o->x, (size_t)o->rows * o->K, o->q.format, &err);
        break;
    case MOE_QUANT_BLOCK_1X128:
    case MOE_QUANT_BLOCK_128X128:
        s = moe_cuda_quant_blockwise(codes, (float *)o->q.scales, o->x, o->rows, o->K, o->q.format,
                                     o->q.recipe == MOE_QUANT_BLOCK_128X128, 0, &err);
        break;
    case MOE_QUANT_MXFP8:
        s = moe_cuda_quant_mxfp8(codes, (uint8_t *)o->q.scales, o->x, o->rows, o->K, o->q.format,
                                 &err);
        break;
    default:
        s = moe_cuda_quant_nvfp4(codes, (uint8_t *)o->q.scales, sc, o->x, o->rows, o->K, &o->nv,
                                 &err);
    }
    if (s != MOE_OK)
        die("quantize", &err);
}

static size_t scale_bytes(moe_quant_recipe r, int rows, int K) {
    if (r == MOE_QUANT_TENSORWISE)
        return 0;
    const size_t n = moe_quant_scale_count(r, rows, K);
    return r == MOE_QUANT_BLOCK_1X128 || r == MOE_QUANT_BLOCK_128X128 ? n * 4 : n;
}

static void qop_make(qop *o, moe_quant_recipe r, moe_fp8_format f, const float *x, int rows,
                     int K) {
    memset(o, 0, sizeof *o);
    o->q.recipe = r;
    o->q.format = f;
    o->x = x;
    o->rows = rows;
    o->K = K;
    o->nv.block_2d = r == MOE_QUANT_NVFP4_2D;
    o->q.nvfp4 = o->nv;
    o->q.codes = dalloc(moe_quant_code_bytes(r, rows, K));
    const size_t sb = scale_bytes(r, rows, K);
    o->q.scales = sb ? dalloc(sb) : NULL;
    if (r == MOE_QUANT_TENSORWISE || r == MOE_QUANT_NVFP4 || r == MOE_QUANT_NVFP4_2D)
        o->q.scalars = dalloc(sizeof(moe_quant_scalars));
    quantize(o);
}

static void qop_free(qop *o) {
    moe_cuda_free((void *)o->q.codes);
    moe_cuda_free((void *)o->q.scales);
    moe_cuda_free((void *)o->q.scalars);
}

/* the host copy of a device operand (codes, scales, scalars), for the output check */
typedef struct hop {
    moe_qmatrix q;
    moe_quant_scalars s;
} hop;

static void hop_make(hop *h, const qop *o) {
    h->q = o->q;
    const size_t cb = moe_quant_code_bytes(o->q.recipe, o->rows, o->K);
    const size_t sb = scale_bytes(o->q.recipe, o->rows, o->K);
    uint8_t *c = malloc(cb);
    moe_cuda_to_host(c, o->q.codes, cb);
    h->q.codes = c;
    if (sb) {
        void *s = malloc(sb);
        moe_cuda_to_host(s, o->q.scales, sb);
        h->q.scales = s;
    }
    if (o->q.scalars) {
        moe_cuda_to_host(&h->s, o->q.scalars, sizeof h->s);
        h->q.scalars = &h->s;
    }
}

static void hop_free(hop *h) {
    free((void *)h->q.codes);
    free((void *)h->q.scales);
}

/* row r of a host operand, dequantized (a one-row view of its codes and scales) */
static void hop_row(float *y, const hop *h, int r, int K) {
    moe_qmatrix v = h->q;
    const moe_quant_recipe rc = h->q.recipe;
    const int nv = rc == MOE_QUANT_NVFP4 || rc == MOE_QUANT_NVFP4_2D;
    v.codes = h->q.codes + (size_t)r * (nv ? K / 2 : K);
    size_t so = 0; /* the row's first scale */
    switch (rc) {
    case MOE_QUANT_BLOCK_1X128:
        so = (size_t)r * (K / 128) * 4;
        break;
    case MOE_QUANT_BLOCK_128X128:
        so = (size_t)(r / 128) * (K / 128) * 4;
        break;
    case MOE_QUANT_MXFP8:
        so = (size_t)r * (K / 32);
        break;
    case MOE_QUANT_NVFP4:
        so = (size_t)r * (K / 16);
        break;
    case MOE_QUANT_NVFP4_2D:
        so = (size_t)(r / 16) * (K / 16);
        break;
    default:
        break;
    }
    if (v.scales)
        v.scales = (const char *)h->q.scales + so;
    moe_error err;
    if (moe_cpu_qmatrix_dequant(y, &v, 1, K, &err) != MOE_OK)
        die("dequantize a row", &err);
}

/* 64 random elements of d (bf16, device) against Σ_k a_row·b_row in double; returns the
 * worst |got − ref| / (1e-2·|ref| + 1e-4·Σ|a·b|): ≤ 1 passes */
typedef void (*row_fn)(float *y, const void *src, int r, int K);

/* element (i, j) of d (bf16, device, N columns) against Σ_k a[k]·b[k] in double, as above */
static double element_error(const void *d, int N, int i, int j, const float *a, const float *b,
                            int K) {
    double ref = 0, mag = 0;
    for (int k = 0; k < K; k++) {
        ref += (double)a[k] * b[k];
        mag += fabs((double)a[k] * b[k]);
    }
    float got;
    moe_cuda_read_act(&got, (const char *)d + ((size_t)i * N + j) * 2, 1);
    return fabs(got - ref) / (1e-2 * fabs(ref) + 1e-4 * mag + 1e-30);
}

static double check(const void *d, int M, int N, int K, row_fn arow, const void *asrc,
                    row_fn brow, const void *bsrc) {
    float *a = malloc((size_t)K * 4), *b = malloc((size_t)K * 4);
    double worst = 0;
    for (int s = 0; s < 64; s++) {
        const int i = (int)(moe_rng_uniform(95, 1, (uint64_t)s) * M) % M;
        const int j = (int)(moe_rng_uniform(95, 2, (uint64_t)s) * N) % N;
        arow(a, asrc, i, K);
        brow(b, bsrc, j, K);
        const double e = element_error(d, N, i, j, a, b, K);
        worst = e > worst ? e : worst;
    }
    free(a), free(b);
    return worst;
}

static void hop_rowfn(float *y, const void *src, int r, int K) { hop_row(y, src, r, K); }

/* a row of a bf16 device matrix */
static void bf16_rowfn(float *y, const void *src, int r, int K) {
    moe_cuda_read_act(y, (const char *)src + (size_t)r * K * 2, (size_t)K);
}

/* ------------------------------------------------------------------ the rows */

typedef struct gemm_ctx {
    void *d;
    qop *a, *b;
    int M, N, K;
    int quant_a, quant_b; /* time the quantizers too */
    const void *xa, *wb;  /* bf16 operands of the baseline */
} gemm_ctx;

static void run_bf16(void *p) {
    gemm_ctx *c = p;
    moe_cuda_matmul_forward(c->d, c->xa, c->wb, c->M, c->K, c->N);
}

static void run_q(void *p) {
    gemm_ctx *c = p;
    moe_error err;
    if (c->quant_a)
        quantize(c->a);
    if (c->quant_b)
        quantize(c->b);
    if (moe_cuda_fp8_gemm(c->d, 0, &c->a->q, &c->b->q, c->M, c->N, c->K, &err) != MOE_OK)
        die("FP8 GEMM", &err);
}

static double g_bf16_ms;

static void report(const shape *s, const char *impl, double ms, double check_ratio) {
    const double tflops = 2.0 * s->M * s->N * (double)s->K / (ms * 1e-3) / 1e12;
    char chk[32];
    if (check_ratio < 0) /* the GEMM of the row above, with the quantizers timed too */
        snprintf(chk, sizeof chk, "(as above)");
    else
        snprintf(chk, sizeof chk, "%s (%.2f)", check_ratio <= 1.0 ? "ok" : "FAIL", check_ratio);
    printf("%-6s %6d %6d %6d  %-38s %9.3f %9.1f %7.2fx   %s\n", s->name, s->M, s->N, s->K, impl,
           ms, tflops, g_bf16_ms / ms, chk);
    if (g_tsv)
        fprintf(g_tsv, "%s\t%d\t%d\t%d\t%s\t%.5f\t%.2f\n", s->name, s->M, s->N, s->K, impl, ms,
                tflops);
    fflush(stdout);
    if (check_ratio > 1.0) {
        fprintf(stderr, "ch05_fp8_gemm_bench: %s on %s: output check failed (%.2f)\n", impl,
                s->name, check_ratio);
        exit(1);
    }
}

/* check then time one quantized GEMM row */
static int row_q(const shape *s, const char *impl, gemm_ctx *c) {
    hop ha, hb;
    moe_error err;
    c->quant_a = c->quant_b = 0;
    if (moe_cuda_fp8_gemm(c->d, 0, &c->a->q, &c->b->q, c->M, c->N, c->K, &err) != MOE_OK) {
        printf("%-6s %6d %6d %6d  %-38s not available: %s\n", s->name, s->M, s->N, s->K, impl,
               err.msg);
        return 0;
    }
    hop_make(&ha, c->a);
    hop_make(&hb, c->b);
    const double chk = check(c->d, s->M, s->N, s->K, hop_rowfn, &ha, hop_rowfn, &hb);
    hop_free(&ha), hop_free(&hb);
    report(s, impl, time_ms(run_q, c), chk);
    return 1;
}

static void bench_shape(const shape *s) {
    const int M = s->M, N = s->N, K = s->K;
    const size_t nx = (size_t)M * K, nw = (size_t)N * K;
    float *x = dalloc(nx * 4), *w = dalloc(nw * 4);
    /* activations N(0,1) with 16 outlier rows (x50), weights N(0, 0.02) */
    moe_cuda_fill_normal(x, nx, 1234, 1, 1.0);
    moe_cuda_fill_normal(x + (size_t)(M / 2) * K, (size_t)16 * K, 1234, 2, 50.0);
    moe_cuda_fill_normal(w, nw, 1234, 3, 0.02);
    void *xb = dalloc(nx * 2), *wb = dalloc(nw * 2), *d = dalloc((size_t)M * N * 2);
    moe_cuda_cast_to_act(xb, x, nx);
    moe_cuda_cast_to_act(wb, w, nw);

    gemm_ctx c = {.d = d, .M = M, .N = N, .K = K, .xa = xb, .wb = wb};
    run_bf16(&c);
    g_bf16_ms = 1.0; /* the ratio column of the baseline row is set after timing */
    const double chk = check(d, M, N, K, bf16_rowfn, xb, bf16_rowfn, wb);
    g_bf16_ms = time_ms(run_bf16, &c);
    report(s, "bf16 cuBLAS (baseline)", g_bf16_ms, chk);

    qop a, b;
    c.a = &a, c.b = &b;
    /* tensorwise */
    qop_make(&a, MOE_QUANT_TENSORWISE, MOE_FP8_E4M3, x, M, K);
    qop_make(&b, MOE_QUANT_TENSORWISE, MOE_FP8_E4M3, w, N, K);
    if (row_q(s, "FP8 tensorwise E4M3", &c)) {
        c.quant_a = 1;
        report(s, "FP8 tensorwise + quantize A", time_ms(run_q, &c), -1);
    }
    qop_free(&a);
    qop_make(&a, MOE_QUANT_TENSORWISE, MOE_FP8_E5M2, x, M, K);
    row_q(s, "FP8 tensorwise E5M2 x E4M3 (hybrid)", &c);
    qop_free(&a), qop_free(&b);
    /* blockwise */
    qop_make(&a, MOE_QUANT_BLOCK_1X128, MOE_FP8_E4M3, x, M, K);
    qop_make(&b, MOE_QUANT_BLOCK_128X128, MOE_FP8_E4M3, w, N, K);
    if (row_q(s, "FP8 blockwise 1x128 x 128x128", &c)) {
        c.quant_a = 1;
        report(s, "FP8 blockwise + quantize A", time_ms(run_q, &c), -1);
        c.quant_b = 1;
        report(s, "FP8 blockwise + quantize A and B", time_ms(run_q, &c), -1);
    }
    qop_free(&a), qop_free(&b);
    /* the Blackwell recipes, emulated here */
    const char *how = moe_cuda_fp8_gemm_native(MOE_QUANT_MXFP8) ? "native" : "emulated";
    char name[64];
    qop_make(&a, MOE_QUANT_MXFP8, MOE_FP8_E4M3, x, M, K);
    qop_make(&b, MOE_QUANT_MXFP8, MOE_FP8_E4M3, w, N, K);
    snprintf(name, sizeof name, "MXFP8 E4M3 (%s)", how);
    row_q(s, name, &c);
    qop_free(&a), qop_free(&b);
    qop_make(&a, MOE_QUANT_NVFP4, MOE_FP8_E4M3, x, M, K);
    qop_make(&b, MOE_QUANT_NVFP4_2D, MOE_FP8_E4M3, w, N, K);
    snprintf(name, sizeof name, "NVFP4 1x16 x 16x16 (%s)", how);
    row_q(s, name, &c);
    qop_free(&a), qop_free(&b);

    moe_cuda_free(x), moe_cuda_free(w), moe_cuda_free(xb), moe_cuda_free(wb), moe_cuda_free(d);
}


/* ------------------------------------------------------------------ the MoE expert GEMMs */

typedef struct gshape {
    const char *name;
    int G, rows, N, K;
} gshape;

static const gshape g_gshapes[] = {
    {"qwen3-fc1", 128, 32768, 1536, 2048},  /* Qwen3-30B-A3B: gate+up, H -> 2F */
    {"qwen3-fc2", 128, 32768, 2048, 768},   /* down, F -> H */
    {"mixtral-fc1", 8, 16384, 28672, 4096}, /* Mixtral-8x7B: w1+w3, H -> 2F */
    {"mixtral-fc2", 8, 16384, 4096, 14336}, /* w2, F -> H */
    /* Qwen3-235B-A22B: 512 rows an expert, so a wgrad tile has 4 k-blocks to its epilogue */
    {"qwen3-235b-fc1", 128, 65536, 3072, 4096},
    {"qwen3-235b-fc2", 128, 65536, 4096, 1536},
};

/* Imbalanced group sizes that sum to rows: weight w_g = 500 + (7919·g mod 1000) (0.5x to 1.5x
 * of the mean), each size rows·w_g / Σw rounded down to a multiple of 16, the rest handed out
 * 16 rows at a time from group 0 (torch_fp8_gemm.py repeats this rule exactly). */
static void group_sizes(int *off, int G, int rows) {
    long long sum = 0;
    for (int g = 0; g < G; g++)
        sum += 500 + (7919LL * g) % 1000;
    int left = rows;
    int *n = malloc(sizeof(int) * (size_t)G);
    for (int g = 0; g < G; g++) {
        n[g] = (int)((long long)rows * (500 + (7919LL * g) % 1000) / sum) / 16 * 16;
        left -= n[g];
    }
    for (int g = 0; left > 0; g = (g + 1) % G) {
        const int add = left < 16 ? left : 16;
        n[g] += add;
        left -= add;
    }
    off[0] = 0;
    for (int g = 0; g < G; g++)
        off[g + 1] = off[g] + n[g];
    free(n);
}

typedef struct grouped_ctx {
    void *d;
    const void *xb, *wb; /* bf16 operands */
    qop *a;              /* A's quantizer (1x128, all rows) */
    moe_qmatrix qa, qb;  /* device operands */
    const int *doff;
    int G, rows, N, K, quant_a;
} grouped_ctx;

static void run_grouped_bf16(void *p) {
    grouped_ctx *c = p;
    moe_cuda_grouped_sm90_forward(c->d, c->xb, c->wb, c->doff, c->G, c->rows, c->K, c->N);
}

static void run_grouped_fp8(void *p) {
    grouped_ctx *c = p;
    moe_error err;
    if (c->quant_a)
        quantize(c->a);
    if (moe_cuda_fp8_grouped_gemm(c->d, 0, &c->qa, &c->qb, c->doff, c->G, c->rows, c->N, c->K,
                                  &err) != MOE_OK)
        die("FP8 grouped GEMM", &err);
}

static void run_dense_ceiling(void *p) {
    grouped_ctx *c = p;
    moe_error err;
    if (moe_cuda_fp8_gemm(c->d, 0, &c->qa, &c->qb, c->rows, c->N, c->K, &err) != MOE_OK)
        die("FP8 dense GEMM", &err);
}

/* the weight gradient of a grouped shape: dW [G][N][K] fp32 from dY [rows, N], X [rows, K]
 * (bf16), in bf16 (chapter 03) or FP8 (the token-wise copies qa/sa, qb/sb of kpad columns) */
typedef struct wgrad_ctx {
    float *dw;
    const void *dy, *x;
    const int *doff;
    int G, rows, N, K, quant;
    moe_dw_mode mode; /* fp32 dW stored (the rows' default) or added */
    size_t kpad;
    uint8_t *qa, *qb;
    float *sa, *sb;
} wgrad_ctx;

static void run_wgrad_bf16(void *p) {
    wgrad_ctx *c = p;
    moe_cuda_grouped_sm90_backward(NULL, c->dw, c->dy, c->x, NULL, c->doff, c->G, c->rows, c->K,
                                   c->N, 0, c->mode);
}

static void run_wgrad_fp8(void *p) {
    wgrad_ctx *c = p;
    moe_error err;
    if (c->quant &&
        (moe_cuda_quant_group_t_act(c->qa, c->sa, c->dy, c->doff, c->G, c->rows, c->N, c->kpad,
                                    MOE_FP8_E4M3, 1, &err) != MOE_OK ||
         moe_cuda_quant_group_t_act(c->qb, c->sb, c->x, c->doff, c->G, c->rows, c->K, c->kpad,
                                    MOE_FP8_E4M3, 1, &err) != MOE_OK))
        die("token-wise FP8 quantize", &err);
    if (moe_cuda_fp8_grouped_wgrad(c->dw, c->mode, c->qa, c->sa, c->qb, c->sb, c->doff, c->G,
                                   c->kpad, c->N, c->K, &err) != MOE_OK)
        die("FP8 grouped wgrad", &err);
}

/* one row of a memory-bound pass (impl) that moved @p bytes in @p ms: its GB/s beside a
 * device-to-device copy of as many bytes timed in the same run (copy_ms, copy_gbs) */
static void bw_row(const shape *s, const char *impl, double ms, double bytes, double copy_ms,
                   double copy_gbs) {
    const double gbs = bytes / (ms * 1e-3) / 1e9;
    printf("%-6s %6d %6d %6d  %-38s %9.3f %6.0f GB/s = %3.0f%% of a D2D copy (%.3f ms, "
           "%.0f GB/s), %.2f GB\n",
           s->name, s->M, s->N, s->K, impl, ms, gbs, 100.0 * gbs / copy_gbs, copy_ms, copy_gbs,
           bytes / 1e9);
    if (g_tsv)
        fprintf(g_tsv, "%s\t%d\t%d\t%d\t%s\t%.5f\t%.2f\n", s->name, s->M, s->N, s->K, impl, ms,
                gbs);
}

/* one token-wise quantize pass alone (the operand of C channels), and the D2D copy that
 * moves as many bytes (its reference) */
typedef struct tq_ctx {
    uint8_t *q;
    float *s;
    const void *x;
    void *scratch; /* the copy's destination */
    const int *doff;
    int G, rows, C;
    size_t kpad, copy_bytes;
} tq_ctx;

static void run_tq(void *p) {
    tq_ctx *c = p;
    moe_error err;
    if (moe_cuda_quant_group_t_act(c->q, c->s, c->x, c->doff, c->G, c->rows, c->C, c->kpad,
                                   MOE_FP8_E4M3, 1, &err) != MOE_OK)
        die("token-wise FP8 quantize", &err);
}

static void run_copy(void *p) {
    tq_ctx *c = p;
    moe_cuda_copy(c->scratch, c->x, c->copy_bytes);
}

/* the token-wise quantize of dY (N channels) and of X (K channels) alone: ms and GB/s (bytes
 * read + written: 2 a bf16 element read, the codes and scales of the groups' padded blocks
 * written) by the vectorized kernel and by the first one (MOE_QUANT_GROUP_T_V1), next to a
 * device-to-device copy of the same number of bytes (half read, half written) in the same
 * run: how near the copy bandwidth the pass runs */
static void bench_tq(const shape *s, const int *off, int G, int rows, const char *what, int C,
                     const void *x, const int *doff, uint8_t *q, float *sc, size_t kpad) {
    size_t nb = 0; /* the groups' padded 128-token blocks */
    for (int g = 0; g < G; g++)
        nb += (size_t)(off[g + 1] - off[g] + MOE_QUANT_BLOCK - 1) / MOE_QUANT_BLOCK;
    const double bytes = 2.0 * off[G] * C + (double)nb * MOE_QUANT_BLOCK * C + 4.0 * nb * C;
    tq_ctx c = {.q = q, .s = sc, .x = x, .doff = doff, .G = G, .rows = rows, .C = C,
                .kpad = kpad, .copy_bytes = (size_t)(bytes / 2) / 16 * 16};
    c.scratch = dalloc(c.copy_bytes);
    const double copy_ms = time_ms(run_copy, &c);
    const double copy_gbs = 2.0 * c.copy_bytes / (copy_ms * 1e-3) / 1e9;
    const int v1 = moe_cuda_quant_group_t_v1();
    for (int k = 0; k < 2; k++) {
        moe_cuda_quant_group_t_set_v1(k);
        const double ms = time_ms(run_tq, &c);
        char impl[64];
        snprintf(impl, sizeof impl, "token-wise quantize %s (C=%d)%s", what, C,
                 k ? " v1" : "");
        bw_row(s, impl, ms, bytes, copy_ms, copy_gbs);
    }
    fflush(stdout);
    moe_cuda_quant_group_t_set_v1(v1);
    moe_cuda_free(c.scratch);
}

/* the SwiGLU forward under the FP8 wgrad on gu [rows, 2F] (F = N/2): the row-wise fused pass
 * with the bf16 output (y_raw) and the token-wise copy made from that output, or the tiled
 * forward writing both sets of codes */
typedef struct sw_ctx {
    const void *gu, *dout; /* dout: the backward's (NULL: the forward) */
    void *y, *scratch;
    uint8_t *q, *qt;
    float *s, *st;
    const float *rs; /* the routing weight of each row, as the layer passes it */
    float *drs, *part; /* its gradient (added to) and the tiled backward's partial sums */
    const int *doff;
    int G, rows, F, tiled;
    size_t kpad, copy_bytes;
} sw_ctx;

static void run_swiglu(void *p) {
    sw_ctx *c = p;
    moe_error err;
    moe_status st;
    if (c->dout && c->tiled)
        st = moe_cuda_swiglu_backward_quant_t(c->q, c->s, c->qt, c->st, c->part, c->drs, c->dout,
                                              c->gu, c->rs, c->doff, c->G, c->rows, c->F,
                                              c->kpad, MOE_FP8_E4M3, 1, &err);
    else if (c->dout)
        st = moe_cuda_swiglu_backward_quant(c->q, c->s, c->y, 1, c->drs, c->dout, c->gu, c->rs,
                                            c->rows, c->F, MOE_FP8_E4M3, 1, &err);
    else if (c->tiled)
        st = moe_cuda_swiglu_forward_quant_t(c->q, c->s, c->qt, c->st, c->gu, c->rs, c->doff,
                                             c->G, c->rows, c->F, c->kpad, MOE_FP8_E4M3, 1, &err);
    else
        st = moe_cuda_swiglu_forward_quant(c->q, c->s, c->y, 1, c->gu, c->rs, c->rows, c->F,
                                           MOE_FP8_E4M3, 1, &err);
    if (st != MOE_OK)
        die("fused SwiGLU forward", &err);
}

static void run_sw_copy(void *p) {
    sw_ctx *c = p;
    moe_cuda_copy(c->scratch, (uint8_t *)c->scratch + c->copy_bytes, c->copy_bytes);
}

/* the SwiGLU forward and backward rows (the header's "SwiGLU forward"), with the routing
 * weight as the layer passes it (the backward adds to its gradient): each pass's ms and GB/s
 * of its own
 * bytes (read 4 a row and F column; write 1 a code, 4 a 128-element scale, 2 an element of
 * the bf16 output; the token-wise copy's codes and scales over the groups' padded blocks)
 * next to a D2D copy of as many bytes */
static void bench_swiglu(const shape *s, const int *off, int G, int rows, int N, const void *gu,
                         const int *doff) {
    const int F = N / 2;
    if (F <= 0 || F % MOE_QUANT_BLOCK != 0)
        return;
    const size_t n = (size_t)rows * F, kpad = moe_fp8_wgrad_kpad(rows, G);
    size_t nb = 0; /* the groups' padded 128-token blocks */
    for (int g = 0; g < G; g++)
        nb += (size_t)(off[g + 1] - off[g] + MOE_QUANT_BLOCK - 1) / MOE_QUANT_BLOCK;
    const double row_b = 4.0 * n + n + 4.0 * (n / MOE_QUANT_BLOCK); /* read gu, fc2's codes */
    const double tok_b = (double)nb * MOE_QUANT_BLOCK * F + 4.0 * nb * F; /* the copy */
    /* the routing weight (0.5 each: the values do not change the work) and its gradient */
    float *rs = dalloc(sizeof(float) * rows), *drs = dalloc(sizeof(float) * rows);
    float *part = dalloc(sizeof(float) * (n / MOE_QUANT_BLOCK + 1));
    moe_cuda_fill_real(rs, 0.5, (size_t)rows);
    moe_cuda_fill_real(drs, 0.0, (size_t)rows);
    sw_ctx c = {.gu = gu, .rs = rs, .drs = drs, .part = part, .y = dalloc(2 * n), .q = dalloc(n),
                .s = dalloc(4 * (n / 128)),
                .qt = dalloc(kpad * F), .st = dalloc(4 * (kpad / 128) * F), .doff = doff,
                .G = G, .rows = rows, .F = F, .kpad = kpad,
                .copy_bytes = (size_t)((row_b + tok_b) / 2) / 16 * 16};
    c.scratch = dalloc(2 * c.copy_bytes + 16);
    const double copy_ms = time_ms(run_sw_copy, &c);
    const double copy_gbs = 2.0 * c.copy_bytes / (copy_ms * 1e-3) / 1e9;
    char impl[64];
    const double ms_row = time_ms(run_swiglu, &c);
    snprintf(impl, sizeof impl, "SwiGLU forward, row-wise + y (F=%d)", F);
    bw_row(s, impl, ms_row, row_b + 2.0 * n, copy_ms, copy_gbs);
    tq_ctx t = {.q = c.qt, .s = c.st, .x = c.y, .doff = doff, .G = G, .rows = rows, .C = F,
                .kpad = kpad};
    const double ms_tok = time_ms(run_tq, &t);
    bw_row(s, "  + the token-wise copy of y", ms_tok, 2.0 * n + tok_b, copy_ms, copy_gbs);
    printf("%-6s %20s  the two: %.3f ms\n", s->name, "", ms_row + ms_tok);
    c.tiled = 1;
    const int blocks0 = moe_cuda_swiglu_forward_t_blocks();
    for (int b = 2; b <= 4; b++) {
        moe_cuda_swiglu_forward_t_set_blocks(b);
        snprintf(impl, sizeof impl, "SwiGLU forward, tiled, %d blocks/SM", b);
        bw_row(s, impl, time_ms(run_swiglu, &c), row_b + tok_b, copy_ms, copy_gbs);
    }
    moe_cuda_swiglu_forward_t_set_blocks(blocks0);
    /* the backward: dout = that output y; the row-wise pass writing dgu's codes and dgu
     * [rows, 2F], then dgu's token-wise copy (MOE_FP8_FUSED_T=0), against the tiled one
     * (MOE_FP8_FUSED_T=1; a form at 3 blocks an SM, 80 registers with its loads in groups of
     * 2, measured slower: 1.349 against 1.296 ms on Mixtral's fc1, results 05) */
    sw_ctx b = c;
    b.dout = c.y;
    b.tiled = 0;
    b.y = dalloc(4 * n);
    b.q = dalloc(2 * n);
    b.s = dalloc(8 * (n / 128));
    b.qt = dalloc(kpad * 2 * F);
    b.st = dalloc(8 * (kpad / 128) * F);
    const double brow_b = 6.0 * n + 2.0 * n + 8.0 * (n / MOE_QUANT_BLOCK); /* gu, dout; codes */
    const double btok_b = 2.0 * tok_b;
    const double ms_brow = time_ms(run_swiglu, &b);
    snprintf(impl, sizeof impl, "SwiGLU backward, row-wise + dgu (F=%d)", F);
    bw_row(s, impl, ms_brow, brow_b + 4.0 * n, copy_ms, copy_gbs);
    tq_ctx bt = {.q = b.qt, .s = b.st, .x = b.y, .doff = doff, .G = G, .rows = rows, .C = 2 * F,
                 .kpad = kpad};
    const double ms_btok = time_ms(run_tq, &bt);
    bw_row(s, "  + the token-wise copy of dgu", ms_btok, 4.0 * n + btok_b, copy_ms, copy_gbs);
    printf("%-6s %20s  the two: %.3f ms\n", s->name, "", ms_brow + ms_btok);
    b.tiled = 1;
    bw_row(s, "SwiGLU backward, tiled (MOE_FP8_FUSED_T)", time_ms(run_swiglu, &b),
           brow_b + btok_b, copy_ms, copy_gbs);
    fflush(stdout);
    void *const bufs[] = {c.y, c.q, c.s, c.qt, c.st, c.scratch, b.y, b.q, b.s, b.qt, b.st,
                          rs, drs, part};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
        moe_cuda_free(bufs[i]);
}

/* one 1x128 quantize of a bf16 operand [rows, cols] (moe_cuda_quant_blockwise_act, the
 * native FP8 layer's pass: lib/mlp.c), with or without its dequantized bf16 copy y, and the
 * D2D copy of as many bytes */
typedef struct q1_ctx {
    uint8_t *q;
    float *s;
    void *y; /* NULL: codes and scales only */
    const void *x;
    void *scratch;
    int rows, cols;
    size_t copy_bytes;
} q1_ctx;

static void run_q1(void *p) {
    q1_ctx *c = p;
    moe_error err;
    if (moe_cuda_quant_blockwise_act(c->q, c->s, c->y, c->x, c->rows, c->cols, MOE_FP8_E4M3, 1,
                                     &err) != MOE_OK)
        die("1x128 FP8 quantize", &err);
}

/* the copy moves as many bytes as the pass (up to 5 per element of x, which holds 2): from
 * the second half of its own scratch buffer into the first, not from x */
static void run_q1_copy(void *p) {
    q1_ctx *c = p;
    moe_cuda_copy(c->scratch, (uint8_t *)c->scratch + c->copy_bytes, c->copy_bytes);
}

/* the 1x128 quantize of x [rows, cols] bf16 (what: its name in the row), with y (the copy)
 * or not: ms and GB/s (bytes read + written: 2 an element read, 1 a code, 4 a 128-element
 * scale, and 2 an element of the copy) by v3 with the hardware's casts, v3 and the
 * vectorized kernel (MOE_QUANT_VEC=3, 2, 1; kernels/quantize.cu), next to a D2D copy of as
 * many bytes (half read, half written) in the same run */
static void bench_q1(const shape *s, const char *what, int rows, int cols, const void *x,
                     int with_y) {
    const size_t n = (size_t)rows * cols;
    const double bytes = (2.0 + 1.0 + (with_y ? 2.0 : 0.0)) * n + 4.0 * (n / MOE_QUANT_BLOCK);
    q1_ctx c = {.q = dalloc(n), .s = dalloc(4 * (n / MOE_QUANT_BLOCK)),
                .y = with_y ? dalloc(2 * n) : NULL, .x = x, .rows = rows, .cols = cols,
                .copy_bytes = (size_t)(bytes / 2) / 16 * 16};
    c.scratch = dalloc(2 * c.copy_bytes);
    const double copy_ms = time_ms(run_q1_copy, &c);
    const double copy_gbs = 2.0 * c.copy_bytes / (copy_ms * 1e-3) / 1e9;
    static const struct {
        int kernel;
        const char *name;
    } ks[] = {{3, "v3 hw"}, {2, "v3"}, {1, "vec"}};
    for (int k = 0; k < 3; k++) {
        moe_cuda_quant_1x128_set_kernel(ks[k].kernel);
        const double ms = time_ms(run_q1, &c);
        char impl[64];
        snprintf(impl, sizeof impl, "1x128 quantize %s%s (C=%d) %s", what, with_y ? "+y" : "",
                 cols, ks[k].name);
        bw_row(s, impl, ms, bytes, copy_ms, copy_gbs);
    }
    fflush(stdout);
    moe_cuda_quant_1x128_set_kernel(-1);
    moe_cuda_free(c.q), moe_cuda_free(c.s), moe_cuda_free(c.scratch);
    if (c.y)
        moe_cuda_free(c.y);
}

/* --shape q1x128 (and all): the 1x128 quantize alone at the native FP8 layer's largest
 * operand, Qwen3-235B's permuted x as chapters/01-naive-moe/ch01_moe_layer_bench.c
 * --shape qwen3-235b has it (lib/bench.c: 8192 tokens x top-8 = 65536 rows of H = 4096),
 * with the copy (as fc1's forward makes it) and without */
static void bench_q1_alone(void) {
    const int rows = 65536, cols = 4096;
    const size_t n = (size_t)rows * cols;
    shape s = {"q1x128", rows, cols, 0};
    printf("q1x128: the 1x128 quantize of Qwen3-235B's permuted x, %d x %d bf16\n", rows, cols);
    float *xf = dalloc(n * 4);
    moe_cuda_fill_normal(xf, n, 1236, 1, 1.0);
    void *x = dalloc(n * 2);
    moe_cuda_cast_to_act(x, xf, n);
    moe_cuda_free(xf);
    bench_q1(&s, "X", rows, cols, x, 1);
    bench_q1(&s, "X", rows, cols, x, 0);
    moe_cuda_free(x);
}

/* the wgrad rows of a grouped shape (above); the ratio column against the bf16 wgrad */
static void bench_wgrad(const shape *s, const int *off, int G, int rows, int N, int K,
                        const void *dy, const void *x, const int *doff) {
    const size_t kpad = moe_fp8_wgrad_kpad(rows, G);
    wgrad_ctx c = {.dw = dalloc((size_t)G * N * K * 4), .dy = dy, .x = x, .doff = doff, .G = G,
                   .rows = rows, .N = N, .K = K, .mode = MOE_DW_STORE, .kpad = kpad,
                   .qa = dalloc((size_t)N * kpad + 16), .qb = dalloc((size_t)K * kpad + 16),
                   .sa = dalloc(kpad / 128 * (size_t)N * 4 + 16),
                   .sb = dalloc(kpad / 128 * (size_t)K * 4 + 16)};
    const double saved = g_bf16_ms;
    run_wgrad_bf16(&c);
    g_bf16_ms = 1.0;
    g_bf16_ms = time_ms(run_wgrad_bf16, &c);
    report(s, "bf16 wgrad grouped (ours, fp32 dW)", g_bf16_ms, -1);
    c.quant = 1;
    run_wgrad_fp8(&c); /* the copies made once */
    c.quant = 0;
    /* the kernel's variants (the test checks they agree bit for bit): the pipelined loop
     * (two accumulator sets, the default) with the scales in shared memory (the default),
     * then read from global memory (as before), then the first loop (shared scales), all at
     * 128 columns, then the 128 × 256 tile */
    const int pipe = moe_cuda_fp8_wgrad_pipe(), ss = moe_cuda_fp8_wgrad_smem_scales();
    const int bn = moe_cuda_fp8_wgrad_bn();
    moe_cuda_fp8_wgrad_set_pipe(1);
    moe_cuda_fp8_wgrad_set_smem_scales(1);
    moe_cuda_fp8_wgrad_set_bn(128);
    report(s, "FP8 wgrad grouped, pipelined (ours, fp32 dW)", time_ms(run_wgrad_fp8, &c), -1);
    moe_cuda_fp8_wgrad_set_smem_scales(0);
    report(s, "FP8 wgrad pipelined, global scales (var.)", time_ms(run_wgrad_fp8, &c), -1);
    moe_cuda_fp8_wgrad_set_smem_scales(1);
    moe_cuda_fp8_wgrad_set_pipe(0);
    report(s, "FP8 wgrad grouped, first loop (variant)", time_ms(run_wgrad_fp8, &c), -1);
    const moe_wgrad_epi epi = moe_cuda_fp8_wgrad_epilogue();
    const int qtr = moe_cuda_fp8_wgrad_quarters();
    moe_cuda_fp8_wgrad_set_pipe(1);
    moe_cuda_fp8_wgrad_set_bn(256);
    moe_cuda_fp8_wgrad_set_epilogue(MOE_WGRAD_EPI_TMA); /* (whatever the variables say) */
    moe_cuda_fp8_wgrad_set_quarters(0);
    report(s, "FP8 wgrad grouped, 128x256 tile", time_ms(run_wgrad_fp8, &c), -1);
    /* the wide tile's other forms (the test checks they agree bit for bit): its fp32 sums
     * straight from registers (direct epilogue) and its promotion by quarters, storing, then
     * adding (a step's later micro-batches) beside the bf16 wgrad adding, with the RMW
     * epilogue and the default (auto) last */
    static const struct {
        moe_dw_mode mode;
        moe_wgrad_epi epi;
        int quarters;
        const char *name;
    } wide_rows[] = {
        {MOE_DW_STORE, MOE_WGRAD_EPI_DIRECT, 0, "FP8 wgrad 128x256, direct epilogue"},
        {MOE_DW_STORE, MOE_WGRAD_EPI_TMA, 1, "FP8 wgrad 128x256 by quarters"},
        {MOE_DW_ACCUMULATE, MOE_WGRAD_EPI_TMA, 0, "FP8 wgrad 128x256 +=, staged (TMA)"},
        {MOE_DW_ACCUMULATE, MOE_WGRAD_EPI_DIRECT, 0, "FP8 wgrad 128x256 +=, direct epilogue"},
        {MOE_DW_ACCUMULATE, MOE_WGRAD_EPI_TMA, 1, "FP8 wgrad 128x256 +=, by quarters"},
        {MOE_DW_ACCUMULATE, MOE_WGRAD_EPI_RMW, 0, "FP8 wgrad 128x256 +=, rmw"},
        {MOE_DW_ACCUMULATE, MOE_WGRAD_EPI_AUTO, 0, "FP8 wgrad 128x256 +=, auto epilogue"},
    };
    for (size_t i = 0; i < sizeof wide_rows / sizeof *wide_rows; i++) {
        if (wide_rows[i].mode != c.mode) { /* the first adding row: bf16's beside it */
            c.mode = wide_rows[i].mode;
            report(s, "bf16 wgrad grouped (ours, fp32 dW +=)", time_ms(run_wgrad_bf16, &c), -1);
        }
        moe_cuda_fp8_wgrad_set_epilogue(wide_rows[i].epi);
        moe_cuda_fp8_wgrad_set_quarters(wide_rows[i].quarters);
        report(s, wide_rows[i].name, time_ms(run_wgrad_fp8, &c), -1);
    }
    c.mode = MOE_DW_STORE;
    moe_cuda_fp8_wgrad_set_epilogue(epi);
    moe_cuda_fp8_wgrad_set_quarters(qtr);
    moe_cuda_fp8_wgrad_set_pipe(pipe);
    moe_cuda_fp8_wgrad_set_smem_scales(ss);
    moe_cuda_fp8_wgrad_set_bn(bn);
    c.quant = 1;
    report(s, pipe ? "FP8 wgrad pipelined + token-wise quantize"
                   : "FP8 wgrad first loop + token-wise quantize",
           time_ms(run_wgrad_fp8, &c), -1);
    bench_tq(s, off, G, rows, "dY", N, dy, doff, c.qa, c.sa, kpad);
    bench_tq(s, off, G, rows, "X", K, x, doff, c.qb, c.sb, kpad);
    g_bf16_ms = saved;
    moe_cuda_free(c.dw), moe_cuda_free(c.qa), moe_cuda_free(c.qb), moe_cuda_free(c.sa);
    moe_cuda_free(c.sb);
}

/* 64 sampled outputs of a grouped GEMM (bf16 D), row i of group g against row g·N + j of B */
static double check_grouped(const void *d, const int *off, int G, int rows, int N, int K,
                            row_fn arow, const void *asrc, row_fn brow, const void *bsrc) {
    float *a = malloc((size_t)K * 4), *b = malloc((size_t)K * 4);
    double worst = 0;
    for (int s = 0; s < 64; s++) {
        const int i = (int)(moe_rng_uniform(96, 1, (uint64_t)s) * rows) % rows;
        const int j = (int)(moe_rng_uniform(96, 2, (uint64_t)s) * N) % N;
        int g = 0;
        while (off[g + 1] <= i)
            g++;
        arow(a, asrc, i, K);
        brow(b, bsrc, g * N + j, K);
        const double e = element_error(d, N, i, j, a, b, K);
        worst = e > worst ? e : worst;
    }
    free(a), free(b);
    return worst;
}

static void bench_grouped(const gshape *gs) {
    const int G = gs->G, rows = gs->rows, N = gs->N, K = gs->K;
    /* the 128x128 weight blocks of all experts quantized at once are each expert's own blocks
     * only when N is a multiple of 128 (true of every shape here) */
    if (N % 128 || K % 128) {
        fprintf(stderr, "ch05_fp8_gemm_bench: %s: N and K must be multiples of 128\n", gs->name);
        exit(1);
    }
    shape s = {gs->name, rows, N, K}; /* for report(): 2·rows·N·K FLOPs */
    int *off = malloc(sizeof(int) * (size_t)(G + 1));
    group_sizes(off, G, rows);
    int lo = rows, hi = 0;
    for (int g = 0; g < G; g++) {
        const int n = off[g + 1] - off[g];
        lo = n < lo ? n : lo;
        hi = n > hi ? n : hi;
    }
    printf("%s: %d experts, %d rows (%d to %d per expert), N=%d, K=%d\n", gs->name, G, rows, lo,
           hi, N, K);
    const size_t nx = (size_t)rows * K, nw = (size_t)G * N * K;
    float *x = dalloc(nx * 4), *w = dalloc(nw * 4);
    moe_cuda_fill_normal(x, nx, 1235, 1, 1.0);
    moe_cuda_fill_normal(x + (size_t)(rows / 2) * K, (size_t)16 * K, 1235, 2, 50.0);
    moe_cuda_fill_normal(w, nw, 1235, 3, 0.02);
    void *xb = dalloc(nx * 2), *wb = dalloc(nw * 2), *d = dalloc((size_t)rows * N * 2);
    moe_cuda_cast_to_act(xb, x, nx);
    moe_cuda_cast_to_act(wb, w, nw);
    int *doff = dalloc(sizeof(int) * (size_t)(G + 1));
    moe_cuda_from_host(doff, off, sizeof(int) * (size_t)(G + 1));

    qop a, b;
    qop_make(&a, MOE_QUANT_BLOCK_1X128, MOE_FP8_E4M3, x, rows, K);
    qop_make(&b, MOE_QUANT_BLOCK_128X128, MOE_FP8_E4M3, w, G * N, K);
    grouped_ctx c = {.d = d, .xb = xb, .wb = wb, .a = &a, .qa = a.q, .qb = b.q, .doff = doff,
                     .G = G, .rows = rows, .N = N, .K = K};

    if (moe_cuda_grouped_sm90_available()) {
        run_grouped_bf16(&c);
        g_bf16_ms = 1.0;
        const double chk = check_grouped(d, off, G, rows, N, K, bf16_rowfn, xb, bf16_rowfn, wb);
        g_bf16_ms = time_ms(run_grouped_bf16, &c);
        report(&s, "bf16 grouped (ours, baseline)", g_bf16_ms, chk);

        moe_error err;
        if (moe_cuda_fp8_grouped_gemm(d, 0, &c.qa, &c.qb, doff, G, rows, N, K, &err) != MOE_OK)
            die("FP8 grouped GEMM", &err);
        hop ha, hb;
        hop_make(&ha, &a);
        hop_make(&hb, &b);
        const double chk8 = check_grouped(d, off, G, rows, N, K, hop_rowfn, &ha, hop_rowfn, &hb);
        const double ms8 = time_ms(run_grouped_fp8, &c);
        report(&s, "FP8 grouped blockwise (ours)", ms8, chk8);
        c.quant_a = 1;
        report(&s, "FP8 grouped blockwise + quantize A", time_ms(run_grouped_fp8, &c), -1);
        c.quant_a = 0;
        /* the other variant of the kernel (the consumer warpgroups issuing together or in
         * turn), checked again */
        const int def = moe_cuda_fp8_grouped_ordered();
        moe_cuda_fp8_grouped_set_ordered(!def);
        /* poisoned first: 1e30 as fp32 is two large bf16 values */
        moe_cuda_fill_real(d, 1e30, (size_t)rows * N * 2 / sizeof(moe_real));
        run_grouped_fp8(&c);
        const double chkv = check_grouped(d, off, G, rows, N, K, hop_rowfn, &ha, hop_rowfn, &hb);
        report(&s, def ? "FP8 grouped, lockstep issue (variant)"
                       : "FP8 grouped, ordered issue (variant)",
               time_ms(run_grouped_fp8, &c), chkv);
        moe_cuda_fp8_grouped_set_ordered(def);
        /* the other tile width (128 x 256 with the split promotion, or 128 x 128 where the
         * wide one is the default; the default issue order), checked again */
        const int bn = moe_cuda_fp8_grouped_bn();
        moe_cuda_fp8_grouped_set_bn(bn == 256 ? 128 : 256);
        moe_cuda_fill_real(d, 1e30, (size_t)rows * N * 2 / sizeof(moe_real));
        run_grouped_fp8(&c);
        const double chkw = check_grouped(d, off, G, rows, N, K, hop_rowfn, &ha, hop_rowfn, &hb);
        const double msw = time_ms(run_grouped_fp8, &c);
        report(&s, bn == 256 ? "FP8 grouped, 128x128 tile (variant)"
                             : "FP8 grouped, 128x256 tile (BN=256)",
               msw, chkw);
        moe_cuda_fp8_grouped_set_bn(bn);
        /* the dense ceiling: expert 0's weights for every row (B's first N rows) */
        run_dense_ceiling(&c);
        const double chkd = check(d, rows, N, K, hop_rowfn, &ha, hop_rowfn, &hb);
        const double msd = time_ms(run_dense_ceiling, &c);
        report(&s, "FP8 blockwise dense cuBLASLt (ceiling)", msd, chkd);
        /* the fraction of the ceiling each tile width reaches (time ratio = TFLOP/s ratio) */
        printf("%-6s %20s  FP8 grouped / ceiling: 128x128 tile %.2f, 128x256 tile %.2f\n",
               gs->name, "", msd / (bn == 256 ? msw : ms8), msd / (bn == 256 ? ms8 : msw));
        /* the wgrad of this shape: dY = the forward's output just written (bf16 values) */
        bench_wgrad(&s, off, G, rows, N, K, d, xb, doff);
        /* the native layer's 1x128 quantize of X (fc1's input) and of dY ([rows, N]: as
         * fc2's dgrad quantizes its output gradient), each with its dequantized copy */
        bench_q1(&s, "X", rows, K, xb, 1);
        bench_q1(&s, "dY", rows, N, d, 1);
        /* the SwiGLU forward under the FP8 wgrad, on that output as [g | u] */
        bench_swiglu(&s, off, G, rows, N, d, doff);
        hop_free(&ha), hop_free(&hb);
    } else {
        printf("%s: skipped: our grouped kernels are sm_90a (Hopper) only\n", gs->name);
    }
    qop_free(&a), qop_free(&b);
    moe_cuda_free(x), moe_cuda_free(w), moe_cuda_free(xb), moe_cuda_free(wb), moe_cuda_free(d);
    moe_cuda_free(doff);
    free(off);
}

int main(int argc, char **argv) {
    const char *want = "all", *tsv = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--repeats") && i + 1 < argc)
            g_repeats = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--warmup") && i + 1 < argc)
            g_warmup = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--shape") && i + 1 < argc)
            want = argv[++i];
        else if (!strcmp(argv[i], "--tsv") && i + 1 < argc)
            tsv = argv[++i];
        else {
            fprintf(stderr,
                    "usage: %s [--repeats 15] [--warmup 5] [--shape all|dense|fc1|fc2|qwen|moe|"
                    "qwen3-fc1|qwen3-fc2|mixtral-fc1|mixtral-fc2|qwen3-235b-fc1|"
                    "qwen3-235b-fc2|q1x128] [--tsv file]\n",
                    argv[0]);
            return 2;
        }
    }
    if (g_repeats < 1 || g_warmup < 0) {
        fprintf(stderr, "ch05_fp8_gemm_bench: --repeats must be >= 1 and --warmup >= 0\n");
        return 2;
    }
    if (!moe_cuda_available()) {
        printf("ch05_fp8_gemm_bench: skipped: no GPU\n");
        return 0;
    }
    if (tsv && !(g_tsv = fopen(tsv, "w"))) {
        fprintf(stderr, "ch05_fp8_gemm_bench: cannot write --tsv %s\n", tsv);
        return 1;
    }
    char dev[256];
    moe_cuda_device_name(dev, sizeof dev);
    moe_bench_header("chapter 05: dense FP8 / FP4 GEMMs vs bf16 cuBLAS", dev);
    printf("median of %d samples after %d warm-up calls; check: 64 sampled outputs vs the host "
           "product of the dequantized operands (ok when the ratio <= 1)\n",
           g_repeats, g_warmup);
    printf("%-6s %6s %6s %6s  %-38s %9s %9s %8s   %s\n", "shape", "M", "N", "K", "GEMM", "ms",
           "TFLOP/s", "vs bf16", "check");
    int any = 0;
    for (size_t i = 0; i < sizeof g_shapes / sizeof *g_shapes; i++)
        if (!strcmp(want, "all") || !strcmp(want, g_shapes[i].name)) {
            bench_shape(&g_shapes[i]);
            any = 1;
        }
    for (size_t i = 0; i < sizeof g_gshapes / sizeof *g_gshapes; i++)
        if (!strcmp(want, "all") || !strcmp(want, "moe") || !strcmp(want, g_gshapes[i].name)) {
            printf("\n");
            bench_grouped(&g_gshapes[i]);
            any = 1;
        }
    if (!strcmp(want, "all") || !strcmp(want, "q1x128")) {
        printf("\n");
        bench_q1_alone();
        any = 1;
    }
    if (g_tsv)
        fclose(g_tsv);
    if (!any) {
        fprintf(stderr, "ch05_fp8_gemm_bench: unknown --shape %s\n", want);
        return 2;
    }
    return 0;
}
