/*
 * The communication layer (lib/comm.h) under mpirun: every collective against a closed
 * form, for any number of ranks (make test-mpi runs 1, 2 and 4).
 *
 * Buffers are "transport buffers": host memory on the MPI transport, device memory on
 * the NCCL transport (MOE_TEST_DEVICE=cuda), allocated and filled through the backend
 * table so the same test checks both paths.
 *
 * How a distributed test fails without hanging: every rank counts its own wrong elements
 * and then all ranks sum those counts (AGREE) before asserting. So either every rank
 * passes a test or every rank fails it, at the same point; a rank that left a test
 * early would leave the others waiting in the next collective forever. The first wrong
 * element of each check is printed to stderr with its rank, since only rank 0's Check
 * report is shown.
 *
 * Data is rank-dependent and every element encodes where it came from (source rank,
 * destination rank, index), so an element delivered to the wrong place, or not at all
 * (receive buffers are poisoned first), is caught.
 */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "comm.h"
#include "suites.h"

#ifdef MOE_HAVE_MPI
#include <mpi.h>
#endif

/* defined by tests/mpi_main.c: the backend whose memory functions make transport buffers
 * (CPU: host memory, CUDA: device memory). The world is moe_test_world() (suites.h). */
const moe_backend *moe_test_mpi_backend(void);

static moe_comm *W;
static const moe_backend *BE;
static int R, P;

static void setup(void) {
    W = moe_test_world();
    BE = moe_test_mpi_backend();
    R = moe_comm_rank(W);
    P = moe_comm_size(W);
}

/* ------------------------------------------------------------ helpers */

/* A transport buffer of @p bytes, filled from @p host when given. */
static void *tbuf(const void *host, size_t bytes) {
    void *p = BE->alloc(bytes ? bytes : 1);
    ck_assert_ptr_nonnull(p);
    if (host && bytes)
        BE->from_host(p, host, bytes);
    return p;
}

/* Copy a transport buffer back to the host. */
static void tread(void *host, const void *t, size_t bytes) {
    if (bytes)
        BE->to_host(host, t, bytes);
}

static void *xmalloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    ck_assert_ptr_nonnull(p);
    return p;
}

/* Count one wrong element; print the first of each check. */
static long long miss(long long bad, const char *what, size_t i, double got, double want) {
    if (bad == 0)
        fprintf(stderr, "[rank %d] %s: element %zu is %.17g, expected %.17g\n", R, what, i, got,
                want);
    return bad + 1;
}

/* Fail on every rank when any rank counted a wrong element (see the top of the file). */
#define AGREE(bad, what)                                                                     \
    do {                                                                                     \
        long long mine_ = (bad), all_ = mine_;                                               \
        moe_comm_host_all_reduce_sum(W, &all_, 1, MOE_DTYPE_I64);                            \
        ck_assert_msg(all_ == 0, "%s: %lld wrong over all %d ranks (%lld on rank %d)", what, \
                      all_, P, mine_, R);                                                    \
    } while (0)

/* ------------------------------------------------------------ tests */

START_TEST(test_dtype_sizes) {
    ck_assert_uint_eq(moe_dtype_size(MOE_DTYPE_F32), 4);
    ck_assert_uint_eq(moe_dtype_size(MOE_DTYPE_F64), 8);
    ck_assert_uint_eq(moe_dtype_size(MOE_DTYPE_BF16), 2);
    ck_assert_uint_eq(moe_dtype_size(MOE_DTYPE_I32), 4);
    ck_assert_uint_eq(moe_dtype_size(MOE_DTYPE_I64), 8);
    ck_assert_uint_eq(moe_dtype_size(MOE_DTYPE_BYTE), 1);
}
END_TEST

START_TEST(test_world_shape) {
    long long bad = 0;
    if (R < 0 || R >= P)
        bad = miss(bad, "rank in [0, size)", 0, R, 0);
    if (moe_comm_world_rank(W) != R)
        bad = miss(bad, "world_rank of the world", 0, moe_comm_world_rank(W), R);
    if (moe_comm_device(W) != BE->device)
        bad = miss(bad, "device", 0, moe_comm_device(W), BE->device);
#ifdef MOE_HAVE_MPI
    int mpi_size = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &mpi_size);
    if (mpi_size != P)
        bad = miss(bad, "size == MPI_COMM_WORLD's", 0, P, mpi_size);
#else
    if (P != 1)
        bad = miss(bad, "size without MPI", 0, P, 1);
#endif
    /* the ranks are a permutation of 0..P-1: each rank appears exactly once */
    int *all = xmalloc((size_t)P * sizeof(int));
    moe_comm_host_all_gather(W, &R, all, 1, MOE_DTYPE_I32);
    for (int q = 0; q < P; q++)
        if (all[q] != q)
            bad = miss(bad, "gathered ranks", (size_t)q, all[q], q);
    free(all);
    AGREE(bad, "world shape");
}
END_TEST

START_TEST(test_all_reduce_sum) {
    const size_t n = 1031;
    const long long tri = (long long)P * (P - 1) / 2, tri1 = (long long)P * (P + 1) / 2;
    float *f = xmalloc(n * sizeof *f);
    double *d = xmalloc(n * sizeof *d);
    int32_t *i32 = xmalloc(n * sizeof *i32);
    int64_t *i64 = xmalloc(n * sizeof *i64);
    for (size_t i = 0; i < n; i++) { /* exact in every type, so the sums are exact */
        f[i] = (float)R + 0.25f * (float)i;
        d[i] = (double)(R + 1) * (double)(i + 1);
        i32[i] = R * 100000 + (int32_t)i;
        i64[i] = ((int64_t)(R + 1) << 33) + (int64_t)i; /* needs all 64 bits */
    }
    void *tf = tbuf(f, n * sizeof *f), *td = tbuf(d, n * sizeof *d);
    void *ti32 = tbuf(i32, n * sizeof *i32), *ti64 = tbuf(i64, n * sizeof *i64);
    moe_comm_all_reduce_sum(W, tf, n, MOE_DTYPE_F32);
    moe_comm_all_reduce_sum(W, td, n, MOE_DTYPE_F64);
    moe_comm_all_reduce_sum(W, ti32, n, MOE_DTYPE_I32);
    moe_comm_all_reduce_sum(W, ti64, n, MOE_DTYPE_I64);
    moe_comm_all_reduce_sum(W, td, 0, MOE_DTYPE_F64); /* zero elements: nothing happens */
    moe_comm_wait(W); /* NCCL enqueued them all; the backend's to_host would wait too */
    tread(f, tf, n * sizeof *f);
    tread(d, td, n * sizeof *d);
    tread(i32, ti32, n * sizeof *i32);
    tread(i64, ti64, n * sizeof *i64);
    long long bad = 0, bf = 0, bd = 0, b32 = 0, b64 = 0;
    for (size_t i = 0; i < n; i++) {
        double wf = (double)tri + (double)P * 0.25 * (double)i;
        double wd = (double)tri1 * (double)(i + 1);
        long long w32 = tri * 100000 + (long long)P * (long long)i;
        long long w64 = (tri1 << 33) + (long long)P * (long long)i;
        if ((double)f[i] != wf)
            bf = miss(bf, "all_reduce_sum F32", i, f[i], wf);
        if (d[i] != wd)
            bd = miss(bd, "all_reduce_sum F64", i, d[i], wd);
        if (i32[i] != w32)
            b32 = miss(b32, "all_reduce_sum I32", i, i32[i], (double)w32);
        if (i64[i] != w64)
            b64 = miss(b64, "all_reduce_sum I64", i, (double)i64[i], (double)w64);
    }
    bad = bf + bd + b32 + b64;
    BE->free(tf), BE->free(td), BE->free(ti32), BE->free(ti64);
    free(f), free(d), free(i32), free(i64);
    AGREE(bad, "all_reduce_sum");
}
END_TEST

START_TEST(test_all_gather) {
    const size_t n = 257;
    int32_t *s32 = xmalloc(n * sizeof *s32), *r32 = xmalloc(n * (size_t)P * sizeof *r32);
    uint16_t *s16 = xmalloc(n * sizeof *s16), *r16 = xmalloc(n * (size_t)P * sizeof *r16);
    for (size_t i = 0; i < n; i++) {
        s32[i] = R * 1000000 + (int32_t)i;
        s16[i] = (uint16_t)(R * 4096 + (int)i); /* a bf16 bit pattern: moved, never read */
    }
    for (size_t i = 0; i < n * (size_t)P; i++)
        r32[i] = -1, r16[i] = 0xffff;
    void *ts32 = tbuf(s32, n * 4), *tr32 = tbuf(r32, n * (size_t)P * 4);
    void *ts16 = tbuf(s16, n * 2), *tr16 = tbuf(r16, n * (size_t)P * 2);
    moe_comm_all_gather(W, ts32, tr32, n, MOE_DTYPE_I32);
    moe_comm_all_gather(W, ts16, tr16, n, MOE_DTYPE_BF16);
    tread(r32, tr32, n * (size_t)P * 4);
    tread(r16, tr16, n * (size_t)P * 2);
    long long b32 = 0, b16 = 0;
    for (int q = 0; q < P; q++)
        for (size_t i = 0; i < n; i++) {
            size_t k = (size_t)q * n + i;
            if (r32[k] != q * 1000000 + (int32_t)i)
                b32 = miss(b32, "all_gather I32", k, r32[k], q * 1000000 + (double)i);
            if (r16[k] != (uint16_t)(q * 4096 + (int)i))
                b16 = miss(b16, "all_gather BF16 bits", k, r16[k], q * 4096 + (double)i);
        }
    BE->free(ts32), BE->free(tr32), BE->free(ts16), BE->free(tr16);
    free(s32), free(r32), free(s16), free(r16);
    AGREE(b32 + b16, "all_gather");
}
END_TEST

/* counts[q] of all_gather_v, two ragged patterns with zero counts */
static size_t agv_count(int pattern, int q) {
    if (pattern == 0)
        return q % 3 == 1 ? 0 : (size_t)(3 * q + 2); /* some ranks send nothing */
    return q == 0 ? 0 : (size_t)(5 + q);             /* rank 0 sends nothing (P=1: nobody) */
}

START_TEST(test_all_gather_v) {
    long long bad = 0;
    for (int pattern = 0; pattern < 2; pattern++) {
        size_t *counts = xmalloc((size_t)P * sizeof *counts), total = 0;
        for (int q = 0; q < P; q++)
            total += counts[q] = agv_count(pattern, q);
        double *send = xmalloc(counts[R] * sizeof *send), *recv = xmalloc(total * sizeof *recv);
        for (size_t i = 0; i < counts[R]; i++)
            send[i] = R * 10000.0 + (double)i;
        for (size_t i = 0; i < total; i++)
            recv[i] = -1.0;
        void *ts = tbuf(send, counts[R] * 8), *tr = tbuf(recv, total * 8);
        moe_comm_all_gather_v(W, ts, tr, counts, MOE_DTYPE_F64);
        tread(recv, tr, total * 8);
        long long b = 0;
        size_t k = 0;
        for (int q = 0; q < P; q++)
            for (size_t i = 0; i < counts[q]; i++, k++)
                if (recv[k] != q * 10000.0 + (double)i)
                    b = miss(b, pattern ? "all_gather_v (rank 0 empty)" : "all_gather_v", k,
                             recv[k], q * 10000.0 + (double)i);
        bad += b;
        BE->free(ts), BE->free(tr);
        free(send), free(recv), free(counts);
    }
    AGREE(bad, "all_gather_v");
}
END_TEST

START_TEST(test_reduce_scatter_sum) {
    const size_t n = 333;
    const double tri1 = (double)P * (P + 1) / 2;
    float *sf = xmalloc(n * (size_t)P * sizeof *sf), *rf = xmalloc(n * sizeof *rf);
    double *sd = xmalloc(n * (size_t)P * sizeof *sd), *rd = xmalloc(n * sizeof *rd);
    for (size_t j = 0; j < n * (size_t)P; j++) {
        sf[j] = (float)(R + 1) * (float)(j + 1);
        sd[j] = (double)(R + 1) * (double)(j + 1) + 0.5;
    }
    for (size_t i = 0; i < n; i++)
        rf[i] = -1.0f, rd[i] = -1.0;
    void *tsf = tbuf(sf, n * (size_t)P * 4), *trf = tbuf(rf, n * 4);
    void *tsd = tbuf(sd, n * (size_t)P * 8), *trd = tbuf(rd, n * 8);
    moe_comm_reduce_scatter_sum(W, tsf, trf, n, MOE_DTYPE_F32);
    moe_comm_reduce_scatter_sum(W, tsd, trd, n, MOE_DTYPE_F64);
    tread(rf, trf, n * 4);
    tread(rd, trd, n * 8);
    long long bf = 0, bd = 0;
    for (size_t i = 0; i < n; i++) {
        double j1 = (double)((size_t)R * n + i + 1); /* this rank's block */
        if ((double)rf[i] != tri1 * j1)
            bf = miss(bf, "reduce_scatter_sum F32", i, rf[i], tri1 * j1);
        if (rd[i] != tri1 * j1 + 0.5 * P)
            bd = miss(bd, "reduce_scatter_sum F64", i, rd[i], tri1 * j1 + 0.5 * P);
    }
    BE->free(tsf), BE->free(trf), BE->free(tsd), BE->free(trd);
    free(sf), free(rf), free(sd), free(rd);
    AGREE(bf + bd, "reduce_scatter_sum");
}
END_TEST

/*
 * Elements rank s sends to rank d. Ragged (0, 11, 22 or 33), with zero pairs, and the
 * last rank sends everything it has (`big` elements) to rank 0: the skewed routing an MoE
 * dispatcher sees when every token of a rank picks experts on one peer. Every other rank
 * keeps a share for itself ((3s + 5s + 1) mod 4 = 1), so the local copy is checked too.
 * big = 0 asks for the balanced case instead: 7 elements between every pair.
 */
static size_t a2a_count(int s, int d, size_t big) {
    if (big == 0)
        return 7; /* the balanced case: equal counts, so only the order tells peers apart */
    if (s == P - 1)
        return d == 0 ? big : 0;
    return (size_t)((3 * s + 5 * d + 1) % 4) * 11;
}

static int64_t a2a_value(int s, int d, size_t i) {
    return (int64_t)s * 1000000000LL + (int64_t)d * 1000000LL + (int64_t)i;
}

static uint16_t a2a_bits(int s, int d, size_t i) { /* 4 bits each: s, d, then index */
    return (uint16_t)((s << 12) | (d << 8) | (int)(i & 0xff));
}

/* One all_to_all_v of I64 (values) or BF16 (bit patterns); returns wrong elements. */
static long long run_a2a(moe_dtype t, size_t big) {
    const size_t es = moe_dtype_size(t);
    size_t *sc = xmalloc((size_t)P * sizeof *sc), *rc = xmalloc((size_t)P * sizeof *rc);
    size_t stot = 0, rtot = 0;
    for (int q = 0; q < P; q++) {
        stot += sc[q] = a2a_count(R, q, big);
        rtot += rc[q] = a2a_count(q, R, big);
    }
    char *send = xmalloc(stot * es), *recv = xmalloc(rtot * es);
    size_t k = 0;
    for (int d = 0; d < P; d++)
        for (size_t i = 0; i < sc[d]; i++, k++) {
            if (t == MOE_DTYPE_I64) {
                int64_t v = a2a_value(R, d, i);
                memcpy(send + k * es, &v, es);
            } else {
                uint16_t v = a2a_bits(R, d, i);
                memcpy(send + k * es, &v, es);
            }
        }
    memset(recv, 0xff, rtot * es); /* poison: -1 / 0xffff is never a valid element */
    void *ts = tbuf(send, stot * es), *tr = tbuf(recv, rtot * es);
    moe_comm_all_to_all_v(W, ts, sc, tr, rc, t);
    tread(recv, tr, rtot * es);
    long long bad = 0;
    k = 0;
    for (int s = 0; s < P; s++)
        for (size_t i = 0; i < rc[s]; i++, k++) {
            if (t == MOE_DTYPE_I64) {
                int64_t v;
                memcpy(&v, recv + k * es, es);
                if (v != a2a_value(s, R, i))
                    bad = miss(bad, "all_to_all_v I64", k, (double)v, (double)a2a_value(s, R, i));
            } else {
                uint16_t v;
                memcpy(&v, recv + k * es, es);
                if (v != a2a_bits(s, R, i))
                    bad = miss(bad, "all_to_all_v BF16 bits", k, v, a2a_bits(s, R, i));
            }
        }
    BE->free(ts), BE->free(tr);
    free(send), free(recv), free(sc), free(rc);
    return bad;
}

START_TEST(test_all_to_all_v) {
    long long bad = run_a2a(MOE_DTYPE_I64, (size_t)1 << 17); /* 1 MiB from the last rank */
    bad += run_a2a(MOE_DTYPE_BF16, 40);
    bad += run_a2a(MOE_DTYPE_I64, 0);
    AGREE(bad, "all_to_all_v");
}
END_TEST

START_TEST(test_send_recv_ring) {
    /* each rank passes a message to the next; even ranks send first and odd ranks receive
     * first, so blocking sends of large messages cannot wait on each other in a cycle.
     * One rank has no peer: nothing to send (sending to oneself is refused). */
    long long bad = 0;
    if (P > 1) {
        const int next = (R + 1) % P, prev = (R + P - 1) % P;
        for (int round = 0; round < 2; round++) {
            const size_t n = round == 0 ? 3 : (size_t)1 << 15; /* eager and rendezvous sizes */
            double *out = xmalloc(n * sizeof *out), *in = xmalloc(n * sizeof *in);
            for (size_t i = 0; i < n; i++)
                out[i] = R * 1e6 + (double)i, in[i] = -1.0;
            void *to = tbuf(out, n * 8), *ti = tbuf(in, n * 8);
            if (R % 2 == 0) {
                moe_comm_send(W, to, n, MOE_DTYPE_F64, next);
                moe_comm_recv(W, ti, n, MOE_DTYPE_F64, prev);
            } else {
                moe_comm_recv(W, ti, n, MOE_DTYPE_F64, prev);
                moe_comm_send(W, to, n, MOE_DTYPE_F64, next);
            }
            tread(in, ti, n * 8);
            long long b = 0;
            for (size_t i = 0; i < n; i++)
                if (in[i] != prev * 1e6 + (double)i)
                    b = miss(b, "ring recv", i, in[i], prev * 1e6 + (double)i);
            bad += b;
            BE->free(to), BE->free(ti);
            free(out), free(in);
        }
    }
    AGREE(bad, "send/recv ring");
}
END_TEST

START_TEST(test_exchange_in_flight) {
    /* two ring exchanges in flight at once on one group (each rank sends to the next and
     * receives from the previous), eager and rendezvous sizes, different data; the second
     * is finished first; then everything must have landed where it belongs. Where the
     * transport cannot start one (one rank: copies), start completes it and returns -1. */
    long long bad = 0;
    const int next = (R + 1) % P, prev = (R + P - 1) % P;
    const size_t n[2] = {5, (size_t)1 << 15};
    double *out[2], *in[2];
    void *to[2], *ti[2];
    int h[2];
    for (int j = 0; j < 2; j++) {
        out[j] = xmalloc(n[j] * sizeof(double)), in[j] = xmalloc(n[j] * sizeof(double));
        for (size_t i = 0; i < n[j]; i++)
            out[j][i] = R * 1e6 + (double)i + 0.5 * j, in[j][i] = -1.0;
        to[j] = tbuf(out[j], n[j] * 8), ti[j] = tbuf(in[j], n[j] * 8);
    }
    for (int j = 0; j < 2; j++) {
        const moe_comm_chunk cs = {0, n[j], next}, cr = {0, n[j], prev};
        h[j] = moe_comm_exchange_start(W, to[j], &cs, 1, ti[j], &cr, 1, MOE_DTYPE_F64);
    }
    /* both complete already (-1), or two different handles in range */
    const int handles_ok = (h[0] == -1 && h[1] == -1) ||
                           (h[0] >= 0 && h[1] >= 0 && h[0] != h[1] &&
                            h[0] < MOE_COMM_MAX_PENDING && h[1] < MOE_COMM_MAX_PENDING);
    if (!handles_ok)
        bad = miss(bad, "exchange handles", 0, h[0], h[1]);
    moe_comm_exchange_finish(W, h[1]);
    moe_comm_exchange_finish(W, h[0]);
    for (int j = 0; j < 2; j++) {
        tread(in[j], ti[j], n[j] * 8);
        for (size_t i = 0; i < n[j]; i++) {
            const double want = prev * 1e6 + (double)i + 0.5 * j;
            if (in[j][i] != want)
                bad = miss(bad, "exchange in flight", i, in[j][i], want);
        }
        BE->free(to[j]), BE->free(ti[j]);
        free(out[j]), free(in[j]);
    }
    AGREE(bad, "two exchanges in flight");
}
END_TEST

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

START_TEST(test_barrier) {
    /* rank 0 arrives 0.5 s late: every other rank must wait for it. The host max first
     * lines the ranks up (it is an MPI all-reduce, independent of the barrier under test). */
    const double delay = 0.5;
    long long bad = 0;
    (void)moe_comm_host_max(W, 0.0);
    double t0 = now_s();
    if (R == 0) {
        struct timespec ts = {0, (long)(delay * 1e9)};
        nanosleep(&ts, NULL);
    }
    moe_comm_barrier(W);
    double waited = now_s() - t0;
    if (R != 0 && waited < 0.5 * delay)
        bad = miss(bad, "seconds waited in the barrier", 0, waited, delay);
    for (int i = 0; i < 10; i++) /* and back to back */
        moe_comm_barrier(W);
    AGREE(bad, "barrier");
}
END_TEST

START_TEST(test_split_even_odd) {
    /* color = parity, key = -rank: each group is ordered by DEScending world rank */
    moe_comm *sub = NULL;
    moe_error err;
    ck_assert_int_eq(moe_comm_split(W, R % 2, -R, &sub, &err), MOE_OK);
    int want_size = 0, want_rank = 0;
    double want_sum = 0;
    for (int q = R % 2; q < P; q += 2) {
        want_size++;
        want_rank += q > R;
        want_sum += q + 1;
    }
    long long bad = 0;
    if (moe_comm_size(sub) != want_size)
        bad = miss(bad, "group size", 0, moe_comm_size(sub), want_size);
    if (moe_comm_rank(sub) != want_rank)
        bad = miss(bad, "group rank", 0, moe_comm_rank(sub), want_rank);
    if (moe_comm_world_rank(sub) != R)
        bad = miss(bad, "world_rank of a group", 0, moe_comm_world_rank(sub), R);
    if (moe_comm_device(sub) != moe_comm_device(W))
        bad = miss(bad, "group device", 0, moe_comm_device(sub), moe_comm_device(W));
    AGREE(bad, "split: shape");

    /* collectives inside the group see only its ranks, in the group's order */
    const int gs = moe_comm_size(sub);
    double v = R + 1;
    void *tv = tbuf(&v, 8);
    moe_comm_all_reduce_sum(sub, tv, 1, MOE_DTYPE_F64);
    tread(&v, tv, 8);
    if (v != want_sum)
        bad = miss(bad, "sum inside the group", 0, v, want_sum);
    int32_t me = R, *got = xmalloc((size_t)gs * sizeof *got);
    void *tme = tbuf(&me, 4), *tgot = tbuf(NULL, (size_t)gs * 4);
    moe_comm_all_gather(sub, tme, tgot, 1, MOE_DTYPE_I32);
    tread(got, tgot, (size_t)gs * 4);
    for (int j = 0; j < gs; j++) {
        int want = (P - 1 - (P - 1 - R % 2) % 2) - 2 * j; /* largest rank of the parity first */
        if (got[j] != want)
            bad = miss(bad, "world ranks gathered in the group", (size_t)j, got[j], want);
    }
    moe_comm_barrier(sub);

    /* a split of a split: singletons. Not freed here: moe_comm_finalize frees it. */
    moe_comm *one = NULL;
    ck_assert_int_eq(moe_comm_split(sub, moe_comm_rank(sub), 0, &one, &err), MOE_OK);
    if (moe_comm_size(one) != 1 || moe_comm_rank(one) != 0)
        bad = miss(bad, "singleton group", 0, moe_comm_size(one), 1);
    moe_comm_all_reduce_sum(one, tv, 1, MOE_DTYPE_F64);

    BE->free(tv), BE->free(tme), BE->free(tgot);
    free(got);
    moe_comm_free(sub);
    AGREE(bad, "split: collectives");
}
END_TEST

START_TEST(test_split_bad_color) {
    /* every rank passes the same bad color, so every rank returns without communicating */
    moe_comm *sub = (moe_comm *)&sub;
    moe_error err;
    ck_assert_int_eq(moe_comm_split(W, -1, 0, &sub, &err), MOE_ERR_BACKEND);
    ck_assert_ptr_null(sub);
    ck_assert_ptr_nonnull(strstr(err.msg, "color"));
}
END_TEST

START_TEST(test_host_functions) {
    const double tri = (double)P * (P - 1) / 2;
    double d[2] = {R + 0.5, -2.0 * R};
    int64_t l = ((int64_t)1 << 40) * (R + 1);
    int32_t i = R + 1;
    float f = 0.5f * (float)R;
    moe_comm_host_all_reduce_sum(W, d, 2, MOE_DTYPE_F64);
    moe_comm_host_all_reduce_sum(W, &l, 1, MOE_DTYPE_I64);
    moe_comm_host_all_reduce_sum(W, &i, 1, MOE_DTYPE_I32);
    moe_comm_host_all_reduce_sum(W, &f, 1, MOE_DTYPE_F32);
    long long bad = 0;
    if (d[0] != tri + 0.5 * P)
        bad = miss(bad, "host sum F64", 0, d[0], tri + 0.5 * P);
    if (d[1] != -2.0 * tri)
        bad = miss(bad, "host sum F64", 1, d[1], -2.0 * tri);
    if (l != ((int64_t)1 << 40) * (int64_t)(P * (P + 1) / 2))
        bad = miss(bad, "host sum I64", 0, (double)l, ldexp(1.0, 40) * P * (P + 1) / 2);
    if (i != P * (P + 1) / 2)
        bad = miss(bad, "host sum I32", 0, i, P * (P + 1) / 2);
    if ((double)f != 0.5 * tri)
        bad = miss(bad, "host sum F32", 0, f, 0.5 * tri);

    int64_t mine[2] = {7 * R, -R}, *all = xmalloc(2 * (size_t)P * sizeof *all);
    moe_comm_host_all_gather(W, mine, all, 2, MOE_DTYPE_I64);
    for (int q = 0; q < P; q++)
        if (all[2 * q] != 7 * q || all[2 * q + 1] != -q)
            bad = miss(bad, "host all_gather I64", (size_t)q, (double)all[2 * q], 7.0 * q);
    free(all);

    double mx = moe_comm_host_max(W, R == P - 1 ? 7.5 : 0.1 * R);
    if (mx != 7.5)
        bad = miss(bad, "host max", 0, mx, 7.5);
    mx = moe_comm_host_max(W, -(double)R);
    if (mx != 0.0)
        bad = miss(bad, "host max of -rank", 0, mx, 0.0);
    AGREE(bad, "host functions");
}
END_TEST

#ifndef MOE_HAVE_CUDA
START_TEST(test_init_cuda_without_cuda) {
    /* every rank gets the same verdict, and MPI (started by the runner) stays up */
    moe_comm *w = (moe_comm *)&w;
    moe_error err;
    ck_assert_int_eq(moe_comm_init(NULL, NULL, MOE_DEVICE_CUDA, &w, &err), MOE_ERR_BACKEND);
    ck_assert_ptr_null(w);
    ck_assert_ptr_nonnull(strstr(err.msg, "--device cpu"));
    AGREE(0, "world still works after a failed init");
}
END_TEST
#endif


/* The bytes each group counts (comm.h: the logical payload this rank puts in, per kind):
 * one call of every collective on a group of its own, with a size that differs per rank,
 * and the counts must be exact. The group is the world split once more, so the checks'
 * own host all-reduces on the world are not counted in it. */
START_TEST(test_bytes_counted) {
    moe_comm *g = NULL;
    moe_error err;
    ck_assert_int_eq(moe_comm_split(W, 0, R, &g, &err), MOE_OK);
    const size_t n = 5 + (size_t)R; /* a send per rank: a count mixed up between ranks shows */
    size_t *counts = xmalloc(sizeof(size_t) * P), total = 0;
    for (int p = 0; p < P; p++)
        counts[p] = 3 + (size_t)p, total += counts[p];
    const size_t big = (size_t)P * (n + 8) + total + 64;
    void *a = tbuf(NULL, big * 8), *b = tbuf(NULL, big * 8);
    BE->zero(a, big * 8);
    BE->zero(b, big * 8);
    unsigned long long want[MOE_COMM_OP_COUNT] = {0}, calls[MOE_COMM_OP_COUNT] = {0};
    moe_comm_bytes_reset(g);

    moe_comm_all_reduce_sum(g, a, 5, MOE_DTYPE_F32); /* its whole buffer */
    want[MOE_COMM_OP_ALL_REDUCE] += 5 * 4, calls[MOE_COMM_OP_ALL_REDUCE]++;
    moe_comm_all_gather(g, a, b, 7, MOE_DTYPE_F64);
    want[MOE_COMM_OP_ALL_GATHER] += 7 * 8, calls[MOE_COMM_OP_ALL_GATHER]++;
    moe_comm_all_gather_v(g, a, b, counts, MOE_DTYPE_I32); /* its own block only */
    want[MOE_COMM_OP_ALL_GATHER] += counts[R] * 4, calls[MOE_COMM_OP_ALL_GATHER]++;
    moe_comm_reduce_scatter_sum(g, a, b, 6, MOE_DTYPE_F64); /* its whole input, P blocks */
    want[MOE_COMM_OP_REDUCE_SCATTER] += (unsigned long long)P * 6 * 8,
        calls[MOE_COMM_OP_REDUCE_SCATTER]++;
    /* all-to-all-v: rank r sends r+p+1 elements to rank p; what it keeps is not sent */
    size_t *sc = xmalloc(sizeof(size_t) * P), *rc = xmalloc(sizeof(size_t) * P);
    for (int p = 0; p < P; p++) {
        sc[p] = (size_t)(R + p + 1), rc[p] = (size_t)(p + R + 1);
        if (p != R)
            want[MOE_COMM_OP_ALL_TO_ALL] += sc[p] * 2;
    }
    calls[MOE_COMM_OP_ALL_TO_ALL]++;
    moe_comm_all_to_all_v(g, a, sc, b, rc, MOE_DTYPE_BF16);
    /* exchange: one chunk of r+p+1 elements to every rank, itself included */
    moe_comm_chunk *cs = xmalloc(sizeof *cs * P), *cr = xmalloc(sizeof *cr * P);
    size_t so = 0, ro = 0;
    for (int p = 0; p < P; p++) {
        cs[p] = (moe_comm_chunk){so, sc[p], p};
        cr[p] = (moe_comm_chunk){ro, rc[p], p};
        so += sc[p], ro += rc[p];
        if (p != R)
            want[MOE_COMM_OP_ALL_TO_ALL] += sc[p] * 8;
    }
    calls[MOE_COMM_OP_ALL_TO_ALL]++;
    moe_comm_exchange(g, a, cs, P, b, cr, P, MOE_DTYPE_I64);
    /* send/recv around the ring: the sender counts, the receiver does not */
    if (P > 1) {
        const int next = (R + 1) % P, prev = (R + P - 1) % P;
        if (R % 2 == 0) {
            moe_comm_send(g, a, n, MOE_DTYPE_F64, next);
            moe_comm_recv(g, b, 5 + (size_t)prev, MOE_DTYPE_F64, prev);
        } else {
            moe_comm_recv(g, b, 5 + (size_t)prev, MOE_DTYPE_F64, prev);
            moe_comm_send(g, a, n, MOE_DTYPE_F64, next);
        }
        want[MOE_COMM_OP_SEND] += n * 8, calls[MOE_COMM_OP_SEND]++;
    }
    /* host control data */
    double h[3] = {1, 2, 3}, hg[3 * 64];
    moe_comm_host_all_reduce_sum(g, h, 3, MOE_DTYPE_F64);
    moe_comm_host_all_gather(g, h, hg, 1, MOE_DTYPE_F64);
    (void)moe_comm_host_max(g, 1.0);
    want[MOE_COMM_OP_HOST] += 3 * 8 + 8 + 8, calls[MOE_COMM_OP_HOST] += 3;
    moe_comm_wait(g);

    moe_comm_bytes got = moe_comm_bytes_sent(g);
    long long bad = 0;
    unsigned long long data = 0;
    for (int op = 0; op < MOE_COMM_OP_COUNT; op++) {
        if (got.bytes[op] != want[op] || got.calls[op] != calls[op]) {
            fprintf(stderr, "[rank %d] %s: counted %llu bytes in %llu calls, expected %llu in %llu\n",
                    R, moe_comm_op_name((moe_comm_op)op), got.bytes[op], got.calls[op], want[op],
                    calls[op]);
            bad++;
        }
        data += op == MOE_COMM_OP_HOST ? 0 : want[op];
    }
    bad += moe_comm_bytes_data(&got) != data;
    moe_comm_bytes_reset(g);
    got = moe_comm_bytes_sent(g);
    for (int op = 0; op < MOE_COMM_OP_COUNT; op++)
        bad += got.bytes[op] != 0 || got.calls[op] != 0;
    AGREE(bad, "bytes counted per collective");
    BE->free(a), BE->free(b);
    free(counts), free(sc), free(rc), free(cs), free(cr);
    moe_comm_free(g);
}
END_TEST

Suite *suite_mpi_comm(void) {
    Suite *s = suite_create("mpi_comm");
    TCase *tc = tcase_create("collectives");
    tcase_add_checked_fixture(tc, setup, NULL);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_dtype_sizes);
    tcase_add_test(tc, test_world_shape);
    tcase_add_test(tc, test_all_reduce_sum);
    tcase_add_test(tc, test_all_gather);
    tcase_add_test(tc, test_all_gather_v);
    tcase_add_test(tc, test_reduce_scatter_sum);
    tcase_add_test(tc, test_all_to_all_v);
    tcase_add_test(tc, test_send_recv_ring);
    tcase_add_test(tc, test_exchange_in_flight);
    tcase_add_test(tc, test_barrier);
    tcase_add_test(tc, test_split_even_odd);
    tcase_add_test(tc, test_split_bad_color);
    tcase_add_test(tc, test_host_functions);
#ifndef MOE_HAVE_CUDA
    tcase_add_test(tc, test_init_cuda_without_cuda);
#endif
    suite_add_tcase(s, tc);
    /* chapter 04: the bytes the benchmark's model is checked against (make check-ch04) */
    TCase *ch04 = tcase_create("bytes");
    tcase_add_checked_fixture(ch04, setup, NULL);
    tcase_set_tags(ch04, "ch04");
    tcase_set_timeout(ch04, 60);
    tcase_add_test(ch04, test_bytes_counted);
    suite_add_tcase(s, ch04);
    return s;
}
