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
 */
#ifndef MOE_QUANT1X128_CUH
#define MOE_QUANT1X128_CUH

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

/**
 * Quantize this lane's 8 elements @p v of its half-warp's tile: the packed codes into
 * @p codes (element k in byte k, little-endian: the memory order), and with @p deq the
 * dequantized values rounded to bf16 (moe_cuda_qdq's bytes). Returns the tile's 1/scale.
 */
static __device__ __forceinline__ float moe_q1x128_tile8(const float v[8], uint2 *codes,
                                                         moe_bf16x8 *deq, moe_fp8_format f,
                                                         int pow2) {
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const uint32_t key = moe_q_abs_key(v[k]);
        m = key > m ? key : m;
    }
    m = moe_q_halfwarp_max_key(m);
    const float scale = moe_q_scale_from_amax(moe_q_key_amax(m), moe_fp8_max(f), pow2);
    const float si = moe_q_scale_inv(scale);
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

#endif /* MOE_QUANT1X128_CUH */
