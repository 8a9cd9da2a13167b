/*
 * SwiGLU activation (CPU), with the routing weight of a routed expert fused in:
 *
 *   out[n,f] = s[n] · silu(g) · u,    silu(g) = g·σ(g),    s[n] = row_scale[n] (or 1)
 *
 * The input row is [g | u] (Megatron's fused fc1 output, gate half first). The routing
 * weight multiplies the activation before fc2 (mlp.h); doing it here instead of in a
 * separate pass means the scaled activation is written once and is at the same time the
 * saved input of fc2.
 *
 * Backward, with a = silu(g)·u recomputed from gu and d = dout·s:
 *   ds  += Σ_f dout·a                                  (the routing weight's gradient)
 *   dg  += d · u · σ(g)(1 + g(1 − σ(g)))               (d silu/dg = σ + g·σ(1 − σ))
 *   du  += d · silu(g)
 * The row sum is taken in double, so its result does not depend on F's rounding.
 */
#include "ops.h"

static inline moe_real sigmoid(moe_real x) { return 1 / (1 + moe_exp(-x)); }

void moe_cpu_swiglu_forward(moe_real *out, const moe_real *gu, const moe_real *row_scale, int N,
                            int F) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const moe_real *g = gu + (size_t)n * 2 * F, *u = g + F;
        const moe_real s = row_scale ? row_scale[n] : 1;
        moe_real *o = out + (size_t)n * F;
        for (int f = 0; f < F; f++)
            o[f] = g[f] * sigmoid(g[f]) * u[f] * s;
    }
}

void moe_cpu_swiglu_backward(moe_real *dgu, moe_real *drow_scale, const moe_real *dout,
                             const moe_real *gu, const moe_real *row_scale, int N, int F) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const moe_real *g = gu + (size_t)n * 2 * F, *u = g + F;
        const moe_real *dy = dout + (size_t)n * F;
        const moe_real s = row_scale ? row_scale[n] : 1;
        moe_real *dg = dgu + (size_t)n * 2 * F, *du = dg + F;
        double ds = 0.0;
        for (int f = 0; f < F; f++) {
            const moe_real sg = sigmoid(g[f]), silu = g[f] * sg, d = dy[f] * s;
            ds += (double)dy[f] * (silu * u[f]);
            dg[f] += d * u[f] * sg * (1 + g[f] * (1 - sg));
            du[f] += d * silu;
        }
        if (drow_scale)
            drow_scale[n] += (moe_real)ds;
    }
}
