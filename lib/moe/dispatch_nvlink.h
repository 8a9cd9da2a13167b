/**
 * @file dispatch_nvlink.h
 * @brief Chapter 02's fused dispatcher: permutation and transfer in one kernel, through
 *        memory the GPUs of the EP group share — the launchers of
 *        kernels/dispatch_nvlink.cu, called by lib/moe/dispatch_fused.c only.
 *
 * Both calls are collective over the group (every rank calls them in the same order) and
 * need moe_comm_peer_access() == 1. Rows are bf16 of width C (a multiple of 8); routing
 * weights are fp32. Assignment a = n·k + j of token n goes to expert e = idx[a] (e = E:
 * dropped) on rank e / EL, at row row_of[a] + shift[e] of that rank's buffers — when that
 * row is below @p cap, the rows the buffers hold (chapter 06's static budget: a row past it
 * is not stored, and combines as zero; the device plan has raised the overflow flag). The largest
 * k the kernels take is ::MOE_FUSED_MAX_TOPK (config.h, where validation checks it).
 */
#ifndef MOE_DISPATCH_NVLINK_H
#define MOE_DISPATCH_NVLINK_H

#include "comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/**
 * @brief Tokens to experts: token n's row of @p x [N, C] is stored into @p rows of the rank
 *        of each of its k experts, and w[a] into @p reals there (when @p reals is not NULL).
 * @param c EP group @param rows expert-side rows (symmetric) @param reals expert-side weights
 *        (symmetric) or NULL @param x [N, C] tokens @param w [N·k] routing weights
 * @param idx [N·k] expert per assignment (E: dropped) @param row_of [N·k] permuted row
 * @param shift [E] destination row − permuted row, per expert @param N tokens @param k top-k
 * @param E experts @param EL experts per rank @param C width
 * @param cap rows of the expert-side buffers (INT_MAX: every row fits)
 */
void moe_nvlink_dispatch(moe_comm *c, const moe_sym_buf *rows, const moe_sym_buf *reals,
                         const void *x, const float *w, const int *idx, const int *row_of,
                         const int *shift, int N, int k, int E, int EL, int C, int cap);

/**
 * @brief Experts to tokens, the reverse: out[n] (+)= Σ_j rows[row of (n, j)] from the
 *        expert's rank (fp32 sum in j order, one bf16 rounding, like unpermute_sum), and
 *        dwp[row_of[a]] = reals[row of a] (0 when dropped) when @p reals is not NULL.
 * @param c EP group @param out [N, C] @param accumulate 1: add to out, 0: overwrite
 * @param dwp [N·k] permuted-layout values, or NULL @param rows expert-side rows (symmetric)
 * @param reals expert-side values (symmetric) or NULL @param idx as for moe_nvlink_dispatch
 * @param row_of as for moe_nvlink_dispatch @param shift as for moe_nvlink_dispatch
 * @param N tokens @param k top-k @param E experts
 * @param EL experts per rank @param C width @param cap as for moe_nvlink_dispatch
 */
void moe_nvlink_combine(moe_comm *c, void *out, int accumulate, float *dwp,
                        const moe_sym_buf *rows, const moe_sym_buf *reals, const int *idx,
                        const int *row_of, const int *shift, int N, int k, int E, int EL, int C,
                        int cap);

#ifdef __cplusplus
}
#endif

#endif /* MOE_DISPATCH_NVLINK_H */
