/**
 * @file ops.h
 * @brief The CPU backend: every op of the model, forward and backward.
 *
 * Conventions, shared by every op here (and by their CUDA twins later):
 *  - Row-major. A "row" is one token; N = batch·seq tokens.
 *  - Linear weights are stored `[out, in]` as in PyTorch, so `y = x · Wᵀ`.
 *  - Forward functions overwrite their outputs.
 *  - Backward functions ACCUMULATE (`+=`) into every gradient they produce,
 *    both weight gradients and input gradients. Callers zero gradient buffers
 *    once per step; residual branches then simply add up.
 *  - Every output element is written by exactly one thread in a fixed order,
 *    so results are bitwise reproducible for any OpenMP thread count.
 *
 * The scalar type is ::moe_real (float; double in the gradient-check build).
 */
#ifndef MOE_CPU_OPS_H
#define MOE_CPU_OPS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "op_types.h"
#include "real.h"

/* ------------------------------------------------------------------ matmul.c */

/**
 * @brief out[N,O] = in[N,I] · w[O,I]ᵀ (a Linear layer without bias).
 * @param out output  @param in input  @param w weight  @param N rows  @param I in features  @param O out features
 */
void moe_cpu_matmul_forward(moe_real *out, const moe_real *in, const moe_real *w, int N, int I,
                            int O);

/**
 * @brief Backward of moe_cpu_matmul_forward: din += dout·w, dw += doutᵀ·in.
 * @param din input gradient [N,I] (NULL to skip)  @param dw weight gradient [O,I] (NULL to skip)
 * @param dout output gradient [N,O]  @param in forward input  @param w weight
 * @param N rows  @param I in features  @param O out features
 */
void moe_cpu_matmul_backward(moe_real *din, moe_real *dw, const moe_real *dout, const moe_real *in,
                             const moe_real *w, int N, int I, int O);

/** @brief Free the scratch memory the matmuls keep between calls (call before exit). */
void moe_cpu_matmul_release(void);

/* ----------------------------------------------------------- grouped_matmul.c */

/**
 * @brief The grouped GEMM (chapter 03): for every group g, rows [off[g], off[g+1]) of
 *        @p out are those rows of @p in times w[g]ᵀ. One call for all the experts, with the
 *        ragged row counts read from @p off (on the CPU, "device" memory is host memory).
 * @param out [off[G], O]  @param in [off[G], I]  @param w [G, O, I]
 * @param off [G+1] non-decreasing row offsets, off[0] = 0 (a group may be empty)
 * @param G groups  @param I in features  @param O out features
 */
void moe_cpu_grouped_matmul_forward(moe_real *out, const moe_real *in, const moe_real *w,
                                    const int *off, int G, int I, int O);

/**
 * @brief Backward of moe_cpu_grouped_matmul_forward(), group by group as
 *        moe_cpu_matmul_backward(): din += dout·w[g], dw[g] += doutᵀ·in.
 * @param din [off[G], I] (NULL to skip)  @param dw [G, O, I] (NULL to skip)
 * @param dout [off[G], O]  @param in forward input  @param w [G, O, I]
 * @param off [G+1] row offsets  @param G groups  @param I in features  @param O out features
 */
void moe_cpu_grouped_matmul_backward(moe_real *din, moe_real *dw, const moe_real *dout,
                                     const moe_real *in, const moe_real *w, const int *off, int G,
                                     int I, int O);

/* --------------------------------------------------------------- embedding.c */

/**
 * @brief out[n,:] = table[tokens[n],:].
 * @param out [N,C]  @param tokens [N]  @param table [V,C]  @param N rows  @param C width
 */
void moe_cpu_embedding_forward(moe_real *out, const int *tokens, const moe_real *table, int N,
                               int C);

/**
 * @brief dtable[tokens[n],:] += dout[n,:] (deterministic: rows of the table are owned by one thread).
 * @param dtable [V,C]  @param dout [N,C]  @param tokens [N]  @param N rows  @param V vocabulary  @param C width
 */
void moe_cpu_embedding_backward(moe_real *dtable, const moe_real *dout, const int *tokens, int N,
                                int V, int C);

/* ----------------------------------------------------------------- rmsnorm.c */

/**
 * @brief RMSNorm: out = x / sqrt(mean(x²) + eps) · w, per row of C.
 * @param out [N,C]  @param rstd saved 1/rms per row [N]  @param x [N,C]  @param w [C]
 * @param N rows  @param C width  @param eps epsilon
 */
void moe_cpu_rmsnorm_forward(moe_real *out, moe_real *rstd, const moe_real *x, const moe_real *w,
                             int N, int C, double eps);

/**
 * @brief Backward of RMSNorm. With x̂ = x·r: dx = r·(dy⊙w − x̂·mean(dy⊙w⊙x̂)), dw = Σ dy⊙x̂.
 * @param dx [N,C]  @param dw [C]  @param dout [N,C]  @param x forward input  @param w weight
 * @param rstd saved by the forward  @param N rows  @param C width
 */
void moe_cpu_rmsnorm_backward(moe_real *dx, moe_real *dw, const moe_real *dout, const moe_real *x,
                              const moe_real *w, const moe_real *rstd, int N, int C);

/* -------------------------------------------------------------------- rope.c */

/**
 * @brief Rotary position embedding, "rotate-half" form (Megatron, Hugging Face):
 *        for i < D/2, θ = p·base^(−2i/D): (x_i, x_{i+D/2}) ↦ (x_i cosθ − x_{i+D/2} sinθ,
 *        x_{i+D/2} cosθ + x_i sinθ). Row n is the token at absolute position
 *        p = @p pos0 + (n mod T).
 *
 * The position offset is what context parallelism needs (chapter 07): a rank holding the
 * chunk of a sequence that starts at token pos0 rotates it exactly as the single-rank model
 * rotates those rows of the whole sequence (the gradient-check suite tests that equality).
 * @param out [B·T, heads·D] (may equal @p in)  @param in same shape
 * @param B batch  @param T tokens per sequence in this chunk  @param heads heads in the row
 * @param D head dim  @param pos0 absolute position of each sequence's first row (≥ 0)
 * @param base RoPE base
 */
void moe_cpu_rope_forward(moe_real *out, const moe_real *in, int B, int T, int heads, int D,
                          int pos0, double base);

/**
 * @brief Backward of RoPE (the inverse rotation): din += Rᵀ·dout.
 * @param din [B·T, heads·D]  @param dout same  @param B batch  @param T tokens per sequence
 * @param heads heads  @param D head dim  @param pos0 as in the forward  @param base RoPE base
 */
void moe_cpu_rope_backward(moe_real *din, const moe_real *dout, int B, int T, int heads, int D,
                           int pos0, double base);

/* --------------------------------------------------------------- attention.c */

/** Query rows per tile of the CPU flash attention: a tile of queries keeps its running
 *  max, sum and output rows while the key tiles stream past (moe_cpu_attention_forward()). */
#define MOE_CPU_ATTENTION_BQ 64
/** Key rows per tile of the CPU flash attention: the scores of one query row against one
 *  key tile are the only scores alive at a time (forward and backward). */
#define MOE_CPU_ATTENTION_BK 64

/**
 * @brief Bytes of workspace the CPU attention needs: 0. The flash forward keeps only y and
 *        lse, and the backward recomputes the probabilities from them, so nothing passes
 *        between the two but the op contract's outputs (its tiles live in per-thread
 *        buffers of O(BK·D) elements inside each call).
 * @param s shape  @return 0
 */
size_t moe_cpu_attention_workspace_bytes(moe_attention_shape s);

/**
 * @brief Causal grouped-query attention, flash style: y = softmax(q·kᵀ/√D + causal mask)·v,
 *        where query head h reads key/value head h / (Hq/Hkv), and the log-sum-exp of every
 *        row of scores, lse_t = log Σ_s exp(q_t·k_s/√D) over the unmasked s (natural log).
 *
 * Any valid shape (moe_attention_shape_invalid()): query t sees key s iff
 * k_pos + s ≤ q_pos + t, so a chunk of queries can attend to another chunk of keys (context
 * parallelism); a row that sees no key gets y = 0 and lse = −∞. Queries are cut into tiles
 * of ::MOE_CPU_ATTENTION_BQ rows and keys into tiles of ::MOE_CPU_ATTENTION_BK; each row
 * keeps a running max m, sum l and unnormalised output o over the key tiles (online softmax,
 * rescaled by exp(m_old − m_new) when the max grows), and y = o / l, lse = m + log l at the
 * end. No [Tq, Tk] buffer exists; the work is split over (b, h, query tile), and the result
 * does not depend on the number of threads.
 * @param y [B·Tq, Hq·D] (overwritten)  @param lse [B, Hq, Tq] (overwritten)
 * @param ws unused (moe_cpu_attention_workspace_bytes() is 0; NULL is fine)
 * @param q [B·Tq, Hq·D]  @param k [B·Tk, Hkv·D]  @param v [B·Tk, Hkv·D]  @param s shape
 */
void moe_cpu_attention_forward(moe_real *y, moe_real *lse, void *ws, const moe_real *q,
                               const moe_real *k, const moe_real *v, moe_attention_shape s);

/**
 * @brief Backward of moe_cpu_attention_forward() (dq, dk, dv accumulate), from y and lse
 *        alone: δ_t = dy_t·y_t, P = exp(S − lse) recomputed tile by tile, dv += Pᵀ·dy,
 *        dP = dy·vᵀ, dS = P ∘ (dP − δ), dq += dS·k/√D, dk += dSᵀ·q/√D.
 *
 * y and lse need not come from a forward over the same keys: given the y and lse of the
 * whole row (all key chunks merged), a call over one key chunk adds exactly that chunk's
 * share of dq and its dk, dv (what context parallelism's backward does). The work is split
 * over (b, key/value head): one thread owns a group's dk and dv, so nothing races and the
 * sums run in a fixed order.
 * @param dq [B·Tq, Hq·D]  @param dk [B·Tk, Hkv·D]  @param dv [B·Tk, Hkv·D]  @param dy [B·Tq, Hq·D]
 * @param y forward output  @param lse forward log-sum-exp  @param ws unused (NULL is fine)
 * @param q queries  @param k keys  @param v values  @param s shape
 */
void moe_cpu_attention_backward(moe_real *dq, moe_real *dk, moe_real *dv, const moe_real *dy,
                                const moe_real *y, const moe_real *lse, void *ws,
                                const moe_real *q, const moe_real *k, const moe_real *v,
                                moe_attention_shape s);

/**
 * @brief Bytes of workspace the naive attention needs: the probabilities P [B, Hq, Tq, Tk]
 *        that its forward saves for its backward.
 * @param s shape  @return bytes
 */
size_t moe_cpu_attention_naive_workspace_bytes(moe_attention_shape s);

/**
 * @brief The naive attention, the reference the flash version is tested against (and the
 *        CPU twin of the CUDA kernels, whose P the GPU tests compare): the same y and lse as
 *        moe_cpu_attention_forward(), from whole rows of scores.
 *
 * It saves the probabilities P [B, Hq, Tq, Tk] (upper triangle written as 0) in @p ws for
 * its backward. lse comes from the same pass as the softmax, from its row max m and sum l:
 * lse = m + log l. Only a chunk attending to itself (moe_attention_shape_not_same_chunk()).
 * No op table uses it.
 * @param y [B·Tq, Hq·D]  @param lse [B, Hq, Tq]
 * @param ws moe_cpu_attention_naive_workspace_bytes() bytes; receives P
 * @param q [B·Tq, Hq·D]  @param k [B·Tk, Hkv·D]  @param v [B·Tk, Hkv·D]  @param s shape
 */
void moe_cpu_attention_naive_forward(moe_real *y, moe_real *lse, void *ws, const moe_real *q,
                                     const moe_real *k, const moe_real *v,
                                     moe_attention_shape s);

/**
 * @brief Backward of moe_cpu_attention_naive_forward() (dq, dk, dv accumulate), from the P
 *        that the forward saved in @p ws. @p y and @p lse belong to the op contract; this
 *        version does not read them.
 * @param dq [B·Tq, Hq·D]  @param dk [B·Tk, Hkv·D]  @param dv [B·Tk, Hkv·D]  @param dy [B·Tq, Hq·D]
 * @param y forward output  @param lse forward log-sum-exp  @param ws the forward's workspace
 * @param q queries  @param k keys  @param v values  @param s shape
 */
void moe_cpu_attention_naive_backward(moe_real *dq, moe_real *dk, moe_real *dv,
                                      const moe_real *dy, const moe_real *y,
                                      const moe_real *lse, void *ws, const moe_real *q,
                                      const moe_real *k, const moe_real *v,
                                      moe_attention_shape s);

/* ------------------------------------------------------------------ swiglu.c */

/**
 * @brief SwiGLU activation with an optional per-row scale:
 *        out[n,f] = silu(g)·u·s[n], silu(g) = g·σ(g), with gu = [g | u] (gate half first, as
 *        Megatron's fused fc1) and s = @p row_scale (1 when NULL).
 *
 * A routed expert scales its activation by the token's routing weight before fc2; fusing
 * the scale here writes the scaled activation once, and that output is exactly fc2's input
 * (the MLP saves it for fc2's weight gradient).
 * @param out [N,F] (overwritten)  @param gu [N,2F] fc1 output  @param row_scale [N] or NULL
 * @param N rows  @param F width
 */
void moe_cpu_swiglu_forward(moe_real *out, const moe_real *gu, const moe_real *row_scale, int N,
                            int F);

/**
 * @brief Backward of moe_cpu_swiglu_forward() (every gradient accumulates). With
 *        a = silu(g)·u recomputed from @p gu, s the row scale (1 when NULL) and d = dout·s:
 *        drow_scale[n] += Σ_f dout·a (summed in double), dg += d·u·σ(g)(1 + g(1 − σ(g))),
 *        du += d·silu(g).
 * @param dgu [N,2F] gradient of gu  @param drow_scale [N] gradient of the row scale, or NULL
 *        (not wanted)  @param dout [N,F]  @param gu [N,2F] forward input
 * @param row_scale [N] or NULL, as in the forward  @param N rows  @param F width
 */
void moe_cpu_swiglu_backward(moe_real *dgu, moe_real *drow_scale, const moe_real *dout,
                             const moe_real *gu, const moe_real *row_scale, int N, int F);

/* ----------------------------------------------------------- cross_entropy.c */

/**
 * @brief Per-row cross-entropy: loss[n] = logsumexp(logits[n]) − logits[n, target[n]].
 * @param losses [N]  @param logits [N,V]  @param targets [N]  @param N rows  @param V vocabulary
 */
void moe_cpu_cross_entropy_forward(moe_real *losses, const moe_real *logits, const int *targets,
                                   int N, int V);

/**
 * @brief dlogits[n] += dloss[n]·(softmax(logits[n]) − onehot(target[n])).
 * @param dlogits [N,V]  @param dloss per-row loss gradient [N] (NULL: every row 1/N, the mean)
 * @param logits [N,V]  @param targets [N]  @param N rows  @param V vocabulary
 */
void moe_cpu_cross_entropy_backward(moe_real *dlogits, const moe_real *dloss,
                                    const moe_real *logits, const int *targets, int N, int V);

/**
 * @brief One vocabulary shard's part of a cross-entropy (vocabulary parallelism): per row,
 *        part[n] = { log Σ_v exp(logits[n,v]),  logits[n, targets[n]] or 0 } over this shard's
 *        V columns. @p targets holds ids local to the shard, −1 where the target lies in
 *        another shard. moe_cpu_cross_entropy_shard_merge() combines the shards' parts.
 * @param part [N,2] (log-sum-exp, target logit)  @param logits [N,V] this shard's columns
 * @param targets [N] local target ids or −1  @param N rows  @param V columns of the shard
 */
void moe_cpu_cross_entropy_shard_forward(moe_real *part, const moe_real *logits,
                                         const int *targets, int N, int V);

/**
 * @brief Merge R shards' parts into the whole rows' losses: lse[n] = log Σ_r exp(lse_r[n])
 *        (computed with the largest lse_r as shift) and losses[n] = lse[n] − Σ_r target_r[n].
 * @param losses [N]  @param lse [N] the whole rows' log-sum-exp (for the backward)
 * @param parts [R,N,2] every shard's part, shard-major (an all-gather's layout)
 * @param R shards  @param N rows
 */
void moe_cpu_cross_entropy_shard_merge(moe_real *losses, moe_real *lse, const moe_real *parts,
                                       int R, int N);

/**
 * @brief One shard's columns of the cross-entropy gradient, from the whole rows' log-sum-exp:
 *        dlogits[n,v] += dloss[n]·(exp(logits[n,v] − lse[n]) − [v == targets[n]]).
 * @param dlogits [N,V]  @param dloss [N] (NULL: every row 1/N, the mean)
 * @param logits [N,V] this shard's columns  @param lse [N] from the merge
 * @param targets [N] local target ids or −1  @param N rows  @param V columns of the shard
 */
void moe_cpu_cross_entropy_shard_backward(moe_real *dlogits, const moe_real *dloss,
                                          const moe_real *logits, const moe_real *lse,
                                          const int *targets, int N, int V);

#endif /* MOE_CPU_OPS_H */
