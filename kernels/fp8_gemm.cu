/*
 * Chapter 05's low-precision GEMM on the GPU, D[M,N] = A[M,K]·B[N,K]ᵀ on quantized operands
 * (lib/fp8_gemm.h has the contract; lib/cpu/fp8_gemm.c the CPU twin).
 *
 * Everything goes through cuBLASLt. As in matmul.cu, the row-major product is computed as
 * its column-major transpose, Dᵀ[N,M] = B·Aᵀ:
 *
 *   cuBLASLt A = our B: K×N column-major (ld K), op T     ("T": K-major, as FP8 needs)
 *   cuBLASLt B = our A: K×M column-major (ld K), op N     ("N": K-major too)
 *   cuBLASLt D = our D: N×M column-major (ld N)           m = N, n = M, k = K
 *
 * so cuBLASLt's A_SCALE is our B's scale and B_SCALE our A's. Hopper's FP8 wgmma reads both
 * operands K-major only, which is exactly this "TN" layout, and cuBLASLt accepts FP8 on
 * sm_90 in no other.
 *
 * Paths, chosen at run time from the device's compute capability (cc):
 *   tensorwise  native (cc ≥ 8.9): SCALAR_32F scales, the quantizers' scale_inv in device
 *               memory, so no host round trip;
 *   blockwise   native on cc 9.x: VEC128_32F for 1×128 operands, BLK128x128_32F for 128×128
 *               ones, the scales first rewritten into cuBLASLt's layout (scales_kernel);
 *               other cc: emulated (there the dequantized bf16 values are rounded: not the
 *               native numerics; untested);
 *   MXFP8       native on cc 10.x (VEC32_UE8M0, swizzled scales; untested: no sm_100 here),
 *   NVFP4       native on cc 10.x (E2M1, VEC16_UE4M3 swizzled, alpha = 1/(G_a·G_b) from
 *               device memory; untested), emulated elsewhere: each operand dequantized by
 *               quantize.cu into fp32 (NVFP4 with a unit global scale and without the inverse
 *               transform: the values the native kernel multiplies), cast to bf16 (exact, see
 *               fp8_gemm.h), then one bf16 cuBLASLt GEMM with fp32 accumulation and the
 *               NVFP4 alpha. MOE_FP8_GEMM_EMULATE=1 forces emulation on any GPU.
 *
 * cuBLASLt plans (descriptors, layouts and the heuristic's algorithm) are cached per shape,
 * types and scale modes: the heuristic costs tens of microseconds, a GEMM of a training step
 * hundreds. Only the scale pointers change between calls. Scratch (converted scales, bf16
 * operands) lives in the MOE_SCRATCH_FP8_GEMM slot; everything runs on moe_cuda_stream() and
 * nothing waits for the device.
 */
#include "cuda_common.cuh"
#include "cuda_ops.h"
#include "fp8_gemm.h"

#define THREADS 256
#define LT_WORKSPACE ((size_t)32 << 20) /* the cuBLAS handle's workspace (cuda_common.cu) */

/* constants in device memory for device-pointer alpha/beta, and NVFP4's alpha */
static __device__ float g_one = 1.0f;
static __device__ float g_zero = 0.0f;
static __device__ float g_alpha;
/* a global scale of 1: the emulated NVFP4 operand is decode(q)·decode(s_b), exactly */
static __device__ moe_quant_scalars g_unit = {0.0f, 1.0f, 1.0f};

template <typename T> static T *symbol(const T &sym) {
    void *p = nullptr;
    MOE_CUDA_CHECK(cudaGetSymbolAddress(&p, sym));
    return (T *)p;
}

static cublasLtHandle_t lt_handle(void) {
    static cublasLtHandle_t h = nullptr;
    if (!h)
        MOE_CUBLAS_CHECK(cublasLtCreate(&h));
    return h;
}

static int force_emulation(void) {
    static int on = -1;
    if (on < 0) {
        const char *s = getenv("MOE_FP8_GEMM_EMULATE");
        on = s && s[0] == '1';
    }
    return on;
}

extern "C" int moe_cuda_fp8_gemm_native(moe_quant_recipe r) {
    const int major = moe_cuda_cc_major();
    switch (r) {
    case MOE_QUANT_TENSORWISE:
        return 1;
    case MOE_QUANT_BLOCK_1X128:
    case MOE_QUANT_BLOCK_128X128:
        return major == 9;
    default: /* MXFP8, NVFP4 */
        return major == 10 && !force_emulation();
    }
}

/* ------------------------------------------------------------------ scratch */

/* carve 256-byte aligned pieces out of one scratch buffer */
typedef struct carve {
    size_t bytes[6];
    int n;
} carve;

static size_t carve_add(carve *c, size_t bytes) {
    c->bytes[c->n++] = moe_round_up(bytes ? bytes : 1, 256);
    return c->bytes[c->n - 1];
}

static void carve_take(const carve *c, void **out) {
    size_t total = 0;
    for (int i = 0; i < c->n; i++)
        total += c->bytes[i];
    char *p = (char *)moe_cuda_scratch(MOE_SCRATCH_FP8_GEMM, total);
    for (int i = 0; i < c->n; i++) {
        out[i] = p;
        p += c->bytes[i];
    }
}

/* ------------------------------------------------------------------ scale layouts */

/* dst (an R×C grid in cuBLASLt's layout l, zeroed first) ← src, whose row r/bh holds row r's
 * scales (bh = 16 expands NVFP4's 16×16 scales to one per row) */
template <typename T>
static __global__ void scales_kernel(T *dst, const T *src, int R, int C, int bh,
                                     moe_gemm_scale_layout l) {
    const size_t n = (size_t)R * C, stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const int r = (int)(i / C), c = (int)(i % C);
        dst[moe_gemm_scale_index(l, r, c, R, C)] = src[(size_t)(r / bh) * C + c];
    }
}

template <typename T>
static void convert_scales(T *dst, const void *src, int R, int C, int bh,
                           moe_gemm_scale_layout l) {
    cudaStream_t st = moe_cuda_stream();
    MOE_CUDA_CHECK(cudaMemsetAsync(dst, 0, moe_gemm_scale_elems(l, R, C) * sizeof(T), st));
    const size_t n = (size_t)R * C;
    if (!n)
        return;
    const size_t blocks = moe_cdiv(n, THREADS);
    scales_kernel<T><<<(unsigned)(blocks > 4096 ? 4096 : blocks), THREADS, 0, st>>>(
        dst, (const T *)src, R, C, bh, l);
    MOE_CUDA_LAUNCH_CHECK();
}

/* ------------------------------------------------------------------ plans */

typedef struct plan_key {
    int M, N, K;
    int ta, tb, td;     /* cudaDataType of our A, our B, D */
    int sa, sb;         /* scale modes of our A, our B (-1: none) */
    int device_alpha;   /* alpha and beta from device memory */
} plan_key;

typedef struct plan {
    plan_key key;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld; /* cuBLASLt's A (our B), B (our A), C = D */
    cublasLtMatmulAlgo_t algo;
} plan;

#define PLAN_CACHE 64
static plan g_plans[PLAN_CACHE];
static int g_nplans = 0, g_next_evict = 0;

static void plan_free(plan *p) {
    cublasLtMatmulDescDestroy(p->desc);
    cublasLtMatrixLayoutDestroy(p->la);
    cublasLtMatrixLayoutDestroy(p->lb);
    cublasLtMatrixLayoutDestroy(p->ld);
}

static const char *type_name(int t) {
    switch (t) {
    case CUDA_R_8F_E4M3:
        return "E4M3";
    case CUDA_R_8F_E5M2:
        return "E5M2";
    case CUDA_R_4F_E2M1:
        return "E2M1";
    case CUDA_R_16BF:
        return "bf16";
    default:
        return "fp32";
    }
}

static void set_scales(plan *p, const void *a_scale, const void *b_scale) {
    if (b_scale) /* cuBLASLt's A is our B */
        MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
            p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &b_scale, sizeof b_scale));
    if (a_scale)
        MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
            p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &a_scale, sizeof a_scale));
}

/* the cached plan for k, or a new one; NULL with a named error when cuBLASLt has no kernel.
 * The scale pointers are set before the heuristic runs, so it sees the descriptor that will
 * run (as PyTorch and NVIDIA's samples do; setting them later was not what made the first
 * tensorwise calls fail on an H100: that was the scale pointers' alignment, see gemm_fp8) */
static plan *get_plan(const plan_key *k, const void *a_scale, const void *b_scale,
                      moe_error *err) {
    for (int i = 0; i < g_nplans; i++)
        if (!memcmp(&g_plans[i].key, k, sizeof *k))
            return &g_plans[i];
    plan p;
    memset(&p, 0, sizeof p);
    p.key = *k;
    MOE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t opT = CUBLAS_OP_T, opN = CUBLAS_OP_N;
    MOE_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &opT, sizeof opT));
    MOE_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &opN, sizeof opN));
    if (k->device_alpha) {
        const cublasLtPointerMode_t pm = CUBLASLT_POINTER_MODE_DEVICE;
        MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_POINTER_MODE,
                                                        &pm, sizeof pm));
    }
    if (k->sb >= 0) { /* cuBLASLt's A is our B */
        const int32_t m = k->sb;
        MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                                                        &m, sizeof m));
    }
    if (k->sa >= 0) {
        const int32_t m = k->sa;
        MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                                                        &m, sizeof m));
    }
    set_scales(&p, a_scale, b_scale);
    MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.la, (cudaDataType)k->tb, k->K, k->N, k->K));
    MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.lb, (cudaDataType)k->ta, k->K, k->M, k->K));
    MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.ld, (cudaDataType)k->td, k->N, k->M, k->N));
    cublasLtMatmulPreference_t pref;
    MOE_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const size_t ws = LT_WORKSPACE;
    MOE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    /* the algorithm must work for any 16-byte aligned pointers (moe_cuda_fp8_gemm checks
     * that), not only for the 256-byte aligned ones of this first call */
    const uint32_t align = 16;
    const cublasLtMatmulPreferenceAttributes_t aligns[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; i++)
        MOE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, aligns[i], &align, sizeof align));
    /* the heuristic's candidates in its order; the first that cublasLtMatmulAlgoCheck accepts
     * for this very descriptor wins */
    cublasLtMatmulHeuristicResult_t h[8];
    int found = 0, pick = -1;
    const cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(lt_handle(), p.desc, p.la, p.lb, p.ld,
                                                            p.ld, pref, 8, h, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    for (int i = 0; s == CUBLAS_STATUS_SUCCESS && i < found && pick < 0; i++) {
        cublasLtMatmulHeuristicResult_t chk;
        if (cublasLtMatmulAlgoCheck(lt_handle(), p.desc, p.la, p.lb, p.ld, p.ld, &h[i].algo,
                                    &chk) == CUBLAS_STATUS_SUCCESS &&
            chk.workspaceSize <= LT_WORKSPACE)
            pick = i;
    }
    if (s != CUBLAS_STATUS_SUCCESS || pick < 0) {
        plan_free(&p);
        moe_error_set(err, MOE_ERR_BACKEND,
                      "FP8 GEMM: cuBLASLt has no kernel for %s (scale mode %d) x %s (scale mode "
                      "%d) -> %s, M=%d N=%d K=%d on this GPU (compute capability %d.x): %s; pad "
                      "the shape (lib/fp8_gemm.h lists what was measured to run) or use "
                      "another recipe",
                      type_name(k->ta), k->sa, type_name(k->tb), k->sb, type_name(k->td), k->M,
                      k->N, k->K, moe_cuda_cc_major(),
                      s != CUBLAS_STATUS_SUCCESS ? cublasGetStatusString(s)
                      : found == 0               ? "the heuristic found no algorithm"
                                                 : "no algorithm passed cublasLtMatmulAlgoCheck");
        return NULL;
    }
    p.algo = h[pick].algo;
    if (g_nplans == PLAN_CACHE) { /* full: replace the entries in turn */
        plan_free(&g_plans[g_next_evict]);
        g_plans[g_next_evict] = p;
        plan *r = &g_plans[g_next_evict];
        g_next_evict = (g_next_evict + 1) % PLAN_CACHE;
        return r;
    }
    g_plans[g_nplans] = p;
    return &g_plans[g_nplans++];
}

/* run plan pl: d = alpha·op(b)·op(a) (+ d when @p accumulate: beta = 1, C = D in place, as
 * cuBLASLt allows with the same layout; NVIDIA's LtBlk128x128Fp8Matmul sample runs beta = 1
 * with blockwise scales and a bf16 C) with the given scale pointers (NULL: none); a refusal
 * at run time is a named error (it names the shape and the status) */
static moe_status run_plan(plan *pl, void *d, int accumulate, const void *a, const void *b,
                           const void *a_scale, const void *b_scale, const float *alpha_dev,
                           moe_error *err) {
    set_scales(pl, a_scale, b_scale);
    (void)moe_cuda_cublas(); /* creates the shared workspace on first use */
    void *ws = moe_cuda_scratch(MOE_SCRATCH_CUBLAS, LT_WORKSPACE);
    const float one = 1.0f, zero = 0.0f;
    const void *alpha = pl->key.device_alpha ? (const void *)alpha_dev : (const void *)&one;
    const void *beta = pl->key.device_alpha
                           ? (const void *)(accumulate ? symbol(g_one) : symbol(g_zero))
                           : (const void *)(accumulate ? &one : &zero);
    const cublasStatus_t s =
        cublasLtMatmul(lt_handle(), pl->desc, alpha, b, pl->la, a, pl->lb, beta, d, pl->ld, d,
                       pl->ld, &pl->algo, ws, LT_WORKSPACE, moe_cuda_stream());
    if (s != CUBLAS_STATUS_SUCCESS)
        return moe_error_set(err, MOE_ERR_BACKEND,
                             "FP8 GEMM: cublasLtMatmul refused %s x %s (scale modes %d, %d), "
                             "M=%d N=%d K=%d: %s (run with CUBLASLT_LOG_LEVEL=2 for its reason)",
                             type_name(pl->key.ta), type_name(pl->key.tb), pl->key.sa,
                             pl->key.sb, pl->key.M, pl->key.N, pl->key.K,
                             cublasGetStatusString(s));
    return MOE_OK;
}

/* ------------------------------------------------------------------ the paths */

static int fp8_type(moe_fp8_format f) { return f == MOE_FP8_E5M2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3; }

/* the tensorwise dequantization scales, copied to 16-byte aligned slots (one thread) */
static __global__ void scalar_scales_kernel(float *sa, float *sb, const moe_quant_scalars *a,
                                            const moe_quant_scalars *b) {
    *sa = a->scale_inv;
    *sb = b->scale_inv;
}

/* NVFP4's alpha: 1/G_a · 1/G_b (one thread) */
static __global__ void alpha_kernel(float *alpha, const moe_quant_scalars *ga,
                                    const moe_quant_scalars *gb) {
    *alpha = ga->scale_inv * gb->scale_inv;
}

/* y[rows, K] = the values a native GEMM multiplies (see the top of the file) */
static moe_status dequant_for_gemm(float *y, const moe_qmatrix *q, int rows, int K,
                                   moe_error *err) {
    if (q->recipe == MOE_QUANT_NVFP4 || q->recipe == MOE_QUANT_NVFP4_2D) {
        moe_nvfp4_opts o = {};
        o.block_2d = q->recipe == MOE_QUANT_NVFP4_2D; /* no rht: the transformed values */
        return moe_cuda_dequant_nvfp4(y, q->codes, (const uint8_t *)q->scales, symbol(g_unit), rows,
                                      K, &o, err);
    }
    switch (q->recipe) {
    case MOE_QUANT_TENSORWISE:
        return moe_cuda_dequant_tensorwise(y, q->codes, q->scalars, (size_t)rows * K, q->format,
                                           err);
    case MOE_QUANT_MXFP8:
        return moe_cuda_dequant_mxfp8(y, q->codes, (const uint8_t *)q->scales, rows, K, q->format,
                                      err);
    default:
        return moe_cuda_dequant_blockwise(y, q->codes, (const float *)q->scales, rows, K, q->format,
                                          q->recipe == MOE_QUANT_BLOCK_128X128, err);
    }
}

static int is_nvfp4(moe_quant_recipe r) { return r == MOE_QUANT_NVFP4 || r == MOE_QUANT_NVFP4_2D; }

/* emulated: dequantize → bf16 → one bf16 GEMM with fp32 accumulation */
static moe_status gemm_emulated(void *d, int td, int accumulate, const moe_qmatrix *a, const moe_qmatrix *b,
                                int M, int N, int K, moe_error *err) {
    carve c = {};
    const size_t rmax = (size_t)(M > N ? M : N);
    carve_add(&c, rmax * K * sizeof(float));
    carve_add(&c, (size_t)M * K * sizeof(moe_bf16));
    carve_add(&c, (size_t)N * K * sizeof(moe_bf16));
    void *p[3];
    carve_take(&c, p);
    MOE_TRY(dequant_for_gemm((float *)p[0], a, M, K, err));
    moe_cuda_cast_to_act(p[1], (const moe_real *)p[0], (size_t)M * K);
    MOE_TRY(dequant_for_gemm((float *)p[0], b, N, K, err));
    moe_cuda_cast_to_act(p[2], (const moe_real *)p[0], (size_t)N * K);
    const float *alpha = symbol(g_one);
    if (is_nvfp4(a->recipe)) {
        alpha = symbol(g_alpha);
        alpha_kernel<<<1, 1, 0, moe_cuda_stream()>>>((float *)alpha, a->scalars, b->scalars);
        MOE_CUDA_LAUNCH_CHECK();
    }
    const plan_key k = {M, N, K, CUDA_R_16BF, CUDA_R_16BF, td, -1, -1, 1};
    plan *pl = get_plan(&k, NULL, NULL, err);
    if (!pl)
        return MOE_ERR_BACKEND;
    return run_plan(pl, d, accumulate, p[1], p[2], NULL, NULL, alpha, err);
}

/* native FP8 with tensorwise or blockwise scales (cuBLASLt on sm_90) */
static moe_status gemm_fp8(void *d, int td, int accumulate, const moe_qmatrix *a, const moe_qmatrix *b, int M,
                           int N, int K, moe_error *err) {
    const void *sa, *sb;
    int ma, mb;
    if (a->recipe == MOE_QUANT_TENSORWISE) {
        /* the scale_inv fields sit 8 bytes into moe_quant_scalars, and cublasLtMatmul refuses
         * FP8 scale pointers that are not 16-byte aligned ("not supported" on an H100, at run
         * time, after the heuristic accepted the descriptor): copy them, on the device */
        carve c = {};
        carve_add(&c, sizeof(float));
        carve_add(&c, sizeof(float));
        void *p[2];
        carve_take(&c, p);
        scalar_scales_kernel<<<1, 1, 0, moe_cuda_stream()>>>((float *)p[0], (float *)p[1],
                                                              a->scalars, b->scalars);
        MOE_CUDA_LAUNCH_CHECK();
        sa = p[0];
        sb = p[1];
        ma = mb = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    } else {
        const int kb = K / MOE_QUANT_BLOCK;
        const int b2d = b->recipe == MOE_QUANT_BLOCK_128X128;
        const int rb = b2d ? (N + MOE_QUANT_BLOCK - 1) / MOE_QUANT_BLOCK : N;
        const moe_gemm_scale_layout lb = b2d ? MOE_GEMM_SCALES_BLK128 : MOE_GEMM_SCALES_VEC128;
        carve c = {};
        carve_add(&c, moe_gemm_scale_elems(MOE_GEMM_SCALES_VEC128, M, kb) * sizeof(float));
        carve_add(&c, moe_gemm_scale_elems(lb, rb, kb) * sizeof(float));
        void *p[2];
        carve_take(&c, p);
        convert_scales<float>((float *)p[0], a->scales, M, kb, 1, MOE_GEMM_SCALES_VEC128);
        convert_scales<float>((float *)p[1], b->scales, rb, kb, 1, lb);
        sa = p[0];
        sb = p[1];
        ma = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
        mb = b2d ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                 : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    }
    const plan_key k = {M, N, K, fp8_type(a->format), fp8_type(b->format), td, ma, mb, 0};
    plan *pl = get_plan(&k, sa, sb, err);
    if (!pl)
        return MOE_ERR_BACKEND;
    return run_plan(pl, d, accumulate, a->codes, b->codes, sa, sb, NULL, err);
}

/* native MXFP8 / NVFP4 (cuBLASLt on sm_100; written from the documentation, untested) */
static moe_status gemm_block_scaled(void *d, int td, int accumulate, const moe_qmatrix *a, const moe_qmatrix *b,
                                    int M, int N, int K, moe_error *err) {
    const int fp4 = is_nvfp4(a->recipe);
    const int blk = fp4 ? MOE_QUANT_NVFP4_BLOCK : MOE_QUANT_MX_BLOCK, kb = K / blk;
    carve c = {};
    carve_add(&c, moe_gemm_scale_elems(MOE_GEMM_SCALES_SWIZZLED, M, kb));
    carve_add(&c, moe_gemm_scale_elems(MOE_GEMM_SCALES_SWIZZLED, N, kb));
    void *p[2];
    carve_take(&c, p);
    convert_scales<uint8_t>((uint8_t *)p[0], a->scales, M, kb,
                            a->recipe == MOE_QUANT_NVFP4_2D ? 16 : 1, MOE_GEMM_SCALES_SWIZZLED);
    convert_scales<uint8_t>((uint8_t *)p[1], b->scales, N, kb,
                            b->recipe == MOE_QUANT_NVFP4_2D ? 16 : 1, MOE_GEMM_SCALES_SWIZZLED);
    const float *alpha = NULL;
    if (fp4) {
        alpha = symbol(g_alpha);
        alpha_kernel<<<1, 1, 0, moe_cuda_stream()>>>((float *)alpha, a->scalars, b->scalars);
        MOE_CUDA_LAUNCH_CHECK();
    }
    const int mode = fp4 ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3
                         : CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0;
    const plan_key k = {M, N, K, fp4 ? CUDA_R_4F_E2M1 : fp8_type(a->format),
                        fp4 ? CUDA_R_4F_E2M1 : fp8_type(b->format), td, mode, mode, fp4};
    plan *pl = get_plan(&k, p[0], p[1], err);
    if (!pl)
        return MOE_ERR_BACKEND;
    return run_plan(pl, d, accumulate, a->codes, b->codes, p[0], p[1], alpha, err);
}

static int aligned16(const void *p) { return p == NULL || (uintptr_t)p % 16 == 0; }

extern "C" moe_status moe_cuda_fp8_gemm_acc(void *d, int d_fp32, int accumulate,
                                            const moe_qmatrix *a, const moe_qmatrix *b, int M,
                                            int N, int K, moe_error *err) {
    MOE_TRY(moe_fp8_gemm_check(a, b, M, N, K, err));
    if (!aligned16(d) || !aligned16(a->codes) || !aligned16(b->codes) || !aligned16(a->scales) ||
        !aligned16(b->scales))
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "FP8 GEMM: D, the codes and the scales must be 16-byte aligned "
                             "(cuBLASLt's FP8 kernels load them with TMA); offset a slice by "
                             "whole 16-byte rows");
    if (M == 0 || N == 0)
        return MOE_OK;
    const int td = d_fp32 ? CUDA_R_32F : CUDA_R_16BF;
    if (K == 0) { /* an empty sum: D = 0, or D += 0 */
        if (!accumulate)
            MOE_CUDA_CHECK(cudaMemsetAsync(d, 0, (size_t)M * N * (d_fp32 ? 4 : 2),
                                           moe_cuda_stream()));
        return MOE_OK;
    }
    if (!moe_cuda_fp8_gemm_native(a->recipe))
        return gemm_emulated(d, td, accumulate, a, b, M, N, K, err);
    if (a->recipe == MOE_QUANT_MXFP8 || is_nvfp4(a->recipe))
        return gemm_block_scaled(d, td, accumulate, a, b, M, N, K, err);
    return gemm_fp8(d, td, accumulate, a, b, M, N, K, err);
}

extern "C" moe_status moe_cuda_fp8_gemm(void *d, int d_fp32, const moe_qmatrix *a,
                                        const moe_qmatrix *b, int M, int N, int K,
                                        moe_error *err) {
    return moe_cuda_fp8_gemm_acc(d, d_fp32, 0, a, b, M, N, K, err);
}

/* the backend's fp8_gemm (lib/backend.h): D in the activation type (bf16) */
extern "C" moe_status moe_cuda_fp8_gemm_act(void *d, int accumulate, const moe_qmatrix *a,
                                            const moe_qmatrix *b, int M, int N, int K,
                                            moe_error *err) {
    return moe_cuda_fp8_gemm_acc(d, 0, accumulate, a, b, M, N, K, err);
}
