/**
 * @file cuda_common.cuh
 * @brief What every CUDA file of moe.c shares: error-checking macros, the stream, the
 *        cuBLAS handles, bf16 helpers and launch helpers.
 *
 * Error checking goes through one small set of macros that name file and line and
 * end the process with a message: a failed CUDA call is a bug or a broken device,
 * never a user error, so there is nothing to return to.
 */
#ifndef MOE_CUDA_COMMON_CUH
#define MOE_CUDA_COMMON_CUH

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/** Activation element type of the CUDA backend. */
typedef __nv_bfloat16 moe_bf16;

/** Abort with file and line when a CUDA runtime call fails. */
#define MOE_CUDA_CHECK(call)                                                                  \
    do {                                                                                      \
        cudaError_t moe_e_ = (call);                                                          \
        if (moe_e_ != cudaSuccess) {                                                          \
            fprintf(stderr, "CUDA error at %s:%d: %s (%s)\n", __FILE__, __LINE__,             \
                    cudaGetErrorString(moe_e_), #call);                                       \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

/** Abort with file and line when a cuBLAS / cuBLASLt call fails. */
#define MOE_CUBLAS_CHECK(call)                                                                \
    do {                                                                                      \
        cublasStatus_t moe_s_ = (call);                                                       \
        if (moe_s_ != CUBLAS_STATUS_SUCCESS) {                                                \
            fprintf(stderr, "cuBLAS error at %s:%d: %s (%s)\n", __FILE__, __LINE__,           \
                    cublasGetStatusString(moe_s_), #call);                                    \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

/**
 * Check the last kernel launch. A launch error (bad grid, too much shared memory) shows
 * here; an error *inside* the kernel (an illegal address) only shows at the next
 * synchronising call, far from its cause. With the environment variable
 * MOE_CUDA_SYNC_CHECK=1 every launch check also waits for the stream, so such an error is
 * reported at the launch that caused it (slow: for debugging only, and not inside a CUDA
 * graph capture).
 */
#define MOE_CUDA_LAUNCH_CHECK() moe_cuda_launch_check(__FILE__, __LINE__)

/** What MOE_CUDA_LAUNCH_CHECK() calls. @param file caller's file @param line caller's line */
void moe_cuda_launch_check(const char *file, int line);

/**
 * A kernel variant chosen by an environment variable (the switches the benchmarks compare):
 * the index of @p var's value among the @p n @p names (an empty name never matches), or
 * @p dflt where @p var is unset or empty. Any other value prints "moe.c: VAR=value: use
 * <help>, or unset it for the default (<names[dflt]>)" and exits with status 1: a misspelt
 * switch must not run the default while the user thinks it ran another variant.
 */
int moe_cuda_env_choice(const char *var, const char *const *names, int n, int dflt,
                        const char *help);

/** The stream every moe.c kernel and cuBLAS call runs on. */
cudaStream_t moe_cuda_stream(void);

/** The cuBLAS handle, bound to moe_cuda_stream() (created on first use). */
cublasHandle_t moe_cuda_cublas(void);

/** The current device's compute capability major (9: Hopper, 10: Blackwell), read once:
 *  the kernels built for sm_90a (wgmma, TMA) run only where it is 9. */
int moe_cuda_cc_major(void);

/** The number of SMs of the current device (queried once). */
static inline int moe_cuda_num_sms(void) {
    static int n = 0;
    if (!n) {
        int dev;
        MOE_CUDA_CHECK(cudaGetDevice(&dev));
        MOE_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    }
    return n;
}

/** How many blocks of @p kernel (@p threads threads, no dynamic shared memory) the device
 *  holds at once: its SMs times the blocks an SM holds (at least one). Not cached: a kernel
 *  type is shared by kernels of one signature, so the caller caches per kernel. */
template <typename K> static inline int moe_cuda_resident_blocks(K kernel, int threads) {
    int per_sm = 0;
    MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
    return moe_cuda_num_sms() * (per_sm > 0 ? per_sm : 1);
}

/** Let kernel @p K take @p bytes of dynamic shared memory, above the 48 KB a launch gets
 *  without asking: cudaFuncSetAttribute once per kernel and process (the flag is per
 *  instantiation of this template, so per kernel), not before every launch. */
template <auto K> static inline void moe_cuda_smem_opt_in(int bytes) {
    static bool done = false;
    if (!done) {
        MOE_CUDA_CHECK(
            cudaFuncSetAttribute(K, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
        done = true;
    }
}

/** The grid of a persistent kernel over @p tiles work items: one CTA an SM, and never more
 *  CTAs than items (0 when there are none: nothing to launch). */
static inline int moe_cuda_persistent_grid(int tiles) {
    return tiles < moe_cuda_num_sms() ? tiles : moe_cuda_num_sms();
}

/** ceil(a / b) for launch grids. */
static inline unsigned moe_cdiv(size_t a, size_t b) { return (unsigned)((a + b - 1) / b); }

/** 8 bf16 in one 16-byte word: row kernels move activations in these units (one 128-bit
 *  load or store per thread) when moe_vec8_ok() allows. */
union moe_bf16x8 {
    uint4 u;       /**< the 16 bytes, for the load / store */
    moe_bf16 h[8]; /**< the 8 elements */
};

/** True when rows of width @p C can move as ::moe_bf16x8: C is a multiple of 8 (so every
 *  row start stays 16-byte aligned) and each given pointer is 16-byte aligned (NULL ones
 *  are ignored). Otherwise kernels fall back to one element per access. */
static inline bool moe_vec8_ok(int C, const void *a, const void *b = nullptr,
                               const void *c = nullptr) {
    return C % 8 == 0 && (uintptr_t)a % 16 == 0 && (uintptr_t)b % 16 == 0 &&
           (uintptr_t)c % 16 == 0;
}

/** bf16 → float */
static __device__ __forceinline__ float moe_ld(const moe_bf16 x) { return __bfloat162float(x); }
/** float → bf16, round to nearest even */
static __device__ __forceinline__ moe_bf16 moe_st(float x) { return __float2bfloat16_rn(x); }

/* ------------------------------------------------------------ reductions
 * Butterfly reductions: every lane (thread) ends with the same value, and the tree has
 * a fixed shape for a fixed block size, so results are identical run to run. */

/** Sum over the 32 lanes of a warp. */
template <typename T> static __device__ __forceinline__ T moe_warp_sum(T v) {
    for (int off = 16; off; off >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

/** Maximum over the 32 lanes of a warp. */
static __device__ __forceinline__ float moe_warp_max(float v) {
    for (int off = 16; off; off >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

/** Softmax statistics over one warp: *max = max_j z[j] and *sum = Σ_j exp(z[j] − max) for
 *  j in [0, n), or over z[idx[j]] when @p idx is given (the k picked experts). Every lane
 *  gets both. */
static __device__ __forceinline__ void moe_warp_softmax_stats(const moe_bf16 *z, const int *idx,
                                                              int n, float *max, float *sum) {
    const int lane = threadIdx.x & 31;
    float m = -INFINITY;
    for (int j = lane; j < n; j += 32)
        m = fmaxf(m, moe_ld(z[idx ? idx[j] : j]));
    m = moe_warp_max(m);
    float s = 0.0f;
    for (int j = lane; j < n; j += 32)
        s += expf(moe_ld(z[idx ? idx[j] : j]) - m);
    *max = m;
    *sum = moe_warp_sum(s);
}

/** One thread's part of a strided sum: acc + f(x[i]) + f(x[i + s]) + f(x[i + 2s]) + ... for
 *  the indices below @p n, added in that order, in double, with U loads in flight at a time.
 *  A plain loop makes each add wait for its own load, so a reduction that one thread walks
 *  for many elements runs at one memory latency per element; loading U ahead keeps the order
 *  of the adds, and so the bits of the sum. */
template <int U, typename F>
static __device__ __forceinline__ double moe_strided_sum(const float *x, size_t i, size_t n,
                                                         size_t s, F f) {
    double acc = 0.0;
    for (; i + (U - 1) * s < n; i += U * s) {
        float v[U];
#pragma unroll
        for (int u = 0; u < U; u++)
            v[u] = x[i + u * s];
#pragma unroll
        for (int u = 0; u < U; u++)
            acc += f((double)v[u]);
    }
    for (; i < n; i += s)
        acc += f((double)x[i]);
    return acc;
}

/** Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread
 *  gets the result. Contains __syncthreads(): call it from every thread of the block. */
template <typename T> static __device__ T moe_block_sum(T v) {
    __shared__ T warp_vals[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = moe_warp_sum(v);
    __syncthreads(); /* warp_vals may still be read by a previous call */
    if (lane == 0)
        warp_vals[warp] = v;
    __syncthreads();
    v = lane < (int)((blockDim.x + 31) >> 5) ? warp_vals[lane] : (T)0;
    return moe_warp_sum(v);
}

/** Maximum over the whole block, as moe_block_sum. */
static __device__ float moe_block_max(float v) {
    __shared__ float warp_vals[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = moe_warp_max(v);
    __syncthreads();
    if (lane == 0)
        warp_vals[warp] = v;
    __syncthreads();
    v = lane < (int)((blockDim.x + 31) >> 5) ? warp_vals[lane] : -INFINITY;
    return moe_warp_max(v);
}

/* ------------------------------------------------------------ scratch memory */

/** Who owns a scratch buffer: one slot per user, so two ops never share one. */
typedef enum moe_scratch_slot {
    MOE_SCRATCH_AUX_LOSS = 0,
    MOE_SCRATCH_EMBEDDING,
    MOE_SCRATCH_PERMUTE,
    MOE_SCRATCH_GROUPED_GEMM,
    MOE_SCRATCH_WGRAD_SPLIT, /* fp32 partial weight gradients of a split-K wgrad */
    MOE_SCRATCH_GATHER,      /* rows a gathered grouped GEMM copies where it cannot gather */
    MOE_SCRATCH_RMSNORM,     /* fp32 partial sums of the RMSNorm weight gradient */
    MOE_SCRATCH_REDUCE,      /* the optimizer's fixed-shape reduction: partials and result */
    MOE_SCRATCH_CUBLAS,      /* cuBLAS's workspace, set once on the handle */
    MOE_SCRATCH_FP8_GEMM,    /* the FP8 GEMM's scale layouts and emulated bf16 operands */
    MOE_SCRATCH_SCATTER,     /* rows a scattering grouped GEMM computes where it cannot scatter */
    MOE_SCRATCH_ATTENTION_DQ, /* the fused Hopper attention backward's fp32 dq and semaphores */
    MOE_SCRATCH_SLOTS
} moe_scratch_slot;

/**
 * A device buffer of at least @p bytes for @p slot, kept between calls (the sizes repeat
 * every step) and grown when needed. Growing waits for queued work before freeing the
 * old buffer, so it happens in the first step (the warm-up) and never after: the sizes are
 * functions of the shapes, which repeat. Growing moves the buffer, so it also advances the
 * memory epoch (moe_cuda_memory_epoch()): a CUDA graph captured before holds the old
 * address and is captured again instead of replayed (graph.cu). Inside a capture growing is
 * refused: the capture is abandoned with the slot's name (moe_cuda_capture_forbid()).
 */
void *moe_cuda_scratch(moe_scratch_slot slot, size_t bytes);

/**
 * The one place the CUDA backend calls cudaMalloc: counted (moe_cuda_alloc_counts()), so a
 * test can assert that a training step allocates nothing after the first.
 * @param bytes size (0 is allocated as 1 byte)  @return the pointer, or NULL when out of memory
 */
void *moe_cuda_malloc_counted(size_t bytes);

/** The one place the CUDA backend calls cudaFree (counted), after the stream's queued work
 *  has finished. @param p pointer (NULL: no-op) */
void moe_cuda_free_counted(void *p);

/** How many times buffers moved (scratch growth); graphs captured at an older epoch are
 *  stale. @return the epoch */
unsigned long long moe_cuda_memory_epoch(void);

/** Advance the memory epoch: a device buffer that a captured CUDA graph may hold was freed
 *  or replaced (scratch growth; kernels/rope.cu's cos/sin tables), so such graphs are
 *  captured again instead of replayed. */
void moe_cuda_memory_moved(void);

/**
 * Where the backend would wait for the device, read device memory on the host, or allocate,
 * it first calls this with what it is about to do. Outside a capture it returns 0 and the
 * caller goes on. Inside a capture on moe_cuda_stream() the work cannot be recorded: the
 * capture is ended and thrown away, @p what is kept as the reason (moe_cuda_graph_end()
 * reports it as a named error), and it returns 1; the caller then goes on eagerly, because
 * the stream is no longer capturing.
 * @param what what could not be captured, e.g. "to_host (a device-to-host copy that waits)"
 * @return 1 when a capture was abandoned, else 0
 */
int moe_cuda_capture_forbid(const char *what);

#endif /* MOE_CUDA_COMMON_CUH */
