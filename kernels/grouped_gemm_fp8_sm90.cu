/*
 * Chapter 05's FP8 grouped GEMM for Hopper: every expert's forward Linear in one persistent
 * kernel, on E4M3 operands with DeepSeek-V3's blockwise scales, the group offsets read from
 * DEVICE memory (sync-free, as chapter 03's bf16 kernel, grouped_gemm_sm90.cu, whose
 * structure, scheduler rule, PTX helpers and epilogue it reuses):
 *
 *   Y[r, n] = Σ_kb  sa[r][kb] · sb_g[n / 128][kb] · Σ_{k in block kb} qa[r, k] · qb_g[n, k]
 *
 * for each row r of group g (rows off[g] .. off[g+1] − 1), with qa the 1×128-tiled
 * activation codes [rows, K] and sa their scales [rows][K/128] (moe_cpu_quant_blockwise,
 * block_2d = 0), qb_g the 128×128-block weight codes of expert g [N, K] and sb_g its scales
 * [⌈N/128⌉][K/128] (block_2d = 1, quantized per expert), all as the quantizers write them.
 *
 * Why the scales cannot go outside the sum: a scale changes every 128 elements of K, so the
 * kernel must apply it per 128-deep K block. Here that block is exactly one pipeline stage
 * (BK = 128 FP8 = 128 bytes, one swizzled row), so per stage each consumer warpgroup
 *   1. issues 4 wgmma m64n128k32 (E4M3 × E4M3 → fp32) into a TEMPORARY accumulator t, the
 *      first with scale_d = 0 (t = A·B: no zeroing pass);
 *   2. waits for them, releases the stage to the producer;
 *   3. adds t · (sa[row] · sb) into the main accumulator d, in fp32 on the CUDA cores.
 * That is DeepGEMM's "promotion": besides applying the scales, it bounds how long Hopper's
 * FP8 tensor cores accumulate with their reduced precision (DeepSeek-V3 measured about 14
 * bits of the fp32 sum) to 128 products; the sum over K is a full fp32 one.
 *
 * The CTA: 288 threads (2 consumer warpgroups + 1 producer warp), one CTA per SM, tiles of
 * 128 rows × 128 columns (each warpgroup 64 rows × 128 columns). Why BN = 128 where the bf16
 * kernel uses 256: a thread holds its 64 main accumulators AND 64 temporary ones; at 256
 * columns that would be 256 registers of accumulators alone, over the 255 a thread has.
 * A stage is 16 KB of A and 16 KB of B; 6 stages (192 KB) + two 16 KB staging buffers =
 * 224 KB of the SM's 227. Each warpgroup waits for its own MMAs before promoting (the
 * temporary accumulator is read right after), so the tensor cores stay busy only while the
 * two warpgroups alternate: one promotes while the other's MMAs run. Left alone they do not:
 * both wait for the same stage, issue their MMAs at the same moment (the tensor cores then
 * interleave them and finish both together), and promote at the same moment, with the
 * tensor cores idle. The ORDERED variant imposes the alternation (two named barriers, 3 and
 * 4, in the way of CUTLASS's ordered sequence barrier): warpgroup 0 issues its k-block, then
 * warpgroup 1 its own, then 0 the next, ... so warpgroup 0's MMAs finish first and it
 * promotes while warpgroup 1's run, and its next MMAs are queued before those end.
 * Which variant runs: moe_cuda_fp8_grouped_set_ordered() (tests, benchmark), else
 * MOE_FP8_GROUPED_ORDERED=0|1, else the default (kernels/cuda_ops.h).
 *
 * The 128 × 256 tile (TN = 256; the default since it passed tests/gpu_quant.c on an H100 at
 * 27db17a, bit-identical to the 128-column tile; MOE_FP8_GROUPED_BN=128 or
 * moe_cuda_fp8_grouped_set_bn(128) selects the narrow one), DeepGEMM's way around the
 * register limit above, a "split promotion": each warpgroup owns 64 rows × 256 columns of
 * MAIN accumulators (128 per thread) but keeps the TEMPORARY one at 64 rows × 128 columns
 * (64 per thread). Per k-block it issues the 4 m64n128k32 of columns 0..127 into t, waits,
 * promotes t into d[0..63] with the scale of weight block n0/128, then issues columns
 * 128..255 into the same t, waits, promotes into d[64..127] with block n0/128 + 1's scale:
 * each half is exactly one 128 × 128 weight scale block. Every output element is then the
 * same fp32 sum as the 128-column tile's (the same m64n128k32 on the same bytes, the same
 * scale product, the same order of k-blocks), so the two tile widths agree bit for bit.
 * The ORDERED turns become halves: warpgroup 0's half 0, 1's half 0, 0's half 1, 1's half
 * 1, 0's half 0 of the next k-block, ... (the same two barriers, an arrival after each
 * issue: each warpgroup waits for the other's previous half, so there is at most one turn
 * outstanding and both walk the same number of halves); while one warpgroup promotes, the
 * other's MMAs run and its own next MMAs are queued behind them. A stage is released after
 * its last half. What it saves: the shared-memory operand reads per FLOP do not change (the
 * same m64n128k32), but a tile moves 16 KB of A + 32 KB of B per k-block for 128 × 256
 * outputs where two 128-column tiles move 64 KB (A twice), and the stage waits, scale loads
 * and epilogue hand-offs per FLOP halve. Registers: 192 of accumulators + addressing do not
 * fit the 168 a thread gets from 384 threads, nor 288 threads' cap (ptxas spills ~700
 * bytes either way), so the CTA is 384 threads: a whole producer warpgroup that gives its
 * registers back (setmaxnreg 40) and two consumer warpgroups that take 232 (ptxas: no
 * spills, registers up to R229). A stage is 16 KB of A and 32 KB of B (two 128-row boxes of
 * the weights' map), 4 stages = 192 KB + the two 16 KB staging buffers (a warpgroup's 64 ×
 * 256 block leaves through its buffer in pieces, each waiting until TMA has read the last)
 * = 224 KB. A tile whose second half lies wholly past N (N = 256·k + 1..128) neither loads
 * nor computes it, and reads no scale past the ⌈N/128⌉ blocks of its expert. The tile
 * scheduler gets the width 256 (moe_tile_at_rule's bn), as the bf16 kernel's 256 columns.
 * Its own instantiations (WIDE = 1): the 128-column kernels compile to the same PTX as before
 * (tools/device_code_diff.py).
 *
 * Scales: the consumer thread loads the two row scales it needs (rows r_lo and r_lo + 8 of
 * its 64, see sm90_epilogue.cuh for the accumulator layout) and the tile's one weight-block
 * scale with ordinary loads one k-block AHEAD of their use, so their latency hides behind a
 * whole k-block of MMAs; sa is [rows][K/128], so these are strided 4-byte loads (the 32-byte
 * sector of a row's scales serves 8 k-blocks from L1), 3 per thread and k-block. A row past
 * the tensor gets scale 0.
 *
 * Ragged edges as in the bf16 kernel: the tile scheduler (lib/moe/tile_schedule.h, the same
 * rule) never lets a tile cross a group; rows of a tile past its group's end are loaded
 * (next group's, or TMA's zero fill past the tensor) and not stored: a warpgroup whose 64
 * rows cross the end writes directly with a row mask, others through TMA; the second 64-row
 * A box is not loaded when the group has no rows in it; the weights are a 3-D tensor map
 * [G, N, K], so a tile past N reads zeros, not the next expert.
 *
 * The same kernel runs dgrad (dX = dY · W_g = dY · (W_gᵀ)ᵀ): A = dY quantized 1×128 along
 * its N, B = the K-major FP8 copy of each W_gᵀ (the 128×128 blocks transposed: the same codes,
 * the scales transposed), made with the forward's codes in one fused pass
 * (moe_cuda_quant_blockwise_t_act; the MoE layer does this, lib/lowp.h, lib/mlp.c). wgrad
 * (dW_g = dY_gᵀ · X_g) would need dY_gᵀ and X_gᵀ tiled 1×128 along the TOKENS, per group,
 * each group's rows padded to a multiple of 128 — not written yet: the layer's wgrad is
 * chapter 03's bf16 grouped kernel.
 *
 * sm_100a has no wgmma: the kernel body compiles to a trap there and the launcher returns a
 * named error unless moe_cuda_grouped_sm90_available().
 */
#include <stdint.h>
#include <stdlib.h>

#include "cuda_common.cuh"
#include "cuda_ops.h"
#include "moe/tile_schedule.h"
#include "sm90_epilogue.cuh"
#include "sm90_ptx.cuh"
#include "wgmma.cuh"

namespace {

constexpr int BM = 128;     /* rows of a tile: 2 consumer warpgroups × 64 */
constexpr int BH = 128;     /* columns of one wgmma m64n128k32 = of a weight scale block = of a
                               B box; a tile is TN = BH (the default) or 2·BH columns wide */
constexpr int BK = MOE_QUANT_BLOCK; /* k per stage: one scale block = one 128-byte row */
[[maybe_unused]] constexpr int BAND = 8; /* m-tiles per raster band (tile_schedule.h) */
[[maybe_unused]] constexpr int MAX_G = MOE_GROUPED_DEV_MAX_GROUPS;
constexpr int A_BYTES = BM * BK;
[[maybe_unused]] constexpr int B_BOX = BH * BK; /* one 128-row weight box */
constexpr int C_BYTES = 16384; /* a warpgroup's staging: 64 × 128 bf16, or half of fp32 */
static_assert(BK == 128, "a stage must be one 128-deep scale block of 128 bytes");

/* What depends on the tile width TN (WIDE = 0: 128, 1: 256; a 0/1 template parameter, so
 * that tools/device_code_diff.py matches the 128-column kernels with their old names): 128 × 128 tiles, 6 stages of 32 KB, 288 threads (the
 * producer a single warp); 128 × 256 tiles, 4 stages of 48 KB, 384 threads (the producer a
 * whole warpgroup, so that setmaxnreg can hand its registers to the consumers). Both:
 * stages + two staging buffers = 224 KB of the SM's 227. */
template <int WIDE> struct Tile {
    static constexpr int TN = WIDE ? 2 * BH : BH; /* the tile's columns */
    static constexpr int STAGES = TN == BH ? 6 : 4;
    static constexpr int STAGE_BYTES = A_BYTES + TN * BK;
    static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 2 * C_BYTES;
    static constexpr int THREADS = TN == BH ? 288 : 384;
    static_assert(SMEM_BYTES <= 227 * 1024, "shared memory");
};

struct Params {
    const int *off;  /* [G+1] group row offsets, DEVICE memory */
    int G, rows, N, K;
    const float *sa; /* [rows][K/128] activation scales (1/scale) */
    const float *sb; /* [G][⌈N/128⌉][K/128] weight scales */
    void *C;         /* [rows, N] output, for the masked stores */
};

/* C32: fp32 output, else bf16. ORDERED: the warpgroups issue their k-blocks (halves) in turn
 * (above). WIDE: 128 × 256 tiles (the split promotion, above), else 128 × 128. */
template <int C32, int ORDERED, int WIDE>
__global__ void __launch_bounds__(Tile<WIDE>::THREADS, 1)
    fp8_grouped_kernel(const __grid_constant__ CUtensorMap map_a,
                       const __grid_constant__ CUtensorMap map_b,
                       const __grid_constant__ CUtensorMap map_c, const Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int TN = Tile<WIDE>::TN;
    constexpr int STAGES = Tile<WIDE>::STAGES, STAGE_BYTES = Tile<WIDE>::STAGE_BYTES;
    constexpr int THREADS = Tile<WIDE>::THREADS;
    constexpr int NH = TN / BH; /* 128-column halves of the tile: 1 or 2 */
    extern __shared__ __align__(1024) uint8_t smem[];
    if (threadIdx.x == 0 && (smem_u32(smem) & 1023))
        __trap(); /* 128-byte swizzled tiles must start on a 1024-byte boundary */
    __shared__ uint64_t full[STAGES], empty[STAGES];
    __shared__ int s_off[MAX_G + 1], s_mt[MAX_G + 1];

    /* wg 2 = the producer (a warp at TN = 128, a warpgroup at 256) */
    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
    for (int g = threadIdx.x; g <= p.G; g += THREADS)
        s_off[g] = p.off[g];
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(&full[s], 1);  /* the producer's expect_tx arrival (+ the bytes) */
            mbar_init(&empty[s], 8); /* one arrival per consumer warp */
        }
        mbar_init_fence();
    }
    __syncthreads();
    if (threadIdx.x == 0)
        moe_tile_prefix_rule(s_mt, s_off, p.G, BM);
    __syncthreads();
    const int ntn = (p.N + TN - 1) / TN, nk = p.K / BK;

    if (wg == 2) { /* ------------------------------------------------ producer */
        if constexpr (NH == 2)
            setmaxnreg_dec<40>(); /* the consumers' accumulators need its registers */
        if (tid == 0) {
            int it = 0;
            moe_tile ti;
            for (int t = blockIdx.x;
                 moe_tile_at_rule(&ti, t, s_off, s_mt, p.G, ntn, BM, TN, BAND); t += gridDim.x) {
                const int a2 = ti.r1 - ti.m0 > BM / 2; /* the group has rows in A's 2nd box */
                /* the tile's second 128 columns hold some of N (else not loaded nor used) */
                const int two = NH == 2 && ti.n0 + BH < p.N;
                for (int kt = 0; kt < nk; kt++, it++) {
                    const int s = it % STAGES, phase = (it / STAGES) & 1;
                    mbar_wait(&empty[s], phase ^ 1);
                    uint8_t *a = smem + s * STAGE_BYTES, *b = a + A_BYTES;
                    mbar_expect_tx(&full[s], (a2 ? A_BYTES : A_BYTES / 2) + (1 + two) * B_BOX);
                    tma_load_2d(a, &map_a, &full[s], kt * BK, ti.m0);
                    if (a2)
                        tma_load_2d(a + A_BYTES / 2, &map_a, &full[s], kt * BK, ti.m0 + BM / 2);
                    tma_load_3d(b, &map_b, &full[s], kt * BK, ti.n0, ti.g);
                    if (two)
                        tma_load_3d(b + B_BOX, &map_b, &full[s], kt * BK, ti.n0 + BH, ti.g);
                }
            }
        }
        return;
    }

    /* ---------------------------------------------------- consumers */
    if constexpr (NH == 2)
        setmaxnreg_inc<232>();
    const int c = wg, warp = tid / 32, lane = tid % 32;
    const int r_lo = warp * 16 + lane / 4; /* this thread's rows: r_lo and r_lo + 8 of 64 */
    uint8_t *cs = smem + STAGES * STAGE_BYTES + c * C_BYTES;
    const int nbn = (p.N + MOE_QUANT_BLOCK - 1) / MOE_QUANT_BLOCK; /* weight blocks along N */
    int it = 0; /* k-blocks consumed so far: the stage ring's position */
    moe_tile ti;
    /* main accumulators (64 rows × TN) and the temporary one (64 rows × 128, one k-block
     * of one half) */
    float d[TN / 2], acc[BH / 2];
    for (int t = blockIdx.x; moe_tile_at_rule(&ti, t, s_off, s_mt, p.G, ntn, BM, TN, BAND);
         t += gridDim.x) {
        const int m_wg = ti.m0 + 64 * c; /* our 64 rows' first */
        const int row0 = m_wg + r_lo, row1 = row0 + 8;
        const int two = NH == 2 && ti.n0 + BH < p.N; /* as the producer decides */
        const float *sa0 = p.sa + (size_t)(row0 < p.rows ? row0 : 0) * nk;
        const float *sa1 = p.sa + (size_t)(row1 < p.rows ? row1 : 0) * nk;
        /* weight block n0 / 128's scales; when two, block n0 / 128 + 1's follow at + nk (it
         * exists: n0 + 128 < N) */
        const float *sb = p.sb + ((size_t)ti.g * nbn + ti.n0 / MOE_QUANT_BLOCK) * nk;
#pragma unroll
        for (int i = 0; i < TN / 2; i++)
            d[i] = 0.0f;
        /* k-block 0's scales; each step loads the next one's (nk >= 1) */
        float nb = __ldg(sb), na0 = row0 < p.rows ? __ldg(sa0) : 0.0f;
        float na1 = row1 < p.rows ? __ldg(sa1) : 0.0f;
        float nbh = two ? __ldg(sb + nk) : 0.0f; /* the second half's weight scale */
        for (int kt = 0; kt < nk; kt++, it++) {
            const int s = it % STAGES, phase = (it / STAGES) & 1;
            const float s0 = na0 * nb, s1 = na1 * nb;
            const float s0h = na0 * nbh, s1h = na1 * nbh;
            if (kt + 1 < nk) {
                nb = __ldg(sb + kt + 1);
                na0 = row0 < p.rows ? __ldg(sa0 + kt + 1) : 0.0f;
                na1 = row1 < p.rows ? __ldg(sa1 + kt + 1) : 0.0f;
                if (two)
                    nbh = __ldg(sb + nk + kt + 1);
            }
            mbar_wait(&full[s], phase);
            const uint8_t *a = smem + s * STAGE_BYTES + c * (A_BYTES / 2);
            const uint8_t *b = smem + s * STAGE_BYTES + A_BYTES;
#pragma unroll
            for (int h = 0; h < NH; h++) { /* the tile's 128-column halves */
                if (h > 0 && !two)
                    break; /* past N: nothing loaded, nothing to compute */
                /* our turn: the other warpgroup issued its previous half */
                if (ORDERED && (c == 1 || it > 0 || h > 0))
                    named_bar_sync(3 + c, 256);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BK / 32; kk++) /* k32 steps: 32 bytes on in the row */
                    moe_wgmma_fp8<BH>::mma(acc, desc(a + kk * 32, 16, 1024),
                                           desc(b + h * B_BOX + kk * 32, 16, 1024), kk > 0);
                wgmma_commit();
                if (ORDERED) /* the other warpgroup's turn */
                    named_bar_arrive(4 - c, 256);
                wgmma_wait<0>();
                if (lane == 0 && (h == NH - 1 || !two)) /* this warp is done with the stage */
                    mbar_arrive(&empty[s]);
                const float t0 = h ? s0h : s0, t1 = h ? s1h : s1;
#pragma unroll
                for (int i = 0; i < BH / 2; i++) { /* the promotion: d += t · sa·sb */
                    reg_fence(acc[i]);
                    d[h * (BH / 2) + i] = fmaf(acc[i], (i & 2) ? t1 : t0, d[h * (BH / 2) + i]);
                }
            }
        }

        /* ------------------------------------------------ epilogue (sm90_epilogue.cuh) */
        const int ncols = (1 + two) * BH; /* a second half past N is not staged */
        if (m_wg + 64 <= ti.r1) {
            epilogue_staged<C32, TN, C_BYTES>(d, cs, c, tid, ncols, [&](const uint8_t *src,
                                                                        int col) {
                const int n = ti.n0 + col;
                if (n >= p.N)
                    return 0;
                tma_store_2d(&map_c, src, n, m_wg);
                return 1;
            });
        } else if (m_wg < ti.r1) { /* the group ends inside our rows */
            epilogue_masked<C32, TN>(d, p.C, p.N, m_wg, ti.n0, ncols, ti.r1, tid, 0);
        }
    }
    if (ORDERED && c == 0 && it > 0) /* consume warpgroup 1's last "your turn" */
        named_bar_sync(3, 256);
    if (tid == 0)
        bulk_wait_all(); /* the last copy-outs have landed before the kernel ends */
#else
    __trap(); /* sm_90a only: the host never launches it elsewhere */
#endif
}

long long g_bn256_calls = 0; /* launches of the 256-column kernel (a test's proof it ran) */

template <int C32, int ORDERED, int WIDE>
void launch(const CUtensorMap &ma, const CUtensorMap &mb, const CUtensorMap &mc, const Params &p,
            int max_tiles) {
    moe_cuda_smem_opt_in<fp8_grouped_kernel<C32, ORDERED, WIDE>>(Tile<WIDE>::SMEM_BYTES);
    const int grid = moe_cuda_persistent_grid(max_tiles);
    if (grid <= 0)
        return;
    fp8_grouped_kernel<C32, ORDERED, WIDE>
        <<<grid, Tile<WIDE>::THREADS, Tile<WIDE>::SMEM_BYTES, moe_cuda_stream()>>>(ma, mb, mc,
                                                                                   p);
    MOE_CUDA_LAUNCH_CHECK();
    if (WIDE)
        g_bn256_calls++;
}

/* the variant's launch for tile width Tile<WIDE>::TN */
template <int WIDE>
void launch_width(int d_fp32, int ord, const CUtensorMap &ma, const CUtensorMap &mb,
                  const CUtensorMap &mc, const Params &p, int max_tiles) {
    if (ord)
        d_fp32 ? launch<1, 1, WIDE>(ma, mb, mc, p, max_tiles)
               : launch<0, 1, WIDE>(ma, mb, mc, p, max_tiles);
    else
        d_fp32 ? launch<1, 0, WIDE>(ma, mb, mc, p, max_tiles)
               : launch<0, 0, WIDE>(ma, mb, mc, p, max_tiles);
}

int aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

int g_ordered = -1; /* the variant; -1 until first used */

int ordered(void) {
    if (g_ordered < 0) {
        const char *e = getenv("MOE_FP8_GROUPED_ORDERED");
        g_ordered = e && *e ? atoi(e) != 0 : MOE_FP8_GROUPED_ORDERED_DEFAULT;
    }
    return g_ordered;
}

int g_bn = -1; /* the tile width, 128 or 256; -1 until first used */

int tile_width(void) {
    if (g_bn < 0) {
        const char *e = getenv("MOE_FP8_GROUPED_BN");
        g_bn = e && *e ? (atoi(e) == 256 ? 256 : 128) : MOE_FP8_GROUPED_BN_DEFAULT;
    }
    return g_bn;
}

} /* namespace */

extern "C" moe_status moe_cuda_fp8_grouped_gemm(void *d, int d_fp32, const moe_qmatrix *a,
                                                const moe_qmatrix *b, const int *dev_off, int G,
                                                int rows, int N, int K, moe_error *err) {
    MOE_TRY(moe_fp8_grouped_check(a, b, G, rows, N, K, err));
    if (!aligned16(a->codes) || !aligned16(b->codes) || !aligned16(d) || !dev_off)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "FP8 grouped GEMM: the codes and the output must be 16-byte "
                             "aligned (TMA), and the offsets given (device memory)");
    if (!moe_cuda_grouped_sm90_available())
        return moe_error_set(err, MOE_ERR_BACKEND,
                             "FP8 grouped GEMM: our kernel is wgmma (sm_90a, Hopper) only; on "
                             "this GPU run moe_cuda_fp8_gemm per expert");
    if (rows == 0 || N == 0 || G == 0)
        return MOE_OK;
    /* A [rows, K] bytes, boxes of 64 rows × 128 k; B [G, N, K], boxes of 128 rows × 128 k
     * (two per stage in a 256-column tile); C [rows, N], boxes of 64 rows × 128 bytes */
    const uint64_t da[2] = {(uint64_t)K, (uint64_t)rows};
    const uint64_t db[3] = {(uint64_t)K, (uint64_t)N, (uint64_t)G};
    const uint64_t dc[2] = {(uint64_t)N, (uint64_t)rows};
    const uint32_t ba[2] = {BK, BM / 2}, bb[3] = {BK, BH, 1};
    const uint32_t bc[2] = {(uint32_t)(d_fp32 ? 32 : 64), 64};
    const Params p = {dev_off, G, rows, N, K, (const float *)a->scales,
                      (const float *)b->scales, d};
    const CUtensorMap ma = moe_tma_map(a->codes, 2, da, ba, MOE_TMA_U8);
    const CUtensorMap mb = moe_tma_map(b->codes, 3, db, bb, MOE_TMA_U8);
    const CUtensorMap mc = moe_tma_map(d, 2, dc, bc, d_fp32 ? MOE_TMA_F32 : MOE_TMA_BF16);
    /* an upper bound of the tiles from host-known sizes: each group adds at most one
     * partial m-tile */
    const int tn = tile_width();
    const int max_tiles = ((rows + BM - 1) / BM + G) * ((N + tn - 1) / tn);
    if (tn == 2 * BH)
        launch_width<1>(d_fp32, ordered(), ma, mb, mc, p, max_tiles);
    else
        launch_width<0>(d_fp32, ordered(), ma, mb, mc, p, max_tiles);
    return MOE_OK;
}

extern "C" void moe_cuda_fp8_grouped_set_ordered(int on) { g_ordered = on != 0; }

extern "C" int moe_cuda_fp8_grouped_ordered(void) { return ordered(); }

extern "C" void moe_cuda_fp8_grouped_set_bn(int bn) { g_bn = bn == 256 ? 256 : 128; }

extern "C" int moe_cuda_fp8_grouped_bn(void) { return tile_width(); }

extern "C" long long moe_cuda_fp8_grouped_bn256_calls(void) { return g_bn256_calls; }
