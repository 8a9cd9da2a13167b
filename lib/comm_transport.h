/**
 * @file comm_transport.h
 * @brief Private to the communication layer: the transport table beneath the groups of
 *        comm.h, and what the transports may ask of lib/comm.c.
 *
 * lib/comm.c keeps the groups (world, split, free, ranks) and forwards every operation
 * to a *transport*: a table of functions, one file each, like Redis's event loop (ae.c)
 * over ae_epoll.c and ae_select.c.
 *
 * | transport | file | buffers | built when |
 * |---|---|---|---|
 * | MPI   | lib/comm_mpi.c       | host   | MOE_HAVE_MPI  |
 * | local | lib/comm_local.c     | host or device (one rank: copies) | always |
 * | NCCL  | kernels/comm_nccl.cu | device | MOE_HAVE_NCCL |
 *
 * Every group has two: a **host** transport for control data (and the bootstrap) — MPI,
 * or local in a build without MPI — and a **data** transport for the transport buffers:
 * the host one on CPU ranks; NCCL on GPU ranks, or local (device-to-device copies) in a
 * one-rank build without NCCL. A transport keeps its per-group state behind a `void *`
 * (an MPI communicator, an NCCL communicator); the functions take that state first.
 * Entries a transport does not have are NULL (a host transport has no symmetric memory,
 * NCCL carries no host control data).
 *
 * The CUDA side implements this lib-declared interface: kernels/comm_nccl.cu defines
 * moe_comm_transport_nccl(); lib never includes a kernels/ header.
 */
#ifndef MOE_COMM_TRANSPORT_H
#define MOE_COMM_TRANSPORT_H

#include <stddef.h>

#include "comm.h"

#ifdef __cplusplus
extern "C" { /* kernels/comm_nccl.cu is C++ */
#endif

/** One transport: the state of a group, the collectives on transport buffers, and what
 *  only host or only device transports have. The semantics of each collective are those
 *  of the comm.h function of the same name. */
typedef struct moe_comm_transport {
    const char *name; /**< "mpi", "local", "nccl" */

    /** @name a group's state */
    /**@{*/
    /** host transports: start the process's runtime (MPI_Init) and make the world's state;
     *  0, or non-zero with the reason in @p why */
    int (*start)(int *argc, char ***argv, void **state, char *why, size_t why_len);
    /** data transports of GPU ranks: the world's state, bootstrapped over the host
     *  transport of @p world (every rank returns the same verdict); 0, or the reason */
    int (*open)(moe_comm *world, void **state, char *why, size_t why_len);
    /** the state of a group split from @p parent (collective over the parent) */
    void *(*split)(void *parent, int color, int key);
    /** this rank's index and the group size */
    void (*shape)(const void *state, int *rank, int *size);
    /** free a state (collective); a host transport's world state that started the
     *  runtime ends it (MPI_Finalize) */
    void (*free)(void *state);
    /** host transports: end the whole job with exit status @p code (never returns) */
    void (*abort)(int code);
    /**@}*/

    /** @name transport buffers (see comm.h) */
    /**@{*/
    void (*all_reduce_sum)(void *s, void *buf, size_t count, moe_dtype t); /**< in-place sum */
    /** in-place maximum (MOE_DTYPE_I32 only: comm.c checks) */
    void (*all_reduce_max)(void *s, void *buf, size_t count, moe_dtype t);
    /** all-gather */
    void (*all_gather)(void *s, const void *send, void *recv, size_t count, moe_dtype t);
    /** all-gather with per-rank counts */
    void (*all_gather_v)(void *s, const void *send, void *recv, const size_t *counts,
                         moe_dtype t);
    /** reduce-scatter sum */
    void (*reduce_scatter_sum)(void *s, const void *send, void *recv, size_t count, moe_dtype t);
    /** all-to-all with per-peer counts */
    void (*all_to_all_v)(void *s, const void *send, const size_t *send_counts, void *recv,
                         const size_t *recv_counts, moe_dtype t);
    /** chunks to and from peers */
    void (*exchange)(void *s, const void *send, const moe_comm_chunk *sends, int n_sends,
                     void *recv, const moe_comm_chunk *recvs, int n_recvs, moe_dtype t);
    /** start an exchange and return at once with a handle in [0, MOE_COMM_MAX_PENDING),
     *  finished by exchange_finish (NULL: comm.c runs the blocking exchange instead) */
    int (*exchange_start)(void *s, const void *send, const moe_comm_chunk *sends, int n_sends,
                          void *recv, const moe_comm_chunk *recvs, int n_recvs, moe_dtype t);
    /** finish the exchange of @p handle (see moe_comm_exchange_finish) */
    void (*exchange_finish)(void *s, int handle);
    /** point-to-point send (to another rank) */
    void (*send)(void *s, const void *buf, size_t count, moe_dtype t, int peer);
    /** point-to-point receive (from another rank) */
    void (*recv)(void *s, void *buf, size_t count, moe_dtype t, int peer);
    /** every rank of the group arrived (returns after that, on every transport) */
    void (*barrier)(void *s);
    /** wait until every operation this rank enqueued has completed (NULL: they complete
     *  before they return) */
    void (*wait)(void *s);
    /** watch work the caller enqueued that waits on peers (a fused dispatch kernel) */
    void (*track)(void *s, const char *op);
    /**@}*/

    /** @name host transports: control data and the bootstrap of device transports */
    /**@{*/
    double (*max)(void *s, double v); /**< maximum of one double over the group */
    /** @p bytes from rank @p root to every rank */
    void (*broadcast)(void *s, void *buf, size_t bytes, int root);
    int (*node_rank)(void *s); /**< index among the ranks of this node (picks the GPU) */
    /**@}*/

    /** @name device transports whose GPUs share memory (NCCL >= 2.28) */
    /**@{*/
    /** 1 when this build can use the device API here (local check), else 0 and why */
    int (*device_api)(char *why, size_t why_len);
    /** create the device communicator (collective); 1 when every rank reaches every
     *  other by load/store, else 0 and why */
    int (*peer_access)(void *s, int ctas, char *why, size_t why_len);
    /** the device communicator (ncclDevComm *), or NULL before peer_access */
    const void *(*device_comm)(const void *s);
    /** allocate and register @p bytes of symmetric memory (collective) */
    void (*sym_alloc)(void *s, size_t bytes, void **ptr, void **window);
    /** deregister and free it (collective) */
    void (*sym_free)(void *s, void *ptr, void *window);
    /**@}*/

    /** @name host transports' stand-in for shared GPU memory (MPI one-sided windows): the
     *  CPU ranks' twin of the fused dispatcher stores and loads through these */
    /**@{*/
    /** put @p bytes from @p src at byte @p offset of @p peer's copy of the window */
    void (*sym_put)(void *s, void *window, int peer, size_t offset, const void *src,
                    size_t bytes);
    /** get @p bytes at byte @p offset of @p peer's copy of the window into @p dst */
    void (*sym_get)(void *s, void *window, int peer, size_t offset, void *dst, size_t bytes);
    /** close an access epoch (collective): every put and get before it is complete, on
     *  every rank, when it returns — the LSA barrier of the GPU kernels */
    void (*sym_fence)(void *s, void *window);
    /**@}*/
} moe_comm_transport;

/** @brief The MPI transport (lib/comm_mpi.c; only in builds with MPI).
 *  @return its table */
const moe_comm_transport *moe_comm_transport_mpi(void);
/** @brief The one-rank transport (lib/comm_local.c): every collective is a copy.
 *  @return its table */
const moe_comm_transport *moe_comm_transport_local(void);
/** @brief The NCCL transport (kernels/comm_nccl.cu; only in builds with NCCL).
 *  @return its table */
const moe_comm_transport *moe_comm_transport_nccl(void);

/** @brief Print "[rank r] fatal: <message>" and end the whole job (never returns).
 *  @param c group (may be NULL) @param fmt printf-style message */
void moe_comm_fatal(const moe_comm *c, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3), noreturn))
#endif
    ;

/** @brief A type's name for messages ("F32", "BF16", …). @param t type @return static string */
const char *moe_comm_dtype_name(moe_dtype t);

/** @brief The chunks of a moe_comm_exchange() that rank @p self sends to itself, copied
 *         with @p copy (matched in list order; the MPI and local transports move only the
 *         others between ranks). @param self this rank @param copy dst, src, bytes
 *  @param send buffer @param sends chunks @param n_sends their number @param recv buffer
 *  @param recvs chunks @param n_recvs their number @param es bytes per element */
void moe_comm_copy_own_chunks(int self, void (*copy)(void *, const void *, size_t),
                              const void *send, const moe_comm_chunk *sends, int n_sends,
                              void *recv, const moe_comm_chunk *recvs, int n_recvs, size_t es);

/** @brief @p bytes from rank @p root to every rank of @p c, on the host transport (the
 *  NCCL bootstrap broadcasts its unique id). @param c group @param buf data @param bytes size
 *  @param root source rank */
void moe_comm_host_broadcast(moe_comm *c, void *buf, size_t bytes, int root);

/** @brief This rank's index among the ranks of its node (which GPU it takes).
 *  @param c group @return local rank */
int moe_comm_node_rank(moe_comm *c);

/** @brief The device communicator of @p c's transport (an ncclDevComm *, for the fused
 *  dispatcher's kernels), or NULL (CPU ranks, no NCCL device API, or before
 *  moe_comm_peer_access()). @param c group @return the handle */
const void *moe_comm_device_comm(moe_comm *c);

/** @brief Let the watchdog cover work the caller enqueued on @p c's stream that waits on
 *  peers (the fused dispatcher's kernels synchronise across GPUs): an error or
 *  MOE_COMM_TIMEOUT then ends the job as for a collective. No-op on host transports.
 *  @param c group @param op its name, for the message (a string literal) */
void moe_comm_track(moe_comm *c, const char *op);

#ifdef __cplusplus
}
#endif

#endif /* MOE_COMM_TRANSPORT_H */
