/**
 * @file trainer.h
 * @brief The training loop as a library: data + model + optimizer, one step at a time.
 *
 * Programs (bin/moe-train, chapter programs) and tests share this, so "the
 * loss falls" and "same seed, same losses" are tested on the exact code users run.
 */
#ifndef MOE_TRAINER_H
#define MOE_TRAINER_H

#include "backend.h"
#include "comm.h"
#include "config.h"
#include "data.h"
#include "model.h"
#include "moe/dispatch.h"
#include "dist_optimizer.h"
#include "optimizer.h"
#include "parallel.h"

struct moe_trainer;
/** A test hook: called once per (re-)run of a step, after its forward and backward are
 *  enqueued and before its update; it may raise step flags (step_flags.h). */
typedef void (*moe_trainer_hook)(struct moe_trainer *t, void *ctx);

/** Everything a run holds. */
typedef struct moe_trainer {
    moe_config cfg;        /**< validated configuration */
    moe_dataset data;      /**< tokenized text */
    moe_model *model;      /**< the model */
    moe_adamw opt;         /**< optimizer state (this rank's pieces under ZeRO-1) */
    moe_zero zero;         /**< the distributed optimizer's layout (n_runs 0: not used) */
    int step;              /**< optimizer steps taken */
    int *inputs;           /**< host [micro·T] */
    int *targets;          /**< host [micro·T] */
    int *batch;            /**< page-locked [micro-batches of this rank][inputs, targets]
                            *   [micro·T]: a step's batches, fetched before the step and
                            *   uploaded without a wait (chapter 06: a captured step replays
                            *   the upload) */
    double *hyper_host;    /**< page-locked [3]: AdamW's {lr, 1 − β1ᵗ, 1 − β2ᵗ} of the step */
    moe_comm *world;       /**< all ranks (NULL: a single process) */
    moe_parallel par;      /**< the process groups of the parallel grid (parallel.h) */
    moe_ep ep;             /**< the dispatcher's context */
    moe_tp tp;             /**< this rank's tensor-parallel group (size 1 without TP) */
    moe_model_cp cp;       /**< context parallelism (cp.attn.cp = 1 without): its CP group,
                                exchange and the TP x CP group of the router statistics */
    int dp_size;           /**< data-parallel ranks: each runs its own micro-batches */
    int dp_rank;           /**< this rank's place among them */
    int rank;              /**< this rank in the world */
    int world_size;        /**< ranks in the world */
    moe_step_scalars *readback; /**< page-locked host copy of the model's step scalars, filled
                                     at each step boundary (step_scalars.h) */
    long long *load_host;  /**< page-locked [L·E] expert loads, read once per load_interval */
    int load_interval;     /**< read the expert loads every this many steps (--log-interval) */
    int loads_read;        /**< the loads were read at least once by this trainer */
    int reruns;            /**< steps run again after a MoE buffer overflow (chapter 06) */
    int amax_reduce;       /**< chapter 05, delayed scaling on several ranks: reduce the amax
                                windows over the replicas (1; MOE_FP8_AMAX_REDUCE=0: tests) */
    moe_trainer_hook step_hook; /**< tests only: see ::moe_trainer_hook (NULL: none) */
    /** grows the MoE budget after an overflow: moe_model_grow_moe_budget() (tests may put a
     *  stand-in here to drive the re-run loop) */
    moe_status (*grow_budget)(moe_model *m, moe_error *err);
    void *step_hook_ctx;   /**< its context */
} moe_trainer;

/** What one optimizer step did. */
typedef struct moe_step_stats {
    int step;              /**< the step's index (0-based) */
    double loss;           /**< mean total loss over the micro-batches */
    double local_loss;     /**< this rank's share of it, before the sum over ranks */
    double ce;             /**< mean cross-entropy */
    double aux;            /**< mean Σ-over-layers load-balancing loss */
    double z;              /**< mean Σ-over-layers z-loss */
    double lr;             /**< learning rate used */
    double grad_norm;      /**< global gradient norm before clipping */
    double seconds;        /**< wall time of the step */
    double tokens;         /**< tokens processed */
    double flops;          /**< training FLOPs of the step (moe_model_flops_per_token · tokens) */
    long long load_min;    /**< fewest tokens any expert of any MoE layer received */
    long long load_max;    /**< most tokens any expert received */
    double load_mean;      /**< mean tokens per expert (= tokens·k/E) */
    int load_read;         /**< 1 when this step read the expert loads back (the three fields
                                above are set): once per moe_trainer::load_interval steps */
    long long dropped;     /**< expert assignments dropped by the capacity (all ranks, layers) */
} moe_step_stats;

/**
 * @brief Load the data, validate the config against it, choose the backend, build and
 *        initialise the model and optimizer.
 * @param out receives the trainer  @param cfg parsed (not yet validated) config
 * @param err receives the reason on failure (bad flag values, missing data, no backend, …)
 * @return ::MOE_OK or the error's code
 */
moe_status moe_trainer_create(moe_trainer **out, const moe_config *cfg, moe_error *err);

/**
 * @brief moe_trainer_create for a distributed run. Every rank is data-parallel for the
 *        dense part (attention, router, norms: replicated, gradients summed over all ranks);
 *        the experts are split over EP groups of --expert-model-parallel-size consecutive
 *        ranks, and replicated over the world/EP expert-data-parallel groups (their
 *        gradients summed there). The groups come from the parallel grid (parallel.h) with
 *        TP = CP = PP = ETP = 1. The global batch is split evenly: rank r runs
 *        micro-batches [r·A, (r+1)·A) of each step, A = global/(micro·ranks). A distributed
 *        step computes the same loss and gradients as one process running every micro-batch.
 * @param out receives the trainer  @param cfg parsed config  @param world all ranks (NULL = one)
 * @param err receives the reason (e.g. EP that does not divide the ranks)
 * @return ::MOE_OK or the error's code
 */
moe_status moe_trainer_create_dist(moe_trainer **out, const moe_config *cfg, moe_comm *world,
                                   moe_error *err);

/** @brief Free everything. @param t trainer (NULL: no-op) */
void moe_trainer_free(moe_trainer *t);

/**
 * @brief The fp32 master weights, whole (this rank's layout: its TP/EP shards of every
 *        tensor), into host memory: moe_model::params, or under the distributed optimizer
 *        every rank's pieces gathered (dist_optimizer.h). For checkpoints, reference dumps
 *        and the tests that compare weights across layouts.
 * @param t trainer; under the distributed optimizer every rank of the run must call it (a
 *        collective over the gradient groups)
 * @param host [moe_model_num_params()] receives the weights
 * @param err receives the reason on failure
 * @return ::MOE_OK or ::MOE_ERR_NOMEM (the whole-size device buffer of the gather)
 */
moe_status moe_trainer_master_to_host(moe_trainer *t, moe_real *host, moe_error *err);

/**
 * @brief Set the fp32 master weights from a whole host copy (this rank's layout), and the
 *        compute copy from them: moe_model_set_weights(), and under the distributed
 *        optimizer this rank's pieces (moe_adamw::master). No communication.
 * @param t trainer  @param host [moe_model_num_params()] the weights
 */
void moe_trainer_master_from_host(moe_trainer *t, const moe_real *host);

/**
 * @brief One optimizer step: global/micro micro-batches forward+backward, clip, AdamW,
 *        expert-bias update.
 *
 * The whole step is enqueued without waiting for the device; the losses, the norm, the
 * clip factor and the step flags stay in backend memory (step_scalars.h) and come back
 * with one asynchronous copy and one wait at the end: the step boundary. Then:
 *  - ::MOE_STEP_OVERFLOW (a static MoE buffer was too small): the update was skipped on the
 *    device; moe_model_grow_moe_budget() grows the buffers and the same step (same batch,
 *    same weights) runs again, counted in moe_trainer::reruns and logged;
 *  - ::MOE_STEP_NONFINITE (with --check-for-nan-in-loss-and-grad, the default: a loss or
 *    global gradient norm that is NaN or infinite): the update was skipped on the device,
 *    so the weights, the optimizer state and the step counter stay those of the previous
 *    step, and the step returns the error. Every rank sees the same (summed) values, so
 *    every rank returns it at the same step.
 * @param t trainer  @param st receives the step's statistics
 * @param err receives the reason on failure (may be NULL)
 * @return ::MOE_OK, ::MOE_ERR_NONFINITE naming the step, the rank and the value, or the
 *         error of moe_model_grow_moe_budget()
 */
moe_status moe_trainer_step(moe_trainer *t, moe_step_stats *st, moe_error *err);

/**
 * @brief The first half of a step: every micro-batch of this rank forward and backward,
 *        gradients summed over the ranks that replicate them, losses and expert loads
 *        summed over all ranks. Fills loss, ce, aux, z, tokens, flops, seconds (it reads
 *        the losses back: a host sync, for tests that look between the halves).
 * @param t trainer  @param st receives the statistics so far
 */
void moe_trainer_gradients(moe_trainer *t, moe_step_stats *st);

/**
 * @brief The second half: global-norm clipping, AdamW, the compute-copy refresh and the
 *        expert-bias update; fills grad_norm, lr and the expert-load statistics. A step the
 *        device skipped (a flag raised) does not count.
 * @param t trainer  @param st statistics from moe_trainer_gradients, completed
 */
void moe_trainer_update(moe_trainer *t, moe_step_stats *st);

/**
 * @brief Mean cross-entropy over @p iters fixed batches of @p split (the same batches every call).
 * @param t trainer  @param split train or val  @param iters batches
 * @return mean cross-entropy
 */
double moe_trainer_evaluate(moe_trainer *t, moe_split split, int iters);

/**
 * @brief Generate @p n characters after a newline, sampling with temperature.
 * @param t trainer  @param n characters  @param temperature > 0  @param seed sampling seed
 * @param out receives n bytes and a terminating zero (size n+1)
 * Collective over the model's ranks: under TP and CP every rank calls it and gets the same
 * text (under CP each rank runs its two chunks of every window, and the rank holding the
 * last token's row shares its logits).
 */
void moe_trainer_sample(moe_trainer *t, int n, double temperature, uint64_t seed, char *out);

#endif /* MOE_TRAINER_H */
