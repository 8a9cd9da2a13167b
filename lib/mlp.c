/* The SwiGLU MLP, one or a group of them: see mlp.h. */
#include "mlp.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>

#include "fp8_gemm.h"
#include "fp8_wgrad.h"
#include "profile.h"

/* chapter 05's native FP8 path (lowp.h): a backend op's status, which a shape checked at
 * start-up cannot fail */
#define fp8_ok(st, err) MOE_REQUIRE_OK(st, err, "native FP8 expert GEMM")

/* MOE_FP8_DISPATCH_CODES=0: fc1's native GEMM quantizes the received rows again instead
 * of reading the received codes (the same codes by construction; a switch for the GPU, where
 * this path was only compiled when it was written) */
static int fp8_dispatch_codes_on(void) {
    const char *e = getenv("MOE_FP8_DISPATCH_CODES");
    return !(e && *e == '0');
}

/* D = Q(A)·B_gᵀ per group in our FP8 grouped kernel: A [rows, K] in the activation type,
 * quantized 1×128 into the context's codes (and, with @p a_deq, its dequantized copy for the
 * bf16 wgrad, in the same pass); B_g the FP8 codes [N, K] of each expert */
/* D = A·B_gᵀ per group on codes already made: A's 1×128 codes @p aq and scales @p as
 * [rows, K], B_g the FP8 codes [N, K] of each expert */
static void fp8_gemm_codes(const moe_backend *be, void *d, const uint8_t *aq, const float *as,
                           const uint8_t *bq, const float *bs, const moe_groups *grp, int N,
                           int K, moe_lowp_role role) {
    const moe_qmatrix qa = {MOE_QUANT_BLOCK_1X128, grp->lowp->spec[role].format, aq, as, NULL,
                            {0}};
    const moe_qmatrix qb = {MOE_QUANT_BLOCK_128X128, MOE_FP8_E4M3, bq, bs, NULL, {0}};
    moe_error err;
    fp8_ok(be->fp8_grouped_gemm(d, 0, &qa, &qb, grp->dev_off, grp->G, grp->rows, N, K, &err),
           &err);
}

static void fp8_gemm(const moe_backend *be, void *d, const void *a, void *a_deq,
                     const uint8_t *bq, const float *bs, const moe_groups *grp, int N, int K,
                     moe_lowp_role role) {
    const moe_qdq_spec *sp = &grp->lowp->spec[role];
    const moe_qdq_ws *ws = &grp->lowp->ws;
    MOE_ASSERT((size_t)grp->rows * K <= grp->lowp->cap);
    moe_error err;
    fp8_ok(be->fp8_quant_act(ws->q, (float *)ws->scales, a_deq, a, grp->rows, K, sp->format,
                             sp->pow2, &err), &err);
    fp8_gemm_codes(be, d, ws->q, ws->scales, bq, bs, grp, N, K, role);
}

/* chapter 05's native FP8 dense linears (lowp.h): linear @p lin's FP8 weight of a single
 * MLP when this call runs it natively (not on rows that arrived quantized: the routed
 * experts' FP8 dispatch), else NULL */
static const moe_fp8_weight *dense_native(const moe_groups *grp, int lin) {
    if (!grp->dense_fp8 || (lin == 0 && grp->x_quantized))
        return NULL;
    MOE_ASSERT(grp->G == 1 && grp->impl != MOE_EXPERTS_KERNEL && !grp->gather && !grp->scatter);
    const moe_fp8_weight *fw = &grp->dense_fp8[lin];
    return moe_lowp_dense_fits(grp->lowp, fw, grp->rows) ? fw : NULL;
}

/* one grouped Linear, through the grouped GEMM the groups ask for; @p gather: its input
 * rows are gathered by grp->gather (fc1 under the fused permutation); @p scatter: its output
 * rows are scattered by grp->scatter (fc2 under it); @p fw: its FP8 codes (the native path
 * of lowp.h) or NULL; @p lin: 0 fc1, 1 fc2 (its sites: grp->lowp_site + lin) */
static void gmm_forward(const moe_backend *be, void *out, const void *in, const void *w,
                        const moe_fp8_weight *fw, const moe_groups *grp, int I, int O,
                        int gather, int scatter, int lin) {
    const moe_fp8_weight *fd = dense_native(grp, lin);
    if (fd) { /* chapter 05, native dense: out = Q(in)·Q(w)ᵀ in the dense FP8 GEMM */
        MOE_ASSERT(fd->O == O && fd->I == I);
        moe_lowp_dense_forward(be, grp->lowp, &out, &fd, 1, in, grp->rows, I);
        return;
    }
    /* chapter 05's FP8 dispatch: fc1's rows arrived quantized (their QDQ, and the codes) */
    const int arrived = lin == 0 && grp->x_quantized;
    if (fw) { /* chapter 05, native: out = Q(in)·Q(w_g)ᵀ on the FP8 codes */
        MOE_ASSERT(!gather && !scatter && grp->impl == MOE_EXPERTS_KERNEL && fw->O == O &&
                   fw->I == I);
        if (arrived && grp->xq && fp8_dispatch_codes_on()) { /* the received codes as they are */
            const moe_qdq_spec *sp = &grp->lowp->spec[MOE_LOWP_ACTIVATION];
            const moe_qmatrix qa = {MOE_QUANT_BLOCK_1X128, sp->format, grp->xq, grp->xs, NULL,
                                    {0}};
            const moe_qmatrix qb = {MOE_QUANT_BLOCK_128X128, MOE_FP8_E4M3, fw->q, fw->s, NULL,
                                    {0}};
            moe_error err;
            fp8_ok(be->fp8_grouped_gemm(out, 0, &qa, &qb, grp->dev_off, grp->G, grp->rows, O, I,
                                        &err), &err);
            return;
        }
        fp8_gemm(be, out, in, NULL, fw->q, fw->s, grp, O, I, MOE_LOWP_ACTIVATION);
        return;
    }
    /* chapter 05, emulated low precision: the input quantized (the weights already are);
     * the fused gather is refused with it at start-up (lowp.h) */
    if (!arrived)
        in = moe_lowp_qdq(be, grp->lowp, in, grp->rows, I, MOE_LOWP_ACTIVATION,
                          grp->lowp_site + lin);
    if (gather)
        be->grouped_matmul_forward_dev_gather(out, in, grp->gather, grp->gather_div, w,
                                              grp->dev_off, grp->G, grp->rows, I, O);
    else if (scatter)
        be->grouped_matmul_forward_dev_scatter(out, in, grp->scatter, w, grp->dev_off, grp->G,
                                               grp->rows, I, O);
    else if (grp->impl == MOE_EXPERTS_KERNEL)
        be->grouped_matmul_forward_dev(out, in, w, grp->dev_off, grp->G, grp->rows, I, O);
    else
        be->grouped_matmul_forward(out, in, w, grp->off, grp->G, I, O);
}

/* chapter 05's FP8 wgrad operands in the context's buffers (moe_lowp_alloc_fp8_wgrad()): A =
 * dout's token-wise copy [O][kpad] first, then B = in's [I][kpad], their scales likewise;
 * returns kpad. The one place that lays them out: fp8_wgrad() and the tiled SwiGLU backward,
 * which writes A itself, both ask here. */
static size_t wgrad_operands(const moe_groups *grp, int I, int O, uint8_t **qa, float **sa,
                             uint8_t **qb, float **sb) {
    const moe_lowp *lp = grp->lowp;
    const size_t kpad = moe_fp8_wgrad_kpad(grp->rows, grp->G);
    MOE_ASSERT(lp->wg_q && lp->wg_s && kpad * (size_t)(O + I) <= lp->wg_elems);
    *qa = lp->wg_q, *qb = *qa + (size_t)O * kpad;
    *sa = lp->wg_s, *sb = *sa + (size_t)O * (kpad / MOE_QUANT_BLOCK);
    return kpad;
}

/* the token-wise copy kept in `act` (MOE_MLP_SAVED_FP8_TOKEN): codes [F][kpad], then the
 * scales [kpad/128][F] (F·kpad is a multiple of 128², so they start aligned); returns kpad,
 * the groups' bound, the same in the forward and the backward */
static size_t saved_t(const void *act, const moe_groups *grp, int F, uint8_t **qt, float **st) {
    const size_t kpad = moe_fp8_wgrad_kpad(grp->rows, grp->G);
    *qt = (uint8_t *)act;
    *st = (float *)(*qt + (size_t)F * kpad);
    return kpad;
}

/* ... and fc1's input x's token-wise copy, kept after it (moe_groups::keep_x_t): codes
 * [H][kpad], then its scales, at moe_mlp_fp8_act_t_bytes() of the output's width; fp8_wgrad()
 * reads it through saved_t() as it reads the output's */
static const void *saved_x_t(const void *act, const moe_groups *grp, int F) {
    return (const uint8_t *)act + moe_mlp_fp8_act_t_bytes((size_t)grp->rows, grp->G, F);
}

/* chapter 05's FP8 wgrad, native (lib/fp8_wgrad.h): dw_g = Q_t(dout_g)ᵀ·Q_t(in_g) in our FP8
 * wgrad kernel, both operands quantized 1×128 along the tokens of each group
 * (wgrad_operands()), dw written in the groups' mode; @p dout NULL: dout's copy is there
 * already (written by the tiled SwiGLU backward); @p in_t: @p in is not values but in's
 * token-wise copy, codes [I][kpad] then scales (kept by the tiled SwiGLU forward, saved_t) */
static void fp8_wgrad(const moe_backend *be, moe_real *dw, const void *dout, const void *in,
                      int in_t, const moe_groups *grp, int I, int O) {
    const moe_lowp *lp = grp->lowp;
    const int N = grp->rows, G = grp->G;
    uint8_t *qa, *qb;
    float *sa, *sb;
    const size_t kpad = wgrad_operands(grp, I, O, &qa, &sa, &qb, &sb);
    const moe_qdq_spec *sg = &lp->spec[MOE_LOWP_GRADIENT], *sx = &lp->spec[MOE_LOWP_ACTIVATION];
    moe_error err;
    if (dout)
        fp8_ok(be->fp8_quant_group_t_act(qa, sa, dout, grp->dev_off, G, N, O, kpad, sg->format,
                                         sg->pow2, &err), &err);
    if (in_t)
        saved_t(in, grp, I, &qb, &sb);
    else
        fp8_ok(be->fp8_quant_group_t_act(qb, sb, in, grp->dev_off, G, N, I, kpad, sx->format,
                                         sx->pow2, &err), &err);
    fp8_ok(be->fp8_grouped_wgrad(dw, grp->dw_mode, qa, sa, qb, sb, grp->dev_off, G, kpad, O, I,
                                 &err), &err);
}

/* The emulation of the FP8 wgrad's numerics (lowp->fp8_wgrad), for the routed experts' grouped
 * GEMMs only (as the native path): the groups' offsets in backend memory for the token-wise
 * QDQ, or NULL (the row-wise QDQ then serves the wgrad as before). The routed experts' groups
 * are those with device offsets (moe/experts.c; a single MLP's, mlp.c's one_group, has none);
 * our kernel reads them there, the CPU's host offsets are backend memory too; a CUDA grouped
 * GEMM with host offsets (cuBLAS) keeps the row-wise QDQ, and so does the CPU's twin of it */
static const int *wgrad_offsets(const moe_backend *be, const moe_groups *grp) {
    if (!grp->lowp || !grp->lowp->on || !grp->lowp->fp8_wgrad || !be->qdq_group_t ||
        !grp->dev_off)
        return NULL;
    if (grp->impl == MOE_EXPERTS_KERNEL)
        return grp->dev_off;
    return NULL;
}

/* one grouped backward through the op the groups ask for (no gather); din or dw may be NULL */
static void grouped_backward(const moe_backend *be, void *din, moe_real *dw, const void *dout,
                             const void *in, const void *w, const moe_groups *grp, int I, int O,
                             int din_accumulate) {
    const int N = grp->rows;
    if (grp->impl == MOE_EXPERTS_KERNEL) {
        be->grouped_matmul_backward_dev(din, dw, dout, in, w, grp->dev_off, grp->G, N, I, O,
                                        din_accumulate, grp->dw_mode);
        return;
    }
    MOE_ASSERT(grp->dw_mode != MOE_DW_ACT);
    if (din && !din_accumulate)
        be->zero(din, be->act_size * (size_t)N * I);
    if (dw && grp->dw_mode == MOE_DW_STORE)
        be->zero(dw, sizeof(moe_real) * (size_t)grp->G * O * I);
    be->grouped_matmul_backward(din, dw, dout, in, w, grp->off, grp->G, I, O);
}

/* chapter 05, NVFP4 with the wgrad's random Hadamard transform (lowp.h): the dgrad GEMM
 * din = Q(dout)·Q(w) as always, then the wgrad on the operands quantized along the tokens,
 * expert by expert (moe_lowp_wgrad(): the host offsets, which NVFP4 has: it refuses the
 * sync-free layer) */
static void wgrad_rht_backward(const moe_backend *be, void *din, moe_real *dw, const void *dout,
                               const void *in, const void *w, const moe_groups *grp, int I,
                               int O, int din_accumulate, int site) {
    const int N = grp->rows;
    MOE_ASSERT(grp->off && !grp->gather && grp->dw_mode != MOE_DW_ACT);
    if (din) {
        const void *dq = moe_lowp_qdq(be, grp->lowp, dout, N, O, MOE_LOWP_GRADIENT, site);
        if (grp->impl == MOE_EXPERTS_KERNEL) {
            be->grouped_matmul_backward_dev(din, NULL, dq, in, w, grp->dev_off, grp->G, N, I,
                                            O, din_accumulate, grp->dw_mode);
        } else {
            if (!din_accumulate)
                be->zero(din, be->act_size * (size_t)N * I);
            be->grouped_matmul_backward(din, NULL, dq, in, w, grp->off, grp->G, I, O);
        }
    }
    if (grp->dw_mode == MOE_DW_STORE)
        be->zero(dw, sizeof(moe_real) * (size_t)grp->G * O * I);
    moe_lowp_wgrad(be, grp->lowp, dw, dout, in, grp->off, grp->G, I, O, site);
}

/* ... and its backward: din accumulates, or (din_accumulate = 0) is overwritten — our
 * kernel simply stores instead of adding; the host-offset ops always add, so they get a
 * zeroed buffer */
static void gmm_backward(const moe_backend *be, void *din, moe_real *dw, const void *dout,
                         const void *in, const void *w, const moe_fp8_weight *fw,
                         const moe_groups *grp, int I, int O, int din_accumulate, int gather,
                         int lin) {
    const int N = grp->rows, site = grp->lowp_site + lin;
    const void *dout_raw = dout;
    const moe_fp8_weight *fd = dense_native(grp, lin);
    if (fd) { /* chapter 05, native dense: din (+)= Q(dout)·Q(w) in the dense FP8 GEMM on
               * Wᵀ's codes, its quantizing pass writing Q(dout) for the bf16 wgrad on the
               * saved input's QDQ, as emulated */
        MOE_ASSERT(fd->O == O && fd->I == I && !gather);
        const void *dq = moe_lowp_dense_dgrad(be, grp->lowp, din, din_accumulate, fd, dout, N);
        if (dw)
            grouped_backward(be, NULL, dw, dq, moe_lowp_qdq_saved(be, grp->lowp, in, N, I, site),
                             w, grp, I, O, 0);
        return;
    }
    if (fw && grp->lowp->fp8_wgrad) { /* chapter 05, native, the FP8 wgrad too */
        MOE_ASSERT(!gather && !din_accumulate && grp->impl == MOE_EXPERTS_KERNEL);
        if (din)
            fp8_gemm(be, din, dout, NULL, fw->qt, fw->st, grp, I, O, MOE_LOWP_GRADIENT);
        if (dw)
            fp8_wgrad(be, dw, dout, in, 0, grp, I, O);
        return;
    }
    if (fw) { /* chapter 05, native: dgrad din = Q(dout)·Q(w_g) on the transposed FP8 codes,
               * one pass quantizing dout for it and writing Q(dout) for the bf16 wgrad */
        MOE_ASSERT(!gather && !din_accumulate && grp->impl == MOE_EXPERTS_KERNEL);
        moe_lowp *lp = grp->lowp;
        if (din)
            fp8_gemm(be, din, dout, lp->grad, fw->qt, fw->st, grp, I, O, MOE_LOWP_GRADIENT);
        else
            dout = moe_lowp_qdq(be, lp, dout, N, O, MOE_LOWP_GRADIENT, site);
        /* wgrad on the dequantized operands, as emulated (the codes' buffer is reused:
         * the dgrad GEMM is queued before it on the same stream); fc1's rows that arrived
         * quantized (the FP8 dispatch) are those values already */
        if (!(lin == 0 && grp->x_quantized))
            in = moe_lowp_qdq_saved(be, lp, in, N, I, site);
        be->grouped_matmul_backward_dev(NULL, dw, din ? lp->grad : dout, in, w, grp->dev_off,
                                        grp->G, N, I, O, 0, grp->dw_mode);
        return;
    }
    if (dw && moe_lowp_wgrad_rht(grp->lowp)) { /* chapter 05, NVFP4: dgrad on Q(dout) */
        wgrad_rht_backward(be, din, dw, dout, in, w, grp, I, O, din_accumulate, site);
        return;
    }
    /* chapter 05: both backward GEMMs on the quantized output gradient and the quantized
     * input (the same bytes as the forward's); the straight-through rule of lowp.h */
    dout = moe_lowp_qdq(be, grp->lowp, dout, N, O, MOE_LOWP_GRADIENT, site);
    const int *wo = wgrad_offsets(be, grp);
    if (wo && !gather && dw) { /* the FP8 wgrad's numerics: dgrad on the row-wise Q(dout),
                                * then wgrad on the token-wise QDQ of dout_raw and in */
        if (din)
            grouped_backward(be, din, NULL, dout, in, w, grp, I, O, din_accumulate);
        moe_lowp *lp = grp->lowp;
        const moe_qdq_spec *sg = &lp->spec[MOE_LOWP_GRADIENT], *sx = &lp->spec[MOE_LOWP_ACTIVATION];
        be->qdq_group_t(lp->grad, dout_raw, wo, grp->G, N, O, sg->format, sg->pow2);
        be->qdq_group_t(lp->act, in, wo, grp->G, N, I, sx->format, sx->pow2);
        grouped_backward(be, NULL, dw, lp->grad, lp->act, w, grp, I, O, 0);
        return;
    }
    if (!(lin == 0 && grp->x_quantized)) /* (the FP8 dispatch's rows are Q(x) already) */
        in = moe_lowp_qdq_saved(be, grp->lowp, in, N, I, site);
    if (gather) {
        be->grouped_matmul_backward_dev_gather(din, dw, dout, in, grp->gather, grp->gather_div,
                                               w, grp->dev_off, grp->G, N, I, O, din_accumulate,
                                               grp->dw_mode);
        return;
    }
    if (grp->impl == MOE_EXPERTS_KERNEL) {
        be->grouped_matmul_backward_dev(din, dw, dout, in, w, grp->dev_off, grp->G, N, I, O,
                                        din_accumulate, grp->dw_mode);
        return;
    }
    MOE_ASSERT(grp->dw_mode != MOE_DW_ACT); /* only our kernel writes activation-type dw */
    if (din && !din_accumulate)
        be->zero(din, be->act_size * (size_t)N * I);
    if (dw && grp->dw_mode == MOE_DW_STORE)
        be->zero(dw, sizeof(moe_real) * (size_t)grp->G * O * I);
    be->grouped_matmul_backward(din, dw, dout, in, w, grp->off, grp->G, I, O);
}

/*
 * Chapter 05's native FP8 layer with its passes fused (lowp.h, "Fused passes"; off with
 * MOE_FP8_FUSED=0, which runs the separate passes above: the same bits, tested by
 * tests/gpu_fp8_fused.c and tests/gpu_fp8_layer.c):
 *  - forward: the SwiGLU writes fc2's 1×128 codes and scales, not its bf16 output; they are
 *    kept for the backward in the `act` buffer itself (codes [N, F] bytes, then the scales
 *    [N][F/128]: F + F/32 bytes a row where the bf16 output took 2F), which is allocated at
 *    that size (moe_mlp_act_bytes()): N·F·31/32 bytes fewer per MoE layer than in bf16;
 *  - backward: fc2's bf16 wgrad dequantizes those codes once (1 byte read and 2 written per
 *    element, where the separate path read the saved bf16 output and quantized it again: 2
 *    read, 3 written); the SwiGLU backward writes dgu's codes and dequantized copy, not dgu.
 * The forward, the backward and the buffer's size must agree on the switch (`act` holds
 * codes under it, in a buffer too small for the bf16 output): it is the context's
 * lp->fp8_fused, latched from MOE_FP8_FUSED when the context is made (moe_lowp_from_config()),
 * and lp->native, set by whoever made the FP8 weights (the model, before its buffers).
 *
 * Under the FP8 wgrad (lp->fp8_wgrad: the default, MOE_FP8_WGRAD=0 turns it off) the wgrad
 * quantizes the SwiGLU output and dgu along the tokens of each expert. The SwiGLU output:
 * the tiled forward (MOE_FP8_SAVE_T, on; kernels/swiglu_quant.cu, the end) writes fc2's
 * row-wise codes (into the context's scratch, fc2's forward reads them at once) and the
 * token-wise copy fc2's wgrad reads, which is what `act` keeps (MOE_MLP_SAVED_FP8_TOKEN: F·Kpad
 * codes and F·Kpad/128 scales, Kpad the groups' 128-padded bound: about half the bf16
 * output's bytes), so the output is never written in bf16 nor quantized in the backward.
 * In that form the layer keeps x likewise (moe_groups::keep_x_t, moe_layer_keeps_x_t()):
 * the forward quantizes x along each expert's tokens into `act`, after the output's copy,
 * which is what fc1's wgrad reads, so the rows x need not be kept (the same pass the backward
 * ran before, moved; the same bits).
 * With MOE_FP8_SAVE_T=0 the row-wise fused forward writes the bf16 output (y_raw) next to the
 * codes into `act`, and the backward's token-wise quantizer reads it. dgu: the fused backward
 * writes its token-wise copy (the tiled backward, the default) or, with MOE_FP8_FUSED_T=0, dgu
 * itself (y_raw) next to its row-wise codes.
 * Per MoE layer of N rows the row-wise passes skip, against the separate passes, the
 * forward's re-read of the SwiGLU output (2·N·F bytes) and, in the backward, the zeroing of
 * dgu, the SwiGLU's read of it and the quantizer's (3 × 4·N·F bytes): 14·N·F bytes and two
 * launches. STATUS: passed tests/gpu_fp8_fused.c and gpu_fp8_layer.c on an H100 at 3d50c58;
 * on with the FP8 wgrad, blockwise's default (MOE_FP8_WGRAD=0 turns both off).
 */

/* the fused passes' condition, whichever wgrad runs: the native path, MOE_FP8_FUSED latched
 * on, and the backend's fused ops */
static int fp8_fused_passes(const moe_backend *be, const moe_lowp *lp) {
    return lp && lp->native && lp->fp8_fused && be->fp8_swiglu_forward_quant &&
           be->fp8_swiglu_backward_quant && be->fp8_dequant_act;
}

moe_mlp_saved moe_mlp_saved_form_of(int fused_passes, int fp8_wgrad, int tiled_forward) {
    if (!fused_passes)
        return MOE_MLP_SAVED_ACT;
    if (!fp8_wgrad) /* fc2's bf16 wgrad dequantizes the forward's row-wise codes */
        return MOE_MLP_SAVED_FP8_ROW;
    /* the FP8 wgrad reads the token-wise copy: written by the tiled forward, or else made in
     * the backward from the bf16 output, which is then what is kept */
    return tiled_forward ? MOE_MLP_SAVED_FP8_TOKEN : MOE_MLP_SAVED_ACT;
}

moe_mlp_saved moe_mlp_saved_form(const moe_backend *be, const moe_lowp *lp) {
    const int fused = fp8_fused_passes(be, lp);
    return moe_mlp_saved_form_of(fused, fused && lp->fp8_wgrad,
                                 fused && lp->fp8_save_t && be->fp8_swiglu_forward_quant_t);
}

int moe_mlp_fp8_saves_codes(const moe_backend *be, const moe_lowp *lp) {
    return moe_mlp_saved_form(be, lp) != MOE_MLP_SAVED_ACT;
}

size_t moe_mlp_fp8_act_bytes(size_t rows, int F) {
    const size_t blocks = ((size_t)F + MOE_QUANT_BLOCK - 1) / MOE_QUANT_BLOCK;
    return rows * (size_t)F + rows * blocks * sizeof(float);
}

size_t moe_mlp_fp8_act_t_bytes(size_t rows, int G, int F) {
    const size_t kpad = moe_fp8_wgrad_kpad(rows > INT_MAX ? INT_MAX : (int)rows, G);
    return (size_t)F * kpad + (size_t)F * (kpad / MOE_QUANT_BLOCK) * sizeof(float);
}

size_t moe_mlp_act_bytes(const moe_backend *be, const moe_lowp *lp, size_t rows, int G, int F,
                         int x_width) {
    switch (moe_mlp_saved_form(be, lp)) {
    case MOE_MLP_SAVED_FP8_ROW: return moe_mlp_fp8_act_bytes(rows, F);
    case MOE_MLP_SAVED_FP8_TOKEN: /* (x's copy after the output's: saved_x_t) */
        return moe_mlp_fp8_act_t_bytes(rows, G, F) +
               (x_width > 0 ? moe_mlp_fp8_act_t_bytes(rows, G, x_width) : 0);
    default: return be->act_size * rows * (size_t)F;
    }
}

int moe_mlp_fp8_fused(const moe_backend *be, const moe_groups *grp) {
    return grp->fp8_w1 && grp->fp8_w2 && fp8_fused_passes(be, grp->lowp);
}

/* x's token-wise copy is the token-wise form's, on the fused passes that write and read it */
static int keeps_x_t_ok(const moe_backend *be, const moe_groups *grp) {
    return moe_mlp_fp8_fused(be, grp) &&
           moe_mlp_saved_form(be, grp->lowp) == MOE_MLP_SAVED_FP8_TOKEN;
}

/* the scales of the codes kept in `act` (after the [N, F] codes: N·F is a multiple of 128,
 * so they start 16-byte aligned) */
static float *saved_scales(void *act, int N, int F) {
    return (float *)((uint8_t *)act + (size_t)N * F);
}

static void forward_fp8_fused(const moe_backend *be, void *out, void *gu, void *act,
                              const void *x, const moe_real *row_scale, const moe_groups *grp,
                              int H, int F) {
    const int N = grp->rows;
    const moe_lowp *lp = grp->lowp;
    const moe_qdq_spec *sp = &lp->spec[MOE_LOWP_ACTIVATION];
    /* fc2's codes: kept in `act` itself, or under the FP8 wgrad (`act` then keeps the
     * token-wise copy or the bf16 output) in the scratch, for fc2's GEMM only */
    const int wgrad = lp->fp8_wgrad;
    uint8_t *q = wgrad ? lp->ws.q : (uint8_t *)act;
    float *s = wgrad ? (float *)lp->ws.scales : saved_scales(act, N, F);
    MOE_ASSERT(!wgrad || (size_t)N * F <= lp->cap);
    moe_error err;
    fp8_gemm(be, gu, x, NULL, grp->fp8_w1->q, grp->fp8_w1->s, grp, 2 * F, H,
             MOE_LOWP_ACTIVATION);
    moe_prof_mark(MOE_PROF_GEMM);
    /* (fc1's GEMM, which read x's codes from the scratch, is queued before on the stream) */
    if (moe_mlp_saved_form(be, lp) == MOE_MLP_SAVED_FP8_TOKEN) {
        /* the tiled forward: fc2's codes, and the token-wise copy its wgrad reads, kept */
        uint8_t *qt;
        float *st;
        const size_t kpad = saved_t(act, grp, F, &qt, &st);
        fp8_ok(be->fp8_swiglu_forward_quant_t(q, s, qt, st, gu, row_scale, grp->dev_off, grp->G,
                                              N, F, kpad, sp->format, sp->pow2, &err),
               &err);
        if (grp->keep_x_t) { /* x's copy for fc1's wgrad, made here instead of in the
                              * backward (the same pass, the same codes), so x itself need
                              * not be kept: half its bytes */
            saved_t(saved_x_t(act, grp, F), grp, H, &qt, &st);
            fp8_ok(be->fp8_quant_group_t_act(qt, st, x, grp->dev_off, grp->G, N, H, kpad,
                                             sp->format, sp->pow2, &err),
                   &err);
        }
    } else {
        MOE_ASSERT(!grp->keep_x_t); /* (the token-wise form's only) */
        fp8_ok(be->fp8_swiglu_forward_quant(q, s, wgrad ? act : NULL, wgrad, gu, row_scale, N,
                                            F, sp->format, sp->pow2, &err),
               &err);
    }
    moe_prof_mark(MOE_PROF_EXPERT_OPS);
    fp8_gemm_codes(be, out, q, s, grp->fp8_w2->q, grp->fp8_w2->s, grp, H, F,
                   MOE_LOWP_ACTIVATION);
    moe_prof_mark(MOE_PROF_GEMM);
}

/* the fused backward under the FP8 wgrad: fc2 as the separate path runs it (dgrad on dout's
 * row-wise codes, FP8 wgrad on the token-wise copies of dout and the kept bf16 output); the
 * SwiGLU backward writing dgu's row-wise codes (fc1's dgrad) and either dgu itself (the
 * source of its token-wise copy), not zeroed first nor read back, or (lp->fp8_fused_t, the
 * tiled kernel) that token-wise copy, straight into the FP8 wgrad's A operand; then fc1's
 * dgrad and FP8 wgrad */
static void backward_fp8_fused_wgrad(const moe_backend *be, void *dx, moe_real *dw1,
                                     moe_real *dw2, moe_real *drow_scale, const void *dout,
                                     const void *x, const void *gu, const void *act,
                                     const moe_real *row_scale, const void *w2, void *ws_dh,
                                     void *ws_dgu, const moe_groups *grp, int H, int F) {
    const int N = grp->rows;
    moe_lowp *lp = grp->lowp;
    const moe_qdq_ws *ws = &lp->ws;
    const moe_qdq_spec *sg = &lp->spec[MOE_LOWP_GRADIENT];
    const int tiled = lp->fp8_fused_t && be->fp8_swiglu_backward_quant_t;
    MOE_ASSERT((size_t)N * 2 * F <= lp->cap);
    moe_error err;
    if (moe_mlp_saved_form(be, lp) == MOE_MLP_SAVED_FP8_TOKEN) {
        /* `act` is fc2's wgrad operand already (the tiled forward kept it) */
        fp8_gemm(be, ws_dh, dout, NULL, grp->fp8_w2->qt, grp->fp8_w2->st, grp, F, H,
                 MOE_LOWP_GRADIENT);
        if (dw2)
            fp8_wgrad(be, dw2, dout, act, 1, grp, F, H);
    } else {
        gmm_backward(be, ws_dh, dw2, dout, act, w2, grp->fp8_w2, grp, F, H, 0, 0, 1);
    }
    moe_prof_mark(MOE_PROF_GEMM);
    /* (fc2's dgrad GEMM, which read dout's codes from the scratch, and its FP8 wgrad, which
     * read the token-wise copies' buffers, are queued before on the same stream) */
    if (tiled) {
        /* dgu's copy is fc1's FP8 wgrad's A (I = H, O = 2F); the routing weight's partial
         * sums, N·F/128 floats, go where dgu would have been (4·N·F bytes) */
        uint8_t *qa, *qb;
        float *sa, *sb;
        const size_t kpad = wgrad_operands(grp, H, 2 * F, &qa, &sa, &qb, &sb);
        fp8_ok(be->fp8_swiglu_backward_quant_t(
                   ws->q, (float *)ws->scales, qa, sa, (float *)ws_dgu,
                   row_scale ? drow_scale : NULL, ws_dh, gu, row_scale, grp->dev_off, grp->G, N,
                   F, kpad, sg->format, sg->pow2, &err),
               &err);
    } else {
        fp8_ok(be->fp8_swiglu_backward_quant(ws->q, (float *)ws->scales, ws_dgu, 1,
                                             row_scale ? drow_scale : NULL, ws_dh, gu,
                                             row_scale, N, F, sg->format, sg->pow2, &err),
               &err);
    }
    moe_prof_mark(MOE_PROF_EXPERT_OPS);
    if (dx)
        fp8_gemm_codes(be, dx, ws->q, ws->scales, grp->fp8_w1->qt, grp->fp8_w1->st, grp, H,
                       2 * F, MOE_LOWP_GRADIENT);
    if (dw1) /* x's token-wise copy where the forward kept it, else made from x here */
        fp8_wgrad(be, dw1, tiled ? NULL : ws_dgu, grp->keep_x_t ? saved_x_t(act, grp, F) : x,
                  grp->keep_x_t, grp, H, 2 * F);
    moe_prof_mark(MOE_PROF_GEMM);
}

static void backward_fp8_fused(const moe_backend *be, void *dx, moe_real *dw1, moe_real *dw2,
                               moe_real *drow_scale, const void *dout, const void *x,
                               const void *gu, const void *act, const moe_real *row_scale,
                               const void *w1, const void *w2, void *ws_dh,
                               const moe_groups *grp, int H, int F) {
    const int N = grp->rows;
    moe_lowp *lp = grp->lowp;
    const moe_qdq_ws *ws = &lp->ws;
    const moe_qdq_spec *sa = &lp->spec[MOE_LOWP_ACTIVATION], *sg = &lp->spec[MOE_LOWP_GRADIENT];
    MOE_ASSERT((size_t)N * 2 * F <= lp->cap && (size_t)N * H <= lp->cap);
    moe_error err;
    /* fc2: dh = Q(dout)·Q(w2_g) (dout's codes and its dequantized copy in one pass), then the
     * bf16 wgrad on that copy and the forward's codes of the SwiGLU output, dequantized */
    fp8_gemm(be, ws_dh, dout, lp->grad, grp->fp8_w2->qt, grp->fp8_w2->st, grp, F, H,
             MOE_LOWP_GRADIENT);
    fp8_ok(be->fp8_dequant_act(lp->act, (const uint8_t *)act,
                               saved_scales((void *)act, N, F), N, F, sa->format, &err),
           &err);
    be->grouped_matmul_backward_dev(NULL, dw2, lp->grad, lp->act, w2, grp->dev_off, grp->G, N,
                                    F, H, 0, grp->dw_mode);
    moe_prof_mark(MOE_PROF_GEMM);
    /* dgu's codes (fc1's dgrad) and dequantized copy (its wgrad), not dgu: the GEMMs above
     * were queued before on the same stream, so the buffers are free again */
    fp8_ok(be->fp8_swiglu_backward_quant(ws->q, (float *)ws->scales, lp->grad, 0,
                                         row_scale ? drow_scale : NULL, ws_dh, gu, row_scale, N,
                                         F, sg->format, sg->pow2, &err),
           &err);
    moe_prof_mark(MOE_PROF_EXPERT_OPS);
    if (dx)
        fp8_gemm_codes(be, dx, ws->q, ws->scales, grp->fp8_w1->qt, grp->fp8_w1->st, grp, H,
                       2 * F, MOE_LOWP_GRADIENT);
    /* fc1's wgrad: x quantized again, as the separate path does (its codes are not kept) */
    const void *xq = moe_lowp_qdq_saved(be, lp, x, N, H, grp->lowp_site);
    be->grouped_matmul_backward_dev(NULL, dw1, lp->grad, xq, w1, grp->dev_off, grp->G, N, H,
                                    2 * F, 0, grp->dw_mode);
    moe_prof_mark(MOE_PROF_GEMM);
}

/* Forward: fc1 → SwiGLU (with the routing weight fused in) → fc2. The SwiGLU output is
 * saved as `act`: it is exactly fc2's input, so fc2's weight gradient reads it as is. */
void moe_mlp_forward_grouped(const moe_backend *be, void *out, void *gu, void *act,
                             const void *x, const moe_real *row_scale, const void *w1,
                             const void *w2, const moe_groups *grp, int H, int F) {
    const int N = grp->rows;
    if (N == 0)
        return;
    /* only our kernel gathers and scatters */
    MOE_ASSERT((!grp->gather && !grp->scatter) || grp->impl == MOE_EXPERTS_KERNEL);
    MOE_ASSERT(!grp->keep_x_t || keeps_x_t_ok(be, grp));
    if (moe_mlp_fp8_fused(be, grp)) {
        MOE_ASSERT(!grp->gather && !grp->scatter && grp->impl == MOE_EXPERTS_KERNEL);
        forward_fp8_fused(be, out, gu, act, x, row_scale, grp, H, F);
        return;
    }
    gmm_forward(be, gu, x, w1, grp->fp8_w1, grp, H, 2 * F, grp->gather != NULL, 0, 0);
    moe_prof_mark(MOE_PROF_GEMM);
    be->swiglu_forward(act, gu, row_scale, N, F);
    moe_prof_mark(MOE_PROF_EXPERT_OPS);
    gmm_forward(be, out, act, w2, grp->fp8_w2, grp, F, H, 0, grp->scatter != NULL, 1);
    moe_prof_mark(MOE_PROF_GEMM);
}

/* Backward: fc2 (its input was the saved act) gives dh = ∂L/∂(scaled activation); one
 * fused SwiGLU backward then takes dh through the routing weight (d scale = Σ_f dh ⊙
 * silu(g)·u, recomputed from gu) and the activation into dgu; fc1 last. */
void moe_mlp_backward_grouped(const moe_backend *be, void *dx, moe_real *dw1, moe_real *dw2,
                              moe_real *drow_scale, const void *dout, const void *x,
                              const void *gu, const void *act, const moe_real *row_scale,
                              const void *w1, const void *w2, void *ws_dh, void *ws_dgu,
                              const moe_groups *grp, int H, int F, int dx_accumulate) {
    const int N = grp->rows;
    if (N == 0)
        return;
    MOE_ASSERT(!grp->keep_x_t || keeps_x_t_ok(be, grp)); /* (else x would be read) */
    if (moe_mlp_fp8_fused(be, grp)) {
        MOE_ASSERT(!grp->gather && !dx_accumulate && grp->impl == MOE_EXPERTS_KERNEL);
        if (grp->lowp->fp8_wgrad)
            backward_fp8_fused_wgrad(be, dx, dw1, dw2, drow_scale, dout, x, gu, act, row_scale,
                                     w2, ws_dh, ws_dgu, grp, H, F);
        else
            backward_fp8_fused(be, dx, dw1, dw2, drow_scale, dout, x, gu, act, row_scale, w1,
                               w2, ws_dh, grp, H, F);
        return;
    }
    const size_t nf = (size_t)N * F;
    gmm_backward(be, ws_dh, dw2, dout, act, w2, grp->fp8_w2, grp, F, H, 0, 0,
                 1); /* dh: a fresh buffer */
    moe_prof_mark(MOE_PROF_GEMM);
    be->zero(ws_dgu, be->act_size * 2 * nf);
    be->swiglu_backward(ws_dgu, row_scale ? drow_scale : NULL, ws_dh, gu, row_scale, N, F);
    moe_prof_mark(MOE_PROF_EXPERT_OPS);
    gmm_backward(be, dx, dw1, ws_dgu, x, w1, grp->fp8_w1, grp, H, 2 * F, dx_accumulate,
                 grp->gather != NULL, 0);
    moe_prof_mark(MOE_PROF_GEMM);
}

/* a single MLP is one group, run by the backend's plain matmul (G = 1) */
moe_groups moe_groups_single(const int *off, moe_lowp *lp, int site) {
    moe_groups g = {off, NULL, 1, MOE_EXPERTS_CUBLAS, MOE_DW_ACCUMULATE, NULL, 1, off[1], lp,
                    NULL, NULL, site, 0, NULL, NULL, NULL, NULL, 0};
    return g;
}

void moe_mlp_forward_lowp(const moe_backend *be, void *out, void *gu, void *act, const void *x,
                          const moe_real *row_scale, const void *w1, const void *w2, int N,
                          int H, int F, moe_lowp *lp, int site, const moe_fp8_weight *fp8) {
    const int off[2] = {0, N};
    moe_groups g = moe_groups_single(off, lp, site);
    g.dense_fp8 = fp8;
    moe_mlp_forward_grouped(be, out, gu, act, x, row_scale, w1, w2, &g, H, F);
}

void moe_mlp_forward(const moe_backend *be, void *out, void *gu, void *act, const void *x,
                     const moe_real *row_scale, const void *w1, const void *w2, int N, int H,
                     int F) {
    moe_mlp_forward_lowp(be, out, gu, act, x, row_scale, w1, w2, N, H, F, NULL, 0, NULL);
}

void moe_mlp_backward_lowp(const moe_backend *be, void *dx, moe_real *dw1, moe_real *dw2,
                           moe_real *drow_scale, const void *dout, const void *x, const void *gu,
                           const void *act, const moe_real *row_scale, const void *w1,
                           const void *w2, void *ws_dh, void *ws_dgu, int N, int H, int F,
                           moe_lowp *lp, int site, const moe_fp8_weight *fp8) {
    const int off[2] = {0, N};
    moe_groups g = moe_groups_single(off, lp, site);
    g.dense_fp8 = fp8;
    moe_mlp_backward_grouped(be, dx, dw1, dw2, drow_scale, dout, x, gu, act, row_scale, w1, w2,
                             ws_dh, ws_dgu, &g, H, F, 1);
}

void moe_mlp_backward(const moe_backend *be, void *dx, moe_real *dw1, moe_real *dw2,
                      moe_real *drow_scale, const void *dout, const void *x, const void *gu,
                      const void *act, const moe_real *row_scale, const void *w1, const void *w2,
                      void *ws_dh, void *ws_dgu, int N, int H, int F) {
    moe_mlp_backward_lowp(be, dx, dw1, dw2, drow_scale, dout, x, gu, act, row_scale, w1, w2,
                          ws_dh, ws_dgu, N, H, F, NULL, 0, NULL);
}
