/*
 * Chapter 03 benchmark: the expert GEMMs alone, backend by backend. For one MoE layer
 * shape, the T·k routed rows are split over E experts as a uniform top-k router splits
 * them (each token picks k distinct experts at random: ragged, a few percent apart), and
 * each of the six GEMMs of the experts' forward + backward is timed on its own:
 *
 *   fc1 forward  gu[n,2F] = x[n,H] · w1_eᵀ        fc2 forward  y[n,H] = h[n,F] · w2_eᵀ
 *   fc1 dgrad    dx[n,H] += dgu · w1_e            fc2 dgrad    dh[n,F] += dy · w2_e
 *   fc1 wgrad    dw1_e += dguᵀ · x  (fp32)        fc2 wgrad    dw2_e += dyᵀ · h  (fp32)
 *
 * for each expert backend (loop = one cublasGemmEx per expert, chapter 01; cublas-grouped
 * = cublasGemmGroupedBatchedEx; grouped = our sm_90a kernel), with the dense bf16 cuBLAS
 * GEMM of 8192³ measured in the same run as the ceiling (every TFLOP/s of our kernel is
 * also given as a % of it). Each backend runs as the MoE layer uses it: dgrad into a
 * fresh buffer is an accumulate (beta = 1) for cuBLAS, whose caller zeroes the buffer
 * first (not timed here), and a plain store for our kernel.
 *
 * wgrad is bound by moving the weight gradient, so its rows also give the achieved
 * bandwidth: the bytes the GEMM must move (the two bf16 activations it reads, 2·n·(I+O),
 * plus dw: read and written when added, 8·E·O·I; written once when stored, 4·E·O·I, or
 * in bf16, 2·E·O·I) over its time. Our kernel's wgrad runs in its three modes
 * (moe_dw_mode): reduce-add into fp32 (later micro-batches), store fp32 (the first
 * micro-batch, when the buffer holds zeros) and store bf16 (as torch._grouped_mm). The whole layer (router,
 * permutation, SwiGLU, combine) is timed by chapter 01's layer benchmark, with
 * --breakdown for its time shares (chapters/03-grouped-gemm/bench.sh runs both).
 * Timing: the backend's timer (CUDA events), warm-up, median of repeats.
 *
 * Our kernel's forward/dgrad schedule is the library's default, or MOE_GROUPED_SCHEDULE
 * (kernels/cuda_ops.h): the header says which.
 *
 * --shape fine: the fine-grained regime (many experts of a few hundred rows, H = 4096,
 * F = 1536), forward and dgrad only, our kernel under each of its nine tile schedules
 * (moe_grouped_schedule: 128-row tiles only, a group's last <= 64 rows in a 64 × 256
 * tile, those rows with the 128 before them in 192-row tiles that share the weight
 * block, or those rows computed transposed with 16, 32 or 64 token columns (swaptail),
 * or 2-CTA clusters whose CTAs take m-tiles 2i, 2i + 1 and load the weights once (mc2);
 * tiles taken statically, CTA b runs b, b + grid, ..., or claimed in order from a
 * device counter; --schedules picks some) against the per-expert cuBLAS loop, in the
 * same run: a uniform top-k
 * router at T = 8192, k = 8 with E = 64, 128, 256 experts; every expert given exactly r
 * rows, r on both sides of multiples of 64 and 128; and the cliff, r in steps of 1 to 4
 * from 120 to 136 and from 250 to 260 (where 128-row tiles cost a whole tile more past
 * each multiple of 128); --rows picks other r. The implementations of each GEMM are timed
 * interleaved (time_interleaved). Each GEMM's output is checked against the loop's
 * before its times are printed; a summary table of the four GEMMs together closes the run.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "bench.h"
#include "flags.h"
#include "log.h"
#include "rng.h"
#ifdef MOE_HAVE_CUDA
#include "cuda_ops.h" /* the wgrad split to report; the old tile schedule, for comparison */
#endif

typedef struct opts {
    char device[MOE_FLAG_STR_LEN];
    char shape[MOE_FLAG_STR_LEN];
    char rows[MOE_FLAG_STR_LEN];
    char schedules[MOE_FLAG_STR_LEN];
    int warmup, repeats;
} opts;

#define OF(name, type, field, def, help, choices) \
    { name, type, offsetof(opts, field), def, help, choices, "benchmark" }
static const moe_flag g_flags[] = {
    OF("device", MOE_FLAG_CHOICE, device, "auto", "backend (auto = cuda when a GPU is present)",
       "auto|cpu|cuda"),
    OF("shape", MOE_FLAG_CHOICE, shape, "auto",
       "layer shape (auto = qwen3 and mixtral on a GPU, small on the CPU)",
       "auto|all|models|sweep|big|qwen3|mixtral|qwen3-235b|dsv2-lite|sweep64|sweep128|"
       "sweep256|sweep512|sweep1024|sweep2048|sweep4096|sweep8192|small|preset|fine"),
    OF("rows", MOE_FLAG_STRING, rows, "",
       "--shape fine: only these rows per expert, comma-separated (e.g. 128,130); empty = "
       "the whole sweep", NULL),
    OF("schedules", MOE_FLAG_STRING, schedules, "",
       "--shape fine: only these tile schedules of our kernel, comma-separated (e.g. "
       "static,static-swaptail); empty = all nine", NULL),
    OF("warmup", MOE_FLAG_INT, warmup, "2", "untimed runs of each GEMM first", NULL),
    OF("repeats", MOE_FLAG_INT, repeats, "7", "timed runs (the median is reported)", NULL),
};

typedef moe_bench_shape shape;

/* KERNEL: our kernel under the default schedule (or MOE_GROUPED_SCHEDULE's);
 * SCHED + s: under the moe_grouped_schedule s, timed by --shape fine only */
enum { LOOP, CUBLAS, KERNEL, N_IMPL, SCHED = N_IMPL };
#define N_SCHED 9

/* --shape fine: the schedules timed, in the order --schedules names them (all by default) */
static int g_sel[N_SCHED], g_nsel;

#ifdef MOE_HAVE_CUDA
static moe_grouped_schedule g_default_sched; /* the schedule KERNEL runs under */
_Static_assert(N_SCHED == MOE_GROUPED_SCHED_COUNT, "one column per schedule of the kernel");
#endif

/* One GEMM of the six: C (+)= A·Bᵀ-shaped problem on the stacked expert weights. */
typedef struct problem {
    const char *name;
    int I, O;     /* the Linear: in features, out features */
    int backward; /* 0 = forward, 1 = dgrad, 2 = wgrad */
    moe_dw_mode dw_mode; /* wgrad: how dw leaves (anything but ACCUMULATE: our kernel only) */
} problem;

typedef struct bufs {
    void *in, *out, *w, *dout, *din;
    moe_real *dw;
    int *dev_off;
} bufs;

static void run_once(const moe_backend *be, int impl, const problem *p, const bufs *b,
                     const int *off, int G) {
    const int N = off[G];
#ifdef MOE_HAVE_CUDA
    if (be->device == MOE_DEVICE_CUDA && impl >= KERNEL)
        moe_cuda_grouped_sm90_set_schedule(impl == KERNEL ? g_default_sched
                                                           : (moe_grouped_schedule)(impl - SCHED));
#endif
    if (impl >= SCHED)
        impl = KERNEL;
    if (p->backward == 0) {
        if (impl == KERNEL)
            be->grouped_matmul_forward_dev(b->out, b->in, b->w, b->dev_off, G, N, p->I, p->O);
        else if (impl == CUBLAS)
            be->grouped_matmul_forward(b->out, b->in, b->w, off, G, p->I, p->O);
        else
            for (int g = 0; g < G; g++)
                be->matmul_forward(MOE_ACT(be, b->out, (size_t)off[g] * p->O),
                                   MOE_ACT(be, b->in, (size_t)off[g] * p->I),
                                   MOE_ACT(be, b->w, (size_t)g * p->O * p->I),
                                   off[g + 1] - off[g], p->I, p->O);
        return;
    }
    void *din = p->backward == 1 ? b->din : NULL;
    moe_real *dw = p->backward == 2 ? b->dw : NULL;
    if (impl == KERNEL)
        be->grouped_matmul_backward_dev(din, dw, b->dout, b->in, b->w, b->dev_off, G, N, p->I,
                                        p->O, 0, p->dw_mode);
    else if (impl == CUBLAS)
        be->grouped_matmul_backward(din, dw, b->dout, b->in, b->w, off, G, p->I, p->O);
    else
        for (int g = 0; g < G; g++) {
            const size_t o = (size_t)off[g];
            be->matmul_backward(din ? MOE_ACT(be, din, o * p->I) : NULL,
                                dw ? dw + (size_t)g * p->O * p->I : NULL,
                                MOE_ACT(be, b->dout, o * p->O), MOE_ACT(be, b->in, o * p->I),
                                MOE_ACT(be, b->w, (size_t)g * p->O * p->I), off[g + 1] - off[g],
                                p->I, p->O);
        }
}

static double time_ms(const moe_backend *be, const opts *o, int impl, const problem *p,
                      const bufs *b, const int *off, int G) {
    for (int i = 0; i < o->warmup; i++)
        run_once(be, impl, p, b, off, G);
    double *ms = malloc(sizeof(double) * o->repeats);
    MOE_ASSERT(ms != NULL);
    for (int r = 0; r < o->repeats; r++) {
        be->timer_begin();
        run_once(be, impl, p, b, off, G);
        ms[r] = be->timer_end_ms();
    }
    const double med = moe_median(ms, o->repeats);
    free(ms);
    return med;
}

/* The median times of n implementations of one GEMM, measured INTERLEAVED: warm-up and
 * every repeat run each implementation once in turn, so a drift of the clocks during the
 * measurement (the GPU heating up, its power limit) is shared by all of them instead of
 * favouring whichever ran first. */
static void time_interleaved(const moe_backend *be, const opts *o, const int *impls, int n,
                             const problem *p, const bufs *b, const int *off, int G,
                             double *med) {
    double *ms = malloc(sizeof(double) * (size_t)n * o->repeats);
    MOE_ASSERT(ms != NULL);
    for (int i = 0; i < o->warmup; i++)
        for (int j = 0; j < n; j++)
            run_once(be, impls[j], p, b, off, G);
    for (int r = 0; r < o->repeats; r++)
        for (int j = 0; j < n; j++) {
            be->timer_begin();
            run_once(be, impls[j], p, b, off, G);
            ms[(size_t)j * o->repeats + r] = be->timer_end_ms();
        }
    for (int j = 0; j < n; j++)
        med[j] = moe_median(ms + (size_t)j * o->repeats, o->repeats);
    free(ms);
}

/* expert sizes of a uniform top-k router: every token picks k distinct experts */
static void uniform_topk_offsets(int *off, const shape *s) {
    int *cnt = calloc((size_t)s->E, sizeof(int)), pick[64];
    MOE_ASSERT(cnt != NULL && s->k <= 64);
    uint64_t draw = 0;
    for (int t = 0; t < s->T; t++)
        for (int j = 0; j < s->k; j++) {
            int e, dup;
            do {
                e = (int)(moe_rng_uniform(3, 7, draw++) * s->E) % s->E;
                dup = 0;
                for (int q = 0; q < j; q++)
                    dup |= pick[q] == e;
            } while (dup);
            pick[j] = e;
            cnt[e]++;
        }
    off[0] = 0;
    for (int e = 0; e < s->E; e++)
        off[e + 1] = off[e] + cnt[e];
    free(cnt);
}

static void fill(const moe_backend *be, void *act, size_t n, uint64_t stream, double sd) {
    moe_real *tmp = be->alloc(sizeof(moe_real) * n);
    MOE_ASSERT(tmp != NULL);
    be->fill_normal(tmp, n, 5, stream, sd);
    be->cast_to_act(act, tmp, n);
    be->free(tmp);
}

/* the bytes a wgrad must move (see the top of the file) */
static double wgrad_bytes(const problem *p, size_t N, int G, size_t act) {
    const double w = (double)G * p->O * p->I;
    const double dw = p->dw_mode == MOE_DW_ACCUMULATE ? 8 * w : p->dw_mode == MOE_DW_STORE ? 4 * w
                                                                                          : act * w;
    return (double)act * N * (p->I + p->O) + dw;
}

/* buffers for the six GEMMs of a layer with G experts over off[G] rows, filled with
 * normals (no dw when wgrad is not timed) */
static void bufs_init(const moe_backend *be, bufs *b, const int *off, int G, int H, int F,
                      int with_dw) {
    const size_t N = (size_t)off[G], S = be->act_size;
    const size_t wide = (size_t)(2 * F > H ? 2 * F : H);
    memset(b, 0, sizeof *b);
    b->in = be->alloc(S * N * wide);
    b->out = be->alloc(S * N * wide);
    b->dout = be->alloc(S * N * wide);
    b->din = be->alloc(S * N * wide);
    b->w = be->alloc(S * (size_t)G * 2 * F * H);
    if (with_dw)
        b->dw = be->alloc(sizeof(moe_real) * (size_t)G * 2 * F * H);
    b->dev_off = be->alloc(sizeof(int) * (G + 1));
    MOE_ASSERT(b->in && b->out && b->dout && b->din && b->w && (b->dw || !with_dw) && b->dev_off);
    fill(be, b->in, N * wide, 1, 1.0);
    fill(be, b->dout, N * wide, 2, 1.0);
    fill(be, b->w, (size_t)G * 2 * F * H, 3, 0.02);
    be->from_host(b->dev_off, off, sizeof(int) * (G + 1));
}

static void bufs_free(const moe_backend *be, bufs *b) {
    be->free(b->in); be->free(b->out); be->free(b->dout); be->free(b->din); be->free(b->w);
    be->free(b->dw); be->free(b->dev_off);
}

/* the smallest and largest group of off[0..G] */
static void group_range(const int *off, int G, int *lo, int *hi) {
    *lo = *hi = off[1] - off[0];
    for (int g = 0; g < G; g++) {
        const int c = off[g + 1] - off[g];
        *lo = c < *lo ? c : *lo;
        *hi = c > *hi ? c : *hi;
    }
}

static void run_shape(const moe_backend *be, const shape *s, const opts *o, double dense) {
    const int G = s->E, H = s->H, F = s->F;
    int *off = malloc(sizeof(int) * (G + 1));
    MOE_ASSERT(off != NULL);
    uniform_topk_offsets(off, s);
    const size_t N = (size_t)off[G], S = be->act_size;
    int lo, hi;
    group_range(off, G, &lo, &hi);
    const problem probs[10] = {
        {"fc1 forward", H, 2 * F, 0, 0},  {"fc2 forward", F, H, 0, 0},
        {"fc1 dgrad", H, 2 * F, 1, 0},    {"fc2 dgrad", F, H, 1, 0},
        {"fc1 wgrad +=", H, 2 * F, 2, MOE_DW_ACCUMULATE},
        {"fc2 wgrad +=", F, H, 2, MOE_DW_ACCUMULATE},
        {"fc1 wgrad =", H, 2 * F, 2, MOE_DW_STORE},
        {"fc2 wgrad =", F, H, 2, MOE_DW_STORE},
        {"fc1 wgrad bf16", H, 2 * F, 2, MOE_DW_ACT},
        {"fc2 wgrad bf16", F, H, 2, MOE_DW_ACT}};
    bufs b;
    bufs_init(be, &b, off, G, H, F, 1);

    printf("\n%s: T=%d H=%d F=%d E=%d k=%d -> %zu rows, %d..%d per expert\n", s->name, s->T, H, F,
           G, s->k, N, lo, hi);
#ifdef MOE_HAVE_CUDA
    if (be->device == MOE_DEVICE_CUDA)
        printf("our wgrad splits each group's rows into %d (fc1) and %d (fc2) chunks\n",
               moe_cuda_grouped_sm90_wgrad_split(G, (int)N, H, 2 * F),
               moe_cuda_grouped_sm90_wgrad_split(G, (int)N, F, H));
#endif
    printf("| GEMM           |  GFLOP | loop ms | TFLOP/s | cublas-grouped ms | TFLOP/s | grouped "
           "ms | TFLOP/s | grouped %% of dense | grouped vs loop |\n"
           "|---|---|---|---|---|---|---|---|---|---|\n");
    double tot[N_IMPL] = {0};
    for (int i = 0; i < 10; i++) {
        const problem *p = &probs[i];
        const double flop = 2.0 * N * p->I * p->O;
        double ms[N_IMPL] = {0};
        for (int impl = 0; impl < N_IMPL; impl++) {
            if (impl != KERNEL && p->dw_mode != MOE_DW_ACCUMULATE)
                continue; /* the cuBLAS backends only add into fp32 */
            ms[impl] = time_ms(be, o, impl, p, &b, off, G);
            if (i < 6)
                tot[impl] += ms[impl];
        }
        printf("| %-14s | %6.1f |", p->name, flop / 1e9);
        for (int impl = 0; impl < N_IMPL; impl++) {
            if (ms[impl] == 0) {
                printf("       - |       - |");
                continue;
            }
            printf(" %7.3f | %7.1f", ms[impl], flop / (ms[impl] * 1e-3) / 1e12);
            if (p->backward == 2) /* wgrad: also the bandwidth it reached */
                printf(" (%.0f GB/s)", wgrad_bytes(p, N, G, S) / (ms[impl] * 1e-3) / 1e9);
            printf(" |");
        }
        printf(" %5.1f%% |", 100.0 * flop / (ms[KERNEL] * 1e-3) / 1e12 / dense);
        if (ms[LOOP] > 0)
            printf(" %.2fx |\n", ms[LOOP] / ms[KERNEL]);
        else
            printf(" - |\n");
    }
    const double flop = 6.0 * 3.0 * N * H * F;
    printf("| all six (+=)   | %6.1f |", flop / 1e9);
    for (int impl = 0; impl < N_IMPL; impl++)
        printf(" %7.3f | %7.1f |", tot[impl], flop / (tot[impl] * 1e-3) / 1e12);
    printf(" %5.1f%% | %.2fx |\n", 100.0 * flop / (tot[KERNEL] * 1e-3) / 1e12 / dense,
           tot[LOOP] / tot[KERNEL]);
    bufs_free(be, &b);
    free(off);
}

/* the dense bf16 ceiling: one 8192³ (GPU) or 1024³ (CPU) cuBLAS/CPU GEMM, in TFLOP/s */
static double dense_peak(const moe_backend *be, const opts *o) {
    const int n = be->device == MOE_DEVICE_CPU ? 1024 : 8192;
    const size_t S = be->act_size, nn = (size_t)n * n;
    bufs b = {0};
    b.in = be->alloc(S * nn);
    b.w = be->alloc(S * nn);
    b.out = be->alloc(S * nn);
    MOE_ASSERT(b.in && b.w && b.out);
    fill(be, b.in, nn, 4, 1.0);
    fill(be, b.w, nn, 5, 0.02);
    const int off[2] = {0, n};
    const problem p = {"dense", n, n, 0, MOE_DW_ACCUMULATE};
    const double ms = time_ms(be, o, LOOP, &p, &b, off, 1);
    const double tf = 2.0 * n * nn / (ms * 1e-3) / 1e12;
    printf("dense GEMM %d^3 (the ceiling of this device): %.3f ms, %.1f TFLOP/s\n", n, ms, tf);
    be->free(b.in); be->free(b.w); be->free(b.out);
    return tf;
}

/* relative L2 error of a against ref (infinite where a has a NaN: an unwritten element of
 * a poisoned output) */
static double rel_err(const moe_real *a, const moe_real *ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i]))
            return INFINITY;
        num += ((double)a[i] - ref[i]) * ((double)a[i] - ref[i]);
        den += (double)ref[i] * ref[i];
    }
    return sqrt(num / (den > 0 ? den : 1e-30));
}

/* the schedules' names, for the tables (the CPU has none: it runs the same loop for each) */
static const char *sched_name(int s) {
#ifdef MOE_HAVE_CUDA
    return moe_cuda_grouped_sm90_schedule_name((moe_grouped_schedule)s);
#else
    static const char *n[N_SCHED] = {"static",          "static-tail64",    "dynamic",
                                     "dynamic-tail64",  "static-share192",  "dynamic-share192",
                                     "static-swaptail", "dynamic-swaptail", "static-mc2"};
    return n[s];
#endif
}

/* the totals of one fine-grained case, for the closing summary */
typedef struct fine_total {
    char title[96];
    int rows, lo, hi;
    double gflop, ms[1 + N_SCHED]; /* the loop, then each selected schedule */
} fine_total;

/* One fine-grained case: the forward and dgrad GEMMs of both Linears, the per-expert loop
 * vs our kernel under each schedule. Before timing, each kernel output (poisoned with NaN
 * first) is compared with the loop's. Returns the worst relative error; *tot gets the
 * four GEMMs' total per implementation. */
static double run_fine_case(const moe_backend *be, const opts *o, const char *title,
                            const int *off, int G, int H, int F, fine_total *tot) {
    bufs b;
    bufs_init(be, &b, off, G, H, F, 0);
    const size_t N = (size_t)off[G], S = be->act_size;
    int lo, hi;
    group_range(off, G, &lo, &hi);
    printf("\n%s -> %zu rows, %d..%d per expert\n", title, N, lo, hi);
    printf("| GEMM        |  GFLOP | loop ms | TFLOP/s |");
    for (int j = 0; j < g_nsel; j++)
        printf(" %s ms | TFLOP/s |", sched_name(g_sel[j]));
    printf(" %s vs %s | vs loop | rel err vs loop |\n|---|---|---|---|",
           sched_name(g_sel[g_nsel - 1]), sched_name(g_sel[0]));
    for (int j = 0; j < g_nsel; j++)
        printf("---|---|");
    printf("---|---|---|\n");
    const problem probs[4] = {{"fc1 forward", H, 2 * F, 0, 0}, {"fc2 forward", F, H, 0, 0},
                              {"fc1 dgrad", H, 2 * F, 1, 0},   {"fc2 dgrad", F, H, 1, 0}};
    const int NJ = 1 + g_nsel; /* the loop, then each selected schedule */
    double worst = 0;
    memset(tot, 0, sizeof *tot);
    snprintf(tot->title, sizeof tot->title, "%s", title);
    tot->rows = (int)N;
    tot->lo = lo;
    tot->hi = hi;
    for (int i = 0; i < 4; i++) {
        const problem *p = &probs[i];
        const size_t n = N * (size_t)(p->backward ? p->I : p->O);
        void *dst = p->backward ? b.din : b.out;
        moe_real *ref = malloc(sizeof(moe_real) * n), *got = malloc(sizeof(moe_real) * n);
        MOE_ASSERT(ref && got);
        double err = 0, ms[1 + N_SCHED];
        int impls[1 + N_SCHED];
        for (int j = 0; j < NJ; j++)
            impls[j] = j ? SCHED + g_sel[j - 1] : LOOP;
        for (int j = 0; j < NJ; j++) {
            const int impl = impls[j];
            if (j == 0) { /* the loop's dgrad adds into its output (beta = 1): start at 0 */
                be->zero(dst, S * n);
            } else {
                for (size_t e = 0; e < n; e++)
                    got[e] = (moe_real)NAN;
                be->write_act(dst, got, n);
            }
            run_once(be, impl, p, &b, off, G);
            be->read_act(j ? got : ref, dst, n);
            if (j) {
                const double e = rel_err(got, ref, n);
                err = e > err ? e : err;
            }
        }
        time_interleaved(be, o, impls, NJ, p, &b, off, G, ms);
        for (int j = 0; j < NJ; j++)
            tot->ms[j] += ms[j];
        const double flop = 2.0 * N * p->I * p->O;
        printf("| %-11s | %6.1f |", p->name, flop / 1e9);
        for (int j = 0; j < NJ; j++)
            printf(" %7.3f | %7.1f |", ms[j], flop / (ms[j] * 1e-3) / 1e12);
        printf(" %.2fx | %.2fx | %.1e%s |\n", ms[1] / ms[NJ - 1], ms[0] / ms[NJ - 1], err,
               err <= 1e-2 ? "" : " WRONG");
        worst = err > worst ? err : worst;
        free(ref);
        free(got);
    }
    tot->gflop = 2.0 * 3.0 * 2.0 * N * H * F / 1e9; /* both Linears, forward + dgrad */
    printf("| all four    | %6.1f |", tot->gflop);
    for (int j = 0; j < NJ; j++)
        printf(" %7.3f | %7.1f |", tot->ms[j], tot->gflop / tot->ms[j]);
    printf(" %.2fx | %.2fx | |\n", tot->ms[1] / tot->ms[NJ - 1], tot->ms[0] / tot->ms[NJ - 1]);
    bufs_free(be, &b);
    return worst;
}

/* --schedules: the selected schedules into g_sel (all when empty); 0, or -1 on a bad name */
static int select_schedules(const char *list) {
    g_nsel = 0;
    if (!*list) {
        for (int s = 0; s < N_SCHED; s++)
            g_sel[g_nsel++] = s;
        return 0;
    }
    for (const char *c = list; *c;) {
        const size_t len = strcspn(c, ",");
        int found = -1;
        for (int s = 0; s < N_SCHED; s++)
            if (strlen(sched_name(s)) == len && !strncmp(c, sched_name(s), len))
                found = s;
        if (found < 0 || g_nsel == N_SCHED)
            return -1;
        g_sel[g_nsel++] = found;
        c += len;
        if (*c == ',')
            c++;
    }
    return g_nsel > 0 ? 0 : -1;
}

/* --shape fine: many experts of a few hundred rows each; returns the worst error seen */
static double run_fine(const moe_backend *be, const opts *o) {
    if (select_schedules(o->schedules) != 0) {
        moe_log_error("--schedules %s: want comma-separated schedule names (static, "
                      "static-tail64, dynamic, dynamic-tail64, static-share192, "
                      "dynamic-share192, static-swaptail, dynamic-swaptail)", o->schedules);
        exit(2);
    }
    const int cpu = be->device == MOE_DEVICE_CPU; /* the CPU runs a small copy of the sweep */
    const int H = cpu ? 256 : 4096, F = cpu ? 128 : 1536, T = cpu ? 1024 : 8192, k = 8;
    const int Es[3] = {64, 128, 256};
    /* a few sizes around multiples of 64, then the cliff: 120..136 and 250..260 (on the
     * CPU, a few of them) */
    int rs[64], nr = 0;
    const int around64[4] = {64, 65, 192, 193};
    for (int i = 0; i < 4; i++)
        rs[nr++] = around64[i];
    const int cliff[15] = {120, 124, 127, 128, 129, 130, 132, 136,
                           250, 254, 255, 256, 257, 258, 260};
    for (int i = 0; i < 15; i += cpu ? 7 : 1)
        rs[nr++] = cliff[i];
    const int only = o->rows[0] != 0; /* --rows: just those exact cases */
    if (only) {
        nr = 0;
        for (const char *c = o->rows; *c && nr < 64;) {
            char *end;
            const long r = strtol(c, &end, 10);
            if (end == c || r < 1 || r > 4096) {
                moe_log_error("--rows %s: want comma-separated rows per expert in 1..4096 "
                              "(e.g. --rows 128,130)", o->rows);
                exit(2);
            }
            rs[nr++] = (int)r;
            c = *end == ',' ? end + 1 : end;
        }
    }
    const int E_exact = cpu ? 16 : 128;
    int *off = malloc(sizeof(int) * (256 + 1));
    fine_total *tots = malloc(sizeof(fine_total) * (3 + (size_t)nr));
    MOE_ASSERT(off != NULL && tots != NULL);
    char title[96];
    double worst = 0, e;
    int nt = 0;
    for (int i = 0; i < (only ? 0 : 3); i++) {
        const shape s = {"fine", T, H, F, Es[i], k};
        uniform_topk_offsets(off, &s);
        snprintf(title, sizeof title, "fine, uniform top-k router: T=%d H=%d F=%d E=%d k=%d", T,
                 H, F, Es[i], k);
        e = run_fine_case(be, o, title, off, Es[i], H, F, &tots[nt++]);
        worst = e > worst ? e : worst;
    }
    for (int i = 0; i < nr; i++) {
        for (int g = 0; g <= E_exact; g++)
            off[g] = g * rs[i];
        snprintf(title, sizeof title, "fine, exactly %d rows per expert: H=%d F=%d E=%d", rs[i], H,
                 F, E_exact);
        e = run_fine_case(be, o, title, off, E_exact, H, F, &tots[nt++]);
        worst = e > worst ? e : worst;
    }
    /* the summary: the four GEMMs together per case, ms (and TFLOP/s) per implementation */
    printf("\nsummary, forward + dgrad of both Linears (all four GEMMs), ms and TFLOP/s\n"
           "| case | rows per expert | GFLOP | loop |");
    for (int j = 0; j < g_nsel; j++)
        printf(" %s |", sched_name(g_sel[j]));
    printf(" %s vs %s |\n|---|---|---|---|", sched_name(g_sel[g_nsel - 1]), sched_name(g_sel[0]));
    for (int j = 0; j < g_nsel; j++)
        printf("---|");
    printf("---|\n");
    for (int i = 0; i < nt; i++) {
        const fine_total *t = &tots[i];
        printf("| %s | %d..%d | %.1f |", t->lo == t->hi ? "exact" : "uniform", t->lo, t->hi,
               t->gflop);
        for (int j = 0; j < 1 + g_nsel; j++)
            printf(" %.3f (%.0f) |", t->ms[j], t->gflop / t->ms[j]);
        printf(" %.2fx |\n", t->ms[1] / t->ms[g_nsel]);
    }
    free(tots);
    free(off);
    return worst;
}

int main(int argc, char **argv) {
    opts o;
    moe_error err;
    const int nflags = (int)(sizeof g_flags / sizeof g_flags[0]);
    moe_flags_set_defaults(g_flags, nflags, &o);
    moe_status st = moe_flags_parse(g_flags, nflags, &o, argc, argv, &err);
    if (st == MOE_ERR_HELP) {
        moe_flags_print_help(stdout, "ch03_grouped_gemm_bench",
                             "Chapter 03: the expert GEMMs per backend, timed.", g_flags, nflags);
        return 0;
    }
    if (st != MOE_OK) {
        moe_log_error("%s", err.msg);
        return 2;
    }
    if (o.repeats < 1 || o.warmup < 0) {
        moe_log_error("--repeats must be >= 1 and --warmup >= 0");
        return 2;
    }
    const moe_backend *be = NULL;
    if (moe_backend_select(o.device, &be, &err) != MOE_OK) {
        moe_log_error("%s", err.msg);
        return 2;
    }
    char dev[256];
    be->device_name(dev, sizeof dev);
    moe_bench_header("ch03 expert GEMMs, per backend", dev);
    printf("%s inputs, fp32 accumulation (wgrad into fp32). Median of %d after %d warm-up.\n",
           be->act_size == 2 ? "bf16" : "fp32", o.repeats, o.warmup);
    if (be->device == MOE_DEVICE_CPU)
        printf("(on the CPU every backend is the same loop over experts)\n");
#ifdef MOE_HAVE_CUDA
    g_default_sched = moe_cuda_grouped_sm90_schedule();
    if (be->device == MOE_DEVICE_CUDA)
        printf("our kernel's forward/dgrad tile schedule: %s (MOE_GROUPED_SCHEDULE, "
               "kernels/cuda_ops.h)\n", sched_name(g_default_sched));
    if (be->device == MOE_DEVICE_CUDA && moe_cuda_grouped_sm90_wgrad_pingpong())
        printf("our kernel's unsplit wgrad: the ping-pong kernel (MOE_GROUPED_WGRAD_PINGPONG, "
               "kernels/grouped_wgrad_pingpong_sm90.cu)\n");
#endif
    const double dense = dense_peak(be, &o);
    if (!strcmp(o.shape, "fine")) {
        const double worst = run_fine(be, &o);
        if (worst > 1e-2) {
            moe_log_error("a grouped GEMM output differs from the per-expert loop (relative "
                          "error %.1e > 1e-2): the times above are not to be trusted", worst);
            return 1;
        }
        return 0;
    }
    int n_shapes;
    const moe_bench_shape *shapes = moe_bench_shapes(&n_shapes);
    for (int i = 0; i < n_shapes; i++)
        if (moe_bench_shape_wanted(o.shape, shapes[i].name, be->device != MOE_DEVICE_CPU))
            run_shape(be, &shapes[i], &o, dense);
    return 0;
}
