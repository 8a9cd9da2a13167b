/*
 * The grouped GEMM on the CPU (chapter 03). The MoE layer's experts are G Linear layers
 * of the same shape applied to ragged, contiguous slices of one row buffer: group g owns
 * rows [off[g], off[g+1]). The GPU kernels of chapter 03 do all groups in one launch and
 * read off[] from device memory, so the host never waits for the counts; on the CPU there
 * is no launch to save, so the grouped GEMM is a loop over the groups, each an ordinary
 * moe_cpu_matmul_forward() on its slice. Empty groups (off[g] == off[g+1]) cost nothing.
 */
#include <stddef.h>

#include "ops.h"

void moe_cpu_grouped_matmul_forward(moe_real *out, const moe_real *in, const moe_real *w,
                                    const int *off, int G, int I, int O) {
    for (int g = 0; g < G; g++)
        moe_cpu_matmul_forward(out + (size_t)off[g] * O, in + (size_t)off[g] * I,
                               w + (size_t)g * O * I, off[g + 1] - off[g], I, O);
}

void moe_cpu_grouped_matmul_backward(moe_real *din, moe_real *dw, const moe_real *dout,
                                     const moe_real *in, const moe_real *w, const int *off, int G,
                                     int I, int O) {
    for (int g = 0; g < G; g++)
        moe_cpu_matmul_backward(din ? din + (size_t)off[g] * I : NULL,
                                dw ? dw + (size_t)g * O * I : NULL, dout + (size_t)off[g] * O,
                                in + (size_t)off[g] * I, w + (size_t)g * O * I,
                                off[g + 1] - off[g], I, O);
}
