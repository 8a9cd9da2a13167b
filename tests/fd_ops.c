/*
 * Finite-difference gradient checks for every CPU op, in double precision
 * (this file is compiled only into the fp64 test binary, see lib/real.h).
 *
 * Pattern: L = Σ r ⊙ op(inputs) with a fixed random r; the analytic gradient
 * is op_backward(dout = r); fd_check compares it with central differences.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cpu/ops.h"
#include "cpu/router.h"
#include "fd.h"
#include "helpers.h"
#include "lowp.h"
#include "mlp.h"
#include "suites.h"

#define TOL 1e-5
#define ALLOC(n) ((moe_real *)calloc((size_t)(n), sizeof(moe_real)))

/* ------------------------------------------------------------------ matmul */
typedef struct { int N, I, O; moe_real *in, *w, *out, *r; } mm_ctx;
static double mm_loss(void *p) {
    mm_ctx *c = p;
    moe_cpu_matmul_forward(c->out, c->in, c->w, c->N, c->I, c->O);
    return fd_dot(c->r, c->out, (size_t)c->N * c->O);
}
START_TEST(test_fd_matmul) {
    /* sizes that are not multiples of the 8x32 register tile, to cover edges */
    mm_ctx c = {37, 19, 45, 0, 0, 0, 0};
    c.in = ALLOC(c.N * c.I); c.w = ALLOC(c.O * c.I); c.out = ALLOC(c.N * c.O); c.r = ALLOC(c.N * c.O);
    moe_test_randn(c.in, c.N * c.I, 1, 1.0);
    moe_test_randn(c.w, c.O * c.I, 2, 1.0);
    moe_test_randn(c.r, c.N * c.O, 3, 1.0);
    moe_real *din = ALLOC(c.N * c.I), *dw = ALLOC(c.O * c.I);
    moe_cpu_matmul_backward(din, dw, c.r, c.in, c.w, c.N, c.I, c.O);
    ck_assert_double_le(fd_check("matmul din", mm_loss, &c, c.in, din, c.N * c.I, 400, TOL), TOL);
    ck_assert_double_le(fd_check("matmul dw", mm_loss, &c, c.w, dw, c.O * c.I, 400, TOL), TOL);
    /* backward accumulates: a second call doubles the gradient */
    moe_real *din2 = ALLOC(c.N * c.I);
    memcpy(din2, din, sizeof(moe_real) * c.N * c.I);
    moe_cpu_matmul_backward(din2, NULL, c.r, c.in, c.w, c.N, c.I, c.O);
    for (int i = 0; i < c.N * c.I; i++)
        ck_assert_double_eq_tol(din2[i], 2 * din[i], 1e-12);
    free(c.in); free(c.w); free(c.out); free(c.r); free(din); free(dw); free(din2);
    moe_cpu_matmul_release();
}
END_TEST

/* --------------------------------------------------------------- embedding */
typedef struct { int N, V, C; int *tok; moe_real *table, *out, *r; } emb_ctx;
static double emb_loss(void *p) {
    emb_ctx *c = p;
    moe_cpu_embedding_forward(c->out, c->tok, c->table, c->N, c->C);
    return fd_dot(c->r, c->out, (size_t)c->N * c->C);
}
START_TEST(test_fd_embedding) {
    emb_ctx c = {23, 7, 20, 0, 0, 0, 0};
    c.tok = malloc(sizeof(int) * c.N);
    for (int n = 0; n < c.N; n++)
        c.tok[n] = (n * 5) % 6; /* repeated tokens, and token 6 never used */
    c.table = ALLOC(c.V * c.C); c.out = ALLOC(c.N * c.C); c.r = ALLOC(c.N * c.C);
    moe_test_randn(c.table, c.V * c.C, 4, 1.0);
    moe_test_randn(c.r, c.N * c.C, 5, 1.0);
    moe_real *dt = ALLOC(c.V * c.C);
    moe_cpu_embedding_backward(dt, c.r, c.tok, c.N, c.V, c.C);
    ck_assert_double_le(fd_check("embedding", emb_loss, &c, c.table, dt, c.V * c.C, 1000, TOL), TOL);
    free(c.tok); free(c.table); free(c.out); free(c.r); free(dt);
}
END_TEST

/* ----------------------------------------------------------------- rmsnorm */
typedef struct { int N, C; moe_real *x, *w, *out, *rstd, *r; } rms_ctx;
static double rms_loss(void *p) {
    rms_ctx *c = p;
    moe_cpu_rmsnorm_forward(c->out, c->rstd, c->x, c->w, c->N, c->C, 1e-5);
    return fd_dot(c->r, c->out, (size_t)c->N * c->C);
}
START_TEST(test_fd_rmsnorm) {
    rms_ctx c = {11, 24, 0, 0, 0, 0, 0};
    c.x = ALLOC(c.N * c.C); c.w = ALLOC(c.C); c.out = ALLOC(c.N * c.C); c.rstd = ALLOC(c.N);
    c.r = ALLOC(c.N * c.C);
    moe_test_randn(c.x, c.N * c.C, 6, 1.0);
    moe_test_randn(c.w, c.C, 7, 1.0);
    moe_test_randn(c.r, c.N * c.C, 8, 1.0);
    rms_loss(&c);
    moe_real *dx = ALLOC(c.N * c.C), *dw = ALLOC(c.C);
    moe_cpu_rmsnorm_backward(dx, dw, c.r, c.x, c.w, c.rstd, c.N, c.C);
    ck_assert_double_le(fd_check("rmsnorm dx", rms_loss, &c, c.x, dx, c.N * c.C, 400, TOL), TOL);
    ck_assert_double_le(fd_check("rmsnorm dw", rms_loss, &c, c.w, dw, c.C, 400, TOL), TOL);
    free(c.x); free(c.w); free(c.out); free(c.rstd); free(c.r); free(dx); free(dw);
}
END_TEST

/* -------------------------------------------------------------------- rope */
typedef struct { int B, T, Hh, D; moe_real *in, *out, *r; } rope_ctx;
static double rope_loss(void *p) {
    rope_ctx *c = p;
    moe_cpu_rope_forward(c->out, c->in, c->B, c->T, c->Hh, c->D, 0, 10000.0);
    return fd_dot(c->r, c->out, (size_t)c->B * c->T * c->Hh * c->D);
}
START_TEST(test_fd_rope) {
    rope_ctx c = {2, 9, 3, 8, 0, 0, 0};
    size_t n = (size_t)c.B * c.T * c.Hh * c.D;
    c.in = ALLOC(n); c.out = ALLOC(n); c.r = ALLOC(n);
    moe_test_randn(c.in, n, 9, 1.0);
    moe_test_randn(c.r, n, 10, 1.0);
    moe_real *din = ALLOC(n);
    moe_cpu_rope_backward(din, c.r, c.B, c.T, c.Hh, c.D, 0, 10000.0);
    ck_assert_double_le(fd_check("rope", rope_loss, &c, c.in, din, n, 500, TOL), TOL);
    /* position 0 is the identity; a rotation keeps the norm of every pair */
    rope_loss(&c);
    for (int d = 0; d < c.D; d++)
        ck_assert_double_eq_tol(c.out[d], c.in[d], 1e-15);
    size_t row = (size_t)5 * c.Hh * c.D; /* t = 5 of sequence 0, head 0 */
    for (int i = 0; i < c.D / 2; i++) {
        double a = c.in[row + i], b = c.in[row + i + c.D / 2];
        double a2 = c.out[row + i], b2 = c.out[row + i + c.D / 2];
        ck_assert_double_eq_tol(a * a + b * b, a2 * a2 + b2 * b2, 1e-12);
    }
    free(c.in); free(c.out); free(c.r); free(din);
}
END_TEST

/* A chunk of a sequence that starts at position pos0 (what a context-parallel rank holds)
 * is rotated exactly as those rows of the whole sequence, forward and backward: the same
 * angles, so the same bits. */
START_TEST(test_rope_offset) {
    const int B = 2, T = 40, Hh = 3, D = 8, pos0 = 29, Tc = 11; /* chunk: rows 29..39 */
    const size_t row = (size_t)Hh * D, n = (size_t)B * T * row, nc = (size_t)B * Tc * row;
    moe_real *in = ALLOC(n), *out = ALLOC(n), *din = ALLOC(n);
    moe_real *cin = ALLOC(nc), *cout = ALLOC(nc), *cdin = ALLOC(nc);
    moe_test_randn(in, n, 15, 1.0);
    for (int b = 0; b < B; b++)
        memcpy(cin + (size_t)b * Tc * row, in + ((size_t)b * T + pos0) * row,
               sizeof(moe_real) * Tc * row);
    moe_cpu_rope_forward(out, in, B, T, Hh, D, 0, 10000.0);
    moe_cpu_rope_forward(cout, cin, B, Tc, Hh, D, pos0, 10000.0);
    moe_cpu_rope_backward(din, in, B, T, Hh, D, 0, 10000.0); /* in as the output gradient */
    moe_cpu_rope_backward(cdin, cin, B, Tc, Hh, D, pos0, 10000.0);
    for (int b = 0; b < B; b++) {
        const size_t full = ((size_t)b * T + pos0) * row, chunk = (size_t)b * Tc * row;
        ck_assert_mem_eq(cout + chunk, out + full, sizeof(moe_real) * Tc * row);
        ck_assert_mem_eq(cdin + chunk, din + full, sizeof(moe_real) * Tc * row);
    }
    free(in); free(out); free(din); free(cin); free(cout); free(cdin);
}
END_TEST

/* --------------------------------------------------------------- attention */
/* The CPU table's flash attention (any chunks, P recomputed from lse in the backward) and
 * the naive reference (P saved in its workspace), each against finite differences of its
 * own forward. */
typedef struct {
    moe_attention_shape s;
    int naive;
    moe_real *q, *k, *v, *y, *lse, *att, *r;
} att_ctx;
static double att_loss(void *p) {
    att_ctx *c = p;
    if (c->naive)
        moe_cpu_attention_naive_forward(c->y, c->lse, c->att, c->q, c->k, c->v, c->s);
    else
        moe_cpu_attention_forward(c->y, c->lse, NULL, c->q, c->k, c->v, c->s);
    return fd_dot(c->r, c->y, (size_t)c->s.B * c->s.Tq * c->s.Hq * c->s.D);
}

/* The op contract's lse against a reference computed here in double, straight from the
 * definition: lse_t = log Σ_s exp(q_t·k_s/√D) over the keys with k_pos + s ≤ q_pos + t,
 * −∞ (and y_t = 0) for a row that sees none. For the naive path, its saved P must be
 * exp(S − lse), the identity the flash backward recomputes P from. */
static void check_lse(const att_ctx *c) {
    const moe_attention_shape sh = c->s;
    const int Tq = sh.Tq, Tk = sh.Tk, D = sh.D, qs = sh.Hq * D, kvs = sh.Hkv * D;
    double *S = malloc(sizeof(double) * Tk);
    ck_assert_ptr_nonnull(S);
    for (int b = 0; b < sh.B; b++)
        for (int h = 0; h < sh.Hq; h++) {
            const int g = h / (sh.Hq / sh.Hkv);
            for (int t = 0; t < Tq; t++) {
                const moe_real *qt = c->q + ((size_t)b * Tq + t) * qs + (size_t)h * D;
                const size_t row = ((size_t)b * sh.Hq + h) * Tq + t;
                const int last = sh.q_pos + t - sh.k_pos < Tk - 1 ? sh.q_pos + t - sh.k_pos : Tk - 1;
                if (last < 0) { /* a row that sees no key */
                    ck_assert_msg(isinf(c->lse[row]) && c->lse[row] < 0,
                                  "lse of a row without keys = %g", (double)c->lse[row]);
                    for (int d = 0; d < D; d++)
                        ck_assert(c->y[((size_t)b * Tq + t) * qs + (size_t)h * D + d] == 0);
                    continue;
                }
                double m = -INFINITY, sum = 0.0;
                for (int u = 0; u <= last; u++) {
                    const moe_real *ku = c->k + ((size_t)b * Tk + u) * kvs + (size_t)g * D;
                    double dot = 0.0;
                    for (int d = 0; d < D; d++)
                        dot += (double)qt[d] * ku[d];
                    S[u] = dot / sqrt((double)D);
                    m = S[u] > m ? S[u] : m;
                }
                for (int u = 0; u <= last; u++)
                    sum += exp(S[u] - m);
                const double ref = m + log(sum);
                ck_assert_msg(fabs(c->lse[row] - ref) <= 1e-12 * (1.0 + fabs(ref)),
                              "lse[b=%d h=%d t=%d] = %.17g, reference %.17g", b, h, t,
                              (double)c->lse[row], ref);
                if (c->naive)
                    for (int u = 0; u <= last; u++)
                        ck_assert_double_eq_tol(c->att[row * Tk + u], exp(S[u] - c->lse[row]),
                                                1e-12);
            }
        }
    free(S);
}

/* One shape through one implementation: the forward's lse (and P), then the backward,
 * which accumulates onto non-zero gradients, against central differences. */
static void fd_attention(moe_attention_shape sh, int naive, uint64_t seed) {
    att_ctx c = {sh, naive, 0, 0, 0, 0, 0, 0, 0};
    const int B = sh.B, Hq = sh.Hq, Hkv = sh.Hkv, D = sh.D;
    const size_t nq = (size_t)B * sh.Tq * Hq * D, nk = (size_t)B * sh.Tk * Hkv * D;
    c.q = ALLOC(nq); c.k = ALLOC(nk); c.v = ALLOC(nk); c.y = ALLOC(nq); c.r = ALLOC(nq);
    c.lse = ALLOC((size_t)B * Hq * sh.Tq);
    if (naive) {
        ck_assert_uint_eq(moe_cpu_attention_naive_workspace_bytes(sh),
                          sizeof(moe_real) * (size_t)B * Hq * sh.Tq * sh.Tk);
        c.att = malloc(moe_cpu_attention_naive_workspace_bytes(sh));
    } else {
        ck_assert_uint_eq(moe_cpu_attention_workspace_bytes(sh), 0);
    }
    moe_test_randn(c.q, nq, seed, 1.0);
    moe_test_randn(c.k, nk, seed + 1, 1.0);
    moe_test_randn(c.v, nk, seed + 2, 1.0);
    moe_test_randn(c.r, nq, seed + 3, 1.0);
    att_loss(&c);
    if (naive) /* causality: rows of P sum to 1 and nothing attends to the future */
        for (int bh = 0; bh < B * Hq; bh++)
            for (int t = 0; t < sh.Tq; t++) {
                double s = 0;
                for (int u = 0; u < sh.Tk; u++) {
                    double pv = c.att[((size_t)bh * sh.Tq + t) * sh.Tk + u];
                    if (u > t)
                        ck_assert_double_eq(pv, 0.0);
                    s += pv;
                }
                ck_assert_double_eq_tol(s, 1.0, 1e-12);
            }
    check_lse(&c);
    /* the gradients start at 1: the backward adds to them, and the check subtracts the 1 */
    moe_real *dq = ALLOC(nq), *dk = ALLOC(nk), *dv = ALLOC(nk);
    for (size_t i = 0; i < nq; i++)
        dq[i] = 1;
    for (size_t i = 0; i < nk; i++)
        dk[i] = dv[i] = 1;
    if (naive)
        moe_cpu_attention_naive_backward(dq, dk, dv, c.r, c.y, c.lse, c.att, c.q, c.k, c.v, sh);
    else
        moe_cpu_attention_backward(dq, dk, dv, c.r, c.y, c.lse, NULL, c.q, c.k, c.v, sh);
    for (size_t i = 0; i < nq; i++)
        dq[i] -= 1;
    for (size_t i = 0; i < nk; i++) {
        dk[i] -= 1;
        dv[i] -= 1;
    }
    char what[96];
    const char *name = naive ? "naive" : "flash";
    snprintf(what, sizeof what, "%s attention Tq=%d Tk=%d q_pos=%d k_pos=%d dq", name, sh.Tq,
             sh.Tk, sh.q_pos, sh.k_pos);
    ck_assert_double_le(fd_check(what, att_loss, &c, c.q, dq, nq, 300, TOL), TOL);
    what[strlen(what) - 2] = 'k';
    ck_assert_double_le(fd_check(what, att_loss, &c, c.k, dk, nk, 300, TOL), TOL);
    what[strlen(what) - 2] = 'v';
    ck_assert_double_le(fd_check(what, att_loss, &c, c.v, dv, nk, 300, TOL), TOL);
    free(c.q); free(c.k); free(c.v); free(c.y); free(c.r); free(c.lse); free(c.att);
    free(dq); free(dk); free(dv);
}

START_TEST(test_fd_attention) {
    /* GQA: 2 query heads per kv head; at an offset (q_pos = k_pos: the same chunk) */
    const moe_attention_shape self = {2, 7, 7, 4, 2, 6, 3, 3};
    fd_attention(self, 1, 11); /* the reference the flash version is tested against */
    fd_attention(self, 0, 11);
    /* more than one query and key tile (64), a partial last tile, 4 query heads on 1 */
    const moe_attention_shape tiles = {1, 70, 70, 4, 1, 4, 0, 0};
    fd_attention(tiles, 0, 21);
}
END_TEST

/* The flash backward on chunks at other offsets (context parallelism's calls): queries at
 * 60..129 against keys 0..74 (two key tiles, every row sees some), and queries 0..8 against
 * keys 3..14 (rows 0..2 see none: y = 0, lse = −∞, no gradient through them). */
START_TEST(test_fd_attention_chunks) {
    const moe_attention_shape later = {1, 70, 75, 2, 1, 3, 60, 0};
    fd_attention(later, 0, 31);
    const moe_attention_shape before = {2, 9, 12, 4, 2, 5, 0, 3};
    fd_attention(before, 0, 41);
}
END_TEST

/* In fp64, flash and naive agree to rounding, forward and backward: |a − b| / max(|b|, 1)
 * ≤ 1e-12 (the values are of order 1; near-zero entries are judged absolutely). */
START_TEST(test_attention_flash_equals_naive_fp64) {
    const moe_attention_shape sh = {2, 67, 67, 4, 2, 8, 5, 5};
    const size_t nq = (size_t)sh.B * sh.Tq * sh.Hq * sh.D, nk = (size_t)sh.B * sh.Tk * sh.Hkv * sh.D;
    const size_t nl = (size_t)sh.B * sh.Hq * sh.Tq;
    moe_real *q = ALLOC(nq), *k = ALLOC(nk), *v = ALLOC(nk), *dy = ALLOC(nq);
    moe_test_randn(q, nq, 51, 1.0);
    moe_test_randn(k, nk, 52, 1.0);
    moe_test_randn(v, nk, 53, 1.0);
    moe_test_randn(dy, nq, 54, 1.0);
    moe_real *y[2], *l[2], *g[2][3];
    void *ws = malloc(moe_cpu_attention_naive_workspace_bytes(sh));
    for (int naive = 0; naive < 2; naive++) {
        y[naive] = ALLOC(nq);
        l[naive] = ALLOC(nl);
        g[naive][0] = ALLOC(nq);
        g[naive][1] = ALLOC(nk);
        g[naive][2] = ALLOC(nk);
        if (naive) {
            moe_cpu_attention_naive_forward(y[1], l[1], ws, q, k, v, sh);
            moe_cpu_attention_naive_backward(g[1][0], g[1][1], g[1][2], dy, y[1], l[1], ws, q, k,
                                             v, sh);
        } else {
            moe_cpu_attention_forward(y[0], l[0], NULL, q, k, v, sh);
            moe_cpu_attention_backward(g[0][0], g[0][1], g[0][2], dy, y[0], l[0], NULL, q, k, v,
                                       sh);
        }
    }
    ck_assert_double_le(moe_test_max_rel_err(y[0], y[1], nq, 1.0), 1e-12);
    ck_assert_double_le(moe_test_max_rel_err(l[0], l[1], nl, 1.0), 1e-12);
    ck_assert_double_le(moe_test_max_rel_err(g[0][0], g[1][0], nq, 1.0), 1e-12);
    ck_assert_double_le(moe_test_max_rel_err(g[0][1], g[1][1], nk, 1.0), 1e-12);
    ck_assert_double_le(moe_test_max_rel_err(g[0][2], g[1][2], nk, 1.0), 1e-12);
    for (int i = 0; i < 2; i++) {
        free(y[i]); free(l[i]); free(g[i][0]); free(g[i][1]); free(g[i][2]);
    }
    free(q); free(k); free(v); free(dy); free(ws);
}
END_TEST

/* What the attention ops run today, and what they name as unsupported: the flash ops (CPU,
 * and CUDA up to D = 128) run every valid shape, any chunk of queries against any chunk of
 * keys; the naive CPU reference one chunk attending to itself. */
START_TEST(test_attention_shapes_supported) {
    const moe_attention_shape self = {2, 16, 16, 4, 2, 8, 0, 0};
    moe_attention_shape s = self;
    ck_assert_ptr_null(moe_attention_shape_unsupported(s, 128));
    ck_assert_ptr_null(moe_attention_shape_not_same_chunk(s));
    s.q_pos = s.k_pos = 48; /* a later chunk attending to itself: the same mask */
    ck_assert_ptr_null(moe_attention_shape_not_same_chunk(s));
    s.k_pos = 32; /* queries 48..63 against keys 32..47: another chunk (chapter 07) */
    ck_assert_ptr_nonnull(strstr(moe_attention_shape_not_same_chunk(s), "same chunk"));
    ck_assert_ptr_null(moe_attention_shape_unsupported(s, 128)); /* the flash ops run it */
    ck_assert_ptr_null(moe_attention_shape_invalid(s));
    s = self;
    s.Tk = 32; /* keys of two chunks */
    ck_assert_ptr_nonnull(strstr(moe_attention_shape_not_same_chunk(s), "same chunk"));
    ck_assert_ptr_null(moe_attention_shape_unsupported(s, 128));
    s = self;
    s.Hkv = 3; /* 4 query heads cannot share 3 key/value heads */
    ck_assert_ptr_nonnull(strstr(moe_attention_shape_unsupported(s, 0), "multiple of Hkv"));
    ck_assert_ptr_nonnull(strstr(moe_attention_shape_not_same_chunk(s), "multiple of Hkv"));
    ck_assert_ptr_nonnull(strstr(moe_attention_shape_invalid(s), "multiple of Hkv"));
    s = self;
    s.Tk = 0; /* no keys at all */
    ck_assert_ptr_nonnull(strstr(moe_attention_shape_invalid(s), "Tk >= 1"));
    s = self;
    s.D = 160;
    ck_assert_ptr_null(moe_attention_shape_unsupported(s, 0));
    ck_assert_ptr_nonnull(strstr(moe_attention_shape_unsupported(s, 128), "head dimension"));
}
END_TEST

/* ------------------------------------------------------------------ swiglu */
/* With and without the fused row scale: d gu always, d row_scale when scaled. The backward
 * accumulates, so it runs on pre-filled gradients and the test subtracts the fill. */
typedef struct { int N, F; moe_real *gu, *s, *out, *r; int scaled; } sw_ctx;
static double sw_loss(void *p) {
    sw_ctx *c = p;
    moe_cpu_swiglu_forward(c->out, c->gu, c->scaled ? c->s : NULL, c->N, c->F);
    return fd_dot(c->r, c->out, (size_t)c->N * c->F);
}
START_TEST(test_fd_swiglu) {
    for (int scaled = 0; scaled <= 1; scaled++) {
        sw_ctx c = {9, 13, 0, 0, 0, 0, scaled};
        const int ngu = c.N * 2 * c.F;
        c.gu = ALLOC(ngu); c.s = ALLOC(c.N); c.out = ALLOC(c.N * c.F); c.r = ALLOC(c.N * c.F);
        moe_test_randn(c.gu, ngu, 15, 2.0);
        moe_test_randn(c.s, c.N, 27, 1.0);
        moe_test_randn(c.r, c.N * c.F, 16, 1.0);
        moe_real *dgu = ALLOC(ngu), *ds = ALLOC(c.N), *fill_gu = ALLOC(ngu), *fill_s = ALLOC(c.N);
        moe_test_randn(fill_gu, ngu, 28, 1.0);
        moe_test_randn(fill_s, c.N, 29, 1.0);
        memcpy(dgu, fill_gu, sizeof(moe_real) * ngu);
        memcpy(ds, fill_s, sizeof(moe_real) * c.N);
        moe_cpu_swiglu_backward(dgu, scaled ? ds : NULL, c.r, c.gu, scaled ? c.s : NULL, c.N, c.F);
        for (int i = 0; i < ngu; i++)
            dgu[i] -= fill_gu[i];
        for (int n = 0; n < c.N; n++)
            ds[n] -= fill_s[n];
        ck_assert_double_le(fd_check(scaled ? "swiglu d gu (scaled)" : "swiglu d gu", sw_loss, &c,
                                     c.gu, dgu, ngu, 400, TOL), TOL);
        if (scaled)
            ck_assert_double_le(fd_check("swiglu d row_scale", sw_loss, &c, c.s, ds, c.N, 400, TOL),
                                TOL);
        else /* no row scale: drow_scale is NULL and nothing else may be touched */
            for (int n = 0; n < c.N; n++)
                ck_assert_double_eq(ds[n], 0.0);
        free(c.gu); free(c.s); free(c.out); free(c.r); free(dgu); free(ds); free(fill_gu);
        free(fill_s);
    }
}
END_TEST

/* ----------------------------------------------------------- cross entropy */
typedef struct { int N, V; int *tgt; moe_real *logits, *losses, *r; } ce_ctx;
static double ce_loss(void *p) {
    ce_ctx *c = p;
    moe_cpu_cross_entropy_forward(c->losses, c->logits, c->tgt, c->N, c->V);
    return fd_dot(c->r, c->losses, (size_t)c->N);
}
START_TEST(test_fd_cross_entropy) {
    ce_ctx c = {8, 11, 0, 0, 0, 0};
    c.tgt = malloc(sizeof(int) * c.N);
    for (int n = 0; n < c.N; n++)
        c.tgt[n] = (n * 3) % c.V;
    c.logits = ALLOC(c.N * c.V); c.losses = ALLOC(c.N); c.r = ALLOC(c.N);
    moe_test_randn(c.logits, c.N * c.V, 17, 3.0);
    moe_test_randn(c.r, c.N, 18, 1.0);
    moe_real *dl = ALLOC(c.N * c.V);
    moe_cpu_cross_entropy_backward(dl, c.r, c.logits, c.tgt, c.N, c.V);
    ck_assert_double_le(fd_check("cross entropy", ce_loss, &c, c.logits, dl, c.N * c.V, 400, TOL), TOL);
    /* NULL dloss means the mean: 1/N per row */
    moe_real *dm = ALLOC(c.N * c.V);
    moe_cpu_cross_entropy_backward(dm, NULL, c.logits, c.tgt, c.N, c.V);
    double row = 0;
    for (int v = 0; v < c.V; v++)
        row += dm[v];
    ck_assert_double_eq_tol(row, 0.0, 1e-14); /* softmax − onehot sums to zero */
    free(c.tgt); free(c.logits); free(c.losses); free(c.r); free(dl); free(dm);
}
END_TEST

/* Vocabulary-parallel cross-entropy: the V columns split into R shards, stored shard-major
 * ([R][N][V/R], each shard as its rank would hold it). Each shard's part, the merge, and the
 * shard backward from the merged lse must be the gradient of the merged loss; and the merged
 * loss must be the plain cross-entropy of the whole rows. */
typedef struct { int N, V, R; int *tgt, *local; moe_real *shards, *parts, *losses, *lse, *r; } vce_ctx;
static void vce_local_targets(vce_ctx *c, int r) {
    const int Vs = c->V / c->R;
    for (int n = 0; n < c->N; n++)
        c->local[(size_t)r * c->N + n] =
            c->tgt[n] >= r * Vs && c->tgt[n] < (r + 1) * Vs ? c->tgt[n] - r * Vs : -1;
}
static double vce_loss(void *p) {
    vce_ctx *c = p;
    const size_t Vs = (size_t)(c->V / c->R);
    for (int r = 0; r < c->R; r++)
        moe_cpu_cross_entropy_shard_forward(c->parts + (size_t)r * c->N * 2,
                                            c->shards + (size_t)r * c->N * Vs,
                                            c->local + (size_t)r * c->N, c->N, (int)Vs);
    moe_cpu_cross_entropy_shard_merge(c->losses, c->lse, c->parts, c->R, c->N);
    return fd_dot(c->r, c->losses, (size_t)c->N);
}
static void check_vocab_parallel_ce(int R) {
    vce_ctx c = {8, 12, R, 0, 0, 0, 0, 0, 0, 0};
    const int N = c.N, V = c.V, Vs = V / R;
    c.tgt = malloc(sizeof(int) * N);
    c.local = malloc(sizeof(int) * N * R);
    for (int n = 0; n < N; n++)
        c.tgt[n] = (n * 5 + 1) % V;
    for (int r = 0; r < R; r++)
        vce_local_targets(&c, r);
    c.shards = ALLOC(N * V); c.parts = ALLOC(2 * N * R); c.losses = ALLOC(N); c.lse = ALLOC(N);
    c.r = ALLOC(N);
    moe_test_randn(c.shards, (size_t)N * V, 21, 3.0);
    moe_test_randn(c.r, N, 22, 1.0);
    /* the whole rows, reassembled from the shards, through the plain op */
    moe_real *whole = ALLOC(N * V), *plain = ALLOC(N);
    for (int r = 0; r < R; r++)
        for (int n = 0; n < N; n++)
            memcpy(whole + (size_t)n * V + r * Vs, c.shards + ((size_t)r * N + n) * Vs,
                   sizeof(moe_real) * Vs);
    moe_cpu_cross_entropy_forward(plain, whole, c.tgt, N, V);
    vce_loss(&c);
    ck_assert_double_le(moe_test_max_rel_err(c.losses, plain, N, 1e-12), 1e-12);
    moe_real *dl = ALLOC(N * V);
    for (int r = 0; r < R; r++)
        moe_cpu_cross_entropy_shard_backward(dl + (size_t)r * N * Vs, c.r,
                                             c.shards + (size_t)r * N * Vs, c.lse,
                                             c.local + (size_t)r * N, N, Vs);
    char what[64];
    snprintf(what, sizeof what, "vocabulary-parallel cross entropy, %d shards", R);
    ck_assert_double_le(fd_check(what, vce_loss, &c, c.shards, dl, (size_t)N * V, 400, TOL), TOL);
    free(c.tgt); free(c.local); free(c.shards); free(c.parts); free(c.losses); free(c.lse);
    free(c.r); free(whole); free(plain); free(dl);
}
START_TEST(test_fd_vocab_parallel_cross_entropy) {
    check_vocab_parallel_ce(1);
    check_vocab_parallel_ce(3);
    check_vocab_parallel_ce(4);
}
END_TEST

/* ------------------------------------------------------------------ router */
typedef struct { int N; moe_router_params p; moe_real *logits, *w, *r; int *idx; float *bias; } rt_ctx;
static double rt_loss(void *p) {
    rt_ctx *c = p;
    moe_cpu_router_forward(c->idx, c->w, c->logits, c->bias, &c->p, c->N);
    return fd_dot(c->r, c->w, (size_t)c->N * c->p.topk);
}
static void check_router(const char *what, moe_router_params p, int with_bias) {
    rt_ctx c = {16, p, 0, 0, 0, 0, 0};
    const int E = p.num_experts, k = p.topk;
    c.logits = ALLOC(c.N * E); c.w = ALLOC(c.N * k); c.r = ALLOC(c.N * k);
    c.idx = malloc(sizeof(int) * c.N * k);
    if (with_bias) {
        c.bias = malloc(sizeof(float) * E);
        for (int e = 0; e < E; e++)
            c.bias[e] = 0.05f * (float)(e % 3);
    }
    moe_test_randn(c.logits, c.N * E, 19, 1.5);
    moe_test_randn(c.r, c.N * k, 20, 1.0);
    rt_loss(&c);
    moe_real *dl = ALLOC(c.N * E);
    moe_cpu_router_backward(dl, c.r, c.logits, c.idx, &c.p, c.N);
    ck_assert_double_le(fd_check(what, rt_loss, &c, c.logits, dl, c.N * E, 2000, TOL), TOL);
    free(c.logits); free(c.w); free(c.r); free(c.idx); free(c.bias); free(dl);
}
static moe_router_params rp(int E, int k, moe_score_fn fn, int pre, int G, int GK, double s) {
    moe_router_params p = {E, k, fn, pre, G, GK, s};
    return p;
}
START_TEST(test_fd_router_variants) {
    check_router("softmax top-k", rp(8, 2, MOE_SCORE_SOFTMAX, 0, 0, 0, 0), 0);
    check_router("softmax top-1", rp(8, 1, MOE_SCORE_SOFTMAX, 0, 0, 0, 0), 0);
    check_router("pre-softmax", rp(8, 3, MOE_SCORE_SOFTMAX, 1, 0, 0, 0), 0);
    check_router("sigmoid", rp(8, 2, MOE_SCORE_SIGMOID, 0, 0, 0, 0), 0);
    check_router("sigmoid top-1", rp(8, 1, MOE_SCORE_SIGMOID, 0, 0, 0, 0), 0);
    check_router("sigmoid + bias", rp(8, 2, MOE_SCORE_SIGMOID, 0, 0, 0, 0), 1);
    check_router("group-limited softmax", rp(8, 4, MOE_SCORE_SOFTMAX, 0, 4, 2, 0), 0);
    check_router("group-limited sigmoid", rp(16, 4, MOE_SCORE_SIGMOID, 0, 4, 2, 2.5), 1);
    check_router("scaling factor", rp(8, 2, MOE_SCORE_SOFTMAX, 1, 0, 0, 2.5), 0);
}
END_TEST

/* ------------------------------------------------------ aux loss and z-loss */
typedef struct { int N, group, E, k; moe_score_fn fn; double coeff; int z; moe_real *logits; } aux_ctx;
static double aux_loss(void *p) {
    aux_ctx *c = p;
    if (c->z)
        return moe_cpu_z_loss_forward(c->logits, c->N, c->E, c->coeff);
    return moe_cpu_aux_loss_forward(c->logits, c->N, c->group, c->E, c->k, c->fn, c->coeff);
}
static void check_aux(const char *what, int group, moe_score_fn fn, int z) {
    aux_ctx c = {24, group, 6, 2, fn, 0.37, z, 0};
    c.logits = ALLOC(c.N * c.E);
    moe_test_randn(c.logits, c.N * c.E, 21, 1.0);
    moe_real *dl = ALLOC(c.N * c.E);
    if (z)
        moe_cpu_z_loss_backward(dl, c.logits, c.N, c.E, c.coeff, 1.0);
    else
        moe_cpu_aux_loss_backward(dl, c.logits, c.N, c.group, c.E, c.k, c.fn, c.coeff, 1.0);
    ck_assert_double_le(fd_check(what, aux_loss, &c, c.logits, dl, c.N * c.E, 1000, TOL), TOL);
    free(c.logits); free(dl);
}
START_TEST(test_fd_aux_losses) {
    check_aux("aux loss (global, softmax)", 24, MOE_SCORE_SOFTMAX, 0);
    check_aux("aux loss (global, sigmoid)", 24, MOE_SCORE_SIGMOID, 0);
    check_aux("seq aux loss (softmax)", 8, MOE_SCORE_SOFTMAX, 0);
    check_aux("seq aux loss (sigmoid)", 6, MOE_SCORE_SIGMOID, 0);
    check_aux("z-loss", 24, MOE_SCORE_SOFTMAX, 1);
}
END_TEST

/* The aux loss split over ranks (chapter 04): rows [row0, row0 + n) of groups of `group`,
 * counts summed over every shard. Each shard's backward against finite differences of its
 * own part of the loss (the counts held fixed, as they are piecewise constant), and the
 * parts add up to the one-rank loss. */
typedef struct { moe_aux_shape sh; const long long *counts; double coeff; moe_real *logits; } aux_shard_ctx;
static double aux_shard_loss(void *p) {
    aux_shard_ctx *c = p;
    return moe_cpu_aux_loss_forward_shard(c->logits, c->counts, &c->sh, c->coeff);
}
/* G groups of `group` tokens whose rows come in runs of `run` (0: one run per group; under
 * context parallelism a rank's rows of each sequence are two runs, moe_aux_shape::run) */
static void check_aux_runs(const char *what, int group, int G, int run, int shards,
                           moe_score_fn fn) {
    const int N = 24, E = 6, k = 2, n = N / shards;
    const double coeff = 0.37;
    moe_real *z = ALLOC(N * E);
    moe_test_randn(z, N * E, 27, 1.0);
    long long *sum = calloc((size_t)G * E, sizeof(long long)), *c = malloc(sizeof(long long) * G * E);
    ck_assert(sum && c);
    for (int r = 0; r < shards; r++) {
        moe_aux_shape sh = {n, r * n, group, G, E, k, fn, run};
        moe_cpu_aux_loss_counts(c, z + (size_t)r * n * E, &sh);
        for (int i = 0; i < G * E; i++)
            sum[i] += c[i];
    }
    double parts = 0.0;
    for (int r = 0; r < shards; r++) {
        aux_shard_ctx x = {{n, r * n, group, G, E, k, fn, run}, sum, coeff, z + (size_t)r * n * E};
        parts += aux_shard_loss(&x);
        moe_real *dl = ALLOC(n * E);
        moe_cpu_aux_loss_backward_shard(dl, x.logits, sum, &x.sh, coeff, 1.0);
        ck_assert_double_le(fd_check(what, aux_shard_loss, &x, x.logits, dl, n * E, 1000, TOL),
                            TOL);
        free(dl);
    }
    const moe_aux_shape all = {N, 0, group, G, E, k, fn, run};
    const double whole = moe_cpu_aux_loss_forward_shard(z, sum, &all, coeff);
    ck_assert_msg(fabs(parts - whole) <= 1e-12 * fabs(whole),
                  "%s: the shards' parts add up to %.15g, the loss is %.15g", what, parts, whole);
    if (run == 0) /* and that is the one-rank loss */
        ck_assert_double_eq_tol(whole, moe_cpu_aux_loss_forward(z, N, group, E, k, fn, coeff),
                                1e-12 * fabs(whole));
    free(z); free(sum); free(c);
}
static void check_aux_shards(const char *what, int group, int shards, moe_score_fn fn) {
    check_aux_runs(what, group, 24 / group, 0, shards, fn);
}
START_TEST(test_fd_aux_loss_shards) {
    check_aux_shards("aux loss over 2 shards (softmax)", 24, 2, MOE_SCORE_SOFTMAX);
    check_aux_shards("aux loss over 4 shards (sigmoid)", 24, 4, MOE_SCORE_SIGMOID);
    check_aux_shards("seq aux loss, shards inside sequences", 12, 4, MOE_SCORE_SOFTMAX);
    check_aux_shards("seq aux loss, shards across sequences", 8, 3, MOE_SCORE_SIGMOID);
    /* context parallelism: one CP rank's rows of 4 sequences of 24 tokens, in runs of 3 */
    check_aux_runs("seq aux loss, CP runs, 2 shards", 24, 4, 3, 2, MOE_SCORE_SOFTMAX);
    check_aux_runs("seq aux loss, CP runs, 3 shards", 24, 4, 3, 3, MOE_SCORE_SIGMOID);
}
END_TEST

/* ------------------------------------------------- SwiGLU MLP with row scale */
typedef struct { int N, H, F; moe_real *x, *w1, *w2, *s, *out, *gu, *act, *r; int scaled; } mlp_ctx;
static double mlp_loss(void *p) {
    mlp_ctx *c = p;
    moe_mlp_forward(moe_backend_cpu(), c->out, c->gu, c->act, c->x, c->scaled ? c->s : NULL, c->w1,
                    c->w2, c->N, c->H, c->F);
    return fd_dot(c->r, c->out, (size_t)c->N * c->H);
}
START_TEST(test_fd_mlp) {
    for (int scaled = 0; scaled <= 1; scaled++) {
        mlp_ctx c = {7, 10, 6, 0, 0, 0, 0, 0, 0, 0, 0, scaled};
        c.x = ALLOC(c.N * c.H); c.w1 = ALLOC(2 * c.F * c.H); c.w2 = ALLOC(c.H * c.F);
        c.s = ALLOC(c.N); c.out = ALLOC(c.N * c.H); c.gu = ALLOC(c.N * 2 * c.F);
        c.act = ALLOC(c.N * c.F); c.r = ALLOC(c.N * c.H);
        moe_test_randn(c.x, c.N * c.H, 22, 1.0);
        moe_test_randn(c.w1, 2 * c.F * c.H, 23, 0.5);
        moe_test_randn(c.w2, c.H * c.F, 24, 0.5);
        moe_test_randn(c.s, c.N, 25, 1.0);
        moe_test_randn(c.r, c.N * c.H, 26, 1.0);
        mlp_loss(&c);
        moe_real *dx = ALLOC(c.N * c.H), *dw1 = ALLOC(2 * c.F * c.H), *dw2 = ALLOC(c.H * c.F);
        moe_real *ds = ALLOC(c.N), *ws_dh = ALLOC(c.N * c.F), *ws_dgu = ALLOC(c.N * 2 * c.F);
        moe_mlp_backward(moe_backend_cpu(), dx, dw1, dw2, scaled ? ds : NULL, c.r, c.x, c.gu, c.act,
                         scaled ? c.s : NULL, c.w1, c.w2, ws_dh, ws_dgu, c.N, c.H, c.F);
        ck_assert_double_le(fd_check("mlp dx", mlp_loss, &c, c.x, dx, c.N * c.H, 500, TOL), TOL);
        ck_assert_double_le(fd_check("mlp dw1", mlp_loss, &c, c.w1, dw1, 2 * c.F * c.H, 500, TOL), TOL);
        ck_assert_double_le(fd_check("mlp dw2", mlp_loss, &c, c.w2, dw2, c.H * c.F, 500, TOL), TOL);
        if (scaled)
            ck_assert_double_le(fd_check("mlp d(row scale)", mlp_loss, &c, c.s, ds, c.N, 500, TOL), TOL);
        free(c.x); free(c.w1); free(c.w2); free(c.s); free(c.out); free(c.gu); free(c.act);
        free(c.r); free(dx); free(dw1); free(dw2); free(ds); free(ws_dh); free(ws_dgu);
    }
    moe_cpu_matmul_release();
}
END_TEST

/* ------------------------------------------------- chapter 05: a linear layer under QDQ */
/* The emulated FP8 / NVFP4 linear layer y = Q(x)·Q(W)ᵀ (lowp.h) and its straight-through
 * backward dx = Q(dy)·Q(W), dW = Q(dy)ᵀ·Q(x). The quantizer is piecewise constant, so the
 * emulated forward's true derivative is 0 almost everywhere (checked below: central
 * differences of it vanish for most coordinates). What the backward computes is, exactly,
 * the gradient of the straight-through SURROGATE
 *     S(x, W) = Σ Q(dy) ⊙ (x + e_x)·(W + e_W)ᵀ,   e_x = Q(x₀) − x₀, e_W = Q(W₀) − W₀ frozen,
 * a smooth function equal to the emulated layer (up to the quantized dy) at (x₀, W₀), with
 * the quantization errors held fixed: QDQ's Jacobian taken as the identity. The check is
 * that fd of S matches the analytic backward to fd tolerance. */
typedef struct {
    int N, I, O;
    moe_real *x, *w, *ex, *ew, *rq, *r, *out, *tmp_x, *tmp_w;
    moe_lowp *lp;
    int emulated; /* 1: the loss of the emulated forward itself (Q inside), with r */
} lowp_lin_ctx;

static double lowp_lin_loss(void *p) {
    lowp_lin_ctx *c = p;
    const moe_backend *be = moe_backend_cpu();
    const size_t nx = (size_t)c->N * c->I, nw = (size_t)c->O * c->I;
    if (c->emulated) {
        memcpy(c->tmp_w, c->w, nw * sizeof(moe_real));
        moe_lowp_qdq_weight(be, c->lp, c->tmp_w, 1, c->O, c->I, 0, 1);
        be->matmul_forward(c->out, moe_lowp_qdq(be, c->lp, c->x, c->N, c->I, MOE_LOWP_ACTIVATION, 0),
                           c->tmp_w, c->N, c->I, c->O);
        return fd_dot(c->r, c->out, (size_t)c->N * c->O);
    }
    for (size_t i = 0; i < nx; i++)
        c->tmp_x[i] = c->x[i] + c->ex[i];
    for (size_t i = 0; i < nw; i++)
        c->tmp_w[i] = c->w[i] + c->ew[i];
    be->matmul_forward(c->out, c->tmp_x, c->tmp_w, c->N, c->I, c->O);
    return fd_dot(c->rq, c->out, (size_t)c->N * c->O);
}

START_TEST(test_fd_lowp_linear_straight_through) {
    static const char *recipes[] = {"--fp8-format e4m3 --fp8-recipe tensorwise",
                                    "--fp8-format hybrid --fp8-recipe blockwise",
                                    "--fp8-format e4m3 --fp8-recipe mxfp8",
                                    "--fp4-format e2m1 --fp4-recipe nvfp4",
                                    /* one site per role: the backward's x replays */
                                    "--fp8-format e4m3 --fp8-recipe delayed"};
    const moe_backend *be = moe_backend_cpu();
    for (int k = 0; k < (int)(sizeof recipes / sizeof recipes[0]); k++) {
        moe_config cfg;
        moe_error err;
        char flags[256];
        snprintf(flags, sizeof flags, "%s --num-query-groups 4", recipes[k]);
        ck_assert_msg(moe_test_config(&cfg, flags, &err) == MOE_OK, "%s", err.msg);
        moe_lowp lp;
        ck_assert(moe_lowp_from_config(&lp, &cfg, &err) == MOE_OK && lp.on);
        lowp_lin_ctx c = {6, 128, 128, 0, 0, 0, 0, 0, 0, 0, 0, 0, &lp, 0};
        const size_t nx = (size_t)c.N * c.I, nw = (size_t)c.O * c.I, ny = (size_t)c.N * c.O;
        ck_assert(moe_lowp_alloc(be, &lp, nw) && moe_lowp_alloc_delayed(be, &lp, 1, 0));
        c.x = ALLOC(nx); c.w = ALLOC(nw); c.ex = ALLOC(nx); c.ew = ALLOC(nw); c.rq = ALLOC(ny);
        c.r = ALLOC(ny); c.out = ALLOC(ny); c.tmp_x = ALLOC(nx); c.tmp_w = ALLOC(nw);
        moe_test_randn(c.x, nx, 61, 1.0);
        moe_test_randn(c.w, nw, 62, 0.1);
        moe_test_randn(c.r, ny, 63, 1.0);
        /* the analytic backward, as the call sites run it (attention.c, mlp.c) */
        moe_real *wq = ALLOC(nw), *xq = ALLOC(nx), *dx = ALLOC(nx), *dw = ALLOC(nw);
        memcpy(wq, c.w, nw * sizeof(moe_real));
        moe_lowp_qdq_weight(be, &lp, wq, 1, c.O, c.I, 0, 1);
        memcpy(xq, moe_lowp_qdq(be, &lp, c.x, c.N, c.I, MOE_LOWP_ACTIVATION, 0), nx * sizeof(moe_real));
        const void *rq = moe_lowp_qdq(be, &lp, c.r, c.N, c.O, MOE_LOWP_GRADIENT, 0);
        memcpy(c.rq, rq, ny * sizeof(moe_real)); /* the quantized dy the backward used */
        be->matmul_backward(dx, dw, rq, xq, wq, c.N, c.I, c.O);
        for (size_t i = 0; i < nx; i++)
            c.ex[i] = xq[i] - c.x[i];
        for (size_t i = 0; i < nw; i++)
            c.ew[i] = wq[i] - c.w[i];
        char what[96];
        snprintf(what, sizeof what, "%s: dx vs the straight-through surrogate", recipes[k]);
        ck_assert_double_le(fd_check(what, lowp_lin_loss, &c, c.x, dx, nx, 300, TOL), TOL);
        snprintf(what, sizeof what, "%s: dW vs the straight-through surrogate", recipes[k]);
        ck_assert_double_le(fd_check(what, lowp_lin_loss, &c, c.w, dw, nw, 300, TOL), TOL);
        /* the quantization did something: Q(x), Q(W), Q(dy) differ from x, W, dy */
        size_t moved = 0;
        for (size_t i = 0; i < ny; i++)
            moved += c.rq[i] != c.r[i];
        ck_assert_msg(moved > ny / 2, "%s: dy barely quantized (%zu of %zu)", recipes[k], moved,
                      ny);
        /* and the emulated forward itself is locally constant in x: its central differences
         * (step 1e-4) vanish for most coordinates, where the straight-through dx does not */
        c.emulated = 1;
        int zero = 0, tried = 0;
        for (size_t i = 0; i < nx; i += 7, tried++) {
            const moe_real x0 = c.x[i];
            c.x[i] = x0 + 1e-4;
            const double lp_ = lowp_lin_loss(&c);
            c.x[i] = x0 - 1e-4;
            const double lm = lowp_lin_loss(&c);
            c.x[i] = x0;
            zero += lp_ == lm;
        }
        printf("  %s: the emulated forward's fd is exactly 0 at %d of %d coordinates of x\n",
               recipes[k], zero, tried);
        ck_assert_msg(zero * 10 >= tried * 8, "%s: only %d of %d", recipes[k], zero, tried);
        moe_lowp_free(be, &lp);
        free(c.x); free(c.w); free(c.ex); free(c.ew); free(c.rq); free(c.r); free(c.out);
        free(c.tmp_x); free(c.tmp_w); free(wq); free(xq); free(dx); free(dw);
    }
    moe_cpu_matmul_release();
}
END_TEST

/* The MLP's call sites under QDQ (mlp.c): each GEMM operand goes through the role it should
 * (hybrid blockwise tells them apart: E4M3 1×128 activations, E5M2 1×128 gradients, 128×128
 * weights), in fp64, against the same chain written out with the backend's ops. */
START_TEST(test_lowp_mlp_roles) {
    const moe_backend *be = moe_backend_cpu();
    moe_config cfg;
    moe_error err;
    ck_assert_msg(moe_test_config(&cfg, "--fp8-format hybrid --fp8-recipe blockwise "
                                        "--num-query-groups 4", &err) == MOE_OK, "%s", err.msg);
    moe_lowp lp;
    ck_assert(moe_lowp_from_config(&lp, &cfg, &err) == MOE_OK);
    const int N = 5, H = 128, F = 128;
    ck_assert(moe_lowp_alloc(be, &lp, (size_t)2 * F * H));
    moe_real *x = ALLOC(N * H), *w1 = ALLOC(2 * F * H), *w2 = ALLOC(H * F), *r = ALLOC(N * H);
    moe_real *out = ALLOC(N * H), *gu = ALLOC(N * 2 * F), *act = ALLOC(N * F);
    moe_real *dx = ALLOC(N * H), *dw1 = ALLOC(2 * F * H), *dw2 = ALLOC(H * F);
    moe_real *dh = ALLOC(N * F), *dgu = ALLOC(N * 2 * F);
    moe_test_randn(x, N * H, 71, 1.0);
    moe_test_randn(w1, 2 * F * H, 72, 0.1);
    moe_test_randn(w2, H * F, 73, 0.1);
    moe_test_randn(r, N * H, 74, 1e-3);
    moe_lowp_qdq_weight(be, &lp, w1, 1, 2 * F, H, 0, 1);
    moe_lowp_qdq_weight(be, &lp, w2, 1, H, F, 0, 1);
    moe_mlp_forward_lowp(be, out, gu, act, x, NULL, w1, w2, N, H, F, &lp, 0, NULL);
    moe_mlp_backward_lowp(be, dx, dw1, dw2, NULL, r, x, gu, act, NULL, w1, w2, dh, dgu, N, H, F,
                          &lp, 0, NULL);
    /* the chain by hand */
    moe_real *q = ALLOC(N * 2 * F), *q2 = ALLOC(N * 2 * F), *e_out = ALLOC(N * H);
    moe_real *e_gu = ALLOC(N * 2 * F), *e_act = ALLOC(N * F), *e_dx = ALLOC(N * H);
    moe_real *e_dw1 = ALLOC(2 * F * H), *e_dw2 = ALLOC(H * F), *e_dh = ALLOC(N * F);
    moe_real *e_dgu = ALLOC(N * 2 * F);
    const moe_qdq_spec *sa = &lp.spec[MOE_LOWP_ACTIVATION], *sg = &lp.spec[MOE_LOWP_GRADIENT];
    be->qdq(q, x, N, H, sa, &lp.ws);
    be->matmul_forward(e_gu, q, w1, N, H, 2 * F);
    be->swiglu_forward(e_act, e_gu, NULL, N, F);
    be->qdq(q, e_act, N, F, sa, &lp.ws);
    be->matmul_forward(e_out, q, w2, N, F, H);
    be->qdq(q2, r, N, H, sg, &lp.ws);
    be->matmul_backward(e_dh, e_dw2, q2, q, w2, N, F, H);
    be->swiglu_backward(e_dgu, NULL, e_dh, e_gu, NULL, N, F);
    be->qdq(q2, e_dgu, N, 2 * F, sg, &lp.ws);
    be->qdq(q, x, N, H, sa, &lp.ws);
    be->matmul_backward(e_dx, e_dw1, q2, q, w1, N, H, 2 * F);
    ck_assert(memcmp(out, e_out, sizeof(moe_real) * N * H) == 0);
    ck_assert(memcmp(dx, e_dx, sizeof(moe_real) * N * H) == 0);
    ck_assert(memcmp(dw1, e_dw1, sizeof(moe_real) * 2 * F * H) == 0);
    ck_assert(memcmp(dw2, e_dw2, sizeof(moe_real) * H * F) == 0);
    /* and it is not the fp64 MLP: the roles matter */
    moe_real *p_out = ALLOC(N * H);
    moe_mlp_forward(be, p_out, e_gu, e_act, x, NULL, w1, w2, N, H, F);
    ck_assert(memcmp(out, p_out, sizeof(moe_real) * N * H) != 0);
    moe_lowp_free(be, &lp);
    free(x); free(w1); free(w2); free(r); free(out); free(gu); free(act); free(dx); free(dw1);
    free(dw2); free(dh); free(dgu); free(q); free(q2); free(e_out); free(e_gu); free(e_act);
    free(e_dx); free(e_dw1); free(e_dw2); free(e_dh); free(e_dgu); free(p_out);
    moe_cpu_matmul_release();
}
END_TEST

Suite *suite_fd_ops(void) {
    Suite *s = suite_create("gradcheck-ops (fp64)");
    TCase *tc = tcase_create("ops");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_fd_matmul);
    tcase_add_test(tc, test_fd_embedding);
    tcase_add_test(tc, test_fd_rmsnorm);
    tcase_add_test(tc, test_fd_rope);
    tcase_add_test(tc, test_rope_offset);
    tcase_add_test(tc, test_attention_shapes_supported);
    tcase_add_test(tc, test_fd_swiglu);
    tcase_add_test(tc, test_fd_cross_entropy);
    tcase_add_test(tc, test_fd_router_variants);
    tcase_add_test(tc, test_fd_mlp);
    tcase_add_test(tc, test_fd_lowp_linear_straight_through);
    tcase_add_test(tc, test_lowp_mlp_roles);
    suite_add_tcase(s, tc);
    /* chapter 01's exercise: the aux loss's gradient (make check-ch01) */
    TCase *ch01 = tcase_create("ch01");
    tcase_set_tags(ch01, "ch01");
    tcase_set_timeout(ch01, 120);
    tcase_add_test(ch01, test_fd_aux_losses);
    suite_add_tcase(s, ch01);
    /* chapter 04: the vocabulary-parallel cross-entropy's gradient (make check-ch04) */
    TCase *ch04 = tcase_create("ch04");
    tcase_set_tags(ch04, "ch04");
    tcase_set_timeout(ch04, 120);
    tcase_add_test(ch04, test_fd_vocab_parallel_cross_entropy);
    tcase_add_test(ch04, test_fd_aux_loss_shards);
    suite_add_tcase(s, ch04);
    /* chapter 07: the flash attention's gradients (make check-ch07) */
    TCase *ch07 = tcase_create("ch07");
    tcase_set_tags(ch07, "ch07");
    tcase_set_timeout(ch07, 120);
    tcase_add_test(ch07, test_fd_attention);
    tcase_add_test(ch07, test_fd_attention_chunks);
    tcase_add_test(ch07, test_attention_flash_equals_naive_fp64);
    suite_add_tcase(s, ch07);
    return s;
}
