/**
 * @file optimizer.h
 * @brief AdamW with fp32 state, global-norm gradient clipping, and the learning-rate schedule.
 *
 * Mixed precision the way Megatron does it: the optimizer owns the fp32 *master*
 * weights and updates them with fp32 gradients; the model computes with a copy in
 * the backend's activation type (bf16 on CUDA), refreshed after every step.
 * Everything runs through the backend's op table, so the state lives where the
 * parameters live.
 */
#ifndef MOE_OPTIMIZER_H
#define MOE_OPTIMIZER_H

#include <math.h>
#include <stddef.h>

#include "backend.h"
#include "config.h"
#include "params.h"
#include "real.h"

/** Most pieces of the flat buffer one optimizer updates (one per gradient group). */
#define MOE_ADAMW_MAX_PIECES 8

/** A piece of the flat parameter buffer that this rank's optimizer updates: elements
 *  [lo, hi), whose moments start at element @p state of moe_adamw::m and moe_adamw::v. */
typedef struct moe_adamw_piece {
    size_t lo;    /**< first element of the piece in the flat buffer */
    size_t hi;    /**< one past its last */
    size_t state; /**< its first moment element */
} moe_adamw_piece;

/** AdamW state: the two moments of the pieces this rank updates, in backend memory. Without
 *  the distributed optimizer there is one piece, the whole buffer, the moments are laid out
 *  like the parameters and the step updates the caller's fp32 master weights; with it
 *  (dist_optimizer.h) each rank holds 1/DP of the moments and of the fp32 master weights
 *  (moe_adamw::master), and the model keeps only its compute copy whole. */
typedef struct moe_adamw {
    const moe_backend *be; /**< where the state lives */
    float *m;              /**< first moment, fp32 */
    float *v;              /**< second moment, fp32 */
    moe_real *master;      /**< the fp32 master weights of the pieces, laid out like the
                                moments (piece k's at its `state` offset), or NULL: the step
                                updates the caller's whole buffer */
    size_t n;              /**< elements of each moment (Σ of the pieces' sizes) */
    moe_adamw_piece piece[MOE_ADAMW_MAX_PIECES]; /**< what this rank updates */
    int n_pieces;          /**< how many */
    moe_adamw_runs runs;   /**< the pieces cut into runs of one weight-decay choice, built
                                once at init (run list in backend memory): what one `adamw`
                                call walks */
    long long step;        /**< steps taken (for bias correction) */
} moe_adamw;

/**
 * @brief One element of AdamW (Loshchilov & Hutter), shared by every backend:
 *        m ← β1·m + (1−β1)·g,  v ← β2·v + (1−β2)·g²,
 *        p ← p − lr·( (m/bc1) / (√(v/bc2) + eps) + wd·p ).
 * @param p parameter (updated)  @param g gradient  @param m first moment (updated)
 * @param v second moment (updated)  @param lr learning rate  @param beta1 β1  @param beta2 β2
 * @param eps epsilon  @param wd weight decay  @param bc1 1−β1ᵗ  @param bc2 1−β2ᵗ
 */
static inline MOE_HOSTDEV void moe_adamw_update(moe_real *p, moe_real g, float *m, float *v,
                                                double lr, double beta1, double beta2, double eps,
                                                double wd, double bc1, double bc2) {
    double mm = beta1 * *m + (1.0 - beta1) * g;
    double vv = beta2 * *v + (1.0 - beta2) * (double)g * g;
    *m = (float)mm;
    *v = (float)vv;
    double upd = (mm / bc1) / (sqrt(vv / bc2) + eps) + wd * *p;
    *p = (moe_real)(*p - lr * upd);
}

/**
 * @brief Allocate zeroed state for every parameter of @p pt on backend @p be, and its run
 *        list (moe_adamw::runs).
 * @param opt state  @param be backend
 * @param pt parameter table: its size, and which tensors decay (read now, not kept)
 * @param err receives the reason on failure
 * @return ::MOE_OK or ::MOE_ERR_NOMEM
 */
moe_status moe_adamw_init(moe_adamw *opt, const moe_backend *be, const moe_param_table *pt,
                          moe_error *err);

/**
 * @brief Allocate zeroed state for the pieces @p pieces of the flat buffer only (the
 *        distributed optimizer: each rank updates its share of every gradient group), and
 *        the run list of those pieces (moe_adamw::runs).
 *
 * The runs: each tensor's part of each piece, since weight decay is per tensor; but the
 * update is elementwise, so neighbouring tensors with the same decay join one run (the GPU
 * preset's 57 tensors are 27 runs), and the `adamw` op walks all runs in one call (chapter
 * 06: one launch a step instead of one per run). The list depends on the table and the
 * pieces only, so it is built here once and copied to the backend.
 * @param opt state  @param be backend
 * @param pt parameter table (which tensors decay; read now, not kept)
 * @param pieces what this rank updates (their `state`
 *        fields are filled in: the pieces' moments back to back)  @param n_pieces 1 ..
 *        ::MOE_ADAMW_MAX_PIECES
 * @param keep_master 1: the optimizer also holds the fp32 master weights of its pieces
 *        (moe_adamw::master, zeroed: fill it with moe_adamw_pieces_from_host()), and the
 *        step updates them instead of the caller's buffer; 0: it holds moments only
 * @param err receives the reason on failure
 * @return ::MOE_OK or ::MOE_ERR_NOMEM (the state or the run list)
 */
moe_status moe_adamw_init_pieces(moe_adamw *opt, const moe_backend *be,
                                 const moe_param_table *pt, const moe_adamw_piece *pieces,
                                 int n_pieces, int keep_master, moe_error *err);

/**
 * @brief Copy this rank's pieces of a whole host buffer (laid out like the parameters) into
 *        a state buffer laid out like the moments: piece k's elements [lo, hi) of @p host go
 *        to element `state` of @p dst. For a checkpoint's moments and master weights, and the
 *        initial master weights.
 * @param opt state (its pieces)
 * @param dst backend memory: moe_adamw::m, moe_adamw::v or moe_adamw::master
 * @param host [total] the whole buffer  @param es bytes per element (of both)
 */
void moe_adamw_pieces_from_host(const moe_adamw *opt, void *dst, const void *host, size_t es);

/** @brief Free the state. @param opt state */
void moe_adamw_free(moe_adamw *opt);

/**
 * @brief One AdamW step over every element of this rank's pieces (the whole buffer unless
 *        moe_adamw_init_pieces() chose less): decoupled weight decay on the elements of
 *        tensors with `decay` set, bias-corrected moments. One call of the backend's
 *        `adamw` op over moe_adamw::runs.
 * @param opt    state
 * @param params [n] master parameters, updated in place (backend memory); unused (may be
 *               NULL) when the optimizer holds its own (moe_adamw::master), which it updates
 * @param grads  [n] gradients (backend memory)
 * @param act    [n] the model's compute copy of the weights (backend memory, activation
 *               type), or NULL: each element of the pieces receives what cast_to_act
 *               would write for its weight after the step (on a skipped step, for the
 *               unchanged weight), so the caller needs no cast pass afterwards
 * @param lr     learning rate
 * @param beta1  first-moment decay
 * @param beta2  second-moment decay
 * @param eps    denominator epsilon
 * @param wd     decoupled weight decay
 * @param clip   [1] backend memory: the clip factor the gradients are multiplied by (the
 *               trainer's, computed on the device), or NULL for none
 * @param flags  [1] backend memory: the step flags (step_flags.h); while a bit is set the
 *               update is skipped on the device, or NULL. opt->step still counts the call:
 *               the caller takes it back when it learns (at the step boundary) that the
 *               step was skipped.
 * @param hyper  NULL: this call counts the step (opt->step + 1) and computes the bias
 *               corrections for @p lr itself. Else [3] backend memory holding {lr, 1 − β1ᵗ,
 *               1 − β2ᵗ} from moe_adamw_next_hyper(), which already counted the step: the
 *               device reads them, so a captured step (chapter 06) replays with the current
 *               values, and @p lr is not used.
 */
void moe_adamw_step(moe_adamw *opt, moe_real *params, const moe_real *grads, void *act,
                    double lr, double beta1, double beta2, double eps,
                    double wd, const double *clip, const int *flags, const double *hyper);

/**
 * @brief Count the next AdamW step and write its scalars for moe_adamw_step()'s @p hyper:
 *        {lr, 1 − β1ᵗ, 1 − β2ᵗ} with t = the new opt->step.
 * @param opt state (its step count is incremented)  @param lr this step's learning rate
 * @param beta1 first-moment decay  @param beta2 second-moment decay
 * @param host [3] receives the values (host memory; the caller copies them to the device)
 */
void moe_adamw_next_hyper(moe_adamw *opt, double lr, double beta1, double beta2,
                          double host[3]);

/**
 * @brief Scale @p grads by moe_clip_factor() = max_norm/(norm + 1e-6) when @p norm exceeds @p max_norm (the norm
 *        may come from several ranks: see moe_trainer_update).
 * @param be backend holding the gradients  @param grads [n]  @param n count
 * @param norm their global L2 norm  @param max_norm threshold (0 = off)
 */
void moe_clip_grads(const moe_backend *be, moe_real *grads, size_t n, double norm,
                    double max_norm);

/**
 * @brief Global L2 norm of @p grads, and scale them by max_norm/norm when it exceeds @p max_norm.
 * @param be backend holding the gradients  @param grads [n]  @param n count
 * @param max_norm threshold (0 = measure only)
 * @return the norm before clipping
 */
double moe_clip_grad_norm(const moe_backend *be, moe_real *grads, size_t n, double max_norm);

/**
 * @brief Learning rate at optimizer step @p step (0-based): linear warmup from 0 to --lr over
 *        --lr-warmup-iters, then cosine/linear decay to --min-lr at --lr-decay-iters, or constant.
 * @param cfg validated config  @param step step index  @return the rate
 */
double moe_lr_at(const moe_config *cfg, int step);

#endif /* MOE_OPTIMIZER_H */
