/*
 * The MoE router on the GPU: top-k selection and routing weights, forward and backward.
 * CPU twin: lib/cpu/router.c (the specification; read its comment for the gradients).
 *
 * Layout: ONE WARP PER TOKEN. A token's E logits (E <= 1024) are read by the 32 lanes in
 * a strided loop (lane l handles experts l, l+32, ...), and everything per token that is
 * not a plain elementwise map lives in a per-warp slice of shared memory:
 *
 *     sel[E]    the selection score (logit, softmax probability, or sigmoid + bias)
 *     prob[E]   the probabilities the weights come from (pre-softmax, sigmoid)
 *     taken[E]  which entries a top-k has already picked
 *     gs[G]     group scores (group-limited routing)
 *     ints      the k picked experts, the GK kept groups, a group's kg picks
 *
 * Top-k is k rounds of a warp arg-max. Every lane scans its strided entries in increasing
 * index order keeping the first strict maximum, then a butterfly of shuffles combines the
 * 32 candidates with the TOTAL order "larger value first, then lower index". That order
 * is exactly the CPU's rule (ties go to the lower index; −∞ entries lose to every finite
 * one but are still picked, lowest index first, if nothing else is left), and because it is
 * a total order every lane ends with the same winner. Picks come out best first.
 *
 * Variants (Megatron Core's semantics; docs/megatron.md lists which exist), all in fp32 (the CPU uses double; results agree to fp32 rounding):
 *   softmax      sel = z;           w_j = softmax over the k picked z
 *   pre-softmax  sel = p = softmax(z) over E;   w_j = p_{i_j} (no renormalisation)
 *   sigmoid      sel = σ(z) + bias; w_j = σ_j / (Σ_m σ_m + 1e-20) when k > 1, else σ_j
 *   group-limit  E experts in G groups of E/G; group score = Σ of its top k/GK sel;
 *                keep the GK best groups, set sel = −∞ elsewhere, then top-k as usual
 *   scaling      every weight times scaling_factor (when > 0)
 *
 * Backward (selection is piecewise constant, only the weights carry gradient), with
 * dw ← scaling·dw first:
 *   softmax      dz_{i_j} += w_j (dw_j − Σ_m w_m dw_m)
 *   pre-softmax  dp = dw scattered to the picked experts; dz_e += p_e (dp_e − Σ p·dp), all e
 *   sigmoid      S = Σσ + 1e-20; dσ_j = (dw_j − Σ_m dw_m σ_m/S)/S (k > 1) or dw_j (k = 1);
 *                dz_{i_j} += dσ_j σ_j (1 − σ_j)
 * The gradient is ACCUMULATED into the bf16 dlogits: read, add in fp32, round once.
 * Each warp owns its token's row, so there are no races and no atomics.
 */
#include <math.h>

#include "cuda_common.cuh"
#include "cuda_ops.h"

#define FULL_MASK 0xffffffffu

/* Warp reductions by butterfly: every lane ends with the same value (fp addition is
 * commutative, so partners compute identical sums), deterministic run to run. */
static __device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

/* Is candidate (ov, oi) before (bv, bi) in the order "larger value, then lower index"?
 * Index −1 means "no candidate" and loses to everything. */
static __device__ __forceinline__ bool better(float ov, int oi, float bv, int bi) {
    if (oi < 0)
        return false;
    if (bi < 0)
        return true;
    return ov > bv || (ov == bv && oi < bi);
}

/* Top-k of v[0..n) (shared memory) into idx[0..k) (shared), best first; taken[0..n) is
 * scratch. Called by all 32 lanes of a warp. */
static __device__ void warp_topk(int *idx, const float *v, int n, int k, unsigned char *taken,
                                 int lane) {
    for (int i = lane; i < n; i += 32)
        taken[i] = 0;
    __syncwarp();
    for (int j = 0; j < k; j++) {
        float bv = 0.0f;
        int bi = -1;
        for (int i = lane; i < n; i += 32) /* increasing i, strict >: lowest index kept */
            if (!taken[i] && (bi < 0 || v[i] > bv)) {
                bv = v[i];
                bi = i;
            }
        for (int off = 16; off; off >>= 1) {
            float ov = __shfl_xor_sync(FULL_MASK, bv, off);
            int oi = __shfl_xor_sync(FULL_MASK, bi, off);
            if (better(ov, oi, bv, bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == 0) {
            idx[j] = bi;
            taken[bi] = 1;
        }
        __syncwarp();
    }
}

/* Bytes of one warp's shared slice, and the offsets of its parts (16-byte aligned). */
struct router_smem {
    size_t sel, prob, gs, ints, taken, total;
};

static __host__ __device__ inline size_t align16(size_t x) { return (x + 15) & ~(size_t)15; }

static __host__ __device__ inline router_smem router_layout(int E, int k, int G, int GK) {
    router_smem L;
    int kg = G > 0 ? k / GK : 0;
    L.sel = 0;
    L.prob = L.sel + align16(sizeof(float) * E);
    L.gs = L.prob + align16(sizeof(float) * E);
    L.ints = L.gs + align16(sizeof(float) * (G > 0 ? G : 1));
    L.taken = L.ints + align16(sizeof(int) * (k + (G > 0 ? GK + kg : 0)));
    L.total = L.taken + align16(E);
    return L;
}

/* Warps per block: up to 4, fewer when E is large, so a block stays under 48 KiB. */
static int warps_for(size_t per_warp) {
    int w = (int)((48 * 1024) / per_warp);
    return w < 1 ? 1 : (w > 4 ? 4 : w);
}

static __global__ void router_forward_kernel(int *topk_idx, float *topk_w, const moe_bf16 *logits,
                                             const float *bias, moe_router_params p, int N) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int E = p.num_experts, k = p.topk, G = p.num_groups, GK = p.group_topk;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n = blockIdx.x * (blockDim.x >> 5) + warp;
    if (n >= N)
        return; /* the whole warp leaves together */
    const router_smem L = router_layout(E, k, G, GK);
    unsigned char *base = smem + (size_t)warp * L.total;
    float *sel = (float *)(base + L.sel), *prob = (float *)(base + L.prob);
    float *gs = (float *)(base + L.gs);
    int *idx = (int *)(base + L.ints);
    int *gidx = idx + k, *tmp = gidx + GK;
    unsigned char *taken = base + L.taken;
    const moe_bf16 *z = logits + (size_t)n * E;
    const float scale = p.scaling_factor > 0 ? (float)p.scaling_factor : 1.0f;
    const bool pre = p.score_fn == MOE_SCORE_SOFTMAX && p.pre_softmax;
    const bool sig = p.score_fn == MOE_SCORE_SIGMOID;

    /* 1. selection scores */
    if (pre) {
        float m = -INFINITY;
        for (int e = lane; e < E; e += 32)
            m = fmaxf(m, moe_ld(z[e]));
        m = moe_warp_max(m);
        float s = 0.0f;
        for (int e = lane; e < E; e += 32)
            s += (prob[e] = expf(moe_ld(z[e]) - m));
        s = moe_warp_sum(s);
        for (int e = lane; e < E; e += 32)
            sel[e] = (prob[e] /= s);
    } else if (sig) {
        for (int e = lane; e < E; e += 32) {
            prob[e] = sigmoidf_(moe_ld(z[e]));
            sel[e] = prob[e] + (bias ? bias[e] : 0.0f);
        }
    } else {
        for (int e = lane; e < E; e += 32)
            sel[e] = moe_ld(z[e]);
    }
    __syncwarp();

    /* 2. group limit: score the groups, keep the best GK, mask the rest to −∞ */
    if (G > 0) {
        const int per = E / G, kg = k / GK;
        for (int g = 0; g < G; g++) {
            warp_topk(tmp, sel + g * per, per, kg, taken, lane);
            if (lane == 0) {
                float s = 0.0f;
                for (int j = 0; j < kg; j++) /* in pick order, as the CPU sums */
                    s += sel[g * per + tmp[j]];
                gs[g] = s;
            }
            __syncwarp();
        }
        warp_topk(gidx, gs, G, GK, taken, lane);
        for (int e = lane; e < E; e += 32) {
            int g = e / per;
            bool kept = false;
            for (int j = 0; j < GK; j++)
                kept |= gidx[j] == g;
            if (!kept)
                sel[e] = -INFINITY;
        }
        __syncwarp();
    }

    /* 3. top-k */
    warp_topk(idx, sel, E, k, taken, lane);

    /* 4. weights */
    int *out_i = topk_idx + (size_t)n * k;
    float *out_w = topk_w + (size_t)n * k;
    if (pre) {
        for (int j = lane; j < k; j += 32) {
            out_i[j] = idx[j];
            out_w[j] = prob[idx[j]] * scale;
        }
    } else if (sig) {
        float S = 0.0f;
        for (int j = lane; j < k; j += 32)
            S += prob[idx[j]];
        S = moe_warp_sum(S);
        for (int j = lane; j < k; j += 32) {
            out_i[j] = idx[j];
            out_w[j] = (k > 1 ? prob[idx[j]] / (S + 1e-20f) : prob[idx[j]]) * scale;
        }
    } else { /* softmax over the k picked logits */
        float m, s;
        moe_warp_softmax_stats(z, idx, k, &m, &s);
        for (int j = lane; j < k; j += 32) {
            out_i[j] = idx[j];
            out_w[j] = expf(moe_ld(z[idx[j]]) - m) / s * scale;
        }
    }
}

static __global__ void router_backward_kernel(moe_bf16 *dlogits, const float *dtopk_w,
                                              const moe_bf16 *logits, const int *topk_idx,
                                              moe_router_params p, int N) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int E = p.num_experts, k = p.topk;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n = blockIdx.x * (blockDim.x >> 5) + warp;
    if (n >= N)
        return;
    const float scale = p.scaling_factor > 0 ? (float)p.scaling_factor : 1.0f;
    const moe_bf16 *z = logits + (size_t)n * E;
    moe_bf16 *dz = dlogits + (size_t)n * E;
    const int *idx = topk_idx + (size_t)n * k;
    const float *dw = dtopk_w + (size_t)n * k;

    if (p.score_fn == MOE_SCORE_SOFTMAX && p.pre_softmax) {
        /* dp = scaled dw scattered to the picked experts (in shared memory) */
        float *dp = (float *)(smem + (size_t)warp * align16(sizeof(float) * E));
        for (int e = lane; e < E; e += 32)
            dp[e] = 0.0f;
        __syncwarp();
        if (lane == 0)
            for (int j = 0; j < k; j++)
                dp[idx[j]] += scale * dw[j];
        __syncwarp();
        float m, s;
        moe_warp_softmax_stats(z, NULL, E, &m, &s);
        float dot = 0.0f;
        for (int e = lane; e < E; e += 32)
            dot += expf(moe_ld(z[e]) - m) / s * dp[e];
        dot = moe_warp_sum(dot);
        for (int e = lane; e < E; e += 32) {
            float pe = expf(moe_ld(z[e]) - m) / s;
            dz[e] = moe_st(moe_ld(dz[e]) + pe * (dp[e] - dot));
        }
    } else if (p.score_fn == MOE_SCORE_SOFTMAX) {
        float m, s;
        moe_warp_softmax_stats(z, idx, k, &m, &s);
        float dot = 0.0f;
        for (int j = lane; j < k; j += 32)
            dot += expf(moe_ld(z[idx[j]]) - m) / s * (scale * dw[j]);
        dot = moe_warp_sum(dot);
        for (int j = lane; j < k; j += 32) {
            float w = expf(moe_ld(z[idx[j]]) - m) / s;
            int e = idx[j];
            dz[e] = moe_st(moe_ld(dz[e]) + w * (scale * dw[j] - dot));
        }
    } else { /* sigmoid */
        float S = 0.0f;
        for (int j = lane; j < k; j += 32)
            S += sigmoidf_(moe_ld(z[idx[j]]));
        S = moe_warp_sum(S) + 1e-20f;
        float dot = 0.0f;
        for (int j = lane; j < k; j += 32)
            dot += scale * dw[j] * sigmoidf_(moe_ld(z[idx[j]])) / S;
        dot = moe_warp_sum(dot);
        for (int j = lane; j < k; j += 32) {
            int e = idx[j];
            float sg = sigmoidf_(moe_ld(z[e]));
            float dsig = k > 1 ? (scale * dw[j] - dot) / S : scale * dw[j];
            dz[e] = moe_st(moe_ld(dz[e]) + dsig * sg * (1.0f - sg));
        }
    }
}

extern "C" void moe_cuda_router_forward(int *topk_idx, moe_real *topk_w, const void *logits,
                                        const float *bias, const moe_router_params *p, int N) {
    if (N <= 0)
        return;
    const router_smem L = router_layout(p->num_experts, p->topk, p->num_groups, p->group_topk);
    const int warps = warps_for(L.total);
    router_forward_kernel<<<moe_cdiv(N, warps), 32 * warps, warps * L.total, moe_cuda_stream()>>>(
        topk_idx, topk_w, (const moe_bf16 *)logits, bias, *p, N);
    MOE_CUDA_LAUNCH_CHECK();
}

extern "C" void moe_cuda_router_backward(void *dlogits, const moe_real *dtopk_w, const void *logits,
                                         const int *topk_idx, const moe_router_params *p, int N) {
    if (N <= 0)
        return;
    const size_t per_warp = align16(sizeof(float) * p->num_experts);
    const int warps = warps_for(per_warp);
    router_backward_kernel<<<moe_cdiv(N, warps), 32 * warps, warps * per_warp, moe_cuda_stream()>>>(
        (moe_bf16 *)dlogits, dtopk_w, (const moe_bf16 *)logits, topk_idx, *p, N);
    MOE_CUDA_LAUNCH_CHECK();
}
