/* The parameter table: see params.h. */
#include "params.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rng.h"

size_t moe_params_add(moe_param_table *pt, const char *name, int ndim, int s0, int s1, int s2,
                      moe_init init, double std, int decay) {
    if (pt->n == pt->cap) {
        pt->cap = pt->cap ? 2 * pt->cap : 64;
        pt->t = realloc(pt->t, sizeof *pt->t * (size_t)pt->cap);
        MOE_ASSERT(pt->t != NULL);
    }
    MOE_ASSERT(ndim >= 1 && ndim <= 3 && strlen(name) < sizeof pt->t[0].name);
    MOE_ASSERT(moe_params_find(pt, name) == NULL);
    moe_tensor *t = &pt->t[pt->n++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->ndim = ndim;
    int s[3] = {s0, s1, s2};
    t->numel = 1;
    for (int i = 0; i < ndim; i++) {
        t->shape[i] = t->global_shape[i] = s[i];
        t->numel *= (size_t)s[i];
    }
    t->shard = (moe_shard){MOE_GROUP_NONE, 0, 0, 1};
    t->inner = (moe_shard){MOE_GROUP_NONE, 0, 0, 1};
    t->grad_group = MOE_GROUP_DP_CP;
    t->partial_group = MOE_GROUP_NONE;
    t->offset = pt->total;
    t->init = init;
    t->std = std;
    t->decay = decay;
    t->low = (moe_tensor_copy){MOE_NO_COPY, MOE_NO_COPY};
    pt->total += t->numel;
    return t->offset;
}

void moe_params_shard(moe_param_table *pt, moe_group_kind group, int dim, int index, int count) {
    MOE_ASSERT(pt->n > 0);
    moe_tensor *t = &pt->t[pt->n - 1];
    /* at most two splits: any one, or EP (whole experts) and then ETP inside each expert
     * along another dimension */
    const int second = t->shard.group != MOE_GROUP_NONE;
    MOE_ASSERT(!second || (t->shard.group == MOE_GROUP_EP && group == MOE_GROUP_ETP &&
                           t->inner.group == MOE_GROUP_NONE && dim != t->shard.dim));
    MOE_ASSERT(dim >= 0 && dim < t->ndim && count >= 1 && index >= 0 && index < count &&
               t->global_shape[dim] % count == 0);
    pt->total -= t->numel;
    t->shape[dim] = t->global_shape[dim] / count;
    t->origin[dim] = index * t->shape[dim];
    t->numel = 1;
    for (int d = 0; d < t->ndim; d++)
        t->numel *= (size_t)t->shape[d];
    if (second) { /* the shards of both splits together make the tensor: the norm sums its
                   * squares over ETP x EP */
        t->inner = (moe_shard){group, dim, index, count};
        t->shard.group = MOE_GROUP_ETP_EP;
    } else {
        t->shard = (moe_shard){group, dim, index, count};
    }
    t->grad_group = moe_group_in_expert_grid(group) ? MOE_GROUP_EDP : MOE_GROUP_DP_CP;
    pt->total += t->numel;
}

void moe_params_partial(moe_param_table *pt, moe_group_kind group) {
    MOE_ASSERT(pt->n > 0 && (group == MOE_GROUP_TP || group == MOE_GROUP_NONE));
    pt->t[pt->n - 1].partial_group = group;
}

size_t moe_tensor_global_index(const moe_tensor *t, size_t j) {
    if (t->shard.count == 1 && t->inner.count == 1)
        return j; /* the whole tensor */
    /* peel the local coordinates off j (innermost first) and place them, shifted by the
     * shard's origin, in the global shape */
    size_t g = 0, place = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        size_t i = j % (size_t)t->shape[d];
        j /= (size_t)t->shape[d];
        g += (i + (size_t)t->origin[d]) * place;
        place *= (size_t)t->global_shape[d];
    }
    return g;
}

size_t moe_tensor_local_index(const moe_tensor *t, size_t g) {
    /* peel the global coordinates off g (innermost first); each must fall inside this
     * shard's [origin, origin + shape) */
    size_t j = 0, place = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        const size_t i = g % (size_t)t->global_shape[d];
        g /= (size_t)t->global_shape[d];
        if (i < (size_t)t->origin[d] || i >= (size_t)t->origin[d] + (size_t)t->shape[d])
            return (size_t)-1;
        j += (i - (size_t)t->origin[d]) * place;
        place *= (size_t)t->shape[d];
    }
    return j;
}

int moe_params_next_run(const moe_param_table *pt, moe_params_key key, int *i, size_t *start,
                        size_t *end, moe_group_kind *k) {
    if (*i >= pt->n)
        return 0;
    *k = key(&pt->t[*i]);
    *start = pt->t[*i].offset;
    while (*i < pt->n && key(&pt->t[*i]) == *k)
        (*i)++;
    *end = pt->t[*i - 1].offset + pt->t[*i - 1].numel;
    return 1;
}

const moe_tensor *moe_params_find(const moe_param_table *pt, const char *name) {
    for (int i = 0; i < pt->n; i++)
        if (!strcmp(pt->t[i].name, name))
            return &pt->t[i];
    return NULL;
}

uint64_t moe_hash_name(const char *s) {
    uint64_t h = 14695981039346656037ull; /* FNV-1a 64-bit offset basis */
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 1099511628211ull;
    }
    return h;
}

void moe_params_init(const moe_param_table *pt, moe_real *params, uint64_t seed) {
    for (int i = 0; i < pt->n; i++) {
        const moe_tensor *t = &pt->t[i];
        moe_real *p = params + t->offset;
        uint64_t stream = moe_hash_name(t->name);
        switch (t->init) {
        case MOE_INIT_ONES:
            for (size_t j = 0; j < t->numel; j++)
                p[j] = 1;
            break;
        case MOE_INIT_ZEROS:
            memset(p, 0, sizeof *p * t->numel);
            break;
        case MOE_INIT_NORMAL:
#pragma omp parallel for schedule(static)
            for (size_t j = 0; j < t->numel; j++)
                p[j] = (moe_real)(t->std *
                                  moe_rng_normal(seed, stream, moe_tensor_global_index(t, j)));
            break;
        }
    }
}

void moe_params_free(moe_param_table *pt) {
    free(pt->t);
    memset(pt, 0, sizeof *pt);
}
