/*
 * Chapter 05, exercise: blockwise FP8 quantization on the CPU — one scale per 1×128 tile of
 * a row (activations, gradients) or per 128×128 block (weights), DeepSeek-V3's recipe.
 *
 * `make STUDENT=1 check-ch05` links this file in place of the library's
 * moe_cpu_quant_blockwise (lib/cpu/quantize.c: the reference solution) and runs the
 * chapter's tests on it (tests/test_quant.c): every tile and block of random data spread
 * over about four decades, E4M3 and E5M2, with and without power-of-two scales, on shapes
 * with a partial last block of rows, against the definition recomputed in the test (each
 * scale bit for bit, each code, dequantize(quantize(x)) within the format's error); a zero
 * block; a NaN that must poison its own tile or block and nothing else; the named shape
 * errors; the same bytes with one thread and with many; the transposed copy
 * (moe_cpu_quant_blockwise_t calls your function twice); and the QDQ op the emulated FP8
 * training runs (the CPU backend's quantizer table holds your function, so
 * `--fp8-recipe blockwise` trains through it).
 *
 * The problem. x is row-major [rows, cols], cols a multiple of 128. Cut it into blocks:
 *   block_2d = 0: 1×128 tiles, block (br, bc) = row br, columns [128·bc, 128·bc + 128);
 *   block_2d = 1: 128×128 blocks, rows [128·br, min(128·br + 128, rows)) — the last block
 *                 of rows may be partial (rows need not be a multiple of 128).
 * With nbc = cols/128 blocks per row of blocks, block (br, bc) is number b = br·nbc + bc,
 * and there are moe_quant_scale_count() of them: rows·nbc, or ceil(rows/128)·nbc.
 * For each block:
 *   amax     = max |x| over the block
 *   scale    = fmax / amax              fmax = 448 (E4M3) or 57344 (E5M2), moe_fp8_max(f)
 *              (pow2 = 1: rounded DOWN to a power of two, so amax·scale ≤ fmax still holds
 *               and scale, 1/scale are exact)
 *   q[i]     = encode_f(x[i] · scale)   for every element i of the block (round to nearest
 *                                       even, saturating at ±fmax)
 *   scale_inv[b] = 1 / scale            what the GEMM and the dequantizer multiply by:
 *                                       x[i] ≈ decode_f(q[i]) · scale_inv[b]
 * Each block's amax lands on the format's largest value, so a block of small numbers keeps
 * its precision even when another block of the same tensor holds an outlier (what one
 * tensorwise scale cannot do: the notebook's §2).
 *
 * The helpers (lib/quant_formats.h, shared with the CUDA kernels, which is why your bytes can
 * equal theirs): moe_q_abs_key, moe_q_key_amax, moe_q_scale_from_amax, moe_q_cast_scaled,
 * moe_q_scale_inv, moe_fp8_max. Use them: the tests compare bits.
 *
 * The catches:
 *  - The amax of a block holding a NaN must be NaN (the block is then poisoned: NaN scale,
 *    codes 0, it dequantizes to NaN instead of hiding the bad value behind ±448). fmaxf
 *    skips NaN (fmaxf(NaN, 1) = 1), so do not reduce with it: take the maximum of the
 *    integer keys moe_q_abs_key(x) (|x|'s bits; their unsigned order is the order of the
 *    values and every NaN is above +inf) and turn the largest key back into a float with
 *    moe_q_key_amax. Integers also make the maximum independent of the reduction order
 *    (OpenMP, a warp shuffle).
 *  - The zero block (scale 1, not 448/0), the scale that overflows fp32 for a tiny amax
 *    (FLT_MAX), the NaN/inf block (NaN scale) and pow2 are moe_q_scale_from_amax's rules;
 *    a NaN scale gives code 0 in moe_q_cast_scaled.
 *  - Store 1/scale computed from the scale, moe_q_scale_inv(scale) — NOT amax/fmax: the
 *    two are different floats for some amaxes (amax = 1.3, E4M3: 1/(448/1.3) =
 *    0.00290178577, 1.3/448 = 0.00290178554), and the test checks the bits.
 *  - x·scale must be one fp32 multiplication (moe_q_cast_scaled does it): computed in double
 *    and then encoded, a product that falls just beside a midpoint between two codes can
 *    round the other way.
 *  - Shapes: cols not a multiple of 128 or rows < 0 is MOE_ERR_CONFIG with a message that
 *    says "not a multiple of 128" (moe_quant_check() writes it), an unknown format too
 *    (moe_quant_check_format()); rows = 0 is fine (nothing to do).
 *  - A partial last block of rows (block_2d, rows % 128 ≠ 0) takes the rows there are: its
 *    amax is over those rows only, and nothing is read or written past row rows − 1.
 *
 * Worked example (one 1×128 tile, E4M3, pow2 = 0): the tile's largest |x| is 3.5, so
 *   scale = 448/3.5 = 128, scale_inv = 0.0078125;
 *   x = 3.5   → 448   → code 0x7E (E4M3's max: 1.75·2⁸)
 *   x = 1.0   → 128   → code 0x70 (2⁷: exponent field 7 + 7 = 14, mantissa 0)
 *   x = 0.3   → 38.4  → code 0x62 (40 = 1.25·2⁵, the nearest E4M3 value; it dequantizes to
 *                        40 · 0.0078125 = 0.3125)
 *   x = −0.01 → −1.28 → code 0xBA (−1.25) → −0.009765625
 *   x = 0     → code 0x00.
 * With amax = 5.0: scale = 448/5 = 89.6 (fp32 89.5999985), 5·scale → code 0x7E,
 * scale_inv = 0.0111607146; with pow2 the scale is 64 (the power of two below 89.6),
 * 5·64 = 320 → code 0x7A, scale_inv = 0.015625.
 *
 * Optional: `#pragma omp parallel for` over the blocks (every block is independent, and
 * each output is written by one thread); the tests also compare one thread with many.
 */
#include "../../student.h"
#include "quantize.h"

moe_status moe_cpu_quant_blockwise(uint8_t *q, float *scale_inv, const float *x, int rows,
                                   int cols, moe_fp8_format f, int block_2d, int pow2,
                                   moe_error *err) {
    MOE_STUDENT_TODO(); /* delete this line when the function is written */
    /* TODO 1: the checks: moe_quant_check(MOE_QUANT_BLOCK_128X128 or MOE_QUANT_BLOCK_1X128,
     *         rows, cols, err) and moe_quant_check_format(f, err), each through MOE_TRY */
    /* TODO 2: B = MOE_QUANT_BLOCK (128), nbc = cols / B, bh = block height (128 or 1),
     *         nbr = ceil(rows / bh), fmax = moe_fp8_max(f) */
    /* TODO 3: for each block b = br·nbc + bc (rows [r0, r1), r1 = min(r0 + bh, rows);
     *         columns [c0, c0 + B)):
     *           a. m = the largest moe_q_abs_key(x[r·cols + c]) of the block (a uint32_t);
     *           b. scale = moe_q_scale_from_amax(moe_q_key_amax(m), fmax, pow2);
     *           c. q[r·cols + c] = moe_q_cast_scaled(x[r·cols + c], scale, f);
     *           d. scale_inv[b] = moe_q_scale_inv(scale).
     *         Index with size_t: rows·cols can pass INT_MAX. */
    (void)q, (void)scale_inv, (void)x, (void)rows, (void)cols, (void)f, (void)block_2d,
        (void)pow2, (void)err;
    return MOE_OK;
}
