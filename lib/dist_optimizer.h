/**
 * @file dist_optimizer.h
 * @brief The distributed optimizer (ZeRO-1, `--use-distributed-optimizer`): each
 *        data-parallel rank keeps the AdamW moments of 1/DP of the parameters.
 *
 * Without it every data-parallel replica all-reduces the gradients and runs the same AdamW
 * step on every parameter: DP copies of the same arithmetic and of the two fp32 moments
 * (8 bytes a parameter). With it, each run of the flat buffer whose gradient is summed over
 * one group (dense tensors over DP x CP, expert shards over EDP: moe_tensor::grad_group) is
 * cut into `size` equal pieces, and
 *
 *   1. the gradients are **reduce-scattered** over the group: rank r receives the sum of
 *      piece r only (the same bytes on the wire as half an all-reduce);
 *   2. AdamW runs on piece r alone, with moments for piece r alone (moe_adamw pieces);
 *   3. the updated parameters are **all-gathered** (the other half of the all-reduce), so
 *      every replica computes with the same weights again.
 *
 * The communication equals an all-reduce's; the moments shrink by the group's size. The
 * fp32 master weights stay whole on every rank (on CPU ranks they are the weights the model
 * computes with), and so does the gradient buffer: only its piece is summed. Everything goes
 * through comm.h, so it runs on MPI and on NCCL alike.
 */
#ifndef MOE_DIST_OPTIMIZER_H
#define MOE_DIST_OPTIMIZER_H

#include "backend.h"
#include "comm.h"
#include "optimizer.h"
#include "parallel.h"
#include "params.h"

/** One run of the flat buffer summed over one group, and this rank's piece of it. */
typedef struct moe_zero_run {
    size_t start;        /**< first element of the run */
    size_t len;          /**< its elements */
    size_t chunk;        /**< ⌈len / size⌉: every piece is this long (the last padded) */
    moe_group_kind kind; /**< the group (::MOE_GROUP_DP_CP or ::MOE_GROUP_EDP) */
    moe_comm *comm;      /**< its communicator (NULL: one rank) */
    int size;            /**< ranks in the group */
    int rank;            /**< this rank's place: it owns piece `rank` */
    moe_adamw_piece piece; /**< [lo, hi): this rank's piece in the flat buffer */
} moe_zero_run;

/** The distributed optimizer's layout and its staging buffer. */
typedef struct moe_zero {
    const moe_backend *be;  /**< where the buffers live */
    moe_zero_run run[MOE_ADAMW_MAX_PIECES]; /**< the runs, in buffer order */
    int n_runs;             /**< how many */
    void *scratch;          /**< backend memory: (size + 1)·chunk elements of the widest run */
    size_t scratch_bytes;   /**< its size */
} moe_zero;

/**
 * @brief Cut every gradient run of @p pt into its group's pieces and allocate the staging
 *        buffer; @p pieces receives this rank's piece of each run, for moe_adamw_init_pieces().
 * @param z layout (zeroed by the caller)  @param be backend  @param pt parameter table
 * @param par the process groups  @param pieces [::MOE_ADAMW_MAX_PIECES] receives the pieces
 * @param n_pieces receives their number  @param err receives the reason on failure
 * @return ::MOE_OK or ::MOE_ERR_NOMEM
 */
moe_status moe_zero_init(moe_zero *z, const moe_backend *be, const moe_param_table *pt,
                         const moe_parallel *par, moe_adamw_piece *pieces, int *n_pieces,
                         moe_error *err);

/** @brief Free the staging buffer. @param z layout */
void moe_zero_free(moe_zero *z);

/**
 * @brief Sum each run's gradient over its group, keeping only this rank's piece: afterwards
 *        elements [lo, hi) of each run hold the group's sum, the rest of the run is stale.
 * @param z layout  @param grads [total] the flat gradient buffer (backend memory)
 */
void moe_zero_reduce_scatter(moe_zero *z, moe_real *grads);

/**
 * @brief Every rank's piece of every run into @p full (the others' pieces arrive, this
 *        rank's is copied from @p mine): after the AdamW step, the parameters
 *        (@p mine = @p full = the flat buffer); for a checkpoint, a moment (@p mine: this
 *        rank's moments, moe_adamw::m; @p full: a whole-size buffer).
 * @param z layout  @param opt the optimizer (its pieces' `state` offsets)
 * @param mine this rank's pieces: at each piece's lo in @p full when @p mine == @p full,
 *        else at its `state` offset  @param full [total] receives every piece
 * @param t element type (moe_dtype_real() or ::MOE_DTYPE_F32)
 */
void moe_zero_all_gather(moe_zero *z, const moe_adamw *opt, const void *mine, void *full,
                         moe_dtype t);

#endif /* MOE_DIST_OPTIMIZER_H */
