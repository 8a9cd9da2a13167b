/*
 * The token dispatcher across ranks (placeholder: the dispatcher's tests replace it).
 *
 * MPI suites get the world from moe_test_world() (suites.h) and, for transport buffers,
 * the backend from tests/mpi_main.c: const moe_backend *moe_test_mpi_backend(void);
 */
#include <check.h>

#include "suites.h"

START_TEST(test_dispatch_placeholder) { ck_assert_int_eq(1, 1); }
END_TEST

Suite *suite_mpi_dispatch(void) {
    Suite *s = suite_create("mpi_dispatch");
    TCase *tc = tcase_create("placeholder");
    tcase_add_test(tc, test_dispatch_placeholder);
    suite_add_tcase(s, tc);
    return s;
}
