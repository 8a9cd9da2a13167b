/*
 * The Hopper (sm_90a) flash-attention forward: wgmma + TMA, warp-specialised, FlashAttention-3's
 * ideas. Same op, same semantics and same outputs as the portable kernel of attention.cu
 * (read its header for the math: causal with q_pos/k_pos offsets, GQA, lse, y = 0 and
 * lse = −∞ for a row that sees no key, the heaviest-first grid order). That kernel's
 * forward launcher calls moe_cuda_attention_sm90_forward() first, which runs this kernel for
 * head dims 64 and 128 on an sm_90 device (MOE_FLASH_SM90=0 turns it off) and otherwise
 * says no, so the portable kernel runs.
 *
 * Why a second kernel. The portable one is FlashAttention-2 on mma.sync: every warp loads
 * its operand fragments from shared memory with ldmatrix, through its own registers, and
 * the loads of the next key tile are issued by the same threads that do the math. On Hopper
 * the tensor cores are fed directly from shared memory by wgmma (a warpgroup of 4 warps
 * issues one 64 × N × 16 product, asynchronously), and whole tiles are copied from global
 * memory by the TMA engine: one thread issues the copy, an mbarrier counts its bytes in.
 * Neither needs the math warps' registers or issue slots, so the work splits by role:
 *
 *   warp specialisation  a CTA has 2 consumer warpgroups (warps 0-7) and 1 producer
 *             warpgroup (warps 8-11, of which one lane works; it gives its registers to the
 *             consumers with setmaxnreg: 24 each, the consumers 240). The producer loads
 *             the CTA's Q tile (128 query rows of one (b, h)) once, then the K and V tiles
 *             (128 keys each) into a ring of 3 stages (4 at D = 64): it waits for a stage
 *             to be empty (8 arrivals: every consumer warp is done with it), announces the
 *             stage's bytes on its full barrier and issues the TMA copies. The consumers
 *             wait on full, compute, and arrive on empty. So loads run stages ahead of the
 *             math without any consumer thread spending an instruction on them.
 *   the math  consumer warpgroup c owns query rows 64c .. 64c + 63 of the tile:
 *             S = Q Kᵀ         wgmma m64n128k16, both operands from shared memory ("SS"):
 *                              Q [rows][D] and K [keys][D] are both K-major (D contiguous),
 *                              D/16 instructions;
 *             online softmax   in registers, as the portable kernel (exp2 with 1/√D·log2 e
 *                              folded in; a row's max and sum across the 4 threads that
 *                              hold it, with two shuffles);
 *             O += P V         wgmma m64nDk16 with A = P from REGISTERS ("RS") and B = V
 *                              [keys][D] from shared memory read MN-major (transposed:
 *                              bf16 wgmma allows it), 128/16 = 8 instructions.
 *   the fragment trick  the fp32 accumulator of m64nNk16 gives thread l of warp w (within
 *             the warpgroup), for each 8-column block j, d[4j], d[4j+1] at row 16w + l/4,
 *             columns 8j + 2(l%4) + {0,1}, and d[4j+2], d[4j+3] at the row 8 below. The A
 *             operand of m64nNk16 from registers is four b32 (two bf16 each) per thread:
 *             a0 = (row 16w + l/4, k = 2(l%4) + {0,1}), a1 = (row + 8, same k), a2 = (row,
 *             k + 8), a3 = (row + 8, k + 8) (the PTX ISA's "wgmma .m64nNk16 register
 *             fragment" figures: the mma.m16n8k16 A layout, one 16-row slice per warp). So
 *             columns 16kb .. 16kb + 15 of S, the 8-column blocks 2kb and 2kb + 1, ARE the
 *             A fragment of k-block kb once packed as bf16 pairs (d0,d1), (d2,d3), (d4,d5),
 *             (d6,d7) of d[8kb ..]: P goes from the softmax to the tensor cores without
 *             touching shared memory.
 *   causal skip  a CTA loads only the key tiles its last row can see (the key end of
 *             attention.cu's fa_key_end), so the tiles wholly above the diagonal are never
 *             loaded or computed (half the work at Tq = Tk); the mask (key > t + q_pos −
 *             k_pos, or key ≥ Tk) is applied only to the tiles that cross the diagonal or the
 *             end of the keys. Rows past Tq (and keys past Tk) are TMA's zero fill: q, k, v
 *             are read through 4-D tensor maps [B][T][H][D], so a box never reaches into the
 *             next sequence; those rows are not stored and those keys are masked to −∞.
 *   memory    every tile is made of TMA boxes of [128 rows][64 bf16] (128-byte rows) with the
 *             128-byte swizzle (sm90_ptx.cuh explains it), 16 KB each, 1024-byte aligned;
 *             D = 128 is two boxes side by side (columns 0-63, 64-127). The wgmma
 *             descriptors describe the same layout as grouped_gemm_sm90.cu's: K-major
 *             (Q, K) with SBO = 1024 (the next 8 rows) and the k16 step 32 bytes along the
 *             row (the next box at k = 64); MN-major (V) with SBO = 1024 (the next 8 keys),
 *             LBO = 16 KB (the next 64 columns of D: the next box) and the k16 step 16 keys
 *             = 2048 bytes. Q 32 KB + 3 stages × (K + V) 192 KB = 224 KB at D = 128 (16 +
 *             4 × 32 KB at D = 64, where the key tile stays 128: a 64 × 128 S per
 *             warpgroup).
 *   epilogue  y = O / l written from registers as bf16 pairs, lse = m/√D + log l, the
 *             masked rows (past Tq) skipped; a row that saw nothing has l = 0: y = 0,
 *             lse = −∞.
 *
 * Not done yet (FlashAttention-3's overlap): within a warpgroup the softmax of tile j
 * waits for S_j and the P V product of tile j waits for the softmax; the two warpgroups
 * overlap each other only as the warp schedulers interleave them. FA3 issues S_{j+1} before
 * the softmax of tile j and has the warpgroups ping-pong through named barriers.
 *
 * The building blocks the backward (attention_sm90_bwd.cu) shares, in attention_sm90.cuh:
 * the 4-D tensor maps of q, k, v (fa_sm90_map), the K-major and MN-major descriptors of the
 * [rows][64] swizzled boxes (fa_desc_kmajor, fa_desc_mnmajor), the bf16 packing; and the RS
 * wgmma (wgmma.cuh's moe_wgmma_rs).
 *
 * sm_100a has no wgmma: this file builds there (the kernel body compiles to a trap) and the
 * launcher runs it only on a device of compute capability 9.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_common.cuh"
#include "cuda_ops.h"
#include "attention_sm90.cuh"
#include "sm90_ptx.cuh"
#include "wgmma.cuh"

namespace {

constexpr int BM = 128;           /* query rows of a CTA: 2 consumer warpgroups × 64 */
constexpr int MAX_STAGES = 4;     /* the K/V ring's barriers */
constexpr int THREADS = 384;      /* 2 consumer warpgroups + 1 producer warpgroup (one lane
                                     works: its registers go to the consumers, setmaxnreg) */
constexpr int BOX = FA_SM90_BOX;   /* one TMA box: [128 rows][64 bf16], 16 KB */
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL) /* device code: sm_90a */
constexpr int BN = 128; /* keys of a tile */
constexpr float LOG2E = 1.4426950408889634f;
#endif

template <int D> struct Layout {
    static constexpr int NC = D / 64;           /* boxes across the head dimension */
    static constexpr int TILE = NC * BOX;       /* Q, or K or V of one stage */
    static constexpr int STAGE = 2 * TILE;      /* K then V */
    /* the K/V ring, as deep as the 227 KB of shared memory allow: D = 128: 32 + 3 × 64 KB,
     * D = 64: 16 + 4 × 32 KB */
    static constexpr int STAGES = D == 128 ? 3 : 4;
    static constexpr int BYTES = TILE + STAGES * STAGE + 1024; /* + alignment slack */
    static_assert(STAGES <= MAX_STAGES && BYTES <= 227 * 1024, "shared memory");
};

struct Args {
    int Tq, Tk, Hq, Hkv;
    int off;     /* q_pos − k_pos: query t sees key s iff s ≤ t + off */
    float scale; /* 1/√D */
};

#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL) /* nothing for sm_100a */

__device__ __forceinline__ float fa_quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float fa_quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
#endif

template <int D, bool PIPE>
__global__ void __launch_bounds__(THREADS, 1)
    fa_sm90_forward_kernel(const __grid_constant__ CUtensorMap mq,
                           const __grid_constant__ CUtensorMap mk,
                           const __grid_constant__ CUtensorMap mv, moe_bf16 *y, float *lse,
                           const Args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    typedef Layout<D> L;
    constexpr int NC = L::NC, STAGES = L::STAGES;
    extern __shared__ uint8_t fa_smem_raw[];
    /* 128-byte swizzled boxes must start on a 1024-byte boundary */
    uint8_t *Qs = fa_smem_raw + ((1024 - (smem_u32(fa_smem_raw) & 1023)) & 1023);
    uint8_t *KV = Qs + L::TILE; /* stage s: K at KV + s·STAGE, V TILE bytes after it */
    __shared__ uint64_t qbar, full[MAX_STAGES], empty[MAX_STAGES];

    const int nqt = (a.Tq + BM - 1) / BM;
    const int h = blockIdx.x, b = blockIdx.y, t0 = (nqt - 1 - (int)blockIdx.z) * BM;
    const int g = h / (a.Hq / a.Hkv);
    /* the keys the CTA's last row sees: [0, kend) (attention.cu's fa_key_end) */
    const long long last = (long long)min(t0 + BM, a.Tq) - 1 + a.off;
    const int kend = last < 0 ? 0 : (int)(last + 1 < a.Tk ? last + 1 : a.Tk);
    const int nkt = (kend + BN - 1) / BN;
    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;

    fa_init_barriers(&qbar, full, empty, STAGES);
    __syncthreads();

    if (wg == 2) {
        /* ------------------------------------------------ producer (one lane) */
        setmaxnreg_dec<24>();
        if (tid == 0 && nkt > 0) {
            mbar_expect_tx(&qbar, L::TILE);
            for (int c = 0; c < NC; c++)
                tma_load_4d(Qs + c * BOX, &mq, &qbar, 64 * c, h, t0, b);
            fa_produce_kv<STAGES, NC>(KV, L::STAGE, L::TILE, BOX, &mk, &mv, full, empty, nkt,
                                      BN, g, b);
        }
        return;
    }

    /* ---------------------------------------------------- consumers */
    /* 240 registers: O (D/2), S (64) and P (32) of the overlapped loop, with room; the
     * launch's 168 per thread × 384 = 24 × 128 + 240 × 256 (of 64K) */
    setmaxnreg_inc<240>();
    const int lane = tid % 32, w = tid / 32;
    const int row = t0 + 64 * wg + 16 * w + lane / 4; /* this thread's rows: row, row + 8 */
    const float sl = a.scale * LOG2E;                 /* exp(x/√D) = exp2(x·sl) */
    const uint8_t *qa = Qs + wg * 64 * 128;           /* our 64 rows of each Q box */
    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; i++)
        o[i] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    float sc[BN / 2];   /* S of a tile: 64 rows × 128 keys, then its exponentials */
    uint32_t p[BN / 4]; /* P as bf16 pairs: k-block kb's A fragment is p[4kb .. 4kb + 3] */

    /* S = Q Kᵀ of the tile in stage s, issued (not waited for): D/16 k-steps of 32 bytes
     * along the rows, 4 per box */
    auto issue_s = [&](int s) {
        const uint8_t *kt = KV + s * L::STAGE;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            const int at = (kk / 4) * BOX + (kk % 4) * 32;
            moe_wgmma<BN, 0, 0>::mma(sc, fa_desc_kmajor(qa + at), fa_desc_kmajor(kt + at),
                                     kk > 0);
        }
        wgmma_commit();
    };
    /* O += P V with the V of stage s, issued: 128 keys = 8 k-steps of 16 keys (2048 bytes) */
    auto issue_pv = [&](int s) {
        const uint8_t *vt = KV + s * L::STAGE + L::TILE;
        wgmma_fence();
#pragma unroll
        for (int kb = 0; kb < BN / 16; kb++)
            moe_wgmma_rs<D, 1>::mma(o, p + 4 * kb, fa_desc_mnmajor(vt + kb * 2048), 1);
        wgmma_commit();
    };
    /* The mask and the online softmax of tile j, once its S has landed in sc: sc becomes
     * exp2(S·sl − m_new·sl), m and l are updated, and the factors O must be scaled by are
     * returned in al0, al1 (the caller applies them once O's pending product is done). */
    auto softmax = [&](int j, float &al0, float &al1) {
#pragma unroll
        for (int i = 0; i < BN / 2; i++)
            reg_fence(sc[i]);
        const int s0 = j * BN;
        if (s0 + BN - 1 > t0 + a.off || s0 + BN > a.Tk) { /* crosses the diagonal or Tk */
#pragma unroll
            for (int n = 0; n < BN / 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int key = s0 + 8 * n + 2 * (lane % 4) + (e & 1);
                    if (key > row + 8 * (e >> 1) + a.off || key >= a.Tk)
                        sc[4 * n + e] = -INFINITY;
                }
        }
        /* rows row (e = 0, 1) and row + 8 (e = 2, 3); the 4 threads of a row hold its
         * 128 columns two by two */
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int n = 0; n < BN / 8; n++) {
            mx0 = fmaxf(mx0, fmaxf(sc[4 * n], sc[4 * n + 1]));
            mx1 = fmaxf(mx1, fmaxf(sc[4 * n + 2], sc[4 * n + 3]));
        }
        mx0 = fa_quad_max(mx0);
        mx1 = fa_quad_max(mx1);
        /* a row with nothing visible yet keeps m = −∞: exponents against 0, all 0 */
        const float ms0 = mx0 == -INFINITY ? 0.0f : mx0 * sl;
        const float ms1 = mx1 == -INFINITY ? 0.0f : mx1 * sl;
        al0 = exp2f(m0 * sl - ms0); /* 0 while m was −∞ */
        al1 = exp2f(m1 * sl - ms1);
        m0 = mx0;
        m1 = mx1;
        float rs0 = 0.0f, rs1 = 0.0f;
#pragma unroll
        for (int n = 0; n < BN / 8; n++) {
            sc[4 * n] = exp2f(fmaf(sc[4 * n], sl, -ms0));
            sc[4 * n + 1] = exp2f(fmaf(sc[4 * n + 1], sl, -ms0));
            sc[4 * n + 2] = exp2f(fmaf(sc[4 * n + 2], sl, -ms1));
            sc[4 * n + 3] = exp2f(fmaf(sc[4 * n + 3], sl, -ms1));
            rs0 += sc[4 * n] + sc[4 * n + 1];
            rs1 += sc[4 * n + 2] + sc[4 * n + 3];
        }
        l0 = l0 * al0 + rs0; /* this thread's columns; the quad's are merged at the end */
        l1 = l1 * al1 + rs1;
    };
    /* O ·= alpha per row, then P = bf16(sc) in the A-fragment order (the fragment trick) */
    auto rescale_pack = [&](float al0, float al1) {
#pragma unroll
        for (int i = 0; i < D / 2; i++)
            reg_fence(o[i]);
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            o[4 * n] *= al0;
            o[4 * n + 1] *= al0;
            o[4 * n + 2] *= al1;
            o[4 * n + 3] *= al1;
        }
#pragma unroll
        for (int n = 0; n < BN / 8; n++) {
            p[2 * n] = fa_pack_bf16(sc[4 * n], sc[4 * n + 1]);     /* (row, k), (row, k+1) */
            p[2 * n + 1] = fa_pack_bf16(sc[4 * n + 2], sc[4 * n + 3]); /* row + 8 */
        }
    };
    auto release = [&](int s) {
        __syncwarp();
        if (lane == 0) /* this warp is done with the stage */
            mbar_arrive(&empty[s]);
    };

    if (nkt > 0)
        mbar_wait(&qbar, 0);
    if (!PIPE) {
        /* one tile at a time: S, softmax, P V, each waiting for the one before */
        for (int j = 0; j < nkt; j++) {
            const int s = j % STAGES;
            mbar_wait(&full[s], (j / STAGES) & 1);
            issue_s(s);
            wgmma_wait<0>();
            float al0, al1;
            softmax(j, al0, al1);
            rescale_pack(al0, al1);
            issue_pv(s);
            wgmma_wait<0>();
            release(s);
        }
    } else if (nkt > 0) {
        /* FA3's intra-warpgroup overlap: S of tile j is issued before P V of tile j − 1,
         * so the tensor cores run P V while this warpgroup does tile j's softmax (which
         * reads only sc; p and o belong to the pending product until its wait) */
        float al0, al1;
        mbar_wait(&full[0], 0);
        issue_s(0);
        wgmma_wait<0>();
        softmax(0, al0, al1);
        rescale_pack(al0, al1);
        for (int j = 1; j < nkt; j++) {
            const int s = j % STAGES, sp = (j - 1) % STAGES;
            mbar_wait(&full[s], (j / STAGES) & 1);
            issue_s(s);
            issue_pv(sp);
            wgmma_wait<1>(); /* S_j has landed (groups complete in order) */
            softmax(j, al0, al1);
            wgmma_wait<0>(); /* P_{j−1} V_{j−1} is done: o and p are ours again */
            release(sp);
            rescale_pack(al0, al1);
        }
        issue_pv((nkt - 1) % STAGES);
        wgmma_wait<0>();
        release((nkt - 1) % STAGES);
    }
#pragma unroll
    for (int i = 0; i < D / 2; i++)
        reg_fence(o[i]);

    /* ---------------------------------------------------- epilogue */
    l0 = fa_quad_sum(l0);
    l1 = fa_quad_sum(l1);
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int t = row + 8 * i;
        const float lt = i ? l1 : l0, mt = i ? m1 : m0;
        if (t >= a.Tq)
            continue;
        const float inv = lt > 0.0f ? 1.0f / lt : 0.0f; /* a row that sees no key: y = 0 */
        if (lane % 4 == 0)
            lse[((size_t)b * a.Hq + h) * a.Tq + t] = lt > 0.0f ? mt * a.scale + logf(lt)
                                                               : -INFINITY;
        moe_bf16 *yr = y + (((size_t)b * a.Tq + t) * a.Hq + h) * D + 2 * (lane % 4);
#pragma unroll
        for (int n = 0; n < D / 8; n++)
            *reinterpret_cast<uint32_t *>(yr + 8 * n) =
                fa_pack_bf16(o[4 * n + 2 * i] * inv, o[4 * n + 2 * i + 1] * inv);
    }
#else
    __trap(); /* sm_90a only: the host never launches it elsewhere */
#endif
}

/* ---------------------------------------------------------------- host side */

/* MOE_FLASH_SM90: unset or 1 = on, 0 = off; read at every call (a getenv), so that one
 * process (the tests, the benchmark) can switch. */
bool fa_sm90_enabled(void) {
    const char *e = getenv("MOE_FLASH_SM90");
    if (!e)
        return true;
    if (strcmp(e, "0") && strcmp(e, "1")) {
        fprintf(stderr, "MOE_FLASH_SM90=%s: must be 1 (the Hopper flash-attention forward, the "
                        "default on an sm_90 GPU) or 0 (the portable kernel)\n", e);
        exit(1);
    }
    return e[0] == '1';
}

/* MOE_FLASH_SM90_PIPE: unset or 1 = the overlapped main loop (S of tile j under P V of tile
 * j − 1), 0 = one tile at a time (the simpler loop, kept to compare and to fall back on). */
bool fa_sm90_pipelined(void) {
    const char *e = getenv("MOE_FLASH_SM90_PIPE");
    if (!e)
        return true;
    if (strcmp(e, "0") && strcmp(e, "1")) {
        fprintf(stderr, "MOE_FLASH_SM90_PIPE=%s: must be 1 (the overlapped main loop, the "
                        "default) or 0 (one tile at a time)\n", e);
        exit(1);
    }
    return e[0] == '1';
}

long long g_sm90_calls = 0;

template <int D, bool PIPE>
void fa_sm90_launch(moe_bf16 *y, float *lse, const void *q, const void *k, const void *v,
                    moe_attention_shape s) {
    moe_cuda_smem_opt_in<fa_sm90_forward_kernel<D, PIPE>>(Layout<D>::BYTES);
    Args a;
    a.Tq = s.Tq;
    a.Tk = s.Tk;
    a.Hq = s.Hq;
    a.Hkv = s.Hkv;
    a.off = s.q_pos - s.k_pos;
    a.scale = (float)(1.0 / sqrt((double)D));
    const CUtensorMap mq = fa_sm90_map(q, s.B, s.Tq, s.Hq, D);
    const CUtensorMap mk = fa_sm90_map(k, s.B, s.Tk, s.Hkv, D);
    const CUtensorMap mv = fa_sm90_map(v, s.B, s.Tk, s.Hkv, D);
    const dim3 grid((unsigned)s.Hq, (unsigned)s.B, (unsigned)((s.Tq + BM - 1) / BM));
    fa_sm90_forward_kernel<D, PIPE><<<grid, THREADS, Layout<D>::BYTES, moe_cuda_stream()>>>(
        mq, mk, mv, y, lse, a);
    MOE_CUDA_LAUNCH_CHECK();
}

} // namespace

extern "C" int moe_cuda_attention_sm90_forward(void *y, moe_real *lse, const void *q,
                                               const void *k, const void *v,
                                               moe_attention_shape s) {
    if (!fa_sm90_enabled() || (s.D != 64 && s.D != 128) || s.B < 1 || s.Tq < 1 || s.Tk < 1 ||
        s.B > 65535 || (s.Tq + BM - 1) / BM > 65535 || !fa_sm90_device())
        return 0;
    if (!fa_aligned16(y) || !fa_aligned16(q) || !fa_aligned16(k) || !fa_aligned16(v))
        return 0; /* TMA needs 16-byte aligned tensors (cudaMalloc gives 256) */
    const bool pipe = fa_sm90_pipelined();
    if (s.D == 64)
        pipe ? fa_sm90_launch<64, true>((moe_bf16 *)y, lse, q, k, v, s)
             : fa_sm90_launch<64, false>((moe_bf16 *)y, lse, q, k, v, s);
    else
        pipe ? fa_sm90_launch<128, true>((moe_bf16 *)y, lse, q, k, v, s)
             : fa_sm90_launch<128, false>((moe_bf16 *)y, lse, q, k, v, s);
    g_sm90_calls++;
    return 1;
}

extern "C" long long moe_cuda_attention_sm90_calls(void) { return g_sm90_calls; }
