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
#include <stdlib.h>
#include <string.h>

#include "cuda_common.cuh"
#include "cuda_ops.h"

typedef struct span {
    uint64_t start, end;
} span;

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
