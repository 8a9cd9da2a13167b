/*
 * Chapter 05's token-wise FP8 copy per expert group (lib/fp8_wgrad.h): the operands of the
 * FP8 wgrad, [C][Kpad] codes with each group's tokens from a 128-aligned column, 1×128
 * blocks along the tokens, scales [Kpad/128][C]. Equal byte for byte to
 * moe_cpu_quant_group_t (the same MOE_HOSTDEV rules; the amax is a maximum of integer keys,
 * which any order gives alike).
 *
 * One 256-thread block per (128 channels, one padded 128-token block): grid (C/128, Kpad/128),
 * Kpad the host's bound (moe_fp8_wgrad_kpad). The block finds its group on the device: the
 * groups' padded starts by a scan over the offsets (moe_wgrad_block_prefix, fp8_wgrad.cuh),
 * then the one thread whose group holds blockIdx.y says so; blocks past the last group's
 * padded end return at once. The 128 tokens × 128 channels of bf16 go to shared memory (a
 * token past the group's end as 0: its key is 0, it cannot raise an amax), then each warp quantizes 16 channels, a lane 4 tokens (lane + 32k),
 * as the transposed half of blockwise_t_kernel: the transposed codes of a channel are one
 * 128-byte run of its row of the copy.
 * With y (the emulation's QDQ, moe_cpu_qdq_group_t's values rounded to bf16), the
 * dequantized values go back to x's own layout [rows][C] (the GPU's emulated path), and the
 * codes are written only when qt is given.
 */
#include "cuda_common.cuh"
#include "cuda_ops.h"
#include "fp8_wgrad.cuh"
#include "fp8_wgrad.h"

namespace {

/* the tile in bf16 (the input's own values: exact), 130 a row: a column read by a warp (one
 * row a lane, 65 words apart) hits 32 banks */
constexpr int B = MOE_QUANT_BLOCK, LD = B + 2, THREADS = 256;
static_assert(THREADS >= MOE_GROUPED_DEV_MAX_GROUPS, "moe_wgrad_block_prefix: a thread a group");

__global__ void __launch_bounds__(THREADS)
    group_t_kernel(uint8_t *qt, float *st, moe_bf16 *y, const moe_bf16 *x, const int *off,
                   int G, int C, size_t kpad, moe_fp8_format f, int pow2) {
    __shared__ moe_bf16 tile[B * LD];            /* 33 KB */
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
        tile[r * LD + c] = r < nt ? x[(size_t)(t0 + r) * C + c0 + c] : moe_st(0.0f);
    }
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float fmax = moe_fp8_max(f);
    for (int j = warp * 16; j < warp * 16 + 16; j++) {
        float v[4];
        uint32_t m = 0;
        for (int k = 0; k < 4; k++) {
            v[k] = moe_ld(tile[(lane + 32 * k) * LD + j]);
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

moe_status launch(uint8_t *qt, float *st, moe_bf16 *y, const moe_bf16 *x, const int *dev_off,
                  int G, int C, size_t kpad, moe_fp8_format f, int pow2) {
    if (kpad == 0)
        return MOE_OK;
    const dim3 grid(C / B, (unsigned)(kpad / B));
    group_t_kernel<<<grid, THREADS, 0, moe_cuda_stream()>>>(qt, st, y, x, dev_off, G, C, kpad,
                                                            f, pow2);
    MOE_CUDA_LAUNCH_CHECK();
    return MOE_OK;
}

} /* namespace */

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
