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
#include "real.h"

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
    /** rows of one group that lie together: row j belongs to group (j / run) % groups. 0
     *  means group_len (each group one run, the usual case). Under context parallelism a
     *  rank's rows are chunk-major, [2][B][C] (chapter 07), so sequence b's rows are two
     *  runs of C: then j counts this CP rank's rows, run = C and group_len = T. */
    int run;
} moe_aux_shape;

/** @brief The group of row @p j of an aux-loss shape (see moe_aux_shape::run).
 *  @param s the shape @param j a row index in the shape's row space @return its group */
static inline MOE_HOSTDEV int moe_aux_group(const moe_aux_shape *s, long long j) {
    const int run = s->run > 0 ? s->run : s->group_len;
    return (int)((j / run) % s->groups);
}

/**
 * The shape of one attention call: a chunk of queries attending to a chunk of keys.
 *
 * Query row t of a sequence is the token at absolute position q_pos + t, key row s the
 * token at k_pos + s, and the causal mask lets query t see key s iff k_pos + s ≤ q_pos + t.
 * Without context parallelism both chunks are the whole sequence (positions 0..T−1). With
 * it (chapter 07) a rank holds chunks of the sequence and attends to key chunks of other
 * ranks: then Tq ≠ Tk or the offsets differ, and the log-sum-exp output is what merges the
 * partial results of those calls exactly. A query row that sees no key of the chunk (its
 * position is before k_pos) gets y = 0 and lse = −∞, the values that drop out of the merge.
 *
 * Supported now: the CPU backend's flash attention runs any valid shape
 * (moe_attention_shape_invalid()), the CUDA flash kernels any valid shape with D ≤ 128
 * (moe_attention_shape_unsupported()); only the naive CPU reference, kept for the tests,
 * needs a chunk attending to itself, Tq = Tk and q_pos = k_pos, at any offset (the mask is
 * then the plain lower triangle): moe_attention_shape_not_same_chunk() names what it cannot
 * run.
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
 * @brief Why a shape is not a valid attention call at all, or NULL when it is.
 * @param s the shape
 * @return a static message naming the invalid part, or NULL
 */
static inline const char *moe_attention_shape_invalid(moe_attention_shape s) {
    if (s.B < 0 || s.Tq < 1 || s.Tk < 1 || s.Hq < 1 || s.Hkv < 1 || s.Hq % s.Hkv != 0 ||
        s.D < 1)
        return "invalid shape (need Tq >= 1, Tk >= 1, D >= 1 and Hq a multiple of Hkv)";
    return NULL;
}

/**
 * @brief Why a backend's attention cannot run a shape, or NULL when it can: the shape is
 *        invalid, or its head dimension is larger than the backend's kernels take. Any
 *        chunk of queries against any chunk of keys is fine (chapter 07).
 * @param s the shape  @param max_D the backend's largest head dimension (0: no limit)
 * @return a static message naming the unsupported part, or NULL
 */
static inline const char *moe_attention_shape_unsupported(moe_attention_shape s, int max_D) {
    const char *why = moe_attention_shape_invalid(s);
    if (why)
        return why;
    if (max_D > 0 && s.D > max_D)
        return "head dimension too large for this backend (the CUDA kernels take D <= 128)";
    return NULL;
}

/**
 * @brief Why the naive CPU reference (moe_cpu_attention_naive_*) cannot run a valid shape,
 *        or NULL when it can: it runs only a chunk attending to itself.
 * @param s the shape
 * @return a static message naming the unsupported part, or NULL
 */
static inline const char *moe_attention_shape_not_same_chunk(moe_attention_shape s) {
    const char *why = moe_attention_shape_invalid(s);
    if (why)
        return why;
    if (s.Tq != s.Tk || s.q_pos != s.k_pos)
        return "queries and keys must be the same chunk (Tq == Tk and q_pos == k_pos) for "
               "the naive reference; the flash attention ops (CPU and CUDA) run any pair of "
               "chunks";
    return NULL;
}

/**
 * @brief Abort with a message naming the shape and @p why (a caller's bug: the model asks
 *        only for shapes its backend runs). Does nothing when @p why is NULL.
 * @param s the shape  @param who the backend's attention, for the message
 * @param why the reason (moe_attention_shape_invalid(), moe_attention_shape_unsupported() or
 *            moe_attention_shape_not_same_chunk())
 */
static inline void moe_attention_shape_check(moe_attention_shape s, const char *who,
                                             const char *why) {
    if (why) {
        fprintf(stderr, "%s: unsupported shape B=%d Tq=%d Tk=%d Hq=%d Hkv=%d D=%d q_pos=%d "
                        "k_pos=%d: %s\n",
                who, s.B, s.Tq, s.Tk, s.Hq, s.Hkv, s.D, s.q_pos, s.k_pos, why);
        abort();
    }
}

/**
 * @brief Abort, naming the shape and the reason, unless a backend's attention can run it
 *        (moe_attention_shape_unsupported()).
 * @param s the shape  @param who the backend's attention, for the message
 * @param max_D its largest head dimension (0: no limit)
 */
static inline void moe_attention_shape_require(moe_attention_shape s, const char *who,
                                               int max_D) {
    moe_attention_shape_check(s, who, moe_attention_shape_unsupported(s, max_D));
}

/** Elements of one chunk of the multi-tensor AdamW: the unit of work of one CUDA block and of
 *  one iteration of the CPU's parallel loop (a multiple of 4·256, so a block's 256 threads
 *  move 4 elements each per pass). */
#define MOE_ADAMW_CHUNK 4096

/**
 * One run of the multi-tensor AdamW: @p n consecutive elements that share one weight-decay
 * choice. The optimizer (optimizer.h) cuts the parameters it updates into runs once, at its
 * creation: a run is a stretch of neighbouring tensors with the same `decay` inside one
 * piece of the optimizer state. Each run has three offsets because the arrays it touches
 * are laid out differently under the distributed optimizer: the gradients and the compute
 * copy like the flat parameter buffer, the moments (and the optimizer's own master weights)
 * piece after piece.
 */
typedef struct moe_adamw_run {
    size_t grad;   /**< first element in the flat buffer: of the gradients and the compute copy */
    size_t weight; /**< first element of the fp32 weights the step updates */
    size_t state;  /**< first element of the moments m and v */
    size_t n;      /**< elements (> 0) */
    size_t chunk;  /**< its first chunk: Σ ⌈n / ::MOE_ADAMW_CHUNK ⌉ over the runs before it */
    int decay;     /**< 1: decoupled weight decay applies to these elements */
} moe_adamw_run;

/** The run list the `adamw` op walks in one call. */
typedef struct moe_adamw_runs {
    moe_adamw_run *run; /**< [n] in BACKEND memory (the device reads it), by increasing chunk */
    int n;              /**< runs */
    size_t chunks;      /**< chunks over all runs: the CUDA grid, the CPU loop's length */
} moe_adamw_runs;

/**
 * @brief The run that chunk @p c belongs to: the last run whose first chunk is ≤ @p c (a
 *        binary search: the runs are sorted by their first chunk). Every CUDA block and
 *        every CPU iteration calls it for its own chunk, so no block searches the elements.
 * @param run [n] the runs  @param n how many (≥ 1)  @param c a chunk, < the total
 * @return the index of its run
 */
static inline MOE_HOSTDEV int moe_adamw_run_of_chunk(const moe_adamw_run *run, int n, size_t c) {
    int lo = 0, hi = n - 1; /* invariant: run[lo].chunk <= c, and the answer is in [lo, hi] */
    while (lo < hi) {
        const int mid = lo + (hi - lo + 1) / 2;
        if (run[mid].chunk <= c)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/**
 * @brief Positions in a RoPE cos/sin table that covers positions 0 .. @p need − 1: the
 *        smallest power of two ≥ max(4096, need). The CUDA backend builds its table this
 *        size (kernels/rope.cu: grown by doubling, so a longer sequence rebuilds it rarely)
 *        and the memory estimate counts it the same way (lib/memory.c).
 * @param need the highest position used, plus one
 * @return the table's positions
 */
static inline long long moe_rope_table_positions(long long need) {
    long long npos = 4096;
    while (npos < need)
        npos *= 2;
    return npos;
}

#endif /* MOE_OP_TYPES_H */
