/**
 * @file step_scalars.h
 * @brief The scalars of one training step, kept on the device until the step boundary.
 *
 * A step produces a handful of numbers the host wants: the loss and its parts, the global
 * gradient norm, the clip factor, the step flags (step_flags.h). Chapters 00–04 brought each
 * one to the host the moment it existed (an op returned a double), and every such return is a
 * host sync: the CPU waits for the GPU to drain, then enqueues the next kernel into an empty
 * queue. Chapter 06 keeps them in one small struct in backend memory instead. Ops accumulate
 * into its slots (`*acc += value`), the clip factor is computed from them on the device and
 * read by AdamW on the device, and the host copies the whole struct once per step, after the
 * step is enqueued, with one asynchronous copy into page-locked memory and one event wait.
 *
 * The struct is the same on the host and the device (plain doubles and one int, the layout
 * of the host compiler, which nvcc also uses), so that copy is a memcpy of the struct.
 * The two inline functions below are the arithmetic both backends run (MOE_HOSTDEV, like
 * moe_adamw_update()): one definition, so the CPU and the GPU do the same operations in the
 * same order and the host formula of chapters 00–04 is kept bit for bit.
 */
#ifndef MOE_STEP_SCALARS_H
#define MOE_STEP_SCALARS_H

#include <math.h>

#include "real.h"
#include "step_flags.h"

/** Slots of the per-group squares: one per process-group kind, and one for tensors held
 *  whole (parallel.h: MOE_GROUP_COUNT + 1, checked where the trainer fills them). */
#define MOE_STEP_NORM_SLOTS 11

/** The clip's epsilon: factor = max_norm / (norm + eps) (Megatron's clip_grad_norm). */
#define MOE_CLIP_EPS 1e-6

/** Where the step's scalars live (one per model, in backend memory). */
typedef struct moe_step_scalars {
    /* this micro-batch (written by the forward, zeroed at its start) */
    double mb[3];        /**< {Σ of the per-token cross-entropies, Σ_layers aux, Σ_layers z} */
    /* the step, over its micro-batches (already / accum) and, after the all-reduce, ranks */
    double step[4];      /**< {loss, ce, aux, z}: Σ (ce + aux + z)/accum, Σ ce/accum, … */
    double local_loss;   /**< step[0] of this rank, before the sum over data-parallel ranks */
    double sumsq[MOE_STEP_NORM_SLOTS]; /**< Σ g² of each gradient shard group (trainer.c) */
    double part[MOE_STEP_NORM_SLOTS];  /**< a run's piece under the distributed optimizer */
    double grad_norm;    /**< √(Σ sumsq), after the group all-reduces */
    double clip;         /**< the factor AdamW multiplies the gradients by (1: no clip) */
    double hyper[3];     /**< AdamW's {lr, 1 − β1ᵗ, 1 − β2ᵗ} of this step, copied in from the
                          *   host after the step's zeroing (moe_adamw_next_hyper()) */
    int flags;           /**< MOE_STEP_* bits raised this step (moe_model::step_flags) */
    int pad;             /**< keeps the size a multiple of 8 */
} moe_step_scalars;

/** @brief The clip factor: max_norm / (norm + ::MOE_CLIP_EPS) when @p norm exceeds
 *  @p max_norm (> 0), else 1 (a NaN norm compares false: no clip).
 *  @param norm global L2 norm  @param max_norm threshold (0 = off)  @return the factor */
static inline MOE_HOSTDEV double moe_clip_factor(double norm, double max_norm) {
    return max_norm > 0 && norm > max_norm ? max_norm / (norm + MOE_CLIP_EPS) : 1.0;
}

/**
 * @brief One micro-batch's losses into the step's: with ce = mb[0]/N and the step's
 *        accum micro-batches, loss += (ce + aux + z)/accum, ce += ce/accum, aux +=
 *        mb[1]/accum, z += mb[2]/accum (the order of chapter 00's host code).
 * @param step {loss, ce, aux, z}, updated  @param mb {Σ CE, aux, z}  @param N tokens of the
 *        micro-batch  @param accum micro-batches of the step over all ranks
 */
static inline MOE_HOSTDEV void moe_step_loss_accumulate(double *step, const double *mb, int N,
                                                        double accum) {
    const double ce = mb[0] / N, total = ce + mb[1] + mb[2];
    step[0] += total / accum;
    step[1] += ce / accum;
    step[2] += mb[1] / accum;
    step[3] += mb[2] / accum;
}

/**
 * @brief The global norm from the groups' squares (the whole tensors' slot first, then the
 *        groups in kind order), its clip factor, and ::MOE_STEP_NONFINITE when @p check and
 *        the loss or the norm is not finite. A non-zero flags word on entry (overflows,
 *        perhaps summed over ranks) becomes ::MOE_STEP_OVERFLOW.
 * @param s the step's scalars (grad_norm, clip, flags written)  @param max_norm --clip-grad
 * @param check --check-for-nan-in-loss-and-grad
 */
static inline MOE_HOSTDEV void moe_step_grad_norm_finalize(moe_step_scalars *s, double max_norm,
                                                           int check) {
    /* until here only the forward raises a flag (::MOE_STEP_OVERFLOW), and the trainer may
     * have summed the word over the ranks: any count of overflows is the one bit */
    s->flags = s->flags ? MOE_STEP_OVERFLOW : 0;
    double total = s->sumsq[MOE_STEP_NORM_SLOTS - 1];
    for (int g = 0; g < MOE_STEP_NORM_SLOTS - 1; g++)
        total += s->sumsq[g];
    s->grad_norm = sqrt(total);
    s->clip = moe_clip_factor(s->grad_norm, max_norm);
    if (check && (!isfinite(s->step[0]) || !isfinite(s->grad_norm)))
        s->flags |= MOE_STEP_NONFINITE;
}

#endif /* MOE_STEP_SCALARS_H */
