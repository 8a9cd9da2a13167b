/*
 * Chapter 03's expert backends on the GPU against their CPU twin (the per-group loop):
 * cuBLAS grouped GEMM (host offsets) and our sm_90a grouped kernel (offsets in device
 * memory), on ragged groups with empty experts, sizes that are not multiples of the tile
 * (128 rows, 128 columns, 64 k) and features that are only multiples of 8 — forward,
 * dgrad and wgrad; then the whole model with each backend against chapter 01's loop.
 * Our kernel runs under each of its nine forward/dgrad tile schedules (moe_grouped_schedule:
 * 128-row tiles only, 64-row tiles for a group's last <= 64 rows, 192-row tiles that
 * compute those rows with the 128 before them (share192), or those rows computed
 * transposed with 16, 32 or 64 token columns (swaptail), each taken statically or
 * claimed from the device counter; and static-mc2, 2-CTA clusters that load a weight
 * block once for two m-tiles), on group sizes around every tile boundary, and with
 * its 192-column tiles on and off. Inputs are rounded to bf16 for both sides (write_act, then read_act back
 * for the CPU); outputs are poisoned first and the accumulating outputs start from random
 * values. Errors are taken group by group (the worst group counts), so that one wrong
 * small group cannot hide in a large tensor's norm.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_ops.h"
#include "helpers.h"
#include "suites.h"
#include "trainer.h"

static double rel(const moe_real *a, const moe_real *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i]))
            return INFINITY;
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return sqrt(num / (den > 0 ? den : 1e-30));
}

/* the worst relative error over the groups' row blocks (group g: rows off[g] .. off[g+1]
 * of a row-major tensor @p cols wide): a wrong one-row group must not hide in the norm of
 * the whole tensor */
static double rel_groups(const moe_real *a, const moe_real *b, const int *off, int G,
                         size_t cols) {
    double worst = 0;
    for (int g = 0; g < G; g++) {
        const size_t n = (size_t)(off[g + 1] - off[g]) * cols;
        const double e = rel(a + (size_t)off[g] * cols, b + (size_t)off[g] * cols, n);
        worst = e > worst ? e : worst;
    }
    return worst;
}

/* Where a tensor differs: the first element (row-major, @p cols wide) that is NaN or off by
 * more than 2e-2·(1 + |ref|) — printed with its group, row, column and both values — and
 * the largest absolute difference, so that a failing GPU run says where to look (a whole
 * tile, one row, the rows past a group's end, a column block). */
static void print_mismatch(const char *what, const moe_real *got, const moe_real *ref,
                           const int *off, int G, size_t cols) {
    const size_t n = (size_t)off[G] * cols;
    size_t first = n, bad = 0;
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        const double diff = fabs((double)got[i] - ref[i]);
        const int wrong = isnan(got[i]) || diff > 2e-2 * (1 + fabs((double)ref[i]));
        if (wrong && first == n)
            first = i;
        bad += wrong;
        if (isnan(got[i]))
            worst = INFINITY;
        else if (diff > worst)
            worst = diff;
    }
    if (first == n) {
        printf("    %s: no element off by more than 2e-2 (max |diff| %.3e)\n", what, worst);
        return;
    }
    const int row = (int)(first / cols);
    int g = 0;
    while (g < G && off[g + 1] <= row)
        g++;
    printf("    %s: %zu of %zu elements wrong; first at row %d (group %d, its row %d of %d), "
           "column %zu: got %g, want %g; max |diff| %.3e\n",
           what, bad, n, row, g, row - off[g], off[g + 1] - off[g], first % cols,
           (double)got[first], (double)ref[first], worst);
}

static int g_split_seen; /* some wgrad below ran split-K */

enum { CUBLAS = -1 };

/* impl: CUBLAS (the cuBLAS grouped GEMM, host offsets), or our kernel (device offsets)
 * under the moe_grouped_schedule impl */
static void check_grouped(const int *sizes, int G, int I, int O, int impl) {
    const moe_grouped_schedule def = moe_cuda_grouped_sm90_schedule();
    if (impl >= 0)
        moe_cuda_grouped_sm90_set_schedule(impl);
    const moe_backend *g = moe_backend_cuda(), *c = moe_backend_cpu();
    int *off = malloc(sizeof(int) * (G + 1));
    off[0] = 0;
    for (int i = 0; i < G; i++)
        off[i + 1] = off[i] + sizes[i];
    const int N = off[G];
    int *doff = g->alloc(sizeof(int) * (G + 1));
    g->from_host(doff, off, sizeof(int) * (G + 1));
    const size_t nin = (size_t)N * I, nout = (size_t)N * O, nw = (size_t)G * O * I;
    moe_real *hin = malloc(sizeof(moe_real) * nin), *hw = malloc(sizeof(moe_real) * nw);
    moe_real *hdo = malloc(sizeof(moe_real) * nout);
    void *din_ = moe_test_upload(g, hin, nin, 41, 1.0);
    void *dw_ = moe_test_upload(g, hw, nw, 42, 0.05);
    void *ddo = moe_test_upload(g, hdo, nout, 43, 1.0);
    /* forward, output poisoned first */
    moe_real *co = malloc(sizeof(moe_real) * nout), *go = malloc(sizeof(moe_real) * nout);
    void *dout = g->alloc(g->act_size * nout);
    moe_test_poison(go, nout);
    g->write_act(dout, go, nout);
    if (impl >= 0)
        g->grouped_matmul_forward_dev(dout, din_, dw_, doff, G, N, I, O);
    else
        g->grouped_matmul_forward(dout, din_, dw_, off, G, I, O);
    c->grouped_matmul_forward(co, hin, hw, off, G, I, O);
    g->read_act(go, dout, nout);
    double ef = rel_groups(go, co, off, G, O);
    if (ef > 1e-2)
        print_mismatch("forward", go, co, off, G, O);
    /* backward into pre-filled accumulators */
    moe_real *cdi = malloc(sizeof(moe_real) * nin), *gdi = malloc(sizeof(moe_real) * nin);
    moe_real *cdw = malloc(sizeof(moe_real) * nw), *gdw = malloc(sizeof(moe_real) * nw);
    void *ddi = moe_test_upload(g, cdi, nin, 44, 0.1);
    moe_test_randn(cdw, nw, 45, 0.1);
    moe_real *ddw = g->alloc(sizeof(moe_real) * nw);
    g->from_host(ddw, cdw, sizeof(moe_real) * nw);
    if (impl >= 0)
        g->grouped_matmul_backward_dev(ddi, ddw, ddo, din_, dw_, doff, G, N, I, O, 1,
                                       MOE_DW_ACCUMULATE);
    else
        g->grouped_matmul_backward(ddi, ddw, ddo, din_, dw_, off, G, I, O);
    c->grouped_matmul_backward(cdi, cdw, hdo, hin, hw, off, G, I, O);
    g->read_act(gdi, ddi, nin);
    g->to_host(gdw, ddw, sizeof(moe_real) * nw);
    double ed = rel_groups(gdi, cdi, off, G, I), ew = rel(gdw, cdw, nw), eo = 0, es = 0, ea = 0;
    if (ed > 1e-2)
        print_mismatch("dgrad (accumulating)", gdi, cdi, off, G, I);
    int split = 1;
    if (impl >= 0) { /* dgrad into a fresh (poisoned) buffer: overwritten, not added to */
        moe_test_poison(gdi, nin);
        g->write_act(ddi, gdi, nin);
        g->grouped_matmul_backward_dev(ddi, NULL, ddo, din_, dw_, doff, G, N, I, O, 0,
                                       MOE_DW_ACCUMULATE);
        memset(cdi, 0, sizeof(moe_real) * nin);
        c->grouped_matmul_backward(cdi, NULL, hdo, hin, hw, off, G, I, O);
        g->read_act(gdi, ddi, nin);
        eo = rel_groups(gdi, cdi, off, G, I);
        if (eo > 1e-2)
            print_mismatch("dgrad (overwriting)", gdi, cdi, off, G, I);
        /* wgrad into a poisoned buffer: MOE_DW_STORE (fp32) and MOE_DW_ACT (bf16) must
         * overwrite every group's block, an empty group's (zeros) included; the CPU twin
         * of both is the sum from zero */
        split = moe_cuda_grouped_sm90_wgrad_split(G, N, I, O);
        c->grouped_matmul_backward_dev(NULL, cdw, hdo, hin, hw, off, G, N, I, O, 0,
                                       MOE_DW_STORE);
        moe_test_poison(gdw, nw);
        g->from_host(ddw, gdw, sizeof(moe_real) * nw);
        g->grouped_matmul_backward_dev(NULL, ddw, ddo, din_, dw_, doff, G, N, I, O, 0,
                                       MOE_DW_STORE);
        g->to_host(gdw, ddw, sizeof(moe_real) * nw);
        es = rel(gdw, cdw, nw);
        void *dwa = g->alloc(g->act_size * nw);
        moe_test_poison(gdw, nw);
        g->write_act(dwa, gdw, nw);
        g->grouped_matmul_backward_dev(NULL, dwa, ddo, din_, dw_, doff, G, N, I, O, 0,
                                       MOE_DW_ACT);
        g->read_act(gdw, dwa, nw);
        ea = rel(gdw, cdw, nw);
        g->free(dwa);
    }
    moe_cuda_grouped_sm90_set_schedule(def);
    printf("  %s%s G=%d N=%d I=%d O=%d: forward %.2e, dgrad %.2e (overwriting %.2e; worst "
           "group), wgrad %.2e (store %.2e, bf16 %.2e; split %d)\n",
           impl < 0 ? "cublas" : "kernel/",
           impl < 0 ? "" : moe_cuda_grouped_sm90_schedule_name(impl), G, N, I, O, ef, ed, eo,
           ew, es, ea, split);
    ck_assert_msg(ef <= 1e-2 && ed <= 1e-2 && eo <= 1e-2 && ew <= 1e-4 && es <= 1e-4 &&
                      ea <= 1e-2,
                  "grouped GEMM differs from the loop");
    if (split > 1)
        g_split_seen = 1;
    g->free(doff); g->free(din_); g->free(dw_); g->free(ddo); g->free(dout); g->free(ddi); g->free(ddw);
    free(off); free(hin); free(hw); free(hdo); free(co); free(go); free(cdi); free(gdi);
    free(cdw); free(gdw);
}

static void check_both(const int *sizes, int G, int I, int O) {
    check_grouped(sizes, G, I, O, CUBLAS);
    check_grouped(sizes, G, I, O, moe_cuda_grouped_sm90_schedule()); /* the default */
}

START_TEST(test_gpu_grouped_matmul) {
    const int ragged[8] = {0, 37, 1, 128, 0, 300, 5, 64};
    check_both(ragged, 8, 96, 160);
    check_both(ragged, 8, 136, 40); /* features: multiples of 8, not of 64 */
    int big[16];
    for (int i = 0; i < 16; i++)
        big[i] = i % 5 == 0 ? 0 : 200 + 37 * i;
    check_both(big, 16, 512, 768);
    const int one[1] = {1000}; /* one group; rows not a multiple of the tile */
    check_both(one, 1, 256, 264);
    /* many small experts, ragged around the 64-row k-step and the 128-row tile */
    int many[128];
    for (int i = 0; i < 128; i++)
        many[i] = (i * 53) % 200;
    check_both(many, 128, 256, 192);
    const int lead_empty[4] = {0, 0, 0, 129}; /* everything on the last group */
    check_both(lead_empty, 4, 64, 128);
}
END_TEST

/* The wgrad modes and split-K on the shapes the fine-grained regime produces: 256 groups
 * of 0, 1, 1-8 rows and sizes around every tile boundary (the 64-row k-step, the 128-row
 * tile); and few, long groups on a small dw, where wgrad splits its k-loop (an empty
 * group, a 1-row group and a group shorter than a chunk among them, so chunks without
 * rows store zeros). Each runs accumulate, store (fp32) and bf16, dw poisoned first. */
static const int g_wgrad_edges[] = {0,   1,   2,   3,   4,   5,   6,   7,   8,   63,  64,  65,
                                    127, 128, 129, 191, 192, 193, 255, 256, 257, 511, 512, 513};
#define N_WGRAD_EDGES ((int)(sizeof g_wgrad_edges / sizeof g_wgrad_edges[0]))

/* 256 groups of the edge sizes, taken in steps of @p step through the list (coprime with its
 * 24 entries, so each size appears about equally often, in a different order per test) */
static void wgrad_edge_groups(int fine[256], int step) {
    for (int i = 0; i < 256; i++)
        fine[i] = g_wgrad_edges[(i * step) % N_WGRAD_EDGES];
}

START_TEST(test_gpu_grouped_wgrad_modes) {
    int fine[256];
    wgrad_edge_groups(fine, 7);
    check_both(fine, 256, 136, 264);
    const int few[6] = {0, 700, 1, 2000, 63, 900};
    check_both(few, 6, 256, 128);
    const int two[2] = {3000, 5000};
    check_both(two, 2, 128, 136);
    const int one[1] = {4097};
    check_both(one, 1, 64, 64);
    if (moe_cuda_grouped_sm90_available())
        ck_assert_msg(g_split_seen, "no shape of this test ran the split-K wgrad");
}
END_TEST

/* The wgrad's L2 prefetch of dw before its reduce-add (moe_cuda_wgrad_set_prefetch): a
 * hint, so with it on the accumulating wgrad must still equal the CPU twin — on the
 * fine-grained shapes (256 groups of 0 .. 513 rows, the prefetch at a tile's first k-step),
 * on long groups whose k-loop exceeds the prefetch lead (up to 755 rows: 12 k-steps; 2,000
 * rows: 32), and on a small dw that splits the k-loop (its chunks store: no prefetch) —
 * by TMA in the 128 × 256 kernel and in the ping-pong one, and by the consumers' prefetch
 * instructions; the launch counter proves that the prefetching kernels ran. */
START_TEST(test_gpu_grouped_wgrad_prefetch) {
    const int was = moe_cuda_wgrad_prefetch();
    moe_cuda_wgrad_set_prefetch(1);
    const long long before = moe_cuda_wgrad_prefetch_launches();
    const int pp = moe_cuda_grouped_sm90_wgrad_pingpong();
    int fine[256], big[16];
    wgrad_edge_groups(fine, 5);
    for (int i = 0; i < 16; i++)
        big[i] = i % 5 == 0 ? 0 : 200 + 37 * i;
    const int few[6] = {0, 700, 1, 2000, 63, 900};
    for (int run = 0; run < 3; run++) {
        /* by TMA in the 128 × 256 kernel, in the ping-pong one, then by the consumers'
         * prefetch instructions (the 128 × 256 kernel) */
        moe_cuda_wgrad_set_prefetch(run < 2 ? 1 : 2);
        moe_cuda_grouped_sm90_set_wgrad_pingpong(run == 1);
        check_both(fine, 256, 136, 264);
        check_both(big, 16, 512, 768);
        check_both(few, 6, 256, 128);
    }
    moe_cuda_grouped_sm90_set_wgrad_pingpong(pp);
    const long long ran = moe_cuda_wgrad_prefetch_launches() - before;
    moe_cuda_wgrad_set_prefetch(was);
    printf("  wgrad with dw prefetched: %lld launches\n", ran);
    if (moe_cuda_grouped_sm90_available()) /* (elsewhere the cuBLAS fallback runs) */
        ck_assert_msg(ran >= 6, "the wgrad's dw prefetch did not run");
}
END_TEST

/* The adding wgrad's epilogues (moe_cuda_wgrad_set_epilogue): every tile by read + add +
 * write from registers (RMW), every tile by TMA's reduce-add, and auto (RMW for tiles of at
 * most 1024 rows, TMA for longer ones, chosen per tile), each against the loop in
 * check_grouped's three modes (only the adding one takes RMW; the others must be unchanged),
 * on the edge sizes with features cut at both edges (I = 136, O = 264: columns past N and a
 * second 64-row half wholly past O, which RMW must not touch), and on groups of up to 2255
 * rows (both kinds of tile under auto); then RMW against TMA bit for bit (rmw_tma_differ). */
/* RMW and TMA must add the same bits (one fp32 addition per element either way): the adding
 * wgrad run twice on the same inputs from the same starting dw, by TMA then by RMW, compared
 * bit for bit. Returns the number of elements that differ (0 where our kernel is absent). */
static size_t rmw_tma_differ(const int *sizes, int G, int I, int O) {
    if (!moe_cuda_grouped_sm90_available())
        return 0;
    const moe_backend *g = moe_backend_cuda();
    int *off = malloc(sizeof(int) * (G + 1));
    off[0] = 0;
    for (int i = 0; i < G; i++)
        off[i + 1] = off[i] + sizes[i];
    const int N = off[G];
    const size_t nin = (size_t)N * I, nout = (size_t)N * O, nw = (size_t)G * O * I;
    int *doff = g->alloc(sizeof(int) * (G + 1));
    g->from_host(doff, off, sizeof(int) * (G + 1));
    moe_real *hin = malloc(sizeof(moe_real) * nin), *hdo = malloc(sizeof(moe_real) * nout);
    moe_real *start = malloc(sizeof(moe_real) * nw), *got[2];
    void *din_ = moe_test_upload(g, hin, nin, 51, 1.0);
    void *ddo = moe_test_upload(g, hdo, nout, 53, 1.0);
    moe_test_randn(start, nw, 55, 0.1);
    moe_real *ddw = g->alloc(sizeof(moe_real) * nw);
    for (int e = 0; e < 2; e++) {
        moe_cuda_wgrad_set_epilogue(e ? MOE_WGRAD_EPI_RMW : MOE_WGRAD_EPI_TMA);
        g->from_host(ddw, start, sizeof(moe_real) * nw);
        moe_cuda_grouped_sm90_backward(NULL, ddw, ddo, din_, NULL, doff, G, N, I, O, 0,
                                       MOE_DW_ACCUMULATE);
        got[e] = malloc(sizeof(moe_real) * nw);
        g->to_host(got[e], ddw, sizeof(moe_real) * nw);
    }
    size_t differ = 0;
    for (size_t i = 0; i < nw; i++)
        differ += memcmp(&got[0][i], &got[1][i], sizeof(moe_real)) != 0;
    printf("  wgrad adding, RMW against TMA, G=%d I=%d O=%d: %zu of %zu elements differ\n", G,
           I, O, differ, nw);
    g->free(doff), g->free(din_), g->free(ddo), g->free(ddw);
    free(off), free(hin), free(hdo), free(start), free(got[0]), free(got[1]);
    return differ;
}

START_TEST(test_gpu_grouped_wgrad_epilogue) {
    const moe_wgrad_epi was = moe_cuda_wgrad_epilogue();
    int fine[256], big[16];
    wgrad_edge_groups(fine, 11);
    for (int i = 0; i < 16; i++)
        big[i] = i % 5 == 0 ? 0 : 200 + 137 * i;
    static const moe_wgrad_epi epis[3] = {MOE_WGRAD_EPI_RMW, MOE_WGRAD_EPI_TMA,
                                          MOE_WGRAD_EPI_AUTO};
    static const char *const names[3] = {"RMW", "TMA", "auto"};
    for (int run = 0; run < 3; run++) {
        moe_cuda_wgrad_set_epilogue(epis[run]);
        printf("  (wgrad adding by %s)\n", names[run]);
        check_both(fine, 256, 136, 264);
        check_both(big, 16, 512, 768);
    }
    const size_t differ = rmw_tma_differ(fine, 256, 136, 264) + rmw_tma_differ(big, 16, 512, 768);
    moe_cuda_wgrad_set_epilogue(was);
    ck_assert_msg(differ == 0, "the RMW epilogue's dw differs from TMA's in %zu elements", differ);
}
END_TEST

/* The ping-pong wgrad (kernels/grouped_wgrad_pingpong_sm90.cu: each consumer warpgroup a
 * whole 128 × 128 tile, the two taking turns in the main loop), switched on for this test:
 * check_grouped's three wgrad modes — reduce-added into a random dw, stored into a
 * poisoned fp32 dw and into a poisoned bf16 dw (an empty group's block must come out
 * zero) — against the CPU twin, on 256 groups of the edge sizes (0, 1-8 rows, around
 * 64 / 128 / 256 / 512: ragged last k-steps whose next group's rows must be zeroed, empty
 * tiles that still take their turn) with features that are multiples of 8 but not of 128
 * (I = 136, O = 264: tiles cut at both edges, a second 64-row half wholly past O) and of
 * 128; few long groups (more k-steps than stages); one group of a few tiles (CTAs of one
 * tile: the second warpgroup has none) and of one row. A wrong ordering barrier hangs
 * here; a wrong ring position or parity shows as a mismatch. Wherever the wgrad is not
 * split (moe_cuda_grouped_sm90_wgrad_split() == 1) each check must launch the kernel three
 * times, once per mode (the counter): split shapes keep the 128 × 256 kernel. */
START_TEST(test_gpu_grouped_wgrad_pingpong) {
    const int def = moe_cuda_grouped_sm90_wgrad_pingpong();
    moe_cuda_grouped_sm90_set_wgrad_pingpong(1);
    int fine[256];
    wgrad_edge_groups(fine, 7);
    const int few[6] = {0, 700, 1, 2000, 63, 900}, one[1] = {200}, row[1] = {1};
    struct {
        const int *sizes;
        int G, I, O;
    } cases[] = {{fine, 256, 136, 264}, {fine, 256, 256, 384}, {fine, 256, 384, 128},
                 {few, 6, 1024, 520},   {one, 1, 256, 264},    {row, 1, 128, 128}};
    const int n = (int)(sizeof cases / sizeof cases[0]);
    int ran = 0, unsplit = 0;
    printf("  (wgrad ping-pong on)\n");
    for (int i = 0; i < n; i++) {
        int rows = 0;
        for (int g = 0; g < cases[i].G; g++)
            rows += cases[i].sizes[g];
        const int split = moe_cuda_grouped_sm90_wgrad_split(cases[i].G, rows, cases[i].I,
                                                            cases[i].O);
        const int before = moe_cuda_grouped_sm90_wgrad_pingpong_launches();
        check_grouped(cases[i].sizes, cases[i].G, cases[i].I, cases[i].O,
                      MOE_GROUPED_SCHED_STATIC);
        const int launched = moe_cuda_grouped_sm90_wgrad_pingpong_launches() - before;
        printf("    ping-pong launches: %d (split %d)\n", launched, split);
        if (moe_cuda_grouped_sm90_available()) /* (elsewhere the cuBLAS fallback runs) */
            ck_assert_msg(launched == (split == 1 ? 3 : 0),
                          "the ping-pong wgrad launched %d times, want %d (G=%d I=%d O=%d)",
                          launched, split == 1 ? 3 : 0, cases[i].G, cases[i].I, cases[i].O);
        ran += launched;
        unsplit += split == 1;
    }
    moe_cuda_grouped_sm90_set_wgrad_pingpong(def);
    if (moe_cuda_grouped_sm90_available())
        ck_assert_msg(ran >= 3 * 4 && unsplit >= 4,
                      "the ping-pong wgrad ran on too few shapes (%d launches, %d unsplit)", ran,
                      unsplit);
}
END_TEST

/* every group size where the tile shape changes: 0, 1-8 rows, and one below, at and above
 * each multiple of 64 up to 321 (a group's last m-tile is 64 rows when it holds <= 64; a
 * group of 128·q + 1 .. 128·q + 64 rows, q >= 1, ends in 192-row sharing tiles) */
static const int g_edges[] = {0,   1,   2,   3,   4,   5,   6,   7,   8,   63,  64,  65,  127, 128,
                              129, 130, 191, 192, 193, 255, 256, 257, 258, 260, 319, 320, 321,
                              0,   1};
#define N_EDGES ((int)(sizeof g_edges / sizeof g_edges[0]))

static void check_schedules(const int *sizes, int G, int I, int O) {
    for (int s = MOE_GROUPED_SCHED_STATIC; s < MOE_GROUPED_SCHED_COUNT; s++)
        check_grouped(sizes, G, I, O, s);
}

START_TEST(test_gpu_grouped_fine_tiles) {
    /* N = 320: the second n-tile of a 64-row tile has valid columns only in warpgroup 0's
     * half, and the forward's sharing tiles (128 columns) are 128, 128 and 64 wide, one
     * slot left without work; K = 200 ends inside a k-step; dgrad's N = 200 < 256
     * (sharing tiles of 128 and 72 columns) */
    check_schedules(g_edges, N_EDGES, 200, 320);
    /* N a multiple of 256, so both warpgroups of a 64-row tile store full TMA pieces, and
     * every slot of a sharing group holds a sharing tile */
    check_schedules(g_edges, N_EDGES, 256, 512);
    /* 256 groups (the most the kernel takes): the edge sizes, shifted so that the groups
     * start at every residue, with runs of empty and one-row groups */
    int many[256];
    for (int i = 0; i < 256; i++)
        many[i] = i % 32 >= 28 ? i % 2 : g_edges[i % N_EDGES] + (i / N_EDGES) % 3;
    check_schedules(many, 256, 136, 264);
    check_grouped(many, 256, 136, 264, CUBLAS);
}
END_TEST

/* The swapped tail tiles (swaptail: a group's last 1..64 rows computed transposed, with 16,
 * 32 or 64 token columns chosen on the device from the offsets): under both swaptail
 * schedules, forward, dgrad accumulating and dgrad overwriting (outputs poisoned first, the
 * first mismatch printed) against the per-expert loop, on every size around the token
 * widths and the tile boundaries — empty groups, 1 row, 1-8 rows, 15-17, 31-33, 63-65,
 * 127-129, 143-145, 191-193, 255-257 — as a few groups and as 256 groups starting at every
 * residue; N = 320 (the last n-tile's second warpgroup and second half have no columns),
 * N = 136 and 200 (not multiples of 64: 16-byte chunks past the end), N = 512 (every
 * column block full), K ending inside a k-step. The wgrad (not affected: its tiles do not
 * change) rides along in check_grouped. */
static const int g_swap_edges[] = {0,  1,  2,   3,   4,   5,   6,   7,   8,   15,  16,
                                   17, 31, 32,  33,  63,  64,  65,  127, 128, 129, 143,
                                   144, 145, 191, 192, 193, 255, 256, 257, 0,   1};
#define N_SWAP_EDGES ((int)(sizeof g_swap_edges / sizeof g_swap_edges[0]))

START_TEST(test_gpu_grouped_swaptail) {
    const int one[1] = {1}, two[2] = {1, 0}, few[4] = {5, 0, 257, 64};
    int many[256];
    for (int i = 0; i < 256; i++)
        many[i] = i % 32 >= 28 ? i % 2 : g_swap_edges[(i * 7) % N_SWAP_EDGES] + (i / 64) % 3;
    const int scheds[2] = {MOE_GROUPED_SCHED_STATIC_SWAPTAIL, MOE_GROUPED_SCHED_DYNAMIC_SWAPTAIL};
    for (int k = 0; k < 2; k++) {
        const int sc = scheds[k];
        check_grouped(one, 1, 64, 256, sc);   /* one row: a 16-column swapped tile */
        check_grouped(two, 2, 136, 136, sc);
        check_grouped(few, 4, 200, 320, sc);
        check_grouped(g_swap_edges, N_SWAP_EDGES, 200, 320, sc);
        check_grouped(g_swap_edges, N_SWAP_EDGES, 256, 512, sc);
        check_grouped(g_swap_edges, N_SWAP_EDGES, 320, 136, sc);
        check_grouped(many, 256, 136, 264, sc);
        check_grouped(many, 256, 264, 200, sc);
    }
}
END_TEST

/* static-mc2 (2-CTA clusters; kernels/grouped_gemm_sm90.cu, moe_tile_pair_at_rule): forward,
 * dgrad accumulating and overwriting against the per-expert loop (outputs poisoned first),
 * on groups with an even and an odd number of m-tiles (pairs, and the last m-tile of an
 * odd count computed under two n-tiles), empty groups, 1 row, sizes around 128 and 256,
 * and 256 groups; with an even and an odd number of n-tiles (an odd one leaves the second
 * CTA of a group's last solo slot idle: it must keep the cluster's pipeline in step and
 * write nothing — a wrong barrier count hangs here, a write shows as a mismatch); N not a
 * multiple of 64 and K ending inside a k-step. The launch counter proves the cluster kernel
 * ran (a gathering input, a scatter, or narrow tiles would not run it). */
static const int g_mc_edges[] = {0,   1,   127, 128, 129, 255, 256, 257, 258, 383, 384,
                                 385, 511, 512, 513, 640, 0,   1,   64,  1000};
#define N_MC_EDGES ((int)(sizeof g_mc_edges / sizeof g_mc_edges[0]))

START_TEST(test_gpu_grouped_mc2) {
    const int sc = MOE_GROUPED_SCHED_STATIC_MC2;
    const int one[1] = {1}, two[2] = {257, 0}, pair[1] = {256}, three[3] = {385, 129, 1};
    int many[256];
    for (int i = 0; i < 256; i++)
        many[i] = i % 32 >= 28 ? i % 2 : g_mc_edges[(i * 7) % N_MC_EDGES] + (i / 64) % 3;
    const int before = moe_cuda_grouped_sm90_mc_launches();
    check_grouped(one, 1, 64, 256, sc);      /* one n-tile: the solo slot's partner idles */
    check_grouped(pair, 1, 256, 512, sc);    /* one pair, two n-tiles */
    check_grouped(two, 2, 136, 136, sc);     /* three m-tiles, one n-tile either way */
    check_grouped(three, 3, 200, 320, sc);   /* odd m-tile counts, N ends inside a tile */
    check_grouped(g_mc_edges, N_MC_EDGES, 200, 320, sc);
    check_grouped(g_mc_edges, N_MC_EDGES, 256, 512, sc);
    check_grouped(g_mc_edges, N_MC_EDGES, 320, 768, sc); /* 3 n-tiles forward, 2 dgrad */
    check_grouped(many, 256, 136, 264, sc);
    check_grouped(many, 256, 264, 200, sc);
    const int ran = moe_cuda_grouped_sm90_mc_launches() - before;
    printf("  static-mc2: %d cluster launches\n", ran);
    if (moe_cuda_grouped_sm90_available()) /* (elsewhere the cuBLAS fallback runs) */
        ck_assert_msg(ran >= 3 * 9, "the static-mc2 kernels did not run");
}
END_TEST

/* Narrow tiles (128 × 192, where 192 divides N with less padding than 256; on by default):
 * the shapes where they apply, under both plain schedules (the 64-row and sharing tiles
 * keep 256 columns), with them on and then off, each against the loop: N = 384 (the GPU
 * preset's hidden size: fc2's forward, fc1's dgrad, and a wgrad whose dw has 384
 * columns), N = 576 (three narrow tiles) and N = 200 (one, with ragged columns), K ending
 * inside a k-step, on the edge group sizes and on 256 groups. */
START_TEST(test_gpu_grouped_narrow_tiles) {
    const int def = moe_cuda_grouped_sm90_narrow();
    int many[256];
    for (int i = 0; i < 256; i++)
        many[i] = i % 32 >= 28 ? i % 2 : g_edges[i % N_EDGES] + (i / N_EDGES) % 3;
    for (int on = 1; on >= 0; on--) {
        moe_cuda_grouped_sm90_set_narrow(on);
        printf("  (narrow tiles %s)\n", on ? "on" : "off");
        for (int s = MOE_GROUPED_SCHED_STATIC; s <= MOE_GROUPED_SCHED_DYNAMIC; s += 2) {
            check_grouped(g_edges, N_EDGES, 384, 576, s);
            check_grouped(g_edges, N_EDGES, 576, 384, s);
        }
        check_grouped(many, 256, 200, 384, MOE_GROUPED_SCHED_STATIC);
        check_grouped(many, 256, 384, 200, MOE_GROUPED_SCHED_STATIC);
    }
    moe_cuda_grouped_sm90_set_narrow(def);
}
END_TEST

/* The fused permutation: the grouped GEMM whose input row r is token map[r] / k (the
 * permutation's perm_src, here a random one over T·k assignments, some unused) equals
 * permute + GEMM on the GPU (the same kernel on the permuted copy: equal up to the sign of
 * a zero) and the CPU's gather variant: forward into a poisoned output, and wgrad (where
 * the gathered rows are the MN-major B) stored fp32 and bf16 into poisoned buffers. */
static void check_gather(const int *sizes, int G, int I, int O) {
    const moe_backend *g = moe_backend_cuda(), *c = moe_backend_cpu();
    const int k = 4;
    int *off = malloc(sizeof(int) * (G + 1));
    off[0] = 0;
    for (int i = 0; i < G; i++)
        off[i + 1] = off[i] + sizes[i];
    const int R = off[G], T = R / k + 3, A = T * k;
    int *map = malloc(sizeof(int) * A);
    for (int a = 0; a < A; a++)
        map[a] = a;
    uint64_t st = 0x9e3779b97f4a7c15ull;
    for (int a = A - 1; a > 0; a--) { /* Fisher-Yates: a random permutation */
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        const int j = (int)((st >> 33) % (uint64_t)(a + 1)), t = map[a];
        map[a] = map[j];
        map[j] = t;
    }
    int *doff = g->alloc(sizeof(int) * (G + 1)), *dmap = g->alloc(sizeof(int) * A);
    g->from_host(doff, off, sizeof(int) * (G + 1));
    g->from_host(dmap, map, sizeof(int) * A);
    const size_t nx = (size_t)T * I, nout = (size_t)R * O, nw = (size_t)G * O * I;
    moe_real *hx = malloc(sizeof(moe_real) * nx), *hw = malloc(sizeof(moe_real) * nw);
    moe_real *hdo = malloc(sizeof(moe_real) * (nout + 1));
    void *dx = moe_test_upload(g, hx, nx, 51, 1.0);
    void *dw_ = moe_test_upload(g, hw, nw, 52, 0.05);
    void *ddo = moe_test_upload(g, hdo, nout, 53, 1.0);
    void *dxp = g->alloc(g->act_size * ((size_t)R * I + 1)); /* the permuted copy */
    g->permute_tokens(dxp, dx, dmap, R, k, I);
    /* forward: fused, permute + GEMM, CPU gather */
    moe_real *a = malloc(sizeof(moe_real) * (nout + nw)), *b = malloc(sizeof(moe_real) * (nout + nw));
    moe_real *cr = malloc(sizeof(moe_real) * (nout + nw));
    void *dy = g->alloc(g->act_size * (nout + 1));
    moe_test_poison(a, nout);
    g->write_act(dy, a, nout);
    g->grouped_matmul_forward_dev_gather(dy, dx, dmap, k, dw_, doff, G, R, I, O);
    g->read_act(a, dy, nout);
    g->grouped_matmul_forward_dev(dy, dxp, dw_, doff, G, R, I, O);
    g->read_act(b, dy, nout);
    c->grouped_matmul_forward_dev_gather(cr, hx, map, k, hw, off, G, R, I, O);
    const double ff = rel_groups(a, b, off, G, O), fc = rel_groups(a, cr, off, G, O);
    /* wgrad, overwriting: fp32 and bf16 */
    double wf[2], wc[2];
    for (int m = 0; m < 2; m++) {
        const moe_dw_mode mode = m ? MOE_DW_ACT : MOE_DW_STORE;
        void *ddw = g->alloc(sizeof(moe_real) * nw);
        moe_real *outs[2] = {a, b};
        for (int v = 0; v < 2; v++) {
            moe_test_poison(outs[v], nw);
            if (m)
                g->write_act(ddw, outs[v], nw);
            else
                g->from_host(ddw, outs[v], sizeof(moe_real) * nw);
            if (v)
                g->grouped_matmul_backward_dev(NULL, ddw, ddo, dxp, dw_, doff, G, R, I, O, 0, mode);
            else
                g->grouped_matmul_backward_dev_gather(NULL, ddw, ddo, dx, dmap, k, dw_, doff, G,
                                                      R, I, O, 0, mode);
            if (m)
                g->read_act(outs[v], ddw, nw);
            else
                g->to_host(outs[v], ddw, sizeof(moe_real) * nw);
        }
        c->grouped_matmul_backward_dev_gather(NULL, cr, hdo, hx, map, k, hw, off, G, R, I, O, 0,
                                              MOE_DW_STORE);
        wf[m] = rel(a, b, nw);
        wc[m] = rel(a, cr, nw);
        g->free(ddw);
    }
    printf("  gather G=%d rows=%d I=%d O=%d: forward vs permute+GEMM %.2e, vs CPU %.2e; wgrad "
           "fp32 %.2e / %.2e, bf16 %.2e / %.2e (split %d)\n",
           G, R, I, O, ff, fc, wf[0], wc[0], wf[1], wc[1],
           moe_cuda_grouped_sm90_wgrad_split(G, R, I, O));
    ck_assert_msg(ff <= 1e-6 && wf[0] <= 1e-6 && wf[1] <= 1e-6,
                  "the fused gather differs from permute + GEMM");
    ck_assert_msg(fc <= 1e-2 && wc[0] <= 1e-4 && wc[1] <= 1e-2,
                  "the fused gather differs from the CPU reference");
    g->free(doff); g->free(dmap); g->free(dx); g->free(dw_); g->free(ddo); g->free(dxp);
    g->free(dy);
    free(off); free(map); free(hx); free(hw); free(hdo); free(a); free(b); free(cr);
}

START_TEST(test_gpu_grouped_gather) {
    /* ragged: empty groups, one row, sizes around the 64-row k-step and the 128-row tile;
     * K = 200 and N = 136 end inside a k-step and a column box */
    check_gather(g_edges, N_EDGES, 200, 320);
    const int few[3] = {0, 2000, 900}; /* long groups on a small dw: wgrad splits its k-loop */
    check_gather(few, 3, 128, 136);
    int many[256]; /* 256 groups, under every forward schedule (the gathering producer
                      broadcasts a claimed tile to its 32 lanes) */
    for (int i = 0; i < 256; i++)
        many[i] = i % 32 >= 28 ? i % 2 : g_edges[i % N_EDGES] + (i / N_EDGES) % 3;
    const moe_grouped_schedule def = moe_cuda_grouped_sm90_schedule();
    for (int sc = MOE_GROUPED_SCHED_STATIC; sc < MOE_GROUPED_SCHED_COUNT; sc++) {
        moe_cuda_grouped_sm90_set_schedule((moe_grouped_schedule)sc);
        printf("  (schedule %s)\n", moe_cuda_grouped_sm90_schedule_name(sc));
        check_gather(many, 256, 136, 264);
    }
    moe_cuda_grouped_sm90_set_schedule(def);
}
END_TEST

/* The fused permutation's other half: the grouped forward whose output row r is stored at
 * row map[r] (the permutation's perm_src over T·k slots, some slots unused) equals the plain
 * forward's row r BIT FOR BIT (the same kernel, only the stores differ), every unused slot
 * keeps its poison (no stray row), and the CPU twin agrees; then the combine over the slot
 * rows (unpermute_sum_slots) equals today's unpermute_sum over the permuted rows bit for
 * bit, from the same random start (the same bf16 values summed in the same order). */
static void check_scatter(const int *sizes, int G, int I, int O) {
    const moe_backend *g = moe_backend_cuda(), *c = moe_backend_cpu();
    const int k = 4;
    int *off = malloc(sizeof(int) * (G + 1));
    off[0] = 0;
    for (int i = 0; i < G; i++)
        off[i + 1] = off[i] + sizes[i];
    const int R = off[G], T = R / k + 3, A = T * k;
    int *map = malloc(sizeof(int) * A), *row_of = malloc(sizeof(int) * A);
    for (int a = 0; a < A; a++)
        map[a] = a;
    uint64_t st = 0x2545f4914f6cdd1dull;
    for (int a = A - 1; a > 0; a--) { /* Fisher-Yates: a random permutation */
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        const int j = (int)((st >> 33) % (uint64_t)(a + 1)), t = map[a];
        map[a] = map[j];
        map[j] = t;
    }
    for (int a = 0; a < A; a++)
        row_of[a] = -1; /* a slot no row goes to: skipped by both combines */
    for (int r = 0; r < R; r++)
        row_of[map[r]] = r;
    int *doff = g->alloc(sizeof(int) * (G + 1)), *dmap = g->alloc(sizeof(int) * A);
    int *drow = g->alloc(sizeof(int) * A);
    g->from_host(doff, off, sizeof(int) * (G + 1));
    g->from_host(dmap, map, sizeof(int) * A);
    g->from_host(drow, row_of, sizeof(int) * A);
    const size_t nin = (size_t)R * I, nw = (size_t)G * O * I, nys = (size_t)A * O;
    moe_real *hin = malloc(sizeof(moe_real) * (nin + 1)), *hw = malloc(sizeof(moe_real) * nw);
    void *din = moe_test_upload(g, hin, nin, 61, 1.0);
    void *dw_ = moe_test_upload(g, hw, nw, 62, 0.05);
    moe_real *ys = malloc(sizeof(moe_real) * (nys + 1)), *yp = malloc(sizeof(moe_real) * (nys + 1));
    moe_real *cr = malloc(sizeof(moe_real) * (nys + 1));
    void *dys = g->alloc(g->act_size * (nys + 1)), *dyp = g->alloc(g->act_size * (nys + 1));
    moe_test_poison(ys, nys);
    g->write_act(dys, ys, nys);
    g->grouped_matmul_forward_dev_scatter(dys, din, dmap, dw_, doff, G, R, I, O);
    g->read_act(ys, dys, nys);
    g->grouped_matmul_forward_dev(dyp, din, dw_, doff, G, R, I, O);
    g->read_act(yp, dyp, (size_t)R * O);
    moe_test_poison(cr, nys);
    c->grouped_matmul_forward_dev_scatter(cr, hin, map, hw, off, G, R, I, O);
    long bad = 0, first = -1, stray = 0;
    double num = 0, den = 0;
    for (int a = 0; a < A; a++)
        for (int o = 0; o < O; o++) {
            const size_t at = (size_t)a * O + o;
            if (row_of[a] < 0) { /* an unused slot: still poisoned */
                stray += !isnan(ys[at]);
                continue;
            }
            const moe_real want = yp[(size_t)row_of[a] * O + o];
            if (!(ys[at] == want) && bad++ == 0)
                first = (long)at;
            num += ((double)ys[at] - cr[at]) * ((double)ys[at] - cr[at]);
            den += (double)cr[at] * cr[at];
        }
    if (first >= 0)
        printf("  scatter: first mismatch at slot %ld col %ld (permuted row %d): %g, plain "
               "forward %g\n", first / O, first % O, row_of[first / O], ys[first],
               yp[(size_t)row_of[first / O] * O + first % O]);
    const double ec = sqrt(num / (den > 0 ? den : 1e-30));
    /* the combine: today's over the permuted rows vs the slots', from one random start */
    const size_t nout = (size_t)T * O;
    moe_real *o1 = malloc(sizeof(moe_real) * (nout + 1)), *o2 = malloc(sizeof(moe_real) * (nout + 1));
    void *dout1 = moe_test_upload(g, o1, nout, 63, 1.0);
    void *dout2 = g->alloc(g->act_size * (nout + 1));
    g->write_act(dout2, o1, nout);
    g->unpermute_sum(dout1, dyp, drow, T, k, O);
    g->unpermute_sum_slots(dout2, dys, drow, T, k, O);
    g->read_act(o1, dout1, nout);
    g->read_act(o2, dout2, nout);
    long cbad = 0, cfirst = -1;
    for (size_t i = 0; i < nout; i++)
        if (!(o1[i] == o2[i]) && cbad++ == 0)
            cfirst = (long)i;
    if (cfirst >= 0)
        printf("  combine: first mismatch at token %ld col %ld: slots %g, permuted %g\n",
               cfirst / O, cfirst % O, o2[cfirst], o1[cfirst]);
    printf("  scatter G=%d rows=%d slots=%d I=%d O=%d: %ld elements differ from the plain "
           "forward, %ld unused-slot elements written, vs CPU %.2e; combine: %ld differ\n",
           G, R, A, I, O, bad, stray, ec, cbad);
    ck_assert_msg(bad == 0 && stray == 0, "the fused scatter differs from the plain forward");
    ck_assert_msg(ec <= 1e-2, "the fused scatter differs from the CPU reference");
    ck_assert_msg(cbad == 0, "the slot-order combine differs from unpermute_sum");
    g->free(doff); g->free(dmap); g->free(drow); g->free(din); g->free(dw_); g->free(dys);
    g->free(dyp); g->free(dout1); g->free(dout2);
    free(off); free(map); free(row_of); free(hin); free(hw); free(ys); free(yp); free(cr);
    free(o1); free(o2);
}

START_TEST(test_gpu_grouped_scatter) {
    /* ragged: empty groups, one row, sizes around the 64-row half tile and the 128-row
     * tile; N = 320 ends inside a 256-column tile (and a 64-column box: 320 = 5·64), K = 200
     * inside a k-step; N = 136 is not a multiple of 64 (16-byte chunks past the end) */
    const moe_grouped_schedule def = moe_cuda_grouped_sm90_schedule();
    const int narrow = moe_cuda_grouped_sm90_narrow();
    int many[256];
    for (int i = 0; i < 256; i++)
        many[i] = i % 32 >= 28 ? i % 2 : g_edges[i % N_EDGES] + (i / N_EDGES) % 3;
    for (int sc = MOE_GROUPED_SCHED_STATIC; sc < MOE_GROUPED_SCHED_COUNT; sc++) {
        moe_cuda_grouped_sm90_set_schedule((moe_grouped_schedule)sc);
        printf("  (schedule %s)\n", moe_cuda_grouped_sm90_schedule_name(sc));
        check_scatter(g_edges, N_EDGES, 200, 320);
        check_scatter(many, 256, 136, 136);
    }
    moe_cuda_grouped_sm90_set_schedule(def);
    for (int on = 1; on >= 0; on--) { /* N = 384: the 192-column tiles where they are on */
        moe_cuda_grouped_sm90_set_narrow(on);
        printf("  (narrow tiles %s)\n", on ? "on" : "off");
        check_scatter(g_edges, N_EDGES, 256, 384);
    }
    moe_cuda_grouped_sm90_set_narrow(narrow);
}
END_TEST

/* The whole model with the fused permutation's halves switched by the environment: scatter
 * only must give the same loss and gradients as no fusion BIT FOR BIT (it changes where fc2
 * stores and how the combine finds its rows, not one sum); gather only and both are checked
 * against the loop by model_vs_loop. */
static void model_grads(const char *extra, double *loss, moe_real **grads, size_t *P) {
    const char *base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 "
                       "--num-query-groups 2 --seq-length 64 --micro-batch-size 8 "
                       "--global-batch-size 8 --num-experts 8 --moe-ffn-hidden-size 64 "
                       "--ffn-hidden-size 128 --device cuda --moe-expert-backend grouped";
    char flags[512];
    snprintf(flags, sizeof flags, "%s %s", base, extra);
    moe_config cfg;
    moe_error err;
    moe_trainer *t;
    moe_step_stats st;
    setenv("MOE_NO_DOWNLOAD", "1", 1);
    ck_assert_msg(moe_test_config(&cfg, flags, &err) == MOE_OK, "%s", err.msg);
    ck_assert_msg(moe_trainer_create(&t, &cfg, &err) == MOE_OK, "%s", err.msg);
    moe_trainer_gradients(t, &st);
    *P = moe_model_num_params(t->model);
    *grads = malloc(sizeof(moe_real) * *P);
    t->model->be->to_host(*grads, t->model->grads, sizeof(moe_real) * *P);
    *loss = st.loss;
    moe_trainer_free(t);
}

START_TEST(test_gpu_grouped_model_scatter_exact) {
    double l0, l1;
    moe_real *g0, *g1;
    size_t P0, P1;
    model_grads("", &l0, &g0, &P0);
    setenv("MOE_FUSED_GATHER", "0", 1);
    model_grads("--moe-permute-fusion", &l1, &g1, &P1);
    unsetenv("MOE_FUSED_GATHER");
    ck_assert(P0 == P1);
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < P0; i++)
        if (!(g0[i] == g1[i]) && bad++ == 0)
            first = i;
    printf("  whole model, fused scatter only vs separate passes: loss %.9g vs %.9g, %zu of %zu "
           "gradients differ%s\n", l1, l0, bad, P0, bad ? "" : " (bit for bit)");
    if (bad)
        printf("  first differing gradient: index %zu, %.9g vs %.9g\n", first, g1[first],
               g0[first]);
    ck_assert_msg(l0 == l1 && bad == 0,
                  "the fused scatter changed the model's loss or gradients");
    free(g0);
    free(g1);
}
END_TEST

/* one gradient step of a small model with expert backend @p impl vs chapter 01's loop */
static void model_vs_loop(const char *impl, const char *extra) {
    const char *base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 "
                       "--num-query-groups 2 --seq-length 64 --micro-batch-size 8 "
                       "--global-batch-size 8 --num-experts 8 --moe-ffn-hidden-size 64 "
                       "--ffn-hidden-size 128 --device cuda";
    char flags[512];
    moe_trainer *t[2];
    moe_step_stats st[2];
    for (int i = 0; i < 2; i++) {
        snprintf(flags, sizeof flags, "%s --moe-expert-backend %s %s", base, i ? impl : "loop",
                 i ? extra : "");
        moe_config cfg;
        moe_error err;
        setenv("MOE_NO_DOWNLOAD", "1", 1);
        ck_assert_msg(moe_test_config(&cfg, flags, &err) == MOE_OK, "%s", err.msg);
        ck_assert_msg(moe_trainer_create(&t[i], &cfg, &err) == MOE_OK, "%s", err.msg);
        moe_trainer_gradients(t[i], &st[i]);
    }
    const size_t P = moe_model_num_params(t[0]->model);
    moe_real *a = malloc(sizeof(moe_real) * P), *b = malloc(sizeof(moe_real) * P);
    t[0]->model->be->to_host(a, t[0]->model->grads, sizeof(moe_real) * P);
    t[1]->model->be->to_host(b, t[1]->model->grads, sizeof(moe_real) * P);
    double e = rel(b, a, P);
    printf("  whole model, %s %s vs loop: loss %.6f vs %.6f, gradients rel %.2e\n", impl, extra,
           st[1].loss, st[0].loss, e);
    ck_assert(fabs(st[0].loss - st[1].loss) <= 1e-3);
    ck_assert(e <= 2e-2);
    free(a);
    free(b);
    moe_trainer_free(t[0]);
    moe_trainer_free(t[1]);
}

START_TEST(test_gpu_grouped_model_equals_loop) {
    model_vs_loop("cublas-grouped", "");
    model_vs_loop("grouped", "");
    model_vs_loop("grouped", "--moe-permute-fusion"); /* the fused permutation, both halves */
    setenv("MOE_FUSED_SCATTER", "0", 1); /* its gather half alone */
    model_vs_loop("grouped", "--moe-permute-fusion");
    unsetenv("MOE_FUSED_SCATTER");
}
END_TEST

Suite *suite_gpu_grouped(void) {
    Suite *s = suite_create("gpu-grouped");
    TCase *tc = tcase_create("grouped");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_gpu_grouped_matmul);
    tcase_add_test(tc, test_gpu_grouped_wgrad_modes);
    tcase_add_test(tc, test_gpu_grouped_wgrad_prefetch);
    tcase_add_test(tc, test_gpu_grouped_wgrad_epilogue);
    tcase_add_test(tc, test_gpu_grouped_wgrad_pingpong);
    tcase_add_test(tc, test_gpu_grouped_fine_tiles);
    tcase_add_test(tc, test_gpu_grouped_swaptail);
    tcase_add_test(tc, test_gpu_grouped_mc2);
    tcase_add_test(tc, test_gpu_grouped_narrow_tiles);
    tcase_add_test(tc, test_gpu_grouped_gather);
    tcase_add_test(tc, test_gpu_grouped_scatter);
    tcase_add_test(tc, test_gpu_grouped_model_scatter_exact);
    tcase_add_test(tc, test_gpu_grouped_model_equals_loop);
    suite_add_tcase(s, tc);
    return s;
}
