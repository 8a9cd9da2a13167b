/* The MoE FFN layer, naive loop over experts: see moe_layer.h. */
#include "moe_layer.h"

#include <stdlib.h>
#include <string.h>

#include "mlp.h"

#define R sizeof(moe_real)
#define A(p, i) MOE_ACT(be, p, i)

static size_t max_rows_f(const moe_moe_dims *d) {
    size_t a = (size_t)d->N * d->k * d->F, b = (size_t)d->N * d->Fs;
    return a > b ? a : b;
}

void moe_moe_acts_alloc(const moe_backend *be, moe_moe_acts *a, const moe_moe_dims *d) {
    const size_t N = d->N, NK = (size_t)d->N * d->k, S = be->act_size;
    memset(a, 0, sizeof *a);
    a->logits = be->alloc(S * N * d->E);
    a->topk_idx = be->alloc(sizeof(int) * NK);
    a->topk_w = be->alloc(R * NK);
    a->perm_src = be->alloc(sizeof(int) * NK);
    a->row_of = be->alloc(sizeof(int) * NK);
    a->wp = be->alloc(R * NK);
    a->xp = be->alloc(S * NK * d->H);
    a->gu = be->alloc(S * NK * 2 * d->F);
    a->act = be->alloc(S * NK * d->F);
    if (d->Fs > 0) {
        a->shared_gu = be->alloc(S * N * 2 * d->Fs);
        a->shared_act = be->alloc(S * N * d->Fs);
    }
    a->expert_offset = calloc((size_t)d->E + 1, sizeof(int));
    a->counts = calloc((size_t)d->E, sizeof(long long));
    MOE_ASSERT(a->logits && a->topk_idx && a->topk_w && a->perm_src && a->row_of && a->wp &&
               a->xp && a->gu && a->act && a->expert_offset && a->counts);
}

void moe_moe_acts_free(const moe_backend *be, moe_moe_acts *a) {
    be->free(a->logits); be->free(a->topk_idx); be->free(a->topk_w); be->free(a->perm_src);
    be->free(a->row_of); be->free(a->wp); be->free(a->xp); be->free(a->gu); be->free(a->act);
    be->free(a->shared_gu); be->free(a->shared_act);
    free(a->expert_offset);
    free(a->counts);
    memset(a, 0, sizeof *a);
}

void moe_moe_workspace_alloc(const moe_backend *be, moe_moe_workspace *w, const moe_moe_dims *d) {
    const size_t N = d->N, NK = (size_t)d->N * d->k, HF = max_rows_f(d), S = be->act_size;
    memset(w, 0, sizeof *w);
    w->yp = be->alloc(S * (NK > N ? NK : N) * d->H);
    w->dyp = be->alloc(S * NK * d->H);
    w->dxp = be->alloc(S * NK * d->H);
    w->dwp = be->alloc(R * NK);
    w->dtopk_w = be->alloc(R * NK);
    w->dlogits = be->alloc(S * N * d->E);
    w->h = be->alloc(S * HF);
    w->dh = be->alloc(S * HF);
    w->dgu = be->alloc(S * 2 * HF);
    MOE_ASSERT(w->yp && w->dyp && w->dxp && w->dwp && w->dtopk_w && w->dlogits && w->h && w->dh &&
               w->dgu);
}

void moe_moe_workspace_free(const moe_backend *be, moe_moe_workspace *w) {
    be->free(w->yp); be->free(w->dyp); be->free(w->dxp); be->free(w->dwp); be->free(w->dtopk_w);
    be->free(w->dlogits); be->free(w->h); be->free(w->dh); be->free(w->dgu);
    memset(w, 0, sizeof *w);
}

/* tokens per aux-loss group: the whole micro-batch, or one sequence */
static int aux_group_len(const moe_moe_dims *d) {
    return d->lb_type == MOE_LB_SEQ_AUX ? d->T : d->N;
}

void moe_moe_forward(const moe_backend *be, void *out, const void *x, const moe_moe_weights *w,
                     const float *expert_bias, const moe_moe_dims *d, moe_moe_acts *a,
                     moe_moe_workspace *ws) {
    const int N = d->N, H = d->H, E = d->E, k = d->k, F = d->F;

    /* 1. route (router math in fp32 / the backend's real type) */
    be->matmul_forward(a->logits, x, w->router, N, H, E);
    be->router_forward(a->topk_idx, a->topk_w, a->logits, expert_bias, &d->router, N);

    /* 2. the router's own losses */
    a->aux_loss = (d->lb_type != MOE_LB_NONE && d->aux_coeff > 0)
                      ? be->aux_loss_forward(a->logits, N, aux_group_len(d), E, k,
                                             d->router.score_fn, d->aux_coeff)
                      : 0.0;
    a->z_loss = d->z_coeff > 0 ? be->z_loss_forward(a->logits, N, E, d->z_coeff) : 0.0;

    /* 3. permute: rows grouped by expert (expert_offset comes back to the host) */
    memset(a->counts, 0, sizeof(long long) * E);
    be->permute_index(a->perm_src, a->row_of, a->expert_offset, a->counts, a->topk_idx, N, k, E);
    be->permute_tokens(a->xp, x, a->perm_src, N * k, k, H);
    be->permute_weights(a->wp, a->topk_w, a->perm_src, N * k);

    /* 4. the naive loop: one SwiGLU MLP per expert, on that expert's rows */
    for (int e = 0; e < E; e++) {
        const size_t off = (size_t)a->expert_offset[e];
        const int rows = a->expert_offset[e + 1] - a->expert_offset[e];
        moe_mlp_forward(be, A(ws->yp, off * H), A(a->gu, off * 2 * F), A(a->act, off * F),
                        A(ws->h, off * F), A(a->xp, off * H), a->wp + off,
                        A(w->fc1, (size_t)e * 2 * F * H), A(w->fc2, (size_t)e * H * F), rows, H,
                        F);
    }

    /* 5. combine: out[n] = Σ_j expert output of (n, j) */
    be->zero(out, be->act_size * (size_t)N * H);
    be->unpermute_sum(out, ws->yp, a->row_of, N, k, H);

    /* 6. shared expert on every token */
    if (d->Fs > 0) {
        moe_mlp_forward(be, ws->yp, a->shared_gu, a->shared_act, NULL, x, NULL, w->shared_fc1,
                        w->shared_fc2, N, H, d->Fs);
        be->add(out, ws->yp, (size_t)N * H);
    }
}

void moe_moe_backward(const moe_backend *be, void *dx, const moe_moe_grads *g, const void *dout,
                      const void *x, const moe_moe_weights *w, const moe_moe_dims *d,
                      const moe_moe_acts *a, moe_moe_workspace *ws, double loss_scale) {
    const int N = d->N, H = d->H, E = d->E, k = d->k, F = d->F;
    const size_t NK = (size_t)N * k;

    /* 5⁻¹. the combine was a sum, so each permuted row receives its token's gradient */
    be->permute_tokens(ws->dyp, dout, a->perm_src, N * k, k, H);
    be->zero(ws->dxp, be->act_size * NK * H);
    be->zero(ws->dwp, R * NK);

    /* 4⁻¹. the expert loop in reverse */
    for (int e = 0; e < E; e++) {
        const size_t off = (size_t)a->expert_offset[e];
        const int rows = a->expert_offset[e + 1] - a->expert_offset[e];
        moe_mlp_backward(be, A(ws->dxp, off * H), g->fc1 + (size_t)e * 2 * F * H,
                         g->fc2 + (size_t)e * H * F, ws->dwp + off, A(ws->dyp, off * H),
                         A(a->xp, off * H), A(a->gu, off * 2 * F), A(a->act, off * F),
                         a->wp + off, A(w->fc1, (size_t)e * 2 * F * H),
                         A(w->fc2, (size_t)e * H * F), A(ws->h, off * F), A(ws->dh, off * F),
                         A(ws->dgu, off * 2 * F), rows, H, F);
    }

    /* 3⁻¹. back to token order: inputs and routing weights */
    be->unpermute_sum(dx, ws->dxp, a->row_of, N, k, H);
    be->zero(ws->dtopk_w, R * NK);
    be->unpermute_weights(ws->dtopk_w, ws->dwp, a->row_of, N, k);

    /* 2⁻¹ and 1⁻¹. router: routing weights, aux loss and z-loss all end in the logits */
    be->zero(ws->dlogits, be->act_size * (size_t)N * E);
    be->router_backward(ws->dlogits, ws->dtopk_w, a->logits, a->topk_idx, &d->router, N);
    if (d->lb_type != MOE_LB_NONE && d->aux_coeff > 0)
        be->aux_loss_backward(ws->dlogits, a->logits, N, aux_group_len(d), E, k,
                              d->router.score_fn, d->aux_coeff, loss_scale);
    if (d->z_coeff > 0)
        be->z_loss_backward(ws->dlogits, a->logits, N, E, d->z_coeff, loss_scale);
    be->matmul_backward(dx, g->router, ws->dlogits, x, w->router, N, H, E);

    /* 6⁻¹. shared expert */
    if (d->Fs > 0)
        moe_mlp_backward(be, dx, g->shared_fc1, g->shared_fc2, NULL, dout, x, a->shared_gu,
                         a->shared_act, NULL, w->shared_fc1, w->shared_fc2, ws->h, ws->dh,
                         ws->dgu, N, H, d->Fs);
}
