/*
 * Chapter 06, exercise: the sync-free permutation index — sort the N·k routing assignments
 * by expert into a STATIC number of rows, the budget, without asking the host anything.
 *
 * `make STUDENT=1 check-ch06` links this file in place of the library's
 * moe_cpu_permute_index_budget (lib/cpu/permute.c: the reference solution) and runs the
 * chapter's tests on it (tests/test_sync_free.c): against the plain index
 * (moe_cpu_permute_index) with an ample budget, on random routing, every token on one
 * expert, and alternating hot experts; a budget of half the rows (what may be written, the
 * clamped offsets, the flag, and the combine that must skip what has no row); and the whole
 * overflow protocol on a small model — the CPU backend's op table holds your function, so
 * the sync-free MoE layer routes every step through it: the step whose routing needs more
 * rows than the budget must raise the flag, the trainer grows the budget and re-runs the
 * step, and the loss and every gradient must then equal, bit for bit, those of a run whose
 * budget was ample from the start.
 *
 * The problem. A CUDA graph freezes the sizes of the kernels it recorded, and the host must
 * not read the device in the middle of a step (README, "the idea"). Chapter 01's index
 * (moe_cpu_permute_index, written in chapter 01's student/permute.c) sizes the permuted
 * buffers from the expert counts, which the CUDA backend copies to the host: a wait. The
 * sync-free layer instead allocates its permuted buffers once with a fixed number of rows,
 * the budget (--moe-expert-rank-capacity-factor · N·k, moe_model_create), and the index must
 * live with it:
 *   - the same stable counting sort as chapter 01: assignment a = n·k + j goes to expert
 *     topk_idx[a]; inside an expert the assignments keep increasing a;
 *   - the row r an assignment gets is the row the plain index would give it. If r < budget:
 *     perm_src[r] = a, row_of[a] = r. If r ≥ budget: no row — row_of[a] = -1 and nothing is
 *     written (perm_src holds only budget entries);
 *   - expert_offset[e] = min(plain offset[e], budget) for e = 0..E (the experts' GEMMs size
 *     their work from the offsets, so none may point past the buffers);
 *   - when the assignments need more rows than the budget (N·k > budget), OR
 *     MOE_STEP_OVERFLOW (lib/step_flags.h) into *flags. The host reads the flags word once,
 *     at the end of the step; then it doubles the budget (moe_model_grow_moe_budget) and
 *     re-runs the step. Nobody looks at the incomplete results of the overflowed step.
 * On the GPU the same function is a histogram, a one-block scan that clamps and raises the
 * flag, and a stable scatter (kernels/permute.cu, moe_cuda_permute_index_budget): the CPU
 * version here is the reference it is compared with (tests/gpu_sync_free.c).
 *
 * The catches:
 *  - OR the flag (*flags |= MOE_STEP_OVERFLOW), never assign it: the word holds the other
 *    events of the step (MOE_STEP_NONFINITE), and the test checks they survive. Raise it
 *    only when the total is ABOVE the budget: exactly N·k rows fit in a budget of N·k.
 *  - Clamp every offset, expert_offset[E] included: after an overflow expert_offset[E] =
 *    budget, and the experts own exactly the rows that exist.
 *  - Never write perm_src[r] for r ≥ budget: that memory is not yours (the test puts a
 *    guard there).
 *  - Which assignments lose their row is the plain sort's tail (the experts with the
 *    largest ids first), not a per-expert capacity: it does not matter which, because the
 *    step is re-run, but it must be what the plain index gives below the budget, since the
 *    tests compare row for row.
 *  - With an ample budget (≥ N·k) the outputs must equal moe_cpu_permute_index()'s exactly,
 *    and *flags must be left as it was.
 *  - budget ≥ 0 and E ≤ MOE_MAX_EXPERTS (config.h) are the caller's promises: a scratch
 *    array of MOE_MAX_EXPERTS + 1 ints on the stack is enough here.
 *
 * Worked example: N = 3 tokens, k = 2, E = 3, topk_idx = {2,0 | 2,1 | 2,0}, so the
 * assignments a = 0..5 go to experts 2,0,2,1,2,0.
 *   counts {2, 1, 3}; plain offsets {0, 2, 3, 6}; plain rows of a = 0..5: {3, 0, 4, 2, 5, 1}.
 *   budget 4 (< 6: overflow), *flags = MOE_STEP_NONFINITE (2) on entry:
 *     expert_offset = {0, 2, 3, 4}, *flags = 3 (2 | MOE_STEP_OVERFLOW),
 *     row_of = {3, 0, -1, 2, -1, 1}, perm_src[0..3] = {1, 5, 3, 0} (perm_src[4..5] untouched);
 *   budget 6: expert_offset = {0, 2, 3, 6}, *flags stays 2, row_of = {3, 0, 4, 2, 5, 1},
 *     perm_src = {1, 5, 3, 0, 2, 4} — chapter 01's index.
 */
#include "../../student.h"
#include "config.h"
#include "cpu/moe_ops.h"
#include "step_flags.h"

void moe_cpu_permute_index_budget(int *perm_src, int *row_of, int *expert_offset, int *flags,
                                  const int *topk_idx, int N, int k, int E, int budget) {
    MOE_STUDENT_TODO(); /* delete this line when the function is written */
    int cur[MOE_MAX_EXPERTS + 1] = {0};
    /* TODO 1: count: cur[e + 1] = the assignments to expert e; then the prefix sum, so that
     *         cur[e] is the plain offset of expert e and cur[E] = N·k */
    /* TODO 2: the flag: if the rows needed (cur[E]) exceed the budget, OR MOE_STEP_OVERFLOW
     *         into *flags */
    /* TODO 3: expert_offset[e] = min(cur[e], budget) for e = 0..E */
    /* TODO 4: the stable scatter: for a = 0 .. N·k − 1, r = cur[topk_idx[a]]++ (the plain
     *         row); below the budget perm_src[r] = a and row_of[a] = r, else row_of[a] = -1 */
    (void)perm_src, (void)row_of, (void)expert_offset, (void)flags, (void)topk_idx, (void)N,
        (void)k, (void)E, (void)budget, (void)cur;
}
