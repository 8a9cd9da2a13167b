/*
 * Grouped GEMM through cuBLAS (chapter 03, backend "b"): every expert's Linear in ONE
 * call, cublasGemmGroupedBatchedEx, instead of one cublasGemmEx per expert.
 *
 * The rows of the experts are contiguous (expert g owns rows [off[g], off[g+1])) and their
 * weights are stacked [G, O, I], so group g is exactly the single matmul of matmul.cu
 * with a row offset and a weight offset: the same column-major mapping (see matmul.cu),
 * one (m, n, k) per group. Empty experts are left out of the call. cuBLAS wants the
 * operand pointers as DEVICE arrays (one per problem) and the sizes as host arrays, so the
 * host builds both from the host-side offsets — this backend still needs the counts on
 * the host, which chapter 03's own kernel removes.
 *
 * Weight gradients are accumulated into fp32 (C in CUDA_R_32F), as in matmul.cu. Where a
 * cuBLAS build does not support a type combination in the grouped call, the op falls back
 * to one cublasGemmEx per group and says so once. cuBLAS 13.1 on an H200 takes the bf16-C
 * calls (forward, dgrad) but rejects bf16 A/B with fp32 C, so wgrad runs per expert.
 */
#include <stdlib.h>
#include <string.h>

#include "cuda_common.cuh"
#include "cuda_ops.h"

typedef struct gproblem {
    int n;              /* how many non-empty groups */
    int *m, *nn, *k;    /* per group sizes */
    int *lda, *ldb, *ldc;
    cublasOperation_t *ta, *tb;
    float *alpha, *beta;
    int *size;          /* 1 problem per group */
    const void **A, **B;
    void **C;
} gproblem;

static void gp_alloc(gproblem *p, int G) {
    p->n = 0;
    p->m = (int *)malloc(sizeof(int) * G * 7);
    p->nn = p->m + G; p->k = p->nn + G; p->lda = p->k + G; p->ldb = p->lda + G;
    p->ldc = p->ldb + G; p->size = p->ldc + G;
    p->ta = (cublasOperation_t *)malloc(sizeof(cublasOperation_t) * G * 2);
    p->tb = p->ta + G;
    p->alpha = (float *)malloc(sizeof(float) * G * 2);
    p->beta = p->alpha + G;
    p->A = (const void **)malloc(sizeof(void *) * G * 3);
    p->B = p->A + G;
    p->C = (void **)(p->B + G);
    MOE_ASSERT(p->m && p->ta && p->alpha && p->A);
}

static void gp_free(gproblem *p) {
    free(p->m); free(p->ta); free(p->alpha); free(p->A);
}

static void gp_add(gproblem *p, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                   const void *A, int lda, const void *B, int ldb, float beta, void *C, int ldc) {
    int i = p->n++;
    p->ta[i] = ta; p->tb[i] = tb; p->m[i] = m; p->nn[i] = n; p->k[i] = k;
    p->A[i] = A; p->lda[i] = lda; p->B[i] = B; p->ldb[i] = ldb; p->C[i] = C; p->ldc[i] = ldc;
    p->alpha[i] = 1.0f; p->beta[i] = beta; p->size[i] = 1;
}

static int g_fallback_noted[2]; /* [C is bf16, C is fp32] */

/* Run the problems: one grouped call, or one cublasGemmEx each if the grouped call is not
 * supported for these types. */
static void gp_run(gproblem *p, cudaDataType_t ctype) {
    if (p->n == 0)
        return;
    const int which = ctype == CUDA_R_32F;
    cublasStatus_t s = CUBLAS_STATUS_NOT_SUPPORTED;
    if (!g_fallback_noted[which]) { /* once rejected, go straight to the loop */
        void **dptr =
            (void **)moe_cuda_scratch(MOE_SCRATCH_GROUPED_GEMM, sizeof(void *) * 3 * p->n);
        /* p->A, p->B, p->C are blocks of G pointers each; with n < G the used parts are not
         * contiguous, so copy them block by block. No stream sync is needed before the host
         * arrays are freed: a copy from pageable memory returns once the data is staged. */
        MOE_CUDA_CHECK(cudaMemcpyAsync(dptr, p->A, sizeof(void *) * p->n, cudaMemcpyHostToDevice,
                                       moe_cuda_stream()));
        MOE_CUDA_CHECK(cudaMemcpyAsync(dptr + p->n, p->B, sizeof(void *) * p->n,
                                       cudaMemcpyHostToDevice, moe_cuda_stream()));
        MOE_CUDA_CHECK(cudaMemcpyAsync(dptr + 2 * p->n, p->C, sizeof(void *) * p->n,
                                       cudaMemcpyHostToDevice, moe_cuda_stream()));
        s = cublasGemmGroupedBatchedEx(moe_cuda_cublas(), p->ta, p->tb, p->m, p->nn, p->k,
                                       p->alpha, (const void *const *)dptr, CUDA_R_16BF, p->lda,
                                       (const void *const *)(dptr + p->n), CUDA_R_16BF, p->ldb,
                                       p->beta, dptr + 2 * p->n, ctype, p->ldc, p->n, p->size,
                                       CUBLAS_COMPUTE_32F);
        if (s == CUBLAS_STATUS_SUCCESS)
            return;
        if (s != CUBLAS_STATUS_NOT_SUPPORTED && s != CUBLAS_STATUS_INVALID_VALUE)
            MOE_CUBLAS_CHECK(s);
        g_fallback_noted[which] = 1;
        fprintf(stderr, "moe.c: cublasGemmGroupedBatchedEx rejects bf16 A/B with %s C (%s); "
                        "using one cublasGemmEx per expert for those GEMMs\n",
                which ? "fp32" : "bf16", cublasGetStatusString(s));
    }
    for (int i = 0; i < p->n; i++)
        MOE_CUBLAS_CHECK(cublasGemmEx(moe_cuda_cublas(), p->ta[i], p->tb[i], p->m[i], p->nn[i],
                                      p->k[i], &p->alpha[i], p->A[i], CUDA_R_16BF, p->lda[i],
                                      p->B[i], CUDA_R_16BF, p->ldb[i], &p->beta[i], p->C[i], ctype,
                                      p->ldc[i], CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

static const moe_bf16 *rows(const void *base, size_t r, int C) {
    return (const moe_bf16 *)base + r * (size_t)C;
}

extern "C" void moe_cuda_grouped_matmul_forward(void *out, const void *in, const void *w,
                                                const int *off, int G, int I, int O) {
    if (G == 1) { /* one matmul: no pointer arrays needed */
        moe_cuda_matmul_forward(out, in, w, off[1] - off[0], I, O);
        return;
    }
    gproblem p;
    gp_alloc(&p, G);
    for (int g = 0; g < G; g++) {
        const int N = off[g + 1] - off[g];
        if (N == 0)
            continue;
        /* outᵀ[O,N] = w_g · inᵀ (matmul.cu's forward) */
        gp_add(&p, CUBLAS_OP_T, CUBLAS_OP_N, O, N, I, rows(w, (size_t)g * O, I), I,
               rows(in, off[g], I), I, 0.0f, (void *)rows(out, off[g], O), O);
    }
    gp_run(&p, CUDA_R_16BF);
    gp_free(&p);
}

extern "C" void moe_cuda_grouped_matmul_backward(void *din, moe_real *dw, const void *dout,
                                                 const void *in, const void *w, const int *off,
                                                 int G, int I, int O) {
    if (G == 1) {
        moe_cuda_matmul_backward(din, dw, dout, in, w, off[1] - off[0], I, O);
        return;
    }
    gproblem p;
    gp_alloc(&p, G);
    if (din) {
        for (int g = 0; g < G; g++) {
            const int N = off[g + 1] - off[g];
            if (N > 0) /* dinᵀ[I,N] += w_gᵀ · doutᵀ */
                gp_add(&p, CUBLAS_OP_N, CUBLAS_OP_N, I, N, O, rows(w, (size_t)g * O, I), I,
                       rows(dout, off[g], O), O, 1.0f, (void *)rows(din, off[g], I), I);
        }
        gp_run(&p, CUDA_R_16BF);
    }
    if (dw) {
        p.n = 0;
        for (int g = 0; g < G; g++) {
            const int N = off[g + 1] - off[g];
            if (N > 0) /* dw_gᵀ[I,O] += inᵀ · dout, fp32 */
                gp_add(&p, CUBLAS_OP_N, CUBLAS_OP_T, I, O, N, rows(in, off[g], I), I,
                       rows(dout, off[g], O), O, 1.0f, dw + (size_t)g * O * I, I);
        }
        gp_run(&p, CUDA_R_32F);
    }
    gp_free(&p);
}
