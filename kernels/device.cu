/*
 * The device: its name, its dense bf16 peak (for MFU), and a timer made of CUDA events.
 *
 * What GPU is this, and what is its dense bf16 peak? MFU = achieved / peak needs the
 * second number, which the hardware does not report, so we keep the datasheet values of
 * the GPUs moe.c targets (dense, i.e. without 2:4 sparsity):
 *   H100 SXM 989 TFLOP/s, H200 989 TFLOP/s (same SMs and clocks as H100, more memory),
 *   B200 2250 TFLOP/s, GB200 2500 TFLOP/s (per GPU).
 * Unknown GPUs report 0 and the trainer prints no MFU rather than a wrong one.
 */
#include <string.h>

#include "cuda_common.cuh"
#include "cuda_ops.h"

extern "C" void moe_cuda_device_name(char *buf, size_t cap) {
    int dev = 0;
    cudaDeviceProp prop;
    MOE_CUDA_CHECK(cudaGetDevice(&dev));
    MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    snprintf(buf, cap, "%s (sm_%d%d, %.0f GiB)", prop.name, prop.major, prop.minor,
             prop.totalGlobalMem / 1073741824.0);
}

/* Free device memory now (cudaMemGetInfo), the budget of the model about to be allocated;
 * 0 when the runtime cannot say, which moe_memory_check() reads as "unknown". */
extern "C" size_t moe_cuda_memory_bytes(void) {
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return free_b;
}

extern "C" double moe_cuda_peak_tflops(void) {
    int dev = 0;
    cudaDeviceProp prop;
    MOE_CUDA_CHECK(cudaGetDevice(&dev));
    MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    const char *n = prop.name;
    if (strstr(n, "GB200"))
        return 2500.0;
    if (strstr(n, "B200"))
        return 2250.0;
    if (strstr(n, "H200"))
        return 989.0;
    if (strstr(n, "H100") && (strstr(n, "PCIe") || strstr(n, "PCI")))
        return 756.0;
    if (strstr(n, "H100"))
        return 989.0;
    return 0.0;
}

/* Timing with CUDA events: the host returns from a launch long before the kernel ends,
 * so a host clock around launches measures nothing. Two events recorded on the stream
 * bracket the work; cudaEventElapsedTime reads the GPU's own clock. */
static cudaEvent_t g_ev0 = NULL, g_ev1 = NULL;

extern "C" void moe_cuda_timer_begin(void) {
    if (!g_ev0) {
        MOE_CUDA_CHECK(cudaEventCreate(&g_ev0));
        MOE_CUDA_CHECK(cudaEventCreate(&g_ev1));
    }
    MOE_CUDA_CHECK(cudaEventRecord(g_ev0, moe_cuda_stream()));
}

extern "C" double moe_cuda_timer_end_ms(void) {
    float ms = 0.0f;
    MOE_CUDA_CHECK(cudaEventRecord(g_ev1, moe_cuda_stream()));
    MOE_CUDA_CHECK(cudaEventSynchronize(g_ev1));
    MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, g_ev0, g_ev1));
    return ms;
}
