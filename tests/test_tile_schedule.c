/*
 * The tile scheduler of the grouped GEMM (chapter 03; lib/moe/tile_schedule.h, and with
 * STUDENT=1 the student's version in chapters/03-grouped-gemm/student/) against a
 * brute-force enumeration written independently of it: nested loops over groups, bands,
 * n-tiles and m-tiles list every tile in the order the schedule must produce. Checked:
 * the m-tile prefix; tile t is the t-th tile of that list (so the band order is right);
 * no index past the last tile; every row of every group is covered exactly once per
 * column tile and no tile crosses into another group; and the per-CTA lists of a
 * persistent launch partition the tiles. Ragged groups, empty groups, one group holding
 * every row, bands wider than a group, and many random shapes. Then the tile height
 * (moe_tile_rows_rule): with 64-row tails, a tile is bm / 2 rows exactly when its group has
 * at most bm / 2 rows left, it still holds all of them, and a group's rows of MMA work are
 * 128·floor(r / 128) + (0, 64 or 128) — checked on every size around the tile boundaries.
 * Last, the tail-sharing tiles (moe_tile_share_rule): every element of every group is
 * computed exactly once, a group's last bm + t rows (1 <= t <= bm / 2) go to sharing
 * tiles of bm + t rows, ceil(N / sbn) of them per such group, each in the slot of the
 * n-tile that holds its first column; other groups keep their plain tiles.
 * And the swapped tail tiles (moe_tile_swap_rule): a tile is swapped exactly when it holds
 * 1..64 rows (<= bm / 2), its token width (16, 32 or 64) is the smallest that holds them,
 * there is one per (group, n-tile) whose group has such a tail and none elsewhere, every
 * element is computed exactly once (the swapped tile computes rows [m0, r1), no row of the
 * next group), and a group's MMA work is 128·floor(r / 128) + (0, 16, 32, 64 or 128) rows.
 */
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "moe/tile_schedule.h"
#include "rng.h"
#include "suites.h"

/* every tile, in schedule order, by nested loops; returns how many */
static int enumerate(moe_tile *list, const int *off, int G, int N, moe_tile_shape s) {
    const int ntn = (N + s.bn - 1) / s.bn;
    int n = 0;
    for (int g = 0; g < G; g++) {
        const int mtiles = (off[g + 1] - off[g] + s.bm - 1) / s.bm;
        for (int b0 = 0; b0 < mtiles; b0 += s.band) {
            const int width = mtiles - b0 < s.band ? mtiles - b0 : s.band;
            for (int nt = 0; nt < ntn; nt++)
                for (int i = 0; i < width; i++) {
                    const moe_tile t = {g, off[g] + (b0 + i) * s.bm, nt * s.bn, off[g], off[g + 1]};
                    list[n++] = t;
                }
        }
    }
    return n;
}

static void check_schedule(const int *off, int G, int N, moe_tile_shape s) {
    const int rows = off[G], ntn = (N + s.bn - 1) / s.bn;
    const int cap = (rows / s.bm + G + 1) * ntn;
    moe_tile *want = malloc(sizeof(moe_tile) * (size_t)cap);
    moe_tile *cta_tiles = malloc(sizeof(moe_tile) * (size_t)cap);
    int *mt = malloc(sizeof(int) * (size_t)(G + 1));
    int *cover = calloc((size_t)(rows ? rows : 1) * ntn, sizeof(int));
    ck_assert(want && cta_tiles && mt && cover);
    const int total = enumerate(want, off, G, N, s);

    /* the m-tile prefix */
    const int mtiles = moe_tile_schedule_prefix(mt, off, G, s.bm);
    ck_assert_int_eq(mtiles * ntn, total);
    for (int g = 0, acc = 0; g <= G; g++) {
        ck_assert_msg(mt[g] == acc, "prefix mt[%d] = %d, want %d (m-tiles of the groups before %d)",
                      g, mt[g], acc, g);
        if (g < G)
            acc += (off[g + 1] - off[g] + s.bm - 1) / s.bm;
    }

    /* tile t is the t-th of the enumeration, and covers its rows once */
    for (int t = 0; t < total; t++) {
        moe_tile ti = {-1, -1, -1, -1, -1};
        ck_assert_msg(moe_tile_schedule_at(&ti, t, off, mt, G, N, s),
                      "tile %d of %d: reported as past the end", t, total);
        const moe_tile *w = &want[t];
        ck_assert_msg(ti.g == w->g && ti.m0 == w->m0 && ti.n0 == w->n0,
                      "tile %d (BM=%d BN=%d band=%d): (group %d, m0 %d, n0 %d), want (group %d, "
                      "m0 %d, n0 %d)", t, s.bm, s.bn, s.band, ti.g, ti.m0, ti.n0, w->g, w->m0,
                      w->n0);
        ck_assert_msg(ti.r0 == off[ti.g] && ti.r1 == off[ti.g + 1],
                      "tile %d: group rows [%d, %d), want [%d, %d)", t, ti.r0, ti.r1, off[ti.g],
                      off[ti.g + 1]);
        ck_assert_msg(ti.m0 >= ti.r0 && ti.m0 < ti.r1, "tile %d starts outside its group", t);
        const int end = ti.m0 + s.bm < ti.r1 ? ti.m0 + s.bm : ti.r1;
        for (int r = ti.m0; r < end; r++)
            cover[(size_t)r * ntn + ti.n0 / s.bn]++;
    }
    for (int r = 0; r < rows; r++)
        for (int nt = 0; nt < ntn; nt++)
            ck_assert_msg(cover[(size_t)r * ntn + nt] == 1,
                          "row %d, column tile %d: covered %d times, want once", r, nt,
                          cover[(size_t)r * ntn + nt]);
    moe_tile past;
    ck_assert_msg(!moe_tile_schedule_at(&past, total, off, mt, G, N, s),
                  "index %d (one past the last tile) must return 0", total);

    /* the per-CTA lists of a persistent launch: CTA b runs tiles b, b + ctas, ... */
    const int ctas_list[3] = {1, 3, 132};
    for (int c = 0; c < 3; c++) {
        const int ctas = ctas_list[c];
        int seen = 0;
        for (int b = 0; b < ctas; b++) {
            const int n = moe_tile_schedule_cta(cta_tiles, cap, b, ctas, off, G, N, s);
            ck_assert_int_eq(n, b < total ? (total - b + ctas - 1) / ctas : 0);
            for (int j = 0; j < n; j++) {
                const moe_tile *w = &want[b + j * ctas];
                ck_assert(cta_tiles[j].g == w->g && cta_tiles[j].m0 == w->m0 &&
                          cta_tiles[j].n0 == w->n0);
            }
            seen += n;
        }
        ck_assert_int_eq(seen, total);
    }
    free(want); free(cta_tiles); free(mt); free(cover);
}

START_TEST(test_tile_schedule_ragged) {
    /* a group of one row, an empty one, exactly one tile, one row past a tile, a large one */
    const int off[7] = {0, 1, 1, 129, 258, 258, 2000};
    const moe_tile_shape s = {128, 256, 8};
    check_schedule(off, 6, 1000, s); /* 4 column tiles, the last one short */
    check_schedule(off, 6, 256, s);
    const moe_tile_shape narrow = {16, 8, 3}; /* bands of 3: the last band of a group short */
    check_schedule(off, 6, 20, narrow);
}
END_TEST

START_TEST(test_tile_schedule_edge_groups) {
    const int all_in_one[4] = {0, 0, 700, 700}; /* only group 1 has rows */
    const moe_tile_shape s = {128, 256, 8};
    check_schedule(all_in_one, 3, 512, s);
    const int single[2] = {0, 5}; /* one group, smaller than a tile, band wider than it */
    check_schedule(single, 1, 300, s);
    const int empty[3] = {0, 0, 0}; /* no rows at all: no tiles */
    check_schedule(empty, 2, 64, s);
}
END_TEST

START_TEST(test_tile_schedule_random) {
    const int bms[4] = {1, 2, 16, 128}, bns[3] = {1, 8, 256}, bands[4] = {1, 2, 3, 8};
    uint64_t draw = 0;
#define U(n) ((int)(moe_rng_uniform(11, 12, draw++) * (n)))
    for (int trial = 0; trial < 60; trial++) {
        const moe_tile_shape s = {bms[U(4)], bns[U(3)], bands[U(4)]};
        const int G = 1 + U(20), N = 1 + U(700);
        int off[21];
        off[0] = 0;
        for (int g = 0; g < G; g++) /* a quarter of the groups empty, others up to 3 tiles */
            off[g + 1] = off[g] + (U(4) == 0 ? 0 : U(3 * s.bm + 1));
        check_schedule(off, G, N, s);
    }
#undef U
}
END_TEST

/* Offsets off[0..G] of G groups whose sizes walk the list edge[0..ne) with stride 7 (coprime
 * with the lists' lengths, so every size appears, next to different neighbours). */
static void edge_offsets(int *off, int G, const int *edge, int ne) {
    off[0] = 0;
    for (int g = 0; g < G; g++)
        off[g + 1] = off[g] + edge[(g * 7) % ne];
}

/* The tile heights of every tile of off[0..G] (shape s), with and without 64-row tails:
 * each tile's rows of its group are the same whatever its height (none lost), and each
 * group's MMA rows equal the closed form computed here from its size alone. */
static void check_heights(const int *off, int G, int N, moe_tile_shape s) {
    int *mt = malloc(sizeof(int) * (size_t)(G + 1));
    long *work = calloc((size_t)G, sizeof(long));
    ck_assert(mt && work);
    const int total = moe_tile_schedule_prefix(mt, off, G, s.bm) * ((N + s.bn - 1) / s.bn);
    for (int fine = 0; fine < 2; fine++) {
        memset(work, 0, sizeof(long) * (size_t)G);
        for (int t = 0; t < total; t++) {
            moe_tile ti;
            ck_assert(moe_tile_schedule_at(&ti, t, off, mt, G, N, s));
            const int h = moe_tile_rows_rule(&ti, s.bm, fine), left = ti.r1 - ti.m0;
            ck_assert_msg(h == (fine && left <= s.bm / 2 ? s.bm / 2 : s.bm),
                          "tile %d (group %d, %d rows left, tails %d): height %d", t, ti.g, left,
                          fine, h);
            ck_assert_msg(h >= (left < s.bm ? left : s.bm),
                          "tile %d: %d rows tall, but %d of its group's rows are its", t, h,
                          left < s.bm ? left : s.bm);
            if (ti.n0 == 0)
                work[ti.g] += h;
        }
        for (int g = 0; g < G; g++) {
            const int r = off[g + 1] - off[g], rem = r % s.bm;
            const long want = (long)(r / s.bm) * s.bm +
                              (rem == 0 ? 0 : fine && rem <= s.bm / 2 ? s.bm / 2 : s.bm);
            ck_assert_msg(work[g] == want, "group %d of %d rows (tails %d): %ld rows of MMA work, "
                          "want %ld", g, r, fine, work[g], want);
        }
    }
    free(mt);
    free(work);
}

START_TEST(test_tile_schedule_tail_heights) {
    /* every size around the tile boundaries, empty and 1-8 rows, 256 groups */
    static const int edge[] = {0,   1,   2,   3,   4,   5,   6,   7,   8,   63,  64,  65, 127,
                               128, 129, 130, 191, 192, 193, 255, 256, 257, 260, 383, 384, 385};
    const int ne = (int)(sizeof edge / sizeof edge[0]);
    int off[257];
    edge_offsets(off, 256, edge, ne);
    const moe_tile_shape s = {128, 256, 8};
    check_heights(off, 256, 320, s);
    check_heights(off, 256, 256, s);
    const moe_tile_shape small = {16, 8, 3};
    check_heights(off, 256, 20, small);
    /* the schedule itself does not change with the heights (same tiles, same order) */
    check_schedule(off, 256, 320, s);
}
END_TEST

/* The sharing tiles of off[0..G] (tile shape s, sharing tiles sbn columns wide): each
 * element is computed by exactly one tile, and the rule's choices are checked against a
 * closed form from the group's size. */
static void check_share(const int *off, int G, int N, moe_tile_shape s, int sbn) {
    int *mt = malloc(sizeof(int) * (size_t)(G + 1));
    const int rows = off[G];
    unsigned char *cover = calloc((size_t)(rows ? rows : 1) * N, 1);
    int *shared = calloc((size_t)G, sizeof(int));
    ck_assert(mt && cover && shared);
    const int total = moe_tile_schedule_prefix(mt, off, G, s.bm) * ((N + s.bn - 1) / s.bn);
    for (int t = 0; t < total; t++) {
        moe_tile ti;
        ck_assert(moe_tile_schedule_at(&ti, t, off, mt, G, N, s));
        const moe_tile plain = ti;
        const int kind = moe_tile_share_rule(&ti, s.bm, s.bn, sbn, N);
        const int r = ti.r1 - ti.r0, q = r / s.bm, tail = r % s.bm;
        const int sharing = q >= 1 && tail >= 1 && tail <= s.bm / 2;
        const int last2 = (plain.m0 - plain.r0) / s.bm >= q - 1;
        ck_assert_msg(kind == 1 ? !(sharing && last2) : sharing && last2,
                      "tile %d (group %d of %d rows, m0 %d): kind %d", t, ti.g, r, plain.m0,
                      kind);
        if (kind == 0)
            continue;
        int m_end = ti.m0 + s.bm, n_end = ti.n0 + s.bn;
        if (kind == 2) {
            ck_assert_msg(ti.m0 == ti.r0 + (q - 1) * s.bm && ti.n0 % sbn == 0 &&
                              ti.n0 / s.bn == plain.n0 / s.bn && ti.n0 < N,
                          "sharing tile %d: m0 %d n0 %d (group rows %d..%d, slot n0 %d)", t,
                          ti.m0, ti.n0, ti.r0, ti.r1, plain.n0);
            m_end = ti.r1; /* bm + tail rows */
            n_end = ti.n0 + sbn;
            shared[ti.g]++;
        }
        m_end = m_end < ti.r1 ? m_end : ti.r1;
        n_end = n_end < N ? n_end : N;
        for (int row = ti.m0; row < m_end; row++)
            for (int col = ti.n0; col < n_end; col++)
                cover[(size_t)row * N + col]++;
    }
    size_t bad = 0; /* (one assertion at the end: check marks a point at each) */
    while (bad < (size_t)rows * N && cover[bad] == 1)
        bad++;
    ck_assert_msg(bad == (size_t)rows * N, "row %zu, column %zu: computed %d times, want once",
                  bad / N, bad % N, bad < (size_t)rows * N ? cover[bad] : 1);
    for (int g = 0; g < G; g++) {
        const int r = off[g + 1] - off[g], tail = r % s.bm;
        const int want = r >= s.bm && tail >= 1 && tail <= s.bm / 2 ? (N + sbn - 1) / sbn : 0;
        ck_assert_msg(shared[g] == want, "group %d of %d rows: %d sharing tiles, want %d", g, r,
                      shared[g], want);
    }
    free(mt);
    free(cover);
    free(shared);
}

START_TEST(test_tile_schedule_share) {
    /* every size around the tile boundaries (and the 192-row sharing tile's), 256 groups */
    static const int edge[] = {0,   1,   2,   3,   4,   5,   6,   7,   8,   63,  64,  65,  127,
                               128, 129, 130, 191, 192, 193, 255, 256, 257, 258, 260, 319,
                               320, 321, 383, 384, 385, 449, 450};
    const int ne = (int)(sizeof edge / sizeof edge[0]);
    int off[257];
    edge_offsets(off, 256, edge, ne);
    const moe_tile_shape s = {128, 256, 8};
    check_share(off, 256, 320, s, 128); /* the kernel's sharing tiles: 128 columns */
    check_share(off, 256, 200, s, 128);
    /* the first 2·ne groups (every size twice), other widths (160 and 192: n-tiles with
     * one or two sharing tiles, slots without work) */
    const int Ns[6] = {64, 192, 256, 520, 1000, 4096};
    for (int i = 0; i < 6; i++) {
        check_share(off, 2 * ne, Ns[i], s, 160);
        check_share(off, 2 * ne, Ns[i], s, 128);
        check_share(off, 2 * ne, Ns[i], s, 192);
    }
    check_share(off, 2 * ne, 512, s, 256); /* sbn = bn: one per n-tile */
    const moe_tile_shape small = {16, 8, 3}; /* narrow bands, sbn = 6 */
    int off2[41];
    off2[0] = 0;
    for (int g = 0; g < 40; g++)
        off2[g + 1] = off2[g] + (g * 5) % 41;
    for (int N = 1; N <= 30; N++)
        check_share(off2, 40, N, small, 6);
}
END_TEST

/* The swapped tail tiles of off[0..G] (tile shape s): checked element by element (each
 * computed once), tile by tile (swapped exactly when it holds 1 .. min(bm / 2, 64) rows, its
 * width the smallest of 16, 32, 64 holding them), and group by group (one swapped tile per
 * n-tile where the group's size mod bm is 1 .. bm / 2, and the closed form of its MMA work,
 * in rows, at the first n-tile). */
static void check_swap(const int *off, int G, int N, moe_tile_shape s) {
    int *mt = malloc(sizeof(int) * (size_t)(G + 1));
    const int rows = off[G], ntn = (N + s.bn - 1) / s.bn;
    unsigned char *cover = calloc((size_t)(rows ? rows : 1) * N, 1);
    int *swapped = calloc((size_t)G, sizeof(int));
    long *work = calloc((size_t)G, sizeof(long));
    ck_assert(mt && cover && swapped && work);
    const int total = moe_tile_schedule_prefix(mt, off, G, s.bm) * ntn;
    for (int t = 0; t < total; t++) {
        moe_tile ti;
        ck_assert(moe_tile_schedule_at(&ti, t, off, mt, G, N, s));
        const int w = moe_tile_swap_rule(&ti, s.bm), left = ti.r1 - ti.m0;
        const int tail = left >= 1 && left <= s.bm / 2 && left <= 64;
        const int want_w = !tail ? 0 : left <= 16 ? 16 : left <= 32 ? 32 : 64;
        ck_assert_msg(w == want_w, "tile %d (group %d, %d rows left from m0 %d): width %d, want "
                      "%d", t, ti.g, left, ti.m0, w, want_w);
        if (w) {
            ck_assert_msg(w >= left && ti.m0 + left == ti.r1 && ti.m0 >= ti.r0,
                          "swapped tile %d: rows %d..%d of group %d..%d, width %d", t, ti.m0,
                          ti.m0 + left, ti.r0, ti.r1, w);
            swapped[ti.g]++;
        }
        if (ti.n0 == 0)
            work[ti.g] += w ? w : s.bm;
        /* a swapped tile writes its tokens j < w masked to rows < r1; a plain one its bm
         * rows masked likewise */
        const int span = w ? w : s.bm;
        const int m_end = ti.m0 + span < ti.r1 ? ti.m0 + span : ti.r1;
        const int n_end = ti.n0 + s.bn < N ? ti.n0 + s.bn : N;
        for (int row = ti.m0; row < m_end; row++)
            for (int col = ti.n0; col < n_end; col++)
                cover[(size_t)row * N + col]++;
    }
    size_t bad = 0;
    while (bad < (size_t)rows * N && cover[bad] == 1)
        bad++;
    ck_assert_msg(bad == (size_t)rows * N, "row %zu, column %zu: computed %d times, want once",
                  bad / N, bad % N, bad < (size_t)rows * N ? cover[bad] : 1);
    for (int g = 0; g < G; g++) {
        const int r = off[g + 1] - off[g], rem = r % s.bm;
        const int has = rem >= 1 && rem <= s.bm / 2 && rem <= 64;
        ck_assert_msg(swapped[g] == (has ? ntn : 0), "group %d of %d rows: %d swapped tiles, "
                      "want %d", g, r, swapped[g], has ? ntn : 0);
        const long want = (long)(r / s.bm) * s.bm +
                          (rem == 0 ? 0 : !has ? s.bm : rem <= 16 ? 16 : rem <= 32 ? 32 : 64);
        ck_assert_msg(work[g] == want, "group %d of %d rows: %ld rows of MMA work, want %ld", g,
                      r, work[g], want);
    }
    free(mt);
    free(cover);
    free(swapped);
    free(work);
}

START_TEST(test_tile_schedule_swap) {
    /* every size around the widths (16, 32, 64) and the tile boundaries, 256 groups */
    static const int edge[] = {0,   1,   2,   3,   4,   5,   6,   7,   8,   15,  16,  17,  31,
                               32,  33,  63,  64,  65,  127, 128, 129, 144, 145, 191, 192,
                               193, 255, 256, 257, 320, 321, 383, 384, 385};
    const int ne = (int)(sizeof edge / sizeof edge[0]);
    int off[257];
    edge_offsets(off, 256, edge, ne);
    const moe_tile_shape s = {128, 256, 8};
    check_swap(off, 256, 320, s); /* the kernel's tiles; the last n-tile short */
    check_swap(off, 256, 512, s);
    check_swap(off, 256, 136, s);
    const int one[2] = {0, 1}; /* one group of one row */
    check_swap(one, 1, 256, s);
    const int lead_empty[5] = {0, 0, 0, 0, 129};
    check_swap(lead_empty, 4, 64, s);
    /* narrow bands: the swapped tile stays in its group's band slot */
    const moe_tile_shape bands3 = {128, 64, 3};
    check_swap(off, 2 * ne, 200, bands3);
    const moe_tile_shape small = {16, 8, 3}; /* bm / 2 = 8: tails of 1..8 rows, width 16 */
    int off2[41];
    off2[0] = 0;
    for (int g = 0; g < 40; g++)
        off2[g + 1] = off2[g] + (g * 5) % 41;
    for (int N = 1; N <= 30; N++)
        check_swap(off2, 40, N, small);
}
END_TEST

/* The pair slots of the static-mc2 schedule (moe_tile_pair_at_rule): over all slots and
 * both ranks, every (group, m-tile, n-tile) is computed exactly once; a multicast slot's
 * two CTAs share group and n-tile and take m-tiles 2i, 2i + 1 of it; a solo slot's take the
 * group's last m-tile (of an odd count) under n-tiles 2j, 2j + 1; a CTA idles only in the
 * second half of a group's last solo slot when ntn is odd; no slot past ps[G]. */
static void check_pairs(const int *off, int G, int N, moe_tile_shape s) {
    const int ntn = (N + s.bn - 1) / s.bn;
    int *ps = malloc(sizeof(int) * (G + 1)), *mt = malloc(sizeof(int) * (G + 1));
    const int total = moe_tile_pair_prefix_rule(ps, off, G, s.bm, ntn);
    const int mtiles = moe_tile_prefix_rule(mt, off, G, s.bm);
    char *seen = calloc((size_t)(mtiles > 0 ? mtiles : 1) * ntn, 1);
    int idle = 0, want_idle = 0;
    for (int g = 0; g < G; g++)
        want_idle += (mt[g + 1] - mt[g]) % 2 && ntn % 2;
    for (int t = 0; t < total; t++) {
        moe_tile a, b;
        const int ka = moe_tile_pair_at_rule(&a, t, 0, off, ps, G, ntn, s.bm, s.bn, s.band);
        const int kb = moe_tile_pair_at_rule(&b, t, 1, off, ps, G, ntn, s.bm, s.bn, s.band);
        ck_assert(a.g == b.g && a.r0 == off[a.g] && a.r1 == off[a.g + 1]);
        if (ka == MOE_PAIR_MCAST) {
            ck_assert_int_eq(kb, MOE_PAIR_MCAST);
            ck_assert(a.n0 == b.n0 && b.m0 == a.m0 + s.bm && (a.m0 - a.r0) % (2 * s.bm) == 0);
        } else {
            ck_assert_int_eq(ka, MOE_PAIR_SOLO);
            ck_assert(kb == MOE_PAIR_SOLO || kb == MOE_PAIR_IDLE);
            ck_assert(a.m0 == b.m0 && b.n0 == a.n0 + s.bn && a.m0 + s.bm >= a.r1);
            ck_assert_int_eq((mt[a.g + 1] - mt[a.g]) % 2, 1);
            idle += kb == MOE_PAIR_IDLE;
            ck_assert(kb == MOE_PAIR_SOLO || b.n0 >= N);
        }
        for (int r = 0; r < 2; r++) {
            const moe_tile *x = r ? &b : &a;
            if ((r ? kb : ka) == MOE_PAIR_IDLE)
                continue;
            ck_assert(x->m0 >= x->r0 && x->m0 < x->r1 && x->n0 < N);
            const size_t i = (size_t)(mt[x->g] + (x->m0 - x->r0) / s.bm) * ntn + x->n0 / s.bn;
            ck_assert_msg(!seen[i], "tile computed twice");
            seen[i] = 1;
        }
    }
    for (size_t i = 0; i < (size_t)mtiles * ntn; i++)
        ck_assert_msg(seen[i], "tile never computed");
    ck_assert_int_eq(idle, want_idle);
    moe_tile x;
    ck_assert_int_eq(moe_tile_pair_at_rule(&x, total, 0, off, ps, G, ntn, s.bm, s.bn, s.band),
                     MOE_PAIR_NONE);
    free(ps);
    free(mt);
    free(seen);
}

START_TEST(test_tile_schedule_pairs) {
    static const int edge[] = {0,   1,   2,   63,  64,  65,  127, 128, 129, 255, 256,
                               257, 258, 383, 384, 385, 511, 512, 513, 1000, 1025};
    const int ne = (int)(sizeof edge / sizeof edge[0]);
    int off[257];
    edge_offsets(off, 256, edge, ne);
    const moe_tile_shape s = {128, 256, 8};
    for (int N = 256; N <= 1536; N += 256) /* even and odd numbers of n-tiles */
        check_pairs(off, 256, N, s);
    check_pairs(off, 256, 320, s);
    check_pairs(off, 256, 136, s);
    const int one[2] = {0, 1}, lead_empty[5] = {0, 0, 0, 0, 257};
    check_pairs(one, 1, 256, s);
    check_pairs(one, 1, 768, s);
    check_pairs(lead_empty, 4, 512, s);
    const moe_tile_shape small = {16, 8, 4};
    int off2[41];
    off2[0] = 0;
    for (int g = 0; g < 40; g++)
        off2[g + 1] = off2[g] + (g * 7) % 75;
    for (int N = 1; N <= 40; N++)
        check_pairs(off2, 40, N, small);
}
END_TEST

Suite *suite_tile_schedule(void) {
    const TTest *tests[] = {test_tile_schedule_ragged, test_tile_schedule_edge_groups,
                            test_tile_schedule_random, test_tile_schedule_tail_heights,
                            test_tile_schedule_share,  test_tile_schedule_swap,
                            test_tile_schedule_pairs};
    return moe_test_chapter_suite("tile_schedule", "ch03", tests, 7);
}
