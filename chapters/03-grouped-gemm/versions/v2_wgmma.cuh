/*
 * v2 — wgmma: the same tiles, the math on the tensor cores.
 *
 * What it adds over v1: Hopper's warpgroup MMA. One instruction, wgmma.mma_async
 * m64n128k16, has the 4 warps of a warpgroup (128 threads) compute a 64 × 128 block of
 * D += A·B over k = 16 — 131072 multiply-adds, read straight from shared memory through
 * two 64-bit "matrix descriptors" (kernels/sm90_ptx.cuh: desc) and accumulated in fp32
 * registers spread over the warpgroup (64 per thread). A CTA is one warpgroup and one
 * 64 × 128 tile; per k-step of BK = 64 (128 bytes of bf16 per row) it
 *
 *   1. fills shared memory with the A slice in[m0.., k0..k0+63] and the B slice
 *      w_g[n0.., k0..k0+63], 16 bytes per thread per access, in the 128-byte SWIZZLED
 *      layout wgmma expects (moe_swizzle128: chunk c of row r goes to chunk c XOR (r mod 8),
 *      so 8 rows read at one column hit 8 different bank groups);
 *   2. fences (the threads' writes must be visible to wgmma, which reads shared memory
 *      through the "async proxy"), syncs, and issues 4 wgmma (k = 0, 16, 32, 48: the
 *      descriptor's start moves 32 bytes) — then waits for them before the next fill.
 *
 * The tile → group mapping, the masking of rows past the group's end and of columns past
 * O, and the one launch with an upper bound of tiles are v1's. The epilogue stores the
 * fp32 accumulators as bf16 straight from registers (common.cuh: store_accumulators, which
 * also says which thread holds which outputs).
 *
 * Why it is faster: the tensor cores do ~15× the math of the CUDA cores. Why it is still
 * far from the ceiling: nothing overlaps — while the threads load a slice, the tensor
 * cores idle, and while the tensor cores run, no load is in flight. The loads also cost
 * registers and instructions of the very threads that should issue MMAs. v3 moves the
 * loads to the TMA engine and overlaps them with the math.
 */
namespace v2 {

constexpr int BM = 64, BN = 128, BK = 64; /* one m64n128 wgmma per k16; BK = 128 bytes */
constexpr int THREADS = 128;              /* one warpgroup */
constexpr int BAND = 8;

__global__ void __launch_bounds__(THREADS) kernel(moe_bf16 *out, const moe_bf16 *in,
                                                  const moe_bf16 *w, const int *off, int G,
                                                  int I, int O) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __shared__ int s_off[MOE_GROUPED_DEV_MAX_GROUPS + 1], s_mt[MOE_GROUPED_DEV_MAX_GROUPS + 1];
    /* swizzled tiles start on a 1024-byte boundary (the swizzle repeats every 8 rows) */
    __shared__ __align__(1024) uint8_t sa[BM * BK * 2];
    __shared__ __align__(1024) uint8_t sb[BN * BK * 2];
    moe_tile t;
    if (!ladder::find_tile<BM, BN, BAND>(&t, off, G, O, s_off, s_mt))
        return;
    const moe_bf16 *wg = w + (size_t)t.g * O * I;
    const int tid = threadIdx.x;

    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; i++)
        d[i] = 0.0f;
    for (int k0 = 0; k0 < I; k0 += BK) {
        /* 1. fill: each row is 8 chunks of 16 bytes (8 bf16); I % 8 == 0, so a chunk is
         *    either wholly inside the row or wholly past its end */
        for (int c = tid; c < BM * 8; c += THREADS) {
            const int row = c / 8, ch = c % 8, r = t.m0 + row, k = k0 + ch * 8;
            const uint4 v = r < t.r1 && k < I ? *(const uint4 *)(in + (size_t)r * I + k)
                                              : make_uint4(0, 0, 0, 0);
            *(uint4 *)(sa + moe_swizzle128(row, ch)) = v;
        }
        for (int c = tid; c < BN * 8; c += THREADS) {
            const int row = c / 8, ch = c % 8, n = t.n0 + row, k = k0 + ch * 8;
            const uint4 v = n < O && k < I ? *(const uint4 *)(wg + (size_t)n * I + k)
                                           : make_uint4(0, 0, 0, 0);
            *(uint4 *)(sb + moe_swizzle128(row, ch)) = v;
        }
        fence_proxy_async(); /* our writes -> visible to wgmma's reads */
        __syncthreads();
        /* 2. the math: 4 × (m64 n128 k16), A and B both K-major */
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++)
            moe_wgmma<BN, 0, 0>::mma(d, desc(sa + kk * 32, 16, 1024), desc(sb + kk * 32, 16, 1024), 1);
        wgmma_commit();
        wgmma_wait<0>();
        __syncthreads(); /* every warp's MMAs are done reading before the next fill */
    }
#pragma unroll
    for (int i = 0; i < BN / 2; i++)
        reg_fence(d[i]);
    ladder::store_accumulators<BN>(out, d, t.m0, t.n0, t.r1, O);
#else
    __trap(); /* sm_90a only: main() runs it on Hopper only */
#endif
}

static void forward(moe_bf16 *out, const moe_bf16 *in, const moe_bf16 *w, const int *dev_off,
                    int G, int rows, int I, int O) {
    const unsigned blocks = (moe_cdiv(rows, BM) + G) * moe_cdiv(O, BN);
    kernel<<<blocks, THREADS, 0, moe_cuda_stream()>>>(out, in, w, dev_off, G, I, O);
    MOE_CUDA_LAUNCH_CHECK();
}

} /* namespace v2 */
