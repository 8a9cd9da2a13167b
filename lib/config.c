/* moe.c's flags, defaults and validation: see config.h. */
#include "config.h"
#include "graph.h"

#include <ctype.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "context_parallel.h"
#include "lowp.h"
#include "memory.h"

#define F(name, type, field, def, help, choices, group) \
    { name, type, offsetof(moe_config, field), def, help, choices, group }

static const char G_MODEL[] = "model";
static const char G_MOE[] = "mixture of experts";
static const char G_TRAIN[] = "training";
static const char G_DATA[] = "data, logging and output";
static const char G_CKPT[] = "checkpointing";
static const char G_PAR[] = "parallel folding";

/* The single source of truth for every flag: name, type, field, default, meaning. */
static const moe_flag g_flags[] = {
    F("num-layers", MOE_FLAG_INT, num_layers, "4", "transformer layers", NULL, G_MODEL),
    F("hidden-size", MOE_FLAG_INT, hidden_size, "128", "model width H", NULL, G_MODEL),
    F("num-attention-heads", MOE_FLAG_INT, num_attention_heads, "4", "query heads", NULL, G_MODEL),
    F("num-query-groups", MOE_FLAG_INT, num_query_groups, "2",
      "key/value heads for grouped-query attention (0 = one per query head)", NULL, G_MODEL),
    F("ffn-hidden-size", MOE_FLAG_INT, ffn_hidden_size, "512",
      "SwiGLU width of dense (non-MoE) FFN layers", NULL, G_MODEL),
    F("seq-length", MOE_FLAG_INT, seq_length, "128", "tokens per sequence", NULL, G_MODEL),
    F("rotary-base", MOE_FLAG_DOUBLE, rotary_base, "10000", "RoPE base frequency", NULL, G_MODEL),
    F("norm-epsilon", MOE_FLAG_DOUBLE, norm_epsilon, "1e-5", "RMSNorm epsilon", NULL, G_MODEL),
    F("qk-layernorm", MOE_FLAG_BOOL, qk_layernorm, "0",
      "RMSNorm on each query and key head before RoPE (Qwen3)", NULL, G_MODEL),
    F("init-method-std", MOE_FLAG_DOUBLE, init_method_std, "0.02",
      "std of the normal weight init (output projections use std/sqrt(2*layers))", NULL, G_MODEL),

    F("num-experts", MOE_FLAG_INT, num_experts, "8", "routed experts per MoE layer (0 = dense model)",
      NULL, G_MOE),
    F("moe-ffn-hidden-size", MOE_FLAG_INT, moe_ffn_hidden_size, "256", "SwiGLU width of each expert",
      NULL, G_MOE),
    F("moe-router-topk", MOE_FLAG_INT, moe_router_topk, "2", "experts per token (k)", NULL, G_MOE),
    F("moe-router-score-function", MOE_FLAG_CHOICE, moe_router_score_function, "softmax",
      "router score function", "softmax|sigmoid", G_MOE),
    F("moe-router-pre-softmax", MOE_FLAG_BOOL, moe_router_pre_softmax, "0",
      "softmax over all experts before top-k (no renormalisation)", NULL, G_MOE),
    F("moe-router-num-groups", MOE_FLAG_INT, moe_router_num_groups, "0",
      "expert groups for group-limited routing (0 = off)", NULL, G_MOE),
    F("moe-router-group-topk", MOE_FLAG_INT, moe_router_group_topk, "0",
      "groups each token may route to (with --moe-router-num-groups)", NULL, G_MOE),
    F("moe-router-topk-scaling-factor", MOE_FLAG_DOUBLE, moe_router_topk_scaling_factor, "0",
      "multiply the final routing weights by this (0 = off)", NULL, G_MOE),
    F("moe-router-load-balancing-type", MOE_FLAG_CHOICE, moe_router_load_balancing_type, "aux_loss",
      "auxiliary load-balancing loss", "aux_loss|seq_aux_loss|none", G_MOE),
    F("moe-aux-loss-coeff", MOE_FLAG_DOUBLE, moe_aux_loss_coeff, "0.01",
      "coefficient of the load-balancing loss (equals the loss at perfect balance)", NULL, G_MOE),
    F("moe-z-loss-coeff", MOE_FLAG_DOUBLE, moe_z_loss_coeff, "0.001",
      "coefficient of the router z-loss mean(logsumexp(logits)^2) (0 = off)", NULL, G_MOE),
    F("moe-router-enable-expert-bias", MOE_FLAG_BOOL, moe_router_enable_expert_bias, "0",
      "aux-loss-free balancing: per-expert selection bias (sigmoid router)", NULL, G_MOE),
    F("moe-router-bias-update-rate", MOE_FLAG_DOUBLE, moe_router_bias_update_rate, "1e-3",
      "expert-bias step: b += rate*sign(mean_count - count), once per global batch", NULL, G_MOE),
    F("moe-shared-expert-intermediate-size", MOE_FLAG_INT, moe_shared_expert_intermediate_size, "0",
      "SwiGLU width of a shared expert every token uses (0 = none)", NULL, G_MOE),
    F("moe-layer-freq", MOE_FLAG_STRING, moe_layer_freq, "1",
      "which layers are MoE: N = every Nth layer, or a 0/1 list such as 0,1,1,1 (dense first)",
      NULL, G_MOE),

    F("expert-model-parallel-size", MOE_FLAG_INT, expert_model_parallel_size, "1",
      "ranks the experts of each MoE layer are split over (EP); must divide --num-experts and "
      "the number of ranks", NULL, G_MOE),
    F("moe-token-dispatcher-type", MOE_FLAG_CHOICE, moe_token_dispatcher_type, "alltoall",
      "how tokens reach experts on other ranks", "alltoall|allgather", G_MOE),
    F("moe-alltoall-path", MOE_FLAG_CHOICE, moe_alltoall_path, "auto",
      "how the alltoall dispatcher moves rows: collective = permute, all-to-all-v (NCCL/MPI), "
      "unpermute; fused = one kernel stores each token into its experts' GPUs and one loads "
      "them back (GPUs in one NVLink domain, NCCL >= 2.28 device API); auto = fused where "
      "possible", "auto|collective|fused", G_MOE),
    F("moe-expert-capacity-factor", MOE_FLAG_DOUBLE, moe_expert_capacity_factor, "0",
      "capacity = ceil(tokens*k/E * factor) per expert; extra tokens are dropped (0 = dropless)",
      NULL, G_MOE),
    F("moe-expert-rank-capacity-factor", MOE_FLAG_DOUBLE, moe_expert_rank_capacity_factor,
      "2.0",
      "static budget of permuted rows per rank, as a multiple of the balanced micro-batch "
      "tokens*k (sync-free dropless layer, chapter 06): an overflow is detected on the GPU, "
      "the buffers grow and the step is re-run; one rank never needs more than 1.0",
      NULL, G_MOE),
    F("moe-token-drop-policy", MOE_FLAG_CHOICE, moe_token_drop_policy, "probs",
      "which tokens an expert over capacity keeps: highest routing weight, or earliest",
      "probs|position", G_MOE),
    F("moe-pad-expert-input-to-capacity", MOE_FLAG_BOOL, moe_pad_expert_input_to_capacity, "0",
      "pad every expert's input to exactly capacity rows (static shapes; needs a capacity "
      "factor)", NULL, G_MOE),

    F("moe-grouped-gemm", MOE_FLAG_BOOL, moe_grouped_gemm, "0",
      "run all local experts' GEMMs as grouped GEMMs instead of chapter 01's loop (Megatron's "
      "switch: with --moe-expert-backend auto it picks 'grouped')", NULL, G_MOE),
    F("moe-permute-fusion", MOE_FLAG_BOOL, moe_permute_fusion, "0",
      "fuse the token permutation into the experts' GEMMs: fc1 gathers its rows from the "
      "tokens by index and fc2 stores its rows in their tokens' slots, so neither permuted "
      "copy is written (chapter 03; one rank, dropless, our grouped kernel; "
      "MOE_FUSED_GATHER=0 or MOE_FUSED_SCATTER=0 turns one half off)", NULL, G_MOE),
    F("moe-expert-backend", MOE_FLAG_CHOICE, moe_expert_backend, "auto",
      "how the experts' GEMMs run: loop (one cublasGemmEx per expert, chapter 01), "
      "cublas-grouped (cublasGemmGroupedBatchedEx), grouped (our sm_90a kernel, sizes read on "
      "the GPU; cuBLAS grouped on other GPUs); auto = grouped on a GPU, loop on the CPU",
      "auto|loop|cublas-grouped|grouped", G_MOE),
    F("cuda-graph-scope", MOE_FLAG_CHOICE, cuda_graph_scope, "none",
      "what is captured once as CUDA graphs and replayed every step (chapter 06; levels nest, "
      "each shape is captured once): none; attn = each layer's attention block, forward and "
      "backward; moe_router = + the router; moe_preprocess = + the dispatch preprocessing; "
      "layer = whole layers; full_iteration = forward, backward and optimizer. A level whose "
      "work still waits for the host is refused with what it waits for",
      "none|attn|moe_router|moe_preprocess|layer|full_iteration", G_TRAIN),

    F("fp8-format", MOE_FLAG_CHOICE, fp8_format, "none",
      "train every linear layer in FP8, emulated (chapter 05: quantize -> dequantize of the "
      "GEMM operands): e4m3 everywhere, or hybrid = e4m3 forward and e5m2 gradients",
      "none|e4m3|hybrid", G_TRAIN),
    F("fp8-recipe", MOE_FLAG_CHOICE, fp8_recipe, "tensorwise",
      "scaling of --fp8-format: tensorwise (current scaling: the tensor's amax now), "
      "delayed (a scale per tensor from the amax history of the previous steps), "
      "blockwise (1x128 tiles, 128x128 weight blocks), mxfp8 (32-element blocks, E8M0 "
      "scales)",
      "tensorwise|delayed|blockwise|mxfp8", G_TRAIN),
    F("moe-fp8-dispatch", MOE_FLAG_CHOICE, moe_fp8_dispatch, "auto",
      "--fp8-recipe blockwise under expert parallelism: quantize the tokens 1x128 once before "
      "the all-to-all, so EP moves FP8 codes and fp32 scales (about half the bytes of bf16) "
      "and the experts' fc1 reads them with no second quantization; the way back stays in "
      "the activation type. auto = on with blockwise, EP > 1 and the collective all-to-all; "
      "off = tokens travel in the activation type", "auto|off", G_TRAIN),
    F("fp8-amax-history-len", MOE_FLAG_INT, fp8_amax_history_len, "1",
      "--fp8-recipe delayed: the amaxes of the last N steps each tensor keeps (Megatron's "
      "default 1; TransformerEngine's own is 1024)", NULL, G_TRAIN),
    F("fp8-amax-compute-algo", MOE_FLAG_CHOICE, fp8_amax_compute_algo, "most_recent",
      "--fp8-recipe delayed: the scale from the largest amax of the history (max) or the "
      "last one (most_recent, Megatron's default)", "most_recent|max", G_TRAIN),
    F("fp8-margin", MOE_FLAG_INT, fp8_margin, "0",
      "--fp8-recipe delayed: divide every scale by 2^margin (headroom for a growing amax)",
      NULL, G_TRAIN),
    F("fp4-format", MOE_FLAG_CHOICE, fp4_format, "none",
      "train every linear layer in FP4 (E2M1), emulated, with --fp4-recipe", "none|e2m1",
      G_TRAIN),
    F("fp4-recipe", MOE_FLAG_CHOICE, fp4_recipe, "nvfp4",
      "scaling of --fp4-format: nvfp4 (16-element blocks with E4M3 scales and an fp32 scale "
      "per tensor, 16x16 weight blocks, stochastic rounding of the gradients, a random "
      "Hadamard transform of the wgrad operands along the tokens)", "nvfp4",
      G_TRAIN),
    F("fp4-disable-rht", MOE_FLAG_BOOL, fp4_disable_rht, "0",
      "--fp4-recipe nvfp4: no random Hadamard transform of the wgrad operands (the wgrad "
      "then quantizes them along the tokens without it; TransformerEngine's "
      "NVFP4BlockScaling disable_rht, NVTE_NVFP4_DISABLE_RHT=1)", NULL, G_TRAIN),

    F("tensor-model-parallel-size", MOE_FLAG_INT, tensor_model_parallel_size, "1",
      "ranks each attention and dense-FFN matrix is split over (TP, Megatron style: column-"
      "parallel QKV and fc1, row-parallel output projection and fc2); must divide the heads, "
      "the key/value groups, --hidden-size, --ffn-hidden-size and the number of ranks",
      NULL, G_PAR),
    F("make-vocab-size-divisible-by", MOE_FLAG_INT, make_vocab_size_divisible_by, "1",
      "pad the tokenizer's vocabulary with unused ids up to a multiple of this, so that "
      "--tensor-model-parallel-size can split the embedding and LM head by vocabulary rows "
      "(Megatron pads to a multiple of this times TP; moe.c pads to exactly this multiple, "
      "so the model stays the same for every TP)", NULL, G_PAR),
    F("sequence-parallel", MOE_FLAG_BOOL, sequence_parallel, "0",
      "with TP: norms and residuals on 1/TP of the tokens each (all-gather before the column-"
      "parallel GEMMs, reduce-scatter after the row-parallel ones)", NULL, G_PAR),
    F("use-distributed-optimizer", MOE_FLAG_BOOL, use_distributed_optimizer, "0",
      "ZeRO-1: reduce-scatter the gradients over the data-parallel ranks, AdamW on this rank's "
      "1/DP of the parameters (and only its moments), all-gather the parameters", NULL, G_PAR),
    F("expert-tensor-parallel-size", MOE_FLAG_INT, expert_tensor_parallel_size, "1",
      "ranks each expert's matrices are split over (ETP; expert grid ETP x EP x EDP)", NULL,
      G_PAR),
    F("context-parallel-size", MOE_FLAG_INT, context_parallel_size, "1",
      "ranks each sequence is split over (CP; chapter 07): each holds 2 of its 2·CP chunks and "
      "attention exchanges keys and values", NULL, G_PAR),
    F("cp-comm-type", MOE_FLAG_CHOICE, cp_comm_type, "p2p",
      "how context-parallel attention brings the keys: p2p (ring), allgather (Llama 3), a2a "
      "(Ulysses: heads <-> sequence), a2a+p2p (a2a inside groups, the ring between them)",
      "p2p|allgather|a2a|a2a+p2p", G_PAR),
    F("hierarchical-context-parallel-sizes", MOE_FLAG_STRING, hierarchical_context_parallel_sizes,
      "", "with --cp-comm-type a2a+p2p: the two levels as 'A,P' (A ranks of adjacent CP ranks "
      "do the all-to-all, P of those groups form the ring; A x P = --context-parallel-size)",
      NULL, G_PAR),
    F("pipeline-model-parallel-size", MOE_FLAG_INT, pipeline_model_parallel_size, "1",
      "pipeline stages (PP; not planned in moe.c: only 1)", NULL, G_PAR),

    F("micro-batch-size", MOE_FLAG_INT, micro_batch_size, "16", "sequences per forward/backward",
      NULL, G_TRAIN),
    F("global-batch-size", MOE_FLAG_INT, global_batch_size, "16",
      "sequences per optimizer step (gradient accumulation = global/micro)", NULL, G_TRAIN),
    F("train-iters", MOE_FLAG_INT, train_iters, "1500", "optimizer steps", NULL, G_TRAIN),
    F("lr", MOE_FLAG_DOUBLE, lr, "2e-3", "peak learning rate", NULL, G_TRAIN),
    F("min-lr", MOE_FLAG_DOUBLE, min_lr, "1e-4", "learning rate at the end of the decay", NULL,
      G_TRAIN),
    F("lr-warmup-iters", MOE_FLAG_INT, lr_warmup_iters, "100", "linear warmup steps", NULL, G_TRAIN),
    F("lr-decay-iters", MOE_FLAG_INT, lr_decay_iters, "0",
      "steps over which the rate decays to --min-lr (0 = --train-iters)", NULL, G_TRAIN),
    F("lr-decay-style", MOE_FLAG_CHOICE, lr_decay_style, "cosine", "decay after warmup",
      "cosine|linear|constant", G_TRAIN),
    F("weight-decay", MOE_FLAG_DOUBLE, weight_decay, "0.1",
      "AdamW decoupled weight decay (matrices only; norms are not decayed)", NULL, G_TRAIN),
    F("adam-beta1", MOE_FLAG_DOUBLE, adam_beta1, "0.9", "AdamW beta1", NULL, G_TRAIN),
    F("adam-beta2", MOE_FLAG_DOUBLE, adam_beta2, "0.99", "AdamW beta2", NULL, G_TRAIN),
    F("adam-eps", MOE_FLAG_DOUBLE, adam_eps, "1e-8", "AdamW epsilon", NULL, G_TRAIN),
    F("clip-grad", MOE_FLAG_DOUBLE, clip_grad, "1.0", "clip the global gradient norm (0 = off)",
      NULL, G_TRAIN),
    F("seed", MOE_FLAG_INT64, seed, "1337", "seed of weights, batches and sampling", NULL, G_TRAIN),
    F("check-for-nan-in-loss-and-grad", MOE_FLAG_BOOL, check_for_nan_in_loss_and_grad, "1",
      "stop the run (exit 1) when a step's loss or gradient norm is NaN or infinite, before "
      "the optimizer touches the weights", NULL, G_TRAIN),
    F("distributed-timeout-minutes", MOE_FLAG_DOUBLE, distributed_timeout_minutes, "5",
      "end the job when a communication operation has not completed after this long (a rank "
      "stopped or hung); the environment variable MOE_COMM_TIMEOUT (seconds) overrides it",
      NULL, G_TRAIN),

    F("data-path", MOE_FLAG_STRING, data_path, "",
      "training text (default: $MOE_DATA_PATH, data/, ../shared/data/, then download)", NULL,
      G_DATA),
    F("tokenizer-type", MOE_FLAG_CHOICE, tokenizer_type, "char",
      "char = distinct characters of the text, byte = all 256 bytes", "char|byte", G_DATA),
    F("log-interval", MOE_FLAG_INT, log_interval, "25", "print a training line every N steps", NULL,
      G_DATA),
    F("eval-interval", MOE_FLAG_INT, eval_interval, "250",
      "evaluate validation loss every N steps (and at the end; 0 = only at the end)", NULL, G_DATA),
    F("eval-iters", MOE_FLAG_INT, eval_iters, "20", "validation batches per evaluation", NULL,
      G_DATA),
    F("metrics-file", MOE_FLAG_STRING, metrics_file, "",
      "write JSON-lines metrics here (one object per line)", NULL, G_DATA),
    F("overwrite", MOE_FLAG_BOOL, overwrite, "0",
      "replace an existing --metrics-file (without it an existing file is never overwritten)",
      NULL, G_DATA),
    F("sample-length", MOE_FLAG_INT, sample_length, "300",
      "characters of text generated at the end (0 = none)", NULL, G_DATA),
    F("sample-temperature", MOE_FLAG_DOUBLE, sample_temperature, "0.8",
      "sampling temperature for the text sample", NULL, G_DATA),
    F("device", MOE_FLAG_CHOICE, device, "auto",
      "backend: auto = cuda when built with CUDA and a GPU is present, else cpu", "auto|cpu|cuda",
      G_DATA),
    F("preset", MOE_FLAG_CHOICE, preset, "auto",
      "default sizes: cpu = this table's defaults, gpu = a larger model for one H100/H200, "
      "auto = gpu when running on CUDA; explicit flags always win",
      "auto|cpu|gpu", G_DATA),

    F("save", MOE_FLAG_STRING, save, "",
      "save checkpoints into this directory (every --save-interval steps, at the end, and on "
      "SIGINT/SIGTERM with --exit-signal-handler)", NULL, G_CKPT),
    F("load", MOE_FLAG_STRING, load, "",
      "resume from the latest checkpoint in this directory (the same as --save: start fresh "
      "when it has none yet)", NULL, G_CKPT),
    F("save-interval", MOE_FLAG_INT, save_interval, "0",
      "save a checkpoint every N steps (0 = only at the end and on a signal)", NULL, G_CKPT),
    F("keep-last", MOE_FLAG_INT, keep_last, "2",
      "checkpoints kept in --save; older ones are deleted after a newer one is complete "
      "(0 = keep all)", NULL, G_CKPT),
    F("exit-signal-handler", MOE_FLAG_BOOL, exit_signal_handler, "0",
      "on SIGINT or SIGTERM, save a checkpoint at the next step boundary and exit 0 (a second "
      "signal kills at once)", NULL, G_CKPT),
};

const moe_flag *moe_config_flags(int *n) {
    *n = (int)(sizeof g_flags / sizeof g_flags[0]);
    return g_flags;
}

void moe_config_defaults(moe_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    int n;
    const moe_flag *f = moe_config_flags(&n);
    moe_flags_set_defaults(f, n, cfg);
}

moe_status moe_config_parse(moe_config *cfg, int argc, char **argv, moe_error *err) {
    int n;
    const moe_flag *f = moe_config_flags(&n);
    return moe_flags_parse(f, n, cfg, argc, argv, err);
}

/* The GPU preset: 45M parameters (13M active), 8192 tokens per step. tinyshakespeare has
 * only 1M characters, so a model this size starts to overfit after ~6 epochs: measured on
 * an H200, validation loss is best around step 750 and rises after 1000, hence 750 steps
 * (about 15 s on an H200). */
static const char g_gpu_preset[] =
    "--num-layers 6 --hidden-size 384 --num-attention-heads 6 --num-query-groups 2 "
    "--ffn-hidden-size 1536 --num-experts 8 --moe-ffn-hidden-size 768 --moe-router-topk 2 "
    "--seq-length 256 --micro-batch-size 32 --global-batch-size 32 --train-iters 750 "
    "--lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 50 --eval-interval 125";

const char *moe_config_preset_flags(const char *name) {
    if (!strcmp(name, "cpu"))
        return "";
    if (!strcmp(name, "gpu"))
        return g_gpu_preset;
    return NULL;
}

moe_status moe_config_parse_string(moe_config *cfg, const char *flags, moe_error *err) {
    char buf[4096];
    if (strlen(flags) >= sizeof buf)
        return moe_error_set(err, MOE_ERR_FLAG, "flag string longer than %zu characters",
                             sizeof buf - 1);
    snprintf(buf, sizeof buf, "%s", flags);
    char *argv[128] = {"flags"};
    int argc = 1;
    for (char *tok = strtok(buf, " "); tok; tok = strtok(NULL, " ")) {
        if (argc == 128)
            return moe_error_set(err, MOE_ERR_FLAG, "flag string has more than 127 words");
        argv[argc++] = tok;
    }
    return moe_config_parse(cfg, argc, argv, err);
}

moe_status moe_config_from_args(moe_config *cfg, int argc, char **argv, int have_gpu,
                                moe_error *err) {
    moe_config_defaults(cfg);
    MOE_TRY(moe_config_parse(cfg, argc, argv, err)); /* first pass: --preset and --device */
    const char *preset = cfg->preset;
    if (!strcmp(preset, "auto"))
        preset = !strcmp(cfg->device, "cuda") || (!strcmp(cfg->device, "auto") && have_gpu)
                     ? "gpu"
                     : "cpu";
    const char *flags = moe_config_preset_flags(preset);
    MOE_ASSERT(flags != NULL); /* the choice list only admits known presets */
    if (!*flags)
        return MOE_OK;
    char saved[MOE_FLAG_STR_LEN];
    snprintf(saved, sizeof saved, "%s", preset);
    moe_config_defaults(cfg);
    MOE_TRY(moe_config_parse_string(cfg, flags, err));
    MOE_TRY(moe_config_parse(cfg, argc, argv, err)); /* the command line wins */
    snprintf(cfg->preset, sizeof cfg->preset, "%s", saved);
    return MOE_OK;
}

void moe_config_print_help(FILE *f, const char *prog) {
    int n;
    const moe_flag *flags = moe_config_flags(&n);
    moe_flags_print_help(
        f, prog,
        "Train a decoder-only Mixture-of-Experts transformer (Qwen3-MoE / DeepSeek-V3 family)\n"
        "on a text file. Flag names follow Megatron-LM.",
        flags, n);
}

/* Parse --moe-layer-freq: "N" = layers 0, N, 2N… are MoE (Megatron's integer form),
 * or a comma list of 0/1 (brackets allowed), one entry per layer. */
static moe_status parse_layer_freq(moe_config *cfg, moe_error *err) {
    const char *s = cfg->moe_layer_freq;
    const char *p = s;
    while (*p && isspace((unsigned char)*p))
        p++;
    if (*p && !strchr(p, ',') && *p != '[') {
        char *end;
        long n = strtol(p, &end, 10);
        if (*end || n < 1)
            return moe_error_set(err, MOE_ERR_CONFIG,
                                 "--moe-layer-freq '%s': give a positive integer N (every Nth "
                                 "layer is MoE) or a 0/1 list such as 0,1,1,1",
                                 s);
        for (int l = 0; l < cfg->num_layers; l++)
            cfg->is_moe_layer[l] = (l % n) == 0;
        return MOE_OK;
    }
    int count = 0;
    for (; *p; p++) {
        if (*p == '0' || *p == '1') {
            if (count >= cfg->num_layers)
                return moe_error_set(err, MOE_ERR_CONFIG,
                                     "--moe-layer-freq '%s' has more entries than --num-layers %d",
                                     s, cfg->num_layers);
            cfg->is_moe_layer[count++] = *p == '1';
        } else if (!(*p == ',' || *p == '[' || *p == ']' || isspace((unsigned char)*p))) {
            return moe_error_set(err, MOE_ERR_CONFIG,
                                 "--moe-layer-freq '%s': unexpected character '%c' (use a 0/1 "
                                 "list such as 0,1,1,1, or an integer)",
                                 s, *p);
        }
    }
    if (count != cfg->num_layers)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "--moe-layer-freq '%s' has %d entries but --num-layers is %d "
                             "(give one 0/1 per layer)",
                             s, count, cfg->num_layers);
    return MOE_OK;
}

#define REQUIRE(cond, ...)                                        \
    do {                                                          \
        if (!(cond))                                              \
            return moe_error_set(err, MOE_ERR_CONFIG, __VA_ARGS__); \
    } while (0)

int moe_config_grouped_kernel_fits(const moe_config *c) {
    return c->hidden_size % MOE_GROUPED_DEV_ALIGN == 0 &&
           c->moe_ffn_hidden_size % MOE_GROUPED_DEV_ALIGN == 0 &&
           c->expert_model_parallel_size >= 1 &&
           c->num_experts / c->expert_model_parallel_size <= MOE_GROUPED_DEV_MAX_GROUPS;
}

int moe_config_fused_fits(const moe_config *c, char *why, size_t cap) {
    char buf[160];
    if (c->hidden_size % MOE_FUSED_ROW_ALIGN)
        snprintf(buf, sizeof buf, "--hidden-size %d is not a multiple of %d (the fused kernels "
                 "move rows of 16 bytes)", c->hidden_size, MOE_FUSED_ROW_ALIGN);
    else if (c->moe_router_topk > MOE_FUSED_MAX_TOPK)
        snprintf(buf, sizeof buf, "--moe-router-topk %d is above %d", c->moe_router_topk,
                 MOE_FUSED_MAX_TOPK);
    else
        return 1;
    if (why)
        snprintf(why, cap, "%s", buf);
    return 0;
}

/* A choice flag's value as its position in the flag's own choice list, the order the
 * config.h enums are declared in; -1 when it is none of them. Resolving here, once, is
 * what keeps strcmp out of the training step. */
static int choice_index(const char *flag, const char *value) {
    for (size_t i = 0; i < sizeof g_flags / sizeof g_flags[0]; i++)
        if (!strcmp(g_flags[i].name, flag))
            return moe_flags_choice_index(g_flags[i].choices, value);
    return -1;
}

#define RESOLVE(field, flag, text)                                                      \
    do {                                                                                \
        int i_ = choice_index(flag, text);                                              \
        REQUIRE(i_ >= 0, "--%s: '%s' is not one of its choices (see --help)", flag, text); \
        field = i_;                                                                     \
    } while (0)

moe_status moe_config_comm_timeout_s(const moe_config *c, double *seconds, moe_error *err) {
    const double m = c->distributed_timeout_minutes;
    REQUIRE(m > 0 && m <= MOE_MAX_TIMEOUT_MINUTES,
            "--distributed-timeout-minutes must be above 0 and at most %.0f (a week; got %g)",
            MOE_MAX_TIMEOUT_MINUTES, m);
    *seconds = 60.0 * m;
    return MOE_OK;
}

/* Every number of the table is finite. The parser already refuses nan and inf, but a
 * config is also filled by code (tests, chapter programs), and a check written as
 * `x >= 0` lets +inf through: one loop over the table covers every flag, also the next
 * one added. */
static moe_status require_finite(const moe_config *c, moe_error *err) {
    for (size_t i = 0; i < sizeof g_flags / sizeof g_flags[0]; i++) {
        const moe_flag *f = &g_flags[i];
        if (f->type != MOE_FLAG_DOUBLE)
            continue;
        const double v = *(const double *)((const char *)c + f->offset);
        REQUIRE(isfinite(v), "--%s must be a finite number (got %g)", f->name, v);
    }
    return MOE_OK;
}

/* Context parallelism (chapter 07, context_parallel.h). Each sequence is cut into 2·CP
 * chunks (load balancing), the attention exchange must fit the heads each TP rank holds, and
 * the per-sequence aux loss would need each rank's rows grouped by sequence (chunk-major rows
 * are not): a named error until it is built. */
static moe_status validate_cp(moe_config *c, moe_error *err) {
    const int CP = c->context_parallel_size, TP = c->tensor_model_parallel_size;
    RESOLVE(c->cp_comm, "cp-comm-type", c->cp_comm_type);
    c->cp_a2a = 0;
    const char *h = c->hierarchical_context_parallel_sizes;
    if (h[0]) { /* "A,P" (also "[A, P]" or "A P"): the a2a level first, as Megatron's list */
        int v[3], n = 0;
        for (const char *q = h; *q && n < 3;) {
            if (*q >= '0' && *q <= '9') {
                char *end;
                v[n++] = (int)strtol(q, &end, 10);
                q = end;
            } else {
                REQUIRE(strchr("[], ", *q), "--hierarchical-context-parallel-sizes '%s': give "
                        "two sizes as 'A,P' (the all-to-all level, then the ring)", h);
                q++;
            }
        }
        REQUIRE(n == 2 && v[0] >= 1 && v[1] >= 1 && v[0] * v[1] == CP,
                "--hierarchical-context-parallel-sizes '%s': give two sizes 'A,P' whose product "
                "is --context-parallel-size %d (e.g. '%d,1' or '1,%d')", h, CP, CP, CP);
        REQUIRE(c->cp_comm == MOE_CP_A2A_P2P,
                "--hierarchical-context-parallel-sizes is for --cp-comm-type a2a+p2p (got %s): "
                "drop it, or use --cp-comm-type a2a+p2p", c->cp_comm_type);
        c->cp_a2a = v[0];
    }
    if (CP == 1)
        return MOE_OK;
    REQUIRE(c->cp_comm != MOE_CP_A2A_P2P || c->cp_a2a > 0,
            "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes 'A,P' (A ranks "
            "do the all-to-all, P groups the ring; A x P = --context-parallel-size %d)", CP);
    /* the attention exchange's own checks, on the heads of one TP rank */
    moe_cp_attention a = {.cp = CP, .type = (moe_cp_comm)c->cp_comm, .B = 1,
                          .T = c->seq_length, .Hq = c->num_attention_heads / TP,
                          .Hkv = c->num_query_groups / TP, .D = c->head_dim, .a2a = c->cp_a2a};
    MOE_TRY(moe_cp_attention_check(&a, err));
    return MOE_OK;
}

/* The parallel sizes that do not depend on the number of ranks (moe_grid_resolve() checks
 * those that do: every product dividing the world). Tensor parallelism splits the attention
 * heads, so TP must divide the query heads and the key/value groups: moe.c does not
 * replicate key/value heads over TP ranks (Megatron can, when TP > groups), which keeps
 * every rank's attention an ordinary GQA over its own heads. */
static moe_status validate_folding(moe_config *c, int any_moe, int any_dense, moe_error *err) {
    const int TP = c->tensor_model_parallel_size;
    REQUIRE(TP >= 1, "--tensor-model-parallel-size must be >= 1 (got %d; 1 = not split)", TP);
    REQUIRE(c->expert_tensor_parallel_size >= 1,
            "--expert-tensor-parallel-size must be >= 1 (got %d; 1 = not split)",
            c->expert_tensor_parallel_size);
    REQUIRE(c->context_parallel_size >= 1,
            "--context-parallel-size must be >= 1 (got %d; 1 = not split)",
            c->context_parallel_size);
    REQUIRE(c->pipeline_model_parallel_size >= 1,
            "--pipeline-model-parallel-size must be >= 1 (got %d; 1 = not split)",
            c->pipeline_model_parallel_size);
    MOE_TRY(validate_cp(c, err));
    REQUIRE(c->pipeline_model_parallel_size == 1,
            "--pipeline-model-parallel-size %d: pipeline parallelism is not planned in moe.c "
            "(every rank holds every layer); use --pipeline-model-parallel-size 1",
            c->pipeline_model_parallel_size);
    /* ETP splits each routed expert's intermediate width (moe/expert_tp.h) */
    const int ETP = c->expert_tensor_parallel_size;
    REQUIRE(!any_moe || c->moe_ffn_hidden_size % ETP == 0,
            "--moe-ffn-hidden-size %d is not divisible by --expert-tensor-parallel-size %d (each "
            "expert's fc1 is split by columns and its fc2 by rows over the ETP ranks): use an "
            "--expert-tensor-parallel-size that divides %d, or a multiple of %d as "
            "--moe-ffn-hidden-size", c->moe_ffn_hidden_size, ETP, c->moe_ffn_hidden_size, ETP);
    REQUIRE(!any_moe || ETP == 1 || !c->moe_permute_fusion,
            "--moe-permute-fusion with --expert-tensor-parallel-size %d: the fused permutation "
            "reads the tokens in place on one rank, but ETP gathers the expert rows of its "
            "group first; drop --moe-permute-fusion or use --expert-tensor-parallel-size 1", ETP);
    REQUIRE(!c->sequence_parallel || TP > 1,
            "--sequence-parallel splits the tokens over the tensor-parallel ranks: it needs "
            "--tensor-model-parallel-size > 1 (got %d)", TP);
    if (TP == 1)
        return MOE_OK;
    REQUIRE(c->num_attention_heads % TP == 0,
            "--num-attention-heads %d is not divisible by --tensor-model-parallel-size %d (each "
            "tensor-parallel rank computes the same number of heads)", c->num_attention_heads,
            TP);
    REQUIRE(c->num_query_groups % TP == 0,
            "--num-query-groups %d is not divisible by --tensor-model-parallel-size %d (each "
            "rank holds whole key/value groups; moe.c does not replicate key/value heads): use "
            "a TP that divides the groups, or more groups", c->num_query_groups, TP);
    /* (TP then divides --hidden-size too: hidden = heads x head_dim) */
    if (any_dense)
        REQUIRE(c->ffn_hidden_size % TP == 0,
                "--ffn-hidden-size %d is not divisible by --tensor-model-parallel-size %d (fc1 "
                "is split by columns, fc2 by rows)", c->ffn_hidden_size, TP);
    REQUIRE(!c->sequence_parallel || c->seq_length % (TP * c->context_parallel_size) == 0,
            "--seq-length %d is not divisible by --tensor-model-parallel-size %d x "
            "--context-parallel-size %d: with --sequence-parallel each rank holds 1/TP of its "
            "context-parallel share of every sequence", c->seq_length, TP,
            c->context_parallel_size);
    /* MoE layers run on each rank's sequence shard (the experts are split by EP, not TP):
     * without SP every TP rank would route the same tokens. Megatron requires the same. */
    REQUIRE(!any_moe || c->sequence_parallel,
            "--tensor-model-parallel-size %d with MoE layers needs --sequence-parallel (the MoE "
            "layers run on each tensor-parallel rank's share of the tokens; the experts are "
            "split with --expert-model-parallel-size)", TP);
    if (any_moe)
        REQUIRE(c->moe_shared_expert_intermediate_size % TP == 0,
                "--moe-shared-expert-intermediate-size %d is not divisible by "
                "--tensor-model-parallel-size %d (the shared expert is tensor-parallel like a "
                "dense FFN)", c->moe_shared_expert_intermediate_size, TP);
    REQUIRE(c->vocab_size % TP == 0,
            "the vocabulary (%d ids, after --make-vocab-size-divisible-by %d) is not divisible by "
            "--tensor-model-parallel-size %d (the embedding and the LM head are split by "
            "vocabulary rows): pad it with --make-vocab-size-divisible-by %d (a multiple of the "
            "TP size), or pick a TP that divides %d", c->vocab_size,
            c->make_vocab_size_divisible_by, TP, TP, c->vocab_size);
    return MOE_OK;
}

moe_status moe_config_validate(moe_config *c, moe_error *err) {
    MOE_TRY(require_finite(c, err));
    double timeout_s;
    MOE_TRY(moe_config_comm_timeout_s(c, &timeout_s, err));
    /* sizes */
    REQUIRE(c->num_layers >= 1 && c->num_layers <= MOE_MAX_LAYERS,
            "--num-layers must be between 1 and %d (got %d)", MOE_MAX_LAYERS, c->num_layers);
    REQUIRE(c->hidden_size >= 1, "--hidden-size must be positive (got %d)", c->hidden_size);
    REQUIRE(c->num_attention_heads >= 1, "--num-attention-heads must be positive (got %d)",
            c->num_attention_heads);
    REQUIRE(c->num_query_groups >= 0, "--num-query-groups must be >= 0 (got %d; 0 means one "
            "key/value head per query head)", c->num_query_groups);
    if (c->num_query_groups == 0)
        c->num_query_groups = c->num_attention_heads;
    REQUIRE(c->hidden_size % c->num_attention_heads == 0,
            "--hidden-size %d is not divisible by --num-attention-heads %d (pick sizes with "
            "hidden = heads * head_dim)", c->hidden_size, c->num_attention_heads);
    REQUIRE(c->num_attention_heads % c->num_query_groups == 0,
            "--num-attention-heads %d is not divisible by --num-query-groups %d (every key/value "
            "head must serve the same number of query heads)",
            c->num_attention_heads, c->num_query_groups);
    c->head_dim = c->hidden_size / c->num_attention_heads;
    REQUIRE(c->head_dim % 2 == 0,
            "head dimension %d (--hidden-size / --num-attention-heads) must be even for RoPE",
            c->head_dim);
    REQUIRE(c->seq_length >= 1, "--seq-length must be positive (got %d)", c->seq_length);
    REQUIRE(c->rotary_base > 1.0, "--rotary-base must be > 1 (got %g)", c->rotary_base);
    REQUIRE(c->norm_epsilon > 0.0 && c->norm_epsilon <= 1.0,
            "--norm-epsilon must be in (0, 1] (got %g)", c->norm_epsilon);
    REQUIRE(c->init_method_std > 0.0 && c->init_method_std <= 1.0,
            "--init-method-std must be in (0, 1] (got %g; Megatron's default is 0.02, and weights "
            "drawn wider overflow the activations)", c->init_method_std);
    REQUIRE(c->vocab_size >= 2, "vocabulary size %d is too small (the data file needs at least "
            "two distinct symbols)", c->vocab_size);
    REQUIRE(c->make_vocab_size_divisible_by >= 1 && c->make_vocab_size_divisible_by <= 65536,
            "--make-vocab-size-divisible-by must be between 1 and 65536 (got %d; 1 = no "
            "padding)", c->make_vocab_size_divisible_by);
    { /* padding (idempotent: a padded size stays as it is) */
        const int d = c->make_vocab_size_divisible_by;
        c->vocab_size = (c->vocab_size + d - 1) / d * d;
    }

    /* which layers are MoE */
    REQUIRE(c->num_experts >= 0 && c->num_experts <= MOE_MAX_EXPERTS,
            "--num-experts must be between 0 and %d (got %d; 0 = dense model)", MOE_MAX_EXPERTS,
            c->num_experts);
    memset(c->is_moe_layer, 0, sizeof c->is_moe_layer);
    int any_moe = 0, any_dense = 0;
    if (c->num_experts > 0) {
        MOE_TRY(parse_layer_freq(c, err));
    }
    for (int l = 0; l < c->num_layers; l++) {
        any_moe |= c->is_moe_layer[l];
        any_dense |= !c->is_moe_layer[l];
    }
    if (any_dense)
        REQUIRE(c->ffn_hidden_size >= 1, "--ffn-hidden-size must be positive for dense layers "
                "(got %d)", c->ffn_hidden_size);

    /* router */
    if (!strcmp(c->moe_router_score_function, "softmax"))
        c->score_fn = MOE_SCORE_SOFTMAX;
    else if (!strcmp(c->moe_router_score_function, "sigmoid"))
        c->score_fn = MOE_SCORE_SIGMOID;
    else
        REQUIRE(0, "--moe-router-score-function must be softmax or sigmoid (got '%s')",
                c->moe_router_score_function);
    if (!strcmp(c->moe_router_load_balancing_type, "aux_loss"))
        c->lb_type = MOE_LB_AUX;
    else if (!strcmp(c->moe_router_load_balancing_type, "seq_aux_loss"))
        c->lb_type = MOE_LB_SEQ_AUX;
    else if (!strcmp(c->moe_router_load_balancing_type, "none"))
        c->lb_type = MOE_LB_NONE;
    else
        REQUIRE(0, "--moe-router-load-balancing-type must be aux_loss, seq_aux_loss or none "
                "(got '%s')", c->moe_router_load_balancing_type);
    RESOLVE(c->dispatcher_type, "moe-token-dispatcher-type", c->moe_token_dispatcher_type);
    RESOLVE(c->alltoall_path, "moe-alltoall-path", c->moe_alltoall_path);
    RESOLVE(c->drop_policy, "moe-token-drop-policy", c->moe_token_drop_policy);
    RESOLVE(c->expert_backend, "moe-expert-backend", c->moe_expert_backend);
    RESOLVE(c->graph_scope, "cuda-graph-scope", c->cuda_graph_scope);
    MOE_TRY(moe_graph_scope_check(c, NULL, err)); /* levels that still wait for the host */
    if (any_moe) {
        const int E = c->num_experts, k = c->moe_router_topk;
        REQUIRE(c->moe_ffn_hidden_size >= 1, "--moe-ffn-hidden-size must be positive (got %d)",
                c->moe_ffn_hidden_size);
        REQUIRE(k >= 1 && k <= MOE_MAX_TOPK, "--moe-router-topk must be between 1 and %d (got %d)",
                MOE_MAX_TOPK, k);
        REQUIRE(k <= E, "--moe-router-topk %d is larger than --num-experts %d (a token cannot "
                "pick more experts than exist)", k, E);
        REQUIRE(!(c->moe_router_pre_softmax && c->score_fn == MOE_SCORE_SIGMOID),
                "--moe-router-pre-softmax only applies to --moe-router-score-function softmax");
        REQUIRE(!(c->moe_router_enable_expert_bias && c->score_fn != MOE_SCORE_SIGMOID),
                "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid "
                "(aux-loss-free balancing biases the sigmoid scores)");
        REQUIRE(c->moe_router_bias_update_rate >= 0.0,
                "--moe-router-bias-update-rate must be >= 0 (got %g)",
                c->moe_router_bias_update_rate);
        const int G = c->moe_router_num_groups, GK = c->moe_router_group_topk;
        REQUIRE(G >= 0 && GK >= 0, "--moe-router-num-groups and --moe-router-group-topk must be "
                ">= 0 (got %d and %d)", G, GK);
        REQUIRE((G == 0) == (GK == 0), "--moe-router-num-groups and --moe-router-group-topk go "
                "together: set both (group-limited routing) or neither (got %d and %d)", G, GK);
        if (G > 0) {
            REQUIRE(E % G == 0, "--num-experts %d is not divisible by --moe-router-num-groups %d",
                    E, G);
            REQUIRE(GK <= G, "--moe-router-group-topk %d is larger than --moe-router-num-groups "
                    "%d", GK, G);
            REQUIRE(k % GK == 0, "--moe-router-topk %d is not divisible by "
                    "--moe-router-group-topk %d (each selected group contributes topk/group_topk "
                    "experts to its group score)", k, GK);
            REQUIRE(k / GK <= E / G, "--moe-router-topk/--moe-router-group-topk = %d is more "
                    "than the %d experts in a group", k / GK, E / G);
        }
        REQUIRE(c->moe_router_topk_scaling_factor >= 0.0,
                "--moe-router-topk-scaling-factor must be >= 0 (got %g; 0 = off)",
                c->moe_router_topk_scaling_factor);
        REQUIRE(c->moe_aux_loss_coeff >= 0.0, "--moe-aux-loss-coeff must be >= 0 (got %g)",
                c->moe_aux_loss_coeff);
        REQUIRE(c->moe_z_loss_coeff >= 0.0, "--moe-z-loss-coeff must be >= 0 (got %g)",
                c->moe_z_loss_coeff);
        const int EP = c->expert_model_parallel_size;
        REQUIRE(EP >= 1, "--expert-model-parallel-size must be >= 1 (got %d)", EP);
        REQUIRE(E % EP == 0, "--num-experts %d is not divisible by --expert-model-parallel-size "
                "%d (every rank must hold the same number of experts)", E, EP);
        REQUIRE(c->moe_expert_capacity_factor >= 0.0,
                "--moe-expert-capacity-factor must be > 0, or 0 for dropless (got %g)",
                c->moe_expert_capacity_factor);
        REQUIRE(c->moe_expert_rank_capacity_factor > 0.0,
                "--moe-expert-rank-capacity-factor must be > 0 (got %g; 2.0 is the default, "
                "1.0 is all one rank ever needs)",
                c->moe_expert_rank_capacity_factor);
        REQUIRE(!(c->moe_pad_expert_input_to_capacity && c->moe_expert_capacity_factor == 0.0),
                "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor "
                "(there is no capacity to pad to in a dropless run)");
        REQUIRE(!(c->moe_pad_expert_input_to_capacity &&
                  c->dispatcher_type == MOE_DISPATCHER_ALLGATHER),
                "--moe-pad-expert-input-to-capacity applies to the alltoall dispatcher only "
                "(the allgather dispatcher has no per-expert sends to pad)");
        char why[160];
        REQUIRE(c->alltoall_path != MOE_A2A_FUSED || moe_config_fused_fits(c, why, sizeof why),
                "--moe-alltoall-path fused is not possible: %s; use --moe-alltoall-path "
                "collective", why);
        REQUIRE(c->expert_backend != MOE_EXPERT_BACKEND_GROUPED || moe_config_grouped_kernel_fits(c),
                "--moe-expert-backend grouped needs --hidden-size and --moe-ffn-hidden-size "
                "that are multiples of %d and at most %d experts per rank (got %d, %d, %d); "
                "use --moe-expert-backend cublas-grouped for other shapes",
                MOE_GROUPED_DEV_ALIGN, MOE_GROUPED_DEV_MAX_GROUPS, c->hidden_size,
                c->moe_ffn_hidden_size, E / EP);
        REQUIRE(!c->moe_permute_fusion ||
                    (EP == 1 && c->moe_expert_capacity_factor == 0.0 &&
                     (c->expert_backend == MOE_EXPERT_BACKEND_GROUPED ||
                      c->expert_backend == MOE_EXPERT_BACKEND_AUTO) &&
                     moe_config_grouped_kernel_fits(c)),
                "--moe-permute-fusion needs one expert-parallel rank, no capacity factor and our "
                "grouped kernel (--moe-expert-backend grouped or auto, sizes multiples of %d, at "
                "most %d experts); drop --moe-permute-fusion otherwise", MOE_GROUPED_DEV_ALIGN,
                MOE_GROUPED_DEV_MAX_GROUPS);
        REQUIRE(c->moe_shared_expert_intermediate_size >= 0,
                "--moe-shared-expert-intermediate-size must be >= 0 (got %d; 0 = none)",
                c->moe_shared_expert_intermediate_size);
    }

    MOE_TRY(validate_folding(c, any_moe, any_dense, err));

    /* training */
    REQUIRE(c->micro_batch_size >= 1, "--micro-batch-size must be positive (got %d)",
            c->micro_batch_size);
    REQUIRE(c->global_batch_size >= 1, "--global-batch-size must be positive (got %d)",
            c->global_batch_size);
    REQUIRE(c->global_batch_size % c->micro_batch_size == 0,
            "--global-batch-size %d is not a multiple of --micro-batch-size %d",
            c->global_batch_size, c->micro_batch_size);
    REQUIRE(c->train_iters >= 0, "--train-iters must be >= 0 (got %d)", c->train_iters);
    REQUIRE(c->lr >= 0.0 && c->lr <= 1.0, "--lr must be in [0, 1] (got %g; AdamW moves each "
            "weight by about lr per step, and typical values are 1e-4 to 1e-2)", c->lr);
    REQUIRE(c->min_lr >= 0.0 && c->min_lr <= c->lr,
            "--min-lr %g must be between 0 and --lr %g", c->min_lr, c->lr);
    REQUIRE(c->lr_warmup_iters >= 0, "--lr-warmup-iters must be >= 0 (got %d)",
            c->lr_warmup_iters);
    REQUIRE(c->lr_decay_iters >= 0, "--lr-decay-iters must be >= 0 (got %d; 0 = --train-iters)",
            c->lr_decay_iters);
    if (!strcmp(c->lr_decay_style, "cosine"))
        c->lr_style = MOE_LR_COSINE;
    else if (!strcmp(c->lr_decay_style, "linear"))
        c->lr_style = MOE_LR_LINEAR;
    else if (!strcmp(c->lr_decay_style, "constant"))
        c->lr_style = MOE_LR_CONSTANT;
    else
        REQUIRE(0, "--lr-decay-style must be cosine, linear or constant (got '%s')",
                c->lr_decay_style);
    REQUIRE(c->weight_decay >= 0.0, "--weight-decay must be >= 0 (got %g)", c->weight_decay);
    REQUIRE(c->adam_beta1 >= 0.0 && c->adam_beta1 < 1.0, "--adam-beta1 must be in [0, 1) (got %g)",
            c->adam_beta1);
    REQUIRE(c->adam_beta2 >= 0.0 && c->adam_beta2 < 1.0, "--adam-beta2 must be in [0, 1) (got %g)",
            c->adam_beta2);
    REQUIRE(c->adam_eps > 0.0 && c->adam_eps <= 1.0, "--adam-eps must be in (0, 1] (got %g)",
            c->adam_eps);
    REQUIRE(c->clip_grad >= 0.0, "--clip-grad must be >= 0 (got %g; 0 = off)", c->clip_grad);

    /* logging */
    REQUIRE(c->log_interval >= 1, "--log-interval must be >= 1 (got %d)", c->log_interval);
    REQUIRE(c->eval_interval >= 0, "--eval-interval must be >= 0 (got %d)", c->eval_interval);
    REQUIRE(c->eval_iters >= 1, "--eval-iters must be >= 1 (got %d)", c->eval_iters);
    REQUIRE(c->sample_length >= 0 && c->sample_length <= MOE_MAX_SAMPLE_LENGTH,
            "--sample-length must be between 0 and %d (got %d)", MOE_MAX_SAMPLE_LENGTH,
            c->sample_length);
    REQUIRE(c->sample_temperature > 0.0, "--sample-temperature must be > 0 (got %g)",
            c->sample_temperature);

    /* checkpointing */
    REQUIRE(c->save_interval >= 0, "--save-interval must be >= 0 (got %d; 0 = only at the end)",
            c->save_interval);
    REQUIRE(c->keep_last >= 0, "--keep-last must be >= 0 (got %d; 0 = keep every checkpoint)",
            c->keep_last);
    REQUIRE(c->save[0] || (c->save_interval == 0 && !c->exit_signal_handler),
            "--save-interval and --exit-signal-handler save checkpoints: give --save DIR too");

    /* chapter 05: the emulated FP8 / NVFP4 flags and every linear layer's widths */
    MOE_TRY(moe_lowp_check_config(c, err));

    /* derived sizes: every buffer the model will allocate, in 64-bit with overflow checks
     * (memory.h); whether the memory is there is moe_model_create()'s question */
    moe_memory_estimate est;
    return moe_memory_estimate_model(c, c->micro_batch_size,
                                     any_moe ? c->expert_model_parallel_size : 1,
                                     sizeof(float), &est, err);
}

/* One warning: formatted into the next free message. */
static void warn(moe_config_warnings_t *w, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static void warn(moe_config_warnings_t *w, const char *fmt, ...) {
    if (w->n >= MOE_MAX_WARNINGS)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->msg[w->n++], sizeof w->msg[0], fmt, ap);
    va_end(ap);
}

void moe_config_warnings(const moe_config *c, moe_config_warnings_t *w) {
    w->n = 0;
    if (c->train_iters > 0 && c->lr_warmup_iters >= c->train_iters)
        warn(w, "--lr-warmup-iters %d is not shorter than --train-iters %d: the learning rate "
             "never reaches --lr %g", c->lr_warmup_iters, c->train_iters, c->lr);
    if (c->lr_decay_iters > 0 && c->lr_decay_iters <= c->lr_warmup_iters)
        warn(w, "--lr-decay-iters %d ends before the warmup (--lr-warmup-iters %d): the rate "
             "drops to --min-lr right after the warmup", c->lr_decay_iters, c->lr_warmup_iters);
    if (c->lr > 0.1)
        warn(w, "--lr %g is far above what AdamW usually trains with (1e-4 to 1e-2): expect a "
             "diverging loss", c->lr);
    if (c->init_method_std > 0.2)
        warn(w, "--init-method-std %g is wide (Megatron's default is 0.02)", c->init_method_std);
    int moe_layers = 0;
    for (int l = 0; l < c->num_layers; l++)
        moe_layers += c->is_moe_layer[l];
    if (moe_layers > 0 && c->moe_expert_capacity_factor > 0 &&
        c->moe_expert_capacity_factor >= (double)c->num_experts / c->moe_router_topk)
        warn(w, "--moe-expert-capacity-factor %g is at least --num-experts / --moe-router-topk "
             "= %g: no token is ever dropped, so the factor only costs padding",
             c->moe_expert_capacity_factor, (double)c->num_experts / c->moe_router_topk);
    /* Under TP (+ SP) each rank routes only its sequence shard, and the capacity counts the
     * tokens a rank routes: which tokens are dropped depends on that local batch, so the run
     * cannot equal one process. EP alone keeps each rank's micro-batch whole, like one
     * process (tests/mpi_ep.c checks the equality with drops). */
    if (moe_layers > 0 && c->moe_expert_capacity_factor > 0 &&
        c->moe_expert_capacity_factor < (double)c->num_experts / c->moe_router_topk &&
        c->tensor_model_parallel_size > 1)
        warn(w, "--moe-expert-capacity-factor %g with --tensor-model-parallel-size %d: token "
             "drops depend on the local batch (each TP rank applies the capacity to its 1/%d of "
             "the tokens), so the loss differs from one process by design; dropless runs match",
             c->moe_expert_capacity_factor, c->tensor_model_parallel_size,
             c->tensor_model_parallel_size);
    if (moe_layers > 0 && (c->moe_aux_loss_coeff > 1 || c->moe_z_loss_coeff > 1))
        warn(w, "--moe-aux-loss-coeff %g / --moe-z-loss-coeff %g: coefficients above 1 let the "
             "router's losses outweigh the language-model loss (typical: 1e-2 and 1e-3)",
             c->moe_aux_loss_coeff, c->moe_z_loss_coeff);
    if (!c->check_for_nan_in_loss_and_grad)
        warn(w, "--no-check-for-nan-in-loss-and-grad: a NaN or infinite loss will not stop "
             "the run");
}
