/*
 * Normal random fill on the device with the counter-based Philox generator of lib/rng.h.
 * Element i gets std · normal(seed, stream, i), computed in double exactly as the host
 * computes it, so a tensor filled here equals the one the CPU backend fills (up to the
 * last bit of the device's log/cos, which agree with glibc's to within an ulp of double
 * and therefore round to the same fp32 almost always).
 */
#include "cuda_common.cuh"
#include "cuda_ops.h"
#include "rng.h"

__global__ static void fill_normal_kernel(float *x, size_t n, unsigned long long seed,
                                          unsigned long long stream, double std) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] = (float)(std * moe_rng_normal(seed, stream, i));
}

extern "C" void moe_cuda_fill_normal(moe_real *x, size_t n, unsigned long long seed,
                                     unsigned long long stream, double std) {
    if (n == 0)
        return;
    unsigned blocks = moe_cdiv(n, 256);
    if (blocks > 65535u * 8)
        blocks = 65535u * 8;
    fill_normal_kernel<<<blocks, 256, 0, moe_cuda_stream()>>>(x, n, seed, stream, std);
    MOE_CUDA_LAUNCH_CHECK();
}
