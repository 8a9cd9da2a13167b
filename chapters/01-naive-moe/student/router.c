/*
 * Chapter 01, exercise: the router's default path — top-k routing with softmax.
 *
 * `make STUDENT=1 check-ch01` links this file in place of the library's
 * moe_cpu_router_forward (lib/cpu/router.c, the reference solution: read it only after
 * you have tried) and runs the chapter's tests on it.
 *
 * Contract (lib/cpu/router.h). For each of the N tokens n:
 *   z      = logits[n·E .. n·E + E)            the token's E router logits
 *   idx    = the k experts with the largest z, best first; equal logits go to the LOWER
 *            expert index (so routing is deterministic)
 *   w_j    = softmax over the k SELECTED logits only: exp(z[idx_j]) / Σ_m exp(z[idx_m]),
 *            so the k weights sum to 1 (top-1: the weight is exactly 1)
 *   w_j   *= p->scaling_factor when it is > 0 (Megatron's --moe-router-topk-scaling-factor)
 * and write topk_idx[n·k + j] = idx_j, topk_w[n·k + j] = w_j for j = 0..k−1.
 * E = p->num_experts, k = p->topk (k ≤ E, k ≤ MOE_MAX_TOPK).
 *
 * What the tests check (tests/test_router.c, case "ch01"; the MoE layer and the whole
 * model's gradients use your router too):
 *   - logits {1, 3, 2, 0}, k = 2 → experts {1, 2}, weights e³/(e³+e²), e²/(e³+e²);
 *   - ties: {2, 2, 1, 2}, k = 2 → experts {0, 1}, weights ½ and ½;
 *   - several tokens in one call, each on its own row; scaling factor 2.5.
 *
 * Hints:
 *   - compute in double and convert at the end: the tests compare to 1e-6;
 *   - subtract the largest selected logit before exp() (softmax is shift-invariant, and
 *     exp(1000) overflows);
 *   - a strict `>` when scanning for the maximum keeps the lower index on ties;
 *   - this exercise grades the default path only. The other variants (pre-softmax,
 *     sigmoid, expert bias, group-limited) are in the library; here, stop with a message
 *     if p asks for one (the check below), since nothing in check-ch01 does.
 */
#include <math.h>

#include "../../student.h"
#include "cpu/router.h"

void moe_cpu_router_forward(int *topk_idx, moe_real *topk_w, const moe_real *logits,
                            const float *bias, const moe_router_params *p, int N) {
    MOE_STUDENT_TODO(); /* delete this line when the function is written */
    if (p->score_fn != MOE_SCORE_SOFTMAX || p->pre_softmax || p->num_groups > 0 || bias) {
        fprintf(stderr, "chapters/01-naive-moe/student/router.c: only the default router "
                        "(softmax, top-k, no groups, no bias) is part of this exercise\n");
        exit(MOE_STUDENT_TODO_STATUS);
    }
    const int E = p->num_experts, k = p->topk;
    const double scale = p->scaling_factor > 0 ? p->scaling_factor : 1.0;
    for (int n = 0; n < N; n++) {
        const moe_real *z = logits + (size_t)n * E;
        int *idx = topk_idx + (size_t)n * k;
        moe_real *w = topk_w + (size_t)n * k;
        /* TODO 1: pick the k largest z, best first, ties to the lower index, into idx[0..k).
         *         (k is small: k passes over E, skipping experts already picked, is fine.) */
        /* TODO 2: w[j] = softmax over z[idx[0..k)] (in double, max subtracted), times scale. */
        (void)z; (void)idx; (void)w; (void)scale;
    }
}
