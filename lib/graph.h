/**
 * @file graph.h
 * @brief CUDA graphs for parts of a training step: `--cuda-graph-scope`, capture once per
 *        shape, replay after (chapter 06).
 *
 * A small model on a fast GPU is host bound: the GPU finishes each kernel before the host
 * has launched the next one. A CUDA graph records a region of ops once and replays all of
 * them with one call of the host. What may be recorded is strict: the region must not wait
 * for the device, read device memory on the host, allocate, or choose its ops from values
 * that live on the device (all of those would be frozen into, or break, the recording).
 *
 * The scope levels follow Megatron's `--cuda-graph-scope` names and nest:
 *
 * | level            | captured (per layer unless said)                                    |
 * |------------------|---------------------------------------------------------------------|
 * | `none`           | nothing: every op launched from the host                            |
 * | `attn`           | the attention block: QKV, QK-norm, RoPE, attention, output projection, forward and backward |
 * | `moe_router`     | + the router GEMM, top-k, aux loss and z-loss                       |
 * | `moe_preprocess` | + the dispatch preprocessing: counts, offsets, permutation          |
 * | `layer`          | each whole transformer layer (Megatron's default per-layer graphs)  |
 * | `full_iteration` | forward, backward and the optimizer step: one graph per step        |
 *
 * The router region is device work on every MoE path. The dispatch plan and the rest of a
 * MoE layer are device work only on the sync-free path (moe/layer.h: one rank of experts,
 * dropless, our grouped kernel): the other paths bring offsets or counts to the host.
 * moe_graph_scope_check() refuses, with a named error, a level whose region still contains
 * work that waits for the host or that has no capture site yet: `moe_preprocess` and
 * `layer` (and `full_iteration`) on a MoE path that is not sync-free, and any level beyond
 * `attn` under tensor parallelism (its collectives count their bytes on the host); the
 * trainer refuses `full_iteration` on more than one GPU rank for the same reason (the
 * gradient all-reduces). The step's batches and AdamW's per-step scalars reach a captured
 * step through page-locked memory (from_host_async), so they are not host waits.
 * moe_graph_run() is the
 * capture helper: keyed by (site, layer, B, T), the first call of a key runs eagerly (the
 * warm-up: lazily sized scratch buffers and library handles settle), the second captures
 * and replays, every later one replays. What the backend finds uncapturable while
 * capturing (a wait, a host read, an allocation) ends the capture and becomes a sticky
 * named error that moe_graphs_status() returns.
 */
#ifndef MOE_GRAPH_H
#define MOE_GRAPH_H

#include "backend.h"
#include "config.h"
#include "error.h"

/** Where in the step a graph is captured. */
typedef enum moe_graph_site {
    MOE_GRAPH_SITE_ATTN_FWD = 0,   /**< one layer's attention block, forward */
    MOE_GRAPH_SITE_ATTN_BWD = 1,   /**< one layer's attention block, backward */
    MOE_GRAPH_SITE_ROUTER_FWD = 2, /**< a MoE layer's router, aux loss and z-loss, forward */
    MOE_GRAPH_SITE_ROUTER_BWD = 3, /**< the same, backward (into the router's input gradient) */
    MOE_GRAPH_SITE_PREPROCESS_FWD = 4, /**< the router and the dispatch plan, forward */
    MOE_GRAPH_SITE_LAYER_FWD = 5,  /**< one whole transformer layer, forward */
    MOE_GRAPH_SITE_LAYER_BWD = 6,  /**< one whole transformer layer, backward */
    MOE_GRAPH_SITE_STEP = 7,       /**< the whole training step: every micro-batch's forward
                                    *   and backward, the norm, AdamW (variant: micro-batches) */
    MOE_GRAPH_SITES
} moe_graph_site;

/** What identifies a captured region: the same key means the same ops on the same buffers. */
typedef struct moe_graph_key {
    moe_graph_site site; /**< where */
    int layer;           /**< which layer (-1 for regions of the whole model) */
    int B;               /**< sequences of the micro-batch (the MoE layer's sites: its rows) */
    int T;               /**< tokens per sequence */
    int variant;         /**< a host choice that changes the ops (0 if none): a layer's
                          *   backward stores the expert weight gradients on the first
                          *   micro-batch of a step and adds them on the others */
    double scale;        /**< a host scalar baked into the ops (0 if none): the backward's
                          *   loss scale, 1 / micro-batches */
} moe_graph_key;

/** Counters of a graph cache, for tests and the benchmark. */
typedef struct moe_graph_stats {
    long long eager;    /**< regions run eagerly (warm-up, or scope none) */
    long long captures; /**< regions captured */
    long long replays;  /**< graph launches */
    long long nodes;    /**< kernels, memsets and copies replayed in total */
} moe_graph_stats;

/** The graphs of one model: one entry per key. */
typedef struct moe_graphs moe_graphs;

/** @brief The name of a scope level, as `--cuda-graph-scope` spells it.
 *  @param s level  @return a static string */
const char *moe_graph_scope_name(moe_graph_scope s);

/**
 * @brief Check that `--cuda-graph-scope` can be captured today (moe_config_validate() calls
 *        it without a backend; moe_model_create() again with its backend). A backend without
 *        graph slots (the CPU) runs every level eagerly, with the same results.
 * @param c config (is_moe_layer resolved)  @param be the backend the model runs on, or NULL
 * @param err receives, for a level that cannot be captured, a message naming the level and
 *        each piece of work in it that is not capturable, and what would make it so
 * @return ::MOE_OK or ::MOE_ERR_CONFIG
 */
moe_status moe_graph_scope_check(const moe_config *c, const moe_backend *be, moe_error *err);

/**
 * @brief A graph cache for a scope.
 * @param be backend (its graph slots are used when @p scope is not none; without them the
 *        cache runs every region eagerly)
 * @param scope the level (checked with moe_graph_scope_check() first)
 * @return the cache, or NULL when out of host memory
 */
moe_graphs *moe_graphs_create(const moe_backend *be, moe_graph_scope scope);

/** @brief Free every graph and the cache. @param g cache (NULL: no-op) */
void moe_graphs_free(moe_graphs *g);

/** @brief The scope of a cache. @param g cache (NULL: none) @return its level */
moe_graph_scope moe_graphs_scope(const moe_graphs *g);

/**
 * @brief Run a region: eagerly, or captured once and replayed.
 *
 * @p fn enqueues the region's ops on the backend; it must enqueue the same ops on the same
 * buffers every time it is called with the same @p key. With a NULL cache or scope none it
 * is simply called. After a capture error the cache runs everything eagerly and keeps the
 * error for moe_graphs_status().
 * @param g cache (NULL: eager)  @param key what the region is
 * @param fn enqueues the region  @param ctx its argument
 */
void moe_graph_run(moe_graphs *g, moe_graph_key key, void (*fn)(void *ctx), void *ctx);

/**
 * @brief The first capture error, if any (sticky).
 * @param g cache (NULL: ok)  @param err receives it
 * @return ::MOE_OK or ::MOE_ERR_CONFIG ("cuda graph scope 'attn': ... is not capturable")
 */
moe_status moe_graphs_status(const moe_graphs *g, moe_error *err);

/**
 * @brief Forget every captured graph: buffers the regions use have moved (the MoE budget grew
 *        after an overflow), so each key warms up and is captured again on its next calls.
 * @param g cache (NULL: no-op)
 */
void moe_graphs_reset(moe_graphs *g);

/** @brief The counters so far. @param g cache (NULL: zeros) @return a copy */
moe_graph_stats moe_graphs_stats(const moe_graphs *g);

#endif /* MOE_GRAPH_H */
