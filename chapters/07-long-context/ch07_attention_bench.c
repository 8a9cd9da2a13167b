/*
 * Chapter 07's measurement: the CUDA flash attention (kernels/attention.cu), causal, bf16,
 * forward, backward and both, against PyTorch SDPA's FLASH_ATTENTION and CUDNN_ATTENTION
 * backends measured in the same run.
 *
 * Shapes: for each head dimension D and sequence length T, H = --hidden / D heads (MHA)
 * and B = max(1, --tokens / T) sequences: the same number of tokens at every length, as in
 * FlashAttention's own benchmarks. FLOPs are counted as FlashAttention does for a causal
 * mask: forward 4·B·H·T²·D / 2, backward 2.5 × that.
 *
 * Before timing, every shape's outputs are checked against a double-precision reference on
 * the host for sampled rows (y, lse and dq of 6 query rows, dk and dv of 6 key rows, in the
 * first and last (b, h)); a check error above 3e-2 (relative to the largest reference value)
 * stops the program. Times are CUDA events on the op's stream, median of --repeats after
 * --warmup calls. The SDPA numbers come from chapters/07-long-context/ch07_sdpa.py (run with
 * --python; it checks the two backends against each other on the same inputs).
 *
 * On an sm_90 GPU the forward is the Hopper kernel (kernels/attention_sm90.cu) for D = 64
 * and 128; the portable forward (kernels/attention.cu, MOE_FLASH_SM90=0) is timed too, and
 * the table shows both ("sm90" says which path the main columns took). The backward in the
 * main columns is the Hopper one on sm_90 for D = 64 and 128 (kernels/attention_sm90_bwd.cu:
 * its fused single kernel in FlashAttention-3's order, mode 6, the default; MOE_FLASH_SM90_BWD=2
 * puts the same kernel in its first order there, =1 its two-kernel form, =0 the portable
 * one); then the portable backward is timed
 * too and "sm90 bwd" says which ran in the main columns (the sampled check runs on the main
 * path, so a wrong Hopper backward stops the program). Wherever a Hopper backward runs (an
 * sm_90 GPU, D = 64 or 128), its seven modes are also checked (the same sampled check) and
 * timed whatever the setting, side by side in the columns "bwd mode 1", "bwd mode 2", "bwd
 * mode 3" (MOE_FLASH_SM90_BWD=3: mode 2's kernel with its wgmmas overlapped with its
 * arithmetic, opt-in) and "bwd mode 4" (MOE_FLASH_SM90_BWD=4: mode 2's kernel with its dq
 * tiles reduce-added in no fixed order, FlashAttention-3's default: NOT deterministic,
 * opt-in; it measures what mode 2's deterministic ordering costs) and "bwd mode 5"
 * (MOE_FLASH_SM90_BWD=5: mode 4 with its dk/dv epilogue's loads batched before its stores,
 * not deterministic either), "bwd mode 6" (MOE_FLASH_SM90_BWD=6: mode 2's kernel with
 * FlashAttention-3's order of products and waits and a dq hand-off per warpgroup; mode 2's
 * bits) and "bwd mode 7" (=7: mode 6 with mode 4's unordered dq adds, NOT deterministic).
 * Run
 * the whole program under MOE_FLASH_SM90=0 MOE_FLASH_SM90_BWD=0 to measure the portable
 * kernels alone.
 *
 *   bin/ch07_attention_bench --seqs 4096,16384,65536 --dims 128,64
 *
 *   bin/ch07_attention_bench [--seqs 1024,4096,16384,32768,65536] [--dims 64,128]
 *                            [--tokens 16384] [--hidden 2048] [--repeats 10] [--warmup 3]
 *                            [--python python3 | --no-sdpa]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cuda_ops.h"

#define MAX_LIST 16
#define CHECK_TOL 3e-2

/* The Hopper backward's modes, MOE_FLASH_SM90_BWD=1 … 7 (kernels/attention_sm90_bwd.cu),
 * each with the launch counter that grows when it runs: 1 any Hopper backward (mode 1 is its
 * two kernels), 2 the fused kernel, 3 with the overlap, 4 with unordered dq additions, 5 that
 * with the batched dk/dv epilogue, 6 and 7 FlashAttention-3's order. */
#define BWD_MODES 7
typedef long long (*launch_counter)(void);
static const launch_counter BWD_MODE_CALLS[BWD_MODES] = {
    moe_cuda_attention_sm90_backward_calls,         moe_cuda_attention_sm90_backward_fused_calls,
    moe_cuda_attention_sm90_backward_overlap_calls, moe_cuda_attention_sm90_backward_nondet_calls,
    moe_cuda_attention_sm90_backward_batched_calls, moe_cuda_attention_sm90_backward_fa3order_calls,
    moe_cuda_attention_sm90_backward_fa3order_calls};

typedef struct sdpa_row {
    int ok;                 /* 1: timed */
    double fwd, bwd, fb;    /* ms */
    double diff;            /* flash vs cuDNN outputs, max rel. */
} sdpa_row;

typedef struct shape_result {
    int B, H, T, D;
    double check, fwd, bwd, fb; /* check error; ms */
    double fwd_portable;        /* ms: the portable forward (MOE_FLASH_SM90=0) */
    int sm90;                   /* the main forward ran the Hopper kernel */
    double bwd_portable;        /* ms: the portable backward (MOE_FLASH_SM90_BWD=0), or 0 */
    int sm90_bwd;               /* the main backward ran the Hopper kernels */
    double bwd_mode[BWD_MODES]; /* ms: the Hopper backward's modes 1-7, or 0: not run */
    sdpa_row flash, cudnn;
} shape_result;

/* A device bf16 tensor of n N(0, 1) values, and its host copy (as the GPU holds it). */
static void *randn_act(size_t n, unsigned long long seed, moe_real **host) {
    moe_real *tmp = moe_cuda_alloc(n * sizeof(moe_real));
    void *x = moe_cuda_alloc(n * 2);
    moe_cuda_fill_normal(tmp, n, seed, 0, 1.0);
    moe_cuda_cast_to_act(x, tmp, n);
    moe_cuda_synchronize();
    moe_cuda_free(tmp);
    if (host) {
        *host = malloc(n * sizeof(moe_real));
        if (!*host) {
            fprintf(stderr, "ch07_attention_bench: out of host memory\n");
            exit(1);
        }
        moe_cuda_read_act(*host, x, n);
    }
    return x;
}

/* A host copy of n device values (bf16 activations or, when f32, fp32). */
static moe_real *fetch(const void *d, size_t n, int f32) {
    moe_real *h = malloc(n * sizeof *h);
    if (!h) {
        fprintf(stderr, "ch07_attention_bench: out of host memory\n");
        exit(1);
    }
    if (f32)
        moe_cuda_to_host(h, d, n * sizeof *h);
    else
        moe_cuda_read_act(h, d, n);
    return h;
}

/* max |a − ref| / max |ref| accumulated over calls: err[0] the max diff, err[1] the max ref */
static void acc_err(double err[2], double a, double ref) {
    const double d = fabs(a - ref);
    err[0] = isnan(d) || d > err[0] ? (isnan(d) ? INFINITY : d) : err[0];
    err[1] = fabs(ref) > err[1] ? fabs(ref) : err[1];
}

/* The sampled check (see the header comment): the worst relative error over y, lse, dq, dk,
 * dv. Host tensors are [B, T, H, D]; lse is [B, H, T]; dq, dk, dv are one backward's
 * increments (they started at 0). */
static double check(int B, int H, int T, int D, const moe_real *q, const moe_real *k,
                    const moe_real *v, const moe_real *dy, const moe_real *y,
                    const moe_real *lse, const moe_real *dq, const moe_real *dk,
                    const moe_real *dv) {
    const double scale = 1.0 / sqrt((double)D);
    const size_t rs = (size_t)H * D; /* row stride of one token */
    double e[5][2] = {{0}};          /* y, lse, dq, dk, dv */
    double *p = malloc(sizeof(double) * (size_t)T), *o = malloc(sizeof(double) * (size_t)D);
    if (!p || !o)
        exit(1);
    const int rows[6] = {0, 1, T / 3, T / 2, T - 2 > 0 ? T - 2 : 0, T - 1};
    const int bh[2][2] = {{0, 0}, {B - 1, H - 1}};
    for (int w = 0; w < 2; w++) {
        const int b = bh[w][0], h = bh[w][1];
        const moe_real *qb = q + (size_t)b * T * rs + (size_t)h * D;
        const moe_real *kb = k + (size_t)b * T * rs + (size_t)h * D;
        const moe_real *vb = v + (size_t)b * T * rs + (size_t)h * D;
        const moe_real *dyb = dy + (size_t)b * T * rs + (size_t)h * D;
        const moe_real *yb = y + (size_t)b * T * rs + (size_t)h * D;
        const moe_real *lb = lse + ((size_t)b * H + h) * T;
        for (int r = 0; r < 6; r++) {
            /* query row t: y, lse, dq */
            const int t = rows[r];
            double m = -INFINITY, l = 0.0, delta = 0.0;
            for (int s = 0; s <= t; s++) {
                double x = 0.0;
                for (int d = 0; d < D; d++)
                    x += (double)qb[(size_t)t * rs + d] * kb[(size_t)s * rs + d];
                p[s] = x * scale;
                m = p[s] > m ? p[s] : m;
            }
            for (int s = 0; s <= t; s++)
                l += exp(p[s] - m);
            for (int d = 0; d < D; d++)
                o[d] = 0.0;
            for (int s = 0; s <= t; s++) {
                p[s] = exp(p[s] - m) / l;
                for (int d = 0; d < D; d++)
                    o[d] += p[s] * vb[(size_t)s * rs + d];
            }
            for (int d = 0; d < D; d++) {
                acc_err(e[0], yb[(size_t)t * rs + d], o[d]);
                delta += (double)dyb[(size_t)t * rs + d] * yb[(size_t)t * rs + d];
            }
            acc_err(e[1], lb[t], m + log(l));
            for (int d = 0; d < D; d++)
                o[d] = 0.0;
            for (int s = 0; s <= t; s++) {
                double dp = 0.0;
                for (int d = 0; d < D; d++)
                    dp += (double)dyb[(size_t)t * rs + d] * vb[(size_t)s * rs + d];
                const double ds = p[s] * (dp - delta) * scale;
                for (int d = 0; d < D; d++)
                    o[d] += ds * kb[(size_t)s * rs + d];
            }
            for (int d = 0; d < D; d++)
                acc_err(e[2], dq[(size_t)b * T * rs + (size_t)t * rs + (size_t)h * D + d], o[d]);
            /* key row s = t: dk, dv over the queries that see it, with the GPU's lse and y */
            const int s = t;
            double *ok = malloc(sizeof(double) * (size_t)D);
            if (!ok)
                exit(1);
            for (int d = 0; d < D; d++)
                o[d] = ok[d] = 0.0;
            for (int u = s; u < T; u++) {
                double x = 0.0, dp = 0.0, du = 0.0;
                for (int d = 0; d < D; d++) {
                    x += (double)qb[(size_t)u * rs + d] * kb[(size_t)s * rs + d];
                    dp += (double)dyb[(size_t)u * rs + d] * vb[(size_t)s * rs + d];
                    du += (double)dyb[(size_t)u * rs + d] * yb[(size_t)u * rs + d];
                }
                const double pu = exp(x * scale - lb[u]), ds = pu * (dp - du) * scale;
                for (int d = 0; d < D; d++) {
                    o[d] += pu * dyb[(size_t)u * rs + d];
                    ok[d] += ds * qb[(size_t)u * rs + d];
                }
            }
            for (int d = 0; d < D; d++) {
                const size_t at = (size_t)b * T * rs + (size_t)s * rs + (size_t)h * D + d;
                acc_err(e[3], dk[at], ok[d]);
                acc_err(e[4], dv[at], o[d]);
            }
            free(ok);
        }
    }
    free(p);
    free(o);
    double worst = 0.0;
    for (int i = 0; i < 5; i++) {
        const double r = e[i][1] > 0 ? e[i][0] / e[i][1] : e[i][0];
        worst = r > worst || isnan(r) ? r : worst;
    }
    return worst;
}

/* Median time of @p reps calls of the forward (which = 0), backward (1) or both (2). */
static double time_op(int which, int reps, int warmup, void *y, moe_real *lse, void *ws,
                      void *dq, void *dk, void *dv, const void *dy, const void *q,
                      const void *k, const void *v, moe_attention_shape s) {
    double *t = malloc(sizeof(double) * (size_t)reps);
    if (!t)
        exit(1);
    for (int i = -warmup; i < reps; i++) {
        moe_cuda_timer_begin();
        if (which != 1)
            moe_cuda_attention_forward(y, lse, ws, q, k, v, s);
        if (which != 0)
            moe_cuda_attention_backward(dq, dk, dv, dy, y, lse, ws, q, k, v, s);
        const double ms = moe_cuda_timer_end_ms();
        if (i >= 0)
            t[i] = ms;
    }
    const double med = moe_median(t, reps);
    free(t);
    return med;
}

/* One backward from zero gradients as the environment selects, checked against the double
 * reference (the program stops above CHECK_TOL, naming the mode); *err gets the check error.
 * Returns 1 when it ran a Hopper backward: for @p mode 1 … BWD_MODES that mode's kernel
 * (BWD_MODE_CALLS), for 0 (the main columns) any of them. */
static int checked_backward(const shape_result *r, int mode, const moe_real *hq,
                            const moe_real *hk, const moe_real *hv, const moe_real *hdy,
                            void *y, moe_real *lse, void *ws, void *dq, void *dk, void *dv,
                            const void *dy, const void *q, const void *k, const void *v,
                            moe_attention_shape s, double *err) {
    const int B = r->B, H = r->H, T = r->T, D = r->D;
    const size_t n = (size_t)B * T * H * D, nl = (size_t)B * H * T;
    moe_cuda_zero(dq, n * 2);
    moe_cuda_zero(dk, n * 2);
    moe_cuda_zero(dv, n * 2);
    const launch_counter calls = BWD_MODE_CALLS[mode > 0 ? mode - 1 : 0];
    const long long before = calls();
    moe_cuda_attention_backward(dq, dk, dv, dy, y, lse, ws, q, k, v, s);
    const int ran = calls() > before;
    moe_cuda_synchronize();
    moe_real *hy = fetch(y, n, 0), *hl = fetch(lse, nl, 1), *hdq = fetch(dq, n, 0);
    moe_real *hdk = fetch(dk, n, 0), *hdv = fetch(dv, n, 0);
    *err = check(B, H, T, D, hq, hk, hv, hdy, hy, hl, hdq, hdk, hdv);
    moe_real *hbufs[] = {hy, hl, hdq, hdk, hdv};
    for (size_t i = 0; i < sizeof hbufs / sizeof hbufs[0]; i++)
        free(hbufs[i]);
    if (!(*err <= CHECK_TOL)) {
        char what[16] = "main";
        if (mode > 0)
            snprintf(what, sizeof what, "mode %d", mode);
        fprintf(stderr, "ch07_attention_bench: B=%d H=%d T=%d D=%d (%s backward): sampled check "
                "error %.3e > %.0e: the kernel is wrong for this shape\n", B, H, T, D, what,
                *err, CHECK_TOL);
        exit(1);
    }
    return ran;
}

static void measure(shape_result *r, int reps, int warmup) {
    const int B = r->B, H = r->H, T = r->T, D = r->D;
    const moe_attention_shape s = {B, T, T, H, H, D, 0, 0};
    const size_t n = (size_t)B * T * H * D, nl = (size_t)B * H * T;
    moe_real *hq, *hk, *hv, *hdy;
    void *q = randn_act(n, 1, &hq), *k = randn_act(n, 2, &hk), *v = randn_act(n, 3, &hv);
    void *dy = randn_act(n, 4, &hdy);
    void *y = moe_cuda_alloc(n * 2), *dq = moe_cuda_alloc(n * 2), *dk = moe_cuda_alloc(n * 2);
    void *dv = moe_cuda_alloc(n * 2);
    moe_real *lse = moe_cuda_alloc(nl * sizeof(moe_real));
    void *ws = moe_cuda_alloc(moe_cuda_attention_workspace_bytes(s));
    moe_cuda_attention_forward(y, lse, ws, q, k, v, s);
    r->sm90_bwd = checked_backward(r, 0, hq, hk, hv, hdy, y, lse, ws, dq, dk, dv, dy, q, k,
                                   v, s, &r->check);
    const long long calls = moe_cuda_attention_sm90_calls();
    r->fwd = time_op(0, reps, warmup, y, lse, ws, dq, dk, dv, dy, q, k, v, s);
    r->sm90 = moe_cuda_attention_sm90_calls() > calls;
    /* the portable forward on the same inputs, then the caller's setting back */
    moe_bench_env env = moe_bench_env_set("MOE_FLASH_SM90", "0");
    r->fwd_portable = time_op(0, reps, warmup, y, lse, ws, dq, dk, dv, dy, q, k, v, s);
    moe_bench_env_restore(&env);
    r->bwd = time_op(1, reps, warmup, y, lse, ws, dq, dk, dv, dy, q, k, v, s);
    if (r->sm90_bwd) { /* and the portable backward */
        env = moe_bench_env_set("MOE_FLASH_SM90_BWD", "0");
        r->bwd_portable = time_op(1, reps, warmup, y, lse, ws, dq, dk, dv, dy, q, k, v, s);
        moe_bench_env_restore(&env);
    }
    /* the Hopper backward's modes side by side, each checked first (a mode that does not run
     * here, e.g. off sm_90, stays at 0) */
    for (int m = 1; m <= BWD_MODES; m++) {
        char mode[8];
        snprintf(mode, sizeof mode, "%d", m);
        env = moe_bench_env_set("MOE_FLASH_SM90_BWD", mode);
        double err = 0.0;
        if (checked_backward(r, m, hq, hk, hv, hdy, y, lse, ws, dq, dk, dv, dy, q, k, v, s, &err))
            r->bwd_mode[m - 1] = time_op(1, reps, warmup, y, lse, ws, dq, dk, dv, dy, q, k, v, s);
        moe_bench_env_restore(&env);
    }
    r->fb = time_op(2, reps, warmup, y, lse, ws, dq, dk, dv, dy, q, k, v, s);
    moe_real *hbufs[] = {hq, hk, hv, hdy};
    for (size_t i = 0; i < sizeof hbufs / sizeof hbufs[0]; i++)
        free(hbufs[i]);
    void *bufs[] = {q, k, v, dy, y, dq, dk, dv, lse, ws};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        moe_cuda_free(bufs[i]);
}

/* Run the SDPA script once for every shape and fill r[].flash / .cudnn from its lines. */
static void run_sdpa(shape_result *r, int n, const char *python, int reps, int warmup,
                     char *info, size_t cap) {
    char cmd[4096];
    int len = snprintf(cmd, sizeof cmd,
                       "%s chapters/07-long-context/ch07_sdpa.py --repeats %d --warmup %d",
                       python, reps, warmup);
    for (int i = 0; i < n && len < (int)sizeof cmd - 64; i++)
        len += snprintf(cmd + len, sizeof cmd - (size_t)len, " %d,%d,%d,%d", r[i].B, r[i].H,
                        r[i].T, r[i].D);
    len += snprintf(cmd + len, sizeof cmd - (size_t)len, " 2>&1");
    snprintf(info, cap, "not run");
    FILE *f = popen(cmd, "r");
    if (!f) {
        snprintf(info, cap, "could not start %s", python);
        return;
    }
    char line[1024];
    while (fgets(line, sizeof line, f)) {
        char name[64], rest[512];
        int B, H, T, D;
        line[strcspn(line, "\n")] = 0;
        if (strncmp(line, "sdpa unavailable", 16) == 0 || strncmp(line, "sdpa torch", 10) == 0) {
            snprintf(info, cap, "%.200s", line + 5);
            continue;
        }
        if (sscanf(line, "sdpa %63s %d %d %d %d %511[^\n]", name, &B, &H, &T, &D, rest) != 6) {
            fprintf(stderr, "  (sdpa) %s\n", line); /* a traceback or a warning: show it */
            continue;
        }
        for (int i = 0; i < n; i++) {
            if (r[i].B != B || r[i].H != H || r[i].T != T || r[i].D != D)
                continue;
            sdpa_row *row = strcmp(name, "FLASH_ATTENTION") == 0 ? &r[i].flash : &r[i].cudnn;
            if (sscanf(rest, "%lf %lf %lf %lf", &row->fwd, &row->bwd, &row->fb, &row->diff) == 4)
                row->ok = 1;
            else
                fprintf(stderr, "  (sdpa %s T=%d D=%d) %s\n", name, T, D, rest);
        }
    }
    const int rc = pclose(f);
    if (rc != 0)
        fprintf(stderr, "ch07_attention_bench: the SDPA script exited with %d\n", rc);
}

static double tflops(double flops, double ms) { return ms > 0 ? flops / (ms * 1e9) : 0.0; }

/* "x.xx" of a ratio, or "-" when the baseline is missing */
static const char *ratio(char *buf, double ours_ms, const sdpa_row *base, int which) {
    const double b = which == 0 ? base->fwd : which == 1 ? base->bwd : base->fb;
    if (!base->ok || ours_ms <= 0)
        return "-";
    snprintf(buf, 16, "%.2fx", b / ours_ms);
    return buf;
}

/* "ms / TFLOP/s" of one of our timings, or "-" when it was not run (buf: 32 bytes) */
static const char *ms_tf(char *buf, double flops, double ms) {
    if (ms <= 0)
        return "-";
    snprintf(buf, 32, "%.3f / %.0f", ms, tflops(flops, ms));
    return buf;
}

static const char *tf_or_dash(char *buf, double flops, const sdpa_row *row, int which) {
    const double ms = which == 0 ? row->fwd : which == 1 ? row->bwd : row->fb;
    if (!row->ok)
        return "-";
    snprintf(buf, 16, "%.0f", tflops(flops, ms));
    return buf;
}

int main(int argc, char **argv) {
    int seqs[MAX_LIST], dims[MAX_LIST];
    int nseq = moe_bench_parse_ints("1024,4096,16384,32768,65536", seqs, MAX_LIST),
        ndim = moe_bench_parse_ints("64,128", dims, MAX_LIST);
    int tokens = 16384, hidden = 2048, reps = 10, warmup = 3, sdpa = 1;
    const char *python = "python3";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--no-sdpa")) {
            sdpa = 0;
            continue;
        }
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            printf("usage: bin/ch07_attention_bench [--seqs 1024,4096,16384,32768,65536] "
                   "[--dims 64,128]\n"
                   "                                [--tokens 16384] [--hidden 2048] "
                   "[--repeats 10] [--warmup 3]\n"
                   "                                [--python python3 | --no-sdpa]\n"
                   "Causal bf16 flash attention, forward, backward and both, against PyTorch "
                   "SDPA's flash and cuDNN\nbackends in the same run. MOE_FLASH_SM90=0: the "
                   "portable forward only; MOE_FLASH_SM90_BWD=0: the\nportable backward, 1: the "
                   "Hopper backward's two kernels in the main columns (all seven\nHopper modes "
                   "are timed side by side on sm_90 anyway; modes 4, 5, 7 are not "
                   "deterministic)."
                   "\n");
            return 0;
        }
        if (!val) {
            fprintf(stderr, "ch07_attention_bench: %s needs a value (or unknown flag)\n", a);
            return 2;
        }
        i++;
        if (!strcmp(a, "--seqs"))
            nseq = moe_bench_parse_ints(val, seqs, MAX_LIST);
        else if (!strcmp(a, "--dims"))
            ndim = moe_bench_parse_ints(val, dims, MAX_LIST);
        else if (!strcmp(a, "--tokens"))
            tokens = atoi(val);
        else if (!strcmp(a, "--hidden"))
            hidden = atoi(val);
        else if (!strcmp(a, "--repeats"))
            reps = atoi(val);
        else if (!strcmp(a, "--warmup"))
            warmup = atoi(val);
        else if (!strcmp(a, "--python"))
            python = val;
        else {
            fprintf(stderr, "ch07_attention_bench: unknown flag %s (see the file's header)\n", a);
            return 2;
        }
    }
    if (nseq < 1 || ndim < 1) {
        fprintf(stderr, "ch07_attention_bench: --seqs and --dims take a comma list of at most "
                        "%d positive integers (e.g. 4096,16384)\n", MAX_LIST);
        return 2;
    }
    if (reps < 1 || warmup < 0 || tokens < 1 || hidden < 1) {
        fprintf(stderr, "ch07_attention_bench: --repeats >= 1, --warmup >= 0, --tokens and "
                        "--hidden >= 1\n");
        return 2;
    }
    for (int j = 0; j < ndim; j++)
        if (dims[j] < 1 || dims[j] > 128 || hidden % dims[j]) {
            fprintf(stderr, "ch07_attention_bench: --dims: %d is not in 1..128 or does not "
                            "divide --hidden %d\n", dims[j], hidden);
            return 2;
        }
    if (!moe_cuda_available()) {
        printf("ch07_attention_bench: skipped: no GPU\n");
        return 0;
    }
    char dev[256];
    moe_cuda_device_name(dev, sizeof dev);
    moe_bench_header("chapter 07: flash attention, causal bf16, ours vs PyTorch SDPA", dev);
    printf("B = max(1, %d / T) sequences, H = %d / D heads (MHA); median of %d after %d "
           "warm-up; TFLOP/s with causal FLOPs (fwd 2·B·H·T²·D, bwd 2.5x)\n\n",
           tokens, hidden, reps, warmup);

    shape_result res[MAX_LIST * MAX_LIST];
    int n = 0;
    for (int j = 0; j < ndim; j++)
        for (int i = 0; i < nseq; i++) {
            shape_result *r = &res[n++];
            memset(r, 0, sizeof *r);
            r->T = seqs[i];
            r->D = dims[j];
            r->H = hidden / dims[j];
            r->B = tokens / seqs[i] > 1 ? tokens / seqs[i] : 1;
            measure(r, reps, warmup);
            char modes[BWD_MODES * 32] = "";
            for (int m = 0; m < BWD_MODES; m++)
                snprintf(modes + strlen(modes), sizeof modes - strlen(modes),
                         "; mode %d %.3f ms", m + 1, r->bwd_mode[m]);
            fprintf(stderr, "  measured T=%d D=%d: fwd %.3f ms (%s; portable %.3f ms) bwd %.3f "
                    "ms (%s; portable %.3f ms%s) (check %.1e)\n",
                    r->T, r->D, r->fwd, r->sm90 ? "sm90" : "portable", r->fwd_portable,
                    r->bwd, r->sm90_bwd ? "sm90" : "portable",
                    r->sm90_bwd ? r->bwd_portable : r->bwd, modes, r->check);
        }
    char info[512] = "skipped (--no-sdpa)";
    if (sdpa)
        run_sdpa(res, n, python, reps, warmup, info, sizeof info);
    printf("SDPA: %s\n\n", info);
    printf("| T | D | B×H | check | sm90 | fwd ms | fwd TFLOP/s | portable fwd ms | portable "
           "fwd TFLOP/s | sm90 bwd | bwd ms | bwd TFLOP/s | portable bwd ms |");
    for (int m = 1; m <= BWD_MODES; m++)
        printf(" bwd mode %d ms / TFLOP/s |", m);
    printf(" fwd+bwd ms | fwd+bwd TFLOP/s | FLASH fwd / f+b TFLOP/s | cuDNN fwd / f+b TFLOP/s | "
           "fwd vs FLASH / cuDNN | f+b vs FLASH / cuDNN |\n|---:|---:|---:|---:|:---:|---:|---:|"
           "---:|---:|:---:|---:|---:|---:|");
    for (int m = 0; m < BWD_MODES; m++)
        printf("---:|");
    printf("---:|---:|---:|---:|---:|---:|\n");
    for (int i = 0; i < n; i++) {
        const shape_result *r = &res[i];
        const double f = 2.0 * r->B * r->H * (double)r->T * r->T * r->D; /* causal fwd */
        char a[16], b[16], c[16], d[16], e[16], g[16], x[16], z[16], m[32];
        printf("| %d | %d | %d×%d | %.1e | %s | %.3f | %.0f | %.3f | %.0f | %s | %.3f | %.0f "
               "| %.3f |",
               r->T, r->D, r->B, r->H, r->check, r->sm90 ? "yes" : "no", r->fwd,
               tflops(f, r->fwd), r->fwd_portable, tflops(f, r->fwd_portable),
               r->sm90_bwd ? "yes" : "no", r->bwd, tflops(2.5 * f, r->bwd),
               r->sm90_bwd ? r->bwd_portable : r->bwd);
        for (int k = 0; k < BWD_MODES; k++)
            printf(" %s |", ms_tf(m, 2.5 * f, r->bwd_mode[k]));
        printf(" %.3f | %.0f | %s / %s | %s / %s | %s / %s | %s / %s |\n", r->fb,
               tflops(3.5 * f, r->fb),
               tf_or_dash(a, f, &r->flash, 0), tf_or_dash(b, 3.5 * f, &r->flash, 2),
               tf_or_dash(c, f, &r->cudnn, 0), tf_or_dash(d, 3.5 * f, &r->cudnn, 2),
               ratio(e, r->fwd, &r->flash, 0), ratio(g, r->fwd, &r->cudnn, 0),
               ratio(x, r->fb, &r->flash, 2), ratio(z, r->fb, &r->cudnn, 2));
    }
    printf("\nratios: SDPA time / ours (> 1: ours faster). check: sampled rows vs a double "
           "reference (bound %.0e). SDPA flash vs cuDNN outputs differ by at most:", CHECK_TOL);
    for (int i = 0; i < n; i++)
        if (res[i].flash.ok)
            printf(" %.1e", res[i].flash.diff);
    printf("\n");
    return 0;
}
