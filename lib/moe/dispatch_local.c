/* The local dispatcher (chapter 01): one rank, dropless — see dispatch.h. The experts run
 * on the permuted rows in place, so dispatching is a permutation and combining the sum
 * of each token's k rows. */
#include "moe/dispatch.h"

#include <string.h>

#include "moe/layer.h"
#include "profile.h"

/* The N·k assignments sorted by expert. Sync-free (chapter 06, our grouped kernel): the
 * offsets stay in device memory, the rows in the static budget, an overflow raises the
 * step flag (the expert loads are counted on the device by the model, from the router's
 * picks: moe_model_forward). Otherwise expert_offset comes
 * back to the host (and to the device for our grouped kernel), with the counts for the
 * statistics. */
static void local_plan(const moe_backend *be, const moe_layer_dims *d, moe_layer_acts *a,
                       moe_layer_workspace *ws) {
    memset(a->counts, 0, sizeof(long long) * d->E);
    a->dropped = 0;
    if (moe_layer_sync_free(d)) {
        be->permute_index_budget(a->perm_src, a->row_of, a->dev_offset, d->step_flags,
                                 a->topk_idx, d->N, d->k, d->E, moe_layer_permuted_rows(d));
        return;
    }
    be->permute_index(a->perm_src, a->row_of, a->expert_offset,
                      d->experts == MOE_EXPERTS_KERNEL ? a->dev_offset : NULL, a->counts,
                      a->topk_idx, d->N, d->k, d->E);
}

/* each token copied to its k rows, each row with its routing weight */
static void local_dispatch(const moe_backend *be, const moe_layer_dims *d, moe_layer_acts *a,
                           moe_layer_workspace *ws, const void *x) {
    if (d->permute_fusion) /* fc1 gathers the tokens itself (experts.c): only weights move */
        be->permute_weights(a->wp, a->topk_w, a->perm_src, moe_layer_permuted_rows(d));
    else
        moe_dispatch_permute(be, d, a, ws, x);
    moe_prof_mark(MOE_PROF_PERMUTE);
}

/* out[n] = Σ_j expert output of (n, j); under the fused scatter fc2 left them in slot
 * order already (row n·k + j of yp), so the sum reads each token's k rows contiguously */
static void local_combine(const moe_backend *be, const moe_layer_dims *d,
                          const moe_layer_acts *a, moe_layer_workspace *ws, void *out) {
    if (d->permute_scatter) {
        be->zero(out, be->act_size * (size_t)d->N * d->H);
        be->unpermute_sum_slots(out, ws->yp, a->row_of, d->N, d->k, d->H);
    } else {
        moe_dispatch_unpermute(be, d, a, out, ws->yp);
    }
    moe_prof_mark(MOE_PROF_UNPERMUTE);
}

/* the combine was a sum, so each permuted row receives its token's gradient */
static void local_dispatch_grad(const moe_backend *be, const moe_layer_dims *d,
                                const moe_layer_acts *a, moe_layer_workspace *ws,
                                const void *dout) {
    be->permute_tokens(ws->dyp, dout, a->perm_src, moe_layer_permuted_rows(d), d->k, d->H);
    moe_prof_mark(MOE_PROF_PERMUTE);
}

static void local_combine_grad(const moe_backend *be, const moe_layer_dims *d,
                               const moe_layer_acts *a, moe_layer_workspace *ws, void *dx) {
    moe_dispatch_unpermute_grads(be, d, a, ws, dx);
}

/* the plan of the local dispatcher lives in the layer's own buffers */
static void local_free(const moe_backend *be, moe_dispatch_plan *plan) {}

const moe_dispatcher moe_dispatcher_local = {
    .name = "local", .expert_side = 0, .plan = local_plan, .dispatch = local_dispatch,
    .combine = local_combine, .dispatch_grad = local_dispatch_grad,
    .combine_grad = local_combine_grad, .free = local_free,
};
