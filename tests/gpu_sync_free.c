/*
 * The sync-free MoE layer on the GPU (chapter 06): the budgeted permutation index and the
 * device-side load counts against their CPU twins (lib/cpu/permute.c) on random, one-expert
 * and alternating routings, with and without an overflow, outputs poisoned first; the
 * combine's skipping of unplaced rows; the fused dispatcher's device plan (EP) against its
 * CPU twin; and the overflow protocol on CUDA trainers (the same helper as the CPU test,
 * tests/test_sync_free.c).
 */
#include <cuda_runtime.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cpu/moe_ops.h"
#include "cuda_ops.h"
#include "helpers.h"
#include "step_flags.h"
#include "suites.h"

#define CK_CUDA(call)                                                                       \
    do {                                                                                    \
        cudaError_t e_ = (call);                                                            \
        ck_assert_msg(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));          \
    } while (0)

#define POISON 0x7f /* int 0x7f7f7f7f, a value no index takes */

static void *dpoisoned(size_t bytes) {
    void *p = NULL;
    CK_CUDA(cudaMalloc(&p, bytes ? bytes : 1));
    CK_CUDA(cudaMemset(p, POISON, bytes ? bytes : 1));
    CK_CUDA(cudaDeviceSynchronize());
    return p;
}

static void dget(void *h, const void *d, size_t bytes) {
    CK_CUDA(cudaDeviceSynchronize()); /* the ops run on the library's own stream */
    CK_CUDA(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
}

static void *dput(const void *h, size_t bytes) {
    void *d = dpoisoned(bytes);
    CK_CUDA(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
    return d;
}

/* 0 random, 1 all on the last expert, 2 alternating between two hot experts */
static int *routing(int kind, int N, int k, int E, uint64_t stream) {
    const int A = N * k;
    int *idx = malloc(sizeof(int) * A);
    moe_real *u = malloc(sizeof(moe_real) * A);
    moe_test_randn(u, A, stream, 1.0);
    for (int a = 0; a < A; a++) {
        int e = (int)((u[a] > 0 ? u[a] : -u[a]) * E * 3) % E;
        idx[a] = kind == 0 ? e : kind == 1 ? E - 1 : (a / k) % 2 ? 1 : E - 2;
    }
    free(u);
    return idx;
}

static void check_budget(int kind, int N, int k, int E, int budget, int C, uint64_t stream) {
    const moe_backend *be = moe_backend_cuda();
    const int A = N * k;
    int *idx = routing(kind, N, k, E, stream);
    /* the CPU twin */
    int *src_c = malloc(sizeof(int) * A), *row_c = malloc(sizeof(int) * A);
    int *off_c = malloc(sizeof(int) * (E + 1));
    memset(src_c, POISON, sizeof(int) * A);
    int flags_c = MOE_STEP_NONFINITE;
    moe_cpu_permute_index_budget(src_c, row_c, off_c, &flags_c, idx, N, k, E, budget);
    /* the GPU, every output poisoned; perm_src has A rows so that a write past the budget
     * would show */
    int *d_idx = dput(idx, sizeof(int) * A);
    int *d_src = dpoisoned(sizeof(int) * A), *d_row = dpoisoned(sizeof(int) * A);
    int *d_off = dpoisoned(sizeof(int) * (E + 1));
    const int nonfinite = MOE_STEP_NONFINITE;
    int *d_flags = dput(&nonfinite, sizeof(int));
    be->permute_index_budget(d_src, d_row, d_off, d_flags, d_idx, N, k, E, budget);
    int *src_g = malloc(sizeof(int) * A), *row_g = malloc(sizeof(int) * A);
    int *off_g = malloc(sizeof(int) * (E + 1)), flags_g = 0;
    dget(src_g, d_src, sizeof(int) * A);
    dget(row_g, d_row, sizeof(int) * A);
    dget(off_g, d_off, sizeof(int) * (E + 1));
    dget(&flags_g, d_flags, sizeof(int));
    printf("  budget kind=%d N=%d k=%d E=%d budget=%d (%s): ", kind, N, k, E, budget,
           A > budget ? "overflow" : "fits");
    ck_assert_int_eq(flags_g, flags_c);
    ck_assert_int_eq(!!(flags_g & MOE_STEP_OVERFLOW), A > budget);
    ck_assert_msg(!memcmp(off_c, off_g, sizeof(int) * (E + 1)), "offsets differ");
    ck_assert_msg(!memcmp(row_c, row_g, sizeof(int) * A), "row_of differs");
    ck_assert_msg(!memcmp(src_c, src_g, sizeof(int) * A),
                  "perm_src differs (or was written past the budget)");

    /* the combine skips unplaced rows: small integers, exact in bf16 and in the fp32 sum */
    const int rows = A < budget ? A : budget;
    moe_real *yp = malloc(sizeof(moe_real) * (size_t)rows * C);
    moe_real *out_c = calloc((size_t)N * C, sizeof(moe_real));
    moe_real *out_g = malloc(sizeof(moe_real) * (size_t)N * C);
    for (size_t i = 0; i < (size_t)rows * C; i++)
        yp[i] = (moe_real)(i % 7) - 3;
    void *d_yp = be->alloc(be->act_size * (size_t)rows * C);
    void *d_out = be->alloc(be->act_size * (size_t)N * C);
    be->write_act(d_yp, yp, (size_t)rows * C);
    moe_cpu_unpermute_sum(out_c, yp, row_c, N, k, C);
    be->unpermute_sum(d_out, d_yp, d_row, N, k, C);
    be->read_act(out_g, d_out, (size_t)N * C);
    ck_assert_msg(!memcmp(out_c, out_g, sizeof(moe_real) * (size_t)N * C),
                  "unpermute_sum differs");
    moe_real *dwp = malloc(sizeof(moe_real) * rows);
    moe_real *dtw_c = malloc(sizeof(moe_real) * A), *dtw_g = malloc(sizeof(moe_real) * A);
    moe_test_randn(dwp, rows, stream + 1, 1.0);
    moe_test_randn(dtw_c, A, stream + 2, 1.0);
    moe_real *d_dwp = dput(dwp, sizeof(moe_real) * rows);
    moe_real *d_dtw = dput(dtw_c, sizeof(moe_real) * A);
    moe_cpu_unpermute_weights(dtw_c, dwp, row_c, N, k);
    be->unpermute_weights(d_dtw, d_dwp, d_row, N, k);
    dget(dtw_g, d_dtw, sizeof(moe_real) * A);
    ck_assert_msg(!memcmp(dtw_c, dtw_g, sizeof(moe_real) * A), "unpermute_weights differs");
    printf("all exact\n");

    CK_CUDA(cudaFree(d_idx)); CK_CUDA(cudaFree(d_src)); CK_CUDA(cudaFree(d_row));
    CK_CUDA(cudaFree(d_off)); CK_CUDA(cudaFree(d_flags));
    CK_CUDA(cudaFree(d_dwp)); CK_CUDA(cudaFree(d_dtw));
    be->free(d_yp);
    be->free(d_out);
    free(idx); free(src_c); free(row_c); free(off_c); free(src_g); free(row_g); free(off_g);
    free(yp); free(out_c); free(out_g); free(dwp); free(dtw_c); free(dtw_g);
}

START_TEST(test_gpu_permute_index_budget) {
    for (int kind = 0; kind < 3; kind++) {
        check_budget(kind, 37, 2, 8, 37 * 2, 16, 900 + kind);        /* exactly fits */
        check_budget(kind, 37, 2, 8, 37 * 2 + 9, 16, 910 + kind);    /* room to spare */
        check_budget(kind, 37, 2, 8, 37, 16, 920 + kind);            /* half */
        check_budget(kind, 3000, 4, 64, 3000 * 4, 64, 930 + kind);   /* several chunks */
        check_budget(kind, 3000, 4, 64, 5001, 64, 940 + kind);       /* overflow mid-chunk */
        check_budget(kind, 3000, 8, 256, 1, 40, 950 + kind);         /* one row */
    }
}
END_TEST

/* The fused dispatcher's device plan (moe_cuda_fused_plan) against its CPU twin, which
 * tests/test_sync_free.c checks against the host plan: every rank's view of random offsets
 * and of every row sent to rank 0, with budgets that hold everything, exactly the rows
 * received, and one row fewer (the flag, the clamped offsets). Outputs poisoned first; the
 * flags word starts with another bit set, which must stay. */
START_TEST(test_gpu_fused_plan) {
    const moe_backend *be = moe_backend_cuda();
    const int shapes[5][2] = {{1, 4}, {2, 8}, {4, 16}, {8, 64}, {8, 1016}}; /* (P, E) */
    unsigned seed = 17;
    for (int s = 0; s < 5; s++)
        for (int hot = 0; hot <= 1; hot++) {
            const int P = shapes[s][0], E = shapes[s][1], EL = E / P;
            const size_t n_all = (size_t)P * (E + 1);
            int *all_off = malloc(sizeof(int) * n_all);
            int *sc = malloc(sizeof(int) * E), *oc = malloc(sizeof(int) * (EL + 1));
            int *sg = malloc(sizeof(int) * E), *og = malloc(sizeof(int) * (EL + 1));
            moe_test_random_offsets(all_off, P, E, hot, &seed);
            int *d_all = dput(all_off, sizeof(int) * n_all);
            for (int r = 0; r < P; r++) {
                int fc = MOE_STEP_NONFINITE;
                moe_cpu_fused_plan(sc, oc, &fc, all_off, P, r, E, INT_MAX);
                const int R = oc[EL];
                const int budgets[3] = {INT_MAX, R, R > 0 ? R - 1 : 0};
                for (int b = 0; b < 3; b++) {
                    fc = MOE_STEP_NONFINITE;
                    moe_cpu_fused_plan(sc, oc, &fc, all_off, P, r, E, budgets[b]);
                    int *d_shift = dpoisoned(sizeof(int) * E);
                    int *d_off = dpoisoned(sizeof(int) * (EL + 1));
                    const int nonfinite = MOE_STEP_NONFINITE;
                    int *d_flags = dput(&nonfinite, sizeof(int)), fg = 0;
                    be->fused_plan(d_shift, d_off, d_flags, d_all, P, r, E, budgets[b]);
                    dget(sg, d_shift, sizeof(int) * E);
                    dget(og, d_off, sizeof(int) * (EL + 1));
                    dget(&fg, d_flags, sizeof(int));
                    ck_assert_msg(!memcmp(sc, sg, sizeof(int) * E),
                                  "P %d E %d rank %d budget %d: shifts differ", P, E, r,
                                  budgets[b]);
                    ck_assert_msg(!memcmp(oc, og, sizeof(int) * (EL + 1)),
                                  "P %d E %d rank %d budget %d: offsets differ", P, E, r,
                                  budgets[b]);
                    ck_assert_int_eq(fg, fc);
                    be->free(d_shift);
                    be->free(d_off);
                    be->free(d_flags);
                }
            }
            be->free(d_all);
            free(all_off); free(sc); free(oc); free(sg); free(og);
        }
}
END_TEST

/* sizes our grouped kernel takes (H, F multiples of 8), sync-free MoE layers */
#define GPU_SYNC_FREE "--num-layers 2 --hidden-size 64 --num-attention-heads 4 "               \
                      "--num-query-groups 2 --seq-length 64 --micro-batch-size 4 "             \
                      "--global-batch-size 8 --num-experts 8 --moe-router-topk 2 "             \
                      "--moe-ffn-hidden-size 64 --ffn-hidden-size 128 --moe-layer-freq 1 "     \
                      "--moe-expert-backend grouped --moe-router-score-function sigmoid "      \
                      "--moe-router-enable-expert-bias --moe-aux-loss-coeff 0 --lr 2e-3 "      \
                      "--lr-warmup-iters 2 --train-iters 10 "

START_TEST(test_gpu_budget_overflow_one_expert) {
    moe_test_budget_protocol(GPU_SYNC_FREE, 1, MOE_TEST_ROUTE_ONE_EXPERT);
}
END_TEST

START_TEST(test_gpu_budget_overflow_alternating) {
    moe_test_budget_protocol(GPU_SYNC_FREE, 1, MOE_TEST_ROUTE_ALTERNATING);
}
END_TEST

Suite *suite_gpu_sync_free(void) {
    Suite *s = suite_create("gpu_sync_free");
    TCase *tc = tcase_create("sync_free");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_gpu_permute_index_budget);
    tcase_add_test(tc, test_gpu_fused_plan);
    tcase_add_test(tc, test_gpu_budget_overflow_one_expert);
    tcase_add_test(tc, test_gpu_budget_overflow_alternating);
    suite_add_tcase(s, tc);
    return s;
}
