/*
 * Chapter 01, exercise: the load-balancing (aux) loss and its gradient.
 *
 * `make STUDENT=1 check-ch01` links this file in place of the library's
 * moe_cpu_aux_loss_forward / moe_cpu_aux_loss_backward (lib/cpu/aux_loss.c, the reference
 * solution) and runs the chapter's tests on it.
 *
 * Contract (lib/cpu/router.h). The N tokens form N / group_len groups of T = group_len
 * tokens (group_len = N: Megatron's aux_loss; group_len = seq_length: seq_aux_loss). For
 * one group, with logits z_t ∈ R^E:
 *   s_t     = softmax(z_t) over all E experts      (fn == MOE_SCORE_SOFTMAX)
 *           = σ(z_t) / Σ_e σ(z_t,e)                (fn == MOE_SCORE_SIGMOID)
 *   c_i     = how many of the T tokens have expert i among the k largest s_t
 *             (ties to the lower index); a count, not differentiable
 *   L_group = coeff · E / (k · T²) · Σ_i c_i · Σ_t s_t,i
 * The function returns the MEAN of L_group over the groups. At perfect balance
 * (c_i = T·k/E, Σ_t s_t,i = T/E) the loss is exactly coeff, whatever E, k and T.
 *
 * Backward: only s carries gradient (c is a constant), so with
 *   g_i = scale · coeff · E / (k · T²) · c_i / groups      (= ∂L/∂s_t,i, the same for every t)
 * ADD to dlogits[t·E + e]:
 *   softmax:  s_t,e · (g_e − Σ_i s_t,i g_i)
 *   sigmoid:  with u = σ(z), S = Σ u, s = u / S:  (g_e − Σ_i s_i g_i) / S · u_e (1 − u_e)
 * (dlogits accumulates: other losses add to the same buffer.)
 *
 * What the tests check: tests/test_router.c "ch01" (loss = coeff at balance for both
 * score functions and per sequence; coeff·E/k when every token picks the same k experts)
 * and tests/fd_ops.c "ch01" (your backward against finite differences of your forward,
 * fp64, global and per-sequence, softmax and sigmoid).
 *
 * Hint: write one helper for "scores of one token" and one for "counts of one group", and
 * use them in both functions; compute in double.
 */
#include "../../student.h"
#include "cpu/router.h"

double moe_cpu_aux_loss_forward(const moe_real *logits, int N, int group_len, int E, int k,
                                moe_score_fn fn, double coeff) {
    MOE_STUDENT_TODO(); /* delete this line when the function is written */
    /* TODO: for each group: the scores s_t of its T tokens, the counts c_i of the top-k of
     *       each s_t, the sums Σ_t s_t,i; L_group as above. Return the mean over groups. */
    return 0.0;
}

void moe_cpu_aux_loss_backward(moe_real *dlogits, const moe_real *logits, int N, int group_len,
                               int E, int k, moe_score_fn fn, double coeff, double scale) {
    MOE_STUDENT_TODO(); /* delete this line when the function is written */
    /* TODO: for each group: the counts c_i (as in the forward), then g_i, then add each
     *       token's gradient through its softmax (or normalised sigmoid) to dlogits. */
}
