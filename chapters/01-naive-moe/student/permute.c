/*
 * Chapter 01, exercise: the permutation — sort the N·k routing assignments by expert.
 *
 * `make STUDENT=1 check-ch01` links this file in place of the library's
 * moe_cpu_permute_index (lib/cpu/permute.c, the reference solution) and runs the
 * chapter's tests on it.
 *
 * Contract (lib/cpu/moe_ops.h). Token n's j-th choice is assignment a = n·k + j, going to
 * expert topk_idx[a] ∈ [0, E). Sort the assignments by expert, STABLY (inside one expert,
 * assignments keep increasing a), and fill:
 *   expert_offset[E+1]  expert e owns permuted rows [expert_offset[e], expert_offset[e+1]);
 *                       expert_offset[0] = 0, expert_offset[E] = N·k
 *   perm_src[N·k]       perm_src[r] = the assignment a at permuted row r
 *   row_of[N·k]         row_of[a]   = the permuted row of assignment a (the inverse map)
 *   counts[E]           if counts != NULL, counts[e] += tokens expert e got (ADD, do not
 *                       overwrite: the trainer sums counts over micro-batches)
 * The layer then copies token perm_src[r] / k into row r (permute) and sums rows
 * row_of[n·k + j] back into token n (unpermute).
 *
 * Example (tests/test_router.c, test_permutation): N = 3, k = 2, E = 3,
 *   topk_idx = {2,0 | 0,1 | 1,2} → expert_offset = {0,2,4,6},
 *   perm_src = {1,2,3,4,0,5}, row_of = {4,0,1,2,3,5}.
 *
 * Hint: a counting sort. One pass counts each expert's assignments, a prefix sum turns
 * the counts into offsets, a second pass in order of a drops each assignment into its
 * expert's next free row (that pass is what makes the sort stable). O(N·k + E).
 * The dispatcher also calls this with E + 1 buckets (the last one holds dropped tokens),
 * so do not assume E ≤ MOE_MAX_EXPERTS for a scratch array: allocate it.
 */
#include "../../student.h"
#include "cpu/moe_ops.h"

void moe_cpu_permute_index(int *perm_src, int *row_of, int *expert_offset, long long *counts,
                           const int *topk_idx, int N, int k, int E) {
    MOE_STUDENT_TODO(); /* delete this line when the function is written */
    /* TODO 1: expert_offset[e + 1] = assignments to expert e; then the prefix sum. */
    /* TODO 2: counts[e] += assignments to expert e (when counts is not NULL). */
    /* TODO 3: walk a = 0 .. N·k−1 and place each assignment at its expert's next row,
     *         filling perm_src and row_of. */
}
