/*
 * Cross-entropy on logits (CPU), numerically stable through the max shift:
 *   loss = log Σ_j exp(z_j − m) + m − z_target,   ∂loss/∂z = softmax(z) − onehot(target).
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
