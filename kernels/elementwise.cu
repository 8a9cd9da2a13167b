/*
 * Elementwise activation ops on the GPU (as the CPU backend's add and scale):
 *   add:   y += x     (the residual connections)
 *   scale: x *= s
 *
 * Each element is loaded as bf16, computed in fp32 and rounded to bf16 once:
 * y = bf16(float(y) + float(x)) is exactly the CPU's fp32 sum, rounded.
 *
 * Memory-bound, so the work is in the access width (chapter 06). The first version moved
 * one bf16 per thread and access: 2-byte loads, a warp reading 64 bytes per array per
 * step, at about twice the HBM floor of the preset's ~19 MB residual adds. Now a thread
 * moves 8 elements per 16-byte access (moe_bf16x8), the width a memory transaction has.
 * The arithmetic is unchanged (each element on its own in fp32, rounded once), so the
 * results are bit for bit those of the one-element version.
 *
 * Where 16-byte accesses cannot reach: the array is cut into
 *     head [0, h)  |  body [h, h + 8·nv): nv 16-byte units  |  tail: what is left (< 8)
 * with h (0..7) the elements before the first 16-byte boundary of y (a bf16 pointer is
 * 2-byte aligned, so h = (16 − y mod 16) / 2 mod 8). x must be at the same offset from a
 * 16-byte boundary as y for its units to be aligned too; when it is not (e.g. x = y + 1
 * element), nv = 0 and the whole array takes the one-element path. The head and tail
 * (at most 14 elements) are done one element a thread, by the first threads of the grid.
 *
 * A grid-stride loop over units (so any n, even beyond 2³¹, works with a bounded grid).
 */
#include "cuda_common.cuh"
#include "cuda_ops.h"

/** How an array of n bf16 splits into a scalar head, nv 16-byte units and a scalar tail. */
struct vec_split {
    size_t head; /* elements before the first unit */
    size_t nv;   /* 16-byte units of 8 elements */
    size_t rest; /* elements outside the units: head + tail */
};

/* @p y and @p x (NULL: none) as bf16 arrays of n elements. */
static vec_split split_for(const void *y, const void *x, size_t n) {
    vec_split s = {0, 0, n};
    const uintptr_t off = (uintptr_t)y % 16;
    if (off % 2 || (x && (uintptr_t)x % 16 != off)) /* x's units would not be aligned */
        return s;
    s.head = (16 - off) % 16 / 2;
    if (s.head > n)
        s.head = n;
    s.nv = (n - s.head) / 8;
    s.rest = n - 8 * s.nv;
    return s;
}

/* Index of the r-th element outside the units (r < s.rest): the head, then the tail. */
static __device__ __forceinline__ size_t rest_index(vec_split s, size_t r) {
    return r < s.head ? r : r + 8 * s.nv;
}

static __global__ void add_kernel(moe_bf16 *y, const moe_bf16 *x, vec_split s) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    uint4 *yv = (uint4 *)(y + s.head);
    const uint4 *xv = (const uint4 *)(x + s.head);
    for (size_t u = t; u < s.nv; u += stride) {
        moe_bf16x8 a, b;
        a.u = yv[u];
        b.u = xv[u];
#pragma unroll
        for (int j = 0; j < 8; j++)
            a.h[j] = moe_st(moe_ld(a.h[j]) + moe_ld(b.h[j]));
        yv[u] = a.u;
    }
    for (size_t r = t; r < s.rest; r += stride) {
        const size_t i = rest_index(s, r);
        y[i] = moe_st(moe_ld(y[i]) + moe_ld(x[i]));
    }
}

static __global__ void scale_kernel(moe_bf16 *x, float f, vec_split s) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    uint4 *xv = (uint4 *)(x + s.head);
    for (size_t u = t; u < s.nv; u += stride) {
        moe_bf16x8 a;
        a.u = xv[u];
#pragma unroll
        for (int j = 0; j < 8; j++)
            a.h[j] = moe_st(moe_ld(a.h[j]) * f);
        xv[u] = a.u;
    }
    for (size_t r = t; r < s.rest; r += stride) {
        const size_t i = rest_index(s, r);
        x[i] = moe_st(moe_ld(x[i]) * f);
    }
}

/* a bounded grid for grid-stride loops: enough blocks to fill any GPU, and for the larger
 * of the two loops (units, or elements outside them) */
static unsigned grid_for(vec_split s, int threads) {
    const size_t work = s.nv > s.rest ? s.nv : s.rest;
    size_t b = moe_cdiv(work, threads);
    return (unsigned)(b < 65536 ? b : 65536);
}

extern "C" void moe_cuda_add(void *y, const void *x, size_t n) {
    if (n == 0)
        return;
    const vec_split s = split_for(y, x, n);
    add_kernel<<<grid_for(s, 256), 256, 0, moe_cuda_stream()>>>((moe_bf16 *)y,
                                                                (const moe_bf16 *)x, s);
    MOE_CUDA_LAUNCH_CHECK();
}

extern "C" void moe_cuda_scale(void *x, double s, size_t n) {
    if (n == 0)
        return;
    const vec_split sp = split_for(x, NULL, n);
    scale_kernel<<<grid_for(sp, 256), 256, 0, moe_cuda_stream()>>>((moe_bf16 *)x, (float)s, sp);
    MOE_CUDA_LAUNCH_CHECK();
}
