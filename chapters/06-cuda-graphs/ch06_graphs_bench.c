/*
 * Chapter 06's measurement: what CUDA graphs change in a training step, for each
 * --cuda-graph-scope level that can be captured today, on the GPU preset and on a larger
 * model, in one run.
 *
 * For each (model, scope):
 *   ms/step, tokens/s  host wall clock around moe_trainer_step() and a final wait, median of
 *                      --steps steps after --warmup steps (the warm-up also captures the
 *                      graphs); the ratio is to scope none of the same model in this run;
 *   host submissions   kernels, memsets and copies the host launched one by one (CUPTI
 *                      activity records outside any graph) plus one per graph launch
 *                      (counted by lib/graph.c), per step;
 *   GPU kernels        every kernel the GPU ran per step, and how many of them inside graphs;
 *   GPU busy / idle    busy = the union of the kernels', memsets' and copies' intervals on the
 *                      GPU's clock (CUPTI) per step; idle = ms/step (untraced) - busy.
 * Counting runs after timing, in separate steps: CUPTI's tracing costs host time itself.
 *
 *   bin/ch06_graphs_bench [--steps 20] [--warmup 3] [--trace-steps 5] [--only preset|large]
 *                          [--top N]   (N>0: after each eager row, the N kernels with the most
 *                                       GPU time per step, from the same CUPTI records)
 *                          [--scopes all|LIST]  (a comma-separated list of scopes to run,
 *                                       for example none: the eager step alone)
 *                          [--flags "FLAGS"]  (more moe-train flags for every model, after
 *                                       the model's own, so a repeated flag takes this value:
 *                                       for example an FP8 recipe, to see which kernels it
 *                                       adds to the step and what they cost)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "config.h"
#include "cuda_ops.h"
#include "timer.h"
#include "trainer.h"

/* the two models: the GPU preset (config.c) and a larger one on the same data and shape */
static const char *const g_large =
    "--hidden-size 1024 --num-attention-heads 16 --num-query-groups 4 --ffn-hidden-size 4096 "
    "--num-experts 16 --moe-ffn-hidden-size 1024 --moe-router-topk 4";

static const moe_graph_scope g_scopes[] = {MOE_GRAPH_NONE, MOE_GRAPH_ATTN, MOE_GRAPH_MOE_ROUTER,
                                           MOE_GRAPH_MOE_PREPROCESS, MOE_GRAPH_LAYER,
                                           MOE_GRAPH_FULL_ITERATION};

typedef struct result {
    double ms, tok_s, submissions, kernels, graph_kernels, busy_ms;
    long long captures;
} result;

/* --flags: more moe-train flags for every model */
static const char *g_flags = "";

static moe_trainer *make(const char *model, moe_graph_scope scope) {
    char flags[4096];
    if (snprintf(flags, sizeof flags, "%s %s --device cuda --cuda-graph-scope %s %s",
                 moe_config_preset_flags("gpu"), model, moe_graph_scope_name(scope),
                 g_flags) >= (int)sizeof flags) {
        fprintf(stderr, "ch06_graphs_bench: --flags is too long (at most about %zu characters)\n",
                sizeof flags / 2);
        exit(2);
    }
    moe_config c;
    moe_error err;
    moe_config_defaults(&c);
    moe_trainer *t = NULL;
    if (moe_config_parse_string(&c, flags, &err) != MOE_OK ||
        moe_trainer_create(&t, &c, &err) != MOE_OK) {
        fprintf(stderr, "ch06_graphs_bench: %s\n  flags: %s\n", err.msg, flags);
        exit(1);
    }
    return t;
}

static void step(moe_trainer *t) {
    moe_step_stats st;
    moe_error err;
    if (moe_trainer_step(t, &st, &err) != MOE_OK) {
        fprintf(stderr, "ch06_graphs_bench: %s\n", err.msg);
        exit(1);
    }
}

/* --top N: after each model's eager row, the N kernels that took the most GPU time */
static int g_top = 0;

static result measure(const char *model, moe_graph_scope scope, int warmup, int steps,
                      int trace_steps) {
    moe_trainer *t = make(model, scope);
    const moe_backend *be = t->model->be;
    for (int i = 0; i < warmup; i++)
        step(t);
    be->synchronize();
    double *ms = malloc(sizeof(double) * (size_t)steps);
    for (int i = 0; i < steps; i++) {
        moe_timer tm;
        moe_timer_start(&tm);
        step(t);
        be->synchronize();
        ms[i] = 1e3 * moe_timer_elapsed(&tm);
    }
    result r = {0};
    r.ms = moe_median(ms, steps);
    free(ms);
    const moe_config *c = &t->cfg;
    r.tok_s = (double)c->global_batch_size * c->seq_length / (r.ms / 1e3);
    /* counting: CUPTI records of trace_steps more steps */
    char why[256];
    const moe_graph_stats g0 = moe_graphs_stats(t->model->graphs);
    if (!moe_cuda_trace_begin(why, sizeof why)) {
        fprintf(stderr, "ch06_graphs_bench: cannot trace: %s\n", why);
        exit(1);
    }
    for (int i = 0; i < trace_steps; i++)
        step(t);
    moe_cuda_trace tr;
    moe_cuda_trace_end(&tr);
    if (g_top > 0 && scope == MOE_GRAPH_NONE) {
        printf("\nwhere the GPU time goes (scope none, %d traced steps):\n\n", trace_steps);
        moe_cuda_trace_print_top(stdout, g_top, trace_steps);
        printf("\n");
    }
    const moe_graph_stats g1 = moe_graphs_stats(t->model->graphs);
    const double n = trace_steps;
    r.submissions = ((double)(tr.kernels - tr.graph_kernels) + (double)(tr.copies - tr.graph_copies) +
                     (double)(g1.replays - g0.replays)) / n;
    r.kernels = tr.kernels / n;
    r.graph_kernels = tr.graph_kernels / n;
    r.busy_ms = tr.busy_ms / n;
    r.captures = g1.captures;
    moe_trainer_free(t);
    return r;
}

/* whether scope @p s is in the comma-separated @p list ("all": every scope) */
static int scope_listed(const char *list, moe_graph_scope s) {
    if (!strcmp(list, "all"))
        return 1;
    const char *name = moe_graph_scope_name(s);
    const size_t n = strlen(name);
    for (const char *p = list; *p;) {
        const size_t len = strcspn(p, ",");
        if (len == n && !strncmp(p, name, n))
            return 1;
        p += len + (p[len] == ',');
    }
    return 0;
}

int main(int argc, char **argv) {
    int steps = 20, warmup = 3, trace_steps = 5;
    const char *only = "", *scopes = "all";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--steps") && i + 1 < argc)
            steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--warmup") && i + 1 < argc)
            warmup = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--trace-steps") && i + 1 < argc)
            trace_steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--only") && i + 1 < argc)
            only = argv[++i];
        else if (!strcmp(argv[i], "--top") && i + 1 < argc)
            g_top = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--scopes") && i + 1 < argc)
            scopes = argv[++i];
        else if (!strcmp(argv[i], "--flags") && i + 1 < argc)
            g_flags = argv[++i];
        else {
            fprintf(stderr, "usage: %s [--steps N] [--warmup N] [--trace-steps N] "
                    "[--only preset|large] [--top N] [--scopes all|LIST] [--flags \"FLAGS\"]\n",
                    argv[0]);
            return 2;
        }
    }
    /* every listed scope must be one of g_scopes (a typo would silently run nothing) */
    int listed = 0;
    for (size_t s = 0; s < sizeof g_scopes / sizeof g_scopes[0]; s++)
        listed += scope_listed(scopes, g_scopes[s]);
    int names = 1;
    for (const char *p = scopes; *p; p++)
        names += *p == ',';
    if (strcmp(scopes, "all") && listed != names) {
        fprintf(stderr, "ch06_graphs_bench: --scopes '%s': each must be one of", scopes);
        for (size_t s = 0; s < sizeof g_scopes / sizeof g_scopes[0]; s++)
            fprintf(stderr, " %s", moe_graph_scope_name(g_scopes[s]));
        fprintf(stderr, " (comma-separated), or all\n");
        return 2;
    }
    if (*only && strcmp(only, "preset") && strcmp(only, "large")) {
        fprintf(stderr, "ch06_graphs_bench: --only '%s': preset or large\n", only);
        return 2;
    }
    if (steps < 1 || warmup < 2 || trace_steps < 1) {
        fprintf(stderr, "ch06_graphs_bench: --steps and --trace-steps must be >= 1, --warmup >= 2 "
                "(a region is warmed up on its first call and captured on its second)\n");
        return 2;
    }
    if (!moe_cuda_available()) {
        printf("ch06_graphs_bench: skipped: no GPU (CUDA graphs replay GPU work)\n");
        return 0;
    }
    char dev[256];
    moe_backend_cuda()->device_name(dev, sizeof dev);
    moe_bench_header("chapter 06: CUDA graphs, one training step per --cuda-graph-scope", dev);
    printf("median of %d steps after %d warm-up steps; counts from CUPTI over %d more steps\n\n",
           steps, warmup, trace_steps);
    /* the ratio column is to the first scope run (none, unless --scopes leaves it out) */
    const char *first = "none";
    for (size_t s = 0; s < sizeof g_scopes / sizeof g_scopes[0]; s++)
        if (scope_listed(scopes, g_scopes[s])) {
            first = moe_graph_scope_name(g_scopes[s]);
            break;
        }
    printf("| model | scope | ms/step | tokens/s | vs %s | host submissions/step | GPU kernels/step "
           "(in graphs) | GPU busy ms/step | GPU idle ms/step | graphs |\n"
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n", first);
    const struct { const char *name, *flags; } models[] = {{"preset", ""}, {"large", g_large}};
    for (int m = 0; m < 2; m++) {
        if (*only && strcmp(only, models[m].name))
            continue;
        double base = 0;
        for (size_t s = 0; s < sizeof g_scopes / sizeof g_scopes[0]; s++) {
            if (!scope_listed(scopes, g_scopes[s]))
                continue;
            result r = measure(models[m].flags, g_scopes[s], warmup, steps, trace_steps);
            if (base == 0)
                base = r.tok_s;
            const double idle = r.ms - r.busy_ms;
            printf("| %s | %s | %.2f | %.0f | %.2fx | %.0f | %.0f (%.0f) | %.2f | %.2f (%.0f%%) | %lld |\n",
                   models[m].name, moe_graph_scope_name(g_scopes[s]), r.ms, r.tok_s,
                   r.tok_s / base, r.submissions, r.kernels, r.graph_kernels, r.busy_ms,
                   idle > 0 ? idle : 0.0, idle > 0 ? 100.0 * idle / r.ms : 0.0, r.captures);
            fflush(stdout);
        }
    }
    printf("\nmodels: preset = --preset gpu; large = --preset gpu %s%s%s\n", g_large,
           *g_flags ? "; both with " : "", g_flags);
    return 0;
}
