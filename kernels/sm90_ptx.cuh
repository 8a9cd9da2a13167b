/**
 * @file sm90_ptx.cuh
 * @brief The Hopper (sm_90a) building blocks of chapter 03's grouped GEMM, as small inline
 *        PTX wrappers: mbarriers, TMA (the tensor memory accelerator) loads and stores,
 *        the wgmma fences and shared-memory matrix descriptors, and the host's tensor-map
 *        encoder. Shared by the library's kernels (grouped_gemm_sm90.cu and chapter 05's
 *        FP8 grouped_gemm_fp8_sm90.cu) and the kernel ladder of
 *        chapters/03-grouped-gemm/versions/; the MMA instructions themselves are wgmma.cuh,
 *        the epilogue sm90_epilogue.cuh.
 *
 * The device helpers compile for sm_90a only (sm_100a has no wgmma, and the kernels that
 * use them compile there to a trap): code that calls them is guarded by
 * `#if defined(__CUDA_ARCH_FEAT_SM90_ALL)` as in grouped_gemm_sm90.cu.
 *
 * The 128-byte swizzle, which every tile here uses: a tile stored "K-major" with BK = 64
 * bf16 per row is rows of 128 bytes; inside each group of 8 rows (1024 bytes), the
 * 16-byte chunk c of row r is stored at chunk position c XOR (r mod 8). The 8 rows a
 * wgmma (or a store of 8 consecutive rows) touches at one column then fall in 8 different
 * bank groups: no bank conflicts, and TMA writes the same layout (CU_TENSOR_MAP_SWIZZLE_128B).
 */
#ifndef MOE_SM90_PTX_CUH
#define MOE_SM90_PTX_CUH

#include <cuda.h>
#include <cudaTypedefs.h>
#include <stdint.h>

#include "cuda_common.cuh"

/** Byte offset of 16-byte chunk @p chunk of row @p row in a 128-byte swizzled tile. */
static __host__ __device__ __forceinline__ int moe_swizzle128(int row, int chunk) {
    return row * 128 + ((chunk ^ (row & 7)) * 16);
}

#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL) /* nothing for sm_100a */

/** The 32-bit shared-memory address PTX wants for a generic pointer into shared memory. */
static __device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* ---------------------------------------------------------------- mbarriers
 * An mbarrier is a 64-bit counter in shared memory: a phase completes when `count`
 * threads have arrived AND every byte announced with expect_tx has landed (TMA counts its
 * bytes down as they arrive). Waiters poll for the phase's parity (0, 1, 0, ...). */

/** Initialise a barrier that expects @p count arrivals per phase. */
static __device__ __forceinline__ void mbar_init(uint64_t *bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}

/** Make barrier initialisation visible to the async proxy (TMA) before first use. */
static __device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

/** Arrive, and tell the barrier how many bytes the TMA loads of this phase will deliver. */
static __device__ __forceinline__ void mbar_expect_tx(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
                 "r"(bytes)
                 : "memory");
}

/** Arrive (one of the barrier's `count`). */
static __device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

/** Wait until the phase with this parity has completed. */
static __device__ __forceinline__ void mbar_wait(uint64_t *bar, int parity) {
    asm volatile("{\n"
                 ".reg .pred done;\n"
                 "WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT;\n"
                 "}\n" ::"r"(smem_u32(bar)),
                 "r"(parity)
                 : "memory");
}

/* ---------------------------------------------------------------- TMA */

/** TMA load of one box at coordinates (c0 innermost, c1) into shared memory; its bytes
 *  count down @p bar's expected transaction. */
static __device__ __forceinline__ void tma_load_2d(void *dst, const CUtensorMap *map,
                                                   uint64_t *bar, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];" ::"r"(smem_u32(dst)),
                 "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(smem_u32(bar))
                 : "memory");
}

/** The same for a 3-D tensor (e.g. stacked expert weights [G, O, I]). */
static __device__ __forceinline__ void tma_load_3d(void *dst, const CUtensorMap *map,
                                                   uint64_t *bar, int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(smem_u32(dst)),
                 "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar))
                 : "memory");
}

/** The same for a 4-D tensor (e.g. attention's q [B, T, H, D]: a box of rows of one head
 *  of one sequence, zero-filled past the sequence's end). */
static __device__ __forceinline__ void tma_load_4d(void *dst, const CUtensorMap *map,
                                                   uint64_t *bar, int c0, int c1, int c2,
                                                   int c3) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6];" ::"r"(smem_u32(dst)),
                 "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(bar))
                 : "memory");
}

/* ---------------------------------------------------------------- CTA clusters
 * A cluster's CTAs run at the same time on neighbouring SMs and can address each other's
 * shared memory (the shared::cluster window): a TMA load can MULTICAST one box into the
 * same offset of several CTAs' shared memory, signalling each CTA's mbarrier at that
 * offset, and a thread can arrive on another CTA's mbarrier. (The grouped GEMM's
 * static-mc2 schedule: two CTAs that need the same weight block load half of it each.) */

/** This CTA's rank in its cluster. */
static __device__ __forceinline__ uint32_t cluster_ctarank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

/** Every thread of every CTA of the cluster: arrive (release) and wait (acquire). Orders
 *  barrier initialisation before the other CTAs' remote arrivals and multicasts, and keeps
 *  a CTA alive (its shared memory mapped) until the others are done touching it. Not
 *  `.aligned`: the threads may reach it from divergent paths. */
static __device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\n"
                 "barrier.cluster.wait.acquire;" ::: "memory");
}

/** Arrive on the mbarrier at @p bar's offset in the shared memory of cluster CTA @p rank
 *  (this CTA's own rank works too). The default semantics (release at CTA scope), as in
 *  CUTLASS's ClusterBarrier: what the arrival publishes is that this warp's wgmma reads of
 *  the stage are complete (wgmma.wait_group retired them), and the partner's TMA write
 *  is ordered after the barrier's phase flips. An explicit `.release.cluster` makes ptxas
 *  put a cluster-wide memory fence before every arrival: measured, the consumers then
 *  spent 64 % of their cycles in that fence (ncu: "stalled waiting on a memory barrier")
 *  and the kernel ran at 0.44x the static schedule. */
static __device__ __forceinline__ void mbar_arrive_cluster(uint64_t *bar, uint32_t rank) {
    asm volatile("{\n"
                 ".reg .b32 remote;\n"
                 "mapa.shared::cluster.u32 remote, %0, %1;\n"
                 "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
                 "}" ::"r"(smem_u32(bar)),
                 "r"(rank)
                 : "memory");
}

/** tma_load_3d multicast: the box lands at @p dst's offset in the shared memory of every
 *  cluster CTA whose bit is set in @p mask, and its bytes count down the mbarrier at
 *  @p bar's offset in each of them. */
static __device__ __forceinline__ void tma_load_3d_mc(void *dst, const CUtensorMap *map,
                                                      uint64_t *bar, int c0, int c1, int c2,
                                                      uint16_t mask) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 ".multicast::cluster [%0], [%1, {%2, %3, %4}], [%5], %6;" ::"r"(smem_u32(dst)),
                 "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar)), "h"(mask)
                 : "memory");
}

/** TMA copy-out of one box from shared memory: store... */
static __device__ __forceinline__ void tma_store_2d(const CUtensorMap *map, const void *src,
                                                    int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%1, %2}], [%3];"
                 ::"l"((uint64_t)map), "r"(c0), "r"(c1), "r"(smem_u32(src))
                 : "memory");
}
/** ... or add into what is there (the add happens in L2). */
static __device__ __forceinline__ void tma_reduce_add_2d(const CUtensorMap *map, const void *src,
                                                         int c0, int c1) {
    asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group"
                 " [%0, {%1, %2}], [%3];" ::"l"((uint64_t)map), "r"(c0), "r"(c1),
                 "r"(smem_u32(src))
                 : "memory");
}
/** ... the same into a 3-D tensor. */
static __device__ __forceinline__ void tma_reduce_add_3d(const CUtensorMap *map, const void *src,
                                                         int c0, int c1, int c2) {
    asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group"
                 " [%0, {%1, %2, %3}], [%4];" ::"l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2),
                 "r"(smem_u32(src))
                 : "memory");
}
/** ... or store one box into a 3-D tensor. */
static __device__ __forceinline__ void tma_store_3d(const CUtensorMap *map, const void *src,
                                                    int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group"
                 " [%0, {%1, %2, %3}], [%4];" ::"l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2),
                 "r"(smem_u32(src))
                 : "memory");
}
/** Ask L2 to fetch one box of a 3-D tensor from global memory (no shared memory, no
 *  barrier, nothing to wait for: a hint the hardware may drop). Out-of-bounds parts of the
 *  box fetch nothing. */
static __device__ __forceinline__ void tma_prefetch_3d(const CUtensorMap *map, int c0, int c1,
                                                       int c2) {
    asm volatile("cp.async.bulk.prefetch.tensor.3d.L2.global.tile [%0, {%1, %2, %3}];" ::"l"(
                     (uint64_t)map),
                 "r"(c0), "r"(c1), "r"(c2)
                 : "memory");
}
/** Add four fp32 values into 16-byte aligned global memory at @p p, without waiting (a
 *  reduction performed in L2, as a TMA reduce-add's; Hopper's vector form, one transaction
 *  for 16 bytes). Each element gets one rounded fp32 addition, old + v: the same bits as a
 *  TMA reduce-add of v. */
static __device__ __forceinline__ void red_add_v4(float *p, float4 v) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x), "f"(v.y),
                 "f"(v.z), "f"(v.w)
                 : "memory");
}
/** Close the group of copy-outs issued since the last commit. */
static __device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
/** The issuing thread: wait until earlier copy-outs have READ their shared memory. */
static __device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
/** ... until they have completed (written global memory). */
static __device__ __forceinline__ void bulk_wait_all() {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

/** Bulk copy of @p bytes from global to shared memory, no tensor map (a 1-D run of
 *  contiguous bytes, e.g. a stage's slice of per-row scales); its bytes count down @p bar's
 *  expected transaction as a TMA load's do. Both addresses 16-byte aligned, @p bytes a
 *  multiple of 16. */
static __device__ __forceinline__ void bulk_load_1d(void *dst, const void *src, uint32_t bytes,
                                                    uint64_t *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1], %2, [%3];" ::"r"(smem_u32(dst)),
                 "l"((uint64_t)__cvta_generic_to_global(src)), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}

/** Make this thread's ordinary shared-memory writes visible to the async proxy (TMA
 *  stores, and wgmma's operand reads) — needed after threads write a tile that wgmma or
 *  TMA reads next. */
static __device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

/** The same between the generic and the async proxy for GLOBAL memory: orders a TMA store
 *  or reduce-add (async proxy) that has completed before this thread's later ordinary
 *  accesses (a release that tells another CTA), and an acquire before this thread's later
 *  TMA copy-outs. */
static __device__ __forceinline__ void fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;" ::: "memory");
}

/* ---------------------------------------------------------------- cp.async
 * The fused permutation (grouped_gemm_sm90.cu, GATHER) copies rows picked by an index,
 * which a TMA box cannot do on Hopper (sm_100's gather4 can): the producer warp's 32
 * lanes copy 16 bytes each with cp.async, writing the same 128-byte-swizzled layout TMA
 * would (moe_swizzle128), and tell the stage's mbarrier when their copies have landed. */

/** Copy 16 bytes global → shared without waiting (L2 only, `.cg`). @p src_bytes < 16 fills
 *  the rest of the 16 with zeros; 0 writes a zero chunk and reads nothing (a row past a
 *  group's end, a column past the tensor). Both addresses must be 16-byte aligned. */
static __device__ __forceinline__ void cp_async16(void *dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}

/** Once every cp.async this thread issued before it has landed, arrive on @p bar. `noinc`:
 *  the arrival is one of the `count` the barrier was initialised with (the other form adds
 *  one to the pending count first, so it would need a count that ignores it). */
static __device__ __forceinline__ void cp_async_mbar_arrive_noinc(uint64_t *bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(bar))
                 : "memory");
}

/** Wait until every cp.async of this thread has landed (before the thread exits). */
static __device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_all;" ::: "memory");
}

/* ---------------------------------------------------------------- wgmma */

/** The 64-bit shared-memory matrix descriptor of wgmma: start address, leading and
 *  stride byte offsets (all in 16-byte units) and the swizzle mode (1 = 128-byte). For a
 *  K-major 128-byte-swizzled tile: lbo = 16 (unused), sbo = 1024 (the next 8 rows). */
static __device__ __forceinline__ uint64_t desc(const void *p, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((smem_u32(p) & 0x3FFFF) >> 4) | (uint64_t)((lbo >> 4) & 0x3FFF) << 16 |
           (uint64_t)((sbo >> 4) & 0x3FFF) << 32 | 1ull << 62;
}

/** Order register (accumulator) accesses before the wgmma that follow. */
static __device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
/** Close the group of wgmma issued since the last commit. */
static __device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
/** Wait until at most N committed wgmma groups are still running. */
template <int N> static __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

/** Warp specialisation's register split: every warp of a warpgroup gives its registers
 *  back down to N per thread (a producer that only issues TMA) or asks for N (the math
 *  warpgroups); the compiler allocates the code after it within N. N is a multiple of 8 in
 *  24..256, and the CTA's total must fit the SM's 64K registers. */
template <int N> static __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N> static __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}

/** Keep the compiler from moving accumulator reads across a wgmma wait. */
static __device__ __forceinline__ void reg_fence(float &r) { asm volatile("" : "+f"(r)::"memory"); }
#endif

/* ---------------------------------------------------------------- host: tensor maps */

/** The driver's cuTensorMapEncodeTiled, found once through the runtime (no -lcuda). */
static inline PFN_cuTensorMapEncodeTiled_v12000 moe_tma_encode_fn(void) {
    static PFN_cuTensorMapEncodeTiled_v12000 fn = NULL;
    if (!fn) {
        cudaDriverEntryPointQueryResult q;
        void *p = NULL;
        MOE_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                                        cudaEnableDefault, &q));
        if (q != cudaDriverEntryPointSuccess || !p) {
            fprintf(stderr, "moe.c: the CUDA driver has no cuTensorMapEncodeTiled\n");
            exit(1);
        }
        fn = (PFN_cuTensorMapEncodeTiled_v12000)p;
    }
    return fn;
}

/** Element types of moe_tma_map(): its last argument. */
enum { MOE_TMA_BF16 = 0, MOE_TMA_F32 = 1, MOE_TMA_U8 = 2 /* FP8 codes: bytes to TMA */ };

/** A tensor map over a dense row-major tensor of @p rank (2 to 5) dims (innermost first)
 *  with a box of @p box elements, 128-byte swizzle, zero fill outside the tensor. @p elem: MOE_TMA_BF16
 *  (the default), MOE_TMA_F32 (also written as 1), or MOE_TMA_U8 (FP8 codes: TMA moves
 *  bytes and does not need to know the format). */
static inline CUtensorMap moe_tma_map(const void *base, int rank, const uint64_t *dims,
                                      const uint32_t *box, int elem = MOE_TMA_BF16) {
    CUtensorMap m;
    const uint64_t esize = elem == MOE_TMA_F32 ? 4 : elem == MOE_TMA_U8 ? 1 : 2;
    uint64_t strides[4]; /* bytes from one index of dim i + 1 to the next (dense tensor) */
    strides[0] = dims[0] * esize;
    for (int i = 1; i + 1 < rank && i < 4; i++)
        strides[i] = dims[i] * strides[i - 1];
    const uint32_t estride[5] = {1, 1, 1, 1, 1};
    const CUtensorMapDataType type = elem == MOE_TMA_F32  ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                     : elem == MOE_TMA_U8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                                          : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    CUresult r = moe_tma_encode_fn()(&m, type, rank, (void *)base, dims, strides, box, estride,
                                     CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                     CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "moe.c: cuTensorMapEncodeTiled failed (%d) for a %dx%llux%llu tensor\n",
                (int)r, rank, (unsigned long long)dims[0], (unsigned long long)dims[1]);
        exit(1);
    }
    return m;
}

#endif /* MOE_SM90_PTX_CUH */
