/* The fused dispatcher (chapter 02, --moe-alltoall-path fused): the all-to-all as two
 * kernels that store and load rows straight in the peers' memory — see dispatch.h. It
 * shares the alltoall dispatcher's plan (dispatch_alltoall.c), with shifts for maps. This
 * is the only file that reaches the NVLink kernels. */
#include "moe/dispatch.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/moe_ops.h" /* moe_cpu_fused_plan: the device plan's arithmetic, for the host plan */
#include "moe/experts.h"

#include "moe/dispatch_nvlink.h"
#include "moe/layer.h"
#include "profile.h"

void moe_dispatch_fused_plan(moe_dispatch_plan *plan, int rank, int P, const long long *all,
                             const moe_backend *be) {
    const int E = plan->E, EL = plan->E_local, W = E + 1;
    /* the largest rank's rows: every rank sizes its symmetric buffers for it */
    plan->max_recv = 0;
    for (int q = 0; q < P; q++) {
        long long r = 0;
        for (int p = 0; p < P; p++)
            for (int el = 0; el < EL; el++)
                r += all[(size_t)p * E + q * EL + el];
        if (r > plan->max_recv)
            plan->max_recv = (int)r;
    }
    plan->cap_recv = INT_MAX; /* the buffers hold every rank's rows */
    /* each expert's shift: the device plan's arithmetic (moe_cpu_fused_plan) on every rank's
     * permuted-row offsets, the running sums of the exchanged counts */
    int *off = malloc(sizeof(int) * (size_t)P * W), *h_shift = malloc(sizeof(int) * E);
    int *local = malloc(sizeof(int) * (EL + 1));
    MOE_ASSERT(off && h_shift && local);
    for (int p = 0; p < P; p++) {
        off[p * W] = 0;
        for (int e = 0; e < E; e++)
            off[p * W + e + 1] = off[p * W + e] + (int)all[(size_t)p * E + e];
    }
    moe_cpu_fused_plan(h_shift, local, NULL, off, P, rank, E, INT_MAX);
    if (E > plan->shift_cap) {
        be->free(plan->shift);
        plan->shift = be->alloc(sizeof(int) * E);
        MOE_ASSERT(plan->shift);
        plan->shift_cap = E;
    }
    be->from_host(plan->shift, h_shift, sizeof(int) * E);
    free(off);
    free(h_shift);
    free(local);
}

void *moe_dispatch_sym_rows(moe_ep *ep, const moe_dispatch_plan *plan, moe_sym_buf *b,
                            size_t row_bytes) {
    const size_t need = row_bytes * ((size_t)plan->max_recv + 1);
    /* a quarter of headroom: the largest rank's rows move a little every step, and each
     * growth is a collective registration (on the sync-free path max_recv is the static
     * budget, so the buffers are allocated once, and again only when the budget grows) */
    if (!b->ptr || b->bytes < need)
        moe_comm_sym_reserve(ep->comm, b, need + need / 4);
    return b->ptr;
}

/* ------------------------------------------- the CPU ranks' twin of the NVLink kernels */

/* On CPU ranks the symmetric buffers are MPI one-sided windows (comm.h): the same
 * addressing as kernels/dispatch_nvlink.cu — assignment a's row goes to row
 * row_of[a] + shift[e] of expert e's rank — with a put or a get per row, and fences where
 * the kernels have their barriers (the first: every peer is done with what it queued
 * before; the last: every transfer is complete). The combine gathers the k rows of each
 * token into the permuted layout and sums them with the backend's unpermute_sum, the
 * collective path's own op, so both paths agree bit for bit. */

/* where assignment a's row lives on its expert's rank: (peer, row), or -1 (dropped, or at
 * or past the receiver's capacity: an overflow the device plan has flagged) */
static int twin_row(const moe_dispatch_plan *p, const int *idx, const int *row_of,
                    const int *shift, size_t a, int *peer) {
    const int e = idx[a];
    if (e >= p->E)
        return -1;
    const int r = row_of[a] + shift[e];
    *peer = e / p->E_local;
    return r < p->cap_recv ? r : -1;
}

static void twin_dispatch(moe_ep *ep, const moe_dispatch_plan *plan, moe_sym_buf *rows,
                          moe_sym_buf *reals, const void *x, const moe_real *w, const int *idx,
                          const int *row_of, int N, int k, int C) {
    const size_t rb = ep->be->act_size * (size_t)C;
    moe_comm_sym_fence(rows);
    if (reals)
        moe_comm_sym_fence(reals);
    for (size_t a = 0; a < (size_t)N * k; a++) {
        int q = 0;
        const int r = twin_row(plan, idx, row_of, plan->shift, a, &q);
        if (r < 0)
            continue;
        moe_comm_sym_put(rows, q, (size_t)r * rb, (const char *)x + a / k * rb, rb);
        if (reals)
            moe_comm_sym_put(reals, q, (size_t)r * sizeof(moe_real), w + a, sizeof(moe_real));
    }
    moe_comm_sym_fence(rows);
    if (reals)
        moe_comm_sym_fence(reals);
}

static void twin_combine(moe_ep *ep, const moe_dispatch_plan *plan, void *out, int accumulate,
                         moe_real *dwp, moe_sym_buf *rows, moe_sym_buf *reals, const int *idx,
                         const int *row_of, int N, int k, int C) {
    const moe_backend *be = ep->be;
    const size_t rb = be->act_size * (size_t)C, NK = (size_t)N * k;
    char *stage = ep->send_buf = moe_grow(be, ep->send_buf, &ep->send_cap, rb * NK + 1);
    moe_comm_sym_fence(rows);
    if (reals)
        moe_comm_sym_fence(reals);
    for (size_t a = 0; a < NK; a++) {
        int q = 0;
        const int r = twin_row(plan, idx, row_of, plan->shift, a, &q);
        char *dst = stage + (size_t)row_of[a] * rb;
        if (r < 0)
            memset(dst, 0, rb);
        else
            moe_comm_sym_get(rows, q, (size_t)r * rb, dst, rb);
        if (reals && r < 0)
            dwp[row_of[a]] = 0;
        else if (reals)
            moe_comm_sym_get(reals, q, (size_t)r * sizeof(moe_real), dwp + row_of[a],
                             sizeof(moe_real));
    }
    moe_comm_sym_fence(rows);
    if (reals)
        moe_comm_sym_fence(reals);
    if (!accumulate)
        be->zero(out, rb * (size_t)N);
    be->unpermute_sum(out, stage, row_of, N, k, C);
}

void moe_dispatch_fused(moe_ep *ep, const moe_dispatch_plan *plan, moe_sym_buf *rows,
                        moe_sym_buf *reals, const void *x, const moe_real *w, const int *idx,
                        const int *row_of, int N, int k, int C) {
    MOE_ASSERT(plan->fused);
    if (moe_comm_sym_on_host(rows)) {
        twin_dispatch(ep, plan, rows, reals, x, w, idx, row_of, N, k, C);
        return;
    }
#if defined(MOE_HAVE_NCCL) && !defined(MOE_REAL_DOUBLE)
    moe_nvlink_dispatch(ep->comm, rows, reals, x, w, idx, row_of, plan->shift, N, k, plan->E,
                        plan->E_local, C, plan->cap_recv);
#else
    moe_comm_abort(NULL, 1, "the fused dispatcher on GPU ranks needs a CUDA + NCCL build");
#endif
}

void moe_combine_fused(moe_ep *ep, const moe_dispatch_plan *plan, void *out, int accumulate,
                       moe_real *dwp, moe_sym_buf *rows, moe_sym_buf *reals, const int *idx,
                       const int *row_of, int N, int k, int C) {
    MOE_ASSERT(plan->fused);
    if (moe_comm_sym_on_host(rows)) {
        twin_combine(ep, plan, out, accumulate, dwp, rows, reals, idx, row_of, N, k, C);
        return;
    }
#if defined(MOE_HAVE_NCCL) && !defined(MOE_REAL_DOUBLE)
    moe_nvlink_combine(ep->comm, out, accumulate, dwp, rows, reals, idx, row_of, plan->shift, N,
                       k, plan->E, plan->E_local, C, plan->cap_recv);
#else
    moe_comm_abort(NULL, 1, "the fused dispatcher on GPU ranks needs a CUDA + NCCL build");
#endif
}

/* ------------------------------------------- the plan on the device (chapter 06) */

/* A backend int buffer of n entries, allocated on the first plan (the warm-up step, before
 * any capture) and kept. */
static int *plan_buffer(const moe_backend *be, int *p, int n) {
    if (p)
        return p;
    p = be->alloc(sizeof(int) * (size_t)n);
    MOE_CHECK_ALLOC(p, sizeof(int) * (size_t)n, "the fused dispatcher's device plan");
    return p;
}

/* The sync-free plan (moe_layer_sync_free(): our grouped kernel, dropless, the step flags):
 *   1. the local permutation into backend memory (N·k rows: every assignment has one);
 *   2. the count exchange ON THE STREAM: an all-gather of every rank's E+1 offsets
 *      through the comm layer (NCCL on GPU ranks, MPI on CPU ranks), no host read;
 *   3. the device op fused_plan: the shifts, and the local experts' offsets for the grouped
 *      kernel, clamped to the static budget of expert-side rows; a rank that would receive
 *      more raises MOE_STEP_OVERFLOW, the kernels store no row past the budget, and the
 *      trainer re-runs the step with a grown budget (moe_model_grow_moe_budget()).
 * Everything the host keeps is static: E, the budget, the buffers. */
static void device_plan(const moe_backend *be, const moe_layer_dims *d, moe_layer_acts *a,
                        moe_layer_workspace *ws) {
    moe_ep *ep = d->ep;
    moe_dispatch_plan *pl = &a->plan;
    const int E = d->E, P = ep->size, NK = d->N * d->k;
    memset(a->counts, 0, sizeof(long long) * E); /* the loads are counted on the device */
    a->dropped = 0;
    pl->dispatcher = &moe_dispatcher_fused;
    pl->fused = pl->sync_free = 1;
    pl->E = E;
    pl->E_local = E / P;
    pl->R_kept = pl->R_send = NK;
    pl->R_recv = pl->max_recv = pl->cap_recv = d->budget_rows; /* the static expert side */
    pl->my_off = plan_buffer(be, pl->my_off, E + 1);
    pl->all_off = plan_buffer(be, pl->all_off, P * (E + 1));
    if (!pl->shift) {
        pl->shift = plan_buffer(be, NULL, E);
        pl->shift_cap = E;
    }
    be->permute_index_budget(a->perm_src, a->row_of, pl->my_off, d->step_flags, a->topk_idx,
                             d->N, d->k, E, NK);
    moe_comm_all_gather(ep->comm, pl->my_off, pl->all_off, (size_t)E + 1, MOE_DTYPE_I32);
    be->fused_plan(pl->shift, a->dev_offset, d->step_flags, pl->all_off, P, ep->rank, E,
                   d->budget_rows);
    moe_expert_rows_reserve(be, d, a, ws, pl, (size_t)d->budget_rows + 1);
}

static void fused_plan(const moe_backend *be, const moe_layer_dims *d, moe_layer_acts *a,
                       moe_layer_workspace *ws) {
    if (moe_layer_sync_free(d))
        device_plan(be, d, a, ws);
    else
        moe_dispatch_alltoall_plan(be, d, a, ws);
}

/* the expert of each assignment: the capacity's (E: dropped) on the host plan; the
 * router's own picks on the sync-free one (dropless) */
static const int *expert_of(const moe_layer_acts *a) {
    return a->plan.sync_free ? a->topk_idx : a->dispatch_idx;
}

/* ------------------------------------------------------- the dispatcher strategy */

/* every token row read once and stored into its experts' rows, with its weight: the
 * layer's own xe, or, where the experts keep x's FP8 copy instead, the workspace's dye
 * (moe_layer_xe()), which the gradients reuse later and every MoE layer shares */
static void fused_dispatch(const moe_backend *be, const moe_layer_dims *d, moe_layer_acts *a,
                           moe_layer_workspace *ws, const void *x) {
    moe_sym_buf *rows = a->xe_sym.ptr ? &a->xe_sym : &ws->dye_sym;
    MOE_ASSERT(rows->ptr == moe_layer_xe(a, ws));
    moe_dispatch_fused(d->ep, &a->plan, rows, &a->we_sym, x, a->topk_w, expert_of(a),
                       a->row_of, d->N, d->k, d->H);
    moe_prof_mark(MOE_PROF_OTHER);
}

/* each token's k expert rows loaded from wherever they are and summed into out */
static void fused_combine(const moe_backend *be, const moe_layer_dims *d,
                          const moe_layer_acts *a, moe_layer_workspace *ws, void *out) {
    moe_combine_fused(d->ep, &a->plan, out, 0, NULL, &ws->ye_sym, NULL, expert_of(a),
                      a->row_of, d->N, d->k, d->H);
    moe_prof_mark(MOE_PROF_OTHER);
}

/* output gradients travel like tokens */
static void fused_dispatch_grad(const moe_backend *be, const moe_layer_dims *d,
                                const moe_layer_acts *a, moe_layer_workspace *ws,
                                const void *dout) {
    moe_dispatch_fused(d->ep, &a->plan, &ws->dye_sym, NULL, dout, NULL, expert_of(a),
                       a->row_of, d->N, d->k, d->H);
    moe_prof_mark(MOE_PROF_OTHER);
}

/* the kernel sums each token's input-gradient rows into dx itself and leaves the
 * routing-weight gradients in the permuted layout (dwp) */
static void fused_combine_grad(const moe_backend *be, const moe_layer_dims *d,
                               const moe_layer_acts *a, moe_layer_workspace *ws, void *dx) {
    moe_combine_fused(d->ep, &a->plan, dx, 1, ws->dwp, &ws->ye_sym, &ws->dwe_sym,
                      expert_of(a), a->row_of, d->N, d->k, d->H);
    moe_prof_mark(MOE_PROF_OTHER);
    moe_dispatch_unpermute_grads(be, d, a, ws, NULL);
}

static void fused_free(const moe_backend *be, moe_dispatch_plan *plan) {
    be->free(plan->shift);
    be->free(plan->my_off);
    be->free(plan->all_off);
    moe_dispatch_alltoall_free(be, plan);
}

const moe_dispatcher moe_dispatcher_fused = {
    .name = "fused", .expert_side = 1, .plan = fused_plan,
    .dispatch = fused_dispatch, .combine = fused_combine, .dispatch_grad = fused_dispatch_grad,
    .combine_grad = fused_combine_grad, .free = fused_free,
};
