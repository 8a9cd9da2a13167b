/**
 * @file comm.h
 * @brief The communication layer: one interface, a transport per kind of rank.
 *
 * Every collective moe.c needs goes through this header. A ::moe_comm is a group of
 * ranks. Its *transport* is fixed when the world is created (lib/comm_transport.h has
 * the table beneath the groups, one file per transport):
 *  - **MPI** for CPU ranks (lib/comm_mpi.c): buffers are host memory;
 *  - **NCCL** for GPU ranks, one GPU per rank (kernels/comm_nccl.cu): buffers are device
 *    memory. NCCL is bootstrapped over MPI: rank 0 creates the ncclUniqueId and
 *    MPI_Bcast's it; the local rank (which GPU to use) comes from an
 *    MPI_COMM_TYPE_SHARED split.
 * The parallel logic above it (dispatchers, later folding groups and the CP ring) is
 * written once against this interface and runs on a laptop and on a cluster.
 *
 * Small control data (token counts, losses, norms) always lives on the host and uses
 * the `moe_comm_host_*` functions, which go through MPI on every transport.
 *
 * Without MPI (a build on a machine with no mpicc) the world is one rank and every
 * collective is a local copy (lib/comm_local.c), so single-process programs need no
 * special case.
 *
 * **When the data is there.** On the MPI and local transports a call returns when its
 * data is there. On NCCL, collectives on transport buffers are *enqueued* on the CUDA
 * backend's stream and return at once: work queued later on that stream (every kernel,
 * and the backend's to_host, which waits for the stream) sees the result, but the host
 * must not read a transport buffer any other way before moe_comm_wait(). Count arrays
 * and chunk lists are read during the call and may be reused when it returns.
 * moe_comm_barrier() waits on every transport.
 *
 * Failure: a rank that hits an error it cannot return (a failed MPI or NCCL call, an
 * NCCL asynchronous error, an operation that does not complete within
 * the deadline of --distributed-timeout-minutes, default 5 minutes, or MOE_COMM_TIMEOUT
 * seconds) prints a message with its rank and the
 * operation (file and line for a failed call), and ends the whole job instead of leaving
 * the other ranks waiting forever. A watchdog thread (lib/comm_watchdog.c) keeps the
 * deadline of every NCCL operation in flight and of every blocking MPI call between
 * ranks. Programs that fail on one rank for a user error call moe_comm_abort() for the
 * same reason.
 */
#ifndef MOE_COMM_H
#define MOE_COMM_H

#include <stddef.h>

#include "backend.h"
#include "error.h"

#ifdef __cplusplus
extern "C" { /* kernels/comm_nccl.cu is C++ */
#endif

/** Element types the collectives move. */
typedef enum moe_dtype {
    MOE_DTYPE_F32 = 0,  /**< float */
    MOE_DTYPE_F64 = 1,  /**< double */
    MOE_DTYPE_BF16 = 2, /**< bfloat16 (2 bytes; reductions not supported on MPI) */
    MOE_DTYPE_I32 = 3,  /**< int */
    MOE_DTYPE_I64 = 4,  /**< long long */
    MOE_DTYPE_BYTE = 5  /**< raw bytes (no reductions) */
} moe_dtype;

/** @brief Size in bytes of one element of @p t. @param t type @return bytes */
size_t moe_dtype_size(moe_dtype t);

/** @brief The type of a backend's activations on the wire (bf16 on CUDA, moe_real on the
 *  CPU). @param be backend @return ::MOE_DTYPE_BF16, ::MOE_DTYPE_F32 or ::MOE_DTYPE_F64 */
static inline moe_dtype moe_dtype_act(const moe_backend *be) {
    return be->act_size == 2 ? MOE_DTYPE_BF16 : be->act_size == 4 ? MOE_DTYPE_F32 : MOE_DTYPE_F64;
}

/** @brief The type of ::moe_real on the wire (master weights, gradients, routing weights).
 *  @return ::MOE_DTYPE_F32, or ::MOE_DTYPE_F64 in the gradient-check build */
static inline moe_dtype moe_dtype_real(void) {
    return sizeof(moe_real) == 4 ? MOE_DTYPE_F32 : MOE_DTYPE_F64;
}

/** A group of ranks (opaque). */
typedef struct moe_comm moe_comm;

/**
 * @brief Start the world: MPI_Init (when built with MPI), and for @p device CUDA one GPU
 *        per rank (the local rank's) and an NCCL communicator over all ranks.
 * @param argc the program's argument count (MPI may consume some)
 * @param argv the program's arguments
 * @param device ::MOE_DEVICE_CPU (MPI transport) or ::MOE_DEVICE_CUDA (NCCL transport)
 * @param world receives the world group
 * @param err receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_BACKEND (e.g. CUDA asked for but the build has no NCCL)
 */
moe_status moe_comm_init(int *argc, char ***argv, moe_device device, moe_comm **world,
                         moe_error *err);

/** @brief Free the world and every group split from it, then MPI_Finalize. @param world the world */
void moe_comm_finalize(moe_comm *world);

/** @brief This rank's index in @p c. @param c group @return rank */
int moe_comm_rank(const moe_comm *c);
/** @brief Number of ranks in @p c. @param c group @return size */
int moe_comm_size(const moe_comm *c);
/** @brief This process's rank in the world (for log prefixes). @param c any group @return world rank */
int moe_comm_world_rank(const moe_comm *c);
/** @brief The transport's device. @param c group @return CPU (MPI) or CUDA (NCCL) */
moe_device moe_comm_device(const moe_comm *c);

/**
 * @brief Split @p parent into groups: ranks with the same @p color form a group, ordered
 *        by @p key (MPI_Comm_split; ncclCommSplit on the NCCL transport). Collective over
 *        the parent. Later chapters build the parallel-folding groups with this.
 * @param parent group to split  @param color group id  @param key order inside the group
 * @param out receives the new group (free with moe_comm_free)  @param err receives the reason
 * @return ::MOE_OK or ::MOE_ERR_BACKEND
 */
moe_status moe_comm_split(moe_comm *parent, int color, int key, moe_comm **out, moe_error *err);

/** @brief Free a group made by moe_comm_split. @param c group (NULL: no-op) */
void moe_comm_free(moe_comm *c);

/* ---------------------------------------------------- transport buffers */

/** @brief In-place sum over the group. @param c group @param buf count elements @param count n @param t type */
void moe_comm_all_reduce_sum(moe_comm *c, void *buf, size_t count, moe_dtype t);

/**
 * @brief In-place maximum over the group, of 32-bit signed integers only (MOE_DTYPE_I32; any
 *        other type ends the job with a message). Chapter 05's amax reduction reduces float
 *        amaxes through it as their bit patterns: for floats ≥ 0 (and the positive NaN) the
 *        order of the bits as int32 is the order of the values, with NaN above +inf, so a
 *        NaN on one rank reaches every rank (a float max would be the transport's choice).
 *        Counted as an all-reduce (::MOE_COMM_OP_ALL_REDUCE).
 * @param c group @param buf count elements @param count n @param t MOE_DTYPE_I32
 */
void moe_comm_all_reduce_max(moe_comm *c, void *buf, size_t count, moe_dtype t);

/** @brief recv = concatenation of every rank's @p count elements, in rank order.
 *  @param c group @param send count elements @param recv size·count elements @param count n @param t type */
void moe_comm_all_gather(moe_comm *c, const void *send, void *recv, size_t count, moe_dtype t);

/** @brief All-gather with a different count per rank (counts[r] elements from rank r, known
 *  to every rank). @param c group @param send counts[rank] elements @param recv Σ counts
 *  @param counts per-rank counts @param t type */
void moe_comm_all_gather_v(moe_comm *c, const void *send, void *recv, const size_t *counts,
                           moe_dtype t);

/** @brief recv (count elements) = Σ over ranks of block [rank·count, (rank+1)·count) of send.
 *  @param c group @param send size·count elements @param recv count elements @param count n
 *  @param t type (F32 or F64) */
void moe_comm_reduce_scatter_sum(moe_comm *c, const void *send, void *recv, size_t count,
                                 moe_dtype t);

/**
 * @brief All-to-all with per-peer counts: send_counts[p] elements go to rank p (taken from
 *        @p send in rank order), recv_counts[p] elements arrive from rank p (stored in rank
 *        order). Counts are host arrays; zero counts are fine.
 * @param c group @param send buffer @param send_counts [size] @param recv buffer
 * @param recv_counts [size] @param t type
 */
void moe_comm_all_to_all_v(moe_comm *c, const void *send, const size_t *send_counts, void *recv,
                           const size_t *recv_counts, moe_dtype t);

/** One piece of a moe_comm_exchange(): @p count elements at element @p offset of the
 *  buffer, going to (or coming from) rank @p peer. */
typedef struct moe_comm_chunk {
    size_t offset; /**< first element in the buffer */
    size_t count;  /**< elements (0: skipped) */
    int peer;      /**< the other rank (may be this rank: a local copy) */
} moe_comm_chunk;

/**
 * @brief An all-to-all made of pieces: every send chunk goes to its peer, every receive
 *        chunk comes from its peer, chunks between the same two ranks matched in list
 *        order (the k-th chunk rank p sends to q is the k-th chunk q receives from p, and
 *        both must have the same count). Unlike all-to-all-v, pieces land anywhere in the
 *        receive buffer: the dispatcher receives each (source rank, local expert) chunk
 *        straight into its place in the expert layout, with no sorting pass afterwards.
 *        NCCL: one group of send/recv; MPI: nonblocking sends and receives.
 * @param c group @param send buffer @param sends chunks to send @param n_sends their number
 * @param recv buffer @param recvs chunks to receive @param n_recvs their number @param t type
 */
void moe_comm_exchange(moe_comm *c, const void *send, const moe_comm_chunk *sends, int n_sends,
                       void *recv, const moe_comm_chunk *recvs, int n_recvs, moe_dtype t);

/** Exchanges one group may have in flight at once (moe_comm_exchange_start()). */
#define MOE_COMM_MAX_PENDING 4

/**
 * @brief Start moe_comm_exchange() and return before it completes, so the caller can
 *        compute while the data moves (chapter 07's ring passes the next keys on while it
 *        works on the held ones). Until moe_comm_exchange_finish() the send buffer must
 *        not change and the receive buffer must not be read.
 *
 * On NCCL the transfer runs on the group's own side stream: it starts once the work
 * enqueued on the compute stream before the call is done, and runs concurrently with what
 * is enqueued after it (CUDA-graph capturable: a fork and a join). MPI posts nonblocking
 * sends and receives. Transports without either (one rank: copies) complete it here.
 * @param c group @param send buffer @param sends chunks to send @param n_sends their number
 * @param recv buffer @param recvs chunks to receive @param n_recvs their number @param t type
 * @return a handle for moe_comm_exchange_finish() (-1: already complete). More than
 *         MOE_COMM_MAX_PENDING exchanges in flight on one group is a fatal error.
 */
int moe_comm_exchange_start(moe_comm *c, const void *send, const moe_comm_chunk *sends,
                            int n_sends, void *recv, const moe_comm_chunk *recvs, int n_recvs,
                            moe_dtype t);

/**
 * @brief Finish an exchange started with moe_comm_exchange_start(): afterwards the receive
 *        buffer holds the data for everything that follows — on NCCL for the work enqueued
 *        on the compute stream after this call (the stream waits for the transfer; the
 *        host does not), on MPI on return (bounded by the timeout like every wait).
 * @param c the group it was started on @param handle its handle (-1: nothing to do)
 */
void moe_comm_exchange_finish(moe_comm *c, int handle);

/** @brief Send @p count elements to @p peer (pairs with moe_comm_recv on the peer).
 *  @param c group @param buf data @param count n @param t type @param peer destination rank */
void moe_comm_send(moe_comm *c, const void *buf, size_t count, moe_dtype t, int peer);
/** @brief Receive @p count elements from @p peer. @param c group @param buf data @param count n
 *  @param t type @param peer source rank */
void moe_comm_recv(moe_comm *c, void *buf, size_t count, moe_dtype t, int peer);

/** @brief Wait for every rank of the group: returns once every rank has called it (and,
 *  on NCCL, once everything this rank enqueued before it has completed). @param c group */
void moe_comm_barrier(moe_comm *c);

/** @brief Wait until every operation this rank enqueued on @p c has completed, so the host
 *  may read its buffers (NCCL; MPI and local calls complete before they return). Bounded
 *  by MOE_COMM_TIMEOUT like the operations themselves. @param c group */
void moe_comm_wait(moe_comm *c);

/* ------------------------------------------------------ bytes sent, per group */

/** The kinds of operation whose bytes a group counts (moe_comm_bytes()). */
typedef enum moe_comm_op {
    MOE_COMM_OP_ALL_REDUCE = 0, /**< moe_comm_all_reduce_sum */
    MOE_COMM_OP_ALL_GATHER,     /**< moe_comm_all_gather and moe_comm_all_gather_v */
    MOE_COMM_OP_REDUCE_SCATTER, /**< moe_comm_reduce_scatter_sum */
    MOE_COMM_OP_ALL_TO_ALL,     /**< moe_comm_all_to_all_v and moe_comm_exchange */
    MOE_COMM_OP_SEND,           /**< moe_comm_send (a receive sends nothing) */
    MOE_COMM_OP_HOST,           /**< the host control data: every moe_comm_host_* call */
    MOE_COMM_OP_COUNT           /**< number of kinds */
} moe_comm_op;

/**
 * What one rank has sent through one group since it was created or last reset.
 *
 * **The convention: the logical payload this rank puts into each operation**, not the
 * bytes an algorithm moves on the wire (a ring all-reduce of n bytes sends 2(P-1)/P·n per
 * rank; a tree, something else; NCCL chooses). So a model of the traffic depends only on
 * the program, never on the library underneath:
 *  - all-reduce of n elements: n (the buffer it contributes);
 *  - all-gather: its own block (counts[rank] for all-gather-v);
 *  - reduce-scatter into n elements: size·n (its whole input: every block is summed);
 *  - all-to-all-v and exchange: the elements addressed to *other* ranks (what it keeps for
 *    itself never leaves it);
 *  - send: n; recv: nothing;
 *  - host control data: the same rules, in MOE_COMM_OP_HOST.
 * Counted where comm.c forwards to a transport: a few additions per call.
 */
typedef struct moe_comm_bytes {
    unsigned long long bytes[MOE_COMM_OP_COUNT]; /**< bytes per kind */
    unsigned long long calls[MOE_COMM_OP_COUNT]; /**< calls per kind */
} moe_comm_bytes;

/** @brief What this rank has sent through @p c (see ::moe_comm_bytes for the convention).
 *  @param c group @return the counts since creation or the last moe_comm_bytes_reset() */
moe_comm_bytes moe_comm_bytes_sent(const moe_comm *c);

/** @brief Zero this rank's counts of @p c (local: no communication). @param c group */
void moe_comm_bytes_reset(moe_comm *c);

/** @brief Sum of the bytes over the kinds of transport-buffer operations (every kind but
 *  ::MOE_COMM_OP_HOST). @param b counts @return bytes */
unsigned long long moe_comm_bytes_data(const moe_comm_bytes *b);

/**
 * @name Counting inside CUDA graphs (chapter 06)
 * The counts above are kept on the host, where each call is made. A CUDA graph replays the
 * collectives it captured without calling comm.c, so a captured region records what its
 * capture counted (per group and kind) and adds it again at each replay: the counts stay
 * those of an eager run, which makes a captured step with collectives (EP, DP) as
 * observable as an eager one. lib/graph.c is the only caller.
 */
/**@{*/
/** What a capture counted: an opaque list of (group, kind, bytes, calls). */
typedef struct moe_comm_tally moe_comm_tally;
/** @brief Start recording every group's counted operations (a capture begins; one at a
 *  time). */
void moe_comm_tally_begin(void);
/** @brief Stop recording. @return what was counted since moe_comm_tally_begin(), or NULL
 *  when nothing was (free with moe_comm_tally_free()) */
moe_comm_tally *moe_comm_tally_end(void);
/** @brief Count the recorded operations again (a replay). @param t a recording, or NULL */
void moe_comm_tally_replay(const moe_comm_tally *t);
/** @brief Put every group of the recording on the communication watchdog's watch with
 *  moe_comm_track() (a replay was enqueued: the operations inside it had no watch of their
 *  own). @param t a recording, or NULL @param op name for the watchdog's message */
void moe_comm_tally_track(const moe_comm_tally *t, const char *op);
/** @brief Free a recording. @param t a recording, or NULL */
void moe_comm_tally_free(moe_comm_tally *t);
/**@}*/

/** @brief Short name of a kind ("all-reduce", "all-gather", "reduce-scatter",
 *  "all-to-all", "send", "host"). @param op kind @return a static string */
const char *moe_comm_op_name(moe_comm_op op);

/* ------------------------------------- memory the GPUs of a group share (NCCL >= 2.28) */

/**
 * @brief A buffer of the same size on every rank of a group that GPU kernels of any rank
 *        can load from and store to (NCCL symmetric memory: ncclMemAlloc and a window
 *        registered with NCCL_WIN_COLL_SYMMETRIC; on CPU ranks an MPI one-sided window,
 *        reached through moe_comm_sym_put() and moe_comm_sym_get()). Kernels find a peer's copy through the
 *        window (ncclGetLsaPointer). Chapter 02's fused dispatcher writes tokens straight
 *        into the expert-side buffers of other GPUs and reads their outputs back.
 */
typedef struct moe_sym_buf {
    void *ptr;      /**< this rank's copy (device memory; host on CPU ranks), or NULL */
    void *window;   /**< the NCCL window (ncclWindow_t), or a boxed MPI_Win */
    size_t bytes;   /**< its size, the same on every rank */
    moe_comm *comm; /**< the group it was registered with */
} moe_sym_buf;

/** CTAs of every kernel that synchronises through the device communicator (one LSA barrier
 *  each). */
#define MOE_COMM_PEER_CTAS 264

/**
 * @brief Whether every rank of the group can reach every other rank's GPU memory by
 *        load/store (one NVLink domain, or PCIe peer-to-peer), with NCCL's device API
 *        usable: NCCL >= 2.28 with headers matching the library that runs. Collective
 *        (creates the device communicator); every rank gets the same answer.
 * @param c group  @param why receives the reason when the answer is 0  @param why_len its size
 * @return 1 or 0 (0 in builds without NCCL; CPU ranks under MPI: 1, through one-sided
 *         windows, see moe_comm_sym_put())
 */
int moe_comm_peer_access(moe_comm *c, char *why, size_t why_len);

/**
 * @brief Make @p b at least @p bytes (grow-only; the contents are lost when it grows).
 *        Collective: every rank of the group calls it with the same @p bytes, in the same
 *        order as its other symmetric-buffer calls. Needs moe_comm_peer_access() == 1.
 * @param c group  @param b buffer (zero-initialised before the first call)  @param bytes size
 */
void moe_comm_sym_reserve(moe_comm *c, moe_sym_buf *b, size_t bytes);

/**
 * @brief Whether @p b lives in host memory and is reached through moe_comm_sym_put(),
 *        moe_comm_sym_get() and moe_comm_sym_fence() (CPU ranks: an MPI one-sided window)
 *        rather than by GPU kernels' loads and stores (NCCL symmetric memory).
 * @param b buffer @return 1 or 0
 */
int moe_comm_sym_on_host(const moe_sym_buf *b);

/**
 * @brief Store @p bytes of @p src at byte @p offset of rank @p peer's copy of @p b (host
 *        buffers only). Complete, and visible on @p peer, after the next
 *        moe_comm_sym_fence(); the bytes to other ranks count as all-to-all bytes.
 * @param b buffer @param peer rank in b's group @param offset bytes @param src data
 * @param bytes size
 */
void moe_comm_sym_put(moe_sym_buf *b, int peer, size_t offset, const void *src, size_t bytes);

/**
 * @brief Load @p bytes at byte @p offset of rank @p peer's copy of @p b into @p dst (host
 *        buffers only); @p dst holds them after the next moe_comm_sym_fence().
 * @param b buffer @param peer rank in b's group @param offset bytes @param dst data
 * @param bytes size
 */
void moe_comm_sym_get(moe_sym_buf *b, int peer, size_t offset, void *dst, size_t bytes);

/** @brief Close an access epoch of @p b (collective over its group): every put and get of
 *  every rank before it is complete when it returns (host buffers only). @param b buffer */
void moe_comm_sym_fence(moe_sym_buf *b);

/** @brief Free a symmetric buffer (collective; no-op when it was never allocated).
 *  @param b buffer */
void moe_comm_sym_free(moe_sym_buf *b);

/* ------------------------------------------------ host control data (always MPI) */

/** @brief Host in-place sum (F64, I64, I32, F32). @param c group @param buf data @param count n @param t type */
void moe_comm_host_all_reduce_sum(moe_comm *c, void *buf, size_t count, moe_dtype t);
/** @brief Host all-gather. @param c group @param send count elements @param recv size·count
 *  @param count n @param t type */
void moe_comm_host_all_gather(moe_comm *c, const void *send, void *recv, size_t count,
                              moe_dtype t);
/** @brief Host maximum over the group of one double (e.g. "did any rank fail?").
 *  @param c group @param v this rank's value @return the maximum */
double moe_comm_host_max(moe_comm *c, double v);

/**
 * @brief Set the deadline of every communication operation, in seconds
 *        (--distributed-timeout-minutes; 300 when never set). Call it before
 *        moe_comm_init(). MOE_COMM_TIMEOUT (seconds), when set, still wins: tests use it
 *        to shorten the deadline of any program.
 * @param seconds positive and finite (other values are ignored)
 */
void moe_comm_set_timeout_s(double seconds);

/**
 * @brief End the whole job from one rank with a message (never returns). Use it when a
 *        rank cannot go on, so the others do not wait for it forever.
 * @param c group (may be NULL before init)  @param code exit code  @param msg what happened
 */
void moe_comm_abort(moe_comm *c, int code, const char *msg);

#ifdef __cplusplus
}
#endif

#endif /* MOE_COMM_H */
