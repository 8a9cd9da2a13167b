/**
 * @file suites.h
 * @brief The Check suites of the unit-test binary and of the fp64 gradient-check binary.
 */
#ifndef MOE_TEST_SUITES_H
#define MOE_TEST_SUITES_H

#include <check.h>

/* unit tests (fp32 build) */
Suite *suite_core(void);      /* tests/test_core.c: rng, errors, metrics */
Suite *suite_data(void);      /* tests/test_data.c: tokenizer, data search, batches */
Suite *suite_config(void);    /* tests/test_config.c: flags, validation, named errors */
Suite *suite_router(void);    /* tests/test_router.c: router semantics, aux losses, expert bias */
Suite *suite_train(void);     /* tests/test_train.c: determinism, loss falls, trainer errors */
Suite *suite_checkpoint(void); /* tests/test_checkpoint.c: resume bit for bit (kill -9, SIGTERM),
                                  kill -9 during a save, corruption and mismatch errors */
Suite *suite_parallel(void);  /* tests/test_parallel.c: the parallel grid, bin/moe-grid, sharded
                                 parameters */
Suite *suite_fuzz(void);      /* tests/test_fuzz.c: thousands of random command lines: no crash,
                                 named errors, accepted sizes fit */
Suite *suite_reliability(void); /* tests/test_reliability.c: the examples of bad input from the reliability work, NaN stops the
                                   step, safe output files, memory estimate, out of memory */
Suite *suite_dispatch_plan(void); /* tests/test_dispatch_plan.c: the dispatch plan's arithmetic
                                     (chapter 02) */
Suite *suite_grouped(void);   /* tests/test_grouped.c: the CPU grouped GEMM (chapter 03) */
Suite *suite_sync_free(void); /* tests/test_sync_free.c: the budgeted permutation, the
                                 overflow protocol, capacity runs (chapter 06) */
Suite *suite_tile_schedule(void); /* tests/test_tile_schedule.c: the grouped GEMM's tile
                                     scheduler vs a brute-force enumeration (chapter 03) */
Suite *suite_graph(void);     /* tests/test_graph.c: --cuda-graph-scope and the capture helper
                                 on a mock backend (chapter 06) */
Suite *suite_vocab_merge(void); /* tests/test_vocab_merge.c: the vocabulary-parallel
                                   cross-entropy's merge of the shards (chapter 04) */
Suite *suite_cp_layout(void);   /* tests/test_cp_layout.c: context parallelism's chunk layout, ring
                                    schedule and log-sum-exp merge (chapter 07) */
Suite *suite_attention(void);  /* tests/test_attention.c: the CPU flash attention against the
                                 naive reference: shapes, chunks at offsets, the model (ch07) */
Suite *suite_step_scalars(void); /* tests/test_step_scalars.c: the step's scalars on the device,
                                    one wait per step, overflow re-run, non-finite skip (ch06) */
Suite *suite_fp8_wgrad(void); /* tests/test_fp8_wgrad.c: the FP8 wgrad's CPU twins vs their
                                 definitions, the emulated expert backward vs the twin */
Suite *suite_quant(void);     /* tests/test_quant.c: the FP8/FP4/E8M0 codecs exhaustively, every
                                 quantization recipe vs its definition, RHT, stochastic rounding
                                 (chapter 05) */

/* finite-difference gradient checks (fp64 build) */
Suite *suite_fd_ops(void);    /* tests/fd_ops.c: every op */
Suite *suite_fd_model(void);  /* tests/fd_model.c: MoE layer and whole model, every router variant */

/* CUDA tests (built when nvcc is found; run on a GPU machine): each CUDA op against its
 * CPU twin on fresh random inputs, then the whole model CUDA vs CPU */
Suite *suite_gpu_dense(void);     /* tests/gpu_dense.c: memory, matmul, norms, rope, swiglu, CE, optimizer */
Suite *suite_gpu_attention(void); /* tests/gpu_attention.c */
Suite *suite_gpu_moe(void);       /* tests/gpu_moe.c: router, aux/z losses, permutation */
Suite *suite_gpu_model(void);     /* tests/gpu_model.c: whole model CUDA vs CPU, 50 steps */
Suite *suite_gpu_grouped(void);   /* tests/gpu_grouped.c: cuBLAS grouped GEMM vs the loop */
Suite *suite_gpu_sync_free(void); /* tests/gpu_sync_free.c: the budgeted permutation vs its
                                     CPU twin, the overflow protocol on the GPU, capture */
Suite *suite_gpu_checkpoint(void); /* tests/gpu_checkpoint.c: kill -9, resume, the same losses
                                      bit for bit, through bin/moe-train --device cuda */
Suite *suite_gpu_graphs(void);    /* tests/gpu_graphs.c: no allocation after step 1; attn graphs
                                     replay == eager bit for bit; capture errors named */
Suite *suite_gpu_scalars(void);   /* tests/gpu_scalars.c: the step's scalar ops CUDA vs CPU, and
                                    a CUDA step's host waits counted (chapter 06) */
Suite *suite_gpu_quant(void);     /* tests/gpu_quant.c: every quantization recipe CUDA vs CPU,
                                     codes and scales byte for byte (chapter 05) */
Suite *suite_gpu_fp8_layer(void); /* tests/gpu_fp8_layer.c: the native FP8 expert layer vs the
                                     CPU's emulated recipe, its quantizers byte for byte */
Suite *suite_gpu_fp8_fused(void); /* tests/gpu_fp8_fused.c: the vectorized 1x128 quantizer and
                                     the fused SwiGLU quantize passes == the separate ones */
Suite *suite_gpu_fp8_wgrad(void); /* tests/gpu_fp8_wgrad.c: the FP8 wgrad's token-wise quantizer
                                     (byte for byte) and grouped GEMM vs their CPU twins */

/* MPI tests (CPU ranks under mpirun) */
Suite *suite_mpi_comm(void);      /* tests/mpi_comm.c: every collective of comm.h, any rank count */
Suite *suite_mpi_grid(void);      /* tests/mpi_grid.c: the grid's communicators match its groups */
Suite *suite_mpi_ep(void);        /* tests/mpi_ep.c: EP = any divisor of the ranks gives the
                                     single-process loss and gradients */
Suite *suite_mpi_checkpoint(void); /* tests/mpi_checkpoint.c: exact resume at EP = ranks, a
                                      checkpoint loaded into another folding, a missing file */
Suite *suite_mpi_delayed(void);   /* tests/mpi_delayed.c: delayed scaling on DP/EP ranks == one process (ch05) */
Suite *suite_mpi_dp(void);        /* tests/mpi_dp.c: the clipped global gradient norm of every
                                     folding is one process's; the distributed optimizer */
Suite *suite_mpi_etp(void);       /* tests/mpi_etp.c: ETP 2 (x EP 2, x TP 2 + SP) gives the
                                     single-process loss, gradients and weights; a mutant
                                     without the ETP reduction fails */
Suite *suite_mpi_fold8(void);     /* tests/mpi_etp.c: the 8-rank foldings (make test-mpi8) */
Suite *suite_mpi_cp(void);        /* tests/mpi_cp.c: context-parallel attention, p2p ring and
                                     all-gather, against one process (chapter 07) */
const struct moe_backend *moe_test_mpi_backend(void); /* the world's backend (mpi_main.c) */
Suite *suite_mpi_tp(void);        /* tests/mpi_tp.c: TP and TP+SP give the single-process loss,
                                     gradients and weights; the f/g operators (chapter 04) */
struct moe_comm;
/** The world the MPI runner (tests/mpi_main.c) started. */
struct moe_comm *moe_test_world(void);

/** Chapter 05's blockwise FP8 under a folding (attention TP @p tp, + SP if @p sp, experts EP
 *  @p ep, more in @p dist_flags) against one process (tests/mpi_tp.c): the first step's loss
 *  within 1e-5 relative on CPU ranks and 1e-3 on GPU ranks, every gradient tensor within
 *  1e-5 on CPU ranks and @p gpu_tol on GPU ranks (why so loose: at the definition). Prints
 *  one line on rank 0 naming @p what. Returns without checking where the world's size does
 *  not fit. */
void moe_test_fp8_folding(const char *model, int tp, int sp, int ep, const char *dist_flags,
                          double gpu_tol, const char *what);

/** A verdict every rank agrees on: count this rank's failures, sum over the world, then
 *  assert. A check that failed on one rank only would otherwise let that rank stop while
 *  the others wait in the next collective. */
#define MOE_TEST_AGREE(bad, ...)                                                            \
    do {                                                                                    \
        long long all_ = (bad);                                                             \
        moe_comm_host_all_reduce_sum(moe_test_world(), &all_, 1, MOE_DTYPE_I64);            \
        ck_assert_msg(all_ == 0, __VA_ARGS__);                                              \
    } while (0)

#endif
