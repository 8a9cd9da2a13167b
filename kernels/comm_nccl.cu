/*
 * The NCCL transport of the communication layer (see lib/comm.h and kernels/comm_nccl.h).
 *
 * One GPU per rank. NCCL moves data between GPUs directly (NVLink, PCIe, InfiniBand),
 * from device buffers, with kernels that run on a CUDA stream. lib/comm.c creates the
 * communicators (bootstrapped over MPI: see the top of that file) and calls the
 * functions below for every transport-buffer collective of a CUDA group.
 *
 * Three rules shape this file.
 *
 *  1. Everything is enqueued on moe_cuda_stream(), the one stream every kernel of the
 *     CUDA backend uses, so a collective runs after the kernels that produced its input
 *     and before those that consume its output with no extra synchronisation.
 *
 *  2. After each operation we WAIT for it, polling instead of blocking: cudaStreamQuery
 *     says whether the stream has drained, ncclCommGetAsyncError whether NCCL hit an
 *     error in the background (a peer died, a network link failed), and a clock bounds
 *     the wait (MOE_COMM_TIMEOUT seconds, default 600). A plain cudaStreamSynchronize
 *     would wait forever if a peer never arrives — for example when one rank crashed
 *     or passed a different count. Waiting also makes the semantics match the MPI
 *     transport exactly: when the call returns, the data is there. (Overlapping
 *     communication with compute is a later chapter's job and will relax this.)
 *     Note that the wait covers everything queued on the stream before the collective,
 *     so the timeout bounds "compute + communication", which is why it is generous.
 *
 *  3. Every failure is fatal for the whole job: print rank, file, line and reason, then
 *     ncclCommAbort (which frees NCCL's resources without waiting for peers) and
 *     MPI_Abort (which takes every rank down). A half-failed collective cannot be
 *     retried, and returning an error would leave the other ranks blocked.
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

#define OMPI_SKIP_MPICXX 1  /* the C API of MPI is enough (and the C++ one is deprecated) */
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#include <nccl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm_nccl.h"
#include "cuda_common.cuh"

struct moe_nccl_comm {
    ncclComm_t comm;
    int rank, size, world_rank;
    int *barrier_buf; /* one int on the device for moe_nccl_barrier */
#ifdef MOE_NCCL_DEVICE_API
    ncclDevComm dev;  /* the device communicator, once moe_nccl_peer_access created it */
    int has_dev;
#endif
};

/* The failure path: what happened has been printed; take the job down. */
static void nccl_fatal(moe_nccl_comm *c) {
    fflush(stdout);
    fflush(stderr);
    if (c && c->comm)
        ncclCommAbort(c->comm);
    MPI_Abort(MPI_COMM_WORLD, 1);
    exit(1); /* not reached */
}

/* A failed NCCL call: say which, where and why, then take the job down. */
static void nccl_fail(moe_nccl_comm *c, ncclResult_t r, const char *call, const char *file,
                      int line) {
    fprintf(stderr, "[rank %d] NCCL error at %s:%d: %s (in %s)\n  last NCCL message: %s\n",
            c ? c->world_rank : -1, file, line, ncclGetErrorString(r), call,
            ncclGetLastError(c ? c->comm : NULL));
    nccl_fatal(c);
}

/** Abort the job with rank, file and line when an NCCL call fails (c: the communicator
 *  to abort, or NULL). */
#define MOE_NCCL_CHECK(c, call)                                 \
    do {                                                        \
        ncclResult_t moe_r_ = (call);                           \
        if (moe_r_ != ncclSuccess)                              \
            nccl_fail((c), moe_r_, #call, __FILE__, __LINE__);  \
    } while (0)

/* ------------------------------------------------------------ helpers */

/* Bytes per element (comm.h's moe_dtype_size has C linkage that this C++ file would not
 * see: comm.h has no extern "C" block). */
static size_t dtype_bytes(moe_dtype t) {
    switch (t) {
    case MOE_DTYPE_F32: case MOE_DTYPE_I32: return 4;
    case MOE_DTYPE_F64: case MOE_DTYPE_I64: return 8;
    case MOE_DTYPE_BF16: return 2;
    case MOE_DTYPE_BYTE: return 1;
    }
    return 1;
}

static ncclDataType_t nccl_type(moe_dtype t) {
    switch (t) {
    case MOE_DTYPE_F32: return ncclFloat32;
    case MOE_DTYPE_F64: return ncclFloat64;
    case MOE_DTYPE_BF16: return ncclBfloat16;
    case MOE_DTYPE_I32: return ncclInt32;
    case MOE_DTYPE_I64: return ncclInt64;
    case MOE_DTYPE_BYTE: return ncclUint8;
    }
    fprintf(stderr, "moe.c internal error at %s:%d: unknown moe_dtype %d\n", __FILE__, __LINE__,
            (int)t);
    abort();
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* MOE_COMM_TIMEOUT in seconds (read once), default 600. */
static double timeout_s(void) {
    static double t = -1;
    if (t < 0) {
        const char *s = getenv("MOE_COMM_TIMEOUT");
        char *end = NULL;
        double v = s ? strtod(s, &end) : 0;
        t = (s && end != s && *end == '\0' && v > 0) ? v : 600.0;
    }
    return t;
}

/* Rule 2: wait for the stream while watching for NCCL errors and the clock. */
static void nccl_wait(moe_nccl_comm *c, const char *what) {
    cudaStream_t s = moe_cuda_stream();
    const double t0 = now_s(), limit = timeout_s();
    for (;;) {
        cudaError_t e = cudaStreamQuery(s);
        if (e == cudaSuccess)
            return;
        if (e != cudaErrorNotReady) {
            fprintf(stderr, "[rank %d] CUDA error while waiting for %s: %s\n", c->world_rank, what,
                    cudaGetErrorString(e));
            nccl_fatal(c);
        }
        ncclResult_t async = ncclSuccess;
        MOE_NCCL_CHECK(c, ncclCommGetAsyncError(c->comm, &async));
        if (async != ncclSuccess && async != ncclInProgress) {
            fprintf(stderr, "[rank %d] NCCL asynchronous error in %s: %s\n  last NCCL message: %s\n",
                    c->world_rank, what, ncclGetErrorString(async), ncclGetLastError(c->comm));
            nccl_fatal(c);
        }
        if (now_s() - t0 > limit) {
            fprintf(stderr,
                    "[rank %d] fatal: %s did not complete within %.0f s (MOE_COMM_TIMEOUT): "
                    "a peer rank is missing or passed different counts\n",
                    c->world_rank, what, limit);
            nccl_fatal(c);
        }
        sched_yield();
    }
}

static const char *at(const void *base, size_t elements, size_t esize) {
    return (const char *)base + elements * esize;
}

/* ------------------------------------------------------------ lifetime */

extern "C" int moe_nccl_set_device(int local_rank) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        (void)cudaGetLastError();
        return -1;
    }
    int dev = local_rank % n;
    MOE_CUDA_CHECK(cudaSetDevice(dev));
    return dev;
}

extern "C" void moe_nccl_unique_id(void *id) {
    static_assert(sizeof(ncclUniqueId) == MOE_NCCL_ID_BYTES, "MOE_NCCL_ID_BYTES");
    ncclUniqueId u;
    MOE_NCCL_CHECK((moe_nccl_comm *)NULL, ncclGetUniqueId(&u));
    memcpy(id, &u, sizeof u);
}

static moe_nccl_comm *wrap(ncclComm_t comm, int world_rank) {
    moe_nccl_comm *c = (moe_nccl_comm *)calloc(1, sizeof *c);
    if (!c) {
        fprintf(stderr, "[rank %d] fatal: out of host memory\n", world_rank);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    c->comm = comm;
    c->world_rank = world_rank;
    MOE_NCCL_CHECK(c, ncclCommUserRank(comm, &c->rank));
    MOE_NCCL_CHECK(c, ncclCommCount(comm, &c->size));
    MOE_CUDA_CHECK(cudaMalloc(&c->barrier_buf, sizeof(int)));
    MOE_CUDA_CHECK(cudaMemset(c->barrier_buf, 0, sizeof(int))); /* 0 + 0 stays 0 */
    return c;
}

extern "C" moe_nccl_comm *moe_nccl_init(const void *id, int nranks, int rank, int world_rank) {
    ncclUniqueId u;
    memcpy(&u, id, sizeof u);
    ncclComm_t comm = NULL;
    moe_nccl_comm tmp;  /* for error messages */
    memset(&tmp, 0, sizeof tmp);
    tmp.rank = rank;
    tmp.size = nranks;
    tmp.world_rank = world_rank;
    MOE_NCCL_CHECK(&tmp, ncclCommInitRank(&comm, nranks, u, rank));
    return wrap(comm, world_rank);
}

extern "C" moe_nccl_comm *moe_nccl_split(moe_nccl_comm *parent, int color, int key) {
    ncclComm_t comm = NULL;
    /* config NULL: the child inherits the parent's configuration */
    MOE_NCCL_CHECK(parent, ncclCommSplit(parent->comm, color, key, &comm, NULL));
    return wrap(comm, parent->world_rank);
}

extern "C" int moe_nccl_rank(const moe_nccl_comm *c) { return c->rank; }

extern "C" void moe_nccl_destroy(moe_nccl_comm *c) {
    if (!c)
        return;
    MOE_CUDA_CHECK(cudaStreamSynchronize(moe_cuda_stream()));
    MOE_CUDA_CHECK(cudaFree(c->barrier_buf));
#ifdef MOE_NCCL_DEVICE_API
    if (c->has_dev)
        MOE_NCCL_CHECK(c, ncclDevCommDestroy(c->comm, &c->dev));
#endif
    MOE_NCCL_CHECK(c, ncclCommFinalize(c->comm)); /* flush outstanding work (collective) */
    MOE_NCCL_CHECK(c, ncclCommDestroy(c->comm));
    free(c);
}

extern "C" void moe_nccl_abort(moe_nccl_comm *c) {
    if (c && c->comm)
        ncclCommAbort(c->comm);
}

/* ------------------------------------------------------------ collectives */

extern "C" void moe_nccl_all_reduce_sum(moe_nccl_comm *c, void *buf, size_t count, moe_dtype t) {
    if (t == MOE_DTYPE_BYTE) {
        fprintf(stderr, "[rank %d] fatal: all_reduce_sum on MOE_DTYPE_BYTE (raw bytes have no sum)\n",
                c->world_rank);
        nccl_fatal(c);
    }
    if (count == 0)
        return;
    MOE_NCCL_CHECK(c, ncclAllReduce(buf, buf, count, nccl_type(t), ncclSum, c->comm,
                                    moe_cuda_stream()));
    nccl_wait(c, "all_reduce_sum");
}

extern "C" void moe_nccl_all_gather(moe_nccl_comm *c, const void *send, void *recv, size_t count,
                                    moe_dtype t) {
    if (count == 0)
        return;
    MOE_NCCL_CHECK(c, ncclAllGather(send, recv, count, nccl_type(t), c->comm, moe_cuda_stream()));
    nccl_wait(c, "all_gather");
}

extern "C" void moe_nccl_all_gather_v(moe_nccl_comm *c, const void *send, void *recv,
                                      const size_t *counts, moe_dtype t) {
    const size_t es = dtype_bytes(t);
    size_t displ = 0;
    MOE_NCCL_CHECK(c, ncclGroupStart());
    for (int r = 0; r < c->size; r++) {
        if (counts[r] > 0) /* every rank knows counts[], so every rank skips the same roots */
            MOE_NCCL_CHECK(c, ncclBroadcast(send, (void *)at(recv, displ, es), counts[r],
                                            nccl_type(t), r, c->comm, moe_cuda_stream()));
        displ += counts[r];
    }
    MOE_NCCL_CHECK(c, ncclGroupEnd());
    nccl_wait(c, "all_gather_v");
}

extern "C" void moe_nccl_reduce_scatter_sum(moe_nccl_comm *c, const void *send, void *recv,
                                            size_t count, moe_dtype t) {
    if (t == MOE_DTYPE_BYTE) {
        fprintf(stderr, "[rank %d] fatal: reduce_scatter_sum on MOE_DTYPE_BYTE\n", c->world_rank);
        nccl_fatal(c);
    }
    if (count == 0)
        return;
    MOE_NCCL_CHECK(c, ncclReduceScatter(send, recv, count, nccl_type(t), ncclSum, c->comm,
                                        moe_cuda_stream()));
    nccl_wait(c, "reduce_scatter_sum");
}

extern "C" void moe_nccl_exchange(moe_nccl_comm *c, const void *send, const moe_comm_chunk *sends,
                                  int n_sends, void *recv, const moe_comm_chunk *recvs,
                                  int n_recvs, moe_dtype t) {
    /* every chunk, those to this rank itself included: NCCL matches a rank's sends to
     * itself with its receives from itself in order, like any peer's, and copies them
     * while the transfers to the other ranks run */
    const size_t es = dtype_bytes(t);
    const ncclDataType_t nt = nccl_type(t);
    MOE_NCCL_CHECK(c, ncclGroupStart());
    for (int i = 0; i < n_sends; i++)
        if (sends[i].count > 0)
            MOE_NCCL_CHECK(c, ncclSend(at(send, sends[i].offset, es), sends[i].count, nt,
                                       sends[i].peer, c->comm, moe_cuda_stream()));
    for (int i = 0; i < n_recvs; i++)
        if (recvs[i].count > 0)
            MOE_NCCL_CHECK(c, ncclRecv((void *)at(recv, recvs[i].offset, es), recvs[i].count, nt,
                                       recvs[i].peer, c->comm, moe_cuda_stream()));
    MOE_NCCL_CHECK(c, ncclGroupEnd());
    nccl_wait(c, "exchange");
}

extern "C" void moe_nccl_all_to_all_v(moe_nccl_comm *c, const void *send, const size_t *send_counts,
                                      void *recv, const size_t *recv_counts, moe_dtype t) {
    const size_t es = dtype_bytes(t);
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
    nccl_wait(c, "all_to_all_v");
}

extern "C" void moe_nccl_send(moe_nccl_comm *c, const void *buf, size_t count, moe_dtype t,
                              int peer) {
    if (count == 0)
        return;
    MOE_NCCL_CHECK(c, ncclSend(buf, count, nccl_type(t), peer, c->comm, moe_cuda_stream()));
    nccl_wait(c, "send");
}

extern "C" void moe_nccl_recv(moe_nccl_comm *c, void *buf, size_t count, moe_dtype t, int peer) {
    if (count == 0)
        return;
    MOE_NCCL_CHECK(c, ncclRecv(buf, count, nccl_type(t), peer, c->comm, moe_cuda_stream()));
    nccl_wait(c, "recv");
}

extern "C" void moe_nccl_barrier(moe_nccl_comm *c) {
    /* NCCL has no barrier: an all-reduce completes on a rank only once every rank has
     * contributed, so waiting for a one-element all-reduce is one. */
    MOE_NCCL_CHECK(c, ncclAllReduce(c->barrier_buf, c->barrier_buf, 1, ncclInt32, ncclSum,
                                    c->comm, moe_cuda_stream()));
    nccl_wait(c, "barrier");
}

/* ------------------------------------------------------------ device API */

extern "C" void moe_nccl_wait(moe_nccl_comm *c, const char *what) { nccl_wait(c, what); }

extern "C" int moe_nccl_device_api_local(char *why, size_t why_len) {
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

extern "C" int moe_nccl_peer_access(moe_nccl_comm *c, int ctas, char *why, size_t why_len) {
#ifdef MOE_NCCL_DEVICE_API
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

extern "C" const void *moe_nccl_dev_comm(const moe_nccl_comm *c) {
#ifdef MOE_NCCL_DEVICE_API
    return c->has_dev ? &c->dev : NULL;
#else
    return NULL;
#endif
}

extern "C" void moe_nccl_sym_alloc(moe_nccl_comm *c, size_t bytes, void **ptr, void **window) {
#ifdef MOE_NCCL_DEVICE_API
    ncclWindow_t w = NULL;
    MOE_NCCL_CHECK(c, ncclMemAlloc(ptr, bytes));
    MOE_NCCL_CHECK(c, ncclCommWindowRegister(c->comm, *ptr, bytes, &w, NCCL_WIN_COLL_SYMMETRIC));
    *window = (void *)w;
#else
    fprintf(stderr, "[rank %d] fatal: symmetric memory needs NCCL >= 2.28\n", c->world_rank);
    nccl_fatal(c);
#endif
}

extern "C" void moe_nccl_sym_free(moe_nccl_comm *c, void *ptr, void *window) {
#ifdef MOE_NCCL_DEVICE_API
    /* peers may still be reading it: deregistration is collective, after the stream */
    MOE_CUDA_CHECK(cudaStreamSynchronize(moe_cuda_stream()));
    MOE_NCCL_CHECK(c, ncclCommWindowDeregister(c->comm, (ncclWindow_t)window));
    MOE_NCCL_CHECK(c, ncclMemFree(ptr));
#endif
}

#endif /* MOE_HAVE_NCCL */
