/*
 * What chapter 07's two Hopper (sm_90a) flash-attention files share: the forward
 * (attention_sm90.cu) and the backward (attention_sm90_bwd.cu). Both read q, k, v (and the
 * backward dy) through 4-D TMA tensor maps [B][T][H][D] in boxes of [rows][64 bf16] with the
 * 128-byte swizzle, and feed the same boxes to wgmma through K-major and MN-major
 * descriptors; attention_sm90.cu's header explains the layout and the fragment trick.
 *
 * Everything here is static (internal to each including file).
 */
#ifndef MOE_ATTENTION_SM90_CUH
#define MOE_ATTENTION_SM90_CUH

#include <stdint.h>

#include "cuda_common.cuh"
#include "sm90_ptx.cuh"

/* One TMA box of 128 rows: [128 rows][64 bf16] = 16 KB (64 rows: half). */
constexpr int FA_SM90_BOX = 128 * 64 * 2;

#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL) /* nothing for sm_100a */

/* The descriptor of a K-major operand inside a [rows][64] swizzled box: p is the first row
 * (a multiple of 8 rows from the box's start) plus 32 bytes per k16 step. */
static __device__ __forceinline__ uint64_t fa_desc_kmajor(const uint8_t *p) {
    return desc(p, 16, 1024);
}

/* The descriptor of an MN-major operand made of [k rows][64 mn] boxes of box_bytes bytes
 * side by side along MN (LBO: the next 64 columns are the next box): p is the first k-row
 * of the step (16 rows of 128 bytes = 2048 bytes per k16 step); SBO = 1024, the next 8
 * k-rows. */
static __device__ __forceinline__ uint64_t fa_desc_mnmajor(const uint8_t *p,
                                                           uint32_t box_bytes = FA_SM90_BOX) {
    return desc(p, box_bytes, 1024);
}

/* Two floats → one register of two bf16 (lo in the low half: the lower column/k). */
static __device__ __forceinline__ uint32_t fa_pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

/* The first thread sets up a CTA's barriers: `resident` for the tiles loaded once (one
 * expect_tx), and per ring stage `full` (the producer's expect_tx and the bytes) and `empty`
 * (one arrival per consumer warp, 8); the caller syncs the block after it. */
static __device__ __forceinline__ void fa_init_barriers(uint64_t *resident, uint64_t *full,
                                                        uint64_t *empty, int stages) {
    if (threadIdx.x == 0) {
        mbar_init(resident, 1);
        for (int s = 0; s < stages; s++) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 8);
        }
        mbar_init_fence();
    }
}

/* The producer's key/value ring, shared by the forward and the backward's dq kernel: key
 * tiles j = 0 .. nkt−1 of `rows` keys of KV head g in sequence b, each stage holding the K
 * tile then the V tile (tile_bytes each, NC boxes of box_bytes side by side along D), its
 * `full` barrier expecting both, after the consumers released it through `empty`. */
template <int STAGES, int NC>
static __device__ __forceinline__ void fa_produce_kv(uint8_t *ring, int stage_bytes,
                                                     int tile_bytes, int box_bytes,
                                                     const CUtensorMap *mk, const CUtensorMap *mv,
                                                     uint64_t *full, uint64_t *empty, int nkt,
                                                     int rows, int g, int b) {
    for (int j = 0; j < nkt; j++) {
        const int s = j % STAGES, phase = (j / STAGES) & 1;
        mbar_wait(&empty[s], phase ^ 1); /* a fresh barrier passes parity 1 */
        uint8_t *kt = ring + s * stage_bytes, *vt = kt + tile_bytes;
        mbar_expect_tx(&full[s], stage_bytes);
        for (int c = 0; c < NC; c++) {
            tma_load_4d(kt + c * box_bytes, mk, &full[s], 64 * c, g, j * rows, b);
            tma_load_4d(vt + c * box_bytes, mv, &full[s], 64 * c, g, j * rows, b);
        }
    }
}
#endif

/* A 4-D tensor map over x [B][T][H][D] bf16 with boxes of [rows][64 d] of one head of one
 * sequence (coordinates: d, head, row, sequence), 128-byte swizzle, zero fill: a box never
 * reaches into the next sequence. rows: 128 (the forward's tiles) or 64. */
static inline CUtensorMap fa_sm90_map(const void *x, int B, int T, int H, int D,
                                      uint32_t rows = 128) {
    const uint64_t dims[4] = {(uint64_t)D, (uint64_t)H, (uint64_t)T, (uint64_t)B};
    const uint32_t box[4] = {64, 1, rows, 1};
    return moe_tma_map(x, 4, dims, box);
}

/* Is the current device of compute capability 9 (the only one these kernels run on)? */
static inline bool fa_sm90_device(void) { return moe_cuda_cc_major() == 9; }

/* TMA needs 16-byte aligned tensors (cudaMalloc gives 256). */
static inline bool fa_aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

#endif /* MOE_ATTENTION_SM90_CUH */
