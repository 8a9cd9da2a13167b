/* CUDA graphs of parts of a training step: see graph.h. */
#include "graph.h"

#include "comm.h"
#include "moe/experts.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const g_scope_names[] = {"none", "attn", "moe_router", "moe_preprocess",
                                            "layer", "full_iteration"};

const char *moe_graph_scope_name(moe_graph_scope s) {
    return (unsigned)s < sizeof g_scope_names / sizeof g_scope_names[0] ? g_scope_names[s]
                                                                       : "?";
}

/* ------------------------------------------------------------------ the static check */

static int any_moe_layer(const moe_config *c) {
    for (int l = 0; l < c->num_layers; l++)
        if (c->is_moe_layer[l])
            return 1;
    return 0;
}

/* Appends "; what" to the list of blockers. */
static void add(char *buf, size_t cap, const char *what) {
    size_t n = strlen(buf);
    if (n + 2 < cap)
        snprintf(buf + n, cap - n, "%s%s", n ? "; " : "", what);
}

/* Why a MoE layer of this configuration is not sync-free (moe_layer_sync_free()), or NULL:
 * the paths that bring offsets or counts to the host. @p be NULL: what the flags alone say
 * (the expert backend "auto" is resolved with the backend). */
static const char *not_sync_free(const moe_config *c, const moe_backend *be) {
    if (c->expert_model_parallel_size > 1 && c->dispatcher_type == MOE_DISPATCHER_ALLGATHER)
        return "the allgather dispatcher sizes the gathered rows from host counts "
               "(--moe-token-dispatcher-type alltoall --moe-alltoall-path fused plans on the "
               "device)";
    /* under EP only the fused dispatcher plans on the device (dispatch_fused.c); auto may
     * fall back to the collective path, so it has to be asked for */
    if (c->expert_model_parallel_size > 1 && c->alltoall_path != MOE_A2A_FUSED)
        return "the collective all-to-all-v needs its splits on the host (--moe-alltoall-path "
               "fused exchanges the counts and plans on the device)";
    if (c->moe_expert_capacity_factor > 0)
        return "a capacity factor drops tokens on the host";
    if (c->expert_tensor_parallel_size > 1)
        return "expert tensor parallelism gathers its rows with host offsets";
    if (c->expert_backend == MOE_EXPERT_BACKEND_LOOP ||
        c->expert_backend == MOE_EXPERT_BACKEND_CUBLAS)
        return "--moe-expert-backend loop and cublas-grouped size their GEMMs from host "
               "offsets (only our grouped kernel reads them on the device)";
    if (!be)
        return NULL;
    switch (moe_expert_impl_from_config(c, be)) {
    case MOE_EXPERTS_KERNEL:
        return NULL;
    case MOE_EXPERTS_CUBLAS:
        return "the experts run on cuBLAS's grouped GEMM, which sizes its GEMMs from host "
               "offsets (our kernel takes --hidden-size and --moe-ffn-hidden-size that are "
               "multiples of 64)";
    default:
        return "the experts run as chapter 01's loop, which sizes its GEMMs from host offsets "
               "(--moe-expert-backend grouped runs our kernel)";
    }
}

moe_status moe_graph_scope_check(const moe_config *c, const moe_backend *be, moe_error *err) {
    const moe_graph_scope s = c->graph_scope;
    if (s == MOE_GRAPH_NONE)
        return MOE_OK;
    /* a backend without graphs (the CPU) runs every level eagerly: the same results */
    if (be && !be->graph_begin)
        return MOE_OK;
    if (s == MOE_GRAPH_ATTN) /* the attention block is pure device work: nothing to refuse */
        return MOE_OK;
    /* Beyond attn. Each item names the work that keeps a level's region from being captured
     * and why; the router is device work on every path (its losses stay on the device). */
    char why[MOE_ERROR_MSG_LEN / 2] = "";
    const int moe = any_moe_layer(c);
    if (c->tensor_model_parallel_size > 1 && (moe || s >= MOE_GRAPH_LAYER))
        add(why, sizeof why, "tensor parallelism: its collectives inside the region count "
            "their bytes on the host");
    const char *host = moe ? not_sync_free(c, be) : NULL;
    if (host && s >= MOE_GRAPH_MOE_PREPROCESS) {
        char buf[MOE_ERROR_MSG_LEN / 4];
        snprintf(buf, sizeof buf, "the MoE layer is not sync-free (%s)", host);
        add(why, sizeof why, buf);
    }
    if (!why[0])
        return MOE_OK;
    return moe_error_set(err, MOE_ERR_CONFIG,
                         "cuda graph scope '%s' is not capturable here: %s. Use a smaller "
                         "--cuda-graph-scope (attn always works; moe_router needs no tensor "
                         "parallelism, moe_preprocess, layer and full_iteration a sync-free MoE "
                         "layer as well; chapter 06)", moe_graph_scope_name(s), why);
}

/* ------------------------------------------------------------------ the cache */

typedef struct graph_entry {
    moe_graph_key key;
    int seen;      /* calls so far: 1 = warmed up (ran eagerly once) */
    void *graph;   /* the backend's executable graph, or NULL */
    size_t nodes;  /* its kernels, memsets and copies */
    moe_comm_tally *tally; /* the bytes its collectives counted at capture (NULL: none) */
} graph_entry;

struct moe_graphs {
    const moe_backend *be;
    moe_graph_scope scope;
    graph_entry *e;
    int n, cap;
    moe_graph_stats stats;
    moe_status status; /* the first capture error (sticky) */
    moe_error err;
};

moe_graphs *moe_graphs_create(const moe_backend *be, moe_graph_scope scope) {
    moe_graphs *g = calloc(1, sizeof *g);
    if (!g)
        return NULL;
    g->be = be;
    g->scope = be->graph_begin ? scope : MOE_GRAPH_NONE; /* no graphs: eager */
    return g;
}

void moe_graphs_free(moe_graphs *g) {
    if (!g)
        return;
    for (int i = 0; i < g->n; i++) {
        if (g->e[i].graph)
            g->be->graph_free(g->e[i].graph);
        moe_comm_tally_free(g->e[i].tally);
    }
    free(g->e);
    free(g);
}

moe_graph_scope moe_graphs_scope(const moe_graphs *g) { return g ? g->scope : MOE_GRAPH_NONE; }

static int same_key(moe_graph_key a, moe_graph_key b) {
    return a.site == b.site && a.layer == b.layer && a.B == b.B && a.T == b.T &&
           a.variant == b.variant && a.scale == b.scale;
}

static graph_entry *lookup(moe_graphs *g, moe_graph_key key) {
    for (int i = 0; i < g->n; i++)
        if (same_key(g->e[i].key, key))
            return &g->e[i];
    if (g->n == g->cap) {
        int cap = g->cap ? 2 * g->cap : 16;
        graph_entry *e = realloc(g->e, sizeof *e * (size_t)cap);
        if (!e)
            return NULL;
        g->e = e;
        g->cap = cap;
    }
    graph_entry *e = &g->e[g->n++];
    memset(e, 0, sizeof *e);
    e->key = key;
    return e;
}

static const char *const g_site_names[MOE_GRAPH_SITES] = {
    "attention forward", "attention backward", "router forward", "router backward",
    "router and dispatch plan", "layer forward", "layer backward", "training step"};

void moe_graph_run(moe_graphs *g, moe_graph_key key, void (*fn)(void *ctx), void *ctx) {
    graph_entry *e = g && g->scope != MOE_GRAPH_NONE && g->status == MOE_OK ? lookup(g, key)
                                                                             : NULL;
    if (e && e->graph) {
        if (g->be->graph_launch(e->graph)) {
            g->stats.replays++;
            g->stats.nodes += (long long)e->nodes;
            /* the replayed collectives: counted as the capture counted them, and watched */
            moe_comm_tally_replay(e->tally);
            moe_comm_tally_track(e->tally, g_site_names[key.site]);
            return;
        }
        /* a buffer it used has moved: forget it, warm up again, capture again */
        g->be->graph_free(e->graph);
        e->graph = NULL;
        moe_comm_tally_free(e->tally);
        e->tally = NULL;
        e->seen = 0;
    }
    if (!e || e->seen == 0) { /* eager: no graphs, or this key's warm-up */
        fn(ctx);
        if (g)
            g->stats.eager++;
        if (e)
            e->seen = 1;
        return;
    }
    char why[MOE_ERROR_MSG_LEN / 2] = "";
    g->be->graph_begin();
    /* the host code of the region runs once, now: what its collectives count is recorded,
     * to be counted again at each replay (comm.h) */
    moe_comm_tally_begin();
    fn(ctx); /* recorded, not run (or run eagerly after an uncapturable op ended the capture) */
    moe_comm_tally *tally = moe_comm_tally_end();
    void *graph = g->be->graph_end(why, sizeof why);
    if (!graph) {
        moe_comm_tally_free(tally);
        /* The region (or its part before the uncapturable op) was recorded, not run, and the
         * recording is gone: this step is lost. The error stops the run. */
        g->status = moe_error_set(&g->err, MOE_ERR_CONFIG,
                                  "cuda graph scope '%s': %s is not capturable (in the %s of "
                                  "layer %d, B=%d T=%d); use a smaller --cuda-graph-scope",
                                  moe_graph_scope_name(g->scope), why, g_site_names[key.site],
                                  key.layer, key.B, key.T);
        return;
    }
    e->graph = graph;
    e->nodes = g->be->graph_nodes(graph);
    e->tally = tally;
    g->stats.captures++;
    if (g->be->graph_launch(graph)) { /* the capture only recorded: now run it (its bytes
                                         were counted while it was recorded) */
        g->stats.replays++;
        g->stats.nodes += (long long)e->nodes;
        moe_comm_tally_track(e->tally, g_site_names[key.site]);
    } else { /* cannot happen: nothing moved since the capture */
        g->status = moe_error_set(&g->err, MOE_ERR_CONFIG,
                                  "cuda graph scope '%s': a buffer moved during the capture of "
                                  "the %s of layer %d (internal error: please report it)",
                                  moe_graph_scope_name(g->scope), g_site_names[key.site],
                                  key.layer);
    }
}

moe_status moe_graphs_status(const moe_graphs *g, moe_error *err) {
    if (!g || g->status == MOE_OK)
        return MOE_OK;
    if (err)
        *err = g->err;
    return g->status;
}

void moe_graphs_reset(moe_graphs *g) {
    if (!g)
        return;
    for (int i = 0; i < g->n; i++) {
        if (g->e[i].graph)
            g->be->graph_free(g->e[i].graph);
        g->e[i].graph = NULL;
        moe_comm_tally_free(g->e[i].tally);
        g->e[i].tally = NULL;
        g->e[i].seen = 0;
    }
}

moe_graph_stats moe_graphs_stats(const moe_graphs *g) {
    moe_graph_stats z = {0, 0, 0, 0};
    return g ? g->stats : z;
}
