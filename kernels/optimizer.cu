/*
 * Optimizer ops on the GPU, all in full precision (fp32 buffers, double math):
 *   sum_squares  Σ x²  (the global gradient norm for clipping)
 *   sum          Σ x
 *   scale_real   x *= s (the clipping itself)
 *   adamw        one AdamW update per element
 *
 * Deterministic reductions. A floating-point sum depends on its order; summing with
 * atomics would make the gradient norm — and so the clipped update — wobble from run
 * to run. Instead, two passes with a FIXED shape:
 *   pass 1: a grid of `blocks` blocks (a function of n only); thread t of block b sums
 *           elements i ≡ b·THREADS + t (mod blocks·THREADS), in increasing i, in
 *           double; the block combines its threads with a fixed tree → partial[b];
 *   pass 2: one block sums partial[0..blocks) with the same fixed tree.
 * The double result is copied to the host (the op returns it), which synchronises.
 * The CPU reference sums fixed 4096-element blocks in order, also in double; the two
 * agree to ~1e-15 relative, not bit for bit.
 *
 * AdamW is elementwise and calls moe_adamw_update() from lib/optimizer.h — the very
 * function the CPU backend calls (it is MOE_HOSTDEV: compiled for host and device), so
 * the update rule exists once. Math in double, state (m, v) stored in fp32.
 */
#include "cuda_common.cuh"
#include "cuda_ops.h"
#include "optimizer.h"

#define THREADS 256
#define MAX_BLOCKS 1024 /* pass-1 blocks: enough to saturate the memory system */


/* pass 1: partial[b] = Σ over this block's grid-stride elements of x (or x²) */
static __global__ void sum_partial_kernel(double *partial, const float *x, size_t n, int square) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    double acc = 0.0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const double v = x[i];
        acc += square ? v * v : v;
    }
    acc = moe_block_sum<double>(acc);
    if (threadIdx.x == 0)
        partial[blockIdx.x] = acc;
}

/* pass 2 (one block): *out = Σ_b partial[b] */
static __global__ void sum_final_kernel(double *out, const double *partial, int blocks) {
    double acc = 0.0;
    for (int b = threadIdx.x; b < blocks; b += blockDim.x)
        acc += partial[b];
    acc = moe_block_sum<double>(acc);
    if (threadIdx.x == 0)
        *out = acc;
}

static double reduce(const float *x, size_t n, int square) {
    if (n == 0)
        return 0.0;
    /* MAX_BLOCKS partials and the result: a scratch slot, allocated by the first call */
    double *g_partial =
        (double *)moe_cuda_scratch(MOE_SCRATCH_REDUCE, (MAX_BLOCKS + 1) * sizeof(double));
    cudaStream_t st = moe_cuda_stream();
    size_t b = moe_cdiv(n, THREADS * 4); /* at least ~4 elements per thread */
    const int blocks = (int)(b < MAX_BLOCKS ? b : MAX_BLOCKS);
    sum_partial_kernel<<<blocks, THREADS, 0, st>>>(g_partial, x, n, square);
    MOE_CUDA_LAUNCH_CHECK();
    sum_final_kernel<<<1, THREADS, 0, st>>>(g_partial + MAX_BLOCKS, g_partial, blocks);
    MOE_CUDA_LAUNCH_CHECK();
    double result = 0.0;
    MOE_CUDA_CHECK(cudaMemcpyAsync(&result, g_partial + MAX_BLOCKS, sizeof(double),
                                   cudaMemcpyDeviceToHost, st));
    MOE_CUDA_CHECK(cudaStreamSynchronize(st));
    return result;
}

extern "C" double moe_cuda_sum_squares(const moe_real *x, size_t n) { return reduce(x, n, 1); }

extern "C" double moe_cuda_sum(const moe_real *x, size_t n) { return reduce(x, n, 0); }

static __global__ void scale_real_kernel(float *x, double s, size_t n) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        x[i] = (float)(x[i] * s); /* in double, like the CPU */
}

static __global__ void adamw_kernel(float *p, const float *g, float *m, float *v, size_t n,
                                    double lr, double beta1, double beta2, double eps, double wd,
                                    double bc1, double bc2) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        moe_adamw_update(&p[i], g[i], &m[i], &v[i], lr, beta1, beta2, eps, wd, bc1, bc2);
}

static unsigned grid_for(size_t n) {
    size_t b = moe_cdiv(n, THREADS);
    return (unsigned)(b < 65536 ? b : 65536);
}

extern "C" void moe_cuda_scale_real(moe_real *x, double s, size_t n) {
    if (n == 0)
        return;
    scale_real_kernel<<<grid_for(n), THREADS, 0, moe_cuda_stream()>>>(x, s, n);
    MOE_CUDA_LAUNCH_CHECK();
}

extern "C" void moe_cuda_adamw(moe_real *p, const moe_real *g, float *m, float *v, size_t n,
                               double lr, double beta1, double beta2, double eps, double wd,
                               double bc1, double bc2) {
    if (n == 0)
        return;
    adamw_kernel<<<grid_for(n), THREADS, 0, moe_cuda_stream()>>>(p, g, m, v, n, lr, beta1, beta2,
                                                                 eps, wd, bc1, bc2);
    MOE_CUDA_LAUNCH_CHECK();
}
