/*
 * SwiGLU on the GPU (as lib/cpu/swiglu.c): out = silu(g) ⊙ u, silu(g) = g·σ(g),
 * where each input row is [g | u] (gate half first, Megatron's fused fc1 output).
 *
 * Backward (σ = σ(g)):
 *   dg += dout · u · σ(1 + g(1 − σ))      (d silu/dg = σ + g·σ(1 − σ))
 *   du += dout · silu(g)
 *
 * Purely elementwise: one thread per output element (n, f). A warp covers 32
 * consecutive f of one row, so its reads of g, of u (F further on) and its writes
 * are each contiguous. Math in fp32 with the accurate expf (not __expf), one bf16
 * rounding per output.
 */
#include "cuda_common.cuh"
#include "cuda_ops.h"

static __device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

static __global__ void swiglu_forward_kernel(moe_bf16 *out, const moe_bf16 *gu, int N, int F) {
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)N * F)
        return;
    const size_t n = idx / F, f = idx % F;
    const moe_bf16 *row = gu + n * 2 * F;
    const float g = moe_ld(row[f]), u = moe_ld(row[F + f]);
    out[idx] = moe_st(g * sigmoid(g) * u);
}

static __global__ void swiglu_backward_kernel(moe_bf16 *dgu, const moe_bf16 *dout,
                                              const moe_bf16 *gu, int N, int F) {
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)N * F)
        return;
    const size_t n = idx / F, f = idx % F;
    const moe_bf16 *row = gu + n * 2 * F;
    moe_bf16 *drow = dgu + n * 2 * F;
    const float g = moe_ld(row[f]), u = moe_ld(row[F + f]), d = moe_ld(dout[idx]);
    const float s = sigmoid(g);
    drow[f] = moe_st(moe_ld(drow[f]) + d * u * s * (1.0f + g * (1.0f - s)));
    drow[F + f] = moe_st(moe_ld(drow[F + f]) + d * g * s);
}

extern "C" void moe_cuda_swiglu_forward(void *out, const void *gu, int N, int F) {
    const size_t n = (size_t)N * F;
    if (n == 0)
        return;
    swiglu_forward_kernel<<<moe_cdiv(n, 256), 256, 0, moe_cuda_stream()>>>(
        (moe_bf16 *)out, (const moe_bf16 *)gu, N, F);
    MOE_CUDA_LAUNCH_CHECK();
}

extern "C" void moe_cuda_swiglu_backward(void *dgu, const void *dout, const void *gu, int N,
                                         int F) {
    const size_t n = (size_t)N * F;
    if (n == 0)
        return;
    swiglu_backward_kernel<<<moe_cdiv(n, 256), 256, 0, moe_cuda_stream()>>>(
        (moe_bf16 *)dgu, (const moe_bf16 *)dout, (const moe_bf16 *)gu, N, F);
    MOE_CUDA_LAUNCH_CHECK();
}
