/*
 * Choosing a backend: `--device auto|cpu|cuda` to an op table.
 *
 * The CPU table is always there (lib/cpu/backend.c). The CUDA table exists in builds with
 * MOE_HAVE_CUDA, implemented by kernels/backend_cuda.cu against the two functions
 * lib/backend.h declares; this file is the only one in lib/ that asks for it.
 */
#include <string.h>

#include "backend.h"

moe_status moe_backend_select(const char *name, const moe_backend **out, moe_error *err) {
    if (!strcmp(name, "cpu")) {
        *out = moe_backend_cpu();
        return MOE_OK;
    }
    if (!strcmp(name, "auto")) {
#ifdef MOE_HAVE_CUDA
        if (moe_cuda_available()) {
            *out = moe_backend_cuda();
            return MOE_OK;
        }
#endif
        *out = moe_backend_cpu();
        return MOE_OK;
    }
    if (!strcmp(name, "cuda")) {
#ifdef MOE_HAVE_CUDA
        if (moe_cuda_available()) {
            *out = moe_backend_cuda();
            return MOE_OK;
        }
        return moe_error_set(err, MOE_ERR_BACKEND,
                             "--device cuda: no usable GPU was found (no device or no driver); "
                             "use --device cpu, or run on a machine with an NVIDIA GPU");
#else
        return moe_error_set(err, MOE_ERR_BACKEND,
                             "--device cuda: this build has no CUDA backend (nvcc was not found "
                             "when it was built); install the CUDA toolkit and rebuild, or use "
                             "--device cpu");
#endif
    }
    return moe_error_set(err, MOE_ERR_FLAG, "--device must be auto, cpu or cuda (got '%s')", name);
}
