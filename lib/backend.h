/**
 * @file backend.h
 * @brief The seam between the model and the hardware: a table of ops.
 *
 * The model (model.c, moe_layer.c, mlp.c) is written once against this table;
 * it never calls a CPU or CUDA function directly. The CPU backend
 * (lib/cpu/backend.c) fills the table with the reference ops of lib/cpu/; a
 * CUDA backend fills it with launchers from kernels/ whose arguments are
 * device pointers. Every op has the signature and the accumulate-into-gradients
 * contract documented in lib/cpu/ops.h, lib/cpu/router.h and lib/cpu/moe_ops.h.
 *
 * Memory that the model touches is allocated through the table as well, so the
 * model does not know where it lives. Host-side decisions the naive MoE loop
 * needs (how many tokens each expert got) come back through `permute_index`,
 * which returns the expert offsets on the host — the host sync that chapter 06
 * removes.
 */
#ifndef MOE_BACKEND_H
#define MOE_BACKEND_H

#include <stddef.h>

#include "cpu/moe_ops.h"
#include "cpu/ops.h"
#include "cpu/router.h"
#include "error.h"

/** Which backend. */
typedef enum moe_device { MOE_DEVICE_CPU = 0, MOE_DEVICE_CUDA = 1 } moe_device;

/** The op table. See lib/cpu/ops.h for the meaning of each op. */
typedef struct moe_backend {
    const char *name;      /**< "cpu" or "cuda" */
    moe_device device;     /**< which device its pointers live on */

    /** @name memory */
    /**@{*/
    void *(*alloc)(size_t bytes);                         /**< zeroed allocation (NULL on failure) */
    void (*free)(void *p);                                /**< release */
    void (*zero)(void *p, size_t bytes);                  /**< memset 0 */
    void (*copy)(void *dst, const void *src, size_t bytes);      /**< device → device */
    void (*to_host)(void *dst, const void *src, size_t bytes);   /**< device → host */
    void (*from_host)(void *dst, const void *src, size_t bytes); /**< host → device */
    /**@}*/

    /** @name dense ops */
    /**@{*/
    /** as moe_cpu_matmul_forward() */
    void (*matmul_forward)(moe_real *, const moe_real *, const moe_real *, int, int, int);
    /** as moe_cpu_matmul_backward() */
    void (*matmul_backward)(moe_real *, moe_real *, const moe_real *, const moe_real *,
                            const moe_real *, int, int, int);
    /** as moe_cpu_embedding_forward() */
    void (*embedding_forward)(moe_real *, const int *, const moe_real *, int, int);
    /** as moe_cpu_embedding_backward() */
    void (*embedding_backward)(moe_real *, const moe_real *, const int *, int, int, int);
    /** as moe_cpu_rmsnorm_forward() */
    void (*rmsnorm_forward)(moe_real *, moe_real *, const moe_real *, const moe_real *, int, int,
                            double);
    /** as moe_cpu_rmsnorm_backward() */
    void (*rmsnorm_backward)(moe_real *, moe_real *, const moe_real *, const moe_real *,
                             const moe_real *, const moe_real *, int, int);
    /** as moe_cpu_rope_forward() */
    void (*rope_forward)(moe_real *, const moe_real *, int, int, int, int, double);
    /** as moe_cpu_rope_backward() */
    void (*rope_backward)(moe_real *, const moe_real *, int, int, int, int, double);
    /** as moe_cpu_attention_forward() */
    void (*attention_forward)(moe_real *, moe_real *, const moe_real *, const moe_real *,
                              const moe_real *, int, int, int, int, int);
    /** as moe_cpu_attention_backward() */
    void (*attention_backward)(moe_real *, moe_real *, moe_real *, const moe_real *,
                               const moe_real *, const moe_real *, const moe_real *,
                               const moe_real *, int, int, int, int, int);
    /** as moe_cpu_swiglu_forward() */
    void (*swiglu_forward)(moe_real *, const moe_real *, int, int);
    /** as moe_cpu_swiglu_backward() */
    void (*swiglu_backward)(moe_real *, const moe_real *, const moe_real *, int, int);
    /** as moe_cpu_cross_entropy_forward() */
    void (*cross_entropy_forward)(moe_real *, const moe_real *, const int *, int, int);
    /** as moe_cpu_cross_entropy_backward() */
    void (*cross_entropy_backward)(moe_real *, const moe_real *, const moe_real *, const int *,
                                   int, int);
    /** y += x over n elements (residual connections) */
    void (*add)(moe_real *y, const moe_real *x, size_t n);
    /** x *= s over n elements */
    void (*scale)(moe_real *x, double s, size_t n);
    /**@}*/

    /** @name MoE ops */
    /**@{*/
    /** as moe_cpu_router_forward() */
    void (*router_forward)(int *, moe_real *, const moe_real *, const float *,
                           const moe_router_params *, int);
    /** as moe_cpu_router_backward() */
    void (*router_backward)(moe_real *, const moe_real *, const moe_real *, const int *,
                            const moe_router_params *, int);
    /** as moe_cpu_aux_loss_forward() */
    double (*aux_loss_forward)(const moe_real *, int, int, int, int, moe_score_fn, double);
    /** as moe_cpu_aux_loss_backward() */
    void (*aux_loss_backward)(moe_real *, const moe_real *, int, int, int, int, moe_score_fn,
                              double, double);
    /** as moe_cpu_z_loss_forward() */
    double (*z_loss_forward)(const moe_real *, int, int, double);
    /** as moe_cpu_z_loss_backward() */
    void (*z_loss_backward)(moe_real *, const moe_real *, int, int, double, double);
    /** builds perm_src/row_of on the device; expert_offset and counts are HOST arrays */
    void (*permute_index)(int *, int *, int *, long long *, const int *, int, int, int);
    /** as moe_cpu_permute_tokens() */
    void (*permute_tokens)(moe_real *, const moe_real *, const int *, int, int, int);
    /** as moe_cpu_permute_weights() */
    void (*permute_weights)(moe_real *, const moe_real *, const int *, int);
    /** as moe_cpu_unpermute_sum() */
    void (*unpermute_sum)(moe_real *, const moe_real *, const int *, int, int, int);
    /** as moe_cpu_unpermute_weights() */
    void (*unpermute_weights)(moe_real *, const moe_real *, const int *, int, int);
    /** row-wise scale: x[r,:] *= s[r] (the routing weight applied after the activation) */
    void (*scale_rows)(moe_real *x, const moe_real *s, int rows, int C);
    /** ds[r] += Σ_c a[r,c]·b[r,c] (gradient of a row scale) */
    void (*row_dot)(moe_real *ds, const moe_real *a, const moe_real *b, int rows, int C);
    /**@}*/
} moe_backend;

/** @brief The CPU reference backend. @return a static table */
const moe_backend *moe_backend_cpu(void);

/**
 * @brief Resolve `--device` to a backend.
 * @param name "auto", "cpu" or "cuda"
 * @param out receives the backend
 * @param err receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_BACKEND when cuda is asked for but not available (with the fix)
 */
moe_status moe_backend_select(const char *name, const moe_backend **out, moe_error *err);

#endif /* MOE_BACKEND_H */
