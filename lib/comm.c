/*
 * The communication layer: one interface (comm.h), two transports.
 *
 * A moe_comm is a group of ranks. Every group carries an MPI communicator (when the
 * build has MPI) and, when its device is CUDA, an NCCL communicator too. Each call
 * picks its transport from the group:
 *
 *   transport buffers (moe_comm_all_reduce_sum … moe_comm_barrier)
 *       CUDA group → NCCL (kernels/comm_nccl.cu), device buffers;
 *       CPU group  → MPI, host buffers;
 *   host control data (moe_comm_host_*) → MPI on every group.
 *
 * Why NCCL is bootstrapped over MPI. An NCCL communicator is created from a 128-byte
 * ncclUniqueId that every rank must hold. NCCL does not say how it gets there; it needs
 * some out-of-band channel. mpirun already started every process and connected them,
 * so rank 0 creates the id and MPI_Bcast's it. MPI also tells each process which GPU
 * to take: MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) groups the ranks of one node,
 * and a rank's index there (its *local rank*) picks the GPU. This is what
 * torch.distributed does with its TCP store, and what Megatron relies on.
 *
 * Why host control data goes over MPI. Token counts, losses and gradient norms are a few
 * numbers the host needs right away (to size buffers, to print, to decide to clip).
 * Sending them over NCCL would mean a host→device copy, a collective and a device→host
 * copy with a synchronisation, for 8 bytes. MPI works on host memory directly, so the
 * host functions are MPI on every transport.
 *
 * Why every failure aborts the job. A collective is a promise that every rank of the
 * group takes part. If one rank hits an error and returns, the others wait for it
 * forever: the classic distributed hang. So a failed MPI call, a failed NCCL call, an
 * NCCL asynchronous error or a timeout prints "[rank r] …" with file and line and calls
 * MPI_Abort, which mpirun turns into the end of every rank. To see the error instead of
 * having MPI abort on its own (its default handler prints little), the world is a copy
 * of MPI_COMM_WORLD with MPI_ERRORS_RETURN, and every call goes through MOE_MPI_CHECK.
 * The NCCL transport waits with a timeout (MOE_COMM_TIMEOUT seconds, default 600, see
 * kernels/comm_nccl.cu). The MPI transport cannot: its collectives are blocking calls
 * with no deadline, so a rank that never arrives is only caught when mpirun or the
 * scheduler kills the job. Errors that are the *caller's* (CUDA asked for without a
 * GPU) are returned as values, but only where every rank reaches the same verdict —
 * moe_comm_init agrees on "does every rank have a GPU?" with an all-reduce before it
 * starts NCCL.
 *
 * MPI counts are int. Open MPI 4 implements MPI 3.1, whose collectives take int counts
 * and displacements (MPI 4.0 adds MPI_Alltoallv_c with MPI_Count; not available here),
 * so a message of more than INT_MAX elements, or a displacement past INT_MAX, aborts
 * with a message instead of silently wrapping around.
 *
 * Without MPI (a machine with no mpicc) the world has one rank and every collective is a
 * local copy, so single-process programs run the same code. The same holds for a CUDA
 * build without NCCL on one rank (device-to-device copies).
 */
#include "comm.h"

#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

#ifdef MOE_HAVE_MPI
#include <mpi.h>
#endif
#ifdef MOE_HAVE_NCCL
#include "comm_nccl.h"
#endif
#ifdef MOE_HAVE_CUDA
#include "cuda_ops.h" /* moe_cuda_copy, moe_cuda_available */
#endif

struct moe_comm {
    moe_device device;
    int rank, size, world_rank;
    moe_comm *world; /* the world this group was split from (the world itself for the world) */
    moe_comm *next;  /* world: the newest group split from it; group: the next older one */
#ifdef MOE_HAVE_MPI
    MPI_Comm mpi;
    int *scount, *sdispl, *rcount, *rdispl; /* [size] int counts for the v-collectives */
#endif
#ifdef MOE_HAVE_NCCL
    moe_nccl_comm *nccl; /* set when device is CUDA */
#endif
};

static int g_world_rank = 0; /* for messages from code that has no group at hand */
#ifdef MOE_HAVE_MPI
static int g_mpi_started_here = 0; /* moe_comm_init called MPI_Init, so finalize ends it */
#endif

size_t moe_dtype_size(moe_dtype t) {
    switch (t) {
    case MOE_DTYPE_F32: return 4;
    case MOE_DTYPE_F64: return 8;
    case MOE_DTYPE_BF16: return 2;
    case MOE_DTYPE_I32: return 4;
    case MOE_DTYPE_I64: return 8;
    case MOE_DTYPE_BYTE: return 1;
    }
    MOE_ASSERT(!"unknown moe_dtype");
    return 0;
}

void moe_comm_abort(moe_comm *c, int code, const char *msg) {
    fprintf(stderr, "[rank %d] fatal: %s\n", c ? c->world_rank : g_world_rank, msg);
    fflush(stdout);
    fflush(stderr);
    if (code == 0)
        code = 1; /* an abort never reports success */
#ifdef MOE_HAVE_MPI
    int started = 0, ended = 0;
    MPI_Initialized(&started);
    MPI_Finalized(&ended);
    if (started && !ended)
        MPI_Abort(MPI_COMM_WORLD, code); /* mpirun ends every other rank too */
#endif
    exit(code);
}

/* moe_comm_abort with a printf-style message. */
static void comm_fatal(const moe_comm *c, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3), noreturn))
#endif
    ;
static void comm_fatal(const moe_comm *c, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    moe_comm_abort((moe_comm *)c, 1, msg);
    exit(1); /* not reached */
}

/* ============================================================ MPI helpers */
#ifdef MOE_HAVE_MPI

static void mpi_fail(int rc, const char *call, const char *file, int line) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS)
        snprintf(msg, sizeof msg, "MPI error code %d", rc);
    fprintf(stderr, "[rank %d] MPI error at %s:%d: %s (in %s)\n", g_world_rank, file, line, msg,
            call);
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    exit(1); /* not reached */
}

/** Abort the job with rank, file and line when an MPI call fails. */
#define MOE_MPI_CHECK(call)                                   \
    do {                                                      \
        int moe_rc_ = (call);                                 \
        if (moe_rc_ != MPI_SUCCESS)                           \
            mpi_fail(moe_rc_, #call, __FILE__, __LINE__);     \
    } while (0)

static MPI_Datatype mpi_type(moe_dtype t) {
    switch (t) {
    case MOE_DTYPE_F32: return MPI_FLOAT;
    case MOE_DTYPE_F64: return MPI_DOUBLE;
    case MOE_DTYPE_BF16: return MPI_UINT16_T; /* moved as 2-byte patterns, never added */
    case MOE_DTYPE_I32: return MPI_INT;
    case MOE_DTYPE_I64: return MPI_LONG_LONG;
    case MOE_DTYPE_BYTE: return MPI_BYTE;
    }
    MOE_ASSERT(!"unknown moe_dtype");
    return MPI_BYTE;
}

static const char *dtype_name(moe_dtype t) {
    static const char *names[] = {"F32", "F64", "BF16", "I32", "I64", "BYTE"};
    return (unsigned)t < sizeof names / sizeof names[0] ? names[t] : "?";
}

/* The type for a sum: MPI has no bfloat16, and bytes have no sum. */
static MPI_Datatype mpi_sum_type(const moe_comm *c, moe_dtype t, const char *what) {
    if (t == MOE_DTYPE_BF16 || t == MOE_DTYPE_BYTE)
        comm_fatal(c, "%s: sums of %s are not supported on the MPI transport (use F32 or F64)",
                   what, dtype_name(t));
    return mpi_type(t);
}

/* An element count or displacement as MPI's int, or a clear abort. */
static int mpi_count(const moe_comm *c, size_t n, const char *what) {
    if (n > (size_t)INT_MAX)
        comm_fatal(c,
                   "%s: %zu elements exceed MPI's int count limit (%d); MPI 3.1 (Open MPI 4) "
                   "has no large-count collectives: move the data in smaller pieces",
                   what, n, INT_MAX);
    return (int)n;
}

/* Fill an int count array and its displacements (exclusive prefix sums) from size_t counts. */
static void mpi_counts(const moe_comm *c, const size_t *counts, int *icount, int *idispl,
                       const char *what) {
    size_t displ = 0;
    for (int r = 0; r < c->size; r++) {
        icount[r] = mpi_count(c, counts[r], what);
        idispl[r] = mpi_count(c, displ, what);
        displ += counts[r];
    }
}

static void alloc_counts(moe_comm *c) {
    c->scount = malloc(4 * (size_t)c->size * sizeof(int));
    if (!c->scount)
        comm_fatal(c, "out of host memory for a group of %d ranks", c->size);
    c->sdispl = c->scount + c->size;
    c->rcount = c->sdispl + c->size;
    c->rdispl = c->rcount + c->size;
}
#endif /* MOE_HAVE_MPI */

/* ============================================================ local copies */

/* One rank and no transport (no MPI, or a CUDA group without NCCL): collectives copy. */
static void local_copy(const moe_comm *c, void *dst, const void *src, size_t bytes) {
    (void)c; /* only the CUDA build looks at the device */
    if (bytes == 0 || dst == src)
        return;
#ifdef MOE_HAVE_CUDA
    if (c->device == MOE_DEVICE_CUDA) {
        moe_cuda_copy(dst, src, bytes);
        return;
    }
#endif
    memmove(dst, src, bytes);
}

/* 1 when the transport buffers of @p c are moved by local copies (a world of one rank). */
static int is_local(const moe_comm *c) {
    (void)c; /* a build without MPI and NCCL has nothing else */
#ifdef MOE_HAVE_NCCL
    if (c->nccl)
        return 0;
#endif
#ifdef MOE_HAVE_MPI
    if (c->device == MOE_DEVICE_CPU)
        return 0;
#endif
    return 1;
}

/* ============================================================ lifetime */

static void free_group(moe_comm *c) {
#ifdef MOE_HAVE_NCCL
    moe_nccl_destroy(c->nccl);
#endif
#ifdef MOE_HAVE_MPI
    if (c->mpi != MPI_COMM_NULL)
        MOE_MPI_CHECK(MPI_Comm_free(&c->mpi));
    free(c->scount);
#endif
    free(c);
}

#ifdef MOE_HAVE_MPI
static void end_mpi_if_ours(void) {
    int ended = 0;
    MPI_Finalized(&ended);
    if (g_mpi_started_here && !ended)
        MPI_Finalize();
    g_mpi_started_here = 0;
}
#endif

/* The CUDA part of moe_comm_init: pick the GPU, start NCCL. Every rank returns the same. */
static moe_status init_cuda(moe_comm *w, moe_error *err) {
#if !defined(MOE_HAVE_CUDA)
    (void)w;
    return moe_error_set(err, MOE_ERR_BACKEND,
                         "--device cuda: this build has no CUDA backend (nvcc was not found when "
                         "it was built); install the CUDA toolkit and rebuild, or use --device cpu");
#elif !defined(MOE_HAVE_NCCL)
    if (w->size > 1)
        return moe_error_set(err, MOE_ERR_BACKEND,
                             "--device cuda with %d ranks: GPU ranks communicate through NCCL, "
                             "and this build has none (the Makefile enables it when nvcc, mpicc "
                             "and nccl.h are all found); install NCCL (libnccl-dev) and rebuild, "
                             "run on one rank, or use --device cpu",
                             w->size);
    if (!moe_cuda_available())
        return moe_error_set(err, MOE_ERR_BACKEND,
                             "--device cuda: no usable GPU was found (no device or no driver); "
                             "use --device cpu, or run on a machine with an NVIDIA GPU");
    return MOE_OK; /* one rank: collectives are device-to-device copies */
#else
    /* 1. the local rank: our index among the ranks that share this node's memory */
    MPI_Comm node;
    int local_rank = 0;
    MOE_MPI_CHECK(MPI_Comm_split_type(w->mpi, MPI_COMM_TYPE_SHARED, w->rank, MPI_INFO_NULL, &node));
    MOE_MPI_CHECK(MPI_Comm_rank(node, &local_rank));
    MOE_MPI_CHECK(MPI_Comm_free(&node));

    /* 2. one GPU per rank; all ranks must agree that they have one before NCCL starts,
     *    or those that do would wait in ncclCommInitRank for those that returned */
    int dev = moe_nccl_set_device(local_rank);
    int mine = dev < 0, any = 0;
    MOE_MPI_CHECK(MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, w->mpi));
    if (any)
        return moe_error_set(err, MOE_ERR_BACKEND,
                             "--device cuda: %s found no usable GPU (no device or no driver); "
                             "use --device cpu, or run one rank per GPU on machines with NVIDIA GPUs",
                             mine ? "this rank" : "another rank");

    /* 3. the bootstrap: rank 0's ncclUniqueId, broadcast over MPI */
    char id[MOE_NCCL_ID_BYTES];
    if (w->rank == 0)
        moe_nccl_unique_id(id);
    MOE_MPI_CHECK(MPI_Bcast(id, MOE_NCCL_ID_BYTES, MPI_BYTE, 0, w->mpi));
    w->nccl = moe_nccl_init(id, w->size, w->rank, w->world_rank);
    return MOE_OK;
#endif
}

moe_status moe_comm_init(int *argc, char ***argv, moe_device device, moe_comm **world,
                         moe_error *err) {
    *world = NULL;
    moe_comm *w = calloc(1, sizeof *w);
    if (!w)
        return moe_error_set(err, MOE_ERR_NOMEM, "moe_comm_init: out of host memory");
    w->device = device;
    w->world = w;
#ifdef MOE_HAVE_MPI
    int started = 0, ended = 0;
    MPI_Initialized(&started);
    MPI_Finalized(&ended);
    if (ended) {
        free(w);
        return moe_error_set(err, MOE_ERR_BACKEND,
                             "moe_comm_init: MPI was already finalized (by moe_comm_finalize); "
                             "start the world once per process");
    }
    if (!started) {
        /* FUNNELED: OpenMP threads never call MPI, only the main thread does. Without
         * mpirun this starts a "singleton" world of one rank. */
        int provided = 0;
        MOE_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided));
    }
    MOE_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &w->mpi));
    MOE_MPI_CHECK(MPI_Comm_set_errhandler(w->mpi, MPI_ERRORS_RETURN)); /* groups inherit it */
    MOE_MPI_CHECK(MPI_Comm_rank(w->mpi, &w->rank));
    MOE_MPI_CHECK(MPI_Comm_size(w->mpi, &w->size));
    alloc_counts(w);
#else
    (void)argc;
    (void)argv;
    w->rank = 0;
    w->size = 1;
#endif
    w->world_rank = w->rank;
    g_world_rank = w->rank;
    moe_log_set_rank(w->rank, w->size);

    if (device == MOE_DEVICE_CUDA) {
        moe_status s = init_cuda(w, err);
        if (s != MOE_OK) { /* every rank is here with the same status: undo together */
            free_group(w);
#ifdef MOE_HAVE_MPI
            if (!started)
                MPI_Finalize(); /* we started MPI for this world only */
#endif
            return s;
        }
    }
#ifdef MOE_HAVE_MPI
    if (!started)
        g_mpi_started_here = 1; /* so moe_comm_finalize ends MPI */
#endif
    *world = w;
    return MOE_OK;
}

void moe_comm_finalize(moe_comm *world) {
    if (!world)
        return;
    if (world->world != world)
        comm_fatal(world, "moe_comm_finalize takes the world; free split groups with moe_comm_free");
    /* newest first: every rank created the groups in the same order, so every rank frees
     * them in the same order too (freeing an NCCL communicator is collective) */
    while (world->next)
        moe_comm_free(world->next);
    free_group(world);
#ifdef MOE_HAVE_MPI
    end_mpi_if_ours();
#endif
}

moe_status moe_comm_split(moe_comm *parent, int color, int key, moe_comm **out, moe_error *err) {
    *out = NULL;
    if (color < 0)
        return moe_error_set(err, MOE_ERR_BACKEND,
                             "moe_comm_split: color %d must be >= 0 (it names the group)", color);
    moe_comm *c = calloc(1, sizeof *c);
    if (!c)
        return moe_error_set(err, MOE_ERR_NOMEM, "moe_comm_split: out of host memory");
    c->device = parent->device;
    c->world = parent->world;
    c->world_rank = parent->world_rank;
#ifdef MOE_HAVE_MPI
    MOE_MPI_CHECK(MPI_Comm_split(parent->mpi, color, key, &c->mpi));
    MOE_MPI_CHECK(MPI_Comm_rank(c->mpi, &c->rank));
    MOE_MPI_CHECK(MPI_Comm_size(c->mpi, &c->size));
    alloc_counts(c);
#else
    (void)key;
    c->rank = 0;
    c->size = 1;
#endif
#ifdef MOE_HAVE_NCCL
    if (parent->nccl) {
        c->nccl = moe_nccl_split(parent->nccl, color, key);
        /* both order the new group by (key, parent rank): the ranks must agree */
        if (moe_nccl_rank(c->nccl) != c->rank)
            comm_fatal(c, "moe_comm_split: NCCL rank %d differs from MPI rank %d",
                       moe_nccl_rank(c->nccl), c->rank);
    }
#endif
    c->next = c->world->next; /* the world keeps every group, so finalize can free them */
    c->world->next = c;
    *out = c;
    return MOE_OK;
}

void moe_comm_free(moe_comm *c) {
    if (!c)
        return;
    if (c->world == c)
        comm_fatal(c, "moe_comm_free: the world is freed by moe_comm_finalize");
    for (moe_comm **p = &c->world->next; *p; p = &(*p)->next)
        if (*p == c) {
            *p = c->next;
            break;
        }
    free_group(c);
}

int moe_comm_rank(const moe_comm *c) { return c->rank; }
int moe_comm_size(const moe_comm *c) { return c->size; }
int moe_comm_world_rank(const moe_comm *c) { return c->world_rank; }
moe_device moe_comm_device(const moe_comm *c) { return c->device; }

/* ============================================================ transport buffers */

void moe_comm_all_reduce_sum(moe_comm *c, void *buf, size_t count, moe_dtype t) {
#ifdef MOE_HAVE_NCCL
    if (c->nccl) {
        moe_nccl_all_reduce_sum(c->nccl, buf, count, t);
        return;
    }
#endif
    if (is_local(c))
        return; /* the sum over one rank is its own data */
    moe_comm_host_all_reduce_sum(c, buf, count, t);
}

void moe_comm_all_gather(moe_comm *c, const void *send, void *recv, size_t count, moe_dtype t) {
#ifdef MOE_HAVE_NCCL
    if (c->nccl) {
        moe_nccl_all_gather(c->nccl, send, recv, count, t);
        return;
    }
#endif
    if (is_local(c)) {
        local_copy(c, recv, send, count * moe_dtype_size(t));
        return;
    }
    moe_comm_host_all_gather(c, send, recv, count, t);
}

void moe_comm_all_gather_v(moe_comm *c, const void *send, void *recv, const size_t *counts,
                           moe_dtype t) {
#ifdef MOE_HAVE_NCCL
    if (c->nccl) {
        moe_nccl_all_gather_v(c->nccl, send, recv, counts, t);
        return;
    }
#endif
    if (is_local(c)) {
        local_copy(c, recv, send, counts[0] * moe_dtype_size(t));
        return;
    }
#ifdef MOE_HAVE_MPI
    mpi_counts(c, counts, c->rcount, c->rdispl, "all_gather_v");
    MOE_MPI_CHECK(MPI_Allgatherv(send, c->rcount[c->rank], mpi_type(t), recv, c->rcount, c->rdispl,
                                 mpi_type(t), c->mpi));
#endif
}

void moe_comm_reduce_scatter_sum(moe_comm *c, const void *send, void *recv, size_t count,
                                 moe_dtype t) {
#ifdef MOE_HAVE_NCCL
    if (c->nccl) {
        moe_nccl_reduce_scatter_sum(c->nccl, send, recv, count, t);
        return;
    }
#endif
    if (is_local(c)) {
        local_copy(c, recv, send, count * moe_dtype_size(t));
        return;
    }
#ifdef MOE_HAVE_MPI
    if (count == 0)
        return;
    MOE_MPI_CHECK(MPI_Reduce_scatter_block(send, recv, mpi_count(c, count, "reduce_scatter_sum"),
                                           mpi_sum_type(c, t, "reduce_scatter_sum"), MPI_SUM,
                                           c->mpi));
#endif
}

void moe_comm_exchange(moe_comm *c, const void *send, const moe_comm_chunk *sends, int n_sends,
                       void *recv, const moe_comm_chunk *recvs, int n_recvs, moe_dtype t) {
    const size_t es = moe_dtype_size(t);
#ifdef MOE_HAVE_NCCL
    if (c->nccl) {
        /* NCCL moves the chunks to this rank itself too, inside the same group and
         * concurrently with the transfers to the peers — as its own all-to-all does. Copying
         * them first, one cudaMemcpyAsync each on the same stream, put them in series with
         * the transfer: 15% of the exchange's time on 2 H200s (chapter 02's benchmark). */
        moe_nccl_exchange(c->nccl, send, sends, n_sends, recv, recvs, n_recvs, t);
        return;
    }
#endif
    /* chunks to this rank itself: local copies (host memory), matched in order; MPI below
     * only moves chunks between different ranks */
    int si = 0, ri = 0;
    for (;;) {
        while (si < n_sends && (sends[si].peer != c->rank || sends[si].count == 0))
            si++;
        while (ri < n_recvs && (recvs[ri].peer != c->rank || recvs[ri].count == 0))
            ri++;
        if (si >= n_sends || ri >= n_recvs)
            break;
        if (sends[si].count != recvs[ri].count)
            comm_fatal(c, "exchange: a chunk to itself of %zu elements meets a receive of %zu",
                       sends[si].count, recvs[ri].count);
        local_copy(c, (char *)recv + recvs[ri].offset * es,
                   (const char *)send + sends[si].offset * es, sends[si].count * es);
        si++;
        ri++;
    }
#ifdef MOE_HAVE_MPI
    if (is_local(c))
        return;
    /* post every receive, then every send; same-pair messages keep their order (MPI's
     * non-overtaking rule for one tag), which is what matches chunk k to chunk k */
    MPI_Request *req = malloc(sizeof(MPI_Request) * (size_t)(n_sends + n_recvs + 1));
    if (!req)
        comm_fatal(c, "exchange: out of host memory");
    int nr = 0;
    for (int i = 0; i < n_recvs; i++)
        if (recvs[i].count > 0 && recvs[i].peer != c->rank)
            MOE_MPI_CHECK(MPI_Irecv((char *)recv + recvs[i].offset * es,
                                    mpi_count(c, recvs[i].count, "exchange"), mpi_type(t),
                                    recvs[i].peer, 7, c->mpi, &req[nr++]));
    for (int i = 0; i < n_sends; i++)
        if (sends[i].count > 0 && sends[i].peer != c->rank)
            MOE_MPI_CHECK(MPI_Isend((const char *)send + sends[i].offset * es,
                                    mpi_count(c, sends[i].count, "exchange"), mpi_type(t),
                                    sends[i].peer, 7, c->mpi, &req[nr++]));
    MOE_MPI_CHECK(MPI_Waitall(nr, req, MPI_STATUSES_IGNORE));
    free(req);
#endif
}

void moe_comm_all_to_all_v(moe_comm *c, const void *send, const size_t *send_counts, void *recv,
                           const size_t *recv_counts, moe_dtype t) {
#ifdef MOE_HAVE_NCCL
    if (c->nccl) {
        moe_nccl_all_to_all_v(c->nccl, send, send_counts, recv, recv_counts, t);
        return;
    }
#endif
    if (is_local(c)) {
        if (send_counts[0] != recv_counts[0])
            comm_fatal(c, "all_to_all_v: one rank sends %zu elements to itself but expects %zu",
                       send_counts[0], recv_counts[0]);
        local_copy(c, recv, send, send_counts[0] * moe_dtype_size(t));
        return;
    }
#ifdef MOE_HAVE_MPI
    mpi_counts(c, send_counts, c->scount, c->sdispl, "all_to_all_v (send)");
    mpi_counts(c, recv_counts, c->rcount, c->rdispl, "all_to_all_v (recv)");
    MOE_MPI_CHECK(MPI_Alltoallv(send, c->scount, c->sdispl, mpi_type(t), recv, c->rcount,
                                c->rdispl, mpi_type(t), c->mpi));
#endif
}

/* Point-to-point needs a real peer: a blocking send to oneself could never complete. */
static void check_peer(const moe_comm *c, int peer, const char *what) {
    if (peer < 0 || peer >= c->size || peer == c->rank)
        comm_fatal(c, "%s: peer %d is not another rank of this group (rank %d of %d)", what, peer,
                   c->rank, c->size);
}

#ifdef MOE_HAVE_MPI
enum { MOE_COMM_TAG = 77 }; /* our point-to-point messages, in our own communicators */
#endif

void moe_comm_send(moe_comm *c, const void *buf, size_t count, moe_dtype t, int peer) {
    check_peer(c, peer, "moe_comm_send");
#ifdef MOE_HAVE_NCCL
    if (c->nccl) {
        moe_nccl_send(c->nccl, buf, count, t, peer);
        return;
    }
#endif
#ifdef MOE_HAVE_MPI
    MOE_MPI_CHECK(MPI_Send(buf, mpi_count(c, count, "send"), mpi_type(t), peer, MOE_COMM_TAG,
                           c->mpi));
#else
    (void)buf, (void)count, (void)t;
#endif
}

void moe_comm_recv(moe_comm *c, void *buf, size_t count, moe_dtype t, int peer) {
    check_peer(c, peer, "moe_comm_recv");
#ifdef MOE_HAVE_NCCL
    if (c->nccl) {
        moe_nccl_recv(c->nccl, buf, count, t, peer);
        return;
    }
#endif
#ifdef MOE_HAVE_MPI
    MOE_MPI_CHECK(MPI_Recv(buf, mpi_count(c, count, "recv"), mpi_type(t), peer, MOE_COMM_TAG,
                           c->mpi, MPI_STATUS_IGNORE));
#else
    (void)buf, (void)count, (void)t;
#endif
}

void moe_comm_barrier(moe_comm *c) {
#ifdef MOE_HAVE_NCCL
    if (c->nccl) {
        moe_nccl_barrier(c->nccl);
        return;
    }
#endif
#ifdef MOE_HAVE_MPI
    MOE_MPI_CHECK(MPI_Barrier(c->mpi));
#else
    (void)c;
#endif
}

/* ============================================================ shared GPU memory */

int moe_comm_peer_access(moe_comm *c, char *why, size_t why_len) {
    snprintf(why, why_len, "CPU ranks share no GPU memory");
#ifdef MOE_HAVE_NCCL
    if (!c->nccl)
        return 0;
    /* every rank must take the same branch into the collective device-communicator
     * creation, so agree on the local checks first, then on the outcome */
    char mine[256] = "";
    int ok = moe_nccl_device_api_local(mine, sizeof mine);
    if (moe_comm_host_max(c, ok ? 0.0 : 1.0) > 0) {
        snprintf(why, why_len, "%s", ok ? "another rank cannot use NCCL's device API" : mine);
        return 0;
    }
    ok = moe_nccl_peer_access(c->nccl, MOE_COMM_PEER_CTAS, mine, sizeof mine);
    if (moe_comm_host_max(c, ok ? 0.0 : 1.0) > 0) {
        snprintf(why, why_len, "%s", ok ? "another rank cannot reach its peers' memory" : mine);
        return 0;
    }
    return 1;
#else
    (void)c;
    return 0;
#endif
}

void moe_comm_sym_reserve(moe_comm *c, moe_sym_buf *b, size_t bytes) {
    if (b->ptr && b->bytes >= bytes)
        return;
    /* whole 2 MiB pages of the GPU's virtual memory: ncclMemAlloc maps whole pages
     * anyway, and the rest of the last one is free headroom */
    const size_t page = (size_t)2 << 20;
    bytes = (bytes + page - 1) / page * page;
#ifdef MOE_HAVE_NCCL
    MOE_ASSERT(c->nccl && moe_nccl_dev_comm(c->nccl));
    moe_comm_sym_free(b);
    moe_nccl_sym_alloc(c->nccl, bytes, &b->ptr, &b->window);
    b->bytes = bytes;
    b->comm = c;
#else
    (void)c;
    moe_comm_abort(NULL, 1, "moe_comm_sym_reserve: built without NCCL");
#endif
}

void moe_comm_sym_free(moe_sym_buf *b) {
#ifdef MOE_HAVE_NCCL
    if (b->ptr)
        moe_nccl_sym_free(b->comm->nccl, b->ptr, b->window);
#endif
    memset(b, 0, sizeof *b);
}

void *moe_comm_nccl(moe_comm *c) {
#ifdef MOE_HAVE_NCCL
    return c ? c->nccl : NULL;
#else
    (void)c;
    return NULL;
#endif
}

/* ============================================================ host control data */

void moe_comm_host_all_reduce_sum(moe_comm *c, void *buf, size_t count, moe_dtype t) {
#ifdef MOE_HAVE_MPI
    if (count == 0)
        return;
    MOE_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, buf, mpi_count(c, count, "all_reduce_sum"),
                                mpi_sum_type(c, t, "all_reduce_sum"), MPI_SUM, c->mpi));
#else
    (void)c, (void)buf, (void)count, (void)t;
#endif
}

void moe_comm_host_all_gather(moe_comm *c, const void *send, void *recv, size_t count,
                              moe_dtype t) {
#ifdef MOE_HAVE_MPI
    if (count == 0)
        return;
    int n = mpi_count(c, count, "all_gather");
    mpi_count(c, count * (size_t)c->size, "all_gather (receive buffer)");
    MOE_MPI_CHECK(MPI_Allgather(send, n, mpi_type(t), recv, n, mpi_type(t), c->mpi));
#else
    if (count && recv != send)
        memmove(recv, send, count * moe_dtype_size(t));
    (void)c;
#endif
}

double moe_comm_host_max(moe_comm *c, double v) {
#ifdef MOE_HAVE_MPI
    double m = v;
    MOE_MPI_CHECK(MPI_Allreduce(&v, &m, 1, MPI_DOUBLE, MPI_MAX, c->mpi));
    return m;
#else
    (void)c;
    return v;
#endif
}
