/*
 * moe-bench: the foundation's CPU benchmark (`make bench`).
 *
 * 1. Matmul: the textbook triple loop (the baseline) against lib/cpu/matmul.c's
 *    register-tiled kernel, on the Linear-layer shapes of the default model,
 *    forward and backward, measured in the same run.
 * 2. One training step of the default model: milliseconds, tokens/s, and the
 *    share of forward vs backward.
 *
 * Each timing is the median of repeats after a warm-up. Inputs are random
 * normals (never zeros), and the tiled result is checked against the baseline
 * before it is timed. Later chapters add their own benchmarks; this one says
 * how fast the CPU reference is.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


#include "bench.h"
#include "config.h"
#include "cpu/ops.h"
#include "log.h"
#include "rng.h"
#include "timer.h"
#include "trainer.h"

/* The baseline everyone writes first: out[n,o] = Σ_i in[n,i]·w[o,i]. */
static void naive_matmul(float *out, const float *in, const float *w, int N, int I, int O) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        for (int o = 0; o < O; o++) {
            float s = 0.0f;
            for (int i = 0; i < I; i++)
                s += in[(size_t)n * I + i] * w[(size_t)o * I + i];
            out[(size_t)n * O + o] = s;
        }
}

#define REPEATS 7

static void bench_matmul(int N, int I, int O) {
    float *in = malloc(sizeof(float) * (size_t)N * I), *w = malloc(sizeof(float) * (size_t)O * I);
    float *a = malloc(sizeof(float) * (size_t)N * O), *b = malloc(sizeof(float) * (size_t)N * O);
    for (size_t i = 0; i < (size_t)N * I; i++)
        in[i] = (float)moe_rng_normal(1, 1, i);
    for (size_t i = 0; i < (size_t)O * I; i++)
        w[i] = (float)moe_rng_normal(1, 2, i);
    naive_matmul(a, in, w, N, I, O);
    moe_cpu_matmul_forward(b, in, w, N, I, O);
    double worst = 0.0;
    for (size_t i = 0; i < (size_t)N * O; i++)
        worst = fmax(worst, fabs((double)a[i] - b[i]) / fmax(fabs((double)a[i]), 1.0));
    if (worst > 1e-4) {
        moe_log_error("tiled matmul disagrees with the triple loop (rel err %.2e)", worst);
        exit(1);
    }
    double tn[REPEATS], tt[REPEATS];
    for (int r = 0; r < REPEATS; r++) {
        double t0 = moe_time_now();
        naive_matmul(a, in, w, N, I, O);
        tn[r] = moe_time_now() - t0;
        t0 = moe_time_now();
        moe_cpu_matmul_forward(b, in, w, N, I, O);
        tt[r] = moe_time_now() - t0;
    }
    double flop = 2.0 * N * I * O, mn = moe_median(tn, REPEATS), mt = moe_median(tt, REPEATS);
    printf("| matmul %5d x %4d -> %4d | %9.2f ms | %7.1f GFLOP/s | %9.2f ms | %7.1f GFLOP/s | %6.1fx |\n",
           N, I, O, 1e3 * mn, flop / mn / 1e9, 1e3 * mt, flop / mt / 1e9, mn / mt);
    free(in); free(w); free(a); free(b);
}

int main(int argc, char **argv) {
    moe_config cfg;
    moe_error err;
    moe_config_defaults(&cfg);
    moe_status s = moe_config_parse(&cfg, argc, argv, &err);
    if (s == MOE_ERR_HELP) {
        printf("usage: moe-bench [model flags of moe-train]\nBenchmarks the CPU matmul and one "
               "training step of the given model (default: the make-train model).\n");
        return 0;
    }
    if (s != MOE_OK) {
        moe_log_error("%s", err.msg);
        return 2;
    }
    char cpu[256];
    moe_backend_cpu()->device_name(cpu, sizeof cpu);
    moe_bench_header("moe-bench", cpu);
    printf("\n");

    const int N = cfg.micro_batch_size * cfg.seq_length, H = cfg.hidden_size;
    printf("| matmul (forward, fp32)      | triple loop  |                 | tiled 8x32   |          "
           "       | speedup |\n|---|---|---|---|---|---|\n");
    bench_matmul(N, H, H);
    bench_matmul(N, H, 2 * cfg.moe_ffn_hidden_size);
    bench_matmul(N, cfg.moe_ffn_hidden_size, H);

    /* one training step of the model, median of repeats after warm-up */
    moe_trainer *t = NULL;
    cfg.train_iters = 100;
    if ((s = moe_trainer_create(&t, &cfg, &err)) != MOE_OK) {
        moe_log_error("%s", err.msg);
        return s == MOE_ERR_CONFIG || s == MOE_ERR_FLAG ? 2 : 1;
    }
    moe_step_stats st;
    for (int w = 0; w < 3; w++)
        moe_trainer_step(t, &st, NULL);
    double ts[REPEATS], tf[REPEATS];
    for (int r = 0; r < REPEATS; r++) {
        moe_trainer_step(t, &st, NULL);
        ts[r] = st.seconds;
        double t0 = moe_time_now();
        moe_model_forward(t->model, t->inputs, t->targets, cfg.micro_batch_size, cfg.seq_length);
        tf[r] = moe_time_now() - t0;
    }
    double step = moe_median(ts, REPEATS), fwd = moe_median(tf, REPEATS);
    int accum = cfg.global_batch_size / cfg.micro_batch_size;
    printf("\n| training step (default model) | ms/step | tokens/s | forward share |\n"
           "|---|---|---|---|\n| %.3fM params, %.3fM active, %d tokens | %.1f | %.0f | %.0f%% |\n",
           moe_model_num_params(t->model) / 1e6, moe_model_num_active_params(t->model) / 1e6,
           (int)st.tokens, 1e3 * step, st.tokens / step, 100.0 * fwd * accum / step);
    moe_trainer_free(t);
    return 0;
}
