/*
 * Expert parallelism is invisible to the math: under mpirun with W ranks, a run with
 * --expert-model-parallel-size EP (every EP dividing W) computes the same loss and the
 * same gradients as ONE process running every micro-batch of the step (the reference,
 * built inside each rank with no communicator). Checked for the all-to-all and the
 * allgather dispatchers, dropless and with a capacity (both drop policies, with padding),
 * and with every token routed to the same two experts (one rank receives everything,
 * the others nothing). On GPU ranks that share memory, both paths of the alltoall
 * dispatcher: the collective one and the fused kernels (--moe-alltoall-path).
 *
 * Bounds, fp32 on CPU ranks: the same operations in a different order (the all-reduce
 * sums per-rank partial gradients), so loss |Δ| ≤ 1e-5·|loss| and every gradient tensor
 * ‖Δ‖/‖ref‖ ≤ 1e-5. On GPU ranks (MOE_TEST_DEVICE=cuda, NCCL) activations are bf16 and
 * an expert sees its rows in a different order, so: loss 1e-3, gradients 2e-2.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "suites.h"
#include "trainer.h"

#define EP_SMALL "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2 " \
                 "--seq-length 16 --micro-batch-size 2 --num-experts 8 --moe-router-topk 2 "    \
                 "--moe-ffn-hidden-size 16 --ffn-hidden-size 32 --moe-layer-freq 0,1 "         \
                 "--moe-shared-expert-intermediate-size 8 "

static int on_gpu(void) { return moe_comm_device(moe_test_world()) == MOE_DEVICE_CUDA; }

static moe_trainer *make(const char *flags, moe_comm *world) {
    return moe_test_trainer(flags, world, on_gpu());
}

/* Route every token to experts 0 and 1 (sigmoid router, a large expert bias). */
static void force_two_experts(moe_trainer *t) {
    moe_model *m = t->model;
    const int E = m->cfg.num_experts;
    float *bias = calloc((size_t)m->cfg.num_layers * E, sizeof(float));
    ck_assert_ptr_nonnull(bias);
    for (int l = 0; l < m->cfg.num_layers; l++) {
        bias[l * E + 0] = 100.0f;
        bias[l * E + 1] = 90.0f;
    }
    m->be->from_host(m->expert_bias, bias, sizeof(float) * m->cfg.num_layers * E);
    free(bias);
}

#define AGREE MOE_TEST_AGREE

/* One step's loss and gradients, distributed vs the single-process reference. */
static void check_ep(const char *extra, int ep, int force) {
    moe_comm *world = moe_test_world();
    const int W = moe_comm_size(world), rank = moe_comm_rank(world);
    if (W % ep != 0)
        return;
    char flags[1024];
    /* two micro-batches per rank */
    snprintf(flags, sizeof flags, EP_SMALL "--global-batch-size %d --expert-model-parallel-size %d %s",
             2 * 2 * W, ep, extra);
    moe_trainer *dist = make(flags, world);
    snprintf(flags, sizeof flags, EP_SMALL "--global-batch-size %d %s", 2 * 2 * W, extra);
    moe_trainer *ref = make(flags, NULL);
    if (force) {
        force_two_experts(dist);
        force_two_experts(ref);
    }
    moe_step_stats sd, sr;
    moe_trainer_gradients(dist, &sd);
    moe_trainer_gradients(ref, &sr);
    const double tol_loss = on_gpu() ? 1e-3 : 1e-5, tol_grad = on_gpu() ? 2e-2 : 1e-5;
    AGREE(!(fabs(sd.loss - sr.loss) <= tol_loss * fabs(sr.loss)),
          "EP %d (%s): loss %.8f vs reference %.8f on rank %d", ep, extra, sd.loss, sr.loss, rank);
    AGREE(sd.dropped != sr.dropped, "EP %d (%s): dropped %lld vs %lld", ep, extra, sd.dropped,
          sr.dropped);
    if (strstr(extra, "capacity"))
        ck_assert_msg(sr.dropped > 0, "the capacity test should drop something");
    double worst;
    const char *worst_name;
    const long long bad = moe_test_compare_shards(dist, ref, tol_grad, &worst,
                                                  &worst_name);
    AGREE(bad, "EP %d (%s): %lld tensors differ (rank %d: worst %s, rel %.2e)", ep, extra, bad,
          rank, worst_name, worst);
    if (rank == 0)
        printf("  EP %d of %d ranks%s%s: loss %.6f = reference %.6f, dropped %lld, gradients "
               "match\n",
               ep, W, *extra ? ", " : "", extra, sd.loss, sr.loss, sd.dropped);
    moe_trainer_free(dist);
    moe_trainer_free(ref);
}

/* Whether these GPU ranks can take the fused path (said once; CPU ranks: never). */
static int fused_possible(void) {
    static int known = -1;
    if (known < 0) {
        char why[320];
        known = moe_comm_peer_access(moe_test_world(), why, sizeof why);
        if (on_gpu() && moe_comm_rank(moe_test_world()) == 0)
            printf("  fused alltoall path: %s%s\n", known ? "tested" : "skipped: ",
                   known ? "" : why);
    }
    return known;
}

START_TEST(test_ep_dropless) {
    for (int ep = 1; ep <= 4; ep *= 2) {
        check_ep("", ep, 0);
        if (fused_possible()) { /* "" took the fused path: the collective one explicitly */
            check_ep("--moe-alltoall-path fused", ep, 0);
            check_ep("--moe-alltoall-path collective", ep, 0);
            check_ep("--moe-alltoall-path collective --moe-expert-backend grouped", ep, 0);
        }
        check_ep("--moe-token-dispatcher-type allgather", ep, 0);
        /* chapter 03's grouped expert path: offsets uploaded from the dispatch plan */
        check_ep("--moe-expert-backend grouped", ep, 0);
        check_ep("--moe-expert-backend grouped --moe-token-dispatcher-type allgather", ep, 0);
    }
}
END_TEST

START_TEST(test_ep_capacity) {
    for (int ep = 1; ep <= 4; ep *= 2) {
        check_ep("--moe-expert-capacity-factor 1.0", ep, 0);
        check_ep("--moe-expert-capacity-factor 1.0 --moe-token-drop-policy position", ep, 0);
        check_ep("--moe-expert-capacity-factor 1.25 --moe-pad-expert-input-to-capacity", ep, 0);
        check_ep("--moe-expert-capacity-factor 1.0 --moe-token-dispatcher-type allgather", ep, 0);
        check_ep("--moe-expert-capacity-factor 1.0 --moe-expert-backend grouped", ep, 0);
        if (fused_possible()) {
            check_ep("--moe-expert-capacity-factor 1.0 --moe-alltoall-path fused", ep, 0);
            check_ep("--moe-expert-capacity-factor 1.0 --moe-alltoall-path collective", ep, 0);
        }
    }
}
END_TEST

START_TEST(test_ep_all_tokens_to_two_experts) {
    const char *sig = "--moe-router-score-function sigmoid --moe-router-enable-expert-bias";
    for (int ep = 1; ep <= 4; ep *= 2)
        check_ep(sig, ep, 1);
    char buf[256];
    /* top-1: every token on expert 0 — one expert (and one rank) receives everything */
    snprintf(buf, sizeof buf, "%s --moe-router-topk 1", sig);
    for (int ep = 1; ep <= 4; ep *= 2)
        check_ep(buf, ep, 1);
    snprintf(buf, sizeof buf, "%s --moe-token-dispatcher-type allgather", sig);
    for (int ep = 1; ep <= 4; ep *= 2)
        check_ep(buf, ep, 1);
    snprintf(buf, sizeof buf, "%s --moe-expert-capacity-factor 1.0", sig);
    for (int ep = 1; ep <= 4; ep *= 2)
        check_ep(buf, ep, 1);
    if (fused_possible()) {
        snprintf(buf, sizeof buf, "%s --moe-router-topk 1 --moe-alltoall-path collective", sig);
        for (int ep = 1; ep <= 4; ep *= 2)
            check_ep(buf, ep, 1);
    }
}
END_TEST

START_TEST(test_ep_training_tracks_reference) {
    moe_comm *world = moe_test_world();
    const int W = moe_comm_size(world);
    const int ep = W >= 2 ? 2 : 1;
    char flags[1024];
    snprintf(flags, sizeof flags,
             EP_SMALL "--global-batch-size %d --expert-model-parallel-size %d "
                      "--moe-router-score-function sigmoid --moe-router-enable-expert-bias",
             4 * W, ep);
    moe_trainer *dist = make(flags, world);
    snprintf(flags, sizeof flags,
             EP_SMALL "--global-batch-size %d --moe-router-score-function sigmoid "
                      "--moe-router-enable-expert-bias",
             4 * W);
    moe_trainer *ref = make(flags, NULL);
    for (int s = 0; s < 5; s++) {
        moe_step_stats a, b;
        moe_trainer_step(dist, &a, NULL);
        moe_trainer_step(ref, &b, NULL);
        const double tol = on_gpu() ? 2e-3 : 1e-4;
        AGREE(!(fabs(a.loss - b.loss) <= tol * fabs(b.loss)), "step %d: %.6f vs %.6f", s, a.loss,
              b.loss);
        AGREE(!(fabs(a.grad_norm - b.grad_norm) <= 10 * tol * b.grad_norm),
              "step %d: grad norm %.6f vs %.6f", s, a.grad_norm, b.grad_norm);
    }
    /* the expert bias, updated from globally summed counts, is the same everywhere */
    const int n = dist->cfg.num_layers * dist->cfg.num_experts;
    long long differ = 0;
    float *bd = malloc(sizeof(float) * n), *br = malloc(sizeof(float) * n);
    ck_assert(bd && br);
    moe_model_read_expert_bias(dist->model, bd);
    moe_model_read_expert_bias(ref->model, br);
    for (int i = 0; i < n && !on_gpu(); i++) /* bf16 may tip a count that is exactly at the mean */
        differ += bd[i] != br[i];
    free(bd);
    free(br);
    AGREE(differ, "%lld expert biases differ", differ);
    moe_trainer_free(dist);
    moe_trainer_free(ref);
}
END_TEST

START_TEST(test_ep_errors) {
    moe_comm *world = moe_test_world();
    const int W = moe_comm_size(world);
    moe_config c;
    moe_error err;
    moe_trainer *t = NULL;
    char flags[512];
    /* EP that does not divide the ranks */
    snprintf(flags, sizeof flags, EP_SMALL "--global-batch-size %d --expert-model-parallel-size %d",
             2 * W * 3, W == 1 ? 2 : W * 2 > 8 ? 3 : W * 2);
    ck_assert_int_eq(moe_test_config(&c, flags, &err), MOE_OK);
    moe_status s = moe_trainer_create_dist(&t, &c, world, &err);
    ck_assert_msg(s == MOE_ERR_CONFIG && strstr(err.msg, "--expert-model-parallel-size"), "%s",
                  err.msg);
    /* experts not divisible by EP */
    ck_assert_int_eq(moe_test_config(&c, EP_SMALL "--expert-model-parallel-size 3", &err), MOE_OK);
    s = moe_trainer_create_dist(&t, &c, world, &err);
    ck_assert_msg(s == MOE_ERR_CONFIG && strstr(err.msg, "--num-experts"), "%s", err.msg);
    /* a global batch that does not split over the ranks */
    if (W > 1) {
        snprintf(flags, sizeof flags, EP_SMALL "--global-batch-size %d", 2 * (W + 1));
        ck_assert_int_eq(moe_test_config(&c, flags, &err), MOE_OK);
        s = moe_trainer_create_dist(&t, &c, world, &err);
        ck_assert_msg(s == MOE_ERR_CONFIG && strstr(err.msg, "--global-batch-size"), "%s",
                      err.msg);
    }
    /* the fused path where the ranks share no memory */
    if (W > 1 && !fused_possible()) {
        snprintf(flags, sizeof flags,
                 EP_SMALL "--global-batch-size %d --expert-model-parallel-size %d "
                          "--moe-alltoall-path fused",
                 2 * W, W);
        ck_assert_int_eq(moe_test_config(&c, flags, &err), MOE_OK);
        s = moe_trainer_create_dist(&t, &c, world, &err);
        ck_assert_msg(s == MOE_ERR_CONFIG && strstr(err.msg, "--moe-alltoall-path fused") &&
                          strstr(err.msg, "collective"),
                      "%s", err.msg);
    }
    ck_assert(t == NULL);
}
END_TEST

Suite *suite_mpi_ep(void) {
    Suite *s = suite_create("mpi-ep");
    TCase *tc = tcase_create("ep");
    tcase_set_tags(tc, "ch02"); /* make check-ch02 runs these on 2 and 4 CPU ranks */
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_ep_dropless);
    tcase_add_test(tc, test_ep_capacity);
    tcase_add_test(tc, test_ep_all_tokens_to_two_experts);
    tcase_add_test(tc, test_ep_training_tracks_reference);
    tcase_add_test(tc, test_ep_errors);
    suite_add_tcase(s, tc);
    return s;
}
