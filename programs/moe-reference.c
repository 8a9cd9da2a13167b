/*
 * moe-reference: dump everything a PyTorch reference needs to check the C model.
 *
 *   bin/moe-reference --out DIR [--steps N] [any moe-train flag ...]
 *   python3 tools/torch_reference.py DIR
 *
 * It builds the trainer exactly as bin/moe-train does (same flags, same backend
 * selection: --device cpu or cuda), then writes into DIR:
 *
 *   config.json   every flag (as text and typed), the resolved sizes (vocab_size,
 *                 head_dim, num_query_groups, is_moe_layer), the backend ("device")
 *                 and the parameter table (name, shape, offset, numel, decay)
 *   params.bin    the initial fp32 master weights, [total] in table order
 *   batches.bin   int32 inputs and targets of every micro-batch of the first N steps,
 *                 [steps][accum][inputs|targets][B][T], exactly the trainer's batches
 *   logits.bin    fp32 logits [B·T, V] of a forward on step 0's first micro-batch at init
 *   grads.bin     fp32 gradients of (ce + aux + z) of that micro-batch (loss scale 1,
 *                 before any clipping), [total] in table order
 *   routing.bin   per MoE layer of that forward: int32 topk_idx [B·T, k] then fp32
 *                 topk_w [B·T, k]
 *   step0.json    ce, aux, z, total of that forward, per-layer aux/z and expert counts
 *   losses.json   per trainer step: loss, ce, aux, z, grad_norm, lr (and the expert bias
 *                 after the step when it is enabled)
 *   params_final.bin  the fp32 master weights after those steps, [total] in table order
 *
 * The extra forward/backward does not disturb training: gradients and expert load
 * counts are reset afterwards, and neither the optimizer nor the expert bias is touched.
 * Exit codes follow moe-train: 2 for flag/config errors, 1 for anything else.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>

#include "config.h"
#include "log.h"
#include "metrics.h"
#include "trainer.h"

#define PROG "moe-reference"

/* ------------------------------------------------------------------ output helpers */

static char g_dir[4096];

static void die(const char *fmt, ...) {
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    moe_log_error("%s", msg);
    exit(1);
}

/* mkdir -p */
static int make_dirs(const char *path) {
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", path);
    size_t n = strlen(buf);
    for (size_t i = 1; i <= n; i++) {
        if (buf[i] == '/' || buf[i] == '\0') {
            char c = buf[i];
            buf[i] = '\0';
            if (mkdir(buf, 0755) != 0 && errno != EEXIST)
                return -1;
            buf[i] = c;
        }
    }
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode) ? 0 : -1;
}

static FILE *open_out(const char *name, const char *mode) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    FILE *f = fopen(path, mode);
    if (!f)
        die("cannot write %s: %s", path, strerror(errno));
    return f;
}

static void close_out(FILE *f, const char *name) {
    if (ferror(f) | fclose(f))
        die("error writing %s/%s (disk full?)", g_dir, name);
}

static void write_bin(const char *name, const void *data, size_t bytes) {
    FILE *f = open_out(name, "wb");
    if (bytes && fwrite(data, 1, bytes, f) != bytes)
        die("error writing %s/%s: %s", g_dir, name, strerror(errno));
    close_out(f, name);
}


/* A JSON number that round-trips a double (Python's json also reads NaN/Infinity). */
static void json_num(FILE *f, double x) {
    if (isnan(x))
        fputs("NaN", f);
    else if (isinf(x))
        fputs(x > 0 ? "Infinity" : "-Infinity", f);
    else
        fprintf(f, "%.17g", x);
}

/* ------------------------------------------------------------------ the dumps */

/* The flag's value in its own type, at full precision. */
static void json_flag_value(FILE *f, const moe_flag *fl, const moe_config *c) {
    const void *p = (const char *)c + fl->offset;
    switch (fl->type) {
    case MOE_FLAG_INT: fprintf(f, "%d", *(const int *)p); break;
    case MOE_FLAG_INT64: fprintf(f, "%lld", *(const long long *)p); break;
    case MOE_FLAG_DOUBLE: json_num(f, *(const double *)p); break;
    case MOE_FLAG_BOOL: fputs(*(const int *)p ? "true" : "false", f); break;
    case MOE_FLAG_STRING:
    case MOE_FLAG_CHOICE: moe_json_write_string(f, (const char *)p); break;
    }
}

static void write_config(const moe_trainer *t, int steps, int accum) {
    const moe_config *c = &t->cfg;
    const moe_model *m = t->model;
    int n;
    const moe_flag *flags = moe_config_flags(&n);
    FILE *f = open_out("config.json", "w");
    fprintf(f, "{\n  \"program\": \"" PROG "\",\n  \"device\": ");
    moe_json_write_string(f, m->be->name);
    fprintf(f, ",\n  \"act_size\": %zu,\n  \"real\": \"" MOE_REAL_NAME "\",\n", m->be->act_size);
    fprintf(f, "  \"steps\": %d,\n  \"accum\": %d,\n", steps, accum);
    fprintf(f, "  \"micro_batch_size\": %d,\n  \"seq_length\": %d,\n", c->micro_batch_size,
            c->seq_length);
    fprintf(f, "  \"vocab_size\": %d,\n  \"head_dim\": %d,\n  \"num_query_groups\": %d,\n",
            c->vocab_size, c->head_dim, c->num_query_groups);
    fprintf(f, "  \"data_path\": ");
    moe_json_write_string(f, t->data.path);
    fprintf(f, ",\n  \"is_moe_layer\": [");
    for (int l = 0; l < c->num_layers; l++)
        fprintf(f, "%s%d", l ? ", " : "", c->is_moe_layer[l]);
    fprintf(f, "],\n  \"flags\": {");
    for (int i = 0; i < n; i++) {
        char v[MOE_FLAG_STR_LEN + 32];
        moe_flags_format_value(&flags[i], c, v, sizeof v);
        fprintf(f, "%s\n    ", i ? "," : "");
        moe_json_write_string(f, flags[i].name);
        fputs(": ", f);
        moe_json_write_string(f, v);
    }
    fprintf(f, "\n  },\n  \"values\": {");
    for (int i = 0; i < n; i++) {
        fprintf(f, "%s\n    ", i ? "," : "");
        moe_json_write_string(f, flags[i].name);
        fputs(": ", f);
        json_flag_value(f, &flags[i], c);
    }
    fprintf(f, "\n  },\n  \"total_params\": %zu,\n  \"params\": [", m->table.total);
    for (int i = 0; i < m->table.n; i++) {
        const moe_tensor *ten = &m->table.t[i];
        fprintf(f, "%s\n    {\"name\": ", i ? "," : "");
        moe_json_write_string(f, ten->name);
        fprintf(f, ", \"shape\": [");
        for (int d = 0; d < ten->ndim; d++)
            fprintf(f, "%s%d", d ? ", " : "", ten->shape[d]);
        fprintf(f, "], \"offset\": %zu, \"numel\": %zu, \"decay\": %d}", ten->offset, ten->numel,
                ten->decay);
    }
    fprintf(f, "\n  ]\n}\n");
    close_out(f, "config.json");
}

/* n full-precision host values, as fp32 on disk. */
static void write_host_real(const char *name, const moe_real *host, size_t n) {
    float *out = malloc(sizeof(float) * (n ? n : 1));
    if (!out)
        die("out of memory writing %s", name);
    for (size_t i = 0; i < n; i++)
        out[i] = (float)host[i];
    write_bin(name, out, sizeof(float) * n);
    free(out);
}

/* n full-precision values of backend memory, as fp32 on disk. */
static void write_real(const char *name, const moe_backend *be, const moe_real *src, size_t n) {
    moe_real *host = malloc(sizeof(moe_real) * (n ? n : 1));
    if (!host)
        die("out of memory writing %s", name);
    be->to_host(host, src, sizeof(moe_real) * n);
    write_host_real(name, host, n);
    free(host);
}

/* the fp32 master weights, wherever the optimizer keeps them (moe_trainer_master_to_host) */
static void write_master(const char *name, moe_trainer *t) {
    const size_t n = t->model->table.total;
    moe_real *host = malloc(sizeof(moe_real) * (n ? n : 1));
    moe_error err;
    if (!host)
        die("out of memory writing %s", name);
    if (moe_trainer_master_to_host(t, host, &err) != MOE_OK)
        die("%s: %s", name, err.msg);
    write_host_real(name, host, n);
    free(host);
}

static void write_batches(const moe_trainer *t, int steps, int accum) {
    const moe_config *c = &t->cfg;
    const size_t bt = (size_t)c->micro_batch_size * c->seq_length;
    int *buf = malloc(sizeof(int) * 2 * bt);
    if (!buf)
        die("out of memory writing batches.bin");
    FILE *f = open_out("batches.bin", "wb");
    for (int s = 0; s < steps; s++)
        for (int i = 0; i < accum; i++) {
            /* exactly what moe_trainer_step() draws */
            moe_dataset_batch(&t->data, MOE_SPLIT_TRAIN, c->micro_batch_size, c->seq_length,
                              (uint64_t)c->seed, (uint64_t)s * accum + i, buf, buf + bt);
            if (fwrite(buf, sizeof(int), 2 * bt, f) != 2 * bt)
                die("error writing %s/batches.bin: %s", g_dir, strerror(errno));
        }
    close_out(f, "batches.bin");
    free(buf);
}

/* Forward + backward (loss scale 1) of step 0's first micro-batch at init. */
static void write_step0(moe_trainer *t) {
    const moe_config *c = &t->cfg;
    moe_model *m = t->model;
    const moe_backend *be = m->be;
    const int B = c->micro_batch_size, T = c->seq_length, N = B * T, V = c->vocab_size;
    const int k = c->moe_router_topk;
    int *in = malloc(sizeof(int) * N), *tg = malloc(sizeof(int) * N);
    moe_real *logits = malloc(sizeof(moe_real) * (size_t)N * V);
    float *lf = malloc(sizeof(float) * (size_t)N * V);
    if (!in || !tg || !logits || !lf)
        die("out of memory for the step-0 dump");
    moe_dataset_batch(&t->data, MOE_SPLIT_TRAIN, B, T, (uint64_t)c->seed, 0, in, tg);

    moe_model_zero_grad(m);
    moe_model_forward(m, in, tg, B, T);
    be->read_act(logits, m->logits, (size_t)N * V);
    for (size_t i = 0; i < (size_t)N * V; i++)
        lf[i] = (float)logits[i];
    write_bin("logits.bin", lf, sizeof(float) * (size_t)N * V);

    /* routing of every MoE layer, before the backward reuses anything */
    FILE *rf = open_out("routing.bin", "wb");
    int *idx = malloc(sizeof(int) * (size_t)N * (k > 0 ? k : 1));
    moe_real *w = malloc(sizeof(moe_real) * (size_t)N * (k > 0 ? k : 1));
    float *wf = malloc(sizeof(float) * (size_t)N * (k > 0 ? k : 1));
    if (!idx || !w || !wf)
        die("out of memory for the routing dump");
    for (int l = 0; l < c->num_layers; l++) {
        if (!c->is_moe_layer[l])
            continue;
        const size_t nk = (size_t)N * k;
        be->to_host(idx, m->acts[l].moe.topk_idx, sizeof(int) * nk);
        be->to_host(w, m->acts[l].moe.topk_w, sizeof(moe_real) * nk);
        for (size_t i = 0; i < nk; i++)
            wf[i] = (float)w[i];
        if (fwrite(idx, sizeof(int), nk, rf) != nk || fwrite(wf, sizeof(float), nk, rf) != nk)
            die("error writing %s/routing.bin: %s", g_dir, strerror(errno));
    }
    close_out(rf, "routing.bin");

    FILE *f = open_out("step0.json", "w");
    fprintf(f, "{\n  \"ce\": ");
    json_num(f, m->last.ce);
    fprintf(f, ",\n  \"aux\": ");
    json_num(f, m->last.aux);
    fprintf(f, ",\n  \"z\": ");
    json_num(f, m->last.z);
    fprintf(f, ",\n  \"total\": ");
    json_num(f, m->last.total);
    fprintf(f, ",\n  \"layer_aux\": [");
    for (int l = 0; l < c->num_layers; l++) {
        fputs(l ? ", " : "", f);
        json_num(f, m->layer_aux[l]);
    }
    fprintf(f, "],\n  \"layer_z\": [");
    for (int l = 0; l < c->num_layers; l++) {
        fputs(l ? ", " : "", f);
        json_num(f, m->layer_z[l]);
    }
    fprintf(f, "],\n  \"expert_counts\": [");
    for (int l = 0; l < c->num_layers; l++) {
        fprintf(f, "%s[", l ? ", " : "");
        if (c->is_moe_layer[l])
            for (int e = 0; e < c->num_experts; e++)
                fprintf(f, "%s%lld", e ? ", " : "", m->acts[l].moe.counts[e]);
        fputc(']', f);
    }
    fprintf(f, "]\n}\n");
    close_out(f, "step0.json");

    moe_model_backward(m, 1.0);
    be->synchronize();
    write_real("grads.bin", be, m->grads, m->table.total);

    /* leave the trainer exactly as moe_trainer_create() made it */
    moe_model_zero_grad(m);
    moe_model_reset_load_counts(m);
    be->synchronize();
    free(in); free(tg); free(logits); free(lf); free(idx); free(w); free(wf);
}

static void write_step_json(FILE *f, const moe_step_stats *st, const moe_model *m, int first) {
    const moe_config *c = &m->cfg;
    fprintf(f, "%s\n    {\"step\": %d, \"loss\": ", first ? "" : ",", st->step);
    json_num(f, st->loss);
    fputs(", \"ce\": ", f);
    json_num(f, st->ce);
    fputs(", \"aux\": ", f);
    json_num(f, st->aux);
    fputs(", \"z\": ", f);
    json_num(f, st->z);
    fputs(", \"grad_norm\": ", f);
    json_num(f, st->grad_norm);
    fputs(", \"lr\": ", f);
    json_num(f, st->lr);
    fprintf(f, ", \"load_min\": %lld, \"load_max\": %lld, \"seconds\": ", st->load_min,
            st->load_max);
    json_num(f, st->seconds);
    if (c->moe_router_enable_expert_bias && c->num_experts > 0) {
        float *bias = malloc(sizeof(float) * (size_t)c->num_layers * c->num_experts);
        MOE_CHECK_ALLOC(bias, sizeof(float) * (size_t)c->num_layers * c->num_experts,
                        "the expert bias");
        moe_model_read_expert_bias(m, bias);
        fputs(", \"expert_bias\": [", f);
        for (int l = 0; l < c->num_layers; l++) {
            fprintf(f, "%s[", l ? ", " : "");
            if (c->is_moe_layer[l])
                for (int e = 0; e < c->num_experts; e++) {
                    fputs(e ? ", " : "", f);
                    json_num(f, bias[(size_t)l * c->num_experts + e]);
                }
            fputc(']', f);
        }
        fputc(']', f);
        free(bias);
    }
    fputc('}', f);
}

/* ------------------------------------------------------------------ main */

static void usage(FILE *f) {
    fprintf(f,
            "usage: " PROG " --out DIR [--steps N] [moe-train flags ...]\n\n"
            "Dump the initial weights, the batches, logits and gradients of one forward/backward\n"
            "and the losses of N training steps, for tools/torch_reference.py to check.\n\n"
            "own flags:\n"
            "  --out DIR                                    directory to write (created)\n"
            "  --steps N                                    trainer steps to run and dump "
            "(default: 10)\n\n"
            "Every other flag is a moe-train flag:\n\n");
}

int main(int argc, char **argv) {
    const char *out = NULL;
    int steps = 10;
    char **rest = calloc((size_t)argc + 1, sizeof *rest);
    if (!rest)
        return 1;
    int nrest = 0;
    rest[nrest++] = argv[0];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = NULL;
        int is_out = !strcmp(a, "--out") || !strncmp(a, "--out=", 6);
        int is_steps = !strcmp(a, "--steps") || !strncmp(a, "--steps=", 8);
        if (!is_out && !is_steps) {
            if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
                usage(stdout);
                moe_config_print_help(stdout, PROG);
                free(rest);
                return 0;
            }
            rest[nrest++] = argv[i];
            continue;
        }
        const char *eq = strchr(a, '=');
        if (eq)
            val = eq + 1;
        else if (i + 1 < argc)
            val = argv[++i];
        else {
            moe_log_error("%s needs a value (%s)", a, is_out ? "--out DIR" : "--steps N");
            free(rest);
            return 2;
        }
        if (is_out) {
            if (!*val) {
                moe_log_error("--out needs a directory name");
                free(rest);
                return 2;
            }
            out = val;
        } else {
            char *end;
            errno = 0;
            long s = strtol(val, &end, 10);
            if (errno || *end || end == val || s < 0 || s > 1000000) {
                moe_log_error("--steps '%s': give a number of steps >= 0", val);
                free(rest);
                return 2;
            }
            steps = (int)s;
        }
    }
    if (!out) {
        moe_log_error("--out DIR is required (where to write the reference dump); see --help");
        free(rest);
        return 2;
    }
    if (strlen(out) >= sizeof g_dir - 64) {
        moe_log_error("--out: path too long");
        free(rest);
        return 2;
    }
    snprintf(g_dir, sizeof g_dir, "%s", out);

    moe_config cfg;
    moe_error err;
    moe_error_clear(&err);
    moe_config_defaults(&cfg);
    moe_status s = moe_config_parse(&cfg, nrest, rest, &err);
    free(rest);
    if (s == MOE_ERR_HELP) {
        usage(stdout);
        moe_config_print_help(stdout, PROG);
        return 0;
    }
    if (s != MOE_OK) {
        moe_log_error("%s", err.msg);
        return 2;
    }
    moe_trainer *t = NULL;
    s = moe_trainer_create(&t, &cfg, &err);
    if (s != MOE_OK) {
        moe_log_error("%s", err.msg);
        return s == MOE_ERR_CONFIG || s == MOE_ERR_FLAG ? 2 : 1;
    }
    if (make_dirs(g_dir) != 0) {
        moe_log_error("--out %s: cannot create the directory: %s", g_dir, strerror(errno));
        moe_trainer_free(t);
        return 1;
    }
    const moe_config *c = &t->cfg;
    moe_model *m = t->model;
    const int accum = c->global_batch_size / c->micro_batch_size;
    moe_log_info(PROG " | device %s, %zu parameters, %d x %d tokens per micro-batch, accum %d, "
                      "%d steps -> %s",
                 m->be->name, m->table.total, c->micro_batch_size, c->seq_length, accum, steps,
                 g_dir);

    write_config(t, steps, accum);
    write_master("params.bin", t);
    write_batches(t, steps, accum);
    write_step0(t);
    moe_log_info("step0 | ce %.6f aux %.6f z %.6f total %.6f", m->last.ce, m->last.aux, m->last.z,
                 m->last.total);

    FILE *f = open_out("losses.json", "w");
    t->load_interval = 1; /* every step's expert loads go into the reference */
    fprintf(f, "{\n  \"steps\": [");
    for (int i = 0; i < steps; i++) {
        moe_step_stats st;
        moe_trainer_step(t, &st, NULL);
        write_step_json(f, &st, m, i == 0);
        moe_log_info("step %3d | loss %.6f (ce %.6f aux %.6f z %.6f) | lr %.3e | norm %.4f", i,
                     st.loss, st.ce, st.aux, st.z, st.lr, st.grad_norm);
    }
    fprintf(f, "\n  ]\n}\n");
    close_out(f, "losses.json");
    write_master("params_final.bin", t);
    moe_log_info(PROG " | wrote %s", g_dir);
    moe_trainer_free(t);
    return 0;
}
