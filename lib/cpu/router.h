/**
 * @file router.h
 * @brief The MoE router and its load-balancing losses (CPU reference).
 *
 * The router maps each token's logits z ∈ R^E (E experts) to k expert indices
 * and k routing weights. The variants of Megatron Core that moe.c implements
 * (docs/megatron.md lists those it does not):
 *
 * | variant | selection | weights |
 * |---|---|---|
 * | softmax (default) | top-k of z | softmax over the k selected z (sum to 1) |
 * | softmax, pre-softmax | top-k of p = softmax(z) over all E | p of the selected, no renorm |
 * | sigmoid | top-k of σ(z) + bias | σ(z) of the selected, renormalised when k > 1 |
 * | group-limited (any of the above) | only inside the best groups | as above |
 *
 * Group-limited routing: the E experts form G groups; a group's score is the
 * sum of its top k/GK selection scores; the GK best groups are kept, the other
 * experts masked to −∞, then top-k as usual. An optional scaling factor
 * multiplies the final weights. Ties in every top-k go to the lower index.
 */
#ifndef MOE_CPU_ROUTER_H
#define MOE_CPU_ROUTER_H

#include "config.h"
#include "op_types.h"
#include "real.h"

/** @brief Router parameters from a validated config. @param cfg config @return the parameters */
moe_router_params moe_router_params_from_config(const moe_config *cfg);

/**
 * @brief Route N tokens.
 * @param topk_idx  [N,k] selected experts, best first
 * @param topk_w    [N,k] routing weights
 * @param logits    [N,E] router logits (fp32 math)
 * @param bias      [E] expert bias added to the selection score (sigmoid only), or NULL
 * @param p         router parameters
 * @param N         tokens
 */
void moe_cpu_router_forward(int *topk_idx, moe_real *topk_w, const moe_real *logits,
                            const float *bias, const moe_router_params *p, int N);

/**
 * @brief Backward of the routing weights w.r.t. the logits (selection is piecewise constant).
 * @param dlogits  [N,E] accumulated
 * @param dtopk_w  [N,k] gradient of the routing weights
 * @param logits   [N,E] forward logits
 * @param topk_idx [N,k] forward selection
 * @param p        router parameters
 * @param N        tokens
 */
void moe_cpu_router_backward(moe_real *dlogits, const moe_real *dtopk_w, const moe_real *logits,
                             const int *topk_idx, const moe_router_params *p, int N);

/**
 * @brief Load-balancing loss, summed over groups of @p group_len tokens and averaged over groups:
 *        per group, coeff·E/(k·T²)·Σ_i c_i·Σ_t s_{t,i} with T = group_len, s the scores of a
 *        full softmax over E (sigmoid router: σ(z)/Σσ(z)), c_i the counts of a plain top-k on s.
 *        group_len = N is Megatron's `aux_loss`; group_len = seq_length its `seq_aux_loss`.
 *        At perfect balance the loss equals coeff.
 * @param logits [N,E]  @param N tokens  @param group_len tokens per group (divides N)
 * @param E experts  @param k top-k  @param fn score function  @param coeff coefficient
 * @return the loss
 */
double moe_cpu_aux_loss_forward(const moe_real *logits, int N, int group_len, int E, int k,
                                moe_score_fn fn, double coeff);

/**
 * @brief Backward of moe_cpu_aux_loss_forward (counts are constants: only the scores carry
 *        gradient). @param dlogits [N,E] accumulated  @param logits [N,E]  @param N tokens
 * @param group_len tokens per group  @param E experts  @param k top-k  @param fn score function
 * @param coeff coefficient  @param scale upstream gradient of the loss
 */
void moe_cpu_aux_loss_backward(moe_real *dlogits, const moe_real *logits, int N, int group_len,
                               int E, int k, moe_score_fn fn, double coeff, double scale);

/**
 * @brief The counts of the aux loss from this rank's rows: counts[g·E + i] = how many of its
 *        rows in group g have expert i in the plain top-k of their scores (zero for groups it
 *        holds no row of). Summed over the ranks that share the groups, they are the c_i of
 *        moe_cpu_aux_loss_forward().
 * @param counts [groups,E] overwritten  @param logits [N,E] this rank's rows  @param s shape
 */
void moe_cpu_aux_loss_counts(long long *counts, const moe_real *logits, const moe_aux_shape *s);

/**
 * @brief This rank's part of the aux loss, with counts summed over every rank's rows:
 *        (1/groups)·Σ_g coeff·E/(k·group_len²)·Σ_i c_{g,i}·Σ_{t of its rows in g} s_{t,i}.
 *        The parts of the ranks add up to moe_cpu_aux_loss_forward() of all the rows.
 * @param logits [N,E] this rank's rows  @param counts [groups,E] counts of every rank's rows
 * @param s shape  @param coeff coefficient  @return this rank's part of the loss
 */
double moe_cpu_aux_loss_forward_shard(const moe_real *logits, const long long *counts,
                                      const moe_aux_shape *s, double coeff);

/**
 * @brief Backward of moe_cpu_aux_loss_forward_shard(): the gradient of this rank's rows
 *        (counts are constants). @param dlogits [N,E] accumulated  @param logits [N,E]
 * @param counts [groups,E] every rank's counts  @param s shape  @param coeff coefficient
 * @param scale upstream gradient of the loss
 */
void moe_cpu_aux_loss_backward_shard(moe_real *dlogits, const moe_real *logits,
                                     const long long *counts, const moe_aux_shape *s,
                                     double coeff, double scale);

/**
 * @brief Router z-loss: coeff · mean_t(logsumexp(z_t)²) — keeps logits small (ST-MoE).
 * @param logits [N,E]  @param N tokens  @param E experts  @param coeff coefficient  @return the loss
 */
double moe_cpu_z_loss_forward(const moe_real *logits, int N, int E, double coeff);

/**
 * @brief Backward of the z-loss: dz += scale·coeff·2·lse_t·softmax(z_t)/N.
 * @param dlogits [N,E] accumulated  @param logits [N,E]  @param N tokens  @param E experts
 * @param coeff coefficient  @param scale upstream gradient
 */
void moe_cpu_z_loss_backward(moe_real *dlogits, const moe_real *logits, int N, int E, double coeff,
                             double scale);

/**
 * @brief Aux-loss-free balancing: b_i += rate·sign(mean(c) − c_i), once per global batch.
 *        Under-loaded experts become more attractive, over-loaded ones less.
 * @param bias [E] fp32 expert bias (not a trained parameter)  @param counts [E] tokens routed
 *        to each expert over the global batch (summed over data-parallel ranks)
 * @param E experts  @param rate update rate
 */
void moe_expert_bias_update(float *bias, const long long *counts, int E, double rate);

#endif /* MOE_CPU_ROUTER_H */
