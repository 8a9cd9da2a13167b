/* Choosing a dispatcher, and what the dispatchers share: see dispatch.h. */
#include "moe/dispatch.h"

#include <stdio.h>
#include <string.h>

#include "log.h"
#include "lowp.h"
#include "moe/layer.h"
#include "profile.h"

/* Chapter 05's FP8 dispatch: on under --fp8-recipe blockwise with EP > 1 where the
 * collective all-to-all moves the rows, unless --moe-fp8-dispatch off. Elsewhere the tokens
 * travel in the activation type and the log says why. */
static void choose_fp8(moe_ep *ep, const moe_config *c, int verbose) {
    ep->fp8 = 0;
    const int blockwise = c->fp8_format[0] && strcmp(c->fp8_format, "none") != 0 &&
                          strcmp(c->fp8_recipe, "blockwise") == 0;
    if (!blockwise || !ep->comm || strcmp(c->moe_fp8_dispatch, "off") == 0)
        return;
    const char *why = ep->dispatcher == &moe_dispatcher_allgather
                          ? "the allgather dispatcher gathers whole token batches"
                      : ep->dispatcher == &moe_dispatcher_fused
                          ? "the fused NVLink kernels store activation-type rows"
                      : c->expert_tensor_parallel_size > 1
                          ? "ETP gathers the expert-side rows again"
                          : NULL;
    if (why) {
        if (verbose)
            moe_log_info("FP8 dispatch: off (%s); the tokens travel in the activation type",
                         why);
        return;
    }
    moe_lowp lp; /* the activation role's format and scales, as the experts' QDQ has them */
    moe_error e;
    if (moe_lowp_from_config(&lp, c, &e) != MOE_OK) /* (validated: not reached) */
        return;
    ep->fp8 = 1;
    ep->fp8_format = lp.spec[MOE_LOWP_ACTIVATION].format;
    ep->fp8_pow2 = lp.spec[MOE_LOWP_ACTIVATION].pow2;
    if (verbose)
        moe_log_info("FP8 dispatch: the tokens cross the all-to-all as 1x128 FP8 codes and "
                     "fp32 scales (--moe-fp8-dispatch off: in the activation type)");
}

static moe_status choose(moe_ep *ep, const moe_config *c, int verbose, moe_error *err);

moe_status moe_ep_choose_dispatcher(moe_ep *ep, const moe_config *c, int verbose,
                                    moe_error *err) {
    MOE_TRY(choose(ep, c, verbose, err));
    choose_fp8(ep, c, verbose);
    return MOE_OK;
}

static moe_status choose(moe_ep *ep, const moe_config *c, int verbose, moe_error *err) {
    if (c->dispatcher_type == MOE_DISPATCHER_ALLGATHER) {
        ep->dispatcher = &moe_dispatcher_allgather;
        return MOE_OK;
    }
    ep->dispatcher = &moe_dispatcher_alltoall;
    if (!ep->comm || c->alltoall_path == MOE_A2A_COLLECTIVE)
        return MOE_OK;
    /* auto takes the fused kernels on GPU ranks only: on CPU ranks the fused path is their
     * twin over MPI windows (dispatch_fused.c), which tests the plan but is not faster */
    if (c->alltoall_path == MOE_A2A_AUTO && ep->be->device != MOE_DEVICE_CUDA) {
        if (verbose)
            moe_log_info("alltoall dispatcher: collective (on CPU ranks the fused path is a "
                         "twin over MPI windows, for tests: --moe-alltoall-path fused)");
        return MOE_OK;
    }
    /* the fused kernels where the GPUs of the EP group share memory, else the collective;
     * peer access is collective: every rank agrees */
    char why[320];
    const int ok = moe_config_fused_fits(c, why, sizeof why) &&
                   moe_comm_peer_access(ep->comm, why, sizeof why);
    if (!ok && c->alltoall_path == MOE_A2A_FUSED)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "--moe-alltoall-path fused is not possible here: %s (use "
                             "--moe-alltoall-path auto or collective)",
                             why);
    /* padding to capacity sends the collective path's static layout */
    if (ok && !c->moe_pad_expert_input_to_capacity)
        ep->dispatcher = &moe_dispatcher_fused;
    if (verbose) {
        if (ep->dispatcher == &moe_dispatcher_fused)
            moe_log_info("alltoall dispatcher: fused kernels through the GPUs' shared "
                         "memory (NVLink)");
        else if (ok)
            moe_log_info("alltoall dispatcher: collective (padding to capacity needs its "
                         "send layout)");
        else
            moe_log_info("alltoall dispatcher: collective (the fused path is not possible: %s)",
                         why);
    }
    return MOE_OK;
}

void moe_dispatch_plan_free(const moe_backend *be, moe_dispatch_plan *plan) {
    if (plan->dispatcher)
        plan->dispatcher->free(be, plan);
    memset(plan, 0, sizeof *plan);
}

void *moe_grow(const moe_backend *be, void *p, size_t *cap, size_t bytes) {
    if (bytes <= *cap)
        return p;
    be->free(p);
    p = be->alloc(bytes);
    MOE_CHECK_ALLOC(p, bytes, "a dispatcher buffer");
    *cap = bytes;
    return p;
}

void moe_ep_free(moe_ep *ep) {
    if (!ep->be)
        return;
    ep->be->free(ep->send_buf);
    ep->be->free(ep->recv_buf);
    ep->be->free(ep->ag_buf);
    ep->be->free(ep->q_send);
    ep->be->free(ep->q_recv);
    ep->be->free(ep->s_send);
    ep->be->free(ep->s_recv);
    ep->send_buf = ep->recv_buf = ep->ag_buf = NULL;
    ep->q_send = ep->q_recv = NULL;
    ep->s_send = ep->s_recv = NULL;
    ep->send_cap = ep->recv_cap = ep->ag_cap = 0;
    ep->q_send_cap = ep->q_recv_cap = ep->s_send_cap = ep->s_recv_cap = 0;
}

void *moe_dispatch_permute(const moe_backend *be, const moe_layer_dims *d, moe_layer_acts *a,
                           moe_layer_workspace *ws, const void *x) {
    const int rows = moe_layer_permuted_rows(d); /* N·k, or a smaller budget (layer.h) */
    void *xp = moe_layer_xp(a, ws);
    be->permute_tokens(xp, x, a->perm_src, rows, d->k, d->H);
    be->permute_weights(a->wp, a->topk_w, a->perm_src, rows);
    return xp;
}

void moe_dispatch_unpermute(const moe_backend *be, const moe_layer_dims *d,
                            const moe_layer_acts *a, void *out, const void *rows) {
    be->zero(out, be->act_size * (size_t)d->N * d->H);
    be->unpermute_sum(out, rows, a->row_of, d->N, d->k, d->H);
}

void moe_dispatch_unpermute_grads(const moe_backend *be, const moe_layer_dims *d,
                                  const moe_layer_acts *a, moe_layer_workspace *ws, void *dx) {
    const int N = d->N, k = d->k;
    if (dx)
        be->unpermute_sum(dx, ws->dxp, a->row_of, N, k, d->H);
    be->zero(ws->dtopk_w, sizeof(moe_real) * (size_t)N * k);
    be->unpermute_weights(ws->dtopk_w, ws->dwp, a->row_of, N, k);
    moe_prof_mark(MOE_PROF_UNPERMUTE);
}
