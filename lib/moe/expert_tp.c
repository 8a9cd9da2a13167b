/* Expert tensor parallelism: the ETP group's rows gathered before the experts and the
 * partial outputs reduce-scattered after them. See expert_tp.h for the math. */
#include "moe/expert_tp.h"

#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "mlp.h"

#define R sizeof(moe_real)

static void *regrow(const moe_backend *be, void *p, size_t bytes) {
    be->free(p);
    p = be->alloc(bytes ? bytes : 1);
    MOE_CHECK_ALLOC(p, bytes, "an expert-tensor-parallel buffer");
    return p;
}

void *moe_etp_x(const moe_etp_rows *r, const moe_etp_work *w) {
    return r->x ? r->x : w->dy;
}

void moe_etp_plan(const moe_backend *be, const moe_tp *etp, moe_etp_rows *r, moe_etp_work *w,
                  const int *off, int G, int H, int F, const moe_lowp *lp, int keep_x_t) {
    const int P = etp->size, S = (int)be->act_size;
    if (r->G != G || !r->counts) {
        free(r->counts);
        free(r->off);
        r->counts = malloc(sizeof(int) * (size_t)P * G);
        r->off = malloc(sizeof(int) * ((size_t)G + 1));
        MOE_ASSERT(r->counts && r->off);
        r->G = G;
    }
    int *mine = malloc(sizeof(int) * (size_t)(G > 0 ? G : 1));
    MOE_ASSERT(mine);
    for (int e = 0; e < G; e++)
        mine[e] = off[e + 1] - off[e];
    moe_comm_host_all_gather(etp->comm, mine, r->counts, (size_t)G, MOE_DTYPE_I32);
    free(mine);
    /* each rank's block is padded to the largest one, so the exchange is one all-gather and
     * one reduce-scatter of equal blocks */
    r->pad = 0;
    for (int j = 0; j < P; j++) {
        int n = 0;
        for (int e = 0; e < G; e++)
            n += r->counts[j * G + e];
        if (n > r->pad)
            r->pad = n;
    }
    r->off[0] = 0;
    for (int e = 0; e < G; e++) {
        r->off[e + 1] = r->off[e];
        for (int j = 0; j < P; j++)
            r->off[e + 1] += r->counts[j * G + e];
    }
    r->rows = (size_t)r->off[G];
    const size_t rows = r->rows + 1;
    if (rows > r->cap || F > r->Fcap) {
        be->free(r->x);
        r->x = keep_x_t ? NULL : regrow(be, NULL, (size_t)S * rows * H);
        r->w = regrow(be, r->w, R * rows);
        r->gu = regrow(be, r->gu, (size_t)S * rows * 2 * F);
        r->act = regrow(be, r->act, moe_mlp_act_bytes(be, lp, rows, G, F, keep_x_t ? H : 0));
        r->cap = rows;
        r->Fcap = F;
    }
    if (rows > w->cap || F > w->Fcap) {
        w->y = regrow(be, w->y, (size_t)S * rows * H);
        w->dy = regrow(be, w->dy, (size_t)S * rows * H);
        w->dw = regrow(be, w->dw, R * rows);
        w->dh = regrow(be, w->dh, (size_t)S * rows * F);
        w->dgu = regrow(be, w->dgu, (size_t)S * rows * 2 * F);
        w->cap = rows;
        w->Fcap = F;
    }
    const size_t row_bytes = (size_t)S * H > R ? (size_t)S * H : R;
    const size_t stage = row_bytes * (size_t)(r->pad + 1);
    if (stage > w->stage) {
        w->send = regrow(be, w->send, stage);
        w->recv = regrow(be, w->recv, stage * (size_t)P);
        w->stage = stage;
    }
}

/* Move the (rank, expert) chunks between the padded rank-major exchange layout (rank j's
 * block at row j·pad, its experts' rows one after another) and the gathered expert-major
 * layout (expert e's rows at off[e], rank by rank): to_experts 1 sorts, 0 unsorts. */
static void sort_chunks(const moe_backend *be, const moe_etp_rows *r, int P, void *blocks,
                        void *experts, size_t row_bytes, int to_experts) {
    const int G = r->G;
    for (int j = 0; j < P; j++) {
        size_t b = (size_t)j * r->pad; /* this chunk's row in the exchange layout */
        for (int e = 0; e < G; e++) {
            size_t x = (size_t)r->off[e]; /* ... and in the expert-major one */
            for (int i = 0; i < j; i++)
                x += (size_t)r->counts[i * G + e];
            const size_t n = (size_t)r->counts[j * G + e];
            char *blk = (char *)blocks + b * row_bytes, *exp = (char *)experts + x * row_bytes;
            if (n)
                be->copy(to_experts ? exp : blk, to_experts ? blk : exp, n * row_bytes);
            b += n;
        }
    }
}

static size_t mine_rows(const moe_etp_rows *r, int rank) {
    size_t n = 0;
    for (int e = 0; e < r->G; e++)
        n += (size_t)r->counts[rank * r->G + e];
    return n;
}

void moe_etp_gather(const moe_backend *be, const moe_tp *etp, const moe_etp_rows *r,
                    moe_etp_work *w, void *dst, const void *src, int C, int real) {
    const size_t es = real ? R : be->act_size, row = es * (size_t)C;
    const moe_dtype t = real ? moe_dtype_real() : moe_dtype_act(be);
    const size_t n = mine_rows(r, etp->rank);
    if (n)
        be->copy(w->send, src, n * row);
    moe_comm_all_gather(etp->comm, w->send, w->recv, (size_t)r->pad * C, t);
    sort_chunks(be, r, etp->size, w->recv, dst, row, 1);
}

void moe_etp_scatter(const moe_backend *be, const moe_tp *etp, const moe_etp_rows *r,
                     moe_etp_work *w, void *dst, const void *src, int C, int real) {
    const size_t es = real ? R : be->act_size, row = es * (size_t)C;
    const moe_dtype t = real ? moe_dtype_real() : moe_dtype_act(be);
    /* the padding rows take part in the sum: zero them */
    be->zero(w->recv, (size_t)etp->size * r->pad * row);
    sort_chunks(be, r, etp->size, w->recv, (void *)src, row, 0);
    const size_t n = mine_rows(r, etp->rank);
    /* Test hook (make test): MOE_TEST_ETP_DROP_REDUCE=1 keeps this rank's own partial sums,
     * the bug of a forgotten reduction, so tests/mpi_etp.c can show its check catches it */
    if (getenv("MOE_TEST_ETP_DROP_REDUCE")) {
        if (n)
            be->copy(dst, (char *)w->recv + (size_t)etp->rank * r->pad * row, n * row);
        return;
    }
    moe_comm_reduce_scatter_sum(etp->comm, w->recv, w->send, (size_t)r->pad * C, t);
    if (n)
        be->copy(dst, w->send, n * row);
}

void moe_etp_rows_free(const moe_backend *be, moe_etp_rows *r) {
    free(r->counts);
    free(r->off);
    be->free(r->x);
    be->free(r->w);
    be->free(r->gu);
    be->free(r->act);
    memset(r, 0, sizeof *r);
}

void moe_etp_work_free(const moe_backend *be, moe_etp_work *w) {
    be->free(w->y);
    be->free(w->dy);
    be->free(w->dw);
    be->free(w->dh);
    be->free(w->dgu);
    be->free(w->send);
    be->free(w->recv);
    memset(w, 0, sizeof *w);
}
