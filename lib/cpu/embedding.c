/* Token embedding lookup and its gradient (CPU). See ops.h. */
#include <string.h>

#include "ops.h"

void moe_cpu_embedding_forward(moe_real *out, const int *tokens, const moe_real *table, int N,
                               int C) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        memcpy(out + (size_t)n * C, table + (size_t)tokens[n] * C, (size_t)C * sizeof(moe_real));
}

/* Several rows may share a token, so a naive parallel loop over rows would race.
 * Instead each thread owns a slice of the columns and walks all rows in order:
 * no atomics, and the same summation order for any thread count. */
void moe_cpu_embedding_backward(moe_real *dtable, const moe_real *dout, const int *tokens, int N,
                                int V, int C) {
    (void)V;
#pragma omp parallel for schedule(static)
    for (int c0 = 0; c0 < C; c0 += 16) {
        int c1 = c0 + 16 < C ? c0 + 16 : C;
        for (int n = 0; n < N; n++) {
            moe_real *d = dtable + (size_t)tokens[n] * C;
            const moe_real *g = dout + (size_t)n * C;
            for (int c = c0; c < c1; c++)
                d[c] += g[c];
        }
    }
}
