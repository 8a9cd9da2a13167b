/*
 * The communication layer: the groups of comm.h over a table of transports.
 *
 * A moe_comm is a group of ranks. This file keeps the groups — the world, the groups
 * split from it, their ranks, their lifetime — and forwards every operation to a
 * transport (comm_transport.h), one file each:
 *
 *   host control data (moe_comm_host_*)      → the host transport: MPI (comm_mpi.c), or
 *                                              one rank's copies (comm_local.c) without MPI;
 *   transport buffers (all_reduce_sum … barrier)
 *       CPU group  → the host transport, host buffers;
 *       CUDA group → NCCL (kernels/comm_nccl.cu), device buffers; without NCCL, one
 *                    rank's device-to-device copies (comm_local.c).
 *
 * So a group holds two transport states: the host one (an MPI communicator) and the
 * data one (an NCCL communicator on GPU ranks; the host one again on CPU ranks). Which
 * transports a build has is decided in one place below; every transport file compiles
 * to its table or to nothing. This is the shape of Redis's event loop: ae.c over
 * ae_epoll.c, ae_kqueue.c and ae_select.c.
 *
 * Why NCCL is bootstrapped over MPI. An NCCL communicator is created from a 128-byte
 * ncclUniqueId that every rank must hold. NCCL does not say how it gets there; it needs
 * some out-of-band channel. mpirun already started every process and connected them,
 * so rank 0 creates the id and the host transport broadcasts it. The host transport
 * also tells each process which GPU to take: its index among the ranks of its node (its
 * *local rank*). This is what torch.distributed does with its TCP store, and what
 * Megatron relies on. The NCCL transport's open hook does it through
 * moe_comm_node_rank(), moe_comm_host_max() and moe_comm_host_broadcast().
 *
 * Why host control data goes over MPI. Token counts, losses and gradient norms are a few
 * numbers the host needs right away (to size buffers, to print, to decide to clip).
 * Sending them over NCCL would mean a host→device copy, a collective and a device→host
 * copy with a synchronisation, for 8 bytes. MPI works on host memory directly, so the
 * host functions use the host transport on every group.
 *
 * Why every failure ends the job. A collective is a promise that every rank of the
 * group takes part. If one rank hits an error and returns, the others wait for it
 * forever: the classic distributed hang. So a failed MPI or NCCL call, an NCCL
 * asynchronous error or a missed deadline prints "[rank r] …" and ends every rank
 * (MPI_Abort from the main thread; from the watchdog thread, see comm_watchdog.c).
 * Errors that are the *caller's* (CUDA asked for without a GPU) are returned as values,
 * but only where every rank reaches the same verdict — the device transport's open
 * agrees on "does every rank have a GPU?" before it starts NCCL.
 */
#include "comm.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm_transport.h"
#include "log.h"

struct moe_comm {
    moe_device device;
    int rank, size, world_rank;
    moe_comm *world; /* the world this group was split from (the world itself for the world) */
    moe_comm *next;  /* world: the newest group split from it; group: the next older one */
    void *host;      /* the host transport's state */
    const moe_comm_transport *data; /* moves the transport buffers */
    void *data_state;               /* its state (the host one on CPU groups) */
    moe_comm_bytes sent;            /* what this rank sent through it (comm.h) */
};

static int g_world_rank = 0; /* for messages from code that has no group at hand */

/* ============================================================ the transports of this build */

/* The transports this build has, chosen here once (each transport file compiles to its
 * table or to nothing): host control data goes over MPI when the build has it, and the
 * transport buffers of GPU ranks over NCCL when it has that. */
#ifdef MOE_HAVE_MPI
#define HOST_TRANSPORT moe_comm_transport_mpi
#else
#define HOST_TRANSPORT moe_comm_transport_local
#endif
#ifdef MOE_HAVE_NCCL
#define DEVICE_TRANSPORT moe_comm_transport_nccl
#else
#define DEVICE_TRANSPORT moe_comm_transport_local
#endif

static const moe_comm_transport *host_transport(void) { return HOST_TRANSPORT(); }

/* ============================================================ types and failure */

static const struct {
    size_t size;
    const char *name;
} g_dtypes[] = {
    [MOE_DTYPE_F32] = {4, "F32"}, [MOE_DTYPE_F64] = {8, "F64"},  [MOE_DTYPE_BF16] = {2, "BF16"},
    [MOE_DTYPE_I32] = {4, "I32"}, [MOE_DTYPE_I64] = {8, "I64"}, [MOE_DTYPE_BYTE] = {1, "BYTE"},
};
enum { N_DTYPES = sizeof g_dtypes / sizeof g_dtypes[0] };

size_t moe_dtype_size(moe_dtype t) {
    MOE_ASSERT((unsigned)t < N_DTYPES);
    return g_dtypes[t].size;
}

const char *moe_comm_dtype_name(moe_dtype t) {
    return (unsigned)t < N_DTYPES ? g_dtypes[t].name : "?";
}

void moe_comm_abort(moe_comm *c, int code, const char *msg) {
    fprintf(stderr, "[rank %d] fatal: %s\n", c ? c->world_rank : g_world_rank, msg);
    fflush(stdout);
    fflush(stderr);
    if (code == 0)
        code = 1; /* an abort never reports success */
    host_transport()->abort(code);
    exit(code); /* not reached */
}

void moe_comm_fatal(const moe_comm *c, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    moe_comm_abort((moe_comm *)c, 1, msg);
    exit(1); /* not reached */
}

/* A sum needs numbers: raw bytes have none (on every transport). */
static void check_sum(const moe_comm *c, moe_dtype t, const char *what) {
    if (t == MOE_DTYPE_BYTE)
        moe_comm_fatal(c, "%s on MOE_DTYPE_BYTE (raw bytes have no sum)", what);
}

/* Point-to-point needs a real peer: a blocking send to oneself could never complete. */
static void check_peer(const moe_comm *c, int peer, const char *what) {
    if (peer < 0 || peer >= c->size || peer == c->rank)
        moe_comm_fatal(c, "%s: peer %d is not another rank of this group (rank %d of %d)", what,
                       peer, c->rank, c->size);
}

/* ============================================================ lifetime */

static void free_group(moe_comm *c) {
    if (c->data_state && c->data_state != c->host)
        c->data->free(c->data_state);
    host_transport()->free(c->host);
    free(c);
}

moe_status moe_comm_init(int *argc, char ***argv, moe_device device, moe_comm **world,
                         moe_error *err) {
    *world = NULL;
    moe_comm *w = calloc(1, sizeof *w);
    if (!w)
        return moe_error_set(err, MOE_ERR_NOMEM, "moe_comm_init: out of host memory");
    w->device = device;
    w->world = w;
    const moe_comm_transport *host = host_transport();
    char why[MOE_ERROR_MSG_LEN];
    if (host->start(argc, argv, &w->host, why, sizeof why) != 0) {
        free(w);
        return moe_error_set(err, MOE_ERR_BACKEND, "%s", why);
    }
    host->shape(w->host, &w->rank, &w->size);
    w->world_rank = w->rank;
    g_world_rank = w->rank;
    moe_log_set_rank(w->rank, w->size);
    w->data = host;
    w->data_state = w->host;

    if (device == MOE_DEVICE_CUDA) {
        const moe_comm_transport *dev = DEVICE_TRANSPORT();
        void *state = NULL;
        if (dev->open(w, &state, why, sizeof why) != 0) {
            /* every rank is here with the same verdict: undo together */
            free_group(w); /* ends MPI when this world started it */
            return moe_error_set(err, MOE_ERR_BACKEND, "%s", why);
        }
        w->data = dev;
        w->data_state = state;
    }
    *world = w;
    return MOE_OK;
}

void moe_comm_finalize(moe_comm *world) {
    if (!world)
        return;
    if (world->world != world)
        moe_comm_fatal(world,
                       "moe_comm_finalize takes the world; free split groups with moe_comm_free");
    /* newest first: every rank created the groups in the same order, so every rank frees
     * them in the same order too (freeing an NCCL communicator is collective) */
    while (world->next)
        moe_comm_free(world->next);
    free_group(world); /* the world's host state ends MPI when the world started it */
}

moe_status moe_comm_split(moe_comm *parent, int color, int key, moe_comm **out, moe_error *err) {
    *out = NULL;
    if (color < 0)
        return moe_error_set(err, MOE_ERR_BACKEND,
                             "moe_comm_split: color %d must be >= 0 (it names the group)", color);
    moe_comm *c = calloc(1, sizeof *c);
    if (!c)
        return moe_error_set(err, MOE_ERR_NOMEM, "moe_comm_split: out of host memory");
    const moe_comm_transport *host = host_transport();
    c->device = parent->device;
    c->world = parent->world;
    c->world_rank = parent->world_rank;
    c->host = host->split(parent->host, color, key);
    host->shape(c->host, &c->rank, &c->size);
    c->data = parent->data;
    c->data_state = c->host;
    if (parent->data_state != parent->host) {
        c->data_state = c->data->split(parent->data_state, color, key);
        /* both order the new group by (key, parent rank): the ranks must agree */
        int rank, size;
        c->data->shape(c->data_state, &rank, &size);
        if (rank != c->rank)
            moe_comm_fatal(c, "moe_comm_split: %s rank %d differs from %s rank %d", c->data->name,
                           rank, host->name, c->rank);
    }
    c->next = c->world->next; /* the world keeps every group, so finalize can free them */
    c->world->next = c;
    *out = c;
    return MOE_OK;
}

void moe_comm_free(moe_comm *c) {
    if (!c)
        return;
    if (c->world == c)
        moe_comm_fatal(c, "moe_comm_free: the world is freed by moe_comm_finalize");
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

/* ============================================================ bytes sent */

/* What the operations counted while a CUDA graph was captured (comm.h): one row per
 * (group, kind), added to the groups' counts again at each replay. */
typedef struct tally_row {
    moe_comm *c;
    moe_comm_op op;
    unsigned long long bytes, calls;
} tally_row;

struct moe_comm_tally {
    tally_row *rows;
    int n, cap;
};

static moe_comm_tally *g_recording; /* the capture in progress, or NULL (one host thread) */

static void record(moe_comm_tally *r, moe_comm *c, moe_comm_op op, unsigned long long bytes) {
    for (int i = 0; i < r->n; i++)
        if (r->rows[i].c == c && r->rows[i].op == op) {
            r->rows[i].bytes += bytes;
            r->rows[i].calls++;
            return;
        }
    if (r->n == r->cap) {
        const int cap = r->cap ? 2 * r->cap : 8;
        tally_row *rows = realloc(r->rows, sizeof *rows * (size_t)cap);
        MOE_ASSERT(rows);
        r->rows = rows;
        r->cap = cap;
    }
    r->rows[r->n++] = (tally_row){c, op, bytes, 1};
}

/* One operation's payload, in comm.h's convention. */
static void tally(moe_comm *c, moe_comm_op op, size_t elements, moe_dtype t) {
    const unsigned long long bytes = (unsigned long long)elements * moe_dtype_size(t);
    c->sent.bytes[op] += bytes;
    c->sent.calls[op]++;
    if (g_recording)
        record(g_recording, c, op, bytes);
}

void moe_comm_tally_begin(void) {
    MOE_ASSERT(!g_recording);
    g_recording = calloc(1, sizeof *g_recording);
    MOE_ASSERT(g_recording);
}

moe_comm_tally *moe_comm_tally_end(void) {
    moe_comm_tally *r = g_recording;
    g_recording = NULL;
    if (r && r->n == 0) {
        moe_comm_tally_free(r);
        return NULL;
    }
    return r;
}

void moe_comm_tally_replay(const moe_comm_tally *r) {
    for (int i = 0; r && i < r->n; i++) {
        r->rows[i].c->sent.bytes[r->rows[i].op] += r->rows[i].bytes;
        r->rows[i].c->sent.calls[r->rows[i].op] += r->rows[i].calls;
    }
}

void moe_comm_tally_track(const moe_comm_tally *r, const char *op) {
    for (int i = 0; r && i < r->n; i++) {
        int seen = 0; /* each group once */
        for (int j = 0; j < i; j++)
            seen |= r->rows[j].c == r->rows[i].c;
        if (!seen)
            moe_comm_track(r->rows[i].c, op);
    }
}

void moe_comm_tally_free(moe_comm_tally *r) {
    if (r)
        free(r->rows);
    free(r);
}

/* Elements of an all-to-all addressed to other ranks. */
static size_t to_others(const moe_comm *c, const size_t *counts) {
    size_t n = 0;
    for (int p = 0; p < c->size; p++)
        n += p == c->rank ? 0 : counts[p];
    return n;
}

moe_comm_bytes moe_comm_bytes_sent(const moe_comm *c) { return c->sent; }

void moe_comm_bytes_reset(moe_comm *c) { memset(&c->sent, 0, sizeof c->sent); }

unsigned long long moe_comm_bytes_data(const moe_comm_bytes *b) {
    unsigned long long n = 0;
    for (int op = 0; op < MOE_COMM_OP_COUNT; op++)
        n += op == MOE_COMM_OP_HOST ? 0 : b->bytes[op];
    return n;
}

const char *moe_comm_op_name(moe_comm_op op) {
    static const char *const names[MOE_COMM_OP_COUNT] = {
        "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "send", "host"};
    return op >= 0 && op < MOE_COMM_OP_COUNT ? names[op] : "?";
}

/* ============================================================ transport buffers */

void moe_comm_all_reduce_sum(moe_comm *c, void *buf, size_t count, moe_dtype t) {
    check_sum(c, t, "all_reduce_sum");
    tally(c, MOE_COMM_OP_ALL_REDUCE, count, t);
    c->data->all_reduce_sum(c->data_state, buf, count, t);
}

void moe_comm_all_reduce_max(moe_comm *c, void *buf, size_t count, moe_dtype t) {
    if (t != MOE_DTYPE_I32)
        moe_comm_fatal(c, "all_reduce_max on %s: only MOE_DTYPE_I32 is supported",
                       moe_comm_dtype_name(t));
    tally(c, MOE_COMM_OP_ALL_REDUCE, count, t);
    c->data->all_reduce_max(c->data_state, buf, count, t);
}

void moe_comm_all_gather(moe_comm *c, const void *send, void *recv, size_t count, moe_dtype t) {
    tally(c, MOE_COMM_OP_ALL_GATHER, count, t);
    c->data->all_gather(c->data_state, send, recv, count, t);
}

void moe_comm_all_gather_v(moe_comm *c, const void *send, void *recv, const size_t *counts,
                           moe_dtype t) {
    tally(c, MOE_COMM_OP_ALL_GATHER, counts[c->rank], t);
    c->data->all_gather_v(c->data_state, send, recv, counts, t);
}

void moe_comm_reduce_scatter_sum(moe_comm *c, const void *send, void *recv, size_t count,
                                 moe_dtype t) {
    check_sum(c, t, "reduce_scatter_sum");
    tally(c, MOE_COMM_OP_REDUCE_SCATTER, (size_t)c->size * count, t);
    c->data->reduce_scatter_sum(c->data_state, send, recv, count, t);
}

void moe_comm_all_to_all_v(moe_comm *c, const void *send, const size_t *send_counts, void *recv,
                           const size_t *recv_counts, moe_dtype t) {
    tally(c, MOE_COMM_OP_ALL_TO_ALL, to_others(c, send_counts), t);
    c->data->all_to_all_v(c->data_state, send, send_counts, recv, recv_counts, t);
}

/* what an exchange sends to other ranks (its own chunks are copies) */
static size_t chunks_to_others(const moe_comm *c, const moe_comm_chunk *sends, int n_sends) {
    size_t n = 0;
    for (int i = 0; i < n_sends; i++)
        n += sends[i].peer == c->rank ? 0 : sends[i].count;
    return n;
}

void moe_comm_exchange(moe_comm *c, const void *send, const moe_comm_chunk *sends, int n_sends,
                       void *recv, const moe_comm_chunk *recvs, int n_recvs, moe_dtype t) {
    tally(c, MOE_COMM_OP_ALL_TO_ALL, chunks_to_others(c, sends, n_sends), t);
    c->data->exchange(c->data_state, send, sends, n_sends, recv, recvs, n_recvs, t);
}

int moe_comm_exchange_start(moe_comm *c, const void *send, const moe_comm_chunk *sends,
                            int n_sends, void *recv, const moe_comm_chunk *recvs, int n_recvs,
                            moe_dtype t) {
    if (!c->data->exchange_start) { /* nothing to overlap with: complete it now */
        moe_comm_exchange(c, send, sends, n_sends, recv, recvs, n_recvs, t);
        return -1;
    }
    tally(c, MOE_COMM_OP_ALL_TO_ALL, chunks_to_others(c, sends, n_sends), t);
    return c->data->exchange_start(c->data_state, send, sends, n_sends, recv, recvs, n_recvs, t);
}

void moe_comm_exchange_finish(moe_comm *c, int handle) {
    if (handle >= 0)
        c->data->exchange_finish(c->data_state, handle);
}

void moe_comm_send(moe_comm *c, const void *buf, size_t count, moe_dtype t, int peer) {
    check_peer(c, peer, "moe_comm_send");
    tally(c, MOE_COMM_OP_SEND, count, t);
    c->data->send(c->data_state, buf, count, t, peer);
}

void moe_comm_recv(moe_comm *c, void *buf, size_t count, moe_dtype t, int peer) {
    check_peer(c, peer, "moe_comm_recv");
    c->data->recv(c->data_state, buf, count, t, peer);
}

void moe_comm_barrier(moe_comm *c) { c->data->barrier(c->data_state); }

void moe_comm_wait(moe_comm *c) {
    if (c->data->wait)
        c->data->wait(c->data_state);
}

void moe_comm_track(moe_comm *c, const char *op) {
    if (c->data->track)
        c->data->track(c->data_state, op);
}

/* ============================================================ shared GPU memory */

int moe_comm_peer_access(moe_comm *c, char *why, size_t why_len) {
    snprintf(why, why_len, "this build's transport shares no memory between ranks");
    const moe_comm_transport *tp = c->data;
    if (!tp->peer_access)
        return 0;
    /* every rank must take the same branch into the collective device-communicator
     * creation, so agree on the local checks first, then on the outcome */
    char mine[256] = "";
    int ok = tp->device_api(mine, sizeof mine);
    if (moe_comm_host_max(c, ok ? 0.0 : 1.0) > 0) {
        snprintf(why, why_len, "%s", ok ? "another rank cannot use NCCL's device API" : mine);
        return 0;
    }
    ok = tp->peer_access(c->data_state, MOE_COMM_PEER_CTAS, mine, sizeof mine);
    if (moe_comm_host_max(c, ok ? 0.0 : 1.0) > 0) {
        snprintf(why, why_len, "%s", ok ? "another rank cannot reach its peers' memory" : mine);
        return 0;
    }
    return 1;
}

const void *moe_comm_device_comm(moe_comm *c) {
    return c && c->data->device_comm ? c->data->device_comm(c->data_state) : NULL;
}

void moe_comm_sym_reserve(moe_comm *c, moe_sym_buf *b, size_t bytes) {
    if (b->ptr && b->bytes >= bytes)
        return;
    /* whole 2 MiB pages of the GPU's virtual memory: ncclMemAlloc maps whole pages
     * anyway, and the rest of the last one is free headroom */
    const size_t page = (size_t)2 << 20;
    bytes = (bytes + page - 1) / page * page;
    if (!c->data->sym_alloc)
        moe_comm_abort(NULL, 1, "moe_comm_sym_reserve: this transport has no shared memory");
    /* GPU ranks: NCCL's device communicator registers the window */
    MOE_ASSERT(!c->data->device_comm || moe_comm_device_comm(c));
    moe_comm_sym_free(b);
    c->data->sym_alloc(c->data_state, bytes, &b->ptr, &b->window);
    b->bytes = bytes;
    b->comm = c;
}

int moe_comm_sym_on_host(const moe_sym_buf *b) {
    return b->comm && b->comm->data->sym_put != NULL;
}

void moe_comm_sym_put(moe_sym_buf *b, int peer, size_t offset, const void *src, size_t bytes) {
    MOE_ASSERT(moe_comm_sym_on_host(b) && offset + bytes <= b->bytes);
    if (peer != b->comm->rank)
        tally(b->comm, MOE_COMM_OP_ALL_TO_ALL, bytes, MOE_DTYPE_BYTE);
    b->comm->data->sym_put(b->comm->data_state, b->window, peer, offset, src, bytes);
}

void moe_comm_sym_get(moe_sym_buf *b, int peer, size_t offset, void *dst, size_t bytes) {
    MOE_ASSERT(moe_comm_sym_on_host(b) && offset + bytes <= b->bytes);
    b->comm->data->sym_get(b->comm->data_state, b->window, peer, offset, dst, bytes);
}

void moe_comm_sym_fence(moe_sym_buf *b) {
    MOE_ASSERT(moe_comm_sym_on_host(b));
    b->comm->data->sym_fence(b->comm->data_state, b->window);
}

void moe_comm_sym_free(moe_sym_buf *b) {
    if (b->ptr)
        b->comm->data->sym_free(b->comm->data_state, b->ptr, b->window);
    memset(b, 0, sizeof *b);
}

/* ============================================================ host control data */

void moe_comm_host_all_reduce_sum(moe_comm *c, void *buf, size_t count, moe_dtype t) {
    check_sum(c, t, "all_reduce_sum");
    tally(c, MOE_COMM_OP_HOST, count, t);
    host_transport()->all_reduce_sum(c->host, buf, count, t);
}

void moe_comm_host_all_gather(moe_comm *c, const void *send, void *recv, size_t count,
                              moe_dtype t) {
    tally(c, MOE_COMM_OP_HOST, count, t);
    host_transport()->all_gather(c->host, send, recv, count, t);
}

double moe_comm_host_max(moe_comm *c, double v) {
    tally(c, MOE_COMM_OP_HOST, 1, MOE_DTYPE_F64);
    return host_transport()->max(c->host, v);
}

void moe_comm_host_broadcast(moe_comm *c, void *buf, size_t bytes, int root) {
    host_transport()->broadcast(c->host, buf, bytes, root);
}

int moe_comm_node_rank(moe_comm *c) { return host_transport()->node_rank(c->host); }
