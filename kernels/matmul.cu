/*
 * Matrix multiplication on the GPU: the three products of a Linear layer through cuBLAS.
 *
 * We do not write GEMM kernels here (chapter 03 writes its own grouped one); cuBLAS's
 * cublasGemmEx runs bf16 inputs on the tensor cores with fp32 accumulation
 * (CUBLAS_COMPUTE_32F). What this file has to get right is the LAYOUT.
 *
 * moe.c is row-major, cuBLAS is column-major (Fortran). The bridge is one fact:
 *
 *     a row-major R×C matrix X, read as column-major, is the C×R matrix Xᵀ,
 *     with leading dimension C.
 *
 * So instead of computing a row-major product we compute its transpose in
 * column-major, (A·B)ᵀ = Bᵀ·Aᵀ, and every operand is then "as stored" (N) or
 * "transposed" (T). With w stored [O,I] (PyTorch layout), the column-major views
 * are: in → inᵀ (I×N, ld I), w → wᵀ (I×O, ld I), dout → doutᵀ (O×N, ld O).
 *
 *   forward  out[N,O]  = in · wᵀ       column-major: outᵀ (O×N) = w · inᵀ
 *            C = outᵀ: m=O, n=N, k=I;  A = w  → op T on wᵀ (lda I);  B = inᵀ → op N (ldb I)
 *
 *   dgrad    din[N,I] += dout · w      column-major: dinᵀ (I×N) += wᵀ · doutᵀ
 *            C = dinᵀ: m=I, n=N, k=O;  A = wᵀ → op N (lda I);  B = doutᵀ → op N (ldb O)
 *
 *   wgrad    dw[O,I]  += doutᵀ · in    column-major: dwᵀ (I×O) += inᵀ · dout
 *            C = dwᵀ: m=I, n=O, k=N;   A = inᵀ → op N (lda I);  B = dout → op T on doutᵀ (ldb O)
 *
 * Backward ops accumulate (beta = 1), as everywhere in moe.c. The weight gradient is
 * an fp32 buffer (it feeds the fp32 optimizer), so wgrad writes C in CUDA_R_32F:
 * cuBLAS reads the old fp32 dw, adds the fp32-accumulated product, writes fp32 — the
 * gradient is never rounded to bf16. dgrad writes bf16, like every activation; note
 * that cuBLAS's bf16 epilogue with beta = 1 rounds the product to bf16 BEFORE adding the
 * old din (measured on an H200: every element equals bf16(bf16(dout·w) + din)), so an
 * accumulated dgrad carries two bf16 roundings — the same as computing the gradient
 * into a bf16 buffer and adding it, which is what PyTorch does.
 *
 * cuBLAS GEMMs are deterministic for a fixed problem, GPU and stream (no split-K with
 * atomics unless asked for), so results repeat bit for bit.
 */
#include "cuda_common.cuh"
#include "cuda_ops.h"

/* C (m×n, col-major, type ctype) = alpha·op(A)·op(B) + beta·C, bf16 A/B, fp32 accumulate. */
static void gemm(cublasOperation_t opa, cublasOperation_t opb, int m, int n, int k,
                 const void *A, int lda, const void *B, int ldb, float beta, void *C,
                 cudaDataType_t ctype, int ldc) {
    const float alpha = 1.0f;
    MOE_CUBLAS_CHECK(cublasGemmEx(moe_cuda_cublas(), opa, opb, m, n, k, &alpha, A, CUDA_R_16BF,
                                  lda, B, CUDA_R_16BF, ldb, &beta, C, ctype, ldc,
                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

extern "C" void moe_cuda_matmul_forward(void *out, const void *in, const void *w, int N, int I,
                                        int O) {
    if (N == 0 || O == 0)
        return;
    if (I == 0) { /* an empty sum: out = 0 */
        moe_cuda_zero(out, (size_t)N * O * sizeof(moe_bf16));
        return;
    }
    /* outᵀ[O,N] = w · inᵀ */
    gemm(CUBLAS_OP_T, CUBLAS_OP_N, O, N, I, w, I, in, I, 0.0f, out, CUDA_R_16BF, O);
}

extern "C" void moe_cuda_matmul_backward(void *din, moe_real *dw, const void *dout,
                                         const void *in, const void *w, int N, int I, int O) {
    if (N == 0 || I == 0 || O == 0)
        return;
    if (din) /* dinᵀ[I,N] += wᵀ · doutᵀ */
        gemm(CUBLAS_OP_N, CUBLAS_OP_N, I, N, O, w, I, dout, O, 1.0f, din, CUDA_R_16BF, I);
    if (dw) /* dwᵀ[I,O] += inᵀ · dout, in fp32 */
        gemm(CUBLAS_OP_N, CUBLAS_OP_T, I, O, N, in, I, dout, O, 1.0f, dw, CUDA_R_32F, I);
}
