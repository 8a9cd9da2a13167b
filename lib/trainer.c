/* The training loop: see trainer.h. */
#include "trainer.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "rng.h"
#include "timer.h"

/* RNG streams of the trainer (weights use the tensor names, data its own streams) */
#define STREAM_SAMPLE 0x5A3B1Eull

moe_status moe_trainer_create(moe_trainer **out, const moe_config *cfg, moe_error *err) {
    return moe_trainer_create_dist(out, cfg, NULL, err);
}

/* The process groups of a run: EP groups are consecutive ranks, the expert-data-parallel
 * groups stride by EP (Megatron's order ... ep, dp: EP varies faster than DP). */
static moe_status make_groups(moe_trainer *t, moe_error *err) {
    const moe_config *c = &t->cfg;
    const int W = t->world_size, EP = c->expert_model_parallel_size;
    const int A = c->global_batch_size / c->micro_batch_size;
    if (W % EP != 0)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "--expert-model-parallel-size %d does not divide the %d rank(s) of "
                             "this run (run with a multiple of %d ranks: mpirun -np %d ...)",
                             EP, W, EP, EP);
    if (A % W != 0)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "--global-batch-size %d is %d micro-batches of %d, which do not split "
                             "evenly over %d ranks (use a global batch that is a multiple of "
                             "micro-batch-size x ranks = %d)",
                             c->global_batch_size, A, c->micro_batch_size, W,
                             c->micro_batch_size * W);
    t->ep.size = EP;
    t->ep.rank = t->rank % EP;
    if (EP > 1)
        MOE_TRY(moe_comm_split(t->world, t->rank / EP, t->rank, &t->ep_group, err));
    if (W / EP > 1)
        MOE_TRY(moe_comm_split(t->world, t->rank % EP, t->rank, &t->edp_group, err));
    t->ep.comm = t->ep_group;

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
    moe_config *c = &t->cfg;
    moe_tokenizer_type tt;
    moe_status s = moe_tokenizer_parse_type(c->tokenizer_type, &tt, err);
    if (s == MOE_OK)
        s = moe_dataset_load(&t->data, c->data_path, tt, err);
    if (s == MOE_OK) {
        c->vocab_size = t->data.tok.vocab_size;
        s = moe_config_validate(c, err);
    }
    if (s == MOE_OK)
        s = moe_dataset_check_seq_len(&t->data, c->seq_length, err);
    const moe_backend *be = NULL;
    if (s == MOE_OK)
        s = moe_backend_select(c->device, &be, err);
    if (s == MOE_OK && !world && c->expert_model_parallel_size > 1)
        s = moe_error_set(err, MOE_ERR_CONFIG,
                          "--expert-model-parallel-size %d needs %d ranks: run under mpirun "
                          "-np %d (a build with MPI)",
                          c->expert_model_parallel_size, c->expert_model_parallel_size,
                          c->expert_model_parallel_size);
    if (s == MOE_OK && world && moe_comm_device(world) != be->device)
        s = moe_error_set(err, MOE_ERR_BACKEND,
                          "--device %s does not match the communication transport (%s ranks)",
                          be->name, moe_comm_device(world) == MOE_DEVICE_CUDA ? "GPU" : "CPU");
    t->ep.be = be;
    if (s == MOE_OK && world)
        s = make_groups(t, err);
    if (s == MOE_OK)
        s = moe_model_create(&t->model, c, be, c->micro_batch_size, t->ep.comm ? &t->ep : NULL,
                             err);
    if (s == MOE_OK)
        s = moe_adamw_init(&t->opt, be, moe_model_num_params(t->model), err);
    if (s == MOE_OK) {
        size_t n = (size_t)c->micro_batch_size * c->seq_length;
        t->inputs = malloc(sizeof(int) * n);
        t->targets = malloc(sizeof(int) * n);
        if (!t->inputs || !t->targets)
            s = moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    }
    if (s != MOE_OK) {
        moe_trainer_free(t);
        return s;
    }
    moe_model_init(t->model, (uint64_t)c->seed);
    *out = t;
    return MOE_OK;
}

void moe_trainer_free(moe_trainer *t) {
    if (!t)
        return;
    moe_model_free(t->model);
    moe_adamw_free(&t->opt);
    moe_ep_free(&t->ep);
    moe_comm_free(t->ep_group);
    moe_comm_free(t->edp_group);
    moe_dataset_free(&t->data);
    free(t->inputs);
    free(t->targets);
    free(t);
    moe_cpu_matmul_release();
}

static moe_dtype real_dtype(void) { return sizeof(moe_real) == 4 ? MOE_DTYPE_F32 : MOE_DTYPE_F64; }

/* Data parallelism for the dense part, expert-data parallelism for the experts: after
 * every rank has accumulated its micro-batches, sum the replicated tensors' gradients over
 * the ranks that replicate them. Dense tensors are replicated on every rank; an expert
 * slice only on the ranks of its expert-data-parallel group. */
/* Consecutive tensors of the same kind (dense or expert) form one run of the flat buffer:
 * [*start, *end) in elements. Returns 0 when there are no more runs. The layout puts all
 * dense tensors first and all expert slices last (model.c), so there are two runs. */
static int next_run(const moe_param_table *pt, int *i, size_t *start, size_t *end, int *expert) {
    if (*i >= pt->n)
        return 0;
    *expert = pt->t[*i].expert;
    *start = pt->t[*i].offset;
    while (*i < pt->n && pt->t[*i].expert == *expert)
        (*i)++;
    *end = pt->t[*i - 1].offset + pt->t[*i - 1].numel;
    return 1;
}

static void sync_gradients(moe_trainer *t) {
    moe_model *m = t->model;
    size_t start, end;
    int expert, i = 0;
    while (next_run(&m->table, &i, &start, &end, &expert)) {
        moe_comm *g = expert ? t->edp_group : t->world;
        if (g && moe_comm_size(g) > 1)
            moe_comm_all_reduce_sum(g, m->grads + start, end - start, real_dtype());
    }
}

/* The global gradient norm: dense gradients are identical on every rank after the sync,
 * expert slices differ across an EP group, so their squares are summed over it. */
static double global_grad_norm(moe_trainer *t) {
    moe_model *m = t->model;
    double dense = 0.0, expert = 0.0;
    size_t start, end;
    int is_expert, i = 0;
    while (next_run(&m->table, &i, &start, &end, &is_expert)) {
        double s = m->be->sum_squares(m->grads + start, end - start);
        if (is_expert)
            expert += s;
        else
            dense += s;
    }
    if (t->ep_group)
        moe_comm_host_all_reduce_sum(t->ep_group, &expert, 1, MOE_DTYPE_F64);
    return sqrt(dense + expert);
}

void moe_trainer_step(moe_trainer *t, moe_step_stats *st) {
    moe_trainer_gradients(t, st);
    moe_trainer_update(t, st);
}

void moe_trainer_gradients(moe_trainer *t, moe_step_stats *st) {
    const moe_config *c = &t->cfg;
    moe_model *m = t->model;
    const int accum = c->global_batch_size / c->micro_batch_size; /* over all ranks */
    const int local = accum / t->world_size;                         /* on this rank */
    const int B = c->micro_batch_size, T = c->seq_length;
    moe_timer timer;
    moe_timer_start(&timer);
    memset(st, 0, sizeof *st);
    st->step = t->step;

    moe_model_zero_grad(m);
    moe_model_reset_load_counts(m);
    for (int i = 0; i < local; i++) {
        /* rank r runs micro-batches [r·local, (r+1)·local) of the step */
        uint64_t batch_index = (uint64_t)t->step * accum + (uint64_t)t->rank * local + i;
        moe_dataset_batch(&t->data, MOE_SPLIT_TRAIN, B, T, (uint64_t)c->seed, batch_index,
                          t->inputs, t->targets);
        st->loss += moe_model_forward(m, t->inputs, t->targets, B, T) / accum;
        st->ce += m->last.ce / accum;
        st->aux += m->last.aux / accum;
        st->z += m->last.z / accum;
        st->dropped += m->last.dropped;
        moe_model_backward(m, 1.0 / accum);
    }
    if (t->world) {
        sync_gradients(t);
        double sums[4] = {st->loss, st->ce, st->aux, st->z};
        moe_comm_host_all_reduce_sum(t->world, sums, 4, MOE_DTYPE_F64);
        st->loss = sums[0];
        st->ce = sums[1];
        st->aux = sums[2];
        st->z = sums[3];
        moe_comm_host_all_reduce_sum(t->world, &st->dropped, 1, MOE_DTYPE_I64);
        if (m->load_counts) /* the expert-bias rule and the statistics see the global batch */
            moe_comm_host_all_reduce_sum(t->world, m->load_counts,
                                         (size_t)c->num_layers * c->num_experts, MOE_DTYPE_I64);
    }
    st->tokens = (double)accum * B * T;
    st->flops = st->tokens * moe_model_flops_per_token(m, T);
    st->seconds = moe_timer_elapsed(&timer);
}

void moe_trainer_update(moe_trainer *t, moe_step_stats *st) {
    const moe_config *c = &t->cfg;
    moe_model *m = t->model;
    moe_timer timer;
    moe_timer_start(&timer);
    /* fp32 master weights: clip and step them, then refresh the compute copy */
    st->grad_norm = global_grad_norm(t);
    moe_clip_grads(m->be, m->grads, moe_model_num_params(m), st->grad_norm, c->clip_grad);
    st->lr = moe_lr_at(c, t->step);
    moe_adamw_step(&t->opt, &m->table, m->params, m->grads, st->lr, c->adam_beta1, c->adam_beta2,
                   c->adam_eps, c->weight_decay);
    moe_model_sync_weights(m);
    moe_model_update_expert_bias(m);
    m->be->synchronize();

    /* expert load over the whole global batch */
    st->load_min = -1;
    int moe_layers = 0;
    for (int l = 0; l < c->num_layers; l++) {
        if (!c->is_moe_layer[l])
            continue;
        moe_layers++;
        for (int e = 0; e < c->num_experts; e++) {
            long long n = m->load_counts[(size_t)l * c->num_experts + e];
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
    st->seconds += moe_timer_elapsed(&timer);
    t->step++;
}

double moe_trainer_evaluate(moe_trainer *t, moe_split split, int iters) {
    const moe_config *c = &t->cfg;
    const int B = c->micro_batch_size, T = c->seq_length;
    double sum = 0.0;
    for (int i = 0; i < iters; i++) {
        /* a fixed seed, independent of the run's: every evaluation sees the same batches */
        moe_dataset_batch(&t->data, split, B, T, 0xE7A1ull, (uint64_t)i, t->inputs, t->targets);
        moe_model_forward(t->model, t->inputs, t->targets, B, T);
        sum += t->model->last.ce;
    }
    return sum / iters;
}

void moe_trainer_sample(moe_trainer *t, int n, double temperature, uint64_t seed, char *out) {
    const moe_config *c = &t->cfg;
    const moe_tokenizer *tok = &t->data.tok;
    const int T = c->seq_length, V = c->vocab_size;
    int *ctx = malloc(sizeof(int) * (size_t)(n + 1));
    moe_real *logits = malloc(sizeof(moe_real) * (size_t)V);
    double *p = malloc(sizeof(double) * (size_t)V);
    MOE_ASSERT(ctx && logits && p);
    int len = 0;
    int nl = tok->byte_to_id['\n'];
    ctx[len++] = nl >= 0 ? nl : 0;
    for (int i = 0; i < n; i++) {
        int start = len > T ? len - T : 0, w = len - start;
        moe_model_forward(t->model, ctx + start, NULL, 1, w);
        const moe_backend *be = t->model->be;
        be->read_act(logits, MOE_ACT(be, t->model->logits, (size_t)(w - 1) * V), (size_t)V);
        double mx = logits[0];
        for (int v = 1; v < V; v++)
            mx = logits[v] > mx ? logits[v] : mx;
        double s = 0.0;
        for (int v = 0; v < V; v++)
            s += (p[v] = exp((logits[v] - mx) / temperature));
        double u = moe_rng_uniform(seed, STREAM_SAMPLE, (uint64_t)i) * s;
        int pick = V - 1;
        for (int v = 0; v < V; v++) {
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
    free(logits);
    free(p);
}
