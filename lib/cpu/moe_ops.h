/**
 * @file moe_ops.h
 * @brief CPU ops specific to the MoE layer: token permutation (see permute.c).
 */
#ifndef MOE_CPU_MOE_OPS_H
#define MOE_CPU_MOE_OPS_H

#include "error.h"
#include "real.h"

/**
 * @brief Sort the N·k assignments by expert (stable) and build both maps.
 * @param perm_src      [N·k] assignment index n·k+j at each permuted row
 * @param row_of        [N·k] permuted row of each assignment
 * @param expert_offset [E+1] expert e owns rows [offset[e], offset[e+1])
 * @param counts        [E] incremented by each expert's token count (NULL to skip)
 * @param topk_idx      [N·k] router selection
 * @param N tokens  @param k experts per token  @param E experts (at most ::MOE_MAX_EXPERTS)
 */
void moe_cpu_permute_index(int *perm_src, int *row_of, int *expert_offset, long long *counts,
                           const int *topk_idx, int N, int k, int E);

/**
 * @brief moe_cpu_permute_index() with a static number of permuted rows, @p budget, and
 *        every output in backend memory (the sync-free layer of chapter 06): the same
 *        stable sort, but a row at or past the budget is not written.
 * @param perm_src      [min(N·k, budget)] assignment at each permuted row
 * @param row_of        [N·k] permuted row of each assignment, or -1 when that row would be
 *                      at or past the budget (the combine then skips the assignment)
 * @param expert_offset [E+1] expert e owns rows [offset[e], offset[e+1]), each offset
 *                      clamped to the budget
 * @param flags         the step-flags word: ::MOE_STEP_OVERFLOW is ORed in when the
 *                      assignments need more rows than the budget
 * @param topk_idx      [N·k] router selection
 * @param N tokens  @param k experts per token  @param E experts (at most ::MOE_MAX_EXPERTS)
 * @param budget rows the permuted buffers hold (>= 0)
 */
void moe_cpu_permute_index_budget(int *perm_src, int *row_of, int *expert_offset, int *flags,
                                  const int *topk_idx, int N, int k, int E, int budget);

/**
 * @brief The fused dispatcher's plan from the exchanged offsets, on the device (chapter 06:
 *        expert parallelism without the host). Rank p's permuted rows for global expert e
 *        are [all_off[p][e], all_off[p][e+1]) (its permute_index_budget offsets), so
 *        c[p][e] = all_off[p][e+1] − all_off[p][e] rows go from p to e's rank q = e / EL
 *        (EL = E / P). On q the expert layout is [local expert][source rank]: p's rows for
 *        e start at base[e] = Σ_{e' in q's experts before e} Σ_p' c[p'][e'] + Σ_{p' < p}
 *        c[p'][e]. For this rank r: shift[e] = base[e] − all_off[r][e] (row on q − permuted
 *        row, what the fused kernels add to row_of), and the local experts' offsets
 *        offset[el] = Σ_{l < el} Σ_p c[p][r·EL + l], clamped to @p budget, with
 *        ::MOE_STEP_OVERFLOW ORed into @p flags when offset[EL] (the rows r receives) exceeds
 *        it. The same arithmetic as the host plan (moe_dispatch_layout()); nothing leaves
 *        the device.
 * @param shift         [E] out: destination row on the expert's rank − permuted row here
 * @param expert_offset [EL+1] out: local expert el owns expert-side rows [off[el], off[el+1])
 * @param flags         the step-flags word (::MOE_STEP_OVERFLOW), or NULL
 * @param all_off       [P, E+1] every rank's permuted-row offsets (the all-gather of them)
 * @param P ranks in the EP group  @param rank this rank  @param E global experts (P divides E)
 * @param budget rows the expert-side buffers hold
 */
void moe_cpu_fused_plan(int *shift, int *expert_offset, int *flags, const int *all_off, int P,
                        int rank, int E, int budget);

/**
 * @brief xp[r] = x[perm_src[r] / k]: copy each token to its k permuted rows.
 * @param xp [rows, C]  @param x [N, C]  @param perm_src map  @param rows N·k  @param k top-k  @param C width
 */
void moe_cpu_permute_tokens(moe_real *xp, const moe_real *x, const int *perm_src, int rows, int k,
                            int C);

/**
 * @brief wp[r] = topk_w[perm_src[r]]: the routing weight of each permuted row.
 * @param wp [rows]  @param topk_w [N·k]  @param perm_src map  @param rows N·k
 */
void moe_cpu_permute_weights(moe_real *wp, const moe_real *topk_w, const int *perm_src, int rows);

/**
 * @brief out[n] += Σ_j yp[row_of[n·k+j]]: combine the k expert outputs of each token
 *        (an assignment with row_of = -1, over a budget, adds nothing).
 * @param out [N, C]  @param yp [N·k, C]  @param row_of map  @param N tokens  @param k top-k  @param C width
 */
void moe_cpu_unpermute_sum(moe_real *out, const moe_real *yp, const int *row_of, int N, int k,
                           int C);

/**
 * @brief out[n] += Σ_j ys[n·k+j] over the j with row_of[n·k+j] >= 0: moe_cpu_unpermute_sum()
 *        on rows already in token-slot order (the fused permutation's fc2 scattered them
 *        there), in the same order, so the same result bit for bit.
 * @param out [N, C]  @param ys [N·k, C] slot rows  @param row_of map (which slots exist)
 * @param N tokens  @param k top-k  @param C width
 */
void moe_cpu_unpermute_sum_slots(moe_real *out, const moe_real *ys, const int *row_of, int N,
                                 int k, int C);

/**
 * @brief dtopk_w[a] += dwp[row_of[a]]: routing-weight gradients back to token order
 *        (nothing where row_of[a] = -1).
 * @param dtopk_w [N·k]  @param dwp [N·k] permuted  @param row_of map  @param N tokens  @param k top-k
 */
void moe_cpu_unpermute_weights(moe_real *dtopk_w, const moe_real *dwp, const int *row_of, int N,
                               int k);

#endif /* MOE_CPU_MOE_OPS_H */
