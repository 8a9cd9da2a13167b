/*
 * Context-parallel attention (chapter 07, lib/context_parallel.h). Under mpirun with W ranks
 * the world is one CP group (cp = W): every rank holds chunks r and 2W−1−r of each sequence
 * (chunk-major), runs each communication type forward and backward, and
 * must get exactly the rows ONE process computes with the attention op on the whole
 * sequence (the ring, the all-gather, the all-to-all of heads (Ulysses), and the hybrid
 * a2a+p2p for every a2a group size that divides W): y and lse of
 * its query rows, and dq, dk, dv of its rows (accumulated onto a
 * non-zero start, so an op that overwrites fails). With W = 1 the same code runs with no
 * group (cp = 1). GQA 4/2 and 4/1, head dims 16 and 8, 3 and 5 tokens per chunk. Bound: fp32,
 * 1e-5 of each tensor's largest magnitude (the same sums, merged in another order). On GPU
 * ranks (MOE_TEST_DEVICE=cuda: bf16 activations, the CUDA flash kernels and cp_merge, NCCL)
 * the one-process reference runs on the same GPU from the same bf16 inputs, and the bound is
 * bf16's: 2e-2 (check_cp says why); the model's bounds are mpi_tp's and mpi_dp's.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "comm.h"
#include "context_parallel.h"
#include "helpers.h"
#include "rng.h"
#include "suites.h"
#include "trainer.h"

/* the local rows, chunk-major, of a [B, T, H, D] tensor (or back) */
static void to_local(moe_real *loc, const moe_real *full, int B, int T, int H, int D, int cp,
                     int r) {
    const int C = T / (2 * cp);
    for (int w = 0; w < 2; w++)
        for (int b = 0; b < B; b++)
            for (int c = 0; c < C; c++) {
                const int pos = moe_cp_chunk(cp, r, w) * C + c;
                memcpy(loc + (((size_t)w * B + b) * C + c) * H * D,
                       full + ((size_t)b * T + pos) * H * D, sizeof(moe_real) * H * D);
            }
}

/* largest |a − b| over n, relative to the largest |b| */
static double rel_err(const moe_real *a, const moe_real *b, size_t n) {
    double e = 0, m = 1e-30;
    for (size_t i = 0; i < n; i++) {
        e = fmax(e, fabs((double)a[i] - b[i]));
        m = fmax(m, fabs((double)b[i]));
    }
    return e / m;
}

static moe_real *randn(size_t n, uint64_t stream) {
    moe_real *x = malloc(sizeof *x * n);
    for (size_t i = 0; i < n; i++)
        x[i] = (moe_real)moe_rng_normal(11, stream, i);
    return x;
}

static int on_gpu(void) { return moe_comm_device(moe_test_world()) == MOE_DEVICE_CUDA; }

/* a backend copy of n host values: activations (`act`: bf16 on GPU ranks) or full precision */
static void *up(const moe_backend *be, const moe_real *h, size_t n, int act) {
    void *d = be->alloc(n * (act ? be->act_size : sizeof(moe_real)));
    ck_assert_ptr_nonnull(d);
    if (act)
        be->write_act(d, h, n);
    else
        be->from_host(d, h, n * sizeof(moe_real));
    return d;
}

/* ...and back, into a fresh host array that the caller frees */
static moe_real *down(const moe_backend *be, const void *d, size_t n, int act) {
    moe_real *h = malloc(sizeof *h * n);
    if (act)
        be->read_act(h, d, n);
    else
        be->to_host(h, d, n * sizeof(moe_real));
    return h;
}

/* a2a+p2p's groups: inner = the a2a ranks of this rank's block of `a2a`, outer = the ranks
 * with its inner rank (NULL where a group has one rank) */
static moe_comm *g_inner, *g_outer;
static int g_a2a;

/* One context-parallel forward and backward of this rank's q, k, v and dy; the outputs come
 * back to the host as out[0..4] = y, lse, dq, dk, dv (the caller frees them). y and lse start
 * poisoned (an unwritten row fails), the gradients at 0.25, which they accumulate onto and
 * which is taken off again. */
static void cp_run(const moe_backend *be, const moe_cp_attention *a, void *ws, const void *g_q,
                   const void *g_k, const void *g_v, const void *g_dy, size_t nq, size_t nk,
                   size_t nl, const moe_real *poison, moe_real *out[5]) {
    void *g_y = up(be, poison, nq, 1), *g_lse = up(be, poison, nl, 0);
    moe_cp_attention_forward(be, a, g_y, g_lse, g_q, g_k, g_v, ws);
    const double start = 0.25;
    moe_real *gq = malloc(sizeof *gq * nq), *gk = malloc(sizeof *gk * nk), *gv = malloc(sizeof *gv * nk);
    for (size_t i = 0; i < nq; i++)
        gq[i] = (moe_real)start;
    for (size_t i = 0; i < nk; i++)
        gk[i] = gv[i] = (moe_real)start;
    void *g_dq = up(be, gq, nq, 1), *g_dk = up(be, gk, nk, 1), *g_dv = up(be, gv, nk, 1);
    moe_cp_attention_backward(be, a, g_dq, g_dk, g_dv, g_dy, g_y, g_lse, g_q, g_k, g_v, ws);
    free(gq), free(gk), free(gv);
    out[0] = down(be, g_y, nq, 1), out[1] = down(be, g_lse, nl, 0);
    out[2] = down(be, g_dq, nq, 1), out[3] = down(be, g_dk, nk, 1), out[4] = down(be, g_dv, nk, 1);
    for (size_t i = 0; i < nq; i++)
        out[2][i] -= (moe_real)start;
    for (size_t i = 0; i < nk; i++)
        out[3][i] -= (moe_real)start, out[4][i] -= (moe_real)start;
    be->free(g_y), be->free(g_lse), be->free(g_dq), be->free(g_dk), be->free(g_dv);
}

static void check_cp(int B, int C, int Hq, int Hkv, int D, moe_cp_comm type) {
    moe_comm *world = moe_test_world();
    const int cp = moe_comm_size(world), r = moe_comm_rank(world), T = 2 * cp * C;
    const moe_backend *be = moe_test_mpi_backend();
    const size_t NQ = (size_t)B * T * Hq * D, NK = (size_t)B * T * Hkv * D, NL = (size_t)B * Hq * T;
    moe_real *q = randn(NQ, 1), *k = randn(NK, 2), *v = randn(NK, 3), *dy = randn(NQ, 4);
    /* one process, the whole sequence, on this rank's backend (so on GPU ranks both sides
     * see the same bf16 inputs) */
    void *d_q = up(be, q, NQ, 1), *d_k = up(be, k, NK, 1), *d_v = up(be, v, NK, 1),
         *d_dy = up(be, dy, NQ, 1);
    void *d_y = be->alloc(be->act_size * NQ), *d_lse = be->alloc(sizeof(moe_real) * NL);
    void *d_dq = be->alloc(be->act_size * NQ), *d_dk = be->alloc(be->act_size * NK),
         *d_dv = be->alloc(be->act_size * NK); /* zeroed */
    const moe_attention_shape whole = {B, T, T, Hq, Hkv, D, 0, 0};
    const size_t wsb = be->attention_workspace_bytes(whole);
    if (be->device == MOE_DEVICE_CPU)
        ck_assert_int_eq((int)wsb, 0);
    void *d_ws = wsb ? be->alloc(wsb) : NULL;
    be->attention_forward(d_y, d_lse, d_ws, d_q, d_k, d_v, whole);
    be->attention_backward(d_dq, d_dk, d_dv, d_dy, d_y, d_lse, d_ws, d_q, d_k, d_v, whole);
    moe_real *y = down(be, d_y, NQ, 1), *lse = down(be, d_lse, NL, 0), *dq = down(be, d_dq, NQ, 1),
             *dk = down(be, d_dk, NK, 1), *dv = down(be, d_dv, NK, 1);
    be->free(d_q), be->free(d_k), be->free(d_v), be->free(d_dy), be->free(d_y), be->free(d_lse);
    be->free(d_dq), be->free(d_dk), be->free(d_dv), be->free(d_ws);
    /* this rank's rows */
    const size_t nq = NQ / cp, nk = NK / cp, nl = NL / cp;
    moe_real *lq = malloc(sizeof *lq * nq), *lk = malloc(sizeof *lk * nk),
             *lv = malloc(sizeof *lv * nk), *ldy = malloc(sizeof *ldy * nq);
    moe_real *want_y = malloc(sizeof *want_y * nq), *want_dq = malloc(sizeof *want_dq * nq),
             *want_dk = malloc(sizeof *want_dk * nk), *want_dv = malloc(sizeof *want_dv * nk);
    to_local(lq, q, B, T, Hq, D, cp, r);
    to_local(lk, k, B, T, Hkv, D, cp, r);
    to_local(lv, v, B, T, Hkv, D, cp, r);
    to_local(ldy, dy, B, T, Hq, D, cp, r);
    to_local(want_y, y, B, T, Hq, D, cp, r);
    to_local(want_dq, dq, B, T, Hq, D, cp, r);
    to_local(want_dk, dk, B, T, Hkv, D, cp, r);
    to_local(want_dv, dv, B, T, Hkv, D, cp, r);
    moe_real *want_lse = malloc(sizeof *want_lse * nl); /* lse [B, Hq, T] -> [2][B][Hq][C] */
    for (int w = 0; w < 2; w++)
        for (int b = 0; b < B; b++)
            for (int h = 0; h < Hq; h++)
                for (int c = 0; c < C; c++)
                    want_lse[(((size_t)w * B + b) * Hq + h) * C + c] =
                        lse[((size_t)b * Hq + h) * T + moe_cp_chunk(cp, r, w) * C + c];
    /* context parallel */
    moe_cp_attention a = {cp > 1 ? world : NULL, cp, r, type, B, T, Hq, Hkv, D,
                          g_inner, g_outer, g_a2a};
    char name[32];
    if (type == MOE_CP_A2A_P2P)
        snprintf(name, sizeof name, "a2a%d+p2p%d", g_a2a, cp / g_a2a);
    else
        snprintf(name, sizeof name, "%s",
                 type == MOE_CP_P2P ? "p2p" : type == MOE_CP_ALLGATHER ? "allgather" : "a2a");
    moe_error err;
    ck_assert_msg(moe_cp_attention_check(&a, &err) == MOE_OK, "%s", err.msg);
    void *ws = be->alloc(moe_cp_attention_workspace_bytes(&a, be->act_size));
    ck_assert_ptr_nonnull(ws);
    moe_real *poison = malloc(sizeof *poison * (nq > nl ? nq : nl));
    for (size_t i = 0; i < (nq > nl ? nq : nl); i++) /* poisoned: an unwritten row fails */
        poison[i] = NAN;
    void *g_q = up(be, lq, nq, 1), *g_k = up(be, lk, nk, 1), *g_v = up(be, lv, nk, 1),
         *g_dy = up(be, ldy, nq, 1);
    moe_real *got[5];
    cp_run(be, &a, ws, g_q, g_k, g_v, g_dy, nq, nk, nl, poison, got);
    moe_real *got_y = got[0], *got_lse = got[1], *gq = got[2], *gk = got[3], *gv = got[4];
    for (int ov = 0; ov < 2 && (type == MOE_CP_P2P || type == MOE_CP_A2A_P2P); ov++) {
        /* the ring with its hops forced overlapped (1) and forced complete before the blocks
         * after them (0; the default picks by size, and these shapes are small): the same
         * ops on the same data in the same order, so the same bits as the default's */
        setenv("MOE_CP_RING_OVERLAP", ov ? "1" : "0", 1);
        moe_real *base[5];
        cp_run(be, &a, ws, g_q, g_k, g_v, g_dy, nq, nk, nl, poison, base);
        unsetenv("MOE_CP_RING_OVERLAP");
        const size_t n[5] = {nq, nl, nq, nk, nk};
        int same = 1;
        for (int i = 0; i < 5; i++) {
            same &= memcmp(base[i], got[i], n[i] * sizeof(moe_real)) == 0;
            free(base[i]);
        }
        MOE_TEST_AGREE(!same, "CP %d %s on rank %d: the ring with MOE_CP_RING_OVERLAP=%d gives "
                       "other bits than by default", cp, name, r, ov);
    }
    const double e[5] = {rel_err(got_y, want_y, nq), rel_err(got_lse, want_lse, nl),
                         rel_err(gq, want_dq, nq), rel_err(gk, want_dk, nk),
                         rel_err(gv, want_dv, nk)};
    /* GPU ranks keep y and the gradients in bf16 (8 significant bits: a rounding is at most
     * 2e-3 of the value): a partial y is rounded before its merge, a key's gradient once per
     * block it gets (up to 2·cp) and again on the start's addition, ~10 roundings in all;
     * the lse stays fp32 */
    const double tol = on_gpu() ? 2e-2 : 1e-5;
    double worst = 0;
    for (int i = 0; i < 5; i++)
        worst = isnan(e[i]) ? INFINITY : fmax(worst, e[i]);
    if (r == 0)
        printf("  CP %d %-9s B=%d T=%d Hq=%d Hkv=%d D=%d: y %.1e lse %.1e dq %.1e dk %.1e dv %.1e "
               "(relative to one process)\n", cp, name, B, T,
               Hq, Hkv, D, e[0], e[1], e[2], e[3], e[4]);
    MOE_TEST_AGREE(!(worst <= tol), "CP %d %s (B=%d T=%d Hq=%d Hkv=%d D=%d) on rank %d: y %.2e "
                   "lse %.2e dq %.2e dk %.2e dv %.2e", cp, name,
                   B, T, Hq, Hkv, D, r, e[0], e[1], e[2], e[3], e[4]);
    be->free(g_q), be->free(g_k), be->free(g_v), be->free(g_dy), be->free(ws);
    free(q), free(k), free(v), free(dy), free(y), free(lse), free(dq), free(dk), free(dv);
    free(lq), free(lk), free(lv), free(ldy), free(want_y), free(want_dq), free(want_dk);
    free(want_dv), free(want_lse), free(poison), free(got_y), free(got_lse), free(gq), free(gk);
    free(gv);
}

START_TEST(test_cp_attention_equals_one_process) {
    moe_error err0;
    ck_assert_msg(moe_cp_attention_supported(moe_test_mpi_backend(), &err0) == MOE_OK, "%s",
                  err0.msg);
    const int cp = moe_comm_size(moe_test_world());
    for (int t = 0; t < 2; t++) {
        const moe_cp_comm type = t ? MOE_CP_ALLGATHER : MOE_CP_P2P;
        check_cp(2, 3, 4, 2, 16, type);
        check_cp(1, 5, 4, 1, 8, type);
    }
    /* a2a splits the heads: both counts must divide by cp (GQA 2:1, then one query per KV) */
    check_cp(2, 3, 2 * cp, cp, 16, MOE_CP_A2A);
    check_cp(1, 5, cp, cp, 8, MOE_CP_A2A);
    /* a2a+p2p: every a2a group size that divides cp (a2a = 1: the ring, a2a = cp: Ulysses) */
    const int r = moe_comm_rank(moe_test_world());
    for (int a2a = 1; a2a <= cp; a2a++) {
        if (cp % a2a)
            continue;
        moe_error err;
        g_inner = g_outer = NULL;
        moe_comm *in = NULL, *out = NULL;
        if (cp > 1) { /* every rank makes both splits, in the same order */
            ck_assert_int_eq(moe_comm_split(moe_test_world(), r / a2a, r % a2a, &in, &err), MOE_OK);
            ck_assert_int_eq(moe_comm_split(moe_test_world(), r % a2a, r / a2a, &out, &err), MOE_OK);
        }
        g_inner = a2a > 1 ? in : NULL;
        g_outer = cp / a2a > 1 ? out : NULL;
        g_a2a = a2a;
        check_cp(2, 3, 2 * a2a, a2a, 16, MOE_CP_A2A_P2P);
        check_cp(1, 5, 2 * a2a, 2 * a2a, 8, MOE_CP_A2A_P2P);
        moe_comm_free(in);
        moe_comm_free(out);
    }
    g_inner = g_outer = NULL;
    g_a2a = 0;
    if (cp > 1) { /* and a head count that does not divide is a named error */
        moe_cp_attention bad = {NULL, cp, 0, MOE_CP_A2A, 1, 2 * cp, cp + 1, 1, 8, NULL, NULL, 0};
        moe_error err;
        ck_assert_int_eq(moe_cp_attention_check(&bad, &err), MOE_ERR_CONFIG);
        moe_cp_attention bad2 = bad; /* an a2a group that does not divide the heads */
        bad2.type = MOE_CP_A2A_P2P;
        bad2.a2a = cp;
        bad2.Hq = 2 * cp + 1;
        ck_assert_int_eq(moe_cp_attention_check(&bad2, &err), MOE_ERR_CONFIG);
        ck_assert_msg(strstr(err.msg, "a2a+p2p"), "%s", err.msg);
        ck_assert_msg(strstr(err.msg, "--cp-comm-type a2a") && strstr(err.msg, "--num-query-groups"),
                      "%s", err.msg);
    }
}
END_TEST

/* ------------------------------------------------- the model, context-parallel */

/* A dense layer then an MoE layer (a shared expert, the aux loss and the z-loss on), GQA and
 * QK-norm: every op the CP ranks run on their T/CP tokens, the attention exchange, the router
 * statistics over TP x CP and the gradient sums over DP x CP. 16 tokens: 2·CP chunks for
 * CP 2 and 4. */
#define CP_MODEL "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "    \
                 "--micro-batch-size 2 --num-experts 4 --moe-router-topk 2 "                  \
                 "--moe-ffn-hidden-size 16 --moe-shared-expert-intermediate-size 16 "           \
                 "--moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 --moe-layer-freq [0,1] "   \
                 "--ffn-hidden-size 32 --qk-layernorm --make-vocab-size-divisible-by 4"

#define SEQ_AUX "--moe-router-load-balancing-type seq_aux_loss"

/* CP ranks (x TP, with the experts over EP; the rest data-parallel) against one process:
 * the first step's loss and every gradient tensor, the gradient norm, the losses of `steps`
 * AdamW steps and then every parameter. `type` is the --cp-comm-type (with its flags). */
static void check_cp_model(int cp, int tp, int ep, const char *type, const char *heads,
                           int steps) {
    moe_comm *world = moe_test_world();
    const int W = moe_comm_size(world), rank = moe_comm_rank(world);
    if (W % (cp * tp) != 0)
        return;
    char common[256], dist_flags[256];
    snprintf(common, sizeof common, "--lr 1e-2 %s", heads);
    snprintf(dist_flags, sizeof dist_flags, "--context-parallel-size %d --cp-comm-type %s", cp,
             type);
    moe_trainer *dist, *ref;
    if (!moe_test_folding(world, CP_MODEL, tp, tp > 1, ep, common, dist_flags, on_gpu(), &dist,
                          &ref))
        return;
    /* each rank holds T/CP tokens of each sequence: its activations are smaller */
    ck_assert_int_eq(dist->model->max_T * cp, ref->model->max_T);
    ck_assert(dist->model->mem.act_bytes < ref->model->mem.act_bytes);
    /* GPU ranks: bf16 activations, the bounds of mpi_tp and mpi_dp (the loss 1e-3, the
     * gradients 2e-2, later losses 2e-3, the parameters after AdamW 2e-2) */
    const double tol = on_gpu() ? 1e-3 : 1e-5, tol_grad = on_gpu() ? 2e-2 : 1e-5;
    const double tol_steps = on_gpu() ? 2e-3 : 1e-4, tol_param = on_gpu() ? 2e-2 : 1e-4;
    moe_step_stats sd, sr;
    moe_trainer_gradients(dist, &sd);
    moe_trainer_gradients(ref, &sr);
    const double dloss = fabs(sd.loss - sr.loss) / fabs(sr.loss);
    MOE_TEST_AGREE(!(dloss <= tol), "CP %d TP %d EP %d %s: loss %.8f (ce %.8f aux %.8f z %.8f) "
                   "vs one process %.8f (ce %.8f aux %.8f z %.8f) on rank %d", cp, tp, ep, type,
                   sd.loss, sd.ce, sd.aux, sd.z, sr.loss, sr.ce, sr.aux, sr.z, rank);
    double worst;
    const char *worst_name;
    const long long bad = moe_test_compare_shards(dist, ref, tol_grad, &worst, &worst_name);
    MOE_TEST_AGREE(bad, "CP %d TP %d EP %d %s: %lld tensors' gradients differ (rank %d: worst "
                   "%s, relative %.2e)", cp, tp, ep, type, bad, rank, worst_name, worst);
    moe_trainer_update(dist, &sd);
    moe_trainer_update(ref, &sr);
    MOE_TEST_AGREE(!(fabs(sd.grad_norm - sr.grad_norm) <= 10 * tol * sr.grad_norm),
                   "CP %d TP %d EP %d %s: gradient norm %.8f vs %.8f (each tensor counted once?)",
                   cp, tp, ep, type, sd.grad_norm, sr.grad_norm);
    double last = 0, last_ref = 0, worst_step = 0;
    for (int s = 1; s < steps; s++) {
        moe_step_stats a, b;
        moe_trainer_step(dist, &a, NULL);
        moe_trainer_step(ref, &b, NULL);
        worst_step = fmax(worst_step, fabs(a.loss - b.loss) / fabs(b.loss));
        last = a.loss;
        last_ref = b.loss;
    }
    MOE_TEST_AGREE(!(worst_step <= tol_steps), "CP %d TP %d EP %d %s: a later step's loss differs by "
                   "%.2e (relative)", cp, tp, ep, type, worst_step);
    /* the parameters after the steps: AdamW's 1/√v amplifies the sums' rounding */
    const double worst_grad = worst;
    const long long pbad = moe_test_compare_state(dist, ref, -1.0, tol_param, &worst, &worst_name);
    MOE_TEST_AGREE(pbad, "CP %d TP %d EP %d %s: %lld tensors differ from one process's after "
                   "%d steps (rank %d: worst %s, relative %.2e)", cp, tp, ep, type, pbad, steps,
                   rank, worst_name, worst);
    if (rank == 0)
        printf("  CP %d %s x TP %d x DP %d, EP %d%s: loss %.8f = one process %.8f (rel %.1e), "
               "gradients rel %.1e; after %d steps loss %.8f = %.8f, parameters rel %.1e\n",
               cp, type, tp, W / (cp * tp), ep, strstr(heads, "seq_aux") ? ", seq_aux_loss" : "",
               sd.loss, sr.loss, dloss, worst_grad, steps, last, last_ref, worst);
    moe_trainer_free(dist);
    moe_trainer_free(ref);
}

/* CP 2 and 4 (where the ranks allow), each exchange: the ring, the all-gather, Ulysses (its
 * heads must divide by CP: 4 query heads, 4 groups) and the hybrid at each split of CP */
START_TEST(test_cp_model_equals_one_process) {
    for (int cp = 2; cp <= 4; cp *= 2) {
        check_cp_model(cp, 1, 1, "p2p", "--num-query-groups 2", 3);
        check_cp_model(cp, 1, 1, "allgather", "--num-query-groups 2", 3);
        check_cp_model(cp, 1, 1, "a2a", "--num-query-groups 4", 3);
        /* the per-sequence aux loss: each sequence's two chunks on every rank */
        check_cp_model(cp, 1, 1, "p2p", "--num-query-groups 2 " SEQ_AUX, 3);
        for (int a2a = 1; a2a <= cp; a2a *= 2) {
            char type[96];
            snprintf(type, sizeof type, "a2a+p2p --hierarchical-context-parallel-sizes %d,%d",
                     a2a, cp / a2a);
            check_cp_model(cp, 1, 1, type, "--num-query-groups 4", 2);
        }
    }
}
END_TEST

/* CP in the folding of chapter 04: CP 2 x TP 2 (+ SP: the router statistics over the TP x CP
 * group of 4), and CP 2 with the experts over EP 2 (their gradients over EDP, which holds
 * the CP ranks) and EP 4 */
START_TEST(test_cp_model_folded) {
    check_cp_model(2, 2, 1, "p2p", "--num-query-groups 2", 3);
    check_cp_model(2, 2, 1, "p2p", "--num-query-groups 2 " SEQ_AUX, 3); /* SP shards of chunks */
    check_cp_model(2, 2, 2, "a2a", "--num-query-groups 4", 2);
    check_cp_model(2, 1, 2, "p2p", "--num-query-groups 2", 3);
    check_cp_model(2, 1, 4, "allgather", "--num-query-groups 2", 2);
}
END_TEST

/* Sampling under CP (moe_trainer_sample): every rank runs its chunks of each window, the rank
 * holding the last token's row shares its logits, and the text equals one process's, for
 * windows shorter than the sequence (padded to 2·CP tokens) and sliding past it. On CPU
 * ranks exactly; on GPU ranks bf16 rounding may flip a near-tie, so there every rank must
 * get the same text (the picks are collective). */
START_TEST(test_cp_sample_equals_one_process) {
    moe_comm *world = moe_test_world();
    const int W = moe_comm_size(world), rank = moe_comm_rank(world);
    for (int cp = 2; cp <= 4 && cp <= W; cp *= 2) {
        if (W % cp != 0)
            continue;
        char dist_flags[96];
        snprintf(dist_flags, sizeof dist_flags, "--context-parallel-size %d --cp-comm-type p2p",
                 cp);
        moe_trainer *dist, *ref;
        if (!moe_test_folding(world, CP_MODEL, 1, 0, 1, "--lr 1e-2 --num-query-groups 2",
                              dist_flags, on_gpu(), &dist, &ref))
            continue;
        enum { N = 40 }; /* past the 16-token sequence: the window slides */
        char a[N + 1], b[N + 1];
        moe_trainer_sample(dist, N, 0.8, 7, a);
        moe_trainer_sample(ref, N, 0.8, 7, b);
        unsigned long h = 5381;
        for (int i = 0; i < N; i++)
            h = h * 33 + (unsigned char)a[i];
        const int same_ranks = moe_comm_host_max(world, (double)h) == (double)h &&
                               -moe_comm_host_max(world, -(double)h) == (double)h;
        MOE_TEST_AGREE(!same_ranks, "CP %d: the ranks sampled different texts", cp);
        if (!on_gpu())
            MOE_TEST_AGREE(memcmp(a, b, N) != 0, "CP %d on rank %d: sampled '%s', one process "
                           "'%s'", cp, rank, a, b);
        if (rank == 0)
            printf("  CP %d sample (%d characters): %s one process's\n", cp, N,
                   memcmp(a, b, N) ? "differs from (GPU: bf16 near-ties)" : "equals");
        moe_trainer_free(dist);
        moe_trainer_free(ref);
    }
}
END_TEST

Suite *suite_mpi_cp(void) {
    const TTest *const tests[] = {test_cp_attention_equals_one_process,
                                  test_cp_model_equals_one_process, test_cp_model_folded,
                                  test_cp_sample_equals_one_process};
    return moe_test_chapter_suite("mpi_cp", "ch07", tests, 4);
}
