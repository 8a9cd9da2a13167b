/*
 * The dispatch plan's arithmetic (chapter 02; make check-ch02 grades it, and with
 * STUDENT=1 the student's version in chapters/02-expert-parallel/student/): splits,
 * expert offsets, chunk lists and sort maps against a hand-worked example seen from both
 * ranks, then the invariants that make the exchange correct, on random counts:
 *  - what rank p sends to rank q is, chunk by chunk and in order, what q expects from p;
 *  - every local expert's block is contiguous and the blocks tile [0, R_recv);
 *  - sort_map and unsort_map are inverse permutations of [0, R_recv).
 */
#include <stdlib.h>

#include "helpers.h"
#include "moe/dispatch.h"
#include "suites.h"

#define MAXP 4
#define MAXE 16

typedef struct {
    size_t send_rows[MAXP], recv_rows[MAXP];
    int expert_offset[MAXE + 1];
    moe_comm_chunk send_chunks[MAXE], recv_chunks[MAXE];
    int sort_map[512], unsort_map[512];
    int R_recv;
} layout;

static void build(layout *L, const long long *all, int P, int rank, int E) {
    for (int i = 0; i < 512; i++)
        L->sort_map[i] = L->unsort_map[i] = -1;
    moe_dispatch_layout(all, P, rank, E, L->send_rows, L->recv_rows, L->expert_offset,
                        L->send_chunks, L->recv_chunks);
    L->R_recv = 0;
    for (int q = 0; q < P; q++)
        L->R_recv += (int)L->recv_rows[q];
    moe_dispatch_sort_maps(L->sort_map, L->unsort_map, L->recv_chunks, P, E / P);
}

static void expect_chunk(moe_comm_chunk c, moe_comm_chunk want) {
    ck_assert_int_eq((int)c.offset, (int)want.offset);
    ck_assert_int_eq((int)c.count, (int)want.count);
    ck_assert_int_eq(c.peer, want.peer);
}

/* 2 ranks, 4 experts (rank 0 owns experts 0-1, rank 1 owns 2-3). all[p][e]: rows rank p
 * sends to expert e. */
static const long long ALL[2 * 4] = {3, 1, 0, 2, /* rank 0 */ 1, 0, 4, 2 /* rank 1 */};

/* What each rank of that example must compute, worked by hand. */
typedef struct {
    int send_rows[2], recv_rows[2], expert_offset[3];
    moe_comm_chunk recv_chunks[4], send_chunks[4];
    int R_recv, sort_map[8], unsort_map[8];
} want_plan;
static const want_plan WANT[2] = {
    /* rank 0 sends 3+1 rows to itself, 0+2 to rank 1, and receives 3+1 and 1+0. Its
     * expert 0 = 3 rows from rank 0 + 1 from rank 1, expert 1 = 1 + 0. Received order
     * [src][el]: 3 rows (r0,e0), 1 row (r0,e1), 1 row (r1,e0). */
    {{4, 2}, {4, 1}, {0, 4, 5},
     {{0, 3, 0}, {4, 1, 0}, {3, 1, 1}, {5, 0, 1}},
     {{0, 3, 0}, {3, 1, 0}, {4, 0, 1}, {4, 2, 1}},
     5, {0, 1, 2, 4, 3}, {0, 1, 2, 4, 3}},
    /* rank 1: expert 2 = 0 rows from rank 0 + 4 from rank 1; expert 3 = 2 + 2 */
    {{1, 6}, {2, 6}, {0, 4, 8},
     {{0, 0, 0}, {4, 2, 0}, {0, 4, 1}, {6, 2, 1}},
     {{0, 1, 0}, {1, 0, 0}, {1, 4, 1}, {5, 2, 1}},
     8, {2, 3, 4, 5, 0, 1, 6, 7}, {4, 5, 0, 1, 2, 3, 6, 7}},
};

START_TEST(test_plan_worked_example) {
    for (int rank = 0; rank < 2; rank++) {
        const want_plan *w = &WANT[rank];
        layout L;
        build(&L, ALL, 2, rank, 4);
        for (int q = 0; q < 2; q++) {
            ck_assert_int_eq((int)L.send_rows[q], w->send_rows[q]);
            ck_assert_int_eq((int)L.recv_rows[q], w->recv_rows[q]);
        }
        for (int i = 0; i < 3; i++)
            ck_assert_int_eq(L.expert_offset[i], w->expert_offset[i]);
        for (int c = 0; c < 4; c++) {
            expect_chunk(L.recv_chunks[c], w->recv_chunks[c]);
            expect_chunk(L.send_chunks[c], w->send_chunks[c]);
        }
        ck_assert_int_eq(L.R_recv, w->R_recv);
        for (int r = 0; r < w->R_recv; r++) {
            ck_assert_int_eq(L.sort_map[r], w->sort_map[r]);
            ck_assert_int_eq(L.unsort_map[r], w->unsort_map[r]);
        }
    }
}
END_TEST

START_TEST(test_plan_invariants) {
    const int shapes[3][2] = {{1, 4}, {2, 8}, {4, 16}}; /* (P, E) */
    unsigned seed = 12;
    for (int s = 0; s < 3; s++) {
        const int P = shapes[s][0], E = shapes[s][1], EL = E / P;
        long long all[MAXP * MAXE];
        for (int i = 0; i < P * E; i++) {
            seed = seed * 1103515245u + 12345u;
            all[i] = (seed >> 16) % 7 == 0 ? 0 : (long long)((seed >> 16) % 9); /* some empty */
        }
        layout L[MAXP];
        for (int r = 0; r < P; r++)
            build(&L[r], all, P, r, E);
        for (int p = 0; p < P; p++) {
            /* sender p's chunks to q, in list order, are receiver q's chunks from p */
            for (int q = 0; q < P; q++) {
                size_t sent = 0;
                for (int el = 0; el < EL; el++) {
                    const moe_comm_chunk sc = L[p].send_chunks[q * EL + el];
                    const moe_comm_chunk rc = L[q].recv_chunks[p * EL + el];
                    ck_assert_int_eq(sc.peer, q);
                    ck_assert_int_eq(rc.peer, p);
                    ck_assert_int_eq((int)sc.count, (int)rc.count);
                    sent += sc.count;
                }
                ck_assert_int_eq((int)sent, (int)L[p].send_rows[q]);
                ck_assert_int_eq((int)sent, (int)L[q].recv_rows[p]);
            }
            /* expert blocks tile [0, R_recv), each chunk inside its expert's block */
            ck_assert_int_eq(L[p].expert_offset[0], 0);
            ck_assert_int_eq(L[p].expert_offset[EL], L[p].R_recv);
            for (int el = 0; el < EL; el++)
                for (int q = 0; q < P; q++) {
                    const moe_comm_chunk c = L[p].recv_chunks[q * EL + el];
                    ck_assert_int_ge((int)c.offset, L[p].expert_offset[el]);
                    ck_assert_int_le((int)(c.offset + c.count), L[p].expert_offset[el + 1]);
                }
            /* the maps are inverse permutations */
            for (int r = 0; r < L[p].R_recv; r++) {
                ck_assert_int_ge(L[p].sort_map[r], 0);
                ck_assert_int_lt(L[p].sort_map[r], L[p].R_recv);
                ck_assert_int_eq(L[p].unsort_map[L[p].sort_map[r]], r);
            }
        }
    }
}
END_TEST

Suite *suite_dispatch_plan(void) {
    const TTest *tests[] = {test_plan_worked_example, test_plan_invariants};
    return moe_test_chapter_suite("dispatch-plan", "ch02", tests, 2);
}
