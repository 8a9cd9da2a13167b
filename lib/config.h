/**
 * @file config.h
 * @brief Every setting of a moe.c run, the flag table that fills it, and validation.
 *
 * Flag names follow Megatron-LM (`--num-layers`, `--moe-router-topk`, …) so a
 * practitioner's command line carries over. Values arrive as text in
 * ::moe_config and are resolved into enums and per-layer masks by
 * moe_config_validate(), which is also where every inconsistency becomes a
 * named error ("--num-experts 6 is not divisible by --moe-router-num-groups 4 …").
 */
#ifndef MOE_CONFIG_H
#define MOE_CONFIG_H

#include "error.h"
#include "flags.h"

/** Most layers a model may have (the size of the per-layer MoE mask). */
#define MOE_MAX_LAYERS 256

/** Largest --moe-router-topk (the router keeps per-token arrays of this size on the stack). */
#define MOE_MAX_TOPK 64

/** Longest --sample-length (the sampler holds the text and its context on the host). */
#define MOE_MAX_SAMPLE_LENGTH 1000000

/** Longest --distributed-timeout-minutes: one week (keeps the deadline's arithmetic in
 *  range; a longer wait is a hang by any measure). */
#define MOE_MAX_TIMEOUT_MINUTES 10080.0

/** Most experts per MoE layer (the dispatcher sorts dropped assignments into one extra
 *  bucket, and the permutation handles 1024 buckets). */
#define MOE_MAX_EXPERTS 1023

/** Most groups (experts per rank) chapter 03's grouped kernel takes: its shared-memory
 *  offset table (--moe-expert-backend grouped). */
#define MOE_GROUPED_DEV_MAX_GROUPS 256
/** Feature sizes the grouped kernel takes are multiples of this (TMA rows are 16-byte
 *  aligned bf16). */
#define MOE_GROUPED_DEV_ALIGN 8

/** Most experts per token chapter 02's fused dispatcher takes (one lane of a warp per
 *  assignment; --moe-alltoall-path fused). */
#define MOE_FUSED_MAX_TOPK 32
/** The fused dispatcher moves rows in 16-byte pieces: --hidden-size is a multiple of this
 *  (bf16 elements). */
#define MOE_FUSED_ROW_ALIGN 8

/** Router score function (Megatron Core's --moe-router-score-function). */
typedef enum moe_score_fn {
    MOE_SCORE_SOFTMAX = 0, /**< softmax: top-k then softmax over the k, or pre-softmax */
    MOE_SCORE_SIGMOID = 1  /**< sigmoid: select on sigmoid+bias, weights renormalised */
} moe_score_fn;

/** Load-balancing loss type. */
typedef enum moe_lb_type {
    MOE_LB_NONE = 0,    /**< no auxiliary loss */
    MOE_LB_AUX = 1,     /**< global (micro-batch) auxiliary loss */
    MOE_LB_SEQ_AUX = 2  /**< per-sequence auxiliary loss, averaged over sequences */
} moe_lb_type;

/** How tokens reach experts on other ranks (--moe-token-dispatcher-type; the enums below
 *  list a choice flag's values in the order of its choice list). */
typedef enum moe_dispatcher_type {
    MOE_DISPATCHER_ALLTOALL = 0, /**< all-to-all: each token row goes to its experts' ranks */
    MOE_DISPATCHER_ALLGATHER = 1 /**< allgather: every rank sees every rank's tokens */
} moe_dispatcher_type;

/** How the alltoall dispatcher moves rows (--moe-alltoall-path). */
typedef enum moe_a2a_path {
    MOE_A2A_AUTO = 0,       /**< fused where the EP group can take it, else collective */
    MOE_A2A_COLLECTIVE = 1, /**< permute, all-to-all-v (NCCL/MPI), unpermute */
    MOE_A2A_FUSED = 2       /**< one kernel stores / loads rows in the peers' memory */
} moe_a2a_path;

/** Which assignments an expert over capacity keeps (--moe-token-drop-policy). */
typedef enum moe_drop_policy {
    MOE_DROP_PROBS = 0,   /**< the highest routing weights (ties: the earliest) */
    MOE_DROP_POSITION = 1 /**< the earliest tokens */
} moe_drop_policy;

/** The expert backend asked for (--moe-expert-backend); moe_expert_impl_from_config()
 *  turns `auto` into one of the others for the backend the model runs on. */
typedef enum moe_expert_choice {
    MOE_EXPERT_BACKEND_AUTO = 0,    /**< the fastest the backend has */
    MOE_EXPERT_BACKEND_LOOP = 1,    /**< chapter 01's loop over experts */
    MOE_EXPERT_BACKEND_CUBLAS = 2,  /**< cuBLAS's grouped GEMM */
    MOE_EXPERT_BACKEND_GROUPED = 3  /**< our grouped kernel (chapter 03) */
} moe_expert_choice;

/** How much of a training step is captured as CUDA graphs (--cuda-graph-scope, chapter 06).
 *  The levels nest: each captures what the one before does, and more (lib/graph.h). */
typedef enum moe_graph_scope {
    MOE_GRAPH_NONE = 0,           /**< every op launched from the host (eager) */
    MOE_GRAPH_ATTN = 1,           /**< each layer's attention block, forward and backward */
    MOE_GRAPH_MOE_ROUTER = 2,     /**< + the router and its losses */
    MOE_GRAPH_MOE_PREPROCESS = 3, /**< + the dispatch preprocessing (counts, offsets, permute) */
    MOE_GRAPH_LAYER = 4,          /**< each whole transformer layer */
    MOE_GRAPH_FULL_ITERATION = 5  /**< forward, backward and the optimizer: one graph */
} moe_graph_scope;

/** Learning-rate decay style. */
typedef enum moe_lr_style { MOE_LR_COSINE = 0, MOE_LR_CONSTANT = 1, MOE_LR_LINEAR = 2 } moe_lr_style;

/** Every setting of a run. Text-valued fields are resolved by moe_config_validate(). */
typedef struct moe_config {
    /* ---- model */
    int num_layers;             /**< --num-layers */
    int hidden_size;            /**< --hidden-size */
    int num_attention_heads;    /**< --num-attention-heads */
    int num_query_groups;       /**< --num-query-groups (KV heads; 0 = same as heads) */
    int ffn_hidden_size;        /**< --ffn-hidden-size (dense FFN layers) */
    int seq_length;             /**< --seq-length */
    double rotary_base;         /**< --rotary-base */
    double norm_epsilon;        /**< --norm-epsilon */
    int qk_layernorm;           /**< --qk-layernorm */
    double init_method_std;     /**< --init-method-std */
    /* ---- MoE */
    int num_experts;            /**< --num-experts (0 = dense model) */
    int moe_ffn_hidden_size;    /**< --moe-ffn-hidden-size */
    int moe_router_topk;        /**< --moe-router-topk */
    char moe_router_score_function[MOE_FLAG_STR_LEN]; /**< --moe-router-score-function */
    int moe_router_pre_softmax; /**< --moe-router-pre-softmax */
    int moe_router_num_groups;  /**< --moe-router-num-groups (0 = no group limit) */
    int moe_router_group_topk;  /**< --moe-router-group-topk */
    double moe_router_topk_scaling_factor; /**< --moe-router-topk-scaling-factor (0 = none) */
    char moe_router_load_balancing_type[MOE_FLAG_STR_LEN]; /**< --moe-router-load-balancing-type */
    double moe_aux_loss_coeff;  /**< --moe-aux-loss-coeff */
    double moe_z_loss_coeff;    /**< --moe-z-loss-coeff */
    int moe_router_enable_expert_bias; /**< --moe-router-enable-expert-bias */
    double moe_router_bias_update_rate; /**< --moe-router-bias-update-rate */
    int moe_shared_expert_intermediate_size; /**< --moe-shared-expert-intermediate-size (0 = none) */
    char moe_layer_freq[MOE_FLAG_STR_LEN]; /**< --moe-layer-freq: N (every Nth layer) or a 0/1 list */
    /* ---- expert parallelism (chapter 02) */
    int expert_model_parallel_size;        /**< --expert-model-parallel-size */
    /* ---- parallel folding (chapter 04) */
    int tensor_model_parallel_size;        /**< --tensor-model-parallel-size (TP) */
    int sequence_parallel;                 /**< --sequence-parallel (SP, needs TP > 1) */
    int use_distributed_optimizer;         /**< --use-distributed-optimizer (ZeRO-1) */
    int make_vocab_size_divisible_by;      /**< --make-vocab-size-divisible-by (vocabulary
                                                padding; 1 = none) */
    int expert_tensor_parallel_size;       /**< --expert-tensor-parallel-size (ETP) */
    int context_parallel_size;             /**< --context-parallel-size (CP: chapter 07) */
    char cp_comm_type[MOE_FLAG_STR_LEN];   /**< --cp-comm-type p2p|allgather|a2a|a2a+p2p */
    /** --hierarchical-context-parallel-sizes "A,P" (a2a+p2p: the a2a level, then the ring) */
    char hierarchical_context_parallel_sizes[MOE_FLAG_STR_LEN];
    int pipeline_model_parallel_size;      /**< --pipeline-model-parallel-size (PP: not planned) */
    char moe_token_dispatcher_type[MOE_FLAG_STR_LEN]; /**< --moe-token-dispatcher-type */
    char moe_alltoall_path[MOE_FLAG_STR_LEN];         /**< --moe-alltoall-path */
    double moe_expert_capacity_factor;     /**< --moe-expert-capacity-factor (0 = dropless) */
    /** --moe-expert-rank-capacity-factor: the static budget of permuted rows of a rank, as a
     *  multiple of its micro-batch's tokens·k (chapter 06) */
    double moe_expert_rank_capacity_factor;
    char moe_token_drop_policy[MOE_FLAG_STR_LEN]; /**< --moe-token-drop-policy */
    int moe_pad_expert_input_to_capacity;  /**< --moe-pad-expert-input-to-capacity */
    int moe_grouped_gemm;                  /**< --moe-grouped-gemm (chapter 03) */
    int moe_permute_fusion;                /**< --moe-permute-fusion (chapter 03) */
    char moe_expert_backend[MOE_FLAG_STR_LEN]; /**< --moe-expert-backend (chapter 03) */
    char cuda_graph_scope[MOE_FLAG_STR_LEN];   /**< --cuda-graph-scope (chapter 06) */
    char fp8_format[MOE_FLAG_STR_LEN];     /**< --fp8-format none|e4m3|hybrid (chapter 05) */
    char fp8_recipe[MOE_FLAG_STR_LEN];     /**< --fp8-recipe tensorwise|delayed|blockwise|mxfp8 */
    int fp8_amax_history_len;              /**< --fp8-amax-history-len (delayed scaling) */
    char moe_fp8_dispatch[MOE_FLAG_STR_LEN];       /**< --moe-fp8-dispatch auto|off */
    char fp8_amax_compute_algo[MOE_FLAG_STR_LEN]; /**< --fp8-amax-compute-algo max|most_recent */
    int fp8_margin;                        /**< --fp8-margin (delayed scaling) */
    char fp4_format[MOE_FLAG_STR_LEN];     /**< --fp4-format none|e2m1 */
    char fp4_recipe[MOE_FLAG_STR_LEN];     /**< --fp4-recipe nvfp4 */
    int fp4_disable_rht;                   /**< --fp4-disable-rht (NVFP4's wgrad RHT off) */
    /* ---- training */
    int micro_batch_size;       /**< --micro-batch-size */
    int global_batch_size;      /**< --global-batch-size (a multiple of the micro batch) */
    int train_iters;            /**< --train-iters */
    double lr;                  /**< --lr */
    double min_lr;              /**< --min-lr */
    int lr_warmup_iters;        /**< --lr-warmup-iters */
    int lr_decay_iters;         /**< --lr-decay-iters (0 = train-iters) */
    char lr_decay_style[MOE_FLAG_STR_LEN]; /**< --lr-decay-style */
    double weight_decay;        /**< --weight-decay */
    double adam_beta1;          /**< --adam-beta1 */
    double adam_beta2;          /**< --adam-beta2 */
    double adam_eps;            /**< --adam-eps */
    double clip_grad;           /**< --clip-grad (0 = off) */
    long long seed;             /**< --seed */
    int check_for_nan_in_loss_and_grad; /**< --check-for-nan-in-loss-and-grad (on by default) */
    double distributed_timeout_minutes;  /**< --distributed-timeout-minutes */
    /* ---- data, logging, output */
    char data_path[MOE_FLAG_STR_LEN];      /**< --data-path */
    char tokenizer_type[MOE_FLAG_STR_LEN]; /**< --tokenizer-type */
    int log_interval;           /**< --log-interval */
    int eval_interval;          /**< --eval-interval */
    int eval_iters;             /**< --eval-iters */
    char metrics_file[MOE_FLAG_STR_LEN];   /**< --metrics-file ("" = none) */
    int overwrite;              /**< --overwrite: replace existing output files */
    int sample_length;          /**< --sample-length */
    double sample_temperature;  /**< --sample-temperature */
    char device[MOE_FLAG_STR_LEN];         /**< --device */
    char preset[MOE_FLAG_STR_LEN];         /**< --preset */
    /* ---- checkpointing (checkpoint.h) */
    char save[MOE_FLAG_STR_LEN];           /**< --save: checkpoint directory ("" = no saving) */
    char load[MOE_FLAG_STR_LEN];           /**< --load: resume from this directory ("" = none) */
    int save_interval;          /**< --save-interval (0 = only at the end and on a signal) */
    int keep_last;              /**< --keep-last: checkpoints kept in --save (0 = all) */
    int exit_signal_handler;    /**< --exit-signal-handler */

    /* ---- resolved by moe_config_validate() */
    int vocab_size;             /**< set from the tokenizer, not a flag */
    int head_dim;               /**< hidden / heads */
    moe_score_fn score_fn;      /**< parsed score function */
    moe_lb_type lb_type;        /**< parsed load-balancing type */
    int cp_comm;                /**< parsed --cp-comm-type (a moe_cp_comm, context_parallel.h) */
    int cp_a2a;                 /**< a2a+p2p: the all-to-all level of
                                     --hierarchical-context-parallel-sizes (0: not given) */
    moe_lr_style lr_style;      /**< parsed decay style */
    int is_moe_layer[MOE_MAX_LAYERS]; /**< 1 where layer l has an MoE FFN */
    moe_dispatcher_type dispatcher_type; /**< parsed --moe-token-dispatcher-type */
    moe_a2a_path alltoall_path;          /**< parsed --moe-alltoall-path */
    moe_drop_policy drop_policy;         /**< parsed --moe-token-drop-policy */
    moe_expert_choice expert_backend;    /**< parsed --moe-expert-backend */
    moe_graph_scope graph_scope;         /**< parsed --cuda-graph-scope */
} moe_config;

/** @brief The flag table of moe.c. @param n receives its length @return the table */
const moe_flag *moe_config_flags(int *n);

/** @brief Fill @p cfg with every default (does not validate). @param cfg config */
void moe_config_defaults(moe_config *cfg);

/**
 * @brief Parse command-line flags over the defaults (does not validate).
 * @param cfg config (defaults must already be set)  @param argc count  @param argv arguments
 * @param err receives the reason on failure
 * @return ::MOE_OK, ::MOE_ERR_HELP or ::MOE_ERR_FLAG
 */
moe_status moe_config_parse(moe_config *cfg, int argc, char **argv, moe_error *err);

/**
 * @brief Check every value and every relation between values; resolve enums and the MoE mask.
 *
 * @p cfg->vocab_size must be set (by the tokenizer) before the call.
 * @param cfg  config
 * @param err  receives a message naming the offending flag(s) and the fix
 * @return ::MOE_OK or ::MOE_ERR_CONFIG
 */
moe_status moe_config_validate(moe_config *cfg, moe_error *err);

/** At most this many warnings from moe_config_warnings(). */
#define MOE_MAX_WARNINGS 8

/** Legal but suspicious settings of a validated configuration, one message each. */
typedef struct moe_config_warnings_t {
    int n;                          /**< how many */
    char msg[MOE_MAX_WARNINGS][256]; /**< each names the flag(s) and what it means */
} moe_config_warnings_t;

/**
 * @brief Settings that are legal but probably not what was meant: a warmup longer than the
 *        run, a capacity factor that never drops a token, a learning rate far above what
 *        AdamW trains with, ... The trainer prints them (rank 0) and runs on.
 * @param c a configuration moe_config_validate() accepted
 * @param out receives the warnings
 */
void moe_config_warnings(const moe_config *c, moe_config_warnings_t *out);

/**
 * @brief The communication deadline a configuration asks for
 *        (--distributed-timeout-minutes), checked: positive, finite, at most
 *        ::MOE_MAX_TIMEOUT_MINUTES. Programs call it before moe_comm_init(), which needs the
 *        deadline before the rest of the configuration can be validated.
 * @param c configuration (parsed)  @param seconds receives the deadline in seconds
 * @param err receives the reason on failure
 * @return ::MOE_OK or ::MOE_ERR_CONFIG
 */
moe_status moe_config_comm_timeout_s(const moe_config *c, double *seconds, moe_error *err);

/**
 * @brief Whether chapter 03's grouped kernel takes this model's expert GEMMs: hidden and
 *        expert sizes multiples of ::MOE_GROUPED_DEV_ALIGN, at most
 *        ::MOE_GROUPED_DEV_MAX_GROUPS experts per rank.
 * @param c configuration
 * @return 1 when it does
 */
int moe_config_grouped_kernel_fits(const moe_config *c);

/**
 * @brief Whether chapter 02's fused dispatcher takes this model's rows: --hidden-size a
 *        multiple of ::MOE_FUSED_ROW_ALIGN and --moe-router-topk at most
 *        ::MOE_FUSED_MAX_TOPK. (Whether the ranks share memory is the communicator's
 *        question: moe_comm_peer_access().)
 * @param c configuration
 * @param why receives the reason when it does not (may be NULL)  @param cap size of @p why
 * @return 1 when it does
 */
int moe_config_fused_fits(const moe_config *c, char *why, size_t cap);

/**
 * @brief Parse a space-separated flag string ("--hidden-size 64 --qk-layernorm") over
 *        @p cfg, as if it were a command line (does not validate).
 * @param cfg config  @param flags the string (at most 4095 characters, 127 words)
 * @param err receives the reason on failure
 * @return ::MOE_OK, ::MOE_ERR_HELP or ::MOE_ERR_FLAG
 */
moe_status moe_config_parse_string(moe_config *cfg, const char *flags, moe_error *err);

/**
 * @brief The flags a preset stands for: "cpu" is the defaults (a model that trains in
 *        minutes on a laptop), "gpu" a larger model sized for one H100/H200.
 * @param name "cpu" or "gpu"  @return a flag string ("" for cpu), or NULL for an unknown name
 */
const char *moe_config_preset_flags(const char *name);

/**
 * @brief Defaults, then the preset's flags, then the command line (which always wins).
 *        `--preset auto` picks "gpu" when the run will use CUDA (`--device cuda`, or
 *        `--device auto` with @p have_gpu) and "cpu" otherwise.
 * @param cfg receives the parsed (not yet validated) config  @param argc count
 * @param argv arguments  @param have_gpu 1 when a CUDA backend and a GPU are available
 * @param err receives the reason on failure
 * @return ::MOE_OK, ::MOE_ERR_HELP or ::MOE_ERR_FLAG
 */
moe_status moe_config_from_args(moe_config *cfg, int argc, char **argv, int have_gpu,
                                moe_error *err);

/** @brief Print --help for the trainer. @param f stream @param prog program name */
void moe_config_print_help(FILE *f, const char *prog);

#endif /* MOE_CONFIG_H */
