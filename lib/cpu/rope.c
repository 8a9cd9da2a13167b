/*
 * Rotary position embedding (CPU), rotate-half form.
 *
 * Each head vector is split into halves a = x[0:D/2], b = x[D/2:D]; pair i is
 * rotated by the angle θ_i(p) = p · base^(−2i/D), p = pos0 + t the absolute position
 * of the row (pos0 ≠ 0 for a chunk of a longer sequence, chapter 07):
 *   a_i' = a_i cos θ − b_i sin θ,    b_i' = b_i cos θ + a_i sin θ.
 * A rotation is orthogonal, so the backward pass is the rotation by −θ.
 * Angles are computed in double, once per (position, i), so CPU and GPU can agree.
 */
#include <math.h>

#include "ops.h"

static void rope_apply(moe_real *out, const moe_real *in, int B, int T, int heads, int D,
                       int pos0, double base, double sign, int accumulate) {
    const int half = D / 2;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < B * T; n++) {
        int pos = pos0 + n % T; /* absolute position of the row */
        for (int i = 0; i < half; i++) {
            double theta = pos * pow(base, -2.0 * i / D);
            moe_real c = (moe_real)cos(theta), s = (moe_real)(sign * sin(theta));
            for (int h = 0; h < heads; h++) {
                size_t o = (size_t)n * heads * D + (size_t)h * D;
                moe_real a = in[o + i], b = in[o + i + half];
                moe_real ra = a * c - b * s, rb = b * c + a * s;
                if (accumulate) {
                    out[o + i] += ra;
                    out[o + i + half] += rb;
                } else {
                    out[o + i] = ra;
                    out[o + i + half] = rb;
                }
            }
        }
    }
}

void moe_cpu_rope_forward(moe_real *out, const moe_real *in, int B, int T, int heads, int D,
                          int pos0, double base) {
    rope_apply(out, in, B, T, heads, D, pos0, base, +1.0, 0);
}

void moe_cpu_rope_backward(moe_real *din, const moe_real *dout, int B, int T, int heads, int D,
                           int pos0, double base) {
    rope_apply(din, dout, B, T, heads, D, pos0, base, -1.0, 1);
}
