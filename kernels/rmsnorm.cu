/*
 * RMSNorm on the GPU. y = x · r · w with r = 1/sqrt(mean(x²) + eps), per row of C.
 *
 * Forward: ONE BLOCK PER ROW. Each thread sums x² over a strided slice of the row
 * (consecutive threads read consecutive elements: coalesced), the partial sums are
 * combined by a warp shuffle reduction and then across warps through shared memory
 * (moe_block_sum of cuda_common.cuh). The tree has a fixed shape for a fixed block size, so the sum —
 * and everything downstream — is the same on every run. r is saved in fp32 for the
 * backward pass; y is rounded to bf16 once, at the end.
 *
 * Backward, per row (x̂ = x·r, g = dy ⊙ w; see lib/cpu/rmsnorm.c for the derivation):
 *   dx  = r · (g − x̂ · mean(g ⊙ x̂))      one block per row again: one reduction
 *                                          for the mean, then an elementwise pass
 *   dw += Σ_rows dy ⊙ x̂                   a reduction over ROWS for every column
 *
 * The column reduction for dw is the interesting one. Without atomics it is done in
 * two deterministic passes:
 *   pass 1: the rows are cut into fixed chunks of ROWS_PER_CHUNK; the thread for
 *           (chunk, column c) sums its chunk in row order → partial[chunk][c] (fp32);
 *   pass 2: the thread for column c adds the partials in chunk order into dw[c].
 * Both passes read rows of consecutive columns: coalesced. The chunking depends only
 * on N, so the rounding is fixed. (The CPU adds row by row into dw, so the two agree
 * to fp32 rounding, not bit for bit.)
 *
 * All sums are in fp32 (the CPU reference uses double for the row sums; with C in the
 * thousands the difference is ~1e-7 relative).
 */
#include "cuda_common.cuh"
#include "cuda_ops.h"

#define THREADS 256       /* threads per row block */
#define ROWS_PER_CHUNK 64 /* rows summed by one thread in pass 1 of dw (at least) */


static __global__ void rmsnorm_forward_kernel(moe_bf16 *out, float *rstd, const moe_bf16 *x,
                                              const moe_bf16 *w, int C, float eps) {
    const size_t row = (size_t)blockIdx.x * C;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float xv = moe_ld(x[row + c]);
        ss += xv * xv;
    }
    ss = moe_block_sum<float>(ss);
    const float r = 1.0f / sqrtf(ss / C + eps);
    if (threadIdx.x == 0)
        rstd[blockIdx.x] = r;
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        out[row + c] = moe_st(moe_ld(x[row + c]) * r * moe_ld(w[c]));
}

static __global__ void rmsnorm_backward_dx_kernel(moe_bf16 *dx, const moe_bf16 *dout,
                                                  const moe_bf16 *x, const moe_bf16 *w,
                                                  const float *rstd, int C) {
    const size_t row = (size_t)blockIdx.x * C;
    const float r = rstd[blockIdx.x];
    float dot = 0.0f; /* Σ (dy⊙w) · x̂ */
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        dot += moe_ld(dout[row + c]) * moe_ld(w[c]) * moe_ld(x[row + c]) * r;
    const float mean = moe_block_sum<float>(dot) / C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float g = moe_ld(dout[row + c]) * moe_ld(w[c]);
        float d = r * (g - moe_ld(x[row + c]) * r * mean);
        dx[row + c] = moe_st(moe_ld(dx[row + c]) + d); /* accumulate */
    }
}

/* pass 1: partial[chunk, c] = Σ_{rows of chunk} dy[n,c] · x[n,c] · r[n] */
static __global__ void rmsnorm_dw_partial_kernel(float *partial, const moe_bf16 *dout,
                                                 const moe_bf16 *x, const float *rstd, int N,
                                                 int C, int rows_per_chunk) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int chunk = blockIdx.y;
    if (c >= C)
        return;
    const int n0 = chunk * rows_per_chunk;
    const int n1 = n0 + rows_per_chunk < N ? n0 + rows_per_chunk : N;
    float acc = 0.0f;
    for (int n = n0; n < n1; n++) {
        size_t i = (size_t)n * C + c;
        acc += moe_ld(dout[i]) * moe_ld(x[i]) * rstd[n];
    }
    partial[(size_t)chunk * C + c] = acc;
}

/* pass 2: dw[c] += Σ_chunks partial[chunk, c], in chunk order */
static __global__ void rmsnorm_dw_final_kernel(float *dw, const float *partial, int chunks,
                                               int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C)
        return;
    float acc = 0.0f;
    for (int k = 0; k < chunks; k++)
        acc += partial[(size_t)k * C + c];
    dw[c] += acc;
}

/* Scratch for the dw partials: a slot of the backend's scratch (cuda_common.cuh), sized in
 * the first step and never moved after (chapter 06's arena). */
static float *partial_buffer(size_t n) {
    return (float *)moe_cuda_scratch(MOE_SCRATCH_RMSNORM, n * sizeof(float));
}

extern "C" void moe_cuda_rmsnorm_forward(void *out, moe_real *rstd, const void *x, const void *w,
                                         int N, int C, double eps) {
    if (N == 0 || C == 0)
        return;
    rmsnorm_forward_kernel<<<N, THREADS, 0, moe_cuda_stream()>>>(
        (moe_bf16 *)out, rstd, (const moe_bf16 *)x, (const moe_bf16 *)w, C, (float)eps);
    MOE_CUDA_LAUNCH_CHECK();
}

extern "C" void moe_cuda_rmsnorm_backward(void *dx, moe_real *dw, const void *dout, const void *x,
                                          const void *w, const moe_real *rstd, int N, int C) {
    if (N == 0 || C == 0)
        return;
    cudaStream_t st = moe_cuda_stream();
    if (dx) {
        rmsnorm_backward_dx_kernel<<<N, THREADS, 0, st>>>(
            (moe_bf16 *)dx, (const moe_bf16 *)dout, (const moe_bf16 *)x, (const moe_bf16 *)w,
            rstd, C);
        MOE_CUDA_LAUNCH_CHECK();
    }
    if (dw) {
        /* grid.y is limited to 65535 chunks: longer chunks for (very) large N */
        int rows_per_chunk = ROWS_PER_CHUNK;
        if (moe_cdiv(N, rows_per_chunk) > 65535)
            rows_per_chunk = (int)moe_cdiv(N, 65535);
        const int chunks = (int)moe_cdiv(N, rows_per_chunk);
        float *partial = partial_buffer((size_t)chunks * C);
        dim3 grid(moe_cdiv(C, THREADS), chunks);
        rmsnorm_dw_partial_kernel<<<grid, THREADS, 0, st>>>(partial, (const moe_bf16 *)dout,
                                                            (const moe_bf16 *)x, rstd, N, C,
                                                            rows_per_chunk);
        MOE_CUDA_LAUNCH_CHECK();
        rmsnorm_dw_final_kernel<<<moe_cdiv(C, THREADS), THREADS, 0, st>>>(dw, partial, chunks, C);
        MOE_CUDA_LAUNCH_CHECK();
    }
}
