/**
 * @file attention.h
 * @brief The attention block of a layer: QKV projections → optional QK-norm → RoPE →
 *        causal grouped-query attention → output projection.
 *
 * The layer (model.c) normalises its input and adds the residual; this module is what
 * lies between, for N = B·T tokens of hidden size H:
 *
 *     q = x·Wqᵀ [N,Hq·D]     k = x·Wkᵀ [N,Hkv·D]     v = x·Wvᵀ [N,Hkv·D]
 *     q, k ← RMSNorm over each head vector   (QK-norm, when enabled: Qwen3)
 *     q, k ← RoPE at positions pos0 .. pos0+T−1 (under CP: each chunk's own positions)
 *     y, lse = attention(q, k, v)             (the op contract of backend.h)
 *     out = y·Woᵀ [N,H]
 *
 * The attention op is the backend's: this module only owns its buffers. Per layer it keeps
 * what the backward reads (q, k, v and their normed and rotated versions, y, the row
 * log-sum-exp lse and the op's workspace); the input-gradient buffers of the backward are
 * scratch that every layer shares (layers run one at a time).
 *
 * The op contract is what chapter 07 fills with flash attention and context parallelism:
 * attention returns lse [B,Hq,T] beside y and receives both in its backward; RoPE takes the
 * position offset pos0 of a chunk of the sequence; and no [B,H,T,T] probability buffer
 * appears in it: the workspace is opaque and sized by the backend
 * (attention_workspace_bytes). The CPU backend's flash attention asks for none (op_ws stays
 * NULL), the CUDA flash kernels for their backward's row dots δ [B,Hq,T] (fp32).
 */
#ifndef MOE_ATTENTION_H
#define MOE_ATTENTION_H

#include "backend.h"
#include "config.h"
#include "context_parallel.h"

struct moe_fp8_weight; /* lowp.h: a weight's FP8 codes (chapter 05's native path) */

/** Sizes and options of one attention call. */
typedef struct moe_attention_dims {
    int B;            /**< sequences */
    int T;            /**< tokens per sequence */
    int H;            /**< hidden size (input and output width) */
    int Hq;           /**< query heads */
    int Hkv;          /**< key/value heads (query groups) */
    int D;            /**< head dimension */
    int qk_norm;      /**< 1: RMSNorm over each query and key head vector */
    double norm_eps;  /**< QK-norm epsilon */
    double rope_base; /**< RoPE base */
    int pos0;         /**< absolute position of every sequence's first token here (0 unless
                           this rank holds a later chunk of the sequence: chapter 07) */
    /** context parallelism (chapter 07), or NULL: the CP group and its exchange (comm, cp,
     *  rank, type, and a2a+p2p's groups; the sizes are filled from these dims). T is then
     *  this rank's T/cp tokens per sequence, chunk-major ([2][B][C]: its early chunk of every
     *  sequence, then its late one), RoPE runs at each chunk's absolute positions and the
     *  attention is moe_cp_attention_forward/backward over the whole sequence */
    const moe_cp_attention *cp;
    /** chapter 05's emulated low precision (lowp.h): the Q, K, V and output projections'
     *  inputs and output gradients go through its QDQ; NULL: none */
    struct moe_lowp *lowp;
    /** the Q projection's linear index in @ref lowp's site table (moe_lowp_site(): K, V, O
     *  follow), under delayed scaling */
    int lowp_site;
} moe_attention_dims;

/** The block's weights: the backend's compute copy (activation type). */
typedef struct moe_attention_weights {
    const void *wq;     /**< [Hq·D, H] */
    const void *wk;     /**< [Hkv·D, H] */
    const void *wv;     /**< [Hkv·D, H] */
    const void *wo;     /**< [H, Hq·D] */
    const void *q_norm; /**< [D], or NULL without QK-norm */
    const void *k_norm; /**< [D], or NULL without QK-norm */
    /** chapter 05's native FP8 dense linears (lowp.h, "Native FP8 dense linears"): [4] the
     *  FP8 codes of wq, wk, wv, wo (and of their transposes), made once per step; NULL: the
     *  emulation (or no low precision) */
    const struct moe_fp8_weight *fp8;
} moe_attention_weights;

/** The block's weight gradients (full precision; they accumulate). */
typedef struct moe_attention_grads {
    moe_real *wq;     /**< [Hq·D, H] */
    moe_real *wk;     /**< [Hkv·D, H] */
    moe_real *wv;     /**< [Hkv·D, H] */
    moe_real *wo;     /**< [H, Hq·D] */
    moe_real *q_norm; /**< [D], or NULL without QK-norm */
    moe_real *k_norm; /**< [D], or NULL without QK-norm */
} moe_attention_grads;

/** What one layer's forward saves for its backward. `void *` buffers hold activations
 *  (the backend's type), `moe_real *` ones full precision. */
typedef struct moe_attention_acts {
    void *q;          /**< query projection [N,Hq·D] */
    void *k;          /**< key projection [N,Hkv·D] */
    void *v;          /**< value projection [N,Hkv·D] */
    void *qn;         /**< queries after QK-norm (when enabled) */
    void *kn;         /**< keys after QK-norm (when enabled) */
    moe_real *q_rstd; /**< QK-norm 1/rms of each query head vector [N·Hq] */
    moe_real *k_rstd; /**< QK-norm 1/rms of each key head vector [N·Hkv] */
    void *qr;         /**< queries after RoPE */
    void *kr;         /**< keys after RoPE */
    void *y;          /**< attention output [N,Hq·D] */
    moe_real *lse;    /**< log-sum-exp of every row of scores [B,Hq,T] */
    void *op_ws;      /**< the attention op's workspace (NULL when it needs none) */
} moe_attention_acts;

/** Input-gradient buffers of the backward, shared by every layer. */
typedef struct moe_attention_scratch {
    void *dy;  /**< ∂L/∂y [N,Hq·D] */
    void *dq;  /**< ∂L/∂(rotated queries) [N,Hq·D]; then ∂L/∂q under QK-norm */
    void *dk;  /**< ∂L/∂(rotated keys) [N,Hkv·D]; then ∂L/∂k under QK-norm */
    void *dv;  /**< ∂L/∂v [N,Hkv·D] */
    void *dq2; /**< ∂L/∂(queries before RoPE) [N,Hq·D] */
    void *dk2; /**< ∂L/∂(keys before RoPE) [N,Hkv·D] */
} moe_attention_scratch;

/**
 * @brief The attention dimensions of a validated config, for B sequences of T tokens
 *        starting at position 0.
 * @param c validated config  @param B sequences  @param T tokens per sequence
 * @return the dims
 */
moe_attention_dims moe_attention_dims_from_config(const moe_config *c, int B, int T);

/**
 * @brief Allocate one layer's saved activations for calls of up to @p d's B and T (a
 *        workspace sized for a shape serves every smaller one).
 * @param be backend  @param a receives the buffers  @param d largest dims
 * @return 1, or 0 when out of memory (free what was allocated with moe_attention_acts_free())
 */
int moe_attention_acts_alloc(const moe_backend *be, moe_attention_acts *a,
                             const moe_attention_dims *d);

/** @brief Free one layer's saved activations. @param be backend  @param a acts (zeroed) */
void moe_attention_acts_free(const moe_backend *be, moe_attention_acts *a);

/**
 * @brief Allocate the backward's shared scratch for up to @p d's B·T tokens.
 * @param be backend  @param s receives the buffers  @param d largest dims
 * @return 1, or 0 when out of memory (free what was allocated with
 *         moe_attention_scratch_free())
 */
int moe_attention_scratch_alloc(const moe_backend *be, moe_attention_scratch *s,
                                const moe_attention_dims *d);

/** @brief Free the scratch. @param be backend  @param s scratch (zeroed) */
void moe_attention_scratch_free(const moe_backend *be, moe_attention_scratch *s);

/**
 * @brief Forward of the block: out = attention(x)·Woᵀ, saving what the backward needs.
 * @param be backend  @param out [N,H] (overwritten)  @param x [N,H] the normed layer input
 * @param w weights  @param d dims of this call (B, T ≤ allocated)  @param a saved activations
 */
void moe_attention_forward(const moe_backend *be, void *out, const void *x,
                           const moe_attention_weights *w, const moe_attention_dims *d,
                           moe_attention_acts *a);

/**
 * @brief Backward of the block: dx and every weight gradient accumulate.
 * @param be backend  @param dx [N,H] gradient of @p x (accumulates)  @param g weight gradients
 * @param dout [N,H] gradient of the forward's output  @param x the forward's input
 * @param w weights  @param d dims of the forward  @param a what the forward saved
 * @param s scratch
 */
void moe_attention_backward(const moe_backend *be, void *dx, const moe_attention_grads *g,
                            const void *dout, const void *x, const moe_attention_weights *w,
                            const moe_attention_dims *d, const moe_attention_acts *a,
                            moe_attention_scratch *s);

#endif /* MOE_ATTENTION_H */
