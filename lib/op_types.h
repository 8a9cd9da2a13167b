/**
 * @file op_types.h
 * @brief The types the op table (backend.h) speaks, shared by every backend.
 *
 * The op table is a contract between the model and the hardware, so the types its ops
 * take belong to neither side: they live here, and lib/cpu/ and kernels/ both include
 * this header. (Before, they lived in lib/cpu/ and the table had to include the CPU
 * backend to get them.)
 */
#ifndef MOE_OP_TYPES_H
#define MOE_OP_TYPES_H

#include <stdio.h>
#include <stdlib.h>

#include "config.h"

/** What a router needs to know (from the config). */
typedef struct moe_router_params {
    int num_experts;        /**< E */
    int topk;               /**< k */
    moe_score_fn score_fn;  /**< softmax or sigmoid */
    int pre_softmax;        /**< softmax over all E before the top-k */
    int num_groups;         /**< G (0 = no group limit) */
    int group_topk;         /**< GK */
    double scaling_factor;  /**< multiply the weights by this (0 = off) */
} moe_router_params;

/**
 * Where one rank's rows sit among the token groups of the load-balancing (aux) loss.
 *
 * The aux loss is a sum over groups of tokens (all tokens: Megatron's `aux_loss`; one
 * sequence: its `seq_aux_loss`). With tensor parallelism the MoE layer runs on each rank's
 * sequence shard, so a group's tokens may lie on several ranks: each rank holds the global
 * rows [row0, row0 + N) of the groups·group_len tokens. The counts of a group are then the
 * sum of every rank's counts (an all-reduce of `aux_loss_counts`), and each rank's loss is
 * the part of the sum over its own rows: the ranks' losses add up to the whole loss, and
 * each rank's gradient is that of its own rows. One rank: {N, 0, group_len, N/group_len}.
 */
typedef struct moe_aux_shape {
    int N;              /**< this rank's rows */
    int row0;           /**< global index of its first row */
    int group_len;      /**< tokens per group, over all ranks (T of the loss's formula) */
    int groups;         /**< groups over all ranks (group_len·groups ≥ row0 + N) */
    int E;              /**< experts */
    int k;              /**< top-k of the counts */
    moe_score_fn fn;    /**< score function (softmax, or normalised sigmoid) */
} moe_aux_shape;

/**
 * The shape of one attention call: a chunk of queries attending to a chunk of keys.
 *
 * Query row t of a sequence is the token at absolute position q_pos + t, key row s the
 * token at k_pos + s, and the causal mask lets query t see key s iff k_pos + s ≤ q_pos + t.
 * Without context parallelism both chunks are the whole sequence (positions 0..T−1). With
 * it (chapter 07) a rank holds chunks of the sequence and attends to key chunks of other
 * ranks: then Tq ≠ Tk or the offsets differ, and the log-sum-exp output is what merges the
 * partial results of those calls exactly.
 *
 * Supported now (moe_attention_shape_unsupported() names what is not): a chunk attending
 * to itself, Tq = Tk and q_pos = k_pos, at any offset (the mask is then the plain lower
 * triangle; positions enter only through RoPE). Attention between different chunks comes
 * with chapter 07.
 */
typedef struct moe_attention_shape {
    int B;     /**< sequences */
    int Tq;    /**< query rows per sequence (rows of q, y, lse) */
    int Tk;    /**< key/value rows per sequence (rows of k, v) */
    int Hq;    /**< query heads */
    int Hkv;   /**< key/value heads; query head h reads head h / (Hq/Hkv) (GQA) */
    int D;     /**< head dimension */
    int q_pos; /**< absolute position of query row 0 */
    int k_pos; /**< absolute position of key row 0 */
} moe_attention_shape;

/**
 * @brief Why the attention ops cannot run a shape yet, or NULL when they can.
 * @param s the shape  @param max_D the backend's largest head dimension (0: no limit)
 * @return a static message naming the unsupported part, or NULL
 */
static inline const char *moe_attention_shape_unsupported(moe_attention_shape s, int max_D) {
    if (s.B < 0 || s.Tq < 1 || s.Hq < 1 || s.Hkv < 1 || s.Hq % s.Hkv != 0 || s.D < 1)
        return "invalid shape (need Tq >= 1, D >= 1 and Hq a multiple of Hkv)";
    if (max_D > 0 && s.D > max_D)
        return "head dimension too large for this backend";
    if (s.Tq != s.Tk || s.q_pos != s.k_pos)
        return "queries and keys must be the same chunk (Tq == Tk and q_pos == k_pos); "
               "attention between different chunks comes with context parallelism (chapter 07)";
    return NULL;
}

/**
 * @brief Abort, naming the shape and the reason, unless the attention ops of a backend can
 *        run it. The model only asks for supported shapes: anything else is a caller's bug.
 * @param s the shape  @param who the backend's attention, for the message
 * @param max_D its largest head dimension (0: no limit)
 */
static inline void moe_attention_shape_require(moe_attention_shape s, const char *who,
                                               int max_D) {
    const char *why = moe_attention_shape_unsupported(s, max_D);
    if (why) {
        fprintf(stderr, "%s: unsupported shape B=%d Tq=%d Tk=%d Hq=%d Hkv=%d D=%d q_pos=%d "
                        "k_pos=%d: %s\n",
                who, s.B, s.Tq, s.Tk, s.Hq, s.Hkv, s.D, s.q_pos, s.k_pos, why);
        abort();
    }
}

#endif /* MOE_OP_TYPES_H */
