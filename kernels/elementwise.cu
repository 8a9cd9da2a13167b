/*
 * Elementwise activation ops on the GPU (as the CPU backend's add and scale):
 *   add:   y += x     (the residual connections)
 *   scale: x *= s
 *
 * One thread per element in a grid-stride loop (so any n, even beyond 2³¹, works with
 * a bounded grid). Each element is loaded as bf16, computed in fp32 and rounded to
 * bf16 once: y = bf16(float(y) + float(x)) is exactly the CPU's fp32 sum, rounded.
 * Memory-bound: a warp reads 64 contiguous bytes per array per step.
 */
#include "cuda_common.cuh"
#include "cuda_ops.h"

static __global__ void add_kernel(moe_bf16 *y, const moe_bf16 *x, size_t n) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = moe_st(moe_ld(y[i]) + moe_ld(x[i]));
}

static __global__ void scale_kernel(moe_bf16 *x, float s, size_t n) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        x[i] = moe_st(moe_ld(x[i]) * s);
}

/* a bounded grid for grid-stride loops: enough blocks to fill any GPU */
static unsigned grid_for(size_t n, int threads) {
    size_t b = moe_cdiv(n, threads);
    return (unsigned)(b < 65536 ? b : 65536);
}

extern "C" void moe_cuda_add(void *y, const void *x, size_t n) {
    if (n == 0)
        return;
    add_kernel<<<grid_for(n, 256), 256, 0, moe_cuda_stream()>>>((moe_bf16 *)y,
                                                                (const moe_bf16 *)x, n);
    MOE_CUDA_LAUNCH_CHECK();
}

extern "C" void moe_cuda_scale(void *x, double s, size_t n) {
    if (n == 0)
        return;
    scale_kernel<<<grid_for(n, 256), 256, 0, moe_cuda_stream()>>>((moe_bf16 *)x, (float)s, n);
    MOE_CUDA_LAUNCH_CHECK();
}
