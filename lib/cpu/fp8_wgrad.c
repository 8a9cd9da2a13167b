/*
 * The CPU twin of chapter 05's FP8 grouped wgrad (lib/fp8_wgrad.h): the definition the CUDA
 * kernel (kernels/grouped_gemm_fp8_wgrad_sm90.cu) is compared with. Per group and 128-token
 * block the exact sum of the decoded code products (in double: at most 128 products of two
 * E4M3 values, so the only rounding is the final one to fp32, where the tensor cores' own
 * accumulation is slightly coarser), then the promotion d = fma(partial, sa·sb, d) in fp32,
 * block after block, as the kernel does.
 */
#include <math.h>
#include <stdlib.h>

#include "config.h" /* MOE_GROUPED_DEV_MAX_GROUPS */
#include "fp8_wgrad.h"

moe_status moe_cpu_fp8_grouped_wgrad(float *d, int accumulate, const uint8_t *qa,
                                     const float *sa, const uint8_t *qb, const float *sb,
                                     const int *off, int G, size_t kpad, int M, int N,
                                     moe_error *err) {
    const int B = MOE_QUANT_BLOCK;
    if (G < 1 || G > MOE_GROUPED_DEV_MAX_GROUPS || M <= 0 || N <= 0 || M % B || N % B ||
        kpad % B)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "FP8 grouped wgrad: G=%d M=%d N=%d kpad=%zu: give 1 to %d groups "
                             "and M, N, kpad positive multiples of %d",
                             G, M, N, kpad, MOE_GROUPED_DEV_MAX_GROUPS, B);
    if (!d || !qa || !sa || !qb || !sb || !off)
        return moe_error_set(err, MOE_ERR_CONFIG, "FP8 grouped wgrad: a pointer is NULL");
    size_t used = 0;
    for (int g = 0; g < G; g++) {
        if (off[g + 1] < off[g] || off[0] != 0)
            return moe_error_set(err, MOE_ERR_CONFIG,
                                 "FP8 grouped wgrad: offsets must start at 0 and not decrease "
                                 "(group %d)", g);
        used += (size_t)(off[g + 1] - off[g] + B - 1) / B * B;
    }
    if (used > kpad)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "FP8 grouped wgrad: the groups need %zu padded columns, the copies "
                             "have kpad=%zu (moe_fp8_wgrad_kpad())", used, kpad);
    /* E4M3 decoded once: a 256-entry table */
    float dec[256];
    for (int i = 0; i < 256; i++)
        dec[i] = moe_fp8_decode((uint8_t)i, MOE_FP8_E4M3);
    size_t p = 0;
    for (int g = 0; g < G; g++) {
        const int nb = (off[g + 1] - off[g] + B - 1) / B;
        float *dg = d + (size_t)g * M * N;
#pragma omp parallel for schedule(static)
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) {
                float acc = 0.0f;
                for (int kb = 0; kb < nb; kb++) {
                    const size_t k0 = p + (size_t)kb * B;
                    const uint8_t *a = qa + (size_t)m * kpad + k0, *b = qb + (size_t)n * kpad + k0;
                    double s = 0;
                    for (int k = 0; k < B; k++)
                        s += (double)dec[a[k]] * dec[b[k]];
                    const float sc = sa[k0 / B * M + m] * sb[k0 / B * N + n];
                    acc = fmaf((float)s, sc, acc);
                }
                float *o = dg + (size_t)m * N + n;
                if (!accumulate)
                    *o = acc;
                else if (nb > 0)
                    *o += acc;
            }
        p += (size_t)nb * B;
    }
    return MOE_OK;
}
