/* The CUDA backend's shared state: one stream, one cuBLAS handle. See cuda_common.cuh. */
#include "cuda_common.cuh"

static cudaStream_t g_stream = NULL;
static cublasHandle_t g_cublas = NULL;

cudaStream_t moe_cuda_stream(void) {
    if (!g_stream)
        MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
    return g_stream;
}

cublasHandle_t moe_cuda_cublas(void) {
    if (!g_cublas) {
        MOE_CUBLAS_CHECK(cublasCreate(&g_cublas));
        MOE_CUBLAS_CHECK(cublasSetStream(g_cublas, moe_cuda_stream()));
    }
    return g_cublas;
}
