/*
 * Load-balancing losses on the GPU: the auxiliary loss (global and per-sequence) and the
 * router z-loss, forward and backward. CPU twin: lib/cpu/aux_loss.c.
 *
 * Auxiliary loss, per group of T tokens (T = N: Megatron's aux_loss; T = seq_len: its
 * seq_aux_loss), averaged over the N/T groups:
 *     L_g = coeff · E / (k · T²) · Σ_i c_i · Σ_t s_{t,i}
 * s: softmax over the E logits (sigmoid router: σ(z)/(Σσ(z) + 1e-20));
 * c_i: how many tokens of the group have expert i in the plain top-k of s.
 *
 * The GPU pipeline, every step deterministic (integer atomics only, fixed-order sums):
 *   1. counts: the plain top-k of s is the router's own top-k — the pre-softmax router
 *      ranks softmax(z), the sigmoid router without bias ranks σ(z), which orders experts
 *      exactly like σ/Σσ — so we call moe_cuda_router_forward() and then count the picks
 *      per (group, expert) with integer atomicAdd (an integer sum is order independent).
 *   2. scores: one warp per token writes s[t, :] in fp32.
 *   3. column sums Σ_t s_{t,i} per group: a block per (group, 32 experts), 32 threads down
 *      the tokens in a fixed stride, partial sums in double, combined in a fixed order.
 *   4. L = mean over groups of coeff·E/(k·T²)·Σ_i c_i·ssum_i: one block, fixed-order tree.
 *      The double comes back to the host (a sync: the forward returns a value).
 * Backward: only s carries gradient (counts are constants). With
 *     ds_i = scale · coeff · E / (k · T²) / groups · c_i,   dot = Σ_i s_i ds_i,
 * softmax:  dz_i += s_i (ds_i − dot);
 * sigmoid:  s_i = σ_i / S  ⇒  dz_i += (ds_i − dot) / S · σ_i (1 − σ_i).
 *
 * Z-loss (ST-MoE): L = coeff · mean_t lse(z_t)²; dz_{t,i} += scale·coeff·2·lse_t/N · softmax_i.
 * One warp per token computes its logsumexp in fp32; the mean is one block's fixed-order sum
 * in double.
 *
 * Gradients are ACCUMULATED into the bf16 dlogits (read, add in fp32, round once).
 * Scratch buffers come from a grow-only device buffer owned by this file (all work is on
 * moe_cuda_stream(), so reusing it call after call is safe).
 */
#include <math.h>

#include "cuda_common.cuh"
#include "cuda_ops.h"

#define FULL_MASK 0xffffffffu
#define WARPS 4 /* warps (tokens) per block in the per-token kernels */

static __device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

/* ------------------------------------------------------------------ scratch */

static void *scratch(size_t bytes) { return moe_cuda_scratch(MOE_SCRATCH_AUX_LOSS, bytes); }

static size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

/* ------------------------------------------------------------------ kernels */

/* cnt[g, e] += 1 for every pick e of every token of group g (integer atomics). */
static __global__ void count_picks_kernel(int *cnt, const int *topk_idx, int N, int k, int T,
                                          int E) {
    int a = blockIdx.x * blockDim.x + threadIdx.x;
    if (a < N * k)
        atomicAdd(&cnt[(size_t)(a / k / T) * E + topk_idx[a]], 1);
}

/* The aux-loss scores of token t: s = softmax(z), or σ(z)/(Σσ + 1e-20). Warp per token.
 * Also returns (through the lane-uniform references) what the backward needs. */
static __device__ void token_stats(const moe_bf16 *z, int E, bool sig, int lane, float &m,
                                   float &sum) {
    if (sig) {
        float s = 0.0f;
        for (int e = lane; e < E; e += 32)
            s += sigmoidf_(moe_ld(z[e]));
        m = 0.0f;
        sum = moe_warp_sum(s) + 1e-20f;
    } else {
        moe_warp_softmax_stats(z, NULL, E, &m, &sum);
    }
}

static __device__ __forceinline__ float token_score(float z, bool sig, float m, float sum) {
    return sig ? sigmoidf_(z) / sum : expf(z - m) / sum;
}

static __global__ void aux_scores_kernel(float *s, const moe_bf16 *logits, int N, int E, bool sig) {
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (t >= N)
        return;
    const moe_bf16 *z = logits + (size_t)t * E;
    float m, sum;
    token_stats(z, E, sig, lane, m, sum);
    for (int e = lane; e < E; e += 32)
        s[(size_t)t * E + e] = token_score(moe_ld(z[e]), sig, m, sum);
}

/* ssum[g, e] = Σ_{t in group g} s[t, e]. Block (32 experts) × (32 token strides). */
static __global__ void aux_colsum_kernel(double *ssum, const float *s, int T, int E) {
    __shared__ double part[32][33];
    const int g = blockIdx.x, e = blockIdx.y * 32 + threadIdx.x, ty = threadIdx.y;
    double acc = 0.0;
    if (e < E)
        for (int t = ty; t < T; t += 32)
            acc += s[((size_t)g * T + t) * E + e];
    part[ty][threadIdx.x] = acc;
    __syncthreads();
    if (ty == 0 && e < E) {
        double tot = 0.0;
        for (int i = 0; i < 32; i++)
            tot += part[i][threadIdx.x];
        ssum[(size_t)g * E + e] = tot;
    }
}

/* out = (1/groups) Σ_g f · Σ_e c[g,e]·ssum[g,e]; one block of 256 threads, fixed order. */
static __global__ void aux_final_kernel(double *out, const int *cnt, const double *ssum, int groups,
                                        int E, double f) {
    double acc = 0.0;
    for (int g = threadIdx.x; g < groups; g += blockDim.x) {
        double dot = 0.0;
        for (int e = 0; e < E; e++)
            dot += (double)cnt[(size_t)g * E + e] * ssum[(size_t)g * E + e];
        acc += f * dot;
    }
    acc = moe_block_sum<double>(acc);
    if (threadIdx.x == 0)
        *out = acc / groups;
}

/* dz += d(aux)/dz for token t; f = scale·coeff·E/(k·T²)/groups. Warp per token. */
static __global__ void aux_backward_kernel(moe_bf16 *dlogits, const moe_bf16 *logits,
                                           const int *cnt, int N, int T, int E, bool sig, float f) {
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (t >= N)
        return;
    const moe_bf16 *z = logits + (size_t)t * E;
    moe_bf16 *dz = dlogits + (size_t)t * E;
    const int *c = cnt + (size_t)(t / T) * E;
    float m, sum;
    token_stats(z, E, sig, lane, m, sum);
    float dot = 0.0f;
    for (int e = lane; e < E; e += 32)
        dot += token_score(moe_ld(z[e]), sig, m, sum) * (f * (float)c[e]);
    dot = moe_warp_sum(dot);
    for (int e = lane; e < E; e += 32) {
        float ze = moe_ld(z[e]), ds = f * (float)c[e], g;
        if (sig) {
            float sg = sigmoidf_(ze);
            g = (ds - dot) / sum * sg * (1.0f - sg);
        } else {
            g = token_score(ze, false, m, sum) * (ds - dot);
        }
        dz[e] = moe_st(moe_ld(dz[e]) + g);
    }
}

/* lse[t] = logsumexp(z_t). Warp per token. */
static __global__ void lse_kernel(float *lse, const moe_bf16 *logits, int N, int E) {
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (t >= N)
        return;
    float m, sum;
    token_stats(logits + (size_t)t * E, E, false, lane, m, sum);
    if (lane == 0)
        lse[t] = m + logf(sum);
}

/* out = Σ_t lse[t]² in double; one block of 256 threads, fixed order. */
static __global__ void sum_sq_kernel(double *out, const float *lse, int N) {
    double acc = 0.0;
    for (int t = threadIdx.x; t < N; t += blockDim.x)
        acc += (double)lse[t] * lse[t];
    acc = moe_block_sum<double>(acc);
    if (threadIdx.x == 0)
        *out = acc;
}

/* dz_t += scale·coeff·2·lse_t/N · softmax(z_t). Warp per token. */
static __global__ void z_loss_backward_kernel(moe_bf16 *dlogits, const moe_bf16 *logits, int N,
                                              int E, float c2n) {
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (t >= N)
        return;
    const moe_bf16 *z = logits + (size_t)t * E;
    moe_bf16 *dz = dlogits + (size_t)t * E;
    float m, sum;
    token_stats(z, E, false, lane, m, sum);
    const float l = m + logf(sum), f = c2n * l;
    for (int e = lane; e < E; e += 32)
        dz[e] = moe_st(moe_ld(dz[e]) + f * expf(moe_ld(z[e]) - l));
}

/* ------------------------------------------------------------------ launchers */

/* Counts per (group, expert) into cnt (device, groups·E ints): the router's top-k, counted. */
static void group_counts(int *cnt, int *idx, float *w, const void *logits, int N, int T, int E,
                         int k, moe_score_fn fn) {
    cudaStream_t st = moe_cuda_stream();
    moe_router_params p = {E, k, fn, fn == MOE_SCORE_SOFTMAX, 0, 0, 0.0};
    moe_cuda_router_forward(idx, w, logits, NULL, &p, N);
    MOE_CUDA_CHECK(cudaMemsetAsync(cnt, 0, sizeof(int) * (size_t)(N / T) * E, st));
    count_picks_kernel<<<moe_cdiv((size_t)N * k, 256), 256, 0, st>>>(cnt, idx, N, k, T, E);
    MOE_CUDA_LAUNCH_CHECK();
}

/* Carve the scratch buffer: counts, router picks and weights, then what the caller asks. */
struct aux_bufs {
    int *cnt, *idx;
    float *w;
    unsigned char *rest;
};

static aux_bufs aux_scratch(int N, int groups, int E, int k, size_t rest_bytes) {
    size_t b_cnt = align256(sizeof(int) * (size_t)groups * E);
    size_t b_idx = align256(sizeof(int) * (size_t)N * k);
    size_t b_w = align256(sizeof(float) * (size_t)N * k);
    unsigned char *p = (unsigned char *)scratch(b_cnt + b_idx + b_w + rest_bytes);
    aux_bufs b = {(int *)p, (int *)(p + b_cnt), (float *)(p + b_cnt + b_idx),
                  p + b_cnt + b_idx + b_w};
    return b;
}

extern "C" double moe_cuda_aux_loss_forward(const void *logits, int N, int group_len, int E, int k,
                                            moe_score_fn fn, double coeff) {
    if (N <= 0 || group_len <= 0 || N % group_len) {
        fprintf(stderr, "moe_cuda_aux_loss_forward: group_len %d must divide N %d\n", group_len, N);
        exit(1);
    }
    const int T = group_len, groups = N / T;
    cudaStream_t st = moe_cuda_stream();
    size_t b_s = align256(sizeof(float) * (size_t)N * E);
    size_t b_ssum = align256(sizeof(double) * (size_t)groups * E);
    aux_bufs b = aux_scratch(N, groups, E, k, b_s + b_ssum + sizeof(double));
    float *s = (float *)b.rest;
    double *ssum = (double *)(b.rest + b_s), *d_out = (double *)(b.rest + b_s + b_ssum);

    group_counts(b.cnt, b.idx, b.w, logits, N, T, E, k, fn);
    aux_scores_kernel<<<moe_cdiv(N, WARPS), 32 * WARPS, 0, st>>>(s, (const moe_bf16 *)logits, N, E,
                                                                 fn == MOE_SCORE_SIGMOID);
    MOE_CUDA_LAUNCH_CHECK();
    aux_colsum_kernel<<<dim3(groups, moe_cdiv(E, 32)), dim3(32, 32), 0, st>>>(ssum, s, T, E);
    MOE_CUDA_LAUNCH_CHECK();
    const double f = coeff * E / ((double)k * T * T);
    aux_final_kernel<<<1, 256, 0, st>>>(d_out, b.cnt, ssum, groups, E, f);
    MOE_CUDA_LAUNCH_CHECK();
    double loss = 0.0;
    MOE_CUDA_CHECK(cudaMemcpyAsync(&loss, d_out, sizeof(double), cudaMemcpyDeviceToHost, st));
    MOE_CUDA_CHECK(cudaStreamSynchronize(st));
    return loss;
}

extern "C" void moe_cuda_aux_loss_backward(void *dlogits, const void *logits, int N, int group_len,
                                           int E, int k, moe_score_fn fn, double coeff,
                                           double scale) {
    if (N <= 0 || group_len <= 0 || N % group_len) {
        fprintf(stderr, "moe_cuda_aux_loss_backward: group_len %d must divide N %d\n", group_len,
                N);
        exit(1);
    }
    const int T = group_len, groups = N / T;
    aux_bufs b = aux_scratch(N, groups, E, k, 0);
    group_counts(b.cnt, b.idx, b.w, logits, N, T, E, k, fn);
    const double f = scale * coeff * E / ((double)k * T * T) / groups;
    aux_backward_kernel<<<moe_cdiv(N, WARPS), 32 * WARPS, 0, moe_cuda_stream()>>>(
        (moe_bf16 *)dlogits, (const moe_bf16 *)logits, b.cnt, N, T, E, fn == MOE_SCORE_SIGMOID,
        (float)f);
    MOE_CUDA_LAUNCH_CHECK();
}

extern "C" double moe_cuda_z_loss_forward(const void *logits, int N, int E, double coeff) {
    if (N <= 0)
        return 0.0;
    cudaStream_t st = moe_cuda_stream();
    size_t b_lse = align256(sizeof(float) * (size_t)N);
    unsigned char *p = (unsigned char *)scratch(b_lse + sizeof(double));
    float *lse = (float *)p;
    double *d_out = (double *)(p + b_lse);
    lse_kernel<<<moe_cdiv(N, WARPS), 32 * WARPS, 0, st>>>(lse, (const moe_bf16 *)logits, N, E);
    MOE_CUDA_LAUNCH_CHECK();
    sum_sq_kernel<<<1, 256, 0, st>>>(d_out, lse, N);
    MOE_CUDA_LAUNCH_CHECK();
    double total = 0.0;
    MOE_CUDA_CHECK(cudaMemcpyAsync(&total, d_out, sizeof(double), cudaMemcpyDeviceToHost, st));
    MOE_CUDA_CHECK(cudaStreamSynchronize(st));
    return coeff * total / N;
}

extern "C" void moe_cuda_z_loss_backward(void *dlogits, const void *logits, int N, int E,
                                         double coeff, double scale) {
    if (N <= 0)
        return;
    z_loss_backward_kernel<<<moe_cdiv(N, WARPS), 32 * WARPS, 0, moe_cuda_stream()>>>(
        (moe_bf16 *)dlogits, (const moe_bf16 *)logits, N, E, (float)(scale * coeff * 2.0 / N));
    MOE_CUDA_LAUNCH_CHECK();
}
