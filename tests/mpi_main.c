/*
 * MPI test runner: the same binary on every rank of `mpirun -np N build/tests/mpi`
 * (make test-mpi runs N = 1, 2, 4 on CPU ranks).
 *
 *  - The world is started once (moe_comm_init) and shared by every suite through
 *    moe_test_world() (suites.h); tests allocate their buffers through moe_test_mpi_backend().
 *  - MOE_TEST_DEVICE=cuda starts a CUDA world instead: the same suites then run on the
 *    NCCL transport with device buffers (one GPU per rank, on a multi-GPU machine).
 *  - Check runs without fork (CK_NOFORK): the ranks are MPI processes, and a forked
 *    child cannot take part in their collectives.
 *  - Only rank 0 prints Check's report; the others run silently. The tests agree on
 *    every verdict (see tests/mpi_comm.c), and the failure counts are summed over the
 *    ranks at the end, so every rank exits with the same status.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "comm.h"
#include "log.h"
#include "suites.h"
#ifdef MOE_HAVE_CUDA
#include "cuda_ops.h"
#endif

static moe_comm *g_world;
static const moe_backend *g_backend;

/** The backend whose alloc/from_host/to_host make transport buffers (declared by the
 *  suites that use it; the world's accessor, moe_test_world, is in suites.h). */


moe_comm *moe_test_world(void) { return g_world; }
const moe_backend *moe_test_mpi_backend(void) { return g_backend; }

int main(int argc, char **argv) {
    const char *dev = getenv("MOE_TEST_DEVICE");
    moe_device device = MOE_DEVICE_CPU;
    if (dev && *dev && strcmp(dev, "cpu") != 0) {
        if (strcmp(dev, "cuda") != 0) {
            fprintf(stderr, "MPI tests: MOE_TEST_DEVICE=%s: use cpu (MPI transport) or cuda (NCCL)\n",
                    dev);
            return EXIT_FAILURE;
        }
        device = MOE_DEVICE_CUDA;
    }
    moe_error err;
    moe_error_clear(&err);
    if (moe_comm_init(&argc, &argv, device, &g_world, &err) != MOE_OK) {
        fprintf(stderr, "MPI tests: %s\n", err.msg);
        return EXIT_FAILURE;
    }
#ifdef MOE_HAVE_CUDA
    g_backend = device == MOE_DEVICE_CUDA ? moe_backend_cuda() : moe_backend_cpu();
#else
    g_backend = moe_backend_cpu();
#endif
    moe_log_set_quiet(1);
    const int rank = moe_comm_rank(g_world), size = moe_comm_size(g_world);
    if (rank == 0) {
        printf("MPI tests: %d rank(s), %s\n", size,
               device == MOE_DEVICE_CUDA ? "NCCL transport (device buffers)"
                                         : "MPI transport (host buffers)");
        fflush(stdout);
    }

    SRunner *sr = srunner_create(suite_mpi_comm());
    srunner_add_suite(sr, suite_mpi_grid());
    srunner_add_suite(sr, suite_mpi_ep());
    srunner_add_suite(sr, suite_mpi_tp());
    srunner_add_suite(sr, suite_mpi_dp());
    srunner_add_suite(sr, suite_mpi_delayed());
    srunner_add_suite(sr, suite_mpi_etp());
    srunner_add_suite(sr, suite_mpi_fold8());
    srunner_add_suite(sr, suite_mpi_cp());
    srunner_add_suite(sr, suite_mpi_checkpoint());
    srunner_set_fork_status(sr, CK_NOFORK);
    srunner_run_all(sr, rank == 0 ? CK_VERBOSE : CK_SILENT);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);

    /* every rank must exit with the same status: sum the failures over the ranks */
    int total = failed;
    moe_comm_host_all_reduce_sum(g_world, &total, 1, MOE_DTYPE_I32);
    if (rank == 0 && total)
        fprintf(stderr, "MPI tests: %d failure(s) summed over %d rank(s)\n", total, size);
    moe_comm_finalize(g_world);
    return total == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
