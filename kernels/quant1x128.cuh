/*
 * One 1×128 tile (chapter 05's activation and gradient recipe) held by a half-warp, 8
 * consecutive elements per lane: the shared step of the vectorized quantizer
 * (kernels/quantize.cu) and of the kernels that quantize what they have just computed
 * (kernels/swiglu_quant.cu). A lane moves its 8 elements with one 16-byte load (bf16) and
 * stores its 8 codes as one 8-byte word, where the old quantizer moved 2-byte elements.
 *
 * Bit-identical to the CPU (lib/cpu/quantize.c): the amax is a maximum of integer keys
 * (moe_q_abs_key), so the 4-step xor butterfly over the half-warp gives the CPU loop's
 * answer in any order, and the scale, the casts and the dequantization are the MOE_HOSTDEV
 * functions of lib/quantize.h the CPU calls.
 *
 * Every lane of the warp must call moe_q1x128_tile8 (it shuffles with the full mask); a lane
 * without a tile passes zeros and ignores what it gets.
 *
 * moe_q1x128_tile8_fast is the same tile in cheaper instructions, for the 1×128 quantizer's
 * third kernel (kernels/quantize.cu, block1x128_v3_kernel), whose speed is the cast's: the
 * format a template parameter (its constants folded), the cast by moe_fp8_encode_fast()
 * (about ten operations where moe_fp8_encode() takes some forty; equal to it on every input:
 * tests/test_quant.c, test_fp8_encode_fast) and the dequantized copy's decode by the
 * hardware's FP8 → f16 conversion, two codes an instruction (exact: every E4M3 and E5M2
 * value is an f16 value); optionally (HW) the cast by the hardware's fp32x2 → FP8x2
 * conversion, two an instruction, which on the finite values the tile casts is the same
 * rule (moe_fp8x2_encode_hw). The amax, the scale, 1/scale, the product x·scale, the product
 * decode·(1/scale) and its bf16 rounding are moe_q1x128_tile8's functions (the NaN
 * canonicalization per tile, see below), so without HW its bytes are moe_q1x128_tile8's by
 * construction, and with HW by the conversion's definition, checked on all 2³² inputs.
 */
#ifndef MOE_QUANT1X128_CUH
#define MOE_QUANT1X128_CUH

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "cuda_common.cuh"
#include "quantize.h"

/** Elements of a 1×128 tile per lane: 16 lanes (a half-warp) cover a tile. */
#define MOE_Q1X128_PER_LANE 8

/** max of a key over the 16 lanes of each half-warp (every lane gets its half's) */
static __device__ __forceinline__ uint32_t moe_q_halfwarp_max_key(uint32_t m) {
#pragma unroll
    for (int off = 8; off; off >>= 1) {
        const uint32_t o = __shfl_xor_sync(0xffffffffu, m, off);
        m = o > m ? o : m;
    }
    return m;
}

/** The scale of this lane's half-warp tile from its 8 elements @p v (the amax over the 16
 *  lanes, moe_q_scale_from_amax), its inverse into @p si. Both 1×128 tile functions below
 *  start with it. */
static __device__ __forceinline__ float moe_q1x128_scale8(const float v[8], float fmax, int pow2,
                                                         float *si) {
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const uint32_t key = moe_q_abs_key(v[k]);
        m = key > m ? key : m;
    }
    m = moe_q_halfwarp_max_key(m);
    const float scale = moe_q_scale_from_amax(moe_q_key_amax(m), fmax, pow2);
    *si = moe_q_scale_inv(scale);
    return scale;
}

/**
 * Quantize this lane's 8 elements @p v of its half-warp's tile: the packed codes into
 * @p codes (element k in byte k, little-endian: the memory order), and with @p deq the
 * dequantized values rounded to bf16 (moe_cuda_qdq's bytes). Returns the tile's 1/scale.
 */
static __device__ __forceinline__ float moe_q1x128_tile8(const float v[8], uint2 *codes,
                                                         moe_bf16x8 *deq, moe_fp8_format f,
                                                         int pow2) {
    float si;
    const float scale = moe_q1x128_scale8(v, moe_fp8_max(f), pow2, &si);
    uint32_t w[2] = {0, 0};
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const uint8_t c = moe_q_cast_scaled(v[k], scale, f);
        w[k / 4] |= (uint32_t)c << (8 * (k % 4));
        if (deq)
            deq->h[k] = moe_st(moe_q_dequant(moe_fp8_decode(c, f), si));
    }
    *codes = make_uint2(w[0], w[1]);
    return si;
}

/**
 * The exact values of two FP8 codes of format @p F (@p pair: the first code in its low byte)
 * as fp32: cvt.rn.f16x2.{e4m3,e5m2}x2 then f16 → f32, both exact (E4M3's range 2⁻⁹ .. 448
 * and E5M2's are f16 values, signed zeros and E5M2's infinities included), so for every code
 * that is not a NaN the value is moe_fp8_decode()'s; a NaN code gives a NaN (f16's canonical
 * one, where moe_fp8_decode() keeps the code's sign), which moe_q_dequant() canonicalizes
 * all the same.
 */
template <moe_fp8_format F>
static __device__ __forceinline__ float2 moe_fp8x2_decode(uint32_t pair) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(pair & 0xFFFFu),
                                                     F == MOE_FP8_E5M2 ? __NV_E5M2 : __NV_E4M3);
    return __half22float2(__half2(h));
}

/**
 * Two fp32 values to two FP8 codes of format @p F (the first in the low byte) by the
 * hardware's cvt.rn.satfinite.{e4m3,e5m2}x2.f32: round to nearest even, values beyond the
 * largest finite one (and ±infinity) to ±max. On every input but a NaN that is
 * moe_fp8_encode()'s rule (fp32 subnormals, flushed or not, round to a zero of their sign
 * either way: the formats' smallest steps are 2⁻⁹ and 2⁻¹⁶); only a NaN differs (the
 * hardware may keep its sign), and moe_q1x128_tile8_fast never casts one: a tile holding a
 * NaN or an infinity has a NaN scale, and its codes are written as 0. The exhaustive check
 * over all 2³² inputs but the NaNs is moe_cuda_fp8_cast_check (tests/gpu_fp8_fused.c).
 */
template <moe_fp8_format F>
static __device__ __forceinline__ uint32_t moe_fp8x2_encode_hw(float lo, float hi) {
    return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE,
                                    F == MOE_FP8_E5M2 ? __NV_E5M2 : __NV_E4M3);
}

/**
 * This lane's 8 elements @p v of a block whose scale is @p scale (its inverse @p si) cast to
 * FP8 format @p F: the packed codes into @p codes (element k in byte k, little-endian: the
 * memory order) and, when @p DEQ, their dequantized values rounded to bf16 into @p deq.
 * @p HW: the casts by the hardware (moe_fp8x2_encode_hw), else by moe_fp8_encode_fast. A
 * non-finite scale (a poisoned block) gives zero codes and NaN copies, moe_q_cast_scaled's
 * and moe_q_dequant's rule. The 1×128 tile below and the 128×128 blocks of
 * kernels/quantize.cu (the weights) share it.
 *
 * Why the copy skips moe_q_dequant's NaN canonicalization per element: in a block whose
 * scale is finite every value is finite, so every code is a finite value's (the casts
 * saturate; only a NaN input gives a NaN code), its decode is finite, 1/scale is finite and
 * positive, and decode·(1/scale) is never NaN: the canonicalization is the identity. In a
 * poisoned block (NaN scale, so NaN 1/scale) every product is NaN and the copy is
 * moe_st(moe_q_nanf()) throughout, which is what it writes then.
 */
template <moe_fp8_format F, bool DEQ, bool HW>
static __device__ __forceinline__ void moe_q_cast8_fast(const float v[8], float scale, float si,
                                                        uint2 *codes, moe_bf16x8 *deq) {
    /* moe_q_cast_scaled: 0 for a NaN scale (a poisoned block), else the cast of x·scale */
    const bool poisoned = moe_q_nonfinite(scale);
    uint32_t w[2] = {0, 0};
    if (HW)
#pragma unroll
        for (int k = 0; k < 8; k += 2)
            w[k / 4] |= moe_fp8x2_encode_hw<F>(moe_q_mul(v[k], scale),
                                               moe_q_mul(v[k + 1], scale))
                        << (8 * (k % 4));
    else
#pragma unroll
        for (int k = 0; k < 8; k++)
            w[k / 4] |= (uint32_t)moe_fp8_encode_fast(moe_q_mul(v[k], scale), F)
                        << (8 * (k % 4));
    if (poisoned)
        w[0] = w[1] = 0;
    if (DEQ) {
        uint32_t *out = (uint32_t *)&deq->u;
#pragma unroll
        for (int k = 0; k < 8; k += 2) {
            const float2 d = moe_fp8x2_decode<F>(w[k / 4] >> (8 * (k % 4)));
            /* moe_st of each (the same rn conversion, two at a time) */
            const __nv_bfloat162 h = __floats2bfloat162_rn(moe_q_mul(d.x, si),
                                                           moe_q_mul(d.y, si));
            out[k / 2] = *(const uint32_t *)&h;
        }
        if (poisoned) {
            const uint32_t nan1 = __bfloat16_as_ushort(moe_st(moe_q_nanf()));
#pragma unroll
            for (int j = 0; j < 4; j++)
                out[j] = nan1 | nan1 << 16;
        }
    }
    *codes = make_uint2(w[0], w[1]);
}

/**
 * moe_q1x128_tile8 of format @p F, with the dequantized copy when @p DEQ (then @p deq is
 * written), in fewer instructions (see the header): the same bytes. @p HW: the casts by the
 * hardware (moe_fp8x2_encode_hw), else by moe_fp8_encode_fast (moe_q_cast8_fast). Returns
 * the tile's 1/scale. Every lane of the warp must call it (the amax shuffles with the full
 * mask).
 */
template <moe_fp8_format F, bool DEQ, bool HW>
static __device__ __forceinline__ float moe_q1x128_tile8_fast(const float v[8], uint2 *codes,
                                                              moe_bf16x8 *deq, int pow2) {
    float si;
    const float scale = moe_q1x128_scale8(v, moe_fp8_max(F), pow2, &si);
    moe_q_cast8_fast<F, DEQ, HW>(v, scale, si, codes, deq);
    return si;
}

#endif /* MOE_QUANT1X128_CUH */
