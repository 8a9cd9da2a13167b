/*
 * SwiGLU's per-element math (kernels/swiglu.cu explains it), shared by the plain kernels and
 * the ones that quantize their output in the same pass (kernels/swiglu_quant.cu), so both
 * compute the same bits.
 */
#ifndef MOE_SWIGLU_CUH
#define MOE_SWIGLU_CUH

#include "cuda_common.cuh"

static __device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* one output of the forward, before rounding */
static __device__ __forceinline__ float swiglu_fwd(float g, float u, float s) {
    return g * sigmoid(g) * u * s;
}

/* One element of the backward: adds into *dg and *du (fp32) and returns dout·a, this
 * element's share of the routing weight's gradient. */
static __device__ __forceinline__ float swiglu_bwd(float g, float u, float dy, float s, float *dg,
                                                   float *du) {
    const float sg = sigmoid(g), silu = g * sg, d = dy * s;
    *dg += d * u * sg * (1.0f + g * (1.0f - sg));
    *du += d * silu;
    return dy * (silu * u);
}

#endif /* MOE_SWIGLU_CUH */
