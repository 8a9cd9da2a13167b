/* Unit-test runner (fp32 CPU build): runs every suite and prints Check's summary.
 * CK_INCLUDE_TAGS=chNN runs only the test cases tagged with a chapter (make check-chNN). */
#include <stdlib.h>

#include "log.h"
#include "suites.h"

int main(void) {
    moe_log_set_quiet(1);
    SRunner *sr = srunner_create(suite_core());
    srunner_add_suite(sr, suite_config());
    srunner_add_suite(sr, suite_data());
    srunner_add_suite(sr, suite_router());
    srunner_add_suite(sr, suite_train());
    srunner_add_suite(sr, suite_parallel());
    srunner_add_suite(sr, suite_fuzz());
    srunner_add_suite(sr, suite_reliability());
    srunner_add_suite(sr, suite_dispatch_plan());
    srunner_add_suite(sr, suite_grouped());
    srunner_add_suite(sr, suite_tile_schedule());
    srunner_add_suite(sr, suite_sync_free());
    srunner_add_suite(sr, suite_graph());
    srunner_add_suite(sr, suite_vocab_merge());
    srunner_add_suite(sr, suite_step_scalars());
    srunner_add_suite(sr, suite_cp_layout());
    srunner_add_suite(sr, suite_attention());
    srunner_add_suite(sr, suite_checkpoint());
    srunner_add_suite(sr, suite_quant());
    srunner_add_suite(sr, suite_fp8_wgrad());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
