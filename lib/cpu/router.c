/*
 * The MoE router (CPU reference). See router.h for the variants; Megatron
 * Core's `topk_routing_with_score_function` is the specification.
 *
 * Gradients. Selection (which experts) is piecewise constant in the logits,
 * so only the weights carry gradient:
 *  - softmax over the k selected logits: dz_j = w_j (dw_j − Σ_m w_m dw_m);
 *  - pre-softmax, w_j = p_{i_j}: dp is dw scattered to the selected experts,
 *    then dz = p ⊙ (dp − Σ_i p_i dp_i) over all E;
 *  - sigmoid renormalised, w_j = σ_j / S with S = Σ_m σ_m (+1e-20):
 *    dσ_j = (dw_j − Σ_m dw_m w_m) / S, then dz_j = dσ_j σ_j (1 − σ_j).
 * A scaling factor s multiplies the final weights, so dw is first multiplied by s.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "router.h"

moe_router_params moe_router_params_from_config(const moe_config *cfg) {
    moe_router_params p;
    p.num_experts = cfg->num_experts;
    p.topk = cfg->moe_router_topk;
    p.score_fn = cfg->score_fn;
    p.pre_softmax = cfg->moe_router_pre_softmax;
    p.num_groups = cfg->moe_router_num_groups;
    p.group_topk = cfg->moe_router_group_topk;
    p.scaling_factor = cfg->moe_router_topk_scaling_factor;
    return p;
}

static inline double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

/* Indices of the k largest of v[0..n), largest first; ties go to the lower index.
 * Entries equal to -INFINITY are never picked while finite ones remain. */
static void topk_indices(int *idx, const double *v, int n, int k) {
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int i = 0; i < n; i++) {
            int taken = 0;
            for (int m = 0; m < j && !taken; m++)
                taken = idx[m] == i;
            if (taken)
                continue;
            if (best < 0 || v[i] > v[best])
                best = i;
        }
        idx[j] = best;
    }
}

/* softmax of v[0..n) into out, in double. */
static void softmax(double *out, const double *v, int n) {
    double m = v[0];
    for (int i = 1; i < n; i++)
        m = v[i] > m ? v[i] : m;
    double s = 0.0;
    for (int i = 0; i < n; i++)
        s += (out[i] = exp(v[i] - m));
    for (int i = 0; i < n; i++)
        out[i] /= s;
}

/* Top-k of the selection score, restricted to the best groups when group-limited. */
static void select_experts(int *idx, double *sel, int E, const moe_router_params *p,
                           double *group_score, int *group_idx, int *tmp) {
    const int k = p->topk;
    if (p->num_groups > 0) {
        const int G = p->num_groups, per = E / G, kg = k / p->group_topk;
        for (int g = 0; g < G; g++) {
            topk_indices(tmp, sel + g * per, per, kg);
            double s = 0.0;
            for (int j = 0; j < kg; j++)
                s += sel[g * per + tmp[j]];
            group_score[g] = s;
        }
        topk_indices(group_idx, group_score, G, p->group_topk);
        for (int g = 0; g < G; g++) {
            int kept = 0;
            for (int j = 0; j < p->group_topk; j++)
                kept |= group_idx[j] == g;
            if (!kept)
                for (int e = g * per; e < (g + 1) * per; e++)
                    sel[e] = -INFINITY;
        }
    }
    topk_indices(idx, sel, E, k);
}

void moe_cpu_router_forward(int *topk_idx, moe_real *topk_w, const moe_real *logits,
                            const float *bias, const moe_router_params *p, int N) {
    const int E = p->num_experts, k = p->topk;
    const double scale = p->scaling_factor > 0 ? p->scaling_factor : 1.0;
#pragma omp parallel
    {
        double *z = malloc(sizeof(double) * E), *sel = malloc(sizeof(double) * E);
        double *prob = malloc(sizeof(double) * E), *gs = malloc(sizeof(double) * (E + 1));
        int *gi = malloc(sizeof(int) * (E + 1)), *tmp = malloc(sizeof(int) * (E + 1));
        MOE_CHECK_ALLOC(z && sel && prob && gs && gi && tmp, 6 * sizeof(double) * (E + 1),
                        "the router's scratch");
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            int *idx = topk_idx + (size_t)n * k;
            moe_real *w = topk_w + (size_t)n * k;
            for (int e = 0; e < E; e++)
                z[e] = logits[(size_t)n * E + e];
            if (p->score_fn == MOE_SCORE_SOFTMAX && p->pre_softmax) {
                softmax(prob, z, E);
                memcpy(sel, prob, sizeof(double) * E);
                select_experts(idx, sel, E, p, gs, gi, tmp);
                for (int j = 0; j < k; j++)
                    w[j] = (moe_real)(prob[idx[j]] * scale);
            } else if (p->score_fn == MOE_SCORE_SOFTMAX) {
                memcpy(sel, z, sizeof(double) * E);
                select_experts(idx, sel, E, p, gs, gi, tmp);
                double zk[MOE_MAX_TOPK], wk[MOE_MAX_TOPK];
                for (int j = 0; j < k; j++)
                    zk[j] = z[idx[j]];
                softmax(wk, zk, k);
                for (int j = 0; j < k; j++)
                    w[j] = (moe_real)(wk[j] * scale);
            } else { /* sigmoid */
                for (int e = 0; e < E; e++) {
                    prob[e] = sigmoid(z[e]);
                    sel[e] = prob[e] + (bias ? (double)bias[e] : 0.0);
                }
                select_experts(idx, sel, E, p, gs, gi, tmp);
                double S = 0.0;
                for (int j = 0; j < k; j++)
                    S += prob[idx[j]];
                for (int j = 0; j < k; j++)
                    w[j] = (moe_real)((k > 1 ? prob[idx[j]] / (S + 1e-20) : prob[idx[j]]) * scale);
            }
        }
        free(z); free(sel); free(prob); free(gs); free(gi); free(tmp);
    }
}

void moe_cpu_router_backward(moe_real *dlogits, const moe_real *dtopk_w, const moe_real *logits,
                             const int *topk_idx, const moe_router_params *p, int N) {
    const int E = p->num_experts, k = p->topk;
    const double scale = p->scaling_factor > 0 ? p->scaling_factor : 1.0;
    MOE_ASSERT(k <= MOE_MAX_TOPK);
#pragma omp parallel
    {
        double *z = malloc(sizeof(double) * E), *prob = malloc(sizeof(double) * E);
        double *dp = malloc(sizeof(double) * E);
        MOE_CHECK_ALLOC(z && prob && dp, 3 * sizeof(double) * E, "the router's scratch");
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            const int *idx = topk_idx + (size_t)n * k;
            moe_real *dz = dlogits + (size_t)n * E;
            double dw[MOE_MAX_TOPK], w[MOE_MAX_TOPK];
            for (int j = 0; j < k; j++)
                dw[j] = scale * dtopk_w[(size_t)n * k + j];
            for (int e = 0; e < E; e++)
                z[e] = logits[(size_t)n * E + e];
            if (p->score_fn == MOE_SCORE_SOFTMAX && p->pre_softmax) {
                softmax(prob, z, E);
                for (int e = 0; e < E; e++)
                    dp[e] = 0.0;
                for (int j = 0; j < k; j++)
                    dp[idx[j]] += dw[j];
                double dot = 0.0;
                for (int e = 0; e < E; e++)
                    dot += prob[e] * dp[e];
                for (int e = 0; e < E; e++)
                    dz[e] += (moe_real)(prob[e] * (dp[e] - dot));
            } else if (p->score_fn == MOE_SCORE_SOFTMAX) {
                double zk[MOE_MAX_TOPK];
                for (int j = 0; j < k; j++)
                    zk[j] = z[idx[j]];
                softmax(w, zk, k);
                double dot = 0.0;
                for (int j = 0; j < k; j++)
                    dot += w[j] * dw[j];
                for (int j = 0; j < k; j++)
                    dz[idx[j]] += (moe_real)(w[j] * (dw[j] - dot));
            } else { /* sigmoid */
                double S = 0.0, sig[MOE_MAX_TOPK];
                for (int j = 0; j < k; j++)
                    S += (sig[j] = sigmoid(z[idx[j]]));
                double dsig[MOE_MAX_TOPK];
                if (k > 1) {
                    S += 1e-20;
                    double dot = 0.0;
                    for (int j = 0; j < k; j++)
                        dot += dw[j] * sig[j] / S;
                    for (int j = 0; j < k; j++)
                        dsig[j] = (dw[j] - dot) / S;
                } else {
                    dsig[0] = dw[0];
                }
                for (int j = 0; j < k; j++)
                    dz[idx[j]] += (moe_real)(dsig[j] * sig[j] * (1.0 - sig[j]));
            }
        }
        free(z); free(prob); free(dp);
    }
}
