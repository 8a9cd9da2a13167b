/*
 * CUDA MoE ops against their CPU twins (lib/cpu/router.c, aux_loss.c, permute.c), on fresh
 * random inputs. (The routing weight's product with the activation and its gradient are
 * fused into SwiGLU: tests/gpu_dense.c checks them.)
 *
 * Inputs are rounded to bf16 on the host and the SAME rounded values are given to both
 * sides (the CPU gets them as fp32, the GPU as bf16), so differences come only from the
 * op. Outputs are poisoned first (0xFF bytes: NaN for floats, −1 for ints) and the
 * accumulating outputs are pre-filled with random values, so a kernel that forgets to
 * write, or overwrites instead of adding, fails.
 *
 * Tolerances:
 *  - routing indices, permutation maps, offsets, counts: exactly equal. The logits are
 *    drawn so that the ranking is never decided by rounding: rows whose selection scores
 *    (or group scores) come within 2e-5 of each other are drawn again; exactly equal
 *    scores from exactly equal logits are kept (both sides break them to the lower index);
 *  - routing weights: 1e-5 relative (fp32 on the GPU, double on the CPU);
 *  - loss values: 1e-5 relative;
 *  - bf16 gradients accumulated into a random pre-fill: |error| ≤ 1e-2·(|reference| +
 *    max |increment|) elementwise (the bf16 rounding of the sum alone is 2^-8 relative);
 *  - pure copies and fp32 sums in the CPU's order (unpermute_sum): bit-exact after the one
 *    bf16 rounding.
 * The file converts fp32 ↔ bf16 itself (round to nearest even) and moves data with plain
 * cudaMemcpy plus cudaDeviceSynchronize, so it needs nothing from kernels/memory.cu.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/moe_ops.h"
#include "cpu/router.h"
#include "cuda_ops.h"
#include "helpers.h"
#include "suites.h"

/* ------------------------------------------------------------------ bf16 and memory */

static uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static float bf2f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void round_bf16(moe_real *x, size_t n) {
    for (size_t i = 0; i < n; i++)
        x[i] = bf2f(f2bf(x[i]));
}

#define CK_CUDA(call)                                                                       \
    do {                                                                                    \
        cudaError_t e_ = (call);                                                            \
        ck_assert_msg(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));          \
    } while (0)

/* Device buffer of @p bytes filled with 0xFF (NaN / −1). */
static void *dnew(size_t bytes) {
    void *p = NULL;
    CK_CUDA(cudaMalloc(&p, bytes ? bytes : 1));
    CK_CUDA(cudaMemset(p, 0xFF, bytes ? bytes : 1));
    CK_CUDA(cudaDeviceSynchronize());
    return p;
}

static void dput(void *d, const void *h, size_t bytes) {
    CK_CUDA(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
    CK_CUDA(cudaDeviceSynchronize());
}

/* Waits for every stream (the ops run on a non-blocking stream), then copies. */
static void dget(void *h, const void *d, size_t bytes) {
    CK_CUDA(cudaDeviceSynchronize());
    CK_CUDA(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
}

static void *dput_bf16_new(const moe_real *h, size_t n) {
    uint16_t *t = malloc(2 * n + 2);
    for (size_t i = 0; i < n; i++)
        t[i] = f2bf(h[i]);
    void *d = dnew(2 * n);
    dput(d, t, 2 * n);
    free(t);
    return d;
}

static void dget_bf16(moe_real *h, const void *d, size_t n) {
    uint16_t *t = malloc(2 * n + 2);
    dget(t, d, 2 * n);
    for (size_t i = 0; i < n; i++)
        h[i] = bf2f(t[i]);
    free(t);
}

static void *dput_new(const void *h, size_t bytes) {
    void *d = dnew(bytes);
    dput(d, h, bytes);
    return d;
}

static moe_real *hrandn(size_t n, uint64_t stream, double scale, int bf16) {
    moe_real *x = malloc(sizeof(moe_real) * (n ? n : 1));
    moe_test_randn(x, n, stream, scale);
    if (bf16)
        round_bf16(x, n);
    return x;
}

static double max_abs(const moe_real *x, size_t n) {
    double m = 0.0;
    for (size_t i = 0; i < n; i++)
        m = fabs(x[i]) > m ? fabs(x[i]) : m;
    return m;
}

/* max_i |a_i − b_i| / (|b_i| + norm): the |b_i| term absorbs the bf16 rounding of the
 * result (at most 2^-8·|b_i|), norm is the size of the increment; NaN → ∞. */
static double max_err(const moe_real *a, const moe_real *b, size_t n, double norm) {
    double w = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]) / (fabs((double)b[i]) + norm);
        if (isnan(d))
            return INFINITY;
        w = d > w ? d : w;
    }
    return w;
}

/* The realistic token count (N = 16384 tokens, E = 128, k = 8); smaller under
 * MOE_TEST_QUICK, for the compute-sanitizer runs. */
static int big_n(void) { return moe_test_quick() ? 2048 : 16384; }

/* ------------------------------------------------------------------ tie-free logits */

#define TIE_TOL 2e-5

typedef struct {
    double v;
    int i;
} vi;

static int vi_desc(const void *a, const void *b) {
    const vi *x = a, *y = b;
    if (x->v != y->v)
        return x->v < y->v ? 1 : -1;
    return x->i - y->i;
}

/* Does the CPU's ranking of this row depend on rounding? Selection scores in double as
 * lib/cpu/router.c computes them; checks the gaps that decide the group choice and the
 * ordered top-k (plus the k+1-th, the boundary). */
static int row_ok(const moe_real *z, const float *bias, const moe_router_params *p) {
    const int E = p->num_experts, k = p->topk;
    double sel[1024];
    vi s[1024];
    if (p->score_fn == MOE_SCORE_SOFTMAX && p->pre_softmax) {
        double m = z[0], t = 0.0;
        for (int e = 1; e < E; e++)
            m = z[e] > m ? z[e] : m;
        for (int e = 0; e < E; e++)
            t += (sel[e] = exp((double)z[e] - m));
        for (int e = 0; e < E; e++)
            sel[e] /= t;
    } else if (p->score_fn == MOE_SCORE_SIGMOID) {
        for (int e = 0; e < E; e++)
            sel[e] = 1.0 / (1.0 + exp(-(double)z[e])) + (bias ? (double)bias[e] : 0.0);
    } else {
        for (int e = 0; e < E; e++)
            sel[e] = z[e];
    }
    if (p->num_groups > 0) {
        const int G = p->num_groups, per = E / G, kg = k / p->group_topk;
        vi gs[1024];
        for (int g = 0; g < G; g++) {
            for (int i = 0; i < per; i++)
                s[i] = (vi){sel[g * per + i], i};
            qsort(s, per, sizeof(vi), vi_desc);
            double t = 0.0;
            for (int j = 0; j < kg; j++)
                t += s[j].v;
            gs[g] = (vi){t, g};
        }
        qsort(gs, G, sizeof(vi), vi_desc);
        for (int j = 0; j < p->group_topk && j + 1 < G; j++) {
            double d = gs[j].v - gs[j + 1].v;
            if (d < TIE_TOL && d != 0.0)
                return 0;
        }
        for (int j = p->group_topk; j < G; j++)
            for (int e = gs[j].i * per; e < (gs[j].i + 1) * per; e++)
                sel[e] = -INFINITY;
    }
    for (int e = 0; e < E; e++)
        s[e] = (vi){sel[e], e};
    qsort(s, E, sizeof(vi), vi_desc);
    for (int j = 0; j < k && j + 1 < E; j++) {
        if (isinf(s[j + 1].v))
            break;
        double d = s[j].v - s[j + 1].v;
        int same = z[s[j].i] == z[s[j + 1].i] &&
                   (!bias || bias[s[j].i] == bias[s[j + 1].i]);
        if (d < TIE_TOL && !(d == 0.0 && same))
            return 0;
    }
    return 1;
}

/* N rows of randn·scale logits, bf16-rounded, each drawn again until row_ok(). */
static moe_real *tie_free_logits(int N, const float *bias, const moe_router_params *p,
                                 uint64_t stream, double scale) {
    const int E = p->num_experts;
    moe_real *z = malloc(sizeof(moe_real) * (size_t)N * E);
    for (int n = 0; n < N; n++) {
        moe_real *row = z + (size_t)n * E;
        int ok = 0;
        for (uint64_t a = 0; a < 4096 && !ok; a++) {
            moe_test_randn(row, E, (stream << 40) | ((uint64_t)n << 12) | a, scale);
            round_bf16(row, E);
            ok = row_ok(row, bias, p);
        }
        ck_assert_msg(ok, "could not draw a tie-free row");
    }
    return z;
}

/* ------------------------------------------------------------------ accumulation checks */

/* An op that adds into a [n] gradient: the CPU twin on fp32, the launcher on bf16. */
typedef struct acc_op {
    void (*cpu)(const struct acc_op *o, moe_real *d);
    void (*gpu)(const struct acc_op *o, void *d_dev);
    const moe_real *z;
    const void *d_z;
    const moe_real *dw;
    const moe_real *d_dw;
    const int *idx;
    const int *d_idx;
    moe_router_params p;
    int N, E, k, group_len;
    moe_score_fn fn;
    double coeff, scale;
    const long long *counts; /* the aux loss: counts of every shard's rows (host) */
    const long long *d_counts; /* the same on the device */
    moe_aux_shape sh;        /* the aux loss: this shard's rows */
} acc_op;

/* A loss op that adds into a device double: run it on a double poisoned with 0.5 (an op
 * that overwrote instead of adding would be off by 0.5) and return what it added. */
static double dev_acc(const long long *d_counts, const void *d_z, const moe_aux_shape *sh,
                      int N, int E, double coeff) {
    double *d = dnew(sizeof(double)), v = 0.5;
    dput(d, &v, sizeof v);
    if (sh)
        moe_cuda_aux_loss_forward(d, d_z, d_counts, sh, coeff);
    else
        moe_cuda_z_loss_forward(d, d_z, N, E, coeff);
    dget(&v, d, sizeof v);
    CK_CUDA(cudaFree(d));
    return v - 0.5;
}

/* Runs the CPU twin on zeros to learn the increment δ, then both sides on a pre-fill of
 * size ~½·max|δ|; returns max_i |gpu_i − cpu_i| / (|cpu_i| + max|δ|). A wrong or missing
 * increment shows up as an error of order 1/(1 + |pre-fill|/max|δ|) ≫ 1e-2. */
static double check_accumulate(const acc_op *o, size_t n, uint64_t stream) {
    moe_real *delta = calloc(n, sizeof(moe_real));
    o->cpu(o, delta);
    /* an op whose increment is zero (softmax router with k = 1) must leave the pre-fill */
    const double amax = max_abs(delta, n) > 0 ? max_abs(delta, n) : 1.0;
    ck_assert_msg(isfinite(amax), "CPU increment is not finite");
    moe_real *ref = hrandn(n, stream, 0.5 * amax, 1);
    void *d = dput_bf16_new(ref, n);
    o->cpu(o, ref);
    o->gpu(o, d);
    moe_real *got = malloc(sizeof(moe_real) * n);
    dget_bf16(got, d, n);
    double err = max_err(got, ref, n, amax);
    CK_CUDA(cudaFree(d));
    free(delta); free(ref); free(got);
    return err;
}

static void router_bwd_cpu(const acc_op *o, moe_real *d) {
    moe_cpu_router_backward(d, o->dw, o->z, o->idx, &o->p, o->N);
}
static void router_bwd_gpu(const acc_op *o, void *d) {
    moe_cuda_router_backward(d, o->d_dw, o->d_z, o->d_idx, &o->p, o->N);
}
static void aux_bwd_cpu(const acc_op *o, moe_real *d) {
    moe_cpu_aux_loss_backward_shard(d, o->z, o->counts, &o->sh, o->coeff, o->scale);
}
static void aux_bwd_gpu(const acc_op *o, void *d) {
    moe_cuda_aux_loss_backward(d, o->d_z, o->d_counts, &o->sh, o->coeff, o->scale);
}
static void z_bwd_cpu(const acc_op *o, moe_real *d) {
    moe_cpu_z_loss_backward(d, o->z, o->N, o->E, o->coeff, o->scale);
}
static void z_bwd_gpu(const acc_op *o, void *d) {
    moe_cuda_z_loss_backward(d, o->d_z, o->N, o->E, o->coeff, o->scale);
}

/* ------------------------------------------------------------------ router */

static moe_router_params rp(int E, int k, moe_score_fn fn, int pre, int G, int GK, double s) {
    moe_router_params p = {E, k, fn, pre, G, GK, s};
    return p;
}

/* Forward and backward of one router variant on N tokens. */
static void check_router(moe_router_params p, int N, int with_bias, uint64_t stream) {
    const int E = p.num_experts, k = p.topk;
    const size_t NE = (size_t)N * E, NK = (size_t)N * k;
    float *bias = NULL;
    if (with_bias) {
        moe_real *b = hrandn(E, stream + 1, 0.05, 0);
        bias = malloc(sizeof(float) * E);
        for (int e = 0; e < E; e++)
            bias[e] = (float)b[e];
        free(b);
    }
    moe_real *z = tie_free_logits(N, bias, &p, stream, 2.0);
    int *idx_c = malloc(sizeof(int) * NK), *idx_g = malloc(sizeof(int) * NK);
    moe_real *w_c = malloc(sizeof(moe_real) * NK), *w_g = malloc(sizeof(moe_real) * NK);
    moe_cpu_router_forward(idx_c, w_c, z, bias, &p, N);

    void *d_z = dput_bf16_new(z, NE);
    float *d_bias = bias ? dput_new(bias, sizeof(float) * E) : NULL;
    int *d_idx = dnew(sizeof(int) * NK);
    moe_real *d_w = dnew(sizeof(moe_real) * NK);
    moe_cuda_router_forward(d_idx, d_w, d_z, d_bias, &p, N);
    dget(idx_g, d_idx, sizeof(int) * NK);
    dget(w_g, d_w, sizeof(moe_real) * NK);
    { /* run to run: bit-identical */
        int *idx2 = malloc(sizeof(int) * NK);
        moe_real *w2 = malloc(sizeof(moe_real) * NK);
        moe_cuda_router_forward(d_idx, d_w, d_z, d_bias, &p, N);
        dget(idx2, d_idx, sizeof(int) * NK);
        dget(w2, d_w, sizeof(moe_real) * NK);
        ck_assert_msg(!memcmp(idx2, idx_g, sizeof(int) * NK) &&
                          !memcmp(w2, w_g, sizeof(moe_real) * NK),
                      "router forward is not deterministic");
        free(idx2); free(w2);
    }
    size_t mism = 0, first = NK;
    for (size_t i = 0; i < NK; i++)
        if (idx_g[i] != idx_c[i]) {
            mism++;
            first = first < i ? first : i;
        }
    double werr = moe_test_max_rel_err(w_g, w_c, NK, 1e-6);
    printf("  router fn=%d pre=%d bias=%d E=%d k=%d G=%d GK=%d s=%g N=%d: idx mismatches %zu, "
           "w rel err %.2e\n",
           p.score_fn, p.pre_softmax, with_bias, E, k, p.num_groups, p.group_topk,
           p.scaling_factor, N, mism, werr);
    ck_assert_msg(mism == 0, "%zu index mismatches, first at %zu: gpu %d cpu %d", mism, first,
                  first < NK ? idx_g[first] : -1, first < NK ? idx_c[first] : -1);
    ck_assert_msg(werr <= 1e-5, "routing weights: rel err %g", werr);

    /* backward, from the CPU's selection */
    moe_real *dw = hrandn(NK, stream + 2, 1.0, 0);
    acc_op o = {router_bwd_cpu, router_bwd_gpu, z, d_z, dw, NULL, idx_c, NULL, p, N, E, k, 0,
                p.score_fn, 0, 0, NULL, NULL, {0}};
    moe_real *d_dw = dput_new(dw, sizeof(moe_real) * NK);
    int *d_idx_c = dput_new(idx_c, sizeof(int) * NK);
    o.d_dw = d_dw;
    o.d_idx = d_idx_c;
    double gerr = check_accumulate(&o, NE, stream + 3);
    printf("    backward: err / max|dz| %.2e\n", gerr);
    ck_assert_msg(gerr <= 1e-2, "router backward: err %g", gerr);

    CK_CUDA(cudaFree(d_z)); CK_CUDA(cudaFree(d_bias)); CK_CUDA(cudaFree(d_idx));
    CK_CUDA(cudaFree(d_w)); CK_CUDA(cudaFree(d_dw)); CK_CUDA(cudaFree(d_idx_c));
    free(bias); free(z); free(idx_c); free(idx_g); free(w_c); free(w_g); free(dw);
}

START_TEST(test_gpu_router_softmax) {
    const int Es[3] = {8, 64, 128}, ks[3] = {1, 2, 8};
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++) {
            check_router(rp(Es[a], ks[b], MOE_SCORE_SOFTMAX, 0, 0, 0, 0), 37, 0, 10 + a * 3 + b);
            check_router(rp(Es[a], ks[b], MOE_SCORE_SOFTMAX, 0, 0, 0, 0), 1000, 0,
                         20 + a * 3 + b);
        }
    check_router(rp(1024, 16, MOE_SCORE_SOFTMAX, 0, 0, 0, 0), 37, 0, 30);
    check_router(rp(64, 2, MOE_SCORE_SOFTMAX, 0, 0, 0, 2.5), 1000, 0, 31); /* scaling */
}
END_TEST

START_TEST(test_gpu_router_pre_softmax) {
    check_router(rp(8, 2, MOE_SCORE_SOFTMAX, 1, 0, 0, 0), 37, 0, 40);
    check_router(rp(64, 2, MOE_SCORE_SOFTMAX, 1, 0, 0, 0), 1000, 0, 41);
    check_router(rp(128, 8, MOE_SCORE_SOFTMAX, 1, 0, 0, 0), 1000, 0, 42);
    check_router(rp(256, 1, MOE_SCORE_SOFTMAX, 1, 0, 0, 1.5), 37, 0, 43);
}
END_TEST

START_TEST(test_gpu_router_sigmoid) {
    check_router(rp(8, 1, MOE_SCORE_SIGMOID, 0, 0, 0, 0), 37, 0, 50);
    check_router(rp(64, 1, MOE_SCORE_SIGMOID, 0, 0, 0, 0), 1000, 0, 51);
    check_router(rp(64, 2, MOE_SCORE_SIGMOID, 0, 0, 0, 0), 1000, 0, 52);
    check_router(rp(128, 8, MOE_SCORE_SIGMOID, 0, 0, 0, 0), 1000, 0, 53);
    check_router(rp(64, 4, MOE_SCORE_SIGMOID, 0, 0, 0, 0), 1000, 1, 54);  /* expert bias */
    check_router(rp(128, 8, MOE_SCORE_SIGMOID, 0, 0, 0, 0), 1000, 1, 55);
    check_router(rp(128, 1, MOE_SCORE_SIGMOID, 0, 0, 0, 0), 37, 1, 56);
    check_router(rp(64, 8, MOE_SCORE_SIGMOID, 0, 0, 0, 2.5), 37, 1, 57); /* scaling */
}
END_TEST

START_TEST(test_gpu_router_group_limited) {
    check_router(rp(64, 8, MOE_SCORE_SOFTMAX, 0, 8, 4, 0), 37, 0, 60);
    check_router(rp(64, 8, MOE_SCORE_SOFTMAX, 0, 8, 4, 0), 1000, 0, 61);
    check_router(rp(64, 8, MOE_SCORE_SOFTMAX, 1, 8, 4, 0), 1000, 0, 62);
    check_router(rp(64, 8, MOE_SCORE_SIGMOID, 0, 8, 4, 0), 1000, 0, 63);
    check_router(rp(64, 8, MOE_SCORE_SIGMOID, 0, 8, 4, 2.5), 1000, 1, 64); /* DeepSeek-V3 */
}
END_TEST

START_TEST(test_gpu_router_realistic) {
    check_router(rp(128, 8, MOE_SCORE_SOFTMAX, 0, 0, 0, 0), big_n(), 0, 70);
    check_router(rp(128, 8, MOE_SCORE_SIGMOID, 0, 0, 0, 2.5), big_n(), 1, 71);
    check_router(rp(128, 8, MOE_SCORE_SIGMOID, 0, 8, 4, 2.5), big_n(), 1, 72);
}
END_TEST

/* ------------------------------------------------------------------ aux and z losses */

/* The aux loss of N rows in G groups of group_len, split into `shards` consecutive row
 * ranges as tensor-parallel ranks hold them (moe_aux_shape; 1: one rank), a group's rows in
 * runs of `run` (moe_aux_shape::run; 0: one run per group; under context parallelism the N
 * rows are one CP rank's [2][B][C]: G = B sequences of group_len = T tokens, run = C). Each
 * shard's counts, CUDA against CPU, exactly (integers from the same bf16 logits); their sum
 * the counts of one rank; each shard's part of the loss and its backward, CUDA against the
 * CPU twin with the summed counts; and the parts add up to the one-rank CPU loss. */
static void check_aux_runs(int N, int group_len, int G, int run, int E, int k, moe_score_fn fn,
                           int shards, uint64_t stream) {
    const size_t NE = (size_t)N * E;
    moe_real *z = hrandn(NE, stream, 1.5, 0);
    for (int n = 0; n < N; n++) /* imbalance: the first eighth of the experts is favoured */
        for (int e = 0; e < (E + 7) / 8; e++)
            z[(size_t)n * E + e] += 1.0f;
    round_bf16(z, NE);
    const double coeff = 1e-2, scale = 3.0;
    const int rows = N / shards;
    const size_t GE = (size_t)G * E;
    long long *sum = calloc(GE, sizeof(long long)), *cc = malloc(sizeof(long long) * GE);
    long long *cg = malloc(sizeof(long long) * GE);
    long long *d_cg = dnew(sizeof(long long) * GE); /* poisoned: every count must be written */
    long long bad_counts = 0;
    for (int r = 0; r < shards; r++) {
        moe_aux_shape sh = {rows, r * rows, group_len, G, E, k, fn, run};
        void *d_z = dput_bf16_new(z + (size_t)r * rows * E, (size_t)rows * E);
        moe_cpu_aux_loss_counts(cc, z + (size_t)r * rows * E, &sh);
        moe_cuda_aux_loss_counts(d_cg, d_z, &sh); /* device counts (chapter 06) */
        dget(cg, d_cg, sizeof(long long) * GE);
        for (size_t i = 0; i < GE; i++) {
            bad_counts += cc[i] != cg[i];
            sum[i] += cc[i];
        }
        CK_CUDA(cudaFree(d_z));
    }
    ck_assert_msg(bad_counts == 0, "aux counts: %lld of %zu differ (CUDA vs CPU)", bad_counts, GE);
    long long *d_sum = dnew(sizeof(long long) * GE);
    dput(d_sum, sum, sizeof(long long) * GE);
    const moe_aux_shape all = {N, 0, group_len, G, E, k, fn, run};
    const double whole = moe_cpu_aux_loss_forward_shard(z, sum, &all, coeff);
    double parts = 0.0, worst = 0.0, gerr = 0.0;
    for (int r = 0; r < shards; r++) {
        moe_aux_shape sh = {rows, r * rows, group_len, G, E, k, fn, run};
        const moe_real *zr = z + (size_t)r * rows * E;
        void *d_z = dput_bf16_new(zr, (size_t)rows * E);
        const double lc = moe_cpu_aux_loss_forward_shard(zr, sum, &sh, coeff);
        const double lg = dev_acc(d_sum, d_z, &sh, 0, 0, coeff);
        ck_assert_msg(dev_acc(d_sum, d_z, &sh, 0, 0, coeff) == lg,
                      "aux loss forward is not deterministic");
        parts += lc;
        const double rel = fabs(lg - lc) / fabs(lc);
        worst = rel > worst ? rel : worst;
        acc_op o = {aux_bwd_cpu, aux_bwd_gpu, zr, d_z, NULL, NULL, NULL, NULL,
                    rp(E, k, fn, 0, 0, 0, 0), rows, E, k, group_len, fn, coeff, scale, sum, d_sum,
                    sh};
        const double e = check_accumulate(&o, (size_t)rows * E, stream + 1 + r);
        gerr = e > gerr ? e : gerr;
        CK_CUDA(cudaFree(d_z));
    }
    const double rel_parts = fabs(parts - whole) / fabs(whole);
    printf("  aux fn=%d N=%d group_len=%d (%d groups, runs of %d) E=%d k=%d over %d shard(s): "
           "loss %.9g, parts sum to %.9g (rel %.1e); CUDA vs CPU: loss rel %.2e, backward err "
           "%.2e\n", fn, N, group_len, G, run ? run : group_len, E, k, shards, whole, parts,
           rel_parts, worst, gerr);
    ck_assert_msg(rel_parts <= 1e-9, "aux loss: the shards' parts %.12g != the loss %.12g",
                  parts, whole);
    ck_assert_msg(worst <= 1e-5, "aux loss: CUDA vs CPU rel %g", worst);
    ck_assert_msg(gerr <= 1e-2, "aux loss backward: err %g", gerr);
    free(sum); free(cc); free(cg);
    CK_CUDA(cudaFree(d_cg));
    CK_CUDA(cudaFree(d_sum));
    free(z);
}

static void check_aux_sharded(int N, int group_len, int E, int k, moe_score_fn fn, int shards,
                              uint64_t stream) {
    check_aux_runs(N, group_len, N / group_len, 0, E, k, fn, shards, stream);
}

static void check_aux(int N, int group_len, int E, int k, moe_score_fn fn, uint64_t stream) {
    check_aux_sharded(N, group_len, E, k, fn, 1, stream);
}

START_TEST(test_gpu_aux_loss) {
    for (int f = 0; f < 2; f++) {
        moe_score_fn fn = f ? MOE_SCORE_SIGMOID : MOE_SCORE_SOFTMAX;
        check_aux(37, 37, 8, 2, fn, 100 + f);
        check_aux(1000, 1000, 64, 4, fn, 110 + f);   /* global */
        check_aux(1000, 100, 64, 4, fn, 120 + f);    /* per sequence */
        check_aux(1000, 1, 64, 4, fn, 130 + f);      /* one token per group */
        check_aux(big_n(), big_n(), 128, 8, fn, 140 + f);
        check_aux(big_n(), big_n() / 4, 128, 8, fn, 150 + f);
        /* tensor-parallel shards (chapter 04): a group over several ranks, ranks holding
         * several groups, and a shard that starts inside a group */
        check_aux_sharded(1024, 1024, 64, 4, fn, 4, 160 + f);
        check_aux_sharded(1024, 128, 64, 4, fn, 2, 170 + f);
        check_aux_sharded(1200, 400, 64, 4, fn, 3, 180 + f);
        check_aux_sharded(1200, 300, 64, 4, fn, 8, 190 + f);
        /* context parallelism (chapter 07): one CP rank's rows of B = 4 sequences of T = 512
         * tokens over CP 4, chunk-major (runs of C = 64), alone and over 2 SP shards */
        check_aux_runs(512, 512, 4, 64, 64, 4, fn, 1, 200 + f);
        check_aux_runs(512, 512, 4, 64, 64, 4, fn, 2, 210 + f);
        check_aux_runs(96, 40, 3, 16, 8, 2, fn, 4, 220 + f); /* shards start inside a run */
    }
}
END_TEST

static void check_z(int N, int E, uint64_t stream) {
    const size_t NE = (size_t)N * E;
    moe_real *z = hrandn(NE, stream, 3.0, 1);
    const double coeff = 1e-3, scale = 2.0;
    void *d_z = dput_bf16_new(z, NE);
    double lc = moe_cpu_z_loss_forward(z, N, E, coeff);
    double lg = dev_acc(NULL, d_z, NULL, N, E, coeff);
    ck_assert_msg(dev_acc(NULL, d_z, NULL, N, E, coeff) == lg,
                  "z-loss forward is not deterministic");
    double rel = fabs(lg - lc) / fabs(lc);
    acc_op o = {z_bwd_cpu, z_bwd_gpu, z, d_z, NULL, NULL, NULL, NULL, rp(E, 1, 0, 0, 0, 0, 0),
                N, E, 1, N, MOE_SCORE_SOFTMAX, coeff, scale, NULL, NULL, {0}};
    double gerr = check_accumulate(&o, NE, stream + 1);
    printf("  z-loss N=%d E=%d: loss cpu %.9g gpu %.9g rel %.2e; backward err %.2e\n", N, E, lc,
           lg, rel, gerr);
    ck_assert_msg(rel <= 1e-5, "z-loss: cpu %.10g gpu %.10g", lc, lg);
    ck_assert_msg(gerr <= 1e-2, "z-loss backward: err %g", gerr);
    CK_CUDA(cudaFree(d_z));
    free(z);
}

START_TEST(test_gpu_z_loss) {
    check_z(37, 8, 200);
    check_z(1000, 64, 210);
    check_z(big_n(), 128, 220);
    check_z(37, 1024, 230);
}
END_TEST

/* ------------------------------------------------------------------ permutation */

enum { IDX_ROUTER, IDX_RAGGED, IDX_ONE };

/* Routing indices: a real router's picks, a ragged skew with empty experts, or all on one. */
static int *make_idx(int kind, int N, int k, int E, uint64_t stream) {
    int *idx = malloc(sizeof(int) * (size_t)N * k);
    if (kind == IDX_ROUTER) {
        moe_router_params p = rp(E, k, MOE_SCORE_SOFTMAX, 0, 0, 0, 0);
        moe_real *z = hrandn((size_t)N * E, stream, 1.0, 1);
        moe_real *w = malloc(sizeof(moe_real) * (size_t)N * k);
        moe_cpu_router_forward(idx, w, z, NULL, &p, N);
        free(z); free(w);
    } else if (kind == IDX_RAGGED) {
        /* only even experts of the lower half, heavily skewed towards expert 0 */
        moe_real *u = hrandn((size_t)N * k, stream, 1.0, 0);
        for (size_t a = 0; a < (size_t)N * k; a++) {
            int e = 2 * (int)(fabs(u[a]) * u[a] * E / 16);
            idx[a] = e < 0 ? 0 : (e >= E / 2 ? (E / 2 - 2 > 0 ? E / 2 - 2 : 0) : e);
        }
        free(u);
    } else {
        for (size_t a = 0; a < (size_t)N * k; a++)
            idx[a] = E - 1;
    }
    return idx;
}

static void check_permute(int kind, int N, int k, int E, int C, uint64_t stream) {
    const int A = N * k;
    int *idx = make_idx(kind, N, k, E, stream);
    /* the index */
    int *src_c = malloc(sizeof(int) * A), *row_c = malloc(sizeof(int) * A);
    int *src_g = malloc(sizeof(int) * A), *row_g = malloc(sizeof(int) * A);
    int *off_c = malloc(sizeof(int) * (E + 1)), *off_g = malloc(sizeof(int) * (E + 1));
    long long *cnt_c = malloc(sizeof(long long) * E), *cnt_g = malloc(sizeof(long long) * E);
    for (int e = 0; e < E; e++)
        cnt_c[e] = cnt_g[e] = 1000 + 7 * e; /* counts accumulate */
    for (int e = 0; e <= E; e++)
        off_g[e] = -7;
    moe_cpu_permute_index(src_c, row_c, off_c, cnt_c, idx, N, k, E);
    int *d_idx = dput_new(idx, sizeof(int) * A);
    int *d_src = dnew(sizeof(int) * A), *d_row = dnew(sizeof(int) * A);
    moe_cuda_permute_index(d_src, d_row, off_g, NULL, cnt_g, d_idx, N, k, E);
    dget(src_g, d_src, sizeof(int) * A);
    dget(row_g, d_row, sizeof(int) * A);
    int empty = 0;
    for (int e = 0; e < E; e++)
        empty += off_c[e + 1] == off_c[e];
    printf("  permute kind=%d N=%d k=%d E=%d C=%d (%d empty experts): ", kind, N, k, E, C, empty);
    ck_assert_int_eq(off_c[E], A);
    ck_assert_msg(!memcmp(off_c, off_g, sizeof(int) * (E + 1)), "expert_offset differs");
    ck_assert_msg(!memcmp(cnt_c, cnt_g, sizeof(long long) * E), "counts differ");
    ck_assert_msg(!memcmp(src_c, src_g, sizeof(int) * A), "perm_src differs");
    ck_assert_msg(!memcmp(row_c, row_g, sizeof(int) * A), "row_of differs");

    /* permute_tokens: a copy, bit-exact */
    const size_t NC = (size_t)N * C, AC = (size_t)A * C;
    moe_real *x = hrandn(NC, stream + 1, 1.0, 1);
    moe_real *xp_c = malloc(sizeof(moe_real) * AC), *xp_g = malloc(sizeof(moe_real) * AC);
    moe_cpu_permute_tokens(xp_c, x, src_c, A, k, C);
    void *d_x = dput_bf16_new(x, NC), *d_xp = dnew(2 * AC);
    moe_cuda_permute_tokens(d_xp, d_x, d_src, A, k, C);
    dget_bf16(xp_g, d_xp, AC);
    ck_assert_msg(!memcmp(xp_c, xp_g, sizeof(moe_real) * AC), "permute_tokens differs");

    /* permute_weights: a gather, bit-exact */
    moe_real *tw = hrandn(A, stream + 2, 1.0, 0);
    moe_real *wp_c = malloc(sizeof(moe_real) * A), *wp_g = malloc(sizeof(moe_real) * A);
    moe_cpu_permute_weights(wp_c, tw, src_c, A);
    moe_real *d_tw = dput_new(tw, sizeof(moe_real) * A), *d_wp = dnew(sizeof(moe_real) * A);
    moe_cuda_permute_weights(d_wp, d_tw, d_src, A);
    dget(wp_g, d_wp, sizeof(moe_real) * A);
    ck_assert_msg(!memcmp(wp_c, wp_g, sizeof(moe_real) * A), "permute_weights differs");

    /* unpermute_sum: fp32 sum in the CPU's order, then one bf16 rounding: bit-exact */
    moe_real *yp = hrandn(AC, stream + 3, 1.0, 1);
    moe_real *out_c = hrandn(NC, stream + 4, 1.0, 1), *out_g = malloc(sizeof(moe_real) * NC);
    void *d_yp = dput_bf16_new(yp, AC), *d_out = dput_bf16_new(out_c, NC);
    moe_cpu_unpermute_sum(out_c, yp, row_c, N, k, C);
    round_bf16(out_c, NC);
    moe_cuda_unpermute_sum(d_out, d_yp, d_row, N, k, C);
    dget_bf16(out_g, d_out, NC);
    size_t bad = 0;
    for (size_t i = 0; i < NC; i++)
        bad += !(out_g[i] == out_c[i]);
    ck_assert_msg(bad == 0, "unpermute_sum: %zu of %zu differ", bad, NC);

    /* unpermute_weights: accumulate a gather, bit-exact */
    moe_real *dwp = hrandn(A, stream + 5, 1.0, 0);
    moe_real *dtw_c = hrandn(A, stream + 6, 1.0, 0), *dtw_g = malloc(sizeof(moe_real) * A);
    moe_real *d_dwp = dput_new(dwp, sizeof(moe_real) * A);
    moe_real *d_dtw = dput_new(dtw_c, sizeof(moe_real) * A);
    moe_cpu_unpermute_weights(dtw_c, dwp, row_c, N, k);
    moe_cuda_unpermute_weights(d_dtw, d_dwp, d_row, N, k);
    dget(dtw_g, d_dtw, sizeof(moe_real) * A);
    ck_assert_msg(!memcmp(dtw_c, dtw_g, sizeof(moe_real) * A), "unpermute_weights differs");
    printf("all exact\n");

    CK_CUDA(cudaFree(d_idx)); CK_CUDA(cudaFree(d_src)); CK_CUDA(cudaFree(d_row));
    CK_CUDA(cudaFree(d_x)); CK_CUDA(cudaFree(d_xp)); CK_CUDA(cudaFree(d_tw));
    CK_CUDA(cudaFree(d_wp)); CK_CUDA(cudaFree(d_yp)); CK_CUDA(cudaFree(d_out));
    CK_CUDA(cudaFree(d_dwp)); CK_CUDA(cudaFree(d_dtw));
    free(idx); free(src_c); free(row_c); free(src_g); free(row_g); free(off_c); free(off_g);
    free(cnt_c); free(cnt_g); free(x); free(xp_c); free(xp_g); free(tw); free(wp_c);
    free(wp_g); free(yp); free(out_c); free(out_g); free(dwp); free(dtw_c); free(dtw_g);
}

START_TEST(test_gpu_permute) {
    check_permute(IDX_ROUTER, 37, 2, 8, 37, 300);
    check_permute(IDX_ROUTER, 1000, 4, 64, 64, 310);
    check_permute(IDX_ROUTER, 1000, 8, 1024, 40, 320);
    check_permute(IDX_RAGGED, 37, 2, 8, 16, 330);
    check_permute(IDX_RAGGED, 1000, 4, 64, 37, 340);
    check_permute(IDX_RAGGED, 1000, 8, 128, 64, 350);
    check_permute(IDX_ONE, 1000, 1, 16, 64, 360);
    check_permute(IDX_ONE, 1000, 4, 8, 37, 370);
    check_permute(IDX_ROUTER, big_n(), 8, 128, 128, 380);
}
END_TEST

Suite *suite_gpu_moe(void) {
    Suite *s = suite_create("gpu_moe");
    TCase *tc = tcase_create("router");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_gpu_router_softmax);
    tcase_add_test(tc, test_gpu_router_pre_softmax);
    tcase_add_test(tc, test_gpu_router_sigmoid);
    tcase_add_test(tc, test_gpu_router_group_limited);
    tcase_add_test(tc, test_gpu_router_realistic);
    suite_add_tcase(s, tc);
    TCase *lb = tcase_create("load_balancing");
    tcase_set_timeout(lb, 600);
    tcase_add_test(lb, test_gpu_aux_loss);
    tcase_add_test(lb, test_gpu_z_loss);
    suite_add_tcase(s, lb);
    TCase *pm = tcase_create("permutation");
    tcase_set_timeout(pm, 600);
    tcase_add_test(pm, test_gpu_permute);
    suite_add_tcase(s, pm);
    return s;
}
