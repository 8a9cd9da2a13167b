/*
 * Optimizer ops on the GPU, all in full precision (fp32 buffers, double math):
 *   sum_squares  *acc += Σ x²  (the global gradient norm for clipping)
 *   sum          *acc += Σ x
 *   add_f64      dst += src (the step's partial sums)
 *   scale_real   x *= s
 *   adamw        one AdamW update per element of every run of the step in one launch (the
 *                multi-tensor AdamW), the gradient times the clip factor, skipped while the
 *                step flags hold a bit; it also writes the bf16 compute copy of the result
 *   loss_accumulate, grad_norm_finalize   the step's scalars (step_scalars.h)
 *
 * Deterministic reductions. A floating-point sum depends on its order; summing with
 * atomics would make the gradient norm — and so the clipped update — wobble from run
 * to run. Instead, two passes with a FIXED shape:
 *   pass 1: a grid of `blocks` blocks (a function of n only); thread t of block b sums
 *           elements i ≡ b·THREADS + t (mod blocks·THREADS), in increasing i, in
 *           double; the block combines its threads with a fixed tree → partial[b];
 *   pass 2: one block sums partial[0..blocks) with the same fixed tree.
 * Pass 2 adds the double into *acc, which stays in device memory (chapter 06: until
 * chapter 05 the op returned it, a copy to the host and a sync per call). The CPU reference sums fixed 4096-element blocks in order, also in double; the two
 * agree to ~1e-15 relative, not bit for bit.
 *
 * AdamW is elementwise and calls moe_adamw_update() from lib/optimizer.h — the very
 * function the CPU backend calls (it is MOE_HOSTDEV: compiled for host and device), so
 * the update rule exists once. Math in double, state (m, v) stored in fp32. It reads two
 * words of device memory written earlier in the same step: the clip factor (every thread
 * multiplies its gradient by it, (float)(g·c) exactly as the in-place clip did, so clipping
 * costs no pass of its own) and the step flags (a bit set: the update is skipped without the
 * host deciding anything). It also writes bf16(p) right after p, the bits cast_to_act would
 * write, so the step needs no cast pass of its own: 2 bytes more per element where the
 * separate pass read 4 and wrote 2 (on a skipped step it writes only that copy, of the
 * unchanged p). The one launch walks every run of the step (see adamw_kernel). The step's
 * scalars are finished by
 * one-thread kernels that call the MOE_HOSTDEV functions of step_scalars.h, as the CPU does.
 */
#include "cuda_common.cuh"
#include "cuda_ops.h"
#include "optimizer.h"

#define THREADS 256
#define MAX_BLOCKS 1024 /* pass-1 blocks: enough to saturate the memory system */

static_assert(MOE_ADAMW_CHUNK % (4 * THREADS) == 0,
              "an AdamW chunk is whole passes of 4 elements per thread");


/* pass 1: partial[b] = Σ over this block's grid-stride elements of x (or x²) */
static __global__ void sum_partial_kernel(double *partial, const float *x, size_t n, int square) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    double acc = moe_strided_sum<4>(x, (size_t)blockIdx.x * blockDim.x + threadIdx.x, n, stride,
                                    [square](double v) { return square ? v * v : v; });
    acc = moe_block_sum<double>(acc);
    if (threadIdx.x == 0)
        partial[blockIdx.x] = acc;
}

/* pass 2 (one block): *acc += Σ_b partial[b] */
static __global__ void sum_final_kernel(double *acc_out, const double *partial, int blocks) {
    double acc = 0.0;
    for (int b = threadIdx.x; b < blocks; b += blockDim.x)
        acc += partial[b];
    acc = moe_block_sum<double>(acc);
    if (threadIdx.x == 0)
        *acc_out += acc;
}

static void reduce(double *acc, const float *x, size_t n, int square) {
    if (n == 0)
        return; /* *acc += 0 */
    /* MAX_BLOCKS partials: a scratch slot, sized by the first call (the stream orders every
     * use, and the result goes to *acc, in the caller's memory) */
    double *g_partial =
        (double *)moe_cuda_scratch(MOE_SCRATCH_REDUCE, MAX_BLOCKS * sizeof(double));
    cudaStream_t st = moe_cuda_stream();
    size_t b = moe_cdiv(n, THREADS * 4); /* at least ~4 elements per thread */
    const int blocks = (int)(b < MAX_BLOCKS ? b : MAX_BLOCKS);
    sum_partial_kernel<<<blocks, THREADS, 0, st>>>(g_partial, x, n, square);
    MOE_CUDA_LAUNCH_CHECK();
    sum_final_kernel<<<1, THREADS, 0, st>>>(acc, g_partial, blocks);
    MOE_CUDA_LAUNCH_CHECK();
}

extern "C" void moe_cuda_sum_squares(double *acc, const moe_real *x, size_t n) {
    reduce(acc, x, n, 1);
}

extern "C" void moe_cuda_sum(double *acc, const moe_real *x, size_t n) { reduce(acc, x, n, 0); }

static __global__ void add_f64_kernel(double *dst, const double *src, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        dst[i] += src[i];
}

extern "C" void moe_cuda_add_f64(double *dst, const double *src, int n) {
    if (n <= 0)
        return;
    add_f64_kernel<<<1, 32, 0, moe_cuda_stream()>>>(dst, src, n);
    MOE_CUDA_LAUNCH_CHECK();
}

/* The step's scalars: a handful of doubles, one thread, the host's formulas. */
static __global__ void loss_accumulate_kernel(double *step, const double *mb, int N,
                                              double accum) {
    moe_step_loss_accumulate(step, mb, N, accum);
}

static __global__ void grad_norm_finalize_kernel(moe_step_scalars *s, double max_norm,
                                                 int check) {
    moe_step_grad_norm_finalize(s, max_norm, check);
}

extern "C" void moe_cuda_loss_accumulate(double *step, const double *mb, int N, double accum) {
    loss_accumulate_kernel<<<1, 1, 0, moe_cuda_stream()>>>(step, mb, N, accum);
    MOE_CUDA_LAUNCH_CHECK();
}

extern "C" void moe_cuda_grad_norm_finalize(moe_step_scalars *s, double max_norm, int check) {
    grad_norm_finalize_kernel<<<1, 1, 0, moe_cuda_stream()>>>(s, max_norm, check);
    MOE_CUDA_LAUNCH_CHECK();
}

static __global__ void scale_real_kernel(float *x, double s, size_t n) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        x[i] = (float)(x[i] * s); /* in double, like the CPU */
}

/* Four consecutive elements in one 16-byte word (fp32) or one 8-byte word (bf16). */
union f32x4 {
    float4 v;
    float s[4];
};
union bf16x4 {
    uint2 u;
    moe_bf16 h[4];
};

/* The multi-tensor AdamW: ONE launch for every run of the step (op_types.h), a block per
 * chunk of MOE_ADAMW_CHUNK elements. Block b finds its run by a binary search over the runs'
 * first chunks (a few reads of a table every block shares, from the cache) and updates
 * elements [lo, hi) of it; thread t takes 4 consecutive elements at a time, lo + 4t,
 * lo + 4t + 4·THREADS, ... Where the run's four arrays start 16-byte aligned (and its bf16
 * copy 8-byte aligned) the 4 elements move as one float4 per array, else one by one, as the
 * ragged end of a run does: the math is moe_adamw_update() per element either way, so both
 * give the same bits. */
static __global__ void __launch_bounds__(THREADS)
    adamw_kernel(const moe_adamw_run *runs, int n_runs, float *p, const float *g, float *m,
                 float *v, moe_bf16 *act, double lr, double beta1, double beta2, double eps,
                 double wd, double bc1, double bc2, const double *clip, const int *flags,
                 const double *hyper) {
    const bool skip = flags && *flags; /* the step is skipped (step_flags.h) */
    if (skip && !act)
        return;
    if (hyper) { /* this step's values, from device memory (a replayed graph sees them) */
        lr = hyper[0];
        bc1 = hyper[1];
        bc2 = hyper[2];
    }
    const double c = clip ? *clip : 1.0;
    const moe_adamw_run r = runs[moe_adamw_run_of_chunk(runs, n_runs, blockIdx.x)];
    const size_t lo = ((size_t)blockIdx.x - r.chunk) * MOE_ADAMW_CHUNK;
    const size_t hi = lo + MOE_ADAMW_CHUNK < r.n ? lo + MOE_ADAMW_CHUNK : r.n;
    float *pr = p + r.weight, *mr = m + r.state, *vr = v + r.state;
    const float *gr = g + r.grad;
    moe_bf16 *ar = act ? act + r.grad : NULL;
    const double d = r.decay ? wd : 0.0;
    /* lo is a multiple of 4, so every 4-element group of an aligned run is aligned */
    const bool vec = ((uintptr_t)pr | (uintptr_t)gr | (uintptr_t)mr | (uintptr_t)vr) % 16 == 0 &&
                     (uintptr_t)ar % 8 == 0;
    for (size_t i = lo + 4 * (size_t)threadIdx.x; i < hi; i += 4 * (size_t)THREADS) {
        if (vec && i + 4 <= hi) {
            f32x4 P, G, M, V;
            P.v = *(const float4 *)(pr + i);
            if (!skip) {
                G.v = *(const float4 *)(gr + i);
                M.v = *(const float4 *)(mr + i);
                V.v = *(const float4 *)(vr + i);
#pragma unroll
                for (int k = 0; k < 4; k++)
                    moe_adamw_update(&P.s[k], (float)(G.s[k] * c), &M.s[k], &V.s[k], lr, beta1,
                                     beta2, eps, d, bc1, bc2);
                *(float4 *)(pr + i) = P.v;
                *(float4 *)(mr + i) = M.v;
                *(float4 *)(vr + i) = V.v;
            }
            if (ar) {
                bf16x4 A;
#pragma unroll
                for (int k = 0; k < 4; k++)
                    A.h[k] = moe_st(P.s[k]); /* what cast_to_act writes */
                *(uint2 *)(ar + i) = A.u;
            }
            continue;
        }
        const size_t e = i + 4 < hi ? i + 4 : hi; /* one by one: unaligned, or the ragged end */
        for (size_t j = i; j < e; j++) {
            if (!skip) /* g·1.0 == g exactly: no clip is no change */
                moe_adamw_update(&pr[j], (float)(gr[j] * c), &mr[j], &vr[j], lr, beta1, beta2,
                                 eps, d, bc1, bc2);
            if (ar)
                ar[j] = moe_st(pr[j]);
        }
    }
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

extern "C" void moe_cuda_adamw(const moe_adamw_runs *runs, moe_real *p, const moe_real *g,
                               float *m, float *v, void *act, double lr, double beta1,
                               double beta2, double eps, double wd, double bc1, double bc2,
                               const double *clip, const int *flags, const double *hyper) {
    if (runs->chunks == 0)
        return;
    MOE_ASSERT(runs->chunks <= 0x7fffffffu); /* the grid's x dimension (8.8e12 elements) */
    adamw_kernel<<<(unsigned)runs->chunks, THREADS, 0, moe_cuda_stream()>>>(
        runs->run, runs->n, p, g, m, v, (moe_bf16 *)act, lr, beta1, beta2, eps, wd, bc1, bc2,
        clip, flags, hyper);
    MOE_CUDA_LAUNCH_CHECK();
}
