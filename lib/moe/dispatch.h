/**
 * @file dispatch.h
 * @brief How tokens reach their experts and come back: the dispatcher as a strategy
 *        (one table of calls), the expert-parallel context, and the plan of one layer.
 *
 * An MoE layer (layer.h) routes, then hands its tokens to a dispatcher, runs the experts
 * on the rows the dispatcher filled, and hands the outputs back to it. Four dispatchers
 * fill the same table ::moe_dispatcher, one file each:
 *
 *  - **local** (dispatch_local.c, chapter 01): one rank, dropless. Permute the N·k
 *    assignments by expert, run the experts on the permuted rows in place, unpermute.
 *  - **alltoall** (dispatch_alltoall.c, chapter 02): with expert parallelism (EP) the E
 *    experts are split over the EP ranks, rank r holding experts [r·E/EP, (r+1)·E/EP).
 *    Each rank routes its own tokens, then (as Megatron Core's alltoall dispatcher):
 *      1. permute locally: the rank's N·k assignments sorted by (global) expert — so they
 *         are also grouped by destination rank;
 *      2. exchange counts: an all-gather of the per-expert count vector over the EP group,
 *         so every rank knows counts[src][e] and with it the input splits (rows it sends
 *         to each rank) and output splits (rows it receives from each rank);
 *      3. all-to-all-v of the token rows and of their routing weights; what arrives is
 *         laid out [source rank][local expert];
 *      4. sort chunks to [local expert][source rank], so each local expert's rows are
 *         contiguous — the experts run exactly as in chapter 01, on local weights. Across
 *         ranks the sort is free: each (source rank, local expert) chunk is received
 *         straight into its place (moe_comm_exchange); only a single rank sorts in memory;
 *      5. the exact reverse: unsort chunks, all-to-all-v back, unpermute.
 *    The backward moves gradients along the same plan: output gradients travel like
 *    tokens (steps 1–4), input and routing-weight gradients come back like outputs
 *    (step 5). It also serves a single rank with a capacity (capacity.h).
 *  - **fused** (dispatch_fused.c, chapter 02, --moe-alltoall-path fused; auto picks it
 *    where it can): when the GPUs of the group can load from and store to each other's
 *    memory (NVLink; NCCL's device API), steps 1 and 3–4 become ONE kernel and step 5
 *    another (kernels/dispatch_nvlink.cu): each token row is read once and stored straight
 *    into its experts' rows on their GPUs, and each token's output is the sum of its k
 *    expert rows loaded from wherever they are. The permuted copies of the collective path
 *    never exist. The expert-side buffers are then symmetric memory, sized for the largest
 *    rank's R_recv; the plan gives each expert the shift from this rank's permuted rows to
 *    their rows on the expert's rank. It shares the alltoall dispatcher's plan.
 *  - **allgather** (dispatch_allgather.c, --moe-token-dispatcher-type allgather): the
 *    simpler alternative: all-gather every rank's tokens and routing, let each rank's
 *    experts pick their rows out of the whole gathered batch, and reduce-scatter the
 *    partial outputs back. Per rank it moves EP·N token rows each way where all-to-all
 *    moves about N·k, so EP/k times as much, but it needs no count exchange and no chunk
 *    sorting; Megatron uses it when tensor parallelism already all-gathers the tokens.
 *
 * Which one a layer uses is decided once: moe_ep_choose_dispatcher() when the trainer
 * sets up the EP group, from the enums moe_config_validate() resolved.
 */
#ifndef MOE_DISPATCH_H
#define MOE_DISPATCH_H

#include <stddef.h>

#include "backend.h"
#include "comm.h"
#include "config.h"
#include "tensor_parallel.h"

/* The layer's types (layer.h), which the strategies read and fill. */
typedef struct moe_layer_dims moe_layer_dims;
typedef struct moe_layer_acts moe_layer_acts;
typedef struct moe_layer_workspace moe_layer_workspace;
typedef struct moe_dispatcher moe_dispatcher;

/** The expert-parallel context shared by the MoE layers of a model. */
typedef struct moe_ep {
    moe_comm *comm;        /**< the EP group, or NULL when EP = 1 */
    int size;              /**< EP ranks */
    int rank;              /**< this rank in the EP group */
    const moe_backend *be; /**< where token buffers live */
    const moe_dispatcher *dispatcher; /**< the strategy the layers use; NULL before
                                           moe_ep_choose_dispatcher() (plans: collective) */
    void *send_buf;        /**< staging for the padded send layout (grow-only) */
    size_t send_cap;       /**< its size in bytes */
    void *recv_buf;        /**< staging for the received layout (grow-only) */
    size_t recv_cap;       /**< its size in bytes */
    void *ag_buf;          /**< allgather dispatcher: the partial outputs of every rank's tokens */
    size_t ag_cap;         /**< its size in bytes */
    /* chapter 05's FP8 dispatch (--moe-fp8-dispatch, dispatch_alltoall.c): the tokens
     * cross the all-to-all as 1×128 FP8 codes and fp32 scales */
    int fp8;               /**< 1: the forward's token rows travel quantized */
    moe_fp8_format fp8_format; /**< their element format (the activation role's) */
    int fp8_pow2;          /**< 1: power-of-two scales (the recipe's) */
    uint8_t *q_send;       /**< the codes sent [R_send, H] (grow-only) */
    uint8_t *q_recv;       /**< the codes received [R_recv, H]: fc1's native GEMM reads them */
    float *s_send;         /**< the scales sent [R_send][H/128] (grow-only) */
    float *s_recv;         /**< the scales received [R_recv][H/128] */
    size_t q_send_cap;     /**< bytes of q_send */
    size_t q_recv_cap;     /**< bytes of q_recv */
    size_t s_send_cap;     /**< bytes of s_send */
    size_t s_recv_cap;     /**< bytes of s_recv */
    moe_tp etp;            /**< the ETP group that splits each local expert (moe/expert_tp.h;
                                comm NULL and size 0 or 1: none). It travels with the EP
                                context because the two groups together hold the experts */
} moe_ep;

/** How one layer's tokens travel in this forward (saved for its backward). */
typedef struct moe_dispatch_plan {
    const moe_dispatcher *dispatcher; /**< the strategy that built it (and frees it) */
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
    int cap_recv;         /**< rows the expert-side buffers hold: the kernels store and load
                               no row at or past it (the budget on the sync-free path) */
    /* the fused path planned on the device (chapter 06, moe_layer_sync_free()) */
    int sync_free;        /**< 1: the counts, shifts and offsets never left the device; the
                               host fields above (R_recv, splits, chunks) are not filled */
    int *my_off;          /**< backend [E+1]: this rank's permuted-row offsets per expert */
    int *all_off;         /**< backend [EP·(E+1)]: every rank's, all-gathered on the stream */
} moe_dispatch_plan;

/**
 * A dispatcher: the calls an MoE layer makes around its experts, in this order.
 *
 * Forward: plan → dispatch → (the experts) → combine. Backward: dispatch_grad →
 * (the experts' backward) → combine_grad. The token side is the layer's input order
 * (x, out, dx: [N,H]); the expert side is the rows the experts run on: the layer's
 * permuted buffers (xp, yp, …) when @ref expert_side is 0, else the expert-side ones
 * (xe, ye, …, [R_recv rows]) of layer.h. Each call marks its profile stage (profile.h).
 */
struct moe_dispatcher {
    const char *name; /**< for logs: "local", "alltoall", "fused", "allgather" */
    int expert_side;  /**< 1: the experts run on the expert-side buffers; 0: on the permuted
                           ones, in place (no transfer) */
    /** Forward: route to the host where needed (counts, capacity), build a->plan, size the
     *  expert-side buffers, and give the experts their groups' offsets. */
    void (*plan)(const moe_backend *be, const moe_layer_dims *d, moe_layer_acts *a,
                 moe_layer_workspace *ws);
    /** Forward: tokens @p x [N,H] and their routing weights (a->topk_w) to the experts'
     *  rows (and weights). */
    void (*dispatch)(const moe_backend *be, const moe_layer_dims *d, moe_layer_acts *a,
                     moe_layer_workspace *ws, const void *x);
    /** Forward: the experts' outputs back to @p out [N,H] = Σ_j output of (n, j)
     *  (overwritten). */
    void (*combine)(const moe_backend *be, const moe_layer_dims *d, const moe_layer_acts *a,
                    moe_layer_workspace *ws, void *out);
    /** Backward: output gradients @p dout [N,H] to the experts' rows, along the forward's
     *  plan (the combine was a sum: each row receives its token's gradient). */
    void (*dispatch_grad)(const moe_backend *be, const moe_layer_dims *d,
                          const moe_layer_acts *a, moe_layer_workspace *ws, const void *dout);
    /** Backward: input gradients back to @p dx [N,H] (added), routing-weight gradients to
     *  ws->dtopk_w [N·k] (overwritten). */
    void (*combine_grad)(const moe_backend *be, const moe_layer_dims *d,
                         const moe_layer_acts *a, moe_layer_workspace *ws, void *dx);
    /** Free what plan() allocated in @p plan (moe_dispatch_plan_free() calls it). */
    void (*free)(const moe_backend *be, moe_dispatch_plan *plan);
};

/** Chapter 01: one rank, dropless: permute, the experts in place, unpermute. */
extern const moe_dispatcher moe_dispatcher_local;
/** Chapter 02: count exchange and all-to-all-v (also a single rank with a capacity). */
extern const moe_dispatcher moe_dispatcher_alltoall;
/** Chapter 02: the all-to-all as two kernels over the GPUs' shared memory (NVLink). */
extern const moe_dispatcher moe_dispatcher_fused;
/** Chapter 02: all-gather the tokens, reduce-scatter the outputs. */
extern const moe_dispatcher moe_dispatcher_allgather;

/**
 * @brief Choose the dispatcher of the MoE layers of an EP group (ep->comm set, or NULL
 *        for one rank) from the resolved configuration: allgather or alltoall; for
 *        alltoall, the fused kernels where --moe-alltoall-path allows and the group can
 *        take them (moe_config_fused_fits() and moe_comm_peer_access(); every rank agrees)
 *        and no padding to capacity asks for the send layout of the collective path.
 * @param ep context (comm, rank set) @param c validated configuration
 * @param verbose 1: log the choice (one rank of the job)
 * @param err receives the reason when --moe-alltoall-path fused is not possible here
 * @return ::MOE_OK or ::MOE_ERR_CONFIG
 */
moe_status moe_ep_choose_dispatcher(moe_ep *ep, const moe_config *c, int verbose,
                                    moe_error *err);

/**
 * @brief Chapter 05's FP8 dispatch (--moe-fp8-dispatch): the forward's token rows of the
 *        collective all-to-all as 1×128 FP8 codes and fp32 scales. Quantizing per row
 *        commutes with moving rows, so the experts receive exactly the QDQ of their rows
 *        (into @p dst, the activation type, for the emulation and the wgrad) and, in
 *        ep->q_recv and ep->s_recv, the codes and scales the native FP8 GEMM reads as they
 *        are. Bytes on the wire per row: H + 4·H/128 instead of H·act_size.
 * @param ep context (ep->fp8 set)  @param plan the layer's plan
 * @param dst [R_recv, H] the expert-side rows  @param src [R_kept, H] the permuted rows
 * @param H the row width (a multiple of 128)
 */
void moe_dispatch_rows_fp8(moe_ep *ep, const moe_dispatch_plan *plan, void *dst, const void *src,
                           int H);

/* ---------------------------------------------------------- alltoall (dispatch_alltoall.c) */

/**
 * @brief Build the plan from this rank's kept counts per global expert: exchange counts
 *        over the EP group, compute splits, and the padding and chunk-sorting maps. The
 *        plan is the fused path's (plan->fused) when ep->dispatcher is ::moe_dispatcher_fused,
 *        the group has peers and nothing is padded.
 * @param ep context  @param plan plan (reused across steps; grows as needed)
 * @param counts host [E] rows this rank sends to each global expert
 * @param E experts  @param pad_capacity 0, or the capacity every expert is padded to
 */
void moe_dispatch_plan_build(moe_ep *ep, moe_dispatch_plan *plan, const long long *counts, int E,
                             int pad_capacity);

/**
 * @brief The arithmetic of a plan (dispatch_layout.c; chapter 02's exercise): from the rows
 *        every rank sends to every global expert, this rank's splits, its local experts'
 *        offsets and the chunk lists of the exchange. Rank q owns global experts
 *        [q·EL, (q+1)·EL) with EL = E / P. Pure host code: no communication, no allocation.
 * @param all           [P, E] rows rank p sends to global expert e (the all-gathered counts)
 * @param P             ranks in the EP group  @param rank this rank  @param E global experts
 * @param send_rows     [P] out: rows this rank sends to each rank
 * @param recv_rows     [P] out: rows this rank receives from each rank
 * @param expert_offset [EL+1] out: local expert el owns expert-layout rows
 *                      [offset[el], offset[el+1]); the layout is [el][source rank]
 * @param send_chunks   [E] out: expert e's rows in this rank's send (permuted) layout,
 *                      peer e / EL
 * @param recv_chunks   [P·EL] out: at index q·EL + el, the rows rank q sends to local expert
 *                      el, placed at their expert-layout offset, peer q
 */
void moe_dispatch_layout(const long long *all, int P, int rank, int E, size_t *send_rows,
                         size_t *recv_rows, int *expert_offset, moe_comm_chunk *send_chunks,
                         moe_comm_chunk *recv_chunks);

/**
 * @brief The sort maps between the received layout [source rank][local expert] (what an
 *        all-to-all-v, or one rank's copy, delivers) and the expert layout [local expert]
 *        [source rank] of @p recv_chunks (dispatch_layout.c; chapter 02's exercise).
 * @param sort_map   [R_recv] out: expert-layout row → received row
 * @param unsort_map [R_recv] out: received row → expert-layout row (the inverse)
 * @param recv_chunks [P·EL] from moe_dispatch_layout()  @param P ranks  @param EL local experts
 */
void moe_dispatch_sort_maps(int *sort_map, int *unsort_map, const moe_comm_chunk *recv_chunks,
                            int P, int EL);

/** @brief Free a plan's buffers (through the dispatcher that built it) and clear it.
 *  @param be backend the plan lives on @param plan plan */
void moe_dispatch_plan_free(const moe_backend *be, moe_dispatch_plan *plan);

/**
 * @brief The alltoall dispatcher's plan step (moe_dispatcher::plan), shared with the fused
 *        dispatcher: the routing to the host (capacity), the local permutation into E + 1
 *        buckets (the last one holds the drops), moe_dispatch_plan_build(), and the
 *        expert-side buffers.
 * @param be backend @param d dims @param a saved state (a->plan built) @param ws workspace
 */
void moe_dispatch_alltoall_plan(const moe_backend *be, const moe_layer_dims *d, moe_layer_acts *a,
                                moe_layer_workspace *ws);

/** @brief Free what moe_dispatch_plan_build() allocated (moe_dispatcher::free of the
 *  alltoall dispatcher; the fused one adds its shifts). @param be backend @param plan plan */
void moe_dispatch_alltoall_free(const moe_backend *be, moe_dispatch_plan *plan);

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

/* ---------------------------------------------------------------- fused (dispatch_fused.c) */

/**
 * @brief The fused part of a host plan: each expert's shift from this rank's permuted rows
 *        to its rows on the expert's rank (the arithmetic of the device plan,
 *        moe_cpu_fused_plan(), run on the host's exchanged counts), and the largest rank's
 *        row count (the symmetric buffers are the same size on every rank). Called by
 *        moe_dispatch_plan_build().
 * @param plan plan (fused; E, E_local set) @param rank this rank in the EP group
 * @param P EP ranks @param all host [P·E] every rank's rows per expert (the exchanged counts)
 * @param be backend the shifts are uploaded to
 */
void moe_dispatch_fused_plan(moe_dispatch_plan *plan, int rank, int P, const long long *all,
                             const moe_backend *be);

/**
 * @brief The fused path's expert-side buffer for rows of @p row_bytes: grown (collectively)
 *        to hold the largest rank's rows of this plan.
 * @param ep context @param plan plan (fused) @param b symmetric buffer
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

/* ------------------------------------------------------------- shared pieces (dispatch.c) */

/**
 * @brief The forward's token side of the permutation, shared by the local and alltoall
 *        dispatchers: each token copied to its k permuted rows ([N·k,H], in a->xp where the
 *        layer keeps them, else in scratch: moe_layer_xp()) and each row's routing weight
 *        (a->wp [N·k]), in the order a->perm_src gives.
 * @param be backend @param d dims @param a saved state @param ws workspace
 * @param x [N,H] tokens
 * @return the permuted rows written (moe_layer_xp())
 */
void *moe_dispatch_permute(const moe_backend *be, const moe_layer_dims *d, moe_layer_acts *a,
                           moe_layer_workspace *ws, const void *x);

/**
 * @brief The forward's way back to token order, shared by the local and alltoall
 *        dispatchers: out[n] = Σ_j rows[row_of[n·k + j]] (overwritten).
 * @param be backend @param d dims @param a saved state @param out [N,H]
 * @param rows [N·k,H] the experts' outputs in the permuted layout
 */
void moe_dispatch_unpermute(const moe_backend *be, const moe_layer_dims *d,
                            const moe_layer_acts *a, void *out, const void *rows);

/**
 * @brief The backward's way back to token order from the permuted layout, shared by the
 *        local and alltoall dispatchers (and, for the weights, the fused one):
 *        dx[n] += Σ_j ws->dxp[row_of[n·k + j]], and ws->dtopk_w = ws->dwp by assignment.
 * @param be backend @param d dims @param a the forward's saved state @param ws workspace
 * @param dx [N,H] input gradients to add to, or NULL when they are there already
 */
void moe_dispatch_unpermute_grads(const moe_backend *be, const moe_layer_dims *d,
                                  const moe_layer_acts *a, moe_layer_workspace *ws, void *dx);

/**
 * @brief A grow-only backend buffer: returns @p p when *cap ≥ bytes, else frees it and
 *        allocates @p bytes (updating *cap).
 * @param be backend @param p current buffer @param cap its size in bytes @param bytes needed
 * @return the buffer
 */
void *moe_grow(const moe_backend *be, void *p, size_t *cap, size_t bytes);

/** @brief Free the context's staging buffers. @param ep context */
void moe_ep_free(moe_ep *ep);

#endif /* MOE_DISPATCH_H */
