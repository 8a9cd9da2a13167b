/*
 * Chapter 07's context-parallel measurement (run under mpirun, one rank per GPU or CPU
 * rank): the attention of one long sequence split over the ranks, forward + backward, per
 * communication type, and for the ring (p2p) with and without its overlap of the next hop
 * with the current blocks (MOE_CP_RING_OVERLAP=0 and =1, set inside this program).
 * The reference is the same sequence's attention on one rank alone (rank 0, the others
 * waiting), measured in the same run: the speedup is t(1 rank) / t(cp ranks) and the
 * scaling efficiency that divided by cp.
 *
 * Times are the slowest rank's: a barrier, the call(s), the backend's synchronize, then the
 * maximum over the ranks; the median of --repeats after --warmup calls. Causal, bf16 on
 * GPU ranks (fp32 on CPU ranks), H heads of dimension D (MHA), B sequences of T tokens,
 * FLOPs counted as FlashAttention does for a causal mask (forward 4·B·H·T²·D / 2, backward
 * 2.5 × that). Every CP output was checked against one process by the mpi_cp tests; this
 * program only times.
 *
 *   mpirun -np 2 bin/ch07_cp_bench --device cuda [--seqs 8192,16384,32768] [--heads 16]
 *          [--dim 128] [--batch 1] [--types p2p,allgather,a2a] [--repeats 5] [--warmup 2]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "comm.h"
#include "context_parallel.h"
#include "log.h"
#include "rng.h"
#include "timer.h"

#define MAX_LIST 16

typedef struct opts {
    const char *device;
    int seqs[MAX_LIST], n_seqs;
    int heads, dim, batch, repeats, warmup;
    moe_cp_comm types[4];
    int n_types;
} opts;

static const char *type_name(moe_cp_comm t) {
    return t == MOE_CP_P2P ? "p2p" : t == MOE_CP_ALLGATHER ? "allgather" : "a2a";
}

static int parse_types(const char *s, moe_cp_comm *out) {
    int n = 0;
    char buf[128];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t && n < 4;
         t = strtok_r(NULL, ",", &save)) {
        if (!strcmp(t, "p2p"))
            out[n++] = MOE_CP_P2P;
        else if (!strcmp(t, "allgather"))
            out[n++] = MOE_CP_ALLGATHER;
        else if (!strcmp(t, "a2a"))
            out[n++] = MOE_CP_A2A;
        else
            return -1;
    }
    return n;
}

/* a backend buffer of n activations, N(0, 1) scaled by `scale` (stream `seed` of the
 * project's counter-based generator) */
static void *randn_act(const moe_backend *be, size_t n, unsigned long long seed, double scale) {
    moe_real *h = malloc(sizeof *h * n);
    if (!h)
        return NULL;
    for (size_t i = 0; i < n; i++)
        h[i] = (moe_real)(scale * moe_rng_normal(0xC7B3u, seed, i));
    void *d = be->alloc(n * be->act_size);
    if (d)
        be->write_act(d, h, n);
    free(h);
    return d;
}

/* One rank's tensors of a call (a->cp = 1: the whole sequence) and its workspace. */
typedef struct bufs {
    void *q, *k, *v, *y, *dy, *dq, *dk, *dv, *ws;
    moe_real *lse;
} bufs;

/* 1 when every buffer was allocated */
static int make_bufs(const moe_backend *be, const moe_cp_attention *a, bufs *b) {
    const size_t rows = (size_t)a->B * a->T / a->cp, NQ = rows * a->Hq * a->D,
                 NK = rows * a->Hkv * a->D;
    memset(b, 0, sizeof *b);
    b->q = randn_act(be, NQ, 1 + a->rank, 1.0);
    b->k = randn_act(be, NK, 101 + a->rank, 1.0);
    b->v = randn_act(be, NK, 201 + a->rank, 1.0);
    b->dy = randn_act(be, NQ, 301 + a->rank, 0.1);
    b->y = be->alloc(NQ * be->act_size);
    b->dq = be->alloc(NQ * be->act_size);
    b->dk = be->alloc(NK * be->act_size);
    b->dv = be->alloc(NK * be->act_size);
    b->lse = be->alloc(rows * a->Hq * sizeof(moe_real));
    if (a->cp > 1) {
        b->ws = be->alloc(moe_cp_attention_workspace_bytes(a, be->act_size));
    } else {
        const moe_attention_shape s = {a->B, a->T, a->T, a->Hq, a->Hkv, a->D, 0, 0};
        const size_t w = be->attention_workspace_bytes(s);
        b->ws = w ? be->alloc(w) : NULL;
        if (w && !b->ws)
            return 0;
    }
    return b->q && b->k && b->v && b->dy && b->y && b->dq && b->dk && b->dv && b->lse &&
           (a->cp == 1 || b->ws);
}

static void free_bufs(const moe_backend *be, bufs *b) {
    void *p[] = {b->q, b->k, b->v, b->y, b->dy, b->dq, b->dk, b->dv, b->ws, b->lse};
    for (size_t i = 0; i < sizeof p / sizeof *p; i++)
        be->free(p[i]);
}

static void call(const moe_backend *be, const moe_cp_attention *a, bufs *b, int which) {
    const moe_attention_shape s = {a->B, a->T, a->T, a->Hq, a->Hkv, a->D, 0, 0};
    if (which != 1) {
        if (a->cp > 1)
            moe_cp_attention_forward(be, a, b->y, b->lse, b->q, b->k, b->v, b->ws);
        else
            be->attention_forward(b->y, b->lse, b->ws, b->q, b->k, b->v, s);
    }
    if (which != 0) {
        if (a->cp > 1)
            moe_cp_attention_backward(be, a, b->dq, b->dk, b->dv, b->dy, b->y, b->lse, b->q,
                                      b->k, b->v, b->ws);
        else
            be->attention_backward(b->dq, b->dk, b->dv, b->dy, b->y, b->lse, b->ws, b->q, b->k,
                                   b->v, s);
    }
}

/* One timed configuration: the call (which: 0 forward, 1 backward, 2 both) on this rank's
 * tensors; the median over the repeats of the slowest rank's ms. `active`: this rank runs
 * the call (the others only meet the barriers and the maximum). */
static double time_call(const moe_backend *be, moe_comm *world, const moe_cp_attention *a,
                        bufs *b, int which, int active, const opts *o) {
    double t[64];
    const int reps = o->repeats < 64 ? o->repeats : 64;
    for (int i = 0; i < o->warmup + reps; i++) {
        moe_comm_barrier(world);
        moe_timer tm;
        moe_timer_start(&tm);
        if (active) {
            call(be, a, b, which);
            be->synchronize();
        }
        const double ms = moe_comm_host_max(world, active ? 1e3 * moe_timer_elapsed(&tm) : 0);
        if (i >= o->warmup)
            t[i - o->warmup] = ms;
    }
    return moe_median(t, reps);
}

int main(int argc, char **argv) {
    opts o = {.device = "cpu", .heads = 16, .dim = 128, .batch = 1, .repeats = 5, .warmup = 2};
    o.n_seqs = moe_bench_parse_ints("8192,16384,32768", o.seqs, MAX_LIST);
    o.n_types = parse_types("p2p,allgather,a2a", o.types);
    int bad = 0;
    for (int i = 1; i < argc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(f, "-h") || !strcmp(f, "--help")) {
            printf("usage: mpirun -np N bin/ch07_cp_bench [--device cpu|cuda] [--seqs T,...] "
                   "[--heads H] [--dim D] [--batch B] [--types p2p,allgather,a2a] "
                   "[--repeats R] [--warmup W]\n");
            return 0;
        }
        if (!v) {
            fprintf(stderr, "ch07_cp_bench: %s needs a value (--help)\n", f);
            return 2;
        }
        i++;
        if (!strcmp(f, "--device"))
            o.device = v, bad |= strcmp(v, "cpu") && strcmp(v, "cuda");
        else if (!strcmp(f, "--seqs"))
            bad |= (o.n_seqs = moe_bench_parse_ints(v, o.seqs, MAX_LIST)) < 1;
        else if (!strcmp(f, "--types"))
            bad |= (o.n_types = parse_types(v, o.types)) < 1;
        else if (!strcmp(f, "--heads"))
            bad |= (o.heads = atoi(v)) < 1;
        else if (!strcmp(f, "--dim"))
            bad |= (o.dim = atoi(v)) < 1 || o.dim > 256;
        else if (!strcmp(f, "--batch"))
            bad |= (o.batch = atoi(v)) < 1;
        else if (!strcmp(f, "--repeats"))
            bad |= (o.repeats = atoi(v)) < 1 || o.repeats > 64;
        else if (!strcmp(f, "--warmup"))
            bad |= (o.warmup = atoi(v)) < 0;
        else {
            fprintf(stderr, "ch07_cp_bench: unknown flag %s (--help)\n", f);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "ch07_cp_bench: bad value '%s' for %s: --seqs and --types are "
                            "comma lists (types p2p, allgather, a2a), --heads, --dim (<= 256), "
                            "--batch, --repeats (1..64) positive, --warmup >= 0\n", v, f);
            return 2;
        }
    }
    moe_comm *world = NULL;
    moe_error err;
    const moe_device dev = strcmp(o.device, "cuda") ? MOE_DEVICE_CPU : MOE_DEVICE_CUDA;
    if (moe_comm_init(&argc, &argv, dev, &world, &err) != MOE_OK) {
        moe_log_error("%s", err.msg);
        return 1;
    }
    const int cp = moe_comm_size(world), rank = moe_comm_rank(world);
    moe_log_set_rank(rank, cp);
    const moe_backend *be = NULL;
    if (moe_backend_select(o.device, &be, &err) != MOE_OK ||
        moe_cp_attention_supported(be, &err) != MOE_OK) {
        moe_log_error("%s", err.msg);
        moe_comm_finalize(world);
        return 1;
    }
    if (cp < 2 && rank == 0)
        moe_log_warn("one rank: nothing is split (run it under mpirun -np 2 or more)");
    if (rank == 0) {
        char name[512], where[600];
        be->device_name(name, sizeof name);
        snprintf(where, sizeof where, "%d ranks x %s", cp, name);
        moe_bench_header("ch07 context-parallel attention: forward + backward, causal", where);
        printf("H = %d heads of D = %d (MHA), B = %d, %s; ms are the slowest rank's, median "
               "of %d after %d warm-up\n\n", o.heads, o.dim, o.batch,
               be->device == MOE_DEVICE_CUDA ? "bf16" : "fp32", o.repeats, o.warmup);
        printf("| T | type | overlap | fwd ms | bwd ms | fwd+bwd ms | TFLOP/s per rank | "
               "1 rank fwd+bwd ms | speedup | efficiency |\n"
               "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
    }
    int fail = 0;
    for (int si = 0; si < o.n_seqs; si++) {
        const int T = o.seqs[si];
        moe_cp_attention one = {NULL, 1, 0, MOE_CP_P2P, o.batch, T, o.heads, o.heads, o.dim,
                                NULL, NULL, 1};
        if (moe_cp_attention_check(&one, &err) != MOE_OK) {
            if (rank == 0)
                moe_log_error("--seqs %d: %s", T, err.msg);
            fail = 1;
            continue;
        }
        /* the reference: the whole sequence on rank 0 */
        bufs b1;
        const int ok1 = rank != 0 || make_bufs(be, &one, &b1);
        double t1 = NAN;
        if (moe_comm_host_max(world, ok1 ? 0 : 1) == 0)
            t1 = time_call(be, world, &one, &b1, 2, rank == 0, &o);
        if (rank == 0)
            free_bufs(be, &b1);
        const double flops = 4.0 * o.batch * o.heads * (double)T * T * o.dim / 2 * 3.5;
        for (int ti = 0; ti < o.n_types; ti++) {
            moe_cp_attention a = {cp > 1 ? world : NULL, cp, rank, o.types[ti], o.batch, T,
                                  o.heads, o.heads, o.dim, NULL, NULL, 1};
            if (cp < 2 || moe_cp_attention_check(&a, &err) != MOE_OK) {
                if (rank == 0 && cp > 1)
                    printf("| %d | %s | | not run: %s |\n", T, type_name(a.type), err.msg);
                continue;
            }
            bufs b;
            const int ok = make_bufs(be, &a, &b);
            if (moe_comm_host_max(world, ok ? 0 : 1) != 0) {
                if (rank == 0)
                    printf("| %d | %s | | out of memory |\n", T, type_name(a.type));
                free_bufs(be, &b);
                continue;
            }
            for (int ov = a.type == MOE_CP_P2P ? 0 : 1; ov <= 1; ov++) {
                if (a.type == MOE_CP_P2P) /* forced either way (by default: by size) */
                    setenv("MOE_CP_RING_OVERLAP", ov ? "1" : "0", 1);
                const double f = time_call(be, world, &a, &b, 0, 1, &o);
                const double bw = time_call(be, world, &a, &b, 1, 1, &o);
                const double fb = time_call(be, world, &a, &b, 2, 1, &o);
                unsetenv("MOE_CP_RING_OVERLAP");
                if (rank == 0)
                    printf("| %d | %s | %s | %.2f | %.2f | %.2f | %.1f | %.2f | %.2fx | %.0f%% |\n",
                           T, type_name(a.type), a.type == MOE_CP_P2P ? (ov ? "on" : "off") : "",
                           f, bw, fb, flops / cp / (fb * 1e9), t1, t1 / fb,
                           100 * t1 / fb / cp);
            }
            free_bufs(be, &b);
        }
    }
    moe_comm_finalize(world);
    return fail;
}
