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
 *
 * The low-precision GEMM (kernels/fp8_gemm.cu) is compared with its CPU twin
 * (moe_cpu_fp8_gemm: the CPU dequantizers, then an fp32 GEMM) with a tolerance instead: the
 * GPU accumulates in another order and rounds D to bf16. So is our FP8 grouped GEMM for the
 * experts (kernels/grouped_gemm_fp8_sm90.cu), against moe_cpu_fp8_grouped_gemm.
 * Without a GPU the runner (tests/gpu_main.c) prints "skipped: no GPU".
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cpu/ops.h"
#include "cuda_ops.h"
#include "fp8_gemm.h"
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
        x[i] = (float)(moe_rng_normal(91, stream, i) *
                       exp2(30.0 * (moe_rng_uniform(92, stream, i) - 0.5)));
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

/* x and xᵀ from one read (blockwise_t_kernel) == the CPU's quantize(x), quantize(xᵀ) */
START_TEST(test_gpu_quant_blockwise_t) {
    const int shapes[][2] = {{128, 128}, {256, 384}, {640, 1024}};
    moe_error err;
    int ok = 1, cases = 0;
    for (int f = 0; f < 2; f++)
        for (int b2 = 0; b2 < 2; b2++)
            for (int sh = 0; sh < 3; sh++) {
                const int R = shapes[sh][0], C = shapes[sh][1], p2 = (sh + f) % 2;
                const size_t n = (size_t)R * C;
                const moe_quant_recipe rc = b2 ? MOE_QUANT_BLOCK_128X128 : MOE_QUANT_BLOCK_1X128;
                const size_t ns = moe_quant_scale_count(rc, R, C);
                const size_t nt = moe_quant_scale_count(rc, C, R);
                float *x = gen(n, 250 + sh, sh == 2 ? 1 : 0);
                float *si = hpoison(ns * 4), *sit = hpoison(nt * 4);
                uint8_t *q = hpoison(n), *qt = hpoison(n);
                ck_assert_int_eq(
                    moe_cpu_quant_blockwise_t(q, si, qt, sit, x, R, C, f, b2, p2, &err), MOE_OK);
                float *dx = dcopy(x, n * 4);
                /* the 128×128 recipe by both kernels (MOE_QUANT_WEIGHT=0: the first one),
                 * each into fresh poisoned outputs; block2d_t_kernel counted */
                for (int first = 0; first < 1 + b2; first++) {
                    float *dsi = dpoison(ns * 4), *dsit = dpoison(nt * 4);
                    uint8_t *dq = dpoison(n), *dqt = dpoison(n);
                    moe_bench_env env = moe_bench_env_set("MOE_QUANT_WEIGHT", first ? "0" : "1");
                    const long long calls = moe_cuda_quant_block2d_calls();
                    ck_assert_int_eq(moe_cuda_quant_blockwise_t(dq, dsi, dqt, dsit, dx, R, C, f,
                                                                b2, p2, &err),
                                     MOE_OK);
                    ck_assert_int_eq(moe_cuda_quant_block2d_calls() - calls, b2 && !first);
                    moe_bench_env_restore(&env);
                    ok &= same_bytes("blockwise_t codes", dq, q, n);
                    ok &= same_bytes("blockwise_t scales", dsi, si, ns * 4);
                    ok &= same_bytes("blockwise_t transposed codes", dqt, qt, n);
                    ok &= same_bytes("blockwise_t transposed scales", dsit, sit, nt * 4);
                    cases++;
                    moe_cuda_free(dsi), moe_cuda_free(dsit), moe_cuda_free(dq), moe_cuda_free(dqt);
                }
                free(x), free(si), free(sit), free(q), free(qt);
                moe_cuda_free(dx);
            }
    printf("  blockwise with transposed copy: %d cases (1x128 / 128x128 by both kernels, "
           "E4M3/E5M2, pow2, NaN), %s\n",
           cases, ok ? "CUDA == CPU byte for byte" : "DIFFER");
    ck_assert(ok);
    ck_assert_int_eq(moe_cuda_quant_blockwise_t(NULL, NULL, NULL, NULL, NULL, 100, 128,
                                                MOE_FP8_E4M3, 0, 0, &err),
                     MOE_ERR_CONFIG);
    ck_assert_ptr_nonnull(strstr(err.msg, "pad the tokens"));
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
    /* the stochastic rounding's draw counter in device memory (moe_nvfp4_opts::sr_counter,
     * what a CUDA graph replays): each quantize advances it once on the device and rounds
     * with moe_q_sr_seed(base, counter): CUDA == CPU over three draws, each draw's codes
     * differing from the previous one's (a stale device counter would repeat them) */
    {
        enum { R2 = 64, C2 = 256, N2 = R2 * C2 };
        float *x2 = gen(N2, 520, 0), *dx2 = dcopy(x2, N2 * 4);
        uint8_t *q2 = hpoison(N2 / 2), *s2 = hpoison(N2 / 16), *prev = hpoison(N2 / 2);
        uint8_t *dq2 = dpoison(N2 / 2), *ds2 = dpoison(N2 / 16);
        moe_quant_scalars g2, *dg2 = dpoison(sizeof g2);
        uint64_t hc = 41, *dc = dcopy(&hc, sizeof hc);
        moe_nvfp4_opts hc_o = {.stochastic = 1, .sr_seed = 99, .sr_counter = &hc};
        moe_nvfp4_opts dc_o = {.stochastic = 1, .sr_seed = 99, .sr_counter = dc};
        for (int draw = 0; draw < 3; draw++) {
            ck_assert_int_eq(moe_cpu_quant_nvfp4(q2, s2, &g2, x2, R2, C2, &hc_o, &err), MOE_OK);
            ck_assert_int_eq(moe_cuda_quant_nvfp4(dq2, ds2, dg2, dx2, R2, C2, &dc_o, &err),
                             MOE_OK);
            char what[64];
            snprintf(what, sizeof what, "NVFP4 SR, device draw counter, draw %d", draw + 1);
            ck_assert(same_bytes(what, dq2, q2, N2 / 2));
            ck_assert(same_bytes(what, dc, &hc, sizeof hc));
            ck_assert_msg(draw == 0 || memcmp(prev, q2, N2 / 2) != 0,
                          "draw %d rounded exactly as the one before", draw + 1);
            memcpy(prev, q2, N2 / 2);
        }
        ck_assert_uint_eq(hc, 44);
        printf("  NVFP4 SR with the draw counter in device memory: 3 draws CUDA == CPU, "
               "counter 41 -> 44\n");
        free(x2), free(q2), free(s2), free(prev);
        moe_cuda_free(dx2), moe_cuda_free(dq2), moe_cuda_free(ds2), moe_cuda_free(dg2),
            moe_cuda_free(dc);
    }
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

/* ------------------------------------------------------------------ the GEMM */

/* one GEMM operand quantized on the CPU (the quantizers' CPU == CUDA equality is tested
 * above), in host memory (h) and copied to the device (d) */
typedef struct operand {
    moe_qmatrix h, d;
    moe_quant_scalars s;
} operand;

static void operand_make(operand *o, moe_quant_recipe r, moe_fp8_format f,
                         const moe_nvfp4_opts *nv, const float *x, int rows, int K) {
    moe_error err;
    memset(o, 0, sizeof *o);
    const size_t cb = moe_quant_code_bytes(r, rows, K), ns = moe_quant_scale_count(r, rows, K);
    const size_t sb = ns * (r == MOE_QUANT_BLOCK_1X128 || r == MOE_QUANT_BLOCK_128X128 ? 4 : 1);
    uint8_t *q = hpoison(cb);
    void *sc = r == MOE_QUANT_TENSORWISE ? NULL : hpoison(sb);
    moe_status st = MOE_OK;
    switch (r) {
    case MOE_QUANT_TENSORWISE:
        st = moe_cpu_quant_tensorwise(q, &o->s, x, (size_t)rows * K, f, &err);
        break;
    case MOE_QUANT_BLOCK_1X128:
    case MOE_QUANT_BLOCK_128X128:
        st = moe_cpu_quant_blockwise(q, sc, x, rows, K, f, r == MOE_QUANT_BLOCK_128X128, 0, &err);
        break;
    case MOE_QUANT_MXFP8:
        st = moe_cpu_quant_mxfp8(q, sc, x, rows, K, f, &err);
        break;
    default: {
        moe_nvfp4_opts opt = *nv;
        opt.block_2d = r == MOE_QUANT_NVFP4_2D;
        st = moe_cpu_quant_nvfp4(q, sc, &o->s, x, rows, K, &opt, &err);
        o->h.nvfp4 = opt;
    }
    }
    ck_assert_int_eq(st, MOE_OK);
    o->h.recipe = r;
    o->h.format = f;
    o->h.codes = q;
    o->h.scales = sc;
    o->h.scalars = r == MOE_QUANT_TENSORWISE || r == MOE_QUANT_NVFP4 || r == MOE_QUANT_NVFP4_2D
                       ? &o->s
                       : NULL;
    o->d = o->h;
    o->d.codes = dcopy(q, cb);
    o->d.scales = sc ? dcopy(sc, sb) : NULL;
    o->d.scalars = o->h.scalars ? dcopy(&o->s, sizeof o->s) : NULL;
}

static void operand_free(operand *o) {
    free((void *)o->h.codes), free((void *)o->h.scales);
    moe_cuda_free((void *)o->d.codes), moe_cuda_free((void *)o->d.scales),
        moe_cuda_free((void *)o->d.scalars);
}

/* activations: N(0,1) rows, two of them outliers (x100, as the massive activations of LLMs);
 * weights: N(0, 0.02), one outlier input channel (x20) */
static float *gemm_input(int rows, int K, uint64_t stream, int weights) {
    float *x = hpoison((size_t)rows * K * 4);
    for (int r = 0; r < rows; r++)
        for (int k = 0; k < K; k++) {
            const size_t i = (size_t)r * K + k;
            double v = moe_rng_normal(94, stream, i) * (weights ? 0.02 : 1.0);
            if (!weights && (r == 7 || r == rows / 2))
                v *= 100.0;
            if (weights && k == 5)
                v *= 20.0;
            x[i] = (float)v;
        }
    return x;
}

/* S[i][j] = Σ_k |deq(a)[i][k]·deq(b)[j][k]|, on the CPU */
static float *abs_product(const moe_qmatrix *a, const moe_qmatrix *b, int M, int N, int K) {
    moe_error err;
    float *da = hpoison((size_t)M * K * 4), *db = hpoison((size_t)N * K * 4);
    float *s = hpoison((size_t)M * N * 4);
    ck_assert_int_eq(moe_cpu_qmatrix_dequant(da, a, M, K, &err), MOE_OK);
    ck_assert_int_eq(moe_cpu_qmatrix_dequant(db, b, N, K, &err), MOE_OK);
    for (size_t i = 0; i < (size_t)M * K; i++)
        da[i] = fabsf(da[i]);
    for (size_t i = 0; i < (size_t)N * K; i++)
        db[i] = fabsf(db[i]);
    moe_cpu_matmul_forward(s, da, db, M, K, N);
    free(da), free(db);
    return s;
}

typedef struct gemm_case {
    const char *name;
    moe_quant_recipe ra, rb;
    moe_fp8_format fa, fb;
    int rht;
} gemm_case;

/* every recipe and format pair the GEMM takes, GPU vs the CPU twin: D poisoned first, ragged
 * M (1, 301, 1000 tokens; blockwise, which needs a multiple of 4: 4, 304, 1000), N not a
 * multiple of 128 (a partial 128×128 weight block), bf16 and fp32 outputs.
 * Tolerance, per element, relative to the sum's own scale S = Σ_k |a_k·b_k| (what bounds an
 * accumulation error; a layout or scale mistake is off by O(S)): |gpu − cpu| ≤ tol·S with
 *   native FP8: 5e-3 for bf16 D, 2e-3 for fp32 D. Hopper's FP8 tensor cores add their
 *               products with fewer bits than fp32 (DeepSeek-V3 measured ~14); measured on an
 *               H100: ~1e-2 of max(|D|, rms D), i.e. below 1e-3·S;
 *   emulated:   5e-3 for bf16 D (its rounding: 2⁻⁹·|D| ≤ 2e-3·S), 2e-5 for fp32 D (exact
 *               bf16 products, fp32 sums: only the order differs) */
START_TEST(test_gpu_fp8_gemm) {
    const gemm_case cases[] = {
        {"tensorwise E4M3 x E4M3", MOE_QUANT_TENSORWISE, MOE_QUANT_TENSORWISE, MOE_FP8_E4M3,
         MOE_FP8_E4M3, 0},
        {"tensorwise E5M2 x E4M3 (hybrid: dgrad)", MOE_QUANT_TENSORWISE, MOE_QUANT_TENSORWISE,
         MOE_FP8_E5M2, MOE_FP8_E4M3, 0},
        {"tensorwise E4M3 x E5M2", MOE_QUANT_TENSORWISE, MOE_QUANT_TENSORWISE, MOE_FP8_E4M3,
         MOE_FP8_E5M2, 0},
        {"blockwise 1x128 x 128x128 E4M3", MOE_QUANT_BLOCK_1X128, MOE_QUANT_BLOCK_128X128,
         MOE_FP8_E4M3, MOE_FP8_E4M3, 0},
        {"blockwise 1x128 x 1x128 E4M3 (wgrad)", MOE_QUANT_BLOCK_1X128, MOE_QUANT_BLOCK_1X128,
         MOE_FP8_E4M3, MOE_FP8_E4M3, 0},
        {"blockwise 1x128 x 128x128 E5M2 x E4M3", MOE_QUANT_BLOCK_1X128,
         MOE_QUANT_BLOCK_128X128, MOE_FP8_E5M2, MOE_FP8_E4M3, 0},
        {"MXFP8 E4M3 x E4M3", MOE_QUANT_MXFP8, MOE_QUANT_MXFP8, MOE_FP8_E4M3, MOE_FP8_E4M3, 0},
        {"MXFP8 E5M2 x E4M3", MOE_QUANT_MXFP8, MOE_QUANT_MXFP8, MOE_FP8_E5M2, MOE_FP8_E4M3, 0},
        {"NVFP4 1x16 x 16x16", MOE_QUANT_NVFP4, MOE_QUANT_NVFP4_2D, MOE_FP8_E4M3, MOE_FP8_E4M3,
         0},
        {"NVFP4 1x16 x 1x16, RHT on both", MOE_QUANT_NVFP4, MOE_QUANT_NVFP4, MOE_FP8_E4M3,
         MOE_FP8_E4M3, 1},
    };
    const int shapes[][3] = {{301, 272, 512}, {1000, 384, 1024}, {1, 256, 256}};
    const int ncases = (int)(sizeof cases / sizeof *cases);
    moe_error err;
    int ok = 1, ran = 0;
    for (int ci = 0; ci < ncases; ci++) {
        const gemm_case *gc = &cases[ci];
        double worst[2] = {0, 0};
        int refused = 0;
        for (int sh = 0; sh < 3; sh++)
            for (int fp32 = 0; fp32 < 2; fp32++) {
                const int blockwise = gc->ra == MOE_QUANT_BLOCK_1X128;
                const int M = (int)(blockwise ? moe_round_up((size_t)shapes[sh][0], 4)
                                              : (size_t)shapes[sh][0]);
                const int N = shapes[sh][1], K = shapes[sh][2];
                const uint64_t stream = 600 + (uint64_t)(ci * 8 + sh * 2 + fp32);
                float *x = gemm_input(M, K, stream, 0), *w = gemm_input(N, K, stream + 500, 1);
                const moe_nvfp4_opts nv = {.rht = gc->rht, .rht_seed = 31};
                operand a, b;
                operand_make(&a, gc->ra, gc->fa, &nv, x, M, K);
                operand_make(&b, gc->rb, gc->fb, &nv, w, N, K);
                const size_t n = (size_t)M * N;
                float *ref = hpoison(n * 4), *got = hpoison(n * 4);
                ck_assert_int_eq(moe_cpu_fp8_gemm(ref, &a.h, &b.h, M, N, K, &err), MOE_OK);
                float *mag = abs_product(&a.h, &b.h, M, N, K); /* S per element */
                void *dd = dpoison(n * (fp32 ? 4 : 2)); /* 0xABAB.. : bf16 and fp32 garbage */
                const moe_status st = moe_cuda_fp8_gemm(dd, fp32, &a.d, &b.d, M, N, K, &err);
                if (st == MOE_ERR_BACKEND) { /* cuBLASLt refused: a named error, reported */
                    if (!fp32)
                        printf("  %s, M=%d N=%d K=%d: refused: %s\n", gc->name, M, N, K,
                               err.msg);
                    refused = 1;
                } else {
                    ck_assert_msg(st == MOE_OK, "%s: %s", gc->name, err.msg);
                    if (fp32)
                        moe_cuda_to_host(got, dd, n * 4);
                    else
                        moe_cuda_read_act(got, dd, n);
                    for (size_t i = 0; i < n; i++) {
                        const double e = fabs((double)got[i] - ref[i]) / (mag[i] + 1e-30);
                        worst[fp32] = e > worst[fp32] || isnan(e) ? e : worst[fp32];
                    }
                    ran++;
                }
                free(x), free(w), free(ref), free(got), free(mag);
                moe_cuda_free(dd);
                operand_free(&a), operand_free(&b);
            }
        const int native = moe_cuda_fp8_gemm_native(gc->ra);
        const int pass = worst[0] <= 5e-3 && worst[1] <= (native ? 2e-3 : 2e-5);
        printf("  %-42s %s: max |gpu - cpu| / S, bf16 D %.2e, fp32 D %.2e %s\n", gc->name,
               native ? "native  " : "emulated", worst[0], worst[1], pass ? "ok" : "TOO LARGE");
        ok &= pass;
        if (refused) {
            printf("  %s: refused, but it must run\n", gc->name);
            ok = 0;
        }
    }
    printf("  FP8/FP4 GEMM: %d GEMMs vs the CPU twin, %s\n", ran,
           ok ? "all within tolerance" : "SOME TOO LARGE OR REFUSED");
    ck_assert(ok);
}
END_TEST

/* the blockwise shape rule, on both sides of it: every M that is a multiple of 4 runs (also
 * with N not a multiple of 128 and K = 256), every other M is the named error of
 * moe_fp8_gemm_check (cuBLASLt itself refused them: measured with the check off) */
START_TEST(test_gpu_fp8_gemm_blockwise_shapes) {
    const int Ms[] = {1, 2, 4, 8, 302, 304};
    const int NK[][2] = {{256, 256}, {272, 512}};
    moe_error err;
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < 2; j++) {
            const int M = Ms[i], N = NK[j][0], K = NK[j][1];
            float *x = gemm_input(M, K, 900 + (uint64_t)i, 0), *w = gemm_input(N, K, 950, 1);
            operand a, b;
            operand_make(&a, MOE_QUANT_BLOCK_1X128, MOE_FP8_E4M3, NULL, x, M, K);
            operand_make(&b, MOE_QUANT_BLOCK_128X128, MOE_FP8_E4M3, NULL, w, N, K);
            void *dd = dpoison((size_t)M * N * 2);
            const moe_status st = moe_cuda_fp8_gemm(dd, 0, &a.d, &b.d, M, N, K, &err);
            if (M % 4)
                ck_assert_msg(st == MOE_ERR_CONFIG && strstr(err.msg, "multiple of 4"),
                              "M=%d: %s", M, err.msg);
            else
                ck_assert_msg(st == MOE_OK, "M=%d N=%d K=%d: %s", M, N, K, err.msg);
            free(x), free(w);
            moe_cuda_free(dd);
            operand_free(&a), operand_free(&b);
        }
    printf("  blockwise FP8 GEMM: M = 4, 8, 304 run, M = 1, 2, 302 are the named error\n");
}
END_TEST

/* the GPU GEMM's own named errors: a misaligned pointer; the shape check is the CPU's */
START_TEST(test_gpu_fp8_gemm_errors) {
    moe_error err;
    enum { M = 16, N = 16, K = 128 };
    uint8_t *codes = dpoison(M * K + 16);
    moe_quant_scalars *s = dpoison(sizeof *s);
    void *d = dpoison(M * N * 2);
    moe_qmatrix a = {.recipe = MOE_QUANT_TENSORWISE, .codes = codes + 1, .scalars = s};
    moe_qmatrix b = a;
    b.codes = codes;
    ck_assert_int_eq(moe_cuda_fp8_gemm(d, 0, &a, &b, M, N, K, &err), MOE_ERR_CONFIG);
    ck_assert_ptr_nonnull(strstr(err.msg, "16-byte aligned"));
    ck_assert_int_eq(moe_cuda_fp8_gemm(d, 0, &b, &b, M, N, 100, &err), MOE_ERR_CONFIG);
    ck_assert_ptr_nonnull(strstr(err.msg, "multiple of 16"));
    moe_cuda_free(codes), moe_cuda_free(s), moe_cuda_free(d);
}
END_TEST

/* ------------------------------------------------------------ the FP8 grouped GEMM */

/* The grouped GEMM's operands on the host and the device: A [rows, K] 1×128 over all rows, B
 * [G·N, K] 128×128 per expert (each [N, K] slice quantized on its own), both E4M3 */
typedef struct grouped_operands {
    moe_qmatrix ha, hb, da, db;
} grouped_operands;

static void grouped_make(grouped_operands *o, const float *x, const float *w, int G, int rows,
                         int N, int K) {
    moe_error err;
    const int kb = K / 128, nbn = (N + 127) / 128;
    uint8_t *qa = hpoison((size_t)rows * K), *qb = hpoison((size_t)G * N * K);
    float *sa = hpoison((size_t)rows * kb * 4 + 4), *sb = hpoison((size_t)G * nbn * kb * 4);
    ck_assert_int_eq(moe_cpu_quant_blockwise(qa, sa, x, rows, K, MOE_FP8_E4M3, 0, 0, &err),
                     MOE_OK);
    for (int g = 0; g < G; g++)
        ck_assert_int_eq(moe_cpu_quant_blockwise(qb + (size_t)g * N * K,
                                                 sb + (size_t)g * nbn * kb,
                                                 w + (size_t)g * N * K, N, K, MOE_FP8_E4M3, 1,
                                                 0, &err),
                         MOE_OK);
    const moe_qmatrix a = {.recipe = MOE_QUANT_BLOCK_1X128, .format = MOE_FP8_E4M3,
                           .codes = qa, .scales = sa};
    const moe_qmatrix b = {.recipe = MOE_QUANT_BLOCK_128X128, .format = MOE_FP8_E4M3,
                           .codes = qb, .scales = sb};
    o->ha = o->da = a;
    o->hb = o->db = b;
    o->da.codes = dcopy(qa, (size_t)rows * K);
    o->da.scales = dcopy(sa, (size_t)rows * kb * 4 + 4);
    o->db.codes = dcopy(qb, (size_t)G * N * K);
    o->db.scales = dcopy(sb, (size_t)G * nbn * kb * 4);
}

static void grouped_free(grouped_operands *o) {
    free((void *)o->ha.codes), free((void *)o->ha.scales);
    free((void *)o->hb.codes), free((void *)o->hb.scales);
    moe_cuda_free((void *)o->da.codes), moe_cuda_free((void *)o->da.scales);
    moe_cuda_free((void *)o->db.codes), moe_cuda_free((void *)o->db.scales);
}

/* S[r][n] = Σ_k |deq(a)[r][k]·deq(b_g)[n][k]| for the group g of row r */
static float *grouped_abs_product(const grouped_operands *o, const int *off, int G, int rows,
                                  int N, int K) {
    moe_error err;
    const int kb = K / 128, nbn = (N + 127) / 128;
    float *da = hpoison((size_t)rows * K * 4 + 4), *db = hpoison((size_t)N * K * 4);
    float *s = hpoison((size_t)rows * N * 4 + 4);
    ck_assert_int_eq(moe_cpu_qmatrix_dequant(da, &o->ha, rows, K, &err), MOE_OK);
    for (size_t i = 0; i < (size_t)rows * K; i++)
        da[i] = fabsf(da[i]);
    for (int g = 0; g < G; g++) {
        moe_qmatrix bg = o->hb;
        bg.codes += (size_t)g * N * K;
        bg.scales = (const float *)o->hb.scales + (size_t)g * nbn * kb;
        ck_assert_int_eq(moe_cpu_qmatrix_dequant(db, &bg, N, K, &err), MOE_OK);
        for (size_t i = 0; i < (size_t)N * K; i++)
            db[i] = fabsf(db[i]);
        if (off[g + 1] > off[g])
            moe_cpu_matmul_forward(s + (size_t)off[g] * N, da + (size_t)off[g] * K, db,
                                   off[g + 1] - off[g], K, N);
    }
    free(da), free(db);
    return s;
}

/* The GPU's D (bf16, or fp32 when fp32) against the CPU twin's ref, per element relative to
 * S = mag (Σ_k |a_k·b_k|): at most 5e-3 with bf16 D (its rounding, 2⁻⁹·|D|), 2e-3 with fp32
 * D, and ||gpu − cpu|| / ||cpu|| ≤ 1e-2; prints one line. got: n floats of host scratch,
 * left holding the GPU's D as fp32. */
static int grouped_vs_ref(const char *what, const void *dd, int fp32, const float *ref,
                          const float *mag, size_t n, float *got) {
    if (fp32)
        moe_cuda_to_host(got, dd, n * 4);
    else
        moe_cuda_read_act(got, dd, n);
    double worst = 0, e2 = 0, r2 = 0;
    for (size_t i = 0; i < n; i++) {
        const double diff = fabs((double)got[i] - ref[i]);
        const double e = diff / (mag[i] + 1e-30);
        worst = e > worst || isnan(e) ? e : worst;
        e2 += diff * diff;
        r2 += (double)ref[i] * ref[i];
    }
    const double frob = n ? sqrt(e2 / (r2 + 1e-300)) : 0;
    const int pass = worst <= (fp32 ? 2e-3 : 5e-3) && frob <= 1e-2 && !isnan(frob);
    printf("  FP8 grouped %s %s D: max |gpu - cpu| / S %.2e, ||gpu - cpu|| / ||cpu|| %.2e %s\n",
           what, fp32 ? "fp32" : "bf16", worst, frob, pass ? "ok" : "TOO LARGE");
    return pass;
}

/* One ragged case of the FP8 grouped GEMM tests: G groups of the given sizes, random x
 * [rows, K] and w [G·N, K] (seeds seed and seed + 100), their quantized operands on both
 * sides, the CPU twin's D, Σ|a·b| per element for the tolerance, a host buffer for the GPU's
 * D and the offsets in device memory. */
typedef struct grouped_case {
    int G, rows, N, K;
    int *off; /* [G + 1], host */
    int *doff; /* the same, device */
    float *x, *w, *ref, *got, *mag;
    size_t n; /* rows · N */
    grouped_operands o;
} grouped_case;

static void grouped_case_make(grouped_case *c, const int *sizes, int G, int N, int K,
                              unsigned seed) {
    moe_error err;
    c->G = G, c->N = N, c->K = K;
    c->off = malloc(sizeof(int) * (G + 1));
    ck_assert_ptr_nonnull(c->off);
    c->off[0] = 0;
    for (int g = 0; g < G; g++)
        c->off[g + 1] = c->off[g] + sizes[g];
    c->rows = c->off[G];
    c->x = gemm_input(c->rows, K, seed, 0);
    c->w = gemm_input(G * N, K, seed + 100, 1);
    grouped_make(&c->o, c->x, c->w, G, c->rows, N, K);
    c->n = (size_t)c->rows * N;
    c->ref = hpoison(c->n * 4 + 4), c->got = hpoison(c->n * 4 + 4);
    ck_assert_int_eq(
        moe_cpu_fp8_grouped_gemm(c->ref, &c->o.ha, &c->o.hb, c->off, G, c->rows, N, K, &err),
        MOE_OK);
    c->mag = grouped_abs_product(&c->o, c->off, G, c->rows, N, K);
    c->doff = dcopy(c->off, sizeof(int) * (G + 1));
}

/* our kernel on the case's operands, into d (bf16, or fp32 with @p fp32) */
static moe_status grouped_case_gemm(const grouped_case *c, void *d, int fp32, moe_error *err) {
    return moe_cuda_fp8_grouped_gemm(d, fp32, &c->o.da, &c->o.db, c->doff, c->G, c->rows, c->N,
                                     c->K, err);
}

static void grouped_case_free(grouped_case *c) {
    moe_cuda_free(c->doff);
    free(c->off), free(c->x), free(c->w), free(c->ref), free(c->got), free(c->mag);
    grouped_free(&c->o);
}

/* Our sm_90a FP8 grouped GEMM (kernels/grouped_gemm_fp8_sm90.cu) against its CPU twin
 * (moe_cpu_fp8_grouped_gemm: the same codes and scales dequantized, fp32 GEMM per group), on ragged
 * groups: empty ones, a single row, sizes around the 64-row warpgroup and 128-row tile boundaries,
 * a last group ending inside a warpgroup's rows, N not a multiple of the 128-column tile or weight
 * block, and a case with more tiles than SMs and more k-blocks than pipeline stages (the ring wraps
 * within and across tiles); both variants of the kernel (the consumer warpgroups issuing their
 * MMAs together or in turn), bf16 and fp32 D. D is poisoned first (0xAB bytes) and every
 * element is compared: a row or column the kernel forgets is off by O(1e38). Tolerance per
 * element relative to S = Σ_k |a_k·b_k| (as the dense GEMM's test): 5e-3 with bf16 D (its
 * rounding, 2⁻⁹·|D|), 2e-3 with fp32 D; and the Frobenius relative error
 * ||gpu − cpu|| / ||cpu|| ≤ 1e-2. The scales are
 * applied per 128-deep K block in fp32 (the promotion), so fp32 D is expected far inside its
 * bound. */
START_TEST(test_gpu_fp8_grouped_gemm) {
    if (!moe_cuda_grouped_sm90_available()) {
        printf("  FP8 grouped GEMM: skipped: not a Hopper GPU (our kernel is sm_90a only)\n");
        return;
    }
    static const int sizes0[] = {0, 1, 63, 64, 65, 129};      /* around 64 and 128 */
    static const int sizes1[] = {128, 127, 0, 200, 192};      /* a tile, one short, ... */
    static const int sizes2[] = {1, 0, 0};                    /* one row in all */
    static int sizes3[16];                                    /* more tiles than SMs */
    for (int g = 0; g < 16; g++)
        sizes3[g] = 250 + 37 * (g % 5) - (g == 3 ? 250 : 0); /* 111 to 398 rows */
    const struct {
        const int *sizes;
        int G, N, K;
    } cases[] = {{sizes0, 6, 272, 256}, {sizes1, 5, 256, 384}, {sizes2, 3, 128, 128},
                 {sizes3, 16, 384, 1024}};
    moe_error err;
    int ok = 1;
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
        grouped_case c;
        grouped_case_make(&c, cases[ci].sizes, cases[ci].G, cases[ci].N, cases[ci].K,
                          1300 + (unsigned)ci);
        for (int v = 0; v < 4; v++) {
            const int fp32 = v & 1, ord = v >> 1; /* output type; the kernel's variant */
            moe_cuda_fp8_grouped_set_ordered(ord);
            void *dd = dpoison(c.n * (fp32 ? 4 : 2));
            ck_assert_msg(grouped_case_gemm(&c, dd, fp32, &err) == MOE_OK, "case %zu: %s", ci,
                          err.msg);
            char what[96];
            snprintf(what, sizeof what, "G=%-2d rows=%-4d N=%d K=%-4d %-8s", c.G, c.rows, c.N,
                     c.K, ord ? "ordered" : "lockstep");
            ok &= grouped_vs_ref(what, dd, fp32, c.ref, c.mag, c.n, c.got);
            moe_cuda_free(dd);
        }
        grouped_case_free(&c);
    }
    moe_cuda_fp8_grouped_set_ordered(MOE_FP8_GROUPED_ORDERED_DEFAULT);
    ck_assert_msg(ok, "the FP8 grouped GEMM differs from its CPU twin");
}
END_TEST

/* The 128 × 256 tile of the FP8 grouped GEMM (moe_cuda_fp8_grouped_set_bn(256): two
 * 128-column halves promoted one after the other per k-block) against the 128-column tile,
 * BIT FOR BIT (the same m64n128k32 on the same bytes, the same scale products, the same order
 * of k-blocks: every element is the same fp32 sum, so bf16 and fp32 D must be the same bytes),
 * and against the CPU twin with grouped_vs_ref's tolerance (the two could share a bug). On
 * ragged groups: empty ones, 1 to 8 rows, sizes around the 64/128/256 boundaries, many
 * groups; N = 256 (whole wide tiles), 384 and 640 (256·k + 128: the last tile's second half
 * past N, neither loaded nor computed), 272 and 144 (not multiples of 128: a half that N ends
 * inside, its weight scale block the expert's last), 128 (one half only); K from one k-block
 * to 5 (more than the wide tile's 4 stages), more tiles than SMs. Both issue orders, bf16 and
 * fp32 D, each D poisoned (0xAB) first. The wide kernel's launch counter must grow by one per
 * wide call: a test of the 128-column kernel alone would otherwise pass. */
START_TEST(test_gpu_fp8_grouped_gemm_bn256) {
    if (!moe_cuda_grouped_sm90_available()) {
        printf("  FP8 grouped GEMM, 256-column tile: skipped: not a Hopper GPU\n");
        return;
    }
    static const int tiny[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1};
    static const int edges[] = {127, 128, 129, 255, 256, 257, 0, 64, 65, 192};
    static int many[24], big[16];
    for (int g = 0; g < 24; g++)
        many[g] = (int[]){1, 8, 130, 0, 256, 300, 63}[g % 7];
    for (int g = 0; g < 16; g++)
        big[g] = 250 + 37 * (g % 5) - (g == 3 ? 250 : 0);
    static const int two[] = {5, 200}, one[] = {1, 129, 0};
    const struct {
        const int *sizes;
        int G, N, K;
    } cases[] = {{tiny, 11, 256, 128},  {edges, 10, 384, 384}, {many, 24, 272, 256},
                 {big, 16, 640, 640},   {two, 2, 144, 128},    {one, 3, 128, 256},
                 {edges, 10, 512, 128}};
    const int bn = moe_cuda_fp8_grouped_bn(), ordered = moe_cuda_fp8_grouped_ordered();
    const long long calls = moe_cuda_fp8_grouped_bn256_calls();
    long long wide = 0; /* the wide calls made here */
    moe_error err;
    int ok = 1, same = 1;
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
        grouped_case c;
        grouped_case_make(&c, cases[ci].sizes, cases[ci].G, cases[ci].N, cases[ci].K,
                          1500 + (unsigned)ci);
        unsigned char *h128 = hpoison(c.n * 4 + 4), *h256 = hpoison(c.n * 4 + 4);
        for (int v = 0; v < 4; v++) {
            const int fp32 = v & 1, ord = v >> 1;
            const size_t bytes = c.n * (fp32 ? 4 : 2);
            moe_cuda_fp8_grouped_set_ordered(ord);
            void *d128 = dpoison(bytes), *d256 = dpoison(bytes);
            moe_cuda_fp8_grouped_set_bn(128);
            ck_assert_msg(grouped_case_gemm(&c, d128, fp32, &err) == MOE_OK, "case %zu: %s", ci,
                          err.msg);
            moe_cuda_fp8_grouped_set_bn(256);
            ck_assert_msg(grouped_case_gemm(&c, d256, fp32, &err) == MOE_OK, "case %zu: %s", ci,
                          err.msg);
            wide += c.rows > 0;
            moe_cuda_to_host(h128, d128, bytes);
            moe_cuda_to_host(h256, d256, bytes);
            size_t first = bytes;
            for (size_t i = 0; i < bytes && first == bytes; i++)
                if (h128[i] != h256[i])
                    first = i;
            char what[96];
            snprintf(what, sizeof what, "G=%-2d rows=%-4d N=%d K=%-4d %-8s 128x256", c.G, c.rows,
                     c.N, c.K, ord ? "ordered" : "lockstep");
            if (first < bytes) {
                const size_t e = first / (fp32 ? 4 : 2);
                printf("  FP8 grouped %s %s D: differs from the 128-column tile at row %zu, "
                       "column %zu\n",
                       what, fp32 ? "fp32" : "bf16", e / c.N, e % c.N);
                same = 0;
            }
            ok &= grouped_vs_ref(what, d256, fp32, c.ref, c.mag, c.n, c.got);
            moe_cuda_free(d128), moe_cuda_free(d256);
        }
        free(h128), free(h256);
        grouped_case_free(&c);
    }
    moe_cuda_fp8_grouped_set_bn(bn);
    moe_cuda_fp8_grouped_set_ordered(ordered);
    const long long ran = moe_cuda_fp8_grouped_bn256_calls() - calls;
    printf("  FP8 grouped 128x256 tile: %lld launches of %lld wide calls, %s the 128-column "
           "tile's bytes\n",
           ran, wide, same ? "identical to" : "NOT identical to");
    ck_assert_msg(ran == wide, "the 256-column kernel ran %lld times, not %lld", ran, wide);
    ck_assert_msg(same, "the 256-column tile's D differs from the 128-column tile's");
    ck_assert_msg(ok, "the 256-column tile differs from the CPU twin");
}
END_TEST

/* its named errors: K not a multiple of 128, a recipe or format it does not take, too many
 * groups (each the shared check moe_fp8_grouped_check, the same on the CPU twin) */
START_TEST(test_gpu_fp8_grouped_gemm_errors) {
    moe_error err;
    uint8_t *codes = dpoison(64 * 256);
    float *scales = dpoison(64 * 4);
    int *doff = dpoison(sizeof(int) * 2);
    void *d = dpoison(64 * 64 * 2);
    moe_qmatrix a = {.recipe = MOE_QUANT_BLOCK_1X128, .format = MOE_FP8_E4M3, .codes = codes,
                     .scales = scales};
    moe_qmatrix b = a;
    b.recipe = MOE_QUANT_BLOCK_128X128;
    ck_assert_int_eq(moe_cuda_fp8_grouped_gemm(d, 0, &a, &b, doff, 1, 16, 64, 200, &err),
                     MOE_ERR_CONFIG);
    ck_assert_ptr_nonnull(strstr(err.msg, "multiple of 128"));
    ck_assert_int_eq(moe_cuda_fp8_grouped_gemm(d, 0, &a, &a, doff, 1, 16, 64, 128, &err),
                     MOE_ERR_CONFIG);
    ck_assert_ptr_nonnull(strstr(err.msg, "128x128"));
    moe_qmatrix e5 = a;
    e5.format = MOE_FP8_E5M2;
    ck_assert_int_eq(moe_cuda_fp8_grouped_gemm(d, 0, &e5, &b, doff, 1, 16, 64, 128, &err),
                     MOE_ERR_CONFIG);
    ck_assert_ptr_nonnull(strstr(err.msg, "E4M3"));
    ck_assert_int_eq(moe_cuda_fp8_grouped_gemm(d, 0, &a, &b, doff, 1, 16, 40, 128, &err),
                     MOE_ERR_CONFIG);
    ck_assert_int_eq(moe_cuda_fp8_grouped_gemm(d, 0, &a, &b, doff, 300, 16, 64, 128, &err),
                     MOE_ERR_CONFIG);
    moe_cuda_free(codes), moe_cuda_free(scales), moe_cuda_free(doff), moe_cuda_free(d);
}
END_TEST

/* a QDQ workspace for n elements, poisoned, on the device (@p dev) or the host */
static moe_qdq_ws qdq_ws(size_t n, int dev) {
    size_t qb, sb;
    moe_qdq_ws_bytes(n, &qb, &sb);
    void *(*p)(size_t) = dev ? dpoison : hpoison;
    return (moe_qdq_ws){p(n * sizeof(float)), p(qb), p(sb), p(sizeof(moe_quant_scalars))};
}

static void qdq_ws_free(moe_qdq_ws *ws, int dev) {
    void (*f)(void *) = dev ? moe_cuda_free : free;
    f(ws->x), f(ws->q), f(ws->scales), f(ws->g);
}

/* Chapter 05's emulated training (lib/lowp.h): the CUDA QDQ op on bf16 activations equals
 * the CPU's on the same values, rounded to bf16 once at the end (the CPU keeps fp32), byte
 * for byte, for every recipe; the output and the workspace start poisoned. */
START_TEST(test_gpu_qdq) {
    const int R = 130, C = 256;
    const size_t n = (size_t)R * C;
    float *x = gen(n, 951, 0);
    void *src = dpoison(2 * n), *want = dpoison(2 * n);
    moe_cuda_write_act(src, x, n);
    moe_cuda_read_act(x, src, n); /* the bf16 values, exactly, in fp32 */
    moe_qdq_ws dws = qdq_ws(n, 1), hws = qdq_ws(n, 0);
    float *y = hpoison(n * sizeof(float));
    unsigned char *hwant = hpoison(2 * n);
    const moe_quant_recipe recipes[] = {MOE_QUANT_TENSORWISE, MOE_QUANT_BLOCK_1X128,
                                        MOE_QUANT_BLOCK_128X128, MOE_QUANT_MXFP8,
                                        MOE_QUANT_NVFP4, MOE_QUANT_NVFP4_2D};
    for (size_t r = 0; r < sizeof recipes / sizeof recipes[0]; r++)
        for (int f = 0; f < 2; f++) {
            moe_qdq_spec sp;
            memset(&sp, 0, sizeof sp);
            sp.recipe = recipes[r];
            sp.format = (moe_fp8_format)f;
            sp.pow2 = f;                /* both scale rules of blockwise */
            sp.nvfp4.stochastic = f;    /* and NVFP4's stochastic rounding */
            sp.nvfp4.sr_seed = 77 + r;
            moe_cpu_qdq(y, x, R, C, &sp, &hws);
            moe_cuda_write_act(want, y, n);
            moe_cuda_to_host(hwant, want, 2 * n);
            /* 128×128: the one-pass kernel (R = 130: a partial last block row) and, with
             * MOE_QUANT_WEIGHT=0, the generic passes, each into a fresh poisoned output */
            const int b2 = recipes[r] == MOE_QUANT_BLOCK_128X128;
            for (int generic = 0; generic < 1 + b2; generic++) {
                void *out = dpoison(2 * n);
                moe_bench_env env = moe_bench_env_set("MOE_QUANT_WEIGHT", generic ? "0" : "1");
                const long long calls = moe_cuda_quant_block2d_calls();
                moe_cuda_qdq(out, src, R, C, &sp, &dws);
                ck_assert_int_eq(moe_cuda_quant_block2d_calls() - calls, b2 && !generic);
                moe_bench_env_restore(&env);
                char what[80];
                snprintf(what, sizeof what, "QDQ recipe %d format %d%s", (int)recipes[r], f,
                         generic ? " (generic passes)" : "");
                ck_assert_msg(same_bytes(what, out, hwant, 2 * n),
                              "%s: CUDA differs from the CPU", what);
                moe_cuda_free(out);
            }
        }
    /* in place, as the emulated linears' weights are (lib/lowp.c, moe_lowp_qdq_weight) */
    {
        moe_qdq_spec sp;
        memset(&sp, 0, sizeof sp);
        sp.recipe = MOE_QUANT_BLOCK_128X128;
        moe_cpu_qdq(y, x, R, C, &sp, &hws);
        moe_cuda_write_act(want, y, n);
        moe_cuda_to_host(hwant, want, 2 * n);
        moe_cuda_qdq(src, src, R, C, &sp, &dws);
        ck_assert_msg(same_bytes("QDQ 128x128 in place", src, hwant, 2 * n),
                      "QDQ 128x128 in place: CUDA differs from the CPU");
    }
    free(x); free(y); free(hwant); qdq_ws_free(&hws, 0);
    moe_cuda_free(src); moe_cuda_free(want);
    qdq_ws_free(&dws, 1);
}
END_TEST

/* Chapter 05, NVFP4's wgrad operands (lib/lowp.c, "wgrad"): the CUDA QDQ along the tokens
 * (moe_cuda_qdq_t: transpose in, NVFP4 with the random Hadamard transform kept, transpose
 * out) equals the CPU's (moe_cpu_qdq_t) on the same bf16 values: the E2M1 codes, E4M3 block
 * scales and global scale left in the workspace byte for byte, and the output rounded to
 * bf16 once, for tokens that need padding (37 → 48, 300 → 304) or not (64), with and without
 * the transform and the stochastic rounding (its draw counter in device memory, advanced
 * the same on both). Outputs and workspaces start poisoned. */
START_TEST(test_gpu_qdq_t) {
    const int shapes[][2] = {{37, 64}, {64, 32}, {300, 256}}; /* tokens, columns */
    int ok = 1, cases = 0;
    for (int sh = 0; sh < 3; sh++)
        for (int v = 0; v < 4; v++) {
            const int n = shapes[sh][0], C = shapes[sh][1], m = (n + 15) / 16 * 16;
            const size_t nin = (size_t)n * C, nout = (size_t)m * C;
            float *x = gen(nin, 960 + (uint64_t)(sh * 4 + v), 0);
            for (size_t i = 0; i < nin; i++) /* plain normals: every block in use */
                x[i] = (float)moe_rng_normal(94, (uint64_t)sh, i) * (i % 97 == 0 ? 30.0f : 1.0f);
            void *src = dpoison(2 * nin), *dst = dpoison(2 * nout), *want = dpoison(2 * nout);
            moe_cuda_write_act(src, x, nin);
            moe_cuda_read_act(x, src, nin); /* the bf16 values, exactly, in fp32 */
            moe_qdq_ws dws = qdq_ws(nout, 1), hws = qdq_ws(nout, 0);
            float *y = hpoison(nout * sizeof(float));
            unsigned char *hwant = hpoison(2 * nout);
            uint64_t hc = 10 + (uint64_t)v, *dc = dcopy(&hc, sizeof hc);
            moe_qdq_spec sp;
            memset(&sp, 0, sizeof sp);
            sp.recipe = MOE_QUANT_NVFP4;
            sp.nvfp4.rht = v & 1;
            sp.nvfp4.rht_seed = 4242;
            sp.nvfp4.stochastic = (v >> 1) & 1;
            sp.nvfp4.sr_seed = 31;
            sp.keep_transform = 1;
            moe_qdq_spec dsp = sp;
            sp.nvfp4.sr_counter = &hc;
            dsp.nvfp4.sr_counter = dc;
            moe_cpu_qdq_t(y, x, n, m, C, &sp, &hws);
            moe_cuda_write_act(want, y, nout);
            moe_cuda_to_host(hwant, want, 2 * nout);
            moe_cuda_qdq_t(dst, src, n, m, C, &dsp, &dws);
            char what[96];
            snprintf(what, sizeof what, "QDQ along the tokens [%d -> %d, %d]%s%s", n, m, C,
                     sp.nvfp4.rht ? " RHT" : "", sp.nvfp4.stochastic ? " SR" : "");
            int c = same_bytes(what, dws.q, hws.q, nout / 2);             /* E2M1 codes */
            c &= same_bytes(what, dws.scales, hws.scales, nout / 16);     /* E4M3 scales */
            c &= same_bytes(what, dws.g, hws.g, sizeof(moe_quant_scalars));
            c &= same_bytes(what, dst, hwant, 2 * nout);                 /* the bf16 output */
            c &= same_bytes(what, dc, &hc, sizeof hc);                   /* the draw counter */
            ok &= c;
            cases++;
            free(x), free(y), free(hwant);
            qdq_ws_free(&hws, 0);
            qdq_ws_free(&dws, 1);
            moe_cuda_free(src), moe_cuda_free(dst), moe_cuda_free(want), moe_cuda_free(dc);
        }
    printf("  NVFP4 QDQ along the tokens (wgrad operands): %d cases (padding, RHT, SR), %s\n",
           cases, ok ? "codes, scales, global scale, bf16 output and counter CUDA == CPU"
                     : "DIFFER");
    ck_assert(ok);
}
END_TEST

/* Chapter 05's delayed scaling in training (lib/lowp.h): the QDQ op at a site of the table,
 * a sequence of recording and replaying QDQs (the first one on current scaling, a NaN in the
 * window, the window wrapping), CUDA against the CPU: the outputs as test_gpu_qdq, the site
 * and its history byte for byte after every call. */
START_TEST(test_gpu_qdq_delayed) {
    enum { R = 64, C = 96, LEN = 3, CALLS = 8 };
    const size_t n = (size_t)R * C;
    moe_qdq_ws dws = qdq_ws(n, 1), hws = qdq_ws(n, 0);
    void *src = dpoison(2 * n), *dst = dpoison(2 * n), *want = dpoison(2 * n);
    float *y = hpoison(n * sizeof(float));
    unsigned char *hwant = hpoison(2 * n);
    int ok = 1;
    for (int algo = 0; algo < 2; algo++)
        for (int f = 0; f < 2; f++) {
            moe_delayed_site site = {1.0f, 1.0f, 1.0f, 0.0f, 0, 0};
            float hist[LEN] = {0};
            moe_delayed_site *dsite = dcopy(&site, sizeof site);
            float *dhist = dcopy(hist, sizeof hist);
            moe_qdq_spec hs, ds;
            memset(&hs, 0, sizeof hs);
            hs.recipe = MOE_QUANT_TENSORWISE;
            hs.format = (moe_fp8_format)f;
            hs.delayed = (moe_delayed_ref){&site, hist, LEN, (moe_amax_algo)algo, 1, 1};
            ds = hs;
            ds.delayed.site = dsite;
            ds.delayed.history = dhist;
            float *x = NULL;
            for (int k = 0; k < CALLS; k++) {
                const int replay = k % 3 == 1; /* the backward's QDQ of the last input */
                if (!replay) {
                    free(x);
                    x = gen(n, 960 + k, k == 4 ? 1 : 0);
                    const float amp = ldexpf(1.0f, (k * 5) % 9 - 4);
                    for (size_t i = 0; i < n; i++)
                        x[i] *= amp;
                    moe_cuda_write_act(src, x, n);
                    moe_cuda_read_act(x, src, n); /* the bf16 values, exactly */
                }
                hs.delayed.record = ds.delayed.record = !replay;
                moe_cpu_qdq(y, x, R, C, &hs, &hws);
                moe_cuda_write_act(want, y, n);
                moe_cuda_to_host(hwant, want, 2 * n);
                moe_cuda_qdq(dst, src, R, C, &ds, &dws);
                ok &= same_bytes("delayed QDQ", dst, hwant, 2 * n);
                ok &= same_bytes("delayed site", dsite, &site, sizeof site);
                ok &= same_bytes("delayed history", dhist, hist, sizeof hist);
            }
            free(x);
            moe_cuda_free(dsite), moe_cuda_free(dhist);
        }
    printf("  delayed QDQ at a site: 2 algorithms x 2 formats x %d calls, %s\n", CALLS,
           ok ? "outputs, site and history CUDA == CPU" : "DIFFER");
    ck_assert(ok);
    free(y); free(hwant); qdq_ws_free(&hws, 0);
    moe_cuda_free(src); moe_cuda_free(dst); moe_cuda_free(want);
    qdq_ws_free(&dws, 1);
}
END_TEST

Suite *suite_gpu_quant(void) {
    const TTest *const tests[] = {test_gpu_quant_tensorwise, test_gpu_quant_delayed,
                                  test_gpu_quant_blockwise,  test_gpu_quant_blockwise_t,
                                  test_gpu_quant_mxfp8,      test_gpu_quant_nvfp4,
                                  test_gpu_fp8_gemm,         test_gpu_fp8_gemm_blockwise_shapes,
                                  test_gpu_fp8_gemm_errors,  test_gpu_fp8_grouped_gemm,
                                  test_gpu_fp8_grouped_gemm_errors, test_gpu_qdq,
                                  test_gpu_qdq_delayed,      test_gpu_qdq_t,
                                  test_gpu_fp8_grouped_gemm_bn256};
    return moe_test_chapter_suite("gpu_quant", "ch05", tests, 15);
}
