/* The MoE transformer: see model.h. */
#include "model.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "cpu/router.h"
#include "lowp.h"
#include "mlp.h"
#include "log.h"
#include "memory.h"
#include "moe/experts.h"

#define R sizeof(moe_real)

/* ------------------------------------------------------------------ layout */

static void layout(moe_model *m) {
    const moe_config *c = &m->cfg;
    const int H = c->hidden_size, D = c->head_dim, Hq = c->num_attention_heads,
              Hkv = c->num_query_groups, V = c->vocab_size, E = c->num_experts;
    const double std = c->init_method_std;
    /* Megatron's output_layer_init_method: projections that write into the residual
     * stream are scaled down so the stream's variance does not grow with depth. */
    const double out_std = std / sqrt(2.0 * c->num_layers);
    moe_param_table *pt = &m->table;
    char name[64];
    /* Tensor parallelism (tensor_parallel.h): QKV and fc1 are split by output rows
     * (column-parallel), the output projection and fc2 by input columns (row-parallel), each
     * rank's shard initialised as its slice of the single-rank tensor. Tensors every TP rank
     * holds whole get a partial gradient where each rank saw part of the work: the QK-norm
     * (each rank's heads), and under sequence parallelism the norms (each rank's tokens). */
    const int tps = m->tp.size, tpr = m->tp.rank, sp = tps > 1 && m->tp.sp;
#define SHARD_TP(dim)                                                                   \
    do {                                                                                \
        if (tps > 1)                                                                    \
            moe_params_shard(pt, MOE_GROUP_TP, dim, tpr, tps);                          \
    } while (0)
#define PARTIAL_TP(cond)                                                                \
    do {                                                                                \
        if (cond)                                                                       \
            moe_params_partial(pt, MOE_GROUP_TP);                                       \
    } while (0)
    /* the embedding and the LM head are split by vocabulary rows (vocab_parallel.h); every
     * rank computes its rows' gradient from all N tokens, so neither is partial */
    m->off_embed = moe_params_add(pt, "embedding", 2, V, H, 0, MOE_INIT_NORMAL, std, 1);
    SHARD_TP(0);
    for (int l = 0; l < c->num_layers; l++) {
        size_t *o = m->off[l];
        for (int s = 0; s < MOE_W_COUNT; s++)
            o[s] = MOE_NO_WEIGHT;
#define ADD(slot, suffix, nd, a, b, cc, init, sd, decay)                                \
    do {                                                                              \
        snprintf(name, sizeof name, "layers.%d.%s", l, suffix);                       \
        o[slot] = moe_params_add(pt, name, nd, a, b, cc, init, sd, decay);            \
    } while (0)
        ADD(MOE_W_LN1, "attn.norm", 1, H, 0, 0, MOE_INIT_ONES, 0, 0);
        PARTIAL_TP(sp);
        /* rows are head-major (row h·D + d), so a split of dim 0 gives whole heads */
        ADD(MOE_W_Q, "attn.wq", 2, Hq * D, H, 0, MOE_INIT_NORMAL, std, 1);
        SHARD_TP(0);
        ADD(MOE_W_K, "attn.wk", 2, Hkv * D, H, 0, MOE_INIT_NORMAL, std, 1);
        SHARD_TP(0);
        ADD(MOE_W_V, "attn.wv", 2, Hkv * D, H, 0, MOE_INIT_NORMAL, std, 1);
        SHARD_TP(0);
        ADD(MOE_W_O, "attn.wo", 2, H, Hq * D, 0, MOE_INIT_NORMAL, out_std, 1);
        SHARD_TP(1);
        if (c->qk_layernorm) {
            ADD(MOE_W_QNORM, "attn.q_norm", 1, D, 0, 0, MOE_INIT_ONES, 0, 0);
            PARTIAL_TP(tps > 1);
            ADD(MOE_W_KNORM, "attn.k_norm", 1, D, 0, 0, MOE_INIT_ONES, 0, 0);
            PARTIAL_TP(tps > 1);
        }
        ADD(MOE_W_LN2, "ffn.norm", 1, H, 0, 0, MOE_INIT_ONES, 0, 0);
        PARTIAL_TP(sp);
        if (c->is_moe_layer[l]) {
            const int Fs = c->moe_shared_expert_intermediate_size;
            /* MoE layers run on each rank's sequence shard (moe/layer.h): the router is
             * replicated and each rank's gradient is that of its tokens; the shared expert
             * is tensor-parallel as a dense FFN is (fc1 seen as [2, Fs, H]) */
            ADD(MOE_W_ROUTER, "moe.router", 2, E, H, 0, MOE_INIT_NORMAL, std, 1);
            PARTIAL_TP(tps > 1);
            if (Fs > 0) {
                ADD(MOE_W_SHARED_FC1, "moe.shared.fc1", 3, 2, Fs, H, MOE_INIT_NORMAL, std, 1);
                SHARD_TP(1);
                ADD(MOE_W_SHARED_FC2, "moe.shared.fc2", 2, H, Fs, 0, MOE_INIT_NORMAL, out_std, 1);
                SHARD_TP(1);
            }
        } else {
            const int F = c->ffn_hidden_size;
            /* fc1 is [2F, H], gate rows then up rows, seen as [2, F, H]: split along F, each
             * rank holds its gate rows and its up rows, again gate first ([2, F/TP, H]), which
             * is what the SwiGLU op expects of an intermediate width F/TP */
            ADD(MOE_W_FC1, "mlp.fc1", 3, 2, F, H, MOE_INIT_NORMAL, std, 1);
            SHARD_TP(1);
            ADD(MOE_W_FC2, "mlp.fc2", 2, H, F, 0, MOE_INIT_NORMAL, out_std, 1);
            SHARD_TP(1);
        }
    }
    m->off_final_norm = moe_params_add(pt, "final_norm", 1, H, 0, 0, MOE_INIT_ONES, 0, 0);
    PARTIAL_TP(sp);
    m->off_lm_head = moe_params_add(pt, "lm_head", 2, V, H, 0, MOE_INIT_NORMAL, std, 1);
    SHARD_TP(0);
    /* The routed experts last: every replicated (dense) tensor is then one contiguous block
     * and every expert slice another, so each gradient sync and norm is one call per block
     * instead of one per tensor. Each rank holds its EP shard of the experts (whole experts,
     * dim 0), which moe_params_init fills with that slice of the full tensor's values.
     * Expert tensor parallelism (moe/expert_tp.h) splits each of those experts again, as TP
     * splits a dense FFN: fc1 is [E, 2F, H] (per expert gate rows, then up rows) seen as
     * [2E, F, H] (the same elements in the same order), so that ETP splits F and each rank
     * holds F/ETP gate rows and the matching F/ETP up rows (column-parallel); fc2 [E, H, F] is
     * split along F (row-parallel). */
    const int ep_rank = m->ep && m->ep->comm ? m->ep->rank : 0;
    const int ep_size = m->ep && m->ep->comm ? m->ep->size : 1;
    const int etps = m->etp.size, etpr = m->etp.rank;
    for (int l = 0; l < c->num_layers; l++) {
        if (!c->is_moe_layer[l])
            continue;
        size_t *o = m->off[l];
        const int F = c->moe_ffn_hidden_size;
        ADD(MOE_W_FC1, "moe.experts.fc1", 3, 2 * E, F, H, MOE_INIT_NORMAL, std, 1);
        moe_params_shard(pt, MOE_GROUP_EP, 0, ep_rank, ep_size);
        if (etps > 1)
            moe_params_shard(pt, MOE_GROUP_ETP, 1, etpr, etps);
        ADD(MOE_W_FC2, "moe.experts.fc2", 3, E, H, F, MOE_INIT_NORMAL, out_std, 1);
        moe_params_shard(pt, MOE_GROUP_EP, 0, ep_rank, ep_size);
        if (etps > 1)
            moe_params_shard(pt, MOE_GROUP_ETP, 2, etpr, etps);
    }
#undef ADD
#undef SHARD_TP
#undef PARTIAL_TP
}

/* layer l's weight in slot s: the compute copy the ops read */
static const void *P(const moe_model *m, int l, moe_layer_weight s) {
    return m->off[l][s] == MOE_NO_WEIGHT ? NULL : MOE_ACT(m->be, m->wact, m->off[l][s]);
}
/* a global weight's compute copy */
static const void *PG(const moe_model *m, size_t off) { return MOE_ACT(m->be, m->wact, off); }
static moe_real *G(const moe_model *m, int l, moe_layer_weight s) {
    return m->off[l][s] == MOE_NO_WEIGHT ? NULL : m->grads + m->off[l][s];
}

/* The fused permutation's halves (--moe-permute-fusion turns both on): environment switch
 * @p name ("MOE_FUSED_GATHER", "MOE_FUSED_SCATTER") = 0 turns one off, so one benchmark can
 * time each half alone, and a half found wrong on a GPU can be switched off without the
 * other. Read at every use (cheap, and tests may set it between models). */
static int fusion_half(const char *name) {
    const char *e = getenv(name);
    if (!e || !*e || !strcmp(e, "1"))
        return 1;
    if (!strcmp(e, "0"))
        return 0;
    fprintf(stderr, "moe.c: %s=%s: use 0 (that half of --moe-permute-fusion off) or 1 (on, the "
                    "default)\n", name, e);
    exit(1);
}

static moe_layer_dims moe_dims(const moe_model *m, int N, int T) {
    const moe_config *c = &m->cfg;
    moe_layer_dims d;
    d.N = N;
    d.T = T;
    d.H = c->hidden_size;
    d.E = c->num_experts;
    d.k = c->moe_router_topk;
    d.F = c->moe_ffn_hidden_size / m->etp.size; /* this rank's part of each expert */
    d.Fs = c->moe_shared_expert_intermediate_size;
    d.router = moe_router_params_from_config(c);
    d.lb_type = c->lb_type;
    d.aux_coeff = c->moe_aux_loss_coeff;
    d.z_coeff = c->moe_z_loss_coeff;
    d.ep = m->ep && m->ep->comm ? m->ep : NULL;
    d.capacity_factor = c->moe_expert_capacity_factor;
    d.drop_policy = c->drop_policy;
    d.pad_to_capacity = c->moe_pad_expert_input_to_capacity;
    d.experts = moe_expert_impl_from_config(c, m->be);
    /* (validated: one rank, dropless, our kernel; an EP group, even of one rank, sends
     * through its dispatcher, which has no fused path) */
    const int fused = c->moe_permute_fusion && !d.ep && m->etp.size == 1;
    d.permute_fusion = fused && fusion_half("MOE_FUSED_GATHER");
    d.permute_scatter = fused && fusion_half("MOE_FUSED_SCATTER");
    d.tp = m->tp.size > 1 ? &m->tp : NULL;
    d.shards = m->cp.attn.cp > 1 ? &m->cp.shards : NULL; /* router statistics over TP x CP */
    d.step_flags = m->step_flags;
    d.budget_rows = m->moe_budget_rows;
    d.etp = m->etp.size > 1 ? &m->etp : NULL;
    d.graphs = m->graphs;
    d.layer = -1; /* the forward and backward set it */
    d.lowp = m->lowp;
    return d;
}

/* The dims the shared FFN workspace is sized for: the MoE layers' and the dense ones'. */
static moe_layer_dims ws_dims(const moe_model *m, int N, int T, int max_ffn) {
    moe_layer_dims d = moe_dims(m, N, T);
    if (m->cfg.num_experts == 0) {
        d.E = 1;
        d.k = 1;
        d.F = 0;
    }
    if (d.Fs < max_ffn)
        d.Fs = max_ffn;
    return d;
}

/* this rank's attention: its Hq/TP query heads and Hkv/TP key/value heads, on every token;
 * layer @p l's sites under delayed scaling */
static moe_attention_dims attn_dims(const moe_model *m, int B, int T, int l) {
    moe_attention_dims d = moe_attention_dims_from_config(&m->cfg, B, T);
    d.Hq /= m->tp.size;
    d.Hkv /= m->tp.size;
    d.cp = m->cp.attn.cp > 1 ? &m->cp.attn : NULL; /* T is then this rank's T/CP */
    d.lowp = m->lowp;
    d.lowp_site = moe_lowp_site(m->lowp, l, MOE_LOWP_ATTN, 0);
    return d;
}

/* the intermediate width of this rank's dense FFNs */
static int dense_ffn(const moe_model *m) { return m->cfg.ffn_hidden_size / m->tp.size; }

/* where a dense linear's weight slot @p s of layer @p l keeps its FP8 copy in m->fp8d (which
 * must exist): the layer's block of MOE_FP8_DENSE_SLOTS, wq, wk, wv, wo, then fc1, fc2 (the
 * dense FFN's, or the shared expert's) */
static moe_fp8_weight *fp8_dense_at(const moe_model *m, int l, int s) {
    int i;
    switch (s) {
    case MOE_W_Q: i = 0; break;
    case MOE_W_K: i = 1; break;
    case MOE_W_V: i = 2; break;
    case MOE_W_O: i = 3; break;
    case MOE_W_FC1: case MOE_W_SHARED_FC1: i = 4; break;
    default: i = 5; /* MOE_W_FC2, MOE_W_SHARED_FC2 */
    }
    return &m->fp8d[(size_t)MOE_FP8_DENSE_SLOTS * l + (size_t)i];
}

/* layer @p l's FP8 dense copies (chapter 05's native dense path): wq, wk, wv, wo, then the
 * FFN's fc1, fc2 (MOE_FP8_DENSE_SLOTS); NULL when emulated */
static const moe_fp8_weight *fp8_dense(const moe_model *m, int l) {
    return m->fp8d ? fp8_dense_at(m, l, MOE_W_Q) : NULL;
}

/* ... its FFN's fc1 and fc2 (the dense FFN's, or the shared expert's) */
static const moe_fp8_weight *fp8_ffn(const moe_model *m, int l) {
    return m->fp8d ? fp8_dense_at(m, l, MOE_W_FC1) : NULL;
}

static moe_attention_weights attn_weights(const moe_model *m, int l) {
    moe_attention_weights w = {P(m, l, MOE_W_Q), P(m, l, MOE_W_K),     P(m, l, MOE_W_V),
                               P(m, l, MOE_W_O), P(m, l, MOE_W_QNORM), P(m, l, MOE_W_KNORM),
                               fp8_dense(m, l)};
    return w;
}

static moe_attention_grads attn_grads(const moe_model *m, int l) {
    moe_attention_grads g = {G(m, l, MOE_W_Q), G(m, l, MOE_W_K),     G(m, l, MOE_W_V),
                             G(m, l, MOE_W_O), G(m, l, MOE_W_QNORM), G(m, l, MOE_W_KNORM)};
    return g;
}

static moe_layer_weights moe_weights(const moe_model *m, int l) {
    moe_layer_weights w = {P(m, l, MOE_W_ROUTER), P(m, l, MOE_W_FC1), P(m, l, MOE_W_FC2),
                         P(m, l, MOE_W_SHARED_FC1), P(m, l, MOE_W_SHARED_FC2),
                         m->fp8w ? &m->fp8w[2 * l] : NULL, m->fp8w ? &m->fp8w[2 * l + 1] : NULL,
                         fp8_ffn(m, l)};
    return w;
}

static moe_layer_grads moe_grads(const moe_model *m, int l) {
    moe_layer_grads g = {G(m, l, MOE_W_ROUTER), G(m, l, MOE_W_FC1), G(m, l, MOE_W_FC2),
                       G(m, l, MOE_W_SHARED_FC1), G(m, l, MOE_W_SHARED_FC2), MOE_DW_ACCUMULATE};
    return g;
}

/* ------------------------------------------------------------------ create */

static void *must(const moe_backend *be, size_t bytes, int *ok) {
    void *p = be->alloc(bytes);
    if (!p)
        *ok = 0;
    return p;
}

/* Whether this model fits, before any allocation: the estimate of memory.h against what the
 * backend has, so a huge but consistent configuration gets a named error, not a crash. It is
 * the per-rank estimate of the grid (moe_memory_estimate_rank(): under the distributed
 * optimizer, the moments of this rank's pieces only), the very one moe-train prints at
 * start-up (moe_model::mem), so a layout that fits only thanks to ZeRO is not refused. Without
 * a grid: one rank of the data-parallel grid, EP from @p ep. */
static moe_status check_memory(const moe_config *c, const moe_backend *be, int B,
                               const moe_ep *ep, const moe_grid *grid, moe_memory_estimate *est,
                               moe_error *err) {
    const int E = ep && ep->comm ? ep->size : 1;
    const moe_grid one = {.world = E, .tp = 1, .cp = 1, .ep = E, .etp = 1, .pp = 1, .dp = 1,
                          .edp = 1};
    moe_status s;
    if (grid) {
        s = moe_memory_estimate_rank(c, B, grid, be->act_size, est, err);
    } else { /* one process runs no distributed optimizer (the trainer's rule) */
        moe_config *plain = malloc(sizeof *plain);
        if (!plain)
            return moe_error_set(err, MOE_ERR_NOMEM, "out of memory creating the model");
        *plain = *c;
        plain->use_distributed_optimizer = 0;
        s = moe_memory_estimate_rank(plain, B, &one, be->act_size, est, err);
        free(plain);
    }
    MOE_TRY(s);
    return moe_memory_check(est, be->memory_bytes ? be->memory_bytes() : 0,
                            be->device == MOE_DEVICE_CUDA ? "free GPU memory" : "host memory",
                            err);
}

static int alloc_fp8_weights(moe_model *m, int moe_rows);
static int alloc_fp8_dense(moe_model *m);

moe_status moe_model_create(moe_model **out, const moe_config *cfg, const moe_backend *be, int B,
                            moe_ep *ep, moe_error *err) {
    return moe_model_create_parallel(out, cfg, be, B, ep, NULL, NULL, NULL, err);
}

moe_status moe_model_create_parallel(moe_model **out, const moe_config *cfg,
                                     const moe_backend *be, int B, moe_ep *ep, const moe_tp *tp,
                                     const moe_model_cp *cp, const moe_grid *grid,
                                     moe_error *err) {
    *out = NULL;
    moe_memory_estimate est;
    MOE_TRY(moe_graph_scope_check(cfg, be, err));
    MOE_TRY(check_memory(cfg, be, B, ep, grid, &est, err));
    moe_model *m = calloc(1, sizeof *m);
    if (!m)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory creating the model");
    m->mem = est;
    m->cfg = *cfg;
    m->be = be;
    m->ep = ep;
    m->tp = tp && tp->comm ? *tp : moe_tp_none();
    if (cp && cp->attn.cp > 1) {
        m->cp = *cp;
    } else {
        memset(&m->cp, 0, sizeof m->cp);
        m->cp.attn.cp = 1;
        m->cp.shards = moe_tp_none();
    }
    /* the ETP group travels with the EP context (dispatch.h) */
    m->etp = ep && ep->etp.comm && ep->etp.size > 1 ? ep->etp : moe_tp_none();
    m->experts_local = cfg->num_experts / (ep && ep->comm ? ep->size : 1);
    {
        moe_lowp lp;
        const moe_status st = moe_lowp_from_config(&lp, cfg, err);
        if (st != MOE_OK) {
            moe_model_free(m);
            return st;
        }
        if (lp.on && !(m->lowp = malloc(sizeof *m->lowp))) {
            moe_model_free(m);
            return moe_error_set(err, MOE_ERR_NOMEM, "out of memory creating the model");
        }
        if (lp.on) {
            *m->lowp = lp;
            moe_log_info("precision: %s: every linear layer's GEMM operands are quantized and "
                         "dequantized (chapter 05)", lp.name);
            /* the native path, decided once before any buffer: the routed experts' saved
             * SwiGLU outputs are sized from it (moe_mlp_act_bytes()); alloc_fp8_weights()
             * makes its FP8 weights */
            m->lowp->native = moe_lowp_native(be, m->lowp) &&
                              moe_expert_impl_from_config(cfg, be) == MOE_EXPERTS_KERNEL;
            /* the dense linears' native path (MOE_FP8_NATIVE_DENSE=1), likewise once:
             * alloc_fp8_dense() makes its FP8 weights */
            m->lowp->native_dense = moe_lowp_native_dense(be, m->lowp);
        }
    }
    layout(m);
    const moe_config *c = &m->cfg;
    /* under CP every buffer holds this rank's T/CP tokens of each sequence */
    const int L = c->num_layers, H = c->hidden_size, V = c->vocab_size,
              T = c->seq_length / m->cp.attn.cp, E = c->num_experts;
    const size_t N = (size_t)B * T, S = be->act_size;
    /* the residual stream and everything outside the TP GEMMs: this rank's rows */
    const size_t Nl = (size_t)moe_tp_local_rows(&m->tp, (int)N);
    m->max_B = B;
    m->max_T = T;
    int ok = 1;
    /* Under the distributed optimizer the fp32 master weights are the optimizer's, 1/DP of
     * them on each rank (dist_optimizer.h): the model holds only the compute copy, whole. */
    m->master_sharded = grid && cfg->use_distributed_optimizer;
    m->params = m->master_sharded ? NULL : must(be, R * m->table.total, &ok);
    m->grads = must(be, R * m->table.total, &ok);
    /* the compute copy of the weights: the master itself when the types agree and it is here */
    m->wact = S == R && m->params && !m->lowp ? (void *)m->params
                                              : must(be, S * m->table.total, &ok);
    m->tokens = must(be, sizeof(int) * N, &ok);
    m->targets = must(be, sizeof(int) * N, &ok);
    m->res = calloc((size_t)L + 1, sizeof *m->res);
    m->acts = calloc((size_t)L, sizeof *m->acts);
    m->layer_aux = calloc((size_t)L, sizeof(double));
    m->layer_z = calloc((size_t)L, sizeof(double));
    if (!m->res || !m->acts || !m->layer_aux || !m->layer_z) {
        moe_model_free(m);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory creating the model");
    }
    for (int l = 0; l <= L; l++)
        m->res[l] = must(be, S * Nl * H, &ok);
    /* before the MoE layers' buffers: the sync-free layers size theirs from the budget */
    m->scalars = must(be, sizeof(moe_step_scalars), &ok);
    /* the flags are a field of the scalars, so one copy brings both back (step_scalars.h) */
    m->step_flags = m->scalars ? &m->scalars->flags : NULL;
    {
        const double nk = (double)Nl * (E > 0 ? c->moe_router_topk : 0);
        const int ep_size = ep && ep->comm ? ep->size : 1;
        m->moe_budget_max = (int)(nk * ep_size < INT_MAX ? nk * ep_size : INT_MAX);
        const double b = ceil(c->moe_expert_rank_capacity_factor * nk);
        m->moe_budget_rows = b < 1 ? 1 : (b < m->moe_budget_max ? (int)b : m->moe_budget_max);
    }
    int max_ffn = 0; /* widest FFN intermediate, for the shared scratch */
    const moe_attention_dims ad = attn_dims(m, B, T, 0);
    for (int l = 0; l < L; l++) {
        moe_block_acts *a = &m->acts[l];
        a->ln1 = must(be, S * Nl * H, &ok);
        a->rstd1 = must(be, R * Nl, &ok);
        if (!moe_attention_acts_alloc(be, &a->attn, &ad))
            ok = 0;
        a->xmid = must(be, S * Nl * H, &ok);
        a->ln2 = must(be, S * Nl * H, &ok);
        a->rstd2 = must(be, R * Nl, &ok);
        if (c->is_moe_layer[l]) { /* on this rank's rows (its sequence shard under TP) */
            moe_layer_dims d = moe_dims(m, (int)Nl, T);
            if (!moe_layer_acts_alloc(be, &a->moe, &d))
                ok = 0;
        } else {
            const int F = dense_ffn(m);
            a->dense_gu = must(be, S * N * 2 * F, &ok);
            a->dense_act = must(be, S * N * F, &ok);
            if (F > max_ffn)
                max_ffn = F;
        }
    }
    /* One workspace serves every FFN: size it for the MoE layers and the dense ones. */
    m->max_ffn = max_ffn;
    {
        moe_layer_dims d = ws_dims(m, (int)N, T, max_ffn);
        if (!moe_layer_workspace_alloc(be, &m->ws, &d))
            ok = 0;
    }
    m->lnf = must(be, S * Nl * H, &ok);
    m->rstdf = must(be, R * Nl, &ok);
    /* with TP the LM head and the cross-entropy run on all N tokens and V/TP ids */
    const size_t Vl = (size_t)V / m->tp.size;
    if (m->tp.size > 1 && !moe_vp_alloc(be, &m->vp, &m->tp, V, (int)N))
        ok = 0;
    m->logits = must(be, S * N * Vl, &ok);
    m->losses = must(be, R * N, &ok);
    m->graphs = moe_graphs_create(be, cfg->graph_scope);
    if (!m->graphs)
        ok = 0;
    m->d_res = must(be, S * Nl * H, &ok);
    m->d_ln = must(be, S * Nl * H, &ok);
    if (!moe_attention_scratch_alloc(be, &m->attn_scratch, &ad))
        ok = 0;
    m->d_logits = must(be, S * N * Vl, &ok);
    if (Nl != N) { /* sequence parallel: the whole-sequence buffers around the TP GEMMs */
        m->tp_x = must(be, S * N * H, &ok);
        m->tp_y = must(be, S * N * H, &ok);
        m->tp_dx = must(be, S * N * H, &ok);
        /* lent to the MoE layers' tensor-parallel shared expert */
        m->ws.tp_x = m->tp_x;
        m->ws.tp_y = m->tp_y;
        m->ws.tp_dx = m->tp_dx;
    }
    /* chapter 05: a per-tensor amax over the sync-free layer's static budget of rows would
     * include the rows past this step's count, which hold an earlier step's tokens */
    int lowp_budget_refused = 0;
    if (m->lowp) { /* chapter 05: the QDQ buffers, for the largest GEMM operand or weight */
        const moe_config *mc = &m->cfg;
        size_t rows = 0;
        for (int l = 0; l < L; l++)
            if (mc->is_moe_layer[l]) {
                moe_layer_dims d = moe_dims(m, (int)Nl, T);
                if (moe_layer_sync_free(&d) &&
                    (m->lowp->spec[MOE_LOWP_ACTIVATION].recipe == MOE_QUANT_TENSORWISE ||
                     m->lowp->spec[MOE_LOWP_ACTIVATION].recipe == MOE_QUANT_NVFP4))
                    lowp_budget_refused = 1;
                /* the budget may grow up to moe_budget_max after an overflow */
                size_t P = (size_t)moe_layer_permuted_rows(&d);
                P = P > (size_t)m->moe_budget_max ? P : (size_t)m->moe_budget_max;
                rows = P > rows ? P : rows;
            }
        if (!moe_lowp_alloc(be, m->lowp, moe_lowp_cap(mc, N, rows)) ||
            !moe_lowp_alloc_delayed(be, m->lowp, L, E > 0 ? m->experts_local : 0))
            ok = 0;
        if (ok && (!alloc_fp8_weights(m, (int)rows) || !alloc_fp8_dense(m)))
            ok = 0;
    }
    if (E > 0) {
        m->expert_bias = must(be, sizeof(float) * (size_t)L * E, &ok);
        m->load_counts = must(be, sizeof(long long) * (size_t)L * E, &ok);
    }
    if (lowp_budget_refused) {
        const int fp4 = m->cfg.fp4_format[0] && strcmp(m->cfg.fp4_format, "none");
        moe_model_free(m); /* (m is gone: the message uses only fp4) */
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "%s with the sync-free MoE layer (our grouped kernel, --moe-expert-"
                             "backend grouped or auto on a GPU): its permuted buffers have a "
                             "static budget of rows, and a per-tensor amax would include the rows "
                             "past this step's tokens; use --fp8-recipe blockwise or mxfp8 (per-"
                             "block scales), or --moe-expert-backend cublas-grouped or loop",
                             fp4 ? "--fp4-recipe nvfp4" : "--fp8-recipe tensorwise");
    }
    if (!ok) {
        size_t np = m->table.total;
        moe_model_free(m);
        return moe_error_set(err, MOE_ERR_NOMEM,
                             "out of %s memory allocating the model (%zu parameters, batch %d x "
                             "%d: about %.3g GB, of which %.3g GB activations); reduce "
                             "--micro-batch-size, --seq-length, or the model (--hidden-size, "
                             "--num-experts, --moe-ffn-hidden-size, --num-layers)",
                             be->device == MOE_DEVICE_CUDA ? "GPU" : "host", np, B, T,
                             est.total_bytes / 1e9, est.act_bytes / 1e9);
    }
    *out = m;
    return MOE_OK;
}

void moe_model_free(moe_model *m) {
    if (!m)
        return;
    const moe_backend *be = m->be;
    const int L = m->cfg.num_layers;
    if (m->wact != (void *)m->params)
        be->free(m->wact);
    for (int i = 0; m->fp8w && i < 2 * L; i++)
        moe_fp8_weight_free(be, &m->fp8w[i]);
    free(m->fp8w);
    for (int i = 0; m->fp8d && i < MOE_FP8_DENSE_SLOTS * L; i++)
        moe_fp8_weight_free(be, &m->fp8d[i]);
    free(m->fp8d);
    moe_lowp_free(be, m->lowp);
    free(m->lowp);
    be->free(m->params);
    be->free(m->grads);
    be->free(m->tokens);
    moe_graphs_free(m->graphs);
    be->free(m->scalars);
    be->free(m->targets);
    if (m->res)
        for (int l = 0; l <= L; l++)
            be->free(m->res[l]);
    if (m->acts)
        for (int l = 0; l < L; l++) {
            moe_block_acts *a = &m->acts[l];
            be->free(a->ln1); be->free(a->rstd1);
            moe_attention_acts_free(be, &a->attn);
            be->free(a->xmid); be->free(a->ln2); be->free(a->rstd2);
            be->free(a->dense_gu); be->free(a->dense_act);
            moe_layer_acts_free(be, &a->moe); /* zeroed (dense layer) or partial: fine */
        }
    moe_layer_workspace_free(be, &m->ws); /* also when its allocation failed half-way */
    be->free(m->lnf); be->free(m->rstdf); be->free(m->logits); be->free(m->losses);
    be->free(m->d_res); be->free(m->d_ln); be->free(m->d_logits);
    be->free(m->tp_x); be->free(m->tp_y); be->free(m->tp_dx);
    moe_vp_free(m->vp.V ? be : NULL, &m->vp);
    moe_attention_scratch_free(be, &m->attn_scratch);
    be->free(m->expert_bias);
    be->free(m->load_counts);
    free(m->res);
    free(m->acts);
    free(m->layer_aux);
    free(m->layer_z);
    moe_params_free(&m->table);
    free(m);
}

void moe_model_init(moe_model *m, uint64_t seed) {
    moe_real *host = malloc(R * m->table.total);
    MOE_CHECK_ALLOC(host, R * m->table.total, "the host copy of the weights for their initialisation");
    moe_params_init(&m->table, host, seed);
    moe_model_set_weights(m, host);
    free(host);
    m->be->zero(m->grads, R * m->table.total);
    if (m->expert_bias) {
        size_t n = (size_t)m->cfg.num_layers * m->cfg.num_experts;
        m->be->zero(m->expert_bias, sizeof(float) * n);
        m->be->zero(m->load_counts, sizeof(long long) * n);
    }
}

void moe_model_set_weights(moe_model *m, const moe_real *host) {
    if (!m->params) { /* the master is the optimizer's: the compute copy straight from host */
        m->be->write_act(m->wact, host, m->table.total);
        return;
    }
    m->be->from_host(m->params, host, R * m->table.total);
    moe_model_sync_weights(m);
}

/* The tensor of the table that starts at @p off. */
static const moe_tensor *tensor_at(const moe_model *m, size_t off) {
    for (int i = 0; i < m->table.n; i++)
        if (m->table.t[i].offset == off)
            return &m->table.t[i];
    return NULL;
}

/* Chapter 05's native path (lowp.h): where moe_lowp_native() allows it and the experts run
 * our grouped kernel, the FP8 codes of every MoE layer's fc1 [E][2F, H] and fc2 [E][H, F]
 * (this rank's experts and columns, as the tensors hold them). 0 when out of memory. */
static int alloc_fp8_weights(moe_model *m, int moe_rows) {
    const moe_config *c = &m->cfg;
    if (!m->lowp->native) /* (decided at the model's creation) */
        return 1;
    const int L = c->num_layers;
    if (!(m->fp8w = calloc((size_t)2 * L, sizeof *m->fp8w)))
        return 0;
    for (int l = 0; l < L; l++)
        for (int i = 0; i < 2 && c->is_moe_layer[l]; i++) {
            const moe_tensor *t = tensor_at(m, m->off[l][i ? MOE_W_FC2 : MOE_W_FC1]);
            MOE_ASSERT(t && t->ndim == 3);
            /* fc1 [2E, F, H] holds expert e's gate and up rows as [2F, H]; fc2 [E, H, F] */
            const int G = i ? t->shape[0] : t->shape[0] / 2, I = t->shape[2];
            if (!moe_fp8_weight_alloc(m->be, &m->fp8w[2 * l + i], G,
                                      (int)(t->numel / (size_t)G / (size_t)I), I))
                return 0;
        }
    if (m->lowp->fp8_wgrad) { /* the FP8 wgrad's token-wise copies (lib/fp8_wgrad.h) */
        int ch = 0;
        for (int i = 0; i < 2 * L; i++)
            if (m->fp8w[i].q && m->fp8w[i].O + m->fp8w[i].I > ch)
                ch = m->fp8w[i].O + m->fp8w[i].I;
        /* under ETP the experts run on the rows of the whole ETP group (expert_tp.h) */
        const int etp = c->expert_tensor_parallel_size > 1 ? c->expert_tensor_parallel_size : 1;
        if (!moe_lowp_alloc_fp8_wgrad(m->be, m->lowp, moe_rows * etp, m->experts_local, ch))
            return 0;
    }
    moe_log_info("precision: the routed experts' forward and dgrad GEMMs run natively in FP8 "
                 "(our FP8 grouped kernel); their wgrad %s, the other linear layers emulated; "
                 "their SwiGLU output kept for the backward %s",
                 m->lowp->fp8_wgrad ? "too (token-wise operands)"
                                     : "in bf16 on QDQ'd operands (MOE_FP8_WGRAD=0)",
                 moe_mlp_saved_form(m->be, m->lowp) == MOE_MLP_SAVED_FP8_TOKEN
                     ? "as the FP8 wgrad's token-wise copy (codes + scales, written by the "
                       "tiled fused forward)"
                 : moe_mlp_saved_form(m->be, m->lowp) == MOE_MLP_SAVED_FP8_ROW
                     ? "as FP8 codes + 1x128 scales (fused passes)"
                 : m->lowp->fp8_wgrad && m->lowp->fp8_fused
                         ? "in bf16, written by the fused passes with fc2's codes (the FP8 "
                           "wgrad reads it; MOE_FP8_SAVE_T=0)"
                     : m->lowp->fp8_wgrad ? "in bf16 (the FP8 wgrad reads it; MOE_FP8_FUSED=0)"
                                          : "in bf16 (MOE_FP8_FUSED=0)");
    return 1;
}

/* Chapter 05's native FP8 dense linears (lowp.h, MOE_FP8_NATIVE_DENSE=1, where
 * moe_lowp_native_dense() holds): the FP8 codes of every layer's attention projections and
 * of its dense FFN or shared expert (MOE_FP8_DENSE_SLOTS; this rank's shards, as the tensors
 * hold them). 0 when out of memory. */
static int alloc_fp8_dense(moe_model *m) {
    const moe_config *c = &m->cfg;
    if (!m->lowp->native_dense) /* (decided at the model's creation) */
        return 1;
    static const int slots[] = {MOE_W_Q,   MOE_W_K,   MOE_W_V,          MOE_W_O,
                                MOE_W_FC1, MOE_W_FC2, MOE_W_SHARED_FC1, MOE_W_SHARED_FC2};
    const int L = c->num_layers;
    if (!(m->fp8d = calloc((size_t)MOE_FP8_DENSE_SLOTS * L, sizeof *m->fp8d)))
        return 0;
    for (int l = 0; l < L; l++)
        for (size_t i = 0; i < sizeof slots / sizeof slots[0]; i++) {
            const int s = slots[i];
            /* the routed experts (a MoE layer's fc1, fc2) are fp8w's; no shared expert */
            if ((c->is_moe_layer[l] && (s == MOE_W_FC1 || s == MOE_W_FC2)) ||
                m->off[l][s] == MOE_NO_WEIGHT)
                continue;
            const moe_tensor *t = tensor_at(m, m->off[l][s]);
            MOE_ASSERT(t && t->ndim >= 2);
            const int I = t->shape[t->ndim - 1];
            if (!moe_fp8_weight_alloc(m->be, fp8_dense_at(m, l, s), 1,
                                      (int)(t->numel / (size_t)I), I))
                return 0;
        }
    moe_log_info("precision: the attention projections, dense FFNs and shared experts run their "
                 "forward and dgrad GEMMs natively in FP8 (cuBLASLt blockwise, "
                 "MOE_FP8_NATIVE_DENSE=1), their wgrad in bf16 on QDQ'd operands");
    return 1;
}

/* Chapter 05: QDQ of every linear layer's matrix in the compute copy, each routed expert's
 * on its own (lowp.h); on the native path the routed experts' FP8 codes instead. Not the
 * router, the norms, the embedding or the LM head. Under delayed scaling each matrix at its
 * linear layer's weight site: @p record 1 records their amaxes (once per optimizer step),
 * 0 replays the scales last recorded (after a checkpoint's load). */
static void lowp_quantize_weights(moe_model *m, int record) {
    static const int slots[] = {MOE_W_Q,   MOE_W_K,   MOE_W_V,          MOE_W_O,
                                MOE_W_FC1, MOE_W_FC2, MOE_W_SHARED_FC1, MOE_W_SHARED_FC2};
    for (int l = 0; l < m->cfg.num_layers; l++) {
        /* each weight's linear layer in the site table (lowp.h), in the order of slots[] */
        const int at = moe_lowp_site(m->lowp, l, MOE_LOWP_ATTN, 0),
                  ffn = moe_lowp_site(m->lowp, l,
                                      m->cfg.is_moe_layer[l] ? MOE_LOWP_EXPERTS : MOE_LOWP_DENSE,
                                      0),
                  sh = moe_lowp_site(m->lowp, l, MOE_LOWP_SHARED, 0);
        const int site[] = {at, at + 1, at + 2, at + 3, ffn, ffn + 1, sh, sh + 1};
        for (size_t i = 0; i < sizeof slots / sizeof slots[0]; i++) {
            const int s = slots[i];
            if (m->off[l][s] == MOE_NO_WEIGHT)
                continue;
            const moe_tensor *t = tensor_at(m, m->off[l][s]);
            MOE_ASSERT(t);
            const int cols = t->shape[t->ndim - 1];
            const int routed = m->cfg.is_moe_layer[l] && (s == MOE_W_FC1 || s == MOE_W_FC2);
            int groups = 1; /* routed experts: fc1 [2E, F, H], fc2 [E, H, F] on this rank */
            if (routed)
                groups = s == MOE_W_FC1 ? t->shape[0] / 2 : t->shape[0];
            const int rows = (int)(t->numel / (size_t)groups / (size_t)cols);
            void *w = MOE_ACT(m->be, m->wact, t->offset);
            if (!routed) { /* a dense linear, and its FP8 copy on the native dense path */
                moe_fp8_weight *fd = m->fp8d ? fp8_dense_at(m, l, s) : NULL;
                moe_lowp_quantize_dense(m->be, m->lowp, fd, w, rows, cols, site[i], record);
                continue;
            }
            moe_fp8_weight *fw = NULL; /* the routed experts' FP8 codes (native path) */
            if (m->fp8w)
                fw = &m->fp8w[2 * l + (s == MOE_W_FC2)];
            moe_lowp_quantize_experts(m->be, m->lowp, fw, w, groups, rows, cols, site[i],
                                      record);
        }
    }
}

void moe_model_sync_weights(moe_model *m) {
    if (m->params) /* else the distributed optimizer refreshes it (moe_zero_gather_weights) */
        m->be->cast_to_act(m->wact, m->params, m->table.total);
    moe_model_weights_written(m);
}

void moe_model_weights_written(moe_model *m) {
    if (m->lowp && m->params) /* (lowp.h refuses the distributed optimizer) */
        lowp_quantize_weights(m, 1);
}

void moe_model_lowp_replay_weights(moe_model *m) {
    if (!m->lowp || !m->params)
        return;
    m->be->cast_to_act(m->wact, m->params, m->table.total);
    lowp_quantize_weights(m, 0);
}

size_t moe_model_num_params(const moe_model *m) { return m->table.total; }

size_t moe_model_num_active_params(const moe_model *m) {
    const moe_config *c = &m->cfg;
    size_t active = m->table.total;
    for (int l = 0; l < c->num_layers; l++)
        if (c->is_moe_layer[l]) {
            /* of the experts' weights (this rank's E/EP of them), a token uses k */
            size_t per_expert = (size_t)3 * c->moe_ffn_hidden_size * c->hidden_size;
            active = active + (size_t)(c->num_experts - m->experts_local) * per_expert -
                     (size_t)(c->num_experts - c->moe_router_topk) * per_expert;
        }
    return active;
}

double moe_model_flops_per_token(const moe_model *m, int T) {
    const moe_config *c = &m->cfg;
    const double H = c->hidden_size, QD = (double)c->num_attention_heads * c->head_dim,
                 KD = (double)c->num_query_groups * c->head_dim;
    double weights = (double)c->vocab_size * H; /* LM head */
    for (int l = 0; l < c->num_layers; l++) {
        weights += H * QD + 2 * H * KD + QD * H;
        if (c->is_moe_layer[l])
            weights += (double)c->num_experts * H +
                       (double)c->moe_router_topk * 3 * c->moe_ffn_hidden_size * H +
                       3.0 * c->moe_shared_expert_intermediate_size * H;
        else
            weights += 3.0 * c->ffn_hidden_size * H;
    }
    return 6 * weights + 6.0 * c->num_layers * T * QD;
}

/* ------------------------------------------------------- the attention blocks, graphed */

/* One layer's attention block, forward or backward, as a region for moe_graph_run() (graph.h:
 * eager under --cuda-graph-scope none, else captured once per (layer, B, T) and replayed).
 * Every pointer it passes is fixed for the layer and the shape, so a replay is the same
 * work on the same buffers. */
typedef struct attn_region {
    moe_model *m;
    int l;
    void *out;                       /* forward: out; backward: dx */
    const void *x, *dout;            /* the block's input; backward: the output gradient */
    const moe_attention_weights *w;
    const moe_attention_grads *g;
    const moe_attention_dims *d;
} attn_region;

static void attn_forward_region(void *p) {
    attn_region *r = p;
    moe_attention_forward(r->m->be, r->out, r->x, r->w, r->d, &r->m->acts[r->l].attn);
}

static void attn_backward_region(void *p) {
    attn_region *r = p;
    moe_attention_backward(r->m->be, r->out, r->g, r->dout, r->x, r->w, r->d,
                           &r->m->acts[r->l].attn, &r->m->attn_scratch);
}

/* The block as its own region, or inline inside the layer's region (scope layer and up) */
static void attention_region_run(moe_model *m, attn_region *r, moe_graph_site site,
                                 void (*fn)(void *)) {
    if (moe_graphs_scope(m->graphs) >= MOE_GRAPH_LAYER) {
        fn(r);
        return;
    }
    moe_graph_key k = {site, r->l, r->d->B, r->d->T, 0, 0.0};
    moe_graph_run(m->graphs, k, fn, r);
}

static void attention_forward(moe_model *m, int l, void *out, const void *x,
                              const moe_attention_weights *w, const moe_attention_dims *d) {
    attn_region r = {m, l, out, x, NULL, w, NULL, d};
    attention_region_run(m, &r, MOE_GRAPH_SITE_ATTN_FWD, attn_forward_region);
}

static void attention_backward(moe_model *m, int l, void *dx, const moe_attention_grads *g,
                               const void *dout, const void *x, const moe_attention_weights *w,
                               const moe_attention_dims *d) {
    attn_region r = {m, l, dx, x, dout, w, g, d};
    attention_region_run(m, &r, MOE_GRAPH_SITE_ATTN_BWD, attn_backward_region);
}

/* ----------------------------------------------------------------- forward */

/* One block's tensor-parallel sandwich (tensor_parallel.h): the block reads the whole
 * input (gathered under SP, as is otherwise: f) and leaves partial sums of the whole output,
 * which g all-reduces, or SP reduce-scatters into this rank's rows. `part` is where the
 * block writes: the output itself, or under SP the whole-sequence scratch. */
static void *block_out(const moe_model *m, void *y) { return m->tp_x ? m->tp_y : y; }

/* One transformer layer, forward: res[l+1] from res[l] (the batch's B, T in m). At
 * `--cuda-graph-scope layer` this is the region captured once per (layer, B, T) and replayed
 * (graph.h): every op is device work on buffers fixed for the shape. */
static void layer_forward(moe_model *m, int l) {
    const moe_backend *be = m->be;
    const moe_config *c = &m->cfg;
    const int H = c->hidden_size, B = m->B, T = m->T, N = B * T;
    const int Nl = moe_tp_local_rows(&m->tp, N);
    const moe_tp *tp = &m->tp;
    const moe_attention_dims ad = attn_dims(m, B, T, l);
    double *mb = m->scalars->mb;
    moe_block_acts *a = &m->acts[l];
    const void *x = m->res[l];
    /* attention block: xmid = x + attn(ln1(x)) */
    be->rmsnorm_forward(a->ln1, a->rstd1, x, P(m, l, MOE_W_LN1), Nl, H, c->norm_epsilon);
    moe_attention_weights aw = attn_weights(m, l);
    void *part = block_out(m, a->xmid);
    attention_forward(m, l, part, moe_tp_enter_forward(be, tp, m->tp_x, a->ln1, N, H), &aw, &ad);
    moe_tp_exit_forward(be, tp, a->xmid, part, N, H);
    be->add(a->xmid, x, (size_t)Nl * H);
    /* FFN block */
    be->rmsnorm_forward(a->ln2, a->rstd2, a->xmid, P(m, l, MOE_W_LN2), Nl, H, c->norm_epsilon);
    void *ffn_out = m->res[l + 1];
    if (c->is_moe_layer[l]) { /* on this rank's Nl rows (moe/layer.h) */
        moe_layer_dims d = moe_dims(m, Nl, T);
        d.layer = l;
        moe_layer_weights w = moe_weights(m, l);
        moe_layer_forward(be, ffn_out, a->ln2, &w,
                          c->moe_router_enable_expert_bias
                              ? m->expert_bias + (size_t)l * c->num_experts
                              : NULL,
                          &d, &a->moe, &m->ws);
        be->add_f64(mb + 1, a->moe.loss, 2); /* aux += layer aux, z += layer z */
        be->expert_load_add(m->load_counts + (size_t)l * c->num_experts, a->moe.topk_idx, Nl,
                            c->moe_router_topk, c->num_experts);
    } else {
        part = block_out(m, ffn_out);
        moe_mlp_forward_lowp(be, part, a->dense_gu, a->dense_act,
                             moe_tp_enter_forward(be, tp, m->tp_x, a->ln2, N, H), NULL,
                             P(m, l, MOE_W_FC1), P(m, l, MOE_W_FC2), N, H, dense_ffn(m),
                             m->lowp, moe_lowp_site(m->lowp, l, MOE_LOWP_DENSE, 0),
                             fp8_ffn(m, l));
        moe_tp_exit_forward(be, tp, ffn_out, part, N, H);
    }
    be->add(ffn_out, a->xmid, (size_t)Nl * H);
}

/* A whole layer as a region for moe_graph_run(). */
typedef struct layer_region {
    moe_model *m;
    int l;
    double loss_scale; /* the backward's */
} layer_region;

static void layer_forward_region(void *p) {
    const layer_region *r = p;
    layer_forward(r->m, r->l);
}

static void forward(moe_model *m, const int *tokens, const int *targets, int B, int T,
                    int staged);

void moe_model_forward_dev(moe_model *m, const int *tokens, const int *targets, int B, int T) {
    forward(m, tokens, targets, B, T, 0);
}

void moe_model_forward_staged(moe_model *m, const int *tokens, const int *targets, int B, int T) {
    forward(m, tokens, targets, B, T, 1);
}

/* staged: the batch is in page-locked memory and goes up without a wait */
static void forward(moe_model *m, const int *tokens, const int *targets, int B, int T,
                    int staged) {
    const moe_backend *be = m->be;
    const moe_config *c = &m->cfg;
    MOE_ASSERT(B >= 1 && B <= m->max_B && T >= 1 && T <= m->max_T);
    const int L = c->num_layers, H = c->hidden_size, V = c->vocab_size;
    const int N = B * T;
    /* under sequence parallelism this rank holds Nl = N/TP rows of the residual stream */
    const int Nl = moe_tp_local_rows(&m->tp, N);
    const moe_tp *tp = &m->tp;
    m->B = B;
    m->T = T;
    void (*up)(void *, const void *, size_t) = staged ? be->from_host_async : be->from_host;
    up(m->tokens, tokens, sizeof(int) * N);
    if (targets)
        up(m->targets, targets, sizeof(int) * N);

    if (m->tp.size > 1) { /* vocabulary-parallel lookup, summed over TP (g, or SP's scatter) */
        moe_vp_set_batch(be, &m->vp, tokens, targets, N);
        void *part = block_out(m, m->res[0]);
        moe_vp_embedding_forward(be, &m->vp, part, PG(m, m->off_embed), N, H);
        moe_tp_exit_forward(be, tp, m->res[0], part, N, H);
    } else {
        be->embedding_forward(m->res[0], m->tokens, PG(m, m->off_embed), N, H);
    }
    /* the micro-batch's losses accumulate on the device: mb = {Σ CE, Σ aux, Σ z} */
    double *mb = m->scalars->mb;
    be->zero(mb, 3 * sizeof(double));
    m->last.dropped = 0;
    for (int l = 0; l < L; l++) {
        if (moe_graphs_scope(m->graphs) == MOE_GRAPH_LAYER) {
            layer_region r = {m, l, 0.0};
            const moe_graph_key k = {MOE_GRAPH_SITE_LAYER_FWD, l, B, T, 0, 0.0};
            moe_graph_run(m->graphs, k, layer_forward_region, &r);
        } else {
            layer_forward(m, l);
        }
        if (c->is_moe_layer[l]) /* host counts of the paths that drop (0 when sync-free) */
            m->last.dropped += m->acts[l].moe.dropped;
    }
    if (m->tp.size > 1 && c->num_experts > 0)
        /* each TP rank added its rows' part of the aux and z losses: the sums are the
         * losses of the whole micro-batch, the same on every rank (a device collective) */
        moe_comm_all_reduce_sum(tp->comm, mb + 1, 2, MOE_DTYPE_F64);
    be->rmsnorm_forward(m->lnf, m->rstdf, m->res[L], PG(m, m->off_final_norm), Nl, H,
                        c->norm_epsilon);
    /* LM head: with TP column-parallel over the vocabulary, on every token (vocab_parallel.h) */
    const int vp = m->tp.size > 1;
    be->matmul_forward(m->logits, moe_tp_enter_forward(be, tp, m->tp_x, m->lnf, N, H),
                       PG(m, m->off_lm_head), N, H, vp ? m->vp.Vl : V);
    if (!targets)
        return;
    if (vp) /* every rank gets the losses of all N tokens */
        moe_vp_cross_entropy_forward(be, tp, &m->vp, m->losses, m->logits, N);
    else
        be->cross_entropy_forward(m->losses, m->logits, m->targets, N, V);
    be->sum(mb, m->losses, (size_t)N); /* mb[0] = 0 + Σ: the mean is taken with the step's */
}

double moe_model_forward(moe_model *m, const int *tokens, const int *targets, int B, int T) {
    moe_model_forward_dev(m, tokens, targets, B, T);
    const long long dropped = m->last.dropped;
    memset(&m->last, 0, sizeof m->last);
    m->last.dropped = dropped;
    if (!targets)
        return 0.0;
    const moe_backend *be = m->be;
    const moe_config *c = &m->cfg;
    const int L = c->num_layers;
    double mb[3];
    be->to_host(mb, m->scalars->mb, sizeof mb);
    for (int l = 0; l < L; l++) { /* each layer's own losses (for reference dumps) */
        double v[2] = {0.0, 0.0};
        if (c->is_moe_layer[l])
            be->to_host(v, m->acts[l].moe.loss, sizeof v);
        m->layer_aux[l] = v[0];
        m->layer_z[l] = v[1];
    }
    if (m->tp.size > 1 && c->num_experts > 0) {
        moe_comm_host_all_reduce_sum(m->tp.comm, m->layer_aux, (size_t)L, MOE_DTYPE_F64);
        moe_comm_host_all_reduce_sum(m->tp.comm, m->layer_z, (size_t)L, MOE_DTYPE_F64);
    }
    const int cp = m->cp.attn.cp;
    if (cp > 1) { /* each CP rank holds its tokens' part of every loss: the sums over CP */
        moe_comm *g = m->cp.attn.comm;
        moe_comm_host_all_reduce_sum(g, mb, 3, MOE_DTYPE_F64);
        if (c->num_experts > 0) {
            moe_comm_host_all_reduce_sum(g, m->layer_aux, (size_t)L, MOE_DTYPE_F64);
            moe_comm_host_all_reduce_sum(g, m->layer_z, (size_t)L, MOE_DTYPE_F64);
        }
    }
    /* the arithmetic of moe_step_loss_accumulate() with one micro-batch of B·T·CP tokens */
    m->last.ce = mb[0] / ((double)B * T * cp);
    m->last.aux = mb[1];
    m->last.z = mb[2];
    m->last.total = m->last.ce + mb[1] + mb[2];
    return m->last.total;
}

/* ---------------------------------------------------------------- backward */

/* One transformer layer, backward: d_res holds ∂L/∂res[l+1] and leaves holding ∂L/∂res[l];
 * the layer's weight gradients accumulate. The region captured at scope layer. */
static void layer_backward(moe_model *m, int l, double loss_scale) {
    const moe_backend *be = m->be;
    const moe_config *c = &m->cfg;
    const int H = c->hidden_size, B = m->B, T = m->T, N = B * T;
    const int Nl = moe_tp_local_rows(&m->tp, N);
    const moe_tp *tp = &m->tp;
    const moe_attention_dims ad = attn_dims(m, B, T, l);
    const size_t S = be->act_size;
    void *dx = m->tp_x ? m->tp_dx : m->d_ln; /* where a block's input gradient accumulates */
    moe_block_acts *a = &m->acts[l];
    const void *x = m->res[l];
    /* FFN block: res[l+1] = xmid + ffn(ln2(xmid)) */
    be->zero(m->d_ln, S * (size_t)Nl * H);
    if (c->is_moe_layer[l]) {
        moe_layer_dims d = moe_dims(m, Nl, T);
        d.layer = l;
        moe_layer_weights w = moe_weights(m, l);
        moe_layer_grads g = moe_grads(m, l);
        /* the first micro-batch after zero_grad: our kernel stores the expert weight
         * gradients instead of reduce-adding them into zeros (half the dw traffic);
         * the other backends add anyway, so they keep accumulating */
        if (m->grads_zero && d.experts == MOE_EXPERTS_KERNEL)
            g.expert_dw = MOE_DW_STORE;
        moe_layer_backward(be, m->d_ln, &g, m->d_res, a->ln2, &w, &d, &a->moe, &m->ws,
                           loss_scale);
    } else {
        const void *dy = moe_tp_exit_backward(be, tp, m->tp_y, m->d_res, N, H);
        const void *xin = moe_tp_enter_forward(be, tp, m->tp_x, a->ln2, N, H);
        if (dx != m->d_ln)
            be->zero(dx, S * (size_t)N * H);
        moe_mlp_backward_lowp(be, dx, G(m, l, MOE_W_FC1), G(m, l, MOE_W_FC2), NULL, dy, xin,
                              a->dense_gu, a->dense_act, NULL, P(m, l, MOE_W_FC1),
                              P(m, l, MOE_W_FC2), m->ws.dh, m->ws.dgu, N, H, dense_ffn(m),
                              m->lowp, moe_lowp_site(m->lowp, l, MOE_LOWP_DENSE, 0),
                              fp8_ffn(m, l));
        moe_tp_enter_backward(be, tp, m->d_ln, dx, N, H);
    }
    be->rmsnorm_backward(m->d_res, G(m, l, MOE_W_LN2), m->d_ln, a->xmid, P(m, l, MOE_W_LN2),
                         a->rstd2, Nl, H);
    /* attention block: xmid = x + attn(ln1(x)) */
    moe_attention_weights aw = attn_weights(m, l);
    moe_attention_grads ag = attn_grads(m, l);
    be->zero(m->d_ln, S * (size_t)Nl * H);
    const void *dy = moe_tp_exit_backward(be, tp, m->tp_y, m->d_res, N, H);
    const void *xin = moe_tp_enter_forward(be, tp, m->tp_x, a->ln1, N, H);
    if (dx != m->d_ln)
        be->zero(dx, S * (size_t)N * H);
    attention_backward(m, l, dx, &ag, dy, xin, &aw, &ad);
    moe_tp_enter_backward(be, tp, m->d_ln, dx, N, H);
    be->rmsnorm_backward(m->d_res, G(m, l, MOE_W_LN1), m->d_ln, x, P(m, l, MOE_W_LN1), a->rstd1,
                         Nl, H);
}

static void layer_backward_region(void *p) {
    const layer_region *r = p;
    layer_backward(r->m, r->l, r->loss_scale);
}

void moe_model_backward(moe_model *m, double loss_scale) {
    const moe_backend *be = m->be;
    const moe_config *c = &m->cfg;
    const int L = c->num_layers, H = c->hidden_size, V = c->vocab_size;
    const int B = m->B, T = m->T, N = B * T;
    const int Nl = moe_tp_local_rows(&m->tp, N);
    const moe_tp *tp = &m->tp;

    /* loss → logits → final norm: the mean over the N tokens. With TP this rank's V/TP
     * columns of every token (vocab_parallel.h); the LM head is column-parallel, so its
     * input gradient is a partial sum over TP (f's backward, or SP's reduce-scatter). */
    const size_t S = be->act_size;
    const int vp = m->tp.size > 1, Vl = vp ? m->vp.Vl : V;
    be->zero(m->d_logits, S * (size_t)N * Vl);
    if (vp)
        moe_vp_cross_entropy_backward(be, &m->vp, m->d_logits, m->logits, N);
    else
        be->cross_entropy_backward(m->d_logits, NULL, m->logits, m->targets, N, V);
    /* the cross-entropy is the mean over the micro-batch's B·T·CP tokens, of which this
     * rank holds B·T (the op divides by these): 1/CP more; the router losses' backward is
     * each rank's part already (moe/layer.h) */
    const double ce_scale = loss_scale / m->cp.attn.cp;
    if (ce_scale != 1.0)
        be->scale(m->d_logits, ce_scale, (size_t)N * Vl);
    void *dfull = m->tp_x ? m->tp_dx : m->d_ln; /* [N,H]: the whole input's gradient */
    be->zero(dfull, S * (size_t)N * H);
    be->matmul_backward(dfull, m->grads + m->off_lm_head, m->d_logits,
                        moe_tp_enter_forward(be, tp, m->tp_x, m->lnf, N, H),
                        PG(m, m->off_lm_head), N, H, Vl);
    moe_tp_enter_backward(be, tp, m->d_ln, dfull, N, H);
    be->zero(m->d_res, S * (size_t)Nl * H);
    be->rmsnorm_backward(m->d_res, m->grads + m->off_final_norm, m->d_ln, m->res[L],
                         PG(m, m->off_final_norm), m->rstdf, Nl, H);

    /* d_res holds ∂L/∂res[l+1]; each block adds its branch's gradient into it in place,
     * leaving ∂L/∂res[l] (the residual connection passes the gradient through unchanged).
     * Under SP a block's backward gathers its input again (Megatron does the same instead of
     * keeping the whole-sequence copy from the forward) and the output gradient. */
    for (int l = L - 1; l >= 0; l--) {
        if (moe_graphs_scope(m->graphs) == MOE_GRAPH_LAYER) {
            /* the first micro-batch stores the expert weight gradients, the others add:
             * two different graphs (layer_backward) */
            layer_region r = {m, l, loss_scale};
            const moe_graph_key k = {MOE_GRAPH_SITE_LAYER_BWD, l, B, T, m->grads_zero,
                                     loss_scale};
            moe_graph_run(m->graphs, k, layer_backward_region, &r);
        } else {
            layer_backward(m, l, loss_scale);
        }
    }
    if (vp) { /* this rank's vocabulary rows, from every token's gradient */
        const void *dy = moe_tp_exit_backward(be, tp, m->tp_y, m->d_res, N, H);
        moe_vp_embedding_backward(be, &m->vp, m->grads + m->off_embed, dy,
                                  m->tp_x ? m->tp_dx : m->d_ln, H);
    } else {
        be->embedding_backward(m->grads + m->off_embed, m->d_res, m->tokens, N, V, H);
    }
    m->grads_zero = 0;
}

void moe_model_zero_grad(moe_model *m) {
    m->be->zero(m->grads, R * m->table.total);
    m->grads_zero = 1;
}

void moe_model_update_expert_bias(moe_model *m) {
    const moe_config *c = &m->cfg;
    if (!c->moe_router_enable_expert_bias || c->num_experts == 0)
        return;
    const int E = c->num_experts;
    for (int l = 0; l < c->num_layers; l++)
        if (c->is_moe_layer[l])
            m->be->expert_bias_update(m->expert_bias + (size_t)l * E,
                                      m->load_counts + (size_t)l * E, E,
                                      c->moe_router_bias_update_rate, m->step_flags);
}

void moe_model_read_expert_bias(const moe_model *m, float *host) {
    if (m->expert_bias)
        m->be->to_host(host, m->expert_bias,
                       sizeof(float) * (size_t)m->cfg.num_layers * m->cfg.num_experts);
}

void moe_model_reset_load_counts(moe_model *m) {
    if (m->load_counts)
        m->be->zero(m->load_counts,
                    sizeof(long long) * (size_t)m->cfg.num_layers * m->cfg.num_experts);
}

int moe_model_keeps_x_t(const moe_model *m) {
    const moe_config *c = &m->cfg;
    const int Nl = moe_tp_local_rows(&m->tp, m->max_B * m->max_T);
    for (int l = 0; l < c->num_layers; l++)
        if (c->is_moe_layer[l]) { /* (every MoE layer has the same dims but the index) */
            const moe_layer_dims d = moe_dims(m, Nl, m->max_T);
            return moe_layer_keeps_x_t(m->be, &d);
        }
    return 0;
}

int moe_model_may_overflow(const moe_model *m) {
    if (m->moe_budget_rows >= m->moe_budget_max)
        return 0;
    const moe_config *c = &m->cfg;
    const int Nl = moe_tp_local_rows(&m->tp, m->max_B * m->max_T);
    for (int l = 0; l < c->num_layers; l++)
        if (c->is_moe_layer[l]) {
            const moe_layer_dims d = moe_dims(m, Nl, m->max_T);
            if (moe_layer_sync_free(&d))
                return 1;
        }
    return 0;
}

moe_status moe_model_grow_moe_budget(moe_model *m, moe_error *err) {
    const int from = m->moe_budget_rows, most = m->moe_budget_max;
    if (from >= most)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "a step raised a MoE buffer overflow, but the budget of %d permuted "
                             "rows is already all that can be needed (internal error: please "
                             "report it)",
                             from);
    /* doubling: a run that keeps overflowing re-runs at most log2(most / from) steps */
    const int to = from > most / 2 ? most : 2 * from;
    m->moe_budget_rows = to;
    m->moe_budget_overflows++;
    const moe_config *c = &m->cfg;
    const int N = m->max_B * m->max_T, Nl = moe_tp_local_rows(&m->tp, N);
    int ok = 1;
    for (int l = 0; l < c->num_layers; l++)
        if (c->is_moe_layer[l]) {
            const moe_layer_dims d = moe_dims(m, Nl, m->max_T);
            ok = moe_layer_acts_regrow(m->be, &m->acts[l].moe, &d) && ok;
        }
    const moe_layer_dims wd = ws_dims(m, N, m->max_T, m->max_ffn);
    ok = moe_layer_workspace_regrow(m->be, &m->ws, &wd) && ok;
    /* the budget's buffers moved and the budget itself is baked into the captured kernels'
     * arguments: every graph is stale (the re-run warms up and captures again) */
    moe_graphs_reset(m->graphs);
    if (!ok)
        return moe_error_set(err, MOE_ERR_NOMEM,
                             "out of %s memory growing the MoE budget from %d to %d permuted "
                             "rows per layer after an overflow; raise the budget at start-up "
                             "(--moe-expert-rank-capacity-factor) or reduce --micro-batch-size",
                             m->be->device == MOE_DEVICE_CUDA ? "GPU" : "host", from, to);
    moe_log_info("moe: static budget overflow (%lld so far), grew %d -> %d permuted rows per "
                 "MoE layer; the step is re-run eagerly",
                 m->moe_budget_overflows, from, to);
    return MOE_OK;
}
