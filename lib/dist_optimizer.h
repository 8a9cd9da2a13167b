/**
 * @file dist_optimizer.h
 * @brief The distributed optimizer (ZeRO-1, `--use-distributed-optimizer`): each
 *        data-parallel rank keeps the fp32 master weights and the AdamW moments of 1/DP of
 *        the parameters, as Megatron's distributed optimizer does.
 *
 * Without it every data-parallel replica all-reduces the gradients and runs the same AdamW
 * step on every parameter: DP copies of the same arithmetic, of the fp32 master weights
 * (4 bytes a parameter) and of the two fp32 moments (8 bytes). With it, each run of the flat
 * buffer whose gradient is summed over one group (dense tensors over DP x CP, expert shards
 * over EDP: moe_tensor::grad_group) is cut into `size` equal pieces, and
 *
 *   1. the gradients are **reduce-scattered** over the group: rank r receives the sum of
 *      piece r only (the same bytes on the wire as half an all-reduce);
 *   2. AdamW runs on piece r alone, with the master weights and moments of piece r alone
 *      (moe_adamw pieces, moe_adamw::master);
 *   3. each rank casts its updated piece into the compute copy of the weights (the model's
 *      moe_model::wact, in the activation type: bf16 on CUDA) and the compute copies are
 *      **all-gathered** in that type (moe_zero_gather_weights()), so every replica computes
 *      with the same weights again. On CUDA that is half the bytes of an fp32 gather.
 *
 * The communication is at most an all-reduce's; the master weights and moments shrink by the
 * group's size (12 bytes a parameter become 12/DP). The model then holds no fp32 master
 * (moe_model::params is NULL) and its compute copy is a buffer of its own even where the
 * activation type is fp32 (the CPU backend): there a rank holds the whole fp32 compute
 * weights plus 1/DP of the master, 4 + 4/DP bytes a parameter where it held 4 without, the
 * price of one code path for both backends. The gradient buffer stays whole on every rank
 * (ZeRO-1, not ZeRO-2): only its piece is summed. Checkpoints gather the master weights and
 * the moments (moe_zero_gather_to_host()), so a file holds them whole. Everything goes
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
 *        rank's is copied from @p mine): after the AdamW step, the compute copy of the
 *        weights (@p mine = @p full = moe_model::wact, moe_zero_gather_weights()); for a
 *        checkpoint or a test, the master weights or a moment (@p mine: this rank's pieces,
 *        moe_adamw::master or moe_adamw::m; @p full: a whole-size buffer).
 * @param z layout  @param opt the optimizer (its pieces' `state` offsets)
 * @param mine this rank's pieces: at each piece's lo in @p full when @p mine == @p full,
 *        else at its `state` offset  @param full [total] receives every piece
 * @param t element type (moe_dtype_act(), moe_dtype_real() or ::MOE_DTYPE_F32)
 */
void moe_zero_all_gather(moe_zero *z, const moe_adamw *opt, const void *mine, void *full,
                         moe_dtype t);

/**
 * @brief After the AdamW step: cast this rank's master pieces (moe_adamw::master) into the
 *        compute copy @p wact at their places [lo, hi), then all-gather the compute copy over
 *        each run's group in the activation type, so every rank holds all of it.
 * @param z layout  @param opt the optimizer (holds the master pieces)
 * @param wact [total] the model's compute copy of the weights (backend memory, activation type)
 */
void moe_zero_gather_weights(moe_zero *z, const moe_adamw *opt, void *wact);

/**
 * @brief The whole of a piece-laid-out buffer, gathered, in host memory: the master weights
 *        or a moment for a checkpoint or a test. Collective over every run's group.
 * @param z layout  @param opt the optimizer (its pieces)
 * @param mine this rank's pieces (moe_adamw::master, moe_adamw::m or moe_adamw::v)
 * @param total elements of the flat buffer  @param t their type (moe_dtype_real() or ::MOE_DTYPE_F32)
 * @param host [total] receives the whole buffer  @param err receives the reason on failure
 * @return ::MOE_OK or ::MOE_ERR_NOMEM (the whole-size backend buffer it gathers into)
 */
moe_status moe_zero_gather_to_host(moe_zero *z, const moe_adamw *opt, const void *mine,
                                   size_t total, moe_dtype t, void *host, moe_error *err);

#endif /* MOE_DIST_OPTIMIZER_H */
