/* The CUDA backend's shared state: one stream, one cuBLAS handle. See cuda_common.cuh. */
#include "cuda_common.cuh"

static cudaStream_t g_stream = NULL;
static cublasHandle_t g_cublas = NULL;

cudaStream_t moe_cuda_stream(void) {
    if (!g_stream)
        MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
    return g_stream;
}

/* MOE_CUDA_SYNC_CHECK=1 in the environment: read once. */
static int sync_check(void) {
    static int on = -1;
    if (on < 0) {
        const char *s = getenv("MOE_CUDA_SYNC_CHECK");
        on = s && s[0] == '1' && s[1] == '\0';
    }
    return on;
}

void moe_cuda_launch_check(const char *file, int line) {
    cudaError_t e = cudaGetLastError();
    const char *when = "at launch";
    if (e == cudaSuccess && sync_check()) {
        e = cudaStreamSynchronize(moe_cuda_stream());
        when = "while running (MOE_CUDA_SYNC_CHECK=1)";
    }
    if (e != cudaSuccess) {
        fprintf(stderr, "CUDA error at %s:%d: %s (kernel %s)\n", file, line, cudaGetErrorString(e),
                when);
        exit(1);
    }
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
