/*
 * Chapter 03's kernel ladder: the grouped GEMM's forward problem, step by step.
 *
 *   out_g[n, O] = in_g[n, I] · w_gᵀ  for every expert g, rows of in grouped by expert
 *   (group g owns rows [off[g], off[g+1]), off[] in DEVICE memory, groups ragged);
 *   bf16 in, bf16 out, fp32 accumulation.
 *
 *   v1  SIMT: CUDA cores, shared-memory tiling, tile -> group on the device  (v1_simt.cuh)
 *   v2  wgmma: tensor cores, shared memory filled by the threads             (v2_wgmma.cuh)
 *   v3  TMA + mbarrier pipeline, producer warp + 2 consumer warpgroups       (v3_tma_pipeline.cuh)
 *   v4  the library's kernel: persistent, TMA-store epilogue                 (kernels/grouped_gemm_sm90.cu)
 *
 * As in llm.c's dev/cuda: one program, the version picked on the command line, each
 * version checked against a reference before it is timed. The reference is chapter 01's
 * loop (one cuBLAS GEMM per expert), itself first checked against an fp64 CPU computation
 * on sampled rows. Each version's output is poisoned (NaN) before its checked run, and
 * every element is compared. Timing: CUDA events on the library's stream, warm-up, median
 * of repeats; the dense bf16 cuBLAS GEMM of 8192³ is measured in the same run as the
 * ceiling. Routing is skewed like a trained router's: expert popularity is log-normal, and
 * every token picks top-k distinct experts by it.
 *
 *   make ch03-versions && bin/ch03_versions            (every version, both shapes)
 *   bin/ch03_versions 3 --shape mixtral                (v3 only)
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_common.cuh"
#include "cuda_ops.h"
#include "moe/tile_schedule.h"
#include "sm90_ptx.cuh"
#include "wgmma.cuh"
extern "C" {
#include "bench.h"
#include "rng.h"
}

#include "common.cuh"
#include "v1_simt.cuh"
#include "v2_wgmma.cuh"
#include "v3_tma_pipeline.cuh"

namespace v4 { /* the library's launcher, as the MoE layer calls it */
static void forward(moe_bf16 *out, const moe_bf16 *in, const moe_bf16 *w, const int *dev_off,
                    int G, int rows, int I, int O) {
    moe_cuda_grouped_sm90_forward(out, in, w, dev_off, G, rows, I, O);
}
} /* namespace v4 */

typedef void (*forward_fn)(moe_bf16 *, const moe_bf16 *, const moe_bf16 *, const int *, int, int,
                           int, int);
struct version {
    const char *name, *what;
    forward_fn fn;
    int hopper; /* needs sm_90a */
};
static const version g_versions[] = {
    {"v1 SIMT", "CUDA cores, smem tiling, device offsets", v1::forward, 0},
    {"v2 wgmma", "tensor cores, smem filled by threads", v2::forward, 1},
    {"v3 TMA pipeline", "TMA + 4-stage mbarrier ring, warp-specialised", v3::forward, 1},
    {"v4 library", "persistent, TMA-store epilogue (grouped_gemm_sm90.cu)", v4::forward, 1},
};
constexpr int N_VERSIONS = sizeof g_versions / sizeof g_versions[0];

/* ---------------------------------------------------------------- checking */

/* count the elements of got that differ from want by more than atol + rtol·|want| (NaN
 * counts: the poison of an unwritten element), and the first such index */
__global__ void compare_kernel(const moe_bf16 *got, const moe_bf16 *want, size_t n, float atol,
                               float rtol, unsigned long long *bad, unsigned long long *first) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float a = __bfloat162float(got[i]), b = __bfloat162float(want[i]);
        if (!(fabsf(a - b) <= atol + rtol * fabsf(b))) {
            atomicAdd(bad, 1ull);
            atomicMin(first, (unsigned long long)i);
        }
    }
}

static float bf16_to_float(moe_bf16 x) { return __bfloat162float(x); }

/* returns the number of bad elements (0 = every element agrees) */
static size_t compare(const moe_bf16 *got, const moe_bf16 *want, int rows, int O, float scale) {
    unsigned long long *d = (unsigned long long *)moe_cuda_alloc(2 * sizeof(unsigned long long));
    const unsigned long long init[2] = {0, ~0ull};
    moe_cuda_from_host(d, init, sizeof init);
    const size_t n = (size_t)rows * O;
    compare_kernel<<<1024, 256, 0, moe_cuda_stream()>>>(got, want, n, 1e-2f * scale, 1e-2f, d,
                                                        d + 1);
    MOE_CUDA_LAUNCH_CHECK();
    unsigned long long h[2];
    moe_cuda_to_host(h, d, sizeof h);
    if (h[0]) {
        moe_bf16 g, w;
        moe_cuda_to_host(&g, got + h[1], sizeof g);
        moe_cuda_to_host(&w, want + h[1], sizeof w);
        printf("    MISMATCH: %llu of %zu elements; first at row %llu, column %llu: %g, want %g\n",
               h[0], n, h[1] / O, h[1] % O, bf16_to_float(g), bf16_to_float(w));
    }
    moe_cuda_free(d);
    return (size_t)h[0];
}

/* the reference itself against fp64 on the CPU, on `samples` rows spread over the groups
 * (every column of each); returns the number of bad elements */
static size_t check_reference(const moe_bf16 *ref, const moe_bf16 *in, const moe_bf16 *w,
                              const int *off, int G, int I, int O, int samples, float scale) {
    const int rows = off[G];
    moe_bf16 *hin = (moe_bf16 *)malloc(sizeof(moe_bf16) * I), *hout = (moe_bf16 *)malloc(sizeof(moe_bf16) * O);
    moe_bf16 *hw = (moe_bf16 *)malloc(sizeof(moe_bf16) * (size_t)O * I);
    MOE_ASSERT(hin && hout && hw);
    size_t bad = 0;
    int have = -1; /* the group whose weights are in hw */
    for (int s = 0; s < samples; s++) {
        const int r = (int)((double)(2 * s + 1) / (2 * samples) * rows);
        int g = 0;
        while (off[g + 1] <= r)
            g++;
        if (g != have) {
            moe_cuda_to_host(hw, w + (size_t)g * O * I, sizeof(moe_bf16) * (size_t)O * I);
            have = g;
        }
        moe_cuda_to_host(hin, in + (size_t)r * I, sizeof(moe_bf16) * I);
        moe_cuda_to_host(hout, ref + (size_t)r * O, sizeof(moe_bf16) * O);
        for (int o = 0; o < O; o++) {
            double acc = 0.0;
            for (int i = 0; i < I; i++)
                acc += (double)bf16_to_float(hin[i]) * bf16_to_float(hw[(size_t)o * I + i]);
            if (!(fabs(bf16_to_float(hout[o]) - acc) <= 1e-2 * scale + 1e-2 * fabs(acc))) {
                if (!bad)
                    printf("    reference MISMATCH at row %d (group %d), column %d: %g, want %g\n",
                           r, g, o, bf16_to_float(hout[o]), acc);
                bad++;
            }
        }
    }
    free(hin); free(hout); free(hw);
    return bad;
}

/* ---------------------------------------------------------------- timing */

struct opts {
    int version; /* 0 = all */
    const char *shape;
    int warmup, repeats;
};

typedef void (*run_fn)(const void *ctx);
static double time_ms(const opts *o, run_fn run, const void *ctx) {
    for (int i = 0; i < o->warmup; i++)
        run(ctx);
    double *ms = (double *)malloc(sizeof(double) * o->repeats);
    MOE_ASSERT(ms != NULL);
    for (int r = 0; r < o->repeats; r++) {
        moe_cuda_timer_begin();
        run(ctx);
        ms[r] = moe_cuda_timer_end_ms();
    }
    const double med = moe_median(ms, o->repeats);
    free(ms);
    return med;
}

struct problem {
    moe_bf16 *out, *in, *w;
    const int *off; /* host copy */
    int *dev_off;
    int G, rows, I, O;
    forward_fn fn;
};

static void run_version(const void *ctx) {
    const problem *p = (const problem *)ctx;
    p->fn(p->out, p->in, p->w, p->dev_off, p->G, p->rows, p->I, p->O);
}

/* chapter 01's baseline and the reference: one cuBLAS GEMM per expert */
static void run_loop(const void *ctx) {
    const problem *p = (const problem *)ctx;
    for (int g = 0; g < p->G; g++)
        moe_cuda_matmul_forward(p->out + (size_t)p->off[g] * p->O, p->in + (size_t)p->off[g] * p->I,
                                p->w + (size_t)g * p->O * p->I, p->off[g + 1] - p->off[g], p->I,
                                p->O);
}

/* the device buffers of a problem whose off (host), G, I and O are set: in, w, the offsets,
 * and two outputs [rows, O] (the reference's and the version's) */
static void problem_alloc(problem *p, moe_bf16 **ref, moe_bf16 **out) {
    p->rows = p->off[p->G];
    p->in = (moe_bf16 *)moe_cuda_alloc(sizeof(moe_bf16) * (size_t)p->rows * p->I);
    p->w = (moe_bf16 *)moe_cuda_alloc(sizeof(moe_bf16) * (size_t)p->G * p->O * p->I);
    *ref = (moe_bf16 *)moe_cuda_alloc(sizeof(moe_bf16) * (size_t)p->rows * p->O);
    *out = (moe_bf16 *)moe_cuda_alloc(sizeof(moe_bf16) * (size_t)p->rows * p->O);
    p->dev_off = (int *)moe_cuda_alloc(sizeof(int) * (p->G + 1));
    moe_cuda_from_host(p->dev_off, p->off, sizeof(int) * (p->G + 1));
}

static void problem_free(problem *p, moe_bf16 *ref, moe_bf16 *out) {
    moe_cuda_free(p->in); moe_cuda_free(p->w); moe_cuda_free(ref); moe_cuda_free(out);
    moe_cuda_free(p->dev_off);
}

static void fill_normal(moe_bf16 *x, size_t n, uint64_t stream, double sd) {
    const size_t chunk = (size_t)1 << 26; /* an fp32 staging buffer of 256 MB at most */
    moe_real *tmp = (moe_real *)moe_cuda_alloc(sizeof(moe_real) * (n < chunk ? n : chunk));
    for (size_t i = 0; i < n; i += chunk) {
        const size_t m = n - i < chunk ? n - i : chunk;
        moe_cuda_fill_normal(tmp, m, 17, stream * 4096 + i / chunk, sd);
        moe_cuda_cast_to_act(x + i, tmp, m);
    }
    moe_cuda_free(tmp);
}

/* Skewed routing like a trained router's: expert e's popularity is exp(0.5·z_e), z_e
 * normal (log-normal: the busiest expert gets ~2-3x the mean), and each of T tokens picks
 * k distinct experts with those probabilities. Returns the offsets [E+1]. */
static void skewed_offsets(int *off, int T, int E, int k) {
    double *cdf = (double *)malloc(sizeof(double) * E), acc = 0.0;
    int *cnt = (int *)calloc(E, sizeof(int)), pick[64];
    MOE_ASSERT(cdf && cnt && k <= 64 && k <= E);
    for (int e = 0; e < E; e++)
        cdf[e] = acc += exp(0.5 * moe_rng_normal(23, 1, (uint64_t)e));
    uint64_t draw = 0;
    for (int t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            int e, dup;
            do {
                const double u = moe_rng_uniform(23, 2, draw++) * acc;
                int lo = 0, hi = E - 1;
                while (lo < hi) { /* first e with cdf[e] > u */
                    const int mid = (lo + hi) / 2;
                    if (cdf[mid] > u)
                        hi = mid;
                    else
                        lo = mid + 1;
                }
                e = lo;
                dup = 0;
                for (int q = 0; q < j; q++)
                    dup |= pick[q] == e;
            } while (dup);
            pick[j] = e;
            cnt[e]++;
        }
    off[0] = 0;
    for (int e = 0; e < E; e++)
        off[e + 1] = off[e] + cnt[e];
    free(cdf);
    free(cnt);
}

/* ---------------------------------------------------------------- one shape */

static int run_shape(const moe_bench_shape *s, const opts *o, int hopper, double dense_tflops) {
    const int G = s->E, I = s->H, O = 2 * s->F; /* fc1 forward: [H] -> [gate | up] = 2F */
    int *off = (int *)malloc(sizeof(int) * (G + 1));
    MOE_ASSERT(off != NULL);
    skewed_offsets(off, s->T, G, s->k);
    const int rows = off[G];
    int lo = rows, hi = 0;
    for (int g = 0; g < G; g++) {
        const int c = off[g + 1] - off[g];
        lo = c < lo ? c : lo;
        hi = c > hi ? c : hi;
    }
    const double flop = 2.0 * rows * I * O;
    printf("\n%s fc1 forward: T=%d k=%d -> %d rows over E=%d experts (%d..%d rows, busiest "
           "%.2fx the mean), I=%d, O=%d: %.1f GFLOP\n",
           s->name, s->T, s->k, rows, G, lo, hi, hi / ((double)rows / G), I, O, flop / 1e9);

    problem p;
    p.G = G; p.I = I; p.O = O; p.off = off;
    moe_bf16 *ref, *out;
    problem_alloc(&p, &ref, &out);
    const double wsd = 0.02, scale = sqrt((double)I) * wsd; /* the outputs' std */
    fill_normal(p.in, (size_t)rows * I, 1, 1.0);
    fill_normal(p.w, (size_t)G * O * I, 2, wsd);

    /* the reference, checked against fp64 on the CPU */
    p.out = ref;
    p.fn = NULL;
    run_loop(&p);
    const size_t ref_bad = check_reference(ref, p.in, p.w, off, G, I, O, 16, (float)scale);
    printf("reference (cuBLAS per expert) vs fp64 CPU on 16 sampled rows x %d columns: %s\n", O,
           ref_bad ? "FAILED" : "ok");
    const double ms_loop = time_ms(o, run_loop, &p);

    printf("| version | what it adds | checked | ms | TFLOP/s | vs previous | of dense |\n"
           "|---|---|---|---|---|---|---|\n");
    printf("| cuBLAS loop | ch01: one GEMM per expert (the reference) | vs CPU: %s | %.3f | %.1f "
           "| - | %.0f%% |\n",
           ref_bad ? "FAIL" : "ok", ms_loop, flop / (ms_loop * 1e-3) / 1e12,
           100.0 * flop / (ms_loop * 1e-3) / 1e12 / dense_tflops);
    int failures = ref_bad != 0;
    double prev = 0.0;
    p.out = out;
    for (int v = 0; v < N_VERSIONS; v++) {
        const version *ver = &g_versions[v];
        if (o->version && o->version != v + 1)
            continue;
        if (ver->hopper && !hopper) {
            printf("| %s | %s | skipped: needs sm_90a (Hopper) | | | | |\n", ver->name, ver->what);
            continue;
        }
        p.fn = ver->fn;
        MOE_CUDA_CHECK(cudaMemsetAsync(out, 0xFF, sizeof(moe_bf16) * (size_t)rows * O,
                                       moe_cuda_stream())); /* NaN: an unwritten element fails */
        run_version(&p);
        const size_t bad = compare(out, ref, rows, O, (float)scale);
        if (bad) { /* a wrong kernel's time means nothing */
            printf("| %s | %s | FAIL (%zu elements) | | | | |\n", ver->name, ver->what, bad);
            failures++;
            prev = 0.0;
            continue;
        }
        const double ms = time_ms(o, run_version, &p), tf = flop / (ms * 1e-3) / 1e12;
        char ratio[32] = "-";
        if (prev > 0.0)
            snprintf(ratio, sizeof ratio, "%.2fx", tf / prev);
        printf("| %s | %s | all %zu ok | %.3f | %.1f | %s | %.0f%% |\n", ver->name, ver->what,
               (size_t)rows * O, ms, tf, ratio, 100.0 * tf / dense_tflops);
        prev = tf;
    }
    problem_free(&p, ref, out);
    free(off);
    return failures;
}

/* a small ragged case for the edges: an empty first and middle group, a group of 1 row,
 * groups that end inside a tile, O not a multiple of any tile width, I not of BK */
static int run_edges(const opts *o, int hopper) {
    static const int sizes[6] = {0, 1, 200, 0, 77, 131};
    const int G = 6, I = 200, O = 264;
    int off[7] = {0};
    for (int g = 0; g < G; g++)
        off[g + 1] = off[g] + sizes[g];
    const int rows = off[G];
    problem p;
    p.G = G; p.I = I; p.O = O; p.off = off;
    moe_bf16 *ref, *out;
    problem_alloc(&p, &ref, &out);
    const double scale = sqrt((double)I) * 0.5;
    fill_normal(p.in, (size_t)rows * I, 3, 1.0);
    fill_normal(p.w, (size_t)G * O * I, 4, 0.5);
    p.out = ref;
    run_loop(&p);
    int failures = check_reference(ref, p.in, p.w, off, G, I, O, 24, (float)scale) != 0;
    printf("\nedges: groups of {0, 1, 200, 0, 77, 131} rows, I=%d, O=%d:", I, O);
    p.out = out;
    for (int v = 0; v < N_VERSIONS; v++) {
        if ((o->version && o->version != v + 1) || (g_versions[v].hopper && !hopper))
            continue;
        p.fn = g_versions[v].fn;
        MOE_CUDA_CHECK(cudaMemsetAsync(out, 0xFF, sizeof(moe_bf16) * (size_t)rows * O,
                                       moe_cuda_stream()));
        run_version(&p);
        const size_t bad = compare(out, ref, rows, O, (float)scale);
        printf(" v%d %s", v + 1, bad ? "FAIL" : "ok");
        failures += bad != 0;
    }
    printf("%s\n", failures ? " (reference or versions FAILED)" : "");
    problem_free(&p, ref, out);
    return failures;
}

static double dense_ceiling(const opts *o) {
    const int n = 8192;
    problem p;
    const int off[2] = {0, n};
    p.G = 1; p.rows = n; p.I = n; p.O = n; p.off = off;
    p.in = (moe_bf16 *)moe_cuda_alloc(sizeof(moe_bf16) * (size_t)n * n);
    p.w = (moe_bf16 *)moe_cuda_alloc(sizeof(moe_bf16) * (size_t)n * n);
    p.out = (moe_bf16 *)moe_cuda_alloc(sizeof(moe_bf16) * (size_t)n * n);
    fill_normal(p.in, (size_t)n * n, 5, 1.0);
    fill_normal(p.w, (size_t)n * n, 6, 0.02);
    const double ms = time_ms(o, run_loop, &p), tf = 2.0 * n * n * (double)n / (ms * 1e-3) / 1e12;
    printf("dense bf16 cuBLAS GEMM %d^3 (the ceiling, measured now): %.3f ms, %.1f TFLOP/s\n", n, ms,
           tf);
    moe_cuda_free(p.in); moe_cuda_free(p.w); moe_cuda_free(p.out);
    return tf;
}

static void usage(FILE *f) {
    fprintf(f, "usage: ch03_versions [VERSION] [--shape qwen3|mixtral|all] [--warmup N] [--repeats N]\n"
               "  VERSION   1..%d runs that version only (default: every version)\n"
               "  --shape   qwen3 = Qwen3-30B-A3B fc1, mixtral = Mixtral-8x7B fc1 (default: all)\n"
               "  --warmup  untimed runs first (default 2)\n"
               "  --repeats timed runs, the median is reported (default 10)\n",
            N_VERSIONS);
}

static int parse_int(const char *flag, const char *v, int min, int max, int *out) {
    char *end;
    const long x = v ? strtol(v, &end, 10) : 0;
    if (!v || *end || x < min || x > max) {
        fprintf(stderr, "ch03_versions: %s needs an integer in [%d, %d], got '%s' (see --help)\n",
                flag, min, max, v ? v : "");
        return 0;
    }
    *out = (int)x;
    return 1;
}

int main(int argc, char **argv) {
    opts o = {0, "all", 2, 10};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--shape")) {
            if (!v || (strcmp(v, "qwen3") && strcmp(v, "mixtral") && strcmp(v, "all"))) {
                fprintf(stderr, "ch03_versions: --shape must be qwen3, mixtral or all, got '%s'\n",
                        v ? v : "");
                return 2;
            }
            o.shape = v;
            i++;
        } else if (!strcmp(a, "--warmup")) {
            if (!parse_int("--warmup", v, 0, 1000, &o.warmup))
                return 2;
            i++;
        } else if (!strcmp(a, "--repeats")) {
            if (!parse_int("--repeats", v, 1, 1000, &o.repeats))
                return 2;
            i++;
        } else if (a[0] != '-') {
            if (!parse_int("VERSION", a, 1, N_VERSIONS, &o.version))
                return 2;
        } else {
            fprintf(stderr, "ch03_versions: unknown flag '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        fprintf(stderr, "ch03_versions: no CUDA GPU found (the ladder needs one; v2-v4 need "
                        "Hopper, sm_90a)\n");
        return 2;
    }
    char dev[256];
    moe_cuda_device_name(dev, sizeof dev);
    const int hopper = moe_cuda_grouped_sm90_available();
    moe_bench_header("ch03 kernel ladder: grouped GEMM forward (chapters/03-grouped-gemm/versions)",
                     dev);
    printf("bf16 in/out, fp32 accumulation, group offsets in device memory. Each version is "
           "checked on every element against the reference, then timed: median of %d after %d "
           "warm-up (CUDA events).\n",
           o.repeats, o.warmup);
    const double dense = dense_ceiling(&o);
    int failures = run_edges(&o, hopper);
    int n_shapes;
    const moe_bench_shape *shapes = moe_bench_shapes(&n_shapes);
    for (int i = 0; i < n_shapes; i++)
        if (strcmp(shapes[i].name, "small") &&
            moe_bench_shape_wanted(o.shape, shapes[i].name, 1))
            failures += run_shape(&shapes[i], &o, hopper, dense);
    printf("\n%s\n", failures ? "ch03_versions: FAILED (see MISMATCH above)" : "ch03_versions: all checks passed");
    return failures ? 1 : 0;
}
