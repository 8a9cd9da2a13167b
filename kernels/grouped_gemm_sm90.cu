/*
 * Our own grouped GEMM for Hopper (chapter 03, backend "c"): every expert's Linear in one
 * persistent kernel built on the sm_90a tensor-core path — TMA loads into swizzled shared
 * memory, wgmma (warpgroup MMA) from there, an mbarrier pipeline between them — that
 * reads the group offsets from DEVICE memory. Nothing about the ragged sizes passes
 * through the host, so the expert computation needs no host sync (chapter 06 captures
 * the MoE layer in a CUDA graph because of that).
 *
 * One kernel, three problems. Every one is C[M,N] (+)= A[M,R] · B[N,R]ᵀ per group g:
 *
 *   forward  out_g[n,O]  = in_g[n,I] · w_gᵀ     A = in_g   (R = I contiguous: "K-major")
 *                                               B = w_g[O,I] (K-major)
 *   dgrad    din_g[n,I] += dout_g[n,O] · w_g    A = dout_g (K-major)
 *                                               B = w_gᵀ: w_g is [O,I], N = I contiguous
 *                                               ("MN-major", the transposed wgmma operand)
 *   wgrad    dw_g[O,I]  += dout_gᵀ · in_g        A = dout_gᵀ, B = in_gᵀ: both MN-major, and
 *                                               the reduction runs over the group's rows
 *
 * bf16 wgmma reads either major from shared memory (the descriptor describes the layout,
 * one instruction bit says which), so no operand is ever transposed in memory.
 *
 * The CTA (288 threads, one CTA per SM, as many CTAs as SMs), tiles of 128 × 256:
 *
 *   warps 0-3,   two consumer warpgroups, each owning 64 of the tile's BM = 128 rows and
 *   warps 4-7    all BN = 256 columns (128 fp32 accumulators per thread). Per k-step:
 *                wait for the stage's "full" barrier, issue 4 wgmma m64n256k16, commit,
 *                and once the PREVIOUS k-step's wgmma are done, release that stage
 *                ("empty") to the producer — one group of MMAs always in flight.
 *   warp 8       producer: one thread walks the same tiles and issues the TMA loads of
 *                each k-step into the next free stage of a STAGES-deep ring, arming the
 *                stage's "full" barrier with the byte count to expect.
 *
 * Narrow tiles, 128 × 192 (the default where they apply; MOE_GROUPED_NARROW=0 turns them
 * off): N columns in tiles of 256 waste ceil(N/256)·256 − N of them, and at N = 384 — the
 * GPU preset's hidden size, the N of fc2's forward, fc1's dgrad and (as dw's columns) fc1's
 * wgrad — that is a third of the MMA work: a full tile and a half-empty one. Tiles of 192
 * columns cover 384 exactly, so the host (which knows N) picks them wherever they pad less
 * (tile_width). Each warpgroup then issues m64n192k16 (96 accumulators a thread) on a B
 * block of 192 rows (K-major: one TMA box of 192 rows; MN-major: three 64-column boxes);
 * the stage keeps its layout, 8 KB of it unused. They are their own instantiation (WN),
 * under the static and dynamic schedules only: the 64-row, sharing and gathering tiles
 * are written for 256 columns.
 *
 * Forward and dgrad can also use a 64 × 256 tile (an experiment, off by default: it measured
 * slower, see g_schedule), for the last <= 64 rows of a group: the two
 * warpgroups then sit side by side instead of one above the other — both read the same
 * 64-row A box, warpgroup c multiplies it by B's columns 128c .. 128c + 127 with 4 wgmma
 * m64n128k16 per k-step (64 accumulators) — so neither idles, and the producer loads one
 * 64-row A box instead of two (40 KB per stage instead of 48). Why: a group of 130 rows
 * would otherwise cost two full 128-row tiles, 256 rows of MMA for 130 rows of output
 * (the tile-quantisation cliff just past every multiple of 128, which hurts where many
 * experts see a few hundred rows each); with it, 128 + 64 rows of MMA (rows are computed
 * in multiples of 64, the smallest M of a wgmma) — but each tile still loads the whole
 * 256-column weight block per k-step, and the time did not fall (the tail tile of the
 * 128-row schedule skips its empty A box too, so both move the same 40 KB per k-step;
 * docs/results/03-grouped-gemm-ii.md §3b). The main loop is instantiated once per
 * width (256 or 128 columns per warpgroup) so that no wgmma pipeline spans a branch.
 *
 * So the share192 schedules let a group's tail rows SHARE the weight block instead: a
 * group of 128·q + t rows (q >= 1, 1 <= t <= 64) computes its last 128 + t rows in tiles
 * of 192 rows × SBN = 128 columns (lib/moe/tile_schedule.h, moe_tile_share_rule). A stage
 * holds 3 A boxes of 64 rows (24 KB) and the 128 weight columns (16 KB); warpgroup c
 * multiplies its 64 full rows by all 128 columns (m64n128) and the tail rows (A's third
 * box) by columns 64c .. 64c + 63 (m64n64): 96 accumulators. Per 256 columns and k-step
 * two such tiles move 80 KB instead of the 88 KB of a full and a tail tile, and compute
 * 192 instead of 256 rows of MMA. Measured on an H100 (docs/results/03-grouped-gemm-ii.md
 * §3c) it does not remove the cliff: the MMA work falls, but under the static schedule
 * the CTAs holding the cheaper sharing tiles run ahead and the weights are read from DRAM
 * again, and the dynamic schedule's own cost above 128 rows eats the rest; so it is a
 * flag, off by default. The sharing tiles are their own kernel instantiation (SHARE): the
 * other schedules' kernels compile exactly as without them (with both in one function,
 * ptxas serialised the forward's wgmma for want of registers).
 *
 * The swaptail schedules (off by default: correct on an H100, but 0.95-0.98x the static
 * schedule at 129-260 rows per expert, docs/results/03-grouped-gemm-ii.md §3e) compute a group's last t = 1 .. 64 rows TRANSPOSED, outᵀ = W · Xᵀ: both the 64-row and the
 * sharing tile still pay for rows in multiples of 64 because wgmma's M is 64, but its N
 * runs from 8 to 256 in steps of 8. So the weight block becomes wgmma's A (warpgroup c
 * takes features 128c .. 128c + 127 as two A blocks of 64: the very 8 KB pieces the plain
 * tile reads as B, K-major for forward, MN-major boxes for dgrad, so the same TMA loads
 * serve) and the tail's token rows, A's first 64-row box, become wgmma's B (K-major for
 * both forward and dgrad) with N = 16, 32 or 64, t rounded up (moe_tile_swap_rule: chosen
 * per tile on the device from the offsets). A 1-row tail then costs 16 columns of MMA per
 * 64 features instead of 64 or 128 rows. The tile keeps its slot in the schedule and its
 * loads (the producer already skips A's empty second box), so only the consumers change:
 * their own 2 × N/2 accumulators (in d[], at any offsets, ptxas serialised the wgmma of
 * the whole kernel) and a transposed epilogue (sm90_epilogue.cuh, epilogue_transposed:
 * through shared memory, then 16-byte row stores masked to the t rows). Their own
 * instantiation (SWAP), forward and dgrad, not with the gather or the scatter.
 *
 * The static-mc2 schedule (MOE_GROUPED_SCHEDULE=static-mc2, off by default; STATUS: passed
 * test_gpu_grouped_mc2 on an H100 at 59083b0, and measured there: 0.98-0.99x the static
 * schedule at 128, 129, 256 and 512 rows per expert, 0.92x at 257, so it does NOT remove the
 * cliff, docs/results/03-grouped-gemm-ii.md §3f) was built to attack the weight traffic behind the 256 → 257-row cliff
 * (docs/results/03-grouped-gemm-ii.md §3e): every further m-tile of a group re-reads its
 * weight block (2 MB per 128 × 256 tile at K = 4096) unless L2 still holds it. The kernel
 * (its own instantiation, MC) is launched in CTA clusters of two along x; cluster c walks
 * PAIR SLOTS c, c + gridDim / 2, ... (moe_tile_pair_at_rule, prefix-summed on the device
 * from the offsets like the m-tiles, so still sync-free): in a multicast slot its CTAs take
 * m-tiles 2i and 2i + 1 of one (group, n-tile), and each loads HALF of every weight k-block
 * (forward: 128 K-major rows through map_bs; dgrad: two of the four MN-major boxes) with
 * .multicast::cluster into both CTAs' shared memory, so the block is read once per pair;
 * each CTA's full barrier expects its own A boxes and the WHOLE B block (half of its bytes
 * come from the partner's TMA). The odd m-tile of a group is not paired with an idle
 * partner (257 rows would cost 4 tile slots per n-tile instead of 3) but with itself under
 * the next n-tile (a solo slot: each CTA loads its own weights); only an odd number of
 * n-tiles leaves the second CTA of a group's last solo slot without a tile, and that CTA
 * still turns the stages (its producer arrives on full with no bytes, its consumers wait
 * and release) so that both CTAs' pipelines stay in step: both walk the same slots with
 * the same ceil(K / 64) k-steps each, so stage it % STAGES is the same stage in both. A
 * stage is overwritten by both producers, so the empty barriers count 16 arrivals — every
 * consumer warp of BOTH CTAs arrives on both (mapa + mbarrier.arrive.shared::cluster), as
 * in CUTLASS's and DeepGEMM's multicast pipelines. All threads meet in a cluster barrier
 * after the barrier initialisation (the partner's barriers exist before a multicast) and
 * before exiting (no CTA leaves while its partner may still write its shared memory).
 * Forward and dgrad, contiguous input, 256-column tiles (with a gathered input, a scatter
 * or narrow tiles the plain kernels run); tests/gpu_grouped.c test_gpu_grouped_mc2.
 *
 * Epilogue: each consumer warpgroup writes its 64 × 256 block from registers into its
 * own 16 KB shared-memory staging buffer, a piece at a time (in the swizzled layout of a
 * TMA box), and one thread hands each piece to TMA: a store for forward (and for dgrad
 * into a fresh buffer), a reduce-add (the accumulate done in L2) for an accumulating dgrad
 * and for wgrad's accumulated fp32 weight gradients. The warpgroup goes straight on to its next
 * tile's main loop while the last copy-out runs; a piece waits only until TMA has read
 * the previous one out of the buffer. Small staging buffers buy a 4th pipeline stage
 * (4 × 48 KB + 2 × 16 KB = 224 KB of the SM's 227 KB). Measured on an H200 (see
 * docs/results/03-grouped-gemm.md): storing straight from registers cost 15-35% of the
 * GEMM time; the 4th stage is worth another 6-10%.
 *
 * The tile scheduler is persistent and, by default, static: CTA b takes tiles b,
 * b + gridDim, ... (the dynamic schedule claims them in order instead: see the kernel's
 * tile ring). Within a group the tiles go in bands of BAND m-tiles, m fastest inside a band, so the
 * CTAs running at the same time touch a few row blocks and a few weight blocks, which
 * stay in L2. For forward and dgrad a group has ceil(rows_g / BM) m-tiles; each CTA reads
 * the G + 1 offsets into shared memory and prefix-sums the m-tiles (G is small), which
 * maps a tile index to its group by binary search — the host never learns the sizes (the
 * rule is lib/moe/tile_schedule.h, one definition for this kernel and the C library). The
 * tile's shape can come from the same offsets (moe_tile_rows_rule): under the -tail64
 * schedules the group's last m-tile is a 64 × 256 tile when it holds <= 64 rows (off by
 * default: measured slower, see g_schedule). The 64-row tile stays in its
 * group's band, next to the tiles that read the same weight block: ordering tiles
 * longest-first instead would balance the last wave a little better but read a weight
 * block again after it has left L2, and a tile costs at most twice another here. For wgrad the tiles
 * are the fixed G × (O/BM) × (I/BN) blocks of dw and the k-loop length is the group's row
 * count.
 *
 * The wgrad wall. wgrad's FLOPs per byte of C are only 2·rows_g / 4 (fp32): with a few
 * hundred rows per group it is bound by moving dw, not by the tensor cores, and a
 * reduce-add moves it twice (L2 reads the old value from HBM, then writes the sum). So the
 * weight gradient leaves in one of three modes (moe_dw_mode, chosen by the caller):
 *   ACCUMULATE  fp32 reduce-add, dw += (later micro-batches of a step);
 *   STORE       fp32 store, dw = (the first micro-batch: the buffer holds zeros, so there
 *               is nothing to read); an empty group's tiles still run and store zeros;
 *   ACT         bf16 store (half the bytes again), what torch._grouped_mm writes.
 * Split-K: when the G · (O/BM) · (I/BN) tiles of dw cannot fill the SMs and the groups
 * are long (rows/G ≥ MIN_CHUNK_KSTEPS·BK per chunk), each group's k-loop is cut into S
 * chunks (S from host-known sizes only: the tile count, the SM count and the total rows;
 * each chunk's k-range is computed on the device from the offsets). The chunks do not
 * reduce-add into dw — a STORE or bf16 chunk would race with the others, and the order
 * of the adds would change the bits from run to run — but each STOREs its partial into an
 * fp32 workspace [S][G][O][I], and one small kernel sums the S partials in order into dw
 * in the caller's mode. The workspace is small exactly when splitting pays (few tiles).
 * The reduce-add's read of the old dw can also move off the epilogue's critical path
 * (MOE_WGRAD_PREFETCH=1, moe_cuda_wgrad_set_prefetch): the producer asks L2 for the tile's dw
 * (cp.async.bulk.prefetch.tensor, sm90_epilogue.cuh's prefetch_dw_tile) WGRAD_PREFETCH_LEAD
 * k-steps before its last load, so HBM reads dw while the tensor cores run the main loop,
 * instead of every CTA's epilogue waiting for it at once; =2: the consumers issue
 * prefetch.global.L2 for its lines at the tile's start (prefetch_dw_lines). It changes no bit
 * of the result. STATUS: both passed test_gpu_grouped_wgrad_prefetch on an H100 (6fe39a1,
 * 53dcef4) and both made the adding wgrad SLOWER there, 0.82x and 0.76x at 512 rows per
 * expert: the adding and storing wgrads both move about 2 TB/s, so the read does not wait on
 * latency, it adds bytes (docs/results/03-grouped-gemm-ii.md §3g). Off by default.
 * Ping-pong (MOE_GROUPED_WGRAD_PINGPONG=1, off by default; measured 0.81-1.01x this kernel at
 * 512 rows per expert on an H100, §3g): where the
 * wgrad runs in one chunk on a contiguous input, kernels/grouped_wgrad_pingpong_sm90.cu can
 * run it instead — each consumer warpgroup a whole 128 × 128 tile, the two taking turns in
 * the main loop, so that one's epilogue overlaps the other's MMAs (sm90_backward).
 * The RMW epilogue (MOE_WGRAD_EPI=rmw|auto, moe_cuda_wgrad_set_epilogue; Params.rmw): an
 * adding tile of at most Params.rmw k-steps reads its old dw, adds its sums and writes them
 * from registers (epilogue_regs, sm90_epilogue.cuh) instead of TMA's reduce-adds, which move
 * dw at about 2.0 TB/s where plain reads and writes reach 2.8 on an H100. The FP8 wgrad
 * gained it first and it made Qwen3-235B's FP8 layer 1.07x faster (docs/results/
 * 05-fp8-nvfp4.md, "The adding wgrad by plain reads and writes"). STATUS here: passed the
 * GPU suite on an H100 (test_gpu_grouped_wgrad_epilogue, and auto as the default of every
 * other grouped test, 173/173); its speed is not measured yet, so TMA stays the default.
 *
 * Ragged edges without padding:
 *   - rows of a forward/dgrad tile past the group's end are loaded (they belong to the
 *     next group, or lie past the tensor, where TMA fills zeros) and not stored: a
 *     warpgroup whose 64 rows cross the group's end writes directly with a row mask
 *     instead of through TMA (a box cannot skip rows); A is loaded in 64-row boxes, and
 *     a box in which the group has no rows is not loaded at all;
 *   - in wgrad the last k-step of a group reads rows of the next group: the consumers
 *     zero those rows of their A tile in shared memory before the wgmma (a row of an
 *     MN-major swizzled tile is one whole 128-byte line, so this ignores the swizzle);
 *   - weights are read through a 3-D tensor map [G, O, I], so a tile running past O or I
 *     gets TMA's zero fill instead of the next expert's weights.
 *
 * Shared-memory layouts (128-byte swizzle, BK = 64 bf16 = 128 bytes):
 *   K-major tile  [rows][64 k]: TMA boxes of {64, rows} (A: 64 rows each, stacked, 8 KB
 *                 apart; B: one box of 256 rows, its rows 128.. 16 KB on); 8-row groups
 *                 of 1024 bytes (descriptor SBO = 1024); the k16 steps advance the start
 *                 by 32 bytes.
 *   MN-major tile [64 k][64 mn] boxes of 8 KB, side by side along MN (LBO = 8192, the
 *                 next 64 MN-elements; SBO = 1024, the next 8 k-rows); the k16 steps
 *                 advance the start by 16 rows = 2048 bytes.
 *
 * The accumulator of m64nNk16 (fp32): thread t of the warpgroup (warp w = t/32, lane l)
 * holds, for each 8-column block j, d[4j+0..1] at row 16w + l/4, columns 8j + 2(l%4) + 0..1,
 * and d[4j+2..3] at the row 8 below.
 *
 * sm_100a has no wgmma: this file builds there (the kernel body compiles to a trap) and
 * moe_cuda_grouped_sm90_available() says no, so the layer uses the cuBLAS grouped backend.
 */
#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "cuda_common.cuh"
#include "cuda_ops.h"
#include "moe/tile_schedule.h"
#include "sm90_epilogue.cuh"
#include "sm90_ptx.cuh"
#include "wgmma.cuh"

namespace {

constexpr int BM = 128;      /* rows of a tile: 2 consumer warpgroups × 64 */
constexpr int BN = 256;      /* columns of a tile: one m64n256k16 wgmma per warpgroup */
constexpr int BK = 64;       /* k per pipeline stage: one 128-byte swizzle row of bf16 */
constexpr int STAGES = 4;    /* pipeline depth */
constexpr int MAX_G = MOE_GROUPED_DEV_MAX_GROUPS; /* shared-memory offset table */
constexpr int THREADS = 288; /* 2 consumer warpgroups (warps 0-7) + 1 producer warp */
constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int C_BYTES = 16384; /* one warpgroup's output staging: a piece of its block */
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 2 * C_BYTES; /* 224 KB of the SM's 227 */
constexpr int MAX_SPLIT = 8;        /* wgrad split-K: most chunks per group */
constexpr int MIN_CHUNK_KSTEPS = 4; /* ... and the fewest k-steps a chunk gets on average */

enum Mode { FWD = 0, DGRAD = 1, WGRAD = 2 };

/* Columns of a tail-sharing tile (192 rows, see Scheduler). A consumer thread holds
 * 0.75·SBN of its accumulators (64 rows × SBN, and the 64 tail rows × SBN / 2), so up to
 * 170 would fit where a 128 × 256 tile's 128 do; dgrad's MN-major B can only be split on
 * its 64-column boxes, so 128 there. 128 for the forward too: a 160-column forward tile
 * (K-major B allows it) measured slower — the 160-column tiles leave slots without work
 * where N is a multiple of 256, and need direct stores for their last 32 columns
 * (docs/results/03-grouped-gemm-ii.md §3c). */
constexpr int SBN = BN / 2;

/* Columns of a narrow tile: 128 × 192, for N that 192 divides better than 256 (see
 * tile_width). m64n192k16 per warpgroup, 96 accumulators a thread. */
constexpr int NARROW_BN = 192;

struct Params {
    const int *off; /* [G+1] group row offsets, DEVICE memory */
    int G;
    int M;          /* wgrad: rows of dw_g (O); unused otherwise (ragged) */
    int N;          /* output columns */
    int K;          /* forward/dgrad: reduction length; unused for wgrad (ragged) */
    void *C;        /* bf16 output [rows, N], for the masked direct stores where a group
                       ends inside a warpgroup's rows (everything else leaves through map_c) */
    int accumulate; /* C += instead of C = (dgrad; wgrad: reduce-add, else store) */
    int split;      /* wgrad: chunks each group's rows are cut into (1 = none, 0 = unset) */
    int fine;       /* forward/dgrad, how a group's last <= 64 rows are computed (see
                       Scheduler): 0 = in a 128-row tile; 1 = in a 64 × 256 tile (tail64);
                       2 = with the 128 rows before them, in 192 × 128 tiles (share192);
                       3 = transposed, the rows as wgmma's N (swaptail); 4 = in
                       128-row tiles, two CTAs of a cluster sharing the weights (static-mc2,
                       the MC kernels) */
    int dyn;        /* 1: CTAs claim their tiles in index order from g_claims (forward and
                       dgrad, see the kernel's tile ring); 0: CTA b takes b, b + grid, ... */
    /* the fused permutation (GATHER kernels only): the GEMM's input row r is token row
       gmap[r] / gdiv of gx [*, gld] (forward: A; wgrad: B), copied by index with cp.async */
    const moe_bf16 *gx;
    const int *gmap;
    int gdiv, gld;
    /* the fused permutation's other half (SCATTER kernels only, forward): output row r is
       stored at row smap[r] of C (16-byte stores from the staging buffer, no TMA) */
    const int *smap;
    int prefetch; /* wgrad, reduce-add: the producer prefetches each tile's dw into L2
                     (prefetch_dw_tile, MOE_WGRAD_PREFETCH) */
    int rmw;      /* wgrad, fp32 added into C = dw: a tile of at most this many k-steps adds
                     its sums by read + add + write from registers (epilogue_regs), a longer
                     one by TMA's reduce-add (0: every tile by TMA; MOE_WGRAD_EPI) */
};

struct Tile {
    int g, m0, n0; /* group; first row (absolute row for forward/dgrad, row of dw_g for
                      wgrad); first column */
    int r0, r1;    /* the group's rows [r0, r1) */
    int nk;        /* k-steps */
    int gc;        /* wgrad: the [O, I] block of C it writes (group, or chunk · G + group) */
    int half;      /* forward/dgrad: a 64 × 256 tile, the two warpgroups side by side
                      (each 64 rows × 128 columns) instead of one above the other */
    int share;     /* forward/dgrad: a tail-sharing tile of 192 rows × SBN columns
                      (rows m0 .. r1 - 1, 129 to 192 of them; see Scheduler) */
    int swap;      /* forward/dgrad: a swapped tail tile, rows m0 .. r1 - 1 (1 to 64 of
                      them) computed transposed with this many token columns (16, 32 or
                      64); 0: not one (see Scheduler) */
    int mc;        /* the MC kernels (static-mc2): 1 = the cluster's two CTAs share this
                      tile's weight block (multicast), 0 = this CTA loads its own, -1 = no
                      tile (the CTA only keeps the cluster's pipeline in step) */
};

/* ---------------------------------------------------------------- PTX helpers
 * (the shared ones — mbarriers, TMA, wgmma fences and descriptors — are sm90_ptx.cuh; the
 * epilogue's barriers and stores are sm90_epilogue.cuh, shared with the FP8 kernel) */
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL) /* nothing for sm_100a */

/* One k-step (BK = 64) of one warpgroup: 4 wgmma m64nNWk16 on the A block at a (64 rows)
 * and the NW columns of B at b. K-major: the k16 steps advance 32 bytes within the
 * 128-byte swizzled row; MN-major: 16 k-rows = 2048 bytes, the next 64 MN-elements 8 KB on. */
template <int NW, int TA, int TB>
__device__ __forceinline__ void mma_kstep(float *d, const uint8_t *a, const uint8_t *b) {
#pragma unroll
    for (int kk = 0; kk < BK / 16; kk++) {
        const uint64_t da = TA ? desc(a + kk * 2048, 8192, 1024) : desc(a + kk * 32, 16, 1024);
        const uint64_t db = TB ? desc(b + kk * 2048, 8192, 1024) : desc(b + kk * 32, 16, 1024);
        moe_wgmma<NW, TA, TB>::mma(d, da, db, 1);
    }
}

/* One k-step of a swapped tail tile (swaptail): D[64 features][NT tokens] += W · Xᵀ, the
 * transposed product. wgmma's A is the 64 weight rows at w — the block the plain tile
 * reads as its B, so it keeps B's major TB (forward: K-major rows of w_g; dgrad: one
 * MN-major [64 k][64 features] box of w_g) — and its B is the first NT token rows of the A
 * block at x (K-major, 8-row groups 1024 bytes apart, so any N that is a multiple of 8
 * reads them the way the plain B reads its 256 rows). */
template <int NT, int TB>
__device__ __forceinline__ void mma_kstep_swap(float *d, const uint8_t *w, const uint8_t *x) {
#pragma unroll
    for (int kk = 0; kk < BK / 16; kk++) {
        const uint64_t dw = TB ? desc(w + kk * 2048, 8192, 1024) : desc(w + kk * 32, 16, 1024);
        const uint64_t dx = desc(x + kk * 32, 16, 1024);
        moe_wgmma<NT, TB, 0>::mma(d, dw, dx, 1);
    }
}
#endif

/* ---------------------------------------------------------------- the scheduler */

/* The tile index -> tile rule is lib/moe/tile_schedule.h, shared with the C library
 * (moe_tile_schedule_at, tested against a brute-force enumeration) and the chapter's
 * kernel ladder; this adds the wgrad raster and each tile's k-loop length. */
template <int MODE, int SHARE, int WN, int SWAP, int MC> struct Scheduler {
    static constexpr int BAND = 8; /* m-tiles per raster band (L2 reuse, see tile_schedule.h) */
    const int *off, *mt; /* shared: offsets [G+1], m-tile prefix [G+1] */
    int G, N, ntn, mtn, total, K, fine;
    int S; /* wgrad: chunks per group (split-K) */
    int rank; /* MC: this CTA's rank in its cluster of two */

    __device__ bool get(int t, Tile &ti) const {
        if (t >= total)
            return false;
        if (MODE == WGRAD) { /* the same banded raster over dw_g's (m, n) tiles */
            const int per = mtn * ntn, s = t / (G * per);
            int mi, ni;
            moe_tile_band_place(t % per, mtn, ntn, BAND, &mi, &ni);
            ti.g = (t / per) % G;
            ti.m0 = mi * BM;
            ti.n0 = ni * WN;
            /* split-K: chunk s of S takes k-steps [s·ck, (s+1)·ck) of the group's nkg, a
             * length read here from the device offsets (a chunk may get none) */
            const int nkg = (off[ti.g + 1] - off[ti.g] + BK - 1) / BK, ck = (nkg + S - 1) / S;
            ti.r0 = off[ti.g] + s * ck * BK;
            ti.r1 = off[ti.g + 1];
            ti.nk = max(0, min(ck, nkg - s * ck));
            ti.gc = s * G + ti.g;
            ti.half = 0;
            ti.share = 0;
            ti.swap = 0;
            return true;
        }
        moe_tile x;
        if constexpr (MC) {
            /* static-mc2: t is a pair slot (mt holds the pair-slot prefix), the cluster's
             * two CTAs take m-tiles 2i, 2i + 1 of one n-tile (multicast) or an odd group's
             * last m-tile under n-tiles 2j, 2j + 1 (solo) */
            const int kind = moe_tile_pair_at_rule(&x, t, rank, off, mt, G, ntn, BM, BN, BAND);
            ti.g = x.g;
            ti.m0 = x.m0;
            ti.n0 = x.n0;
            ti.r0 = x.r0;
            ti.r1 = x.r1;
            ti.nk = (K + BK - 1) / BK; /* the same for every slot: the CTAs stay in step */
            ti.half = ti.share = ti.swap = 0;
            ti.mc = kind == MOE_PAIR_MCAST ? 1 : kind == MOE_PAIR_SOLO ? 0 : -1;
            return true;
        }
        moe_tile_at_rule(&x, t, off, mt, G, ntn, BM, WN, BAND);
        /* share192 (the SHARE kernels): a group's last 128 + (1 .. 64) rows in 192-row
         * tiles, placed in the slots of its last two m-tiles; a slot without such a tile
         * has no work (nk = 0) */
        const int kind = SHARE ? moe_tile_share_rule(&x, BM, BN, SBN, N) : 1;
        ti.share = kind == 2;
        ti.g = x.g;
        ti.m0 = x.m0;
        ti.n0 = x.n0;
        ti.r0 = x.r0;
        ti.r1 = x.r1;
        ti.nk = kind ? (K + BK - 1) / BK : 0;
        /* the tile shape, from the offsets alone: under tail64 a group's last m-tile that
         * holds at most 64 of its rows is a 64 × 256 tile (half the MMA work and 40 of the
         * 48 KB per k-step), so rows are computed in multiples of 64, not of 128 */
        ti.half = moe_tile_rows_rule(&x, BM, fine == 1) == BM / 2;
        /* swaptail (the SWAP kernels): a tile holding a group's last 1 .. 64 rows is
         * computed transposed, the rows as wgmma's N (16, 32 or 64 of them), so a 1-row
         * tail costs 16 columns of MMA instead of 64 or 128 rows; same slot, same loads */
        ti.swap = SWAP && fine == 3 ? moe_tile_swap_rule(&x, BM) : 0;
        return true;
    }
};

/* ---------------------------------------------------------------- the kernel */

/* ---------------------------------------------------------------- the fused gather
 * GATHER: the forward's A (wgrad's B) is the token rows picked by the permutation's index,
 * not a contiguous permuted copy. The producer warp's 32 lanes copy them with cp.async
 * into exactly the swizzled layout TMA would have written, then each lane arrives on the
 * stage's full barrier with cp.async.mbarrier.arrive.noinc (the barrier expects 1 + 32
 * arrivals: lane 0's expect_tx for the TMA operand, and the 32 lanes'), so the consumers'
 * wait is the one they already do. cp.async writes shared memory through the generic
 * proxy and wgmma reads it through the async proxy: after the wait each consumer thread
 * issues fence.proxy.async (the producer cannot: it does not wait for its copies). */

#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL) /* nothing for sm_100a */
/* forward, A [128 rows][64 k] K-major: lane l holds the source token of rows l + 32j
 * (tok[j], -1 past the group's end: those rows are zero-filled and never stored) */
__device__ __forceinline__ void gather_tokens(int tok[4], const Params &p, int first, int end,
                                              int lane, int n) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int r = first + lane + 32 * j;
        tok[j] = j < n && r < end ? p.gmap[r] / p.gdiv : -1;
    }
}

/* ... and k-step k0 of it: pass i copies rows 4i .. 4i + 3, lane l the 16-byte chunk l % 8
 * of row 4i + l / 8 (a row is 64 bf16 = 8 chunks; 4 rows = 512 bytes per pass) */
__device__ __forceinline__ void gather_a_kmajor(uint8_t *a, const int tok[4], const Params &p,
                                                int k0, int lane) {
    const int chunk = lane % 8, kk = k0 + 8 * chunk;
    const bool kin = kk < p.K; /* K is a multiple of 8: a chunk is wholly in or out */
#pragma unroll
    for (int i = 0; i < BM / 4; i++) {
        const int t = __shfl_sync(0xffffffffu, tok[i / 8], 4 * (i % 8) + lane / 8);
        const bool ok = kin && t >= 0;
        cp_async16(a + moe_swizzle128(4 * i + lane / 8, chunk),
                   ok ? p.gx + (size_t)t * p.gld + kk : p.gx, ok ? 16 : 0);
    }
}

/* wgrad, B [64 k][256 n] MN-major (4 boxes of [64 k][64 n], 8 KB apart): a k-row is one
 * token row, so lane l copies chunk l % 8 of box l / 8 of every k-row (512 contiguous
 * bytes of the token per row), its token broadcast from the lane that read it */
__device__ __forceinline__ void gather_b_mnmajor(uint8_t *b, const int tok[4], const Params &p,
                                                 int n0, int lane) {
    const int box = lane / 8, chunk = lane % 8, n = n0 + 64 * box + 8 * chunk;
    const bool nin = n < p.N; /* N is a multiple of 8 */
#pragma unroll 16
    for (int kr = 0; kr < BK; kr++) { /* (a select, not tok[kr / 32]: no local memory) */
        const int t = __shfl_sync(0xffffffffu, kr < 32 ? tok[0] : tok[1], kr % 32);
        const bool ok = nin && t >= 0;
        cp_async16(b + box * 8192 + moe_swizzle128(kr, chunk),
                   ok ? p.gx + (size_t)t * p.gld + n : p.gx, ok ? 16 : 0);
    }
}

#endif

/* The dynamic schedule's counters (Params::dyn): g_claims[0] counts the tiles claimed after
 * the first wave (CTA b runs tile b first, then gridDim.x + atomicAdd(&g_claims[0], 1), ...
 * until an index is past the last tile), g_claims[1] the CTAs that have made their last
 * claim. The last CTA to finish puts both back to 0, so every launch finds them zero
 * without a memset; the backend runs on one stream, so no two launches overlap. */
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL) /* nothing for sm_100a */
__device__ int g_claims[2];
#endif

/* C32: the output C is fp32 (wgrad's main gradients or split-K partials); else bf16.
 * GATHER: the fused permutation (above); forward and wgrad only. SCATTER: its other half,
 * forward only (bf16, no sharing tiles): every output row goes to row p.smap[row] of C
 * (epilogue_scatter). map_bs: the forward's weights in boxes of SBN = 128 rows (a sharing
 * tile's; map_b's box is 256). */
template <int MODE, int C32, int GATHER, int SHARE, int WN, int SCATTER, int SWAP, int MC>
__global__ void __launch_bounds__(THREADS, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                        const __grid_constant__ CUtensorMap map_b,
                        const __grid_constant__ CUtensorMap map_bs,
                        const __grid_constant__ CUtensorMap map_c, const Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int TA = MODE == WGRAD, TB = MODE != FWD; /* MN-major operands */
    /* WN: the tile's columns, BN or NARROW_BN (then no 64-row, sharing or gathering tiles:
     * the host picks it only for the plain schedules). The stage keeps its 48 KB layout;
     * a narrow tile's B fills 24 of its 32 KB. */
    static_assert(WN == BN || (WN == NARROW_BN && !SHARE && !GATHER), "tile width");
    static_assert(!SCATTER || (MODE == FWD && !C32 && !SHARE), "the scatter epilogue");
    static_assert(!SWAP || (MODE != WGRAD && !C32 && !GATHER && !SHARE && WN == BN && !SCATTER),
                  "swapped tail tiles: forward and dgrad, bf16, plain 256-column kernels");
    static_assert(!MC || (MODE != WGRAD && !C32 && !GATHER && !SHARE && WN == BN && !SCATTER &&
                          !SWAP),
                  "static-mc2: forward and dgrad, bf16, plain 256-column kernels");
    constexpr int WB_BYTES = WN * BK * 2, WSTAGE_TX = A_BYTES + WB_BYTES;
    constexpr int RING = 4; /* tile indices the producer may publish ahead of the consumers */

    /* 128-byte swizzled tiles must start on a 1024-byte boundary */
    extern __shared__ __align__(1024) uint8_t smem[];
    if (threadIdx.x == 0 && (smem_u32(smem) & 1023))
        __trap(); /* the layout below would overflow the allocation */
    __shared__ uint64_t full[STAGES], empty[STAGES];
    __shared__ uint64_t tfull[RING], tempty[RING]; /* the tile ring (below) */
    __shared__ int s_tile[RING];
    __shared__ int s_off[MAX_G + 1], s_mt[MAX_G + 1];

    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128; /* wg 2 = the producer warp */
    for (int g = threadIdx.x; g <= p.G; g += THREADS)
        s_off[g] = p.off[g];
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            /* the producer's expect_tx arrival (+ the bytes), and with GATHER the 32
             * lanes' cp.async arrivals (noinc: they count against this number) */
            mbar_init(&full[s], GATHER ? 1 + 32 : 1);
            /* one arrival per consumer warp; MC: of both CTAs of the cluster (the partner's
             * multicast writes this stage of our shared memory too) */
            mbar_init(&empty[s], MC ? 16 : 8);
        }
        for (int r = 0; r < RING; r++) {
            mbar_init(&tfull[r], 1);  /* the producer wrote s_tile[r] */
            mbar_init(&tempty[r], 8); /* every consumer warp has read it */
        }
        mbar_init_fence();
    }
    __syncthreads();
    if constexpr (MC)
        cluster_sync(); /* the partner's barriers exist before we multicast or arrive */
    if (threadIdx.x == 0) { /* m-tile prefix over the groups (forward/dgrad) */
        if constexpr (MC) /* ... MC: the pair-slot prefix */
            moe_tile_pair_prefix_rule(s_mt, s_off, p.G, BM, (p.N + BN - 1) / BN);
        else
            moe_tile_prefix_rule(s_mt, s_off, p.G, BM);
    }
    __syncthreads();

    Scheduler<MODE, SHARE, WN, SWAP, MC> sch;
    sch.off = s_off;
    sch.mt = s_mt;
    sch.G = p.G;
    sch.K = p.K;
    sch.fine = p.fine;
    sch.N = p.N;
    sch.ntn = (p.N + WN - 1) / WN;
    sch.mtn = (p.M + BM - 1) / BM;
    sch.S = p.split > 1 ? p.split : 1;
    sch.total = MODE == WGRAD ? sch.S * p.G * sch.mtn * sch.ntn : s_mt[p.G] * sch.ntn;
    /* MC: the cluster (CTAs 2c, 2c + 1) takes pair slots c, c + gridDim / 2, ... (the
     * slot walks below divide blockIdx.x and gridDim.x by CL) */
    constexpr int CL = MC ? 2 : 1;
    if constexpr (MC) {
        sch.rank = (int)cluster_ctarank();
        sch.total = s_mt[p.G];
    }

    /* Which tiles a CTA runs. Static (dyn = 0): CTA b takes b, b + gridDim, ..., a fixed
     * sequence the producer and the consumers each walk. Dynamic (dyn = 1, forward and
     * dgrad): after its first tile b, the producer claims the next unclaimed index from a
     * counter in global memory when it starts a tile, so tiles start in index order across
     * the whole grid whatever each costs, and publishes it to the consumers through the
     * tile ring: s_tile[j % RING] holds the CTA's j-th tile (tfull: written, tempty: read
     * by all 8 consumer warps), the last one past the end (the signal to stop). That matters for the L2: the tiles
     * that read the same weight block (a group's m-tiles of one n-tile, neighbours in the
     * banded order) then run at the same time and fetch it from HBM once. Under the static
     * rule they do so only while every tile costs the same: with 64-row tiles among
     * 128-row ones a CTA's tiles can all be of one kind (130 rows per expert: tiles
     * alternate 128, 64, and CTA b gets the parity of b), the CTAs drift apart, and each
     * weight block is fetched twice. */
    if (wg == 2) {
        /* ------------------------------------------------ producer
         * Lane 0 issues the TMA loads and runs the tile ring; with GATHER all 32 lanes also
         * copy the gathered operand (forward: A, wgrad: B) by index, and every lane waits
         * for the free stage. */
        const int lane = tid;
        if (GATHER || lane == 0) {
            int it = 0;
            Tile ti;
            int tok[4];
            int t = blockIdx.x / CL;
            for (int j = 0;; j++) {
                if (p.dyn && lane == 0) {
                    const int r = j % RING;
                    mbar_wait(&tempty[r], ((j / RING) & 1) ^ 1);
                    s_tile[r] = t;
                    mbar_arrive(&tfull[r]); /* release: the consumers see s_tile[r] */
                }
                if (!sch.get(t, ti))
                    break;
                /* claim the next tile now; its index is needed only after this tile's loads */
                int next = t + gridDim.x / CL;
                if (p.dyn) {
                    if (lane == 0)
                        next = gridDim.x + atomicAdd(&g_claims[0], 1);
                    if (GATHER)
                        next = __shfl_sync(0xffffffffu, next, 0);
                }
                if (GATHER && MODE == FWD) /* the tile's 128 source rows, once per tile */
                    gather_tokens(tok, p, ti.m0, ti.r1, lane, 4);
                for (int kt = 0; kt < ti.nk; kt++, it++) {
                    const int s = it % STAGES, phase = (it / STAGES) & 1;
                    const int k0 = kt * BK;
                    if (MODE == WGRAD && C32 && p.prefetch == 1 && lane == 0 &&
                        kt == (ti.nk > WGRAD_PREFETCH_LEAD ? ti.nk - WGRAD_PREFETCH_LEAD : 0))
                        prefetch_dw_tile<BM>(&map_c, ti.n0, ti.m0, ti.gc, WN, p.N);
                    if (GATHER && MODE == WGRAD) /* this k-step's 64 source rows */
                        gather_tokens(tok, p, ti.r0 + k0, ti.r1, lane, 2);
                    mbar_wait(&empty[s], phase ^ 1);
                    uint8_t *a = smem + s * STAGE_BYTES, *b = a + A_BYTES;
                    if constexpr (MC) {
                        if (ti.mc < 0) { /* no tile: the stage's phase turns with no bytes */
                            mbar_arrive(&full[s]);
                            continue;
                        }
                    }
                    if (SHARE && ti.share) {
                        /* a sharing tile: A = 3 boxes of 64 rows (24 KB; the third holds
                         * the group's 1 .. 64 last rows), then its 128 weight columns
                         * (16 KB), in the same 48 KB stage */
                        constexpr int SA = 3 * (A_BYTES / 2), SB = SBN * BK * 2;
                        b = a + SA;
                        if (lane == 0) {
                            mbar_expect_tx(&full[s], SA + SB);
                            for (int i = 0; i < 3; i++)
                                tma_load_2d(a + i * (A_BYTES / 2), &map_a, &full[s], k0,
                                            ti.m0 + 64 * i);
                            if (MODE == FWD) /* K-major: one box of 128 weight rows */
                                tma_load_3d(b, &map_bs, &full[s], k0, ti.n0, ti.g);
                            else /* MN-major: [64 k][64 n] boxes */
                                for (int i = 0; i < SBN / 64; i++)
                                    tma_load_3d(b + i * 8192, &map_b, &full[s], ti.n0 + 64 * i,
                                                k0, ti.g);
                        }
                        continue;
                    }
                    /* forward/dgrad: the second 64-row A box only where the group has rows
                     * in it (never in a 64-row tile; never a box wholly past the tensor) */
                    const int a2 = MODE == WGRAD || ti.r1 - ti.m0 > BM / 2;
                    if (lane == 0) {
                        /* the bytes TMA brings: with GATHER only the other operand's */
                        mbar_expect_tx(&full[s], GATHER ? (MODE == WGRAD ? A_BYTES : WB_BYTES)
                                                 : a2   ? WSTAGE_TX
                                                        : WSTAGE_TX - A_BYTES / 2);
                        if (MODE == WGRAD) { /* both MN-major: 64×64 boxes along M and N */
                            for (int i = 0; i < BM / 64; i++)
                                tma_load_2d(a + i * 8192, &map_a, &full[s], ti.m0 + 64 * i,
                                            ti.r0 + k0);
                            for (int i = 0; !GATHER && i < WN / 64; i++)
                                tma_load_2d(b + i * 8192, &map_b, &full[s], ti.n0 + 64 * i,
                                            ti.r0 + k0);
                        } else { /* A: K-major boxes of 64 rows × 64 k, the second 8 KB on */
                            if (!GATHER) {
                                tma_load_2d(a, &map_a, &full[s], k0, ti.m0);
                                if (a2)
                                    tma_load_2d(a + A_BYTES / 2, &map_a, &full[s], k0,
                                                ti.m0 + BM / 2);
                            }
                            if (MC && ti.mc > 0) {
                                /* the pair's weight block: this CTA loads half of it (K-major:
                                 * 128 rows, map_bs; MN-major: boxes 2·rank, 2·rank + 1) into
                                 * both CTAs, and its full barrier counts the partner's half
                                 * too (the expect_tx above is the whole block) */
                                if (MODE == FWD)
                                    tma_load_3d_mc(b + sch.rank * (B_BYTES / 2), &map_bs,
                                                   &full[s], k0, ti.n0 + sch.rank * (BN / 2),
                                                   ti.g, 3);
                                else
                                    for (int i = 2 * sch.rank; i < 2 * sch.rank + 2; i++)
                                        tma_load_3d_mc(b + i * 8192, &map_b, &full[s],
                                                       ti.n0 + 64 * i, k0, ti.g, 3);
                            } else if (MODE == FWD) /* one box of WN weight rows */
                                tma_load_3d(b, &map_b, &full[s], k0, ti.n0, ti.g);
                            else
                                for (int i = 0; i < WN / 64; i++)
                                    tma_load_3d(b + i * 8192, &map_b, &full[s], ti.n0 + 64 * i,
                                                k0, ti.g);
                        }
                    }
                    if (GATHER) {
                        if (MODE == FWD) /* all 128 rows: those past the group are zeros */
                            gather_a_kmajor(a, tok, p, k0, lane);
                        else
                            gather_b_mnmajor(b, tok, p, ti.n0, lane);
                        cp_async_mbar_arrive_noinc(&full[s]);
                    }
                }
                t = next;
            }
            if (GATHER)
                cp_async_wait_all(); /* no copy outlives its thread */
            if (p.dyn && lane == 0) {
                /* this CTA's claims are over; the last CTA to get here resets the counters */
                __threadfence();
                if (atomicAdd(&g_claims[1], 1) == (int)gridDim.x - 1) {
                    atomicExch(&g_claims[0], 0);
                    atomicExch(&g_claims[1], 0);
                }
            }
        }
        if constexpr (MC)
            cluster_sync(); /* (with the consumers: see the kernel's end) */
        return;
    }

    /* ---------------------------------------------------- consumers */
    const int c = wg, lane = tid % 32;
    uint8_t *cs = smem + STAGES * STAGE_BYTES + c * C_BYTES; /* this warpgroup's C staging */
    int it = 0;
    Tile ti;
    /* accumulators: 64 × 256 (128 per thread); a sharing tile's 64 × SBN and 64 × SBN / 2
     * (96) fit in them. (More than 128 do not fit: each of 288 threads gets at most 168
     * registers, three warps of 32 sharing an SM sub-partition's 16K.) */
    constexpr int ND = WN / 2;
    float d[ND];
    /* a consumer warp frees a stage: MC, in both CTAs of the cluster (each CTA's producer
     * overwrites the stage in both) */
    auto release = [&](uint64_t *bar) {
        if constexpr (MC) {
            mbar_arrive_cluster(bar, 0);
            mbar_arrive_cluster(bar, 1);
        } else {
            mbar_arrive(bar);
        }
    };
    for (int j = 0, t = blockIdx.x / CL;; j++, t += gridDim.x / CL) {
        if (p.dyn) { /* the producer's claim; static: b, b + gridDim, ... as it walks them */
            const int r = j % RING;
            mbar_wait(&tfull[r], (j / RING) & 1);
            t = s_tile[r];
            __syncwarp();
            if (lane == 0) /* every lane of this warp has read it */
                mbar_arrive(&tempty[r]);
        }
        if (!sch.get(t, ti))
            break;
        if (ti.nk == 0 && (MODE != WGRAD || p.accumulate))
            continue; /* wgrad of an empty group (or chunk) adds nothing; a STORE writes 0 */
        if (MODE == WGRAD && C32 && p.prefetch == 2) /* (p.C is dw then: see the host) */
            prefetch_dw_lines<BM, WN>((const float *)p.C, ti.gc, ti.m0, ti.n0, p.M, p.N,
                                      c * 128 + tid, 256);
        const int half = MODE != WGRAD && ti.half;   /* a 64 × 256 tile (see Scheduler) */
        const int share = SHARE && ti.share; /* a 192-row sharing tile (see Scheduler) */
        /* A sharing tile: warpgroup c computes rows 64c .. 64c + 63 (full rows of the group)
         * × all SBN columns, and the tail rows 128 .. (1 to 64 of them, A's third box) ×
         * columns c·SBN/2 .. — 8 KB into B either way (forward: K-major B, its row 64c;
         * dgrad: MN-major B, its box c) */
        const int tail_col = c * (SBN / 2), tail_b = c * 8192;
        /* the main loop, one instantiation per warpgroup width (256, 128, or SBN + a tail
         * of SBN / 2), so that no wgmma pipeline spans a branch (ptxas would serialise the
         * MMAs) */
        auto mainloop = [&](float *acc, float *acc2, auto nw, auto tw, auto sw) {
            constexpr int NW = decltype(nw)::value, TW = decltype(tw)::value;
            constexpr int SW = decltype(sw)::value; /* a swapped tile's token columns */
            for (int kt = 0; kt < ti.nk; kt++, it++) {
                const int s = it % STAGES, phase = (it / STAGES) & 1;
                mbar_wait(&full[s], phase);
                if (GATHER) /* the producer's cp.async wrote through the generic proxy */
                    fence_proxy_async();
                /* a 128-row tile: warpgroup c takes A rows 64c.. and all of B; a 64-row tile:
                 * both take A rows 0-63, and warpgroup c the B columns 128c.. (K-major: B rows
                 * 128c.., 16 KB on; MN-major: the boxes 2c and 2c + 1, 16 KB on) */
                uint8_t *a = smem + s * STAGE_BYTES + (half ? 0 : c * (A_BYTES / 2));
                uint8_t *b = smem + s * STAGE_BYTES + A_BYTES + (half ? c * (B_BYTES / 2) : 0);
                if (MODE == WGRAD) {
                    const int valid = ti.r1 - (ti.r0 + kt * BK);
                    if (valid < BK) { /* rows of the next group: zero them in our A block */
                        uint4 *line = (uint4 *)(a + valid * 128);
                        for (int i = tid; i < (BK - valid) * 8; i += 128)
                            line[i] = make_uint4(0, 0, 0, 0);
                        fence_proxy_async();
                        wg_barrier(c);
                    }
                }
                wgmma_fence();
                if constexpr (SW > 0) {
                    /* swapped tail tile: warpgroup c takes the weight block's features
                     * 128c .. 128c + 127 as two wgmma A blocks of 64 (8 KB each: K-major
                     * rows, or MN-major boxes 2c, 2c + 1) times the tail's SW token rows
                     * (A's first box) as wgmma's B: into acc and acc2, SW / 2 each */
                    uint8_t *st = smem + s * STAGE_BYTES, *wb = st + A_BYTES + c * 16384;
                    mma_kstep_swap<SW, TB>(acc, wb, st);
                    mma_kstep_swap<SW, TB>(acc2, wb + 8192, st);
                } else if constexpr (TW == 0) {
                    mma_kstep<NW, TA, TB>(acc, a, b);
                } else { /* sharing tile: A = 3 row boxes (24 KB), then B (SBN columns) */
                    uint8_t *st = smem + s * STAGE_BYTES, *bs = st + 3 * (A_BYTES / 2);
                    mma_kstep<NW, TA, TB>(acc, st + c * (A_BYTES / 2), bs);
                    mma_kstep<TW, TA, TB>(acc + NW / 2, st + A_BYTES, bs + tail_b);
                }
                wgmma_commit();
                /* the previous k-step's MMAs are done once at most this one is pending */
                wgmma_wait<1>();
                if (kt > 0 && lane == 0)
                    release(&empty[(it - 1) % STAGES]);
            }
            wgmma_wait<0>();
            if (ti.nk > 0 && lane == 0) /* a stored wgrad chunk may have no k-steps */
                release(&empty[(it - 1) % STAGES]);
        };
        if constexpr (MC) {
            if (ti.mc < 0) { /* no tile: pass the stages on, in step with the partner */
                for (int kt = 0; kt < ti.nk; kt++, it++) {
                    mbar_wait(&full[it % STAGES], (it / STAGES) & 1);
                    if (lane == 0)
                        release(&empty[it % STAGES]);
                }
                continue;
            }
        }
        using Z = std::integral_constant<int, 0>;
        using Full = std::integral_constant<int, BN>;
        if constexpr (SWAP) {
            /* a swapped tail tile: its own accumulators, 2 × SW / 2 a thread, and d[] is not
             * live here. (With the two halves inside d[] — any offsets — ptxas serialised
             * the wgmma of the whole kernel for want of registers: C7511.) Then the
             * transposed epilogue writes features 128c .. of rows m0 .. r1 − 1. */
            auto swapped = [&](auto sw) {
                constexpr int SW = decltype(sw)::value;
                float e0[SW / 2], e1[SW / 2];
#pragma unroll
                for (int i = 0; i < SW / 2; i++)
                    e0[i] = e1[i] = 0.0f;
                mainloop(e0, e1, Full(), Z(), sw);
#pragma unroll
                for (int i = 0; i < SW / 2; i++) {
                    reg_fence(e0[i]);
                    reg_fence(e1[i]);
                }
                epilogue_transposed<SW, C_BYTES>(e0, e1, cs, c, tid, (moe_bf16 *)p.C, p.N, ti.m0,
                                                 ti.n0 + c * (BN / 2), ti.r1, p.accumulate);
            };
            if (ti.swap) {
                if (ti.swap == 16)
                    swapped(std::integral_constant<int, 16>());
                else if (ti.swap == 32)
                    swapped(std::integral_constant<int, 32>());
                else
                    swapped(std::integral_constant<int, 64>());
                continue;
            }
        }
#pragma unroll
        for (int i = 0; i < ND; i++)
            d[i] = 0.0f;
        if constexpr (MODE == WGRAD || WN != BN) {
            mainloop(d, d, std::integral_constant<int, WN>(), Z(), Z());
        } else if constexpr (SHARE) {
            if (share) /* d[0 .. SBN/2): 64 rows × SBN; then the tail's 64 × SBN / 2 */
                mainloop(d, d, std::integral_constant<int, SBN>(),
                         std::integral_constant<int, SBN / 2>(), Z());
            else
                mainloop(d, d, Full(), Z(), Z());
        } else if (half) { /* accumulators d[0..63]: 64 rows × 128 columns */
            mainloop(d, d, std::integral_constant<int, BN / 2>(), Z(), Z());
        } else {
            mainloop(d, d, Full(), Z(), Z());
        }
#pragma unroll
        for (int i = 0; i < ND; i++)
            reg_fence(d[i]);

        /* ------------------------------------------------ epilogue
         * Accumulators → this warpgroup's staging buffer (in the 128-byte swizzled layout
         * of a TMA box, which also keeps the shared-memory writes free of bank
         * conflicts) → one thread hands the boxes to TMA and the warpgroup goes straight
         * on to its next tile's main loop while the copy-out runs. Forward stores; an
         * accumulating dgrad or wgrad ADDs into global memory (TMA's reduce-add: the
         * accumulate happens in L2, no read-modify-write by the SM); a wgrad into a
         * buffer known to hold zeros, a bf16 wgrad and the split-K partials store. */
        const int m_wg = ti.m0 + (half ? 0 : c * 64);        /* our block's first row, */
        const int n_wg = ti.n0 + (half ? c * (BN / 2) : 0);  /* first column */
        const int ncols = half || share ? BN / 2 : WN; /* and width */
        if constexpr (MODE == WGRAD && C32) { /* a short adding tile: read, added, written */
            if (p.accumulate && ti.nk <= p.rmw) {
                const int nc = min(ncols, p.N - n_wg); /* (I % 8 == 0: the host checks) */
                epilogue_regs<WN, 1>(d, (float *)p.C + ((size_t)ti.gc * p.M + m_wg) * p.N + n_wg,
                                     p.N, nc, p.M - m_wg, tid, 1);
                continue; /* (what follows the epilogue is the forward's share tails) */
            }
        }
        if constexpr (SCATTER) {
            /* every block, whole or cut by its group's end, row by row to its slot */
            epilogue_scatter<WN, C_BYTES>(d, cs, c, tid, ncols, (moe_bf16 *)p.C, p.N, m_wg,
                                          n_wg, ti.r1, p.smap);
        } else if (MODE == WGRAD || m_wg + 64 <= ti.r1) {
            /* our 64 × 256 block leaves through the staging buffer in pieces of C_BYTES
             * (bf16: 2 × 128 columns; fp32: 4 × 64), each two TMA boxes [64 rows][128 bytes] */
            epilogue_staged<C32, WN, C_BYTES>(d, cs, c, tid, ncols, [&](const uint8_t *src,
                                                                        int col) {
                const int n = n_wg + col;
                if (n >= p.N)
                    return 0;
                if (MODE == WGRAD && p.accumulate)
                    tma_reduce_add_3d(&map_c, src, n, m_wg, ti.gc);
                else if (MODE == WGRAD)
                    tma_store_3d(&map_c, src, n, m_wg, ti.gc);
                else if (p.accumulate)
                    tma_reduce_add_2d(&map_c, src, n, m_wg);
                else
                    tma_store_2d(&map_c, src, n, m_wg);
                return 1;
            });
        } else {
            /* the group ends inside our 64 rows: the rows after it belong to the next
             * group, which a TMA box cannot skip — write directly, masked (bf16: forward
             * and dgrad) */
            epilogue_masked<0, WN>(d, p.C, p.N, m_wg, n_wg, ncols, ti.r1, tid, p.accumulate);
        }
        if constexpr (SHARE) {
            if (share) /* the tail rows (1 .. 64 of them): masked, from d[SBN / 2 ..] */
                epilogue_masked<0, SBN / 2>(d + SBN / 2, p.C, p.N, ti.m0 + BM, ti.n0 + tail_col,
                                            SBN / 2, ti.r1, tid, p.accumulate);
        }
    }
    if (tid == 0)
        bulk_wait_all(); /* the last copy-outs have landed before the kernel ends */
    if constexpr (MC)
        cluster_sync(); /* no CTA leaves while its partner may still multicast into its
                           shared memory or arrive on its barriers */
#else
    __trap(); /* sm_90a only: the host never launches it elsewhere */
#endif
}

/* ---------------------------------------------------------------- host side */

/* launches of the MC (static-mc2) kernels, for the tests: the schedule really ran */
int g_mc_launches = 0;

/* MC: clusters of two CTAs along x (cudaLaunchKernelEx), as many clusters as fit at once
 * (cudaOccupancyMaxActiveClusters: one CTA per SM, and a cluster needs two SMs of one GPC,
 * so that can be fewer than SMs / 2) and no more than max_tiles (an upper bound of the
 * pair slots: each slot holds at least one tile) */
template <int MODE, int C32, int GATHER, int SHARE, int WN = BN, int SCATTER = 0, int SWAP = 0,
          int MC = 0>
void launch_kernel(const CUtensorMap &ma, const CUtensorMap &mb, const CUtensorMap &mbs,
                   const CUtensorMap &mc, const Params &p, int max_tiles) {
    auto kernel = grouped_gemm_kernel<MODE, C32, GATHER, SHARE, WN, SCATTER, SWAP, MC>;
    moe_cuda_smem_opt_in<grouped_gemm_kernel<MODE, C32, GATHER, SHARE, WN, SCATTER, SWAP, MC>>(
        SMEM_BYTES);
    if constexpr (MC) {
        static int max_clusters = 0;
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = 2;
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        cudaLaunchConfig_t cfg = {};
        cfg.blockDim = dim3(THREADS);
        cfg.dynamicSmemBytes = SMEM_BYTES;
        cfg.stream = moe_cuda_stream();
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        if (!max_clusters) {
            cfg.gridDim = dim3(moe_cuda_num_sms() / 2 * 2);
            MOE_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&max_clusters, kernel, &cfg));
            MOE_ASSERT(max_clusters >= 1);
        }
        const int clusters = max_tiles < max_clusters ? max_tiles : max_clusters;
        if (clusters <= 0)
            return;
        cfg.gridDim = dim3(2 * clusters);
        MOE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, ma, mb, mbs, mc, p));
        g_mc_launches++;
        return;
    }
    const int grid = moe_cuda_persistent_grid(max_tiles);
    if (grid <= 0)
        return;
    kernel<<<grid, THREADS, SMEM_BYTES, moe_cuda_stream()>>>(ma, mb, mbs, mc, p);
    MOE_CUDA_LAUNCH_CHECK();
}

/* the gathering kernel where p asks for it (forward and wgrad; dgrad never reads the input),
 * else the sharing one where the schedule does (p.fine == 2; forward and dgrad: its own
 * instantiation, so the other schedules' kernels compile exactly as without it). A
 * gathering forward keeps 128-row tiles under share192 (the kernel's Scheduler ignores
 * fine == 2 without SHARE): with both, ptxas serialised its wgmma for want of registers.
 * mbs: the forward's weights in boxes of a sharing tile's 128 rows, else unused (pass mb).
 * wn: the tile width, from tile_width() (NARROW_BN only where it allows it). */
template <int MODE, int C32 = MODE == WGRAD>
void launch(const CUtensorMap &ma, const CUtensorMap &mb, const CUtensorMap &mbs,
            const CUtensorMap &mc, const Params &p, int max_tiles, int wn) {
    constexpr int CAN_SHARE = MODE != WGRAD;
    if (MODE == FWD && p.smap) { /* the scatter epilogue: no gather, no sharing tiles */
        MOE_ASSERT(!p.gmap);
        if (wn == NARROW_BN)
            launch_kernel<FWD, 0, 0, 0, NARROW_BN, 1>(ma, mb, mbs, mc, p, max_tiles);
        else
            launch_kernel<FWD, 0, 0, 0, BN, 1>(ma, mb, mbs, mc, p, max_tiles);
    } else if (wn == NARROW_BN) {
        launch_kernel<MODE, C32, 0, 0, NARROW_BN>(ma, mb, mbs, mc, p, max_tiles);
    } else if (CAN_SHARE && p.fine == 2 && !p.gmap) {
        launch_kernel<MODE, C32, 0, CAN_SHARE>(ma, mb, mbs, mc, p, max_tiles);
    } else if (CAN_SHARE && p.fine == 3 && !p.gmap) { /* swapped tail tiles (swaptail) */
        launch_kernel<MODE, C32, 0, 0, BN, 0, CAN_SHARE>(ma, mb, mbs, mc, p, max_tiles);
    } else if (CAN_SHARE && p.fine == 4 && !p.gmap) { /* 2-CTA clusters (static-mc2) */
        launch_kernel<MODE, C32, 0, 0, BN, 0, 0, CAN_SHARE>(ma, mb, mbs, mc, p, max_tiles);
    } else if (MODE != DGRAD && p.gmap) {
        launch_kernel<MODE, C32, MODE != DGRAD, 0>(ma, mb, mbs, mc, p, max_tiles);
    } else {
        launch_kernel<MODE, C32, 0, 0>(ma, mb, mbs, mc, p, max_tiles);
    }
}

/* The input of a grouped GEMM: a contiguous [rows, I] buffer (map == NULL), or the fused
 * permutation's rows: input row r is token row map[r] / div of x [*, I]. */
struct Input {
    const void *x;
    const int *map;
    int div;
};

/* the gathered input as fields of Params (none for a contiguous one) */
void set_gather(Params &p, const Input &in, int I) {
    p.gx = (const moe_bf16 *)in.x;
    p.gmap = in.map;
    p.gdiv = in.div;
    p.gld = I;
}

/* where the kernel cannot run (not Hopper): a contiguous copy of a gathered input, for
 * cuBLAS — the permutation pass the kernel fuses away */
const void *contiguous(const Input &in, int rows, int I) {
    if (!in.map)
        return in.x;
    void *xp = moe_cuda_scratch(MOE_SCRATCH_GATHER, sizeof(moe_bf16) * (size_t)rows * I);
    moe_cuda_permute_tokens(xp, in.x, in.map, rows, in.div, I);
    return xp;
}

/* out[map[r], :] = src[r, :] for r < off[G] (bf16 rows of C elements): the portable path's
 * scatter, the pass the kernel's scatter epilogue fuses away. One block per row. */
__global__ void scatter_rows_kernel(moe_bf16 *out, const moe_bf16 *src, const int *map,
                                    const int *off, int G, int C) {
    const int r = blockIdx.x;
    if (r >= off[G])
        return;
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        out[(size_t)map[r] * C + c] = src[(size_t)r * C + c];
}

/* The forward/dgrad schedule, a moe_grouped_schedule: how a group's last <= 64 rows are
 * computed (Params::fine: sched_fine) and whether tiles are claimed from a counter
 * (Params::dyn: sched_dyn). -1 until first used: then MOE_GROUPED_SCHEDULE, or the
 * default, static (128-row tiles).
 * Measured (docs/results/03-grouped-gemm-ii.md §3): static with 64-row tiles is slower
 * (0.72x at 130 rows per expert on an H200) because the CTAs drift apart and read the
 * weights from DRAM twice (ncu on an H100: 5.9 against 3.4 GB); claiming the tiles in
 * order fixes that, but the 64-row tiles still do not pay (0.90x at 130 rows on an H100),
 * and dynamic alone is 2-4% faster up to 128 rows per expert, 3-8% slower above. The
 * share192 schedules (192-row tiles sharing the weight block with the tail rows): see
 * docs/results/03-grouped-gemm-ii.md §3c. The swaptail schedules (the tail rows computed
 * transposed, their rows as wgmma's N): docs/results/03-grouped-gemm-ii.md §3e. static-mc2
 * (2-CTA clusters, weights multicast; see the header): 0.92-0.99x static (§3f). Tests run every
 * schedule, the benchmark (--shape fine) times them side by side. */
int g_schedule = -1;

constexpr int N_SCHEDULES = MOE_GROUPED_SCHED_COUNT;
const char *const SCHEDULE_NAMES[N_SCHEDULES] = {"static",          "static-tail64",
                                                 "dynamic",         "dynamic-tail64",
                                                 "static-share192", "dynamic-share192",
                                                 "static-swaptail", "dynamic-swaptail",
                                                 "static-mc2"};

/* Params::fine and Params::dyn of schedule s (the order of moe_grouped_schedule) */
int sched_fine(int s) {
    return s >= MOE_GROUPED_SCHED_STATIC_MC2       ? 4
           : s >= MOE_GROUPED_SCHED_STATIC_SWAPTAIL  ? 3
           : s >= MOE_GROUPED_SCHED_STATIC_SHARE192 ? 2
                                                    : s & 1;
}
int sched_dyn(int s) {
    return s == MOE_GROUPED_SCHED_DYNAMIC || s == MOE_GROUPED_SCHED_DYNAMIC_TAIL64 ||
           s == MOE_GROUPED_SCHED_DYNAMIC_SHARE192 || s == MOE_GROUPED_SCHED_DYNAMIC_SWAPTAIL;
}

int schedule(void) {
    if (g_schedule < 0)
        g_schedule = moe_cuda_env_choice(
            "MOE_GROUPED_SCHEDULE", SCHEDULE_NAMES, N_SCHEDULES, MOE_GROUPED_SCHED_DEFAULT,
            "a schedule of the sm_90a grouped GEMM: static, static-tail64, dynamic, "
            "dynamic-tail64, static-share192, dynamic-share192, static-swaptail, "
            "dynamic-swaptail or static-mc2");
    return g_schedule;
}

/* Narrow tiles (Params-independent, a host choice like the schedule): -1 until first used,
 * then MOE_GROUPED_NARROW (0 turns them off), else on. */
int g_narrow = -1;

int narrow_enabled(void) {
    if (g_narrow < 0) {
        const char *e = getenv("MOE_GROUPED_NARROW");
        g_narrow = !(e && !strcmp(e, "0"));
    }
    return g_narrow;
}

/* The wgrad's L2 prefetch of dw before a reduce-add (prefetch_dw_tile; a host choice, like
 * the schedule): -1 until first used, then MOE_WGRAD_PREFETCH=0|1, else the default. */
int g_wgrad_prefetch = -1;
long long g_prefetch_launches = 0; /* wgrad launches that prefetched, both kernels */

/* How an unsplit wgrad adds into fp32 dw (moe_wgrad_epi: tma, rmw or auto; a host choice):
 * -1 until first used, then MOE_WGRAD_EPI, else the default. auto: RMW for a tile of at most
 * WGRAD_RMW_MAX_ROWS of its group's rows (sm90_epilogue.cuh), the FP8 wgrad's rule. */
int g_wgrad_epi = -1;

int wgrad_epi(void) {
    if (g_wgrad_epi < 0) {
        static const char *const names[] = {"tma", "", "rmw", "auto"};
        g_wgrad_epi = moe_cuda_env_choice(
            "MOE_WGRAD_EPI", names, 4, MOE_WGRAD_EPI_DEFAULT,
            "tma (the bf16 wgrad adds into fp32 dw by TMA reduce-adds), rmw (by reading, "
            "adding and writing from registers) or auto (rmw for tiles of at most 1024 rows, "
            "else tma)");
    }
    return g_wgrad_epi;
}

/* Params.rmw of an adding wgrad: the k-steps up to which a tile adds by RMW */
int wgrad_rmw_ksteps(void) {
    const int e = wgrad_epi();
    return e == MOE_WGRAD_EPI_RMW ? INT_MAX : e == MOE_WGRAD_EPI_AUTO ? WGRAD_RMW_MAX_ROWS / BK : 0;
}

/* The tile width for N output columns: BN = 256, or NARROW_BN = 192 where that pads fewer
 * columns. N = 384 (the GPU preset's hidden size) in 256-column tiles is a full tile and a
 * half-empty one: a third of the MMA work computes zeros. In 192-column tiles it is two
 * full ones. Each narrow tile still loads its A block whole, so where both widths pad
 * alike (N = 768: 3 × 256 or 4 × 192) the wider one wins. N is host-known, so the choice
 * costs no sync. Only for the plain schedules (fine == 0) and non-gathering kernels: the
 * 64-row, sharing and gathering tiles are written for 256 columns. */
int tile_width(int N, int fine, int gather) {
    if (!narrow_enabled() || fine != 0 || gather)
        return BN;
    const int pad_n = (N + NARROW_BN - 1) / NARROW_BN * NARROW_BN, pad_b = (N + BN - 1) / BN * BN;
    return pad_n < pad_b ? NARROW_BN : BN;
}

void check_shapes(int G, int I, int O) {
    if (G > MAX_G || I % MOE_GROUPED_DEV_ALIGN || O % MOE_GROUPED_DEV_ALIGN) {
        fprintf(stderr, "moe.c: the sm_90a grouped GEMM needs at most %d groups and feature sizes "
                        "that are multiples of 8 (got G=%d, I=%d, O=%d)\n", MAX_G, G, I, O);
        exit(1);
    }
}

/* dw (+)= Σ_s part[s] for s = 0 .. S-1 in that order, four elements a thread per step.
 * Summing the split-K partials here, in a fixed order, instead of reduce-adding them from
 * the GEMM keeps the result identical run to run (no floating-point atomics), makes the
 * STORE and bf16 modes safe (no chunk may store over another's sum) and rounds a bf16 dw
 * once, from the full fp32 sum. n is a multiple of 4 (O and I are multiples of 8). */
__global__ void wgrad_reduce_kernel(void *dw, const float4 *part, size_t n4, int S, int mode) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n4;
         i += (size_t)gridDim.x * blockDim.x) {
        float4 v = mode == MOE_DW_ACCUMULATE ? ((float4 *)dw)[i] : make_float4(0, 0, 0, 0);
        for (int s = 0; s < S; s++) {
            const float4 q = part[s * n4 + i];
            v.x += q.x; v.y += q.y; v.z += q.z; v.w += q.w;
        }
        if (mode == MOE_DW_ACT) {
            __nv_bfloat162 *o = (__nv_bfloat162 *)dw + 2 * i;
            o[0] = __floats2bfloat162_rn(v.x, v.y);
            o[1] = __floats2bfloat162_rn(v.z, v.w);
        } else {
            ((float4 *)dw)[i] = v;
        }
    }
}

void wgrad_reduce(void *dw, const float *part, size_t n, int S, moe_dw_mode mode) {
    const size_t n4 = n / 4;
    const int grid = (int)((n4 + 255) / 256 < 4096 ? (n4 + 255) / 256 : 4096);
    wgrad_reduce_kernel<<<grid, 256, 0, moe_cuda_stream()>>>(dw, (const float4 *)part, n4, S,
                                                            (int)mode);
    MOE_CUDA_LAUNCH_CHECK();
}

} /* namespace */

extern "C" void moe_cuda_grouped_sm90_set_schedule(moe_grouped_schedule s) {
    MOE_ASSERT(s >= MOE_GROUPED_SCHED_STATIC && s < N_SCHEDULES);
    g_schedule = (int)s;
}

extern "C" void moe_cuda_grouped_sm90_set_narrow(int on) { g_narrow = on != 0; }

extern "C" int moe_cuda_wgrad_prefetch(void) {
    if (g_wgrad_prefetch < 0) {
        const char *e = getenv("MOE_WGRAD_PREFETCH");
        g_wgrad_prefetch = MOE_WGRAD_PREFETCH_DEFAULT;
        if (e && *e) {
            if (strcmp(e, "0") && strcmp(e, "1") && strcmp(e, "2")) {
                fprintf(stderr, "moe.c: MOE_WGRAD_PREFETCH=%s: use 0 (no L2 prefetch of dw "
                                "before the wgrad's reduce-add), 1 (by the producer's TMA) or "
                                "2 (by the consumers' prefetch instructions), or unset it for "
                                "the default, %d\n",
                        e, MOE_WGRAD_PREFETCH_DEFAULT);
                exit(1);
            }
            g_wgrad_prefetch = e[0] - '0';
        }
    }
    return g_wgrad_prefetch;
}

extern "C" void moe_cuda_wgrad_set_prefetch(int how) {
    g_wgrad_prefetch = how == 1 || how == 2 ? how : 0;
}

extern "C" void moe_cuda_wgrad_set_epilogue(moe_wgrad_epi e) {
    g_wgrad_epi = e == MOE_WGRAD_EPI_TMA || e == MOE_WGRAD_EPI_RMW || e == MOE_WGRAD_EPI_AUTO
                      ? (int)e
                      : MOE_WGRAD_EPI_DEFAULT;
}

extern "C" moe_wgrad_epi moe_cuda_wgrad_epilogue(void) { return (moe_wgrad_epi)wgrad_epi(); }

extern "C" void moe_cuda_wgrad_prefetch_note(void) { g_prefetch_launches++; }

extern "C" long long moe_cuda_wgrad_prefetch_launches(void) { return g_prefetch_launches; }

extern "C" int moe_cuda_grouped_sm90_narrow(void) { return narrow_enabled(); }

extern "C" moe_grouped_schedule moe_cuda_grouped_sm90_schedule(void) {
    return (moe_grouped_schedule)schedule();
}

extern "C" const char *moe_cuda_grouped_sm90_schedule_name(moe_grouped_schedule s) {
    return s >= 0 && s < N_SCHEDULES ? SCHEDULE_NAMES[s] : "?";
}

extern "C" int moe_cuda_grouped_sm90_mc_launches(void) { return g_mc_launches; }

extern "C" int moe_cuda_grouped_sm90_available(void) {
    return moe_cuda_cc_major() == 9;
}

/* The portable path (sm_100a and anything that is not Hopper): bring the offsets to the
 * host — the sync this kernel exists to avoid — and run cuBLAS's grouped GEMM. */
static const int *offsets_on_host(const int *dev_off, int G) {
    static int *h = NULL;
    static int cap = 0;
    if (G + 1 > cap) {
        free(h);
        h = (int *)malloc(sizeof(int) * (G + 1));
        MOE_ASSERT(h != NULL);
        cap = G + 1;
    }
    MOE_CUDA_CHECK(cudaMemcpyAsync(h, dev_off, sizeof(int) * (G + 1), cudaMemcpyDeviceToHost,
                                   moe_cuda_stream()));
    MOE_CUDA_CHECK(cudaStreamSynchronize(moe_cuda_stream()));
    return h;
}


/* scatter: NULL, or output row r goes to row scatter[r] of out (the fused permutation's
 * fc2; out then has as many rows as scatter's values reach) */
static void sm90_forward(void *out, const Input &in, const void *w, const int *dev_off, int G,
                         int rows, int I, int O, const int *scatter = NULL) {
    if (rows == 0)
        return;
    if (!moe_cuda_grouped_sm90_available()) {
        void *dst = out;
        if (scatter) /* computed contiguously, then scattered */
            dst = moe_cuda_scratch(MOE_SCRATCH_SCATTER, sizeof(moe_bf16) * (size_t)rows * O);
        moe_cuda_grouped_matmul_forward(dst, contiguous(in, rows, I), w,
                                        offsets_on_host(dev_off, G), G, I, O);
        if (scatter) {
            scatter_rows_kernel<<<rows, 128, 0, moe_cuda_stream()>>>(
                (moe_bf16 *)out, (const moe_bf16 *)dst, scatter, dev_off, G, O);
            MOE_CUDA_LAUNCH_CHECK();
        }
        return;
    }
    check_shapes(G, I, O);
    /* out[n,O] = in[n,I] · w_gᵀ: A = in (K-major), B = w [G,O,I] (K-major), C = out */
    const uint64_t da[2] = {(uint64_t)I, (uint64_t)rows};
    const uint64_t db[3] = {(uint64_t)I, (uint64_t)O, (uint64_t)G};
    const uint64_t dc[2] = {(uint64_t)O, (uint64_t)rows};
    Params p = {dev_off, G, 0, O, I, out, 0, 1, sched_fine(schedule()), sched_dyn(schedule()),
                NULL, NULL, 0, 0, scatter, 0, 0};
    MOE_ASSERT(!(scatter && in.map)); /* (no kernel both gathers and scatters) */
    set_gather(p, in, I);
    const int wn = tile_width(O, p.fine, in.map != NULL);
    const uint32_t ba[2] = {BK, BM / 2}, bb[3] = {BK, (uint32_t)wn, 1}, bbs[3] = {BK, SBN, 1},
                   bc[2] = {64, 64};
    const CUtensorMap mb = moe_tma_map(w, 3, db, bb);
    /* (128-row weight boxes: a sharing tile's, and static-mc2's half of a weight block) */
    const CUtensorMap mbs = p.fine == 2 || p.fine == 4 ? moe_tma_map(w, 3, db, bbs) : mb;
    /* a gathered A has no tensor map (the kernel does not read map_a then) */
    launch<FWD>(in.map ? mb : moe_tma_map(in.x, 2, da, ba), mb, mbs, moe_tma_map(out, 2, dc, bc),
                p, ((rows + BM - 1) / BM + G) * ((O + wn - 1) / wn), wn);
}

extern "C" void moe_cuda_grouped_sm90_forward(void *out, const void *in, const void *w,
                                              const int *dev_off, int G, int rows, int I, int O) {
    sm90_forward(out, Input{in, NULL, 1}, w, dev_off, G, rows, I, O);
}

extern "C" void moe_cuda_grouped_sm90_forward_gather(void *out, const void *x, const int *map,
                                                     int div, const void *w, const int *dev_off,
                                                     int G, int rows, int I, int O) {
    sm90_forward(out, Input{x, map, div}, w, dev_off, G, rows, I, O);
}

extern "C" void moe_cuda_grouped_sm90_forward_scatter(void *out, const void *in, const int *map,
                                                      const void *w, const int *dev_off, int G,
                                                      int rows, int I, int O) {
    sm90_forward(out, Input{in, NULL, 1}, w, dev_off, G, rows, I, O, map);
}

extern "C" int moe_cuda_grouped_sm90_wgrad_split(int G, int rows, int I, int O) {
    if (G <= 0 || rows <= 0 || !moe_cuda_grouped_sm90_available())
        return 1;
    const int wn = tile_width(I, 0, 0); /* (a gathering wgrad uses BN: S is only a choice) */
    const int tiles = G * ((O + BM - 1) / BM) * ((I + wn - 1) / wn);
    int S = moe_cuda_num_sms() / tiles; /* whole waves of chunks, no tail wave */
    const int k_avg = rows / (G * BK);           /* a group's k-steps, on average */
    S = S < k_avg / MIN_CHUNK_KSTEPS ? S : k_avg / MIN_CHUNK_KSTEPS;
    S = S < MAX_SPLIT ? S : MAX_SPLIT;
    return S > 1 ? S : 1;
}

static void sm90_backward(void *din, void *dw, const void *dout, const Input &in, const void *w,
                          const int *dev_off, int G, int rows, int I, int O, int din_accumulate,
                          moe_dw_mode dw_mode) {
    const size_t nw = (size_t)G * O * I;
    const size_t dw_bytes = nw * (dw_mode == MOE_DW_ACT ? sizeof(moe_bf16) : sizeof(float));
    if (rows == 0) { /* no rows: an overwritten dw is all zeros */
        if (dw && dw_mode != MOE_DW_ACCUMULATE)
            MOE_CUDA_CHECK(cudaMemsetAsync(dw, 0, dw_bytes, moe_cuda_stream()));
        return;
    }
    if (!moe_cuda_grouped_sm90_available()) {
        const int *off = offsets_on_host(dev_off, G);
        if (din && !din_accumulate)
            MOE_CUDA_CHECK(cudaMemsetAsync(din, 0, sizeof(moe_bf16) * (size_t)rows * I,
                                           moe_cuda_stream()));
        if (din)
            moe_cuda_grouped_matmul_backward(din, NULL, dout, NULL, w, off, G, I, O);
        if (!dw)
            return;
        /* cuBLAS adds into fp32: into dw itself, or into zeros that are then written out
         * as bf16 */
        float *acc = dw_mode == MOE_DW_ACT
                         ? (float *)moe_cuda_scratch(MOE_SCRATCH_WGRAD_SPLIT, nw * sizeof(float))
                         : (float *)dw;
        if (dw_mode != MOE_DW_ACCUMULATE)
            MOE_CUDA_CHECK(cudaMemsetAsync(acc, 0, nw * sizeof(float), moe_cuda_stream()));
        moe_cuda_grouped_matmul_backward(NULL, acc, dout, contiguous(in, rows, I), w, off, G, I,
                                         O);
        if (dw_mode == MOE_DW_ACT)
            wgrad_reduce(dw, acc, nw, 1, dw_mode);
        return;
    }
    check_shapes(G, I, O);
    if (din) { /* din[n,I] (+)= dout[n,O] · w_g[O,I]: A = dout (K-major), B = w (MN-major) */
        const uint64_t da[2] = {(uint64_t)O, (uint64_t)rows};
        const uint64_t db[3] = {(uint64_t)I, (uint64_t)O, (uint64_t)G};
        const uint64_t dc[2] = {(uint64_t)I, (uint64_t)rows};
        const uint32_t ba[2] = {BK, BM / 2}, bb[3] = {64, BK, 1}, bc[2] = {64, 64};
        const Params p = {dev_off, G, 0, I, O, din, din_accumulate, 1, sched_fine(schedule()),
                          sched_dyn(schedule()), NULL, NULL, 0, 0, NULL, 0, 0};
        const CUtensorMap mb = moe_tma_map(w, 3, db, bb);
        const int wn = tile_width(I, p.fine, 0);
        launch<DGRAD>(moe_tma_map(dout, 2, da, ba), mb, mb, moe_tma_map(din, 2, dc, bc), p,
                      ((rows + BM - 1) / BM + G) * ((I + wn - 1) / wn), wn);
    }
    if (dw) { /* dw_g[O,I] (+)= dout_gᵀ · in_g: A = dout, B = in (both MN-major; a gathered
               * B is copied by index, each of its k-rows one token row) */
        const int S = moe_cuda_grouped_sm90_wgrad_split(G, rows, I, O);
        if (S == 1 && !in.map && moe_cuda_grouped_sm90_wgrad_pingpong()) {
            /* one chunk, contiguous input: the ping-pong kernel when switched on (off by
             * default; kernels/grouped_wgrad_pingpong_sm90.cu) */
            moe_cuda_grouped_sm90_wgrad_pingpong_run(dw, dout, in.x, dev_off, G, rows, I, O,
                                                     dw_mode);
            return;
        }
        const uint64_t da[2] = {(uint64_t)O, (uint64_t)rows};
        const uint64_t db[2] = {(uint64_t)I, (uint64_t)rows};
        const uint64_t dc[3] = {(uint64_t)I, (uint64_t)O, (uint64_t)G * S};
        const uint32_t box[2] = {64, BK}, bc32[3] = {32, 64, 1}, bc16[3] = {64, 64, 1};
        const int wn = tile_width(I, 0, in.map != NULL);
        const int tiles = S * G * ((O + BM - 1) / BM) * ((I + wn - 1) / wn);
        const CUtensorMap ma = moe_tma_map(dout, 2, da, box);
        const CUtensorMap mb = in.map ? ma : moe_tma_map(in.x, 2, db, box);
        if (S > 1) { /* every chunk STORES its partial [S][G][O][I]; one ordered sum after */
            float *part = (float *)moe_cuda_scratch(MOE_SCRATCH_WGRAD_SPLIT, S * nw * sizeof(float));
            Params p = {dev_off, G, O, I, 0, NULL, 0, S, 0, 0, NULL, NULL, 0, 0, NULL, 0, 0};
            set_gather(p, in, I);
            launch<WGRAD>(ma, mb, mb, moe_tma_map(part, 3, dc, bc32, 1), p, tiles, wn);
            wgrad_reduce(dw, part, nw, S, dw_mode);
        } else if (dw_mode == MOE_DW_ACT) { /* bf16, stored */
            Params p = {dev_off, G, O, I, 0, NULL, 0, 1, 0, 0, NULL, NULL, 0, 0, NULL, 0, 0};
            set_gather(p, in, I);
            launch<WGRAD, 0>(ma, mb, mb, moe_tma_map(dw, 3, dc, bc16), p, tiles, wn);
        } else { /* fp32: reduce-added, or stored into a buffer whose contents do not count */
            const int acc = dw_mode == MOE_DW_ACCUMULATE;
            /* (C: dw, for the consumers' prefetch and the RMW epilogue, which read it; the
             * other tiles leave through TMA) */
            const int pf = acc ? moe_cuda_wgrad_prefetch() : 0;
            Params p = {dev_off, G, O, I, 0, acc ? dw : NULL, acc, 1, 0, 0, NULL, NULL, 0, 0,
                        NULL, pf, acc && I % 8 == 0 ? wgrad_rmw_ksteps() : 0};
            set_gather(p, in, I);
            if (p.prefetch)
                moe_cuda_wgrad_prefetch_note();
            launch<WGRAD>(ma, mb, mb, moe_tma_map(dw, 3, dc, bc32, 1), p, tiles, wn);
        }
    }
}

extern "C" void moe_cuda_grouped_sm90_backward(void *din, void *dw, const void *dout,
                                               const void *in, const void *w, const int *dev_off,
                                               int G, int rows, int I, int O, int din_accumulate,
                                               moe_dw_mode dw_mode) {
    sm90_backward(din, dw, dout, Input{in, NULL, 1}, w, dev_off, G, rows, I, O, din_accumulate,
                  dw_mode);
}

extern "C" void moe_cuda_grouped_sm90_backward_gather(void *din, void *dw, const void *dout,
                                                      const void *x, const int *map, int div,
                                                      const void *w, const int *dev_off, int G,
                                                      int rows, int I, int O, int din_accumulate,
                                                      moe_dw_mode dw_mode) {
    sm90_backward(din, dw, dout, Input{x, map, div}, w, dev_off, G, rows, I, O, din_accumulate,
                  dw_mode);
}
