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
 */
#ifndef MOE_PARAMS_H
#define MOE_PARAMS_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "real.h"

/** How a tensor is initialised. */
typedef enum moe_init { MOE_INIT_NORMAL = 0, MOE_INIT_ONES = 1, MOE_INIT_ZEROS = 2 } moe_init;

/** One tensor of the table. */
typedef struct moe_tensor {
    char name[64];     /**< e.g. "layers.0.attn.wq" */
    int ndim;          /**< 1..3 */
    int shape[3];      /**< sizes, outermost first */
    size_t offset;     /**< first element in the flat buffer */
    size_t numel;      /**< element count */
    moe_init init;     /**< how to initialise */
    double std;        /**< normal init std */
    int decay;         /**< 1 when AdamW weight decay applies (matrices, not norms) */
    int expert;        /**< 1 for routed-expert weights: sharded over expert-parallel ranks,
                            their gradients are not summed over the EP group */
    size_t rng_offset; /**< index of this rank's first element in the full (unsharded)
                            tensor: element j is initialised as element rng_offset + j */
} moe_tensor;

/** A growable list of tensors laid out back to back. */
typedef struct moe_param_table {
    moe_tensor *t;     /**< the tensors */
    int n;             /**< how many */
    int cap;           /**< allocated entries */
    size_t total;      /**< total elements */
} moe_param_table;

/**
 * @brief Append a tensor; returns its offset in the flat buffer.
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
