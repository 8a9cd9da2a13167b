/* The memory a model will allocate, before it does: see memory.h. */
#include "memory.h"

#include <limits.h>
#include <string.h>
#include <unistd.h>

#include "context_parallel.h"
#include "lowp.h"
#include "mlp.h"
#include "moe/capacity.h"
#include "op_types.h"
#include "real.h"

/* The running estimate. Products saturate at LLONG_MAX instead of wrapping, so one
 * overflow anywhere stays visible to the end; the first buffer that is too large (for int
 * indexing, or at all) is kept for the message. */
typedef struct tally {
    moe_memory_estimate *e;
    long long *bytes;        /* the sum the next buffers add to: params or activations */
    const char *bad;         /* the first buffer that does not fit */
    long long bad_elems;
    const char *bad_flags;   /* the flags that set its size */
} tally;

static long long mul(long long a, long long b) {
    if (a == LLONG_MAX || b == LLONG_MAX || (a > 0 && b > LLONG_MAX / a))
        return LLONG_MAX;
    return a * b;
}

static long long add(long long a, long long b) { return a > LLONG_MAX - b ? LLONG_MAX : a + b; }

/* chapter 05's FP8 copy of n weight elements (moe_fp8_weight_bytes(), in checked sums): the
 * codes and those of the transpose, and two fp32 scales per 128×128 block */
static long long fp8_copy_bytes(long long n) {
    return add(mul(2, n), mul(8, n / (128 * 128)));
}

/* @p count buffers named @p name of @p elems elements of @p size bytes each. */
static void buffers(tally *t, const char *name, long long count, long long elems, long long size,
                    const char *flags) {
    if (elems > INT_MAX && !t->bad) {
        t->bad = name;
        t->bad_elems = elems;
        t->bad_flags = flags;
    }
    if (elems > t->e->largest) {
        t->e->largest = elems;
        t->e->largest_name = name;
    }
    *t->bytes = add(*t->bytes, mul(count, mul(elems, size)));
}

static void buffer(tally *t, const char *name, long long elems, long long size, const char *flags) {
    buffers(t, name, 1, elems, size, flags);
}

static const char BATCH[] = "--micro-batch-size or --seq-length";
static const char WIDTH[] = "--micro-batch-size, --seq-length or --hidden-size";
static const char HEADS[] = "--micro-batch-size, --seq-length or --num-attention-heads";
static const char EXPERT[] = "--micro-batch-size, --seq-length, --moe-router-topk or "
                             "--moe-ffn-hidden-size";
static const char MODEL[] = "--hidden-size, --num-experts, --moe-ffn-hidden-size, "
                            "--ffn-hidden-size or --num-layers";

/* The routed experts' SwiGLU outputs (or, the token-wise form's, their inputs: @p F = H)
 * kept for the backward, @p rows rows of width @p F in
 * @p G groups, in the form @p form (moe_mlp_saved_form()): activation elements of @p size
 * bytes, or chapter 05's FP8 codes (1 byte each) and their 1×128 fp32 scales, row-wise or
 * the token-wise copy (each group's tokens padded to 128: moe_fp8_wgrad_kpad()), as
 * moe_mlp_act_bytes() allocates them; the FP8 ones are added to the estimate's report with
 * what they would take in bf16. */
static void saved_act(tally *t, const char *name, long long rows, long long F, long long G,
                      long long size, moe_mlp_saved form, const char *flags) {
    const long long elems = mul(rows, F);
    if (form == MOE_MLP_SAVED_ACT) {
        buffer(t, name, elems, size, flags);
        return;
    }
    /* the token-wise copy's padded columns: rows + 127·G rounded down to 128 (the sizing
     * rule's, in the estimate's overflow-checked arithmetic) */
    const long long cols = form == MOE_MLP_SAVED_FP8_TOKEN
                               ? add(rows, mul(127, G)) / MOE_QUANT_BLOCK * MOE_QUANT_BLOCK
                               : rows;
    const long long codes = mul(cols, F);
    const long long scales = mul(cols, (F + MOE_QUANT_BLOCK - 1) / MOE_QUANT_BLOCK);
    buffer(t, name, codes, 1, flags);
    buffer(t, name, scales, (long long)sizeof(float), flags);
    t->e->fp8_act_bytes = add(t->e->fp8_act_bytes, add(codes, mul(scales, sizeof(float))));
    t->e->fp8_act_bf16_bytes = add(t->e->fp8_act_bf16_bytes, mul(elems, 2));
}

/* The rows an MoE layer's experts ran on, as the layer keeps them for the backward, @p rows
 * of them in @p G local experts: the inputs (@p names[0]; in chapter 05's token-wise form
 * their FP8 copy, moe_layer_keeps_x_t()), the fc1 outputs and the SwiGLU outputs (in
 * @p form: saved_act()). Names are static: the tally keeps the largest one's. */
static void experts_kept(tally *t, const char *const names[3], long long rows, long long G,
                         long long H, long long F, long long size, moe_mlp_saved form,
                         const char *flags) {
    if (form == MOE_MLP_SAVED_FP8_TOKEN)
        saved_act(t, names[0], rows, H, G, size, form, flags);
    else
        buffer(t, names[0], mul(rows, H), size, flags);
    buffer(t, names[1], mul(rows, mul(2, F)), size, flags);
    saved_act(t, names[2], rows, F, G, size, form, flags);
}

/* Parameters: one tensor of @p elems elements, counted in *params. */
static void tensor(tally *t, const char *name, long long elems) {
    buffer(t, name, elems, 1, MODEL); /* counted in elements here, bytes below */
}

moe_status moe_memory_estimate_model(const moe_config *c, int micro_batch, int ep_size,
                                     size_t act_size, moe_memory_estimate *out, moe_error *err) {
    *out = (moe_memory_estimate){0};
    const long long L = c->num_layers, H = c->hidden_size, Hq = c->num_attention_heads,
                    Hkv = c->num_query_groups ? c->num_query_groups : c->num_attention_heads,
                    D = c->hidden_size / c->num_attention_heads, V = c->vocab_size,
                    E = c->num_experts, k = c->moe_router_topk, F = c->moe_ffn_hidden_size,
                    Fs = c->moe_shared_expert_intermediate_size, Fd = c->ffn_hidden_size,
                    EP = ep_size >= 1 ? ep_size : 1, B = micro_batch,
                    CP = c->context_parallel_size > 1 ? c->context_parallel_size : 1,
                    T = c->seq_length / CP; /* context parallelism: this rank's tokens */
    const long long S = (long long)act_size, Rb = (long long)sizeof(moe_real);
    const long long N = mul(B, T), NK = mul(N, k);
    /* tensor parallelism (tensor_parallel.h): the split tensors hold 1/TP of their rows or
     * columns; under sequence parallelism the residual stream, the norms and the MoE layers
     * hold Nl = N/TP rows, the attention and dense FFNs work on all N rows with 1/TP of the
     * heads / width, the logits on all N rows with 1/TP of the vocabulary */
    const long long TP = c->tensor_model_parallel_size > 1 ? c->tensor_model_parallel_size : 1;
    const int sp = TP > 1 && c->sequence_parallel;
    const long long Nl = sp ? N / TP : N, NKl = mul(Nl, k);
    const long long Hql = Hq / TP, Hkvl = Hkv / TP, Vl = V / TP, Fsl = Fs / TP, Fdl = Fd / TP;
    /* expert tensor parallelism (moe/expert_tp.h): each local expert holds F/ETP of its
     * width, and runs on the rows of its whole ETP group, gathered */
    const long long ETP =
        c->expert_tensor_parallel_size > 1 ? c->expert_tensor_parallel_size : 1;
    const long long Fl = F / ETP;
    tally t = {.e = out};

    /* ---- parameters (elements first, then the bytes of their four or five copies) */
    long long P = 0, Pe = 0;
    t.bytes = &P;
    int any_moe = 0;
    tensor(&t, "embedding", mul(Vl, H));
    tensor(&t, "lm_head", mul(Vl, H));
    P = add(P, H); /* final norm */
    for (int l = 0; l < L; l++) {
        tensor(&t, "attn.wq", mul(mul(Hql, D), H));
        tensor(&t, "attn.wk", mul(mul(Hkvl, D), H));
        tensor(&t, "attn.wv", mul(mul(Hkvl, D), H));
        tensor(&t, "attn.wo", mul(H, mul(Hql, D)));
        P = add(P, add(mul(2, H), c->qk_layernorm ? 2 * D : 0));
        if (c->is_moe_layer[l]) {
            any_moe = 1;
            tensor(&t, "moe.router", mul(E, H));
            tensor(&t, "moe.shared.fc1", mul(mul(2, Fsl), H));
            tensor(&t, "moe.shared.fc2", mul(H, Fsl));
            t.bytes = &Pe; /* the routed experts: the expert grid's tensors */
            tensor(&t, "moe.experts.fc1", mul(mul(E / EP, mul(2, Fl)), H));
            tensor(&t, "moe.experts.fc2", mul(mul(E / EP, H), Fl));
            t.bytes = &P;
        } else {
            tensor(&t, "mlp.fc1", mul(mul(2, Fdl), H));
            tensor(&t, "mlp.fc2", mul(H, Fdl));
        }
    }
    out->expert_params = Pe;
    out->dense_params = P;
    out->params = P = add(P, Pe);
    out->optim_elems = P;
    /* fp32 master weights (and the compute copy when its type differs, or when chapter 05's
     * emulated low precision quantizes it in place: model.c), fp32 gradients, two fp32
     * AdamW moments */
    moe_lowp lowp;
    moe_error lowp_err;
    const int lowp_on = moe_lowp_from_config(&lowp, c, &lowp_err) == MOE_OK && lowp.on;
    out->weight_bytes = mul(P, add(Rb, S != Rb || lowp_on ? S : 0));
    /* chapter 05's native FP8 path (lowp.h): each MoE layer's routed fc1 and fc2 also as FP8
     * codes plus those of their transposes, with 128×128 scales (moe_fp8_weight_bytes()).
     * The estimate sees no GPU, so it counts them wherever the path may run: the native
     * recipe with our grouped kernel as the expert backend, asked for, or `auto` off the CPU
     * (an upper bound on a GPU that is not sm_90) */
    const int fp8_native =
        any_moe && moe_lowp_native_recipe(lowp_on ? &lowp : NULL) &&
        moe_config_grouped_kernel_fits(c) &&
        (c->expert_backend == MOE_EXPERT_BACKEND_GROUPED ||
         (c->expert_backend == MOE_EXPERT_BACKEND_AUTO && strcmp(c->device, "cpu") != 0));
    for (int l = 0; fp8_native && l < L; l++)
        if (c->is_moe_layer[l]) /* moe_fp8_weight_bytes() of fc1 and fc2, in checked sums */
            out->weight_bytes = add(out->weight_bytes,
                                    fp8_copy_bytes(mul(E / EP, mul(mul(3, Fl), H))));
    /* ... and with MOE_FP8_NATIVE_DENSE=1 (lowp.h, "Native FP8 dense linears") every dense
     * linear too: attention's four projections, the dense FFN's or the shared expert's fc1
     * and fc2 (this rank's shards; a weight's 128×128 blocks never span two of them). Counted
     * wherever the switch asks for it (an upper bound where the device cannot run it) */
    for (int l = 0; lowp_on && lowp.native_dense && l < L; l++) {
        const long long Fffn = c->is_moe_layer[l] ? Fsl : Fdl;
        const long long n[] = {mul(mul(Hql, D), H), mul(mul(Hkvl, D), H), mul(mul(Hkvl, D), H),
                               mul(H, mul(Hql, D)), mul(mul(2, Fffn), H), mul(H, Fffn)};
        for (size_t i = 0; i < sizeof n / sizeof n[0]; i++)
            out->weight_bytes = add(out->weight_bytes, fp8_copy_bytes(n[i]));
    }
    /* ... and the fused passes keep the routed experts' SwiGLU outputs as FP8 codes and
     * scales, in buffers of that size (lib/mlp.c, moe_mlp_act_bytes()): moe_mlp_saved_form()'s rule
     * (moe_mlp_saved_form_of()) on a bf16 backend (the CUDA one; the CPU has no fused passes), from
     * the switches as the model will read them: row-wise codes with the FP8 wgrad off, its
     * token-wise copy under it (MOE_FP8_SAVE_T). On a GPU that is not sm_90 they stay bf16, where
     * the FP8 weights above are not made: the two errors go opposite ways. */
    const moe_mlp_saved fp8_act = moe_mlp_saved_form_of(fp8_native && lowp.fp8_fused && S == 2,
                                                        lowp.fp8_wgrad, lowp.fp8_save_t);
    out->grad_bytes = mul(P, Rb);
    out->optim_bytes = mul(P, 8);
    out->param_bytes = add(add(out->weight_bytes, out->grad_bytes), out->optim_bytes);

    /* ---- activations of one micro-batch (model.c, attention.c, moe/layer.c) */
    long long A = 0;
    t.bytes = &A;
    buffers(&t, "tokens and targets", 4, N, (long long)sizeof(int), BATCH);
    buffers(&t, "residual stream", L + 1, mul(Nl, H), S, WIDTH);
    buffers(&t, "layer norms and residual", mul(3, L), mul(Nl, H), S, WIDTH);
    buffers(&t, "norm statistics", mul(2, L), Nl, Rb, BATCH);
    const long long QD = mul(N, mul(Hql, D)), KD = mul(N, mul(Hkvl, D));
    const int qk = c->qk_layernorm;
    buffers(&t, "attention q", mul(L, qk ? 4 : 3), QD, S, WIDTH);
    buffers(&t, "attention k/v", mul(L, qk ? 4 : 3), KD, S, WIDTH);
    buffers(&t, "attention statistics", mul(L, qk ? 3 : 1), mul(N, Hql), Rb, HEADS);
    /* the attention op's workspace, one per layer: the CUDA flash kernels keep the
     * backward's row dots δ [B, heads, T] in fp32 there; the CPU's flash attention keeps
     * nothing (0 bytes), but the estimate is made from the flags alone, before a backend is
     * chosen, so it counts them for every backend. No [B, heads, T, T] buffer exists. */
    if (CP > 1) { /* the exchange's workspace instead (context_parallel.h), one per layer */
        const moe_cp_attention a = {.cp = (int)CP, .type = (moe_cp_comm)c->cp_comm,
                                    .B = (int)B, .T = c->seq_length, .Hq = (int)Hql,
                                    .Hkv = (int)Hkvl, .D = (int)D,
                                    .a2a = c->cp_a2a > 0 ? c->cp_a2a : 1};
        const long long ws = (long long)moe_cp_attention_workspace_bytes(&a, (size_t)S);
        buffers(&t, "context-parallel attention workspace", L, (ws + S - 1) / S, S, HEADS);
    } else {
        buffers(&t, "attention workspace", L, mul(N, Hql), (long long)sizeof(float), HEADS);
    }
    buffers(&t, "attention gradients", 3, QD, S, WIDTH);
    buffers(&t, "attention gradients k/v", 3, KD, S, WIDTH);
    long long widest_dense = 0;
    for (int l = 0; l < L; l++) {
        if (c->is_moe_layer[l]) {
            /* an MoE layer runs on this rank's Nl rows; its shared expert on all N rows
             * with 1/TP of the width (moe/layer.h) */
            buffer(&t, "router logits", mul(Nl, E), S, "--micro-batch-size, --seq-length or "
                   "--num-experts");
            buffers(&t, "routing indices", 4, NKl, (long long)sizeof(int),
                    "--micro-batch-size, --seq-length or --moe-router-topk");
            buffers(&t, "routing weights", 4, NKl, Rb,
                    "--micro-batch-size, --seq-length or --moe-router-topk");
            /* the rows the experts ran on, kept for the backward (experts_kept()): the
             * local dispatcher's permuted rows, in place; else the expert side's, at most
             * every assignment of the EP group (the fused NVLink dispatcher's peers write the
             * rows into the shared workspace, where the form keeps their copy); with ETP the
             * group's rows, gathered, and the rows the dispatcher delivered are scratch
             * (moe/layer.h, moe_layer_keeps_xe()) */
            const int local = EP == 1 && ETP == 1 && !(c->moe_expert_capacity_factor > 0);
            static const char *const local_names[3] = {"moe.xp", "moe.gu", "moe.act"};
            if (local)
                experts_kept(&t, local_names, NKl, E, H, Fl, S, fp8_act, EXPERT);
            buffer(&t, "moe.shared", mul(N, mul(3, Fsl)), S,
                   "--micro-batch-size, --seq-length or --moe-shared-expert-intermediate-size");
            static const char *const ep_names[3] = {
                "expert-side inputs", "expert-side fc1 outputs", "expert-side SwiGLU outputs"};
            if (!local && ETP == 1)
                experts_kept(&t, ep_names, mul(NKl, EP), E / EP, H, Fl, S, fp8_act,
                             "--micro-batch-size, --seq-length, --moe-router-topk or "
                             "--expert-model-parallel-size");
            static const char *const etp_names[3] = {"expert-tensor-parallel inputs",
                                                     "expert-tensor-parallel fc1 outputs",
                                                     "expert-tensor-parallel SwiGLU outputs"};
            if (ETP > 1)
                experts_kept(&t, etp_names, mul(mul(NKl, EP), ETP), E / EP, H, Fl, S, fp8_act,
                             "--micro-batch-size, --seq-length, --moe-router-topk or "
                             "--expert-tensor-parallel-size");
            if (c->moe_pad_expert_input_to_capacity && Nl <= INT_MAX) {
                const long long cap = moe_expert_capacity((int)Nl, (int)k, (int)E,
                                                          c->moe_expert_capacity_factor);
                buffer(&t, "padded expert input", mul(mul(E, cap), H), S,
                       "--moe-expert-capacity-factor, --micro-batch-size or --seq-length");
            }
        } else {
            buffer(&t, "mlp.gu", mul(N, mul(2, Fdl)), S, "--micro-batch-size, --seq-length or "
                   "--ffn-hidden-size");
            buffer(&t, "mlp.act", mul(N, Fdl), S, "--micro-batch-size, --seq-length or "
                   "--ffn-hidden-size");
            widest_dense = Fdl;
        }
    }
    /* the one FFN workspace (moe/layer.c), sized for all N rows (the dense FFNs' and the
     * shared expert's; more than an MoE layer on Nl rows needs) */
    const long long rows = any_moe ? (NK > N ? NK : N) : N;
    const long long hf_moe = any_moe ? mul(NK, Fl) : 0;
    const long long hf_dense = mul(N, Fs > widest_dense ? Fs : widest_dense);
    const long long HF = hf_moe > hf_dense ? hf_moe : hf_dense;
    buffers(&t, "ffn workspace rows", 3, mul(rows, H), S, EXPERT);
    buffers(&t, "ffn workspace", 3, HF, S, EXPERT);
    if (any_moe && ETP > 1) { /* the gathered rows' scratch (one for every layer) and the
                               * padded exchange blocks, at most every row of the group */
        const long long grows = mul(mul(NKl, EP), ETP);
        buffer(&t, "expert-tensor-parallel scratch", mul(grows, add(mul(2, H), mul(3, Fl))), S,
               EXPERT);
        buffers(&t, "expert-tensor-parallel exchange", 2, mul(grows, H), S, EXPERT);
    }
    if (any_moe)
        buffer(&t, "router logit gradients", mul(N, E), S, "--micro-batch-size, --seq-length "
               "or --num-experts");
    buffers(&t, "final norm and gradients", 3, mul(Nl, H), S, WIDTH);
    if (sp) /* the whole-sequence buffers around the TP blocks (model.c) */
        buffers(&t, "sequence-parallel gather/scatter", 3, mul(N, H), S, WIDTH);
    buffers(&t, "logits and their gradient", 2, mul(N, Vl), S,
            "--micro-batch-size or --seq-length (the vocabulary comes from the data)");
    buffers(&t, "losses", 2, N, Rb, BATCH);
    if (E > 0)
        buffers(&t, "expert bias and loads", 3, mul(L, E), 8, "--num-experts or --num-layers");
    { /* chapter 05: the emulated low precision's QDQ scratch (lowp.h), sized like the model's */
        if (lowp_on) {
            const size_t cap = moe_lowp_cap(c, (size_t)N, any_moe ? (size_t)mul(NKl, EP) : 0);
            const long long ops = mul(2, mul((long long)cap, S)); /* the two operand buffers */
            const long long rest = (long long)moe_lowp_scratch_bytes(cap, (size_t)S) - ops;
            const char *fix = "--micro-batch-size, --seq-length or the widest FFN";
            buffers(&t, "low-precision QDQ operands", 2, (long long)cap, S, fix);
            /* (counted in 16-byte units: fewer elements than cap, so no false overflow) */
            buffer(&t, "low-precision QDQ staging, codes and scales", (rest + 15) / 16, 16, fix);
            const size_t dl = moe_lowp_delayed_bytes(c, any_moe ? (int)(E / EP) : 0);
            if (dl) /* delayed scaling's site table: a scale and a window per tensor */
                buffer(&t, "FP8 delayed-scaling amax histories", (long long)((dl + 15) / 16), 16,
                       "--fp8-amax-history-len");
            if (fp8_native && lowp.fp8_wgrad) { /* the FP8 wgrad's token-wise copies
                                                 * (moe_lowp_alloc_fp8_wgrad(): the rows of
                                                 * the ETP group, fc1's 2F + H channels) */
                const long long wrows = mul(mul(NKl, EP), ETP);
                const size_t b = moe_lowp_fp8_wgrad_bytes(
                    wrows > INT_MAX ? INT_MAX : (int)wrows, (int)(E / EP), (int)(2 * Fl + H));
                buffer(&t, "FP8 wgrad token-wise operands", (long long)((b + 15) / 16), 16,
                       EXPERT);
            }
        }
    }
    if (!strcmp(c->device, "cuda")) {
        /* the CUDA backend's RoPE table (kernels/rope.cu): cos and sin (one float2) of every
         * position 0 .. npos − 1 and pair, npos a power of two ≥ max(4096, seq_length), kept
         * for the run. Counted for --device cuda only: under auto the backend is not known
         * here, and on the CPU there is no table */
        const long long npos = moe_rope_table_positions(c->seq_length);
        buffer(&t, "RoPE cos/sin table (CUDA)", mul(npos, D / 2), 8, "--seq-length");
    }
    out->act_bytes = A;
    out->total_bytes = add(out->param_bytes, out->act_bytes);

    if (t.bad) {
        if (t.bad_elems == LLONG_MAX)
            return moe_error_set(err, MOE_ERR_CONFIG,
                                 "the %s buffer's size overflows 64 bits: reduce %s", t.bad,
                                 t.bad_flags);
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "the %s buffer would hold %lld elements, more than %d (the ops "
                             "count elements with int): reduce %s",
                             t.bad, t.bad_elems, INT_MAX, t.bad_flags);
    }
    if (out->total_bytes == LLONG_MAX)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "the model's memory overflows 64 bits: reduce %s or %s", MODEL,
                             BATCH);
    return MOE_OK;
}

moe_status moe_memory_estimate_rank(const moe_config *c, int micro_batch, const moe_grid *g,
                                    size_t act_size, moe_memory_estimate *out, moe_error *err) {
    int any_moe = 0;
    for (int l = 0; l < c->num_layers; l++)
        any_moe |= c->is_moe_layer[l];
    MOE_TRY(moe_memory_estimate_model(c, micro_batch, any_moe ? g->ep : 1, act_size, out, err));
    if (!c->use_distributed_optimizer)
        return MOE_OK;
    /* ZeRO-1 (dist_optimizer.h): the dense run is cut into DP·CP pieces, the expert run into
     * EDP pieces, each ⌈run / size⌉ long (the last one shorter); this rank keeps the moments
     * and the fp32 master weights of its piece of each, at most ⌈run / size⌉: what a rank at
     * position 0 holds exactly.
     * The reduce-scatter and all-gather stage through one buffer of (size + 1)·⌈run / size⌉
     * elements of the widest run that has more than one rank. */
    const long long S = (long long)act_size;
    const long long groups[2] = {(long long)g->dp * g->cp, g->edp};
    const long long runs[2] = {out->dense_params, out->expert_params};
    const long long es = sizeof(moe_real) > sizeof(float) ? sizeof(moe_real) : sizeof(float);
    long long pieces = 0, widest = 0;
    for (int i = 0; i < 2; i++) {
        const long long size = groups[i] >= 1 ? groups[i] : 1;
        const long long chunk = (runs[i] + size - 1) / size;
        pieces = add(pieces, chunk);
        if (size > 1 && runs[i] > 0 && mul(size + 1, chunk) > widest)
            widest = mul(size + 1, chunk);
    }
    out->optim_elems = pieces;
    out->zero_staging_bytes = mul(widest, es);
    out->optim_bytes = add(mul(pieces, 8), out->zero_staging_bytes);
    /* and the fp32 master weights of those pieces beside the moments; the model keeps the
     * compute copy whole, a buffer of its own even where its type is moe_real (model.c) */
    out->weight_bytes = add(mul(out->params, S), mul(pieces, (long long)sizeof(moe_real)));
    out->param_bytes = add(add(out->weight_bytes, out->grad_bytes), out->optim_bytes);
    out->total_bytes = add(out->param_bytes, out->act_bytes);
    return MOE_OK;
}

moe_status moe_memory_check(const moe_memory_estimate *e, unsigned long long available,
                            const char *device, moe_error *err) {
    if (available == 0 || (unsigned long long)e->total_bytes <= available)
        return MOE_OK;
    const double gb = 1e9;
    return moe_error_set(err, MOE_ERR_NOMEM,
                         "out of memory: this model needs about %.3g GB on each rank (%.3g GB for "
                         "%lld parameters with their gradients and AdamW moments, %.3g GB of "
                         "activations per micro-batch; largest buffer: %s) but the %s is "
                         "%.3g GB: reduce %s, or %s",
                         e->total_bytes / gb, e->param_bytes / gb, e->params, e->act_bytes / gb,
                         e->largest_name ? e->largest_name : "-", device, available / gb, BATCH,
                         MODEL);
}

unsigned long long moe_memory_host_bytes(void) {
    long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && size > 0 ? (unsigned long long)pages * (unsigned long long)size : 0;
}
