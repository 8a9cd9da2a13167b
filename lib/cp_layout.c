/* Context parallelism's bookkeeping (chapter 07): see cp_layout.h for the layout, the ring
 * and the merge. */
#include "cp_layout.h"

#include <math.h>
#include <string.h>

moe_status moe_cp_check(int T, int cp, moe_error *err) {
    if (cp < 1)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "--context-parallel-size %d: it must be at least 1", cp);
    /* in long long: 2·cp (and the suggestions) of a fuzzed cp near INT_MAX overflow int */
    const long long chunks = 2LL * cp;
    if (T < 1 || T % chunks != 0) {
        const long long lo = T / chunks * chunks, hi = lo + chunks;
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "--seq-length %d is not a multiple of 2 x --context-parallel-size "
                             "(%lld): context parallelism cuts every sequence into 2·cp equal "
                             "chunks (rank r holds chunks r and 2cp-1-r, so that causal "
                             "attention costs every rank the same). Use --seq-length %lld or "
                             "%lld, or another --context-parallel-size",
                             T, chunks, lo > 0 ? lo : hi, hi);
    }
    return MOE_OK;
}

void moe_cp_take_local(int *dst, const int *src, int B, int T, int cp, int rank) {
    const int C = T / (2 * cp);
    for (int w = 0; w < 2; w++)
        for (int b = 0; b < B; b++)
            memcpy(dst + ((size_t)w * B + b) * C,
                   src + (size_t)b * T + (size_t)moe_cp_chunk(cp, rank, w) * C,
                   sizeof(int) * (size_t)C);
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

/* one row: the accumulator (yr, *l) and the part (yb, lb) */
static void merge_row(moe_real *yr, moe_real *l, const moe_real *yb, double lb, int D) {
    const double la = *l;
    if (isinf(lb) && lb < 0) /* the part saw no key: nothing to add */
        return;
    if (isinf(la) && la < 0) { /* nothing accumulated yet: take the part */
        for (int d = 0; d < D; d++)
            yr[d] = yb[d];
        *l = (moe_real)lb;
        return;
    }
    const double hi = la > lb ? la : lb, lo = la > lb ? lb : la;
    const double m = hi + log1p(exp(lo - hi));
    const double wa = exp(la - m), wb = exp(lb - m);
    for (int d = 0; d < D; d++)
        yr[d] = (moe_real)(wa * yr[d] + wb * yb[d]);
    *l = (moe_real)m;
}

void moe_cp_merge(moe_real *y, moe_real *lse, const moe_real *y_b, const moe_real *lse_b, int B,
                  int T, int H, int D) {
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++) {
                const size_t row = (((size_t)b * T + t) * H + h) * (size_t)D;
                const size_t l = ((size_t)b * H + h) * T + t;
                merge_row(y + row, lse + l, y_b + row, lse_b[l], D);
            }
}
