/*
 * CUDA dense ops against their CPU twins (kernels/{memory,matmul,embedding,rmsnorm,rope,
 * swiglu,cross_entropy,elementwise,optimizer}.cu vs lib/cpu/ and lib/cpu/backend.c).
 *
 * The pattern of every test:
 *  1. fresh random inputs (moe_test_randn), uploaded as bf16 with moe_cuda_write_act and
 *     READ BACK, so the CPU twin gets exactly the bf16-rounded values the GPU sees — the
 *     comparison then measures the op, not the rounding of its inputs;
 *  2. outputs poisoned first (0xFF bytes: NaN in both bf16 and fp32), so an element the
 *     kernel forgets to write fails; gradients that ACCUMULATE are pre-filled with random
 *     values of the size of the gradient itself, so "overwrote instead of adding" fails;
 *  3. compare: global error max|a−b| / max|b| over the tensor, and elementwise
 *     |a−b| / max(|b|, floor) with floor = 10% of max|b|. bf16 outputs carry one
 *     rounding (≤ 2⁻⁹ relative), so bf16 bounds are 1e-2 / 2e-2; fp32 outputs are
 *     tighter (1e-3 and below), the optimizer's ~1e-6.
 * Every comparison prints its errors, so the run is also a report. With MOE_TEST_QUICK set
 * (runs under compute-sanitizer) the realistic sizes are skipped.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cpu/ops.h"
#include "cuda_ops.h"
#include "helpers.h"
#include "suites.h"

/* ------------------------------------------------------------------ helpers */

static moe_real *hmalloc(size_t n) {
    moe_real *p = malloc((n ? n : 1) * sizeof(moe_real));
    ck_assert_ptr_nonnull(p);
    return p;
}

static void *dmalloc(size_t bytes) {
    void *p = moe_cuda_alloc(bytes);
    ck_assert_ptr_nonnull(p);
    return p;
}

/* Fill a device buffer with 0xFF bytes: NaN as bf16 and as fp32. */
static void poison_dev(void *p, size_t bytes) {
    unsigned char *h = malloc(bytes ? bytes : 1);
    ck_assert_ptr_nonnull(h);
    memset(h, 0xFF, bytes);
    moe_cuda_from_host(p, h, bytes);
    free(h);
}

/* n random bf16 values written to the device buffer @p d; returns the host copy, rounded:
 * exactly what the GPU holds. */
static moe_real *upload_act(void *d, size_t n, uint64_t stream, double scale) {
    moe_real *h = hmalloc(n);
    moe_test_randn(h, n, stream, scale);
    moe_cuda_write_act(d, h, n);
    moe_cuda_read_act(h, d, n);
    return h;
}

/* Random bf16 tensor of n elements placed @p off elements into a fresh device buffer (off = 1
 * makes it 2 bytes past a 16-byte boundary: the kernels' one-element path). *alloc gets the
 * buffer to free, *host the values the GPU holds. */
static void *rand_act_at(size_t n, size_t off, uint64_t stream, double scale, moe_real **host,
                         void **alloc) {
    *alloc = dmalloc((n + off) * 2);
    void *d = (char *)*alloc + 2 * off;
    *host = upload_act(d, n, stream, scale);
    return d;
}

/* Random bf16 activation tensor: returns the device buffer; *host gets the rounded values. */
static void *rand_act(size_t n, uint64_t stream, double scale, moe_real **host) {
    void *alloc;
    return rand_act_at(n, 0, stream, scale, host, &alloc);
}

/* Random fp32 tensor on the device; *host gets the same values. */
static moe_real *rand_real(size_t n, uint64_t stream, double scale, moe_real **host) {
    moe_real *h = hmalloc(n);
    moe_test_randn(h, n, stream, scale);
    moe_real *d = dmalloc(n * sizeof(moe_real));
    moe_cuda_from_host(d, h, n * sizeof(moe_real));
    *host = h;
    return d;
}

static moe_real *read_act(const void *d, size_t n) {
    moe_real *h = hmalloc(n);
    moe_cuda_read_act(h, d, n);
    return h;
}

static moe_real *read_real(const moe_real *d, size_t n) {
    moe_real *h = hmalloc(n);
    moe_cuda_to_host(h, d, n * sizeof(moe_real));
    return h;
}

static double max_abs(const moe_real *x, size_t n) {
    double m = 0.0;
    for (size_t i = 0; i < n; i++)
        m = fabs((double)x[i]) > m ? fabs((double)x[i]) : m;
    return m;
}

/* Compare got (GPU) with want (CPU): global ≤ tol and elementwise ≤ 2·tol (floor 10%). */
static void expect_close(const char *what, const moe_real *got, const moe_real *want, size_t n,
                         double tol) {
    double scale = max_abs(want, n), diff = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - (double)want[i]);
        if (isnan(d)) {
            diff = INFINITY;
            break;
        }
        diff = d > diff ? d : diff;
    }
    double global = scale > 0 ? diff / scale : diff;
    double elem = moe_test_max_rel_err(got, want, n, scale > 0 ? 0.1 * scale : 1e-30);
    printf("  %-34s n=%-9zu global %.2e  elem %.2e  (tol %.0e)\n", what, n, global, elem, tol);
    ck_assert_msg(global <= tol, "%s: global error %.3e > %.1e", what, global, tol);
    ck_assert_msg(elem <= 2 * tol, "%s: elementwise error %.3e > %.1e", what, elem, 2 * tol);
}

/* Host round-to-nearest-even fp32 → bf16 → fp32 (what write_act must do). */
static float bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7F800000u) == 0x7F800000u) /* inf / NaN */
        return f;
    u += 0x7FFFu + ((u >> 16) & 1u);
    u &= 0xFFFF0000u;
    memcpy(&f, &u, 4);
    return f;
}

/* Deterministic token ids in [0, V): a fraction `skew` of them are token 1 (long segments). */
static int *make_tokens(int N, int V, double skew, uint64_t seed) {
    int *t = malloc((size_t)N * sizeof(int));
    ck_assert_ptr_nonnull(t);
    uint64_t s = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    for (int n = 0; n < N; n++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        uint32_t r = (uint32_t)(s >> 33);
        t[n] = (r % 1000) < skew * 1000 ? 1 % V : (int)((r >> 10) % (uint32_t)V);
    }
    return t;
}

static int *upload_ints(const int *h, size_t n) {
    int *d = dmalloc(n * sizeof(int));
    moe_cuda_from_host(d, h, n * sizeof(int));
    return d;
}

/* ------------------------------------------------------------------ memory */

START_TEST(test_gpu_memory) {
    const size_t n = 100003;
    /* alloc returns zeroed memory */
    unsigned char *bytes = malloc(n * 2);
    void *d = dmalloc(n * 2);
    moe_cuda_to_host(bytes, d, n * 2);
    for (size_t i = 0; i < n * 2; i++)
        ck_assert_msg(bytes[i] == 0, "alloc: byte %zu not zero", i);

    /* write_act / read_act: round to nearest even, and bf16 values survive exactly */
    moe_real *h = hmalloc(n), *back = hmalloc(n);
    moe_test_randn(h, n, 1, 3.0);
    h[0] = 1.0f + 1.0f / 256;     /* tie: rounds to even (1.0) */
    h[1] = 1.0f + 3.0f / 256;     /* tie: rounds to even (1 + 4/256) */
    h[2] = 0.0f;
    h[3] = -65504.0f;
    moe_cuda_write_act(d, h, n);
    moe_cuda_read_act(back, d, n);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += back[i] != bf16_round(h[i]);
    ck_assert_msg(bad == 0, "write_act/read_act: %zu values not rounded to nearest even", bad);
    ck_assert(back[0] == 1.0f && back[1] == 1.0f + 4.0f / 256);
    expect_close("write_act/read_act (vs fp32)", back, h, n, 4e-3);
    moe_cuda_write_act(d, back, n); /* bf16 → fp32 → bf16 is the identity */
    moe_real *again = read_act(d, n);
    ck_assert_int_eq(memcmp(again, back, n * sizeof(moe_real)), 0);

    /* copy (device → device) and zero */
    void *d2 = dmalloc(n * 2);
    poison_dev(d2, n * 2);
    moe_cuda_copy(d2, d, n * 2);
    moe_real *copied = read_act(d2, n);
    ck_assert_int_eq(memcmp(copied, back, n * sizeof(moe_real)), 0);
    moe_cuda_zero(d2, n * 2);
    moe_cuda_to_host(bytes, d2, n * 2);
    for (size_t i = 0; i < n * 2; i++)
        ck_assert_msg(bytes[i] == 0, "zero: byte %zu not zero", i);

    /* from_host / to_host of fp32: exact */
    moe_real *hr = NULL;
    moe_real *dr = rand_real(n, 2, 1.0, &hr);
    moe_real *hr2 = read_real(dr, n);
    ck_assert_int_eq(memcmp(hr, hr2, n * sizeof(moe_real)), 0);

    /* cast_to_act: fp32 master → bf16 compute copy, rounded like the host */
    poison_dev(d, n * 2);
    moe_cuda_cast_to_act(d, dr, n);
    moe_real *cast = read_act(d, n);
    bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += cast[i] != bf16_round(hr[i]);
    ck_assert_msg(bad == 0, "cast_to_act: %zu values differ from round-to-nearest-even", bad);

    /* a failed allocation returns NULL and leaves the device usable (skipped in quick mode:
     * compute-sanitizer would report the deliberate cudaMalloc failure as an error) */
    if (!moe_test_quick()) {
        void *huge = moe_cuda_alloc((size_t)1 << 52);
        ck_assert_ptr_null(huge);
    }
    moe_cuda_zero(d2, 16);
    moe_cuda_synchronize();
    moe_cuda_free(NULL);

    moe_cuda_free(d);
    moe_cuda_free(d2);
    moe_cuda_free(dr);
    free(bytes);
    free(h);
    free(back);
    free(again);
    free(copied);
    free(hr);
    free(hr2);
    free(cast);
}
END_TEST

/* ------------------------------------------------------------------ matmul */

static void check_matmul(int N, int I, int O) {
    char name[96];
    moe_real *in, *w, *dout, *din0, *dw0;
    void *d_in = rand_act((size_t)N * I, 10, 1.0, &in);
    void *d_w = rand_act((size_t)O * I, 11, 1.0 / sqrt(I), &w);
    void *d_dout = rand_act((size_t)N * O, 12, 1.0, &dout);

    /* forward */
    void *d_out = dmalloc((size_t)N * O * 2);
    poison_dev(d_out, (size_t)N * O * 2);
    moe_cuda_matmul_forward(d_out, d_in, d_w, N, I, O);
    moe_real *out = read_act(d_out, (size_t)N * O), *ref = hmalloc((size_t)N * O);
    moe_cpu_matmul_forward(ref, in, w, N, I, O);
    snprintf(name, sizeof name, "matmul fwd N=%d I=%d O=%d", N, I, O);
    expect_close(name, out, ref, (size_t)N * O, 1e-2);

    /* backward, both gradients, accumulating onto random contents */
    void *d_din = rand_act((size_t)N * I, 13, sqrt((double)O / I), &din0);
    moe_real *d_dw = rand_real((size_t)O * I, 14, sqrt((double)N), &dw0);
    moe_cuda_matmul_backward(d_din, d_dw, d_dout, d_in, d_w, N, I, O);
    moe_real *din = read_act(d_din, (size_t)N * I), *dw = read_real(d_dw, (size_t)O * I);
    moe_cpu_matmul_backward(din0, dw0, dout, in, w, N, I, O);
    snprintf(name, sizeof name, "matmul dgrad N=%d I=%d O=%d", N, I, O);
    expect_close(name, din, din0, (size_t)N * I, 1e-2);
    snprintf(name, sizeof name, "matmul wgrad (fp32) N=%d I=%d O=%d", N, I, O);
    expect_close(name, dw, dw0, (size_t)O * I, 1e-3);

    /* NULL din, then NULL dw: only the other one changes */
    moe_cuda_matmul_backward(NULL, d_dw, d_dout, d_in, d_w, N, I, O);
    moe_cuda_matmul_backward(d_din, NULL, d_dout, d_in, d_w, N, I, O);
    moe_real *din2 = read_act(d_din, (size_t)N * I), *dw2 = read_real(d_dw, (size_t)O * I);
    moe_cpu_matmul_backward(din0, dw0, dout, in, w, N, I, O);
    snprintf(name, sizeof name, "matmul dgrad x2 (NULL dw) N=%d", N);
    expect_close(name, din2, din0, (size_t)N * I, 1e-2);
    snprintf(name, sizeof name, "matmul wgrad x2 (NULL din) N=%d", N);
    expect_close(name, dw2, dw0, (size_t)O * I, 1e-3);

    /* N = 0 touches nothing */
    moe_cuda_matmul_forward(d_out, d_in, d_w, 0, I, O);
    moe_cuda_matmul_backward(d_din, d_dw, d_dout, d_in, d_w, 0, I, O);
    moe_real *out3 = read_act(d_out, (size_t)N * O), *dw3 = read_real(d_dw, (size_t)O * I);
    ck_assert_int_eq(memcmp(out3, out, (size_t)N * O * sizeof(moe_real)), 0);
    ck_assert_int_eq(memcmp(dw3, dw2, (size_t)O * I * sizeof(moe_real)), 0);

    moe_cuda_free(d_in);
    moe_cuda_free(d_w);
    moe_cuda_free(d_dout);
    moe_cuda_free(d_out);
    moe_cuda_free(d_din);
    moe_cuda_free(d_dw);
    free(in), free(w), free(dout), free(din0), free(dw0), free(out), free(ref);
    free(din), free(dw), free(din2), free(dw2), free(out3), free(dw3);
}

START_TEST(test_gpu_matmul) {
    check_matmul(37, 70, 130);
    check_matmul(300, 64, 65);
    check_matmul(1, 33, 7);
    if (!moe_test_quick()) /* the realistic size (skipped under the sanitizer) */
        check_matmul(4096, 512, 1536);
}
END_TEST

/* --------------------------------------------------------------- embedding */

static void check_embedding(int N, int V, int C, double skew) {
    char name[96];
    moe_real *table, *dout, *dt0;
    int *tok = make_tokens(N, V, skew, (uint64_t)N * 7 + V);
    int *d_tok = upload_ints(tok, (size_t)N);
    void *d_table = rand_act((size_t)V * C, 20, 1.0, &table);
    void *d_dout = rand_act((size_t)N * C, 21, 1.0, &dout);

    void *d_out = dmalloc((size_t)N * C * 2);
    poison_dev(d_out, (size_t)N * C * 2);
    moe_cuda_embedding_forward(d_out, d_tok, d_table, N, C);
    moe_real *out = read_act(d_out, (size_t)N * C), *ref = hmalloc((size_t)N * C);
    moe_cpu_embedding_forward(ref, tok, table, N, C);
    snprintf(name, sizeof name, "embedding fwd N=%d V=%d C=%d", N, V, C);
    expect_close(name, out, ref, (size_t)N * C, 0.0); /* a copy: exact */

    /* backward: same summation order as the CPU, so bit-identical */
    moe_real *d_dt = rand_real((size_t)V * C, 22, 3.0, &dt0);
    moe_cuda_embedding_backward(d_dt, d_dout, d_tok, N, V, C);
    moe_real *dt = read_real(d_dt, (size_t)V * C);
    moe_cpu_embedding_backward(dt0, dout, tok, N, V, C);
    snprintf(name, sizeof name, "embedding bwd N=%d V=%d C=%d", N, V, C);
    expect_close(name, dt, dt0, (size_t)V * C, 1e-6);
    ck_assert_msg(!memcmp(dt, dt0, (size_t)V * C * sizeof(moe_real)),
                  "embedding backward is not bit-identical to the CPU");

    moe_cuda_free(d_tok);
    moe_cuda_free(d_table);
    moe_cuda_free(d_dout);
    moe_cuda_free(d_out);
    moe_cuda_free(d_dt);
    free(tok), free(table), free(dout), free(dt0), free(out), free(ref), free(dt);
}

START_TEST(test_gpu_embedding) {
    check_embedding(300, 65, 130, 0.0);
    check_embedding(37, 1000, 33, 0.0);  /* most tokens unused */
    if (!moe_test_quick()) /* realistic, with one very frequent token */
        check_embedding(4096, 65, 512, 0.3);
    check_embedding(1, 3, 7, 0.0);
}
END_TEST

/* ----------------------------------------------------------------- rmsnorm */

/* What one check_rmsnorm() run produced on the GPU (host copies), for bit comparisons. */
typedef struct rms_run {
    moe_real *out, *rstd, *dx, *dw;
} rms_run;

/* A bf16 activation buffer of n elements starting @p shift (0 or 1) elements into an
 * allocation of n + 2, the rest poisoned: shift = 1 misaligns it by 2 bytes, which sends
 * the norm kernels to their element-by-element path; the poisoned guards catch writes
 * outside the tensor (rms_guards_intact()). *base gets the allocation to free. */
static void *rms_buffer(size_t n, int shift, void **base) {
    *base = dmalloc((n + 2) * 2);
    poison_dev(*base, (n + 2) * 2);
    return (char *)*base + 2 * shift;
}

/* The guard elements of rms_buffer() still hold the poison (0xFFFF). */
static void rms_guards_intact(const char *what, void *base, size_t n, int shift) {
    uint16_t *h = malloc((n + 2) * 2);
    ck_assert_ptr_nonnull(h);
    moe_cuda_to_host(h, base, (n + 2) * 2);
    for (size_t i = 0; i < n + 2; i++)
        if (i < (size_t)shift || i >= n + (size_t)shift)
            ck_assert_msg(h[i] == 0xFFFFu, "%s: element %td outside the tensor was written",
                          what, (ptrdiff_t)i - shift);
    free(h);
}

/*
 * moe_cuda_rmsnorm_{forward,backward} on N rows of C against the CPU twin. The activations
 * (x, dy, y, dx) start @p shift elements into their allocations (rms_buffer). Forward
 * outputs are poisoned first; dx and dw ACCUMULATE, so they start from random values. The
 * dx-only (dw NULL) and dw-only (dx NULL) calls must give the same bits as the call that
 * computes both. Returns the GPU's results in @p run (the caller frees them) when given.
 */
static void check_rmsnorm_at(int N, int C, int shift, rms_run *run) {
    char name[96];
    const double eps = 1e-6;
    const size_t n = (size_t)N * C;
    void *b_x, *b_dout, *b_out, *b_dx;
    void *d_x = rms_buffer(n, shift, &b_x), *d_dout = rms_buffer(n, shift, &b_dout);
    void *d_out = rms_buffer(n, shift, &b_out), *d_dx = rms_buffer(n, shift, &b_dx);
    moe_real *x = upload_act(d_x, n, 30, 2.0), *dout = upload_act(d_dout, n, 32, 1.0);
    moe_real *w;
    void *d_w = rand_act((size_t)C, 31, 0.5, &w);

    moe_real *d_rstd = dmalloc((size_t)N * sizeof(moe_real));
    poison_dev(d_rstd, (size_t)N * sizeof(moe_real));
    moe_cuda_rmsnorm_forward(d_out, d_rstd, d_x, d_w, N, C, eps);
    moe_real *out = read_act(d_out, n), *rstd = read_real(d_rstd, (size_t)N);
    moe_real *ref = hmalloc(n), *rstd_ref = hmalloc((size_t)N);
    moe_cpu_rmsnorm_forward(ref, rstd_ref, x, w, N, C, eps);
    snprintf(name, sizeof name, "rmsnorm fwd N=%d C=%d%s", N, C, shift ? " unaligned" : "");
    expect_close(name, out, ref, n, 1e-2);
    snprintf(name, sizeof name, "rmsnorm rstd (fp32) N=%d C=%d", N, C);
    expect_close(name, rstd, rstd_ref, (size_t)N, 1e-5);

    /* backward from the same saved rstd on both sides (the CPU's) */
    moe_cuda_from_host(d_rstd, rstd_ref, (size_t)N * sizeof(moe_real));
    moe_real *dx0 = upload_act(d_dx, n, 33, 0.3), *dw0;
    moe_real *d_dw = rand_real((size_t)C, 34, sqrt((double)N), &dw0);
    moe_real *dx_init = hmalloc(n), *dw_init = hmalloc((size_t)C);
    memcpy(dx_init, dx0, n * sizeof(moe_real));
    memcpy(dw_init, dw0, (size_t)C * sizeof(moe_real));
    moe_cuda_rmsnorm_backward(d_dx, d_dw, d_dout, d_x, d_w, d_rstd, N, C);
    moe_real *dx = read_act(d_dx, n), *dw = read_real(d_dw, (size_t)C);
    moe_cpu_rmsnorm_backward(dx0, dw0, dout, x, w, rstd_ref, N, C);
    snprintf(name, sizeof name, "rmsnorm dx N=%d C=%d", N, C);
    expect_close(name, dx, dx0, n, 1e-2);
    /* 1e-4, not 1e-5: the CPU twin adds the N rows one by one in fp32 (its own error grows
     * like √N), the GPU in chunks */
    snprintf(name, sizeof name, "rmsnorm dw (fp32) N=%d C=%d", N, C);
    expect_close(name, dw, dw0, (size_t)C, 1e-4);

    /* dx alone and dw alone: the same bits as together (and so run to run) */
    moe_cuda_write_act(d_dx, dx_init, n); /* exact: the values are bf16 already */
    moe_cuda_rmsnorm_backward(d_dx, NULL, d_dout, d_x, d_w, d_rstd, N, C);
    moe_real *dx_only = read_act(d_dx, n);
    ck_assert_msg(!memcmp(dx_only, dx, n * sizeof(moe_real)), "rmsnorm dx alone N=%d C=%d", N,
                  C);
    moe_cuda_from_host(d_dw, dw_init, (size_t)C * sizeof(moe_real));
    moe_cuda_rmsnorm_backward(NULL, d_dw, d_dout, d_x, d_w, d_rstd, N, C);
    moe_real *dw_only = read_real(d_dw, (size_t)C);
    ck_assert_msg(!memcmp(dw_only, dw, (size_t)C * sizeof(moe_real)), "rmsnorm dw alone N=%d C=%d",
                  N, C);

    rms_guards_intact("rmsnorm x", b_x, n, shift);
    rms_guards_intact("rmsnorm dy", b_dout, n, shift);
    rms_guards_intact("rmsnorm y", b_out, n, shift);
    rms_guards_intact("rmsnorm dx", b_dx, n, shift);
    if (run)
        *run = (rms_run){out, rstd, dx, dw};
    else
        free(out), free(rstd), free(dx), free(dw);
    moe_cuda_free(b_x), moe_cuda_free(d_w), moe_cuda_free(b_dout), moe_cuda_free(b_out);
    moe_cuda_free(d_rstd), moe_cuda_free(b_dx), moe_cuda_free(d_dw);
    free(x), free(w), free(dout), free(dx0), free(dw0), free(ref), free(rstd_ref);
    free(dx_init), free(dw_init), free(dx_only), free(dw_only);
}

/* Every path of kernels/rmsnorm.cu: C = 1..8, the boundaries of the register-held rows
 * (C = 256, 512, 1024 and one past), odd and ragged C, large C (the strided loop, with and
 * without the fused dw), and N that is not a multiple of the rows a block handles. */
START_TEST(test_gpu_rmsnorm) {
    static const int shapes[][2] = {
        {37, 130}, {300, 65}, {1, 1000}, {19, 1},   {19, 2},   {19, 3},   {19, 4},
        {19, 5},   {19, 6},   {19, 7},   {17, 8},   {33, 256}, {33, 257}, {45, 383},
        {45, 384}, {21, 512}, {21, 520}, {13, 1024}, {13, 1025}, {9, 1032}, {5, 4096},
        {3, 8200}, {3, 8193},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
        check_rmsnorm_at(shapes[i][0], shapes[i][1], 0, NULL);
    if (!moe_test_quick()) { /* the GPU preset's norm, and larger configurations */
        check_rmsnorm_at(8192, 384, 0, NULL);
        check_rmsnorm_at(4096, 512, 0, NULL);
        check_rmsnorm_at(1000, 4096, 0, NULL);
        check_rmsnorm_at(100, 8200, 0, NULL);
    }
}
END_TEST

/* Misaligned by one element, the kernels read and write element by element: the results
 * must still match the CPU and be the same bits as the aligned 16-byte path's (the sums
 * add the same numbers in the same order). */
START_TEST(test_gpu_rmsnorm_unaligned) {
    static const int shapes[][2] = {{45, 384}, {13, 1024}, {5, 4096}, {8192, 384}};
    const size_t count = sizeof shapes / sizeof *shapes - (moe_test_quick() ? 1 : 0);
    for (size_t i = 0; i < count; i++) {
        const int N = shapes[i][0], C = shapes[i][1];
        const size_t n = (size_t)N * C;
        rms_run a, u;
        check_rmsnorm_at(N, C, 0, &a);
        check_rmsnorm_at(N, C, 1, &u);
        ck_assert_msg(!memcmp(a.out, u.out, n * sizeof(moe_real)), "y differs C=%d", C);
        ck_assert_msg(!memcmp(a.rstd, u.rstd, N * sizeof(moe_real)), "rstd differs C=%d", C);
        ck_assert_msg(!memcmp(a.dx, u.dx, n * sizeof(moe_real)), "dx differs C=%d", C);
        ck_assert_msg(!memcmp(a.dw, u.dw, C * sizeof(moe_real)), "dw differs C=%d", C);
        free(a.out), free(a.rstd), free(a.dx), free(a.dw);
        free(u.out), free(u.rstd), free(u.dx), free(u.dw);
    }
}
END_TEST

/* -------------------------------------------------------------------- rope */

/* One run of RoPE forward (out poisoned first, then again in place) and backward (into a
 * random din) at @p off elements into its buffers, each checked against the CPU twin.
 * Returns the GPU's forward and backward outputs (*fwd, *bwd) for the caller to compare. */
static void run_rope(int B, int T, int heads, int D, int pos0, double base, size_t off,
                     moe_real **fwd, moe_real **bwd) {
    char name[128];
    const size_t n = (size_t)B * T * heads * D;
    moe_real *in, *dout, *din0;
    void *a_in, *a_dout, *a_out, *a_din;
    void *d_in = rand_act_at(n, off, 40, 1.0, &in, &a_in);
    void *d_dout = rand_act_at(n, off, 41, 1.0, &dout, &a_dout);

    a_out = dmalloc((n + off) * 2);
    void *d_out = (char *)a_out + 2 * off;
    poison_dev(a_out, (n + off) * 2);
    moe_cuda_rope_forward(d_out, d_in, B, T, heads, D, pos0, base);
    moe_real *out = read_act(d_out, n), *ref = hmalloc(n);
    moe_cpu_rope_forward(ref, in, B, T, heads, D, pos0, base);
    snprintf(name, sizeof name, "rope fwd B=%d T=%d H=%d D=%d pos0=%d off=%zu", B, T, heads, D,
             pos0, off);
    expect_close(name, out, ref, n, 1e-2);

    /* in place (out == in) gives the same result */
    moe_cuda_copy(d_out, d_in, n * 2);
    moe_cuda_rope_forward(d_out, d_out, B, T, heads, D, pos0, base);
    moe_real *inplace = read_act(d_out, n);
    ck_assert_int_eq(memcmp(inplace, out, n * sizeof(moe_real)), 0);

    /* backward accumulates into a random din */
    void *d_din = rand_act_at(n, off, 42, 1.0, &din0, &a_din);
    moe_cuda_rope_backward(d_din, d_dout, B, T, heads, D, pos0, base);
    moe_real *din = read_act(d_din, n);
    moe_cpu_rope_backward(din0, dout, B, T, heads, D, pos0, base);
    snprintf(name, sizeof name, "rope bwd B=%d T=%d H=%d D=%d pos0=%d off=%zu", B, T, heads, D,
             pos0, off);
    expect_close(name, din, din0, n, 1e-2);

    moe_cuda_free(a_in), moe_cuda_free(a_dout), moe_cuda_free(a_out), moe_cuda_free(a_din);
    free(in), free(dout), free(din0), free(ref), free(inplace);
    *fwd = out;
    *bwd = din;
}

/* @p pos0: the rows are positions pos0.. of each sequence (a context-parallel chunk). When
 * D/2 is a multiple of 8 the kernel takes 8 pairs a thread with 16-byte accesses; the same
 * call one element off a 16-byte boundary takes the one-pair path, and both must give the
 * same bits. */
static void check_rope(int B, int T, int heads, int D, int pos0, double base) {
    const size_t n = (size_t)B * T * heads * D;
    moe_real *fwd, *bwd;
    run_rope(B, T, heads, D, pos0, base, 0, &fwd, &bwd);
    if (D % 16 == 0) {
        moe_real *fwd1, *bwd1;
        run_rope(B, T, heads, D, pos0, base, 1, &fwd1, &bwd1);
        ck_assert_msg(memcmp(fwd, fwd1, n * sizeof(moe_real)) == 0 &&
                          memcmp(bwd, bwd1, n * sizeof(moe_real)) == 0,
                      "rope D=%d: the 16-byte and the one-element paths differ", D);
        free(fwd1), free(bwd1);
    }
    free(fwd), free(bwd);
}

START_TEST(test_gpu_rope) {
    check_rope(3, 37, 4, 64, 0, 10000.0);
    check_rope(2, 50, 6, 64, 0, 10000.0); /* the GPU preset's heads: 6 query, 2 key/value */
    check_rope(2, 50, 2, 64, 0, 10000.0);
    check_rope(1, 5000, 2, 6, 0, 1e6);        /* long positions, tiny head: one pair a thread */
    check_rope(2, 300, 4, 64, 4700, 10000.0); /* a chunk at positions 4700..4999 */
    check_rope(2, 100, 3, 128, 100000, 10000.0); /* positions ~1e5: angles need double */
    check_rope(1, 64, 2, 16, 99990, 1e6);        /* the smallest head of 8 pairs a thread */
    if (!moe_test_quick()) {
        check_rope(2, 1024, 8, 128, 0, 10000.0);
        check_rope(1, 8192, 6, 64, 0, 10000.0); /* the preset's q and k of one step */
        check_rope(1, 8192, 2, 64, 0, 10000.0);
        check_rope(2, 2048, 2, 64, 131072 - 2048, 1e6); /* a CP rank's chunk, far out */
    }
}
END_TEST

/* The cos/sin tables (kernels/rope.cu) are cached per (D, base) and cover positions from 0:
 * a call beyond them, a new D or base, and more (D, base) than the cache holds must each get
 * correct values — a stale or short table would rotate by the wrong angle. */
START_TEST(test_gpu_rope_table_rebuilt) {
    check_rope(1, 16, 2, 64, 0, 10000.0);
    check_rope(1, 4096, 2, 64, 100000, 10000.0); /* grows the table past position 104095 */
    check_rope(1, 16, 2, 64, 0, 10000.0);        /* served by the grown table */
    check_rope(1, 16, 2, 128, 0, 10000.0);       /* another D */
    check_rope(1, 16, 2, 64, 0, 500000.0);       /* another base */
    check_rope(1, 16, 2, 32, 7, 10000.0);
    check_rope(1, 16, 2, 16, 0, 10000.0); /* a fifth (D, base): one table is replaced */
    check_rope(2, 40, 2, 64, 3000, 10000.0);
    check_rope(1, 300, 2, 128, 5000, 10000.0);
    check_rope(1, 16, 2, 64, 0, 500000.0);
}
END_TEST

/* ------------------------------------------------------------------ swiglu */

/* SwiGLU with the fused row scale (scaled = 1) or without (row_scale = drow_scale = NULL).
 * @p off shifts gu by that many bf16 elements, so F % 8 == 0 can still take the unaligned
 * (scalar) path; F % 8 != 0 takes it anyway. The backward's block is as wide as the row
 * needs (up to 256 threads): the shapes cover one pass, several passes and both paths. */
static void check_swiglu(int N, int F, int scaled, int off) {
    char name[96];
    const char *tag = scaled ? "scaled" : "plain";
    const size_t nf = (size_t)N * F, ngu = 2 * nf;
    moe_real *gu_all, *dout, *dgu0, *s = NULL, *ds0 = NULL;
    void *d_gu_all = rand_act(ngu + off, 50, 2.0, &gu_all);
    const void *d_gu = (const char *)d_gu_all + 2 * (size_t)off;
    const moe_real *gu = gu_all + off;
    void *d_dout = rand_act(nf, 51, 1.0, &dout);
    moe_real *d_s = scaled ? rand_real((size_t)N, 53, 1.0, &s) : NULL;

    void *d_out = dmalloc(nf * 2);
    poison_dev(d_out, nf * 2);
    moe_cuda_swiglu_forward(d_out, d_gu, d_s, N, F);
    moe_real *out = read_act(d_out, nf), *ref = hmalloc(nf);
    moe_cpu_swiglu_forward(ref, gu, s, N, F);
    snprintf(name, sizeof name, "swiglu fwd %s N=%d F=%d off=%d", tag, N, F, off);
    expect_close(name, out, ref, nf, 1e-2);

    /* accumulating outputs start from random values of their own size: ds sums F terms */
    void *d_dgu = rand_act(ngu, 52, 1.0, &dgu0);
    moe_real *d_ds = scaled ? rand_real((size_t)N, 54, sqrt((double)F), &ds0) : NULL;
    moe_cuda_swiglu_backward(d_dgu, d_ds, d_dout, d_gu, d_s, N, F);
    moe_real *dgu = read_act(d_dgu, ngu);
    moe_cpu_swiglu_backward(dgu0, ds0, dout, gu, s, N, F);
    snprintf(name, sizeof name, "swiglu bwd dgu %s N=%d F=%d off=%d", tag, N, F, off);
    expect_close(name, dgu, dgu0, ngu, 1e-2);
    if (scaled) {
        /* fp32 output, the row sum in fp32 on both sides */
        moe_real *ds = read_real(d_ds, (size_t)N);
        snprintf(name, sizeof name, "swiglu bwd ds N=%d F=%d off=%d", N, F, off);
        expect_close(name, ds, ds0, (size_t)N, 1e-3);
        free(ds);
        moe_cuda_free(d_s), moe_cuda_free(d_ds);
        free(s), free(ds0);
    }

    moe_cuda_free(d_gu_all), moe_cuda_free(d_dout), moe_cuda_free(d_out), moe_cuda_free(d_dgu);
    free(gu_all), free(dout), free(dgu0), free(out), free(ref), free(dgu);
}

START_TEST(test_gpu_swiglu) {
    for (int scaled = 0; scaled <= 1; scaled++) {
        check_swiglu(37, 130, scaled, 0); /* F % 8 != 0: scalar */
        check_swiglu(300, 65, scaled, 0);
        check_swiglu(37, 64, scaled, 0);  /* vectorised, one pass */
        check_swiglu(37, 64, scaled, 1);  /* F % 8 == 0 but unaligned: scalar */
        check_swiglu(5, 3001, scaled, 0); /* scalar, several passes of 256 threads */
        check_swiglu(9, 4096, scaled, 0); /* vectorised, several passes */
        if (!moe_test_quick())
            check_swiglu(4096, 1024, scaled, 0);
    }
}
END_TEST

/* ----------------------------------------------------------- cross-entropy */

static void check_cross_entropy(int N, int V) {
    char name[96];
    moe_real *z, *dloss, *dz0, *dzn0;
    int *tgt = make_tokens(N, V, 0.0, (uint64_t)V * 3 + N);
    int *d_tgt = upload_ints(tgt, (size_t)N);
    void *d_z = rand_act((size_t)N * V, 60, 3.0, &z);

    moe_real *d_loss = dmalloc((size_t)N * sizeof(moe_real));
    poison_dev(d_loss, (size_t)N * sizeof(moe_real));
    moe_cuda_cross_entropy_forward(d_loss, d_z, d_tgt, N, V);
    moe_real *loss = read_real(d_loss, (size_t)N), *ref = hmalloc((size_t)N);
    moe_cpu_cross_entropy_forward(ref, z, tgt, N, V);
    snprintf(name, sizeof name, "cross-entropy loss (fp32) N=%d V=%d", N, V);
    expect_close(name, loss, ref, (size_t)N, 1e-5);

    /* backward with per-row dloss (prefill ~ the gradient's size) */
    moe_real *d_dloss = rand_real((size_t)N, 61, 1.0, &dloss);
    void *d_dz = rand_act((size_t)N * V, 62, 0.1, &dz0);
    moe_cuda_cross_entropy_backward(d_dz, d_dloss, d_z, d_tgt, N, V);
    moe_real *dz = read_act(d_dz, (size_t)N * V);
    moe_cpu_cross_entropy_backward(dz0, dloss, z, tgt, N, V);
    snprintf(name, sizeof name, "cross-entropy bwd N=%d V=%d", N, V);
    expect_close(name, dz, dz0, (size_t)N * V, 1e-2);

    /* dloss = NULL: every row 1/N */
    void *d_dzn = rand_act((size_t)N * V, 63, 0.1 / N, &dzn0);
    moe_cuda_cross_entropy_backward(d_dzn, NULL, d_z, d_tgt, N, V);
    moe_real *dzn = read_act(d_dzn, (size_t)N * V);
    moe_cpu_cross_entropy_backward(dzn0, NULL, z, tgt, N, V);
    snprintf(name, sizeof name, "cross-entropy bwd mean N=%d V=%d", N, V);
    expect_close(name, dzn, dzn0, (size_t)N * V, 1e-2);

    moe_cuda_free(d_tgt), moe_cuda_free(d_z), moe_cuda_free(d_loss), moe_cuda_free(d_dloss);
    moe_cuda_free(d_dz), moe_cuda_free(d_dzn);
    free(tgt), free(z), free(dloss), free(dz0), free(dzn0), free(loss), free(ref), free(dz);
    free(dzn);
}

START_TEST(test_gpu_cross_entropy) {
    check_cross_entropy(37, 65);
    check_cross_entropy(300, 1000);
    if (!moe_test_quick()) {
        check_cross_entropy(4096, 65);
        check_cross_entropy(64, 50304);
    }
}
END_TEST

/* The vocabulary-parallel cross-entropy (chapter 04): one shard of Vs columns, whose local
 * targets are −1 wherever the global target lies in the other R−1 shards; the merge on fresh
 * random parts of R shards; the shard backward from a fresh random lse near the rows' own. */
static void check_cross_entropy_shard(int N, int Vs, int R) {
    char name[96];
    moe_real *z, *parts, *dloss, *dz0, *dzn0, *lse_in;
    int *tgt = make_tokens(N, Vs * R, 0.0, (uint64_t)Vs * 5 + N);
    for (int n = 0; n < N; n++) /* this is shard 1 of R: columns [Vs, 2·Vs) */
        tgt[n] = tgt[n] >= Vs && tgt[n] < 2 * Vs ? tgt[n] - Vs : -1;
    int *d_tgt = upload_ints(tgt, (size_t)N);
    void *d_z = rand_act((size_t)N * Vs, 64, 3.0, &z);

    const size_t np = 2 * (size_t)N;
    moe_real *d_part = dmalloc(np * sizeof(moe_real));
    poison_dev(d_part, np * sizeof(moe_real));
    moe_cuda_cross_entropy_shard_forward(d_part, d_z, d_tgt, N, Vs);
    moe_real *part = read_real(d_part, np), *part0 = hmalloc(np);
    moe_cpu_cross_entropy_shard_forward(part0, z, tgt, N, Vs);
    snprintf(name, sizeof name, "ce shard fwd (fp32) N=%d Vs=%d", N, Vs);
    expect_close(name, part, part0, np, 1e-5);

    moe_real *d_parts = rand_real(np * R, 65, 3.0, &parts);
    moe_real *d_loss = dmalloc((size_t)N * sizeof(moe_real)),
             *d_lse = dmalloc((size_t)N * sizeof(moe_real));
    poison_dev(d_loss, (size_t)N * sizeof(moe_real));
    poison_dev(d_lse, (size_t)N * sizeof(moe_real));
    moe_cuda_cross_entropy_shard_merge(d_loss, d_lse, d_parts, R, N);
    moe_real *loss = read_real(d_loss, (size_t)N), *lse = read_real(d_lse, (size_t)N);
    moe_real *loss0 = hmalloc((size_t)N), *lse0 = hmalloc((size_t)N);
    moe_cpu_cross_entropy_shard_merge(loss0, lse0, parts, R, N);
    snprintf(name, sizeof name, "ce shard merge loss R=%d N=%d", R, N);
    expect_close(name, loss, loss0, (size_t)N, 1e-5);
    snprintf(name, sizeof name, "ce shard merge lse R=%d N=%d", R, N);
    expect_close(name, lse, lse0, (size_t)N, 1e-5);

    /* the backward's lse: the shard's own plus log R and noise (a whole row has more mass) */
    moe_real *d_lse_in = rand_real((size_t)N, 66, 0.3, &lse_in);
    for (int n = 0; n < N; n++)
        lse_in[n] += part0[2 * (size_t)n] + (moe_real)log((double)R);
    moe_cuda_from_host(d_lse_in, lse_in, (size_t)N * sizeof(moe_real));
    moe_real *d_dloss = rand_real((size_t)N, 67, 1.0, &dloss);
    void *d_dz = rand_act((size_t)N * Vs, 68, 0.1, &dz0);
    moe_cuda_cross_entropy_shard_backward(d_dz, d_dloss, d_z, d_lse_in, d_tgt, N, Vs);
    moe_real *dz = read_act(d_dz, (size_t)N * Vs);
    moe_cpu_cross_entropy_shard_backward(dz0, dloss, z, lse_in, tgt, N, Vs);
    snprintf(name, sizeof name, "ce shard bwd N=%d Vs=%d", N, Vs);
    expect_close(name, dz, dz0, (size_t)N * Vs, 1e-2);
    void *d_dzn = rand_act((size_t)N * Vs, 69, 0.1 / N, &dzn0);
    moe_cuda_cross_entropy_shard_backward(d_dzn, NULL, d_z, d_lse_in, d_tgt, N, Vs);
    moe_real *dzn = read_act(d_dzn, (size_t)N * Vs);
    moe_cpu_cross_entropy_shard_backward(dzn0, NULL, z, lse_in, tgt, N, Vs);
    snprintf(name, sizeof name, "ce shard bwd mean N=%d Vs=%d", N, Vs);
    expect_close(name, dzn, dzn0, (size_t)N * Vs, 1e-2);

    moe_cuda_free(d_tgt), moe_cuda_free(d_z), moe_cuda_free(d_part), moe_cuda_free(d_parts);
    moe_cuda_free(d_loss), moe_cuda_free(d_lse), moe_cuda_free(d_lse_in);
    moe_cuda_free(d_dloss), moe_cuda_free(d_dz), moe_cuda_free(d_dzn);
    free(tgt), free(z), free(part), free(part0), free(parts), free(loss), free(lse);
    free(loss0), free(lse0), free(lse_in), free(dloss), free(dz0), free(dz), free(dzn0);
    free(dzn);
}

START_TEST(test_gpu_cross_entropy_shard) {
    check_cross_entropy_shard(37, 33, 2);
    check_cross_entropy_shard(300, 250, 4);
    if (!moe_test_quick())
        check_cross_entropy_shard(4096, 12576, 4); /* a 50304 vocabulary over TP 4 */
}
END_TEST

/* ------------------------------------------------------------- elementwise */

/* add and scale on n elements at y + yoff, x + xoff (offsets in elements) inside buffers with
 * 8 guard elements after: every element is compared BIT FOR BIT with the fp32 arithmetic
 * rounded once (what the kernels promise, on the 16-byte path and the one-element path
 * alike), and the guards must be untouched. */
static void check_add_scale(size_t n, size_t yoff, size_t xoff) {
    const moe_backend *cpu = moe_backend_cpu();
    const size_t ny = yoff + n + 8, nx = xoff + n + 8;
    moe_real *x, *y;
    void *d_x = rand_act(nx, 70, 1.0, &x), *d_y = rand_act(ny, 71, 1.0, &y);

    moe_cuda_add((char *)d_y + 2 * yoff, (char *)d_x + 2 * xoff, n);
    moe_real *got = read_act(d_y, ny);
    size_t bad = 0, guard = 0;
    for (size_t i = 0; i < ny; i++) {
        if (i >= yoff && i < yoff + n)
            bad += got[i] != bf16_round(y[i] + x[i - yoff + xoff]);
        else
            guard += memcmp(&got[i], &y[i], sizeof(moe_real)) != 0;
    }
    ck_assert_msg(bad == 0 && guard == 0,
                  "add n=%zu y+%zu x+%zu: %zu elements not the rounded fp32 sum, %zu guards "
                  "written", n, yoff, xoff, bad, guard);

    const double f = 0.37;
    moe_cuda_scale((char *)d_y + 2 * yoff, f, n);
    moe_real *got2 = read_act(d_y, ny);
    bad = guard = 0;
    for (size_t i = 0; i < ny; i++) {
        if (i >= yoff && i < yoff + n)
            bad += got2[i] != bf16_round(got[i] * (float)f);
        else
            guard += memcmp(&got2[i], &y[i], sizeof(moe_real)) != 0;
    }
    ck_assert_msg(bad == 0 && guard == 0,
                  "scale n=%zu x+%zu: %zu elements not the rounded fp32 product, %zu guards "
                  "written", n, yoff, bad, guard);
    cpu->scale(got + yoff, f, n); /* the CPU twin (double product): within one rounding */
    expect_close("scale vs CPU", got2 + yoff, got + yoff, n, 1e-2);

    moe_cuda_free(d_x), moe_cuda_free(d_y);
    free(x), free(y), free(got), free(got2);
}

START_TEST(test_gpu_elementwise) {
    const moe_backend *cpu = moe_backend_cpu();
    const size_t n = 1000003;
    moe_real *x, *y;
    void *d_x = rand_act(n, 70, 1.0, &x);
    void *d_y = rand_act(n, 71, 1.0, &y);

    moe_cuda_add(d_y, d_x, n);
    moe_real *got = read_act(d_y, n);
    cpu->add(y, x, n);
    expect_close("add", got, y, n, 1e-2);

    moe_cuda_free(d_x), moe_cuda_free(d_y);
    free(x), free(y), free(got);

    /* odd sizes, each around the 8-element units, aligned and not */
    const size_t sizes[] = {1, 7, 8, 9, 15, 17, 4099, 1000003};
    const size_t offs[][2] = {{0, 0}, {1, 0}, {0, 1}, {1, 1}, {3, 3}, {7, 7}, {5, 2}};
    for (size_t a = 0; a < sizeof sizes / sizeof *sizes; a++)
        for (size_t b = 0; b < sizeof offs / sizeof *offs; b++)
            check_add_scale(sizes[a], offs[b][0], offs[b][1]);
}
END_TEST

/* --------------------------------------------------------------- optimizer */

/* A reduction op (acc += Σ) run on a device double that starts at 0.25, and on a host double
 * that starts there too: an op that overwrote instead of adding would be off by 0.25. */
static double dev_reduce(void (*op)(double *, const moe_real *, size_t), const moe_real *x,
                         size_t n) {
    double *d = dmalloc(sizeof(double)), v = 0.25;
    moe_cuda_from_host(d, &v, sizeof v);
    op(d, x, n);
    moe_cuda_to_host(&v, d, sizeof v);
    moe_cuda_free(d);
    return v - 0.25;
}
static double host_reduce(void (*op)(double *, const moe_real *, size_t), const moe_real *x,
                          size_t n) {
    double v = 0.25;
    op(&v, x, n);
    return v - 0.25;
}

START_TEST(test_gpu_optimizer) {
    const moe_backend *cpu = moe_backend_cpu();
    const size_t sizes[] = {1, 37, 4097, 1000003, 5000011};
    for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
        size_t n = sizes[s];
        moe_real *x;
        moe_real *d_x = rand_real(n, 80 + s, 1.0, &x);
        double ss = dev_reduce(moe_cuda_sum_squares, d_x, n);
        double ss_ref = host_reduce(cpu->sum_squares, x, n);
        double su = dev_reduce(moe_cuda_sum, d_x, n), su_ref = host_reduce(cpu->sum, x, n);
        double ss2 = dev_reduce(moe_cuda_sum_squares, d_x, n);
        double su2 = dev_reduce(moe_cuda_sum, d_x, n);
        printf("  sum_squares n=%-9zu rel err %.2e   sum abs err %.2e (|x| sum %.1f)\n", n,
               fabs(ss - ss_ref) / ss_ref, fabs(su - su_ref), ss_ref);
        ck_assert_msg(fabs(ss - ss_ref) <= 1e-12 * ss_ref, "sum_squares %.17g vs %.17g", ss,
                      ss_ref);
        /* Σx can cancel to ~0: bound the error by the sum of magnitudes (≤ √(n·Σx²)) */
        ck_assert_msg(fabs(su - su_ref) <= 1e-12 * sqrt((double)n * ss_ref), "sum %.17g vs %.17g",
                      su, su_ref);
        ck_assert_msg(ss == ss2 && su == su2, "reductions are not deterministic");
        moe_cuda_free(d_x);
        free(x);
    }
    ck_assert(dev_reduce(moe_cuda_sum_squares, NULL, 0) == 0.0 &&
              dev_reduce(moe_cuda_sum, NULL, 0) == 0.0);

    /* scale_real: double math like the CPU */
    const size_t n = 100003;
    moe_real *x, *p, *g, *m, *v;
    moe_real *d_x = rand_real(n, 90, 1.0, &x);
    moe_cuda_scale_real(d_x, 0.123, n);
    moe_real *xs = read_real(d_x, n);
    cpu->scale_real(x, 0.123, n);
    expect_close("scale_real (fp32)", xs, x, n, 1e-6);

    /* AdamW at step 3 with weight decay, from non-trivial moments */
    moe_real *d_p = rand_real(n, 91, 1.0, &p);
    moe_real *d_g = rand_real(n, 92, 1e-2, &g);
    moe_real *d_m = rand_real(n, 93, 1e-3, &m);
    v = hmalloc(n);
    moe_test_randn(v, n, 94, 1e-3);
    for (size_t i = 0; i < n; i++)
        v[i] = v[i] * v[i];
    moe_real *d_v = dmalloc(n * sizeof(moe_real));
    moe_cuda_from_host(d_v, v, n * sizeof(moe_real));
    const double lr = 3e-4, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
    const double bc1 = 1 - pow(b1, 3), bc2 = 1 - pow(b2, 3);
    moe_adamw_runs d_run = moe_test_adamw_flat(moe_backend_cuda(), n),
                   h_run = moe_test_adamw_flat(cpu, n);
    moe_cuda_adamw(&d_run, d_p, d_g, (float *)d_m, (float *)d_v, NULL, lr, b1, b2, eps, wd, bc1,
                   bc2, NULL, NULL, NULL);
    moe_real *gp = read_real(d_p, n), *gm = read_real(d_m, n), *gv = read_real(d_v, n);
    cpu->adamw(&h_run, p, g, (float *)m, (float *)v, NULL, lr, b1, b2, eps, wd, bc1, bc2, NULL,
               NULL, NULL);
    moe_cuda_free(d_run.run);
    cpu->free(h_run.run);
    expect_close("adamw p (fp32)", gp, p, n, 1e-6);
    expect_close("adamw m (fp32)", gm, m, n, 1e-6);
    expect_close("adamw v (fp32)", gv, v, n, 1e-6);
    /* the update itself (p moved by ~lr), not just p, must match */
    moe_real *p0 = NULL;
    moe_real *d_p0 = rand_real(n, 91, 1.0, &p0);
    for (size_t i = 0; i < n; i++) {
        gp[i] -= p0[i];
        p[i] -= p0[i];
    }
    expect_close("adamw update p - p0", gp, p, n, 1e-3);

    moe_cuda_free(d_x), moe_cuda_free(d_p), moe_cuda_free(d_g), moe_cuda_free(d_m);
    moe_cuda_free(d_v), moe_cuda_free(d_p0);
    free(x), free(xs), free(p), free(g), free(m), free(v), free(gp), free(gm), free(gv);
    free(p0);
}
END_TEST

/* ------------------------------------------------------------ the op table */

START_TEST(test_gpu_backend_table) {
    const moe_backend *b = moe_backend_cuda();
    ck_assert_str_eq(b->name, "cuda");
    ck_assert_int_eq(b->device, MOE_DEVICE_CUDA);
    ck_assert_int_eq((int)b->act_size, 2);
    /* every slot is filled */
    const void *slots[] = {
        (void *)b->alloc, (void *)b->free, (void *)b->zero, (void *)b->copy,
        (void *)b->to_host, (void *)b->from_host, (void *)b->read_act, (void *)b->write_act,
        (void *)b->cast_to_act, (void *)b->synchronize, (void *)b->device_name,
        (void *)b->peak_tflops, (void *)b->timer_begin, (void *)b->timer_end_ms,
        (void *)b->fill_normal, (void *)b->matmul_forward,
        (void *)b->matmul_backward, (void *)b->embedding_forward, (void *)b->embedding_backward,
        (void *)b->rmsnorm_forward, (void *)b->rmsnorm_backward, (void *)b->rope_forward,
        (void *)b->rope_backward, (void *)b->attention_workspace_bytes,
        (void *)b->attention_forward, (void *)b->attention_backward,
        (void *)b->swiglu_forward, (void *)b->swiglu_backward, (void *)b->cross_entropy_forward,
        (void *)b->cross_entropy_backward, (void *)b->cross_entropy_shard_forward,
        (void *)b->cross_entropy_shard_merge, (void *)b->cross_entropy_shard_backward,
        (void *)b->add, (void *)b->scale,
        (void *)b->router_forward, (void *)b->router_backward, (void *)b->aux_loss_forward,
        (void *)b->aux_loss_backward, (void *)b->z_loss_forward, (void *)b->z_loss_backward,
        (void *)b->permute_index, (void *)b->permute_tokens, (void *)b->permute_weights,
        (void *)b->unpermute_sum, (void *)b->unpermute_weights, (void *)b->sum_squares,
        (void *)b->sum, (void *)b->scale_real, (void *)b->adamw, (void *)b->add_f64,
        (void *)b->loss_accumulate, (void *)b->grad_norm_finalize, (void *)b->expert_load_add,
        (void *)b->expert_bias_update, (void *)b->host_alloc, (void *)b->host_free,
        (void *)b->to_host_async, (void *)b->wait_to_host, (void *)b->aux_loss_counts,
    };
    for (size_t i = 0; i < sizeof slots / sizeof *slots; i++)
        ck_assert_msg(slots[i] != NULL, "slot %zu of the CUDA op table is NULL", i);
    ck_assert(b->matmul_forward == moe_cuda_matmul_forward);
    ck_assert(b->adamw == moe_cuda_adamw);
}
END_TEST

Suite *suite_gpu_dense(void) {
    Suite *s = suite_create("gpu_dense");
    TCase *tc = tcase_create("dense");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_gpu_backend_table);
    tcase_add_test(tc, test_gpu_memory);
    tcase_add_test(tc, test_gpu_matmul);
    tcase_add_test(tc, test_gpu_embedding);
    tcase_add_test(tc, test_gpu_rmsnorm);
    tcase_add_test(tc, test_gpu_rmsnorm_unaligned);
    tcase_add_test(tc, test_gpu_rope);
    tcase_add_test(tc, test_gpu_rope_table_rebuilt);
    tcase_add_test(tc, test_gpu_swiglu);
    tcase_add_test(tc, test_gpu_cross_entropy);
    tcase_add_test(tc, test_gpu_cross_entropy_shard);
    tcase_add_test(tc, test_gpu_elementwise);
    tcase_add_test(tc, test_gpu_optimizer);
    suite_add_tcase(s, tc);
    return s;
}
