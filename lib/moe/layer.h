/**
 * @file layer.h
 * @brief The MoE FFN layer: route → losses → dispatch → experts → combine → shared
 *        expert, with the dispatcher, capacity and the expert backend as switches.
 *
 * Forward, for N tokens x [N,H]:
 *  1. route: router logits z = x·W_rᵀ [N,E] (fp32), routing → top-k experts and weights;
 *  2. losses: load-balancing aux loss and z-loss from z (they join the training loss);
 *  3. dispatch: the N·k assignments sorted by expert, each token copied to its k rows —
 *     in place on one rank (chapter 01), or to the ranks that hold the experts
 *     (chapter 02). The dispatcher is a strategy (dispatch.h): plan, dispatch, combine;
 *  4. experts: each local expert runs its SwiGLU MLP on its rows, with the routing
 *     weight applied after the activation (fused into the SwiGLU op, mlp.h) — chapter
 *     01's loop or chapter 03's grouped GEMMs (experts.h);
 *  5. combine: each token's output is the plain sum of its k expert rows;
 *  6. plus the shared expert (if any) applied to every token.
 * Backward runs the exact reverse on the same dispatcher and plan.
 *
 * The switches, in moe_layer_dims:
 *  - `ep` (chapter 02): the expert-parallel context; ep->dispatcher is the strategy of
 *    steps 3 and 5 (alltoall, fused or allgather, chosen once at setup), and step 4 runs
 *    this rank's E/EP experts;
 *  - `capacity_factor` (chapter 02): dropped assignments skip the experts (capacity.h);
 *    a single rank then uses the alltoall dispatcher too, with no peers;
 *  - `experts` (chapter 03): step 4 as chapter 01's loop or as one grouped GEMM per
 *    Linear (cuBLAS's, or our kernel that reads the group offsets on the device);
 *  - `permute_fusion` (chapter 03): step 3 moves only the routing weights, and fc1
 *    gathers its rows straight from the tokens by the permutation's index;
 *    `permute_scatter`, its other half: fc2 stores each output row in its token's slot
 *    (row n·k + j) and step 5 sums each token's k contiguous slots.
 *  - `tp` (chapter 04): attention's tensor-parallel group, with sequence parallelism. The
 *    layer then runs on this rank's N rows of the N·TP tokens (its sequence shard): the
 *    router is replicated (its gradient is this rank's part, summed over TP by the
 *    trainer), the aux-loss counts are summed over TP and each rank adds its rows' part of
 *    the loss (moe_aux_shape), the z-loss coefficient is divided by TP, and the shared
 *    expert is tensor-parallel like a dense FFN (all-gather, column-parallel fc1,
 *    row-parallel fc2, reduce-scatter). The experts see tokens, not ranks: the dispatcher
 *    sends each rank's rows to the EP group as before.
 *  - `shards` (chapter 07): under context parallelism the router statistics treat the CP
 *    ranks like TP's sequence shards: the counts are summed over TP x CP, the z-loss
 *    coefficient divided by TP x CP (the shared expert stays tensor-parallel over TP only).
 */
#ifndef MOE_LAYER_H
#define MOE_LAYER_H

#include "backend.h"
#include "config.h"
#include "graph.h"
#include "mlp.h"
#include "moe/dispatch.h"
#include "moe/expert_tp.h"
#include "tensor_parallel.h"

/** Sizes and settings of one MoE layer. */
typedef struct moe_layer_dims {
    int N;                      /**< tokens (B·T) */
    int T;                      /**< sequence length (groups of the per-sequence aux loss) */
    int H;                      /**< hidden size */
    int E;                      /**< experts */
    int k;                      /**< top-k */
    int F;                      /**< expert intermediate size */
    int Fs;                     /**< shared expert intermediate size (0 = none) */
    moe_router_params router;   /**< router settings */
    moe_lb_type lb_type;        /**< aux loss type */
    double aux_coeff;           /**< aux loss coefficient */
    double z_coeff;             /**< z-loss coefficient */
    moe_ep *ep;                 /**< expert parallelism with its dispatcher (NULL: one rank) */
    double capacity_factor;     /**< 0 = dropless */
    moe_drop_policy drop_policy; /**< which assignments an expert over capacity keeps */
    int pad_to_capacity;        /**< pad every expert's input to capacity rows */
    moe_expert_impl experts;    /**< how step 4 runs: loop, cuBLAS grouped, our kernel */
    /** the fused permutation (chapter 03, --moe-permute-fusion): fc1 gathers its rows from
     *  the tokens by index, so the permuted copy xp is never written; one rank, dropless,
     *  ::MOE_EXPERTS_KERNEL only */
    int permute_fusion;
    /** the fused permutation's other half (chapter 03, --moe-permute-fusion unless
     *  MOE_FUSED_SCATTER=0): fc2 stores its output row r at slot row perm_src[r] (= n·k + j)
     *  of ws->yp, so the permuted copy of the outputs is never written and the combine sums
     *  each token's k contiguous slot rows (unpermute_sum_slots: the same sums in the same
     *  order, bit for bit). The backward is unchanged (it never reads the outputs). The
     *  same conditions as @ref permute_fusion */
    int permute_scatter;
    const moe_tp *tp;           /**< the TP group with SP (NULL or size 1: all N·1 tokens here) */
    /** the ranks the micro-batch's tokens are split over, for the router's statistics: the
     *  TP group with SP, or under context parallelism TP x CP (chapter 07: a CP rank holds
     *  T/CP tokens of every sequence, as a TP rank holds N/TP rows). The aux-loss counts are
     *  summed over it and the z-loss coefficient divided by its size. NULL: @ref tp */
    const moe_tp *shards;
    /** chapter 06, the sync-free layer: the step-flags word (moe_model::step_flags, backend
     *  memory), or NULL. When set, a layer whose path allows it (moe_layer_sync_free())
     *  keeps the counts and offsets in backend memory from the router to the unpermute, and
     *  an overflow of @ref budget_rows raises ::MOE_STEP_OVERFLOW here */
    int *step_flags;
    /** the static budget of permuted rows (0: none, N·k); see moe_layer_permuted_rows() */
    int budget_rows;
    /** expert tensor parallelism (moe/expert_tp.h): the ETP group, each of its ranks holding
     *  F of every local expert's columns (F above is already this rank's part); NULL: none */
    const moe_tp *etp;
    /** chapter 06: the model's graph cache (graph.h) and this layer's index, for the capture
     *  sites inside the layer: the router at `--cuda-graph-scope moe_router`, the router and
     *  the dispatch plan at `moe_preprocess` (at `layer` the model captures the whole layer).
     *  NULL: every op is launched eagerly */
    moe_graphs *graphs;
    int layer; /**< this layer's index (the graphs' key) */
    /** chapter 05's emulated low precision (lowp.h): the routed and shared experts' GEMM
     *  operands go through its QDQ (the router's do not); NULL: none */
    moe_lowp *lowp;
} moe_layer_dims;

/** The layer's weights: the backend's compute copy (activation type), views into it. */
typedef struct moe_layer_weights {
    const void *router;      /**< [E,H] */
    const void *fc1;         /**< [E,2F,H] */
    const void *fc2;         /**< [E,H,F] */
    const void *shared_fc1;  /**< [2Fs,H] or NULL */
    const void *shared_fc2;  /**< [H,Fs] or NULL */
    /** chapter 05's native FP8 path (lowp.h): fc1's and fc2's FP8 codes and transposed
     *  codes, made once per step by moe_lowp_quantize_experts(); NULL: the emulation (or no
     *  low precision) */
    const moe_fp8_weight *fc1_fp8;
    const moe_fp8_weight *fc2_fp8; /**< see @ref fc1_fp8 */
    /** chapter 05's native FP8 dense linears (lowp.h): [2] the shared expert's fc1 and fc2
     *  in FP8, made once per step by moe_lowp_quantize_dense(); NULL: emulated */
    const moe_fp8_weight *shared_fp8;
} moe_layer_weights;

/** The layer's weight gradients (full precision), views into the gradient buffer. */
typedef struct moe_layer_grads {
    moe_real *router;      /**< [E,H] */
    moe_real *fc1;         /**< [E,2F,H] */
    moe_real *fc2;         /**< [E,H,F] */
    moe_real *shared_fc1;  /**< [2Fs,H] or NULL */
    moe_real *shared_fc2;  /**< [H,Fs] or NULL */
    /** how the experts' backward writes fc1 and fc2 (::moe_dw_mode): ACCUMULATE (0, the
     *  default), STORE when the caller knows they hold zeros (the first micro-batch of a
     *  step), ACT when they point at activation-type storage (our grouped kernel only) */
    moe_dw_mode expert_dw;
} moe_layer_grads;

/** What the forward saves for the backward (sized for N tokens). `void *` buffers are
 *  activations (the backend's type); `moe_real *` ones are full precision. */
typedef struct moe_layer_acts {
    void *logits;         /**< [N,E] router logits */
    int *topk_idx;        /**< [N,k] selected experts */
    moe_real *topk_w;     /**< [N,k] routing weights */
    int *perm_src;        /**< [N·k] assignment at each permuted row */
    int *row_of;          /**< [N·k] permuted row of each assignment */
    moe_real *wp;         /**< [N·k] routing weight of each permuted row */
    void *xp;             /**< [N·k,H] permuted inputs, where the backward reads them (the
                               local dispatcher without moe_layer_keeps_x_t()); else NULL, and
                               the forward writes them to scratch: moe_layer_xp() */
    void *gu;             /**< [N·k,2F] expert fc1 outputs (the local dispatcher's; the
                               others save the expert-side gue and acte, and this and act are
                               NULL) */
    void *act;            /**< [N·k,F] expert SwiGLU outputs × routing weight (fc2's input);
                               chapter 05: in moe_mlp_saved_form()'s form, and then with
                               moe_layer_keeps_x_t() the inputs' token-wise FP8 copy after
                               them (moe_mlp_act_bytes()) */
    void *shared_gu;      /**< [N,2Fs] */
    void *shared_act;     /**< [N,Fs] */
    int *expert_offset;   /**< host [E+1]: expert e owns permuted rows [off[e], off[e+1]) */
    int *dev_offset;      /**< the same offsets in backend memory ([E+2]; chapter 03 kernel) */
    long long *counts;    /**< host [E]: tokens per expert, this forward */
    long long *aux_counts; /**< backend [groups,E]: the aux loss's counts, summed over TP */
    double *loss;         /**< backend [2]: {load-balancing loss (this rank's part under TP),
                               z-loss} of this forward, on the device (step_scalars.h) */
    /* the dispatchers that send rows (dispatch.h) and capacity */
    long long dropped;    /**< assignments dropped by the capacity, this forward */
    int *dispatch_idx;    /**< [N·k] routing with dropped assignments set to E */
    int *host_idx;        /**< host [N·k] copy of the routing */
    moe_real *host_w;     /**< host [N·k] copy of the routing weights */
    moe_dispatch_plan plan; /**< how the tokens travelled */
    size_t e_rows;        /**< rows allocated on the expert side */
    void *xe;             /**< [e_rows,H] tokens at the local experts, where the backward
                               reads them (moe_layer_keeps_xe(); else NULL, and the
                               dispatcher writes them to scratch, moe_layer_xe()) */
    moe_real *we;         /**< [e_rows] their routing weights */
    void *gue;            /**< [e_rows,2F] expert fc1 outputs (NULL with ETP: a->etp.gu) */
    void *acte;           /**< [e_rows,F] expert SwiGLU outputs × routing weight (NULL with
                               ETP: a->etp.act) */
    moe_sym_buf xe_sym;   /**< the fused dispatcher: xe in memory the EP group shares
                               (unused with moe_layer_keeps_x_t(): the rows go to dye_sym) */
    moe_sym_buf we_sym;   /**< the fused dispatcher: we, likewise */
    moe_etp_rows etp;     /**< with ETP: the rows of the whole ETP group (moe/expert_tp.h) */
} moe_layer_acts;

/** Scratch shared by all MoE layers (only one runs at a time). */
typedef struct moe_layer_workspace {
    void *yp;           /**< [max(N·k,N),H] expert outputs, permuted */
    void *dyp;          /**< [N·k,H] */
    void *dxp;          /**< [N·k,H] permuted input gradients; in the forward, the permuted
                             inputs where the layer does not keep them (moe_layer_xp()) */
    moe_real *dwp;      /**< [N·k] */
    moe_real *dtopk_w;  /**< [N·k] */
    void *dlogits;      /**< [N,E] */
    void *dh;           /**< [max(N·k·F, N·Fs)] */
    void *dgu;          /**< [2·max(N·k·F, N·Fs)] */
    size_t e_rows;      /**< rows allocated for the expert-side scratch below */
    void *ye;           /**< [e_rows,H] expert outputs / input gradients at the experts */
    void *dye;          /**< [e_rows,H] output gradients at the experts; in the forward, the
                             tokens at the experts where the layer does not keep them
                             (moe_layer_xe()) */
    moe_real *dwe;      /**< [e_rows] routing-weight gradients at the experts */
    void *edh;          /**< [e_rows,F] */
    void *edgu;         /**< [e_rows,2F] */
    moe_sym_buf ye_sym;  /**< the fused dispatcher: ye in memory the EP group shares */
    moe_sym_buf dye_sym; /**< the fused dispatcher: dye, likewise */
    moe_sym_buf dwe_sym; /**< the fused dispatcher: dwe, likewise */
    moe_etp_work etp;    /**< with ETP: the gathered rows' scratch (moe/expert_tp.h) */
    moe_ep single;       /**< the alltoall dispatcher's context on one rank (a capacity
                              without EP): no group, its staging buffers kept across steps */
    /* with TP: [N·TP,H] whole-sequence buffers for the shared expert's gather/scatter,
     * lent by the caller (not freed here; the model's SP scratch) */
    void *tp_x;  /**< with TP: the gathered input [N·TP,H] (lent by the caller) */
    void *tp_y;  /**< with TP: the partial output / gathered output gradient (lent) */
    void *tp_dx; /**< with TP: the whole input's partial gradient (lent) */
} moe_layer_workspace;

/**
 * @brief Whether the layer runs sync-free (chapter 06): counts and offsets stay in backend
 *        memory from the router to the unpermute, forward and backward, and nothing waits
 *        for the device. That is dropless, our grouped kernel (it reads the offsets on the
 *        device), no ETP group, a step-flags word to raise an overflow in, and either one
 *        rank or an EP group with the fused dispatcher, whose plan is made on the device
 *        (the counts all-gathered on the stream, the shifts and offsets by the fused_plan op;
 *        the expert side holds a static budget of rows). The other paths need the counts on
 *        the host: the per-expert loop and cuBLAS's grouped GEMM size each GEMM from them, a
 *        capacity drops on the host, the collective all-to-all-v and the allgather
 *        dispatcher need host splits, and ETP gathers its group's rows with host offsets
 *        (graph.c's scope check lists the same paths from the flags alone).
 * @param d dims @return 1 or 0
 */
int moe_layer_sync_free(const moe_layer_dims *d);

/**
 * @brief Rows of the permuted buffers (xp, gu, act, yp, ...) for @p d->N tokens: the N·k
 *        assignments, or on the one-rank sync-free path the static budget d->budget_rows
 *        when that is smaller. On one rank, dropless, exactly N·k rows are filled whatever
 *        the routing, so any budget of at least N·k never overflows; a smaller one always
 *        does (the assignments past it get no row, ::MOE_STEP_OVERFLOW is raised and the
 *        step is re-run with grown buffers). Under EP the N·k rows a rank sends always fit;
 *        the budget sizes the expert side instead (the rows a rank receives depend on every
 *        rank's routing, up to EP·N·k).
 * @param d dims @return rows
 */
int moe_layer_permuted_rows(const moe_layer_dims *d);

/**
 * @brief Whether the layer keeps its experts' input as chapter 05's token-wise FP8 copy
 *        (moe_groups::keep_x_t) instead of the rows themselves: the permuted rows a->xp of
 *        the local dispatcher (without the fused permutation) or the expert-side rows of
 *        every other dispatcher (the fused NVLink one's peers then write them into the
 *        workspace's shared dye_sym; with ETP the rows gathered over the group, a->etp.x,
 *        moe_etp_plan()'s keep_x_t); our grouped kernel, and the
 *        saved form ::MOE_MLP_SAVED_FP8_TOKEN (the native FP8 experts' fused passes under
 *        the FP8 wgrad with the tiled SwiGLU forward). Then fc1's wgrad reads the copy, made
 *        in the forward (H·Kpad·33/32 bytes, Kpad the rows padded per expert to 128, against
 *        2·rows·H in bf16), and the rows are scratch (moe_layer_xp(), moe_layer_xe()).
 * @param be backend @param d dims (d->lowp's native flag set: the model sets it before the
 *        layers' buffers) @return 1 or 0
 */
int moe_layer_keeps_x_t(const moe_backend *be, const moe_layer_dims *d);

/**
 * @brief Whether the layer keeps the tokens at its experts (a->xe) for its backward: not
 *        where it keeps their FP8 copy (moe_layer_keeps_x_t()), nor with ETP, whose backward
 *        reads the rows gathered over the group (a->etp.x) instead. Then the dispatcher
 *        writes them into the workspace's dye (moe_layer_xe()). With ETP the expert-side fc1
 *        and SwiGLU outputs (a->gue, a->acte) are not allocated either: the experts' outputs
 *        are those of the gathered rows (a->etp.gu, a->etp.act).
 * @param be backend @param d dims @return 1 or 0
 */
int moe_layer_keeps_xe(const moe_backend *be, const moe_layer_dims *d);

/**
 * @brief Where the forward writes the permuted inputs: a->xp where the layer keeps them for
 *        its backward, else the workspace's dxp (free until the backward's input gradients;
 *        the alltoall dispatcher only sends them, and with moe_layer_keeps_x_t() the experts
 *        keep their FP8 copy).
 * @param a acts @param ws workspace @return [moe_layer_permuted_rows(),H] activation rows
 */
void *moe_layer_xp(const moe_layer_acts *a, const moe_layer_workspace *ws);

/**
 * @brief Where the dispatcher writes the tokens at the experts: a->xe where the layer keeps
 *        them for its backward, else the workspace's dye (free until the backward's output
 *        gradients at the experts; with moe_layer_keeps_x_t() the experts keep their FP8
 *        copy).
 * @param a acts @param ws workspace @return [rows at the experts,H] activation rows
 */
void *moe_layer_xe(const moe_layer_acts *a, const moe_layer_workspace *ws);

/**
 * @brief Re-allocate the buffers whose size is the budget of permuted rows, for the budget in
 *        @p d (after it grew: moe_model_grow_moe_budget()). What they held is lost: the step
 *        is re-run.
 * @param be backend @param a acts @param d dims @return 1, or 0 when an allocation failed
 */
int moe_layer_acts_regrow(const moe_backend *be, moe_layer_acts *a, const moe_layer_dims *d);

/**
 * @brief moe_layer_acts_regrow() for the workspace.
 * @param be backend @param w workspace @param d dims (those it was allocated with, new budget)
 * @return 1, or 0 when an allocation failed
 */
int moe_layer_workspace_regrow(const moe_backend *be, moe_layer_workspace *w,
                               const moe_layer_dims *d);

/** @brief Allocate the saved activations for @p d. @param be backend @param a acts @param d dims
 *  @return 1, or 0 when an allocation failed (free with moe_layer_acts_free()) */
int moe_layer_acts_alloc(const moe_backend *be, moe_layer_acts *a, const moe_layer_dims *d);
/** @brief Free them. @param be backend @param a acts */
void moe_layer_acts_free(const moe_backend *be, moe_layer_acts *a);
/** @brief Allocate the workspace for @p d. @param be backend @param w workspace @param d dims
 *  @return 1, or 0 when an allocation failed (free with moe_layer_workspace_free()) */
int moe_layer_workspace_alloc(const moe_backend *be, moe_layer_workspace *w,
                              const moe_layer_dims *d);
/** @brief Free it. @param be backend @param w workspace */
void moe_layer_workspace_free(const moe_backend *be, moe_layer_workspace *w);

/**
 * @brief Forward of the MoE FFN for @p N tokens (N ≤ the allocated size; N a multiple of T).
 * @param be backend  @param out [N,H] (overwritten)  @param x [N,H] input  @param w weights
 * @param expert_bias [E] fp32 selection bias or NULL  @param d dims (d->N is used)
 * @param a saved activations  @param ws workspace
 */
void moe_layer_forward(const moe_backend *be, void *out, const void *x, const moe_layer_weights *w,
                       const float *expert_bias, const moe_layer_dims *d, moe_layer_acts *a,
                       moe_layer_workspace *ws);

/**
 * @brief Backward of the MoE FFN (gradients accumulate). The aux and z losses enter with
 *        weight @p loss_scale (1/gradient-accumulation steps).
 * @param be backend  @param dx [N,H]  @param g weight gradients  @param dout [N,H]
 * @param x forward input  @param w weights  @param d dims  @param a saved activations
 * @param ws workspace  @param loss_scale weight of the aux/z losses in the total loss
 */
void moe_layer_backward(const moe_backend *be, void *dx, const moe_layer_grads *g, const void *dout,
                        const void *x, const moe_layer_weights *w, const moe_layer_dims *d,
                        const moe_layer_acts *a, moe_layer_workspace *ws, double loss_scale);

#endif /* MOE_LAYER_H */
