/**
 * @file tensor_parallel.h
 * @brief Megatron's tensor-parallel operators: the conjugate pair f / g, and their
 *        sequence-parallel versions, on a tensor-parallel group.
 *
 * Tensor parallelism (TP) splits a block's two matrices over the ranks of a TP group:
 * the first one by output columns (**column-parallel**: QKV, fc1; each rank computes its
 * heads, its slice of the intermediate width), the second by input rows (**row-parallel**:
 * the output projection, fc2; each rank produces a partial sum of the whole output).
 * Two operators glue the block into the replicated model around it:
 *
 *     f  before the column-parallel GEMM:  forward identity,   backward all-reduce
 *     g  after the row-parallel GEMM:      forward all-reduce, backward identity
 *
 * f and g are conjugate: each one's backward is the other's forward. f's backward sums
 * the input gradients that the ranks' column shards contributed; g's forward sums the
 * partial outputs of the row shards. One all-reduce per block each way.
 *
 * **Sequence parallelism** (SP) removes the redundancy that remains: without it every TP
 * rank runs the norms and residual adds on all N tokens. With SP each rank holds N/TP
 * consecutive rows (tokens) of the residual stream, and the pair becomes
 *
 *     gather   before the column-parallel GEMM: forward all-gather,     backward reduce-scatter
 *     scatter  after the row-parallel GEMM:     forward reduce-scatter, backward all-gather
 *
 * An all-reduce is a reduce-scatter followed by an all-gather, so each gather/scatter pair
 * moves what plain TP's all-reduce does; but the backward gathers each block's input a
 * second time (it was not kept whole), so SP moves somewhat more bytes than plain TP (the
 * bytes model of chapter 04 counts them) and keeps 1/TP of the activations between blocks.
 *
 * moe_tp_enter_*() and moe_tp_exit_*() pick f/g or their SP versions from the group, so
 * the model writes one block for TP 1, TP and TP+SP. Every collective goes through comm.h:
 * MPI on CPU ranks, NCCL on GPU ranks. Rows are rank-major: rank r's shard of an [N,C]
 * buffer is rows [r·N/TP, (r+1)·N/TP).
 */
#ifndef MOE_TENSOR_PARALLEL_H
#define MOE_TENSOR_PARALLEL_H

#include <stddef.h>

#include "backend.h"

struct moe_comm;

/** A tensor-parallel group as the model sees it. */
typedef struct moe_tp {
    struct moe_comm *comm; /**< the TP group (NULL: TP 1, every operator is the identity) */
    int size;              /**< ranks in the group (1 without TP) */
    int rank;              /**< this rank's position */
    int sp;                /**< 1: sequence parallel (each rank holds N/size rows) */
} moe_tp;

/** @brief The TP group of one rank: no split. @return {NULL, 1, 0, 0} */
moe_tp moe_tp_none(void);

/** @brief Rows of the residual stream this rank holds for N tokens: N/size under SP, else N.
 *  @param tp group (NULL: TP 1) @param N tokens @return local rows */
int moe_tp_local_rows(const moe_tp *tp, int N);

/** @brief The first of this rank's rows (0 without SP). @param tp group (NULL: TP 1)
 *  @param N tokens @return row index */
int moe_tp_first_row(const moe_tp *tp, int N);

/** @brief f forward: the identity (every rank already holds the whole input).
 *  @param tp group @param x input @return x */
const void *moe_tp_f_forward(const moe_tp *tp, const void *x);

/** @brief f backward: all-reduce the input gradient (each rank's column shard contributed a
 *  partial sum). @param be backend @param tp group @param dx [n] in place @param n elements */
void moe_tp_f_backward(const moe_backend *be, const moe_tp *tp, void *dx, size_t n);

/** @brief g forward: all-reduce the row-parallel GEMM's partial outputs.
 *  @param be backend @param tp group @param y [n] in place @param n elements */
void moe_tp_g_forward(const moe_backend *be, const moe_tp *tp, void *y, size_t n);

/** @brief g backward: the identity (the output gradient is whole on every rank).
 *  @param tp group @param dy output gradient @return dy */
const void *moe_tp_g_backward(const moe_tp *tp, const void *dy);

/** @brief SP gather forward: all-gather the row shards. @param be backend @param tp group
 *  @param full [size·rows, C] out @param shard [rows, C] @param rows local rows @param C width */
void moe_tp_sp_gather_forward(const moe_backend *be, const moe_tp *tp, void *full,
                              const void *shard, int rows, int C);

/** @brief SP gather backward: reduce-scatter the whole-input gradient into this rank's rows.
 *  @param be backend @param tp group @param dshard [rows, C] (overwritten)
 *  @param dfull [size·rows, C] partial sums @param rows local rows @param C width */
void moe_tp_sp_gather_backward(const moe_backend *be, const moe_tp *tp, void *dshard,
                               const void *dfull, int rows, int C);

/** @brief SP scatter forward: reduce-scatter the partial outputs into this rank's rows.
 *  @param be backend @param tp group @param shard [rows, C] (overwritten)
 *  @param full [size·rows, C] partial sums @param rows local rows @param C width */
void moe_tp_sp_scatter_forward(const moe_backend *be, const moe_tp *tp, void *shard,
                               const void *full, int rows, int C);

/** @brief SP scatter backward: all-gather the output gradient's row shards.
 *  @param be backend @param tp group @param dfull [size·rows, C] out
 *  @param dshard [rows, C] @param rows local rows @param C width */
void moe_tp_sp_scatter_backward(const moe_backend *be, const moe_tp *tp, void *dfull,
                                const void *dshard, int rows, int C);

/**
 * @brief Before a column-parallel GEMM: the whole input [N,C] the GEMM reads. Under SP the
 *        rows are all-gathered into @p full; otherwise f (the input itself).
 * @param be backend @param tp group (NULL: TP 1) @param full [N,C] scratch (SP only)
 * @param x this rank's input rows @param N tokens @param C width @return the whole input
 */
const void *moe_tp_enter_forward(const moe_backend *be, const moe_tp *tp, void *full,
                                 const void *x, int N, int C);

/**
 * @brief Backward of moe_tp_enter_forward: @p dfull holds this rank's partial gradient of
 *        the whole input. Under SP it is reduce-scattered into @p dx (overwritten); otherwise
 *        all-reduced in place, and then @p dfull must be @p dx.
 * @param be backend @param tp group @param dx this rank's input-gradient rows
 * @param dfull [N,C] partial gradient @param N tokens @param C width
 */
void moe_tp_enter_backward(const moe_backend *be, const moe_tp *tp, void *dx, void *dfull,
                           int N, int C);

/**
 * @brief After a row-parallel GEMM whose partial output [N,C] is in @p partial: under SP,
 *        reduce-scatter it into @p y (this rank's rows); otherwise g, an all-reduce in
 *        place, and then @p partial must be @p y.
 * @param be backend @param tp group @param y this rank's output rows
 * @param partial [N,C] partial sums @param N tokens @param C width
 */
void moe_tp_exit_forward(const moe_backend *be, const moe_tp *tp, void *y, void *partial, int N,
                         int C);

/**
 * @brief Backward of moe_tp_exit_forward: the whole output gradient the row-parallel GEMM's
 *        backward reads. Under SP the rows of @p dy are all-gathered into @p full; otherwise
 *        g's backward (@p dy itself).
 * @param be backend @param tp group @param full [N,C] scratch (SP only)
 * @param dy this rank's output-gradient rows @param N tokens @param C width
 * @return the whole output gradient
 */
const void *moe_tp_exit_backward(const moe_backend *be, const moe_tp *tp, void *full,
                                 const void *dy, int N, int C);

#endif /* MOE_TENSOR_PARALLEL_H */
