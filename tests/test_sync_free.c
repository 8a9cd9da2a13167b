/*
 * The sync-free MoE layer on the CPU (chapter 06): the budgeted permutation index against
 * the plain one, its overflow (nothing written past the budget, the flag raised), the
 * overflow protocol with adversarial routing (grow, re-run, the same loss and gradients bit
 * for bit as an ample budget), capacity runs that never overflow, the flag's validation, and
 * the fused dispatcher's device plan against the host plan's arithmetic (under EP; the
 * distributed runs are in tests/mpi_ep.c).
 * The CUDA twins are tested against these in tests/gpu_sync_free.c.
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/moe_ops.h"
#include "helpers.h"
#include "moe/dispatch.h"
#include "step_flags.h"
#include "suites.h"
#include "trainer.h"

/* SMALL-sized runs whose MoE layers are sync-free: our grouped kernel's CPU twin, the
 * sigmoid router with its selection bias (to force the routing), dropless, one rank */
#define SYNC_FREE "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2 " \
                  "--seq-length 16 --micro-batch-size 4 --global-batch-size 8 --num-experts 4 "   \
                  "--moe-router-topk 2 --moe-ffn-hidden-size 32 --ffn-hidden-size 64 "           \
                  "--moe-layer-freq 1 --moe-expert-backend grouped "                            \
                  "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "        \
                  "--moe-aux-loss-coeff 0 --lr 3e-3 --lr-warmup-iters 2 --train-iters 10 "

/* routings of N·k assignments over E experts: 0 random, 1 all on expert E-1, 2 alternating
 * between two hot experts */
static int *routing(int kind, int N, int k, int E, uint64_t stream) {
    const int A = N * k;
    int *idx = malloc(sizeof(int) * A);
    moe_real *u = malloc(sizeof(moe_real) * A);
    moe_test_randn(u, A, stream, 1.0);
    for (int a = 0; a < A; a++) {
        int e = (int)((u[a] > 0 ? u[a] : -u[a]) * E) % E;
        idx[a] = kind == 0 ? e : kind == 1 ? E - 1 : (a / k) % 2 ? 1 : E - 2;
    }
    free(u);
    return idx;
}

/* With a budget of at least N·k, the budgeted index is exactly the plain one, and raises
 * nothing. Outputs poisoned first. */
START_TEST(test_permute_index_budget_matches) {
    const int N = 37, k = 3, E = 8, A = N * k;
    for (int kind = 0; kind < 3; kind++) {
        int *idx = routing(kind, N, k, E, 700 + kind);
        int src[A], row[A], off[E + 1], src_b[A], row_b[A], off_b[E + 1];
        moe_cpu_permute_index(src, row, off, NULL, idx, N, k, E);
        for (int budget = A; budget <= A + 5; budget += 5) {
            memset(src_b, 0x7f, sizeof src_b);
            memset(row_b, 0x7f, sizeof row_b);
            memset(off_b, 0x7f, sizeof off_b);
            int flags = 0;
            moe_cpu_permute_index_budget(src_b, row_b, off_b, &flags, idx, N, k, E, budget);
            ck_assert_int_eq(flags, 0);
            ck_assert(!memcmp(src, src_b, sizeof src));
            ck_assert(!memcmp(row, row_b, sizeof row));
            ck_assert(!memcmp(off, off_b, sizeof off));
        }
        free(idx);
    }
}
END_TEST

/* A budget below N·k: the rows that fit are the plain index's, the rest get row_of = -1,
 * the offsets are clamped, nothing is written past the budget and the flag is raised (and
 * ORed: other bits survive). The combine then skips the rows that have no place. */
START_TEST(test_permute_index_budget_overflow) {
    const int N = 29, k = 2, E = 6, A = N * k, C = 5;
    for (int kind = 0; kind < 3; kind++) {
        int *idx = routing(kind, N, k, E, 710 + kind);
        int src[A], row[A], off[E + 1];
        moe_cpu_permute_index(src, row, off, NULL, idx, N, k, E);
        const int budget = A / 2;
        int src_b[A], row_b[A], off_b[E + 1];
        for (int i = 0; i < A; i++)
            src_b[i] = row_b[i] = -7; /* poison; src_b past the budget is a guard */
        int flags = MOE_STEP_NONFINITE;
        moe_cpu_permute_index_budget(src_b, row_b, off_b, &flags, idx, N, k, E, budget);
        ck_assert_int_eq(flags, MOE_STEP_NONFINITE | MOE_STEP_OVERFLOW);
        for (int r = 0; r < A; r++)
            ck_assert_int_eq(src_b[r], r < budget ? src[r] : -7);
        int placed = 0;
        for (int a = 0; a < A; a++) {
            ck_assert_int_eq(row_b[a], row[a] < budget ? row[a] : -1);
            placed += row_b[a] >= 0;
        }
        ck_assert_int_eq(placed, budget);
        for (int e = 0; e <= E; e++)
            ck_assert_int_eq(off_b[e], off[e] < budget ? off[e] : budget);
        /* the combine adds the placed rows only */
        moe_real yp[A * C], out[N * C];
        for (int i = 0; i < A * C; i++)
            yp[i] = (moe_real)(i % 7 + 1);
        memset(out, 0, sizeof out);
        moe_cpu_unpermute_sum(out, yp, row_b, N, k, C);
        for (int n = 0; n < N; n++) {
            moe_real want = 0;
            for (int j = 0; j < k; j++)
                if (row_b[n * k + j] >= 0)
                    want += yp[(size_t)row_b[n * k + j] * C];
            ck_assert_float_eq(out[(size_t)n * C], want);
        }
        /* the clamped offsets place exactly the budget's rows */
        ck_assert_int_eq(off_b[E], budget);
        free(idx);
    }
}
END_TEST

/* The protocol, every token to one expert and alternating hot experts (helpers.c). */
START_TEST(test_budget_overflow_one_expert) {
    moe_test_budget_protocol(SYNC_FREE, 0, MOE_TEST_ROUTE_ONE_EXPERT);
}
END_TEST

START_TEST(test_budget_overflow_alternating) {
    moe_test_budget_protocol(SYNC_FREE, 0, MOE_TEST_ROUTE_ALTERNATING);
}
END_TEST

/* A capacity bounds every expert's rows, so its sizes are static by construction: with every
 * token sent to one expert and a tiny rank budget, nothing overflows and nothing re-runs;
 * the hot expert drops what is past its capacity instead, and the rows the experts see stay
 * within E · capacity. */
START_TEST(test_capacity_never_overflows) {
    moe_trainer *t = moe_test_trainer(SYNC_FREE "--moe-expert-capacity-factor 1.0 "
                                                "--moe-expert-rank-capacity-factor 0.25",
                                      NULL, 0);
    moe_model *m = t->model;
    const moe_config *c = &m->cfg;
    const int E = c->num_experts, L = c->num_layers;
    const int Nk = c->micro_batch_size * c->seq_length * c->moe_router_topk;
    const int cap = (Nk + E - 1) / E; /* ceil(N·k/E · 1.0) */
    float *bias = calloc((size_t)L * E, sizeof *bias);
    for (int step = 0; step < 3; step++) {
        for (int l = 0; l < L; l++)
            bias[(size_t)l * E] = 50.0f; /* expert 0 first for every token */
        m->be->from_host(m->expert_bias, bias, sizeof(float) * (size_t)L * E);
        moe_step_stats st;
        moe_trainer_gradients(t, &st);
        int flags = -1;
        m->be->to_host(&flags, m->step_flags, sizeof flags);
        ck_assert_int_eq(flags, 0);
        ck_assert_msg(st.dropped > 0, "the hot expert dropped nothing");
        for (int l = 0; l < L; l++)
            ck_assert_int_le(m->acts[l].moe.plan.R_recv, E * cap);
        moe_trainer_update(t, &st);
    }
    ck_assert_int_eq((int)m->moe_budget_overflows, 0);
    free(bias);
    moe_trainer_free(t);
    /* a huge factor is clamped to the rows that can ever arrive, N·k on one rank */
    t = moe_test_trainer(SYNC_FREE "--moe-expert-rank-capacity-factor 1e12", NULL, 0);
    ck_assert_int_eq(t->model->moe_budget_rows, t->model->moe_budget_max);
    ck_assert_int_eq(t->model->moe_budget_max, Nk);
    moe_trainer_free(t);
}
END_TEST

/* The fused dispatcher's plan made on the device (moe_cpu_fused_plan, the twin of the
 * CUDA kernel) against the host plan's arithmetic (moe_dispatch_layout), from every rank's
 * point of view, on random counts and on every row sent to rank 0:
 *  - shift[e] takes this rank's permuted row of expert e to its row on e's rank: the
 *    receive chunk (this rank, e) there minus this rank's send chunk e;
 *  - the local offsets are the layout's expert offsets;
 *  - a budget of exactly the rows received never overflows; one row fewer clamps the
 *    offsets and raises MOE_STEP_OVERFLOW (and leaves the other bits alone). */
START_TEST(test_fused_plan_matches_layout) {
    enum { MP = 8, ME = 64 };
    const int shapes[5][2] = {{1, 4}, {2, 8}, {2, 16}, {4, 16}, {8, 64}}; /* (P, E) */
    unsigned seed = 5;
    for (int s = 0; s < 5; s++)
        for (int trial = 0; trial < 4; trial++) {
            const int P = shapes[s][0], E = shapes[s][1], EL = E / P, W = E + 1;
            int all_off[MP * (ME + 1)];
            long long all[MP * ME];
            moe_test_random_offsets(all_off, P, E, trial == 3, &seed);
            for (int p = 0; p < P; p++)
                for (int e = 0; e < E; e++)
                    all[p * E + e] = all_off[p * W + e + 1] - all_off[p * W + e];
            static size_t send_rows[MP][MP], recv_rows[MP][MP];
            static int offset[MP][ME + 1];
            static moe_comm_chunk send[MP][ME], recv[MP][ME];
            for (int r = 0; r < P; r++)
                moe_dispatch_layout(all, P, r, E, send_rows[r], recv_rows[r], offset[r],
                                    send[r], recv[r]);
            for (int r = 0; r < P; r++) {
                int shift[ME], off[ME + 1], flags = MOE_STEP_NONFINITE;
                memset(shift, 0x7f, sizeof shift);
                memset(off, 0x7f, sizeof off);
                moe_cpu_fused_plan(shift, off, &flags, all_off, P, r, E, INT_MAX);
                ck_assert_int_eq(flags, MOE_STEP_NONFINITE);
                for (int e = 0; e < E; e++) {
                    const int q = e / EL, el = e % EL;
                    ck_assert_int_eq(shift[e], (int)recv[q][r * EL + el].offset -
                                                   (int)send[r][e].offset);
                }
                for (int el = 0; el <= EL; el++)
                    ck_assert_int_eq(off[el], offset[r][el]);
                const int R = offset[r][EL]; /* the rows this rank receives */
                moe_cpu_fused_plan(shift, off, &flags, all_off, P, r, E, R);
                ck_assert_int_eq(flags, MOE_STEP_NONFINITE);
                if (R == 0)
                    continue;
                moe_cpu_fused_plan(shift, off, &flags, all_off, P, r, E, R - 1);
                ck_assert_int_eq(flags, MOE_STEP_NONFINITE | MOE_STEP_OVERFLOW);
                for (int el = 0; el <= EL; el++)
                    ck_assert_int_eq(off[el], offset[r][el] < R - 1 ? offset[r][el] : R - 1);
            }
        }
}
END_TEST

/* --moe-expert-rank-capacity-factor: positive and finite (a huge one is fine: the budget is
 * clamped to the most rows that can arrive, moe_model_create). */
START_TEST(test_budget_flag_validation) {
    const char *bad[] = {"0", "-1", "nan", "inf"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char flags[800];
        snprintf(flags, sizeof flags, SYNC_FREE "--moe-expert-rank-capacity-factor %s", bad[i]);
        moe_config c;
        moe_error err;
        moe_status s = moe_test_config(&c, flags, &err);
        if (s == MOE_OK) {
            c.vocab_size = 65; /* what the data would set */
            s = moe_config_validate(&c, &err);
        }
        ck_assert_msg(s != MOE_OK, "factor %s was accepted", bad[i]);
        ck_assert_msg(strstr(err.msg, "moe-expert-rank-capacity-factor"),
                      "factor %s: the error does not name the flag: %s", bad[i], err.msg);
    }
}
END_TEST

Suite *suite_sync_free(void) {
    Suite *s = suite_create("sync_free");
    const TTest *tests[] = {test_permute_index_budget_matches, test_permute_index_budget_overflow,
                            test_budget_overflow_one_expert,   test_budget_overflow_alternating,
                            test_capacity_never_overflows,     test_budget_flag_validation,
                            test_fused_plan_matches_layout};
    tcase_set_tags(moe_test_tcase(s, "ch06", 120, tests, 7), "ch06");
    return s;
}
