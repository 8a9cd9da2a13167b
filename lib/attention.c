/* The attention block of a layer: see attention.h. */
#include "attention.h"

#include <string.h>

#define R sizeof(moe_real)

moe_attention_dims moe_attention_dims_from_config(const moe_config *c, int B, int T) {
    moe_attention_dims d = {.B = B, .T = T, .H = c->hidden_size, .Hq = c->num_attention_heads,
                            .Hkv = c->num_query_groups, .D = c->head_dim,
                            .qk_norm = c->qk_layernorm, .norm_eps = c->norm_epsilon,
                            .rope_base = c->rotary_base, .pos0 = 0};
    return d;
}

/* The op's view of the call: the chunk of queries attends to the same chunk of keys. */
static moe_attention_shape op_shape(const moe_attention_dims *d) {
    moe_attention_shape s = {d->B, d->T, d->T, d->Hq, d->Hkv, d->D, d->pos0, d->pos0};
    return s;
}

int moe_attention_acts_alloc(const moe_backend *be, moe_attention_acts *a,
                             const moe_attention_dims *d) {
    const size_t N = (size_t)d->B * d->T, S = be->act_size;
    const size_t QD = N * d->Hq * d->D, KD = N * d->Hkv * d->D;
    memset(a, 0, sizeof *a);
    a->q = be->alloc(S * QD);
    a->k = be->alloc(S * KD);
    a->v = be->alloc(S * KD);
    int ok = a->q && a->k && a->v;
    if (d->qk_norm) {
        a->qn = be->alloc(S * QD);
        a->kn = be->alloc(S * KD);
        a->q_rstd = be->alloc(R * N * d->Hq);
        a->k_rstd = be->alloc(R * N * d->Hkv);
        ok = ok && a->qn && a->kn && a->q_rstd && a->k_rstd;
    }
    a->qr = be->alloc(S * QD);
    a->kr = be->alloc(S * KD);
    a->y = be->alloc(S * QD);
    a->lse = be->alloc(R * N * d->Hq);
    ok = ok && a->qr && a->kr && a->y && a->lse;
    const size_t ws = be->attention_workspace_bytes(op_shape(d));
    if (ws > 0) {
        a->op_ws = be->alloc(ws);
        ok = ok && a->op_ws;
    }
    return ok;
}

void moe_attention_acts_free(const moe_backend *be, moe_attention_acts *a) {
    be->free(a->q); be->free(a->k); be->free(a->v);
    be->free(a->qn); be->free(a->kn); be->free(a->q_rstd); be->free(a->k_rstd);
    be->free(a->qr); be->free(a->kr); be->free(a->y); be->free(a->lse); be->free(a->op_ws);
    memset(a, 0, sizeof *a);
}

int moe_attention_scratch_alloc(const moe_backend *be, moe_attention_scratch *s,
                                const moe_attention_dims *d) {
    const size_t N = (size_t)d->B * d->T, S = be->act_size;
    const size_t QD = N * d->Hq * d->D, KD = N * d->Hkv * d->D;
    s->dy = be->alloc(S * QD);
    s->dq = be->alloc(S * QD);
    s->dk = be->alloc(S * KD);
    s->dv = be->alloc(S * KD);
    s->dq2 = be->alloc(S * QD);
    s->dk2 = be->alloc(S * KD);
    return s->dy && s->dq && s->dk && s->dv && s->dq2 && s->dk2;
}

void moe_attention_scratch_free(const moe_backend *be, moe_attention_scratch *s) {
    be->free(s->dy); be->free(s->dq); be->free(s->dk);
    be->free(s->dv); be->free(s->dq2); be->free(s->dk2);
    memset(s, 0, sizeof *s);
}

void moe_attention_forward(const moe_backend *be, void *out, const void *x,
                           const moe_attention_weights *w, const moe_attention_dims *d,
                           moe_attention_acts *a) {
    const int B = d->B, T = d->T, N = B * T, H = d->H, Hq = d->Hq, Hkv = d->Hkv, D = d->D;
    be->matmul_forward(a->q, x, w->wq, N, H, Hq * D);
    be->matmul_forward(a->k, x, w->wk, N, H, Hkv * D);
    be->matmul_forward(a->v, x, w->wv, N, H, Hkv * D);
    const void *qin = a->q, *kin = a->k;
    if (d->qk_norm) { /* RMSNorm over each head vector (Qwen3): N·heads rows of D */
        be->rmsnorm_forward(a->qn, a->q_rstd, a->q, w->q_norm, N * Hq, D, d->norm_eps);
        be->rmsnorm_forward(a->kn, a->k_rstd, a->k, w->k_norm, N * Hkv, D, d->norm_eps);
        qin = a->qn;
        kin = a->kn;
    }
    be->rope_forward(a->qr, qin, B, T, Hq, D, d->pos0, d->rope_base);
    be->rope_forward(a->kr, kin, B, T, Hkv, D, d->pos0, d->rope_base);
    be->attention_forward(a->y, a->lse, a->op_ws, a->qr, a->kr, a->v, op_shape(d));
    be->matmul_forward(out, a->y, w->wo, N, Hq * D, H);
}

/* The forward in reverse. Every op accumulates into its gradients, so each scratch buffer
 * is zeroed right before the op that fills it. */
void moe_attention_backward(const moe_backend *be, void *dx, const moe_attention_grads *g,
                            const void *dout, const void *x, const moe_attention_weights *w,
                            const moe_attention_dims *d, const moe_attention_acts *a,
                            moe_attention_scratch *s) {
    const int B = d->B, T = d->T, N = B * T, H = d->H, Hq = d->Hq, Hkv = d->Hkv, D = d->D;
    const size_t S = be->act_size, QD = (size_t)N * Hq * D, KD = (size_t)N * Hkv * D;
    be->zero(s->dy, S * QD);
    be->matmul_backward(s->dy, g->wo, dout, a->y, w->wo, N, Hq * D, H);
    be->zero(s->dq, S * QD);
    be->zero(s->dk, S * KD);
    be->zero(s->dv, S * KD);
    be->attention_backward(s->dq, s->dk, s->dv, s->dy, a->y, a->lse, a->op_ws, a->qr, a->kr,
                           a->v, op_shape(d));
    be->zero(s->dq2, S * QD);
    be->zero(s->dk2, S * KD);
    be->rope_backward(s->dq2, s->dq, B, T, Hq, D, d->pos0, d->rope_base);
    be->rope_backward(s->dk2, s->dk, B, T, Hkv, D, d->pos0, d->rope_base);
    void *dq = s->dq2, *dk = s->dk2;
    if (d->qk_norm) { /* back through QK-norm, into the now free first buffers */
        be->zero(s->dq, S * QD);
        be->zero(s->dk, S * KD);
        be->rmsnorm_backward(s->dq, g->q_norm, s->dq2, a->q, w->q_norm, a->q_rstd, N * Hq, D);
        be->rmsnorm_backward(s->dk, g->k_norm, s->dk2, a->k, w->k_norm, a->k_rstd, N * Hkv, D);
        dq = s->dq;
        dk = s->dk;
    }
    be->matmul_backward(dx, g->wq, dq, x, w->wq, N, H, Hq * D);
    be->matmul_backward(dx, g->wk, dk, x, w->wk, N, H, Hkv * D);
    be->matmul_backward(dx, g->wv, s->dv, x, w->wv, N, H, Hkv * D);
}
