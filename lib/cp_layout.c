/* Context parallelism's bookkeeping (chapter 07): see cp_layout.h for the layout, the ring
 * and the merge. */
#include "cp_layout.h"

#include <math.h>

moe_status moe_cp_check(int T, int cp, moe_error *err) {
    if (cp < 1)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "--context-parallel-size %d: it must be at least 1", cp);
    if (T < 1 || T % (2 * cp) != 0) {
        const int lo = T / (2 * cp) * (2 * cp), hi = lo + 2 * cp;
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "--seq-length %d is not a multiple of 2 x --context-parallel-size "
                             "(%d): context parallelism cuts every sequence into 2·cp equal "
                             "chunks (rank r holds chunks r and 2cp-1-r, so that causal "
                             "attention costs every rank the same). Use --seq-length %d or %d, "
                             "or another --context-parallel-size",
                             T, 2 * cp, lo > 0 ? lo : hi, hi);
    }
    return MOE_OK;
}

int moe_cp_ring_pairs(int cp, int rank, int i, moe_cp_pair out[4]) {
    const int s = moe_cp_ring_source(cp, rank, i);
    int n = 0;
    if (s == rank) { /* its own chunks: the two diagonal blocks, and late queries on early keys */
        out[n++] = (moe_cp_pair){0, 0, 1};
        out[n++] = (moe_cp_pair){1, 0, 0};
        out[n++] = (moe_cp_pair){1, 1, 1};
    } else if (s < rank) { /* s's early chunk precedes both of ours; its late one follows both */
        out[n++] = (moe_cp_pair){0, 0, 0};
        out[n++] = (moe_cp_pair){1, 0, 0};
    } else { /* both of s's chunks follow our early chunk and precede our late one */
        out[n++] = (moe_cp_pair){1, 0, 0};
        out[n++] = (moe_cp_pair){1, 1, 0};
    }
    return n;
}

void moe_cp_merge(moe_real *y, moe_real *lse, const moe_real *y_b, const moe_real *lse_b,
                  size_t rows, int D) {
    for (size_t r = 0; r < rows; r++) {
        const double a = lse[r], b = lse_b[r];
        if (isinf(b) && b < 0) /* the part saw no key: nothing to add */
            continue;
        moe_real *yr = y + r * (size_t)D;
        const moe_real *yb = y_b + r * (size_t)D;
        if (isinf(a) && a < 0) { /* nothing accumulated yet: take the part */
            for (int d = 0; d < D; d++)
                yr[d] = yb[d];
            lse[r] = lse_b[r];
            continue;
        }
        const double hi = a > b ? a : b, lo = a > b ? b : a;
        const double l = hi + log1p(exp(lo - hi));
        const double wa = exp(a - l), wb = exp(b - l);
        for (int d = 0; d < D; d++)
            yr[d] = (moe_real)(wa * yr[d] + wb * yb[d]);
        lse[r] = (moe_real)l;
    }
}
