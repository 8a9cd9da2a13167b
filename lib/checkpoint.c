/* Checkpoint and resume: see checkpoint.h; the file format is checkpoint_file.h's. */
#include "checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "atomic_file.h"
#include "checkpoint_file.h"
#include "dist_optimizer.h"
#include "log.h"
#include "lowp.h"

#define PATH_CAP 1100
#define REAL_DTYPE (sizeof(moe_real) == 4 ? MOE_CKPT_F32 : MOE_CKPT_F64)

/* What is saved for each parameter tensor, by name prefix: the master weights and the two
 * AdamW moments (Megatron/PyTorch call them exp_avg and exp_avg_sq). */
enum { BUF_PARAM, BUF_EXP_AVG, BUF_EXP_AVG_SQ, BUF_COUNT };
static const char *const g_prefix[BUF_COUNT] = {"model.", "optim.exp_avg.", "optim.exp_avg_sq."};
/* trainer.state: the step and what depends on it */
enum { ST_STEP, ST_ADAM_STEP, ST_SEED, ST_CONSUMED_SAMPLES, ST_COUNT };

/* The host copies of the state a checkpoint holds, laid out like the parameters. */
typedef struct host_state {
    moe_real *param;
    float *moment[2];    /* exp_avg, exp_avg_sq */
    float *expert_bias;  /* [L·E], or NULL for a dense model */
    int64_t state[ST_COUNT];
    int64_t sr_calls;    /* NVFP4's stochastic-rounding counter (lowp.sr_calls), or 0 */
    /* FP8 delayed scaling's site table (lowp.h), or NULL: per site its four scalars (scale,
     * used, used_inv, amax), its slot and count (pos, steps), and its amax window */
    float *dl_scalars;   /* [sites][4] */
    int64_t *dl_slots;   /* [sites][2] */
    float *dl_history;   /* [sites][hist_len] */
    moe_delayed_site *dl_site; /* [sites] the table as the backend holds it */
    int dl_found;        /* load: the checkpoint held them */
} host_state;

/* Whether the model's low-precision recipe draws stochastic-rounding seeds (NVFP4's
 * gradients, chapter 05): then its counter of draws is state a resumed run must continue
 * from, or it would round every later gradient with other random bits. */
static int has_sr_counter(const moe_model *m) {
    return m->lowp && m->lowp->spec[MOE_LOWP_GRADIENT].nvfp4.stochastic;
}
#define SR_TENSOR "lowp.sr_calls"

/* FP8 delayed scaling (chapter 05): every site's scale and amax history are state a resumed
 * run must continue from, or its next steps would cast with other scales. Optional sections:
 * a checkpoint of another recipe has none, and its run starts with empty histories. */
#define DL_SCALARS "lowp.delayed.scalars"
#define DL_SLOTS "lowp.delayed.slots"
#define DL_HISTORY "lowp.delayed.history"
static size_t dl_sites(const moe_model *m) { return moe_lowp_sites(m->lowp); }

static void *buf_of(host_state *h, int b) {
    return b == BUF_PARAM ? (void *)h->param : (void *)h->moment[b - 1];
}
static moe_ckpt_dtype dtype_of(int b) { return b == BUF_PARAM ? REAL_DTYPE : MOE_CKPT_F32; }

static void host_state_free(host_state *h) {
    free(h->param);
    free(h->moment[0]);
    free(h->moment[1]);
    free(h->expert_bias);
    free(h->dl_scalars);
    free(h->dl_slots);
    free(h->dl_history);
    free(h->dl_site);
}

static moe_status host_state_alloc(host_state *h, const moe_model *m, moe_error *err) {
    memset(h, 0, sizeof *h);
    const size_t n = m->table.total;
    const size_t nb = m->expert_bias ? (size_t)m->cfg.num_layers * m->cfg.num_experts : 0;
    h->param = malloc(sizeof(moe_real) * n + 1);
    h->moment[0] = malloc(sizeof(float) * n + 1);
    h->moment[1] = malloc(sizeof(float) * n + 1);
    h->expert_bias = nb ? malloc(sizeof(float) * nb) : NULL;
    const size_t ns = dl_sites(m);
    if (ns) {
        h->dl_scalars = malloc(sizeof(float) * 4 * ns);
        h->dl_slots = malloc(sizeof(int64_t) * 2 * ns);
        h->dl_history = malloc(sizeof(float) * ns * (size_t)m->lowp->hist_len);
        h->dl_site = malloc(sizeof(moe_delayed_site) * ns);
    }
    if (!h->param || !h->moment[0] || !h->moment[1] || (nb && !h->expert_bias) ||
        (ns && (!h->dl_scalars || !h->dl_slots || !h->dl_history || !h->dl_site))) {
        host_state_free(h);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory for the checkpoint's host copy "
                             "of %zu parameters (%.1f MB)", n,
                             (sizeof(moe_real) + 8.0) * n / 1e6);
    }
    return MOE_OK;
}

/* ------------------------------------------------------------------ paths */

static void iter_dir(char *out, size_t cap, const char *dir, long long step) {
    snprintf(out, cap, "%s/iter_%07lld", dir, step);
}
static void shard_path(char *out, size_t cap, const char *dir, long long step, int rank) {
    snprintf(out, cap, "%s/iter_%07lld/rank_%05d.moeckpt", dir, step, rank);
}

/* mkdir -p */
static moe_status make_dirs(const char *dir, moe_error *err) {
    char p[PATH_CAP];
    snprintf(p, sizeof p, "%s", dir);
    for (char *s = p + 1;; s++) {
        if (*s != '/' && *s != '\0')
            continue;
        char c = *s;
        *s = '\0';
        if (mkdir(p, 0777) != 0 && errno != EEXIST)
            return moe_error_set(err, MOE_ERR_IO, "cannot create checkpoint directory '%s': %s "
                                 "(fix the path given to --save)", p, strerror(errno));
        *s = c;
        if (!c)
            return MOE_OK;
    }
}

/* ------------------------------------------------------------------ collective verdicts */

/* Every rank ends a collective operation with the same verdict: a failure on one rank (its
 * disk, its file) fails the operation everywhere, so no rank goes on with a checkpoint the
 * others did not write or load. */
static moe_status agree(const moe_trainer *t, moe_status s, const char *what, moe_error *err) {
    if (!t->world)
        return s;
    int bad = s != MOE_OK;
    moe_comm_host_all_reduce_sum(t->world, &bad, 1, MOE_DTYPE_I32);
    if (bad && s == MOE_OK)
        return moe_error_set(err, MOE_ERR_IO, "%s failed on another rank (see its message)",
                             what);
    return s;
}

/* ------------------------------------------------------------------ save */

/* Of the ranks holding the same shard of a tensor (its replicas, the ranks its gradient is
 * summed over), the first one saves it. */
static int saves_tensor(const moe_trainer *t, const moe_tensor *ti) {
    if (!t->world)
        return 1;
    moe_group g;
    moe_grid_group(&t->par.grid, ti->grad_group, t->rank, &g, NULL);
    return g.rank == 0;
}

/* Every flag as "name=value\n": what the loader compares with its own flags. */
static char *config_text(const moe_config *c, size_t *len) {
    int n;
    const moe_flag *flags = moe_config_flags(&n);
    size_t cap = (size_t)n * (MOE_FLAG_STR_LEN + 128), used = 0;
    char *text = malloc(cap);
    if (!text)
        return NULL;
    for (int i = 0; i < n; i++) {
        char v[MOE_FLAG_STR_LEN + 32];
        moe_flags_format_value(&flags[i], c, v, sizeof v);
        used += (size_t)snprintf(text + used, cap - used, "%s=%s\n", flags[i].name, v);
    }
    *len = used;
    return text;
}

/* A tensor entry of the file: @p ti's shard with @p name, or a whole 1-/2-d tensor. */
static moe_ckpt_tensor entry(const char *name, moe_ckpt_dtype dtype, const moe_tensor *ti,
                             int ndim, int64_t s0, int64_t s1, const void *data) {
    moe_ckpt_tensor e;
    memset(&e, 0, sizeof e);
    snprintf(e.name, sizeof e.name, "%s", name);
    e.dtype = dtype;
    e.shard_count = 1;
    size_t numel = 1;
    if (ti) {
        e.ndim = ti->ndim;
        for (int d = 0; d < ti->ndim; d++)
            e.global_shape[d] = ti->global_shape[d];
        if (ti->shard.count > 1) {
            e.shard_dim = ti->shard.dim;
            e.shard_index = ti->shard.index;
            e.shard_count = ti->shard.count;
        }
        numel = ti->numel;
    } else {
        e.ndim = ndim;
        e.global_shape[0] = s0;
        e.global_shape[1] = s1;
        numel = (size_t)s0 * (size_t)(ndim > 1 ? s1 : 1);
    }
    e.bytes = numel * moe_ckpt_dtype_size(dtype);
    e.data = data;
    return e;
}

/* A tensor split twice (the routed experts: EP, then ETP inside each expert) is saved as its
 * EP shard, whole experts with every column: the file format records one split per tensor.
 * The ranks of the ETP group all-gather their slices of @p mine (collective over the group:
 * every member saves the tensor or none does, since they share their EDP position), and the
 * first of them places each element at its index in the EP shard, written to *out; the others
 * get NULL. @p outer receives the EP shard as a tensor (what the file entry describes). */
static moe_status etp_assemble(const moe_trainer *t, const moe_tensor *ti, const void *mine,
                               size_t es, moe_dtype dt, void **out, moe_tensor *outer,
                               moe_error *err) {
    const int P = ti->inner.count, dim = ti->inner.dim;
    *outer = *ti;
    outer->shape[dim] = ti->global_shape[dim];
    outer->origin[dim] = 0;
    outer->inner = (moe_shard){MOE_GROUP_NONE, 0, 0, 1};
    outer->shard.group = MOE_GROUP_EP;
    outer->numel = ti->numel * (size_t)P;
    unsigned char *all = malloc(outer->numel * es);
    *out = NULL;
    if (!all)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory gathering tensor '%s' over its "
                             "expert-tensor-parallel ranks (%zu values)", ti->name, outer->numel);
    moe_comm_host_all_gather(moe_parallel_group(&t->par, MOE_GROUP_ETP), mine, all, ti->numel,
                             dt);
    if (ti->inner.index != 0) {
        free(all);
        return MOE_OK;
    }
    unsigned char *ep_shard = malloc(outer->numel * es);
    if (!ep_shard) {
        free(all);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory saving tensor '%s'", ti->name);
    }
    for (int j = 0; j < P; j++) { /* rank j's slice, element by element */
        moe_tensor piece = *ti;
        piece.inner.index = j;
        piece.origin[dim] = j * ti->shape[dim];
        const unsigned char *src = all + (size_t)j * ti->numel * es;
        for (size_t i = 0; i < ti->numel; i++)
            memcpy(ep_shard + moe_tensor_local_index(outer, moe_tensor_global_index(&piece, i)) * es,
                   src + i * es, es);
    }
    free(all);
    *out = ep_shard;
    return MOE_OK;
}

/* This rank's file: its first-replica tensors; rank 0 adds the run's state and flags. */
static moe_status write_shard(const moe_trainer *t, const char *path, host_state *h,
                              const char *config, size_t config_len, moe_error *err) {
    const moe_model *m = t->model;
    const moe_param_table *pt = &m->table;
    /* the parameters' buffers, then at most: trainer.state, config, expert bias, the
     * stochastic-rounding counter and delayed scaling's three tables */
    enum { EXTRA_ENTRIES = 7 };
    moe_ckpt_tensor *list = calloc((size_t)pt->n * BUF_COUNT + EXTRA_ENTRIES, sizeof *list);
    void **owned = calloc((size_t)pt->n * BUF_COUNT + 1, sizeof *owned); /* assembled copies */
    if (!list || !owned) {
        free(list);
        free(owned);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory saving a checkpoint");
    }
    int n = 0, n_owned = 0;
    moe_status s = MOE_OK;
    for (int i = 0; i < pt->n && s == MOE_OK; i++) {
        const moe_tensor *ti = &pt->t[i];
        if (!saves_tensor(t, ti))
            continue;
        for (int b = 0; b < BUF_COUNT && s == MOE_OK; b++) {
            char name[MOE_CKPT_NAME_LEN];
            snprintf(name, sizeof name, "%s%s", g_prefix[b], ti->name);
            const size_t es = moe_ckpt_dtype_size(dtype_of(b));
            const void *data = (const char *)buf_of(h, b) + es * ti->offset;
            if (ti->inner.count == 1) {
                list[n++] = entry(name, dtype_of(b), ti, 0, 0, 0, data);
                continue;
            }
            moe_tensor outer;
            void *ep_shard;
            s = etp_assemble(t, ti, data, es,
                             b == BUF_PARAM ? moe_dtype_real() : MOE_DTYPE_F32, &ep_shard,
                             &outer, err);
            if (s == MOE_OK && ep_shard) {
                owned[n_owned++] = ep_shard;
                list[n++] = entry(name, dtype_of(b), &outer, 0, 0, 0, ep_shard);
            }
        }
    }
    if (s == MOE_OK && t->rank == 0) {
        list[n++] = entry("trainer.state", MOE_CKPT_I64, NULL, 1, ST_COUNT, 0, h->state);
        list[n++] = entry("config", MOE_CKPT_U8, NULL, 1, (int64_t)config_len, 0, config);
        if (h->expert_bias)
            list[n++] = entry("router.expert_bias", MOE_CKPT_F32, NULL, 2, m->cfg.num_layers,
                              m->cfg.num_experts, h->expert_bias);
        if (has_sr_counter(m)) /* the same on every rank: each quantizes as many gradients */
            list[n++] = entry(SR_TENSOR, MOE_CKPT_I64, NULL, 1, 1, 0, &h->sr_calls);
        if (h->dl_scalars) { /* rank 0's: on several ranks the replicas' windows are equal
                              * after the amax reduction, and EP, where they are not, is
                              * refused with a checkpoint (trainer.c) */
            const int64_t ns = (int64_t)dl_sites(m);
            list[n++] = entry(DL_SCALARS, MOE_CKPT_F32, NULL, 2, ns, 4, h->dl_scalars);
            list[n++] = entry(DL_SLOTS, MOE_CKPT_I64, NULL, 2, ns, 2, h->dl_slots);
            list[n++] = entry(DL_HISTORY, MOE_CKPT_F32, NULL, 2, ns, m->lowp->hist_len,
                              h->dl_history);
        }
    }
    moe_ckpt_file_info info = {.step = t->step, .file_index = t->rank,
                               .file_count = t->world_size};
    if (s == MOE_OK)
        s = moe_ckpt_file_write(path, &info, list, n, err);
    for (int i = 0; i < n_owned; i++)
        free(owned[i]);
    free(owned);
    free(list);
    return s;
}

static moe_status write_latest(const char *dir, long long step, moe_error *err) {
    char path[PATH_CAP];
    snprintf(path, sizeof path, "%s/%s", dir, MOE_CKPT_LATEST);
    moe_atomic_file af;
    MOE_TRY(moe_atomic_open(&af, path, err));
    fprintf(af.f, "%lld\n", step);
    return moe_atomic_commit(&af, err);
}

static int cmp_desc(const void *a, const void *b) {
    long long x = *(const long long *)a, y = *(const long long *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

static void remove_dir(const char *path) {
    DIR *d = opendir(path);
    if (!d)
        return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        char p[PATH_CAP + 300];
        snprintf(p, sizeof p, "%s/%s", path, e->d_name);
        unlink(p);
    }
    closedir(d);
    if (rmdir(path) != 0)
        moe_log_warn("could not delete old checkpoint '%s': %s", path, strerror(errno));
}

/* Keep the checkpoint of @p step and the keep-1 newest older ones. Newer ones (left by a run
 * that was rolled back to an older checkpoint) are not ours to delete. */
static void prune(const char *dir, long long step, int keep) {
    DIR *d = opendir(dir);
    if (!d)
        return;
    long long *older = NULL;
    int n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        long long s;
        int end = 0;
        if (sscanf(e->d_name, "iter_%lld%n", &s, &end) != 1 || e->d_name[end] != '\0' ||
            s >= step)
            continue;
        if (n == cap) {
            long long *grown = realloc(older, sizeof *older * (size_t)(cap = 2 * cap + 8));
            if (!grown)
                break;
            older = grown;
        }
        older[n++] = s;
    }
    closedir(d);
    if (n > 0) /* qsort of a NULL array is undefined even for 0 elements */
        qsort(older, (size_t)n, sizeof *older, cmp_desc);
    for (int i = keep - 1; i < n; i++) {
        char p[PATH_CAP];
        iter_dir(p, sizeof p, dir, older[i]);
        remove_dir(p);
    }
    free(older);
}

/* The whole fp32 master weights and AdamW moments into the host copy. Under the distributed
 * optimizer each rank holds its pieces only: they are all-gathered over each gradient group
 * first, so the file has the same contents as without it (every rank's file whole master
 * weights and moments of its shards), and a run may resume with another data-parallel size
 * or without the distributed optimizer. */
static moe_status state_to_host(moe_trainer *t, host_state *h, moe_error *err) {
    const moe_backend *be = t->model->be;
    const size_t n = t->model->table.total;
    MOE_TRY(moe_trainer_master_to_host(t, h->param, err));
    for (int b = 0; b < 2; b++) {
        const float *mine = b ? t->opt.v : t->opt.m;
        if (!t->zero.n_runs)
            be->to_host(h->moment[b], mine, sizeof(float) * n);
        else
            MOE_TRY(moe_zero_gather_to_host(&t->zero, &t->opt, mine, n, MOE_DTYPE_F32,
                                            h->moment[b], err));
    }
    const moe_lowp *lp = t->model->lowp;
    const size_t ns = dl_sites(t->model);
    if (ns) {
        moe_delayed_site *site = h->dl_site;
        be->to_host(site, lp->sites, sizeof *site * ns);
        be->to_host(h->dl_history, lp->history, sizeof(float) * ns * (size_t)lp->hist_len);
        for (size_t i = 0; i < ns; i++) {
            const float v[4] = {site[i].scale, site[i].used, site[i].used_inv, site[i].amax};
            memcpy(h->dl_scalars + 4 * i, v, sizeof v);
            h->dl_slots[2 * i] = site[i].pos;
            h->dl_slots[2 * i + 1] = site[i].steps;
        }
    }
    return MOE_OK;
}

moe_status moe_checkpoint_save(moe_trainer *t, const char *dir, int keep_last, moe_error *err) {
    moe_model *m = t->model;
    const moe_backend *be = m->be;
    char path[PATH_CAP];
    iter_dir(path, sizeof path, dir, t->step);
    moe_status s = make_dirs(path, err);
    host_state h;
    memset(&h, 0, sizeof h);
    if (s == MOE_OK)
        s = host_state_alloc(&h, m, err);
    size_t config_len = 0;
    char *config = s == MOE_OK ? config_text(&t->cfg, &config_len) : NULL;
    if (s == MOE_OK && !config)
        s = moe_error_set(err, MOE_ERR_NOMEM, "out of memory saving a checkpoint");
    if (s == MOE_OK) {
        be->synchronize();
        s = state_to_host(t, &h, err);
    }
    if (s == MOE_OK) {
        if (h.expert_bias)
            moe_model_read_expert_bias(m, h.expert_bias);
        h.state[ST_STEP] = t->step;
        h.state[ST_ADAM_STEP] = t->opt.step;
        h.state[ST_SEED] = t->cfg.seed;
        h.state[ST_CONSUMED_SAMPLES] = (int64_t)t->step * t->cfg.global_batch_size;
        h.sr_calls = has_sr_counter(m) ? (int64_t)moe_lowp_sr_calls(be, m->lowp) : 0;
        shard_path(path, sizeof path, dir, t->step, t->rank);
        s = write_shard(t, path, &h, config, config_len, err);
    }
    free(config);
    host_state_free(&h);
    /* the pointer moves only when every rank's file is complete */
    s = agree(t, s, "saving the checkpoint", err);
    if (s == MOE_OK && t->rank == 0) {
        s = write_latest(dir, t->step, err);
        if (s == MOE_OK && keep_last > 0)
            prune(dir, t->step, keep_last);
    }
    return agree(t, s, "saving the checkpoint", err);
}

/* ------------------------------------------------------------------ load */

/* The step `latest` names; *found = 0 when there is no pointer file. */
static moe_status read_latest(const char *dir, long long *step, int *found, moe_error *err) {
    char path[PATH_CAP];
    snprintf(path, sizeof path, "%s/%s", dir, MOE_CKPT_LATEST);
    *found = 0;
    FILE *f = fopen(path, "r");
    if (!f) {
        if (errno == ENOENT)
            return MOE_OK;
        return moe_error_set(err, MOE_ERR_IO, "cannot read '%s': %s", path, strerror(errno));
    }
    char line[64] = "";
    char *got = fgets(line, sizeof line, f);
    fclose(f);
    char *end = NULL;
    *step = got ? strtoll(line, &end, 10) : -1;
    if (!got || end == line || (*end != '\n' && *end != '\0') || *step < 0)
        return moe_error_set(err, MOE_ERR_DATA, "'%s' does not hold a step number (it should "
                             "contain one line such as 200)", path);
    *found = 1;
    return MOE_OK;
}

/* Read and verify every file of the checkpoint of @p step: each intact, each of this step,
 * each saying it is file i of the same count, none missing. */
static moe_status read_files(const char *dir, long long step, moe_ckpt_file **out, int *nf,
                             moe_error *err) {
    char path[PATH_CAP];
    moe_ckpt_file first;
    shard_path(path, sizeof path, dir, step, 0);
    MOE_TRY(moe_ckpt_file_read(&first, path, err));
    const int count = first.info.file_count;
    moe_ckpt_file *f = calloc(count > 0 ? (size_t)count : 1, sizeof *f);
    if (!f) {
        moe_ckpt_file_free(&first);
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory loading a checkpoint");
    }
    f[0] = first;
    moe_status s = MOE_OK;
    for (int i = 1; i < count && s == MOE_OK; i++) {
        shard_path(path, sizeof path, dir, step, i);
        if (access(path, F_OK) != 0)
            s = moe_error_set(err, MOE_ERR_IO, "checkpoint '%s/iter_%07lld' is missing shard "
                              "file '%s' (it was saved by %d ranks; every file is needed)", dir,
                              step, path, count);
        else
            s = moe_ckpt_file_read(&f[i], path, err);
    }
    for (int i = 0; i < count && s == MOE_OK; i++)
        if (f[i].info.step != step || f[i].info.file_index != i || f[i].info.file_count != count)
            s = moe_error_set(err, MOE_ERR_DATA, "checkpoint file '%s' does not belong to the "
                              "checkpoint of step %lld (it says step %lld, file %d of %d): files "
                              "of different checkpoints were mixed", f[i].path, step,
                              (long long)f[i].info.step, f[i].info.file_index,
                              f[i].info.file_count);
    if (s != MOE_OK) {
        for (int i = 0; i < count; i++)
            moe_ckpt_file_free(&f[i]);
        free(f);
        return s;
    }
    *out = f;
    *nf = count;
    return MOE_OK;
}

static const moe_ckpt_tensor *find(const moe_ckpt_file *f, int nf, const char *name) {
    for (int i = 0; i < nf; i++)
        for (int j = 0; j < f[i].n; j++)
            if (!strcmp(f[i].t[j].name, name))
                return &f[i].t[j];
    return NULL;
}

/* Reassemble the whole tensor @p name from its shards in every file (each element is put at
 * its place in the global shape by the shard's metadata), then cut out @p ti's shard of it:
 * this is what loads a checkpoint into another folding. @p out receives ti->numel elements. */
static moe_status gather(const moe_ckpt_file *f, int nf, const char *name, const moe_tensor *ti,
                         moe_ckpt_dtype dtype, void *out, moe_error *err) {
    const size_t es = moe_ckpt_dtype_size(dtype);
    size_t gnumel = 1;
    for (int d = 0; d < ti->ndim; d++)
        gnumel *= (size_t)ti->global_shape[d];
    unsigned char *full = malloc(gnumel * es);
    unsigned char *have = NULL;
    int count = 0, dim = 0;
    moe_status s = full ? MOE_OK : moe_error_set(err, MOE_ERR_NOMEM, "out of memory loading "
                                                 "tensor '%s' (%zu elements)", name, gnumel);
    for (int i = 0; i < nf && s == MOE_OK; i++)
        for (int j = 0; j < f[i].n && s == MOE_OK; j++) {
            const moe_ckpt_tensor *c = &f[i].t[j];
            if (strcmp(c->name, name) != 0)
                continue;
            int same = c->dtype == dtype && c->ndim == ti->ndim;
            for (int d = 0; same && d < ti->ndim; d++)
                same = c->global_shape[d] == ti->global_shape[d];
            if (!same) {
                s = moe_error_set(err, MOE_ERR_CONFIG, "tensor '%s' in '%s' has another shape or "
                                  "type than in this model (the checkpoint is of another model "
                                  "or build)", name, f[i].path);
                break;
            }
            if (!have) {
                count = c->shard_count;
                dim = c->shard_dim;
                have = calloc((size_t)count, 1);
                if (!have) {
                    s = moe_error_set(err, MOE_ERR_NOMEM, "out of memory loading a checkpoint");
                    break;
                }
            } else if (c->shard_count != count || c->shard_dim != dim) {
                s = moe_error_set(err, MOE_ERR_DATA, "the shards of tensor '%s' are split in "
                                  "different ways ('%s'): files of different checkpoints were "
                                  "mixed", name, f[i].path);
                break;
            }
            /* the piece as a moe_tensor, so moe_tensor_global_index places its elements */
            moe_tensor piece;
            memset(&piece, 0, sizeof piece);
            piece.ndim = c->ndim;
            for (int d = 0; d < c->ndim; d++)
                piece.shape[d] = piece.global_shape[d] = (int)c->global_shape[d];
            piece.shape[dim] /= count;
            piece.origin[dim] = c->shard_index * piece.shape[dim];
            piece.numel = gnumel / (size_t)count;
            const unsigned char *src = c->data;
            for (size_t e = 0; e < piece.numel; e++)
                memcpy(full + moe_tensor_global_index(&piece, e) * es, src + e * es, es);
            have[c->shard_index] = 1;
        }
    if (s == MOE_OK && !have)
        s = moe_error_set(err, MOE_ERR_DATA, "the checkpoint in '%s' has no tensor '%s'",
                          f[0].path, name);
    for (int k = 0; s == MOE_OK && k < count; k++)
        if (!have[k])
            s = moe_error_set(err, MOE_ERR_DATA, "the checkpoint in '%s' lacks shard %d of %d of "
                              "tensor '%s'", f[0].path, k, count, name);
    if (s == MOE_OK)
        for (size_t e = 0; e < ti->numel; e++)
            memcpy((unsigned char *)out + e * es, full + moe_tensor_global_index(ti, e) * es, es);
    free(full);
    free(have);
    return s;
}

/* A whole (unsharded) tensor of the given shape, to gather by. */
static moe_tensor whole(int ndim, int s0, int s1) {
    moe_tensor w;
    memset(&w, 0, sizeof w);
    w.ndim = ndim;
    w.shape[0] = w.global_shape[0] = s0;
    w.shape[1] = w.global_shape[1] = s1;
    w.numel = (size_t)s0 * (size_t)(ndim > 1 ? s1 : 1);
    return w;
}

/* Flags that shape the model: a difference makes the checkpoint unloadable. */
static const char *const g_shape_flags[] = {
    "num-layers", "hidden-size", "num-attention-heads", "num-query-groups", "ffn-hidden-size",
    "qk-layernorm", "num-experts", "moe-ffn-hidden-size", "moe-layer-freq",
    "moe-shared-expert-intermediate-size", "tokenizer-type", "moe-router-enable-expert-bias",
    "make-vocab-size-divisible-by"};
/* Settings of the model, MoE and training groups that only say how the run executes. */
static const char *const g_free_flags[] = {
    "train-iters", "expert-model-parallel-size", "tensor-model-parallel-size",
    "sequence-parallel", "expert-tensor-parallel-size", "context-parallel-size",
    "cp-comm-type", "hierarchical-context-parallel-sizes", "pipeline-model-parallel-size", "moe-token-dispatcher-type",
    "moe-alltoall-path", "moe-expert-backend", "moe-grouped-gemm"};

static int listed(const char *const *list, size_t n, const char *name) {
    for (size_t i = 0; i < n; i++)
        if (!strcmp(list[i], name))
            return 1;
    return 0;
}
#define LISTED(list, name) listed(list, sizeof list / sizeof list[0], name)

/* Compare the saved flags with this run's: model-shape differences are errors, training
 * differences warnings (rank 0 prints them), the rest is free. */
static moe_status check_config(const moe_trainer *t, const moe_ckpt_file *f, int nf,
                               moe_error *err) {
    const moe_ckpt_tensor *c = find(f, nf, "config");
    if (!c)
        return moe_error_set(err, MOE_ERR_DATA, "the checkpoint in '%s' has no 'config' record",
                             f[0].path);
    char *text = malloc((size_t)c->bytes + 1);
    if (!text)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory loading a checkpoint");
    memcpy(text, c->data, (size_t)c->bytes);
    text[c->bytes] = '\0';
    int n;
    const moe_flag *flags = moe_config_flags(&n);
    moe_status s = MOE_OK;
    for (char *line = strtok(text, "\n"); line && s == MOE_OK; line = strtok(NULL, "\n")) {
        char *eq = strchr(line, '=');
        if (!eq)
            continue;
        *eq = '\0';
        const char *name = line, *saved = eq + 1;
        const moe_flag *fl = NULL;
        for (int i = 0; i < n && !fl; i++)
            fl = !strcmp(flags[i].name, name) ? &flags[i] : NULL;
        if (!fl) /* a flag this build no longer has */
            continue;
        char now[MOE_FLAG_STR_LEN + 32];
        moe_flags_format_value(fl, &t->cfg, now, sizeof now);
        if (!strcmp(now, saved))
            continue;
        if (LISTED(g_shape_flags, name))
            s = moe_error_set(err, MOE_ERR_CONFIG, "the checkpoint in '%s' was saved with --%s "
                              "%s, this run has --%s %s: flags that shape the model must match "
                              "the checkpoint (give --%s %s, or load another checkpoint)",
                              f[0].path, name, saved, name, now, name, saved);
        else if (t->rank == 0 && !LISTED(g_free_flags, name) &&
                 (!strcmp(fl->group, "model") || !strcmp(fl->group, "mixture of experts") ||
                  !strcmp(fl->group, "training")))
            moe_log_warn("resuming with --%s %s, the checkpoint was saved with %s: the run "
                         "will not reproduce an uninterrupted one", name, now, saved);
    }
    free(text);
    return s;
}

/* Delayed scaling's site table, when this run has one and the checkpoint too; a checkpoint
 * of another recipe (none saved) leaves the fresh table: empty histories. */
static moe_status stage_delayed(const moe_model *m, const moe_ckpt_file *f, int nf,
                                host_state *h, moe_error *err) {
    const int ns = (int)dl_sites(m), len = ns ? m->lowp->hist_len : 0;
    h->dl_found = ns > 0 && find(f, nf, DL_HISTORY) != NULL;
    if (!h->dl_found) {
        if (ns)
            moe_log_info("ckpt  | no delayed-scaling state in '%s': the amax histories start "
                         "empty", f[0].path);
        return MOE_OK;
    }
    const moe_ckpt_tensor *saved = find(f, nf, DL_HISTORY);
    if (saved->ndim != 2 || saved->global_shape[0] != ns || saved->global_shape[1] != len)
        return moe_error_set(err, MOE_ERR_CONFIG, "the checkpoint in '%s' holds delayed-scaling "
                             "histories of %lld sites x %lld steps, this run has %d x %d "
                             "(--fp8-amax-history-len must match the checkpoint's)", f[0].path,
                             (long long)saved->global_shape[0],
                             (long long)(saved->ndim > 1 ? saved->global_shape[1] : 1), ns, len);
    const moe_tensor sc = whole(2, ns, 4), sl = whole(2, ns, 2), hi = whole(2, ns, len);
    MOE_TRY(gather(f, nf, DL_SCALARS, &sc, MOE_CKPT_F32, h->dl_scalars, err));
    MOE_TRY(gather(f, nf, DL_SLOTS, &sl, MOE_CKPT_I64, h->dl_slots, err));
    MOE_TRY(gather(f, nf, DL_HISTORY, &hi, MOE_CKPT_F32, h->dl_history, err));
    for (int i = 0; i < ns; i++) {
        const int64_t pos = h->dl_slots[2 * i], steps = h->dl_slots[2 * i + 1];
        if (pos < 0 || pos >= len || steps < 0 || steps > INT32_MAX)
            return moe_error_set(err, MOE_ERR_DATA, "the checkpoint in '%s' says delayed-scaling "
                                 "site %d is at slot %lld of %d after %lld steps", f[0].path, i,
                                 (long long)pos, len, (long long)steps);
        const float *v = h->dl_scalars + 4 * i;
        h->dl_site[i] = (moe_delayed_site){v[0], v[1], v[2], v[3], (int32_t)pos, (int32_t)steps};
    }
    return MOE_OK;
}

/* Everything a checkpoint holds for this trainer, into host buffers, verified. */
static moe_status stage(const moe_trainer *t, const moe_ckpt_file *f, int nf, long long step,
                        host_state *h, moe_error *err) {
    const moe_model *m = t->model;
    MOE_TRY(check_config(t, f, nf, err));
    const moe_tensor st = whole(1, ST_COUNT, 1);
    MOE_TRY(gather(f, nf, "trainer.state", &st, MOE_CKPT_I64, h->state, err));
    if (h->state[ST_STEP] != step)
        return moe_error_set(err, MOE_ERR_DATA, "the checkpoint in '%s' says step %lld inside "
                             "and step %lld outside", f[0].path, (long long)h->state[ST_STEP],
                             step);
    for (int i = 0; i < m->table.n; i++) {
        const moe_tensor *ti = &m->table.t[i];
        for (int b = 0; b < BUF_COUNT; b++) {
            char name[MOE_CKPT_NAME_LEN];
            snprintf(name, sizeof name, "%s%s", g_prefix[b], ti->name);
            const size_t es = moe_ckpt_dtype_size(dtype_of(b));
            MOE_TRY(gather(f, nf, name, ti, dtype_of(b), (char *)buf_of(h, b) + es * ti->offset,
                           err));
        }
    }
    if (h->expert_bias) {
        const moe_tensor eb = whole(2, m->cfg.num_layers, m->cfg.num_experts);
        MOE_TRY(gather(f, nf, "router.expert_bias", &eb, MOE_CKPT_F32, h->expert_bias, err));
    }
    /* a checkpoint saved without stochastic rounding (another precision) has made no draws */
    h->sr_calls = 0;
    if (has_sr_counter(m) && find(f, nf, SR_TENSOR)) {
        const moe_tensor one = whole(1, 1, 1);
        MOE_TRY(gather(f, nf, SR_TENSOR, &one, MOE_CKPT_I64, &h->sr_calls, err));
        if (h->sr_calls < 0)
            return moe_error_set(err, MOE_ERR_DATA, "the checkpoint in '%s' says %lld "
                                 "stochastic-rounding draws", f[0].path, (long long)h->sr_calls);
    }
    return stage_delayed(m, f, nf, h, err);
}

/* Copy the verified state into the trainer: the only step that changes it. */
static void apply(moe_trainer *t, const host_state *h) {
    moe_model *m = t->model;
    const moe_backend *be = m->be;
    /* this rank's master weights and moments: all of them, or its pieces under the
     * distributed optimizer (the file holds them whole, so any data-parallel size loads it) */
    moe_trainer_master_from_host(t, h->param);
    moe_adamw_pieces_from_host(&t->opt, t->opt.m, h->moment[0], sizeof(float));
    moe_adamw_pieces_from_host(&t->opt, t->opt.v, h->moment[1], sizeof(float));
    if (h->expert_bias) {
        const size_t nb = (size_t)m->cfg.num_layers * m->cfg.num_experts;
        be->from_host(m->expert_bias, h->expert_bias, sizeof(float) * nb);
    }
    t->step = (int)h->state[ST_STEP];
    t->opt.step = h->state[ST_ADAM_STEP];
    if (has_sr_counter(m))
        moe_lowp_set_sr_calls(be, m->lowp, (uint64_t)h->sr_calls);
    if (h->dl_found) { /* the sites, then the weights cast again with their saved scales */
        const size_t ns = dl_sites(m);
        be->from_host(m->lowp->sites, h->dl_site, sizeof(moe_delayed_site) * ns);
        be->from_host(m->lowp->history, h->dl_history,
                      sizeof(float) * ns * (size_t)m->lowp->hist_len);
        moe_model_lowp_replay_weights(m);
    }
    be->synchronize();
}

moe_status moe_checkpoint_load(moe_trainer *t, const char *dir, int fresh_ok, int *loaded,
                               moe_error *err) {
    *loaded = 0;
    long long step = 0;
    int found = 0;
    moe_status s = read_latest(dir, &step, &found, err);
    if (s == MOE_OK && !found) {
        if (fresh_ok) {
            moe_log_info("ckpt  | no checkpoint in '%s' yet: starting from step 0", dir);
            return agree(t, MOE_OK, "loading the checkpoint", err);
        }
        s = moe_error_set(err, MOE_ERR_IO, "--load '%s': no checkpoint there ('%s' is missing; "
                          "give the directory a run saved into with --save)", dir,
                          MOE_CKPT_LATEST);
    }
    moe_ckpt_file *f = NULL;
    int nf = 0;
    if (s == MOE_OK)
        s = read_files(dir, step, &f, &nf, err);
    host_state h;
    memset(&h, 0, sizeof h);
    if (s == MOE_OK)
        s = host_state_alloc(&h, t->model, err);
    if (s == MOE_OK)
        s = stage(t, f, nf, step, &h, err);
    for (int i = 0; i < nf; i++)
        moe_ckpt_file_free(&f[i]);
    free(f);
    s = agree(t, s, "loading the checkpoint", err);
    if (s == MOE_OK) {
        apply(t, &h);
        *loaded = 1;
    }
    host_state_free(&h);
    return s;
}
