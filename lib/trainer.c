/* The training loop: see trainer.h. */
#include "trainer.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "cpu/ops.h"
#include "lowp.h"
#include "moe/experts.h"
#include "log.h"
#include "rng.h"
#include "timer.h"

/* RNG streams of the trainer (weights use the tensor names, data its own streams) */
#define STREAM_SAMPLE 0x5A3B1Eull

moe_status moe_trainer_create(moe_trainer **out, const moe_config *cfg, moe_error *err) {
    return moe_trainer_create_dist(out, cfg, NULL, err);
}

/* Context parallelism's groups (chapter 07): the CP group of the grid, its exchange, and for
 * a2a+p2p its two levels (Megatron's --hierarchical-context-parallel-sizes A,P): the a2a
 * groups are A adjacent CP ranks, the ring joins the ranks with the same place in theirs. The
 * router statistics are summed over TP x CP (moe/layer.h). */
static moe_status make_cp(moe_trainer *t, moe_error *err) {
    const moe_config *c = &t->cfg;
    moe_model_cp *cp = &t->cp;
    moe_group g;
    moe_grid_group(&t->par.grid, MOE_GROUP_CP, t->rank, &g, NULL);
    cp->attn = (moe_cp_attention){.comm = moe_parallel_group(&t->par, MOE_GROUP_CP),
                                  .cp = g.size, .rank = g.rank,
                                  .type = (moe_cp_comm)c->cp_comm, .a2a = c->cp_a2a};
    moe_grid_group(&t->par.grid, MOE_GROUP_TP_CP, t->rank, &g, NULL);
    cp->shards = (moe_tp){moe_parallel_group(&t->par, MOE_GROUP_TP_CP), g.size, g.rank, 1};
    if (cp->attn.cp == 1 || cp->attn.type != MOE_CP_A2A_P2P)
        return MOE_OK;
    const int A = c->cp_a2a, r = cp->attn.rank;
    moe_comm *in = NULL, *out = NULL;
    /* every rank of the CP group makes both splits, in the same order */
    MOE_TRY(moe_comm_split(cp->attn.comm, r / A, r % A, &in, err));
    MOE_TRY(moe_comm_split(cp->attn.comm, r % A, r / A, &out, err));
    cp->attn.inner = A > 1 ? in : NULL;
    cp->attn.outer = cp->attn.cp / A > 1 ? out : NULL;
    if (!cp->attn.inner)
        moe_comm_free(in);
    if (!cp->attn.outer)
        moe_comm_free(out);
    return MOE_OK;
}

/* The process groups of a run, from the parallel grid (parallel.h): the attention/dense
 * grid TP x CP x DP (PP is 1: not planned) and the expert grid EP x EDP. The ranks of a
 * TP x CP group run the same micro-batches (a CP rank its T/CP tokens of each sequence);
 * the DP groups split them. */
static moe_status make_groups(moe_trainer *t, moe_error *err) {
    const moe_config *c = &t->cfg;
    const int W = t->world_size, EP = c->expert_model_parallel_size;
    const int A = c->global_batch_size / c->micro_batch_size;
    const moe_grid grid = {.world = W,
                           .tp = c->tensor_model_parallel_size,
                           .cp = c->context_parallel_size,
                           .ep = EP,
                           .etp = c->expert_tensor_parallel_size,
                           .pp = c->pipeline_model_parallel_size};
    MOE_TRY(moe_parallel_create(&t->par, t->world, &grid, err));
    const int DP = t->par.grid.dp;
    if (A % DP != 0)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "--global-batch-size %d is %d micro-batches of %d, which do not split "
                             "evenly over %d data-parallel ranks (use a global batch that is a "
                             "multiple of micro-batch-size x data-parallel ranks = %d)",
                             c->global_batch_size, A, c->micro_batch_size, DP,
                             c->micro_batch_size * DP);
    moe_group g;
    moe_grid_group(&t->par.grid, MOE_GROUP_DP, t->rank, &g, NULL);
    t->dp_size = g.size;
    t->dp_rank = g.rank;
    moe_grid_group(&t->par.grid, MOE_GROUP_TP, t->rank, &g, NULL);
    t->tp = (moe_tp){moe_parallel_group(&t->par, MOE_GROUP_TP), g.size, g.rank,
                     c->sequence_parallel};
    MOE_TRY(make_cp(t, err));
    moe_group ep;
    moe_grid_group(&t->par.grid, MOE_GROUP_EP, t->rank, &ep, NULL);
    t->ep.size = ep.size;
    t->ep.rank = ep.rank;
    t->ep.comm = moe_parallel_group(&t->par, MOE_GROUP_EP);
    /* the ETP group splits each local expert (moe/expert_tp.h); it travels with the EP
     * context, the two together holding one copy of the experts */
    moe_grid_group(&t->par.grid, MOE_GROUP_ETP, t->rank, &g, NULL);
    t->ep.etp = (moe_tp){moe_parallel_group(&t->par, MOE_GROUP_ETP), g.size, g.rank, 0};

    /* which dispatcher the MoE layers use (moe/dispatch.h) */
    MOE_TRY(moe_ep_choose_dispatcher(&t->ep, c, t->rank == 0, err));
    return MOE_OK;
}

moe_status moe_trainer_create_dist(moe_trainer **out, const moe_config *cfg, moe_comm *world,
                                   moe_error *err) {
    *out = NULL;
    moe_trainer *t = calloc(1, sizeof *t);
    if (!t)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    t->cfg = *cfg;
    t->world = world;
    t->rank = world ? moe_comm_rank(world) : 0;
    t->world_size = world ? moe_comm_size(world) : 1;
    t->dp_size = t->world_size;
    t->tp = moe_tp_none();
    t->cp.attn.cp = 1;
    t->cp.shards = moe_tp_none();
    moe_config *c = &t->cfg;
    moe_tokenizer_type tt;
    moe_status s = moe_tokenizer_parse_type(c->tokenizer_type, &tt, err);
    if (s == MOE_OK)
        s = moe_dataset_load(&t->data, c->data_path, tt, err);
    if (s == MOE_OK) {
        c->vocab_size = t->data.tok.vocab_size;
        s = moe_config_validate(c, err);
    }
    if (s == MOE_OK && t->rank == 0) { /* legal but suspicious settings: say so, once */
        moe_config_warnings_t w;
        moe_config_warnings(c, &w);
        for (int i = 0; i < w.n; i++)
            moe_log_warn("%s", w.msg[i]);
    }
    if (s == MOE_OK)
        s = moe_dataset_check_seq_len(&t->data, c->seq_length, err);
    const moe_backend *be = NULL;
    if (s == MOE_OK)
        s = moe_backend_select(c->device, &be, err);
    /* a split over ranks needs the ranks: one process cannot run it */
    const struct {
        const char *flag;
        int size;
    } splits[] = {{"expert-model-parallel-size", c->expert_model_parallel_size},
                  {"expert-tensor-parallel-size", c->expert_tensor_parallel_size},
                  {"tensor-model-parallel-size", c->tensor_model_parallel_size},
                  {"context-parallel-size", c->context_parallel_size}};
    for (int i = 0; i < 4 && s == MOE_OK && !world; i++)
        if (splits[i].size > 1)
            s = moe_error_set(err, MOE_ERR_CONFIG,
                              "--%s %d needs %d ranks: run under mpirun -np %d (a build with "
                              "MPI)", splits[i].flag, splits[i].size, splits[i].size,
                              splits[i].size);
    if (s == MOE_OK && world && moe_comm_device(world) != be->device)
        s = moe_error_set(err, MOE_ERR_BACKEND,
                          "--device %s does not match the communication transport (%s ranks)",
                          be->name, moe_comm_device(world) == MOE_DEVICE_CUDA ? "GPU" : "CPU");
    /* context-parallel attention needs the merge and the packing ops (CPU and CUDA have them) */
    if (s == MOE_OK && c->context_parallel_size > 1)
        s = moe_cp_attention_supported(be, err);
    /* chapter 05's delayed scaling on several ranks: the amax windows are reduced over the
     * replicas after each micro-batch (reduce_amax below; under TP/ETP the recipe is refused
     * by lowp.c's start-up checks, a shard's amax not being the tensor's).
     * MOE_FP8_AMAX_REDUCE=0 turns the reduction off: tests only (they show the windows part) */
    const char *amax_env = getenv("MOE_FP8_AMAX_REDUCE");
    t->amax_reduce = !(amax_env && strcmp(amax_env, "0") == 0);
    /* The checkpoint keeps rank 0's site table (checkpoint.c): the replicas' windows are
     * equal after the reduction, but under EP each rank holds other experts' sites, so a
     * resume would give every rank rank 0's expert histories. Refused until the table is
     * saved per EP rank. */
    if (s == MOE_OK && t->world_size > 1 && strcmp(c->fp8_recipe, "delayed") == 0 &&
        strcmp(c->fp8_format, "none") != 0 && c->expert_model_parallel_size > 1 &&
        (c->save[0] || c->load[0]))
        s = moe_error_set(err, MOE_ERR_CONFIG,
                          "--fp8-recipe delayed with --expert-model-parallel-size %d and "
                          "--save/--load: the checkpoint keeps one rank's amax histories, and "
                          "under EP each rank's experts have their own; not supported yet: "
                          "checkpoint with EP 1 (data parallel only), or use --fp8-recipe "
                          "blockwise or tensorwise",
                          c->expert_model_parallel_size);
    t->ep.be = be;
    if (s == MOE_OK && world)
        s = make_groups(t, err);
    if (s == MOE_OK)
        s = moe_model_create_parallel(&t->model, c, be, c->micro_batch_size,
                                      t->ep.comm || t->ep.etp.comm ? &t->ep : NULL, &t->tp,
                                      &t->cp, world ? &t->par.grid : NULL, err);
    if (s == MOE_OK && world && c->use_distributed_optimizer) {
        /* ZeRO-1: this rank's master weights and moments cover its piece of each gradient
         * group only (the model holds no master: moe_model::master_sharded) */
        moe_adamw_piece pieces[MOE_ADAMW_MAX_PIECES];
        int n_pieces = 0;
        MOE_ASSERT(t->model->master_sharded);
        s = moe_zero_init(&t->zero, be, &t->model->table, &t->par, pieces, &n_pieces, err);
        if (s == MOE_OK)
            s = moe_adamw_init_pieces(&t->opt, be, &t->model->table, pieces, n_pieces, 1, err);
    } else if (s == MOE_OK)
        s = moe_adamw_init(&t->opt, be, &t->model->table, err);
    if (s == MOE_OK) { /* page-locked landing places of the step boundary's readback */
        const size_t nl = (size_t)c->num_layers * c->num_experts;
        t->readback = be->host_alloc(sizeof(moe_step_scalars));
        t->load_host = nl ? be->host_alloc(sizeof(long long) * nl) : NULL;
        t->load_interval = c->log_interval;
        t->grow_budget = moe_model_grow_moe_budget;
        t->hyper_host = be->host_alloc(3 * sizeof(double));
        /* this rank's micro-batches of a step, inputs and targets (make_groups set dp_size) */
        const size_t local = (size_t)(c->global_batch_size / c->micro_batch_size) /
                             (size_t)t->dp_size;
        t->batch = be->host_alloc(sizeof(int) * 2 * local * (size_t)c->micro_batch_size *
                                  (size_t)c->seq_length);
        if (!t->readback || (nl && !t->load_host) || !t->hyper_host || !t->batch)
            s = moe_error_set(err, MOE_ERR_NOMEM,
                              "out of page-locked host memory for the step's batches and "
                              "readback: reduce --global-batch-size or --seq-length");
    }
    /* (full_iteration on several GPU ranks: the gradient all-reduces inside the step count
     * their bytes on the host, and a replay adds what its capture counted, lib/graph.c) */
    if (s == MOE_OK) {
        size_t n = (size_t)c->micro_batch_size * c->seq_length;
        t->inputs = malloc(sizeof(int) * n);
        t->targets = malloc(sizeof(int) * n);
        if (!t->inputs || !t->targets)
            s = moe_error_set(err, MOE_ERR_NOMEM,
                              "out of host memory for the batch (2 x %zu tokens): reduce "
                              "--micro-batch-size or --seq-length", n);
    }
    if (s != MOE_OK) {
        moe_trainer_free(t);
        return s;
    }
    moe_model_init(t->model, (uint64_t)c->seed);
    if (t->opt.master) { /* this rank's pieces of the same initial master weights */
        const size_t n = moe_model_num_params(t->model);
        moe_real *host = malloc(sizeof(moe_real) * (n ? n : 1));
        MOE_CHECK_ALLOC(host, sizeof(moe_real) * n, "the host copy of the initial weights");
        moe_params_init(&t->model->table, host, (uint64_t)c->seed);
        moe_adamw_pieces_from_host(&t->opt, t->opt.master, host, sizeof(moe_real));
        free(host);
    }
    *out = t;
    return MOE_OK;
}

moe_status moe_trainer_master_to_host(moe_trainer *t, moe_real *host, moe_error *err) {
    const moe_model *m = t->model;
    const size_t n = m->table.total;
    if (!t->opt.master) {
        m->be->to_host(host, m->params, sizeof(moe_real) * n);
        return MOE_OK;
    }
    return moe_zero_gather_to_host(&t->zero, &t->opt, t->opt.master, n, moe_dtype_real(), host,
                                   err);
}

void moe_trainer_master_from_host(moe_trainer *t, const moe_real *host) {
    moe_model_set_weights(t->model, host);
    if (t->opt.master)
        moe_adamw_pieces_from_host(&t->opt, t->opt.master, host, sizeof(moe_real));
}

void moe_trainer_free(moe_trainer *t) {
    if (!t)
        return;
    if (t->model) {
        t->model->be->host_free(t->readback);
        t->model->be->host_free(t->load_host);
        t->model->be->host_free(t->hyper_host);
        t->model->be->host_free(t->batch);
    }
    moe_model_free(t->model);
    moe_adamw_free(&t->opt);
    moe_zero_free(&t->zero);
    moe_ep_free(&t->ep);
    moe_comm_free(t->cp.attn.inner); /* a2a+p2p's levels (make_cp); the CP group is the grid's */
    moe_comm_free(t->cp.attn.outer);
    moe_parallel_free(&t->par);
    moe_dataset_free(&t->data);
    free(t->inputs);
    free(t->targets);
    free(t);
    moe_cpu_matmul_release();
}

/* Consecutive tensors that share a key (the group their gradient is summed over, or the
 * group their shards are spread over) form one run of the flat buffer (moe_params_next_run).
 * The layout puts every dense tensor first and every expert shard last (model.c), so there
 * are two runs, and each collective below moves one whole run: one call per group, not one
 * per tensor. */
static moe_group_kind replicas(const moe_tensor *t) { return t->grad_group; }
static moe_group_kind partial(const moe_tensor *t) { return t->partial_group; }
static moe_group_kind shard_group(const moe_tensor *t) { return t->shard.group; }

/* After every rank has accumulated its micro-batches, sum each gradient over the ranks that
 * hold the same tensor (its replicas): dense tensors over DP x CP, expert shards over EDP.
 * First, the tensors whose gradient a rank computed from part of the work of its TP group
 * (tensor_parallel.h: norms under sequence parallelism, the QK-norm) are summed over TP,
 * so that every replica holds its group's whole gradient. */
static void sync_gradients(moe_trainer *t) {
    moe_model *m = t->model;
    size_t start, end;
    moe_group_kind k;
    int i = 0;
    while (moe_params_next_run(&m->table, partial, &i, &start, &end, &k)) {
        moe_comm *g = k == MOE_GROUP_NONE ? NULL : moe_parallel_group(&t->par, k);
        if (g)
            moe_comm_all_reduce_sum(g, m->grads + start, end - start, moe_dtype_real());
    }
    if (t->zero.n_runs) { /* the distributed optimizer: each rank sums its piece only */
        moe_zero_reduce_scatter(&t->zero, m->grads);
        return;
    }
    i = 0;
    while (moe_params_next_run(&m->table, replicas, &i, &start, &end, &k)) {
        moe_comm *g = moe_parallel_group(&t->par, k);
        if (g)
            moe_comm_all_reduce_sum(g, m->grads + start, end - start, moe_dtype_real());
    }
}

/* The global gradient norm: after the sync every replica holds the same gradient, so the
 * squares of a tensor every rank holds whole count once, and those of a split tensor are
 * summed over the ranks holding its shards (the expert shards over EP, the TP-split ones over
 * TP). Under the distributed optimizer a rank holds the summed gradient of its piece of each
 * run only: the squares of the pieces, sorted by the tensors' shard groups, are first summed
 * over the run's group (DP x CP or EDP), which gives every rank its replicas' whole squares,
 * and then go on as above. Whole tensors first, then each group's sum in kind order. Every
 * rank has the same layout, so every rank takes part in the same all-reduces.
 *
 * Chapter 06: nothing here leaves the device. Each sum of squares is added into its group's
 * double in the step's scalars (step_scalars.h), the group sums are all-reduced where they
 * lie (on the stream under NCCL; on the host buffers of the CPU backend under MPI), and one
 * kernel takes the root, the clip factor and the non-finite check, which AdamW then reads. */
_Static_assert(MOE_STEP_NORM_SLOTS == MOE_GROUP_COUNT + 1,
               "one slot of the step's squares per group kind, and one for whole tensors");

static void enqueue_grad_norm(moe_trainer *t) {
    moe_model *m = t->model;
    const moe_backend *be = m->be;
    const moe_param_table *pt = &m->table;
    moe_step_scalars *S = m->scalars;
    int used[MOE_GROUP_COUNT + 1] = {0};
    for (int i = 0; i < pt->n; i++)
        used[pt->t[i].shard.group] = 1;
    be->zero(S->sumsq, sizeof S->sumsq); /* the squares of this update only */
    if (t->zero.n_runs) {
        for (int r = 0; r < t->zero.n_runs; r++) {
            const moe_zero_run *run = &t->zero.run[r];
            be->zero(S->part, sizeof S->part);
            for (int i = 0; i < pt->n; i++) { /* each tensor's part of the piece */
                const moe_tensor *ten = &pt->t[i];
                const size_t a = ten->offset > run->piece.lo ? ten->offset : run->piece.lo;
                const size_t b = ten->offset + ten->numel < run->piece.hi
                                     ? ten->offset + ten->numel : run->piece.hi;
                if (a < b)
                    be->sum_squares(&S->part[ten->shard.group], m->grads + a, b - a);
            }
            if (run->comm)
                moe_comm_all_reduce_sum(run->comm, S->part, MOE_STEP_NORM_SLOTS, MOE_DTYPE_F64);
            be->add_f64(S->sumsq, S->part, MOE_STEP_NORM_SLOTS);
        }
    } else {
        size_t start, end;
        moe_group_kind k;
        int i = 0;
        while (moe_params_next_run(pt, shard_group, &i, &start, &end, &k))
            be->sum_squares(&S->sumsq[k], m->grads + start, end - start);
    }
    for (int g = 0; g < MOE_GROUP_COUNT; g++) {
        moe_comm *c = moe_parallel_group(&t->par, (moe_group_kind)g);
        if (used[g] && c)
            moe_comm_all_reduce_sum(c, &S->sumsq[g], 1, MOE_DTYPE_F64);
    }
    /* an overflow on any rank re-runs the step on every rank (a rank that went on alone would
     * wait in the next collective): the flags are summed over the world, on the device, and
     * the finalize turns a non-zero sum back into the bit. Only where a layer can overflow:
     * with the default budget (every row has a place) the step pays no extra collective. */
    if (t->world && moe_model_may_overflow(m))
        moe_comm_all_reduce_sum(t->world, &S->flags, 1, MOE_DTYPE_I32);
    be->grad_norm_finalize(S, t->cfg.clip_grad, t->cfg.check_for_nan_in_loss_and_grad);
}

/* --check-for-nan-in-loss-and-grad: the device raised MOE_STEP_NONFINITE and skipped the
 * update, so the weights (and any checkpoint written from them) stay those of the last good
 * step. The loss and the norm are sums over all ranks, so every rank sees the same value and
 * stops at the same step: none is left waiting in a collective. local_loss says which ranks'
 * own micro-batches went bad. */
static moe_status nonfinite_error(const moe_trainer *t, const moe_step_stats *st,
                                  moe_error *err) {
    const int loss_bad = !isfinite(st->loss);
    return moe_error_set(err, MOE_ERR_NONFINITE,
                         "step %d, rank %d: the %s is %g (loss %g: cross-entropy %g, aux %g, "
                         "z-loss %g; this rank's own micro-batches: loss %g); the weights were "
                         "not updated. Lower --lr, --init-method-std or the router coefficients, "
                         "or run with --no-check-for-nan-in-loss-and-grad to continue anyway",
                         st->step + 1, t->rank, loss_bad ? "loss" : "gradient norm",
                         loss_bad ? st->loss : st->grad_norm, st->loss, st->ce, st->aux, st->z,
                         st->local_loss);
}

static void prepare_batches(moe_trainer *t, moe_step_stats *st);
static void prepare_update(moe_trainer *t, moe_step_stats *st);
static void enqueue_gradients(moe_trainer *t, moe_step_stats *st);
static void enqueue_update(moe_trainer *t, moe_step_stats *st);
static void read_boundary(moe_trainer *t, moe_step_stats *st, int loads);

/* Whether this step reads the expert loads back: once per --log-interval (and the first
 * step this trainer runs, and the last of the run), when the program prints them. */
static int reads_loads(const moe_trainer *t) {
    return t->load_host &&
           (!t->loads_read || (t->step + 1) % t->load_interval == 0 ||
            t->step + 1 == t->cfg.train_iters);
}

/* The whole step's device work as one region: `--cuda-graph-scope full_iteration` captures
 * it once per shape and replays it (graph.h). Everything that changes from step to step
 * reaches it through page-locked memory the host fills before (prepare_batches,
 * prepare_update): the batches and AdamW's {lr, bias corrections}. */
typedef struct step_region {
    moe_trainer *t;
    moe_step_stats *st;
} step_region;

static void step_work(void *p) {
    step_region *r = p;
    enqueue_gradients(r->t, r->st);
    enqueue_update(r->t, r->st);
}

moe_status moe_trainer_step(moe_trainer *t, moe_step_stats *st, moe_error *err) {
    moe_timer timer;
    moe_timer_start(&timer);
    moe_model *m = t->model;
    for (;;) {
        /* the whole step is enqueued without one wait; then the boundary: one copy, one wait */
        prepare_batches(t, st);
        prepare_update(t, st);
        if (moe_graphs_scope(m->graphs) == MOE_GRAPH_FULL_ITERATION && !t->step_hook) {
            step_region r = {t, st};
            const moe_config *c = &t->cfg;
            const int local = c->global_batch_size / c->micro_batch_size / t->dp_size;
            const moe_graph_key k = {MOE_GRAPH_SITE_STEP, -1, c->micro_batch_size,
                                     c->seq_length, local, 0.0};
            moe_graph_run(m->graphs, k, step_work, &r);
            MOE_TRY(moe_graphs_status(m->graphs, err));
        } else { /* (a test hook runs between the two halves: eagerly) */
            enqueue_gradients(t, st);
            if (t->step_hook)
                t->step_hook(t, t->step_hook_ctx);
            /* a region that could not be captured (graph.h) lost this step's work: stop with
             * its name before the update (a host-side status, known at capture time) */
            MOE_TRY(moe_graphs_status(m->graphs, err));
            enqueue_update(t, st);
        }
        read_boundary(t, st, reads_loads(t));
        const int flags = t->readback->flags;
        if (flags) /* the device skipped AdamW: its step count goes back */
            t->opt.step--;
        if (flags & MOE_STEP_OVERFLOW) {
            /* a static MoE buffer was too small: nothing was updated, so grow the buffers
             * and run the same step (same batch, same weights) again */
            MOE_TRY(t->grow_budget(t->model, err)); /* logs the growth */
            t->reruns++;
            continue;
        }
        if (flags & MOE_STEP_NONFINITE)
            return nonfinite_error(t, st, err);
        break;
    }
    st->seconds = moe_timer_elapsed(&timer);
    t->step++;
    return MOE_OK;
}

/* One micro-batch of this rank: B sequences of the split, or under CP its T/CP tokens of
 * each, chunk-major (cp_layout.h), cut from the whole micro-batch read into t->inputs and
 * t->targets. */
static void read_batch(moe_trainer *t, moe_split split, uint64_t seed, uint64_t index,
                       int *inputs, int *targets) {
    const moe_config *c = &t->cfg;
    const int B = c->micro_batch_size, T = c->seq_length, cp = t->cp.attn.cp;
    if (cp == 1) {
        moe_dataset_batch(&t->data, split, B, T, seed, index, inputs, targets);
        return;
    }
    moe_dataset_batch(&t->data, split, B, T, seed, index, t->inputs, t->targets);
    moe_cp_take_local(inputs, t->inputs, B, T, cp, t->cp.attn.rank);
    moe_cp_take_local(targets, t->targets, B, T, cp, t->cp.attn.rank);
}

/* The host's part of a step, before any of its device work: this rank's batches into
 * page-locked memory (and the step's counts into the statistics). */
static void prepare_batches(moe_trainer *t, moe_step_stats *st) {
    const moe_config *c = &t->cfg;
    const int accum = c->global_batch_size / c->micro_batch_size; /* over all ranks */
    const int local = accum / t->dp_size; /* on this rank (and the rest of its TP group) */
    const int B = c->micro_batch_size, T = c->seq_length;
    const size_t n = (size_t)B * T / (size_t)t->cp.attn.cp; /* this rank's tokens of one */
    memset(st, 0, sizeof *st);
    st->step = t->step;
    for (int i = 0; i < local; i++) {
        /* data-parallel rank r runs micro-batches [r·local, (r+1)·local) of the step; the
         * ranks of its CP group read the same ones and keep their tokens of each */
        uint64_t batch_index = (uint64_t)t->step * accum + (uint64_t)t->dp_rank * local + i;
        read_batch(t, MOE_SPLIT_TRAIN, (uint64_t)c->seed, batch_index, t->batch + 2 * i * n,
                   t->batch + (2 * i + 1) * n);
    }
    st->tokens = (double)accum * B * T;
    st->flops = st->tokens * moe_model_flops_per_token(t->model, T);
}

/* ... and of its update: AdamW's step count, learning rate and bias corrections into
 * page-locked memory (enqueue_update copies them in; the caller takes the count back when
 * the device skipped the step). */
static void prepare_update(moe_trainer *t, moe_step_stats *st) {
    const moe_config *c = &t->cfg;
    st->lr = moe_lr_at(c, t->step);
    moe_adamw_next_hyper(&t->opt, st->lr, c->adam_beta1, c->adam_beta2, t->hyper_host);
}

/* Chapter 05's delayed scaling on several ranks (TransformerEngine's amax reduction): after
 * each micro-batch, every site's window becomes its max over the ranks that hold the same
 * tensor (moe_lowp_reduce_amax(): DP x CP for the dense sites, EDP for the experts', and the
 * grouped experts' rows over EP x EDP), before the next micro-batch casts with it. Per
 * micro-batch and not per step, as TransformerEngine reduces at each forward's end: the next
 * micro-batch's scales come from the windows, and they must be the replicas' common ones.
 * (The weights record after the update, on replicas with equal weights: equal amaxes.) */
static void reduce_amax(moe_trainer *t) {
    const moe_model *m = t->model;
    if (!t->world || !t->amax_reduce || !m->lowp || !m->lowp->history)
        return;
    moe_comm *dense = moe_parallel_group(&t->par, MOE_GROUP_DP_CP);
    moe_comm *experts = dense, *rows = NULL;
    if (t->cfg.expert_model_parallel_size > 1)
        experts = moe_parallel_group(&t->par, MOE_GROUP_EDP);
    if (moe_expert_impl_from_config(&t->cfg, m->be) != MOE_EXPERTS_LOOP)
        rows = dense; /* (EP x EDP: the same ranks as DP x CP without TP) */
    moe_lowp_reduce_amax(m->lowp, dense, experts, rows);
}

/* The step start: every scalar of the step, the flags included, to zero (one memset). */
static void enqueue_gradients(moe_trainer *t, moe_step_stats *st) {
    const moe_config *c = &t->cfg;
    moe_model *m = t->model;
    const moe_backend *be = m->be;
    moe_step_scalars *S = m->scalars;
    const int accum = c->global_batch_size / c->micro_batch_size; /* over all ranks */
    const int local = accum / t->dp_size; /* on this rank (and the rest of its TP group) */
    const int B = c->micro_batch_size, T = c->seq_length, Tl = T / t->cp.attn.cp;
    const size_t n = (size_t)B * Tl; /* under CP this rank's T/CP tokens of each sequence */

    be->zero(S, sizeof *S);
    moe_model_zero_grad(m);
    moe_model_reset_load_counts(m);
    for (int i = 0; i < local; i++) {
        moe_model_forward_staged(m, t->batch + 2 * i * n, t->batch + (2 * i + 1) * n, B, Tl);
        /* this rank's partial sums over the micro-batch's B·T tokens: the sum over DP x CP
         * below is the step's loss */
        be->loss_accumulate(S->step, S->mb, B * T, (double)accum);
        st->dropped += m->last.dropped;
        moe_model_backward(m, 1.0 / accum);
        reduce_amax(t);
    }
    be->copy(&S->local_loss, &S->step[0], sizeof(double));
    /* every rank of a TP group has the same losses and counts, a CP rank its tokens' part:
     * sum over the DP x CP ranks */
    moe_comm *dp = t->world ? moe_parallel_group(&t->par, MOE_GROUP_DP_CP) : NULL;
    if (t->world)
        sync_gradients(t);
    /* under TP each rank's MoE layers ran on its own rows (its sequence shard): their
     * expert loads and drops add up over the TP group (the losses were summed in the model) */
    const size_t nl = (size_t)c->num_layers * c->num_experts;
    if (t->tp.comm && m->load_counts) {
        moe_comm_all_reduce_sum(t->tp.comm, m->load_counts, nl, MOE_DTYPE_I64);
        moe_comm_host_all_reduce_sum(t->tp.comm, &st->dropped, 1, MOE_DTYPE_I64);
    }
    if (dp) {
        moe_comm_all_reduce_sum(dp, S->step, 4, MOE_DTYPE_F64);
        /* (a host collective: only a capacity drops tokens, and a dropless step keeps none
         * inside, so a captured step has nothing that would run once at capture only) */
        if (c->moe_expert_capacity_factor > 0)
            moe_comm_host_all_reduce_sum(dp, &st->dropped, 1, MOE_DTYPE_I64);
        if (m->load_counts) /* the expert-bias rule and the statistics see the global batch */
            moe_comm_all_reduce_sum(dp, m->load_counts, nl, MOE_DTYPE_I64);
    }
}

/* The update, all on the device: the norm and clip factor, AdamW (which reads them and the
 * flags), the ZeRO gather, the compute-copy refresh and the expert bias (skipped on the
 * device as well when a flag is up). */
static void enqueue_update(moe_trainer *t, moe_step_stats *st) {
    const moe_config *c = &t->cfg;
    moe_model *m = t->model;
    enqueue_grad_norm(t);
    /* lr and the bias corrections from the step's scalars (prepare_update counted the step) */
    m->be->from_host_async(m->scalars->hyper, t->hyper_host, sizeof m->scalars->hyper);
    /* without the distributed optimizer AdamW also writes the compute copy (bf16 on CUDA) of
     * every weight it updates: no cast pass over the weights after it. Where the copy IS the
     * weights (the CPU's fp32 model without low precision) there is nothing to write: the
     * copy would store every weight onto itself, a second pass over them each step (the cast
     * it replaced skipped that case too) */
    void *act = t->opt.master || m->wact == (void *)m->params ? NULL : m->wact;
    moe_adamw_step(&t->opt, m->params, m->grads, act, st->lr, c->adam_beta1, c->adam_beta2,
                   c->adam_eps, c->weight_decay, &m->scalars->clip, m->step_flags,
                   m->scalars->hyper);
    if (t->opt.master) /* ZeRO-1: every rank updated its master piece; gather the compute
                        * copies of the others' (in the activation type: bf16 on CUDA) */
        moe_zero_gather_weights(&t->zero, &t->opt, m->wact);
    else
        moe_model_weights_written(m);
    moe_model_update_expert_bias(m);
}

/* The step boundary: the scalars (and, once per log interval, the expert loads) into
 * page-locked memory with one asynchronous copy each, one event, one wait. */
static void read_boundary(moe_trainer *t, moe_step_stats *st, int loads) {
    const moe_config *c = &t->cfg;
    moe_model *m = t->model;
    const moe_backend *be = m->be;
    const size_t nl = (size_t)c->num_layers * c->num_experts;
    be->to_host_async(t->readback, m->scalars, sizeof(moe_step_scalars));
    if (loads)
        be->to_host_async(t->load_host, m->load_counts, sizeof(long long) * nl);
    be->wait_to_host();
    const moe_step_scalars *r = t->readback;
    st->loss = r->step[0];
    st->ce = r->step[1];
    st->aux = r->step[2];
    st->z = r->step[3];
    st->local_loss = r->local_loss;
    st->grad_norm = r->grad_norm;
    st->load_read = 0;
    if (!loads)
        return;
    t->loads_read = 1;
    st->load_read = 1;
    /* expert load over the whole global batch */
    st->load_min = -1;
    int moe_layers = 0;
    for (int l = 0; l < c->num_layers; l++) {
        if (!c->is_moe_layer[l])
            continue;
        moe_layers++;
        for (int e = 0; e < c->num_experts; e++) {
            long long n = t->load_host[(size_t)l * c->num_experts + e];
            if (st->load_min < 0 || n < st->load_min)
                st->load_min = n;
            if (n > st->load_max)
                st->load_max = n;
        }
    }
    if (moe_layers > 0)
        st->load_mean = st->tokens * c->moe_router_topk / c->num_experts;
    else
        st->load_min = 0;
}

void moe_trainer_gradients(moe_trainer *t, moe_step_stats *st) {
    moe_timer timer;
    moe_timer_start(&timer);
    prepare_batches(t, st);
    enqueue_gradients(t, st);
    read_boundary(t, st, 0);
    st->seconds = moe_timer_elapsed(&timer);
}

void moe_trainer_update(moe_trainer *t, moe_step_stats *st) {
    moe_timer timer;
    moe_timer_start(&timer);
    prepare_update(t, st);
    enqueue_update(t, st);
    read_boundary(t, st, t->load_host != NULL);
    st->seconds += moe_timer_elapsed(&timer);
    if (t->readback->flags) { /* skipped on the device */
        t->opt.step--;
        return;
    }
    t->step++;
}

double moe_trainer_evaluate(moe_trainer *t, moe_split split, int iters) {
    const moe_config *c = &t->cfg;
    const int B = c->micro_batch_size, T = c->seq_length / t->cp.attn.cp;
    const size_t n = (size_t)B * T;
    int *in = t->cp.attn.cp > 1 ? t->batch : t->inputs; /* (free between steps) */
    int *tg = t->cp.attn.cp > 1 ? t->batch + n : t->targets;
    double sum = 0.0;
    for (int i = 0; i < iters; i++) {
        /* a fixed seed, independent of the run's: every evaluation sees the same batches
         * (under CP each rank its tokens; moe_model_forward sums the losses over CP) */
        read_batch(t, split, 0xE7A1ull, (uint64_t)i, in, tg);
        moe_model_forward(t->model, in, tg, B, T);
        sum += t->model->last.ce;
    }
    return sum / iters;
}

void moe_trainer_sample(moe_trainer *t, int n, double temperature, uint64_t seed, char *out) {
    const moe_config *c = &t->cfg;
    const moe_tokenizer *tok = &t->data.tok;
    /* the model's vocabulary may be padded (--make-vocab-size-divisible-by): sample among the
     * tokenizer's ids only */
    const int T = c->seq_length, V = c->vocab_size, Vt = tok->vocab_size;
    const int cp = t->cp.attn.cp, cp_rank = t->cp.attn.rank;
    int *ctx = malloc(sizeof(int) * (size_t)(n + 1));
    int *window = malloc(sizeof(int) * (size_t)T), *local = malloc(sizeof(int) * (size_t)T);
    moe_real *logits = malloc(sizeof(moe_real) * (size_t)V);
    double *p = malloc(sizeof(double) * (size_t)V);
    MOE_ASSERT(ctx && window && local && logits && p);
    /* Under sequence parallelism a forward needs a multiple of TP tokens, under context
     * parallelism of 2·CP (each rank two chunks; T is a multiple of both): the window is
     * padded at its end, which the causal mask keeps from changing the rows before it. With
     * TP every rank has its V/TP logits of every row (vocab_parallel.h): each puts its own in
     * place and a sum over TP assembles the row. Under CP the row of the window's last token
     * lives on the rank holding its chunk: that rank puts it in place, the others zeros,
     * and a sum over CP gives every rank the row (all ranks then draw the same token). */
    const moe_tp *tp = &t->model->tp;
    const int Vl = tp->size > 1 ? t->model->vp.Vl : V, v0 = tp->size > 1 ? t->model->vp.v0 : 0;
    const int sp = tp->size > 1 && tp->sp;
    const int unit = (sp ? tp->size : 1) * (cp > 1 ? 2 * cp : 1);
    int len = 0;
    int nl = tok->byte_to_id['\n'];
    ctx[len++] = nl >= 0 ? nl : 0;
    for (int i = 0; i < n; i++) {
        int start = len > T ? len - T : 0, w = len - start;
        const int tw = (w + unit - 1) / unit * unit;
        memcpy(window, ctx + start, sizeof(int) * (size_t)w);
        for (int j = w; j < tw; j++)
            window[j] = 0;
        int row = w - 1; /* the last token's row here, or -1: another CP rank holds it */
        if (cp > 1) {
            moe_cp_take_local(local, window, 1, tw, cp, cp_rank);
            moe_model_forward(t->model, local, NULL, 1, tw / cp);
            row = moe_cp_local_index(tw, cp, cp_rank, w - 1);
        } else {
            moe_model_forward(t->model, window, NULL, 1, tw);
        }
        const moe_backend *be = t->model->be;
        memset(logits, 0, sizeof(moe_real) * (size_t)V);
        if (row >= 0)
            be->read_act(logits + v0, MOE_ACT(be, t->model->logits, (size_t)row * Vl),
                         (size_t)Vl);
        if (tp->size > 1)
            moe_comm_host_all_reduce_sum(tp->comm, logits, (size_t)V, moe_dtype_real());
        if (cp > 1)
            moe_comm_host_all_reduce_sum(t->cp.attn.comm, logits, (size_t)V, moe_dtype_real());
        double mx = logits[0];
        for (int v = 1; v < Vt; v++)
            mx = logits[v] > mx ? logits[v] : mx;
        double s = 0.0;
        for (int v = 0; v < Vt; v++)
            s += (p[v] = exp((logits[v] - mx) / temperature));
        double u = moe_rng_uniform(seed, STREAM_SAMPLE, (uint64_t)i) * s;
        int pick = Vt - 1;
        for (int v = 0; v < Vt; v++) {
            u -= p[v];
            if (u <= 0) {
                pick = v;
                break;
            }
        }
        ctx[len++] = pick;
    }
    unsigned char *bytes = (unsigned char *)out;
    moe_tokenizer_decode(tok, ctx + 1, (size_t)n, bytes);
    out[n] = '\0';
    free(ctx);
    free(window);
    free(local);
    free(logits);
    free(p);
}
