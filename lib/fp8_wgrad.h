/**
 * @file fp8_wgrad.h
 * @brief Chapter 05: the routed experts' weight gradients in FP8 (blockwise recipe), the
 *        operands quantized 1×128 along the TOKENS per expert group, and the CPU twins of
 *        the two CUDA ops that compute them (kernels/quantize_group_t.cu,
 *        kernels/grouped_gemm_fp8_wgrad_sm90.cu).
 *
 * The weight gradient of expert g is a sum over that expert's tokens:
 *
 *   dW_g[o, i] = Σ_{t in group g} dY[t, o] · X[t, i]
 *
 * Hopper's FP8 wgmma reads both operands K-major, and here K is the tokens: so both dY and X
 * are needed TRANSPOSED, [channels][tokens], with their 1×128 scale blocks running along the
 * tokens (TransformerEngine's "columnwise" copy of the blockwise recipe, Megatron's wgrad
 * operand). A scale block must not mix two experts (their tokens are summed into different
 * matrices), so each group's tokens start at a multiple of 128:
 *
 *   padded start of group g   P_g = Σ_{h<g} ⌈n_h / 128⌉ · 128     (n_h = off[h+1] − off[h])
 *
 * and the copy is [C][Kpad] codes with [Kpad/128][C] fp32 scale_inv (1/scale), token t of
 * group g at column P_g + (t − off[g]); the columns P_g + n_g .. P_{g+1} − 1 hold zero codes
 * (they add nothing), the columns from P_G on are not written. Every 128-column block of a
 * group holds at least one token, so each scale is a real block's (amax, scale and codes as
 * moe_cpu_quant_blockwise() with block_2d = 0 would give for that block: the same MOE_HOSTDEV
 * rules). P_g is computed on the device from the offsets (sync-free); the host only knows a
 * bound of P_G, moe_fp8_wgrad_kpad().
 *
 * Why the scales are block-major ([Kpad/128][C], not [C][Kpad/128] as the row-wise 1×128
 * scales are): the GEMM needs, per k-block, the scales of a tile's 128 consecutive rows of A
 * and of B at once (a row scale times a column scale, below); block-major they are 512
 * contiguous bytes, so each thread's loads are coalesced and L1-friendly.
 *
 * The GEMM (the "wgrad mode" of the FP8 grouped GEMM): with A = dYᵀ's copy [M][Kpad] (M = O,
 * the rows of each dW_g) and B = Xᵀ's copy [N][Kpad] (N = I), for each group g
 *
 *   D_g[m, n] (+)= Σ_{kb in g's blocks} sa[kb][m] · sb[kb][n] · Σ_{k in block kb} qa[m, k]·qb[n, k]
 *
 * The scale of a k-block is a row scale times a column scale: it cannot leave the sum, and is
 * applied when each block's partial sum is promoted into the fp32 accumulator (as the forward
 * kernel does with its row × weight-block scale). D is [G][M][N] fp32 (the main gradient):
 * added to (an empty group leaves its block untouched) or stored (an empty group's block is
 * zeros); the CUDA op also stores bf16 (::MOE_DW_ACT), as chapter 03's bf16 wgrad does.
 *
 * Numerics against the emulation: the codes' values decode(q)·scale_inv are exactly
 * representable, so the GEMM on them is the emulated wgrad Q(dY)ᵀ·Q(X) with Q the token-wise
 * QDQ (moe_cpu_qdq_group_t()), up to the summation order.
 */
#ifndef MOE_FP8_WGRAD_H
#define MOE_FP8_WGRAD_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "quantize.h"

#ifdef __cplusplus
extern "C" {
#endif

/**
 * @brief The padded token columns a token-wise copy needs for any @p G groups of @p rows
 *        tokens in all: Σ ⌈n_g/128⌉·128 ≤ rows + 127·G, rounded down to a multiple of 128.
 * @param rows the tokens of all groups (or the static budget they end within)
 * @param G groups  @return Kpad, a multiple of 128 (0 when there can be no tokens)
 */
static inline MOE_HOSTDEV size_t moe_fp8_wgrad_kpad(int rows, int G) {
    const size_t n = (size_t)(rows > 0 ? rows : 0) + (size_t)127 * (size_t)(G > 0 ? G : 0);
    return n / MOE_QUANT_BLOCK * MOE_QUANT_BLOCK;
}

/**
 * @brief Check a token-wise quantization's arguments: 1 ≤ G ≤ MOE_GROUPED_DEV_MAX_GROUPS,
 *        rows ≥ 0, C > 0 a multiple of 128, Kpad a multiple of 128 and at least
 *        moe_fp8_wgrad_kpad(rows, G), a known format, the pointers given.
 * @param qt codes  @param st scales  @param x input  @param off offsets
 * @param G groups  @param rows rows of x  @param C its columns  @param kpad the copy's columns
 * @param f format  @param err receives the reason  @return ::MOE_OK or ::MOE_ERR_CONFIG
 */
moe_status moe_quant_group_t_check(const void *qt, const void *st, const void *x,
                                   const int *off, int G, int rows, int C, size_t kpad,
                                   moe_fp8_format f, moe_error *err);

/**
 * @brief The token-wise FP8 copy of x per group (the CPU twin of
 *        moe_cuda_quant_group_t_act()): codes qt [C][kpad] and scale_inv st [kpad/128][C],
 *        laid out as this file's header says.
 * @param qt [C][kpad] codes  @param st [kpad/128][C] scales  @param x [rows][C] values
 * @param off [G+1] host offsets, 0 = off[0] ≤ … ≤ off[G] ≤ rows
 * @param G groups  @param rows rows of x  @param C columns of x (a multiple of 128)
 * @param kpad the copy's columns (≥ moe_fp8_wgrad_kpad(rows, G))
 * @param f element format  @param pow2 1: power-of-two scales (the recipe's)
 * @param err receives the reason
 * @return ::MOE_OK, or ::MOE_ERR_CONFIG (moe_quant_group_t_check(), bad offsets)
 */
moe_status moe_cpu_quant_group_t(uint8_t *qt, float *st, const float *x, const int *off, int G,
                                 int rows, int C, size_t kpad, moe_fp8_format f, int pow2,
                                 moe_error *err);

/**
 * @brief The emulation's token-wise QDQ: y[t, c] = the dequantized value of x[t, c] in the
 *        copy moe_cpu_quant_group_t() makes (same blocks, same codes), in x's own layout.
 *        Rows from off[G] on are not written.
 * @param y [rows][C] output (may be x)  @param x [rows][C] input  @param off [G+1] host offsets
 * @param G groups  @param rows rows  @param C columns (a multiple of 128)
 * @param f format  @param pow2 power-of-two scales  @param err receives the reason
 * @return ::MOE_OK or ::MOE_ERR_CONFIG
 */
moe_status moe_cpu_qdq_group_t(float *y, const float *x, const int *off, int G, int rows, int C,
                               moe_fp8_format f, int pow2, moe_error *err);

/**
 * @brief The CPU twin of the FP8 grouped wgrad (moe_cuda_fp8_grouped_wgrad()): per group g
 *        and block, the block's exact sum of decoded code products times sa·sb, added into
 *        an fp32 accumulator (fmaf, as the kernel's promotion).
 * @param d [G][M][N] fp32  @param accumulate 1: d += (an empty group's block untouched);
 *        0: d = (an empty group's block zeros)
 * @param qa [M][kpad] codes of A (dYᵀ)  @param sa [kpad/128][M] its scale_inv
 * @param qb [N][kpad] codes of B (Xᵀ)  @param sb [kpad/128][N] its scale_inv
 * @param off [G+1] host offsets (the tokens', as given to the quantizer)
 * @param G groups  @param kpad columns of the copies  @param M rows of A and of each D_g
 * @param N rows of B, columns of D_g  @param err receives the reason
 * @return ::MOE_OK or ::MOE_ERR_CONFIG (shapes: M, N multiples of 128, bad offsets)
 */
moe_status moe_cpu_fp8_grouped_wgrad(float *d, int accumulate, const uint8_t *qa,
                                     const float *sa, const uint8_t *qb, const float *sb,
                                     const int *off, int G, size_t kpad, int M, int N,
                                     moe_error *err);

#ifdef __cplusplus
}
#endif

#endif /* MOE_FP8_WGRAD_H */
