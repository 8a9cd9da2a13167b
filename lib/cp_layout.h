/**
 * @file cp_layout.h
 * @brief Context parallelism's bookkeeping (chapter 07): which tokens of a sequence a rank
 *        holds, which key/value chunks it sees at each step of the ring, and the merge of
 *        partial attention results by their log-sum-exp.
 *
 * With CP ranks every sequence of T tokens is cut into 2·cp chunks of C = T/(2·cp) tokens,
 * and rank r holds chunks r and 2·cp−1−r. Causal attention makes late queries expensive
 * (query t reads t+1 keys), so a rank that held one contiguous T/cp slice would do more work
 * the later its slice; pairing an early chunk with its mirror gives every rank the same
 * work. Example, cp = 2, chunks 0..3: rank 0 holds {0, 3}, rank 1 holds {1, 2}.
 *
 * **The ring.** At step i = 0 .. cp−1 a rank holds the keys and values of rank
 * s = (r − i) mod cp, and attends its queries to them:
 *  - i = 0 (s = r): its own chunks, causally (the diagonal blocks, and its late chunk
 *    against its early one in full);
 *  - s < r: every query of both its chunks against the *first* chunk of s (chunk s is
 *    earlier than both of r's chunks; s's late chunk 2cp−1−s is later than both): half the
 *    keys, no mask;
 *  - s > r: only the *second* chunk of its queries (2cp−1−r) against both chunks of s (chunk r
 *    is earlier than anything s holds): half the queries, no mask.
 * So after step 0 every step is the same amount of unmasked work. moe_cp_ring_pairs() lists
 * a step's (query chunk, key chunk, masked) triples; the test checks that over the cp steps
 * every causally visible pair of chunks is computed exactly once.
 *
 * **The merge.** A query row attended to disjoint sets of keys gives partial results
 * (y_a, lse_a) and (y_b, lse_b), each softmax-normalised over its own keys, with
 * lse = log Σ_j exp(s_j). Over the union, lse = log(exp(lse_a) + exp(lse_b)) =
 * max + log1p(exp(min − max)) (no overflow), and y = exp(lse_a − lse)·y_a +
 * exp(lse_b − lse)·y_b: each part reweighted by its share of the total softmax mass. A part
 * that saw no visible key has lse = −∞ and weight 0.
 */
#ifndef MOE_CP_LAYOUT_H
#define MOE_CP_LAYOUT_H

#include <stddef.h>

#include "error.h"
#include "real.h"

/** One block of a ring step: the rank's query chunk `q` (0: its early chunk r, 1: its late
 *  chunk 2cp−1−r) against the key/value chunk `k` of the rank it holds this step (0: that
 *  rank's early chunk, 1: its late one), causally masked or in full. */
typedef struct moe_cp_pair {
    int q;      /**< 0 or 1: which of this rank's two chunks supplies the queries */
    int k;      /**< 0 or 1: which of the visiting rank's two chunks supplies keys/values */
    int masked; /**< 1: the causal mask applies (a diagonal block), 0: every key is visible */
} moe_cp_pair;

/**
 * @brief Check a context-parallel size against a sequence length: 2·cp must divide T (the
 *        load-balanced layout cuts each sequence into 2·cp equal chunks).
 * @param T tokens per sequence (--seq-length)  @param cp --context-parallel-size
 * @param err receives a message naming both flags and the nearest lengths that work
 * @return ::MOE_OK or ::MOE_ERR_CONFIG
 */
moe_status moe_cp_check(int T, int cp, moe_error *err);

/**
 * @brief The global index (0 .. 2cp−1) of one of a rank's two chunks.
 * @param cp ranks  @param rank this rank in the CP group  @param which 0: early, 1: late
 * @return rank, or 2·cp−1−rank
 */
static inline int moe_cp_chunk(int cp, int rank, int which) {
    return which == 0 ? rank : 2 * cp - 1 - rank;
}

/**
 * @brief The absolute position in the sequence of a rank's local token @p t (0 .. T/cp−1:
 *        its early chunk first, then its late one), as RoPE and the causal mask need it.
 * @param T tokens per sequence  @param cp ranks  @param rank this rank  @param t local index
 * @return the position (0 .. T−1)
 */
static inline int moe_cp_position(int T, int cp, int rank, int t) {
    const int C = T / (2 * cp);
    return moe_cp_chunk(cp, rank, t / C) * C + t % C;
}

/**
 * @brief The inverse of moe_cp_position(): the local index on rank @p rank of the token at
 *        absolute position @p pos, or -1 when another rank holds it.
 * @param T tokens per sequence  @param cp ranks  @param rank this rank  @param pos position
 * @return the local index (0 .. T/cp−1), or -1
 */
static inline int moe_cp_local_index(int T, int cp, int rank, int pos) {
    const int C = T / (2 * cp), chunk = pos / C;
    if (chunk == moe_cp_chunk(cp, rank, 0))
        return pos % C;
    return chunk == moe_cp_chunk(cp, rank, 1) ? C + pos % C : -1;
}

/**
 * @brief This rank's tokens of B sequences, chunk-major: its early chunk of every sequence,
 *        then its late chunk of every sequence ([2][B][C], C = T/(2·cp)), the order every
 *        context-parallel tensor of the model keeps (one chunk of all B sequences contiguous).
 * @param dst [B·T/cp] receives them  @param src [B·T] the whole micro-batch (row-major)
 * @param B sequences  @param T tokens per sequence (2·cp divides it)  @param cp ranks
 * @param rank this rank in the CP group
 */
void moe_cp_take_local(int *dst, const int *src, int B, int T, int cp, int rank);

/**
 * @brief The blocks a rank computes at step @p i of the ring (at most 4; see the file's
 *        comment for which and why).
 * @param cp ranks  @param rank this rank  @param i step (0 .. cp−1)
 * @param out receives the blocks  @return how many (3 at step 0, else 2)
 */
int moe_cp_ring_pairs(int cp, int rank, int i, moe_cp_pair out[4]);

/** @brief The rank whose keys and values a rank holds at step @p i: (rank − i) mod cp.
 *  @param cp ranks  @param rank this rank  @param i step  @return the rank */
static inline int moe_cp_ring_source(int cp, int rank, int i) {
    return ((rank - i) % cp + cp) % cp;
}

/**
 * @brief Merge a partial attention result into an accumulated one, in the attention op's
 *        layouts (y [B, T, H, D], lse [B, H, T]), one query row (b, t, h) at a time:
 *        lse = max + log1p(exp(min − max)), y = exp(lse_acc − lse)·y + exp(lse_b − lse)·y_b.
 *        A row with lse_b = −∞ (no visible key) leaves the accumulator unchanged; an
 *        accumulator row at −∞ takes the part as it is.
 * @param y accumulated output, updated  @param lse its log-sum-exp, updated
 * @param y_b the part's output  @param lse_b the part's log-sum-exp
 * @param B sequences  @param T query rows per sequence  @param H query heads
 * @param D head dimension
 */
void moe_cp_merge(moe_real *y, moe_real *lse, const moe_real *y_b, const moe_real *lse_b, int B,
                  int T, int H, int D);

#endif /* MOE_CP_LAYOUT_H */
