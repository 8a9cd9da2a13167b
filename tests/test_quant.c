/*
 * Chapter 05's formats and quantization recipes on the CPU (lib/quant_formats.h,
 * lib/quantize.h, lib/cpu/quantize.c).
 *
 *  - the codecs: all 256 E4M3 / E5M2 / E8M0 codes and the 16 E2M1 codes decode to a table
 *    computed here independently (ldexp of the fields), encode(decode(c)) == c for every
 *    finite code, every midpoint between neighbours rounds to the even one (and the floats
 *    next to it to the nearer one), saturation, NaN, fp32 subnormals;
 *  - each recipe on random data: the codes, the scales as specified (recomputed here from
 *    the block's amax), dequantize(quantize(x)) within the format's error bound per element,
 *    zero blocks, non-finite inputs, ragged rows, the named shape errors;
 *  - delayed scaling follows the window's maximum; MXFP8's E8M0 rule on hand-made blocks;
 *  - the Hadamard transform (H·Hᵀ = 16·I, the Sylvester matrix, inverse ∘ forward = identity)
 *    and NVFP4's stochastic rounding (unbiased over elements and over seeds, reproducible);
 *  - the low-precision GEMM's contract (lib/fp8_gemm.h): its named errors for bad recipe
 *    pairs, formats and shapes, the scale layouts cuBLASLt reads, and its CPU twin against a
 *    double-precision product of the dequantized operands.
 * Outputs are filled with 0xAB bytes before every call, so an element a function forgets to
 * write fails the comparison with its expected value.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "fp8_gemm.h"
#include "helpers.h"
#include "lowp.h"
#include "quantize.h"
#include "rng.h"
#include "suites.h"

/* ------------------------------------------------------------------ helpers */

static void *poisoned(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    ck_assert_ptr_nonnull(p);
    memset(p, 0xAB, bytes);
    return p;
}

/* n normals times 2^(spread·(u − ½)): spread 0 is plain N(0,1), spread 20 spans 6 decades */
static float *frand(size_t n, uint64_t stream, double spread) {
    float *x = poisoned(n * sizeof(float));
    for (size_t i = 0; i < n; i++)
        x[i] = (float)(moe_rng_normal(77, stream, i) *
                       exp2(spread * (moe_rng_uniform(78, stream, i) - 0.5)));
    return x;
}

static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* the same float bit for bit, or both NaN */
static int same(float a, float b) { return (isnan(a) && isnan(b)) || bits(a) == bits(b); }

/* independent tables: the value of a code from its fields, with ldexp */
static double ref_e4m3(int c) {
    const int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
    if (e == 15 && m == 7)
        return NAN;
    const double v = e == 0 ? ldexp(m, -9) : ldexp(8 + m, e - 10); /* (1 + m/8)·2^(e−7) */
    return s ? -v : v;
}

static double ref_e5m2(int c) {
    const int s = c >> 7, e = (c >> 2) & 31, m = c & 3;
    if (e == 31)
        return m ? NAN : (s ? -INFINITY : INFINITY);
    const double v = e == 0 ? ldexp(m, -16) : ldexp(4 + m, e - 17); /* (1 + m/4)·2^(e−15) */
    return s ? -v : v;
}

static double ref_e2m1(int c) {
    static const double mag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
    return c & 8 ? -mag[c & 7] : mag[c & 7];
}

typedef struct fmt8 {
    const char *name;
    uint8_t (*enc)(float);
    float (*dec)(uint8_t);
    double (*ref)(int);
    int ncodes, max_mag, sign_bit;
} fmt8;

static uint8_t enc43(float x) { return moe_e4m3_encode(x); }
static float dec43(uint8_t c) { return moe_e4m3_decode(c); }
static uint8_t enc52(float x) { return moe_e5m2_encode(x); }
static float dec52(uint8_t c) { return moe_e5m2_decode(c); }
static uint8_t enc21(float x) { return moe_e2m1_encode(x); }
static float dec21(uint8_t c) { return moe_e2m1_decode(c); }

static const fmt8 FORMATS[3] = {
    {"E4M3", enc43, dec43, ref_e4m3, 256, 0x7E, 0x80},
    {"E5M2", enc52, dec52, ref_e5m2, 256, 0x7B, 0x80},
    {"E2M1", enc21, dec21, ref_e2m1, 16, 0x7, 0x8},
};

/* ------------------------------------------------------------------ codecs */

START_TEST(test_decode_tables) {
    for (int f = 0; f < 3; f++) {
        const fmt8 *F = &FORMATS[f];
        int bad = 0, nans = 0;
        for (int c = 0; c < F->ncodes; c++) {
            const double r = F->ref(c);
            const float got = F->dec((uint8_t)c);
            nans += isnan(r);
            if (isnan(r) ? !isnan(got) : bits(got) != bits((float)r)) {
                if (bad++ < 5)
                    fprintf(stderr, "%s code 0x%02X decodes to %a, want %a\n", F->name, c,
                            (double)got, r);
            }
        }
        ck_assert_msg(bad == 0, "%s: %d codes decode wrong", F->name, bad);
        ck_assert_int_eq(nans, f == 0 ? 2 : f == 1 ? 6 : 0); /* E4M3 S.1111.111; E5M2 3 per sign */
    }
    /* the named constants */
    ck_assert(moe_e4m3_decode(0x7E) == 448.0f && moe_e4m3_decode(0xFE) == -448.0f);
    ck_assert(moe_e5m2_decode(0x7B) == 57344.0f && isinf(moe_e5m2_decode(0x7C)));
    ck_assert(moe_e4m3_decode(0x01) == ldexpf(1, -9) && moe_e5m2_decode(0x01) == ldexpf(1, -16));
    ck_assert(moe_e4m3_decode(MOE_E4M3_ONE) == 1.0f);
    ck_assert(signbit(moe_e4m3_decode(0x80)) && moe_e4m3_decode(0x80) == 0.0f);
    /* E8M0: 2^(c−127), 0xFF NaN; from an exponent, clamped */
    for (int c = 0; c < 256; c++) {
        const float got = moe_e8m0_decode((uint8_t)c);
        if (c == 255)
            ck_assert(isnan(got));
        else
            ck_assert_msg(bits(got) == bits((float)ldexp(1.0, c - 127)), "E8M0 0x%02X", c);
        if (c < 255)
            ck_assert_int_eq(moe_e8m0_from_exp(c - 127), c);
    }
    ck_assert_int_eq(moe_e8m0_from_exp(-200), 0);
    ck_assert_int_eq(moe_e8m0_from_exp(300), 254);
    ck_assert_int_eq(moe_e8m0_decode(MOE_E8M0_ONE), 1);
    /* floor(log2) from the bits, subnormals included */
    const float probe[] = {1.0f, 1.5f, 2.0f, 0.75f, 448.0f, 500.0f, FLT_MAX, FLT_MIN,
                           from_bits(1), from_bits(0x00400000), from_bits(0x005FFFFF), 3e-39f};
    for (size_t i = 0; i < sizeof probe / sizeof *probe; i++) {
        int e;
        frexp(probe[i], &e); /* probe = m·2^e with m in [0.5, 1) */
        ck_assert_msg(moe_q_floor_log2(probe[i]) == e - 1, "floor_log2(%a)", (double)probe[i]);
    }
}
END_TEST

START_TEST(test_encode_roundtrip_and_ties) {
    for (int f = 0; f < 3; f++) {
        const fmt8 *F = &FORMATS[f];
        /* encode(decode(c)) == c for every finite code, both signs, −0 included */
        for (int c = 0; c < F->ncodes; c++) {
            const float v = F->dec((uint8_t)c);
            if (isnan(v) || isinf(v))
                continue;
            ck_assert_msg(F->enc(v) == c, "%s: encode(decode(0x%02X) = %a) = 0x%02X", F->name,
                          c, (double)v, F->enc(v));
        }
        /* every midpoint between neighbours (exact in fp32: one more bit) rounds to the even
         * code; the floats just below and above it round to the nearer code */
        for (int k = 0; k < F->max_mag; k++) {
            const double lo = F->ref(k), hi = F->ref(k + 1);
            const float mid = (float)((lo + hi) / 2);
            ck_assert(mid == (lo + hi) / 2);
            const int even = k % 2 == 0 ? k : k + 1;
            for (int s = 0; s < 2; s++) {
                const float sg = s ? -1.0f : 1.0f;
                const int sb = s ? F->sign_bit : 0;
                ck_assert_msg(F->enc(sg * mid) == (sb | even), "%s: tie %a -> 0x%02X, want 0x%02X",
                              F->name, (double)(sg * mid), F->enc(sg * mid), sb | even);
                ck_assert_int_eq(F->enc(sg * nextafterf(mid, 0.0f)), sb | k);
                ck_assert_int_eq(F->enc(sg * nextafterf(mid, INFINITY)), sb | (k + 1));
            }
        }
        /* saturation: beyond max, huge, infinite → ±max; the midpoint above max too */
        const float fmax = F->dec((uint8_t)F->max_mag);
        const float above[] = {nextafterf(fmax, INFINITY), fmax * 1.0625f, fmax * 1.125f,
                               fmax * 2.0f, 1e30f, FLT_MAX, INFINITY};
        for (size_t i = 0; i < sizeof above / sizeof *above; i++) {
            ck_assert_int_eq(F->enc(above[i]), F->max_mag);
            ck_assert_int_eq(F->enc(-above[i]), F->sign_bit | F->max_mag);
        }
        /* tiny values: fp32 subnormals and anything below half the smallest subnormal → ±0;
         * exactly half rounds to even (0) */
        const float sub = F->dec(1);
        const float tiny[] = {sub / 2, nextafterf(sub / 2, 0.0f), 1e-30f, FLT_MIN, from_bits(1),
                              from_bits(0x007FFFFF)};
        for (size_t i = 0; i < sizeof tiny / sizeof *tiny; i++) {
            ck_assert_int_eq(F->enc(tiny[i]), 0);
            ck_assert_int_eq(F->enc(-tiny[i]), F->sign_bit);
        }
        ck_assert_int_eq(F->enc(nextafterf(sub / 2, 1.0f)), 1);
        /* NaN: the positive NaN code of E4M3/E5M2, whatever the sign and payload; E2M1 → +0 */
        const uint32_t nans[] = {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFFFFFFFFu, 0x7FBFFFFFu};
        for (size_t i = 0; i < sizeof nans / sizeof *nans; i++)
            ck_assert_int_eq(F->enc(from_bits(nans[i])), f == 2 ? 0 : 0x7F);
    }
    /* a few hand values */
    ck_assert_int_eq(moe_e4m3_encode(464.0f), 0x7E);  /* tie 448|480: 448 is even */
    ck_assert_int_eq(moe_e4m3_encode(-500.0f), 0xFE);
    ck_assert_int_eq(moe_e5m2_encode(61440.0f), 0x7B); /* tie 57344|inf: rounds up, saturates */
    ck_assert_int_eq(moe_e2m1_encode(5.0f), 0x6);     /* tie 4|6: 4 is even */
    ck_assert_int_eq(moe_e2m1_encode(2.5f), 0x4);     /* tie 2|3: 2 is even */
    ck_assert_int_eq(moe_e2m1_encode(0.25f), 0x0);    /* tie 0|0.5 */
    ck_assert_int_eq(moe_e2m1_encode(0.75f), 0x2);    /* tie 0.5|1: 1 is even */
    ck_assert_int_eq(moe_e2m1_encode(-1.25f), 0xA);   /* tie 1|1.5: 1 is even */
}
END_TEST

/* ------------------------------------------------------------------ recipes */

static const float FMAX[2] = {448.0f, 57344.0f};
static const int MBITS[2] = {3, 2};
static const char *FNAME[2] = {"E4M3", "E5M2"};

/* the fast FP8 encoder (the token-wise quantizer's, kernels/quantize_group_t.cu) equals
 * moe_fp8_encode() on every magnitude (all 2^31 positive bit patterns, NaNs and infinities
 * included) in both formats, and on every 4093rd negative one (its sign is one OR, the same
 * for every magnitude): about 2^32 calls, ~10 CPU-seconds at -O2, split over the threads */
START_TEST(test_fp8_encode_fast) {
    for (int f = 0; f < 2; f++) {
        long long bad = 0;
#pragma omp parallel for schedule(static) reduction(+ : bad)
        for (long long hi = 0; hi < (1LL << 15); hi++)
            for (uint32_t lo = 0; lo < (1u << 16); lo++) {
                const uint32_t u = (uint32_t)hi << 16 | lo;
                const moe_fp8_format fm = (moe_fp8_format)f;
                const float x = from_bits(u), nx = from_bits(u | 0x80000000u);
                bad += moe_fp8_encode_fast(x, fm) != moe_fp8_encode(x, fm);
                if (u % 4093 == 0)
                    bad += moe_fp8_encode_fast(nx, fm) != moe_fp8_encode(nx, fm);
            }
        ck_assert_msg(bad == 0, "%s: the fast encoder differs on %lld inputs", FNAME[f], bad);
    }
}
END_TEST


/* |y − x| of an FP8 element within half a step of the format, relative for normals and
 * absolute (half the smallest subnormal, in x's units) below: y = decode(cast(x·s))/s */
static int fp8_within(float y, float x, float scale_inv, moe_fp8_format f) {
    const double sub = f == MOE_FP8_E5M2 ? ldexp(1, -16) : ldexp(1, -9);
    const double bound = ldexp(fabs(x), -(MBITS[f] + 1)) * (1 + 1e-6) +
                         0.5 * sub * scale_inv * (1 + 1e-6) + 1e-45;
    return fabs((double)y - x) <= bound;
}

START_TEST(test_tensorwise) {
    const size_t sizes[] = {1, 1000, 100003};
    moe_error err;
    for (int f = 0; f < 2; f++)
        for (size_t si = 0; si < 3; si++) {
            const size_t n = sizes[si];
            float *x = frand(n, 10 + si, 16.0);
            uint8_t *q = poisoned(n);
            float *y = poisoned(n * sizeof(float));
            moe_quant_scalars s;
            memset(&s, 0xAB, sizeof s);
            ck_assert_int_eq(moe_cpu_quant_tensorwise(q, &s, x, n, f, &err), MOE_OK);
            ck_assert_int_eq(moe_cpu_dequant_tensorwise(y, q, &s, n, f, &err), MOE_OK);
            float amax = 0;
            for (size_t i = 0; i < n; i++)
                amax = fmaxf(amax, fabsf(x[i]));
            ck_assert(bits(s.amax) == bits(amax));
            ck_assert(bits(s.scale) == bits(FMAX[f] / amax));
            ck_assert(bits(s.scale_inv) == bits(1.0f / s.scale));
            /* the tensor's largest element lands on the format's largest value */
            ck_assert_int_eq(moe_fp8_encode(amax * s.scale, f), f ? 0x7B : 0x7E);
            size_t bad = 0;
            for (size_t i = 0; i < n; i++) {
                bad += q[i] != moe_fp8_encode(x[i] * s.scale, f);
                bad += !fp8_within(y[i], x[i], s.scale_inv, f);
            }
            ck_assert_msg(bad == 0, "tensorwise %s n=%zu: %zu elements wrong", FNAME[f], n, bad);
            free(x), free(q), free(y);
        }
    /* zero tensor: scale 1, codes 0; a NaN or an inf: NaN scales, codes 0, NaN out; a tiny
     * amax: the scale is clamped to FLT_MAX */
    float z[40] = {0}, y[40];
    uint8_t q[40];
    moe_quant_scalars s;
    memset(q, 0xAB, sizeof q);
    moe_cpu_quant_tensorwise(q, &s, z, 40, MOE_FP8_E4M3, &err);
    ck_assert(s.amax == 0 && s.scale == 1 && s.scale_inv == 1);
    for (int i = 0; i < 40; i++)
        ck_assert_int_eq(q[i], 0);
    for (int bad = 0; bad < 3; bad++) {
        z[17] = bad == 0 ? NAN : bad == 1 ? INFINITY : -INFINITY;
        memset(q, 0xAB, sizeof q);
        moe_cpu_quant_tensorwise(q, &s, z, 40, MOE_FP8_E4M3, &err);
        ck_assert(bad ? isinf(s.amax) : bits(s.amax) == MOE_Q_NAN_BITS);
        ck_assert(bits(s.scale) == MOE_Q_NAN_BITS && bits(s.scale_inv) == MOE_Q_NAN_BITS);
        moe_cpu_dequant_tensorwise(y, q, &s, 40, MOE_FP8_E4M3, &err);
        for (int i = 0; i < 40; i++)
            ck_assert(q[i] == 0 && isnan(y[i]));
    }
    z[17] = 1e-38f;
    moe_cpu_quant_tensorwise(q, &s, z, 40, MOE_FP8_E4M3, &err);
    ck_assert(s.scale == FLT_MAX);
    ck_assert_int_eq(moe_cpu_quant_tensorwise(q, &s, z, 40, (moe_fp8_format)7, &err),
                     MOE_ERR_CONFIG);
}
END_TEST

START_TEST(test_delayed_scaling) {
    enum { N = 1000, LEN = 3, STEPS = 12 };
    /* amax per step; a NaN at step 7 freezes the scale while it is in the window */
    const float A[STEPS] = {1, 8, 2, 0.5f, 0.25f, 0.125f, 4, NAN, 1, 1, 2, 16};
    float hist[LEN] = {0, 0, 0}, window[LEN] = {0, 0, 0};
    moe_quant_scalars s = {0, 1.0f, 0};
    float expect_scale = 1.0f;
    moe_error err;
    uint8_t *q = poisoned(N);
    float *x = poisoned(N * sizeof(float));
    for (int k = 0; k < STEPS; k++) {
        for (int i = 0; i < N; i++)
            x[i] = (float)(0.9 * (2 * moe_rng_uniform(5, k, i) - 1)) * (isnan(A[k]) ? 1 : A[k]);
        x[7] = isnan(A[k]) ? NAN : -A[k];
        memset(q, 0xAB, N);
        const int pos = k % LEN;
        ck_assert_int_eq(moe_cpu_quant_delayed(q, &s, hist, LEN, pos, x, N, MOE_FP8_E4M3, &err),
                         MOE_OK);
        /* the codes used the scale chosen before this step */
        for (int i = 0; i < N; i++)
            ck_assert_int_eq(q[i], moe_e4m3_encode(x[i] * expect_scale));
        ck_assert(bits(s.scale_inv) == bits(1.0f / expect_scale));
        ck_assert(same(s.amax, A[k]) && same(hist[pos], A[k]));
        window[pos] = A[k];
        float m = 0;
        int finite = 1;
        for (int j = 0; j < LEN; j++) {
            finite &= isfinite(window[j]);
            m = fmaxf(m, window[j]);
        }
        if (finite && m > 0)
            expect_scale = 448.0f / m;
        ck_assert_msg(bits(s.scale) == bits(expect_scale), "step %d: next scale %g, want %g", k,
                      (double)s.scale, (double)expect_scale);
    }
    /* the window did its job: the 8 of step 1 left it at step 4 */
    float h2[LEN] = {0}, probe = 1;
    moe_quant_scalars s2 = {0, 1, 0};
    const float amaxes[5] = {1, 8, 2, 0.5f, 0.25f};
    float scales[5];
    for (int k = 0; k < 5; k++) {
        probe = amaxes[k];
        moe_cpu_quant_delayed(q, &s2, h2, LEN, k % LEN, &probe, 1, MOE_FP8_E4M3, &err);
        scales[k] = s2.scale;
    }
    ck_assert(scales[1] == 56 && scales[2] == 56 && scales[3] == 56 && scales[4] == 224);
    ck_assert_int_eq(moe_cpu_quant_delayed(q, &s, hist, 0, 0, x, N, MOE_FP8_E4M3, &err),
                     MOE_ERR_CONFIG);
    ck_assert_int_eq(moe_cpu_quant_delayed(q, &s, hist, LEN, LEN, x, N, MOE_FP8_E4M3, &err),
                     MOE_ERR_CONFIG);
    ck_assert_ptr_nonnull(strstr(err.msg, "window"));
    free(q), free(x);
}
END_TEST

/* expected power-of-two scale: 2^floor(log2(fmax/amax)) of the float quotient */
static float pow2_down(float s) {
    int e;
    frexpf(s, &e);
    return ldexpf(1.0f, e - 1);
}

START_TEST(test_blockwise) {
    const int shapes[][2] = {{1, 128}, {130, 256}, {257, 384}, {3, 1024}};
    moe_error err;
    for (int f = 0; f < 2; f++)
        for (int b2 = 0; b2 < 2; b2++)
            for (int p2 = 0; p2 < 2; p2++)
                for (int sh = 0; sh < 4; sh++) {
                    const int R = shapes[sh][0], C = shapes[sh][1], nbc = C / 128;
                    const int bh = b2 ? 128 : 1, nbr = (R + bh - 1) / bh;
                    const size_t n = (size_t)R * C;
                    float *x = frand(n, 100 + sh, 12.0);
                    /* block (0, last) all zeros */
                    for (int r = 0; r < (b2 ? (R < 128 ? R : 128) : 1); r++)
                        for (int c = C - 128; c < C; c++)
                            x[(size_t)r * C + c] = 0.0f;
                    uint8_t *q = poisoned(n);
                    const size_t ns = moe_quant_scale_count(b2 ? MOE_QUANT_BLOCK_128X128
                                                               : MOE_QUANT_BLOCK_1X128, R, C);
                    ck_assert_int_eq(ns, (size_t)nbr * nbc);
                    float *si = poisoned(ns * sizeof(float)), *y = poisoned(n * sizeof(float));
                    ck_assert_int_eq(moe_cpu_quant_blockwise(q, si, x, R, C, f, b2, p2, &err),
                                     MOE_OK);
                    ck_assert_int_eq(moe_cpu_dequant_blockwise(y, q, si, R, C, f, b2, &err),
                                     MOE_OK);
                    size_t bad = 0;
                    for (int br = 0; br < nbr; br++)
                        for (int bc = 0; bc < nbc; bc++) {
                            const int r0 = br * bh, r1 = r0 + bh < R ? r0 + bh : R;
                            float amax = 0;
                            for (int r = r0; r < r1; r++)
                                for (int c = bc * 128; c < bc * 128 + 128; c++)
                                    amax = fmaxf(amax, fabsf(x[(size_t)r * C + c]));
                            float scale = amax == 0 ? 1.0f : FMAX[f] / amax;
                            if (p2 && amax > 0)
                                scale = pow2_down(scale);
                            const float got_inv = si[(size_t)br * nbc + bc];
                            if (bits(got_inv) != bits(1.0f / scale)) {
                                bad++;
                                continue;
                            }
                            if (amax > 0 && !p2) /* amax·scale lands on max */
                                bad += moe_fp8_encode(amax * scale, f) != (f ? 0x7B : 0x7E);
                            if (amax > 0 && p2) /* a power of two, amax·scale in (max/2, max] */
                                bad += !(amax * scale <= FMAX[f] * (1 + 1e-6) && amax * scale > FMAX[f] / 2 &&
                                         pow2_down(scale) == scale);
                            for (int r = r0; r < r1; r++)
                                for (int c = bc * 128; c < bc * 128 + 128; c++) {
                                    const size_t i = (size_t)r * C + c;
                                    bad += q[i] != moe_fp8_encode(x[i] * scale, f);
                                    bad += !fp8_within(y[i], x[i], 1.0f / scale, f);
                                    if (amax == 0)
                                        bad += q[i] != 0 || y[i] != 0;
                                }
                        }
                    ck_assert_msg(bad == 0, "blockwise %s %s%s [%d, %d]: %zu wrong", FNAME[f],
                                  b2 ? "128x128" : "1x128", p2 ? " pow2" : "", R, C, bad);
                    free(x), free(q), free(si), free(y);
                }
    /* a NaN poisons its tile only (1x128) or its block (128x128) */
    for (int b2 = 0; b2 < 2; b2++) {
        enum { R = 200, C = 256 };
        float *x = frand(R * C, 9, 0.0), *y = poisoned(R * C * sizeof(float));
        uint8_t *q = poisoned(R * C);
        float si[400];
        x[150 * C + 130] = NAN; /* row 150, column tile 1 */
        moe_cpu_quant_blockwise(q, si, x, R, C, MOE_FP8_E4M3, b2, 0, &err);
        moe_cpu_dequant_blockwise(y, q, si, R, C, MOE_FP8_E4M3, b2, &err);
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) {
                const int hit = c >= 128 && (b2 ? r >= 128 : r == 150);
                ck_assert_msg(hit == !!isnan(y[r * C + c]), "NaN spread wrong at (%d, %d)", r, c);
                if (hit)
                    ck_assert_int_eq(q[r * C + c], 0);
            }
        free(x), free(y), free(q);
    }
    /* named errors */
    float x1[200] = {0};
    uint8_t q1[200];
    float s1[4];
    ck_assert_int_eq(moe_cpu_quant_blockwise(q1, s1, x1, 2, 100, MOE_FP8_E4M3, 0, 0, &err),
                     MOE_ERR_CONFIG);
    ck_assert_ptr_nonnull(strstr(err.msg, "not a multiple of 128"));
    ck_assert_int_eq(moe_cpu_quant_blockwise(q1, s1, x1, -1, 128, MOE_FP8_E4M3, 1, 0, &err),
                     MOE_ERR_CONFIG);
    ck_assert_int_eq(moe_cpu_quant_blockwise(q1, s1, x1, 0, 128, MOE_FP8_E4M3, 1, 0, &err), MOE_OK);
}
END_TEST

START_TEST(test_mxfp8) {
    moe_error err;
    /* the E8M0 rule on hand-made blocks: scale exponent = floor(log2 amax) − 8 (E4M3) */
    struct {
        float amax;
        int code;
    } cases[] = {
        {1.0f, 127 - 8},      {448.0f, 127},        {500.0f, 127},        {511.9f, 127},
        {512.0f, 128},        {3.0f, 127 - 7},      {0.75f, 127 - 9},     {FLT_MAX, 127 + 119},
        {from_bits(1), 0},    {1e-38f, 0},          {0.0f, 127},          {NAN, 255},
        {INFINITY, 255},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        float x[32] = {0};
        for (int j = 0; j < 32; j++)
            x[j] = cases[k].amax * ((float)(j % 5) / 5.0f); /* smaller entries */
        x[9] = -cases[k].amax;
        uint8_t q[32], sc = 0xAB;
        memset(q, 0xAB, 32);
        ck_assert_int_eq(moe_cpu_quant_mxfp8(q, &sc, x, 1, 32, MOE_FP8_E4M3, &err), MOE_OK);
        ck_assert_msg(sc == cases[k].code, "amax %a: E8M0 0x%02X, want 0x%02X",
                      (double)cases[k].amax, sc, cases[k].code);
        if (cases[k].amax == 500.0f) /* above 448 after scaling by 2^0: saturates */
            ck_assert_int_eq(q[9], 0xFE);
        if (cases[k].amax == 448.0f || cases[k].amax == 1.0f)
            ck_assert_int_eq(q[9], cases[k].amax == 448.0f ? 0xFE : 0xF8); /* −448 ; −256 */
        if (isnan(cases[k].amax) || isinf(cases[k].amax)) /* poisoned: codes 0 */
            for (int j = 0; j < 32; j++)
                ck_assert_int_eq(q[j], 0);
        if (cases[k].amax == 0.0f) /* zeros: ±0 (x[9] is −0) */
            for (int j = 0; j < 32; j++)
                ck_assert_int_eq(q[j], j == 9 ? 0x80 : 0);
    }
    /* E5M2 elements: emax_elem = 15 */
    {
        float x[32] = {1.0f};
        uint8_t q[32], sc;
        moe_cpu_quant_mxfp8(q, &sc, x, 1, 32, MOE_FP8_E5M2, &err);
        ck_assert_int_eq(sc, 127 - 15);
        ck_assert(moe_e5m2_decode(q[0]) == 32768.0f);
    }
    /* random data: codes, scales, error bound, ragged rows */
    const int shapes[][2] = {{1, 32}, {37, 96}, {129, 512}};
    for (int f = 0; f < 2; f++)
        for (int sh = 0; sh < 3; sh++) {
            const int R = shapes[sh][0], C = shapes[sh][1];
            const size_t n = (size_t)R * C, nb = n / 32;
            float *x = frand(n, 200 + sh, 30.0), *y = poisoned(n * sizeof(float));
            for (int j = 0; j < 32; j++)
                x[n - 32 + j] = 0.0f; /* the last block: zeros */
            uint8_t *q = poisoned(n), *sc = poisoned(nb);
            ck_assert_int_eq(moe_cpu_quant_mxfp8(q, sc, x, R, C, f, &err), MOE_OK);
            ck_assert_int_eq(moe_cpu_dequant_mxfp8(y, q, sc, R, C, f, &err), MOE_OK);
            size_t bad = 0;
            for (size_t b = 0; b < nb; b++) {
                float amax = 0;
                for (int j = 0; j < 32; j++)
                    amax = fmaxf(amax, fabsf(x[b * 32 + j]));
                int e = 0;
                if (amax > 0) {
                    frexpf(amax, &e);
                    e = e - 1 - (f ? 15 : 8);
                    e = e < -127 ? -127 : e;
                }
                bad += sc[b] != e + 127;
                const float X = ldexpf(1.0f, e);
                for (int j = 0; j < 32; j++) {
                    const size_t i = b * 32 + j;
                    bad += q[i] != moe_fp8_encode(x[i] / X, f);
                    /* saturation aside (E4M3: |x|/X in (448, 512)), within half a step */
                    if (fabsf(x[i]) / X <= FMAX[f])
                        bad += !fp8_within(y[i], x[i], X, f);
                    else
                        bad += y[i] != copysignf(FMAX[f] * X, x[i]);
                }
            }
            ck_assert_int_eq(sc[nb - 1], 127);
            ck_assert_msg(bad == 0, "MXFP8 %s [%d, %d]: %zu wrong", FNAME[f], R, C, bad);
            free(x), free(y), free(q), free(sc);
        }
    float x1[64] = {0};
    uint8_t q1[64], s1[2];
    ck_assert_int_eq(moe_cpu_quant_mxfp8(q1, s1, x1, 1, 48, MOE_FP8_E4M3, &err), MOE_ERR_CONFIG);
    ck_assert_ptr_nonnull(strstr(err.msg, "not a multiple of 32"));
}
END_TEST

/* half the gap between the E2M1 neighbours of a = |v| (saturation beyond 6) */
static double e2m1_err_bound(double a) {
    return a <= 2 ? 0.25 : a <= 4 ? 0.5 : a <= 6 ? 1.0 : a - 6;
}

/* check one NVFP4 quantization against the definition, recomputed here */
static size_t check_nvfp4(const float *xt, int R, int C, const moe_nvfp4_opts *o,
                          const uint8_t *q, const uint8_t *sc, const moe_quant_scalars *g,
                          const float *yt) {
    const int gpr = C / 16, bh = o->block_2d ? 16 : 1, nbr = (R + bh - 1) / bh;
    size_t bad = 0;
    float amax = 0;
    for (size_t i = 0; i < (size_t)R * C; i++)
        amax = fmaxf(amax, fabsf(xt[i]));
    const float G = amax == 0 ? 1.0f : 2688.0f / amax;
    bad += bits(g->amax) != bits(amax) || bits(g->scale) != bits(G) ||
           bits(g->scale_inv) != bits(1.0f / G);
    for (int br = 0; br < nbr; br++)
        for (int bc = 0; bc < gpr; bc++) {
            const int r0 = br * bh, r1 = r0 + bh < R ? r0 + bh : R;
            float bm = 0;
            for (int r = r0; r < r1; r++)
                for (int j = 0; j < 16; j++)
                    bm = fmaxf(bm, fabsf(xt[(size_t)r * C + bc * 16 + j]));
            const uint8_t want = bm == 0 ? 0x38 : moe_e4m3_encode(bm / 6.0f * G);
            const uint8_t got = sc[(size_t)br * gpr + bc];
            if (got != want) {
                bad++;
                continue;
            }
            const float d = moe_e4m3_decode(got) / G;
            for (int r = r0; r < r1; r++)
                for (int j = 0; j < 16; j++) {
                    const size_t i = (size_t)r * C + bc * 16 + j;
                    const uint8_t byte = q[(size_t)r * (C / 2) + bc * 8 + j / 2];
                    const uint8_t c = j & 1 ? byte >> 4 : byte & 0xF;
                    if (!o->stochastic)
                        bad += c != (got == 0 ? 0 : moe_e2m1_encode(xt[i] / d));
                    const double a = fabs((double)xt[i]) / d;
                    const double err = fabs((double)moe_e2m1_decode(c) * d - xt[i]);
                    const double bound = (o->stochastic ? 2 * e2m1_err_bound(a) : e2m1_err_bound(a));
                    if (got != 0)
                        bad += err > bound * d * (1 + 1e-5) + 1e-30;
                    if (yt) /* the dequantized value, in the transformed domain */
                        bad += bits(yt[i]) != bits(moe_e2m1_decode(c) * (moe_e4m3_decode(got) / G));
                }
        }
    return bad;
}

START_TEST(test_nvfp4) {
    moe_error err;
    const int shapes[][2] = {{1, 16}, {37, 64}, {130, 256}};
    for (int b2 = 0; b2 < 2; b2++)
        for (int sh = 0; sh < 3; sh++) {
            const int R = shapes[sh][0], C = shapes[sh][1];
            const size_t n = (size_t)R * C;
            const moe_nvfp4_opts o = {.block_2d = b2};
            float *x = frand(n, 300 + sh, 8.0), *y = poisoned(n * sizeof(float));
            if (R > 16) /* a zero block */
                for (int r = 16; r < 32; r++)
                    for (int j = 0; j < 16; j++)
                        x[(size_t)r * C + 16 + j] = 0.0f;
            const size_t ns = moe_quant_scale_count(b2 ? MOE_QUANT_NVFP4_2D : MOE_QUANT_NVFP4, R, C);
            uint8_t *q = poisoned(n / 2), *sc = poisoned(ns);
            moe_quant_scalars g;
            memset(&g, 0xAB, sizeof g);
            ck_assert_int_eq(moe_cpu_quant_nvfp4(q, sc, &g, x, R, C, &o, &err), MOE_OK);
            ck_assert_int_eq(moe_cpu_dequant_nvfp4(y, q, sc, &g, R, C, &o, &err), MOE_OK);
            const size_t bad = check_nvfp4(x, R, C, &o, q, sc, &g, y);
            ck_assert_msg(bad == 0, "NVFP4 %s [%d, %d]: %zu wrong", b2 ? "16x16" : "1x16", R, C, bad);
            if (R > 16)
                ck_assert_int_eq(sc[b2 ? 1 * (C / 16) + 1 : 16 * (C / 16) + 1], MOE_E4M3_ONE);
            free(x), free(y), free(q), free(sc);
        }
    /* packing: element 2j in the low nibble */
    {
        float x[16] = {6.0f, -3.0f, 0.5f, 1.0f};
        uint8_t q[8], sc;
        moe_quant_scalars g;
        memset(q, 0xAB, 8);
        moe_cpu_quant_nvfp4(q, &sc, &g, x, 1, 16, NULL, &err);
        ck_assert(g.scale == 448.0f && sc == 0x7E); /* (6/6)·448 = 448: divisor 1 */
        ck_assert_int_eq(q[0], 0x7 | (0xD << 4));
        ck_assert_int_eq(q[1], 0x1 | (0x2 << 4));
        for (int j = 2; j < 8; j++)
            ck_assert_int_eq(q[j], 0);
    }
    /* a block far below the tensor amax: its E4M3 scale underflows to 0, its codes are 0 */
    {
        float x[32], y[32];
        for (int j = 0; j < 32; j++)
            x[j] = j < 16 ? 1e-3f * (float)(j + 1) : 0.5f;
        x[20] = 1e6f;
        uint8_t q[16], sc[2];
        moe_quant_scalars g;
        moe_cpu_quant_nvfp4(q, sc, &g, x, 1, 32, NULL, &err);
        moe_cpu_dequant_nvfp4(y, q, sc, &g, 1, 32, NULL, &err);
        ck_assert_int_eq(sc[0], 0);
        for (int j = 0; j < 16; j++)
            ck_assert(y[j] == 0.0f && (q[j / 2] & (j & 1 ? 0xF0 : 0x0F)) == 0);
        ck_assert(fabsf(y[20] - 1e6f) <= 1e6f * 1e-6f);
    }
    /* a NaN or an inf anywhere poisons the whole tensor */
    for (int bad = 0; bad < 2; bad++) {
        float *x = frand(64, 11, 0.0), y[64];
        x[40] = bad ? -INFINITY : NAN;
        uint8_t q[32], sc[4];
        moe_quant_scalars g;
        moe_cpu_quant_nvfp4(q, sc, &g, x, 2, 32, NULL, &err);
        moe_cpu_dequant_nvfp4(y, q, sc, &g, 2, 32, NULL, &err);
        ck_assert(bits(g.scale) == MOE_Q_NAN_BITS);
        for (int j = 0; j < 4; j++)
            ck_assert_int_eq(sc[j], MOE_E4M3_NAN);
        for (int j = 0; j < 64; j++)
            ck_assert(isnan(y[j]) && q[j / 2] == 0);
        free(x);
    }
    float x1[32] = {0};
    uint8_t q1[16], s1[2];
    moe_quant_scalars g1;
    ck_assert_int_eq(moe_cpu_quant_nvfp4(q1, s1, &g1, x1, 1, 24, NULL, &err), MOE_ERR_CONFIG);
    ck_assert_ptr_nonnull(strstr(err.msg, "not a multiple of 16"));
}
END_TEST

START_TEST(test_hadamard) {
    /* H from the transform with no signs: row i of H/4 is e_i·(H/4); Sylvester's
     * H[i][j] = (−1)^popcount(i & j); H·Hᵀ = 16·I */
    float H[16][16];
    for (int i = 0; i < 16; i++) {
        float v[16] = {0};
        v[i] = 1.0f;
        moe_q_rht16(v, 0, 0);
        for (int j = 0; j < 16; j++) {
            H[i][j] = 4.0f * v[j];
            ck_assert(H[i][j] == (__builtin_popcount(i & j) & 1 ? -1.0f : 1.0f));
        }
    }
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++) {
            float d = 0;
            for (int k = 0; k < 16; k++)
                d += H[i][k] * H[j][k];
            ck_assert(d == (i == j ? 16.0f : 0.0f));
        }
    /* with the signs of a seed: M = H·S/4, M·Mᵀ = I; the forward is v·M */
    const uint32_t signs = moe_q_rht_signs(42);
    ck_assert(signs != moe_q_rht_signs(43));
    enum { R = 9, C = 64 };
    float *x = frand(R * C, 400, 10.0), *t = poisoned(R * C * sizeof(float)),
          *b = poisoned(R * C * sizeof(float));
    moe_error err;
    ck_assert_int_eq(moe_cpu_rht16(t, x, R, C, 42, 0, &err), MOE_OK);
    ck_assert_int_eq(moe_cpu_rht16(b, t, R, C, 42, 1, &err), MOE_OK);
    double worst_fwd = 0, worst_id = 0;
    for (int g = 0; g < R * C / 16; g++) {
        const float *xg = x + g * 16;
        double norm = 0, nt = 0;
        for (int k = 0; k < 16; k++)
            norm = fmax(norm, fabs(xg[k]));
        for (int j = 0; j < 16; j++) {
            double want = 0; /* (x·H·S/4)_j in double */
            for (int k = 0; k < 16; k++)
                want += xg[k] * H[k][j];
            want *= ((signs >> j) & 1 ? -0.25 : 0.25);
            worst_fwd = fmax(worst_fwd, fabs(t[g * 16 + j] - want) / norm);
            worst_id = fmax(worst_id, fabs(b[g * 16 + j] - xg[j]) / norm);
            nt += (double)t[g * 16 + j] * t[g * 16 + j];
        }
        double nx = 0;
        for (int k = 0; k < 16; k++)
            nx += (double)xg[k] * xg[k];
        ck_assert(fabs(sqrt(nt) - sqrt(nx)) <= 1e-6 * sqrt(nx)); /* orthogonal */
    }
    printf("  Hadamard: forward vs double %.2e, inverse(forward) vs identity %.2e (of the "
           "group's max)\n", worst_fwd, worst_id);
    ck_assert(worst_fwd < 1e-6 && worst_id < 1e-6);
    /* NVFP4 with the transform: the amax is the transformed tensor's, the blocks are those of
     * the transformed values, and dequantize inverts the transform */
    for (int b2 = 0; b2 < 2; b2++) {
        const moe_nvfp4_opts o = {.block_2d = b2, .rht = 1, .rht_seed = 42};
        uint8_t q[R * C / 2], sc[R * C / 16];
        moe_quant_scalars g;
        float *y = poisoned(R * C * sizeof(float));
        ck_assert_int_eq(moe_cpu_quant_nvfp4(q, sc, &g, x, R, C, &o, &err), MOE_OK);
        const moe_nvfp4_opts plain = {.block_2d = b2};
        ck_assert_uint_eq(check_nvfp4(t, R, C, &plain, q, sc, &g, NULL), 0);
        ck_assert_int_eq(moe_cpu_dequant_nvfp4(y, q, sc, &g, R, C, &o, &err), MOE_OK);
        /* the error of a group is that of its transformed values (orthogonal): at most
         * 16 × (its block's divisor)² in squares */
        const int gpr = C / 16, bh = b2 ? 16 : 1;
        for (int gi = 0; gi < R * gpr; gi++) {
            const int r = gi / gpr, gc = gi % gpr;
            const float d = moe_e4m3_decode(sc[(r / bh) * gpr + gc]) / g.scale;
            double e2 = 0;
            for (int j = 0; j < 16; j++)
                e2 += pow(y[gi * 16 + j] - x[gi * 16 + j], 2);
            ck_assert_msg(sqrt(e2) <= 4.0 * d * 1.0001, "group %d: error %g, bound %g", gi,
                          sqrt(e2), 4.0 * d);
        }
        free(y);
    }
    free(x), free(t), free(b);
}
END_TEST

START_TEST(test_stochastic_rounding) {
    enum { R = 64, C = 64, N = R * C };
    moe_error err;
    /* every block: one 6 (block scale 448, divisor 1) and fifteen 2.4 (between 2 and 3) */
    float *x = poisoned(N * sizeof(float));
    for (int i = 0; i < N; i++)
        x[i] = i % 16 == 3 ? 6.0f : (i % 2 ? 2.4f : -2.4f);
    const moe_nvfp4_opts rne = {0}, sr = {.stochastic = 1, .sr_seed = 1234};
    uint8_t q[N / 2], q2[N / 2], sc[N / 16];
    moe_quant_scalars g;
    float *y = poisoned(N * sizeof(float));
    /* nearest even: always 2 — biased by 0.4 */
    moe_cpu_quant_nvfp4(q, sc, &g, x, R, C, &rne, &err);
    moe_cpu_dequant_nvfp4(y, q, sc, &g, R, C, &rne, &err);
    ck_assert(g.scale == 448.0f && sc[0] == 0x7E && fabsf(y[0]) == 2.0f);
    /* stochastic: 2 or 3, mean 2.4 over the elements of one seed */
    memset(q, 0xAB, sizeof q);
    ck_assert_int_eq(moe_cpu_quant_nvfp4(q, sc, &g, x, R, C, &sr, &err), MOE_OK);
    moe_cpu_dequant_nvfp4(y, q, sc, &g, R, C, &sr, &err);
    double sum = 0;
    int cnt = 0, threes = 0;
    for (int i = 0; i < N; i++) {
        if (i % 16 == 3) {
            ck_assert(y[i] == 6.0f); /* on the grid: exact */
            continue;
        }
        ck_assert(fabsf(y[i]) == 2.0f || fabsf(y[i]) == 3.0f);
        ck_assert(signbit(y[i]) == signbit(x[i]));
        sum += fabsf(y[i]), cnt++, threes += fabsf(y[i]) == 3.0f;
    }
    const double mean = sum / cnt, sigma = sqrt(0.24 / cnt);
    printf("  stochastic rounding of 2.4: mean %.4f over %d elements (sigma %.4f), %d threes\n",
           mean, cnt, sigma, threes);
    ck_assert_msg(fabs(mean - 2.4) < 5 * sigma, "biased: mean %g", mean);
    /* reproducible: the same seed gives the same bytes, another seed others */
    moe_cpu_quant_nvfp4(q2, sc, &g, x, R, C, &sr, &err);
    ck_assert(memcmp(q, q2, sizeof q) == 0);
    const moe_nvfp4_opts sr2 = {.stochastic = 1, .sr_seed = 1235};
    moe_cpu_quant_nvfp4(q2, sc, &g, x, R, C, &sr2, &err);
    ck_assert(memcmp(q, q2, sizeof q) != 0);
    /* the draw counter (moe_nvfp4_opts::sr_counter, what training and CUDA graphs use): a
     * quantize advances it by one and rounds with moe_q_sr_seed(base, counter after) — the
     * same bytes as that seed given directly; the next call draws another seed */
    uint64_t ctr = 6;
    const moe_nvfp4_opts src = {.stochastic = 1, .sr_seed = 1234, .sr_counter = &ctr},
                         s7 = {.stochastic = 1, .sr_seed = moe_q_sr_seed(1234, 7)};
    moe_cpu_quant_nvfp4(q, sc, &g, x, R, C, &src, &err);
    ck_assert_uint_eq(ctr, 7);
    moe_cpu_quant_nvfp4(q2, sc, &g, x, R, C, &s7, &err);
    ck_assert(memcmp(q, q2, sizeof q) == 0);
    moe_cpu_quant_nvfp4(q2, sc, &g, x, R, C, &src, &err);
    ck_assert_uint_eq(ctr, 8);
    ck_assert(memcmp(q, q2, sizeof q) != 0);
    const moe_nvfp4_opts rne_ctr = {.sr_counter = &ctr}; /* not stochastic: no draw */
    moe_cpu_quant_nvfp4(q2, sc, &g, x, R, C, &rne_ctr, &err);
    ck_assert_uint_eq(ctr, 8);
    /* unbiased over seeds for one element, for values all over the grid */
    const float vals[] = {0.1f, 0.3f, 0.7f, 1.2f, 1.9f, 2.7f, 3.5f, 5.2f, -4.4f};
    for (size_t k = 0; k < sizeof vals / sizeof *vals; k++) {
        float xs[16] = {6.0f};
        xs[5] = vals[k];
        double s = 0, s2 = 0;
        const int seeds = 2000;
        for (int seed = 0; seed < seeds; seed++) {
            const moe_nvfp4_opts o = {.stochastic = 1, .sr_seed = (uint64_t)seed};
            uint8_t qq[8], ss;
            float yy[16];
            moe_cpu_quant_nvfp4(qq, &ss, &g, xs, 1, 16, &o, &err);
            moe_cpu_dequant_nvfp4(yy, qq, &ss, &g, 1, 16, &o, &err);
            s += yy[5], s2 += (double)yy[5] * yy[5];
        }
        const double m = s / seeds, var = s2 / seeds - m * m;
        ck_assert_msg(fabs(m - vals[k]) <= 5 * sqrt(var / seeds) + 1e-6,
                      "SR of %g over %d seeds: mean %g", (double)vals[k], seeds, m);
    }
    free(x), free(y);
}
END_TEST

/* every recipe gives the same bytes with one OpenMP thread as with all of them */
START_TEST(test_thread_count_invariant) {
#ifdef _OPENMP
    enum { R = 300, C = 512, N = R * C };
    float *x = frand(N, 500, 20.0);
    moe_error err;
    uint8_t *q[2], *s8[2];
    float *sf[2];
    moe_quant_scalars g[2];
    const int nth = omp_get_max_threads();
    for (int t = 0; t < 2; t++) {
        omp_set_num_threads(t ? nth : 1);
        q[t] = poisoned(N * 4), s8[t] = poisoned(N), sf[t] = poisoned(N);
        const moe_nvfp4_opts o = {.block_2d = 1, .stochastic = 1, .sr_seed = 3, .rht = 1,
                                  .rht_seed = 5};
        moe_cpu_quant_tensorwise(q[t], &g[t], x, N, MOE_FP8_E4M3, &err);
        moe_cpu_quant_blockwise(q[t] + N, sf[t], x, R, C, MOE_FP8_E4M3, 1, 1, &err);
        moe_cpu_quant_mxfp8(q[t] + 2 * N, s8[t], x, R, C, MOE_FP8_E4M3, &err);
        moe_cpu_quant_nvfp4(q[t] + 3 * N, s8[t] + N / 32, &g[t], x, R, C, &o, &err);
    }
    omp_set_num_threads(nth);
    ck_assert(!memcmp(q[0], q[1], N * 4) && !memcmp(s8[0], s8[1], N) &&
              !memcmp(sf[0], sf[1], N) && !memcmp(&g[0], &g[1], sizeof g[0]));
    for (int t = 0; t < 2; t++)
        free(q[t]), free(s8[t]), free(sf[t]);
    free(x);
#endif
}
END_TEST

/* the transposed copy: with 128×128 blocks it is the codes and scales transposed; with 1×128
 * tiles its scales are the amaxes of x's 128-row column segments; rows not a multiple of 128
 * are a named error */
START_TEST(test_blockwise_transpose) {
    enum { R = 256, C = 384 };
    moe_error err;
    float *x = frand(R * C, 800, 10.0);
    for (int b2 = 0; b2 < 2; b2++) {
        uint8_t *q = poisoned(R * C), *qt = poisoned(R * C);
        float *s = poisoned(R * C), *st = poisoned(R * C);
        ck_assert_int_eq(moe_cpu_quant_blockwise_t(q, s, qt, st, x, R, C, MOE_FP8_E4M3, b2, 0, &err),
                         MOE_OK);
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++)
                if (b2)
                    ck_assert_uint_eq(qt[(size_t)c * R + r], q[(size_t)r * C + c]);
        if (b2) {
            for (int br = 0; br < R / 128; br++)
                for (int bc = 0; bc < C / 128; bc++)
                    ck_assert(bits(st[bc * (R / 128) + br]) == bits(s[br * (C / 128) + bc]));
        } else {
            for (int c = 0; c < C; c++)
                for (int br = 0; br < R / 128; br++) {
                    float amax = 0;
                    for (int r = br * 128; r < br * 128 + 128; r++)
                        amax = fmaxf(amax, fabsf(x[(size_t)r * C + c]));
                    ck_assert(bits(st[(size_t)c * (R / 128) + br]) ==
                              bits(moe_q_scale_inv(moe_q_scale_from_amax(amax, 448.0f, 0))));
                }
        }
        free(q), free(qt), free(s), free(st);
    }
    ck_assert_int_eq(moe_cpu_quant_blockwise_t(NULL, NULL, NULL, NULL, x, 100, 128, MOE_FP8_E4M3,
                                               0, 0, &err),
                     MOE_ERR_CONFIG);
    ck_assert_ptr_nonnull(strstr(err.msg, "pad the tokens"));
    free(x);
}
END_TEST

/* ------------------------------------------------------------------ the GEMM */

/* every named error of moe_fp8_gemm_check(), each with the words a user needs */
START_TEST(test_fp8_gemm_check) {
    moe_error err;
    uint8_t codes[16];
    float scales[4];
    moe_quant_scalars s = {0, 1, 1};
    const moe_qmatrix tw = {.recipe = MOE_QUANT_TENSORWISE, .codes = codes, .scalars = &s};
    const moe_qmatrix b1 = {.recipe = MOE_QUANT_BLOCK_1X128, .codes = codes, .scales = scales};
    const moe_qmatrix b2 = {.recipe = MOE_QUANT_BLOCK_128X128, .codes = codes, .scales = scales};
    const moe_qmatrix mx = {.recipe = MOE_QUANT_MXFP8, .codes = codes, .scales = scales};
    const moe_qmatrix nv = {.recipe = MOE_QUANT_NVFP4, .codes = codes, .scales = scales,
                            .scalars = &s};
    moe_qmatrix nvr = nv;
    nvr.nvfp4.rht = 1;
    moe_qmatrix e5 = tw, e5b = tw, nos = b1;
    e5.format = e5b.format = MOE_FP8_E5M2;
    nos.scales = NULL;
    const struct {
        const moe_qmatrix *a, *b;
        int M, N, K;
        const char *want; /* NULL: valid */
    } cases[] = {
        {&tw, &tw, 301, 256, 512, NULL},
        {&b1, &b2, 4, 272, 1024, NULL},
        {&b1, &b1, 0, 16, 128, NULL},
        {&mx, &mx, 5, 32, 64, NULL},
        {&nv, &nv, 5, 32, 64, NULL},
        {&e5, &tw, 16, 16, 16, NULL},
        {&tw, &tw, 16, 16, 100, "not a multiple of 16"},
        {&b1, &b2, 16, 16, 192, "not a multiple of 128"},
        {&b1, &b2, 301, 16, 128, "M=301 is not a multiple of 4"},
        {&tw, &tw, 301, 16, 128, NULL},
        {&mx, &mx, 16, 16, 48, "not a multiple of 32"},
        {&nv, &nv, 16, 16, 48, "not a multiple of 32"},
        {&tw, &tw, 16, 100, 128, "N=100"},
        {&tw, &tw, -1, 16, 128, "negative shape"},
        {&tw, &b1, 16, 16, 128, "do not pair"},
        {&b2, &b2, 16, 16, 128, "do not pair"},
        {&mx, &nv, 16, 16, 128, "do not pair"},
        {&e5, &e5b, 16, 16, 128, "E5M2 x E5M2"},
        {&nv, &nvr, 16, 16, 128, "Hadamard"},
        {&nos, &b1, 16, 16, 128, "lacks"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const moe_status st =
            moe_fp8_gemm_check(cases[i].a, cases[i].b, cases[i].M, cases[i].N, cases[i].K, &err);
        if (!cases[i].want) {
            ck_assert_msg(st == MOE_OK, "case %zu: %s", i, err.msg);
        } else {
            ck_assert_msg(st == MOE_ERR_CONFIG, "case %zu accepted", i);
            ck_assert_msg(strstr(err.msg, cases[i].want), "case %zu: '%s' lacks '%s'", i, err.msg,
                          cases[i].want);
        }
    }
}
END_TEST

/* the scale layouts of moe_gemm_scale_index(): each one a bijection of the grid into its
 * buffer (no two scales on one slot, none beyond the end), the 1×128 one R-contiguous with a
 * 16-byte leading dimension, and the swizzled one equal to PyTorch's to_blocked(), written
 * here as its reshapes: pad to (128·ntr, 4·ntc), view (ntr, 128, ntc, 4), permute to
 * (ntr, ntc, 128, 4), view each tile as (4, 32, 4), swap its first two axes, flatten */
START_TEST(test_gemm_scale_layouts) {
    const int grids[][2] = {{1, 1}, {5, 3}, {128, 4}, {301, 36}, {257, 9}};
    for (int l = 0; l < 3; l++)
        for (size_t g = 0; g < sizeof grids / sizeof *grids; g++) {
            const int R = grids[g][0], C = grids[g][1];
            const size_t n = moe_gemm_scale_elems((moe_gemm_scale_layout)l, R, C);
            unsigned char *hit = calloc(n, 1);
            for (int r = 0; r < R; r++)
                for (int c = 0; c < C; c++) {
                    const size_t i = moe_gemm_scale_index((moe_gemm_scale_layout)l, r, c, R, C);
                    ck_assert_msg(i < n && !hit[i], "layout %d grid %dx%d (%d,%d)", l, R, C, r, c);
                    hit[i] = 1;
                }
            free(hit);
        }
    ck_assert_uint_eq(moe_gemm_scale_index(MOE_GEMM_SCALES_VEC128, 2, 3, 301, 36), 3 * 304 + 2);
    ck_assert_uint_eq(moe_gemm_scale_index(MOE_GEMM_SCALES_BLK128, 2, 5, 3, 9), 2 * 12 + 5);
    const int R = 257, C = 9, ntr = 3, ntc = 3;
    size_t f = 0;
    for (int tr = 0; tr < ntr; tr++)
        for (int tc = 0; tc < ntc; tc++)
            for (int j = 0; j < 32; j++)     /* the swapped axes: 32 first, then 4 */
                for (int i = 0; i < 4; i++)
                    for (int cc = 0; cc < 4; cc++, f++) {
                        const int r = tr * 128 + i * 32 + j, c = tc * 4 + cc;
                        if (r < R && c < C)
                            ck_assert_uint_eq(
                                moe_gemm_scale_index(MOE_GEMM_SCALES_SWIZZLED, r, c, R, C), f);
                    }
    ck_assert_uint_eq(f, moe_gemm_scale_elems(MOE_GEMM_SCALES_SWIZZLED, R, C));
}
END_TEST

/* the CPU twin equals Σ_k deq(a)·deq(b) in double (fp32 accumulation: 1e-5), for every
 * recipe pair, the NVFP4 transform included; and the quantized product stays near the exact
 * one (a loose bound per recipe: the quantization error, not the twin's) */
START_TEST(test_fp8_gemm_cpu_twin) {
    enum { M = 36, N = 48, K = 256 }; /* M: blockwise needs a multiple of 4 */
    const moe_quant_recipe pairs[][2] = {{MOE_QUANT_TENSORWISE, MOE_QUANT_TENSORWISE},
                                         {MOE_QUANT_BLOCK_1X128, MOE_QUANT_BLOCK_128X128},
                                         {MOE_QUANT_MXFP8, MOE_QUANT_MXFP8},
                                         {MOE_QUANT_NVFP4, MOE_QUANT_NVFP4_2D}};
    const double loose[] = {0.08, 0.08, 0.08, 0.3};
    moe_error err;
    float *x = frand(M * K, 700, 0), *w = frand(N * K, 701, 0);
    for (int p = 0; p < 4; p++) {
        uint8_t *qa = poisoned(M * K), *qb = poisoned(N * K);
        float *sa = poisoned(M * K), *sb = poisoned(N * K); /* room for any scale count */
        moe_quant_scalars ga, gb;
        const moe_nvfp4_opts oa = {.rht = 1, .rht_seed = 4}, ob = {.block_2d = 1, .rht = 1,
                                                                   .rht_seed = 4};
        moe_qmatrix a = {.recipe = pairs[p][0], .codes = qa, .scales = sa, .scalars = &ga,
                         .nvfp4 = oa};
        moe_qmatrix b = {.recipe = pairs[p][1], .codes = qb, .scales = sb, .scalars = &gb,
                         .nvfp4 = ob};
        switch (p) {
        case 0:
            moe_cpu_quant_tensorwise(qa, &ga, x, M * K, MOE_FP8_E4M3, &err);
            moe_cpu_quant_tensorwise(qb, &gb, w, N * K, MOE_FP8_E4M3, &err);
            break;
        case 1:
            moe_cpu_quant_blockwise(qa, sa, x, M, K, MOE_FP8_E4M3, 0, 0, &err);
            moe_cpu_quant_blockwise(qb, sb, w, N, K, MOE_FP8_E4M3, 1, 0, &err);
            break;
        case 2:
            moe_cpu_quant_mxfp8(qa, (uint8_t *)sa, x, M, K, MOE_FP8_E4M3, &err);
            moe_cpu_quant_mxfp8(qb, (uint8_t *)sb, w, N, K, MOE_FP8_E4M3, &err);
            break;
        default:
            moe_cpu_quant_nvfp4(qa, (uint8_t *)sa, &ga, x, M, K, &oa, &err);
            moe_cpu_quant_nvfp4(qb, (uint8_t *)sb, &gb, w, N, K, &ob, &err);
        }
        float *da = poisoned(M * K * 4), *db = poisoned(N * K * 4), *d = poisoned(M * N * 4);
        ck_assert_int_eq(moe_cpu_qmatrix_dequant(da, &a, M, K, &err), MOE_OK);
        ck_assert_int_eq(moe_cpu_qmatrix_dequant(db, &b, N, K, &err), MOE_OK);
        ck_assert_int_eq(moe_cpu_fp8_gemm(d, &a, &b, M, N, K, &err), MOE_OK);
        double worst = 0, worst_exact = 0, norm = 0;
        for (int i = 0; i < M * N; i++) {
            double deq = 0, exact = 0;
            for (int k = 0; k < K; k++) {
                deq += (double)da[(i / N) * K + k] * db[(i % N) * K + k];
                exact += (double)x[(i / N) * K + k] * w[(i % N) * K + k];
            }
            worst = fmax(worst, fabs(d[i] - deq));
            worst_exact = fmax(worst_exact, fabs(d[i] - exact));
            norm = fmax(norm, fabs(exact));
        }
        ck_assert_msg(worst <= 1e-5 * norm, "pair %d: twin vs double %g (max |D| %g)", p, worst,
                      norm);
        ck_assert_msg(worst_exact <= loose[p] * norm, "pair %d: quantized vs exact %g of %g", p,
                      worst_exact, norm);
        free(qa), free(qb), free(sa), free(sb), free(da), free(db), free(d);
    }
    free(x), free(w);
}
END_TEST

/* The FP8 grouped GEMM's CPU twin (the reference of our sm_90a kernel): on ragged groups
 * (empty, 1 row, 5 rows, 130 rows; N = 144, a partial 128×128 weight block) each row equals
 * the double-precision dot products of its dequantized row of A and its expert's dequantized
 * B_g (A 1×128 over all rows, B 128×128 per expert); and the shape rules are named errors. */
START_TEST(test_fp8_grouped_gemm_cpu_twin) {
    enum { G = 4, N = 144, K = 256, NBN = 2, KB = 2 };
    const int off[G + 1] = {0, 0, 1, 6, 136};
    const int rows = off[G];
    moe_error err;
    float *x = frand(rows * K, 710, 0), *w = frand(G * N * K, 711, 0);
    uint8_t *qa = poisoned(rows * K), *qb = poisoned(G * N * K);
    float *sa = poisoned(rows * KB * 4), *sb = poisoned(G * NBN * KB * 4);
    ck_assert_int_eq(moe_cpu_quant_blockwise(qa, sa, x, rows, K, MOE_FP8_E4M3, 0, 0, &err),
                     MOE_OK);
    for (int g = 0; g < G; g++)
        ck_assert_int_eq(moe_cpu_quant_blockwise(qb + g * N * K, sb + g * NBN * KB,
                                                 w + g * N * K, N, K, MOE_FP8_E4M3, 1, 0, &err),
                         MOE_OK);
    moe_qmatrix a = {.recipe = MOE_QUANT_BLOCK_1X128, .format = MOE_FP8_E4M3, .codes = qa,
                     .scales = sa};
    moe_qmatrix b = {.recipe = MOE_QUANT_BLOCK_128X128, .format = MOE_FP8_E4M3, .codes = qb,
                     .scales = sb};
    float *da = poisoned(rows * K * 4), *db = poisoned(G * N * K * 4), *d = poisoned(rows * N * 4);
    ck_assert_int_eq(moe_cpu_qmatrix_dequant(da, &a, rows, K, &err), MOE_OK);
    for (int g = 0; g < G; g++) {
        moe_qmatrix bg = b;
        bg.codes = qb + g * N * K;
        bg.scales = sb + g * NBN * KB;
        ck_assert_int_eq(moe_cpu_qmatrix_dequant(db + g * N * K, &bg, N, K, &err), MOE_OK);
    }
    ck_assert_int_eq(moe_cpu_fp8_grouped_gemm(d, &a, &b, off, G, rows, N, K, &err), MOE_OK);
    double worst = 0, norm = 0;
    for (int g = 0; g < G; g++)
        for (int r = off[g]; r < off[g + 1]; r++)
            for (int n = 0; n < N; n++) {
                double ref = 0;
                for (int k = 0; k < K; k++)
                    ref += (double)da[r * K + k] * db[(g * N + n) * K + k];
                worst = fmax(worst, fabs(d[r * N + n] - ref));
                norm = fmax(norm, fabs(ref));
            }
    ck_assert_msg(worst <= 1e-5 * norm, "grouped twin vs double %g (max |D| %g)", worst, norm);
    /* the named errors */
    ck_assert_int_eq(moe_cpu_fp8_grouped_gemm(d, &a, &b, off, G, rows, N, 200, &err),
                     MOE_ERR_CONFIG);
    ck_assert_ptr_nonnull(strstr(err.msg, "multiple of 128"));
    ck_assert_int_eq(moe_cpu_fp8_grouped_gemm(d, &a, &a, off, G, rows, N, K, &err),
                     MOE_ERR_CONFIG);
    moe_qmatrix e5 = a;
    e5.format = MOE_FP8_E5M2;
    ck_assert_int_eq(moe_cpu_fp8_grouped_gemm(d, &e5, &b, off, G, rows, N, K, &err),
                     MOE_ERR_CONFIG);
    ck_assert_int_eq(moe_cpu_fp8_grouped_gemm(d, &a, &b, off, G, rows, 136, K, &err),
                     MOE_ERR_CONFIG); /* N not a multiple of 16 */
    ck_assert_int_eq(moe_cpu_fp8_grouped_gemm(d, &a, &b, off, G, rows - 1, N, K, &err),
                     MOE_ERR_CONFIG); /* off[G] != rows */
    ck_assert_int_eq(moe_fp8_grouped_check(&a, &b, 0, rows, N, K, &err), MOE_ERR_CONFIG);
    free(x), free(w), free(qa), free(qb), free(sa), free(sb), free(da), free(db), free(d);
}
END_TEST

/* ------------------------------------------------------------------ QDQ (chapter 05's
 * emulated training, lowp.h) */

/* The backend's QDQ op gives, byte for byte, the recipe's quantize then dequantize; and the
 * flags pick the recipes lowp.h documents. */
START_TEST(test_qdq_matches_quant_dequant) {
    const int R = 130, C = 256; /* a partial last block of rows for the 2D recipes */
    const size_t n = (size_t)R * C;
    float *x = frand(n, 901, 12.0);
    x[5] = 0.0f; /* and a few special values */
    x[7] = -0.0f;
    size_t qb, sb;
    moe_qdq_ws_bytes(n, &qb, &sb);
    moe_qdq_ws ws = {poisoned(n * sizeof(float)), poisoned(qb), poisoned(sb),
                     poisoned(sizeof(moe_quant_scalars))};
    float *y = poisoned(n * sizeof(float)), *ref = poisoned(n * sizeof(float));
    uint8_t *q = poisoned(qb), *sc = poisoned(sb);
    moe_quant_scalars g;
    moe_error err;
    const moe_backend *be = moe_backend_cpu();
    const moe_quant_recipe recipes[] = {MOE_QUANT_TENSORWISE, MOE_QUANT_BLOCK_1X128,
                                        MOE_QUANT_BLOCK_128X128, MOE_QUANT_MXFP8,
                                        MOE_QUANT_NVFP4, MOE_QUANT_NVFP4_2D};
    for (size_t r = 0; r < sizeof recipes / sizeof recipes[0]; r++)
        for (int f = 0; f < 2; f++)
            for (int variant = 0; variant < 2; variant++) { /* pow2 / stochastic rounding */
                moe_qdq_spec sp;
                memset(&sp, 0, sizeof sp);
                sp.recipe = recipes[r];
                sp.format = (moe_fp8_format)f;
                sp.pow2 = variant;
                sp.nvfp4.stochastic = variant;
                sp.nvfp4.sr_seed = 1234 + r;
                be->qdq(y, x, R, C, &sp, &ws);
                moe_nvfp4_opts o = sp.nvfp4;
                o.block_2d = recipes[r] == MOE_QUANT_NVFP4_2D;
                switch (recipes[r]) {
                case MOE_QUANT_TENSORWISE:
                    ck_assert(moe_cpu_quant_tensorwise(q, &g, x, n, sp.format, &err) == MOE_OK);
                    ck_assert(moe_cpu_dequant_tensorwise(ref, q, &g, n, sp.format, &err) == MOE_OK);
                    break;
                case MOE_QUANT_BLOCK_1X128:
                case MOE_QUANT_BLOCK_128X128: {
                    const int b2 = recipes[r] == MOE_QUANT_BLOCK_128X128;
                    ck_assert(moe_cpu_quant_blockwise(q, (float *)sc, x, R, C, sp.format, b2,
                                                      variant, &err) == MOE_OK);
                    ck_assert(moe_cpu_dequant_blockwise(ref, q, (float *)sc, R, C, sp.format, b2,
                                                        &err) == MOE_OK);
                    break;
                }
                case MOE_QUANT_MXFP8:
                    ck_assert(moe_cpu_quant_mxfp8(q, sc, x, R, C, sp.format, &err) == MOE_OK);
                    ck_assert(moe_cpu_dequant_mxfp8(ref, q, sc, R, C, sp.format, &err) == MOE_OK);
                    break;
                default:
                    ck_assert(moe_cpu_quant_nvfp4(q, sc, &g, x, R, C, &o, &err) == MOE_OK);
                    ck_assert(moe_cpu_dequant_nvfp4(ref, q, sc, &g, R, C, &o, &err) == MOE_OK);
                }
                ck_assert_msg(memcmp(y, ref, n * sizeof(float)) == 0,
                              "recipe %d format %d variant %d: QDQ differs from quantize + "
                              "dequantize", (int)recipes[r], f, variant);
                size_t changed = 0; /* and it did quantize */
                for (size_t i = 0; i < n; i++)
                    changed += bits(y[i]) != bits(x[i]);
                ck_assert_msg(changed > n / 2, "recipe %d: only %zu of %zu values changed",
                              (int)recipes[r], changed, n);
            }
    /* in place (dst = src) as the weights are */
    moe_qdq_spec sp = {MOE_QUANT_MXFP8, MOE_FP8_E4M3, 0, {0}, {0}, 0};
    be->qdq(y, x, R, C, &sp, &ws);
    memcpy(ref, x, n * sizeof(float));
    be->qdq(ref, ref, R, C, &sp, &ws);
    ck_assert(memcmp(y, ref, n * sizeof(float)) == 0);

    /* the flags' recipes, per role (lowp.h's table) */
    const char *flags[] = {"--fp8-format e4m3 --fp8-recipe tensorwise",
                           "--fp8-format hybrid --fp8-recipe blockwise --num-query-groups 4",
                           "--fp8-format e4m3 --fp8-recipe mxfp8",
                           "--fp4-format e2m1 --fp4-recipe nvfp4", ""};
    const moe_quant_recipe want[][3] = {
        {MOE_QUANT_TENSORWISE, MOE_QUANT_TENSORWISE, MOE_QUANT_TENSORWISE},
        {MOE_QUANT_BLOCK_1X128, MOE_QUANT_BLOCK_128X128, MOE_QUANT_BLOCK_1X128},
        {MOE_QUANT_MXFP8, MOE_QUANT_MXFP8, MOE_QUANT_MXFP8},
        {MOE_QUANT_NVFP4, MOE_QUANT_NVFP4_2D, MOE_QUANT_NVFP4}};
    for (int i = 0; i < 5; i++) {
        moe_config c;
        ck_assert_msg(moe_test_config(&c, flags[i], &err) == MOE_OK, "%s", err.msg);
        moe_lowp lp;
        ck_assert(moe_lowp_from_config(&lp, &c, &err) == MOE_OK);
        ck_assert_int_eq(lp.on, i < 4);
        if (i == 4)
            break;
        for (int role = 0; role < MOE_LOWP_ROLES; role++)
            ck_assert_int_eq(lp.spec[role].recipe, want[i][role]);
        ck_assert_int_eq(lp.spec[MOE_LOWP_GRADIENT].format, i == 1 ? MOE_FP8_E5M2 : MOE_FP8_E4M3);
        ck_assert_int_eq(lp.spec[MOE_LOWP_ACTIVATION].format, MOE_FP8_E4M3);
        ck_assert_int_eq(lp.spec[MOE_LOWP_ACTIVATION].nvfp4.stochastic, 0); /* gradients only */
        ck_assert_int_eq(lp.spec[MOE_LOWP_WEIGHT].nvfp4.stochastic, 0);
        ck_assert_int_eq(lp.spec[MOE_LOWP_GRADIENT].nvfp4.stochastic, i == 3);
        ck_assert_int_eq(lp.wgrad_rht, i == 3); /* TransformerEngine's default: on */
    }
    free(x); free(y); free(ref); free(q); free(sc);
    free(ws.x); free(ws.q); free(ws.scales); free(ws.g);
}
END_TEST

/* Chapter 05, NVFP4's wgrad with the random Hadamard transform (lowp.c, "wgrad"), on the CPU
 * backend, three groups of 150, 0 and 143 tokens (padding and an empty group):
 *  - moe_lowp_wgrad() equals a double-precision reference built independently: each group's
 *    operands transposed by hand (tokens zero-padded to 16), quantized by
 *    moe_cpu_quant_nvfp4() with the transform (the gradient stochastically, with the
 *    counter's next seeds), dequantized WITHOUT the inverse, multiplied in double;
 *  - the draw counter advanced once per non-empty group (the gradients only);
 *  - the transform is orthogonal and the same for both operands, so it cancels in the
 *    product: on Gaussian data (whose distribution it leaves as it is) the error against
 *    the exact product dyᵀ·x is that of the same quantization along the tokens without the
 *    transform, within 10 % (different signs per operand, or an inverse applied to one of
 *    them, would leave an error of the order of the product itself);
 *  - on data with outliers (1 % of the elements ×30) the wgrad with the transform differs
 *    from --fp4-disable-rht's (rowwise QDQ, as the dgrad's) in most elements; the errors
 *    against the exact product are printed (with and without the transform, and
 *    --fp4-disable-rht's). They do NOT show the transform closer on such data: a block of
 *    16 whose outlier is spread by H lands all 16 values in the coarse top of the E2M1 grid,
 *    which costs as much as the small values the outlier crushes without it. */
static void outliers(moe_real *v, size_t n, uint64_t stream) {
    for (size_t i = 0; i < n; i++) {
        v[i] = (moe_real)moe_rng_normal(7, stream, i);
        if (moe_rng_bits(7, stream + 1000, i).v[0] % 100 == 0)
            v[i] *= 30;
    }
}

/* the reference wgrad of one group, in double: dw [O, I] = Σ_t dq[o][t]·xq[i][t] over the
 * padded tokens, dq and xq the dequantized (transform kept) transposed operands */
static void ref_wgrad_group(double *dw, double *abs_sum, const moe_real *dy, const moe_real *x,
                            int n, int I, int O, int rht, uint64_t rht_seed, uint64_t sr_seed) {
    const int m = (n + 15) / 16 * 16;
    float *t[2], *y[2];
    const int C[2] = {O, I};
    const moe_real *src[2] = {dy, x};
    moe_error err;
    for (int k = 0; k < 2; k++) {
        t[k] = malloc(sizeof(float) * C[k] * m);
        y[k] = malloc(sizeof(float) * C[k] * m);
        for (int c = 0; c < C[k]; c++)
            for (int r = 0; r < m; r++)
                t[k][(size_t)c * m + r] = r < n ? (float)src[k][(size_t)r * C[k] + c] : 0.0f;
        const moe_nvfp4_opts q = {.stochastic = k == 0, .sr_seed = sr_seed, .rht = rht,
                                  .rht_seed = rht_seed},
                             dq = {0}; /* no inverse transform */
        uint8_t *codes = malloc((size_t)C[k] * m / 2), *sc = malloc((size_t)C[k] * m / 16);
        moe_quant_scalars g;
        ck_assert_int_eq(moe_cpu_quant_nvfp4(codes, sc, &g, t[k], C[k], m, &q, &err), MOE_OK);
        ck_assert_int_eq(moe_cpu_dequant_nvfp4(y[k], codes, sc, &g, C[k], m, &dq, &err), MOE_OK);
        free(codes), free(sc);
    }
    for (int o = 0; o < O; o++)
        for (int i = 0; i < I; i++) {
            double acc = 0, a = 0;
            for (int r = 0; r < m; r++) {
                const double p = (double)y[0][(size_t)o * m + r] * y[1][(size_t)i * m + r];
                acc += p, a += fabs(p);
            }
            dw[(size_t)o * I + i] = acc;
            if (abs_sum)
                abs_sum[(size_t)o * I + i] = a;
        }
    for (int k = 0; k < 2; k++)
        free(t[k]), free(y[k]);
}

/* ‖a − b‖ / ‖b‖ (Frobenius) */
static double rel_err(const moe_real *a, const double *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++)
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]), den += b[i] * b[i];
    return sqrt(num / den);
}

/* ‖Q_t(dy)ᵀ·Q_t(x) − dyᵀ·x‖ / ‖dyᵀ·x‖ over one group of n tokens, the reference's
 * quantization along the tokens with or without the transform */
static double wgrad_err(const moe_real *dy, const moe_real *x, int n, int I, int O, int rht) {
    double *q = malloc(sizeof(double) * O * I), num = 0, den = 0;
    ref_wgrad_group(q, NULL, dy, x, n, I, O, rht, 4242, 99);
    for (int o = 0; o < O; o++)
        for (int i = 0; i < I; i++) {
            double e = 0;
            for (int t = 0; t < n; t++)
                e += (double)dy[(size_t)t * O + o] * x[(size_t)t * I + i];
            num += (q[(size_t)o * I + i] - e) * (q[(size_t)o * I + i] - e), den += e * e;
        }
    free(q);
    return sqrt(num / den);
}

START_TEST(test_lowp_wgrad_rht) {
    const moe_backend *be = moe_backend_cpu();
    enum { G = 3, N = 293, I = 64, O = 48 };
    const int off[G + 1] = {0, 150, 150, N};
    moe_config c;
    moe_error err;
    ck_assert_msg(moe_test_config(&c, "--fp4-format e2m1 --fp4-recipe nvfp4", &err) == MOE_OK,
                  "%s", err.msg);
    moe_lowp lp;
    ck_assert(moe_lowp_from_config(&lp, &c, &err) == MOE_OK && lp.on && lp.wgrad_rht);
    ck_assert(moe_lowp_alloc(be, &lp, (size_t)(N + 16) * I));
    moe_real *dy = malloc(sizeof(moe_real) * N * O), *x = malloc(sizeof(moe_real) * N * I);
    outliers(dy, (size_t)N * O, 11);
    outliers(x, (size_t)N * I, 12);
    const size_t nw = (size_t)G * O * I;
    moe_real *dw = malloc(sizeof(moe_real) * nw), *dw_off = malloc(sizeof(moe_real) * nw);
    double *ref = malloc(sizeof(double) * nw), *ref_norht = malloc(sizeof(double) * nw),
           *exact = malloc(sizeof(double) * nw), *abs_sum = malloc(sizeof(double) * nw);
    /* the training path */
    moe_lowp_set_sr_calls(be, &lp, 5);
    memset(dw, 0, sizeof(moe_real) * nw);
    moe_lowp_wgrad(be, &lp, dw, dy, x, off, G, I, O, 0);
    ck_assert_uint_eq(moe_lowp_sr_calls(be, &lp), 7); /* two non-empty groups' gradients */
    /* the reference, the exact product, and the same quantization without the transform */
    uint64_t draw = 5;
    for (int g = 0; g < G; g++) {
        const int n = off[g + 1] - off[g];
        double *rg = ref + (size_t)g * O * I, *ng = ref_norht + (size_t)g * O * I,
               *eg = exact + (size_t)g * O * I;
        memset(rg, 0, sizeof(double) * O * I);
        memset(ng, 0, sizeof(double) * O * I);
        memset(eg, 0, sizeof(double) * O * I);
        memset(abs_sum + (size_t)g * O * I, 0, sizeof(double) * O * I);
        if (n == 0)
            continue;
        const moe_real *dyg = dy + (size_t)off[g] * O, *xg = x + (size_t)off[g] * I;
        draw++;
        ref_wgrad_group(rg, abs_sum + (size_t)g * O * I, dyg, xg, n, I, O, 1, lp.rht_seed,
                        moe_q_sr_seed(lp.seed, draw));
        ref_wgrad_group(ng, NULL, dyg, xg, n, I, O, 0, 0, moe_q_sr_seed(lp.seed, draw));
        for (int o = 0; o < O; o++)
            for (int i = 0; i < I; i++)
                for (int t = 0; t < n; t++)
                    eg[(size_t)o * I + i] += (double)dyg[(size_t)t * O + o] * xg[(size_t)t * I + i];
    }
    /* moe_lowp_wgrad == reference up to the fp32 GEMM's sums: 1e-5 of Σ|products| */
    double worst = 0;
    for (int g = 0; g < G; g++)
        for (int o = 0; o < O; o++)
            for (int i = 0; i < I; i++) {
                const size_t k = ((size_t)g * O + o) * I + i;
                const double e = fabs((double)dw[k] - ref[k]) / (abs_sum[k] + 1e-30);
                ck_assert_msg(e < 1e-5, "dW[%d][%d][%d] = %.9g, reference %.9g", g, o, i,
                              (double)dw[k], ref[k]);
                worst = e > worst ? e : worst;
            }
    /* the training path with --fp4-disable-rht: the rowwise QDQs the dgrad uses too */
    memset(dw_off, 0, sizeof(moe_real) * nw);
    moe_lowp lo = lp;
    lo.wgrad_rht = 0;
    for (int g = 0; g < G; g++) {
        const int n = off[g + 1] - off[g];
        if (n == 0)
            continue;
        moe_real *dq = malloc(sizeof(moe_real) * n * O);
        memcpy(dq, moe_lowp_qdq(be, &lo, dy + (size_t)off[g] * O, n, O, MOE_LOWP_GRADIENT, 0),
               sizeof(moe_real) * n * O);
        const void *xq = moe_lowp_qdq(be, &lo, x + (size_t)off[g] * I, n, I,
                                      MOE_LOWP_ACTIVATION, 0);
        be->matmul_backward(NULL, dw_off + (size_t)g * O * I, dq, xq, NULL, n, I, O);
        free(dq);
    }
    const double e_rht = rel_err(dw, exact, nw), e_off = rel_err(dw_off, exact, nw);
    moe_real *tmp = malloc(sizeof(moe_real) * nw);
    for (size_t k = 0; k < nw; k++)
        tmp[k] = (moe_real)ref_norht[k];
    const double e_t = rel_err(tmp, exact, nw);
    printf("  NVFP4 wgrad with RHT == double reference (max err %.2e of the bound); relative "
           "error vs dy^T x with 1%% outliers x30: RHT %.4f, along the tokens without RHT "
           "%.4f, rowwise (--fp4-disable-rht) %.4f\n", worst / 1e-5, e_rht, e_t, e_off);
    /* Gaussian data: the transform neither helps nor hurts (orthogonal, shared) */
    enum { NG = 1024 };
    moe_real *gdy = malloc(sizeof(moe_real) * NG * O), *gx = malloc(sizeof(moe_real) * NG * I);
    for (size_t i = 0; i < (size_t)NG * O; i++)
        gdy[i] = (moe_real)moe_rng_normal(8, 1, i);
    for (size_t i = 0; i < (size_t)NG * I; i++)
        gx[i] = (moe_real)moe_rng_normal(8, 2, i);
    const double g_rht = wgrad_err(gdy, gx, NG, I, O, 1), g_no = wgrad_err(gdy, gx, NG, I, O, 0);
    printf("  Gaussian data, %d tokens: relative error vs dy^T x with RHT %.4f, without %.4f\n",
           NG, g_rht, g_no);
    ck_assert_msg(g_rht < 0.3 && fabs(g_rht - g_no) < 0.1 * g_no,
                  "Gaussian data: RHT's error %.4f, without %.4f: the transform does not cancel "
                  "in the product", g_rht, g_no);
    free(gdy), free(gx);
    size_t differ = 0;
    for (size_t k = 0; k < nw; k++)
        differ += dw[k] != dw_off[k];
    ck_assert_msg(differ > nw / 2, "only %zu of %zu dW elements differ with RHT on and off",
                  differ, nw);
    free(dy), free(x), free(dw), free(dw_off), free(ref), free(ref_norht), free(exact),
        free(tmp), free(abs_sum);
    moe_lowp_free(be, &lp);
}
END_TEST

/* Chapter 05's delayed scaling in training (lowp.h, "Delayed scaling"), the call sites'
 * contract on the CPU backend:
 *  - the first tensor at a site takes current scaling: the same bytes as the tensorwise
 *    recipe's QDQ;
 *  - moe_lowp_qdq_saved() (the backward's QDQ of a saved input) gives exactly the bytes the
 *    forward's QDQ gave and leaves the site and its history as they were;
 *  - a later tensor is cast with fmax/2^margin over the largest amax of the window BEFORE it
 *    (not its own: a larger input saturates), and its amax joins the window;
 *  - sites are found by identity: another linear's or role's site is untouched;
 *  - a weight QDQ with record = 0 replays the recorded scale. */
static moe_delayed_site site_at(const moe_lowp *lp, int linear, moe_lowp_role role) {
    moe_delayed_site s;
    memcpy(&s, lp->sites + (size_t)linear * MOE_LOWP_ROLES + role, sizeof s);
    return s;
}

START_TEST(test_lowp_delayed_sites) {
    const moe_backend *be = moe_backend_cpu();
    moe_config c;
    moe_error err;
    ck_assert_msg(moe_test_config(&c, "--fp8-format e4m3 --fp8-recipe delayed "
                                      "--fp8-amax-history-len 3 --fp8-amax-compute-algo max "
                                      "--fp8-margin 1", &err) == MOE_OK, "%s", err.msg);
    moe_lowp lp;
    ck_assert(moe_lowp_from_config(&lp, &c, &err) == MOE_OK && lp.on && lp.delayed);
    const int R = 8, C = 40;
    const size_t n = (size_t)R * C;
    ck_assert(moe_lowp_alloc(be, &lp, n) && moe_lowp_alloc_delayed(be, &lp, 2, 3));
    ck_assert_uint_eq(moe_lowp_sites(&lp), 2 * (8 + 2 * 3) * 3);
    const int o = moe_lowp_site(&lp, 1, MOE_LOWP_ATTN, 0) + 3; /* layer 1's output projection */
    ck_assert_int_eq(moe_lowp_site(&lp, 1, MOE_LOWP_EXPERTS, 2), 14 + 8 + 4);
    const float num = 448.0f / 2; /* E4M3's max over 2^margin */
    moe_real *x = malloc(sizeof(moe_real) * n), *y1 = malloc(sizeof(moe_real) * n),
             *want = malloc(sizeof(moe_real) * n);
    moe_test_randn(x, n, 71, 1.0);
    float amax1 = 0;
    for (size_t i = 0; i < n; i++)
        amax1 = fmaxf(amax1, fabsf((float)x[i]));
    /* 1. the first tensor: current scaling with the margin */
    memcpy(y1, moe_lowp_qdq(be, &lp, x, R, C, MOE_LOWP_ACTIVATION, o), sizeof(moe_real) * n);
    moe_delayed_site s = site_at(&lp, o, MOE_LOWP_ACTIVATION);
    ck_assert_int_eq(s.steps, 1);
    ck_assert_int_eq(s.pos, 1);
    ck_assert(s.amax == amax1 && s.used == num / amax1 && s.scale == num / amax1);
    moe_qdq_spec cur = lp.spec[MOE_LOWP_ACTIVATION]; /* tensorwise current scaling... */
    for (size_t i = 0; i < n; i++)
        x[i] *= 0.5; /* ...with the margin: the same codes from x/2 at fmax/amax */
    be->qdq(want, x, R, C, &cur, &lp.ws);
    for (size_t i = 0; i < n; i++)
        ck_assert_msg(y1[i] == 2 * want[i], "element %zu: %g vs %g", i, (double)y1[i],
                      2 * (double)want[i]);
    for (size_t i = 0; i < n; i++)
        x[i] *= 2;
    /* 2. the backward's QDQ of the saved input: the same bytes, nothing recorded */
    float hist[3];
    memcpy(hist, lp.history + ((size_t)o * MOE_LOWP_ROLES) * 3, sizeof hist);
    const void *y2 = moe_lowp_qdq_saved(be, &lp, x, R, C, o);
    ck_assert(memcmp(y2, y1, sizeof(moe_real) * n) == 0);
    moe_delayed_site s2 = site_at(&lp, o, MOE_LOWP_ACTIVATION);
    ck_assert(memcmp(&s2, &s, sizeof s) == 0);
    ck_assert(memcmp(hist, lp.history + ((size_t)o * MOE_LOWP_ROLES) * 3, sizeof hist) == 0);
    /* 3. a tensor 4x larger is cast with the scale of the window before it: it saturates */
    for (size_t i = 0; i < n; i++)
        x[i] *= 4;
    const moe_real *y3 = moe_lowp_qdq(be, &lp, x, R, C, MOE_LOWP_ACTIVATION, o);
    s = site_at(&lp, o, MOE_LOWP_ACTIVATION);
    ck_assert(s.used == num / amax1);            /* fmax/2^margin over max(window before) */
    ck_assert(s.scale == num / (4 * amax1));     /* the next: the window holds 4·amax1 now */
    ck_assert_int_eq(s.steps, 2);
    ck_assert_int_eq(s.pos, 2);
    int saturated = 0;
    for (size_t i = 0; i < n; i++)
        saturated += fabsf((float)y3[i]) == 448.0f * s.used_inv; /* the largest code */
    ck_assert_msg(saturated > 0, "nothing saturated");
    /* 4. other sites untouched: the same linear's gradient, another layer's, the weights */
    ck_assert_int_eq(site_at(&lp, o, MOE_LOWP_GRADIENT).steps, 0);
    ck_assert_int_eq(site_at(&lp, o - 14, MOE_LOWP_ACTIVATION).steps, 0);
    ck_assert_int_eq(site_at(&lp, o, MOE_LOWP_WEIGHT).steps, 0);
    /* 5. weights: per expert (linear + 2g), record then replay the same bytes */
    const int e0 = moe_lowp_site(&lp, 0, MOE_LOWP_EXPERTS, 0);
    moe_real *w = malloc(sizeof(moe_real) * 3 * n), *w0 = malloc(sizeof(moe_real) * 3 * n),
             *wq = malloc(sizeof(moe_real) * 3 * n);
    moe_test_randn(w0, 3 * n, 72, 0.1);
    memcpy(wq, w0, sizeof(moe_real) * 3 * n);
    moe_lowp_qdq_weight(be, &lp, wq, 3, R, C, e0, 1);
    for (int g = 0; g < 3; g++) {
        ck_assert_int_eq(site_at(&lp, e0 + 2 * g, MOE_LOWP_WEIGHT).steps, 1);
        ck_assert_int_eq(site_at(&lp, e0 + 2 * g + 1, MOE_LOWP_WEIGHT).steps, 0); /* fc2 */
    }
    moe_delayed_site before = site_at(&lp, e0 + 2, MOE_LOWP_WEIGHT);
    memcpy(w, w0, sizeof(moe_real) * 3 * n);
    moe_lowp_qdq_weight(be, &lp, w, 3, R, C, e0, 0);
    ck_assert(memcmp(w, wq, sizeof(moe_real) * 3 * n) == 0);
    moe_delayed_site after = site_at(&lp, e0 + 2, MOE_LOWP_WEIGHT);
    ck_assert(memcmp(&before, &after, sizeof before) == 0);
    free(x); free(y1); free(want); free(w); free(w0); free(wq);
    moe_lowp_free(be, &lp);
}
END_TEST

Suite *suite_quant(void) {
    const TTest *const tests[] = {test_decode_tables,       test_encode_roundtrip_and_ties,
                                  test_tensorwise,          test_delayed_scaling,
                                  test_blockwise,           test_mxfp8,
                                  test_nvfp4,               test_hadamard,
                                  test_stochastic_rounding, test_thread_count_invariant,
                                  test_blockwise_transpose, test_fp8_gemm_check,
                                  test_gemm_scale_layouts,  test_fp8_gemm_cpu_twin,
                                  test_fp8_grouped_gemm_cpu_twin,
                                  test_qdq_matches_quant_dequant, test_lowp_delayed_sites,
                                  test_lowp_wgrad_rht,      test_fp8_encode_fast};
    return moe_test_chapter_suite("quant", "ch05", tests, 19);
}
