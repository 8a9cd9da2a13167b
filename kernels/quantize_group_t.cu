/*
 * Chapter 05's token-wise FP8 copy per expert group (lib/fp8_wgrad.h): the operands of the
 * FP8 wgrad, [C][Kpad] codes with each group's tokens from a 128-aligned column, 1×128
 * blocks along the tokens, scales [Kpad/128][C]. Equal byte for byte to
 * moe_cpu_quant_group_t (the same MOE_HOSTDEV rules; the amax is a maximum of integer keys,
 * which any order gives alike).
 *
 * STATUS: the vectorized kernel (v2, below) is the default: byte for byte the CPU twin on an
 * H100 (tests/gpu_fp8_wgrad.c), at 72-90 % of a copy (docs/results/05-fp8-nvfp4.md);
 * MOE_QUANT_GROUP_T_V1=1 (or moe_cuda_quant_group_t_set_v1) runs the first kernel instead.
 *
 * The pass moves bytes and casts: it reads 2 bytes and writes 1 per element, so it can at
 * best run at the copy bandwidth of 3 bytes an element (Mixtral fc1's two copies: 1.6 GB,
 * ~0.55 ms on an H100). The first kernel (group_t_kernel_v1) ran at about a quarter of that:
 * 2-byte loads, 1-byte stores, a block scan per tile, and the general encoder
 * (moe_q_encode: ~40 integer operations, at half the fp32 rate on Hopper, per element: the
 * casts alone cost about as much as the memory). v2:
 *
 *  - one 256-thread block per 128 channels and a stride of padded 128-token blocks
 *    (TILES_PER_CTA of them on average): the groups' padded starts (moe_wgrad_block_prefix)
 *    are scanned once per block, and each tile finds its group by a binary search of them in
 *    shared memory;
 *  - the tile (128 tokens × 128 channels of bf16, 32 KB) arrives by 16-byte loads, eight per
 *    thread, all issued before the first is stored (and before the barrier that waits for
 *    the previous tile's readers), so a thread keeps 128 bytes in flight;
 *  - a lane then owns 2 channels × 16 consecutive tokens (one 32-bit word, a bf16 pair, per
 *    token), so its codes of one channel are 16 bytes: one 16-byte store, and the 8 lanes of
 *    a channel write its 128-byte run whole; the amax of a channel is a max over the lane's
 *    16 keys then a 3-step xor butterfly over its 8 lanes;
 *  - the cast is the hardware's fp32x2 → FP8x2 conversion (moe_fp8x2_encode_hw,
 *    quant1x128.cuh), two values an instruction, equal to moe_fp8_encode on every finite
 *    input (tested over all of them); the codes are packed 4 at a time with a byte permute.
 *
 * The transpose's bank conflicts. The tile is stored unpadded, 256 bytes (64 words, two
 * rounds of the 32 banks) a token row, in 16 chunks of 16 bytes (8 channels); chunk q of
 * token row t lives at chunk position q ^ ((t >> 4) & 7) of its row (an XOR swizzle).
 *  - The 16-byte stores: a quarter-warp (the unit of a 128-bit shared access) is 8 threads
 *    with chunks q = 0..7 (or 8..15) of one row: XOR with one constant permutes them, so
 *    the 8 chunks cover the 32 banks once.
 *  - The 32-bit reads: at step k, lane (s = lane & 7, p = lane >> 3) reads word p of chunk q
 *    of row 16·s + k. Unswizzled, the 8 rows 16 apart start in the same bank (16 · 64 words
 *    is a multiple of 32): an 8-way conflict. Swizzled, row 16·s + k has its chunk at
 *    q ^ s: bank 4·((q ^ s) & 7) + p, 32 distinct banks for the 32 lanes.
 * Padding cannot do it: any row stride puts rows 16 apart on banks 16·stride apart, one of
 * only two values mod 32; and a padded row would break the 16-byte alignment of the stores.
 *
 * With y (the emulation's QDQ, moe_cpu_qdq_group_t's values rounded to bf16), each lane
 * writes its dequantized values over its own words of the tile, and after a barrier the tile
 * goes back to x's layout [rows][C] with 16-byte stores (rows past the group's end skipped);
 * the codes are written only when qt is given. y may be x: a tile is read whole before any
 * of it is written, and no other block touches it.
 *
 * v2 needs x, y and qt 16-byte aligned (C and Kpad are multiples of 128, so every row then
 * is); otherwise the first kernel runs (a launch-time choice).
 */
#include <stdlib.h>

#include "cuda_common.cuh"
#include "cuda_ops.h"
#include "fp8_wgrad.cuh"
#include "fp8_wgrad.h"
#include "quant_group_t.cuh"

namespace {

constexpr int B = MOE_QUANT_BLOCK, THREADS = 256;
static_assert(THREADS >= MOE_GROUPED_DEV_MAX_GROUPS, "moe_wgrad_block_prefix: a thread a group");

/* ------------------------------------------------------------------ v1 (the first kernel)
 * One 256-thread block per (128 channels, one padded 128-token block): grid (C/128, Kpad/128).
 * The block finds its group with its own scan; the tile goes to shared memory 2 bytes a
 * thread (130 bf16 a row: a column read by a warp, one row a lane, 65 words apart, hits 32
 * banks); each warp quantizes 16 channels, a lane 4 tokens (lane + 32k), storing a byte each. */
constexpr int LD1 = B + 2;

__global__ void __launch_bounds__(THREADS)
    group_t_kernel_v1(uint8_t *qt, float *st, moe_bf16 *y, const moe_bf16 *x, const int *off,
                      int G, int C, size_t kpad, moe_fp8_format f, int pow2) {
    __shared__ moe_bf16 tile[B * LD1]; /* 33 KB */
    __shared__ int s_pb[MOE_GROUPED_DEV_MAX_GROUPS + 1];
    __shared__ int s_info[2]; /* this block's first token and its token count (0: none) */
    const int pb = blockIdx.y, c0 = blockIdx.x * B;
    if (threadIdx.x == 0)
        s_info[1] = 0; /* past the last group's padded end, unless a group claims it */
    moe_wgrad_block_prefix(s_pb, off, G); /* (synchronizes) */
    if (threadIdx.x < G && s_pb[threadIdx.x] <= pb && pb < s_pb[threadIdx.x + 1]) {
        const int g = threadIdx.x, kb = pb - s_pb[g]; /* exactly one thread: its group */
        s_info[0] = off[g] + kb * B;
        s_info[1] = min(B, off[g + 1] - off[g] - kb * B);
    }
    __syncthreads();
    const int t0 = s_info[0], nt = s_info[1];
    if (nt == 0)
        return; /* past the last group's padded end: not written (lib/fp8_wgrad.h) */
    for (int i = threadIdx.x; i < B * B; i += THREADS) {
        const int r = i / B, c = i % B; /* consecutive threads: consecutive channels */
        tile[r * LD1 + c] = r < nt ? x[(size_t)(t0 + r) * C + c0 + c] : moe_st(0.0f);
    }
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float fmax = moe_fp8_max(f);
    for (int j = warp * 16; j < warp * 16 + 16; j++) {
        float v[4];
        uint32_t m = 0;
        for (int k = 0; k < 4; k++) {
            v[k] = moe_ld(tile[(lane + 32 * k) * LD1 + j]);
            const uint32_t key = moe_q_abs_key(v[k]);
            m = key > m ? key : m;
        }
        m = __reduce_max_sync(0xffffffffu, m);
        const float scale = moe_q_scale_from_amax(moe_q_key_amax(m), fmax, pow2);
        const float si = moe_q_scale_inv(scale);
        for (int k = 0; k < 4; k++) {
            const int t = lane + 32 * k;
            const uint8_t code = t < nt ? moe_q_cast_scaled(v[k], scale, f) : (uint8_t)0;
            if (qt)
                qt[(size_t)(c0 + j) * kpad + (size_t)pb * B + t] = code;
            if (y && t < nt)
                y[(size_t)(t0 + t) * C + c0 + j] = moe_st(moe_q_dequant(moe_fp8_decode(code, f), si));
        }
        if (lane == 0 && st)
            st[(size_t)pb * C + c0 + j] = si;
    }
}

/* ------------------------------------------------------------------ v2 (see the header) */

/* the tile step (quant_group_t.cuh): its 16 chunks a row, its 16-token lane segments */
constexpr int CHUNKS = MOE_GT_CHUNKS, SEG = MOE_GT_SEG;
constexpr int ROWS_PER_PASS = THREADS / CHUNKS; /* 16 token rows per load step */
constexpr int LOADS = B / ROWS_PER_PASS;        /* 8 loads of 16 bytes per thread */
constexpr int TILES_PER_CTA = 4;   /* padded token blocks per block, on average */
/* 4 blocks an SM: 64 registers a thread (80 unbounded, which allows 3), 4 × 34 KB of shared
 * memory, 4 × 32 KB of loads in flight; the QDQ's kernel (the emulation's, which also holds
 * the dequantized values) 2, where it does not spill */
constexpr int MIN_CTAS = 4;
static_assert(LOADS == 8 && B / SEG == 8 && THREADS == MOE_GT_THREADS,
              "the swizzle assumes 8 segments of 16 rows, the tile step 256 threads");

template <moe_fp8_format F, bool QDQ>
__global__ void __launch_bounds__(THREADS, QDQ ? MIN_CTAS / 2 : MIN_CTAS)
    group_t_kernel(uint8_t *qt, float *st, moe_bf16 *y, const moe_bf16 *x, const int *off,
                   int G, int C, size_t kpad, int pow2) {
    __shared__ uint4 tile[B * CHUNKS]; /* 32 KB: [token][swizzled chunk] */
    __shared__ int s_pb[MOE_GROUPED_DEV_MAX_GROUPS + 1];
    __shared__ int s_off[MOE_GROUPED_DEV_MAX_GROUPS + 1];
    const int tid = threadIdx.x, c0 = blockIdx.x * B;
    for (int i = tid; i <= G; i += THREADS) /* G + 1 offsets: 257 at the most */
        s_off[i] = off[i];
    moe_wgrad_block_prefix(s_pb, off, G); /* (synchronizes, after s_off's stores too) */
    const int total = s_pb[G]; /* the padded blocks of all groups: the rest is not written */
    /* the load step's thread layout: chunk lq of token rows lr + 16·i */
    const int lq = tid % CHUNKS, lr = tid / CHUNKS;
    for (int pb = blockIdx.y; pb < total; pb += gridDim.y) {
        const int g = moe_gt_group_of(s_pb, G, pb); /* its group */
        const int t0 = s_off[g] + (pb - s_pb[g]) * B;
        const int nt = min(B, s_off[g + 1] - t0);
        uint4 r[LOADS];
#pragma unroll
        for (int i = 0; i < LOADS; i++) {
            const int t = lr + ROWS_PER_PASS * i;
            r[i] = t < nt ? *(const uint4 *)(x + (size_t)(t0 + t) * C + c0 + 8 * lq)
                          : make_uint4(0, 0, 0, 0); /* key 0, code 0: the padding */
        }
        __syncthreads(); /* the previous tile's readers are done */
#pragma unroll
        for (int i = 0; i < LOADS; i++) {
            const int t = lr + ROWS_PER_PASS * i;
            tile[t * CHUNKS + moe_gt_swz(t, lq)] = r[i];
        }
        __syncthreads();
        moe_gt_tile_step<F, QDQ>(tile, qt, st, c0, pb, C, kpad, pow2);
        if (QDQ) {
            __syncthreads();
#pragma unroll
            for (int i = 0; i < LOADS; i++) {
                const int t = lr + ROWS_PER_PASS * i;
                if (t < nt)
                    *(uint4 *)(y + (size_t)(t0 + t) * C + c0 + 8 * lq) =
                        tile[t * CHUNKS + moe_gt_swz(t, lq)];
            }
        }
    }
}

long long g_v2_calls = 0; /* launches of v2 (a test's proof that it ran) */
int g_v1 = -1;            /* MOE_QUANT_GROUP_T_V1; -1 until first used */

int use_v1(void) {
    if (g_v1 < 0) {
        const char *e = getenv("MOE_QUANT_GROUP_T_V1");
        g_v1 = e && *e ? atoi(e) != 0 : 0;
    }
    return g_v1;
}

moe_status launch(uint8_t *qt, float *st, moe_bf16 *y, const moe_bf16 *x, const int *dev_off,
                  int G, int C, size_t kpad, moe_fp8_format f, int pow2) {
    if (kpad == 0)
        return MOE_OK;
    const size_t nblk = kpad / B;
    if (use_v1() || !moe_vec8_ok(C, x, y, qt)) {
        const dim3 grid(C / B, (unsigned)nblk);
        group_t_kernel_v1<<<grid, THREADS, 0, moe_cuda_stream()>>>(qt, st, y, x, dev_off, G, C,
                                                                    kpad, f, pow2);
        MOE_CUDA_LAUNCH_CHECK();
        return MOE_OK;
    }
    /* enough blocks to fill the GPU several times over at the shapes of chapter 05 (the
     * Mixtral X copy: 32 × 34 blocks), each over about TILES_PER_CTA padded token blocks */
    size_t gy = (nblk + TILES_PER_CTA - 1) / TILES_PER_CTA;
    gy = gy > 65535 ? 65535 : gy;
    const dim3 grid(C / B, (unsigned)gy);
    /* a kernel per format (its constants folded into the encoder) and per output: the
     * codes and scales, or (y given) the QDQ into y */
    void (*k)(uint8_t *, float *, moe_bf16 *, const moe_bf16 *, const int *, int, int, size_t,
              int) = f == MOE_FP8_E5M2 ? (y ? group_t_kernel<MOE_FP8_E5M2, true>
                                            : group_t_kernel<MOE_FP8_E5M2, false>)
                                       : (y ? group_t_kernel<MOE_FP8_E4M3, true>
                                            : group_t_kernel<MOE_FP8_E4M3, false>);
    k<<<grid, THREADS, 0, moe_cuda_stream()>>>(qt, st, y, x, dev_off, G, C, kpad, pow2);
    MOE_CUDA_LAUNCH_CHECK();
    g_v2_calls++;
    return MOE_OK;
}

} /* namespace */

extern "C" void moe_cuda_quant_group_t_set_v1(int on) { g_v1 = on != 0; }

extern "C" int moe_cuda_quant_group_t_v1(void) { return use_v1(); }

extern "C" long long moe_cuda_quant_group_t_v2_calls(void) { return g_v2_calls; }

extern "C" moe_status moe_cuda_quant_group_t_act(uint8_t *qt, float *st, const void *x,
                                                 const int *dev_off, int G, int rows, int C,
                                                 size_t kpad, moe_fp8_format f, int pow2,
                                                 moe_error *err) {
    MOE_TRY(moe_quant_group_t_check(qt, st, x, dev_off, G, rows, C, kpad, f, err));
    return launch(qt, st, NULL, (const moe_bf16 *)x, dev_off, G, C, kpad, f, pow2);
}

extern "C" moe_status moe_cuda_qdq_group_t_act(void *y, const void *x, const int *dev_off, int G,
                                               int rows, int C, moe_fp8_format f, int pow2,
                                               moe_error *err) {
    const size_t kpad = moe_fp8_wgrad_kpad(rows, G);
    MOE_TRY(moe_quant_group_t_check(y, y, x, dev_off, G, rows, C, kpad, f, err));
    return launch(NULL, NULL, (moe_bf16 *)y, (const moe_bf16 *)x, dev_off, G, C, kpad, f, pow2);
}
