/*
 * v3 — TMA + an mbarrier pipeline: loads overlap the math.
 *
 * What it adds over v2:
 *   - TMA. The Tensor Memory Accelerator copies a whole box of a tensor (here 128 rows ×
 *     64 k of in, 256 rows × 64 k of w_g) from global to shared memory on ONE thread's
 *     command, writing the 128-byte swizzled layout itself (the tensor map says so) and
 *     filling zeros outside the tensor. No thread spends registers or instructions on
 *     loads any more. Weights go through a 3-D map [G, O, I], so a tile running past O
 *     gets zeros, not the next expert's rows.
 *   - A STAGES-deep ring of shared-memory buffers and two mbarriers per stage. A
 *     producer warp (one thread of it) runs ahead: it waits until stage s is "empty",
 *     announces the bytes to expect on its "full" barrier and issues the TMA loads; the
 *     barrier's phase completes when the bytes have landed. The consumers wait for
 *     "full", run their wgmma, and hand the stage back ("empty") once the MMAs reading it
 *     are done. With 4 stages, up to 3 k-steps of loads are in flight while the tensor
 *     cores work on the fourth: memory latency is hidden.
 *   - Warp specialisation and a bigger tile: 2 consumer warpgroups (each 64 rows × 256
 *     columns, m64n256k16, 128 fp32 accumulators per thread) + 1 producer warp = 288
 *     threads; the 128 × 256 tile reads each loaded byte for twice the math of v2's
 *     64 × 128, halving shared-memory traffic per FLOP.
 *   - wgmma stays asynchronous: a consumer commits a k-step's 4 MMAs and waits only
 *     until the PREVIOUS k-step's are done (wgmma_wait<1>), then releases that stage —
 *     one group of MMAs is always queued on the tensor cores.
 *
 * Kept from v2: one CTA per tile of an upper bound (the tile → group rule of
 * lib/moe/tile_schedule.h), rows past the group's end loaded (they are the next group's,
 * or TMA's zeros past the tensor) but not stored, the epilogue straight from registers.
 *
 * What is left for v4 (the library's kernel, kernels/grouped_gemm_sm90.cu): here each
 * CTA runs one tile and ends; its epilogue (128 × 256 bf16 written from registers) and
 * its pipeline's fill and drain are not overlapped with any math, and with 192 KB of
 * shared memory only one CTA fits an SM. v4 is persistent (one CTA per SM walks many
 * tiles, the next tile's loads start while this one's epilogue runs) and writes its
 * output through shared memory and TMA stores.
 */
namespace v3 {

constexpr int BM = 128, BN = 256, BK = 64; /* tile; k-step = one 128-byte swizzle row */
constexpr int STAGES = 4;
constexpr int THREADS = 288; /* warps 0-7: 2 consumer warpgroups; warp 8: the producer */
constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES; /* 192 KB */
constexpr int BAND = 8;

__global__ void __launch_bounds__(THREADS, 1)
    kernel(const __grid_constant__ CUtensorMap map_in, const __grid_constant__ CUtensorMap map_w,
           moe_bf16 *out, const int *off, int G, int I, int O) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(1024) uint8_t smem[];
    __shared__ uint64_t full[STAGES], empty[STAGES];
    __shared__ int s_off[MOE_GROUPED_DEV_MAX_GROUPS + 1], s_mt[MOE_GROUPED_DEV_MAX_GROUPS + 1];
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(&full[s], 1);  /* the producer's expect_tx arrival (+ the bytes) */
            mbar_init(&empty[s], 8); /* one arrival per consumer warp */
        }
        mbar_init_fence();
    }
    moe_tile t; /* (its __syncthreads also publishes the barriers' initialisation) */
    if (!ladder::find_tile<BM, BN, BAND>(&t, off, G, O, s_off, s_mt))
        return;
    const int nk = (I + BK - 1) / BK;
    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;

    if (wg == 2) { /* ------------------------------------------------ producer */
        if (tid == 0)
            for (int kt = 0; kt < nk; kt++) {
                const int s = kt % STAGES, phase = (kt / STAGES) & 1;
                /* wait for the consumers to free the stage (the first round passes: a
                 * fresh barrier counts its "previous" phase as complete) */
                mbar_wait(&empty[s], phase ^ 1);
                mbar_expect_tx(&full[s], STAGE_BYTES);
                uint8_t *a = smem + s * STAGE_BYTES, *b = a + A_BYTES;
                tma_load_2d(a, &map_in, &full[s], kt * BK, t.m0);      /* in[m0.., k..] */
                tma_load_3d(b, &map_w, &full[s], kt * BK, t.n0, t.g); /* w[g, n0.., k..] */
            }
        return;
    }

    /* ---------------------------------------------------- consumers: warpgroup wg owns
     * rows 64·wg .. 64·wg + 63 of the tile (the A tile's second 8 KB for wg = 1) */
    const int lane = tid % 32;
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; i++)
        d[i] = 0.0f;
    for (int kt = 0; kt < nk; kt++) {
        const int s = kt % STAGES, phase = (kt / STAGES) & 1;
        mbar_wait(&full[s], phase); /* the stage's bytes have landed */
        const uint8_t *a = smem + s * STAGE_BYTES + wg * (A_BYTES / 2), *b = smem + s * STAGE_BYTES + A_BYTES;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++)
            moe_wgmma<BN, 0, 0>::mma(d, desc(a + kk * 32, 16, 1024), desc(b + kk * 32, 16, 1024), 1);
        wgmma_commit();
        wgmma_wait<1>(); /* the previous k-step's MMAs are done: release its stage */
        if (kt > 0 && lane == 0)
            mbar_arrive(&empty[(kt - 1) % STAGES]);
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < BN / 2; i++)
        reg_fence(d[i]);
    ladder::store_accumulators<BN>(out, d, t.m0 + wg * 64, t.n0, t.r1, O);
#else
    __trap(); /* sm_90a only: main() runs it on Hopper only */
#endif
}

static void forward(moe_bf16 *out, const moe_bf16 *in, const moe_bf16 *w, const int *dev_off,
                    int G, int rows, int I, int O) {
    static bool configured = false;
    if (!configured) {
        MOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            SMEM_BYTES));
        configured = true;
    }
    /* in [rows, I] in boxes of 64 k × 128 rows; w [G, O, I] in boxes of 64 k × 256 rows */
    const uint64_t din[2] = {(uint64_t)I, (uint64_t)rows}, dw[3] = {(uint64_t)I, (uint64_t)O, (uint64_t)G};
    const uint32_t bin[2] = {BK, BM}, bw[3] = {BK, BN, 1};
    const unsigned blocks = (moe_cdiv(rows, BM) + G) * moe_cdiv(O, BN);
    kernel<<<blocks, THREADS, SMEM_BYTES, moe_cuda_stream()>>>(
        moe_tma_map(in, 2, din, bin), moe_tma_map(w, 3, dw, bw), out, dev_off, G, I, O);
    MOE_CUDA_LAUNCH_CHECK();
}

} /* namespace v3 */
