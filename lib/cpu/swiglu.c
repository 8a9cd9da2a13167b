/*
 * SwiGLU activation (CPU): out = silu(g) ⊙ u with silu(g) = g·σ(g).
 * The input row is [g | u] (Megatron's fused fc1 output, gate half first).
 * d silu/dg = σ(g) + g·σ(g)(1 − σ(g)) = σ(g)(1 + g(1 − σ(g))).
 */
#include "ops.h"

static inline moe_real sigmoid(moe_real x) { return 1 / (1 + moe_exp(-x)); }

void moe_cpu_swiglu_forward(moe_real *out, const moe_real *gu, int N, int F) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const moe_real *g = gu + (size_t)n * 2 * F, *u = g + F;
        moe_real *o = out + (size_t)n * F;
        for (int f = 0; f < F; f++)
            o[f] = g[f] * sigmoid(g[f]) * u[f];
    }
}

void moe_cpu_swiglu_backward(moe_real *dgu, const moe_real *dout, const moe_real *gu, int N, int F) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const moe_real *g = gu + (size_t)n * 2 * F, *u = g + F;
        const moe_real *d = dout + (size_t)n * F;
        moe_real *dg = dgu + (size_t)n * 2 * F, *du = dg + F;
        for (int f = 0; f < F; f++) {
            moe_real s = sigmoid(g[f]);
            dg[f] += d[f] * u[f] * s * (1 + g[f] * (1 - s));
            du[f] += d[f] * g[f] * s;
        }
    }
}
