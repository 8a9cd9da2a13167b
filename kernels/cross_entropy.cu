/*
 * Cross-entropy on logits on the GPU (as lib/cpu/cross_entropy.c):
 *   loss[n]     = logsumexp(z[n,:]) − z[n, target[n]]
 *   dz[n,v]    += dloss[n] · (softmax(z[n,:])_v − [v == target[n]])
 *
 * logsumexp is computed stably with the max shift: m = max_v z_v, then
 * lse = m + log Σ_v exp(z_v − m) — every exponent is ≤ 0, so nothing overflows.
 *
 * ONE BLOCK PER ROW (a row is one token's V logits; V is the vocabulary, 65 for
 * tinyshakespeare, 50k+ for a BPE vocabulary). Two block reductions per row: the max,
 * then the sum of exponentials, each a strided per-thread pass over the row
 * (coalesced) followed by a warp-shuffle tree and a tree over warps in shared memory.
 * The trees have a fixed shape: deterministic. Sums in fp32 (the CPU uses double;
 * the loss differs by ~1e-7 relative). Losses are fp32; dz is bf16 and accumulates.
 *
 * dloss == NULL means every row has gradient 1/N (the mean over the batch), as on
 * the CPU.
 */
#include "cuda_common.cuh"
#include "cuda_ops.h"

#define THREADS 256


/* log Σ_v exp(z_v) of one row, for the whole block */
static __device__ float row_logsumexp(const moe_bf16 *z, int V) {
    float m = -INFINITY;
    for (int v = threadIdx.x; v < V; v += blockDim.x)
        m = fmaxf(m, moe_ld(z[v]));
    m = moe_block_max(m);
    float s = 0.0f;
    for (int v = threadIdx.x; v < V; v += blockDim.x)
        s += expf(moe_ld(z[v]) - m);
    s = moe_block_sum<float>(s);
    return m + logf(s);
}

static __global__ void cross_entropy_forward_kernel(float *losses, const moe_bf16 *logits,
                                                    const int *targets, int V) {
    const moe_bf16 *z = logits + (size_t)blockIdx.x * V;
    const float lse = row_logsumexp(z, V);
    if (threadIdx.x == 0)
        losses[blockIdx.x] = lse - moe_ld(z[targets[blockIdx.x]]);
}

static __global__ void cross_entropy_backward_kernel(moe_bf16 *dlogits, const float *dloss,
                                                     const moe_bf16 *logits, const int *targets,
                                                     int N, int V) {
    const size_t row = (size_t)blockIdx.x * V;
    const moe_bf16 *z = logits + row;
    moe_bf16 *dz = dlogits + row;
    const float lse = row_logsumexp(z, V);
    const float g = dloss ? dloss[blockIdx.x] : 1.0f / N;
    const int target = targets[blockIdx.x];
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        const float p = expf(moe_ld(z[v]) - lse);
        dz[v] = moe_st(moe_ld(dz[v]) + g * (p - (v == target ? 1.0f : 0.0f)));
    }
}

extern "C" void moe_cuda_cross_entropy_forward(moe_real *losses, const void *logits,
                                               const int *targets, int N, int V) {
    if (N == 0)
        return;
    cross_entropy_forward_kernel<<<N, THREADS, 0, moe_cuda_stream()>>>(
        losses, (const moe_bf16 *)logits, targets, V);
    MOE_CUDA_LAUNCH_CHECK();
}

extern "C" void moe_cuda_cross_entropy_backward(void *dlogits, const moe_real *dloss,
                                                const void *logits, const int *targets, int N,
                                                int V) {
    if (N == 0)
        return;
    cross_entropy_backward_kernel<<<N, THREADS, 0, moe_cuda_stream()>>>(
        (moe_bf16 *)dlogits, dloss, (const moe_bf16 *)logits, targets, N, V);
    MOE_CUDA_LAUNCH_CHECK();
}
