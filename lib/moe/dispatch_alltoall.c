/* The alltoall dispatcher (chapter 02): count exchange, all-to-all-v of the rows, chunk
 * sort — see dispatch.h. Its plan also serves the fused dispatcher (dispatch_fused.c). */
#include "moe/dispatch.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/capacity.h"
#include "moe/experts.h"
#include "moe/layer.h"
#include "profile.h"

#define A(p, i) MOE_ACT(be, p, i)

/* ---------------------------------------------------------------------- plan */

void moe_dispatch_plan_build(moe_ep *ep, moe_dispatch_plan *plan, const long long *counts, int E,
                             int pad_capacity) {
    const moe_backend *be = ep->be;
    const int P = ep->comm ? ep->size : 1, rank = ep->comm ? ep->rank : 0, EL = E / P;
    if (!plan->send_rows) {
        plan->send_rows = calloc((size_t)P, sizeof(size_t));
        plan->recv_rows = calloc((size_t)P, sizeof(size_t));
        plan->expert_offset = calloc((size_t)EL + 1, sizeof(int));
        plan->send_chunks = calloc((size_t)P * EL, sizeof(moe_comm_chunk));
        plan->recv_chunks = calloc((size_t)P * EL, sizeof(moe_comm_chunk));
        MOE_ASSERT(plan->send_rows && plan->recv_rows && plan->expert_offset &&
                   plan->send_chunks && plan->recv_chunks);
    }
    plan->E = E;
    plan->E_local = EL;

    /* what this rank sends to each global expert, and the count exchange */
    long long *mine = malloc(sizeof(long long) * E), *all = malloc(sizeof(long long) * E * P);
    MOE_ASSERT(mine && all);
    plan->R_kept = 0;
    plan->R_send = 0;
    for (int e = 0; e < E; e++) {
        plan->R_kept += (int)counts[e];
        mine[e] = pad_capacity ? pad_capacity : counts[e];
        plan->R_send += (int)mine[e];
    }
    if (ep->comm)
        moe_comm_host_all_gather(ep->comm, mine, all, (size_t)E, MOE_DTYPE_I64);
    else
        memcpy(all, mine, sizeof(long long) * E);

    /* splits, local expert offsets and the chunk lists of the exchange (dispatch_layout.c) */
    moe_dispatch_layout(all, P, rank, E, plan->send_rows, plan->recv_rows, plan->expert_offset,
                        plan->send_chunks, plan->recv_chunks);
    plan->R_recv = 0;
    for (int p = 0; p < P; p++)
        plan->R_recv += (int)plan->recv_rows[p];

    /* the fused path: shifts instead of maps (dispatch_fused.c) */
    plan->dispatcher = ep->dispatcher == &moe_dispatcher_fused && ep->comm && !pad_capacity
                           ? &moe_dispatcher_fused
                           : &moe_dispatcher_alltoall;
    plan->fused = plan->dispatcher == &moe_dispatcher_fused;
    plan->sync_free = 0; /* the host planned it */
    if (plan->fused)
        moe_dispatch_fused_plan(plan, rank, P, all, be);

    /* host maps */
    int rows = plan->R_send > plan->R_recv ? plan->R_send : plan->R_recv;
    if (plan->R_kept > rows)
        rows = plan->R_kept;
    int *h_send = malloc(sizeof(int) * (rows + 1)), *h_unpad = malloc(sizeof(int) * (rows + 1));
    int *h_sort = malloc(sizeof(int) * (rows + 1)), *h_unsort = malloc(sizeof(int) * (rows + 1));
    MOE_ASSERT(h_send && h_unpad && h_sort && h_unsort);
    if (pad_capacity)
        moe_capacity_pad_maps(h_send, h_unpad, counts, E, pad_capacity);
    if (!plan->fused) /* the fused path needs no maps */
        moe_dispatch_sort_maps(h_sort, h_unsort, plan->recv_chunks, P, EL);

    /* upload */
    if (rows > plan->cap_rows) {
        be->free(plan->send_map);
        be->free(plan->unpad_map);
        be->free(plan->sort_map);
        be->free(plan->unsort_map);
        size_t bytes = sizeof(int) * (size_t)(rows + 1);
        plan->send_map = be->alloc(bytes);
        plan->unpad_map = be->alloc(bytes);
        plan->sort_map = be->alloc(bytes);
        plan->unsort_map = be->alloc(bytes);
        MOE_CHECK_ALLOC(plan->send_map && plan->unpad_map && plan->sort_map && plan->unsort_map,
                        4 * bytes, "the all-to-all dispatcher's maps");
        plan->cap_rows = rows;
    }
    /* without padding the send layout is the permuted layout itself: no send/unpad maps */
    plan->padded = pad_capacity > 0;
    if (plan->padded) {
        be->from_host(plan->send_map, h_send, sizeof(int) * plan->R_send);
        be->from_host(plan->unpad_map, h_unpad, sizeof(int) * plan->R_kept);
    }
    if (!plan->fused) {
        be->from_host(plan->sort_map, h_sort, sizeof(int) * plan->R_recv);
        be->from_host(plan->unsort_map, h_unsort, sizeof(int) * plan->R_recv);
    }
    free(h_send); free(h_unpad); free(h_sort); free(h_unsort);
    free(mine); free(all);
}

/* ------------------------------------------------------------ moving rows */

/* counts per rank in elements: rows · C */
static void scale_counts(size_t *out, const size_t *rows, int P, int C) {
    for (int p = 0; p < P; p++)
        out[p] = rows[p] * (size_t)C;
}

/* The one routine behind all four directions: is_act picks activations (gather_rows, the
 * backend's type) or full precision (gather_reals, C = 1); to_experts the direction. */
/* The plan's chunk lists (in rows) scaled to rows of C elements, for moe_comm_exchange();
 * the caller frees both */
static void chunks_in_elements(const moe_dispatch_plan *plan, int nch, int C,
                               moe_comm_chunk **send, moe_comm_chunk **recv) {
    moe_comm_chunk *cs = malloc(sizeof *cs * nch), *cr = malloc(sizeof *cr * nch);
    MOE_ASSERT(cs && cr);
    for (int i = 0; i < nch; i++) {
        cs[i] = plan->send_chunks[i];
        cs[i].offset *= (size_t)C;
        cs[i].count *= (size_t)C;
        cr[i] = plan->recv_chunks[i];
        cr[i].offset *= (size_t)C;
        cr[i].count *= (size_t)C;
    }
    *send = cs;
    *recv = cr;
}

static void move(moe_ep *ep, const moe_dispatch_plan *plan, void *dst, const void *src, int C,
                 int is_act, int to_experts) {
    const moe_backend *be = ep->be;
    const size_t elem = is_act ? be->act_size : sizeof(moe_real);
    const moe_dtype t = is_act ? moe_dtype_act(be) : moe_dtype_real();
    const int P = ep->comm ? ep->size : 1;
    ep->send_buf = moe_grow(be, ep->send_buf, &ep->send_cap, elem * C * (size_t)(plan->R_send + 1));
    ep->recv_buf = moe_grow(be, ep->recv_buf, &ep->recv_cap, elem * C * (size_t)(plan->R_recv + 1));
    size_t *sc = malloc(sizeof(size_t) * P), *rc = malloc(sizeof(size_t) * P);
    MOE_ASSERT(sc && rc);
    scale_counts(sc, plan->send_rows, P, C);
    scale_counts(rc, plan->recv_rows, P, C);
#define GATHER(d, s, map, rows)                                            \
    do {                                                                   \
        if (is_act)                                                        \
            be->gather_rows((d), (s), (map), (rows), C);                   \
        else                                                               \
            be->gather_reals((moe_real *)(d), (const moe_real *)(s), (map), (rows)); \
    } while (0)
    /* chunk lists in elements */
    const int nch = P * plan->E_local;
    moe_comm_chunk *cs, *cr;
    chunks_in_elements(plan, nch, C, &cs, &cr);
    if (to_experts) {
        /* permuted → (padded) send layout → exchange straight into [el][src] */
        const void *send = src;
        if (plan->padded) {
            GATHER(ep->send_buf, src, plan->send_map, plan->R_send);
            send = ep->send_buf;
        }
        if (ep->comm)
            moe_comm_exchange(ep->comm, send, cs, nch, dst, cr, nch, t);
        else /* one rank: [src][el] is [el] already, the sort is a gather */
            GATHER(dst, send, plan->sort_map, plan->R_recv);
    } else {
        /* [el][src] → exchange back into the (padded) send layout → (unpad) → permuted */
        void *back = plan->padded ? ep->send_buf : dst;
        if (ep->comm)
            moe_comm_exchange(ep->comm, src, cr, nch, back, cs, nch, t);
        else
            GATHER(back, src, plan->unsort_map, plan->R_recv);
        if (plan->padded)
            GATHER(dst, back, plan->unpad_map, plan->R_kept);
    }
    free(cs);
    free(cr);
#undef GATHER
    free(sc);
    free(rc);
}

/* One exchange toward the experts of rows of C elements of type t, with no padding or
 * sorting step (the caller's rows are in the send layout already): the FP8 dispatch's
 * codes and scales */
static void exchange_to_experts(moe_ep *ep, const moe_dispatch_plan *plan, void *dst,
                                const void *src, int C, moe_dtype t) {
    const int nch = ep->size * plan->E_local;
    moe_comm_chunk *cs, *cr;
    chunks_in_elements(plan, nch, C, &cs, &cr);
    moe_comm_exchange(ep->comm, src, cs, nch, dst, cr, nch, t);
    free(cs);
    free(cr);
}

/* a backend quantizer's status: the shapes were checked at start-up (lowp.c) */
#define fp8_ok(st, err) MOE_REQUIRE_OK(st, err, "FP8 dispatch")

void moe_dispatch_rows_fp8(moe_ep *ep, const moe_dispatch_plan *plan, void *dst, const void *src,
                           int H) {
    const moe_backend *be = ep->be;
    MOE_ASSERT(ep->comm && ep->fp8 && H % MOE_QUANT_BLOCK == 0);
    const size_t S = (size_t)H / MOE_QUANT_BLOCK, Rs = (size_t)plan->R_send,
                 Rr = (size_t)plan->R_recv;
    const void *rows = src;
    if (plan->padded) { /* the send layout first (padding rows are zeros: zero codes) */
        ep->send_buf = moe_grow(be, ep->send_buf, &ep->send_cap, be->act_size * H * (Rs + 1));
        be->gather_rows(ep->send_buf, src, plan->send_map, plan->R_send, H);
        rows = ep->send_buf;
    }
    ep->q_send = moe_grow(be, ep->q_send, &ep->q_send_cap, (size_t)H * (Rs + 1));
    ep->s_send = moe_grow(be, ep->s_send, &ep->s_send_cap, sizeof(float) * S * (Rs + 1));
    ep->q_recv = moe_grow(be, ep->q_recv, &ep->q_recv_cap, (size_t)H * (Rr + 1));
    ep->s_recv = moe_grow(be, ep->s_recv, &ep->s_recv_cap, sizeof(float) * S * (Rr + 1));
    moe_error err;
    /* quantize once, before the exchange: each row's 1×128 tiles are its own, so these are
     * the codes the experts' QDQ of the received rows would make */
    if (Rs > 0)
        fp8_ok(be->fp8_quant_act(ep->q_send, ep->s_send, NULL, rows, plan->R_send, H,
                                 ep->fp8_format, ep->fp8_pow2, &err), &err);
    exchange_to_experts(ep, plan, ep->q_recv, ep->q_send, H, MOE_DTYPE_BYTE);
    exchange_to_experts(ep, plan, ep->s_recv, ep->s_send, (int)S, MOE_DTYPE_F32);
    if (Rr > 0)
        fp8_ok(be->fp8_dequant_act(dst, ep->q_recv, ep->s_recv, plan->R_recv, H, ep->fp8_format,
                                   &err), &err);
}

void moe_dispatch_rows(moe_ep *ep, const moe_dispatch_plan *plan, void *dst, const void *src,
                       int C) {
    move(ep, plan, dst, src, C, 1, 1);
}

void moe_dispatch_reals(moe_ep *ep, const moe_dispatch_plan *plan, moe_real *dst,
                        const moe_real *src) {
    move(ep, plan, dst, src, 1, 0, 1);
}

void moe_combine_rows(moe_ep *ep, const moe_dispatch_plan *plan, void *dst, const void *src,
                      int C) {
    move(ep, plan, dst, src, C, 1, 0);
}

void moe_combine_reals(moe_ep *ep, const moe_dispatch_plan *plan, moe_real *dst,
                       const moe_real *src) {
    move(ep, plan, dst, src, 1, 0, 0);
}

/* ------------------------------------------------------- the dispatcher strategy */

/* The EP group's context, or (a capacity without EP) the workspace's single-rank one */
static moe_ep *ep_of(const moe_layer_dims *d, moe_layer_workspace *ws) {
    return d->ep ? d->ep : &ws->single;
}

void moe_dispatch_alltoall_plan(const moe_backend *be, const moe_layer_dims *d, moe_layer_acts *a,
                                moe_layer_workspace *ws) {
    const int N = d->N, E = d->E, k = d->k, NK = N * k;
    /* routing to the host: counts for the statistics, and the capacity decision */
    int *didx = malloc(sizeof(int) * NK), *off = malloc(sizeof(int) * (E + 2));
    long long *kept = malloc(sizeof(long long) * E);
    MOE_ASSERT(didx && off && kept);
    const int cap = moe_capacity_route(be, d, a, didx);
    be->from_host(a->dispatch_idx, didx, sizeof(int) * NK);

    /* local permutation into E + 1 buckets: the last one holds the dropped assignments */
    be->permute_index(a->perm_src, a->row_of, off, NULL, NULL, a->dispatch_idx, N, k, E + 1);
    for (int e = 0; e < E; e++)
        kept[e] = off[e + 1] - off[e];
    moe_dispatch_plan *pl = &a->plan;
    moe_dispatch_plan_build(ep_of(d, ws), pl, kept, E, d->pad_to_capacity ? cap : 0);
    moe_expert_rows_reserve(be, d, a, ws, pl, (size_t)pl->R_recv + 1);
    free(didx);
    free(off);
    free(kept);
}

/* permuted copies (token rows, routing weights) through the exchange */
static void a2a_dispatch(const moe_backend *be, const moe_layer_dims *d, moe_layer_acts *a,
                         moe_layer_workspace *ws, const void *x) {
    moe_ep *ep = ep_of(d, ws);
    /* (the permuted rows are only sent: scratch, moe_layer_xp()) */
    const void *xp = moe_dispatch_permute(be, d, a, ws, x);
    void *xe = moe_layer_xe(a, ws); /* (scratch where the experts keep x's FP8 copy) */
    if (ep->fp8) /* chapter 05: FP8 codes and scales on the wire (--moe-fp8-dispatch) */
        moe_dispatch_rows_fp8(ep, &a->plan, xe, xp, d->H);
    else
        moe_dispatch_rows(ep, &a->plan, xe, xp, d->H);
    moe_dispatch_reals(ep, &a->plan, a->we, a->wp);
    moe_prof_mark(MOE_PROF_OTHER);
}

/* Expert-side rows @p src back to the permuted layout @p dst; the rows of dropped
 * assignments (after R_kept) are zero */
static void rows_home(const moe_backend *be, const moe_layer_dims *d, const moe_layer_acts *a,
                      moe_layer_workspace *ws, void *dst, const void *src) {
    const int R_kept = a->plan.R_kept, H = d->H;
    moe_combine_rows(ep_of(d, ws), &a->plan, dst, src, H);
    be->zero(A(dst, (size_t)R_kept * H), be->act_size * (size_t)(d->N * d->k - R_kept) * H);
}

static void a2a_combine(const moe_backend *be, const moe_layer_dims *d, const moe_layer_acts *a,
                        moe_layer_workspace *ws, void *out) {
    rows_home(be, d, a, ws, ws->yp, ws->ye);
    moe_dispatch_unpermute(be, d, a, out, ws->yp);
    moe_prof_mark(MOE_PROF_OTHER);
}

/* output gradients travel like tokens */
static void a2a_dispatch_grad(const moe_backend *be, const moe_layer_dims *d,
                              const moe_layer_acts *a, moe_layer_workspace *ws,
                              const void *dout) {
    be->permute_tokens(ws->dyp, dout, a->perm_src, d->N * d->k, d->k, d->H);
    moe_dispatch_rows(ep_of(d, ws), &a->plan, ws->dye, ws->dyp, d->H);
    moe_prof_mark(MOE_PROF_OTHER);
}

/* input and routing-weight gradients come back like outputs, then to token order */
static void a2a_combine_grad(const moe_backend *be, const moe_layer_dims *d,
                             const moe_layer_acts *a, moe_layer_workspace *ws, void *dx) {
    const int R_kept = a->plan.R_kept, NK = d->N * d->k;
    rows_home(be, d, a, ws, ws->dxp, ws->ye);
    moe_combine_reals(ep_of(d, ws), &a->plan, ws->dwp, ws->dwe);
    be->zero(ws->dwp + R_kept, sizeof(moe_real) * (size_t)(NK - R_kept));
    moe_prof_mark(MOE_PROF_OTHER);
    moe_dispatch_unpermute_grads(be, d, a, ws, dx);
}

void moe_dispatch_alltoall_free(const moe_backend *be, moe_dispatch_plan *plan) {
    be->free(plan->send_map);
    be->free(plan->unpad_map);
    be->free(plan->sort_map);
    be->free(plan->unsort_map);
    free(plan->send_rows);
    free(plan->recv_rows);
    free(plan->expert_offset);
    free(plan->send_chunks);
    free(plan->recv_chunks);
}

const moe_dispatcher moe_dispatcher_alltoall = {
    .name = "alltoall", .expert_side = 1, .plan = moe_dispatch_alltoall_plan,
    .dispatch = a2a_dispatch, .combine = a2a_combine, .dispatch_grad = a2a_dispatch_grad,
    .combine_grad = a2a_combine_grad, .free = moe_dispatch_alltoall_free,
};
