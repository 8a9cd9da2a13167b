/* Chapter 05's emulated low-precision training: see lowp.h. */
#include "lowp.h"

#include "comm.h"
#include "fp8_gemm.h"
#include "fp8_wgrad.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define REQUIRE(cond, ...)                                          \
    do {                                                            \
        if (!(cond))                                                \
            return moe_error_set(err, MOE_ERR_CONFIG, __VA_ARGS__); \
    } while (0)

static int is_on(const char *flag) { return flag[0] && strcmp(flag, "none") != 0; }

/* An on/off switch from the environment, read once per context: @p name unset or empty
 * gives @p dflt, else its integer value's truth (so "0" is off). */
static int env_switch(const char *name, int dflt) {
    const char *e = getenv(name);
    return e && *e ? atoi(e) != 0 : dflt;
}

/* the switches lowp.h describes, and their defaults:
 *  MOE_FP8_WGRAD        the routed experts' weight gradients on token-wise FP8 operands
 *                       (lib/fp8_wgrad.h: the native FP8 wgrad kernel, the emulation's
 *                       token-wise QDQ), as the blockwise recipe has it (DeepSeek-V3,
 *                       TransformerEngine's Float8BlockScaling: all three GEMMs in FP8, the
 *                       wgrad's operands quantized along the tokens); on. 0: on the
 *                       row-wise quantized operands of the dgrad, in a bf16 GEMM (what this
 *                       course did first; on an H100 the Mixtral layer 1.05x slower, its
 *                       validation loss 0.3-0.4 % lower over three seeds: results 05);
 *  MOE_FP8_FUSED        the native path's fused passes (lib/mlp.c), on unless 0: read once
 *                       per context, since the saved SwiGLU outputs' buffers are sized from it;
 *  MOE_FP8_FUSED_T      under the FP8 wgrad, the fused SwiGLU backward writes dgu's
 *                       token-wise copy itself ("Fused passes"): on. On an H100 the Mixtral
 *                       layer with 31 repeats won three alternating pairs, 22.35 / 22.25 /
 *                       22.27 against 22.46 / 22.46 / 22.35 ms (docs/results/05-fp8-nvfp4.md);
 *                       0 keeps the row-wise backward and dgu's separate token-wise pass;
 *  MOE_FP8_SAVE_T       under the FP8 wgrad, the fused SwiGLU forward writes the output's
 *                       token-wise copy (fc2's wgrad operand) and that copy, not the bf16
 *                       output, is kept for the backward (lib/mlp.c, moe_mlp_saved_form()):
 *                       on. Read once per context, as MOE_FP8_FUSED, since the saved
 *                       outputs' buffers are sized from it;
 *  MOE_FP8_NATIVE_DENSE the dense linears' native FP8 GEMMs ("Native FP8 dense linears"),
 *                       off: the model's FP8 weight copies (and the memory estimate) depend
 *                       on it. */
#define MOE_FP8_WGRAD_DEFAULT 1
#define MOE_FP8_FUSED_DEFAULT 1
#define MOE_FP8_FUSED_T_DEFAULT 1
#define MOE_FP8_SAVE_T_DEFAULT 1
#define MOE_FP8_NATIVE_DENSE_DEFAULT 0

moe_status moe_lowp_from_config(moe_lowp *lp, const moe_config *c, moe_error *err) {
    memset(lp, 0, sizeof *lp);
    const int fp8 = is_on(c->fp8_format), fp4 = is_on(c->fp4_format);
    if (!fp8 && !fp4)
        return MOE_OK;
    REQUIRE(!(fp8 && fp4), "--fp8-format %s and --fp4-format %s both given: pick one of them "
            "(Megatron trains either in FP8 or in NVFP4)", c->fp8_format, c->fp4_format);
    lp->on = 1;
    lp->seed = (uint64_t)c->seed ^ 0x5f8d3a1c7e2b9d41ull;
    if (fp4) {
        for (int r = 0; r < MOE_LOWP_ROLES; r++)
            lp->spec[r].recipe = MOE_QUANT_NVFP4;
        lp->spec[MOE_LOWP_WEIGHT].recipe = MOE_QUANT_NVFP4_2D;  /* 16×16 weight blocks */
        lp->spec[MOE_LOWP_GRADIENT].nvfp4.stochastic = 1;        /* gradients only */
        /* the wgrad operands' transform (lowp.h, "wgrad"), on as in TransformerEngine; one
         * sign vector for the run, the same for both operands of every wgrad */
        lp->wgrad_rht = !c->fp4_disable_rht;
        lp->rht_seed = (uint64_t)c->seed ^ 0x2c1b3c6d9e8f7a55ull;
        snprintf(lp->name, sizeof lp->name, "nvfp4 (emulated)");
        return MOE_OK;
    }
    const int hybrid = strcmp(c->fp8_format, "hybrid") == 0;
    const char *r = c->fp8_recipe;
    if (strcmp(r, "delayed") == 0) { /* tensorwise, the scale from a history per site */
        lp->delayed = 1;
        lp->hist_len = c->fp8_amax_history_len;
        lp->algo = strcmp(c->fp8_amax_compute_algo, "max") == 0 ? MOE_AMAX_MAX
                                                                 : MOE_AMAX_MOST_RECENT;
        lp->margin = c->fp8_margin;
    }
    moe_quant_recipe act = MOE_QUANT_TENSORWISE, wgt = MOE_QUANT_TENSORWISE;
    if (strcmp(r, "blockwise") == 0) {
        act = MOE_QUANT_BLOCK_1X128;
        wgt = MOE_QUANT_BLOCK_128X128;
    } else if (strcmp(r, "mxfp8") == 0) {
        act = wgt = MOE_QUANT_MXFP8;
    }
    for (int k = 0; k < MOE_LOWP_ROLES; k++) {
        lp->spec[k].recipe = k == MOE_LOWP_WEIGHT ? wgt : act;
        lp->spec[k].format = MOE_FP8_E4M3;
        /* blockwise: power-of-two scales, TransformerEngine's default for this recipe */
        lp->spec[k].pow2 = strcmp(r, "blockwise") == 0;
    }
    if (hybrid) /* E4M3 forward, E5M2 gradients */
        lp->spec[MOE_LOWP_GRADIENT].format = MOE_FP8_E5M2;
    snprintf(lp->name, sizeof lp->name, "fp8 %.12s %.8s (emulated)", r, c->fp8_format);
    const int native = moe_lowp_native_recipe(lp);
    lp->fp8_wgrad = native && env_switch("MOE_FP8_WGRAD", MOE_FP8_WGRAD_DEFAULT);
    lp->fp8_fused = native && env_switch("MOE_FP8_FUSED", MOE_FP8_FUSED_DEFAULT);
    lp->fp8_fused_t = lp->fp8_fused && /* (acts under fp8_wgrad only) */
                      env_switch("MOE_FP8_FUSED_T", MOE_FP8_FUSED_T_DEFAULT);
    lp->fp8_save_t = lp->fp8_fused && /* (acts under fp8_wgrad only) */
                     env_switch("MOE_FP8_SAVE_T", MOE_FP8_SAVE_T_DEFAULT);
    lp->native_dense = native && env_switch("MOE_FP8_NATIVE_DENSE", MOE_FP8_NATIVE_DENSE_DEFAULT);
    return MOE_OK;
}

/* one linear layer's widths, for the shape check */
typedef struct linear_shape {
    const char *name; /* as the parameter table names it */
    int in, out;      /* this rank's I and O */
    const char *why_in, *why_out; /* the flags the widths come from */
} linear_shape;

static moe_status check_linear(const linear_shape *s, const char *flag, const char *recipe,
                               int width, moe_error *err) {
    REQUIRE(s->in % width == 0,
            "%s %s needs every linear layer's widths to be multiples of its block of %d "
            "elements: %s has input width %d (%s); pick sizes that are multiples of %d%s",
            flag, recipe, width, s->name, s->in, s->why_in, width,
            width > 1 ? ", or --fp8-recipe tensorwise (any width)" : "");
    REQUIRE(s->out % width == 0,
            "%s %s needs every linear layer's widths to be multiples of its block of %d "
            "elements: %s has output width %d (%s), the width of its output gradient; pick "
            "sizes that are multiples of %d, or --fp8-recipe tensorwise (any width)",
            flag, recipe, width, s->name, s->out, s->why_out, width);
    return MOE_OK;
}

moe_status moe_lowp_check_config(const moe_config *c, moe_error *err) {
    const int fp8 = is_on(c->fp8_format), fp4 = is_on(c->fp4_format);
    REQUIRE(c->fp8_amax_history_len >= 1,
            "--fp8-amax-history-len %d: delayed scaling keeps the amaxes of the last N steps, "
            "N >= 1 (Megatron's default 1, TransformerEngine's 1024)", c->fp8_amax_history_len);
    REQUIRE(c->fp8_margin >= 0 && c->fp8_margin <= MOE_QUANT_MAX_MARGIN,
            "--fp8-margin %d: delayed scaling divides each scale by 2^margin; give 0 to %d "
            "(Megatron's default 0)", c->fp8_margin, MOE_QUANT_MAX_MARGIN);
    REQUIRE(!c->fp4_disable_rht || fp4,
            "--fp4-disable-rht without --fp4-format e2m1: the random Hadamard transform is "
            "part of the NVFP4 recipe; give --fp4-format e2m1 or drop --fp4-disable-rht");
    if (!fp8 && !fp4)
        return MOE_OK;
    moe_lowp lp;
    MOE_TRY(moe_lowp_from_config(&lp, c, err));
    const char *flag = fp4 ? "--fp4-recipe" : "--fp8-recipe";
    const char *recipe = fp4 ? c->fp4_recipe : c->fp8_recipe;
    REQUIRE(!c->use_distributed_optimizer,
            "%s %s with --use-distributed-optimizer: the emulated low precision quantizes the "
            "weights' compute copy after the cast, which the distributed optimizer's gather "
            "writes instead; not supported yet: drop one of the two", flag, recipe);
    REQUIRE(!c->moe_permute_fusion,
            "%s %s with --moe-permute-fusion: fc1 would gather its rows from the unquantized "
            "tokens; drop --moe-permute-fusion (the emulation quantizes the permuted copy)",
            flag, recipe);
    const int tps = c->tensor_model_parallel_size, etps = c->expert_tensor_parallel_size;
    const int per_tensor = lp.spec[MOE_LOWP_ACTIVATION].recipe == MOE_QUANT_TENSORWISE ||
                           fp4; /* one amax per tensor: NVFP4's global scale too */
    REQUIRE(!per_tensor || (tps == 1 && etps == 1),
            "%s %s with tensor parallelism (TP %d, ETP %d): the per-tensor amax would be each "
            "shard's, where Megatron reduces it over the group; not supported yet: use "
            "--fp8-recipe blockwise or mxfp8 (per-block scales), or TP = ETP = 1",
            flag, recipe, tps, etps);
    int width = 1;
    switch (lp.spec[MOE_LOWP_ACTIVATION].recipe) {
    case MOE_QUANT_BLOCK_1X128: width = MOE_QUANT_BLOCK; break;
    case MOE_QUANT_MXFP8: width = MOE_QUANT_MX_BLOCK; break;
    case MOE_QUANT_NVFP4: width = MOE_QUANT_NVFP4_BLOCK; break;
    default: return MOE_OK; /* tensorwise: any width */
    }
    const int H = c->hidden_size, QD = c->num_attention_heads * c->head_dim,
              KD = c->num_query_groups * c->head_dim;
    const linear_shape attn[] = {
        {"attn.wq", H, QD / tps, "--hidden-size", "--num-attention-heads x head dim / TP"},
        {"attn.wk", H, KD / tps, "--hidden-size", "--num-query-groups x head dim / TP"},
        {"attn.wv", H, KD / tps, "--hidden-size", "--num-query-groups x head dim / TP"},
        {"attn.wo", QD / tps, H, "--num-attention-heads x head dim / TP", "--hidden-size"}};
    for (size_t i = 0; i < sizeof attn / sizeof attn[0]; i++)
        MOE_TRY(check_linear(&attn[i], flag, recipe, width, err));
    int any_dense = 0, any_moe = 0;
    for (int l = 0; l < c->num_layers; l++) {
        any_moe |= c->is_moe_layer[l];
        any_dense |= !c->is_moe_layer[l];
    }
    if (any_dense) {
        const int F = c->ffn_hidden_size / tps;
        const linear_shape s[] = {{"mlp.fc1", H, 2 * F, "--hidden-size", "2 x --ffn-hidden-size / TP"},
                                  {"mlp.fc2", F, H, "--ffn-hidden-size / TP", "--hidden-size"}};
        MOE_TRY(check_linear(&s[0], flag, recipe, width, err));
        MOE_TRY(check_linear(&s[1], flag, recipe, width, err));
    }
    if (any_moe) {
        const int F = c->moe_ffn_hidden_size / etps, Fs = c->moe_shared_expert_intermediate_size / tps;
        const linear_shape s[] = {
            {"moe.experts.fc1", H, 2 * F, "--hidden-size", "2 x --moe-ffn-hidden-size / ETP"},
            {"moe.experts.fc2", F, H, "--moe-ffn-hidden-size / ETP", "--hidden-size"},
            {"moe.shared.fc1", H, 2 * Fs, "--hidden-size",
             "2 x --moe-shared-expert-intermediate-size / TP"},
            {"moe.shared.fc2", Fs, H, "--moe-shared-expert-intermediate-size / TP",
             "--hidden-size"}};
        for (int i = 0; i < (Fs > 0 ? 4 : 2); i++)
            MOE_TRY(check_linear(&s[i], flag, recipe, width, err));
    }
    return MOE_OK;
}

size_t moe_lowp_cap(const moe_config *c, size_t tokens, size_t moe_rows) {
    size_t width = (size_t)c->hidden_size;
    const int widths[] = {c->num_attention_heads * c->head_dim, 2 * c->ffn_hidden_size,
                          2 * c->moe_ffn_hidden_size,
                          2 * c->moe_shared_expert_intermediate_size};
    for (size_t i = 0; i < sizeof widths / sizeof widths[0]; i++)
        width = (size_t)widths[i] > width ? (size_t)widths[i] : width;
    /* + a block: the wgrad operands' tokens padded to NVFP4's 16 (moe_lowp_wgrad()) */
    const size_t rows = (moe_rows > tokens ? moe_rows : tokens) + MOE_QUANT_NVFP4_BLOCK;
    return (rows > width ? rows : width) * width;
}

size_t moe_lowp_scratch_bytes(size_t cap, size_t act_size) {
    size_t qb, sb;
    moe_qdq_ws_bytes(cap, &qb, &sb);
    /* as moe_lowp_alloc(): fp32 staging, codes, scales, the scalars, two operand buffers */
    return sizeof(float) * cap + qb + sb + sizeof(moe_quant_scalars) + 2 * act_size * cap +
           sizeof(uint64_t); /* the draw counter */
}

int moe_lowp_alloc(const moe_backend *be, moe_lowp *lp, size_t cap) {
    if (!lp->on)
        return 1;
    size_t qb, sb;
    moe_qdq_ws_bytes(cap, &qb, &sb);
    lp->cap = cap;
    lp->ws.x = be->alloc(sizeof(float) * (cap > 0 ? cap : 1));
    lp->ws.q = be->alloc(qb);
    lp->ws.scales = be->alloc(sb);
    lp->ws.g = be->alloc(sizeof(moe_quant_scalars));
    lp->act = be->alloc(be->act_size * (cap > 0 ? cap : 1));
    lp->grad = be->alloc(be->act_size * (cap > 0 ? cap : 1));
    lp->sr_calls = be->alloc(sizeof(uint64_t));
    if (lp->sr_calls)
        be->zero(lp->sr_calls, sizeof(uint64_t));
    return lp->ws.x && lp->ws.q && lp->ws.scales && lp->ws.g && lp->act && lp->grad &&
           lp->sr_calls;
}

void moe_lowp_free(const moe_backend *be, moe_lowp *lp) {
    if (!lp)
        return;
    be->free(lp->ws.x);
    be->free(lp->ws.q);
    be->free(lp->ws.scales);
    be->free(lp->ws.g);
    be->free(lp->act);
    be->free(lp->grad);
    be->free(lp->sr_calls);
    lp->sr_calls = NULL;
    be->free(lp->sites);
    be->free(lp->history);
    be->free(lp->wg_q);
    be->free(lp->wg_s);
    lp->wg_q = NULL;
    lp->wg_s = NULL;
    memset(&lp->ws, 0, sizeof lp->ws);
    lp->act = lp->grad = NULL;
    lp->sites = NULL;
    lp->history = NULL;
}

/*
 * Delayed scaling (`--fp8-recipe delayed`): which state a QDQ uses.
 *
 * Each tensor a linear layer quantizes has its own scale and amax history, as in
 * TransformerEngine (one FP8 meta per module: input, weight, output gradient). The model
 * runs every layer's forward and, later, its backward, and the backward quantizes the saved
 * input AGAIN (no quantized copy is kept: "Buffers" in lowp.h). So the state cannot be
 * found by counting QDQs in call order: the backward's calls come in another order and some
 * quantize a tensor the second time. A call site names its state instead: the linear layer
 * (moe_lowp_site(): the layer, the block, the expert, fc1/fc2 or Q/K/V/O) and the role give
 * the site index (linear·3 + role) into a table allocated with the model.
 *
 * When the history moves:
 *  - the forward's QDQ of an input and the backward's of an output gradient record: the
 *    tensor is cast with site->scale, chosen from the history before it, and its amax goes
 *    into the history (once per micro-batch at each site);
 *  - the backward's QDQ of a saved input (moe_lowp_qdq_saved()) replays: it casts with the
 *    scale the forward used (site->used) and records nothing, so the backward's GEMMs see
 *    exactly the forward's codes. The forward and the backward of a micro-batch alternate
 *    (the trainer runs them back to back), so `used` is still the forward's;
 *  - the weights record once per optimizer step, when the compute copy is quantized
 *    (moe_model_weights_written()); after a checkpoint's load they replay.
 * The first tensor at a site (no history yet) takes current scaling: TransformerEngine
 * starts from scale 1, which would cast a gradient of 1e-6 to zero codes and saturate an
 * activation above 448 for a whole step; current scaling gives step 1 what the tensorwise
 * recipe gives it and costs nothing here (the amax is computed anyway, to be recorded).
 * The table lives in backend memory and only the quantize kernels touch it: no step reads a
 * scale on the host, and a CUDA graph replays the same kernels on the same state.
 */
size_t moe_lowp_sites(const moe_lowp *lp) {
    if (!lp || !lp->delayed)
        return 0;
    return (size_t)lp->layers * (size_t)(MOE_LOWP_EXPERTS + 2 * lp->experts) * MOE_LOWP_ROLES;
}

size_t moe_lowp_delayed_bytes(const moe_config *c, int experts) {
    if (!is_on(c->fp8_format) || strcmp(c->fp8_recipe, "delayed") != 0)
        return 0;
    const moe_lowp lp = {.delayed = 1, .layers = c->num_layers, .experts = experts};
    const size_t n = moe_lowp_sites(&lp);
    const size_t len = c->fp8_amax_history_len > 0 ? (size_t)c->fp8_amax_history_len : 1;
    return n * (sizeof(moe_delayed_site) + sizeof(float) * len);
}

int moe_lowp_alloc_delayed(const moe_backend *be, moe_lowp *lp, int layers, int experts) {
    if (!lp->on || !lp->delayed)
        return 1;
    lp->layers = layers;
    lp->experts = experts;
    const size_t n = moe_lowp_sites(lp), nh = n * (size_t)lp->hist_len;
    lp->sites = be->alloc(sizeof(moe_delayed_site) * (n ? n : 1));
    lp->history = be->alloc(sizeof(float) * (nh ? nh : 1));
    moe_delayed_site *h = malloc(sizeof *h * (n ? n : 1));
    const int ok = lp->sites && lp->history && h;
    if (ok) {
        for (size_t i = 0; i < n; i++)
            h[i] = (moe_delayed_site){1.0f, 1.0f, 1.0f, 0.0f, 0, 0};
        be->from_host(lp->sites, h, sizeof *h * n);
        be->zero(lp->history, sizeof(float) * nh);
    }
    free(h);
    return ok;
}

int moe_lowp_site(const moe_lowp *lp, int layer, moe_lowp_block block, int expert) {
    if (!lp || !lp->sites) /* no table (yet): a sizing call, or another recipe */
        return 0;
    MOE_ASSERT(layer >= 0 && layer < lp->layers && expert >= 0 &&
               (block == MOE_LOWP_EXPERTS ? expert < lp->experts : expert == 0));
    return layer * (MOE_LOWP_EXPERTS + 2 * lp->experts) + (int)block + 2 * expert;
}

/* the windows [first, first + n) of the table, their max over group g (floats ≥ 0 as int32) */
static void reduce_windows(const moe_lowp *lp, moe_comm *g, size_t first, size_t n) {
    if (g && n)
        moe_comm_all_reduce_max(g, lp->history + first * (size_t)lp->hist_len,
                                n * (size_t)lp->hist_len, MOE_DTYPE_I32);
}

void moe_lowp_reduce_amax(const moe_lowp *lp, moe_comm *dense, moe_comm *experts,
                          moe_comm *rows) {
    if (!lp || !lp->history)
        return;
    if (dense == experts && (!rows || rows == dense)) { /* one collective: no EP */
        reduce_windows(lp, dense, 0, moe_lowp_sites(lp));
        return;
    }
    const size_t R = MOE_LOWP_ROLES, per_layer = (size_t)(MOE_LOWP_EXPERTS + 2 * lp->experts);
    for (int l = 0; l < lp->layers; l++) {
        const size_t base = (size_t)l * per_layer * R;
        reduce_windows(lp, dense, base, MOE_LOWP_EXPERTS * R);
        if (!lp->experts)
            continue;
        reduce_windows(lp, experts, base + MOE_LOWP_EXPERTS * R, 2 * (size_t)lp->experts * R);
        for (size_t lin = MOE_LOWP_EXPERTS; rows && lin < MOE_LOWP_EXPERTS + 2; lin++) {
            reduce_windows(lp, rows, base + lin * R + MOE_LOWP_ACTIVATION, 1);
            reduce_windows(lp, rows, base + lin * R + MOE_LOWP_GRADIENT, 1);
        }
    }
}

/* the spec of one QDQ: a gradient under stochastic rounding gets the next seed; under delayed
 * scaling the site of (linear, role), recording or replaying */
static moe_qdq_spec spec_of(moe_lowp *lp, moe_lowp_role role, int linear, int record) {
    moe_qdq_spec s = lp->spec[role];
    if (s.nvfp4.stochastic)
        s.nvfp4.sr_seed = lp->seed, s.nvfp4.sr_counter = lp->sr_calls; /* advanced on the device */
    if (lp->sites) {
        const size_t k = (size_t)linear * MOE_LOWP_ROLES + (size_t)role;
        MOE_ASSERT(linear >= 0 && k < moe_lowp_sites(lp));
        s.delayed = (moe_delayed_ref){lp->sites + k, lp->history + k * (size_t)lp->hist_len,
                                      lp->hist_len, lp->algo, lp->margin, record};
    }
    return s;
}

static const void *qdq_operand(const moe_backend *be, moe_lowp *lp, const void *buf, int rows,
                               int cols, moe_lowp_role role, int linear, int record) {
    if (!lp || !lp->on || rows == 0)
        return buf;
    MOE_ASSERT(role != MOE_LOWP_WEIGHT && (size_t)rows * cols <= lp->cap);
    void *dst = role == MOE_LOWP_GRADIENT ? lp->grad : lp->act;
    const moe_qdq_spec s = spec_of(lp, role, linear, record);
    be->qdq(dst, buf, rows, cols, &s, &lp->ws);
    return dst;
}

const void *moe_lowp_qdq(const moe_backend *be, moe_lowp *lp, const void *buf, int rows,
                         int cols, moe_lowp_role role, int linear) {
    return qdq_operand(be, lp, buf, rows, cols, role, linear, 1);
}

const void *moe_lowp_qdq_saved(const moe_backend *be, moe_lowp *lp, const void *buf, int rows,
                               int cols, int linear) {
    return qdq_operand(be, lp, buf, rows, cols, MOE_LOWP_ACTIVATION, linear, 0);
}

int moe_lowp_wgrad_rht(const moe_lowp *lp) { return lp && lp->on && lp->wgrad_rht; }

/*
 * The wgrad with NVFP4's random Hadamard transform (TransformerEngine's NVFP4BlockScaling,
 * whose RHT applies to the columnwise, i.e. wgrad, usage of the input and of the gradient).
 * dW = dYᵀ·X reduces over the tokens, so a native NVFP4 wgrad quantizes the transposed
 * operands dYᵀ [O, n] and Xᵀ [I, n]: 16-element blocks along the tokens, each block first
 * multiplied by M = H·S/4 (H the 16×16 Hadamard matrix, S the run's random signs), the amaxes
 * taken after it. M is orthogonal (M·Mᵀ = H·Hᵀ/16 = I), so for one block of 16 tokens
 * Σ_t (dy·M)_t (x·M)_t = dy·M·Mᵀ·xᵀ = Σ_t dy_t x_t: the product is unchanged in exact
 * arithmetic and only the quantization sees the transformed values, whose outliers are
 * spread over the block. The emulation computes exactly that product: each operand's QDQ
 * along the tokens (be->qdq_t, the transform kept: moe_qdq_spec::keep_transform), then the
 * ordinary wgrad GEMM over the padded tokens (zero rows transform into nonzero values, which
 * the product needs: all 16 positions of a block take part). Each group (expert) is a tensor
 * of its own (its own global scale), as TransformerEngine's GroupedLinear quantizes each
 * expert's split, and its tokens are padded to a multiple of 16 on their own.
 */
void moe_lowp_wgrad(const moe_backend *be, moe_lowp *lp, moe_real *dw, const void *dout,
                    const void *in, const int *off, int G, int I, int O, int linear) {
    MOE_ASSERT(moe_lowp_wgrad_rht(lp) && off);
    const int B = MOE_QUANT_NVFP4_BLOCK;
    for (int g = 0; g < G; g++) {
        const int n = off[g + 1] - off[g], m = (n + B - 1) / B * B;
        if (n == 0)
            continue;
        MOE_ASSERT((size_t)m * (O > I ? O : I) <= lp->cap);
        moe_qdq_spec s[2] = {spec_of(lp, MOE_LOWP_GRADIENT, linear, 1),
                             spec_of(lp, MOE_LOWP_ACTIVATION, linear, 1)};
        for (int k = 0; k < 2; k++) {
            s[k].recipe = MOE_QUANT_NVFP4; /* 1×16 along the tokens */
            s[k].nvfp4.rht = 1;
            s[k].nvfp4.rht_seed = lp->rht_seed;
            s[k].keep_transform = 1;
        }
        be->qdq_t(lp->grad, MOE_ACT(be, dout, (size_t)off[g] * O), n, m, O, &s[0], &lp->ws);
        be->qdq_t(lp->act, MOE_ACT(be, in, (size_t)off[g] * I), n, m, I, &s[1], &lp->ws);
        be->matmul_backward(NULL, dw + (size_t)g * O * I, lp->grad, lp->act, NULL, m, I, O);
    }
}

void moe_lowp_qdq_weight(const moe_backend *be, moe_lowp *lp, void *w, int groups, int rows,
                         int cols, int linear, int record) {
    if (!lp || !lp->on)
        return;
    MOE_ASSERT((size_t)rows * cols <= lp->cap);
    for (int g = 0; g < groups; g++) {
        const moe_qdq_spec s = spec_of(lp, MOE_LOWP_WEIGHT, linear + 2 * g, record);
        void *wg = MOE_ACT(be, w, (size_t)g * rows * cols);
        be->qdq(wg, wg, rows, cols, &s, &lp->ws);
    }
}

size_t moe_lowp_fp8_wgrad_bytes(int rows, int G, int channels) {
    const size_t n = moe_fp8_wgrad_kpad(rows, G) * (size_t)channels;
    return n + sizeof(float) * (n / MOE_QUANT_BLOCK);
}

int moe_lowp_alloc_fp8_wgrad(const moe_backend *be, moe_lowp *lp, int rows, int G,
                             int channels) {
    if (!lp || !lp->on || !lp->fp8_wgrad)
        return 1;
    const size_t n = moe_fp8_wgrad_kpad(rows, G) * (size_t)channels;
    be->free(lp->wg_q);
    be->free(lp->wg_s);
    lp->wg_q = be->alloc(n ? n : 1);
    lp->wg_s = be->alloc(sizeof(float) * (n / MOE_QUANT_BLOCK + 1));
    lp->wg_elems = n;
    return lp->wg_q && lp->wg_s;
}

uint64_t moe_lowp_sr_calls(const moe_backend *be, const moe_lowp *lp) {
    uint64_t n = 0;
    if (lp && lp->on && lp->sr_calls)
        be->to_host(&n, lp->sr_calls, sizeof n);
    return n;
}

void moe_lowp_set_sr_calls(const moe_backend *be, moe_lowp *lp, uint64_t n) {
    if (lp && lp->on && lp->sr_calls)
        be->from_host(lp->sr_calls, &n, sizeof n);
}

int moe_lowp_native_recipe(const moe_lowp *lp) {
    if (!lp || !lp->on)
        return 0;
    for (int r = 0; r < MOE_LOWP_ROLES; r++)
        if (lp->spec[r].format != MOE_FP8_E4M3)
            return 0;
    return lp->spec[MOE_LOWP_ACTIVATION].recipe == MOE_QUANT_BLOCK_1X128 &&
           lp->spec[MOE_LOWP_WEIGHT].recipe == MOE_QUANT_BLOCK_128X128;
}

int moe_lowp_native(const moe_backend *be, const moe_lowp *lp) {
    if (!moe_lowp_native_recipe(lp) || !be->fp8_grouped_native || !be->fp8_grouped_native())
        return 0;
    const char *e = getenv("MOE_FP8_NATIVE");
    return !(e && *e == '0');
}

size_t moe_fp8_weight_bytes(int G, int O, int I) {
    const size_t n = (size_t)G * O * I;
    return 2 * n + 2 * sizeof(float) * (n / MOE_QUANT_BLOCK / MOE_QUANT_BLOCK);
}

int moe_fp8_weight_alloc(const moe_backend *be, moe_fp8_weight *fw, int G, int O, int I) {
    MOE_ASSERT(O % MOE_QUANT_BLOCK == 0 && I % MOE_QUANT_BLOCK == 0);
    const size_t n = (size_t)G * O * I, ns = n / MOE_QUANT_BLOCK / MOE_QUANT_BLOCK;
    *fw = (moe_fp8_weight){be->alloc(n ? n : 1), be->alloc(sizeof(float) * (ns ? ns : 1)),
                           be->alloc(n ? n : 1), be->alloc(sizeof(float) * (ns ? ns : 1)),
                           G, O, I};
    if (fw->q && fw->s && fw->qt && fw->st)
        return 1;
    moe_fp8_weight_free(be, fw);
    return 0;
}

void moe_fp8_weight_free(const moe_backend *be, moe_fp8_weight *fw) {
    if (!fw)
        return;
    be->free(fw->q);
    be->free(fw->s);
    be->free(fw->qt);
    be->free(fw->st);
    memset(fw, 0, sizeof *fw);
}

/* the FP8 codes of G weights [O, I] and of their transposes, in one fused pass (the native
 * paths' weights; the recipe's 128×128 blocks) */
static void quantize_fp8_weight(const moe_backend *be, const moe_lowp *lp, moe_fp8_weight *fw,
                                const void *w, int G, int O, int I, const char *who) {
    MOE_ASSERT(fw->G == G && fw->O == O && fw->I == I);
    const moe_qdq_spec *s = &lp->spec[MOE_LOWP_WEIGHT];
    moe_error err; /* (the model checked every shape at start-up) */
    MOE_REQUIRE_OK(be->fp8_quant_t_act(fw->q, fw->s, fw->qt, fw->st, w, G, O, I, s->format, 1,
                                       s->pow2, &err),
                   &err, who);
}

void moe_lowp_quantize_experts(const moe_backend *be, moe_lowp *lp, moe_fp8_weight *fw, void *w,
                               int G, int O, int I, int linear, int record) {
    if (!lp || !lp->on)
        return;
    if (!fw) {
        moe_lowp_qdq_weight(be, lp, w, G, O, I, linear, record);
        return;
    }
    quantize_fp8_weight(be, lp, fw, w, G, O, I, "moe_lowp_quantize_experts");
}

/* ------------------------------------------------- native FP8 dense linears (lowp.h) */

int moe_lowp_native_dense(const moe_backend *be, const moe_lowp *lp) {
    return lp && lp->native_dense && moe_lowp_native(be, lp) && be->fp8_gemm &&
           be->fp8_quant_act && be->fp8_quant_t_act;
}

int moe_lowp_dense_fits(const moe_lowp *lp, const moe_fp8_weight *fw, int rows) {
    /* cuBLASLt's blockwise GEMM wants M % 4 == 0 (moe_fp8_gemm_check()); the widths are
     * multiples of 128, checked at start-up (moe_lowp_check_config()) */
    return lp && lp->on && lp->native_dense && fw && fw->q && fw->G == 1 && rows > 0 &&
           rows % 4 == 0;
}

/* (the backend ops below cannot fail on the shapes checked at start-up and by
 * moe_lowp_dense_fits(); a cuBLASLt refusal is named before the abort: MOE_REQUIRE_OK) */
static const char *const DENSE = "native FP8 dense GEMM";

/* x [rows, cols] quantized 1×128 into the context's codes and scales (and, with @p y, its
 * dequantized copy there): the A operand of the next dense GEMMs */
static moe_qmatrix dense_quant(const moe_backend *be, moe_lowp *lp, void *y, const void *x,
                               int rows, int cols, moe_lowp_role role) {
    const moe_qdq_spec *sp = &lp->spec[role];
    MOE_ASSERT((size_t)rows * cols <= lp->cap);
    moe_error err;
    MOE_REQUIRE_OK(be->fp8_quant_act(lp->ws.q, (float *)lp->ws.scales, y, x, rows, cols,
                                     sp->format, sp->pow2, &err),
                   &err, DENSE);
    const moe_qmatrix a = {MOE_QUANT_BLOCK_1X128, sp->format, lp->ws.q, lp->ws.scales, NULL,
                           {0}};
    return a;
}

/* d (+)= A·Bᵀ on B = @p q, @p s: the codes [N, K] of a weight or of its transpose */
static void dense_gemm(const moe_backend *be, moe_lowp *lp, void *d, int accumulate,
                       const moe_qmatrix *a, const uint8_t *q, const float *s, int M, int N,
                       int K) {
    const moe_qmatrix b = {MOE_QUANT_BLOCK_128X128, MOE_FP8_E4M3, q, s, NULL, {0}};
    moe_error err;
    MOE_REQUIRE_OK(be->fp8_gemm(d, accumulate, a, &b, M, N, K, &err), &err, DENSE);
    lp->dense_gemms++;
}

void moe_lowp_dense_forward(const moe_backend *be, moe_lowp *lp, void *const *out,
                            const moe_fp8_weight *const *fw, int n, const void *x, int rows,
                            int I) {
    for (int i = 0; i < n; i++)
        MOE_ASSERT(moe_lowp_dense_fits(lp, fw[i], rows) && fw[i]->I == I);
    /* (the GEMMs read the codes in stream order: nothing quantizes between them) */
    const moe_qmatrix a = dense_quant(be, lp, NULL, x, rows, I, MOE_LOWP_ACTIVATION);
    for (int i = 0; i < n; i++)
        dense_gemm(be, lp, out[i], 0, &a, fw[i]->q, fw[i]->s, rows, fw[i]->O, I);
}

const void *moe_lowp_dense_dgrad(const moe_backend *be, moe_lowp *lp, void *din, int accumulate,
                                 const moe_fp8_weight *fw, const void *dout, int rows) {
    MOE_ASSERT(moe_lowp_dense_fits(lp, fw, rows));
    const moe_qmatrix a = dense_quant(be, lp, lp->grad, dout, rows, fw->O, MOE_LOWP_GRADIENT);
    if (din) /* dx [rows, I] = Q(dout) [rows, O] · (Wᵀ [I, O])ᵀ: Wᵀ's codes are K-major */
        dense_gemm(be, lp, din, accumulate, &a, fw->qt, fw->st, rows, fw->I, fw->O);
    return lp->grad;
}

void moe_lowp_quantize_dense(const moe_backend *be, moe_lowp *lp, moe_fp8_weight *fw, void *w,
                             int O, int I, int linear, int record) {
    if (!lp || !lp->on)
        return;
    if (fw) /* first, from W itself: the codes of the emulation's Q(W) (lowp.h) */
        quantize_fp8_weight(be, lp, fw, w, 1, O, I, "moe_lowp_quantize_dense");
    moe_lowp_qdq_weight(be, lp, w, 1, O, I, linear, record);
}
