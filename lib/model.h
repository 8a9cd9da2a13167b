/**
 * @file model.h
 * @brief The decoder-only MoE transformer: parameters, forward, backward.
 *
 * token embedding → L × [ RMSNorm → causal GQA attention with RoPE (optional
 * QK-norm) → residual → RMSNorm → MoE FFN (or dense SwiGLU FFN) → residual ]
 * → final RMSNorm → LM head → cross-entropy.
 *
 * The model is written against the op table of backend.h and so runs on any
 * backend; its parameters, gradients and activations live in that backend's
 * memory. The training loss is
 *     L = CE + Σ_layers (aux_loss + z_loss),
 * and moe_model_backward() accumulates the gradient of `loss_scale · L`.
 */
#ifndef MOE_MODEL_H
#define MOE_MODEL_H

#include <stdint.h>

#include "attention.h"
#include "backend.h"
#include "config.h"
#include "graph.h"
#include "memory.h"
#include "moe/layer.h"
#include "params.h"
#include "step_flags.h"
#include "tensor_parallel.h"
#include "vocab_parallel.h"

/** Per-layer weight slots (offsets into the parameter buffer). */
typedef enum moe_layer_weight {
    MOE_W_LN1,        /**< attention RMSNorm [H] */
    MOE_W_Q,          /**< query projection [Hq·D, H] */
    MOE_W_K,          /**< key projection [Hkv·D, H] */
    MOE_W_V,          /**< value projection [Hkv·D, H] */
    MOE_W_O,          /**< output projection [H, Hq·D] */
    MOE_W_QNORM,      /**< QK-norm of queries [D] */
    MOE_W_KNORM,      /**< QK-norm of keys [D] */
    MOE_W_LN2,        /**< FFN RMSNorm [H] */
    MOE_W_ROUTER,     /**< router [E, H] */
    MOE_W_FC1,        /**< expert fc1 [E, 2F, H], or dense fc1 [2F, H] */
    MOE_W_FC2,        /**< expert fc2 [E, H, F], or dense fc2 [H, F] */
    MOE_W_SHARED_FC1, /**< shared expert fc1 [2Fs, H] */
    MOE_W_SHARED_FC2, /**< shared expert fc2 [H, Fs] */
    MOE_W_COUNT       /**< number of slots */
} moe_layer_weight;

/** Marks a slot the layer does not have. */
#define MOE_NO_WEIGHT ((size_t)-1)

/** The FP8 copies of a layer's dense linears (moe_model::fp8d): wq, wk, wv, wo, fc1, fc2 (the
 *  dense FFN's, or in a MoE layer the shared expert's). */
#define MOE_FP8_DENSE_SLOTS 6

/** Activations one transformer layer (block) saves for its backward: `void *` in the
 *  backend's activation type, `moe_real *` (norm statistics) in full precision. */
typedef struct moe_block_acts {
    void *ln1;                    /**< attention norm output [N,H] */
    moe_real *rstd1;              /**< its 1/rms per row [N] */
    moe_attention_acts attn;      /**< attention block saved state */
    void *xmid;                   /**< residual after attention [N,H] */
    void *ln2;                    /**< FFN norm output [N,H] */
    moe_real *rstd2;              /**< its 1/rms per row [N] */
    moe_layer_acts moe;           /**< MoE FFN saved state (MoE layers) */
    void *dense_gu;               /**< dense FFN fc1 output [N,2F] (dense layers) */
    void *dense_act;              /**< dense FFN SwiGLU output [N,F] (dense layers) */
} moe_block_acts;

/** Losses of the last forward. */
typedef struct moe_losses {
    double ce;      /**< mean cross-entropy */
    double aux;     /**< Σ over layers of the load-balancing loss */
    double z;       /**< Σ over layers of the z-loss */
    double total;   /**< ce + aux + z */
    long long dropped; /**< expert assignments dropped by the capacity, all layers */
} moe_losses;

/** Context parallelism of a model (chapter 07): each rank holds T/CP tokens of every
 *  sequence, chunk-major (moe_cp_take_local()), and its attention exchanges keys and values
 *  over the CP group; its router statistics are summed over TP x CP. */
typedef struct moe_model_cp {
    moe_cp_attention attn; /**< the exchange: comm, cp, rank, type, a2a and its groups (the
                                sizes are the attention block's to fill); cp = 1: none */
    moe_tp shards;         /**< the TP x CP group: the MoE layers' router statistics */
} moe_model_cp;

/** The model. */
typedef struct moe_model {
    moe_config cfg;               /**< validated configuration (a copy) */
    const moe_backend *be;        /**< where everything lives and runs */
    moe_ep *ep;                   /**< expert parallelism, or NULL */
    moe_tp tp;                    /**< tensor (and sequence) parallelism: size 1 without */
    moe_model_cp cp;              /**< context parallelism (cp.attn.cp = 1 without): the model
                                       then runs on T/CP tokens of each sequence */
    moe_memory_estimate mem;      /**< this rank's memory estimate (memory.h), checked before
                                       any allocation and printed by moe-train */
    moe_tp etp;                   /**< expert tensor parallelism (moe/expert_tp.h): the ETP
                                       group, from moe_ep::etp; size 1 without */
    moe_vocab_parallel vp;        /**< with TP: this rank's vocabulary shard (else zeroed) */
    int experts_local;            /**< experts of each MoE layer held by this rank */
    moe_param_table table;        /**< names, shapes, offsets */
    moe_real *params;             /**< [table.total] master weights, full precision; NULL when
                                       master_sharded (the optimizer holds them) */
    int master_sharded;           /**< the distributed optimizer keeps this rank's pieces of the
                                       master weights (moe_adamw::master, dist_optimizer.h):
                                       created with a grid and --use-distributed-optimizer */
    moe_real *grads;              /**< [table.total] gradients, full precision */
    int grads_zero;               /**< grads hold zeros: set by moe_model_zero_grad(), cleared
                                       by the next backward, which then lets our grouped
                                       kernel STORE the expert weight gradients */
    void *wact;                   /**< [table.total] compute copy of the weights in the activation
                                       type (aliases params when that type is moe_real and the
                                       model holds the master; its own buffer otherwise) */
    size_t off_embed;             /**< offset of the embedding [V,H] */
    size_t off_final_norm;        /**< offset of the final norm [H] */
    size_t off_lm_head;           /**< offset of the LM head [V,H] */
    size_t off[MOE_MAX_LAYERS][MOE_W_COUNT];       /**< per-layer tensors */
    float *expert_bias;           /**< [L·E] aux-loss-free selection bias (backend memory;
                                       moe_model_read_expert_bias() copies it out) */
    long long *load_counts;       /**< backend [L·E] tokens per expert since the last reset */
    int max_B;                    /**< allocated batch */
    int max_T;                    /**< allocated sequence length */
    int max_ffn;                  /**< widest dense FFN intermediate (sizes the FFN workspace) */
    int B;                        /**< batch of the last forward */
    int T;                        /**< sequence length of the last forward */
    int *tokens;                  /**< input ids, backend [B·T] */
    int *targets;                 /**< target ids, backend [B·T] */
    void **res;                   /**< residual stream: res[l] is layer l's input, [L+1][N,H] */
    moe_block_acts *acts;         /**< [L] */
    void *lnf;                /**< final norm output [N,H] */
    moe_real *rstdf;              /**< its 1/rms [N] */
    void *logits;             /**< [N,V], or with TP [N,V/TP] (this rank's ids) */
    moe_real *losses;             /**< [N] per-token cross-entropy */
    moe_layer_workspace ws;         /**< MoE/FFN scratch */
    void *d_res;              /**< ∂L/∂residual stream [N,H] */
    void *d_ln;               /**< ∂L/∂norm output [N,H] */
    moe_attention_scratch attn_scratch; /**< attention backward scratch */
    void *tp_x;                   /**< SP: the gathered input of a block [N,H] (else NULL) */
    void *tp_y;                   /**< SP: a row-parallel GEMM's partial output, and in the
                                       backward the gathered output gradient [N,H] */
    void *tp_dx;                  /**< SP: a block's partial input gradient [N,H] */
    void *d_logits;           /**< ∂L/∂logits, as logits */
    moe_losses last;              /**< losses of the last forward */
    double *layer_aux;            /**< [L] per-layer aux loss of the last forward */
    double *layer_z;              /**< [L] per-layer z-loss of the last forward */
    moe_step_scalars *scalars;    /**< [1] backend memory: the step's losses, norm, clip factor
                                       and flags, read once per step (step_scalars.h) */
    /** chapter 05's emulated FP8 / NVFP4 (lowp.h), or NULL without --fp8-format /
     *  --fp4-format. The compute copy of the weights is then its own buffer, every linear
     *  layer's matrix in it quantized at each moe_model_sync_weights() */
    moe_lowp *lowp;
    /** chapter 05's native FP8 path (lowp.h: moe_lowp_native(), our grouped kernel): [2L]
     *  the routed experts' fc1 and fc2 of each MoE layer in FP8, made at each
     *  moe_model_sync_weights() instead of their QDQ; NULL when emulated */
    moe_fp8_weight *fp8w;
    /** chapter 05's native FP8 dense linears (lowp.h, "Native FP8 dense linears",
     *  MOE_FP8_NATIVE_DENSE=1): [MOE_FP8_DENSE_SLOTS·L] each layer's wq, wk, wv, wo, then its
     *  dense FFN's (or shared expert's) fc1, fc2 in FP8, made at each moe_model_sync_weights()
     *  before their QDQ (an absent weight's slot stays zero); NULL when emulated */
    moe_fp8_weight *fp8d;
    int *step_flags;              /**< &scalars->flags, backend memory: MOE_STEP_* bits raised on
                                       the device during a step (step_flags.h); zeroed at each
                                       step start */
    int moe_budget_rows;          /**< chapter 06: the static budget of permuted rows of every
                                       MoE layer (--moe-expert-rank-capacity-factor · this
                                       rank's micro-batch tokens · k), grown on an overflow */
    int moe_budget_max;           /**< the most rows that can ever need a place (tokens·k·EP):
                                       the budget never grows past it */
    long long moe_budget_overflows; /**< overflows of the budget so far (each re-ran a step) */
    moe_graphs *graphs;           /**< the CUDA graphs of --cuda-graph-scope (graph.h); the
                                       attention blocks run through it */
} moe_model;

/**
 * @brief Build the model for a validated config: lay out the parameters and allocate
 *        parameters, gradients and activations for batches of up to @p B × cfg->seq_length.
 * @param out receives the model  @param cfg validated config (vocab_size set)
 * @param be backend  @param B largest micro-batch
 * @param ep expert parallelism: this rank holds experts [rank·E/EP, (rank+1)·E/EP) of every
 *        MoE layer and tokens travel through the dispatcher; NULL for a single rank
 * @param err receives the reason on failure
 * @return ::MOE_OK, ::MOE_ERR_NOMEM, or ::MOE_ERR_CONFIG for a --cuda-graph-scope that
 *         cannot be captured (moe_graph_scope_check())
 */
moe_status moe_model_create(moe_model **out, const moe_config *cfg, const moe_backend *be, int B,
                            moe_ep *ep, moe_error *err);

/**
 * @brief moe_model_create() with tensor parallelism: this rank holds its TP shard of the
 *        attention projections and of the dense FFNs (column-parallel QKV and fc1,
 *        row-parallel output projection and fc2), and under sequence parallelism 1/TP of
 *        the tokens of the residual stream (tensor_parallel.h).
 * @param out receives the model  @param cfg validated config  @param be backend
 * @param B largest micro-batch  @param ep expert parallelism or NULL
 * @param tp this rank's TP group (copied), or NULL for TP 1
 * @param cp context parallelism (copied), or NULL for CP 1: every forward then takes this
 *        rank's T/CP tokens of each sequence (chunk-major, moe_cp_take_local()) with T the
 *        local length, and the activations are sized for seq_length/CP tokens
 * @param grid the resolved grid of the run (moe_grid_resolve()), or NULL for one rank: the
 *        memory check before any allocation uses its per-rank estimate
 *        (moe_memory_estimate_rank(), kept in moe_model::mem), which counts the distributed
 *        optimizer's master weights and moments of this rank's pieces only. With a grid and
 *        --use-distributed-optimizer the model holds no fp32 master (moe_model::params NULL,
 *        moe_model::master_sharded set; the trainer's optimizer keeps this rank's pieces) and
 *        its compute copy moe_model::wact is a buffer of its own
 * @param err receives the reason on failure
 * @return ::MOE_OK or ::MOE_ERR_NOMEM (the estimate exceeds the backend's memory)
 */
moe_status moe_model_create_parallel(moe_model **out, const moe_config *cfg,
                                     const moe_backend *be, int B, moe_ep *ep, const moe_tp *tp,
                                     const moe_model_cp *cp, const moe_grid *grid,
                                     moe_error *err);

/** @brief Free the model. @param m model (NULL: no-op) */
void moe_model_free(moe_model *m);

/**
 * @brief Initialise every parameter from the counter-based RNG (same values on every backend):
 *        moe_model_set_weights() of moe_params_init()'s values.
 * @param m model  @param seed seed
 */
void moe_model_init(moe_model *m, uint64_t seed);

/** @brief Number of parameters (all experts). @param m model @return count */
size_t moe_model_num_params(const moe_model *m);

/** @brief Parameters a token uses: experts counted k of E. @param m model @return count */
size_t moe_model_num_active_params(const moe_model *m);

/**
 * @brief Training FLOPs per token (forward + backward), the numerator of MFU:
 *        6 · (matmul weights a token uses: attention projections, router, k of E experts,
 *        shared expert or dense FFN, LM head) + 6 · L · T · Hq · D for causal attention
 *        (QKᵀ and PV, 2·T·Hq·D multiply-adds each per token, halved by the causal mask,
 *        times 3 for forward + backward). Embedding lookups and norms are not counted.
 * @param m model  @param T sequence length  @return FLOPs per token
 */
double moe_model_flops_per_token(const moe_model *m, int T);

/**
 * @brief Forward pass over B sequences of T tokens (host token ids), leaving the losses on
 *        the device: m->scalars->mb = {Σ per-token CE, Σ_layers aux, Σ_layers z} (summed
 *        over TP), and each MoE layer's expert load added into m->load_counts. Nothing is
 *        read back (chapter 06: the trainer reads once per step).
 * @param m model  @param tokens host [B·T]  @param targets host [B·T] or NULL (no loss)
 * @param B sequences (≤ allocated)  @param T tokens per sequence (≤ seq_length; under CP
 *        this rank's tokens of each, ≤ seq_length/CP)
 */
void moe_model_forward_dev(moe_model *m, const int *tokens, const int *targets, int B, int T);

/**
 * @brief moe_model_forward_dev() for a batch in page-locked host memory (the backend's
 *        host_alloc): the tokens go up with from_host_async, so the call never waits and a
 *        captured training step (`--cuda-graph-scope full_iteration`) replays the upload.
 *        @p tokens and @p targets must not change until the step boundary's wait.
 * @param m model  @param tokens host_alloc'd [B·T]  @param targets host_alloc'd [B·T] or NULL
 * @param B sequences (≤ allocated)  @param T tokens per sequence (≤ seq_length; under CP
 *        this rank's tokens of each, ≤ seq_length/CP)
 */
void moe_model_forward_staged(moe_model *m, const int *tokens, const int *targets, int B, int T);

/**
 * @brief moe_model_forward_dev(), then the losses read back (a host sync): for evaluation,
 *        sampling, tests and programs that want the number now.
 * @param m model  @param tokens host [B·T]  @param targets host [B·T] or NULL (no loss)
 * @param B sequences (≤ allocated)  @param T tokens per sequence (≤ seq_length; under CP
 *        this rank's tokens of each, ≤ seq_length/CP)
 * @return the total loss (CE + aux + z), or 0 when @p targets is NULL; details in m->last,
 *         m->layer_aux and m->layer_z. Under CP the losses are summed over the CP group (a
 *         collective): every CP rank returns the micro-batch's
 */
double moe_model_forward(moe_model *m, const int *tokens, const int *targets, int B, int T);

/**
 * @brief Backward of the last forward (which must have had targets): grads += loss_scale·∇L.
 * @param m model  @param loss_scale 1/(gradient-accumulation steps)
 */
void moe_model_backward(moe_model *m, double loss_scale);

/** @brief Refresh the compute copy of the weights from the master weights (cast_to_act;
 *  a no-op when they are the same buffer, or when the model holds no master: then
 *  moe_zero_gather_weights() refreshes it), then what is derived from the compute copy
 *  (moe_model_weights_written()). After new master weights: set, loaded, or stepped by an
 *  optimizer that did not write the compute copy itself. @param m model */
void moe_model_sync_weights(moe_model *m);

/** @brief The compute copy of the weights is current (an AdamW step wrote it along with the
 *  master weights: moe_adamw_step()'s `act`): derive what comes from it, the low-precision
 *  weights of chapter 05 (their QDQ in place, or the FP8 codes of the native path). A no-op
 *  without a low-precision recipe or without a master (see moe_model_sync_weights()).
 *  @param m model */
void moe_model_weights_written(moe_model *m);

/** @brief The compute copy again from the master weights, quantized with the scales last
 *  recorded and recording nothing (chapter 05's delayed scaling, lowp.h): after a checkpoint
 *  restored the site table, the weights the saved run's next step would have used. A no-op
 *  without a low-precision recipe or a master. @param m model */
void moe_model_lowp_replay_weights(moe_model *m);

/**
 * @brief Set the weights from a whole host copy of the fp32 master weights (this rank's
 *        layout: its TP/EP shards): the master and its compute copy, or, when the model holds
 *        no master (moe_model::master_sharded), the compute copy alone (the optimizer's
 *        pieces are the caller's to set: moe_trainer_master_from_host()).
 * @param m model  @param host [table.total] the weights
 */
void moe_model_set_weights(moe_model *m, const moe_real *host);

/** @brief Set every gradient to zero (the next backward knows it: the first micro-batch's
 *  expert weight gradients are stored, not added). @param m model */
void moe_model_zero_grad(moe_model *m);

/**
 * @brief Grow the static MoE buffers after a step raised ::MOE_STEP_OVERFLOW.
 *
 * The trainer calls this at the step boundary when the step-flags word says a static MoE
 * buffer was too small; it then re-runs the step eagerly from the same state (the optimizer
 * skipped the update while the bit was set; the re-run zeroes the gradients, the load counts
 * and the flags again). The budget of permuted rows doubles, up to the most that can ever be
 * needed (moe_model::moe_budget_max), and every MoE layer's budget-sized buffers are
 * re-allocated; the event is counted in moe_model::moe_budget_overflows and logged
 * ("moe: static budget overflow, grew X -> Y permuted rows ...").
 * @param m   the model
 * @param err set on failure
 * @return MOE_OK; MOE_ERR_NOMEM when the grown buffers do not fit; MOE_ERR_CONFIG when the
 *         budget is already the most that can be needed (an overflow there is a bug)
 */
moe_status moe_model_grow_moe_budget(moe_model *m, moe_error *err);

/**
 * @brief Whether the model's MoE layers keep their experts' inputs as chapter 05's
 *        token-wise FP8 copy instead of the permuted rows (moe_layer_keeps_x_t()).
 * @param m the model  @return 1 or 0 (0 without MoE layers)
 */
int moe_model_keeps_x_t(const moe_model *m);

/**
 * @brief Whether a step of this model can raise ::MOE_STEP_OVERFLOW: some MoE layer runs
 *        sync-free (moe_layer_sync_free()) and its budget of permuted rows is below the most
 *        that can arrive. Every rank of a run gets the same answer (it follows from the
 *        configuration and the budget, which all ranks grow together), so the trainer can
 *        skip the step flags' sum over the world when it is 0 without a rank waiting alone.
 * @param m the model  @return 1 or 0
 */
int moe_model_may_overflow(const moe_model *m);

/**
 * @brief Aux-loss-free balancing: update every MoE layer's expert bias from m->load_counts
 *        (call once per global batch, then reset the counts). No-op unless the bias is enabled.
 *        Runs on the device, and does nothing there while m->step_flags holds a bit (a
 *        skipped step moves no bias).
 * @param m model
 */
void moe_model_update_expert_bias(moe_model *m);

/** @brief Copy the expert bias to the host (a sync: checkpoints, reference dumps).
 *  @param m model  @param host [L·E] receives it (nothing when the model has no experts) */
void moe_model_read_expert_bias(const moe_model *m, float *host);

/** @brief Zero m->load_counts (on the device). @param m model */
void moe_model_reset_load_counts(moe_model *m);

#endif /* MOE_MODEL_H */
