/*
 * The step's scalars on the device and the step boundary (chapter 06), on the CPU backend:
 *  - a training step waits for the device exactly once (the boundary's wait_to_host) and reads
 *    nothing back through to_host / read_act / synchronize (counted through the op table);
 *  - the overflow protocol: a step whose flags say MOE_STEP_OVERFLOW skips its update, grows
 *    the budget and runs again, and the run's losses and weights are those of a run without
 *    the overflow, bit for bit;
 *  - a non-finite gradient norm stops the run with the named error and leaves the weights,
 *    the AdamW state, the expert bias and the step counters untouched;
 *  - the CPU twins of the scalar ops do the host formulas.
 * The CPU backend's memory is host memory, so a hook can raise flags and poison gradients
 * directly (moe_trainer::step_hook).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "suites.h"
#include "trainer.h"

#define SMALL "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2 " \
              "--seq-length 32 --micro-batch-size 4 --global-batch-size 8 --num-experts 4 "   \
              "--moe-ffn-hidden-size 32 --ffn-hidden-size 64 --lr 3e-3 --lr-warmup-iters 2 "   \
              "--train-iters 40 --moe-router-score-function sigmoid "                        \
              "--moe-router-enable-expert-bias --clip-grad 0.05 "

START_TEST(test_step_waits_once) {
    moe_trainer *t = moe_test_trainer(SMALL, NULL, 0);
    moe_test_sync_counts n = {0};
    moe_test_count_syncs(t, &n);
    for (int s = 0; s < 3; s++) {
        moe_test_step(t);
    }
    printf("  3 CPU steps: wait_to_host %lld, to_host %lld, read_act %lld, synchronize %lld | "
           "not ours: from_host %lld (the batches), permute_index %lld (the MoE layer)\n",
           n.wait_to_host, n.to_host, n.read_act, n.synchronize, n.from_host, n.permute_index);
    ck_assert_msg(n.wait_to_host == 3, "%lld boundary waits in 3 steps, not one per step",
                  n.wait_to_host);
    ck_assert_msg(n.to_host == 0 && n.read_act == 0 && n.synchronize == 0,
                  "the step read the device back: to_host %lld, read_act %lld, synchronize %lld",
                  n.to_host, n.read_act, n.synchronize);
    moe_trainer_free(t);
}
END_TEST

/* ---------------------------------------------------------------- overflow: re-run */

typedef struct hook_ctx {
    int calls;        /* the hook's calls (one per run of a step) */
    int at_step;      /* the step to act on */
    int times;        /* how many runs of it to act on */
    int acted;
    int flag;         /* the bit to raise, or 0 */
    int poison;       /* 1: set a gradient to NaN */
} hook_ctx;

static void hook(moe_trainer *t, void *p) {
    hook_ctx *h = p;
    h->calls++;
    if (t->step != h->at_step || h->acted >= h->times)
        return;
    h->acted++;
    if (h->flag)
        *t->model->step_flags |= h->flag; /* CPU: backend memory is host memory */
    if (h->poison)
        t->model->grads[7] = NAN;
}

static int g_grows;
static moe_status grow_ok(moe_model *m, moe_error *err) {
    (void)m;
    (void)err;
    g_grows++;
    return MOE_OK;
}

START_TEST(test_overflow_reruns_the_step) {
    const int steps = 4;
    moe_trainer *a = moe_test_trainer(SMALL, NULL, 0), *b = moe_test_trainer(SMALL, NULL, 0);
    hook_ctx h = {.at_step = 1, .times = 2, .flag = MOE_STEP_OVERFLOW};
    b->step_hook = hook;
    b->step_hook_ctx = &h;
    b->grow_budget = grow_ok;
    g_grows = 0;
    for (int s = 0; s < steps; s++) {
        const double la = moe_test_step(a), lb = moe_test_step(b);
        ck_assert_msg(memcmp(&la, &lb, sizeof la) == 0,
                      "step %d: loss %.17g with two overflows, %.17g without", s, lb, la);
    }
    ck_assert_int_eq(b->reruns, 2);
    ck_assert_int_eq(g_grows, 2);
    ck_assert_int_eq(h.calls, steps + 2);
    ck_assert_int_eq(b->step, steps);
    ck_assert_int_eq((int)b->opt.step, steps);
    const size_t n = moe_model_num_params(a->model);
    ck_assert_msg(!memcmp(a->model->params, b->model->params, sizeof(moe_real) * n),
                  "the weights after the re-runs differ from a run without overflow");
    ck_assert_msg(!memcmp(a->opt.m, b->opt.m, sizeof(float) * a->opt.n) &&
                      !memcmp(a->opt.v, b->opt.v, sizeof(float) * a->opt.n),
                  "the AdamW moments after the re-runs differ");
    const size_t nb = (size_t)a->cfg.num_layers * a->cfg.num_experts;
    ck_assert_msg(!memcmp(a->model->expert_bias, b->model->expert_bias, sizeof(float) * nb),
                  "the expert bias moved during a skipped step");
    printf("  overflow at step 2, twice: 2 re-runs, losses and weights = a run without\n");
    moe_trainer_free(a);
    moe_trainer_free(b);
}
END_TEST

/* The placeholder budget of a model without one is an error, and it reaches the caller. */
START_TEST(test_overflow_without_budget_is_an_error) {
    moe_trainer *t = moe_test_trainer(SMALL, NULL, 0);
    hook_ctx h = {.at_step = 0, .times = 1, .flag = MOE_STEP_OVERFLOW};
    t->step_hook = hook;
    t->step_hook_ctx = &h;
    t->grow_budget = moe_model_grow_moe_budget;
    moe_step_stats st;
    moe_error err;
    const moe_status s = moe_trainer_step(t, &st, &err);
    if (s == MOE_OK) { /* a model with a budget grows it and re-runs the step */
        ck_assert_int_eq(t->reruns, 1);
    } else {
        ck_assert_int_eq(t->step, 0);
        ck_assert_int_eq((int)t->opt.step, 0);
    }
    moe_trainer_free(t);
}
END_TEST

/* ---------------------------------------------------------------- non-finite: skip */

START_TEST(test_nonfinite_skips_the_update) {
    moe_trainer *t = moe_test_trainer(SMALL, NULL, 0);
    moe_test_step(t);
    moe_test_step(t);
    moe_model *m = t->model;
    const size_t n = moe_model_num_params(m), nb = (size_t)t->cfg.num_layers * t->cfg.num_experts;
    moe_real *p = malloc(sizeof(moe_real) * n);
    float *mo = malloc(sizeof(float) * t->opt.n), *vo = malloc(sizeof(float) * t->opt.n);
    float *bias = malloc(sizeof(float) * nb);
    ck_assert(p && mo && vo && bias);
    memcpy(p, m->params, sizeof(moe_real) * n);
    memcpy(mo, t->opt.m, sizeof(float) * t->opt.n);
    memcpy(vo, t->opt.v, sizeof(float) * t->opt.n);
    memcpy(bias, m->expert_bias, sizeof(float) * nb);
    hook_ctx h = {.at_step = 2, .times = 1, .poison = 1};
    t->step_hook = hook;
    t->step_hook_ctx = &h;
    moe_step_stats st;
    moe_error err;
    ck_assert_int_eq(moe_trainer_step(t, &st, &err), MOE_ERR_NONFINITE);
    ck_assert_msg(strstr(err.msg, "step 3") && strstr(err.msg, "gradient norm is") &&
                      strstr(err.msg, "nan") &&
                      strstr(err.msg, "--no-check-for-nan-in-loss-and-grad"),
                  "%s", err.msg);
    ck_assert_msg(!memcmp(p, m->params, sizeof(moe_real) * n), "the weights were updated");
    ck_assert_msg(!memcmp(mo, t->opt.m, sizeof(float) * t->opt.n) &&
                      !memcmp(vo, t->opt.v, sizeof(float) * t->opt.n),
                  "the AdamW moments were updated");
    ck_assert_msg(!memcmp(bias, m->expert_bias, sizeof(float) * nb), "the expert bias moved");
    ck_assert_int_eq(t->step, 2);
    ck_assert_int_eq((int)t->opt.step, 2);
    ck_assert_int_eq(t->reruns, 0);
    free(p); free(mo); free(vo); free(bias);
    moe_trainer_free(t);
}
END_TEST

/* ------------------------------------------------------- the CPU twins of the scalar ops */

START_TEST(test_scalar_ops_cpu) {
    const moe_backend *be = moe_backend_cpu();
    /* one micro-batch of 64 tokens, accum 2, the step starting from other values */
    double step[4] = {1.0, 2.0, 3.0, 4.0}, mb[3] = {130.5, 0.25, 0.125};
    be->loss_accumulate(step, mb, 64, 2.0);
    const double ce = 130.5 / 64;
    ck_assert(step[0] == 1.0 + (ce + 0.25 + 0.125) / 2 && step[1] == 2.0 + ce / 2 &&
              step[2] == 3.0 + 0.25 / 2 && step[3] == 4.0 + 0.125 / 2);
    /* the norm: the whole tensors' slot and the groups', the clip, the check */
    moe_step_scalars s;
    memset(&s, 0, sizeof s);
    s.sumsq[MOE_STEP_NORM_SLOTS - 1] = 9.0;
    s.sumsq[0] = 16.0;
    be->grad_norm_finalize(&s, 1.0, 1);
    ck_assert(s.grad_norm == 5.0 && s.clip == 1.0 / (5.0 + MOE_CLIP_EPS) && s.flags == 0);
    be->grad_norm_finalize(&s, 10.0, 1);
    ck_assert(s.clip == 1.0 && s.flags == 0);
    be->grad_norm_finalize(&s, 0.0, 1); /* clipping off */
    ck_assert(s.clip == 1.0);
    s.step[0] = INFINITY;
    be->grad_norm_finalize(&s, 1.0, 0); /* the check off: no flag */
    ck_assert(s.flags == 0);
    be->grad_norm_finalize(&s, 1.0, 1);
    ck_assert(s.flags == MOE_STEP_NONFINITE);
    s.step[0] = 0.0;
    s.flags = MOE_STEP_OVERFLOW;
    s.sumsq[3] = NAN;
    be->grad_norm_finalize(&s, 1.0, 1);
    ck_assert(isnan(s.grad_norm) && s.clip == 1.0 &&
              s.flags == (MOE_STEP_OVERFLOW | MOE_STEP_NONFINITE));
    /* AdamW: the clip factor is the in-place clip; a flag skips everything */
    moe_real p1[3] = {1, 2, 3}, p2[3] = {1, 2, 3}, g[3] = {0.5f, -0.25f, 2.0f}, gc[3];
    float m1[3] = {0}, v1[3] = {0}, m2[3] = {0}, v2[3] = {0};
    const double clip = 0.3;
    for (int i = 0; i < 3; i++)
        gc[i] = (moe_real)(g[i] * clip);
    const moe_adamw_runs run3 = moe_test_adamw_flat(be, 3); /* the three elements */
    be->adamw(&run3, p1, g, m1, v1, NULL, 1e-2, 0.9, 0.95, 1e-8, 0.1, 0.1, 0.05, &clip, NULL,
              NULL);
    be->adamw(&run3, p2, gc, m2, v2, NULL, 1e-2, 0.9, 0.95, 1e-8, 0.1, 0.1, 0.05, NULL, NULL,
              NULL);
    ck_assert(!memcmp(p1, p2, sizeof p1) && !memcmp(m1, m2, sizeof m1) &&
              !memcmp(v1, v2, sizeof v1));
    /* lr and the bias corrections from memory (hyper) win over the arguments */
    moe_real p3[3] = {1, 2, 3};
    float m3[3] = {0}, v3[3] = {0};
    const double hyper[3] = {1e-2, 0.1, 0.05};
    be->adamw(&run3, p3, gc, m3, v3, NULL, 7.0, 0.9, 0.95, 1e-8, 0.1, 0.9, 0.9, NULL, NULL,
              hyper);
    ck_assert(!memcmp(p3, p2, sizeof p3) && !memcmp(m3, m2, sizeof m3) &&
              !memcmp(v3, v2, sizeof v3));
    const int flag = MOE_STEP_NONFINITE;
    be->adamw(&run3, p1, g, m1, v1, NULL, 1e-2, 0.9, 0.95, 1e-8, 0.1, 0.1, 0.05, &clip, &flag,
              NULL);
    ck_assert(!memcmp(p1, p2, sizeof p1) && !memcmp(m1, m2, sizeof m1));
    be->free(run3.run);
    /* the expert load and the bias */
    long long load[4] = {5, 0, 0, 1};
    const int idx[6] = {0, 3, 1, 3, 3, 2};
    be->expert_load_add(load, idx, 3, 2, 4);
    ck_assert(load[0] == 6 && load[1] == 1 && load[2] == 1 && load[3] == 4);
    float bias[4] = {0}, bias0[4] = {0};
    be->expert_bias_update(bias, load, 4, 0.5, &flag);
    ck_assert(!memcmp(bias, bias0, sizeof bias));
    be->expert_bias_update(bias, load, 4, 0.5, NULL); /* mean 3: below it up, above down */
    ck_assert(bias[0] == -0.5f && bias[1] == 0.5f && bias[2] == 0.5f && bias[3] == -0.5f);
}
END_TEST

Suite *suite_step_scalars(void) {
    const TTest *const tests[] = {test_step_waits_once, test_overflow_reruns_the_step,
                                         test_overflow_without_budget_is_an_error,
                                         test_nonfinite_skips_the_update, test_scalar_ops_cpu};
    return moe_test_chapter_suite("step_scalars", "ch06", tests,
                                  (int)(sizeof tests / sizeof *tests));
}
