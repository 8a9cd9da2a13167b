/**
 * @file fp8_gemm.h
 * @brief Chapter 05's low-precision GEMM: D[M,N] = A[M,K] · B[N,K]ᵀ on quantized operands
 *        (FP8 tensorwise and blockwise, MXFP8, NVFP4), its contract, its shape rules and the
 *        CPU twin every GPU result is compared with.
 *
 * **The operands.** Both are row-major with K along the row ("K-major"): A holds M rows of
 * activations (or output gradients), B holds N rows of weights, the way a Linear layer stores
 * them ([out, in]). So the forward `y = x·wᵀ` is this GEMM as it stands; the backward GEMMs
 * (dgrad `dx = dy·w`, wgrad `dw = dyᵀ·x`) need their operands transposed first, because
 * **Hopper's FP8 tensor cores (wgmma) read FP8 operands only K-major**: cuBLASLt accepts FP8
 * on sm_90 only in the "TN" layout, and so does this function. For the blockwise recipe the
 * transposed FP8 copies of the backward come from moe_cpu_quant_blockwise_t() (and its CUDA
 * twin), which quantizes x and xᵀ from one read of x; the other recipes have no such kernel
 * yet.
 * Each operand is described by a ::moe_qmatrix: its recipe, its codes, its scales as the
 * quantizers of quantize.h wrote them (no layout conversion by the caller).
 *
 * **What each recipe computes**, with deq() the dequantization of quantize.h:
 *
 * | A recipe | B recipe | D | on sm_90 (Hopper) |
 * |---|---|---|---|
 * | tensorwise | tensorwise | deq(A)·deq(B)ᵀ, the two fp32 scale_inv applied by the GEMM | cuBLASLt FP8, `A/B_SCALE_POINTER` |
 * | 1×128 | 128×128 or 1×128 | the same, one fp32 scale per 128-deep K block of each row (and per 128 rows of B) | cuBLASLt FP8, `VEC128_32F` / `BLK128x128_32F` |
 * | MXFP8 | MXFP8 | the same, E8M0 scales per 32 | **emulated**: dequantize → bf16 GEMM |
 * | NVFP4 | NVFP4 (1D or 16×16) | Σ q·s_b over K, times 1/(G_a·G_b) | **emulated**: dequantize → bf16 GEMM |
 *
 * Element formats: E4M3 × E4M3, and the "hybrid" recipe's E5M2 (gradients) × E4M3 in either
 * position (cuBLASLt 13.0 on an H100 ran E5M2 × E4M3 with tensorwise and with blockwise
 * scales); cuBLASLt has no E5M2 × E5M2 GEMM, so that pair is a named error.
 *
 * **Emulation, and why it has the native numerics.** MXFP8 and NVFP4 GEMMs exist in cuBLASLt
 * only on sm_100+ (block-scaled tcgen05 MMAs). On Hopper the GPU path dequantizes each
 * operand (the quantize.cu dequantizers) and multiplies the bf16 copies with fp32
 * accumulation. Every dequantized MXFP8 element is a 4-bit significand times a power of two,
 * and every NVFP4 element decode(q)·decode(s_b) has at most 6 significant bits (E2M1 × E4M3)
 * when the global scale is left out, so both are exact in bf16 (8 bits) unless they fall
 * below bf16's smallest subnormal (2⁻¹³³); NVFP4's 1/(G_a·G_b) is applied as the GEMM's alpha,
 * as the native kernel does. So the products are the native path's exactly and only the
 * accumulation order differs. With the random Hadamard transform, both operands must have it
 * with the same seed (the product is then invariant: H·Hᵀ = I along K) and the GEMM runs
 * on the transformed values, as a native NVFP4 GEMM would.
 *
 * **Scale layouts cuBLASLt wants** (moe_gemm_scale_index()): the 1×128 scales of an operand
 * [R, K] as [K/128][round_up(R, 4)] (R contiguous: the quantizer writes [R][K/128], so the GEMM
 * transposes them, R·K/128 floats, ~3 % of the FP8 bytes); the 128×128 scales as
 * [⌈R/128⌉][round_up(K/128, 4)] (the quantizer's [⌈R/128⌉][K/128], padded when K/128 is not a
 * multiple of 4); MXFP8/NVFP4 scales (native path only) in 128×4 tiles swizzled as cuBLASLt's
 * block-scaling layout. The GEMM converts them into a scratch buffer on every call; it is one
 * small kernel.
 *
 * **Shapes** (moe_fp8_gemm_check()): M ≥ 0 (ragged: tokens per expert), any for tensorwise,
 * MXFP8 and NVFP4, a multiple of 4 for blockwise (cuBLASLt 13.0 on an H100 refused blockwise
 * GEMMs with M = 1, 2, 301, 302 and ran M = 4, 8, 16, 304, 1000, for N of 256 to 384 and K of
 * 256 to 1024); N a multiple of 16; K a multiple of 16 (tensorwise), 128 (blockwise), 32
 * (MXFP8 and NVFP4: a packed NVFP4 row must be 16-byte aligned); otherwise ::MOE_ERR_CONFIG
 * with the multiple. The GPU path also wants the codes, the scales and D 16-byte aligned
 * (cudaMalloc gives 256); the tensorwise scale_inv, 8 bytes into ::moe_quant_scalars, is
 * copied to an aligned slot by the GEMM, because cublasLtMatmul refuses it where it is.
 */
#ifndef MOE_FP8_GEMM_H
#define MOE_FP8_GEMM_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "quantize.h"

/** One quantized GEMM operand: a row-major [rows, K] matrix as a quantizer of quantize.h left
 *  it. Pointers are host memory for the CPU twin, device memory for the CUDA GEMM. */
typedef struct moe_qmatrix {
    moe_quant_recipe recipe; /**< how it was quantized (NVFP4_2D: NVFP4 with 16×16 scales) */
    moe_fp8_format format;   /**< element format of the FP8 recipes (ignored for NVFP4) */
    const uint8_t *codes;    /**< [rows, K] bytes; NVFP4: [rows, K/2], two codes a byte */
    const void *scales;      /**< the per-block scales, in the quantizer's layout: fp32
                                  scale_inv (blockwise), E8M0 bytes (MXFP8), E4M3 bytes
                                  (NVFP4); NULL for tensorwise */
    const moe_quant_scalars *scalars; /**< tensorwise: the quantizer's scalars (scale_inv is
                                           used); NVFP4: its global scale; else NULL */
    moe_nvfp4_opts nvfp4;    /**< NVFP4: the options it was quantized with (block_2d, rht,
                                  rht_seed are read) */
} moe_qmatrix;

/** How an operand's scales must be laid out for cuBLASLt (moe_gemm_scale_index()). */
typedef enum moe_gemm_scale_layout {
    MOE_GEMM_SCALES_VEC128 = 0,  /**< 1×128: [C][round_up(R, 4)], R contiguous */
    MOE_GEMM_SCALES_BLK128 = 1,  /**< 128×128: [R][round_up(C, 4)] (R = ⌈rows/128⌉) */
    MOE_GEMM_SCALES_SWIZZLED = 2 /**< MXFP8 / NVFP4: 128×4 tiles of 512 bytes */
} moe_gemm_scale_layout;

/** @brief n rounded up to a multiple of m. @param n value (≥ 0) @param m multiple (> 0)
 *  @return the rounded value */
static inline MOE_HOSTDEV size_t moe_round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

/**
 * @brief Where scale (r, c) of an R×C scale grid goes in the layout cuBLASLt reads.
 *
 * VEC128: `c·round_up(R,4) + r` (the scales of one K block are contiguous over the rows, the
 * leading dimension padded to 4 floats = 16 bytes, as TransformerEngine's "GEMM-ready" 1D
 * scales). BLK128: `r·round_up(C,4) + c`. SWIZZLED: the grid is cut into tiles of 128 rows ×
 * 4 columns, tiles in row-major order, and inside a tile row rr, column cc is at
 * `(rr mod 32)·16 + (rr / 32)·4 + cc` (cuBLAS's block-scaling factor layout for
 * VEC32_UE8M0 / VEC16_UE4M3, PyTorch's `to_blocked`).
 * @param l the layout  @param r row of the grid  @param c column  @param R rows of the grid
 * @param C columns of the grid  @return the element offset
 */
static inline MOE_HOSTDEV size_t moe_gemm_scale_index(moe_gemm_scale_layout l, int r, int c,
                                                      int R, int C) {
    switch (l) {
    case MOE_GEMM_SCALES_VEC128:
        return (size_t)c * moe_round_up((size_t)R, 4) + (size_t)r;
    case MOE_GEMM_SCALES_BLK128:
        return (size_t)r * moe_round_up((size_t)C, 4) + (size_t)c;
    default: {
        const size_t tile = (size_t)(r / 128) * ((size_t)(C + 3) / 4) + (size_t)(c / 4);
        const int rr = r % 128;
        return tile * 512 + (size_t)(rr % 32) * 16 + (size_t)(rr / 32) * 4 + (size_t)(c % 4);
    }
    }
}

/** @brief Elements of an R×C scale grid in layout @p l, padding included.
 *  @param l the layout @param R rows of the grid @param C columns @return the count */
static inline MOE_HOSTDEV size_t moe_gemm_scale_elems(moe_gemm_scale_layout l, int R, int C) {
    switch (l) {
    case MOE_GEMM_SCALES_VEC128:
        return (size_t)C * moe_round_up((size_t)R, 4);
    case MOE_GEMM_SCALES_BLK128:
        return (size_t)R * moe_round_up((size_t)C, 4);
    default:
        return moe_round_up((size_t)R, 128) * moe_round_up((size_t)C, 4);
    }
}

#ifdef __cplusplus
extern "C" { /* kernels/fp8_gemm.cu calls the check */
#endif

/**
 * @brief Check a low-precision GEMM before running it: the pair of recipes, the formats,
 *        the NVFP4 options and the shape.
 *
 * Accepted pairs: tensorwise × tensorwise; 1×128 (A) × 128×128 or 1×128 (B); MXFP8 × MXFP8;
 * NVFP4 (1D or 16×16) × NVFP4 (1D or 16×16) with the same random Hadamard transform (both
 * off, or both on with one seed). Formats: not E5M2 × E5M2. Shape: M ≥ 0 (blockwise: a
 * multiple of 4), N ≥ 0 and a multiple of 16, K ≥ 0 and a multiple of the recipe's (16
 * tensorwise, 128 blockwise, 32 MXFP8 and NVFP4). Codes must be given, and the scales or
 * scalars the recipe needs.
 * @param a the [M, K] operand  @param b the [N, K] operand  @param M rows of A and D
 * @param N rows of B, columns of D  @param K the shared dimension
 * @param err receives the reason, naming the flag or the fix
 * @return ::MOE_OK or ::MOE_ERR_CONFIG
 */
moe_status moe_fp8_gemm_check(const moe_qmatrix *a, const moe_qmatrix *b, int M, int N, int K,
                              moe_error *err);

/**
 * @brief Dequantize one operand on the CPU: y[rows, K] = deq(q) with the dequantizer of its
 *        recipe (quantize.h), the inverse Hadamard transform included.
 * @param y [rows, K] output  @param q the operand (host pointers)  @param rows its rows
 * @param K its columns  @param err receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_CONFIG for a bad recipe or shape
 */
moe_status moe_cpu_qmatrix_dequant(float *y, const moe_qmatrix *q, int rows, int K,
                                   moe_error *err);

/**
 * @brief The CPU twin of the low-precision GEMM: D[M,N] = deq(A)·deq(B)ᵀ, each operand
 *        dequantized by moe_cpu_qmatrix_dequant(), the product by moe_cpu_matmul_forward()
 *        (fp32 accumulation; no rounding of the operands beyond their quantization).
 * @param d [M, N] fp32 output  @param a the [M, K] operand  @param b the [N, K] operand
 * @param M rows of A  @param N rows of B  @param K shared dimension
 * @param err receives the reason on failure
 * @return ::MOE_OK, ::MOE_ERR_CONFIG (moe_fp8_gemm_check()) or ::MOE_ERR_NOMEM
 */
moe_status moe_cpu_fp8_gemm(float *d, const moe_qmatrix *a, const moe_qmatrix *b, int M, int N,
                            int K, moe_error *err);

/* -------------------------------------------------------- the FP8 grouped GEMM (experts) */

/**
 * @brief Check an FP8 grouped GEMM (the experts' forward) before running it.
 *
 * The GEMM: for each group (expert) g, rows off[g] .. off[g+1] − 1 of D [rows, N] are
 * A[those rows, K] · B_gᵀ, B_g = rows g·N .. g·N + N − 1 of B [G·N, K]. A is blockwise 1×128
 * (tokens: moe_cpu_quant_blockwise() with block_2d = 0 over all rows at once, so its scales are
 * [rows][K/128]) and B is blockwise 128×128 quantized **per expert** (each [N, K] slice on its
 * own, so expert g's scales are the ⌈N/128⌉·(K/128) floats from g·⌈N/128⌉·(K/128) on, and no
 * block spans two experts); both E4M3 (the forward's operands in the `e4m3` and `hybrid`
 * formats). Shape: 1 ≤ G ≤ MOE_GROUPED_DEV_MAX_GROUPS, rows ≥ 0 (any: no multiple of 4 as the
 * cuBLASLt path asks, groups may be empty or a single row), N > 0 a multiple of 16, K > 0 a
 * multiple of 128 (one scale block per pipeline stage; a K that is not is the named error, pad
 * it with zero columns). The offsets themselves are not checked here (the GPU path never sees
 * them on the host): off[0] = 0, non-decreasing, off[G] = rows.
 * @param a the [rows, K] activations  @param b the [G·N, K] expert weights
 * @param G groups  @param rows rows of A and D  @param N columns of D (rows of each B_g)
 * @param K the shared dimension  @param err receives the reason
 * @return ::MOE_OK or ::MOE_ERR_CONFIG
 */
moe_status moe_fp8_grouped_check(const moe_qmatrix *a, const moe_qmatrix *b, int G, int rows,
                                 int N, int K, moe_error *err);

/**
 * @brief The CPU twin of the FP8 grouped GEMM (moe_cuda_fp8_grouped_gemm): per group, the
 *        blockwise dequantization of its rows of A and of B_g, then an fp32 GEMM — the dense
 *        twin moe_cpu_fp8_gemm() on each group's views, the same scales.
 * @param d [rows, N] fp32 output  @param a the [rows, K] 1×128 operand
 * @param b the [G·N, K] operand, 128×128 per expert  @param off [G+1] row offsets (host)
 * @param G groups  @param rows rows of A  @param N columns of D  @param K shared dimension
 * @param err receives the reason on failure
 * @return ::MOE_OK, ::MOE_ERR_CONFIG (moe_fp8_grouped_check(), or offsets that are not
 *         0 .. rows non-decreasing) or ::MOE_ERR_NOMEM
 */
moe_status moe_cpu_fp8_grouped_gemm(float *d, const moe_qmatrix *a, const moe_qmatrix *b,
                                    const int *off, int G, int rows, int N, int K,
                                    moe_error *err);

#ifdef __cplusplus
}
#endif

#endif /* MOE_FP8_GEMM_H */
