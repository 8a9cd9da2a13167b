/*
 * Rotary position embedding on the GPU, rotate-half form (as lib/cpu/rope.c).
 *
 * A row n = (b, t) holds `heads` head vectors of D values; p = pos0 + (n mod T) is its
 * absolute position (pos0 ≠ 0 for a chunk of a longer sequence, chapter 07). Each head
 * vector is split into halves a = x[0:D/2], b = x[D/2:D], and pair i is rotated by
 * θ_i(p) = p · base^(−2i/D):
 *     a_i' = a_i cos θ − b_i sin θ,      b_i' = b_i cos θ + a_i sin θ.
 * The backward pass is the rotation by −θ (a rotation is orthogonal: R⁻¹ = Rᵀ), added
 * into din.
 *
 * Thread layout: one thread per (row n, pair i). It computes cos θ and sin θ ONCE and
 * applies them to the pair i of every head in the row. Consecutive threads take
 * consecutive i, so the loads and stores of a warp are contiguous.
 *
 * Precision: the angle is computed in double, like the CPU. At p ≈ 10⁵ and i = 0 the
 * angle is 10⁵ rad; in fp32 its rounding error alone would be ~0.004 rad, visible in
 * bf16 outputs. In double, pow/cos/sin agree with the CPU's libm to the last bit of
 * the float they are rounded to (almost always). The rotation itself is fp32.
 *
 * In-place use (out == in) is safe: each thread reads its pair before writing it, and
 * no other thread touches that pair.
 */
#include "cuda_common.cuh"
#include "cuda_ops.h"

/* sign = +1: forward (overwrite); sign = −1: backward (accumulate) */
static __global__ void rope_kernel(moe_bf16 *out, const moe_bf16 *in, int N, int T, int heads,
                                   int D, int pos0, double base, double sign, int accumulate) {
    const int half = D / 2;
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)N * half)
        return;
    const int n = (int)(idx / half), i = (int)(idx % half);
    const int pos = pos0 + n % T; /* absolute position of the row */
    const double theta = pos * pow(base, -2.0 * i / D);
    const float c = (float)cos(theta), s = (float)(sign * sin(theta));
    for (int h = 0; h < heads; h++) {
        const size_t o = (size_t)n * heads * D + (size_t)h * D;
        const float a = moe_ld(in[o + i]), b = moe_ld(in[o + i + half]);
        float ra = a * c - b * s, rb = b * c + a * s;
        if (accumulate) {
            ra += moe_ld(out[o + i]);
            rb += moe_ld(out[o + i + half]);
        }
        out[o + i] = moe_st(ra);
        out[o + i + half] = moe_st(rb);
    }
}

static void rope_launch(void *out, const void *in, int B, int T, int heads, int D, int pos0,
                        double base, double sign, int accumulate) {
    const int N = B * T;
    const size_t pairs = (size_t)N * (D / 2);
    if (pairs == 0 || heads == 0)
        return;
    const int threads = 256;
    rope_kernel<<<moe_cdiv(pairs, threads), threads, 0, moe_cuda_stream()>>>(
        (moe_bf16 *)out, (const moe_bf16 *)in, N, T, heads, D, pos0, base, sign, accumulate);
    MOE_CUDA_LAUNCH_CHECK();
}

extern "C" void moe_cuda_rope_forward(void *out, const void *in, int B, int T, int heads, int D,
                                      int pos0, double base) {
    rope_launch(out, in, B, T, heads, D, pos0, base, +1.0, 0);
}

extern "C" void moe_cuda_rope_backward(void *din, const void *dout, int B, int T, int heads, int D,
                                       int pos0, double base) {
    rope_launch(din, dout, B, T, heads, D, pos0, base, -1.0, 1);
}
