/* AdamW, gradient clipping and the learning-rate schedule: see optimizer.h. */
#include "optimizer.h"

#include <math.h>

moe_status moe_adamw_init(moe_adamw *opt, const moe_backend *be, size_t n, moe_error *err) {
    const moe_adamw_piece all = {0, n, 0};
    return moe_adamw_init_pieces(opt, be, &all, 1, 0, err);
}

moe_status moe_adamw_init_pieces(moe_adamw *opt, const moe_backend *be,
                                 const moe_adamw_piece *pieces, int n_pieces, int keep_master,
                                 moe_error *err) {
    MOE_ASSERT(n_pieces >= 1 && n_pieces <= MOE_ADAMW_MAX_PIECES);
    size_t n = 0;
    for (int i = 0; i < n_pieces; i++) {
        MOE_ASSERT(pieces[i].lo <= pieces[i].hi);
        opt->piece[i] = pieces[i];
        opt->piece[i].state = n;
        n += pieces[i].hi - pieces[i].lo;
    }
    opt->n_pieces = n_pieces;
    opt->be = be;
    opt->m = be->alloc(sizeof(float) * (n ? n : 1));
    opt->v = be->alloc(sizeof(float) * (n ? n : 1));
    opt->master = keep_master ? be->alloc(sizeof(moe_real) * (n ? n : 1)) : NULL;
    opt->n = n;
    opt->step = 0;
    if (!opt->m || !opt->v || (keep_master && !opt->master)) {
        moe_adamw_free(opt);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory for the AdamW state (%zu values%s)",
                             n, keep_master ? " with their fp32 master weights" : "");
    }
    return MOE_OK;
}

void moe_adamw_pieces_from_host(const moe_adamw *opt, void *dst, const void *host, size_t es) {
    for (int k = 0; k < opt->n_pieces; k++) {
        const moe_adamw_piece *pc = &opt->piece[k];
        opt->be->from_host((char *)dst + pc->state * es, (const char *)host + pc->lo * es,
                           (pc->hi - pc->lo) * es);
    }
}

void moe_adamw_free(moe_adamw *opt) {
    if (opt->be) {
        opt->be->free(opt->m);
        opt->be->free(opt->v);
        opt->be->free(opt->master);
    }
    opt->m = opt->v = NULL;
    opt->master = NULL;
}

void moe_adamw_next_hyper(moe_adamw *opt, double lr, double beta1, double beta2,
                          double host[3]) {
    opt->step++;
    host[0] = lr;
    host[1] = 1.0 - pow(beta1, (double)opt->step);
    host[2] = 1.0 - pow(beta2, (double)opt->step);
}

void moe_adamw_step(moe_adamw *opt, const moe_param_table *pt, moe_real *params,
                    const moe_real *grads, double lr, double beta1, double beta2, double eps,
                    double wd, const double *clip, const int *flags, const double *hyper) {
    double h[3] = {0.0, 0.0, 0.0}; /* unused when the device reads @p hyper */
    if (!hyper)
        moe_adamw_next_hyper(opt, lr, beta1, beta2, h);
    const double bc1 = h[1], bc2 = h[2];
    /* Each tensor's part of each piece, since weight decay is per tensor; but the update is
     * elementwise, so neighbouring tensors with the same decay are one call: a run
     * [ra, rb) grows while the next tensor starts where it ends (chapter 06: the GPU preset's
     * 57 tensors were 57 launches, most of them small) */
    for (int k = 0; k < opt->n_pieces; k++) {
        const moe_adamw_piece *pc = &opt->piece[k];
        size_t ra = 0, rb = 0; /* the run, empty */
        int rdecay = 0;
        for (int t = 0; t <= pt->n; t++) {
            size_t a = 0, b = 0;
            int decay = 0;
            if (t < pt->n) {
                const moe_tensor *ten = &pt->t[t];
                a = ten->offset > pc->lo ? ten->offset : pc->lo;
                b = ten->offset + ten->numel < pc->hi ? ten->offset + ten->numel : pc->hi;
                decay = ten->decay != 0;
                if (a >= b)
                    continue;
                if (rb > ra && a == rb && decay == rdecay) {
                    rb = b;
                    continue;
                }
            }
            if (rb > ra) { /* flush the run (before a tensor that cannot join it, or at the end) */
                const size_t st = pc->state + (ra - pc->lo);
                moe_real *p = opt->master ? opt->master + st : params + ra;
                opt->be->adamw(p, grads + ra, opt->m + st, opt->v + st, rb - ra, lr, beta1,
                               beta2, eps, rdecay ? wd : 0.0, bc1, bc2, clip, flags, hyper);
            }
            ra = a;
            rb = b;
            rdecay = decay;
        }
    }
}

void moe_clip_grads(const moe_backend *be, moe_real *grads, size_t n, double norm,
                    double max_norm) {
    const double f = moe_clip_factor(norm, max_norm);
    if (f != 1.0)
        be->scale_real(grads, f, n);
}

double moe_clip_grad_norm(const moe_backend *be, moe_real *grads, size_t n, double max_norm) {
    /* the squares accumulate into a double in backend memory, read back here: this helper
     * is for programs and tests; the trainer keeps the norm on the device (trainer.c) */
    double *acc = be->alloc(sizeof(double)), sq = 0.0;
    MOE_CHECK_ALLOC(acc, sizeof(double), "the gradient norm's sum");
    be->sum_squares(acc, grads, n);
    be->to_host(&sq, acc, sizeof sq);
    be->free(acc);
    const double norm = sqrt(sq);
    moe_clip_grads(be, grads, n, norm, max_norm);
    return norm;
}

double moe_lr_at(const moe_config *c, int step) {
    if (c->lr_warmup_iters > 0 && step < c->lr_warmup_iters)
        return c->lr * (step + 1) / c->lr_warmup_iters;
    if (c->lr_style == MOE_LR_CONSTANT)
        return c->lr;
    int decay_iters = c->lr_decay_iters > 0 ? c->lr_decay_iters : c->train_iters;
    if (step >= decay_iters)
        return c->min_lr;
    int span = decay_iters - c->lr_warmup_iters;
    if (span <= 0)
        return c->min_lr;
    double ratio = (double)(step - c->lr_warmup_iters) / span;
    double coeff = c->lr_style == MOE_LR_COSINE ? 0.5 * (1.0 + cos(M_PI * ratio)) : 1.0 - ratio;
    return c->min_lr + coeff * (c->lr - c->min_lr);
}
