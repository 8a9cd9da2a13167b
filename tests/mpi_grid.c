/*
 * The parallel grid's communicators (lib/parallel.h) under mpirun: for every layout that fits
 * the world (make test-mpi runs 1, 2 and 4 ranks), moe_parallel_create() gives each rank, for
 * each kind, the group moe_grid_group() computes: NULL for a group of one rank, otherwise a
 * communicator of the right size, this rank at its position, and the members in group order
 * (an all-gather of the world ranks over the communicator). Verdicts are summed over the
 * world before asserting, as in tests/mpi_comm.c, so no rank leaves a test early.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "helpers.h"
#include "parallel.h"
#include "suites.h"

/* One layout: the groups of every kind against the pure function. Returns the wrong count. */
static long long check_layout(moe_comm *world, int tp, int cp, int ep, int etp, int pp) {
    const int W = moe_comm_size(world), rank = moe_comm_rank(world);
    moe_grid g = {.world = W, .tp = tp, .cp = cp, .ep = ep, .etp = etp, .pp = pp};
    moe_parallel par;
    moe_error err;
    if (moe_grid_resolve(&g, NULL) != MOE_OK)
        return 0; /* does not fit this world */
    if (moe_parallel_create(&par, world, &g, &err) != MOE_OK) {
        fprintf(stderr, "[rank %d] tp%d cp%d ep%d etp%d pp%d: %s\n", rank, tp, cp, ep, etp, pp,
                err.msg);
        return 1;
    }
    long long bad = 0;
    int *members = malloc(sizeof(int) * W), *got = malloc(sizeof(int) * W);
    for (int k = 0; k < MOE_GROUP_COUNT; k++) {
        moe_group grp;
        moe_grid_group(&par.grid, (moe_group_kind)k, rank, &grp, members);
        moe_comm *c = moe_parallel_group(&par, (moe_group_kind)k);
        int ok;
        if (grp.size == 1) {
            ok = c == NULL;
        } else {
            ok = c && moe_comm_size(c) == grp.size && moe_comm_rank(c) == grp.rank;
            if (ok) {
                moe_comm_host_all_gather(c, &rank, got, 1, MOE_DTYPE_I32);
                for (int i = 0; i < grp.size; i++)
                    ok &= got[i] == members[i];
            }
        }
        if (!ok) {
            fprintf(stderr, "[rank %d] tp%d cp%d ep%d etp%d pp%d: group %s is wrong\n", rank, tp,
                    cp, ep, etp, pp, moe_group_name((moe_group_kind)k));
            bad++;
        }
    }
    free(members);
    free(got);
    moe_parallel_free(&par);
    return bad;
}

START_TEST(test_grid_communicators) {
    moe_comm *world = moe_test_world();
    /* {tp, cp, ep, etp, pp}: each axis alone, then combinations (those that do not fit the
     * world are skipped) */
    static const int layouts[][5] = {
        {1, 1, 1, 1, 1}, {2, 1, 1, 1, 1}, {1, 2, 1, 1, 1}, {1, 1, 2, 1, 1}, {1, 1, 1, 2, 1},
        {1, 1, 1, 1, 2}, {4, 1, 1, 1, 1}, {1, 1, 4, 1, 1}, {1, 1, 1, 1, 4}, {2, 2, 1, 1, 1},
        {2, 1, 2, 1, 1}, {2, 1, 2, 2, 1}, {1, 2, 4, 1, 1}, {1, 1, 2, 1, 2}, {2, 1, 1, 2, 2},
        {1, 1, 2, 2, 1},
    };
    long long bad = 0;
    for (size_t i = 0; i < sizeof layouts / sizeof layouts[0]; i++) {
        const int *l = layouts[i];
        bad += check_layout(world, l[0], l[1], l[2], l[3], l[4]);
    }
    moe_comm_host_all_reduce_sum(world, &bad, 1, MOE_DTYPE_I64);
    ck_assert_msg(bad == 0, "%lld wrong groups over all ranks (see stderr)", bad);
}
END_TEST

/* A grid that does not match the world's size is refused, on every rank alike. */
START_TEST(test_grid_world_mismatch) {
    moe_comm *world = moe_test_world();
    moe_grid g = {.world = moe_comm_size(world) + 1, .tp = 1, .cp = 1, .ep = 1, .etp = 1, .pp = 1};
    moe_parallel par;
    moe_error err;
    ck_assert_int_eq(moe_parallel_create(&par, world, &g, &err), MOE_ERR_CONFIG);
    g.world = moe_comm_size(world);
    g.ep = 3 * moe_comm_size(world);
    ck_assert_int_eq(moe_parallel_create(&par, world, &g, &err), MOE_ERR_CONFIG);
    ck_assert_msg(strstr(err.msg, "--expert-model-parallel-size"), "%s", err.msg);
}
END_TEST

Suite *suite_mpi_grid(void) {
    Suite *s = suite_create("mpi-grid");
    const TTest *tests[] = {test_grid_communicators, test_grid_world_mismatch};
    moe_test_tcase(s, "grid", 300, tests, 2);
    return s;
}
