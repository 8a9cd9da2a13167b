/*
 * Cross-entropy on logits (CPU), numerically stable through the max shift:
 *   loss = log Σ_j exp(z_j − m) + m − z_target,   ∂loss/∂z = softmax(z) − onehot(target).
 *
 * The vocabulary-parallel version (chapter 04) splits the V columns over R ranks. Each rank
 * reduces its shard to two numbers per row (the shard ops below): its log-sum-exp
 * lse_r = log Σ_{v in shard r} exp(z_v) and its target logit (z_target when the target lies
 * in its shard, else 0). Log-sum-exps merge exactly, lse = log Σ_r exp(lse_r), and exactly
 * one shard holds the target, so after an all-gather of the R pairs every rank has
 *   loss = lse − Σ_r target_r,
 * and the gradient of its own columns, softmax_v − onehot_v = exp(z_v − lse) − onehot_v,
 * needs nothing of the other ranks but lse.
 */
#include <math.h>

#include "ops.h"

/* log Σ_v exp(z_v), computed as m + log Σ exp(z_v − m) with m = max z. */
static double logsumexp(const moe_real *z, int V) {
    moe_real m = z[0];
    for (int v = 1; v < V; v++)
        m = z[v] > m ? z[v] : m;
    double s = 0.0;
    for (int v = 0; v < V; v++)
        s += exp((double)(z[v] - m));
    return m + log(s);
}

void moe_cpu_cross_entropy_forward(moe_real *losses, const moe_real *logits, const int *targets,
                                   int N, int V) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const moe_real *z = logits + (size_t)n * V;
        losses[n] = (moe_real)(logsumexp(z, V) - z[targets[n]]);
    }
}

void moe_cpu_cross_entropy_shard_forward(moe_real *part, const moe_real *logits,
                                         const int *targets, int N, int V) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const moe_real *z = logits + (size_t)n * V;
        part[2 * (size_t)n] = (moe_real)logsumexp(z, V);
        part[2 * (size_t)n + 1] = targets[n] >= 0 ? z[targets[n]] : (moe_real)0;
    }
}

void moe_cpu_cross_entropy_shard_merge(moe_real *losses, moe_real *lse, const moe_real *parts,
                                       int R, int N) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        /* log Σ_r exp(lse_r), shifted by the largest lse_r; the target logits summed */
        double m = parts[2 * (size_t)n], t = 0.0, s = 0.0;
        for (int r = 1; r < R; r++) {
            const double l = parts[((size_t)r * N + n) * 2];
            m = l > m ? l : m;
        }
        for (int r = 0; r < R; r++) {
            const moe_real *p = parts + ((size_t)r * N + n) * 2;
            s += exp((double)p[0] - m);
            t += p[1];
        }
        const double l = m + log(s);
        lse[n] = (moe_real)l;
        losses[n] = (moe_real)(l - t);
    }
}

void moe_cpu_cross_entropy_shard_backward(moe_real *dlogits, const moe_real *dloss,
                                          const moe_real *logits, const moe_real *lse,
                                          const int *targets, int N, int V) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const moe_real *z = logits + (size_t)n * V;
        moe_real *dz = dlogits + (size_t)n * V;
        const moe_real g = dloss ? dloss[n] : (moe_real)(1.0 / N);
        for (int v = 0; v < V; v++) {
            moe_real p = (moe_real)exp((double)z[v] - lse[n]);
            dz[v] += g * (p - (v == targets[n]));
        }
    }
}

void moe_cpu_cross_entropy_backward(moe_real *dlogits, const moe_real *dloss,
                                    const moe_real *logits, const int *targets, int N, int V) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const moe_real *z = logits + (size_t)n * V;
        moe_real *dz = dlogits + (size_t)n * V;
        moe_real g = dloss ? dloss[n] : (moe_real)(1.0 / N);
        double lse = logsumexp(z, V);
        for (int v = 0; v < V; v++) {
            moe_real p = (moe_real)exp((double)z[v] - lse);
            dz[v] += g * (p - (v == targets[n]));
        }
    }
}
