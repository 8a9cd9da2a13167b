/*
 * Chapter 02 benchmark: what the all-to-all dispatcher costs on top of the raw all-to-all.
 *
 *   mpirun -np 2 bin/ch02_dispatch_bench [--device cuda] [--hidden 4096] [--experts-per-rank 4]
 *
 * Every rank routes T tokens of width H to E = EP · experts-per-rank experts (top-k,
 * uniform random routing: the balanced case), then runs the dispatcher's forward path —
 * local permutation, count exchange, all-to-all-v of the rows, chunk sort — and the
 * combine back (unsort, all-to-all-v back, unpermute), with no expert in between. The
 * baseline, measured in the same run, is one all-to-all of the same number of bytes with
 * equal splits (what NCCL/MPI can do with no bookkeeping at all), forward and back.
 *
 * Two paths of the same dispatcher are timed: the collective one (permute_tokens, the
 * NCCL/MPI exchange, unpermute) and, where the GPUs share memory (NVLink), the fused one
 * (one kernel stores each token into its experts' GPUs, one loads and sums them back:
 * --moe-alltoall-path fused in the trainer).
 *
 * Bandwidth is bytes leaving this rank for other ranks / time, per direction, averaged
 * over dispatch and combine. CUDA events (GPU) or the clock (CPU), warm-up, median of
 * repeats, after a barrier.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "comm.h"
#include "moe/dispatch.h"
#include "flags.h"
#include "log.h"
#include "bench.h"
#include "rng.h"

typedef struct opts {
    char device[MOE_FLAG_STR_LEN];
    int hidden, experts_per_rank, topk, repeats, warmup;
} opts;

#define OF(name, type, field, def, help, choices) \
    { name, type, offsetof(opts, field), def, help, choices, "benchmark" }
static const moe_flag g_flags[] = {
    OF("device", MOE_FLAG_CHOICE, device, "auto", "backend (auto = cuda when a GPU is present)",
       "auto|cpu|cuda"),
    OF("hidden", MOE_FLAG_INT, hidden, "0", "token width H (0 = 4096 on a GPU, 1024 on CPU ranks)",
       NULL),
    OF("experts-per-rank", MOE_FLAG_INT, experts_per_rank, "4", "local experts", NULL),
    OF("topk", MOE_FLAG_INT, topk, "2", "experts per token", NULL),
    OF("repeats", MOE_FLAG_INT, repeats, "9", "timed iterations (median)", NULL),
    OF("warmup", MOE_FLAG_INT, warmup, "2", "untimed iterations", NULL),
};

/* median over ranks of the per-rank medians would hide stragglers: take the slowest rank */
static double timed_ms(const moe_backend *be, moe_comm *world, double *ms, int n) {
    return moe_comm_host_max(world, moe_median(ms, n));
}

/* Every token must come back exactly k times (x·k, to bf16 rounding); else end the job. */
static void check_round_trip(const moe_backend *be, moe_comm *world, moe_real *oh,
                             const moe_real *xr, const void *out, size_t n, int k,
                             const char *path) {
    be->read_act(oh, out, n);
    double worst = 0;
    for (size_t i = 0; i < n; i++)
        worst = fmax(worst, fabs(oh[i] - k * xr[i]) / fmax(fabs(k * xr[i]), 1.0));
    if (worst > 2e-2) {
        char msg[160];
        snprintf(msg, sizeof msg, "round trip through the %s dispatcher is wrong (err %.3g)", path,
                 worst);
        moe_comm_abort(world, 1, msg);
    }
}

static char last_stages[512];

int main(int argc, char **argv) {
    opts o;
    moe_error err;
    const int nf = (int)(sizeof g_flags / sizeof g_flags[0]);
    moe_flags_set_defaults(g_flags, nf, &o);
    const moe_backend *be = NULL;
    moe_status s = moe_flags_parse(g_flags, nf, &o, argc, argv, &err);
    if (s == MOE_ERR_HELP) {
        moe_flags_print_help(stdout, "ch02_dispatch_bench",
                             "Chapter 02: dispatcher + combine vs a raw all-to-all of the same "
                             "bytes (run under mpirun).", g_flags, nf);
        return 0;
    }
    if (s != MOE_OK || moe_backend_select(o.device, &be, &err) != MOE_OK) {
        moe_log_error("%s", err.msg);
        return 2;
    }
    if (o.hidden == 0)
        o.hidden = be->device == MOE_DEVICE_CUDA ? 4096 : 1024;
    if (o.hidden < 1 || o.experts_per_rank < 1 || o.topk < 1 || o.repeats < 1 || o.warmup < 0) {
        moe_log_error("--hidden, --experts-per-rank, --topk and --repeats must be >= 1");
        return 2;
    }
    moe_comm *world = NULL;
    if (moe_comm_init(&argc, &argv, be->device, &world, &err) != MOE_OK) {
        moe_log_error("%s", err.msg);
        return 1;
    }
    const int P = moe_comm_size(world), rank = moe_comm_rank(world), H = o.hidden;
    const int E = P * o.experts_per_rank, k = o.topk < E ? o.topk : E;
    char dev[256], where[300];
    be->device_name(dev, sizeof dev);
    snprintf(where, sizeof where, "%d ranks x %s", P, dev);
    if (rank == 0) {
        moe_bench_header("ch02 dispatcher vs raw all-to-all", where);
        printf("H=%d, E=%d (%d per rank), top-%d, uniform routing; bytes = rows leaving each rank "
               "x H x %zu B; median of %d, slowest rank\n\n",
               H, E, o.experts_per_rank, k, be->act_size, o.repeats);
    }
    moe_ep ep = {.comm = P > 1 ? world : NULL, .size = P, .rank = rank, .be = be};
    char why[320] = "one rank";
    if (P > 1 && be->device != MOE_DEVICE_CUDA) /* (peer access is collective: all or none) */
        snprintf(why, sizeof why, "CPU ranks: their fused path is a twin over MPI windows, a "
                 "test of the plan, not a fast path");
    const int fused = P > 1 && be->device == MOE_DEVICE_CUDA && k <= MOE_FUSED_MAX_TOPK &&
                      moe_comm_peer_access(world, why, sizeof why);
    if (rank == 0) {
        if (!fused)
            printf("fused path: not timed (%s)\n\n", why);
        printf("| tokens/rank | MB out/rank | raw a2a ms | raw GB/s | collective ms | GB/s | of raw "
               "| fused ms | GB/s | of raw |\n|---|---|---|---|---|---|---|---|---|---|\n");
    }
    const int sizes[] = {1024, 4096, 16384, 32768};
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        const int T = sizes[si], NK = T * k;
        /* uniform random distinct experts per token, from the counter-based RNG */
        int *idx = malloc(sizeof(int) * NK);
        for (int t = 0; t < T; t++)
            for (int j = 0; j < k; j++) {
                int e;
                int fresh;
                uint64_t draw = 0;
                do {
                    e = (int)(moe_rng_uniform(7 + rank, 1, (uint64_t)t * 64 + j + draw++ * 4096) * E);
                    fresh = 1;
                    for (int m = 0; m < j; m++)
                        fresh &= idx[t * k + m] != e;
                } while (!fresh);
                idx[t * k + j] = e;
            }
        int *d_idx = be->alloc(sizeof(int) * NK), *perm_src = be->alloc(sizeof(int) * NK);
        int *row_of = be->alloc(sizeof(int) * NK), *off = malloc(sizeof(int) * (E + 1));
        long long *counts = calloc((size_t)E, sizeof(long long));
        long long *kept = malloc(sizeof(long long) * E);
        be->from_host(d_idx, idx, sizeof(int) * NK);
        moe_real *xh = malloc(sizeof(moe_real) * (size_t)T * H);
        for (size_t i = 0; i < (size_t)T * H; i++)
            xh[i] = (moe_real)moe_rng_normal(3, (uint64_t)rank, i);
        void *x = be->alloc(be->act_size * (size_t)T * H);
        void *xp = be->alloc(be->act_size * (size_t)NK * H);
        void *out = be->alloc(be->act_size * (size_t)T * H);
        be->write_act(x, xh, (size_t)T * H);
        moe_dispatch_plan plan, fplan;
        memset(&plan, 0, sizeof plan);
        memset(&fplan, 0, sizeof fplan);
        moe_sym_buf xs;
        memset(&xs, 0, sizeof xs);

        /* one round trip through the dispatcher (no expert): must return x·k exactly */
        void *xe = NULL;
        double *ms = malloc(sizeof(double) * o.repeats), *raw = malloc(sizeof(double) * o.repeats);
        for (int it = 0; it < o.warmup + o.repeats; it++) {
            moe_comm_barrier(world);
            be->timer_begin();
            be->permute_index(perm_src, row_of, off, NULL, counts, d_idx, T, k, E);
            be->permute_tokens(xp, x, perm_src, NK, k, H);
            for (int e = 0; e < E; e++)
                kept[e] = off[e + 1] - off[e];
            moe_dispatch_plan_build(&ep, &plan, kept, E, 0);
            if (!xe)
                xe = be->alloc(be->act_size * (size_t)(P * NK + 1) * H);
            moe_dispatch_rows(&ep, &plan, xe, xp, H);
            moe_combine_rows(&ep, &plan, xp, xe, H);
            be->zero(out, be->act_size * (size_t)T * H);
            be->unpermute_sum(out, xp, row_of, T, k, H);
            double t_ms = be->timer_end_ms();
            if (it >= o.warmup)
                ms[it - o.warmup] = t_ms;
        }
        /* check: every token came back k times */
        moe_real *oh = malloc(sizeof(moe_real) * (size_t)T * H);
        moe_real *xr = malloc(sizeof(moe_real) * (size_t)T * H);
        be->read_act(xr, x, (size_t)T * H);
        check_round_trip(be, world, oh, xr, out, (size_t)T * H, k, "collective");

        /* the fused path: no permuted copies, the rows go straight to the experts' GPUs */
        double *fms = malloc(sizeof(double) * o.repeats), fstage[2] = {0};
        be->zero(out, be->act_size * (size_t)T * H); /* rows the fused path misses stay 0 */
        for (int it = 0; fused && it < o.warmup + o.repeats; it++) {
            moe_comm_barrier(world);
            be->timer_begin();
            be->permute_index(perm_src, row_of, off, NULL, counts, d_idx, T, k, E);
            for (int e = 0; e < E; e++)
                kept[e] = off[e + 1] - off[e];
            /* this plan only is the fused path's: the collective one above was built without */
            ep.dispatcher = &moe_dispatcher_fused;
            moe_dispatch_plan_build(&ep, &fplan, kept, E, 0);
            ep.dispatcher = NULL;
            moe_dispatch_sym_rows(&ep, &fplan, &xs, be->act_size * (size_t)H);
            moe_dispatch_fused(&ep, &fplan, &xs, NULL, x, NULL, d_idx, row_of, T, k, H);
            moe_combine_fused(&ep, &fplan, out, 0, NULL, &xs, NULL, d_idx, row_of, T, k, H);
            double t_ms = be->timer_end_ms();
            if (it >= o.warmup)
                fms[it - o.warmup] = t_ms;
        }
        if (fused) {
            /* out holds the last timed round trip (combine overwrites it) */
            check_round_trip(be, world, oh, xr, out, (size_t)T * H, k, "fused");
            for (int it = 0; it < o.repeats; it++) {
                moe_comm_barrier(world);
                be->timer_begin();
                moe_dispatch_fused(&ep, &fplan, &xs, NULL, x, NULL, d_idx, row_of, T, k, H);
                fstage[0] += be->timer_end_ms();
                be->timer_begin();
                moe_combine_fused(&ep, &fplan, out, 0, NULL, &xs, NULL, d_idx, row_of, T, k, H);
                fstage[1] += be->timer_end_ms();
            }
        }
        /* bytes leaving this rank: rows for experts on other ranks */
        size_t rows_out = 0;
        for (int p = 0; p < P; p++)
            if (p != rank)
                rows_out += plan.send_rows[p];
        double bytes = (double)rows_out * H * be->act_size;
        /* raw baseline: the same total rows in equal splits, there and back */
        size_t per = (size_t)NK / P * H;
        size_t *cnt = malloc(sizeof(size_t) * P);
        for (int p = 0; p < P; p++)
            cnt[p] = per;
        moe_dtype t = moe_dtype_act(be);
        for (int it = 0; it < o.warmup + o.repeats; it++) {
            moe_comm_barrier(world);
            be->timer_begin();
            if (P > 1) {
                moe_comm_all_to_all_v(world, xp, cnt, xe, cnt, t);
                moe_comm_all_to_all_v(world, xe, cnt, xp, cnt, t);
            } else {
                be->copy(xe, xp, be->act_size * per);
                be->copy(xp, xe, be->act_size * per);
            }
            double t_ms = be->timer_end_ms();
            if (it >= o.warmup)
                raw[it - o.warmup] = t_ms;
        }
        /* where the time goes: each stage timed on its own (stages end with a sync) */
        double stage[7] = {0};
        for (int it = 0; it < o.repeats; it++) {
            moe_comm_barrier(world);
            be->timer_begin();
            be->permute_index(perm_src, row_of, off, NULL, counts, d_idx, T, k, E);
            stage[0] += be->timer_end_ms();
            be->timer_begin();
            be->permute_tokens(xp, x, perm_src, NK, k, H);
            stage[1] += be->timer_end_ms();
            for (int e = 0; e < E; e++)
                kept[e] = off[e + 1] - off[e];
            be->timer_begin();
            moe_dispatch_plan_build(&ep, &plan, kept, E, 0);
            stage[2] += be->timer_end_ms();
            be->timer_begin();
            moe_dispatch_rows(&ep, &plan, xe, xp, H);
            stage[3] += be->timer_end_ms();
            be->timer_begin();
            moe_combine_rows(&ep, &plan, xp, xe, H);
            stage[4] += be->timer_end_ms();
            be->timer_begin();
            be->zero(out, be->act_size * (size_t)T * H);
            be->unpermute_sum(out, xp, row_of, T, k, H);
            stage[5] += be->timer_end_ms();
        }
        if (rank == 0 && si + 1 == sizeof sizes / sizeof sizes[0]) {
            snprintf(last_stages, sizeof last_stages,
                     "stages at %d tokens (rank 0, mean ms): permute_index %.3f, permute_tokens "
                     "%.3f, plan %.3f, dispatch exchange %.3f, combine exchange %.3f, unpermute "
                     "%.3f",
                     T, stage[0] / o.repeats, stage[1] / o.repeats, stage[2] / o.repeats,
                     stage[3] / o.repeats, stage[4] / o.repeats, stage[5] / o.repeats);
            if (fused)
                snprintf(last_stages + strlen(last_stages), sizeof last_stages - strlen(last_stages),
                         "; fused dispatch %.3f, fused combine %.3f", fstage[0] / o.repeats,
                         fstage[1] / o.repeats);
        }
        double raw_bytes = (double)per * (P - 1) * be->act_size;
        double m_disp = timed_ms(be, world, ms, o.repeats), m_raw = timed_ms(be, world, raw, o.repeats);
        double gbs = 2 * bytes / (m_disp * 1e-3) / 1e9, raw_gbs = 2 * raw_bytes / (m_raw * 1e-3) / 1e9;
        double m_f = fused ? timed_ms(be, world, fms, o.repeats) : 0;
        double fgbs = fused ? 2 * bytes / (m_f * 1e-3) / 1e9 : 0;
        if (rank == 0) {
            printf("| %11d | %11.1f | %10.3f | %8.1f | %13.3f | %6.1f | %5.0f%% |", T, bytes / 1e6,
                   m_raw, raw_gbs, m_disp, gbs, P > 1 ? 100 * gbs / raw_gbs : 0.0);
            if (fused)
                printf(" %8.3f | %6.1f | %5.0f%% |\n", m_f, fgbs, 100 * fgbs / raw_gbs);
            else
                printf("      n/a |    n/a |    n/a |\n");
        }
        free(fms);
        moe_comm_sym_free(&xs);
        moe_dispatch_plan_free(be, &fplan);
        moe_dispatch_plan_free(be, &plan);
        be->free(d_idx); be->free(perm_src); be->free(row_of); be->free(x); be->free(xp);
        be->free(out); be->free(xe);
        free(idx); free(off); free(counts); free(kept); free(xh); free(oh); free(xr); free(ms); free(raw);
        free(cnt);
    }
    if (rank == 0)
        printf("\n%s\n", last_stages);
    moe_ep_free(&ep);
    moe_comm_finalize(world);
    return 0;
}
