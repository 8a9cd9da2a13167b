/*
 * The CPU grouped GEMM (chapter 03; make check-ch03 grades it, and with STUDENT=1 the
 * student's version in chapters/03-grouped-gemm/student/) against a plain triple loop,
 * with ragged groups, an empty group, and one group holding every row. The output is
 * poisoned with NaN first, so a row the GEMM forgets to write fails.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"

#include "cpu/ops.h"
#include "helpers.h"
#include "suites.h"

/* out[r] = in[r] · w[g]ᵀ for the g with off[g] <= r < off[g+1], in double */
static void reference(double *out, const moe_real *in, const moe_real *w, const int *off, int G,
                      int I, int O) {
    for (int g = 0; g < G; g++)
        for (int r = off[g]; r < off[g + 1]; r++)
            for (int o = 0; o < O; o++) {
                double acc = 0.0;
                for (int i = 0; i < I; i++)
                    acc += (double)in[(size_t)r * I + i] * w[((size_t)g * O + o) * I + i];
                out[(size_t)r * O + o] = acc;
            }
}

static void check_grouped(const int *off, int G, int I, int O) {
    const int rows = off[G];
    moe_real *in = malloc(sizeof(moe_real) * (size_t)(rows ? rows : 1) * I);
    moe_real *w = malloc(sizeof(moe_real) * (size_t)G * O * I);
    moe_real *out = malloc(sizeof(moe_real) * (size_t)(rows ? rows : 1) * O);
    double *want = malloc(sizeof(double) * (size_t)(rows ? rows : 1) * O);
    ck_assert(in && w && out && want);
    moe_test_randn(in, (size_t)rows * I, 40, 1.0);
    moe_test_randn(w, (size_t)G * O * I, 41, 0.5);
    moe_test_poison(out, (size_t)rows * O);
    moe_cpu_grouped_matmul_forward(out, in, w, off, G, I, O);
    reference(want, in, w, off, G, I, O);
    for (size_t j = 0; j < (size_t)rows * O; j++)
        ck_assert_msg(fabs(out[j] - want[j]) <= 1e-4 * (1.0 + fabs(want[j])),
                      "row %zu, column %zu: %g, want %g", j / O, j % O, (double)out[j], want[j]);
    free(in); free(w); free(out); free(want);
    moe_cpu_matmul_release();
}

START_TEST(test_grouped_forward_ragged) {
    const int off[5] = {0, 3, 3, 10, 11}; /* 3 rows, none, 7 rows, 1 row */
    check_grouped(off, 4, 5, 6);
}
END_TEST

START_TEST(test_grouped_forward_one_group_has_all) {
    const int off[4] = {0, 0, 9, 9}; /* every row in group 1: only w[1] may be used */
    check_grouped(off, 3, 8, 4);
}
END_TEST

/* The weight-gradient modes of the device-offset backward (moe_dw_mode) on the CPU twin:
 * ACCUMULATE adds dw_g = Σ_rows dout ⊗ in to what dw held; STORE and ACT (the activation
 * type is moe_real on the CPU) overwrite it, an empty group's block with zeros, whatever
 * the buffer held (poisoned with NaN here). */
START_TEST(test_grouped_wgrad_modes) {
    const int off[5] = {0, 3, 3, 10, 11}, G = 4, I = 5, O = 6, rows = 11;
    const size_t nw = (size_t)G * O * I;
    moe_real in[11 * 5], dout[11 * 6], w[4 * 6 * 5], dw[4 * 6 * 5], base[4 * 6 * 5];
    moe_test_randn(in, sizeof in / sizeof in[0], 1, 1.0);
    moe_test_randn(dout, sizeof dout / sizeof dout[0], 2, 1.0);
    moe_test_randn(w, nw, 3, 1.0);
    moe_test_randn(base, nw, 4, 1.0);
    const moe_backend *be = moe_backend_cpu();
    for (int mode = MOE_DW_ACCUMULATE; mode <= MOE_DW_ACT; mode++) {
        if (mode == MOE_DW_ACCUMULATE)
            memcpy(dw, base, sizeof dw);
        else
            moe_test_poison(dw, nw);
        be->grouped_matmul_backward_dev(NULL, dw, dout, in, w, off, G, rows, I, O, 0,
                                        (moe_dw_mode)mode);
        for (int g = 0; g < G; g++)
            for (int o = 0; o < O; o++)
                for (int i = 0; i < I; i++) {
                    const size_t at = ((size_t)g * O + o) * I + i;
                    double want = mode == MOE_DW_ACCUMULATE ? base[at] : 0.0;
                    for (int r = off[g]; r < off[g + 1]; r++)
                        want += (double)dout[r * O + o] * in[r * I + i];
                    ck_assert_msg(fabs(dw[at] - want) <= 1e-5 * (1 + fabs(want)),
                                  "mode %d: dw[%d,%d,%d] = %g, want %g", mode, g, o, i,
                                  (double)dw[at], want);
                }
    }
}
END_TEST

/* The fused permutation's CPU twin (the reference of the GPU kernel's gather): input row r
 * is token map[r] / k, checked against the definition written out — forward into a
 * poisoned output, and dw_g = Σ_{r in g} dout[r] ⊗ x[map[r] / k] stored over a poisoned
 * buffer — on groups with an empty one, and a map that skips some assignments. */
START_TEST(test_grouped_gather) {
    const int off[5] = {0, 3, 3, 10, 11}, G = 4, I = 5, O = 6, rows = 11, k = 2, T = 7;
    const int map[11] = {13, 0, 5, 2, 9, 11, 1, 6, 12, 3, 8}; /* assignments of 7 tokens × 2 */
    const size_t nw = (size_t)G * O * I;
    moe_real x[7 * 5], dout[11 * 6], w[4 * 6 * 5], dw[4 * 6 * 5], out[11 * 6];
    moe_test_randn(x, (size_t)T * I, 5, 1.0);
    moe_test_randn(dout, sizeof dout / sizeof dout[0], 6, 1.0);
    moe_test_randn(w, nw, 7, 1.0);
    const moe_backend *be = moe_backend_cpu();
    moe_test_poison(out, sizeof out / sizeof out[0]);
    be->grouped_matmul_forward_dev_gather(out, x, map, k, w, off, G, rows, I, O);
    moe_test_poison(dw, nw);
    be->grouped_matmul_backward_dev_gather(NULL, dw, dout, x, map, k, w, off, G, rows, I, O, 0,
                                           MOE_DW_STORE);
    for (int g = 0; g < G; g++)
        for (int o = 0; o < O; o++) {
            for (int r = off[g]; r < off[g + 1]; r++) {
                double want = 0;
                for (int i = 0; i < I; i++)
                    want += (double)x[map[r] / k * I + i] * w[((size_t)g * O + o) * I + i];
                ck_assert_msg(fabs(out[r * O + o] - want) <= 1e-5 * (1 + fabs(want)),
                              "forward row %d col %d: %g, want %g", r, o, (double)out[r * O + o],
                              want);
            }
            for (int i = 0; i < I; i++) {
                double want = 0;
                for (int r = off[g]; r < off[g + 1]; r++)
                    want += (double)dout[r * O + o] * x[map[r] / k * I + i];
                const size_t at = ((size_t)g * O + o) * I + i;
                ck_assert_msg(fabs(dw[at] - want) <= 1e-5 * (1 + fabs(want)),
                              "dw[%d,%d,%d] = %g, want %g", g, o, i, (double)dw[at], want);
            }
        }
}
END_TEST

Suite *suite_grouped(void) {
    const TTest *tests[] = {test_grouped_forward_ragged, test_grouped_forward_one_group_has_all,
                            test_grouped_wgrad_modes, test_grouped_gather};
    return moe_test_chapter_suite("grouped", "ch03", tests, 4);
}
