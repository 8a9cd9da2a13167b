/*
 * The CPU backend: the op table of backend.h filled with the reference ops.
 *
 * The table speaks in `void *` for activations because their element type belongs
 * to the backend; on the CPU it is moe_real, so each entry below is a one-line
 * adapter that hands the buffers to the typed reference op in lib/cpu/.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cp_layout.h"
#include "fp8_wgrad.h"
#include "cpu/moe_ops.h"
#include "cpu/ops.h"
#include "cpu/router.h"
#include "memory.h"
#include "optimizer.h"
#include "rng.h"
#include "timer.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* ------------------------------------------------------- memory and precision */

static void *cpu_alloc(size_t bytes) { return calloc(1, bytes ? bytes : 1); }
static void cpu_free(void *p) { free(p); }
static void cpu_zero(void *p, size_t bytes) { memset(p, 0, bytes); }
static void cpu_copy(void *dst, const void *src, size_t bytes) { memcpy(dst, src, bytes); }
static void cpu_copy_2d(void *dst, size_t dpitch, const void *src, size_t spitch,
                        size_t width, size_t rows) {
    for (size_t r = 0; r < rows; r++)
        memcpy((char *)dst + r * dpitch, (const char *)src + r * spitch, width);
}
static void cpu_fill_real(moe_real *x, double v, size_t n) {
    for (size_t i = 0; i < n; i++)
        x[i] = (moe_real)v;
}
/* the activation type is moe_real: the chapter's merge as it is */
static void cpu_cp_merge(void *y, moe_real *lse, const void *y_b, const moe_real *lse_b, int B,
                         int T, int H, int D) {
    moe_cp_merge(y, lse, y_b, lse_b, B, T, H, D);
}
static void cpu_read_act(moe_real *host, const void *src, size_t n) {
    memcpy(host, src, n * sizeof(moe_real));
}
static void cpu_write_act(void *dst, const moe_real *host, size_t n) {
    memcpy(dst, host, n * sizeof(moe_real));
}
static void cpu_cast_to_act(void *dst, const moe_real *src, size_t n) {
    if (dst != src)
        memcpy(dst, src, n * sizeof(moe_real));
}
static void cpu_synchronize(void) {}

static void cpu_device_name(char *buf, size_t cap) {
    char model[200] = "unknown CPU";
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (f) {
        char line[512];
        while (fgets(line, sizeof line, f))
            if (!strncmp(line, "model name", 10)) {
                const char *colon = strchr(line, ':');
                if (colon) {
                    snprintf(model, sizeof model, "%s", colon + 2);
                    model[strcspn(model, "\n")] = '\0';
                }
                break;
            }
        fclose(f);
    }
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    snprintf(buf, cap, "CPU: %s, %d threads", model, threads);
}

static double cpu_peak_tflops(void) { return 0.0; }
static size_t cpu_memory_bytes(void) { return (size_t)moe_memory_host_bytes(); }

static double g_timer_t0;
static void cpu_timer_begin(void) { g_timer_t0 = moe_time_now(); }
static double cpu_timer_end_ms(void) { return 1e3 * (moe_time_now() - g_timer_t0); }

static void cpu_fill_normal(moe_real *x, size_t n, unsigned long long seed,
                            unsigned long long stream, double std) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++)
        x[i] = (moe_real)(std * moe_rng_normal(seed, stream, i));
}

/* ------------------------------------------------------------- adapters */

static void a_matmul_forward(void *out, const void *in, const void *w, int N, int I, int O) {
    moe_cpu_matmul_forward(out, in, w, N, I, O);
}
static void a_matmul_backward(void *din, moe_real *dw, const void *dout, const void *in,
                              const void *w, int N, int I, int O) {
    moe_cpu_matmul_backward(din, dw, dout, in, w, N, I, O);
}
/* the CPU's "device memory" is host memory: the device copy of the offsets is a memcpy */
static void a_permute_index(int *perm_src, int *row_of, int *expert_offset, int *dev_offset,
                            long long *counts, const int *topk_idx, int N, int k, int E) {
    moe_cpu_permute_index(perm_src, row_of, expert_offset, counts, topk_idx, N, k, E);
    if (dev_offset)
        memcpy(dev_offset, expert_offset, sizeof(int) * (E + 1));
}

/* grouped matmul on the CPU (grouped_matmul.c): the loop over groups */
static void cpu_grouped_forward(void *out, const void *in, const void *w, const int *off, int G,
                                int I, int O) {
    moe_cpu_grouped_matmul_forward(out, in, w, off, G, I, O);
}
static void cpu_grouped_backward(void *din, moe_real *dw, const void *dout, const void *in,
                                 const void *w, const int *off, int G, int I, int O) {
    moe_cpu_grouped_matmul_backward(din, dw, dout, in, w, off, G, I, O);
}

/* ... and with the offsets in "device" memory, which on the CPU is the same loop */
static void cpu_grouped_forward_dev(void *out, const void *in, const void *w, const int *dev_off,
                                    int G, int rows, int I, int O) {
    MOE_ASSERT(dev_off[G] <= rows); /* (the EP expert side: a budget, partly filled) */
    cpu_grouped_forward(out, in, w, dev_off, G, I, O);
}
static void cpu_grouped_backward_dev(void *din, void *dw, const void *dout, const void *in,
                                     const void *w, const int *dev_off, int G, int rows, int I,
                                     int O, int din_accumulate, moe_dw_mode dw_mode) {
    MOE_ASSERT(dev_off[G] <= rows);
    if (din && !din_accumulate)
        memset(din, 0, sizeof(moe_real) * (size_t)rows * I);
    /* an overwritten dw is a sum that starts from zero; the CPU's activation type is
     * moe_real, so MOE_DW_ACT is the same as MOE_DW_STORE here */
    if (dw && dw_mode != MOE_DW_ACCUMULATE)
        memset(dw, 0, sizeof(moe_real) * (size_t)G * O * I);
    cpu_grouped_backward(din, dw, dout, in, w, dev_off, G, I, O);
}

/* ... and on gathered rows: the reference copies them (the permutation the GPU kernel
 * fuses away), then runs the plain op */
static moe_real *gathered(const void *x, const int *map, int div, int rows, int I) {
    moe_real *xp = malloc(sizeof(moe_real) * ((size_t)rows * I + 1));
    MOE_CHECK_ALLOC(xp, sizeof(moe_real) * (size_t)rows * I, "a gathered grouped-GEMM input");
    moe_cpu_permute_tokens(xp, x, map, rows, div, I);
    return xp;
}
static void cpu_grouped_forward_dev_gather(void *out, const void *x, const int *map, int div,
                                           const void *w, const int *dev_off, int G, int rows,
                                           int I, int O) {
    moe_real *xp = gathered(x, map, div, rows, I);
    cpu_grouped_forward_dev(out, xp, w, dev_off, G, rows, I, O);
    free(xp);
}
static void cpu_grouped_backward_dev_gather(void *din, void *dw, const void *dout, const void *x,
                                            const int *map, int div, const void *w,
                                            const int *dev_off, int G, int rows, int I, int O,
                                            int din_accumulate, moe_dw_mode dw_mode) {
    moe_real *xp = gathered(x, map, div, rows, I);
    cpu_grouped_backward_dev(din, dw, dout, xp, w, dev_off, G, rows, I, O, din_accumulate,
                             dw_mode);
    free(xp);
}

/* ... and with its output rows scattered: row r to row map[r] (the fused permutation's fc2).
 * The reference computes contiguously, then moves the rows (the pass the GPU kernel's
 * epilogue fuses away). */
static void cpu_grouped_forward_dev_scatter(void *out, const void *in, const int *map,
                                            const void *w, const int *dev_off, int G, int rows,
                                            int I, int O) {
    moe_real *yp = malloc(sizeof(moe_real) * ((size_t)rows * O + 1));
    MOE_CHECK_ALLOC(yp, sizeof(moe_real) * (size_t)rows * O, "a scattered grouped-GEMM output");
    cpu_grouped_forward_dev(yp, in, w, dev_off, G, rows, I, O);
    for (int r = 0; r < dev_off[G]; r++)
        memcpy((moe_real *)out + (size_t)map[r] * O, yp + (size_t)r * O, sizeof(moe_real) * O);
    free(yp);
}

static void a_embedding_forward(void *out, const int *tokens, const void *table, int N, int C) {
    moe_cpu_embedding_forward(out, tokens, table, N, C);
}
static void a_embedding_backward(moe_real *dtable, const void *dout, const int *tokens, int N,
                                 int V, int C) {
    moe_cpu_embedding_backward(dtable, dout, tokens, N, V, C);
}
static void a_rmsnorm_forward(void *out, moe_real *rstd, const void *x, const void *w, int N,
                              int C, double eps) {
    moe_cpu_rmsnorm_forward(out, rstd, x, w, N, C, eps);
}
static void a_rmsnorm_backward(void *dx, moe_real *dw, const void *dout, const void *x,
                               const void *w, const moe_real *rstd, int N, int C) {
    moe_cpu_rmsnorm_backward(dx, dw, dout, x, w, rstd, N, C);
}
static void a_rope_forward(void *out, const void *in, int B, int T, int h, int D, int pos0,
                           double base) {
    moe_cpu_rope_forward(out, in, B, T, h, D, pos0, base);
}
static void a_rope_backward(void *din, const void *dout, int B, int T, int h, int D, int pos0,
                            double base) {
    moe_cpu_rope_backward(din, dout, B, T, h, D, pos0, base);
}
static void a_attention_forward(void *y, moe_real *lse, void *ws, const void *q, const void *k,
                                const void *v, moe_attention_shape s) {
    moe_cpu_attention_forward(y, lse, ws, q, k, v, s);
}
static void a_attention_backward(void *dq, void *dk, void *dv, const void *dy, const void *y,
                                 const moe_real *lse, void *ws, const void *q, const void *k,
                                 const void *v, moe_attention_shape s) {
    moe_cpu_attention_backward(dq, dk, dv, dy, y, lse, ws, q, k, v, s);
}
static void a_swiglu_forward(void *out, const void *gu, const moe_real *row_scale, int N, int F) {
    moe_cpu_swiglu_forward(out, gu, row_scale, N, F);
}
static void a_swiglu_backward(void *dgu, moe_real *drow_scale, const void *dout, const void *gu,
                              const moe_real *row_scale, int N, int F) {
    moe_cpu_swiglu_backward(dgu, drow_scale, dout, gu, row_scale, N, F);
}
static void a_ce_forward(moe_real *losses, const void *logits, const int *t, int N, int V) {
    moe_cpu_cross_entropy_forward(losses, logits, t, N, V);
}
static void a_ce_backward(void *dlogits, const moe_real *dloss, const void *logits, const int *t,
                          int N, int V) {
    moe_cpu_cross_entropy_backward(dlogits, dloss, logits, t, N, V);
}
static void a_ce_shard_forward(moe_real *part, const void *logits, const int *t, int N, int V) {
    moe_cpu_cross_entropy_shard_forward(part, logits, t, N, V);
}
static void a_ce_shard_backward(void *dlogits, const moe_real *dloss, const void *logits,
                                const moe_real *lse, const int *t, int N, int V) {
    moe_cpu_cross_entropy_shard_backward(dlogits, dloss, logits, lse, t, N, V);
}
/* the emulation's token-wise QDQ (lib/fp8_wgrad.h) on moe_real values, through fp32 */
static void cpu_qdq_group_t(void *dst, const void *src, const int *off, int G, int rows,
                            int cols, moe_fp8_format f, int pow2) {
    const size_t n = (size_t)rows * cols;
    float *x = malloc(sizeof(float) * (n ? n : 1));
    MOE_ASSERT(x);
    for (size_t i = 0; i < n; i++)
        x[i] = (float)((const moe_real *)src)[i];
    moe_error err;
    const moe_status st = moe_cpu_qdq_group_t(x, x, off, G, rows, cols, f, pow2, &err);
    if (st != MOE_OK)
        fprintf(stderr, "token-wise QDQ: %s\n", err.msg);
    MOE_ASSERT(st == MOE_OK); /* the model checked every shape at start-up */
    const int end = off[G]; /* rows past the groups: not written (as the CUDA op) */
    for (size_t i = 0; i < (size_t)end * cols; i++)
        ((moe_real *)dst)[i] = x[i];
    free(x);
}

static void cpu_add(void *yv, const void *xv, size_t n) {
    moe_real *y = yv;
    const moe_real *x = xv;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++)
        y[i] += x[i];
}
static void cpu_scale(void *xv, double s, size_t n) {
    moe_real *x = xv;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++)
        x[i] = (moe_real)(x[i] * s);
}

/* ------------------------------------------------------------------- MoE ops */

static void a_router_forward(int *idx, moe_real *w, const void *logits, const float *bias,
                             const moe_router_params *p, int N) {
    moe_cpu_router_forward(idx, w, logits, bias, p, N);
}
static void a_router_backward(void *dlogits, const moe_real *dw, const void *logits,
                              const int *idx, const moe_router_params *p, int N) {
    moe_cpu_router_backward(dlogits, dw, logits, idx, p, N);
}
static void a_aux_counts(long long *counts, const void *logits, const moe_aux_shape *s) {
    moe_cpu_aux_loss_counts(counts, logits, s);
}
static void a_aux_forward(double *acc, const void *logits, const long long *counts,
                          const moe_aux_shape *s, double coeff) {
    *acc += moe_cpu_aux_loss_forward_shard(logits, counts, s, coeff);
}
static void a_aux_backward(void *dlogits, const void *logits, const long long *counts,
                           const moe_aux_shape *s, double coeff, double scale) {
    moe_cpu_aux_loss_backward_shard(dlogits, logits, counts, s, coeff, scale);
}
static void a_z_forward(double *acc, const void *logits, int N, int E, double coeff) {
    *acc += moe_cpu_z_loss_forward(logits, N, E, coeff);
}
static void a_z_backward(void *dlogits, const void *logits, int N, int E, double coeff,
                         double scale) {
    moe_cpu_z_loss_backward(dlogits, logits, N, E, coeff, scale);
}
static void a_permute_tokens(void *xp, const void *x, const int *src, int rows, int k, int C) {
    moe_cpu_permute_tokens(xp, x, src, rows, k, C);
}
static void a_unpermute_sum(void *out, const void *yp, const int *row_of, int N, int k, int C) {
    moe_cpu_unpermute_sum(out, yp, row_of, N, k, C);
}
static void a_unpermute_sum_slots(void *out, const void *ys, const int *row_of, int N, int k,
                                  int C) {
    moe_cpu_unpermute_sum_slots(out, ys, row_of, N, k, C);
}
static void cpu_gather_rows(void *dstv, const void *srcv, const int *map, int rows, int C) {
    moe_real *dst = dstv;
    const moe_real *src = srcv;
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        if (map[r] < 0)
            memset(dst + (size_t)r * C, 0, sizeof(moe_real) * C);
        else
            memcpy(dst + (size_t)r * C, src + (size_t)map[r] * C, sizeof(moe_real) * C);
    }
}
static void cpu_gather_reals(moe_real *dst, const moe_real *src, const int *map, int rows) {
    for (int r = 0; r < rows; r++)
        dst[r] = map[r] < 0 ? 0 : src[map[r]];
}

/* ----------------------------------------------------------------- optimizer */

/* Fixed-size blocks summed in order: the same result for any thread count. */
#define BLK 4096
static double block_sum(const moe_real *x, size_t n, int square) {
    size_t nb = (n + BLK - 1) / BLK;
    double *part = calloc(nb ? nb : 1, sizeof(double));
    MOE_CHECK_ALLOC(part, nb * sizeof(double), "the gradient-norm partial sums");
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < nb; b++) {
        double s = 0.0;
        size_t end = (b + 1) * BLK < n ? (b + 1) * BLK : n;
        for (size_t i = b * BLK; i < end; i++)
            s += square ? (double)x[i] * x[i] : (double)x[i];
        part[b] = s;
    }
    double total = 0.0;
    for (size_t b = 0; b < nb; b++)
        total += part[b];
    free(part);
    return total;
}
static void cpu_sum_squares(double *acc, const moe_real *x, size_t n) {
    *acc += block_sum(x, n, 1);
}
static void cpu_sum(double *acc, const moe_real *x, size_t n) { *acc += block_sum(x, n, 0); }
static void cpu_add_f64(double *dst, const double *src, int n) {
    for (int i = 0; i < n; i++)
        dst[i] += src[i];
}
static void cpu_scale_real(moe_real *x, double s, size_t n) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++)
        x[i] = (moe_real)(x[i] * s);
}
/* The multi-tensor AdamW: the same loop as the CUDA kernel (kernels/optimizer.cu), one
 * iteration per chunk, each finding its run by a binary search. The compute copy is the
 * weight itself (the activation type is moe_real: cast_to_act is a copy), written after
 * the update, or of the unchanged weight on a skipped step. */
static void cpu_adamw(const moe_adamw_runs *runs, moe_real *p, const moe_real *g, float *m,
                      float *v, void *act, double lr, double beta1, double beta2, double eps,
                      double wd, double bc1, double bc2, const double *clip, const int *flags,
                      const double *hyper) {
    const int skip = flags && *flags; /* the step is skipped: its loss or norm is bad, or it
                                       * overflowed */
    if (skip && !act)
        return;
    if (hyper) {
        lr = hyper[0];
        bc1 = hyper[1];
        bc2 = hyper[2];
    }
    const double c = clip ? *clip : 1.0;
    moe_real *a = act;
#pragma omp parallel for schedule(static)
    for (size_t k = 0; k < runs->chunks; k++) {
        const moe_adamw_run r = runs->run[moe_adamw_run_of_chunk(runs->run, runs->n, k)];
        const size_t lo = (k - r.chunk) * MOE_ADAMW_CHUNK;
        const size_t hi = lo + MOE_ADAMW_CHUNK < r.n ? lo + MOE_ADAMW_CHUNK : r.n;
        const double d = r.decay ? wd : 0.0;
        for (size_t i = lo; i < hi; i++) {
            moe_real *w = &p[r.weight + i];
            if (!skip) /* g·1.0 == g exactly: no clip is no change */
                moe_adamw_update(w, (moe_real)(g[r.grad + i] * c), &m[r.state + i],
                                 &v[r.state + i], lr, beta1, beta2, eps, d, bc1, bc2);
            if (a)
                a[r.grad + i] = *w;
        }
    }
}

/* --------------------------------------------------- the step's scalars (chapter 06) */

static void cpu_loss_accumulate(double *step, const double *mb, int N, double accum) {
    moe_step_loss_accumulate(step, mb, N, accum);
}
static void cpu_grad_norm_finalize(moe_step_scalars *s, double max_norm, int check) {
    moe_step_grad_norm_finalize(s, max_norm, check);
}
static void cpu_expert_load_add(long long *load, const int *topk_idx, int N, int k, int E) {
    for (size_t i = 0; i < (size_t)N * k; i++) {
        MOE_ASSERT(topk_idx[i] >= 0 && topk_idx[i] < E);
        load[topk_idx[i]]++;
    }
}
static void cpu_expert_bias_update(float *bias, const long long *load, int E, double rate,
                                   const int *flags) {
    if (!(flags && *flags))
        moe_expert_bias_update(bias, load, E, rate);
}
static void *cpu_host_alloc(size_t bytes) { return calloc(1, bytes ? bytes : 1); }
static void cpu_wait_to_host(void) {}

static const moe_backend g_cpu = {
    .name = "cpu",
    .device = MOE_DEVICE_CPU,
    .act_size = sizeof(moe_real),
    .alloc = cpu_alloc,
    .free = cpu_free,
    .zero = cpu_zero,
    .copy = cpu_copy,
    .to_host = cpu_copy,
    .from_host = cpu_copy,
    .copy_2d = cpu_copy_2d,
    .fill_real = cpu_fill_real,
    .read_act = cpu_read_act,
    .write_act = cpu_write_act,
    .cast_to_act = cpu_cast_to_act,
    .synchronize = cpu_synchronize,
    .device_name = cpu_device_name,
    .peak_tflops = cpu_peak_tflops,
    .memory_bytes = cpu_memory_bytes,
    .timer_begin = cpu_timer_begin,
    .timer_end_ms = cpu_timer_end_ms,
    .fill_normal = cpu_fill_normal,
    .matmul_forward = a_matmul_forward,
    .matmul_backward = a_matmul_backward,
    .grouped_matmul_forward = cpu_grouped_forward,
    .grouped_matmul_backward = cpu_grouped_backward,
    .grouped_matmul_forward_dev = cpu_grouped_forward_dev,
    .grouped_matmul_backward_dev = cpu_grouped_backward_dev,
    .grouped_matmul_forward_dev_gather = cpu_grouped_forward_dev_gather,
    .grouped_matmul_backward_dev_gather = cpu_grouped_backward_dev_gather,
    .grouped_matmul_forward_dev_scatter = cpu_grouped_forward_dev_scatter,
    .embedding_forward = a_embedding_forward,
    .embedding_backward = a_embedding_backward,
    .rmsnorm_forward = a_rmsnorm_forward,
    .rmsnorm_backward = a_rmsnorm_backward,
    .rope_forward = a_rope_forward,
    .rope_backward = a_rope_backward,
    .attention_workspace_bytes = moe_cpu_attention_workspace_bytes,
    .attention_forward = a_attention_forward,
    .attention_backward = a_attention_backward,
    .cp_merge = cpu_cp_merge,
    .swiglu_forward = a_swiglu_forward,
    .swiglu_backward = a_swiglu_backward,
    .cross_entropy_forward = a_ce_forward,
    .cross_entropy_backward = a_ce_backward,
    .cross_entropy_shard_forward = a_ce_shard_forward,
    .cross_entropy_shard_merge = moe_cpu_cross_entropy_shard_merge,
    .cross_entropy_shard_backward = a_ce_shard_backward,
    .qdq = moe_cpu_qdq,
    .fp8_quant_act = moe_cpu_quant_blockwise_act,
    .fp8_dequant_act = moe_cpu_dequant_blockwise_act,
    .qdq_group_t = cpu_qdq_group_t,
    .qdq_t = moe_cpu_qdq_t,
    .add = cpu_add,
    .scale = cpu_scale,
    .router_forward = a_router_forward,
    .router_backward = a_router_backward,
    .aux_loss_counts = a_aux_counts,
    .aux_loss_forward = a_aux_forward,
    .aux_loss_backward = a_aux_backward,
    .z_loss_forward = a_z_forward,
    .z_loss_backward = a_z_backward,
    .permute_index = a_permute_index,
    .permute_index_budget = moe_cpu_permute_index_budget,
    .fused_plan = moe_cpu_fused_plan,
    .permute_tokens = a_permute_tokens,
    .permute_weights = moe_cpu_permute_weights,
    .unpermute_sum = a_unpermute_sum,
    .unpermute_sum_slots = a_unpermute_sum_slots,
    .unpermute_weights = moe_cpu_unpermute_weights,
    .gather_rows = cpu_gather_rows,
    .gather_reals = cpu_gather_reals,
    .sum_squares = cpu_sum_squares,
    .sum = cpu_sum,
    .add_f64 = cpu_add_f64,
    .scale_real = cpu_scale_real,
    .adamw = cpu_adamw,
    .loss_accumulate = cpu_loss_accumulate,
    .grad_norm_finalize = cpu_grad_norm_finalize,
    .expert_load_add = cpu_expert_load_add,
    .expert_bias_update = cpu_expert_bias_update,
    .host_alloc = cpu_host_alloc,
    .host_free = cpu_free,
    .to_host_async = cpu_copy,
    .wait_to_host = cpu_wait_to_host,
    .from_host_async = cpu_copy,
};

const moe_backend *moe_backend_cpu(void) { return &g_cpu; }
