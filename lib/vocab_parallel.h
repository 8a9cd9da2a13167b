/**
 * @file vocab_parallel.h
 * @brief The vocabulary-parallel embedding and LM head, and the parallel cross-entropy:
 *        with tensor parallelism no rank ever holds a whole row of logits.
 *
 * With TP the embedding table and the LM head [V, H] are split by vocabulary rows: rank r
 * of the TP group holds ids [r·V/TP, (r+1)·V/TP). Both run on all N tokens of the
 * micro-batch (under sequence parallelism the LM head's input is all-gathered first, as any
 * column-parallel GEMM's, tensor_parallel.h):
 *
 *  - **Embedding.** Each rank looks up the tokens whose id is in its range and writes zeros
 *    for the others (`gather_rows` with −1 for another rank's id); the sum over the group
 *    (g: an all-reduce, or under SP a reduce-scatter into each rank's rows) is the lookup.
 *    Backward: each rank adds the output gradient of its own tokens into its rows.
 *  - **LM head.** Column-parallel: rank r computes the logits of its ids only, [N, V/TP].
 *  - **Cross-entropy.** Per row, each rank reduces its logits to two numbers (the backend's
 *    `cross_entropy_shard_forward`): its log-sum-exp lse_r and its target logit (0 when
 *    another rank owns the target). One all-gather of these 2N numbers, and every rank
 *    merges them (`cross_entropy_shard_merge`): lse = log Σ_r exp(lse_r), loss = lse −
 *    Σ_r target_r. The backward of rank r's logits needs only lse:
 *    ∂loss/∂z_v = exp(z_v − lse) − [v = target].
 *
 * Megatron reaches the same numbers with three all-reduces of N values (the max, then the
 * sum of exponentials and the target logit); merging log-sum-exps needs no common shift,
 * so one collective does (the same merge as chapter 07's ring attention).
 */
#ifndef MOE_VOCAB_PARALLEL_H
#define MOE_VOCAB_PARALLEL_H

#include "backend.h"
#include "tensor_parallel.h"

/** This rank's vocabulary shard and the buffers of the parallel cross-entropy. */
typedef struct moe_vocab_parallel {
    int V;            /**< the whole vocabulary */
    int Vl;           /**< ids this rank holds: V / TP */
    int v0;           /**< its first id */
    int max_N;        /**< tokens the buffers hold */
    int n_rows;       /**< tokens of the last batch whose id this rank holds */
    int *ids;         /**< [N] backend: each token's id in this shard, or −1 */
    int *targets;     /**< [N] backend: each target's id in this shard, or −1 */
    int *rows;        /**< [N] backend: the n_rows tokens whose id this rank holds */
    int *row_ids;     /**< [N] backend: their ids in this shard */
    int *host;        /**< [4N] host staging of the four maps */
    moe_real *part;   /**< [N,2] backend: this rank's (log-sum-exp, target logit) per row */
    moe_real *parts;  /**< [TP,N,2] backend: every rank's, all-gathered */
    moe_real *lse;    /**< [N] backend: the whole rows' log-sum-exp, for the backward */
} moe_vocab_parallel;

/**
 * @brief Allocate the buffers of rank tp->rank's vocabulary shard.
 * @param be backend @param vp out @param tp the TP group (size must divide @p V)
 * @param V whole vocabulary @param N most tokens per batch
 * @return 1, or 0 when an allocation failed (free with moe_vp_free() either way)
 */
int moe_vp_alloc(const moe_backend *be, moe_vocab_parallel *vp, const moe_tp *tp, int V, int N);

/** @brief Free the buffers (a zeroed struct: no-op). @param be backend @param vp shard */
void moe_vp_free(const moe_backend *be, moe_vocab_parallel *vp);

/**
 * @brief Map a batch's host token ids (and targets) to this shard's ids and copy the maps
 *        to the backend.
 * @param be backend @param vp shard @param tokens host [N] @param targets host [N] or NULL
 * @param N tokens
 */
void moe_vp_set_batch(const moe_backend *be, moe_vocab_parallel *vp, const int *tokens,
                      const int *targets, int N);

/**
 * @brief This rank's part of the embedding lookup: out[n] = its row of tokens[n], or zeros
 *        for another rank's id. The caller sums @p out over the TP group.
 * @param be backend @param vp shard @param out [N,H] @param table [V/TP,H] compute copy
 * @param N tokens @param H width
 */
void moe_vp_embedding_forward(const moe_backend *be, const moe_vocab_parallel *vp, void *out,
                              const void *table, int N, int H);

/**
 * @brief Backward of the lookup: dtable[id] += dout[n] for the tokens whose id this rank
 *        holds (dout whole on every rank: all-gathered under SP).
 * @param be backend @param vp shard @param dtable [V/TP,H] gradient (accumulates)
 * @param dout [N,H] @param scratch [N,H] activations @param H width
 */
void moe_vp_embedding_backward(const moe_backend *be, const moe_vocab_parallel *vp,
                               moe_real *dtable, const void *dout, void *scratch, int H);

/**
 * @brief The parallel cross-entropy of the last batch's targets: every rank of the group
 *        gets the losses of all N rows from its own [N, V/TP] logits.
 * @param be backend @param tp group @param vp shard @param losses [N] out
 * @param logits [N,V/TP] this rank's columns @param N rows
 */
void moe_vp_cross_entropy_forward(const moe_backend *be, const moe_tp *tp,
                                  moe_vocab_parallel *vp, moe_real *losses, const void *logits,
                                  int N);

/**
 * @brief Its backward for this rank's columns: dlogits += (softmax − onehot)/N, the
 *        gradient of the mean loss over the N rows.
 * @param be backend @param vp shard @param dlogits [N,V/TP] (accumulates)
 * @param logits [N,V/TP] @param N rows
 */
void moe_vp_cross_entropy_backward(const moe_backend *be, const moe_vocab_parallel *vp,
                                   void *dlogits, const void *logits, int N);

#endif /* MOE_VOCAB_PARALLEL_H */
