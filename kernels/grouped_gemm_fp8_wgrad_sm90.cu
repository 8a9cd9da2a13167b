/*
 * Chapter 05's FP8 grouped wgrad for Hopper (lib/fp8_wgrad.h): every routed expert's weight
 * gradient dW_g = dY_gᵀ · X_g in one persistent kernel, on the token-wise FP8 copies of dY
 * and X (kernels/quantize_group_t.cu), the group offsets read from DEVICE memory (sync-free):
 *
 *   D_g[m, n] (+)= Σ_{kb in g's blocks} sa[kb][m] · sb[kb][n] · Σ_{k in kb} qa[m, k] · qb[n, k]
 *
 * A = dYᵀ's codes [M][Kpad] (M = O), B = Xᵀ's [N][Kpad] (N = I), both K-major (K = the
 * tokens), as Hopper's FP8 wgmma needs. It is the forward kernel (grouped_gemm_fp8_sm90.cu)
 * turned around, and reuses its machinery: 2 consumer warpgroups of 64 rows + a producer
 * (a warpgroup here: the register note below), tiles of 128 × 128, a stage = one 128-deep
 * k-block of A (two TMA boxes of 64 rows × 128 bytes), B (one box of 128 rows) and their
 * scales (below), 5 stages, the same swizzled descriptors, the same "promotion" of each
 * k-block's wgmma partial into fp32 main accumulators, the same ORDERED issue (named
 * barriers 3 and 4: moe_cuda_fp8_grouped_ordered()), the same epilogue (sm90_epilogue.cuh).
 * What differs:
 *   - the tiles: the group (expert) g, then 128-row block of dW_g, then 128-column block:
 *     G · (M/128) · (N/128) tiles, each with its group's k-loop, ⌈n_g/128⌉ k-blocks from the
 *     group's padded start P_g (lib/fp8_wgrad.h), which every CTA computes from the offsets
 *     in shared memory (moe_wgrad_block_prefix, fp8_wgrad.cuh: a scan, a thread a group);
 *   - the scale of a k-block is a row scale times a COLUMN scale (a token block of dY's
 *     channel m and one of X's channel n), so the promotion multiplies each accumulator by
 *     its own sa[m]·sb[n]. A thread's 64 accumulators are rows r_lo, r_lo + 8 and columns
 *     8j + 2(l%4) + {0, 1}, j < 16 (sm90_epilogue.cuh): 2 row scales and 32 column scales
 *     per k-block. The scales are block-major ([Kpad/128][M] and [Kpad/128][N]), so the
 *     tile's scales of one k-block are two runs of 512 contiguous bytes, sa[kb][m0 ..
 *     m0 + 127] and sb[kb][n0 .. n0 + 127], kb = P_g + the local k-block: the producer
 *     brings them into a 1 KB slot of the k-block's stage with two bulk copies
 *     (cp.async.bulk, no tensor map; DeepGEMM brings its scales with TMA too), counted in
 *     the stage's full barrier, and each consumer thread reads its 2 row and 32 column
 *     scales there (conflict-free, release_promote_smem) once the k-block's MMAs are done,
 *     into registers, before it gives the stage back. The room: 5 stages, not 6 (Ring).
 *   - why: the consumers first loaded the scales from global memory (16 float2 and 2
 *     floats a thread and k-block, issued after the k-block's MMAs so their latency would
 *     hide behind the MMAs waited for next; kept as MOE_FP8_WGRAD_SCALES=global). Nsight
 *     Compute on an H100 (Mixtral fc2: 16384 tokens, 4096 × 14336, 8 experts; pipelined,
 *     fp32 dW added) saw 4.34 ms, the tensor pipe 29 % busy, no eligible warp in 68 % of
 *     the cycles, and the top stall the L1TEX scoreboard (2.8 of 7.1 cycles between
 *     issues): those loads, not hidden (L1 hit 78 %). Shared memory answers in ~30
 *     cycles, and TMA fetched the slot long before, with the codes.
 *   - the output: dW [G][M][N] through a 3-D tensor map: fp32 reduce-added (ACCUMULATE),
 *     fp32 stored (STORE) or bf16 stored (ACT), chapter 03's three modes (moe_dw_mode);
 *     M and N are multiples of 128, so every tile is whole and leaves through TMA. An empty
 *     group's tiles: skipped when adding, zeros stored otherwise.
 * The consumer loop, pipelined (MOE_FP8_WGRAD_PIPE=1, the default; moe_cuda_fp8_wgrad_pipe):
 * the first loop (=0, kept to compare) committed each k-block's MMAs, waited for them
 * (wgmma_wait<0>) and promoted before issuing the next k-block, so this warpgroup's share of
 * the tensor cores idled through every promotion (the other warpgroup's MMAs covered only
 * part of it: 0.85-0.93x the bf16 wgrad on an H100). Now, the DeepGEMM / CUTLASS way, each
 * warpgroup has two accumulator sets: k-block j's MMAs go into acc[j % 2]; step j issues
 * j + 1's into the other set, waits until only that group is outstanding (wgmma_wait<1>: j
 * is done), reads j's scales, gives j's stage back to the producer (only now: the wgmma
 * read it until it completed), and promotes j while j + 1 runs. The parity is fixed at
 * compile time by a loop by twos (registers cannot be indexed), and whether a step issues
 * is a template argument, not a runtime flag tested twice (pipe_step: otherwise ptxas
 * serializes the wgmmas).
 * The same k-blocks are promoted in the same order with the same fmaf, so the output is bit
 * for bit the first loop's. The ORDERED issue is unchanged: each issue (now one k-block
 * ahead of its promotion) waits for the other warpgroup's previous issue.
 * Why two accumulator sets and not a wider tile (128 × 256, each consumer 64 × 256, half the
 * promotions per MMA FLOP): its 128 wgmma accumulators plus 128 sums are 256 registers, past
 * the 240 a consumer can have (below); it would also still wait before each promotion.
 * Two sets cost 64 registers more than the first loop (see the register note below).
 * The 128 × 256 tile after all (WIDE = 1; MOE_FP8_WGRAD_BN=256 or moe_cuda_fp8_wgrad_set_bn,
 * off by default), the forward kernel's "split promotion" (grouped_gemm_fp8_sm90.cu, where
 * it took the forward from 59-71 % to 74-88 % of the dense FP8 GEMM on an H100): each
 * consumer warpgroup owns 64 rows × 256 columns of SUMS (128 registers a thread) but only
 * one 64 × 128 wgmma accumulator (64): per k-block it issues columns 0..127's 4
 * m64n128k32 into it, waits, promotes them into d[0..63] (each with its sa[m]·sb[n], the
 * column scales of that half read from the stage's slot, 4 pairs at a time: 8 registers,
 * not 32), then columns 128..255's into the same accumulator, promotes into d[64..127], and
 * only then gives the stage back. 192 accumulators: the forward's registers (a producer
 * warpgroup at 40, consumers at 232: 2 × 232 + 40 = 504 ≤ 512); ptxas -v: no spills. The
 * ORDERED turns become halves (warpgroup 0's half 0, 1's half 0, 0's half 1, 1's half 1,
 * ..., the same barriers 3 and 4: issue_kblock's h), so while one warpgroup promotes a half
 * the other's MMAs run: the wait before each promotion is the other warpgroup's issue, not
 * idle tensor cores. What it saves over the 128 × 128 pipelined loop: per k-block 48 KB of
 * loads for 128 × 256 outputs where two narrow tiles load 64 KB (A twice), half the stage
 * waits, scale copies and epilogue hand-offs per FLOP. Each output element is the same fp32
 * sum as the narrow kernels' (the same m64n128k32 on the same bytes, the same scale
 * product, the same fmaf in the same k-block order), so they agree bit for bit
 * (tests/gpu_fp8_wgrad.c). A stage: A 16 KB, B 32 KB (two 128-row boxes), scales 1.5 KB
 * (sa's 128 rows, sb's 256 columns); 4 stages with two 16 KB staging buffers are 230 KB +
 * 2 KB static, over the 227 KB, so the staging buffers are 8 KB (Ring): 4 × 49.5 + 16 + 2
 * = 216 KB. 4 stages, not 3 with 16 KB buffers: 4 k-blocks ahead as the forward's wide
 * tile (3 × 48 KB would be 1.7 µs of MMAs at the tensor cores' peak, close to a loaded
 * L2's latency), at the price of an epilogue in 8 pieces instead of 4 (fp32; 4 instead of
 * 2 with bf16), each waiting until TMA has read the last, once per tile of nk k-blocks.
 * Not tried: the other choice, 3 stages. N = 128·odd: the last tile's second half lies
 * past N; it is neither loaded nor computed, its scales not read, its columns not stored.
 * Only with the scales in shared memory and the pipelined loop selected (the defaults): with
 * MOE_FP8_WGRAD_SCALES=global or MOE_FP8_WGRAD_PIPE=0 (comparisons of the 128-column
 * kernel) the 128-column tile runs.
 * Load balance is the simple one (tiles strided over the CTAs in order; a long group's
 * tiles cost more); correctness first. The order is the bf16 wgrad's: within a group, bands
 * of 8 m-tiles, m fastest inside a band (place, in the kernel), so that the CTAs of a wave
 * share their operands in L2 (on Mixtral's fc2 it halved the DRAM reads: 1.25x that wgrad).
 * The scales are read in the same order with the same values whichever memory they come
 * from, so the output is also bit for bit the global-scales kernel's (tests/gpu_fp8_wgrad.c
 * compares all four variants of loop and scale path).
 *
 * STATUS: every variant passed tests/gpu_fp8_wgrad.c on an H100: the global-scales kernel
 * (0.83-0.91x the bf16 wgrad), the shared-memory scales (the default, MOE_FP8_WGRAD_SCALES=
 * global for the old path: 0.99-1.25x the bf16 wgrad, ad0b47d) and the 128 × 256 tile
 * (MOE_FP8_WGRAD_BN=256; 6e1d150: bit for bit the 128-column kernels in all three output
 * modes, and 751 against the pipelined 128-column kernel's 731 TFLOP/s on Mixtral's fc1,
 * 1.03x: measured on that one shape, so it stays opt-in). The L2 prefetch of dW before the
 * reduce-add (MOE_WGRAD_PREFETCH=1, as the bf16 wgrad's: kernels/grouped_gemm_sm90.cu; the
 * shared-memory-scales kernels only) passed tests/gpu_fp8_wgrad.c on an H100 (its output
 * bit for bit the other variants'); off, as the bf16 wgrad's prefetch measured slower.
 * The RMW and auto epilogues (MOE_FP8_WGRAD_EPI=rmw|auto, auto the default) passed
 * tests/gpu_fp8_wgrad.c on an H100 (bit for bit the other variants, auto's two epilogues in
 * one launch) and made Qwen3-235B's FP8 layer 1.07x faster (docs/results/05-fp8-nvfp4.md,
 * "The adding wgrad by plain reads and writes").
 * The direct epilogue (MOE_FP8_WGRAD_EPI=direct, epilogue_regs) passed
 * tests/gpu_fp8_wgrad.c on an H100 (bit for bit) and is slower everywhere it was timed: on
 * Mixtral's fc1 storing 5.59 against 5.23 ms, adding 5.95 against 5.83; on Qwen3-235B's fc1
 * (4 k-blocks a tile) adding 8.41 against 7.01; the Mixtral layer 22.86-23.02 against
 * 22.60-22.80 ms (docs/results/05-fp8-nvfp4.md, "The FP8 wgrad becomes blockwise's
 * default"). So the staging was not what the tile waited for: Nsight Compute puts the staged
 * and the direct store at the same 4.64 ms alone, DRAM 30 % busy, and the top stall the
 * consumers' named barriers (the ORDERED turns). Off.
 */
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_common.cuh"
#include "cuda_ops.h"
#include "fp8_wgrad.cuh"
#include "fp8_wgrad.h"
#include "moe/tile_schedule.h"
#include "sm90_epilogue.cuh"
#include "sm90_ptx.cuh"
#include "wgmma.cuh"

namespace {

constexpr int BM = 128, BN = 128, BK = MOE_QUANT_BLOCK, THREADS = 384;
/* m-tiles per raster band (moe_tile_band_place; see place below) */
[[maybe_unused]] constexpr int BAND = 8;
/* The auto epilogue (DIRECT = 3, the default with fp32 dW): a tile of at most this many
 * k-blocks adds into dW by RMW, a longer one staged (sm90_epilogue.cuh, WGRAD_RMW_MAX_ROWS).
 * The tile's own count (its group's), so ragged groups choose per tile, on the device. */
constexpr int RMW_MAX_KBLOCKS = WGRAD_RMW_MAX_ROWS / BK;
[[maybe_unused]] constexpr int MAX_G = MOE_GROUPED_DEV_MAX_GROUPS;
constexpr int A_BYTES = BM * BK, B_BYTES = BN * BK, STAGE_BYTES = A_BYTES + B_BYTES;
/* a stage's scales: sa's 128 rows, sb's 128 columns */
[[maybe_unused]] constexpr int SCL_BYTES = (BM + BN) * 4;
constexpr int C_BYTES = 16384;
static_assert(THREADS >= MOE_GROUPED_DEV_MAX_GROUPS, "moe_wgrad_block_prefix: a thread a group");
/* The ring of each scale path (SS: 1 = the scales in shared memory, with their stage; 0 =
 * read from global memory by the consumers, kept to compare). Shared memory, from the
 * 1024-aligned base: STAGES × 32 KB of codes (A then B), then (SS) STAGES × 1 KB of scales,
 * then the two consumers' 16 KB staging buffers. A block may have 227 KB (232448 bytes),
 * static shared memory included: the barriers and the 257 group starts (1.1 KB) take 2 KB
 * once the dynamic part is aligned to 1024 (ptxas -v: "2048 bytes smem"). 6 stages with
 * their scales would be 6 × 33 + 32 + 2 = 232 KB: over. So the shared-memory scales come
 * with 5 stages (5 × 33 + 32 + 2 = 199 KB), not with 6 and halved staging buffers: the
 * loads are not what the loop waits for (Nsight Compute on an H100, Mixtral fc2: DRAM 27 %
 * busy, L2 hits 83 %; its top stall was the consumers' scale loads), 5 k-blocks ahead are
 * 1.4 µs of MMAs at the tensor cores' peak (a k-block is 4.2 MFLOP, 0.28 µs at 1979/132
 * TFLOP/s an SM), above an L2 or DRAM load's latency, and 8 KB staging buffers would make
 * the epilogue wait for TMA to read each 8 KB box before writing the next (4 waits a tile
 * instead of 2 with fp32 output). 6 stages + 8 KB buffers is the other choice, not tried.
 * WIDE (the 128 × 256 tile, above): stages of 48 KB + 1.5 KB of scales, 4 of them, and 8 KB
 * staging buffers (16 KB ones would make 232 KB). */
template <int SS, int WIDE = 0> struct Ring {
    static constexpr int TN = WIDE ? 2 * BN : BN; /* the tile's columns */
    static constexpr int SB = A_BYTES + TN * BK;  /* a stage's codes */
    static constexpr int SCL = (BM + TN) * 4;     /* a stage's scales */
    static constexpr int STAGES = WIDE ? 4 : SS ? 5 : 6;
    static constexpr int CB = WIDE ? 8192 : C_BYTES; /* a consumer's staging buffer */
    static constexpr int SCL_OFF = STAGES * SB;                     /* the scales */
    static constexpr int C_OFF = SCL_OFF + (SS ? STAGES * SCL : 0); /* the staging */
    static constexpr int SMEM = C_OFF + 2 * CB;
    static_assert(SMEM + 2048 <= 232448, "over the 227 KB a block may have");
    static_assert(SCL_OFF % 1024 == 0 && C_OFF % 1024 == 0, "swizzled tiles: 1024-aligned");
    static_assert(!WIDE || SS, "the 128 x 256 tile reads its scales from its stage only");
};
/* registers: the first loop's 128 accumulators (64 of the k-block's wgmma, 64 scaled sums),
 * the scales and the addressing need about 200 a consumer thread; the pipelined loop's 192
 * accumulators (two wgmma sets and the sums) about 240. 288 threads (two consumer warpgroups
 * and one producer warp) cannot have them: three warps then share an SM sub-partition's 16K
 * registers, 168 each at most (an H100 refused __maxnreg__(224) at launch: "too many
 * resources requested"). So the producer is a whole warpgroup that gives its registers to the
 * consumers with setmaxnreg, as kernels/attention_sm90.cu does: per sub-partition one warp of
 * each warpgroup, 2 × 240 + 24 = 504 ≤ 512 registers a lane (FlashAttention-3's split; the
 * producer's loop fits 24 without spilling). ptxas -v with 232 (and 40 for the producer):
 * the pipelined loop spilled 28 to 48 bytes; with 240 and 32-bit scale indices: none, except
 * 4 to 8 bytes in the bf16-output variants (their epilogue). */
[[maybe_unused]] constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240;
/* the 128 × 256 tile's (WIDE): 128 main + 64 wgmma accumulators, the forward's 40 / 232 */
[[maybe_unused]] constexpr int PRODUCER_REGS_W = 40, CONSUMER_REGS_W = 232;
static_assert(BK == 128, "a stage must be one 128-token scale block of 128 bytes");

struct Params {
    const int *off; /* [G+1] token offsets, DEVICE memory */
    int G, M, N;
    const float *sa, *sb; /* [Kpad/128][M], [Kpad/128][N] */
    int accumulate;       /* 1: reduce-add (fp32); 0: store */
    int prefetch;         /* reduce-add: the producer prefetches each tile's dW into L2
                             (prefetch_dw_tile, MOE_WGRAD_PREFETCH) */
    float *dw;            /* dW [G][M][N] fp32: the direct epilogue's (DIRECT) destination */
};

/* one k-block's MMAs of consumer warpgroup c (issue number it: its stage and phase) into
 * acc, issued and committed, not waited for. ORDERED: the warpgroups take turns at the
 * issue (named barriers 3 and 4, as the forward kernel): warpgroup 0's first issue waits
 * for nobody, every other waits for the other warpgroup's previous issue. The 128 × 256
 * tile (SB: its stage's bytes) issues a k-block in two calls, h = 0 and 1: its 128-column
 * halves, each a turn of its own; the second finds the stage already full */
template <int ORDERED, int STAGES, int SB = STAGE_BYTES>
__device__ __forceinline__ void issue_kblock(float *acc, const uint8_t *smem, uint64_t *full,
                                             int it, int c, int h = 0) {
    const int s = it % STAGES, phase = (it / STAGES) & 1;
    if (h == 0)
        mbar_wait(&full[s], phase);
    const uint8_t *a = smem + s * SB + c * (A_BYTES / 2);
    const uint8_t *b = smem + s * SB + A_BYTES + h * B_BYTES;
    if (ORDERED && (c == 1 || it > 0 || h > 0))
        named_bar_sync(3 + c, 256);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 32; kk++)
        moe_wgmma_fp8<BN>::mma(acc, desc(a + kk * 32, 16, 1024), desc(b + kk * 32, 16, 1024),
                               kk > 0);
    wgmma_commit();
    if (ORDERED)
        named_bar_arrive(4 - c, 256);
}

/* the promotion of one finished k-block: d[i] += acc[i] · sa[row] · sb[col], the thread's
 * 64 accumulators (rows row0, row0 + 8; columns 8j + 2(lane%4) + {0, 1}); a0, a1: the two
 * row scales, sbv: the 16 column-scale pairs. reg_fence keeps every accumulator read after
 * the wgmma wait that precedes the call (the wait is an asm the compiler cannot see into) */
template <int J = BN / 8>
__device__ __forceinline__ void promote(float *d, float *acc, float a0, float a1,
                                        const float2 *sbv) {
#pragma unroll
    for (int j = 0; j < J; j++) {
        const float2 sv = sbv[j];
#pragma unroll
        for (int h = 0; h < 4; h++) { /* d[4j+h]: row (h & 2 ? row1 : row0), column h & 1 */
            const int i = 4 * j + h;
            reg_fence(acc[i]);
            const float sc = ((h & 2) ? a1 : a0) * ((h & 1) ? sv.y : sv.x);
            d[i] = fmaf(acc[i], sc, d[i]);
        }
    }
}

/* a finished k-block's scales from its stage's slot in shared memory (SS), into registers,
 * then its stage given back to the producer (only now: the reads of the slot are done; the
 * arrive's release orders them before the producer's next TMA write), then its promotion.
 * sc: the slot (sa's 128 rows, then sb's 128 columns); ia = 64c + r_lo, the thread's first
 * row in the CTA's tile, ib = 128 + 2(lane%4), its first column scale in the slot. No bank
 * conflicts: a warp reads rows r_lo = 16w + lane/4, 8 consecutive floats (each to 4 lanes,
 * a broadcast), and column pairs 8j + 2(lane%4), 4 consecutive float2 (32 bytes, each to 8
 * lanes): one wavefront a load. 34 registers, live from here to the promotion only (not
 * across the wgmma wait before, where 32 more spilled: see pipe_step) */
template <int J = BN / 8> /* (a template, as promote: sm_100a compiles none of it) */
__device__ __forceinline__ void release_promote_smem(float *d, float *acc, const float *sc,
                                                     uint64_t *empty, int lane, int ia, int ib) {
    const float a0 = sc[ia], a1 = sc[ia + 8];
    float2 sbv[J];
#pragma unroll
    for (int j = 0; j < J; j++)
        sbv[j] = *(const float2 *)(sc + ib + 8 * j);
    if (lane == 0)
        mbar_arrive(empty); /* (an asm with a memory clobber: the reads stay before it) */
    promote<J>(d, acc, a0, a1, sbv);
}

/* one step of the pipelined loop: k-block kt's MMAs were issued into cur. MORE (a k-block
 * follows): issue kt + 1's into nxt, then wait until only that group is outstanding (kt
 * done); else wait for all. Then give kt's stage back to the producer and promote cur,
 * while kt + 1 runs on the tensor cores. MORE is a template argument, not a flag tested
 * twice: ptxas tracks which accumulators an in-flight wgmma owns along each path, and two
 * tests of one runtime flag (issue if more, wait<1> if more) give it a path where nxt's
 * group is still running at the loop's exit; it then serializes every wgmma (C7514) and
 * injects a wait (C7517). it0: the issue number of the tile's k-block 0. SS: the scales in
 * the stage's slot (ia, ib: release_promote_smem's), else in global memory (ia, ib: the
 * thread's first row and column scale of k-block 0, 32-bit indices into p.sa and p.sb) */
template <int ORDERED, int MORE, int SS>
__device__ __forceinline__ void pipe_step(float *d, float *cur, float *nxt, const uint8_t *smem,
                                          uint64_t *full, uint64_t *empty, int it0, int kt,
                                          int c, int lane, int ia, int ib, const Params &p) {
    constexpr int STAGES = Ring<SS>::STAGES;
    const int s = (it0 + kt) % STAGES;
    if (MORE)
        issue_kblock<ORDERED, STAGES>(nxt, smem, full, it0 + kt + 1, c);
    if constexpr (SS) {
        if (MORE)
            wgmma_wait<1>(); /* all but kt + 1's group: kt's MMAs have read their stage */
        else
            wgmma_wait<0>();
        release_promote_smem(d, cur, (const float *)(smem + Ring<SS>::SCL_OFF + s * SCL_BYTES),
                             &empty[s], lane, ia, ib);
    } else {
        /* kt's row scales: their latency hides behind the wait. Its column scales are loaded
         * after it: 32 more registers live across the wait spill (ptxas -v), and a spilled
         * accumulator serializes the wgmmas (C7514); their latency hides behind kt + 1's
         * MMAs (in principle: Nsight Compute found these loads the loop's top stall) */
        const float *sak = p.sa + (unsigned)(ia + kt * p.M);
        const float a0 = __ldg(sak), a1 = __ldg(sak + 8);
        if (MORE)
            wgmma_wait<1>();
        else
            wgmma_wait<0>();
        if (lane == 0)
            mbar_arrive(&empty[s]);
        const float *sbk = p.sb + (unsigned)(ib + kt * p.N);
#pragma unroll
        for (int q = 0; q < BN / 32; q++) { /* 4 pairs at a time: 8 registers, not 32 */
            float2 sbv[4];
#pragma unroll
            for (int j = 0; j < 4; j++)
                sbv[j] = __ldg((const float2 *)(sbk + 32 * q + 8 * j));
            promote<4>(d + 16 * q, cur + 16 * q, a0, a1, sbv);
        }
    }
}

/* ---------------------------------------------------------------- the wide tile by quarters
 * (WIDE = 2; MOE_FP8_WGRAD_QUARTERS=1, moe_cuda_fp8_wgrad_set_quarters; with the 128 × 256
 * tile only). The split promotion above waits for each 128-column half's MMAs before it
 * promotes them (wgmma_wait<0>), so this warpgroup has nothing queued at the tensor cores while
 * it promotes, and the ORDERED turns are what keeps them busy (Nsight Compute on Mixtral's fc1:
 * the named barriers are the warps' top stall, the tile at 830 TFLOP/s alone where the forward
 * of the same shape runs 1072). Here a k-block is promoted in four 64-column quarters with two
 * accumulator sets of 32 registers, as the 128-column kernel's PIPE loop does with k-blocks:
 * quarter q + 1's MMAs (4 × m64n64k32) are issued into the other set before quarter q is
 * waited for and promoted (quarters_tile). A warpgroup then has MMAs queued through three of
 * its four promotions, not through none of its two, so there are no turns (ORDERED is not
 * used). Registers: 128 sums + 2 × 32 accumulators = 192, as the halves' 128 + 64. The same m64·k32 FP8 products
 * summed over the same 128-deep k-block, the same scale product and the same fmaf in the same
 * k-block order for every element: the output is meant to be the halves' bit for bit
 * (tests/gpu_fp8_wgrad.c checks it). STATUS: passed gpu_fp8_wgrad on an H100 at 4b8d4da and
 * measured there SLOWER (docs/results/05-fp8-nvfp4.md): Mixtral fc1 5.58 against 5.16 ms
 * storing, Qwen3-235B fc1 3.92 against 3.23; the layer no faster. Off (the default). */

/* issue quarter q (columns 64q .. 64q + 63 of the tile; rows 64q.. of the stage's B boxes) of
 * k-block issue number it into acc (32 registers), committed, not waited for; WAIT: first
 * wait until the stage is full (a k-block's quarter 0) */
template <int STAGES, int SB, int WAIT>
__device__ __forceinline__ void issue_quarter(float *acc, const uint8_t *smem, uint64_t *full,
                                              int it, int c, int q) {
    const int s = it % STAGES;
    if (WAIT)
        mbar_wait(&full[s], (it / STAGES) & 1);
    const uint8_t *a = smem + s * SB + c * (A_BYTES / 2);
    const uint8_t *b = smem + s * SB + A_BYTES + q * (B_BYTES / 2); /* 64 rows: 8 KB */
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 32; kk++)
        moe_wgmma_fp8<64>::mma(acc, desc(a + kk * 32, 16, 1024), desc(b + kk * 32, 16, 1024),
                               kk > 0);
    wgmma_commit();
}

/* the promotion of a finished quarter q: d[32q ..] += acc · sa[row] · sb[col], the column
 * scales of the quarter read from the stage's slot 4 pairs at a time (registers are short),
 * in G = 2 groups (a template, as promote: sm_100a compiles none of it) */
template <int G = 2>
__device__ __forceinline__ void promote_quarter(float *d, float *acc, const float *sc, int q,
                                                int lane, float a0, float a1) {
    const float *sbq = sc + BM + 64 * q + 2 * (lane % 4);
#pragma unroll
    for (int g = 0; g < G; g++) {
        float2 sbv[4];
#pragma unroll
        for (int j = 0; j < 4; j++)
            sbv[j] = *(const float2 *)(sbq + 32 * g + 8 * j);
        promote<4>(d + 32 * q + 16 * g, acc + 16 * g, a0, a1, sbv);
    }
}

/* One tile's k-loop by quarters, NQ = 4 (both 128-column halves inside N) or 2 (the second
 * half past N). Quarter q's accumulators are q even ? acc : acc2: NQ is even, so every
 * k-block starts in acc, and every parity is known at compile time (registers cannot be
 * indexed). Within a k-block quarter q + 1 is queued before quarter q is waited for; the
 * last quarter is waited for alone (wgmma_wait<0>), so no group is in flight from one k-block
 * to the next. Queuing the next k-block's quarter 0 there too (the PIPE loop's way) made ptxas
 * serialize every wgmma of the kernel (C7514), in every loop shape tried; the other
 * warpgroup's MMAs cover that one quarter's promotion. */
template <int NQ, int STAGES, int SB>
__device__ __forceinline__ void quarters_tile(float *d, float *acc, float *acc2,
                                              const uint8_t *smem, uint64_t *full,
                                              uint64_t *empty, int &it, int nk, int c, int lane,
                                              int r_lo, int scl_off, int scl_bytes) {
    for (int kt = 0; kt < nk; kt++, it++) {
        const int s = it % STAGES;
        issue_quarter<STAGES, SB, 1>(acc, smem, full, it, c, 0);
        const float *sc = (const float *)(smem + scl_off + s * scl_bytes);
        const float a0 = sc[64 * c + r_lo], a1 = sc[64 * c + r_lo + 8];
#pragma unroll
        for (int q = 0; q + 1 < NQ; q++) { /* the next quarter is queued first */
            issue_quarter<STAGES, SB, 0>(q % 2 ? acc : acc2, smem, full, it, c, q + 1);
            wgmma_wait<1>();
            promote_quarter(d, q % 2 ? acc2 : acc, sc, q, lane, a0, a1);
        }
        wgmma_wait<0>();
        /* the stage is given back once the last promotion has read its column scales from
         * the stage's slot */
        promote_quarter(d, acc2, sc, NQ - 1, lane, a0, a1);
        if (lane == 0)
            mbar_arrive(&empty[s]); /* (an asm with a memory clobber: the reads stay before it) */
    }
}

/* C32: fp32 output, else bf16 (stored). ORDERED: as the forward kernel. PIPE: 1 = two
 * accumulator sets, k-block j + 1's MMAs run while j is promoted (the default); 0 = the
 * first loop, each k-block's MMAs waited for before its promotion (MOE_FP8_WGRAD_PIPE=0).
 * SS: 1 = each k-block's scales brought into shared memory with its stage by the producer
 * (the default); 0 = the consumers load them from global memory (MOE_FP8_WGRAD_SCALES=global) */
template <int C32, int ORDERED, int PIPE, int SS, int WIDE = 0, int DIRECT = 0>
__global__ void __launch_bounds__(THREADS, 1)
    fp8_wgrad_kernel(const __grid_constant__ CUtensorMap map_a,
                     const __grid_constant__ CUtensorMap map_b,
                     const __grid_constant__ CUtensorMap map_c, const Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    typedef Ring<SS, WIDE> R;
    constexpr int STAGES = R::STAGES, TN = R::TN;
    static_assert(!DIRECT || (C32 && WIDE), "the direct epilogue: fp32 dW, the wide tile");
    static_assert(DIRECT >= 0 && DIRECT <= 3, "DIRECT: 0 staged, 1 direct, 2 rmw, 3 auto");
    extern __shared__ __align__(1024) uint8_t smem[];
    if (threadIdx.x == 0 && (smem_u32(smem) & 1023))
        __trap();
    __shared__ uint64_t full[STAGES], empty[STAGES];
    __shared__ int s_pb[MAX_G + 1]; /* padded k-block start of each group, and the end */

    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 8);
        }
        mbar_init_fence();
    }
    moe_wgrad_block_prefix(s_pb, p.off, p.G); /* (ends with __syncthreads) */
    /* (WIDE: a tile's second 128 columns may lie past N = 256·k + 128) */
    const int ntm = p.M / BM, ntn = WIDE ? (p.N + TN - 1) / TN : p.N / BN;
    const int per_g = ntm * ntn, tiles = p.G * per_g;
    /* tile t: group t / per_g, then its (m, n) block of dW_g in bands of BAND m-tiles, m
     * fastest inside a band (the bf16 wgrad's order, moe_tile_band_place). Why: walked with n
     * fastest, the CTAs running at once covered all of dW_g's n-tiles for only a couple of
     * m-tiles, so each pass over the m-tiles re-read B (Xᵀ's codes, N × the group's tokens)
     * from DRAM wherever B does not stay in L2: on Mixtral's fc2 (N = 14336, 29 MB of codes
     * per expert) the wgrad read 4.2 GB of operands for 0.3 GB of them and ran at fc1's rate
     * × 0.75. In bands, the CTAs of a wave share 8 m-tiles' A and about 16 n-tiles' B. */
    const auto place = [&](int t, int &g, int &m0, int &n0) {
        int mi, ni;
        g = t / per_g;
        moe_tile_band_place(t % per_g, ntm, ntn, BAND, &mi, &ni);
        m0 = mi * BM;
        n0 = ni * TN;
    };

    if (wg == 2) { /* ------------------------------------------------ producer */
        /* the whole warpgroup; one lane issues the loads */
        setmaxnreg_dec<WIDE ? PRODUCER_REGS_W : PRODUCER_REGS>();
        if (tid == 0) {
            int it = 0;
            for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
                int g, m0, n0;
                place(t, g, m0, n0);
                const int kb0 = s_pb[g], nk = s_pb[g + 1] - kb0;
                /* B boxes of 128 rows (columns of dW) the tile holds: 1, or 2 when WIDE and
                 * its second half holds some of N (else neither loaded nor its scales) */
                const int nb = WIDE && n0 + BN < p.N ? 2 : 1;
                for (int kt = 0; kt < nk; kt++, it++) {
                    const int s = it % STAGES, phase = (it / STAGES) & 1;
                    if (C32 && SS && p.prefetch && /* (SS = 0, the old path, has no room) */
                        kt == (nk > WGRAD_PREFETCH_LEAD ? nk - WGRAD_PREFETCH_LEAD : 0))
                        prefetch_dw_tile<BM>(&map_c, n0, m0, g, nb * BN, p.N);
                    mbar_wait(&empty[s], phase ^ 1);
                    uint8_t *a = smem + s * R::SB, *b = a + A_BYTES;
                    mbar_expect_tx(&full[s],
                                   A_BYTES + nb * B_BYTES + (SS ? (BM + nb * BN) * 4 : 0));
                    const int k = (kb0 + kt) * BK;
                    tma_load_2d(a, &map_a, &full[s], k, m0);
                    tma_load_2d(a + A_BYTES / 2, &map_a, &full[s], k, m0 + BM / 2);
                    tma_load_2d(b, &map_b, &full[s], k, n0);
                    if (WIDE && nb == 2)
                        tma_load_2d(b + B_BYTES, &map_b, &full[s], k, n0 + BN);
                    if constexpr (SS) { /* the k-block's scale rows: 512 contiguous bytes each
                                         * (block-major scales, m0, n0 multiples of 128), sb's
                                         * 1 KB when WIDE and nb = 2 */
                        float *sc = (float *)(smem + R::SCL_OFF + s * R::SCL);
                        const unsigned kb = kb0 + kt; /* 32-bit: the host checked it fits */
                        bulk_load_1d(sc, p.sa + (kb * p.M + m0), BM * 4, &full[s]);
                        bulk_load_1d(sc + BM, p.sb + (kb * p.N + n0), nb * BN * 4, &full[s]);
                    }
                }
            }
        }
        return;
    }

    /* ---------------------------------------------------- consumers */
    setmaxnreg_inc<WIDE ? CONSUMER_REGS_W : CONSUMER_REGS>();
    const int c = wg, warp = tid / 32, lane = tid % 32;
    const int r_lo = warp * 16 + lane / 4;
    int it = 0;
    /* main accumulators (64 rows × TN), the k-block's wgmma ones (64 × 128) */
    float d[TN / 2], acc[BN / 2], acc2[PIPE ? BN / 2 : WIDE == 2 ? 32 : 1];
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        int g, m0, n0;
        place(t, g, m0, n0);
        const int kb0 = s_pb[g], nk = s_pb[g + 1] - kb0;
        if (nk == 0 && p.accumulate)
            continue; /* an empty group adds nothing (the producer skipped it too) */
        const int m_wg = m0 + 64 * c, row0 = m_wg + r_lo, row1 = row0 + 8;
#pragma unroll
        for (int i = 0; i < TN / 2; i++)
            d[i] = 0.0f;
        const int two = WIDE && n0 + BN < p.N; /* as the producer's nb = 2 */
        if constexpr (WIDE == 2) { /* ------------- 128 × 256 by quarters, two accumulator sets */
            /* (acc is 64 registers, acc2 32 here: a quarter's accumulators are 32) */
            if (nk > 0) {
                if (two)
                    quarters_tile<4, STAGES, R::SB>(d, acc, acc2, smem, full, empty, it, nk, c,
                                                    lane, r_lo, R::SCL_OFF, R::SCL);
                else
                    quarters_tile<2, STAGES, R::SB>(d, acc, acc2, smem, full, empty, it, nk, c,
                                                    lane, r_lo, R::SCL_OFF, R::SCL);
            }
        } else if constexpr (WIDE) { /* ----------- 128 × 256: the split promotion, by halves */
            for (int kt = 0; kt < nk; kt++, it++) {
                const int s = it % STAGES;
                const float *sc = (const float *)(smem + R::SCL_OFF + s * R::SCL);
                float a0 = 0.0f, a1 = 0.0f; /* the row scales, read once the stage is full */
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    if (h > 0 && !two)
                        break; /* past N: nothing loaded, nothing to compute */
                    issue_kblock<ORDERED, STAGES, R::SB>(acc, smem, full, it, c, h);
                    wgmma_wait<0>(); /* this half's MMAs have read the stage */
                    if (h == 0) {
                        a0 = sc[64 * c + r_lo];
                        a1 = sc[64 * c + r_lo + 8];
                    }
                    /* the half's column scales, 4 pairs at a time (8 registers, not 32: the
                     * 192 accumulators leave little room), read from the stage while it is
                     * still ours: it is given back after its last half's promotion */
                    const float *sbh = sc + BM + BN * h + 2 * (lane % 4);
#pragma unroll
                    for (int q = 0; q < BN / 32; q++) {
                        float2 sbv[4];
#pragma unroll
                        for (int j = 0; j < 4; j++)
                            sbv[j] = *(const float2 *)(sbh + 32 * q + 8 * j);
                        promote<4>(d + (BN / 2) * h + 16 * q, acc + 16 * q, a0, a1, sbv);
                    }
                }
                if (lane == 0)
                    mbar_arrive(&empty[s]); /* (an asm with a memory clobber: reads before) */
            }
        } else if constexpr (PIPE) { /* -------------------------------- two accumulator sets */
            /* the parity of a k-block must be known at compile time (registers cannot be
             * indexed), hence the loop by twos */
            /* the scales' indices: in the stage's slot (SS), else global from k-block 0 as
             * 32-bit indices (the host checks that they fit): registers are short here, a
             * 64-bit pointer costs two */
            const int ia = SS ? 64 * c + r_lo : kb0 * p.M + row0;
            const int ib = SS ? BM + 2 * (lane % 4) : kb0 * p.N + n0 + 2 * (lane % 4);
            /* acc holds the even k-blocks, acc2 the odd ones */
            if (nk > 0) {
                issue_kblock<ORDERED, STAGES>(acc, smem, full, it, c);
                for (int kt = 0;; kt += 2) { /* k-block kt in flight in acc */
                    if (kt + 1 >= nk) {
                        pipe_step<ORDERED, 0, SS>(d, acc, acc2, smem, full, empty, it, kt, c,
                                                  lane, ia, ib, p);
                        break;
                    }
                    pipe_step<ORDERED, 1, SS>(d, acc, acc2, smem, full, empty, it, kt, c, lane,
                                              ia, ib, p);
                    /* kt + 1 in flight in acc2 */
                    if (kt + 2 >= nk) {
                        pipe_step<ORDERED, 0, SS>(d, acc2, acc, smem, full, empty, it, kt + 1,
                                                  c, lane, ia, ib, p);
                        break;
                    }
                    pipe_step<ORDERED, 1, SS>(d, acc2, acc, smem, full, empty, it, kt + 1, c,
                                              lane, ia, ib, p);
                }
            }
            it += nk;
        } else if constexpr (SS) { /* ------ one accumulator set, the scales in the stage */
            for (int kt = 0; kt < nk; kt++, it++) {
                const int s = it % STAGES;
                issue_kblock<ORDERED, STAGES>(acc, smem, full, it, c);
                wgmma_wait<0>(); /* the tensor cores idle from here to the next issue */
                release_promote_smem(d, acc,
                                     (const float *)(smem + Ring<SS>::SCL_OFF + s * SCL_BYTES),
                                     &empty[s], lane, 64 * c + r_lo, BM + 2 * (lane % 4));
            }
        } else { /* ----------------------------- one accumulator set, global scales */
            /* this thread's column scales: columns n0 + 8j + 2(lane%4) + {0,1} */
            const float *sbc = p.sb + n0 + 2 * (lane % 4);
            float na0 = 0.0f, na1 = 0.0f;
            if (nk > 0) {
                na0 = __ldg(p.sa + (size_t)kb0 * p.M + row0);
                na1 = __ldg(p.sa + (size_t)kb0 * p.M + row1);
            }
            for (int kt = 0; kt < nk; kt++, it++) {
                const size_t kb = (size_t)(kb0 + kt);
                const float a0 = na0, a1 = na1;
                if (kt + 1 < nk) {
                    na0 = __ldg(p.sa + (kb + 1) * p.M + row0);
                    na1 = __ldg(p.sa + (kb + 1) * p.M + row1);
                }
                issue_kblock<ORDERED, STAGES>(acc, smem, full, it, c);
                float2 sbv[BN / 8]; /* loaded while the MMAs run */
                const float *sbk = sbc + kb * p.N;
#pragma unroll
                for (int j = 0; j < BN / 8; j++)
                    sbv[j] = __ldg((const float2 *)(sbk + 8 * j));
                wgmma_wait<0>(); /* the tensor cores idle from here to the next issue */
                if (lane == 0)
                    mbar_arrive(&empty[it % STAGES]);
                promote(d, acc, a0, a1, sbv);
            }
        }

        /* ------------------------------------------------ epilogue: whole 64-row blocks */
        const int ncols = WIDE ? (1 + two) * BN : BN; /* a half past N is not staged */
        /* DIRECT (fp32 dW): the sums leave from registers (epilogue_regs, sm90_epilogue.cuh:
         * no staging buffer, no barrier), added by L2 reductions (direct: tried because the
         * staging waits on TMA 8 times a tile; slower, STATUS above) or read, added and
         * written (rmw: the adding wgrad of short tiles is its epilogue, and TMA's reduce-adds
         * move dW at 2.0 TB/s where plain reads and writes reach 2.8; on long tiles the wait
         * for the reads costs more, hence auto) */
        float *dwb = p.dw + ((size_t)g * p.M + m_wg) * p.N + n0;
        if constexpr (DIRECT == 1 || DIRECT == 2) {
            epilogue_regs<TN, DIRECT == 2>(d, dwb, p.N, ncols, 64, tid, p.accumulate);
            continue;
        }
        if constexpr (DIRECT == 3) { /* auto: short tiles added by RMW, the rest staged */
            if (p.accumulate && nk <= RMW_MAX_KBLOCKS) {
                epilogue_regs<TN, 1>(d, dwb, p.N, ncols, 64, tid, 1);
                continue;
            }
        }
        uint8_t *cs = smem + R::C_OFF + c * R::CB;
        epilogue_staged<C32, TN, R::CB>(d, cs, c, tid, ncols, [&](const uint8_t *src, int col) {
            if (C32 && p.accumulate)
                tma_reduce_add_3d(&map_c, src, n0 + col, m_wg, g);
            else
                tma_store_3d(&map_c, src, n0 + col, m_wg, g);
            return 1;
        });
    }
    if (ORDERED && c == 0 && it > 0)
        named_bar_sync(3, 256);
    if (tid == 0)
        bulk_wait_all();
#else
    __trap();
#endif
}

long long g_bn256_calls; /* launches of the 128 × 256 kernel (the tests' proof it ran) */
long long g_direct_calls; /* launches whose fp32 sums may leave from registers: direct, rmw
                            or auto (likewise) */
long long g_quarters_calls; /* launches of the wide tile by quarters (likewise) */

template <int C32, int ORDERED, int PIPE, int SS, int WIDE = 0, int DIRECT = 0>
void launch(const CUtensorMap &ma, const CUtensorMap &mb, const CUtensorMap &mc, const Params &p,
            int tiles) {
    constexpr int SMEM_BYTES = Ring<SS, WIDE>::SMEM;
    moe_cuda_smem_opt_in<fp8_wgrad_kernel<C32, ORDERED, PIPE, SS, WIDE, DIRECT>>(SMEM_BYTES);
    const int grid = moe_cuda_persistent_grid(tiles);
    if (grid <= 0)
        return;
    fp8_wgrad_kernel<C32, ORDERED, PIPE, SS, WIDE, DIRECT>
        <<<grid, THREADS, SMEM_BYTES, moe_cuda_stream()>>>(ma, mb, mc, p);
    MOE_CUDA_LAUNCH_CHECK();
    g_bn256_calls += WIDE != 0;
    g_quarters_calls += WIDE == 2;
    g_direct_calls += DIRECT != 0;
}

int aligned16(const void *q) { return ((uintptr_t)q & 15) == 0; }

/* the variants as one index: C32, ORDERED, PIPE, SS (each 0 or 1) */
template <int V>
void launch_v(const CUtensorMap &ma, const CUtensorMap &mb, const CUtensorMap &mc,
              const Params &p, int tiles) {
    launch<(V >> 3) & 1, (V >> 2) & 1, (V >> 1) & 1, V & 1>(ma, mb, mc, p, tiles);
}

/* the 128 × 256 tile's variants: C32, ORDERED (its own loop: PIPE 0; scales in shared
 * memory: SS 1), and with fp32 output (C32) the epilogue (DIRECT: 0 staged, 1 direct, 2 rmw,
 * 3 auto) as a third: index DIRECT · 4 + C32 · 2 + ORDERED */
template <int V>
void launch_wide(const CUtensorMap &ma, const CUtensorMap &mb, const CUtensorMap &mc,
                 const Params &p, int tiles) {
    launch<(V >> 1) & 1, V & 1, 0, 1, 1, (V >> 2)>(ma, mb, mc, p, tiles);
}

/* a 0/1 switch: *cached, else the environment's @p name ("0" off, any other number on),
 * else @p dflt; read once */
int env_switch(int *cached, const char *name, int dflt) {
    if (*cached < 0) {
        const char *e = getenv(name);
        *cached = e && *e ? atoi(e) != 0 : dflt;
    }
    return *cached;
}

int g_pipe = -1; /* the loop; -1 until first used */

int pipe(void) { return env_switch(&g_pipe, "MOE_FP8_WGRAD_PIPE", MOE_FP8_WGRAD_PIPE_DEFAULT); }

int g_quarters = -1; /* the wide tile by quarters (WIDE = 2); -1 until first used */

int quarters(void) {
    return env_switch(&g_quarters, "MOE_FP8_WGRAD_QUARTERS", MOE_FP8_WGRAD_QUARTERS_DEFAULT);
}

int g_epi = -1; /* the wide tile's fp32 epilogue (moe_wgrad_epi); -1 until first used */

int epilogue(void) {
    if (g_epi < 0) { /* MOE_FP8_WGRAD_EPI, else the default; 0 and 1 (the first two
                        settings' names) still mean tma and direct */
        static const char *const names[] = {"tma", "direct", "rmw", "auto", "0", "1"};
        char help[256];
        snprintf(help, sizeof help,
                 "tma (the wide FP8 wgrad tile's fp32 sums staged through shared memory, TMA "
                 "reduce-adds), direct (from registers, L2 reductions), rmw (from registers, "
                 "read, added and written) or auto (rmw for tiles of at most %d k-blocks, else "
                 "tma)",
                 RMW_MAX_KBLOCKS);
        g_epi = moe_cuda_env_choice("MOE_FP8_WGRAD_EPI", names, 6, MOE_FP8_WGRAD_EPI_DEFAULT,
                                    help) % 4;
    }
    return g_epi;
}

int g_smem_scales = -1; /* where the consumers read the scales; -1 until first used */
long long g_smem_calls; /* launches of a shared-memory-scales variant (the tests' proof) */

int smem_scales(void) {
    if (g_smem_scales < 0) {
        const char *e = getenv("MOE_FP8_WGRAD_SCALES");
        g_smem_scales = e && *e ? strcmp(e, "global") && strcmp(e, "0") /* else smem, 1 */
                                : MOE_FP8_WGRAD_SMEM_SCALES_DEFAULT;
    }
    return g_smem_scales;
}

int g_bn = -1; /* the tile width asked for, 128 or 256; -1 until first used */

int tile_width(void) {
    if (g_bn < 0) {
        const char *e = getenv("MOE_FP8_WGRAD_BN");
        g_bn = e && *e ? (atoi(e) == 256 ? 256 : 128) : MOE_FP8_WGRAD_BN_DEFAULT;
    }
    return g_bn;
}

} /* namespace */

extern "C" moe_status moe_cuda_fp8_grouped_wgrad(void *dw, moe_dw_mode mode, const uint8_t *qa,
                                                 const float *sa, const uint8_t *qb,
                                                 const float *sb, const int *dev_off, int G,
                                                 size_t kpad, int M, int N, moe_error *err) {
    if (G < 1 || G > MOE_GROUPED_DEV_MAX_GROUPS || M <= 0 || N <= 0 || M % BM || N % BN ||
        kpad % BK)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "FP8 grouped wgrad: G=%d M=%d N=%d kpad=%zu: give 1 to %d groups "
                             "and M, N, kpad positive multiples of 128",
                             G, M, N, kpad, MOE_GROUPED_DEV_MAX_GROUPS);
    if (!dw || !qa || !sa || !qb || !sb || !dev_off || !aligned16(qa) || !aligned16(qb) ||
        !aligned16(dw) || ((uintptr_t)sb & 7))
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "FP8 grouped wgrad: a pointer is NULL or misaligned (codes and dW "
                             "16 bytes for TMA, the column scales 8)");
    if ((kpad / BK) * (size_t)(M > N ? M : N) > (size_t)INT_MAX)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "FP8 grouped wgrad: kpad=%zu with M=%d, N=%d: the scale arrays "
                             "exceed 2^31 elements (the kernel indexes them in 32 bits); "
                             "split the tokens",
                             kpad, M, N);
    if (!moe_cuda_grouped_sm90_available())
        return moe_error_set(err, MOE_ERR_BACKEND,
                             "FP8 grouped wgrad: our kernel is wgmma (sm_90a, Hopper) only; set "
                             "MOE_FP8_WGRAD=0 for the bf16 wgrad");
    const int C32 = mode != MOE_DW_ACT;
    if (kpad == 0) { /* no tokens can exist: an overwritten dW is zeros */
        if (mode != MOE_DW_ACCUMULATE)
            MOE_CUDA_CHECK(cudaMemsetAsync(dw, 0, (size_t)G * M * N * (C32 ? 4 : 2),
                                           moe_cuda_stream()));
        return MOE_OK;
    }
    const uint64_t da[2] = {(uint64_t)kpad, (uint64_t)M}, db[2] = {(uint64_t)kpad, (uint64_t)N};
    const uint64_t dc[3] = {(uint64_t)N, (uint64_t)M, (uint64_t)G};
    const uint32_t ba[2] = {BK, BM / 2}, bb[2] = {BK, BN};
    const uint32_t bc[3] = {(uint32_t)(C32 ? 32 : 64), 64, 1};
    /* the bulk copies of the scales need 16-byte aligned rows: M, N are multiples of 128,
     * so the arrays' starts decide; others take the global-memory path */
    const int ss = smem_scales() && aligned16(sa) && aligned16(sb);
    /* (the global-scales kernels do not prefetch: with it their consumers spilled) */
    const int prefetch = mode == MOE_DW_ACCUMULATE && ss && moe_cuda_wgrad_prefetch() == 1;
    const Params p = {dev_off, G, M, N, sa, sb, mode == MOE_DW_ACCUMULATE, prefetch,
                      (float *)dw};
    if (prefetch)
        moe_cuda_wgrad_prefetch_note();
    const CUtensorMap ma = moe_tma_map(qa, 2, da, ba, MOE_TMA_U8);
    const CUtensorMap mb = moe_tma_map(qb, 2, db, bb, MOE_TMA_U8);
    const CUtensorMap mc = moe_tma_map(dw, 3, dc, bc, C32 ? MOE_TMA_F32 : MOE_TMA_BF16);
    typedef void (*launcher)(const CUtensorMap &, const CUtensorMap &, const CUtensorMap &,
                             const Params &, int);
    static const launcher variants[16] = {
        launch_v<0>, launch_v<1>, launch_v<2>,  launch_v<3>,  launch_v<4>,  launch_v<5>,
        launch_v<6>, launch_v<7>, launch_v<8>,  launch_v<9>,  launch_v<10>, launch_v<11>,
        launch_v<12>, launch_v<13>, launch_v<14>, launch_v<15>};
    g_smem_calls += ss;
    /* the 128 × 256 tile has its own loop, with the scales in shared memory: asked for with
     * the global-scales path or the first loop (the 128-column comparisons), the 128 × 128
     * tile runs */
    if (ss && pipe() && tile_width() == 2 * BN) {
        /* (bf16 output, C32 = 0, has the staged epilogue only: no DIRECT > 0 with C32 = 0) */
        static const launcher wide[16] = {
            launch_wide<0>,  launch_wide<1>,  launch_wide<2>, launch_wide<3>,
            NULL,            NULL,            launch_wide<6>, launch_wide<7>,
            NULL,            NULL,            launch_wide<10>, launch_wide<11>,
            NULL,            NULL,            launch_wide<14>, launch_wide<15>};
        /* by quarters (no issue order: WIDE = 2, ORDERED = 0, the staged epilogue) */
        static const launcher by_quarters[2] = {launch<0, 0, 0, 1, 2>, launch<1, 0, 0, 1, 2>};
        const int tiles = G * (M / BM) * ((N + 2 * BN - 1) / (2 * BN));
        const int dir = C32 ? epilogue() : 0; /* (bf16 output: always staged) */
        /* the quarters kernel stages its sums: asked for, it runs unless a register epilogue
         * (direct, rmw) was asked for too; under auto (the default) its tiles are all staged */
        if (quarters() && dir != MOE_WGRAD_EPI_DIRECT && dir != MOE_WGRAD_EPI_RMW)
            by_quarters[C32](ma, mb, mc, p, tiles);
        else
            wide[dir << 2 | C32 << 1 | moe_cuda_fp8_grouped_ordered()](ma, mb, mc, p, tiles);
        return MOE_OK;
    }
    variants[C32 << 3 | moe_cuda_fp8_grouped_ordered() << 2 | pipe() << 1 | ss](
        ma, mb, mc, p, G * (M / BM) * (N / BN));
    return MOE_OK;
}

extern "C" void moe_cuda_fp8_wgrad_set_pipe(int on) { g_pipe = on != 0; }

extern "C" int moe_cuda_fp8_wgrad_pipe(void) { return pipe(); }

extern "C" void moe_cuda_fp8_wgrad_set_smem_scales(int on) { g_smem_scales = on != 0; }

extern "C" int moe_cuda_fp8_wgrad_smem_scales(void) { return smem_scales(); }

extern "C" long long moe_cuda_fp8_wgrad_smem_calls(void) { return g_smem_calls; }

extern "C" void moe_cuda_fp8_wgrad_set_bn(int bn) { g_bn = bn == 256 ? 256 : 128; }

extern "C" int moe_cuda_fp8_wgrad_bn(void) { return tile_width(); }

extern "C" long long moe_cuda_fp8_wgrad_bn256_calls(void) { return g_bn256_calls; }

extern "C" void moe_cuda_fp8_wgrad_set_quarters(int on) { g_quarters = on != 0; }

extern "C" int moe_cuda_fp8_wgrad_quarters(void) { return quarters(); }

extern "C" long long moe_cuda_fp8_wgrad_quarters_calls(void) { return g_quarters_calls; }

extern "C" void moe_cuda_fp8_wgrad_set_epilogue(moe_wgrad_epi e) {
    g_epi = e < MOE_WGRAD_EPI_TMA || e > MOE_WGRAD_EPI_AUTO ? MOE_FP8_WGRAD_EPI_DEFAULT
                                                                   : (int)e;
}

extern "C" moe_wgrad_epi moe_cuda_fp8_wgrad_epilogue(void) {
    return (moe_wgrad_epi)epilogue();
}

extern "C" long long moe_cuda_fp8_wgrad_direct_calls(void) { return g_direct_calls; }
