/*
 * Chapter 04, exercise: the merge of the vocabulary-parallel cross-entropy (on the CPU).
 *
 * `make STUDENT=1 check-ch04` links this file in place of the library's
 * moe_cpu_cross_entropy_shard_merge (lib/cpu/cross_entropy.c: the reference solution) and
 * runs the chapter's tests on it: tests/test_vocab_merge.c (a worked example, logits far
 * too large for a naive exp, every shard count from 1 to 8 against the plain
 * cross-entropy of the whole rows), the finite-difference check of the parallel
 * cross-entropy (tests/fd_ops.c), and every TP folding on 2 and 4 MPI ranks
 * (tests/mpi_tp.c, tests/mpi_dp.c), whose losses go through this function.
 *
 * The problem. Under tensor parallelism the LM head is split by vocabulary rows: rank r
 * holds the logits z[n, v] of its V/R columns only, and nobody ever holds a whole row of
 * logits (at V = 150k and N = 16k rows that would be 10 GB). Each rank reduces its columns
 * to two numbers per row (moe_cpu_cross_entropy_shard_forward):
 *
 *   lse_r[n]    = log Σ_{v in shard r} exp(z[n, v])
 *   target_r[n] = z[n, target[n]] if the target id lies in shard r, else 0
 *
 * One all-gather gives every rank all R pairs, laid out shard-major:
 *
 *   parts[(r·N + n)·2 + 0] = lse_r[n],   parts[(r·N + n)·2 + 1] = target_r[n]
 *
 * and your merge turns them into the whole rows' numbers, on every rank:
 *
 *   lse[n]    = log Σ_r exp(lse_r[n])           (the log-sum-exp over the whole row)
 *   losses[n] = lse[n] − Σ_r target_r[n]        (exactly one shard holds the target)
 *
 * lse[n] is kept for the backward: each rank's gradient of its own columns is
 * exp(z[n, v] − lse[n]) − [v == target[n]], nothing else from the other ranks.
 *
 * The catch: lse_r can be large (logits of a few hundred are common late in training, or
 * when the LM head diverges), and exp(800) is inf in double. Shift by the largest lse_r:
 * log Σ_r exp(lse_r) = m + log Σ_r exp(lse_r − m), m = max_r lse_r; every term is then
 * ≤ 1 and one of them is exactly 1, so the sum is in [1, R] and never overflows.
 *
 * Worked example (R = 2 shards, N = 1 row): the row's logits are {1, 2 | 3, 4} (shard 0
 * holds ids 0-1, shard 1 ids 2-3), the target is id 2.
 *   shard 0: lse_0 = log(e^1 + e^2) = 2.31326169, target_0 = 0
 *   shard 1: lse_1 = log(e^3 + e^4) = 4.31326169, target_1 = 3
 *   parts = {2.31326169, 0,  4.31326169, 3}
 *   m = 4.31326169, lse = m + log(e^(2.31326169 − m) + 1) = 4.44018970
 *   losses[0] = 4.44018970 − (0 + 3) = 1.44018970 (= the plain cross-entropy of the row)
 *
 * The tests check lse and losses on every row to 1e-6 relative (fp32), that no value is
 * inf or NaN with lse_r near 1000, and that each row uses only its own R pairs.
 */
#include "../../student.h"
#include "cpu/ops.h"

void moe_cpu_cross_entropy_shard_merge(moe_real *losses, moe_real *lse, const moe_real *parts,
                                       int R, int N) {
    MOE_STUDENT_TODO(); /* delete this line when the function is written */
    for (int n = 0; n < N; n++) {
        /* TODO 1: m = the largest lse_r[n] over r = 0 .. R−1 (parts[(r·N + n)·2]).
         *         Accumulate in double: the sums below lose digits in fp32. */
        /* TODO 2: s = Σ_r exp(lse_r[n] − m) and t = Σ_r target_r[n]
         *         (parts[(r·N + n)·2 + 1]). */
        /* TODO 3: lse[n] = m + log(s); losses[n] = lse[n] − t (cast back to moe_real). */
        (void)losses, (void)lse, (void)parts, (void)R;
    }
}
