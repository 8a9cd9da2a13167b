/* The vocabulary-parallel embedding, LM head and cross-entropy: see vocab_parallel.h. The
 * maps from global to local ids are built on the host, where the batch's ids are anyway. */
#include "vocab_parallel.h"

#include <stdlib.h>
#include <string.h>

#include "comm.h"

int moe_vp_alloc(const moe_backend *be, moe_vocab_parallel *vp, const moe_tp *tp, int V, int N) {
    memset(vp, 0, sizeof *vp);
    MOE_ASSERT(V % tp->size == 0);
    vp->V = V;
    vp->Vl = V / tp->size;
    vp->v0 = tp->rank * vp->Vl;
    vp->max_N = N;
    const size_t n = (size_t)N;
    vp->ids = be->alloc(sizeof(int) * n);
    vp->targets = be->alloc(sizeof(int) * n);
    vp->rows = be->alloc(sizeof(int) * n);
    vp->row_ids = be->alloc(sizeof(int) * n);
    vp->host = malloc(sizeof(int) * 4 * n);
    vp->part = be->alloc(sizeof(moe_real) * 2 * n);
    vp->parts = be->alloc(sizeof(moe_real) * 2 * n * (size_t)tp->size);
    vp->lse = be->alloc(sizeof(moe_real) * n);
    return vp->ids && vp->targets && vp->rows && vp->row_ids && vp->host && vp->part &&
           vp->parts && vp->lse;
}

void moe_vp_free(const moe_backend *be, moe_vocab_parallel *vp) {
    if (!be)
        return;
    be->free(vp->ids);
    be->free(vp->targets);
    be->free(vp->rows);
    be->free(vp->row_ids);
    free(vp->host);
    be->free(vp->part);
    be->free(vp->parts);
    be->free(vp->lse);
    memset(vp, 0, sizeof *vp);
}

/* an id of the whole vocabulary as this shard's, or −1 */
static int local_id(const moe_vocab_parallel *vp, int id) {
    return id >= vp->v0 && id < vp->v0 + vp->Vl ? id - vp->v0 : -1;
}

void moe_vp_set_batch(const moe_backend *be, moe_vocab_parallel *vp, const int *tokens,
                      const int *targets, int N) {
    MOE_ASSERT(N <= vp->max_N);
    int *ids = vp->host, *tg = ids + N, *rows = tg + N, *row_ids = rows + N;
    vp->n_rows = 0;
    for (int n = 0; n < N; n++) {
        ids[n] = local_id(vp, tokens[n]);
        if (ids[n] >= 0) {
            rows[vp->n_rows] = n;
            row_ids[vp->n_rows++] = ids[n];
        }
        if (targets)
            tg[n] = local_id(vp, targets[n]);
    }
    be->from_host(vp->ids, ids, sizeof(int) * (size_t)N);
    be->from_host(vp->rows, rows, sizeof(int) * (size_t)vp->n_rows);
    be->from_host(vp->row_ids, row_ids, sizeof(int) * (size_t)vp->n_rows);
    if (targets)
        be->from_host(vp->targets, tg, sizeof(int) * (size_t)N);
}

void moe_vp_embedding_forward(const moe_backend *be, const moe_vocab_parallel *vp, void *out,
                              const void *table, int N, int H) {
    be->gather_rows(out, table, vp->ids, N, H);
}

void moe_vp_embedding_backward(const moe_backend *be, const moe_vocab_parallel *vp,
                               moe_real *dtable, const void *dout, void *scratch, int H) {
    /* the rows of this rank's tokens, packed, then the ordinary embedding backward on them */
    be->gather_rows(scratch, dout, vp->rows, vp->n_rows, H);
    be->embedding_backward(dtable, scratch, vp->row_ids, vp->n_rows, vp->Vl, H);
}

void moe_vp_cross_entropy_forward(const moe_backend *be, const moe_tp *tp,
                                  moe_vocab_parallel *vp, moe_real *losses, const void *logits,
                                  int N) {
    be->cross_entropy_shard_forward(vp->part, logits, vp->targets, N, vp->Vl);
    moe_comm_all_gather(tp->comm, vp->part, vp->parts, 2 * (size_t)N, moe_dtype_real());
    be->cross_entropy_shard_merge(losses, vp->lse, vp->parts, tp->size, N);
}

void moe_vp_cross_entropy_backward(const moe_backend *be, const moe_vocab_parallel *vp,
                                   void *dlogits, const void *logits, int N) {
    be->cross_entropy_shard_backward(dlogits, NULL, logits, vp->lse, vp->targets, N, vp->Vl);
}
