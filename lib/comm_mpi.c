/*
 * The MPI transport (comm_transport.h): host buffers, one MPI communicator per group.
 *
 * It is the transport of CPU ranks, and the host transport of every rank: control data
 * (token counts, losses, norms) and the bootstrap of NCCL go through it on GPU ranks
 * too (see lib/comm.c for why).
 *
 * Errors are shown, then the job ends. MPI's default error handler aborts with little
 * to go on, so the world is a copy of MPI_COMM_WORLD with MPI_ERRORS_RETURN (groups
 * split from it inherit that), and every call goes through MOE_MPI_CHECK, which prints
 * "[rank r] MPI error at file:line: reason (in call)" and calls MPI_Abort — mpirun then
 * ends every rank.
 *
 * Deadlines. A blocking MPI call between ranks waits as long as its peers take: forever,
 * if one of them never arrives (it hangs, or a debugger or SIGSTOP stopped it). So every
 * such call is marked in flight on a watch (comm_watchdog.h) for its duration, and the
 * watchdog thread ends the job with "[rank r] fatal: <op> did not complete within N s
 * (MOE_COMM_TIMEOUT)" when one takes too long. MPI is started MPI_THREAD_FUNNELED: only
 * the main thread calls MPI (OpenMP threads never do, nor does the watchdog), so one
 * watch of depth 1 per world is enough.
 *
 * MPI counts are int. Open MPI 4 implements MPI 3.1, whose collectives take int counts
 * and displacements (MPI 4.0 adds MPI_Alltoallv_c with MPI_Count; not available here),
 * so a message of more than INT_MAX elements, or a displacement past INT_MAX, aborts
 * with a message instead of silently wrapping around.
 *
 * The file compiles to nothing unless the Makefile found mpicc (MOE_HAVE_MPI).
 */
#ifdef MOE_HAVE_MPI

#include <limits.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm_transport.h"
#include "comm_watchdog.h"

typedef struct mpi_state {
    MPI_Comm comm;
    int rank, size;
    int *scount, *sdispl, *rcount, *rdispl; /* [size] int counts for the v-collectives */
    /* exchanges in flight (moe_comm_exchange_start): their requests, NULL when free */
    MPI_Request *pending[MOE_COMM_MAX_PENDING];
    int n_pending[MOE_COMM_MAX_PENDING];
    moe_comm_watch *watch; /* the world's (NULL on one rank: nobody to wait for) */
    int owns_watch;        /* 1 on the world, which closes it */
    int ends_mpi;          /* 1 on a world that started MPI: freeing it ends MPI */
    int one_node;          /* windows: 1 when every rank of the group shares this node, 0
                              when not, -1 not asked yet (mpi_sym_alloc) */
} mpi_state;

static int g_world_rank = 0; /* for messages */

/* ------------------------------------------------------------ errors and deadlines */

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

/** A call that waits for other ranks: checked, and in flight on the watch while it runs. */
#define MOE_MPI_WAIT(s, op, call)                             \
    do {                                                      \
        if ((s)->watch)                                       \
            moe_comm_watch_begin((s)->watch, op);             \
        MOE_MPI_CHECK(call);                                  \
        if ((s)->watch)                                       \
            moe_comm_watch_end((s)->watch);                   \
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

/* The type for a sum: MPI has no bfloat16 (comm.c already refused sums of bytes). */
static MPI_Datatype mpi_sum_type(moe_dtype t, const char *what) {
    if (t == MOE_DTYPE_BF16)
        moe_comm_fatal(NULL,
                       "%s: sums of %s are not supported on the MPI transport (use F32 or F64)",
                       what, moe_comm_dtype_name(t));
    return mpi_type(t);
}

/* An element count or displacement as MPI's int, or a clear abort. */
static int mpi_count(size_t n, const char *what) {
    if (n > (size_t)INT_MAX)
        moe_comm_fatal(NULL,
                       "%s: %zu elements exceed MPI's int count limit (%d); MPI 3.1 (Open MPI 4) "
                       "has no large-count collectives: move the data in smaller pieces",
                       what, n, INT_MAX);
    return (int)n;
}

/* Fill an int count array and its displacements (exclusive prefix sums) from size_t counts. */
static void mpi_counts(const mpi_state *s, const size_t *counts, int *icount, int *idispl,
                       const char *what) {
    size_t displ = 0;
    for (int r = 0; r < s->size; r++) {
        icount[r] = mpi_count(counts[r], what);
        idispl[r] = mpi_count(displ, what);
        displ += counts[r];
    }
}

/* ------------------------------------------------------------ a group's state */

/* A state for communicator @p comm (rank, size, count arrays). */
static mpi_state *new_state(MPI_Comm comm) {
    mpi_state *s = calloc(1, sizeof *s);
    if (!s)
        moe_comm_fatal(NULL, "out of host memory for an MPI group");
    s->comm = comm;
    MOE_MPI_CHECK(MPI_Comm_rank(comm, &s->rank));
    MOE_MPI_CHECK(MPI_Comm_size(comm, &s->size));
    s->scount = malloc(4 * (size_t)s->size * sizeof(int));
    if (!s->scount)
        moe_comm_fatal(NULL, "out of host memory for a group of %d ranks", s->size);
    s->sdispl = s->scount + s->size;
    s->rcount = s->sdispl + s->size;
    s->rdispl = s->rcount + s->size;
    s->one_node = -1;
    return s;
}

static int mpi_start(int *argc, char ***argv, void **state, char *why, size_t why_len) {
    int started = 0, ended = 0;
    MPI_Initialized(&started);
    MPI_Finalized(&ended);
    if (ended) {
        snprintf(why, why_len,
                 "moe_comm_init: MPI was already finalized (by moe_comm_finalize); start the "
                 "world once per process");
        return 1;
    }
    if (!started) {
        /* FUNNELED: OpenMP threads never call MPI, only the main thread does. Without
         * mpirun this starts a "singleton" world of one rank. */
        int provided = 0;
        MOE_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided));
    }
    MPI_Comm world;
    MOE_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &world));
    MOE_MPI_CHECK(MPI_Comm_set_errhandler(world, MPI_ERRORS_RETURN)); /* groups inherit it */
    mpi_state *s = new_state(world);
    s->ends_mpi = !started; /* MPI was started for this world only */
    g_world_rank = s->rank;
    if (s->size > 1) {
        static const moe_comm_watch_hooks blocking = {NULL, NULL, NULL}; /* ended by the caller */
        s->watch = moe_comm_watch_open(&blocking, NULL, s->rank, 1);
        s->owns_watch = 1;
    }
    *state = s;
    return 0;
}

static void *mpi_split(void *parent, int color, int key) {
    mpi_state *p = parent;
    MPI_Comm comm;
    MOE_MPI_WAIT(p, "split", MPI_Comm_split(p->comm, color, key, &comm));
    mpi_state *s = new_state(comm);
    s->watch = p->watch;
    return s;
}

static void mpi_shape(const void *state, int *rank, int *size) {
    const mpi_state *s = state;
    *rank = s->rank;
    *size = s->size;
}

static void mpi_free(void *state) {
    mpi_state *s = state;
    if (s->comm != MPI_COMM_NULL)
        MOE_MPI_CHECK(MPI_Comm_free(&s->comm));
    if (s->owns_watch)
        moe_comm_watch_close(s->watch);
    int ended = 0;
    MPI_Finalized(&ended);
    if (s->ends_mpi && !ended)
        MPI_Finalize();
    free(s->scount);
    free(s);
}

static void mpi_abort(int code) {
    int started = 0, ended = 0;
    MPI_Initialized(&started);
    MPI_Finalized(&ended);
    if (started && !ended)
        MPI_Abort(MPI_COMM_WORLD, code); /* mpirun ends every other rank too */
    exit(code);
}

/* ------------------------------------------------------------ collectives */

static void mpi_all_reduce_sum(void *state, void *buf, size_t count, moe_dtype t) {
    mpi_state *s = state;
    if (count == 0)
        return;
    MOE_MPI_WAIT(s, "all_reduce_sum",
                 MPI_Allreduce(MPI_IN_PLACE, buf, mpi_count(count, "all_reduce_sum"),
                               mpi_sum_type(t, "all_reduce_sum"), MPI_SUM, s->comm));
}

static void mpi_all_reduce_max(void *state, void *buf, size_t count, moe_dtype t) {
    mpi_state *s = state;
    if (count == 0)
        return;
    MOE_MPI_WAIT(s, "all_reduce_max",
                 MPI_Allreduce(MPI_IN_PLACE, buf, mpi_count(count, "all_reduce_max"),
                               mpi_type(t), MPI_MAX, s->comm));
}

static void mpi_all_gather(void *state, const void *send, void *recv, size_t count,
                           moe_dtype t) {
    mpi_state *s = state;
    if (count == 0)
        return;
    int n = mpi_count(count, "all_gather");
    mpi_count(count * (size_t)s->size, "all_gather (receive buffer)");
    MOE_MPI_WAIT(s, "all_gather",
                 MPI_Allgather(send, n, mpi_type(t), recv, n, mpi_type(t), s->comm));
}

static void mpi_all_gather_v(void *state, const void *send, void *recv, const size_t *counts,
                             moe_dtype t) {
    mpi_state *s = state;
    mpi_counts(s, counts, s->rcount, s->rdispl, "all_gather_v");
    MOE_MPI_WAIT(s, "all_gather_v",
                 MPI_Allgatherv(send, s->rcount[s->rank], mpi_type(t), recv, s->rcount,
                                s->rdispl, mpi_type(t), s->comm));
}

static void mpi_reduce_scatter_sum(void *state, const void *send, void *recv, size_t count,
                                   moe_dtype t) {
    mpi_state *s = state;
    if (count == 0)
        return;
    MOE_MPI_WAIT(s, "reduce_scatter_sum",
                 MPI_Reduce_scatter_block(send, recv, mpi_count(count, "reduce_scatter_sum"),
                                          mpi_sum_type(t, "reduce_scatter_sum"), MPI_SUM,
                                          s->comm));
}

static void mpi_all_to_all_v(void *state, const void *send, const size_t *send_counts,
                             void *recv, const size_t *recv_counts, moe_dtype t) {
    mpi_state *s = state;
    mpi_counts(s, send_counts, s->scount, s->sdispl, "all_to_all_v (send)");
    mpi_counts(s, recv_counts, s->rcount, s->rdispl, "all_to_all_v (recv)");
    MOE_MPI_WAIT(s, "all_to_all_v",
                 MPI_Alltoallv(send, s->scount, s->sdispl, mpi_type(t), recv, s->rcount,
                               s->rdispl, mpi_type(t), s->comm));
}

static void host_copy(void *dst, const void *src, size_t bytes) { memmove(dst, src, bytes); }

/* Post an exchange: its own chunks copied, every receive, then every send, with @p tag;
 * returns the requests (malloc'd) and their number in *n. Same-pair messages keep their
 * order (MPI's non-overtaking rule for one tag), which is what matches chunk k to chunk k. */
static MPI_Request *exchange_post(mpi_state *s, const void *send, const moe_comm_chunk *sends,
                                  int n_sends, void *recv, const moe_comm_chunk *recvs,
                                  int n_recvs, moe_dtype t, int tag, int *n) {
    const size_t es = moe_dtype_size(t);
    /* chunks to this rank itself are copies; MPI moves only those between ranks */
    moe_comm_copy_own_chunks(s->rank, host_copy, send, sends, n_sends, recv, recvs, n_recvs, es);
    MPI_Request *req = malloc(sizeof(MPI_Request) * (size_t)(n_sends + n_recvs + 1));
    if (!req)
        moe_comm_fatal(NULL, "exchange: out of host memory");
    int nr = 0;
    for (int i = 0; i < n_recvs; i++)
        if (recvs[i].count > 0 && recvs[i].peer != s->rank)
            MOE_MPI_CHECK(MPI_Irecv((char *)recv + recvs[i].offset * es,
                                    mpi_count(recvs[i].count, "exchange"), mpi_type(t),
                                    recvs[i].peer, tag, s->comm, &req[nr++]));
    for (int i = 0; i < n_sends; i++)
        if (sends[i].count > 0 && sends[i].peer != s->rank)
            MOE_MPI_CHECK(MPI_Isend((const char *)send + sends[i].offset * es,
                                    mpi_count(sends[i].count, "exchange"), mpi_type(t),
                                    sends[i].peer, tag, s->comm, &req[nr++]));
    *n = nr;
    return req;
}

static void mpi_exchange(void *state, const void *send, const moe_comm_chunk *sends, int n_sends,
                         void *recv, const moe_comm_chunk *recvs, int n_recvs, moe_dtype t) {
    mpi_state *s = state;
    int nr;
    MPI_Request *req = exchange_post(s, send, sends, n_sends, recv, recvs, n_recvs, t, 7, &nr);
    MOE_MPI_WAIT(s, "exchange", MPI_Waitall(nr, req, MPI_STATUSES_IGNORE));
    free(req);
}

/* A started exchange takes a free slot; its tag is 8 + the slot, so two in flight between
 * the same pair of ranks never match each other's messages (every rank takes the same
 * slots in the same order: the calls are collective). */
static int mpi_exchange_start(void *state, const void *send, const moe_comm_chunk *sends,
                              int n_sends, void *recv, const moe_comm_chunk *recvs, int n_recvs,
                              moe_dtype t) {
    mpi_state *s = state;
    int h = 0;
    while (h < MOE_COMM_MAX_PENDING && s->pending[h])
        h++;
    if (h == MOE_COMM_MAX_PENDING)
        moe_comm_fatal(NULL, "exchange_start: more than %d exchanges in flight on one group",
                       MOE_COMM_MAX_PENDING);
    s->pending[h] = exchange_post(s, send, sends, n_sends, recv, recvs, n_recvs, t, 8 + h,
                                  &s->n_pending[h]);
    return h;
}

static void mpi_exchange_finish(void *state, int h) {
    mpi_state *s = state;
    if (h < 0 || h >= MOE_COMM_MAX_PENDING || !s->pending[h])
        moe_comm_fatal(NULL, "exchange_finish: handle %d is not an exchange in flight", h);
    MOE_MPI_WAIT(s, "exchange", MPI_Waitall(s->n_pending[h], s->pending[h], MPI_STATUSES_IGNORE));
    free(s->pending[h]);
    s->pending[h] = NULL;
}

enum { MOE_COMM_TAG = 77 }; /* our point-to-point messages, in our own communicators */

static void mpi_send(void *state, const void *buf, size_t count, moe_dtype t, int peer) {
    mpi_state *s = state;
    MOE_MPI_WAIT(s, "send",
                 MPI_Send(buf, mpi_count(count, "send"), mpi_type(t), peer, MOE_COMM_TAG,
                          s->comm));
}

static void mpi_recv(void *state, void *buf, size_t count, moe_dtype t, int peer) {
    mpi_state *s = state;
    MOE_MPI_WAIT(s, "recv",
                 MPI_Recv(buf, mpi_count(count, "recv"), mpi_type(t), peer, MOE_COMM_TAG,
                          s->comm, MPI_STATUS_IGNORE));
}

static void mpi_barrier(void *state) {
    mpi_state *s = state;
    MOE_MPI_WAIT(s, "barrier", MPI_Barrier(s->comm));
}

/* ------------------------------------------------------------ host control data */

static double mpi_max(void *state, double v) {
    mpi_state *s = state;
    double m = v;
    MOE_MPI_WAIT(s, "max", MPI_Allreduce(&v, &m, 1, MPI_DOUBLE, MPI_MAX, s->comm));
    return m;
}

static void mpi_broadcast(void *state, void *buf, size_t bytes, int root) {
    mpi_state *s = state;
    MOE_MPI_WAIT(s, "broadcast",
                 MPI_Bcast(buf, mpi_count(bytes, "broadcast"), MPI_BYTE, root, s->comm));
}

/* This rank's place among the group's ranks on its node, and how many they are
 * (collective over the group) */
static void node_split(mpi_state *s, int *rank, int *size) {
    MPI_Comm node;
    MOE_MPI_WAIT(s, "node split",
                 MPI_Comm_split_type(s->comm, MPI_COMM_TYPE_SHARED, s->rank, MPI_INFO_NULL,
                                     &node));
    MOE_MPI_CHECK(MPI_Comm_rank(node, rank));
    MOE_MPI_CHECK(MPI_Comm_size(node, size));
    MOE_MPI_CHECK(MPI_Comm_free(&node));
}

static int mpi_node_rank(void *state) {
    int local_rank = 0, n = 0;
    node_split(state, &local_rank, &n);
    return local_rank;
}

/* ------------------------------------- one-sided windows: shared memory for CPU ranks */

/* CPU ranks have no NVLink, but MPI's one-sided windows give the same model: a buffer of
 * the same size on every rank that any rank stores into and loads from by (rank, offset),
 * with a fence where the GPU kernels have their LSA barriers. The fused dispatcher's CPU
 * twin (lib/moe/dispatch_fused.c) runs on them, so its plan and its addressing are tested
 * on CPU ranks too. */
static int mpi_device_api(char *why, size_t why_len) { return 1; }
static int mpi_peer_access(void *state, int ctas, char *why, size_t why_len) { return 1; }

/* Whether every rank of the group runs on this node (collective, asked once per group).
 * Every rank gets the same answer: the group is on one node or it is not. */
static int one_node(mpi_state *s) {
    if (s->one_node < 0) {
        int r = 0, n = 0;
        node_split(s, &r, &n);
        s->one_node = n == s->size;
    }
    return s->one_node;
}

/* A group on one node allocates its windows with MPI_Win_allocate_shared, not
 * MPI_Win_allocate. Open MPI 4.1 serves MPI_Win_allocate with osc/rdma, whose backing file
 * is /dev/shm/osc_rdma.<node>.<job>.<communicator id> (fixed upstream in 5.0, open-mpi/ompi
 * #9492/#9495): the communicators of one MPI_Comm_split share their id, so two EP groups of
 * one node (EP 2 of 4 ranks) map, truncate and unlink the same file — each group's puts land
 * in the other's windows, or the allocation fails with MPI_ERR_WIN. Shared windows are
 * osc/sm's, whose file names the creating process. Put, get and fence are the same on both
 * (offsets relative to the target's own base). A group spanning nodes keeps MPI_Win_allocate;
 * on Open MPI 4.1, where two such groups share a node, run with `--mca osc ^rdma`. Found by
 * tests/mpi_ep.c (EP 2 of 4 CPU ranks, the fused path), which failed there on every run. */
static void mpi_sym_alloc(void *state, size_t bytes, void **ptr, void **window) {
    mpi_state *s = state;
    MPI_Win *win = malloc(sizeof *win);
    MOE_ASSERT(win);
    if (one_node(s))
        MOE_MPI_WAIT(s, "window allocation",
                     MPI_Win_allocate_shared((MPI_Aint)bytes, 1, MPI_INFO_NULL, s->comm, ptr,
                                             win));
    else
        MOE_MPI_WAIT(s, "window allocation",
                     MPI_Win_allocate((MPI_Aint)bytes, 1, MPI_INFO_NULL, s->comm, ptr, win));
    memset(*ptr, 0, bytes);
    *window = win;
}

static void mpi_sym_free(void *state, void *ptr, void *window) {
    MPI_Win *win = window;
    MOE_MPI_CHECK(MPI_Win_free(win)); /* frees ptr too */
    free(win);
}

static void mpi_sym_put(void *state, void *window, int peer, size_t offset, const void *src,
                        size_t bytes) {
    const int n = mpi_count(bytes, "window put");
    MOE_MPI_CHECK(MPI_Put(src, n, MPI_BYTE, peer, (MPI_Aint)offset, n, MPI_BYTE,
                          *(MPI_Win *)window));
}

static void mpi_sym_get(void *state, void *window, int peer, size_t offset, void *dst,
                        size_t bytes) {
    const int n = mpi_count(bytes, "window get");
    MOE_MPI_CHECK(MPI_Get(dst, n, MPI_BYTE, peer, (MPI_Aint)offset, n, MPI_BYTE,
                          *(MPI_Win *)window));
}

static void mpi_sym_fence(void *state, void *window) {
    mpi_state *s = state;
    MOE_MPI_WAIT(s, "window fence", MPI_Win_fence(0, *(MPI_Win *)window));
}

static const moe_comm_transport g_mpi = {
    .name = "mpi",
    /* a group's state */
    .start = mpi_start, .split = mpi_split, .shape = mpi_shape, .free = mpi_free,
    .abort = mpi_abort,
    /* transport buffers */
    .all_reduce_sum = mpi_all_reduce_sum, .all_reduce_max = mpi_all_reduce_max,
    .all_gather = mpi_all_gather,
    .all_gather_v = mpi_all_gather_v, .reduce_scatter_sum = mpi_reduce_scatter_sum,
    .all_to_all_v = mpi_all_to_all_v, .exchange = mpi_exchange,
    .exchange_start = mpi_exchange_start, .exchange_finish = mpi_exchange_finish, .send = mpi_send,
    .recv = mpi_recv, .barrier = mpi_barrier,
    /* host control data and the bootstrap of device transports */
    .max = mpi_max, .broadcast = mpi_broadcast, .node_rank = mpi_node_rank,
    /* one-sided windows: the fused dispatcher's shared memory on CPU ranks */
    .device_api = mpi_device_api, .peer_access = mpi_peer_access, .sym_alloc = mpi_sym_alloc,
    .sym_free = mpi_sym_free, .sym_put = mpi_sym_put, .sym_get = mpi_sym_get,
    .sym_fence = mpi_sym_fence,
};

const moe_comm_transport *moe_comm_transport_mpi(void) { return &g_mpi; }

#endif /* MOE_HAVE_MPI */
