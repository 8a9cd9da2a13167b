/**
 * @file cuda_ops.h
 * @brief The CUDA backend's launchers: plain C functions (`extern "C"`) with exactly the
 *        signatures of the op table in lib/backend.h, on device pointers.
 *
 * Activations (`void *`) are bf16; `moe_real *` buffers are fp32 (master weights,
 * gradients, statistics, losses, routing weights). Every launcher enqueues work on
 * moe_cuda_stream() and returns without waiting, except where it returns a value to
 * the host (the loss values, permute_index's host offsets), which synchronises.
 * No launcher uses floating-point atomics: results are identical run to run.
 */
#ifndef MOE_CUDA_OPS_H
#define MOE_CUDA_OPS_H

#include <stddef.h>

#include "backend.h"
#include "fp8_gemm.h"
#include "quantize.h"

#ifdef __cplusplus
extern "C" {
#endif

/* moe_cuda_available() and moe_backend_cuda() are declared in lib/backend.h: the library
 * defines the interface, this backend implements it. */

/* memory and precision (kernels/memory.cu) */
void *moe_cuda_alloc(size_t bytes);
void moe_cuda_free(void *p);
void moe_cuda_zero(void *p, size_t bytes);
void moe_cuda_copy(void *dst, const void *src, size_t bytes);
void moe_cuda_to_host(void *dst, const void *src, size_t bytes);
void moe_cuda_from_host(void *dst, const void *src, size_t bytes);
void moe_cuda_read_act(moe_real *host, const void *src, size_t n);
void moe_cuda_write_act(void *dst, const moe_real *host, size_t n);
void moe_cuda_cast_to_act(void *dst, const moe_real *src, size_t n);
void moe_cuda_synchronize(void);
void moe_cuda_device_name(char *buf, size_t cap);
double moe_cuda_peak_tflops(void);
size_t moe_cuda_memory_bytes(void);
void moe_cuda_timer_begin(void);
double moe_cuda_timer_end_ms(void);
void moe_cuda_fill_normal(moe_real *x, size_t n, unsigned long long seed,
                          unsigned long long stream, double std);
/** cudaMalloc and cudaFree calls since the start (memory.cu makes every one of them), for
 *  the arena test and the benchmark. @param mallocs receives  @param frees receives */
void moe_cuda_alloc_counts(long long *mallocs, long long *frees);

/* CUDA graph capture (kernels/graph.cu): the op table's graph slots */
void moe_cuda_graph_begin(void);
void *moe_cuda_graph_end(char *why, size_t cap);
int moe_cuda_graph_launch(void *g);
void moe_cuda_graph_free(void *g);
size_t moe_cuda_graph_nodes(const void *g);

/** What the GPU ran between moe_cuda_trace_begin() and moe_cuda_trace_end() (CUPTI's
 *  activity records, kernels/trace.cu; chapter 06's benchmark). */
typedef struct moe_cuda_trace {
    long long kernels;       /**< kernels run */
    long long graph_kernels; /**< of which launched as nodes of a CUDA graph */
    long long copies;        /**< memsets and copies run */
    long long graph_copies;  /**< of which graph nodes */
    double busy_ms;          /**< the union of their [start, end) intervals: time the GPU
                                  was doing something */
} moe_cuda_trace;
/** Start recording (0 and a reason in @p why when CUPTI cannot). */
int moe_cuda_trace_begin(char *why, size_t cap);
/** Stop recording, after the work has finished, and summarise it into @p out. */
void moe_cuda_trace_end(moe_cuda_trace *out);
/** After moe_cuda_trace_end(): print the @p top kernels by GPU time, per step of @p steps
 *  traced steps, as a markdown table (kernel times summed, so overlap counts twice). */
void moe_cuda_trace_print_top(FILE *f, int top, int steps);

/* dense ops */
void moe_cuda_matmul_forward(void *out, const void *in, const void *w, int N, int I, int O);
void moe_cuda_matmul_backward(void *din, moe_real *dw, const void *dout, const void *in,
                              const void *w, int N, int I, int O);
void moe_cuda_grouped_matmul_forward(void *out, const void *in, const void *w, const int *off,
                                     int G, int I, int O);
void moe_cuda_grouped_matmul_backward(void *din, moe_real *dw, const void *dout, const void *in,
                                      const void *w, const int *off, int G, int I, int O);
/* chapter 03's own sm_90a grouped GEMM (kernels/grouped_gemm_sm90.cu): offsets in device memory */
int moe_cuda_grouped_sm90_available(void);
void moe_cuda_grouped_sm90_forward(void *out, const void *in, const void *w, const int *dev_off,
                                   int G, int rows, int I, int O);
void moe_cuda_grouped_sm90_backward(void *din, void *dw, const void *dout, const void *in,
                                    const void *w, const int *dev_off, int G, int rows, int I,
                                    int O, int din_accumulate, moe_dw_mode dw_mode);
/* the same with the fused permutation: the input's row r is row map[r] / div of x */
void moe_cuda_grouped_sm90_forward_gather(void *out, const void *x, const int *map, int div,
                                          const void *w, const int *dev_off, int G, int rows,
                                          int I, int O);
void moe_cuda_grouped_sm90_backward_gather(void *din, void *dw, const void *dout, const void *x,
                                           const int *map, int div, const void *w,
                                           const int *dev_off, int G, int rows, int I, int O,
                                           int din_accumulate, moe_dw_mode dw_mode);
/* the forward whose output row r is stored at row map[r] of out (the fused permutation's fc2:
 * map = perm_src, so out is in token-slot order, row n·k + j) */
void moe_cuda_grouped_sm90_forward_scatter(void *out, const void *in, const int *map,
                                           const void *w, const int *dev_off, int G, int rows,
                                           int I, int O);
/* how many chunks the sm_90a wgrad splits each group's rows into for this shape (1 = no
 * split), from host-known sizes only: for tests and benchmarks to report */
int moe_cuda_grouped_sm90_wgrad_split(int G, int rows, int I, int O);
/* the forward/dgrad tile schedule of the kernel above (process-wide, not thread-safe):
 * how a group's last <= 64 rows are computed — in a 128 x 256 tile, in a 64 x 256 tile
 * (tail64), together with the 128 rows before them in 192 x 128 tiles that share the
 * weight block (share192), or transposed, out^T = W x^T with the rows as wgmma's N of 16,
 * 32 or 64 (swaptail) — and whether the CTAs claim tiles in order from a device
 * counter (dynamic) instead of CTA b taking tiles b, b + grid, ... (static). Chosen by
 * moe_cuda_grouped_sm90_set_schedule (tests, the chapter 03 benchmark), else by the
 * environment, MOE_GROUPED_SCHEDULE=static|static-tail64|dynamic|dynamic-tail64|
 * static-share192|dynamic-share192|static-swaptail|dynamic-swaptail|static-mc2 (the names of
 * moe_cuda_grouped_sm90_schedule_name), else the default */
typedef enum moe_grouped_schedule {
    MOE_GROUPED_SCHED_STATIC = 0,         /* 128-row tiles, CTA b takes b, b + grid, ... */
    MOE_GROUPED_SCHED_STATIC_TAIL64 = 1,  /* ... with 64-row tiles for short last tiles */
    MOE_GROUPED_SCHED_DYNAMIC = 2,        /* 128-row tiles, claimed in order */
    MOE_GROUPED_SCHED_DYNAMIC_TAIL64 = 3, /* both */
    MOE_GROUPED_SCHED_STATIC_SHARE192 = 4,  /* 128-row tiles, but a group's last 128 + (1..64)
                                               rows in 192 x 128 tiles (tail-sharing) */
    MOE_GROUPED_SCHED_DYNAMIC_SHARE192 = 5, /* ... claimed in order */
    MOE_GROUPED_SCHED_STATIC_SWAPTAIL = 6,  /* 128-row tiles, but a group's last 1..64 rows
                                               computed transposed (swapped operands) */
    MOE_GROUPED_SCHED_DYNAMIC_SWAPTAIL = 7, /* ... claimed in order */
    MOE_GROUPED_SCHED_STATIC_MC2 = 8,       /* 128-row tiles, CTA clusters of two that take
                                               m-tiles 2i, 2i+1 of one (group, n-tile) and
                                               load its weight block once, multicast */
    MOE_GROUPED_SCHED_COUNT = 9             /* (how many there are) */
} moe_grouped_schedule;
#define MOE_GROUPED_SCHED_DEFAULT MOE_GROUPED_SCHED_STATIC
void moe_cuda_grouped_sm90_set_schedule(moe_grouped_schedule s);
moe_grouped_schedule moe_cuda_grouped_sm90_schedule(void);
const char *moe_cuda_grouped_sm90_schedule_name(moe_grouped_schedule s);
/* how many times the static-mc2 kernels (2-CTA clusters, multicast weights) were launched
 * in this process: a test's proof that the schedule ran */
int moe_cuda_grouped_sm90_mc_launches(void);
/* narrow tiles (process-wide, like the schedule): with them on (the default; the
 * environment's MOE_GROUPED_NARROW=0 turns them off) a GEMM whose N columns 192 divides with
 * less padding than 256 (N = 384: 2 x 192 instead of 256 + a half-empty 256) runs 128 x 192
 * tiles, under the static and dynamic schedules and without the fused gather */
void moe_cuda_grouped_sm90_set_narrow(int on);
int moe_cuda_grouped_sm90_narrow(void);
/** @brief How a grouped wgrad's tile writes fp32 dw (our sm_90a kernels: the bf16 one,
 *  kernels/grouped_gemm_sm90.cu, and the FP8 one's 128 × 256 tile; bf16 dw and the FP8
 *  kernel's 128-column tile are always staged). Each gives the same bits: one fp32 addition
 *  (or a store) per element. */
typedef enum {
    /** staged through a shared-memory buffer per warpgroup, then TMA (a reduce-add or a
     *  store), each piece waiting until TMA has read the last */
    MOE_WGRAD_EPI_TMA = 0,
    /** straight from registers, 16 bytes a thread: added in L2 (`red.global.add.v4.f32`) or
     *  stored (the FP8 kernel only) */
    MOE_WGRAD_EPI_DIRECT = 1,
    /** straight from registers; adding, each thread reads its old values and writes
     *  old + sum (plain loads and stores, no L2 reductions); storing, staged */
    MOE_WGRAD_EPI_RMW = 2,
    /** adding: RMW for a tile of at most 1024 of its group's rows (8 FP8 k-blocks, 16 bf16
     *  k-steps; read on the device, per tile), TMA for longer ones; storing: TMA */
    MOE_WGRAD_EPI_AUTO = 3,
} moe_wgrad_epi;
/** The default epilogue of the bf16 grouped wgrad adding into fp32 dw: TMA. RMW and auto
 *  passed the GPU suite on an H100 (test_gpu_grouped_wgrad_epilogue, and auto as the default
 *  of every other grouped test) but their speed is not measured yet, so they are opt-in. */
#define MOE_WGRAD_EPI_DEFAULT MOE_WGRAD_EPI_TMA
/**
 * @brief Choose how the bf16 grouped wgrad (our sm_90a kernel, unsplit, not ping-pong) adds
 *        into fp32 dw (process-wide, not thread-safe): ::MOE_WGRAD_EPI_TMA, ::MOE_WGRAD_EPI_RMW
 *        or ::MOE_WGRAD_EPI_AUTO; any other value restores the default. RMW needs I % 8 == 0
 *        (16-byte rows); otherwise the tiles stay staged.
 *
 * Without a call, the environment's MOE_WGRAD_EPI=tma|rmw|auto decides, else
 * ::MOE_WGRAD_EPI_DEFAULT. Set by the tests and the benchmarks.
 * @param e the epilogue
 */
void moe_cuda_wgrad_set_epilogue(moe_wgrad_epi e);
/** @brief The bf16 grouped wgrad's adding epilogue asked for (moe_cuda_wgrad_set_epilogue()).
 *  @return the epilogue */
moe_wgrad_epi moe_cuda_wgrad_epilogue(void);
/** The default of the wgrad's L2 prefetch (moe_cuda_wgrad_set_prefetch()): 0, off (both forms
 *  measured slower on an H100: docs/results/03-grouped-gemm-ii.md §3g). */
#define MOE_WGRAD_PREFETCH_DEFAULT 0
/**
 * @brief Prefetch, or not, each weight-gradient tile's fp32 dw into L2 before the wgrad
 *        reduce-adds into it (process-wide, not thread-safe). Both Hopper wgrad kernels, the
 *        bf16 grouped GEMM's and the FP8 one's, in ::MOE_DW_ACCUMULATE mode: their producer
 *        asks L2 for the tile a few k-steps before the epilogue, so the read of the old values
 *        overlaps the main loop. It changes no result, only where the read waits.
 *
 * Without a call, the environment's MOE_WGRAD_PREFETCH=0|1|2 decides (another value stops the
 * process with a message), else ::MOE_WGRAD_PREFETCH_DEFAULT.
 * @param how 1: the producer's TMA prefetches the tile (cp.async.bulk.prefetch.tensor, all
 *        three kernels); 2: the consumer threads issue prefetch.global.L2 for its lines at the
 *        tile's start (the bf16 128 × 256 kernel only; the others do not prefetch then);
 *        anything else: no prefetch
 */
void moe_cuda_wgrad_set_prefetch(int how);
/** @brief How the wgrad prefetches dw (moe_cuda_wgrad_set_prefetch()). @return 0, 1 or 2 */
int moe_cuda_wgrad_prefetch(void);
/** @brief Count one wgrad launch that prefetched (called by the wgrad launchers). */
void moe_cuda_wgrad_prefetch_note(void);
/** @brief Wgrad launches that prefetched dw since the process started, both kernels: a
 *  test's proof that the prefetch ran. @return the count */
long long moe_cuda_wgrad_prefetch_launches(void);
/**
 * @brief Turn the ping-pong wgrad (kernels/grouped_wgrad_pingpong_sm90.cu) on or off,
 *        process-wide (not thread-safe), overriding the environment.
 *
 * With it on, moe_cuda_grouped_sm90_backward() computes dw with the ping-pong kernel (each
 * consumer warpgroup owns a whole 128 x 128 tile, the two take turns in the main loop, so
 * one's epilogue overlaps the other's MMAs) wherever it would otherwise run the wgrad in
 * one chunk (moe_cuda_grouped_sm90_wgrad_split() == 1) on a contiguous input; split-K and
 * the fused gather keep the 128 x 256 kernel. Off by default: tested on an H100, and measured
 * there 0.81-1.01x the 128 x 256 kernel at 512 rows per expert.
 * @param on nonzero: on; 0: off
 */
void moe_cuda_grouped_sm90_set_wgrad_pingpong(int on);
/**
 * @brief Whether the ping-pong wgrad is on: moe_cuda_grouped_sm90_set_wgrad_pingpong()'s
 *        value, else the environment's MOE_GROUPED_WGRAD_PINGPONG (nonzero: on), else off.
 * @return 1 on, 0 off
 */
int moe_cuda_grouped_sm90_wgrad_pingpong(void);
/**
 * @brief How many times the ping-pong wgrad kernel was launched in this process: a test's
 *        proof that it ran.
 * @return the launch count
 */
int moe_cuda_grouped_sm90_wgrad_pingpong_launches(void);
/**
 * @brief The ping-pong wgrad itself: dw_g[O,I] (+)= dout_gᵀ · in_g for every group g, in
 *        one persistent sm_90a kernel, the offsets read from device memory (no host sync).
 *
 * moe_cuda_grouped_sm90_backward() calls it when it is switched on; tests and benchmarks
 * may call it directly. It needs an sm_90 device (moe_cuda_grouped_sm90_available()),
 * G <= MOE_GROUPED_DEV_MAX_GROUPS and I, O multiples of MOE_GROUPED_DEV_ALIGN (it exits
 * with a message otherwise).
 * @param dw [G][O][I]: fp32 for MOE_DW_ACCUMULATE (added to) and MOE_DW_STORE (overwritten,
 *        an empty group's block with zeros), bf16 for MOE_DW_ACT (overwritten)
 * @param dout [rows][O] bf16, the output gradient in group order
 * @param in [rows][I] bf16, the input in group order
 * @param dev_off [G+1] group row offsets, DEVICE memory; dev_off[G] == rows
 * @param G groups  @param rows total rows  @param I in features  @param O out features
 * @param mode how dw leaves (moe_dw_mode)
 */
void moe_cuda_grouped_sm90_wgrad_pingpong_run(void *dw, const void *dout, const void *in,
                                              const int *dev_off, int G, int rows, int I, int O,
                                              moe_dw_mode mode);
void moe_cuda_embedding_forward(void *out, const int *tokens, const void *table, int N, int C);
void moe_cuda_embedding_backward(moe_real *dtable, const void *dout, const int *tokens, int N,
                                 int V, int C);
void moe_cuda_rmsnorm_forward(void *out, moe_real *rstd, const void *x, const void *w, int N,
                              int C, double eps);
void moe_cuda_rmsnorm_backward(void *dx, moe_real *dw, const void *dout, const void *x,
                               const void *w, const moe_real *rstd, int N, int C);
void moe_cuda_rope_forward(void *out, const void *in, int B, int T, int heads, int D, int pos0,
                           double base);
void moe_cuda_rope_backward(void *din, const void *dout, int B, int T, int heads, int D, int pos0,
                            double base);
size_t moe_cuda_attention_workspace_bytes(moe_attention_shape s);
void moe_cuda_attention_forward(void *y, moe_real *lse, void *ws, const void *q, const void *k,
                                const void *v, moe_attention_shape s);
/* chapter 07's Hopper flash-attention forward (kernels/attention_sm90.cu): runs it and
 * returns 1 for head dims 64 and 128 on an sm_90 device with 16-byte aligned tensors unless
 * MOE_FLASH_SM90=0, else returns 0 without doing anything (moe_cuda_attention_forward
 * calls it first and falls back to the portable kernel). The count of calls that ran it
 * lets a test prove the path was taken. */
int moe_cuda_attention_sm90_forward(void *y, moe_real *lse, const void *q, const void *k,
                                    const void *v, moe_attention_shape s);
long long moe_cuda_attention_sm90_calls(void);
/* chapter 07's Hopper flash-attention backward (kernels/attention_sm90_bwd.cu): with
 * MOE_FLASH_SM90_BWD unset or 6 (its fused kernel with a deterministic fp32 dq reduction in
 * a scratch workspace, in FlashAttention-3's order of products and waits inside an iteration
 * with a dq hand-off per warpgroup: the default, measured 1.02-1.05x mode 2 on an H100), 2
 * (the same kernel in its first order: mode 6's bits), 3 (the same kernel with its wgmmas overlapped with its
 * arithmetic: mode 2's bits; opt-in: measured 0.95-0.98x mode 2's speed on an H100), 4 (the fused kernel with its dq
 * tiles reduce-added in no fixed order: NOT deterministic, FlashAttention-3's default; opt-in,
 * measured 1.05x mode 2), 5 (mode 4 with its dk/dv epilogue's loads batched before its
 * stores: dk, dv mode 2's bits; opt-in, measured slower than mode 4), 7 (mode 6 with mode 4's
 * unordered dq reduce-adds: NOT deterministic; opt-in, measured 1.04-1.10x mode 2), or 1 (its
 * two kernels: the same
 * bits on the tests' shapes, not always); 0 = the portable kernels. Head dims 64 and 128, an sm_90 device and
 * 16-byte aligned tensors: adds the gradients to dq, dk, dv from dy, the forward's lse and delta =
 * rowsum(dy ⊙ y) [B, Hq, Tq] (computed by the caller) and returns 1; else returns 0 without
 * doing anything (moe_cuda_attention_backward calls it first and falls back to the portable
 * kernels). MOE_FLASH_SM90_BWD set to anything but 0 .. 7 exits with a message naming it.
 * The call counts (every call that ran a Hopper backward; those that ran the fused kernel,
 * modes 2-7; those that ran mode 3; those that ran the non-deterministic modes 4, 5 and 7;
 * those that ran mode 5; those that ran modes 6 and 7) let a test prove the path was taken. */
int moe_cuda_attention_sm90_backward(void *dq, void *dk, void *dv, const void *dy,
                                     const moe_real *lse, const moe_real *delta, const void *q,
                                     const void *k, const void *v, moe_attention_shape s);
long long moe_cuda_attention_sm90_backward_calls(void);
long long moe_cuda_attention_sm90_backward_fused_calls(void);
long long moe_cuda_attention_sm90_backward_overlap_calls(void);
long long moe_cuda_attention_sm90_backward_nondet_calls(void);
long long moe_cuda_attention_sm90_backward_batched_calls(void);
long long moe_cuda_attention_sm90_backward_fa3order_calls(void);
void moe_cuda_attention_backward(void *dq, void *dk, void *dv, const void *dy, const void *y,
                                 const moe_real *lse, void *ws, const void *q, const void *k,
                                 const void *v, moe_attention_shape s);
void moe_cuda_swiglu_forward(void *out, const void *gu, const moe_real *row_scale, int N, int F);
void moe_cuda_swiglu_backward(void *dgu, moe_real *drow_scale, const void *dout, const void *gu,
                              const moe_real *row_scale, int N, int F);
void moe_cuda_cross_entropy_forward(moe_real *losses, const void *logits, const int *targets,
                                    int N, int V);
void moe_cuda_cross_entropy_backward(void *dlogits, const moe_real *dloss, const void *logits,
                                     const int *targets, int N, int V);
void moe_cuda_cross_entropy_shard_forward(moe_real *part, const void *logits, const int *targets,
                                          int N, int V);
void moe_cuda_cross_entropy_shard_merge(moe_real *losses, moe_real *lse, const moe_real *parts,
                                        int R, int N);
void moe_cuda_cross_entropy_shard_backward(void *dlogits, const moe_real *dloss,
                                           const void *logits, const moe_real *lse,
                                           const int *targets, int N, int V);
/* context parallelism (chapter 07; kernels/cp_merge.cu) */
void moe_cuda_cp_merge(void *y, moe_real *lse, const void *y_b, const moe_real *lse_b, int B,
                       int T, int H, int D);
void moe_cuda_fill_real(moe_real *x, double v, size_t n);
void moe_cuda_copy_2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                      size_t rows);
void moe_cuda_add(void *y, const void *x, size_t n);
void moe_cuda_scale(void *x, double s, size_t n);

/* MoE ops */
void moe_cuda_router_forward(int *topk_idx, moe_real *topk_w, const void *logits,
                             const float *bias, const moe_router_params *p, int N);
void moe_cuda_router_backward(void *dlogits, const moe_real *dtopk_w, const void *logits,
                              const int *topk_idx, const moe_router_params *p, int N);
void moe_cuda_aux_loss_counts(long long *counts, const void *logits, const moe_aux_shape *s);
void moe_cuda_aux_loss_forward(double *acc, const void *logits, const long long *counts,
                               const moe_aux_shape *s, double coeff);
void moe_cuda_aux_loss_backward(void *dlogits, const void *logits, const long long *counts,
                                const moe_aux_shape *s, double coeff, double scale);
void moe_cuda_z_loss_forward(double *acc, const void *logits, int N, int E, double coeff);
void moe_cuda_z_loss_backward(void *dlogits, const void *logits, int N, int E, double coeff,
                              double scale);
void moe_cuda_permute_index(int *perm_src, int *row_of, int *expert_offset, int *dev_offset,
                            long long *counts,
                            const int *topk_idx, int N, int k, int E);
void moe_cuda_permute_index_budget(int *perm_src, int *row_of, int *expert_offset, int *flags,
                                   const int *topk_idx, int N, int k, int E, int budget);
void moe_cuda_fused_plan(int *shift, int *expert_offset, int *flags, const int *all_off, int P,
                         int rank, int E, int budget);
void moe_cuda_permute_tokens(void *xp, const void *x, const int *perm_src, int rows, int k, int C);
void moe_cuda_permute_weights(moe_real *wp, const moe_real *topk_w, const int *perm_src, int rows);
void moe_cuda_unpermute_sum(void *out, const void *yp, const int *row_of, int N, int k, int C);
/* the same sum over rows in token-slot order: out[n] += Σ_j ys[n·k + j] where row_of[n·k + j]
 * >= 0 (the fused permutation's combine, after fc2 scattered its rows) */
void moe_cuda_unpermute_sum_slots(void *out, const void *ys, const int *row_of, int N, int k,
                                  int C);
void moe_cuda_unpermute_weights(moe_real *dtopk_w, const moe_real *dwp, const int *row_of, int N,
                                int k);
void moe_cuda_gather_rows(void *dst, const void *src, const int *map, int rows, int C);
void moe_cuda_gather_reals(moe_real *dst, const moe_real *src, const int *map, int rows);

/* optimizer */
void moe_cuda_sum_squares(double *acc, const moe_real *x, size_t n);
void moe_cuda_sum(double *acc, const moe_real *x, size_t n);
void moe_cuda_add_f64(double *dst, const double *src, int n);
void moe_cuda_scale_real(moe_real *x, double s, size_t n);
void moe_cuda_adamw(const moe_adamw_runs *runs, moe_real *p, const moe_real *g, float *m,
                    float *v, void *act, double lr, double beta1, double beta2, double eps,
                    double wd, double bc1, double bc2, const double *clip, const int *flags,
                    const double *hyper);

/* the step's scalars on the device (chapter 06, step_scalars.h) */
void moe_cuda_loss_accumulate(double *step, const double *mb, int N, double accum);
void moe_cuda_grad_norm_finalize(moe_step_scalars *s, double max_norm, int check);
void moe_cuda_expert_load_add(long long *load, const int *topk_idx, int N, int k, int E);
void moe_cuda_expert_bias_update(float *bias, const long long *load, int E, double rate,
                                 const int *flags);
/* the step boundary's readback (kernels/readback.cu) */
void *moe_cuda_host_alloc(size_t bytes);
void moe_cuda_host_free(void *p);
void moe_cuda_to_host_async(void *dst, const void *src, size_t bytes);
void moe_cuda_wait_to_host(void);
void moe_cuda_from_host_async(void *dst, const void *src, size_t bytes);

/* chapter 05's quantization recipes (kernels/quantize.cu): the CUDA twins of the CPU
 * reference in lib/quantize.h, with the same arguments (device pointers) and the same
 * results byte for byte. Each validates its shape on the host (the same named errors as the
 * CPU's) and enqueues its kernels without waiting; the scalars stay in device memory. */
moe_status moe_cuda_quant_tensorwise(uint8_t *q, moe_quant_scalars *s, const float *x, size_t n,
                                     moe_fp8_format f, moe_error *err);
moe_status moe_cuda_quant_delayed(uint8_t *q, moe_quant_scalars *s, float *history, int len,
                                  int pos, const float *x, size_t n, moe_fp8_format f,
                                  moe_error *err);
/** @brief As moe_cpu_quant_delayed_site() (quantize.h), the site in device memory. */
moe_status moe_cuda_quant_delayed_site(uint8_t *q, moe_quant_scalars *s, const moe_delayed_ref *d,
                                       const float *x, size_t n, moe_fp8_format f,
                                       moe_error *err);
moe_status moe_cuda_dequant_tensorwise(float *y, const uint8_t *q, const moe_quant_scalars *s,
                                       size_t n, moe_fp8_format f, moe_error *err);
moe_status moe_cuda_quant_blockwise(uint8_t *q, float *scale_inv, const float *x, int rows,
                                    int cols, moe_fp8_format f, int block_2d, int pow2,
                                    moe_error *err);
moe_status moe_cuda_quant_blockwise_t(uint8_t *q, float *scale_inv, uint8_t *qt,
                                      float *scale_inv_t, const float *x, int rows, int cols,
                                      moe_fp8_format f, int block_2d, int pow2, moe_error *err);
moe_status moe_cuda_dequant_blockwise(float *y, const uint8_t *q, const float *scale_inv,
                                      int rows, int cols, moe_fp8_format f, int block_2d,
                                      moe_error *err);
/* the same quantizers reading bf16 activations (the native FP8 layer, lib/lowp.h): 1×128
 * codes and scales of x [rows, cols] as moe_cuda_quant_blockwise of its fp32 values, and
 * when y is not NULL the dequantized values rounded to bf16 (what moe_cuda_qdq writes) in
 * the same pass; and blockwise with the transposed copy (moe_cuda_quant_blockwise_t) of
 * each of @p batch matrices [rows, cols] stored one after the other (the experts' weights:
 * codes, copies and scales batched the same way) */
moe_status moe_cuda_quant_blockwise_act(uint8_t *q, float *scale_inv, void *y, const void *x,
                                        int rows, int cols, moe_fp8_format f, int pow2,
                                        moe_error *err);
/* the inverse of moe_cuda_quant_blockwise_act: 1×128 codes and scales to bf16, the bytes of
 * its y (chapter 05's FP8 dispatch: the received rows) */
moe_status moe_cuda_dequant_blockwise_act(void *y, const uint8_t *q, const float *scale_inv,
                                          int rows, int cols, moe_fp8_format f, moe_error *err);
/* which kernel quantizes 1×128 (moe_cuda_quant_blockwise without block_2d and
 * moe_cuda_quant_blockwise_act; process-wide, not thread-safe; all give the same bytes):
 * 0 = one warp per tile (also the fallback for misaligned buffers), 1 = the vectorized one
 * (a half-warp per tile), 2 = v3 (kernels/quantize.cu, block1x128_v3_kernel), 3 = v3 with
 * the hardware's FP8 casts (the default: byte for byte the others on an H100, whose casts
 * equal moe_fp8_encode/moe_fp8_decode on all 2^32 inputs, tests/gpu_fp8_fused.c). Set by
 * moe_cuda_quant_1x128_set_kernel (tests, the chapter 05 benchmark; -1 = back to the
 * environment), else MOE_QUANT_VEC=0|1|2|3 read at each launch,
 * else MOE_QUANT_1X128_DEFAULT. The count of v3's launches lets a test prove it ran;
 * moe_cuda_quant_1x128_set_max_blocks caps v3's grid (0: the device's width), so a test can
 * make its warps loop over many groups of tiles on a small tensor. */
#define MOE_QUANT_1X128_DEFAULT 3
void moe_cuda_quant_1x128_set_kernel(int k);
int moe_cuda_quant_1x128_kernel(void);
void moe_cuda_quant_1x128_set_max_blocks(int blocks);
long long moe_cuda_quant_1x128_v3_calls(void);
/* a test of the hardware conversions v3 relies on (tests/gpu_fp8_fused.c): into
 * *cast_bad the count of fp32 inputs but NaNs, all 2^32 bit patterns tried, whose
 * cvt.rn.satfinite cast to format f differs from moe_fp8_encode's (in either half of the
 * pair), into *decode_bad the count of non-NaN codes whose FP8 → f16 → fp32 value differs
 * from moe_fp8_decode's bits. Synchronizes (reads the counts back). */
moe_status moe_cuda_fp8_cast_check(long long *cast_bad, long long *decode_bad, moe_fp8_format f,
                                   moe_error *err);
/* launches of the 128×128 recipe's second kernels (block2d_t_kernel, the weights with their
 * transposes; block2d_qdq_kernel, moe_cuda_qdq's one pass; both off with MOE_QUANT_WEIGHT=0):
 * a test's proof that they ran */
long long moe_cuda_quant_block2d_calls(void);
moe_status moe_cuda_quant_blockwise_t_act(uint8_t *q, float *scale_inv, uint8_t *qt,
                                          float *scale_inv_t, const void *x, int batch, int rows,
                                          int cols, moe_fp8_format f, int block_2d, int pow2,
                                          moe_error *err);
moe_status moe_cuda_quant_mxfp8(uint8_t *q, uint8_t *scales, const float *x, int rows, int cols,
                                moe_fp8_format f, moe_error *err);
moe_status moe_cuda_dequant_mxfp8(float *y, const uint8_t *q, const uint8_t *scales, int rows,
                                  int cols, moe_fp8_format f, moe_error *err);
moe_status moe_cuda_quant_nvfp4(uint8_t *q, uint8_t *scales, moe_quant_scalars *g, const float *x,
                                int rows, int cols, const moe_nvfp4_opts *o, moe_error *err);
moe_status moe_cuda_dequant_nvfp4(float *y, const uint8_t *q, const uint8_t *scales,
                                  const moe_quant_scalars *g, int rows, int cols,
                                  const moe_nvfp4_opts *o, moe_error *err);
moe_status moe_cuda_rht16(float *y, const float *x, int rows, int cols, uint64_t seed,
                          int inverse, moe_error *err);
/* chapter 05's fused passes of the native FP8 layer (kernels/swiglu_quant.cu; the backend's
 * fp8_swiglu_forward_quant, fp8_swiglu_backward_quant, fp8_dequant_act): the same bytes as
 * moe_cuda_swiglu_forward / moe_cuda_swiglu_backward (into a zeroed dgu) followed by
 * moe_cuda_quant_blockwise_act, and as that quantizer's dequantized copy (y_raw = 0) or as
 * the SwiGLU's own bf16 output (y_raw = 1: the FP8 wgrad's source). F % 128 == 0 and
 * 16-byte aligned buffers, else MOE_ERR_CONFIG (nothing launched). */
moe_status moe_cuda_swiglu_forward_quant(uint8_t *q, float *scale_inv, void *y, int y_raw,
                                         const void *gu, const moe_real *row_scale, int N, int F,
                                         moe_fp8_format f, int pow2, moe_error *err);
moe_status moe_cuda_swiglu_backward_quant(uint8_t *q, float *scale_inv, void *y, int y_raw,
                                          moe_real *drow_scale, const void *dout, const void *gu,
                                          const moe_real *row_scale, int N, int F,
                                          moe_fp8_format f, int pow2, moe_error *err);

/* ... and the backward under the FP8 wgrad, tiled (kernels/swiglu_quant.cu, "tiled"): dgu's
 * row-wise codes and scales as moe_cuda_swiglu_backward_quant's, and its token-wise copy qt
 * [2F][kpad], st [kpad/128][2F] as moe_cuda_quant_group_t_act of dgu would write them, dgu
 * itself never written; drow_scale added to through part [F/128][N] (fp32 rounding of the
 * row-wise kernel's sum, another order). F % 128 == 0, 16-byte aligned buffers and
 * moe_quant_group_t_check's arguments, else MOE_ERR_CONFIG (nothing launched). */
moe_status moe_cuda_swiglu_backward_quant_t(uint8_t *q, float *scale_inv, uint8_t *qt, float *st,
                                            float *part, moe_real *drow_scale, const void *dout,
                                            const void *gu, const moe_real *row_scale,
                                            const int *dev_off, int G, int N, int F, size_t kpad,
                                            moe_fp8_format f, int pow2, moe_error *err);
/* launches of the tiled backward since the start (a test's proof that it ran) */
long long moe_cuda_swiglu_backward_quant_t_calls(void);
/* ... and the forward under the FP8 wgrad, tiled (kernels/swiglu_quant.cu, the end): the
 * SwiGLU output's row-wise codes q and scales as moe_cuda_swiglu_forward_quant's, and its
 * token-wise copy qt [F][kpad], st [kpad/128][F] as moe_cuda_quant_group_t_act of that output
 * would write them, the output itself never written. F % 128 == 0, 16-byte aligned buffers
 * and moe_quant_group_t_check's arguments, else MOE_ERR_CONFIG (nothing launched). */
moe_status moe_cuda_swiglu_forward_quant_t(uint8_t *q, float *scale_inv, uint8_t *qt, float *st,
                                           const void *gu, const moe_real *row_scale,
                                           const int *dev_off, int G, int N, int F, size_t kpad,
                                           moe_fp8_format f, int pow2, moe_error *err);
/* launches of the tiled forward since the start */
long long moe_cuda_swiglu_forward_quant_t_calls(void);
#define MOE_FP8_SAVE_T_BLOCKS_DEFAULT 4
/* the tiled forward's blocks per SM (its launch bounds: 2, 3 or 4; others are clamped),
 * process-wide, for the benchmark and the tests; without a call MOE_FP8_SAVE_T_BLOCKS, else
 * MOE_FP8_SAVE_T_BLOCKS_DEFAULT. The bytes are the same in every form. */
void moe_cuda_swiglu_forward_t_set_blocks(int blocks);
int moe_cuda_swiglu_forward_t_blocks(void);

/* the CUDA twin of moe_cpu_qdq (bf16 activations through ws->x in fp32) */
void moe_cuda_qdq(void *dst, const void *src, int rows, int cols, const moe_qdq_spec *spec,
                  const moe_qdq_ws *ws);
/* the CUDA twin of moe_cpu_qdq_t: the QDQ along the tokens of a wgrad operand, src [n, cols]
 * bf16 → dst [m, cols] bf16 (tokens zero-padded to m), through ws->x [cols, m] in fp32 */
void moe_cuda_qdq_t(void *dst, const void *src, int n, int m, int cols,
                    const moe_qdq_spec *spec, const moe_qdq_ws *ws);

/* chapter 05's low-precision GEMM (kernels/fp8_gemm.cu): D[M,N] = A[M,K]·B[N,K]ᵀ on
 * quantized operands, the contract and the shape rules of lib/fp8_gemm.h (the CPU twin is
 * moe_cpu_fp8_gemm). d: bf16, or fp32 when d_fp32 is 1. Enqueued on moe_cuda_stream(). */
moe_status moe_cuda_fp8_gemm(void *d, int d_fp32, const moe_qmatrix *a, const moe_qmatrix *b,
                             int M, int N, int K, moe_error *err);
/* ... with @p accumulate 1: D += A·Bᵀ (cuBLASLt's beta = 1 on D itself; a bf16 D is read,
 * summed in fp32 with the product and rounded once, as the bf16 matmul_backward does) */
moe_status moe_cuda_fp8_gemm_acc(void *d, int d_fp32, int accumulate, const moe_qmatrix *a,
                                 const moe_qmatrix *b, int M, int N, int K, moe_error *err);
/* the backend's fp8_gemm (lib/backend.h): moe_cuda_fp8_gemm_acc with a bf16 D */
moe_status moe_cuda_fp8_gemm_act(void *d, int accumulate, const moe_qmatrix *a,
                                 const moe_qmatrix *b, int M, int N, int K, moe_error *err);
/* chapter 05's FP8 grouped GEMM, our sm_90a kernel (kernels/grouped_gemm_fp8_sm90.cu): the
 * experts' forward D[rows, N] = A_g · B_gᵀ per group, A blockwise 1×128 and B 128×128 per
 * expert, E4M3, the contract and the shape rules of moe_fp8_grouped_check (lib/fp8_gemm.h;
 * the CPU twin is moe_cpu_fp8_grouped_gemm). dev_off: [G+1] row offsets in DEVICE memory,
 * read by the kernel (no host sync). d: bf16, or fp32 when d_fp32 is 1. ::MOE_ERR_BACKEND
 * where the GPU is not Hopper. Enqueued on moe_cuda_stream(). */
moe_status moe_cuda_fp8_grouped_gemm(void *d, int d_fp32, const moe_qmatrix *a,
                                     const moe_qmatrix *b, const int *dev_off, int G, int rows,
                                     int N, int K, moe_error *err);
/* its two variants (process-wide, not thread-safe): 1 = the consumer warpgroups issue their
 * k-blocks in turn (named barriers), so one promotes while the other's MMAs run; 0 = they
 * issue together. Set by moe_cuda_fp8_grouped_set_ordered (tests, the chapter 05 benchmark),
 * else MOE_FP8_GROUPED_ORDERED=0|1, else the default */
#define MOE_FP8_GROUPED_ORDERED_DEFAULT 1
void moe_cuda_fp8_grouped_set_ordered(int on);
int moe_cuda_fp8_grouped_ordered(void);
/** The default tile width of the FP8 grouped GEMM: 256 columns (on an H100 bit-identical to
 *  the 128-column tile, and faster: docs/results/05-fp8-nvfp4.md). */
#define MOE_FP8_GROUPED_BN_DEFAULT 256
/**
 * @brief Choose the FP8 grouped GEMM's tile width (process-wide, not thread-safe; forward
 *        and dgrad, both output types): 128 × 128 tiles, or 128 × 256 tiles whose consumer
 *        warpgroups promote each k-block in two 128-column halves (the "split promotion" of
 *        kernels/grouped_gemm_fp8_sm90.cu). Both give bit-identical outputs.
 *
 * Without a call, the environment's MOE_FP8_GROUPED_BN=128|256 decides, else
 * ::MOE_FP8_GROUPED_BN_DEFAULT. Set by the tests and the chapter 05 benchmark.
 * @param bn 256 for the wide tile; any other value selects 128
 */
void moe_cuda_fp8_grouped_set_bn(int bn);
/** @brief The FP8 grouped GEMM's tile width in use: 128 or 256 (moe_cuda_fp8_grouped_set_bn()).
 *  @return 128 or 256 */
int moe_cuda_fp8_grouped_bn(void);
/** @brief Launches of the 256-column FP8 grouped kernel since the process started: a test's
 *  proof that it ran. @return the count */
long long moe_cuda_fp8_grouped_bn256_calls(void);
/* chapter 05's FP8 wgrad (lib/fp8_wgrad.h): the token-wise FP8 copy [C][kpad] of a bf16
 * [rows][C] per expert group, scales [kpad/128][C], the offsets in DEVICE memory
 * (kernels/quantize_group_t.cu; CPU twin moe_cpu_quant_group_t); the emulation's QDQ with
 * the same blocks into y [rows][C] bf16 (y may be x; CPU twin moe_cpu_qdq_group_t); and the
 * grouped wgrad dW_g [M][N] (+)= A_gᵀ-copy · B_g-copy on two such copies
 * (kernels/grouped_gemm_fp8_wgrad_sm90.cu; CPU twin moe_cpu_fp8_grouped_wgrad), dW written
 * as mode says (fp32 added / stored, bf16 stored). Enqueued on moe_cuda_stream(). */
moe_status moe_cuda_quant_group_t_act(uint8_t *qt, float *st, const void *x, const int *dev_off,
                                      int G, int rows, int C, size_t kpad, moe_fp8_format f,
                                      int pow2, moe_error *err);
moe_status moe_cuda_qdq_group_t_act(void *y, const void *x, const int *dev_off, int G, int rows,
                                    int C, moe_fp8_format f, int pow2, moe_error *err);
/* the token-wise quantizer's two kernels (process-wide, not thread-safe): 0 = the vectorized
 * one (the default), 1 = the first one (MOE_QUANT_GROUP_T_V1=1, for a comparison; it also
 * serves inputs that are not 16-byte aligned). Set by moe_cuda_quant_group_t_set_v1 (tests,
 * the chapter 05 benchmark), else MOE_QUANT_GROUP_T_V1=0|1. The count of launches of the
 * vectorized kernel lets a test prove it ran. */
void moe_cuda_quant_group_t_set_v1(int on);
int moe_cuda_quant_group_t_v1(void);
long long moe_cuda_quant_group_t_v2_calls(void);
moe_status moe_cuda_fp8_grouped_wgrad(void *dw, moe_dw_mode mode, const uint8_t *qa,
                                      const float *sa, const uint8_t *qb, const float *sb,
                                      const int *dev_off, int G, size_t kpad, int M, int N,
                                      moe_error *err);
/* the wgrad kernel's two consumer loops (process-wide, not thread-safe): 1 = two accumulator
 * sets, k-block j + 1's MMAs run while j's partial is promoted (scaled into the fp32 sums);
 * 0 = the first loop, each k-block's MMAs waited for before its promotion (the tensor cores
 * idle meanwhile). Same numbers either way (the same promotion order). Set by
 * moe_cuda_fp8_wgrad_set_pipe (tests, the chapter 05 benchmark), else MOE_FP8_WGRAD_PIPE=0|1,
 * else the default */
#define MOE_FP8_WGRAD_PIPE_DEFAULT 1
void moe_cuda_fp8_wgrad_set_pipe(int on);
int moe_cuda_fp8_wgrad_pipe(void);
/* where the wgrad kernel's consumers read each k-block's scales (process-wide, not
 * thread-safe): 1 = from shared memory, where the producer brings them with the k-block's
 * stage (bulk copies; 5 stages instead of 6 to make room); 0 = from global memory, as the
 * kernel first did (MOE_FP8_WGRAD_SCALES=global, for a comparison; also taken when sa or sb
 * is not 16-byte aligned). Same numbers either way. Set by moe_cuda_fp8_wgrad_set_smem_scales
 * (tests, the chapter 05 benchmark), else MOE_FP8_WGRAD_SCALES=global|smem (or 0|1), else the
 * default. The count of launches with the scales in shared memory lets a test prove it ran. */
#define MOE_FP8_WGRAD_SMEM_SCALES_DEFAULT 1
void moe_cuda_fp8_wgrad_set_smem_scales(int on);
int moe_cuda_fp8_wgrad_smem_scales(void);
long long moe_cuda_fp8_wgrad_smem_calls(void);
/** The default tile width of the FP8 grouped wgrad: 256 columns, the 128 × 256 tile (the
 *  same bits as the 128 × 128 one; on an H100 1.02x it on Mixtral's fc1, 0.90x on
 *  Qwen3-235B's storing but 1.00x adding: docs/results/05-fp8-nvfp4.md). */
#define MOE_FP8_WGRAD_BN_DEFAULT 256
/**
 * @brief Choose the FP8 grouped wgrad's tile width (process-wide, not thread-safe; all three
 *        output modes): 128 × 128 tiles, or 128 × 256 tiles whose consumer warpgroups promote
 *        each k-block in two 128-column halves (the "split promotion" of
 *        kernels/grouped_gemm_fp8_wgrad_sm90.cu, as the forward's 128 × 256 tile). Both give
 *        bit-identical outputs.
 *
 * The wide tile has one loop, with the scales in shared memory: with the scales read from
 * global memory (moe_cuda_fp8_wgrad_set_smem_scales(0), or sa / sb not 16-byte aligned) or the
 * first loop (moe_cuda_fp8_wgrad_set_pipe(0)), the 128-column tile runs whatever is set here.
 * Without a call, the environment's MOE_FP8_WGRAD_BN=128|256 decides, else
 * ::MOE_FP8_WGRAD_BN_DEFAULT. Set by the tests and the chapter 05 benchmark.
 * @param bn 256 for the wide tile; any other value selects 128
 */
void moe_cuda_fp8_wgrad_set_bn(int bn);
/** @brief The FP8 grouped wgrad's tile width asked for: 128 or 256 (moe_cuda_fp8_wgrad_set_bn()).
 *  @return 128 or 256 */
int moe_cuda_fp8_wgrad_bn(void);
/** @brief Launches of the 128 × 256 FP8 grouped wgrad kernel since the process started: a
 *  test's proof that it ran. @return the count */
long long moe_cuda_fp8_wgrad_bn256_calls(void);
/** The default promotion of the 128 × 256 FP8 wgrad tile: 0 = by 128-column halves, each
 *  waited for (the measured one). */
#define MOE_FP8_WGRAD_QUARTERS_DEFAULT 0
/**
 * @brief Choose how the 128 × 256 FP8 grouped wgrad tile promotes a k-block (process-wide,
 *        not thread-safe): 1 = in four 64-column quarters with two accumulator sets, the next
 *        quarter's MMAs queued before the current one is waited for, so a warpgroup never
 *        idles at the tensor cores while it promotes (no issue turns); 0 = in two 128-column
 *        halves, each waited for, the warpgroups taking turns (the default). Meant to give the
 *        same bits. Only for the wide tile, whose sums it stages: with a register epilogue
 *        asked for (::MOE_WGRAD_EPI_DIRECT, ::MOE_WGRAD_EPI_RMW) the halves run; under
 *        ::MOE_WGRAD_EPI_AUTO its adding tiles are all staged. STATUS: passed tests/gpu_fp8_wgrad.c on an H100 at 4b8d4da, and
 *        measured slower there than the halves (docs/results/05-fp8-nvfp4.md): off.
 *
 * Without a call, the environment's MOE_FP8_WGRAD_QUARTERS=0|1 decides, else
 * ::MOE_FP8_WGRAD_QUARTERS_DEFAULT. Set by the tests and the chapter 05 benchmark.
 * @param on 1 for the quarters, 0 for the halves
 */
void moe_cuda_fp8_wgrad_set_quarters(int on);
/** @brief The wide FP8 wgrad tile's promotion asked for (moe_cuda_fp8_wgrad_set_quarters()).
 *  @return 1 quarters, 0 halves */
int moe_cuda_fp8_wgrad_quarters(void);
/** @brief Launches of the wide FP8 wgrad tile by quarters since the process started: a test's
 *  proof that it ran. @return the count */
long long moe_cuda_fp8_wgrad_quarters_calls(void);
/** The default epilogue of the 128 × 256 FP8 wgrad tile with fp32 dW. */
#define MOE_FP8_WGRAD_EPI_DEFAULT MOE_WGRAD_EPI_AUTO
/**
 * @brief Choose how the 128 × 256 FP8 grouped wgrad tile writes fp32 dW (process-wide, not
 *        thread-safe); see ::moe_wgrad_epi. A value out of range restores the default.
 *
 * Without a call, the environment's MOE_FP8_WGRAD_EPI=tma|direct|rmw|auto (or 0|1 for
 * tma|direct) decides, else ::MOE_FP8_WGRAD_EPI_DEFAULT. Set by the tests and the chapter 05
 * benchmark.
 * @param e the epilogue
 */
void moe_cuda_fp8_wgrad_set_epilogue(moe_wgrad_epi e);
/** @brief The FP8 grouped wgrad's fp32 epilogue asked for (moe_cuda_fp8_wgrad_set_epilogue()).
 *  @return the epilogue */
moe_wgrad_epi moe_cuda_fp8_wgrad_epilogue(void);
/** @brief Launches of the FP8 grouped wgrad whose fp32 sums may leave from registers (the
 *  direct, rmw or auto epilogue) since the process started: a test's proof that it ran.
 *  @return the count */
long long moe_cuda_fp8_wgrad_direct_calls(void);
/* 1 when this GPU runs the recipe's GEMM natively in cuBLASLt, 0 when emulated (dequantize →
 * bf16 GEMM): tensorwise always native; blockwise native on compute capability 9.x; MXFP8 and
 * NVFP4 native on 10.x unless MOE_FP8_GEMM_EMULATE=1 */
int moe_cuda_fp8_gemm_native(moe_quant_recipe r);

#ifdef __cplusplus
}
#endif

#endif /* MOE_CUDA_OPS_H */
