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
 *
 * Split over ranks (moe_aux_shape: tensor parallelism runs the MoE layer on each rank's
 * sequence shard): the counts are a sum over tokens, so each rank counts its own rows and
 * an all-reduce gives every rank the c_i of the whole group; the loss is linear in the
 * score sums, so each rank's part uses only its own rows' scores, the parts add up to L,
 * and each rank's gradient is exactly that of its rows. (Megatron does the same: counts
 * summed over TP x CP, the token count of the whole group, each rank's own scores.)
 * Under context parallelism a sequence's rows on a rank are two runs (its early and late
 * chunk, moe_aux_shape::run); each row finds its group by moe_aux_group(), the rest holds.
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

static void check_shape(const moe_aux_shape *sh) {
    MOE_ASSERT(sh->N >= 0 && sh->row0 >= 0 && sh->group_len > 0 && sh->groups > 0 &&
               (long long)sh->row0 + sh->N <= (long long)sh->groups * sh->group_len &&
               sh->k >= 1 && sh->k <= MOE_MAX_TOPK && sh->k <= sh->E && sh->run >= 0);
}

void moe_cpu_aux_loss_counts(long long *counts, const moe_real *logits, const moe_aux_shape *sh) {
    check_shape(sh);
    const int E = sh->E;
    double *s = malloc(sizeof(double) * E);
    MOE_ASSERT(s);
    memset(counts, 0, sizeof(long long) * (size_t)sh->groups * E);
    for (int t = 0; t < sh->N; t++) {
        aux_scores(s, logits + (size_t)t * E, E, sh->fn);
        count_topk(counts + (size_t)moe_aux_group(sh, (long long)sh->row0 + t) * E, s, E, sh->k);
    }
    free(s);
}

double moe_cpu_aux_loss_forward_shard(const moe_real *logits, const long long *counts,
                                      const moe_aux_shape *sh, double coeff) {
    check_shape(sh);
    const int E = sh->E, T = sh->group_len, G = sh->groups;
    /* each group's score sums over this rank's rows of it, rows in order */
    double *ssum = calloc((size_t)G * E, sizeof(double)), *s = malloc(sizeof(double) * E);
    MOE_ASSERT(ssum && s);
    for (int t = 0; t < sh->N; t++) {
        aux_scores(s, logits + (size_t)t * E, E, sh->fn);
        double *g = ssum + (size_t)moe_aux_group(sh, (long long)sh->row0 + t) * E;
        for (int e = 0; e < E; e++)
            g[e] += s[e];
    }
    double total = 0.0; /* a group without rows here adds exactly 0 */
    for (int g = 0; g < G; g++) {
        const long long *c = counts + (size_t)g * E;
        double dot = 0.0;
        for (int e = 0; e < E; e++)
            dot += (double)c[e] * ssum[(size_t)g * E + e];
        total += coeff * E / ((double)sh->k * T * T) * dot;
    }
    free(ssum); free(s);
    return total / G;
}

/* One rank holding every row: groups of group_len, counted from its own logits. */
static moe_aux_shape one_rank(int N, int group_len, int E, int k, moe_score_fn fn) {
    MOE_ASSERT(group_len > 0 && N % group_len == 0 && k <= MOE_MAX_TOPK);
    return (moe_aux_shape){N, 0, group_len, N / group_len, E, k, fn, 0};
}

double moe_cpu_aux_loss_forward(const moe_real *logits, int N, int group_len, int E, int k,
                                moe_score_fn fn, double coeff) {
    const moe_aux_shape sh = one_rank(N, group_len, E, k, fn);
    long long *c = malloc(sizeof(long long) * (size_t)sh.groups * E);
    MOE_ASSERT(c);
    moe_cpu_aux_loss_counts(c, logits, &sh);
    const double loss = moe_cpu_aux_loss_forward_shard(logits, c, &sh, coeff);
    free(c);
    return loss;
}

void moe_cpu_aux_loss_backward_shard(moe_real *dlogits, const moe_real *logits,
                                     const long long *counts, const moe_aux_shape *sh,
                                     double coeff, double scale) {
    check_shape(sh);
    const int E = sh->E, T = sh->group_len;
    double *s = malloc(sizeof(double) * E), *ds = malloc(sizeof(double) * E);
    MOE_ASSERT(s && ds);
    /* the loss is averaged over groups, hence the 1/groups */
    const double f = scale * coeff * E / ((double)sh->k * T * T) / sh->groups;
    for (int t = 0; t < sh->N; t++) {
        const long long *c = counts + (size_t)moe_aux_group(sh, (long long)sh->row0 + t) * E;
        for (int e = 0; e < E; e++)
            ds[e] = f * (double)c[e];
        const moe_real *z = logits + (size_t)t * E;
        moe_real *dz = dlogits + (size_t)t * E;
        aux_scores(s, z, E, sh->fn);
        double dot = 0.0;
        for (int e = 0; e < E; e++)
            dot += s[e] * ds[e];
        if (sh->fn == MOE_SCORE_SOFTMAX) {
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
    free(s); free(ds);
}

void moe_cpu_aux_loss_backward(moe_real *dlogits, const moe_real *logits, int N, int group_len,
                               int E, int k, moe_score_fn fn, double coeff, double scale) {
    const moe_aux_shape sh = one_rank(N, group_len, E, k, fn);
    long long *c = malloc(sizeof(long long) * (size_t)sh.groups * E);
    MOE_ASSERT(c);
    moe_cpu_aux_loss_counts(c, logits, &sh);
    moe_cpu_aux_loss_backward_shard(dlogits, logits, c, &sh, coeff, scale);
    free(c);
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
