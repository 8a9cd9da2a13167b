/*
 * Router semantics against hand-computed values, one test per router variant that moe.c
 * implements (docs/megatron.md); the load-balancing losses at balance and imbalance; the
 * expert-bias rule; the permutation; and the MoE layer against a direct per-token sum.
 *
 * The test case tagged "ch01" grades chapter 01's exercises (make check-ch01, and with
 * STUDENT=1 the student versions of the router's default path, the aux loss and the
 * permutation): it uses only the default softmax router.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cpu/moe_ops.h"
#include "cpu/ops.h"
#include "cpu/router.h"
#include "helpers.h"
#include "mlp.h"
#include "moe/capacity.h"
#include "moe/layer.h"
#include "suites.h"

static moe_router_params rp(int E, int k, moe_score_fn fn, int pre, int G, int GK, double s) {
    moe_router_params p = {E, k, fn, pre, G, GK, s};
    return p;
}

/* Route one token and compare indices exactly and weights to 1e-6. */
static void expect_route(const moe_real *logits, const float *bias, moe_router_params p,
                         const int *want_idx, const double *want_w) {
    int idx[16];
    moe_real w[16];
    for (int j = 0; j < p.topk; j++) {
        idx[j] = -1;
        w[j] = (moe_real)NAN;
    }
    moe_cpu_router_forward(idx, w, logits, bias, &p, 1);
    for (int j = 0; j < p.topk; j++) {
        ck_assert_int_eq(idx[j], want_idx[j]);
        ck_assert_double_eq_tol(w[j], want_w[j], 1e-6);
    }
}

static const moe_real L4[4] = {1, 3, 2, 0};

START_TEST(test_router_softmax_topk) {
    /* top-2 of the logits (3 and 2), then softmax over just those two */
    double e3 = exp(3.0), e2 = exp(2.0);
    int idx[2] = {1, 2};
    double w[2] = {e3 / (e3 + e2), e2 / (e3 + e2)};
    expect_route(L4, NULL, rp(4, 2, MOE_SCORE_SOFTMAX, 0, 0, 0, 0), idx, w);
    /* top-1: the single weight is softmax over one value = 1 */
    int idx1[1] = {1};
    double w1[1] = {1.0};
    expect_route(L4, NULL, rp(4, 1, MOE_SCORE_SOFTMAX, 0, 0, 0, 0), idx1, w1);
}
END_TEST

START_TEST(test_router_softmax_ties_and_tokens) {
    /* several tokens in one call, each routed on its own row; equal logits go to the
     * lower index, so the 2-2 tie of token 0 picks experts 0 then 1 (weights 1/2 each) */
    const moe_real z[3 * 4] = {2, 2, 1, 2, /**/ 0, 0, 5, 1, /**/ -1, -2, -3, -4};
    int idx[6];
    moe_real w[6];
    moe_router_params p = rp(4, 2, MOE_SCORE_SOFTMAX, 0, 0, 0, 0);
    moe_cpu_router_forward(idx, w, z, NULL, &p, 3);
    const int want_idx[6] = {0, 1, 2, 3, 0, 1};
    const double want_w[6] = {0.5, 0.5, exp(5.0) / (exp(5.0) + exp(1.0)),
                              exp(1.0) / (exp(5.0) + exp(1.0)), exp(-1.0) / (exp(-1.0) + exp(-2.0)),
                              exp(-2.0) / (exp(-1.0) + exp(-2.0))};
    for (int a = 0; a < 6; a++) {
        ck_assert_int_eq(idx[a], want_idx[a]);
        ck_assert_double_eq_tol(w[a], want_w[a], 1e-6);
    }
}
END_TEST

START_TEST(test_router_pre_softmax) {
    /* softmax over all four, then top-2, no renormalisation (weights sum < 1) */
    double s = exp(1.0) + exp(3.0) + exp(2.0) + exp(0.0);
    int idx[2] = {1, 2};
    double w[2] = {exp(3.0) / s, exp(2.0) / s};
    expect_route(L4, NULL, rp(4, 2, MOE_SCORE_SOFTMAX, 1, 0, 0, 0), idx, w);
}
END_TEST

static double sig(double x) { return 1.0 / (1.0 + exp(-x)); }

START_TEST(test_router_sigmoid) {
    /* sigmoid scores, top-2, renormalised over the two */
    int idx[2] = {1, 2};
    double w[2] = {sig(3) / (sig(3) + sig(2)), sig(2) / (sig(3) + sig(2))};
    expect_route(L4, NULL, rp(4, 2, MOE_SCORE_SIGMOID, 0, 0, 0, 0), idx, w);
    /* top-1: no renormalisation, the weight is the sigmoid itself */
    int idx1[1] = {1};
    double w1[1] = {sig(3)};
    expect_route(L4, NULL, rp(4, 1, MOE_SCORE_SIGMOID, 0, 0, 0, 0), idx1, w1);
}
END_TEST

START_TEST(test_router_sigmoid_expert_bias) {
    /* the bias changes WHICH experts are picked (σ(0)+0.6 = 1.1 beats σ(3) ≈ 0.95),
     * but the weights come from the unbiased scores */
    const float bias[4] = {0, 0, 0, 0.6f};
    int idx[2] = {3, 1};
    double w[2] = {sig(0) / (sig(0) + sig(3)), sig(3) / (sig(0) + sig(3))};
    expect_route(L4, bias, rp(4, 2, MOE_SCORE_SIGMOID, 0, 0, 0, 0), idx, w);
}
END_TEST

START_TEST(test_router_scaling_factor) {
    double e3 = exp(3.0), e2 = exp(2.0);
    int idx[2] = {1, 2};
    double w[2] = {2.5 * e3 / (e3 + e2), 2.5 * e2 / (e3 + e2)};
    expect_route(L4, NULL, rp(4, 2, MOE_SCORE_SOFTMAX, 0, 0, 0, 2.5), idx, w);
}
END_TEST

START_TEST(test_router_group_limited) {
    /* 8 experts in 4 groups of 2; keep 2 groups; k = 4, so a group's score is the sum of
     * its top 4/2 = 2 logits: g0 = 5−3 = 2, g1 = 2+2 = 4, g2 = 4+3.5 = 7.5, g3 = 4.6−5 = −0.4.
     * Groups 2 and 1 survive; plain top-4 would have picked experts 0 and 6. */
    const moe_real z[8] = {5, -3, 2, 2, 4, 3.5, 4.6, -5};
    double s = exp(4.0) + exp(3.5) + 2 * exp(2.0);
    int idx[4] = {4, 5, 2, 3}; /* the 2-2 tie goes to the lower index */
    double w[4] = {exp(4.0) / s, exp(3.5) / s, exp(2.0) / s, exp(2.0) / s};
    expect_route(z, NULL, rp(8, 4, MOE_SCORE_SOFTMAX, 0, 4, 2, 0), idx, w);
    /* without the group limit */
    double s2 = exp(5.0) + exp(4.6) + exp(4.0) + exp(3.5);
    int idx2[4] = {0, 6, 4, 5};
    double w2[4] = {exp(5.0) / s2, exp(4.6) / s2, exp(4.0) / s2, exp(3.5) / s2};
    expect_route(z, NULL, rp(8, 4, MOE_SCORE_SOFTMAX, 0, 0, 0, 0), idx2, w2);
}
END_TEST

START_TEST(test_aux_loss_balance) {
    const double coeff = 0.01;
    const int E = 4, k = 2, T = 8;
    moe_real z[8 * 4];
    /* uniform scores: Σ_t s_ti = T/E for every i and Σ_i c_i = T·k, so L = coeff exactly */
    memset(z, 0, sizeof z);
    ck_assert_double_eq_tol(moe_cpu_aux_loss_forward(z, T, T, E, k, MOE_SCORE_SOFTMAX, coeff),
                            coeff, 1e-12);
    ck_assert_double_eq_tol(moe_cpu_aux_loss_forward(z, T, T, E, k, MOE_SCORE_SIGMOID, coeff),
                            coeff, 1e-12);
    /* a balanced routing with peaked scores: token t prefers experts t%4 and (t+1)%4 */
    for (int t = 0; t < T; t++)
        for (int e = 0; e < E; e++)
            z[t * E + e] = (e == t % 4 || e == (t + 1) % 4) ? 5 : 0;
    ck_assert_double_eq_tol(moe_cpu_aux_loss_forward(z, T, T, E, k, MOE_SCORE_SOFTMAX, coeff),
                            coeff, 1e-6);
    /* the same per sequence (two sequences of 4) */
    ck_assert_double_eq_tol(moe_cpu_aux_loss_forward(z, T, 4, E, k, MOE_SCORE_SOFTMAX, coeff),
                            coeff, 1e-6);
    /* collapse: every token prefers experts 0 and 1 → counts (8,8,0,0), and the loss
     * approaches its maximum coeff·E/k as the scores concentrate */
    for (int t = 0; t < T; t++)
        for (int e = 0; e < E; e++)
            z[t * E + e] = e < 2 ? 20 : 0;
    double collapsed = moe_cpu_aux_loss_forward(z, T, T, E, k, MOE_SCORE_SOFTMAX, coeff);
    ck_assert_double_eq_tol(collapsed, coeff * E / k, 1e-6);
}
END_TEST

START_TEST(test_z_loss_value) {
    moe_real z[2 * 4] = {0, 0, 0, 0, 1, 2, 3, 4};
    double l0 = log(4.0), l1 = log(exp(1.0) + exp(2.0) + exp(3.0) + exp(4.0));
    ck_assert_double_eq_tol(moe_cpu_z_loss_forward(z, 2, 4, 0.1), 0.1 * (l0 * l0 + l1 * l1) / 2,
                            1e-6);
}
END_TEST

START_TEST(test_expert_bias_update) {
    /* mean count 6: under-loaded experts go up by rate, over-loaded down, exact ones stay */
    float bias[4] = {0.5f, 0.5f, 0.5f, 0.5f};
    const long long counts[4] = {10, 2, 6, 6};
    moe_expert_bias_update(bias, counts, 4, 1e-3);
    ck_assert_float_eq(bias[0], 0.5f - 1e-3f);
    ck_assert_float_eq(bias[1], 0.5f + 1e-3f);
    ck_assert_float_eq(bias[2], 0.5f);
    ck_assert_float_eq(bias[3], 0.5f);
}
END_TEST

START_TEST(test_permutation) {
    /* 3 tokens, k = 2: assignments a = 0..5 go to experts 2,0 | 0,1 | 1,2 */
    const int topk_idx[6] = {2, 0, 0, 1, 1, 2};
    int perm_src[6], row_of[6], off[4];
    long long counts[3] = {0, 0, 0};
    moe_cpu_permute_index(perm_src, row_of, off, counts, topk_idx, 3, 2, 3);
    const int want_src[6] = {1, 2, 3, 4, 0, 5}, want_row[6] = {4, 0, 1, 2, 3, 5},
              want_off[4] = {0, 2, 4, 6};
    for (int i = 0; i < 6; i++) {
        ck_assert_int_eq(perm_src[i], want_src[i]);
        ck_assert_int_eq(row_of[i], want_row[i]);
    }
    for (int e = 0; e <= 3; e++)
        ck_assert_int_eq(off[e], want_off[e]);
    for (int e = 0; e < 3; e++)
        ck_assert_int_eq((int)counts[e], 2);
    /* permute then unpermute-sum of a row-identity gives k copies back */
    moe_real x[3] = {10, 20, 30}, xp[6], out[3] = {0, 0, 0};
    moe_cpu_permute_tokens(xp, x, perm_src, 6, 2, 1);
    const moe_real want_xp[6] = {10, 20, 20, 30, 10, 30};
    for (int r = 0; r < 6; r++)
        ck_assert_double_eq(xp[r], want_xp[r]);
    moe_cpu_unpermute_sum(out, xp, row_of, 3, 2, 1);
    for (int n = 0; n < 3; n++)
        ck_assert_double_eq(out[n], 2 * x[n]);
    /* the fused scatter's combine: the same rows in slot order (ys[a] = xp[row_of[a]]), with
     * slot 3 over a budget (row_of = -1: poisoned, and skipped), gives the same sums */
    moe_real ys[6], o1[3] = {1, 2, 3}, o2[3] = {1, 2, 3};
    int ro[6];
    for (int a = 0; a < 6; a++) {
        ro[a] = a == 3 ? -1 : row_of[a];
        ys[a] = a == 3 ? NAN : xp[row_of[a]];
    }
    moe_cpu_unpermute_sum(o1, xp, ro, 3, 2, 1);
    moe_cpu_unpermute_sum_slots(o2, ys, ro, 3, 2, 1);
    for (int n = 0; n < 3; n++)
        ck_assert_double_eq(o1[n], o2[n]);
    ck_assert_double_eq(o2[1], 2 + x[1]); /* token 1 lost its second row (slot 3) */
}
END_TEST

/* Capacity and drop policies against a hand count. */
START_TEST(test_capacity_drops) {
    /* capacity = ceil(N·k/E · factor): 8 tokens, top-2 of 4 experts, factor 1.25 → 5 */
    ck_assert_int_eq(moe_expert_capacity(8, 2, 4, 1.25), 5);
    ck_assert_int_eq(moe_expert_capacity(8, 2, 4, 1.0), 4);
    /* 5 tokens, top-1, 2 experts; expert 0 gets 4 tokens but holds 2 */
    const int idx[5] = {0, 0, 0, 1, 0};
    const moe_real w[5] = {0.1f, 0.9f, 0.5f, 0.3f, 0.7f};
    int out[5];
    /* probs: keep the two highest weights (0.9 at a1, 0.7 at a4), drop a0 and a2 */
    ck_assert_int_eq((int)moe_apply_capacity(out, idx, w, 5, 1, 2, 2, 0), 2);
    const int want_probs[5] = {2, 0, 2, 1, 0};
    for (int a = 0; a < 5; a++)
        ck_assert_int_eq(out[a], want_probs[a]);
    /* position: keep the earliest two (a0, a1), drop a2 and a4 */
    ck_assert_int_eq((int)moe_apply_capacity(out, idx, w, 5, 1, 2, 2, 1), 2);
    const int want_pos[5] = {0, 0, 2, 1, 2};
    for (int a = 0; a < 5; a++)
        ck_assert_int_eq(out[a], want_pos[a]);
    /* under capacity nothing is dropped */
    ck_assert_int_eq((int)moe_apply_capacity(out, idx, w, 5, 1, 2, 4, 0), 0);
    for (int a = 0; a < 5; a++)
        ck_assert_int_eq(out[a], idx[a]);
}
END_TEST

/* The naive layer must equal Σ_j w_j · expert_{i_j}(x) + shared(x), computed token by token. */
START_TEST(test_moe_layer_matches_direct_sum) {
    const moe_backend *be = moe_backend_cpu();
    moe_layer_dims d = {.N = 12, .T = 6, .H = 8, .E = 4, .k = 2, .F = 5, .Fs = 3,
                        .router = rp(4, 2, MOE_SCORE_SOFTMAX, 0, 0, 0, 0),
                        .lb_type = MOE_LB_AUX, .aux_coeff = 0.01, .z_coeff = 0.001};
    const int N = d.N, H = d.H, E = d.E, F = d.F, Fs = d.Fs;
    moe_real *x = calloc((size_t)N * H, sizeof *x), *out = calloc((size_t)N * H, sizeof *out);
    moe_real *wr = calloc((size_t)E * H, sizeof *wr), *w1 = calloc((size_t)E * 2 * F * H, sizeof *w1);
    moe_real *w2 = calloc((size_t)E * H * F, sizeof *w2), *s1 = calloc((size_t)2 * Fs * H, sizeof *s1);
    moe_real *s2 = calloc((size_t)H * Fs, sizeof *s2);
    moe_test_randn(x, (size_t)N * H, 30, 1.0);
    moe_test_randn(wr, (size_t)E * H, 31, 1.0);
    moe_test_randn(w1, (size_t)E * 2 * F * H, 32, 0.5);
    moe_test_randn(w2, (size_t)E * H * F, 33, 0.5);
    moe_test_randn(s1, (size_t)2 * Fs * H, 34, 0.5);
    moe_test_randn(s2, (size_t)H * Fs, 35, 0.5);
    moe_test_poison(out, (size_t)N * H);
    moe_layer_weights w = {wr, w1, w2, s1, s2, NULL, NULL, NULL};
    moe_layer_acts a;
    moe_layer_workspace ws;
    moe_layer_acts_alloc(be, &a, &d);
    moe_layer_workspace_alloc(be, &ws, &d);
    moe_layer_forward(be, out, x, &w, NULL, &d, &a, &ws);

    long long total = 0;
    for (int e = 0; e < E; e++)
        total += a.counts[e];
    ck_assert_int_eq((int)total, N * d.k);

    moe_real row[8], tmp[8], gu[10], act[5], gus[6], acts[3];
    for (int n = 0; n < N; n++) {
        for (int c = 0; c < H; c++)
            row[c] = 0;
        for (int j = 0; j < d.k; j++) {
            int e = a.topk_idx[n * d.k + j];
            moe_real wt = a.topk_w[n * d.k + j];
            moe_mlp_forward(be, tmp, gu, act, x + (size_t)n * H, &wt, w1 + (size_t)e * 2 * F * H,
                            w2 + (size_t)e * H * F, 1, H, F);
            for (int c = 0; c < H; c++)
                row[c] += tmp[c];
        }
        moe_mlp_forward(be, tmp, gus, acts, x + (size_t)n * H, NULL, s1, s2, 1, H, Fs);
        for (int c = 0; c < H; c++)
            ck_assert_double_eq_tol(out[(size_t)n * H + c], row[c] + tmp[c], 1e-5);
    }
    moe_layer_acts_free(be, &a);
    moe_layer_workspace_free(be, &ws);
    free(x); free(out); free(wr); free(w1); free(w2); free(s1); free(s2);
    moe_cpu_matmul_release();
}
END_TEST

Suite *suite_router(void) {
    Suite *s = suite_create("router");
    /* chapter 01's exercises: the default router, the aux loss, the permutation, the layer */
    const TTest *ch01[] = {test_router_softmax_topk,     test_router_softmax_ties_and_tokens,
                           test_router_scaling_factor,   test_aux_loss_balance,
                           test_permutation,             test_moe_layer_matches_direct_sum};
    tcase_set_tags(moe_test_tcase(s, "ch01", 60, ch01, 6), "ch01");
    /* the other router variants, the z-loss, the expert bias, capacity */
    const TTest *other[] = {test_router_pre_softmax,   test_router_sigmoid,
                            test_router_sigmoid_expert_bias, test_router_group_limited,
                            test_z_loss_value,         test_expert_bias_update,
                            test_capacity_drops};
    moe_test_tcase(s, "router", 60, other, 7);
    return s;
}
