/**
 * @file mlp.h
 * @brief The SwiGLU MLP: fc1 → SwiGLU → (optional per-row scale) → fc2.
 *
 * One function serves the dense FFN, the shared expert and every routed expert
 * (the naive MoE loop calls it once per expert on that expert's rows). For a
 * routed expert the per-row scale is the routing weight, applied after the
 * activation and before fc2 (as Megatron Core does): then combining expert outputs is a
 * plain sum, and the routing weight's gradient is Σ_f dh ⊙ silu(g)·u.
 *
 * The scale is fused into the SwiGLU ops (backend swiglu_forward / swiglu_backward):
 *   forward   gu = fc1(x);  act = silu(g)·u·s;  out = fc2(act)
 *   backward  dh = fc2ᵀ(dout);  dgu, ds = swiglu_backward(dh, gu, s);  dx = fc1ᵀ(dgu)
 * so the saved `act` holds the SCALED activation — exactly fc2's input, which fc2's
 * weight gradient reads as is — and no pass copies, scales or dots an [N,F] buffer.
 *
 * Weights: fc1 [2F, H] (gate rows first, then up rows), fc2 [H, F], given as the
 * backend's compute copy (activation type); their gradients are full precision.
 * Activations (`void *`) are in the backend's activation type.
 */
#ifndef MOE_MLP_H
#define MOE_MLP_H

#include "backend.h"
#include "lowp.h"

/** How the routed experts' GEMMs run: the ladder of chapters 01 and 03. */
typedef enum moe_expert_impl {
    MOE_EXPERTS_LOOP = 0, /**< one MLP (two GEMMs) per expert, sized on the host (chapter 01) */
    MOE_EXPERTS_CUBLAS,   /**< cublasGemmGroupedBatchedEx: one call per Linear, host sizes */
    MOE_EXPERTS_KERNEL    /**< our grouped kernel: one launch per GEMM, sizes read on device */
} moe_expert_impl;

/** The groups of a grouped MLP: group g owns rows [off[g], off[g+1]). */
typedef struct moe_groups {
    const int *off;       /**< HOST [G+1] offsets, off[0] = 0; NULL for ::MOE_EXPERTS_KERNEL
                               when the host does not know them (chapter 06's sync-free
                               layer: only dev_off and @ref rows exist) */
    const int *dev_off;   /**< the same in backend memory (read by ::MOE_EXPERTS_KERNEL) */
    int G;                /**< groups */
    moe_expert_impl impl; /**< ::MOE_EXPERTS_CUBLAS or ::MOE_EXPERTS_KERNEL */
    moe_dw_mode dw_mode;  /**< how the backward writes dw1, dw2 (::MOE_DW_ACT: our kernel only) */
    /** the fused permutation (::MOE_EXPERTS_KERNEL only; NULL: none): fc1's input row r is
     *  row gather[r] / gather_div of the x passed in (backend memory [off[G]]), so x is the
     *  token buffer itself and no permuted copy of it exists */
    const int *gather;
    int gather_div;       /**< see @ref gather (the top-k) */
    int rows;             /**< rows of the buffers = off[G] where @ref off is known; with only
                               dev_off, the static row count the kernels are sized for (the
                               groups end at dev_off[G] <= rows) */
    /** chapter 05's emulated low precision (lowp.h): both GEMMs' inputs and output
     *  gradients go through its QDQ; NULL or off: as before */
    moe_lowp *lowp;
    /** chapter 05's native FP8 path (lowp.h): fc1's and fc2's FP8 codes; when given (both,
     *  with @ref lowp on, ::MOE_EXPERTS_KERNEL, no gather, the input gradient overwritten)
     *  the forward and dgrad GEMMs run in our FP8 grouped kernel; NULL: emulated */
    const moe_fp8_weight *fp8_w1;
    const moe_fp8_weight *fp8_w2; /**< see @ref fp8_w1 */
    /** fc1's linear index in @ref lowp's site table (moe_lowp_site(); fc2 is the next),
     *  under delayed scaling: the grouped GEMMs quantize all the groups' rows as one tensor,
     *  at the first expert's sites */
    int lowp_site;
    /** chapter 05's FP8 dispatch (moe_dispatch_rows_fp8()): 1 when fc1's input rows hold
     *  already the dequantized values of their 1×128 quantization (the all-to-all moved
     *  codes and scales), so fc1 quantizes nothing again, forward or backward */
    int x_quantized;
    /** with @ref x_quantized on the native path: those codes [rows, I] and scales
     *  [rows][I/128] in backend memory, read by fc1's FP8 GEMM as they are; NULL: the
     *  native path quantizes the dequantized rows again (the same codes) */
    const uint8_t *xq;
    const float *xs; /**< see @ref xq */
    /** the fused permutation's other half (::MOE_EXPERTS_KERNEL only; NULL: none): fc2's
     *  output row r is stored at row scatter[r] of the out passed in (backend memory
     *  [off[G]]: the permutation's perm_src, so out is in token-slot order, n·k + j, and
     *  needs as many rows as the slots). The backward is unchanged: it never reads out */
    const int *scatter;
    /** chapter 05's native FP8 dense linears (lowp.h, "Native FP8 dense linears"): a single
     *  MLP's (one group, host offsets: the dense FFN, the shared expert) [2] fc1's and fc2's
     *  FP8 codes, made once per step; NULL: emulated. Apart from @ref fp8_w1, which only the
     *  routed experts' grouped kernel runs */
    const moe_fp8_weight *dense_fp8;
    /** chapter 05, the token-wise saved form (moe_mlp_saved_form() is
     *  ::MOE_MLP_SAVED_FP8_TOKEN, so the fused passes run): 1 when the forward also keeps fc1's
     *  input x for the backward as its token-wise FP8 copy, the operand fc1's FP8 wgrad
     *  reads, after the SwiGLU output's in `act` (which is then moe_mlp_act_bytes() with
     *  x_width = H). The backward reads that copy and never x, so the caller need not keep x:
     *  the rows become scratch (moe_layer_keeps_x_t()) */
    int keep_x_t;
} moe_groups;

/**
 * @brief The groups of a single MLP: one group of @p off[1] rows, run by the backend's
 *        plain matmul (what moe_mlp_forward_lowp() runs on).
 * @param off [2] {0, rows} (kept by pointer: it must outlive the groups)
 * @param lp chapter 05's context or NULL  @param site fc1's linear index (moe_lowp_site())
 * @return the groups
 */
moe_groups moe_groups_single(const int *off, moe_lowp *lp, int site);

/**
 * @brief Forward.
 * @param be backend  @param out [N,H] output (overwritten)  @param gu [N,2F] saved fc1 output
 * @param act [N,F] saved SwiGLU output, already multiplied by @p row_scale (fc2's input)
 * @param x [N,H] input  @param row_scale [N] or NULL  @param w1 fc1  @param w2 fc2
 * @param N rows  @param H hidden  @param F intermediate
 */
void moe_mlp_forward(const moe_backend *be, void *out, void *gu, void *act, const void *x,
                     const moe_real *row_scale, const void *w1, const void *w2, int N, int H,
                     int F);

/**
 * @brief Backward (all gradients accumulate).
 * @param be backend  @param dx [N,H]  @param dw1 [2F,H]  @param dw2 [H,F]
 * @param drow_scale [N] (NULL when there is no row scale)  @param dout [N,H]
 * @param x forward input  @param gu saved  @param act saved  @param row_scale as in forward
 * @param w1 fc1  @param w2 fc2  @param ws_dh [N,F] scratch  @param ws_dgu [N,2F] scratch
 * @param N rows  @param H hidden  @param F intermediate
 */
void moe_mlp_backward(const moe_backend *be, void *dx, moe_real *dw1, moe_real *dw2,
                      moe_real *drow_scale, const void *dout, const void *x, const void *gu,
                      const void *act, const moe_real *row_scale, const void *w1, const void *w2,
                      void *ws_dh, void *ws_dgu, int N, int H, int F);

/**
 * @brief moe_mlp_forward() with chapter 05's emulated low precision (lowp.h).
 * @param be backend  @param out [N,H] output  @param gu [N,2F] saved fc1 output
 * @param act [N,F] saved SwiGLU output  @param x [N,H] input  @param row_scale [N] or NULL
 * @param w1 fc1 (already quantized: the model's compute copy)  @param w2 fc2 (likewise)
 * @param N rows  @param H hidden  @param F intermediate  @param lp the context (NULL: none)
 * @param site fc1's linear index in @p lp's site table (moe_lowp_site(); fc2 is the next)
 * @param fp8 [2] fc1's and fc2's FP8 codes for the native dense path (lowp.h, "Native FP8
 *        dense linears"; each runs where moe_lowp_dense_fits()), or NULL: emulated
 */
void moe_mlp_forward_lowp(const moe_backend *be, void *out, void *gu, void *act, const void *x,
                          const moe_real *row_scale, const void *w1, const void *w2, int N,
                          int H, int F, moe_lowp *lp, int site, const moe_fp8_weight *fp8);

/**
 * @brief moe_mlp_backward() with chapter 05's emulated low precision (lowp.h).
 * @param be backend  @param dx [N,H]  @param dw1 [2F,H]  @param dw2 [H,F]
 * @param drow_scale [N] or NULL  @param dout [N,H]  @param x forward input  @param gu saved
 * @param act saved  @param row_scale as in forward  @param w1 fc1  @param w2 fc2
 * @param ws_dh [N,F] scratch  @param ws_dgu [N,2F] scratch  @param N rows  @param H hidden
 * @param F intermediate  @param lp the context (NULL: none)  @param site as the forward's
 * @param fp8 as the forward's
 */
void moe_mlp_backward_lowp(const moe_backend *be, void *dx, moe_real *dw1, moe_real *dw2,
                           moe_real *drow_scale, const void *dout, const void *x, const void *gu,
                           const void *act, const moe_real *row_scale, const void *w1,
                           const void *w2, void *ws_dh, void *ws_dgu, int N, int H, int F,
                           moe_lowp *lp, int site, const moe_fp8_weight *fp8);

/**
 * @brief Whether chapter 05's native FP8 experts run with their quantization fused into the
 *        SwiGLU passes (lib/mlp.c, "native FP8 layer with its passes fused"): the groups
 *        carry FP8 weights (grp->fp8_w1, fp8_w2) and grp->lowp is native with the fused
 *        switch latched on and the backend has the fused ops (moe_mlp_saved_form()'s
 *        condition for FP8). Then moe_mlp_forward_grouped() keeps in @p act the
 *        SwiGLU output as moe_mlp_saved_form() says (FP8 codes, or under the FP8 wgrad
 *        without the tiled forward its bf16 values, written next to fc2's codes), and
 *        moe_mlp_backward_grouped() reads them so.
 * @param be backend  @param grp the groups
 * @return 1 when fused
 */
int moe_mlp_fp8_fused(const moe_backend *be, const moe_groups *grp);

/** How the routed experts keep their SwiGLU output for the backward (the `act` buffer). */
typedef enum moe_mlp_saved {
    MOE_MLP_SAVED_ACT = 0,  /**< the output itself: rows·F activation elements */
    MOE_MLP_SAVED_FP8_ROW,  /**< its 1×128 FP8 codes and scales along F (the fused passes with
                                 the bf16 wgrad, `MOE_FP8_WGRAD=0`): moe_mlp_fp8_act_bytes() */
    MOE_MLP_SAVED_FP8_TOKEN /**< its token-wise FP8 copy, the operand of fc2's FP8 wgrad
                                 (lib/fp8_wgrad.h; the fused passes under the FP8 wgrad with
                                 `MOE_FP8_SAVE_T` not 0): moe_mlp_fp8_act_t_bytes() */
} moe_mlp_saved;

/**
 * @brief How the routed experts of a context keep their SwiGLU output for the backward. FP8
 *        (either form) needs the fused passes: the native path on (@p lp->native: the FP8
 *        weights were made), `MOE_FP8_FUSED` not 0 when the context was made
 *        (@p lp->fp8_fused, latched: the buffers are sized from it) and the backend's fused
 *        ops. Without the FP8 wgrad the row-wise codes that fc2's forward reads are kept;
 *        under it (@p lp->fp8_wgrad) the token-wise copy that fc2's wgrad reads, written by
 *        the tiled SwiGLU forward (@p lp->fp8_save_t and the backend's op), else the bf16
 *        output (the backward's token-wise quantizer reads it). The one rule behind the
 *        buffers' size (moe_mlp_act_bytes()) and the passes that write and read them.
 * @param be backend  @param lp the context (NULL: ::MOE_MLP_SAVED_ACT)
 * @return the form
 */
moe_mlp_saved moe_mlp_saved_form(const moe_backend *be, const moe_lowp *lp);

/**
 * @brief moe_mlp_saved_form()'s rule on its three conditions, for callers that have no
 *        backend yet (the memory estimate, lib/memory.c, decides from the flags alone).
 * @param fused_passes the fused passes run (moe_mlp_saved_form(): the native path, the
 *        latched switch, the backend's ops)
 * @param fp8_wgrad the FP8 wgrad is on (@p lp->fp8_wgrad)
 * @param tiled_forward the tiled SwiGLU forward writes the token-wise copy (@p lp->fp8_save_t
 *        and the backend's op)
 * @return the form
 */
moe_mlp_saved moe_mlp_saved_form_of(int fused_passes, int fp8_wgrad, int tiled_forward);

/**
 * @brief Whether the saved SwiGLU outputs are FP8 (either form of moe_mlp_saved_form()).
 * @param be backend  @param lp the context (NULL: 0)
 * @return 1 when the saved SwiGLU outputs are FP8 codes
 */
int moe_mlp_fp8_saves_codes(const moe_backend *be, const moe_lowp *lp);

/**
 * @brief Bytes of @p rows rows of the SwiGLU output kept as row-wise FP8 codes: the codes
 *        [rows, F], then the fp32 scales [rows][F/128] (F + F/32 bytes a row, against 2F in
 *        bf16).
 * @param rows rows  @param F width (a multiple of 128 on the native path)
 * @return bytes
 */
size_t moe_mlp_fp8_act_bytes(size_t rows, int F);

/**
 * @brief Bytes of the SwiGLU output of @p rows rows in @p G groups kept as its token-wise
 *        FP8 copy: the codes [F][Kpad], then the fp32 scales [Kpad/128][F], with Kpad =
 *        moe_fp8_wgrad_kpad(rows, G) (each group's tokens padded to 128): F·Kpad·(1 + 1/32)
 *        bytes, against 2·rows·F in bf16.
 * @param rows rows  @param G groups  @param F width (a multiple of 128)
 * @return bytes
 */
size_t moe_mlp_fp8_act_t_bytes(size_t rows, int G, int F);

/**
 * @brief Bytes of a routed experts' `act` buffer (the SwiGLU output kept for the backward)
 *        of @p rows rows in at most @p G groups, in moe_mlp_saved_form()'s form; in the
 *        token-wise form, with @p x_width > 0, followed by the token-wise copy of fc1's input
 *        of that width (moe_groups::keep_x_t: moe_mlp_fp8_act_t_bytes() of each). Every
 *        allocation of such a buffer (moe/layer.c, moe/experts.c, moe/expert_tp.c, the tests)
 *        takes its size from here.
 * @param be backend  @param lp the context (NULL: none)  @param rows rows
 * @param G groups (local experts)  @param F width
 * @param x_width the hidden size H where the groups keep x's copy (moe_groups::keep_x_t),
 *        else 0 (ignored outside the token-wise form)
 * @return bytes
 */
size_t moe_mlp_act_bytes(const moe_backend *be, const moe_lowp *lp, size_t rows, int G, int F,
                         int x_width);

/**
 * @brief Forward of G MLPs at once (chapter 03): MLP g (weights g of the stacked w1
 *        [G,2F,H] and w2 [G,H,F]) runs on rows [off[g], off[g+1]) of every buffer, through
 *        the backend's grouped matmul — one GEMM call for all experts instead of one each.
 * @param be backend  @param out [N,H]  @param gu [N,2F]  @param act [N,F] (scaled, as in
 *        moe_mlp_forward), or under moe_mlp_fp8_saves_codes() its FP8 codes and scales
 *        (moe_mlp_act_bytes() of N rows and grp->G groups; with grp->keep_x_t, x's token-wise
 *        copy too)
 * @param x [N,H], or the token rows grp->gather picks from  @param row_scale [N] or NULL
 * @param w1 stacked fc1  @param w2 stacked fc2
 * @param grp the groups (N = off[G]) and which grouped GEMM runs them
 * @param H hidden  @param F intermediate
 */
void moe_mlp_forward_grouped(const moe_backend *be, void *out, void *gu, void *act,
                             const void *x, const moe_real *row_scale, const void *w1,
                             const void *w2, const moe_groups *grp, int H, int F);

/**
 * @brief Backward of moe_mlp_forward_grouped (weight and row-scale gradients accumulate;
 *        dw1/dw2 stacked).
 * @param be backend  @param dx [N,H]  @param dw1 [G,2F,H]  @param dw2 [G,H,F]
 * @param drow_scale [N] or NULL  @param dout [N,H]
 * @param x input (not read, and may be NULL, with grp->keep_x_t: `act` holds its copy)
 * @param gu saved  @param act saved  @param row_scale as in forward  @param w1 fc1  @param w2 fc2
 * @param ws_dh [N,F] scratch  @param ws_dgu [N,2F] scratch  @param grp as in forward
 * @param H hidden  @param F intermediate
 * @param dx_accumulate 1: dx += the input gradient; 0: dx = it (a fresh buffer: saves
 *        zeroing it first)
 */
void moe_mlp_backward_grouped(const moe_backend *be, void *dx, moe_real *dw1, moe_real *dw2,
                              moe_real *drow_scale, const void *dout, const void *x,
                              const void *gu, const void *act, const moe_real *row_scale,
                              const void *w1, const void *w2, void *ws_dh, void *ws_dgu,
                              const moe_groups *grp, int H, int F, int dx_accumulate);

#endif /* MOE_MLP_H */
