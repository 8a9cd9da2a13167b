/*
 * Matrix multiplication on the CPU: the one hot loop of the CPU backend.
 *
 * Everything is expressed with a single kernel, C[M,N] (+)= A[M,K]·B[K,N] with
 * all matrices row-major ("NN"). The three products of a Linear layer map onto
 * it as follows (w is [O,I], PyTorch layout):
 *
 *   forward  out  = in · wᵀ     A = in,     B = wᵀ   (a transposed copy of w)
 *   dgrad    din += dout · w    A = dout,   B = w    (as stored)
 *   wgrad    dw  += doutᵀ · in  A = doutᵀ,  B = in   (a transposed copy of dout)
 *
 * The transposes cost O(M·K) memory traffic against O(M·N·K) arithmetic.
 *
 * The kernel computes C in register tiles of MR×NR = 8×32: for each k it
 * broadcasts eight values of A and multiplies them with 32 contiguous values
 * of B — an outer product that the compiler turns into vector FMAs without any
 * reassociation of sums, so the result is the plain left-to-right sum over k
 * and therefore identical for any number of threads.
 */
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "ops.h"

#define MR 8
#define NR 32

/* Scratch for transposed copies, kept between calls (the sizes repeat every step). */
static moe_real *g_scratch = NULL;
static size_t g_scratch_cap = 0;

static moe_real *scratch(size_t n) {
    if (n > g_scratch_cap) {
        free(g_scratch);
        g_scratch = malloc(n * sizeof *g_scratch);
        MOE_CHECK_ALLOC(g_scratch, n * sizeof *g_scratch, "the matmul's scratch");
        g_scratch_cap = n;
    }
    return g_scratch;
}

void moe_cpu_matmul_release(void) {
    free(g_scratch);
    g_scratch = NULL;
    g_scratch_cap = 0;
}

/* dst[C,R] = src[R,C]ᵀ, in cache-friendly 32×32 blocks. */
static void transpose(moe_real *dst, const moe_real *src, int R, int C) {
#pragma omp parallel for schedule(static)
    for (int r0 = 0; r0 < R; r0 += 32)
        for (int c0 = 0; c0 < C; c0 += 32)
            for (int r = r0; r < r0 + 32 && r < R; r++)
                for (int c = c0; c < c0 + 32 && c < C; c++)
                    dst[(size_t)c * R + r] = src[(size_t)r * C + c];
}

/* One full MR×NR tile at (m, n). */
static inline void tile_full(moe_real *C, const moe_real *A, const moe_real *B, int m, int n,
                             int N, int K, int accumulate) {
    moe_real acc[MR][NR];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NR; j++)
            acc[r][j] = accumulate ? C[(size_t)(m + r) * N + n + j] : 0;
    const moe_real *a0 = A + (size_t)m * K;
    for (int k = 0; k < K; k++) {
        const moe_real *b = B + (size_t)k * N + n;
        for (int r = 0; r < MR; r++) {
            moe_real a = a0[(size_t)r * K + k];
            for (int j = 0; j < NR; j++)
                acc[r][j] += a * b[j];
        }
    }
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NR; j++)
            C[(size_t)(m + r) * N + n + j] = acc[r][j];
}

/* A partial tile at the edges: same arithmetic order, bounds-checked. */
static void tile_edge(moe_real *C, const moe_real *A, const moe_real *B, int m, int n, int M,
                      int N, int K, int accumulate) {
    int mr = M - m < MR ? M - m : MR, nr = N - n < NR ? N - n : NR;
    moe_real acc[MR][NR];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < nr; j++)
            acc[r][j] = accumulate ? C[(size_t)(m + r) * N + n + j] : 0;
    for (int k = 0; k < K; k++)
        for (int r = 0; r < mr; r++) {
            moe_real a = A[(size_t)(m + r) * K + k];
            for (int j = 0; j < nr; j++)
                acc[r][j] += a * B[(size_t)k * N + n + j];
        }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < nr; j++)
            C[(size_t)(m + r) * N + n + j] = acc[r][j];
}

/* C[M,N] (+)= A[M,K] · B[K,N]. */
static void gemm_nn(moe_real *C, const moe_real *A, const moe_real *B, int M, int N, int K,
                    int accumulate) {
    const int tm = (M + MR - 1) / MR, tn = (N + NR - 1) / NR;
    const long tiles = (long)tm * tn;
#pragma omp parallel for schedule(static)
    for (long t = 0; t < tiles; t++) {
        int m = (int)(t / tn) * MR, n = (int)(t % tn) * NR;
        if (m + MR <= M && n + NR <= N)
            tile_full(C, A, B, m, n, N, K, accumulate);
        else
            tile_edge(C, A, B, m, n, M, N, K, accumulate);
    }
}

void moe_cpu_matmul_forward(moe_real *out, const moe_real *in, const moe_real *w, int N, int I,
                            int O) {
    if (N == 0)
        return;
    moe_real *wt = scratch((size_t)I * O);
    transpose(wt, w, O, I);
    gemm_nn(out, in, wt, N, O, I, 0);
}

void moe_cpu_matmul_backward(moe_real *din, moe_real *dw, const moe_real *dout, const moe_real *in,
                             const moe_real *w, int N, int I, int O) {
    if (N == 0)
        return;
    if (din)
        gemm_nn(din, dout, w, N, I, O, 1);
    if (dw) {
        moe_real *doutt = scratch((size_t)N * O);
        transpose(doutt, dout, N, O);
        gemm_nn(dw, doutt, in, O, I, N, 1);
    }
}
