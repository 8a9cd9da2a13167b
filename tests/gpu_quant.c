/*
 * Chapter 05's quantization recipes, CUDA (kernels/quantize.cu) against the CPU reference
 * (lib/cpu/quantize.c): the same bytes.
 *
 * Both backends run the same MOE_HOSTDEV arithmetic (lib/quant_formats.h), so nothing here
 * has a tolerance: codes, scales (fp32, E8M0, E4M3), the per-tensor scalars, the delayed
 * scaling's history, the dequantized values and the Hadamard transform are compared with
 * memcmp. Every device output is filled with 0xAB bytes first, so an element a kernel forgets
 * to write differs from the CPU's. Inputs are fresh random tensors spanning ~9 decades (so
 * blocks hit FP8 subnormals and saturation), with ragged row counts, an all-zero block, exact
 * rounding midpoints, fp32 subnormals and, in some cases, a NaN or an infinity.
 * Without a GPU the runner (tests/gpu_main.c) prints "skipped: no GPU".
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_ops.h"
#include "helpers.h"
#include "quantize.h"
#include "rng.h"
#include "suites.h"

static void *hpoison(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    ck_assert_ptr_nonnull(p);
    memset(p, 0xAB, bytes);
    return p;
}

static void *dpoison(size_t bytes) {
    void *d = moe_cuda_alloc(bytes ? bytes : 1);
    ck_assert_ptr_nonnull(d);
    void *h = hpoison(bytes);
    moe_cuda_from_host(d, h, bytes);
    free(h);
    return d;
}

static void *dcopy(const void *h, size_t bytes) {
    void *d = moe_cuda_alloc(bytes ? bytes : 1);
    ck_assert_ptr_nonnull(d);
    moe_cuda_from_host(d, h, bytes);
    return d;
}

/* the device buffer equals the host one, byte for byte; prints the first difference */
static int same_bytes(const char *what, const void *dev, const void *host, size_t bytes) {
    unsigned char *got = hpoison(bytes);
    moe_cuda_to_host(got, dev, bytes);
    const unsigned char *want = host;
    size_t first = bytes, diff = 0;
    for (size_t i = 0; i < bytes; i++)
        if (got[i] != want[i]) {
            diff++;
            if (first == bytes)
                first = i;
        }
    if (diff)
        printf("  %s: %zu of %zu bytes differ, first at byte %zu: CUDA 0x%02X, CPU 0x%02X\n", what,
               diff, bytes, first, got[first], want[first]);
    free(got);
    return diff == 0;
}

/* kind 0: normals times 2^U(−15, 15); 1: the same with a NaN; 2: with +inf. From 1024
 * elements on, the first 128 are zero (an all-zero 1×128 tile, MXFP8 and NVFP4 blocks); a
 * few exact rounding midpoints and fp32 subnormals */
static float *gen(size_t n, uint64_t stream, int kind) {
    float *x = hpoison(n * sizeof(float));
    for (size_t i = 0; i < n; i++)
        x[i] = (float)(moe_rng_normal(91, stream, i) * exp2(30.0 * (moe_rng_uniform(92, stream, i) - 0.5)));
    for (size_t i = 0; n >= 1024 && i < 128; i++)
        x[i] = 0.0f;
    const float special[] = {464.0f, 2.5f, 0.75f, 61440.0f, 1e-40f, -1e-44f, 0.015625f * 1.5f};
    for (size_t k = 0; k < sizeof special / sizeof *special; k++)
        if (n > 300 + 37 * k)
            x[300 + 37 * k] = special[k];
    if (kind && n > 1)
        x[n / 2 + 1] = kind == 1 ? NAN : INFINITY;
    return x;
}

START_TEST(test_gpu_quant_tensorwise) {
    const size_t sizes[] = {1, 1000, (1u << 20) + 3};
    moe_error err;
    int ok = 1, cases = 0;
    for (int f = 0; f < 2; f++)
        for (int si = 0; si < 3; si++)
            for (int kind = 0; kind < 3; kind++) {
                const size_t n = sizes[si];
                float *x = gen(n, 10 * si + kind, kind), *y = hpoison(n * 4);
                uint8_t *q = hpoison(n);
                moe_quant_scalars s;
                memset(&s, 0xAB, sizeof s);
                ck_assert_int_eq(moe_cpu_quant_tensorwise(q, &s, x, n, f, &err), MOE_OK);
                moe_cpu_dequant_tensorwise(y, q, &s, n, f, &err);
                float *dx = dcopy(x, n * 4), *dy = dpoison(n * 4);
                uint8_t *dq = dpoison(n);
                moe_quant_scalars *ds = dpoison(sizeof s);
                ck_assert_int_eq(moe_cuda_quant_tensorwise(dq, ds, dx, n, f, &err), MOE_OK);
                ck_assert_int_eq(moe_cuda_dequant_tensorwise(dy, dq, ds, n, f, &err), MOE_OK);
                ok &= same_bytes("tensorwise codes", dq, q, n);
                ok &= same_bytes("tensorwise scalars", ds, &s, sizeof s);
                ok &= same_bytes("tensorwise dequantized", dy, y, n * 4);
                cases++;
                free(x), free(y), free(q);
                moe_cuda_free(dx), moe_cuda_free(dy), moe_cuda_free(dq), moe_cuda_free(ds);
            }
    printf("  tensorwise: %d cases (E4M3/E5M2, n up to 2^20+3, NaN, inf), %s\n", cases,
           ok ? "CUDA == CPU byte for byte" : "DIFFER");
    ck_assert(ok);
}
END_TEST

START_TEST(test_gpu_quant_delayed) {
    enum { N = 5000, LEN = 4, STEPS = 9 };
    moe_error err;
    int ok = 1;
    for (int f = 0; f < 2; f++) {
        float hist[LEN] = {0};
        moe_quant_scalars s = {0, 1.0f, 0};
        float *dh = dcopy(hist, sizeof hist);
        moe_quant_scalars *ds = dcopy(&s, sizeof s);
        for (int k = 0; k < STEPS; k++) {
            float *x = gen(N, 100 + k, k == 5 ? 1 : 0);
            const float amp = ldexpf(1.0f, (k * 7) % 11 - 5);
            for (int i = 0; i < N; i++)
                x[i] *= amp;
            uint8_t *q = hpoison(N), *dq = dpoison(N);
            float *dx = dcopy(x, N * 4);
            ck_assert_int_eq(moe_cpu_quant_delayed(q, &s, hist, LEN, k % LEN, x, N, f, &err),
                             MOE_OK);
            ck_assert_int_eq(moe_cuda_quant_delayed(dq, ds, dh, LEN, k % LEN, dx, N, f, &err),
                             MOE_OK);
            ok &= same_bytes("delayed codes", dq, q, N);
            ok &= same_bytes("delayed scalars", ds, &s, sizeof s);
            ok &= same_bytes("delayed history", dh, hist, sizeof hist);
            free(x), free(q);
            moe_cuda_free(dq), moe_cuda_free(dx);
        }
        moe_cuda_free(dh), moe_cuda_free(ds);
    }
    printf("  delayed scaling: 2 formats x %d steps (a NaN at step 5), %s\n", STEPS,
           ok ? "codes, scalars and history CUDA == CPU" : "DIFFER");
    ck_assert(ok);
    ck_assert_int_eq(moe_cuda_quant_delayed(NULL, NULL, NULL, 2, 2, NULL, 0, MOE_FP8_E4M3, &err),
                     MOE_ERR_CONFIG);
}
END_TEST

START_TEST(test_gpu_quant_blockwise) {
    const int shapes[][2] = {{1, 128}, {130, 256}, {257, 1024}, {1000, 384}};
    moe_error err;
    int ok = 1, cases = 0;
    for (int f = 0; f < 2; f++)
        for (int b2 = 0; b2 < 2; b2++)
            for (int p2 = 0; p2 < 2; p2++)
                for (int sh = 0; sh < 4; sh++) {
                    const int R = shapes[sh][0], C = shapes[sh][1];
                    const size_t n = (size_t)R * C;
                    const size_t ns = moe_quant_scale_count(
                        b2 ? MOE_QUANT_BLOCK_128X128 : MOE_QUANT_BLOCK_1X128, R, C);
                    const int kind = (sh + p2) % 3;
                    float *x = gen(n, 200 + sh, kind), *si = hpoison(ns * 4), *y = hpoison(n * 4);
                    uint8_t *q = hpoison(n);
                    ck_assert_int_eq(moe_cpu_quant_blockwise(q, si, x, R, C, f, b2, p2, &err),
                                     MOE_OK);
                    moe_cpu_dequant_blockwise(y, q, si, R, C, f, b2, &err);
                    float *dx = dcopy(x, n * 4), *dsi = dpoison(ns * 4), *dy = dpoison(n * 4);
                    uint8_t *dq = dpoison(n);
                    ck_assert_int_eq(moe_cuda_quant_blockwise(dq, dsi, dx, R, C, f, b2, p2, &err),
                                     MOE_OK);
                    ck_assert_int_eq(moe_cuda_dequant_blockwise(dy, dq, dsi, R, C, f, b2, &err),
                                     MOE_OK);
                    ok &= same_bytes("blockwise codes", dq, q, n);
                    ok &= same_bytes("blockwise scales", dsi, si, ns * 4);
                    ok &= same_bytes("blockwise dequantized", dy, y, n * 4);
                    cases++;
                    free(x), free(si), free(y), free(q);
                    moe_cuda_free(dx), moe_cuda_free(dsi), moe_cuda_free(dy), moe_cuda_free(dq);
                }
    printf("  blockwise: %d cases (1x128 / 128x128, pow2 or not, ragged rows), %s\n", cases,
           ok ? "CUDA == CPU byte for byte" : "DIFFER");
    ck_assert(ok);
    ck_assert_int_eq(moe_cuda_quant_blockwise(NULL, NULL, NULL, 4, 100, MOE_FP8_E4M3, 0, 0, &err),
                     MOE_ERR_CONFIG);
    ck_assert_ptr_nonnull(strstr(err.msg, "not a multiple of 128"));
}
END_TEST

START_TEST(test_gpu_quant_mxfp8) {
    const int shapes[][2] = {{1, 32}, {37, 96}, {513, 2048}};
    moe_error err;
    int ok = 1, cases = 0;
    for (int f = 0; f < 2; f++)
        for (int sh = 0; sh < 3; sh++)
            for (int kind = 0; kind < 3; kind++) {
                const int R = shapes[sh][0], C = shapes[sh][1];
                const size_t n = (size_t)R * C, ns = n / 32;
                float *x = gen(n, 300 + sh * 3 + kind, kind), *y = hpoison(n * 4);
                uint8_t *q = hpoison(n), *sc = hpoison(ns);
                ck_assert_int_eq(moe_cpu_quant_mxfp8(q, sc, x, R, C, f, &err), MOE_OK);
                moe_cpu_dequant_mxfp8(y, q, sc, R, C, f, &err);
                float *dx = dcopy(x, n * 4), *dy = dpoison(n * 4);
                uint8_t *dq = dpoison(n), *dsc = dpoison(ns);
                ck_assert_int_eq(moe_cuda_quant_mxfp8(dq, dsc, dx, R, C, f, &err), MOE_OK);
                ck_assert_int_eq(moe_cuda_dequant_mxfp8(dy, dq, dsc, R, C, f, &err), MOE_OK);
                ok &= same_bytes("MXFP8 codes", dq, q, n);
                ok &= same_bytes("MXFP8 E8M0 scales", dsc, sc, ns);
                ok &= same_bytes("MXFP8 dequantized", dy, y, n * 4);
                cases++;
                free(x), free(y), free(q), free(sc);
                moe_cuda_free(dx), moe_cuda_free(dy), moe_cuda_free(dq), moe_cuda_free(dsc);
            }
    printf("  MXFP8: %d cases, %s\n", cases, ok ? "CUDA == CPU byte for byte" : "DIFFER");
    ck_assert(ok);
}
END_TEST

START_TEST(test_gpu_quant_nvfp4) {
    const int shapes[][2] = {{1, 16}, {37, 64}, {300, 1024}};
    moe_error err;
    int ok = 1, cases = 0;
    for (int opt = 0; opt < 8; opt++)
        for (int sh = 0; sh < 3; sh++)
            for (int kind = 0; kind < 2; kind++) {
                const moe_nvfp4_opts o = {.block_2d = opt & 1, .stochastic = (opt >> 1) & 1,
                                          .sr_seed = 1000 + (uint64_t)sh, .rht = (opt >> 2) & 1,
                                          .rht_seed = 77 + (uint64_t)opt};
                const int R = shapes[sh][0], C = shapes[sh][1];
                const size_t n = (size_t)R * C;
                const size_t ns = moe_quant_scale_count(o.block_2d ? MOE_QUANT_NVFP4_2D
                                                                   : MOE_QUANT_NVFP4, R, C);
                /* half the cases over 9 decades (most blocks then underflow to a zero E4M3
                 * scale: that path), half plain normals (every block's elements in use) */
                const uint64_t stream = 400 + (uint64_t)(opt * 8 + sh * 2 + kind);
                float *x = gen(n, stream, kind ? 1 : 0), *y = hpoison(n * 4);
                if ((opt + sh) % 2)
                    for (size_t i = 0; i < n; i++)
                        x[i] = isnan(x[i]) ? x[i] : (float)moe_rng_normal(93, stream, i);
                uint8_t *q = hpoison(n / 2), *sc = hpoison(ns);
                moe_quant_scalars g;
                memset(&g, 0xAB, sizeof g);
                ck_assert_int_eq(moe_cpu_quant_nvfp4(q, sc, &g, x, R, C, &o, &err), MOE_OK);
                moe_cpu_dequant_nvfp4(y, q, sc, &g, R, C, &o, &err);
                float *dx = dcopy(x, n * 4), *dy = dpoison(n * 4);
                uint8_t *dq = dpoison(n / 2), *dsc = dpoison(ns);
                moe_quant_scalars *dg = dpoison(sizeof g);
                ck_assert_int_eq(moe_cuda_quant_nvfp4(dq, dsc, dg, dx, R, C, &o, &err), MOE_OK);
                ck_assert_int_eq(moe_cuda_dequant_nvfp4(dy, dq, dsc, dg, R, C, &o, &err), MOE_OK);
                char what[96];
                snprintf(what, sizeof what, "NVFP4%s%s%s [%d, %d]%s", o.block_2d ? " 16x16" : "",
                         o.stochastic ? " SR" : "", o.rht ? " RHT" : "", R, C, kind ? " NaN" : "");
                int c = same_bytes(what, dq, q, n / 2);
                c &= same_bytes(what, dsc, sc, ns);
                c &= same_bytes(what, dg, &g, sizeof g);
                c &= same_bytes(what, dy, y, n * 4);
                ok &= c;
                cases++;
                free(x), free(y), free(q), free(sc);
                moe_cuda_free(dx), moe_cuda_free(dy), moe_cuda_free(dq), moe_cuda_free(dsc),
                    moe_cuda_free(dg);
            }
    printf("  NVFP4: %d cases (1D/2D x nearest/stochastic x RHT, NaN), %s\n", cases,
           ok ? "codes, E4M3 scales, global scale and dequantized CUDA == CPU" : "DIFFER");
    ck_assert(ok);
    /* the transform alone, both ways */
    enum { R = 33, C = 512 };
    float *x = gen(R * C, 500, 1), *t = hpoison(R * C * 4), *b = hpoison(R * C * 4);
    moe_cpu_rht16(t, x, R, C, 9, 0, &err);
    moe_cpu_rht16(b, t, R, C, 9, 1, &err);
    float *dx = dcopy(x, R * C * 4), *dt = dpoison(R * C * 4), *db = dpoison(R * C * 4);
    ck_assert_int_eq(moe_cuda_rht16(dt, dx, R, C, 9, 0, &err), MOE_OK);
    ck_assert_int_eq(moe_cuda_rht16(db, dt, R, C, 9, 1, &err), MOE_OK);
    ck_assert(same_bytes("RHT forward", dt, t, R * C * 4));
    ck_assert(same_bytes("RHT inverse", db, b, R * C * 4));
    free(x), free(t), free(b);
    moe_cuda_free(dx), moe_cuda_free(dt), moe_cuda_free(db);
    ck_assert_int_eq(moe_cuda_quant_nvfp4(NULL, NULL, NULL, NULL, 2, 24, NULL, &err),
                     MOE_ERR_CONFIG);
}
END_TEST

Suite *suite_gpu_quant(void) {
    const TTest *const tests[] = {test_gpu_quant_tensorwise, test_gpu_quant_delayed,
                                  test_gpu_quant_blockwise, test_gpu_quant_mxfp8,
                                  test_gpu_quant_nvfp4};
    return moe_test_chapter_suite("gpu_quant", "ch05", tests, 5);
}
