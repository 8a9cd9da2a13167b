/*
 * CUDA test runner. Without a usable GPU (CI) it says so and succeeds, visibly:
 * "skipped: no GPU". On the GPU machine it runs every CUDA-vs-CPU suite.
 */
#include <stdio.h>
#include <stdlib.h>

#include "cuda_ops.h"
#include "log.h"
#include "suites.h"

int main(void) {
    if (!moe_cuda_available()) {
        printf("GPU tests: skipped: no GPU\n");
        return EXIT_SUCCESS;
    }
    moe_log_set_quiet(1);
    SRunner *sr = srunner_create(suite_gpu_dense());
    srunner_add_suite(sr, suite_gpu_attention());
    srunner_add_suite(sr, suite_gpu_moe());
    srunner_add_suite(sr, suite_gpu_model());
    srunner_add_suite(sr, suite_gpu_grouped());
    srunner_add_suite(sr, suite_gpu_checkpoint());
    srunner_add_suite(sr, suite_gpu_sync_free());
    srunner_add_suite(sr, suite_gpu_graphs());
    srunner_add_suite(sr, suite_gpu_scalars());
    srunner_add_suite(sr, suite_gpu_quant());
    srunner_add_suite(sr, suite_gpu_fp8_layer());
    srunner_add_suite(sr, suite_gpu_fp8_fused());
    srunner_add_suite(sr, suite_gpu_fp8_wgrad());
    srunner_set_fork_status(sr, CK_NOFORK); /* one CUDA context for the whole run */
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
