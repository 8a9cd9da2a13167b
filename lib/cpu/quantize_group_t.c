/*
 * Token-wise blockwise FP8 per expert group on the CPU (chapter 05, lib/fp8_wgrad.h): the
 * reference of the CUDA quantize + transpose for the FP8 wgrad (kernels/quantize_group_t.cu)
 * and the emulation's QDQ with the same blocks.
 *
 * One block is (channel c, 128 tokens of one group): its amax over those tokens only (the
 * padding past the group's end holds no token), its scale by the rules every blockwise
 * quantizer shares (moe_q_scale_from_amax, moe_q_cast_scaled: the CUDA kernel calls the same
 * MOE_HOSTDEV functions, so the bytes agree exactly).
 */
#include "config.h" /* MOE_GROUPED_DEV_MAX_GROUPS */
#include "fp8_wgrad.h"

moe_status moe_quant_group_t_check(const void *qt, const void *st, const void *x,
                                   const int *off, int G, int rows, int C, size_t kpad,
                                   moe_fp8_format f, moe_error *err) {
    if (G < 1 || G > MOE_GROUPED_DEV_MAX_GROUPS)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "token-wise FP8 (wgrad operand): G=%d groups, give 1 to %d", G,
                             MOE_GROUPED_DEV_MAX_GROUPS);
    if (rows < 0 || C <= 0 || C % MOE_QUANT_BLOCK)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "token-wise FP8 (wgrad operand): [%d, %d]: the rows must be >= 0 "
                             "and the columns a positive multiple of %d (the GEMM's tile)",
                             rows, C, MOE_QUANT_BLOCK);
    if (kpad % MOE_QUANT_BLOCK || kpad < moe_fp8_wgrad_kpad(rows, G))
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "token-wise FP8 (wgrad operand): kpad=%zu columns; give a "
                             "multiple of %d of at least moe_fp8_wgrad_kpad(%d, %d) = %zu",
                             kpad, MOE_QUANT_BLOCK, rows, G, moe_fp8_wgrad_kpad(rows, G));
    if (f != MOE_FP8_E4M3 && f != MOE_FP8_E5M2)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "token-wise FP8 (wgrad operand): unknown FP8 format %d", (int)f);
    if ((!qt || !st) || !x || !off)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "token-wise FP8 (wgrad operand): a pointer is NULL");
    return MOE_OK;
}

static moe_status check_off(const int *off, int G, int rows, moe_error *err) {
    if (off[0] != 0 || off[G] > rows)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "token-wise FP8: offsets run from %d to %d, not 0 to <= rows=%d",
                             off[0], off[G], rows);
    for (int g = 0; g < G; g++)
        if (off[g + 1] < off[g])
            return moe_error_set(err, MOE_ERR_CONFIG,
                                 "token-wise FP8: offsets decrease at group %d", g);
    return MOE_OK;
}

/* the block (column c, tokens t0 .. t1 − 1 of x [*, C]): its scale (see the file header) */
static float block_scale(const float *x, int C, int c, int t0, int t1, moe_fp8_format f,
                         int pow2) {
    uint32_t m = 0;
    for (int t = t0; t < t1; t++) {
        const uint32_t k = moe_q_abs_key(x[(size_t)t * C + c]);
        m = k > m ? k : m;
    }
    return moe_q_scale_from_amax(moe_q_key_amax(m), moe_fp8_max(f), pow2);
}

/* Every 128-token block of every group and column, with its scale: the codes into qt [C][kpad]
 * (each group from its padded start, the padding zero codes) and the 1/scales into st
 * [kpad/128][C] when qt is not NULL; the dequantized values into y [rows, C] (which may be
 * x: each element is read, then written) when y is not NULL. */
static void group_t_blocks(uint8_t *qt, float *st, size_t kpad, float *y, const float *x,
                           const int *off, int G, int C, moe_fp8_format f, int pow2) {
    const int B = MOE_QUANT_BLOCK;
    size_t p = 0; /* the group's padded start */
    for (int g = 0; g < G; g++) {
        const int n = off[g + 1] - off[g], nb = (n + B - 1) / B;
#pragma omp parallel for schedule(static) if ((size_t)n * C > 65536)
        for (int c = 0; c < C; c++)
            for (int kb = 0; kb < nb; kb++) {
                const int t0 = off[g] + kb * B, t1 = t0 + B < off[g + 1] ? t0 + B : off[g + 1];
                const float scale = block_scale(x, C, c, t0, t1, f, pow2);
                const float si = moe_q_scale_inv(scale);
                if (qt) {
                    uint8_t *dst = qt + (size_t)c * kpad + p + (size_t)kb * B;
                    for (int i = 0; i < B; i++)
                        dst[i] = t0 + i < t1
                                     ? moe_q_cast_scaled(x[(size_t)(t0 + i) * C + c], scale, f)
                                     : 0;
                    st[(p / B + kb) * (size_t)C + c] = si;
                }
                for (int t = t0; y && t < t1; t++) {
                    const size_t i = (size_t)t * C + c;
                    y[i] = moe_q_dequant(moe_fp8_decode(moe_q_cast_scaled(x[i], scale, f), f), si);
                }
            }
        p += (size_t)nb * B;
    }
}

moe_status moe_cpu_quant_group_t(uint8_t *qt, float *st, const float *x, const int *off, int G,
                                 int rows, int C, size_t kpad, moe_fp8_format f, int pow2,
                                 moe_error *err) {
    MOE_TRY(moe_quant_group_t_check(qt, st, x, off, G, rows, C, kpad, f, err));
    MOE_TRY(check_off(off, G, rows, err));
    group_t_blocks(qt, st, kpad, NULL, x, off, G, C, f, pow2);
    return MOE_OK;
}

moe_status moe_cpu_qdq_group_t(float *y, const float *x, const int *off, int G, int rows, int C,
                               moe_fp8_format f, int pow2, moe_error *err) {
    const uint8_t dummy = 0;
    MOE_TRY(moe_quant_group_t_check(&dummy, &dummy, x, off, G, rows, C,
                                    moe_fp8_wgrad_kpad(rows, G), f, err));
    MOE_TRY(check_off(off, G, rows, err));
    group_t_blocks(NULL, NULL, 0, y, x, off, G, C, f, pow2);
    return MOE_OK;
}
