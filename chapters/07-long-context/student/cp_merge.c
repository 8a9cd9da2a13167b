/*
 * Chapter 07, exercise: merge two partial attention results by their log-sum-exp (on the
 * CPU).
 *
 * `make STUDENT=1 check-ch07` links this file in place of the library's moe_cp_merge
 * (lib/cp_layout.c: the reference solution) and runs the chapter's tests on it:
 * tests/test_cp_layout.c (one row merged from up to four ragged parts, one of them
 * possibly empty, scores large enough that an unshifted exp overflows, against one softmax
 * over all the keys) and the context-parallel attention on 2, 3 and 4 MPI ranks
 * (tests/mpi_cp.c: ring and all-gather merge every rank's partial results through this
 * function, and must equal one process's attention, forward and backward).
 *
 * The problem. Context parallelism splits the keys of a query row over ranks (and over
 * the steps of the ring). Each block of keys gives a partial result that is already
 * softmax-normalised over its own keys:
 *
 *   lse_a = log Σ_{j in a} exp(s_j),   y_a = Σ_{j in a} exp(s_j − lse_a) · v_j
 *
 * and likewise (y_b, lse_b) for a disjoint block b. Over the union of the two blocks:
 *
 *   lse = log(exp(lse_a) + exp(lse_b))
 *   y   = exp(lse_a − lse) · y_a + exp(lse_b − lse) · y_b
 *
 * each part reweighted by its share of the total softmax mass (the two weights sum to 1).
 * Your function does this in place: (y, lse) is the accumulator, (y_b, lse_b) the part.
 *
 * Layouts (the attention op's): y and y_b are [B, T, H, D] (row (b, t, h) starts at
 * ((b·T + t)·H + h)·D), lse and lse_b are [B, H, T] (row (b, t, h) at (b·H + h)·T + t).
 * Note the two different orders: a merge that walks both with one index is wrong, and the
 * MPI tests (B, H > 1) will say so even where the one-row unit test passes.
 *
 * The catches:
 *  - exp(lse) overflows for large scores (lse = 800 is possible): compute
 *    lse = hi + log1p(exp(lo − hi)) with hi the larger and lo the smaller of the two, so
 *    every exponent is ≤ 0. Accumulate in double.
 *  - A block can hold no visible key (causal masking): its lse is −∞ and its y is 0. If
 *    lse_b = −∞ leave the row as it is; if the accumulator's lse = −∞ (nothing merged yet)
 *    copy the part (y = y_b, lse = lse_b) — the accumulator's y may hold anything then,
 *    even NaN (the test poisons it), so it must not be multiplied by its weight 0.
 *
 * Worked example (D = 1): part a saw scores {0, 1} with values {1, 3}; part b saw score
 * {2} with value {5}.
 *   lse_a = log(e^0 + e^1) = 1.31326169, y_a = (1·1 + 3·e)/(1 + e) = 2.46211716
 *   lse_b = 2,                          y_b = 5
 *   lse   = 2 + log1p(exp(1.31326169 − 2)) = 2.40760596
 *   y     = exp(1.31326169 − 2.40760596)·2.46211716 + exp(2 − 2.40760596)·5 = 4.15042077
 *         (= (1 + 3e + 5e²)/(1 + e + e²): one softmax over the three keys)
 */
#include <math.h>

#include "../../student.h"
#include "cp_layout.h"

void moe_cp_merge(moe_real *y, moe_real *lse, const moe_real *y_b, const moe_real *lse_b, int B,
                  int T, int H, int D) {
    MOE_STUDENT_TODO(); /* delete this line when the function is written */
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++) {
                /* TODO 1: the row's offsets: yo into y and y_b ([B, T, H, D]), lo into lse
                 *         and lse_b ([B, H, T]) */
                /* TODO 2: la = lse[lo], lb = lse_b[lo] (as double); the two −∞ cases */
                /* TODO 3: m = hi + log1p(exp(lo − hi)); wa = exp(la − m), wb = exp(lb − m);
                 *         y[yo + d] = wa·y[yo + d] + wb·y_b[yo + d] for d < D; lse[lo] = m */
                (void)y, (void)lse, (void)y_b, (void)lse_b, (void)D;
            }
}
