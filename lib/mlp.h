/**
 * @file mlp.h
 * @brief The SwiGLU MLP: fc1 → SwiGLU → (optional per-row scale) → fc2.
 *
 * One function serves the dense FFN, the shared expert and every routed expert
 * (the naive MoE loop calls it once per expert on that expert's rows). For a
 * routed expert the per-row scale is the routing weight, applied after the
 * activation and before fc2 (BRIEF §6): then combining expert outputs is a
 * plain sum, and the routing weight's gradient is Σ_f dh ⊙ act.
 *
 * Weights: fc1 [2F, H] (gate rows first, then up rows), fc2 [H, F], given as the
 * backend's compute copy (activation type); their gradients are full precision.
 * Activations (`void *`) are in the backend's activation type.
 */
#ifndef MOE_MLP_H
#define MOE_MLP_H

#include "backend.h"

/**
 * @brief Forward.
 * @param be backend  @param out [N,H] output (overwritten)  @param gu [N,2F] saved fc1 output
 * @param act [N,F] saved SwiGLU output  @param h [N,F] scratch for the scaled activation
 *        (unused when @p row_scale is NULL)
 * @param x [N,H] input  @param row_scale [N] or NULL  @param w1 fc1  @param w2 fc2
 * @param N rows  @param H hidden  @param F intermediate
 */
void moe_mlp_forward(const moe_backend *be, void *out, void *gu, void *act, void *h, const void *x,
                     const moe_real *row_scale, const void *w1, const void *w2, int N, int H,
                     int F);

/**
 * @brief Backward (all gradients accumulate).
 * @param be backend  @param dx [N,H]  @param dw1 [2F,H]  @param dw2 [H,F]
 * @param drow_scale [N] (NULL when there is no row scale)  @param dout [N,H]
 * @param x forward input  @param gu saved  @param act saved  @param row_scale as in forward
 * @param w1 fc1  @param w2 fc2  @param ws_h [N,F] scratch  @param ws_dh [N,F] scratch
 * @param ws_dgu [N,2F] scratch  @param N rows  @param H hidden  @param F intermediate
 */
void moe_mlp_backward(const moe_backend *be, void *dx, moe_real *dw1, moe_real *dw2,
                      moe_real *drow_scale, const void *dout, const void *x, const void *gu,
                      const void *act, const moe_real *row_scale, const void *w1, const void *w2,
                      void *ws_h, void *ws_dh, void *ws_dgu, int N, int H, int F);

/**
 * @brief Forward of G MLPs at once (chapter 03): MLP g (weights g of the stacked w1
 *        [G,2F,H] and w2 [G,H,F]) runs on rows [off[g], off[g+1]) of every buffer, through
 *        the backend's grouped matmul — one GEMM call for all experts instead of one each.
 * @param be backend  @param out [N,H]  @param gu [N,2F]  @param act [N,F]  @param h [N,F] scratch
 * @param x [N,H]  @param row_scale [N] or NULL  @param w1 stacked fc1  @param w2 stacked fc2
 * @param off HOST [G+1] row offsets, off[0] = 0, N = off[G]  @param G groups
 * @param H hidden  @param F intermediate
 */
void moe_mlp_forward_grouped(const moe_backend *be, void *out, void *gu, void *act, void *h,
                             const void *x, const moe_real *row_scale, const void *w1,
                             const void *w2, const int *off, int G, int H, int F);

/**
 * @brief Backward of moe_mlp_forward_grouped (gradients accumulate; dw1/dw2 stacked).
 * @param be backend  @param dx [N,H]  @param dw1 [G,2F,H]  @param dw2 [G,H,F]
 * @param drow_scale [N] or NULL  @param dout [N,H]  @param x input  @param gu saved
 * @param act saved  @param row_scale as in forward  @param w1 fc1  @param w2 fc2
 * @param ws_h [N,F]  @param ws_dh [N,F]  @param ws_dgu [N,2F]  @param off HOST [G+1]
 * @param G groups  @param H hidden  @param F intermediate
 */
void moe_mlp_backward_grouped(const moe_backend *be, void *dx, moe_real *dw1, moe_real *dw2,
                              moe_real *drow_scale, const void *dout, const void *x,
                              const void *gu, const void *act, const moe_real *row_scale,
                              const void *w1, const void *w2, void *ws_h, void *ws_dh,
                              void *ws_dgu, const int *off, int G, int H, int F);

#endif /* MOE_MLP_H */
