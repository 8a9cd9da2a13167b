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
 *  - the multi-tensor adamw (every run of a step in one launch) against its CPU twin, its
 *    bf16 compute copy cast_to_act of the updated weights bit for bit, float4 and
 *    one-by-one paths the same bits;
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
    moe_adamw_runs d_run = moe_test_adamw_flat(moe_backend_cuda(), n),
                   h_run = moe_test_adamw_flat(cpu, n);
    moe_cuda_adamw(&d_run, dp, dg, dm, dv, NULL, 3e-4, b1, b2, 1e-8, 0.1, bc1, bc2, dclip, dflag,
                   NULL);
    get(gp, dp, sizeof(moe_real) * n), get(gm, dm, sizeof(float) * n), get(gv, dv, sizeof(float) * n);
    ck_assert_msg(!memcmp(gp, p, sizeof(moe_real) * n) && !memcmp(gm, m, sizeof(float) * n) &&
                      !memcmp(gv, v, sizeof(float) * n),
                  "AdamW moved p, m or v while a step flag was up");
    /* clip factor from device memory = the gradients clipped in place first (both sides);
     * lr and the bias corrections from device memory too (the arguments are wrong on
     * purpose: the kernel must not use them when hyper is given) */
    const double hyper[3] = {3e-4, bc1, bc2};
    double *dhyper = dev(hyper, sizeof hyper);
    moe_cuda_adamw(&d_run, dp, dg, dm, dv, NULL, 99.0, b1, b2, 1e-8, 0.1, 0.5, 0.5, dclip, dzero,
                   dhyper);
    get(gp, dp, sizeof(moe_real) * n), get(gm, dm, sizeof(float) * n), get(gv, dv, sizeof(float) * n);
    cpu->scale_real(g, clip, n);
    cpu->adamw(&h_run, p, g, m, v, NULL, 3e-4, b1, b2, 1e-8, 0.1, bc1, bc2, NULL, NULL, NULL);
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
    moe_cuda_free(d_run.run), cpu->free(h_run.run);
    free(p), free(g), free(m), free(v), free(gp), free(gm), free(gv);
}
END_TEST

/* What one step of an AdamW gives: the weights (the caller's [n], or the master [opt.n]),
 * the moments [opt.n], the compute copy [n] and cast_to_act of the weights the step left
 * [as many], both in the backend's activation type (`as` bytes an element: bf16 on CUDA). */
typedef struct adamw_result {
    moe_real *w;
    float *m, *v;
    unsigned char *act, *cast;
    size_t as;
} adamw_result;

static const double ADAM_B1 = 0.9, ADAM_B2 = 0.95, ADAM_EPS = 1e-8, ADAM_WD = 0.1;

/* One step of @p opt (its backend: @p be) from the weights @p w0 [n] (flat; into the master
 * when it has one), the moments @p m0, @p v0 [opt.n] and the gradients @p g [n], with @p clip,
 * @p flags and @p hyper in that backend's memory. The caller's buffers start @p shift
 * elements into their allocation (1: no 16-byte alignment, the one-by-one path), the
 * compute copy is poisoned first (all bits set: a NaN in fp32 and bf16). */
static adamw_result adamw_once(moe_adamw *opt, const moe_backend *be, size_t n, size_t shift,
                               const moe_real *w0, const float *m0, const float *v0,
                               const moe_real *g, const double *clip, const int *flags,
                               const double *hyper) {
    const size_t ns = opt->n, nw = opt->master ? ns : n, as = be->act_size;
    adamw_result r = {malloc(sizeof(moe_real) * nw), malloc(sizeof(float) * ns),
                      malloc(sizeof(float) * ns), malloc(as * n), malloc(as * nw), as};
    char *p = be->alloc(sizeof(moe_real) * (n + shift));
    char *gd = be->alloc(sizeof(moe_real) * (n + shift));
    char *act = be->alloc(as * (n + shift)), *cast = be->alloc(as * nw);
    ck_assert(r.w && r.m && r.v && r.act && r.cast && p && gd && act && cast);
    moe_real *dp = (moe_real *)p + shift, *dg = (moe_real *)gd + shift;
    void *dact = act + as * shift;
    be->from_host(dg, g, sizeof(moe_real) * n);
    memset(r.act, 0xff, as * n);
    be->from_host(dact, r.act, as * n);
    be->from_host(opt->m, m0, sizeof(float) * ns);
    be->from_host(opt->v, v0, sizeof(float) * ns);
    if (opt->master)
        moe_adamw_pieces_from_host(opt, opt->master, w0, sizeof(moe_real));
    else
        be->from_host(dp, w0, sizeof(moe_real) * n);
    /* (lr and the bias corrections are wrong on purpose: @p hyper holds this step's) */
    moe_adamw_step(opt, opt->master ? NULL : dp, dg, dact, 99.0, ADAM_B1, ADAM_B2, ADAM_EPS,
                   ADAM_WD, clip, flags, hyper);
    moe_real *w = opt->master ? opt->master : dp;
    be->cast_to_act(cast, w, nw);
    be->to_host(r.w, w, sizeof(moe_real) * nw);
    be->to_host(r.m, opt->m, sizeof(float) * ns);
    be->to_host(r.v, opt->v, sizeof(float) * ns);
    be->to_host(r.act, dact, as * n);
    be->to_host(r.cast, cast, as * nw);
    be->free(p), be->free(gd), be->free(act), be->free(cast);
    return r;
}

static void adamw_result_free(adamw_result *r) {
    free(r->w), free(r->m), free(r->v), free(r->act), free(r->cast);
}

/* The compute copy is cast_to_act of the weights on this rank's pieces (bit for bit) and
 * untouched (all bits set) elsewhere. */
static void expect_act_is_cast(const moe_adamw *opt, const adamw_result *r, size_t n,
                               const char *what) {
    size_t bad = 0, next = 0; /* bytes before the next piece that must still be poison */
    const size_t as = r->as;
    for (int k = 0; k <= opt->n_pieces; k++) {
        const moe_adamw_piece *pc = k < opt->n_pieces ? &opt->piece[k] : NULL;
        const size_t lo = pc ? pc->lo : n;
        for (size_t b = next * as; b < lo * as; b++)
            bad += r->act[b] != 0xff;
        if (!pc)
            break;
        const size_t at = opt->master ? pc->state : pc->lo;
        bad += memcmp(r->act + pc->lo * as, r->cast + at * as, as * (pc->hi - pc->lo)) != 0;
        next = pc->hi;
    }
    ck_assert_msg(bad == 0, "%s: the compute copy is not cast_to_act of the updated weights "
                  "(%zu bad bytes or pieces)", what, bad);
}

/* The CUDA multi-tensor AdamW (one launch) against its CPU twin on fresh random inputs, the
 * clip factor and {lr, bias corrections} read from device memory, on the whole buffer and on
 * the distributed optimizer's layout (three pieces with their own master weights, whose
 * offsets are not the gradients'). p, m and v are updated in place, so an element the
 * kernel skipped keeps its input and fails the comparison; the bf16 copy is poisoned. Then:
 * the same step on buffers one float off 16-byte alignment gives the same bits (float4 and
 * one by one agree), and a raised step flag leaves p, m, v as they were while the copy is
 * still written. */
START_TEST(test_gpu_adamw_multi_tensor) {
    const moe_backend *cpu = moe_backend_cpu(), *cu = moe_backend_cuda();
    moe_param_table pt = moe_test_adamw_table();
    const size_t n = pt.total, C = MOE_ADAMW_CHUNK;
    const moe_adamw_piece whole[] = {{0, n, 0}},
                          pieces[] = {{1000, 1000 + C + 77, 0}, {3 * C + 9, n / 2, 0},
                                      {n / 2, n - 1, 0}};
    const double clip = 0.0371, hyper[3] = {3e-4, 1 - pow(ADAM_B1, 3), 1 - pow(ADAM_B2, 3)};
    const int zero = 0, flag = MOE_STEP_NONFINITE;
    double *dclip = dev(&clip, sizeof clip), *dhyper = dev(hyper, sizeof hyper);
    int *dzero = dev(&zero, sizeof zero), *dflag = dev(&flag, sizeof flag);
    moe_real *g = malloc(sizeof(moe_real) * n), *w0 = malloc(sizeof(moe_real) * n);
    moe_test_randn(g, n, 401, 1e-2);
    moe_test_randn(w0, n, 402, 1.0);
    for (int master = 0; master < 2; master++) {
        const moe_adamw_piece *pc = master ? pieces : whole;
        const int np = master ? 3 : 1;
        moe_adamw h, d; /* the CPU's and the GPU's */
        ck_assert_int_eq(moe_adamw_init_pieces(&h, cpu, &pt, pc, np, master, NULL), MOE_OK);
        ck_assert_int_eq(moe_adamw_init_pieces(&d, cu, &pt, pc, np, master, NULL), MOE_OK);
        const size_t ns = h.n, nw = master ? ns : n;
        float *m0 = malloc(sizeof(float) * ns), *v0 = malloc(sizeof(float) * ns);
        moe_test_randn(m0, ns, 403, 1e-3);
        moe_test_randn(v0, ns, 404, 1e-3);
        for (size_t i = 0; i < ns; i++)
            v0[i] *= v0[i];
        adamw_result want = adamw_once(&h, cpu, n, 0, w0, m0, v0, g, &clip, &zero, hyper);
        adamw_result got = adamw_once(&d, cu, n, 0, w0, m0, v0, g, dclip, dzero, dhyper);
        const double ew = moe_test_max_rel_err(got.w, want.w, nw, 1e-6),
                     em = moe_test_max_rel_err(got.m, want.m, ns, 1e-9),
                     ev = moe_test_max_rel_err(got.v, want.v, ns, 1e-12);
        printf("  multi-tensor adamw (%s, %d runs, %zu chunks, one launch) vs the CPU: rel err "
               "p %.2e m %.2e v %.2e\n", master ? "3 pieces, master weights" : "whole buffer",
               d.runs.n, d.runs.chunks, ew, em, ev);
        ck_assert_msg(ew <= 1e-6 && em <= 1e-6 && ev <= 1e-6, "multi-tensor adamw differs from "
                      "the CPU twin: p %g m %g v %g", ew, em, ev);
        expect_act_is_cast(&d, &got, n, "multi-tensor adamw");
        if (!master) { /* one float off alignment: the one-by-one path, the same bits */
            adamw_result off = adamw_once(&d, cu, n, 1, w0, m0, v0, g, dclip, dzero, dhyper);
            ck_assert_msg(!memcmp(off.w, got.w, sizeof(moe_real) * n) &&
                              !memcmp(off.m, got.m, sizeof(float) * ns) &&
                              !memcmp(off.v, got.v, sizeof(float) * ns) &&
                              !memcmp(off.act, got.act, got.as * n),
                          "adamw on unaligned buffers differs from the float4 path");
            adamw_result_free(&off);
        }
        /* a raised flag: nothing moves, the copy is of the unchanged weights */
        adamw_result skip = adamw_once(&d, cu, n, 0, w0, m0, v0, g, dclip, dflag, dhyper);
        moe_real *w0s = malloc(sizeof(moe_real) * nw); /* w0 as the step's weights lie */
        for (int k = 0; k < d.n_pieces; k++) {
            const moe_adamw_piece *q = &d.piece[k];
            memcpy(w0s + (master ? q->state : q->lo), w0 + q->lo,
                   sizeof(moe_real) * (q->hi - q->lo));
        }
        ck_assert_msg(!memcmp(skip.w, w0s, sizeof(moe_real) * nw) &&
                          !memcmp(skip.m, m0, sizeof(float) * ns) &&
                          !memcmp(skip.v, v0, sizeof(float) * ns),
                      "AdamW moved p, m or v while a step flag was up");
        expect_act_is_cast(&d, &skip, n, "a skipped step");
        adamw_result_free(&want), adamw_result_free(&got), adamw_result_free(&skip);
        free(m0), free(v0), free(w0s);
        moe_adamw_free(&h), moe_adamw_free(&d);
    }
    moe_cuda_free(dclip), moe_cuda_free(dhyper), moe_cuda_free(dzero), moe_cuda_free(dflag);
    free(g), free(w0);
    moe_params_free(&pt);
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
                                         test_gpu_adamw_multi_tensor, test_gpu_readback,
                                         test_gpu_step_waits_once};
    return moe_test_chapter_suite("gpu_scalars", "ch06", tests,
                                  (int)(sizeof tests / sizeof *tests));
}
