/*
 * SwiGLU on the GPU (as lib/cpu/swiglu.c), with a routed expert's routing weight fused in.
 * Each input row is [g | u] (gate half first, Megatron's fused fc1 output), s[n] is the
 * row's routing weight (1 when row_scale is NULL: dense FFN, shared expert):
 *
 *   forward    out[n,f] = s[n] · silu(g) · u,             silu(g) = g·σ(g)
 *   backward   with a = silu(g)·u and d = dout·s[n]:
 *              ds[n] += Σ_f dout · a                      (the routing weight's gradient)
 *              dg    += d · u · σ(1 + g(1 − σ))           (d silu/dg = σ + g·σ(1 − σ))
 *              du    += d · silu(g)
 *
 * Why the scale lives here. The MoE layer multiplies each expert row by its routing
 * weight between the activation and fc2. As separate ops that cost, per step, a copy of
 * the [rows, F] activation, a scaling pass over it, a row-dot pass for ds and a second
 * scaling pass over dh — four extra trips through the largest element-wise buffers of
 * the layer, to multiply by one number per row. Fused, the forward writes the scaled
 * activation once (it is exactly fc2's input, so fc2's weight gradient reads it as is),
 * and the backward reads dout, g and u once: it recomputes a = silu(g)·u in registers,
 * which is cheaper than storing an unscaled copy.
 *
 * Forward: purely elementwise, one thread per 8 outputs (16-byte moe_bf16x8 loads of g, u
 * and store of out) when F % 8 == 0 and the pointers are 16-byte aligned, one per output
 * otherwise. Consecutive threads cover consecutive columns of a row, so every access of a
 * warp is contiguous.
 *
 * Backward: one block per row, because ds needs the row's sum. The threads stride the row
 * (8 columns at a time when aligned, as the forward), each keeps its partial Σ dout·a in
 * fp32, and moe_block_sum adds the partials in a fixed tree: ds is the same run to run,
 * with no atomics. The block is as wide as the row needs, up to 256 threads, so narrow
 * experts do not leave most of a block idle.
 *
 * Math in fp32 with the accurate expf (not __expf), one bf16 rounding per output; the
 * accumulating gradients are read, added to in fp32 and rounded once.
 */
#include "cuda_common.cuh"
#include "cuda_ops.h"
#include "swiglu.cuh"

/* One thread per VEC ? 8 : 1 consecutive outputs of a row. */
template <bool VEC>
static __global__ void swiglu_forward_kernel(moe_bf16 *out, const moe_bf16 *gu,
                                             const float *row_scale, int N, int F) {
    const size_t per_row = VEC ? F / 8 : F; /* units of work per row */
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)N * per_row)
        return;
    const size_t n = idx / per_row, c = idx % per_row;
    const float s = row_scale ? row_scale[n] : 1.0f;
    const moe_bf16 *g = gu + n * 2 * F, *u = g + F;
    if (VEC) {
        moe_bf16x8 vg, vu, vo;
        vg.u = ((const uint4 *)g)[c];
        vu.u = ((const uint4 *)u)[c];
#pragma unroll
        for (int i = 0; i < 8; i++)
            vo.h[i] = moe_st(swiglu_fwd(moe_ld(vg.h[i]), moe_ld(vu.h[i]), s));
        ((uint4 *)out)[idx] = vo.u; /* row n, unit c: out + 8·(n·F/8 + c) */
    } else {
        out[idx] = moe_st(swiglu_fwd(moe_ld(g[c]), moe_ld(u[c]), s));
    }
}

/* One block per row; drow_scale may be NULL (then the row sum is not stored). */
template <bool VEC>
static __global__ void swiglu_backward_kernel(moe_bf16 *dgu, float *drow_scale,
                                              const moe_bf16 *dout, const moe_bf16 *gu,
                                              const float *row_scale, int F) {
    const size_t n = blockIdx.x;
    const float s = row_scale ? row_scale[n] : 1.0f;
    const moe_bf16 *g = gu + n * 2 * F, *u = g + F, *dy = dout + n * F;
    moe_bf16 *dg = dgu + n * 2 * F, *du = dg + F;
    float acc = 0.0f;
    if (VEC) {
        for (int c = threadIdx.x; c < F / 8; c += blockDim.x) {
            moe_bf16x8 vg, vu, vy, vdg, vdu;
            vg.u = ((const uint4 *)g)[c];
            vu.u = ((const uint4 *)u)[c];
            vy.u = ((const uint4 *)dy)[c];
            vdg.u = ((const uint4 *)dg)[c];
            vdu.u = ((const uint4 *)du)[c];
#pragma unroll
            for (int i = 0; i < 8; i++) {
                float a = moe_ld(vdg.h[i]), b = moe_ld(vdu.h[i]);
                acc += swiglu_bwd(moe_ld(vg.h[i]), moe_ld(vu.h[i]), moe_ld(vy.h[i]), s, &a, &b);
                vdg.h[i] = moe_st(a);
                vdu.h[i] = moe_st(b);
            }
            ((uint4 *)dg)[c] = vdg.u;
            ((uint4 *)du)[c] = vdu.u;
        }
    } else {
        for (int f = threadIdx.x; f < F; f += blockDim.x) {
            float a = moe_ld(dg[f]), b = moe_ld(du[f]);
            acc += swiglu_bwd(moe_ld(g[f]), moe_ld(u[f]), moe_ld(dy[f]), s, &a, &b);
            dg[f] = moe_st(a);
            du[f] = moe_st(b);
        }
    }
    if (drow_scale) { /* the same for every thread of the block: all of them reach the sum */
        acc = moe_block_sum(acc);
        if (threadIdx.x == 0)
            drow_scale[n] += acc;
    }
}

extern "C" void moe_cuda_swiglu_forward(void *out, const void *gu, const moe_real *row_scale,
                                        int N, int F) {
    if (N <= 0 || F <= 0)
        return;
    cudaStream_t st = moe_cuda_stream();
    if (moe_vec8_ok(F, out, gu))
        swiglu_forward_kernel<true><<<moe_cdiv((size_t)N * (F / 8), 256), 256, 0, st>>>(
            (moe_bf16 *)out, (const moe_bf16 *)gu, row_scale, N, F);
    else
        swiglu_forward_kernel<false><<<moe_cdiv((size_t)N * F, 256), 256, 0, st>>>(
            (moe_bf16 *)out, (const moe_bf16 *)gu, row_scale, N, F);
    MOE_CUDA_LAUNCH_CHECK();
}

extern "C" void moe_cuda_swiglu_backward(void *dgu, moe_real *drow_scale, const void *dout,
                                         const void *gu, const moe_real *row_scale, int N,
                                         int F) {
    if (N <= 0 || F <= 0)
        return;
    cudaStream_t st = moe_cuda_stream();
    const bool vec = moe_vec8_ok(F, dgu, dout, gu);
    /* threads per row: enough for one pass over the row, a multiple of 32, at most 256 */
    const int units = vec ? F / 8 : F;
    const int threads = units >= 256 ? 256 : 32 * (int)moe_cdiv(units, 32);
    if (vec)
        swiglu_backward_kernel<true><<<N, threads, 0, st>>>(
            (moe_bf16 *)dgu, drow_scale, (const moe_bf16 *)dout, (const moe_bf16 *)gu, row_scale,
            F);
    else
        swiglu_backward_kernel<false><<<N, threads, 0, st>>>(
            (moe_bf16 *)dgu, drow_scale, (const moe_bf16 *)dout, (const moe_bf16 *)gu, row_scale,
            F);
    MOE_CUDA_LAUNCH_CHECK();
}
