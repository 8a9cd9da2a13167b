/**
 * @file fp8_wgrad.cuh
 * @brief The device half of lib/fp8_wgrad.h's layout, shared by the token-wise quantizer
 *        (quantize_group_t.cu) and the FP8 wgrad kernel (grouped_gemm_fp8_wgrad_sm90.cu):
 *        each group's padded start, in 128-token blocks, from the offsets in device memory.
 */
#ifndef MOE_FP8_WGRAD_CUH
#define MOE_FP8_WGRAD_CUH

#include "config.h" /* MOE_GROUPED_DEV_MAX_GROUPS */
#include "quantize.h"

/**
 * s_pb[g] = Σ_{h<g} ⌈n_h / 128⌉ for g = 0 .. G (s_pb[G]: all the groups' blocks), n_h =
 * off[h+1] − off[h], into shared memory: one thread per group loads its size, then an
 * inclusive Hillis-Steele scan over MOE_GROUPED_DEV_MAX_GROUPS slots (8 steps), in place in
 * s_pb[1 ..]. Why not one thread walking the groups: G dependent global loads, 256 of them
 * at a few hundred cycles each, would cost tens of microseconds per block. Every thread of
 * the block calls it (it synchronizes, last of all too); blockDim.x ≥ MOE_GROUPED_DEV_MAX_GROUPS,
 * G ≤ MOE_GROUPED_DEV_MAX_GROUPS.
 */
static __device__ __forceinline__ void moe_wgrad_block_prefix(int *s_pb, const int *off, int G) {
    constexpr int S = MOE_GROUPED_DEV_MAX_GROUPS;
    const int t = threadIdx.x;
    if (t < S)
        s_pb[t + 1] = t < G ? (off[t + 1] - off[t] + MOE_QUANT_BLOCK - 1) / MOE_QUANT_BLOCK : 0;
    if (t == 0)
        s_pb[0] = 0;
    __syncthreads();
    for (int d = 1; d < S; d <<= 1) {
        const int add = t < S && t >= d ? s_pb[t + 1 - d] : 0;
        __syncthreads();
        if (t < S)
            s_pb[t + 1] += add;
        __syncthreads();
    }
}

#endif /* MOE_FP8_WGRAD_CUH */
