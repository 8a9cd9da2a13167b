/*
 * Chapter 05's native FP8 layer (lib/lowp.h): the passes that read bf16 only to write FP8,
 * fused into the pass that produced the bf16.
 *
 *   forward   the SwiGLU output a = s·silu(g)·u goes to fc2's FP8 GEMM only: the SwiGLU
 *             writes its 1×128 codes and scales (and, when asked, the dequantized bf16 copy)
 *             instead of a, which the quantizer then read back (MOE_FP8_FUSED=0 in lib/mlp.c
 *             runs the two passes);
 *   backward  dgu = [dg | du] goes to fc1's FP8 dgrad (codes) and the bf16 wgrad (the
 *             dequantized copy): the SwiGLU backward writes both, and not dgu;
 *   y_raw     under the FP8 wgrad (the default) the wgrad quantizes a and dgu again,
 *             along the tokens of each expert (kernels/quantize_group_t.cu), from their bf16
 *             values: then the bf16 output `y` is a itself, or dgu itself (the bytes the
 *             separate kernels write), next to the row-wise codes, instead of the dequantized
 *             copy — one pass still, where the separate path wrote a (dgu), read it back to
 *             quantize it, and (backward) zeroed dgu first. STATUS of y_raw: passed
 *             tests/gpu_fp8_fused.c and gpu_fp8_layer.c on an H100 at 3d50c58;
 *   tiled     under the FP8 wgrad the backward can write dgu's token-wise copy itself
 *             (moe_cuda_swiglu_backward_quant_t, below; lib/mlp.c takes it with
 *             MOE_FP8_FUSED_T, on by default since eb6afaa's suite passed: see below): a
 *             block computes 128 tokens × 128 channels of dg and of du, quantizes each
 *             token's row of them 1×128 (fc1's dgrad) and each channel's column 1×128 along
 *             the tokens (fc1's FP8 wgrad, quant_group_t.cuh's step), so dgu is neither
 *             written nor read back;
 *   tiled fwd under the FP8 wgrad the forward writes a's token-wise copy itself
 *             (moe_cuda_swiglu_forward_quant_t, at the end; MOE_FP8_SAVE_T, on): the same
 *             128 × 128 tiles, fc2's row-wise codes and the copy fc2's wgrad reads, which the
 *             layer keeps for the backward instead of a in bf16 (about half the bytes);
 *   saved     the backward's bf16 wgrad needs Q(a) as bf16: dequantized once from the codes
 *             the forward kept (1 byte read per element, 2 written), where the unfused path
 *             quantized the saved bf16 a again (2 read, 3 written).
 *
 * Bit for bit the unfused passes: each element is computed and rounded to bf16 exactly as in
 * kernels/swiglu.cu (the same swiglu.cuh math, the backward starting from a zero dgu as the
 * unfused path's zeroed buffer), read back as fp32 as the quantizer would read it, and
 * quantized by the quantizer's own tile step (quant1x128.cuh: since d51ec36 the
 * 1×128 quantizer v3's moe_q1x128_tile8_fast with the hardware's casts and the format as a
 * template parameter, where it was the generic moe_q1x128_tile8 that runs both formats' code
 * for every element, which held these passes near 1.8 TB/s; the same bytes, by the proof in
 * quant1x128.cuh and the exhaustive cast check of tests/gpu_fp8_fused.c; passed gpu_fp8_fused
 * and gpu_fp8_layer on an H100 at d51ec36, where the Mixtral FP8 layer's element-wise stage
 * fell from 3.47 to 1.55 ms, docs/results/05-fp8-nvfp4.md). The routing weight's gradient
 * keeps the unfused kernel's thread-to-column map and block size, so each thread's partial
 * sum and the block's tree add in the same order.
 *
 * Both need F % 128 == 0 (the native path's start-up check) and 16-byte aligned rows; the
 * launchers return MOE_ERR_CONFIG otherwise, before launching anything.
 */
#include <limits.h>

#include "cuda_common.cuh"
#include "cuda_ops.h"
#include "fp8_wgrad.h"
#include "quant1x128.cuh"
#include "quant_group_t.cuh"
#include "swiglu.cuh"

#define THREADS 256

static moe_status check_fused(int N, int F, const void *a, const void *b, const void *c,
                              const char *what, moe_error *err) {
    if (N < 0 || F <= 0 || F % MOE_QUANT_BLOCK != 0)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "%s: F = %d is not a positive multiple of %d (the 1x128 tiles); "
                             "the native FP8 layer checks this at start-up",
                             what, F, MOE_QUANT_BLOCK);
    if (!moe_vec8_ok(F, a, b, c))
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "%s: a buffer is not 16-byte aligned; run the unfused passes "
                             "(MOE_FP8_FUSED=0)",
                             what);
    return MOE_OK;
}

/* quantize the tile whose lane-share is @p v and store it at element @p i of [rows, W]
 * (tile index @p t); @p valid: this half-warp has a tile; with @p y also its bf16 values:
 * the dequantized copy, or (@p y_raw) @p v itself (bf16 values already: exact) */
template <moe_fp8_format FMT>
static __device__ __forceinline__ void store_tile(uint8_t *q, float *scale_inv, moe_bf16 *y,
                                                  int y_raw, const float v[8], size_t i,
                                                  size_t t, bool valid, bool lead, int pow2) {
    uint2 cw;
    moe_bf16x8 d;
    /* the 1×128 quantizer v3's tile (quant1x128.cuh: the hardware's casts, the format a
     * template parameter): moe_q1x128_tile8's bytes in a fraction of its instructions.
     * (y, y_raw are the kernel's arguments: every lane of the warp takes the same branch.) */
    const float si = y && !y_raw ? moe_q1x128_tile8_fast<FMT, true, true>(v, &cw, &d, pow2)
                                 : moe_q1x128_tile8_fast<FMT, false, true>(v, &cw, NULL, pow2);
    if (y && y_raw) {
#pragma unroll
        for (int k = 0; k < 8; k++)
            d.h[k] = moe_st(v[k]);
    }
    if (valid) {
        *(uint2 *)(q + i) = cw;
        if (y)
            *(uint4 *)(y + i) = d.u;
        if (lead)
            scale_inv[t] = si;
    }
}

/* a half-warp per 1×128 tile of the output [N, F], lane l its columns 8l .. 8l+7: the
 * forward's values (swiglu_forward_kernel's, rounded to bf16), then the tile's quantization */
template <moe_fp8_format FMT>
static __global__ void swiglu_quant_fwd_kernel(uint8_t *q, float *scale_inv, moe_bf16 *y,
                                               int y_raw, const moe_bf16 *gu,
                                               const float *row_scale, int F, long long tiles,
                                               int pow2) {
    const int lane = threadIdx.x & 31, hl = lane & 15, nbc = F / MOE_QUANT_BLOCK;
    const long long warps = (long long)gridDim.x * (blockDim.x / 32);
    for (long long p = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
         2 * p < tiles; p += warps) {
        const long long t = 2 * p + (lane >> 4);
        const bool valid = t < tiles;
        float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (valid) {
            const size_t n = (size_t)(t / nbc), c = (size_t)(t % nbc) * 16 + hl; /* 8-col unit */
            const float s = row_scale ? row_scale[n] : 1.0f;
            const moe_bf16 *g = gu + n * 2 * F, *u = g + F;
            moe_bf16x8 vg, vu;
            vg.u = ((const uint4 *)g)[c];
            vu.u = ((const uint4 *)u)[c];
#pragma unroll
            for (int k = 0; k < 8; k++)
                v[k] = moe_ld(moe_st(swiglu_fwd(moe_ld(vg.h[k]), moe_ld(vu.h[k]), s)));
        }
        const size_t i = (size_t)t * MOE_QUANT_BLOCK + MOE_Q1X128_PER_LANE * hl;
        store_tile<FMT>(q, scale_inv, y, y_raw, v, i, (size_t)t, valid, hl == 0, pow2);
    }
}

extern "C" moe_status moe_cuda_swiglu_forward_quant(uint8_t *q, float *scale_inv, void *y,
                                                    int y_raw, const void *gu,
                                                    const moe_real *row_scale,
                                                    int N, int F, moe_fp8_format f, int pow2,
                                                    moe_error *err) {
    MOE_TRY(moe_quant_check_format(f, err));
    MOE_TRY(check_fused(N, F, gu, y, NULL, "moe_cuda_swiglu_forward_quant", err));
    if ((uintptr_t)q % 8 != 0)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "moe_cuda_swiglu_forward_quant: the codes are not 8-byte aligned");
    const long long tiles = (long long)N * (F / MOE_QUANT_BLOCK);
    if (tiles == 0)
        return MOE_OK;
    const long long pairs = (tiles + 1) / 2, per_block = THREADS / 32;
    long long blocks = (pairs + per_block - 1) / per_block;
    blocks = blocks > 4096 ? 4096 : blocks;
    auto kernel = f == MOE_FP8_E5M2 ? swiglu_quant_fwd_kernel<MOE_FP8_E5M2>
                                    : swiglu_quant_fwd_kernel<MOE_FP8_E4M3>;
    kernel<<<(unsigned)blocks, THREADS, 0, moe_cuda_stream()>>>(
        q, scale_inv, (moe_bf16 *)y, y_raw, (const moe_bf16 *)gu, row_scale, F, tiles, pow2);
    MOE_CUDA_LAUNCH_CHECK();
    return MOE_OK;
}

/* swiglu_backward_kernel<true> (one block per row, thread x on the 8-column units x,
 * x + blockDim, ...), from a zero dgu, with dg and du quantized 1×128 along the row of dgu
 * [N, 2F] instead of stored. Units are 16 to a tile and the warps start at multiples of 32
 * units, so each half-warp holds one tile of dg and the matching tile of du. */
template <moe_fp8_format FMT>
static __global__ void swiglu_quant_bwd_kernel(uint8_t *q, float *scale_inv, moe_bf16 *y,
                                               int y_raw, float *drow_scale, const moe_bf16 *dout,
                                               const moe_bf16 *gu, const float *row_scale,
                                               int F, int pow2) {
    const size_t n = blockIdx.x;
    const int lane = threadIdx.x & 31, units = F / 8, nbr = 2 * F / MOE_QUANT_BLOCK;
    const float s = row_scale ? row_scale[n] : 1.0f;
    const moe_bf16 *g = gu + n * 2 * F, *u = g + F, *dy = dout + n * F;
    float acc = 0.0f;
    for (int c0 = threadIdx.x - lane; c0 < units; c0 += blockDim.x) { /* warp-uniform */
        const int c = c0 + lane;
        const bool valid = c < units;
        float vg_[8] = {0, 0, 0, 0, 0, 0, 0, 0}, vu_[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (valid) {
            moe_bf16x8 vg, vu, vy;
            vg.u = ((const uint4 *)g)[c];
            vu.u = ((const uint4 *)u)[c];
            vy.u = ((const uint4 *)dy)[c];
#pragma unroll
            for (int k = 0; k < 8; k++) {
                float a = 0.0f, b = 0.0f; /* the zeroed dgu of the unfused path */
                acc += swiglu_bwd(moe_ld(vg.h[k]), moe_ld(vu.h[k]), moe_ld(vy.h[k]), s, &a, &b);
                vg_[k] = moe_ld(moe_st(a));
                vu_[k] = moe_ld(moe_st(b));
            }
        }
        const size_t i = n * 2 * F + (size_t)8 * c, t = n * nbr + (size_t)(c / 16);
        const bool lead = (lane & 15) == 0;
        store_tile<FMT>(q, scale_inv, y, y_raw, vg_, i, t, valid, lead, pow2);
        store_tile<FMT>(q, scale_inv, y, y_raw, vu_, i + F, t + F / MOE_QUANT_BLOCK, valid, lead,
                        pow2);
    }
    if (drow_scale) { /* as swiglu_backward_kernel: every thread reaches the sum */
        acc = moe_block_sum(acc);
        if (threadIdx.x == 0)
            drow_scale[n] += acc;
    }
}

extern "C" moe_status moe_cuda_swiglu_backward_quant(uint8_t *q, float *scale_inv, void *y,
                                                     int y_raw, moe_real *drow_scale, const void *dout,
                                                     const void *gu, const moe_real *row_scale,
                                                     int N, int F, moe_fp8_format f, int pow2,
                                                     moe_error *err) {
    MOE_TRY(moe_quant_check_format(f, err));
    MOE_TRY(check_fused(N, F, gu, dout, y, "moe_cuda_swiglu_backward_quant", err));
    if ((uintptr_t)q % 8 != 0)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "moe_cuda_swiglu_backward_quant: the codes are not 8-byte aligned");
    if (N == 0)
        return MOE_OK;
    /* moe_cuda_swiglu_backward's block size, so the routing weight's gradient adds alike */
    const int units = F / 8;
    const int threads = units >= 256 ? 256 : 32 * (int)moe_cdiv(units, 32);
    auto kernel = f == MOE_FP8_E5M2 ? swiglu_quant_bwd_kernel<MOE_FP8_E5M2>
                                    : swiglu_quant_bwd_kernel<MOE_FP8_E4M3>;
    kernel<<<N, threads, 0, moe_cuda_stream()>>>(q, scale_inv, (moe_bf16 *)y, y_raw, drow_scale,
                                                 (const moe_bf16 *)dout, (const moe_bf16 *)gu,
                                                 row_scale, F, pow2);
    MOE_CUDA_LAUNCH_CHECK();
    return MOE_OK;
}

/* ------------------------------------------------------------------------------------------
 * The backward under the FP8 wgrad, tiled: moe_cuda_swiglu_backward_quant_t.
 *
 * Why: with y_raw the row-wise kernel above writes dgu in bf16 (4·N·F bytes) only for the
 * token-wise quantizer to read it back; on Mixtral's layer that round trip is 1.9 GB. The
 * token-wise scale of a channel needs the amax of its 128 tokens, which a row-wise pass
 * cannot see, so this kernel works on 128 × 128 tiles laid out as the token-wise copy's
 * blocks: blockIdx.x the 128-channel block cb (dg's channels c0 .. c0 + 127 and du's
 * F + c0 ..), and a stride of padded token blocks pb of the groups (lib/fp8_wgrad.h), then of
 * the rows past the last group (off[G] .. N: their row-wise codes only, as the separate
 * passes give; the token-wise copy does not cover them). Per tile:
 *   1. a half-warp per token row, lane l its 8 channels c0 + 8l ..: the loads of g, u and
 *      dout, swiglu_bwd from zero (the separate path's zeroed dgu) rounded to bf16, the
 *      row's 1×128 tiles of dg and du quantized and stored (store_tile, as the row-wise
 *      kernel), and the bf16 values put in two swizzled shared-memory tiles;
 *   2. each tile quantized along its tokens (moe_gt_tile_step, the token-wise quantizer's
 *      own step), its codes and scales stored.
 * The bytes are the separate passes' (the same values, the same tile functions). The routing
 * weight's gradient is not: Σ_f over F channels is now a sum of F/128 block partials, each
 * a half-warp's butterfly, written to @p part [F/128][N] and added in block order by
 * swiglu_drow_kernel: deterministic, but another order than the row-wise kernel's, so it
 * agrees with it to fp32 rounding (tests/gpu_fp8_fused.c), not bit for bit.
 * A block a channel block (grid x) and about T_PER_CTA token blocks (grid y), two blocks an
 * SM (64 KB of tiles each), 12 loads of 16 bytes in flight a thread.
 * STATUS: passed tests/gpu_fp8_fused.c and gpu_fp8_layer.c on an H100 (cdaebf3), and the
 * whole GPU suite with it on (171/171; the model's losses equal to the separate passes') at
 * eb6afaa: the default since. First measured on the Mixtral FP8-wgrad layer
 * (docs/results/05-fp8-nvfp4.md) against the row-wise fused backward: 22.11 vs 22.39 ms in
 * one call, 22.56 vs 22.33 in another, within noise (it moves about 2 TB/s; the casts of
 * both quantizations and the shuffles of the row-wise one sit between its loads).
 * Tried and slower: a persistent form (two blocks an SM striding over all tiles, the next
 * tile's first loads issued before the token-wise step of the current one), 22.88 vs 22.45;
 * 3 blocks an SM (80 registers, the loads in groups of 2): 1.349 against 1.296 ms alone.
 * Alone (ch05_fp8_gemm_bench's SwiGLU backward rows, with the routing weight) it beats the
 * row-wise pass and the token-wise copy it replaces, 1.365 against 1.527 ms on Mixtral's fc1
 * (Nsight Compute inside the layer, 3f48dca: 1.35 against 0.985 + 0.534). The layer's
 * 7-repeat medians were too noisy to show it; with 31 repeats in three alternating pairs it
 * wins all three, 22.35 / 22.25 / 22.27 against 22.46 / 22.46 / 22.35 ms (results 05).
 */
constexpr int T_ROWS = MOE_GT_THREADS / MOE_GT_CHUNKS; /* 16 token rows per pass */
constexpr int T_PASSES = MOE_QUANT_BLOCK / T_ROWS;     /* 8 passes cover 128 tokens */
constexpr int T_TILE = MOE_QUANT_BLOCK * MOE_GT_CHUNKS * 16; /* one 128 × 128 bf16 tile */
constexpr int T_SMEM = 2 * T_TILE;                            /* dg's and du's tiles */
constexpr int T_PER_CTA = 2; /* token blocks per block, on average */

/* The tiled kernels' token blocks (both directions): the groups' padded blocks pb < total in
 * the token-wise copy's order, then `tail` blocks of the rows past the last group. */
struct t_blocks {
    int total, tail;
};

/* copy the offsets to shared memory and make the padded block starts (synchronizes) */
static __device__ __forceinline__ t_blocks t_blocks_of(int *s_pb, int *s_off, const int *off,
                                                       int G, int N) {
    for (int i = threadIdx.x; i <= G; i += MOE_GT_THREADS)
        s_off[i] = off[i];
    moe_wgrad_block_prefix(s_pb, off, G); /* (synchronizes, after s_off's stores too) */
    return {s_pb[G], (N - s_off[G] + MOE_QUANT_BLOCK - 1) / MOE_QUANT_BLOCK};
}

/* token block pb's first row *t0 and row count *nt; 1 if it is a group's (its token-wise copy
 * is written), 0 for the rows past the groups (row-wise codes only, as the separate passes) */
static __device__ __forceinline__ bool t_block_rows(const int *s_pb, const int *s_off, int G,
                                                    int N, int total, int pb, int *t0, int *nt) {
    if (pb < total) {
        const int g = moe_gt_group_of(s_pb, G, pb);
        *t0 = s_off[g] + (pb - s_pb[g]) * MOE_QUANT_BLOCK;
        *nt = min(MOE_QUANT_BLOCK, s_off[g + 1] - *t0);
        return true;
    }
    *t0 = s_off[G] + (pb - total) * MOE_QUANT_BLOCK;
    *nt = min(MOE_QUANT_BLOCK, N - *t0);
    return false;
}

template <moe_fp8_format FMT>
static __global__ void __launch_bounds__(MOE_GT_THREADS, 2)
    swiglu_quant_bwd_t_kernel(uint8_t *q, float *scale_inv, uint8_t *qt, float *st, float *part,
                              const moe_bf16 *dout, const moe_bf16 *gu, const float *row_scale,
                              const int *off, int G, int N, int F, size_t kpad, int pow2) {
    extern __shared__ __align__(1024) uint4 t_smem[];
    __shared__ int s_pb[MOE_GROUPED_DEV_MAX_GROUPS + 1];
    __shared__ int s_off[MOE_GROUPED_DEV_MAX_GROUPS + 1];
    uint4 *tg = t_smem, *tu = t_smem + MOE_QUANT_BLOCK * MOE_GT_CHUNKS;
    const int tid = threadIdx.x, cb = blockIdx.x, c0 = cb * MOE_QUANT_BLOCK;
    const int nbc = F / MOE_QUANT_BLOCK, nbr = 2 * nbc;
    const t_blocks tb = t_blocks_of(s_pb, s_off, off, G, N);
    /* chunk lq of token rows lr + 16·i: a half-warp holds one row's 128 channels */
    const int lq = tid % MOE_GT_CHUNKS, lr = tid / MOE_GT_CHUNKS;
    for (int pb = blockIdx.y; pb < tb.total + tb.tail; pb += gridDim.y) {
        int t0, nt; /* (grouped is block-uniform; past the groups: row-wise codes, d scale) */
        const bool grouped = t_block_rows(s_pb, s_off, G, N, tb.total, pb, &t0, &nt);
        __syncthreads(); /* the previous tile's readers are done */
#pragma unroll
        for (int half = 0; half < 2; half++) {
            constexpr int P = T_PASSES / 2;
            moe_bf16x8 vg[P], vu[P], vy[P];
#pragma unroll
            for (int i = 0; i < P; i++) { /* all loads first: 12 × 16 bytes in flight */
                const int t = lr + T_ROWS * (P * half + i);
                vg[i].u = vu[i].u = vy[i].u = make_uint4(0, 0, 0, 0);
                if (t < nt) {
                    const size_t n = (size_t)(t0 + t);
                    const moe_bf16 *g = gu + n * 2 * F + c0 + 8 * lq;
                    vg[i].u = *(const uint4 *)g;
                    vu[i].u = *(const uint4 *)(g + F);
                    vy[i].u = *(const uint4 *)(dout + n * F + c0 + 8 * lq);
                }
            }
#pragma unroll
            for (int i = 0; i < P; i++) {
                const int t = lr + T_ROWS * (P * half + i);
                const bool valid = t < nt;
                const size_t n = (size_t)(t0 + (valid ? t : 0));
                const float s = row_scale && valid ? row_scale[n] : 1.0f;
                float a[8], b[8], acc = 0.0f;
                moe_bf16x8 ha, hb;
#pragma unroll
                for (int k = 0; k < 8; k++) {
                    float da = 0.0f, db = 0.0f; /* the zeroed dgu of the separate path */
                    acc += swiglu_bwd(moe_ld(vg[i].h[k]), moe_ld(vu[i].h[k]), moe_ld(vy[i].h[k]),
                                      s, &da, &db);
                    ha.h[k] = moe_st(da);
                    hb.h[k] = moe_st(db);
                    a[k] = moe_ld(ha.h[k]); /* zero for a padded token: key 0, code 0 */
                    b[k] = moe_ld(hb.h[k]);
                }
                /* the row's 1×128 tiles of dg and du (every lane: store_tile shuffles) */
                const size_t iq = n * 2 * F + c0 + (size_t)MOE_Q1X128_PER_LANE * lq;
                const size_t it = n * nbr + cb;
                store_tile<FMT>(q, scale_inv, NULL, 0, a, iq, it, valid, lq == 0, pow2);
                store_tile<FMT>(q, scale_inv, NULL, 0, b, iq + F, it + nbc, valid, lq == 0, pow2);
                if (part) { /* the row's partial Σ dout·a over these 128 channels */
#pragma unroll
                    for (int o = 8; o; o >>= 1)
                        acc += __shfl_xor_sync(0xffffffffu, acc, o);
                    if (valid && lq == 0)
                        part[(size_t)cb * N + n] = acc;
                }
                if (grouped) {
                    tg[t * MOE_GT_CHUNKS + moe_gt_swz(t, lq)] = ha.u;
                    tu[t * MOE_GT_CHUNKS + moe_gt_swz(t, lq)] = hb.u;
                }
            }
        }
        if (grouped) {
            __syncthreads();
            moe_gt_tile_step<FMT, false>(tg, qt, st, c0, pb, 2 * F, kpad, pow2);
            moe_gt_tile_step<FMT, false>(tu, qt, st, F + c0, pb, 2 * F, kpad, pow2);
        }
    }
}

/* drow_scale[n] += Σ_cb part[cb][n], in block order (deterministic) */
static __global__ void swiglu_drow_kernel(float *drow_scale, const float *part, int N, int nbc) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N)
        return;
    float acc = 0.0f;
    for (int cb = 0; cb < nbc; cb++)
        acc += part[(size_t)cb * N + n];
    drow_scale[n] += acc;
}

/* the tiled kernels' grid: a block a channel block (x) and about T_PER_CTA token blocks (y) */
static moe_status t_grid(dim3 *grid, int N, int F, size_t kpad, const char *what,
                         moe_error *err) {
    /* a bound of the token blocks: the groups' padded ones (≤ kpad/128) and those of the
     * rows past the groups (≤ ⌈N/128⌉); blocks past the real count return at once */
    const size_t bound = kpad / MOE_QUANT_BLOCK + moe_cdiv(N, MOE_QUANT_BLOCK);
    if (bound > (size_t)INT_MAX / 2)
        return moe_error_set(err, MOE_ERR_CONFIG, "%s: %zu token blocks overflow an int (N = %d)",
                             what, bound, N);
    size_t gy = moe_cdiv(bound, T_PER_CTA);
    gy = gy > 65535 ? 65535 : gy;
    *grid = dim3((unsigned)(F / MOE_QUANT_BLOCK), (unsigned)gy);
    return MOE_OK;
}

/* the tiled kernel of one format: its 64 KB of shared memory asked for once, then launched */
template <moe_fp8_format FMT>
static void launch_bwd_t(dim3 grid, uint8_t *q, float *scale_inv, uint8_t *qt, float *st,
                         float *part, const void *dout, const void *gu, const float *row_scale,
                         const int *dev_off, int G, int N, int F, size_t kpad, int pow2) {
    moe_cuda_smem_opt_in<swiglu_quant_bwd_t_kernel<FMT>>(T_SMEM);
    swiglu_quant_bwd_t_kernel<FMT><<<grid, MOE_GT_THREADS, T_SMEM, moe_cuda_stream()>>>(
        q, scale_inv, qt, st, part, (const moe_bf16 *)dout, (const moe_bf16 *)gu, row_scale,
        dev_off, G, N, F, kpad, pow2);
}

long long g_bwd_t_calls = 0; /* launches of the tiled backward (a test's proof that it ran) */

extern "C" long long moe_cuda_swiglu_backward_quant_t_calls(void) { return g_bwd_t_calls; }

extern "C" moe_status moe_cuda_swiglu_backward_quant_t(
    uint8_t *q, float *scale_inv, uint8_t *qt, float *st, float *part, moe_real *drow_scale,
    const void *dout, const void *gu, const moe_real *row_scale, const int *dev_off, int G,
    int N, int F, size_t kpad, moe_fp8_format f, int pow2, moe_error *err) {
    static const char *const what = "moe_cuda_swiglu_backward_quant_t";
    MOE_TRY(moe_quant_check_format(f, err));
    MOE_TRY(check_fused(N, F, gu, dout, NULL, what, err));
    if (F > INT_MAX / 2)
        return moe_error_set(err, MOE_ERR_CONFIG, "%s: 2F overflows (F = %d)", what, F);
    MOE_TRY(moe_quant_group_t_check(qt, st, gu, dev_off, G, N, 2 * F, kpad, f, err));
    if ((uintptr_t)q % 8 != 0 || (uintptr_t)qt % 16 != 0)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "%s: the row-wise codes are not 8-byte or the token-wise codes "
                             "not 16-byte aligned", what);
    if (drow_scale && !part)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "%s: the routing weight's gradient needs the partial sums' buffer "
                             "(N x F/128 floats)", what);
    if (N == 0)
        return MOE_OK;
    const int nbc = F / MOE_QUANT_BLOCK;
    dim3 grid;
    MOE_TRY(t_grid(&grid, N, F, kpad, what, err));
    float *pt = drow_scale ? part : NULL;
    if (f == MOE_FP8_E5M2)
        launch_bwd_t<MOE_FP8_E5M2>(grid, q, scale_inv, qt, st, pt, dout, gu, row_scale, dev_off,
                                   G, N, F, kpad, pow2);
    else
        launch_bwd_t<MOE_FP8_E4M3>(grid, q, scale_inv, qt, st, pt, dout, gu, row_scale, dev_off,
                                   G, N, F, kpad, pow2);
    MOE_CUDA_LAUNCH_CHECK();
    if (drow_scale) {
        swiglu_drow_kernel<<<(unsigned)moe_cdiv(N, 256), 256, 0, moe_cuda_stream()>>>(
            drow_scale, part, N, nbc);
        MOE_CUDA_LAUNCH_CHECK();
    }
    g_bwd_t_calls++;
    return MOE_OK;
}

/*
 * The tiled forward under the FP8 wgrad (MOE_FP8_SAVE_T, on by default; lib/mlp.c, "Fused
 * passes"): the SwiGLU output a goes to fc2's forward as row-wise codes (1×128 along F, as
 * moe_cuda_swiglu_forward_quant writes them) and to fc2's FP8 wgrad as its token-wise copy
 * (1×128 along each expert's tokens, as moe_cuda_quant_group_t_act of a would write it). The
 * row-wise kernel above wrote a itself in bf16 for the backward's token-wise quantizer, so a
 * was kept for the backward at 2 bytes an element; here the token-wise copy is what is kept
 * (1 byte an element, 4 bytes of scale per 128, the groups padded to 128 tokens), and neither
 * the bf16 write nor the backward's read of it and its launch remain. The tile walk is the
 * tiled backward's (one 128 × 128 tile of a a step, blockIdx.x its channel block, the padded
 * token blocks of the groups, then the rows past them, row-wise only):
 *   1. a half-warp per token row, lane l its 8 channels c0 + 8l ..: g and u loaded (four
 *      passes' loads at a time, 8 × 16 bytes in flight a thread), a = swiglu_fwd rounded to
 *      bf16 exactly as the row-wise kernel, the row's 1×128 tile quantized and stored
 *      (store_tile), the bf16 values put in a swizzled shared-memory tile;
 *   2. the tile quantized along its tokens (moe_gt_tile_step), codes and scales stored.
 * The same values through the same tile functions: the same bytes as the two separate passes
 * (tests/gpu_fp8_fused.c checks every byte).
 */
template <moe_fp8_format FMT, int MB>
static __global__ void __launch_bounds__(MOE_GT_THREADS, MB)
    swiglu_quant_fwd_t_kernel(uint8_t *q, float *scale_inv, uint8_t *qt, float *st,
                              const moe_bf16 *gu, const float *row_scale, const int *off, int G,
                              int N, int F, size_t kpad, int pow2) {
    extern __shared__ __align__(1024) uint4 t_smem[];
    __shared__ int s_pb[MOE_GROUPED_DEV_MAX_GROUPS + 1];
    __shared__ int s_off[MOE_GROUPED_DEV_MAX_GROUPS + 1];
    const int tid = threadIdx.x, cb = blockIdx.x, c0 = cb * MOE_QUANT_BLOCK;
    const int nbc = F / MOE_QUANT_BLOCK;
    const t_blocks tb = t_blocks_of(s_pb, s_off, off, G, N);
    const int lq = tid % MOE_GT_CHUNKS, lr = tid / MOE_GT_CHUNKS;
    for (int pb = blockIdx.y; pb < tb.total + tb.tail; pb += gridDim.y) {
        int t0, nt;
        const bool grouped = t_block_rows(s_pb, s_off, G, N, tb.total, pb, &t0, &nt);
        __syncthreads(); /* the previous tile's readers are done */
#pragma unroll
        for (int half = 0; half < 2; half++) {
            constexpr int P = T_PASSES / 2;
            moe_bf16x8 vg[P], vu[P];
#pragma unroll
            for (int i = 0; i < P; i++) { /* all loads first: 8 × 16 bytes in flight */
                const int t = lr + T_ROWS * (P * half + i);
                vg[i].u = vu[i].u = make_uint4(0, 0, 0, 0);
                if (t < nt) {
                    const moe_bf16 *g = gu + (size_t)(t0 + t) * 2 * F + c0 + 8 * lq;
                    vg[i].u = *(const uint4 *)g;
                    vu[i].u = *(const uint4 *)(g + F);
                }
            }
#pragma unroll
            for (int i = 0; i < P; i++) {
                const int t = lr + T_ROWS * (P * half + i);
                const bool valid = t < nt;
                const size_t n = (size_t)(t0 + (valid ? t : 0));
                const float s = row_scale && valid ? row_scale[n] : 1.0f;
                float a[8];
                moe_bf16x8 ha;
#pragma unroll
                for (int k = 0; k < 8; k++) { /* padded: g = u = 0, so a = +0 (code 0) */
                    ha.h[k] = moe_st(swiglu_fwd(moe_ld(vg[i].h[k]), moe_ld(vu[i].h[k]), s));
                    a[k] = moe_ld(ha.h[k]);
                }
                store_tile<FMT>(q, scale_inv, NULL, 0, a,
                                n * F + c0 + (size_t)MOE_Q1X128_PER_LANE * lq, n * nbc + cb,
                                valid, lq == 0, pow2);
                if (grouped)
                    t_smem[t * MOE_GT_CHUNKS + moe_gt_swz(t, lq)] = ha.u;
            }
        }
        if (grouped) {
            __syncthreads();
            moe_gt_tile_step<FMT, false>(t_smem, qt, st, c0, pb, F, kpad, pow2);
        }
    }
}

long long g_fwd_t_calls = 0; /* launches of the tiled forward (a test's proof that it ran) */

extern "C" long long moe_cuda_swiglu_forward_quant_t_calls(void) { return g_fwd_t_calls; }

/* The tiled forward's blocks per SM, its launch bounds' minimum (2, 3 or 4: ptxas fits it in
 * 102, 79 and 64 registers, no spills; each block holds one 32 KB tile): more blocks hide
 * more of the load latency between one tile's phases. Measured on an H100 (results 05) on
 * Mixtral's fc1 output: 0.900, 0.737 and 0.706 ms (53, 65 and 68 % of a copy's bandwidth),
 * against 0.867 ms for the row-wise pass and the token-wise copy it replaces: 4 is the
 * default. -1 until first used: then MOE_FP8_SAVE_T_BLOCKS, else
 * MOE_FP8_SAVE_T_BLOCKS_DEFAULT (cuda_ops.h). */
int g_fwd_t_blocks = -1;

static int fwd_t_blocks(void) {
    if (g_fwd_t_blocks < 0) {
        const char *e = getenv("MOE_FP8_SAVE_T_BLOCKS");
        const int v = e && *e ? atoi(e) : MOE_FP8_SAVE_T_BLOCKS_DEFAULT;
        if (v < 2 || v > 4) {
            fprintf(stderr, "MOE_FP8_SAVE_T_BLOCKS=%s: the tiled SwiGLU forward runs 2, 3 or 4 "
                            "blocks per SM; unset it or give one of those\n", e);
            exit(2);
        }
        g_fwd_t_blocks = v;
    }
    return g_fwd_t_blocks;
}

extern "C" void moe_cuda_swiglu_forward_t_set_blocks(int blocks) {
    g_fwd_t_blocks = blocks < 2 ? 2 : blocks > 4 ? 4 : blocks;
}

extern "C" int moe_cuda_swiglu_forward_t_blocks(void) { return fwd_t_blocks(); }

template <moe_fp8_format FMT, int MB>
static void launch_fwd_t(dim3 grid, uint8_t *q, float *scale_inv, uint8_t *qt, float *st,
                         const void *gu, const float *row_scale, const int *dev_off, int G, int N,
                         int F, size_t kpad, int pow2) {
    moe_cuda_smem_opt_in<swiglu_quant_fwd_t_kernel<FMT, MB>>(T_TILE);
    swiglu_quant_fwd_t_kernel<FMT, MB><<<grid, MOE_GT_THREADS, T_TILE, moe_cuda_stream()>>>(
        q, scale_inv, qt, st, (const moe_bf16 *)gu, row_scale, dev_off, G, N, F, kpad, pow2);
}

typedef void (*fwd_t_launcher)(dim3, uint8_t *, float *, uint8_t *, float *, const void *,
                               const float *, const int *, int, int, int, size_t, int);

extern "C" moe_status moe_cuda_swiglu_forward_quant_t(uint8_t *q, float *scale_inv, uint8_t *qt,
                                                      float *st, const void *gu,
                                                      const moe_real *row_scale,
                                                      const int *dev_off, int G, int N, int F,
                                                      size_t kpad, moe_fp8_format f, int pow2,
                                                      moe_error *err) {
    static const char *const what = "moe_cuda_swiglu_forward_quant_t";
    MOE_TRY(moe_quant_check_format(f, err));
    MOE_TRY(check_fused(N, F, gu, NULL, NULL, what, err));
    if (F > INT_MAX / 2)
        return moe_error_set(err, MOE_ERR_CONFIG, "%s: 2F overflows (F = %d)", what, F);
    MOE_TRY(moe_quant_group_t_check(qt, st, gu, dev_off, G, N, F, kpad, f, err));
    if (!q || !scale_inv || (uintptr_t)q % 8 != 0 || (uintptr_t)qt % 16 != 0)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "%s: the row-wise codes are missing or not 8-byte aligned, or the "
                             "token-wise codes not 16-byte aligned", what);
    if (N == 0)
        return MOE_OK;
    dim3 grid;
    MOE_TRY(t_grid(&grid, N, F, kpad, what, err));
    static const fwd_t_launcher launchers[2][3] = {
        {launch_fwd_t<MOE_FP8_E4M3, 2>, launch_fwd_t<MOE_FP8_E4M3, 3>,
         launch_fwd_t<MOE_FP8_E4M3, 4>},
        {launch_fwd_t<MOE_FP8_E5M2, 2>, launch_fwd_t<MOE_FP8_E5M2, 3>,
         launch_fwd_t<MOE_FP8_E5M2, 4>}};
    launchers[f == MOE_FP8_E5M2][fwd_t_blocks() - 2](grid, q, scale_inv, qt, st, gu, row_scale,
                                                     dev_off, G, N, F, kpad, pow2);
    MOE_CUDA_LAUNCH_CHECK();
    g_fwd_t_calls++;
    return MOE_OK;
}
