/*
 * Token permutation on the GPU: group the N·k (token, expert) assignments by expert,
 * and copy tokens (and their routing weights) to and from that layout.
 * CPU twin: lib/cpu/permute.c. (The routing weight's product with the activation, and its
 * gradient, are fused into the SwiGLU kernels: kernels/swiglu.cu.)
 *
 * The index: a STABLE counting sort of the assignments a = n·k + j by expert
 * topk_idx[a], giving perm_src[r] (the assignment at permuted row r) and row_of[a] (its
 * inverse). Stable means: inside an expert, assignments keep increasing a — exactly the
 * CPU's order, so both backends produce identical maps. Three small kernels, no sorting
 * library, integer arithmetic only (deterministic by construction):
 *
 *   1. histogram   the assignments are cut into chunks of CHUNK; block c counts its
 *                  chunk per expert (shared-memory integer atomics) into hist[c][e].
 *   2. scan        one thread per expert turns its column hist[·][e] into an exclusive
 *                  prefix over chunks (where chunk c's first e-row goes, relative to e);
 *                  thread 0 scans the expert totals into expert_offset[0..E].
 *   3. scatter     one warp per chunk walks its chunk in order, 32 assignments at a
 *                  time. __match_any_sync groups the lanes that hold the same expert;
 *                  a lane's rank among its peers is the number of lower lanes with the
 *                  same expert; row = cursor[e] + rank; then the lowest peer advances
 *                  cursor[e] by the peer count. Lanes, tiles and chunks are visited in
 *                  assignment order, so the result is the stable order.
 *
 * expert_offset and the per-expert counts are needed on the HOST by the naive MoE loop
 * (one GEMM per expert, with its row count): moe_cuda_permute_index copies the E+1 offsets
 * back and synchronises. moe_cuda_permute_index_budget (chapter 06) does not: the offsets
 * stay in device memory for the grouped kernel, which reads them there, and the permuted
 * buffers have a static number of rows, the budget. The scan clamps the offsets to the
 * budget and, when the assignments need more rows, ORs MOE_STEP_OVERFLOW into the
 * step-flags word; the scatter writes no row at or past the budget (row_of = -1 there, and
 * the combine skips it). The host learns of it at the step boundary and re-runs the step
 * with grown buffers (lib/model.h, moe_model_grow_moe_budget).
 *
 * The data movers (bf16 rows, fp32 accumulation, no atomics):
 *   permute_tokens     xp[r, :] = x[perm_src[r] / k, :]
 *   permute_weights    wp[r] = topk_w[perm_src[r]]
 *   unpermute_sum      out[n, :] += Σ_j yp[row_of[n·k + j], :]: one thread per column
 *                      starts from out in fp32, adds the k rows in j order (the CPU's
 *                      order), rounds to bf16 once
 *   unpermute_sum_slots  the same sum, but row j of token n is row n·k + j (fc2 scattered
 *                      its rows there: the fused permutation), skipped where row_of < 0:
 *                      the same values added in the same order, so bit for bit the same
 *   unpermute_weights  dtopk_w[a] += dwp[row_of[a]]
 * Row kernels move 8 bf16 (16 bytes, moe_bf16x8) per access when the width is a multiple
 * of 8 and the pointers are 16-byte aligned (moe_vec8_ok), and one element at a time
 * otherwise.
 */
#include <limits.h>
#include <stdint.h>

#include "cuda_common.cuh"
#include "cuda_ops.h"
#include "step_flags.h"

#define FULL_MASK 0xffffffffu
#define CHUNK 1024 /* assignments per chunk of the counting sort */

/* ------------------------------------------------------------------ scratch */

static void *scratch(size_t bytes) { return moe_cuda_scratch(MOE_SCRATCH_PERMUTE, bytes); }

/* ------------------------------------------------------------------ the index */

static __global__ void chunk_histogram_kernel(int *hist, const int *topk_idx, int A, int E) {
    extern __shared__ int h[];
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        h[e] = 0;
    __syncthreads();
    const int begin = blockIdx.x * CHUNK, end = min(A, begin + CHUNK);
    for (int a = begin + threadIdx.x; a < end; a += blockDim.x)
        atomicAdd(&h[topk_idx[a]], 1);
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        hist[(size_t)blockIdx.x * E + e] = h[e];
}

/* One block, one thread per expert (E <= 1024). With a budget, @p clamped receives the
 * offsets clamped to it and @p flags the overflow bit (both NULL: no budget). */
static __global__ void chunk_scan_kernel(int *hist, int *offset, int chunks, int E, int budget,
                                         int *clamped, int *flags) {
    extern __shared__ int tot[];
    const int e = threadIdx.x;
    if (e < E) {
        int run = 0;
        for (int c = 0; c < chunks; c++) {
            int h = hist[(size_t)c * E + e];
            hist[(size_t)c * E + e] = run;
            run += h;
        }
        tot[e] = run;
    }
    __syncthreads();
    if (e == 0) {
        int run = 0;
        for (int i = 0; i < E; i++) {
            offset[i] = run;
            run += tot[i];
        }
        offset[E] = run;
        if (clamped) {
            for (int i = 0; i <= E; i++)
                clamped[i] = min(offset[i], budget);
            if (run > budget)
                atomicOr(flags, MOE_STEP_OVERFLOW);
        }
    }
}

/* One warp per chunk. */
static __global__ void chunk_scatter_kernel(int *perm_src, int *row_of, const int *topk_idx,
                                            const int *hist, const int *offset, int A, int E,
                                            int budget) {
    extern __shared__ int cursor[];
    const int lane = threadIdx.x;
    for (int e = lane; e < E; e += 32)
        cursor[e] = offset[e] + hist[(size_t)blockIdx.x * E + e];
    __syncwarp();
    const int begin = blockIdx.x * CHUNK, end = min(A, begin + CHUNK);
    for (int t = begin; t < end; t += 32) {
        const int a = t + lane;
        const bool valid = a < end;
        const int e = valid ? topk_idx[a] : -1 - lane; /* invalid lanes match nobody */
        const unsigned peers = __match_any_sync(FULL_MASK, e);
        const int rank = __popc(peers & ((1u << lane) - 1));
        const int r = valid ? cursor[e] + rank : 0;
        __syncwarp(); /* every lane has read its cursor before the leader moves it */
        if (valid) {
            if (r < budget) /* no row at or past the budget: the step is re-run */
                perm_src[r] = a;
            row_of[a] = r < budget ? r : -1;
            if (__ffs(peers) - 1 == lane)
                cursor[e] += __popc(peers);
        }
        __syncwarp();
    }
}

/* The three kernels of the index; returns the E+1 unclamped offsets (scratch). With a
 * budget (clamped != NULL) rows at or past it are not written. */
static const int *index_launch(int *perm_src, int *row_of, const int *topk_idx, int A, int E,
                               int budget, int *clamped, int *flags) {
    if (E > 1024) {
        fprintf(stderr, "moe_cuda_permute_index: E = %d > 1024 experts\n", E);
        exit(1);
    }
    cudaStream_t st = moe_cuda_stream();
    const int chunks = (int)moe_cdiv(A, CHUNK);
    int *d_off = (int *)scratch(sizeof(int) * ((size_t)chunks * E + E + 1));
    int *hist = d_off + E + 1;
    const size_t sh = sizeof(int) * E;
    chunk_histogram_kernel<<<chunks, 256, sh, st>>>(hist, topk_idx, A, E);
    MOE_CUDA_LAUNCH_CHECK();
    chunk_scan_kernel<<<1, 32 * moe_cdiv(E, 32), sh, st>>>(hist, d_off, chunks, E, budget,
                                                          clamped, flags);
    MOE_CUDA_LAUNCH_CHECK();
    chunk_scatter_kernel<<<chunks, 32, sh, st>>>(perm_src, row_of, topk_idx, hist, d_off, A, E,
                                                 budget);
    MOE_CUDA_LAUNCH_CHECK();
    return d_off;
}

extern "C" void moe_cuda_permute_index(int *perm_src, int *row_of, int *expert_offset,
                                       int *dev_offset, long long *counts, const int *topk_idx,
                                       int N, int k, int E) {
    const int A = N * k;
    if (A <= 0) {
        for (int e = 0; e <= E; e++)
            expert_offset[e] = 0;
        if (dev_offset)
            MOE_CUDA_CHECK(cudaMemsetAsync(dev_offset, 0, sizeof(int) * (E + 1), moe_cuda_stream()));
        return;
    }
    cudaStream_t st = moe_cuda_stream();
    const int *d_off = index_launch(perm_src, row_of, topk_idx, A, E, INT_MAX, NULL, NULL);
    if (dev_offset) /* the grouped kernel reads them from device memory */
        MOE_CUDA_CHECK(cudaMemcpyAsync(dev_offset, d_off, sizeof(int) * (E + 1),
                                       cudaMemcpyDeviceToDevice, st));
    /* the host sync of the naive MoE loop */
    MOE_CUDA_CHECK(
        cudaMemcpyAsync(expert_offset, d_off, sizeof(int) * (E + 1), cudaMemcpyDeviceToHost, st));
    MOE_CUDA_CHECK(cudaStreamSynchronize(st));
    if (counts)
        for (int e = 0; e < E; e++)
            counts[e] += expert_offset[e + 1] - expert_offset[e];
}

/* Chapter 06: the same index with a static budget of rows, nothing back to the host. */
extern "C" void moe_cuda_permute_index_budget(int *perm_src, int *row_of, int *expert_offset,
                                              int *flags, const int *topk_idx, int N, int k,
                                              int E, int budget) {
    const int A = N * k;
    if (A <= 0) {
        MOE_CUDA_CHECK(cudaMemsetAsync(expert_offset, 0, sizeof(int) * (E + 1), moe_cuda_stream()));
        return;
    }
    index_launch(perm_src, row_of, topk_idx, A, E, budget, expert_offset, flags);
}

/* Chapter 06: the fused dispatcher's plan from the all-gathered offsets, on the device
 * (the math: moe_cpu_fused_plan in lib/cpu/moe_ops.h). One block: thread e first sums
 * every rank's rows for expert e into shared memory, then finds e's shift; threads
 * el <= EL the local experts' offsets. E <= 1023, P·E small: a few µs, and no host. */
static __global__ void fused_plan_kernel(int *shift, int *expert_offset, int *flags,
                                         const int *all_off, int P, int rank, int E, int budget) {
    extern __shared__ long long per_expert[]; /* Σ_p c[p][e] */
    const int EL = E / P, W = E + 1;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        long long t = 0;
        for (int p = 0; p < P; p++)
            t += all_off[p * W + e + 1] - all_off[p * W + e];
        per_expert[e] = t;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const int q = e / EL;
        long long base = 0; /* q's earlier local experts, then the earlier ranks' rows for e */
        for (int l = q * EL; l < e; l++)
            base += per_expert[l];
        for (int p = 0; p < rank; p++)
            base += all_off[p * W + e + 1] - all_off[p * W + e];
        shift[e] = (int)(base - all_off[rank * W + e]);
    }
    for (int el = threadIdx.x; el <= EL; el += blockDim.x) {
        long long off = 0;
        for (int l = 0; l < el; l++)
            off += per_expert[rank * EL + l];
        expert_offset[el] = off < budget ? (int)off : budget;
        if (el == EL && off > budget && flags)
            atomicOr(flags, MOE_STEP_OVERFLOW);
    }
}

extern "C" void moe_cuda_fused_plan(int *shift, int *expert_offset, int *flags, const int *all_off,
                                    int P, int rank, int E, int budget) {
    const int threads = 32 * moe_cdiv(E + 1 < 1024 ? E + 1 : 1024, 32);
    fused_plan_kernel<<<1, threads, sizeof(long long) * E, moe_cuda_stream()>>>(
        shift, expert_offset, flags, all_off, P, rank, E, budget);
    MOE_CUDA_LAUNCH_CHECK();
}

/* ------------------------------------------------------------------ row movers */

/* One block per permuted row. */
template <bool VEC>
static __global__ void permute_tokens_kernel(moe_bf16 *xp, const moe_bf16 *x, const int *perm_src,
                                             int k, int C) {
    const size_t r = blockIdx.x;
    const moe_bf16 *src = x + (size_t)(perm_src[r] / k) * C;
    moe_bf16 *dst = xp + r * C;
    if (VEC) {
        for (int c = threadIdx.x; c < C / 8; c += blockDim.x)
            ((uint4 *)dst)[c] = ((const uint4 *)src)[c];
    } else {
        for (int c = threadIdx.x; c < C; c += blockDim.x)
            dst[c] = src[c];
    }
}

extern "C" void moe_cuda_permute_tokens(void *xp, const void *x, const int *perm_src, int rows,
                                        int k, int C) {
    if (rows <= 0 || C <= 0)
        return;
    cudaStream_t st = moe_cuda_stream();
    if (moe_vec8_ok(C, xp, x))
        permute_tokens_kernel<true>
            <<<rows, 128, 0, st>>>((moe_bf16 *)xp, (const moe_bf16 *)x, perm_src, k, C);
    else
        permute_tokens_kernel<false>
            <<<rows, 128, 0, st>>>((moe_bf16 *)xp, (const moe_bf16 *)x, perm_src, k, C);
    MOE_CUDA_LAUNCH_CHECK();
}

static __global__ void permute_weights_kernel(float *wp, const float *topk_w, const int *perm_src,
                                              int rows) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < rows)
        wp[r] = topk_w[perm_src[r]];
}

extern "C" void moe_cuda_permute_weights(moe_real *wp, const moe_real *topk_w, const int *perm_src,
                                         int rows) {
    if (rows <= 0)
        return;
    permute_weights_kernel<<<moe_cdiv(rows, 256), 256, 0, moe_cuda_stream()>>>(wp, topk_w, perm_src,
                                                                               rows);
    MOE_CUDA_LAUNCH_CHECK();
}

/* One block per token; its k source rows are read once into shared memory. SLOTS: row j
 * of token n is row n·k + j of yp (fc2 scattered it there), where row_of says it exists. */
template <bool VEC, bool SLOTS>
static __global__ void unpermute_sum_kernel(moe_bf16 *out, const moe_bf16 *yp, const int *row_of,
                                            int k, int C) {
    __shared__ int rows[64]; /* k <= MOE_MAX_TOPK = 64 */
    const size_t n = blockIdx.x;
    for (int j = threadIdx.x; j < k; j += blockDim.x) {
        const int r = row_of[n * k + j];
        rows[j] = SLOTS && r >= 0 ? (int)(n * k + j) : r;
    }
    __syncthreads();
    moe_bf16 *o = out + n * C;
    if (VEC) {
        for (int c = threadIdx.x; c < C / 8; c += blockDim.x) {
            moe_bf16x8 v;
            v.u = ((const uint4 *)o)[c];
            float acc[8];
            for (int i = 0; i < 8; i++)
                acc[i] = moe_ld(v.h[i]);
            for (int j = 0; j < k; j++) {
                if (rows[j] < 0) /* over the budget: no row (the step is re-run) */
                    continue;
                moe_bf16x8 y;
                y.u = ((const uint4 *)(yp + (size_t)rows[j] * C))[c];
                for (int i = 0; i < 8; i++)
                    acc[i] += moe_ld(y.h[i]);
            }
            for (int i = 0; i < 8; i++)
                v.h[i] = moe_st(acc[i]);
            ((uint4 *)o)[c] = v.u;
        }
    } else {
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            float acc = moe_ld(o[c]);
            for (int j = 0; j < k; j++)
                if (rows[j] >= 0)
                    acc += moe_ld(yp[(size_t)rows[j] * C + c]);
            o[c] = moe_st(acc);
        }
    }
}

template <bool SLOTS>
static void unpermute_sum_launch(void *out, const void *yp, const int *row_of, int N, int k,
                                 int C) {
    if (N <= 0 || C <= 0)
        return;
    if (k > 64) {
        fprintf(stderr, "moe_cuda_unpermute_sum: k = %d > 64\n", k);
        exit(1);
    }
    cudaStream_t st = moe_cuda_stream();
    if (moe_vec8_ok(C, out, yp))
        unpermute_sum_kernel<true, SLOTS>
            <<<N, 128, 0, st>>>((moe_bf16 *)out, (const moe_bf16 *)yp, row_of, k, C);
    else
        unpermute_sum_kernel<false, SLOTS>
            <<<N, 128, 0, st>>>((moe_bf16 *)out, (const moe_bf16 *)yp, row_of, k, C);
    MOE_CUDA_LAUNCH_CHECK();
}

extern "C" void moe_cuda_unpermute_sum(void *out, const void *yp, const int *row_of, int N, int k,
                                       int C) {
    unpermute_sum_launch<false>(out, yp, row_of, N, k, C);
}

extern "C" void moe_cuda_unpermute_sum_slots(void *out, const void *ys, const int *row_of, int N,
                                             int k, int C) {
    unpermute_sum_launch<true>(out, ys, row_of, N, k, C);
}

static __global__ void unpermute_weights_kernel(float *dtopk_w, const float *dwp, const int *row_of,
                                                int A) {
    int a = blockIdx.x * blockDim.x + threadIdx.x;
    if (a < A && row_of[a] >= 0)
        dtopk_w[a] += dwp[row_of[a]];
}

extern "C" void moe_cuda_unpermute_weights(moe_real *dtopk_w, const moe_real *dwp,
                                           const int *row_of, int N, int k) {
    const int A = N * k;
    if (A <= 0)
        return;
    unpermute_weights_kernel<<<moe_cdiv(A, 256), 256, 0, moe_cuda_stream()>>>(dtopk_w, dwp, row_of,
                                                                              A);
    MOE_CUDA_LAUNCH_CHECK();
}
