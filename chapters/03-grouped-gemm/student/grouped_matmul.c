/*
 * Chapter 03, exercise: a simple grouped GEMM that reads the group offsets from memory.
 *
 * `make STUDENT=1 check-ch03` links this file in place of the library's
 * moe_cpu_grouped_matmul_forward (lib/cpu/grouped_matmul.c, the reference solution) and
 * runs the chapter's CPU tests on it: tests/test_grouped.c (against a triple loop, ragged
 * and empty groups, output poisoned with NaN) and tests/fd_model.c "ch03" (the model with
 * --moe-grouped-gemm and --moe-expert-backend grouped: its gradients by finite
 * differences, and the same loss and gradients as chapter 01's loop to 1e-12 in fp64).
 *
 * Contract (lib/cpu/ops.h). G groups (experts) of the same Linear shape, weights
 * w [G, O, I] (group g's matrix is w + g·O·I, row-major [O, I]); the rows of in [off[G], I]
 * are grouped: group g owns rows [off[g], off[g+1]) (off is non-decreasing, off[0] = 0, a
 * group may be empty). Compute, for every group g and every row r of g:
 *     out[r, o] = Σ_i in[r, i] · w[g, o, i]          (out = in · w[g]ᵀ, out [off[G], O])
 * Every row of out is written (the tests fill it with NaN first).
 *
 * Why "reads the offsets from memory": on the GPU, our grouped kernel gets off[] as a
 * device pointer and each thread block works out which group its tile belongs to, so the
 * host never waits for the counts. Write this one the same way — one flat loop over the
 * OUTPUT ROWS r = 0 .. off[G]−1 that finds each row's group from off[] (a binary search,
 * or a pointer that advances), rather than a loop over groups that calls a dense GEMM:
 * that is the shape of chapter 03's SIMT kernel (v1), one output element per thread.
 *
 * Hint: accumulate in double (or at least keep the i-loop innermost and contiguous) —
 * the comparison is to 1e-4 relative.
 */
#include "../../student.h"
#include "cpu/ops.h"

void moe_cpu_grouped_matmul_forward(moe_real *out, const moe_real *in, const moe_real *w,
                                    const int *off, int G, int I, int O) {
    MOE_STUDENT_TODO(); /* delete this line when the function is written */
    /* TODO 1: for each output row r in [0, off[G]): its group g, off[g] <= r < off[g+1]
     *         (skip empty groups: several off[] entries can be equal). */
    /* TODO 2: out[r·O + o] = Σ_i in[r·I + i] · w[(g·O + o)·I + i] for o in [0, O). */
}
