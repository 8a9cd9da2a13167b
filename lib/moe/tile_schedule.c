/* The tile scheduler of chapter 03's grouped GEMM, as C functions: see tile_schedule.h.
 * The rule itself lives in the header, shared with the CUDA kernels; these wrap it. */
#include "moe/tile_schedule.h"

#include <stdlib.h>

int moe_tile_schedule_prefix(int *mt, const int *off, int G, int bm) {
    return moe_tile_prefix_rule(mt, off, G, bm);
}

int moe_tile_schedule_at(moe_tile *ti, int t, const int *off, const int *mt, int G, int N,
                         moe_tile_shape shape) {
    return moe_tile_at_rule(ti, t, off, mt, G, (N + shape.bn - 1) / shape.bn, shape.bm, shape.bn,
                            shape.band);
}

int moe_tile_schedule_cta(moe_tile *tiles, int cap, int cta, int ctas, const int *off, int G,
                          int N, moe_tile_shape shape) {
    int *mt = malloc(sizeof(int) * (size_t)(G + 1));
    if (!mt)
        return -1;
    moe_tile_prefix_rule(mt, off, G, shape.bm);
    const int ntn = (N + shape.bn - 1) / shape.bn;
    int n = 0;
    moe_tile ti;
    for (int t = cta; moe_tile_at_rule(&ti, t, off, mt, G, ntn, shape.bm, shape.bn, shape.band);
         t += ctas, n++)
        if (n < cap)
            tiles[n] = ti;
    free(mt);
    return n;
}
