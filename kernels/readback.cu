/*
 * The step boundary's readback (chapter 06): the one place a training step waits for the GPU.
 *
 * Until chapter 06 the host read each scalar of a step as soon as it existed (the loss of
 * every layer and micro-batch, the norm of every gradient run): each read was a
 * cudaMemcpy to pageable memory plus cudaStreamSynchronize, so the CPU stopped, the GPU's
 * queue ran dry, and the next kernels were launched into an idle GPU. Now the step's scalars
 * live in one small struct in device memory (lib/step_scalars.h) and come back once:
 *
 *   to_host_async   cudaMemcpyAsync into PAGE-LOCKED host memory (cudaHostAlloc), then
 *                   cudaEventRecord. A copy into pageable memory cannot be asynchronous (the
 *                   driver stages it and waits); into pinned memory the copy engine writes
 *                   the host buffer directly, in stream order, after the whole step.
 *   wait_to_host    cudaEventSynchronize on that event: the host waits for the step's work
 *                   and nothing after it, once per step, when it has nothing left to enqueue.
 *
 * One event, created on first use: a step has one boundary, and the stream orders the copies.
 *
 *   from_host_async the other direction, from page-locked memory: the step's batches and
 *                   AdamW's per-step scalars (lr and the bias corrections). It returns at
 *                   once, and a graph can capture it (a copy from pageable memory cannot be).
 */
#include <string.h>

#include "cuda_common.cuh"
#include "cuda_ops.h"

static cudaEvent_t g_readback = NULL;

extern "C" void *moe_cuda_host_alloc(size_t bytes) {
    void *p = NULL;
    if (cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocDefault) != cudaSuccess) {
        (void)cudaGetLastError(); /* the caller reports the failure (NULL) */
        return NULL;
    }
    memset(p, 0, bytes ? bytes : 1);
    return p;
}

extern "C" void moe_cuda_host_free(void *p) {
    if (p)
        MOE_CUDA_CHECK(cudaFreeHost(p));
}

extern "C" void moe_cuda_to_host_async(void *dst, const void *src, size_t bytes) {
    if (!g_readback) /* no timing: the cheapest event to record and wait on */
        MOE_CUDA_CHECK(cudaEventCreateWithFlags(&g_readback, cudaEventDisableTiming));
    cudaStream_t st = moe_cuda_stream();
    if (bytes)
        MOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, st));
    MOE_CUDA_CHECK(cudaEventRecord(g_readback, st));
}

extern "C" void moe_cuda_from_host_async(void *dst, const void *src, size_t bytes) {
    if (bytes) /* from pinned memory: a copy-engine transfer in stream order, capturable */
        MOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, moe_cuda_stream()));
}

extern "C" void moe_cuda_wait_to_host(void) {
    if (g_readback)
        MOE_CUDA_CHECK(cudaEventSynchronize(g_readback));
}
