/**
 * @file optimizer.h
 * @brief AdamW with fp32 state, global-norm gradient clipping, and the learning-rate schedule.
 */
#ifndef MOE_OPTIMIZER_H
#define MOE_OPTIMIZER_H

#include <stddef.h>

#include "config.h"
#include "params.h"
#include "real.h"

/** AdamW state: the two moments, laid out like the parameters. */
typedef struct moe_adamw {
    float *m;          /**< first moment, fp32 */
    float *v;          /**< second moment, fp32 */
    size_t n;          /**< elements */
    long long step;    /**< steps taken (for bias correction) */
} moe_adamw;

/** @brief Allocate zeroed state for @p n parameters. @param opt state @param n count
 *  @param err receives the reason on failure @return ::MOE_OK or ::MOE_ERR_NOMEM */
moe_status moe_adamw_init(moe_adamw *opt, size_t n, moe_error *err);

/** @brief Free the state. @param opt state */
void moe_adamw_free(moe_adamw *opt);

/**
 * @brief One AdamW step (Loshchilov & Hutter): decoupled weight decay on tensors with
 *        `decay` set, bias-corrected moments.
 *        p ← p − lr·(m̂/(√v̂ + eps) + wd·p)
 * @param opt    state
 * @param pt     parameter table (which tensors decay)
 * @param params [n] parameters, updated in place
 * @param grads  [n] gradients
 * @param lr     learning rate
 * @param beta1  first-moment decay
 * @param beta2  second-moment decay
 * @param eps    denominator epsilon
 * @param wd     decoupled weight decay
 */
void moe_adamw_step(moe_adamw *opt, const moe_param_table *pt, moe_real *params,
                    const moe_real *grads, double lr, double beta1, double beta2, double eps,
                    double wd);

/**
 * @brief Global L2 norm of @p grads, and scale them by max_norm/norm when it exceeds @p max_norm.
 * @param grads [n]  @param n count  @param max_norm threshold (0 = measure only)
 * @return the norm before clipping
 */
double moe_clip_grad_norm(moe_real *grads, size_t n, double max_norm);

/**
 * @brief Learning rate at optimizer step @p step (0-based): linear warmup from 0 to --lr over
 *        --lr-warmup-iters, then cosine/linear decay to --min-lr at --lr-decay-iters, or constant.
 * @param cfg validated config  @param step step index  @return the rate
 */
double moe_lr_at(const moe_config *cfg, int step);

#endif /* MOE_OPTIMIZER_H */
