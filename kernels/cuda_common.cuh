/**
 * @file cuda_common.cuh
 * @brief What every CUDA file of moe.c shares: error-checking macros, the stream, the
 *        cuBLAS handles, bf16 helpers and launch helpers.
 *
 * Error checking goes through one small set of macros that name file and line and
 * end the process with a message: a failed CUDA call is a bug or a broken device,
 * never a user error, so there is nothing to return to.
 */
#ifndef MOE_CUDA_COMMON_CUH
#define MOE_CUDA_COMMON_CUH

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

/** Activation element type of the CUDA backend. */
typedef __nv_bfloat16 moe_bf16;

/** Abort with file and line when a CUDA runtime call fails. */
#define MOE_CUDA_CHECK(call)                                                                  \
    do {                                                                                      \
        cudaError_t moe_e_ = (call);                                                          \
        if (moe_e_ != cudaSuccess) {                                                          \
            fprintf(stderr, "CUDA error at %s:%d: %s (%s)\n", __FILE__, __LINE__,             \
                    cudaGetErrorString(moe_e_), #call);                                       \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

/** Abort with file and line when a cuBLAS / cuBLASLt call fails. */
#define MOE_CUBLAS_CHECK(call)                                                                \
    do {                                                                                      \
        cublasStatus_t moe_s_ = (call);                                                       \
        if (moe_s_ != CUBLAS_STATUS_SUCCESS) {                                                \
            fprintf(stderr, "cuBLAS error at %s:%d: %s (%s)\n", __FILE__, __LINE__,           \
                    cublasGetStatusString(moe_s_), #call);                                    \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

/** Check the last kernel launch (and, with MOE_CUDA_SYNC_CHECK=1, wait for it). */
#define MOE_CUDA_LAUNCH_CHECK() MOE_CUDA_CHECK(cudaGetLastError())

/** The stream every moe.c kernel and cuBLAS call runs on. */
cudaStream_t moe_cuda_stream(void);

/** The cuBLAS handle, bound to moe_cuda_stream() (created on first use). */
cublasHandle_t moe_cuda_cublas(void);

/** ceil(a / b) for launch grids. */
static inline unsigned moe_cdiv(size_t a, size_t b) { return (unsigned)((a + b - 1) / b); }

/** bf16 → float */
static __device__ __forceinline__ float moe_ld(const moe_bf16 x) { return __bfloat162float(x); }
/** float → bf16, round to nearest even */
static __device__ __forceinline__ moe_bf16 moe_st(float x) { return __float2bfloat16_rn(x); }

#endif /* MOE_CUDA_COMMON_CUH */
