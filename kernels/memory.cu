/*
 * Memory and precision for the CUDA backend (the first block of the op table).
 *
 * Everything here is a thin wrapper over the CUDA runtime, with two rules:
 *
 *  1. Work is ordered on ONE stream, moe_cuda_stream(). Kernels, cuBLAS calls,
 *     memsets and copies are all enqueued there, so they run in program order
 *     without any explicit synchronisation between them. (The stream is created
 *     non-blocking, i.e. it does NOT synchronise with the legacy default stream;
 *     that is why even the memset of a fresh allocation goes on it.)
 *
 *  2. Anything that hands data to the HOST waits for it: to_host / from_host /
 *     read_act / write_act enqueue a copy and then cudaStreamSynchronize(), so the
 *     caller may read (or overwrite) its host buffer as soon as the call returns.
 *     That is what the CPU backend's memcpy promises, and the model relies on it.
 *
 *  3. (chapter 06) cudaMalloc and cudaFree are called in ONE place each,
 *     moe_cuda_malloc_counted() and moe_cuda_free_counted(), which count them: the model
 *     allocates everything when it is created and the scratch buffers grow in the first
 *     step, so from the second step on a training step allocates nothing — the arena
 *     test (tests/gpu_graphs.c) reads the counters to prove it. Every call here that waits,
 *     reads the device on the host or allocates first asks moe_cuda_capture_forbid(): inside
 *     a CUDA graph capture it is not capturable, and the capture fails with its name.
 *
 * Precision. Activations are bf16 (1 sign, 8 exponent, 7 mantissa bits: the range
 * of fp32 with 3 significant decimal digits). Converting fp32 → bf16 rounds to the
 * nearest value, ties to even (relative error ≤ 2⁻⁹); bf16 → fp32 is exact (the
 * bf16 bits are the upper half of the fp32 bits). read_act / write_act convert on
 * the host with the same __nv_bfloat16 conversions the kernels use (cuda_bf16.h
 * makes them callable on both sides); cast_to_act — the per-step refresh of the
 * bf16 compute copy from the fp32 master weights — runs on the device.
 */
#include <string.h>

#include "cuda_common.cuh"
#include "cuda_ops.h"

/* dst[i] = bf16(src[i]): one thread per element, grid-stride for any n. */
static __global__ void cast_to_bf16_kernel(moe_bf16 *dst, const float *src, size_t n) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = moe_st(src[i]);
}

static long long g_mallocs = 0, g_frees = 0;

void *moe_cuda_malloc_counted(size_t bytes) {
    void *p = NULL;
    (void)moe_cuda_capture_forbid("cudaMalloc (an allocation)");
    /* a zero-byte request still returns a distinct non-NULL pointer, like calloc */
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        (void)cudaGetLastError(); /* out of memory is not sticky: clear it and report NULL */
        return NULL;
    }
    g_mallocs++;
    return p;
}

void moe_cuda_free_counted(void *p) {
    if (!p)
        return;
    (void)moe_cuda_capture_forbid("cudaFree (a release, which waits for the stream)");
    /* queued kernels may still read p: let them finish first */
    MOE_CUDA_CHECK(cudaStreamSynchronize(moe_cuda_stream()));
    MOE_CUDA_CHECK(cudaFree(p));
    g_frees++;
}

extern "C" void moe_cuda_alloc_counts(long long *mallocs, long long *frees) {
    *mallocs = g_mallocs;
    *frees = g_frees;
}

extern "C" void *moe_cuda_alloc(size_t bytes) {
    void *p = moe_cuda_malloc_counted(bytes);
    if (p)
        MOE_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes ? bytes : 1, moe_cuda_stream()));
    return p;
}

extern "C" void moe_cuda_free(void *p) { moe_cuda_free_counted(p); }

extern "C" void moe_cuda_zero(void *p, size_t bytes) {
    if (bytes)
        MOE_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, moe_cuda_stream()));
}

extern "C" void moe_cuda_copy(void *dst, const void *src, size_t bytes) {
    if (bytes && dst != src)
        MOE_CUDA_CHECK(
            cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, moe_cuda_stream()));
}

extern "C" void moe_cuda_to_host(void *dst, const void *src, size_t bytes) {
    if (!bytes)
        return;
    (void)moe_cuda_capture_forbid("to_host (a device-to-host copy the host waits for)");
    MOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, moe_cuda_stream()));
    MOE_CUDA_CHECK(cudaStreamSynchronize(moe_cuda_stream()));
}

extern "C" void moe_cuda_from_host(void *dst, const void *src, size_t bytes) {
    if (!bytes)
        return;
    (void)moe_cuda_capture_forbid("from_host (a copy from pageable host memory the host waits "
                                  "for)");
    MOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, moe_cuda_stream()));
    MOE_CUDA_CHECK(cudaStreamSynchronize(moe_cuda_stream()));
}

extern "C" void moe_cuda_read_act(moe_real *host, const void *src, size_t n) {
    if (!n)
        return;
    moe_bf16 *tmp = (moe_bf16 *)malloc(n * sizeof(moe_bf16));
    if (!tmp) {
        fprintf(stderr, "moe_cuda_read_act: out of host memory (%zu values)\n", n);
        exit(1);
    }
    moe_cuda_to_host(tmp, src, n * sizeof(moe_bf16));
    for (size_t i = 0; i < n; i++)
        host[i] = (moe_real)__bfloat162float(tmp[i]); /* exact */
    free(tmp);
}

extern "C" void moe_cuda_write_act(void *dst, const moe_real *host, size_t n) {
    if (!n)
        return;
    moe_bf16 *tmp = (moe_bf16 *)malloc(n * sizeof(moe_bf16));
    if (!tmp) {
        fprintf(stderr, "moe_cuda_write_act: out of host memory (%zu values)\n", n);
        exit(1);
    }
    for (size_t i = 0; i < n; i++)
        tmp[i] = __float2bfloat16_rn((float)host[i]); /* round to nearest even */
    moe_cuda_from_host(dst, tmp, n * sizeof(moe_bf16));
    free(tmp);
}

extern "C" void moe_cuda_cast_to_act(void *dst, const moe_real *src, size_t n) {
    if (!n)
        return;
    const int threads = 256;
    size_t blocks = moe_cdiv(n, threads);
    if (blocks > 65536) /* grid-stride: enough blocks to fill any GPU */
        blocks = 65536;
    cast_to_bf16_kernel<<<(unsigned)blocks, threads, 0, moe_cuda_stream()>>>((moe_bf16 *)dst, src,
                                                                           n);
    MOE_CUDA_LAUNCH_CHECK();
}

extern "C" void moe_cuda_synchronize(void) {
    (void)moe_cuda_capture_forbid("synchronize (the host waits for the stream)");
    MOE_CUDA_CHECK(cudaStreamSynchronize(moe_cuda_stream()));
}
