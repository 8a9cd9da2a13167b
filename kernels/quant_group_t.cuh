/*
 * The token-wise tile step of chapter 05's FP8 wgrad operands (lib/fp8_wgrad.h): a tile of
 * 128 tokens × 128 channels of bf16 in shared memory, quantized 1×128 ALONG THE TOKENS (one
 * scale per channel and 128-token block), its codes written transposed, [C][Kpad]. Shared by
 * the token-wise quantizer (kernels/quantize_group_t.cu, which reads the tile from a bf16
 * tensor) and the fused SwiGLU backward (kernels/swiglu_quant.cu, which computes the tile
 * and never writes it to global memory).
 *
 * The layout and the bank-conflict argument are quantize_group_t.cu's header's: a token row
 * is 256 bytes in 16 chunks of 16 bytes (8 channels), chunk q of row t at chunk position
 * q ^ ((t >> 4) & 7) (moe_gt_swz). The step is for 256-thread blocks: warp w, pass h takes
 * chunk q = 2w + h; lane (s = lane & 7, p = lane >> 3) takes tokens 16s .. 16s + 15 of
 * channels 8q + 2p (the low bf16 of each word) and 8q + 2p + 1 (the high).
 */
#ifndef MOE_QUANT_GROUP_T_CUH
#define MOE_QUANT_GROUP_T_CUH

#include "cuda_common.cuh"
#include "fp8_wgrad.cuh"
#include "quant1x128.cuh"
#include "quantize.h"

#define MOE_GT_THREADS 256 /* the step's block size */
#define MOE_GT_CHUNKS 16   /* 16-byte chunks of a token row (8 channels each) */
#define MOE_GT_SEG 16      /* consecutive tokens per lane: one 16-byte code store */
static_assert(MOE_QUANT_BLOCK == 128 && MOE_GT_CHUNKS * 8 == MOE_QUANT_BLOCK,
              "the tile step assumes 128 × 128 tiles");

/** the swizzled chunk position of chunk q of token row t */
static __device__ __forceinline__ int moe_gt_swz(int t, int q) { return q ^ ((t >> 4) & 7); }

/* the key of a bf16 (its fp32 bits' |.|: moe_q_abs_key of the value) from its 16 bits in the
 * low or high half of w, and the value itself */
static __device__ __forceinline__ uint32_t moe_gt_key_lo(uint32_t w) {
    return (w << 16) & 0x7FFFFFFFu;
}
static __device__ __forceinline__ uint32_t moe_gt_key_hi(uint32_t w) { return w & 0x7FFF0000u; }
static __device__ __forceinline__ float moe_gt_val_lo(uint32_t w) { return moe_q_u2f(w << 16); }
static __device__ __forceinline__ float moe_gt_val_hi(uint32_t w) {
    return moe_q_u2f(w & 0xFFFF0000u);
}

/** max of a key over the 8 lanes of a channel (lanes that differ in bits 0..2) */
static __device__ __forceinline__ uint32_t moe_gt_seg_max_key(uint32_t m) {
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) {
        const uint32_t other = __shfl_xor_sync(0xffffffffu, m, o);
        m = other > m ? other : m;
    }
    return m;
}

/** The group of padded token block @p pb: the last g < G with s_pb[g] ≤ pb (then pb <
 *  s_pb[g + 1] when pb < s_pb[G]; an empty group has s_pb[g] = s_pb[g + 1] and is passed
 *  over), by a binary search of the padded starts in shared memory. */
static __device__ __forceinline__ int moe_gt_group_of(const int *s_pb, int G, int pb) {
    int g = 0;
#pragma unroll
    for (int step = MOE_GROUPED_DEV_MAX_GROUPS / 2; step; step >>= 1)
        if (g + step < G && s_pb[g + step] <= pb)
            g += step;
    return g;
}

/** One channel's 16 codes (as moe_q_cast_scaled: all 0 for a NaN scale), packed
 *  little-endian, and with DEQ its dequantized values rounded to bf16 into the half (HI or
 *  not) of w. The values are finite (a block holding a NaN or an infinity has a NaN scale),
 *  so the hardware's fp32x2 → FP8x2 conversion casts them, two an instruction, by the same
 *  rule as moe_fp8_encode_fast (moe_fp8x2_encode_hw, quant1x128.cuh: checked on every finite
 *  input by tests/gpu_fp8_fused.c). Why not the software encoder with the signs gathered
 *  from the words, as before: about ten operations an element against half of one; this
 *  step runs in every token-wise pass (the quantizer and both tiled SwiGLU passes), whose
 *  time was their instructions', not their bytes' (docs/results/05-fp8-nvfp4.md). */
template <moe_fp8_format F, bool HI, bool DEQ>
static __device__ __forceinline__ uint4 moe_gt_cast16(uint32_t *w, float scale, float si) {
    uint32_t c[4];
    const bool poisoned = moe_q_nonfinite(scale);
#pragma unroll
    for (int g = 0; g < 4; g++) {
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; j++)
            v[j] = moe_q_mul(HI ? moe_gt_val_hi(w[4 * g + j]) : moe_gt_val_lo(w[4 * g + j]),
                             scale);
        const uint32_t lo = moe_fp8x2_encode_hw<F>(v[0], v[1]);
        const uint32_t hi = moe_fp8x2_encode_hw<F>(v[2], v[3]);
        c[g] = poisoned ? 0u : __byte_perm(lo, hi, 0x5410);
        if (DEQ)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const uint8_t code = (uint8_t)(c[g] >> (8 * j));
                const uint32_t h = __bfloat16_as_ushort(
                    moe_st(moe_q_dequant(moe_fp8_decode(code, F), si)));
                uint32_t &x = w[4 * g + j];
                x = HI ? (x & 0xFFFFu) | (h << 16) : (x & 0xFFFF0000u) | h;
            }
    }
    return make_uint4(c[0], c[1], c[2], c[3]);
}

/**
 * Quantize the tile in @p tile (written and made visible by a __syncthreads() before) along
 * its tokens: every thread of the 256 calls it. Without QDQ the codes of channel c0 + j go
 * to qt[(c0 + j)·kpad + pb·128 ..] (128 bytes) and its scale_inv to st[pb·C + c0 + j]; with
 * QDQ nothing is written to global memory and each value in the tile is replaced by its
 * dequantized value rounded to bf16 (the emulation's QDQ). Padded tokens must hold zeros
 * (key 0, code 0).
 */
template <moe_fp8_format F, bool QDQ>
static __device__ __forceinline__ void moe_gt_tile_step(uint4 *tile, uint8_t *qt, float *st,
                                                        int c0, int pb, int C, size_t kpad,
                                                        int pow2) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, s = lane & 7, p = lane >> 3;
    const float fmax = moe_fp8_max(F);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int q = 2 * warp + h;
        uint32_t w[MOE_GT_SEG], mlo = 0, mhi = 0;
#pragma unroll
        for (int k = 0; k < MOE_GT_SEG; k++) {
            const int t = MOE_GT_SEG * s + k;
            w[k] = ((const uint32_t *)&tile[t * MOE_GT_CHUNKS + moe_gt_swz(t, q)])[p];
            mlo = max(mlo, moe_gt_key_lo(w[k]));
            mhi = max(mhi, moe_gt_key_hi(w[k]));
        }
        mlo = moe_gt_seg_max_key(mlo);
        mhi = moe_gt_seg_max_key(mhi);
        const float sclo = moe_q_scale_from_amax(moe_q_key_amax(mlo), fmax, pow2);
        const float schi = moe_q_scale_from_amax(moe_q_key_amax(mhi), fmax, pow2);
        const float silo = moe_q_scale_inv(sclo), sihi = moe_q_scale_inv(schi);
        const uint4 clo = moe_gt_cast16<F, false, QDQ>(w, sclo, silo);
        const uint4 chi = moe_gt_cast16<F, true, QDQ>(w, schi, sihi);
        const int c = c0 + 8 * q + 2 * p; /* the low channel */
        if (!QDQ) {
            uint8_t *dst = qt + (size_t)c * kpad + (size_t)pb * MOE_QUANT_BLOCK + MOE_GT_SEG * s;
            *(uint4 *)dst = clo;
            *(uint4 *)(dst + kpad) = chi;
            if (s < 2) /* 8 consecutive scales: channels 8q .. 8q + 7 */
                st[(size_t)pb * C + c + s] = s ? sihi : silo;
        }
        if (QDQ) /* the dequantized pair back over the words just read */
#pragma unroll
            for (int k = 0; k < MOE_GT_SEG; k++) {
                const int t = MOE_GT_SEG * s + k;
                ((uint32_t *)&tile[t * MOE_GT_CHUNKS + moe_gt_swz(t, q)])[p] = w[k];
            }
    }
}

#endif /* MOE_QUANT_GROUP_T_CUH */
