/*
 * RMSNorm (CPU). y = x · r · w with r = 1/sqrt(mean(x²) + eps).
 *
 * Backward, per row (x̂ = x·r, g = dy ⊙ w):
 *   dx = r · (g − x̂ · mean(g ⊙ x̂))
 *   dw = Σ_rows dy ⊙ x̂
 * The derivation: ∂r/∂x_j = −r³ x_j / C, so dx_j = r g_j − (r³/C) x_j Σ_i g_i x_i.
 * Row reductions accumulate in double: this is the reference backend.
 */
#include <stdlib.h>

#include "error.h"
#include "ops.h"

void moe_cpu_rmsnorm_forward(moe_real *out, moe_real *rstd, const moe_real *x, const moe_real *w,
                             int N, int C, double eps) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const moe_real *xr = x + (size_t)n * C;
        double ss = 0.0;
        for (int c = 0; c < C; c++)
            ss += (double)xr[c] * xr[c];
        moe_real r = (moe_real)(1.0 / sqrt(ss / C + eps));
        rstd[n] = r;
        moe_real *o = out + (size_t)n * C;
        for (int c = 0; c < C; c++)
            o[c] = xr[c] * r * w[c];
    }
}

void moe_cpu_rmsnorm_backward(moe_real *dx, moe_real *dw, const moe_real *dout, const moe_real *x,
                              const moe_real *w, const moe_real *rstd, int N, int C) {
    if (dx) {
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) {
            const moe_real *xr = x + (size_t)n * C, *g = dout + (size_t)n * C;
            moe_real r = rstd[n];
            double dot = 0.0; /* Σ (dy⊙w) · x̂ */
            for (int c = 0; c < C; c++)
                dot += (double)g[c] * w[c] * xr[c] * r;
            moe_real mean = (moe_real)(dot / C);
            moe_real *d = dx + (size_t)n * C;
            for (int c = 0; c < C; c++)
                d[c] += r * (g[c] * w[c] - xr[c] * r * mean);
        }
    }
    if (dw) {
        /* columns are independent: each thread owns a slice of them */
#pragma omp parallel for schedule(static)
        for (int c0 = 0; c0 < C; c0 += 16) {
            int c1 = c0 + 16 < C ? c0 + 16 : C;
            for (int n = 0; n < N; n++) {
                const moe_real *xr = x + (size_t)n * C, *g = dout + (size_t)n * C;
                for (int c = c0; c < c1; c++)
                    dw[c] += g[c] * xr[c] * rstd[n];
            }
        }
    }
}
