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
 * Precision: the angle is computed in double, like the CPU. At p ≈ 10⁵ and i = 0 the
 * angle is 10⁵ rad; in fp32 its rounding error alone would be ~0.004 rad, visible in
 * bf16 outputs. In double, pow/cos/sin agree with the CPU's libm to the last bit of
 * the float they are rounded to (almost always). The rotation itself is fp32.
 *
 * The cos/sin table (chapter 06). cos θ and sin θ depend only on (p, i) and on (D, base),
 * never on the data, yet the first version computed them — pow, cos and sin in double —
 * in every call, for every (row, pair): 24 calls a step in the GPU preset, each paying
 * B·T·D/2 double evaluations (hundreds of fp64 instructions each) before its first load,
 * then moving the data two bytes at a time. It ran at ~3.5x its bandwidth floor. Two ways
 * out were weighed:
 *   - amortise: still compute the angles per call, but once per (row, pair) for all heads
 *     of q and k together, with wide loads. The double math shrinks, but stays in every
 *     call of every step;
 *   - a table: compute (float) cos θ and (float) sin θ once per process, for positions
 *     0 .. npos−1 and pairs 0 .. D/2−1, and keep it in device memory. A call then only
 *     reads its rows' slice of the table (the same slice for every head, batch row and
 *     layer, so it stays in L1/L2: 256 bytes a position at D = 64, 2 MiB for 8192
 *     positions) and its data.
 * The table removes all of the per-call fp64 work, so it is what this file does. Its
 * values are computed by the same expressions in double as before and rounded to float,
 * so c and s are bit for bit what the per-call kernel used (the backward's −sin θ is the
 * float negated, which is exact), and so are the results.
 *
 * The table's life: one per (D, base), covering absolute positions 0 .. npos−1 (a
 * context-parallel rank reads positions far from 0, so the table starts at position 0
 * whatever pos0 is). A call that needs a position beyond npos, or a (D, base) not seen
 * yet, builds a NEW table (npos rounded up to a power of two, at least 4096, so growth is
 * rare) with one kernel and frees the old one. A table's contents never change while it
 * is allocated, so a CUDA graph that captured a read of it stays right; freeing one
 * advances the memory epoch (moe_cuda_memory_moved()), so such a graph is captured again
 * instead of replayed. Building allocates, so it is not capturable: it first calls
 * moe_cuda_capture_forbid(), like a scratch buffer that grows. In training that never
 * happens: lib/graph.c runs every region eagerly once (the warm-up) before capturing it,
 * and the warm-up builds the table; from then on a call only looks the table up on the
 * host — no allocation, no sync, nothing the graph cannot hold.
 *
 * Thread layout: one thread per (row n, head h, VEC consecutive pairs i .. i+VEC−1).
 * VEC = 8 when D/2 is a multiple of 8 and in/out are 16-byte aligned (the preset's D = 64
 * and D = 128): the thread moves a and b as one 16-byte moe_bf16x8 each (and out's, to
 * accumulate) and reads its 8 (cos, sin) pairs as four float4. VEC = 1 otherwise (e.g.
 * D = 6). Consecutive threads take consecutive pair groups, then heads, then rows, so the
 * loads and stores of a warp are contiguous.
 *
 * In-place use (out == in) is safe: each thread reads its pairs before writing them, and
 * no other thread touches them.
 */
#include "cuda_common.cuh"
#include "cuda_ops.h"

/* ---------------------------------------------------------------- the table */

/* cs[p·(D/2) + i] = ((float) cos θ_i(p), (float) sin θ_i(p)) for p < npos: the per-call
 * kernel's expressions, unchanged (int p times a double power, in double). */
static __global__ void rope_table_kernel(float2 *cs, long long npos, int D, double base) {
    const int half = D / 2;
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)npos * half)
        return;
    const int pos = (int)(idx / half), i = (int)(idx % half);
    const double theta = pos * pow(base, -2.0 * i / D);
    cs[idx] = make_float2((float)cos(theta), (float)sin(theta));
}

/** One cached table: cos/sin of positions 0 .. npos−1 for one (D, base). */
struct rope_table {
    int D;          /* head dimension (0: slot unused) */
    double base;    /* RoPE base */
    long long npos; /* positions covered */
    float2 *cs;     /* [npos, D/2] (cos, sin) */
};

enum { ROPE_TABLES = 4 }; /* distinct (D, base) kept at once: a model has one */
static rope_table g_tables[ROPE_TABLES];
static int g_evict = 0; /* the slot a fifth (D, base) replaces next */

/* Build a table for (D, base) covering positions 0 .. need−1 into *t, replacing its old
 * one. Not capturable (it allocates): see the file comment. */
static void rope_table_build(rope_table *t, int D, double base, long long need) {
    (void)moe_cuda_capture_forbid("building the RoPE cos/sin table (cudaMalloc)");
    const long long npos = moe_rope_table_positions(need);
    const size_t entries = (size_t)npos * (size_t)(D / 2);
    float2 *cs = (float2 *)moe_cuda_malloc_counted(entries * sizeof(float2));
    if (!cs) {
        fprintf(stderr, "CUDA RoPE table: out of device memory (%zu bytes for %lld positions, "
                        "D=%d)\n", entries * sizeof(float2), npos, D);
        exit(1);
    }
    rope_table_kernel<<<moe_cdiv(entries, 256), 256, 0, moe_cuda_stream()>>>(cs, npos, D, base);
    MOE_CUDA_LAUNCH_CHECK();
    if (t->cs) { /* a graph may hold the old table: it must be captured again */
        moe_cuda_free_counted(t->cs);
        moe_cuda_memory_moved();
    }
    t->D = D;
    t->base = base;
    t->npos = npos;
    t->cs = cs;
}

/* The table for (D, base) covering positions 0 .. need−1, built or grown when needed. */
static const float2 *rope_table_get(int D, double base, long long need) {
    rope_table *t = NULL;
    for (int k = 0; k < ROPE_TABLES && !t; k++)
        if (g_tables[k].D == D && g_tables[k].base == base)
            t = &g_tables[k];
    for (int k = 0; k < ROPE_TABLES && !t; k++)
        if (g_tables[k].D == 0)
            t = &g_tables[k];
    if (!t) {
        t = &g_tables[g_evict];
        g_evict = (g_evict + 1) % ROPE_TABLES;
    }
    if (t->D != D || t->base != base || t->npos < need)
        rope_table_build(t, D, base, need);
    return t->cs;
}

/* ---------------------------------------------------------------- the rotation */

/* sign = +1: forward (overwrite); sign = −1: backward (accumulate). VEC pairs a thread. */
template <int VEC>
static __global__ void rope_kernel(moe_bf16 *out, const moe_bf16 *in, const float2 *cs, int N,
                                   int T, int heads, int D, int pos0, float sign, int accumulate) {
    const int half = D / 2, groups = half / VEC;
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)N * heads * groups)
        return;
    const size_t row_units = (size_t)heads * groups;
    const int n = (int)(idx / row_units), r = (int)(idx % row_units);
    const int h = r / groups, i = (r % groups) * VEC;
    const int pos = pos0 + n % T; /* absolute position of the row */
    const float2 *t = cs + (size_t)pos * half + i;
    const size_t o = (size_t)n * heads * D + (size_t)h * D + i; /* a_i; b_i is o + half */
    moe_bf16x8 va, vb, oa, ob; /* the first VEC elements are used */
    float2 t8[VEC];
    if constexpr (VEC == 8) {
        va.u = *(const uint4 *)(in + o);
        vb.u = *(const uint4 *)(in + o + half);
        if (accumulate) {
            oa.u = *(const uint4 *)(out + o);
            ob.u = *(const uint4 *)(out + o + half);
        }
#pragma unroll
        for (int j = 0; j < VEC; j += 2) { /* (c, s) of two pairs in one 16-byte load */
            const float4 q = __ldg((const float4 *)(t + j));
            t8[j] = make_float2(q.x, q.y);
            t8[j + 1] = make_float2(q.z, q.w);
        }
    } else {
        va.h[0] = in[o];
        vb.h[0] = in[o + half];
        if (accumulate) {
            oa.h[0] = out[o];
            ob.h[0] = out[o + half];
        }
        t8[0] = __ldg(t);
    }
#pragma unroll
    for (int j = 0; j < VEC; j++) {
        const float c = t8[j].x, s = sign * t8[j].y; /* −(float) sin θ is exact */
        const float a = moe_ld(va.h[j]), b = moe_ld(vb.h[j]);
        /* ra = a·c − b·s, rb = b·c + a·s with the roundings the per-call kernel had (ptxas
         * contracted it to these two FMAs on sm_90a), spelt out: left to itself ptxas
         * pairs this loop's products differently, e.g. rb = fma(a, s, b·c), which is not
         * bit for bit the same */
        float ra = __fmaf_rn(a, c, -__fmul_rn(b, s)), rb = __fmaf_rn(b, c, __fmul_rn(a, s));
        if (accumulate) {
            ra += moe_ld(oa.h[j]);
            rb += moe_ld(ob.h[j]);
        }
        oa.h[j] = moe_st(ra);
        ob.h[j] = moe_st(rb);
    }
    if constexpr (VEC == 8) {
        *(uint4 *)(out + o) = oa.u;
        *(uint4 *)(out + o + half) = ob.u;
    } else {
        out[o] = oa.h[0];
        out[o + half] = ob.h[0];
    }
}

static void rope_launch(void *out, const void *in, int B, int T, int heads, int D, int pos0,
                        double base, float sign, int accumulate) {
    const int half = D / 2;
    const size_t N = (size_t)B * T;
    if (N == 0 || half <= 0 || heads <= 0)
        return;
    if (pos0 < 0) {
        fprintf(stderr, "CUDA RoPE: negative position offset pos0=%d\n", pos0);
        exit(1);
    }
    const float2 *cs = rope_table_get(D, base, (long long)pos0 + T);
    const bool vec = half % 8 == 0 && moe_vec8_ok(8, out, in);
    const size_t threads_needed = N * heads * (vec ? half / 8 : half);
    const int threads = 256;
    if (vec)
        rope_kernel<8><<<moe_cdiv(threads_needed, threads), threads, 0, moe_cuda_stream()>>>(
            (moe_bf16 *)out, (const moe_bf16 *)in, cs, (int)N, T, heads, D, pos0, sign,
            accumulate);
    else
        rope_kernel<1><<<moe_cdiv(threads_needed, threads), threads, 0, moe_cuda_stream()>>>(
            (moe_bf16 *)out, (const moe_bf16 *)in, cs, (int)N, T, heads, D, pos0, sign,
            accumulate);
    MOE_CUDA_LAUNCH_CHECK();
}

extern "C" void moe_cuda_rope_forward(void *out, const void *in, int B, int T, int heads, int D,
                                      int pos0, double base) {
    rope_launch(out, in, B, T, heads, D, pos0, base, +1.0f, 0);
}

extern "C" void moe_cuda_rope_backward(void *din, const void *dout, int B, int T, int heads, int D,
                                       int pos0, double base) {
    rope_launch(din, dout, B, T, heads, D, pos0, base, -1.0f, 1);
}
