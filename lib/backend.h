/**
 * @file backend.h
 * @brief The seam between the model and the hardware: a table of ops.
 *
 * The model (model.c, moe_layer.c, mlp.c) is written once against this table;
 * it never calls a CPU or CUDA function directly. The CPU backend
 * (lib/cpu/backend.c) fills the table with the reference ops of lib/cpu/; a
 * CUDA backend fills it with launchers from kernels/ whose arguments are
 * device pointers. Every op has the signature and the accumulate-into-gradients
 * contract documented in lib/cpu/ops.h, lib/cpu/router.h and lib/cpu/moe_ops.h.
 *
 * Memory that the model touches is allocated through the table as well, so the
 * model does not know where it lives. Host-side decisions the naive MoE loop
 * needs (how many tokens each expert got) come back through `permute_index`,
 * which returns the expert offsets on the host — a host sync. Chapter 06's
 * `permute_index_budget` keeps them in backend memory instead (lib/moe/layer.h). The
 * scalars of a step (losses, gradient norm, clip factor, step flags) are written into
 * backend memory by the ops and read by the host once per step, through to_host_async /
 * wait_to_host (chapter 06, step_scalars.h).
 */
#ifndef MOE_BACKEND_H
#define MOE_BACKEND_H

#include <stddef.h>

#include "config.h"
#include "error.h"
#include "op_types.h"
#include "quantize.h"
#include "real.h"
#include "step_scalars.h"

struct moe_qmatrix; /* fp8_gemm.h: an operand of the FP8 GEMMs */

#ifdef __cplusplus
extern "C" { /* kernels/backend_cuda.cu implements the CUDA entries */
#endif

/** Which backend. */
typedef enum moe_device {
    MOE_DEVICE_CPU = 0, /**< host memory, the CPU reference ops */
    MOE_DEVICE_CUDA = 1 /**< device memory, the CUDA kernels */
} moe_device;

/**
 * How the grouped kernel's weight gradient leaves (grouped_matmul_backward_dev, chapter 03).
 * A training step's first micro-batch meets a gradient buffer that holds zeros, so adding
 * into it reads 4 bytes per element for nothing: STORE writes instead. ACT writes the
 * gradient in the activation type, as torch._grouped_mm does (bf16 on CUDA: half the
 * bytes again), for comparing like with like; a trainer that keeps fp32 main gradients
 * would then add it into them itself.
 */
typedef enum moe_dw_mode {
    MOE_DW_ACCUMULATE = 0, /**< dw (moe_real) += the gradient: the usual contract */
    MOE_DW_STORE = 1,      /**< dw (moe_real) = the gradient; what it held is not read */
    MOE_DW_ACT = 2         /**< dw (activation type, `act_size` bytes) = the gradient */
} moe_dw_mode;

/**
 * Address of element @p i of an activation buffer @p p. Activations are `void *`
 * because their element type belongs to the backend (fp32 on the CPU, bf16 on CUDA);
 * `be->act_size` is its size in bytes.
 */
#define MOE_ACT(be, p, i) ((void *)((char *)(p) + (size_t)(i) * (be)->act_size))

/**
 * The op table. Types tell what precision a buffer has on every backend:
 *  - `void *` — an **activation** (or a compute copy of a weight): the backend's
 *    activation type, `act_size` bytes per element (fp32 on the CPU, bf16 on CUDA);
 *  - `moe_real *` — always full precision: master weights, weight gradients,
 *    normalisation statistics, per-token losses, routing weights, optimizer state;
 *  - `int *` — token ids and routing indices.
 * The meaning of each op is documented with its CPU twin in lib/cpu/ops.h,
 * lib/cpu/router.h and lib/cpu/moe_ops.h; backward ops accumulate.
 */
typedef struct moe_backend {
    const char *name;      /**< "cpu" or "cuda" */
    moe_device device;     /**< which device its pointers live on */
    size_t act_size;       /**< bytes per activation element */

    /** @name memory and precision */
    /**@{*/
    void *(*alloc)(size_t bytes);                         /**< zeroed allocation (NULL on failure) */
    void (*free)(void *p);                                /**< release (NULL: no-op) */
    void (*zero)(void *p, size_t bytes);                  /**< memset 0 */
    void (*copy)(void *dst, const void *src, size_t bytes);      /**< device → device */
    void (*to_host)(void *dst, const void *src, size_t bytes);   /**< device → host */
    void (*from_host)(void *dst, const void *src, size_t bytes); /**< host → device */
    /** dst + r·dpitch ← src + r·spitch, @p width bytes each, r < @p rows (device → device,
     *  as cudaMemcpy2D): the packing of strided rows, e.g. context parallelism's all-to-all
     *  of heads (chapter 07) */
    void (*copy_2d)(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                    size_t rows);
    /** x[i] = v, i < n, full-precision elements (e.g. log-sum-exp rows at −∞) */
    void (*fill_real)(moe_real *x, double v, size_t n);
    /** n activations → host moe_real (for logits, tests) */
    void (*read_act)(moe_real *host, const void *src, size_t n);
    /** n host moe_real → activations (for tests) */
    void (*write_act)(void *dst, const moe_real *host, size_t n);
    /** dst (activation type) = src (master weights), n elements: the compute copy */
    void (*cast_to_act)(void *dst, const moe_real *src, size_t n);
    /** wait until all queued work is done (timing) */
    void (*synchronize)(void);
    /** a human-readable name of the device ("NVIDIA H200", "CPU: AMD EPYC, 2 threads") */
    void (*device_name)(char *buf, size_t cap);
    /** dense bf16 tensor-core peak in TFLOP/s for MFU (0 when unknown, e.g. CPUs) */
    double (*peak_tflops)(void);
    /** bytes of device memory free for allocations (0 = unknown): moe_model_create() checks
     *  its estimate (memory.h) against it before allocating */
    size_t (*memory_bytes)(void);
    /** start the backend's timer (CUDA: an event recorded on the stream; CPU: the clock) */
    void (*timer_begin)(void);
    /** milliseconds since timer_begin, once all work queued before this call has finished */
    double (*timer_end_ms)(void);
    /** x[i] = std · normal(seed, stream, i): the counter-based RNG of rng.h, on the device */
    void (*fill_normal)(moe_real *x, size_t n, unsigned long long seed, unsigned long long stream,
                        double std);
    /**@}*/

    /** @name graph capture (chapter 06; NULL on a backend without graphs: the CPU)
     *  lib/graph.h uses these four to record a region of ops once and replay it. */
    /**@{*/
    /** start recording: ops enqueued from now on are captured, not run */
    void (*graph_begin)(void);
    /** stop recording and make the recording replayable; NULL when it could not be captured,
     *  with the reason (what was not capturable) in @p why */
    void *(*graph_end)(char *why, size_t cap);
    /** replay a graph: 1, or 0 when a buffer it used has moved since (capture it again) */
    int (*graph_launch)(void *g);
    /** release a graph (NULL: no-op) */
    void (*graph_free)(void *g);
    /** the kernels, memsets and copies a graph holds */
    size_t (*graph_nodes)(const void *g);
    /**@}*/

    /** @name dense ops */
    /**@{*/
    /** as moe_cpu_matmul_forward() */
    void (*matmul_forward)(void *out, const void *in, const void *w, int N, int I, int O);
    /** as moe_cpu_matmul_backward() (dw in full precision) */
    void (*matmul_backward)(void *din, moe_real *dw, const void *dout, const void *in,
                            const void *w, int N, int I, int O);
    /** G matmuls in one op: rows [off[g], off[g+1]) of @p in times w_g[O,I]ᵀ, weights stacked
     *  [G,O,I]; @p off is a HOST array [G+1] (chapter 03: grouped GEMM) */
    void (*grouped_matmul_forward)(void *out, const void *in, const void *w, const int *off,
                                   int G, int I, int O);
    /** backward of grouped_matmul_forward (accumulates, dw in full precision) */
    void (*grouped_matmul_backward)(void *din, moe_real *dw, const void *dout, const void *in,
                                    const void *w, const int *off, int G, int I, int O);
    /** grouped_matmul_forward with the offsets @p dev_off [G+1] in BACKEND memory, so the
     *  host never needs the group sizes (chapter 03's own kernel); @p rows >= dev_off[G],
     *  the rows of @p in and @p out (more on chapter 06's sync-free EP expert side, a static
     *  budget of rows of which the device plan fills dev_off[G]: the rows past it are
     *  neither read nor written); G <= ::MOE_GROUPED_DEV_MAX_GROUPS, I and O multiples of
     *  ::MOE_GROUPED_DEV_ALIGN */
    void (*grouped_matmul_forward_dev)(void *out, const void *in, const void *w,
                                       const int *dev_off, int G, int rows, int I, int O);
    /** backward of grouped_matmul_forward_dev: din accumulates when @p din_accumulate is
     *  1 and is overwritten (all @p rows rows) when it is 0, which saves zeroing a fresh
     *  buffer first; dw [G,O,I] is written as @p dw_mode says (::moe_dw_mode: a moe_real
     *  buffer added to or overwritten, or an activation-type buffer overwritten), every
     *  group's block included, an empty group's too */
    void (*grouped_matmul_backward_dev)(void *din, void *dw, const void *dout,
                                        const void *in, const void *w, const int *dev_off,
                                        int G, int rows, int I, int O, int din_accumulate,
                                        moe_dw_mode dw_mode);
    /** grouped_matmul_forward_dev on GATHERED input rows (chapter 03, the fused
     *  permutation): row r of the input is row map[r] / div of @p x [*, I], with @p map
     *  [rows] in backend memory — the permutation's perm_src and its top-k, so the permuted
     *  copy of the tokens is never written. CPU: a gathered copy, then the plain op */
    void (*grouped_matmul_forward_dev_gather)(void *out, const void *x, const int *map, int div,
                                              const void *w, const int *dev_off, int G,
                                              int rows, int I, int O);
    /** grouped_matmul_backward_dev whose forward input was gathered as above (only dw
     *  reads it) */
    void (*grouped_matmul_backward_dev_gather)(void *din, void *dw, const void *dout,
                                               const void *x, const int *map, int div,
                                               const void *w, const int *dev_off, int G,
                                               int rows, int I, int O, int din_accumulate,
                                               moe_dw_mode dw_mode);
    /** grouped_matmul_forward_dev with its output rows SCATTERED (chapter 03, the fused
     *  permutation's fc2): row r of the result (r < dev_off[G]) is stored at row map[r] of
     *  @p out, with @p map [rows] in backend memory — the permutation's perm_src, so out is
     *  in token-slot order (row n·k + j) and the combine a contiguous sum
     *  (unpermute_sum_slots). Rows of out that no r maps to are not written. CPU: the plain
     *  op, then the rows moved */
    void (*grouped_matmul_forward_dev_scatter)(void *out, const void *in, const int *map,
                                               const void *w, const int *dev_off, int G,
                                               int rows, int I, int O);
    /** as moe_cpu_embedding_forward() */
    void (*embedding_forward)(void *out, const int *tokens, const void *table, int N, int C);
    /** as moe_cpu_embedding_backward() */
    void (*embedding_backward)(moe_real *dtable, const void *dout, const int *tokens, int N, int V,
                               int C);
    /** as moe_cpu_rmsnorm_forward() */
    void (*rmsnorm_forward)(void *out, moe_real *rstd, const void *x, const void *w, int N, int C,
                            double eps);
    /** as moe_cpu_rmsnorm_backward() */
    void (*rmsnorm_backward)(void *dx, moe_real *dw, const void *dout, const void *x,
                             const void *w, const moe_real *rstd, int N, int C);
    /** as moe_cpu_rope_forward(): rows are positions pos0 .. pos0+T−1 of each sequence */
    void (*rope_forward)(void *out, const void *in, int B, int T, int heads, int D, int pos0,
                         double base);
    /** as moe_cpu_rope_backward() */
    void (*rope_backward)(void *din, const void *dout, int B, int T, int heads, int D, int pos0,
                          double base);
    /**
     * The attention op contract (chapter 07's flash attention and context parallelism fill
     * the same three slots). The caller owns q, k, v, y, lse [B,Hq,Tq] (full precision) and
     * one opaque workspace per attention call it will differentiate, of
     * attention_workspace_bytes() bytes (a workspace sized for a shape serves every smaller
     * one; none is allocated for 0 bytes, and the ops then get NULL): what the forward leaves
     * there is for the backward of the same call. The contract has no [B,H,T,T] buffer: both
     * backends run flash attention and recompute the probabilities from lse in the backward;
     * the CPU's asks for 0 bytes, the CUDA kernels for the backward's row dots δ [B,Hq,Tq]
     * (fp32). A query row that sees no key gets y = 0 and lse = −∞. Both run any chunk of
     * queries against any chunk of keys; the CPU ops abort on a shape that
     * moe_attention_shape_invalid() rejects, the CUDA ops on one that
     * moe_attention_shape_unsupported() rejects (a head dimension above 128).
     */
    size_t (*attention_workspace_bytes)(moe_attention_shape s);
    /** as moe_cpu_attention_forward(): y and the row log-sum-exp lse */
    void (*attention_forward)(void *y, moe_real *lse, void *ws, const void *q, const void *k,
                              const void *v, moe_attention_shape s);
    /** as moe_cpu_attention_backward(): dq, dk, dv accumulate; receives the forward's y,
     *  lse and workspace */
    void (*attention_backward)(void *dq, void *dk, void *dv, const void *dy, const void *y,
                               const moe_real *lse, void *ws, const void *q, const void *k,
                               const void *v, moe_attention_shape s);
    /** as moe_cp_merge() (context parallelism, chapter 07), with y and y_b [B,T,H,D] in the
     *  activation type and lse, lse_b [B,H,T] full precision: the part merged into the
     *  accumulator by their log-sum-exp; a part row at −∞ leaves the row as it is, an
     *  accumulator row at −∞ takes the part. The CPU op is moe_cp_merge() itself */
    void (*cp_merge)(void *y, moe_real *lse, const void *y_b, const moe_real *lse_b, int B,
                     int T, int H, int D);
    /** as moe_cpu_swiglu_forward(): out = silu(g)·u, times the routing weight
     *  row_scale[n] when not NULL (fused: the scaled activation is fc2's input) */
    void (*swiglu_forward)(void *out, const void *gu, const moe_real *row_scale, int N, int F);
    /** as moe_cpu_swiglu_backward(): dgu += …, and drow_scale[n] += Σ_f dout·silu(g)·u
     *  (summed in full precision) when drow_scale is not NULL */
    void (*swiglu_backward)(void *dgu, moe_real *drow_scale, const void *dout, const void *gu,
                            const moe_real *row_scale, int N, int F);
    /** as moe_cpu_cross_entropy_forward() */
    void (*cross_entropy_forward)(moe_real *losses, const void *logits, const int *targets, int N,
                                  int V);
    /** as moe_cpu_cross_entropy_backward() */
    void (*cross_entropy_backward)(void *dlogits, const moe_real *dloss, const void *logits,
                                   const int *targets, int N, int V);
    /** as moe_cpu_cross_entropy_shard_forward(): a vocabulary shard's (log-sum-exp, target
     *  logit) per row, targets local to the shard or −1 (chapter 04) */
    void (*cross_entropy_shard_forward)(moe_real *part, const void *logits, const int *targets,
                                        int N, int V);
    /** as moe_cpu_cross_entropy_shard_merge(): R shards' parts [R,N,2] → losses and lse */
    void (*cross_entropy_shard_merge)(moe_real *losses, moe_real *lse, const moe_real *parts,
                                      int R, int N);
    /** as moe_cpu_cross_entropy_shard_backward(): a shard's columns of the gradient */
    void (*cross_entropy_shard_backward)(void *dlogits, const moe_real *dloss, const void *logits,
                                         const moe_real *lse, const int *targets, int N, int V);
    /** dst = dequantize(quantize(src)) of a [rows, cols] activation-type tensor (chapter 05's
     *  emulated low precision, lib/lowp.h): as moe_cpu_qdq(), through @p ws in backend
     *  memory; dst may be src */
    void (*qdq)(void *dst, const void *src, int rows, int cols, const moe_qdq_spec *spec,
                const moe_qdq_ws *ws);
    /** chapter 05's native FP8 layer, fused (lowp.h, "Fused passes"): the SwiGLU forward
     *  (@ref swiglu_forward's values, rounded to the activation type) writing its 1×128
     *  codes @p q and scales @p s [N][F/128] instead of its output (as @ref fp8_quant_act of
     *  that output), with @p y not NULL also the dequantized copy, or with @p y_raw the
     *  output itself (@ref swiglu_forward's bytes: the FP8 wgrad quantizes it again along
     *  the tokens, lib/fp8_wgrad.h); NULL where @ref fp8_grouped_native is */
    moe_status (*fp8_swiglu_forward_quant)(uint8_t *q, float *s, void *y, int y_raw,
                                           const void *gu, const moe_real *row_scale, int N,
                                           int F, moe_fp8_format f, int pow2, moe_error *err);
    /** ... and the SwiGLU backward into a zero dgu [N, 2F] (@ref swiglu_backward's values,
     *  drow_scale added to alike) writing dgu's 1×128 codes, scales [N][2F/128] and, with
     *  @p y not NULL, its dequantized copy (or with @p y_raw dgu itself) instead of dgu;
     *  NULL where @ref fp8_grouped_native is */
    moe_status (*fp8_swiglu_backward_quant)(uint8_t *q, float *s, void *y, int y_raw,
                                            moe_real *drow_scale, const void *dout,
                                            const void *gu, const moe_real *row_scale, int N,
                                            int F, moe_fp8_format f, int pow2, moe_error *err);
    /** ... and the SwiGLU backward under the FP8 wgrad, tiled: dgu's row-wise codes @p q and
     *  scales @p s as @ref fp8_swiglu_backward_quant's, and its token-wise copy @p qt
     *  [2F][kpad], @p st [kpad/128][2F] as @ref fp8_quant_group_t_act of dgu would give
     *  (the groups @p dev_off, @p G of lib/fp8_wgrad.h), dgu itself never written;
     *  @p drow_scale, when not NULL, added to through @p part [F/128][N] floats (another
     *  summation order than @ref fp8_swiglu_backward_quant's); NULL where no such kernel */
    moe_status (*fp8_swiglu_backward_quant_t)(uint8_t *q, float *s, uint8_t *qt, float *st,
                                              float *part, moe_real *drow_scale,
                                              const void *dout, const void *gu,
                                              const moe_real *row_scale, const int *dev_off,
                                              int G, int N, int F, size_t kpad,
                                              moe_fp8_format f, int pow2, moe_error *err);
    /** ... and the SwiGLU forward under the FP8 wgrad, tiled: the output's row-wise codes
     *  @p q and scales @p s as @ref fp8_swiglu_forward_quant's, and its token-wise copy
     *  @p qt [F][kpad], @p st [kpad/128][F] as @ref fp8_quant_group_t_act of the output would
     *  give (the groups @p dev_off, @p G of lib/fp8_wgrad.h), the output itself never
     *  written: fc2's FP8 wgrad reads that copy, kept for the backward; NULL where no such
     *  kernel */
    moe_status (*fp8_swiglu_forward_quant_t)(uint8_t *q, float *s, uint8_t *qt, float *st,
                                             const void *gu, const moe_real *row_scale,
                                             const int *dev_off, int G, int N, int F,
                                             size_t kpad, moe_fp8_format f, int pow2,
                                             moe_error *err);
    /** dst [m, cols] = the QDQ along the tokens of src [n, cols] (a wgrad operand, NVFP4's
     *  random Hadamard transform: lib/lowp.h), tokens zero-padded to m: as moe_cpu_qdq_t(),
     *  through @p ws in backend memory; dst is not src */
    void (*qdq_t)(void *dst, const void *src, int n, int m, int cols, const moe_qdq_spec *spec,
                  const moe_qdq_ws *ws);
    /** chapter 05's native FP8 expert GEMMs (lowp.h, ::moe_fp8_weight): 1 when this device
     *  runs them (our FP8 grouped kernel, sm_90a); NULL on a backend that has none (the CPU),
     *  which then runs the recipe emulated through @ref qdq */
    int (*fp8_grouped_native)(void);
    /** blockwise 1×128 quantize of an activation-type [rows, cols]: codes @p q, scales @p s
     *  [rows][cols/128] (as moe_cpu_quant_blockwise() of its fp32 values), and when @p y is
     *  not NULL the dequantized values in the activation type (@ref qdq's bytes) in the same
     *  pass (chapter 05's native FP8 GEMMs, and the FP8 dispatch on every backend) */
    moe_status (*fp8_quant_act)(uint8_t *q, float *s, void *y, const void *x, int rows,
                                int cols, moe_fp8_format f, int pow2, moe_error *err);
    /** the inverse of fp8_quant_act: 1×128 codes @p q and scales @p s [rows][cols/128]
     *  dequantized into the activation type @p y, the same bytes as its @p y (chapter 05's
     *  FP8 dispatch: the received codes become the experts' input rows) */
    moe_status (*fp8_dequant_act)(void *y, const uint8_t *q, const float *s, int rows,
                                  int cols, moe_fp8_format f, moe_error *err);
    /** blockwise quantize of @p batch activation-type matrices [rows, cols] stored one after
     *  the other, each with its transposed copy [cols, rows] from the same read (as
     *  moe_cpu_quant_blockwise_t() of each); NULL where @ref fp8_grouped_native is */
    moe_status (*fp8_quant_t_act)(uint8_t *q, float *s, uint8_t *qt, float *st, const void *x,
                                  int batch, int rows, int cols, moe_fp8_format f, int block_2d,
                                  int pow2, moe_error *err);
    /** the FP8 grouped GEMM of lib/fp8_gemm.h (moe_fp8_grouped_check()'s contract, the
     *  offsets in backend memory), D in the activation type, or fp32 when @p d_fp32; NULL
     *  where @ref fp8_grouped_native is */
    moe_status (*fp8_grouped_gemm)(void *d, int d_fp32, const struct moe_qmatrix *a,
                                   const struct moe_qmatrix *b, const int *dev_off, int G,
                                   int rows, int N, int K, moe_error *err);
    /** chapter 05's native FP8 dense linears (lowp.h, "Native FP8 dense linears"): the
     *  low-precision GEMM of lib/fp8_gemm.h, D[M,N] = A[M,K]·B[N,K]ᵀ (moe_fp8_gemm_check()'s
     *  contract; cuBLASLt on sm_90), D in the activation type, overwritten or, with
     *  @p accumulate, added to (D += A·Bᵀ); NULL on a backend that has none (the CPU) */
    moe_status (*fp8_gemm)(void *d, int accumulate, const struct moe_qmatrix *a,
                           const struct moe_qmatrix *b, int M, int N, int K, moe_error *err);
    /** chapter 05's FP8 wgrad (lib/fp8_wgrad.h): the token-wise FP8 copy [C][kpad] (scales
     *  [kpad/128][C]) of an activation-type [rows][C] per group, @p off [G+1] in backend
     *  memory (as moe_cpu_quant_group_t()); NULL where @ref fp8_grouped_native is */
    moe_status (*fp8_quant_group_t_act)(uint8_t *qt, float *st, const void *x, const int *off,
                                        int G, int rows, int C, size_t kpad, moe_fp8_format f,
                                        int pow2, moe_error *err);
    /** the FP8 grouped wgrad of lib/fp8_wgrad.h on two such copies: dw [G][M][N] written as
     *  @p mode says (::moe_dw_mode); NULL where @ref fp8_grouped_native is */
    moe_status (*fp8_grouped_wgrad)(void *dw, moe_dw_mode mode, const uint8_t *qa,
                                    const float *sa, const uint8_t *qb, const float *sb,
                                    const int *off, int G, size_t kpad, int M, int N,
                                    moe_error *err);
    /** the emulation's token-wise QDQ of the FP8 wgrad's operands: dst [rows][cols] = the
     *  dequantized values of the copy above (moe_cpu_qdq_group_t(); the activation type, so
     *  bf16 on CUDA), @p off in backend memory; rows from off[G] on not written; dst may be
     *  src */
    void (*qdq_group_t)(void *dst, const void *src, const int *off, int G, int rows, int cols,
                        moe_fp8_format f, int pow2);
    /** y += x over n activations (residual connections) */
    void (*add)(void *y, const void *x, size_t n);
    /** x *= s over n activations */
    void (*scale)(void *x, double s, size_t n);
    /**@}*/

    /** @name MoE ops */
    /**@{*/
    /** as moe_cpu_router_forward() (router math in fp32) */
    void (*router_forward)(int *topk_idx, moe_real *topk_w, const void *logits, const float *bias,
                           const moe_router_params *p, int N);
    /** as moe_cpu_router_backward() */
    void (*router_backward)(void *dlogits, const moe_real *dtopk_w, const void *logits,
                            const int *topk_idx, const moe_router_params *p, int N);
    /** as moe_cpu_aux_loss_counts(); @p counts [groups,E] in BACKEND memory (the ranks
     *  sharing the groups sum it with a device collective), the logits are this rank's rows */
    void (*aux_loss_counts)(long long *counts, const void *logits, const moe_aux_shape *s);
    /** *acc += moe_cpu_aux_loss_forward_shard(); @p acc [1] and @p counts in BACKEND memory,
     *  so the loss stays on the device (chapter 06: no host sync in the step) */
    void (*aux_loss_forward)(double *acc, const void *logits, const long long *counts,
                             const moe_aux_shape *s, double coeff);
    /** as moe_cpu_aux_loss_backward_shard(); @p counts in BACKEND memory */
    void (*aux_loss_backward)(void *dlogits, const void *logits, const long long *counts,
                              const moe_aux_shape *s, double coeff, double scale);
    /** *acc += moe_cpu_z_loss_forward(); @p acc [1] in BACKEND memory */
    void (*z_loss_forward)(double *acc, const void *logits, int N, int E, double coeff);
    /** as moe_cpu_z_loss_backward() */
    void (*z_loss_backward)(void *dlogits, const void *logits, int N, int E, double coeff,
                            double scale);
    /** as moe_cpu_permute_index(): perm_src/row_of in device memory; expert_offset and
     *  counts are HOST arrays (the host sync of the naive loop); @p dev_offset, when not
     *  NULL, gets the same E+1 offsets in device memory (for the grouped kernel) */
    void (*permute_index)(int *perm_src, int *row_of, int *expert_offset, int *dev_offset,
                          long long *counts, const int *topk_idx, int N, int k, int E);
    /** as moe_cpu_permute_index_budget(): every output in backend memory, @p flags the
     *  step-flags word (moe_model::step_flags) — no host round trip, nothing waits (chapter
     *  06's sync-free layer); the permuted buffers hold @p budget rows */
    void (*permute_index_budget)(int *perm_src, int *row_of, int *expert_offset, int *flags,
                                 const int *topk_idx, int N, int k, int E, int budget);
    /** as moe_cpu_fused_plan(): every array in backend memory (chapter 06, the fused
     *  dispatcher's plan without the host) */
    void (*fused_plan)(int *shift, int *expert_offset, int *flags, const int *all_off, int P,
                       int rank, int E, int budget);
    /** as moe_cpu_permute_tokens() */
    void (*permute_tokens)(void *xp, const void *x, const int *perm_src, int rows, int k, int C);
    /** as moe_cpu_permute_weights() */
    void (*permute_weights)(moe_real *wp, const moe_real *topk_w, const int *perm_src, int rows);
    /** as moe_cpu_unpermute_sum() (the k rows are summed in fp32) */
    void (*unpermute_sum)(void *out, const void *yp, const int *row_of, int N, int k, int C);
    /** as moe_cpu_unpermute_sum_slots() (the same sums, bit for bit, on slot-ordered rows) */
    void (*unpermute_sum_slots)(void *out, const void *ys, const int *row_of, int N, int k,
                                int C);
    /** as moe_cpu_unpermute_weights() */
    void (*unpermute_weights)(moe_real *dtopk_w, const moe_real *dwp, const int *row_of, int N,
                              int k);
    /** dst[r,:] = src[map[r],:], or zeros where map[r] < 0 (dispatcher layouts, padding) */
    void (*gather_rows)(void *dst, const void *src, const int *map, int rows, int C);
    /** dst[r] = src[map[r]], or 0 where map[r] < 0 (full precision) */
    void (*gather_reals)(moe_real *dst, const moe_real *src, const int *map, int rows);
    /**@}*/

    /** @name optimizer (full precision) */
    /**@{*/
    /** *acc += Σ x² over n elements, in double; @p acc [1] in BACKEND memory */
    void (*sum_squares)(double *acc, const moe_real *x, size_t n);
    /** *acc += Σ x over n elements, in double; @p acc [1] in BACKEND memory */
    void (*sum)(double *acc, const moe_real *x, size_t n);
    /** dst[i] += src[i], i < n: doubles in BACKEND memory (partial sums of the step) */
    void (*add_f64)(double *dst, const double *src, int n);
    /** x *= s over n full-precision elements */
    void (*scale_real)(moe_real *x, double s, size_t n);
    /** one AdamW update (moe_adamw_update()) of every element of the runs @p runs
     *  (op_types.h) in ONE call (on CUDA one launch: a block per chunk), run r's
     *  elements i < n being p[weight + i], g[grad + i], m[state + i], v[state + i], with
     *  weight decay @p wd where the run has `decay`, else none; bc1/bc2 are the bias
     *  corrections 1−βᵗ. @p act (or NULL) receives the compute copy of each element after
     *  the call: act[grad + i] = what cast_to_act writes for p[weight + i] (bitwise), so
     *  no cast pass follows the step. @p clip (or NULL: 1) is the clip factor each gradient
     *  is multiplied by first, and while @p flags (or NULL) holds any ::MOE_STEP_OVERFLOW /
     *  ::MOE_STEP_NONFINITE bit p, m and v are not written (act still receives the copy of
     *  the unchanged p): both [1] in BACKEND memory, read by the device, so the host never
     *  decides. @p hyper (or NULL: the arguments) is {lr, bc1, bc2} [3] in BACKEND memory:
     *  the values that change every step, read by the device so that a captured step
     *  replays with the current ones (chapter 06) */
    void (*adamw)(const moe_adamw_runs *runs, moe_real *p, const moe_real *g, float *m,
                  float *v, void *act, double lr, double beta1, double beta2, double eps,
                  double wd, double bc1, double bc2, const double *clip, const int *flags,
                  const double *hyper);
    /**@}*/

    /** @name the step's scalars on the device (chapter 06; step_scalars.h) */
    /**@{*/
    /** as moe_step_loss_accumulate(): a micro-batch's {Σ CE, aux, z} into the step's
     *  {loss, ce, aux, z}; both in BACKEND memory */
    void (*loss_accumulate)(double *step, const double *mb, int N, double accum);
    /** as moe_step_grad_norm_finalize(): the norm, the clip factor and the non-finite bit
     *  from the squares of each group; all pointers in BACKEND memory */
    void (*grad_norm_finalize)(moe_step_scalars *s, double max_norm, int check);
    /** load[e] += how many of the N·k picks @p topk_idx [N,k] are expert e (BACKEND memory) */
    void (*expert_load_add)(long long *load, const int *topk_idx, int N, int k, int E);
    /** as moe_expert_bias_update() on one layer's @p bias [E] from its @p load [E], unless
     *  @p flags holds a bit (the step is skipped); all in BACKEND memory */
    void (*expert_bias_update)(float *bias, const long long *load, int E, double rate,
                               const int *flags);
    /** page-locked host memory for the step boundary's readback (plain malloc on the CPU),
     *  zeroed; NULL on failure */
    void *(*host_alloc)(size_t bytes);
    /** release host_alloc's memory (NULL: no-op) */
    void (*host_free)(void *p);
    /** queue a device → host copy into host_alloc'd @p dst and record an event after it;
     *  returns at once (the CPU copies at once) */
    void (*to_host_async)(void *dst, const void *src, size_t bytes);
    /** wait for the event of the last to_host_async: the step boundary's one wait */
    void (*wait_to_host)(void);
    /** queue a host → device copy from host_alloc'd @p src; returns at once. @p src must not
     *  change until the copy has run (the step boundary's wait): the training step's
     *  batches and AdamW's step scalars come this way, so a captured step can replay the
     *  copy (a copy from pageable memory waits, and cannot be captured) */
    void (*from_host_async)(void *dst, const void *src, size_t bytes);
    /**@}*/
} moe_backend;

/** @brief The CPU reference backend (lib/cpu/backend.c). @return a static table */
const moe_backend *moe_backend_cpu(void);

/* The CUDA backend (kernels/backend_cuda.cu) implements these two in builds with
 * MOE_HAVE_CUDA. lib/ declares them and never includes a kernels/ header: the CUDA side
 * fills an interface the library defines, not the other way round. */

/** @brief 1 when a CUDA device is usable (driver present, at least one GPU); CUDA builds
 *  only. @return 0 or 1 */
int moe_cuda_available(void);

/** @brief The CUDA op table (device pointers, bf16 activations); CUDA builds only.
 *  @return a static table */
const moe_backend *moe_backend_cuda(void);

/**
 * @brief Resolve `--device` to a backend.
 * @param name "auto", "cpu" or "cuda"
 * @param out receives the backend
 * @param err receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_BACKEND when cuda is asked for but not available (with the fix)
 */
moe_status moe_backend_select(const char *name, const moe_backend **out, moe_error *err);

#ifdef __cplusplus
}
#endif

#endif /* MOE_BACKEND_H */
