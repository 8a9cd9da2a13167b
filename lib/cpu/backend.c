/* The CPU backend: the op table of backend.h filled with the reference ops. */
#include <stdlib.h>
#include <string.h>

#include "backend.h"

static void *cpu_alloc(size_t bytes) { return calloc(1, bytes ? bytes : 1); }
static void cpu_free(void *p) { free(p); }
static void cpu_zero(void *p, size_t bytes) { memset(p, 0, bytes); }
static void cpu_copy(void *dst, const void *src, size_t bytes) { memcpy(dst, src, bytes); }

static void cpu_add(moe_real *y, const moe_real *x, size_t n) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++)
        y[i] += x[i];
}

static void cpu_scale(moe_real *x, double s, size_t n) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++)
        x[i] = (moe_real)(x[i] * s);
}

static void cpu_scale_rows(moe_real *x, const moe_real *s, int rows, int C) {
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < C; c++)
            x[(size_t)r * C + c] *= s[r];
}

static void cpu_row_dot(moe_real *ds, const moe_real *a, const moe_real *b, int rows, int C) {
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        double acc = 0.0;
        for (int c = 0; c < C; c++)
            acc += (double)a[(size_t)r * C + c] * b[(size_t)r * C + c];
        ds[r] += (moe_real)acc;
    }
}

static const moe_backend g_cpu = {
    .name = "cpu",
    .device = MOE_DEVICE_CPU,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .zero = cpu_zero,
    .copy = cpu_copy,
    .to_host = cpu_copy,
    .from_host = cpu_copy,
    .matmul_forward = moe_cpu_matmul_forward,
    .matmul_backward = moe_cpu_matmul_backward,
    .embedding_forward = moe_cpu_embedding_forward,
    .embedding_backward = moe_cpu_embedding_backward,
    .rmsnorm_forward = moe_cpu_rmsnorm_forward,
    .rmsnorm_backward = moe_cpu_rmsnorm_backward,
    .rope_forward = moe_cpu_rope_forward,
    .rope_backward = moe_cpu_rope_backward,
    .attention_forward = moe_cpu_attention_forward,
    .attention_backward = moe_cpu_attention_backward,
    .swiglu_forward = moe_cpu_swiglu_forward,
    .swiglu_backward = moe_cpu_swiglu_backward,
    .cross_entropy_forward = moe_cpu_cross_entropy_forward,
    .cross_entropy_backward = moe_cpu_cross_entropy_backward,
    .add = cpu_add,
    .scale = cpu_scale,
    .router_forward = moe_cpu_router_forward,
    .router_backward = moe_cpu_router_backward,
    .aux_loss_forward = moe_cpu_aux_loss_forward,
    .aux_loss_backward = moe_cpu_aux_loss_backward,
    .z_loss_forward = moe_cpu_z_loss_forward,
    .z_loss_backward = moe_cpu_z_loss_backward,
    .permute_index = moe_cpu_permute_index,
    .permute_tokens = moe_cpu_permute_tokens,
    .permute_weights = moe_cpu_permute_weights,
    .unpermute_sum = moe_cpu_unpermute_sum,
    .unpermute_weights = moe_cpu_unpermute_weights,
    .scale_rows = cpu_scale_rows,
    .row_dot = cpu_row_dot,
};

const moe_backend *moe_backend_cpu(void) { return &g_cpu; }

moe_status moe_backend_select(const char *name, const moe_backend **out, moe_error *err) {
    if (!strcmp(name, "cpu") || !strcmp(name, "auto")) {
        /* "auto" picks CUDA once a CUDA backend is compiled in and a GPU is present. */
        *out = &g_cpu;
        return MOE_OK;
    }
    if (!strcmp(name, "cuda"))
        return moe_error_set(err, MOE_ERR_BACKEND,
                             "--device cuda: this build has no CUDA backend yet (it arrives with "
                             "the CUDA issue); use --device cpu");
    return moe_error_set(err, MOE_ERR_FLAG, "--device must be auto, cpu or cuda (got '%s')", name);
}
