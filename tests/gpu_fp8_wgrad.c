/*
 * Chapter 05's FP8 wgrad (lib/fp8_wgrad.h) on the GPU against its CPU twins:
 *  - the token-wise quantize + transpose per expert group (moe_cuda_quant_group_t_act vs
 *    moe_cpu_quant_group_t): codes and scales byte for byte over the whole poisoned buffers
 *    (the tail past the last group's padded end must stay poisoned on both sides), and the
 *    emulation's QDQ (moe_cuda_qdq_group_t_act vs moe_cpu_qdq_group_t rounded to bf16);
 *  - the grouped wgrad GEMM (moe_cuda_fp8_grouped_wgrad vs moe_cpu_fp8_grouped_wgrad) in its
 *    three modes: fp32 added onto random values (an empty group's block must keep them),
 *    fp32 stored and bf16 stored over NaN poison (an empty group's block must be zeros);
 *    each with both consumer loops (moe_cuda_fp8_wgrad_set_pipe: pipelined, then the first
 *    one), each with the scales brought into shared memory with their stage and read from
 *    global memory (moe_cuda_fp8_wgrad_set_smem_scales; a count of launches proves which
 *    ran), then the 128 × 256 tile (moe_cuda_fp8_wgrad_set_bn(256), its split promotion; its
 *    own count of launches proves it ran), then the 128 × 256 tile and the pipelined loop
 *    with dW prefetched into L2 before the reduce-add (moe_cuda_wgrad_set_prefetch; a count
 *    proves it ran when adding, and only then), then the 128 × 256 tile writing fp32 dW
 *    straight from registers (moe_cuda_fp8_wgrad_set_epilogue(DIRECT); a count proves it ran
 *    with fp32 output, and only then), then the 128 × 256 tile promoted by 64-column quarters
 *    with two accumulator sets (moe_cuda_fp8_wgrad_set_quarters; its own count), then the
 *    128 × 256 tile adding by read-modify-write from registers (RMW) and with the auto
 *    epilogue (RMW for tiles of at most 8 k-blocks, TMA for longer ones: the shape with a
 *    1200-row group has both), and both issue orders of the warpgroups (the quarters take no
 *    turns: the same run twice). The eleven promote the
 *    same k-blocks' partials (m64n128k32, or m64n64k32 by quarters: the same products summed
 *    over the same 128-deep block for each element) with the same scales in the same order
 *    and add each sum once, so their outputs must also be equal bit for bit. The wide tile on
 *    N = 128·odd (its last tile's second half past N: not computed, not stored) and
 *    N = 256·k.
 * Ragged groups: 0, 1, 127, 128, 129, 255 rows; 40 groups of 0 to 189 rows; for the GEMM
 * also 700, 0, 385, 257, 1 rows (6, 0, 4, 3, 1 k-blocks) and 1200, 130, 0, 900 (10, 2, 0,
 * 8 k-blocks: auto's two epilogues in one launch); for the quantizer also the most
 * groups (256, 0 to 300 rows, C = 384). The quantizer in both formats, pow2 scales on and
 * off, by its vectorized kernel and by the first one (MOE_QUANT_GROUP_T_V1), with a NaN, an
 * infinity, −0 and bf16 subnormals among the values; a count of launches proves which ran.
 *
 * The GEMM's bound: the CPU sums each block's code products exactly; Hopper's FP8 tensor
 * cores accumulate a 128-deep block with about 14 significant bits (DeepSeek-V3), then both
 * promote in fp32. So |gpu − cpu| ≤ 2⁻¹⁰ · Σ_kb |sa·sb| · Σ_k |qa·qb| + 1e-6·|cpu| + tiny
 * (4x the 14 bits' worth, for safety), with the Σ|.| computed on the CPU per element; a wrong
 * index, scale or layout is O(1) of the values, and the sum of a few hundred random-sign
 * products is about Σ|.|/√n, still ~2⁻⁵ of it. "worst error" prints the largest error as a
 * fraction of that bound (a healthy kernel: well below 1). The first violation is printed
 * with its (group, row, column) and both values.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h" /* MOE_GROUPED_DEV_MAX_GROUPS */
#include "cuda_ops.h"
#include "fp8_wgrad.h"
#include "helpers.h"
#include "suites.h"

static int hopper(const char *what) {
    if (moe_cuda_grouped_sm90_available())
        return 1;
    printf("  %s: skipped: not a Hopper GPU (the FP8 wgrad kernel is sm_90a only)\n", what);
    return 0;
}

static void *dpoison(size_t bytes, unsigned char byte) {
    void *h = malloc(bytes ? bytes : 1);
    ck_assert_ptr_nonnull(h);
    memset(h, byte, bytes);
    void *d = moe_cuda_alloc(bytes ? bytes : 1);
    moe_cuda_from_host(d, h, bytes);
    free(h);
    return d;
}

/* the device bytes equal the host's; the first difference printed */
static int same(const char *what, const void *dev, const void *host, size_t bytes) {
    unsigned char *got = malloc(bytes ? bytes : 1);
    moe_cuda_to_host(got, dev, bytes);
    size_t diff = 0, first = 0;
    for (size_t i = 0; i < bytes; i++)
        if (got[i] != ((const unsigned char *)host)[i] && !diff++)
            first = i;
    if (diff)
        printf("  %s: %zu of %zu bytes differ, the first at byte %zu: GPU 0x%02x, CPU 0x%02x\n",
               what, diff, bytes, first, got[first], ((const unsigned char *)host)[first]);
    free(got);
    return diff == 0;
}

/* random bf16-exact values on both sides: x [rows][C] host fp32, dx its device bf16 copy */
static void *upload(float *x, size_t n, uint64_t seed, double scale) {
    const moe_backend *g = moe_backend_cuda();
    moe_real *h = malloc(sizeof(moe_real) * (n ? n : 1));
    void *d = moe_test_upload(g, h, n, seed, scale);
    for (size_t i = 0; i < n; i++)
        x[i] = (float)h[i];
    free(h);
    return d;
}

static void offsets(int *off, const int *sizes, int G) {
    off[0] = 0;
    for (int e = 0; e < G; e++)
        off[e + 1] = off[e] + sizes[e];
}

/* one element set to the bf16 of bits b on both sides (host fp32, device bf16) */
static void poke(float *x, void *dx, size_t i, uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    memcpy(&x[i], &u, 4);
    moe_cuda_from_host((char *)dx + 2 * i, &b, 2);
}

/* (a): quantize + transpose and the QDQ of one [rows][C] bf16 tensor, ragged groups, in
 * format f with pow2 scales or not, by the kernel v1 says (moe_cuda_quant_group_t_set_v1);
 * special: a NaN, an infinity (their blocks' scales NaN, codes 0), −0 and bf16 subnormals
 * (codes that round to ±0) among the first 64 tokens */
static int check_quant(const int *sizes, int G, int C, uint64_t seed, moe_fp8_format f, int pow2,
                       int v1, int special) {
    int off[MOE_GROUPED_DEV_MAX_GROUPS + 1];
    offsets(off, sizes, G);
    const int rows = off[G] + 3; /* 3 rows past the groups (a static budget's): never read */
    const size_t kpad = moe_fp8_wgrad_kpad(rows, G), n = (size_t)rows * C;
    const size_t nq = (size_t)C * kpad, ns = kpad / MOE_QUANT_BLOCK * C;
    float *x = malloc(sizeof(float) * (n + 1));
    void *dx = upload(x, n, seed, 2.0);
    for (size_t i = 0; special && i < 64 && i < (size_t)rows; i++) /* token i, channel 3i mod C */
        poke(x, dx, i * C + (3 * i) % C,
             i == 5   ? 0x7FC0 /* NaN */
             : i == 9 ? 0xFF80 /* −inf */
             : i % 4 == 1 ? 0x8000 /* −0 */
             : i % 4 == 2 ? 0x0001 : 0x8013); /* ± bf16 subnormals */
    const int saved_v1 = moe_cuda_quant_group_t_v1();
    moe_cuda_quant_group_t_set_v1(v1);
    const long long calls = moe_cuda_quant_group_t_v2_calls();
    int *doff = moe_cuda_alloc(sizeof(int) * (G + 1));
    moe_cuda_from_host(doff, off, sizeof(int) * (G + 1));
    uint8_t *q = malloc(nq + 1);
    float *s = malloc(sizeof(float) * (ns + 1));
    memset(q, 0xAB, nq);
    memset(s, 0xAB, sizeof(float) * ns);
    moe_error err;
    ck_assert_int_eq(moe_cpu_quant_group_t(q, s, x, off, G, rows, C, kpad, f, pow2, &err), MOE_OK);
    void *dq = dpoison(nq, 0xAB), *ds = dpoison(sizeof(float) * ns, 0xAB);
    ck_assert_int_eq(moe_cuda_quant_group_t_act(dq, ds, dx, doff, G, rows, C, kpad, f, pow2, &err),
                     MOE_OK);
    int ok = same("token-wise codes", dq, q, nq);
    ok &= same("token-wise scales", ds, s, sizeof(float) * ns);
    /* the QDQ: the CPU's values rounded to bf16 (exact: decode·2^k), rows past off[G] kept */
    float *y = malloc(sizeof(float) * (n + 1));
    memcpy(y, x, sizeof(float) * n);
    ck_assert_int_eq(moe_cpu_qdq_group_t(y, x, off, G, rows, C, f, pow2, &err), MOE_OK);
    const moe_backend *g = moe_backend_cuda();
    moe_real *hy = malloc(sizeof(moe_real) * (n + 1));
    for (size_t i = 0; i < n; i++)
        hy[i] = y[i];
    void *want = g->alloc(2 * n + 2), *dy = g->alloc(2 * n + 2);
    g->write_act(want, hy, n);
    unsigned char *hw = malloc(2 * n + 2);
    moe_cuda_to_host(hw, want, 2 * n);
    moe_cuda_copy(dy, dx, 2 * n); /* in place, as the emulated path runs it */
    ck_assert_int_eq(moe_cuda_qdq_group_t_act(dy, dy, doff, G, rows, C, f, pow2, &err), MOE_OK);
    ok &= same("token-wise QDQ (bf16)", dy, hw, 2 * n);
    /* the kernel asked for ran: v2 launched twice (the copy and the QDQ), or not at all */
    const long long ran = moe_cuda_quant_group_t_v2_calls() - calls;
    if (ran != (v1 ? 0 : 2)) {
        printf("  token-wise FP8: the %s kernel did not run (%lld launches of v2)\n",
               v1 ? "first" : "vectorized", ran);
        ok = 0;
    }
    moe_cuda_quant_group_t_set_v1(saved_v1);
    printf("  token-wise FP8 %s %s G=%d rows=%d C=%d kpad=%zu%s: codes, scales, QDQ %s\n",
           v1 ? "v1" : "v2", f == MOE_FP8_E5M2 ? "E5M2" : "E4M3", G, off[G], C, kpad,
           pow2 ? " pow2" : "", ok ? "CUDA == CPU byte for byte" : "DIFFER");
    free(x), free(q), free(s), free(y), free(hy), free(hw);
    g->free(dx), g->free(doff), g->free(dq), g->free(ds), g->free(want), g->free(dy);
    return ok;
}

/* (b): dW_g [O][I] from dY [rows][O] and X [rows][I], both quantized token-wise on the CPU
 * (the bytes (a) was just shown to make on the GPU), the GEMM in each mode */
static int check_gemm(const int *sizes, int G, int O, int I, uint64_t seed) {
    int off[MOE_GROUPED_DEV_MAX_GROUPS + 1];
    offsets(off, sizes, G);
    const int rows = off[G];
    const size_t kpad = moe_fp8_wgrad_kpad(rows, G), nkb = kpad / MOE_QUANT_BLOCK;
    const size_t na = (size_t)rows * O, nb = (size_t)rows * I, nw = (size_t)G * O * I;
    float *dy = malloc(sizeof(float) * (na + 1)), *x = malloc(sizeof(float) * (nb + 1));
    moe_cuda_free(upload(dy, na, seed, 1.0));
    moe_cuda_free(upload(x, nb, seed + 1, 3.0));
    for (size_t i = 0; i < na; i += 97) /* a few rows with a wide range of magnitudes */
        dy[i] *= 1e-3f;
    uint8_t *qa = calloc(O * kpad + 1, 1), *qb = calloc(I * kpad + 1, 1);
    float *sa = calloc(nkb * O + 1, sizeof(float)), *sb = calloc(nkb * I + 1, sizeof(float));
    moe_error err;
    ck_assert_int_eq(moe_cpu_quant_group_t(qa, sa, dy, off, G, rows, O, kpad, MOE_FP8_E4M3, 1, &err),
                     MOE_OK);
    ck_assert_int_eq(moe_cpu_quant_group_t(qb, sb, x, off, G, rows, I, kpad, MOE_FP8_E4M3, 1, &err),
                     MOE_OK);
    /* the bound's Σ_kb |sa·sb| Σ_k |qa·qb| per element: the same twin on |codes| */
    uint8_t *aa = malloc(O * kpad + 1), *ab = malloc(I * kpad + 1);
    for (size_t i = 0; i < O * kpad; i++)
        aa[i] = qa[i] & 0x7F; /* E4M3's sign is the top bit */
    for (size_t i = 0; i < I * kpad; i++)
        ab[i] = qb[i] & 0x7F;
    float *mag = malloc(sizeof(float) * (nw + 1)), *init = malloc(sizeof(float) * (nw + 1));
    ck_assert_int_eq(moe_cpu_fp8_grouped_wgrad(mag, 0, aa, sa, ab, sb, off, G, kpad, O, I, &err),
                     MOE_OK);
    void *dqa = moe_cuda_alloc(O * kpad + 16), *dqb = moe_cuda_alloc(I * kpad + 16);
    void *dsa = moe_cuda_alloc(sizeof(float) * nkb * O + 16);
    void *dsb = moe_cuda_alloc(sizeof(float) * nkb * I + 16);
    moe_cuda_from_host(dqa, qa, O * kpad);
    moe_cuda_from_host(dqb, qb, I * kpad);
    moe_cuda_from_host(dsa, sa, sizeof(float) * nkb * O);
    moe_cuda_from_host(dsb, sb, sizeof(float) * nkb * I);
    int *doff = moe_cuda_alloc(sizeof(int) * (G + 1));
    moe_cuda_from_host(doff, off, sizeof(int) * (G + 1));
    float *want = malloc(sizeof(float) * (nw + 1)), *got = malloc(sizeof(float) * (nw + 1));
    uint16_t *got16 = malloc(2 * nw + 2);
    void *dw = moe_cuda_alloc(sizeof(float) * nw + 16);
    int ok = 1;
    static const char *const names[] = {"fp32 added", "fp32 stored", "bf16 stored"};
    float *piped = malloc(sizeof(float) * (nw + 1)); /* the first variant's output */
    enum { NV = 11 }; /* variants per mode */
    for (int run = 0; run < 3 * NV; run++) {
        /* each mode with the pipelined loop, then the first loop, each with the scales read
         * from shared memory, then from global memory, then the 128 × 256 tile, then the
         * 128 × 256 tile and the pipelined loop with dW prefetched into L2 (a hint: it acts
         * only when adding), then the 128 × 256 tile with the direct epilogue (fp32 only:
         * bf16 stays staged), then the 128 × 256 tile promoted by 64-column quarters, then
         * with the RMW and the auto epilogues; the last ten must equal the first bit for bit
         * (the same scale values, the same promotions in the same order, one fp32 addition
         * an element) */
        const int mode = run / NV, v = run % NV, wide = v == 4 || v == 5 || v >= 7;
        const int pf = v == 5 || v == 6, qtr = v == 8;
        const moe_wgrad_epi epi = v == 7    ? MOE_WGRAD_EPI_DIRECT
                                      : v == 9  ? MOE_WGRAD_EPI_RMW
                                      : v == 10 ? MOE_WGRAD_EPI_AUTO
                                                : MOE_WGRAD_EPI_TMA;
        const int dir = epi != MOE_WGRAD_EPI_TMA;
        const int pipe = wide || v == 6 || !(v & 2), ss = wide || v == 6 || !(v & 1);
        moe_cuda_wgrad_set_prefetch(pf);
        moe_cuda_fp8_wgrad_set_pipe(pipe);
        moe_cuda_fp8_wgrad_set_smem_scales(ss);
        moe_cuda_fp8_wgrad_set_bn(wide ? 256 : 128);
        moe_cuda_fp8_wgrad_set_epilogue(epi);
        moe_cuda_fp8_wgrad_set_quarters(qtr);
        const char *scl = ss ? "shared" : "global";
        const char *loop = v == 9   ? "128x256 rmw"
                           : v == 10 ? "128x256 auto epilogue"
                           : dir    ? "128x256 direct"
                           : qtr  ? "128x256 by quarters"
                           : wide ? "128x256"
                           : pipe ? "pipelined"
                                  : "first";
        const moe_dw_mode md = mode == 0 ? MOE_DW_ACCUMULATE : mode == 1 ? MOE_DW_STORE : MOE_DW_ACT;
        /* the starting contents: random values to add to, or NaN poison */
        for (size_t i = 0; i < nw; i++)
            init[i] = mode == 0 ? (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f : NAN;
        if (mode == 2) {
            memset(got16, 0xFF, 2 * nw);
            moe_cuda_from_host(dw, got16, 2 * nw);
        } else {
            moe_cuda_from_host(dw, init, sizeof(float) * nw);
        }
        memcpy(want, init, sizeof(float) * nw);
        ck_assert_int_eq(moe_cpu_fp8_grouped_wgrad(want, mode == 0, qa, sa, qb, sb, off, G, kpad,
                                                   O, I, &err),
                         MOE_OK);
        const long long calls = moe_cuda_fp8_wgrad_smem_calls();
        const long long wcalls = moe_cuda_fp8_wgrad_bn256_calls();
        const long long pcalls = moe_cuda_wgrad_prefetch_launches();
        const long long dcalls = moe_cuda_fp8_wgrad_direct_calls();
        const long long qcalls = moe_cuda_fp8_wgrad_quarters_calls();
        ck_assert_int_eq(moe_cuda_fp8_grouped_wgrad(dw, md, dqa, dsa, dqb, dsb, doff, G, kpad, O,
                                                    I, &err),
                         MOE_OK);
        if (moe_cuda_fp8_wgrad_smem_calls() - calls != ss) { /* the path asked for ran */
            printf("  FP8 wgrad %s: the %s-memory scale path did not run\n", names[mode], scl);
            ok = 0;
        }
        if (moe_cuda_fp8_wgrad_bn256_calls() - wcalls != wide) { /* the tile asked for ran */
            printf("  FP8 wgrad %s: the %s tile did not run\n", names[mode],
                   wide ? "128x256" : "128x128");
            ok = 0;
        }
        if (moe_cuda_fp8_wgrad_direct_calls() - dcalls != (dir && mode < 2)) {
            printf("  FP8 wgrad %s: the epilogue from registers (%s) %s\n", names[mode], loop,
                   dir && mode < 2 ? "did not run" : "ran unasked");
            ok = 0;
        }
        if (moe_cuda_fp8_wgrad_quarters_calls() - qcalls != qtr) {
            printf("  FP8 wgrad %s: the 128x256 tile by quarters %s\n", names[mode],
                   qtr ? "did not run" : "ran unasked");
            ok = 0;
        }
        if (moe_cuda_wgrad_prefetch_launches() - pcalls != (pf && mode == 0)) {
            printf("  FP8 wgrad %s: the L2 prefetch of dW %s\n", names[mode],
                   pf && mode == 0 ? "did not run" : "ran unasked");
            ok = 0;
        }
        if (mode == 2) {
            moe_cuda_to_host(got16, dw, 2 * nw);
            for (size_t i = 0; i < nw; i++) {
                const uint32_t u = (uint32_t)got16[i] << 16;
                memcpy(&got[i], &u, 4);
            }
        } else {
            moe_cuda_to_host(got, dw, sizeof(float) * nw);
        }
        if (v == 0) {
            memcpy(piped, got, sizeof(float) * nw);
        } else {
            size_t nd = 0, fd = 0;
            for (size_t i = 0; i < nw; i++)
                if (memcmp(&got[i], &piped[i], 4) && !nd++)
                    fd = i;
            if (nd) {
                printf("  FP8 wgrad %s: the %s loop with %s scales differs from the pipelined "
                       "loop with shared scales in %zu of %zu elements, the first at %zu: %.9g "
                       "vs %.9g\n",
                       names[mode], loop, scl, nd, nw, fd, got[fd], piped[fd]);
                ok = 0;
            }
        }
        double worst = 0;
        size_t bad = 0, first = 0;
        for (size_t i = 0; i < nw; i++) {
            /* bf16 output: against the CPU's unrounded value, plus half a bf16 ulp (2^-8
             * relative at most) for the GPU's rounding; comparing with the CPU's value rounded
             * too would fail wherever the two fp32 sums straddle a rounding midpoint (an H100
             * gave 67 where the CPU's 67.2588 rounds to 67.5) */
            const double w = want[i];
            double tol = ldexp(mag[i], -10) + 1e-6 * fabs(w) + 1e-30;
            if (mode == 2)
                tol += ldexp(fabs(w), -8);
            const double e = fabs((double)got[i] - w);
            const double r = e / tol;
            if (!(e <= tol) && !bad++)
                first = i;
            if (isfinite(r) && r > worst)
                worst = r;
        }
        if (bad) {
            const size_t g = first / ((size_t)O * I), o = first / I % O, i = first % I;
            printf("  FP8 wgrad %s (%s loop, %s scales): %zu of %zu outside the bound; first "
                   "at group %zu row %zu col %zu: GPU %.9g, CPU %.9g, bound %.3g\n",
                   names[mode], loop, scl, bad, nw, g, o, i, got[first],
                   want[first],
                   ldexp(mag[first], -10) + 1e-6 * fabs(want[first]));
            ok = 0;
        }
        printf("  FP8 wgrad G=%d rows=%d O=%d I=%d %s, %s loop, %s scales%s: worst error "
               "%.3f of the bound%s\n",
               G, rows, O, I, names[mode], loop, scl, pf ? ", dW prefetched" : "", worst,
               bad ? " FAIL" : "");
    }
    free(piped);
    free(dy), free(x), free(qa), free(qb), free(sa), free(sb), free(aa), free(ab), free(mag);
    free(init), free(want), free(got), free(got16);
    moe_cuda_free(dqa), moe_cuda_free(dqb), moe_cuda_free(dsa);
    moe_cuda_free(dsb), moe_cuda_free(doff), moe_cuda_free(dw);
    return ok;
}

static const int g_s0[] = {0, 1, 127, 128, 129, 0, 255, 64}; /* around 128, empty, one row */
static const int g_s1[] = {0, 0, 1};                         /* one row in all */
/* long groups: 6, 0, 4, 3 and 1 k-blocks, so the pipelined loop goes round more than once
 * (it takes k-blocks by twos) and ends on both parities */
static const int g_s3[] = {700, 0, 385, 257, 1};
/* 10, 2, 0 and 8 k-blocks: the auto epilogue adds the first group's tiles by TMA (more than 8
 * k-blocks), the others' by RMW, in one launch */
static const int g_s4[] = {1200, 130, 0, 900};

START_TEST(test_gpu_fp8_wgrad_quant) {
    if (!hopper("token-wise FP8"))
        return;
    int s2[40];
    for (int e = 0; e < 40; e++)
        s2[e] = e % 7 == 3 ? 0 : (e * 53) % 190; /* 0 to 189 rows */
    /* the most groups the kernels take, 0 to 300 rows each (a quarter of them empty) */
    int s3[MOE_GROUPED_DEV_MAX_GROUPS];
    for (int e = 0; e < MOE_GROUPED_DEV_MAX_GROUPS; e++)
        s3[e] = e % 4 == 1 ? 0 : (e * 97 + 13) % 301;
    int ok = 1;
    for (int v1 = 0; v1 < 2; v1++) /* the vectorized kernel, then the first (its fallback) */
        for (int fp = 0; fp < 4; fp++) {
            const moe_fp8_format f = fp & 1 ? MOE_FP8_E5M2 : MOE_FP8_E4M3;
            const int pow2 = !(fp & 2);
            ok &= check_quant(g_s0, 8, 384, 91 + fp, f, pow2, v1, 1);
            ok &= check_quant(g_s1, 3, 128, 95 + fp, f, pow2, v1, 0);
            ok &= check_quant(s2, 40, 256, 99 + fp, f, pow2, v1, 1);
            if (!v1)
                ok &= check_quant(s3, MOE_GROUPED_DEV_MAX_GROUPS, 384, 103 + fp, f, pow2, 0, 1);
        }
    ck_assert_msg(ok, "the token-wise FP8 copy differs from the CPU's");
}
END_TEST

START_TEST(test_gpu_fp8_wgrad_gemm) {
    if (!hopper("FP8 wgrad"))
        return;
    int s2[40];
    for (int e = 0; e < 40; e++)
        s2[e] = e % 7 == 3 ? 0 : (e * 53) % 190;
    const int ordered = moe_cuda_fp8_grouped_ordered(), pipe = moe_cuda_fp8_wgrad_pipe();
    const int smem_scales = moe_cuda_fp8_wgrad_smem_scales(), bn = moe_cuda_fp8_wgrad_bn();
    const int prefetch = moe_cuda_wgrad_prefetch();
    const moe_wgrad_epi epi = moe_cuda_fp8_wgrad_epilogue();
    const int quarters = moe_cuda_fp8_wgrad_quarters();
    int ok = 1;
    for (int o = 0; o < 2; o++) { /* both issue orders of the consumer warpgroups */
        moe_cuda_fp8_grouped_set_ordered(o);
        printf("  (warpgroups %s)\n", o ? "ordered" : "unordered");
        ok &= check_gemm(g_s0, 8, 256, 384, 101);
        ok &= check_gemm(g_s1, 3, 128, 128, 102);
        ok &= check_gemm(s2, 40, 256, 128, 103);
        ok &= check_gemm(g_s3, 5, 128, 256, 104);
        ok &= check_gemm(g_s3, 5, 256, 512, 105); /* N = 256·2: whole wide tiles */
        ok &= check_gemm(g_s4, 4, 128, 256, 106); /* auto: RMW and TMA tiles in one launch */
    }
    moe_cuda_fp8_grouped_set_ordered(ordered);
    moe_cuda_fp8_wgrad_set_pipe(pipe);
    moe_cuda_fp8_wgrad_set_smem_scales(smem_scales);
    moe_cuda_fp8_wgrad_set_bn(bn);
    moe_cuda_wgrad_set_prefetch(prefetch);
    moe_cuda_fp8_wgrad_set_epilogue(epi);
    moe_cuda_fp8_wgrad_set_quarters(quarters);
    ck_assert_msg(ok, "the FP8 wgrad differs from the CPU twin beyond the FP8 bound");
}
END_TEST

Suite *suite_gpu_fp8_wgrad(void) {
    const TTest *const tests[] = {test_gpu_fp8_wgrad_quant, test_gpu_fp8_wgrad_gemm};
    return moe_test_chapter_suite("gpu_fp8_wgrad", "ch05", tests, 2);
}
