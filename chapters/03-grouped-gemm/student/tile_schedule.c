/*
 * Chapter 03, exercise: the tile scheduler of the grouped GEMM (on the CPU).
 *
 * `make STUDENT=1 check-ch03` links this file in place of the library's
 * moe_tile_schedule_prefix and moe_tile_schedule_at (lib/moe/tile_schedule.c, which calls
 * the rule in lib/moe/tile_schedule.h: the reference solution, and the very code the
 * sm_90a kernel runs on the GPU) and runs tests/test_tile_schedule.c on them: against a
 * brute-force list of every tile in schedule order, with ragged and empty groups, bands
 * wider than a group, and 60 random shapes.
 *
 * The problem. The grouped GEMM writes out[off[G], N]; group g owns rows
 * [off[g], off[g+1]) (off non-decreasing, off[0] = 0, a group may be empty). The output
 * is cut into tiles of BM rows × BN columns (shape.bm, shape.bn) that never cross a
 * group: group g has mtiles_g = ceil(rows_g / BM) m-tiles (the last may be short) and
 * every group has ntn = ceil(N / BN) n-tiles. A persistent kernel hands out tile indices
 * t = 0, 1, 2, ... and each CTA must find ITS tile from t and off[] alone (off[] lives in
 * GPU memory; the host never learns the sizes). The order of the indices:
 *
 *   1. group by group (all of group 0's tiles, then group 1's, ...);
 *   2. inside a group, in BANDS of shape.band m-tiles (the last band of a group may be
 *      narrower: rows_in_band = min(band, mtiles_g − b·band));
 *   3. inside a band, n-tile by n-tile, and for each n-tile the band's m-tiles, m fastest.
 *
 * Worked example: BM = 128, BN = 256, band = 2, N = 512 (ntn = 2), off = {0, 300, 300, 400}.
 *   group 0: 300 rows -> 3 m-tiles; group 1: empty; group 2: 100 rows -> 1 m-tile.
 *   prefix mt = {0, 3, 3, 4}: 4 m-tiles, 8 tiles in all.
 *   t : (group, m0, n0)      t = 0: (0,   0,   0)   t = 1: (0, 128,   0)   band 0, n 0
 *                            t = 2: (0,   0, 256)   t = 3: (0, 128, 256)   band 0, n 1
 *                            t = 4: (0, 256,   0)   t = 5: (0, 256, 256)   band 1 (narrow)
 *                            t = 6: (2, 300,   0)   t = 7: (2, 300, 256)   group 2
 *   t = 8: no such tile, return 0.
 *
 * The tests check: the prefix; that tile t is exactly the t-th tile of that order (group,
 * m0, n0, and r0 = off[g], r1 = off[g+1]); 0 for t past the last tile; every row of every
 * group covered exactly once per n-tile.
 */
#include "../../student.h"
#include "moe/tile_schedule.h"

int moe_tile_schedule_prefix(int *mt, const int *off, int G, int bm) {
    MOE_STUDENT_TODO(); /* delete this line when the function is written */
    /* TODO 1: mt[g] = the number of m-tiles of the groups before g, for g = 0 .. G
     *         (mt[0] = 0; group h has ceil((off[h+1] − off[h]) / bm) m-tiles, 0 if empty). */
    /* TODO 2: return mt[G]. */
    return 0;
}

int moe_tile_schedule_at(moe_tile *ti, int t, const int *off, const int *mt, int G, int N,
                         moe_tile_shape shape) {
    MOE_STUDENT_TODO(); /* delete this line when the function is written */
    /* TODO 1: ntn = ceil(N / shape.bn); if t < 0 or t >= mt[G]·ntn, return 0. */
    /* TODO 2: m = t / ntn is t's position among ALL m-tiles. Find the group g with
     *         mt[g] <= m < mt[g+1] by binary search over mt (a GPU thread cannot afford a
     *         loop over 128 groups per tile). Careful: empty groups have mt[g] == mt[g+1];
     *         you want the LAST g with mt[g] <= m. */
    /* TODO 3: l = t − mt[g]·ntn is the index inside the group; its band b = l / (band·ntn),
     *         in_band = l % (band·ntn), rows_in_band = min(band, mtiles_g − b·band).
     *         m-tile mi = b·band + in_band % rows_in_band, n-tile ni = in_band / rows_in_band. */
    /* TODO 4: ti->g = g, ti->r0 = off[g], ti->r1 = off[g+1], ti->m0 = off[g] + mi·bm,
     *         ti->n0 = ni·bn; return 1. */
    return 0;
}
