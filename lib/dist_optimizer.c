/* The distributed optimizer (ZeRO-1): see dist_optimizer.h. */
#include "dist_optimizer.h"

#include <string.h>

static moe_group_kind replicas(const moe_tensor *t) { return t->grad_group; }

moe_status moe_zero_init(moe_zero *z, const moe_backend *be, const moe_param_table *pt,
                         const moe_parallel *par, moe_adamw_piece *pieces, int *n_pieces,
                         moe_error *err) {
    memset(z, 0, sizeof *z);
    z->be = be;
    size_t start, end, widest = 0;
    moe_group_kind k;
    int i = 0;
    while (moe_params_next_run(pt, replicas, &i, &start, &end, &k)) {
        MOE_ASSERT(z->n_runs < MOE_ADAMW_MAX_PIECES);
        moe_zero_run *r = &z->run[z->n_runs];
        r->start = start;
        r->len = end - start;
        r->kind = k;
        r->comm = moe_parallel_group(par, k);
        r->size = r->comm ? moe_comm_size(r->comm) : 1;
        r->rank = r->comm ? moe_comm_rank(r->comm) : 0;
        r->chunk = (r->len + (size_t)r->size - 1) / (size_t)r->size;
        /* piece `rank` = [start + rank·chunk, start + (rank+1)·chunk), cut at the run's end */
        size_t lo = start + (size_t)r->rank * r->chunk, hi = lo + r->chunk;
        lo = lo < end ? lo : end;
        hi = hi < end ? hi : end;
        r->piece = (moe_adamw_piece){lo, hi, 0};
        pieces[z->n_runs++] = r->piece;
        if (r->comm && (size_t)(r->size + 1) * r->chunk > widest)
            widest = (size_t)(r->size + 1) * r->chunk;
    }
    *n_pieces = z->n_runs;
    /* gradients and parameters are moe_real, the moments float: room for the wider */
    const size_t es = sizeof(moe_real) > sizeof(float) ? sizeof(moe_real) : sizeof(float);
    z->scratch_bytes = widest * es;
    if (widest && !(z->scratch = be->alloc(z->scratch_bytes)))
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory for the distributed optimizer's "
                             "staging buffer (%zu bytes)", z->scratch_bytes);
    return MOE_OK;
}

void moe_zero_free(moe_zero *z) {
    if (z->be)
        z->be->free(z->scratch);
    z->scratch = NULL;
}

void moe_zero_reduce_scatter(moe_zero *z, moe_real *grads) {
    const size_t es = sizeof(moe_real);
    for (int i = 0; i < z->n_runs; i++) {
        const moe_zero_run *r = &z->run[i];
        if (!r->comm)
            continue;
        /* the run, padded with zeros to size·chunk, then this rank's summed piece after it */
        char *send = z->scratch, *recv = send + (size_t)r->size * r->chunk * es;
        z->be->copy(send, grads + r->start, r->len * es);
        z->be->zero(send + r->len * es, ((size_t)r->size * r->chunk - r->len) * es);
        moe_comm_reduce_scatter_sum(r->comm, send, recv, r->chunk, moe_dtype_real());
        z->be->copy(grads + r->piece.lo, recv, (r->piece.hi - r->piece.lo) * es);
    }
}

void moe_zero_all_gather(moe_zero *z, const moe_adamw *opt, const void *mine, void *full,
                         moe_dtype t) {
    const size_t es = moe_dtype_size(t);
    for (int i = 0; i < z->n_runs; i++) {
        const moe_zero_run *r = &z->run[i];
        const moe_adamw_piece *pc = &opt->piece[i];
        const size_t n = pc->hi - pc->lo;
        const char *src = (const char *)mine + (mine == full ? pc->lo : pc->state) * es;
        if (!r->comm) { /* one rank: its piece is the run */
            if (mine != full)
                z->be->copy((char *)full + pc->lo * es, src, n * es);
            continue;
        }
        char *gathered = z->scratch, *send = gathered + (size_t)r->size * r->chunk * es;
        z->be->copy(send, src, n * es); /* the pad of the last piece is never read back */
        moe_comm_all_gather(r->comm, send, gathered, r->chunk, t);
        z->be->copy((char *)full + r->start * es, gathered, r->len * es);
    }
}

void moe_zero_gather_weights(moe_zero *z, const moe_adamw *opt, void *wact) {
    const moe_backend *be = z->be;
    for (int i = 0; i < opt->n_pieces; i++) {
        const moe_adamw_piece *pc = &opt->piece[i];
        be->cast_to_act(MOE_ACT(be, wact, pc->lo), opt->master + pc->state, pc->hi - pc->lo);
    }
    moe_zero_all_gather(z, opt, wact, wact, moe_dtype_act(be));
}

moe_status moe_zero_gather_to_host(moe_zero *z, const moe_adamw *opt, const void *mine,
                                   size_t total, moe_dtype t, void *host, moe_error *err) {
    const size_t bytes = moe_dtype_size(t) * total;
    void *full = z->be->alloc(bytes ? bytes : 1);
    if (!full)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory gathering the distributed "
                             "optimizer's state (%zu values)", total);
    moe_zero_all_gather(z, opt, mine, full, t);
    z->be->to_host(host, full, bytes);
    z->be->free(full);
    return MOE_OK;
}
