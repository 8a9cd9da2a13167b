/*
 * Causal grouped-query attention on the GPU (the CUDA twin of the naive attention of
 * lib/cpu/attention.c, moe_cpu_attention_naive_*; the CPU table now runs the flash version).
 *
 * The math, for query head h of sequence b, with key/value head g = h / (Hq/Hkv):
 *
 *   S[t,s] = q_t · k_s / √D                  (s ≤ t; −∞ above the diagonal)
 *   P[t,:] = softmax(S[t,:])                 saved in att [B, Hq, T, T] as bf16
 *   y_t    = Σ_s P[t,s] v_s
 *   lse_t  = log Σ_s exp(S[t,s]) = m_t + log l_t   (row max m, sum l = Σ exp(S − m); fp32)
 *
 *   backward, with dP[t,s] = dy_t · v_s and the row dot δ_t = Σ_s P[t,s] dP[t,s]:
 *   dv_s  += Σ_t P[t,s] dy_t
 *   dS     = P ⊙ (dP − δ)                    (the softmax Jacobian, row by row)
 *   dq_t  += Σ_s dS[t,s] k_s / √D
 *   dk_s  += Σ_t dS[t,s] q_t / √D
 *
 * Precision: activations are bf16 in memory; every product, the softmax and every
 * accumulation run in fp32; results are rounded to bf16 once, when they are stored.
 *
 * Design. This is the "materialised" attention of the chapters before flash attention
 * (chapter 07): it saves P in its op workspace (backend.h's attention contract: the
 * workspace is att, B·Hq·T·T bf16), so the T×T matrix is written once per head anyway.
 * Everything is cut into 64×64 tiles of that matrix. A thread block of 256 threads
 * (16×16, thread (ty, tx)) owns one tile at a time and computes a 4×4 micro-tile of it:
 * rows ty, ty+16, ty+32, ty+48 and columns tx, tx+16, tx+32, tx+48. The 64-row slices
 * of q, k, v, dy that a tile needs are staged in shared memory as fp32; products over
 * the head dimension D read them from there. A row of a tile lives in the 16 threads of
 * one half-warp, so row reductions (max, sum, δ) are warp shuffles.
 *
 * Shared-memory tiles are [64][LD] with LD = 16·NJ + 1, NJ = ceil(D/16) rounded up to
 * 2, 4 or 8 (the template parameter): columns D..LD−1 are zero, so inner loops need no
 * bounds tests, and the odd stride puts the 16 rows a half-warp reads in 16 different
 * banks. D may be anything up to 128; T anything (partial tiles are zero-padded).
 *
 *   forward   one block per (b, h, 64 query rows), two sweeps over the key tiles:
 *             1. S tile by tile → running row max m and sum l (online softmax),
 *                then lse = m + log l per row (fp32);
 *             2. S again → P = exp(S − m)/l → att (bf16) and y += P·V (P in fp32).
 *             Tiles above the diagonal are written as zeros. Recomputing S costs one
 *             extra Q·Kᵀ but keeps shared memory independent of T.
 *
 *   backward  reads the saved P (bf16, exactly what the forward stored; no recompute),
 *             so the backward of a head is two matmul-shaped passes:
 *     dq      one block per (b, h, 64 query rows). Sweep 1: dP = dy·vᵀ tile by tile →
 *             δ_t (kept, and written to a small fp32 scratch [B, Hq, T]). Sweep 2:
 *             dP again → dS → dq += dS·K/√D. The block owns its dq rows.
 *     dk, dv  one block per (b, g, 64 key rows). It loops, in a fixed order, over the
 *             query heads of group g and the query tiles at or below the diagonal, and
 *             builds the transposed tiles dPᵀ = v·dyᵀ, dSᵀ = Pᵀ ⊙ (dPᵀ − δ) to
 *             accumulate dv += Pᵀ·dY and dk += dSᵀ·Q/√D in registers. The block owns
 *             its dk, dv rows, so the several query heads that share a key/value head
 *             add up without atomics, in the same order every run: bitwise reproducible.
 *
 *             The contract also hands the backward y and lse; this backward reads P
 *             instead and does not touch them.
 *
 * Blocks are issued heaviest first (the causal triangle gives the last query tiles the
 * most work), and every launcher enqueues on moe_cuda_stream() without waiting.
 */
#include <math.h>

#include "cuda_common.cuh"
#include "cuda_ops.h"

#define ATT_TILE 64      /* rows and columns of a tile of the T×T matrix */
#define ATT_THREADS 256  /* 16 × 16 threads, a 4×4 micro-tile each */
#define ATT_LDP (ATT_TILE + 1) /* stride of 64×64 fp32 tiles in shared memory */

/* Stride of a [64][D] tile in shared memory (odd: see the header comment). */
template <int NJ> struct AttDims {
    static constexpr int DP = 16 * NJ;  /* padded head dimension */
    static constexpr int LD = DP + 1;
};

/* The largest head dimension the kernels handle (NJ = 8: 16·8 columns). */
#define ATT_MAX_D 128

/*
 * Stage rows row0..row0+63 of one head (D values from src + row·stride) into a
 * [64][LD] fp32 tile, times @p mul. Rows ≥ T and columns ≥ D become 0. Consecutive
 * threads read consecutive elements of a row: coalesced.
 */
template <int NJ>
static __device__ void att_load_rows(float *dst, const moe_bf16 *src, size_t stride, int row0,
                                     int T, int D, float mul) {
    constexpr int DP = AttDims<NJ>::DP, LD = AttDims<NJ>::LD;
    for (int i = threadIdx.x; i < ATT_TILE * DP; i += ATT_THREADS) {
        int r = i / DP, d = i % DP;
        int row = row0 + r;
        float x = 0.0f;
        if (row < T && d < D)
            x = moe_ld(src[(size_t)row * stride + d]) * mul;
        dst[r * LD + d] = x;
    }
}

/*
 * Stage the 64×64 tile P[t0.., s0..] of one head's probabilities (att rows of length T)
 * into shared memory, as fp32, only where s ≤ t < T (zero elsewhere, so the upper
 * triangle is never read). transpose = 0: dst[t][s]; 1: dst[s][t].
 */
static __device__ void att_load_p(float *dst, const moe_bf16 *P, int t0, int s0, int T,
                                  int transpose) {
    for (int i = threadIdx.x; i < ATT_TILE * ATT_TILE; i += ATT_THREADS) {
        int r = i / ATT_TILE, c = i % ATT_TILE; /* r: query row, c: key column */
        int t = t0 + r, s = s0 + c;
        float p = 0.0f;
        if (t < T && s <= t)
            p = moe_ld(P[(size_t)t * T + s]);
        dst[transpose ? c * ATT_LDP + r : r * ATT_LDP + c] = p;
    }
}

/*
 * The micro-tile of a "row dot" product over the head dimension:
 *   acc[i][j] = Σ_d A[ty+16i][d] · B[tx+16j][d]
 * (S = Q·Kᵀ, dP = dY·Vᵀ, dPᵀ = V·dYᵀ), A and B [64][LD] tiles in shared memory.
 */
template <int NJ>
static __device__ __forceinline__ void att_rowdot(float acc[4][4], const float *A, const float *B,
                                                  int D) {
    constexpr int LD = AttDims<NJ>::LD;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
            acc[i][j] = 0.0f;
    for (int d = 0; d < D; d++) {
        float a[4], b[4];
#pragma unroll
        for (int i = 0; i < 4; i++)
            a[i] = A[(ty + 16 * i) * LD + d];
#pragma unroll
        for (int j = 0; j < 4; j++)
            b[j] = B[(tx + 16 * j) * LD + d];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
                acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
}

/*
 * The micro-tile of a "tile times rows" product:
 *   acc[i][j] += Σ_c W[ty+16i][c] · X[c][tx+16j]
 * (y += P·V, dq += dS·K, dv += Pᵀ·dY, dk += dSᵀ·Q), W a 64×64 tile, X a [64][LD] tile.
 */
template <int NJ>
static __device__ __forceinline__ void att_tilemul(float acc[4][NJ], const float *W,
                                                   const float *X) {
    constexpr int LD = AttDims<NJ>::LD;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
#pragma unroll 4
    for (int c = 0; c < ATT_TILE; c++) {
        float w[4];
#pragma unroll
        for (int i = 0; i < 4; i++)
            w[i] = W[(ty + 16 * i) * ATT_LDP + c];
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            float x = X[c * LD + tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; i++)
                acc[i][j] = fmaf(w[i], x, acc[i][j]);
        }
    }
}

/* Sum / max over the 16 threads (tx) of a half-warp that share a row. */
static __device__ __forceinline__ float att_row_sum(float x) {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1)
        x += __shfl_xor_sync(0xffffffffu, x, o, 16);
    return x;
}
static __device__ __forceinline__ float att_row_max(float x) {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1)
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o, 16));
    return x;
}

/* Blocks run heaviest first: block x handles the (n−1−x)-th tile of the sequence. */
static __device__ __forceinline__ int att_tile_of_block(int ntiles) {
    return ntiles - 1 - (int)blockIdx.x;
}

/* ------------------------------------------------------------------------- forward */

template <int NJ>
__global__ void __launch_bounds__(ATT_THREADS)
    att_forward_kernel(moe_bf16 *y, float *lse, moe_bf16 *att, const moe_bf16 *q,
                       const moe_bf16 *k, const moe_bf16 *v, int T, int Hq, int Hkv, int D,
                       float scale) {
    constexpr int LD = AttDims<NJ>::LD;
    extern __shared__ float smem[];
    float *Qs = smem;                      /* [64][LD]  q_t · scale */
    float *Ks = Qs + ATT_TILE * LD;        /* [64][LD]  k_s */
    float *Vs = Ks + ATT_TILE * LD;        /* [64][LD]  v_s */
    float *Ps = Vs + ATT_TILE * LD;        /* [64][65]  P tile, fp32 */

    const int ntiles = (T + ATT_TILE - 1) / ATT_TILE;
    const int qt = att_tile_of_block(ntiles), h = blockIdx.y, b = blockIdx.z;
    const int g = h / (Hq / Hkv), t0 = qt * ATT_TILE;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    const size_t qs = (size_t)Hq * D, kvs = (size_t)Hkv * D;
    const moe_bf16 *qb = q + (size_t)b * T * qs + (size_t)h * D;
    const moe_bf16 *kb = k + (size_t)b * T * kvs + (size_t)g * D;
    const moe_bf16 *vb = v + (size_t)b * T * kvs + (size_t)g * D;
    moe_bf16 *P = att + ((size_t)b * Hq + h) * T * T;

    att_load_rows<NJ>(Qs, qb, qs, t0, T, D, scale);

    /* Sweep 1: online softmax statistics. Each thread keeps, for its 4 rows, the max
     * m and the sum l = Σ exp(S − m) over the columns it has seen; the 16 threads of a
     * row merge theirs at the end. */
    float m[4], l[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    for (int st = 0; st <= qt; st++) {
        const int s0 = st * ATT_TILE;
        __syncthreads(); /* the previous tile's readers are done with Ks */
        att_load_rows<NJ>(Ks, kb, kvs, s0, T, D, 1.0f);
        __syncthreads();
        float S[4][4];
        att_rowdot<NJ>(S, Qs, Ks, D);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int t = t0 + ty + 16 * i;
            float mt = m[i];
#pragma unroll
            for (int j = 0; j < 4; j++)
                if (s0 + tx + 16 * j <= t)
                    mt = fmaxf(mt, S[i][j]);
            if (mt == -INFINITY)
                continue; /* nothing unmasked yet in this thread's part of the row */
            float sum = l[i] * expf(m[i] - mt);
#pragma unroll
            for (int j = 0; j < 4; j++)
                if (s0 + tx + 16 * j <= t)
                    sum += expf(S[i][j] - mt);
            m[i] = mt;
            l[i] = sum;
        }
    }
    float inv_l[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float mrow = att_row_max(m[i]);
        const float part = m[i] == -INFINITY ? 0.0f : l[i] * expf(m[i] - mrow);
        const float lrow = att_row_sum(part);
        m[i] = mrow;
        inv_l[i] = lrow > 0.0f ? 1.0f / lrow : 0.0f; /* 0 only for padding rows t ≥ T */
        const int t = t0 + ty + 16 * i;
        if (tx == 0 && t < T)
            lse[((size_t)b * Hq + h) * T + t] = mrow + logf(lrow);
    }

    /* Sweep 2: P = exp(S − m) / l → att and y. */
    float acc[4][NJ];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < NJ; j++)
            acc[i][j] = 0.0f;
    for (int st = 0; st <= qt; st++) {
        const int s0 = st * ATT_TILE;
        __syncthreads(); /* previous readers of Ks, Vs, Ps are done */
        att_load_rows<NJ>(Ks, kb, kvs, s0, T, D, 1.0f);
        att_load_rows<NJ>(Vs, vb, kvs, s0, T, D, 1.0f);
        __syncthreads();
        float S[4][4];
        att_rowdot<NJ>(S, Qs, Ks, D);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = ty + 16 * i;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int c = tx + 16 * j;
                Ps[r * ATT_LDP + c] =
                    s0 + c <= t0 + r ? expf(S[i][j] - m[i]) * inv_l[i] : 0.0f;
            }
        }
        __syncthreads();
        /* write the tile row by row (coalesced), then y += P·V with P in fp32 */
        for (int e = threadIdx.x; e < ATT_TILE * ATT_TILE; e += ATT_THREADS) {
            const int r = e / ATT_TILE, c = e % ATT_TILE;
            if (t0 + r < T && s0 + c < T)
                P[(size_t)(t0 + r) * T + s0 + c] = moe_st(Ps[r * ATT_LDP + c]);
        }
        att_tilemul<NJ>(acc, Ps, Vs);
    }
    /* the tiles right of the diagonal tile: masked, written as 0 */
    const int s_from = (qt + 1) * ATT_TILE;
    if (s_from < T) {
        const int width = T - s_from;
        const moe_bf16 zero = moe_st(0.0f);
        for (int e = threadIdx.x; e < ATT_TILE * width; e += ATT_THREADS) {
            const int r = e / width, c = e % width;
            if (t0 + r < T)
                P[(size_t)(t0 + r) * T + s_from + c] = zero;
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int t = t0 + ty + 16 * i;
        if (t >= T)
            continue;
        moe_bf16 *yt = y + ((size_t)b * T + t) * qs + (size_t)h * D;
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            const int d = tx + 16 * j;
            if (d < D)
                yt[d] = moe_st(acc[i][j]);
        }
    }
}

/* ------------------------------------------------------------------------ backward */

/* dq (and the row dots δ) for one (b, h, 64 query rows). */
template <int NJ>
__global__ void __launch_bounds__(ATT_THREADS)
    att_backward_dq_kernel(moe_bf16 *dq, float *delta, const moe_bf16 *dy, const moe_bf16 *att,
                           const moe_bf16 *k, const moe_bf16 *v, int T, int Hq, int Hkv, int D,
                           float scale) {
    constexpr int LD = AttDims<NJ>::LD;
    extern __shared__ float smem[];
    float *dYs = smem;                     /* [64][LD]  dy_t */
    float *Ks = dYs + ATT_TILE * LD;       /* [64][LD]  k_s */
    float *Vs = Ks + ATT_TILE * LD;        /* [64][LD]  v_s */
    float *Ps = Vs + ATT_TILE * LD;        /* [64][65]  P[t][s] */
    float *dSs = Ps + ATT_TILE * ATT_LDP;  /* [64][65]  dS[t][s] */

    const int ntiles = (T + ATT_TILE - 1) / ATT_TILE;
    const int qt = att_tile_of_block(ntiles), h = blockIdx.y, b = blockIdx.z;
    const int g = h / (Hq / Hkv), t0 = qt * ATT_TILE;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    const size_t qs = (size_t)Hq * D, kvs = (size_t)Hkv * D;
    const moe_bf16 *kb = k + (size_t)b * T * kvs + (size_t)g * D;
    const moe_bf16 *vb = v + (size_t)b * T * kvs + (size_t)g * D;
    const moe_bf16 *P = att + ((size_t)b * Hq + h) * T * T;

    att_load_rows<NJ>(dYs, dy + (size_t)b * T * qs + (size_t)h * D, qs, t0, T, D, 1.0f);

    /* Sweep 1: δ_t = Σ_s P[t,s] dP[t,s], each thread over its columns, then per row. */
    float dl[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int st = 0; st <= qt; st++) {
        const int s0 = st * ATT_TILE;
        __syncthreads();
        att_load_rows<NJ>(Vs, vb, kvs, s0, T, D, 1.0f);
        att_load_p(Ps, P, t0, s0, T, 0);
        __syncthreads();
        float dP[4][4];
        att_rowdot<NJ>(dP, dYs, Vs, D);
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
                dl[i] = fmaf(Ps[(ty + 16 * i) * ATT_LDP + tx + 16 * j], dP[i][j], dl[i]);
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        dl[i] = att_row_sum(dl[i]);
        const int t = t0 + ty + 16 * i;
        if (tx == 0 && t < T)
            delta[((size_t)b * Hq + h) * T + t] = dl[i];
    }

    /* Sweep 2: dS = P ⊙ (dP − δ), dq += dS·K. */
    float acc[4][NJ];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < NJ; j++)
            acc[i][j] = 0.0f;
    for (int st = 0; st <= qt; st++) {
        const int s0 = st * ATT_TILE;
        __syncthreads();
        att_load_rows<NJ>(Ks, kb, kvs, s0, T, D, 1.0f);
        att_load_rows<NJ>(Vs, vb, kvs, s0, T, D, 1.0f);
        att_load_p(Ps, P, t0, s0, T, 0);
        __syncthreads();
        float dP[4][4];
        att_rowdot<NJ>(dP, dYs, Vs, D);
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int e = (ty + 16 * i) * ATT_LDP + tx + 16 * j;
                dSs[e] = Ps[e] * (dP[i][j] - dl[i]);
            }
        __syncthreads();
        att_tilemul<NJ>(acc, dSs, Ks);
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int t = t0 + ty + 16 * i;
        if (t >= T)
            continue;
        moe_bf16 *dqt = dq + ((size_t)b * T + t) * qs + (size_t)h * D;
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            const int d = tx + 16 * j;
            if (d < D)
                dqt[d] = moe_st(moe_ld(dqt[d]) + acc[i][j] * scale);
        }
    }
}

/* dk and dv for one (b, g, 64 key rows), summed over the query heads of group g. */
template <int NJ>
__global__ void __launch_bounds__(ATT_THREADS)
    att_backward_dkdv_kernel(moe_bf16 *dk, moe_bf16 *dv, const float *delta, const moe_bf16 *dy,
                             const moe_bf16 *att, const moe_bf16 *q, const moe_bf16 *v, int T,
                             int Hq, int Hkv, int D, float scale) {
    constexpr int LD = AttDims<NJ>::LD;
    extern __shared__ float smem[];
    float *Vs = smem;                      /* [64][LD]  v_s (for the whole block) */
    float *Qs = Vs + ATT_TILE * LD;        /* [64][LD]  q_t */
    float *dYs = Qs + ATT_TILE * LD;       /* [64][LD]  dy_t */
    float *Pt = dYs + ATT_TILE * LD;       /* [64][65]  Pᵀ[s][t] */
    float *dSt = Pt + ATT_TILE * ATT_LDP;  /* [64][65]  dSᵀ[s][t] */
    float *dls = dSt + ATT_TILE * ATT_LDP; /* [64]      δ_t */

    const int ntiles = (T + ATT_TILE - 1) / ATT_TILE;
    const int kt = att_tile_of_block(ntiles), g = blockIdx.y, b = blockIdx.z;
    const int rep = Hq / Hkv, s0 = kt * ATT_TILE;
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    const size_t qs = (size_t)Hq * D, kvs = (size_t)Hkv * D;

    att_load_rows<NJ>(Vs, v + (size_t)b * T * kvs + (size_t)g * D, kvs, s0, T, D, 1.0f);

    float accv[4][NJ], acck[4][NJ];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            accv[i][j] = 0.0f;
            acck[i][j] = 0.0f;
        }
    for (int h = g * rep; h < (g + 1) * rep; h++) {
        const moe_bf16 *P = att + ((size_t)b * Hq + h) * T * T;
        const float *dlh = delta + ((size_t)b * Hq + h) * T;
        for (int qt = kt; qt < ntiles; qt++) { /* query tiles at or below the diagonal */
            const int t0 = qt * ATT_TILE;
            __syncthreads();
            att_load_rows<NJ>(Qs, q + (size_t)b * T * qs + (size_t)h * D, qs, t0, T, D, 1.0f);
            att_load_rows<NJ>(dYs, dy + (size_t)b * T * qs + (size_t)h * D, qs, t0, T, D,
                              1.0f);
            att_load_p(Pt, P, t0, s0, T, 1);
            if (threadIdx.x < ATT_TILE)
                dls[threadIdx.x] = t0 + (int)threadIdx.x < T ? dlh[t0 + threadIdx.x] : 0.0f;
            __syncthreads();
            float dPt[4][4]; /* dPᵀ[s][t] = v_s · dy_t */
            att_rowdot<NJ>(dPt, Vs, dYs, D);
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int e = (ty + 16 * i) * ATT_LDP + tx + 16 * j;
                    dSt[e] = Pt[e] * (dPt[i][j] - dls[tx + 16 * j]);
                }
            __syncthreads();
            att_tilemul<NJ>(accv, Pt, dYs);
            att_tilemul<NJ>(acck, dSt, Qs);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int s = s0 + ty + 16 * i;
        if (s >= T)
            continue;
        moe_bf16 *dks = dk + ((size_t)b * T + s) * kvs + (size_t)g * D;
        moe_bf16 *dvs = dv + ((size_t)b * T + s) * kvs + (size_t)g * D;
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            const int d = tx + 16 * j;
            if (d < D) {
                dks[d] = moe_st(moe_ld(dks[d]) + acck[i][j] * scale);
                dvs[d] = moe_st(moe_ld(dvs[d]) + accv[i][j]);
            }
        }
    }
}

/* ----------------------------------------------------------------------- launchers */

/* Dynamic shared memory of each kernel, in bytes. */
template <int NJ> static size_t att_smem_forward(void) {
    return (3 * (size_t)ATT_TILE * AttDims<NJ>::LD + (size_t)ATT_TILE * ATT_LDP) * sizeof(float);
}
template <int NJ> static size_t att_smem_backward(void) {
    return (3 * (size_t)ATT_TILE * AttDims<NJ>::LD + 2 * (size_t)ATT_TILE * ATT_LDP + ATT_TILE) *
           sizeof(float);
}

template <int NJ>
static void att_forward_launch(moe_bf16 *y, float *lse, moe_bf16 *att, const moe_bf16 *q,
                               const moe_bf16 *k, const moe_bf16 *v, int B, int T, int Hq,
                               int Hkv, int D) {
    const size_t smem = att_smem_forward<NJ>();
    MOE_CUDA_CHECK(cudaFuncSetAttribute(att_forward_kernel<NJ>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    dim3 grid(moe_cdiv(T, ATT_TILE), Hq, B);
    att_forward_kernel<NJ><<<grid, ATT_THREADS, smem, moe_cuda_stream()>>>(
        y, lse, att, q, k, v, T, Hq, Hkv, D, (float)(1.0 / sqrt((double)D)));
    MOE_CUDA_LAUNCH_CHECK();
}

template <int NJ>
static void att_backward_launch(moe_bf16 *dq, moe_bf16 *dk, moe_bf16 *dv, const moe_bf16 *dy,
                                const moe_bf16 *att, const moe_bf16 *q, const moe_bf16 *k,
                                const moe_bf16 *v, int B, int T, int Hq, int Hkv, int D) {
    const size_t smem = att_smem_backward<NJ>();
    const float scale = (float)(1.0 / sqrt((double)D));
    cudaStream_t st = moe_cuda_stream();
    /* δ [B, Hq, T]: a scratch slot, sized by the first backward and kept (no allocation per
     * step, and an address a CUDA graph can keep: chapter 06) */
    float *delta = (float *)moe_cuda_scratch(MOE_SCRATCH_ATTENTION,
                                             (size_t)B * Hq * T * sizeof(float));

    MOE_CUDA_CHECK(cudaFuncSetAttribute(att_backward_dq_kernel<NJ>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    dim3 grid_q(moe_cdiv(T, ATT_TILE), Hq, B);
    att_backward_dq_kernel<NJ><<<grid_q, ATT_THREADS, smem, st>>>(dq, delta, dy, att, k, v, T,
                                                                  Hq, Hkv, D, scale);
    MOE_CUDA_LAUNCH_CHECK();

    MOE_CUDA_CHECK(cudaFuncSetAttribute(att_backward_dkdv_kernel<NJ>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    dim3 grid_kv(moe_cdiv(T, ATT_TILE), Hkv, B);
    att_backward_dkdv_kernel<NJ><<<grid_kv, ATT_THREADS, smem, st>>>(dk, dv, delta, dy, att, q,
                                                                     v, T, Hq, Hkv, D, scale);
    MOE_CUDA_LAUNCH_CHECK();
}

/* The naive kernels' workspace: P [B, Hq, T, T] in bf16. */
extern "C" size_t moe_cuda_attention_workspace_bytes(moe_attention_shape s) {
    return sizeof(moe_bf16) * (size_t)s.B * s.Hq * s.Tq * s.Tk;
}

/* Only a chunk attending to itself (Tq = Tk, q_pos = k_pos): the mask is then s ≤ t, which
 * is what the kernels apply; the offsets enter only through RoPE. */
extern "C" void moe_cuda_attention_forward(void *y, moe_real *lse, void *ws, const void *q,
                                           const void *k, const void *v, moe_attention_shape s) {
    moe_attention_shape_require(s, "moe_cuda_attention", ATT_MAX_D);
    const int B = s.B, T = s.Tq, Hq = s.Hq, Hkv = s.Hkv, D = s.D;
    if (B < 1)
        return;
    moe_bf16 *Y = (moe_bf16 *)y, *A = (moe_bf16 *)ws;
    const moe_bf16 *Q = (const moe_bf16 *)q, *K = (const moe_bf16 *)k, *V = (const moe_bf16 *)v;
    if (D <= 32)
        att_forward_launch<2>(Y, lse, A, Q, K, V, B, T, Hq, Hkv, D);
    else if (D <= 64)
        att_forward_launch<4>(Y, lse, A, Q, K, V, B, T, Hq, Hkv, D);
    else
        att_forward_launch<8>(Y, lse, A, Q, K, V, B, T, Hq, Hkv, D);
}

extern "C" void moe_cuda_attention_backward(void *dq, void *dk, void *dv, const void *dy,
                                            const void *y, const moe_real *lse, void *ws,
                                            const void *q, const void *k, const void *v,
                                            moe_attention_shape s) {
    moe_attention_shape_require(s, "moe_cuda_attention", ATT_MAX_D);
    const int B = s.B, T = s.Tq, Hq = s.Hq, Hkv = s.Hkv, D = s.D;
    if (B < 1)
        return;
    moe_bf16 *dQ = (moe_bf16 *)dq, *dK = (moe_bf16 *)dk, *dV = (moe_bf16 *)dv;
    const moe_bf16 *dY = (const moe_bf16 *)dy, *A = (const moe_bf16 *)ws;
    const moe_bf16 *Q = (const moe_bf16 *)q, *K = (const moe_bf16 *)k, *V = (const moe_bf16 *)v;
    if (D <= 32)
        att_backward_launch<2>(dQ, dK, dV, dY, A, Q, K, V, B, T, Hq, Hkv, D);
    else if (D <= 64)
        att_backward_launch<4>(dQ, dK, dV, dY, A, Q, K, V, B, T, Hq, Hkv, D);
    else
        att_backward_launch<8>(dQ, dK, dV, dY, A, Q, K, V, B, T, Hq, Hkv, D);
}
