/* What the benchmark programs share: see bench.h. */
#include "bench.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "provenance.h"

static int cmp_double(const void *p, const void *q) {
    const double x = *(const double *)p, y = *(const double *)q;
    return (x > y) - (x < y);
}

double moe_median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void moe_bench_header(const char *title, const char *device) {
    char date[64], commit[64];
    moe_utc_date(date, sizeof date);
    moe_git_commit(commit, sizeof commit);
    printf("%s | %s | %s | commit %s\n", title, device, date, commit);
}

static const moe_bench_shape g_shapes[] = {
    {"qwen3", 16384, 2048, 768, 128, 8},
    {"mixtral", 8192, 4096, 14336, 8, 2},
    {"small", 2048, 256, 256, 16, 4},
};

const moe_bench_shape *moe_bench_shapes(int *n) {
    *n = (int)(sizeof g_shapes / sizeof g_shapes[0]);
    return g_shapes;
}

int moe_bench_shape_wanted(const char *want, const char *name, int on_gpu) {
    if (!strcmp(want, "all") || !strcmp(want, name))
        return 1;
    if (strcmp(want, "auto"))
        return 0;
    return on_gpu ? strcmp(name, "small") != 0 : !strcmp(name, "small");
}
