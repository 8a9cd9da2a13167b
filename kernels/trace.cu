/*
 * What the GPU ran, from CUPTI's activity API (shipped with the CUDA toolkit): every
 * kernel, memset and copy leaves a record with its start and end on the GPU's clock, and
 * whether it ran as a node of a CUDA graph (graphId != 0). Chapter 06's benchmark uses it
 * to count per step
 *   - host submissions: the work the host launched one by one (records outside graphs)
 *     plus one per graph launch (counted by lib/graph.c), and
 *   - GPU busy time: the union of the records' intervals, so the time the GPU had nothing
 *     to do is the step's wall time minus it.
 * Concurrent-kernel records (CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) are used because the
 * plain KERNEL kind serialises kernels. Only the benchmark links this file (and -lcupti).
 */
#include <cupti.h>
#include <cxxabi.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_common.cuh"
#include "cuda_ops.h"

typedef struct span {
    uint64_t start, end;
} span;

/* time per kernel name, for the breakdown (a few dozen names: a linear search is enough) */
typedef struct by_name {
    char name[96];
    uint64_t ns;
    long long count;
} by_name;
static by_name *g_names = NULL;
static size_t g_nn = 0, g_ncap = 0;

/* "void foo<int>(float*, ...)" -> "foo<int>": demangled, arguments dropped */
static void short_name(const char *mangled, char *out, size_t cap) {
    int st = 0;
    char *d = abi::__cxa_demangle(mangled, NULL, NULL, &st);
    const char *s = st == 0 && d ? d : mangled;
    if (!strncmp(s, "void ", 5))
        s += 5;
    /* a kernel in an anonymous namespace demangles as "(anonymous namespace)::name<...>(...)":
     * without this the '(' would end the name before it starts, and every such kernel (the
     * grouped GEMMs) would share one empty name */
    static const char anon[] = "(anonymous namespace)::";
    if (!strncmp(s, anon, sizeof anon - 1))
        s += sizeof anon - 1;
    size_t n = 0;
    int depth = 0;
    for (; s[n] && n + 1 < cap; n++) {
        depth += s[n] == '<';
        depth -= s[n] == '>';
        if (s[n] == '(' && depth == 0)
            break;
    }
    memcpy(out, s, n);
    out[n] = 0;
    free(d);
}

static void add_name(const char *mangled, uint64_t ns) {
    char nm[96];
    short_name(mangled ? mangled : "?", nm, sizeof nm);
    for (size_t i = 0; i < g_nn; i++)
        if (!strcmp(g_names[i].name, nm)) {
            g_names[i].ns += ns;
            g_names[i].count++;
            return;
        }
    if (g_nn == g_ncap) {
        g_ncap = g_ncap ? 2 * g_ncap : 256;
        g_names = (by_name *)realloc(g_names, g_ncap * sizeof *g_names);
        if (!g_names) {
            fprintf(stderr, "trace: out of host memory\n");
            exit(1);
        }
    }
    snprintf(g_names[g_nn].name, sizeof g_names[g_nn].name, "%s", nm);
    g_names[g_nn].ns = ns;
    g_names[g_nn].count = 1;
    g_nn++;
}

static span *g_spans = NULL;
static size_t g_n = 0, g_cap = 0;
static moe_cuda_trace g_t;

static void add_span(uint64_t start, uint64_t end) {
    if (g_n == g_cap) {
        g_cap = g_cap ? 2 * g_cap : 65536;
        g_spans = (span *)realloc(g_spans, g_cap * sizeof *g_spans);
        if (!g_spans) {
            fprintf(stderr, "trace: out of host memory\n");
            exit(1);
        }
    }
    g_spans[g_n].start = start;
    g_spans[g_n].end = end;
    g_n++;
}

static void CUPTIAPI buffer_requested(uint8_t **buf, size_t *size, size_t *max_records) {
    *size = (size_t)8 << 20;
    *buf = (uint8_t *)aligned_alloc(8, *size);
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size,
                                      size_t valid) {
    CUpti_Activity *r = NULL;
    while (cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
        if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL ||
            r->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
            const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)r;
            g_t.kernels++;
            g_t.graph_kernels += k->graphId != 0;
            add_span(k->start, k->end);
            add_name(k->name, k->end - k->start);
        } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
            const CUpti_ActivityMemset4 *m = (const CUpti_ActivityMemset4 *)r;
            g_t.copies++;
            g_t.graph_copies += m->graphId != 0;
            add_span(m->start, m->end);
        } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
            const CUpti_ActivityMemcpy6 *m = (const CUpti_ActivityMemcpy6 *)r;
            g_t.copies++;
            g_t.graph_copies += m->graphId != 0;
            add_span(m->start, m->end);
        }
    }
    free(buf);
}

static const CUpti_ActivityKind g_kinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
                                             CUPTI_ACTIVITY_KIND_MEMSET,
                                             CUPTI_ACTIVITY_KIND_MEMCPY};

extern "C" int moe_cuda_trace_begin(char *why, size_t cap) {
    memset(&g_t, 0, sizeof g_t);
    g_n = 0;
    g_nn = 0;
    CUptiResult r = cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
    for (size_t i = 0; r == CUPTI_SUCCESS && i < sizeof g_kinds / sizeof g_kinds[0]; i++)
        r = cuptiActivityEnable(g_kinds[i]);
    if (r != CUPTI_SUCCESS) {
        const char *s = NULL;
        cuptiGetResultString(r, &s);
        snprintf(why, cap, "CUPTI: %s", s ? s : "unknown error");
        return 0;
    }
    return 1;
}

static int by_start(const void *a, const void *b) {
    const span *x = (const span *)a, *y = (const span *)b;
    return x->start < y->start ? -1 : x->start > y->start;
}

extern "C" void moe_cuda_trace_end(moe_cuda_trace *out) {
    MOE_CUDA_CHECK(cudaStreamSynchronize(moe_cuda_stream()));
    for (size_t i = 0; i < sizeof g_kinds / sizeof g_kinds[0]; i++)
        (void)cuptiActivityDisable(g_kinds[i]);
    (void)cuptiActivityFlushAll(1);
    /* the union of the intervals: sort by start, merge overlaps */
    qsort(g_spans, g_n, sizeof *g_spans, by_start);
    uint64_t busy = 0, cur_s = 0, cur_e = 0;
    for (size_t i = 0; i < g_n; i++) {
        if (i == 0 || g_spans[i].start > cur_e) {
            busy += cur_e - cur_s;
            cur_s = g_spans[i].start;
            cur_e = g_spans[i].end;
        } else if (g_spans[i].end > cur_e) {
            cur_e = g_spans[i].end;
        }
    }
    busy += cur_e - cur_s;
    g_t.busy_ms = (double)busy / 1e6;
    *out = g_t;
}

static int by_time(const void *a, const void *b) {
    const by_name *x = (const by_name *)a, *y = (const by_name *)b;
    return x->ns > y->ns ? -1 : x->ns < y->ns;
}

extern "C" void moe_cuda_trace_print_top(FILE *f, int top, int steps) {
    qsort(g_names, g_nn, sizeof *g_names, by_time);
    uint64_t total = 0;
    for (size_t i = 0; i < g_nn; i++)
        total += g_names[i].ns;
    fprintf(f, "| kernel | launches/step | ms/step | share of kernel time |\n|---|---:|---:|---:|\n");
    for (size_t i = 0; i < g_nn && (int)i < top; i++)
        fprintf(f, "| `%s` | %.1f | %.3f | %.1f%% |\n", g_names[i].name,
                (double)g_names[i].count / steps, (double)g_names[i].ns / 1e6 / steps,
                total ? 100.0 * (double)g_names[i].ns / (double)total : 0.0);
    fprintf(f, "| (all %zu kernel names) | | %.3f | 100%% |\n", g_nn, (double)total / 1e6 / steps);
}
