/* Step 4 of the MoE layer, the local experts: see experts.h. */
#include "moe/experts.h"

#include "profile.h"

#define R sizeof(moe_real)
#define A(p, i) MOE_ACT(be, p, i)

moe_expert_impl moe_expert_impl_from_config(const moe_config *c, const moe_backend *be) {
    switch (c->expert_backend) {
    case MOE_EXPERT_BACKEND_LOOP:
        return MOE_EXPERTS_LOOP;
    case MOE_EXPERT_BACKEND_CUBLAS:
        return MOE_EXPERTS_CUBLAS;
    case MOE_EXPERT_BACKEND_GROUPED:
        return MOE_EXPERTS_KERNEL;
    case MOE_EXPERT_BACKEND_AUTO:
        break;
    }
    /* auto: the fastest on a GPU — our kernel where its shapes fit, else cuBLAS's grouped
     * GEMM; on the CPU the loop, unless Megatron's switch asks for grouped */
    if (be->device == MOE_DEVICE_CPU && !c->moe_grouped_gemm && !c->moe_permute_fusion)
        return MOE_EXPERTS_LOOP; /* (the fused permutation is a grouped-kernel path) */
    return moe_config_grouped_kernel_fits(c) ? MOE_EXPERTS_KERNEL : MOE_EXPERTS_CUBLAS;
}

/* grow-only buffers on the expert side (their row count changes every step) */
static void *regrow(const moe_backend *be, void *p, size_t bytes) {
    be->free(p);
    p = be->alloc(bytes ? bytes : 1);
    MOE_CHECK_ALLOC(p, bytes, "an expert-side buffer");
    return p;
}

void moe_expert_rows_reserve(const moe_backend *be, const moe_layer_dims *d, moe_layer_acts *a,
                             moe_layer_workspace *ws, const moe_dispatch_plan *pl, size_t rows) {
    const size_t S = be->act_size, H = d->H, F = d->F;
    const int fused = pl && pl->fused, x_t = moe_layer_keeps_x_t(be, d);
    const int keep_xe = moe_layer_keeps_xe(be, d), etp = d->etp != NULL;
    if (fused) { /* (the rows in ws->dye where the layer does not keep them) */
        a->xe = keep_xe ? moe_dispatch_sym_rows(d->ep, pl, &a->xe_sym, S * H) : NULL;
        a->we = moe_dispatch_sym_rows(d->ep, pl, &a->we_sym, R);
        ws->ye = moe_dispatch_sym_rows(d->ep, pl, &ws->ye_sym, S * H);
        ws->dye = moe_dispatch_sym_rows(d->ep, pl, &ws->dye_sym, S * H);
        ws->dwe = moe_dispatch_sym_rows(d->ep, pl, &ws->dwe_sym, R);
    }
    if (rows > a->e_rows) {
        /* the tokens at the experts are kept where the backward reads them, else they are
         * the workspace's scratch (ws->dye, grown below; layer.h, moe_layer_xe()) */
        if (!fused) {
            be->free(a->xe);
            a->xe = keep_xe ? regrow(be, NULL, S * rows * H) : NULL;
            a->we = regrow(be, a->we, R * rows);
        }
        /* (the token-wise form pads each local expert's tokens: bounded by d->E; x's copy
         * after the output's with moe_layer_keeps_x_t(). With ETP the experts' outputs are
         * the gathered rows': moe_etp_plan() allocates them) */
        be->free(a->gue);
        be->free(a->acte);
        a->gue = etp ? NULL : regrow(be, NULL, S * rows * 2 * F);
        a->acte = etp ? NULL
                      : regrow(be, NULL, moe_mlp_act_bytes(be, d->lowp, rows,
                                                           pl ? pl->E_local : d->E, (int)F,
                                                           x_t ? (int)H : 0));
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

/* The rows step 4 runs on, and its scratch: the permuted rows in place (the local
 * dispatcher), or the expert-side rows a dispatcher filled. */
typedef struct expert_rows {
    const void *x;       /* inputs */
    const moe_real *w;   /* their routing weights */
    void *gu, *act;      /* saved fc1 outputs, scaled SwiGLU outputs */
    void *y;             /* outputs */
    const void *dy;      /* output gradients */
    void *dx;            /* input gradients */
    moe_real *dw;        /* routing-weight gradients */
    void *dh, *dgu;      /* backward scratch */
    const int *off;      /* host [G+1] group offsets (NULL on the sync-free path) */
    int G;               /* groups (local experts) */
    size_t rows;         /* rows in use */
} expert_rows;

static expert_rows rows_of(const moe_layer_dims *d, const moe_layer_acts *a,
                           moe_layer_workspace *ws, const void *x, int expert_side,
                           int forward) {
    /* the fused permutation: fc1 reads the tokens x itself (see groups_of); the permuted
     * rows are scratch in the backward where the layer keeps x's FP8 copy (a->xp NULL:
     * moe_layer_xp()), which its fc1 reads instead */
    if (!expert_side)
        return (expert_rows){d->permute_fusion ? x : forward ? moe_layer_xp(a, ws) : a->xp,
                             a->wp, a->gu, a->act, ws->yp,
                             ws->dyp, ws->dxp, ws->dwp, ws->dh, ws->dgu,
                             /* sync-free: the offsets exist in device memory only */
                             moe_layer_sync_free(d) ? NULL : a->expert_offset, d->E,
                             (size_t)moe_layer_permuted_rows(d)};
    const moe_dispatch_plan *pl = &a->plan;
    /* the outputs' buffer takes the input gradients in the backward; a plan made on the
     * device (dispatch_fused.c) left the offsets there and the rows at the static budget;
     * the tokens are scratch in the backward where the layer keeps their FP8 copy (a->xe
     * NULL: moe_layer_xe()) */
    return (expert_rows){forward ? moe_layer_xe(a, ws) : a->xe, a->we, a->gue, a->acte, ws->ye,
                         ws->dye, ws->ye, ws->dwe, ws->edh, ws->edgu,
                         pl->sync_free ? NULL : pl->expert_offset, pl->E_local,
                         (size_t)pl->R_recv};
}

/* With ETP (expert_tp.h): the same rows of the whole ETP group, gathered expert-major, and
 * their scratch. The outputs' buffer takes the input gradients in the backward, as above;
 * the forward gathers the inputs into scratch where the layer keeps their FP8 copy
 * (moe_etp_x()) */
static expert_rows etp_rows_of(const moe_layer_acts *a, moe_layer_workspace *ws, int forward) {
    const moe_etp_rows *g = &a->etp;
    const moe_etp_work *w = &ws->etp;
    return (expert_rows){forward ? moe_etp_x(g, w) : g->x, g->w, g->gu, g->act, w->y, w->dy,
                         w->y, w->dw, w->dh, w->dgu, g->off, g->G, g->rows};
}

/* The groups of step 4. Our grouped kernel reads the offsets from device memory: the
 * local dispatcher's permutation wrote them there already, the others' plans are
 * uploaded here (forward; the backward reuses them), but for the device plan's, which are
 * there already. Under the fused permutation fc1
 * gathers its row r from token perm_src[r] / k (forward and weight gradient). */
static moe_groups groups_of(const moe_backend *be, const moe_layer_dims *d,
                            const moe_layer_acts *a, const expert_rows *r, int upload,
                            int expert_side) {
    if (d->experts == MOE_EXPERTS_KERNEL && upload && r->off)
        be->from_host(a->dev_offset, r->off, sizeof(int) * (r->G + 1));
    moe_groups g = {r->off, a->dev_offset, r->G, d->experts, MOE_DW_ACCUMULATE, NULL, 1,
                    (int)r->rows, d->lowp, NULL, NULL,
                    moe_lowp_site(d->lowp, d->layer, MOE_LOWP_EXPERTS, 0), 0, NULL, NULL,
                    NULL, NULL, 0};
    /* chapter 05's FP8 dispatch: the expert-side rows arrived as their 1×128 QDQ (only the
     * collective alltoall dispatcher sets ep->fp8, and never with ETP: dispatch.c) */
    g.x_quantized = expert_side && d->ep && d->ep->fp8 && !d->etp;
    /* chapter 05: the rows' token-wise FP8 copy kept in a->act or a->acte, not the rows */
    g.keep_x_t = moe_layer_keeps_x_t(be, d);
    if (d->permute_fusion || d->permute_scatter)
        MOE_ASSERT(d->experts == MOE_EXPERTS_KERNEL && !d->ep && d->capacity_factor == 0 &&
                   !d->etp); /* the local dispatcher's rows, in place */
    if (d->permute_fusion) {
        g.gather = a->perm_src;
        g.gather_div = d->k;
    }
    if (d->permute_scatter) /* fc2's row r to slot row perm_src[r] of ws->yp (layer.h) */
        g.scatter = a->perm_src;
    return g;
}

/* chapter 01's loop: expert @p e's rows as a group of its own (@p off, which the group
 * points to, receives its bounds), at its own low-precision site, x quantized as @p all's */
static moe_groups expert_group(const moe_layer_dims *d, const expert_rows *r,
                               const moe_groups *all, int e, int off[2]) {
    off[0] = 0;
    off[1] = r->off[e + 1] - r->off[e];
    moe_groups one =
        moe_groups_single(off, d->lowp, moe_lowp_site(d->lowp, d->layer, MOE_LOWP_EXPERTS, e));
    one.x_quantized = all->x_quantized;
    return one;
}


void moe_experts_forward(const moe_backend *be, const moe_layer_dims *d, moe_layer_acts *a,
                         moe_layer_workspace *ws, const moe_layer_weights *w, const void *x,
                         int expert_side) {
    const int H = d->H, F = d->F;
    const expert_rows here = rows_of(d, a, ws, x, expert_side, 1);
    expert_rows r = here;
    if (d->etp) { /* every rank of the ETP group on the rows of all of them (expert_tp.h) */
        MOE_ASSERT(expert_side);
        moe_etp_plan(be, d->etp, &a->etp, &ws->etp, here.off, here.G, H, F, d->lowp,
                     moe_layer_keeps_x_t(be, d));
        r = etp_rows_of(a, ws, 1);
        moe_etp_gather(be, d->etp, &a->etp, &ws->etp, (void *)r.x, here.x, H, 0);
        moe_etp_gather(be, d->etp, &a->etp, &ws->etp, (void *)r.w, here.w, 1, 1);
    }
    moe_groups grp = groups_of(be, d, a, &r, expert_side, expert_side);
    grp.fp8_w1 = w->fc1_fp8; /* chapter 05's native FP8 GEMMs, when the model made them */
    grp.fp8_w2 = w->fc2_fp8;
    if (grp.x_quantized) { /* the FP8 dispatch's codes, for fc1's native GEMM */
        grp.xq = d->ep->q_recv;
        grp.xs = d->ep->s_recv;
    }
    MOE_ASSERT(!grp.fp8_w1 || grp.impl == MOE_EXPERTS_KERNEL);
    /* r.act was allocated at moe_mlp_act_bytes()'s size: FP8 codes there mean this runs the
     * fused passes, which write codes (a bf16 output would overflow it) */
    MOE_ASSERT(!moe_mlp_fp8_saves_codes(be, d->lowp) || moe_mlp_fp8_fused(be, &grp));
    if (grp.impl != MOE_EXPERTS_LOOP) { /* chapter 03: one grouped GEMM per Linear */
        moe_mlp_forward_grouped(be, r.y, r.gu, r.act, r.x, r.w, w->fc1, w->fc2, &grp, H, F);
    } else { /* chapter 01: one SwiGLU MLP per expert on its rows */
        for (int e = 0; e < r.G; e++) {
            int off[2];
            const size_t o = (size_t)r.off[e];
            moe_groups one = expert_group(d, &r, &grp, e, off);
            moe_mlp_forward_grouped(be, A(r.y, o * H), A(r.gu, o * 2 * F), A(r.act, o * F),
                                    A(r.x, o * H), r.w + o, A(w->fc1, (size_t)e * 2 * F * H),
                                    A(w->fc2, (size_t)e * H * F), &one, H, F);
        }
    }
    /* fc2 was row-parallel: sum the partial outputs, each rank keeping its own rows */
    if (d->etp)
        moe_etp_scatter(be, d->etp, &a->etp, &ws->etp, here.y, r.y, H, 0);
}

void moe_experts_backward(const moe_backend *be, const moe_layer_dims *d, const moe_layer_acts *a,
                          moe_layer_workspace *ws, const moe_layer_weights *w,
                          const moe_layer_grads *g, const void *x, int expert_side) {
    const int H = d->H, F = d->F;
    const expert_rows here = rows_of(d, a, ws, x, expert_side, 0);
    expert_rows r = here;
    if (d->etp) { /* the output gradients of the whole ETP group's rows (the forward's plan) */
        r = etp_rows_of(a, ws, 0);
        moe_etp_gather(be, d->etp, &a->etp, &ws->etp, (void *)r.dy, here.dy, H, 0);
    }
    /* the loop adds into the input gradients expert by expert; the grouped paths
     * overwrite them. Routing-weight gradients: rows of dropped or absent assignments
     * stay 0. */
    if (d->experts == MOE_EXPERTS_LOOP)
        be->zero(r.dx, be->act_size * r.rows * H);
    be->zero(r.dw, R * r.rows);
    moe_prof_mark(MOE_PROF_EXPERT_OPS);
    moe_groups grp = groups_of(be, d, a, &r, 0, expert_side);
    grp.dw_mode = g->expert_dw;
    grp.fp8_w1 = w->fc1_fp8;
    grp.fp8_w2 = w->fc2_fp8;
    MOE_ASSERT(!moe_mlp_fp8_saves_codes(be, d->lowp) || moe_mlp_fp8_fused(be, &grp));
    if (grp.impl != MOE_EXPERTS_LOOP) {
        moe_mlp_backward_grouped(be, r.dx, g->fc1, g->fc2, r.dw, r.dy, r.x, r.gu, r.act, r.w,
                                 w->fc1, w->fc2, r.dh, r.dgu, &grp, H, F, 0);
    } else {
        MOE_ASSERT(grp.dw_mode != MOE_DW_ACT); /* only our kernel writes activation-type dw */
        if (grp.dw_mode == MOE_DW_STORE) { /* the loop adds: start the sums from zero */
            be->zero(g->fc1, R * r.G * 2 * F * H);
            be->zero(g->fc2, R * r.G * H * F);
        }
        for (int e = 0; e < r.G; e++) {
            int off[2];
            const size_t o = (size_t)r.off[e];
            moe_groups one = expert_group(d, &r, &grp, e, off);
            moe_mlp_backward_grouped(be, A(r.dx, o * H), g->fc1 + (size_t)e * 2 * F * H,
                                     g->fc2 + (size_t)e * H * F, r.dw + o, A(r.dy, o * H),
                                     A(r.x, o * H), A(r.gu, o * 2 * F), A(r.act, o * F),
                                     r.w + o, A(w->fc1, (size_t)e * 2 * F * H),
                                     A(w->fc2, (size_t)e * H * F), A(r.dh, o * F),
                                     A(r.dgu, o * 2 * F), &one, H, F, 1);
        }
    }
    /* fc1 was column-parallel and the routing weight multiplies each rank's slice of h: the
     * input and routing-weight gradients are partial sums over the group (the all-gather's
     * gradient is this reduce-scatter) */
    if (d->etp) {
        moe_etp_scatter(be, d->etp, &a->etp, &ws->etp, here.dx, r.dx, H, 0);
        moe_etp_scatter(be, d->etp, &a->etp, &ws->etp, here.dw, r.dw, 1, 1);
    }
}
