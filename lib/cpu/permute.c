/*
 * Token permutation for the MoE layer (CPU reference).
 *
 * Each of the N tokens picks k experts, giving N·k assignments a = n·k + j.
 * The experts want their tokens contiguous, so we sort the assignments by
 * expert with a counting sort that is stable (inside an expert, assignments
 * keep the order n·k + j), and remember both directions of the map:
 *   perm_src[r] = the assignment at permuted row r
 *   row_of[a]   = the permuted row of assignment a
 * Then:
 *   permute:    xp[r]   = x[perm_src[r] / k]         (a token appears k times)
 *   unpermute:  out[n] += Σ_j yp[row_of[n·k + j]]    (a plain sum, in j order)
 * The sum over j is done per token by one thread in a fixed order, so the
 * combine is deterministic without atomics.
 *
 * The sync-free index (chapter 06) is the same sort with a static number of permuted rows,
 * the budget: its offsets stay in backend memory, clamped to the budget; an assignment whose
 * row would fall at or past the budget gets row_of = -1 and no row (the combine skips it),
 * and the step-flags word gets MOE_STEP_OVERFLOW so that the step is re-run with grown
 * buffers. Nothing is written past the budget.
 */
#include <string.h>

#include "config.h"
#include "moe_ops.h"
#include "step_flags.h"

void moe_cpu_permute_index(int *perm_src, int *row_of, int *expert_offset, long long *counts,
                           const int *topk_idx, int N, int k, int E) {
    for (int e = 0; e <= E; e++)
        expert_offset[e] = 0;
    for (int a = 0; a < N * k; a++)
        expert_offset[topk_idx[a] + 1]++;
    for (int e = 0; e < E; e++) {
        if (counts)
            counts[e] += expert_offset[e + 1];
        expert_offset[e + 1] += expert_offset[e];
    }
    /* stable scatter: walk assignments in order, fill each expert's next slot */
    int cur[MOE_MAX_EXPERTS + 1];
    MOE_ASSERT(E <= MOE_MAX_EXPERTS + 1); /* + the dispatcher's bucket of dropped tokens */
    for (int e = 0; e < E; e++)
        cur[e] = expert_offset[e];
    for (int a = 0; a < N * k; a++) {
        int r = cur[topk_idx[a]]++;
        perm_src[r] = a;
        row_of[a] = r;
    }
}

void moe_cpu_permute_index_budget(int *perm_src, int *row_of, int *expert_offset, int *flags,
                                  const int *topk_idx, int N, int k, int E, int budget) {
    MOE_ASSERT(budget >= 0 && E <= MOE_MAX_EXPERTS);
    int cur[MOE_MAX_EXPERTS + 1] = {0};
    for (int a = 0; a < N * k; a++)
        cur[topk_idx[a] + 1]++;
    for (int e = 0; e < E; e++)
        cur[e + 1] += cur[e];
    if (cur[E] > budget)
        *flags |= MOE_STEP_OVERFLOW;
    for (int e = 0; e <= E; e++)
        expert_offset[e] = cur[e] < budget ? cur[e] : budget;
    for (int a = 0; a < N * k; a++) {
        const int r = cur[topk_idx[a]]++;
        row_of[a] = r < budget ? r : -1;
        if (r < budget)
            perm_src[r] = a;
    }
}

void moe_cpu_fused_plan(int *shift, int *expert_offset, int *flags, const int *all_off, int P,
                        int rank, int E, int budget) {
    MOE_ASSERT(P > 0 && E % P == 0 && E <= MOE_MAX_EXPERTS);
    const int EL = E / P, W = E + 1; /* W: one rank's row of all_off */
    long long tot[MOE_MAX_EXPERTS]; /* Σ_p c[p][e]: every rank's rows for expert e */
    for (int e = 0; e < E; e++) {
        tot[e] = 0;
        for (int p = 0; p < P; p++)
            tot[e] += all_off[p * W + e + 1] - all_off[p * W + e];
    }
    for (int e = 0; e < E; e++) {
        const int q = e / EL;
        long long base = 0; /* q's earlier local experts, then the earlier ranks' rows for e */
        for (int l = q * EL; l < e; l++)
            base += tot[l];
        for (int p = 0; p < rank; p++)
            base += all_off[p * W + e + 1] - all_off[p * W + e];
        shift[e] = (int)(base - all_off[rank * W + e]);
    }
    long long off = 0;
    for (int el = 0; el <= EL; el++) {
        expert_offset[el] = off < budget ? (int)off : budget;
        if (el < EL)
            off += tot[rank * EL + el];
    }
    if (off > budget && flags)
        *flags |= MOE_STEP_OVERFLOW;
}

void moe_cpu_permute_tokens(moe_real *xp, const moe_real *x, const int *perm_src, int rows, int k,
                            int C) {
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++)
        memcpy(xp + (size_t)r * C, x + (size_t)(perm_src[r] / k) * C, sizeof(moe_real) * C);
}

void moe_cpu_permute_weights(moe_real *wp, const moe_real *topk_w, const int *perm_src, int rows) {
    for (int r = 0; r < rows; r++)
        wp[r] = topk_w[perm_src[r]];
}

void moe_cpu_unpermute_sum(moe_real *out, const moe_real *yp, const int *row_of, int N, int k,
                           int C) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        moe_real *o = out + (size_t)n * C;
        for (int j = 0; j < k; j++) {
            if (row_of[n * k + j] < 0) /* over the budget: no row (the step is re-run) */
                continue;
            const moe_real *y = yp + (size_t)row_of[n * k + j] * C;
            for (int c = 0; c < C; c++)
                o[c] += y[c];
        }
    }
}

void moe_cpu_unpermute_sum_slots(moe_real *out, const moe_real *ys, const int *row_of, int N,
                                 int k, int C) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        moe_real *o = out + (size_t)n * C;
        for (int j = 0; j < k; j++) {
            if (row_of[n * k + j] < 0)
                continue;
            const moe_real *y = ys + ((size_t)n * k + j) * C;
            for (int c = 0; c < C; c++)
                o[c] += y[c];
        }
    }
}

void moe_cpu_unpermute_weights(moe_real *dtopk_w, const moe_real *dwp, const int *row_of, int N,
                               int k) {
    for (int a = 0; a < N * k; a++)
        if (row_of[a] >= 0)
            dtopk_w[a] += dwp[row_of[a]];
}
