/*
 * Chapter 04 benchmark: what each parallel folding of one world costs, and why.
 *
 *   mpirun -np 4 bin/ch04_folding_bench [--foldings "tp=2,ep=4;tp=2,ep=2,etp=2;tp=1,ep=2,zero=1"]
 *                                       [--repeats 5]
 *
 * For every folding (attention/dense TP with sequence parallelism; experts EP, each expert
 * optionally split again over ETP ranks; the rest of each grid data-parallel: DP = world/TP,
 * EDP = world/(ETP·EP)) it trains a small MoE model for a few real steps and prints, per
 * step:
 *  - the step time (median of the repeats, slowest rank) and the tokens per second per rank:
 *    each DP rank (a TP group) runs one micro-batch per step, so a folding with more TP
 *    and less DP processes fewer tokens per step; tokens/s per rank is the comparison;
 *  - the bytes this rank sent in each of its groups, counted by the communication layer
 *    (comm.h: the logical payload a rank puts into each collective, not wire bytes);
 *  - the same bytes from an analytic model of the step, which must agree exactly, on every
 *    rank and every step, or the program exits 1;
 *  - the memory per rank (memory.h's estimate: weights, gradients, AdamW state,
 *    activations).
 *
 * The model of one step (one micro-batch per rank, N = B·T tokens of width H, s bytes per
 * activation on the wire, r bytes per moe_real, TP size t):
 *  - TP with SP: every "sandwich" (attention, a dense FFN, an MoE layer's shared expert)
 *    all-gathers this rank's N/t rows before its column-parallel GEMM and reduce-scatters
 *    the N rows after its row-parallel one; the backward gathers the output gradient and
 *    the input again and reduce-scatters the input gradient. The embedding is a
 *    reduce-scatter (its backward an all-gather), the LM head an all-gather (its backward
 *    an all-gather and a reduce-scatter), the vocabulary-parallel cross-entropy one
 *    all-gather of 2N reals (each token's partial max and sum). Then the gradients each
 *    TP rank computed from its rows only (moe_tensor::partial_group) are all-reduced.
 *    Without SP (dense models only) each sandwich is one all-reduce of N·H each way.
 *  - EP: per MoE layer, from the step's real routing (the dispatch plan's rows to and
 *    from each rank): the tokens go out (H activations and one routing weight each), the
 *    expert outputs come back, the output gradients go out and the input and routing
 *    weight gradients come back: 2(out+back)·H·s + (out+back)·r bytes, rows kept on this
 *    rank not counted. GPU ranks on one NVLink host take the fused path (chapter 02): our
 *    kernels store the rows straight into the peers' memory, so no collective runs and
 *    the comm layer counts nothing; the model prints those bytes on a line of their own.
 *  - ETP (`etp=e`, moe/expert_tp.h: each routed expert's fc1 split by columns and fc2 by
 *    rows over the e ranks of an ETP group): per MoE layer, after the EP dispatch, the ETP
 *    ranks must see the same rows. Rank j holds R_j of them (what its EP group delivered,
 *    the kept rows included), and every exchange pads each rank's block to p = max_j R_j
 *    rows, so that it is one collective of equal blocks (R_j from the counts the layer
 *    exchanged, this step's real routing). The forward all-gathers the inputs (H
 *    activations a row) and the routing weights (one real) and reduce-scatters the partial
 *    outputs (fc2 is row-parallel); the backward all-gathers the output gradients and
 *    reduce-scatters the partial input and routing-weight gradients (each a sum over the
 *    split width). A reduce-scatter counts its whole padded input, e blocks:
 *        all-gather p·(2H·s + r),   reduce-scatter e·p·(2H·s + r)   bytes per MoE layer.
 *    The expert weights' gradients need no sum over ETP (each rank's slice saw every row of
 *    the group): they are summed over EDP = world/(ETP·EP) below, each rank holding
 *    1/(EP·ETP) of every layer's experts.
 *  - DP (dense) and EDP (experts): one all-reduce of every gradient over its replicas
 *    (moe_tensor::grad_group), r bytes per element.
 *  - With the distributed optimizer (`zero=1`, --use-distributed-optimizer) that all-reduce
 *    becomes, per run of consecutive tensors with one grad_group of size P > 1 and L
 *    elements, cut into P pieces of c = ⌈L/P⌉ (the last padded): a reduce-scatter of the
 *    padded run, P·c·r bytes, before AdamW, and an all-gather of this rank's updated piece
 *    of the compute weights, c·s bytes, after it (the fp32 master stays sharded: bf16 on the
 *    wire on GPU ranks, half of an fp32 gather).
 *  - The step's scalars stay on the device (chapter 06), so their sums are modelled data
 *    all-reduces of 8 bytes a value: the losses and expert loads over TP and DP, the
 *    aux-loss counts over TP, the gradient norm's squares per shard group.
 * Host control data (the dispatchers' token counts per expert, the dropped-token count)
 * is counted and printed, not modelled ("counted only").
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "comm.h"
#include "flags.h"
#include "log.h"
#include "memory.h"
#include "parallel.h"
#include "timer.h"
#include "trainer.h"

#define PROG "ch04_folding_bench"

typedef struct opts {
    char device[MOE_FLAG_STR_LEN];
    char foldings[MOE_FLAG_STR_LEN];
    char model[MOE_FLAG_STR_LEN];
    int repeats, warmup;
} opts;

/* one item of --foldings */
#define FOLDING_SYNTAX "tp=T,ep=E[,etp=X][,sp=0|1][,zero=0|1]"

#define OF(name, type, field, def, help, choices) \
    { name, type, offsetof(opts, field), def, help, choices, "benchmark" }
static const moe_flag g_flags[] = {
    OF("device", MOE_FLAG_CHOICE, device, "cpu", "backend of every rank", "cpu|cuda"),
    OF("foldings", MOE_FLAG_STRING, foldings, "",
       "';'-separated foldings, each '" FOLDING_SYNTAX "' (etp: "
       "--expert-tensor-parallel-size, default 1; sp defaults to 1 when tp > 1; zero=1: "
       "--use-distributed-optimizer); empty = every power-of-two tp and ep the world allows, "
       "uniform TP (tp=2,etp=2, the rest of the world EP) and plain DP with the distributed "
       "optimizer", NULL),
    OF("model", MOE_FLAG_STRING, model, "",
       "extra model flags appended to the built-in small MoE model (e.g. '--hidden-size 128')",
       NULL),
    OF("repeats", MOE_FLAG_INT, repeats, "5", "timed training steps (median)", NULL),
    OF("warmup", MOE_FLAG_INT, warmup, "1", "untimed training steps first", NULL),
};
#define NFLAGS ((int)(sizeof g_flags / sizeof g_flags[0]))

/* Every layer MoE with a shared expert (so each layer has two TP sandwiches), the alltoall
 * dispatcher, dropless; the heads, KV groups, experts and vocabulary divide by 4. */
#define BASE_MODEL                                                                           \
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 4 "          \
    "--seq-length 32 --micro-batch-size 2 --num-experts 8 --moe-router-topk 2 "              \
    "--moe-ffn-hidden-size 64 --moe-shared-expert-intermediate-size 64 "                     \
    "--moe-aux-loss-coeff 1e-2 --make-vocab-size-divisible-by 8 "                            \
    "--moe-token-dispatcher-type alltoall --lr 1e-3"

typedef struct folding {
    int tp, ep, sp;
    int etp;  /* --expert-tensor-parallel-size */
    int zero; /* --use-distributed-optimizer */
} folding;

/* "tp=2,ep=4,etp=2,sp=1,zero=1" -> f; 0 on a malformed item */
static int parse_folding(const char *s, folding *f) {
    f->tp = 1, f->ep = 1, f->etp = 1, f->sp = -1, f->zero = 0;
    char buf[128];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *save = NULL, *kv = strtok_r(buf, ",", &save); kv; kv = strtok_r(NULL, ",", &save)) {
        while (*kv == ' ')
            kv++;
        int v;
        char key[8];
        if (sscanf(kv, "%7[a-z]=%d", key, &v) != 2)
            return 0;
        if (!strcmp(key, "tp"))
            f->tp = v;
        else if (!strcmp(key, "ep"))
            f->ep = v;
        else if (!strcmp(key, "etp"))
            f->etp = v;
        else if (!strcmp(key, "sp"))
            f->sp = v;
        else if (!strcmp(key, "zero") && (v == 0 || v == 1))
            f->zero = v;
        else
            return 0;
    }
    if (f->sp < 0)
        f->sp = f->tp > 1;
    return 1;
}

/* Every setting of a folding, for the messages: "tp=2,ep=2,etp=2,sp=1,zero=0" */
static const char *folding_str(const folding *f, char *buf, size_t cap) {
    snprintf(buf, cap, "tp=%d,ep=%d,etp=%d,sp=%d,zero=%d", f->tp, f->ep, f->etp, f->sp, f->zero);
    return buf;
}

/* ---------------------------------------------------------------- the analytic model */

/* bytes[kind][op]: what this rank sends in the group of each kind during one step */
typedef unsigned long long model_bytes[MOE_GROUP_COUNT][MOE_COMM_OP_COUNT];

static moe_group_kind grad_group_of(const moe_tensor *x) { return x->grad_group; }

/* The fused NVLink path's bytes of the last step modelled (rows stored straight into the
 * peers' memory by our kernels: no collective, so the comm layer counts none of them) */
static unsigned long long g_fused_bytes;

/* micro-batches each rank runs in one step */
static unsigned long long micro_batches(const moe_trainer *t) {
    const moe_config *c = &t->model->cfg;
    return (unsigned long long)(c->global_batch_size / c->micro_batch_size) / t->dp_size;
}

static void model_step(const moe_trainer *t, model_bytes out) {
    g_fused_bytes = 0;
    memset(out, 0, sizeof(model_bytes));
    const moe_model *m = t->model;
    const moe_config *c = &m->cfg;
    const moe_backend *be = m->be;
    const unsigned long long s = be->act_size, r = sizeof(moe_real);
    const unsigned long long N = (unsigned long long)c->micro_batch_size * c->seq_length;
    const unsigned long long H = (unsigned long long)c->hidden_size;
    const int L = c->num_layers;

    /* TP: the sandwiches and the vocabulary-parallel ends */
    if (t->tp.size > 1) {
        const unsigned long long tp = (unsigned long long)t->tp.size, X = N * H * s;
        unsigned long long S = 0; /* sandwiches per step */
        for (int l = 0; l < L; l++)
            S += 1 + (!c->is_moe_layer[l] || c->moe_shared_expert_intermediate_size > 0);
        unsigned long long *b = out[MOE_GROUP_TP];
        if (t->tp.sp) {
            /* all-gathers: S (forward) + 2S (backward: dy and x again) + the LM head's input
             * (forward, and again in its backward) + the embedding's backward */
            b[MOE_COMM_OP_ALL_GATHER] += (3 * S + 3) * (X / tp);
            /* reduce-scatters of the N rows: S + the embedding (forward), S + the LM head
             * (backward) */
            b[MOE_COMM_OP_REDUCE_SCATTER] += (2 * S + 2) * X;
        } else {
            b[MOE_COMM_OP_ALL_REDUCE] += (2 * S + 2) * X; /* g forward, f backward */
        }
        b[MOE_COMM_OP_ALL_GATHER] += 2 * N * r; /* the cross-entropy's partial max and sum */
    }
    /* gradients: partial sums over TP first, then every replica group */
    for (int i = 0; i < m->table.n; i++) {
        const moe_tensor *x = &m->table.t[i];
        if (x->partial_group != MOE_GROUP_NONE)
            out[x->partial_group][MOE_COMM_OP_ALL_REDUCE] += x->numel * r;
        if (x->grad_group != MOE_GROUP_NONE && !c->use_distributed_optimizer)
            out[x->grad_group][MOE_COMM_OP_ALL_REDUCE] += x->numel * r;
    }
    /* the distributed optimizer: per run of one grad_group, a reduce-scatter of the run
     * padded to P pieces of c elements (r bytes each), and an all-gather of this rank's piece
     * of the compute copy (s bytes each: the master weights stay sharded) */
    if (c->use_distributed_optimizer) {
        size_t start, end;
        moe_group_kind k;
        int i = 0;
        while (moe_params_next_run(&m->table, grad_group_of, &i, &start, &end, &k)) {
            const moe_comm *g = k == MOE_GROUP_NONE ? NULL : moe_parallel_group(&t->par, k);
            if (!g)
                continue;
            const unsigned long long P = (unsigned long long)moe_comm_size(g);
            const unsigned long long chunk = (end - start + P - 1) / P;
            out[k][MOE_COMM_OP_REDUCE_SCATTER] += P * chunk * r;
            out[k][MOE_COMM_OP_ALL_GATHER] += chunk * s; /* the compute copy's piece */
        }
    }
    /* The step's scalars (chapter 06: they stay on the device, so their sums are data
     * all-reduces, 8 bytes a value): under TP each micro-batch's aux and z totals and each
     * MoE layer's aux-loss counts [groups, E], and the step's expert loads [L, E]; over DP
     * the step's {loss, ce, aux, z} and the loads; the gradient norm's squares, one value
     * per shard group with a communicator (under ZeRO first each run's slots over its group).
     * The step flags (one int) are summed over the world when a layer can overflow its
     * budget (moe_model_may_overflow): where a group spans the world it is the world's
     * communicator, and those 4 bytes are counted there (once: kinds that share a
     * communicator share its counts). */
    {
        const unsigned long long E = (unsigned long long)c->num_experts, LE = (unsigned long long)L * E;
        const unsigned long long micro = micro_batches(t);
        if (t->tp.comm && E > 0) {
            unsigned long long per_micro = 2 * 8;
            const int aux = c->lb_type != MOE_LB_NONE && c->moe_aux_loss_coeff > 0;
            const unsigned long long groups =
                c->lb_type == MOE_LB_SEQ_AUX ? (unsigned long long)c->micro_batch_size : 1;
            for (int l = 0; l < L; l++)
                if (c->is_moe_layer[l] && aux)
                    per_micro += groups * E * 8;
            out[MOE_GROUP_TP][MOE_COMM_OP_ALL_REDUCE] += micro * per_micro + LE * 8;
        }
        if (t->world)
            out[MOE_GROUP_DP_CP][MOE_COMM_OP_ALL_REDUCE] += 4 * 8 + LE * 8;
        int used[MOE_GROUP_COUNT + 1] = {0};
        for (int i = 0; i < m->table.n; i++)
            used[m->table.t[i].shard.group] = 1;
        for (int q = 0; q < t->zero.n_runs; q++)
            if (t->zero.run[q].comm)
                out[t->zero.run[q].kind][MOE_COMM_OP_ALL_REDUCE] += MOE_STEP_NORM_SLOTS * 8;
        for (int g = 0; g < MOE_GROUP_COUNT; g++)
            if (used[g] && moe_parallel_group(&t->par, (moe_group_kind)g))
                out[g][MOE_COMM_OP_ALL_REDUCE] += 8;
        for (int g = 0; t->world && moe_model_may_overflow(m) && g < MOE_GROUP_COUNT; g++)
            if (moe_parallel_group(&t->par, (moe_group_kind)g) == t->world) {
                out[g][MOE_COMM_OP_ALL_REDUCE] += sizeof(int);
                break;
            }
    }
    /* EP: the tokens of this step's routing */
    if (t->ep.comm) {
        for (int l = 0; l < L; l++) {
            if (!c->is_moe_layer[l])
                continue;
            const moe_dispatch_plan *p = &m->acts[l].moe.plan;
            /* chapter 06's plan on the device (fused and sync-free): each micro-batch
             * all-gathers every rank's expert offsets, E + 1 int32, over the EP group; the
             * rows then move by peer stores, which the host never counts */
            if (p->fused && p->sync_free) {
                out[MOE_GROUP_EP][MOE_COMM_OP_ALL_GATHER] +=
                    micro_batches(t) * ((unsigned long long)c->num_experts + 1) * 4;
                continue;
            }
            if (!p->send_rows) /* no step yet (the group list before any warm-up) */
                continue;
            unsigned long long rows = 0, sent = 0; /* out + back; out */
            for (int q = 0; q < t->ep.size; q++)
                if (q != t->ep.rank) {
                    rows += p->send_rows[q] + p->recv_rows[q];
                    sent += p->send_rows[q];
                }
            if (p->fused) /* GPU ranks on one NVLink host: peer stores, not a collective */
                g_fused_bytes += 2 * rows * H * s + rows * r;
            else /* chapter 05's FP8 dispatch: the forward's token rows as H codes + H/128
                  * fp32 scales instead of H activations (the way back stays as it was) */
                out[MOE_GROUP_EP][MOE_COMM_OP_ALL_TO_ALL] +=
                    2 * rows * H * s + rows * r -
                    (t->ep.fp8 ? sent * (H * s - H - 4 * (H / 128)) : 0);
        }
    }
    /* ETP: per MoE layer, the group's rows gathered (x, w; then dy) and the partial sums
     * reduce-scattered (y; then dx, dw), every rank's block padded to the largest one */
    if (m->etp.size > 1) {
        const unsigned long long e = (unsigned long long)m->etp.size, row = 2 * H * s + r;
        for (int l = 0; l < L; l++) {
            if (!c->is_moe_layer[l])
                continue;
            const moe_etp_rows *er = &m->acts[l].moe.etp;
            if (!er->counts) /* no step yet */
                continue;
            unsigned long long p = 0; /* max_j R_j */
            for (int j = 0; j < m->etp.size; j++) {
                unsigned long long Rj = 0;
                for (int g = 0; g < er->G; g++)
                    Rj += (unsigned long long)er->counts[j * er->G + g];
                p = Rj > p ? Rj : p;
            }
            out[MOE_GROUP_ETP][MOE_COMM_OP_ALL_GATHER] += p * row;
            out[MOE_GROUP_ETP][MOE_COMM_OP_REDUCE_SCATTER] += e * p * row;
        }
    }
}

/* ---------------------------------------------------------------- the groups */

/* The distinct communicators of a run: kinds whose groups coincide (e.g. TP and EP both
 * the world) share one, and so one set of counts. */
typedef struct group_row {
    moe_comm *comm;
    char name[64];     /* "tp=ep", ... */
    int size;
    unsigned long long model[MOE_COMM_OP_COUNT];
} group_row;

static int collect_groups(const moe_trainer *t, group_row *rows, const model_bytes mb) {
    int n = 0;
    for (int k = 0; k < MOE_GROUP_COUNT; k++) {
        moe_comm *g = moe_parallel_group(&t->par, (moe_group_kind)k);
        int j = 0;
        if (!g)
            continue;
        while (j < n && rows[j].comm != g)
            j++;
        if (j == n) {
            memset(&rows[n], 0, sizeof rows[n]);
            rows[n].comm = g;
            rows[n].size = moe_comm_size(g);
            n++;
        }
        size_t len = strlen(rows[j].name);
        snprintf(rows[j].name + len, sizeof rows[j].name - len, "%s%s", len ? "=" : "",
                 moe_group_name((moe_group_kind)k));
        for (int op = 0; op < MOE_COMM_OP_COUNT; op++)
            rows[j].model[op] += mb[k][op];
    }
    return n;
}

static void mb_str(char *out, size_t cap, double bytes) {
    if (bytes >= 1e6)
        snprintf(out, cap, "%.3f MB", bytes / 1e6);
    else
        snprintf(out, cap, "%.1f kB", bytes / 1e3);
}

/* One folding: build, warm up, time the steps with the counts checked on each. Returns the
 * number of (rank, step, group, kind) disagreements on this rank, or -1 when the folding
 * could not be built (the reason printed by rank 0). */
static long long run_folding(const opts *o, moe_comm *world, const folding *f) {
    const int W = moe_comm_size(world), rank = moe_comm_rank(world);
    const int dp = W / (f->tp > 0 && W % f->tp == 0 ? f->tp : 1);
    char flags[2048], name[96];
    folding_str(f, name, sizeof name);
    snprintf(flags, sizeof flags,
             "%s %s --device %s --tensor-model-parallel-size %d --expert-model-parallel-size %d "
             "--expert-tensor-parallel-size %d %s %s --global-batch-size %d",
             BASE_MODEL, o->model, o->device, f->tp, f->ep, f->etp,
             f->sp ? "--sequence-parallel" : "", f->zero ? "--use-distributed-optimizer" : "",
             2 * dp);
    moe_config cfg;
    moe_error err;
    moe_error_clear(&err);
    moe_config_defaults(&cfg);
    moe_trainer *t = NULL;
    moe_status st = moe_config_parse_string(&cfg, flags, &err);
    if (st == MOE_OK)
        st = moe_trainer_create_dist(&t, &cfg, world, &err);
    if (moe_comm_host_max(world, st != MOE_OK) > 0) { /* every rank skips it together */
        if (rank == 0)
            printf("\nfolding %s: not run (%s)\n", name,
                   st != MOE_OK ? err.msg : "another rank could not build it");
        moe_trainer_free(t);
        return -1;
    }
    for (int i = 0; i < o->warmup; i++) {
        moe_step_stats s;
        if (moe_trainer_step(t, &s, &err) != MOE_OK)
            moe_comm_abort(world, 1, err.msg);
    }
    group_row rows[MOE_GROUP_COUNT];
    model_bytes mb;
    model_step(t, mb); /* only for the group list; recomputed after every step */
    const int ng = collect_groups(t, rows, mb);
    double *ms = malloc(sizeof(double) * (size_t)o->repeats);
    moe_comm_bytes counted[MOE_GROUP_COUNT];
    long long bad = 0;
    double loss = 0;
    for (int i = 0; i < o->repeats; i++) {
        for (int g = 0; g < ng; g++)
            moe_comm_bytes_reset(rows[g].comm);
        moe_comm_barrier(world);
        moe_timer tm;
        moe_timer_start(&tm);
        moe_step_stats s;
        if (moe_trainer_step(t, &s, &err) != MOE_OK)
            moe_comm_abort(world, 1, err.msg);
        t->model->be->synchronize();
        ms[i] = 1e3 * moe_timer_elapsed(&tm);
        loss = s.loss;
        for (int g = 0; g < ng; g++)
            counted[g] = moe_comm_bytes_sent(rows[g].comm);
        model_step(t, mb);
        ng == collect_groups(t, rows, mb) ? (void)0 : moe_comm_abort(world, 1, "groups changed");
        for (int g = 0; g < ng; g++)
            for (int op = 0; op < MOE_COMM_OP_HOST; op++)
                if (counted[g].bytes[op] != rows[g].model[op]) {
                    if (bad++ < 8)
                        fprintf(stderr,
                                "[rank %d] %s step %d: group %s %s "
                                "counted %llu bytes, the model says %llu\n",
                                rank, name, i, rows[g].name,
                                moe_comm_op_name((moe_comm_op)op), counted[g].bytes[op],
                                rows[g].model[op]);
                }
    }
    const double med = moe_comm_host_max(world, moe_median(ms, o->repeats));
    const long long all_bad = (long long)moe_comm_host_max(world, (double)bad);
    const moe_memory_estimate e = t->model->mem; /* checked before the model's allocation */
    if (rank == 0) {
        const moe_grid *gr = &t->par.grid;
        char etp_key[16] = "", etp_grid[24] = ""; /* ETP named only where it splits experts */
        if (f->etp > 1) {
            snprintf(etp_key, sizeof etp_key, ",etp=%d", f->etp);
            snprintf(etp_grid, sizeof etp_grid, "ETP %d x ", gr->etp);
        }
        printf("\nfolding tp=%d,ep=%d%s%s%s: attention TP %d x DP %d, experts %sEP %d x EDP %d%s"
               " | step %.2f ms (median of %d, slowest rank), %.0f tokens/s per rank, loss %.4f\n",
               f->tp, f->ep, etp_key, f->sp ? " + SP" : "", f->zero ? ",zero=1" : "", gr->tp,
               gr->dp, etp_grid, gr->ep, gr->edp, f->zero ? ", distributed optimizer" : "", med,
               o->repeats, (double)t->cfg.global_batch_size * t->cfg.seq_length / (med / 1e3) / W,
               loss);
        char sw[32], sg[32], so[32], sa[32], stot[32];
        mb_str(sw, sizeof sw, (double)e.weight_bytes);
        mb_str(sg, sizeof sg, (double)e.grad_bytes);
        mb_str(so, sizeof so, (double)e.optim_bytes);
        mb_str(sa, sizeof sa, (double)e.act_bytes);
        mb_str(stot, sizeof stot, (double)e.total_bytes);
        printf("  memory/rank (estimate): %lld params | weights %s, grads %s, AdamW %s, "
               "activations %s, total %s\n", e.params, sw, sg, so, sa, stot);
        printf("  %-20s %5s  %-14s %14s %14s  %s\n", "group", "ranks", "collective",
               "counted B", "model B", "(rank 0, last step)");
        for (int g = 0; g < ng; g++)
            for (int opi = 0; opi < MOE_COMM_OP_COUNT; opi++) {
                if (!counted[g].calls[opi] && !rows[g].model[opi])
                    continue;
                char mod[32];
                if (opi == MOE_COMM_OP_HOST)
                    snprintf(mod, sizeof mod, "counted only");
                else
                    snprintf(mod, sizeof mod, "%llu", rows[g].model[opi]);
                printf("  %-20s %5d  %-14s %14llu %14s  %llu calls\n", rows[g].name,
                       rows[g].size, moe_comm_op_name((moe_comm_op)opi), counted[g].bytes[opi],
                       mod, counted[g].calls[opi]);
            }
        if (!ng)
            printf("  (one rank per group: nothing to communicate)\n");
        if (g_fused_bytes)
            printf("  %-20s %5d  %-14s %14s %14llu  (the fused NVLink path: peer stores by our "
                   "kernels, not counted by the comm layer)\n",
                   "ep (fused)", t->ep.size, "peer stores", "-", g_fused_bytes);
        printf("  model %s the counts on every rank for all %d steps\n",
               all_bad ? "DISAGREES WITH" : "= exactly", o->repeats);
    }
    free(ms);
    moe_trainer_free(t);
    return bad;
}

int main(int argc, char **argv) {
    opts o;
    moe_error err;
    moe_error_clear(&err);
    moe_flags_set_defaults(g_flags, NFLAGS, &o);
    moe_status s = moe_flags_parse(g_flags, NFLAGS, &o, argc, argv, &err);
    if (s == MOE_ERR_HELP) {
        moe_flags_print_help(stdout, PROG,
                             "Chapter 04: step time, bytes per group (counted and modelled, "
                             "which must agree) and memory per rank of each parallel folding "
                             "(run under mpirun).", g_flags, NFLAGS);
        return 0;
    }
    if (s == MOE_OK && (o.repeats < 1 || o.warmup < 0))
        s = moe_error_set(&err, MOE_ERR_FLAG, "--repeats must be >= 1 and --warmup >= 0");
    if (s != MOE_OK) {
        moe_log_error("%s", err.msg);
        return 2;
    }
    moe_comm *world = NULL;
    const moe_device dev = strcmp(o.device, "cuda") ? MOE_DEVICE_CPU : MOE_DEVICE_CUDA;
    if (moe_comm_init(&argc, &argv, dev, &world, &err) != MOE_OK) {
        moe_log_error("%s", err.msg);
        return 1;
    }
    const int W = moe_comm_size(world), rank = moe_comm_rank(world);
    moe_log_set_rank(rank, W);
    setenv("MOE_NO_DOWNLOAD", "1", 1);

    folding list[64];
    int n = 0;
    if (o.foldings[0]) {
        char buf[MOE_FLAG_STR_LEN];
        snprintf(buf, sizeof buf, "%s", o.foldings);
        for (char *save = NULL, *item = strtok_r(buf, ";", &save); item && n < 64;
             item = strtok_r(NULL, ";", &save)) {
            if (!parse_folding(item, &list[n])) {
                if (rank == 0)
                    moe_log_error("--foldings: '%s' is not '" FOLDING_SYNTAX "' (e.g. "
                                  "--foldings \"tp=2,ep=2;tp=2,ep=1,etp=2;tp=1,ep=4,zero=1\")",
                                  item);
                moe_comm_finalize(world);
                return 2;
            }
            n++;
        }
    } else { /* every power-of-two tp (up to 4: the heads) and ep (up to 8: the experts) */
        for (int tp = 1; tp <= W && tp <= 4; tp *= 2)
            for (int ep = 1; ep <= W && ep <= 8; ep *= 2)
                if (W % tp == 0 && W % ep == 0)
                    list[n++] = (folding){.tp = tp, .ep = ep, .etp = 1, .sp = tp > 1};
        /* uniform TP: the experts split like the attention (ETP = TP = 2) and over the rest
         * of the world by EP, so that ETP x EP is the world, the experts' split of the folded
         * tp=2,ep=W (when the 8 experts divide by W/2) */
        if (W % 2 == 0 && 8 % (W / 2) == 0)
            list[n++] = (folding){.tp = 2, .ep = W / 2, .etp = 2, .sp = 1};
        if (W > 1) /* plain DP (and EDP) with the distributed optimizer */
            list[n++] = (folding){.tp = 1, .ep = 1, .etp = 1, .zero = 1};
    }
    if (rank == 0) {
        char name[600], where[640];
        moe_error e2;
        const moe_backend *be = NULL;
        if (moe_backend_select(o.device, &be, &e2) == MOE_OK)
            be->device_name(name, sizeof name);
        else
            snprintf(name, sizeof name, "%s", o.device);
        snprintf(where, sizeof where, "%d ranks x %s", W, name);
        moe_bench_header("ch04 parallel foldings: step time, bytes per group, memory", where);
        printf("model: %s %s\nbytes: the logical payload each rank puts into each collective "
               "(comm.h), per training step of one micro-batch per rank\n",
               BASE_MODEL, o.model);
    }
    long long bad = 0;
    for (int i = 0; i < n; i++) {
        long long b = run_folding(&o, world, &list[i]);
        bad += b > 0 ? b : 0;
    }
    const int fail = moe_comm_host_max(world, (double)bad) > 0;
    if (rank == 0)
        printf("\n%s\n", fail ? "FAIL: the bytes model disagrees with the counts (see above)"
                              : "OK: the bytes model agrees exactly with the counts");
    moe_comm_finalize(world);
    return fail ? 1 : 0;
}
