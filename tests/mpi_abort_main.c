/*
 * A failing rank must end the job, not leave the others waiting.
 *
 * Run by `make test-mpi` under mpirun with 2 ranks, rank 0 waiting in an all-reduce that
 * can never complete while rank 1
 *  - (no argument) gives up with moe_comm_abort: the job must end with rank 1's message;
 *  - `stop`: stops itself (SIGSTOP, as a hung process or a debugger would) and never
 *    arrives: with MOE_COMM_TIMEOUT=2, rank 0's watchdog must end the job with
 *    "[rank 0] fatal: all_reduce_sum did not complete within 2 s (MOE_COMM_TIMEOUT)";
 *  - `stop --distributed-timeout-minutes 0.05`: the same with the deadline from the trainer's
 *    flag (parsed and checked as bin/moe-train does), "... within 3 s
 *    (--distributed-timeout-minutes)".
 * The test passes when mpirun returns non-zero within the make target's time limit and
 * the output carries the message; a hang is caught by `timeout`.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm.h"
#include "config.h"

int main(int argc, char **argv) {
    moe_comm *world = NULL;
    moe_error err;
    if (argc > 2) { /* flags after the mode: the deadline, as bin/moe-train sets it */
        moe_config cfg;
        double seconds;
        moe_config_defaults(&cfg);
        if (moe_config_parse(&cfg, argc - 1, argv + 1, &err) != MOE_OK ||
            moe_config_comm_timeout_s(&cfg, &seconds, &err) != MOE_OK) {
            fprintf(stderr, "%s\n", err.msg);
            return 1;
        }
        moe_comm_set_timeout_s(seconds);
    }
    if (moe_comm_init(&argc, &argv, MOE_DEVICE_CPU, &world, &err) != MOE_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    if (moe_comm_size(world) < 2) {
        printf("abort test: needs 2 ranks\n");
        moe_comm_finalize(world);
        return 1;
    }
    const int stop = argc > 1 && !strcmp(argv[1], "stop");
    if (moe_comm_rank(world) == 1) {
        if (stop) {
            raise(SIGSTOP); /* ending the job, mpirun continues this rank and kills it: */
            for (;;)        /* it must not join the collective in between */
                pause();
        } else
            moe_comm_abort(world, 3, "rank 1 gives up on purpose (tests/mpi_abort_main.c)");
    }
    double x = 1.0;
    moe_comm_host_all_reduce_sum(world, &x, 1, MOE_DTYPE_F64); /* never completes */
    printf("abort test: rank 0 got past a collective its peer never joined\n");
    moe_comm_finalize(world);
    return 0;
}
