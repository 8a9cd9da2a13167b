/* The all-to-all token dispatcher and capacity: see dispatcher.h. */
#include "dispatcher.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int moe_expert_capacity(int N, int k, int E, double factor) {
    return (int)ceil((double)N * k / E * factor);
}

/* ------------------------------------------------------------------ capacity */

typedef struct cand {
    int a;      /* assignment index n·k + j */
    moe_real w; /* its routing weight */
} cand;

static int by_weight_then_position(const void *x, const void *y) {
    const cand *p = x, *q = y;
    if (p->w != q->w)
        return p->w > q->w ? -1 : 1;
    return (p->a > q->a) - (p->a < q->a);
}

long long moe_apply_capacity(int *dispatch_idx, const int *topk_idx, const moe_real *topk_w, int N,
                             int k, int E, int capacity, int by_position) {
    const int NK = N * k;
    memcpy(dispatch_idx, topk_idx, sizeof(int) * NK);
    int *count = calloc((size_t)E, sizeof(int));
    cand *c = malloc(sizeof(cand) * (size_t)(NK ? NK : 1));
    MOE_ASSERT(count && c);
    for (int a = 0; a < NK; a++)
        count[topk_idx[a]]++;
    long long dropped = 0;
    for (int e = 0; e < E; e++) {
        if (count[e] <= capacity)
            continue;
        /* expert e is over capacity: rank its assignments and drop the tail */
        int n = 0;
        for (int a = 0; a < NK; a++)
            if (topk_idx[a] == e)
                c[n++] = (cand){a, topk_w[a]};
        if (!by_position) /* assignments are already in position order */
            qsort(c, (size_t)n, sizeof *c, by_weight_then_position);
        for (int i = capacity; i < n; i++) {
            dispatch_idx[c[i].a] = E;
            dropped++;
        }
    }
    free(count);
    free(c);
    return dropped;
}

/* ---------------------------------------------------------------------- plan */

static moe_dtype act_dtype(const moe_backend *be) {
    return be->act_size == 2 ? MOE_DTYPE_BF16 : be->act_size == 4 ? MOE_DTYPE_F32 : MOE_DTYPE_F64;
}
static moe_dtype real_dtype(void) { return sizeof(moe_real) == 4 ? MOE_DTYPE_F32 : MOE_DTYPE_F64; }

void *moe_grow(const moe_backend *be, void *p, size_t *cap, size_t bytes) {
    if (bytes <= *cap)
        return p;
    be->free(p);
    p = be->alloc(bytes);
    MOE_ASSERT(p != NULL);
    *cap = bytes;
    return p;
}

void moe_dispatch_plan_build(moe_ep *ep, moe_dispatch_plan *plan, const long long *counts, int E,
                             int pad_capacity) {
    const moe_backend *be = ep->be;
    const int P = ep->comm ? ep->size : 1, rank = ep->comm ? ep->rank : 0, EL = E / P;
    if (!plan->send_rows) {
        plan->send_rows = calloc((size_t)P, sizeof(size_t));
        plan->recv_rows = calloc((size_t)P, sizeof(size_t));
        plan->expert_offset = calloc((size_t)EL + 1, sizeof(int));
        plan->send_chunks = calloc((size_t)P * EL, sizeof(moe_comm_chunk));
        plan->recv_chunks = calloc((size_t)P * EL, sizeof(moe_comm_chunk));
        MOE_ASSERT(plan->send_rows && plan->recv_rows && plan->expert_offset &&
                   plan->send_chunks && plan->recv_chunks);
    }
    plan->E = E;
    plan->E_local = EL;

    /* what this rank sends to each global expert, and the count exchange */
    long long *mine = malloc(sizeof(long long) * E), *all = malloc(sizeof(long long) * E * P);
    MOE_ASSERT(mine && all);
    plan->R_kept = 0;
    plan->R_send = 0;
    for (int e = 0; e < E; e++) {
        plan->R_kept += (int)counts[e];
        mine[e] = pad_capacity ? pad_capacity : counts[e];
        plan->R_send += (int)mine[e];
    }
    if (ep->comm)
        moe_comm_host_all_gather(ep->comm, mine, all, (size_t)E, MOE_DTYPE_I64);
    else
        memcpy(all, mine, sizeof(long long) * E);

    /* splits: to rank p go my rows for p's experts; from rank p come p's rows for mine */
    plan->R_recv = 0;
    for (int p = 0; p < P; p++) {
        plan->send_rows[p] = plan->recv_rows[p] = 0;
        for (int el = 0; el < EL; el++) {
            plan->send_rows[p] += (size_t)mine[p * EL + el];
            plan->recv_rows[p] += (size_t)all[(size_t)p * E + rank * EL + el];
        }
        plan->R_recv += (int)plan->recv_rows[p];
    }

    /* the fused path: each expert's shift from my permuted rows to its rows on its rank,
     * and the largest rank's row count (the symmetric buffers are the same size on all) */
    plan->fused = ep->fused && ep->comm && !pad_capacity;
    if (plan->fused) {
        plan->max_recv = 0;
        for (int q = 0; q < P; q++) {
            long long r = 0;
            for (int p = 0; p < P; p++)
                for (int el = 0; el < EL; el++)
                    r += all[(size_t)p * E + q * EL + el];
            if (r > plan->max_recv)
                plan->max_recv = (int)r;
        }
        int *h_shift = malloc(sizeof(int) * E);
        MOE_ASSERT(h_shift);
        long long perm_off = 0;
        for (int e = 0; e < E; e++) {
            const int q = e / EL, el = e % EL;
            long long base = 0; /* q's earlier local experts, then earlier ranks' rows for e */
            for (int l = 0; l < el; l++)
                for (int p = 0; p < P; p++)
                    base += all[(size_t)p * E + q * EL + l];
            for (int p = 0; p < rank; p++)
                base += all[(size_t)p * E + e];
            h_shift[e] = (int)(base - perm_off);
            perm_off += counts[e];
        }
        if (E > plan->shift_cap) {
            be->free(plan->shift);
            plan->shift = be->alloc(sizeof(int) * E);
            MOE_ASSERT(plan->shift);
            plan->shift_cap = E;
        }
        be->from_host(plan->shift, h_shift, sizeof(int) * E);
        free(h_shift);
    }

    /* host maps */
    int rows = plan->R_send > plan->R_recv ? plan->R_send : plan->R_recv;
    if (plan->R_kept > rows)
        rows = plan->R_kept;
    int *h_send = malloc(sizeof(int) * (rows + 1)), *h_unpad = malloc(sizeof(int) * (rows + 1));
    int *h_sort = malloc(sizeof(int) * (rows + 1)), *h_unsort = malloc(sizeof(int) * (rows + 1));
    MOE_ASSERT(h_send && h_unpad && h_sort && h_unsort);
    if (pad_capacity) {
        /* expert e's slots are [e·cap, (e+1)·cap): its kept rows first, then zero rows */
        int kept_off = 0;
        for (int e = 0; e < E; e++) {
            for (int i = 0; i < pad_capacity; i++) {
                int srow = e * pad_capacity + i;
                h_send[srow] = i < counts[e] ? kept_off + i : -1;
                if (i < counts[e])
                    h_unpad[kept_off + i] = srow;
            }
            kept_off += (int)counts[e];
        }
    }
    /* received layout [src p][local expert el] → expert layout [el][p] */
    int *recv_off = malloc(sizeof(int) * (size_t)P * EL), *exp_off = malloc(sizeof(int) * (size_t)P * EL);
    MOE_ASSERT(recv_off && exp_off);
    int off = 0;
    for (int p = 0; p < P; p++)
        for (int el = 0; el < EL; el++) {
            recv_off[p * EL + el] = off;
            off += (int)all[(size_t)p * E + rank * EL + el];
        }
    off = 0;
    for (int el = 0; el < EL; el++) {
        plan->expert_offset[el] = off;
        for (int p = 0; p < P; p++) {
            exp_off[p * EL + el] = off;
            off += (int)all[(size_t)p * E + rank * EL + el];
        }
    }
    plan->expert_offset[EL] = off;
    /* the same layouts as chunk lists, for the exchange across ranks */
    size_t send_off = 0;
    for (int e = 0; e < E; e++) {
        plan->send_chunks[e] = (moe_comm_chunk){send_off, (size_t)mine[e], e / EL};
        send_off += (size_t)mine[e];
    }
    for (int p = 0; p < P; p++)
        for (int el = 0; el < EL; el++)
            plan->recv_chunks[p * EL + el] =
                (moe_comm_chunk){(size_t)exp_off[p * EL + el],
                                 (size_t)all[(size_t)p * E + rank * EL + el], p};
    for (int p = 0; p < P && !plan->fused; p++) /* the fused path needs no maps */
        for (int el = 0; el < EL; el++) {
            int n = (int)all[(size_t)p * E + rank * EL + el];
            for (int i = 0; i < n; i++) {
                h_sort[exp_off[p * EL + el] + i] = recv_off[p * EL + el] + i;
                h_unsort[recv_off[p * EL + el] + i] = exp_off[p * EL + el] + i;
            }
        }

    /* upload */
    if (rows > plan->cap_rows) {
        be->free(plan->send_map);
        be->free(plan->unpad_map);
        be->free(plan->sort_map);
        be->free(plan->unsort_map);
        size_t bytes = sizeof(int) * (size_t)(rows + 1);
        plan->send_map = be->alloc(bytes);
        plan->unpad_map = be->alloc(bytes);
        plan->sort_map = be->alloc(bytes);
        plan->unsort_map = be->alloc(bytes);
        MOE_ASSERT(plan->send_map && plan->unpad_map && plan->sort_map && plan->unsort_map);
        plan->cap_rows = rows;
    }
    /* without padding the send layout is the permuted layout itself: no send/unpad maps */
    plan->padded = pad_capacity > 0;
    if (plan->padded) {
        be->from_host(plan->send_map, h_send, sizeof(int) * plan->R_send);
        be->from_host(plan->unpad_map, h_unpad, sizeof(int) * plan->R_kept);
    }
    if (!plan->fused) {
        be->from_host(plan->sort_map, h_sort, sizeof(int) * plan->R_recv);
        be->from_host(plan->unsort_map, h_unsort, sizeof(int) * plan->R_recv);
    }
    free(h_send); free(h_unpad); free(h_sort); free(h_unsort); free(recv_off); free(exp_off);
    free(mine); free(all);
}

void moe_dispatch_plan_free(const moe_backend *be, moe_dispatch_plan *plan) {
    be->free(plan->ag_tok);
    be->free(plan->ag_inv);
    be->free(plan->ag_identity);
    be->free(plan->send_map);
    be->free(plan->unpad_map);
    be->free(plan->sort_map);
    be->free(plan->unsort_map);
    be->free(plan->shift);
    free(plan->send_rows);
    free(plan->recv_rows);
    free(plan->expert_offset);
    free(plan->send_chunks);
    free(plan->recv_chunks);
    memset(plan, 0, sizeof *plan);
}

/* ------------------------------------------------------------ the fused path */

void *moe_dispatch_sym_rows(moe_ep *ep, const moe_dispatch_plan *plan, moe_sym_buf *b,
                            size_t row_bytes) {
    const size_t need = row_bytes * ((size_t)plan->max_recv + 1);
    /* a quarter of headroom: the largest rank's rows move a little every step, and each
     * growth is a collective registration */
    if (!b->ptr || b->bytes < need)
        moe_comm_sym_reserve(ep->comm, b, need + need / 4);
    return b->ptr;
}

void moe_dispatch_fused(moe_ep *ep, const moe_dispatch_plan *plan, moe_sym_buf *rows,
                        moe_sym_buf *reals, const void *x, const moe_real *w, const int *idx,
                        const int *row_of, int N, int k, int C) {
    MOE_ASSERT(plan->fused);
#if defined(MOE_HAVE_NCCL) && !defined(MOE_REAL_DOUBLE)
    moe_nvlink_dispatch(ep->comm, rows, reals, x, w, idx, row_of, plan->shift, N, k, plan->E,
                        plan->E_local, C);
#else
    (void)ep; (void)rows; (void)reals; (void)x; (void)w; (void)idx; (void)row_of; (void)N;
    (void)k; (void)C;
    moe_comm_abort(NULL, 1, "the fused dispatcher needs a CUDA + NCCL build");
#endif
}

void moe_combine_fused(moe_ep *ep, const moe_dispatch_plan *plan, void *out, int accumulate,
                       moe_real *dwp, moe_sym_buf *rows, moe_sym_buf *reals, const int *idx,
                       const int *row_of, int N, int k, int C) {
    MOE_ASSERT(plan->fused);
#if defined(MOE_HAVE_NCCL) && !defined(MOE_REAL_DOUBLE)
    moe_nvlink_combine(ep->comm, out, accumulate, dwp, rows, reals, idx, row_of, plan->shift, N,
                       k, plan->E, plan->E_local, C);
#else
    (void)ep; (void)out; (void)accumulate; (void)dwp; (void)rows; (void)reals; (void)idx;
    (void)row_of; (void)N; (void)k; (void)C;
    moe_comm_abort(NULL, 1, "the fused dispatcher needs a CUDA + NCCL build");
#endif
}

void moe_ep_free(moe_ep *ep) {
    if (!ep->be)
        return;
    ep->be->free(ep->send_buf);
    ep->be->free(ep->recv_buf);
    ep->be->free(ep->ag_buf);
    ep->send_buf = ep->recv_buf = ep->ag_buf = NULL;
    ep->send_cap = ep->recv_cap = ep->ag_cap = 0;
}

/* ------------------------------------------------------------ moving rows */

/* counts per rank in elements: rows · C */
static void scale_counts(size_t *out, const size_t *rows, int P, int C) {
    for (int p = 0; p < P; p++)
        out[p] = rows[p] * (size_t)C;
}

/* The one routine behind all four directions. elem: element size; is_act: activation
 * (gather_rows) or full precision (gather_reals, C = 1). */
static void move(moe_ep *ep, const moe_dispatch_plan *plan, void *dst, const void *src, int C,
                 int is_act, int to_experts) {
    const moe_backend *be = ep->be;
    const size_t elem = is_act ? be->act_size : sizeof(moe_real);
    const moe_dtype t = is_act ? act_dtype(be) : real_dtype();
    const int P = ep->comm ? ep->size : 1;
    ep->send_buf = moe_grow(be, ep->send_buf, &ep->send_cap, elem * C * (size_t)(plan->R_send + 1));
    ep->recv_buf = moe_grow(be, ep->recv_buf, &ep->recv_cap, elem * C * (size_t)(plan->R_recv + 1));
    size_t *sc = malloc(sizeof(size_t) * P), *rc = malloc(sizeof(size_t) * P);
    MOE_ASSERT(sc && rc);
    scale_counts(sc, plan->send_rows, P, C);
    scale_counts(rc, plan->recv_rows, P, C);
#define GATHER(d, s, map, rows)                                            \
    do {                                                                   \
        if (is_act)                                                        \
            be->gather_rows((d), (s), (map), (rows), C);                   \
        else                                                               \
            be->gather_reals((moe_real *)(d), (const moe_real *)(s), (map), (rows)); \
    } while (0)
    /* chunk lists in elements */
    const int nch = P * plan->E_local;
    moe_comm_chunk *cs = malloc(sizeof *cs * nch), *cr = malloc(sizeof *cr * nch);
    MOE_ASSERT(cs && cr);
    for (int i = 0; i < nch; i++) {
        cs[i] = plan->send_chunks[i];
        cs[i].offset *= (size_t)C;
        cs[i].count *= (size_t)C;
        cr[i] = plan->recv_chunks[i];
        cr[i].offset *= (size_t)C;
        cr[i].count *= (size_t)C;
    }
    if (to_experts) {
        /* permuted → (padded) send layout → exchange straight into [el][src] */
        const void *send = src;
        if (plan->padded) {
            GATHER(ep->send_buf, src, plan->send_map, plan->R_send);
            send = ep->send_buf;
        }
        if (ep->comm)
            moe_comm_exchange(ep->comm, send, cs, nch, dst, cr, nch, t);
        else /* one rank: [src][el] is [el] already, the sort is a gather */
            GATHER(dst, send, plan->sort_map, plan->R_recv);
    } else {
        /* [el][src] → exchange back into the (padded) send layout → (unpad) → permuted */
        void *back = plan->padded ? ep->send_buf : dst;
        if (ep->comm)
            moe_comm_exchange(ep->comm, src, cr, nch, back, cs, nch, t);
        else
            GATHER(back, src, plan->unsort_map, plan->R_recv);
        if (plan->padded)
            GATHER(dst, back, plan->unpad_map, plan->R_kept);
    }
    free(cs);
    free(cr);
#undef GATHER
    free(sc);
    free(rc);
}

void moe_dispatch_rows(moe_ep *ep, const moe_dispatch_plan *plan, void *dst, const void *src,
                       int C) {
    move(ep, plan, dst, src, C, 1, 1);
}

void moe_dispatch_reals(moe_ep *ep, const moe_dispatch_plan *plan, moe_real *dst,
                        const moe_real *src) {
    move(ep, plan, dst, src, 1, 0, 1);
}

void moe_combine_rows(moe_ep *ep, const moe_dispatch_plan *plan, void *dst, const void *src,
                      int C) {
    move(ep, plan, dst, src, C, 1, 0);
}

void moe_combine_reals(moe_ep *ep, const moe_dispatch_plan *plan, moe_real *dst,
                       const moe_real *src) {
    move(ep, plan, dst, src, 1, 0, 0);
}
