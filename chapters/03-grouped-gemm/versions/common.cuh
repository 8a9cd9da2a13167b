/*
 * What the ladder's versions share: finding a block's tile from the offsets in device
 * memory (v1-v3), and storing a warpgroup's wgmma accumulators (v2, v3).
 */
namespace ladder {

/* Every thread of the block calls this. It copies the G + 1 offsets into shared memory
 * (s_off, s_mt: [G+1] each), prefix-sums the m-tiles and finds the block's tile with the
 * rule of lib/moe/tile_schedule.h (tile index = blockIdx.x). Returns false for a block past
 * the last tile — the same answer for every thread, so the whole block can return. */
template <int BM, int BN, int BAND>
__device__ __forceinline__ bool find_tile(moe_tile *t, const int *off, int G, int O, int *s_off,
                                          int *s_mt) {
    for (int g = threadIdx.x; g <= G; g += blockDim.x)
        s_off[g] = off[g];
    __syncthreads();
    if (threadIdx.x == 0)
        moe_tile_prefix_rule(s_mt, s_off, G, BM);
    __syncthreads();
    return moe_tile_at_rule(t, blockIdx.x, s_off, s_mt, G, (O + BN - 1) / BN, BM, BN, BAND);
}

/* One warpgroup's m64nNk16 accumulators d[N/2] (fp32) -> out rows m0 .. m0 + 63 as bf16,
 * straight from registers; rows >= r1 (the next group's) and columns >= O are skipped.
 * Thread t (warp w = t/32 of the warpgroup, lane l) holds, for each 8-column block j,
 * columns 8j + 2(l%4) + {0,1} of rows 16w + l/4 (d[4j], d[4j+1]) and 16w + l/4 + 8
 * (d[4j+2], d[4j+3]). */
template <int N>
__device__ __forceinline__ void store_accumulators(moe_bf16 *out, const float *d, int m0, int n0,
                                                   int r1, int O) {
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
#pragma unroll
    for (int j = 0; j < N / 8; j++) {
        const int col = n0 + 8 * j + 2 * (lane % 4);
        if (col >= O)
            continue;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = m0 + warp * 16 + lane / 4 + 8 * h;
            if (row < r1)
                *(__nv_bfloat162 *)(out + (size_t)row * O + col) =
                    __floats2bfloat162_rn(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
        }
    }
}

} /* namespace ladder */
