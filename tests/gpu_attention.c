/*
 * CUDA causal GQA attention (kernels/attention.cu) against its CPU twin, the naive CPU
 * attention (lib/cpu/attention.c, moe_cpu_attention_naive_*), on fresh random inputs.
 *
 * Inputs are rounded to bf16 before both sides see them, so the only differences
 * left are fp32 summation order and the bf16 rounding of the GPU's outputs. Errors are
 * measured as max|gpu − cpu| / max|cpu| over a whole tensor. Outputs start as NaN
 * (forward) or as random values (backward, which must accumulate), so an element that
 * a kernel forgets to write, or overwrites instead of adding to, fails the check.
 *
 * The op contract (backend.h) makes the probabilities an opaque workspace; both naive
 * implementations keep P [B, Hq, T, T] there (bf16 on the GPU), and these tests compare it
 * as such. The row log-sum-exp lse is an fp32 output of both.
 *
 * This file talks to the GPU through the CUDA runtime only (cudaMalloc, cudaMemcpy and
 * a host-side fp32 ↔ bf16 conversion), so it depends on nothing but the attention kernels.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    int B, T, Hq, Hkv, D;
    int pos; /* q_pos = k_pos: a chunk attending to itself, at that offset */
    const char *what;
} shape;

static const shape SHAPES[] = {
    {2, 37, 4, 2, 32, 0, "GQA, T shorter than a tile"},
    {3, 100, 3, 3, 64, 0, "MHA, T not a multiple of the tile"},
    {2, 100, 4, 1, 128, 0, "MQA, D = 128"},
    {2, 130, 6, 2, 40, 0, "GQA, D not a multiple of 16, three tiles"},
    {3, 64, 2, 1, 16, 0, "MQA, small D, exactly one tile"},
    {4, 512, 8, 4, 64, 0, "realistic"}, /* skipped under MOE_TEST_QUICK (the sanitizer run) */
    {2, 100, 4, 2, 64, 300, "a chunk at positions 300..399 attending to itself"},
};

#define SHAPE_SKIPPED(i) (moe_test_quick() && SHAPES[i].T >= 512)
#define NSHAPES ((int)(sizeof SHAPES / sizeof SHAPES[0]))

/* The op's shape of a test case. */
static moe_attention_shape op_shape(const shape *s) {
    moe_attention_shape o = {s->B, s->T, s->T, s->Hq, s->Hkv, s->D, s->pos, s->pos};
    return o;
}

/* ------------------------------------------------------------------------- forward */

START_TEST(test_attention_forward) {
    if (SHAPE_SKIPPED(_i))
        return;
    const shape s = SHAPES[_i];
    const int B = s.B, T = s.T, Hq = s.Hq, Hkv = s.Hkv, D = s.D;
    const size_t nq = (size_t)B * T * Hq * D, nkv = (size_t)B * T * Hkv * D;
    const size_t natt = (size_t)B * Hq * T * T, nl = (size_t)B * Hq * T;
    const moe_attention_shape sh = op_shape(&s);
    /* the naive workspace is P in bf16 */
    ck_assert_uint_eq(moe_cuda_attention_workspace_bytes(sh), natt * sizeof(uint16_t));
    moe_real *q = randn_bf16(nq, 10 + (uint64_t)_i, 1.0);
    moe_real *k = randn_bf16(nkv, 20 + (uint64_t)_i, 1.0);
    moe_real *v = randn_bf16(nkv, 30 + (uint64_t)_i, 1.0);
    moe_real *y_ref = malloc(nq * sizeof *y_ref), *y = malloc(nq * sizeof *y);
    moe_real *a_ref = malloc(natt * sizeof *a_ref), *a = malloc(natt * sizeof *a);
    moe_real *l_ref = malloc(nl * sizeof *l_ref), *l = malloc(nl * sizeof *l);
    ck_assert(y_ref && y && a_ref && a && l_ref && l);
    moe_cpu_attention_naive_forward(y_ref, l_ref, a_ref, q, k, v, sh);

    void *dq = upload(q, nq), *dk = upload(k, nkv), *dv = upload(v, nkv);
    void *dy = upload_nan(nq), *da = upload_nan(natt);
    float *dl = upload_nan_f32(nl);
    moe_cuda_attention_forward(dy, dl, da, dq, dk, dv, sh);
    CU_OK(cudaGetLastError());
    download(y, dy, nq);
    download(a, da, natt);
    download_f32(l, dl, nl);

    const double ey = norm_err(y, y_ref, nq), ea = norm_err(a, a_ref, natt);
    /* lse is fp32 on both sides, from the same bf16 inputs: only the summation order and
     * expf/logf differ, far inside what a bf16 output would allow */
    const double el = norm_err(l, l_ref, nl);
    /* every row of P sums to 1 and is exactly 0 above the diagonal */
    double worst_sum = 0.0;
    size_t nonzero_above = 0;
    for (size_t bh = 0; bh < (size_t)B * Hq; bh++)
        for (int t = 0; t < T; t++) {
            const moe_real *p = a + (bh * T + (size_t)t) * T;
            double sum = 0.0;
            for (int u = 0; u < T; u++) {
                if (u <= t)
                    sum += p[u];
                else if (p[u] != 0.0f)
                    nonzero_above++;
            }
            double dev = fabs(sum - 1.0);
            worst_sum = isnan(dev) ? INFINITY : (dev > worst_sum ? dev : worst_sum);
        }
    printf("attention forward  B=%d T=%4d Hq=%d Hkv=%d D=%3d (%s): y %.2e  att %.2e  "
           "lse %.2e  |rowsum-1| %.2e\n",
           B, T, Hq, Hkv, D, s.what, ey, ea, el, worst_sum);
    ck_assert_msg(ey <= 1e-2, "%s: y error %g", s.what, ey);
    ck_assert_msg(ea <= 1e-2, "%s: att error %g", s.what, ea);
    ck_assert_msg(el <= 1e-3, "%s: lse error %g", s.what, el);
    ck_assert_msg(worst_sum <= 5e-3, "%s: an att row sums to 1 ± %g", s.what, worst_sum);
    ck_assert_msg(nonzero_above == 0, "%s: %zu att entries above the diagonal are not 0",
                  s.what, nonzero_above);

    cudaFree(dq);
    cudaFree(dk);
    cudaFree(dv);
    cudaFree(dy);
    cudaFree(da);
    cudaFree(dl);
    free(q);
    free(k);
    free(v);
    free(y_ref);
    free(y);
    free(a_ref);
    free(a);
    free(l_ref);
    free(l);
}
END_TEST

/* ------------------------------------------------------------------------ backward */

START_TEST(test_attention_backward) {
    if (SHAPE_SKIPPED(_i))
        return;
    const shape s = SHAPES[_i];
    const int B = s.B, T = s.T, Hq = s.Hq, Hkv = s.Hkv, D = s.D;
    const size_t nq = (size_t)B * T * Hq * D, nkv = (size_t)B * T * Hkv * D;
    const size_t natt = (size_t)B * Hq * T * T, nl = (size_t)B * Hq * T;
    const moe_attention_shape sh = op_shape(&s);
    moe_real *q = randn_bf16(nq, 40 + (uint64_t)_i, 1.0);
    moe_real *k = randn_bf16(nkv, 50 + (uint64_t)_i, 1.0);
    moe_real *v = randn_bf16(nkv, 60 + (uint64_t)_i, 1.0);
    moe_real *gy = randn_bf16(nq, 70 + (uint64_t)_i, 1.0);
    /* the gradients start non-zero: the backward must add to them */
    moe_real *gq0 = randn_bf16(nq, 80 + (uint64_t)_i, 1.0);
    moe_real *gk0 = randn_bf16(nkv, 90 + (uint64_t)_i, 1.0);
    moe_real *gv0 = randn_bf16(nkv, 100 + (uint64_t)_i, 1.0);
    /* y, lse and P from the CPU forward, P rounded to bf16 as the GPU stores it; both sides
     * use them (the contract hands y and lse to the backward too) */
    moe_real *y = malloc(nq * sizeof *y), *att = malloc(natt * sizeof *att);
    moe_real *lse = malloc(nl * sizeof *lse);
    ck_assert(y && att && lse);
    moe_cpu_attention_naive_forward(y, lse, att, q, k, v, sh);
    round_bf16(att, natt);

    moe_real *gq_ref = malloc(nq * sizeof *gq_ref), *gq = malloc(nq * sizeof *gq);
    moe_real *gk_ref = malloc(nkv * sizeof *gk_ref), *gk = malloc(nkv * sizeof *gk);
    moe_real *gv_ref = malloc(nkv * sizeof *gv_ref), *gv = malloc(nkv * sizeof *gv);
    ck_assert(gq_ref && gq && gk_ref && gk && gv_ref && gv);
    memcpy(gq_ref, gq0, nq * sizeof *gq_ref);
    memcpy(gk_ref, gk0, nkv * sizeof *gk_ref);
    memcpy(gv_ref, gv0, nkv * sizeof *gv_ref);
    moe_cpu_attention_naive_backward(gq_ref, gk_ref, gv_ref, gy, y, lse, att, q, k, v, sh);

    void *dq = upload(q, nq), *dk = upload(k, nkv), *dv = upload(v, nkv);
    void *dgy = upload(gy, nq), *datt = upload(att, natt), *dy = upload(y, nq);
    float *dlse = upload_f32(lse, nl);
    void *dgq = upload(gq0, nq), *dgk = upload(gk0, nkv), *dgv = upload(gv0, nkv);
    moe_cuda_attention_backward(dgq, dgk, dgv, dgy, dy, dlse, datt, dq, dk, dv, sh);
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
    const double jq = norm_err(iq, iq_ref, nq), jk = norm_err(ik, ik_ref, nkv),
                 jv = norm_err(iv, iv_ref, nkv);
    printf("attention backward B=%d T=%4d Hq=%d Hkv=%d D=%3d (%s): dq %.2e dk %.2e dv %.2e "
           "(increments %.2e %.2e %.2e)\n",
           B, T, Hq, Hkv, D, s.what, eq, ek, ev, jq, jk, jv);
    ck_assert_msg(eq <= 1e-2, "%s: dq error %g", s.what, eq);
    ck_assert_msg(ek <= 1e-2, "%s: dk error %g", s.what, ek);
    ck_assert_msg(ev <= 1e-2, "%s: dv error %g", s.what, ev);
    /* the increments carry the bf16 rounding of start + increment: a looser bound */
    ck_assert_msg(jq <= 3e-2, "%s: dq increment error %g", s.what, jq);
    ck_assert_msg(jk <= 3e-2, "%s: dk increment error %g", s.what, jk);
    ck_assert_msg(jv <= 3e-2, "%s: dv increment error %g", s.what, jv);

    void *bufs[] = {dq, dk, dv, dgy, datt, dy, dlse, dgq, dgk, dgv};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        cudaFree(bufs[i]);
    moe_real *hbufs[] = {q,  k,  v,      gy, gq0,    gk0, gv0,    gq_ref, gq, gk_ref, gk,
                         gv_ref, gv, y,      att, lse, iq, iq_ref, ik, ik_ref, iv, iv_ref};
    for (size_t i = 0; i < sizeof hbufs / sizeof hbufs[0]; i++)
        free(hbufs[i]);
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

/* Two runs from the same inputs give the same bits (no atomics, fixed orders). */
START_TEST(test_attention_deterministic) {
    const int B = 2, T = 200, Hq = 8, Hkv = 2, D = 64;
    const moe_attention_shape sh = {B, T, T, Hq, Hkv, D, 0, 0};
    const size_t nq = (size_t)B * T * Hq * D, nkv = (size_t)B * T * Hkv * D;
    const size_t natt = (size_t)B * Hq * T * T, nl = (size_t)B * Hq * T;
    moe_real *q = randn_bf16(nq, 110, 1.0), *k = randn_bf16(nkv, 111, 1.0);
    moe_real *v = randn_bf16(nkv, 112, 1.0), *gy = randn_bf16(nq, 113, 1.0);
    void *dq = upload(q, nq), *dk = upload(k, nkv), *dv = upload(v, nkv), *dgy = upload(gy, nq);
    uint16_t *out[2][6];
    for (int run = 0; run < 2; run++) {
        void *dy = upload_nan(nq), *da = upload_nan(natt);
        float *dl = upload_nan_f32(nl);
        void *dgq = upload_zero(nq), *dgk = upload_zero(nkv), *dgv = upload_zero(nkv);
        moe_cuda_attention_forward(dy, dl, da, dq, dk, dv, sh);
        moe_cuda_attention_backward(dgq, dgk, dgv, dgy, dy, dl, da, dq, dk, dv, sh);
        out[run][0] = bits(dy, nq);
        out[run][1] = bits(da, natt);
        out[run][2] = bits(dgq, nq);
        out[run][3] = bits(dgk, nkv);
        out[run][4] = bits(dgv, nkv);
        out[run][5] = bits(dl, 2 * nl); /* fp32: two 16-bit halves each */
        cudaFree(dy);
        cudaFree(da);
        cudaFree(dl);
        cudaFree(dgq);
        cudaFree(dgk);
        cudaFree(dgv);
    }
    const size_t n[6] = {nq, natt, nq, nkv, nkv, 2 * nl};
    const char *name[6] = {"y", "att", "dq", "dk", "dv", "lse"};
    for (int i = 0; i < 6; i++) {
        ck_assert_msg(memcmp(out[0][i], out[1][i], n[i] * 2) == 0, "%s differs between runs",
                      name[i]);
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
}
END_TEST

Suite *suite_gpu_attention(void) {
    Suite *s = suite_create("gpu_attention");
    TCase *tc = tcase_create("attention");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, test_attention_forward, 0, NSHAPES);
    tcase_add_loop_test(tc, test_attention_backward, 0, NSHAPES);
    tcase_add_test(tc, test_attention_deterministic);
    suite_add_tcase(s, tc);
    return s;
}
