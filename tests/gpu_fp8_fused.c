/*
 * Chapter 05's fused passes of the native FP8 layer (kernels/swiglu_quant.cu, lib/mlp.c
 * "native FP8 layer with its passes fused") and the vectorized 1×128 quantizer
 * (kernels/quantize.cu, quant1x128.cuh): the same bytes as the separate passes.
 *
 *  - the 1×128 quantizer of bf16 (codes, scales, dequantized bf16 copy): v3 with software
 *    and hardware casts (MOE_QUANT_VEC=2, 3), the vectorized kernel (1), the former
 *    warp-per-tile kernel (0) and the CPU (moe_cpu_quant_blockwise of the same values) agree
 *    byte for byte, on odd row counts, tile counts that are odd or not a multiple of the
 *    block's 16 tiles, a single tile, and a misaligned input (the fallback); v3's launch
 *    count proves it ran;
 *  - v3 further (passed on an H100 at 27db17a): fp32 inputs, NaN and infinity
 *    tiles, its warps' loop with the grid capped and not; and the hardware conversions it
 *    uses against the library's encoder and decoder on all 2^32 inputs;
 *  - fused SwiGLU forward == moe_cuda_swiglu_forward then the quantizer;
 *  - fused SwiGLU backward == zero dgu, moe_cuda_swiglu_backward, then the quantizer with its
 *    dequantized copy; the routing weight's gradient (accumulated onto random values)
 *    too, which checks the summation order;
 *  - both with y_raw (the FP8 wgrad's arrangement, lib/mlp.c): the bf16 output they write next
 *    to the codes is the separate SwiGLU's output (forward) or dgu (backward) byte for byte.
 *    y_raw passed on an H100 at 3d50c58;
 *  - the saved codes' dequantization == the quantizer's dequantized copy;
 *  - the tiled backward of the FP8 wgrad (MOE_FP8_FUSED_T) == the row-wise one keeping dgu,
 *    then the token-wise quantizer: both codes and scales byte for byte; its routing-weight
 *    gradient, summed in another order, within 1e-5 of the largest (the one tolerance here).
 * Otherwise no tolerance: memcmp. Every output is 0xAB-poisoned first, so an element a kernel
 * forgets differs. A mismatch prints its first byte offset, both bytes and the count.
 * Without a GPU the runner (tests/gpu_main.c) prints "skipped: no GPU".
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/ops.h"
#include "cuda_ops.h"
#include "fp8_wgrad.h"
#include "helpers.h"
#include "quantize.h"
#include "rng.h"
#include "suites.h"

static void *dpoison(size_t bytes) {
    void *h = malloc(bytes ? bytes : 1);
    ck_assert_ptr_nonnull(h);
    memset(h, 0xAB, bytes);
    void *d = moe_cuda_alloc(bytes ? bytes : 1);
    ck_assert_ptr_nonnull(d);
    moe_cuda_from_host(d, h, bytes);
    free(h);
    return d;
}

/* two buffers equal byte for byte (each on the device when its flag says so) */
static int same2(const char *what, const void *a, int a_dev, const void *b, int b_dev,
                 size_t bytes) {
    unsigned char *x = malloc(bytes ? bytes : 1), *y = malloc(bytes ? bytes : 1);
    if (a_dev)
        moe_cuda_to_host(x, a, bytes);
    else
        memcpy(x, a, bytes);
    if (b_dev)
        moe_cuda_to_host(y, b, bytes);
    else
        memcpy(y, b, bytes);
    size_t first = bytes, diff = 0;
    for (size_t i = 0; i < bytes; i++)
        if (x[i] != y[i]) {
            diff++;
            if (first == bytes)
                first = i;
        }
    if (diff)
        printf("  %s: %zu of %zu bytes differ, first at byte %zu: 0x%02X vs 0x%02X\n", what, diff,
               bytes, first, x[first], y[first]);
    free(x), free(y);
    return diff == 0;
}

/* n values normal × 2^U(−lo, lo) per element (so tiles hit FP8 subnormals and saturation);
 * the first 128 zero when n >= 1024 (an all-zero tile) */
static float *gen(size_t n, uint64_t stream, double scale, double lo) {
    float *x = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++)
        x[i] = (float)(scale * moe_rng_normal(31, stream, i) *
                       exp2(2 * lo * (moe_rng_uniform(32, stream, i) - 0.5)));
    for (size_t i = 0; n >= 1024 && i < 128; i++)
        x[i] = 0.0f;
    return x;
}

/* bf16 on the device from fp32 values; @p x receives the values the device holds */
static void *upload_bf16(float *x, size_t n) {
    void *d = dpoison(2 * n);
    moe_cuda_write_act(d, x, n);
    moe_cuda_read_act(x, d, n);
    return d;
}

/* The backward's routing weights and the d scale it adds to, for @p N rows: host values
 * (*rs uniform, *drs0 normal: seeds @p su, @p sn of stream @p stream), the weights on the
 * device (*drs) and two device copies of *drs0 (*dr1, *dr2), one for each path to add into */
static void bwd_scales(int N, uint64_t su, uint64_t sn, uint64_t stream, float **rs,
                       float **drs0, float **drs, float **dr1, float **dr2) {
    *rs = malloc(sizeof(float) * (N + 1));
    *drs0 = malloc(sizeof(float) * (N + 1));
    for (int r = 0; r < N; r++) {
        (*rs)[r] = (float)moe_rng_uniform(su, stream, r);
        (*drs0)[r] = (float)moe_rng_normal(sn, stream, r);
    }
    *drs = dpoison(sizeof(float) * N);
    moe_cuda_from_host(*drs, *rs, sizeof(float) * N);
    *dr1 = dpoison(sizeof(float) * N);
    *dr2 = dpoison(sizeof(float) * N);
    moe_cuda_from_host(*dr1, *drs0, sizeof(float) * N);
    moe_cuda_from_host(*dr2, *drs0, sizeof(float) * N);
}

START_TEST(test_gpu_quant_1x128_vec) {
    /* rows × 128-wide tiles: 1 tile, odd tile counts, not multiples of a block's 16 tiles */
    const int shapes[][2] = {{1, 128}, {3, 128}, {17, 384}, {301, 1152}, {1001, 640}, {64, 2048}};
    moe_error err;
    int ok = 1, cases = 0;
    for (int sh = 0; sh < 6; sh++)
        for (int fmt = 0; fmt < 2; fmt++)
            for (int p2 = 0; p2 < 2; p2++)
                for (int mis = 0; mis < 2; mis++) { /* mis: input 2 bytes off (fallback) */
                    const int R = shapes[sh][0], C = shapes[sh][1];
                    const size_t n = (size_t)R * C, ns = n / 128;
                    float *x = gen(n, 100 + sh, 1.0, 12.0);
                    void *dxa = dpoison(2 * n + 16);
                    void *dx = (char *)dxa + (mis ? 2 : 0);
                    moe_cuda_write_act(dx, x, n);
                    moe_cuda_read_act(x, dx, n);
                    uint8_t *q = malloc(n);
                    float *s = malloc(4 * ns), *yf = malloc(4 * n);
                    ck_assert_int_eq(moe_cpu_quant_blockwise(q, s, x, R, C, fmt, 0, p2, &err),
                                     MOE_OK);
                    moe_cpu_dequant_blockwise(yf, q, s, R, C, fmt, 0, &err);
                    void *want_y = dpoison(2 * n);
                    moe_cuda_write_act(want_y, yf, n);
                    for (int vec = 0; vec < 4; vec++) {
                        const char *env[] = {"0", "1", "2", "3"};
                        setenv("MOE_QUANT_VEC", env[vec], 1);
                        const long long v3_before = moe_cuda_quant_1x128_v3_calls();
                        uint8_t *dq = dpoison(n);
                        float *ds = dpoison(4 * ns);
                        void *dy = dpoison(2 * n);
                        ck_assert_int_eq(moe_cuda_quant_blockwise_act(dq, ds, dy, dx, R, C, fmt,
                                                                      p2, &err),
                                         MOE_OK);
                        char what[96];
                        snprintf(what, sizeof what, "[%d, %d] fmt %d pow2 %d vec %d mis %d", R,
                                 C, fmt, p2, vec, mis);
                        int k = same2("1x128 codes", dq, 1, q, 0, n);
                        k &= same2("1x128 scales", ds, 1, s, 0, 4 * ns);
                        k &= same2("1x128 dequantized", dy, 1, want_y, 1, 2 * n);
                        /* y = NULL: codes only */
                        uint8_t *dq2 = dpoison(n);
                        ck_assert_int_eq(moe_cuda_quant_blockwise_act(dq2, ds, NULL, dx, R, C,
                                                                      fmt, p2, &err),
                                         MOE_OK);
                        k &= same2("1x128 codes (no copy)", dq2, 1, q, 0, n);
                        /* v3 ran (twice) where it was asked for and the buffers allow it */
                        ck_assert_int_eq(moe_cuda_quant_1x128_v3_calls() - v3_before,
                                         vec >= 2 && !mis ? 2 : 0);
                        /* the saved codes' dequantization */
                        if (!mis) {
                            void *dz = dpoison(2 * n);
                            ck_assert_int_eq(
                                moe_cuda_dequant_blockwise_act(dz, dq, ds, R, C, fmt, &err),
                                MOE_OK);
                            k &= same2("dequantized saved codes", dz, 1, want_y, 1, 2 * n);
                            moe_cuda_free(dz);
                        }
                        if (!k)
                            printf("  ^ in case %s\n", what);
                        ok &= k;
                        cases++;
                        moe_cuda_free(dq), moe_cuda_free(ds), moe_cuda_free(dy),
                            moe_cuda_free(dq2);
                    }
                    unsetenv("MOE_QUANT_VEC");
                    free(x), free(q), free(s), free(yf);
                    moe_cuda_free(dxa), moe_cuda_free(want_y);
                }
    printf("  1x128 quantizer of bf16: %d cases (v3 with software and hardware casts, "
           "vectorized and warp-per-tile, ragged shapes, misaligned input), %s\n",
           cases, ok ? "== CPU byte for byte" : "DIFFER");
    ck_assert(ok);
}
END_TEST

/* the hardware conversions v3's MOE_QUANT_VEC=3 casts with (and both v3s decode with)
 * against moe_fp8_encode / moe_fp8_decode on every input: all 2^32 fp32 bit patterns but
 * the NaNs (infinities and subnormals included), every code that is not a NaN */
START_TEST(test_gpu_fp8_cast_check) {
    moe_error err;
    for (int f = 0; f < 2; f++) {
        long long cast_bad = -1, decode_bad = -1;
        ck_assert_int_eq(moe_cuda_fp8_cast_check(&cast_bad, &decode_bad, f, &err), MOE_OK);
        printf("  %s: hardware cast differs from moe_fp8_encode on %lld non-NaN inputs (of "
               "2^32 patterns), hardware decode from moe_fp8_decode on %lld codes\n",
               f ? "E5M2" : "E4M3", cast_bad, decode_bad);
        ck_assert_int_eq(cast_bad, 0);
        ck_assert_int_eq(decode_bad, 0);
    }
}
END_TEST

/* v3 of the 1x128 quantizer (MOE_QUANT_VEC=2: software casts, 3: the hardware's) against
 * the CPU, byte for byte, on what the other test does not reach: fp32 inputs
 * (moe_cuda_quant_blockwise), tiles holding a NaN or an infinity (poisoned: codes 0, NaN
 * scale, NaN copy), fp32 subnormals and rounding midpoints; the warps' loop over groups of
 * 8 tiles, with the grid capped at 1 and 3 blocks (tile counts 2709 and 3003: tails of 5 and
 * 3 tiles, odd) and uncapped on 2053 x 2176 (34901 tiles: more than one sweep of an H100's
 * resident grid, 132 SMs x 4 blocks x 64 tiles = 33792); y NULL and not; both formats, pow2
 * on and off. */
static float *gen_special(size_t n, uint64_t stream) {
    float *x = gen(n, stream, 1.0, 14.0);
    const float special[] = {464.0f, 2.5f, 0.75f, 61440.0f, 1e-40f, -1e-44f, 0.0234375f,
                             -0.0f};
    for (size_t k = 0; k < sizeof special / sizeof *special; k++)
        if (n > 300 + 37 * k)
            x[300 + 37 * k] = special[k];
    if (n > 4096) { /* a NaN in one tile, an infinity in another */
        x[n / 2 + 1] = NAN;
        x[n / 3 + 7] = -INFINITY;
    }
    return x;
}

START_TEST(test_gpu_quant_1x128_v3) {
    const struct {
        int R, C, max_blocks;
    } cases_[] = {{301, 1152, 1}, {1001, 384, 3}, {1, 128, 0}, {2053, 2176, 0}};
    moe_error err;
    int ok = 1, cases = 0;
    for (size_t sh = 0; sh < sizeof cases_ / sizeof *cases_; sh++)
        for (int fmt = 0; fmt < 2; fmt++)
            for (int p2 = 0; p2 < 2; p2++) {
                const int R = cases_[sh].R, C = cases_[sh].C;
                const size_t n = (size_t)R * C, ns = n / 128;
                moe_cuda_quant_1x128_set_max_blocks(cases_[sh].max_blocks);
                /* fp32 input: the values as generated */
                float *x = gen_special(n, 300 + sh);
                uint8_t *q = malloc(n);
                float *s = malloc(4 * ns), *yf = malloc(4 * n);
                ck_assert_int_eq(moe_cpu_quant_blockwise(q, s, x, R, C, fmt, 0, p2, &err), MOE_OK);
                float *dxf = moe_cuda_alloc(4 * n);
                moe_cuda_from_host(dxf, x, 4 * n);
                for (int k3 = 2; k3 < 4; k3++) {
                    moe_cuda_quant_1x128_set_kernel(k3);
                    const long long before = moe_cuda_quant_1x128_v3_calls();
                    uint8_t *dq = dpoison(n);
                    float *ds = dpoison(4 * ns);
                    ck_assert_int_eq(
                        moe_cuda_quant_blockwise(dq, ds, dxf, R, C, fmt, 0, p2, &err), MOE_OK);
                    ck_assert_int_eq(moe_cuda_quant_1x128_v3_calls() - before, 1);
                    int k = same2("v3 fp32 codes", dq, 1, q, 0, n);
                    k &= same2("v3 fp32 scales", ds, 1, s, 0, 4 * ns);
                    if (!k)
                        printf("  ^ in case fp32 [%d, %d] fmt %d pow2 %d kernel %d blocks %d\n", R,
                               C, fmt, p2, k3, cases_[sh].max_blocks);
                    ok &= k;
                    cases++;
                    moe_cuda_free(dq), moe_cuda_free(ds);
                }
                moe_cuda_free(dxf);
                /* bf16 input: the values the device holds */
                void *dx = upload_bf16(x, n);
                ck_assert_int_eq(moe_cpu_quant_blockwise(q, s, x, R, C, fmt, 0, p2, &err), MOE_OK);
                moe_cpu_dequant_blockwise(yf, q, s, R, C, fmt, 0, &err);
                void *want_y = dpoison(2 * n);
                moe_cuda_write_act(want_y, yf, n);
                for (int k3 = 2; k3 < 4; k3++)
                    for (int with_y = 0; with_y < 2; with_y++) {
                        moe_cuda_quant_1x128_set_kernel(k3);
                        const long long before = moe_cuda_quant_1x128_v3_calls();
                        uint8_t *dq = dpoison(n);
                        float *ds = dpoison(4 * ns);
                        void *dy = with_y ? dpoison(2 * n) : NULL;
                        ck_assert_int_eq(moe_cuda_quant_blockwise_act(dq, ds, dy, dx, R, C, fmt,
                                                                      p2, &err),
                                         MOE_OK);
                        ck_assert_int_eq(moe_cuda_quant_1x128_v3_calls() - before, 1);
                        int k = same2("v3 bf16 codes", dq, 1, q, 0, n);
                        k &= same2("v3 bf16 scales", ds, 1, s, 0, 4 * ns);
                        if (with_y)
                            k &= same2("v3 bf16 dequantized", dy, 1, want_y, 1, 2 * n);
                        if (!k)
                            printf("  ^ in case bf16 [%d, %d] fmt %d pow2 %d kernel %d y %d "
                                   "blocks %d\n",
                                   R, C, fmt, p2, k3, with_y, cases_[sh].max_blocks);
                        ok &= k;
                        cases++;
                        moe_cuda_free(dq), moe_cuda_free(ds);
                        if (dy)
                            moe_cuda_free(dy);
                    }
                moe_cuda_quant_1x128_set_kernel(-1);
                moe_cuda_quant_1x128_set_max_blocks(0);
                free(x), free(q), free(s), free(yf);
                moe_cuda_free(dx), moe_cuda_free(want_y);
            }
    printf("  1x128 quantizer v3 (software and hardware casts): %d cases (fp32 and bf16, NaN "
           "and inf tiles, grid capped at 1 and 3 blocks and not, y or not), %s\n",
           cases, ok ? "== CPU byte for byte" : "DIFFER");
    ck_assert(ok);
}
END_TEST

/* F values: one tile, three, and 2176 (272 8-column units: a 256-thread backward block
 * loops twice, the second time with only 16 units, half a warp) */
static const int FS[] = {128, 384, 2176};
static const int NS[] = {1, 7, 130};

START_TEST(test_gpu_swiglu_quant_forward) {
    moe_error err;
    int ok = 1, cases = 0;
    for (int fi = 0; fi < 3; fi++)
        for (int ni = 0; ni < 3; ni++)
            for (int scaled = 0; scaled < 2; scaled++)
                for (int with_y = 0; with_y < 3; with_y++) { /* none, dequantized, raw */
                    const int N = NS[ni], F = FS[fi];
                    const size_t n = (size_t)N * F, ns = n / 128;
                    float *gu = gen(2 * n, 200 + fi * 3 + ni, 3.0, 6.0);
                    float *rs = malloc(sizeof(float) * N);
                    for (int r = 0; r < N; r++)
                        rs[r] = (float)moe_rng_uniform(33, fi * 3 + ni, r);
                    void *dgu = upload_bf16(gu, 2 * n);
                    float *drs = dpoison(sizeof(float) * N);
                    moe_cuda_from_host(drs, rs, sizeof(float) * N);
                    const float *row_scale = scaled ? drs : NULL;
                    /* separate passes */
                    void *act = dpoison(2 * n), *y1 = dpoison(2 * n);
                    uint8_t *q1 = dpoison(n);
                    float *s1 = dpoison(4 * ns);
                    moe_cuda_swiglu_forward(act, dgu, row_scale, N, F);
                    ck_assert_int_eq(moe_cuda_quant_blockwise_act(q1, s1, y1, act, N, F,
                                                                  MOE_FP8_E4M3, 1, &err),
                                     MOE_OK);
                    /* fused */
                    void *y2 = dpoison(2 * n);
                    uint8_t *q2 = dpoison(n);
                    float *s2 = dpoison(4 * ns);
                    ck_assert_int_eq(moe_cuda_swiglu_forward_quant(q2, s2, with_y ? y2 : NULL,
                                                                   with_y == 2, dgu, row_scale,
                                                                   N, F, MOE_FP8_E4M3, 1, &err),
                                     MOE_OK);
                    int k = same2("fused forward codes", q2, 1, q1, 1, n);
                    k &= same2("fused forward scales", s2, 1, s1, 1, 4 * ns);
                    if (with_y == 1)
                        k &= same2("fused forward dequantized", y2, 1, y1, 1, 2 * n);
                    if (with_y == 2) /* the FP8 wgrad's source: the SwiGLU's own output */
                        k &= same2("fused forward bf16 output (y_raw)", y2, 1, act, 1, 2 * n);
                    if (!k)
                        printf("  ^ in case N %d F %d scaled %d y %d\n", N, F, scaled, with_y);
                    ok &= k;
                    cases++;
                    free(gu), free(rs);
                    moe_cuda_free(dgu), moe_cuda_free(drs), moe_cuda_free(act);
                    moe_cuda_free(y1), moe_cuda_free(q1), moe_cuda_free(s1);
                    moe_cuda_free(y2), moe_cuda_free(q2), moe_cuda_free(s2);
                }
    printf("  fused SwiGLU forward + 1x128 quantize: %d cases, %s\n", cases,
           ok ? "== separate passes byte for byte (codes, scales, copy or output)" : "DIFFER");
    ck_assert(ok);
    ck_assert_int_eq(moe_cuda_swiglu_forward_quant(NULL, NULL, NULL, 0, NULL, NULL, 4, 100,
                                                   MOE_FP8_E4M3, 1, &err),
                     MOE_ERR_CONFIG);
    ck_assert_ptr_nonnull(strstr(err.msg, "multiple of 128"));
}
END_TEST

START_TEST(test_gpu_swiglu_quant_backward) {
    moe_error err;
    int ok = 1, cases = 0;
    for (int fi = 0; fi < 3; fi++)
        for (int ni = 0; ni < 3; ni++)
            for (int sr = 0; sr < 4; sr++) { /* raw: y is dgu itself (y_raw), not the copy */
                const int scaled = sr & 1, raw = sr >> 1;
                const int N = NS[ni], F = FS[fi];
                const size_t n = (size_t)N * F, n2 = 2 * n, ns2 = n2 / 128;
                float *gu = gen(n2, 300 + fi * 3 + ni, 3.0, 6.0);
                float *dy = gen(n, 400 + fi * 3 + ni, 1e-3, 10.0);
                float *rs, *drs0, *drs, *dr1, *dr2;
                bwd_scales(N, 34, 35, fi * 3 + ni, &rs, &drs0, &drs, &dr1, &dr2);
                void *dgu = upload_bf16(gu, n2), *ddy = upload_bf16(dy, n);
                const float *row_scale = scaled ? drs : NULL;
                /* separate passes: a zeroed dgu, the backward, the quantizer with its copy */
                void *dgrad = dpoison(2 * n2), *y1 = dpoison(2 * n2);
                uint8_t *q1 = dpoison(n2);
                float *s1 = dpoison(4 * ns2);
                moe_cuda_zero(dgrad, 2 * n2);
                moe_cuda_swiglu_backward(dgrad, scaled ? dr1 : NULL, ddy, dgu, row_scale, N, F);
                ck_assert_int_eq(moe_cuda_quant_blockwise_act(q1, s1, y1, dgrad, N, 2 * F,
                                                              MOE_FP8_E4M3, 1, &err),
                                 MOE_OK);
                /* fused */
                void *y2 = dpoison(2 * n2);
                uint8_t *q2 = dpoison(n2);
                float *s2 = dpoison(4 * ns2);
                ck_assert_int_eq(moe_cuda_swiglu_backward_quant(q2, s2, y2, raw,
                                                                scaled ? dr2 : NULL, ddy, dgu,
                                                                row_scale, N, F, MOE_FP8_E4M3,
                                                                1, &err),
                                 MOE_OK);
                int k = same2("fused backward codes", q2, 1, q1, 1, n2);
                k &= same2("fused backward scales", s2, 1, s1, 1, 4 * ns2);
                if (raw) /* the FP8 wgrad's source: dgu itself, the separate backward's bytes */
                    k &= same2("fused backward dgu (y_raw)", y2, 1, dgrad, 1, 2 * n2);
                else
                    k &= same2("fused backward dequantized", y2, 1, y1, 1, 2 * n2);
                k &= same2("fused backward routing-weight gradient", dr2, 1, dr1, 1,
                           sizeof(float) * N);
                if (!k)
                    printf("  ^ in case N %d F %d scaled %d raw %d\n", N, F, scaled, raw);
                ok &= k;
                cases++;
                free(gu), free(dy), free(rs), free(drs0);
                moe_cuda_free(dgu), moe_cuda_free(ddy), moe_cuda_free(drs);
                moe_cuda_free(dr1), moe_cuda_free(dr2), moe_cuda_free(dgrad);
                moe_cuda_free(y1), moe_cuda_free(q1), moe_cuda_free(s1);
                moe_cuda_free(y2), moe_cuda_free(q2), moe_cuda_free(s2);
            }
    printf("  fused SwiGLU backward + 1x128 quantize: %d cases, %s\n", cases,
           ok ? "== separate passes byte for byte (codes, scales, copy or dgu, d scale)"
              : "DIFFER");
    ck_assert(ok);
}
END_TEST

/* The tiled kernels' cases (ragged groups: empty ones, one row, sizes around 128, 40
 * groups; rows past the last group) and their variants v (format: E5M2 when odd; with the
 * routing weight and plain scales when v >> 1, else without and power-of-two scales). Case
 * ci's offsets into off [41], its G, F and N; F is @p wide_f in the last case. */
typedef struct t_case {
    moe_fp8_format f;
    int scaled, pow2, G, F, N, past;
} t_case;

static t_case tiled_case(int ci, int v, int wide_f, int *off) {
    static const int z0[] = {0, 1, 127, 128, 129, 0, 255, 64};
    static const int z1[] = {1, 0, 0};
    static int z2[40];
    for (int e = 0; e < 40; e++)
        z2[e] = e % 7 == 3 ? 0 : (e * 53) % 190;
    const struct {
        const int *sizes;
        int G, F, past;
    } cs[] = {{z0, 8, 384, 3}, {z1, 3, 128, 0}, {z2, 40, 128, 130}, {z0, 8, wide_f, 0}};
    t_case c = {v & 1 ? MOE_FP8_E5M2 : MOE_FP8_E4M3, (v >> 1) & 1, !((v >> 1) & 1),
                cs[ci].G, cs[ci].F, 0, cs[ci].past};
    off[0] = 0;
    for (int g = 0; g < c.G; g++)
        off[g + 1] = off[g] + cs[ci].sizes[g];
    c.N = off[c.G] + c.past;
    return c;
}

/* The tiled backward under the FP8 wgrad (moe_cuda_swiglu_backward_quant_t) against the
 * separate passes: the row-wise fused backward with y_raw (dgu), then the token-wise
 * quantizer of that dgu. Codes and scales, row-wise and token-wise, byte for byte (both
 * sides poisoned alike, so the columns neither writes agree too); the routing weight's
 * gradient within fp32 rounding (another summation order). Ragged groups: empty ones, one
 * row, sizes around 128, 40 groups; rows past the last group (their row-wise codes only, 3
 * and 130 of them); both formats, both scale kinds, with and without the routing weight. */
START_TEST(test_gpu_swiglu_quant_backward_t) {
    moe_error err;
    int ok = 1, cases = 0;
    double worst_d = 0;
    const long long calls0 = moe_cuda_swiglu_backward_quant_t_calls();
    for (int ci = 0; ci < 4; ci++)
        for (int v = 0; v < 4; v++) {
            int off[41];
            const t_case tc = tiled_case(ci, v, 128, off);
            const moe_fp8_format f = tc.f;
            const int scaled = tc.scaled, pow2 = tc.pow2, G = tc.G, F = tc.F, N = tc.N;
            const size_t n = (size_t)N * F, n2 = 2 * n, ns2 = n2 / 128;
            const size_t kpad = moe_fp8_wgrad_kpad(N, G), nt = kpad * 2 * F;
            const size_t nst = kpad / 128 * 2 * F;
            float *gu = gen(n2, 500 + ci * 4 + v, 3.0, 6.0);
            float *dy = gen(n, 600 + ci * 4 + v, 1e-3, 10.0);
            float *rs, *drs0, *drs, *dr1, *dr2;
            bwd_scales(N, 36, 37, ci * 4 + v, &rs, &drs0, &drs, &dr1, &dr2);
            void *dgu = upload_bf16(gu, n2), *ddy = upload_bf16(dy, n);
            int *doff = moe_cuda_alloc(sizeof(int) * (G + 1));
            moe_cuda_from_host(doff, off, sizeof(int) * (G + 1));
            const float *row_scale = scaled ? drs : NULL;
            /* separate: the row-wise fused backward keeping dgu, then the token-wise copy */
            void *dgrad = dpoison(2 * n2);
            uint8_t *q1 = dpoison(n2), *qt1 = dpoison(nt);
            float *s1 = dpoison(4 * ns2), *st1 = dpoison(4 * nst);
            ck_assert_int_eq(moe_cuda_swiglu_backward_quant(q1, s1, dgrad, 1, scaled ? dr1 : NULL,
                                                            ddy, dgu, row_scale, N, F, f, pow2,
                                                            &err),
                             MOE_OK);
            ck_assert_int_eq(moe_cuda_quant_group_t_act(qt1, st1, dgrad, doff, G, N, 2 * F, kpad,
                                                        f, pow2, &err),
                             MOE_OK);
            /* tiled */
            uint8_t *q2 = dpoison(n2), *qt2 = dpoison(nt);
            float *s2 = dpoison(4 * ns2), *st2 = dpoison(4 * nst);
            float *part = dpoison(sizeof(float) * (n / 128 + 1));
            ck_assert_int_eq(moe_cuda_swiglu_backward_quant_t(q2, s2, qt2, st2, part,
                                                              scaled ? dr2 : NULL, ddy, dgu,
                                                              row_scale, doff, G, N, F, kpad, f,
                                                              pow2, &err),
                             MOE_OK);
            int k = same2("tiled backward row-wise codes", q2, 1, q1, 1, n2);
            k &= same2("tiled backward row-wise scales", s2, 1, s1, 1, 4 * ns2);
            k &= same2("tiled backward token-wise codes", qt2, 1, qt1, 1, nt);
            k &= same2("tiled backward token-wise scales", st2, 1, st1, 1, 4 * nst);
            float *h1 = malloc(sizeof(float) * (N + 1)), *h2 = malloc(sizeof(float) * (N + 1));
            moe_cuda_to_host(h1, dr1, sizeof(float) * N);
            moe_cuda_to_host(h2, dr2, sizeof(float) * N);
            double big = 0, worst = 0;
            for (int r = 0; r < N; r++) {
                big = fmax(big, fabs(h1[r] - drs0[r]));
                const double d = fabs((double)h2[r] - (double)h1[r]);
                worst = d > worst || d != d ? d : worst;
            }
            if (!scaled) /* no routing weight: d scale untouched, bit for bit */
                k &= same2("tiled backward d scale (untouched)", dr2, 1, dr1, 1, 4 * (size_t)N);
            else if (!(worst <= 1e-5 * big + 1e-30)) {
                printf("  tiled backward d scale: max |diff| %.3g, largest sum %.3g\n", worst,
                       big);
                k = 0;
            }
            worst_d = fmax(worst_d, big > 0 ? worst / big : 0);
            if (!k)
                printf("  ^ in case G %d N %d F %d (rows past the groups %d) format %d scaled %d "
                       "pow2 %d\n", G, N, F, tc.past, (int)f, scaled, pow2);
            ok &= k;
            cases++;
            free(gu), free(dy), free(rs), free(drs0), free(h1), free(h2);
            void *const bufs[] = {dgu, ddy, doff, drs, dr1, dr2, dgrad, q1, qt1, s1, st1,
                                  q2, qt2, s2, st2, part};
            for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
                moe_cuda_free(bufs[i]);
        }
    ck_assert_int_eq(moe_cuda_swiglu_backward_quant_t_calls() - calls0, cases);
    printf("  tiled SwiGLU backward + both quantizations: %d cases (%lld launches), %s; d scale "
           "within %.2g of the largest sum\n", cases,
           moe_cuda_swiglu_backward_quant_t_calls() - calls0,
           ok ? "== separate passes byte for byte (row-wise and token-wise codes and scales)"
              : "DIFFER", worst_d);
    ck_assert(ok);
    /* named errors, nothing launched */
    const int off1[2] = {0, 4};
    int *d1 = moe_cuda_alloc(sizeof off1);
    moe_cuda_from_host(d1, off1, sizeof off1);
    void *b = dpoison(1 << 16);
    ck_assert_int_eq(moe_cuda_swiglu_backward_quant_t(b, b, b, b, b, NULL, b, b, NULL, d1, 1, 4,
                                                      100, 512, MOE_FP8_E4M3, 1, &err),
                     MOE_ERR_CONFIG);
    ck_assert_ptr_nonnull(strstr(err.msg, "multiple of 128"));
    ck_assert_int_eq(moe_cuda_swiglu_backward_quant_t(b, b, b, b, NULL, b, b, b, NULL, d1, 1, 4,
                                                      128, 512, MOE_FP8_E4M3, 1, &err),
                     MOE_ERR_CONFIG);
    ck_assert_ptr_nonnull(strstr(err.msg, "partial sums"));
    ck_assert_int_eq(moe_cuda_swiglu_backward_quant_t(b, b, b, b, b, NULL, b, b, NULL, d1, 1, 4,
                                                      128, 0, MOE_FP8_E4M3, 1, &err),
                     MOE_ERR_CONFIG); /* kpad too small for the groups */
    ck_assert_int_eq(moe_cuda_swiglu_backward_quant_t_calls() - calls0, cases);
    moe_cuda_free(d1), moe_cuda_free(b);
}
END_TEST

/* The tiled forward under the FP8 wgrad (moe_cuda_swiglu_forward_quant_t, MOE_FP8_SAVE_T)
 * against the separate passes: the SwiGLU forward, the 1×128 quantizer of its output (fc2's
 * row-wise codes) and the token-wise quantizer of that output (the copy fc2's wgrad reads,
 * which the tiled forward keeps instead of the output). Codes and scales byte for byte, both
 * sides poisoned alike. The backward's ragged groups (empty ones, one row, sizes around 128,
 * 40 groups, rows past the last group) and a wider F (17 channel blocks); both formats, both
 * scale kinds, with and without the routing weight. */
START_TEST(test_gpu_swiglu_quant_forward_t) {
    moe_error err;
    int ok = 1, cases = 0;
    const long long calls0 = moe_cuda_swiglu_forward_quant_t_calls();
    const int blocks0 = moe_cuda_swiglu_forward_t_blocks();
    for (int ci = 0; ci < 4; ci++)
        for (int v = 0; v < 12; v++) { /* v % 4 the variant, 2 + v / 4 the blocks per SM */
            int off[41];
            const t_case tc = tiled_case(ci, v % 4, 2176, off);
            moe_cuda_swiglu_forward_t_set_blocks(2 + v / 4);
            const moe_fp8_format f = tc.f;
            const int scaled = tc.scaled, pow2 = tc.pow2, G = tc.G, F = tc.F, N = tc.N;
            const size_t n = (size_t)N * F, ns = n / 128;
            const size_t kpad = moe_fp8_wgrad_kpad(N, G), nt = kpad * F, nst = kpad / 128 * F;
            float *gu = gen(2 * n, 700 + ci * 4 + v, 3.0, 6.0);
            float *rs = malloc(sizeof(float) * (N + 1));
            for (int r = 0; r < N; r++)
                rs[r] = (float)moe_rng_uniform(38, ci * 4 + v, r);
            void *dgu = upload_bf16(gu, 2 * n);
            float *drs = dpoison(sizeof(float) * (N + 1));
            moe_cuda_from_host(drs, rs, sizeof(float) * N);
            int *doff = moe_cuda_alloc(sizeof(int) * (G + 1));
            moe_cuda_from_host(doff, off, sizeof(int) * (G + 1));
            const float *row_scale = scaled ? drs : NULL;
            /* separate: the output, its row-wise codes, its token-wise copy */
            void *act = dpoison(2 * n);
            uint8_t *q1 = dpoison(n), *qt1 = dpoison(nt);
            float *s1 = dpoison(4 * ns), *st1 = dpoison(4 * nst);
            moe_cuda_swiglu_forward(act, dgu, row_scale, N, F);
            ck_assert_int_eq(moe_cuda_quant_blockwise_act(q1, s1, NULL, act, N, F, f, pow2, &err),
                             MOE_OK);
            ck_assert_int_eq(moe_cuda_quant_group_t_act(qt1, st1, act, doff, G, N, F, kpad, f,
                                                        pow2, &err),
                             MOE_OK);
            /* tiled */
            uint8_t *q2 = dpoison(n), *qt2 = dpoison(nt);
            float *s2 = dpoison(4 * ns), *st2 = dpoison(4 * nst);
            ck_assert_int_eq(moe_cuda_swiglu_forward_quant_t(q2, s2, qt2, st2, dgu, row_scale,
                                                             doff, G, N, F, kpad, f, pow2, &err),
                             MOE_OK);
            int k = same2("tiled forward row-wise codes", q2, 1, q1, 1, n);
            k &= same2("tiled forward row-wise scales", s2, 1, s1, 1, 4 * ns);
            k &= same2("tiled forward token-wise codes", qt2, 1, qt1, 1, nt);
            k &= same2("tiled forward token-wise scales", st2, 1, st1, 1, 4 * nst);
            if (!k)
                printf("  ^ in case G %d N %d F %d (rows past the groups %d) format %d scaled %d "
                       "pow2 %d, %d blocks per SM\n", G, N, F, tc.past, (int)f, scaled, pow2,
                       2 + v / 4);
            ok &= k;
            cases++;
            free(gu), free(rs);
            void *const bufs[] = {dgu, drs, doff, act, q1, qt1, s1, st1, q2, qt2, s2, st2};
            for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
                moe_cuda_free(bufs[i]);
        }
    moe_cuda_swiglu_forward_t_set_blocks(blocks0);
    ck_assert_int_eq(moe_cuda_swiglu_forward_quant_t_calls() - calls0, cases);
    printf("  tiled SwiGLU forward + both quantizations: %d cases (2, 3 and 4 blocks per SM), "
           "%s\n", cases,
           ok ? "== separate passes byte for byte (row-wise and token-wise codes and scales)"
              : "DIFFER");
    ck_assert(ok);
    /* named errors, nothing launched */
    const int off1[2] = {0, 4};
    int *d1 = moe_cuda_alloc(sizeof off1);
    moe_cuda_from_host(d1, off1, sizeof off1);
    void *b = dpoison(1 << 16);
    ck_assert_int_eq(moe_cuda_swiglu_forward_quant_t(b, b, b, b, b, NULL, d1, 1, 4, 100, 512,
                                                     MOE_FP8_E4M3, 1, &err),
                     MOE_ERR_CONFIG);
    ck_assert_ptr_nonnull(strstr(err.msg, "multiple of 128"));
    ck_assert_int_eq(moe_cuda_swiglu_forward_quant_t(b, b, b, b, b, NULL, d1, 1, 4, 128, 0,
                                                     MOE_FP8_E4M3, 1, &err),
                     MOE_ERR_CONFIG); /* kpad too small for the groups */
    ck_assert_int_eq(moe_cuda_swiglu_forward_quant_t(NULL, b, b, b, b, NULL, d1, 1, 4, 128, 512,
                                                     MOE_FP8_E4M3, 1, &err),
                     MOE_ERR_CONFIG); /* no row-wise codes */
    ck_assert_int_eq(moe_cuda_swiglu_forward_quant_t_calls() - calls0, cases);
    moe_cuda_free(d1), moe_cuda_free(b);
}
END_TEST

Suite *suite_gpu_fp8_fused(void) {
    const TTest *const tests[] = {test_gpu_quant_1x128_vec, test_gpu_fp8_cast_check,
                                  test_gpu_quant_1x128_v3, test_gpu_swiglu_quant_forward,
                                  test_gpu_swiglu_quant_backward,
                                  test_gpu_swiglu_quant_backward_t,
                                  test_gpu_swiglu_quant_forward_t};
    return moe_test_chapter_suite("gpu_fp8_fused", "ch05", tests, 7);
}
