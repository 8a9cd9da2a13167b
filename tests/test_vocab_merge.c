/*
 * The merge of the vocabulary-parallel cross-entropy (chapter 04; lib/cpu/cross_entropy.c,
 * and with STUDENT=1 the student's version in chapters/04-parallel-folding/student/):
 * R shards' (log-sum-exp, target logit) pairs into each row's loss and log-sum-exp.
 * Checked against log Σ_r exp(lse_r) − Σ_r target_r computed here in double from the pairs
 * (which the test builds from whole rows, so they agree with the rows' own log-sum-exp): the
 * worked example of the stub; logits near 1000, where exp overflows without the max
 * shift; and 1 to 8 shards of random rows (uneven widths, the target in any shard).
 * Outputs are poisoned with NaN first, so a row left unwritten fails. fp32: 1e-6 relative
 * (the merge is a few double operations; the bound is the fp32 rounding of its outputs).
 */
#include <math.h>
#include <stdlib.h>

#include "cpu/ops.h"
#include "helpers.h"
#include "suites.h"

/* log Σ exp over n values, in double with the max shift: the reference. */
static double ref_lse(const double *z, int n) {
    double m = z[0], s = 0;
    for (int i = 1; i < n; i++)
        m = z[i] > m ? z[i] : m;
    for (int i = 0; i < n; i++)
        s += exp(z[i] - m);
    return m + log(s);
}

static void expect_row(double got, double want, const char *what, int n, int R) {
    ck_assert_msg(isfinite(got) && fabs(got - want) <= 1e-6 * fabs(want) + 1e-6,
                  "%s of row %d with R = %d shards: got %.9g, want %.9g%s", what, n, R, got, want,
                  isfinite(got) ? "" : " (inf or NaN: shift by the largest lse_r before exp)");
}

/* The worked example of the stub's comment: logits {1, 2 | 3, 4}, target id 2. */
START_TEST(test_merge_worked_example) {
    const moe_real parts[4] = {(moe_real)log(exp(1.0) + exp(2.0)), 0,
                               (moe_real)log(exp(3.0) + exp(4.0)), 3};
    moe_real loss = NAN, lse = NAN;
    moe_cpu_cross_entropy_shard_merge(&loss, &lse, parts, 2, 1);
    const double z[4] = {1, 2, 3, 4};
    expect_row(lse, ref_lse(z, 4), "lse", 0, 2);
    expect_row(loss, ref_lse(z, 4) - 3, "loss", 0, 2);
}
END_TEST

/* Random rows of V logits around @p centre, split into R shards of uneven widths, each
 * shard's pair computed here; the merge must give the whole row's numbers. */
static void check_shards(int R, double centre, uint64_t seed) {
    enum { N = 7, V = 29 };
    moe_real noise[N * V];
    moe_test_randn(noise, N * V, seed, 3.0);
    double z[N][V];
    int target[N], cut[9];
    for (int n = 0; n < N; n++) {
        for (int v = 0; v < V; v++)
            z[n][v] = centre + noise[n * V + v];
        target[n] = (int)((seed * 7 + (uint64_t)n * 11) % V);
    }
    cut[0] = 0; /* shard r holds ids [cut[r], cut[r+1]): uneven widths, none empty */
    for (int r = 1; r < R; r++)
        cut[r] = r * V / R + (r % 2);
    cut[R] = V;
    moe_real *parts = malloc(sizeof(moe_real) * 2 * (size_t)R * N);
    ck_assert_ptr_nonnull(parts);
    for (int r = 0; r < R; r++)
        for (int n = 0; n < N; n++) {
            moe_real *p = parts + ((size_t)r * N + n) * 2;
            p[0] = (moe_real)ref_lse(&z[n][cut[r]], cut[r + 1] - cut[r]);
            p[1] = target[n] >= cut[r] && target[n] < cut[r + 1] ? (moe_real)z[n][target[n]] : 0;
        }
    moe_real losses[N], lse[N];
    for (int n = 0; n < N; n++)
        losses[n] = lse[n] = NAN;
    moe_cpu_cross_entropy_shard_merge(losses, lse, parts, R, N);
    for (int n = 0; n < N; n++) {
        /* the whole row's lse from the pairs as given (rounded to moe_real: near 1000 an fp32
         * lse_r carries 6e-5 of rounding, which the loss, a difference of two such numbers,
         * would inherit), then checked against the row itself to the pairs' rounding */
        double l[8] = {0}, t = 0;
        for (int r = 0; r < R; r++) {
            l[r] = parts[((size_t)r * N + n) * 2];
            t += parts[((size_t)r * N + n) * 2 + 1];
        }
        const double want = ref_lse(l, R);
        ck_assert(fabs(want - ref_lse(z[n], V)) <= 1e-6 * fabs(want) + 1e-5);
        expect_row(lse[n], want, "lse", n, R);
        expect_row(losses[n], want - t, "loss", n, R);
    }
    free(parts);
}

START_TEST(test_merge_shards) {
    for (int R = 1; R <= 8; R++)
        check_shards(R, 0.0, 100 + (uint64_t)R);
}
END_TEST

/* lse_r near 1000: exp(1000) is inf in double, so only the shifted sum survives. */
START_TEST(test_merge_large_logits) {
    for (int R = 2; R <= 8; R *= 2) {
        check_shards(R, 1000.0, 200 + (uint64_t)R);
        check_shards(R, -1000.0, 300 + (uint64_t)R);
    }
}
END_TEST

Suite *suite_vocab_merge(void) {
    const TTest *const tests[] = {test_merge_worked_example, test_merge_shards,
                                  test_merge_large_logits};
    return moe_test_chapter_suite("vocab-merge", "ch04", tests, 3);
}
