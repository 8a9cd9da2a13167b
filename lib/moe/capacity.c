/* Expert capacity and token dropping: see capacity.h. */
#include "moe/capacity.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moe/layer.h"

int moe_expert_capacity(int N, int k, int E, double factor) {
    /* In double, then clamped: a token picks an expert at most once, so no expert ever
     * receives more than N rows, and a larger capacity drops nothing. Without the clamp a
     * large factor (or one that is not finite) overflows int and the capacity goes
     * negative. */
    double cap = ceil((double)N * k / E * factor);
    if (!(cap < (double)N)) /* also catches NaN */
        return N;
    return cap < 0 ? 0 : (int)cap;
}

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
                             int k, int E, int capacity, moe_drop_policy policy) {
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
        if (policy == MOE_DROP_PROBS) /* assignments are already in position order */
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

int moe_capacity_route(const moe_backend *be, const moe_layer_dims *d, moe_layer_acts *a,
                       int *didx) {
    const int E = d->E, NK = d->N * d->k;
    be->to_host(a->host_idx, a->topk_idx, sizeof(int) * NK);
    be->to_host(a->host_w, a->topk_w, sizeof(moe_real) * NK);
    memset(a->counts, 0, sizeof(long long) * E);
    for (int i = 0; i < NK; i++)
        a->counts[a->host_idx[i]]++;
    a->dropped = 0;
    if (d->capacity_factor <= 0) {
        memcpy(didx, a->host_idx, sizeof(int) * NK);
        return 0;
    }
    int cap = moe_expert_capacity(d->N, d->k, E, d->capacity_factor);
    a->dropped = moe_apply_capacity(didx, a->host_idx, a->host_w, d->N, d->k, E, cap,
                                    d->drop_policy);
    return cap;
}

void moe_capacity_pad_maps(int *send, int *unpad, const long long *counts, int E, int cap) {
    int kept_off = 0;
    for (int e = 0; e < E; e++) {
        for (int i = 0; i < cap; i++) {
            int srow = e * cap + i;
            send[srow] = i < counts[e] ? kept_off + i : -1;
            if (i < counts[e])
                unpad[kept_off + i] = srow;
        }
        kept_off += (int)counts[e];
    }
}
