/*
 * Finite-difference gradient checks of the MoE layer and of the whole model,
 * in double precision, for every router variant, with the shared expert on and
 * off, QK-norm, GQA, dense first layers, and the load-balancing losses.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/ops.h"
#include "fd.h"
#include "helpers.h"
#include "model.h"
#include "suites.h"

#define TOL 1e-5

/* A validated config from a flag string (on top of the defaults). */
static moe_config make_config(const char *flags, int vocab) {
    moe_config c;
    moe_error err;
    ck_assert_msg(moe_test_config(&c, flags, &err) == MOE_OK, "%s", err.msg);
    c.vocab_size = vocab;
    ck_assert_msg(moe_config_validate(&c, &err) == MOE_OK, "%s", err.msg);
    return c;
}

/* A tiny model: the base shape every variant below starts from. */
#define TINY "--num-layers 2 --hidden-size 16 --num-attention-heads 4 --num-query-groups 2 " \
             "--seq-length 6 --ffn-hidden-size 12 --moe-ffn-hidden-size 8 --init-method-std 0.3 "

/* ------------------------------------------------------------ whole model */

typedef struct {
    moe_model *m;
    int B, T;
    int *tok, *tgt;
} model_ctx;

static double model_loss(void *p) {
    model_ctx *c = p;
    return moe_model_forward(c->m, c->tok, c->tgt, c->B, c->T);
}

static void check_model(const char *what, const char *flags) {
    const int V = 13, B = 2;
    moe_config cfg = make_config(flags, V);
    moe_model *m = NULL;
    moe_error err;
    ck_assert_msg(moe_model_create(&m, &cfg, moe_backend_cpu(), B, NULL, &err) == MOE_OK, "%s", err.msg);
    moe_model_init(m, 7);
    /* norm weights start at 1; move them off 1 so their gradients are generic */
    for (int t = 0; t < m->table.n; t++)
        if (m->table.t[t].init == MOE_INIT_ONES)
            for (size_t i = 0; i < m->table.t[t].numel; i++)
                m->params[m->table.t[t].offset + i] += (moe_real)(0.1 * ((int)(i % 5) - 2));
    if (cfg.moe_router_enable_expert_bias) {
        for (int i = 0; i < cfg.num_layers * cfg.num_experts; i++)
            m->expert_bias[i] = 0.02f * (float)((i * 7) % 5); /* CPU: backend memory is host */
    }
    model_ctx c = {m, B, cfg.seq_length, malloc(sizeof(int) * B * cfg.seq_length),
                   malloc(sizeof(int) * B * cfg.seq_length)};
    for (int i = 0; i < B * cfg.seq_length; i++) {
        c.tok[i] = (i * 5 + 3) % V;
        c.tgt[i] = (i * 7 + 1) % V;
    }
    moe_model_zero_grad(m);
    double loss = model_loss(&c);
    ck_assert(loss > 0);
    if (cfg.num_experts > 0 && cfg.moe_aux_loss_coeff > 0 &&
        cfg.lb_type != MOE_LB_NONE)
        ck_assert_msg(m->last.aux > 0, "%s: aux loss not computed", what);
    moe_model_backward(m, 0.5); /* a loss scale ≠ 1 must scale every gradient, aux included */
    moe_model_backward(m, 0.5);
    for (int t = 0; t < m->table.n; t++) {
        const moe_tensor *ten = &m->table.t[t];
        char name[160];
        snprintf(name, sizeof name, "%s: %s", what, ten->name);
        double e = fd_check(name, model_loss, &c, m->params + ten->offset,
                            m->grads + ten->offset, ten->numel, 24, TOL);
        ck_assert_msg(e <= TOL, "%s: gradient of %s off by %.3e", what, ten->name, e);
    }
    free(c.tok);
    free(c.tgt);
    moe_model_free(m);
    moe_cpu_matmul_release();
}

START_TEST(test_fd_model_softmax_shared_qknorm) {
    check_model("softmax top-2, shared expert, qk-norm, dense first layer",
                TINY "--num-experts 4 --moe-router-topk 2 --moe-shared-expert-intermediate-size 8 "
                     "--qk-layernorm --moe-layer-freq 0,1 --moe-aux-loss-coeff 0.1 "
                     "--moe-z-loss-coeff 0.01");
}
END_TEST

START_TEST(test_fd_model_softmax_no_shared) {
    check_model("softmax top-2, no shared expert",
                TINY "--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.1 "
                     "--moe-z-loss-coeff 0.01");
}
END_TEST

START_TEST(test_fd_model_pre_softmax_seq_aux) {
    check_model("pre-softmax top-3, seq aux loss, shared expert",
                TINY "--num-experts 6 --moe-router-topk 3 --moe-router-pre-softmax "
                     "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 0.1 "
                     "--moe-shared-expert-intermediate-size 4");
}
END_TEST

START_TEST(test_fd_model_sigmoid_bias_scaling) {
    check_model("sigmoid + expert bias + scaling factor",
                TINY "--num-experts 4 --moe-router-topk 2 --moe-router-score-function sigmoid "
                     "--moe-router-enable-expert-bias --moe-router-topk-scaling-factor 2.5 "
                     "--moe-aux-loss-coeff 0.1 --moe-z-loss-coeff 0.01");
}
END_TEST

START_TEST(test_fd_model_group_limited) {
    check_model("group-limited softmax (8 experts, 4 groups, 2 kept), top-4",
                TINY "--num-experts 8 --moe-router-topk 4 --moe-router-num-groups 4 "
                     "--moe-router-group-topk 2 --moe-aux-loss-coeff 0.1");
    check_model("group-limited sigmoid, top-2, shared expert",
                TINY "--num-experts 8 --moe-router-topk 2 --moe-router-num-groups 4 "
                     "--moe-router-group-topk 2 --moe-router-score-function sigmoid "
                     "--moe-shared-expert-intermediate-size 8 --moe-aux-loss-coeff 0.1");
}
END_TEST

static void same_as_loop(const char *flags);

/* The dispatcher path (local permutation into E+1 buckets, plan, chunk sort, combine),
 * single process: with a capacity that drops, with padding, and with a capacity so large
 * nothing is dropped — which must also equal chapter 01's naive loop exactly. */
START_TEST(test_fd_model_capacity) {
    check_model("capacity 1.0, probs policy (drops)",
                TINY "--num-experts 4 --moe-router-topk 2 --moe-expert-capacity-factor 1.0 "
                     "--moe-aux-loss-coeff 0.1 --moe-shared-expert-intermediate-size 4");
    check_model("capacity 1.0, position policy, padded",
                TINY "--num-experts 4 --moe-router-topk 2 --moe-expert-capacity-factor 1.0 "
                     "--moe-token-drop-policy position --moe-pad-expert-input-to-capacity");
    /* dispatcher path with no drops vs the naive loop: same loss, same gradients */
    same_as_loop(TINY "--num-experts 4 --moe-router-topk 2 --moe-expert-capacity-factor 100");
}
END_TEST

/* Chapter 03's grouped GEMM in the model (make check-ch03): gradients through it, and the
 * same numbers as chapter 01's loop. */
START_TEST(test_fd_model_grouped) {
    check_model("grouped GEMM, capacity 1.0",
                TINY "--num-experts 4 --moe-router-topk 2 --moe-expert-capacity-factor 1.0 "
                     "--moe-grouped-gemm");
    /* the grouped experts vs the loop: offsets from the host (cuBLAS's path) and from
     * "device" memory (our kernel's path; on the CPU both run the loop over groups) */
    same_as_loop(TINY "--num-experts 4 --moe-router-topk 2 --moe-grouped-gemm "
                      "--moe-shared-expert-intermediate-size 4");
    same_as_loop(TINY "--num-experts 4 --moe-router-topk 2 --moe-expert-backend cublas-grouped "
                      "--moe-shared-expert-intermediate-size 4");
    same_as_loop(TINY "--num-experts 4 --moe-router-topk 2 --moe-expert-backend grouped "
                      "--moe-expert-capacity-factor 100");
}
END_TEST

/* A variant that must compute exactly what chapter 01's loop computes (fp64, 1e-12). */
static void same_as_loop(const char *flags) {
    const int V = 13, B = 2;
    moe_config c1 = make_config(TINY "--num-experts 4 --moe-router-topk 2", V);
    if (strstr(flags, "shared"))
        c1 = make_config(TINY "--num-experts 4 --moe-router-topk 2 "
                              "--moe-shared-expert-intermediate-size 4", V);
    moe_config c2 = make_config(flags, V);
    moe_model *m1 = NULL, *m2 = NULL;
    moe_error err;
    ck_assert(moe_model_create(&m1, &c1, moe_backend_cpu(), B, NULL, &err) == MOE_OK);
    ck_assert(moe_model_create(&m2, &c2, moe_backend_cpu(), B, NULL, &err) == MOE_OK);
    moe_model_init(m1, 7);
    moe_model_init(m2, 7);
    int tok[12], tgt[12];
    for (int i = 0; i < 12; i++) {
        tok[i] = (i * 5 + 3) % V;
        tgt[i] = (i * 7 + 1) % V;
    }
    double l1 = moe_model_forward(m1, tok, tgt, B, 6), l2 = moe_model_forward(m2, tok, tgt, B, 6);
    ck_assert_double_eq_tol(l1, l2, 1e-12);
    moe_model_zero_grad(m1);
    moe_model_zero_grad(m2);
    moe_model_backward(m1, 1.0);
    moe_model_backward(m2, 1.0);
    for (size_t i = 0; i < m1->table.total; i++)
        ck_assert_double_eq_tol(m1->grads[i], m2->grads[i], 1e-12);
    moe_model_free(m1);
    moe_model_free(m2);
    moe_cpu_matmul_release();
}

START_TEST(test_fd_model_top1_and_dense) {
    check_model("softmax top-1", TINY "--num-experts 4 --moe-router-topk 1 --moe-z-loss-coeff 0.01");
    check_model("dense model (no experts)", TINY "--num-experts 0");
}
END_TEST

Suite *suite_fd_model(void) {
    Suite *s = suite_create("gradcheck-model (fp64)");
    TCase *tc = tcase_create("model");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_fd_model_softmax_shared_qknorm);
    tcase_add_test(tc, test_fd_model_pre_softmax_seq_aux);
    tcase_add_test(tc, test_fd_model_sigmoid_bias_scaling);
    tcase_add_test(tc, test_fd_model_group_limited);
    tcase_add_test(tc, test_fd_model_top1_and_dense);
    tcase_add_test(tc, test_fd_model_capacity);
    suite_add_tcase(s, tc);
    /* chapter 01: the whole model's gradients through the default router and its aux loss */
    TCase *ch01 = tcase_create("ch01");
    tcase_set_tags(ch01, "ch01");
    tcase_set_timeout(ch01, 300);
    tcase_add_test(ch01, test_fd_model_softmax_no_shared);
    suite_add_tcase(s, ch01);
    /* chapter 03: the grouped GEMM in the model */
    TCase *ch03 = tcase_create("ch03");
    tcase_set_tags(ch03, "ch03");
    tcase_set_timeout(ch03, 300);
    tcase_add_test(ch03, test_fd_model_grouped);
    suite_add_tcase(s, ch03);
    return s;
}
