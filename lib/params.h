/**
 * @file params.h
 * @brief The parameter table: every weight tensor of the model, by name, in one flat buffer.
 *
 * All parameters live in one contiguous array (and so do their gradients and
 * the two AdamW moments, with the same layout). That makes the optimizer one
 * loop, gradient clipping one norm, a checkpoint one write — and a tensor is
 * just a name, a shape and an offset.
 *
 * Initial values come from the counter-based RNG with the tensor's *name* as
 * the stream (an FNV-1a hash): element i of "layers.2.moe.experts.fc1" has the same
 * value on every backend and in every parallel layout, whichever rank holds it.
 *
 * A tensor knows how it is sharded (::moe_shard: over which group, along which dimension,
 * which shard of how many, its global shape) and which group holds its replicas. The
 * initialisation reads the first to give each shard its slice of the single-rank tensor;
 * the trainer reads the second to sum each gradient over the right ranks.
 */
#ifndef MOE_PARAMS_H
#define MOE_PARAMS_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "parallel.h"
#include "real.h"

/** How a tensor is initialised. */
typedef enum moe_init { MOE_INIT_NORMAL = 0, MOE_INIT_ONES = 1, MOE_INIT_ZEROS = 2 } moe_init;

/** How a tensor is split over the ranks of a group: this rank holds shard @p index of
 *  @p count equal pieces along dimension @p dim (a count of 1: the whole tensor). */
typedef struct moe_shard {
    moe_group_kind group; /**< the group whose ranks hold the shards (e.g. ::MOE_GROUP_EP);
                               ::MOE_GROUP_NONE for a tensor every rank holds whole */
    int dim;              /**< the split dimension, 0 = outermost */
    int index;            /**< this rank's shard, 0 .. count-1 (its position in the group) */
    int count;            /**< shards (the group's size) */
} moe_shard;

/** No second compute copy (moe_tensor_copy::offset). */
#define MOE_NO_COPY ((size_t)-1)

/**
 * A second compute copy of a weight in a narrower type, with its scaling factors. Unused
 * for now (every offset is ::MOE_NO_COPY): chapter 05 (FP8) keeps the FP8 copy of each
 * matrix and its scales in buffers of the model, located by these offsets, next to the
 * master weights and the activation-type copy.
 */
typedef struct moe_tensor_copy {
    size_t offset;       /**< first element in the model's low-precision weight buffer */
    size_t scale_offset; /**< first scale in its scale buffer */
} moe_tensor_copy;

/**
 * One tensor of the table: a name that is stable across runs and layouts (checkpoints key
 * tensors by name and shard), this rank's shard of it, and where the shard lives.
 */
typedef struct moe_tensor {
    char name[64];       /**< e.g. "layers.3.moe.experts.fc1" */
    int ndim;            /**< 1..3 */
    int shape[3];        /**< this rank's sizes, outermost first */
    int global_shape[3]; /**< the sizes of the whole (single-rank) tensor */
    int origin[3];       /**< index in the whole tensor of this shard's first element, per dim */
    moe_shard shard;     /**< how the tensor is split (count 1: this rank holds all of it).
                              After a second split (moe_params_shard() called twice: the
                              routed experts, by EP and then by ETP) shard.group is the union
                              of both groups (::MOE_GROUP_ETP_EP), the ranks that together hold
                              the whole tensor, and dim/index/count stay the first split's */
    moe_shard inner;     /**< the second split (ETP inside each expert), or count 1 */
    moe_group_kind grad_group; /**< the ranks holding the same shard (replicas): its gradient
                                    is summed over them. ::MOE_GROUP_DP_CP for the dense
                                    grid, ::MOE_GROUP_EDP for the expert grid */
    moe_group_kind partial_group; /**< ::MOE_GROUP_TP for a tensor every tensor-parallel
                                       rank holds whole but whose gradient each rank computes
                                       from part of the work only (norm weights and the
                                       embedding under sequence parallelism, the QK-norm with
                                       TP): summed over that group first; else
                                       ::MOE_GROUP_NONE */
    size_t offset;       /**< first element in the flat buffer */
    size_t numel;        /**< element count of this shard */
    moe_init init;       /**< how to initialise */
    double std;          /**< normal init std */
    int decay;           /**< 1 when AdamW weight decay applies (matrices, not norms) */
    moe_tensor_copy low; /**< the low-precision compute copy (chapter 05; unused) */
} moe_tensor;

/** A growable list of tensors laid out back to back. */
typedef struct moe_param_table {
    moe_tensor *t;     /**< the tensors */
    int n;             /**< how many */
    int cap;           /**< allocated entries */
    size_t total;      /**< total elements */
} moe_param_table;

/**
 * @brief Append a whole tensor of the dense grid (replicated over DP x CP); returns its offset
 *        in the flat buffer. Split it with moe_params_shard() before adding the next one.
 * @param pt    table
 * @param name  unique name
 * @param ndim  1..3
 * @param s0    outermost size
 * @param s1    second size (ignored when ndim < 2)
 * @param s2    third size (ignored when ndim < 3)
 * @param init  initialisation
 * @param std   normal std
 * @param decay 1 when weight decay applies
 * @return the tensor's offset
 */
size_t moe_params_add(moe_param_table *pt, const char *name, int ndim, int s0, int s1, int s2,
                      moe_init init, double std, int decay);

/**
 * @brief Keep only this rank's shard of the tensor added last: shard @p index of @p count
 *        along @p dim, over the ranks of @p group. Its shape becomes the shard's (the global
 *        shape stays), and a tensor split over an expert-grid group (EP, ETP) belongs to the
 *        expert grid: its gradient is summed over EDP instead of DP x CP. Element j of the
 *        shard is initialised as the element of the whole tensor it is a slice of, so a
 *        row- or column-parallel shard starts as its slice of the single-rank weights.
 *        A routed expert's tensor is split twice: by ::MOE_GROUP_EP (whole experts), then by
 *        ::MOE_GROUP_ETP along another dimension (moe_tensor::inner); shard.group becomes
 *        ::MOE_GROUP_ETP_EP, the ranks whose shards make up the whole tensor.
 * @param pt    table (its last tensor is split)
 * @param group the ranks holding the shards
 * @param dim   0 .. ndim-1; its size must be a multiple of the count
 * @param index this rank's shard, 0 .. count-1
 * @param count shards (1: the whole tensor, only the group is recorded)
 */
void moe_params_shard(moe_param_table *pt, moe_group_kind group, int dim, int index, int count);

/**
 * @brief Mark the tensor added last as one whose gradient is a partial sum over @p group on
 *        each rank (moe_tensor::partial_group); ::MOE_GROUP_NONE leaves it whole.
 * @param pt table (its last tensor is marked)  @param group ::MOE_GROUP_TP or ::MOE_GROUP_NONE
 */
void moe_params_partial(moe_param_table *pt, moe_group_kind group);

/**
 * @brief Index in the whole (unsharded) tensor of element @p j of this rank's shard: the
 *        element whose value it holds at initialisation.
 * @param t tensor  @param j 0 .. numel-1  @return the row-major index in global_shape
 */
size_t moe_tensor_global_index(const moe_tensor *t, size_t j);

/**
 * @brief Index in this rank's shard of element @p g of the whole tensor (the inverse of
 *        moe_tensor_global_index()), or (size_t)-1 when another rank's shard holds it.
 * @param t tensor  @param g a row-major index in global_shape  @return the index or -1
 */
size_t moe_tensor_local_index(const moe_tensor *t, size_t g);

/** What groups tensors into runs (e.g. their moe_tensor::grad_group). */
typedef moe_group_kind (*moe_params_key)(const moe_tensor *t);

/**
 * @brief The next run of consecutive tensors that share a key: [*start, *end) in elements of
 *        the flat buffer, and the key. Start with *i = 0; each call moves *i past the run.
 * @param pt table  @param key the key of a tensor  @param i the next tensor (updated)
 * @param start receives the run's first element  @param end one past its last
 * @param k receives the run's key  @return 0 when there are no more runs, else 1
 */
int moe_params_next_run(const moe_param_table *pt, moe_params_key key, int *i, size_t *start,
                        size_t *end, moe_group_kind *k);

/** @brief Find a tensor by name. @param pt table @param name name @return it, or NULL */
const moe_tensor *moe_params_find(const moe_param_table *pt, const char *name);

/**
 * @brief Initialise a host buffer of pt->total elements from the counter-based RNG.
 * @param pt table  @param params host buffer  @param seed run seed
 */
void moe_params_init(const moe_param_table *pt, moe_real *params, uint64_t seed);

/** @brief 64-bit FNV-1a hash of a string (the RNG stream of a tensor). @param s text @return hash */
uint64_t moe_hash_name(const char *s);

/** @brief Free the table. @param pt table */
void moe_params_free(moe_param_table *pt);

#endif /* MOE_PARAMS_H */
