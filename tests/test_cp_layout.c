/*
 * Context parallelism's bookkeeping (chapter 07, lib/cp_layout.h): the load-balanced chunk
 * layout covers every position of a sequence exactly once; over the cp steps of the ring a
 * rank computes every causally visible block of chunks exactly once (masked exactly on the
 * diagonal), and every rank does the same amount of work; the log-sum-exp merge of partial
 * attention results equals one softmax over all the keys; the length check names its flags.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cp_layout.h"
#include "helpers.h"
#include "suites.h"

START_TEST(test_cp_positions_cover_the_sequence) {
    for (int cp = 1; cp <= 8; cp++) {
        const int C = 3, T = 2 * cp * C, local = T / cp;
        int *seen = calloc((size_t)T, sizeof *seen);
        for (int r = 0; r < cp; r++)
            for (int t = 0; t < local; t++) {
                const int p = moe_cp_position(T, cp, r, t);
                ck_assert_int_ge(p, 0);
                ck_assert_int_lt(p, T);
                seen[p]++;
                if (t % C) /* consecutive inside a chunk */
                    ck_assert_int_eq(p, moe_cp_position(T, cp, r, t - 1) + 1);
            }
        for (int p = 0; p < T; p++) {
            ck_assert_msg(seen[p] == 1, "cp %d: position %d held %d times", cp, p, seen[p]);
            /* moe_cp_local_index is the inverse: exactly one rank finds p, at its index */
            int holders = 0;
            for (int r = 0; r < cp; r++) {
                const int t = moe_cp_local_index(T, cp, r, p);
                if (t < 0)
                    continue;
                holders++;
                ck_assert_int_lt(t, local);
                ck_assert_int_eq(moe_cp_position(T, cp, r, t), p);
            }
            ck_assert_int_eq(holders, 1);
        }
        /* rank 0 holds the first and the last chunk */
        ck_assert_int_eq(moe_cp_position(T, cp, 0, 0), 0);
        ck_assert_int_eq(moe_cp_position(T, cp, 0, local - 1), T - 1);
        free(seen);
    }
}
END_TEST

START_TEST(test_cp_ring_covers_the_causal_blocks_once) {
    for (int cp = 1; cp <= 8; cp++) {
        const int n = 2 * cp;
        int work0 = -1;
        for (int r = 0; r < cp; r++) {
            int *count = calloc((size_t)n * n, sizeof *count);
            int work = 0; /* unmasked blocks count 2, masked (half the scores) 1 */
            int sources = 0;
            for (int i = 0; i < cp; i++) {
                const int s = moe_cp_ring_source(cp, r, i);
                sources |= 1 << s;
                moe_cp_pair p[4];
                const int np = moe_cp_ring_pairs(cp, r, i, p);
                ck_assert_int_eq(np, i == 0 ? 3 : 2);
                for (int j = 0; j < np; j++) {
                    const int qc = moe_cp_chunk(cp, r, p[j].q), kc = moe_cp_chunk(cp, s, p[j].k);
                    ck_assert_msg(kc <= qc, "cp %d rank %d step %d: query chunk %d reads the "
                                  "later key chunk %d", cp, r, i, qc, kc);
                    ck_assert_msg(p[j].masked == (qc == kc), "cp %d rank %d step %d: block "
                                  "(%d,%d) masked %d", cp, r, i, qc, kc, p[j].masked);
                    count[qc * n + kc]++;
                    work += p[j].masked ? 1 : 2;
                }
            }
            ck_assert_int_eq(sources, (1 << cp) - 1); /* every rank's keys visit once */
            for (int w = 0; w < 2; w++) {
                const int qc = moe_cp_chunk(cp, r, w);
                for (int kc = 0; kc < n; kc++)
                    ck_assert_msg(count[qc * n + kc] == (kc <= qc),
                                  "cp %d rank %d: block (%d,%d) computed %d times", cp, r, qc,
                                  kc, count[qc * n + kc]);
            }
            if (work0 < 0)
                work0 = work;
            ck_assert_msg(work == work0, "cp %d: rank %d does %d units of work, rank 0 %d", cp,
                          r, work, work0);
            free(count);
        }
    }
}
END_TEST

/* softmax over keys [a, b) of one row of scores: y = Σ p_j v_j, lse = log Σ exp(s_j);
 * an empty range gives lse = -inf and y = 0 */
static void part(const double *s, const double *v, int a, int b, int D, moe_real *y,
                 moe_real *lse) {
    double m = -INFINITY;
    for (int j = a; j < b; j++)
        m = s[j] > m ? s[j] : m;
    double l = 0, acc[16] = {0};
    for (int j = a; j < b; j++) {
        const double e = exp(s[j] - m);
        l += e;
        for (int d = 0; d < D; d++)
            acc[d] += e * v[j * D + d];
    }
    for (int d = 0; d < D; d++)
        y[d] = (moe_real)(b > a ? acc[d] / l : 0.0);
    *lse = (moe_real)(b > a ? m + log(l) : -INFINITY);
}

START_TEST(test_cp_merge_equals_one_softmax) {
    enum { K = 40, D = 8 };
    srand(7);
    for (int trial = 0; trial < 50; trial++) {
        double s[K], v[K * D];
        const double scale = trial % 5 == 0 ? 300.0 : 3.0; /* large scores: exp overflows unshifted */
        for (int j = 0; j < K; j++)
            s[j] = scale * ((double)rand() / RAND_MAX - 0.5);
        for (int j = 0; j < K * D; j++)
            v[j] = (double)rand() / RAND_MAX - 0.5;
        moe_real want[D], want_lse;
        part(s, v, 0, K, D, want, &want_lse);
        /* the keys in up to 4 ragged parts, one of them possibly empty */
        const int cut1 = rand() % K, cut2 = cut1 + rand() % (K - cut1 + 1);
        const int bounds[] = {0, cut1, cut1, cut2, K};
        moe_real y[D], lse = -INFINITY;
        for (int d = 0; d < D; d++) /* poison: an accumulator at -inf must be overwritten */
            y[d] = NAN;
        for (int q = 0; q < 4; q++) {
            moe_real yb[D], lb;
            part(s, v, bounds[q], bounds[q + 1], D, yb, &lb);
            moe_cp_merge(y, &lse, yb, &lb, 1, 1, 1, D);
        }
        ck_assert_msg(fabs(lse - want_lse) <= 1e-5 * fmax(1.0, fabs(want_lse)),
                      "trial %d: lse %.9g, one softmax %.9g", trial, lse, want_lse);
        for (int d = 0; d < D; d++)
            ck_assert_msg(fabs(y[d] - want[d]) <= 1e-5, "trial %d: y[%d] %.9g, want %.9g",
                          trial, d, y[d], want[d]);
    }
}
END_TEST

START_TEST(test_cp_check_names_the_flags) {
    moe_error err;
    ck_assert_int_eq(moe_cp_check(256, 4, &err), MOE_OK);
    ck_assert_int_eq(moe_cp_check(256, 1, &err), MOE_OK);
    ck_assert_int_eq(moe_cp_check(100, 4, &err), MOE_ERR_CONFIG); /* 100 % 8 != 0 */
    ck_assert_msg(strstr(err.msg, "--seq-length") && strstr(err.msg, "--context-parallel-size") &&
                      strstr(err.msg, "96") && strstr(err.msg, "104"),
                  "%s", err.msg);
    ck_assert_int_eq(moe_cp_check(6, 4, &err), MOE_ERR_CONFIG);
    ck_assert_msg(strstr(err.msg, "--seq-length 8"), "%s", err.msg);
    ck_assert_int_eq(moe_cp_check(64, 0, &err), MOE_ERR_CONFIG);
}
END_TEST

Suite *suite_cp_layout(void) {
    Suite *s = suite_create("cp_layout");
    const TTest *tests[] = {test_cp_positions_cover_the_sequence,
                            test_cp_ring_covers_the_causal_blocks_once,
                            test_cp_merge_equals_one_softmax, test_cp_check_names_the_flags};
    tcase_set_tags(moe_test_tcase(s, "ch07", 60, tests, 4), "ch07");
    return s;
}
