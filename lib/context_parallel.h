/**
 * @file context_parallel.h
 * @brief Context-parallel attention (chapter 07): each rank holds 2 of the 2·cp chunks of
 *        every sequence (cp_layout.h) and attends its queries to the keys of all ranks.
 *
 * Two ways to bring the keys, as Megatron's `--cp-comm-type` names them:
 *  - **p2p** (ring attention): the keys and values travel around the ring of CP ranks, one
 *    hop per step; at step i a rank holds those of rank (r − i) mod cp, computes the blocks
 *    moe_cp_ring_pairs() lists, and merges each partial result into its output by its
 *    log-sum-exp. Each hop is started before the blocks of the step and finished after
 *    them (moe_comm_exchange_start), so the next keys travel while the held ones are used.
 *    In the backward the key and value gradients travel too: each step computes its blocks
 *    into a fresh accumulator while the previous ranks' partial sum arrives, adds it, and
 *    sends the total on during the next step; one more hop brings them home. Memory: two
 *    ranks' keys and values, two gradient accumulators and one arriving partial sum.
 *  - **allgather** (as in Llama 3): every rank all-gathers all keys and values once, attends
 *    its queries to the visible chunks, and the key/value gradients are reduce-scattered
 *    back. Memory: the whole sequence's keys and values; no ring, two collectives.
 *  - **a2a** (DeepSpeed-Ulysses): an all-to-all turns "my tokens, every head" into "every
 *    token, my heads" (Hq/cp query heads and Hkv/cp key/value heads: both must divide by
 *    cp), each rank runs plain causal attention over the whole sequence for its heads, and
 *    an all-to-all turns the output back. Memory: the local size; four all-to-alls forward
 *    (q, k, v in, y and lse out) and more in the backward, but no ring of dependent steps.
 *  - **a2a+p2p** (hierarchical): the all-to-all of heads inside groups of `a2a` ranks (a
 *    node's fast links), then a ring between the groups, each rank passing the keys and
 *    values of its head slice for its group's 2·a2a chunks. With a2a = cp it is a2a (one
 *    ring step), with a2a = 1 the ring over single ranks.
 *
 * The local tensors are **chunk-major**: a rank's T/cp tokens of each sequence are stored as
 * its early chunk of every sequence, then its late chunk of every sequence
 * ([2][B][C][heads][D], C = T/(2·cp)), so that one chunk of all B sequences is one
 * contiguous [B, C, heads, D] block, which the attention op takes as it is. lse is
 * [2][B][Hq][C] in the same spirit. The backward uses the attention op's backward with the
 * *merged* output and log-sum-exp of each query row, which is exactly the gradient of the
 * softmax over all keys (the probabilities of one block are exp(s − lse_total)).
 *
 * The backend's attention op must run a query chunk against another chunk
 * (moe_attention_shape with Tq ≠ Tk or q_pos ≠ k_pos), which the CPU's and the CUDA flash
 * attention both do. Everything else goes through the op table too, so CPU and GPU ranks
 * run the same code: the merge (the cp_merge op: moe_cp_merge() on the CPU, a kernel on the
 * GPU), the lse's start at −∞ (fill_real) and the all-to-alls' packing (copy_2d, strided
 * rows into a contiguous staging area); the exchanges are moe_comm_* calls (NCCL on GPU
 * ranks).
 */
#ifndef MOE_CONTEXT_PARALLEL_H
#define MOE_CONTEXT_PARALLEL_H

#include "backend.h"
#include "comm.h"
#include "cp_layout.h"
#include "error.h"

/** How the keys and values reach the other ranks (--cp-comm-type). */
typedef enum moe_cp_comm {
    MOE_CP_P2P = 0,   /**< ring attention: send/recv around the CP ranks */
    MOE_CP_ALLGATHER, /**< all-gather the keys and values, reduce-scatter their gradients */
    MOE_CP_A2A,       /**< all-to-all heads <-> sequence (Ulysses) */
    MOE_CP_A2A_P2P,   /**< all-to-all inside groups of `a2a` ranks, the ring between them */
} moe_cp_comm;

/** One rank's view of a context-parallel attention call. */
typedef struct moe_cp_attention {
    moe_comm *comm;   /**< the CP group (NULL: cp = 1, nothing to exchange) */
    int cp;           /**< ranks of the group */
    int rank;         /**< this rank in it */
    moe_cp_comm type; /**< p2p or allgather */
    int B;            /**< sequences */
    int T;            /**< tokens per sequence, over all ranks (2·cp·C) */
    int Hq;           /**< query heads */
    int Hkv;          /**< key/value heads */
    int D;            /**< head dimension */
    /* a2a+p2p only: CP rank r is inner rank r mod a2a of the group of ranks
     * [r − r mod a2a, … + a2a) and outer rank r / a2a of the ring of the ranks with its
     * inner rank; either group may be NULL when it has one rank */
    moe_comm *inner;  /**< the a2a group (size a2a) */
    moe_comm *outer;  /**< the ring (size cp / a2a) */
    int a2a;          /**< ranks of the a2a group (divides cp and both head counts) */
} moe_cp_attention;

/**
 * @brief Whether a backend has the ops context parallelism needs beside attention: cp_merge,
 *        fill_real and copy_2d (the CPU and CUDA backends both do).
 * @param be backend  @param err receives the reason when it cannot
 * @return ::MOE_OK or ::MOE_ERR_CONFIG (naming --context-parallel-size and what to use)
 */
moe_status moe_cp_attention_supported(const moe_backend *be, moe_error *err);

/**
 * @brief Whether a call's sizes fit its communication type: 2·cp must divide T (every type),
 *        and for a2a cp must divide both head counts.
 * @param a the call  @param err receives a message naming the flags and the fix
 * @return ::MOE_OK or ::MOE_ERR_CONFIG
 */
moe_status moe_cp_attention_check(const moe_cp_attention *a, moe_error *err);

/**
 * @brief Backend memory the call needs beside its tensors, in bytes: for p2p two ranks'
 *        keys and values, two gradient accumulators and an arriving partial sum (10 times
 *        one rank's keys), and one partial output and lse; for allgather the whole sequence's keys and values and their gradients; for
 *        a2a eight local-sized tensors, the lse and a staging area. Then, for every
 *        backend, the attention op's workspace of the largest block call: one fp32 per
 *        query row (the CUDA op's backward keeps its row dots δ there; the CPU's needs none).
 * @param a the call  @param act_size bytes per activation
 * @return bytes of workspace (moe_cp_attention_forward/backward take it as @p ws)
 */
size_t moe_cp_attention_workspace_bytes(const moe_cp_attention *a, size_t act_size);

/**
 * @brief Forward: y and lse of this rank's queries over the keys of the whole sequence.
 * @param be backend (its attention op must run chunk pairs)  @param a the call
 * @param y [2][B][C][Hq][D] output  @param lse [2][B][Hq][C] its row log-sum-exp
 * @param q [2][B][C][Hq][D]  @param k [2][B][C][Hkv][D]  @param v as k (this rank's chunks,
 *        RoPE applied at their absolute positions)
 * @param ws moe_cp_attention_workspace_bytes() bytes of backend memory
 */
void moe_cp_attention_forward(const moe_backend *be, const moe_cp_attention *a, void *y,
                              moe_real *lse, const void *q, const void *k, const void *v,
                              void *ws);

/**
 * @brief Backward: dq, dk, dv of this rank's chunks (accumulated, +=) from dy, with the
 *        forward's merged y and lse.
 * @param be backend  @param a the call  @param dq as q  @param dk as k  @param dv as v
 * @param dy as y  @param y the forward's output  @param lse the forward's log-sum-exp
 * @param q the forward's queries  @param k its keys  @param v its values
 * @param ws workspace, as in the forward
 */
void moe_cp_attention_backward(const moe_backend *be, const moe_cp_attention *a, void *dq,
                               void *dk, void *dv, const void *dy, const void *y,
                               const moe_real *lse, const void *q, const void *k, const void *v,
                               void *ws);

#endif /* MOE_CONTEXT_PARALLEL_H */
