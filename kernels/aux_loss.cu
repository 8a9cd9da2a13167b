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
 * A rank may hold only some rows of the groups (moe_aux_shape: global rows [row0, row0+N)
 * of groups·T tokens; tensor parallelism runs the MoE layer on sequence shards; under
 * context parallelism a sequence's rows are runs, moe_aux_shape::run). The counts
 * are then computed per rank and summed over the ranks by the caller (a device collective:
 * they stay in device memory), and the forward and backward take them: this rank's part of
 * L uses only its rows' scores.
 *
 * The GPU pipeline, every step deterministic (integer atomics only, fixed-order sums):
 *   1. counts (moe_cuda_aux_loss_counts): the plain top-k of s is the router's own top-k —
 *      the pre-softmax router ranks softmax(z), the sigmoid router without bias ranks σ(z),
 *      which orders experts exactly like σ/Σσ — so we call moe_cuda_router_forward() and
 *      count the picks per (group, expert) with integer atomicAdd (an integer sum is order
 *      independent), into the caller's device array.
 *   2. scores: one warp per token writes s[t, :] in fp32.
 *   3. column sums Σ_t s_{t,i} over this rank's rows of each group it holds: a block per
 *      (group, 32 experts, slice of the rows), 32 threads down the slice in a fixed stride,
 *      partial sums in double, combined in a fixed order;
 *   4. L = (1/groups)·Σ_g coeff·E/(k·T²)·Σ_i c_{g,i}·ssum_{g,i}, ssum the slices' sum in
 *      slice order: one block, fixed-order tree,
 *      added into the caller's device double (until chapter 06 it came back to the host: a
 *      sync per layer and micro-batch).
 * Backward: only s carries gradient (counts are constants). With
 *     ds_i = scale · coeff · E / (k · T²) / groups · c_i,   dot = Σ_i s_i ds_i,
 * softmax:  dz_i += s_i (ds_i − dot);
 * sigmoid:  s_i = σ_i / S  ⇒  dz_i += (ds_i − dot) / S · σ_i (1 − σ_i).
 *
 * Z-loss (ST-MoE): L = coeff · mean_t lse(z_t)²; dz_{t,i} += scale·coeff·2·lse_t/N · softmax_i.
 * One warp per token computes its logsumexp in fp32; the mean is one block's fixed-order sum
 * in double, added into the caller's device double.
 *
 * Aux-loss-free balancing (chapter 06 moved it here from the host): the load of each expert
 * is a histogram of the router's picks (integer atomics), and the bias update is one block per
 * layer running moe_expert_bias_update()'s arithmetic in its order, skipped when the step
 * flags hold a bit.
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

/* cnt[g, e] += 1 for every pick e of every row of group g (integer atomics); local row t
 * is row row0 + t of the shape, whose group is moe_aux_group(). */
static __global__ void count_picks_kernel(long long *cnt, const int *topk_idx, int N, int k,
                                          moe_aux_shape sh) {
    const int a = blockIdx.x * blockDim.x + threadIdx.x, lane = threadIdx.x % 32;
    const long long slot =
        a < N * k ? moe_aux_group(&sh, (long long)sh.row0 + a / k) * sh.E + topk_idx[a] : -1;
    /* The lanes of a warp that pick the same (group, expert) add together, through one
     * leader: with few experts every pick of the step otherwise queues on a handful of
     * counters (16,384 atomics on 8 addresses for the GPU preset). Integers: the same
     * counts in any order. (blockDim.x is a multiple of 32: every lane is here.) */
    const unsigned same = __match_any_sync(0xffffffffu, slot);
    if (slot >= 0 && lane == __ffs(same) - 1)
        atomicAdd((unsigned long long *)&cnt[slot], (unsigned long long)__popc(same));
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

/* The column sums are cut into COLSUM_SLICES slices of a group's rows, each summed by a
 * block of its own: with one block per group (the global aux loss has one group) a block's
 * threads each walked N/32 rows, every add waiting on a load from L2 — 16 µs a call for the
 * GPU preset's 8192 × 8 scores. The slicing depends on nothing but the constant, so the
 * order of every sum, and the result, is the same on every run. */
#define COLSUM_SLICES 16

/* part[j, z, e] = Σ s[t, e] over slice z of this rank's rows t of group g0 + j. The group's
 * rows are runs of `run` rows, one every groups·run (one run when run = T, the usual case;
 * two per rank under context parallelism), walked in order; slice z takes the rows lo + ty +
 * 32·(z + COLSUM_SLICES·i) of each run. Block (32 experts) × (32 row strides), grid (groups,
 * expert blocks, slices). */
static __global__ void aux_colsum_kernel(double *part, const float *s, int N, int row0, int g0,
                                         int groups, int run, int E) {
    __shared__ double sh[32][33];
    const int g = blockIdx.x, e = blockIdx.y * 32 + threadIdx.x, ty = threadIdx.y;
    const int z = blockIdx.z;
    double acc = 0.0;
    for (long long a = (long long)(g0 + g) * run - row0; a < N; a += (long long)groups * run) {
        const long long b = a + run;
        const int lo = a > 0 ? (int)a : 0, hi = b < N ? (int)b : N;
        if (e < E)
            for (int t = lo + ty + 32 * z; t < hi; t += 32 * COLSUM_SLICES)
                acc += s[(size_t)t * E + e];
    }
    sh[ty][threadIdx.x] = acc;
    __syncthreads();
    if (ty == 0 && e < E) {
        double tot = 0.0;
        for (int i = 0; i < 32; i++)
            tot += sh[i][threadIdx.x];
        part[((size_t)g * COLSUM_SLICES + z) * E + e] = tot;
    }
}

/* out = (1/groups) Σ_j f · Σ_e c[j,e]·ssum[j,e] over the ng groups this rank holds rows of
 * (cnt points at the first), ssum[j,e] = Σ_z part[j,z,e] in slice order; one block of 256
 * threads, fixed order. */
static __global__ void aux_final_kernel(double *out, const long long *cnt, const double *part,
                                        int ng, int groups, int E, double f) {
    double acc = 0.0;
    for (int g = threadIdx.x; g < ng; g += blockDim.x) {
        double dot = 0.0;
        for (int e = 0; e < E; e++) {
            double ssum = 0.0;
            for (int z = 0; z < COLSUM_SLICES; z++)
                ssum += part[((size_t)g * COLSUM_SLICES + z) * E + e];
            dot += (double)cnt[(size_t)g * E + e] * ssum;
        }
        acc += f * dot;
    }
    acc = moe_block_sum<double>(acc);
    if (threadIdx.x == 0)
        *out += acc / groups;
}

/* dz += d(aux)/dz for local row t (global row0 + t); f = scale·coeff·E/(k·T²)/groups.
 * cnt: the counts from the first group this rank holds rows of. Warp per token. */
static __global__ void aux_backward_kernel(moe_bf16 *dlogits, const moe_bf16 *logits,
                                           const long long *cnt, int N, moe_aux_shape sh, int g0,
                                           bool sig, float f) {
    const int E = sh.E;
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (t >= N)
        return;
    const moe_bf16 *z = logits + (size_t)t * E;
    moe_bf16 *dz = dlogits + (size_t)t * E;
    const long long *c = cnt + (size_t)(moe_aux_group(&sh, (long long)sh.row0 + t) - g0) * E;
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

/* out += coeff · Σ_t lse[t]² / N, the sum in double; one block of 256 threads, fixed order. */
static __global__ void z_final_kernel(double *out, const float *lse, int N, double coeff) {
    /* thread t adds lse[t]², lse[t + 256]², ... in that order, 8 loads in flight at a time:
     * one block walking the values one L2 latency each took 8 us for 8192 tokens */
    double acc = moe_strided_sum<8>(lse, threadIdx.x, (size_t)N, blockDim.x,
                                    [](double v) { return v * v; });
    acc = moe_block_sum<double>(acc);
    if (threadIdx.x == 0)
        *out += coeff * acc / N;
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

static void check_shape(const moe_aux_shape *s, const char *who) {
    if (s->N < 0 || s->row0 < 0 || s->group_len <= 0 || s->groups <= 0 || s->run < 0 ||
        (long long)s->row0 + s->N > (long long)s->groups * s->group_len || s->k < 1 ||
        s->k > s->E) {
        fprintf(stderr, "%s: rows [%d, %d) do not fit %d groups of %d (E %d, k %d)\n", who,
                s->row0, s->row0 + s->N, s->groups, s->group_len, s->E, s->k);
        exit(1);
    }
}

/* The groups this rank holds rows of: g0 .. g0 + ng − 1 (with runs shorter than a group,
 * context parallelism: every group, those without rows here summing to 0). */
static int run_of(const moe_aux_shape *s) { return s->run > 0 ? s->run : s->group_len; }
static int first_group(const moe_aux_shape *s) {
    return run_of(s) < s->group_len ? 0 : s->row0 / s->group_len;
}
static int held_groups(const moe_aux_shape *s) {
    if (s->N <= 0)
        return 0;
    if (run_of(s) < s->group_len)
        return s->groups;
    return (s->row0 + s->N - 1) / s->group_len - first_group(s) + 1;
}

extern "C" void moe_cuda_aux_loss_counts(long long *counts, const void *logits,
                                         const moe_aux_shape *s) {
    check_shape(s, "moe_cuda_aux_loss_counts");
    const int N = s->N, E = s->E, k = s->k, G = s->groups;
    cudaStream_t st = moe_cuda_stream();
    const size_t b_idx = align256(sizeof(int) * (size_t)N * k);
    unsigned char *p = (unsigned char *)scratch(b_idx + sizeof(float) * (size_t)N * k);
    int *idx = (int *)p;
    float *w = (float *)(p + b_idx);
    MOE_CUDA_CHECK(cudaMemsetAsync(counts, 0, sizeof(long long) * (size_t)G * E, st));
    if (N > 0) {
        moe_router_params rp = {E, k, s->fn, s->fn == MOE_SCORE_SOFTMAX, 0, 0, 0.0};
        moe_cuda_router_forward(idx, w, logits, NULL, &rp, N);
        count_picks_kernel<<<moe_cdiv((size_t)N * k, 256), 256, 0, st>>>(counts, idx, N, k, *s);
        MOE_CUDA_LAUNCH_CHECK();
    }
}

extern "C" void moe_cuda_aux_loss_forward(double *acc, const void *logits,
                                          const long long *counts, const moe_aux_shape *s,
                                          double coeff) {
    check_shape(s, "moe_cuda_aux_loss_forward");
    const int N = s->N, E = s->E, T = s->group_len, ng = held_groups(s);
    if (ng == 0)
        return; /* *acc += 0 */
    cudaStream_t st = moe_cuda_stream();
    const size_t b_s = align256(sizeof(float) * (size_t)N * E);
    unsigned char *p =
        (unsigned char *)scratch(b_s + sizeof(double) * (size_t)ng * COLSUM_SLICES * E);
    float *sc = (float *)p;
    double *part = (double *)(p + b_s);
    aux_scores_kernel<<<moe_cdiv(N, WARPS), 32 * WARPS, 0, st>>>(sc, (const moe_bf16 *)logits, N, E,
                                                                 s->fn == MOE_SCORE_SIGMOID);
    MOE_CUDA_LAUNCH_CHECK();
    aux_colsum_kernel<<<dim3(ng, moe_cdiv(E, 32), COLSUM_SLICES), dim3(32, 32), 0, st>>>(
        part, sc, N, s->row0, first_group(s), s->groups, run_of(s), E);
    MOE_CUDA_LAUNCH_CHECK();
    const double f = coeff * E / ((double)s->k * T * T);
    aux_final_kernel<<<1, 256, 0, st>>>(acc, counts + (size_t)first_group(s) * E, part, ng,
                                        s->groups, E, f);
    MOE_CUDA_LAUNCH_CHECK();
}

extern "C" void moe_cuda_aux_loss_backward(void *dlogits, const void *logits,
                                           const long long *counts, const moe_aux_shape *s,
                                           double coeff, double scale) {
    check_shape(s, "moe_cuda_aux_loss_backward");
    const int N = s->N, E = s->E, T = s->group_len, ng = held_groups(s);
    if (ng == 0)
        return;
    const double f = scale * coeff * E / ((double)s->k * T * T) / s->groups;
    aux_backward_kernel<<<moe_cdiv(N, WARPS), 32 * WARPS, 0, moe_cuda_stream()>>>(
        (moe_bf16 *)dlogits, (const moe_bf16 *)logits, counts + (size_t)first_group(s) * E, N,
        *s, first_group(s), s->fn == MOE_SCORE_SIGMOID, (float)f);
    MOE_CUDA_LAUNCH_CHECK();
}

extern "C" void moe_cuda_z_loss_forward(double *acc, const void *logits, int N, int E,
                                        double coeff) {
    if (N <= 0)
        return;
    cudaStream_t st = moe_cuda_stream();
    float *lse = (float *)scratch(sizeof(float) * (size_t)N);
    lse_kernel<<<moe_cdiv(N, WARPS), 32 * WARPS, 0, st>>>(lse, (const moe_bf16 *)logits, N, E);
    MOE_CUDA_LAUNCH_CHECK();
    z_final_kernel<<<1, 256, 0, st>>>(acc, lse, N, coeff);
    MOE_CUDA_LAUNCH_CHECK();
}

extern "C" void moe_cuda_z_loss_backward(void *dlogits, const void *logits, int N, int E,
                                         double coeff, double scale) {
    if (N <= 0)
        return;
    z_loss_backward_kernel<<<moe_cdiv(N, WARPS), 32 * WARPS, 0, moe_cuda_stream()>>>(
        (moe_bf16 *)dlogits, (const moe_bf16 *)logits, N, E, (float)(scale * coeff * 2.0 / N));
    MOE_CUDA_LAUNCH_CHECK();
}

/* ------------------------------------------------- expert load and bias (aux-loss-free) */

/* load[e] += 1 for every pick e (integer atomics: order independent). */
static __global__ void load_add_kernel(long long *load, const int *topk_idx, size_t n) {
    const size_t a = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (a < n)
        atomicAdd((unsigned long long *)&load[topk_idx[a]], 1ull);
}

extern "C" void moe_cuda_expert_load_add(long long *load, const int *topk_idx, int N, int k,
                                         int E) {
    const size_t n = (size_t)N * k;
    if (n == 0)
        return;
    load_add_kernel<<<moe_cdiv(n, 256), 256, 0, moe_cuda_stream()>>>(load, topk_idx, n);
    MOE_CUDA_LAUNCH_CHECK();
}

/* moe_expert_bias_update() (lib/cpu/aux_loss.c) on the device: every thread sums the E counts
 * in the CPU's order for the mean (E is small), then moves its experts' biases by ±rate. */
static __global__ void bias_update_kernel(float *bias, const long long *load, int E, double rate,
                                          const int *flags) {
    if (flags && *flags)
        return; /* the step is skipped: its counts are not applied */
    double mean = 0.0;
    for (int e = 0; e < E; e++)
        mean += (double)load[e];
    mean /= E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const double off = mean - (double)load[e];
        bias[e] += (float)(rate * ((off > 0) - (off < 0)));
    }
}

extern "C" void moe_cuda_expert_bias_update(float *bias, const long long *load, int E,
                                            double rate, const int *flags) {
    bias_update_kernel<<<1, 256, 0, moe_cuda_stream()>>>(bias, load, E, rate, flags);
    MOE_CUDA_LAUNCH_CHECK();
}
