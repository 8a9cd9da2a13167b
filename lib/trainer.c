/* The training loop: see trainer.h. */
#include "trainer.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "rng.h"
#include "timer.h"

/* RNG streams of the trainer (weights use the tensor names, data its own streams) */
#define STREAM_SAMPLE 0x5A3B1Eull

moe_status moe_trainer_create(moe_trainer **out, const moe_config *cfg, moe_error *err) {
    *out = NULL;
    moe_trainer *t = calloc(1, sizeof *t);
    if (!t)
        return moe_error_set(err, MOE_ERR_NOMEM, "out of memory");
    t->cfg = *cfg;
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
    if (s == MOE_OK)
        s = moe_model_create(&t->model, c, be, c->micro_batch_size, err);
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
    moe_dataset_free(&t->data);
    free(t->inputs);
    free(t->targets);
    free(t);
    moe_cpu_matmul_release();
}

void moe_trainer_step(moe_trainer *t, moe_step_stats *st) {
    const moe_config *c = &t->cfg;
    moe_model *m = t->model;
    const int accum = c->global_batch_size / c->micro_batch_size;
    const int B = c->micro_batch_size, T = c->seq_length;
    moe_timer timer;
    moe_timer_start(&timer);
    memset(st, 0, sizeof *st);
    st->step = t->step;

    moe_model_zero_grad(m);
    moe_model_reset_load_counts(m);
    for (int i = 0; i < accum; i++) {
        uint64_t batch_index = (uint64_t)t->step * accum + i;
        moe_dataset_batch(&t->data, MOE_SPLIT_TRAIN, B, T, (uint64_t)c->seed, batch_index,
                          t->inputs, t->targets);
        st->loss += moe_model_forward(m, t->inputs, t->targets, B, T) / accum;
        st->ce += m->last.ce / accum;
        st->aux += m->last.aux / accum;
        st->z += m->last.z / accum;
        moe_model_backward(m, 1.0 / accum);
    }
    /* fp32 master weights: clip and step them, then refresh the compute copy */
    st->grad_norm = moe_clip_grad_norm(m->be, m->grads, moe_model_num_params(m), c->clip_grad);
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
        st->load_mean = (double)accum * B * T * c->moe_router_topk / c->num_experts;
    else
        st->load_min = 0;
    st->tokens = (double)accum * B * T;
    st->flops = st->tokens * moe_model_flops_per_token(m, T);
    st->seconds = moe_timer_elapsed(&timer);
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
