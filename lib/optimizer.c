/* AdamW, gradient clipping and the learning-rate schedule: see optimizer.h. */
#include "optimizer.h"

#include <math.h>
#include <stdlib.h>

moe_status moe_adamw_init(moe_adamw *opt, const moe_backend *be, const moe_param_table *pt,
                          moe_error *err) {
    const moe_adamw_piece all = {0, pt->total, 0};
    return moe_adamw_init_pieces(opt, be, pt, &all, 1, 0, err);
}

/* The run list of the pieces (optimizer.h), into @p run [pt->n · n_pieces at most]: each
 * tensor's part of each piece; a run grows while the next tensor starts where it ends with
 * the same decay, and never crosses into the next piece (whose moments start elsewhere).
 * Returns how many runs, and the chunks of them all in @p chunks. */
static int build_runs(const moe_adamw *opt, const moe_param_table *pt, moe_adamw_run *run,
                      size_t *chunks) {
    int n = 0;
    *chunks = 0;
    for (int k = 0; k < opt->n_pieces; k++) {
        const moe_adamw_piece *pc = &opt->piece[k];
        const int first = n; /* this piece's first run */
        for (int t = 0; t < pt->n; t++) {
            const moe_tensor *ten = &pt->t[t];
            const size_t a = ten->offset > pc->lo ? ten->offset : pc->lo;
            const size_t b = ten->offset + ten->numel < pc->hi ? ten->offset + ten->numel : pc->hi;
            const int decay = ten->decay != 0;
            if (a >= b)
                continue;
            moe_adamw_run *last = n > first ? &run[n - 1] : NULL;
            if (last && last->grad + last->n == a && last->decay == decay) {
                last->n = b - last->grad; /* the tensor joins the run */
                continue;
            }
            const size_t st = pc->state + (a - pc->lo); /* its moments, and master weights */
            run[n++] = (moe_adamw_run){.grad = a, .weight = opt->master ? st : a, .state = st,
                                       .n = b - a, .decay = decay};
        }
    }
    for (int r = 0; r < n; r++) { /* the chunks, now that every run has its length */
        run[r].chunk = *chunks;
        *chunks += (run[r].n + MOE_ADAMW_CHUNK - 1) / MOE_ADAMW_CHUNK;
    }
    return n;
}

moe_status moe_adamw_init_pieces(moe_adamw *opt, const moe_backend *be,
                                 const moe_param_table *pt, const moe_adamw_piece *pieces,
                                 int n_pieces, int keep_master, moe_error *err) {
    MOE_ASSERT(n_pieces >= 1 && n_pieces <= MOE_ADAMW_MAX_PIECES);
    size_t n = 0;
    for (int i = 0; i < n_pieces; i++) {
        MOE_ASSERT(pieces[i].lo <= pieces[i].hi && pieces[i].hi <= pt->total);
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
    /* the run list: built on the host, copied to the backend once */
    const size_t most = (size_t)(pt->n ? pt->n : 1) * (size_t)n_pieces;
    moe_adamw_run *host = malloc(sizeof *host * most);
    opt->runs = (moe_adamw_runs){.run = be->alloc(sizeof *host * most)};
    const int runs_ok = host && opt->runs.run;
    if (runs_ok) {
        opt->runs.n = build_runs(opt, pt, host, &opt->runs.chunks);
        be->from_host(opt->runs.run, host, sizeof *host * (size_t)opt->runs.n);
    }
    free(host);
    if (!opt->m || !opt->v || (keep_master && !opt->master) || !runs_ok) {
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
        opt->be->free(opt->runs.run);
    }
    opt->m = opt->v = NULL;
    opt->master = NULL;
    opt->runs = (moe_adamw_runs){0};
}

void moe_adamw_next_hyper(moe_adamw *opt, double lr, double beta1, double beta2,
                          double host[3]) {
    opt->step++;
    host[0] = lr;
    host[1] = 1.0 - pow(beta1, (double)opt->step);
    host[2] = 1.0 - pow(beta2, (double)opt->step);
}

void moe_adamw_step(moe_adamw *opt, moe_real *params, const moe_real *grads, void *act,
                    double lr, double beta1, double beta2, double eps, double wd,
                    const double *clip, const int *flags, const double *hyper) {
    double h[3] = {0.0, 0.0, 0.0}; /* unused when the device reads @p hyper */
    if (!hyper)
        moe_adamw_next_hyper(opt, lr, beta1, beta2, h);
    if (opt->runs.n == 0)
        return; /* nothing to update (an empty piece) */
    /* one call over every run (built at init): on CUDA one launch, a block per chunk */
    opt->be->adamw(&opt->runs, opt->master ? opt->master : params, grads, opt->m, opt->v, act,
                   lr, beta1, beta2, eps, wd, h[1], h[2], clip, flags, hyper);
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
