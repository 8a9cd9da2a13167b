/**
 * @file real.h
 * @brief The floating-point type of the CPU backend.
 *
 * The CPU backend is written once against `moe_real`, which is `float` in every
 * normal build. The gradient-check tests compile the very same sources a
 * second time with `-DMOE_REAL_DOUBLE`, so finite differences run in double
 * precision on the real code, not on a copy of it.
 */
#ifndef MOE_REAL_H
#define MOE_REAL_H

#include <math.h>

/** Marks small functions that host C code and CUDA kernels share. */
#ifdef __CUDACC__
#define MOE_HOSTDEV __host__ __device__
#else
#define MOE_HOSTDEV
#endif

#ifdef MOE_REAL_DOUBLE
typedef double moe_real;      /**< scalar type of the CPU backend (double in the gradcheck build) */
#define MOE_REAL_NAME "fp64"
#define moe_exp exp
#define moe_log log
#define moe_sqrt sqrt
#define moe_cos cos
#define moe_sin sin
#define moe_fabs fabs
#define moe_pow pow
#else
typedef float moe_real;       /**< scalar type of the CPU backend (float in normal builds) */
#define MOE_REAL_NAME "fp32"  /**< name of the scalar type, for messages */
#define moe_exp expf          /**< exp in the scalar type */
#define moe_log logf          /**< log in the scalar type */
#define moe_sqrt sqrtf        /**< sqrt in the scalar type */
#define moe_cos cosf          /**< cos in the scalar type */
#define moe_sin sinf          /**< sin in the scalar type */
#define moe_fabs fabsf        /**< fabs in the scalar type */
#define moe_pow powf          /**< pow in the scalar type */
#endif

#endif /* MOE_REAL_H */
