/*
 * The CPU flash attention (lib/cpu/attention.c, chapter 07) against the naive attention it
 * replaced, kept in the library as the reference (moe_cpu_attention_naive_*), on fresh
 * random inputs.
 *
 *  - flash == naive, forward (y, lse) and backward (dq, dk, dv), for GQA 4/2 and 4/1, head
 *    dims 5, 64 and 128, and sequence lengths 1, 7, 63, 64, 65 and 130 (around the tile
 *    boundaries of MOE_CPU_ATTENTION_BQ = BK = 64), B = 2. The forward's outputs are NaN
 *    before the call, so an element it does not write fails; the gradients start from random
 *    values, and both the totals and the increments (total − start) are compared, so a
 *    backward that overwrites instead of adding, or skips an element, fails.
 *  - chunks at position offsets (what context parallelism will ask for), against slices of
 *    the whole-sequence naive attention: a query chunk against the keys before it; two key
 *    chunks whose partial (y, lse) merge into the whole rows, with rows that see no key of a
 *    chunk (y = 0, lse = −∞); and the backward of each key chunk, given the merged y and lse,
 *    adding exactly that chunk's share of the gradients.
 *  - the result does not depend on the number of OpenMP threads (bit for bit).
 *  - the whole model with the CPU table (flash: no workspace allocated) against the same
 *    model with the naive ops in the table (their workspace allocated): the same loss and
 *    gradients.
 *
 * Errors are max_i |a_i − b_i| / max_i |b_i| over a tensor (as the GPU tests measure them),
 * lse's |a − b| / max(|b|, 1): fp32, bound 1e-5 (the differences are summation order and
 * the online rescaling: about 1e-7 to 1e-6 measured, so the bound has a margin of 10).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "backend.h"
#include "cpu/ops.h"
#include "helpers.h"
#include "model.h"
#include "suites.h"

#define TOL 1e-5

static moe_real *alloc_real(size_t n) {
    moe_real *x = malloc((n ? n : 1) * sizeof *x);
    ck_assert_ptr_nonnull(x);
    return x;
}

static moe_real *randn(size_t n, uint64_t stream) {
    moe_real *x = alloc_real(n);
    moe_test_randn(x, n, stream, 1.0);
    return x;
}

static moe_real *poisoned(size_t n) {
    moe_real *x = alloc_real(n);
    moe_test_poison(x, n);
    return x;
}

static moe_real *copy_of(const moe_real *x, size_t n) {
    moe_real *y = alloc_real(n);
    memcpy(y, x, n * sizeof *y);
    return y;
}

static moe_real *zeros(size_t n) {
    moe_real *x = alloc_real(n);
    memset(x, 0, n * sizeof *x);
    return x;
}

/* max_i |a_i − b_i| / max_i |b_i| over a tensor (NaN or inf anywhere: infinite) */
static double rel_err(const moe_real *a, const moe_real *b, size_t n) {
    double mx = 0.0, worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        mx = fmax(mx, fabs((double)b[i]));
        const double d = fabs((double)a[i] - (double)b[i]);
        worst = isnan(d) || isinf(d) ? INFINITY : fmax(worst, d);
    }
    return worst / fmax(mx, 1e-30);
}

/* The same for the increments a − start against b − start. Where the reference increment is
 * exactly 0 everywhere (dq and dk when every row sees one key: dS = P(dP − δ) = 0), the
 * increment must be 0 up to rounding: max|a − start| against max|b|. */
static double rel_err_inc(const moe_real *a, const moe_real *b, const moe_real *start,
                          size_t n) {
    double mx = 0.0, mb = 0.0, worst = 0.0, ma = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double da = (double)a[i] - start[i], db = (double)b[i] - start[i];
        mx = fmax(mx, fabs(db));
        mb = fmax(mb, fabs((double)b[i]));
        ma = isnan(da) ? INFINITY : fmax(ma, fabs(da));
        const double d = fabs(da - db);
        worst = isnan(d) || isinf(d) ? INFINITY : fmax(worst, d);
    }
    return mx > 0 ? worst / mx : ma / fmax(mb, 1e-30);
}

/* lse against a reference: |a − b| / max(|b|, 1), both −∞ counts as equal */
static double lse_err(const moe_real *a, const moe_real *b, size_t n) {
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (isinf(b[i]) && b[i] < 0 && isinf(a[i]) && a[i] < 0)
            continue;
        const double e = fabs((double)a[i] - b[i]) / fmax(fabs((double)b[i]), 1.0);
        worst = isnan(e) ? INFINITY : fmax(worst, e);
    }
    return worst;
}

/* rows [r0, r0 + n) of every sequence of x [B·T, width] */
static moe_real *rows_of(const moe_real *x, int B, int T, int width, int r0, int n) {
    moe_real *out = alloc_real((size_t)B * n * width);
    for (int b = 0; b < B; b++)
        memcpy(out + (size_t)b * n * width, x + ((size_t)b * T + r0) * width,
               sizeof *out * (size_t)n * width);
    return out;
}

/* rows [r0, r0 + n) of every (b, h) of lse [B, H, T] */
static moe_real *lse_rows(const moe_real *l, int BH, int T, int r0, int n) {
    moe_real *out = alloc_real((size_t)BH * n);
    for (int bh = 0; bh < BH; bh++)
        memcpy(out + (size_t)bh * n, l + (size_t)bh * T + r0, sizeof *out * (size_t)n);
    return out;
}

/* ------------------------------------------------------------ flash == naive */

static const int GROUPS[][2] = {{4, 2}, {4, 1}}; /* (Hq, Hkv) */
static const int DIMS[] = {5, 64, 128};
static const int LENS[] = {1, 7, 63, 64, 65, 130};
#define NLENS ((int)(sizeof LENS / sizeof *LENS))
#define NDIMS ((int)(sizeof DIMS / sizeof *DIMS))
#define NCASES (2 * NDIMS * NLENS)

START_TEST(test_flash_matches_naive) {
    const int B = 2, Hq = GROUPS[_i / (NDIMS * NLENS)][0], Hkv = GROUPS[_i / (NDIMS * NLENS)][1];
    const int D = DIMS[(_i / NLENS) % NDIMS], T = LENS[_i % NLENS];
    const int pos = (_i % 2) ? 37 : 0; /* a chunk attending to itself at an offset */
    const moe_attention_shape sh = {B, T, T, Hq, Hkv, D, pos, pos};
    const size_t nq = (size_t)B * T * Hq * D, nkv = (size_t)B * T * Hkv * D;
    const size_t nl = (size_t)B * Hq * T;
    const uint64_t seed = 1000 + 16 * (uint64_t)_i;
    moe_real *q = randn(nq, seed), *k = randn(nkv, seed + 1), *v = randn(nkv, seed + 2);
    moe_real *dy = randn(nq, seed + 3);
    moe_real *dq0 = randn(nq, seed + 4), *dk0 = randn(nkv, seed + 5), *dv0 = randn(nkv, seed + 6);

    ck_assert_uint_eq(moe_cpu_attention_workspace_bytes(sh), 0);
    ck_assert_uint_eq(moe_cpu_attention_naive_workspace_bytes(sh),
                      sizeof(moe_real) * (size_t)B * Hq * T * T);
    void *ws = malloc(moe_cpu_attention_naive_workspace_bytes(sh));
    ck_assert_ptr_nonnull(ws);
    moe_real *y_ref = poisoned(nq), *l_ref = poisoned(nl);
    moe_cpu_attention_naive_forward(y_ref, l_ref, ws, q, k, v, sh);
    moe_real *y = poisoned(nq), *l = poisoned(nl);
    moe_cpu_attention_forward(y, l, NULL, q, k, v, sh);
    const double ey = rel_err(y, y_ref, nq), el = lse_err(l, l_ref, nl);

    moe_real *dq_ref = copy_of(dq0, nq), *dk_ref = copy_of(dk0, nkv), *dv_ref = copy_of(dv0, nkv);
    moe_cpu_attention_naive_backward(dq_ref, dk_ref, dv_ref, dy, y_ref, l_ref, ws, q, k, v, sh);
    moe_real *dq = copy_of(dq0, nq), *dk = copy_of(dk0, nkv), *dv = copy_of(dv0, nkv);
    moe_cpu_attention_backward(dq, dk, dv, dy, y, l, NULL, q, k, v, sh);
    const double eq = rel_err(dq, dq_ref, nq), ek = rel_err(dk, dk_ref, nkv),
                 ev = rel_err(dv, dv_ref, nkv);
    const double iq = rel_err_inc(dq, dq_ref, dq0, nq), ik = rel_err_inc(dk, dk_ref, dk0, nkv),
                 iv = rel_err_inc(dv, dv_ref, dv0, nkv);
    if (getenv("MOE_TEST_VERBOSE"))
        printf("flash vs naive Hq=%d Hkv=%d D=%3d T=%3d: y %.1e lse %.1e | dq %.1e dk %.1e "
               "dv %.1e | increments %.1e %.1e %.1e\n",
               Hq, Hkv, D, T, ey, el, eq, ek, ev, iq, ik, iv);
    const char *what = "flash vs naive";
    ck_assert_msg(ey <= TOL, "%s Hq=%d Hkv=%d D=%d T=%d: y error %g", what, Hq, Hkv, D, T, ey);
    ck_assert_msg(el <= TOL, "%s Hq=%d Hkv=%d D=%d T=%d: lse error %g", what, Hq, Hkv, D, T, el);
    ck_assert_msg(eq <= TOL && iq <= TOL, "%s Hq=%d Hkv=%d D=%d T=%d: dq error %g (increment %g)",
                  what, Hq, Hkv, D, T, eq, iq);
    ck_assert_msg(ek <= TOL && ik <= TOL, "%s Hq=%d Hkv=%d D=%d T=%d: dk error %g (increment %g)",
                  what, Hq, Hkv, D, T, ek, ik);
    ck_assert_msg(ev <= TOL && iv <= TOL, "%s Hq=%d Hkv=%d D=%d T=%d: dv error %g (increment %g)",
                  what, Hq, Hkv, D, T, ev, iv);
    free(q); free(k); free(v); free(dy); free(dq0); free(dk0); free(dv0); free(ws);
    free(y_ref); free(l_ref); free(y); free(l);
    free(dq_ref); free(dk_ref); free(dv_ref); free(dq); free(dk); free(dv);
}
END_TEST

/* ------------------------------------------------------------ chunks at offsets */

enum { CB = 2, CT = 130, CHQ = 4, CHKV = 2, CD = 16 };

typedef struct whole {
    moe_real *q, *k, *v, *dy, *y, *lse, *dq, *dk, *dv;
} whole;

/* The whole sequence through the naive attention: y, lse and the gradients (from zero) of
 * the output gradient dy, whose rows before @p dy_from are zero. */
static whole whole_sequence(int dy_from) {
    const moe_attention_shape sh = {CB, CT, CT, CHQ, CHKV, CD, 0, 0};
    const size_t nq = (size_t)CB * CT * CHQ * CD, nkv = (size_t)CB * CT * CHKV * CD;
    whole w = {randn(nq, 1), randn(nkv, 2), randn(nkv, 3), randn(nq, 4), poisoned(nq),
               poisoned((size_t)CB * CHQ * CT), zeros(nq), zeros(nkv), zeros(nkv)};
    for (int b = 0; b < CB; b++)
        memset(w.dy + (size_t)b * CT * CHQ * CD, 0, sizeof(moe_real) * (size_t)dy_from * CHQ * CD);
    void *ws = malloc(moe_cpu_attention_naive_workspace_bytes(sh));
    ck_assert_ptr_nonnull(ws);
    moe_cpu_attention_naive_forward(w.y, w.lse, ws, w.q, w.k, w.v, sh);
    moe_cpu_attention_naive_backward(w.dq, w.dk, w.dv, w.dy, w.y, w.lse, ws, w.q, w.k, w.v, sh);
    free(ws);
    return w;
}

static void whole_free(whole *w) {
    free(w->q); free(w->k); free(w->v); free(w->dy); free(w->y); free(w->lse);
    free(w->dq); free(w->dk); free(w->dv);
}

/* Queries at positions 70..129 against the keys 0..129 (Tq ≠ Tk, q_pos ≠ k_pos): the
 * whole sequence's rows 70..129, and with dy zero before row 70, its gradients. */
START_TEST(test_flash_query_chunk) {
    const int r0 = 70, n = CT - r0;
    whole w = whole_sequence(r0);
    const moe_attention_shape sh = {CB, n, CT, CHQ, CHKV, CD, r0, 0};
    const size_t nq = (size_t)CB * n * CHQ * CD, nkv = (size_t)CB * CT * CHKV * CD;
    moe_real *q = rows_of(w.q, CB, CT, CHQ * CD, r0, n), *dy = rows_of(w.dy, CB, CT, CHQ * CD, r0, n);
    moe_real *y = poisoned(nq), *lse = poisoned((size_t)CB * CHQ * n);
    moe_cpu_attention_forward(y, lse, NULL, q, w.k, w.v, sh);
    moe_real *y_ref = rows_of(w.y, CB, CT, CHQ * CD, r0, n);
    moe_real *l_ref = lse_rows(w.lse, CB * CHQ, CT, r0, n);
    ck_assert_double_le(rel_err(y, y_ref, nq), TOL);
    ck_assert_double_le(lse_err(lse, l_ref, (size_t)CB * CHQ * n), TOL);
    moe_real *dq = zeros(nq), *dk = zeros(nkv), *dv = zeros(nkv);
    moe_cpu_attention_backward(dq, dk, dv, dy, y, lse, NULL, q, w.k, w.v, sh);
    moe_real *dq_ref = rows_of(w.dq, CB, CT, CHQ * CD, r0, n);
    ck_assert_double_le(rel_err(dq, dq_ref, nq), TOL);
    ck_assert_double_le(rel_err(dk, w.dk, nkv), TOL);
    ck_assert_double_le(rel_err(dv, w.dv, nkv), TOL);
    free(q); free(dy); free(y); free(lse); free(y_ref); free(l_ref);
    free(dq); free(dk); free(dv); free(dq_ref);
    whole_free(&w);
}
END_TEST

/* All queries against the keys split in two chunks, 0..49 and 50..129 (a split inside a
 * tile). Each call gives a partial (y, lse); the rows before position 50 see no key of the
 * second chunk: y = 0 and lse = −∞ there. The merge
 *     lse = log(exp(lse₁) + exp(lse₂)),   y = exp(lse₁ − lse) y₁ + exp(lse₂ − lse) y₂
 * is the whole sequence's. Then the backward of each chunk, given the merged y and lse,
 * adds that chunk's share: dq summed over the calls, and each chunk's dk, dv rows, are the
 * whole sequence's gradients (ring attention's backward, in one process). */
START_TEST(test_flash_key_chunks_merge) {
    const int cut = 50;
    const int Tk[2] = {cut, CT - cut}, k0[2] = {0, cut};
    whole w = whole_sequence(0);
    const size_t nq = (size_t)CB * CT * CHQ * CD, nl = (size_t)CB * CHQ * CT;
    moe_real *y[2], *lse[2], *k[2], *v[2];
    for (int c = 0; c < 2; c++) {
        const moe_attention_shape sh = {CB, CT, Tk[c], CHQ, CHKV, CD, 0, k0[c]};
        k[c] = rows_of(w.k, CB, CT, CHKV * CD, k0[c], Tk[c]);
        v[c] = rows_of(w.v, CB, CT, CHKV * CD, k0[c], Tk[c]);
        y[c] = poisoned(nq);
        lse[c] = poisoned(nl);
        moe_cpu_attention_forward(y[c], lse[c], NULL, w.q, k[c], v[c], sh);
    }
    for (int bh = 0; bh < CB * CHQ; bh++) /* rows that see no key of chunk 2 */
        for (int t = 0; t < cut; t++) {
            const moe_real l2 = lse[1][(size_t)bh * CT + t];
            ck_assert_msg(isinf(l2) && l2 < 0, "lse of a row that sees no key: %g", (double)l2);
        }
    for (size_t r = 0; r < (size_t)CB * CT; r++)
        for (int h = 0; h < CHQ; h++)
            if ((int)(r % CT) < cut)
                for (int d = 0; d < CD; d++)
                    ck_assert(y[1][(r * CHQ + h) * CD + d] == 0);
    moe_real *ym = alloc_real(nq), *lm = alloc_real(nl);
    for (int b = 0; b < CB; b++)
        for (int h = 0; h < CHQ; h++)
            for (int t = 0; t < CT; t++) {
                const size_t i = ((size_t)b * CHQ + h) * CT + t;
                const double l1 = lse[0][i], l2 = lse[1][i], m = fmax(l1, l2);
                const double l = m + log(exp(l1 - m) + exp(l2 - m));
                const double a1 = exp(l1 - l), a2 = exp(l2 - l);
                lm[i] = (moe_real)l;
                const size_t row = (((size_t)b * CT + t) * CHQ + h) * CD;
                for (int d = 0; d < CD; d++)
                    ym[row + d] = (moe_real)(a1 * y[0][row + d] + a2 * y[1][row + d]);
            }
    ck_assert_double_le(rel_err(ym, w.y, nq), TOL);
    ck_assert_double_le(lse_err(lm, w.lse, nl), TOL);
    /* backward per key chunk from the merged y and lse */
    moe_real *dq = zeros(nq);
    for (int c = 0; c < 2; c++) {
        const moe_attention_shape sh = {CB, CT, Tk[c], CHQ, CHKV, CD, 0, k0[c]};
        const size_t nkv = (size_t)CB * Tk[c] * CHKV * CD;
        moe_real *dk = zeros(nkv), *dv = zeros(nkv);
        moe_cpu_attention_backward(dq, dk, dv, w.dy, ym, lm, NULL, w.q, k[c], v[c], sh);
        moe_real *dk_ref = rows_of(w.dk, CB, CT, CHKV * CD, k0[c], Tk[c]);
        moe_real *dv_ref = rows_of(w.dv, CB, CT, CHKV * CD, k0[c], Tk[c]);
        ck_assert_double_le(rel_err(dk, dk_ref, nkv), TOL);
        ck_assert_double_le(rel_err(dv, dv_ref, nkv), TOL);
        free(dk); free(dv); free(dk_ref); free(dv_ref);
    }
    ck_assert_double_le(rel_err(dq, w.dq, nq), TOL);
    for (int c = 0; c < 2; c++) {
        free(y[c]); free(lse[c]); free(k[c]); free(v[c]);
    }
    free(ym); free(lm); free(dq);
    whole_free(&w);
}
END_TEST

/* --------------------------------------------------------- threads, bit for bit */

#ifdef _OPENMP
START_TEST(test_flash_thread_count) {
    const moe_attention_shape sh = {CB, CT, CT, CHQ, CHKV, CD, 0, 0};
    const size_t nq = (size_t)CB * CT * CHQ * CD, nkv = (size_t)CB * CT * CHKV * CD;
    const size_t nl = (size_t)CB * CHQ * CT;
    moe_real *q = randn(nq, 21), *k = randn(nkv, 22), *v = randn(nkv, 23), *dy = randn(nq, 24);
    moe_real *out[2][5];
    const int saved = omp_get_max_threads(), threads[2] = {1, 3};
    for (int r = 0; r < 2; r++) {
        omp_set_num_threads(threads[r]);
        moe_real **o = out[r];
        o[0] = poisoned(nq);
        o[1] = poisoned(nl);
        o[2] = zeros(nq);
        o[3] = zeros(nkv);
        o[4] = zeros(nkv);
        moe_cpu_attention_forward(o[0], o[1], NULL, q, k, v, sh);
        moe_cpu_attention_backward(o[2], o[3], o[4], dy, o[0], o[1], NULL, q, k, v, sh);
    }
    omp_set_num_threads(saved);
    const size_t n[5] = {nq, nl, nq, nkv, nkv};
    const char *names[5] = {"y", "lse", "dq", "dk", "dv"};
    for (int i = 0; i < 5; i++) {
        ck_assert_msg(memcmp(out[0][i], out[1][i], n[i] * sizeof(moe_real)) == 0,
                      "%s differs between 1 and 3 threads", names[i]);
        free(out[0][i]);
        free(out[1][i]);
    }
    free(q); free(k); free(v); free(dy);
}
END_TEST
#endif

/* ------------------------------------------------------------ the whole model */

static void naive_fwd(void *y, moe_real *lse, void *ws, const void *q, const void *k,
                      const void *v, moe_attention_shape s) {
    moe_cpu_attention_naive_forward(y, lse, ws, q, k, v, s);
}
static void naive_bwd(void *dq, void *dk, void *dv, const void *dy, const void *y,
                      const moe_real *lse, void *ws, const void *q, const void *k, const void *v,
                      moe_attention_shape s) {
    moe_cpu_attention_naive_backward(dq, dk, dv, dy, y, lse, ws, q, k, v, s);
}

/* The model sizes the attention workspace from the table (none for flash, P for the naive
 * ops), and both tables train the same model: loss and gradients. A sequence of 70 tokens
 * crosses a tile boundary; fp32 through two layers, the same bound as the ops (about 1e-6
 * measured on every tensor's gradient). */
START_TEST(test_model_flash_vs_naive) {
    const int V = 17, B = 2;
    moe_config c;
    moe_error err;
    ck_assert_int_eq(moe_test_config(&c, "--num-layers 2 --hidden-size 32 "
                                         "--num-attention-heads 4 --num-query-groups 2 "
                                         "--seq-length 70 --moe-ffn-hidden-size 16 "
                                         "--ffn-hidden-size 32 --num-experts 4 "
                                         "--moe-layer-freq [0,1] --init-method-std 0.2",
                                     &err),
                     MOE_OK);
    c.vocab_size = V;
    ck_assert_msg(moe_config_validate(&c, &err) == MOE_OK, "%s", err.msg);
    const int T = c.seq_length;
    moe_backend naive = *moe_backend_cpu();
    naive.attention_workspace_bytes = moe_cpu_attention_naive_workspace_bytes;
    naive.attention_forward = naive_fwd;
    naive.attention_backward = naive_bwd;
    moe_model *mf = NULL, *mn = NULL;
    ck_assert_int_eq(moe_model_create(&mf, &c, moe_backend_cpu(), B, NULL, &err), MOE_OK);
    ck_assert_int_eq(moe_model_create(&mn, &c, &naive, B, NULL, &err), MOE_OK);
    for (int l = 0; l < c.num_layers; l++) {
        ck_assert_ptr_null(mf->acts[l].attn.op_ws);
        ck_assert_ptr_nonnull(mn->acts[l].attn.op_ws);
    }
    moe_model_init(mf, 5);
    moe_model_init(mn, 5);
    int *tok = malloc(sizeof(int) * B * T), *tgt = malloc(sizeof(int) * B * T);
    ck_assert(tok && tgt);
    for (int i = 0; i < B * T; i++) {
        tok[i] = (i * 5 + 3) % V;
        tgt[i] = (i * 7 + 1) % V;
    }
    const double lf = moe_model_forward(mf, tok, tgt, B, T), ln = moe_model_forward(mn, tok, tgt, B, T);
    ck_assert_msg(fabs(lf - ln) <= TOL * fabs(ln), "loss flash %.9g naive %.9g", lf, ln);
    moe_model_zero_grad(mf);
    moe_model_zero_grad(mn);
    moe_model_backward(mf, 1.0);
    moe_model_backward(mn, 1.0);
    for (int t = 0; t < mf->table.n; t++) {
        const moe_tensor *ten = &mf->table.t[t];
        const double eg = rel_err(mf->grads + ten->offset, mn->grads + ten->offset, ten->numel);
        if (getenv("MOE_TEST_VERBOSE"))
            printf("model flash vs naive: %-32s %.1e\n", ten->name, eg);
        ck_assert_msg(eg <= TOL, "gradient of %s: flash vs naive error %g", ten->name, eg);
    }
    free(tok);
    free(tgt);
    moe_model_free(mf);
    moe_model_free(mn);
}
END_TEST

Suite *suite_attention(void) {
    Suite *s = suite_create("attention");
    TCase *tc = tcase_create("ch07");
    tcase_set_tags(tc, "ch07");
    tcase_set_timeout(tc, 60);
    tcase_add_loop_test(tc, test_flash_matches_naive, 0, NCASES);
    tcase_add_test(tc, test_flash_query_chunk);
    tcase_add_test(tc, test_flash_key_chunks_merge);
#ifdef _OPENMP
    tcase_add_test(tc, test_flash_thread_count);
#endif
    tcase_add_test(tc, test_model_flash_vs_naive);
    suite_add_tcase(s, tc);
    return s;
}
