/*
 * The trainer end to end on tinyshakespeare: determinism (bitwise, and for any
 * thread count), a short run whose loss falls, errors at the trainer boundary,
 * and the moe-train program's exit codes and messages.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "helpers.h"
#include "suites.h"
#include "lowp.h"
#include "model.h"
#include "trainer.h"

#define SMALL "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2 " \
              "--seq-length 32 --micro-batch-size 4 --global-batch-size 8 --num-experts 4 "   \
              "--moe-ffn-hidden-size 32 --ffn-hidden-size 64 --lr 3e-3 --lr-warmup-iters 2 "   \
              "--train-iters 40 "

static moe_status make_trainer(moe_trainer **t, const char *flags, moe_error *err) {
    setenv("MOE_NO_DOWNLOAD", "1", 1);
    moe_config c;
    moe_status s = moe_test_config(&c, flags, err);
    if (s != MOE_OK)
        return s;
    return moe_trainer_create(t, &c, err);
}

static void run_losses(const char *flags, int steps, double *losses) {
    moe_trainer *t = NULL;
    moe_error err;
    ck_assert_msg(make_trainer(&t, flags, &err) == MOE_OK, "%s", err.msg);
    for (int i = 0; i < steps; i++) {
        moe_step_stats st;
        moe_trainer_step(t, &st, NULL);
        losses[i] = st.loss;
    }
    moe_trainer_free(t);
}

START_TEST(test_determinism_same_seed) {
    const int steps = moe_test_quick() ? 5 : 20;
    double a[20], b[20], c[20];
    const char *flags = SMALL "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
                              "--moe-shared-expert-intermediate-size 16 --qk-layernorm";
    run_losses(flags, steps, a);
    run_losses(flags, steps, b);
    for (int i = 0; i < steps; i++)
        ck_assert_msg(memcmp(&a[i], &b[i], sizeof(double)) == 0,
                      "step %d: %.17g vs %.17g (same seed must give identical bits)", i, a[i], b[i]);
    /* every output element is owned by one thread, so the thread count cannot matter */
#ifdef _OPENMP
    int saved = omp_get_max_threads();
    omp_set_num_threads(saved > 1 ? 1 : 2);
    run_losses(flags, steps, c);
    omp_set_num_threads(saved);
    for (int i = 0; i < steps; i++)
        ck_assert_msg(memcmp(&a[i], &c[i], sizeof(double)) == 0,
                      "step %d: %.17g vs %.17g with a different thread count", i, a[i], c[i]);
#endif
    /* and a different seed gives different numbers */
    char other[1024];
    snprintf(other, sizeof other, "%s --seed 7", flags);
    run_losses(other, 1, c);
    ck_assert(c[0] != a[0]);
}
END_TEST

START_TEST(test_loss_falls) {
    const int steps = moe_test_quick() ? 15 : 40;
    double l[40];
    run_losses(SMALL, steps, l);
    /* char-level Shakespeare starts at ln(65) ≈ 4.17 */
    ck_assert_double_gt(l[0], 3.9);
    ck_assert_double_lt(l[0], 4.5);
    double tail = (l[steps - 1] + l[steps - 2] + l[steps - 3]) / 3;
    const double drop = moe_test_quick() ? 0.5 : 0.8;
    ck_assert_msg(tail < l[0] - drop, "loss went from %.3f to %.3f", l[0], tail);
}
END_TEST

/* Chapter 05: training in FP8 / NVFP4, emulated (lowp.h). A model whose every linear width is
 * a multiple of 128 (so every recipe takes it), a dense layer and a shared expert among the
 * MoE layers, 30 steps in fp32 and under each recipe. Each run must (1) differ from fp32 at
 * every step (the QDQ ran: a skipped one would give fp32's bits), (2) fall, and (3) end
 * within a stated margin of fp32: the mean loss of the last 10 steps within 3 % for FP8 and
 * 5 % for NVFP4 (the test prints what it measured; 300-step runs of the same model:
 * docs/results/runs/ch05_fp8_train_cpu_9dc4e10.txt). */
#define LOWP_MODEL                                                                            \
    "--num-layers 2 --hidden-size 128 --num-attention-heads 4 --num-query-groups 4 "          \
    "--seq-length 32 --micro-batch-size 4 --global-batch-size 8 --num-experts 4 "             \
    "--moe-ffn-hidden-size 128 --ffn-hidden-size 128 --moe-shared-expert-intermediate-size " \
    "128 --moe-layer-freq 2 --lr 3e-3 --lr-warmup-iters 2 --train-iters 30 "
#define LOWP_STEPS 30

static double tail_mean(const double *l) {
    double s = 0;
    for (int i = LOWP_STEPS - 10; i < LOWP_STEPS; i++)
        s += l[i];
    return s / 10;
}

START_TEST(test_lowp_training) {
    static const char *recipes[] = {"--fp8-format e4m3 --fp8-recipe tensorwise",
                                    "--fp8-format hybrid --fp8-recipe blockwise",
                                    "--fp8-format e4m3 --fp8-recipe mxfp8",
                                    "--fp4-format e2m1 --fp4-recipe nvfp4",
                                    "--fp8-format e4m3 --fp8-recipe delayed "
                                    "--fp8-amax-history-len 16 --fp8-amax-compute-algo max",
                                    /* NVFP4 without the wgrad's random Hadamard transform */
                                    "--fp4-format e2m1 --fp4-recipe nvfp4 --fp4-disable-rht"};
    static const double margin[] = {0.03, 0.03, 0.03, 0.05, 0.03, 0.05};
    double ref[LOWP_STEPS], l[LOWP_STEPS], nvfp4[2][LOWP_STEPS];
    run_losses(LOWP_MODEL, LOWP_STEPS, ref);
    const double ref_tail = tail_mean(ref);
    printf("  emulated low precision, 30 steps: fp32 first %.4f, mean of the last 10 %.4f\n",
           ref[0], ref_tail);
    for (int r = 0; r < (int)(sizeof recipes / sizeof recipes[0]); r++) {
        char flags[512];
        snprintf(flags, sizeof flags, LOWP_MODEL "%s", recipes[r]);
        run_losses(flags, LOWP_STEPS, l);
        for (int i = 0; i < LOWP_STEPS; i++)
            ck_assert_msg(memcmp(&l[i], &ref[i], sizeof(double)) != 0,
                          "%s: step %d has fp32's loss bits %.17g: was anything quantized?",
                          recipes[r], i, l[i]);
        const double tail = tail_mean(l), rel = fabs(tail - ref_tail) / ref_tail;
        printf("  %-45s first %.4f, last 10 %.4f (%+.2f %% of fp32)\n", recipes[r], l[0], tail,
               100 * (tail - ref_tail) / ref_tail);
        ck_assert_msg(tail < l[0] - 0.5, "%s: the loss did not fall (%.4f -> %.4f)", recipes[r],
                      l[0], tail);
        ck_assert_msg(rel < margin[r], "%s: last-10 mean %.4f is %.2f %% from fp32's %.4f "
                      "(margin %.0f %%)", recipes[r], tail, 100 * rel, ref_tail,
                      100 * margin[r]);
        if (r == 3 || r == 5)
            memcpy(nvfp4[r == 5], l, sizeof l);
    }
    /* the transform changes the weight gradients, not the forward: step 1's loss is the
     * same with and without it, every later one differs */
    ck_assert(memcmp(&nvfp4[0][0], &nvfp4[1][0], sizeof(double)) == 0);
    for (int i = 1; i < LOWP_STEPS; i++)
        ck_assert_msg(nvfp4[0][i] != nvfp4[1][i], "step %d: NVFP4 with and without the wgrad "
                      "RHT both %.17g: was the transform applied?", i + 1, nvfp4[0][i]);
    /* the experts' grouped paths (one QDQ over all experts' rows; the per-row tiles make it
     * the loop's values) train as the loop does */
    double loop[LOWP_STEPS];
    run_losses(LOWP_MODEL "--fp8-format hybrid --fp8-recipe blockwise", LOWP_STEPS, loop);
    static const char *paths[] = {"grouped", "cublas-grouped"};
    for (int p = 0; p < 2; p++) {
        char flags[512];
        snprintf(flags, sizeof flags,
                 LOWP_MODEL "--fp8-format hybrid --fp8-recipe blockwise --moe-expert-backend %s",
                 paths[p]);
        run_losses(flags, LOWP_STEPS, l);
        const double rel = fabs(tail_mean(l) - tail_mean(loop)) / tail_mean(loop);
        printf("  blockwise hybrid, experts %-15s last 10 %.4f (loop %.4f)\n", paths[p],
               tail_mean(l), tail_mean(loop));
        ck_assert_msg(rel < 0.01, "%s: %.4f vs the loop's %.4f", paths[p], tail_mean(l),
                      tail_mean(loop));
    }
    /* NVFP4's wgrad transform expert by expert under the grouped GEMM with host offsets
     * (moe_lowp_wgrad(): G groups, each padded on its own): it trains as the loop does,
     * within NVFP4's margin of fp32 (the forward's QDQ is one tensor over all experts
     * there, one per expert in the loop, so the bits differ) */
    run_losses(LOWP_MODEL "--fp4-format e2m1 --fp4-recipe nvfp4 --moe-expert-backend "
                          "cublas-grouped", LOWP_STEPS, l);
    printf("  nvfp4, experts cublas-grouped            first %.4f, last 10 %.4f (loop %.4f)\n",
           l[0], tail_mean(l), tail_mean(nvfp4[0]));
    ck_assert_msg(tail_mean(l) < l[0] - 0.5 && fabs(tail_mean(l) - ref_tail) / ref_tail < 0.05,
                  "nvfp4, cublas-grouped experts: %.4f -> %.4f (fp32 %.4f)", l[0], tail_mean(l),
                  ref_tail);
    /* a per-tensor amax over the sync-free layer's static budget of rows is refused */
    moe_trainer *t = NULL;
    moe_error err;
    ck_assert(make_trainer(&t, LOWP_MODEL "--fp8-format e4m3 --moe-expert-backend grouped",
                           &err) == MOE_ERR_CONFIG);
    ck_assert_msg(strstr(err.msg, "static budget of rows") && strstr(err.msg, "tensorwise"),
                  "%s", err.msg);
}
END_TEST

START_TEST(test_trainer_eval_and_sample) {
    moe_trainer *t = NULL;
    moe_error err;
    ck_assert_msg(make_trainer(&t, SMALL "--num-experts 0", &err) == MOE_OK, "%s", err.msg);
    double v1 = moe_trainer_evaluate(t, MOE_SPLIT_VAL, 2);
    double v2 = moe_trainer_evaluate(t, MOE_SPLIT_VAL, 2);
    ck_assert_double_eq(v1, v2); /* evaluation uses the same batches every time */
    char text[41];
    memset(text, 0x7f, sizeof text);
    moe_trainer_sample(t, 40, 1.0, 3, text);
    ck_assert_int_eq((int)strlen(text), 40);
    for (int i = 0; i < 40; i++)
        ck_assert(t->data.tok.byte_to_id[(unsigned char)text[i]] >= 0);
    moe_trainer_free(t);
}
END_TEST

static void expect_error(const char *flags, moe_status code, const char *needle) {
    moe_trainer *t = NULL;
    moe_error err;
    moe_error_clear(&err);
    moe_status s = make_trainer(&t, flags, &err);
    ck_assert_msg(s == code, "flags '%s': expected status %d, got %d (%s)", flags, code, s, err.msg);
    ck_assert_msg(strstr(err.msg, needle) != NULL, "flags '%s': message '%s' lacks '%s'", flags,
                  err.msg, needle);
    ck_assert(t == NULL);
}

START_TEST(test_trainer_errors) {
    expect_error(SMALL "--data-path /nonexistent/file.txt", MOE_ERR_IO, "--data-path");
    expect_error(SMALL "--seq-length 200000", MOE_ERR_CONFIG, "--seq-length");
    expect_error(SMALL "--moe-router-topk 9", MOE_ERR_CONFIG, "--moe-router-topk");
    expect_error(SMALL "--num-attention-heads 3", MOE_ERR_CONFIG, "--num-attention-heads");
    if (!moe_test_have_gpu())
        expect_error(SMALL "--device cuda", MOE_ERR_BACKEND, "--device");
    expect_error(SMALL "--no-such-flag 1", MOE_ERR_FLAG, "--no-such-flag");
    /* context parallelism splits each sequence over ranks: one process cannot run it */
    expect_error(SMALL "--context-parallel-size 2", MOE_ERR_CONFIG, "mpirun -np 2");
}
END_TEST

/* Run bin/moe-train (built by `make all` before the tests) and capture its output. */
static int run_program(const char *args, char *out, size_t cap) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "MOE_NO_DOWNLOAD=1 ./bin/moe-train %s", args);
    return moe_test_run(cmd, out, cap);
}

START_TEST(test_program_cli) {
    if (!moe_test_have_program("bin/moe-train"))
        return;
    static char out[1 << 16];
    ck_assert_int_eq(run_program("--help", out, sizeof out), 0);
    ck_assert(strstr(out, "--moe-router-topk") && strstr(out, "(default: "));
    ck_assert_int_eq(run_program("--hiden-size 3", out, sizeof out), 2);
    ck_assert_msg(strstr(out, "did you mean --hidden-size"), "%s", out);
    ck_assert_int_eq(run_program("--num-experts 6 --moe-router-num-groups 4 "
                                 "--moe-router-group-topk 1", out, sizeof out), 2);
    ck_assert_msg(strstr(out, "--moe-router-num-groups"), "%s", out);
    ck_assert_int_eq(run_program("--data-path /nonexistent", out, sizeof out), 1);
    ck_assert_msg(strstr(out, "--data-path"), "%s", out);
    /* a tiny real run prints steps, an eval line and a sample */
    ck_assert_int_eq(run_program(SMALL "--train-iters 3 --log-interval 1 --eval-iters 1 "
                                       "--sample-length 20", out, sizeof out), 0);
    ck_assert_msg(strstr(out, "step     3/3") && strstr(out, "val loss") && strstr(out, "sample"),
                  "%s", out);
}
END_TEST

/* Chapter 05's delayed scaling through training (lowp.h, "Delayed scaling"), its state read
 * after every step. One micro-batch per step, a window of 4, the max algorithm, margin 1 (so
 * the numerator is 448/2). At every site that recorded in step t:
 *  - its first tensor took current scaling: used = 224/amax(itself);
 *  - every later one was cast with 224 / (the max of the amaxes of the last 4 records BEFORE
 *    it), kept by the test from what each step recorded, and that was the site's scale
 *    before the step: the history of steps < t, not the tensor itself;
 *  - its amax went into the slot it was at, and the slot moved by one (mod 4);
 * and each site recorded as often as it should: the forward inputs and output gradients of
 * attention, the dense FFN and the shared expert once per step (the backward's replay of a
 * saved input records nothing), each weight once per step (plus once when the model was
 * made), a routed expert's input and gradient at most once (an expert may get no tokens),
 * and the K and V inputs (served by Q's QDQ) never. */
#define DELAYED_MODEL                                                                        \
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2 "          \
    "--seq-length 16 --micro-batch-size 4 --global-batch-size 4 --num-experts 4 "            \
    "--moe-ffn-hidden-size 32 --ffn-hidden-size 64 --moe-shared-expert-intermediate-size 16 " \
    "--moe-layer-freq 0,1 --lr 3e-3 --lr-warmup-iters 2 --train-iters 20 --fp8-format e4m3 " \
    "--fp8-recipe delayed --fp8-amax-history-len 4 --fp8-amax-compute-algo max --fp8-margin 1 "

/* how often site (linear li, role) of the DELAYED_MODEL records per step: 1, 0, or -1 for
 * "0 or 1" (a routed expert's input and gradient) */
static int records_per_step(int li, int role, int experts) {
    const int stride = 8 + 2 * experts, layer = li / stride, j = li % stride;
    const int moe = layer == 1; /* --moe-layer-freq 0,1 */
    if ((j == 4 || j == 5) && moe) /* no dense FFN in the MoE layer */
        return 0;
    if (j >= 6 && !moe) /* no shared expert, no routed experts in the dense one */
        return 0;
    if (role == MOE_LOWP_ACTIVATION && (j == 1 || j == 2)) /* K, V: Q's QDQ serves them */
        return 0;
    if (j >= 8 && role != MOE_LOWP_WEIGHT)
        return -1;
    return 1;
}

START_TEST(test_lowp_delayed_history) {
    enum { STEPS = 7, LEN = 4, MAXREC = STEPS + 1 };
    moe_trainer *t = NULL;
    moe_error err;
    ck_assert_msg(make_trainer(&t, DELAYED_MODEL, &err) == MOE_OK, "%s", err.msg);
    const moe_lowp *lp = t->model->lowp;
    const moe_backend *be = t->model->be;
    ck_assert(lp && lp->delayed && lp->hist_len == LEN && lp->sites);
    const size_t ns = moe_lowp_sites(lp);
    moe_delayed_site *prev = malloc(sizeof *prev * ns), *now = malloc(sizeof *now * ns);
    float *hist = malloc(sizeof(float) * ns * LEN);
    float *log = calloc(ns * MAXREC, sizeof(float)); /* every amax each site recorded */
    be->to_host(prev, lp->sites, sizeof *prev * ns);
    for (size_t k = 0; k < ns; k++) { /* the model's creation quantized the weights once */
        const int want = k % 3 == MOE_LOWP_WEIGHT &&
                         records_per_step((int)(k / 3), MOE_LOWP_WEIGHT, lp->experts) == 1;
        ck_assert_msg(prev[k].steps == want, "site %zu: %d records at creation", k,
                      prev[k].steps);
        if (want)
            log[k * MAXREC] = prev[k].amax;
    }
    const float num = 448.0f / 2;
    double first = 0, last = 0;
    for (int step = 1; step <= STEPS; step++) {
        last = moe_test_step(t);
        first = step == 1 ? last : first;
        be->to_host(now, lp->sites, sizeof *now * ns);
        be->to_host(hist, lp->history, sizeof(float) * ns * LEN);
        for (size_t k = 0; k < ns; k++) {
            const int per = records_per_step((int)(k / 3), (int)(k % 3), lp->experts);
            const int d = now[k].steps - prev[k].steps;
            ck_assert_msg(per < 0 ? d == 0 || d == 1 : d == per,
                          "step %d, site %zu (linear %zu, role %zu): %d records, want %d", step,
                          k, k / 3, k % 3, d, per);
            if (d == 0)
                continue;
            const int n = prev[k].steps; /* records before this one */
            float want;
            if (n == 0) {
                want = num / now[k].amax; /* current scaling */
            } else {
                float m = 0;
                for (int i = n - 1; i >= 0 && i >= n - LEN; i--)
                    m = fmaxf(m, log[k * MAXREC + i]);
                want = num / m;
                ck_assert(now[k].used == prev[k].scale);
            }
            ck_assert_msg(now[k].used == want, "step %d, site %zu: cast with %.9g, want %.9g "
                          "(224 / max of the %d amaxes before)", step, k, now[k].used, want,
                          n < LEN ? n : LEN);
            ck_assert(now[k].used_inv == 1.0f / now[k].used);
            ck_assert(hist[k * LEN + prev[k].pos] == now[k].amax);
            ck_assert_int_eq(now[k].pos, (prev[k].pos + 1) % LEN);
            log[k * MAXREC + n] = now[k].amax;
        }
        memcpy(prev, now, sizeof *now * ns);
    }
    ck_assert_msg(last < first, "the loss did not fall: %.4f -> %.4f", first, last);
    free(prev), free(now), free(hist), free(log);
    moe_trainer_free(t);
}
END_TEST

Suite *suite_train(void) {
    Suite *s = suite_create("train");
    TCase *tc = tcase_create("train");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_determinism_same_seed);
    tcase_add_test(tc, test_loss_falls);
    tcase_add_test(tc, test_lowp_training);
    tcase_add_test(tc, test_trainer_eval_and_sample);
    tcase_add_test(tc, test_trainer_errors);
    tcase_add_test(tc, test_program_cli);
    suite_add_tcase(s, tc);
    TCase *ch05 = tcase_create("ch05");
    tcase_set_tags(ch05, "ch05");
    tcase_set_timeout(ch05, 120);
    tcase_add_test(ch05, test_lowp_delayed_history);
    suite_add_tcase(s, ch05);
    return s;
}
