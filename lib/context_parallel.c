/* Context-parallel attention (chapter 07): see context_parallel.h. */
#include "context_parallel.h"

#include <math.h>
#include <string.h>

#include "log.h"

moe_status moe_cp_attention_supported(const moe_backend *be, moe_error *err) {
    if (be->device == MOE_DEVICE_CPU)
        return MOE_OK;
    return moe_error_set(err, MOE_ERR_CONFIG,
                         "--context-parallel-size > 1 needs an attention op that runs a chunk "
                         "of queries against another chunk of keys: the CPU backend's flash "
                         "attention does (--device cpu); the CUDA flash kernel is the next "
                         "step of chapter 07");
}

/* Element counts of one rank's tensors: a chunk of B sequences of queries (QC) and of
 * keys (KC), lse rows of a chunk (LC), and a rank's keys or values, both chunks (KL). */
typedef struct sizes {
    int C;
    size_t QC, KC, LC, KL;
} sizes;

static sizes sizes_of(const moe_cp_attention *a) {
    sizes z;
    z.C = a->T / (2 * a->cp);
    z.QC = (size_t)a->B * z.C * a->Hq * a->D;
    z.KC = (size_t)a->B * z.C * a->Hkv * a->D;
    z.LC = (size_t)a->B * a->Hq * z.C;
    z.KL = 2 * z.KC;
    return z;
}

size_t moe_cp_attention_workspace_bytes(const moe_cp_attention *a, size_t act_size) {
    const sizes z = sizes_of(a);
    const size_t part = z.QC * act_size + z.LC * sizeof(moe_real); /* one partial y, lse */
    if (a->type == MOE_CP_ALLGATHER) /* all keys and values, their gradients, one piece */
        return (4 * (size_t)a->cp * z.KL + z.KL) * act_size + part;
    return 8 * z.KL * act_size + part; /* two travelling sets of k, v, dk, dv */
}

/* The shape of one block: query chunk `qc` of this rank against key chunk `kc`, global
 * chunk indices (their absolute positions give the causal mask). */
static moe_attention_shape block(const moe_cp_attention *a, int qc, int kc) {
    const int C = a->T / (2 * a->cp);
    moe_attention_shape s = {a->B, C, C, a->Hq, a->Hkv, a->D, qc * C, kc * C};
    return s;
}

/* Pass `count` elements of `cur` to the next rank of the ring and receive the previous
 * rank's into `nxt` (one exchange: no ordering of sends and receives to get wrong). */
static void ring_shift(const moe_backend *be, const moe_cp_attention *a, const void *cur,
                       void *nxt, size_t count) {
    const moe_comm_chunk to = {0, count, (a->rank + 1) % a->cp};
    const moe_comm_chunk from = {0, count, (a->rank + a->cp - 1) % a->cp};
    moe_comm_exchange(a->comm, cur, &to, 1, nxt, &from, 1, moe_dtype_act(be));
}

#define AT(p, i) ((char *)(p) + (size_t)(i) * S) /* element i of an activation buffer */

void moe_cp_attention_forward(const moe_backend *be, const moe_cp_attention *a, void *y,
                              moe_real *lse, const void *q, const void *k, const void *v,
                              void *ws) {
    const sizes z = sizes_of(a);
    const size_t S = be->act_size;
    MOE_ASSERT(S == sizeof(moe_real)); /* the merge runs on host memory (moe_cp_attention_supported) */
    char *w = ws;
    void *kv[2] = {w, w + 2 * z.KL * S}; /* the held rank's [k | v], and the next one's */
    void *y_part = w + 4 * z.KL * S;
    moe_real *lse_part = (moe_real *)((char *)y_part + z.QC * S);
    for (size_t i = 0; i < 2 * z.LC; i++) /* nothing merged yet: every row at lse = −∞ */
        lse[i] = -INFINITY;
    if (a->type == MOE_CP_ALLGATHER) {
        char *all_k = w, *all_v = w + (size_t)a->cp * z.KL * S;
        y_part = all_v + (size_t)a->cp * z.KL * S + 2 * (size_t)a->cp * z.KL * S + z.KL * S;
        lse_part = (moe_real *)((char *)y_part + z.QC * S);
        if (a->comm) {
            moe_comm_all_gather(a->comm, k, all_k, z.KL, moe_dtype_act(be));
            moe_comm_all_gather(a->comm, v, all_v, z.KL, moe_dtype_act(be));
        } else {
            be->copy(all_k, k, z.KL * S);
            be->copy(all_v, v, z.KL * S);
        }
        for (int qa = 0; qa < 2; qa++)
            for (int s = 0; s < a->cp; s++)
                for (int kb = 0; kb < 2; kb++) {
                    const int qc = moe_cp_chunk(a->cp, a->rank, qa), kc = moe_cp_chunk(a->cp, s, kb);
                    if (kc > qc) /* every key of a later chunk is masked */
                        continue;
                    const size_t off = (size_t)s * z.KL + kb * z.KC;
                    be->attention_forward(y_part, lse_part, NULL, AT(q, qa * z.QC),
                                          AT(all_k, off), AT(all_v, off), block(a, qc, kc));
                    moe_cp_merge((moe_real *)AT(y, qa * z.QC), lse + qa * z.LC, y_part, lse_part,
                                 a->B, z.C, a->Hq, a->D);
                }
        return;
    }
    be->copy(kv[0], k, z.KL * S);
    be->copy(AT(kv[0], z.KL), v, z.KL * S);
    for (int i = 0; i < a->cp; i++) {
        const int s = moe_cp_ring_source(a->cp, a->rank, i);
        moe_cp_pair p[4];
        const int np = moe_cp_ring_pairs(a->cp, a->rank, i, p);
        for (int j = 0; j < np; j++) {
            const int qc = moe_cp_chunk(a->cp, a->rank, p[j].q);
            const int kc = moe_cp_chunk(a->cp, s, p[j].k);
            be->attention_forward(y_part, lse_part, NULL, AT(q, p[j].q * z.QC),
                                  AT(kv[0], p[j].k * z.KC), AT(kv[0], z.KL + p[j].k * z.KC),
                                  block(a, qc, kc));
            moe_cp_merge((moe_real *)AT(y, p[j].q * z.QC), lse + p[j].q * z.LC, y_part,
                         lse_part, a->B, z.C, a->Hq, a->D);
        }
        if (i + 1 < a->cp) { /* pass the held keys and values on; receive the next ones */
            ring_shift(be, a, kv[0], kv[1], 2 * z.KL);
            void *t = kv[0];
            kv[0] = kv[1];
            kv[1] = t;
        }
    }
}

void moe_cp_attention_backward(const moe_backend *be, const moe_cp_attention *a, void *dq,
                               void *dk, void *dv, const void *dy, const void *y,
                               const moe_real *lse, const void *q, const void *k, const void *v,
                               void *ws) {
    const sizes z = sizes_of(a);
    const size_t S = be->act_size;
    MOE_ASSERT(S == sizeof(moe_real));
    char *w = ws;
    if (a->type == MOE_CP_ALLGATHER) {
        /* the forward's gather again (the workspace is shared between calls), then every
         * visible block's gradients into whole-sequence accumulators, reduce-scattered home */
        char *all_k = w, *all_v = w + (size_t)a->cp * z.KL * S;
        char *all_dk = all_v + (size_t)a->cp * z.KL * S, *all_dv = all_dk + (size_t)a->cp * z.KL * S;
        char *mine = all_dv + (size_t)a->cp * z.KL * S;
        if (a->comm) {
            moe_comm_all_gather(a->comm, k, all_k, z.KL, moe_dtype_act(be));
            moe_comm_all_gather(a->comm, v, all_v, z.KL, moe_dtype_act(be));
        } else {
            be->copy(all_k, k, z.KL * S);
            be->copy(all_v, v, z.KL * S);
        }
        be->zero(all_dk, 2 * (size_t)a->cp * z.KL * S);
        for (int qa = 0; qa < 2; qa++)
            for (int s = 0; s < a->cp; s++)
                for (int kb = 0; kb < 2; kb++) {
                    const int qc = moe_cp_chunk(a->cp, a->rank, qa), kc = moe_cp_chunk(a->cp, s, kb);
                    if (kc > qc)
                        continue;
                    const size_t off = (size_t)s * z.KL + kb * z.KC;
                    be->attention_backward(AT(dq, qa * z.QC), AT(all_dk, off), AT(all_dv, off),
                                           AT(dy, qa * z.QC), AT(y, qa * z.QC), lse + qa * z.LC,
                                           NULL, AT(q, qa * z.QC), AT(all_k, off),
                                           AT(all_v, off), block(a, qc, kc));
                }
        for (int t = 0; t < 2; t++) { /* each rank's piece of dk, then of dv */
            char *all = t == 0 ? all_dk : all_dv;
            void *out = t == 0 ? dk : dv;
            if (a->comm)
                moe_comm_reduce_scatter_sum(a->comm, all, mine, z.KL, moe_dtype_act(be));
            else
                be->copy(mine, all, z.KL * S);
            be->add(out, mine, z.KL);
        }
        return;
    }
    /* p2p: [k | v | dk | dv] of the held rank travel together; the gradients go home at
     * the end (one more hop) */
    void *set[2] = {w, w + 4 * z.KL * S};
    be->copy(set[0], k, z.KL * S);
    be->copy(AT(set[0], z.KL), v, z.KL * S);
    be->zero(AT(set[0], 2 * z.KL), 2 * z.KL * S);
    for (int i = 0; i < a->cp; i++) {
        const int s = moe_cp_ring_source(a->cp, a->rank, i);
        moe_cp_pair p[4];
        const int np = moe_cp_ring_pairs(a->cp, a->rank, i, p);
        char *c = set[0];
        for (int j = 0; j < np; j++) {
            const int qc = moe_cp_chunk(a->cp, a->rank, p[j].q);
            const int kc = moe_cp_chunk(a->cp, s, p[j].k);
            const size_t ko = p[j].k * z.KC;
            be->attention_backward(AT(dq, p[j].q * z.QC), AT(c, 2 * z.KL + ko),
                                   AT(c, 3 * z.KL + ko), AT(dy, p[j].q * z.QC),
                                   AT(y, p[j].q * z.QC), lse + p[j].q * z.LC, NULL,
                                   AT(q, p[j].q * z.QC), AT(c, ko), AT(c, z.KL + ko),
                                   block(a, qc, kc));
        }
        if (i + 1 < a->cp) {
            ring_shift(be, a, set[0], set[1], 4 * z.KL);
            void *t = set[0];
            set[0] = set[1];
            set[1] = t;
        }
    }
    char *home = AT(set[0], 2 * z.KL); /* [dk | dv] of rank + 1 (or our own when cp = 1) */
    if (a->cp > 1) {
        ring_shift(be, a, home, AT(set[1], 2 * z.KL), 2 * z.KL);
        home = AT(set[1], 2 * z.KL);
    }
    be->add(dk, home, z.KL);
    be->add(dv, AT(home, z.KL), z.KL);
}
