/**
 * @file quantize.h
 * @brief Chapter 05's quantization recipes (Megatron Core / TransformerEngine): tensorwise
 *        current and delayed scaling, blockwise 1×128 and 128×128 FP8, MXFP8 and NVFP4, each
 *        a quantize and a dequantize, on the CPU (lib/cpu/quantize.c, the reference) and
 *        on CUDA (kernels/quantize.cu, launchers in kernels/cuda_ops.h, the same bytes).
 *
 * A recipe turns an fp32 tensor x into **codes** (one byte per FP8 element, one nibble per
 * FP4 element) and **scales**, such that dequantize(codes, scales) ≈ x. The formats and
 * every per-element and per-block rule live in quant_formats.h, shared by both backends.
 *
 * | recipe | element | scale | one scale per | scale rule |
 * |---|---|---|---|---|
 * | tensorwise (current) | E4M3 / E5M2 | fp32 | tensor | fmax / amax(x) |
 * | tensorwise (delayed) | E4M3 / E5M2 | fp32 | tensor | fmax / max(amax history), from the previous steps |
 * | blockwise 1×128 | E4M3 / E5M2 | fp32 (optionally a power of two) | 128 consecutive elements of a row (activations, gradients) | fmax / amax(tile) |
 * | blockwise 128×128 | E4M3 / E5M2 | fp32 (optionally a power of two) | 128×128 block (weights) | fmax / amax(block) |
 * | MXFP8 | E4M3 / E5M2 | E8M0 | 32 consecutive elements of a row | 2^(floor(log2 amax) − emax_elem) |
 * | NVFP4 | E2M1 | E4M3, and one fp32 per tensor | 16 consecutive elements of a row, or 16×16 (weights) | (amax/6)·(2688/tensor amax) |
 *
 * **Layouts.** x is row-major [rows, cols]. FP8 codes are bytes [rows, cols]. NVFP4 codes
 * are packed two per byte, [rows, cols/2]: element 2j in the low nibble of byte j, element
 * 2j+1 in the high nibble. Scales are row-major over the blocks: [rows, cols/B] for 1×B
 * blocks, [ceil(rows/B), cols/B] for B×B blocks. (cuBLAS's swizzled scale layouts for MXFP8
 * and NVFP4 GEMMs are not made here: that belongs to the GEMMs.)
 *
 * **Shapes.** rows ≥ 0 is any number: a last block of rows that is not full (128×128,
 * 16×16) takes the rows there are. cols must be a multiple of the block width along the row
 * (128 blockwise, 32 MXFP8, 16 NVFP4), otherwise the recipe returns ::MOE_ERR_CONFIG with a
 * message naming the multiple: a partial last tile in a row would work arithmetically, but
 * the FP8/FP4 GEMMs these tensors are for need the alignment anyway. Tensorwise recipes take
 * any element count.
 *
 * **Non-finite inputs.** The amax of a block (or tensor) that holds a NaN is NaN, of one that
 * holds ±inf is inf; such a block gets a NaN scale (fp32 ::MOE_Q_NAN_BITS, E8M0 0xFF, E4M3
 * 0x7F) and all its codes 0, so it dequantizes to NaN everywhere: the bad value shows up
 * downstream instead of hiding as a saturated ±max. For NVFP4 the tensor amax holds it, so
 * the whole tensor is poisoned. Delayed scaling quantizes with a scale fixed beforehand: its
 * elements are cast (NaN → the NaN code, ±inf → ±max), the non-finite amax is recorded in
 * the history, and while it is in the window the scale is not updated.
 *
 * **Zero blocks.** A block of zeros gets scale 1 (fp32 1.0, E8M0 2⁰, E4M3 1.0) and codes 0
 * (±0: a −0.0 keeps its sign, code 0x80 in FP8, 0x8 in E2M1): no division by zero anywhere.
 *
 * **Randomness.** NVFP4's stochastic rounding and the random Hadamard transform draw from the
 * counter-based RNG (rng.h): element i's bits are a function of (seed, i), so the result is
 * reproducible from the seed and identical on the CPU and the GPU.
 */
#ifndef MOE_QUANTIZE_H
#define MOE_QUANTIZE_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "quant_formats.h"

/** Width of a blockwise FP8 tile (1×128) and side of a weight block (128×128). */
#define MOE_QUANT_BLOCK 128
/** Elements per MXFP8 block. */
#define MOE_QUANT_MX_BLOCK 32
/** Elements per NVFP4 block (1×16), and side of a 2D weight block (16×16). */
#define MOE_QUANT_NVFP4_BLOCK 16

/** The per-tensor numbers of a tensorwise recipe, and NVFP4's global scale: three floats,
 *  the same layout on the host and the device, written by the quantize ops. */
typedef struct moe_quant_scalars {
    float amax;      /**< the largest |x| of the tensor just quantized (NaN if it held one) */
    float scale;     /**< current scaling and NVFP4: the scale used (x·scale was cast);
                          delayed scaling: the scale for the NEXT step */
    float scale_inv; /**< what a GEMM multiplies the codes by: 1/scale of the codes just made */
} moe_quant_scalars;

/** Which recipe, for moe_quant_check() and the sizes of its outputs. */
typedef enum moe_quant_recipe {
    MOE_QUANT_TENSORWISE = 0,   /**< one fp32 scale per tensor (current or delayed scaling) */
    MOE_QUANT_BLOCK_1X128 = 1,  /**< fp32 scale per 1×128 tile */
    MOE_QUANT_BLOCK_128X128 = 2, /**< fp32 scale per 128×128 block */
    MOE_QUANT_MXFP8 = 3,        /**< E8M0 scale per 1×32 block */
    MOE_QUANT_NVFP4 = 4,        /**< E4M3 scale per 1×16 block, fp32 per tensor */
    MOE_QUANT_NVFP4_2D = 5      /**< E4M3 scale per 16×16 block, fp32 per tensor */
} moe_quant_recipe;

/** NVFP4's options. Zero-initialised: 1D blocks, round to nearest even, no transform. */
typedef struct moe_nvfp4_opts {
    int block_2d;        /**< 1: one scale per 16×16 block (weights), 0: per 1×16 */
    int stochastic;      /**< 1: stochastic rounding of the elements (gradients) */
    uint64_t sr_seed;    /**< the stochastic rounding's seed (with a draw counter: the base) */
    uint64_t *sr_counter; /**< NULL: sr_seed is the seed. Otherwise a draw counter in
                              backend memory: a stochastic quantize first adds 1 to it (one
                              thread, once per tensor) and rounds with moe_q_sr_seed(sr_seed,
                              counter), read on the device when it runs, so a captured CUDA
                              graph draws a new seed at every replay */
    int rht;             /**< 1: random Hadamard transform of every 16-element row group
                              before quantizing (the amaxes are taken after it);
                              dequantize then applies the inverse */
    uint64_t rht_seed;   /**< the seed of the transform's 16 signs */
} moe_nvfp4_opts;

/** @brief The end of a current-scaling quantize (tensorwise, NVFP4's global scale): the
 *  tensor's amax, its scale num/amax (moe_q_scale_from_amax()) and 1/scale. Both backends
 *  call it (the CUDA one in a one-thread kernel, after the amax reduction).
 *  @param s receives the three numbers  @param amax the tensor's amax (canonical NaN if any)
 *  @param num the numerator: the format's max, or 448·6 for NVFP4 */
static inline MOE_HOSTDEV void moe_quant_scalars_from_amax(moe_quant_scalars *s, float amax,
                                                           float num) {
    s->amax = amax;
    s->scale = moe_q_scale_from_amax(amax, num, 0);
    s->scale_inv = moe_q_scale_inv(s->scale);
}

/**
 * @brief The end of a delayed-scaling step, after its codes were cast with s->scale: the
 *        codes' scale_inv, this step's amax into the history, and the next scale from the
 *        window's maximum m (kept when m is 0, NaN or infinite). Both backends call it.
 * @param s the scalars (scale in; amax, scale_inv and the next scale out)
 * @param history [len] the window  @param len its length  @param pos this step's slot
 * @param amax this step's amax  @param fmax the format's largest value
 */
static inline MOE_HOSTDEV void moe_quant_delayed_finish(moe_quant_scalars *s, float *history,
                                                        int len, int pos, float amax,
                                                        float fmax) {
    s->scale_inv = moe_q_scale_inv(s->scale);
    s->amax = history[pos] = amax;
    uint32_t m = 0;
    for (int i = 0; i < len; i++) {
        const uint32_t k = moe_q_abs_key(history[i]);
        m = k > m ? k : m;
    }
    const float hmax = moe_q_key_amax(m);
    if (!moe_q_nonfinite(hmax) && hmax > 0.0f)
        s->scale = moe_q_scale_from_amax(hmax, fmax, 0);
}

/** How delayed scaling chooses the next scale from the amax history (Megatron's
 *  `--fp8-amax-compute-algo`). */
typedef enum moe_amax_algo {
    MOE_AMAX_MAX = 0,         /**< the largest amax of the window */
    MOE_AMAX_MOST_RECENT = 1  /**< the amax just recorded */
} moe_amax_algo;

/** The state of one tensor under delayed scaling (one call site of training, lib/lowp.h),
 *  in backend memory: only the quantize ops read and write it, so a step never waits for
 *  the host and a captured CUDA graph replays it as it is. */
typedef struct moe_delayed_site {
    float scale;    /**< the scale this rank's window gave after the last recording (the
                         next cast's on one rank; the fallback of a poisoned window) */
    float used;     /**< the scale the last recording quantize cast with (a replay's too) */
    float used_inv; /**< 1/used: the dequantization scale of those codes */
    float amax;     /**< the amax last recorded */
    int32_t pos;    /**< the history slot the next amax goes into */
    int32_t steps;  /**< amaxes recorded so far (0: nothing yet, current scaling) */
} moe_delayed_site;

/** One delayed-scaling quantize of a site (::moe_qdq_spec's @c delayed; site NULL: none). */
typedef struct moe_delayed_ref {
    moe_delayed_site *site; /**< [1] the tensor's state (backend memory) */
    float *history;         /**< [len] its amax window (backend memory) */
    int len;                /**< the window's length, ≥ 1 (`--fp8-amax-history-len`) */
    moe_amax_algo algo;     /**< how the next scale is chosen */
    int margin;             /**< `--fp8-margin` ≥ 0: every scale is divided by 2^margin */
    int record;             /**< 1: a new tensor (record its amax); 0: a replay of the last
                                 recorded one (the same scale, nothing recorded) */
} moe_delayed_ref;

/**
 * @brief The scale a delayed site's window gives: fmax/2^margin over the window's largest
 *        amax (::MOE_AMAX_MAX) or over the amax in slot @p last (::MOE_AMAX_MOST_RECENT),
 *        or @p keep while that amax is not finite and positive (TransformerEngine's rule:
 *        an empty or poisoned window does not move the scale).
 * @param history [len] the window  @param len its length  @param last the slot written last
 * @param algo the compute algorithm  @param num fmax / 2^margin  @param keep the fallback
 * @return the scale
 */
static inline MOE_HOSTDEV float moe_delayed_window_scale(const float *history, int len, int last,
                                                         moe_amax_algo algo, float num,
                                                         float keep) {
    float a = history[last];
    if (algo == MOE_AMAX_MAX) {
        uint32_t m = 0;
        for (int i = 0; i < len; i++) {
            const uint32_t k = moe_q_abs_key(history[i]);
            m = k > m ? k : m;
        }
        a = moe_q_key_amax(m);
    }
    return !moe_q_nonfinite(a) && a > 0.0f ? moe_q_scale_from_amax(a, num, 0) : keep;
}

/**
 * @brief Record one tensor's amax at a delayed-scaling site and choose the scales, before
 *        its codes are cast: the scale this tensor casts with is the one the window gives
 *        AS IT IS NOW (moe_delayed_window_scale(), falling back on site->scale), except for
 *        the site's first tensor, which has no history and takes current scaling (num/amax
 *        of itself); then its amax goes into the window and site->scale becomes the scale
 *        the window now gives (the next tensor's, on one rank). Both backends call it (CUDA
 *        in one thread).
 *
 * Why the cast reads the window and not site->scale: on several ranks the trainer reduces
 * the windows (a max over the replicas, moe_lowp_reduce_amax()) between two recordings,
 * after site->scale was chosen from this rank's amax alone; reading the window at the cast
 * makes the reduced amaxes the ones that count, with no pass over the sites after the
 * reduction. On one rank nothing moves the window between two recordings, so the scale is
 * site->scale, bit for bit.
 * @param d the site  @param history [len] its window  @param len its length
 * @param algo the compute algorithm  @param num the numerator: fmax / 2^margin
 * @param amax this tensor's amax (canonical NaN if it held one)
 */
static inline MOE_HOSTDEV void moe_delayed_record(moe_delayed_site *d, float *history, int len,
                                                  moe_amax_algo algo, float num, float amax) {
    const int last = d->pos > 0 ? d->pos - 1 : len - 1;
    const float used = d->steps > 0
                           ? moe_delayed_window_scale(history, len, last, algo, num, d->scale)
                           : moe_q_scale_from_amax(amax, num, 0);
    history[d->pos] = amax;
    /* a poisoned first tensor keeps the initial scale */
    const float next = moe_delayed_window_scale(history, len, d->pos, algo, num,
                                                moe_q_nonfinite(used) ? d->scale : used);
    d->used = used;
    d->used_inv = moe_q_scale_inv(used);
    d->amax = amax;
    if (!moe_q_nonfinite(next))
        d->scale = next;
    d->pos = d->pos + 1 < len ? d->pos + 1 : 0;
    d->steps = d->steps < INT32_MAX ? d->steps + 1 : d->steps;
}

/** The largest `--fp8-margin` (the scale's numerator fmax/2^margin stays a normal float). */
#define MOE_QUANT_MAX_MARGIN 64

/** @brief A delayed site's numerator: the format's max over 2^margin (exact: a power of two).
 *  @param f the format @param margin 0 to ::MOE_QUANT_MAX_MARGIN @return fmax·2^−margin */
static inline MOE_HOSTDEV float moe_quant_delayed_num(moe_fp8_format f, int margin) {
    return moe_q_mul(moe_fp8_max(f), moe_q_pow2f(-margin));
}

/** @brief The scalars a site's last recorded tensor was cast with (what its dequantize and a
 *  replay use). @param s receives amax, scale and scale_inv @param d the site */
static inline MOE_HOSTDEV void moe_delayed_scalars(moe_quant_scalars *s,
                                                   const moe_delayed_site *d) {
    s->amax = d->amax;
    s->scale = d->used;
    s->scale_inv = d->used_inv;
}

#ifdef __cplusplus
extern "C" { /* kernels/quantize.cu calls the checks */
#endif

/** @brief Check an FP8 format value. @param f the format @param err receives the message
 *  @return ::MOE_OK, or ::MOE_ERR_CONFIG for a value that is neither E4M3 nor E5M2 */
moe_status moe_quant_check_format(moe_fp8_format f, moe_error *err);

/**
 * @brief Check a recipe's shape: rows ≥ 0, cols ≥ 0 and a multiple of the recipe's block
 *        width along the row (tensorwise: any).
 * @param r the recipe  @param rows rows of x  @param cols columns of x
 * @param err receives the message naming the multiple
 * @return ::MOE_OK or ::MOE_ERR_CONFIG
 */
moe_status moe_quant_check(moe_quant_recipe r, int rows, int cols, moe_error *err);

/** @brief Check the rows of a blockwise quantize with a transposed copy
 *  (moe_cpu_quant_blockwise_t()): a multiple of 128, since they become the copy's columns.
 *  @param rows rows of x @param err receives the message @return ::MOE_OK or ::MOE_ERR_CONFIG */
moe_status moe_quant_check_transpose(int rows, moe_error *err);

/** @brief Check delayed scaling's window: len ≥ 1 and 0 ≤ pos < len.
 *  @param len the history's length @param pos this step's slot @param err receives the message
 *  @return ::MOE_OK or ::MOE_ERR_CONFIG */
moe_status moe_quant_check_window(int len, int pos, moe_error *err);

/** @brief Number of scales a recipe writes for a [rows, cols] tensor (blockwise, MXFP8,
 *  NVFP4: one per block; tensorwise: 1). @param r the recipe @param rows rows (≥ 0)
 *  @param cols columns, checked by moe_quant_check() @return the count */
size_t moe_quant_scale_count(moe_quant_recipe r, int rows, int cols);

/** @brief Bytes of a recipe's codes for a [rows, cols] tensor (rows·cols; NVFP4 rows·cols/2).
 *  @param r the recipe @param rows rows @param cols columns @return the bytes */
size_t moe_quant_code_bytes(moe_quant_recipe r, int rows, int cols);

/* -------------------------------------------------------- tensorwise scaling */

/**
 * @brief Tensorwise current scaling: amax = max|x|, scale = fmax/amax
 *        (moe_q_scale_from_amax()), codes = cast(x·scale).
 * @param q [n] codes  @param s receives amax, scale and scale_inv
 * @param x [n] input  @param n elements  @param f element format
 * @param err receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_CONFIG for an unknown format
 */
moe_status moe_cpu_quant_tensorwise(uint8_t *q, moe_quant_scalars *s, const float *x, size_t n,
                                    moe_fp8_format f, moe_error *err);

/**
 * @brief Tensorwise delayed scaling, one step: quantize x with the scale chosen from the
 *        previous steps, then record this step's amax and choose the next scale.
 *
 * In order: codes = cast(x·s->scale); s->scale_inv = 1/s->scale (the codes' dequantization
 * scale); s->amax = history[pos] = max|x|; then, with m the maximum of the whole history
 * (the window of the last @p len amaxes), s->scale = fmax/m when m is finite and > 0, else
 * s->scale is kept (TransformerEngine's rule: an empty or poisoned window does not move the
 * scale). The caller starts with a zeroed history and s->scale = 1 and advances @p pos
 * (pos + 1 mod len) after each step.
 * @param q [n] codes  @param s scale in; amax, scale_inv and the next scale out
 * @param history [len] the amax window, updated  @param len its length (≥ 1)
 * @param pos the slot of this step (0 ≤ pos < len)  @param x [n] input  @param n elements
 * @param f element format  @param err receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_CONFIG for a bad len, pos or format
 */
moe_status moe_cpu_quant_delayed(uint8_t *q, moe_quant_scalars *s, float *history, int len,
                                 int pos, const float *x, size_t n, moe_fp8_format f,
                                 moe_error *err);

/**
 * @brief Delayed scaling at a site of training (lib/lowp.h), its state in memory: when
 *        d->record, the tensor's amax is recorded and the scales chosen
 *        (moe_delayed_record(): the history's scale, current scaling for the site's first
 *        tensor); then, recorded or replayed, codes = cast(x·d->site->used) (a NaN scale
 *        writes 0, as current scaling) and @p s = moe_delayed_scalars().
 * @param q [n] codes  @param s receives the scalars the codes were cast with
 * @param d the site, its window and options  @param x [n] input  @param n elements
 * @param f element format  @param err receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_CONFIG for a bad window, margin or format
 */
moe_status moe_cpu_quant_delayed_site(uint8_t *q, moe_quant_scalars *s, const moe_delayed_ref *d,
                                      const float *x, size_t n, moe_fp8_format f,
                                      moe_error *err);

/** @brief Check a delayed site's options: a window of at least 1, a margin of 0 to 64.
 *  @param d the reference @param err receives the message @return ::MOE_OK or ::MOE_ERR_CONFIG */
moe_status moe_quant_check_delayed(const moe_delayed_ref *d, moe_error *err);

/**
 * @brief Dequantize a tensorwise recipe: y = decode(q)·s->scale_inv.
 * @param y [n] output  @param q [n] codes  @param s the scalars the quantize wrote
 * @param n elements  @param f element format  @param err receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_CONFIG for an unknown format
 */
moe_status moe_cpu_dequant_tensorwise(float *y, const uint8_t *q, const moe_quant_scalars *s,
                                      size_t n, moe_fp8_format f, moe_error *err);

/* -------------------------------------------------------- blockwise FP8 */

/**
 * @brief Blockwise FP8: one fp32 scale per 1×128 tile of a row (@p block_2d = 0:
 *        activations and gradients) or per 128×128 block (@p block_2d = 1: weights).
 *        scale = fmax/amax(block) (rounded down to a power of two when @p pow2), codes =
 *        cast(x·scale), and the block's dequantization scale 1/scale is stored.
 * @param q [rows, cols] codes  @param scale_inv [moe_quant_scale_count()] 1/scale per block
 * @param x [rows, cols] input  @param rows rows  @param cols columns (a multiple of 128)
 * @param f element format  @param block_2d 0: 1×128 tiles, 1: 128×128 blocks
 * @param pow2 1: power-of-two scales  @param err receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_CONFIG for a bad shape or format
 */
moe_status moe_cpu_quant_blockwise(uint8_t *q, float *scale_inv, const float *x, int rows,
                                   int cols, moe_fp8_format f, int block_2d, int pow2,
                                   moe_error *err);

/**
 * @brief Dequantize blockwise FP8: y = decode(q)·scale_inv[block].
 * @param y [rows, cols] output  @param q [rows, cols] codes  @param scale_inv per block
 * @param rows rows  @param cols columns  @param f element format
 * @param block_2d as quantized  @param err receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_CONFIG for a bad shape or format
 */
moe_status moe_cpu_dequant_blockwise(float *y, const uint8_t *q, const float *scale_inv,
                                     int rows, int cols, moe_fp8_format f, int block_2d,
                                     moe_error *err);

/**
 * @brief Blockwise FP8 of x and of xᵀ from one read of x: the two copies a training step's
 *        GEMMs need, since Hopper's FP8 tensor cores read both operands K-major
 *        (lib/fp8_gemm.h): x's row-major codes for the forward, xᵀ's for the backward.
 *
 * The outputs are, by definition, moe_cpu_quant_blockwise() of x (@p q, @p scale_inv) and of
 * its transpose xᵀ [cols, rows] (@p qt, @p scale_inv_t), with the same format, tiling and
 * pow2. With 1×128 tiles (activations, gradients) xᵀ's tiles are 128×1 columns of x, so its
 * codes are their own (other scales); with 128×128 blocks (weights) the blocks are the same,
 * and qt, scale_inv_t are q and scale_inv transposed.
 * @param q [rows, cols] codes of x  @param scale_inv x's scales, moe_quant_scale_count()
 * @param qt [cols, rows] codes of xᵀ  @param scale_inv_t xᵀ's scales
 * @param x [rows, cols] input  @param rows rows (a multiple of 128: xᵀ's columns)
 * @param cols columns (a multiple of 128)  @param f element format
 * @param block_2d 0: 1×128 tiles, 1: 128×128 blocks  @param pow2 1: power-of-two scales
 * @param err receives the reason on failure
 * @return ::MOE_OK, ::MOE_ERR_CONFIG for a bad shape or format, ::MOE_ERR_NOMEM
 */
moe_status moe_cpu_quant_blockwise_t(uint8_t *q, float *scale_inv, uint8_t *qt,
                                     float *scale_inv_t, const float *x, int rows, int cols,
                                     moe_fp8_format f, int block_2d, int pow2, moe_error *err);

/* -------------------------------------------------------- MXFP8 */

/**
 * @brief MXFP8 (OCP MX): one E8M0 scale X = 2^(floor(log2 amax) − emax_elem) per 32
 *        consecutive elements of a row (moe_mx_scale_code()), elements cast(x/X)
 *        (saturating: for E4M3 the block's largest element can exceed 448 by up to 12.5%).
 * @param q [rows, cols] codes  @param scales [rows, cols/32] E8M0 codes
 * @param x [rows, cols] input  @param rows rows  @param cols columns (a multiple of 32)
 * @param f element format (E4M3 in Megatron's MXFP8 recipe)
 * @param err receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_CONFIG for a bad shape or format
 */
moe_status moe_cpu_quant_mxfp8(uint8_t *q, uint8_t *scales, const float *x, int rows, int cols,
                               moe_fp8_format f, moe_error *err);

/**
 * @brief Dequantize MXFP8: y = decode(q)·2^(scale−127) (NaN for a 0xFF scale).
 * @param y [rows, cols] output  @param q codes  @param scales E8M0 codes
 * @param rows rows  @param cols columns  @param f element format
 * @param err receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_CONFIG for a bad shape or format
 */
moe_status moe_cpu_dequant_mxfp8(float *y, const uint8_t *q, const uint8_t *scales, int rows,
                                 int cols, moe_fp8_format f, moe_error *err);

/* -------------------------------------------------------- NVFP4 */

/**
 * @brief NVFP4: optionally the random Hadamard transform of every 16-element row group;
 *        then global scale G = 2688/amax(tensor) (into g), one E4M3 block scale
 *        s_b = cast((amax_b/6)·G) per 1×16 block (or per 16×16 block), and the elements
 *        cast(x/(decode(s_b)/G)) to E2M1, to nearest even or stochastically.
 * @param q [rows, cols/2] packed E2M1 codes  @param scales [moe_quant_scale_count()] E4M3
 * @param g receives the tensor amax (after the transform), G and 1/G
 * @param x [rows, cols] input  @param rows rows  @param cols columns (a multiple of 16)
 * @param o options (NULL: 1D, nearest even, no transform)
 * @param err receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_CONFIG for a bad shape
 */
moe_status moe_cpu_quant_nvfp4(uint8_t *q, uint8_t *scales, moe_quant_scalars *g, const float *x,
                               int rows, int cols, const moe_nvfp4_opts *o, moe_error *err);

/**
 * @brief Dequantize NVFP4: y = decode(q)·(decode(s_b)/G), then the inverse Hadamard
 *        transform when the options had it, so that y ≈ x.
 * @param y [rows, cols] output  @param q packed codes  @param scales E4M3 block scales
 * @param g the global scale the quantize wrote  @param rows rows  @param cols columns
 * @param o the options of the quantize (NULL: none)  @param err receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_CONFIG for a bad shape
 */
moe_status moe_cpu_dequant_nvfp4(float *y, const uint8_t *q, const uint8_t *scales,
                                 const moe_quant_scalars *g, int rows, int cols,
                                 const moe_nvfp4_opts *o, moe_error *err);

/**
 * @brief The random Hadamard transform (moe_q_rht16()) of every 16-element row group of x,
 *        or its inverse. y may be x.
 * @param y [rows, cols] output  @param x [rows, cols] input  @param rows rows
 * @param cols columns (a multiple of 16)  @param seed the seed of the signs
 * @param inverse 0: forward, 1: inverse  @param err receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_CONFIG for a bad shape
 */
moe_status moe_cpu_rht16(float *y, const float *x, int rows, int cols, uint64_t seed,
                         int inverse, moe_error *err);

/* -------------------------------------------------------- QDQ (emulated low precision) */

/**
 * One quantize → dequantize ("QDQ", fake quantization): which recipe, element format and
 * options a tensor of a given role goes through (lib/lowp.h picks them from the flags).
 */
typedef struct moe_qdq_spec {
    moe_quant_recipe recipe; /**< ::MOE_QUANT_TENSORWISE (current scaling), ::MOE_QUANT_BLOCK_1X128,
                                  ::MOE_QUANT_BLOCK_128X128, ::MOE_QUANT_MXFP8,
                                  ::MOE_QUANT_NVFP4 or ::MOE_QUANT_NVFP4_2D */
    moe_fp8_format format;   /**< the FP8 element format (ignored by NVFP4) */
    int pow2;                /**< blockwise: power-of-two scales */
    moe_nvfp4_opts nvfp4;    /**< NVFP4's options (block_2d follows the recipe) */
    moe_delayed_ref delayed; /**< tensorwise with delayed.site set: delayed scaling at that
                                  site (moe_cpu_quant_delayed_site()) instead of current */
    int keep_transform;      /**< NVFP4 with nvfp4.rht: the dequantized values stay in the
                                  transformed basis (no inverse transform). The wgrad
                                  operands (moe_cpu_qdq_t()): both carry the same orthogonal
                                  transform along the reduction, which cancels in the
                                  product, as in a native NVFP4 GEMM on the codes */
} moe_qdq_spec;

/** The buffers of a QDQ, in the memory of the backend that runs it, each sized for the
 *  largest tensor it will see (moe_qdq_ws_bytes()). */
typedef struct moe_qdq_ws {
    float *x;               /**< [rows·cols] fp32: the input, then the dequantized values */
    uint8_t *q;             /**< codes, moe_quant_code_bytes() */
    void *scales;           /**< the block scales (fp32 or one byte each), 4·moe_quant_scale_count() bytes */
    moe_quant_scalars *g;   /**< [1] the tensorwise scalars / NVFP4's global scale */
} moe_qdq_ws;

/** A backend's quantizers and dequantizers, with the signatures of the CPU ones: the CPU's
 *  (moe_cpu_quant_fns()) or CUDA's, so that one QDQ sequence serves both. */
typedef struct moe_quant_fns {
    /** as moe_cpu_quant_tensorwise() */
    moe_status (*tensorwise)(uint8_t *, moe_quant_scalars *, const float *, size_t,
                             moe_fp8_format, moe_error *);
    /** as moe_cpu_dequant_tensorwise() */
    moe_status (*dequant_tensorwise)(float *, const uint8_t *, const moe_quant_scalars *, size_t,
                                     moe_fp8_format, moe_error *);
    /** as moe_cpu_quant_blockwise() */
    moe_status (*blockwise)(uint8_t *, float *, const float *, int, int, moe_fp8_format, int, int,
                            moe_error *);
    /** as moe_cpu_dequant_blockwise() */
    moe_status (*dequant_blockwise)(float *, const uint8_t *, const float *, int, int,
                                    moe_fp8_format, int, moe_error *);
    /** as moe_cpu_quant_mxfp8() */
    moe_status (*mxfp8)(uint8_t *, uint8_t *, const float *, int, int, moe_fp8_format,
                        moe_error *);
    /** as moe_cpu_dequant_mxfp8() */
    moe_status (*dequant_mxfp8)(float *, const uint8_t *, const uint8_t *, int, int,
                                moe_fp8_format, moe_error *);
    /** as moe_cpu_quant_nvfp4() */
    moe_status (*nvfp4)(uint8_t *, uint8_t *, moe_quant_scalars *, const float *, int, int,
                        const moe_nvfp4_opts *, moe_error *);
    /** as moe_cpu_dequant_nvfp4() */
    moe_status (*dequant_nvfp4)(float *, const uint8_t *, const uint8_t *,
                                const moe_quant_scalars *, int, int, const moe_nvfp4_opts *,
                                moe_error *);
    /** as moe_cpu_quant_delayed_site() */
    moe_status (*delayed)(uint8_t *, moe_quant_scalars *, const moe_delayed_ref *, const float *,
                          size_t, moe_fp8_format, moe_error *);
} moe_quant_fns;

/** @brief The CPU's quantizers, for moe_qdq_f32(). @return a static table */
const moe_quant_fns *moe_cpu_quant_fns(void);

/** @brief Bytes of each buffer of a ::moe_qdq_ws for tensors of up to @p n elements (the
 *  largest any recipe needs). @param n elements @param q receives the codes' bytes
 *  @param scales receives the scales' bytes */
void moe_qdq_ws_bytes(size_t n, size_t *q, size_t *scales);

/**
 * @brief QDQ of ws->x [rows, cols] in place, with @p fn's quantize and then dequantize of
 *        the recipe: x ← dequantize(quantize(x)), exactly what the two calls give.
 * @param fn the backend's quantizers  @param spec the recipe  @param ws the buffers (x in and out)
 * @param rows rows  @param cols columns (the recipe's shape rules: moe_quant_check())
 * @param err receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_CONFIG for a shape or format the recipe refuses
 */
moe_status moe_qdq_f32(const moe_quant_fns *fn, const moe_qdq_spec *spec, const moe_qdq_ws *ws,
                       int rows, int cols, moe_error *err);

/**
 * @brief The CPU backend's QDQ op: dst = QDQ(src), activations of the CPU (moe_real),
 *        through ws->x in fp32 (moe_real → float is exact in the fp32 build; the gradcheck
 *        build rounds to float first). dst may be src. A shape the recipe refuses aborts:
 *        the model checks every shape at start-up (lib/lowp.h).
 * @param dst [rows, cols] output  @param src [rows, cols] input  @param rows rows
 * @param cols columns  @param spec the recipe  @param ws the buffers (host memory)
 */
void moe_cpu_qdq(void *dst, const void *src, int rows, int cols, const moe_qdq_spec *spec,
                 const moe_qdq_ws *ws);

/**
 * @brief Blockwise 1×128 quantize of an activation-type [rows, cols] tensor on the CPU
 *        (the backend's fp8_quant_act; moe_cuda_quant_blockwise_act()'s twin): codes and
 *        scales as moe_cpu_quant_blockwise() of its fp32 values, and with @p y the
 *        dequantized values in the activation type, the bytes moe_cpu_qdq() writes.
 * @param q [rows, cols] codes  @param s [rows][cols/128] 1/scale per tile
 * @param y NULL, or [rows, cols] the dequantized values  @param x [rows, cols] input
 * @param rows rows  @param cols columns (a multiple of 128)  @param f element format
 * @param pow2 1: power-of-two scales  @param err receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_CONFIG for a bad shape or format
 */
moe_status moe_cpu_quant_blockwise_act(uint8_t *q, float *s, void *y, const void *x, int rows,
                                       int cols, moe_fp8_format f, int pow2, moe_error *err);

/**
 * @brief Dequantize 1×128 codes and scales into the activation type on the CPU (the
 *        backend's fp8_dequant_act: chapter 05's FP8 dispatch turns the received codes back
 *        into the rows the experts read): the same values as moe_cpu_quant_blockwise_act()'s
 *        @p y, hence as moe_cpu_qdq() of the tensor that was quantized.
 * @param y [rows, cols] output  @param q [rows, cols] codes  @param s [rows][cols/128] 1/scale
 * @param rows rows  @param cols columns (a multiple of 128)  @param f element format
 * @param err receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_CONFIG for a bad shape or format
 */
moe_status moe_cpu_dequant_blockwise_act(void *y, const uint8_t *q, const float *s, int rows,
                                         int cols, moe_fp8_format f, moe_error *err);

/**
 * @brief The CPU backend's QDQ along the tokens (chapter 05: a wgrad operand, NVFP4's random
 *        Hadamard transform): dst [m, cols] = (QDQ by @p spec of srcᵀ [cols, m])ᵀ, where
 *        srcᵀ's columns n..m−1 are zeros (the tokens padded to the recipe's block). So each
 *        block (and, with spec->nvfp4.rht, each transform) runs over 16 consecutive tokens
 *        of one column, the layout a native wgrad GEMM dW = dYᵀ·X reduces over; with
 *        spec->keep_transform the values stay transformed (lib/lowp.h, "wgrad").
 * @param dst [m, cols] output (moe_real; not @p src)  @param src [n, cols] input
 * @param n tokens  @param m padded tokens (n <= m, a multiple of the recipe's block)
 * @param cols columns  @param spec the recipe  @param ws the buffers (host memory; x holds
 *        cols·m floats)
 */
void moe_cpu_qdq_t(void *dst, const void *src, int n, int m, int cols, const moe_qdq_spec *spec,
                   const moe_qdq_ws *ws);

#ifdef __cplusplus
}
#endif

#endif /* MOE_QUANTIZE_H */
