/*
 * CUDA graphs on the GPU (chapter 06):
 *  - the arena: from the second training step on, a step calls cudaMalloc and cudaFree
 *    zero times (kernels/memory.cu counts every call) and the device's free memory does
 *    not change (which would also show an allocation the counters cannot see, e.g. a
 *    library's own), with and without graphs;
 *  - every --cuda-graph-scope (attn … full_iteration): the losses of 6 steps
 *    and the parameters after them are those of the eager run bit for bit (the same kernels
 *    on the same buffers in the same order, only launched by a replay), on a small model and
 *    on the GPU preset's shape, and the graphs were really used (captures and replays
 *    counted), also when a small MoE budget overflows and the step is re-run;
 *  - a capture that meets a host read (to_host) fails with a named error, and the scopes
 *    that still wait for the host are refused when the trainer is created.
 * Without a GPU the runner prints "skipped: no GPU" (tests/gpu_main.c).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_ops.h"
#include "helpers.h"
#include "lowp.h"
#include "suites.h"
#include "trainer.h"

#define SMALL "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 " \
              "--seq-length 64 --micro-batch-size 8 --global-batch-size 16 --num-experts 8 "  \
              "--moe-ffn-hidden-size 64 --ffn-hidden-size 128 --lr 2e-3 --lr-warmup-iters 2 " \
              "--moe-shared-expert-intermediate-size 32 --qk-layernorm --moe-layer-freq 0,1 "

static moe_status make(moe_trainer **t, const char *flags, moe_error *err) {
    char buf[2100];
    snprintf(buf, sizeof buf, "%.2000s --device cuda", flags);
    moe_config c;
    setenv("MOE_NO_DOWNLOAD", "1", 1);
    moe_status s = moe_test_config(&c, buf, err);
    if (s != MOE_OK)
        return s;
    return moe_trainer_create(t, &c, err);
}

static moe_trainer *must_make(const char *flags) {
    moe_trainer *t = NULL;
    moe_error err;
    ck_assert_msg(make(&t, flags, &err) == MOE_OK, "%s", err.msg);
    return t;
}

static void step(moe_trainer *t, double *loss) {
    moe_step_stats st;
    moe_error err;
    ck_assert_msg(moe_trainer_step(t, &st, &err) == MOE_OK, "%s", err.msg);
    if (loss)
        *loss = st.loss;
}

/* Steps 2..6 allocate nothing. */
static void check_arena(const char *flags) {
    moe_trainer *t = must_make(flags);
    step(t, NULL);
    t->model->be->synchronize();
    long long m0, f0, m1, f1;
    moe_cuda_alloc_counts(&m0, &f0);
    const size_t free0 = moe_cuda_memory_bytes();
    for (int s = 2; s <= 6; s++)
        step(t, NULL);
    t->model->be->synchronize();
    moe_cuda_alloc_counts(&m1, &f1);
    const size_t free1 = moe_cuda_memory_bytes();
    printf("  arena (%s): steps 2-6: %lld cudaMalloc, %lld cudaFree, free memory %+lld bytes\n",
           flags + (strncmp(flags, SMALL, strlen(SMALL)) ? 0 : strlen(SMALL)), m1 - m0, f1 - f0,
           (long long)free1 - (long long)free0);
    ck_assert_msg(m1 == m0 && f1 == f0, "steps 2-6 called cudaMalloc %lld and cudaFree %lld times",
                  m1 - m0, f1 - f0);
    ck_assert_msg(free1 == free0, "free device memory changed by %lld bytes during steps 2-6",
                  (long long)free1 - (long long)free0);
    moe_trainer_free(t);
}

START_TEST(test_gpu_arena_no_allocation_after_step_one) {
    check_arena(SMALL);
    check_arena(SMALL "--cuda-graph-scope attn");
    check_arena(SMALL "--cuda-graph-scope layer");
    check_arena(SMALL "--cuda-graph-scope full_iteration");
}
END_TEST

/* 6 steps eager and 6 with the regions of @p scope graphed: identical losses and parameters. */
static void check_replay_equals_eager(const char *flags, const char *scope) {
    char graphed[2100];
    snprintf(graphed, sizeof graphed, "%.2000s --cuda-graph-scope %s", flags, scope);
    moe_trainer *te = must_make(flags), *tg = must_make(graphed);
    enum { STEPS = 6 };
    for (int s = 0; s < STEPS; s++) {
        double le, lg;
        step(te, &le);
        step(tg, &lg);
        ck_assert_msg(memcmp(&le, &lg, sizeof le) == 0, "step %d: loss eager %.17g, graphed %.17g",
                      s + 1, le, lg);
    }
    const size_t P = moe_model_num_params(te->model);
    moe_real *pe = malloc(sizeof(moe_real) * P), *pg = malloc(sizeof(moe_real) * P);
    ck_assert_ptr_nonnull(pe);
    ck_assert_ptr_nonnull(pg);
    te->model->be->to_host(pe, te->model->params, sizeof(moe_real) * P);
    tg->model->be->to_host(pg, tg->model->params, sizeof(moe_real) * P);
    size_t diff = 0;
    for (size_t i = 0; i < P; i++)
        diff += memcmp(&pe[i], &pg[i], sizeof(moe_real)) != 0;
    const moe_graph_stats st = moe_graphs_stats(tg->model->graphs);
    const int L = tg->cfg.num_layers;
    printf("  replay == eager (%s, scope %s): %d steps, %zu of %zu parameters differ; %lld "
           "captures, %lld replays (%lld nodes), %lld eager runs\n",
           flags, scope, STEPS, diff, P, st.captures, st.replays, st.nodes, st.eager);
    ck_assert_msg(diff == 0, "%zu parameters differ after %d steps", diff, STEPS);
    /* every key (region, layer, shape, variant): warmed up once, captured once, replayed
     * after; attn has exactly one forward and one backward key per layer */
    ck_assert_int_eq(te->reruns, tg->reruns); /* the same overflows, re-run the same way */
    if (!te->reruns) { /* (a re-run recaptures: the grown buffers moved) */
        ck_assert_int_eq(st.eager, st.captures);
        ck_assert(st.replays >= st.captures * (STEPS - 2));
    }
    ck_assert(st.captures >= 1 && st.replays >= STEPS - 2);
    if (!strcmp(scope, "attn"))
        ck_assert_int_eq(st.captures, 2 * L);
    if (!strcmp(scope, "full_iteration") && !te->reruns)
        ck_assert_int_eq(st.captures, 1); /* one graph: the whole step */
    ck_assert_int_eq(moe_graphs_stats(te->model->graphs).captures, 0);
    free(pe);
    free(pg);
    moe_trainer_free(te);
    moe_trainer_free(tg);
}

START_TEST(test_gpu_graph_attn_replay_equals_eager) {
    /* the small model has a dense and a MoE layer and two micro-batches per step (so the
     * layer backward has a storing and an adding variant) */
    const char *scopes[] = {"attn", "moe_router", "moe_preprocess", "layer", "full_iteration"};
    for (int i = 0; i < 5; i++)
        check_replay_equals_eager(SMALL, scopes[i]);
    /* a budget of 0.3·N·k rows overflows at the first step: the step is re-run with grown
     * buffers (which moves them, so the graphs are captured again), the same as eagerly */
    check_replay_equals_eager(SMALL "--moe-expert-rank-capacity-factor 0.3 ", "layer");
    check_replay_equals_eager(SMALL "--moe-expert-rank-capacity-factor 0.3 ", "full_iteration");
    /* the GPU preset's shape (B 32, T 256, hidden 384, 8 experts) with 2 of its 6 layers */
    char preset[1024];
    snprintf(preset, sizeof preset, "%s --num-layers 2", moe_config_preset_flags("gpu"));
    check_replay_equals_eager(preset, "attn");
    check_replay_equals_eager(preset, "layer");
    check_replay_equals_eager(preset, "full_iteration");
}
END_TEST

/* chapter 05's NVFP4 under graphs: a dense model (the per-tensor recipe is refused with the
 * sync-free MoE layer that the larger scopes need), widths multiples of 16 */
#define DENSE_FP4 "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 " \
                  "--seq-length 64 --micro-batch-size 8 --global-batch-size 16 --num-experts 0 " \
                  "--ffn-hidden-size 128 --lr 2e-3 --lr-warmup-iters 2 --qk-layernorm "        \
                  "--fp4-format e2m1 --fp4-recipe nvfp4 "

/* The stochastic rounding's draw counter lives in device memory and the quantize kernels
 * advance and read it (quantize.h, moe_nvfp4_opts::sr_counter), so a replayed step rounds
 * its gradients with new seeds: replay == eager bit for bit over 6 steps (eager draws a new
 * seed per gradient, so a replay that reused the captured seeds would part from it at step
 * 2), and the counter moves between two replays by the eager run's draws per step. */
START_TEST(test_gpu_graph_nvfp4_replay_equals_eager) {
    check_replay_equals_eager(DENSE_FP4, "attn");
    check_replay_equals_eager(DENSE_FP4, "full_iteration");
    moe_trainer *te = must_make(DENSE_FP4),
                *tg = must_make(DENSE_FP4 "--cuda-graph-scope full_iteration");
    uint64_t prev = 0;
    for (int s = 1; s <= 4; s++) {
        step(te, NULL);
        step(tg, NULL);
        const uint64_t ce = moe_lowp_sr_calls(te->model->be, te->model->lowp),
                       cg = moe_lowp_sr_calls(tg->model->be, tg->model->lowp);
        printf("  NVFP4 draw counter after step %d: eager %llu, graphed %llu\n", s,
               (unsigned long long)ce, (unsigned long long)cg);
        ck_assert_msg(cg == ce, "step %d: the graphed run made %llu draws, eager %llu", s,
                      (unsigned long long)cg, (unsigned long long)ce);
        ck_assert_msg(cg > prev, "step %d: the draw counter did not move (%llu): the replay "
                      "rounded with the seeds of the step before", s, (unsigned long long)cg);
        prev = cg;
    }
    ck_assert(moe_graphs_stats(tg->model->graphs).replays >= 2); /* steps 3 and 4 replayed */
    moe_trainer_free(te);
    moe_trainer_free(tg);
}
END_TEST

/* A region that reads the device on the host cannot be captured: the capture ends, and the
 * error names the op and the region. */
static const moe_backend *g_be;
static void reads_host(void *ctx) {
    int v = 0;
    g_be->to_host(&v, ctx, sizeof v);
}

START_TEST(test_gpu_graph_uncapturable_is_named) {
    const moe_backend *be = moe_backend_cuda();
    g_be = be;
    int *d = be->alloc(sizeof(int));
    moe_graphs *g = moe_graphs_create(be, MOE_GRAPH_ATTN);
    moe_graph_key k = {MOE_GRAPH_SITE_ATTN_FWD, 0, 1, 1, 0, 0.0};
    moe_graph_run(g, k, reads_host, d); /* warm-up: eager, fine */
    moe_error err;
    ck_assert_int_eq(moe_graphs_status(g, &err), MOE_OK);
    moe_graph_run(g, k, reads_host, d); /* capture: to_host is refused */
    ck_assert_int_eq(moe_graphs_status(g, &err), MOE_ERR_CONFIG);
    printf("  uncapturable: %s\n", err.msg);
    ck_assert_msg(strstr(err.msg, "cuda graph scope 'attn'") && strstr(err.msg, "to_host"), "%s",
                  err.msg);
    /* the stream is not left capturing: ordinary work goes on */
    int one = 1, back = 0;
    be->from_host(d, &one, sizeof one);
    be->to_host(&back, d, sizeof back);
    ck_assert_int_eq(back, 1);
    moe_graphs_free(g);
    be->free(d);

    /* a scope whose region still waits for the host is refused when the trainer is
     * created, by name: cuBLAS's grouped GEMM sizes its GEMMs from host offsets */
    moe_trainer *t = NULL;
    ck_assert_int_eq(make(&t, SMALL "--moe-expert-backend cublas-grouped --cuda-graph-scope "
                          "layer", &err), MOE_ERR_CONFIG);
    ck_assert_msg(strstr(err.msg, "'layer'") && strstr(err.msg, "host offsets"), "%s", err.msg);
    ck_assert_ptr_null(t);
    ck_assert_int_eq(make(&t, SMALL "--moe-expert-capacity-factor 1.0 --cuda-graph-scope "
                          "full_iteration", &err), MOE_ERR_CONFIG);
    ck_assert_msg(strstr(err.msg, "full_iteration") && strstr(err.msg, "capacity"), "%s",
                  err.msg);
    ck_assert_ptr_null(t);
}
END_TEST

Suite *suite_gpu_graphs(void) {
    Suite *s = suite_create("gpu-graphs");
    TCase *tc = tcase_create("graphs");
    tcase_set_tags(tc, "ch06");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_gpu_arena_no_allocation_after_step_one);
    tcase_add_test(tc, test_gpu_graph_attn_replay_equals_eager);
    tcase_add_test(tc, test_gpu_graph_uncapturable_is_named);
    tcase_add_test(tc, test_gpu_graph_nvfp4_replay_equals_eager);
    suite_add_tcase(s, tc);
    return s;
}
