/* The MoE FFN layer, naive loop over experts: see moe_layer.h. */
#include "moe_layer.h"

#include <stdlib.h>
#include <string.h>

#include "mlp.h"
#include "profile.h"

#define R sizeof(moe_real)
#define A(p, i) MOE_ACT(be, p, i)

static size_t max_rows_f(const moe_layer_dims *d) {
    size_t a = (size_t)d->N * d->k * d->F, b = (size_t)d->N * d->Fs;
    return a > b ? a : b;
}

void moe_layer_acts_alloc(const moe_backend *be, moe_layer_acts *a, const moe_layer_dims *d) {
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
    a->dev_offset = be->alloc(sizeof(int) * ((size_t)d->E + 2));
    a->counts = calloc((size_t)d->E, sizeof(long long));
    if (d->ep || d->capacity_factor > 0) {
        a->dispatch_idx = be->alloc(sizeof(int) * NK);
        a->host_idx = malloc(sizeof(int) * NK);
        a->host_w = malloc(R * NK);
        MOE_ASSERT(a->dispatch_idx && a->host_idx && a->host_w);
    }
    MOE_ASSERT(a->logits && a->topk_idx && a->topk_w && a->perm_src && a->row_of && a->wp &&
               a->xp && a->gu && a->act && a->expert_offset && a->dev_offset && a->counts);
}

void moe_layer_acts_free(const moe_backend *be, moe_layer_acts *a) {
    be->free(a->logits); be->free(a->topk_idx); be->free(a->topk_w); be->free(a->perm_src);
    be->free(a->row_of); be->free(a->wp); be->free(a->xp); be->free(a->gu); be->free(a->act);
    be->free(a->shared_gu); be->free(a->shared_act);
    free(a->expert_offset);
    be->free(a->dev_offset);
    free(a->counts);
    be->free(a->dispatch_idx);
    free(a->host_idx);
    free(a->host_w);
    moe_dispatch_plan_free(be, &a->plan);
    if (a->xe_sym.ptr) { /* the fused dispatcher's buffers are not the backend's */
        moe_comm_sym_free(&a->xe_sym);
        moe_comm_sym_free(&a->we_sym);
        a->xe = NULL;
        a->we = NULL;
    }
    be->free(a->xe); be->free(a->we); be->free(a->gue); be->free(a->acte);
    memset(a, 0, sizeof *a);
}

void moe_layer_workspace_alloc(const moe_backend *be, moe_layer_workspace *w, const moe_layer_dims *d) {
    const size_t N = d->N, NK = (size_t)d->N * d->k, HF = max_rows_f(d), S = be->act_size;
    memset(w, 0, sizeof *w);
    w->yp = be->alloc(S * (NK > N ? NK : N) * d->H);
    w->dyp = be->alloc(S * NK * d->H);
    w->dxp = be->alloc(S * NK * d->H);
    w->dwp = be->alloc(R * NK);
    w->dtopk_w = be->alloc(R * NK);
    w->dlogits = be->alloc(S * N * d->E);
    w->dh = be->alloc(S * HF);
    w->dgu = be->alloc(S * 2 * HF);
    MOE_ASSERT(w->yp && w->dyp && w->dxp && w->dwp && w->dtopk_w && w->dlogits && w->dh && w->dgu);
}

void moe_layer_workspace_free(const moe_backend *be, moe_layer_workspace *w) {
    be->free(w->yp); be->free(w->dyp); be->free(w->dxp); be->free(w->dwp); be->free(w->dtopk_w);
    be->free(w->dlogits); be->free(w->dh); be->free(w->dgu);
    if (w->ye_sym.ptr) { /* the fused dispatcher's buffers are not the backend's */
        moe_comm_sym_free(&w->ye_sym);
        moe_comm_sym_free(&w->dye_sym);
        moe_comm_sym_free(&w->dwe_sym);
        w->ye = w->dye = NULL;
        w->dwe = NULL;
    }
    be->free(w->ye); be->free(w->dye); be->free(w->dwe); be->free(w->edh); be->free(w->edgu);
    memset(w, 0, sizeof *w);
}

/* tokens per aux-loss group: the whole micro-batch, or one sequence */
static int aux_group_len(const moe_layer_dims *d) {
    return d->lb_type == MOE_LB_SEQ_AUX ? d->T : d->N;
}

/* The groups of step 4: expert e owns rows [off[e], off[e+1]) (host). Our grouped kernel
 * reads the offsets from device memory: the plain path has them there already
 * (permute_index wrote a->dev_offset), the dispatcher paths upload the plan's. */
static moe_groups expert_groups(const moe_backend *be, const moe_layer_dims *d, moe_layer_acts *a,
                                const int *off, int G, int upload) {
    if (d->experts == MOE_EXPERTS_KERNEL && upload)
        be->from_host(a->dev_offset, off, sizeof(int) * (G + 1));
    moe_groups g = {off, a->dev_offset, G, d->experts};
    return g;
}

/* The experts on an expert-contiguous layout: expert e (weights e of fc1/fc2) owns rows
 * [off[e], off[e+1]). Chapter 01's loop — or chapter 03's grouped GEMMs: one per Linear
 * for all of them (--moe-expert-backend). */
static void experts_forward(const moe_backend *be, void *y, void *gu, void *act, const void *x,
                            const moe_real *w_row, const void *fc1, const void *fc2,
                            const moe_groups *grp, int H, int F) {
    const int *off = grp->off, n_experts = grp->G;
    if (grp->impl != MOE_EXPERTS_LOOP) {
        moe_mlp_forward_grouped(be, y, gu, act, x, w_row, fc1, fc2, grp, H, F);
        return;
    }
    for (int e = 0; e < n_experts; e++) {
        const size_t o = (size_t)off[e];
        const int rows = off[e + 1] - off[e];
        moe_mlp_forward(be, A(y, o * H), A(gu, o * 2 * F), A(act, o * F), A(x, o * H),
                        w_row + o, A(fc1, (size_t)e * 2 * F * H), A(fc2, (size_t)e * H * F), rows,
                        H, F);
    }
}

static void experts_backward(const moe_backend *be, void *dx, moe_real *g_fc1, moe_real *g_fc2,
                             moe_real *dw_row, const void *dy, const void *x, const void *gu,
                             const void *act, const moe_real *w_row, const void *fc1,
                             const void *fc2, void *dh, void *dgu, const moe_groups *grp, int H,
                             int F) {
    const int *off = grp->off, n_experts = grp->G;
    if (grp->impl != MOE_EXPERTS_LOOP) {
        /* dx is a fresh buffer of the layer: overwrite it */
        moe_mlp_backward_grouped(be, dx, g_fc1, g_fc2, dw_row, dy, x, gu, act, w_row, fc1, fc2, dh,
                                 dgu, grp, H, F, 0);
        return;
    }
    for (int e = 0; e < n_experts; e++) {
        const size_t o = (size_t)off[e];
        const int rows = off[e + 1] - off[e];
        moe_mlp_backward(be, A(dx, o * H), g_fc1 + (size_t)e * 2 * F * H, g_fc2 + (size_t)e * H * F,
                         dw_row + o, A(dy, o * H), A(x, o * H), A(gu, o * 2 * F), A(act, o * F),
                         w_row + o, A(fc1, (size_t)e * 2 * F * H), A(fc2, (size_t)e * H * F),
                         A(dh, o * F), A(dgu, o * 2 * F), rows, H, F);
    }
}

/* grow-only buffers on the expert side (their row count changes every step) */
static void *regrow(const moe_backend *be, void *p, size_t bytes) {
    be->free(p);
    p = be->alloc(bytes ? bytes : 1);
    MOE_ASSERT(p != NULL);
    return p;
}

/* rows: this rank's expert-side rows + 1. With the fused dispatcher (pl->fused) the
 * buffers that peers store into or load from are symmetric memory sized for the largest
 * rank (collective: every rank grows them at the same call); the rest stay local. */
static void ensure_expert_rows(const moe_backend *be, moe_layer_acts *a, moe_layer_workspace *ws,
                               const moe_layer_dims *d, const moe_dispatch_plan *pl, size_t rows) {
    const size_t S = be->act_size, H = d->H, F = d->F;
    const int fused = pl && pl->fused;
    if (fused) {
        a->xe = moe_dispatch_sym_rows(d->ep, pl, &a->xe_sym, S * H);
        a->we = moe_dispatch_sym_rows(d->ep, pl, &a->we_sym, R);
        ws->ye = moe_dispatch_sym_rows(d->ep, pl, &ws->ye_sym, S * H);
        ws->dye = moe_dispatch_sym_rows(d->ep, pl, &ws->dye_sym, S * H);
        ws->dwe = moe_dispatch_sym_rows(d->ep, pl, &ws->dwe_sym, R);
    }
    if (rows > a->e_rows) {
        if (!fused) {
            a->xe = regrow(be, a->xe, S * rows * H);
            a->we = regrow(be, a->we, R * rows);
        }
        a->gue = regrow(be, a->gue, S * rows * 2 * F);
        a->acte = regrow(be, a->acte, S * rows * F);
        a->e_rows = rows;
    }
    if (rows > ws->e_rows) {
        if (!fused) {
            ws->ye = regrow(be, ws->ye, S * rows * H);
            ws->dye = regrow(be, ws->dye, S * rows * H);
            ws->dwe = regrow(be, ws->dwe, R * rows);
        }
        ws->edh = regrow(be, ws->edh, S * rows * F);
        ws->edgu = regrow(be, ws->edgu, S * rows * 2 * F);
        ws->e_rows = rows;
    }
}

/* The routing on the host: per-expert counts for the statistics, and the capacity
 * decision (didx = the routing with dropped assignments sent to expert E). Returns the
 * capacity (0 when dropless). */
static int route_to_host(const moe_backend *be, const moe_layer_dims *d, moe_layer_acts *a, int *didx) {
    const int E = d->E, NK = d->N * d->k;
    be->to_host(a->host_idx, a->topk_idx, sizeof(int) * NK);
    be->to_host(a->host_w, a->topk_w, R * NK);
    memset(a->counts, 0, sizeof(long long) * E);
    for (int i = 0; i < NK; i++)
        a->counts[a->host_idx[i]]++;
    a->dropped = 0;
    if (d->capacity_factor <= 0) {
        memcpy(didx, a->host_idx, sizeof(int) * NK);
        return 0;
    }
    int cap = moe_expert_capacity(d->N, d->k, E, d->capacity_factor);
    a->dropped =
        moe_apply_capacity(didx, a->host_idx, a->host_w, d->N, d->k, E, cap, d->drop_by_position);
    return cap;
}

/* The allgather dispatcher (see dispatcher.h): all-gather the tokens and the routing,
 * take this rank's experts' rows out of the whole gathered batch, run them, and
 * reduce-scatter the partial outputs. The expert sees its rows in the same order as with
 * all-to-all (by source rank, then position). */
static void forward_allgather(const moe_backend *be, void *out, const void *x,
                              const moe_layer_weights *w, const moe_layer_dims *d, moe_layer_acts *a,
                              moe_layer_workspace *ws) {
    moe_ep *ep = d->ep;
    const int N = d->N, H = d->H, E = d->E, k = d->k, F = d->F, NK = N * k;
    const int P = ep->size, EL = E / P, first = ep->rank * EL, GNK = P * NK;
    const moe_dtype t = be->act_size == 2 ? MOE_DTYPE_BF16 : be->act_size == 4 ? MOE_DTYPE_F32
                                                                             : MOE_DTYPE_F64;
    int *didx = malloc(sizeof(int) * NK), *gidx = malloc(sizeof(int) * GNK);
    moe_real *gw = malloc(R * GNK);
    MOE_ASSERT(didx && gidx && gw);
    route_to_host(be, d, a, didx);
    moe_comm_host_all_gather(ep->comm, didx, gidx, (size_t)NK, MOE_DTYPE_I32);
    moe_comm_host_all_gather(ep->comm, a->host_w, gw, (size_t)NK,
                             sizeof(moe_real) == 4 ? MOE_DTYPE_F32 : MOE_DTYPE_F64);
    /* this rank's rows: local expert by local expert, gathered assignments in order */
    int *tok = malloc(sizeof(int) * (GNK + 1)), *inv = malloc(sizeof(int) * GNK);
    int *ident = malloc(sizeof(int) * GNK);
    moe_real *we = malloc(R * (GNK + 1));
    MOE_ASSERT(tok && inv && ident && we);
    moe_dispatch_plan *pl = &a->plan;
    if (!pl->expert_offset)
        pl->expert_offset = calloc((size_t)EL + 1, sizeof(int));
    int rows = 0;
    for (int i = 0; i < GNK; i++) {
        inv[i] = -1;
        ident[i] = i;
    }
    for (int el = 0; el < EL; el++) {
        pl->expert_offset[el] = rows;
        for (int i = 0; i < GNK; i++)
            if (gidx[i] == first + el) {
                tok[rows] = i / k;
                we[rows] = gw[i];
                inv[i] = rows++;
            }
    }
    pl->expert_offset[EL] = rows;
    pl->R_recv = rows;
    pl->E = E;
    pl->E_local = EL;
    if (GNK > pl->ag_cap) {
        be->free(pl->ag_tok);
        be->free(pl->ag_inv);
        be->free(pl->ag_identity);
        pl->ag_tok = be->alloc(sizeof(int) * (GNK + 1));
        pl->ag_inv = be->alloc(sizeof(int) * GNK);
        pl->ag_identity = be->alloc(sizeof(int) * GNK);
        MOE_ASSERT(pl->ag_tok && pl->ag_inv && pl->ag_identity);
        pl->ag_cap = GNK;
    }
    be->from_host(pl->ag_tok, tok, sizeof(int) * rows);
    be->from_host(pl->ag_inv, inv, sizeof(int) * GNK);
    be->from_host(pl->ag_identity, ident, sizeof(int) * GNK);
    ensure_expert_rows(be, a, ws, d, NULL, (size_t)rows + 1);
    be->from_host(a->we, we, R * rows);

    /* every rank's tokens; this rank's experts take their rows */
    ep->send_buf = moe_grow(be, ep->send_buf, &ep->send_cap, be->act_size * (size_t)P * N * H);
    moe_comm_all_gather(ep->comm, x, ep->send_buf, (size_t)N * H, t);
    be->gather_rows(a->xe, ep->send_buf, pl->ag_tok, rows, H);
    moe_prof_mark(MOE_PROF_OTHER);
    const moe_groups grp = expert_groups(be, d, a, pl->expert_offset, EL, 1);
    experts_forward(be, ws->ye, a->gue, a->acte, a->xe, a->we, w->fc1, w->fc2, &grp, H, F);
    /* partial outputs for every gathered token, then summed over the ranks */
    ep->recv_buf = moe_grow(be, ep->recv_buf, &ep->recv_cap, be->act_size * (size_t)GNK * H);
    ep->ag_buf = moe_grow(be, ep->ag_buf, &ep->ag_cap, be->act_size * (size_t)P * N * H);
    be->gather_rows(ep->recv_buf, ws->ye, pl->ag_inv, GNK, H);
    be->zero(ep->ag_buf, be->act_size * (size_t)P * N * H);
    be->unpermute_sum(ep->ag_buf, ep->recv_buf, pl->ag_identity, P * N, k, H);
    moe_comm_reduce_scatter_sum(ep->comm, ep->ag_buf, out, (size_t)N * H, t);
    free(didx); free(gidx); free(gw); free(tok); free(inv); free(ident); free(we);
}

static void backward_allgather(const moe_backend *be, void *dx, const moe_layer_grads *g,
                               const void *dout, const moe_layer_weights *w, const moe_layer_dims *d,
                               const moe_layer_acts *a, moe_layer_workspace *ws) {
    moe_ep *ep = d->ep;
    const int N = d->N, H = d->H, E = d->E, k = d->k, F = d->F, NK = N * k;
    const int P = ep->size, EL = E / P, GNK = P * NK;
    const moe_dispatch_plan *pl = &a->plan;
    const int rows = pl->R_recv;
    const moe_dtype t = be->act_size == 2 ? MOE_DTYPE_BF16 : be->act_size == 4 ? MOE_DTYPE_F32
                                                                             : MOE_DTYPE_F64;
    ensure_expert_rows(be, (moe_layer_acts *)a, ws, d, NULL, (size_t)rows + 1);
    /* the combine was a sum: each expert row gets its token's output gradient */
    ep->send_buf = moe_grow(be, ep->send_buf, &ep->send_cap, be->act_size * (size_t)P * N * H);
    moe_comm_all_gather(ep->comm, dout, ep->send_buf, (size_t)N * H, t);
    be->gather_rows(ws->dye, ep->send_buf, pl->ag_tok, rows, H);
    if (d->experts == MOE_EXPERTS_LOOP) /* the grouped paths overwrite it */
        be->zero(ws->ye, be->act_size * (size_t)rows * H);
    be->zero(ws->dwe, R * (size_t)rows);
    moe_prof_mark(MOE_PROF_OTHER);
    const moe_groups grp = expert_groups(be, d, (moe_layer_acts *)a, pl->expert_offset, EL, 0);
    experts_backward(be, ws->ye, g->fc1, g->fc2, ws->dwe, ws->dye, a->xe, a->gue, a->acte, a->we,
                     w->fc1, w->fc2, ws->edh, ws->edgu, &grp, H, F);
    /* input gradients: per gathered token, summed over the ranks, this rank's share */
    ep->recv_buf = moe_grow(be, ep->recv_buf, &ep->recv_cap, be->act_size * (size_t)GNK * H);
    ep->ag_buf = moe_grow(be, ep->ag_buf, &ep->ag_cap, be->act_size * (size_t)P * N * H);
    be->gather_rows(ep->recv_buf, ws->ye, pl->ag_inv, GNK, H);
    be->zero(ep->ag_buf, be->act_size * (size_t)P * N * H);
    be->unpermute_sum(ep->ag_buf, ep->recv_buf, pl->ag_identity, P * N, k, H);
    moe_comm_reduce_scatter_sum(ep->comm, ep->ag_buf, ws->dxp, (size_t)N * H, t);
    be->add(dx, ws->dxp, (size_t)N * H);
    /* routing-weight gradients: each assignment was computed on exactly one rank */
    moe_real *dw_all = (moe_real *)ep->recv_buf; /* reuse: rows·H ≥ GNK values */
    be->gather_reals(dw_all, ws->dwe, pl->ag_inv, GNK);
    moe_comm_reduce_scatter_sum(ep->comm, dw_all, ws->dtopk_w, (size_t)NK,
                                sizeof(moe_real) == 4 ? MOE_DTYPE_F32 : MOE_DTYPE_F64);
}

/* Steps 3–5 with the dispatcher: capacity, local permutation, all-to-all to the experts'
 * ranks, the local experts, and back (see dispatcher.h). */
static void forward_dispatch(const moe_backend *be, void *out, const void *x,
                             const moe_layer_weights *w, const moe_layer_dims *d, moe_layer_acts *a,
                             moe_layer_workspace *ws) {
    const int N = d->N, H = d->H, E = d->E, k = d->k, F = d->F, NK = N * k;
    moe_ep local = {.comm = NULL, .size = 1, .rank = 0, .be = be};
    moe_ep *ep = d->ep ? d->ep : &local;
    const int EL = E / (ep->comm ? ep->size : 1);

    /* routing to the host: counts for the statistics, and the capacity decision */
    int *didx = malloc(sizeof(int) * NK), *off = malloc(sizeof(int) * (E + 2));
    long long *kept = malloc(sizeof(long long) * E);
    MOE_ASSERT(didx && off && kept);
    const int cap = route_to_host(be, d, a, didx);
    be->from_host(a->dispatch_idx, didx, sizeof(int) * NK);

    /* local permutation into E + 1 buckets: the last one holds the dropped assignments */
    be->permute_index(a->perm_src, a->row_of, off, NULL, NULL, a->dispatch_idx, N, k, E + 1);
    for (int e = 0; e < E; e++)
        kept[e] = off[e + 1] - off[e];
    moe_dispatch_plan *pl = &a->plan;
    moe_dispatch_plan_build(ep, pl, kept, E, d->pad_to_capacity ? cap : 0);
    ensure_expert_rows(be, a, ws, d, pl, (size_t)pl->R_recv + 1);

    /* to the experts: permuted copies through the collective, or the fused kernel that
     * stores each token straight into its experts' rows */
    if (pl->fused) {
        moe_dispatch_fused(ep, pl, &a->xe_sym, &a->we_sym, x, a->topk_w, a->dispatch_idx,
                           a->row_of, N, k, H);
    } else {
        be->permute_tokens(a->xp, x, a->perm_src, NK, k, H);
        be->permute_weights(a->wp, a->topk_w, a->perm_src, NK);
        moe_dispatch_rows(ep, pl, a->xe, a->xp, H);
        moe_dispatch_reals(ep, pl, a->we, a->wp);
    }
    moe_prof_mark(MOE_PROF_OTHER);
    const moe_groups grp = expert_groups(be, d, a, pl->expert_offset, EL, 1);
    experts_forward(be, ws->ye, a->gue, a->acte, a->xe, a->we, w->fc1, w->fc2, &grp, H, F);

    /* and back: out[n] = Σ_j expert output of (n, j) */
    if (pl->fused) {
        moe_combine_fused(ep, pl, out, 0, NULL, &ws->ye_sym, NULL, a->dispatch_idx, a->row_of,
                          N, k, H);
    } else {
        moe_combine_rows(ep, pl, ws->yp, ws->ye, H);
        const int R_kept = pl->R_kept;
        be->zero(A(ws->yp, (size_t)R_kept * H), be->act_size * (size_t)(NK - R_kept) * H);
        be->zero(out, be->act_size * (size_t)N * H);
        be->unpermute_sum(out, ws->yp, a->row_of, N, k, H);
    }
    if (ep == &local)
        moe_ep_free(&local);
    free(didx);
    free(off);
    free(kept);
}

static void backward_dispatch(const moe_backend *be, void *dx, const moe_layer_grads *g,
                              const void *dout, const moe_layer_weights *w, const moe_layer_dims *d,
                              const moe_layer_acts *a, moe_layer_workspace *ws) {
    const int N = d->N, H = d->H, E = d->E, k = d->k, F = d->F, NK = N * k;
    moe_ep local = {.comm = NULL, .size = 1, .rank = 0, .be = be};
    moe_ep *ep = d->ep ? d->ep : &local;
    const int EL = E / (ep->comm ? ep->size : 1), R_recv = a->plan.R_recv, R_kept = a->plan.R_kept;
    moe_layer_acts *am = (moe_layer_acts *)a; /* ensure_expert_rows never shrinks: a's data stays */
    const moe_dispatch_plan *pl = &a->plan;
    ensure_expert_rows(be, am, ws, d, pl, (size_t)R_recv + 1);
    /* output gradients travel like tokens */
    if (pl->fused) {
        moe_dispatch_fused(ep, pl, &ws->dye_sym, NULL, dout, NULL, a->dispatch_idx, a->row_of, N,
                           k, H);
    } else {
        be->permute_tokens(ws->dyp, dout, a->perm_src, NK, k, H);
        moe_dispatch_rows(ep, pl, ws->dye, ws->dyp, H);
    }
    if (d->experts == MOE_EXPERTS_LOOP) /* the grouped paths overwrite it */
        be->zero(ws->ye, be->act_size * (size_t)R_recv * H);
    be->zero(ws->dwe, R * (size_t)R_recv);
    moe_prof_mark(MOE_PROF_OTHER);
    const moe_groups grp = expert_groups(be, d, am, a->plan.expert_offset, EL, 0);
    experts_backward(be, ws->ye, g->fc1, g->fc2, ws->dwe, ws->dye, a->xe, a->gue, a->acte, a->we,
                     w->fc1, w->fc2, ws->edh, ws->edgu, &grp, H, F);
    /* input and routing-weight gradients come back like outputs: the fused kernel sums
     * each token's rows into dx itself; the collective path leaves them permuted in dxp
     * for moe_layer_backward's unpermute */
    if (pl->fused) {
        moe_combine_fused(ep, pl, dx, 1, ws->dwp, &ws->ye_sym, &ws->dwe_sym, a->dispatch_idx,
                          a->row_of, N, k, H);
        return;
    }
    moe_combine_rows(ep, pl, ws->dxp, ws->ye, H);
    be->zero(A(ws->dxp, (size_t)R_kept * H), be->act_size * (size_t)(NK - R_kept) * H);
    moe_combine_reals(ep, pl, ws->dwp, ws->dwe);
    be->zero(ws->dwp + R_kept, R * (size_t)(NK - R_kept));
    if (ep == &local)
        moe_ep_free(&local);
}

void moe_layer_forward(const moe_backend *be, void *out, const void *x, const moe_layer_weights *w,
                     const float *expert_bias, const moe_layer_dims *d, moe_layer_acts *a,
                     moe_layer_workspace *ws) {
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
    moe_prof_mark(MOE_PROF_ROUTER);

    if (d->ep && d->ep->allgather) {
        forward_allgather(be, out, x, w, d, a, ws);
        moe_prof_mark(MOE_PROF_OTHER);
    } else if (d->ep || d->capacity_factor > 0) {
        /* expert parallelism and/or capacity: steps 3–5 through the dispatcher */
        forward_dispatch(be, out, x, w, d, a, ws);
        moe_prof_mark(MOE_PROF_OTHER);
    } else {
        /* 3. permute: rows grouped by expert (expert_offset comes back to the host) */
        memset(a->counts, 0, sizeof(long long) * E);
        a->dropped = 0;
        be->permute_index(a->perm_src, a->row_of, a->expert_offset,
                          d->experts == MOE_EXPERTS_KERNEL ? a->dev_offset : NULL, a->counts,
                          a->topk_idx, N, k, E);
        be->permute_tokens(a->xp, x, a->perm_src, N * k, k, H);
        be->permute_weights(a->wp, a->topk_w, a->perm_src, N * k);
        moe_prof_mark(MOE_PROF_PERMUTE);

        /* 4. the experts: chapter 01's loop of one SwiGLU MLP per expert on its rows, or
         *    (chapter 03) one grouped GEMM per Linear for all of them */
        const moe_groups grp = expert_groups(be, d, a, a->expert_offset, E, 0);
        experts_forward(be, ws->yp, a->gu, a->act, a->xp, a->wp, w->fc1, w->fc2, &grp, H, F);

        /* 5. combine: out[n] = Σ_j expert output of (n, j) */
        be->zero(out, be->act_size * (size_t)N * H);
        be->unpermute_sum(out, ws->yp, a->row_of, N, k, H);
        moe_prof_mark(MOE_PROF_UNPERMUTE);
    }

    /* 6. shared expert on every token */
    if (d->Fs > 0) {
        moe_mlp_forward(be, ws->yp, a->shared_gu, a->shared_act, x, NULL, w->shared_fc1,
                        w->shared_fc2, N, H, d->Fs);
        be->add(out, ws->yp, (size_t)N * H);
    }
}

void moe_layer_backward(const moe_backend *be, void *dx, const moe_layer_grads *g, const void *dout,
                      const void *x, const moe_layer_weights *w, const moe_layer_dims *d,
                      const moe_layer_acts *a, moe_layer_workspace *ws, double loss_scale) {
    const int N = d->N, H = d->H, E = d->E, k = d->k, F = d->F;
    const size_t NK = (size_t)N * k;

    if (d->ep && d->ep->allgather) {
        /* produces dx's expert part and the routing-weight gradients directly */
        be->zero(ws->dtopk_w, R * NK);
        backward_allgather(be, dx, g, dout, w, d, a, ws);
        moe_prof_mark(MOE_PROF_OTHER);
    } else if (d->ep || d->capacity_factor > 0) {
        backward_dispatch(be, dx, g, dout, w, d, a, ws);
        moe_prof_mark(MOE_PROF_OTHER);
    } else {
        /* 5⁻¹. the combine was a sum, so each permuted row receives its token's gradient */
        be->permute_tokens(ws->dyp, dout, a->perm_src, N * k, k, H);
        /* the loop adds into dxp expert by expert; the grouped paths overwrite it */
        if (d->experts == MOE_EXPERTS_LOOP)
            be->zero(ws->dxp, be->act_size * NK * H);
        be->zero(ws->dwp, R * NK);
        moe_prof_mark(MOE_PROF_PERMUTE);

        /* 4⁻¹. the expert loop in reverse */
        const moe_groups grp = expert_groups(be, d, (moe_layer_acts *)a, a->expert_offset, E, 0);
        experts_backward(be, ws->dxp, g->fc1, g->fc2, ws->dwp, ws->dyp, a->xp, a->gu, a->act,
                         a->wp, w->fc1, w->fc2, ws->dh, ws->dgu, &grp, H, F);
    }

    /* 3⁻¹. back to token order: inputs (the fused dispatcher summed them into dx already)
     * and routing weights */
    if (!(d->ep && d->ep->allgather)) {
        if (!a->plan.fused)
            be->unpermute_sum(dx, ws->dxp, a->row_of, N, k, H);
        be->zero(ws->dtopk_w, R * NK);
        be->unpermute_weights(ws->dtopk_w, ws->dwp, a->row_of, N, k);
        moe_prof_mark(MOE_PROF_UNPERMUTE);
    }

    /* 2⁻¹ and 1⁻¹. router: routing weights, aux loss and z-loss all end in the logits */
    be->zero(ws->dlogits, be->act_size * (size_t)N * E);
    be->router_backward(ws->dlogits, ws->dtopk_w, a->logits, a->topk_idx, &d->router, N);
    if (d->lb_type != MOE_LB_NONE && d->aux_coeff > 0)
        be->aux_loss_backward(ws->dlogits, a->logits, N, aux_group_len(d), E, k,
                              d->router.score_fn, d->aux_coeff, loss_scale);
    if (d->z_coeff > 0)
        be->z_loss_backward(ws->dlogits, a->logits, N, E, d->z_coeff, loss_scale);
    be->matmul_backward(dx, g->router, ws->dlogits, x, w->router, N, H, E);
    moe_prof_mark(MOE_PROF_ROUTER);

    /* 6⁻¹. shared expert */
    if (d->Fs > 0)
        moe_mlp_backward(be, dx, g->shared_fc1, g->shared_fc2, NULL, dout, x, a->shared_gu,
                         a->shared_act, NULL, w->shared_fc1, w->shared_fc2, ws->dh, ws->dgu, N,
                         H, d->Fs);
}

moe_expert_impl moe_expert_impl_from_config(const moe_config *c, const moe_backend *be) {
    const char *s = c->moe_expert_backend;
    if (!strcmp(s, "loop"))
        return MOE_EXPERTS_LOOP;
    if (!strcmp(s, "cublas-grouped"))
        return MOE_EXPERTS_CUBLAS;
    if (!strcmp(s, "grouped"))
        return MOE_EXPERTS_KERNEL;
    /* auto: the fastest on a GPU — our kernel where its shapes fit, else cuBLAS's grouped
     * GEMM; on the CPU the loop, unless Megatron's switch asks for grouped */
    if (be->device == MOE_DEVICE_CPU && !c->moe_grouped_gemm)
        return MOE_EXPERTS_LOOP;
    return moe_config_grouped_kernel_fits(c) ? MOE_EXPERTS_KERNEL : MOE_EXPERTS_CUBLAS;
}
