/*
 * v1 — SIMT: the grouped GEMM on plain CUDA cores, offsets read from device memory.
 *
 *   out[r, o] = Σ_i in[r, i] · w[g, o, i]   for every row r of group g (rows [off[g], off[g+1]))
 *
 * What it adds over chapter 01's loop of cuBLAS calls: ONE launch for all G experts, and
 * no host sync — the host never learns the group sizes. It launches an upper bound of
 * tiles (each group wastes at most one partial m-tile, so ceil(rows / BM) + G m-tiles
 * always suffice); each block reads off[] into shared memory, prefix-sums the m-tiles and
 * finds its own tile (group, first row, first column) by binary search: the rule of
 * lib/moe/tile_schedule.h, the same the library's kernel runs (common.cuh: find_tile).
 * Blocks past the last tile return at once.
 *
 * The GEMM itself is the textbook shared-memory tiling: a block of 16 × 16 threads owns a
 * 64 × 64 output tile; per k-step of 16 it stages a 64 × 16 slice of in and of w_g in
 * shared memory (as fp32; one padding column keeps the transposing stores free of bank
 * conflicts), and each thread accumulates a 4 × 4 block of outputs in registers, reading
 * 4 + 4 values from shared memory per 16 FMAs. Rows past the group's end and columns
 * past O are loaded as zeros and not stored.
 *
 * Why it is slow: every multiply-add is one FMA instruction on a CUDA core, and an H100
 * has 60-70 TFLOP/s of those in fp32 at best (this kernel reaches a fraction of it) against
 * ~1000 TFLOP/s of bf16 tensor-core math. v2 moves the math to the tensor cores.
 */
namespace v1 {

constexpr int BM = 64, BN = 64, BK = 16; /* output tile, k-step */
constexpr int TM = 4, TN = 4;            /* outputs per thread: a 4 × 4 block */
constexpr int THREADS = (BM / TM) * (BN / TN); /* 256 */
constexpr int BAND = 8;                  /* m-tiles per band (tile_schedule.h) */

__global__ void __launch_bounds__(THREADS) kernel(moe_bf16 *out, const moe_bf16 *in,
                                                  const moe_bf16 *w, const int *off, int G,
                                                  int I, int O) {
    __shared__ int s_off[MOE_GROUPED_DEV_MAX_GROUPS + 1], s_mt[MOE_GROUPED_DEV_MAX_GROUPS + 1];
    __shared__ float As[BK][BM + 1], Bs[BK][BN + 1]; /* [k][row]: the inner loop reads rows */
    moe_tile t;
    if (!ladder::find_tile<BM, BN, BAND>(&t, off, G, O, s_off, s_mt))
        return; /* past the last tile: the whole block leaves */
    const moe_bf16 *wg = w + (size_t)t.g * O * I;
    const int tx = threadIdx.x % (BN / TN), ty = threadIdx.x / (BN / TN);

    float acc[TM][TN] = {};
    for (int k0 = 0; k0 < I; k0 += BK) {
        /* stage in[m0 .. m0+63, k0 .. k0+15] and w_g[n0 .. n0+63, k0 .. k0+15]: consecutive
         * threads read consecutive k of a row (coalesced in 32-byte pieces) */
        for (int e = threadIdx.x; e < BM * BK; e += THREADS) {
            const int row = e / BK, k = e % BK, r = t.m0 + row, n = t.n0 + row, kk = k0 + k;
            As[k][row] = r < t.r1 && kk < I ? __bfloat162float(in[(size_t)r * I + kk]) : 0.0f;
            Bs[k][row] = n < O && kk < I ? __bfloat162float(wg[(size_t)n * I + kk]) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BK; k++) {
            float a[TM], b[TN];
#pragma unroll
            for (int i = 0; i < TM; i++)
                a[i] = As[k][ty * TM + i];
#pragma unroll
            for (int j = 0; j < TN; j++)
                b[j] = Bs[k][tx * TN + j];
#pragma unroll
            for (int i = 0; i < TM; i++)
#pragma unroll
                for (int j = 0; j < TN; j++)
                    acc[i][j] += a[i] * b[j];
        }
        __syncthreads(); /* everyone is done with this slice before the next overwrites it */
    }
#pragma unroll
    for (int i = 0; i < TM; i++) {
        const int r = t.m0 + ty * TM + i;
#pragma unroll
        for (int j = 0; j < TN; j++) {
            const int n = t.n0 + tx * TN + j;
            if (r < t.r1 && n < O)
                out[(size_t)r * O + n] = __float2bfloat16(acc[i][j]);
        }
    }
}

/* one block per tile of an upper bound: ceil(rows / BM) + G m-tiles × ceil(O / BN) */
static void forward(moe_bf16 *out, const moe_bf16 *in, const moe_bf16 *w, const int *dev_off,
                    int G, int rows, int I, int O) {
    const unsigned blocks = (moe_cdiv(rows, BM) + G) * moe_cdiv(O, BN);
    kernel<<<blocks, THREADS, 0, moe_cuda_stream()>>>(out, in, w, dev_off, G, I, O);
    MOE_CUDA_LAUNCH_CHECK();
}

} /* namespace v1 */
