/* CUDA graphs of parts of a training step: see graph.h. */
#include "graph.h"

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

moe_status moe_graph_scope_check(const moe_config *c, const moe_backend *be, moe_error *err) {
    const moe_graph_scope s = c->graph_scope;
    if (s == MOE_GRAPH_NONE)
        return MOE_OK;
    /* a backend without graphs (the CPU) runs every level eagerly: the same results */
    if (be && !be->graph_begin)
        return MOE_OK;
    if (s == MOE_GRAPH_ATTN) /* the attention block is pure device work: nothing to refuse */
        return MOE_OK;
    /* Every level beyond attn is refused today. Each item names the work and why; the host
     * reads of the router and of the step's losses, norm and clip are gone (the step's
     * scalars stay on the device: step_scalars.h), so what is left is a capture site for
     * each region, and the host reads of the MoE paths that are not sync-free. */
    char why[MOE_ERROR_MSG_LEN / 2] = "";
    const int moe = any_moe_layer(c);
    if (moe) {
        add(why, sizeof why, "the router (device work only) has no capture site yet");
        if (s >= MOE_GRAPH_MOE_PREPROCESS)
            add(why, sizeof why, "permute_index returns the expert offsets on the host (the "
                "sync-free path has no capture site yet)");
    }
    if (s >= MOE_GRAPH_LAYER) {
        if (moe)
            add(why, sizeof why, "other MoE paths size GEMMs from host offsets, drop on the "
                "host or exchange counts on the host (EP)");
        else /* dense layers are device work, but only attn has a capture site yet */
            add(why, sizeof why, "the dense FFN and the norms around each block have no "
                "capture site yet (only attn)");
    }
    if (s >= MOE_GRAPH_FULL_ITERATION)
        add(why, sizeof why, "the tokens come from pageable memory (from_host waits)");
    if (!why[0]) /* a dense model at moe_router / moe_preprocess: nothing beyond attn */
        return MOE_OK;
    return moe_error_set(err, MOE_ERR_CONFIG,
                         "cuda graph scope '%s' is not capturable yet: %s. Use --cuda-graph-scope "
                         "attn (or none) until the capture sites of the larger scopes land "
                         "(chapter 06)", moe_graph_scope_name(s), why);
}

/* ------------------------------------------------------------------ the cache */

typedef struct graph_entry {
    moe_graph_key key;
    int seen;      /* calls so far: 1 = warmed up (ran eagerly once) */
    void *graph;   /* the backend's executable graph, or NULL */
    size_t nodes;  /* its kernels, memsets and copies */
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
    for (int i = 0; i < g->n; i++)
        if (g->e[i].graph)
            g->be->graph_free(g->e[i].graph);
    free(g->e);
    free(g);
}

moe_graph_scope moe_graphs_scope(const moe_graphs *g) { return g ? g->scope : MOE_GRAPH_NONE; }

static int same_key(moe_graph_key a, moe_graph_key b) {
    return a.site == b.site && a.layer == b.layer && a.B == b.B && a.T == b.T;
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

static const char *const g_site_names[MOE_GRAPH_SITES] = {"attention forward",
                                                          "attention backward"};

void moe_graph_run(moe_graphs *g, moe_graph_key key, void (*fn)(void *ctx), void *ctx) {
    graph_entry *e = g && g->scope != MOE_GRAPH_NONE && g->status == MOE_OK ? lookup(g, key)
                                                                             : NULL;
    if (e && e->graph) {
        if (g->be->graph_launch(e->graph)) {
            g->stats.replays++;
            g->stats.nodes += (long long)e->nodes;
            return;
        }
        /* a buffer it used has moved: forget it, warm up again, capture again */
        g->be->graph_free(e->graph);
        e->graph = NULL;
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
    fn(ctx); /* recorded, not run (or run eagerly after an uncapturable op ended the capture) */
    void *graph = g->be->graph_end(why, sizeof why);
    if (!graph) {
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
    g->stats.captures++;
    if (g->be->graph_launch(graph)) { /* the capture only recorded: now run it */
        g->stats.replays++;
        g->stats.nodes += (long long)e->nodes;
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

moe_graph_stats moe_graphs_stats(const moe_graphs *g) {
    moe_graph_stats z = {0, 0, 0, 0};
    return g ? g->stats : z;
}
