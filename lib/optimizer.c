/* AdamW, gradient clipping and the learning-rate schedule: see optimizer.h. */
#include "optimizer.h"

#include <math.h>
#include <stdlib.h>

moe_status moe_adamw_init(moe_adamw *opt, size_t n, moe_error *err) {
    opt->m = calloc(n ? n : 1, sizeof(float));
    opt->v = calloc(n ? n : 1, sizeof(float));
    opt->n = n;
    opt->step = 0;
    if (!opt->m || !opt->v) {
        moe_adamw_free(opt);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory for the AdamW state (%zu values)",
                             n);
    }
    return MOE_OK;
}

void moe_adamw_free(moe_adamw *opt) {
    free(opt->m);
    free(opt->v);
    opt->m = opt->v = NULL;
}

void moe_adamw_step(moe_adamw *opt, const moe_param_table *pt, moe_real *params,
                    const moe_real *grads, double lr, double beta1, double beta2, double eps,
                    double wd) {
    opt->step++;
    const double bc1 = 1.0 - pow(beta1, (double)opt->step);
    const double bc2 = 1.0 - pow(beta2, (double)opt->step);
    for (int t = 0; t < pt->n; t++) {
        const moe_tensor *ten = &pt->t[t];
        const double decay = ten->decay ? wd : 0.0;
        const size_t o = ten->offset;
#pragma omp parallel for schedule(static)
        for (size_t i = o; i < o + ten->numel; i++) {
            double g = grads[i];
            double m = beta1 * opt->m[i] + (1.0 - beta1) * g;
            double v = beta2 * opt->v[i] + (1.0 - beta2) * g * g;
            opt->m[i] = (float)m;
            opt->v[i] = (float)v;
            double upd = (m / bc1) / (sqrt(v / bc2) + eps) + decay * params[i];
            params[i] = (moe_real)(params[i] - lr * upd);
        }
    }
}

double moe_clip_grad_norm(moe_real *grads, size_t n, double max_norm) {
    /* Fixed-size blocks summed in order: the same norm for any thread count. */
    enum { BLK = 4096 };
    size_t nb = (n + BLK - 1) / BLK;
    double *part = calloc(nb ? nb : 1, sizeof(double));
    MOE_ASSERT(part != NULL);
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < nb; b++) {
        double s = 0.0;
        size_t end = (b + 1) * BLK < n ? (b + 1) * BLK : n;
        for (size_t i = b * BLK; i < end; i++)
            s += (double)grads[i] * grads[i];
        part[b] = s;
    }
    double ss = 0.0;
    for (size_t b = 0; b < nb; b++)
        ss += part[b];
    free(part);
    double norm = sqrt(ss);
    if (max_norm > 0 && norm > max_norm) {
        double s = max_norm / (norm + 1e-6);
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < n; i++)
            grads[i] = (moe_real)(grads[i] * s);
    }
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
