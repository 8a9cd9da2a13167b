/* The allgather dispatcher (chapter 02, --moe-token-dispatcher-type allgather): all-gather
 * the tokens and the routing, take this rank's experts' rows out of the whole gathered
 * batch, run them, and reduce-scatter the partial outputs — see dispatch.h. The experts
 * see their rows in the same order as with all-to-all (by source rank, then position). */
#include "moe/dispatch.h"

#include <stdlib.h>

#include "moe/capacity.h"
#include "moe/experts.h"
#include "moe/layer.h"
#include "profile.h"

#define R sizeof(moe_real)

/* The gathered routing decides this rank's rows: local expert by local expert, gathered
 * assignments in order. ag_tok: row → gathered token; ag_inv: gathered assignment → row
 * (−1: another rank's expert); ag_identity lets unpermute_sum add k rows per token. */
static void ag_plan(const moe_backend *be, const moe_layer_dims *d, moe_layer_acts *a,
                    moe_layer_workspace *ws) {
    moe_ep *ep = d->ep;
    const int N = d->N, E = d->E, k = d->k, NK = N * k;
    const int P = ep->size, EL = E / P, first = ep->rank * EL, GNK = P * NK;
    int *didx = malloc(sizeof(int) * NK), *gidx = malloc(sizeof(int) * GNK);
    moe_real *gw = malloc(R * GNK);
    MOE_ASSERT(didx && gidx && gw);
    moe_capacity_route(be, d, a, didx);
    moe_comm_host_all_gather(ep->comm, didx, gidx, (size_t)NK, MOE_DTYPE_I32);
    moe_comm_host_all_gather(ep->comm, a->host_w, gw, (size_t)NK, moe_dtype_real());
    int *tok = malloc(sizeof(int) * (GNK + 1)), *inv = malloc(sizeof(int) * GNK);
    int *ident = malloc(sizeof(int) * GNK);
    moe_real *we = malloc(R * (GNK + 1));
    MOE_ASSERT(tok && inv && ident && we);
    moe_dispatch_plan *pl = &a->plan;
    pl->dispatcher = &moe_dispatcher_allgather;
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
    moe_expert_rows_reserve(be, d, a, ws, NULL, (size_t)rows + 1);
    be->from_host(a->we, we, R * rows);
    free(didx); free(gidx); free(gw); free(tok); free(inv); free(ident); free(we);
}

/* Every rank's token-side rows @p src [N,H] gathered; this rank's experts take theirs
 * into @p dst [R_recv,H]. */
static void gather_to_experts(const moe_backend *be, const moe_layer_dims *d,
                              const moe_layer_acts *a, void *dst, const void *src) {
    moe_ep *ep = d->ep;
    const size_t NH = (size_t)d->N * d->H;
    ep->send_buf = moe_grow(be, ep->send_buf, &ep->send_cap, be->act_size * ep->size * NH);
    moe_comm_all_gather(ep->comm, src, ep->send_buf, NH, moe_dtype_act(be));
    be->gather_rows(dst, ep->send_buf, a->plan.ag_tok, a->plan.R_recv, d->H);
    moe_prof_mark(MOE_PROF_OTHER);
}

/* Expert-side rows @p src: the partial sums of every gathered token, summed over the
 * ranks; this rank's tokens land in @p dst [N,H] (overwritten). */
static void reduce_to_tokens(const moe_backend *be, const moe_layer_dims *d,
                             const moe_layer_acts *a, void *dst, const void *src) {
    moe_ep *ep = d->ep;
    const int P = ep->size, GNK = P * d->N * d->k;
    const size_t NH = (size_t)d->N * d->H;
    ep->recv_buf = moe_grow(be, ep->recv_buf, &ep->recv_cap, be->act_size * (size_t)GNK * d->H);
    ep->ag_buf = moe_grow(be, ep->ag_buf, &ep->ag_cap, be->act_size * P * NH);
    be->gather_rows(ep->recv_buf, src, a->plan.ag_inv, GNK, d->H);
    be->zero(ep->ag_buf, be->act_size * P * NH);
    be->unpermute_sum(ep->ag_buf, ep->recv_buf, a->plan.ag_identity, P * d->N, d->k, d->H);
    moe_comm_reduce_scatter_sum(ep->comm, ep->ag_buf, dst, NH, moe_dtype_act(be));
}

static void ag_dispatch(const moe_backend *be, const moe_layer_dims *d, moe_layer_acts *a,
                        moe_layer_workspace *ws, const void *x) {
    /* (the weights came with the plan; the rows are scratch where the experts keep x's
     * FP8 copy: moe_layer_xe()) */
    gather_to_experts(be, d, a, moe_layer_xe(a, ws), x);
}

static void ag_combine(const moe_backend *be, const moe_layer_dims *d, const moe_layer_acts *a,
                       moe_layer_workspace *ws, void *out) {
    reduce_to_tokens(be, d, a, out, ws->ye);
    moe_prof_mark(MOE_PROF_OTHER);
}

/* the combine was a sum: each expert row gets its token's output gradient */
static void ag_dispatch_grad(const moe_backend *be, const moe_layer_dims *d,
                             const moe_layer_acts *a, moe_layer_workspace *ws, const void *dout) {
    gather_to_experts(be, d, a, ws->dye, dout);
}

/* input gradients: per gathered token, summed over the ranks, this rank's share; the
 * routing-weight gradients: each assignment was computed on exactly one rank */
static void ag_combine_grad(const moe_backend *be, const moe_layer_dims *d,
                            const moe_layer_acts *a, moe_layer_workspace *ws, void *dx) {
    moe_ep *ep = d->ep;
    const size_t NK = (size_t)d->N * d->k;
    be->zero(ws->dtopk_w, R * NK);
    reduce_to_tokens(be, d, a, ws->dxp, ws->ye);
    be->add(dx, ws->dxp, (size_t)d->N * d->H);
    moe_real *dw_all = (moe_real *)ep->recv_buf; /* reuse: rows·H ≥ GNK values */
    be->gather_reals(dw_all, ws->dwe, a->plan.ag_inv, ep->size * (int)NK);
    moe_comm_reduce_scatter_sum(ep->comm, dw_all, ws->dtopk_w, NK, moe_dtype_real());
    moe_prof_mark(MOE_PROF_OTHER);
}

static void ag_free(const moe_backend *be, moe_dispatch_plan *plan) {
    be->free(plan->ag_tok);
    be->free(plan->ag_inv);
    be->free(plan->ag_identity);
    free(plan->expert_offset);
}

const moe_dispatcher moe_dispatcher_allgather = {
    .name = "allgather", .expert_side = 1, .plan = ag_plan, .dispatch = ag_dispatch,
    .combine = ag_combine, .dispatch_grad = ag_dispatch_grad, .combine_grad = ag_combine_grad,
    .free = ag_free,
};
