/*
 * CUDA flash attention (kernels/attention.cu) against its CPU twin, the CPU flash attention
 * (lib/cpu/attention.c, moe_cpu_attention_forward/backward), on fresh random inputs.
 *
 * Inputs are rounded to bf16 before both sides see them, so the differences left are the
 * fp32 summation order, the bf16 rounding of P and dS where the GPU feeds them to its tensor
 * cores, and the bf16 rounding of the GPU's outputs. Errors are measured as
 * max|gpu − cpu| / max|cpu| over a whole tensor. Outputs start as NaN (forward) or as random
 * values (backward, which must accumulate), so an element that a kernel forgets to write, or
 * overwrites instead of adding to, fails the check.
 *
 * The shapes cover the head dimensions the kernels are fast for (64, 128) and odd ones (40,
 * 5: no 16-byte loads), GQA ratios 1, 3 and MQA, lengths around the 64-row tiles (1, 17,
 * 255, 257), and chunks of queries against other chunks of keys (Tq ≠ Tk, q_pos ≠ k_pos,
 * rows that see no key: y = 0, lse = −∞), as context parallelism calls them. Those run the
 * portable kernel (MOE_FLASH_SM90=0); test_attention_sm90 runs the Hopper forward
 * (kernels/attention_sm90.cu, both of its main loops) against the CPU and the portable
 * kernel, and fails on an sm_90 device if the Hopper path did not run;
 * test_attention_sm90_backward does the same for the Hopper backward
 * (kernels/attention_sm90_bwd.cu, MOE_FLASH_SM90_BWD=1 to 5 set by the test: the two-kernel
 * form, the fused one, the fused one overlapped, the fused one with unordered dq additions,
 * and that with a batched dk/dv epilogue), and checks that two runs of each deterministic
 * mode give the same bits.
 *
 * Then context parallelism's device pieces (kernels/cp_merge.cu): the merge of partial
 * results by their log-sum-exp, the strided copy and the lse fill, against the CPU ops.
 *
 * This file talks to the GPU through the CUDA runtime only (cudaMalloc, cudaMemcpy and
 * a host-side fp32 ↔ bf16 conversion), so it depends on nothing but the kernels it tests
 * (and the CPU backend's table for the twins).
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "bench.h"
#include "cp_layout.h"
#include "cpu/ops.h"
#include "cuda_ops.h"
#include "helpers.h"
#include "suites.h"

/* ------------------------------------------------------------ host-side helpers */

#define CU_OK(call)                                                                        \
    do {                                                                                   \
        cudaError_t e_ = (call);                                                           \
        ck_assert_msg(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));         \
    } while (0)

/* fp32 → bf16 bits, round to nearest even (NaN stays a quiet NaN). */
static uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* bf16 bits → fp32 (exact). */
static float bf2f(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round x to the nearest bf16, in place: what both sides of a comparison then see. */
static void round_bf16(moe_real *x, size_t n) {
    for (size_t i = 0; i < n; i++)
        x[i] = bf2f(f2bf((float)x[i]));
}

/* A fresh bf16 device copy of n host values. */
static void *upload(const moe_real *x, size_t n) {
    uint16_t *h = malloc(n * sizeof *h);
    ck_assert_ptr_nonnull(h);
    for (size_t i = 0; i < n; i++)
        h[i] = f2bf((float)x[i]);
    void *d = NULL;
    CU_OK(cudaMalloc(&d, n * sizeof *h));
    CU_OK(cudaMemcpy(d, h, n * sizeof *h, cudaMemcpyHostToDevice));
    free(h);
    return d;
}

/* A device buffer of n bf16 zeros. */
static void *upload_zero(size_t n) {
    void *d = NULL;
    CU_OK(cudaMalloc(&d, n * sizeof(uint16_t)));
    CU_OK(cudaMemset(d, 0, n * sizeof(uint16_t)));
    return d;
}

/* A device buffer of n fp32 values (lse). */
static float *upload_f32(const moe_real *x, size_t n) {
    float *h = malloc(n * sizeof *h);
    ck_assert_ptr_nonnull(h);
    for (size_t i = 0; i < n; i++)
        h[i] = (float)x[i];
    float *d = NULL;
    CU_OK(cudaMalloc((void **)&d, n * sizeof *h));
    CU_OK(cudaMemcpy(d, h, n * sizeof *h, cudaMemcpyHostToDevice));
    free(h);
    return d;
}

/* A device buffer of n fp32 NaNs (all bits set is a NaN). */
static float *upload_nan_f32(size_t n) {
    float *d = NULL;
    CU_OK(cudaMalloc((void **)&d, n * sizeof *d));
    CU_OK(cudaMemset(d, 0xff, n * sizeof *d));
    return d;
}

/* n fp32 device values → host, after all queued work (moe_real is float in this build). */
static void download_f32(moe_real *x, const float *d, size_t n) {
    CU_OK(cudaDeviceSynchronize());
    CU_OK(cudaMemcpy(x, d, n * sizeof *d, cudaMemcpyDeviceToHost));
}

/* A device buffer of n bf16 NaNs. */
static void *upload_nan(size_t n) {
    moe_real *h = malloc(n * sizeof *h);
    ck_assert_ptr_nonnull(h);
    moe_test_poison(h, n);
    void *d = upload(h, n);
    free(h);
    return d;
}

/* n bf16 device values → host. Waits for all queued work first (the kernels run on
 * the backend's own non-blocking stream, which cudaMemcpy does not wait for). */
static void download(moe_real *x, const void *d, size_t n) {
    CU_OK(cudaDeviceSynchronize());
    uint16_t *h = malloc(n * sizeof *h);
    ck_assert_ptr_nonnull(h);
    CU_OK(cudaMemcpy(h, d, n * sizeof *h, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++)
        x[i] = bf2f(h[i]);
    free(h);
}

/* max|a − b| / max|b| (NaN anywhere counts as infinite). */
static double norm_err(const moe_real *a, const moe_real *b, size_t n) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (isnan(d))
            return INFINITY;
        num = d > num ? d : num;
        den = fabs((double)b[i]) > den ? fabs((double)b[i]) : den;
    }
    return den > 0.0 ? num / den : num;
}

/* The error of an increment (gpu − start vs cpu − start), relative to the larger of its
 * largest reference value and 2^-8 of the largest accumulated value: the increment is read
 * back through bf16(start + increment), which cannot resolve it more finely than that
 * (and at T = 1 the dq, dk increments are exactly 0: dS = P (dP − δ) with P = 1, δ = dP). */
static double increment_err(const moe_real *inc, const moe_real *inc_ref, const moe_real *total,
                            size_t n) {
    double num = 0.0, den = 0.0, tot = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double d = fabs((double)inc[i] - (double)inc_ref[i]);
        if (isnan(d))
            return INFINITY;
        num = d > num ? d : num;
        den = fabs((double)inc_ref[i]) > den ? fabs((double)inc_ref[i]) : den;
        tot = fabs((double)total[i]) > tot ? fabs((double)total[i]) : tot;
    }
    den = den > tot / 256.0 ? den : tot / 256.0;
    return den > 0.0 ? num / den : num;
}

/* a − b, elementwise (the increment a backward added). */
static moe_real *diff(const moe_real *a, const moe_real *b, size_t n) {
    moe_real *o = malloc(n * sizeof *o);
    ck_assert_ptr_nonnull(o);
    for (size_t i = 0; i < n; i++)
        o[i] = a[i] - b[i];
    return o;
}

static moe_real *randn_bf16(size_t n, uint64_t stream, double scale) {
    moe_real *x = malloc(n * sizeof *x);
    ck_assert_ptr_nonnull(x);
    moe_test_randn(x, n, stream, scale);
    round_bf16(x, n);
    return x;
}

/* ------------------------------------------------------------------------- shapes */

typedef struct {
    int B, Tq, Tk, Hq, Hkv, D, q_pos, k_pos;
    const char *what;
} shape;

static const shape SHAPES[] = {
    {2, 1, 1, 3, 3, 64, 0, 0, "T = 1"},
    {2, 17, 17, 6, 2, 64, 0, 0, "GQA 3, T = 17"},
    {2, 255, 255, 4, 4, 128, 0, 0, "MHA, D = 128, T = 255"},
    {1, 257, 257, 6, 2, 40, 0, 0, "GQA 3, D = 40, T = 257"},
    {2, 130, 130, 4, 1, 128, 0, 0, "MQA, D = 128, three tiles"},
    {2, 33, 33, 4, 2, 5, 0, 0, "D = 5: element loads"},
    {3, 64, 64, 2, 1, 16, 0, 0, "small D, exactly one tile"},
    {2, 100, 100, 4, 2, 64, 300, 300, "a chunk at positions 300..399 attending to itself"},
    {2, 70, 130, 3, 1, 64, 130, 0, "queries 130..199 against the keys 0..129 before them"},
    {2, 96, 64, 6, 2, 128, 32, 0, "queries 32..127 against keys 0..63: a shifted diagonal"},
    {2, 50, 80, 4, 4, 64, 0, 20, "keys 20..99, queries 0..49: 20 rows see no key"},
    {2, 200, 70, 6, 2, 40, 100, 150, "keys 150..219, queries 100..299"},
    {4, 512, 512, 8, 4, 64, 0, 0, "realistic"}, /* skipped under MOE_TEST_QUICK */
};

#define NSHAPES ((int)(sizeof SHAPES / sizeof SHAPES[0]))
/* Loop index i: shape i % NSHAPES, with the kernels' wide tiles forced (i < NSHAPES,
 * MOE_FLASH_MT=2) or their narrow ones (MOE_FLASH_MT=1): the default picks between these
 * two by length (kernels/attention.cu), so both are what the model runs. */
#define SHAPE_SKIPPED(i) (moe_test_quick() && SHAPES[(i) % NSHAPES].Tq >= 512)

/* Select the tile configuration of loop index i; returns its name for the messages. */
static const char *tiles_for(int i) {
    const int narrow = i >= NSHAPES;
    /* the portable kernel's forward; the Hopper one has its own test (test_attention_sm90) */
    ck_assert_int_eq(setenv("MOE_FLASH_SM90", "0", 1), 0);
    ck_assert_int_eq(setenv("MOE_FLASH_MT", narrow ? "1" : "2", 1), 0);
    return narrow ? "MT=1" : "MT=2";
}

/* The op's shape of a test case. */
static moe_attention_shape op_shape(const shape *s) {
    moe_attention_shape o = {s->B, s->Tq, s->Tk, s->Hq, s->Hkv, s->D, s->q_pos, s->k_pos};
    return o;
}

/* lse: max|gpu − cpu| / max|cpu| over the finite entries; a row that is −∞ on one side
 * must be −∞ on the other (counted in *mismatch), NaN counts as infinite error. */
static double lse_err(const moe_real *a, const moe_real *b, size_t n, size_t *mismatch) {
    double num = 0.0, den = 0.0;
    *mismatch = 0;
    for (size_t i = 0; i < n; i++) {
        if (isinf(b[i]) || isinf(a[i])) {
            *mismatch += !(a[i] == b[i]);
            continue;
        }
        const double d = fabs((double)a[i] - (double)b[i]);
        if (isnan(d))
            return INFINITY;
        num = d > num ? d : num;
        den = fabs((double)b[i]) > den ? fabs((double)b[i]) : den;
    }
    return den > 0.0 ? num / den : num;
}

/* ------------------------------------------------------------------------- forward */

START_TEST(test_attention_forward) {
    if (SHAPE_SKIPPED(_i))
        return;
    const shape s = SHAPES[_i % NSHAPES];
    const char *tiles = tiles_for(_i);
    const moe_attention_shape sh = op_shape(&s);
    const size_t nq = (size_t)s.B * s.Tq * s.Hq * s.D, nkv = (size_t)s.B * s.Tk * s.Hkv * s.D;
    const size_t nl = (size_t)s.B * s.Hq * s.Tq;
    /* the workspace is δ [B, Hq, Tq] in fp32: O(T), no T × T buffer */
    ck_assert_uint_eq(moe_cuda_attention_workspace_bytes(sh), nl * sizeof(float));
    moe_real *q = randn_bf16(nq, 10 + (uint64_t)(_i % NSHAPES), 1.0);
    moe_real *k = randn_bf16(nkv, 20 + (uint64_t)(_i % NSHAPES), 1.0);
    moe_real *v = randn_bf16(nkv, 30 + (uint64_t)(_i % NSHAPES), 1.0);
    moe_real *y_ref = malloc(nq * sizeof *y_ref), *y = malloc(nq * sizeof *y);
    moe_real *l_ref = malloc(nl * sizeof *l_ref), *l = malloc(nl * sizeof *l);
    ck_assert(y_ref && y && l_ref && l);
    moe_cpu_attention_forward(y_ref, l_ref, NULL, q, k, v, sh);

    void *dq = upload(q, nq), *dk = upload(k, nkv), *dv = upload(v, nkv);
    void *dy = upload_nan(nq);
    float *dl = upload_nan_f32(nl), *ws = upload_nan_f32(nl);
    moe_cuda_attention_forward(dy, dl, ws, dq, dk, dv, sh);
    CU_OK(cudaGetLastError());
    download(y, dy, nq);
    download_f32(l, dl, nl);

    const double ey = norm_err(y, y_ref, nq);
    /* lse is fp32 on both sides, from the same bf16 inputs: only the summation order and
     * exp2f/logf differ, far inside what a bf16 output would allow */
    size_t inf_mismatch, blind = 0;
    const double el = lse_err(l, l_ref, nl, &inf_mismatch);
    for (size_t i = 0; i < nl; i++)
        blind += isinf(l_ref[i]) != 0; /* glibc's isinf(−∞) is −1 */
    printf("attention forward  %s B=%d Tq=%3d Tk=%3d Hq=%d Hkv=%d D=%3d pos %d/%d (%s): y %.2e  "
           "lse %.2e  (%zu rows see no key)\n",
           tiles, s.B, s.Tq, s.Tk, s.Hq, s.Hkv, s.D, s.q_pos, s.k_pos, s.what, ey, el, blind);
    ck_assert_msg(ey <= 1e-2, "%s: y error %g", s.what, ey);
    ck_assert_msg(el <= 1e-3, "%s: lse error %g", s.what, el);
    ck_assert_msg(inf_mismatch == 0, "%s: %zu lse entries are -inf on one side only", s.what,
                  inf_mismatch);

    void *bufs[] = {dq, dk, dv, dy, dl, ws};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        cudaFree(bufs[i]);
    moe_real *hbufs[] = {q, k, v, y_ref, y, l_ref, l};
    for (size_t i = 0; i < sizeof hbufs / sizeof hbufs[0]; i++)
        free(hbufs[i]);
    unsetenv("MOE_FLASH_MT"); /* back to the default for whatever runs next */
    unsetenv("MOE_FLASH_SM90");
}
END_TEST

/* ------------------------------------------------------- the Hopper forward (sm_90a) */

/* kernels/attention_sm90.cu against the CPU twin and against the portable kernel, on the
 * shapes its tiles make hard: lengths around its 128-row query and key tiles (1, 63, 127,
 * 129, 300, 1000) and a long one, both head dims it runs, GQA 4 (Hq = 8, Hkv = 2), MHA, MQA,
 * and the chunks context parallelism passes (a query chunk after its key chunk; a chunk whose
 * queries all precede the keys: every row sees nothing, y = 0, lse = −∞; a shifted
 * diagonal). On an sm_90 device the test fails unless the Hopper path actually ran
 * (moe_cuda_attention_sm90_calls() grew), so it cannot pass through the portable kernel;
 * elsewhere it checks the fallback. */
static const shape SM90_SHAPES[] = {
    {2, 1, 1, 8, 2, 128, 0, 0, "T = 1"},
    {2, 63, 63, 8, 2, 64, 0, 0, "T = 63, D = 64"},
    {2, 127, 127, 8, 2, 128, 0, 0, "T = 127"},
    {2, 129, 129, 8, 2, 64, 0, 0, "T = 129, D = 64: a second tile of one row"},
    {2, 129, 129, 8, 2, 128, 0, 0, "T = 129, D = 128"},
    {1, 300, 300, 8, 2, 128, 0, 0, "T = 300"},
    {1, 300, 300, 4, 4, 64, 0, 0, "T = 300, MHA, D = 64"},
    {2, 300, 300, 4, 1, 64, 0, 0, "T = 300, MQA, D = 64"},
    {1, 1000, 1000, 8, 2, 64, 0, 0, "T = 1000, D = 64"},
    {1, 1000, 1000, 4, 4, 128, 0, 0, "T = 1000, MHA"},
    {2, 300, 300, 8, 2, 128, 600, 300, "CP: queries 600..899 after the keys 300..599"},
    {2, 200, 300, 8, 2, 64, 0, 300, "CP: queries 0..199 before the keys 300..499: all blind"},
    {2, 250, 170, 8, 2, 128, 100, 30, "CP: keys 30..199, queries 100..349: a shifted diagonal"},
    {1, 700, 500, 8, 2, 64, 0, 77, "CP: keys 77..576, queries 0..699: 77 blind rows"},
    {1, 4096, 4096, 4, 1, 128, 0, 0, "T = 4096, MQA"}, /* skipped under MOE_TEST_QUICK */
};
#define NSM90 ((int)(sizeof SM90_SHAPES / sizeof SM90_SHAPES[0]))

/* max|a − b| / max|b| as norm_err, and the first element over tol·max|b| (or NaN) printed
 * with its index and both values: where a kernel goes wrong, not only that it does. */
static double diag_err(const char *what, const moe_real *a, const moe_real *b, size_t n,
                       double tol) {
    double den = 0.0, num = 0.0;
    size_t worst = 0;
    for (size_t i = 0; i < n; i++)
        den = fabs((double)b[i]) > den ? fabs((double)b[i]) : den;
    int shown = 0;
    for (size_t i = 0; i < n; i++) {
        const double d = fabs((double)a[i] - (double)b[i]);
        if ((isnan(d) || d > tol * (den > 0.0 ? den : 1.0)) && !shown) {
            printf("  %s: first mismatch at %zu: got %g, want %g\n", what, i, (double)a[i],
                   (double)b[i]);
            shown = 1;
        }
        if (isnan(d))
            return INFINITY;
        if (d > num)
            num = d, worst = i;
    }
    if (num > 0.0)
        printf("  %s: max error %g at %zu (got %g, want %g)\n", what, num, worst,
               (double)a[worst], (double)b[worst]);
    return den > 0.0 ? num / den : num;
}

/* Is the current device a compute capability 9 GPU (where the Hopper path must run)? */
static int device_is_sm90(void) {
    int dev = 0, major = 0;
    CU_OK(cudaGetDevice(&dev));
    CU_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    return major == 9;
}

START_TEST(test_attention_sm90) {
    const shape s = SM90_SHAPES[_i];
    if (moe_test_quick() && s.Tq >= 4096)
        return;
    const moe_attention_shape sh = op_shape(&s);
    const size_t nq = (size_t)s.B * s.Tq * s.Hq * s.D, nkv = (size_t)s.B * s.Tk * s.Hkv * s.D;
    const size_t nl = (size_t)s.B * s.Hq * s.Tq;
    moe_real *q = randn_bf16(nq, 200 + (uint64_t)_i, 1.0);
    moe_real *k = randn_bf16(nkv, 220 + (uint64_t)_i, 1.0);
    moe_real *v = randn_bf16(nkv, 240 + (uint64_t)_i, 1.0);
    moe_real *y_ref = malloc(nq * sizeof *y_ref), *l_ref = malloc(nl * sizeof *l_ref);
    moe_real *y[3], *l[3];
    for (int p = 0; p < 3; p++) {
        y[p] = malloc(nq * sizeof *y[p]);
        l[p] = malloc(nl * sizeof *l[p]);
        ck_assert(y[p] && l[p]);
    }
    ck_assert(y_ref && l_ref);
    moe_cpu_attention_forward(y_ref, l_ref, NULL, q, k, v, sh);

    void *dq = upload(q, nq), *dk = upload(k, nkv), *dv = upload(v, nkv);
    const int sm90 = device_is_sm90();
    /* p = 0: the portable kernel (MOE_FLASH_SM90=0); p = 1: the Hopper one (the default,
     * its overlapped loop); p = 2: the Hopper one with MOE_FLASH_SM90_PIPE=0 */
    for (int p = 0; p < 3; p++) {
        ck_assert_int_eq(setenv("MOE_FLASH_SM90", p ? "1" : "0", 1), 0);
        ck_assert_int_eq(setenv("MOE_FLASH_SM90_PIPE", p == 2 ? "0" : "1", 1), 0);
        void *dy = upload_nan(nq);
        float *dl = upload_nan_f32(nl), *ws = upload_nan_f32(nl);
        const long long before = moe_cuda_attention_sm90_calls();
        moe_cuda_attention_forward(dy, dl, ws, dq, dk, dv, sh);
        CU_OK(cudaGetLastError());
        download(y[p], dy, nq);
        download_f32(l[p], dl, nl);
        const long long ran = moe_cuda_attention_sm90_calls() - before;
        ck_assert_msg(ran == (p && sm90), "%s: the Hopper path ran %lld times with "
                      "MOE_FLASH_SM90=%d on a device %s sm_90", s.what, ran, p > 0,
                      sm90 ? "of" : "not of");
        cudaFree(dy);
        cudaFree(dl);
        cudaFree(ws);
    }
    unsetenv("MOE_FLASH_SM90");
    unsetenv("MOE_FLASH_SM90_PIPE");

    printf("attention sm90 forward B=%d Tq=%4d Tk=%4d Hq=%d Hkv=%d D=%3d pos %d/%d (%s)%s\n",
           s.B, s.Tq, s.Tk, s.Hq, s.Hkv, s.D, s.q_pos, s.k_pos, s.what,
           sm90 ? "" : " [no sm_90 device: the fallback]");
    for (int p = 1; p < 3; p++) {
        const char *loop = p == 1 ? "overlapped loop" : "MOE_FLASH_SM90_PIPE=0";
        printf(" %s:\n", loop);
        const double ey = diag_err("y vs cpu", y[p], y_ref, nq, 1e-2);
        const double ep = diag_err("y vs portable", y[p], y[0], nq, 1e-2);
        size_t inf_mismatch;
        const double el = lse_err(l[p], l_ref, nl, &inf_mismatch);
        size_t first_inf = nl;
        for (size_t i = 0; i < nl && first_inf == nl; i++)
            if ((isinf(l[p][i]) || isinf(l_ref[i])) && l[p][i] != l_ref[i])
                first_inf = i;
        if (first_inf < nl)
            printf("  lse: first -inf mismatch at %zu: got %g, want %g\n", first_inf,
                   (double)l[p][first_inf], (double)l_ref[first_inf]);
        printf("  y %.2e (vs portable %.2e)  lse %.2e\n", ey, ep, el);
        ck_assert_msg(ey <= 1e-2, "%s (%s): y error %g against the CPU", s.what, loop, ey);
        ck_assert_msg(ep <= 1e-2, "%s (%s): y error %g against the portable kernel", s.what,
                      loop, ep);
        ck_assert_msg(el <= 1e-3, "%s (%s): lse error %g", s.what, loop, el);
        ck_assert_msg(inf_mismatch == 0, "%s (%s): %zu lse entries are -inf on one side only",
                      s.what, loop, inf_mismatch);
    }

    cudaFree(dq);
    cudaFree(dk);
    cudaFree(dv);
    moe_real *hbufs[] = {q, k, v, y_ref, l_ref, y[0], y[1], y[2], l[0], l[1], l[2]};
    for (size_t i = 0; i < sizeof hbufs / sizeof hbufs[0]; i++)
        free(hbufs[i]);
}
END_TEST

/* ------------------------------------------------------------------------ backward */

START_TEST(test_attention_backward) {
    if (SHAPE_SKIPPED(_i))
        return;
    const shape s = SHAPES[_i % NSHAPES];
    const char *tiles = tiles_for(_i);
    const moe_attention_shape sh = op_shape(&s);
    const size_t nq = (size_t)s.B * s.Tq * s.Hq * s.D, nkv = (size_t)s.B * s.Tk * s.Hkv * s.D;
    const size_t nl = (size_t)s.B * s.Hq * s.Tq;
    moe_real *q = randn_bf16(nq, 40 + (uint64_t)(_i % NSHAPES), 1.0);
    moe_real *k = randn_bf16(nkv, 50 + (uint64_t)(_i % NSHAPES), 1.0);
    moe_real *v = randn_bf16(nkv, 60 + (uint64_t)(_i % NSHAPES), 1.0);
    moe_real *gy = randn_bf16(nq, 70 + (uint64_t)(_i % NSHAPES), 1.0);
    /* the gradients start non-zero: the backward must add to them */
    moe_real *gq0 = randn_bf16(nq, 80 + (uint64_t)(_i % NSHAPES), 1.0);
    moe_real *gk0 = randn_bf16(nkv, 90 + (uint64_t)(_i % NSHAPES), 1.0);
    moe_real *gv0 = randn_bf16(nkv, 100 + (uint64_t)(_i % NSHAPES), 1.0);
    /* y and lse from the CPU forward, y rounded to bf16 as the GPU stores it; both sides
     * use them (the contract hands y and lse to the backward, which takes δ = dy·y) */
    moe_real *y = malloc(nq * sizeof *y), *lse = malloc(nl * sizeof *lse);
    ck_assert(y && lse);
    moe_cpu_attention_forward(y, lse, NULL, q, k, v, sh);
    round_bf16(y, nq);

    moe_real *gq_ref = malloc(nq * sizeof *gq_ref), *gq = malloc(nq * sizeof *gq);
    moe_real *gk_ref = malloc(nkv * sizeof *gk_ref), *gk = malloc(nkv * sizeof *gk);
    moe_real *gv_ref = malloc(nkv * sizeof *gv_ref), *gv = malloc(nkv * sizeof *gv);
    ck_assert(gq_ref && gq && gk_ref && gk && gv_ref && gv);
    memcpy(gq_ref, gq0, nq * sizeof *gq_ref);
    memcpy(gk_ref, gk0, nkv * sizeof *gk_ref);
    memcpy(gv_ref, gv0, nkv * sizeof *gv_ref);
    moe_cpu_attention_backward(gq_ref, gk_ref, gv_ref, gy, y, lse, NULL, q, k, v, sh);

    void *dq = upload(q, nq), *dk = upload(k, nkv), *dv = upload(v, nkv);
    void *dgy = upload(gy, nq), *dy = upload(y, nq);
    float *dlse = upload_f32(lse, nl), *ws = upload_nan_f32(nl);
    void *dgq = upload(gq0, nq), *dgk = upload(gk0, nkv), *dgv = upload(gv0, nkv);
    moe_cuda_attention_backward(dgq, dgk, dgv, dgy, dy, dlse, ws, dq, dk, dv, sh);
    CU_OK(cudaGetLastError());
    download(gq, dgq, nq);
    download(gk, dgk, nkv);
    download(gv, dgv, nkv);

    /* the accumulated values, and the increments alone (gpu − start vs cpu − start) */
    const double eq = norm_err(gq, gq_ref, nq), ek = norm_err(gk, gk_ref, nkv),
                 ev = norm_err(gv, gv_ref, nkv);
    moe_real *iq = diff(gq, gq0, nq), *iq_ref = diff(gq_ref, gq0, nq);
    moe_real *ik = diff(gk, gk0, nkv), *ik_ref = diff(gk_ref, gk0, nkv);
    moe_real *iv = diff(gv, gv0, nkv), *iv_ref = diff(gv_ref, gv0, nkv);
    const double jq = increment_err(iq, iq_ref, gq_ref, nq),
                 jk = increment_err(ik, ik_ref, gk_ref, nkv),
                 jv = increment_err(iv, iv_ref, gv_ref, nkv);
    printf("attention backward %s B=%d Tq=%3d Tk=%3d Hq=%d Hkv=%d D=%3d pos %d/%d (%s): dq %.2e "
           "dk %.2e dv %.2e (increments %.2e %.2e %.2e)\n",
           tiles, s.B, s.Tq, s.Tk, s.Hq, s.Hkv, s.D, s.q_pos, s.k_pos, s.what, eq, ek, ev, jq, jk,
           jv);
    ck_assert_msg(eq <= 1e-2, "%s: dq error %g", s.what, eq);
    ck_assert_msg(ek <= 1e-2, "%s: dk error %g", s.what, ek);
    ck_assert_msg(ev <= 1e-2, "%s: dv error %g", s.what, ev);
    /* the increments carry the bf16 rounding of start + increment and of P, dS in the
     * tensor-core products: a looser bound */
    ck_assert_msg(jq <= 3e-2, "%s: dq increment error %g", s.what, jq);
    ck_assert_msg(jk <= 3e-2, "%s: dk increment error %g", s.what, jk);
    ck_assert_msg(jv <= 3e-2, "%s: dv increment error %g", s.what, jv);

    void *bufs[] = {dq, dk, dv, dgy, dy, dlse, ws, dgq, dgk, dgv};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        cudaFree(bufs[i]);
    moe_real *hbufs[] = {q,  k,  v,      gy, gq0,    gk0, gv0,    gq_ref, gq, gk_ref, gk,
                         gv_ref, gv, y,      lse, iq, iq_ref, ik, ik_ref, iv, iv_ref};
    for (size_t i = 0; i < sizeof hbufs / sizeof hbufs[0]; i++)
        free(hbufs[i]);
    unsetenv("MOE_FLASH_MT"); /* back to the default for whatever runs next */
    unsetenv("MOE_FLASH_SM90");
}
END_TEST

/* ------------------------------------------------------------------- determinism */

/* Fetch n bf16 device values as raw bits. */
static uint16_t *bits(const void *d, size_t n) {
    uint16_t *h = malloc(n * sizeof *h);
    ck_assert_ptr_nonnull(h);
    CU_OK(cudaDeviceSynchronize());
    CU_OK(cudaMemcpy(h, d, n * sizeof *h, cudaMemcpyDeviceToHost));
    return h;
}

/* Two runs from the same inputs give the same bits (no atomics, fixed orders), for the
 * two fast head dimensions, GQA and a query chunk against another key chunk. */
static const moe_attention_shape DET_SHAPES[] = {
    {2, 300, 300, 6, 2, 64, 0, 0},
    {2, 200, 260, 4, 1, 128, 60, 0},
};

#define NDET ((int)(sizeof DET_SHAPES / sizeof DET_SHAPES[0]))

START_TEST(test_attention_deterministic) {
    const moe_attention_shape sh = DET_SHAPES[_i % NDET];
    ck_assert_int_eq(setenv("MOE_FLASH_MT", _i >= NDET ? "1" : "2", 1), 0);
    const size_t nq = (size_t)sh.B * sh.Tq * sh.Hq * sh.D;
    const size_t nkv = (size_t)sh.B * sh.Tk * sh.Hkv * sh.D, nl = (size_t)sh.B * sh.Hq * sh.Tq;
    moe_real *q = randn_bf16(nq, 110, 1.0), *k = randn_bf16(nkv, 111, 1.0);
    moe_real *v = randn_bf16(nkv, 112, 1.0), *gy = randn_bf16(nq, 113, 1.0);
    void *dq = upload(q, nq), *dk = upload(k, nkv), *dv = upload(v, nkv), *dgy = upload(gy, nq);
    uint16_t *out[2][5];
    for (int run = 0; run < 2; run++) {
        void *dy = upload_nan(nq);
        float *dl = upload_nan_f32(nl), *ws = upload_nan_f32(nl);
        void *dgq = upload_zero(nq), *dgk = upload_zero(nkv), *dgv = upload_zero(nkv);
        moe_cuda_attention_forward(dy, dl, ws, dq, dk, dv, sh);
        moe_cuda_attention_backward(dgq, dgk, dgv, dgy, dy, dl, ws, dq, dk, dv, sh);
        out[run][0] = bits(dy, nq);
        out[run][1] = bits(dgq, nq);
        out[run][2] = bits(dgk, nkv);
        out[run][3] = bits(dgv, nkv);
        out[run][4] = bits(dl, 2 * nl); /* fp32: two 16-bit halves each */
        void *bufs[] = {dy, dl, ws, dgq, dgk, dgv};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
            cudaFree(bufs[i]);
    }
    const size_t n[5] = {nq, nq, nkv, nkv, 2 * nl};
    const char *name[5] = {"y", "dq", "dk", "dv", "lse"};
    for (int i = 0; i < 5; i++) {
        ck_assert_msg(memcmp(out[0][i], out[1][i], n[i] * 2) == 0,
                      "D=%d MT=%d: %s differs between runs", sh.D, _i >= NDET ? 1 : 2, name[i]);
        free(out[0][i]);
        free(out[1][i]);
    }
    cudaFree(dq);
    cudaFree(dk);
    cudaFree(dv);
    cudaFree(dgy);
    free(q);
    free(k);
    free(v);
    free(gy);
    unsetenv("MOE_FLASH_MT"); /* back to the default for whatever runs next */
}
END_TEST

/* ------------------------------------------------------ the Hopper backward (sm_90a) */

/* The elements where a is not within a few bf16 ulps of b: |a − b| > 2^-6 |b| (2 to 4 ulps of
 * b: a bf16 ulp is 2^-8 .. 2^-7 of the value) + 2^-12 max|b| (for values near 0, whose ulp is
 * finer than what an fp32 sum in another order can hold them to). Prints the first and the
 * count; returns the count (0: close). For two gradients that differ only in the order of
 * their fp32 sums before one bf16 rounding. */
static size_t far_ulps(const char *what, const moe_real *a, const moe_real *b, size_t n) {
    double mx = 0.0;
    for (size_t i = 0; i < n; i++)
        mx = fabs((double)b[i]) > mx ? fabs((double)b[i]) : mx;
    size_t far = 0, same = 0;
    for (size_t i = 0; i < n; i++) {
        const double d = fabs((double)a[i] - (double)b[i]);
        same += a[i] == b[i];
        if (isnan(d) || d > ldexp(fabs((double)b[i]), -6) + ldexp(mx, -12)) {
            if (!far)
                printf("  %s: first element beyond a few ulps at %zu: got %g, want %g\n", what,
                       i, (double)a[i], (double)b[i]);
            far++;
        }
    }
    printf("  %s: %zu of %zu elements differ, %zu beyond a few ulps\n", what, n - same, n, far);
    return far;
}

/* kernels/attention_sm90_bwd.cu (MOE_FLASH_SM90_BWD=1 to 7, set here and restored) against
 * the CPU twin and against the portable backward (MOE_FLASH_SM90_BWD=0), dq, dk, dv, on the
 * shapes its tiles make hard: lengths around its 64- and 128-row tiles (1, 63, 127, 129, 300,
 * 1000, 4096), both head dims it runs, GQA 4 (Hq = 8, Hkv = 2: dk, dv summed over 4 query
 * heads), MHA, MQA, and context parallelism's chunks (queries after their keys, all rows
 * blind, a shifted diagonal, some blind rows). The gradients start at random values (the
 * backward adds to them), so a row it overwrites or forgets fails the increment check. Each
 * mode runs twice and must give the same bits (mode 1: no atomics; mode 2: its dq additions
 * in a fixed order); mode 2 is also compared with mode 1 (its dk, dv come from the same
 * instructions, so they should be the same bits: printed, not asserted); mode 3 (mode 2's
 * kernel with its wgmmas overlapped with its arithmetic: the same operations in the same
 * order) must give mode 2's bits exactly, dq, dk and dv (asserted where the Hopper backward
 * ran). Mode 4 (mode 2's kernel with the dq tiles reduce-added in no fixed order: NOT
 * deterministic) must give mode 2's dk and dv bits (the same instructions; asserted, and the
 * same in both runs) and a dq within a few bf16 ulps of mode 2's (far_ulps: the same fp32
 * terms summed in another order, then one rounding), besides the bounds against the CPU,
 * the portable backward and mode 1 that every mode meets; its two runs may differ in dq
 * (printed, not asserted). Mode 5 (mode 4 with its dk/dv epilogue's loads batched: the same
 * operations) is held to mode 4's checks. Mode 6 (mode 2's products in FlashAttention-3's
 * order, a dq hand-off per warpgroup; deterministic) is held to mode 3's: mode 2's dq, dk, dv
 * bits. Mode 7 (mode 6 without the dq ordering) is held to mode 4's. On an sm_90 device the
 * test fails unless each Hopper path ran (moe_cuda_attention_sm90_backward_calls() and, for
 * modes 2 to 7, moe_cuda_attention_sm90_backward_fused_calls(), for mode 3 also
 * moe_cuda_attention_sm90_backward_overlap_calls(), for modes 4, 5 and 7
 * moe_cuda_attention_sm90_backward_nondet_calls(), for mode 5
 * moe_cuda_attention_sm90_backward_batched_calls(), for modes 6 and 7
 * moe_cuda_attention_sm90_backward_fa3order_calls(), grew); elsewhere it checks the
 * fallback. The shapes are the forward test's (SM90_SHAPES): one list serves both. */
START_TEST(test_attention_sm90_backward) {
    const shape s = SM90_SHAPES[_i];
    if (moe_test_quick() && s.Tq >= 4096)
        return;
    const moe_attention_shape sh = op_shape(&s);
    const size_t nq = (size_t)s.B * s.Tq * s.Hq * s.D, nkv = (size_t)s.B * s.Tk * s.Hkv * s.D;
    const size_t nl = (size_t)s.B * s.Hq * s.Tq;
    const uint64_t seed = 300 + 10 * (uint64_t)_i;
    moe_real *q = randn_bf16(nq, seed, 1.0), *k = randn_bf16(nkv, seed + 1, 1.0);
    moe_real *v = randn_bf16(nkv, seed + 2, 1.0), *gy = randn_bf16(nq, seed + 3, 1.0);
    /* the gradients start non-zero: the backward must add to them */
    moe_real *g0[3] = {randn_bf16(nq, seed + 4, 1.0), randn_bf16(nkv, seed + 5, 1.0),
                       randn_bf16(nkv, seed + 6, 1.0)};
    const size_t n[3] = {nq, nkv, nkv};
    const char *name[3] = {"dq", "dk", "dv"};
    moe_real *y = malloc(nq * sizeof *y), *lse = malloc(nl * sizeof *lse);
    ck_assert(y && lse);
    moe_cpu_attention_forward(y, lse, NULL, q, k, v, sh);
    round_bf16(y, nq);
    moe_real *ref[3];
    for (int i = 0; i < 3; i++) {
        ref[i] = malloc(n[i] * sizeof *ref[i]);
        ck_assert_ptr_nonnull(ref[i]);
        memcpy(ref[i], g0[i], n[i] * sizeof *ref[i]);
    }
    moe_cpu_attention_backward(ref[0], ref[1], ref[2], gy, y, lse, NULL, q, k, v, sh);

    void *dq = upload(q, nq), *dk = upload(k, nkv), *dv = upload(v, nkv);
    void *dgy = upload(gy, nq), *dy = upload(y, nq);
    float *dlse = upload_f32(lse, nl);
    const int sm90 = device_is_sm90();
    const moe_bench_env env = moe_bench_env_set("MOE_FLASH_SM90_BWD", "0");
    /* run 0: the portable backward; runs 2m − 1, 2m: mode m = 1 .. 7 (each twice: the same
     * bits, but for the dq of the non-deterministic modes 4, 5 and 7) */
    enum { RUNS = 15, MODES = 7 };
    static const char *const mode[RUNS] = {"0", "1", "1", "2", "2", "3", "3", "4",
                                           "4", "5", "5", "6", "6", "7", "7"};
    moe_real *got[RUNS][3];
    uint16_t *raw[RUNS][3];
    for (int r = 0; r < RUNS; r++) {
        ck_assert_int_eq(setenv("MOE_FLASH_SM90_BWD", mode[r], 1), 0);
        float *ws = upload_nan_f32(nl);
        void *dg[3] = {upload(g0[0], nq), upload(g0[1], nkv), upload(g0[2], nkv)};
        const long long before = moe_cuda_attention_sm90_backward_calls();
        const long long fused_before = moe_cuda_attention_sm90_backward_fused_calls();
        const long long overlap_before = moe_cuda_attention_sm90_backward_overlap_calls();
        const long long nondet_before = moe_cuda_attention_sm90_backward_nondet_calls();
        const long long batched_before = moe_cuda_attention_sm90_backward_batched_calls();
        const long long fa3_before = moe_cuda_attention_sm90_backward_fa3order_calls();
        moe_cuda_attention_backward(dg[0], dg[1], dg[2], dgy, dy, dlse, ws, dq, dk, dv, sh);
        CU_OK(cudaGetLastError());
        CU_OK(cudaDeviceSynchronize());
        const long long ran = moe_cuda_attention_sm90_backward_calls() - before;
        const long long fused = moe_cuda_attention_sm90_backward_fused_calls() - fused_before;
        const long long overlap =
            moe_cuda_attention_sm90_backward_overlap_calls() - overlap_before;
        const long long nondet = moe_cuda_attention_sm90_backward_nondet_calls() - nondet_before;
        const long long batched =
            moe_cuda_attention_sm90_backward_batched_calls() - batched_before;
        const long long fa3 = moe_cuda_attention_sm90_backward_fa3order_calls() - fa3_before;
        const int m_r = (r + 1) / 2; /* the run's mode (0: the portable backward) */
        ck_assert_msg(ran == (r && sm90) && fused == (m_r >= 2 && sm90) &&
                          overlap == (m_r == 3 && sm90) &&
                          nondet == ((m_r == 4 || m_r == 5 || m_r == 7) && sm90) &&
                          batched == (m_r == 5 && sm90) && fa3 == (m_r >= 6 && sm90),
                      "%s: with MOE_FLASH_SM90_BWD=%s on a device %s sm_90 the Hopper backward "
                      "ran %lld times, its fused kernel %lld times, in mode 3 %lld times, in "
                      "mode 4, 5 or 7 %lld times, in mode 5 %lld times, in mode 6 or 7 %lld "
                      "times",
                      s.what, mode[r], sm90 ? "of" : "not of", ran, fused, overlap, nondet,
                      batched, fa3);
        for (int i = 0; i < 3; i++) {
            got[r][i] = malloc(n[i] * sizeof *got[r][i]);
            ck_assert_ptr_nonnull(got[r][i]);
            download(got[r][i], dg[i], n[i]);
            raw[r][i] = bits(dg[i], n[i]);
            cudaFree(dg[i]);
        }
        cudaFree(ws);
    }
    moe_bench_env_restore(&env);

    printf("attention sm90 backward B=%d Tq=%4d Tk=%4d Hq=%d Hkv=%d D=%3d pos %d/%d (%s)%s\n",
           s.B, s.Tq, s.Tk, s.Hq, s.Hkv, s.D, s.q_pos, s.k_pos, s.what,
           sm90 ? "" : " [no sm_90 device: the fallback]");
    for (int m = 1; m <= MODES; m++) { /* mode m: runs 2m − 1 and 2m */
        const int r = 2 * m - 1;
        for (int i = 0; i < 3; i++) {
            char what[64];
            snprintf(what, sizeof what, "mode %d %s vs cpu", m, name[i]);
            const double e = diag_err(what, got[r][i], ref[i], n[i], 1e-2);
            snprintf(what, sizeof what, "mode %d %s vs portable", m, name[i]);
            const double ep = diag_err(what, got[r][i], got[0][i], n[i], 1e-2);
            snprintf(what, sizeof what, "mode %d %s vs mode 1", m, name[i]);
            const double e1 = diag_err(what, got[r][i], got[1][i], n[i], 1e-2);
            /* the increments alone (gpu − start vs cpu − start): where a kernel overwrites
             * or forgets, this is what shows it */
            moe_real *inc = diff(got[r][i], g0[i], n[i]), *inc_ref = diff(ref[i], g0[i], n[i]);
            snprintf(what, sizeof what, "mode %d %s increment vs cpu", m, name[i]);
            diag_err(what, inc, inc_ref, n[i], 3e-2);
            const double ei = increment_err(inc, inc_ref, ref[i], n[i]);
            size_t first_diff = n[i];
            for (size_t j = 0; j < n[i] && first_diff == n[i]; j++)
                if (raw[r][i][j] != raw[r + 1][i][j])
                    first_diff = j;
            const int same_as_1 = m >= 2 && memcmp(raw[r][i], raw[1][i], n[i] * 2) == 0;
            /* the non-deterministic modes' dq may differ from run to run */
            const int nondet_dq = (m == 4 || m == 5 || m == 7) && i == 0;
            /* modes 3 to 7 (but 4, 5 and 7's dq): the first element that differs from mode 2 */
            const int as_2 = m >= 3 && !nondet_dq;
            size_t diff_2 = n[i];
            for (size_t j = 0; as_2 && j < n[i] && diff_2 == n[i]; j++)
                if (raw[r][i][j] != raw[3][i][j])
                    diff_2 = j;
            printf("  mode %d %s: %.2e (vs portable %.2e, vs mode 1 %.2e%s, "
                   "increment %.2e)%s%s\n",
                   m, name[i], e, ep, e1, same_as_1 ? ": the same bits" : "", ei,
                   first_diff == n[i]         ? ""
                   : nondet_dq        ? " (its two runs differ: expected)"
                                      : " NOT deterministic",
                   as_2 ? (diff_2 < n[i] ? " NOT mode 2's bits" : ", mode 2's bits") : "");
            size_t far_2 = 0; /* modes 4, 5, 7's dq (both runs): within a few ulps of mode 2's */
            for (int rr = r; nondet_dq && rr <= r + 1; rr++) {
                snprintf(what, sizeof what, "mode %d run %d dq vs mode 2", m, rr - r + 1);
                far_2 += far_ulps(what, got[rr][i], got[3][i], n[i]);
            }
            ck_assert_msg(e <= 1e-2, "%s: mode %d %s error %g against the CPU", s.what, m,
                          name[i], e);
            ck_assert_msg(ep <= 1e-2, "%s: mode %d %s error %g against the portable backward",
                          s.what, m, name[i], ep);
            ck_assert_msg(e1 <= 1e-2, "%s: mode %d %s error %g against mode 1", s.what, m,
                          name[i], e1);
            ck_assert_msg(ei <= 3e-2, "%s: mode %d %s increment error %g", s.what, m, name[i],
                          ei);
            /* modes 4, 5, 7's dq may differ between runs (its additions have no fixed order) */
            ck_assert_msg(first_diff == n[i] || nondet_dq,
                          "%s: mode %d %s differs between two runs at %zu", s.what, m, name[i],
                          first_diff);
            /* modes 3 and 6 are mode 2's operations with mode 2's accumulation orders, modes
             * 4, 5 and 7's dk and dv are mode 2's operations (without an sm_90 device all are
             * the portable backward, deterministic too) */
            ck_assert_msg(diff_2 == n[i], "%s: mode %d %s differs from mode 2 at %zu", s.what,
                          m, name[i], diff_2);
            ck_assert_msg(far_2 == 0, "%s: mode %d dq: %zu elements beyond a few ulps of mode 2's",
                          s.what, m, far_2);
            free(inc);
            free(inc_ref);
        }
    }

    void *bufs[] = {dq, dk, dv, dgy, dy, dlse};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        cudaFree(bufs[i]);
    for (int i = 0; i < 3; i++) {
        for (int r = 0; r < RUNS; r++) {
            free(got[r][i]);
            free(raw[r][i]);
        }
        free(ref[i]);
        free(g0[i]);
    }
    free(q), free(k), free(v), free(gy), free(y), free(lse);
}
END_TEST

/* ------------------------------------------- context parallelism's device pieces */

/* cp_merge (kernels/cp_merge.cu) against moe_cp_merge(), the CPU op, on fresh random inputs
 * ({B, T, H, D}: the fast head dimensions and odd ones). Every fifth row's accumulator is at
 * −∞ (its y poisoned with NaN: the part must replace it), every fifth row's part (its y_b
 * poisoned: it must not be read), every fifth row both (nothing changes). Those rows must
 * match the CPU exactly; merged rows within bf16's rounding of y (max error / max |y|
 * 1e-2: one rounding is at most 2^-9 relative) and fp32's of the lse (1e-5). */
static const int MERGE_SHAPES[][4] = {{2, 7, 3, 64}, {1, 33, 4, 128}, {3, 5, 2, 5}};
#define NMERGE ((int)(sizeof MERGE_SHAPES / sizeof MERGE_SHAPES[0]))

START_TEST(test_cp_merge) {
    const int B = MERGE_SHAPES[_i][0], T = MERGE_SHAPES[_i][1], H = MERGE_SHAPES[_i][2],
              D = MERGE_SHAPES[_i][3];
    const size_t ny = (size_t)B * T * H * D, nl = (size_t)B * H * T;
    moe_real *y = randn_bf16(ny, 300 + _i, 1.0), *yb = randn_bf16(ny, 400 + _i, 1.0);
    moe_real *la = malloc(nl * sizeof *la), *lb = malloc(nl * sizeof *lb);
    moe_test_randn(la, nl, 500 + _i, 3.0);
    moe_test_randn(lb, nl, 600 + _i, 3.0);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++) {
                const size_t l = ((size_t)b * H + h) * T + t, row = (((size_t)b * T + t) * H + h) * D;
                if (l % 5 == 1 || l % 5 == 3)
                    la[l] = -INFINITY;
                if (l % 5 == 2 || l % 5 == 3)
                    lb[l] = -INFINITY;
                if (l % 5 == 1) /* the part replaces it */
                    moe_test_poison(y + row, D);
                if (l % 5 == 2) /* never read */
                    moe_test_poison(yb + row, D);
            }
    void *dy = upload(y, ny), *dyb = upload(yb, ny);
    float *dla = upload_f32(la, nl), *dlb = upload_f32(lb, nl);
    moe_cuda_cp_merge(dy, dla, dyb, dlb, B, T, H, D);
    moe_backend_cpu()->cp_merge(y, la, yb, lb, B, T, H, D);
    moe_real *gy = malloc(ny * sizeof *gy), *gl = malloc(nl * sizeof *gl);
    download(gy, dy, ny);
    download_f32(gl, dla, nl);
    double num = 0, den = 0, lerr = 0;
    long long exact_bad = 0;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++) {
                const size_t l = ((size_t)b * H + h) * T + t, row = (((size_t)b * T + t) * H + h) * D;
                if (l % 5 >= 1 && l % 5 <= 3) { /* a −∞ rule: exactly the CPU's */
                    exact_bad += !(gl[l] == la[l]);
                    for (int d = 0; d < D; d++)
                        exact_bad += !(gy[row + d] == y[row + d]);
                    continue;
                }
                lerr = fmax(lerr, fabs((double)gl[l] - la[l]) / fmax(1.0, fabs((double)la[l])));
                for (int d = 0; d < D; d++) {
                    const double e = fabs((double)gy[row + d] - y[row + d]);
                    num = isnan(e) ? INFINITY : fmax(num, e);
                    den = fmax(den, fabs((double)y[row + d]));
                }
            }
    const double yerr = num / den;
    printf("  cp_merge B=%d T=%d H=%d D=%d: y %.1e lse %.1e, %lld of the -inf rows' values "
           "differ\n", B, T, H, D, yerr, lerr, exact_bad);
    ck_assert_msg(exact_bad == 0, "cp_merge: %lld values of rows at -inf differ from the CPU's",
                  exact_bad);
    ck_assert_msg(yerr <= 1e-2 && lerr <= 1e-5, "cp_merge B=%d T=%d H=%d D=%d: y %.2e lse %.2e",
                  B, T, H, D, yerr, lerr);
    cudaFree(dy), cudaFree(dyb), cudaFree(dla), cudaFree(dlb);
    free(y), free(yb), free(la), free(lb), free(gy), free(gl);
}
END_TEST

/* copy_2d and fill_real against their CPU twins: strided rows into a poisoned destination
 * (the gaps between the rows must keep the poison), and −∞ into all but the last of a
 * poisoned buffer. */
START_TEST(test_cp_copy_2d_fill) {
    enum { ROWS = 9, SP = 40, DP = 56, W = 26, N = 1001 };
    unsigned char src[ROWS * SP], want[ROWS * DP], got[ROWS * DP];
    for (int i = 0; i < ROWS * SP; i++)
        src[i] = (unsigned char)(i * 7 + 3);
    memset(want, 0xff, sizeof want);
    moe_backend_cpu()->copy_2d(want, DP, src, SP, W, ROWS);
    void *dsrc = NULL, *ddst = NULL;
    CU_OK(cudaMalloc(&dsrc, sizeof src));
    CU_OK(cudaMalloc(&ddst, sizeof got));
    CU_OK(cudaMemcpy(dsrc, src, sizeof src, cudaMemcpyHostToDevice));
    CU_OK(cudaMemset(ddst, 0xff, sizeof got));
    moe_cuda_copy_2d(ddst, DP, dsrc, SP, W, ROWS);
    CU_OK(cudaDeviceSynchronize());
    CU_OK(cudaMemcpy(got, ddst, sizeof got, cudaMemcpyDeviceToHost));
    ck_assert_msg(memcmp(got, want, sizeof got) == 0, "copy_2d differs from the CPU's");
    moe_real *hw = malloc(N * sizeof *hw), *hg = malloc(N * sizeof *hg);
    moe_test_poison(hw, N);
    float *df = upload_nan_f32(N);
    moe_backend_cpu()->fill_real(hw, -INFINITY, N - 1);
    moe_cuda_fill_real(df, -INFINITY, N - 1);
    download_f32(hg, df, N);
    for (int i = 0; i < N - 1; i++)
        ck_assert_msg(isinf(hg[i]) && hg[i] < 0 && hg[i] == hw[i], "fill_real: element %d", i);
    ck_assert_msg(isnan(hg[N - 1]) && isnan(hw[N - 1]), "fill_real wrote past its n");
    cudaFree(dsrc), cudaFree(ddst), cudaFree(df);
    free(hw), free(hg);
}
END_TEST

Suite *suite_gpu_attention(void) {
    Suite *s = suite_create("gpu_attention");
    TCase *tc = tcase_create("attention");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, test_attention_forward, 0, 2 * NSHAPES);
    tcase_add_loop_test(tc, test_attention_sm90, 0, NSM90);
    tcase_add_loop_test(tc, test_attention_backward, 0, 2 * NSHAPES);
    tcase_add_loop_test(tc, test_attention_deterministic, 0, 2 * NDET);
    tcase_add_loop_test(tc, test_attention_sm90_backward, 0, NSM90);
    suite_add_tcase(s, tc);
    TCase *cp = tcase_create("cp"); /* CK_RUN_CASE=cp: context parallelism's pieces alone */
    tcase_add_loop_test(cp, test_cp_merge, 0, NMERGE);
    tcase_add_test(cp, test_cp_copy_2d_fill);
    suite_add_tcase(s, cp);
    return s;
}
