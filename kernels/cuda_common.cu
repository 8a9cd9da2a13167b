/* The CUDA backend's shared state: one stream, one cuBLAS handle, the scratch buffers.
 * See cuda_common.cuh. */
#include <string.h>

#include "cuda_common.cuh"

static cudaStream_t g_stream = NULL;
static cublasHandle_t g_cublas = NULL;

cudaStream_t moe_cuda_stream(void) {
    if (!g_stream)
        MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
    return g_stream;
}

int moe_cuda_env_choice(const char *var, const char *const *names, int n, int dflt,
                        const char *help) {
    const char *e = getenv(var);
    if (!e || !*e)
        return dflt;
    for (int i = 0; i < n; i++)
        if (*names[i] && !strcmp(e, names[i]))
            return i;
    fprintf(stderr, "moe.c: %s=%s: use %s, or unset it for the default (%s)\n", var, e, help,
            names[dflt]);
    exit(1);
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
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    if (e == cudaSuccess && sync_check() &&
        cudaStreamIsCapturing(moe_cuda_stream(), &cap) == cudaSuccess &&
        cap == cudaStreamCaptureStatusNone) { /* a capture cannot wait: checked at replay */
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
static unsigned long long g_epoch = 0;

static const char *const g_slot_names[MOE_SCRATCH_SLOTS] = {
    "aux_loss", "embedding", "permute", "grouped_gemm", "wgrad_split",
    "gather", "rmsnorm", "reduce", "cublas", "fp8_gemm", "scatter", "attention_dq"};

unsigned long long moe_cuda_memory_epoch(void) { return g_epoch; }

void moe_cuda_memory_moved(void) { g_epoch++; }

void *moe_cuda_scratch(moe_scratch_slot slot, size_t bytes) {
    if (bytes > g_scratch_bytes[slot]) {
        char what[96];
        snprintf(what, sizeof what, "scratch buffer '%s' grows (cudaMalloc)", g_slot_names[slot]);
        (void)moe_cuda_capture_forbid(what); /* then grow eagerly: the capture is gone */
        /* round up to a power of two (at least 64 KiB): a slot whose size wobbles with the
         * shape settles after one growth instead of growing every time */
        size_t cap = 65536;
        while (cap < bytes)
            cap *= 2;
        moe_cuda_free_counted(g_scratch[slot]);
        g_scratch[slot] = moe_cuda_malloc_counted(cap);
        if (!g_scratch[slot]) {
            fprintf(stderr, "CUDA scratch '%s': out of device memory (%zu bytes)\n",
                    g_slot_names[slot], cap);
            exit(1);
        }
        g_scratch_bytes[slot] = cap;
        moe_cuda_memory_moved();
    }
    return g_scratch[slot];
}

int moe_cuda_cc_major(void) {
    static int major = -1;
    if (major < 0) {
        int dev = 0, m = 0;
        MOE_CUDA_CHECK(cudaGetDevice(&dev));
        MOE_CUDA_CHECK(cudaDeviceGetAttribute(&m, cudaDevAttrComputeCapabilityMajor, dev));
        major = m;
    }
    return major;
}

cublasHandle_t moe_cuda_cublas(void) {
    if (!g_cublas) {
        MOE_CUBLAS_CHECK(cublasCreate(&g_cublas));
        MOE_CUBLAS_CHECK(cublasSetStream(g_cublas, moe_cuda_stream()));
        /* Our own workspace, set once: cuBLAS then never allocates one itself (it may not
         * inside a graph capture), and eager and captured GEMMs see the same workspace
         * size, so its heuristics pick the same kernels: replay equals eager bit for bit.
         * 32 MiB is what NVIDIA recommends for Hopper. */
        const size_t ws = (size_t)32 << 20;
        MOE_CUBLAS_CHECK(cublasSetWorkspace(g_cublas, moe_cuda_scratch(MOE_SCRATCH_CUBLAS, ws), ws));
    }
    return g_cublas;
}
