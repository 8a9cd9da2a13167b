/*
 * Checkpoints under MPI (CPU ranks; GPU ranks with MOE_TEST_DEVICE=cuda):
 *  - resume is exact: W ranks at EP W train N steps; the same run saved at N/2, freed and
 *    loaded by a new trainer gives the same losses bit for bit;
 *  - another folding: a checkpoint saved by W ranks at EP W loads into one process (EP1)
 *    and into W ranks at EP1 (data-parallel experts), and one saved by one process loads
 *    into W ranks at EP W; the next step's loss is the one of the run continued without
 *    resharding (same operations in another order: 1e-5 relative on CPU ranks, as in
 *    tests/mpi_ep.c; 1e-3 on GPU ranks);
 *  - a missing rank file is a named error on every rank;
 *  - tensor parallelism (chapter 04): a dense model saved by W ranks at TP W with sequence
 *    parallelism (attention, FFN, embedding and LM head split) loads into one process, and
 *    one saved by one process loads into TP W + SP, each giving the next-step loss of the
 *    run continued without resharding (same bounds);
 *  - the distributed optimizer (chapter 04): saved by W ranks with
 *    --use-distributed-optimizer (the fp32 master weights and moments sharded), resumed the
 *    same way (two steps' losses, the moments and the master weights bit for bit), by one
 *    process and by W ranks without it, and one saved without it resumed with it (loss 1e-5,
 *    moments and master weights 1e-6 of their largest value); each loads exactly the saved
 *    master weights;
 *  - expert tensor parallelism (chapter 04): a checkpoint saved at ETP 2 x EP W/2 loads
 *    into one process (ETP 1 x EP 1), and the reverse, with the same next-step loss.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "checkpoint.h"
#include "dist_optimizer.h"
#include "helpers.h"
#include "suites.h"

#define CK_MPI "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2 " \
               "--seq-length 16 --micro-batch-size 2 --num-experts 8 --moe-router-topk 2 "    \
               "--moe-ffn-hidden-size 16 --ffn-hidden-size 32 --moe-layer-freq 0,1 "         \
               "--moe-shared-expert-intermediate-size 8 --moe-router-score-function sigmoid " \
               "--moe-router-enable-expert-bias --lr 3e-3 --lr-warmup-iters 2 "              \
               "--lr-decay-iters 16 "

static int on_gpu(void) { return moe_comm_device(moe_test_world()) == MOE_DEVICE_CUDA; }

/* A trainer at ETP @p etp x EP @p ep over @p world (NULL: one process), two micro-batches
 * per rank of W. */
static moe_trainer *make_experts(int etp, int ep, moe_comm *world) {
    const int W = moe_comm_size(moe_test_world());
    char flags[1200];
    snprintf(flags, sizeof flags, CK_MPI "--global-batch-size %d --expert-model-parallel-size "
             "%d --expert-tensor-parallel-size %d --device %s", 2 * 2 * W, ep, etp,
             on_gpu() ? "cuda" : "cpu");
    setenv("MOE_NO_DOWNLOAD", "1", 1);
    moe_config c;
    moe_error err;
    ck_assert_msg(moe_test_config(&c, flags, &err) == MOE_OK, "%s", err.msg);
    moe_trainer *t = NULL;
    ck_assert_msg(moe_trainer_create_dist(&t, &c, world, &err) == MOE_OK, "%s", err.msg);
    return t;
}

/* A trainer at EP @p ep (ETP 1). */
static moe_trainer *make(int ep, moe_comm *world) { return make_experts(1, ep, world); }

/* One directory for every rank: named after rank 0's pid. */
static void shared_dir(char *out, size_t cap, const char *name) {
    moe_comm *w = moe_test_world();
    long long pid = moe_comm_rank(w) == 0 ? (long long)getpid() : 0;
    moe_comm_host_all_reduce_sum(w, &pid, 1, MOE_DTYPE_I64);
    const char *tmp = getenv("TMPDIR");
    snprintf(out, cap, "%s/moe_mpi_%lld_%s", tmp && *tmp ? tmp : "/tmp", pid, name);
}

static void remove_shared(const char *dir) {
    moe_comm_barrier(moe_test_world());
    if (moe_comm_rank(moe_test_world()) == 0) {
        char cmd[700];
        snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
        ck_assert(system(cmd) == 0);
    }
}

static void save(moe_trainer *t, const char *dir) {
    moe_error err;
    ck_assert_msg(moe_checkpoint_save(t, dir, 0, &err) == MOE_OK, "%s", err.msg);
}

static void load(moe_trainer *t, const char *dir) {
    moe_error err;
    int loaded = 0;
    ck_assert_msg(moe_checkpoint_load(t, dir, 0, &loaded, &err) == MOE_OK, "%s", err.msg);
    ck_assert_int_eq(loaded, 1);
}

START_TEST(test_ckpt_resume_exact) {
    moe_comm *w = moe_test_world();
    const int W = moe_comm_size(w);
    char dir[600];
    shared_dir(dir, sizeof dir, "exact");
    double ref[6], got[6];
    moe_trainer *a = make(W, w);
    for (int i = 0; i < 6; i++)
        ref[i] = moe_test_step(a);
    moe_trainer_free(a);
    moe_trainer *b = make(W, w);
    for (int i = 0; i < 3; i++)
        moe_test_step(b);
    save(b, dir);
    moe_trainer_free(b);
    moe_trainer *c = make(W, w);
    load(c, dir);
    for (int i = 3; i < 6; i++)
        got[i] = moe_test_step(c);
    moe_trainer_free(c);
    for (int i = 3; i < 6; i++)
        ck_assert_msg(memcmp(&got[i], &ref[i], sizeof(double)) == 0,
                      "step %d at EP %d: %.17g resumed vs %.17g uninterrupted", i + 1, W, got[i],
                      ref[i]);
    remove_shared(dir);
}
END_TEST

static void check_close(double got, double want, const char *what) {
    const double tol = on_gpu() ? 1e-3 : 1e-5;
    ck_assert_msg(fabs(got - want) <= tol * fabs(want), "%s: next-step loss %.9g, continued "
                  "without resharding %.9g", what, got, want);
}

/* A trainer in one of a test's two layouts: @p dist the W-rank one over the world, else one
 * process (every rank runs the same single-process trainer). */
typedef moe_trainer *(*layout_fn)(int dist);

/* A trainer in layout @p dist takes two steps and is saved to @p dir (a single-process one
 * by rank 0 alone); returns its next step's loss, which a trainer that loads @p dir must
 * reproduce. */
static double save_after_two(layout_fn mk, int dist, const char *dir) {
    moe_comm *w = moe_test_world();
    moe_trainer *t = mk(dist);
    moe_test_step(t);
    moe_test_step(t);
    if (dist || moe_comm_rank(w) == 0)
        save(t, dir);
    if (!dist)
        moe_comm_barrier(w);
    const double next = moe_test_step(t);
    moe_trainer_free(t);
    return next;
}

/* A trainer in layout @p dist loads @p dir; its next step's loss must be @p next. */
static void load_and_check(layout_fn mk, int dist, const char *dir, double next,
                           const char *what) {
    moe_trainer *t = mk(dist);
    load(t, dir);
    check_close(moe_test_step(t), next, what);
    moe_trainer_free(t);
}

/* Saved in the W-rank layout @p name and loaded by one process, then saved by one process
 * and loaded in that layout: each gives the next-step loss of the run continued without
 * resharding. */
static void reshard_both_ways(layout_fn mk, const char *name, const char *dir,
                              const char *dir1) {
    char what[200];
    const double next = save_after_two(mk, 1, dir);
    snprintf(what, sizeof what, "%s -> one process", name);
    load_and_check(mk, 0, dir, next, what);
    const double next1 = save_after_two(mk, 0, dir1);
    snprintf(what, sizeof what, "one process -> %s", name);
    load_and_check(mk, 1, dir1, next1, what);
}

/* EP W over the world, or EP 1 in one process */
static moe_trainer *ep_layout(int dist) {
    return dist ? make(moe_comm_size(moe_test_world()), moe_test_world()) : make(1, NULL);
}


START_TEST(test_ckpt_reshard) {
    moe_comm *w = moe_test_world();
    const int W = moe_comm_size(w);
    char dir[600], dir1[600];
    shared_dir(dir, sizeof dir, "reshard");
    shared_dir(dir1, sizeof dir1, "reshard1");

    /* EP W -> one process (EP1), and -> W ranks at EP1; one process -> EP W */
    const double next = save_after_two(ep_layout, 1, dir);
    load_and_check(ep_layout, 0, dir, next, "EP W -> one process");
    moe_trainer *dp = make(1, w);
    load(dp, dir);
    check_close(moe_test_step(dp), next, "EP W -> W ranks at EP 1");
    moe_trainer_free(dp);
    const double next1 = save_after_two(ep_layout, 0, dir1);
    load_and_check(ep_layout, 1, dir1, next1, "one process -> EP W");

    /* a missing rank file: every rank reports it */
    if (W > 1) {
        moe_comm_barrier(w);
        if (moe_comm_rank(w) == 0) {
            char path[700];
            snprintf(path, sizeof path, "%s/iter_0000002/rank_%05d.moeckpt", dir, W - 1);
            ck_assert_int_eq(unlink(path), 0);
        }
        moe_comm_barrier(w);
        moe_trainer *t = make(W, w);
        moe_error err;
        int loaded = 0;
        moe_status s = moe_checkpoint_load(t, dir, 0, &loaded, &err);
        ck_assert_msg(s == MOE_ERR_IO && strstr(err.msg, "missing shard"), "%d: %s", s, err.msg);
        ck_assert_int_eq(t->step, 0);
        moe_trainer_free(t);
    }
    remove_shared(dir);
    remove_shared(dir1);
}
END_TEST

#define CK_TP "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --num-query-groups 4 " \
              "--seq-length 16 --micro-batch-size 2 --num-experts 0 --ffn-hidden-size 32 "   \
              "--make-vocab-size-divisible-by 4 --lr 3e-3 --lr-warmup-iters 2 "             \
              "--lr-decay-iters 16 "

/* A dense trainer at TP @p tp (+ SP when tp > 1) over @p world (NULL: one process), with
 * the same global batch for every folding. */
static moe_trainer *make_tp(int tp, moe_comm *world) {
    const int W = moe_comm_size(moe_test_world());
    char flags[1200];
    snprintf(flags, sizeof flags, CK_TP "--global-batch-size %d --tensor-model-parallel-size %d %s",
             2 * 2 * W, tp, tp > 1 ? "--sequence-parallel" : "");
    return moe_test_trainer(flags, world, on_gpu());
}

/* TP W with SP over the world, or TP 1 in one process */
static moe_trainer *tp_layout(int dist) {
    return dist ? make_tp(moe_comm_size(moe_test_world()), moe_test_world()) : make_tp(1, NULL);
}

START_TEST(test_ckpt_tensor_parallel) {
    moe_comm *w = moe_test_world();
    if (moe_comm_size(w) == 1)
        return; /* TP needs two ranks at least */
    char dir[600], dir1[600];
    shared_dir(dir, sizeof dir, "tp");
    shared_dir(dir1, sizeof dir1, "tp1");
    reshard_both_ways(tp_layout, "TP W + SP", dir, dir1);
    remove_shared(dir);
    remove_shared(dir1);
}
END_TEST

/* The distributed optimizer (chapter 04): a trainer at EP 1 over @p world (NULL: one
 * process), so DP = EDP = W, with or without --use-distributed-optimizer. */
static moe_trainer *make_zero(moe_comm *world, int zero) {
    const int W = moe_comm_size(moe_test_world());
    char flags[1200];
    snprintf(flags, sizeof flags, CK_MPI "--global-batch-size %d %s", 2 * 2 * W,
             zero ? "--use-distributed-optimizer" : "");
    return moe_test_trainer(flags, world, on_gpu());
}

/* Both AdamW moments, whole, on the host: under the distributed optimizer every rank holds
 * its pieces only, so they are all-gathered (collective over the trainer's groups). */
static float *whole_moments(moe_trainer *t) {
    const size_t n = t->model->table.total;
    float *host = malloc(sizeof(float) * 2 * n);
    ck_assert(host != NULL);
    for (int b = 0; b < 2; b++) {
        float *mine = b ? t->opt.v : t->opt.m;
        moe_error err;
        if (t->zero.n_runs)
            ck_assert_msg(moe_zero_gather_to_host(&t->zero, &t->opt, mine, n, MOE_DTYPE_F32,
                                                  host + b * n, &err) == MOE_OK, "%s", err.msg);
        else
            t->model->be->to_host(host + b * n, mine, sizeof(float) * n);
    }
    return host;
}

/* The whole fp32 master weights of @p t against @p want: bit for bit (@p exact), else within
 * @p tol of the largest |value|. Collective under the distributed optimizer. */
static void check_master(moe_trainer *t, const moe_real *want, int exact, double tol,
                         const char *what) {
    const size_t n = t->model->table.total;
    moe_real *got = moe_test_master(t);
    double top = 0, worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        top = fabs((double)want[i]) > top ? fabs((double)want[i]) : top;
        if (fabs((double)got[i] - want[i]) > worst)
            worst = fabs((double)got[i] - want[i]), at = i;
    }
    if (exact)
        ck_assert_msg(memcmp(got, want, sizeof(moe_real) * n) == 0, "%s: master weight %zu is "
                      "%.9g, want %.9g", what, at, (double)got[at], (double)want[at]);
    else
        ck_assert_msg(worst <= tol * top, "%s: master weight %zu is %.9g, want %.9g (error %.3g "
                      "of the largest %.3g, bound %g)", what, at, (double)got[at],
                      (double)want[at], worst, top, tol);
    free(got);
}

/* The moments after the next step against those of the run continued without resharding:
 * bit for bit where the arithmetic is the same (@p exact), else to @p tol of the largest
 * |value| of each moment (the gradients were summed in another order). */
static void check_moments(moe_trainer *t, const float *want, int exact, double tol,
                          const char *what) {
    const size_t n = t->model->table.total;
    float *got = whole_moments(t);
    for (int b = 0; b < 2; b++) {
        const float *g = got + b * n, *w = want + b * n;
        double top = 0, worst = 0;
        size_t at = 0;
        for (size_t i = 0; i < n; i++)
            top = fabs(w[i]) > top ? fabs(w[i]) : top;
        for (size_t i = 0; i < n; i++)
            if (fabs((double)g[i] - w[i]) > worst)
                worst = fabs((double)g[i] - w[i]), at = i;
        if (exact)
            ck_assert_msg(memcmp(g, w, sizeof(float) * n) == 0, "%s: AdamW %s differs at "
                          "element %zu: %.9g vs %.9g continued", what, b ? "v" : "m", at,
                          (double)g[at], (double)w[at]);
        else
            ck_assert_msg(worst <= tol * top, "%s: AdamW %s at element %zu: %.9g vs %.9g "
                          "continued (error %.3g of the largest %.3g, bound %g)", what,
                          b ? "v" : "m", at, (double)g[at], (double)w[at], worst, top, tol);
    }
    free(got);
}

/* @p t (in another layout than the one that saved) loads @p dir: exactly the @p saved master
 * weights, then one step gives the continued run's loss @p next and moments @p want, within
 * the reduction-order bounds. Returns @p t for more checks. */
static moe_trainer *resume_other(moe_trainer *t, const char *dir, const moe_real *saved,
                                 double next, const float *want, double tol, const char *what) {
    char as_loaded[200];
    snprintf(as_loaded, sizeof as_loaded, "%s, as loaded", what);
    load(t, dir);
    check_master(t, saved, 1, 0, as_loaded);
    check_close(moe_test_step(t), next, what);
    check_moments(t, want, 0, tol, what);
    return t;
}

/* Saved by W ranks with --use-distributed-optimizer (each rank holding the master weights and
 * moments of its pieces, the file them whole): resumed (a) the same way, (b) by one process
 * without it, (c) by W ranks without it; and (d) one saved by W ranks without it resumed with
 * it. Each loads exactly the saved master weights (gathered back from the pieces under the
 * distributed optimizer), and its next step's loss and moments are those of the run
 * continued without a checkpoint: bit for bit in (a) (two steps, and the master weights after
 * them), within the reduction-order bounds in (b), (c) and (d). In a world of one (the GPU run
 * of this suite) the pieces are whole runs: the same code paths, no communication. */
START_TEST(test_ckpt_distributed_optimizer) {
    moe_comm *w = moe_test_world();
    const int W = moe_comm_size(w);
    char dir[600], dir1[600];
    shared_dir(dir, sizeof dir, "zero");
    shared_dir(dir1, sizeof dir1, "zero1");
    moe_trainer *src = make_zero(w, 1);
    moe_test_step(src);
    moe_test_step(src);
    save(src, dir);
    moe_real *saved = moe_test_master(src);
    const double next = moe_test_step(src);
    float *want = whole_moments(src);
    const double next2 = moe_test_step(src);
    moe_real *want_master = moe_test_master(src);
    moe_trainer_free(src);
    const double tol = on_gpu() ? 1e-3 : 1e-6;

    moe_trainer *same = make_zero(w, 1);
    load(same, dir);
    check_master(same, saved, 1, 0, "ZeRO DP W -> the same, as loaded");
    const double got = moe_test_step(same);
    ck_assert_msg(memcmp(&got, &next, sizeof got) == 0, "ZeRO DP %d -> ZeRO DP %d: next-step "
                  "loss %.17g vs %.17g continued", W, W, got, next);
    check_moments(same, want, !on_gpu(), tol, "ZeRO DP W -> the same");
    const double got2 = moe_test_step(same);
    ck_assert_msg(memcmp(&got2, &next2, sizeof got2) == 0, "ZeRO DP %d -> ZeRO DP %d: second "
                  "step's loss %.17g vs %.17g continued", W, W, got2, next2);
    check_master(same, want_master, !on_gpu(), tol, "ZeRO DP W -> the same, after two steps");
    moe_trainer_free(same);

    moe_trainer_free(resume_other(make_zero(NULL, 0), dir, saved, next, want, tol,
                                  "ZeRO DP W -> one process"));
    moe_trainer_free(resume_other(make_zero(w, 0), dir, saved, next, want, tol,
                                  "ZeRO DP W -> DP W without it"));
    free(want);
    free(saved);
    free(want_master);

    /* (d) saved without the distributed optimizer, resumed with it: each rank keeps its
     * pieces of the file's master weights and moments */
    moe_trainer *plain = make_zero(w, 0);
    moe_test_step(plain);
    moe_test_step(plain);
    save(plain, dir1);
    saved = moe_test_master(plain);
    const double next1 = moe_test_step(plain);
    want = whole_moments(plain);
    want_master = moe_test_master(plain);
    moe_trainer_free(plain);
    moe_trainer *zero = resume_other(make_zero(w, 1), dir1, saved, next1, want, tol,
                                     "DP W -> ZeRO DP W");
    check_master(zero, want_master, 0, tol, "DP W -> ZeRO DP W, after the next step");
    moe_trainer_free(zero);
    free(want);
    free(saved);
    free(want_master);
    remove_shared(dir);
    remove_shared(dir1);
}
END_TEST

/* Expert tensor parallelism (chapter 04): a checkpoint saved at ETP 2 x EP W/2 (each expert
 * tensor split twice; the file holds each EP shard, assembled over its ETP ranks) loads into
 * one process (ETP 1 x EP 1), and one saved by one process loads into ETP 2 x EP W/2, each
 * giving the next-step loss of the run continued without resharding. */
static moe_trainer *etp_layout(int dist) {
    const int W = moe_comm_size(moe_test_world());
    return dist ? make_experts(2, W / 2, moe_test_world()) : make_experts(1, 1, NULL);
}

START_TEST(test_ckpt_expert_tensor_parallel) {
    moe_comm *w = moe_test_world();
    const int W = moe_comm_size(w);
    if (W == 1 || W % 2)
        return; /* ETP 2 needs two ranks at least */
    char dir[600], dir1[600];
    shared_dir(dir, sizeof dir, "etp");
    shared_dir(dir1, sizeof dir1, "etp1");
    reshard_both_ways(etp_layout, "ETP 2 x EP W/2", dir, dir1);
    remove_shared(dir);
    remove_shared(dir1);
}
END_TEST

Suite *suite_mpi_checkpoint(void) {
    Suite *s = suite_create("mpi-checkpoint");
    const TTest *const tests[] = {test_ckpt_resume_exact, test_ckpt_reshard};
    moe_test_tcase(s, "checkpoint", 300, tests, 2);
    const TTest *const tp_tests[] = {test_ckpt_tensor_parallel, test_ckpt_distributed_optimizer,
                                     test_ckpt_expert_tensor_parallel};
    tcase_set_tags(moe_test_tcase(s, "checkpoint-tp", 300, tp_tests, 3), "ch04");
    return s;
}
