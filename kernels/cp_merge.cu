/*
 * Context parallelism's device pieces (chapter 07, lib/context_parallel.c):
 *   cp_merge:  a partial attention result (y_b, lse_b) merged into the accumulated one
 *              (y, lse) by their log-sum-exp, the twin of moe_cp_merge() (lib/cp_layout.c);
 *   fill_real: lse rows set to −∞ before the first merge;
 *   copy_2d:   the strided row packing of the all-to-all of heads (cudaMemcpy2DAsync).
 *
 * The merge: one warp per query row (b, t, h). Every lane reads the two lse values and
 * computes the same weights in fp32, lse = max + log1p(exp(min − max)),
 * y = exp(lse_acc − lse)·y + exp(lse_b − lse)·y_b, each element loaded as bf16 and rounded
 * once; lane 0 writes the new lse after the warp has read the old one. The −∞ rules are the
 * CPU's: a part at −∞ leaves the row untouched, an accumulator at −∞ takes the part as it
 * is (both at −∞: the row stays at −∞ with its y). fp32 where the CPU uses double: the
 * weights are in [0, 1], so the difference is fp32 rounding, far below bf16's.
 */
#include "cuda_common.cuh"
#include "cuda_ops.h"

static __global__ void cp_merge_kernel(moe_bf16 *y, float *lse, const moe_bf16 *y_b,
                                       const float *lse_b, int B, int T, int H, int D) {
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= (long long)B * T * H)
        return; /* a whole warp leaves together: rows are per warp */
    const int h = (int)(row % H), t = (int)(row / H % T), b = (int)(row / ((long long)H * T));
    const size_t l = ((size_t)b * H + h) * T + t, off = (size_t)row * D;
    const float la = lse[l], lb = lse_b[l];
    __syncwarp();
    if (isinf(lb) && lb < 0)
        return;
    if (isinf(la) && la < 0) {
        for (int d = lane; d < D; d += 32)
            y[off + d] = y_b[off + d];
        if (lane == 0)
            lse[l] = lb;
        return;
    }
    const float hi = fmaxf(la, lb), lo = fminf(la, lb);
    const float m = hi + log1pf(expf(lo - hi));
    const float wa = expf(la - m), wb = expf(lb - m);
    for (int d = lane; d < D; d += 32)
        y[off + d] = moe_st(wa * moe_ld(y[off + d]) + wb * moe_ld(y_b[off + d]));
    if (lane == 0)
        lse[l] = m;
}

extern "C" void moe_cuda_cp_merge(void *y, moe_real *lse, const void *y_b, const moe_real *lse_b,
                                  int B, int T, int H, int D) {
    const long long rows = (long long)B * T * H;
    if (rows == 0)
        return;
    const int warps = 8; /* rows per block */
    cp_merge_kernel<<<(unsigned)moe_cdiv(rows, warps), 32 * warps, 0, moe_cuda_stream()>>>(
        (moe_bf16 *)y, lse, (const moe_bf16 *)y_b, lse_b, B, T, H, D);
    MOE_CUDA_LAUNCH_CHECK();
}

static __global__ void fill_real_kernel(float *x, float v, size_t n) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        x[i] = v;
}

extern "C" void moe_cuda_fill_real(moe_real *x, double v, size_t n) {
    if (n == 0)
        return;
    size_t blocks = moe_cdiv(n, 256);
    fill_real_kernel<<<(unsigned)(blocks < 65536 ? blocks : 65536), 256, 0, moe_cuda_stream()>>>(
        x, (float)v, n);
    MOE_CUDA_LAUNCH_CHECK();
}

extern "C" void moe_cuda_copy_2d(void *dst, size_t dpitch, const void *src, size_t spitch,
                                 size_t width, size_t rows) {
    if (width == 0 || rows == 0)
        return;
    MOE_CUDA_CHECK(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, rows,
                                     cudaMemcpyDeviceToDevice, moe_cuda_stream()));
}
