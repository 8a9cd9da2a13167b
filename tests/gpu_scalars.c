/*
 * The step's scalars on the GPU (chapter 06): every new op of the op table against its CPU
 * twin, outputs poisoned first, and a CUDA training step's host waits counted.
 *
 *  - loss_accumulate, grad_norm_finalize: one-thread kernels running the MOE_HOSTDEV
 *    functions of step_scalars.h, so they must agree with the CPU BIT FOR BIT (same double
 *    operations in the same order), on random values, NaN and infinity included;
 *  - add_f64, expert_load_add (integer atomics) and expert_bias_update: exact as well;
 *  - adamw with a clip factor and the step flags: the clip is the in-place clip of chapters
 *    00–05 (the same float result), a raised flag leaves p, m and v untouched bit for bit;
 *  - to_host_async + wait_to_host: page-locked memory, the copy visible after the wait;
 *  - a step on the CUDA backend: zero to_host / read_act / synchronize, one wait_to_host per
 *    step (the step boundary). The MoE layer's own host reads (permute_index, the batch's
 *    from_host) belong to the sync-free layer's work and are reported, not asserted.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_ops.h"
#include "helpers.h"
#include "rng.h"
#include "suites.h"
#include "trainer.h"

static void *dev(const void *host, size_t bytes) {
    void *d = moe_cuda_alloc(bytes);
    ck_assert_ptr_nonnull(d);
    moe_cuda_from_host(d, host, bytes);
    return d;
}

static void get(void *host, const void *d, size_t bytes) { moe_cuda_to_host(host, d, bytes); }

/* the same double bit for bit, or both NaN (a NaN's payload is the hardware's) */
static int same(double a, double b) {
    return (isnan(a) && isnan(b)) || !memcmp(&a, &b, sizeof a);
}

/* a random double of either sign spanning a few decades */
static double rnd(uint64_t s, uint64_t i) {
    return (moe_rng_uniform(s, 7, i) - 0.5) * pow(10.0, 4.0 * moe_rng_uniform(s, 8, i) - 2.0);
}

START_TEST(test_gpu_scalar_ops) {
    const moe_backend *cpu = moe_backend_cpu();
    /* loss_accumulate: 200 random micro-batches into a random start, exactly the CPU */
    long long bad = 0;
    for (int r = 0; r < 200; r++) {
        double step[4], mb[3], got[4];
        for (int i = 0; i < 4; i++)
            step[i] = rnd(r, i);
        for (int i = 0; i < 3; i++)
            mb[i] = fabs(rnd(r, 10 + i));
        const int N = 1 + r * 37;
        const double accum = 1 + r % 9;
        double *d_step = dev(step, sizeof step), *d_mb = dev(mb, sizeof mb);
        moe_cuda_loss_accumulate(d_step, d_mb, N, accum);
        get(got, d_step, sizeof got);
        cpu->loss_accumulate(step, mb, N, accum);
        bad += memcmp(got, step, sizeof got) != 0;
        moe_cuda_free(d_step), moe_cuda_free(d_mb);
    }
    ck_assert_msg(bad == 0, "loss_accumulate: %lld of 200 differ from the CPU's bits", bad);
    /* grad_norm_finalize: random squares, clip on/off, the check on/off, bad values */
    bad = 0;
    for (int r = 0; r < 200; r++) {
        moe_step_scalars s, g;
        memset(&s, 0xA5, sizeof s); /* poison: every field the op writes must be written */
        for (int i = 0; i < MOE_STEP_NORM_SLOTS; i++)
            s.sumsq[i] = r % 3 ? fabs(rnd(r, 20 + i)) : 0.0;
        s.step[0] = rnd(r, 40);
        s.flags = r % 5 == 0 ? MOE_STEP_OVERFLOW : 0;
        if (r % 17 == 3)
            s.sumsq[r % MOE_STEP_NORM_SLOTS] = NAN;
        if (r % 19 == 4)
            s.step[0] = INFINITY;
        const double max_norm = r % 4 == 0 ? 0.0 : fabs(rnd(r, 41));
        const int check = r % 7 != 0;
        moe_step_scalars *d = dev(&s, sizeof s);
        moe_cuda_grad_norm_finalize(d, max_norm, check);
        get(&g, d, sizeof g);
        cpu->grad_norm_finalize(&s, max_norm, check);
        bad += !same(g.grad_norm, s.grad_norm) || !same(g.clip, s.clip) || g.flags != s.flags;
        moe_cuda_free(d);
    }
    ck_assert_msg(bad == 0, "grad_norm_finalize: %lld of 200 differ from the CPU", bad);
    /* add_f64 */
    {
        double a[11], b[11], got[11];
        for (int i = 0; i < 11; i++)
            a[i] = rnd(5, i), b[i] = rnd(6, i);
        double *da = dev(a, sizeof a), *db = dev(b, sizeof b);
        moe_cuda_add_f64(da, db, 11);
        get(got, da, sizeof got);
        cpu->add_f64(a, b, 11);
        ck_assert_msg(!memcmp(got, a, sizeof a), "add_f64 differs from the CPU");
        moe_cuda_free(da), moe_cuda_free(db);
    }
    /* expert_load_add onto a random start, then expert_bias_update with and without a flag */
    for (int c = 0; c < 3; c++) {
        const int E = c == 0 ? 4 : c == 1 ? 64 : 300, N = 1000 * (c + 1), k = c + 1;
        long long *load = malloc(sizeof(long long) * E), *lg = malloc(sizeof(long long) * E);
        int *idx = malloc(sizeof(int) * (size_t)N * k);
        float *bias = malloc(sizeof(float) * E), *bg = malloc(sizeof(float) * E);
        for (int e = 0; e < E; e++)
            load[e] = (long long)(moe_rng_uniform(c, 1, e) * 50), bias[e] = (float)rnd(c, e);
        for (int i = 0; i < N * k; i++) /* skewed: low experts hot */
            idx[i] = (int)(E * pow(moe_rng_uniform(c, 2, i), 2.0));
        long long *dl = dev(load, sizeof(long long) * E);
        int *di = dev(idx, sizeof(int) * (size_t)N * k);
        float *db = dev(bias, sizeof(float) * E);
        moe_cuda_expert_load_add(dl, di, N, k, E);
        cpu->expert_load_add(load, idx, N, k, E);
        get(lg, dl, sizeof(long long) * E);
        ck_assert_msg(!memcmp(lg, load, sizeof(long long) * E), "expert_load_add, E=%d", E);
        const int flag = MOE_STEP_NONFINITE;
        int *dflag = dev(&flag, sizeof flag);
        moe_cuda_expert_bias_update(db, dl, E, 1e-3, dflag); /* skipped */
        get(bg, db, sizeof(float) * E);
        ck_assert_msg(!memcmp(bg, bias, sizeof(float) * E), "a flagged bias update moved, E=%d",
                      E);
        moe_cuda_expert_bias_update(db, dl, E, 1e-3, NULL);
        cpu->expert_bias_update(bias, load, E, 1e-3, NULL);
        get(bg, db, sizeof(float) * E);
        ck_assert_msg(!memcmp(bg, bias, sizeof(float) * E), "expert_bias_update, E=%d", E);
        printf("  expert load E=%d, %d picks, and the bias update: exactly the CPU\n", E, N * k);
        moe_cuda_free(dl), moe_cuda_free(di), moe_cuda_free(db), moe_cuda_free(dflag);
        free(load), free(lg), free(idx), free(bias), free(bg);
    }
}
END_TEST

START_TEST(test_gpu_adamw_clip_flags) {
    const moe_backend *cpu = moe_backend_cpu();
    const size_t n = 100003;
    moe_real *p = malloc(sizeof(moe_real) * n), *g = malloc(sizeof(moe_real) * n);
    float *m = malloc(sizeof(float) * n), *v = malloc(sizeof(float) * n);
    moe_real *gp = malloc(sizeof(moe_real) * n);
    float *gm = malloc(sizeof(float) * n), *gv = malloc(sizeof(float) * n);
    moe_test_randn(p, n, 301, 1.0);
    moe_test_randn(g, n, 302, 1e-2);
    moe_test_randn(m, n, 303, 1e-3);
    moe_test_randn(v, n, 304, 1e-3);
    for (size_t i = 0; i < n; i++)
        v[i] *= v[i];
    moe_real *dp = dev(p, sizeof(moe_real) * n), *dg = dev(g, sizeof(moe_real) * n);
    float *dm = dev(m, sizeof(float) * n), *dv = dev(v, sizeof(float) * n);
    const double clip = 0.0371, b1 = 0.9, b2 = 0.95, bc1 = 1 - pow(b1, 4), bc2 = 1 - pow(b2, 4);
    const int zero = 0, flag = MOE_STEP_OVERFLOW;
    double *dclip = dev(&clip, sizeof clip);
    int *dzero = dev(&zero, sizeof zero), *dflag = dev(&flag, sizeof flag);
    /* a raised flag: nothing moves */
    moe_cuda_adamw(dp, dg, dm, dv, n, 3e-4, b1, b2, 1e-8, 0.1, bc1, bc2, dclip, dflag, NULL);
    get(gp, dp, sizeof(moe_real) * n), get(gm, dm, sizeof(float) * n), get(gv, dv, sizeof(float) * n);
    ck_assert_msg(!memcmp(gp, p, sizeof(moe_real) * n) && !memcmp(gm, m, sizeof(float) * n) &&
                      !memcmp(gv, v, sizeof(float) * n),
                  "AdamW moved p, m or v while a step flag was up");
    /* clip factor from device memory = the gradients clipped in place first (both sides);
     * lr and the bias corrections from device memory too (the arguments are wrong on
     * purpose: the kernel must not use them when hyper is given) */
    const double hyper[3] = {3e-4, bc1, bc2};
    double *dhyper = dev(hyper, sizeof hyper);
    moe_cuda_adamw(dp, dg, dm, dv, n, 99.0, b1, b2, 1e-8, 0.1, 0.5, 0.5, dclip, dzero, dhyper);
    get(gp, dp, sizeof(moe_real) * n), get(gm, dm, sizeof(float) * n), get(gv, dv, sizeof(float) * n);
    cpu->scale_real(g, clip, n);
    cpu->adamw(p, g, m, v, n, 3e-4, b1, b2, 1e-8, 0.1, bc1, bc2, NULL, NULL, NULL);
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double e = fabs((double)gp[i] - p[i]) / (fabs(p[i]) + 1e-6);
        worst = e > worst ? e : worst;
    }
    printf("  adamw with a device clip factor (%.4f) vs the CPU's clip-then-step: rel err %.2e\n",
           clip, worst);
    ck_assert_msg(worst <= 1e-6, "adamw with the clip factor: rel err %g", worst);
    moe_cuda_free(dp), moe_cuda_free(dg), moe_cuda_free(dm), moe_cuda_free(dv);
    moe_cuda_free(dclip), moe_cuda_free(dzero), moe_cuda_free(dflag), moe_cuda_free(dhyper);
    free(p), free(g), free(m), free(v), free(gp), free(gm), free(gv);
}
END_TEST

START_TEST(test_gpu_readback) {
    const size_t n = 1000;
    double *h = moe_cuda_host_alloc(sizeof(double) * n), *src = malloc(sizeof(double) * n);
    ck_assert_ptr_nonnull(h);
    for (size_t i = 0; i < n; i++)
        src[i] = rnd(9, i), h[i] = NAN; /* poisoned */
    double *d = dev(src, sizeof(double) * n);
    moe_cuda_to_host_async(h, d, sizeof(double) * n);
    moe_cuda_wait_to_host();
    ck_assert_msg(!memcmp(h, src, sizeof(double) * n), "the readback differs from the source");
    moe_cuda_free(d);
    moe_cuda_host_free(h);
    free(src);
}
END_TEST

/* A CUDA step, EP = 1 (the local dispatcher): the scalars' part of the step never waits. */
START_TEST(test_gpu_step_waits_once) {
    moe_trainer *t = moe_test_trainer(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 "
        "--seq-length 64 --micro-batch-size 8 --global-batch-size 32 --num-experts 8 "
        "--moe-ffn-hidden-size 64 --ffn-hidden-size 128 --moe-router-score-function sigmoid "
        "--moe-router-enable-expert-bias --clip-grad 0.1 --moe-z-loss-coeff 1e-3 --log-interval 2",
        NULL, 1);
    moe_test_sync_counts n = {0};
    moe_test_count_syncs(t, &n);
    const int steps = 4;
    for (int s = 0; s < steps; s++)
        moe_test_step(t);
    printf("  %d CUDA steps of 4 micro-batches: wait_to_host %lld, to_host %lld, read_act %lld, "
           "synchronize %lld | the MoE layer's own: permute_index %lld, from_host %lld\n",
           steps, n.wait_to_host, n.to_host, n.read_act, n.synchronize, n.permute_index,
           n.from_host);
    ck_assert_msg(n.wait_to_host == steps, "%lld boundary waits in %d steps", n.wait_to_host,
                  steps);
    ck_assert_msg(n.to_host == 0 && n.read_act == 0 && n.synchronize == 0,
                  "the step read the device back: to_host %lld, read_act %lld, synchronize %lld",
                  n.to_host, n.read_act, n.synchronize);
    moe_trainer_free(t);
}
END_TEST

Suite *suite_gpu_scalars(void) {
    const TTest *const tests[] = {test_gpu_scalar_ops, test_gpu_adamw_clip_flags,
                                         test_gpu_readback, test_gpu_step_waits_once};
    return moe_test_chapter_suite("gpu_scalars", "ch06", tests,
                                  (int)(sizeof tests / sizeof *tests));
}
