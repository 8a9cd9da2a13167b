/* Helpers shared by the test suites: see helpers.h. */
#include "helpers.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend.h"
#include "rng.h"

int moe_test_quick(void) {
    const char *q = getenv("MOE_TEST_QUICK");
    return q && *q && *q != '0';
}

void moe_test_randn(moe_real *x, size_t n, uint64_t stream, double scale) {
    for (size_t i = 0; i < n; i++)
        x[i] = (moe_real)(scale * moe_rng_normal(12345, 1000 + stream, i));
}

void moe_test_poison(moe_real *x, size_t n) {
    for (size_t i = 0; i < n; i++)
        x[i] = (moe_real)NAN;
}

double moe_test_max_rel_err(const moe_real *a, const moe_real *b, size_t n, double floor) {
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        double s = fabs((double)b[i]);
        double r = d / (s > floor ? s : floor);
        if (isnan(r))
            return INFINITY;
        if (r > worst)
            worst = r;
    }
    return worst;
}

moe_status moe_test_config(moe_config *cfg, const char *flags, moe_error *err) {
    moe_config_defaults(cfg);
    return moe_config_parse_string(cfg, flags, err);
}

int moe_test_have_gpu(void) {
    const moe_backend *b = NULL;
    return moe_backend_select("cuda", &b, NULL) == MOE_OK;
}

void moe_test_tmp_path(char *out, size_t cap, const char *name) {
    const char *dir = getenv("TMPDIR");
    snprintf(out, cap, "%s/moe_test_%d_%s", dir && *dir ? dir : "/tmp", (int)getpid(), name);
}

int moe_test_run(const char *cmd, char *out, size_t cap) {
    char full[2048];
    snprintf(full, sizeof full, "%s 2>&1", cmd);
    FILE *p = popen(full, "r");
    if (!p)
        return -1;
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = '\0';
    int status = pclose(p);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

int moe_test_have_program(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "skipped: %s not built (run make all first)\n", path);
        return 0;
    }
    fclose(f);
    return 1;
}

TCase *moe_test_tcase(Suite *s, const char *name, double timeout, const TTest *const *tests,
                      int n) {
    TCase *tc = tcase_create(name);
    tcase_set_timeout(tc, timeout);
    for (int i = 0; i < n; i++)
        tcase_add_test(tc, tests[i]);
    suite_add_tcase(s, tc);
    return tc;
}

Suite *moe_test_chapter_suite(const char *name, const char *chapter, const TTest *const *tests,
                              int n) {
    Suite *s = suite_create(name);
    tcase_set_tags(moe_test_tcase(s, chapter, 60, tests, n), chapter);
    return s;
}
