/*
 * Chapter 05's quantization recipes on the GPU: the CUDA twins of lib/cpu/quantize.c, equal
 * to them byte for byte (codes and scales), which tests/gpu_quant.c checks with memcmp.
 *
 * How the bytes come out equal: every per-element and per-block rule is a MOE_HOSTDEV
 * function of lib/quant_formats.h and lib/quantize.h that the CPU calls too; this file only
 * maps blocks onto threads. The amax reductions are maxima of integer keys
 * (moe_q_abs_key), so a warp shuffle, a shared-memory step or an integer atomicMax give the
 * CPU loop's answer whatever the order. No float atomics, no float reductions.
 *
 * The kernels, by recipe:
 *   tensorwise  amax_kernel (grid-stride, atomicMax of the key into s->amax, zeroed first),
 *               scalars_kernel (one thread: moe_quant_scalars_from_amax), cast_kernel;
 *   delayed     cast_kernel with the scale already in s->scale, amax_kernel into the history
 *               slot, delayed_kernel (one thread: moe_quant_delayed_finish); at a training
 *               site (lib/lowp.h) amax_kernel, delayed_site_kernel (one thread:
 *               moe_delayed_record, the state in device memory), then cast_kernel;
 *   blockwise   1×128: a half-warp per tile, 8 elements per lane in 16-byte loads, the warps
 *               striding over the tiles (quant1x128.cuh; MOE_QUANT_VEC=0: the former one
 *               warp per tile, 4 elements per lane; MOE_QUANT_VEC=2 or 3: v3, the same tile in
 *               cheaper instructions, 8 tiles a warp in flight, block1x128_v3_kernel;
 *               3, the hardware's casts, is the default); 128×128: one 256-thread block
 *               per block (64 elements per thread), the amax through shared memory;
 *               with a transposed copy (blockwise_t_kernel): a 128×128 tile of x in shared
 *               memory, quantized along its rows and its columns in the same block (the
 *               128×128 recipe, the experts' weights: block2d_t_kernel, the tile in
 *               registers, each element cast once, the codes transposed in shared memory);
 *               both also read bf16 (the native FP8 layer, lib/lowp.h: activations 1×128
 *               with their dequantized bf16 copy in the same pass, which is also the QDQ
 *               op's 1×128 path; a batch of expert weights with their transposes);
 *   MXFP8       one warp per 32-element block, one element per lane;
 *   NVFP4       nvfp4_amax_kernel (per 16-element group, after the optional Hadamard
 *               transform), nvfp4_scalars_kernel (which also advances the stochastic
 *               rounding's draw counter), then nvfp4_kernel: one thread per group, 256
 *               threads = 16 rows × 16 groups, laid out so that the 16 rows of a 16×16 block
 *               are one half-warp (the 2D block amax is a 4-step shuffle).
 * Everything is enqueued on moe_cuda_stream(); nothing waits for the device, and the scales
 * never travel through the host (delayed scaling reads its scale from device memory).
 */
#include "cuda_common.cuh"
#include "cuda_ops.h"
#include "quant1x128.cuh"
#include "quantize.h"

#include <stdlib.h>
#include <string.h>

#define THREADS 256
#define MAX_BLOCKS 1024

/* maximum of a key over the lanes of a warp (xor-butterfly: every lane gets it); width 16
 * reduces each half-warp on its own */
static __device__ __forceinline__ uint32_t warp_max_key(uint32_t v, int width = 32) {
    for (int off = width / 2; off; off >>= 1) {
        const uint32_t o = __shfl_xor_sync(0xffffffffu, v, off);
        v = o > v ? o : v;
    }
    return v;
}

/* maximum of a key over a THREADS-thread block: each warp's butterfly, then the warps' maxima
 * through @p warp_max (shared, THREADS / 32 words); every thread gets it. A __syncthreads
 * inside: every thread of the block must call it */
static __device__ __forceinline__ uint32_t block_max_key(uint32_t m, uint32_t *warp_max) {
    m = warp_max_key(m);
    if ((threadIdx.x & 31) == 0)
        warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    m = 0;
#pragma unroll
    for (int w = 0; w < THREADS / 32; w++)
        m = warp_max[w] > m ? warp_max[w] : m;
    return m;
}

static unsigned grid_for(size_t work, size_t per_block) {
    const size_t b = (work + per_block - 1) / per_block;
    return (unsigned)(b < 1 ? 1 : b > MAX_BLOCKS ? MAX_BLOCKS : b);
}

/* ------------------------------------------------------------------ tensorwise */

/* *key = max(*key, max_i |x[i]| as a key); *key zeroed by the caller */
static __global__ void amax_kernel(unsigned *key, const float *x, size_t n) {
    uint32_t m = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const uint32_t k = moe_q_abs_key(x[i]);
        m = k > m ? k : m;
    }
    m = warp_max_key(m);
    if ((threadIdx.x & 31) == 0 && m)
        atomicMax(key, m);
}

/* s->amax holds the reduced key: the scalars from it (one thread) */
static __global__ void scalars_kernel(moe_quant_scalars *s, float num) {
    moe_quant_scalars_from_amax(s, moe_q_key_amax(__float_as_uint(s->amax)), num);
}

/* q[i] = cast(x[i]·scale); with poison_nan, a NaN scale writes 0 (current scaling) */
static __global__ void cast_kernel(uint8_t *q, const float *x, size_t n, const float *scale,
                                   moe_fp8_format f, int poison_nan) {
    const float s = *scale;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        q[i] = poison_nan ? moe_q_cast_scaled(x[i], s, f) : moe_fp8_encode(moe_q_mul(x[i], s), f);
}

static __global__ void delayed_kernel(moe_quant_scalars *s, float *history, int len, int pos,
                                      float fmax) {
    const float amax = moe_q_key_amax(__float_as_uint(history[pos]));
    moe_quant_delayed_finish(s, history, len, pos, amax, fmax);
}

/* the tensor's amax key into *key (zeroed here first) */
static void launch_amax(unsigned *key, const float *x, size_t n) {
    cudaStream_t st = moe_cuda_stream();
    MOE_CUDA_CHECK(cudaMemsetAsync(key, 0, sizeof(unsigned), st));
    amax_kernel<<<grid_for(n, THREADS * 4), THREADS, 0, st>>>(key, x, n);
    MOE_CUDA_LAUNCH_CHECK();
}

extern "C" moe_status moe_cuda_quant_tensorwise(uint8_t *q, moe_quant_scalars *s, const float *x,
                                                size_t n, moe_fp8_format f, moe_error *err) {
    MOE_TRY(moe_quant_check_format(f, err));
    cudaStream_t st = moe_cuda_stream();
    launch_amax((unsigned *)&s->amax, x, n);
    scalars_kernel<<<1, 1, 0, st>>>(s, moe_fp8_max(f));
    MOE_CUDA_LAUNCH_CHECK();
    if (n) {
        cast_kernel<<<grid_for(n, THREADS * 4), THREADS, 0, st>>>(q, x, n, &s->scale, f, 1);
        MOE_CUDA_LAUNCH_CHECK();
    }
    return MOE_OK;
}

extern "C" moe_status moe_cuda_quant_delayed(uint8_t *q, moe_quant_scalars *s, float *history,
                                             int len, int pos, const float *x, size_t n,
                                             moe_fp8_format f, moe_error *err) {
    MOE_TRY(moe_quant_check_format(f, err));
    MOE_TRY(moe_quant_check_window(len, pos, err));
    cudaStream_t st = moe_cuda_stream();
    if (n) {
        cast_kernel<<<grid_for(n, THREADS * 4), THREADS, 0, st>>>(q, x, n, &s->scale, f, 0);
        MOE_CUDA_LAUNCH_CHECK();
    }
    launch_amax((unsigned *)(history + pos), x, n);
    delayed_kernel<<<1, 1, 0, st>>>(s, history, len, pos, moe_fp8_max(f));
    MOE_CUDA_LAUNCH_CHECK();
    return MOE_OK;
}

/* a delayed site (one thread): with @p record, this tensor's amax (its key in s->amax) is
 * recorded and the scales chosen; then s = the scalars its codes are cast with */
static __global__ void delayed_site_kernel(moe_quant_scalars *s, moe_delayed_ref d, float num) {
    if (d.record)
        moe_delayed_record(d.site, d.history, d.len, d.algo, num,
                           moe_q_key_amax(__float_as_uint(s->amax)));
    moe_delayed_scalars(s, d.site);
}

/* as the CPU's: amax (when recording), the site's scalars, then the cast with the scale read
 * from device memory: nothing travels through the host, so a graph can capture it */
extern "C" moe_status moe_cuda_quant_delayed_site(uint8_t *q, moe_quant_scalars *s,
                                                  const moe_delayed_ref *d, const float *x,
                                                  size_t n, moe_fp8_format f, moe_error *err) {
    MOE_TRY(moe_quant_check_format(f, err));
    MOE_TRY(moe_quant_check_delayed(d, err));
    cudaStream_t st = moe_cuda_stream();
    if (d->record)
        launch_amax((unsigned *)&s->amax, x, n);
    delayed_site_kernel<<<1, 1, 0, st>>>(s, *d, moe_quant_delayed_num(f, d->margin));
    MOE_CUDA_LAUNCH_CHECK();
    if (n) {
        cast_kernel<<<grid_for(n, THREADS * 4), THREADS, 0, st>>>(q, x, n, &s->scale, f, 1);
        MOE_CUDA_LAUNCH_CHECK();
    }
    return MOE_OK;
}

static __global__ void dequant_tensorwise_kernel(float *y, const uint8_t *q,
                                                 const moe_quant_scalars *s, size_t n,
                                                 moe_fp8_format f) {
    const float si = s->scale_inv;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = moe_q_dequant(moe_fp8_decode(q[i], f), si);
}

extern "C" moe_status moe_cuda_dequant_tensorwise(float *y, const uint8_t *q,
                                                  const moe_quant_scalars *s, size_t n,
                                                  moe_fp8_format f, moe_error *err) {
    MOE_TRY(moe_quant_check_format(f, err));
    if (n) {
        dequant_tensorwise_kernel<<<grid_for(n, THREADS * 4), THREADS, 0, moe_cuda_stream()>>>(
            y, q, s, n, f);
        MOE_CUDA_LAUNCH_CHECK();
    }
    return MOE_OK;
}

/* ------------------------------------------------------------------ blockwise */

/* an input element as fp32: the fp32 quantizers' own, or a bf16 activation (exact) */
static __device__ __forceinline__ float ld_f32(float v) { return v; }
static __device__ __forceinline__ float ld_f32(moe_bf16 v) { return moe_ld(v); }

/* one warp per 1×128 tile: lane l holds elements l, l+32, l+64, l+96. With @p y (bf16
 * input only), also the dequantized values rounded to bf16: moe_cuda_qdq's bytes, in the
 * same pass (chapter 05's native FP8 layer: the codes for the FP8 GEMM, the values for the
 * bf16 wgrad) */
template <typename T>
static __global__ void block1x128_kernel(uint8_t *q, float *scale_inv, moe_bf16 *y, const T *x,
                                         long long tiles, int nbc, int cols, moe_fp8_format f,
                                         int pow2) {
    const long long t = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (t >= tiles)
        return; /* the whole warp: t is the same for its lanes */
    const size_t base = (size_t)(t / nbc) * cols + (size_t)(t % nbc) * MOE_QUANT_BLOCK;
    float v[4];
    uint32_t m = 0;
    for (int k = 0; k < 4; k++) {
        v[k] = ld_f32(x[base + lane + 32 * k]);
        const uint32_t key = moe_q_abs_key(v[k]);
        m = key > m ? key : m;
    }
    m = warp_max_key(m);
    const float scale = moe_q_scale_from_amax(moe_q_key_amax(m), moe_fp8_max(f), pow2);
    const float si = moe_q_scale_inv(scale);
    for (int k = 0; k < 4; k++) {
        const uint8_t c = moe_q_cast_scaled(v[k], scale, f);
        q[base + lane + 32 * k] = c;
        if (y)
            y[base + lane + 32 * k] = moe_st(moe_q_dequant(moe_fp8_decode(c, f), si));
    }
    if (lane == 0)
        scale_inv[t] = si;
}

/* 8 consecutive inputs as fp32, in 16-byte loads (@p x 16-byte aligned) */
static __device__ __forceinline__ void ld8_f32(float v[8], const float *x) {
    const float4 a = ((const float4 *)x)[0], b = ((const float4 *)x)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z,
    v[7] = b.w;
}
static __device__ __forceinline__ void ld8_f32(float v[8], const moe_bf16 *x) {
    moe_bf16x8 h;
    h.u = *(const uint4 *)x;
#pragma unroll
    for (int k = 0; k < 8; k++)
        v[k] = moe_ld(h.h[k]);
}

/* The vectorized 1×128 quantizer: a half-warp per tile, lane l of it holding elements
 * 8l .. 8l+7 (one 16-byte load of bf16, two of fp32; the 8 codes one 8-byte store, the
 * dequantized copy one 16-byte store), the amax by a 4-step shuffle (quant1x128.cuh). The
 * warps stride over pairs of tiles, so a warp quantizes many tiles and the grid stays at
 * the device's width. The rows are contiguous (cols = 128·nbc), so tile t is elements
 * 128t .. 128t+127 and its scale scale_inv[t], whatever the row. */
template <typename T>
static __global__ void block1x128_vec_kernel(uint8_t *q, float *scale_inv, moe_bf16 *y,
                                             const T *x, long long tiles, moe_fp8_format f,
                                             int pow2) {
    const int lane = threadIdx.x & 31, hl = lane & 15;
    const long long warps = (long long)gridDim.x * (blockDim.x / 32);
    /* the loop is the same for the whole warp (pairs), so every lane reaches the shuffles */
    for (long long p = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
         2 * p < tiles; p += warps) {
        const long long t = 2 * p + (lane >> 4);
        const bool valid = t < tiles;
        const size_t i = (size_t)t * MOE_QUANT_BLOCK + MOE_Q1X128_PER_LANE * hl;
        float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (valid)
            ld8_f32(v, x + i);
        uint2 c;
        moe_bf16x8 d;
        const float si = moe_q1x128_tile8(v, &c, y ? &d : NULL, f, pow2);
        if (valid) {
            *(uint2 *)(q + i) = c;
            if (y)
                *(uint4 *)(y + i) = d.u;
            if (hl == 0)
                scale_inv[t] = si;
        }
    }
}

/* The third 1×128 quantizer, v3: the default with the hardware's casts
 * (MOE_QUANT_1X128_DEFAULT = 3, cuda_ops.h; MOE_QUANT_VEC=2 or
 * moe_cuda_quant_1x128_set_kernel(2) runs it with the software encoder, =1 the vectorized
 * kernel below). STATUS: byte for byte the CPU twin and the older kernels on an H100 at
 * 27db17a (tests/gpu_fp8_fused.c, gpu_quant.c, gpu_fp8_layer.c). The vectorized kernel above
 * moves ~1.3 TB/s on an H100 (Qwen3-235B's permuted x, 65536 × 4096 bf16 with its
 * dequantized copy: 1.05 ms) where a copy of its bytes runs ~3 TB/s. Its grid is not the
 * limit (1024 blocks of 8 warps: more than the 6 blocks an SM holds at its 37 registers),
 * nor only its 16 bytes in flight a lane: per element it spends
 * some forty integer operations on the general encoder (moe_q_encode, the format a runtime
 * value, so both formats' code is there) and about twenty more on the general decoder for
 * the copy, with Hopper's integer pipe at half the fp32 rate: about the time the pass takes.
 * v3 changes the instructions, not the arithmetic:
 *
 *  - the tile is moe_q1x128_tile8_fast (quant1x128.cuh): the format a template parameter,
 *    the cast moe_fp8_encode_fast (equal to moe_fp8_encode on every input), or with
 *    MOE_QUANT_VEC=3 the hardware's cvt.rn.satfinite fp32x2 → FP8x2 (the same rule on the
 *    finite values a tile casts: two elements an instruction where the fast encoder takes
 *    ~15 integer operations each), the copy's decode the hardware's FP8x2 → f16x2 (exact);
 *    the amax, the scale, 1/scale and every product and rounding are moe_q1x128_tile8's;
 *  - a warp takes V3_TILES = 8 consecutive tiles an iteration, a tile per half-warp per step
 *    as before, and issues all its loads first (4 independent 16-byte loads a lane for bf16,
 *    8 for fp32) before the first shuffle: 64 bytes in flight a lane, not 16;
 *  - the grid is the device's resident width (its SMs times the blocks of this kernel one
 *    holds, from the occupancy calculator: 4 at ≤ 64 registers), the warps striding over
 *    groups of V3_TILES tiles;
 *  - the loads and stores are streaming (evict-first: each byte is touched once), and the
 *    8 scales of a warp's tiles go out as one 32-byte run (lanes 0..3 of each half).
 * y is given only with bf16 inputs (the native FP8 layer's copy); fp32 ones come without. */
constexpr int V3_PAIRS = 4, V3_TILES = 2 * V3_PAIRS, V3_WARPS = THREADS / 32;

/* a lane's 8 elements as loaded: one 16-byte word of bf16, two of fp32 */
template <typename T> struct raw8 {
    uint4 w[sizeof(T) / 2];
};

template <typename T>
static __device__ __forceinline__ void ld_raw8(raw8<T> &r, const T *x) {
#pragma unroll
    for (int j = 0; j < (int)(sizeof(T) / 2); j++)
        r.w[j] = __ldcs((const uint4 *)x + j);
}

static __device__ __forceinline__ void unpack8(float v[8], const raw8<float> &r) {
#pragma unroll
    for (int j = 0; j < 2; j++) {
        v[4 * j] = __uint_as_float(r.w[j].x), v[4 * j + 1] = __uint_as_float(r.w[j].y);
        v[4 * j + 2] = __uint_as_float(r.w[j].z), v[4 * j + 3] = __uint_as_float(r.w[j].w);
    }
}
static __device__ __forceinline__ void unpack8(float v[8], const raw8<moe_bf16> &r) {
    moe_bf16x8 h;
    h.u = r.w[0];
#pragma unroll
    for (int k = 0; k < 8; k++)
        v[k] = moe_ld(h.h[k]);
}

template <typename T, moe_fp8_format F, bool DEQ, bool HW>
static __global__ void __launch_bounds__(THREADS, 4)
    block1x128_v3_kernel(uint8_t *q, float *scale_inv, moe_bf16 *y, const T *x, long long tiles,
                         int pow2) {
    const int lane = threadIdx.x & 31, hl = lane & 15, half = lane >> 4;
    const long long stride = (long long)gridDim.x * V3_WARPS * V3_TILES;
    /* t0 is the same for the whole warp, so every lane reaches the shuffles */
    for (long long t0 = ((long long)blockIdx.x * V3_WARPS + threadIdx.x / 32) * V3_TILES;
         t0 < tiles; t0 += stride) {
        raw8<T> r[V3_PAIRS];
#pragma unroll
        for (int u = 0; u < V3_PAIRS; u++) { /* tile t0 + 2u + half: all loads first */
            const long long t = t0 + 2 * u + half;
            if (t < tiles)
                ld_raw8<T>(r[u], x + (size_t)t * MOE_QUANT_BLOCK + MOE_Q1X128_PER_LANE * hl);
            else
                r[u] = raw8<T>{}; /* zeros: key 0, nothing stored */
        }
        float mine = 0.0f; /* lane hl < V3_PAIRS of each half: the scale of its tile u = hl */
#pragma unroll
        for (int u = 0; u < V3_PAIRS; u++) {
            const long long t = t0 + 2 * u + half;
            float v[8];
            unpack8(v, r[u]);
            uint2 c;
            moe_bf16x8 d;
            const float si = moe_q1x128_tile8_fast<F, DEQ, HW>(v, &c, &d, pow2);
            if (t < tiles) {
                const size_t i = (size_t)t * MOE_QUANT_BLOCK + MOE_Q1X128_PER_LANE * hl;
                __stcs((uint2 *)(q + i), c);
                if (DEQ)
                    __stcs((uint4 *)(y + i), d.u);
            }
            mine = hl == u ? si : mine;
        }
        /* lane (half, u) writes tile t0 + 2u + half's scale: 8 consecutive floats */
        if (hl < V3_PAIRS && t0 + 2 * hl + half < tiles)
            scale_inv[t0 + 2 * hl + half] = mine;
    }
}

/* which 1×128 kernel runs: -1 until set (then MOE_QUANT_VEC decides at each launch) */
static int g_1x128_kernel = -1;
static int g_1x128_max_blocks = 0; /* a test's cap on v3's grid; 0: the device's width */
static long long g_1x128_v3_calls = 0;

extern "C" void moe_cuda_quant_1x128_set_kernel(int k) {
    g_1x128_kernel = k < 0 ? -1 : k > 3 ? 3 : k;
}

/* MOE_QUANT_VEC=0: the one-warp-per-tile kernel (the reference the vectorized one replaced),
 * 1: the vectorized one, 2: v3, 3: v3 with the hardware's casts; unset or anything else:
 * MOE_QUANT_1X128_DEFAULT. Read at every launch (tests switch it with setenv), unless set by
 * moe_cuda_quant_1x128_set_kernel */
extern "C" int moe_cuda_quant_1x128_kernel(void) {
    if (g_1x128_kernel >= 0)
        return g_1x128_kernel;
    const char *e = getenv("MOE_QUANT_VEC");
    if (e && e[0] >= '0' && e[0] <= '3' && !e[1])
        return e[0] - '0';
    return MOE_QUANT_1X128_DEFAULT;
}

extern "C" void moe_cuda_quant_1x128_set_max_blocks(int blocks) {
    g_1x128_max_blocks = blocks > 0 ? blocks : 0;
}

extern "C" long long moe_cuda_quant_1x128_v3_calls(void) { return g_1x128_v3_calls; }

/* v3's grid: enough blocks to fill the device once (@p full: its SMs times the blocks of
 * the kernel an SM holds), fewer when there are not as many groups of V3_TILES tiles, or the
 * test's cap */
static unsigned v3_grid(int full, long long tiles) {
    long long g = (tiles + V3_WARPS * V3_TILES - 1) / (V3_WARPS * V3_TILES);
    g = g < full ? g : full;
    if (g_1x128_max_blocks && g > g_1x128_max_blocks)
        g = g_1x128_max_blocks;
    return (unsigned)(g < 1 ? 1 : g);
}

template <typename T, moe_fp8_format F, bool DEQ, bool HW>
static void launch_v3(uint8_t *q, float *scale_inv, moe_bf16 *y, const T *x, long long tiles,
                      int pow2) {
    auto k = block1x128_v3_kernel<T, F, DEQ, HW>;
    static int full = 0; /* the resident width, computed once per kernel */
    if (!full)
        full = moe_cuda_resident_blocks(k, THREADS);
    k<<<v3_grid(full, tiles), THREADS, 0, moe_cuda_stream()>>>(q, scale_inv, y, x, tiles, pow2);
}

template <typename T, moe_fp8_format F, bool HW>
static void launch_v3(uint8_t *q, float *scale_inv, moe_bf16 *y, const T *x, long long tiles,
                      int pow2) {
    if constexpr (sizeof(T) == 2) { /* bf16: with or without the dequantized copy */
        if (y) {
            launch_v3<T, F, true, HW>(q, scale_inv, y, x, tiles, pow2);
            return;
        }
    }
    launch_v3<T, F, false, HW>(q, scale_inv, NULL, x, tiles, pow2);
}

template <typename T, bool HW>
static void launch_v3(uint8_t *q, float *scale_inv, moe_bf16 *y, const T *x, long long tiles,
                      moe_fp8_format f, int pow2) {
    if (f == MOE_FP8_E5M2)
        launch_v3<T, MOE_FP8_E5M2, HW>(q, scale_inv, y, x, tiles, pow2);
    else
        launch_v3<T, MOE_FP8_E4M3, HW>(q, scale_inv, y, x, tiles, pow2);
}

/* the hardware's conversions v3 uses against the library's rules, on every input: the casts
 * of all fp32 bit patterns but the NaNs (never cast, see moe_fp8x2_encode_hw), each
 * pattern in both halves of the pair; and the decode of every code that is not a NaN (bits
 * compared, so the signed zeros too). Mismatches counted into cnt[0] (casts), cnt[1]
 * (decodes), zeroed by the caller */
template <moe_fp8_format F>
static __global__ void fp8_cast_check_kernel(unsigned long long *cnt) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long bad = 0;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < (1ull << 32); i += stride) {
        const float x = __uint_as_float((uint32_t)i), other = __uint_as_float((uint32_t)~i);
        if (moe_q_abs_key(x) > 0x7F800000u) /* a NaN: never cast */
            continue;
        const uint32_t want = moe_fp8_encode(x, F);
        const uint32_t lo =
            moe_fp8x2_encode_hw<F>(x, moe_q_abs_key(other) > 0x7F800000u ? 0.0f : other);
        const uint32_t hi = moe_fp8x2_encode_hw<F>(0.0f, x);
        bad += (lo & 0xFFu) != want;
        bad += (hi >> 8 & 0xFFu) != want;
    }
    if (bad)
        atomicAdd(&cnt[0], bad);
    if (blockIdx.x == 0) {
        const uint8_t c = (uint8_t)threadIdx.x; /* 256 threads: every code once */
        const float want = moe_fp8_decode(c, F);
        const float2 got = moe_fp8x2_decode<F>((uint32_t)c | (uint32_t)(uint8_t)~c << 8);
        const float got_hi = moe_fp8x2_decode<F>((uint32_t)c << 8).y;
        if (want == want && (__float_as_uint(got.x) != __float_as_uint(want) ||
                             __float_as_uint(got_hi) != __float_as_uint(want)))
            atomicAdd(&cnt[1], 1ull);
    }
}

extern "C" moe_status moe_cuda_fp8_cast_check(long long *cast_bad, long long *decode_bad,
                                              moe_fp8_format f, moe_error *err) {
    MOE_TRY(moe_quant_check_format(f, err));
    unsigned long long *d = (unsigned long long *)moe_cuda_alloc(2 * sizeof *d), h[2];
    cudaStream_t st = moe_cuda_stream();
    MOE_CUDA_CHECK(cudaMemsetAsync(d, 0, 2 * sizeof *d, st));
    if (f == MOE_FP8_E5M2)
        fp8_cast_check_kernel<MOE_FP8_E5M2><<<4096, THREADS, 0, st>>>(d);
    else
        fp8_cast_check_kernel<MOE_FP8_E4M3><<<4096, THREADS, 0, st>>>(d);
    MOE_CUDA_LAUNCH_CHECK();
    moe_cuda_to_host(h, d, sizeof h);
    moe_cuda_free(d);
    *cast_bad = (long long)h[0];
    *decode_bad = (long long)h[1];
    return MOE_OK;
}

template <typename T>
static void launch_block1x128(uint8_t *q, float *scale_inv, moe_bf16 *y, const T *x, int rows,
                              int cols, moe_fp8_format f, int pow2) {
    const int nbc = cols / MOE_QUANT_BLOCK;
    const long long tiles = (long long)rows * nbc;
    if (tiles == 0)
        return;
    /* 16-byte loads of x and stores of y, 8-byte stores of q (rows start at multiples of 128
     * elements, so only the base pointers can be misaligned) */
    const int kernel = moe_cuda_quant_1x128_kernel();
    const bool aligned =
        (uintptr_t)x % 16 == 0 && (uintptr_t)y % 16 == 0 && (uintptr_t)q % 8 == 0;
    if (aligned && kernel >= 2) {
        if (kernel == 3)
            launch_v3<T, true>(q, scale_inv, y, x, tiles, f, pow2);
        else
            launch_v3<T, false>(q, scale_inv, y, x, tiles, f, pow2);
        g_1x128_v3_calls++;
    } else if (aligned && kernel == 1) {
        const long long pairs = (tiles + 1) / 2, warps = THREADS / 32;
        block1x128_vec_kernel<T>
            <<<grid_for((size_t)pairs, warps), THREADS, 0, moe_cuda_stream()>>>(
                q, scale_inv, y, x, tiles, f, pow2);
    } else {
        block1x128_kernel<T><<<(unsigned)((tiles + 7) / 8), THREADS, 0, moe_cuda_stream()>>>(
            q, scale_inv, y, x, tiles, nbc, cols, f, pow2);
    }
    MOE_CUDA_LAUNCH_CHECK();
}

/* one 256-thread block per 128×128 block (grid: nbc × nbr): thread t holds column t mod 128
 * of rows t/128, t/128 + 2, ... */
static __global__ void block128x128_kernel(uint8_t *q, float *scale_inv, const float *x,
                                           int rows, int cols, moe_fp8_format f, int pow2) {
    __shared__ uint32_t warp_max[THREADS / 32];
    const int bc = blockIdx.x, br = blockIdx.y, c = bc * MOE_QUANT_BLOCK + (threadIdx.x & 127);
    const int r0 = br * MOE_QUANT_BLOCK + (threadIdx.x >> 7);
    const int r1 = min(br * MOE_QUANT_BLOCK + MOE_QUANT_BLOCK, rows);
    uint32_t m = 0;
    for (int r = r0; r < r1; r += 2) {
        const uint32_t key = moe_q_abs_key(x[(size_t)r * cols + c]);
        m = key > m ? key : m;
    }
    m = block_max_key(m, warp_max);
    const float scale = moe_q_scale_from_amax(moe_q_key_amax(m), moe_fp8_max(f), pow2);
    for (int r = r0; r < r1; r += 2) {
        const size_t i = (size_t)r * cols + c;
        q[i] = moe_q_cast_scaled(x[i], scale, f);
    }
    if (threadIdx.x == 0)
        scale_inv[(size_t)br * gridDim.x + bc] = moe_q_scale_inv(scale);
}

extern "C" moe_status moe_cuda_quant_blockwise(uint8_t *q, float *scale_inv, const float *x,
                                               int rows, int cols, moe_fp8_format f,
                                               int block_2d, int pow2, moe_error *err) {
    MOE_TRY(moe_quant_check(block_2d ? MOE_QUANT_BLOCK_128X128 : MOE_QUANT_BLOCK_1X128, rows,
                            cols, err));
    MOE_TRY(moe_quant_check_format(f, err));
    const int nbc = cols / MOE_QUANT_BLOCK;
    if (rows == 0 || nbc == 0)
        return MOE_OK;
    cudaStream_t st = moe_cuda_stream();
    if (block_2d) {
        const dim3 grid(nbc, (rows + MOE_QUANT_BLOCK - 1) / MOE_QUANT_BLOCK);
        block128x128_kernel<<<grid, THREADS, 0, st>>>(q, scale_inv, x, rows, cols, f, pow2);
        MOE_CUDA_LAUNCH_CHECK();
    } else {
        launch_block1x128<float>(q, scale_inv, NULL, x, rows, cols, f, pow2);
    }
    return MOE_OK;
}

extern "C" moe_status moe_cuda_quant_blockwise_act(uint8_t *q, float *scale_inv, void *y,
                                                   const void *x, int rows, int cols,
                                                   moe_fp8_format f, int pow2, moe_error *err) {
    MOE_TRY(moe_quant_check(MOE_QUANT_BLOCK_1X128, rows, cols, err));
    MOE_TRY(moe_quant_check_format(f, err));
    launch_block1x128<moe_bf16>(q, scale_inv, (moe_bf16 *)y, (const moe_bf16 *)x, rows, cols, f,
                                pow2);
    return MOE_OK;
}

static __device__ __forceinline__ void st_val(float *p, float v) { *p = v; }
static __device__ __forceinline__ void st_val(moe_bf16 *p, float v) { *p = moe_st(v); }

/* T = float: the fp32 values; T = moe_bf16: rounded to bf16, block1x128_kernel's y bytes
 * (the same decode and multiply), for the FP8 dispatch's received rows */
template <typename T>
static __global__ void dequant_blockwise_kernel(T *y, const uint8_t *q, const float *scale_inv,
                                                int rows, int cols, moe_fp8_format f, int bh) {
    const size_t n = (size_t)rows * cols, stride = (size_t)gridDim.x * blockDim.x;
    const int nbc = cols / MOE_QUANT_BLOCK;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const int r = (int)(i / cols), c = (int)(i % cols);
        st_val(&y[i], moe_q_dequant(moe_fp8_decode(q[i], f),
                                    scale_inv[(size_t)(r / bh) * nbc + c / MOE_QUANT_BLOCK]));
    }
}

extern "C" moe_status moe_cuda_dequant_blockwise(float *y, const uint8_t *q,
                                                 const float *scale_inv, int rows, int cols,
                                                 moe_fp8_format f, int block_2d, moe_error *err) {
    MOE_TRY(moe_quant_check(block_2d ? MOE_QUANT_BLOCK_128X128 : MOE_QUANT_BLOCK_1X128, rows,
                            cols, err));
    MOE_TRY(moe_quant_check_format(f, err));
    const size_t n = (size_t)rows * cols;
    if (n) {
        dequant_blockwise_kernel<float>
            <<<grid_for(n, THREADS * 4), THREADS, 0, moe_cuda_stream()>>>(
                y, q, scale_inv, rows, cols, f, block_2d ? MOE_QUANT_BLOCK : 1);
        MOE_CUDA_LAUNCH_CHECK();
    }
    return MOE_OK;
}

/* 8 elements per thread: y = bf16(dequant(code)), the scale of their tile */
static __global__ void dequant_act_kernel(moe_bf16 *y, const uint8_t *q, const float *scale_inv,
                                          size_t units, moe_fp8_format f) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t c = (size_t)blockIdx.x * blockDim.x + threadIdx.x; c < units; c += stride) {
        const uint2 w = ((const uint2 *)q)[c];
        const float si = scale_inv[c / 16];
        moe_bf16x8 d;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const uint8_t code = (uint8_t)((k < 4 ? w.x : w.y) >> (8 * (k % 4)));
            d.h[k] = moe_st(moe_q_dequant(moe_fp8_decode(code, f), si));
        }
        ((uint4 *)y)[c] = d.u;
    }
}

extern "C" moe_status moe_cuda_dequant_blockwise_act(void *y, const uint8_t *q,
                                                     const float *scale_inv, int rows, int cols,
                                                     moe_fp8_format f, moe_error *err) {
    MOE_TRY(moe_quant_check(MOE_QUANT_BLOCK_1X128, rows, cols, err));
    MOE_TRY(moe_quant_check_format(f, err));
    const size_t n = (size_t)rows * cols;
    if (n == 0)
        return MOE_OK;
    if ((uintptr_t)y % 16 == 0 && (uintptr_t)q % 8 == 0) { /* 8 elements a thread */
        const size_t units = n / 8; /* cols is a multiple of 128 (checked above) */
        size_t blocks = (units + THREADS - 1) / THREADS;
        blocks = blocks > 4096 ? 4096 : blocks;
        dequant_act_kernel<<<(unsigned)blocks, THREADS, 0, moe_cuda_stream()>>>(
            (moe_bf16 *)y, q, scale_inv, units, f);
    } else {
        dequant_blockwise_kernel<moe_bf16>
            <<<grid_for(n, THREADS * 4), THREADS, 0, moe_cuda_stream()>>>(
                (moe_bf16 *)y, q, scale_inv, rows, cols, f, 1);
    }
    MOE_CUDA_LAUNCH_CHECK();
    return MOE_OK;
}

/* blockIdx.z of a transposing quantizer: a batch of matrices, each quantized on its own (the
 * experts' weights): move the pointers to member blockIdx.z (@p n elements, @p ns scales) */
template <typename T>
static __device__ __forceinline__ void batch_member(const T *&x, uint8_t *&q, float *&scale_inv,
                                                    uint8_t *&qt, float *&scale_inv_t, size_t n,
                                                    size_t ns) {
    const size_t z = blockIdx.z;
    x += z * n;
    q += z * n;
    qt += z * n;
    scale_inv += z * ns;
    scale_inv_t += z * ns;
}

/* x and xᵀ blockwise from one read: one 256-thread block per 128×128 tile of x (grid
 * nbc × nbr), the tile in shared memory (129 floats a row: a column read by a warp hits 32
 * banks). 1×128: each warp quantizes 16 rows of the tile (x's tiles) and 16 of its columns
 * (xᵀ's tiles), 4 elements a lane, as block1x128_kernel; 128×128: one amax for the tile,
 * then every element cast once and written twice, to q (row-major) and to qt (transposed).
 * The writes of qt are coalesced: consecutive threads write consecutive bytes of a row of xᵀ */
#define TILE_LD (MOE_QUANT_BLOCK + 1)
template <typename T>
static __global__ void blockwise_t_kernel(uint8_t *q, float *scale_inv, uint8_t *qt,
                                          float *scale_inv_t, const T *x, int rows, int cols,
                                          moe_fp8_format f, int block_2d, int pow2) {
    extern __shared__ float tile[]; /* [128][TILE_LD] */
    __shared__ uint32_t warp_max[THREADS / 32];
    const int B = MOE_QUANT_BLOCK, bc = blockIdx.x, br = blockIdx.y;
    const int nbc = gridDim.x, nbr = gridDim.y, r0 = br * B, c0 = bc * B;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    batch_member(x, q, scale_inv, qt, scale_inv_t, (size_t)rows * cols, (size_t)nbr * nbc);
    for (int i = threadIdx.x; i < B * B; i += THREADS)
        tile[(i / B) * TILE_LD + i % B] = ld_f32(x[(size_t)(r0 + i / B) * cols + c0 + i % B]);
    __syncthreads();
    const float fmax = moe_fp8_max(f);
    if (block_2d) {
        uint32_t m = 0;
        for (int i = threadIdx.x; i < B * B; i += THREADS) {
            const uint32_t k = moe_q_abs_key(tile[(i / B) * TILE_LD + i % B]);
            m = k > m ? k : m;
        }
        m = block_max_key(m, warp_max);
        const float scale = moe_q_scale_from_amax(moe_q_key_amax(m), fmax, pow2);
        for (int i = threadIdx.x; i < B * B; i += THREADS) {
            const int r = i / B, c = i % B; /* x's row-major order */
            q[(size_t)(r0 + r) * cols + c0 + c] =
                moe_q_cast_scaled(tile[r * TILE_LD + c], scale, f);
            const int ct = i / B, rt = i % B; /* xᵀ's row-major order */
            qt[(size_t)(c0 + ct) * rows + r0 + rt] =
                moe_q_cast_scaled(tile[rt * TILE_LD + ct], scale, f);
        }
        if (threadIdx.x == 0) {
            scale_inv[(size_t)br * nbc + bc] = moe_q_scale_inv(scale);
            scale_inv_t[(size_t)bc * nbr + br] = moe_q_scale_inv(scale);
        }
        return;
    }
    for (int j = warp * 16; j < warp * 16 + 16; j++) {
        for (int t = 0; t < 2; t++) { /* t = 0: row j of the tile (x); 1: column j (xᵀ) */
            float v[4];
            uint32_t m = 0;
            for (int k = 0; k < 4; k++) {
                const int e = lane + 32 * k;
                v[k] = t ? tile[e * TILE_LD + j] : tile[j * TILE_LD + e];
                const uint32_t key = moe_q_abs_key(v[k]);
                m = key > m ? key : m;
            }
            m = warp_max_key(m);
            const float scale = moe_q_scale_from_amax(moe_q_key_amax(m), fmax, pow2);
            uint8_t *dst = t ? qt + (size_t)(c0 + j) * rows + r0 : q + (size_t)(r0 + j) * cols + c0;
            for (int k = 0; k < 4; k++)
                dst[lane + 32 * k] = moe_q_cast_scaled(v[k], scale, f);
            if (lane == 0) {
                if (t)
                    scale_inv_t[(size_t)(c0 + j) * nbr + br] = moe_q_scale_inv(scale);
                else
                    scale_inv[(size_t)(r0 + j) * nbc + bc] = moe_q_scale_inv(scale);
            }
        }
    }
}

/* A 128×128 block of a row-major matrix held in registers by a THREADS-thread block: chunk
 * i = threadIdx.x + THREADS·j (j < T2_PER) is the block's row i / T2_CH, columns 8 (i % T2_CH)
 * .. + 7, one 16-byte load of bf16 (two of fp32), so a warp reads two rows. */
#define T2_CH (MOE_QUANT_BLOCK / 8)                       /* 16 chunks a row */
#define T2_PER (MOE_QUANT_BLOCK * T2_CH / THREADS)        /* 8 chunks a thread */

/* load the block at @p x (row stride @p cols, @p nrows ≤ 128 of its rows exist: the others
 * read as zeros, whose key 0 leaves the amax alone) into @p r, and return its scale for a
 * format of largest value @p fmax: moe_q_scale_from_amax of the amax over every element, as
 * the CPU's 128×128 recipe. Every thread of the block must call it (block_max_key) */
template <typename T>
static __device__ __forceinline__ float tile2d_load_scale(raw8<T> (&r)[T2_PER], const T *x,
                                                          int cols, int nrows, float fmax,
                                                          int pow2, uint32_t *warp_max) {
#pragma unroll
    for (int j = 0; j < T2_PER; j++) {
        const int i = threadIdx.x + THREADS * j;
        if (i / T2_CH < nrows)
            ld_raw8<T>(r[j], x + (size_t)(i / T2_CH) * cols + 8 * (i % T2_CH));
        else
            r[j] = raw8<T>{};
    }
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < T2_PER; j++) {
        float v[8];
        unpack8(v, r[j]);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const uint32_t key = moe_q_abs_key(v[k]);
            m = key > m ? key : m;
        }
    }
    return moe_q_scale_from_amax(moe_q_key_amax(block_max_key(m, warp_max)), fmax, pow2);
}

/* The 128×128 recipe with its transposed copy, faster (the experts' weights, quantized once
 * per optimizer step: lib/lowp.c). blockwise_t_kernel above moves 2- or 4-byte elements and
 * 1-byte codes one at a time, holds the tile as 66 KB of fp32 (three blocks an SM) and casts
 * every element twice, once for x and once for xᵀ; on an H100 it ran the larger model's
 * expert weights at about 0.5 TB/s, 3.1 ms a step. Here, one 256-thread block per tile:
 *   1. each thread loads 8 chunks of 8 consecutive elements (16-byte loads; a warp reads two
 *      rows of the tile), keeps them in registers, and the tile's amax is the maximum of the
 *      integer keys (the warp's butterfly, then the 8 warps' through shared memory);
 *   2. each chunk is cast once, by the hardware's fp32x2 → FP8x2 conversion (the bytes of
 *      moe_fp8_encode on every value it casts: a tile with a NaN or an infinity has a NaN
 *      scale and is written as zeros, moe_q_cast_scaled's rule; quant1x128.cuh), stored to
 *      q as one 8-byte word, and put in a 16.5 KB code tile in shared memory;
 *   3. xᵀ's rows are the tile's columns: each thread gathers 8 chunks of 8 codes down a
 *      column and stores each as one 8-byte word. The code tile's rows are 129 bytes, so the
 *      16 chunks a half-warp gathers start in 16 different banks.
 * The codes of xᵀ are x's codes transposed (one scale for the whole tile), so both are the
 * CPU's bytes (tests/gpu_quant.c, gpu_fp8_layer.c); MOE_QUANT_WEIGHT=0 runs the kernel
 * above instead. */
#define T2_LD (MOE_QUANT_BLOCK + 1)
template <typename T, moe_fp8_format F>
static __global__ void __launch_bounds__(THREADS)
    block2d_t_kernel(uint8_t *q, float *scale_inv, uint8_t *qt, float *scale_inv_t, const T *x,
                     int rows, int cols, int pow2) {
    constexpr int B = MOE_QUANT_BLOCK;
    __shared__ uint8_t codes[B * T2_LD];
    __shared__ uint32_t warp_max[THREADS / 32];
    const int bc = blockIdx.x, br = blockIdx.y, nbc = gridDim.x, nbr = gridDim.y;
    const int r0 = br * B, c0 = bc * B;
    batch_member(x, q, scale_inv, qt, scale_inv_t, (size_t)rows * cols, (size_t)nbr * nbc);
    raw8<T> r[T2_PER];
    const float scale = tile2d_load_scale<T>(r, x + (size_t)r0 * cols + c0, cols, B,
                                             moe_fp8_max(F), pow2, warp_max);
    const float si = moe_q_scale_inv(scale);
#pragma unroll
    for (int j = 0; j < T2_PER; j++) {
        const int i = threadIdx.x + THREADS * j, row = i / T2_CH, c = 8 * (i % T2_CH);
        float v[8];
        unpack8(v, r[j]);
        uint2 w;
        moe_q_cast8_fast<F, false, true>(v, scale, si, &w, NULL);
        __stcs((uint2 *)(q + (size_t)(r0 + row) * cols + c0 + c), w);
#pragma unroll
        for (int k = 0; k < 8; k++)
            codes[row * T2_LD + c + k] = (uint8_t)((k < 4 ? w.x : w.y) >> (8 * (k % 4)));
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < T2_PER; j++) { /* chunk i of xᵀ: row i / 16 (x's column), 8 (i % 16) .. */
        const int i = threadIdx.x + THREADS * j, ct = i / T2_CH, rt = 8 * (i % T2_CH);
        uint32_t w[2] = {0, 0};
#pragma unroll
        for (int k = 0; k < 8; k++)
            w[k / 4] |= (uint32_t)codes[(rt + k) * T2_LD + ct] << (8 * (k % 4));
        __stcs((uint2 *)(qt + (size_t)(c0 + ct) * rows + r0 + rt), make_uint2(w[0], w[1]));
    }
    if (threadIdx.x == 0) {
        scale_inv[(size_t)br * nbc + bc] = si;
        scale_inv_t[(size_t)bc * nbr + br] = si;
    }
}

/* The 128×128 recipe's QDQ in one pass: the weights of the emulated linears (lib/lowp.c,
 * moe_lowp_qdq_weight, once per step, through moe_cuda_qdq), bf16 in and out. The generic
 * path converts to fp32, quantizes, dequantizes and converts back: four passes and about 22
 * bytes an element, where this moves 4. The block in registers (tile2d_load_scale), each
 * chunk cast and dequantized by moe_q_cast8_fast and stored as 16 bytes of bf16; the rows past
 * @p rows (a partial last block row, which the recipe allows) are neither read nor written.
 * The same bytes as the generic path (tests/gpu_quant.c, test_gpu_qdq). In place (y == x) is
 * safe: a block writes only the chunks its own threads read, after reading them. */
template <moe_fp8_format F>
static __global__ void __launch_bounds__(THREADS)
    block2d_qdq_kernel(moe_bf16 *y, const moe_bf16 *x, int rows, int cols, int pow2) {
    __shared__ uint32_t warp_max[THREADS / 32];
    const int r0 = blockIdx.y * MOE_QUANT_BLOCK, nrows = min(MOE_QUANT_BLOCK, rows - r0);
    const size_t base = (size_t)r0 * cols + (size_t)blockIdx.x * MOE_QUANT_BLOCK;
    raw8<moe_bf16> r[T2_PER];
    const float scale = tile2d_load_scale<moe_bf16>(r, x + base, cols, nrows, moe_fp8_max(F),
                                                    pow2, warp_max);
    const float si = moe_q_scale_inv(scale);
#pragma unroll
    for (int j = 0; j < T2_PER; j++) {
        const int i = threadIdx.x + THREADS * j;
        if (i / T2_CH >= nrows)
            continue;
        float v[8];
        unpack8(v, r[j]);
        uint2 c;
        moe_bf16x8 d;
        moe_q_cast8_fast<F, true, true>(v, scale, si, &c, &d);
        __stcs((uint4 *)(y + base + (size_t)(i / T2_CH) * cols + 8 * (i % T2_CH)), d.u);
    }
}

/* MOE_QUANT_WEIGHT=0: the 128×128 recipe's weights by the first kernels (the transposing
 * pass by blockwise_t_kernel, the emulated QDQ by the generic four passes) instead of
 * block2d_t_kernel and block2d_qdq_kernel; read at every launch, so a test or a benchmark
 * can switch it with setenv */
static int weight_v2(void) {
    const char *e = getenv("MOE_QUANT_WEIGHT");
    return !(e && !strcmp(e, "0"));
}

long long g_block2d_calls = 0; /* launches of block2d_t_kernel and block2d_qdq_kernel (a
                                  test's proof they ran) */

extern "C" long long moe_cuda_quant_block2d_calls(void) { return g_block2d_calls; }

template <typename T>
static moe_status launch_blockwise_t(uint8_t *q, float *scale_inv, uint8_t *qt,
                                     float *scale_inv_t, const T *x, int batch, int rows,
                                     int cols, moe_fp8_format f, int block_2d, int pow2,
                                     moe_error *err) {
    MOE_TRY(moe_quant_check_transpose(rows, err));
    MOE_TRY(moe_quant_check(MOE_QUANT_BLOCK_1X128, rows, cols, err));
    MOE_TRY(moe_quant_check_format(f, err));
    if (rows == 0 || cols == 0 || batch == 0)
        return MOE_OK;
    const dim3 grid(cols / MOE_QUANT_BLOCK, rows / MOE_QUANT_BLOCK, batch);
    if (block_2d && weight_v2()) {
        if (f == MOE_FP8_E4M3)
            block2d_t_kernel<T, MOE_FP8_E4M3><<<grid, THREADS, 0, moe_cuda_stream()>>>(
                q, scale_inv, qt, scale_inv_t, x, rows, cols, pow2);
        else
            block2d_t_kernel<T, MOE_FP8_E5M2><<<grid, THREADS, 0, moe_cuda_stream()>>>(
                q, scale_inv, qt, scale_inv_t, x, rows, cols, pow2);
        MOE_CUDA_LAUNCH_CHECK();
        g_block2d_calls++;
        return MOE_OK;
    }
    const size_t smem = (size_t)MOE_QUANT_BLOCK * TILE_LD * sizeof(float); /* 66 KB */
    moe_cuda_smem_opt_in<blockwise_t_kernel<T>>((int)smem);
    blockwise_t_kernel<T><<<grid, THREADS, smem, moe_cuda_stream()>>>(
        q, scale_inv, qt, scale_inv_t, x, rows, cols, f, block_2d, pow2);
    MOE_CUDA_LAUNCH_CHECK();
    return MOE_OK;
}

extern "C" moe_status moe_cuda_quant_blockwise_t(uint8_t *q, float *scale_inv, uint8_t *qt,
                                                 float *scale_inv_t, const float *x, int rows,
                                                 int cols, moe_fp8_format f, int block_2d,
                                                 int pow2, moe_error *err) {
    return launch_blockwise_t<float>(q, scale_inv, qt, scale_inv_t, x, 1, rows, cols, f,
                                     block_2d, pow2, err);
}

extern "C" moe_status moe_cuda_quant_blockwise_t_act(uint8_t *q, float *scale_inv, uint8_t *qt,
                                                     float *scale_inv_t, const void *x,
                                                     int batch, int rows, int cols,
                                                     moe_fp8_format f, int block_2d, int pow2,
                                                     moe_error *err) {
    return launch_blockwise_t<moe_bf16>(q, scale_inv, qt, scale_inv_t, (const moe_bf16 *)x,
                                        batch, rows, cols, f, block_2d, pow2, err);
}

/* ------------------------------------------------------------------ MXFP8 */

/* one warp per 32-element block (rows are whole blocks: block b is elements 32b .. 32b+31) */
static __global__ void mxfp8_kernel(uint8_t *q, uint8_t *scales, const float *x, size_t nblocks,
                                    moe_fp8_format f) {
    const size_t b = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (b >= nblocks)
        return;
    const float v = x[b * MOE_QUANT_MX_BLOCK + lane];
    const uint32_t m = warp_max_key(moe_q_abs_key(v));
    const uint8_t code = moe_mx_scale_code(moe_q_key_amax(m), f);
    q[b * MOE_QUANT_MX_BLOCK + lane] = moe_mx_cast(v, code, f);
    if (lane == 0)
        scales[b] = code;
}

extern "C" moe_status moe_cuda_quant_mxfp8(uint8_t *q, uint8_t *scales, const float *x, int rows,
                                           int cols, moe_fp8_format f, moe_error *err) {
    MOE_TRY(moe_quant_check(MOE_QUANT_MXFP8, rows, cols, err));
    MOE_TRY(moe_quant_check_format(f, err));
    const size_t nblocks = (size_t)rows * (cols / MOE_QUANT_MX_BLOCK);
    if (nblocks) {
        mxfp8_kernel<<<(unsigned)((nblocks + 7) / 8), THREADS, 0, moe_cuda_stream()>>>(
            q, scales, x, nblocks, f);
        MOE_CUDA_LAUNCH_CHECK();
    }
    return MOE_OK;
}

static __global__ void dequant_mxfp8_kernel(float *y, const uint8_t *q, const uint8_t *scales,
                                            size_t n, moe_fp8_format f) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = moe_q_dequant(moe_fp8_decode(q[i], f),
                             moe_e8m0_decode(scales[i / MOE_QUANT_MX_BLOCK]));
}

extern "C" moe_status moe_cuda_dequant_mxfp8(float *y, const uint8_t *q, const uint8_t *scales,
                                             int rows, int cols, moe_fp8_format f,
                                             moe_error *err) {
    MOE_TRY(moe_quant_check(MOE_QUANT_MXFP8, rows, cols, err));
    MOE_TRY(moe_quant_check_format(f, err));
    const size_t n = (size_t)rows * cols;
    if (n) {
        dequant_mxfp8_kernel<<<grid_for(n, THREADS * 4), THREADS, 0, moe_cuda_stream()>>>(
            y, q, scales, n, f);
        MOE_CUDA_LAUNCH_CHECK();
    }
    return MOE_OK;
}

/* ------------------------------------------------------------------ NVFP4 */

/* the 16 values of group g (consecutive in memory: cols is a multiple of 16), transformed */
static __device__ __forceinline__ void load_group(float *v, const float *x, size_t g, int rht,
                                                  uint32_t signs) {
    for (int j = 0; j < 16; j++)
        v[j] = x[g * 16 + j];
    if (rht)
        moe_q_rht16(v, signs, 0);
}

static __global__ void nvfp4_amax_kernel(unsigned *key, const float *x, size_t ngroups, int rht,
                                         uint32_t signs) {
    uint32_t m = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t g = (size_t)blockIdx.x * blockDim.x + threadIdx.x; g < ngroups; g += stride) {
        float v[16];
        load_group(v, x, g, rht, signs);
        for (int j = 0; j < 16; j++) {
            const uint32_t k = moe_q_abs_key(v[j]);
            m = k > m ? k : m;
        }
    }
    m = warp_max_key(m);
    if ((threadIdx.x & 31) == 0 && m)
        atomicMax(key, m);
}

/* NVFP4's scalars (global scale from the amax), and the stochastic rounding's draw counter
 * advanced by this one thread (quantize.h, moe_nvfp4_opts::sr_counter): nvfp4_kernel, next on
 * the stream, reads it, so a replayed graph rounds with a fresh seed */
static __global__ void nvfp4_scalars_kernel(moe_quant_scalars *s, uint64_t *sr_counter) {
    moe_quant_scalars_from_amax(s, moe_q_key_amax(__float_as_uint(s->amax)),
                                MOE_NVFP4_GLOBAL_NUM);
    if (sr_counter)
        *sr_counter += 1;
}

/* one thread per 16-element row group; a 256-thread block covers 16 rows × 16 groups, thread
 * t = 16·(group in block) + (row in block), so the 16 rows of a 16×16 block are a half-warp */
static __global__ void nvfp4_kernel(uint8_t *q, uint8_t *scales, const moe_quant_scalars *g,
                                    const float *x, int rows, int cols, moe_nvfp4_opts o,
                                    uint32_t signs) {
    const int rl = threadIdx.x & 15, gl = threadIdx.x >> 4, gpr = cols / 16;
    const int r = blockIdx.x * 16 + rl, gc = blockIdx.y * 16 + gl;
    const bool valid = r < rows && gc < gpr;
    float v[16];
    uint32_t m = 0;
    if (valid) {
        load_group(v, x, (size_t)r * gpr + gc, o.rht, signs);
        for (int j = 0; j < 16; j++) {
            const uint32_t k = moe_q_abs_key(v[j]);
            m = k > m ? k : m;
        }
    }
    if (o.block_2d)
        m = warp_max_key(m, 16); /* every lane takes part, valid or not (a missing row adds 0) */
    if (!valid)
        return;
    const float G = g->scale;
    if (o.stochastic && o.sr_counter)
        o.sr_seed = moe_q_sr_seed(o.sr_seed, *o.sr_counter);
    const uint8_t code = moe_nvfp4_scale_code(moe_q_key_amax(m), G);
    const float d = moe_nvfp4_divisor(code, G);
    const uint64_t i0 = (uint64_t)r * cols + (uint64_t)gc * 16;
    uint8_t *qr = q + (size_t)r * (cols / 2) + (size_t)gc * 8;
    for (int j = 0; j < 16; j += 2)
        qr[j / 2] = (uint8_t)(moe_nvfp4_cast(v[j], d, o.stochastic, o.sr_seed, i0 + j) |
                              moe_nvfp4_cast(v[j + 1], d, o.stochastic, o.sr_seed, i0 + j + 1)
                                  << 4);
    if (!o.block_2d)
        scales[(size_t)r * gpr + gc] = code;
    else if (rl == 0)
        scales[(size_t)blockIdx.x * gpr + gc] = code;
}

extern "C" moe_status moe_cuda_quant_nvfp4(uint8_t *q, uint8_t *scales, moe_quant_scalars *g,
                                           const float *x, int rows, int cols,
                                           const moe_nvfp4_opts *opts, moe_error *err) {
    const moe_nvfp4_opts o = opts ? *opts : moe_nvfp4_opts{};
    MOE_TRY(moe_quant_check(o.block_2d ? MOE_QUANT_NVFP4_2D : MOE_QUANT_NVFP4, rows, cols, err));
    cudaStream_t st = moe_cuda_stream();
    const uint32_t signs = o.rht ? moe_q_rht_signs(o.rht_seed) : 0;
    const size_t ngroups = (size_t)rows * (cols / 16);
    MOE_CUDA_CHECK(cudaMemsetAsync(&g->amax, 0, sizeof(float), st));
    if (ngroups) {
        nvfp4_amax_kernel<<<grid_for(ngroups, THREADS), THREADS, 0, st>>>(
            (unsigned *)&g->amax, x, ngroups, o.rht, signs);
        MOE_CUDA_LAUNCH_CHECK();
    }
    nvfp4_scalars_kernel<<<1, 1, 0, st>>>(g, o.stochastic ? o.sr_counter : nullptr);
    MOE_CUDA_LAUNCH_CHECK();
    if (ngroups) {
        const dim3 grid((rows + 15) / 16, (cols / 16 + 15) / 16);
        nvfp4_kernel<<<grid, THREADS, 0, st>>>(q, scales, g, x, rows, cols, o, signs);
        MOE_CUDA_LAUNCH_CHECK();
    }
    return MOE_OK;
}

/* one thread per group: decode, scale, optional inverse transform */
static __global__ void dequant_nvfp4_kernel(float *y, const uint8_t *q, const uint8_t *scales,
                                            const moe_quant_scalars *g, int rows, int cols,
                                            int bh, int rht, uint32_t signs) {
    const int gpr = cols / 16;
    const size_t ngroups = (size_t)rows * gpr, stride = (size_t)gridDim.x * blockDim.x;
    const float G = g->scale;
    for (size_t gi = (size_t)blockIdx.x * blockDim.x + threadIdx.x; gi < ngroups; gi += stride) {
        const int r = (int)(gi / gpr), gc = (int)(gi % gpr);
        const float ds = moe_q_div(moe_e4m3_decode(scales[(size_t)(r / bh) * gpr + gc]), G);
        float v[16];
        for (int j = 0; j < 16; j++) {
            const uint8_t byte = q[(size_t)r * (cols / 2) + (size_t)gc * 8 + j / 2];
            v[j] = moe_q_dequant(moe_e2m1_decode(j & 1 ? byte >> 4 : byte & 0xF), ds);
        }
        if (rht)
            moe_q_rht16(v, signs, 1);
        for (int j = 0; j < 16; j++)
            y[gi * 16 + j] = v[j];
    }
}

extern "C" moe_status moe_cuda_dequant_nvfp4(float *y, const uint8_t *q, const uint8_t *scales,
                                             const moe_quant_scalars *g, int rows, int cols,
                                             const moe_nvfp4_opts *opts, moe_error *err) {
    const moe_nvfp4_opts o = opts ? *opts : moe_nvfp4_opts{};
    MOE_TRY(moe_quant_check(o.block_2d ? MOE_QUANT_NVFP4_2D : MOE_QUANT_NVFP4, rows, cols, err));
    const size_t ngroups = (size_t)rows * (cols / 16);
    if (ngroups) {
        dequant_nvfp4_kernel<<<grid_for(ngroups, THREADS), THREADS, 0, moe_cuda_stream()>>>(
            y, q, scales, g, rows, cols, o.block_2d ? 16 : 1, o.rht,
            o.rht ? moe_q_rht_signs(o.rht_seed) : 0u);
        MOE_CUDA_LAUNCH_CHECK();
    }
    return MOE_OK;
}

static __global__ void rht16_kernel(float *y, const float *x, size_t ngroups, uint32_t signs,
                                    int inverse) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t gi = (size_t)blockIdx.x * blockDim.x + threadIdx.x; gi < ngroups; gi += stride) {
        float v[16];
        for (int j = 0; j < 16; j++)
            v[j] = x[gi * 16 + j];
        moe_q_rht16(v, signs, inverse);
        for (int j = 0; j < 16; j++)
            y[gi * 16 + j] = v[j];
    }
}

extern "C" moe_status moe_cuda_rht16(float *y, const float *x, int rows, int cols, uint64_t seed,
                                     int inverse, moe_error *err) {
    MOE_TRY(moe_quant_check(MOE_QUANT_NVFP4, rows, cols, err));
    const size_t ngroups = (size_t)rows * (cols / 16);
    if (ngroups) {
        rht16_kernel<<<grid_for(ngroups, THREADS), THREADS, 0, moe_cuda_stream()>>>(
            y, x, ngroups, moe_q_rht_signs(seed), inverse);
        MOE_CUDA_LAUNCH_CHECK();
    }
    return MOE_OK;
}

/* ------------------------------------------------------------------ QDQ */

static __global__ void bf16_to_f32_kernel(float *y, const moe_bf16 *x, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] = moe_ld(x[i]);
}

static __global__ void f32_to_bf16_kernel(moe_bf16 *y, const float *x, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] = moe_st(x[i]);
}

/* the CUDA quantizers, in moe_qdq_f32's table: the same sequence as the CPU's */
static const moe_quant_fns g_cuda_quant_fns = {
    moe_cuda_quant_tensorwise, moe_cuda_dequant_tensorwise, moe_cuda_quant_blockwise,
    moe_cuda_dequant_blockwise, moe_cuda_quant_mxfp8,       moe_cuda_dequant_mxfp8,
    moe_cuda_quant_nvfp4,      moe_cuda_dequant_nvfp4,     moe_cuda_quant_delayed_site};

/* bf16 → fp32 (exact), the recipe's quantize and dequantize, fp32 → bf16 (round to nearest
 * even: the one rounding the CPU's fp32 activations do not have) */
extern "C" void moe_cuda_qdq(void *dst, const void *src, int rows, int cols,
                             const moe_qdq_spec *spec, const moe_qdq_ws *ws) {
    const size_t n = (size_t)rows * cols;
    if (n == 0)
        return;
    moe_error err;
    if (spec->recipe == MOE_QUANT_BLOCK_128X128 && weight_v2()) { /* one pass, too */
        const moe_status s = moe_quant_check(spec->recipe, rows, cols, &err);
        MOE_REQUIRE_OK(s, &err, "moe_cuda_qdq"); /* the model checked every shape at start-up */
        const dim3 grid(cols / MOE_QUANT_BLOCK, (rows + MOE_QUANT_BLOCK - 1) / MOE_QUANT_BLOCK);
        if (spec->format == MOE_FP8_E4M3)
            block2d_qdq_kernel<MOE_FP8_E4M3><<<grid, THREADS, 0, moe_cuda_stream()>>>(
                (moe_bf16 *)dst, (const moe_bf16 *)src, rows, cols, spec->pow2);
        else
            block2d_qdq_kernel<MOE_FP8_E5M2><<<grid, THREADS, 0, moe_cuda_stream()>>>(
                (moe_bf16 *)dst, (const moe_bf16 *)src, rows, cols, spec->pow2);
        MOE_CUDA_LAUNCH_CHECK();
        g_block2d_calls++;
        return;
    }
    if (spec->recipe == MOE_QUANT_BLOCK_1X128) { /* one pass: the same bytes as the four below */
        const moe_status s = moe_cuda_quant_blockwise_act(ws->q, (float *)ws->scales, dst, src,
                                                          rows, cols, spec->format, spec->pow2,
                                                          &err);
        MOE_REQUIRE_OK(s, &err, "moe_cuda_qdq"); /* the model checked every shape at start-up */
        return;
    }
    cudaStream_t st = moe_cuda_stream();
    bf16_to_f32_kernel<<<grid_for(n, THREADS * 4), THREADS, 0, st>>>(ws->x, (const moe_bf16 *)src,
                                                                     n);
    const moe_status s = moe_qdq_f32(&g_cuda_quant_fns, spec, ws, rows, cols, &err);
    MOE_REQUIRE_OK(s, &err, "moe_cuda_qdq"); /* the model checked every shape at start-up */
    f32_to_bf16_kernel<<<grid_for(n, THREADS * 4), THREADS, 0, st>>>((moe_bf16 *)dst, ws->x, n);
}

/* the tokens' transpose of a wgrad operand (moe_cuda_qdq_t) through a 32×32 tile in shared
 * memory (33 columns: no bank conflicts), so that both the read and the write are coalesced:
 * y [cols, m] fp32 = xᵀ with the tokens n..m−1 zero */
static __global__ void tokens_t_in_kernel(float *y, const moe_bf16 *x, int n, int m, int cols) {
    __shared__ float tile[32][33];
    const int c0 = blockIdx.x * 32, r0 = blockIdx.y * 32;
    for (int i = threadIdx.y; i < 32; i += blockDim.y) {
        const int r = r0 + i, c = c0 + threadIdx.x;
        tile[i][threadIdx.x] = r < n && c < cols ? moe_ld(x[(size_t)r * cols + c]) : 0.0f;
    }
    __syncthreads();
    for (int i = threadIdx.y; i < 32; i += blockDim.y) {
        const int c = c0 + i, r = r0 + threadIdx.x;
        if (c < cols && r < m)
            y[(size_t)c * m + r] = tile[threadIdx.x][i];
    }
}

/* ... and back: y [m, cols] bf16 (round to nearest even) = xᵀ of x [cols, m] fp32 */
static __global__ void tokens_t_out_kernel(moe_bf16 *y, const float *x, int m, int cols) {
    __shared__ float tile[32][33];
    const int r0 = blockIdx.x * 32, c0 = blockIdx.y * 32;
    for (int i = threadIdx.y; i < 32; i += blockDim.y) {
        const int c = c0 + i, r = r0 + threadIdx.x;
        tile[i][threadIdx.x] = c < cols && r < m ? x[(size_t)c * m + r] : 0.0f;
    }
    __syncthreads();
    for (int i = threadIdx.y; i < 32; i += blockDim.y) {
        const int r = r0 + i, c = c0 + threadIdx.x;
        if (r < m && c < cols)
            y[(size_t)r * cols + c] = moe_st(tile[threadIdx.x][i]);
    }
}

/* the CPU's sequence (moe_cpu_qdq_t): transpose in, the recipe's QDQ of [cols, m] (its blocks
 * along the tokens), transpose out */
extern "C" void moe_cuda_qdq_t(void *dst, const void *src, int n, int m, int cols,
                               const moe_qdq_spec *spec, const moe_qdq_ws *ws) {
    MOE_ASSERT(n >= 0 && n <= m && dst != src);
    if ((size_t)m * cols == 0)
        return;
    cudaStream_t st = moe_cuda_stream();
    const dim3 block(32, 8);
    tokens_t_in_kernel<<<dim3((cols + 31) / 32, (m + 31) / 32), block, 0, st>>>(
        ws->x, (const moe_bf16 *)src, n, m, cols);
    MOE_CUDA_LAUNCH_CHECK();
    moe_error err;
    const moe_status s = moe_qdq_f32(&g_cuda_quant_fns, spec, ws, cols, m, &err);
    MOE_REQUIRE_OK(s, &err, "moe_cuda_qdq_t"); /* the model checked every shape at start-up */
    tokens_t_out_kernel<<<dim3((m + 31) / 32, (cols + 31) / 32), block, 0, st>>>(
        (moe_bf16 *)dst, ws->x, m, cols);
    MOE_CUDA_LAUNCH_CHECK();
}
