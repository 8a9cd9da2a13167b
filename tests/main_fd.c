/* Finite-difference gradient-check runner (fp64 CPU build): prints Check's summary. */
#include <stdlib.h>

#include "log.h"
#include "suites.h"

int main(void) {
    moe_log_set_quiet(1);
    SRunner *sr = srunner_create(suite_fd_ops());
    srunner_add_suite(sr, suite_fd_model());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
