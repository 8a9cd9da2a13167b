/*
 * RMSNorm on the GPU. y = x · r · w with r = 1/sqrt(mean(x²) + eps), per row of C.
 *
 * Layout: ONE WARP PER ROW, WARPS rows per block. A row is cut into UNITS of 8 elements
 * (16 bytes); lane l owns units l, l+32, l+64, ... of its row, so one warp-wide access
 * moves 32 consecutive units (512 bytes: coalesced). Where the row is aligned (C a
 * multiple of 8 and every pointer 16-byte aligned: moe_vec8_ok) a unit is ONE 128-bit
 * load or store; otherwise (ragged C, odd pointers) the same unit is read element by
 * element, elements past C reading as 0 and never written. The sums add the same numbers
 * in the same order on both paths, so the result depends on C only, not on alignment.
 *
 * Why a warp and not a block per row: at the sizes that matter (C = 384 in the GPU preset)
 * a 256-thread block holds 1.5 elements per thread: most of its lanes idle, every load is
 * a 2-byte scalar, and each row pays two __syncthreads() reductions through shared memory.
 * A warp holds the whole row in 48 units, 1.5 per lane, reduces it with five shuffles
 * (moe_warp_sum: no shared memory, no barrier), and many rows are in flight per SM, which
 * is what hides the memory latency. Up to C = 32·8·MAX_REG_UNITS (1024) the units a lane
 * loaded stay in REGISTERS between the reduction and the write, so every element is read
 * from memory once and written once; above that the lane loops over its units twice and
 * the second read comes from the caches.
 *
 * Forward: ss = Σ x² (lane sums, then the warp's butterfly: a fixed tree for a fixed C, so
 * the sum — and everything downstream — is the same on every run), r saved in fp32 for the
 * backward pass, y rounded to bf16 once, at the end.
 *
 * Backward, per row (x̂ = x·r, g = dy ⊙ w; see lib/cpu/rmsnorm.c for the derivation):
 *   dx += r · (g − x̂ · mean(g ⊙ x̂))     one warp per row: one reduction for the mean,
 *                                          then an elementwise pass that ADDS into dx
 *   dw += Σ_rows dy ⊙ x̂                   a reduction over ROWS for every column
 *
 * The column reduction for dw is the interesting one. Without atomics it is done in
 * two deterministic passes:
 *   pass 1: the rows are cut into fixed chunks; each chunk's column sums go to
 *           partial[chunk][c] (fp32), in an order fixed by N and C.
 *           - C ≤ 1024 (the row in registers): pass 1 is FUSED into the dx kernel, since
 *             dy and x are already in registers there. A block's chunk is its
 *             WARPS·BWD_ROWS_PER_WARP rows; each lane adds dy ⊙ x̂ of its warp's rows into
 *             registers (its own units: the same columns in every row), the warps put
 *             their sums in shared memory and the block adds them in warp order. dy and
 *             x are read once for dx and dw together.
 *           - larger C: a separate kernel, the thread for (chunk, column c) summing its
 *             ROWS_PER_CHUNK rows in row order (consecutive threads, consecutive columns).
 *   pass 2: the FINAL_SLICES threads of a column each add every FINAL_SLICES-th partial
 *           in chunk order, then one adds the slices in order into dw[c]: the partials
 *           are read by many threads at once instead of one long chain per column.
 * The chunking depends only on N and C, so the rounding is fixed. (The CPU adds row by
 * row into dw, so the two agree to fp32 rounding, not bit for bit.)
 *
 * All sums are in fp32 (the CPU reference uses double for the row sums; with C in the
 * thousands the difference is ~1e-7 relative).
 */
#include <type_traits>

#include "cuda_common.cuh"
#include "cuda_ops.h"

#define WARPS 8             /* rows in flight per block: one warp each */
#define BWD_ROWS_PER_WARP 2 /* rows one warp of the dx kernel handles in turn (dw chunk) */
#define MAX_REG_UNITS 4     /* units per lane kept in registers: C ≤ 32·8·4 = 1024 */
#define ROWS_PER_CHUNK 64   /* rows summed by one thread in the unfused pass 1 of dw */
#define FINAL_SLICES 16     /* threads per column in pass 2 of dw */

/* ------------------------------------------------------------ row units */

/** Unit @p u (elements 8u .. 8u+7) of a row of C: one 16-byte load when VEC, else element
 *  by element with the elements past C read as 0. */
template <bool VEC>
static __device__ __forceinline__ moe_bf16x8 load8(const moe_bf16 *__restrict__ row, int u,
                                                   int C) {
    moe_bf16x8 v;
    if constexpr (VEC) {
        v.u = reinterpret_cast<const uint4 *>(row)[u];
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++)
            v.h[j] = 8 * u + j < C ? row[8 * u + j] : moe_st(0.0f);
    }
    return v;
}

/** Store unit @p u of a row of C (elements past C are not written). */
template <bool VEC>
static __device__ __forceinline__ void store8(moe_bf16 *__restrict__ row, int u, int C,
                                              const moe_bf16x8 &v) {
    if constexpr (VEC) {
        reinterpret_cast<uint4 *>(row)[u] = v.u;
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (8 * u + j < C)
                row[8 * u + j] = v.h[j];
    }
}

/**
 * Call f(u, k) for each unit u of this lane in ascending order (u = lane + 32k). With V > 0
 * the caller guarantees units ≤ 32·V and the loop is unrolled, so k is a constant that can
 * index register arrays; with V = 0 the loop strides over any number of units (k = 0).
 */
template <int V, typename F>
static __device__ __forceinline__ void for_units(int units, F &&f) {
    const int lane = threadIdx.x & 31;
    if constexpr (V > 0) {
#pragma unroll
        for (int k = 0; k < V; k++)
            if (lane + 32 * k < units)
                f(lane + 32 * k, k);
    } else {
#pragma unroll 4
        for (int u = lane; u < units; u += 32)
            f(u, 0);
    }
}

/* ------------------------------------------------------------ forward */

template <bool VEC, int V>
static __global__ void __launch_bounds__(WARPS * 32)
    rmsnorm_forward_kernel(moe_bf16 *__restrict__ out, float *__restrict__ rstd,
                           const moe_bf16 *__restrict__ x, const moe_bf16 *__restrict__ w,
                           int N, int C, float eps) {
    const int row = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (row >= N)
        return; /* the whole warp leaves: no shuffle below misses a lane */
    const size_t off = (size_t)row * C;
    const int units = (C + 7) / 8;
    moe_bf16x8 xv[V > 0 ? V : 1]; /* the lane's units, kept from the reduction to the write */
    float ss = 0.0f;
    for_units<V>(units, [&](int u, int k) {
        const moe_bf16x8 xu = load8<VEC>(x + off, u, C);
#pragma unroll
        for (int j = 0; j < 8; j++)
            ss += moe_ld(xu.h[j]) * moe_ld(xu.h[j]);
        if constexpr (V > 0)
            xv[k] = xu;
    });
    ss = moe_warp_sum(ss);
    const float r = 1.0f / sqrtf(ss / C + eps);
    if ((threadIdx.x & 31) == 0)
        rstd[row] = r;
    for_units<V>(units, [&](int u, int k) {
        moe_bf16x8 xu, o;
        if constexpr (V > 0)
            xu = xv[k];
        else
            xu = load8<VEC>(x + off, u, C);
        const moe_bf16x8 wu = load8<VEC>(w, u, C);
#pragma unroll
        for (int j = 0; j < 8; j++)
            o.h[j] = moe_st(moe_ld(xu.h[j]) * r * moe_ld(wu.h[j]));
        store8<VEC>(out + off, u, C, o);
    });
}

/* ------------------------------------------------------------ backward */

/**
 * dx += r·(g − x̂·mean(g ⊙ x̂)) for the block's WARPS·BWD_ROWS_PER_WARP rows (skipped when
 * dx is NULL) and, when @p partial is given (V > 0 only), partial[block][c] = Σ over those
 * rows of dy·x·r: pass 1 of dw, with WARPS·C floats of dynamic shared memory.
 */
template <bool VEC, int V>
static __global__ void __launch_bounds__(WARPS * 32)
    rmsnorm_backward_kernel(moe_bf16 *__restrict__ dx, float *__restrict__ partial,
                            const moe_bf16 *__restrict__ dout, const moe_bf16 *__restrict__ x,
                            const moe_bf16 *__restrict__ w, const float *__restrict__ rstd,
                            int N, int C) {
    extern __shared__ float warp_dw[]; /* [WARPS][C] */
    const int warp = threadIdx.x >> 5;
    const int units = (C + 7) / 8;
    float acc[V > 0 ? V : 1][8] = {}; /* Σ dy·x̂ over this warp's rows, for the lane's units */
    for (int i = 0; i < BWD_ROWS_PER_WARP; i++) {
        const int row = (blockIdx.x * BWD_ROWS_PER_WARP + i) * WARPS + warp;
        if (row >= N)
            break; /* whole warp; later rows are larger */
        const size_t off = (size_t)row * C;
        const float r = rstd[row];
        moe_bf16x8 xv[V > 0 ? V : 1], gv[V > 0 ? V : 1];
        float dot = 0.0f; /* Σ (dy⊙w) · x̂ */
        for_units<V>(units, [&](int u, int k) {
            const moe_bf16x8 xu = load8<VEC>(x + off, u, C), gu = load8<VEC>(dout + off, u, C);
            const moe_bf16x8 wu = load8<VEC>(w, u, C);
#pragma unroll
            for (int j = 0; j < 8; j++)
                dot += moe_ld(gu.h[j]) * moe_ld(wu.h[j]) * moe_ld(xu.h[j]) * r;
            if constexpr (V > 0) {
                xv[k] = xu, gv[k] = gu;
#pragma unroll
                for (int j = 0; j < 8; j++)
                    acc[k][j] += moe_ld(gu.h[j]) * moe_ld(xu.h[j]) * r;
            }
        });
        if (!dx)
            continue;
        const float mean = moe_warp_sum(dot) / C;
        for_units<V>(units, [&](int u, int k) {
            moe_bf16x8 xu, gu, o;
            if constexpr (V > 0)
                xu = xv[k], gu = gv[k];
            else
                xu = load8<VEC>(x + off, u, C), gu = load8<VEC>(dout + off, u, C);
            const moe_bf16x8 wu = load8<VEC>(w, u, C), du = load8<VEC>(dx + off, u, C);
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const float g = moe_ld(gu.h[j]) * moe_ld(wu.h[j]);
                const float d = r * (g - moe_ld(xu.h[j]) * r * mean);
                o.h[j] = moe_st(moe_ld(du.h[j]) + d); /* accumulate */
            }
            store8<VEC>(dx + off, u, C, o);
        });
    }
    if constexpr (V > 0) {
        if (!partial) /* the same for the whole block */
            return;
        float *mine = warp_dw + (size_t)warp * C; /* every column: the units cover the row */
        for_units<V>(units, [&](int u, int k) {
#pragma unroll
            for (int j = 0; j < 8; j++)
                if (8 * u + j < C)
                    mine[8 * u + j] = acc[k][j];
        });
        __syncthreads();
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            float s = 0.0f;
#pragma unroll
            for (int q = 0; q < WARPS; q++) /* in warp order: fixed */
                s += warp_dw[(size_t)q * C + c];
            partial[(size_t)blockIdx.x * C + c] = s;
        }
    }
}

/* unfused pass 1 (C > 32·8·MAX_REG_UNITS):
 * partial[chunk, c] = Σ_{rows of chunk} dy[n,c] · x[n,c] · r[n] */
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

/* pass 2: dw[c] += Σ_chunks partial[chunk, c]. Block (32 columns) × (FINAL_SLICES): slice s
 * adds chunks s, s + FINAL_SLICES, ... in order, then the slices are added in order. */
static __global__ void __launch_bounds__(32 * FINAL_SLICES)
    rmsnorm_dw_final_kernel(float *dw, const float *partial, int chunks, int C) {
    __shared__ float slice[FINAL_SLICES][32];
    const int c = blockIdx.x * 32 + threadIdx.x;
    float acc = 0.0f;
    if (c < C)
        for (int k = threadIdx.y; k < chunks; k += FINAL_SLICES)
            acc += partial[(size_t)k * C + c];
    slice[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        float s = 0.0f;
#pragma unroll
        for (int q = 0; q < FINAL_SLICES; q++)
            s += slice[q][threadIdx.x];
        dw[c] += s;
    }
}

/* ------------------------------------------------------------ launchers */

/* Scratch for the dw partials: a slot of the backend's scratch (cuda_common.cuh), sized in
 * the first step and never moved after (chapter 06's arena). */
static float *partial_buffer(size_t n) {
    return (float *)moe_cuda_scratch(MOE_SCRATCH_RMSNORM, n * sizeof(float));
}

/* Units per lane kept in registers for rows of C: the smallest of 1, 2, 4 that holds the
 * row (32 lanes · 8 elements each), or 0 (strided, the row re-read) above 1024. */
static int register_units(int C) {
    const int units = (C + 7) / 8;
    for (int v = 1; v <= MAX_REG_UNITS; v *= 2)
        if (units <= 32 * v)
            return v;
    return 0;
}

/* Call launch(VEC, V) with both as compile-time constants (std::integral_constant). */
template <typename F> static void dispatch(bool vec, int C, F &&launch) {
    auto with_units = [&](auto vec_c) {
        switch (register_units(C)) {
        case 1: launch(vec_c, std::integral_constant<int, 1>()); break;
        case 2: launch(vec_c, std::integral_constant<int, 2>()); break;
        case 4: launch(vec_c, std::integral_constant<int, 4>()); break;
        default: launch(vec_c, std::integral_constant<int, 0>()); break;
        }
    };
    if (vec)
        with_units(std::true_type());
    else
        with_units(std::false_type());
}

extern "C" void moe_cuda_rmsnorm_forward(void *out, moe_real *rstd, const void *x, const void *w,
                                         int N, int C, double eps) {
    if (N == 0 || C == 0)
        return;
    dispatch(moe_vec8_ok(C, out, x, w), C, [&](auto vec, auto v) {
        rmsnorm_forward_kernel<decltype(vec)::value, decltype(v)::value>
            <<<moe_cdiv(N, WARPS), WARPS * 32, 0, moe_cuda_stream()>>>(
                (moe_bf16 *)out, rstd, (const moe_bf16 *)x, (const moe_bf16 *)w, N, C,
                (float)eps);
    });
    MOE_CUDA_LAUNCH_CHECK();
}

extern "C" void moe_cuda_rmsnorm_backward(void *dx, moe_real *dw, const void *dout, const void *x,
                                          const void *w, const moe_real *rstd, int N, int C) {
    if (N == 0 || C == 0 || (!dx && !dw))
        return;
    cudaStream_t st = moe_cuda_stream();
    const bool fused = dw && register_units(C) > 0; /* pass 1 of dw inside the dx kernel */
    const unsigned blocks = moe_cdiv(N, WARPS * BWD_ROWS_PER_WARP);
    float *partial = NULL;
    int chunks = 0;
    if (fused) {
        chunks = (int)blocks;
        partial = partial_buffer((size_t)chunks * C);
    }
    if (dx || fused) {
        const bool vec = moe_vec8_ok(C, dx, dout, x) && moe_vec8_ok(C, w);
        const size_t smem = fused ? (size_t)WARPS * C * sizeof(float) : 0;
        dispatch(vec, C, [&](auto vec_c, auto v) {
            rmsnorm_backward_kernel<decltype(vec_c)::value, decltype(v)::value>
                <<<blocks, WARPS * 32, smem, st>>>(
                    (moe_bf16 *)dx, partial, (const moe_bf16 *)dout, (const moe_bf16 *)x,
                    (const moe_bf16 *)w, rstd, N, C);
        });
        MOE_CUDA_LAUNCH_CHECK();
    }
    if (dw && !fused) {
        /* grid.y is limited to 65535 chunks: longer chunks for (very) large N */
        int rows_per_chunk = ROWS_PER_CHUNK;
        if (moe_cdiv(N, rows_per_chunk) > 65535)
            rows_per_chunk = (int)moe_cdiv(N, 65535);
        chunks = (int)moe_cdiv(N, rows_per_chunk);
        partial = partial_buffer((size_t)chunks * C);
        dim3 grid(moe_cdiv(C, 256), chunks);
        rmsnorm_dw_partial_kernel<<<grid, 256, 0, st>>>(partial, (const moe_bf16 *)dout,
                                                        (const moe_bf16 *)x, rstd, N, C,
                                                        rows_per_chunk);
        MOE_CUDA_LAUNCH_CHECK();
    }
    if (dw) {
        rmsnorm_dw_final_kernel<<<moe_cdiv(C, 32), dim3(32, FINAL_SLICES), 0, st>>>(dw, partial,
                                                                                  chunks, C);
        MOE_CUDA_LAUNCH_CHECK();
    }
}
