/*
 * The ping-pong wgrad for Hopper (chapter 03): dw_g[O,I] (+)= dout_gᵀ · in_g for every
 * expert group g in one persistent sm_90a kernel, the group offsets read from DEVICE memory
 * (sync-free, as kernels/grouped_gemm_sm90.cu, whose header explains the operands: A = dout
 * and B = in, both MN-major, the reduction over the group's rows). Same problem, same
 * three dw modes, same ragged k-loop; a different division of the work between the two
 * consumer warpgroups.
 *
 * STATUS: passed test_gpu_grouped_wgrad_pingpong on an H100 (6fe39a1: every mode, every
 * shape, 3 launches each) and measured there at 512 rows per expert (sweep512) against the
 * 128 × 256 kernel: fp32 stored 0.94-1.01x, bf16 0.81-0.89x, fp32 added 0.98-0.99x
 * (docs/results/03-grouped-gemm-ii.md §3g): the half-size warpgroup tile's extra operand
 * traffic costs more than the hidden epilogue saves. Off by default: moe_cuda_grouped_sm90_backward()
 * runs it only with MOE_GROUPED_WGRAD_PINGPONG=1 (or moe_cuda_grouped_sm90_set_wgrad_pingpong),
 * and only where its wgrad would run in one chunk (split S == 1) on a contiguous input.
 *
 * Why. In grouped_gemm_sm90.cu a 128 × 256 tile is shared by the two consumer warpgroups
 * (64 rows each): both run the main loop together, then both run the epilogue together,
 * and while they copy the accumulators out (registers → 16 KB staging pieces → TMA) the
 * tensor cores idle. In the fine-grained regime (Qwen3-235B-A22B: ~512 rows per expert) a
 * wgrad tile's main loop is short — 512 rows are 8 k-steps of 64 — and its epilogue is big
 * (the whole 128 × 256 fp32 block, 128 KB; 64 KB in bf16), so that idle time is a large
 * share: measured, the wgrad stores reach 65-69 % of the dense bf16 ceiling at 512 rows per
 * expert where the forward and dgrad reach 71-79 % (docs/results/03-grouped-gemm-ii.md,
 * the sweep512 table and "Why 75% is out of reach").
 *
 * Ping-pong (CUTLASS's KernelTmaWarpSpecializedPingpong): each consumer warpgroup owns a
 * WHOLE tile of 128 × 128 — per k16, two wgmma m64n128k16 on the two 64-row boxes of A and
 * the same B (64 + 64 accumulators, the 128 a thread of today) — and the two warpgroups
 * take the CTA's tiles in turn: tile j of the CTA's static sequence (b, b + gridDim, ...)
 * is warpgroup j % 2's. An ordering barrier lets one warpgroup at a time run its main
 * loop, so warpgroup 1 issues its MMAs while warpgroup 0 copies its tile out, and the
 * other way round:
 *
 *     tensor cores   | WG0 tile 0 | WG1 tile 1 | WG0 tile 2 | WG1 tile 3 | ...
 *     epilogue       |            | WG0 tile 0 | WG1 tile 1 | WG0 tile 2 | ...
 *
 * The overlap, per SM (H100: ~4,096 dense bf16 FLOP a clock an SM, i.e. 989 TFLOP/s over
 * 132 SMs at ~1.83 GHz): a k-step of a 128 × 128 tile is 2·128·128·64 = 2.1 MFLOP, ~512
 * clocks, so 512 rows (8 k-steps) are ~4,100 clocks of main loop. Its epilogue is 64 KB of
 * fp32 (32 KB bf16) in 16 KB pieces, each written from registers (≥ 128 clocks at 128
 * bytes a clock), fenced and handed to TMA, the next waiting until TMA has read the last:
 * roughly 1,200-2,000 clocks for fp32, so it fits under the other warpgroup's main loop,
 * and the tensor cores see one main loop after the other. What is left is the memory
 * wall of the header of grouped_gemm_sm90.cu: at 4,100 clocks a tile, an SM writes 16
 * bytes of fp32 dw a clock, ~3.9 TB/s over the GPU — a STORE at 512 rows per expert is
 * still bound by HBM (~3.35 TB/s), a reduce-add (read and write: twice that) much more
 * so; the bf16 store (half) is where the overlap should show whole.
 *
 * The price, to watch when it is measured: a warpgroup's tile is half the CTA tile of
 * grouped_gemm_sm90.cu (128 accumulators a thread allow 128 × 128 or 64 × 256 per
 * warpgroup, and 128 × 128 loads the least of those), so per FLOP it loads 37 % more
 * through TMA (32 KB per 2.1 MFLOP against 48 KB per 4.2 MFLOP: ~64 bytes a clock an SM at
 * the full MMA rate, served by L2, where the operands of a group's tiles stay) and its
 * wgmma read 20 % more shared memory (two m64n128k16 read B twice: 12 KB per k16, where
 * one m64n256k16 of the same FLOPs reads 10 KB). If the measurement shows the kernel fed too
 * slowly rather than stalled in its epilogue, the next step is CUTLASS's: 2-CTA clusters
 * that multicast the shared operand.
 *
 * The pipeline: one producer thread (warp 8) walks ALL the CTA's tiles in order and loads
 * each k-step (A: two [64 k][64 O] boxes, B: two [64 k][64 I] boxes, 32 KB) into the next
 * stage of ONE ring of STAGES = 6 (6 × 32 KB + 2 × 16 KB staging = 224 KB). A stage is
 * read by the one warpgroup whose tile it belongs to: its "empty" barrier counts that
 * warpgroup's 4 warps. Each consumer warpgroup also walks all tiles and counts the other
 * warpgroup's k-steps into its ring position `it` (the k-loops are ragged: each tile's
 * length comes from the offsets, so the position is a sum, not CUTLASS's k · tiles).
 * Because the main loops are ordered, the ring's stages are waited for in exactly the
 * order the producer fills them, as with one consumer: a warpgroup never waits on a stage
 * more than one phase ahead, where the parity wait of an mbarrier would alias. (Without
 * the ordering, warpgroup 1 could start on stage it = 8 of a 6-stage ring before its
 * first fill and pass the wait on the wrong parity: the ordering barrier is needed for
 * correctness, not only for speed.)
 *
 * The ordering barrier: two mbarriers, order[c] = "warpgroup c may run its main loop",
 * 4 arrivals (a lane of each warp of the other warpgroup). Warpgroup c, before tile j > 0
 * of the CTA (one of its own), waits for phase (j − 1) / 2 of order[c]; after ISSUING its
 * last k-step (before waiting for those MMAs) it arrives on order[c ^ 1]. Tile 0 waits for
 * nothing. So order[1] completes phase k when warpgroup 0 has issued tile 2k, and order[0]
 * phase k when warpgroup 1 has issued tile 2k + 1. A warpgroup cannot arrive twice before
 * the other has waited (its next arrival needs the other's), so no phase is skipped.
 * Deadlock freedom:
 *   - every tile of the sequence takes its turn, an empty one too (nk = 0: wait, arrive,
 *     and an ACCUMULATE then skips the epilogue, a STORE stores zeros), so the arrival a
 *     wait needs — from tile j − 1, which exists whenever tile j does — always comes;
 *   - a wait happens only before a tile that exists: a warpgroup whose next tile is past
 *     the end (an odd count, a CTA with one tile, a CTA whose second warpgroup has none)
 *     just leaves; an arrival nobody waits for is harmless;
 *   - the producer waits for stage it − STAGES, released by its tile's warpgroup after its
 *     wgmma read it: either at the next k-step of that tile (whose fill is earlier than
 *     `it`, already done) or after the tile's last MMA — which waits for nothing but the
 *     tensor cores. A main loop needs its turn (the previous tile's ISSUE, which needs only
 *     earlier fills) and its own fills. No cycle: every wait points at an earlier fill or
 *     an earlier tile.
 *
 * Kept from grouped_gemm_sm90.cu: the wgrad raster (banded, moe_tile_band_place of
 * lib/moe/tile_schedule.h), the 3-D tensor map [G][O][I] for dw (rows past O and columns
 * past I are clipped by TMA; a second 64-row half wholly past O is not copied out at all),
 * the ragged k-loop (the last k-step of a group reads the next group's rows: the warpgroup
 * zeroes those rows of its A tile in shared memory before the wgmma), the three dw modes
 * (fp32 reduce-add, fp32 store with zeros for an empty group, bf16 store) and the staged
 * epilogue (sm90_epilogue.cuh, each warpgroup its own 16 KB buffer: the two epilogues
 * never share one, so unlike CUTLASS's they need no ordering of their own). Not here:
 * split-K (where moe_cuda_grouped_sm90_wgrad_split() would cut the k-loop the 128 × 256
 * kernel runs) and the fused gather (in.map: the 128 × 256 kernel).
 *
 * sm_100a has no wgmma: the kernel body compiles to a trap there, and the host never
 * launches it (moe_cuda_grouped_sm90_available()).
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

constexpr int BM = 128;     /* rows of dw_g per tile (O): two 64-row A boxes */
constexpr int BN = 128;     /* columns per tile (I): one m64n128k16 per A box */
constexpr int BK = 64;      /* rows of the group per k-step: one 128-byte swizzle row of bf16 */
constexpr int STAGES = 6;   /* the ring, shared by both warpgroups (in tile order) */
constexpr int MAX_G = MOE_GROUPED_DEV_MAX_GROUPS;
constexpr int THREADS = 288; /* 2 consumer warpgroups (warps 0-7) + 1 producer warp */
constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int C_BYTES = 16384; /* a warpgroup's output staging: a piece of its tile */
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 2 * C_BYTES; /* 224 KB of the SM's 227 */
static_assert(SMEM_BYTES <= 227 * 1024 - 2048, "the static shared memory must fit beside");

struct Params {
    const int *off; /* [G+1] group row offsets, DEVICE memory */
    int G;
    int M;          /* rows of dw_g (O) */
    int N;          /* columns of dw_g (I) */
    int accumulate; /* fp32 reduce-add (MOE_DW_ACCUMULATE), else store */
    int prefetch;   /* reduce-add: the producer prefetches each tile's dw into L2
                       (prefetch_dw_tile, MOE_WGRAD_PREFETCH) */
};

struct Tile {
    int g, m0, n0; /* group, first row and first column of dw_g */
    int r0, r1;    /* the group's rows [r0, r1): the k-loop */
    int nk;        /* k-steps, ceil((r1 − r0) / BK): 0 for an empty group */
};

#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL) /* nothing for sm_100a */
constexpr int BOX_BYTES = 64 * BK * 2; /* one [64 k][64 mn] MN-major box: 8 KB */
constexpr int BAND = 8; /* m-tiles per raster band, as grouped_gemm_sm90.cu's wgrad */

/* Tile t of the G · mtn · ntn tiles of dw: group t / (mtn · ntn), then the banded raster
 * of grouped_gemm_sm90.cu's wgrad (lib/moe/tile_schedule.h) inside the group. */
__device__ __forceinline__ void tile_at(int t, const int *off, int mtn, int ntn, Tile &ti) {
    const int per = mtn * ntn;
    int mi, ni;
    moe_tile_band_place(t % per, mtn, ntn, BAND, &mi, &ni);
    ti.g = t / per;
    ti.m0 = mi * BM;
    ti.n0 = ni * BN;
    ti.r0 = off[ti.g];
    ti.r1 = off[ti.g + 1];
    ti.nk = (ti.r1 - ti.r0 + BK - 1) / BK;
}

/* One k-step of a warpgroup's 128 × 128 tile: per k16, A's box 0 (rows 0-63) into d[0..63]
 * and box 1 (rows 64-127) into d[64..127], both times the same B (two boxes side by side,
 * LBO = 8 KB). MN-major: the k16 steps advance 16 k-rows = 2048 bytes. The two chains are
 * independent, so the tensor cores always have the next wgmma. */
__device__ __forceinline__ void mma_kstep(float *d, const uint8_t *a, const uint8_t *b) {
#pragma unroll
    for (int kk = 0; kk < BK / 16; kk++) {
        const uint64_t db = desc(b + kk * 2048, 8192, 1024);
        moe_wgmma<BN, 1, 1>::mma(d, desc(a + kk * 2048, 8192, 1024), db, 1);
        moe_wgmma<BN, 1, 1>::mma(d + BN / 2, desc(a + BOX_BYTES + kk * 2048, 8192, 1024), db,
                                 1);
    }
}
#endif

/* C32: dw is fp32 (reduce-added or stored), else bf16 (stored). */
template <int C32>
__global__ void __launch_bounds__(THREADS, 1)
    wgrad_pingpong_kernel(const __grid_constant__ CUtensorMap map_a,
                          const __grid_constant__ CUtensorMap map_b,
                          const __grid_constant__ CUtensorMap map_c, const Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    /* 128-byte swizzled tiles must start on a 1024-byte boundary */
    extern __shared__ __align__(1024) uint8_t smem[];
    if (threadIdx.x == 0 && (smem_u32(smem) & 1023))
        __trap();
    __shared__ uint64_t full[STAGES], empty[STAGES];
    __shared__ uint64_t order[2]; /* order[c]: warpgroup c's turn to run its main loop */
    __shared__ int s_off[MAX_G + 1];

    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128; /* wg 2 = the producer warp */
    for (int g = threadIdx.x; g <= p.G; g += THREADS)
        s_off[g] = p.off[g];
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(&full[s], 1);  /* the producer's expect_tx arrival (+ the bytes) */
            mbar_init(&empty[s], 4); /* one arrival per warp of the warpgroup that read it */
        }
        mbar_init(&order[0], 4); /* one arrival per warp of the other warpgroup */
        mbar_init(&order[1], 4);
        mbar_init_fence();
    }
    __syncthreads();
    const int mtn = (p.M + BM - 1) / BM, ntn = (p.N + BN - 1) / BN, total = p.G * mtn * ntn;
    Tile ti;

    if (wg == 2) {
        /* ------------------------------------------------ producer: every tile, in order */
        if (tid == 0) {
            int it = 0;
            for (int t = blockIdx.x; t < total; t += gridDim.x) {
                tile_at(t, s_off, mtn, ntn, ti);
                for (int kt = 0; kt < ti.nk; kt++, it++) {
                    const int s = it % STAGES, phase = (it / STAGES) & 1;
                    const int k = ti.r0 + kt * BK;
                    if (C32 && p.prefetch &&
                        kt == (ti.nk > WGRAD_PREFETCH_LEAD ? ti.nk - WGRAD_PREFETCH_LEAD : 0))
                        prefetch_dw_tile<BM>(&map_c, ti.n0, ti.m0, ti.g, BN, p.N);
                    mbar_wait(&empty[s], phase ^ 1);
                    uint8_t *a = smem + s * STAGE_BYTES, *b = a + A_BYTES;
                    /* (boxes past O, I or the tensor's rows are zero-filled: full bytes) */
                    mbar_expect_tx(&full[s], STAGE_BYTES);
                    for (int i = 0; i < BM / 64; i++)
                        tma_load_2d(a + i * BOX_BYTES, &map_a, &full[s], ti.m0 + 64 * i, k);
                    for (int i = 0; i < BN / 64; i++)
                        tma_load_2d(b + i * BOX_BYTES, &map_b, &full[s], ti.n0 + 64 * i, k);
                }
            }
        }
        return;
    }

    /* ---------------------------------------------------- consumers */
    const int c = wg, lane = tid % 32;
    uint8_t *cs = smem + STAGES * STAGE_BYTES + c * C_BYTES; /* this warpgroup's staging */
    float d[BN]; /* rows 0-63 of the tile in d[0 .. 63], rows 64-127 in d[64 .. 127] */
    int it = 0;  /* position in the ring: every k-step of the CTA's tiles so far, both's */
    for (int j = 0, t = blockIdx.x; t < total; j++, t += gridDim.x) {
        tile_at(t, s_off, mtn, ntn, ti);
        if ((j & 1) != c) { /* the other warpgroup's tile: its k-steps pass us by */
            it += ti.nk;
            continue;
        }
        if (j > 0) /* our turn: the other warpgroup has issued tile j − 1 */
            mbar_wait(&order[c], ((j - 1) >> 1) & 1);
#pragma unroll
        for (int i = 0; i < BN; i++)
            d[i] = 0.0f;
        for (int kt = 0; kt < ti.nk; kt++, it++) {
            const int s = it % STAGES, phase = (it / STAGES) & 1;
            mbar_wait(&full[s], phase);
            uint8_t *a = smem + s * STAGE_BYTES, *b = a + A_BYTES;
            const int valid = ti.r1 - (ti.r0 + kt * BK); /* >= 1 */
            if (valid < BK) {
                /* the group ends in this k-step: k-rows valid .. 63 are the next group's
                 * (or TMA's zeros past the tensor). Zero them in both A boxes: a k-row of
                 * an MN-major box is one whole 128-byte line, so the swizzle does not
                 * matter; B's rows then meet zeros. */
                const int nz = (BK - valid) * 8; /* 16-byte chunks per box */
                for (int i = tid; i < 2 * nz; i += 128) {
                    const int box = i >= nz;
                    ((uint4 *)(a + box * BOX_BYTES + valid * 128))[i - box * nz] =
                        make_uint4(0, 0, 0, 0);
                }
                fence_proxy_async(); /* generic writes, read by wgmma (the async proxy) */
                wg_barrier(c);
            }
            wgmma_fence();
            mma_kstep(d, a, b);
            wgmma_commit();
            /* the previous k-step's MMAs are done once at most this one is pending */
            wgmma_wait<1>();
            if (kt > 0 && lane == 0)
                mbar_arrive(&empty[(it - 1) % STAGES]);
        }
        /* all our MMAs are issued: the other warpgroup's turn (its first wgmma queue
         * behind ours while we wait for them and copy the tile out) */
        if (lane == 0)
            mbar_arrive(&order[c ^ 1]);
        wgmma_wait<0>();
        if (ti.nk > 0 && lane == 0)
            mbar_arrive(&empty[(it - 1) % STAGES]);
#pragma unroll
        for (int i = 0; i < BN; i++)
            reg_fence(d[i]);
        if (ti.nk == 0 && p.accumulate)
            continue; /* an empty group adds nothing; a STORE writes its zeros */

        /* ------------------------------------------------ epilogue
         * each 64-row half through our staging buffer in pieces of C_BYTES (fp32: 2 × 64
         * columns, bf16: 1 × 128), each piece two TMA boxes [64 rows][128 bytes] into
         * dw [G][O][I]: reduce-added (ACCUMULATE) or stored. TMA clips the rows past O and
         * the columns past I; a half wholly past O is skipped. */
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int m_wg = ti.m0 + 64 * h;
            if (m_wg >= p.M)
                break;
            epilogue_staged<C32, BN, C_BYTES>(d + 64 * h, cs, c, tid, BN,
                                              [&](const uint8_t *src, int col) {
                                                  const int n = ti.n0 + col;
                                                  if (n >= p.N)
                                                      return 0;
                                                  if (C32 && p.accumulate)
                                                      tma_reduce_add_3d(&map_c, src, n, m_wg,
                                                                        ti.g);
                                                  else
                                                      tma_store_3d(&map_c, src, n, m_wg, ti.g);
                                                  return 1;
                                              });
        }
    }
    if (tid == 0)
        bulk_wait_all(); /* the last copy-outs have landed before the kernel ends */
#else
    __trap(); /* sm_90a only: the host never launches it elsewhere */
#endif
}

/* ---------------------------------------------------------------- host side */

int g_pingpong = -1; /* -1 until first used: then MOE_GROUPED_WGRAD_PINGPONG, else off */
int g_launches = 0;  /* launches of the kernel, for the tests */

template <int C32>
void launch(const CUtensorMap &ma, const CUtensorMap &mb, const CUtensorMap &mc, const Params &p,
            int tiles) {
    moe_cuda_smem_opt_in<wgrad_pingpong_kernel<C32>>(SMEM_BYTES);
    const int grid = moe_cuda_persistent_grid(tiles);
    if (grid <= 0)
        return;
    wgrad_pingpong_kernel<C32><<<grid, THREADS, SMEM_BYTES, moe_cuda_stream()>>>(ma, mb, mc, p);
    MOE_CUDA_LAUNCH_CHECK();
    g_launches++;
}

} /* namespace */

extern "C" void moe_cuda_grouped_sm90_set_wgrad_pingpong(int on) { g_pingpong = on != 0; }

extern "C" int moe_cuda_grouped_sm90_wgrad_pingpong(void) {
    if (g_pingpong < 0) {
        const char *e = getenv("MOE_GROUPED_WGRAD_PINGPONG");
        g_pingpong = e && *e && atoi(e) != 0;
    }
    return g_pingpong;
}

extern "C" int moe_cuda_grouped_sm90_wgrad_pingpong_launches(void) { return g_launches; }

extern "C" void moe_cuda_grouped_sm90_wgrad_pingpong_run(void *dw, const void *dout,
                                                         const void *in, const int *dev_off,
                                                         int G, int rows, int I, int O,
                                                         moe_dw_mode mode) {
    MOE_ASSERT(moe_cuda_grouped_sm90_available());
    if (G > MAX_G || I % MOE_GROUPED_DEV_ALIGN || O % MOE_GROUPED_DEV_ALIGN) {
        fprintf(stderr, "moe.c: the sm_90a ping-pong wgrad needs at most %d groups and feature "
                        "sizes that are multiples of %d (got G=%d, I=%d, O=%d)\n",
                MAX_G, MOE_GROUPED_DEV_ALIGN, G, I, O);
        exit(1);
    }
    const size_t nw = (size_t)G * O * I;
    if (rows == 0) { /* no rows (and no tensor map over them): an overwritten dw is zeros */
        if (mode != MOE_DW_ACCUMULATE)
            MOE_CUDA_CHECK(cudaMemsetAsync(
                dw, 0, nw * (mode == MOE_DW_ACT ? sizeof(moe_bf16) : sizeof(float)),
                moe_cuda_stream()));
        return;
    }
    /* A = dout [rows][O], B = in [rows][I], both read as MN-major [64 rows][64 features]
     * boxes; dw [G][O][I] written in boxes of 128 bytes × 64 rows (fp32: 32 columns) */
    const uint64_t da[2] = {(uint64_t)O, (uint64_t)rows}, db[2] = {(uint64_t)I, (uint64_t)rows};
    const uint64_t dc[3] = {(uint64_t)I, (uint64_t)O, (uint64_t)G};
    const uint32_t box[2] = {64, BK}, bc32[3] = {32, 64, 1}, bc16[3] = {64, 64, 1};
    const CUtensorMap ma = moe_tma_map(dout, 2, da, box), mb = moe_tma_map(in, 2, db, box);
    const int acc = mode == MOE_DW_ACCUMULATE;
    const Params p = {dev_off, G, O, I, acc, acc && moe_cuda_wgrad_prefetch() == 1};
    if (p.prefetch)
        moe_cuda_wgrad_prefetch_note();
    const int tiles = G * ((O + BM - 1) / BM) * ((I + BN - 1) / BN);
    if (mode == MOE_DW_ACT)
        launch<0>(ma, mb, moe_tma_map(dw, 3, dc, bc16), p, tiles);
    else
        launch<1>(ma, mb, moe_tma_map(dw, 3, dc, bc32, MOE_TMA_F32), p, tiles);
}
