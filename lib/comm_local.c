/*
 * The local transport (comm_transport.h): a group of one rank, where every collective is
 * a copy from the send buffer to the receive buffer, or nothing at all.
 *
 * It serves twice. As the **host** transport of a build without MPI, so single-process
 * programs run the same code as distributed ones: the world has one rank, a sum over it
 * is its own data, a gather is a copy. And as the **data** transport of GPU ranks in a
 * build without NCCL, where the copies are device-to-device: only on one rank, since
 * GPUs of different processes need NCCL to talk.
 *
 * The copies go through the backend's op table (backend.h): memcpy for host memory,
 * cudaMemcpyAsync on the CUDA stream for device memory. So this file, like all of lib/,
 * knows nothing of CUDA.
 */
#include <stdio.h>
#include <stdlib.h>

#include "backend.h"
#include "comm_transport.h"

typedef struct local_state {
    const moe_backend *be; /* whose copy moves the data */
} local_state;

static local_state g_host;   /* host memory (the CPU backend's copy) */
static local_state g_device; /* device memory (the CUDA backend's copy) */

static void copy(void *s, void *dst, const void *src, size_t bytes) {
    if (bytes && dst != src)
        ((local_state *)s)->be->copy(dst, src, bytes);
}

/* ------------------------------------------------------------ a group's state */

static int local_start(int *argc, char ***argv, void **state, char *why, size_t why_len) {
    (void)argc, (void)argv, (void)why, (void)why_len;
    g_host.be = moe_backend_cpu();
    *state = &g_host;
    return 0;
}

static int local_open(moe_comm *world, void **state, char *why, size_t why_len) {
    if (moe_comm_size(world) > 1) {
        snprintf(why, why_len,
                 "--device cuda with %d ranks: GPU ranks communicate through NCCL, and this "
                 "build has none (the Makefile enables it when nvcc, mpicc and nccl.h are all "
                 "found); install NCCL (libnccl-dev) and rebuild, run on one rank, or use "
                 "--device cpu",
                 moe_comm_size(world));
        return 1;
    }
    moe_error err;
    if (moe_backend_select("cuda", &g_device.be, &err) != MOE_OK) {
        snprintf(why, why_len, "%s", err.msg);
        return 1;
    }
    *state = &g_device;
    return 0;
}

static void *local_split(void *parent, int color, int key) {
    (void)color, (void)key;
    return parent; /* a split of one rank is that rank */
}

static void local_shape(const void *s, int *rank, int *size) {
    (void)s;
    *rank = 0;
    *size = 1;
}

static void local_free(void *s) { (void)s; }

static void local_abort(int code) { exit(code); }

/* ------------------------------------------------------------ transport buffers */

static void local_all_reduce_sum(void *s, void *buf, size_t count, moe_dtype t) {
    (void)s, (void)buf, (void)count, (void)t; /* the sum over one rank is its own data */
}

static void local_all_reduce_max(void *s, void *buf, size_t count, moe_dtype t) {
    (void)s, (void)buf, (void)count, (void)t; /* the maximum over one rank is its own data */
}

static void local_all_gather(void *s, const void *send, void *recv, size_t count, moe_dtype t) {
    copy(s, recv, send, count * moe_dtype_size(t));
}

static void local_all_gather_v(void *s, const void *send, void *recv, const size_t *counts,
                               moe_dtype t) {
    copy(s, recv, send, counts[0] * moe_dtype_size(t));
}

static void local_reduce_scatter_sum(void *s, const void *send, void *recv, size_t count,
                                     moe_dtype t) {
    copy(s, recv, send, count * moe_dtype_size(t));
}

static void local_all_to_all_v(void *s, const void *send, const size_t *send_counts, void *recv,
                               const size_t *recv_counts, moe_dtype t) {
    if (send_counts[0] != recv_counts[0])
        moe_comm_fatal(NULL, "all_to_all_v: one rank sends %zu elements to itself but expects %zu",
                       send_counts[0], recv_counts[0]);
    copy(s, recv, send, send_counts[0] * moe_dtype_size(t));
}

void moe_comm_copy_own_chunks(int self, void (*cp)(void *, const void *, size_t),
                              const void *send, const moe_comm_chunk *sends, int n_sends,
                              void *recv, const moe_comm_chunk *recvs, int n_recvs, size_t es) {
    /* the k-th chunk this rank sends itself is the k-th it receives from itself */
    int si = 0, ri = 0;
    for (;;) {
        while (si < n_sends && (sends[si].peer != self || sends[si].count == 0))
            si++;
        while (ri < n_recvs && (recvs[ri].peer != self || recvs[ri].count == 0))
            ri++;
        if (si >= n_sends || ri >= n_recvs)
            break;
        if (sends[si].count != recvs[ri].count)
            moe_comm_fatal(NULL, "exchange: a chunk to itself of %zu elements meets a receive of %zu",
                           sends[si].count, recvs[ri].count);
        char *dst = (char *)recv + recvs[ri].offset * es;
        const char *src = (const char *)send + sends[si].offset * es;
        if (dst != src)
            cp(dst, src, sends[si].count * es);
        si++;
        ri++;
    }
}

static void local_exchange(void *s, const void *send, const moe_comm_chunk *sends, int n_sends,
                           void *recv, const moe_comm_chunk *recvs, int n_recvs, moe_dtype t) {
    moe_comm_copy_own_chunks(0, ((local_state *)s)->be->copy, send, sends, n_sends, recv, recvs,
                             n_recvs, moe_dtype_size(t));
}

static void local_nothing(void *s) { (void)s; } /* a barrier of one rank */

/* ------------------------------------------------------------ host control data */

static double local_max(void *s, double v) {
    (void)s;
    return v;
}

static void local_broadcast(void *s, void *buf, size_t bytes, int root) {
    (void)s, (void)buf, (void)bytes, (void)root; /* the root is this rank */
}

static int local_node_rank(void *s) {
    (void)s;
    return 0;
}

static const moe_comm_transport g_local = {
    .name = "local",
    .start = local_start, /* as the host transport: host memory */
    .open = local_open,   /* as the data transport of one GPU rank: device memory */
    .split = local_split, .shape = local_shape, .free = local_free, .abort = local_abort,
    /* sums are the data itself; gathers, scatters and exchanges copy */
    .all_reduce_sum = local_all_reduce_sum, .all_reduce_max = local_all_reduce_max, .all_gather = local_all_gather,
    .all_gather_v = local_all_gather_v, .reduce_scatter_sum = local_reduce_scatter_sum,
    .all_to_all_v = local_all_to_all_v, .exchange = local_exchange,
    .send = NULL, .recv = NULL, /* comm.c refuses them: one rank has no peer */
    .barrier = local_nothing,
    .max = local_max, .broadcast = local_broadcast, .node_rank = local_node_rank,
};

const moe_comm_transport *moe_comm_transport_local(void) { return &g_local; }
