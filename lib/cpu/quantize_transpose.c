/*
 * Blockwise FP8 of x and of its transpose on the CPU (chapter 05): the reference of the
 * fused CUDA quantize + transpose (moe_cuda_quant_blockwise_t, kernels/quantize.cu).
 *
 * The reference is the definition: quantize x, then quantize its transpose, both through
 * moe_cpu_quant_blockwise() (the CUDA twin does both from one read of each 128×128 tile).
 * This function has a file of its own, apart from lib/cpu/quantize.c, so that those are two
 * calls through the symbol: `make STUDENT=1 check-ch05` replaces moe_cpu_quant_blockwise at
 * link time (Makefile, "chapter self-checks"), and in the same file the compiler inlined the
 * first call (GCC -O3 did), which kept the reference's codes for x under a student's
 * function.
 */
#include <stdlib.h>

#include "quantize.h"

moe_status moe_cpu_quant_blockwise_t(uint8_t *q, float *scale_inv, uint8_t *qt,
                                     float *scale_inv_t, const float *x, int rows, int cols,
                                     moe_fp8_format f, int block_2d, int pow2, moe_error *err) {
    MOE_TRY(moe_quant_check_transpose(rows, err));
    MOE_TRY(moe_cpu_quant_blockwise(q, scale_inv, x, rows, cols, f, block_2d, pow2, err));
    const size_t n = (size_t)rows * cols;
    float *xt = malloc((n ? n : 1) * sizeof *xt);
    if (!xt)
        return moe_error_set(err, MOE_ERR_NOMEM, "blockwise FP8 transpose: %zu floats", n);
#pragma omp parallel for schedule(static) if ((size_t)rows * cols > 65536)
    for (int c = 0; c < cols; c++)
        for (int r = 0; r < rows; r++)
            xt[(size_t)c * rows + r] = x[(size_t)r * cols + c];
    const moe_status s = moe_cpu_quant_blockwise(qt, scale_inv_t, xt, cols, rows, f, block_2d,
                                                 pow2, err);
    free(xt);
    return s;
}
