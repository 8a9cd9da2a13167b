/* Helpers shared by the test suites: see helpers.h. */
#include "helpers.h"

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend.h"
#include "rng.h"
#include "step_flags.h"
#include "trainer.h"

int moe_test_quick(void) {
    const char *q = getenv("MOE_TEST_QUICK");
    return q && *q && *q != '0';
}

void moe_test_randn(moe_real *x, size_t n, uint64_t stream, double scale) {
    for (size_t i = 0; i < n; i++)
        x[i] = (moe_real)(scale * moe_rng_normal(12345, 1000 + stream, i));
}

void moe_test_poison(moe_real *x, size_t n) {
    for (size_t i = 0; i < n; i++)
        x[i] = (moe_real)NAN;
}

moe_param_table moe_test_adamw_table(void) {
    const int C = MOE_ADAMW_CHUNK;
    moe_param_table pt = {0};
    moe_params_add(&pt, "big", 1, 3 * C + 5, 0, 0, MOE_INIT_NORMAL, 0.02, 1);
    moe_params_add(&pt, "odd", 3, 2, 3, 7, MOE_INIT_NORMAL, 0.02, 1);
    moe_params_add(&pt, "n1", 1, 13, 0, 0, MOE_INIT_ONES, 0.0, 0);
    moe_params_add(&pt, "c", 2, 129, 65, 0, MOE_INIT_NORMAL, 0.02, 1);
    moe_params_add(&pt, "n2", 1, 1, 0, 0, MOE_INIT_ONES, 0.0, 0);
    moe_params_add(&pt, "e", 2, 256, 64, 0, MOE_INIT_NORMAL, 0.02, 1);
    moe_params_add(&pt, "d", 1, C + 1, 0, 0, MOE_INIT_NORMAL, 0.02, 1);
    return pt;
}

moe_adamw_runs moe_test_adamw_flat(const moe_backend *be, size_t n) {
    const moe_adamw_run one = {.n = n, .decay = 1}; /* every offset 0, the first chunk 0 */
    moe_adamw_runs r = {.run = be->alloc(sizeof one), .n = 1,
                        .chunks = (n + MOE_ADAMW_CHUNK - 1) / MOE_ADAMW_CHUNK};
    ck_assert_ptr_nonnull(r.run);
    be->from_host(r.run, &one, sizeof one);
    return r;
}

void *moe_test_upload(const moe_backend *be, moe_real *host, size_t n, uint64_t stream,
                      double scale) {
    moe_test_randn(host, n, stream, scale);
    void *d = be->alloc(be->act_size * (n ? n : 1));
    ck_assert_ptr_nonnull(d);
    be->write_act(d, host, n);
    be->read_act(host, d, n);
    return d;
}

double moe_test_max_rel_err(const moe_real *a, const moe_real *b, size_t n, double floor) {
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        double s = fabs((double)b[i]);
        double r = d / (s > floor ? s : floor);
        if (isnan(r))
            return INFINITY;
        if (r > worst)
            worst = r;
    }
    return worst;
}

moe_status moe_test_config(moe_config *cfg, const char *flags, moe_error *err) {
    moe_config_defaults(cfg);
    return moe_config_parse_string(cfg, flags, err);
}

int moe_test_have_gpu(void) {
    const moe_backend *b = NULL;
    return moe_backend_select("cuda", &b, NULL) == MOE_OK;
}

void moe_test_tmp_path(char *out, size_t cap, const char *name) {
    const char *dir = getenv("TMPDIR");
    snprintf(out, cap, "%s/moe_test_%d_%s", dir && *dir ? dir : "/tmp", (int)getpid(), name);
}

int moe_test_run(const char *cmd, char *out, size_t cap) {
    char full[2048];
    snprintf(full, sizeof full, "%s 2>&1", cmd);
    FILE *p = popen(full, "r");
    if (!p)
        return -1;
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = '\0';
    int status = pclose(p);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

int moe_test_have_program(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "skipped: %s not built (run make all first)\n", path);
        return 0;
    }
    fclose(f);
    return 1;
}

TCase *moe_test_tcase(Suite *s, const char *name, double timeout, const TTest *const *tests,
                      int n) {
    TCase *tc = tcase_create(name);
    tcase_set_timeout(tc, timeout);
    for (int i = 0; i < n; i++)
        tcase_add_test(tc, tests[i]);
    suite_add_tcase(s, tc);
    return tc;
}

Suite *moe_test_chapter_suite(const char *name, const char *chapter, const TTest *const *tests,
                              int n) {
    Suite *s = suite_create(name);
    tcase_set_tags(moe_test_tcase(s, chapter, 60, tests, n), chapter);
    return s;
}

/* ------------------------------------------------------------------ resume via moe-train */

#define RESUME_MAX_STEPS 64

/* The "loss" text of every train record of a metrics file, by step; returns the last step
 * (0 when there is none, -1 when the file cannot be read). */
static int read_losses(const char *path, char loss[][40]) {
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    char line[4096];
    int last = 0;
    while (fgets(line, sizeof line, f)) {
        const char *st = strstr(line, "\"step\":"), *lo = strstr(line, "\"loss\":");
        if (!strstr(line, "\"event\":\"train\"") || !st || !lo)
            continue;
        int step = atoi(st + 7);
        if (step < 1 || step >= RESUME_MAX_STEPS)
            continue;
        snprintf(loss[step], 40, "%.*s", (int)strcspn(lo + 7, ",}"), lo + 7);
        last = step;
    }
    fclose(f);
    return last;
}

static long long read_latest_step(const char *dir) {
    char path[700];
    snprintf(path, sizeof path, "%s/latest_checkpointed_iteration.txt", dir);
    FILE *f = fopen(path, "r");
    long long step = -1;
    if (f) {
        if (fscanf(f, "%lld", &step) != 1)
            step = -1;
        fclose(f);
    }
    return step;
}

#define FAIL(...)                              \
    do {                                       \
        snprintf(why, cap, __VA_ARGS__);       \
        return 0;                              \
    } while (0)

/* Start the run to be interrupted; returns its pid (the shell execs moe-train itself). */
static pid_t start_run(const char *cmd) {
    pid_t pid = fork();
    if (pid == 0) {
        if (!freopen("/dev/null", "w", stdout) || !freopen("/dev/null", "w", stderr))
            _exit(126);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    return pid;
}

int moe_test_resume_after_signal(const char *flags, int steps, int sig, char *why, size_t cap) {
    static char out[1 << 16];
    static char ref[RESUME_MAX_STEPS][40], got[RESUME_MAX_STEPS][40];
    char dir[512], ckpt[600], cmd[2000];
    if (steps >= RESUME_MAX_STEPS)
        FAIL("at most %d steps", RESUME_MAX_STEPS - 1);
    moe_test_tmp_path(dir, sizeof dir, sig == SIGKILL ? "resume_kill" : "resume_term");
    snprintf(cmd, sizeof cmd, "rm -rf %s && mkdir -p %s", dir, dir);
    if (system(cmd) != 0)
        FAIL("cannot create %s", dir);
    snprintf(ckpt, sizeof ckpt, "%s/ckpt", dir);
    const char *run = "MOE_NO_DOWNLOAD=1 exec ./bin/moe-train";

    /* 1. the uninterrupted reference */
    char metrics[700];
    snprintf(metrics, sizeof metrics, "%s/ref.jsonl", dir);
    snprintf(cmd, sizeof cmd, "%s %s --train-iters %d --metrics-file %s", run, flags, steps,
             metrics);
    if (moe_test_run(cmd, out, sizeof out) != 0)
        FAIL("the reference run failed:\n%s", out);
    memset(ref, 0, sizeof ref);
    if (read_losses(metrics, ref) != steps)
        FAIL("the reference run did not log %d steps", steps);

    /* 2. the run that is interrupted once it is past half way */
    snprintf(metrics, sizeof metrics, "%s/cut.jsonl", dir);
    snprintf(cmd, sizeof cmd, "%s %s --train-iters 1000000 --save %s --save-interval 2 "
             "--metrics-file %s %s", run, flags, ckpt, metrics,
             sig == SIGTERM ? "--exit-signal-handler" : "");
    pid_t pid = start_run(cmd);
    if (pid < 0)
        FAIL("fork failed");
    int status = 0, waited = 0;
    for (int ms = 0;; ms += 2) {
        memset(got, 0, sizeof got);
        int past = sig == SIGKILL ? read_latest_step(ckpt) >= steps / 2
                                  : read_losses(metrics, got) >= steps / 2;
        if (past)
            break;
        if (waitpid(pid, &status, WNOHANG) == pid) {
            waited = 1;
            break;
        }
        if (ms > 120000) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            FAIL("the run to interrupt did not reach step %d within 120 s", steps / 2);
        }
        usleep(2000);
    }
    if (waited)
        FAIL("the run to interrupt ended by itself (status %d)", status);
    kill(pid, sig);
    waitpid(pid, &status, 0);
    if (sig == SIGKILL && !(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL))
        FAIL("the run did not die of SIGKILL (status %d)", status);
    if (sig == SIGTERM && !(WIFEXITED(status) && WEXITSTATUS(status) == 0))
        FAIL("with --exit-signal-handler, SIGTERM must save and exit 0 (status %d)", status);
    const long long saved = read_latest_step(ckpt);
    if (saved < steps / 2 || saved >= steps)
        FAIL("the checkpoint left is of step %lld; the test needs one in [%d, %d) (a machine "
             "too slow to interrupt the run in time?)", saved, steps / 2, steps);

    /* 3. resume up to the reference's length, and compare */
    snprintf(cmd, sizeof cmd, "%s %s --train-iters %d --load %s --save %s --metrics-file "
             "%s/resumed.jsonl", run, flags, steps, ckpt, ckpt, dir);
    if (moe_test_run(cmd, out, sizeof out) != 0 || !strstr(out, "resumed from"))
        FAIL("the resumed run failed:\n%s", out);
    memset(got, 0, sizeof got);
    snprintf(metrics, sizeof metrics, "%s/resumed.jsonl", dir);
    if (read_losses(metrics, got) != steps)
        FAIL("the resumed run did not reach step %d", steps);
    for (int s = 1; s <= steps; s++) {
        if (s <= saved && got[s][0])
            FAIL("the resumed run repeated step %d (the checkpoint was of step %lld)", s, saved);
        if (s > saved && strcmp(got[s], ref[s]) != 0)
            FAIL("step %d after resuming from step %lld: loss %s, uninterrupted %s", s, saved,
                 got[s], ref[s]);
    }
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0)
        FAIL("cannot remove %s", dir);
    return 1;
}
#undef FAIL

double moe_test_step(moe_trainer *t) {
    moe_step_stats st;
    ck_assert_int_eq(moe_trainer_step(t, &st, NULL), MOE_OK);
    return st.loss;
}

static double rel_l2(const moe_real *a, const moe_real *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return isfinite(num) ? sqrt(num / (den > 0 ? den : 1e-30)) : INFINITY;
}

moe_real *moe_test_master(moe_trainer *t) {
    const size_t n = moe_model_num_params(t->model);
    moe_real *host = malloc(sizeof(moe_real) * (n ? n : 1));
    ck_assert(host != NULL);
    moe_error err;
    ck_assert_msg(moe_trainer_master_to_host(t, host, &err) == MOE_OK, "%s", err.msg);
    return host;
}

long long moe_test_compare_state(moe_trainer *dist, moe_trainer *ref, double grad_tol,
                                 double param_tol, double *worst, const char **worst_name) {
    const moe_model *md = dist->model, *mr = ref->model;
    long long bad = 0;
    *worst = 0;
    *worst_name = "";
    /* the whole master weights of both (a collective under the distributed optimizer), and
     * the gradients, each on the host */
    moe_real *master[2] = {moe_test_master(dist), moe_test_master(ref)};
    moe_real *grads[2] = {malloc(sizeof(moe_real) * md->table.total),
                          malloc(sizeof(moe_real) * mr->table.total)};
    ck_assert(grads[0] && grads[1]);
    md->be->to_host(grads[0], md->grads, sizeof(moe_real) * md->table.total);
    mr->be->to_host(grads[1], mr->grads, sizeof(moe_real) * mr->table.total);
    for (int i = 0; i < md->table.n; i++) {
        const moe_tensor *td = &md->table.t[i];
        const moe_tensor *tr = moe_params_find(&mr->table, td->name);
        ck_assert_ptr_nonnull(tr);
        moe_real *gr = malloc(sizeof(moe_real) * td->numel);
        ck_assert(gr != NULL);
        /* the gradients (unless asked not to), then the weights: the same slice of the
         * reference's whole tensor (element j is element moe_tensor_global_index(td, j)) */
        for (int w = grad_tol < 0 ? 1 : 0; w < 2; w++) {
            const moe_real *gd = (w ? master : grads)[0] + td->offset;
            const moe_real *full = (w ? master : grads)[1] + tr->offset;
            const double tol = w ? param_tol : grad_tol;
            for (size_t j = 0; j < td->numel; j++)
                gr[j] = full[moe_tensor_global_index(td, j)];
            const double e = tol == 0 ? (memcmp(gd, gr, sizeof(moe_real) * td->numel) ? INFINITY : 0)
                                      : rel_l2(gd, gr, td->numel);
            bad += !(e <= tol);
            if (!(e <= *worst)) { /* the largest error, within the bound or not */
                *worst = e;
                *worst_name = td->name;
            }
        }
        free(gr);
    }
    for (int k = 0; k < 2; k++) {
        free(master[k]);
        free(grads[k]);
    }
    return bad;
}

long long moe_test_compare_shards(moe_trainer *dist, moe_trainer *ref, double tol,
                                  double *worst, const char **worst_name) {
    return moe_test_compare_state(dist, ref, tol, 0, worst, worst_name);
}

/* Assignments routed to another expert: half the L1 distance of the two trainers' global
 * expert loads after one moe_trainer_gradients() each (0: the same routing, barring moves
 * that cancel exactly). */
static long long routing_moves(const moe_trainer *dist, const moe_trainer *ref) {
    const moe_model *a = dist->model, *b = ref->model;
    const size_t n = (size_t)a->cfg.num_layers * a->cfg.num_experts;
    if (!a->load_counts || n == 0)
        return 0;
    long long *la = malloc(sizeof(long long) * n), *lb = malloc(sizeof(long long) * n);
    a->be->to_host(la, a->load_counts, sizeof(long long) * n);
    b->be->to_host(lb, b->load_counts, sizeof(long long) * n);
    long long moved = 0;
    for (size_t i = 0; i < n; i++)
        moved += llabs(la[i] - lb[i]);
    free(la);
    free(lb);
    return moved / 2;
}

int moe_test_folding(moe_comm *world, const char *base, int tp, int sp, int ep,
                     const char *common, const char *dist_flags, int gpu, moe_trainer **dist,
                     moe_trainer **ref) {
    const int W = moe_comm_size(world);
    if (tp > W || W % tp != 0 || ep > W || W % ep != 0)
        return 0;
    const int batch = 2 * 2 * (W / tp);
    for (int seed = 1;; seed++) {
        char flags[1024], seed_flag[32] = "";
        if (seed > 1) /* later flags win: the base's own seed first, then the next ones */
            snprintf(seed_flag, sizeof seed_flag, "--seed %d", seed);
        snprintf(flags, sizeof flags,
                 "%s --global-batch-size %d --tensor-model-parallel-size %d "
                 "--expert-model-parallel-size %d %s %s %s %s",
                 base, batch, tp, ep, sp ? "--sequence-parallel" : "", common, dist_flags,
                 seed_flag);
        *dist = moe_test_trainer(flags, world, gpu);
        snprintf(flags, sizeof flags, "%s --global-batch-size %d %s %s", base, batch, common,
                 seed_flag);
        *ref = moe_test_trainer(flags, NULL, gpu);
        if (!gpu || (*dist)->model->cfg.num_experts == 0)
            return 1;
        moe_step_stats sd, sr;
        moe_trainer_gradients(*dist, &sd);
        moe_trainer_gradients(*ref, &sr);
        char what[320];
        snprintf(what, sizeof what, "GPU, TP %d EP %d %s%s", tp, ep, common, dist_flags);
        if (moe_test_routes_alike(world, *dist, *ref, seed, what))
            return 1;
        moe_trainer_free(*dist);
        moe_trainer_free(*ref);
    }
}

long long moe_test_first_step(moe_trainer *dist, moe_trainer *ref, double tol, double *loss_err,
                              moe_step_stats *sd, moe_step_stats *sr, double *worst,
                              const char **worst_name) {
    moe_trainer_gradients(dist, sd);
    moe_trainer_gradients(ref, sr);
    *loss_err = fabs(sd->loss - sr->loss) / fabs(sr->loss);
    long long bad = moe_test_compare_shards(dist, ref, tol, worst, worst_name);
    moe_comm_host_all_reduce_sum(dist->world, &bad, 1, MOE_DTYPE_I64);
    return bad;
}

int moe_test_routes_alike(moe_comm *world, const moe_trainer *dist, const moe_trainer *ref,
                          int seed, const char *what) {
    const long long moved = routing_moves(dist, ref);
    if (moved == 0)
        return 1;
    if (moe_comm_rank(world) == 0)
        printf("  (%s, seed %d: %lld assignment(s) of the first step routed to another expert "
               "than in one process (bf16 partial sums), so the expert gradients are not "
               "comparable; the runs are rebuilt with the next seed)\n",
               what, seed, moved);
    ck_assert_msg(seed < 8, "%s: 8 seeds in a row route differently from one process on GPU "
                  "ranks: not near-ties (a bug in the folded routing?)", what);
    return 0;
}

moe_trainer *moe_test_trainer(const char *flags, moe_comm *world, int gpu) {
    moe_config c;
    moe_error err;
    char buf[1200];
    const int len = snprintf(buf, sizeof buf, "%s --device %s", flags, gpu ? "cuda" : "cpu");
    ck_assert_msg(len >= 0 && (size_t)len < sizeof buf, "moe_test_trainer: %d characters of "
                  "flags, more than its %zu", len, sizeof buf - 1);
    setenv("MOE_NO_DOWNLOAD", "1", 1);
    ck_assert_msg(moe_test_config(&c, buf, &err) == MOE_OK, "%s", err.msg);
    moe_trainer *t = NULL;
    ck_assert_msg(moe_trainer_create_dist(&t, &c, world, &err) == MOE_OK, "%s", err.msg);
    return t;
}

/* the step-flags word (one int in backend memory), read and cleared */
static int take_step_flags(moe_model *m) {
    int f = 0;
    m->be->to_host(&f, m->step_flags, sizeof f);
    m->be->zero(m->step_flags, sizeof f);
    return f;
}

/* Force the routing through the expert bias: +50 on the hot expert of each MoE layer
 * outweighs any sigmoid score (< 1), so every token picks it first. */
static int force_routing(moe_model *m, int route, int step) {
    const moe_config *c = &m->cfg;
    const int E = c->num_experts, L = c->num_layers;
    float *bias = calloc((size_t)L * E, sizeof *bias);
    int hot0 = -1;
    for (int l = 0; l < L; l++) {
        const int hot = route == MOE_TEST_ROUTE_ONE_EXPERT ? 0 : (l + step) % E;
        bias[(size_t)l * E + hot] = 50.0f;
        if (hot0 < 0 && c->is_moe_layer[l])
            hot0 = hot;
    }
    m->be->from_host(m->expert_bias, bias, sizeof(float) * (size_t)L * E);
    free(bias);
    return hot0; /* the first MoE layer's hot expert */
}

/* the expert loads [L·E], from backend memory */
static long long *host_loads(const moe_model *m) {
    const size_t n = (size_t)m->cfg.num_layers * m->cfg.num_experts;
    long long *v = malloc(sizeof(long long) * n);
    m->be->to_host(v, m->load_counts, sizeof(long long) * n);
    return v;
}

static moe_real *host_grads(const moe_model *m) {
    const size_t n = moe_model_num_params(m);
    moe_real *g = malloc(sizeof(moe_real) * n);
    m->be->to_host(g, m->grads, sizeof(moe_real) * n);
    return g;
}

void moe_test_random_offsets(int *all_off, int P, int E, int hot, unsigned *seed) {
    for (int p = 0; p < P; p++) {
        int *o = all_off + (size_t)p * (E + 1);
        o[0] = 0;
        for (int e = 0; e < E; e++) {
            *seed = *seed * 1103515245u + 12345u;
            const int r = (int)((*seed >> 16) % 9), c = (*seed >> 20) % 5 == 0 ? 0 : r;
            o[e + 1] = o[e] + (hot ? (e == 0 ? 40 : 0) : c);
        }
    }
}

void moe_test_budget_protocol(const char *flags, int gpu, int route) {
    char buf[1500];
    snprintf(buf, sizeof buf, "%s --moe-expert-rank-capacity-factor 0.5", flags);
    moe_trainer *small = moe_test_trainer(buf, NULL, gpu);
    snprintf(buf, sizeof buf, "%s --moe-expert-rank-capacity-factor 1.0", flags);
    moe_trainer *ample = moe_test_trainer(buf, NULL, gpu);
    moe_model *ms = small->model, *ma = ample->model;
    const moe_config *c = &ma->cfg;
    const int E = c->num_experts, L = c->num_layers;
    const int tokens = c->global_batch_size * c->seq_length;
    ck_assert_int_lt(ms->moe_budget_rows, ma->moe_budget_rows);
    ck_assert_int_eq(ma->moe_budget_rows, ma->moe_budget_max);
    const size_t P = moe_model_num_params(ma);
    for (int step = 0; step < 3; step++) {
        const int hot = force_routing(ma, route, step);
        force_routing(ms, route, step);
        take_step_flags(ma);
        take_step_flags(ms);
        moe_step_stats sa, ss;
        moe_trainer_gradients(ample, &sa);
        ck_assert_msg(take_step_flags(ma) == 0, "step %d: a budget of tokens*k overflowed",
                      step);
        /* the routing really was forced: every token picked the hot expert */
        long long *la = host_loads(ma);
        for (int l = 0; l < L; l++)
            if (c->is_moe_layer[l]) {
                ck_assert_int_eq((int)la[(size_t)l * E + hot], tokens);
                break;
            }
        moe_trainer_gradients(small, &ss);
        const int f = take_step_flags(ms);
        if (step == 0) { /* without the re-run the flag is set: the budget is half of N·k */
            ck_assert_msg(f & MOE_STEP_OVERFLOW, "step 0: the small budget did not raise "
                                                 "MOE_STEP_OVERFLOW (flags %d)", f);
            moe_error err;
            ck_assert_msg(moe_model_grow_moe_budget(ms, &err) == MOE_OK, "%s", err.msg);
            moe_trainer_gradients(small, &ss); /* the eager re-run, from the same state */
            ck_assert_int_eq(take_step_flags(ms), 0);
        } else {
            ck_assert_msg(f == 0, "step %d: the grown budget overflowed (flags %d)", step, f);
        }
        printf("  route %d step %d: loss %.9g (ample) %.9g (re-run)\n", route, step, sa.loss,
               ss.loss);
        ck_assert_msg(ss.loss == sa.loss, "step %d: loss %.17g after the re-run, %.17g with an "
                      "ample budget", step, ss.loss, sa.loss);
        moe_real *gs = host_grads(ms), *ga = host_grads(ma);
        size_t bad = 0;
        for (size_t i = 0; i < P; i++)
            bad += memcmp(&gs[i], &ga[i], sizeof(moe_real)) != 0;
        ck_assert_msg(bad == 0, "step %d: %zu of %zu gradients differ from the ample run",
                      step, bad, P);
        free(gs);
        free(ga);
        long long *ls = host_loads(ms);
        ck_assert_msg(!memcmp(ls, la, sizeof(long long) * L * E), "step %d: expert loads differ",
                      step);
        free(ls);
        free(la);
        moe_trainer_update(ample, &sa);
        moe_trainer_update(small, &ss);
    }
    ck_assert_int_eq((int)ms->moe_budget_overflows, 1);
    ck_assert_int_eq(ms->moe_budget_rows, ms->moe_budget_max);
    moe_trainer_free(small);
    moe_trainer_free(ample);
}

/* ------------------------------------------------ counting the host's waits (chapter 06) */

static const moe_backend *g_sync_inner;    /* the table the trainer had */
static moe_test_sync_counts *g_sync_counts;
static moe_backend g_sync_table;           /* a copy with the blocking entries wrapped */

static void count_to_host(void *dst, const void *src, size_t bytes) {
    g_sync_counts->to_host++;
    g_sync_inner->to_host(dst, src, bytes);
}
static void count_from_host(void *dst, const void *src, size_t bytes) {
    g_sync_counts->from_host++;
    g_sync_inner->from_host(dst, src, bytes);
}
static void count_read_act(moe_real *host, const void *src, size_t n) {
    g_sync_counts->read_act++;
    g_sync_inner->read_act(host, src, n);
}
static void count_synchronize(void) {
    g_sync_counts->synchronize++;
    g_sync_inner->synchronize();
}
static double count_timer_end_ms(void) {
    g_sync_counts->timer_end_ms++;
    return g_sync_inner->timer_end_ms();
}
static void count_wait_to_host(void) {
    g_sync_counts->wait_to_host++;
    g_sync_inner->wait_to_host();
}
static void count_permute_index(int *perm_src, int *row_of, int *expert_offset, int *dev_offset,
                                long long *counts, const int *topk_idx, int N, int k, int E) {
    g_sync_counts->permute_index++;
    g_sync_inner->permute_index(perm_src, row_of, expert_offset, dev_offset, counts, topk_idx, N,
                                k, E);
}

void moe_test_count_syncs(moe_trainer *t, moe_test_sync_counts *counts) {
    g_sync_inner = t->model->be;
    g_sync_counts = counts;
    g_sync_table = *g_sync_inner;
    g_sync_table.to_host = count_to_host;
    g_sync_table.from_host = count_from_host;
    g_sync_table.read_act = count_read_act;
    g_sync_table.synchronize = count_synchronize;
    g_sync_table.timer_end_ms = count_timer_end_ms;
    g_sync_table.wait_to_host = count_wait_to_host;
    g_sync_table.permute_index = count_permute_index;
    /* every holder of the table: the model, the optimizer, ZeRO, the dispatcher contexts */
    t->model->be = &g_sync_table;
    t->opt.be = &g_sync_table;
    if (t->zero.be)
        t->zero.be = &g_sync_table;
    t->ep.be = &g_sync_table;
    t->model->ws.single.be = &g_sync_table;
}
