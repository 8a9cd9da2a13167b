/**
 * @file quant_formats.h
 * @brief The low-precision number formats of chapter 05 (FP8 E4M3 and E5M2, FP4 E2M1, the
 *        E8M0 scale) and the per-block arithmetic of the quantization recipes, written once
 *        for the host and the device.
 *
 * Every function here is `static inline MOE_HOSTDEV` (like moe_adamw_update() and the
 * functions of step_scalars.h): the CPU reference (lib/cpu/quantize.c) and the CUDA kernels
 * (kernels/quantize.cu) call the very same code, so the two backends produce the same bytes.
 * Three rules make that true:
 *
 *  1. **Conversions are integer code.** Encoding reads the fp32 bit pattern and rounds with
 *     integer shifts; decoding builds the exact value from a small integer times a power of
 *     two. No `log2f`, no `ldexpf`, no library call whose last bit could differ.
 *  2. **Every float operation is one IEEE operation, rounded to nearest even.** On the device
 *     moe_q_mul() and moe_q_div() are `__fmul_rn` / `__fdiv_rn`: nvcc never fuses them into
 *     an FMA and never replaces the division by an approximation, whatever the flags. On the
 *     host, ISO C (`-std=c11`) does not contract `a*b+c` either (GCC's default in a standard
 *     mode is `-ffp-contract=off`), and x86-64 computes `float` in SSE registers, one
 *     rounding per operation. (No expression here has the a·b+c shape anyway: a product is
 *     only ever encoded, compared or multiplied again.)
 *  3. **NaN is written as a constant.** x86 and CUDA disagree on the sign and payload of a
 *     NaN produced by arithmetic, so no result here depends on one: a NaN input encodes to a
 *     fixed code, and a NaN scale is written from the bit pattern ::MOE_Q_NAN_BITS.
 *
 * The formats (OCP 8-bit floating point spec v1.0, OCP MX spec v1.0):
 *
 * | format | bits (s.e.m) | bias | max finite | smallest subnormal | specials |
 * |---|---|---|---|---|---|
 * | E4M3 | 1.4.3 | 7 | 448 (S.1111.110) | 2⁻⁹ | NaN = S.1111.111, no infinity |
 * | E5M2 | 1.5.2 | 15 | 57344 (S.11110.11) | 2⁻¹⁶ | ±inf = S.11111.00, NaN = S.11111.{01,10,11} |
 * | E2M1 | 1.2.1 | 1 | 6 (S.11.1) | 0.5 | none: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives |
 * | E8M0 | 0.8.0 | 127 | 2¹²⁷ | 2⁻¹²⁷ | 0xFF = NaN; no sign, no zero |
 *
 * Encoding from fp32 rounds to nearest, ties to even, and **saturates**: a finite value
 * beyond the largest finite one, and ±infinity, become ±max (TransformerEngine's E4M3 casts,
 * CUDA's `__NV_SATFINITE`); we apply the same rule to E5M2 and E2M1. A NaN input becomes the
 * positive NaN code (0x7F) of E4M3 and E5M2, whatever its sign; E2M1 has no NaN, and encodes
 * NaN as +0 (the recipes never ask it to: a block holding a NaN gets a NaN scale instead).
 * A value that rounds to zero keeps its sign (−0 is a code of its own).
 */
#ifndef MOE_QUANT_FORMATS_H
#define MOE_QUANT_FORMATS_H

#include <float.h>
#include <stdint.h>
#include <string.h>

#include "real.h"
#include "rng.h"

/* ------------------------------------------------------------------ fp32 bits */

/** The bit pattern of the canonical positive quiet NaN we write (0x7FC00000). */
#define MOE_Q_NAN_BITS 0x7FC00000u

/** @brief The bits of a float. @param f the float @return its IEEE-754 bit pattern */
static inline MOE_HOSTDEV uint32_t moe_q_f2u(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
#endif
}

/** @brief The float of a bit pattern. @param u IEEE-754 bits @return the float */
static inline MOE_HOSTDEV float moe_q_u2f(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/** @brief The canonical NaN (::MOE_Q_NAN_BITS), the same bits on every backend.
 *  @return NaN */
static inline MOE_HOSTDEV float moe_q_nanf(void) { return moe_q_u2f(MOE_Q_NAN_BITS); }

/** @brief @p f, or the canonical NaN when @p f is a NaN. Arithmetic on a NaN operand keeps
 *  its payload on x86 but returns 0x7FFFFFFF on CUDA; outputs that can come from such
 *  arithmetic (dequantized values, the transform of a NaN) pass through this, so the two
 *  backends agree byte for byte there too. @param f the value @return f or ::MOE_Q_NAN_BITS */
static inline MOE_HOSTDEV float moe_q_canon(float f) { return f != f ? moe_q_nanf() : f; }

/** @brief 1 when @p f is NaN or ±infinity (its exponent field is all ones).
 *  @param f the value @return 1 or 0 */
static inline MOE_HOSTDEV int moe_q_nonfinite(float f) {
    return (moe_q_f2u(f) & 0x7F800000u) == 0x7F800000u;
}

/** @brief |f| as bits: the key of the amax reductions. For |f| the unsigned order of the
 *  bits is the order of the values, and every NaN's bits are above +inf's, so the largest key
 *  of a block is its amax, NaN if the block holds one. Any order of reduction (a loop, a warp
 *  shuffle, an integer atomicMax) gives the same key. @param f the value @return |f|'s bits */
static inline MOE_HOSTDEV uint32_t moe_q_abs_key(float f) { return moe_q_f2u(f) & 0x7FFFFFFFu; }

/** @brief The amax a reduced key stands for: the value, or the canonical NaN for any NaN key
 *  (so a NaN's payload never reaches the outputs). @param key moe_q_abs_key() maximum
 *  @return the amax, ≥ 0, +inf or NaN */
static inline MOE_HOSTDEV float moe_q_key_amax(uint32_t key) {
    return key > 0x7F800000u ? moe_q_nanf() : moe_q_u2f(key);
}

/** @brief 2^k, exactly, from its bits. @param k in [−149, 127] (below −126: a subnormal)
 *  @return the power of two */
static inline MOE_HOSTDEV float moe_q_pow2f(int k) {
    return k >= -126 ? moe_q_u2f((uint32_t)(k + 127) << 23) : moe_q_u2f(1u << (k + 149));
}

/** @brief a·b, one rounding to nearest even on every backend (`__fmul_rn` on the device:
 *  never fused into an FMA). @param a factor @param b factor @return the product */
static inline MOE_HOSTDEV float moe_q_mul(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

/** @brief a+b, one rounding to nearest even on every backend (`__fadd_rn` on the device:
 *  never fused into an FMA). @param a term @param b term @return the sum */
static inline MOE_HOSTDEV float moe_q_add(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

/** @brief a/b, correctly rounded on every backend (`__fdiv_rn` on the device: never the
 *  approximate division of `-prec-div=false`). @param a dividend @param b divisor
 *  @return the quotient */
static inline MOE_HOSTDEV float moe_q_div(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}

/** @brief floor(log2(a)) of a positive finite float, from its bits (subnormals included).
 *  @param a > 0, finite @return the exponent, in [−149, 127] */
static inline MOE_HOSTDEV int moe_q_floor_log2(float a) {
    const uint32_t u = moe_q_f2u(a) & 0x7FFFFFFFu;
    const int e = (int)(u >> 23);
    if (e)
        return e - 127;
    int p = 22; /* a subnormal: the highest set bit of the mantissa */
    while (p > 0 && !((u >> p) & 1u))
        p--;
    return p - 149;
}

/* ------------------------------------------------------------------ the codecs */

/**
 * @brief Round-to-nearest-even encoding of fp32 into a small floating-point format with
 *        saturation (the one routine behind moe_e4m3_encode(), moe_e5m2_encode() and
 *        moe_e2m1_encode()).
 *
 * The fp32 value is sig · 2^(ex−23) with a 24-bit significand sig. A normal result keeps
 * the top mbits+1 bits of sig; a result below the format's smallest normal 2^(1−bias) is a
 * multiple of the subnormal step 2^(1−bias−mbits), so sig is shifted further. The dropped
 * bits decide the rounding: above half rounds up, exactly half rounds to the even neighbour.
 * The code is then (exponent field << mbits) + rounded significand, where a significand that
 * rounded up to 2^(mbits+1) carries into the exponent by itself; codes are ordered like
 * values, so saturation is one comparison with @p max_mag.
 * @param x the value  @param nbits bits of the code (8 or 4)  @param mbits mantissa bits
 * @param bias exponent bias  @param max_mag the code of the largest finite magnitude
 * @param nan_code the code of a NaN input
 * @return the code, in the low @p nbits bits
 */
static inline MOE_HOSTDEV uint32_t moe_q_encode(float x, int nbits, int mbits, int bias,
                                                uint32_t max_mag, uint32_t nan_code) {
    const uint32_t u = moe_q_f2u(x), a = u & 0x7FFFFFFFu;
    const uint32_t sign = (u >> 31) << (nbits - 1);
    if (a > 0x7F800000u)
        return nan_code;
    if (a == 0x7F800000u)
        return sign | max_mag; /* ±inf saturates */
    const int e32 = (int)(a >> 23);
    uint32_t sig = a & 0x7FFFFFu;
    int ex = -126; /* an fp32 subnormal: no implicit bit */
    if (e32) {
        sig |= 0x800000u;
        ex = e32 - 127;
    }
    const int emin = 1 - bias; /* the format's smallest normal exponent */
    int shift = 23 - mbits;
    uint32_t efield = 0; /* subnormal result: the exponent field stays 0 */
    if (ex >= emin)
        efield = (uint32_t)(ex + bias - 1);
    else
        shift += emin - ex;
    uint32_t r = 0;
    if (shift < 32) {
        const uint32_t q = sig >> shift, rem = sig & ((1u << shift) - 1u),
                       half = 1u << (shift - 1);
        r = q + (rem > half || (rem == half && (q & 1u)));
    } /* else sig < 2^24 < half: rounds to zero */
    uint32_t mag = (efield << mbits) + r;
    if (mag > max_mag)
        mag = max_mag;
    return sign | mag;
}

/**
 * @brief The exact value of a code of a small floating-point format, specials excluded
 *        (the callers handle them): (1.m)·2^(e−bias) for e > 0, (0.m)·2^(1−bias) for e = 0,
 *        computed as a small integer times a power of two (both exact, so is the product).
 * @param c the code  @param nbits bits of the code  @param mbits mantissa bits
 * @param bias exponent bias  @return the value
 */
static inline MOE_HOSTDEV float moe_q_decode(uint32_t c, int nbits, int mbits, int bias) {
    const uint32_t mag = c & ((1u << (nbits - 1)) - 1u);
    const int e = (int)(mag >> mbits);
    const uint32_t m = mag & ((1u << mbits) - 1u);
    const float v = e ? moe_q_mul((float)((1u << mbits) | m), moe_q_pow2f(e - bias - mbits))
                      : moe_q_mul((float)m, moe_q_pow2f(1 - bias - mbits));
    return (c >> (nbits - 1)) & 1u ? -v : v;
}

/** Largest finite E4M3 value. */
#define MOE_E4M3_MAX 448.0f
/** Largest finite E5M2 value. */
#define MOE_E5M2_MAX 57344.0f
/** Largest E2M1 value. */
#define MOE_E2M1_MAX 6.0f
/** The E4M3 NaN code we write (S.1111.111 with S = 0). */
#define MOE_E4M3_NAN 0x7Fu
/** The E5M2 NaN code we write (S.11111.11 with S = 0). */
#define MOE_E5M2_NAN 0x7Fu
/** The E4M3 code of 1.0 (the scale of an all-zero NVFP4 block). */
#define MOE_E4M3_ONE 0x38u
/** The E8M0 code of 2⁰ = 1 (the scale of an all-zero MXFP8 block). */
#define MOE_E8M0_ONE 127u
/** The E8M0 NaN code. */
#define MOE_E8M0_NAN 0xFFu

/** @brief fp32 → E4M3 (OCP "fn"): nearest even, saturating at ±448, NaN → 0x7F.
 *  @param x the value @return the code */
static inline MOE_HOSTDEV uint8_t moe_e4m3_encode(float x) {
    return (uint8_t)moe_q_encode(x, 8, 3, 7, 0x7Eu, MOE_E4M3_NAN);
}

/** @brief E4M3 → fp32, exact; S.1111.111 → NaN (::MOE_Q_NAN_BITS with the code's sign).
 *  @param c the code @return the value */
static inline MOE_HOSTDEV float moe_e4m3_decode(uint8_t c) {
    if ((c & 0x7Fu) == 0x7Fu)
        return moe_q_u2f(MOE_Q_NAN_BITS | ((uint32_t)(c >> 7) << 31));
    return moe_q_decode(c, 8, 3, 7);
}

/** @brief fp32 → E5M2: nearest even, saturating at ±57344 (±inf too), NaN → 0x7F.
 *  @param x the value @return the code */
static inline MOE_HOSTDEV uint8_t moe_e5m2_encode(float x) {
    return (uint8_t)moe_q_encode(x, 8, 2, 15, 0x7Bu, MOE_E5M2_NAN);
}

/** @brief E5M2 → fp32, exact; S.11111.00 → ±inf, S.11111.{01,10,11} → NaN.
 *  @param c the code @return the value */
static inline MOE_HOSTDEV float moe_e5m2_decode(uint8_t c) {
    const uint32_t s = (uint32_t)(c >> 7) << 31;
    if ((c & 0x7Cu) == 0x7Cu)
        return moe_q_u2f((c & 0x03u) ? (MOE_Q_NAN_BITS | s) : (0x7F800000u | s));
    return moe_q_decode(c, 8, 2, 15);
}

/** @brief fp32 → E2M1 (4-bit code in the low nibble): nearest even, saturating at ±6;
 *  NaN → 0 (+0: E2M1 has no NaN). @param x the value @return the code, 0..15 */
static inline MOE_HOSTDEV uint8_t moe_e2m1_encode(float x) {
    return (uint8_t)moe_q_encode(x, 4, 1, 1, 0x7u, 0u);
}

/** @brief E2M1 → fp32, exact. @param c the code (low nibble) @return the value */
static inline MOE_HOSTDEV float moe_e2m1_decode(uint8_t c) { return moe_q_decode(c & 0xFu, 4, 1, 1); }

/** @brief E8M0 → fp32: 2^(c−127) exactly (c = 0 is the subnormal 2⁻¹²⁷), 0xFF → NaN.
 *  @param c the code @return the scale */
static inline MOE_HOSTDEV float moe_e8m0_decode(uint8_t c) {
    return c == MOE_E8M0_NAN ? moe_q_nanf() : moe_q_pow2f((int)c - 127);
}

/** @brief The E8M0 code of 2^e. E8M0 scales are made from an exponent, never rounded from
 *  a float: e is clamped to the format's range [−127, 127]. @param e the exponent
 *  @return the code, 0..254 */
static inline MOE_HOSTDEV uint8_t moe_e8m0_from_exp(int e) {
    return (uint8_t)((e < -127 ? -127 : e > 127 ? 127 : e) + 127);
}

/* ------------------------------------------------------- the recipes' arithmetic */

/** Which FP8 format a recipe's elements use. */
typedef enum moe_fp8_format {
    MOE_FP8_E4M3 = 0, /**< 4 exponent bits, 3 mantissa bits, max 448 */
    MOE_FP8_E5M2 = 1  /**< 5 exponent bits, 2 mantissa bits, max 57344 */
} moe_fp8_format;

/** @brief Encode in format @p f. @param x the value @param f the format @return the code */
static inline MOE_HOSTDEV uint8_t moe_fp8_encode(float x, moe_fp8_format f) {
    return f == MOE_FP8_E5M2 ? moe_e5m2_encode(x) : moe_e4m3_encode(x);
}

/** @brief Decode in format @p f. @param c the code @param f the format @return the value */
static inline MOE_HOSTDEV float moe_fp8_decode(uint8_t c, moe_fp8_format f) {
    return f == MOE_FP8_E5M2 ? moe_e5m2_decode(c) : moe_e4m3_decode(c);
}

/**
 * @brief fp32 → FP8 in format @p f in about ten branch-free operations (the magnitude),
 *        with moe_fp8_encode_fast() equal to
 *        moe_fp8_encode() for EVERY input bit pattern (tests/test_quant.c,
 *        test_fp8_encode_fast: every magnitude in both formats; all 2³² inputs were compared
 *        when it was written): the encoder of the kernels
 *        whose speed is the cast's (kernels/quantize_group_t.cu), where moe_q_encode()'s
 *        general shifts and branches cost some forty integer operations an element.
 *
 * With a = |x|'s bits and m the format's mantissa bits (3 or 2), bias 7 or 15:
 *  - a normal result (|x| ≥ 2^(1−bias)): fp32's exponent and top m mantissa bits, read as one
 *    integer a >> (23−m), are the code up to the exponent's rebias (127 − bias) << m; adding
 *    half − 1 plus the kept part's lowest bit before the shift rounds to nearest even (a
 *    carry out of the mantissa moves into the exponent, as a code's should), and the rebias
 *    is subtracted in the same addition (a ≥ 2^(1−bias) keeps it non-negative);
 *  - a subnormal result (|x| < 2^(1−bias), fp32 subnormals and 0 included): the code counts
 *    steps of 2^(1−bias−m); the magic number M = 2^(23 + 1−bias−m) has exactly that step as
 *    its ulp, so the one IEEE addition |x| + M rounds |x| to nearest even steps, and the
 *    bits of the sum minus M's are the count (a count of 2^m is the smallest normal code,
 *    as it should be). A device that flushes subnormal inputs (-ftz) gets 0 both ways;
 *  - then saturation at the largest finite code (inf included).
 * moe_fp8_encode_fast() adds the sign and NaN → 0x7F; a kernel whose values are known finite
 * may call this half alone and add the signs 4 codes at a time.
 * @param a |x|'s bits, at most +inf's (0x7F800000: not a NaN)  @param f the format
 * @return the code's magnitude (its low 7 bits)
 */
static inline MOE_HOSTDEV uint32_t moe_fp8_encode_fast_mag(uint32_t a, moe_fp8_format f) {
    const int e5 = f == MOE_FP8_E5M2;
    const int sh = e5 ? 21 : 20;                              /* 23 − m */
    const uint32_t rebias = e5 ? 448u : 960u;                 /* (127 − bias) << m */
    const uint32_t tiny = e5 ? 0x38800000u : 0x3C800000u;     /* 2^(1 − bias) */
    const uint32_t magic = e5 ? 0x43000000u : 0x46800000u;    /* M: 2^7 or 2^14 */
    const uint32_t max_mag = e5 ? 0x7Bu : 0x7Eu;
    const uint32_t nrm = (a + ((1u << (sh - 1)) - 1u - (rebias << sh)) + ((a >> sh) & 1u)) >> sh;
    const uint32_t sub = moe_q_f2u(moe_q_add(moe_q_u2f(a), moe_q_u2f(magic))) - magic;
    const uint32_t mag = a < tiny ? sub : nrm;
    return mag > max_mag ? max_mag : mag;
}

/** @brief fp32 → FP8, moe_fp8_encode_fast_mag()'s magnitude with the sign, NaN → 0x7F.
 *  @param x the value  @param f the format  @return the code */
static inline MOE_HOSTDEV uint8_t moe_fp8_encode_fast(float x, moe_fp8_format f) {
    const uint32_t u = moe_q_f2u(x), a = u & 0x7FFFFFFFu;
    return a > 0x7F800000u ? (uint8_t)0x7Fu
                           : (uint8_t)(((u >> 24) & 0x80u) | moe_fp8_encode_fast_mag(a, f));
}

/** @brief The largest finite value of @p f. @param f the format @return 448 or 57344 */
static inline MOE_HOSTDEV float moe_fp8_max(moe_fp8_format f) {
    return f == MOE_FP8_E5M2 ? MOE_E5M2_MAX : MOE_E4M3_MAX;
}

/** @brief The exponent of @p f's largest power of two (emax_elem of the OCP MX spec):
 *  8 for E4M3 (448 = 1.75·2⁸), 15 for E5M2. @param f the format @return emax_elem */
static inline MOE_HOSTDEV int moe_fp8_emax(moe_fp8_format f) { return f == MOE_FP8_E5M2 ? 15 : 8; }

/**
 * @brief The quantization scale of a block (or tensor) whose largest magnitude is @p amax:
 *        fmax / amax, so that amax lands on the format's largest value.
 *
 * - amax NaN or infinite: NaN (the block is poisoned: its codes are 0 and it dequantizes to
 *   NaN, so the non-finite value is not hidden behind a saturated code);
 * - amax = 0: 1 (nothing to scale; no division by zero);
 * - fmax / amax overflows fp32 (amax below about fmax / 3.4e38): FLT_MAX, as
 *   TransformerEngine does;
 * - @p pow2: the scale rounded DOWN to a power of two (its mantissa bits cleared), so that
 *   amax·scale ≤ fmax still holds and scale and 1/scale are exact.
 * @param amax the block's amax (≥ 0, inf or NaN)  @param fmax the format's largest value
 * @param pow2 1: round down to a power of two  @return the scale
 */
static inline MOE_HOSTDEV float moe_q_scale_from_amax(float amax, float fmax, int pow2) {
    if (moe_q_nonfinite(amax))
        return moe_q_nanf();
    if (amax == 0.0f)
        return 1.0f;
    float s = moe_q_div(fmax, amax);
    if (s > FLT_MAX)
        s = FLT_MAX;
    if (pow2)
        s = moe_q_u2f(moe_q_f2u(s) & 0xFF800000u);
    return s;
}

/** @brief The dequantization scale 1/scale (what a GEMM multiplies by); NaN stays NaN.
 *  @param scale a moe_q_scale_from_amax() result @return 1/scale */
static inline MOE_HOSTDEV float moe_q_scale_inv(float scale) {
    return moe_q_nonfinite(scale) ? moe_q_nanf() : moe_q_div(1.0f, scale);
}

/** @brief One element of a recipe with an fp32 scale: cast(x·scale), or 0 when the scale
 *  is NaN (a poisoned block). @param x the value @param scale the block's scale
 *  @param f the format @return the code */
static inline MOE_HOSTDEV uint8_t moe_q_cast_scaled(float x, float scale, moe_fp8_format f) {
    return moe_q_nonfinite(scale) ? (uint8_t)0 : moe_fp8_encode(moe_q_mul(x, scale), f);
}

/** @brief One dequantized element: value·scale (a decoded code times its block's
 *  dequantization scale), NaN canonical. @param value the decoded code @param scale_inv the
 *  block's dequantization scale @return the product */
static inline MOE_HOSTDEV float moe_q_dequant(float value, float scale_inv) {
    return moe_q_canon(moe_q_mul(value, scale_inv));
}

/**
 * @brief The MXFP8 shared scale of a 32-element block (OCP MX spec v1.0, section 6.3):
 *        X = 2^(floor(log2(amax)) − emax_elem), as an E8M0 code.
 *
 * The block's largest element then becomes amax / X ∈ [2^emax_elem, 2^(emax_elem+1)), which
 * for E4M3 is [256, 512): values above 448 saturate to 448 (the spec's rule clips up to 12.5%
 * of the largest magnitude). TransformerEngine's MXFP8 kernels differ here: they round
 * amax/448 UP to a power of two, so nothing saturates, at the price of one bit of range.
 * amax = 0 gives 2⁰ (::MOE_E8M0_ONE); NaN or inf gives ::MOE_E8M0_NAN; the exponent is
 * clamped to E8M0's [−127, 127].
 * @param amax the block's amax  @param f the element format  @return the E8M0 code
 */
static inline MOE_HOSTDEV uint8_t moe_mx_scale_code(float amax, moe_fp8_format f) {
    if (moe_q_nonfinite(amax))
        return (uint8_t)MOE_E8M0_NAN;
    if (amax == 0.0f)
        return (uint8_t)MOE_E8M0_ONE;
    return moe_e8m0_from_exp(moe_q_floor_log2(amax) - moe_fp8_emax(f));
}

/** @brief One MXFP8 element: cast(x / X) with X = 2^(code−127) (a multiplication by 2^(127−code),
 *  exact but for the final rounding), or 0 when the scale is NaN.
 *  @param x the value @param code the block's E8M0 code @param f the format @return the code */
static inline MOE_HOSTDEV uint8_t moe_mx_cast(float x, uint8_t code, moe_fp8_format f) {
    if (code == MOE_E8M0_NAN)
        return 0;
    return moe_fp8_encode(moe_q_mul(x, moe_q_pow2f(127 - (int)code)), f);
}

/** NVFP4's global scale numerator: E4M3's max times E2M1's max, 448·6. */
#define MOE_NVFP4_GLOBAL_NUM 2688.0f

/**
 * @brief The E4M3 scale of an NVFP4 block: (block_amax / 6) · global_scale, cast to E4M3
 *        (nearest even, saturating at 448).
 *
 * global_scale = 448·6 / tensor_amax (moe_q_scale_from_amax(amax, 2688, 0)) maps the
 * tensor's largest block scale onto E4M3's largest value. A NaN global scale (a non-finite
 * value in the tensor) gives ::MOE_E4M3_NAN; an all-zero block gives 1.0
 * (::MOE_E4M3_ONE). A tiny block next to a large tensor amax can round to the E4M3 code 0
 * (block_amax below about 2⁻¹⁰·tensor_amax/448): its elements are then written as 0.
 * @param block_amax the block's amax  @param global_scale the tensor's global scale
 * @return the E4M3 code
 */
static inline MOE_HOSTDEV uint8_t moe_nvfp4_scale_code(float block_amax, float global_scale) {
    if (moe_q_nonfinite(global_scale))
        return (uint8_t)MOE_E4M3_NAN;
    if (block_amax == 0.0f)
        return (uint8_t)MOE_E4M3_ONE;
    return moe_e4m3_encode(moe_q_mul(moe_q_div(block_amax, MOE_E2M1_MAX), global_scale));
}

/** @brief The divisor of an NVFP4 block's elements: decoded block scale / global scale
 *  (element = x / divisor). 0 when the elements must be written as 0: the block scale is 0
 *  (an underflow) or NaN (a poisoned tensor). @param code the block's E4M3 code
 *  @param global_scale the tensor's global scale @return the divisor, or 0 */
static inline MOE_HOSTDEV float moe_nvfp4_divisor(uint8_t code, float global_scale) {
    const float d = moe_e4m3_decode(code);
    if (moe_q_nonfinite(d) || d == 0.0f)
        return 0.0f;
    return moe_q_div(d, global_scale);
}

/** The E2M1 magnitudes, indexed by their 3-bit code. */
#define MOE_E2M1_GRID {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f}

/**
 * @brief Stochastic rounding to E2M1: v rounds to one of its two neighbours lo ≤ |v| < hi on
 *        the E2M1 grid, to hi with probability (|v| − lo)/(hi − lo), so that the expected
 *        value is v (unbiased); |v| ≥ 6 saturates to 6.
 *
 * The probability is compared with 24 random bits: hi when rnd24·2⁻²⁴ < (|v|−lo)/(hi−lo). The
 * subtraction is exact (Sterbenz: lo ≤ |v| ≤ 2·lo for lo ≥ 0.5), the division is one rounded
 * operation, and the random bits come from the counter-based RNG (rng.h), so the CPU and the
 * GPU make the same choice for the same seed and element.
 * @param v the scaled value (finite)  @param rnd24 24 random bits (0 .. 2²⁴−1)
 * @return the E2M1 code
 */
static inline MOE_HOSTDEV uint8_t moe_e2m1_encode_sr(float v, uint32_t rnd24) {
    const float grid[8] = MOE_E2M1_GRID;
    const uint8_t sign = (moe_q_f2u(v) >> 31) ? 0x8u : 0x0u;
    const float a = moe_q_u2f(moe_q_abs_key(v));
    if (!(a < MOE_E2M1_MAX))
        return (uint8_t)(sign | 0x7u);
    int lo = 0;
    while (lo < 6 && grid[lo + 1] <= a)
        lo++;
    const float frac = moe_q_div(a - grid[lo], grid[lo + 1] - grid[lo]);
    const float u = moe_q_mul((float)rnd24, moe_q_pow2f(-24));
    return (uint8_t)(sign | (u < frac ? lo + 1 : lo));
}

/** The RNG stream of NVFP4's stochastic rounding (rng.h: seed, stream, counter). */
#define MOE_Q_STREAM_SR 0x51A7u
/** The RNG stream of the random Hadamard transform's signs. */
#define MOE_Q_STREAM_RHT 0x4AD3u

/** @brief The 24 random bits of element @p i of a stochastically rounded tensor: word i mod 4
 *  of Philox block i/4 under (seed, ::MOE_Q_STREAM_SR), top 24 bits.
 *  @param seed the rounding seed @param i the element's row-major index @return 24 bits */
static inline MOE_HOSTDEV uint32_t moe_q_sr_bits(uint64_t seed, uint64_t i) {
    return moe_rng_bits(seed, MOE_Q_STREAM_SR, i >> 2).v[i & 3] >> 8;
}

/** @brief The stochastic rounding's seed of draw @p n from base seed @p base: base + n·φ·2⁶⁴
 *  (the golden-ratio increment, so consecutive draws' seeds are far apart). The emulated
 *  training path (lib/lowp.h) rounds its n-th gradient quantization with it; the counter n
 *  lives in backend memory (moe_nvfp4_opts::sr_counter).
 *  @param base the base seed  @param n the draw (1 for the first)  @return the seed */
static inline MOE_HOSTDEV uint64_t moe_q_sr_seed(uint64_t base, uint64_t n) {
    return base + 0x9E3779B97F4A7C15ull * n;
}

/**
 * @brief One NVFP4 element: x / divisor cast to E2M1, to nearest even or stochastically
 *        (with the bits of element @p idx under @p seed), or 0 when the divisor is 0
 *        (moe_nvfp4_divisor(): an underflowed or poisoned block).
 * @param x the (transformed) value  @param d the block's divisor
 * @param stochastic 1: stochastic rounding  @param seed its seed
 * @param idx the element's row-major index in the tensor  @return the 4-bit code
 */
static inline MOE_HOSTDEV uint8_t moe_nvfp4_cast(float x, float d, int stochastic, uint64_t seed,
                                                 uint64_t idx) {
    if (d == 0.0f)
        return 0;
    const float v = moe_q_div(x, d);
    return stochastic ? moe_e2m1_encode_sr(v, moe_q_sr_bits(seed, idx)) : moe_e2m1_encode(v);
}

/** @brief The 16 random signs of the Hadamard transform for @p seed: bit j of the result set
 *  means sign j is −1 (the low 16 bits of word 0 of Philox block 0 of ::MOE_Q_STREAM_RHT).
 *  @param seed the transform's seed @return the sign bits */
static inline MOE_HOSTDEV uint32_t moe_q_rht_signs(uint64_t seed) {
    return moe_rng_bits(seed, MOE_Q_STREAM_RHT, 0).v[0] & 0xFFFFu;
}

/**
 * @brief The random Hadamard transform of one 16-element group, in place, as a row vector:
 *        forward v ← v·(H·S)/4, inverse v ← v·(S·H)/4, where H is the 16×16 Sylvester
 *        Hadamard matrix (entries ±1, H = Hᵀ, H·Hᵀ = 16·I) and S = diag(±1) the signs.
 *
 * (H·S)/4 is orthogonal, so the inverse is its transpose (S·H)/4 and a GEMM whose two
 * operands are both transformed along their shared dimension gives the same product
 * (TransformerEngine's NVFP4 recipe does this to the wgrad GEMM's inputs). v·H is computed by
 * the fast Walsh–Hadamard butterfly (4 stages of a+b, a−b), the same order on every backend;
 * the division by 4 and the signs are exact. A NaN comes out as the canonical NaN (with the
 * sign of its slot), whatever its payload.
 * @param v the 16 values  @param signs moe_q_rht_signs()  @param inverse 0: forward
 */
static inline MOE_HOSTDEV void moe_q_rht16(float *v, uint32_t signs, int inverse) {
    if (inverse)
        for (int j = 0; j < 16; j++)
            if ((signs >> j) & 1u)
                v[j] = -v[j];
    for (int h = 1; h < 16; h <<= 1)
        for (int i = 0; i < 16; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const float a = v[j], b = v[j + h];
                v[j] = a + b;
                v[j + h] = a - b;
            }
    for (int j = 0; j < 16; j++) {
        v[j] = moe_q_canon(moe_q_mul(v[j], 0.25f));
        if (!inverse && ((signs >> j) & 1u))
            v[j] = -v[j];
    }
}

#endif /* MOE_QUANT_FORMATS_H */
