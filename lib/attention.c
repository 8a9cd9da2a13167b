/* The attention block of a layer: see attention.h. */
#include "attention.h"

#include <string.h>

#include "lowp.h"

#define R sizeof(moe_real)

moe_attention_dims moe_attention_dims_from_config(const moe_config *c, int B, int T) {
    moe_attention_dims d = {.B = B, .T = T, .H = c->hidden_size, .Hq = c->num_attention_heads,
                            .Hkv = c->num_query_groups, .D = c->head_dim,
                            .qk_norm = c->qk_layernorm, .norm_eps = c->norm_epsilon,
                            .rope_base = c->rotary_base, .pos0 = 0, .cp = NULL};
    return d;
}

/* The op's view of the call: the chunk of queries attends to the same chunk of keys. */
static moe_attention_shape op_shape(const moe_attention_dims *d) {
    moe_attention_shape s = {d->B, d->T, d->T, d->Hq, d->Hkv, d->D, d->pos0, d->pos0};
    return s;
}

/* Under CP: the exchange's view of the call, the whole sequence being T·cp tokens. */
static moe_cp_attention cp_call(const moe_attention_dims *d) {
    moe_cp_attention a = *d->cp;
    a.B = d->B;
    a.T = d->T * d->cp->cp;
    a.Hq = d->Hq;
    a.Hkv = d->Hkv;
    a.D = d->D;
    return a;
}

/* The op's workspace, or under CP the exchange's (its buffers serve forward and backward). */
static size_t op_workspace_bytes(const moe_backend *be, const moe_attention_dims *d) {
    if (d->cp) {
        const moe_cp_attention a = cp_call(d);
        return moe_cp_attention_workspace_bytes(&a, be->act_size);
    }
    return be->attention_workspace_bytes(op_shape(d));
}

/* RoPE (forward, or its backward) of n tokens' heads. Under CP the T local tokens of each
 * sequence are two chunks of C, stored chunk-major: chunk w of all B sequences is one
 * contiguous [B, C, heads, D] block, which RoPE takes at that chunk's absolute position
 * (rank r's chunks are r and 2cp−1−r: positions are not contiguous, one call per chunk). */
static void rope(const moe_backend *be, int backward, void *out, const void *in,
                 const moe_attention_dims *d, int heads) {
    void (*op)(void *, const void *, int, int, int, int, int, double) =
        backward ? be->rope_backward : be->rope_forward;
    if (!d->cp) {
        op(out, in, d->B, d->T, heads, d->D, d->pos0, d->rope_base);
        return;
    }
    const int C = d->T / 2;
    const size_t chunk = (size_t)d->B * C * heads * d->D;
    for (int w = 0; w < 2; w++)
        op(MOE_ACT(be, out, w * chunk), MOE_ACT(be, in, w * chunk), d->B, C, heads, d->D,
           moe_cp_chunk(d->cp->cp, d->cp->rank, w) * C, d->rope_base);
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
    const size_t ws = op_workspace_bytes(be, d);
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

/* chapter 05's native FP8 dense linears (lowp.h): projection @p proj's FP8 weight (0..3:
 * Q, K, V, O) when this call of @p rows tokens runs it natively, else NULL (the emulation) */
static const moe_fp8_weight *native_w(const moe_attention_weights *w,
                                      const moe_attention_dims *d, int proj, int rows) {
    return w->fp8 && moe_lowp_dense_fits(d->lowp, &w->fp8[proj], rows) ? &w->fp8[proj] : NULL;
}

void moe_attention_forward(const moe_backend *be, void *out, const void *x,
                           const moe_attention_weights *w, const moe_attention_dims *d,
                           moe_attention_acts *a) {
    const int B = d->B, T = d->T, N = B * T, H = d->H, Hq = d->Hq, Hkv = d->Hkv, D = d->D;
    if (native_w(w, d, 0, N) && native_w(w, d, 1, N) && native_w(w, d, 2, N)) {
        /* chapter 05, native: one quantization of the input serves Q, K and V */
        void *const qkv[3] = {a->q, a->k, a->v};
        const moe_fp8_weight *const fw[3] = {&w->fp8[0], &w->fp8[1], &w->fp8[2]};
        moe_lowp_dense_forward(be, d->lowp, qkv, fw, 3, x, N, H);
    } else {
        /* chapter 05 (or x): one QDQ of the input serves Q, K and V (Q's site) */
        x = moe_lowp_qdq(be, d->lowp, x, N, H, MOE_LOWP_ACTIVATION, d->lowp_site);
        be->matmul_forward(a->q, x, w->wq, N, H, Hq * D);
        be->matmul_forward(a->k, x, w->wk, N, H, Hkv * D);
        be->matmul_forward(a->v, x, w->wv, N, H, Hkv * D);
    }
    const void *qin = a->q, *kin = a->k;
    if (d->qk_norm) { /* RMSNorm over each head vector (Qwen3): N·heads rows of D */
        be->rmsnorm_forward(a->qn, a->q_rstd, a->q, w->q_norm, N * Hq, D, d->norm_eps);
        be->rmsnorm_forward(a->kn, a->k_rstd, a->k, w->k_norm, N * Hkv, D, d->norm_eps);
        qin = a->qn;
        kin = a->kn;
    }
    rope(be, 0, a->qr, qin, d, Hq);
    rope(be, 0, a->kr, kin, d, Hkv);
    if (d->cp) { /* this rank's queries over the whole sequence's keys (context_parallel.h) */
        const moe_cp_attention cp = cp_call(d);
        moe_cp_attention_forward(be, &cp, a->y, a->lse, a->qr, a->kr, a->v, a->op_ws);
    } else {
        be->attention_forward(a->y, a->lse, a->op_ws, a->qr, a->kr, a->v, op_shape(d));
    }
    const moe_fp8_weight *fo = native_w(w, d, 3, N);
    if (fo) {
        moe_lowp_dense_forward(be, d->lowp, &out, &fo, 1, a->y, N, Hq * D);
        return;
    }
    be->matmul_forward(out,
                       moe_lowp_qdq(be, d->lowp, a->y, N, Hq * D, MOE_LOWP_ACTIVATION,
                                    d->lowp_site + 3),
                       w->wo, N, Hq * D, H);
}

/* One projection's backward, under chapter 05's emulated low precision on the quantized
 * output gradient (and the input the caller quantized); as be->matmul_backward otherwise.
 * With @p fw (the native FP8 dense path, lowp.h) the dgrad adds Q(dout)·Q(W) into din in the
 * FP8 GEMM and the wgrad runs in bf16 on Q(dout), as emulated. */
static void proj_backward(const moe_backend *be, const moe_attention_dims *d, int proj, void *din,
                          moe_real *dw, const void *dout, const void *in, const void *w,
                          const moe_fp8_weight *fw, int N, int I, int O) {
    const int site = d->lowp_site + proj;
    if (fw) {
        const void *dq = moe_lowp_dense_dgrad(be, d->lowp, din, 1, fw, dout, N);
        be->matmul_backward(NULL, dw, dq, in, NULL, N, I, O);
        return;
    }
    const void *dq = moe_lowp_qdq(be, d->lowp, dout, N, O, MOE_LOWP_GRADIENT, site);
    if (!moe_lowp_wgrad_rht(d->lowp)) {
        be->matmul_backward(din, dw, dq, in, w, N, I, O);
        return;
    }
    /* NVFP4: @p in is the input itself; the wgrad quantizes it and dout along the tokens
     * with the random Hadamard transform (lowp.h) after the dgrad GEMM */
    be->matmul_backward(din, NULL, dq, NULL, w, N, I, O);
    const int off[2] = {0, N};
    moe_lowp_wgrad(be, d->lowp, dw, dout, in, off, 1, I, O, site);
}

/* the input a projection's backward takes: its saved forward QDQ, or under NVFP4's wgrad
 * transform the input itself (moe_lowp_wgrad() quantizes it) */
static const void *proj_input(const moe_backend *be, const moe_attention_dims *d, const void *x,
                              int N, int I, int linear) {
    return moe_lowp_wgrad_rht(d->lowp) ? x : moe_lowp_qdq_saved(be, d->lowp, x, N, I, linear);
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
    proj_backward(be, d, 3, s->dy, g->wo, dout,
                  proj_input(be, d, a->y, N, Hq * D, d->lowp_site + 3), w->wo,
                  native_w(w, d, 3, N), N, Hq * D, H);
    be->zero(s->dq, S * QD);
    be->zero(s->dk, S * KD);
    be->zero(s->dv, S * KD);
    if (d->cp) { /* the key/value gradients of every rank's queries come home */
        const moe_cp_attention cp = cp_call(d);
        moe_cp_attention_backward(be, &cp, s->dq, s->dk, s->dv, s->dy, a->y, a->lse, a->qr,
                                  a->kr, a->v, a->op_ws);
    } else {
        be->attention_backward(s->dq, s->dk, s->dv, s->dy, a->y, a->lse, a->op_ws, a->qr, a->kr,
                               a->v, op_shape(d));
    }
    be->zero(s->dq2, S * QD);
    be->zero(s->dk2, S * KD);
    rope(be, 1, s->dq2, s->dq, d, Hq);
    rope(be, 1, s->dk2, s->dk, d, Hkv);
    void *dq = s->dq2, *dk = s->dk2;
    if (d->qk_norm) { /* back through QK-norm, into the now free first buffers */
        be->zero(s->dq, S * QD);
        be->zero(s->dk, S * KD);
        be->rmsnorm_backward(s->dq, g->q_norm, s->dq2, a->q, w->q_norm, a->q_rstd, N * Hq, D);
        be->rmsnorm_backward(s->dk, g->k_norm, s->dk2, a->k, w->k_norm, a->k_rstd, N * Hkv, D);
        dq = s->dq;
        dk = s->dk;
    }
    x = proj_input(be, d, x, N, H, d->lowp_site); /* chapter 05 (or x) */
    proj_backward(be, d, 0, dx, g->wq, dq, x, w->wq, native_w(w, d, 0, N), N, H, Hq * D);
    proj_backward(be, d, 1, dx, g->wk, dk, x, w->wk, native_w(w, d, 1, N), N, H, Hkv * D);
    proj_backward(be, d, 2, dx, g->wv, s->dv, x, w->wv, native_w(w, d, 2, N), N, H, Hkv * D);
}
