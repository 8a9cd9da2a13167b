/**
 * @file lowp.h
 * @brief Chapter 05: training in FP8 / NVFP4, **emulated** ("low precision"). Every linear
 *        layer's GEMM operands go through the recipe's quantize → dequantize (QDQ, fake
 *        quantization) and the GEMM itself runs in the usual precision.
 *
 * The flags are Megatron's: `--fp8-format e4m3|hybrid` with `--fp8-recipe
 * tensorwise|delayed|blockwise|mxfp8` (delayed: `--fp8-amax-history-len`,
 * `--fp8-amax-compute-algo max|most_recent`, `--fp8-margin`), or `--fp4-format e2m1` with
 * `--fp4-recipe nvfp4`. They act on
 * every linear layer: the attention's Q, K, V and output projections, the routed experts'
 * fc1 and fc2, the shared expert and the dense FFNs. The router, the norms, the softmax, the
 * attention core, the embedding, the LM head and the optimizer stay as they are.
 *
 * What is quantized, for a linear layer y = x·Wᵀ:
 *  - forward: x (role ::MOE_LOWP_ACTIVATION) and W (::MOE_LOWP_WEIGHT);
 *  - backward: dy (::MOE_LOWP_GRADIENT) in both GEMMs, dx = Q(dy)·Q(W) and dW = Q(dy)ᵀ·Q(x).
 *
 * | recipe | activation | weight | gradient |
 * |---|---|---|---|
 * | tensorwise | E4M3, one scale (current amax) | E4M3, one scale per tensor (per expert) | E4M3 (`hybrid`: E5M2) |
 * | delayed | as tensorwise, the scale from the amax history of the tensor's call site | as tensorwise | as tensorwise |
 * | blockwise | 1×128 tiles | 128×128 blocks | 1×128 tiles |
 * | mxfp8 | 1×32, E8M0 scales | 1×32 | 1×32 |
 * | nvfp4 | E2M1, 1×16, E4M3 scales + fp32 per tensor | 16×16 blocks | 1×16, stochastic rounding |
 *
 * **Straight-through estimator.** The quantizer is piecewise constant, so its true derivative
 * is 0 almost everywhere. Like every low-precision trainer, the backward treats QDQ as the
 * identity for the gradient: dx = Q(dy)·Q(W) is used as ∂L/∂x and dW = Q(dy)ᵀ·Q(x) as
 * ∂L/∂W, as if y were x·Wᵀ evaluated on the quantized operands. The gradients that reach
 * the master weights are those of the quantized model, passed straight through Q. (NVFP4's
 * wgrad takes dW = Q_t(dy)ᵀ·Q_t(x), its operands quantized along the tokens with the
 * Hadamard transform: another estimate of the same ∂L/∂W, below.)
 *
 * **What differs from a native FP8 GEMM.** The products and sums: a native GEMM accumulates
 * the codes' products in fp32 and applies the scales per block; the emulation multiplies the
 * dequantized values (exactly representable in fp32) in the GEMM's own order. On CUDA the
 * dequantized values are rounded to bf16 (activations are bf16 there), which a scale that is
 * not a power of two can change in the last bits. One QDQ per tensor serves both backward
 * GEMMs: the blockwise recipes' wgrad operands are tiled along the rows as for the dgrad
 * GEMM, where a native kernel tiles them along the tokens (the transposed copy) — except the
 * routed experts' under the FP8 wgrad (lib/fp8_wgrad.h; blockwise's default,
 * `MOE_FP8_WGRAD=0` turns it off), tiled along each expert's tokens. (With power-of-two
 * scales the two tilings give different values only where an element falls into the
 * subnormals of its block: E4M3's relative precision does not depend on the scale.) NVFP4's
 * wgrad is the other exception: it quantizes dy and x along the tokens with the random
 * Hadamard transform (moe_lowp_wgrad(), TransformerEngine's
 * NVFP4BlockScaling; off with `--fp4-disable-rht`), so dW = Q_t(dy)ᵀ·Q_t(x) there, a second
 * quantization of dy.
 *
 * **Delayed scaling** (TransformerEngine's DelayedScaling): each tensor a linear layer
 * quantizes is cast with a scale chosen from the amaxes of the previous steps at its call
 * site, and its own amax is recorded for the next ones. The state is a table of sites
 * (layer, linear, role; per expert for the routed experts) in backend memory, found by the
 * call site's identity, not by call order, because the backward quantizes a saved input
 * again: that QDQ replays the forward's scale and records nothing (moe_lowp_qdq_saved()).
 * The first tensor at a site takes current scaling. Details in lib/lowp.c, "Delayed
 * scaling"; the table is saved in checkpoints. Not done: Megatron's `--fp8-interval`
 * (deprecated there; every step updates here). On several ranks the windows are max-reduced
 * over the replicas after each micro-batch (moe_lowp_reduce_amax()).
 *
 * **Refused at start-up** (named errors): the distributed optimizer, the fused permutation,
 * a per-tensor recipe (tensorwise, delayed, NVFP4) under TP/ETP or with the sync-free MoE
 * layer (whose static budget of rows holds stale rows past the step's count), delayed
 * and any linear width that is not a multiple of the
 * recipe's block. NVFP4 runs under CUDA graphs: its stochastic rounding's draw counter
 * (@ref moe_lowp::sr_calls) is in backend memory and advanced by the quantize kernels.
 *
 * **Native FP8 on Hopper** (blockwise, `e4m3`, our grouped kernel: moe_lowp_native()). The
 * routed experts' forward and dgrad GEMMs run on FP8 codes in our FP8 grouped kernel (lib/
 * fp8_gemm.h) instead of the emulation's bf16 GEMM on dequantized values, at the SAME
 * quantization points, so the products are the emulation's exactly (E4M3 codes times
 * power-of-two scales are exact in bf16 and fp32) and only the summation differs:
 *  - forward y = x·Wᵀ: x quantized 1×128 along I (one pass from bf16), W as its 128×128
 *    codes (::moe_fp8_weight, made once per step);
 *  - dgrad dx = dy·W = dy·(Wᵀ)ᵀ: dy quantized 1×128 along O (the emulation's Q(dy)), and the
 *    K-major transposed copy of each expert's W, made in the same pass as the forward
 *    codes by the fused quantize+transpose kernel (a 128×128 block transposes exactly: the
 *    same codes, its scale moves to the transposed position);
 *  - wgrad dW = Q_t(dy)ᵀ·Q_t(x), by default in FP8 too, as the recipe has it (DeepSeek-V3,
 *    TransformerEngine's Float8BlockScaling; ::moe_lowp::fp8_wgrad, lib/fp8_wgrad.h): dy and x
 *    quantized 1×128 along the TOKENS of each expert into K-major copies (each expert's
 *    tokens from a 128-aligned column), then our FP8 wgrad kernel; the emulation then QDQs
 *    the routed experts' wgrad operands the same way (the grouped path: CPU
 *    `--moe-expert-backend grouped`), so the CPU twin of the expert backward is what the GPU
 *    computes up to the summation order. The fused passes (below) run with it too, keeping
 *    the bf16 SwiGLU output and dgu that the token-wise copies are made from. With
 *    `MOE_FP8_WGRAD=0` (the course's first arrangement) the wgrad is a bf16 grouped GEMM on
 *    the row-wise dequantized operands, as emulated (the pass that quantizes dy writes its
 *    dequantized copy too): on an H100 the Mixtral layer 1.05x slower (results 05).
 *
 * **Fused passes** (the native path, `MOE_FP8_FUSED` unset or 1; lib/mlp.c,
 * moe_mlp_fp8_fused()). No pass reads bf16 only to write FP8 around the SwiGLU: its forward
 * writes the 1×128 codes and scales of its output (fc2's A) instead of the output, and they
 * are kept for the backward in the output's own buffer, allocated at their size: N·F + N·F/32
 * bytes instead of 2·N·F, N·F·31/32 bytes saved per MoE layer (moe_mlp_act_bytes(), the one
 * size of every such buffer; lib/memory.c counts and reports it, `memory|` in moe-train).
 * Since the buffer's size depends on it, the switch is read once, when the context is made
 * (moe_lowp::fp8_fused), not per call;
 * fc2's bf16 wgrad dequantizes them once (1 byte read, 2 written per element, instead of
 * quantizing the saved bf16 output again: 2 read, 3 written); the SwiGLU backward writes
 * dgu's codes (fc1's dgrad) and dequantized copy (fc1's wgrad), not dgu. The same bits as the
 * separate passes (tests/gpu_fp8_fused.c, gpu_fp8_layer.c). `MOE_FP8_FUSED=0` (set before the
 * model is made) runs the separate passes, the SwiGLU output then kept in bf16. Not
 * fused yet: x is still quantized by its own pass in the forward and again in the backward
 * (its codes are not kept), and dy by its own pass.
 * With the FP8 wgrad (the default; not under `MOE_FP8_WGRAD=0`) the fused passes run in a
 * second arrangement (lib/mlp.c; passed its GPU tests on an H100 at 3d50c58): its token-wise
 * copies are made from the bf16 SwiGLU output and dgu, so the fused SwiGLU forward and
 * backward write those (y_raw) next to the row-wise codes, instead of the dequantized copy;
 * fc2's forward and fc1's dgrad read the codes from the context's scratch. The SwiGLU
 * output's token-wise copy is instead written by a tiled forward (`MOE_FP8_SAVE_T`, on;
 * moe_lowp::fp8_save_t), which keeps it for the backward in place of the bf16 output: F·Kpad
 * bytes and F·Kpad/32 of scales (Kpad ≤ N + 127·G, each expert's tokens padded to 128)
 * instead of 2·N·F, and neither the bf16 write, nor the backward's token-wise pass over it
 * (moe_mlp_saved_form(): one sizing rule; `MOE_FP8_SAVE_T=0` keeps the bf16 output).
 * In that form the experts' input x is kept likewise (moe_layer_keeps_x_t(): on every
 * dispatcher, and with ETP the rows gathered over the group): its token-wise copy, fc1's
 * wgrad operand, is made in the forward and kept after the output's in the same buffer, and
 * the rows become scratch (H·Kpad·33/32 bytes kept instead of 2·N·H; the same bits).
 * Against the separate passes: 14·N·F bytes fewer per MoE layer of N rows (the forward's
 * re-read of the output, 2·N·F; the backward's zeroing of dgu, the SwiGLU's read of it and
 * the quantizer's, 4·N·F each) and two launches; the same bits (tests/gpu_fp8_fused.c,
 * gpu_fp8_layer.c). dgu's token-wise copy is part of the backward (`MOE_FP8_FUSED_T`, on;
 * moe_lowp::fp8_fused_t; 0 makes it a pass of its own): the token-wise scale of a channel
 * needs the amax over each expert's 128-token blocks, which a row-wise pass does not see,
 * so a tiled SwiGLU backward (kernels/swiglu_quant.cu, "tiled") computes
 * 128 tokens × 128 channels of dgu at a time, in the token-wise copy's blocks, and writes
 * their row-wise codes (fc1's dgrad) and their token-wise copy (fc1's FP8 wgrad), never dgu:
 * 8·N·F bytes fewer (dgu written and read back). The same codes and scales as the separate
 * passes; the routing weight's gradient sums its F channels in 128-channel blocks, another
 * order, so it agrees to fp32 rounding (tests/gpu_fp8_fused.c). STATUS: the default since the
 * whole GPU suite (171/171, the model's losses equal to the separate passes') passed with it
 * on an H100 at eb6afaa. Measured (results 05): with the routing weight, 1.365 ms against
 * 1.527 for the row-wise pass and the token-wise copy on Mixtral's fc1; the Mixtral layer with
 * 31 repeats won three alternating pairs, 22.35 / 22.25 / 22.27 against 22.46 / 22.46 / 22.35.
 * The shared expert, dense FFNs and attention stay emulated unless `MOE_FP8_NATIVE_DENSE=1`
 * (below). Elsewhere (the CPU, a GPU that is not sm_90, `hybrid`'s E5M2 gradients, the other
 * recipes and expert backends) the emulation runs; `MOE_FP8_NATIVE=0` asks for it on Hopper
 * too.
 *
 * **Native FP8 dense linears** (`MOE_FP8_NATIVE_DENSE=1`, off by default; blockwise E4M3 on
 * sm_90 as moe_lowp_native(), any expert backend: moe_lowp_native_dense()). STATUS: passed
 * tests/gpu_fp8_layer.c's "dense" cases on an H100 at 8868409 (native vs the GPU's emulation
 * 6.6e-04 to 1.1e-03 relative; the 6-step model's losses within 1.5e-04) and measured there:
 * SLOWER at the sizes this library trains — 0.86x the emulated dense layers' tokens/s on the
 * GPU preset (hidden 384), 0.96x on convergence.sh's larger model (hidden 1024) — so off
 * (docs/results/05-fp8-nvfp4.md, "Native FP8 for the dense linears"). Every other linear layer —
 * attention's Q, K, V and output projections, the dense FFN's and the shared expert's fc1
 * and fc2 — runs the experts' arrangement through the dense FP8 GEMM of lib/fp8_gemm.h
 * (cuBLASLt, be->fp8_gemm), at the emulation's quantization points:
 *  - forward y = x·Wᵀ: x quantized 1×128 along I into the context's codes (one pass; the
 *    attention's Q, K and V GEMMs read the same codes, as they read one QDQ of x), W as its
 *    128×128 codes;
 *  - dgrad dx (+)= dy·W = dy·(Wᵀ)ᵀ: dy quantized 1×128 along O, its dequantized copy written
 *    in the same pass (the emulation's Q(dy), for the wgrad), and the K-major codes of Wᵀ
 *    from the fused quantize+transpose. Attention's dx sums the Q, K and V dgrads: the GEMM
 *    adds into it (cuBLASLt's beta = 1 on a bf16 D, one rounding, as the bf16 GEMM does);
 *  - wgrad dW += Q(dy)ᵀ·Q(x): the bf16 GEMM on the dequantized operands, as emulated.
 * The weights: each dense weight's codes and transposed codes (a ::moe_fp8_weight with
 * G = 1) are made once per optimizer step (moe_lowp_quantize_dense()), from the compute copy
 * before the emulation's in-place QDQ of it, which is kept: the compute copy then holds Q(W)
 * as before, so a call whose shape cuBLASLt's blockwise GEMM does not take (rows not a
 * multiple of 4: moe_lowp_dense_fits()) falls back to the emulation with the same numerics,
 * and the weight pass costs what the emulation already paid. The copies add
 * moe_fp8_weight_bytes(1, O, I) per dense weight (2·O·I bytes and two scale grids), counted
 * by the memory estimate when the switch is on. The switch is read once, when the context
 * is made (@ref moe_lowp::native_dense): the model's buffers depend on it. The counter
 * @ref moe_lowp::dense_gemms counts the native dense GEMMs issued (host side: under a CUDA
 * graph it counts the captures, not the replays), so a test can tell that the path ran.
 *
 * **Buffers.** The weights' compute copy is quantized once per step, in place (the model
 * keeps it apart from the master weights); an activation or gradient goes into one of two
 * scratch buffers of the context, allocated once with the model, and is quantized again in
 * the backward (the same bytes: QDQ is deterministic, and delayed scaling replays the
 * forward's scale; the gradient is quantized there for the first time). Nothing is allocated
 * in a step.
 */
#ifndef MOE_LOWP_H
#define MOE_LOWP_H

#include <stdint.h>

#include "backend.h"
#include "config.h"
#include "error.h"
#include "quantize.h"

#ifdef __cplusplus
extern "C" {
#endif

/** What a tensor is to a GEMM: it picks the recipe's tiling and format. */
typedef enum moe_lowp_role {
    MOE_LOWP_ACTIVATION = 0, /**< a GEMM's input x */
    MOE_LOWP_WEIGHT = 1,     /**< a weight matrix W [O, I] */
    MOE_LOWP_GRADIENT = 2,   /**< an output gradient dy */
    MOE_LOWP_ROLES = 3       /**< number of roles */
} moe_lowp_role;

/** The emulated low precision of a model: the recipe per role and the scratch buffers. */
typedef struct moe_lowp {
    int on;                             /**< 0: no flag given, everything as before */
    char name[48];                      /**< e.g. "fp8 blockwise e4m3" (logs) */
    moe_qdq_spec spec[MOE_LOWP_ROLES];  /**< the recipe of each role */
    size_t cap;                         /**< elements each buffer holds */
    moe_qdq_ws ws;                      /**< the QDQ's fp32 values, codes and scales */
    void *act;                          /**< [cap] the quantized input of the current GEMM */
    void *grad;                         /**< [cap] the quantized output gradient */
    uint64_t seed;                      /**< the stochastic rounding's base seed */
    uint64_t *sr_calls;                 /**< [1] in backend memory: gradient QDQs so far,
                                             the rounding's draw counter (each stochastic
                                             quantize advances it on the device: quantize.h,
                                             moe_nvfp4_opts::sr_counter); read and set with
                                             moe_lowp_sr_calls(), moe_lowp_set_sr_calls() */
    int wgrad_rht;                      /**< NVFP4: 1 (default; 0 with --fp4-disable-rht):
                                             the wgrad quantizes its operands along the tokens
                                             with the random Hadamard transform
                                             (moe_lowp_wgrad()) */
    uint64_t rht_seed;                  /**< the transform's signs, from --seed */
    int native;                         /**< 1: the routed experts run the native FP8 GEMMs
                                             (moe_lowp_native(); the model sets it once, with
                                             its FP8 weights, before its buffers) */
    /* chapter 05's FP8 wgrad (lib/fp8_wgrad.h, MOE_FP8_WGRAD): the routed experts' weight
     * gradients on operands quantized 1×128 along the tokens of each expert */
    int fp8_wgrad;                      /**< 1: blockwise E4M3 unless MOE_FP8_WGRAD=0:
                                             the native path runs the FP8 wgrad kernel, the
                                             emulation its token-wise QDQ */
    int fp8_fused;                      /**< 1: blockwise E4M3 with MOE_FP8_FUSED not 0 when
                                             the context was made: the native path's fused
                                             passes (lib/mlp.c, moe_mlp_fp8_fused()). Read
                                             once, not per call: the routed experts' saved
                                             SwiGLU outputs are allocated at the size it
                                             gives (moe_mlp_act_bytes()), so the switch
                                             cannot change under a buffer */
    int fp8_fused_t;                    /**< 1: fp8_fused, and MOE_FP8_FUSED_T not 0: under
                                             the FP8 wgrad (fp8_wgrad) the SwiGLU backward
                                             writes dgu's token-wise copy itself ("Fused
                                             passes"); no effect without it */
    int fp8_save_t;                     /**< 1: fp8_fused, and MOE_FP8_SAVE_T not 0: under
                                             the FP8 wgrad the SwiGLU forward writes its
                                             output's token-wise copy, which is kept for the
                                             backward instead of the bf16 output ("Fused
                                             passes"; moe_mlp_saved_form()). Latched as
                                             fp8_fused: the buffers are sized from it */
    int native_dense;                   /**< 1: the dense linears run native FP8 GEMMs ("Native
                                             FP8 dense linears"). moe_lowp_from_config() sets
                                             it to the request (the native recipe with
                                             MOE_FP8_NATIVE_DENSE=1, what the memory estimate
                                             counts); the model then keeps it only where
                                             moe_lowp_native_dense() holds, before its
                                             buffers */
    unsigned long long dense_gemms;     /**< native dense FP8 GEMMs issued so far (forward and
                                             dgrad; host counter, for the tests) */
    uint8_t *wg_q;                      /**< the native path's two token-wise copies (codes),
                                             moe_lowp_alloc_fp8_wgrad() */
    float *wg_s;                        /**< their scales */
    size_t wg_elems;                    /**< codes @ref wg_q holds */
    /* delayed scaling (`--fp8-recipe delayed`): a state per call site, "Delayed scaling" */
    int delayed;                        /**< 1: the tensorwise recipe with delayed scaling */
    int hist_len;                       /**< --fp8-amax-history-len */
    moe_amax_algo algo;                 /**< --fp8-amax-compute-algo */
    int margin;                         /**< --fp8-margin */
    int layers;                         /**< the site table's layers (moe_lowp_alloc_delayed()) */
    int experts;                        /**< its routed experts per layer (this rank's) */
    moe_delayed_site *sites;            /**< [moe_lowp_sites()] in backend memory */
    float *history;                     /**< [moe_lowp_sites()][hist_len] in backend memory */
} moe_lowp;

/** Where a linear layer's sites start within a layer's block of the site table
 *  (moe_lowp_site()): attention's Q, K, V, O, then each FFN's fc1 and fc2. */
typedef enum moe_lowp_block {
    MOE_LOWP_ATTN = 0,    /**< +0 Q (its input: Q's, K's and V's), +1 K, +2 V, +3 O */
    MOE_LOWP_DENSE = 4,   /**< the dense FFN: +0 fc1, +1 fc2 */
    MOE_LOWP_SHARED = 6,  /**< the shared expert: +0 fc1, +1 fc2 */
    MOE_LOWP_EXPERTS = 8  /**< routed expert e: +2e fc1, +2e+1 fc2 */
} moe_lowp_block;

/** A routed expert weight [G][O, I] in FP8 for the native path (lowp.h): each expert's
 *  128×128-block codes and, from the same pass, those of its transpose, in backend memory. */
typedef struct moe_fp8_weight {
    uint8_t *q;   /**< [G·O, I] codes, expert g's [O, I] from g·O·I: the forward's B */
    float *s;     /**< [G][O/128][I/128] their scales (1/scale per block) */
    uint8_t *qt;  /**< [G·I, O] the codes of each expert's Wᵀ [I, O]: dgrad's B */
    float *st;    /**< [G][I/128][O/128] their scales (@ref s transposed per expert) */
    int G;        /**< experts */
    int O;        /**< rows of each expert's W (a multiple of 128) */
    int I;        /**< columns (a multiple of 128) */
} moe_fp8_weight;

/**
 * @brief The recipes from the flags (no memory yet): off when neither `--fp8-format` nor
 *        `--fp4-format` is given.
 * @param lp receives the context  @param c the configuration (validated)
 * @param err receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_CONFIG for a combination the flags do not allow
 */
moe_status moe_lowp_from_config(moe_lowp *lp, const moe_config *c, moe_error *err);

/**
 * @brief The start-up check (moe_config_validate() calls it): the flags go together, the
 *        parallel layout is one this slice supports, and every linear layer's widths are
 *        multiples of the recipe's block. The message names the flag, the layer and the fix.
 * @param c the configuration (sizes already validated)  @param err receives the reason
 * @return ::MOE_OK or ::MOE_ERR_CONFIG
 */
moe_status moe_lowp_check_config(const moe_config *c, moe_error *err);

/**
 * @brief The elements of the largest tensor a run quantizes: (the most rows of any GEMM
 *        operand, or the widest width) × the widest width (a weight matrix or an operand).
 *        The widths are the whole layer's (hidden, heads × head_dim, 2·F of each FFN); the
 *        rows are the micro-batch's tokens, or the permuted rows a MoE layer may hold (its
 *        static budget can grow to every assignment that can arrive).
 * @param c config  @param tokens the micro-batch's tokens on this rank (B·T)
 * @param moe_rows the most permuted rows of a MoE layer (0 without MoE layers)
 * @return the element count, for moe_lowp_alloc() and the memory estimate
 */
size_t moe_lowp_cap(const moe_config *c, size_t tokens, size_t moe_rows);

/**
 * @brief The bytes moe_lowp_alloc() allocates for @p cap elements.
 * @param cap elements (moe_lowp_cap())  @param act_size bytes of an activation element
 * @return the bytes of the scratch buffers
 */
size_t moe_lowp_scratch_bytes(size_t cap, size_t act_size);

/**
 * @brief Allocate the scratch buffers in backend memory (nothing when @p lp is off).
 * @param be backend  @param lp the context  @param cap elements of the largest tensor
 *        quantized (rows × width of any GEMM operand, or a weight matrix)
 * @return 1 on success, 0 when out of memory
 */
int moe_lowp_alloc(const moe_backend *be, moe_lowp *lp, size_t cap);

/** @brief Release the buffers. @param be backend @param lp the context (NULL: no-op) */
void moe_lowp_free(const moe_backend *be, moe_lowp *lp);

/**
 * @brief Allocate and initialise delayed scaling's site table in backend memory (nothing
 *        unless lp->delayed): every site's scale 1, an empty history, slot 0.
 * @param be backend  @param lp the context  @param layers the model's layers
 * @param experts the routed experts of a layer on this rank (0 without MoE layers)
 * @return 1 on success, 0 when out of memory
 */
int moe_lowp_alloc_delayed(const moe_backend *be, moe_lowp *lp, int layers, int experts);

/** @brief Sites of the table: layers × (8 + 2·experts) linear layers × 3 roles (0 unless
 *  delayed). @param lp the context (NULL: 0) @return the count */
size_t moe_lowp_sites(const moe_lowp *lp);

/** @brief Bytes of the site table for a configuration (the memory estimate).
 *  @param c config @param experts routed experts per layer on this rank @return bytes */
size_t moe_lowp_delayed_bytes(const moe_config *c, int experts);

/**
 * @brief The linear layer a call site quantizes for, as an index into the site table: layer
 *        @p layer, @p block, and for ::MOE_LOWP_EXPERTS expert @p expert (its fc1; fc2 is
 *        the next). Add 1..3 for attention's K, V, O and 1 for an FFN's fc2.
 * @param lp the context (NULL: 0)  @param layer the layer  @param block which block
 * @param expert the routed expert on this rank (0 otherwise)
 * @return the linear's index (a site is index·3 + role)
 */
int moe_lowp_site(const moe_lowp *lp, int layer, moe_lowp_block block, int expert);

/**
 * @brief QDQ of a GEMM operand [rows, cols] into the context's buffer for its role: a new
 *        tensor (a forward's input, an output gradient). Under delayed scaling it is cast
 *        with the scale of linear @p linear's site for @p role and its amax recorded there.
 * @param be backend  @param lp the context (NULL or off: nothing happens)
 * @param buf [rows, cols] the operand (activation type)  @param rows rows
 * @param cols columns (checked at start-up)  @param role ::MOE_LOWP_ACTIVATION or
 *        ::MOE_LOWP_GRADIENT  @param linear the linear layer (moe_lowp_site())
 * @return the quantized copy (lp->act or lp->grad), or @p buf itself when off
 */
const void *moe_lowp_qdq(const moe_backend *be, moe_lowp *lp, const void *buf, int rows,
                         int cols, moe_lowp_role role, int linear);

/**
 * @brief The backward's QDQ of a saved forward input: the same bytes as the forward's QDQ at
 *        linear @p linear (lowp.h, "Buffers"). Under delayed scaling it replays that
 *        forward's scale and records nothing.
 * @param be backend  @param lp the context (NULL or off: nothing happens)
 * @param buf [rows, cols] the saved input  @param rows rows  @param cols columns
 * @param linear the linear layer the forward quantized it for
 * @return the quantized copy (lp->act), or @p buf itself when off
 */
const void *moe_lowp_qdq_saved(const moe_backend *be, moe_lowp *lp, const void *buf, int rows,
                               int cols, int linear);

/**
 * @brief QDQ of @p groups weight matrices [groups][rows, cols] in place (each expert's
 *        matrix is a tensor of its own: its own scales, and NVFP4's own global scale).
 * @param be backend  @param lp the context (NULL or off: nothing happens)
 * @param w the matrices (activation type)  @param groups how many  @param rows rows of each
 * @param cols columns  @param linear the first matrix's linear layer (moe_lowp_site());
 *        group g's is linear + 2g (the routed experts' layout)
 * @param record delayed scaling: 1 records the weights' amaxes (once per optimizer step),
 *        0 replays the last recorded scales (the weights again, after a checkpoint's load)
 */
void moe_lowp_qdq_weight(const moe_backend *be, moe_lowp *lp, void *w, int groups, int rows,
                         int cols, int linear, int record);

/**
 * @brief Whether the wgrad GEMMs take NVFP4's random Hadamard transform (moe_lowp_wgrad()):
 *        `--fp4-format e2m1` without `--fp4-disable-rht`.
 * @param lp the context (NULL or off: 0)  @return 1 when on
 */
int moe_lowp_wgrad_rht(const moe_lowp *lp);

/**
 * @brief NVFP4's wgrad with the random Hadamard transform (lib/lowp.c, "wgrad"): for each
 *        group g of rows off[g]..off[g+1]: dw_g += Q_t(dy_g)ᵀ·Q_t(x_g), where Q_t quantizes
 *        along the tokens in 16-element blocks after the transform (the same signs for both
 *        operands, so it cancels in the product), the tokens padded to a multiple of 16
 *        with zeros, the gradient with stochastic rounding; each group is a tensor of its
 *        own. Uses lp->grad and lp->act (the dgrad GEMM must be queued before it).
 * @param be backend  @param lp the context (moe_lowp_wgrad_rht() on)
 * @param dw [G][O, I] the weight gradients (accumulated into)
 * @param dout [off[G], O] the output gradient, not quantized  @param in [off[G], I] the
 *        layer's input, not quantized  @param off HOST [G+1] the groups' row offsets
 * @param G groups  @param I input width  @param O output width
 * @param linear the first group's linear layer (moe_lowp_site())
 */
void moe_lowp_wgrad(const moe_backend *be, moe_lowp *lp, moe_real *dw, const void *dout,
                    const void *in, const int *off, int G, int I, int O, int linear);

struct moe_comm;

/**
 * @brief Delayed scaling on several ranks: reduce the amax windows of the site table over
 *        the ranks that hold the same tensors (TransformerEngine's amax reduction group),
 *        so every replica casts with the scale one process would on the whole batch.
 *
 * Each window is replaced by its elementwise maximum over the group (the amaxes as int32
 * bits, moe_comm_all_reduce_max(): exact, NaN wins). The slots a rank did not write this
 * time are equal on every replica already (by induction from the zeroed table), so the max
 * changes only the slots recorded since the last reduction; the next cast reads the window
 * (moe_delayed_record()), so no pass over the sites follows. Which group reduces what:
 *  - attention, dense FFN and shared-expert sites (every block below ::MOE_LOWP_EXPERTS):
 *    over @p dense, the ranks with the same weights and different tokens (DP x CP);
 *  - the routed experts' sites (per local expert, each EP rank holding other experts):
 *    over @p experts, the expert-data-parallel replicas (EDP), never over EP;
 *  - and where the experts' rows are one grouped tensor at local expert 0's sites (the
 *    grouped backends: its activation and gradient roles stand for all this rank's
 *    experts' rows), those two roles once more over @p rows, the ranks whose experts
 *    together make the layer (EP x EDP, = DP x CP without TP), so the amax is that of every
 *    expert's rows, as on one process. (The weight roles stay per expert.)
 * One collective over the whole table where the three are the same group (no EP); else per
 * layer one over the dense block, one over the experts' block and four windows over @p rows.
 * Not under TP/ETP: a shard's amax would first need a max over TP (refused at start-up).
 * @param lp the context (no site table: nothing happens)
 * @param dense DP x CP group (NULL: none)  @param experts EDP group (NULL: none)
 * @param rows the group of the grouped experts' rows (NULL: per-expert sites, the loop)
 */
void moe_lowp_reduce_amax(const moe_lowp *lp, struct moe_comm *dense, struct moe_comm *experts,
                          struct moe_comm *rows);

/**
 * @brief The stochastic rounding's draw counter (lowp.h, "Resuming"): the gradient
 *        quantizations made so far. Reads backend memory (a host sync on CUDA): for
 *        checkpoints and tests, not inside a step.
 * @param be backend  @param lp the context (NULL, off, or no counter: 0)
 * @return the counter
 */
uint64_t moe_lowp_sr_calls(const moe_backend *be, const moe_lowp *lp);

/**
 * @brief Set the draw counter (a checkpoint's load): the next gradient quantization rounds
 *        with draw @p n + 1.
 * @param be backend  @param lp the context (NULL, off, or no counter: nothing happens)
 * @param n the draws already made
 */
void moe_lowp_set_sr_calls(const moe_backend *be, moe_lowp *lp, uint64_t n);

/**
 * @brief Whether the routed experts can run the native FP8 GEMMs on this backend: the
 *        blockwise recipe in E4M3 for every role (not `hybrid`: the kernel is E4M3 × E4M3),
 *        a backend whose be->fp8_grouped_native() says yes (sm_90a), and `MOE_FP8_NATIVE`
 *        not set to 0 in the environment. The caller also needs our grouped kernel as the
 *        expert backend (the native path uses its device offsets).
 * @param be backend  @param lp the context (NULL or off: 0)
 * @return 1 when native
 */
int moe_lowp_native(const moe_backend *be, const moe_lowp *lp);

/**
 * @brief The native path's buffers for the FP8 wgrad (lib/fp8_wgrad.h): the token-wise codes
 *        and scales of both operands of the largest expert wgrad (nothing when
 *        @ref moe_lowp::fp8_wgrad is off).
 * @param be backend  @param lp the context  @param rows the most permuted rows of a MoE layer
 * @param G this rank's experts  @param channels the most O + I of an expert Linear (fc1:
 *        2F + H)  @return 1 on success, 0 when out of memory
 */
int moe_lowp_alloc_fp8_wgrad(const moe_backend *be, moe_lowp *lp, int rows, int G,
                             int channels);

/**
 * @brief The bytes moe_lowp_alloc_fp8_wgrad() allocates (the memory estimate).
 * @param rows as there  @param G as there  @param channels as there  @return bytes
 */
size_t moe_lowp_fp8_wgrad_bytes(int rows, int G, int channels);

/**
 * @brief The recipe half of moe_lowp_native(): blockwise (1×128 activations and gradients,
 *        128×128 weights) in E4M3 for every role. The memory estimate, which sees no
 *        backend, counts the native path's FP8 weight copies where this holds.
 * @param lp the context (NULL or off: 0)  @return 1 when the recipe is the native path's
 */
int moe_lowp_native_recipe(const moe_lowp *lp);

/** @brief Bytes of a ::moe_fp8_weight's buffers. @param G experts @param O rows of each
 *  @param I columns @return the bytes (codes twice, scales twice) */
size_t moe_fp8_weight_bytes(int G, int O, int I);

/**
 * @brief Allocate the buffers of a ::moe_fp8_weight in backend memory.
 * @param be backend  @param fw receives the buffers and the shape
 * @param G experts  @param O rows of each (a multiple of 128)  @param I columns (likewise)
 * @return 1 on success, 0 when out of memory (then nothing is held)
 */
int moe_fp8_weight_alloc(const moe_backend *be, moe_fp8_weight *fw, int G, int O, int I);

/** @brief Release the buffers. @param be backend @param fw the weight (NULL: no-op) */
void moe_fp8_weight_free(const moe_backend *be, moe_fp8_weight *fw);

/**
 * @brief Quantize a routed expert weight [G][O, I] (the compute copy) for the step: with
 *        @p fw, into its FP8 codes and transposed codes (one fused pass, the native path),
 *        leaving @p w as it is; without, QDQ of @p w in place (moe_lowp_qdq_weight(), the
 *        emulation).
 * @param be backend  @param lp the context (NULL or off: nothing happens)
 * @param fw the FP8 weight (allocated for G, O, I) or NULL  @param w the weights
 *        (activation type)  @param G experts  @param O rows of each  @param I columns
 * @param linear the first expert's linear layer (moe_lowp_qdq_weight())
 * @param record 1: record the amaxes, 0: replay (moe_lowp_qdq_weight())
 */
void moe_lowp_quantize_experts(const moe_backend *be, moe_lowp *lp, moe_fp8_weight *fw, void *w,
                               int G, int O, int I, int linear, int record);

/**
 * @brief Whether the dense linears can run the native FP8 GEMMs ("Native FP8 dense linears"):
 *        asked for (@ref moe_lowp::native_dense, from `MOE_FP8_NATIVE_DENSE=1`), the native
 *        path's recipe and device (moe_lowp_native(): blockwise E4M3, sm_90a, `MOE_FP8_NATIVE`
 *        not 0), and a backend with the dense FP8 GEMM and the quantizers.
 * @param be backend  @param lp the context (NULL or off: 0)  @return 1 when native
 */
int moe_lowp_native_dense(const moe_backend *be, const moe_lowp *lp);

/**
 * @brief Whether one dense linear's call runs natively: its FP8 weight was made (@p fw and
 *        its codes given) and cuBLASLt's blockwise GEMM takes @p rows (a multiple of 4,
 *        lib/fp8_gemm.h: M = 1, 2, 301, 302 were refused on an H100); else the caller runs
 *        the emulation, whose Q(W) the compute copy still holds.
 * @param lp the context  @param fw the weight's FP8 copy or NULL  @param rows the tokens
 * @return 1 when native
 */
int moe_lowp_dense_fits(const moe_lowp *lp, const moe_fp8_weight *fw, int rows);

/**
 * @brief The native forward of @p n dense linears that share their input: out_i[rows, O_i] =
 *        Q(x)·Q(W_i)ᵀ, x [rows, I] quantized 1×128 once into the context's codes, each W_i
 *        as its 128×128 codes (O_i = fw[i]->O). moe_lowp_dense_fits() must hold for each.
 * @param be backend  @param lp the context  @param out [n] outputs (activation type,
 *        overwritten)  @param fw [n] the FP8 weights  @param n how many  @param x the input
 *        (activation type)  @param rows its rows  @param I its columns (each fw[i]->I)
 */
void moe_lowp_dense_forward(const moe_backend *be, moe_lowp *lp, void *const *out,
                            const moe_fp8_weight *const *fw, int n, const void *x, int rows,
                            int I);

/**
 * @brief The native dgrad of a dense linear: din[rows, I] (+)= Q(dout)·Q(W) on the codes of
 *        Wᵀ, dout [rows, O] quantized 1×128 along O in one pass that also writes its
 *        dequantized copy Q(dout) into lp->grad (the bf16 wgrad's operand, the emulation's
 *        bytes). moe_lowp_dense_fits() must hold.
 * @param be backend  @param lp the context  @param din [rows, I] (activation type) or NULL
 *        (then only Q(dout) is made)  @param accumulate 1: din += the product, 0: din =
 * @param fw the FP8 weight [O, I]  @param dout the output gradient  @param rows its rows
 * @return Q(dout), [rows, O] in lp->grad
 */
const void *moe_lowp_dense_dgrad(const moe_backend *be, moe_lowp *lp, void *din, int accumulate,
                                 const moe_fp8_weight *fw, const void *dout, int rows);

/**
 * @brief Quantize a dense linear's weight [O, I] (the compute copy) for the step: with
 *        @p fw, first into its FP8 codes and transposed codes (one fused pass, "Native FP8
 *        dense linears"), then, in every case, the emulation's QDQ of @p w in place
 *        (moe_lowp_qdq_weight(): the fallback's operand).
 * @param be backend  @param lp the context (NULL or off: nothing happens)
 * @param fw the FP8 weight (allocated for 1, O, I) or NULL  @param w the weight (activation
 *        type)  @param O rows  @param I columns  @param linear its linear layer
 *        (moe_lowp_site())  @param record as moe_lowp_qdq_weight()
 */
void moe_lowp_quantize_dense(const moe_backend *be, moe_lowp *lp, moe_fp8_weight *fw, void *w,
                             int O, int I, int linear, int record);

#ifdef __cplusplus
}
#endif

#endif /* MOE_LOWP_H */
