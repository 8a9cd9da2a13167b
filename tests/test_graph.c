/* CUDA graphs, the parts a CPU can check (chapter 06): --cuda-graph-scope's values and named
 * errors, and the capture helper's bookkeeping (warm-up, capture once per key, replay,
 * recapture after a buffer moved, a capture error that is sticky and named) against a mock
 * backend whose graph slots count what they are asked to do. The GPU side — the arena, and
 * replay equal to eager bit for bit — is tests/gpu_graphs.c. */
#include <string.h>

#include "backend.h"
#include "config.h"
#include "graph.h"
#include "helpers.h"
#include "suites.h"

/* ---- a mock graph backend: the CPU table with graph slots that record */
static int g_begins, g_launches, g_stale_next, g_fail_next;
static int g_token = 42; /* what mock_end hands out as "the graph" */

static void mock_begin(void) { g_begins++; }
static void *mock_end(char *why, size_t cap) {
    if (g_fail_next) {
        g_fail_next = 0;
        snprintf(why, cap, "to_host (a device-to-host copy the host waits for)");
        return NULL;
    }
    return &g_token;
}
static int mock_launch(void *g) {
    ck_assert_ptr_eq(g, &g_token);
    if (g_stale_next) {
        g_stale_next = 0;
        return 0;
    }
    g_launches++;
    return 1;
}
static void mock_free(void *g) { (void)g; }
static size_t mock_nodes(const void *g) { (void)g; return 7; }

static moe_backend mock_backend(void) {
    moe_backend b = *moe_backend_cpu();
    b.name = "mock";
    b.graph_begin = mock_begin;
    b.graph_end = mock_end;
    b.graph_launch = mock_launch;
    b.graph_free = mock_free;
    b.graph_nodes = mock_nodes;
    g_begins = g_launches = g_stale_next = g_fail_next = 0;
    return b;
}

static int g_runs; /* calls of the region itself */
static void region(void *ctx) { (void)ctx; g_runs++; }

/* validated config from a flag string */
static moe_status config(moe_config *c, const char *flags, moe_error *err) {
    moe_status s = moe_test_config(c, flags, err);
    if (s != MOE_OK)
        return s;
    c->vocab_size = 65;
    return moe_config_validate(c, err);
}

START_TEST(test_graph_scope_flag) {
    moe_config c;
    moe_error err;
    ck_assert_int_eq(config(&c, "", &err), MOE_OK);
    ck_assert_int_eq(c.graph_scope, MOE_GRAPH_NONE);
    const char *names[] = {"none", "attn", "moe_router", "moe_preprocess", "layer",
                           "full_iteration"};
    for (int i = 0; i < 6; i++) { /* every name parses (a dense model: see below) */
        char f[96];
        snprintf(f, sizeof f, "--num-experts 0 --cuda-graph-scope %s", names[i]);
        ck_assert_int_eq(moe_test_config(&c, f, &err), MOE_OK);
        c.vocab_size = 65;
        (void)moe_config_validate(&c, &err);
        ck_assert_int_eq((int)c.graph_scope, i);
        ck_assert_str_eq(moe_graph_scope_name(c.graph_scope), names[i]);
    }
    ck_assert_int_ne(config(&c, "--cuda-graph-scope full", &err), MOE_OK);
    ck_assert_msg(strstr(err.msg, "cuda-graph-scope"), "%s", err.msg);
}
END_TEST

START_TEST(test_graph_scope_check_named_errors) {
    moe_config c;
    moe_error err;
    /* the CPU has no graphs: attn is accepted and runs eagerly */
    ck_assert_int_eq(config(&c, "--cuda-graph-scope attn", &err), MOE_OK);
    ck_assert_int_eq(moe_graph_scope_check(&c, moe_backend_cpu(), &err), MOE_OK);
    moe_graphs *cpu = moe_graphs_create(moe_backend_cpu(), c.graph_scope);
    ck_assert_int_eq(moe_graphs_scope(cpu), MOE_GRAPH_NONE);
    moe_graphs_free(cpu);
    moe_backend mb = mock_backend();
    ck_assert_int_eq(moe_graph_scope_check(&c, &mb, &err), MOE_OK); /* attn: capturable */
    /* beyond attn: the default MoE layer (one rank, dropless) is sync-free, so every level
     * is capturable */
    const char *ok_scopes[] = {"moe_router", "moe_preprocess", "layer", "full_iteration"};
    for (int i = 0; i < 4; i++) {
        char f[160];
        snprintf(f, sizeof f, "--hidden-size 64 --moe-ffn-hidden-size 64 --moe-expert-backend "
                 "grouped --cuda-graph-scope %s", ok_scopes[i]);
        ck_assert_msg(config(&c, f, &err) == MOE_OK, "%s: %s", f, err.msg);
        ck_assert_msg(moe_graph_scope_check(&c, &mb, &err) == MOE_OK, "%s: %s", f, err.msg);
    }
    /* under EP, the fused dispatcher with our grouped kernel plans on the device (chapter
     * 06): every level is capturable; the collective and allgather paths are refused below */
    for (int i = 0; i < 4; i++) {
        char f[256];
        snprintf(f, sizeof f, "--hidden-size 64 --moe-ffn-hidden-size 64 --moe-expert-backend "
                 "grouped --expert-model-parallel-size 2 --moe-alltoall-path fused "
                 "--cuda-graph-scope %s", ok_scopes[i]);
        ck_assert_msg(config(&c, f, &err) == MOE_OK, "%s: %s", f, err.msg);
        ck_assert_msg(moe_graph_scope_check(&c, &mb, &err) == MOE_OK, "%s: %s", f, err.msg);
    }
    /* each refusal names the level and the work that waits for the host */
    struct { const char *flags, *must, *must_not; } cases[] = {
        {"--cuda-graph-scope full_iteration --expert-model-parallel-size 2", "all-to-all-v",
         NULL},
        {"--cuda-graph-scope layer --expert-model-parallel-size 2 --moe-alltoall-path "
         "collective", "splits on the host", NULL},
        {"--cuda-graph-scope layer --expert-model-parallel-size 2 --moe-token-dispatcher-type "
         "allgather", "allgather", NULL},
        {"--cuda-graph-scope layer --expert-model-parallel-size 2 --moe-alltoall-path fused "
         "--moe-expert-capacity-factor 1.0", "capacity", NULL},
        {"--cuda-graph-scope moe_preprocess --moe-expert-capacity-factor 1.0", "capacity", NULL},
        {"--cuda-graph-scope layer --moe-expert-backend loop", "host offsets", NULL},
        {"--cuda-graph-scope layer --moe-expert-backend cublas-grouped", "host offsets", NULL},
        {"--cuda-graph-scope moe_router --tensor-model-parallel-size 2 --sequence-parallel"
        , "tensor parallelism", "not sync-free"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *scope = strstr(cases[i].flags, "scope ") + 6;
        char want[64];
        snprintf(want, sizeof want, "cuda graph scope '%.*s'", (int)strcspn(scope, " "), scope);
        /* refused when the configuration is validated, whatever the device */
        ck_assert_msg(config(&c, cases[i].flags, &err) == MOE_ERR_CONFIG, "%s: accepted",
                      cases[i].flags);
        ck_assert_msg(strstr(err.msg, want) && strstr(err.msg, cases[i].must), "%s", err.msg);
        ck_assert_msg(!cases[i].must_not || !strstr(err.msg, cases[i].must_not), "%s", err.msg);
    }
    /* the backend decides "auto": the CPU-like mock runs the loop, which is not sync-free */
    ck_assert_int_eq(config(&c, "--cuda-graph-scope layer", &err), MOE_OK);
    ck_assert_int_eq(moe_graph_scope_check(&c, &mb, &err), MOE_ERR_CONFIG);
    ck_assert_msg(strstr(err.msg, "loop"), "%s", err.msg);
    /* moe_router on a path that is not sync-free is fine: the router is device work */
    ck_assert_int_eq(config(&c, "--cuda-graph-scope moe_router --moe-expert-capacity-factor 1.0",
                            &err), MOE_OK);
    /* a dense model has no router: moe_router captures what attn does */
    ck_assert_int_eq(config(&c, "--num-experts 0 --cuda-graph-scope moe_router", &err), MOE_OK);
    ck_assert_int_eq(moe_graph_scope_check(&c, &mb, &err), MOE_OK);
}
END_TEST

START_TEST(test_graph_capture_once_per_key) {
    moe_backend mb = mock_backend();
    moe_graphs *g = moe_graphs_create(&mb, MOE_GRAPH_ATTN);
    ck_assert_ptr_nonnull(g);
    g_runs = 0;
    moe_graph_key k0 = {MOE_GRAPH_SITE_ATTN_FWD, 0, 8, 64, 0, 0.0},
                  k1 = {MOE_GRAPH_SITE_ATTN_FWD, 1, 8, 64, 0, 0.0},
                  k0b = {MOE_GRAPH_SITE_ATTN_BWD, 0, 8, 64, 0, 0.0},
                  k0s = {MOE_GRAPH_SITE_ATTN_FWD, 0, 4, 64, 0, 0.0};
    moe_graph_run(g, k0, region, NULL); /* warm-up: eager */
    ck_assert_int_eq(g_runs, 1);
    ck_assert_int_eq(g_begins, 0);
    moe_graph_run(g, k0, region, NULL); /* capture (the region enqueues once), then launch */
    ck_assert_int_eq(g_runs, 2);
    ck_assert_int_eq(g_begins, 1);
    ck_assert_int_eq(g_launches, 1);
    for (int i = 0; i < 5; i++) /* replays: the host never calls the region again */
        moe_graph_run(g, k0, region, NULL);
    ck_assert_int_eq(g_runs, 2);
    ck_assert_int_eq(g_launches, 6);
    /* another layer, direction or shape is another graph */
    moe_graph_run(g, k1, region, NULL);
    moe_graph_run(g, k0b, region, NULL);
    moe_graph_run(g, k0s, region, NULL);
    ck_assert_int_eq(g_runs, 5);
    ck_assert_int_eq(g_begins, 1);
    moe_graph_stats st = moe_graphs_stats(g);
    ck_assert_int_eq(st.eager, 4);
    ck_assert_int_eq(st.captures, 1);
    ck_assert_int_eq(st.replays, 6);
    ck_assert_int_eq(st.nodes, 6 * 7);
    /* a host choice (store vs add) or a baked scalar (the loss scale) is another graph too */
    moe_graph_key kv = {MOE_GRAPH_SITE_LAYER_BWD, 0, 8, 64, 1, 0.5}, kv0 = kv, kv2 = kv;
    kv0.variant = 0;
    kv2.scale = 0.25;
    for (int i = 0; i < 2; i++) {
        moe_graph_run(g, kv, region, NULL);
        moe_graph_run(g, kv0, region, NULL);
        moe_graph_run(g, kv2, region, NULL);
    }
    ck_assert_int_eq(g_runs, 11); /* each warmed up, then captured */
    ck_assert_int_eq(g_begins, 4);
    moe_graph_run(g, kv, region, NULL); /* and each replays on its own */
    moe_graph_run(g, kv0, region, NULL);
    moe_graph_run(g, kv2, region, NULL);
    ck_assert_int_eq(g_runs, 11);
    g_runs = 5;
    g_begins = 1;
    /* a buffer moved (the launch says stale): warm up again, then capture again */
    g_stale_next = 1;
    moe_graph_run(g, k0, region, NULL);
    ck_assert_int_eq(g_runs, 6);
    moe_graph_run(g, k0, region, NULL);
    ck_assert_int_eq(g_begins, 2);
    ck_assert_int_eq(g_runs, 7);
    /* reset (the MoE budget grew, its buffers moved): each key warms up and captures again */
    moe_graphs_reset(g);
    moe_graph_run(g, k0, region, NULL); /* eager */
    ck_assert_int_eq(g_runs, 8);
    ck_assert_int_eq(g_begins, 2);
    moe_graph_run(g, k0, region, NULL); /* captured again */
    ck_assert_int_eq(g_runs, 9);
    ck_assert_int_eq(g_begins, 3);
    moe_error err;
    ck_assert_int_eq(moe_graphs_status(g, &err), MOE_OK);
    moe_graphs_free(g);

    /* scope none (and no cache): the region runs every time, nothing is captured */
    g = moe_graphs_create(&mb, MOE_GRAPH_NONE);
    g_runs = 0;
    for (int i = 0; i < 3; i++) {
        moe_graph_run(g, k0, region, NULL);
        moe_graph_run(NULL, k0, region, NULL);
    }
    ck_assert_int_eq(g_runs, 6);
    ck_assert_int_eq(g_begins, 3); /* no capture began */
    moe_graphs_free(g);
}
END_TEST

START_TEST(test_graph_capture_error_is_named_and_sticky) {
    moe_backend mb = mock_backend();
    moe_graphs *g = moe_graphs_create(&mb, MOE_GRAPH_ATTN);
    moe_graph_key k = {MOE_GRAPH_SITE_ATTN_BWD, 3, 8, 64, 0, 0.0};
    g_runs = 0;
    moe_graph_run(g, k, region, NULL);
    g_fail_next = 1; /* the backend found something it could not capture */
    moe_graph_run(g, k, region, NULL);
    moe_error err;
    ck_assert_int_eq(moe_graphs_status(g, &err), MOE_ERR_CONFIG);
    ck_assert_msg(strstr(err.msg, "cuda graph scope 'attn'") && strstr(err.msg, "to_host") &&
                      strstr(err.msg, "attention backward of layer 3"),
                  "%s", err.msg);
    /* after the error everything runs eagerly, and the error stays */
    moe_graph_run(g, k, region, NULL);
    ck_assert_int_eq(g_runs, 3);
    ck_assert_int_eq(g_begins, 1);
    ck_assert_int_eq(moe_graphs_status(g, &err), MOE_ERR_CONFIG);
    moe_graphs_free(g);
}
END_TEST

Suite *suite_graph(void) {
    const TTest *tests[] = {test_graph_scope_flag, test_graph_scope_check_named_errors,
                                         test_graph_capture_once_per_key,
                                         test_graph_capture_error_is_named_and_sticky};
    return moe_test_chapter_suite("graph", "ch06", tests, 4);
}
