/* The CUDA backend's shared state: one stream, one cuBLAS handle. See cuda_common.cuh. */
#include "cuda_common.cuh"

static cudaStream_t g_stream = NULL;
static cublasHandle_t g_cublas = NULL;

cudaStream_t moe_cuda_stream(void) {
    if (!g_stream)
        MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
    return g_stream;
}

static void *g_scratch[MOE_SCRATCH_SLOTS];
static size_t g_scratch_bytes[MOE_SCRATCH_SLOTS];

void *moe_cuda_scratch(moe_scratch_slot slot, size_t bytes) {
    if (bytes > g_scratch_bytes[slot]) {
        if (g_scratch[slot]) {
            MOE_CUDA_CHECK(cudaStreamSynchronize(moe_cuda_stream()));
            MOE_CUDA_CHECK(cudaFree(g_scratch[slot]));
        }
        MOE_CUDA_CHECK(cudaMalloc(&g_scratch[slot], bytes));
        g_scratch_bytes[slot] = bytes;
    }
    return g_scratch[slot];
}

cublasHandle_t moe_cuda_cublas(void) {
    if (!g_cublas) {
        MOE_CUBLAS_CHECK(cublasCreate(&g_cublas));
        MOE_CUBLAS_CHECK(cublasSetStream(g_cublas, moe_cuda_stream()));
    }
    return g_cublas;
}
