/**
 * @file memory.h
 * @brief What a model of a configuration will allocate, computed before anything is.
 *
 * Every size is computed in 64-bit integers with overflow checks, from the flags alone,
 * so a configuration whose sizes do not fit is refused with a named error before a
 * single byte is allocated: moe_config_validate() rejects sizes that overflow or that
 * the ops cannot index (a buffer of more than INT_MAX elements: the ops count rows and
 * elements with int), and moe_model_create() compares the total with the memory the
 * backend has (moe_memory_check()), so a huge but consistent configuration gets "needs
 * 3.1 TB, the device has 80 GB; reduce --micro-batch-size ..." instead of a crash.
 *
 * The estimate follows the allocations of model.c, moe/layer.c and attention.c buffer
 * by buffer (parameters, gradients, AdamW moments, the compute copy; the activations of
 * one micro-batch; the expert-side rows of one MoE layer, counted as if every token of
 * the EP group came to this rank; chapter 05's native FP8 path keeps the routed experts'
 * SwiGLU outputs as FP8 codes, moe_mlp_act_bytes(), where the flags allow it on a bf16
 * backend). With tensor parallelism (the config's
 * `--tensor-model-parallel-size`, `--sequence-parallel`) it counts this rank's shards of
 * the split tensors and the rows it holds (tensor_parallel.h, moe/layer.h). It is an
 * estimate, not an accountant: a unit test keeps it within a factor of two of what the
 * CPU backend really allocates, and the MPI tests check its parameter count on every
 * rank of a folded layout exactly, and its optimizer state under the distributed optimizer
 * (moe_memory_estimate_rank()) against the pieces the ranks really keep.
 */
#ifndef MOE_MEMORY_H
#define MOE_MEMORY_H

#include <stddef.h>

#include "config.h"
#include "error.h"
#include "parallel.h"

/** The memory a model will take on one rank, in bytes (and the largest buffer). */
typedef struct moe_memory_estimate {
    long long params;          /**< parameters held by this rank (its expert shard) */
    long long dense_params;    /**< of which on the attention/dense grid (replicated over
                                    DP x CP: their gradients are summed there) */
    long long expert_params;   /**< of which the routed experts' shard (replicated over EDP) */
    long long optim_elems;     /**< parameters whose AdamW moments (and, under the distributed
                                    optimizer, fp32 master weights) this rank keeps: all of
                                    them, or under the distributed optimizer its pieces */
    long long zero_staging_bytes; /**< the distributed optimizer's staging buffer (0 without) */
    long long weight_bytes;    /**< fp32 master weights and the compute copy (if another
                                    type); under the distributed optimizer the whole compute
                                    copy (activation type) and the master of optim_elems only */
    long long grad_bytes;      /**< fp32 gradients */
    long long optim_bytes;     /**< the two fp32 AdamW moments (8 bytes x optim_elems) and the
                                    staging buffer */
    long long param_bytes;     /**< weight_bytes + grad_bytes + optim_bytes */
    long long act_bytes;       /**< activations and workspaces of one micro-batch */
    long long total_bytes;     /**< param_bytes + act_bytes */
    long long fp8_act_bytes;   /**< chapter 05's native FP8: of act_bytes, the routed
                                    experts' SwiGLU outputs kept for the backward as FP8 codes
                                    and 1×128 scales (moe_mlp_act_bytes()), and in the
                                    token-wise form their inputs' copy too
                                    (moe_layer_keeps_x_t()); 0 where they are kept
                                    in the activation type */
    long long fp8_act_bf16_bytes; /**< what those would take in bf16 (0 likewise) */
    long long largest;         /**< elements of the largest single buffer */
    const char *largest_name;  /**< its name ("logits", "moe.gu", ...) */
} moe_memory_estimate;

/**
 * @brief Estimate what moe_model_create() allocates for @p c on one rank.
 * @param c configuration, validated far enough that its sizes are positive and its MoE
 *          mask is resolved (moe_config_validate() calls this as its last check)
 * @param micro_batch sequences per forward (the model's B)
 * @param ep_size ranks the experts are split over (1: all on this rank)
 * @param act_size bytes per activation element of the backend (4 on the CPU, 2 on CUDA)
 * @param out receives the estimate
 * @param err receives the reason on failure
 * @return ::MOE_OK; ::MOE_ERR_CONFIG when a size overflows 64 bits or a buffer has more
 *         than INT_MAX elements, naming the buffer, its size and the flags that set it
 */
moe_status moe_memory_estimate_model(const moe_config *c, int micro_batch, int ep_size,
                                     size_t act_size, moe_memory_estimate *out, moe_error *err);

/**
 * @brief The estimate of one rank of a parallel grid: moe_memory_estimate_model() with the
 *        grid's EP, and under `--use-distributed-optimizer` (dist_optimizer.h) the moments and
 *        fp32 master weights of this rank's pieces only: ⌈dense / (DP·CP)⌉ + ⌈experts / EDP⌉
 *        parameters' worth (the pieces of a rank at position 0 of both groups, the largest),
 *        plus the staging buffer of the reduce-scatter and all-gather, and the whole compute
 *        copy of the weights in the activation type.
 * @param c configuration (its TP, SP and distributed-optimizer flags are read)
 * @param micro_batch sequences per forward  @param g the resolved grid (moe_grid_resolve())
 * @param act_size bytes per activation element  @param out receives the estimate
 * @param err receives the reason on failure
 * @return ::MOE_OK or ::MOE_ERR_CONFIG, as moe_memory_estimate_model()
 */
moe_status moe_memory_estimate_rank(const moe_config *c, int micro_batch, const moe_grid *g,
                                    size_t act_size, moe_memory_estimate *out, moe_error *err);

/**
 * @brief Refuse an estimate larger than the memory there is.
 * @param e the estimate  @param available bytes the device has (0: unknown, always passes)
 * @param device "CPU memory", "GPU memory", for the message
 * @param err receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_NOMEM with the estimate, what is available and the flags
 *         to reduce
 */
moe_status moe_memory_check(const moe_memory_estimate *e, unsigned long long available,
                            const char *device, moe_error *err);

/** @brief Bytes of physical memory of this machine (0 when unknown).
 *  @return bytes */
unsigned long long moe_memory_host_bytes(void);

#endif /* MOE_MEMORY_H */
