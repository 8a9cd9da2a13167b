/* The fused dispatcher (chapter 02, --moe-alltoall-path fused): the all-to-all as two
 * kernels that store and load rows straight in the peers' memory — see dispatch.h. It
 * shares the alltoall dispatcher's plan (dispatch_alltoall.c), with shifts for maps. This
 * is the only file that reaches the NVLink kernels. */
#include "moe/dispatch.h"

#include <stdlib.h>

#include "moe/dispatch_nvlink.h"
#include "moe/layer.h"
#include "profile.h"

void moe_dispatch_fused_plan(moe_dispatch_plan *plan, int rank, int P, const long long *counts,
                             const long long *all, const moe_backend *be) {
    const int E = plan->E, EL = plan->E_local;
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
    /* each expert's shift from this rank's permuted rows to its rows on the expert's rank */
    int *h_shift = malloc(sizeof(int) * E);
    MOE_ASSERT(h_shift);
    long long perm_off = 0;
    for (int e = 0; e < E; e++) {
        const int q = e / EL, el = e % EL;
        long long base = 0; /* q's earlier local experts, then earlier ranks' rows for e */
        for (int l = 0; l < el; l++)
            for (int p = 0; p < P; p++)
                base += all[(size_t)p * E + q * EL + l];
        for (int p = 0; p < rank; p++)
            base += all[(size_t)p * E + e];
        h_shift[e] = (int)(base - perm_off);
        perm_off += counts[e];
    }
    if (E > plan->shift_cap) {
        be->free(plan->shift);
        plan->shift = be->alloc(sizeof(int) * E);
        MOE_ASSERT(plan->shift);
        plan->shift_cap = E;
    }
    be->from_host(plan->shift, h_shift, sizeof(int) * E);
    free(h_shift);
}

void *moe_dispatch_sym_rows(moe_ep *ep, const moe_dispatch_plan *plan, moe_sym_buf *b,
                            size_t row_bytes) {
    const size_t need = row_bytes * ((size_t)plan->max_recv + 1);
    /* a quarter of headroom: the largest rank's rows move a little every step, and each
     * growth is a collective registration */
    if (!b->ptr || b->bytes < need)
        moe_comm_sym_reserve(ep->comm, b, need + need / 4);
    return b->ptr;
}

void moe_dispatch_fused(moe_ep *ep, const moe_dispatch_plan *plan, moe_sym_buf *rows,
                        moe_sym_buf *reals, const void *x, const moe_real *w, const int *idx,
                        const int *row_of, int N, int k, int C) {
    MOE_ASSERT(plan->fused);
#if defined(MOE_HAVE_NCCL) && !defined(MOE_REAL_DOUBLE)
    moe_nvlink_dispatch(ep->comm, rows, reals, x, w, idx, row_of, plan->shift, N, k, plan->E,
                        plan->E_local, C);
#else
    (void)ep; (void)rows; (void)reals; (void)x; (void)w; (void)idx; (void)row_of; (void)N;
    (void)k; (void)C;
    moe_comm_abort(NULL, 1, "the fused dispatcher needs a CUDA + NCCL build");
#endif
}

void moe_combine_fused(moe_ep *ep, const moe_dispatch_plan *plan, void *out, int accumulate,
                       moe_real *dwp, moe_sym_buf *rows, moe_sym_buf *reals, const int *idx,
                       const int *row_of, int N, int k, int C) {
    MOE_ASSERT(plan->fused);
#if defined(MOE_HAVE_NCCL) && !defined(MOE_REAL_DOUBLE)
    moe_nvlink_combine(ep->comm, out, accumulate, dwp, rows, reals, idx, row_of, plan->shift, N,
                       k, plan->E, plan->E_local, C);
#else
    (void)ep; (void)out; (void)accumulate; (void)dwp; (void)rows; (void)reals; (void)idx;
    (void)row_of; (void)N; (void)k; (void)C;
    moe_comm_abort(NULL, 1, "the fused dispatcher needs a CUDA + NCCL build");
#endif
}

/* ------------------------------------------------------- the dispatcher strategy */

/* every token row read once and stored into its experts' rows, with its weight */
static void fused_dispatch(const moe_backend *be, const moe_layer_dims *d, moe_layer_acts *a,
                           moe_layer_workspace *ws, const void *x) {
    moe_dispatch_fused(d->ep, &a->plan, &a->xe_sym, &a->we_sym, x, a->topk_w, a->dispatch_idx,
                       a->row_of, d->N, d->k, d->H);
    moe_prof_mark(MOE_PROF_OTHER);
}

/* each token's k expert rows loaded from wherever they are and summed into out */
static void fused_combine(const moe_backend *be, const moe_layer_dims *d,
                          const moe_layer_acts *a, moe_layer_workspace *ws, void *out) {
    moe_combine_fused(d->ep, &a->plan, out, 0, NULL, &ws->ye_sym, NULL, a->dispatch_idx,
                      a->row_of, d->N, d->k, d->H);
    moe_prof_mark(MOE_PROF_OTHER);
}

/* output gradients travel like tokens */
static void fused_dispatch_grad(const moe_backend *be, const moe_layer_dims *d,
                                const moe_layer_acts *a, moe_layer_workspace *ws,
                                const void *dout) {
    moe_dispatch_fused(d->ep, &a->plan, &ws->dye_sym, NULL, dout, NULL, a->dispatch_idx,
                       a->row_of, d->N, d->k, d->H);
    moe_prof_mark(MOE_PROF_OTHER);
}

/* the kernel sums each token's input-gradient rows into dx itself and leaves the
 * routing-weight gradients in the permuted layout (dwp) */
static void fused_combine_grad(const moe_backend *be, const moe_layer_dims *d,
                               const moe_layer_acts *a, moe_layer_workspace *ws, void *dx) {
    moe_combine_fused(d->ep, &a->plan, dx, 1, ws->dwp, &ws->ye_sym, &ws->dwe_sym,
                      a->dispatch_idx, a->row_of, d->N, d->k, d->H);
    moe_prof_mark(MOE_PROF_OTHER);
    moe_dispatch_unpermute_grads(be, d, a, ws, NULL);
}

static void fused_free(const moe_backend *be, moe_dispatch_plan *plan) {
    be->free(plan->shift);
    moe_dispatch_alltoall_free(be, plan);
}

const moe_dispatcher moe_dispatcher_fused = {
    .name = "fused", .expert_side = 1, .plan = moe_dispatch_alltoall_plan,
    .dispatch = fused_dispatch, .combine = fused_combine, .dispatch_grad = fused_dispatch_grad,
    .combine_grad = fused_combine_grad, .free = fused_free,
};
