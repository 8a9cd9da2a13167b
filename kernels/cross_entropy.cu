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
 *
 * The vocabulary-parallel twins (lib/cpu/cross_entropy.c explains the math): the shard
 * forward is the same row reduction, keeping the shard's log-sum-exp and its target logit
 * (0 where the target id is −1, another shard's); the merge is one thread per row over the
 * R gathered parts, in the CPU's order (fp32 here, double there); the shard backward is the
 * backward above with the whole row's lse read instead of recomputed.
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

static __global__ void cross_entropy_shard_forward_kernel(float *part, const moe_bf16 *logits,
                                                          const int *targets, int V) {
    const moe_bf16 *z = logits + (size_t)blockIdx.x * V;
    const float lse = row_logsumexp(z, V);
    if (threadIdx.x == 0) {
        const int t = targets[blockIdx.x];
        part[2 * (size_t)blockIdx.x] = lse;
        part[2 * (size_t)blockIdx.x + 1] = t >= 0 ? moe_ld(z[t]) : 0.0f;
    }
}

static __global__ void cross_entropy_shard_merge_kernel(float *losses, float *lse,
                                                        const float *parts, int R, int N) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N)
        return;
    float m = parts[2 * (size_t)n], t = 0.0f, s = 0.0f;
    for (int r = 1; r < R; r++)
        m = fmaxf(m, parts[((size_t)r * N + n) * 2]);
    for (int r = 0; r < R; r++) {
        const float *p = parts + ((size_t)r * N + n) * 2;
        s += expf(p[0] - m);
        t += p[1];
    }
    const float l = m + logf(s);
    lse[n] = l;
    losses[n] = l - t;
}

static __global__ void cross_entropy_shard_backward_kernel(moe_bf16 *dlogits, const float *dloss,
                                                           const moe_bf16 *logits,
                                                           const float *lse, const int *targets,
                                                           int N, int V) {
    const size_t row = (size_t)blockIdx.x * V;
    const moe_bf16 *z = logits + row;
    moe_bf16 *dz = dlogits + row;
    const float l = lse[blockIdx.x];
    const float g = dloss ? dloss[blockIdx.x] : 1.0f / N;
    const int target = targets[blockIdx.x];
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        const float p = expf(moe_ld(z[v]) - l);
        dz[v] = moe_st(moe_ld(dz[v]) + g * (p - (v == target ? 1.0f : 0.0f)));
    }
}

extern "C" void moe_cuda_cross_entropy_shard_forward(moe_real *part, const void *logits,
                                                     const int *targets, int N, int V) {
    if (N == 0)
        return;
    cross_entropy_shard_forward_kernel<<<N, THREADS, 0, moe_cuda_stream()>>>(
        part, (const moe_bf16 *)logits, targets, V);
    MOE_CUDA_LAUNCH_CHECK();
}

extern "C" void moe_cuda_cross_entropy_shard_merge(moe_real *losses, moe_real *lse,
                                                   const moe_real *parts, int R, int N) {
    if (N == 0)
        return;
    cross_entropy_shard_merge_kernel<<<moe_cdiv(N, THREADS), THREADS, 0, moe_cuda_stream()>>>(
        losses, lse, parts, R, N);
    MOE_CUDA_LAUNCH_CHECK();
}

extern "C" void moe_cuda_cross_entropy_shard_backward(void *dlogits, const moe_real *dloss,
                                                      const void *logits, const moe_real *lse,
                                                      const int *targets, int N, int V) {
    if (N == 0)
        return;
    cross_entropy_shard_backward_kernel<<<N, THREADS, 0, moe_cuda_stream()>>>(
        (moe_bf16 *)dlogits, dloss, (const moe_bf16 *)logits, lse, targets, N, V);
    MOE_CUDA_LAUNCH_CHECK();
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
