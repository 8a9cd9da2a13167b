/**
 * @file sm90_epilogue.cuh
 * @brief What the sm_90a grouped GEMMs do after their main loop, written once for the bf16
 *        kernel (grouped_gemm_sm90.cu) and the FP8 one (grouped_gemm_fp8_sm90.cu): a consumer
 *        warpgroup's 64-row block of fp32 accumulators leaves either through a shared-memory
 *        staging buffer and TMA (whole 64-row blocks), or by direct, row-masked stores (a
 *        block that a group ends inside: a TMA box cannot skip the next group's rows).
 *
 * The accumulator layout of wgmma m64nN (fp32, any K and input type): thread t of the
 * warpgroup (warp w = t/32, lane l) holds, for each 8-column block j, d[4j+0..1] at row
 * 16w + l/4, columns 8j + 2(l%4) + 0..1, and d[4j+2..3] at the row 8 below.
 *
 * The staging buffer is written in the 128-byte swizzled layout of a TMA box [64 rows][128
 * bytes] (moe_swizzle128; that also keeps the shared-memory writes free of bank conflicts),
 * a PIECE of C_BYTES at a time; one thread hands each piece's boxes to TMA (a store or a
 * reduce-add, as the caller's `issue` decides) and the warpgroup goes on; before the next
 * piece is written into the same buffer, it waits until TMA has READ the last one (short:
 * the global writes complete later). Measured on an H200 (docs/results/03-grouped-gemm.md):
 * storing straight from registers cost 15-35 % of the bf16 GEMM's time.
 */
#ifndef MOE_SM90_EPILOGUE_CUH
#define MOE_SM90_EPILOGUE_CUH

#include <stdint.h>

#include "cuda_common.cuh"
#include "sm90_ptx.cuh"

/** The auto epilogue of both adding wgrads (moe_wgrad_epi): a tile whose group has at most
 *  this many rows (its k-loop's length) adds its sums by RMW from registers (epilogue_regs),
 *  a longer one by TMA's reduce-adds. Measured on the FP8 wgrad (H100, docs/results/
 *  05-fp8-nvfp4.md, "The adding wgrad by plain reads and writes"), RMW against TMA: 512 rows
 *  an expert 1.12-1.13x, 1024 on average 1.15x, 2048 0.83x. Outside the sm_90a guard: the
 *  host reads it too. */
constexpr int WGRAD_RMW_MAX_ROWS = 1024;

#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL) /* nothing for sm_100a */

/** Named barrier @p id (0 is __syncthreads'): wait until @p n threads have arrived, this one
 *  included. */
static __device__ __forceinline__ void named_bar_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}

/** Arrive on named barrier @p id (of @p n threads) without waiting: a signal to the threads
 *  that named_bar_sync() on it. */
static __device__ __forceinline__ void named_bar_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}

/** Barrier of the 128 threads of consumer warpgroup @p c (named barrier 1 + c; the FP8 kernel
 *  uses 3 and 4 for its issue order). */
static __device__ __forceinline__ void wg_barrier(int c) { named_bar_sync(1 + c, 128); }

/** Before writing the staging buffer: the previous copy-out has read it. */
static __device__ __forceinline__ void epilogue_reserve(int c, int tid) {
    if (tid == 0)
        bulk_wait_read();
    wg_barrier(c);
}

/** After writing it: make the writes visible to TMA (the async proxy), then hand over. */
static __device__ __forceinline__ void epilogue_publish(int c) {
    fence_proxy_async();
    wg_barrier(c);
}

/** Piece @p q (C_BYTES: PIECE_COLS columns) of warpgroup @p c's 64-row block of accumulators
 *  @p d into the staging buffer @p cs, in the swizzled layout of TMA boxes [64 rows][128
 *  bytes], box b at cs + 8192·b. C32: fp32, else bf16. */
template <int C32, int NW, int C_BYTES>
static __device__ __forceinline__ void stage_piece(const float *d, uint8_t *cs, int q, int tid) {
    constexpr int ES = C32 ? 4 : 2;                 /* bytes per output element */
    constexpr int PIECE_COLS = C_BYTES / (64 * ES); /* columns per piece */
    constexpr int BOX_COLS = 128 / ES;              /* 64 or 32 */
    const int warp = tid / 32, lane = tid % 32, r_lo = warp * 16 + lane / 4;
#pragma unroll
    for (int jj = 0; jj < PIECE_COLS / 8; jj++) {
        const int j = q * (PIECE_COLS / 8) + jj; /* the accumulators' 8-column block */
        if (j >= NW / 8) /* (known at compile time once unrolled) */
            break;
        const int col = 8 * jj + 2 * (lane % 4);
        const int box = col / BOX_COLS, cc = col % BOX_COLS;
        const int chunk = cc * ES / 16, within = (cc * ES) % 16;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = r_lo + 8 * h;
            uint8_t *dst = cs + box * 8192 + moe_swizzle128(row, chunk) + within;
            if (C32)
                *(float2 *)dst = make_float2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
            else
                *(__nv_bfloat162 *)dst =
                    __floats2bfloat162_rn(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
        }
    }
}

/** How many k-steps before the end of a wgrad tile's loads its producer prefetches the tile's
 *  dw into L2 (prefetch_dw_tile): the producer runs up to a pipeline's depth (4) ahead of the
 *  consumers, so the lines are asked for about 16 k-steps (8 µs at 650 TFLOP/s) before the
 *  epilogue's reduce-add needs them, or at the tile's start when it is shorter than that. */
constexpr int WGRAD_PREFETCH_LEAD = 12;

/**
 * Prefetch an accumulating wgrad tile's fp32 dw into L2: @p rows × @p cols from column @p n0,
 * row @p m0 of block @p g of the 3-D tensor behind @p map (boxes of 32 fp32 columns × 64
 * rows, the epilogue's own), columns from @p N on skipped. Why: a TMA reduce-add reads every
 * element it adds to (L2 fetches the old value from HBM, adds, writes the sum back later).
 * Issued by the epilogue, that read is one HBM round trip per piece, taken while the tensor
 * cores idle and while every CTA's epilogue asks at once; issued by the producer during the
 * main loop, the read overlaps the MMAs and the reduce-add finds its lines in L2. A hint:
 * it changes no result.
 */
/**
 * The same prefetch by plain instructions (MOE_WGRAD_PREFETCH=2): thread @p t of @p nt asks L2
 * for its share of the tile's 128-byte lines (prefetch.global.L2) — @p rows rows of
 * @p cols fp32 from (@p m0, @p n0) of block @p g of dw [*][M][N], rows from M and columns from
 * N on skipped. Issued by the consumers at the tile's start, so the requests go through the
 * load/store units instead of queueing in the producer's TMA unit before the operand loads.
 */
template <int ROWS, int COLS>
static __device__ __forceinline__ void prefetch_dw_lines(const float *dw, int g, int m0, int n0,
                                                         int M, int N, int t, int nt) {
    constexpr int LPR = COLS * 4 / 128; /* 128-byte lines per row */
    for (int i = t; i < ROWS * LPR; i += nt) {
        const int r = m0 + i / LPR, col = n0 + (i % LPR) * 32;
        if (r < M && col < N)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(dw + ((size_t)g * M + r) * N + col));
    }
}

template <int ROWS>
static __device__ __forceinline__ void prefetch_dw_tile(const CUtensorMap *map, int n0, int m0,
                                                        int g, int cols, int N) {
    for (int r = 0; r < ROWS; r += 64)
        for (int cc = 0; cc < cols && n0 + cc < N; cc += 32)
            tma_prefetch_3d(map, n0 + cc, m0 + r, g);
}

/**
 * Warpgroup @p c's block of 64 rows × @p ncols (≤ NW, a multiple of 64) accumulators @p d
 * → its staging buffer @p cs (C_BYTES) → TMA. C32: fp32 output, else bf16. @p issue(src, col) is called by one
 * thread for each TMA box [64 rows][128 bytes] at @p src whose first column is @p col (from
 * the block's first): it issues the box's store or reduce-add and returns 1, or returns 0 to
 * skip this box and the rest of the piece (a column past the tensor).
 */
template <int C32, int NW, int C_BYTES, typename Issue>
static __device__ __forceinline__ void epilogue_staged(const float *d, uint8_t *cs, int c, int tid,
                                                       int ncols, Issue &&issue) {
    constexpr int ES = C32 ? 4 : 2;
    constexpr int PIECE_COLS = C_BYTES / (64 * ES);
    constexpr int BOX_COLS = 128 / ES;
    /* NW need not be a multiple of a piece (a 192-column tile, bf16: one piece of 128
     * columns and one of 64) */
    constexpr int PIECES = (NW + PIECE_COLS - 1) / PIECE_COLS;
#pragma unroll
    for (int q = 0; q < PIECES; q++) {
        if (q * PIECE_COLS >= ncols)
            break;
        epilogue_reserve(c, tid);
        stage_piece<C32, NW, C_BYTES>(d, cs, q, tid);
        epilogue_publish(c);
        if (tid == 0) {
            for (int box = 0; box < PIECE_COLS / BOX_COLS; box++) {
                const int col = q * PIECE_COLS + box * BOX_COLS;
                if (col >= ncols || !issue(cs + box * 8192, col))
                    break; /* past the block (its staging holds stale data there) */
            }
            bulk_commit();
        }
    }
}

/**
 * Warpgroup @p c's block of 64 rows × @p ncols (≤ NW, a multiple of 8) fp32 accumulators
 * @p d straight from registers to @p dst (the block's first element, rows @p ld floats
 * apart), no staging buffer: stored (@p accumulate = 0), else added to what is there, by L2
 * reductions (`red.global.add.v4.f32`, RMW = 0) or by reading the old values, adding and
 * writing (RMW = 1). Rows from @p rows on are not touched (a block past the matrix's end).
 *
 * The layout: for 8-column block j the thread holds row r_lo's columns 8j + 2q + {0, 1} (q =
 * lane % 4) and row r_lo + 8's. Lanes q and q ^ 1 swap halves (two shuffles), so an even q
 * holds row r_lo's 4 columns 8j + 4(q/2) .. + 3 and an odd q row r_lo + 8's: 16 aligned bytes
 * each, and a warp's instruction writes 16 rows × 32 contiguous bytes, whole sectors. Each
 * element gets one fp32 addition (old + sum), as TMA's reduce-add gives it, so the bits are
 * the staged epilogue's, up to subnormals: PTX's red and atom .add.f32 flush them to zero, a
 * plain add (and the CPU twins) keeps them.
 *
 * Why RMW: an adding wgrad whose tiles have few k-steps is its epilogue, and TMA's reduce-adds
 * (the staged epilogue) move dw at about 2.0 TB/s on an H100 where plain reads and writes of
 * the same tiles reach 2.8 (docs/results/05-fp8-nvfp4.md, "The adding wgrad by plain reads
 * and writes"). Its cost: the warpgroup waits for its reads, so on long tiles it loses; the
 * kernels choose it per tile. The reads go in batches of 8 × 16 bytes, the next batch in
 * flight while one is added and stored (2 × 32 registers: the main loop's are free by now);
 * streaming hints (.cs), each line being read once and written once.
 */
template <int NW, int RMW>
static __device__ __forceinline__ void epilogue_regs(const float *d, float *dst, size_t ld,
                                                     int ncols, int rows, int tid,
                                                     int accumulate) {
    static_assert(NW % 64 == 0, "whole batches of 8 column blocks");
    const int lane = tid % 32, q = lane % 4, odd = q & 1;
    const int row = (tid / 32) * 16 + lane / 4 + 8 * odd;
    const bool live = row < rows;
    float *out = dst + (size_t)row * ld + 4 * (q >> 1);
    /* column block j's 4 sums of this thread's row (every lane calls it: shuffles) */
    const auto sums = [&](int j) {
        /* an even lane gives away its row r_lo + 8 pair, an odd one its row r_lo pair */
        const float s0 = odd ? d[4 * j] : d[4 * j + 2], s1 = odd ? d[4 * j + 1] : d[4 * j + 3];
        const float g0 = __shfl_xor_sync(0xffffffffu, s0, 1);
        const float g1 = __shfl_xor_sync(0xffffffffu, s1, 1);
        return odd ? make_float4(g0, g1, d[4 * j + 2], d[4 * j + 3])
                   : make_float4(d[4 * j], d[4 * j + 1], g0, g1);
    };
    if (RMW && accumulate) {
        constexpr int J = NW / 8, B = 8;
        float4 old[2][B];
#pragma unroll
        for (int i = 0; i < B; i++)
            if (live && 8 * i < ncols)
                old[0][i] = __ldcs((const float4 *)(out + 8 * i));
#pragma unroll
        for (int b = 0; b < J / B; b++) {
            if (b + 1 < J / B)
#pragma unroll
                for (int i = 0; i < B; i++) {
                    const int j = (b + 1) * B + i;
                    if (live && 8 * j < ncols)
                        old[(b + 1) % 2][i] = __ldcs((const float4 *)(out + 8 * j));
                }
#pragma unroll
            for (int i = 0; i < B; i++) {
                const int j = b * B + i;
                if (8 * j >= ncols) /* (warp-uniform) */
                    break;
                const float4 v = sums(j), o = old[b % 2][i];
                if (live)
                    __stcs((float4 *)(out + 8 * j),
                           make_float4(o.x + v.x, o.y + v.y, o.z + v.z, o.w + v.w));
            }
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < NW / 8; j++) {
        if (8 * j >= ncols) /* (warp-uniform) */
            break;
        const float4 v = sums(j);
        if (!live)
            continue;
        if (accumulate)
            red_add_v4(out + 8 * j, v);
        else
            *(float4 *)(out + 8 * j) = v;
    }
}

/**
 * The scatter epilogue (bf16; chapter 03's fused permutation, fc2): the same block, staged
 * as above, leaves ROW BY ROW — block row i (absolute row m_wg + i) goes to row
 * @p dst_row[m_wg + i] of @p C [*, ldc], as 16-byte vector stores read back from the
 * staging buffer (TMA cannot scatter rows on Hopper: a box is a rectangle). Rows at or past
 * @p r_end (the next group's) and columns at or past @p ldc are not written, so a block that
 * its group ends inside needs no separate masked path. Per pass, the 128 threads cover 8
 * rows × 16 chunks of 16 bytes (a piece's two boxes of one row: 256 contiguous bytes in
 * C): a quarter-warp reads one row's 128 swizzled bytes (every bank once) and writes them
 * as one coalesced segment. No TMA is involved, so a plain barrier (not the proxy fence)
 * orders the staging writes before the reads and the reads before the next piece.
 */
template <int NW, int C_BYTES>
static __device__ __forceinline__ void epilogue_scatter(const float *d, uint8_t *cs, int c,
                                                        int tid, int ncols, moe_bf16 *C,
                                                        int ldc, int m_wg, int n_wg, int r_end,
                                                        const int *dst_row) {
    constexpr int PIECE_COLS = C_BYTES / (64 * 2); /* 128 */
    constexpr int PIECES = (NW + PIECE_COLS - 1) / PIECE_COLS;
    const int sub = tid % 16, box = sub / 8, chunk = sub % 8; /* which 16 bytes of a row */
    int dst[8]; /* this thread's rows i = tid / 16 + 8·p: their destinations (-1: none) */
#pragma unroll
    for (int p = 0; p < 8; p++) {
        const int row = m_wg + tid / 16 + 8 * p;
        dst[p] = row < r_end ? __ldg(dst_row + row) : -1;
    }
#pragma unroll
    for (int q = 0; q < PIECES; q++) {
        if (q * PIECE_COLS >= ncols)
            break;
        wg_barrier(c); /* the previous piece's reads are done */
        stage_piece<0, NW, C_BYTES>(d, cs, q, tid);
        wg_barrier(c);
        const int col = q * PIECE_COLS + box * 64 + chunk * 8; /* from the block's first */
        if (col < ncols && n_wg + col < ldc) {
#pragma unroll
            for (int p = 0; p < 8; p++) {
                const int i = tid / 16 + 8 * p;
                if (dst[p] < 0)
                    continue;
                const uint4 v = *(const uint4 *)(cs + box * 8192 + moe_swizzle128(i, chunk));
                *(uint4 *)(C + (size_t)dst[p] * ldc + n_wg + col) = v;
            }
        }
    }
}

/**
 * The transposed epilogue of a swapped tail tile (bf16; grouped_gemm_sm90.cu's swaptail
 * schedules): warpgroup @p c holds Cᵀ for 128 output columns (features) and @p NT token rows
 * as two wgmma m64nNT accumulators, @p d0 for features 0..63 and @p d1 for 64..127
 * (feature = the accumulator's row, token = its column). Element (feature f, token j)
 * belongs at C[m0 + j][n_wg + f], so each half goes through the staging buffer
 * TRANSPOSED — written as fp32 rows [token j][64 features] of 256 bytes, the 16-byte chunk
 * q of row j stored at chunk q ^ (j % 16) (the four tokens one store instruction writes
 * then fall in different banks) — and is read back a row at a time: 8 threads cover one
 * token's 64 features, each reading 8 fp32 (two chunks), adding the old value when
 * @p accumulate (in fp32, one rounding, as epilogue_masked does), and writing 8 bf16 as one
 * 16-byte store. Tokens at or past @p r_end (the next group's rows, or the padding up to
 * NT) and columns at or past @p ldc are not written. ldc is a multiple of 8, so a 16-byte
 * chunk of 8 columns is wholly in or out. No TMA: plain barriers order the staging writes
 * and reads, and epilogue_reserve() first waits until an earlier TMA copy-out of this
 * buffer has read it.
 */
template <int NT, int C_BYTES>
static __device__ __forceinline__ void epilogue_transposed(const float *d0, const float *d1,
                                                           uint8_t *cs, int c, int tid,
                                                           moe_bf16 *C, int ldc, int m0,
                                                           int n_wg, int r_end, int accumulate) {
    static_assert(NT % 16 == 0 && NT * 64 * 4 <= C_BYTES, "a half's fp32 staging must fit");
    const int warp = tid / 32, lane = tid % 32, oct = tid % 8;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const float *d = h ? d1 : d0;
        epilogue_reserve(c, tid); /* the buffer is free (TMA and the last half have read it) */
#pragma unroll
        for (int j = 0; j < NT / 8; j++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
#pragma unroll
                for (int x = 0; x < 2; x++) {
                    const int f = 16 * warp + lane / 4 + 8 * e, tok = 8 * j + 2 * (lane % 4) + x;
                    float *dst = (float *)(cs + tok * 256 + (((f / 4) ^ (tok % 16)) * 16)) + f % 4;
                    *dst = d[4 * j + 2 * e + x];
                }
            }
        }
        wg_barrier(c);
        const int col = n_wg + 64 * h + 8 * oct; /* this thread's 8 columns */
        if (col < ldc) {
#pragma unroll
            for (int p = 0; p < NT / 16; p++) {
                const int i = tid / 8 + 16 * p, row = m0 + i;
                if (row >= r_end)
                    continue;
                const uint8_t *src = cs + i * 256;
                const float4 lo = *(const float4 *)(src + ((2 * oct) ^ (i % 16)) * 16);
                const float4 hi = *(const float4 *)(src + ((2 * oct + 1) ^ (i % 16)) * 16);
                float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
                uint4 *o = (uint4 *)(C + (size_t)row * ldc + col);
                if (accumulate) {
                    const uint4 old = *o;
                    const __nv_bfloat162 *ob = (const __nv_bfloat162 *)&old;
#pragma unroll
                    for (int q = 0; q < 4; q++) {
                        const float2 f2 = __bfloat1622float2(ob[q]);
                        v[2 * q] += f2.x;
                        v[2 * q + 1] += f2.y;
                    }
                }
                uint4 out;
                __nv_bfloat162 *pb = (__nv_bfloat162 *)&out;
#pragma unroll
                for (int q = 0; q < 4; q++)
                    pb[q] = __floats2bfloat162_rn(v[2 * q], v[2 * q + 1]);
                *o = out;
            }
        }
    }
}

/**
 * The same block written directly to @p C ([*, ldc], bf16 or fp32 as C32), rows from @p m_wg
 * (the block's first) up to @p r_end (exclusive: where the group ends), columns from @p n_wg,
 * at most @p ncols of them and none at or past @p ldc; @p accumulate adds to C.
 */
template <int C32, int NW>
static __device__ __forceinline__ void epilogue_masked(const float *d, void *C, int ldc, int m_wg,
                                                       int n_wg, int ncols, int r_end, int tid,
                                                       int accumulate) {
    const int warp = tid / 32, lane = tid % 32, r_lo = warp * 16 + lane / 4;
#pragma unroll
    for (int j = 0; j < NW / 8; j++) {
        if (8 * j >= ncols)
            break;
        const int col = n_wg + 8 * j + 2 * (lane % 4);
        if (col >= ldc)
            continue;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = m_wg + r_lo + 8 * h;
            if (row >= r_end)
                continue;
            float x = d[4 * j + 2 * h], y = d[4 * j + 2 * h + 1];
            const size_t at = (size_t)row * ldc + col;
            if (C32) {
                float2 *o = (float2 *)((float *)C + at);
                if (accumulate) {
                    x += o->x;
                    y += o->y;
                }
                *o = make_float2(x, y);
            } else {
                __nv_bfloat162 *o = (__nv_bfloat162 *)((moe_bf16 *)C + at);
                if (accumulate) {
                    const float2 old = __bfloat1622float2(*o);
                    x += old.x;
                    y += old.y;
                }
                *o = __floats2bfloat162_rn(x, y);
            }
        }
    }
}
#endif

#endif /* MOE_SM90_EPILOGUE_CUH */
