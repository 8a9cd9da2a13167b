/*
 * Causal grouped-query flash attention on the GPU, on tensor cores (the CUDA twin of the CPU
 * flash attention of lib/cpu/attention.c, moe_cpu_attention_forward/backward).
 *
 * The math, for query head h of sequence b, with key/value head g = h / (Hq/Hkv), query row
 * t at absolute position q_pos + t and key row s at k_pos + s:
 *
 *   S[t,s] = q_t · k_s / √D     if k_pos + s ≤ q_pos + t (causal), else −∞
 *   P[t,:] = softmax(S[t,:]),   y_t = Σ_s P[t,s] v_s,   lse_t = log Σ_s exp(S[t,s])
 *
 *   backward, with dP[t,s] = dy_t · v_s and δ_t = Σ_s P[t,s] dP[t,s] = dy_t · y_t:
 *   dS = P ⊙ (dP − δ),  dv_s += Σ_t P[t,s] dy_t,  dq_t += Σ_s dS[t,s] k_s / √D,
 *   dk_s += Σ_t dS[t,s] q_t / √D.
 *
 * A query row that sees no key of the chunk (q_pos + t < k_pos) gets y = 0 and lse = −∞.
 *
 * Precision: q, k, v, y, dy and the gradients are bf16 in memory; S, the softmax, dP, dS and
 * every accumulation are fp32 (the tensor cores' bf16 × bf16 → fp32 products). P and dS are
 * rounded to bf16 only where they enter a product with a bf16 operand (P·V, dS·K, ...), as in
 * FlashAttention-2; the row statistics m, l and lse stay fp32.
 *
 * Design: FlashAttention-2 on mma.sync.m16n8k16 (bf16 → fp32), which every GPU since Ampere
 * runs, so the same source builds for sm_90a and sm_100a. On an sm_90 GPU the forward of
 * head dims 64 and 128 runs the Hopper kernel of attention_sm90.cu instead (wgmma, TMA and
 * warp-specialised producer / consumer warps, FlashAttention-3's ideas; MOE_FLASH_SM90=0
 * keeps this one). The backward computes δ here, then offers the work to the Hopper
 * backward of attention_sm90_bwd.cu (D = 64, 128 on sm_90; MOE_FLASH_SM90_BWD=0 keeps this
 * file's) and otherwise runs this file's kernels.
 *
 *   tiles     a block has 4 warps (128 threads); each warp owns MT m-tiles of 16 rows (32
 *             rows with MT = 2). Forward and dq: a block owns 4·16·MT query rows and walks
 *             the key tiles its rows can see. Each warp computes its slice of S = Q·Kᵀ with
 *             mma, keeps it in registers, and reuses the accumulator layout of S directly as
 *             the A operand of the next product (two 16 × 8 fp32 accumulators = one 16 × 16
 *             bf16 A fragment), so neither P nor dS ever touches shared memory. Operands
 *             come from shared memory through ldmatrix (.trans where the product needs the
 *             tile's columns: V in P·V, K in dS·K, Q and dY in the dk/dv products); every
 *             B fragment read serves the warp's MT m-tiles, which is what MT buys: at MT = 1
 *             a warp reads about as many shared-memory bytes per mma as the SM can deliver,
 *             so the tensor cores wait. MT = 2 needs up to 255 registers; FaConfig picks MT
 *             and the tile lengths per head dimension so that nothing spills. Which tiling
 *             runs is measured (see fa_wide_forward): the wide forward from 512 query rows,
 *             the narrow backward; MOE_FLASH_MT=1 or 2 forces one (the tests run both).
 *   memory    tiles are [rows][DP + 8] bf16 in shared memory, DP the head dimension padded
 *             to 32, 64 or 128 (the template parameter; columns D..DP−1 are loaded as zeros,
 *             so any D ≤ 128 runs and only d < D is stored). The 16 extra bytes per row put
 *             the 8 rows an ldmatrix reads in 8 different bank groups. Loads are cp.async,
 *             16 bytes each (zero-filled outside the tensor) when D is a multiple of 8 and
 *             the tensors are 16-byte aligned, else plain element loads. Key tiles (or the
 *             dk/dv kernel's query tiles) are double-buffered: tile j+1 is in flight while
 *             tile j is computed, one __syncthreads per tile.
 *   forward   the online softmax per row: running max m and sum l (each thread over its
 *             columns; the 4 threads of a row merge l at the end), o rescaled by
 *             exp(m_old − m_new) whenever the max grows. Exponentials are exp2 with the
 *             scale and log2(e) folded in. y = o / l, lse = m/√D + log l. No T × T buffer.
 *   backward  three kernels, none with atomics (the price: S and dP are computed twice,
 *             once for dq and once for dk, dv: 7 tile products where FlashAttention-2's
 *             backward, which adds dq with atomics, has 5):
 *     δ       δ_t = dy_t · y_t per (b, t, h), one warp a row, into the op workspace
 *             [B, Hq, Tq] fp32 (the workspace is O(B·Hq·T), nothing else);
 *     dq      one block per (b, h, query tile): P = exp(S − lse) recomputed tile by tile,
 *             dP = dY·Vᵀ, dS = P ⊙ (dP − δ), dq += dS·K/√D in registers; it owns its rows;
 *     dk, dv  one block per (b, g, key tile), 16·MT keys per warp: it works on the transposed
 *             tiles Sᵀ = K·Qᵀ and dPᵀ = V·dYᵀ, looping over the query heads of group g and
 *             the query tiles that see its keys, always in the same order, and accumulates
 *             dv += Pᵀ·dY and dk += dSᵀ·Q/√D in registers. The block owns its dk, dv rows.
 *             Every output element is summed by one thread in a fixed order, so two runs
 *             give the same bits.
 *   order     the heaviest blocks are issued first: the tile index is the grid's slowest
 *             dimension, so all (b, h) of the last query tile (forward, dq: it sees the
 *             most keys) or of the first key tile (dk/dv: seen by the most queries) go first.
 *
 * Every launcher enqueues on moe_cuda_stream() without waiting.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_common.cuh"
#include "cuda_ops.h"

#define FA_MAX_D 128    /* the largest head dimension (padded head dims 32, 64, 128) */
#define FA_WARPS 4      /* warps per block */
#define FA_THREADS (32 * FA_WARPS)
#define FA_LOG2E 1.4426950408889634f

/* The launch arguments every kernel shares. */
struct FaArgs {
    int Tq, Tk, Hq, Hkv, D;
    int off;     /* q_pos − k_pos: query t sees key s iff s ≤ t + off */
    float scale; /* 1/√D */
    int vec;     /* tiles move as 16-byte cp.async (D % 8 == 0, aligned tensors) */
};

/* ------------------------------------------------------------------ PTX helpers */

static __device__ __forceinline__ uint32_t fa_smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16 bytes global → shared, asynchronously; !full: 16 zero bytes (nothing is read). */
static __device__ __forceinline__ void fa_cp_async16(void *dst, const void *src, bool full) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(fa_smem_addr(dst)),
                 "l"(src), "r"(full ? 16 : 0));
}
static __device__ __forceinline__ void fa_cp_async_commit(void) {
    asm volatile("cp.async.commit_group;\n" ::);
}
static __device__ __forceinline__ void fa_cp_async_wait_all(void) {
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

/* Four 8×8 bf16 matrices from shared memory; lane i gives the address of row i%8 of
 * matrix i/8. r[j] holds, in lane l, row l/4, columns 2(l%4) and 2(l%4)+1 of matrix j
 * (.trans: of the transposed matrix). */
static __device__ __forceinline__ void fa_ldsm4(uint32_t r[4], const moe_bf16 *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(fa_smem_addr(p)));
}
static __device__ __forceinline__ void fa_ldsm4_t(uint32_t r[4], const moe_bf16 *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(fa_smem_addr(p)));
}

/* c (16×8 fp32) += a (16×16 bf16, row-major) · b (16×8 bf16, column-major). Lane l, with
 * r = l/4 and c = 2(l%4): c[0..1] = row r, cols c, c+1; c[2..3] = row r+8; a[0] = row r,
 * k = c, c+1; a[1] = row r+8; a[2], a[3] the same at k + 8; b[0] = k = c, c+1, col r;
 * b[1] at k + 8. */
static __device__ __forceinline__ void fa_mma(float c[4], const uint32_t a[4], uint32_t b0,
                                              uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Two floats → one register of two bf16 (lo in the low half: the lower column). */
static __device__ __forceinline__ uint32_t fa_pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

/* The A fragment (16 rows × 16 columns k0..k0+15) made of two 16×8 accumulators, the
 * n-blocks k0/8 and k0/8 + 1: their layouts line up with A's (FlashAttention-2's trick). */
static __device__ __forceinline__ void fa_acc_to_a(uint32_t a[4], const float lo[4],
                                                   const float hi[4]) {
    a[0] = fa_pack(lo[0], lo[1]);
    a[1] = fa_pack(lo[2], lo[3]);
    a[2] = fa_pack(hi[0], hi[1]);
    a[3] = fa_pack(hi[2], hi[3]);
}

/* ------------------------------------------------------------------ tiles */

/* Row stride of a tile in shared memory, in bf16 (see the header comment). */
template <int DP> struct FaTile {
    static constexpr int LD = DP + 8;
};

/*
 * Stage rows row0..row0+R−1 of one head (D values from src + row·stride) into the
 * [R][LD] tile dst. Rows ≥ nrows and columns ≥ D become 0. Asynchronous when a.vec (the
 * caller commits and waits), else plain loads (visible after the next __syncthreads).
 */
template <int DP, int R>
static __device__ __forceinline__ void fa_load_tile(moe_bf16 *dst, const moe_bf16 *src,
                                                    size_t stride, int row0, int nrows,
                                                    const FaArgs &a) {
    constexpr int LD = FaTile<DP>::LD, CH = DP / 8;
    if (a.vec) {
        for (int i = threadIdx.x; i < R * CH; i += FA_THREADS) {
            const int r = i / CH, c = (i % CH) * 8, row = row0 + r;
            const bool in = row < nrows && c < a.D;
            fa_cp_async16(dst + r * LD + c, in ? src + (size_t)row * stride + c : src, in);
        }
    } else {
        for (int i = threadIdx.x; i < R * DP; i += FA_THREADS) {
            const int r = i / DP, c = i % DP, row = row0 + r;
            dst[r * LD + c] =
                row < nrows && c < a.D ? src[(size_t)row * stride + c] : moe_st(0.0f);
        }
    }
}

/*
 * acc[m][n] = A · Bᵀ over the padded head dimension, for MT m-tiles of 16 rows of A (the
 * warp's rows, from As) and NB n-blocks of 8 rows of B (from Bs), both [..][LD] tiles in
 * shared memory: S = Q·Kᵀ, dP = dY·Vᵀ, Sᵀ = K·Qᵀ, dPᵀ = V·dYᵀ. Each B fragment read from
 * shared memory serves MT m-tiles: the warp's rows are its reuse factor.
 */
template <int DP, int MT, int NB>
static __device__ __forceinline__ void fa_gemm_abt(float acc[MT][NB][4], const moe_bf16 *As,
                                                   const moe_bf16 *Bs) {
    constexpr int LD = FaTile<DP>::LD;
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int n = 0; n < NB; n++)
            acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < DP / 16; kk++) {
        uint32_t af[MT][4];
#pragma unroll
        for (int m = 0; m < MT; m++)
            fa_ldsm4(af[m], As + (m * 16 + lane % 16) * LD + kk * 16 + (lane / 16) * 8);
#pragma unroll
        for (int n = 0; n < NB; n += 2) {
            uint32_t bf[4]; /* rows 8n..8n+15 of B: b of n-block n is bf[0..1], n+1 bf[2..3] */
            fa_ldsm4(bf, Bs + (n * 8 + lane % 8 + (lane / 16) * 8) * LD + kk * 16 +
                             ((lane / 8) % 2) * 8);
#pragma unroll
            for (int m = 0; m < MT; m++) {
                fa_mma(acc[m][n], af[m], bf[0], bf[1]);
                fa_mma(acc[m][n + 1], af[m], bf[2], bf[3]);
            }
        }
    }
}

/*
 * out[m][n] (DP/8 n-blocks) += W · X, W [16·MT rows][8·NB columns] in registers
 * (accumulator layout, rounded to bf16 here), X [8·NB rows][DP] in shared memory read by
 * rows (ldmatrix .trans): y += P·V, dq += dS·K, dv += Pᵀ·dY, dk += dSᵀ·Q.
 */
template <int DP, int MT, int NB>
static __device__ __forceinline__ void fa_gemm_wx(float out[MT][DP / 8][4],
                                                  const float W[MT][NB][4], const moe_bf16 *Xs) {
    constexpr int LD = FaTile<DP>::LD;
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int kk = 0; kk < NB / 2; kk++) {
        uint32_t af[MT][4];
#pragma unroll
        for (int m = 0; m < MT; m++)
            fa_acc_to_a(af[m], W[m][2 * kk], W[m][2 * kk + 1]);
#pragma unroll
        for (int n = 0; n < DP / 8; n += 2) {
            uint32_t bf[4];
            fa_ldsm4_t(bf, Xs + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * LD + n * 8 +
                               (lane / 16) * 8);
#pragma unroll
            for (int m = 0; m < MT; m++) {
                fa_mma(out[m][n], af[m], bf[0], bf[1]);
                fa_mma(out[m][n + 1], af[m], bf[2], bf[3]);
            }
        }
    }
}

/* Zero an accumulator of MT m-tiles and N n-blocks. */
template <int MT, int N>
static __device__ __forceinline__ void fa_zero(float acc[MT][N][4]) {
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int n = 0; n < N; n++)
            acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.0f;
}

/* Sum over the 4 lanes that hold one accumulator row. */
static __device__ __forceinline__ float fa_quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
static __device__ __forceinline__ float fa_quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

/* The keys query rows [t0, t_end) see together: s < the returned bound (0: none). */
static __device__ __forceinline__ int fa_key_end(int t_end, const FaArgs &a) {
    const long long last = (long long)t_end - 1 + a.off; /* the last row's last key */
    return last < 0 ? 0 : (int)(last + 1 < a.Tk ? last + 1 : a.Tk);
}


/*
 * Store acc (this warp's 16·MT rows from row0, DP/8 n-blocks) times mul (per row) into a
 * [rows][stride] bf16 tensor, only where row < nrows and d < D; add to what is there when
 * @p accumulate.
 */
template <int DP, int MT>
static __device__ __forceinline__ void fa_store_rows(moe_bf16 *dst, size_t stride, int row0,
                                                     int nrows, const float acc[MT][DP / 8][4],
                                                     const float mul[MT][2], bool accumulate,
                                                     int D) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int row = row0 + m * 16 + lane / 4 + 8 * i;
            if (row >= nrows)
                continue;
            moe_bf16 *p = dst + (size_t)row * stride;
#pragma unroll
            for (int n = 0; n < DP / 8; n++) {
                const int d = n * 8 + 2 * (lane % 4);
#pragma unroll
                for (int e = 0; e < 2; e++)
                    if (d + e < D) {
                        const float x = acc[m][n][2 * i + e] * mul[m][i];
                        p[d + e] = moe_st(accumulate ? moe_ld(p[d + e]) + x : x);
                    }
            }
        }
}

/* ------------------------------------------------------------------------- forward */

/* One block: 16·MT·4 query rows (MT m-tiles of 16 per warp), key tiles of BK rows. */
template <int DP, int MT, int BK>
__global__ void __launch_bounds__(FA_THREADS)
    fa_forward_kernel(moe_bf16 *y, float *lse, const moe_bf16 *q, const moe_bf16 *k,
                      const moe_bf16 *v, FaArgs a) {
    constexpr int LD = FaTile<DP>::LD, NB = BK / 8, BQ = 16 * MT * FA_WARPS;
    extern __shared__ __align__(16) unsigned char fa_smem[];
    moe_bf16 *Qs = (moe_bf16 *)fa_smem; /* [BQ][LD] */
    moe_bf16 *Ks = Qs + BQ * LD;        /* [2][BK][LD] */
    moe_bf16 *Vs = Ks + 2 * BK * LD;    /* [2][BK][LD] */

    const int nqt = (a.Tq + BQ - 1) / BQ;
    const int h = blockIdx.x, b = blockIdx.y, t0 = (nqt - 1 - (int)blockIdx.z) * BQ;
    const int g = h / (a.Hq / a.Hkv), warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const size_t qs = (size_t)a.Hq * a.D, kvs = (size_t)a.Hkv * a.D;
    const moe_bf16 *qb = q + (size_t)b * a.Tq * qs + (size_t)h * a.D;
    const moe_bf16 *kb = k + (size_t)b * a.Tk * kvs + (size_t)g * a.D;
    const moe_bf16 *vb = v + (size_t)b * a.Tk * kvs + (size_t)g * a.D;
    const int kend = fa_key_end(min(t0 + BQ, a.Tq), a);
    const int nkt = (kend + BK - 1) / BK;
    const int wrow = t0 + warp * 16 * MT;   /* the warp's first row */
    const int row = wrow + lane / 4;        /* this thread's rows: row + 16m + 8i */

    fa_load_tile<DP, BQ>(Qs, qb, qs, t0, a.Tq, a);
    if (nkt > 0) {
        fa_load_tile<DP, BK>(Ks, kb, kvs, 0, a.Tk, a);
        fa_load_tile<DP, BK>(Vs, vb, kvs, 0, a.Tk, a);
    }
    fa_cp_async_commit();

    const float sl = a.scale * FA_LOG2E; /* exp(x/√D) = exp2(x·sl) */
    float o[MT][DP / 8][4], m[MT][2], l[MT][2];
    fa_zero<MT, DP / 8>(o);
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
        m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.0f;

    for (int j = 0; j < nkt; j++) {
        fa_cp_async_wait_all();
        __syncthreads(); /* tile j landed; everyone is done with tile j−1's buffer */
        if (j + 1 < nkt) {
            const int nb = (j + 1) & 1;
            fa_load_tile<DP, BK>(Ks + nb * BK * LD, kb, kvs, (j + 1) * BK, a.Tk, a);
            fa_load_tile<DP, BK>(Vs + nb * BK * LD, vb, kvs, (j + 1) * BK, a.Tk, a);
        }
        fa_cp_async_commit();
        const moe_bf16 *Kt = Ks + (j & 1) * BK * LD, *Vt = Vs + (j & 1) * BK * LD;
        const int s0 = j * BK;

        float s[MT][NB][4];
        fa_gemm_abt<DP, MT, NB>(s, Qs + (wrow - t0) * LD, Kt);
        /* the mask, only on tiles that cross the diagonal or the end of the keys */
        if (s0 + BK - 1 > t0 + a.off || s0 + BK > a.Tk) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int n = 0; n < NB; n++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int key = s0 + n * 8 + 2 * (lane % 4) + (e & 1);
                        if (key > row + 16 * mt + 8 * (e >> 1) + a.off || key >= a.Tk)
                            s[mt][n][e] = -INFINITY;
                    }
        }
        /* the online softmax, row by row (row + 16·mt + 8·i) */
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int i = 0; i < 2; i++) {
                float mx = m[mt][i];
#pragma unroll
                for (int n = 0; n < NB; n++)
                    mx = fmaxf(mx, fmaxf(s[mt][n][2 * i], s[mt][n][2 * i + 1]));
                mx = fa_quad_max(mx);
                /* a row with nothing visible yet keeps m = −∞: exponents against 0, all 0 */
                const float ms = mx == -INFINITY ? 0.0f : mx * sl;
                const float alpha = exp2f(m[mt][i] * sl - ms); /* 0 while m was −∞ */
                m[mt][i] = mx;
                float rs = 0.0f;
#pragma unroll
                for (int n = 0; n < NB; n++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const float p = exp2f(fmaf(s[mt][n][2 * i + e], sl, -ms));
                        s[mt][n][2 * i + e] = p;
                        rs += p;
                    }
                l[mt][i] = l[mt][i] * alpha + rs; /* this thread's columns; merged at the end */
#pragma unroll
                for (int n = 0; n < DP / 8; n++) {
                    o[mt][n][2 * i] *= alpha;
                    o[mt][n][2 * i + 1] *= alpha;
                }
            }
        fa_gemm_wx<DP, MT, NB>(o, s, Vt);
    }
    fa_cp_async_wait_all();

    float inv[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const float lt = fa_quad_sum(l[mt][i]);
            const int t = row + 16 * mt + 8 * i;
            inv[mt][i] = lt > 0.0f ? 1.0f / lt : 0.0f; /* a row that sees no key: y = 0 */
            if (lane % 4 == 0 && t < a.Tq)
                lse[((size_t)b * a.Hq + h) * a.Tq + t] =
                    lt > 0.0f ? m[mt][i] * a.scale + logf(lt) : -INFINITY;
        }
    fa_store_rows<DP, MT>(y + (size_t)b * a.Tq * qs + (size_t)h * a.D, qs, wrow, a.Tq, o, inv,
                          false, a.D);
}

/* ------------------------------------------------------------------------ backward */

/* δ_t = dy_t · y_t (fp32), one warp per (b, t, h) row, into delta [B, Hq, Tq]. */
__global__ void fa_delta_kernel(float *delta, const moe_bf16 *dy, const moe_bf16 *y, int B,
                                int Tq, int Hq, int D) {
    const long long r = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (r >= (long long)B * Tq * Hq)
        return;
    const int lane = threadIdx.x % 32, h = (int)(r % Hq);
    const long long bt = r / Hq; /* b·Tq + t */
    const moe_bf16 *dyr = dy + (size_t)r * D, *yr = y + (size_t)r * D;
    float sum = 0.0f;
    for (int d = lane; d < D; d += 32)
        sum = fmaf(moe_ld(dyr[d]), moe_ld(yr[d]), sum);
    sum = moe_warp_sum(sum);
    if (lane == 0) {
        const long long b = bt / Tq, t = bt % Tq;
        delta[((size_t)b * Hq + h) * Tq + t] = sum;
    }
}

/* dq for one (b, h, 16·MT·4 query rows), key tiles of BK rows. */
template <int DP, int MT, int BK>
__global__ void __launch_bounds__(FA_THREADS)
    fa_backward_dq_kernel(moe_bf16 *dq, const float *delta, const float *lse, const moe_bf16 *q,
                          const moe_bf16 *k, const moe_bf16 *v, const moe_bf16 *dy, FaArgs a) {
    constexpr int LD = FaTile<DP>::LD, NB = BK / 8, BQ = 16 * MT * FA_WARPS;
    extern __shared__ __align__(16) unsigned char fa_smem[];
    moe_bf16 *Qs = (moe_bf16 *)fa_smem; /* [BQ][LD] */
    moe_bf16 *dYs = Qs + BQ * LD;       /* [BQ][LD] */
    moe_bf16 *Ks = dYs + BQ * LD;       /* [2][BK][LD] */
    moe_bf16 *Vs = Ks + 2 * BK * LD;    /* [2][BK][LD] */

    const int nqt = (a.Tq + BQ - 1) / BQ;
    const int h = blockIdx.x, b = blockIdx.y, t0 = (nqt - 1 - (int)blockIdx.z) * BQ;
    const int g = h / (a.Hq / a.Hkv), warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const size_t qs = (size_t)a.Hq * a.D, kvs = (size_t)a.Hkv * a.D;
    const size_t qoff = (size_t)b * a.Tq * qs + (size_t)h * a.D;
    const moe_bf16 *kb = k + (size_t)b * a.Tk * kvs + (size_t)g * a.D;
    const moe_bf16 *vb = v + (size_t)b * a.Tk * kvs + (size_t)g * a.D;
    const int kend = fa_key_end(min(t0 + BQ, a.Tq), a);
    const int nkt = (kend + BK - 1) / BK;
    if (nkt == 0)
        return; /* no row of the tile sees a key: dq gets nothing */
    const int wrow = t0 + warp * 16 * MT, row = wrow + lane / 4;

    fa_load_tile<DP, BQ>(Qs, q + qoff, qs, t0, a.Tq, a);
    fa_load_tile<DP, BQ>(dYs, dy + qoff, qs, t0, a.Tq, a);
    fa_load_tile<DP, BK>(Ks, kb, kvs, 0, a.Tk, a);
    fa_load_tile<DP, BK>(Vs, vb, kvs, 0, a.Tk, a);
    fa_cp_async_commit();

    /* this thread's rows: lse·log2(e) (0 where it is −∞ or past Tq: those rows see no
     * key, every P of theirs is masked to 0) and δ */
    float l2[MT][2], dl[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int t = row + 16 * mt + 8 * i;
            const size_t at = ((size_t)b * a.Hq + h) * a.Tq + t;
            const float lt = t < a.Tq ? lse[at] : -INFINITY;
            l2[mt][i] = lt == -INFINITY ? 0.0f : lt * FA_LOG2E;
            dl[mt][i] = t < a.Tq ? delta[at] : 0.0f;
        }
    const float sl = a.scale * FA_LOG2E;
    float acc[MT][DP / 8][4];
    fa_zero<MT, DP / 8>(acc);

    for (int j = 0; j < nkt; j++) {
        fa_cp_async_wait_all();
        __syncthreads();
        if (j + 1 < nkt) {
            const int nb = (j + 1) & 1;
            fa_load_tile<DP, BK>(Ks + nb * BK * LD, kb, kvs, (j + 1) * BK, a.Tk, a);
            fa_load_tile<DP, BK>(Vs + nb * BK * LD, vb, kvs, (j + 1) * BK, a.Tk, a);
        }
        fa_cp_async_commit();
        const moe_bf16 *Kt = Ks + (j & 1) * BK * LD, *Vt = Vs + (j & 1) * BK * LD;
        const int s0 = j * BK;

        float s[MT][NB][4], dp[MT][NB][4];
        fa_gemm_abt<DP, MT, NB>(s, Qs + (wrow - t0) * LD, Kt);
        fa_gemm_abt<DP, MT, NB>(dp, dYs + (wrow - t0) * LD, Vt);
        const bool mask = s0 + BK - 1 > t0 + a.off || s0 + BK > a.Tk;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int n = 0; n < NB; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int i = e >> 1, key = s0 + n * 8 + 2 * (lane % 4) + (e & 1);
                    float p = exp2f(fmaf(s[mt][n][e], sl, -l2[mt][i]));
                    if (mask && (key > row + 16 * mt + 8 * i + a.off || key >= a.Tk))
                        p = 0.0f;
                    s[mt][n][e] = p * (dp[mt][n][e] - dl[mt][i]); /* dS (without 1/√D) */
                }
        fa_gemm_wx<DP, MT, NB>(acc, s, Kt);
    }
    fa_cp_async_wait_all();
    float mul[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
        mul[mt][0] = mul[mt][1] = a.scale;
    fa_store_rows<DP, MT>(dq + qoff, qs, wrow, a.Tq, acc, mul, true, a.D);
}

/* dk and dv for one (b, g, 16·MT·4 key rows), summed over the query heads of group g; BQC
 * query rows per step (few enough that the two accumulators and Sᵀ, dPᵀ fit the registers). */
template <int DP, int MT, int BQC>
__global__ void __launch_bounds__(FA_THREADS)
    fa_backward_dkdv_kernel(moe_bf16 *dk, moe_bf16 *dv, const float *delta, const float *lse,
                            const moe_bf16 *q, const moe_bf16 *k, const moe_bf16 *v,
                            const moe_bf16 *dy, FaArgs a) {
    constexpr int LD = FaTile<DP>::LD, NB = BQC / 8, BKV = 16 * MT * FA_WARPS;
    extern __shared__ __align__(16) unsigned char fa_smem[];
    moe_bf16 *Ks = (moe_bf16 *)fa_smem;        /* [BKV][LD] */
    moe_bf16 *Vs = Ks + BKV * LD;              /* [BKV][LD] */
    moe_bf16 *Qs = Vs + BKV * LD;              /* [2][BQC][LD] */
    moe_bf16 *dYs = Qs + 2 * BQC * LD;         /* [2][BQC][LD] */
    float *Ls = (float *)(dYs + 2 * BQC * LD); /* [2][BQC] lse·log2(e) */
    float *Ds = Ls + 2 * BQC;                  /* [2][BQC] δ */

    const int g = blockIdx.x, b = blockIdx.y, s0 = (int)blockIdx.z * BKV;
    const int rep = a.Hq / a.Hkv, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const size_t qs = (size_t)a.Hq * a.D, kvs = (size_t)a.Hkv * a.D;
    const size_t kvoff = (size_t)b * a.Tk * kvs + (size_t)g * a.D;
    /* the first query row that sees key s0: q_pos + t ≥ k_pos + s0 */
    const long long first = (long long)s0 - a.off;
    if (first >= a.Tq)
        return; /* no query sees these keys: dk, dv get nothing */
    const int qt0 = first > 0 ? (int)(first / BQC) : 0;
    const int per = (a.Tq + BQC - 1) / BQC - qt0, nit = rep * per;
    const int wrow = s0 + warp * 16 * MT, srow = wrow + lane / 4; /* keys srow + 16m + 8i */

    /* stage step it's query tile: head g·rep + it/per, rows from (qt0 + it%per)·BQC */
    auto stage = [&](int it, int buf) {
        const int hh = g * rep + it / per, t0 = (qt0 + it % per) * BQC;
        const size_t qoff = (size_t)b * a.Tq * qs + (size_t)hh * a.D;
        fa_load_tile<DP, BQC>(Qs + buf * BQC * LD, q + qoff, qs, t0, a.Tq, a);
        fa_load_tile<DP, BQC>(dYs + buf * BQC * LD, dy + qoff, qs, t0, a.Tq, a);
        for (int c = threadIdx.x; c < BQC; c += FA_THREADS) {
            const int t = t0 + c;
            const size_t at = ((size_t)b * a.Hq + hh) * a.Tq + t;
            const float lt = t < a.Tq ? lse[at] : -INFINITY;
            Ls[buf * BQC + c] = lt == -INFINITY ? 0.0f : lt * FA_LOG2E;
            Ds[buf * BQC + c] = t < a.Tq ? delta[at] : 0.0f;
        }
    };
    fa_load_tile<DP, BKV>(Ks, k + kvoff, kvs, s0, a.Tk, a);
    fa_load_tile<DP, BKV>(Vs, v + kvoff, kvs, s0, a.Tk, a);
    stage(0, 0);
    fa_cp_async_commit();

    const float sl = a.scale * FA_LOG2E;
    float ak[MT][DP / 8][4], av[MT][DP / 8][4];
    fa_zero<MT, DP / 8>(ak);
    fa_zero<MT, DP / 8>(av);

    for (int it = 0; it < nit; it++) {
        fa_cp_async_wait_all();
        __syncthreads();
        if (it + 1 < nit)
            stage(it + 1, (it + 1) & 1);
        fa_cp_async_commit();
        const int buf = it & 1, t0 = (qt0 + it % per) * BQC;
        const moe_bf16 *Qt = Qs + buf * BQC * LD, *dYt = dYs + buf * BQC * LD;
        const float *Lt = Ls + buf * BQC, *Dt = Ds + buf * BQC;

        float s[MT][NB][4], dp[MT][NB][4]; /* Sᵀ = K·Qᵀ, dPᵀ = V·dYᵀ: rows keys, columns queries */
        fa_gemm_abt<DP, MT, NB>(s, Ks + (wrow - s0) * LD, Qt);
        fa_gemm_abt<DP, MT, NB>(dp, Vs + (wrow - s0) * LD, dYt);
        const bool mask = s0 + BKV - 1 > t0 + a.off || t0 + BQC > a.Tq || s0 + BKV > a.Tk;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int n = 0; n < NB; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int c = n * 8 + 2 * (lane % 4) + (e & 1), t = t0 + c;
                    const int key = srow + 16 * mt + 8 * (e >> 1);
                    float p = exp2f(fmaf(s[mt][n][e], sl, -Lt[c]));
                    if (mask && (key > t + a.off || t >= a.Tq || key >= a.Tk))
                        p = 0.0f;
                    s[mt][n][e] = p;                          /* Pᵀ */
                    dp[mt][n][e] = p * (dp[mt][n][e] - Dt[c]); /* dSᵀ (without 1/√D) */
                }
        fa_gemm_wx<DP, MT, NB>(av, s, dYt);
        fa_gemm_wx<DP, MT, NB>(ak, dp, Qt);
    }
    fa_cp_async_wait_all();
    float one[MT][2], mul[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
        one[mt][0] = one[mt][1] = 1.0f, mul[mt][0] = mul[mt][1] = a.scale;
    fa_store_rows<DP, MT>(dk + kvoff, kvs, wrow, a.Tk, ak, mul, true, a.D);
    fa_store_rows<DP, MT>(dv + kvoff, kvs, wrow, a.Tk, av, one, true, a.D);
}

/* ----------------------------------------------------------------------- launchers */

/* Launch @p kernel with @p smem bytes of dynamic shared memory (opting in above 48 KiB). */
template <typename K, typename... Args>
static void fa_launch(K kernel, dim3 grid, size_t smem, Args... args) {
    MOE_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    kernel<<<grid, FA_THREADS, smem, moe_cuda_stream()>>>(args...);
    MOE_CUDA_LAUNCH_CHECK();
}

/* The shared arguments; vec when every tile row is whole 16-byte words. */
static FaArgs fa_args(moe_attention_shape s, const void *p0, const void *p1, const void *p2,
                      const void *p3 = nullptr, const void *p4 = nullptr) {
    FaArgs a;
    a.Tq = s.Tq;
    a.Tk = s.Tk;
    a.Hq = s.Hq;
    a.Hkv = s.Hkv;
    a.D = s.D;
    a.off = s.q_pos - s.k_pos;
    a.scale = (float)(1.0 / sqrt((double)s.D));
    a.vec = moe_vec8_ok(s.D, p0, p1, p2) && moe_vec8_ok(s.D, p3, p4);
    return a;
}

/* The grids: (heads, sequences, tiles), the tile index slowest (heaviest first). */
static dim3 fa_grid(int heads, int B, int rows, int tile) {
    return dim3((unsigned)heads, (unsigned)B, moe_cdiv((size_t)rows, (size_t)tile));
}

/*
 * The tile shapes of each padded head dimension: MT m-tiles of 16 rows per warp (every
 * shared-memory fragment a warp reads serves MT m-tiles), the key tile of the forward and
 * dq kernels, the query tile of the dk/dv kernel. WIDE is two m-tiles per warp wherever the
 * registers hold them without spilling (ptxas -v: at D = 128 the dq and dk/dv kernels keep
 * one); narrow is one m-tile everywhere.
 */
template <int DP, bool WIDE> struct FaConfig {
    static constexpr int FWD_MT = WIDE ? 2 : 1, FWD_BK = WIDE && DP == 128 ? 32 : 64;
    static constexpr int DQ_MT = WIDE && DP < 128 ? 2 : 1, DQ_BK = DQ_MT == 2 ? 32 : 64;
    static constexpr int KV_MT = WIDE && DP < 128 ? 2 : 1;
    static constexpr int KV_BQC = KV_MT == 2 || DP == 128 ? 32 : 64;
};

/*
 * Which tiling runs. Measured on one H100 (docs/results/07-long-context.md): the wide
 * forward is 15-20% faster from T = 1K up, but slower at the GPU preset's T = 256 (fewer,
 * larger blocks on 132 SMs); the wide backward is slower at T ≤ 4K and within 2% above. So by
 * default the forward is wide from FA_WIDE_MIN_T query rows and the backward narrow.
 * MOE_FLASH_MT=1 or 2 forces the narrow or the wide tiles everywhere (the tests run both);
 * it is read at every call (a getenv), so that one process can switch.
 */
#define FA_WIDE_MIN_T 512

static int fa_tiles_forced(void) {
    const char *e = getenv("MOE_FLASH_MT");
    if (!e)
        return 0;
    if (strcmp(e, "1") && strcmp(e, "2")) {
        fprintf(stderr, "MOE_FLASH_MT=%s: must be 1 (one m-tile of 16 rows per warp) or 2 "
                        "(two); unset it for the measured default\n", e);
        exit(1);
    }
    return e[0] - '0';
}
static bool fa_wide_forward(int Tq) {
    const int f = fa_tiles_forced();
    return f ? f == 2 : Tq >= FA_WIDE_MIN_T;
}
static bool fa_wide_backward(void) { return fa_tiles_forced() == 2; }

template <int DP, bool WIDE>
static void fa_forward_launch(moe_bf16 *y, float *lse, const moe_bf16 *q, const moe_bf16 *k,
                              const moe_bf16 *v, moe_attention_shape s) {
    typedef FaConfig<DP, WIDE> C;
    constexpr int BQ = 16 * C::FWD_MT * FA_WARPS;
    const FaArgs a = fa_args(s, q, k, v, y);
    const size_t smem = sizeof(moe_bf16) * FaTile<DP>::LD * (BQ + 4 * C::FWD_BK);
    fa_launch(fa_forward_kernel<DP, C::FWD_MT, C::FWD_BK>, fa_grid(s.Hq, s.B, s.Tq, BQ), smem,
              y, lse, q, k, v, a);
}

/* δ_t = dy_t · y_t into the workspace [B, Hq, Tq] (both backwards read it). */
static void fa_delta_launch(float *delta, const moe_bf16 *dy, const moe_bf16 *y,
                            moe_attention_shape s) {
    const long long rows = (long long)s.B * s.Tq * s.Hq; /* one warp each, 8 per block */
    fa_delta_kernel<<<moe_cdiv((size_t)rows, 8), 256, 0, moe_cuda_stream()>>>(
        delta, dy, y, s.B, s.Tq, s.Hq, s.D);
    MOE_CUDA_LAUNCH_CHECK();
}

template <int DP, bool WIDE>
static void fa_backward_launch(moe_bf16 *dq, moe_bf16 *dk, moe_bf16 *dv, const moe_bf16 *dy,
                               const float *lse, const float *delta, const moe_bf16 *q,
                               const moe_bf16 *k, const moe_bf16 *v, moe_attention_shape s) {
    typedef FaConfig<DP, WIDE> C;
    const FaArgs a = fa_args(s, q, k, v, dy);

    constexpr int BQ = 16 * C::DQ_MT * FA_WARPS;
    const size_t smem_q = sizeof(moe_bf16) * FaTile<DP>::LD * (2 * BQ + 4 * C::DQ_BK);
    fa_launch(fa_backward_dq_kernel<DP, C::DQ_MT, C::DQ_BK>, fa_grid(s.Hq, s.B, s.Tq, BQ),
              smem_q, dq, delta, lse, q, k, v, dy, a);

    constexpr int BKV = 16 * C::KV_MT * FA_WARPS;
    const size_t smem_kv = sizeof(moe_bf16) * FaTile<DP>::LD * (2 * BKV + 4 * C::KV_BQC) +
                           sizeof(float) * 4 * C::KV_BQC;
    fa_launch(fa_backward_dkdv_kernel<DP, C::KV_MT, C::KV_BQC>, fa_grid(s.Hkv, s.B, s.Tk, BKV),
              smem_kv, dk, dv, delta, lse, q, k, v, dy, a);
}

/* The workspace: the backward's δ [B, Hq, Tq] fp32 (the forward leaves nothing there). */
extern "C" size_t moe_cuda_attention_workspace_bytes(moe_attention_shape s) {
    return sizeof(float) * (size_t)s.B * s.Hq * s.Tq;
}

extern "C" void moe_cuda_attention_forward(void *y, moe_real *lse, void *ws, const void *q,
                                           const void *k, const void *v, moe_attention_shape s) {
    (void)ws;
    moe_attention_shape_require(s, "moe_cuda_attention", FA_MAX_D);
    if (s.B < 1)
        return;
    if (moe_cuda_attention_sm90_forward(y, lse, q, k, v, s))
        return; /* the Hopper kernel (attention_sm90.cu) took it */
    moe_bf16 *Y = (moe_bf16 *)y;
    const moe_bf16 *Q = (const moe_bf16 *)q, *K = (const moe_bf16 *)k, *V = (const moe_bf16 *)v;
    const bool w = fa_wide_forward(s.Tq);
    if (s.D <= 32)
        w ? fa_forward_launch<32, true>(Y, lse, Q, K, V, s)
          : fa_forward_launch<32, false>(Y, lse, Q, K, V, s);
    else if (s.D <= 64)
        w ? fa_forward_launch<64, true>(Y, lse, Q, K, V, s)
          : fa_forward_launch<64, false>(Y, lse, Q, K, V, s);
    else
        w ? fa_forward_launch<128, true>(Y, lse, Q, K, V, s)
          : fa_forward_launch<128, false>(Y, lse, Q, K, V, s);
}

extern "C" void moe_cuda_attention_backward(void *dq, void *dk, void *dv, const void *dy,
                                            const void *y, const moe_real *lse, void *ws,
                                            const void *q, const void *k, const void *v,
                                            moe_attention_shape s) {
    moe_attention_shape_require(s, "moe_cuda_attention", FA_MAX_D);
    if (s.B < 1)
        return;
    moe_bf16 *dQ = (moe_bf16 *)dq, *dK = (moe_bf16 *)dk, *dV = (moe_bf16 *)dv;
    const moe_bf16 *dY = (const moe_bf16 *)dy, *Y = (const moe_bf16 *)y;
    const moe_bf16 *Q = (const moe_bf16 *)q, *K = (const moe_bf16 *)k, *V = (const moe_bf16 *)v;
    float *delta = (float *)ws;
    fa_delta_launch(delta, dY, Y, s);
    if (moe_cuda_attention_sm90_backward(dq, dk, dv, dy, lse, delta, q, k, v, s))
        return; /* the Hopper kernels (attention_sm90_bwd.cu) took it */
    const bool w = fa_wide_backward();
    if (s.D <= 32)
        w ? fa_backward_launch<32, true>(dQ, dK, dV, dY, lse, delta, Q, K, V, s)
          : fa_backward_launch<32, false>(dQ, dK, dV, dY, lse, delta, Q, K, V, s);
    else if (s.D <= 64)
        w ? fa_backward_launch<64, true>(dQ, dK, dV, dY, lse, delta, Q, K, V, s)
          : fa_backward_launch<64, false>(dQ, dK, dV, dY, lse, delta, Q, K, V, s);
    else
        w ? fa_backward_launch<128, true>(dQ, dK, dV, dY, lse, delta, Q, K, V, s)
          : fa_backward_launch<128, false>(dQ, dK, dV, dY, lse, delta, Q, K, V, s);
}
