/*
 * Chapter 05's FP8 grouped wgrad for Hopper (lib/fp8_wgrad.h): every routed expert's weight
 * gradient dW_g = dY_gᵀ · X_g in one persistent kernel, on the token-wise FP8 copies of dY
 * and X (kernels/quantize_group_t.cu), the group offsets read from DEVICE memory (sync-free):
 *
 *   D_g[m, n] (+)= Σ_{kb in g's blocks} sa[kb][m] · sb[kb][n] · Σ_{k in kb} qa[m, k] · qb[n, k]
 *
 * A = dYᵀ's codes [M][Kpad] (M = O), B = Xᵀ's [N][Kpad] (N = I), both K-major (K = the
 * tokens), as Hopper's FP8 wgmma needs. It is the forward kernel (grouped_gemm_fp8_sm90.cu)
 * turned around, and reuses its machinery: 288 threads (2 consumer warpgroups of 64 rows + a
 * producer warp), tiles of 128 × 128, a stage = one 128-deep k-block of A (two TMA boxes of
 * 64 rows × 128 bytes) and B (one box of 128 rows), 6 stages, the same swizzled descriptors,
 * the same "promotion" of each k-block's wgmma partial into fp32 main accumulators, the same
 * ORDERED issue (named barriers 3 and 4: moe_cuda_fp8_grouped_ordered()), the same epilogue
 * (sm90_epilogue.cuh). What differs:
 *   - the tiles: the group (expert) g, then 128-row block of dW_g, then 128-column block:
 *     G · (M/128) · (N/128) tiles, each with its group's k-loop, ⌈n_g/128⌉ k-blocks from the
 *     group's padded start P_g (lib/fp8_wgrad.h), which every CTA computes from the offsets
 *     in shared memory (moe_wgrad_block_prefix, fp8_wgrad.cuh: a scan, a thread a group);
 *   - the scale of a k-block is a row scale times a COLUMN scale (a token block of dY's
 *     channel m and one of X's channel n), so the promotion multiplies each accumulator by
 *     its own sa[m]·sb[n]. A thread's 64 accumulators are rows r_lo, r_lo + 8 and columns
 *     8j + 2(l%4) + {0, 1}, j < 16 (sm90_epilogue.cuh): 2 row scales and 32 column scales
 *     per k-block. The scales are block-major ([Kpad/128][M] and [Kpad/128][N]): a
 *     thread's column scales are 16 float2 loads, one 32-byte sector per warp and load,
 *     the same sectors for every warp (L1). They are issued right after the k-block's
 *     MMAs, so their latency hides behind the MMAs the thread then waits for; the two row
 *     scales are loaded one k-block ahead, as in the forward kernel.
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
 * is done), gives j's stage back to the producer (only now: the wgmma read it until it
 * completed), and promotes j while j + 1 runs. The parity is fixed at compile time by a loop
 * by twos (registers cannot be indexed), and whether a step issues is a template argument,
 * not a runtime flag tested twice (pipe_step: otherwise ptxas serializes the wgmmas).
 * The same k-blocks are promoted in the same order with the same fmaf, so the output is bit
 * for bit the first loop's. The ORDERED issue is unchanged: each issue (now one k-block
 * ahead of its promotion) waits for the other warpgroup's previous issue.
 * Why two accumulator sets and not a wider tile (128 × 256, each consumer 64 × 256, half the
 * promotions per MMA FLOP): its 128 wgmma accumulators plus 128 sums are 256 registers, past
 * the 240 a consumer can have (below); it would also still wait before each promotion.
 * Two sets cost 64 registers more than the first loop (see the register note below).
 * Load balance is the simple one (tiles strided over the CTAs in order; a long group's
 * tiles cost more); correctness first.
 */
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>

#include "cuda_common.cuh"
#include "cuda_ops.h"
#include "fp8_wgrad.cuh"
#include "fp8_wgrad.h"
#include "sm90_epilogue.cuh"
#include "sm90_ptx.cuh"
#include "wgmma.cuh"

namespace {

constexpr int BM = 128, BN = 128, BK = MOE_QUANT_BLOCK, STAGES = 6, THREADS = 384;
[[maybe_unused]] constexpr int MAX_G = MOE_GROUPED_DEV_MAX_GROUPS;
constexpr int A_BYTES = BM * BK, B_BYTES = BN * BK, STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int C_BYTES = 16384;
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 2 * C_BYTES; /* 224 KB */
static_assert(THREADS >= MOE_GROUPED_DEV_MAX_GROUPS, "moe_wgrad_block_prefix: a thread a group");
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
static_assert(BK == 128, "a stage must be one 128-token scale block of 128 bytes");

struct Params {
    const int *off; /* [G+1] token offsets, DEVICE memory */
    int G, M, N;
    const float *sa, *sb; /* [Kpad/128][M], [Kpad/128][N] */
    int accumulate;       /* 1: reduce-add (fp32); 0: store */
};

/* one k-block's MMAs of consumer warpgroup c (issue number it: its stage and phase) into
 * acc, issued and committed, not waited for. ORDERED: the warpgroups take turns at the
 * issue (named barriers 3 and 4, as the forward kernel): warpgroup 0's first issue waits
 * for nobody, every other waits for the other warpgroup's previous issue */
template <int ORDERED>
__device__ __forceinline__ void issue_kblock(float *acc, const uint8_t *smem, uint64_t *full,
                                             int it, int c) {
    const int s = it % STAGES, phase = (it / STAGES) & 1;
    mbar_wait(&full[s], phase);
    const uint8_t *a = smem + s * STAGE_BYTES + c * (A_BYTES / 2);
    const uint8_t *b = smem + s * STAGE_BYTES + A_BYTES;
    if (ORDERED && (c == 1 || it > 0))
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

/* one step of the pipelined loop: k-block kt's MMAs were issued into cur. MORE (a k-block
 * follows): issue kt + 1's into nxt, then wait until only that group is outstanding (kt
 * done); else wait for all. Then give kt's stage back to the producer and promote cur,
 * while kt + 1 runs on the tensor cores. MORE is a template argument, not a flag tested
 * twice: ptxas tracks which accumulators an in-flight wgmma owns along each path, and two
 * tests of one runtime flag (issue if more, wait<1> if more) give it a path where nxt's
 * group is still running at the loop's exit; it then serializes every wgmma (C7514) and
 * injects a wait (C7517). it0: the issue number of the tile's k-block 0 */
template <int ORDERED, int MORE>
__device__ __forceinline__ void pipe_step(float *d, float *cur, float *nxt, const uint8_t *smem,
                                          uint64_t *full, uint64_t *empty, int it0, int kt,
                                          int c, int lane, int ia, int ib, const Params &p) {
    if (MORE)
        issue_kblock<ORDERED>(nxt, smem, full, it0 + kt + 1, c);
    /* kt's row scales: their latency hides behind the wait. Its column scales are loaded
     * after it: 32 more registers live across the wait spill (ptxas -v), and a spilled
     * accumulator serializes the wgmmas (C7514); their latency hides behind kt + 1's MMAs */
    const float *sak = p.sa + (unsigned)(ia + kt * p.M);
    const float a0 = __ldg(sak), a1 = __ldg(sak + 8);
    if (MORE)
        wgmma_wait<1>(); /* all but kt + 1's group: kt's MMAs have read their stage */
    else
        wgmma_wait<0>();
    if (lane == 0)
        mbar_arrive(&empty[(it0 + kt) % STAGES]);
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

/* C32: fp32 output, else bf16 (stored). ORDERED: as the forward kernel. PIPE: 1 = two
 * accumulator sets, k-block j + 1's MMAs run while j is promoted (the default); 0 = the
 * first loop, each k-block's MMAs waited for before its promotion (MOE_FP8_WGRAD_PIPE=0) */
template <int C32, int ORDERED, int PIPE>
__global__ void __launch_bounds__(THREADS, 1)
    fp8_wgrad_kernel(const __grid_constant__ CUtensorMap map_a,
                     const __grid_constant__ CUtensorMap map_b,
                     const __grid_constant__ CUtensorMap map_c, const Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
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
    const int ntm = p.M / BM, ntn = p.N / BN, per_g = ntm * ntn, tiles = p.G * per_g;

    if (wg == 2) { /* ------------------------------------------------ producer */
        setmaxnreg_dec<PRODUCER_REGS>(); /* the whole warpgroup; one lane issues the loads */
        if (tid == 0) {
            int it = 0;
            for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
                const int g = t / per_g, r = t % per_g, m0 = (r / ntn) * BM, n0 = (r % ntn) * BN;
                const int kb0 = s_pb[g], nk = s_pb[g + 1] - kb0;
                for (int kt = 0; kt < nk; kt++, it++) {
                    const int s = it % STAGES, phase = (it / STAGES) & 1;
                    mbar_wait(&empty[s], phase ^ 1);
                    uint8_t *a = smem + s * STAGE_BYTES, *b = a + A_BYTES;
                    mbar_expect_tx(&full[s], STAGE_BYTES);
                    const int k = (kb0 + kt) * BK;
                    tma_load_2d(a, &map_a, &full[s], k, m0);
                    tma_load_2d(a + A_BYTES / 2, &map_a, &full[s], k, m0 + BM / 2);
                    tma_load_2d(b, &map_b, &full[s], k, n0);
                }
            }
        }
        return;
    }

    /* ---------------------------------------------------- consumers */
    setmaxnreg_inc<CONSUMER_REGS>();
    const int c = wg, warp = tid / 32, lane = tid % 32;
    const int r_lo = warp * 16 + lane / 4;
    int it = 0;
    float d[BN / 2], acc[BN / 2], acc2[PIPE ? BN / 2 : 1];
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        const int g = t / per_g, r = t % per_g, m0 = (r / ntn) * BM, n0 = (r % ntn) * BN;
        const int kb0 = s_pb[g], nk = s_pb[g + 1] - kb0;
        if (nk == 0 && p.accumulate)
            continue; /* an empty group adds nothing (the producer skipped it too) */
        const int m_wg = m0 + 64 * c, row0 = m_wg + r_lo, row1 = row0 + 8;
        /* this thread's column scales: columns n0 + 8j + 2(lane%4) + {0,1} */
        const float *sbc = p.sb + n0 + 2 * (lane % 4);
#pragma unroll
        for (int i = 0; i < BN / 2; i++)
            d[i] = 0.0f;
        if constexpr (PIPE) { /* -------------------------------- two accumulator sets */
            /* the parity of a k-block must be known at compile time (registers cannot be
             * indexed), hence the loop by twos */
            /* the scales as 32-bit indices from k-block 0 (the host checks that they fit):
             * registers are short here, a 64-bit pointer costs two */
            const int ia = kb0 * p.M + row0, ib = kb0 * p.N + n0 + 2 * (lane % 4);
            /* acc holds the even k-blocks, acc2 the odd ones */
            if (nk > 0) {
                issue_kblock<ORDERED>(acc, smem, full, it, c);
                for (int kt = 0;; kt += 2) { /* k-block kt in flight in acc */
                    if (kt + 1 >= nk) {
                        pipe_step<ORDERED, 0>(d, acc, acc2, smem, full, empty, it, kt, c, lane,
                                              ia, ib, p);
                        break;
                    }
                    pipe_step<ORDERED, 1>(d, acc, acc2, smem, full, empty, it, kt, c, lane, ia,
                                          ib, p);
                    /* kt + 1 in flight in acc2 */
                    if (kt + 2 >= nk) {
                        pipe_step<ORDERED, 0>(d, acc2, acc, smem, full, empty, it, kt + 1, c,
                                              lane, ia, ib, p);
                        break;
                    }
                    pipe_step<ORDERED, 1>(d, acc2, acc, smem, full, empty, it, kt + 1, c, lane,
                                          ia, ib, p);
                }
            }
            it += nk;
        } else { /* ---------- one accumulator set: the first loop, kept to compare */
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
                issue_kblock<ORDERED>(acc, smem, full, it, c);
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
        uint8_t *cs = smem + STAGES * STAGE_BYTES + c * C_BYTES;
        epilogue_staged<C32, BN, C_BYTES>(d, cs, c, tid, BN, [&](const uint8_t *src, int col) {
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

template <int C32, int ORDERED, int PIPE>
void launch(const CUtensorMap &ma, const CUtensorMap &mb, const CUtensorMap &mc, const Params &p,
            int tiles) {
    static bool configured = false;
    if (!configured) {
        MOE_CUDA_CHECK(cudaFuncSetAttribute(fp8_wgrad_kernel<C32, ORDERED, PIPE>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            SMEM_BYTES));
        configured = true;
    }
    const int grid = tiles < moe_sm90_num_sms() ? tiles : moe_sm90_num_sms();
    if (grid <= 0)
        return;
    fp8_wgrad_kernel<C32, ORDERED, PIPE><<<grid, THREADS, SMEM_BYTES, moe_cuda_stream()>>>(ma, mb, mc, p);
    MOE_CUDA_LAUNCH_CHECK();
}

int aligned16(const void *q) { return ((uintptr_t)q & 15) == 0; }

/* the variants as one index: C32, ORDERED, PIPE (each 0 or 1) */
template <int V>
void launch_v(const CUtensorMap &ma, const CUtensorMap &mb, const CUtensorMap &mc,
              const Params &p, int tiles) {
    launch<(V >> 2) & 1, (V >> 1) & 1, V & 1>(ma, mb, mc, p, tiles);
}

int g_pipe = -1; /* the loop; -1 until first used */

int pipe(void) {
    if (g_pipe < 0) {
        const char *e = getenv("MOE_FP8_WGRAD_PIPE");
        g_pipe = e && *e ? atoi(e) != 0 : MOE_FP8_WGRAD_PIPE_DEFAULT;
    }
    return g_pipe;
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
    const Params p = {dev_off, G, M, N, sa, sb, mode == MOE_DW_ACCUMULATE};
    const CUtensorMap ma = moe_tma_map(qa, 2, da, ba, MOE_TMA_U8);
    const CUtensorMap mb = moe_tma_map(qb, 2, db, bb, MOE_TMA_U8);
    const CUtensorMap mc = moe_tma_map(dw, 3, dc, bc, C32 ? MOE_TMA_F32 : MOE_TMA_BF16);
    const int tiles = G * (M / BM) * (N / BN);
    typedef void (*launcher)(const CUtensorMap &, const CUtensorMap &, const CUtensorMap &,
                             const Params &, int);
    static const launcher variants[8] = {launch_v<0>, launch_v<1>, launch_v<2>, launch_v<3>,
                                         launch_v<4>, launch_v<5>, launch_v<6>, launch_v<7>};
    variants[C32 << 2 | moe_cuda_fp8_grouped_ordered() << 1 | pipe()](ma, mb, mc, p, tiles);
    return MOE_OK;
}

extern "C" void moe_cuda_fp8_wgrad_set_pipe(int on) { g_pipe = on != 0; }

extern "C" int moe_cuda_fp8_wgrad_pipe(void) { return pipe(); }
