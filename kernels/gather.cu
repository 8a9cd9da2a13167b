/*
 * Row gathers with an index map, the one data-movement primitive of the token
 * dispatcher (lib/moe/dispatch_alltoall.c): dst[r,:] = src[map[r],:], and a zero row where
 * map[r] < 0 (the padding rows of --moe-pad-expert-input-to-capacity). Chunk sorting
 * ([source rank][local expert] → [local expert][source rank]) and its reverse are both
 * such gathers with maps the host builds from the exchanged counts.
 *
 * One block per row; threads stride over the row with 16-byte loads when C is a
 * multiple of 8 (8 bf16), plain 2-byte loads otherwise.
 */
#include "cuda_common.cuh"
#include "cuda_ops.h"

static __global__ void gather_rows_kernel(moe_bf16 *dst, const moe_bf16 *src, const int *map,
                                          int C) {
    const int r = blockIdx.x, s = map[r];
    moe_bf16 *d = dst + (size_t)r * C;
    if ((C & 7) == 0) {
        uint4 *d4 = (uint4 *)d;
        const uint4 *s4 = s >= 0 ? (const uint4 *)(src + (size_t)s * C) : NULL;
        for (int c = threadIdx.x; c < C / 8; c += blockDim.x)
            d4[c] = s4 ? s4[c] : make_uint4(0, 0, 0, 0);
    } else {
        for (int c = threadIdx.x; c < C; c += blockDim.x)
            d[c] = s >= 0 ? src[(size_t)s * C + c] : moe_st(0.0f);
    }
}

static __global__ void gather_reals_kernel(float *dst, const float *src, const int *map,
                                           int rows) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < rows)
        dst[r] = map[r] >= 0 ? src[map[r]] : 0.0f;
}

extern "C" void moe_cuda_gather_rows(void *dst, const void *src, const int *map, int rows,
                                     int C) {
    if (rows <= 0)
        return;
    gather_rows_kernel<<<rows, 128, 0, moe_cuda_stream()>>>((moe_bf16 *)dst,
                                                            (const moe_bf16 *)src, map, C);
    MOE_CUDA_LAUNCH_CHECK();
}

extern "C" void moe_cuda_gather_reals(moe_real *dst, const moe_real *src, const int *map,
                                      int rows) {
    if (rows <= 0)
        return;
    gather_reals_kernel<<<moe_cdiv(rows, 256), 256, 0, moe_cuda_stream()>>>(dst, src, map, rows);
    MOE_CUDA_LAUNCH_CHECK();
}
