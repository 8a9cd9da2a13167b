/*
 * The NCCL transport of the communication layer (lib/comm_transport.h): device buffers,
 * one GPU per rank, one NCCL communicator per group.
 *
 * NCCL moves data between GPUs directly (NVLink, PCIe, InfiniBand), from device buffers,
 * with kernels that run on a CUDA stream. lib/comm.c keeps the groups and forwards every
 * transport-buffer operation of a CUDA group to the table at the end of this file.
 *
 * Three rules shape this file.
 *
 *  1. Everything is enqueued on moe_cuda_stream(), the one stream every kernel of the
 *     CUDA backend uses, so a collective runs after the kernels that produced its input
 *     and before those that consume its output with no extra synchronisation — and the
 *     backend's to_host, which waits for that stream, reads its result.
 *
 *  2. Nothing waits on the host. A collective is enqueued and the call returns, so the
 *     host runs ahead and queues the next kernels while the GPU communicates (chapters
 *     04 and 07 overlap the two; chapter 06 captures a step in a CUDA graph, where a host
 *     wait is not allowed at all). Errors and hangs are still caught: after each
 *     operation we record a CUDA event and put "operation X in flight since t" on the
 *     communicator's watch (lib/comm_watchdog.h). The watchdog thread polls the events,
 *     ncclCommGetAsyncError (a peer died, a network link failed) and a clock
 *     (--distributed-timeout-minutes, default 5; MOE_COMM_TIMEOUT seconds wins). Only
 *     moe_comm_barrier and moe_comm_wait block, on cudaStreamSynchronize, under the same watch.
 *
 *  3. Every failure is fatal for the whole job: print rank, file, line and reason, then
 *     ncclCommAbort (which frees NCCL's resources without waiting for peers) and end
 *     every rank. A half-failed collective cannot be retried, and returning an error
 *     would leave the other ranks blocked.
 *
 * Counts: NCCL takes size_t counts, so unlike MPI (int counts) there is no overflow to
 * check. Variable-size collectives are built from grouped primitives:
 *  - all-gather-v = one ncclBroadcast per rank (root r broadcasts its counts[r] elements
 *    into its slot of every receive buffer), all inside one ncclGroupStart/End so NCCL
 *    launches them together;
 *  - all-to-all-v = one ncclSend and one ncclRecv per peer inside a group, skipping
 *    zero counts (both sides skip, because the counts agree: send_counts[p] on rank r is
 *    recv_counts[r] on rank p). Sending to oneself inside a group is allowed by NCCL.
 *
 * The file compiles to nothing unless the Makefile found NCCL (MOE_HAVE_NCCL).
 */
#ifdef MOE_HAVE_NCCL

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm_nccl.h"
#include "comm_transport.h"
#include "comm_watchdog.h"
#include "cuda_common.cuh"

/* Operations one communicator may have in flight before the host waits for the oldest
 * (more than a training step enqueues between two host reads). */
#define DEPTH 256

struct nccl_state {
    ncclComm_t comm;
    int rank, size, world_rank;
    int device;             /* the GPU the communicator lives on (for the watchdog thread) */
    int *barrier_buf;       /* one int on the device for the barrier */
    cudaEvent_t done[DEPTH]; /* slot i: recorded after the operation in the watch's slot i */
    /* exchanges in flight (moe_comm_exchange_start) run on the group's side stream: `fork`
     * orders them after the compute stream's earlier work, join[h] marks the end of the
     * one with handle h, which the compute stream waits for at its finish */
    cudaStream_t side;
    cudaEvent_t fork, join[MOE_COMM_MAX_PENDING];
    int busy[MOE_COMM_MAX_PENDING];
    moe_comm_watch *watch;
#ifdef MOE_NCCL_DEVICE_API
    ncclDevComm dev; /* the device communicator, once peer_access created it */
    int has_dev;
#endif
};

/* A failed NCCL call: say which, where and why, release the communicator, end the job. */
static void nccl_fail(nccl_state *c, ncclResult_t r, const char *call, const char *file,
                      int line) {
    char msg[512];
    snprintf(msg, sizeof msg, "NCCL error at %s:%d: %s (in %s)\n  last NCCL message: %s", file,
             line, ncclGetErrorString(r), call, ncclGetLastError(c ? c->comm : NULL));
    if (c && c->comm)
        ncclCommAbort(c->comm);
    moe_comm_fatal(NULL, "%s", msg);
}

/** Abort the job with rank, file and line when an NCCL call fails (c: the communicator
 *  to abort, or NULL). */
#define MOE_NCCL_CHECK(c, call)                                 \
    do {                                                        \
        ncclResult_t moe_r_ = (call);                           \
        if (moe_r_ != ncclSuccess)                              \
            nccl_fail((c), moe_r_, #call, __FILE__, __LINE__);  \
    } while (0)

static ncclDataType_t nccl_type(moe_dtype t) {
    switch (t) {
    case MOE_DTYPE_F32: return ncclFloat32;
    case MOE_DTYPE_F64: return ncclFloat64;
    case MOE_DTYPE_BF16: return ncclBfloat16;
    case MOE_DTYPE_I32: return ncclInt32;
    case MOE_DTYPE_I64: return ncclInt64;
    case MOE_DTYPE_BYTE: return ncclUint8;
    }
    moe_comm_fatal(NULL, "internal error at %s:%d: unknown moe_dtype %d", __FILE__, __LINE__,
                   (int)t);
}

static const char *at(const void *base, size_t elements, size_t esize) {
    return (const char *)base + elements * esize;
}

/* ------------------------------------------------------------ the watch (rule 2) */

/* The watchdog thread must talk to our GPU: a CUDA call from a thread whose current
 * device is another would create a context there (on GPU 0, from every rank). */
static int on_device(const nccl_state *c, char *msg, size_t cap) {
    static thread_local int bound = -1;
    if (bound == c->device)
        return 0;
    cudaError_t e = cudaSetDevice(c->device);
    if (e != cudaSuccess) {
        snprintf(msg, cap, "CUDA error in the communication watchdog: %s", cudaGetErrorString(e));
        return -1;
    }
    bound = c->device;
    return 0;
}

static int watch_done(void *ctx, int slot, const char *op, char *msg, size_t cap) {
    nccl_state *c = (nccl_state *)ctx;
    if (on_device(c, msg, cap))
        return -1;
    cudaError_t e = cudaEventQuery(c->done[slot]);
    if (e == cudaSuccess)
        return 1;
    if (e == cudaErrorNotReady)
        return 0;
    snprintf(msg, cap, "CUDA error while waiting for %s: %s", op, cudaGetErrorString(e));
    return -1;
}

static int watch_failed(void *ctx, const char *op, char *msg, size_t cap) {
    nccl_state *c = (nccl_state *)ctx;
    ncclResult_t async = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(c->comm, &async);
    if (r != ncclSuccess)
        async = r;
    if (async == ncclSuccess || async == ncclInProgress)
        return 0;
    snprintf(msg, cap, "NCCL asynchronous error in %s: %s\n  last NCCL message: %s", op,
             ncclGetErrorString(async), ncclGetLastError(c->comm));
    return -1;
}

static void watch_abort(void *ctx) { ncclCommAbort(((nccl_state *)ctx)->comm); }

/* The operation just enqueued on stream `st` is in flight: mark its end there and watch it.
 * Not while the stream is captured into a CUDA graph (chapter 06): the event would only
 * mark a place in the graph, and the watchdog thread's query of it would break the
 * capture; the graph's launch is watched instead (moe_comm_tally_track in lib/graph.c). */
static void enqueued_on(nccl_state *c, const char *op, cudaStream_t st) {
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    MOE_CUDA_CHECK(cudaStreamIsCapturing(st, &cs));
    if (cs != cudaStreamCaptureStatusNone)
        return;
    const int slot = moe_comm_watch_slot(c->watch);
    MOE_CUDA_CHECK(cudaEventRecord(c->done[slot], st));
    moe_comm_watch_begin(c->watch, op);
}

static void enqueued(nccl_state *c, const char *op) { enqueued_on(c, op, moe_cuda_stream()); }

/* The host waits for the stream; the watchdog still bounds the wait. */
static void nccl_wait(void *s) {
    nccl_state *c = (nccl_state *)s;
    MOE_CUDA_CHECK(cudaStreamSynchronize(moe_cuda_stream()));
    moe_comm_watch_clear(c->watch);
}

static void nccl_track(void *s, const char *op) { enqueued((nccl_state *)s, op); }

/* ------------------------------------------------------------ lifetime */

static nccl_state *wrap(ncclComm_t comm, int world_rank) {
    nccl_state *c = (nccl_state *)calloc(1, sizeof *c);
    if (!c)
        moe_comm_fatal(NULL, "out of host memory");
    c->comm = comm;
    c->world_rank = world_rank;
    MOE_NCCL_CHECK(c, ncclCommUserRank(comm, &c->rank));
    MOE_NCCL_CHECK(c, ncclCommCount(comm, &c->size));
    MOE_CUDA_CHECK(cudaGetDevice(&c->device));
    c->barrier_buf = (int *)moe_cuda_malloc_counted(sizeof(int));
    if (!c->barrier_buf) {
        fprintf(stderr, "NCCL transport: out of device memory for the barrier word\n");
        exit(1);
    }
    MOE_CUDA_CHECK(cudaMemset(c->barrier_buf, 0, sizeof(int))); /* 0 + 0 stays 0 */
    for (int i = 0; i < DEPTH; i++)
        MOE_CUDA_CHECK(cudaEventCreateWithFlags(&c->done[i], cudaEventDisableTiming));
    MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&c->side, cudaStreamNonBlocking));
    MOE_CUDA_CHECK(cudaEventCreateWithFlags(&c->fork, cudaEventDisableTiming));
    for (int i = 0; i < MOE_COMM_MAX_PENDING; i++)
        MOE_CUDA_CHECK(cudaEventCreateWithFlags(&c->join[i], cudaEventDisableTiming));
    static const moe_comm_watch_hooks hooks = {watch_done, watch_failed, watch_abort};
    c->watch = moe_comm_watch_open(&hooks, c, world_rank, DEPTH);
    return c;
}

/* Bind this process to GPU `local_rank % device_count`; -1 when no device is visible. */
static int set_device(int local_rank) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        (void)cudaGetLastError();
        return -1;
    }
    int dev = local_rank % n;
    MOE_CUDA_CHECK(cudaSetDevice(dev));
    return dev;
}

/* The bootstrap over the host transport (see lib/comm.c for why). */
static int nccl_open(moe_comm *w, void **state, char *why, size_t why_len) {
    /* 1. the local rank, our index among the ranks of this node, picks the GPU */
    const int dev = set_device(moe_comm_node_rank(w));

    /* 2. all ranks must agree that they have a GPU before NCCL starts, or those that
     *    do would wait in ncclCommInitRank for those that returned */
    const int mine = dev < 0;
    if (moe_comm_host_max(w, mine ? 1.0 : 0.0) > 0) {
        snprintf(why, why_len,
                 "--device cuda: %s found no usable GPU (no device or no driver); use --device "
                 "cpu, or run one rank per GPU on machines with NVIDIA GPUs",
                 mine ? "this rank" : "another rank");
        return 1;
    }

    /* 3. rank 0's ncclUniqueId, broadcast by the host transport */
    ncclUniqueId id;
    if (moe_comm_rank(w) == 0)
        MOE_NCCL_CHECK((nccl_state *)NULL, ncclGetUniqueId(&id));
    moe_comm_host_broadcast(w, &id, sizeof id, 0);
    ncclComm_t comm = NULL;
    MOE_NCCL_CHECK((nccl_state *)NULL,
                   ncclCommInitRank(&comm, moe_comm_size(w), id, moe_comm_rank(w)));
    *state = wrap(comm, moe_comm_world_rank(w));
    return 0;
}

static void *nccl_split(void *parent, int color, int key) {
    nccl_state *p = (nccl_state *)parent;
    ncclComm_t comm = NULL;
    /* config NULL: the child inherits the parent's configuration */
    MOE_NCCL_CHECK(p, ncclCommSplit(p->comm, color, key, &comm, NULL));
    return wrap(comm, p->world_rank);
}

static void nccl_shape(const void *s, int *rank, int *size) {
    const nccl_state *c = (const nccl_state *)s;
    *rank = c->rank;
    *size = c->size;
}

static void nccl_free(void *s) {
    nccl_state *c = (nccl_state *)s;
    MOE_CUDA_CHECK(cudaStreamSynchronize(moe_cuda_stream()));
    moe_comm_watch_close(c->watch); /* nothing is in flight any more */
    for (int i = 0; i < DEPTH; i++)
        MOE_CUDA_CHECK(cudaEventDestroy(c->done[i]));
    MOE_CUDA_CHECK(cudaStreamSynchronize(c->side));
    for (int i = 0; i < MOE_COMM_MAX_PENDING; i++)
        MOE_CUDA_CHECK(cudaEventDestroy(c->join[i]));
    MOE_CUDA_CHECK(cudaEventDestroy(c->fork));
    MOE_CUDA_CHECK(cudaStreamDestroy(c->side));
    moe_cuda_free_counted(c->barrier_buf);
#ifdef MOE_NCCL_DEVICE_API
    if (c->has_dev)
        MOE_NCCL_CHECK(c, ncclDevCommDestroy(c->comm, &c->dev));
#endif
    MOE_NCCL_CHECK(c, ncclCommFinalize(c->comm)); /* flush outstanding work (collective) */
    MOE_NCCL_CHECK(c, ncclCommDestroy(c->comm));
    free(c);
}

/* ------------------------------------------------------------ collectives */

static void nccl_all_reduce_sum(void *s, void *buf, size_t count, moe_dtype t) {
    nccl_state *c = (nccl_state *)s;
    if (count == 0)
        return;
    MOE_NCCL_CHECK(c, ncclAllReduce(buf, buf, count, nccl_type(t), ncclSum, c->comm,
                                    moe_cuda_stream()));
    enqueued(c, "all_reduce_sum");
}

static void nccl_all_reduce_max(void *s, void *buf, size_t count, moe_dtype t) {
    nccl_state *c = (nccl_state *)s;
    if (count == 0)
        return;
    MOE_NCCL_CHECK(c, ncclAllReduce(buf, buf, count, nccl_type(t), ncclMax, c->comm,
                                    moe_cuda_stream()));
    enqueued(c, "all_reduce_max");
}

static void nccl_all_gather(void *s, const void *send, void *recv, size_t count, moe_dtype t) {
    nccl_state *c = (nccl_state *)s;
    if (count == 0)
        return;
    MOE_NCCL_CHECK(c, ncclAllGather(send, recv, count, nccl_type(t), c->comm, moe_cuda_stream()));
    enqueued(c, "all_gather");
}

static void nccl_all_gather_v(void *s, const void *send, void *recv, const size_t *counts,
                              moe_dtype t) {
    nccl_state *c = (nccl_state *)s;
    const size_t es = moe_dtype_size(t);
    size_t displ = 0;
    MOE_NCCL_CHECK(c, ncclGroupStart());
    for (int r = 0; r < c->size; r++) {
        if (counts[r] > 0) /* every rank knows counts[], so every rank skips the same roots */
            MOE_NCCL_CHECK(c, ncclBroadcast(send, (void *)at(recv, displ, es), counts[r],
                                            nccl_type(t), r, c->comm, moe_cuda_stream()));
        displ += counts[r];
    }
    MOE_NCCL_CHECK(c, ncclGroupEnd());
    enqueued(c, "all_gather_v");
}

static void nccl_reduce_scatter_sum(void *s, const void *send, void *recv, size_t count,
                                    moe_dtype t) {
    nccl_state *c = (nccl_state *)s;
    if (count == 0)
        return;
    MOE_NCCL_CHECK(c, ncclReduceScatter(send, recv, count, nccl_type(t), ncclSum, c->comm,
                                        moe_cuda_stream()));
    enqueued(c, "reduce_scatter_sum");
}

/* Every chunk of an exchange, as one NCCL group on stream `st`. */
static void exchange_on(nccl_state *c, const void *send, const moe_comm_chunk *sends, int n_sends,
                        void *recv, const moe_comm_chunk *recvs, int n_recvs, moe_dtype t,
                        cudaStream_t st) {
    /* every chunk, those to this rank itself included: NCCL matches a rank's sends to
     * itself with its receives from itself in order, like any peer's, and copies them
     * while the transfers to the other ranks run. Copying them first, one cudaMemcpyAsync
     * each on the same stream, put them in series with the transfer: 15% of the
     * exchange's time on 2 H200s (chapter 02's benchmark). */
    const size_t es = moe_dtype_size(t);
    const ncclDataType_t nt = nccl_type(t);
    MOE_NCCL_CHECK(c, ncclGroupStart());
    for (int i = 0; i < n_sends; i++)
        if (sends[i].count > 0)
            MOE_NCCL_CHECK(c, ncclSend(at(send, sends[i].offset, es), sends[i].count, nt,
                                       sends[i].peer, c->comm, st));
    for (int i = 0; i < n_recvs; i++)
        if (recvs[i].count > 0)
            MOE_NCCL_CHECK(c, ncclRecv((void *)at(recv, recvs[i].offset, es), recvs[i].count, nt,
                                       recvs[i].peer, c->comm, st));
    MOE_NCCL_CHECK(c, ncclGroupEnd());
    enqueued_on(c, "exchange", st);
}

static void nccl_exchange(void *s, const void *send, const moe_comm_chunk *sends, int n_sends,
                          void *recv, const moe_comm_chunk *recvs, int n_recvs, moe_dtype t) {
    exchange_on((nccl_state *)s, send, sends, n_sends, recv, recvs, n_recvs, t,
                moe_cuda_stream());
}

/* The exchange on the side stream, after the compute stream's work so far (a fork: under
 * stream capture the side stream joins the graph here). Every exchange in flight of this
 * group shares the side stream, so they also run in the order they were started, which is
 * the same on every rank: NCCL's rule for one communicator. */
static int nccl_exchange_start(void *s, const void *send, const moe_comm_chunk *sends,
                               int n_sends, void *recv, const moe_comm_chunk *recvs, int n_recvs,
                               moe_dtype t) {
    nccl_state *c = (nccl_state *)s;
    int h = 0;
    while (h < MOE_COMM_MAX_PENDING && c->busy[h])
        h++;
    if (h == MOE_COMM_MAX_PENDING)
        moe_comm_fatal(NULL, "exchange_start: more than %d exchanges in flight on one group",
                       MOE_COMM_MAX_PENDING);
    MOE_CUDA_CHECK(cudaEventRecord(c->fork, moe_cuda_stream()));
    MOE_CUDA_CHECK(cudaStreamWaitEvent(c->side, c->fork, 0));
    exchange_on(c, send, sends, n_sends, recv, recvs, n_recvs, t, c->side);
    MOE_CUDA_CHECK(cudaEventRecord(c->join[h], c->side));
    c->busy[h] = 1;
    return h;
}

/* The compute stream waits for the exchange (the join); the host does not. */
static void nccl_exchange_finish(void *s, int h) {
    nccl_state *c = (nccl_state *)s;
    if (h < 0 || h >= MOE_COMM_MAX_PENDING || !c->busy[h])
        moe_comm_fatal(NULL, "exchange_finish: handle %d is not an exchange in flight", h);
    MOE_CUDA_CHECK(cudaStreamWaitEvent(moe_cuda_stream(), c->join[h], 0));
    c->busy[h] = 0;
}

static void nccl_all_to_all_v(void *s, const void *send, const size_t *send_counts, void *recv,
                              const size_t *recv_counts, moe_dtype t) {
    nccl_state *c = (nccl_state *)s;
    const size_t es = moe_dtype_size(t);
    const ncclDataType_t nt = nccl_type(t);
    size_t sdispl = 0, rdispl = 0;
    MOE_NCCL_CHECK(c, ncclGroupStart());
    for (int p = 0; p < c->size; p++) {
        if (send_counts[p] > 0)
            MOE_NCCL_CHECK(c, ncclSend(at(send, sdispl, es), send_counts[p], nt, p, c->comm,
                                       moe_cuda_stream()));
        if (recv_counts[p] > 0)
            MOE_NCCL_CHECK(c, ncclRecv((void *)at(recv, rdispl, es), recv_counts[p], nt, p,
                                       c->comm, moe_cuda_stream()));
        sdispl += send_counts[p];
        rdispl += recv_counts[p];
    }
    MOE_NCCL_CHECK(c, ncclGroupEnd());
    enqueued(c, "all_to_all_v");
}

static void nccl_send(void *s, const void *buf, size_t count, moe_dtype t, int peer) {
    nccl_state *c = (nccl_state *)s;
    if (count == 0)
        return;
    MOE_NCCL_CHECK(c, ncclSend(buf, count, nccl_type(t), peer, c->comm, moe_cuda_stream()));
    enqueued(c, "send");
}

static void nccl_recv(void *s, void *buf, size_t count, moe_dtype t, int peer) {
    nccl_state *c = (nccl_state *)s;
    if (count == 0)
        return;
    MOE_NCCL_CHECK(c, ncclRecv(buf, count, nccl_type(t), peer, c->comm, moe_cuda_stream()));
    enqueued(c, "recv");
}

static void nccl_barrier(void *s) {
    nccl_state *c = (nccl_state *)s;
    /* NCCL has no barrier: an all-reduce completes on a rank only once every rank has
     * contributed, so waiting for a one-element all-reduce is one. */
    MOE_NCCL_CHECK(c, ncclAllReduce(c->barrier_buf, c->barrier_buf, 1, ncclInt32, ncclSum,
                                    c->comm, moe_cuda_stream()));
    enqueued(c, "barrier");
    nccl_wait(c);
}

/* ------------------------------------------------------------ device API */

static int nccl_device_api(char *why, size_t why_len) {
#ifdef MOE_NCCL_DEVICE_API
    int v = 0;
    if (ncclGetVersion(&v) != ncclSuccess)
        v = 0;
    if (v != NCCL_VERSION_CODE) {
        /* the device API's structures are compiled into our kernels from the headers */
        snprintf(why, why_len,
                 "this build has the NCCL %d.%d.%d headers but runs NCCL %d.%d.%d, and the device "
                 "API needs them equal (rebuild against the headers of the library that runs)",
                 NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH, v / 10000, (v / 100) % 100, v % 100);
        return 0;
    }
    return 1;
#else
    snprintf(why, why_len, "NCCL %d.%d.%d has no device API (it needs NCCL >= 2.28)", NCCL_MAJOR,
             NCCL_MINOR, NCCL_PATCH);
    return 0;
#endif
}

static int nccl_peer_access(void *s, int ctas, char *why, size_t why_len) {
#ifdef MOE_NCCL_DEVICE_API
    nccl_state *c = (nccl_state *)s;
    if (!c->has_dev) {
        ncclDevCommRequirements req;
        memset(&req, 0, sizeof req); /* 2.28 has no initializer macro; zero is "nothing" */
        req.lsaBarrierCount = ctas;  /* one barrier per CTA of our kernels */
        ncclResult_t r = ncclDevCommCreate(c->comm, &req, &c->dev);
        if (r != ncclSuccess) {
            snprintf(why, why_len, "ncclDevCommCreate failed: %s (%s)", ncclGetErrorString(r),
                     ncclGetLastError(c->comm));
            return 0;
        }
        c->has_dev = 1;
    }
    if (c->dev.lsaSize != c->size) {
        snprintf(why, why_len,
                 "only %d of the group's %d GPUs reach each other by load/store (NVLink or PCIe "
                 "P2P); the fused dispatcher needs all of them",
                 c->dev.lsaSize, c->size);
        return 0;
    }
    return 1;
#else
    snprintf(why, why_len, "NCCL has no device API");
    return 0;
#endif
}

static const void *nccl_device_comm(const void *s) {
#ifdef MOE_NCCL_DEVICE_API
    const nccl_state *c = (const nccl_state *)s;
    return c->has_dev ? &c->dev : NULL;
#else
    return NULL;
#endif
}

static void nccl_sym_alloc(void *s, size_t bytes, void **ptr, void **window) {
    nccl_state *c = (nccl_state *)s;
#ifdef MOE_NCCL_DEVICE_API
    ncclWindow_t w = NULL;
    MOE_NCCL_CHECK(c, ncclMemAlloc(ptr, bytes));
    MOE_NCCL_CHECK(c, ncclCommWindowRegister(c->comm, *ptr, bytes, &w, NCCL_WIN_COLL_SYMMETRIC));
    *window = (void *)w;
#else
    (void)bytes, (void)ptr, (void)window;
    ncclCommAbort(c->comm);
    moe_comm_fatal(NULL, "symmetric memory needs NCCL >= 2.28");
#endif
}

static void nccl_sym_free(void *s, void *ptr, void *window) {
#ifdef MOE_NCCL_DEVICE_API
    nccl_state *c = (nccl_state *)s;
    /* peers may still be reading it: deregistration is collective, after the stream */
    MOE_CUDA_CHECK(cudaStreamSynchronize(moe_cuda_stream()));
    MOE_NCCL_CHECK(c, ncclCommWindowDeregister(c->comm, (ncclWindow_t)window));
    MOE_NCCL_CHECK(c, ncclMemFree(ptr));
#else
    (void)s, (void)ptr, (void)window;
#endif
}

/* ------------------------------------------------------------ the table */

/* Every entry, in the table's order: C++ wants them all, and the NULLs say what NCCL does
 * not do (host control data and the bootstrap stay with the host transport). */
static const moe_comm_transport g_nccl = {
    .name = "nccl",
    /* a group's state */
    .start = NULL, .open = nccl_open, .split = nccl_split, .shape = nccl_shape,
    .free = nccl_free, .abort = NULL,
    /* transport buffers */
    .all_reduce_sum = nccl_all_reduce_sum, .all_reduce_max = nccl_all_reduce_max, .all_gather = nccl_all_gather,
    .all_gather_v = nccl_all_gather_v, .reduce_scatter_sum = nccl_reduce_scatter_sum,
    .all_to_all_v = nccl_all_to_all_v, .exchange = nccl_exchange,
    .exchange_start = nccl_exchange_start, .exchange_finish = nccl_exchange_finish, .send = nccl_send,
    .recv = nccl_recv, .barrier = nccl_barrier, .wait = nccl_wait, .track = nccl_track,
    /* host control data */
    .max = NULL, .broadcast = NULL, .node_rank = NULL,
    /* shared GPU memory */
    .device_api = nccl_device_api, .peer_access = nccl_peer_access,
    .device_comm = nccl_device_comm, .sym_alloc = nccl_sym_alloc, .sym_free = nccl_sym_free,
    /* GPU kernels load and store symmetric memory themselves: no host puts and gets */
    .sym_put = NULL, .sym_get = NULL, .sym_fence = NULL,
};

extern "C" const moe_comm_transport *moe_comm_transport_nccl(void) { return &g_nccl; }

#endif /* MOE_HAVE_NCCL */
