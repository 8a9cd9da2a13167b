/*
 * The quantization recipes of chapter 05 on the CPU: the reference the CUDA kernels
 * (kernels/quantize.cu) must match byte for byte.
 *
 * Every recipe has the same three steps:
 *   1. amax: the largest |x| of each block (or of the tensor). Computed on integer keys
 *      (moe_q_abs_key: |x|'s bits, ordered like the values, NaN above +inf), so any order of
 *      reduction gives the same answer, and a NaN anywhere makes the block's amax NaN;
 *   2. the block's scale from its amax (quant_formats.h: moe_q_scale_from_amax,
 *      moe_mx_scale_code, moe_nvfp4_scale_code), with the rules for zero and non-finite
 *      blocks documented in quantize.h;
 *   3. each element scaled and encoded (moe_q_cast_scaled, moe_mx_cast, E2M1 to nearest even
 *      or stochastically).
 * Dequantize is decode(code) × the block's dequantization scale.
 *
 * The per-element and per-block arithmetic is not written here but in quant_formats.h,
 * which the CUDA kernels include too; this file only walks the blocks. OpenMP splits the
 * work by rows or blocks; every output is written by one thread, and the amax reductions are
 * maxima of integers, so the result does not depend on the number of threads.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "quantize.h"

/* ------------------------------------------------------------------ shapes */

static int recipe_width(moe_quant_recipe r) {
    switch (r) {
    case MOE_QUANT_BLOCK_1X128:
    case MOE_QUANT_BLOCK_128X128:
        return MOE_QUANT_BLOCK;
    case MOE_QUANT_MXFP8:
        return MOE_QUANT_MX_BLOCK;
    case MOE_QUANT_NVFP4:
    case MOE_QUANT_NVFP4_2D:
        return MOE_QUANT_NVFP4_BLOCK;
    default:
        return 1;
    }
}

static const char *recipe_name(moe_quant_recipe r) {
    switch (r) {
    case MOE_QUANT_TENSORWISE:
        return "tensorwise FP8";
    case MOE_QUANT_BLOCK_1X128:
        return "blockwise FP8 (1x128 tiles)";
    case MOE_QUANT_BLOCK_128X128:
        return "blockwise FP8 (128x128 blocks)";
    case MOE_QUANT_MXFP8:
        return "MXFP8";
    case MOE_QUANT_NVFP4:
        return "NVFP4";
    case MOE_QUANT_NVFP4_2D:
        return "NVFP4 (16x16 blocks)";
    }
    return "unknown recipe";
}

moe_status moe_quant_check(moe_quant_recipe r, int rows, int cols, moe_error *err) {
    if ((int)r < MOE_QUANT_TENSORWISE || (int)r > MOE_QUANT_NVFP4_2D)
        return moe_error_set(err, MOE_ERR_CONFIG, "quantize: unknown recipe %d", (int)r);
    if (rows < 0 || cols < 0)
        return moe_error_set(err, MOE_ERR_CONFIG, "%s: negative shape [%d, %d]",
                             recipe_name(r), rows, cols);
    const int w = recipe_width(r);
    if (cols % w)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "%s: %d columns is not a multiple of %d (the scale block along "
                             "a row); pad the tensor's columns to a multiple of %d",
                             recipe_name(r), cols, w, w);
    return MOE_OK;
}

size_t moe_quant_scale_count(moe_quant_recipe r, int rows, int cols) {
    const size_t R = rows > 0 ? (size_t)rows : 0, w = (size_t)recipe_width(r);
    const size_t nb = cols > 0 ? (size_t)cols / w : 0;
    switch (r) {
    case MOE_QUANT_BLOCK_128X128:
    case MOE_QUANT_NVFP4_2D:
        return (R + w - 1) / w * nb;
    case MOE_QUANT_BLOCK_1X128:
    case MOE_QUANT_MXFP8:
    case MOE_QUANT_NVFP4:
        return R * nb;
    default:
        return 1;
    }
}

size_t moe_quant_code_bytes(moe_quant_recipe r, int rows, int cols) {
    const size_t n = (size_t)(rows > 0 ? rows : 0) * (size_t)(cols > 0 ? cols : 0);
    return r == MOE_QUANT_NVFP4 || r == MOE_QUANT_NVFP4_2D ? n / 2 : n;
}

static moe_status check_format(moe_fp8_format f, const char *who, moe_error *err) {
    if (f != MOE_FP8_E4M3 && f != MOE_FP8_E5M2)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "%s: unknown FP8 format %d (MOE_FP8_E4M3 or MOE_FP8_E5M2)", who,
                             (int)f);
    return MOE_OK;
}

moe_status moe_quant_check_format(moe_fp8_format f, moe_error *err) {
    return check_format(f, "quantize", err);
}

moe_status moe_quant_check_transpose(int rows, moe_error *err) {
    if (rows < 0 || rows % MOE_QUANT_BLOCK)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "blockwise FP8 with a transposed copy: %d rows is not a multiple of "
                             "%d (the rows become the transposed copy's columns, tiled by %d); "
                             "pad the tokens to a multiple of %d",
                             rows, MOE_QUANT_BLOCK, MOE_QUANT_BLOCK, MOE_QUANT_BLOCK);
    return MOE_OK;
}

moe_status moe_quant_check_window(int len, int pos, moe_error *err) {
    if (len < 1 || pos < 0 || pos >= len)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "delayed scaling: history slot %d of a window of %d (need a "
                             "window of at least 1 and 0 <= slot < window)",
                             pos, len);
    return MOE_OK;
}

/* ------------------------------------------------------------------ tensorwise */

/* Every loop below is parallel only above 65,536 elements: for a small tensor a parallel
 * region costs more than the work, and many tiny regions (the stochastic-rounding test
 * quantizes one 16-element row thousands of times) crawl on a loaded machine. The bytes do
 * not depend on the thread count (test_thread_count_invariant). */

/* max |x| as a key (see the top of the file) */
static uint32_t amax_key(const float *x, size_t n) {
    uint32_t m = 0;
#pragma omp parallel for reduction(max : m) schedule(static) if (n > 65536)
    for (size_t i = 0; i < n; i++) {
        const uint32_t k = moe_q_abs_key(x[i]);
        m = k > m ? k : m;
    }
    return m;
}

moe_status moe_cpu_quant_tensorwise(uint8_t *q, moe_quant_scalars *s, const float *x, size_t n,
                                    moe_fp8_format f, moe_error *err) {
    MOE_TRY(check_format(f, "tensorwise FP8", err));
    moe_quant_scalars_from_amax(s, moe_q_key_amax(amax_key(x, n)), moe_fp8_max(f));
    const float scale = s->scale;
#pragma omp parallel for schedule(static) if (n > 65536)
    for (size_t i = 0; i < n; i++)
        q[i] = moe_q_cast_scaled(x[i], scale, f);
    return MOE_OK;
}

moe_status moe_cpu_quant_delayed(uint8_t *q, moe_quant_scalars *s, float *history, int len,
                                 int pos, const float *x, size_t n, moe_fp8_format f,
                                 moe_error *err) {
    MOE_TRY(check_format(f, "delayed scaling", err));
    MOE_TRY(moe_quant_check_window(len, pos, err));
    const float scale = s->scale;
#pragma omp parallel for schedule(static) if (n > 65536)
    for (size_t i = 0; i < n; i++)
        q[i] = moe_fp8_encode(moe_q_mul(x[i], scale), f);
    moe_quant_delayed_finish(s, history, len, pos, moe_q_key_amax(amax_key(x, n)),
                             moe_fp8_max(f));
    return MOE_OK;
}

moe_status moe_quant_check_delayed(const moe_delayed_ref *d, moe_error *err) {
    if (d->len < 1)
        return moe_error_set(err, MOE_ERR_CONFIG, "delayed scaling: an amax history of %d "
                             "steps (need at least 1)", d->len);
    if (d->margin < 0 || d->margin > MOE_QUANT_MAX_MARGIN)
        return moe_error_set(err, MOE_ERR_CONFIG, "delayed scaling: a margin of %d (need 0 to "
                             "%d: the scale is divided by 2^margin)", d->margin,
                             MOE_QUANT_MAX_MARGIN);
    if (d->algo != MOE_AMAX_MAX && d->algo != MOE_AMAX_MOST_RECENT)
        return moe_error_set(err, MOE_ERR_CONFIG, "delayed scaling: unknown amax algorithm %d",
                             (int)d->algo);
    return MOE_OK;
}

moe_status moe_cpu_quant_delayed_site(uint8_t *q, moe_quant_scalars *s, const moe_delayed_ref *d,
                                      const float *x, size_t n, moe_fp8_format f,
                                      moe_error *err) {
    MOE_TRY(check_format(f, "delayed scaling", err));
    MOE_TRY(moe_quant_check_delayed(d, err));
    if (d->record)
        moe_delayed_record(d->site, d->history, d->len, d->algo,
                           moe_quant_delayed_num(f, d->margin), moe_q_key_amax(amax_key(x, n)));
    moe_delayed_scalars(s, d->site);
    const float scale = s->scale;
#pragma omp parallel for schedule(static) if (n > 65536)
    for (size_t i = 0; i < n; i++)
        q[i] = moe_q_cast_scaled(x[i], scale, f);
    return MOE_OK;
}

moe_status moe_cpu_dequant_tensorwise(float *y, const uint8_t *q, const moe_quant_scalars *s,
                                      size_t n, moe_fp8_format f, moe_error *err) {
    MOE_TRY(check_format(f, "tensorwise FP8", err));
    const float si = s->scale_inv;
#pragma omp parallel for schedule(static) if (n > 65536)
    for (size_t i = 0; i < n; i++)
        y[i] = moe_q_dequant(moe_fp8_decode(q[i], f), si);
    return MOE_OK;
}

/* ------------------------------------------------------------------ blockwise */

moe_status moe_cpu_quant_blockwise(uint8_t *q, float *scale_inv, const float *x, int rows,
                                   int cols, moe_fp8_format f, int block_2d, int pow2,
                                   moe_error *err) {
    const moe_quant_recipe rc = block_2d ? MOE_QUANT_BLOCK_128X128 : MOE_QUANT_BLOCK_1X128;
    MOE_TRY(moe_quant_check(rc, rows, cols, err));
    MOE_TRY(check_format(f, recipe_name(rc), err));
    const int B = MOE_QUANT_BLOCK, nbc = cols / B, bh = block_2d ? B : 1;
    const int nbr = (rows + bh - 1) / bh;
    const float fmax = moe_fp8_max(f);
#pragma omp parallel for schedule(static) if ((size_t)rows * cols > 65536)
    for (long long b = 0; b < (long long)nbr * nbc; b++) {
        const int br = (int)(b / nbc), bc = (int)(b % nbc);
        const int r0 = br * bh, r1 = r0 + bh < rows ? r0 + bh : rows, c0 = bc * B;
        uint32_t m = 0;
        for (int r = r0; r < r1; r++)
            for (int c = c0; c < c0 + B; c++) {
                const uint32_t k = moe_q_abs_key(x[(size_t)r * cols + c]);
                m = k > m ? k : m;
            }
        const float scale = moe_q_scale_from_amax(moe_q_key_amax(m), fmax, pow2);
        for (int r = r0; r < r1; r++)
            for (int c = c0; c < c0 + B; c++)
                q[(size_t)r * cols + c] = moe_q_cast_scaled(x[(size_t)r * cols + c], scale, f);
        scale_inv[b] = moe_q_scale_inv(scale);
    }
    return MOE_OK;
}

moe_status moe_cpu_dequant_blockwise(float *y, const uint8_t *q, const float *scale_inv,
                                     int rows, int cols, moe_fp8_format f, int block_2d,
                                     moe_error *err) {
    const moe_quant_recipe rc = block_2d ? MOE_QUANT_BLOCK_128X128 : MOE_QUANT_BLOCK_1X128;
    MOE_TRY(moe_quant_check(rc, rows, cols, err));
    MOE_TRY(check_format(f, recipe_name(rc), err));
    const int B = MOE_QUANT_BLOCK, nbc = cols / B, bh = block_2d ? B : 1;
#pragma omp parallel for schedule(static) if ((size_t)rows * cols > 65536)
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            const float si = scale_inv[(size_t)(r / bh) * nbc + c / B];
            y[(size_t)r * cols + c] = moe_q_dequant(moe_fp8_decode(q[(size_t)r * cols + c], f), si);
        }
    return MOE_OK;
}

/* ------------------------------------------------------------------ MXFP8 */

moe_status moe_cpu_quant_mxfp8(uint8_t *q, uint8_t *scales, const float *x, int rows, int cols,
                               moe_fp8_format f, moe_error *err) {
    MOE_TRY(moe_quant_check(MOE_QUANT_MXFP8, rows, cols, err));
    MOE_TRY(check_format(f, "MXFP8", err));
    const size_t nblocks = (size_t)rows * (cols / MOE_QUANT_MX_BLOCK);
#pragma omp parallel for schedule(static) if ((size_t)rows * cols > 65536)
    for (long long b = 0; b < (long long)nblocks; b++) {
        const float *xb = x + (size_t)b * MOE_QUANT_MX_BLOCK; /* rows are whole blocks */
        uint32_t m = 0;
        for (int j = 0; j < MOE_QUANT_MX_BLOCK; j++) {
            const uint32_t k = moe_q_abs_key(xb[j]);
            m = k > m ? k : m;
        }
        const uint8_t code = moe_mx_scale_code(moe_q_key_amax(m), f);
        for (int j = 0; j < MOE_QUANT_MX_BLOCK; j++)
            q[(size_t)b * MOE_QUANT_MX_BLOCK + j] = moe_mx_cast(xb[j], code, f);
        scales[b] = code;
    }
    return MOE_OK;
}

moe_status moe_cpu_dequant_mxfp8(float *y, const uint8_t *q, const uint8_t *scales, int rows,
                                 int cols, moe_fp8_format f, moe_error *err) {
    MOE_TRY(moe_quant_check(MOE_QUANT_MXFP8, rows, cols, err));
    MOE_TRY(check_format(f, "MXFP8", err));
    const size_t n = (size_t)rows * cols;
#pragma omp parallel for schedule(static) if (n > 65536)
    for (size_t i = 0; i < n; i++)
        y[i] = moe_q_dequant(moe_fp8_decode(q[i], f), moe_e8m0_decode(scales[i / MOE_QUANT_MX_BLOCK]));
    return MOE_OK;
}

/* ------------------------------------------------------------------ NVFP4 */

/* the 16 values of group g of x (row-major, cols a multiple of 16: groups are consecutive),
 * transformed when the options say so */
static void load_group(float *v, const float *x, size_t g, const moe_nvfp4_opts *o,
                       uint32_t signs) {
    memcpy(v, x + g * 16, 16 * sizeof(float));
    if (o->rht)
        moe_q_rht16(v, signs, 0);
}

moe_status moe_cpu_quant_nvfp4(uint8_t *q, uint8_t *scales, moe_quant_scalars *g, const float *x,
                               int rows, int cols, const moe_nvfp4_opts *opts, moe_error *err) {
    const moe_nvfp4_opts none = {0};
    const moe_nvfp4_opts *o = opts ? opts : &none;
    const moe_quant_recipe rc = o->block_2d ? MOE_QUANT_NVFP4_2D : MOE_QUANT_NVFP4;
    MOE_TRY(moe_quant_check(rc, rows, cols, err));
    const int B = MOE_QUANT_NVFP4_BLOCK, gpr = cols / B; /* groups per row */
    const size_t ngroups = (size_t)rows * gpr;
    const uint32_t signs = o->rht ? moe_q_rht_signs(o->rht_seed) : 0;
    /* pass 1: the tensor's amax, after the transform */
    uint32_t m = 0;
#pragma omp parallel for reduction(max : m) schedule(static) if ((size_t)rows * cols > 65536)
    for (long long gi = 0; gi < (long long)ngroups; gi++) {
        float v[16];
        load_group(v, x, (size_t)gi, o, signs);
        for (int j = 0; j < 16; j++) {
            const uint32_t k = moe_q_abs_key(v[j]);
            m = k > m ? k : m;
        }
    }
    moe_quant_scalars_from_amax(g, moe_q_key_amax(m), MOE_NVFP4_GLOBAL_NUM);
    const float G = g->scale;
    /* the draw counter (quantize.h): advanced once, between the passes, as the CUDA twin's
     * scalars kernel does */
    moe_nvfp4_opts oc = *o;
    if (o->stochastic && o->sr_counter)
        oc.sr_seed = moe_q_sr_seed(o->sr_seed, ++*o->sr_counter);
    o = &oc;
    /* pass 2: per block of bh rows × 16 columns, its scale, then its elements */
    const int bh = o->block_2d ? B : 1, nbr = (rows + bh - 1) / bh;
#pragma omp parallel for schedule(static) if ((size_t)rows * cols > 65536)
    for (long long b = 0; b < (long long)nbr * gpr; b++) {
        const int br = (int)(b / gpr), bc = (int)(b % gpr);
        const int r0 = br * bh, r1 = r0 + bh < rows ? r0 + bh : rows;
        float v[16][16]; /* the block's rows, transformed */
        uint32_t bm = 0;
        for (int r = r0; r < r1; r++) {
            load_group(v[r - r0], x, (size_t)r * gpr + bc, o, signs);
            for (int j = 0; j < 16; j++) {
                const uint32_t k = moe_q_abs_key(v[r - r0][j]);
                bm = k > bm ? k : bm;
            }
        }
        const uint8_t code = moe_nvfp4_scale_code(moe_q_key_amax(bm), G);
        const float d = moe_nvfp4_divisor(code, G);
        for (int r = r0; r < r1; r++) {
            uint8_t *qr = q + (size_t)r * (cols / 2) + bc * 8;
            const uint64_t i0 = (uint64_t)r * cols + (uint64_t)bc * 16;
            for (int j = 0; j < 16; j += 2)
                qr[j / 2] = (uint8_t)(
                    moe_nvfp4_cast(v[r - r0][j], d, o->stochastic, o->sr_seed, i0 + j) |
                    moe_nvfp4_cast(v[r - r0][j + 1], d, o->stochastic, o->sr_seed, i0 + j + 1) << 4);
        }
        scales[b] = code;
    }
    return MOE_OK;
}

moe_status moe_cpu_dequant_nvfp4(float *y, const uint8_t *q, const uint8_t *scales,
                                 const moe_quant_scalars *g, int rows, int cols,
                                 const moe_nvfp4_opts *opts, moe_error *err) {
    const moe_nvfp4_opts none = {0};
    const moe_nvfp4_opts *o = opts ? opts : &none;
    const moe_quant_recipe rc = o->block_2d ? MOE_QUANT_NVFP4_2D : MOE_QUANT_NVFP4;
    MOE_TRY(moe_quant_check(rc, rows, cols, err));
    const int B = MOE_QUANT_NVFP4_BLOCK, gpr = cols / B, bh = o->block_2d ? B : 1;
    const uint32_t signs = o->rht ? moe_q_rht_signs(o->rht_seed) : 0;
    const float G = g->scale;
#pragma omp parallel for schedule(static) if ((size_t)rows * cols > 65536)
    for (int r = 0; r < rows; r++)
        for (int gc = 0; gc < gpr; gc++) {
            const float ds = moe_q_div(moe_e4m3_decode(scales[(size_t)(r / bh) * gpr + gc]), G);
            float v[16];
            for (int j = 0; j < 16; j++) {
                const uint8_t byte = q[(size_t)r * (cols / 2) + gc * 8 + j / 2];
                v[j] = moe_q_dequant(moe_e2m1_decode(j & 1 ? byte >> 4 : byte & 0xF), ds);
            }
            if (o->rht)
                moe_q_rht16(v, signs, 1);
            memcpy(y + (size_t)r * cols + (size_t)gc * 16, v, sizeof v);
        }
    return MOE_OK;
}

moe_status moe_cpu_rht16(float *y, const float *x, int rows, int cols, uint64_t seed,
                         int inverse, moe_error *err) {
    MOE_TRY(moe_quant_check(MOE_QUANT_NVFP4, rows, cols, err));
    const uint32_t signs = moe_q_rht_signs(seed);
    const size_t ngroups = (size_t)rows * (cols / 16);
#pragma omp parallel for schedule(static) if ((size_t)rows * cols > 65536)
    for (long long gi = 0; gi < (long long)ngroups; gi++) {
        float v[16];
        memcpy(v, x + (size_t)gi * 16, sizeof v);
        moe_q_rht16(v, signs, inverse);
        memcpy(y + (size_t)gi * 16, v, sizeof v);
    }
    return MOE_OK;
}

/* ------------------------------------------------------------------ QDQ */

const moe_quant_fns *moe_cpu_quant_fns(void) {
    static const moe_quant_fns fns = {
        moe_cpu_quant_tensorwise, moe_cpu_dequant_tensorwise, moe_cpu_quant_blockwise,
        moe_cpu_dequant_blockwise, moe_cpu_quant_mxfp8,       moe_cpu_dequant_mxfp8,
        moe_cpu_quant_nvfp4,      moe_cpu_dequant_nvfp4,     moe_cpu_quant_delayed_site};
    return &fns;
}

void moe_qdq_ws_bytes(size_t n, size_t *q, size_t *scales) {
    *q = n > 0 ? n : 1; /* FP8: one byte per element (NVFP4: half) */
    /* the most scale bytes per element: NVFP4's one byte per 16 (fp32 per 128 and a byte
     * per 32 are fewer); a partial last block of rows (2D blocks) adds at most a row of
     * blocks, which a tensor of n elements has fewer of than n/16 + 16 */
    *scales = n / MOE_QUANT_NVFP4_BLOCK + 64;
}

moe_status moe_qdq_f32(const moe_quant_fns *fn, const moe_qdq_spec *spec, const moe_qdq_ws *ws,
                       int rows, int cols, moe_error *err) {
    MOE_TRY(moe_quant_check(spec->recipe, rows, cols, err));
    const size_t n = (size_t)rows * cols;
    const moe_fp8_format f = spec->format;
    switch (spec->recipe) {
    case MOE_QUANT_TENSORWISE:
        if (spec->delayed.site)
            MOE_TRY(fn->delayed(ws->q, ws->g, &spec->delayed, ws->x, n, f, err));
        else
            MOE_TRY(fn->tensorwise(ws->q, ws->g, ws->x, n, f, err));
        return fn->dequant_tensorwise(ws->x, ws->q, ws->g, n, f, err);
    case MOE_QUANT_BLOCK_1X128:
    case MOE_QUANT_BLOCK_128X128: {
        const int b2 = spec->recipe == MOE_QUANT_BLOCK_128X128;
        MOE_TRY(fn->blockwise(ws->q, (float *)ws->scales, ws->x, rows, cols, f, b2, spec->pow2,
                              err));
        return fn->dequant_blockwise(ws->x, ws->q, (const float *)ws->scales, rows, cols, f, b2,
                                     err);
    }
    case MOE_QUANT_MXFP8:
        MOE_TRY(fn->mxfp8(ws->q, (uint8_t *)ws->scales, ws->x, rows, cols, f, err));
        return fn->dequant_mxfp8(ws->x, ws->q, (const uint8_t *)ws->scales, rows, cols, f, err);
    case MOE_QUANT_NVFP4:
    case MOE_QUANT_NVFP4_2D: {
        moe_nvfp4_opts o = spec->nvfp4;
        o.block_2d = spec->recipe == MOE_QUANT_NVFP4_2D;
        MOE_TRY(fn->nvfp4(ws->q, (uint8_t *)ws->scales, ws->g, ws->x, rows, cols, &o, err));
        if (spec->keep_transform) /* the wgrad operands: no inverse transform (quantize.h) */
            o.rht = 0;
        return fn->dequant_nvfp4(ws->x, ws->q, (const uint8_t *)ws->scales, ws->g, rows, cols,
                                 &o, err);
    }
    }
    return moe_error_set(err, MOE_ERR_CONFIG, "QDQ: unknown recipe %d", (int)spec->recipe);
}

void moe_cpu_qdq(void *dst, const void *src, int rows, int cols, const moe_qdq_spec *spec,
                 const moe_qdq_ws *ws) {
    const size_t n = (size_t)rows * cols;
    const moe_real *s = (const moe_real *)src;
    moe_real *d = (moe_real *)dst;
    for (size_t i = 0; i < n; i++)
        ws->x[i] = (float)s[i];
    moe_error err;
    const moe_status st = moe_qdq_f32(moe_cpu_quant_fns(), spec, ws, rows, cols, &err);
    if (st != MOE_OK)
        fprintf(stderr, "moe_cpu_qdq: %s\n", err.msg);
    MOE_ASSERT(st == MOE_OK); /* the model checked every shape at start-up */
    for (size_t i = 0; i < n; i++)
        d[i] = (moe_real)ws->x[i];
}

/* The activation type is moe_real on the CPU: through fp32 as moe_cpu_qdq() goes, so the
 * codes, the scales and the dequantized values are the QDQ's to the bit. */
moe_status moe_cpu_quant_blockwise_act(uint8_t *q, float *s, void *y, const void *x, int rows,
                                       int cols, moe_fp8_format f, int pow2, moe_error *err) {
    MOE_TRY(moe_quant_check(MOE_QUANT_BLOCK_1X128, rows, cols, err));
    const size_t n = (size_t)rows * cols;
    float *v = malloc(sizeof(float) * (n ? n : 1));
    MOE_ASSERT(v);
    for (size_t i = 0; i < n; i++)
        v[i] = (float)((const moe_real *)x)[i];
    moe_status st = moe_cpu_quant_blockwise(q, s, v, rows, cols, f, 0, pow2, err);
    if (st == MOE_OK && y)
        st = moe_cpu_dequant_blockwise_act(y, q, s, rows, cols, f, err);
    free(v);
    return st;
}

moe_status moe_cpu_dequant_blockwise_act(void *y, const uint8_t *q, const float *s, int rows,
                                         int cols, moe_fp8_format f, moe_error *err) {
    MOE_TRY(moe_quant_check(MOE_QUANT_BLOCK_1X128, rows, cols, err));
    const size_t n = (size_t)rows * cols;
    float *v = malloc(sizeof(float) * (n ? n : 1));
    MOE_ASSERT(v);
    const moe_status st = moe_cpu_dequant_blockwise(v, q, s, rows, cols, f, 0, err);
    for (size_t i = 0; st == MOE_OK && i < n; i++)
        ((moe_real *)y)[i] = (moe_real)v[i];
    free(v);
    return st;
}

void moe_cpu_qdq_t(void *dst, const void *src, int n, int m, int cols, const moe_qdq_spec *spec,
                   const moe_qdq_ws *ws) {
    MOE_ASSERT(n >= 0 && n <= m && dst != src);
    if ((size_t)m * cols == 0)
        return;
    const moe_real *s = (const moe_real *)src;
    moe_real *d = (moe_real *)dst;
#pragma omp parallel for schedule(static) if ((size_t)m * cols > 65536)
    for (int c = 0; c < cols; c++)
        for (int r = 0; r < m; r++) /* the tokens padded with zeros */
            ws->x[(size_t)c * m + r] = r < n ? (float)s[(size_t)r * cols + c] : 0.0f;
    moe_error err;
    const moe_status st = moe_qdq_f32(moe_cpu_quant_fns(), spec, ws, cols, m, &err);
    if (st != MOE_OK)
        fprintf(stderr, "moe_cpu_qdq_t: %s\n", err.msg);
    MOE_ASSERT(st == MOE_OK); /* the model checked every shape at start-up */
#pragma omp parallel for schedule(static) if ((size_t)m * cols > 65536)
    for (int r = 0; r < m; r++)
        for (int c = 0; c < cols; c++)
            d[(size_t)r * cols + c] = (moe_real)ws->x[(size_t)c * m + r];
}
