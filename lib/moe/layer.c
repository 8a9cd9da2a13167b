/* The MoE FFN layer: route → losses → dispatch → experts → combine → shared expert.
 * See layer.h; the dispatchers are in dispatch_*.c, the experts in experts.c. */
#include "moe/layer.h"

#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "mlp.h"
#include "moe/experts.h"
#include "profile.h"

#define R sizeof(moe_real)

int moe_layer_sync_free(const moe_layer_dims *d) {
    /* (ETP gathers the expert-side rows with host offsets: moe_etp_plan; under EP only the
     * fused dispatcher plans on the device, dispatch_fused.c) */
    return d->step_flags && (!d->ep || d->ep->dispatcher == &moe_dispatcher_fused) && !d->etp &&
           d->capacity_factor == 0 && d->experts == MOE_EXPERTS_KERNEL;
}

int moe_layer_permuted_rows(const moe_layer_dims *d) {
    const int nk = d->N * d->k;
    return !d->ep && moe_layer_sync_free(d) && d->budget_rows > 0 && d->budget_rows < nk
               ? d->budget_rows
               : nk;
}

static size_t max_rows_f(const moe_layer_dims *d) {
    size_t a = (size_t)moe_layer_permuted_rows(d) * d->F, b = (size_t)d->N * d->Fs;
    return a > b ? a : b;
}

static const moe_dispatcher *dispatcher_of(const moe_layer_dims *d);

int moe_layer_keeps_x_t(const moe_backend *be, const moe_layer_dims *d) {
    /* the rows the experts run on, whichever dispatcher filled them (with ETP: gathered over
     * the group, expert_tp.h), but for the fused permutation's, which reads the tokens
     * themselves (the local dispatcher's only: moe/experts.c). The fused NVLink dispatcher's
     * peers then write into the workspace's shared dye: its kernels open with a barrier
     * that waits for every peer's queued reads of the buffer (dispatch_nvlink.cu) */
    return !d->permute_fusion && d->experts == MOE_EXPERTS_KERNEL &&
           moe_mlp_saved_form(be, d->lowp) == MOE_MLP_SAVED_FP8_TOKEN;
}

/* The permuted rows the experts run on in place: the local dispatcher's. The others fill
 * expert-side rows (a->xe, gue, acte: moe/experts.c), so the permuted buffers below but
 * perm_src and wp are not allocated for them */
static int local_rows(const moe_layer_dims *d) {
    return dispatcher_of(d) == &moe_dispatcher_local;
}

/* The layer keeps its permuted inputs only where its backward reads them: the local
 * dispatcher's experts, unless they keep x's token-wise FP8 copy instead. The alltoall
 * dispatcher only sends them (the experts keep the rows they received) */
static int keeps_xp(const moe_backend *be, const moe_layer_dims *d) {
    return local_rows(d) && !moe_layer_keeps_x_t(be, d);
}

int moe_layer_keeps_xe(const moe_backend *be, const moe_layer_dims *d) {
    return !d->etp && !moe_layer_keeps_x_t(be, d);
}

void *moe_layer_xp(const moe_layer_acts *a, const moe_layer_workspace *ws) {
    return a->xp ? a->xp : ws->dxp;
}

void *moe_layer_xe(const moe_layer_acts *a, const moe_layer_workspace *ws) {
    return a->xe ? a->xe : ws->dye;
}

/* The buffers with one row per permuted row: the budget's (one definition for the
 * allocation and the regrowth). */
static int alloc_permuted(const moe_backend *be, moe_layer_acts *a, const moe_layer_dims *d) {
    const size_t P = moe_layer_permuted_rows(d), S = be->act_size;
    const int keep = keeps_xp(be, d), local = local_rows(d);
    be->free(a->perm_src); be->free(a->wp); be->free(a->xp); be->free(a->gu); be->free(a->act);
    a->perm_src = be->alloc(sizeof(int) * P);
    a->wp = be->alloc(R * P);
    a->xp = keep ? be->alloc(S * P * d->H) : NULL;
    a->gu = local ? be->alloc(S * P * 2 * d->F) : NULL;
    /* chapter 05's native FP8: the SwiGLU output's codes and scales, not bf16, and in the
     * token-wise form x's copy too (lib/mlp.c) */
    a->act = local ? be->alloc(moe_mlp_act_bytes(be, d->lowp, P, d->E, d->F,
                                                 moe_layer_keeps_x_t(be, d) ? d->H : 0))
                   : NULL;
    return a->perm_src && a->wp && (a->xp || !keep) && ((a->gu && a->act) || !local);
}

int moe_layer_acts_regrow(const moe_backend *be, moe_layer_acts *a, const moe_layer_dims *d) {
    return alloc_permuted(be, a, d);
}

int moe_layer_acts_alloc(const moe_backend *be, moe_layer_acts *a, const moe_layer_dims *d) {
    const size_t N = d->N, NK = (size_t)d->N * d->k, S = be->act_size;
    memset(a, 0, sizeof *a);
    a->logits = be->alloc(S * N * d->E);
    a->topk_idx = be->alloc(sizeof(int) * NK);
    a->topk_w = be->alloc(R * NK);
    a->row_of = be->alloc(sizeof(int) * NK);
    int ok = alloc_permuted(be, a, d);
    if (d->Fs > 0) {
        a->shared_gu = be->alloc(S * N * 2 * d->Fs);
        a->shared_act = be->alloc(S * N * d->Fs);
    }
    a->expert_offset = calloc((size_t)d->E + 1, sizeof(int));
    a->dev_offset = be->alloc(sizeof(int) * ((size_t)d->E + 2));
    a->counts = calloc((size_t)d->E, sizeof(long long));
    {   /* at most one aux-loss group per sequence of all TP ranks' tokens */
        const size_t groups = (size_t)d->N * (d->tp ? d->tp->size : 1) / (d->T > 0 ? d->T : 1);
        a->aux_counts = be->alloc((groups > 1 ? groups : 1) * (size_t)d->E * sizeof(long long));
    }
    a->loss = be->alloc(2 * sizeof(double));
    if (d->ep || d->etp || d->capacity_factor > 0) {
        a->dispatch_idx = be->alloc(sizeof(int) * NK);
        a->host_idx = malloc(sizeof(int) * NK);
        a->host_w = malloc(R * NK);
        ok = ok && a->dispatch_idx && a->host_idx && a->host_w;
    }
    /* out of memory is the caller's error to report (with the sizes and the flags), not
     * an assertion: a large batch reaches here */
    return ok && a->logits && a->topk_idx && a->topk_w && a->row_of &&
           (d->Fs == 0 || (a->shared_gu && a->shared_act)) &&
           a->expert_offset && a->dev_offset && a->counts && a->aux_counts && a->loss;
}

void moe_layer_acts_free(const moe_backend *be, moe_layer_acts *a) {
    be->free(a->logits); be->free(a->topk_idx); be->free(a->topk_w); be->free(a->perm_src);
    be->free(a->row_of); be->free(a->wp); be->free(a->xp); be->free(a->gu); be->free(a->act);
    be->free(a->shared_gu); be->free(a->shared_act);
    free(a->expert_offset);
    be->free(a->dev_offset);
    free(a->counts);
    be->free(a->aux_counts);
    be->free(a->loss);
    be->free(a->dispatch_idx);
    free(a->host_idx);
    free(a->host_w);
    moe_dispatch_plan_free(be, &a->plan);
    if (a->we_sym.ptr) { /* the fused dispatcher's buffers are not the backend's (xe_sym
                          * unused where the layer keeps x's FP8 copy) */
        moe_comm_sym_free(&a->xe_sym);
        moe_comm_sym_free(&a->we_sym);
        a->xe = NULL;
        a->we = NULL;
    }
    be->free(a->xe); be->free(a->we); be->free(a->gue); be->free(a->acte);
    moe_etp_rows_free(be, &a->etp);
    memset(a, 0, sizeof *a);
}

/* the workspace's buffers with one row per permuted row (yp also serves the shared expert's
 * N rows, dh and dgu its N·Fs) */
static int alloc_permuted_ws(const moe_backend *be, moe_layer_workspace *w,
                             const moe_layer_dims *d) {
    const size_t N = d->N, P = moe_layer_permuted_rows(d), HF = max_rows_f(d), S = be->act_size;
    /* under the fused scatter fc2 writes yp in slot order: all N·k slots, even where the
     * sync-free budget keeps fewer permuted rows */
    size_t Y = P > N ? P : N;
    if (d->permute_scatter && (size_t)d->N * d->k > Y)
        Y = (size_t)d->N * d->k;
    be->free(w->yp); be->free(w->dyp); be->free(w->dxp); be->free(w->dwp);
    be->free(w->dh); be->free(w->dgu);
    w->yp = be->alloc(S * Y * d->H);
    w->dyp = be->alloc(S * P * d->H);
    w->dxp = be->alloc(S * P * d->H);
    w->dwp = be->alloc(R * P);
    w->dh = be->alloc(S * HF);
    w->dgu = be->alloc(S * 2 * HF);
    return w->yp && w->dyp && w->dxp && w->dwp && w->dh && w->dgu;
}

int moe_layer_workspace_regrow(const moe_backend *be, moe_layer_workspace *w,
                               const moe_layer_dims *d) {
    return alloc_permuted_ws(be, w, d);
}

int moe_layer_workspace_alloc(const moe_backend *be, moe_layer_workspace *w,
                              const moe_layer_dims *d) {
    const size_t N = d->N, NK = (size_t)d->N * d->k, S = be->act_size;
    memset(w, 0, sizeof *w);
    const int ok = alloc_permuted_ws(be, w, d);
    w->dtopk_w = be->alloc(R * NK);
    w->dlogits = be->alloc(S * N * d->E);
    w->single = (moe_ep){.comm = NULL, .size = 1, .rank = 0, .be = be};
    return ok && w->dtopk_w && w->dlogits;
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
    moe_ep_free(&w->single);
    moe_etp_work_free(be, &w->etp);
    memset(w, 0, sizeof *w);
}

/* the TP group this layer's tokens are split over, or NULL */
static const moe_tp *tp_of(const moe_layer_dims *d) {
    if (!d->tp || d->tp->size == 1)
        return NULL;
    MOE_ASSERT(d->tp->comm && d->tp->sp); /* config.c: MoE layers with TP need SP */
    return d->tp;
}

/* the ranks the micro-batch's tokens are split over (TP with SP, or TP x CP), or NULL */
static const moe_tp *shards_of(const moe_layer_dims *d) {
    if (d->shards)
        return d->shards->size > 1 ? d->shards : NULL;
    return tp_of(d);
}

/* This rank's rows among the aux loss's groups: the whole micro-batch (all the shards'
 * tokens), or one sequence. Under SP rank r holds rows [r·N, (r+1)·N) of the N·TP.
 * Under CP (chapter 07) d->T is this rank's T/CP tokens of each sequence, held chunk-major
 * ([2][B][C], C = T/(2·CP): its early chunk of every sequence, then its late one), so a
 * sequence's rows are two runs of C in this CP rank's N·TP rows (moe_aux_shape::run); the
 * counts, summed over TP x CP, are then those of the whole sequence of T tokens. */
static moe_aux_shape aux_shape(const moe_layer_dims *d) {
    const moe_tp *sh = shards_of(d), *tp = tp_of(d);
    const int all = d->N * (sh ? sh->size : 1);
    if (d->lb_type != MOE_LB_SEQ_AUX)
        return (moe_aux_shape){d->N, sh ? sh->rank * d->N : 0, all, 1, d->E, d->k,
                               d->router.score_fn, 0};
    const int tps = tp ? tp->size : 1, cp = sh ? sh->size / tps : 1;
    if (cp == 1)
        return (moe_aux_shape){d->N, sh ? sh->rank * d->N : 0, d->T, all / d->T, d->E, d->k,
                               d->router.score_fn, 0};
    MOE_ASSERT(d->T % 2 == 0); /* config.c: 2·CP divides the sequence */
    return (moe_aux_shape){d->N, (tp ? tp->rank : 0) * d->N, d->T * cp, d->N * tps / d->T,
                           d->E, d->k, d->router.score_fn, d->T / 2};
}

/* The z-loss is a mean over all N·TP·CP tokens: each rank's mean over its N rows, with the
 * coefficient divided by TP x CP, is its part of it (Megatron divides by TP x CP likewise). */
static double z_coeff(const moe_layer_dims *d) {
    const moe_tp *sh = shards_of(d);
    return d->z_coeff / (sh ? sh->size : 1);
}

/* How steps 3 and 5 run: the EP group's dispatcher (chosen once, at setup); on one EP rank
 * the alltoall one with no peers when a capacity drops tokens or ETP gathers the
 * expert-side rows (expert_tp.h), else chapter 01's. */
static const moe_dispatcher *dispatcher_of(const moe_layer_dims *d) {
    if (d->ep)
        return d->ep->dispatcher ? d->ep->dispatcher : &moe_dispatcher_alltoall;
    return d->capacity_factor > 0 || d->etp ? &moe_dispatcher_alltoall : &moe_dispatcher_local;
}

/* Steps 1 and 2 of the forward (and, with `plan`, step 3's plan): a region for
 * moe_graph_run() at `--cuda-graph-scope moe_router` / `moe_preprocess` (graph.h). */
typedef struct route_region {
    const moe_backend *be;
    const void *x;
    const moe_layer_weights *w;
    const float *expert_bias;
    const moe_layer_dims *d;
    moe_layer_acts *a;
    moe_layer_workspace *ws;
    int plan; /* also the dispatch plan (device work only on the sync-free path) */
} route_region;

static void route_forward(void *p) {
    const route_region *r = p;
    const moe_backend *be = r->be;
    const moe_layer_dims *d = r->d;
    moe_layer_acts *a = r->a;
    const int N = d->N, H = d->H, E = d->E;

    /* 1. route (router math in fp32 / the backend's real type) */
    be->matmul_forward(a->logits, r->x, r->w->router, N, H, E);
    be->router_forward(a->topk_idx, a->topk_w, a->logits, r->expert_bias, &d->router, N);

    /* 2. the router's own losses, added into a->loss on the device (no host read) */
    const moe_tp *shards = shards_of(d);
    be->zero(a->loss, 2 * sizeof(double));
    if (d->lb_type != MOE_LB_NONE && d->aux_coeff > 0) {
        /* the counts of every shard's rows (a device collective), then this rank's part */
        const moe_aux_shape sh = aux_shape(d);
        be->aux_loss_counts(a->aux_counts, a->logits, &sh);
        if (shards)
            moe_comm_all_reduce_sum(shards->comm, a->aux_counts, (size_t)sh.groups * E,
                                    MOE_DTYPE_I64);
        be->aux_loss_forward(&a->loss[0], a->logits, a->aux_counts, &sh, d->aux_coeff);
    }
    if (d->z_coeff > 0)
        be->z_loss_forward(&a->loss[1], a->logits, N, E, z_coeff(d));
    moe_prof_mark(MOE_PROF_ROUTER);

    /* 3, first half: where each assignment goes (counts, capacity, plan) */
    if (r->plan)
        dispatcher_of(d)->plan(be, d, a, r->ws);
}

void moe_layer_forward(const moe_backend *be, void *out, const void *x, const moe_layer_weights *w,
                       const float *expert_bias, const moe_layer_dims *d, moe_layer_acts *a,
                       moe_layer_workspace *ws) {
    const int N = d->N, H = d->H;
    const moe_dispatcher *dp = dispatcher_of(d);
    const moe_tp *tp = tp_of(d);

    /* 1-2: route and the router's losses; 3: the plan. Captured as one graph at scope
     * moe_router (1-2) or moe_preprocess (1-3); at layer and above the whole layer is the
     * model's region, so nothing here captures (graph.h) */
    const moe_graph_scope scope = moe_graphs_scope(d->graphs);
    const int site = scope == MOE_GRAPH_MOE_ROUTER       ? MOE_GRAPH_SITE_ROUTER_FWD
                     : scope == MOE_GRAPH_MOE_PREPROCESS ? MOE_GRAPH_SITE_PREPROCESS_FWD
                                                         : -1;
    route_region rr = {be, x, w, expert_bias, d, a, ws, site != MOE_GRAPH_SITE_ROUTER_FWD};
    if (site >= 0) {
        const moe_graph_key k = {(moe_graph_site)site, d->layer, N, d->T, 0, 0.0};
        moe_graph_run(d->graphs, k, route_forward, &rr);
    } else {
        route_forward(&rr);
    }
    if (!rr.plan)
        dp->plan(be, d, a, ws);

    /* 3, second half: the tokens and their routing weights to their experts' rows */
    dp->dispatch(be, d, a, ws, x);

    /* 4. the experts: chapter 01's loop of one SwiGLU MLP per expert on its rows, or
     *    (chapter 03) one grouped GEMM per Linear for all of them */
    moe_experts_forward(be, d, a, ws, w, x, dp->expert_side);

    /* 5. combine: out[n] = Σ_j expert output of (n, j) */
    dp->combine(be, d, a, ws, out);

    /* 6. shared expert on every token; with TP a dense FFN's sandwich around it: the
     *    rows gathered, fc1 column- and fc2 row-parallel (Fs/TP wide here), the partial
     *    outputs reduce-scattered back to this rank's rows (tensor_parallel.h) */
    if (d->Fs > 0) {
        const int Ns = N * (tp ? tp->size : 1), Fs = d->Fs / (tp ? tp->size : 1);
        void *part = tp ? ws->tp_y : ws->yp;
        moe_mlp_forward_lowp(be, part, a->shared_gu, a->shared_act,
                             moe_tp_enter_forward(be, tp, ws->tp_x, x, Ns, H), NULL,
                             w->shared_fc1, w->shared_fc2, Ns, H, Fs, d->lowp,
                             moe_lowp_site(d->lowp, d->layer, MOE_LOWP_SHARED, 0),
                             w->shared_fp8);
        moe_tp_exit_forward(be, tp, ws->yp, part, Ns, H);
        be->add(out, ws->yp, (size_t)N * H);
    }
}

/* Steps 2⁻¹ and 1⁻¹ of the backward: a region for moe_graph_run() (route_region's twin). */
typedef struct router_region {
    const moe_backend *be;
    void *dx;
    const moe_layer_grads *g;
    const void *x;
    const moe_layer_weights *w;
    const moe_layer_dims *d;
    const moe_layer_acts *a;
    moe_layer_workspace *ws;
    double loss_scale;
} router_region;

static void router_backward(void *p) {
    const router_region *r = p;
    const moe_backend *be = r->be;
    const moe_layer_dims *d = r->d;
    const moe_layer_acts *a = r->a;
    moe_layer_workspace *ws = r->ws;
    const int N = d->N, H = d->H, E = d->E;
    be->zero(ws->dlogits, be->act_size * (size_t)N * E);
    be->router_backward(ws->dlogits, ws->dtopk_w, a->logits, a->topk_idx, &d->router, N);
    if (d->lb_type != MOE_LB_NONE && d->aux_coeff > 0) {
        const moe_aux_shape sh = aux_shape(d);
        be->aux_loss_backward(ws->dlogits, a->logits, a->aux_counts, &sh, d->aux_coeff,
                              r->loss_scale);
    }
    if (d->z_coeff > 0)
        be->z_loss_backward(ws->dlogits, a->logits, N, E, z_coeff(d), r->loss_scale);
    be->matmul_backward(r->dx, r->g->router, ws->dlogits, r->x, r->w->router, N, H, E);
    moe_prof_mark(MOE_PROF_ROUTER);
}

void moe_layer_backward(const moe_backend *be, void *dx, const moe_layer_grads *g, const void *dout,
                        const void *x, const moe_layer_weights *w, const moe_layer_dims *d,
                        const moe_layer_acts *a, moe_layer_workspace *ws, double loss_scale) {
    const int N = d->N, H = d->H;
    const moe_dispatcher *dp = dispatcher_of(d);

    /* 5⁻¹. the combine was a sum, so each expert row receives its token's gradient */
    dp->dispatch_grad(be, d, a, ws, dout);

    /* 4⁻¹. the experts in reverse */
    moe_experts_backward(be, d, a, ws, w, g, x, dp->expert_side);

    /* 3⁻¹. back to token order: input gradients into dx, routing-weight gradients into
     *      ws->dtopk_w */
    dp->combine_grad(be, d, a, ws, dx);

    /* 2⁻¹ and 1⁻¹. router: routing weights, aux loss and z-loss all end in the logits
     *      (captured as one graph at scope moe_router and moe_preprocess) */
    router_region rb = {be, dx, g, x, w, d, a, ws, loss_scale};
    const moe_graph_scope scope = moe_graphs_scope(d->graphs);
    if (scope == MOE_GRAPH_MOE_ROUTER || scope == MOE_GRAPH_MOE_PREPROCESS) {
        const moe_graph_key k = {MOE_GRAPH_SITE_ROUTER_BWD, d->layer, N, d->T, 0, loss_scale};
        moe_graph_run(d->graphs, k, router_backward, &rb);
    } else {
        router_backward(&rb);
    }

    /* 6⁻¹. shared expert; with TP the output gradient's rows and the input are gathered
     *      again, and the whole input's partial gradient is reduce-scattered to this rank */
    if (d->Fs > 0) {
        const moe_tp *tp = tp_of(d);
        const int Ns = N * (tp ? tp->size : 1), Fs = d->Fs / (tp ? tp->size : 1);
        const void *dy = moe_tp_exit_backward(be, tp, ws->tp_y, dout, Ns, H);
        const void *xin = moe_tp_enter_forward(be, tp, ws->tp_x, x, Ns, H);
        void *dfull = tp ? ws->tp_dx : dx;
        if (tp)
            be->zero(dfull, be->act_size * (size_t)Ns * H);
        moe_mlp_backward_lowp(be, dfull, g->shared_fc1, g->shared_fc2, NULL, dy, xin,
                              a->shared_gu, a->shared_act, NULL, w->shared_fc1, w->shared_fc2,
                              ws->dh, ws->dgu, Ns, H, Fs, d->lowp,
                              moe_lowp_site(d->lowp, d->layer, MOE_LOWP_SHARED, 0),
                              w->shared_fp8);
        if (tp) { /* yp is free in the backward */
            moe_tp_enter_backward(be, tp, ws->yp, dfull, Ns, H);
            be->add(dx, ws->yp, (size_t)N * H);
        }
    }
}
