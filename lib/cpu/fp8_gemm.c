/*
 * Chapter 05's low-precision GEMM on the CPU: the shape and recipe rules every backend
 * applies (moe_fp8_gemm_check) and the reference the CUDA GEMM is compared with
 * (moe_cpu_fp8_gemm): dequantize each operand with the dequantizer of its recipe, then one
 * fp32 GEMM. The operands' values are exactly those the quantizers encode, so the only
 * difference left to the GPU is its accumulation order and its bf16 output rounding.
 */
#include <stdlib.h>

#include "config.h" /* MOE_GROUPED_DEV_MAX_GROUPS */
#include "fp8_gemm.h"
#include "ops.h"

static int is_fp8(moe_quant_recipe r) {
    return r == MOE_QUANT_TENSORWISE || r == MOE_QUANT_BLOCK_1X128 ||
           r == MOE_QUANT_BLOCK_128X128 || r == MOE_QUANT_MXFP8;
}

static int is_nvfp4(moe_quant_recipe r) { return r == MOE_QUANT_NVFP4 || r == MOE_QUANT_NVFP4_2D; }

/* the K multiple a recipe pair needs, and its name for messages */
static int k_multiple(moe_quant_recipe r, const char **name) {
    switch (r) {
    case MOE_QUANT_TENSORWISE:
        *name = "tensorwise FP8";
        return 16; /* 16-byte rows: cuBLASLt's FP8 alignment */
    case MOE_QUANT_BLOCK_1X128:
        *name = "blockwise FP8";
        return MOE_QUANT_BLOCK;
    case MOE_QUANT_MXFP8:
        *name = "MXFP8";
        return MOE_QUANT_MX_BLOCK;
    default:
        *name = "NVFP4";
        return 32; /* K/2 bytes a row, 16-byte aligned */
    }
}

moe_status moe_fp8_gemm_check(const moe_qmatrix *a, const moe_qmatrix *b, int M, int N, int K,
                              moe_error *err) {
    const moe_quant_recipe ra = a->recipe, rb = b->recipe;
    int pair_ok = 0;
    if (ra == MOE_QUANT_TENSORWISE || ra == MOE_QUANT_MXFP8)
        pair_ok = rb == ra;
    else if (ra == MOE_QUANT_BLOCK_1X128)
        pair_ok = rb == MOE_QUANT_BLOCK_1X128 || rb == MOE_QUANT_BLOCK_128X128;
    else if (is_nvfp4(ra))
        pair_ok = is_nvfp4(rb);
    if (!pair_ok)
        return moe_error_set(
            err, MOE_ERR_CONFIG,
            "FP8 GEMM: recipes %d (A) x %d (B) do not pair; use tensorwise x tensorwise, "
            "1x128 (A, activations/gradients) x 128x128 or 1x128 (B), MXFP8 x MXFP8, or "
            "NVFP4 x NVFP4 (--fp8-recipe / --fp4-recipe name one recipe for both operands)",
            (int)ra, (int)rb);
    if (is_fp8(ra)) {
        MOE_TRY(moe_quant_check_format(a->format, err));
        MOE_TRY(moe_quant_check_format(b->format, err));
        if (a->format == MOE_FP8_E5M2 && b->format == MOE_FP8_E5M2)
            return moe_error_set(err, MOE_ERR_CONFIG,
                                 "FP8 GEMM: E5M2 x E5M2 has no cuBLASLt kernel; quantize one "
                                 "operand in E4M3 (--fp8-format hybrid puts E5M2 on gradients "
                                 "only, E4M3 on activations and weights)");
    } else if (a->nvfp4.rht != b->nvfp4.rht ||
               (a->nvfp4.rht && a->nvfp4.rht_seed != b->nvfp4.rht_seed)) {
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "NVFP4 GEMM: the random Hadamard transform must be on both "
                             "operands with the same seed, or on neither (A: %s seed %llu, "
                             "B: %s seed %llu): the product is invariant only then",
                             a->nvfp4.rht ? "on" : "off", (unsigned long long)a->nvfp4.rht_seed,
                             b->nvfp4.rht ? "on" : "off", (unsigned long long)b->nvfp4.rht_seed);
    }
    const char *name;
    const int km = k_multiple(ra, &name);
    if (M < 0 || N < 0 || K < 0)
        return moe_error_set(err, MOE_ERR_CONFIG, "%s GEMM: negative shape M=%d N=%d K=%d", name,
                             M, N, K);
    if (K % km)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "%s GEMM: K=%d is not a multiple of %d (the scale block and the "
                             "16-byte rows the FP8/FP4 tensor cores read); pad K to a multiple "
                             "of %d",
                             name, K, km, km);
    if (ra == MOE_QUANT_BLOCK_1X128 && M % 4)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "blockwise FP8 GEMM: M=%d is not a multiple of 4, which cuBLASLt's "
                             "1x128-scaled kernels need (measured on an H100: M = 1, 2, 301, 302 "
                             "refused; 4, 8, 304, 1000 run); pad the tokens to a multiple of 4",
                             M);
    if (N % 16)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "%s GEMM: N=%d (rows of B, columns of D) is not a multiple of 16, "
                             "which cuBLASLt's FP8 kernels need; pad the weight's rows to a "
                             "multiple of 16",
                             name, N);
    const int need_scalars = ra == MOE_QUANT_TENSORWISE || is_nvfp4(ra);
    const int need_scales = ra != MOE_QUANT_TENSORWISE;
    if (!a->codes || !b->codes || (need_scalars && (!a->scalars || !b->scalars)) ||
        (need_scales && (!a->scales || !b->scales)))
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "%s GEMM: an operand lacks its codes, scales or scalars (NULL)",
                             name);
    return MOE_OK;
}

moe_status moe_cpu_qmatrix_dequant(float *y, const moe_qmatrix *q, int rows, int K,
                                   moe_error *err) {
    switch (q->recipe) {
    case MOE_QUANT_TENSORWISE:
        return moe_cpu_dequant_tensorwise(y, q->codes, q->scalars, (size_t)rows * K, q->format,
                                          err);
    case MOE_QUANT_BLOCK_1X128:
    case MOE_QUANT_BLOCK_128X128:
        return moe_cpu_dequant_blockwise(y, q->codes, q->scales, rows, K, q->format,
                                         q->recipe == MOE_QUANT_BLOCK_128X128, err);
    case MOE_QUANT_MXFP8:
        return moe_cpu_dequant_mxfp8(y, q->codes, q->scales, rows, K, q->format, err);
    case MOE_QUANT_NVFP4:
    case MOE_QUANT_NVFP4_2D: {
        moe_nvfp4_opts o = q->nvfp4;
        o.block_2d = q->recipe == MOE_QUANT_NVFP4_2D;
        return moe_cpu_dequant_nvfp4(y, q->codes, q->scales, q->scalars, rows, K, &o, err);
    }
    }
    return moe_error_set(err, MOE_ERR_CONFIG, "dequantize: unknown recipe %d", (int)q->recipe);
}

/* deq(q) as moe_real (a copy only in the double-precision build) */
static moe_status dequant_real(moe_real **out, const moe_qmatrix *q, int rows, int K,
                               moe_error *err) {
    const size_t n = (size_t)rows * K;
    float *y = malloc((n ? n : 1) * sizeof *y);
    if (!y)
        return moe_error_set(err, MOE_ERR_NOMEM, "FP8 GEMM twin: %zu floats", n);
    const moe_status s = moe_cpu_qmatrix_dequant(y, q, rows, K, err);
    if (s != MOE_OK) {
        free(y);
        return s;
    }
#ifdef MOE_REAL_DOUBLE
    moe_real *r = malloc((n ? n : 1) * sizeof *r);
    if (!r) {
        free(y);
        return moe_error_set(err, MOE_ERR_NOMEM, "FP8 GEMM twin: %zu reals", n);
    }
    for (size_t i = 0; i < n; i++)
        r[i] = y[i];
    free(y);
    *out = r;
#else
    *out = y;
#endif
    return MOE_OK;
}

/* D = deq(A)·deq(B)ᵀ, the shape already checked */
static moe_status gemm_twin(float *d, const moe_qmatrix *a, const moe_qmatrix *b, int M, int N,
                            int K, moe_error *err) {
    moe_real *da = NULL, *db = NULL;
    moe_status s = dequant_real(&da, a, M, K, err);
    if (s == MOE_OK)
        s = dequant_real(&db, b, N, K, err);
    if (s == MOE_OK) {
#ifdef MOE_REAL_DOUBLE
        const size_t nd = (size_t)M * N;
        moe_real *dd = malloc((nd > 0 ? nd : 1) * sizeof *dd);
        if (!dd) {
            s = moe_error_set(err, MOE_ERR_NOMEM, "FP8 GEMM twin: output");
        } else {
            moe_cpu_matmul_forward(dd, da, db, M, K, N);
            for (size_t i = 0; i < nd; i++)
                d[i] = (float)dd[i];
            free(dd);
        }
#else
        moe_cpu_matmul_forward(d, da, db, M, K, N);
#endif
    }
    free(da);
    free(db);
    return s;
}

moe_status moe_cpu_fp8_gemm(float *d, const moe_qmatrix *a, const moe_qmatrix *b, int M, int N,
                            int K, moe_error *err) {
    MOE_TRY(moe_fp8_gemm_check(a, b, M, N, K, err));
    return gemm_twin(d, a, b, M, N, K, err);
}

moe_status moe_fp8_grouped_check(const moe_qmatrix *a, const moe_qmatrix *b, int G, int rows,
                                 int N, int K, moe_error *err) {
    if (a->recipe != MOE_QUANT_BLOCK_1X128 || b->recipe != MOE_QUANT_BLOCK_128X128)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "FP8 grouped GEMM: blockwise only, 1x128 activations (A) x 128x128 "
                             "weights (B); got recipes %d x %d (--fp8-recipe blockwise)",
                             (int)a->recipe, (int)b->recipe);
    if (a->format != MOE_FP8_E4M3 || b->format != MOE_FP8_E4M3)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "FP8 grouped GEMM: E4M3 x E4M3 only (the forward's operands in "
                             "both --fp8-format e4m3 and hybrid); got formats %d x %d",
                             (int)a->format, (int)b->format);
    if (G < 1 || G > MOE_GROUPED_DEV_MAX_GROUPS)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "FP8 grouped GEMM: G=%d groups, the kernel takes 1 to %d (its "
                             "shared-memory offset table)",
                             G, MOE_GROUPED_DEV_MAX_GROUPS);
    if (rows < 0 || N <= 0 || N % 16)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "FP8 grouped GEMM: rows=%d N=%d: rows must be >= 0 and N a "
                             "positive multiple of 16 (16-byte output rows for TMA); pad the "
                             "experts' output width",
                             rows, N);
    if (K <= 0 || K % MOE_QUANT_BLOCK)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "FP8 grouped GEMM: K=%d is not a positive multiple of %d: the "
                             "kernel applies one scale per 128-deep K block, one pipeline "
                             "stage; pad K with zero columns to a multiple of %d",
                             K, MOE_QUANT_BLOCK, MOE_QUANT_BLOCK);
    if (!a->codes || !b->codes || !a->scales || !b->scales)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "FP8 grouped GEMM: an operand lacks its codes or scales (NULL)");
    return MOE_OK;
}

moe_status moe_cpu_fp8_grouped_gemm(float *d, const moe_qmatrix *a, const moe_qmatrix *b,
                                    const int *off, int G, int rows, int N, int K,
                                    moe_error *err) {
    MOE_TRY(moe_fp8_grouped_check(a, b, G, rows, N, K, err));
    if (off[0] != 0 || off[G] != rows)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "FP8 grouped GEMM twin: offsets run from %d to %d, not 0 to rows=%d",
                             off[0], off[G], rows);
    const int kb = K / MOE_QUANT_BLOCK, nbn = (N + MOE_QUANT_BLOCK - 1) / MOE_QUANT_BLOCK;
    for (int g = 0; g < G; g++) {
        const int n = off[g + 1] - off[g];
        if (n < 0)
            return moe_error_set(err, MOE_ERR_CONFIG,
                                 "FP8 grouped GEMM twin: offsets decrease at group %d", g);
        if (n == 0)
            continue;
        /* the group's rows of A (1×128: rows are independent) and expert g's weights */
        moe_qmatrix av = *a, bv = *b;
        av.codes = a->codes + (size_t)off[g] * K;
        av.scales = (const float *)a->scales + (size_t)off[g] * kb;
        bv.codes = b->codes + (size_t)g * N * K;
        bv.scales = (const float *)b->scales + (size_t)g * nbn * kb;
        MOE_TRY(gemm_twin(d + (size_t)off[g] * N, &av, &bv, n, N, K, err));
    }
    return MOE_OK;
}
