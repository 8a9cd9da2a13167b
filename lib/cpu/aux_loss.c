/*
 * Load balancing for the router (CPU reference): the auxiliary loss (global and
 * per-sequence), the z-loss, and the aux-loss-free expert-bias update.
 *
 * Auxiliary loss (Switch Transformer, as Megatron Core computes it), for a
 * group of T tokens:
 *     L = coeff · E / (k · T²) · Σ_i c_i · Σ_t s_{t,i}
 * s: scores of a full softmax over the E experts (sigmoid router: σ(z)/Σσ(z)),
 * c_i: how many of the T tokens have expert i in the plain top-k of s.
 * With perfect balance c_i = T·k/E and Σ_t s_{t,i} = T/E, so L = coeff: the
 * coefficient *is* the loss at balance, whatever E, k and T are.
 * Only s carries gradient: ∂L/∂s_{t,i} = coeff·E/(k·T²)·c_i; then through the
 * softmax (or the normalised sigmoid) to the logits.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "router.h"

static inline double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

/* Scores for the aux loss of one token: softmax, or σ normalised to sum 1. */
static void aux_scores(double *s, const moe_real *z, int E, moe_score_fn fn) {
    if (fn == MOE_SCORE_SOFTMAX) {
        double m = z[0];
        for (int e = 1; e < E; e++)
            m = z[e] > m ? z[e] : m;
        double sum = 0.0;
        for (int e = 0; e < E; e++)
            sum += (s[e] = exp((double)z[e] - m));
        for (int e = 0; e < E; e++)
            s[e] /= sum;
    } else {
        double sum = 0.0;
        for (int e = 0; e < E; e++)
            sum += (s[e] = sigmoid(z[e]));
        for (int e = 0; e < E; e++)
            s[e] /= (sum + 1e-20);
    }
}

/* Add one to counts[i] for each i in the plain top-k of s (ties: lower index). */
static void count_topk(long long *counts, const double *s, int E, int k) {
    int picked[MOE_MAX_TOPK];
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int m = 0; m < j; m++)
                taken |= picked[m] == e;
            if (!taken && (best < 0 || s[e] > s[best]))
                best = e;
        }
        picked[j] = best;
        counts[best]++;
    }
}

/* Counts and per-expert score sums of one group of T tokens. */
static void group_stats(long long *counts, double *ssum, const moe_real *logits, int T, int E,
                        int k, moe_score_fn fn, double *s) {
    memset(counts, 0, sizeof(long long) * E);
    memset(ssum, 0, sizeof(double) * E);
    for (int t = 0; t < T; t++) {
        aux_scores(s, logits + (size_t)t * E, E, fn);
        count_topk(counts, s, E, k);
        for (int e = 0; e < E; e++)
            ssum[e] += s[e];
    }
}

double moe_cpu_aux_loss_forward(const moe_real *logits, int N, int group_len, int E, int k,
                                moe_score_fn fn, double coeff) {
    MOE_ASSERT(group_len > 0 && N % group_len == 0 && k <= MOE_MAX_TOPK);
    const int groups = N / group_len, T = group_len;
    long long *c = malloc(sizeof(long long) * E);
    double *ssum = malloc(sizeof(double) * E), *s = malloc(sizeof(double) * E);
    MOE_ASSERT(c && ssum && s);
    double total = 0.0;
    for (int g = 0; g < groups; g++) {
        group_stats(c, ssum, logits + (size_t)g * T * E, T, E, k, fn, s);
        double dot = 0.0;
        for (int e = 0; e < E; e++)
            dot += (double)c[e] * ssum[e];
        total += coeff * E / ((double)k * T * T) * dot;
    }
    free(c); free(ssum); free(s);
    return total / groups;
}

void moe_cpu_aux_loss_backward(moe_real *dlogits, const moe_real *logits, int N, int group_len,
                               int E, int k, moe_score_fn fn, double coeff, double scale) {
    MOE_ASSERT(group_len > 0 && N % group_len == 0 && k <= MOE_MAX_TOPK);
    const int groups = N / group_len, T = group_len;
    long long *c = malloc(sizeof(long long) * E);
    double *ssum = malloc(sizeof(double) * E), *s = malloc(sizeof(double) * E);
    double *ds = malloc(sizeof(double) * E);
    MOE_ASSERT(c && ssum && s && ds);
    for (int g = 0; g < groups; g++) {
        const moe_real *lg = logits + (size_t)g * T * E;
        group_stats(c, ssum, lg, T, E, k, fn, s);
        /* the loss is averaged over groups, hence the 1/groups */
        double f = scale * coeff * E / ((double)k * T * T) / groups;
        for (int e = 0; e < E; e++)
            ds[e] = f * (double)c[e];
        for (int t = 0; t < T; t++) {
            const moe_real *z = lg + (size_t)t * E;
            moe_real *dz = dlogits + ((size_t)g * T + t) * E;
            aux_scores(s, z, E, fn);
            double dot = 0.0;
            for (int e = 0; e < E; e++)
                dot += s[e] * ds[e];
            if (fn == MOE_SCORE_SOFTMAX) {
                for (int e = 0; e < E; e++)
                    dz[e] += (moe_real)(s[e] * (ds[e] - dot));
            } else {
                /* s_e = σ_e / S: dσ_e = (ds_e − Σ s·ds)/S, dz = dσ σ(1−σ) */
                double S = 0.0;
                for (int e = 0; e < E; e++)
                    S += sigmoid(z[e]);
                S += 1e-20;
                for (int e = 0; e < E; e++) {
                    double sg = sigmoid(z[e]);
                    dz[e] += (moe_real)((ds[e] - dot) / S * sg * (1.0 - sg));
                }
            }
        }
    }
    free(c); free(ssum); free(s); free(ds);
}

/* logsumexp of one row, in double. */
static double lse_row(const moe_real *z, int E) {
    double m = z[0];
    for (int e = 1; e < E; e++)
        m = z[e] > m ? z[e] : m;
    double s = 0.0;
    for (int e = 0; e < E; e++)
        s += exp((double)z[e] - m);
    return m + log(s);
}

double moe_cpu_z_loss_forward(const moe_real *logits, int N, int E, double coeff) {
    double total = 0.0;
    for (int n = 0; n < N; n++) {
        double l = lse_row(logits + (size_t)n * E, E);
        total += l * l;
    }
    return coeff * total / N;
}

void moe_cpu_z_loss_backward(moe_real *dlogits, const moe_real *logits, int N, int E, double coeff,
                             double scale) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const moe_real *z = logits + (size_t)n * E;
        double l = lse_row(z, E);
        double f = scale * coeff * 2.0 * l / N;
        for (int e = 0; e < E; e++)
            dlogits[(size_t)n * E + e] += (moe_real)(f * exp((double)z[e] - l));
    }
}

void moe_expert_bias_update(float *bias, const long long *counts, int E, double rate) {
    double mean = 0.0;
    for (int e = 0; e < E; e++)
        mean += (double)counts[e];
    mean /= E;
    for (int e = 0; e < E; e++) {
        double off = mean - (double)counts[e];
        bias[e] += (float)(rate * ((off > 0) - (off < 0)));
    }
}
