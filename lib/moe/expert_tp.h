/**
 * @file expert_tp.h
 * @brief Expert tensor parallelism (ETP): each local expert's SwiGLU MLP split over the ranks
 *        of an ETP group, as Megatron splits it.
 *
 * An expert is a SwiGLU MLP of width F: gu = x·fc1ᵀ ([n, 2F]: gate | up), h = silu(gate)·up·w
 * (w the routing weight), y = h·fc2ᵀ ([n, H]). With ETP the F columns are split over the
 * group's ETP ranks, exactly as tensor parallelism splits a dense FFN (tensor_parallel.h):
 *
 *  - fc1 is **column-parallel**: rank j holds gate rows and up rows [j·F/ETP, (j+1)·F/ETP),
 *    so it computes its F/ETP columns of gate and of up, and its own slice of h, with no
 *    communication (SwiGLU is element-wise in F);
 *  - fc2 is **row-parallel**: rank j holds fc2's columns of the same slice, [H, F/ETP], and
 *    y_j = h_j·fc2_jᵀ is a partial sum: y = Σ_j y_j.
 *
 * The ranks of an ETP group must therefore see the *same* rows. They do not, after the
 * dispatch: every rank routes its own tokens and its EP group delivers them. So, as
 * Megatron's all-to-all dispatcher does after its all-to-all, the rows are gathered over the
 * ETP group before the experts and the partial outputs reduce-scattered after them:
 *
 *     rows at this rank (the dispatcher's, expert-major, R_j of them on rank j)
 *       -> all-gather over ETP (each rank's block padded to max_j R_j rows)
 *       -> sort the (rank, expert) chunks expert-major: expert e's rows of rank 0, rank 1, ...
 *       -> experts at width F/ETP on the Σ_j R_j rows: partial outputs
 *       -> unsort to (rank, expert) blocks, reduce-scatter over ETP: rank j gets Σ of the
 *          partial outputs of *its* rows, the whole expert output
 *
 * The backward is the mirror image: the output gradients are gathered (the gradient of a
 * reduce-scatter), the experts' backward runs on the gathered rows, and the partial input
 * gradients and routing-weight gradients (each a sum over F, of which a rank has its slice)
 * are reduce-scattered (the gradient of an all-gather). The weight gradients need nothing:
 * rank j's slice of fc1/fc2 saw every row of the group. Summed over EDP afterwards, they are
 * the gradient of the whole batch.
 *
 * The counts exchange is one host all-gather of G integers per layer and forward; the
 * backward reuses it. moe_etp_plan() does it; the gathers and scatters are moves of rows.
 */
#ifndef MOE_EXPERT_TP_H
#define MOE_EXPERT_TP_H

#include <stddef.h>

#include "backend.h"
#include "lowp.h"
#include "real.h"
#include "tensor_parallel.h"

/** What one MoE layer's forward saves of the ETP group's rows (grow-only buffers). */
typedef struct moe_etp_rows {
    int G;            /**< local experts */
    int *counts;      /**< host [ETP·G]: rank j's rows of local expert e at [j·G + e] */
    int *off;         /**< host [G+1]: expert e owns gathered rows [off[e], off[e+1]) */
    int pad;          /**< rows of each rank's block in the exchange: the largest rank's */
    size_t rows;      /**< gathered rows, off[G] */
    size_t cap;       /**< rows allocated below */
    int Fcap;         /**< the width F they were allocated for */
    void *x;          /**< [cap,H] the gathered inputs, or NULL where the experts keep their
                           token-wise FP8 copy instead (moe_etp_plan()'s keep_x_t) */
    moe_real *w;      /**< [cap] their routing weights */
    void *gu;         /**< [cap,2F] fc1 outputs (F = this rank's slice) */
    void *act;        /**< [cap,F] SwiGLU outputs × routing weight (cap rows of act_row bytes:
                           moe_etp_plan()) */
} moe_etp_rows;

/** Scratch of the gathered rows, shared by every MoE layer (grow-only). */
typedef struct moe_etp_work {
    size_t cap;       /**< rows allocated for y .. dgu */
    int Fcap;         /**< the width F they were allocated for */
    void *y;          /**< [cap,H] partial outputs; the partial input gradients in the backward */
    void *dy;         /**< [cap,H] gathered output gradients */
    moe_real *dw;     /**< [cap] partial routing-weight gradients */
    void *dh;         /**< [cap,F] backward scratch */
    void *dgu;        /**< [cap,2F] backward scratch */
    size_t stage;     /**< bytes of each staging buffer below */
    void *send;       /**< this rank's block, padded to pad rows */
    void *recv;       /**< every rank's block, padded */
} moe_etp_work;

/**
 * @brief Exchange the ETP group's row counts and size the gathered buffers (collective over
 *        @p etp): afterwards r->counts, r->off, r->pad and r->rows describe the gathered
 *        layout, and the buffers of @p r and @p w hold at least r->rows rows.
 * @param be backend @param etp the ETP group (size > 1) @param r the layer's saved rows
 * @param w the scratch @param off host [G+1]: this rank's expert offsets (the dispatcher's)
 * @param G local experts @param H hidden size @param F this rank's slice of the expert width
 * @param lp the low-precision context or NULL: r->act's size is moe_mlp_act_bytes() of the
 *        rows and G (F activation elements a row, or chapter 05's FP8 codes and scales)
 * @param keep_x_t 1: the experts keep the gathered inputs as their token-wise FP8 copy, after
 *        the SwiGLU output's in r->act (moe_groups::keep_x_t, moe_layer_keeps_x_t()); r->x is
 *        then not allocated, and the forward gathers the inputs into the scratch w->dy, free
 *        until the backward's output gradients (moe_etp_x())
 */
void moe_etp_plan(const moe_backend *be, const moe_tp *etp, moe_etp_rows *r, moe_etp_work *w,
                  const int *off, int G, int H, int F, const moe_lowp *lp, int keep_x_t);

/**
 * @brief Where the forward gathers the inputs: r->x where the layer keeps them for its
 *        backward, else the scratch w->dy (moe_etp_plan()'s keep_x_t).
 * @param r the layer's rows @param w the scratch @return [r->rows,H] activation rows
 */
void *moe_etp_x(const moe_etp_rows *r, const moe_etp_work *w);

/**
 * @brief All-gather rows over the ETP group, expert-major (collective): @p dst [r->rows, C]
 *        receives, for each expert e, its rows of rank 0, then of rank 1, ...
 * @param be backend @param etp group @param r the plan (moe_etp_plan) @param w scratch
 * @param dst gathered rows @param src this rank's rows, expert-major (counts[rank·G + e] of
 *        expert e) @param C elements per row
 * @param real 1: elements are ::moe_real (routing weights); 0: activations
 */
void moe_etp_gather(const moe_backend *be, const moe_tp *etp, const moe_etp_rows *r,
                    moe_etp_work *w, void *dst, const void *src, int C, int real);

/**
 * @brief Reduce-scatter gathered rows back to their ranks (collective): @p dst (this rank's
 *        rows, expert-major) = Σ over the ETP group of each rank's partial values of them.
 *        The adjoint of moe_etp_gather().
 * @param be backend @param etp group @param r the plan @param w scratch
 * @param dst this rank's rows @param src gathered partial rows [r->rows, C]
 * @param C elements per row @param real 1: ::moe_real elements; 0: activations
 */
void moe_etp_scatter(const moe_backend *be, const moe_tp *etp, const moe_etp_rows *r,
                     moe_etp_work *w, void *dst, const void *src, int C, int real);

/** @brief Free the saved rows. @param be backend @param r rows (zeroed) */
void moe_etp_rows_free(const moe_backend *be, moe_etp_rows *r);

/** @brief Free the scratch. @param be backend @param w scratch (zeroed) */
void moe_etp_work_free(const moe_backend *be, moe_etp_work *w);

#endif /* MOE_EXPERT_TP_H */
