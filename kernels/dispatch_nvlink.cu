/*
 * Chapter 02's fused all-to-all dispatcher: the permutation and the transfer in one kernel
 * (see lib/moe/dispatch_nvlink.h for the contract, lib/moe/dispatch.h for the algorithm).
 *
 * The collective path moves every token row three times: permute_tokens copies it to its
 * k rows, NCCL copies those rows to the experts' GPUs, and on the way back NCCL copies
 * them home before unpermute sums them. When every GPU of the group can load from and
 * store to every other's memory (NVLink), none of the intermediate copies is needed:
 *
 *   dispatch: one warp per token reads the token's row ONCE and stores it straight to
 *             its k destinations — rows of the expert-side buffer of the GPU that holds
 *             each expert, at their final place in the [local expert][source rank]
 *             layout. The routing weight goes along the same way.
 *   combine:  one warp per token loads its k expert-output rows from wherever they are
 *             (this GPU or a peer), sums them in fp32 in j order — the same order and
 *             rounding as unpermute_sum — and stores the token's row once.
 *
 * Where row (n, j) lands: its expert e = idx[n·k + j] lives on rank q = e / EL; in this
 * rank's permuted layout the row is row_of[n·k + j], inside expert e's run that starts at
 * off[e]; on q, this rank's rows for e start at base[e] (after every rank before this one,
 * and after q's earlier local experts). So its row on q is row_of[n·k + j] + shift[e] with
 * shift[e] = base[e] − off[e], computed by the plan from the exchanged counts. Dropped
 * assignments (idx = E) go nowhere and combine as zero.
 *
 * A warp handles a token: lane j < k finds where row (n, j) goes, and the warp's copy loop
 * takes each destination from lane j by a shuffle — so k <= 32 (MOE_FUSED_MAX_TOPK), and
 * every lane runs every iteration of that loop, whatever the row width.
 *
 * Synchronisation: the buffers are NCCL symmetric memory, and each kernel begins and ends
 * with an LSA barrier (one per CTA index, across the group). The opening barrier means
 * every peer has finished the work queued before it — the experts that produced what
 * combine reads, or the reads of the buffer dispatch overwrites; the closing one means
 * every store (dispatch) or load (combine) of every peer is done before any rank goes on.
 * Acquire/release ordering makes the stores of one GPU visible to the loads of another.
 * Every rank launches the same grid, and all its CTAs are resident at once (the grid is
 * capped by occupancy), so no CTA can wait on a peer CTA that never gets an SM.
 * The host waits for neither kernel: the barriers order the GPUs, a symmetric buffer is
 * freed only once its stream has drained (moe_comm_sym_free), and the communication
 * watchdog (moe_comm_track) ends the job if a peer never reaches a barrier.
 */
#ifdef MOE_HAVE_NCCL

#include "comm_nccl.h"      /* NCCL and, from 2.28, its device API (MOE_NCCL_DEVICE_API) */
#include "comm_transport.h" /* the group's device communicator; the watchdog */
#include "cuda_common.cuh"
#include "moe/dispatch_nvlink.h"

#ifdef MOE_NCCL_DEVICE_API

#define THREADS 256
#define WARPS (THREADS / 32)
#define UNROLL 4 /* 16-byte loads in flight per lane */

/* Lane j < k: where assignment a's row (of row_bytes) goes, or comes from, in window win
 * on its expert's rank; NULL when the assignment was dropped, or when its row is at or past
 * cap, the rows the buffers hold (the sync-free plan's budget: the plan has raised the
 * overflow flag, the step is re-run, and nothing is stored out of bounds meanwhile). */
static __device__ __forceinline__ char *peer_row(ncclWindow_t win, const int *idx,
                                                 const int *row_of, const int *shift, size_t a,
                                                 int E, int EL, int cap, size_t row_bytes) {
    const int e = idx[a];
    if (e >= E)
        return NULL;
    const int r = row_of[a] + shift[e];
    if (r >= cap)
        return NULL;
    return (char *)ncclGetPeerPointer(win, (size_t)r * row_bytes, e / EL);
}

static __global__ void __launch_bounds__(THREADS)
    dispatch_kernel(ncclDevComm dc, ncclWindow_t rows, ncclWindow_t reals, const uint4 *x,
                    const float *w, const int *idx, const int *row_of, const int *shift, int N,
                    int k, int E, int EL, int cap, int n16) {
    ncclLsaBarrierSession<ncclCoopCta> bar(ncclCoopCta(), dc, ncclTeamTagLsa(), blockIdx.x);
    bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
    const int lane = threadIdx.x % 32;
    const size_t row_bytes = (size_t)n16 * 16;
    for (int n = blockIdx.x * WARPS + threadIdx.x / 32; n < N; n += gridDim.x * WARPS) {
        const size_t a = (size_t)n * k + lane;
        char *mine = NULL;
        if (lane < k) {
            mine = peer_row(rows, idx, row_of, shift, a, E, EL, cap, row_bytes);
            if (w && mine)
                *(float *)peer_row(reals, idx, row_of, shift, a, E, EL, cap, sizeof(float)) = w[a];
        }
        const uint4 *src = x + (size_t)n * n16;
        /* every lane runs every iteration (the shuffles need the whole warp) */
        for (int c0 = lane; c0 - lane < n16; c0 += 32 * UNROLL) {
            uint4 v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; u++)
                if (c0 + 32 * u < n16)
                    v[u] = src[c0 + 32 * u];
            for (int j = 0; j < k; j++) {
                uint4 *dst = (uint4 *)__shfl_sync(0xffffffffu, (uintptr_t)mine, j);
                if (!dst)
                    continue;
#pragma unroll
                for (int u = 0; u < UNROLL; u++)
                    if (c0 + 32 * u < n16)
                        dst[c0 + 32 * u] = v[u];
            }
        }
    }
    bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
}

static __global__ void __launch_bounds__(THREADS)
    combine_kernel(ncclDevComm dc, ncclWindow_t rows, ncclWindow_t reals, uint4 *out,
                   int accumulate, float *dwp, const int *idx, const int *row_of,
                   const int *shift, int N, int k, int E, int EL, int cap, int n16) {
    ncclLsaBarrierSession<ncclCoopCta> bar(ncclCoopCta(), dc, ncclTeamTagLsa(), blockIdx.x);
    bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
    const int lane = threadIdx.x % 32;
    const size_t row_bytes = (size_t)n16 * 16;
    for (int n = blockIdx.x * WARPS + threadIdx.x / 32; n < N; n += gridDim.x * WARPS) {
        const size_t a = (size_t)n * k + lane;
        const char *mine = NULL;
        if (lane < k) {
            mine = peer_row(rows, idx, row_of, shift, a, E, EL, cap, row_bytes);
            if (dwp)
                dwp[row_of[a]] =
                    mine ? *(const float *)peer_row(reals, idx, row_of, shift, a, E, EL, cap,
                                                    sizeof(float))
                         : 0.0f;
        }
        uint4 *o = out + (size_t)n * n16;
        for (int c0 = lane; c0 - lane < n16; c0 += 32 * UNROLL) {
            float acc[UNROLL][8];
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
                moe_bf16x8 v;
                v.u = accumulate && c0 + 32 * u < n16 ? o[c0 + 32 * u] : make_uint4(0, 0, 0, 0);
#pragma unroll
                for (int i = 0; i < 8; i++)
                    acc[u][i] = moe_ld(v.h[i]);
            }
            for (int j = 0; j < k; j++) {
                const uint4 *src = (const uint4 *)__shfl_sync(0xffffffffu, (uintptr_t)mine, j);
                if (!src)
                    continue;
                moe_bf16x8 y[UNROLL];
#pragma unroll
                for (int u = 0; u < UNROLL; u++)
                    if (c0 + 32 * u < n16)
                        y[u].u = src[c0 + 32 * u];
#pragma unroll
                for (int u = 0; u < UNROLL; u++)
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        acc[u][i] += moe_ld(y[u].h[i]);
            }
#pragma unroll
            for (int u = 0; u < UNROLL; u++)
                if (c0 + 32 * u < n16) {
                    moe_bf16x8 v;
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        v.h[i] = moe_st(acc[u][i]);
                    o[c0 + 32 * u] = v.u;
                }
        }
    }
    bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
}

/* The same grid on every rank, every CTA resident at once, one LSA barrier per CTA. */
template <typename K> static int grid_for(K kernel) {
    static int g = 0;
    if (!g) {
        const int r = moe_cuda_resident_blocks(kernel, THREADS);
        g = r < MOE_COMM_PEER_CTAS ? r : MOE_COMM_PEER_CTAS;
    }
    return g;
}

static const ncclDevComm &dev_comm(moe_comm *c, int k) {
    if (k > MOE_FUSED_MAX_TOPK)
        moe_comm_abort(c, 1, "fused dispatcher: top-k above MOE_FUSED_MAX_TOPK");
    const void *d = moe_comm_device_comm(c);
    if (!d)
        moe_comm_abort(c, 1, "fused dispatcher used before moe_comm_peer_access() succeeded");
    return *(const ncclDevComm *)d;
}

extern "C" void moe_nvlink_dispatch(moe_comm *c, const moe_sym_buf *rows, const moe_sym_buf *reals,
                                    const void *x, const float *w, const int *idx,
                                    const int *row_of, const int *shift, int N, int k, int E,
                                    int EL, int C, int cap) {
    dispatch_kernel<<<grid_for(dispatch_kernel), THREADS, 0, moe_cuda_stream()>>>(
        dev_comm(c, k), (ncclWindow_t)rows->window, reals ? (ncclWindow_t)reals->window : NULL,
        (const uint4 *)x, reals ? w : NULL, idx, row_of, shift, N, k, E, EL, cap, C / 8);
    MOE_CUDA_LAUNCH_CHECK();
    moe_comm_track(c, "fused dispatch"); /* a peer that never arrives: the watchdog ends the job */
}

extern "C" void moe_nvlink_combine(moe_comm *c, void *out, int accumulate, float *dwp,
                                   const moe_sym_buf *rows, const moe_sym_buf *reals,
                                   const int *idx, const int *row_of, const int *shift, int N,
                                   int k, int E, int EL, int C, int cap) {
    combine_kernel<<<grid_for(combine_kernel), THREADS, 0, moe_cuda_stream()>>>(
        dev_comm(c, k), (ncclWindow_t)rows->window, reals ? (ncclWindow_t)reals->window : NULL,
        (uint4 *)out, accumulate, reals ? dwp : NULL, idx, row_of, shift, N, k, E, EL, cap, C / 8);
    MOE_CUDA_LAUNCH_CHECK();
    moe_comm_track(c, "fused combine"); /* a peer that never arrives: the watchdog ends the job */
}

#else /* NCCL without the device API: moe_comm_peer_access() is 0, these are never called */

extern "C" void moe_nvlink_dispatch(moe_comm *c, const moe_sym_buf *rows, const moe_sym_buf *reals,
                                    const void *x, const float *w, const int *idx,
                                    const int *row_of, const int *shift, int N, int k, int E,
                                    int EL, int C, int cap) {
    moe_comm_abort(c, 1, "fused dispatcher: NCCL has no device API");
}

extern "C" void moe_nvlink_combine(moe_comm *c, void *out, int accumulate, float *dwp,
                                   const moe_sym_buf *rows, const moe_sym_buf *reals,
                                   const int *idx, const int *row_of, const int *shift, int N,
                                   int k, int E, int EL, int C, int cap) {
    moe_comm_abort(c, 1, "fused dispatcher: NCCL has no device API");
}

#endif /* MOE_NCCL_DEVICE_API */
#endif /* MOE_HAVE_NCCL */
