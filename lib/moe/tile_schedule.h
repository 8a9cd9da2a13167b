/**
 * @file tile_schedule.h
 * @brief The tile scheduler of chapter 03's grouped GEMM: which output tile a tile index
 *        names, for ragged groups whose row offsets the GPU reads from its own memory.
 *
 * The grouped GEMM computes out_g[n, N] = in_g[n, K] · w_gᵀ for groups g = 0..G−1; group g
 * owns rows [off[g], off[g+1]) of in and out. The output is cut into tiles of BM rows ×
 * BN columns that never cross a group: group g has ceil(rows_g / BM) m-tiles (its last one
 * may be short) times ntn = ceil(N / BN) n-tiles. Tile indices 0 .. total−1 run group by
 * group; inside a group the tiles go in BANDS of `band` m-tiles, m fastest inside a band:
 *
 *     group g, band b, n-tile n, m-tile (b·band + i), i = 0 .. rows_in_band − 1
 *
 * so CTAs that run at the same time share a few row blocks of in and a few weight blocks
 * of w_g, which stay in L2. To map an index to its group without asking the host, the
 * m-tile counts are prefix-summed (mt[g] = m-tiles before group g, mt[G] = all of them)
 * and the index's m-tile position is found by binary search in mt.
 *
 * The rule is written ONCE, here, as `static inline MOE_HOSTDEV` functions: the CUDA
 * kernels (kernels/grouped_gemm_sm90.cu, chapter 03's kernel ladder) call them on the
 * device, and lib/moe/tile_schedule.c wraps them as the library's C functions, which the
 * tests check against a brute-force enumeration (tests/test_tile_schedule.c).
 */
#ifndef MOE_TILE_SCHEDULE_H
#define MOE_TILE_SCHEDULE_H

#include "real.h" /* MOE_HOSTDEV */

/** One output tile of the grouped GEMM. */
typedef struct moe_tile {
    int g;  /**< its group */
    int m0; /**< first row (absolute row of in/out) */
    int n0; /**< first column */
    int r0; /**< the group's first row, off[g] */
    int r1; /**< one past the group's last row, off[g+1]: rows m0 .. min(m0+BM, r1)−1 are the
                 tile's */
} moe_tile;

/**
 * @brief Place (m-tile @p mi, n-tile @p ni) of local tile index @p l in a raster of
 *        @p mtiles × @p ntn tiles walked in bands of @p band m-tiles, m fastest inside a
 *        band. The one definition of the band order (the wgrad raster of dw_g uses it too).
 * @param l index inside the raster, in [0, mtiles·ntn)  @param mtiles m-tiles of the raster
 * @param ntn n-tiles  @param band m-tiles per band (>= 1)
 * @param mi receives the m-tile  @param ni receives the n-tile
 */
static inline MOE_HOSTDEV void moe_tile_band_place(int l, int mtiles, int ntn, int band, int *mi,
                                                   int *ni) {
    const int b = l / (band * ntn), in_band = l % (band * ntn);
    const int left = mtiles - b * band; /* the last band may be narrower */
    const int rows_in_band = left < band ? left : band;
    *mi = b * band + in_band % rows_in_band;
    *ni = in_band / rows_in_band;
}

/**
 * @brief The m-tile prefix: mt[g] = Σ_{h<g} ceil((off[h+1] − off[h]) / bm), for g = 0..G.
 * @param mt [G+1] receives the prefix  @param off [G+1] group row offsets
 * @param G groups  @param bm rows per tile
 * @return mt[G], the number of m-tiles of all groups
 */
static inline MOE_HOSTDEV int moe_tile_prefix_rule(int *mt, const int *off, int G, int bm) {
    int acc = 0;
    for (int g = 0; g < G; g++) {
        mt[g] = acc;
        acc += (off[g + 1] - off[g] + bm - 1) / bm;
    }
    mt[G] = acc;
    return acc;
}

/**
 * @brief The tile of index @p t: its group by binary search in the m-tile prefix, then its
 *        place inside the group by moe_tile_band_place().
 * @param ti receives the tile  @param t tile index  @param off [G+1] row offsets
 * @param mt [G+1] the m-tile prefix of moe_tile_prefix_rule()  @param G groups
 * @param ntn n-tiles, ceil(N / bn)  @param bm rows per tile  @param bn columns per tile
 * @param band m-tiles per band
 * @return 1, or 0 when @p t >= mt[G]·ntn (no such tile; @p ti is untouched)
 */
static inline MOE_HOSTDEV int moe_tile_at_rule(moe_tile *ti, int t, const int *off,
                                               const int *mt, int G, int ntn, int bm, int bn,
                                               int band) {
    if (t < 0 || t >= mt[G] * ntn)
        return 0;
    const int m = t / ntn; /* t's m-tile position, counting every group's m-tiles */
    int lo = 0, hi = G - 1; /* the g with mt[g] <= m < mt[g+1] (empty groups are skipped) */
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (mt[mid] <= m)
            lo = mid;
        else
            hi = mid - 1;
    }
    int mi, ni;
    moe_tile_band_place(t - mt[lo] * ntn, mt[lo + 1] - mt[lo], ntn, band, &mi, &ni);
    ti->g = lo;
    ti->r0 = off[lo];
    ti->r1 = off[lo + 1];
    ti->m0 = ti->r0 + mi * bm;
    ti->n0 = ni * bn;
    return 1;
}

/**
 * @brief The rows tile @p ti computes: @p bm, or bm / 2 when @p fine is set and at most
 *        bm / 2 of its group's rows are left from its first row (a group's ragged last
 *        m-tile). The kernel computes rows in multiples of 64 (the M of one wgmma), so with
 *        bm = 128 a group of r rows costs 128·floor(r / 128) rows of MMA work, plus 64 when
 *        r mod 128 is 1..64 and 128 when it is 65..127 — instead of 128·ceil(r / 128): no
 *        whole extra tile for the 2 rows of a group of 130. Read from the offsets alone, so
 *        the device decides it without the host.
 * @param ti the tile (from moe_tile_at_rule())  @param bm rows of a full tile (even)
 * @param fine 1: a short last m-tile is bm / 2 rows tall; 0: every tile is bm rows
 * @return bm or bm / 2
 */
static inline MOE_HOSTDEV int moe_tile_rows_rule(const moe_tile *ti, int bm, int fine) {
    return fine && ti->r1 - ti->m0 <= bm / 2 ? bm / 2 : bm;
}

/**
 * @brief The tail-sharing tile (the "share192" schedules): a group whose last m-tile holds
 *        1 .. bm / 2 rows (r = q·bm + t, q >= 1, 1 <= t <= bm / 2) computes its last
 *        bm + t rows — its last full m-tile and the tail — in tiles of (bm + bm / 2) rows
 *        × @p sbn columns, so the tail's rows share the weight block that the full rows
 *        load anyway instead of loading it again in a tile of their own.
 *
 * Why: with 128 × 256 tiles a group of 257 rows costs three tiles per 256 columns, each
 * loading the whole 256-column weight block per k-step (3 × 32 KB of weights plus 40 KB
 * of rows), and 384 rows of MMA for 257 rows of output. A 64-row tile for the tail halves
 * its MMA work but still loads the weight block (docs/results/03-grouped-gemm-ii.md §3b).
 * With bm = 128 the group's last 129 rows are 192-row tiles instead, whose weight block
 * serves all 192 rows: for the sm_90a kernel sbn = 128, a 40 KB pipeline stage (3 row
 * boxes of 8 KB, 128 weight columns of 64 k), 80 KB per 256 columns and k-step instead of
 * 88 KB, and 192 instead of 256 rows of MMA. (sbn is bounded by the registers: a consumer
 * thread holds 0.75·sbn accumulators of such a tile, and 128 of a 128 × 256 one.) It is
 * an experiment, off by default: on an H100 it did not remove the cliff
 * (docs/results/03-grouped-gemm-ii.md §3c).
 *
 * The schedule itself does not change: the group keeps its ceil(r / bm) m-tile SLOTS
 * (moe_tile_prefix_rule() and moe_tile_at_rule() are the same), and the two last slots of
 * n-tile ni (bn columns) hold the sharing tiles whose first column lies in n-tile ni's
 * columns: tile j (columns [j·sbn, (j+1)·sbn)) sits in slot (ni = floor(j·sbn / bn),
 * s = j − ceil(ni·bn / sbn)). With bn / 2 <= sbn <= bn that is at most two per n-tile,
 * so they fit; a slot left over (or one whose tile starts past @p N) has no work. Placing
 * them by their first column keeps a sharing tile next, in time, to the full tiles that
 * read the same weight columns (the band order, moe_tile_band_place()).
 *
 * Read from the offsets alone (the tile's r0, r1, m0), so the device decides it without
 * the host.
 * @param ti the tile of moe_tile_at_rule() (same bm, bn); rewritten for a sharing tile:
 *        m0 = its group's first row of the shared block, n0 = j·sbn
 * @param bm rows of a full tile (even)  @param bn columns of a full tile
 * @param sbn columns of a sharing tile, bn / 2 <= sbn <= bn  @param N output columns
 * @return 1: a plain bm × bn tile (@p ti unchanged); 2: a sharing tile of rows
 *         [m0, r1) (bm + 1 .. bm + bm / 2 of them) and columns [n0, min(n0 + sbn, N));
 *         0: a slot without work
 */
static inline MOE_HOSTDEV int moe_tile_share_rule(moe_tile *ti, int bm, int bn, int sbn, int N) {
    const int r = ti->r1 - ti->r0, q = r / bm, t = r % bm;
    if (q < 1 || t < 1 || t > bm / 2)
        return 1;
    const int mi = (ti->m0 - ti->r0) / bm; /* this tile's m-slot in its group */
    if (mi < q - 1)
        return 1;
    const int ni = ti->n0 / bn;
    const int j0 = (ni * bn + sbn - 1) / sbn, j1 = ((ni + 1) * bn + sbn - 1) / sbn;
    const int j = j0 + mi - (q - 1); /* slot q - 1 takes j0, slot q the one after */
    if (j >= j1 || j * sbn >= N)
        return 0;
    ti->m0 = ti->r0 + (q - 1) * bm;
    ti->n0 = j * sbn;
    return 2;
}

/**
 * @brief The swapped tail tile (the "swaptail" schedules): a tile that holds t = r1 − m0
 *        <= min(bm / 2, 64) rows — the last m-tile of a group of r = 128·q + t rows, any
 *        q >= 0 — is computed TRANSPOSED, Cᵀ = W_tile · X_tailᵀ, and this says how many
 *        token columns that product has: t rounded up to 16, 32 or 64.
 *
 * Why: a wgmma's M is 64 rows, so a tile computes rows in multiples of 64 and a 1-row
 * tail still costs 64 rows of MMA per weight column (the tail64 tile of
 * moe_tile_rows_rule(); the 128-row tile costs 128). Swapped, the weight block is the
 * operand whose rows wgmma counts in 64s (its output features, of which there are always
 * plenty) and the tail's token rows are wgmma's N, which runs from 8 to 256 in steps of 8:
 * a 1-row tail costs 16 columns of MMA per 64 features instead of 64 or 128 rows. The
 * kernel instantiates N = 16, 32 and 64 (fewer instantiations, no 8: the MMA of m64n8 and
 * m64n16 cost about the same issue slot), so the rows of MMA work of a group of r rows
 * are 128·floor(r / 128) + (0, 16, 32, 64 or 128).
 *
 * The schedule does not change: the tile keeps its slot (moe_tile_at_rule()), its rows
 * and its bn columns; only the way the kernel computes it does. Read from the offsets
 * alone, so the device decides it without the host.
 * @param ti the tile (from moe_tile_at_rule())  @param bm rows of a full tile (even)
 * @return 0: a plain tile; else the token width of the swapped product (16, 32 or 64,
 *         >= the tile's rows)
 */
static inline MOE_HOSTDEV int moe_tile_swap_rule(const moe_tile *ti, int bm) {
    const int t = ti->r1 - ti->m0;
    if (t < 1 || t > bm / 2 || t > 64)
        return 0;
    return t <= 16 ? 16 : t <= 32 ? 32 : 64;
}

/**
 * @brief The pair slots of one group (the "static-mc2" schedule, a CTA cluster of two):
 *        (q / 2)·ntn multicast slots, each two m-tiles 2i, 2i + 1 of one n-tile, and, for
 *        an odd number q = ceil(rows / bm) of m-tiles, ceil(ntn / 2) solo slots, each the
 *        last m-tile under two neighbouring n-tiles.
 *
 * Why: in the fine-grained regime the weight block of a tile (bn rows of w_g × all of K)
 * outweighs its rows, and every further m-tile of a group reads it again unless L2 still
 * holds it (docs/results/03-grouped-gemm-ii.md §3e). A CTA cluster of two computes the
 * m-tiles 2i and 2i + 1 of one (group, n-tile) at the same time and each CTA loads half
 * of every weight k-block, multicast into both CTAs' shared memory: the weights are read
 * once per pair. The odd m-tile left over is not paired with an empty partner (that CTA
 * would idle a whole tile: a group of 257 rows would cost 4 tile slots per n-tile instead
 * of 3) but with itself under the next n-tile: each CTA loads its own weights (solo), both
 * compute; only an odd ntn leaves one CTA idle in the group's last slot.
 * @param rows the group's rows  @param bm rows per m-tile  @param ntn n-tiles
 * @return the group's pair slots
 */
static inline MOE_HOSTDEV int moe_tile_pair_count(int rows, int bm, int ntn) {
    const int q = (rows + bm - 1) / bm;
    return q / 2 * ntn + q % 2 * ((ntn + 1) / 2);
}

/**
 * @brief The pair-slot prefix: ps[g] = Σ_{h<g} moe_tile_pair_count(rows_h), g = 0..G.
 * @param ps [G+1] receives the prefix  @param off [G+1] row offsets  @param G groups
 * @param bm rows per m-tile  @param ntn n-tiles
 * @return ps[G], the number of pair slots
 */
static inline MOE_HOSTDEV int moe_tile_pair_prefix_rule(int *ps, const int *off, int G, int bm,
                                                        int ntn) {
    int acc = 0;
    for (int g = 0; g < G; g++) {
        ps[g] = acc;
        acc += moe_tile_pair_count(off[g + 1] - off[g], bm, ntn);
    }
    ps[G] = acc;
    return acc;
}

/** What a CTA of a pair slot does (moe_tile_pair_at_rule()). */
enum {
    MOE_PAIR_NONE = 0,  /**< no such slot (past the last one) */
    MOE_PAIR_IDLE = 1,  /**< no tile: the solo slot's second n-tile lies past N */
    MOE_PAIR_SOLO = 2,  /**< a tile whose weights this CTA loads alone */
    MOE_PAIR_MCAST = 3  /**< a tile whose weight block the two CTAs load half each */
};

/**
 * @brief The tile that CTA @p rank (0 or 1) of a cluster computes in pair slot @p t: the
 *        group by binary search in the pair-slot prefix; then, inside the group, the
 *        multicast slots in bands of band / 2 pairs (the band order of
 *        moe_tile_band_place(), so a band still spans @p band m-tiles), then the solo
 *        slots. Multicast: m-tile 2i + rank of pair i, both CTAs the same n-tile. Solo:
 *        the group's last m-tile, n-tile 2j + rank.
 * @param ti receives the tile (for MOE_PAIR_IDLE: the group and rows, n0 past N)
 * @param t pair slot  @param rank the CTA's rank in its cluster (0 or 1)
 * @param off [G+1] row offsets  @param ps [G+1] the prefix of moe_tile_pair_prefix_rule()
 * @param G groups  @param ntn n-tiles  @param bm rows per m-tile  @param bn columns per tile
 * @param band m-tiles per band (even)
 * @return MOE_PAIR_NONE, MOE_PAIR_IDLE, MOE_PAIR_SOLO or MOE_PAIR_MCAST
 */
static inline MOE_HOSTDEV int moe_tile_pair_at_rule(moe_tile *ti, int t, int rank,
                                                    const int *off, const int *ps, int G,
                                                    int ntn, int bm, int bn, int band) {
    if (t < 0 || t >= ps[G])
        return MOE_PAIR_NONE;
    int lo = 0, hi = G - 1; /* the g with ps[g] <= t < ps[g+1] (empty groups are skipped) */
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (ps[mid] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    const int l = t - ps[lo], q = (off[lo + 1] - off[lo] + bm - 1) / bm, np = q / 2;
    ti->g = lo;
    ti->r0 = off[lo];
    ti->r1 = off[lo + 1];
    if (l < np * ntn) {
        int pi, ni;
        moe_tile_band_place(l, np, ntn, band / 2, &pi, &ni);
        ti->m0 = ti->r0 + (2 * pi + rank) * bm;
        ti->n0 = ni * bn;
        return MOE_PAIR_MCAST;
    }
    const int n = 2 * (l - np * ntn) + rank;
    ti->m0 = ti->r0 + (q - 1) * bm;
    ti->n0 = n * bn;
    return n < ntn ? MOE_PAIR_SOLO : MOE_PAIR_IDLE;
}

/** The shape of a tile grid: how the output is cut and walked. */
typedef struct moe_tile_shape {
    int bm;   /**< rows per tile (the sm_90a kernel: 128) */
    int bn;   /**< columns per tile (256) */
    int band; /**< m-tiles per band (8) */
} moe_tile_shape;

/**
 * @brief The m-tile prefix of @p G groups (the library's C function; the rule is
 *        moe_tile_prefix_rule()).
 * @param mt [G+1] receives mt[g] = m-tiles of the groups before g
 * @param off [G+1] non-decreasing row offsets, off[0] = 0  @param G groups (>= 1)
 * @param bm rows per tile (>= 1)
 * @return the number of m-tiles, mt[G]
 */
int moe_tile_schedule_prefix(int *mt, const int *off, int G, int bm);

/**
 * @brief The tile of index @p t (the library's C function; the rule is
 *        moe_tile_at_rule()): tiles run group by group, in bands of `band` m-tiles, m
 *        fastest inside a band.
 * @param ti receives the tile  @param t tile index  @param off [G+1] row offsets
 * @param mt [G+1] the prefix of moe_tile_schedule_prefix()  @param G groups
 * @param N output columns  @param shape tile shape
 * @return 1, or 0 when t is past the last tile
 */
int moe_tile_schedule_at(moe_tile *ti, int t, const int *off, const int *mt, int G, int N,
                         moe_tile_shape shape);

/**
 * @brief The tiles one persistent CTA runs: CTA @p cta of @p ctas takes tiles cta,
 *        cta + ctas, cta + 2·ctas, ... (the static schedule of the sm_90a kernel).
 * @param tiles receives at most cap tiles, in the order the CTA runs them
 * @param cap capacity of the tiles array
 * @param cta this CTA, in [0, ctas)
 * @param ctas the number of CTAs
 * @param off [G+1] row offsets
 * @param G groups
 * @param N output columns
 * @param shape tile shape
 * @return the number of tiles of this CTA (may exceed @p cap: only @p cap are written), or
 *         -1 when memory for the prefix cannot be had
 */
int moe_tile_schedule_cta(moe_tile *tiles, int cap, int cta, int ctas, const int *off, int G,
                          int N, moe_tile_shape shape);

#endif /* MOE_TILE_SCHEDULE_H */
