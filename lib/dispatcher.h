/**
 * @file dispatcher.h
 * @brief Expert parallelism: the all-to-all token dispatcher, and capacity / dropping.
 *
 * With expert parallelism (EP) the E experts of a layer are split over the EP ranks:
 * rank r holds experts [r·E/EP, (r+1)·E/EP). Each rank routes its own tokens, then
 * tokens travel to the ranks that hold their experts and back (BRIEF §6):
 *
 *   1. permute locally: the rank's N·k assignments sorted by (global) expert — so they
 *      are also grouped by destination rank;
 *   2. exchange counts: an all-gather of the per-expert count vector over the EP group,
 *      so every rank knows counts[src][e] and with it the input splits (rows it sends to
 *      each rank) and output splits (rows it receives from each rank);
 *   3. all-to-all-v of the token rows and of their routing weights; what arrives is laid
 *      out [source rank][local expert];
 *   4. sort chunks to [local expert][source rank], so each local expert's rows are
 *      contiguous — the experts run exactly as in chapter 01, on local weights. Across
 *      ranks the sort is free: each (source rank, local expert) chunk is received
 *      straight into its place (moe_comm_exchange); only a single rank sorts in memory;
 *   5. the exact reverse: unsort chunks, all-to-all-v back, unpermute.
 * The backward moves gradients along the same plan: output gradients travel like
 * tokens (steps 1–4), input and routing-weight gradients come back like outputs (step 5).
 *
 * Capacity (--moe-expert-capacity-factor): each expert accepts at most
 * capacity = ceil(N·k/E · factor) of a rank's N tokens; the rest are dropped (their
 * expert output is zero, their routing weight gets no gradient). Policy "probs" keeps an
 * expert's highest-weight assignments, "position" the earliest. With
 * --moe-pad-expert-input-to-capacity every expert receives exactly capacity rows from
 * every rank (zero rows fill the gap), so every split is static.
 *
 * The fused path (--moe-alltoall-path fused; auto picks it where it can): when the GPUs of
 * the group can load from and store to each other's memory (NVLink; NCCL's device API),
 * steps 1 and 3–4 become ONE kernel and step 5 another (kernels/dispatch_nvlink.cu): each
 * token row is read once and stored straight into its experts' rows on their GPUs, and
 * each token's output is the sum of its k expert rows loaded from wherever they are. The
 * permuted copies of the collective path (permute_tokens, the send and receive buffers,
 * unpermute's input) never exist. The expert-side buffers are then symmetric memory,
 * sized for the largest rank's R_recv; the plan gives each expert the shift from this
 * rank's permuted rows to their rows on the expert's rank.
 *
 * The allgather dispatcher (--moe-token-dispatcher-type allgather, lib/moe_layer.c) is the
 * simpler alternative: all-gather every rank's tokens and routing, let each rank's
 * experts pick their rows out of the whole gathered batch, and reduce-scatter the partial
 * outputs back. Per rank it moves EP·N token rows each way where all-to-all moves about
 * N·k, so EP/k times as much, but it needs no count exchange and no chunk sorting;
 * Megatron uses it when tensor parallelism already all-gathers the tokens.
 */
#ifndef MOE_DISPATCHER_H
#define MOE_DISPATCHER_H

#include <stddef.h>

#include "backend.h"
#include "comm.h"
#include "dispatch_nvlink.h"

/** The expert-parallel context shared by the MoE layers of a model. */
typedef struct moe_ep {
    moe_comm *comm;        /**< the EP group, or NULL when EP = 1 */
    int size;              /**< EP ranks */
    int rank;              /**< this rank in the EP group */
    const moe_backend *be; /**< where token buffers live */
    void *send_buf;        /**< staging for the padded send layout (grow-only) */
    size_t send_cap;       /**< its size in bytes */
    void *recv_buf;        /**< staging for the received layout (grow-only) */
    size_t recv_cap;       /**< its size in bytes */
    void *ag_buf;          /**< allgather dispatcher: the partial outputs of every rank's tokens */
    size_t ag_cap;         /**< its size in bytes */
    int allgather;         /**< 1: the allgather dispatcher instead of all-to-all */
    int fused;             /**< 1: the all-to-all goes through the fused kernels (needs
                                moe_comm_peer_access() on comm) */
} moe_ep;

/** How one layer's tokens travel in this forward (saved for its backward). */
typedef struct moe_dispatch_plan {
    int E;                /**< experts in the layer (global) */
    int E_local;          /**< experts on this rank */
    int R_kept;           /**< local permuted rows that are sent (not dropped) */
    int R_send;           /**< rows of the send layout (R_kept, or E·capacity padded) */
    int R_recv;           /**< rows that arrive = rows the local experts process */
    size_t *send_rows;    /**< host [EP]: rows sent to each rank */
    size_t *recv_rows;    /**< host [EP]: rows received from each rank */
    int *expert_offset;   /**< host [E_local+1]: local expert e owns rows [off[e], off[e+1]) */
    int padded;           /**< 1 when the send layout is padded to capacity */
    int *send_map;        /**< backend [R_send]: send row → permuted row (−1: padding) when padded */
    int *unpad_map;       /**< backend [R_kept]: permuted row → send row when padded */
    int *sort_map;        /**< backend [R_recv]: expert-layout row → received row */
    int *unsort_map;      /**< backend [R_recv]: received row → expert-layout row */
    int cap_rows;         /**< allocated rows of the backend maps */
    moe_comm_chunk *send_chunks; /**< host [EP·E_local]: (rank p, its local expert el) pieces of
                                      the send layout, in rows */
    moe_comm_chunk *recv_chunks; /**< host [EP·E_local]: (source p, my local expert el) pieces,
                                      at their place in the expert layout, in rows */
    /* the allgather dispatcher: every rank sees every rank's tokens */
    int *ag_tok;          /**< backend [R_recv]: expert-side row → token in the gathered batch */
    int *ag_inv;          /**< backend [EP·N·k]: gathered assignment → expert-side row, or −1 */
    int *ag_identity;     /**< backend [EP·N·k]: a → a (combine k rows per gathered token) */
    int ag_cap;           /**< allocated entries of the three */
    /* the fused path */
    int fused;            /**< 1: this layer moves rows with the fused kernels */
    int max_recv;         /**< the largest R_recv of any rank (sizes the symmetric buffers) */
    int *shift;           /**< backend [E]: row on the expert's rank − permuted row, per expert */
    int shift_cap;        /**< allocated entries of shift */
} moe_dispatch_plan;

/**
 * @brief Capacity of one expert for @p N tokens: ceil(N·k/E · factor).
 * @param N tokens @param k top-k @param E experts @param factor capacity factor (> 0)
 * @return rows
 */
int moe_expert_capacity(int N, int k, int E, double factor);

/**
 * @brief Apply a capacity to a routing (host arrays). Dropped assignments get the expert id
 *        @p E (one past the last), which the permutation sorts to the end.
 * @param dispatch_idx [N·k] receives the routing with drops  @param topk_idx [N·k] routing
 * @param topk_w [N·k] routing weights (for policy "probs")  @param N tokens  @param k top-k
 * @param E experts  @param capacity rows per expert  @param by_position 1 = keep earliest,
 *        0 = keep highest weight (ties: earliest)
 * @return the number of dropped assignments
 */
long long moe_apply_capacity(int *dispatch_idx, const int *topk_idx, const moe_real *topk_w, int N,
                             int k, int E, int capacity, int by_position);

/**
 * @brief Build the plan from this rank's kept counts per global expert: exchange counts
 *        over the EP group, compute splits, and the padding and chunk-sorting maps.
 * @param ep context  @param plan plan (reused across steps; grows as needed)
 * @param counts host [E] rows this rank sends to each global expert
 * @param E experts  @param pad_capacity 0, or the capacity every expert is padded to
 */
void moe_dispatch_plan_build(moe_ep *ep, moe_dispatch_plan *plan, const long long *counts, int E,
                             int pad_capacity);

/** @brief Free a plan's buffers. @param be backend the plan lives on @param plan plan */
void moe_dispatch_plan_free(const moe_backend *be, moe_dispatch_plan *plan);

/**
 * @brief Tokens to experts: rows [0, R_kept) of @p src (local permuted layout, width C)
 *        arrive as @p dst [R_recv, C] in [local expert][source rank] order.
 * @param ep context @param plan plan @param dst expert-side rows @param src permuted rows @param C width
 */
void moe_dispatch_rows(moe_ep *ep, const moe_dispatch_plan *plan, void *dst, const void *src,
                       int C);

/** @brief moe_dispatch_rows for one full-precision value per row (routing weights).
 *  @param ep context @param plan plan @param dst [R_recv] @param src [R_kept] */
void moe_dispatch_reals(moe_ep *ep, const moe_dispatch_plan *plan, moe_real *dst,
                        const moe_real *src);

/**
 * @brief Experts back to tokens, the exact reverse of moe_dispatch_rows: @p src [R_recv, C]
 *        in expert order lands in rows [0, R_kept) of @p dst (local permuted layout).
 * @param ep context @param plan plan @param dst permuted rows @param src expert-side rows @param C width
 */
void moe_combine_rows(moe_ep *ep, const moe_dispatch_plan *plan, void *dst, const void *src,
                      int C);

/** @brief moe_combine_rows for one full-precision value per row (routing-weight gradients).
 *  @param ep context @param plan plan @param dst [R_kept] @param src [R_recv] */
void moe_combine_reals(moe_ep *ep, const moe_dispatch_plan *plan, moe_real *dst,
                       const moe_real *src);

/**
 * @brief The fused path's expert-side buffer for rows of @p row_bytes: grown (collectively)
 *        to hold the largest rank's rows of this plan.
 * @param ep context (ep->fused) @param plan plan (fused) @param b symmetric buffer
 * @param row_bytes bytes per row @return b->ptr
 */
void *moe_dispatch_sym_rows(moe_ep *ep, const moe_dispatch_plan *plan, moe_sym_buf *b,
                            size_t row_bytes);

/**
 * @brief Fused tokens to experts: token rows @p x [N, C] (and weights @p w) land in the
 *        expert-side buffers of their experts' ranks, in the layout of moe_dispatch_rows.
 *        Replaces permute_tokens + moe_dispatch_rows (+ the weights).
 * @param ep context @param plan plan (fused) @param rows destination rows (symmetric)
 * @param reals destination weights (symmetric) or NULL @param x [N, C] @param w [N·k] or NULL
 * @param idx [N·k] backend: expert per assignment (E: dropped) @param row_of [N·k] backend:
 *        permuted row per assignment @param N tokens @param k top-k @param C width
 */
void moe_dispatch_fused(moe_ep *ep, const moe_dispatch_plan *plan, moe_sym_buf *rows,
                        moe_sym_buf *reals, const void *x, const moe_real *w, const int *idx,
                        const int *row_of, int N, int k, int C);

/**
 * @brief Fused experts to tokens: out[n] (+)= Σ_j of token n's expert rows, and
 *        dwp[row_of[a]] = the expert-side value of assignment a (0 if dropped). Replaces
 *        moe_combine_rows + unpermute_sum (+ moe_combine_reals).
 * @param ep context @param plan plan (fused) @param out [N, C] @param accumulate 1: add to
 *        out @param dwp [N·k] or NULL @param rows expert-side rows (symmetric)
 * @param reals expert-side values (symmetric) or NULL @param idx as for moe_dispatch_fused
 * @param row_of as for moe_dispatch_fused @param N tokens @param k top-k @param C width
 */
void moe_combine_fused(moe_ep *ep, const moe_dispatch_plan *plan, void *out, int accumulate,
                       moe_real *dwp, moe_sym_buf *rows, moe_sym_buf *reals, const int *idx,
                       const int *row_of, int N, int k, int C);

/**
 * @brief A grow-only backend buffer: returns @p p when *cap ≥ bytes, else frees it and
 *        allocates @p bytes (updating *cap).
 * @param be backend @param p current buffer @param cap its size in bytes @param bytes needed
 * @return the buffer
 */
void *moe_grow(const moe_backend *be, void *p, size_t *cap, size_t bytes);

/** @brief Free the context's staging buffers. @param ep context */
void moe_ep_free(moe_ep *ep);

#endif /* MOE_DISPATCHER_H */
