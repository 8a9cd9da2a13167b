/*
 * CUDA graph capture for the op table (backend.h's graph slots; lib/graph.h decides what
 * to capture and when).
 *
 * A CUDA graph is a recording of the work enqueued on a stream: between
 * cudaStreamBeginCapture and cudaStreamEndCapture nothing runs, every kernel launch,
 * memset and copy becomes a node; cudaGraphInstantiate turns the recording into an
 * executable graph, and cudaGraphLaunch replays all of it with ONE call of the host. The
 * kernels, their arguments (pointers and scalars) and their order are frozen: replaying
 * is only correct when the same work on the same buffers is wanted again, which is why
 * lib/graph.c keys each graph by the shape and why buffers must never move (the arena:
 * memory.cu, cuda_common.cu).
 *
 * Capture mode: cudaStreamCaptureModeThreadLocal, deliberately. Global would also forbid
 * "unsafe" calls (cudaMalloc, synchronous copies) in every other thread while we capture:
 * the communication watchdog thread (comm_watchdog.h) polls the device, and would fail
 * for a capture it has nothing to do with. Relaxed would forbid nothing, so a cudaMalloc
 * inside the captured region would slip through and bake an address into the graph. With
 * ThreadLocal the thread that captures may do nothing unsafe, and the others are free.
 *
 * What cannot be captured (a wait, a device-to-host read, an allocation) is caught before
 * it happens: the backend calls moe_cuda_capture_forbid(what) first, which ends and throws
 * away the capture and keeps `what`. The caller then goes on eagerly (the stream no longer
 * captures), and moe_cuda_graph_end() returns NULL with the reason, which lib/graph.c turns
 * into a named error ("cuda graph scope 'attn': to_host (...) is not capturable").
 */
#include <string.h>

#include "cuda_common.cuh"
#include "cuda_ops.h"

/** One captured region. */
struct moe_cuda_graph {
    cudaGraphExec_t exec;     /* what cudaGraphLaunch replays */
    size_t nodes;             /* kernels, memsets and copies in it */
    unsigned long long epoch; /* moe_cuda_memory_epoch() when captured */
};

static char g_abandoned[256]; /* why the capture in progress was thrown away ("" = it was not) */

int moe_cuda_capture_forbid(const char *what) {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    MOE_CUDA_CHECK(cudaStreamIsCapturing(moe_cuda_stream(), &st));
    if (st == cudaStreamCaptureStatusNone)
        return 0;
    cudaGraph_t graph = NULL;
    (void)cudaStreamEndCapture(moe_cuda_stream(), &graph); /* ends it, even if invalidated */
    (void)cudaGetLastError();
    if (graph)
        MOE_CUDA_CHECK(cudaGraphDestroy(graph));
    snprintf(g_abandoned, sizeof g_abandoned, "%s", what);
    return 1;
}

extern "C" void moe_cuda_graph_begin(void) {
    g_abandoned[0] = '\0';
    MOE_CUDA_CHECK(cudaStreamBeginCapture(moe_cuda_stream(), cudaStreamCaptureModeThreadLocal));
}

extern "C" void *moe_cuda_graph_end(char *why, size_t cap) {
    if (g_abandoned[0]) { /* moe_cuda_capture_forbid() already ended it */
        snprintf(why, cap, "%s", g_abandoned);
        return NULL;
    }
    cudaGraph_t graph = NULL;
    cudaError_t e = cudaStreamEndCapture(moe_cuda_stream(), &graph);
    if (e != cudaSuccess || !graph) { /* invalidated by a call we do not guard */
        snprintf(why, cap, "the capture was invalidated by a call that is not guarded "
                 "(%s)", cudaGetErrorString(e));
        (void)cudaGetLastError();
        if (graph)
            MOE_CUDA_CHECK(cudaGraphDestroy(graph));
        return NULL;
    }
    moe_cuda_graph *g = (moe_cuda_graph *)calloc(1, sizeof *g);
    if (!g) {
        snprintf(why, cap, "out of host memory for a graph");
        MOE_CUDA_CHECK(cudaGraphDestroy(graph));
        return NULL;
    }
    MOE_CUDA_CHECK(cudaGraphGetNodes(graph, NULL, &g->nodes));
    MOE_CUDA_CHECK(cudaGraphInstantiate(&g->exec, graph, 0));
    MOE_CUDA_CHECK(cudaGraphDestroy(graph)); /* the executable graph keeps its own copy */
    g->epoch = moe_cuda_memory_epoch();
    return g;
}

extern "C" int moe_cuda_graph_launch(void *gp) {
    moe_cuda_graph *g = (moe_cuda_graph *)gp;
    if (g->epoch != moe_cuda_memory_epoch())
        return 0; /* a scratch buffer moved since: the caller captures again */
    MOE_CUDA_CHECK(cudaGraphLaunch(g->exec, moe_cuda_stream()));
    return 1;
}

extern "C" void moe_cuda_graph_free(void *gp) {
    moe_cuda_graph *g = (moe_cuda_graph *)gp;
    if (!g)
        return;
    MOE_CUDA_CHECK(cudaStreamSynchronize(moe_cuda_stream())); /* a replay may be running */
    MOE_CUDA_CHECK(cudaGraphExecDestroy(g->exec));
    free(g);
}

extern "C" size_t moe_cuda_graph_nodes(const void *gp) {
    return ((const moe_cuda_graph *)gp)->nodes;
}
