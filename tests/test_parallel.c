/* The parallel grid (lib/parallel.h) against Megatron Core's documented layouts, property
 * checks on random layouts, its named errors and bin/moe-grid's command line; and the
 * sharding metadata of the parameter table (a shard initialises as its slice of the whole
 * tensor, the model's tensors know their groups). */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "helpers.h"
#include "model.h"
#include "parallel.h"
#include "params.h"
#include "rng.h"
#include "suites.h"

static moe_grid resolved(int world, int tp, int cp, int ep, int etp, int pp) {
    moe_grid g = {.world = world, .tp = tp, .cp = cp, .ep = ep, .etp = etp, .pp = pp};
    moe_error err;
    ck_assert_msg(moe_grid_resolve(&g, &err) == MOE_OK, "%s", err.msg);
    return g;
}

/* The groups of one kind: count rows of size ranks, in Megatron's group order. */
typedef struct expected {
    moe_group_kind kind;
    int count, size;
    const int *rows;
} expected;

/* Every rank's group of each kind is row grp.index of the expected rows, and the rank sits at
 * position grp.rank of it. */
static void expect_groups(const moe_grid *g, const expected *e, int n) {
    int *members = malloc(sizeof(int) * (size_t)g->world);
    for (; n > 0; n--, e++)
        for (int r = 0; r < g->world; r++) {
            moe_group grp;
            const char *name = moe_group_name(e->kind);
            moe_grid_group(g, e->kind, r, &grp, members);
            ck_assert_msg(grp.count == e->count && grp.size == e->size,
                          "%s: rank %d in %d groups of %d, expected %d of %d", name, r, grp.count,
                          grp.size, e->count, e->size);
            ck_assert_int_eq(grp.kind, e->kind);
            ck_assert(grp.index >= 0 && grp.index < e->count);
            const int *row = e->rows + (size_t)grp.index * e->size;
            ck_assert_msg(row[grp.rank] == r, "%s: rank %d at position %d of group %d", name, r,
                          grp.rank, grp.index);
            for (int i = 0; i < e->size; i++)
                ck_assert_msg(members[i] == row[i], "%s group %d member %d: %d, expected %d",
                              name, grp.index, i, members[i], row[i]);
        }
    free(members);
}

#define ROWS(...) ((const int[]){__VA_ARGS__})
#define EXPECT(g, ...)                                                           \
    do {                                                                         \
        const expected e_[] = {__VA_ARGS__};                                     \
        expect_groups(g, e_, (int)(sizeof e_ / sizeof e_[0]));                   \
    } while (0)

/* 0, 1, ..., 15: consecutive ranks */
static const int SEQ[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* The example of the issue and of Megatron's MoE-parallel-folding documentation: 16 ranks,
 * attention TP2 x CP2 x DP2 x PP2, experts EP8 x PP2. */
START_TEST(test_grid_folding_example) {
    moe_grid g = resolved(16, 2, 2, 8, 1, 2);
    ck_assert_int_eq(g.dp, 2);
    ck_assert_int_eq(g.edp, 1);
    EXPECT(&g, {MOE_GROUP_EP, 2, 8, SEQ}, {MOE_GROUP_ETP_EP, 2, 8, SEQ},
           {MOE_GROUP_CP, 8, 2, ROWS(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15)},
           {MOE_GROUP_DP, 8, 2, ROWS(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15)},
           {MOE_GROUP_TP, 8, 2, SEQ},
           {MOE_GROUP_PP, 8, 2, ROWS(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15)},
           /* DP x CP: the dense gradients' group, 4 ranks sharing tp and pp coordinates */
           {MOE_GROUP_DP_CP, 4, 4, ROWS(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15)},
           {MOE_GROUP_TP_CP, 4, 4, SEQ},
           /* EDP of 1 and ETP of 1: every rank alone */
           {MOE_GROUP_EDP, 16, 1, SEQ}, {MOE_GROUP_ETP, 16, 1, SEQ});
}
END_TEST

/* The examples in Megatron's parallel_state.py docstrings. */
START_TEST(test_grid_megatron_docstrings) {
    /* initialize_model_parallel: 16 GPUs, TP2, PP4 (so DP2); expert TP defaults to TP
     * there, which gives the same groups on the expert grid */
    moe_grid g = resolved(16, 2, 1, 1, 2, 4);
    const int *dp = ROWS(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
    EXPECT(&g, {MOE_GROUP_DP, 8, 2, dp}, {MOE_GROUP_TP, 8, 2, SEQ},
           {MOE_GROUP_PP, 4, 4, ROWS(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)},
           {MOE_GROUP_ETP, 8, 2, SEQ}, {MOE_GROUP_EDP, 8, 2, dp});

    /* context_parallel_size: 8 GPUs, TP4, CP2: CP groups [0,4] [1,5] [2,6] [3,7] */
    g = resolved(8, 4, 2, 1, 1, 1);
    EXPECT(&g, {MOE_GROUP_CP, 4, 2, ROWS(0, 4, 1, 5, 2, 6, 3, 7)});

    /* generate_masked_orthogonal_rank_groups: [tp, dp, pp] = [2, 3, 4], dp groups
     * [0,2,4], [1,3,5], ..., [19,21,23] */
    g = resolved(24, 2, 1, 1, 1, 4);
    ck_assert_int_eq(g.dp, 3);
    int dp3[8 * 3];
    for (int grp = 0; grp < 8; grp++)
        for (int i = 0; i < 3; i++)
            dp3[grp * 3 + i] = (grp % 2) + 2 * i + 6 * (grp / 2);
    ck_assert_int_eq(dp3[7 * 3 + 0], 19);
    ck_assert_int_eq(dp3[7 * 3 + 2], 23);
    EXPECT(&g, {MOE_GROUP_DP, 8, 3, dp3});
}
END_TEST

/* Expert tensor parallelism, and expert grids that differ from the attention grid. */
START_TEST(test_grid_expert_layouts) {
    /* 8 ranks, TP2 (DP4); experts ETP2 x EP2 (EDP2) */
    moe_grid g = resolved(8, 2, 1, 2, 2, 1);
    ck_assert_int_eq(g.edp, 2);
    const int *edp = ROWS(0, 4, 1, 5, 2, 6, 3, 7);
    EXPECT(&g, {MOE_GROUP_ETP, 4, 2, SEQ}, {MOE_GROUP_EP, 4, 2, ROWS(0, 2, 1, 3, 4, 6, 5, 7)},
           {MOE_GROUP_EDP, 4, 2, edp}, {MOE_GROUP_ETP_EP, 2, 4, SEQ},
           {MOE_GROUP_DP, 2, 4, ROWS(0, 2, 4, 6, 1, 3, 5, 7)});

    /* 8 ranks, TP2 (DP4); experts ETP1 x EP4 (EDP2): EP consecutive, EDP strides by 4 */
    g = resolved(8, 2, 1, 4, 1, 1);
    EXPECT(&g, {MOE_GROUP_EP, 2, 4, SEQ}, {MOE_GROUP_EDP, 4, 2, edp});

    /* what the trainer builds today: W ranks all DP, EP consecutive ranks, EDP stride EP */
    g = resolved(4, 1, 1, 2, 1, 1);
    EXPECT(&g, {MOE_GROUP_DP, 1, 4, SEQ}, {MOE_GROUP_DP_CP, 1, 4, SEQ}, {MOE_GROUP_EP, 2, 2, SEQ},
           {MOE_GROUP_EDP, 2, 2, ROWS(0, 2, 1, 3)}, {MOE_GROUP_TP, 4, 1, SEQ});

    /* pure data parallelism, and one rank */
    g = resolved(4, 1, 1, 1, 1, 1);
    EXPECT(&g, {MOE_GROUP_DP, 1, 4, SEQ}, {MOE_GROUP_EDP, 1, 4, SEQ}, {MOE_GROUP_EP, 4, 1, SEQ});
    g = resolved(1, 1, 1, 1, 1, 1);
    ck_assert(g.dp == 1 && g.edp == 1);
    for (int k = 0; k < MOE_GROUP_COUNT; k++)
        EXPECT(&g, {(moe_group_kind)k, 1, 1, SEQ});
}
END_TEST

static int pick(int *choices, int n, uint64_t i) {
    return choices[(int)(moe_rng_uniform(77, 5, i) * n) % n];
}

/* Random valid layouts: every rank in exactly one group of each kind, at its position;
 * the sizes are the products of the kind's axes; a rank's positions are its coordinates on
 * both grids (rank = tp_r + tp·(cp_r + cp·(dp_r + dp·pp_r)), the same with etp, ep, edp);
 * each PP group holds the same coordinates on both grids' other axes (so PP is the same
 * group in both); DP inside DP x CP, EP inside ETP x EP. */
START_TEST(test_grid_properties) {
    int sizes[] = {1, 1, 2, 2, 3, 4};
    uint64_t draw = 0;
    for (int iter = 0; iter < (moe_test_quick() ? 40 : 200); iter++) {
        const int tp = pick(sizes, 6, draw++), cp = pick(sizes, 6, draw++),
                  dp = pick(sizes, 6, draw++), pp = pick(sizes, 6, draw++);
        const int W = tp * cp * dp * pp, per_stage = W / pp;
        int div[64], nd = 0;
        for (int d = 1; d <= per_stage; d++)
            if (per_stage % d == 0)
                div[nd++] = d;
        const int etp = pick(div, nd, draw++);
        nd = 0;
        for (int d = 1; d <= per_stage / etp; d++)
            if (per_stage / etp % d == 0)
                div[nd++] = d;
        const int ep = pick(div, nd, draw++);
        moe_grid g = resolved(W, tp, cp, ep, etp, pp);
        ck_assert_int_eq(g.dp, dp);
        ck_assert_int_eq(g.edp, W / (etp * ep * pp));
        const int want[MOE_GROUP_COUNT] = {tp, cp, dp, pp, dp * cp, tp * cp, etp, ep, g.edp,
                                           etp * ep};
        int *seen = calloc((size_t)W * W, sizeof(int)), *members = malloc(sizeof(int) * W);
        for (int k = 0; k < MOE_GROUP_COUNT; k++) {
            memset(seen, 0, sizeof(int) * (size_t)W * W);
            for (int r = 0; r < W; r++) {
                moe_group grp;
                moe_grid_group(&g, (moe_group_kind)k, r, &grp, members);
                ck_assert_msg(grp.size == want[k] && grp.count * grp.size == W,
                              "%s of W%d tp%d cp%d pp%d ep%d etp%d: size %d", moe_group_name(k), W,
                              tp, cp, pp, ep, etp, grp.size);
                ck_assert_int_eq(members[grp.rank], r);
                for (int i = 0; i < grp.size; i++)
                    seen[grp.index * W + members[i]]++;
            }
            /* group index g lists each of its members once for each of them: size times,
             * and no rank is in two groups */
            for (int r = 0; r < W; r++) {
                int in = 0;
                for (int gi = 0; gi < W; gi++)
                    in += seen[gi * W + r] != 0;
                ck_assert_msg(in == 1, "%s: rank %d in %d groups", moe_group_name(k), r, in);
            }
        }
        for (int r = 0; r < W; r++) {
            moe_group grp[MOE_GROUP_COUNT];
            for (int k = 0; k < MOE_GROUP_COUNT; k++)
                moe_grid_group(&g, (moe_group_kind)k, r, &grp[k], NULL);
            const int pr = grp[MOE_GROUP_PP].rank;
            ck_assert_int_eq(r, grp[MOE_GROUP_TP].rank +
                                    tp * (grp[MOE_GROUP_CP].rank +
                                          cp * (grp[MOE_GROUP_DP].rank + dp * pr)));
            ck_assert_int_eq(r, grp[MOE_GROUP_ETP].rank +
                                    etp * (grp[MOE_GROUP_EP].rank +
                                           ep * (grp[MOE_GROUP_EDP].rank + g.edp * pr)));
            moe_grid_group(&g, MOE_GROUP_PP, r, &grp[0], members);
            for (int i = 0; i < grp[0].size; i++) {
                const moe_group_kind other[] = {MOE_GROUP_TP_CP, MOE_GROUP_DP, MOE_GROUP_ETP_EP,
                                                MOE_GROUP_EDP};
                for (int o = 0; o < 4; o++) {
                    moe_group a, b;
                    moe_grid_group(&g, other[o], r, &a, NULL);
                    moe_grid_group(&g, other[o], members[i], &b, NULL);
                    ck_assert_msg(a.rank == b.rank, "PP group of rank %d: %s differs", r,
                                  moe_group_name(other[o]));
                }
            }
            int *inner = malloc(sizeof(int) * W);
            const moe_group_kind sub[2][2] = {{MOE_GROUP_DP, MOE_GROUP_DP_CP},
                                              {MOE_GROUP_EP, MOE_GROUP_ETP_EP}};
            for (int s = 0; s < 2; s++) {
                moe_group a, b;
                moe_grid_group(&g, sub[s][0], r, &a, inner);
                moe_grid_group(&g, sub[s][1], r, &b, members);
                for (int i = 0; i < a.size; i++) {
                    int found = 0;
                    for (int j = 0; j < b.size; j++)
                        found |= members[j] == inner[i];
                    ck_assert_msg(found, "%s of rank %d is not inside its %s",
                                  moe_group_name(sub[s][0]), r, moe_group_name(sub[s][1]));
                }
            }
            free(inner);
        }
        free(seen);
        free(members);
    }
}
END_TEST

static void expect_grid_error(int world, int tp, int cp, int ep, int etp, int pp,
                              const char *flag) {
    moe_grid g = {.world = world, .tp = tp, .cp = cp, .ep = ep, .etp = etp, .pp = pp};
    moe_error err;
    moe_error_clear(&err);
    ck_assert_int_eq(moe_grid_resolve(&g, &err), MOE_ERR_CONFIG);
    ck_assert_int_eq(err.code, MOE_ERR_CONFIG);
    ck_assert_msg(strstr(err.msg, flag) != NULL, "message does not name %s: %s", flag, err.msg);
}

START_TEST(test_grid_errors) {
    expect_grid_error(0, 1, 1, 1, 1, 1, "at least 1 rank");
    expect_grid_error(8, 0, 1, 1, 1, 1, "--tensor-model-parallel-size 0");
    expect_grid_error(8, 1, -2, 1, 1, 1, "--context-parallel-size -2");
    expect_grid_error(8, 1, 1, 0, 1, 1, "--expert-model-parallel-size 0");
    expect_grid_error(8, 1, 1, 1, 0, 1, "--expert-tensor-parallel-size 0");
    expect_grid_error(8, 1, 1, 1, 1, 0, "--pipeline-model-parallel-size 0");
    /* the attention grid does not divide the world, and the fix: a multiple of 4 ranks */
    expect_grid_error(6, 4, 1, 1, 1, 1, "--tensor-model-parallel-size 4");
    expect_grid_error(6, 4, 1, 1, 1, 1, "multiple of 4 ranks");
    expect_grid_error(12, 2, 2, 1, 1, 2, "--context-parallel-size 2");
    /* the expert grid does not: sizes of 1 are left out of the message */
    expect_grid_error(8, 1, 1, 3, 1, 1, "into --expert-model-parallel-size 3 = 3");
    expect_grid_error(12, 1, 1, 2, 4, 1, "--expert-tensor-parallel-size 4");
    expect_grid_error(10, 1, 1, 3, 1, 2, "--pipeline-model-parallel-size 2");
    /* more ranks than the world, and products that would overflow an int */
    expect_grid_error(4, 8, 1, 1, 1, 1, "needs more than the 4 rank(s)");
    expect_grid_error(8, 1, 1, 4, 4, 1, "--expert-model-parallel-size 4");
    expect_grid_error(8, INT_MAX, INT_MAX, 1, 1, INT_MAX, "needs more than");
    expect_grid_error(INT_MAX, 1, 1, INT_MAX, INT_MAX, INT_MAX, "needs more than");
}
END_TEST

/* bin/moe-grid: the 16-rank example, one rank's groups, and named errors with exit code 2. */
START_TEST(test_grid_program) {
    if (!moe_test_have_program("bin/moe-grid"))
        return;
    static const struct {
        const char *args;   /* after ./bin/moe-grid */
        int status;         /* expected exit status */
        const char *out[3]; /* text the output must contain (NULL: no more) */
    } cases[] = {
        {"--help", 0, {"--expert-tensor-parallel-size", "(default: "}},
        {"--world-size 16 --tensor-model-parallel-size 2 --context-parallel-size 2 "
         "--pipeline-model-parallel-size 2 --expert-model-parallel-size 8 "
         "--expert-tensor-parallel-size 1",
         0,
         {"[0 1 2 3 4 5 6 7] [8 9 10 11 12 13 14 15]", "[0 2] [1 3]", "[0 4] [1 5]"}},
        {"--world-size 8 --expert-model-parallel-size 4 --rank 5", 0, {"ep ", "[4 5 6 7]"}},
        {"--world-size 6 --tensor-model-parallel-size 4", 2, {"--tensor-model-parallel-size 4"}},
        {"--world-size 8 --rank 8", 2, {"--rank 8"}},
        {"", 2, {"--world-size"}},
        {"--world-size 4 --context-paralel-size 2", 2, {"did you mean"}},
    };
    static char out[1 << 16];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char cmd[512];
        snprintf(cmd, sizeof cmd, "./bin/moe-grid %s", cases[i].args);
        ck_assert_msg(moe_test_run(cmd, out, sizeof out) == cases[i].status, "%s: %s", cmd, out);
        for (int j = 0; j < 3 && cases[i].out[j]; j++)
            ck_assert_msg(strstr(out, cases[i].out[j]), "%s: no \"%s\" in %s", cmd,
                          cases[i].out[j], out);
    }
}
END_TEST

/* ------------------------------------------------------------------ sharded parameters */

/* A [4, 6, 10] tensor split along each dimension: shard s of n holds exactly the slice of the
 * whole tensor's initial values (rows, columns, or innermost elements), and the table lays
 * the smaller shard out for the tensors after it. */
START_TEST(test_params_shard_init) {
    const int shape[3] = {4, 6, 10}, counts[3] = {2, 3, 5};
    moe_param_table whole = {0};
    moe_params_add(&whole, "w", 3, shape[0], shape[1], shape[2], MOE_INIT_NORMAL, 0.5, 1);
    moe_real *full = malloc(sizeof(moe_real) * whole.total);
    moe_params_init(&whole, full, 42);
    for (int dim = 0; dim < 3; dim++) {
        const int n = counts[dim];
        int *hit = calloc(whole.total, sizeof(int));
        for (int s = 0; s < n; s++) {
            moe_param_table pt = {0};
            moe_params_add(&pt, "w", 3, shape[0], shape[1], shape[2], MOE_INIT_NORMAL, 0.5, 1);
            const moe_group_kind group = dim == 1 ? MOE_GROUP_EP : MOE_GROUP_TP;
            moe_params_shard(&pt, group, dim, s, n);
            moe_params_add(&pt, "after", 1, 3, 0, 0, MOE_INIT_ONES, 0, 0);
            const moe_tensor *t = &pt.t[0];
            ck_assert_int_eq(t->shape[dim], shape[dim] / n);
            ck_assert_int_eq(t->global_shape[dim], shape[dim]);
            ck_assert_uint_eq(t->numel, whole.total / n);
            ck_assert_uint_eq(pt.t[1].offset, t->numel);
            ck_assert_uint_eq(pt.total, t->numel + 3);
            ck_assert(t->shard.group == group && t->shard.dim == dim && t->shard.index == s &&
                      t->shard.count == n);
            /* split over an expert-grid group: replicas are EDP; else DP x CP */
            ck_assert_int_eq(t->grad_group, dim == 1 ? MOE_GROUP_EDP : MOE_GROUP_DP_CP);
            ck_assert_int_eq(pt.t[1].grad_group, MOE_GROUP_DP_CP);
            moe_real *p = malloc(sizeof(moe_real) * pt.total);
            moe_params_init(&pt, p, 42);
            for (size_t j = 0; j < t->numel; j++) {
                /* the element's coordinates, by hand: local + origin along the split dim */
                size_t c[3] = {j / ((size_t)t->shape[1] * t->shape[2]),
                               j / (size_t)t->shape[2] % t->shape[1], j % (size_t)t->shape[2]};
                c[dim] += (size_t)s * t->shape[dim];
                size_t gi = (c[0] * shape[1] + c[1]) * shape[2] + c[2];
                ck_assert_uint_eq(moe_tensor_global_index(t, j), gi);
                ck_assert_msg(p[j] == full[gi], "dim %d shard %d element %zu: %g, whole %g", dim,
                              s, j, (double)p[j], (double)full[gi]);
                hit[gi]++;
            }
            ck_assert(p[t->numel] == 1 && p[t->numel + 2] == 1);
            free(p);
            moe_params_free(&pt);
        }
        for (size_t i = 0; i < whole.total; i++)
            ck_assert_msg(hit[i] == 1, "dim %d: element %zu in %d shards", dim, i, hit[i]);
        free(hit);
    }
    /* a shard count of 1 is the whole tensor, recorded as in the group */
    moe_param_table pt = {0};
    moe_params_add(&pt, "w", 3, shape[0], shape[1], shape[2], MOE_INIT_NORMAL, 0.5, 1);
    moe_params_shard(&pt, MOE_GROUP_EP, 0, 0, 1);
    ck_assert_uint_eq(pt.total, whole.total);
    ck_assert_int_eq(pt.t[0].grad_group, MOE_GROUP_EDP);
    ck_assert_uint_eq(moe_tensor_global_index(&pt.t[0], 17), 17);
    ck_assert(pt.t[0].low.offset == MOE_NO_COPY);
    moe_params_free(&pt);
    moe_params_free(&whole);
    free(full);
}
END_TEST

/* The model's table: stable names, dense tensors replicated over DP x CP and laid out first,
 * the routed experts split over EP (dim 0) with EDP replicas last, so each gradient group
 * is one contiguous block (one collective per group). */
START_TEST(test_model_param_groups) {
    moe_config c;
    moe_error err;
    ck_assert(moe_test_config(&c, "--num-layers 2 --hidden-size 16 --num-attention-heads 2 "
                                  "--seq-length 8 --num-experts 4 --moe-ffn-hidden-size 8 "
                                  "--ffn-hidden-size 16 --moe-layer-freq 0,1 "
                                  "--moe-shared-expert-intermediate-size 8",
                              &err) == MOE_OK);
    c.vocab_size = 11;
    ck_assert_msg(moe_config_validate(&c, &err) == MOE_OK, "%s", err.msg);
    moe_model *m = NULL;
    ck_assert_msg(moe_model_create(&m, &c, moe_backend_cpu(), 1, NULL, &err) == MOE_OK, "%s",
                  err.msg);
    const moe_tensor *fc1 = moe_params_find(&m->table, "layers.1.moe.experts.fc1");
    ck_assert_ptr_nonnull(fc1);
    ck_assert(fc1->shard.group == MOE_GROUP_EP && fc1->shard.dim == 0 && fc1->shard.count == 1);
    ck_assert_int_eq(fc1->inner.count, 1);
    /* [E, 2F, H] seen as [2E, F, H]: gate and up rows of each expert, so ETP can split F */
    ck_assert_int_eq(fc1->global_shape[0], 8);
    ck_assert_int_eq(fc1->global_shape[1], 8);
    ck_assert_int_eq(fc1->grad_group, MOE_GROUP_EDP);
    ck_assert_ptr_nonnull(moe_params_find(&m->table, "layers.0.mlp.fc1"));
    ck_assert_int_eq(moe_params_find(&m->table, "layers.1.moe.router")->grad_group,
                     MOE_GROUP_DP_CP);
    ck_assert_int_eq(moe_params_find(&m->table, "layers.1.moe.shared.fc2")->shard.group,
                     MOE_GROUP_NONE);
    int changes = 0;
    for (int i = 1; i < m->table.n; i++)
        changes += m->table.t[i].grad_group != m->table.t[i - 1].grad_group;
    ck_assert_int_eq(m->table.t[0].grad_group, MOE_GROUP_DP_CP);
    ck_assert_int_eq(m->table.t[m->table.n - 1].grad_group, MOE_GROUP_EDP);
    ck_assert_int_eq(changes, 1);
    moe_model_free(m);
}
END_TEST

Suite *suite_parallel(void) {
    Suite *s = suite_create("parallel");
    const TTest *grid[] = {test_grid_folding_example, test_grid_megatron_docstrings,
                           test_grid_expert_layouts,  test_grid_properties,
                           test_grid_errors,          test_grid_program};
    moe_test_tcase(s, "grid", 120, grid, 6);
    const TTest *params[] = {test_params_shard_init, test_model_param_groups};
    moe_test_tcase(s, "params", 60, params, 2);
    return s;
}
