/*
 * Chapter 05's FP8 wgrad on the CPU (lib/fp8_wgrad.h): its twins against independent
 * definitions, and the emulated expert backward under MOE_FP8_WGRAD against the twin.
 *  - the token-wise copy per group == each group's rows transposed, zero-padded to a multiple
 *    of 128 tokens and quantized by the plain 1×128 quantizer (moe_cpu_quant_blockwise), at
 *    the group's padded column; the tail past the last group is left as it was;
 *  - the token-wise QDQ == those codes dequantized, back in place;
 *  - the wgrad twin == an fp64 GEMM of the dequantized copies (1e-5 of Σ|terms|), an empty
 *    group's block untouched when adding and zero when storing;
 *  - the emulated grouped MLP backward with fp8_wgrad on gives dW1 and dW2 equal to the wgrad
 *    twin on the token-wise codes of dgu, x and dh, act (what the native path computes), and
 *    visibly different from the row-wise wgrad (fp8_wgrad off).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fp8_wgrad.h"
#include "helpers.h"
#include "lowp.h"
#include "mlp.h"
#include "suites.h"

static const int g_sizes[] = {0, 1, 127, 128, 129, 0, 255, 64};
enum { NG = 8 };

static void offsets(int *off, const int *sizes, int G) {
    off[0] = 0;
    for (int g = 0; g < G; g++)
        off[g + 1] = off[g] + sizes[g];
}

static float *randf(size_t n, uint64_t seed, double scale) {
    moe_real *r = malloc(sizeof(moe_real) * (n + 1));
    float *f = malloc(sizeof(float) * (n + 1));
    moe_test_randn(r, n, seed, scale);
    for (size_t i = 0; i < n; i++)
        f[i] = (float)r[i];
    free(r);
    return f;
}

START_TEST(test_quant_group_t_definition) {
    int off[NG + 1];
    offsets(off, g_sizes, NG);
    const int C = 256, rows = off[NG] + 5;
    const size_t kpad = moe_fp8_wgrad_kpad(rows, NG), nkb = kpad / 128;
    float *x = randf((size_t)rows * C, 5, 2.0);
    x[3 * C + 7] = 0; /* a few exact values */
    uint8_t *q = malloc(C * kpad);
    float *s = malloc(sizeof(float) * nkb * C);
    memset(q, 0xAB, C * kpad);
    memset(s, 0xAB, sizeof(float) * nkb * C);
    moe_error err;
    ck_assert_int_eq(moe_cpu_quant_group_t(q, s, x, off, NG, rows, C, kpad, MOE_FP8_E4M3, 1, &err),
                     MOE_OK);
    size_t p = 0;
    for (int g = 0; g < NG; g++) {
        const int n = g_sizes[g], K = (n + 127) / 128 * 128;
        if (K == 0)
            continue;
        float *xt = calloc((size_t)C * K, sizeof(float));
        for (int c = 0; c < C; c++)
            for (int t = 0; t < n; t++)
                xt[(size_t)c * K + t] = x[(size_t)(off[g] + t) * C + c];
        uint8_t *rq = malloc((size_t)C * K);
        float *rs = malloc(sizeof(float) * C * (K / 128));
        ck_assert_int_eq(moe_cpu_quant_blockwise(rq, rs, xt, C, K, MOE_FP8_E4M3, 0, 1, &err),
                         MOE_OK);
        for (int c = 0; c < C; c++) {
            ck_assert_msg(memcmp(q + (size_t)c * kpad + p, rq + (size_t)c * K, K) == 0,
                          "group %d channel %d: codes differ from the padded transpose's", g, c);
            for (int kb = 0; kb < K / 128; kb++)
                ck_assert_msg(s[(p / 128 + kb) * C + c] == rs[(size_t)c * (K / 128) + kb],
                              "group %d channel %d block %d: scale differs", g, c, kb);
        }
        free(xt), free(rq), free(rs);
        p += K;
    }
    for (int c = 0; c < C; c++) /* the tail past the last group: not written */
        for (size_t k = p; k < kpad; k++)
            ck_assert_int_eq(q[(size_t)c * kpad + k], 0xAB);
    /* the QDQ: those codes dequantized, in x's layout; rows past the groups untouched */
    float *y = malloc(sizeof(float) * rows * C);
    for (size_t i = 0; i < (size_t)rows * C; i++)
        y[i] = -777.0f;
    ck_assert_int_eq(moe_cpu_qdq_group_t(y, x, off, NG, rows, C, MOE_FP8_E4M3, 1, &err), MOE_OK);
    p = 0;
    for (int g = 0; g < NG; g++) {
        for (int t = 0; t < g_sizes[g]; t++)
            for (int c = 0; c < C; c++) {
                const float want = moe_q_dequant(
                    moe_fp8_decode(q[(size_t)c * kpad + p + t], MOE_FP8_E4M3),
                    s[(p / 128 + t / 128) * C + c]);
                ck_assert_msg(y[(size_t)(off[g] + t) * C + c] == want,
                              "QDQ group %d token %d channel %d: %g, the codes say %g", g, t, c,
                              y[(size_t)(off[g] + t) * C + c], want);
            }
        p += (size_t)(g_sizes[g] + 127) / 128 * 128;
    }
    for (size_t i = (size_t)off[NG] * C; i < (size_t)rows * C; i++)
        ck_assert(y[i] == -777.0f);
    /* named errors: a kpad too small, columns not a multiple of 128 */
    ck_assert_int_eq(moe_cpu_quant_group_t(q, s, x, off, NG, rows, C, kpad - 128, MOE_FP8_E4M3, 1,
                                           &err),
                     MOE_ERR_CONFIG);
    ck_assert_int_eq(moe_cpu_quant_group_t(q, s, x, off, NG, rows, 200, kpad, MOE_FP8_E4M3, 1, &err),
                     MOE_ERR_CONFIG);
    free(x), free(q), free(s), free(y);
}
END_TEST

/* the token-wise copy of x [rows][C] on the CPU: codes and scales, allocated */
static void copy_t(uint8_t **q, float **s, const float *x, const int *off, int G, int rows, int C,
                   size_t kpad) {
    *q = malloc((size_t)C * kpad + 1);
    *s = malloc(sizeof(float) * (kpad / 128 * C + 1));
    memset(*q, 0, (size_t)C * kpad);
    moe_error err;
    ck_assert_int_eq(moe_cpu_quant_group_t(*q, *s, x, off, G, rows, C, kpad, MOE_FP8_E4M3, 1, &err),
                     MOE_OK);
}

START_TEST(test_wgrad_twin_definition) {
    int off[NG + 1];
    offsets(off, g_sizes, NG);
    const int M = 128, N = 256, rows = off[NG];
    const size_t kpad = moe_fp8_wgrad_kpad(rows, NG), nkb = kpad / 128, nw = (size_t)NG * M * N;
    float *a = randf((size_t)rows * M, 7, 1.0), *b = randf((size_t)rows * N, 8, 3.0);
    uint8_t *qa, *qb;
    float *sa, *sb;
    copy_t(&qa, &sa, a, off, NG, rows, M, kpad);
    copy_t(&qb, &sb, b, off, NG, rows, N, kpad);
    float *d = malloc(sizeof(float) * nw), *d0 = malloc(sizeof(float) * nw);
    for (size_t i = 0; i < nw; i++)
        d[i] = d0[i] = (float)(i % 13) - 6.0f;
    moe_error err;
    ck_assert_int_eq(moe_cpu_fp8_grouped_wgrad(d, 1, qa, sa, qb, sb, off, NG, kpad, M, N, &err),
                     MOE_OK);
    size_t p = 0;
    double worst = 0;
    for (int g = 0; g < NG; g++) {
        const int nb = (g_sizes[g] + 127) / 128;
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) {
                double sum = 0, mag = 0;
                for (size_t k = p; k < p + (size_t)nb * 128; k++) {
                    const double va = moe_fp8_decode(qa[(size_t)m * kpad + k], MOE_FP8_E4M3) *
                                      (double)sa[k / 128 * M + m];
                    const double vb = moe_fp8_decode(qb[(size_t)n * kpad + k], MOE_FP8_E4M3) *
                                      (double)sb[k / 128 * N + n];
                    sum += va * vb;
                    mag += fabs(va * vb);
                }
                const size_t i = (size_t)g * M * N + (size_t)m * N + n;
                if (nb == 0) { /* an empty group's block: untouched when adding */
                    ck_assert(d[i] == d0[i]);
                    continue;
                }
                const double e = fabs(d[i] - (d0[i] + sum)) / (mag + fabs(d0[i]) + 1e-30);
                worst = e > worst ? e : worst;
            }
        p += (size_t)nb * 128;
    }
    ck_assert_msg(worst < 1e-5, "wgrad twin vs fp64 of the dequantized copies: %g", worst);
    /* stored: an empty group's block is zeros */
    for (size_t i = 0; i < nw; i++)
        d[i] = NAN;
    ck_assert_int_eq(moe_cpu_fp8_grouped_wgrad(d, 0, qa, sa, qb, sb, off, NG, kpad, M, N, &err),
                     MOE_OK);
    for (size_t i = 0; i < (size_t)M * N; i++)
        ck_assert(d[i] == 0.0f); /* group 0 is empty */
    for (size_t i = 0; i < nw; i++)
        ck_assert(isfinite(d[i]));
    (void)nkb;
    free(a), free(b), free(qa), free(qb), free(sa), free(sb), free(d), free(d0);
}
END_TEST

/* n × C normals, every odd column 2^-18 times smaller. Why: with power-of-two scales an
 * E4M3 code's relative precision does not depend on its block's scale, so the row-wise and
 * the token-wise QDQ differ only where an element is so far below its block's amax that it
 * falls into the subnormals; here a row-wise block mixes both kinds of columns (the small ones
 * lose their bits), a token-wise block holds one column */
static void skewed(moe_real *x, int n, int C, uint64_t seed) {
    moe_test_randn(x, (size_t)n * C, seed, 1.0);
    for (int t = 0; t < n; t++)
        for (int c = 1; c < C; c += 2)
            x[(size_t)t * C + c] = (moe_real)ldexp(x[(size_t)t * C + c], -18);
}

/* the worst relative error of a row or a column of one group's [M][K] block of a vs b */
static double worst_line(const moe_real *a, const float *b, int G, int M, int K) {
    double worst = 0;
    for (int g = 0; g < G; g++)
        for (int dir = 0; dir < 2; dir++)
            for (int u = 0; u < (dir ? K : M); u++) {
                double num = 0, den = 0;
                for (int v = 0; v < (dir ? M : K); v++) {
                    const size_t i = (size_t)g * M * K + (dir ? (size_t)v * K + u : (size_t)u * K + v);
                    num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
                    den += (double)b[i] * b[i];
                }
                const double r = den > 0 ? sqrt(num / den) : (num > 0 ? INFINITY : 0);
                worst = r > worst ? r : worst;
            }
    return worst;
}

/* the emulated grouped MLP's backward (CPU), dW1 and dW2, with the wgrad's operands
 * token-wise (fp8_wgrad) or row-wise */
static void mlp_dw(moe_real *dw1, moe_real *dw2, moe_real **dgu_out, moe_real **act_out,
                   moe_real **dh_out, const int *off, int G, int H, int F, int fp8_wgrad) {
    const moe_backend *be = moe_backend_cpu();
    const int N = off[G];
    moe_config c;
    moe_config_defaults(&c);
    snprintf(c.fp8_format, sizeof c.fp8_format, "e4m3");
    snprintf(c.fp8_recipe, sizeof c.fp8_recipe, "blockwise");
    moe_lowp lp;
    moe_error err;
    ck_assert_int_eq(moe_lowp_from_config(&lp, &c, &err), MOE_OK);
    lp.fp8_wgrad = fp8_wgrad;
    const size_t W = (size_t)(2 * F > H ? 2 * F : H);
    ck_assert(moe_lowp_alloc(be, &lp, (N > (int)W ? (size_t)N : W) * W));
    const size_t n1 = (size_t)G * 2 * F * H, n2 = (size_t)G * H * F;
    moe_real *x = malloc(sizeof(moe_real) * N * H), *w1 = malloc(sizeof(moe_real) * n1);
    moe_real *w2 = malloc(sizeof(moe_real) * n2), *dy = malloc(sizeof(moe_real) * N * H);
    moe_real *rs = malloc(sizeof(moe_real) * N), *drs = calloc(N, sizeof(moe_real));
    skewed(x, N, H, 21);
    moe_test_randn(w1, n1, 22, 0.05);
    moe_test_randn(w2, n2, 23, 0.05);
    skewed(dy, N, H, 24);
    for (int i = 0; i < N; i++)
        rs[i] = (moe_real)(0.25 + 0.5 * ((i * 37) % 101) / 101.0);
    moe_lowp_quantize_experts(be, &lp, NULL, w1, G, 2 * F, H, 0, 1);
    moe_lowp_quantize_experts(be, &lp, NULL, w2, G, H, F, 0, 1);
    moe_real *out = malloc(sizeof(moe_real) * N * H), *gu = malloc(sizeof(moe_real) * N * 2 * F);
    moe_real *act = malloc(sizeof(moe_real) * N * F), *dx = malloc(sizeof(moe_real) * N * H);
    moe_real *dh = malloc(sizeof(moe_real) * N * F), *dgu = malloc(sizeof(moe_real) * N * 2 * F);
    moe_groups grp = {.off = off, .dev_off = off, .G = G, .impl = MOE_EXPERTS_KERNEL,
                      .dw_mode = MOE_DW_STORE, .gather_div = 1, .rows = N, .lowp = &lp};
    moe_mlp_forward_grouped(be, out, gu, act, x, rs, w1, w2, &grp, H, F);
    moe_mlp_backward_grouped(be, dx, dw1, dw2, drs, dy, x, gu, act, rs, w1, w2, dh, dgu, &grp, H,
                             F, 0);
    *dgu_out = dgu, *act_out = act, *dh_out = dh;
    moe_lowp_free(be, &lp);
    free(x), free(w1), free(w2), free(rs), free(drs), free(out), free(gu), free(dx);
    *dgu_out = dgu;
    (void)dy;
    free(dy);
}

START_TEST(test_emulated_backward_is_the_twin) {
    int off[NG + 1];
    offsets(off, g_sizes, NG);
    const int G = NG, H = 128, F = 128, N = off[G];
    const size_t n1 = (size_t)G * 2 * F * H, n2 = (size_t)G * H * F;
    moe_real *dw1 = malloc(sizeof(moe_real) * n1), *dw2 = malloc(sizeof(moe_real) * n2);
    moe_real *rw1 = malloc(sizeof(moe_real) * n1), *rw2 = malloc(sizeof(moe_real) * n2);
    moe_real *dgu, *act, *dh, *r_dgu, *r_act, *r_dh;
    mlp_dw(dw1, dw2, &dgu, &act, &dh, off, G, H, F, 1);
    mlp_dw(rw1, rw2, &r_dgu, &r_act, &r_dh, off, G, H, F, 0);
    /* the twin on the token-wise codes: fc2's dW2 = Q_t(dout)ᵀ Q_t(act); fc1's dW1 =
     * Q_t(dgu)ᵀ Q_t(x) (dout and x are mlp_dw's seeds 24 and 21) */
    const size_t kpad = moe_fp8_wgrad_kpad(N, G);
    moe_real *xr = malloc(sizeof(moe_real) * N * H), *dyr = malloc(sizeof(moe_real) * N * H);
    skewed(xr, N, H, 21);
    skewed(dyr, N, H, 24);
    float *xf = malloc(sizeof(float) * N * H), *dyf = malloc(sizeof(float) * N * H);
    float *af = malloc(sizeof(float) * N * F), *gf = malloc(sizeof(float) * N * 2 * F);
    for (size_t i = 0; i < (size_t)N * H; i++)
        xf[i] = (float)xr[i], dyf[i] = (float)dyr[i];
    for (size_t i = 0; i < (size_t)N * F; i++)
        af[i] = (float)act[i];
    for (size_t i = 0; i < (size_t)N * 2 * F; i++)
        gf[i] = (float)dgu[i];
    const struct {
        const float *a, *b;
        int M, K;
        const moe_real *got, *rowwise;
        const char *name;
    } lin[2] = {{dyf, af, H, F, dw2, rw2, "fc2"}, {gf, xf, 2 * F, H, dw1, rw1, "fc1"}};
    for (int l = 0; l < 2; l++) {
        uint8_t *qa, *qb;
        float *sa, *sb;
        copy_t(&qa, &sa, lin[l].a, off, G, N, lin[l].M, kpad);
        copy_t(&qb, &sb, lin[l].b, off, G, N, lin[l].K, kpad);
        const size_t nw = (size_t)G * lin[l].M * lin[l].K;
        float *want = malloc(sizeof(float) * nw);
        moe_error err;
        ck_assert_int_eq(moe_cpu_fp8_grouped_wgrad(want, 0, qa, sa, qb, sb, off, G, kpad, lin[l].M,
                                                   lin[l].K, &err),
                         MOE_OK);
        const double rel = worst_line(lin[l].got, want, G, lin[l].M, lin[l].K);
        const double rel_r = worst_line(lin[l].rowwise, want, G, lin[l].M, lin[l].K);
        printf("  FP8 wgrad, emulated %s: worst row/column vs the twin %.3g (token-wise), "
               "%.3g (row-wise)\n", lin[l].name, rel, rel_r);
        ck_assert_msg(rel < 1e-5, "%s: the emulated token-wise wgrad vs the twin: %g", lin[l].name,
                      rel);
        ck_assert_msg(rel_r > 1e-2, "%s: the row-wise wgrad equals the token-wise one (%g): the "
                      "switch changes nothing", lin[l].name, rel_r);
        free(qa), free(qb), free(sa), free(sb), free(want);
    }
    free(dw1), free(dw2), free(rw1), free(rw2), free(dgu), free(act), free(dh), free(r_dgu);
    free(r_act), free(r_dh), free(xr), free(dyr), free(xf), free(dyf), free(af), free(gf);
}
END_TEST

Suite *suite_fp8_wgrad(void) {
    const TTest *const tests[] = {test_quant_group_t_definition, test_wgrad_twin_definition,
                                  test_emulated_backward_is_the_twin};
    return moe_test_chapter_suite("fp8_wgrad", "ch05", tests, 3);
}
