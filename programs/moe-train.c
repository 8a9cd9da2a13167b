/*
 * moe-train: train a Mixture-of-Experts transformer on a text file.
 *
 *   bin/moe-train                      # the default small MoE on tinyshakespeare
 *   bin/moe-train --help               # every flag, its default and meaning
 *
 * Prints one line per --log-interval steps (loss, step time, tokens/s, expert
 * load), the validation loss every --eval-interval steps, a text sample at the
 * end, and (with --metrics-file) one JSON object per event.
 *
 * With --save DIR it checkpoints every --save-interval steps and at the end; --load DIR
 * resumes; with --exit-signal-handler, SIGINT/SIGTERM save at the next step boundary and
 * exit 0 (checkpoint.h).
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "checkpoint.h"
#include "comm.h"
#include "config.h"
#include "exit_signal.h"
#include "log.h"
#include "memory.h"
#include "metrics.h"
#include "mlp.h"
#include "outfile.h"
#include "timer.h"
#include "trainer.h"

/* On more than one rank: each rank's groups (parallel.h), one line a rank, and what each
 * rank will hold (memory.h), dense and expert parameters apart since they are replicated
 * over different groups. */
static void print_grid(const moe_trainer *t) {
    const moe_grid *g = &t->par.grid;
    char line[1024];
    for (int r = 0; r < g->world; r++) {
        moe_grid_print_rank_line(g, r, line, sizeof line);
        moe_log_info("grid  | %s", line);
    }
    const moe_memory_estimate e = t->model->mem; /* the one the model was checked against */
    const double mb = 1e6;
    moe_log_info("memory| per rank (estimate): weights %.2f MB, gradients %.2f MB, AdamW moments "
                 "%.2f MB, activations %.2f MB per micro-batch; total %.2f MB",
                 e.weight_bytes / mb, e.grad_bytes / mb, e.optim_bytes / mb, e.act_bytes / mb,
                 e.total_bytes / mb);
    char zero[160] = "";
    if (t->cfg.use_distributed_optimizer)
        snprintf(zero, sizeof zero, "; distributed optimizer: fp32 master weights and moments "
                 "of %.3fM (1/%d of the dense, 1/%d of the experts)", e.optim_elems / 1e6,
                 g->dp * g->cp, g->edp);
    moe_log_info("memory| %.3fM parameters: dense %.3fM (TP %d shard, replicated over DP x CP "
                 "%d), experts %.3fM (ETP %d x EP %d shard, replicated over EDP %d)%s",
                 e.params / 1e6, e.dense_params / 1e6, g->tp, g->dp * g->cp,
                 e.expert_params / 1e6, g->etp, g->ep, g->edp, zero);
}

static void print_config(const moe_trainer *t) {
    const moe_config *c = &t->cfg;
    const moe_model *m = t->model;
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    int moe_layers = 0;
    for (int l = 0; l < c->num_layers; l++)
        moe_layers += c->is_moe_layer[l];
    moe_log_info("moe.c | data %s (%zu tokens: %zu train, %zu val, vocab %d, %s tokenizer)",
                 t->data.path, t->data.n_tokens, t->data.n_train,
                 t->data.n_tokens - t->data.n_train, c->vocab_size, c->tokenizer_type);
    moe_log_info("model | %d layers (%d MoE), hidden %d, %d heads / %d kv groups, head dim %d%s",
                 c->num_layers, moe_layers, c->hidden_size, c->num_attention_heads,
                 c->num_query_groups, c->head_dim, c->qk_layernorm ? ", qk-norm" : "");
    if (moe_layers > 0)
        moe_log_info("moe   | %d experts x SwiGLU %d, top-%d, router %s%s%s, aux %s %.3g, z-loss "
                     "%.3g%s%s",
                     c->num_experts, c->moe_ffn_hidden_size, c->moe_router_topk,
                     c->moe_router_score_function, c->moe_router_pre_softmax ? " (pre-softmax)" : "",
                     c->moe_router_num_groups ? " (group-limited)" : "",
                     c->moe_router_load_balancing_type, c->moe_aux_loss_coeff, c->moe_z_loss_coeff,
                     c->moe_router_enable_expert_bias ? ", expert bias" : "",
                     c->moe_shared_expert_intermediate_size ? ", shared expert" : "");
    char dev[256];
    m->be->device_name(dev, sizeof dev);
    moe_log_info("params| %.3fM total, %.3fM active per token, %.1f MFLOP per token (fwd+bwd)",
                 moe_model_num_params(m) / 1e6, moe_model_num_active_params(m) / 1e6,
                 moe_model_flops_per_token(m, c->seq_length) / 1e6);
    moe_log_info("device| %s (preset %s)%s", dev, c->preset,
                 m->be->peak_tflops() > 0 ? "" : " -- no known bf16 peak, so no MFU");
    moe_log_info("train | %d steps x %d sequences x %d tokens, lr %g -> %g (%s, %d warmup), "
                 "device %s, %d threads",
                 c->train_iters, c->global_batch_size, c->seq_length, c->lr, c->min_lr,
                 c->lr_decay_style, c->lr_warmup_iters, m->be->name, threads);
    char cp_detail[160] = ""; /* CP: the exchange and each rank's share of a sequence */
    if (c->context_parallel_size > 1)
        snprintf(cp_detail, sizeof cp_detail, " (%.16s%s%.32s, %d of %d tokens per sequence a rank)",
                 c->cp_comm_type, c->cp_a2a ? " " : "",
                 c->cp_a2a ? c->hierarchical_context_parallel_sizes : "",
                 c->seq_length / c->context_parallel_size, c->seq_length);
    if (t->world_size > 1)
        moe_log_info("ranks | %d ranks, tensor parallel %d%s, context parallel %d%s, expert "
                     "parallel %d (%s dispatcher, %d experts per rank, each split over %d ETP "
                     "rank(s)), data parallel %d: %d micro-batches per rank per step%s",
                     t->world_size, c->tensor_model_parallel_size,
                     c->sequence_parallel ? " + SP" : "", c->context_parallel_size, cp_detail,
                     c->expert_model_parallel_size,
                     c->moe_token_dispatcher_type, m->experts_local,
                     c->expert_tensor_parallel_size, t->dp_size,
                     c->global_batch_size / c->micro_batch_size / t->dp_size,
                     c->moe_expert_capacity_factor > 0 ? ", capacity on" : "");
    /* chapter 05's native FP8: what keeping the routed experts' SwiGLU outputs (and, in the
     * token-wise form, their inputs: moe_layer_keeps_x_t()) as FP8 codes saves (the estimate's
     * buffers, which are the model's: lib/mlp.c, moe_mlp_act_bytes(), moe/layer.c) */
    const moe_memory_estimate *e = &m->mem;
    const int x_t = moe_model_keeps_x_t(m);
    if (moe_mlp_fp8_saves_codes(m->be, m->lowp) && e->fp8_act_bytes > 0)
        moe_log_info("memory| routed experts' SwiGLU output%s kept for the backward in FP8: "
                     "%.2f MB (bf16: %.2f MB), %.2f MB less per micro-batch%s",
                     x_t ? " and input" : "", e->fp8_act_bytes / 1e6, e->fp8_act_bf16_bytes / 1e6,
                     (e->fp8_act_bf16_bytes - e->fp8_act_bytes) / 1e6,
                     t->world_size > 1 ? " on each rank (estimate)" : "");
    if (t->world_size > 1)
        print_grid(t);
}

/* A failure on one rank that the others cannot know of ends the whole job with its
 * message (under mpirun), or just this process, with exit status @p code. */
static void fail(moe_comm *world, int code, const char *msg) {
    if (moe_comm_size(world) > 1)
        moe_comm_abort(world, code, msg);
    moe_log_error("%s", msg);
    moe_comm_finalize(world);
    exit(code);
}

/* A metrics line that could not be written stops the run: results must not be lost
 * silently (a full disk, /dev/full). Only rank 0 writes, so it ends the whole job. */
static void end_record(moe_metrics *mx, moe_comm *world) {
    moe_error err;
    if (moe_metrics_end(mx, &err) != MOE_OK)
        fail(world, 1, err.msg);
}

static void write_config_metrics(moe_metrics *mx, const moe_trainer *t, moe_comm *world) {
    int n;
    const moe_flag *flags = moe_config_flags(&n);
    moe_metrics_begin(mx, "config");
    for (int i = 0; i < n; i++) {
        char v[MOE_FLAG_STR_LEN + 32];
        moe_flags_format_value(&flags[i], &t->cfg, v, sizeof v);
        moe_metrics_str(mx, flags[i].name, v);
    }
    moe_metrics_int(mx, "vocab_size", t->cfg.vocab_size);
    moe_metrics_int(mx, "num_params", (long long)moe_model_num_params(t->model));
    moe_metrics_int(mx, "num_active_params", (long long)moe_model_num_active_params(t->model));
    moe_metrics_str(mx, "device", t->model->be->name);
    end_record(mx, world);
}

static void evaluate(moe_trainer *t, moe_metrics *mx, moe_comm *world, int step, double elapsed) {
    double val = moe_trainer_evaluate(t, MOE_SPLIT_VAL, t->cfg.eval_iters);
    double train = moe_trainer_evaluate(t, MOE_SPLIT_TRAIN, t->cfg.eval_iters);
    moe_log_info("eval  | step %5d | train loss %.4f | val loss %.4f | %.1f s elapsed", step, train,
                 val, elapsed);
    moe_metrics_begin(mx, "eval");
    moe_metrics_int(mx, "step", step);
    moe_metrics_num(mx, "train_loss", train);
    moe_metrics_num(mx, "val_loss", val);
    moe_metrics_num(mx, "elapsed_s", elapsed);
    end_record(mx, world);
}

/* Test hook (make test-mpi): MOE_TEST_KILL_AT_STEP=k makes the last rank die by SIGKILL
 * before step k, as a crashed node would; the job must then resume from its checkpoint. */
static void test_kill_hook(const moe_trainer *t, int step) {
    const char *k = getenv("MOE_TEST_KILL_AT_STEP");
    if (k && atoi(k) == step && t->rank == t->world_size - 1)
        raise(SIGKILL);
}

/* Free everything and return the exit code. */
static int finish(moe_trainer *t, moe_metrics *mx, moe_comm *world, int code) {
    moe_metrics_close(mx);
    moe_trainer_free(t);
    moe_comm_finalize(world);
    return code;
}

/* End the run after a failure every rank agreed on (a load or a save). */
static int fail_agreed(moe_trainer *t, moe_metrics *mx, moe_comm *world, const moe_error *err,
                       int code) {
    moe_log_error("%s", err->msg);
    return finish(t, mx, world, code);
}

int main(int argc, char **argv) {
    moe_config cfg;
    moe_error err;
    moe_error_clear(&err);
    const moe_backend *gpu = NULL;
    int have_gpu = moe_backend_select("cuda", &gpu, NULL) == MOE_OK;
    moe_status s = moe_config_from_args(&cfg, argc, argv, have_gpu, &err);
    if (s == MOE_ERR_HELP) {
        moe_config_print_help(stdout, "moe-train");
        return 0;
    }
    if (s != MOE_OK) {
        moe_log_error("%s", err.msg);
        return 2;
    }
    /* the communication deadline must be known before the world exists */
    double timeout_s;
    if (moe_config_comm_timeout_s(&cfg, &timeout_s, &err) != MOE_OK) {
        moe_log_error("%s", err.msg);
        return 2;
    }
    moe_comm_set_timeout_s(timeout_s);
    /* the world: one rank, or every rank of mpirun; GPU ranks talk through NCCL */
    const moe_backend *be = NULL;
    if (moe_backend_select(cfg.device, &be, &err) != MOE_OK) {
        moe_log_error("%s", err.msg);
        return 2;
    }
    moe_comm *world = NULL;
    if (moe_comm_init(&argc, &argv, be->device, &world, &err) != MOE_OK) {
        moe_log_error("%s", err.msg);
        return 1;
    }
    const int ranks = moe_comm_size(world);
    moe_trainer *t = NULL;
    s = moe_trainer_create_dist(&t, &cfg, ranks > 1 ? world : NULL, &err);
    if (s != MOE_OK) {
        /* every rank validates the same config, but a rank-local failure (memory, data)
         * must not leave the others waiting in a collective: end the whole job */
        if (ranks > 1)
            moe_comm_abort(world, s == MOE_ERR_CONFIG || s == MOE_ERR_FLAG ? 2 : 1, err.msg);
        moe_log_error("%s", err.msg);
        moe_comm_finalize(world);
        return s == MOE_ERR_CONFIG || s == MOE_ERR_FLAG ? 2 : 1;
    }
    /* resume first: a resumed run appends to its metrics file instead of refusing it */
    int loaded = 0;
    if (cfg.load[0]) {
        s = moe_checkpoint_load(t, cfg.load, !strcmp(cfg.load, cfg.save), &loaded, &err);
        if (s != MOE_OK)
            return fail_agreed(t, NULL, world, &err, s == MOE_ERR_CONFIG ? 2 : 1);
        if (loaded)
            moe_log_info("ckpt  | resumed from '%s' at step %d", cfg.load, t->step);
    }
    /* the output paths: never an input of the run (outfile.h); the metrics file is never an
     * existing file without --overwrite, unless this run resumes (then it appends) */
    const char *inputs[] = {t->data.path};
    if (cfg.save[0] &&
        (s = moe_outfile_check(cfg.save, "save", inputs, 1, MOE_OUTFILE_APPEND, &err)) != MOE_OK)
        return fail_agreed(t, NULL, world, &err, 2);
    moe_metrics *mx = NULL;
    if (moe_comm_rank(world) == 0 && t->cfg.metrics_file[0]) {
        const moe_outfile_mode mode = loaded            ? MOE_OUTFILE_APPEND
                                      : t->cfg.overwrite ? MOE_OUTFILE_OVERWRITE
                                                         : MOE_OUTFILE_NEW;
        s = moe_outfile_check(t->cfg.metrics_file, "metrics-file", inputs, 1, mode, &err);
        if (s == MOE_OK)
            s = moe_metrics_open(&mx, t->cfg.metrics_file, mode, &err);
        if (s != MOE_OK)
            fail(world, s == MOE_ERR_CONFIG ? 2 : 1, err.msg);
    }
    print_config(t);
    write_config_metrics(mx, t, world);

    const moe_config *c = &t->cfg;
    if (c->exit_signal_handler && moe_exit_signal_install(&err) != MOE_OK)
        return fail_agreed(t, mx, world, &err, 1);
    moe_timer total;
    moe_timer_start(&total);
    double train_s = 0.0, tokens = 0.0, window_s = 0.0, window_tok = 0.0, window_flops = 0.0;
    const int first_step = t->step;
    for (int step = first_step; step < c->train_iters; step++) {
        test_kill_hook(t, step);
        moe_step_stats st;
        s = moe_trainer_step(t, &st, &err);
        if (s != MOE_OK) {
            /* a NaN or infinite loss or gradient norm: every rank stops at this step, the
             * weights untouched (--check-for-nan-in-loss-and-grad) */
            moe_log_error("%s", err.msg);
            moe_metrics_begin(mx, "error");
            moe_metrics_int(mx, "step", step + 1);
            moe_metrics_str(mx, "message", err.msg);
            end_record(mx, world);
            return finish(t, mx, world, 1);
        }
        train_s += st.seconds;
        tokens += st.tokens;
        window_s += st.seconds;
        window_tok += st.tokens;
        window_flops += st.flops;
        moe_metrics_begin(mx, "train");
        moe_metrics_int(mx, "step", step + 1);
        moe_metrics_num(mx, "loss", st.loss);
        moe_metrics_num(mx, "ce", st.ce);
        moe_metrics_num(mx, "aux_loss", st.aux);
        moe_metrics_num(mx, "z_loss", st.z);
        moe_metrics_num(mx, "lr", st.lr);
        moe_metrics_num(mx, "grad_norm", st.grad_norm);
        moe_metrics_num(mx, "step_s", st.seconds);
        moe_metrics_num(mx, "tokens_per_s", st.tokens / st.seconds);
        moe_metrics_num(mx, "tflops", st.flops / st.seconds / 1e12);
        if (t->model->be->peak_tflops() > 0)
            moe_metrics_num(mx, "mfu", st.flops / st.seconds / 1e12 / t->model->be->peak_tflops());
        if (st.load_read) { /* read on the device once per --log-interval (chapter 06) */
            moe_metrics_int(mx, "expert_load_min", st.load_min);
            moe_metrics_int(mx, "expert_load_max", st.load_max);
            moe_metrics_num(mx, "expert_load_mean", st.load_mean);
        }
        moe_metrics_int(mx, "dropped_tokens", st.dropped);
        end_record(mx, world);
        if ((step + 1) % c->log_interval == 0 || step == first_step ||
            step + 1 == c->train_iters) {
            double eta = (c->train_iters - step - 1) * (train_s / (step + 1 - first_step));
            char load[128] = "";
            if (st.load_mean > 0)
                snprintf(load, sizeof load, " | experts min/mean/max %lld/%.0f/%lld%s",
                         st.load_min, st.load_mean, st.load_max,
                         c->moe_expert_capacity_factor > 0 ? ", dropped " : "");
            if (st.load_mean > 0 && c->moe_expert_capacity_factor > 0)
                snprintf(load + strlen(load), sizeof load - strlen(load), "%lld", st.dropped);
            char perf[96] = "";
            double tflops = window_flops / window_s / 1e12, peak = t->model->be->peak_tflops();
            if (peak > 0)
                snprintf(perf, sizeof perf, " | %.1f TFLOP/s, MFU %.1f%%", tflops,
                         100 * tflops / peak);
            else
                snprintf(perf, sizeof perf, " | %.1f GFLOP/s", 1e3 * tflops);
            moe_log_info("step %5d/%d | loss %.4f (ce %.4f aux %.4f z %.4f) | lr %.2e | norm "
                         "%.2f | %.0f ms | %.0f tok/s%s%s | eta %.0f s",
                         step + 1, c->train_iters, st.loss, st.ce, st.aux, st.z, st.lr,
                         st.grad_norm, 1000 * st.seconds, window_tok / window_s, perf, load, eta);
            window_s = window_tok = window_flops = 0.0;
        }
        if (c->eval_interval > 0 && (step + 1) % c->eval_interval == 0 &&
            step + 1 != c->train_iters)
            evaluate(t, mx, world, step + 1, moe_timer_elapsed(&total));
        /* a step boundary: every rank decides the same way whether to save and stop */
        const int stop = c->exit_signal_handler && moe_exit_signal_agreed(t->world);
        if (c->save[0] && (stop || step + 1 == c->train_iters ||
                           (c->save_interval > 0 && (step + 1) % c->save_interval == 0))) {
            if (moe_checkpoint_save(t, c->save, c->keep_last, &err) != MOE_OK)
                return fail_agreed(t, mx, world, &err, 1);
            moe_log_info("ckpt  | saved step %d in '%s'", t->step, c->save);
        }
        if (stop) {
            moe_log_info("signal| stopping after step %d on a signal; resume with --load %s",
                         t->step, c->save);
            return finish(t, mx, world, 0);
        }
    }
    evaluate(t, mx, world, c->train_iters, moe_timer_elapsed(&total));
    moe_log_info("done  | %d steps in %.1f s of training (%.0f tok/s)", c->train_iters, train_s,
                 train_s > 0 ? tokens / train_s : 0.0);
    if (c->sample_length > 0) {
        char *text = malloc((size_t)c->sample_length + 1);
        if (text) {
            moe_trainer_sample(t, c->sample_length, c->sample_temperature, (uint64_t)c->seed,
                               text);
            moe_log_info("sample (temperature %.2f):\n----\n%s\n----", c->sample_temperature,
                         text);
            free(text);
        }
    }
    return finish(t, mx, world, 0);
}
