/**
 * @file comm_nccl.h
 * @brief The NCCL transport of the communication layer: plain C functions (`extern "C"`)
 *        that lib/comm.c calls when a group's device is CUDA.
 *
 * Nothing above lib/comm.c calls these directly: the model and the dispatchers use
 * comm.h, which picks MPI or NCCL per group. They exist only in builds with
 * MOE_HAVE_NCCL (CUDA + MPI + nccl.h found by the Makefile).
 *
 * Buffers are device pointers; every operation is enqueued on moe_cuda_stream() and
 * then waited for (see kernels/comm_nccl.cu for why, and for the timeout). Counts are
 * in elements of the given ::moe_dtype; count arrays are host arrays. Every failure
 * (an NCCL error, an asynchronous error, a timeout) prints the rank, file and line,
 * aborts the NCCL communicator and then the whole MPI job: there is no error to return.
 */
#ifndef MOE_COMM_NCCL_H
#define MOE_COMM_NCCL_H

#include <stddef.h>

#include "comm.h"

/* NCCL's device API (>= 2.28) for the .cu files that use it: symmetric memory windows that
 * kernels of every rank load from and store to, and barriers between those kernels. Its
 * structures are inlined into our kernels, so the headers must be those of the library
 * that runs (moe_nccl_device_api_local checks). */
#ifdef __CUDACC__
#include <nccl.h>
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
#define MOE_NCCL_DEVICE_API 1
#include <nccl_device.h>
#endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

/** An NCCL communicator with what the transport needs next to it (opaque). */
typedef struct moe_nccl_comm moe_nccl_comm;

/** Bytes of an ncclUniqueId (what rank 0 broadcasts over MPI). */
#define MOE_NCCL_ID_BYTES 128

/** @brief Bind this process to GPU `local_rank % device_count` (cudaSetDevice).
 *  @param local_rank this rank's index among the ranks of its node
 *  @return the device index, or -1 when no CUDA device is visible */
int moe_nccl_set_device(int local_rank);

/** @brief Create a fresh ncclUniqueId (rank 0 only). @param id receives MOE_NCCL_ID_BYTES bytes */
void moe_nccl_unique_id(void *id);

/** @brief Join the communicator named by @p id (collective over all @p nranks ranks).
 *  @param id the unique id from rank 0 @param nranks group size @param rank this rank
 *  @param world_rank for error messages @return the communicator */
moe_nccl_comm *moe_nccl_init(const void *id, int nranks, int rank, int world_rank);

/** @brief ncclCommSplit (collective over @p parent). @param parent group @param color group id
 *  @param key order in the group @return the new communicator */
moe_nccl_comm *moe_nccl_split(moe_nccl_comm *parent, int color, int key);

/** @brief This rank's index in @p c as NCCL sees it. @param c communicator @return rank */
int moe_nccl_rank(const moe_nccl_comm *c);

/** @brief Finalize and destroy (collective). @param c communicator (NULL: no-op) */
void moe_nccl_destroy(moe_nccl_comm *c);

/** @brief ncclCommAbort, without waiting for the other ranks. @param c communicator (NULL: no-op) */
void moe_nccl_abort(moe_nccl_comm *c);

/** @brief In-place sum. @param c comm @param buf data @param count n @param t type (not BYTE) */
void moe_nccl_all_reduce_sum(moe_nccl_comm *c, void *buf, size_t count, moe_dtype t);
/** @brief All-gather. @param c comm @param send count elements @param recv size·count
 *  @param count n @param t type */
void moe_nccl_all_gather(moe_nccl_comm *c, const void *send, void *recv, size_t count,
                         moe_dtype t);
/** @brief All-gather with per-rank counts (one grouped broadcast per rank).
 *  @param c comm @param send counts[rank] elements @param recv Σ counts @param counts [size]
 *  @param t type */
void moe_nccl_all_gather_v(moe_nccl_comm *c, const void *send, void *recv, const size_t *counts,
                           moe_dtype t);
/** @brief Reduce-scatter sum. @param c comm @param send size·count @param recv count
 *  @param count n @param t type */
void moe_nccl_reduce_scatter_sum(moe_nccl_comm *c, const void *send, void *recv, size_t count,
                                 moe_dtype t);
/** @brief All-to-all-v (grouped send/recv per peer). @param c comm @param send buffer
 *  @param send_counts [size] @param recv buffer @param recv_counts [size] @param t type */
void moe_nccl_exchange(moe_nccl_comm *c, const void *send, const moe_comm_chunk *sends,
                       int n_sends, void *recv, const moe_comm_chunk *recvs, int n_recvs,
                       moe_dtype t);
void moe_nccl_all_to_all_v(moe_nccl_comm *c, const void *send, const size_t *send_counts,
                           void *recv, const size_t *recv_counts, moe_dtype t);
/** @brief Point-to-point send. @param c comm @param buf data @param count n @param t type
 *  @param peer destination */
void moe_nccl_send(moe_nccl_comm *c, const void *buf, size_t count, moe_dtype t, int peer);
/** @brief Point-to-point receive. @param c comm @param buf data @param count n @param t type
 *  @param peer source */
void moe_nccl_recv(moe_nccl_comm *c, void *buf, size_t count, moe_dtype t, int peer);
/** @brief Barrier: a one-element all-reduce, waited for. @param c comm */
void moe_nccl_barrier(moe_nccl_comm *c);

/* The device API, for chapter 02's fused dispatcher (kernels/dispatch_nvlink.cu). */

/** Wait for the stream like every collective does (NCCL errors, MOE_COMM_TIMEOUT). */
void moe_nccl_wait(moe_nccl_comm *c, const char *what);
/** 1 when this build's NCCL headers have the device API and match the library that runs;
 *  else 0 and the reason in @p why. Local: no communication. */
int moe_nccl_device_api_local(char *why, size_t why_len);
/** Create the device communicator with @p ctas LSA barriers (collective) and say whether
 *  every rank of the group reaches every other by load/store; else 0 and why. */
int moe_nccl_peer_access(moe_nccl_comm *c, int ctas, char *why, size_t why_len);
/** The ncclDevComm (as const void *: this header is C), or NULL before peer_access. */
const void *moe_nccl_dev_comm(const moe_nccl_comm *c);
/** ncclMemAlloc + a symmetric window registration of @p bytes (collective: every rank of
 *  the group, the same bytes). */
void moe_nccl_sym_alloc(moe_nccl_comm *c, size_t bytes, void **ptr, void **window);
/** Deregister and free a symmetric buffer (collective). */
void moe_nccl_sym_free(moe_nccl_comm *c, void *ptr, void *window);

#ifdef __cplusplus
}
#endif

#endif /* MOE_COMM_NCCL_H */
