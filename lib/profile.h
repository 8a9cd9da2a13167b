/**
 * @file profile.h
 * @brief Where the time of an MoE layer goes: an opt-in stage timer.
 *
 * The layer code marks the end of each stage (router, permutation, expert GEMMs, the
 * experts' element-wise work, unpermutation); the time since the previous mark is added
 * to that stage. Off by default, when a mark is one branch; on, every mark waits for the
 * device (the backend's timer), so a profiled run is slower than an unprofiled one and
 * only its shares are meaningful. Benchmarks turn it on for one extra, untimed run
 * (chapters/01-naive-moe/ch01_moe_layer_bench.c --breakdown).
 */
#ifndef MOE_PROFILE_H
#define MOE_PROFILE_H

#include "backend.h"

/** The stages of an MoE layer, forward and backward together. */
typedef enum moe_prof_stage {
    MOE_PROF_ROUTER = 0, /**< router GEMM, top-k, aux/z losses, and their backward */
    MOE_PROF_PERMUTE,    /**< index, permute tokens and weights (backward: gradients) */
    MOE_PROF_GEMM,       /**< the expert GEMMs: fc1, fc2, their dgrad and wgrad */
    MOE_PROF_EXPERT_OPS, /**< SwiGLU, routing-weight scaling, zeroing: element-wise work */
    MOE_PROF_UNPERMUTE,  /**< combine (backward: input and routing-weight gradients) */
    MOE_PROF_OTHER,      /**< anything else (dispatcher communication, shared expert) */
    MOE_PROF_STAGES
} moe_prof_stage;

/** Stage names for printing, indexed by ::moe_prof_stage. */
extern const char *const moe_prof_stage_names[MOE_PROF_STAGES];

/**
 * @brief Start profiling (clear the totals and start the clock, so the first mark
 *        measures from here), or stop it (the totals stay readable).
 * @param be the backend whose timer to use, or NULL to turn profiling off
 */
void moe_prof_start(const moe_backend *be);

/**
 * @brief Add the time since the previous mark (or the start) to a stage. No-op when off.
 * @param stage the stage that just ended
 */
void moe_prof_mark(moe_prof_stage stage);

/**
 * @brief The totals since moe_prof_start().
 * @return milliseconds per stage, indexed by ::moe_prof_stage
 */
const double *moe_prof_ms(void);

#endif /* MOE_PROFILE_H */
