/* The SwiGLU MLP, one or a group of them: see mlp.h. */
#include "mlp.h"

#include <stdio.h>

#include "fp8_gemm.h"
#include "profile.h"

/* chapter 05's native FP8 path (lowp.h): a backend op's status, which a shape checked at
 * start-up cannot fail */
static void fp8_ok(moe_status st, const moe_error *err) {
    if (st != MOE_OK)
        fprintf(stderr, "native FP8 expert GEMM: %s\n", err->msg);
    MOE_ASSERT(st == MOE_OK);
}

/* D = Q(A)·B_gᵀ per group in our FP8 grouped kernel: A [rows, K] in the activation type,
 * quantized 1×128 into the context's codes (and, with @p a_deq, its dequantized copy for the
 * bf16 wgrad, in the same pass); B_g the FP8 codes [N, K] of each expert */
static void fp8_gemm(const moe_backend *be, void *d, const void *a, void *a_deq,
                     const uint8_t *bq, const float *bs, const moe_groups *grp, int N, int K,
                     moe_lowp_role role) {
    const moe_qdq_spec *sp = &grp->lowp->spec[role];
    const moe_qdq_ws *ws = &grp->lowp->ws;
    MOE_ASSERT((size_t)grp->rows * K <= grp->lowp->cap);
    moe_error err;
    fp8_ok(be->fp8_quant_act(ws->q, (float *)ws->scales, a_deq, a, grp->rows, K, sp->format,
                             sp->pow2, &err), &err);
    const moe_qmatrix qa = {MOE_QUANT_BLOCK_1X128, sp->format, ws->q, ws->scales, NULL, {0}};
    const moe_qmatrix qb = {MOE_QUANT_BLOCK_128X128, MOE_FP8_E4M3, bq, bs, NULL, {0}};
    fp8_ok(be->fp8_grouped_gemm(d, 0, &qa, &qb, grp->dev_off, grp->G, grp->rows, N, K, &err),
           &err);
}

/* one grouped Linear, through the grouped GEMM the groups ask for; @p gather: its input
 * rows are gathered by grp->gather (fc1 under the fused permutation); @p fw: its FP8 codes
 * (the native path of lowp.h) or NULL; @p lin: 0 fc1, 1 fc2 (its sites: grp->lowp_site + lin) */
static void gmm_forward(const moe_backend *be, void *out, const void *in, const void *w,
                        const moe_fp8_weight *fw, const moe_groups *grp, int I, int O,
                        int gather, int lin) {
    if (fw) { /* chapter 05, native: out = Q(in)·Q(w_g)ᵀ on the FP8 codes */
        MOE_ASSERT(!gather && grp->impl == MOE_EXPERTS_KERNEL && fw->O == O && fw->I == I);
        fp8_gemm(be, out, in, NULL, fw->q, fw->s, grp, O, I, MOE_LOWP_ACTIVATION);
        return;
    }
    /* chapter 05, emulated low precision: the input quantized (the weights already are);
     * the fused gather is refused with it at start-up (lowp.h) */
    in = moe_lowp_qdq(be, grp->lowp, in, grp->rows, I, MOE_LOWP_ACTIVATION,
                      grp->lowp_site + lin);
    if (gather)
        be->grouped_matmul_forward_dev_gather(out, in, grp->gather, grp->gather_div, w,
                                              grp->dev_off, grp->G, grp->rows, I, O);
    else if (grp->impl == MOE_EXPERTS_KERNEL)
        be->grouped_matmul_forward_dev(out, in, w, grp->dev_off, grp->G, grp->rows, I, O);
    else
        be->grouped_matmul_forward(out, in, w, grp->off, grp->G, I, O);
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
    if (fw) { /* chapter 05, native: dgrad din = Q(dout)·Q(w_g) on the transposed FP8 codes,
               * one pass quantizing dout for it and writing Q(dout) for the bf16 wgrad */
        MOE_ASSERT(!gather && !din_accumulate && grp->impl == MOE_EXPERTS_KERNEL);
        moe_lowp *lp = grp->lowp;
        if (din)
            fp8_gemm(be, din, dout, lp->grad, fw->qt, fw->st, grp, I, O, MOE_LOWP_GRADIENT);
        else
            dout = moe_lowp_qdq(be, lp, dout, N, O, MOE_LOWP_GRADIENT, site);
        /* wgrad on the dequantized operands, as emulated (the codes' buffer is reused:
         * the dgrad GEMM is queued before it on the same stream) */
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

/* Forward: fc1 → SwiGLU (with the routing weight fused in) → fc2. The SwiGLU output is
 * saved as `act`: it is exactly fc2's input, so fc2's weight gradient reads it as is. */
void moe_mlp_forward_grouped(const moe_backend *be, void *out, void *gu, void *act,
                             const void *x, const moe_real *row_scale, const void *w1,
                             const void *w2, const moe_groups *grp, int H, int F) {
    const int N = grp->rows;
    if (N == 0)
        return;
    MOE_ASSERT(!grp->gather || grp->impl == MOE_EXPERTS_KERNEL); /* only our kernel gathers */
    gmm_forward(be, gu, x, w1, grp->fp8_w1, grp, H, 2 * F, grp->gather != NULL, 0);
    moe_prof_mark(MOE_PROF_GEMM);
    be->swiglu_forward(act, gu, row_scale, N, F);
    moe_prof_mark(MOE_PROF_EXPERT_OPS);
    gmm_forward(be, out, act, w2, grp->fp8_w2, grp, F, H, 0, 1);
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
static moe_groups one_group(const int *off, moe_lowp *lp, int site) {
    moe_groups g = {off, NULL, 1, MOE_EXPERTS_CUBLAS, MOE_DW_ACCUMULATE, NULL, 1, off[1], lp,
                    NULL, NULL, site};
    return g;
}

void moe_mlp_forward_lowp(const moe_backend *be, void *out, void *gu, void *act, const void *x,
                          const moe_real *row_scale, const void *w1, const void *w2, int N,
                          int H, int F, moe_lowp *lp, int site) {
    const int off[2] = {0, N};
    const moe_groups g = one_group(off, lp, site);
    moe_mlp_forward_grouped(be, out, gu, act, x, row_scale, w1, w2, &g, H, F);
}

void moe_mlp_forward(const moe_backend *be, void *out, void *gu, void *act, const void *x,
                     const moe_real *row_scale, const void *w1, const void *w2, int N, int H,
                     int F) {
    moe_mlp_forward_lowp(be, out, gu, act, x, row_scale, w1, w2, N, H, F, NULL, 0);
}

void moe_mlp_backward_lowp(const moe_backend *be, void *dx, moe_real *dw1, moe_real *dw2,
                           moe_real *drow_scale, const void *dout, const void *x, const void *gu,
                           const void *act, const moe_real *row_scale, const void *w1,
                           const void *w2, void *ws_dh, void *ws_dgu, int N, int H, int F,
                           moe_lowp *lp, int site) {
    const int off[2] = {0, N};
    const moe_groups g = one_group(off, lp, site);
    moe_mlp_backward_grouped(be, dx, dw1, dw2, drow_scale, dout, x, gu, act, row_scale, w1, w2,
                             ws_dh, ws_dgu, &g, H, F, 1);
}

void moe_mlp_backward(const moe_backend *be, void *dx, moe_real *dw1, moe_real *dw2,
                      moe_real *drow_scale, const void *dout, const void *x, const void *gu,
                      const void *act, const moe_real *row_scale, const void *w1, const void *w2,
                      void *ws_dh, void *ws_dgu, int N, int H, int F) {
    moe_mlp_backward_lowp(be, dx, dw1, dw2, drow_scale, dout, x, gu, act, row_scale, w1, w2,
                          ws_dh, ws_dgu, N, H, F, NULL, 0);
}
