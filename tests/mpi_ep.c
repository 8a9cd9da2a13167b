/*
 * Expert parallelism is invisible to the math: under mpirun with W ranks, a run with
 * --expert-model-parallel-size EP (every EP dividing W) computes the same loss and the
 * same gradients as ONE process running every micro-batch of the step (the reference,
 * built inside each rank with no communicator). Checked for the all-to-all and the
 * allgather dispatchers, dropless and with a capacity (both drop policies, with padding),
 * and with every token routed to the same two experts (one rank receives everything,
 * the others nothing). On GPU ranks that share memory, both paths of the alltoall
 * dispatcher: the collective one and the fused kernels (--moe-alltoall-path); on CPU ranks
 * the fused path runs as its twin over MPI one-sided windows. Chapter 06: the fused
 * dispatcher's plan made on the device (sync-free) against the host's plan bit for bit,
 * and its overflow protocol (every token on one rank, a small budget: re-runs, then the
 * same losses and weights as an ample budget).
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

#include "bench.h"
#include "graph.h"
#include "helpers.h"
#include "parallel.h"
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

/* Chapter 06's sync-free EP path: the fused dispatcher (on CPU ranks its twin over MPI
 * windows) with our grouped kernel; the plan is made on the device (dispatch_fused.c). A
 * budget of 4·N·k expert-side rows holds everything up to EP = 4. */
#define SYNC_FREE_EP "--moe-alltoall-path fused --moe-expert-backend grouped " \
                     "--moe-expert-rank-capacity-factor 4"

/* One step's loss and gradients, distributed vs the single-process reference. */
static void check_ep(const char *extra, int ep, int force) {
    moe_comm *world = moe_test_world();
    const int W = moe_comm_size(world), rank = moe_comm_rank(world);
    if (W % ep != 0)
        return;
    char flags[1024];
    /* two micro-batches per rank */
    snprintf(flags, sizeof flags,
             EP_SMALL "--global-batch-size %d --expert-model-parallel-size %d %s",
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
    if (strstr(extra, "--moe-expert-capacity-factor"))
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
            /* chapter 06: the fused dispatcher planned on the device (sync-free), with a
             * budget that holds every row (EP·N·k) */
            check_ep(SYNC_FREE_EP, ep, 0);
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
        snprintf(buf, sizeof buf, "%s " SYNC_FREE_EP, sig);
        for (int ep = 1; ep <= 4; ep *= 2)
            check_ep(buf, ep, 1);
    }
}
END_TEST

/* Bitwise: one rank's gradients (its own layout) of two trainers with the same layout. */
static long long grads_differ(const moe_trainer *a, const moe_trainer *b) {
    const size_t n = moe_model_num_params(a->model);
    ck_assert_int_eq((long long)n, (long long)moe_model_num_params(b->model));
    moe_real *ga = malloc(sizeof(moe_real) * (n ? n : 1));
    moe_real *gb = malloc(sizeof(moe_real) * (n ? n : 1));
    ck_assert(ga && gb);
    a->model->be->to_host(ga, a->model->grads, sizeof(moe_real) * n);
    b->model->be->to_host(gb, b->model->grads, sizeof(moe_real) * n);
    long long bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += memcmp(&ga[i], &gb[i], sizeof(moe_real)) != 0;
    free(ga);
    free(gb);
    return bad;
}

/* Chapter 06: the plan made on the device (fused, sync-free) against the host's plan
 * (collective all-to-all-v) on the same ranks, with the same grouped kernel. The expert side
 * is the same [local expert][source rank] layout and the combine the same unpermute_sum, so
 * on CPU ranks the loss and every gradient agree bit for bit (on GPU ranks the two paths
 * sum in different places: within check_ep's bounds). Random routing and every token on
 * experts 0 and 1 (one rank receives everything). */
START_TEST(test_ep_sync_free_matches_host_plan) {
    moe_comm *world = moe_test_world();
    const int W = moe_comm_size(world), rank = moe_comm_rank(world);
    if (W < 2 || !fused_possible())
        return;
    const char *sig = "--moe-router-score-function sigmoid --moe-router-enable-expert-bias";
    for (int force = 0; force <= 1; force++) {
        char flags[1024];
        snprintf(flags, sizeof flags,
                 EP_SMALL "--global-batch-size %d --expert-model-parallel-size %d %s " SYNC_FREE_EP,
                 4 * W, W, force ? sig : "");
        moe_trainer *dev = make(flags, world);
        snprintf(flags, sizeof flags,
                 EP_SMALL "--global-batch-size %d --expert-model-parallel-size %d %s "
                          "--moe-alltoall-path collective --moe-expert-backend grouped",
                 4 * W, W, force ? sig : "");
        moe_trainer *host = make(flags, world);
        if (force) {
            force_two_experts(dev);
            force_two_experts(host);
        }
        moe_step_stats sd, sh;
        moe_trainer_gradients(dev, &sd);
        moe_trainer_gradients(host, &sh);
        /* the path really was the device plan (layer 1 is the MoE layer of EP_SMALL) */
        ck_assert_int_eq(dev->model->acts[1].moe.plan.sync_free, 1);
        ck_assert_int_eq(host->model->acts[1].moe.plan.sync_free, 0);
        if (!on_gpu()) {
            AGREE(sd.loss != sh.loss, "EP %d%s: loss %.17g (device plan) vs %.17g (host plan)",
                  W, force ? ", forced" : "", sd.loss, sh.loss);
            const long long bad = grads_differ(dev, host);
            AGREE(bad, "EP %d%s: %lld gradients differ between the device and the host plan",
                  W, force ? ", forced" : "", bad);
        }
        if (rank == 0)
            printf("  EP %d%s: device plan loss %.9g, host plan %.9g%s\n", W,
                   force ? " (every token on experts 0 and 1)" : "", sd.loss, sh.loss,
                   on_gpu() ? "" : ", gradients equal bit for bit");
        moe_trainer_free(dev);
        moe_trainer_free(host);
    }
}
END_TEST

/* Chapter 06's overflow protocol under EP: every token on experts 0 and 1, both on rank 0,
 * which receives EP·N·k rows. A budget of 0.5·N·k overflows there (and only there); the
 * flag is summed over the world, so every rank skips the update, grows its budget (a
 * collective re-registration of the symmetric buffers) and re-runs the step; after three
 * steps the losses and the weights are those of a run whose budget never overflowed, bit
 * for bit. */
START_TEST(test_ep_sync_free_overflow) {
    moe_comm *world = moe_test_world();
    const int W = moe_comm_size(world), rank = moe_comm_rank(world);
    if (W < 2 || !fused_possible())
        return;
    char flags[1024];
    const char *base = EP_SMALL "--moe-router-score-function sigmoid "
                                "--moe-router-enable-expert-bias --moe-alltoall-path fused "
                                "--moe-expert-backend grouped";
    snprintf(flags, sizeof flags, "%s --global-batch-size %d --expert-model-parallel-size %d "
             "--moe-expert-rank-capacity-factor 0.5", base, 4 * W, W);
    moe_trainer *small = make(flags, world);
    snprintf(flags, sizeof flags, "%s --global-batch-size %d --expert-model-parallel-size %d "
             "--moe-expert-rank-capacity-factor %d", base, 4 * W, W, W);
    moe_trainer *ample = make(flags, world);
    ck_assert_int_eq(ample->model->moe_budget_rows, ample->model->moe_budget_max);
    ck_assert_int_lt(small->model->moe_budget_rows, small->model->moe_budget_max);
    force_two_experts(small);
    force_two_experts(ample);
    for (int step = 0; step < 3; step++) {
        moe_step_stats ss, sa;
        moe_error err;
        ck_assert_msg(moe_trainer_step(small, &ss, &err) == MOE_OK, "%s", err.msg);
        ck_assert_msg(moe_trainer_step(ample, &sa, &err) == MOE_OK, "%s", err.msg);
        if (!on_gpu())
            AGREE(ss.loss != sa.loss, "step %d: loss %.17g after the re-runs, %.17g with an "
                  "ample budget", step, ss.loss, sa.loss);
        if (rank == 0)
            printf("  EP %d, every token on rank 0, step %d: loss %.9g (re-run) %.9g (ample), "
                   "budget %d of %d rows, %lld re-runs so far\n", W, step, ss.loss, sa.loss,
                   small->model->moe_budget_rows, small->model->moe_budget_max,
                   (long long)small->reruns);
    }
    /* 0.5 -> 1 -> ... -> EP times N·k: every doubling was one overflow and one re-run, all
     * in the first step */
    int grows = 0;
    for (int f = 1; f < 2 * W; f *= 2) /* 0.5·N·k doubled up to W·N·k: log2(2W) times */
        grows++;
    ck_assert_int_eq(small->model->moe_budget_rows, small->model->moe_budget_max);
    ck_assert_int_eq((int)small->reruns, grows);
    ck_assert_int_eq((int)ample->reruns, 0);
    moe_real *ps = moe_test_master(small), *pa = moe_test_master(ample);
    const size_t n = moe_model_num_params(small->model);
    long long bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += on_gpu() ? 0 : memcmp(&ps[i], &pa[i], sizeof(moe_real)) != 0;
    AGREE(bad, "%lld of %zu weights differ from the ample run after 3 steps", bad, n);
    free(ps);
    free(pa);
    moe_trainer_free(small);
    moe_trainer_free(ample);
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

/* Chapter 06: CUDA graphs under EP, on GPU ranks. With the sync-free EP path (the counts
 * all-gathered on the stream, the fused kernels, the plan made on the device) a whole MoE
 * layer (--cuda-graph-scope layer) and the whole step with its gradient all-reduces
 * (full_iteration) are captured once and replayed; 6 steps of replay give the losses and
 * the weights of 6 eager steps bit for bit, and the bytes each group counted are the same
 * (a replay adds what its capture counted: moe_comm_tally_replay). CPU ranks have no
 * graphs: skipped, and said so. */
#define EP_GPU "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 " \
               "--seq-length 64 --micro-batch-size 4 --num-experts 8 --moe-router-topk 2 "     \
               "--moe-ffn-hidden-size 64 --ffn-hidden-size 128 --moe-layer-freq 1 "           \
               "--moe-alltoall-path fused --moe-expert-backend grouped --lr 2e-3 "            \
               "--lr-warmup-iters 2 --train-iters 10 "

static unsigned long long group_bytes(moe_trainer *t, moe_group_kind g) {
    moe_comm *c = moe_parallel_group(&t->par, g);
    if (!c)
        return 0;
    const moe_comm_bytes b = moe_comm_bytes_sent(c);
    return moe_comm_bytes_data(&b);
}

START_TEST(test_ep_graph_replay_equals_eager) {
    moe_comm *world = moe_test_world();
    const int W = moe_comm_size(world), rank = moe_comm_rank(world);
    if (!on_gpu() || W < 2 || !fused_possible()) {
        if (rank == 0)
            printf("  CUDA graphs under EP: skipped (%s)\n",
                   !on_gpu() ? "CPU ranks have no graphs; MOE_TEST_DEVICE=cuda runs it"
                             : W < 2 ? "one rank" : "the GPUs share no memory");
        return;
    }
    const char *scopes[] = {"layer", "full_iteration"};
    for (int i = 0; i < 2; i++) {
        char flags[1024], graphed[1100];
        snprintf(flags, sizeof flags,
                 EP_GPU "--global-batch-size %d --expert-model-parallel-size %d",
                 8 * W, W);
        snprintf(graphed, sizeof graphed, "%s --cuda-graph-scope %s", flags, scopes[i]);
        moe_trainer *te = make(flags, world), *tg = make(graphed, world);
        for (int s = 0; s < 6; s++) {
            moe_step_stats a, b;
            moe_error err;
            ck_assert_msg(moe_trainer_step(te, &a, &err) == MOE_OK, "%s", err.msg);
            ck_assert_msg(moe_trainer_step(tg, &b, &err) == MOE_OK, "%s", err.msg);
            AGREE(memcmp(&a.loss, &b.loss, sizeof a.loss) != 0,
                  "scope %s, step %d: loss eager %.17g, graphed %.17g", scopes[i], s + 1, a.loss,
                  b.loss);
        }
        ck_assert_int_eq(te->model->acts[0].moe.plan.sync_free, 1);
        const size_t P = moe_model_num_params(te->model);
        moe_real *pe = malloc(sizeof(moe_real) * P), *pg = malloc(sizeof(moe_real) * P);
        ck_assert(pe && pg);
        te->model->be->to_host(pe, te->model->params, sizeof(moe_real) * P);
        tg->model->be->to_host(pg, tg->model->params, sizeof(moe_real) * P);
        long long diff = 0;
        for (size_t j = 0; j < P; j++)
            diff += memcmp(&pe[j], &pg[j], sizeof(moe_real)) != 0;
        AGREE(diff, "scope %s: %lld of %zu parameters differ after 6 steps", scopes[i], diff, P);
        const moe_graph_stats st = moe_graphs_stats(tg->model->graphs);
        ck_assert_msg(st.captures >= 1 && st.replays >= 4, "scope %s: %lld captures, %lld replays",
                      scopes[i], st.captures, st.replays);
        const moe_group_kind kinds[2] = {MOE_GROUP_EP, MOE_GROUP_DP_CP};
        for (int g = 0; g < 2; g++)
            AGREE(group_bytes(te, kinds[g]) != group_bytes(tg, kinds[g]),
                  "scope %s: group %d counted %llu bytes eager, %llu graphed", scopes[i], g,
                  group_bytes(te, kinds[g]), group_bytes(tg, kinds[g]));
        if (rank == 0)
            printf("  EP %d, scope %s: 6 steps replayed = eager bit for bit (losses, %zu "
                   "parameters, bytes counted); %lld captures, %lld replays\n",
                   W, scopes[i], P, st.captures, st.replays);
        free(pe);
        free(pg);
        moe_trainer_free(te);
        moe_trainer_free(tg);
    }
}
END_TEST

/* Chapter 05's FP8 dispatch (--moe-fp8-dispatch, dispatch_alltoall.c): under --fp8-recipe
 * blockwise the tokens cross the all-to-all as 1×128 codes and fp32 scales. Quantization per row
 * commutes with moving rows, so against the tokens travelling in the activation type
 * (--moe-fp8-dispatch off) the loss and every gradient are the same bit for bit, and both equal one
 * process (check_ep's bounds) — with the bf16 wgrad (MOE_FP8_WGRAD=0), whose x is the row-wise
 * QDQ'd value either way. Under the FP8 wgrad (blockwise's default) the experts' wgrad quantizes x
 * again along the tokens: from the received codes' values with the FP8 dispatch, from x itself
 * without (DeepSeek-V3's FP8 dispatch quantizes twice too). So there the loss is still the same bit
 * for bit (the forward), and a few of the routed experts' weight gradients differ in the last bits:
 * with power-of-two scales the two tilings give other values only where an element falls into its
 * block's subnormals (lowp.h). Both runs still equal one process within check_ep's bounds. One
 * micro-batch per rank, so the layer's last plan is the step's and the bytes the EP group counted
 * are exact: the activation-type run moves 2(S+R)·H·s + (S+R)·r per MoE layer (S, R: rows
 * sent to / received from the other ranks; the chapter 04 bytes model), the FP8 run
 * S·(H·s − H − 4·H/128) fewer (only the forward's tokens are quantized: the combine and the
 * whole backward stay in the activation type). */
#define FP8_EP "--num-layers 2 --hidden-size 128 --num-attention-heads 4 --num-query-groups 4 " \
               "--seq-length 16 --micro-batch-size 2 --num-experts 8 --moe-router-topk 2 "     \
               "--moe-ffn-hidden-size 128 --ffn-hidden-size 128 --moe-layer-freq 0,1 "         \
               "--fp8-format e4m3 --fp8-recipe blockwise --moe-alltoall-path collective "

static unsigned long long ep_a2a_bytes(moe_trainer *t) {
    const moe_comm_bytes b = moe_comm_bytes_sent(moe_parallel_group(&t->par, MOE_GROUP_EP));
    return b.bytes[MOE_COMM_OP_ALL_TO_ALL];
}

START_TEST(test_ep_fp8_dispatch) {
    moe_comm *world = moe_test_world();
    const int W = moe_comm_size(world), rank = moe_comm_rank(world);
    const char *backends[] = {"", "--moe-grouped-gemm "};
    for (int fw = 0; fw < 2; fw++) /* the bf16 wgrad, then the FP8 wgrad (read at make()) */
    for (int ep = 2; ep <= 4; ep *= 2) {
        if (W % ep != 0)
            continue;
        for (int b = 0; b < 2; b++) {
            moe_bench_env wg = moe_bench_env_set("MOE_FP8_WGRAD", fw ? "1" : "0");
            char flags[1024];
            snprintf(flags, sizeof flags,
                     FP8_EP "%s--global-batch-size %d --expert-model-parallel-size %d",
                     backends[b], 2 * W, ep);
            moe_trainer *fp8 = make(flags, world);
            ck_assert_msg(fp8->ep.fp8, "EP %d blockwise: the FP8 dispatch should be on", ep);
            strncat(flags, " --moe-fp8-dispatch off", sizeof flags - strlen(flags) - 1);
            moe_trainer *act = make(flags, world);
            ck_assert(!act->ep.fp8);
            snprintf(flags, sizeof flags, FP8_EP "%s--global-batch-size %d", backends[b], 2 * W);
            moe_trainer *ref = make(flags, NULL);
            /* (the two runs' EP groups may be the same communicator, the world's: each
             * counts its own step alone) */
            moe_step_stats sf, sa, sr;
            moe_comm_bytes_reset(moe_parallel_group(&fp8->par, MOE_GROUP_EP));
            moe_trainer_gradients(fp8, &sf);
            const unsigned long long got_fp8 = ep_a2a_bytes(fp8);
            moe_comm_bytes_reset(moe_parallel_group(&act->par, MOE_GROUP_EP));
            moe_trainer_gradients(act, &sa);
            const unsigned long long got_act = ep_a2a_bytes(act);
            moe_trainer_gradients(ref, &sr);
            AGREE(memcmp(&sf.loss, &sa.loss, sizeof sf.loss) != 0,
                  "EP %d: FP8 dispatch loss %.9f, activation-type %.9f on rank %d", ep, sf.loss,
                  sa.loss, rank);
            const long long diff = grads_differ(fp8, act);
            AGREE(!fw && diff, "EP %d %s: %lld gradients differ between the FP8 dispatch and "
                  "the activation-type one (rank %d)", ep, backends[b], diff, rank);
            /* the FP8 wgrad with the grouped backend: x quantized twice (above) */
            const int twice = fw && b == 1;
            const double tl = on_gpu() ? 1e-3 : 1e-5, tg = on_gpu() ? 2e-2 : 1e-5;
            AGREE(!(fabs(sf.loss - sr.loss) <= tl * fabs(sr.loss)),
                  "EP %d: loss %.8f vs one process %.8f on rank %d", ep, sf.loss, sr.loss, rank);
            double worst;
            const char *worst_name;
            const long long bad = moe_test_compare_shards(fp8, ref, tg, &worst, &worst_name);
            AGREE(bad, "EP %d FP8 dispatch: %lld tensors differ from one process (rank %d: "
                  "worst %s, rel %.2e)", ep, bad, rank, worst_name, worst);
            /* the bytes, from the plans of the one MoE layer */
            const moe_model *m = fp8->model;
            const unsigned long long H = (unsigned long long)m->cfg.hidden_size,
                                     s = m->be->act_size, r = sizeof(moe_real);
            unsigned long long want_act = 0, saved = 0;
            for (int l = 0; l < m->cfg.num_layers; l++) {
                if (!m->cfg.is_moe_layer[l])
                    continue;
                const moe_dispatch_plan *pf = &m->acts[l].moe.plan,
                                        *pa = &act->model->acts[l].moe.plan;
                unsigned long long S = 0, R = 0;
                for (int q = 0; q < ep; q++) {
                    ck_assert_int_eq((long long)pf->send_rows[q], (long long)pa->send_rows[q]);
                    if (q != fp8->ep.rank) {
                        S += pf->send_rows[q];
                        R += pf->recv_rows[q];
                    }
                }
                want_act += 2 * (S + R) * H * s + (S + R) * r;
                saved += S * (H * s - H - 4 * (H / 128));
            }
            AGREE(got_act != want_act, "EP %d: activation-type dispatch counted %llu bytes, the "
                  "model says %llu (rank %d)", ep, got_act, want_act, rank);
            AGREE(got_fp8 != want_act - saved, "EP %d: FP8 dispatch counted %llu bytes, expected "
                  "%llu = %llu - %llu (rank %d)", ep, got_fp8, want_act - saved, want_act, saved,
                  rank);
            if (rank == 0)
                printf("  EP %d of %d ranks, blockwise%s%s, %s wgrad: FP8 dispatch = "
                       "activation-type %s = one process (loss %.6f); all-to-all bytes %llu "
                       "vs %llu (%.2fx)\n",
                       ep, W, *backends[b] ? ", " : "", backends[b], fw ? "FP8" : "bf16",
                       twice ? "(the loss bit for bit)" : "bit for bit",
                       sf.loss, got_fp8, got_act,
                       (double)got_act / (double)(got_fp8 ? got_fp8 : 1));
            if (rank == 0 && twice)
                printf("    (%lld gradient values differ from the activation-type dispatch; the "
                       "worst tensor vs one process: %s, rel %.2e)\n",
                       diff, worst_name, worst);
            moe_trainer_free(fp8);
            moe_trainer_free(act);
            moe_trainer_free(ref);
            moe_bench_env_restore(&wg);
        }
    }
}
END_TEST

/* Chapter 05 on the expert side's other paths: with the FP8 wgrad and the tiled SwiGLU
 * forward (blockwise's defaults) the experts keep their input x as its token-wise FP8 copy
 * under the fused NVLink dispatcher and under ETP too.
 *  - Fused: the peers write the rows into the workspace's shared dye (one symmetric buffer
 *    for every MoE layer and for the backward's output gradients: moe_layer_xe()); no layer
 *    allocates its own. Three MoE layers: a peer's dispatch of the next layer writes into
 *    the buffer this rank's experts of the layer before read, which only the fused kernels'
 *    opening barrier orders (dispatch_nvlink.cu). The host plan (with a capacity) and the
 *    plan made on the device (chapter 06).
 *  - ETP 2: the rows gathered over the group go to the scratch ws->etp.dy (moe_etp_x()); the
 *    layer keeps neither them nor the rows the dispatcher delivered.
 * Against MOE_FP8_SAVE_T=0 (the bf16 rows kept, the copies made in the backward: the same
 * bits, lowp.h) the loss and every gradient agree bit for bit, and both equal one process
 * within check_ep's bounds (under ETP the gradients within 1e-1: moe_test_fp8_folding() in
 * tests/mpi_tp.c says why). Needs GPU ranks (the fused cases: that share memory) and our
 * native FP8 experts (Hopper). */
#define FP8_FUSED "--num-layers 3 --hidden-size 128 --num-attention-heads 4 --num-query-groups 4 " \
                  "--seq-length 16 --micro-batch-size 2 --num-experts 8 --moe-router-topk 2 "     \
                  "--moe-ffn-hidden-size 128 --ffn-hidden-size 128 --moe-layer-freq 1,1,1 "       \
                  "--fp8-format e4m3 --fp8-recipe blockwise --moe-expert-backend grouped "

START_TEST(test_ep_fp8_keeps_x_t) {
    moe_comm *world = moe_test_world();
    const int W = moe_comm_size(world), rank = moe_comm_rank(world);
    if (!on_gpu() || W < 2) {
        if (rank == 0)
            printf("  FP8, x kept as its copy on the fused path and with ETP: skipped: %s\n",
                   !on_gpu() ? "CPU ranks (the token-wise form is the CUDA experts')"
                             : "needs 2 GPU ranks");
        return;
    }
    /* the fused path's host plan (a capacity drops on the host), its plan made on the
     * device, ETP 2 */
    const struct {
        const char *name, *flags, *par; /* flags of both runs; of the distributed one */
        int ep, etp, sync_free;
    } cases[] = {
        {"the fused path, the host plan, a capacity",
         "--moe-alltoall-path fused --moe-expert-capacity-factor 1.0 ", "", W, 1, 0},
        {"the fused path, the device plan", SYNC_FREE_EP " ", "", W, 1, 1},
        /* (each rank's slice of the experts' width a multiple of the 128-wide blocks) */
        {"ETP 2", "--moe-ffn-hidden-size 256 ", "--expert-tensor-parallel-size 2 ", W / 2, 2,
         0},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
        const int etp = cases[ci].etp > 1;
        if (!etp && !fused_possible())
            continue;
        moe_trainer *kept, *rows, *ref;
        moe_step_stats sk, sr, s1;
        for (int seed = 1;; seed++) { /* (ETP: until the routing is one process's) */
            char flags[1024];
            snprintf(flags, sizeof flags, FP8_FUSED "%s%s--global-batch-size %d "
                     "--expert-model-parallel-size %d --seed %d", cases[ci].flags,
                     cases[ci].par, 2 * W, cases[ci].ep, seed);
            kept = make(flags, world);
            if (!(kept->model->lowp && kept->model->lowp->native)) {
                if (rank == 0)
                    printf("  FP8, x kept as its copy: skipped: not a Hopper GPU (our FP8 "
                           "grouped kernel is sm_90a only)\n");
                moe_trainer_free(kept);
                return;
            }
            moe_bench_env st = moe_bench_env_set("MOE_FP8_SAVE_T", "0");
            rows = make(flags, world);
            moe_bench_env_restore(&st); /* (latched by the model: lowp.h) */
            snprintf(flags, sizeof flags, FP8_FUSED "%s--global-batch-size %d --seed %d",
                     cases[ci].flags, 2 * W, seed);
            ref = make(flags, NULL);
            moe_trainer_gradients(kept, &sk);
            moe_trainer_gradients(rows, &sr);
            moe_trainer_gradients(ref, &s1);
            /* ETP sums fc2's partial outputs in bf16, which can tip a near-tied token of a
             * later layer to another expert (as in moe_test_folding()) */
            if (!etp || moe_test_routes_alike(world, kept, ref, seed, cases[ci].name))
                break;
            moe_trainer_free(kept);
            moe_trainer_free(rows);
            moe_trainer_free(ref);
        }
        ck_assert_int_eq(moe_model_keeps_x_t(kept->model), 1);
        ck_assert_int_eq(moe_model_keeps_x_t(rows->model), 0);
        for (int l = 0; l < kept->model->cfg.num_layers; l++) {
            const moe_layer_acts *a = &kept->model->acts[l].moe, *b = &rows->model->acts[l].moe;
            ck_assert_msg(!a->xe && !a->xe_sym.ptr, "layer %d allocated rows it does not keep", l);
            if (etp) { /* the gathered rows: the copy, or the bf16 rows */
                ck_assert_msg(!a->etp.x && b->etp.x && !b->xe && !a->gue && !b->acte,
                              "layer %d: ETP kept rows it does not read", l);
            } else {
                ck_assert_msg(a->plan.fused && b->plan.fused, "layer %d not fused", l);
                ck_assert_int_eq(a->plan.sync_free, cases[ci].sync_free);
                ck_assert_msg(b->xe && b->xe == b->xe_sym.ptr, "layer %d (bf16 rows) kept none",
                              l);
            }
        }
        AGREE(memcmp(&sk.loss, &sr.loss, sizeof sk.loss) != 0,
              "%s: loss %.9f keeping x's FP8 copy, %.9f keeping its rows (rank %d)",
              cases[ci].name, sk.loss, sr.loss, rank);
        const long long diff = grads_differ(kept, rows);
        AGREE(diff, "%s: %lld gradients differ between keeping x's FP8 copy and its rows "
              "(rank %d)", cases[ci].name, diff, rank);
        AGREE(sk.dropped != s1.dropped, "%s: dropped %lld vs one process %lld", cases[ci].name,
              sk.dropped, s1.dropped);
        AGREE(!(fabs(sk.loss - s1.loss) <= 1e-3 * fabs(s1.loss)),
              "%s: loss %.8f vs one process %.8f on rank %d", cases[ci].name, sk.loss, s1.loss,
              rank);
        double worst;
        const char *worst_name;
        /* under ETP on GPU ranks the bf16 partial sums, amplified by FP8 rounding, need a
         * looser bound (moe_test_fp8_folding() in tests/mpi_tp.c says why) */
        const double tol = etp ? 1e-1 : 2e-2;
        const long long bad = moe_test_compare_shards(kept, ref, tol, &worst, &worst_name);
        AGREE(bad, "%s, FP8: %lld tensors differ from one process beyond %.0e (rank %d: worst "
              "%s, rel %.2e)", cases[ci].name, bad, tol, rank, worst_name, worst);
        if (rank == 0)
            printf("  FP8 on %s, EP %d x ETP %d: x kept as its FP8 copy = its rows kept, bit "
                   "for bit (loss %.6f, dropped %lld) = one process (%.6f)\n", cases[ci].name,
                   cases[ci].ep, cases[ci].etp, sk.loss, sk.dropped, s1.loss);
        moe_trainer_free(kept);
        moe_trainer_free(rows);
        moe_trainer_free(ref);
    }
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
    /* chapter 05: the FP8 dispatch (CK_RUN_CASE=fp8_dispatch runs it alone) */
    tc = tcase_create("fp8_dispatch");
    tcase_set_tags(tc, "ch05");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_ep_fp8_dispatch);
    tcase_add_test(tc, test_ep_fp8_keeps_x_t);
    suite_add_tcase(s, tc);
    /* chapter 06: EP without the host (CK_RUN_CASE=sync_free runs these alone) */
    tc = tcase_create("sync_free");
    tcase_set_tags(tc, "ch06");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_ep_sync_free_matches_host_plan);
    tcase_add_test(tc, test_ep_sync_free_overflow);
    tcase_add_test(tc, test_ep_graph_replay_equals_eager);
    suite_add_tcase(s, tc);
    return s;
}
