/*
 * A failing rank must end the job, not leave the others waiting (BRIEF §3.6).
 *
 * Run by `make test-mpi` under mpirun with 2 ranks: rank 1 gives up with moe_comm_abort
 * while rank 0 waits in an all-reduce that can never complete. The test passes when
 * mpirun returns non-zero within the make target's time limit and the message names the
 * rank; a hang is caught by `timeout`. (Without the abort, rank 0 would wait forever.)
 */
#include <stdio.h>
#include <stdlib.h>

#include "comm.h"

int main(int argc, char **argv) {
    moe_comm *world = NULL;
    moe_error err;
    if (moe_comm_init(&argc, &argv, MOE_DEVICE_CPU, &world, &err) != MOE_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    if (moe_comm_size(world) < 2) {
        printf("abort test: needs 2 ranks\n");
        moe_comm_finalize(world);
        return 1;
    }
    if (moe_comm_rank(world) == 1)
        moe_comm_abort(world, 3, "rank 1 gives up on purpose (tests/mpi_abort_main.c)");
    double x = 1.0;
    moe_comm_host_all_reduce_sum(world, &x, 1, MOE_DTYPE_F64); /* never completes */
    printf("abort test: rank 0 got past a collective its peer never joined\n");
    moe_comm_finalize(world);
    return 0;
}
