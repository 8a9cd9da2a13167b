/*
 * Causal grouped-query attention (CPU).
 *
 * For query head h of sequence b, with key/value head g = h / (Hq/Hkv):
 *   S[t,s] = q_t · k_s / √D          (s ≤ t; masked to −∞ above the diagonal)
 *   P[t,:] = softmax(S[t,:])
 *   y_t    = Σ_s P[t,s] v_s
 *   lse_t  = log Σ_{s≤t} exp(S[t,s]) = m_t + log Σ_{s≤t} exp(S[t,s] − m_t)
 * with m_t = max_s S[t,s]: the softmax computes m_t and that sum (in double) anyway, so
 * lse is exact for the price of one log per row.
 * Backward (dP = dy·vᵀ, then through the softmax, then the two products):
 *   dv_s += Σ_t P[t,s] dy_t
 *   dS[t,s] = P[t,s] (dP[t,s] − Σ_u P[t,u] dP[t,u])
 *   dq_t += Σ_s dS[t,s] k_s / √D,     dk_s += Σ_t dS[t,s] q_t / √D
 *
 * Work is split over (b, g) pairs: all query heads that share a key/value head
 * are handled by one thread, so dk and dv are written without races and in a
 * fixed order. Keys and values are copied transposed ([D][T]) into a per-thread
 * buffer so that every inner loop walks contiguous memory and vectorises.
 *
 * This is the naive attention of the op contract (backend.h): its workspace holds P
 * [B, Hq, T, T], which the forward writes and the backward reads, so the backward does
 * not recompute the scores. Only a chunk attending to itself is supported (Tq = Tk,
 * q_pos = k_pos), where the causal mask is s ≤ t whatever the offset.
 */
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "ops.h"

/* dst[d][s] = src row s, head column block. */
static void gather_transposed(moe_real *dst, const moe_real *src, int T, int stride, int D) {
    for (int s = 0; s < T; s++)
        for (int d = 0; d < D; d++)
            dst[(size_t)d * T + s] = src[(size_t)s * stride + d];
}

size_t moe_cpu_attention_workspace_bytes(moe_attention_shape s) {
    return sizeof(moe_real) * (size_t)s.B * s.Hq * s.Tq * s.Tk;
}

void moe_cpu_attention_forward(moe_real *y, moe_real *lse, void *ws, const moe_real *q,
                               const moe_real *k, const moe_real *v, moe_attention_shape sh) {
    moe_attention_shape_require(sh, "moe_cpu_attention", 0);
    moe_real *att = ws;
    const int B = sh.B, T = sh.Tq, Hq = sh.Hq, Hkv = sh.Hkv, D = sh.D;
    const int rep = Hq / Hkv, qs = Hq * D, kvs = Hkv * D;
    const moe_real scale = (moe_real)(1.0 / sqrt((double)D));
#pragma omp parallel
    {
        moe_real *kt = malloc((size_t)D * T * sizeof *kt);
        double *lsum = malloc((size_t)T * sizeof *lsum); /* each row's softmax sum */
        MOE_ASSERT(kt && lsum);
#pragma omp for schedule(static)
        for (int bg = 0; bg < B * Hkv; bg++) {
            int b = bg / Hkv, g = bg % Hkv;
            const moe_real *kb = k + (size_t)b * T * kvs + (size_t)g * D;
            const moe_real *vb = v + (size_t)b * T * kvs + (size_t)g * D;
            gather_transposed(kt, kb, T, kvs, D);
            for (int h = g * rep; h < (g + 1) * rep; h++) {
                moe_real *P = att + ((size_t)b * Hq + h) * T * T;
                for (int t = 0; t < T; t++) {
                    const moe_real *qt = q + ((size_t)b * T + t) * qs + (size_t)h * D;
                    moe_real *p = P + (size_t)t * T;
                    for (int s = 0; s <= t; s++)
                        p[s] = 0;
                    for (int d = 0; d < D; d++) {
                        moe_real qd = qt[d] * scale;
                        const moe_real *kd = kt + (size_t)d * T;
                        for (int s = 0; s <= t; s++)
                            p[s] += qd * kd[s];
                    }
                    moe_real m = p[0];
                    for (int s = 1; s <= t; s++)
                        m = p[s] > m ? p[s] : m;
                    double sum = 0.0;
                    for (int s = 0; s <= t; s++) {
                        p[s] = moe_exp(p[s] - m);
                        sum += p[s];
                    }
                    lse[((size_t)b * Hq + h) * T + t] = m; /* + log(sum), below */
                    lsum[t] = sum;
                    moe_real inv = (moe_real)(1.0 / sum);
                    for (int s = 0; s <= t; s++)
                        p[s] *= inv;
                    for (int s = t + 1; s < T; s++)
                        p[s] = 0;
                    moe_real *yt = y + ((size_t)b * T + t) * qs + (size_t)h * D;
                    for (int d = 0; d < D; d++)
                        yt[d] = 0;
                    for (int s = 0; s <= t; s++) {
                        const moe_real *vs = vb + (size_t)s * kvs;
                        moe_real ps = p[s];
                        for (int d = 0; d < D; d++)
                            yt[d] += ps * vs[d];
                    }
                }
                /* lse = m + log l, the log taken once the head's rows are done: a libm call
                 * inside the row loop above made this forward 10-15% slower (AVX-512 build) */
                moe_real *lh = lse + ((size_t)b * Hq + h) * T;
                for (int t = 0; t < T; t++)
                    lh[t] = (moe_real)((double)lh[t] + log(lsum[t]));
            }
        }
        free(kt);
        free(lsum);
    }
}

void moe_cpu_attention_backward(moe_real *dq, moe_real *dk, moe_real *dv, const moe_real *dy,
                                const moe_real *y, const moe_real *lse, void *ws,
                                const moe_real *q, const moe_real *k, const moe_real *v,
                                moe_attention_shape sh) {
    moe_attention_shape_require(sh, "moe_cpu_attention", 0);
    const moe_real *att = ws;
    const int B = sh.B, T = sh.Tq, Hq = sh.Hq, Hkv = sh.Hkv, D = sh.D;
    const int rep = Hq / Hkv, qs = Hq * D, kvs = Hkv * D;
    const moe_real scale = (moe_real)(1.0 / sqrt((double)D));
#pragma omp parallel
    {
        moe_real *vt = malloc((size_t)D * T * sizeof *vt);
        moe_real *dS = malloc((size_t)T * sizeof *dS);
        MOE_ASSERT(vt && dS);
#pragma omp for schedule(static)
        for (int bg = 0; bg < B * Hkv; bg++) {
            int b = bg / Hkv, g = bg % Hkv;
            const moe_real *kb = k + (size_t)b * T * kvs + (size_t)g * D;
            const moe_real *vb = v + (size_t)b * T * kvs + (size_t)g * D;
            moe_real *dkb = dk + (size_t)b * T * kvs + (size_t)g * D;
            moe_real *dvb = dv + (size_t)b * T * kvs + (size_t)g * D;
            gather_transposed(vt, vb, T, kvs, D);
            for (int h = g * rep; h < (g + 1) * rep; h++) {
                const moe_real *P = att + ((size_t)b * Hq + h) * T * T;
                for (int t = 0; t < T; t++) {
                    const moe_real *p = P + (size_t)t * T;
                    const moe_real *dyt = dy + ((size_t)b * T + t) * qs + (size_t)h * D;
                    const moe_real *qt = q + ((size_t)b * T + t) * qs + (size_t)h * D;
                    moe_real *dqt = dq + ((size_t)b * T + t) * qs + (size_t)h * D;
                    /* dP[t,s] = dy_t · v_s, and dv_s += P[t,s] dy_t */
                    for (int s = 0; s <= t; s++)
                        dS[s] = 0;
                    for (int d = 0; d < D; d++) {
                        moe_real gd = dyt[d];
                        const moe_real *vd = vt + (size_t)d * T;
                        for (int s = 0; s <= t; s++)
                            dS[s] += gd * vd[s];
                    }
                    for (int s = 0; s <= t; s++) {
                        moe_real *dvs = dvb + (size_t)s * kvs;
                        moe_real ps = p[s];
                        for (int d = 0; d < D; d++)
                            dvs[d] += ps * dyt[d];
                    }
                    /* through the softmax */
                    double dot = 0.0;
                    for (int s = 0; s <= t; s++)
                        dot += (double)p[s] * dS[s];
                    for (int s = 0; s <= t; s++)
                        dS[s] = p[s] * (dS[s] - (moe_real)dot) * scale;
                    /* dq_t += Σ_s dS k_s ; dk_s += dS q_t */
                    for (int s = 0; s <= t; s++) {
                        const moe_real *ks = kb + (size_t)s * kvs;
                        moe_real *dks = dkb + (size_t)s * kvs;
                        moe_real ds = dS[s];
                        for (int d = 0; d < D; d++) {
                            dqt[d] += ds * ks[d];
                            dks[d] += ds * qt[d];
                        }
                    }
                }
            }
        }
        free(vt);
        free(dS);
    }
}
