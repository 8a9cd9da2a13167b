/*
 * Data parallelism and the global gradient norm (chapter 04). Under mpirun with W ranks:
 *
 *  - Gradient clipping sees the norm of the WHOLE model, every element counted once: a
 *    tensor split over TP or EP adds each shard once, a tensor every TP rank holds whole
 *    (norms, the router) and every replica over DP / EDP adds once, not once per copy. The
 *    classic bug counts a replicated tensor once per rank of its TP group (or of the world),
 *    which inflates the norm and over-clips. The check: with a clip far below the norm
 *    (--clip-grad 1e-3, so every step is clipped), each folding reports one process's norm
 *    and holds one process's clipped gradient (each rank's shard against that slice), and
 *    the weights after several steps are one process's.
 *  - Foldings: TP 2 (dense), TP 2 + SP, EP 2, attention TP 2 with experts EP 2, and on 4
 *    ranks attention TP 2 x DP 2 with experts EP 4, TP 4 + SP, EP 2 x EDP 2.
 *
 * Bounds, fp32 on CPU ranks (sums in another order): norm and first-step gradients 1e-5
 * relative, losses and weights after the later steps 1e-4 (AdamW divides by √v). On GPU
 * ranks (bf16 activations) 2e-2.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "helpers.h"
#include "memory.h"
#include "suites.h"
#include "trainer.h"

static int on_gpu(void) { return moe_comm_device(moe_test_world()) == MOE_DEVICE_CUDA; }

#define CLIP 1e-3

/* A dense model (TP without SP) and an MoE model whose first layer is dense (so a run holds
 * TP-split, TP-replicated and EP-split tensors at once), dropless. */
#define DENSE "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2 " \
              "--seq-length 16 --micro-batch-size 2 --num-experts 0 --ffn-hidden-size 32 "   \
              "--make-vocab-size-divisible-by 4 --qk-layernorm "
#define MOE "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --num-query-groups 4 "   \
            "--seq-length 16 --micro-batch-size 2 --num-experts 4 --moe-router-topk 2 "       \
            "--moe-ffn-hidden-size 16 --moe-shared-expert-intermediate-size 16 "               \
            "--moe-aux-loss-coeff 1e-2 --moe-layer-freq [0,1] --ffn-hidden-size 32 "           \
            "--make-vocab-size-divisible-by 4 "

/* One folding against one process: `steps` clipped AdamW steps; `extra` is appended to both
 * runs' flags, `dist_only` to the distributed one's (e.g. --use-distributed-optimizer). */
static void check_clip(const char *base, int tp, int sp, int ep, const char *dist_only,
                       int steps) {
    const int W = moe_comm_size(moe_test_world()), rank = moe_comm_rank(moe_test_world());
    char common[64];
    snprintf(common, sizeof common, "--lr 1e-2 --clip-grad %g", CLIP);
    moe_trainer *dist, *ref;
    if (!moe_test_folding(moe_test_world(), base, tp, sp, ep, common, dist_only, on_gpu(), &dist, &ref))
        return;
    const int zero = strstr(dist_only, "distributed-optimizer") != NULL;
    double norm = 0;
    const double tol = on_gpu() ? 2e-2 : 1e-5, tol_steps = on_gpu() ? 2e-2 : 1e-4;
    double worst;
    const char *worst_name;
    for (int s = 0; s < steps; s++) {
        moe_step_stats sd, sr;
        ck_assert_int_eq(moe_trainer_step(dist, &sd, NULL), MOE_OK);
        ck_assert_int_eq(moe_trainer_step(ref, &sr, NULL), MOE_OK);
        /* the clip is engaged: otherwise the norm's use is never tested */
        norm = sd.grad_norm;
        ck_assert_msg(sr.grad_norm > 10 * CLIP, "the reference's norm %g is not above the clip",
                      sr.grad_norm);
        MOE_TEST_AGREE(!(fabs(sd.grad_norm - sr.grad_norm) <= tol * sr.grad_norm),
                       "TP %d%s EP %d %s, step %d: gradient norm %.8f vs one process %.8f "
                       "(ratio %.4f)", tp, sp ? "+SP" : "", ep, dist_only, s + 1, sd.grad_norm,
                       sr.grad_norm, sd.grad_norm / sr.grad_norm);
        MOE_TEST_AGREE(!(fabs(sd.loss - sr.loss) <= (s ? tol_steps : tol) * fabs(sr.loss)),
                       "TP %d%s EP %d %s, step %d: loss %.8f vs %.8f", tp, sp ? "+SP" : "", ep,
                       dist_only, s + 1, sd.loss, sr.loss);
        /* after the first step: the clipped gradient (each rank's shard; under the
         * distributed optimizer a rank holds only its part of the reduced gradient, so the
         * weights carry the check) and the weights it gave */
        if (s == 0) {
            const long long bad = moe_test_compare_state(dist, ref, zero ? -1 : tol,
                                                         tol, &worst, &worst_name);
            MOE_TEST_AGREE(bad, "TP %d%s EP %d %s, after the first clipped step: %lld tensors "
                           "differ (rank %d: worst %s, rel %.2e)", tp, sp ? "+SP" : "", ep,
                           dist_only, bad, rank, worst_name, worst);
        }
    }
    const long long bad = moe_test_compare_state(dist, ref, -1, tol_steps, &worst,
                                                 &worst_name);
    MOE_TEST_AGREE(bad, "TP %d%s EP %d %s, weights after %d clipped steps: %lld tensors differ "
                   "(rank %d: worst %s, rel %.2e)", tp, sp ? "+SP" : "", ep, dist_only, steps,
                   bad, rank, worst_name, worst);
    /* The count itself: with every gradient element 1 the norm is √(parameters of the whole
     * model), whatever the folding. Real gradients of norms and routers are small next to the
     * matrices', so counting them twice moves the norm by 1e-4 only; here a tensor counted
     * once per replica shows at once. */
    {
        moe_model *m = dist->model;
        const size_t n = moe_model_num_params(m);
        moe_real *ones = malloc(sizeof(moe_real) * n);
        ck_assert(ones != NULL);
        for (size_t i = 0; i < n; i++)
            ones[i] = 1;
        m->be->from_host(m->grads, ones, sizeof(moe_real) * n);
        free(ones);
        moe_step_stats st = {0};
        moe_trainer_update(dist, &st);
        const double want = sqrt((double)moe_model_num_params(ref->model));
        MOE_TEST_AGREE(!(fabs(st.grad_norm - want) <= 1e-9 * want),
                       "TP %d%s EP %d %s: with every gradient 1 the norm is %.6f, not "
                       "sqrt(%zu parameters) = %.6f: some tensor is counted %s", tp,
                       sp ? "+SP" : "", ep, dist_only, st.grad_norm,
                       moe_model_num_params(ref->model), want,
                       st.grad_norm > want ? "more than once" : "not at all");
    }
    if (rank == 0)
        printf("  TP %d x DP %d%s, EP %d x EDP %d %s: clipped norm %.6f = one process's, "
               "weights equal after %d steps\n", tp, W / tp, sp ? " + SP" : "", ep, W / ep,
               dist_only, norm, steps);
    moe_trainer_free(dist);
    moe_trainer_free(ref);
}

START_TEST(test_grad_norm_folded) {
    const int W = moe_comm_size(moe_test_world());
    check_clip(DENSE, 2, 0, 1, "", 3);       /* TP 2: norms and QK-norm replicated over TP */
    check_clip(MOE, 2, 1, 1, "", 3);         /* TP 2 + SP; experts replicated (EDP = W) */
    check_clip(MOE, 1, 0, 2, "", 3);         /* EP 2: experts split, the rest over DP */
    check_clip(MOE, 2, 1, 2, "", 3);         /* attention TP 2, experts EP 2 */
    if (W >= 4) {
        check_clip(MOE, 2, 1, 4, "", 3);     /* attention TP 2 x DP 2, experts EP 4 */
        check_clip(MOE, 4, 1, 2, "", 3);     /* TP 4 + SP, experts EP 2 x EDP 2 */
    }
}
END_TEST

/* ZeRO-1 is invisible to the math: the same foldings with --use-distributed-optimizer give
 * one process's clipped norms, losses and weights (each rank updates only its piece of
 * every gradient group, and gathers the others'), and each rank's moments are its share. */
START_TEST(test_distributed_optimizer) {
    const int W = moe_comm_size(moe_test_world());
    const char *z = "--use-distributed-optimizer";
    check_clip(MOE, 1, 0, 2, z, 3);          /* DP 2 (EDP 1 on 2 ranks, EDP 2 on 4) */
    check_clip(MOE, 1, 0, 1, z, 3);          /* DP = EDP = W */
    check_clip(DENSE, 2, 0, 1, z, 3);        /* TP 2 (x DP 2 on 4 ranks) */
    if (W >= 4)
        check_clip(MOE, 2, 1, 4, z, 3);      /* attention TP 2 x DP 2, experts EP 4 */
    /* the moments: this rank's pieces, Σ over a gradient group = the whole run. Twice: the
     * MoE model, and one of hidden size 34 with one head, whose dense run (170 norm elements
     * beside matrices of multiples of 4) does not divide by 4, so the pieces are uneven */
    static const char *const models[] = {MOE, MOE " --hidden-size 34 --num-attention-heads 1 "
                                              "--num-query-groups 1"};
    for (int v = 0; v < 2; v++) {
        char flags[1024];
        snprintf(flags, sizeof flags, "%s --global-batch-size %d %s", models[v], 4 * W, z);
        moe_trainer *t = moe_test_trainer(flags, moe_test_world(), on_gpu());
        size_t whole = 0;
        int uneven = 0;
        for (int r = 0; r < t->zero.n_runs; r++) {
            const moe_zero_run *run = &t->zero.run[r];
            long long mine = (long long)(run->piece.hi - run->piece.lo);
            if (run->comm)
                moe_comm_host_all_reduce_sum(run->comm, &mine, 1, MOE_DTYPE_I64);
            MOE_TEST_AGREE(mine != (long long)run->len, "run %d: the pieces cover %lld of %zu "
                           "elements", r, mine, run->len);
            whole += run->len;
            uneven |= run->len % (size_t)run->size != 0;
            ck_assert(run->piece.hi - run->piece.lo <= run->chunk);
        }
        ck_assert_uint_eq(whole, moe_model_num_params(t->model));
        ck_assert(W == 1 || t->opt.n < moe_model_num_params(t->model));
        /* the fp32 master weights are the optimizer's, as many as its moments (the sum of
         * this rank's pieces, 1/W of the parameters give or take the rounding); the model
         * holds only the compute copy, whole */
        long long pieces = 0;
        for (int k = 0; k < t->opt.n_pieces; k++)
            pieces += (long long)(t->opt.piece[k].hi - t->opt.piece[k].lo);
        ck_assert_msg(t->opt.master && !t->model->params && t->model->wact &&
                          t->model->master_sharded && (long long)t->opt.n == pieces,
                      "the master weights must live in the optimizer's %lld piece elements "
                      "(opt.n %zu, master %p, model params %p)", pieces, t->opt.n,
                      (void *)t->opt.master, (void *)t->model->params);
        ck_assert_msg(!(v == 1 && W == 4) || uneven, "the second model's runs divide by 4: "
                      "the rounding of the pieces goes untested");
        /* the memory estimate (memory.h) counts exactly these pieces: Σ ⌈run / size⌉
         * moments (a rank's piece is that long, the last of a group's may be shorter) and
         * the staging buffer the layout allocated */
        moe_memory_estimate e;
        moe_error err;
        const moe_model *md = t->model;
        ck_assert_int_eq(moe_memory_estimate_rank(&md->cfg, md->max_B, &t->par.grid,
                                                  md->be->act_size, &e, &err), MOE_OK);
        long long chunks = 0;
        for (int r = 0; r < t->zero.n_runs; r++)
            chunks += (long long)t->zero.run[r].chunk;
        const long long wbytes = e.params * (long long)md->be->act_size +
                                 chunks * (long long)sizeof(moe_real);
        MOE_TEST_AGREE(e.optim_elems != chunks ||
                           e.params != (long long)moe_model_num_params(md) ||
                           (long long)t->opt.n > e.optim_elems ||
                           e.zero_staging_bytes != (long long)t->zero.scratch_bytes ||
                           e.optim_bytes != 8 * chunks + (long long)t->zero.scratch_bytes ||
                           e.weight_bytes != wbytes,
                       "distributed optimizer on %d ranks (model %d): the estimate keeps "
                       "moments of %lld parameters and %lld staging bytes, the layout's pieces "
                       "are %lld long (this rank's: %zu) with %zu staging bytes; weights %lld "
                       "bytes, want %lld (the whole compute copy and the master pieces)", W, v,
                       e.optim_elems, e.zero_staging_bytes, chunks, t->opt.n,
                       t->zero.scratch_bytes, e.weight_bytes, wbytes);
        moe_trainer_free(t);
    }
}
END_TEST

/* The sharded master weights change nothing: the same DP run with and without
 * --use-distributed-optimizer gives the same losses, and after 4 steps the same fp32 master
 * weights (gathered from the pieces: moe_trainer_master_to_host) and the same compute copy on
 * every rank. The gradients are summed by a reduce-scatter instead of an all-reduce, which
 * may add in another order (on 4 CPU ranks the weights then move by ~1e-6, AdamW dividing by
 * √v): 1e-5 relative on CPU ranks. In a world of one (the GPU run of
 * this suite) no sum is taken, and everything must agree bit for bit, the bf16 compute copy
 * included (cast from each piece, then gathered, against cast from the whole master). */
START_TEST(test_sharded_master_matches_plain_dp) {
    const int W = moe_comm_size(moe_test_world()), rank = moe_comm_rank(moe_test_world());
    char flags[1024];
    snprintf(flags, sizeof flags, "%s --global-batch-size %d --lr 1e-2", MOE, 4 * W);
    moe_trainer *plain = moe_test_trainer(flags, moe_test_world(), on_gpu());
    strcat(flags, " --use-distributed-optimizer");
    moe_trainer *zero = moe_test_trainer(flags, moe_test_world(), on_gpu());
    ck_assert(zero->opt.master && !plain->opt.master);
    const int exact = W == 1;
    const double tol = 1e-5;
    const size_t n = moe_model_num_params(plain->model);
    moe_real *a = moe_test_master(plain), *b = moe_test_master(zero);
    MOE_TEST_AGREE(memcmp(a, b, sizeof(moe_real) * n) != 0,
                   "the initial master weights differ with the distributed optimizer");
    free(a);
    free(b);
    for (int s = 0; s < 4; s++) {
        const double lp = moe_test_step(plain), lz = moe_test_step(zero);
        MOE_TEST_AGREE(exact ? memcmp(&lp, &lz, sizeof lp) != 0
                             : !(fabs(lp - lz) <= tol * fabs(lp)),
                       "step %d on %d ranks: loss %.17g without the distributed optimizer, "
                       "%.17g with it", s + 1, W, lp, lz);
    }
    a = moe_test_master(plain);
    b = moe_test_master(zero);
    double worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        const double d = fabs((double)a[i] - b[i]) / (fabs((double)a[i]) + 1e-3);
        if (!(d <= worst))
            worst = d, at = i;
    }
    MOE_TEST_AGREE(exact ? memcmp(a, b, sizeof(moe_real) * n) != 0 : !(worst <= tol),
                   "after 4 steps on %d ranks the master weights differ (rank %d: element %zu "
                   "%.9g without, %.9g with the distributed optimizer)", W, rank, at,
                   (double)a[at], (double)b[at]);
    /* the compute copies every rank computes with, whole on every rank */
    const moe_backend *be = plain->model->be;
    moe_real *ca = malloc(sizeof(moe_real) * n), *cb = malloc(sizeof(moe_real) * n);
    ck_assert(ca && cb);
    be->read_act(ca, plain->model->wact, n);
    be->read_act(cb, zero->model->wact, n);
    long long differ = 0;
    for (size_t i = 0; i < n; i++)
        differ += exact ? ca[i] != cb[i]
                        : !(fabs((double)ca[i] - cb[i]) <= tol * (fabs((double)ca[i]) + 1e-3));
    MOE_TEST_AGREE(differ, "after 4 steps on %d ranks %lld compute weights differ (rank %d)", W,
                   differ, rank);
    if (rank == 0)
        printf("  DP %d, %s: 4 steps with the master sharded over the ranks = without (%s; "
               "master worst rel %.2e)\n", W, on_gpu() ? "GPU" : "CPU",
               exact ? "bit for bit" : "to 1e-5", worst);
    free(a);
    free(b);
    free(ca);
    free(cb);
    moe_trainer_free(plain);
    moe_trainer_free(zero);
}
END_TEST

/* The overflow protocol over ranks (chapter 06): sync-free MoE layers (our grouped kernel or
 * its CPU twin, one EP rank, dropless) with half the rows they need, on every DP rank. Each
 * rank raises MOE_STEP_OVERFLOW; the trainer sums the flags over the world on the device
 * (2 on two ranks: the finalize must turn the sum back into the overflow bit, or the step
 * would read as non-finite), every rank grows its budget and re-runs the step once, and the
 * run's losses are those of one process that overflowed and re-ran the same way. Today every
 * rank overflows alike (dropless on one EP rank: N·k rows each, whatever the routing), so
 * this proves the sum and its normalisation, not that one rank's overflow alone brings the
 * others along (that needs the budget under EP, not built yet). */
#define SYNC_FREE_DP "--num-layers 2 --hidden-size 32 --num-attention-heads 4 "              \
                     "--num-query-groups 2 --seq-length 16 --micro-batch-size 2 "             \
                     "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 "          \
                     "--ffn-hidden-size 64 --moe-expert-backend grouped "                     \
                     "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "   \
                     "--moe-aux-loss-coeff 0 --lr 3e-3 --lr-warmup-iters 2 --train-iters 10 " \
                     "--moe-expert-rank-capacity-factor 0.5"

START_TEST(test_overflow_rerun_over_ranks) {
    const int W = moe_comm_size(moe_test_world()), rank = moe_comm_rank(moe_test_world());
    moe_trainer *dist, *ref;
    if (W < 2 || !moe_test_folding(moe_test_world(), SYNC_FREE_DP, 1, 0, 1, "", "", on_gpu(),
                                   &dist, &ref))
        return;
    ck_assert_msg(moe_model_may_overflow(dist->model), "the budget of half the rows must be "
                  "able to overflow (else the flags are not summed and nothing is tested)");
    const double tol = on_gpu() ? 1e-3 : 1e-5;
    for (int s = 0; s < 3; s++) {
        moe_step_stats sd, sr;
        moe_error err;
        ck_assert_msg(moe_trainer_step(dist, &sd, &err) == MOE_OK, "rank %d step %d: %s", rank,
                      s, err.msg);
        ck_assert_msg(moe_trainer_step(ref, &sr, &err) == MOE_OK, "one process, step %d: %s", s,
                      err.msg);
        MOE_TEST_AGREE(!(fabs(sd.loss - sr.loss) <= tol * fabs(sr.loss)),
                       "step %d: loss %.9g on %d ranks, %.9g in one process", s, sd.loss, W,
                       sr.loss);
    }
    MOE_TEST_AGREE(dist->reruns != 1 || ref->reruns != 1,
                   "re-runs: %d on rank %d, %d in one process (want 1 and 1)", dist->reruns,
                   rank, ref->reruns);
    if (rank == 0)
        printf("  DP %d, budget half the rows: one overflow, one re-run on every rank, losses = "
               "one process's for 3 steps\n", W);
    moe_trainer_free(dist);
    moe_trainer_free(ref);
}
END_TEST

Suite *suite_mpi_dp(void) {
    Suite *s = suite_create("mpi_dp");
    TCase *tc = tcase_create("data_parallel");
    tcase_set_tags(tc, "ch04");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_grad_norm_folded);
    tcase_add_test(tc, test_distributed_optimizer);
    tcase_add_test(tc, test_sharded_master_matches_plain_dp);
    tcase_add_test(tc, test_overflow_rerun_over_ranks);
    suite_add_tcase(s, tc);
    return s;
}
