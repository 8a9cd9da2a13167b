/*
 * The whole model, CUDA against CPU: same flags, data and seed give the same initial
 * model on both backends; after one forward+backward the loss, the logits and every
 * gradient tensor agree within bf16 bounds; and 50 training steps on the GPU track the
 * CPU's losses within a stated band.
 *
 * Bounds (bf16 activations with fp32 accumulation against an fp32 reference):
 *   loss |Δ| ≤ 0.02, logits ‖Δ‖/‖ref‖ ≤ 0.02, each gradient tensor ‖Δ‖/‖ref‖ ≤ 0.05 —
 *   except the routed experts' weights, ≤ 0.10: bf16 moves the router logits by ~0.5%,
 *   which flips a few near-tied expert choices, and a flipped token's gradient lands in a
 *   different expert (measured on an H200: 3.9–4.6%, every other tensor below 3%) —
 *   every one of 50 training losses |Δ| ≤ 0.05, and the last-10 average |Δ| ≤ 0.03.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_ops.h"
#include "helpers.h"
#include "suites.h"
#include "trainer.h"

#define GPU_SMALL "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 " \
                  "--seq-length 64 --micro-batch-size 8 --global-batch-size 16 --num-experts 8 " \
                  "--moe-ffn-hidden-size 64 --ffn-hidden-size 128 --lr 2e-3 --lr-warmup-iters 5 " \
                  "--train-iters 50 --moe-shared-expert-intermediate-size 32 --qk-layernorm "     \
                  "--moe-layer-freq 0,1 "

static moe_trainer *make(const char *flags, const char *device) {
    char buf[2048];
    snprintf(buf, sizeof buf, "%s --device %s", flags, device);
    moe_config c;
    moe_error err;
    setenv("MOE_NO_DOWNLOAD", "1", 1);
    ck_assert_msg(moe_test_config(&c, buf, &err) == MOE_OK, "%s", err.msg);
    moe_trainer *t = NULL;
    ck_assert_msg(moe_trainer_create(&t, &c, &err) == MOE_OK, "%s", err.msg);
    return t;
}

/* ‖a − b‖ / ‖b‖ over n values */
static double rel_l2(const moe_real *a, const moe_real *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        num += d * d;
        den += (double)b[i] * b[i];
        if (isnan(a[i]))
            return INFINITY;
    }
    return sqrt(num / (den > 0 ? den : 1e-30));
}

/* One forward+backward on both backends; every bound is multiplied by @p slack (1 for bf16
 * against fp32; more where a quantizer amplifies the bf16 differences, see the FP8 test). The
 * errors are printed before they are checked, so a failure shows all of them. */
static void check_one_step(const char *flags, double slack) {
    moe_trainer *tc = make(flags, "cpu"), *tg = make(flags, "cuda");
    ck_assert_str_eq(tg->model->be->name, "cuda");
    const moe_config *c = &tc->cfg;
    const int B = c->micro_batch_size, T = c->seq_length, V = c->vocab_size;
    const size_t P = moe_model_num_params(tc->model), NV = (size_t)B * T * V;
    /* the same initial master weights, bit for bit */
    moe_real *pc = malloc(sizeof(moe_real) * P), *pg = malloc(sizeof(moe_real) * P);
    tg->model->be->to_host(pg, tg->model->params, sizeof(moe_real) * P);
    memcpy(pc, tc->model->params, sizeof(moe_real) * P);
    ck_assert_msg(memcmp(pc, pg, sizeof(moe_real) * P) == 0, "initial weights differ");

    moe_dataset_batch(&tc->data, MOE_SPLIT_TRAIN, B, T, 1337, 0, tc->inputs, tc->targets);
    double lc = moe_model_forward(tc->model, tc->inputs, tc->targets, B, T);
    double lg = moe_model_forward(tg->model, tc->inputs, tc->targets, B, T);
    moe_real *zc = malloc(sizeof(moe_real) * NV), *zg = malloc(sizeof(moe_real) * NV);
    tc->model->be->read_act(zc, tc->model->logits, NV);
    tg->model->be->read_act(zg, tg->model->logits, NV);
    const double ez = rel_l2(zg, zc, NV);

    moe_model_zero_grad(tc->model);
    moe_model_zero_grad(tg->model);
    moe_model_backward(tc->model, 1.0);
    moe_model_backward(tg->model, 1.0);
    memcpy(pc, tc->model->grads, sizeof(moe_real) * P);
    tg->model->be->to_host(pg, tg->model->grads, sizeof(moe_real) * P);
    double worst = 0, worst_other = 0, worst_excess = 0;
    const char *worst_name = "", *worst_other_name = "", *over = NULL;
    for (int i = 0; i < tc->model->table.n; i++) {
        const moe_tensor *t = &tc->model->table.t[i];
        double e = rel_l2(pg + t->offset, pc + t->offset, t->numel);
        double bound = slack * (strstr(t->name, ".experts.") ? 0.10 : 0.05);
        if (e / bound > worst_excess) {
            worst_excess = e / bound;
            over = e > bound ? t->name : NULL;
        }
        if (e > worst) {
            worst = e;
            worst_name = t->name;
        }
        if (!strstr(t->name, ".experts.") && e > worst_other) {
            worst_other = e;
            worst_other_name = t->name;
        }
    }
    printf("  one step (%s): loss cpu %.5f cuda %.5f | logits rel %.2e | worst grad %s rel %.2e "
           "| worst non-expert grad %s rel %.2e\n",
           flags + strlen(GPU_SMALL), lc, lg, ez, worst_name, worst, worst_other_name,
           worst_other);
    ck_assert_msg(fabs(lc - lg) <= 0.02 * slack, "loss cpu %.5f vs cuda %.5f", lc, lg);
    ck_assert_msg(ez <= 0.02 * slack, "logits rel err %.4f > %.3f", ez, 0.02 * slack);
    ck_assert_msg(!over, "gradient of %s: rel err above its bound (%.2fx the bound)", over,
                  worst_excess);
    free(pc); free(pg); free(zc); free(zg);
    moe_trainer_free(tc);
    moe_trainer_free(tg);
}

START_TEST(test_gpu_model_one_step) {
    check_one_step(GPU_SMALL "", 1);
    check_one_step(GPU_SMALL "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
                             "--moe-router-num-groups 4 --moe-router-group-topk 2 "
                             "--moe-router-load-balancing-type seq_aux_loss", 1);
    check_one_step(GPU_SMALL "--moe-router-pre-softmax --moe-router-topk 3 "
                             "--moe-router-topk-scaling-factor 2", 1);
}
END_TEST

/* @p steps training steps of the same model on the CPU and on CUDA: the losses of each, and
 * the largest difference */
static double track_cpu(const char *flags, int steps, double *lc, double *lg) {
    moe_trainer *tc = make(flags, "cpu"), *tg = make(flags, "cuda");
    double worst = 0;
    for (int s = 0; s < steps; s++) {
        moe_step_stats a, b;
        moe_trainer_step(tc, &a, NULL);
        moe_trainer_step(tg, &b, NULL);
        lc[s] = a.loss;
        lg[s] = b.loss;
        worst = fmax(worst, fabs(lc[s] - lg[s]));
    }
    moe_trainer_free(tc);
    moe_trainer_free(tg);
    return worst;
}

START_TEST(test_gpu_model_50_steps_track_cpu) {
    double lc[50], lg[50], tail = 0;
    const double worst = track_cpu(GPU_SMALL, 50, lc, lg);
    for (int s = 40; s < 50; s++)
        tail += fabs(lc[s] - lg[s]) / 10;
    printf("  50 steps: cpu %.4f -> %.4f, cuda %.4f -> %.4f, max |diff| %.4f, last-10 mean |diff| "
           "%.4f\n", lc[0], lc[49], lg[0], lg[49], worst, tail);
    ck_assert_msg(worst <= 0.05, "a training loss differs by %.4f", worst);
    ck_assert_msg(tail <= 0.03, "last-10 losses differ by %.4f on average", tail);
    ck_assert(lg[49] < lg[0] - 0.5); /* and the GPU run actually learns */
}
END_TEST

/* Chapter 05: the emulated FP8 path on CUDA (bf16 activations) against the CPU's (fp32), the
 * same recipe (MXFP8: per-row blocks, so the grouped kernel's padding rows change nothing):
 * one step's loss and gradients, then 30 steps of training.
 *
 * The one-step bounds are twice bf16's. Each linear layer quantizes its inputs to E4M3, whose
 * step is 2^-3 = 12.5% of the value's binade: inputs that differ by bf16's rounding (~2^-9)
 * land on different sides of a rounding boundary for about 2^-9 / 2^-3 ≈ 1.6% of the values,
 * each then off by a whole E4M3 step. Measured on an H100 (fc266fd): logits 2.06% against
 * bf16's bound of 2%, where the bf16 path itself is at 0.55%. */
static void lowp_tracks_cpu(const char *recipe, const char *flags) {
    check_one_step(flags, 2);
    double lc[30], lg[30];
    const double worst = track_cpu(flags, 30, lc, lg);
    printf("  fp8 %s emulated, 30 steps: cpu %.4f -> %.4f, cuda %.4f -> %.4f, max |diff| "
           "%.4f\n", recipe, lc[0], lc[29], lg[0], lg[29], worst);
    ck_assert_msg(worst <= 0.05, "a training loss differs by %.4f", worst);
    ck_assert(lg[29] < lg[0] - 0.5);
}

START_TEST(test_gpu_model_lowp_tracks_cpu) {
    lowp_tracks_cpu("mxfp8", GPU_SMALL "--fp8-format e4m3 --fp8-recipe mxfp8");
}
END_TEST

/* Chapter 05's delayed scaling (lowp.h): the same bounds as the mxfp8 run above. The experts
 * loop on both backends (a per-tensor recipe is refused with the sync-free grouped layer, and
 * the loop gives each expert its own tensors, hence its own sites, on both). Passed on an
 * H100 (a6f2b19). */
START_TEST(test_gpu_model_delayed_tracks_cpu) {
    lowp_tracks_cpu("delayed", GPU_SMALL "--fp8-format e4m3 --fp8-recipe delayed "
                                         "--fp8-amax-history-len 4 --fp8-amax-compute-algo "
                                         "max --moe-expert-backend loop");
}
END_TEST

Suite *suite_gpu_model(void) {
    Suite *s = suite_create("gpu-model");
    TCase *tc = tcase_create("model");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_gpu_model_one_step);
    tcase_add_test(tc, test_gpu_model_50_steps_track_cpu);
    tcase_add_test(tc, test_gpu_model_lowp_tracks_cpu);
    tcase_add_test(tc, test_gpu_model_delayed_tracks_cpu);
    suite_add_tcase(s, tc);
    return s;
}
