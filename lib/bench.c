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

moe_bench_env moe_bench_env_set(const char *name, const char *value) {
    moe_bench_env e = {name, 0, ""};
    const char *old = getenv(name);
    if (old) {
        if (strlen(old) >= sizeof e.value) {
            fprintf(stderr, "%s=%s: longer than %zu characters, which this program cannot "
                            "restore after changing it; unset it or give a shorter value\n",
                    name, old, sizeof e.value - 1);
            exit(2);
        }
        e.was_set = 1;
        snprintf(e.value, sizeof e.value, "%s", old);
    }
    setenv(name, value, 1);
    return e;
}

void moe_bench_env_restore(const moe_bench_env *e) {
    if (e->was_set)
        setenv(e->name, e->value, 1);
    else
        unsetenv(e->name);
}

void moe_bench_header(const char *title, const char *device) {
    char date[64], commit[64];
    moe_utc_date(date, sizeof date);
    moe_git_commit(commit, sizeof commit);
    printf("%s | %s | %s | commit %s\n", title, device, date, commit);
}

int moe_bench_parse_ints(const char *s, int *out, int cap) {
    int n = 0;
    for (const char *p = s; *p;) {
        char *end;
        const long v = strtol(p, &end, 10);
        if (end == p || v < 1 || v > (1L << 24) || n == cap)
            return -1;
        out[n++] = (int)v;
        if (*end == ',' && end[1])
            end++;
        else if (*end)
            return -1; /* anything else, or a comma with nothing after it */
        p = end;
    }
    return n > 0 ? n : -1;
}

static const moe_bench_shape g_shapes[] = {
    {"qwen3", 16384, 2048, 768, 128, 8},
    {"mixtral", 8192, 4096, 14336, 8, 2},
    {"qwen3-235b", 8192, 4096, 1536, 128, 8}, /* Qwen3-235B-A22B */
    {"dsv2-lite", 16384, 2048, 1408, 64, 6},  /* DeepSeek-V2-Lite */
    /* rows per expert 64 .. 8192 at H=4096, F=1536, k=8: T=8192 and E = T·k/rows, except
     * that E stays within the grouped kernel's 256 groups (T shrinks instead) */
    {"sweep64", 2048, 4096, 1536, 256, 8},
    {"sweep128", 4096, 4096, 1536, 256, 8},
    {"sweep256", 8192, 4096, 1536, 256, 8},
    {"sweep512", 8192, 4096, 1536, 128, 8},
    {"sweep1024", 8192, 4096, 1536, 64, 8},
    {"sweep2048", 8192, 4096, 1536, 32, 8},
    {"sweep4096", 8192, 4096, 1536, 16, 8},
    {"sweep8192", 8192, 4096, 1536, 8, 8},
    {"small", 2048, 256, 256, 16, 4},
    /* the GPU preset's MoE layer (--preset gpu): short reductions (K = 384 and 768) and
     * N = 384, the grouped GEMM's case in the trainer (chapter 06) */
    {"preset", 8192, 384, 768, 8, 2},
};

const moe_bench_shape *moe_bench_shapes(int *n) {
    *n = (int)(sizeof g_shapes / sizeof g_shapes[0]);
    return g_shapes;
}

int moe_bench_shape_wanted(const char *want, const char *name, int on_gpu) {
    const int sweep = !strncmp(name, "sweep", 5);
    const int small = !strcmp(name, "small") || !strcmp(name, "preset"); /* not a model's */
    if (!strcmp(want, "all") || !strcmp(want, name))
        return 1;
    if (!strcmp(want, "sweep"))
        return sweep;
    if (!strcmp(want, "models")) /* the four model shapes */
        return !sweep && !small;
    if (!strcmp(want, "big")) /* both */
        return !small;
    if (strcmp(want, "auto"))
        return 0;
    if (on_gpu) /* the two shapes of the first grouped-GEMM chapter */
        return !strcmp(name, "qwen3") || !strcmp(name, "mixtral");
    return on_gpu ? strcmp(name, "small") != 0 : !strcmp(name, "small");
}
