/*
 * moe-grid: print the process groups of a parallel layout (a teaching aid).
 *
 *   bin/moe-grid --world-size 16 --tensor-model-parallel-size 2 --context-parallel-size 2 \
 *                --pipeline-model-parallel-size 2 --expert-model-parallel-size 8 \
 *                --expert-tensor-parallel-size 1
 *   bin/moe-grid --world-size 8 --expert-model-parallel-size 4 --rank 5
 *
 * For a world size and Megatron's parallel sizes (data parallelism is what is left:
 * dp = world / (tp·cp·pp) on the attention grid, edp = world / (etp·ep·pp) on the expert
 * grid) it prints every group of every kind, then each rank's position in its groups; with
 * --rank R, rank R's groups one per line. The groups are exactly those moe-train's ranks
 * build, printed by lib/parallel.c (moe_grid_print_all, moe_grid_print_rank; moe-train prints
 * each rank's line at start-up). Exit codes follow moe-train: 2 for flag and layout errors.
 */
#include <stddef.h>
#include <stdio.h>

#include "flags.h"
#include "log.h"
#include "parallel.h"

#define PROG "moe-grid"

typedef struct grid_args {
    int world; /**< --world-size */
    int tp;    /**< --tensor-model-parallel-size */
    int cp;    /**< --context-parallel-size */
    int ep;    /**< --expert-model-parallel-size */
    int etp;   /**< --expert-tensor-parallel-size (0: same as tp) */
    int pp;    /**< --pipeline-model-parallel-size */
    int rank;  /**< --rank (-1: all) */
} grid_args;

#define F(name, field, def, help) \
    { name, MOE_FLAG_INT, offsetof(grid_args, field), def, help, NULL, "layout" }

static const moe_flag FLAGS[] = {
    F("world-size", world, "0", "ranks in the job (required)"),
    F("tensor-model-parallel-size", tp, "1", "TP: ranks that split each attention/dense matrix"),
    F("context-parallel-size", cp, "1", "CP: ranks that split each sequence"),
    F("expert-model-parallel-size", ep, "1", "EP: ranks that split the experts of a layer"),
    F("expert-tensor-parallel-size", etp, "0",
      "ETP: ranks that split each expert's matrices (0 = same as TP, Megatron's default)"),
    F("pipeline-model-parallel-size", pp, "1", "PP: pipeline stages (the same in both grids)"),
    F("rank", rank, "-1", "print only this rank's groups (-1 = every group)"),
};
#define NFLAGS ((int)(sizeof FLAGS / sizeof FLAGS[0]))

int main(int argc, char **argv) {
    grid_args a;
    moe_error err;
    moe_error_clear(&err);
    moe_flags_set_defaults(FLAGS, NFLAGS, &a);
    moe_status s = moe_flags_parse(FLAGS, NFLAGS, &a, argc, argv, &err);
    if (s == MOE_ERR_HELP) {
        moe_flags_print_help(stdout, PROG,
                             "Print every process group of a parallel layout: the attention/dense "
                             "grid (tp, cp, dp, pp)\nand the expert grid (etp, ep, edp, pp), in "
                             "Megatron's rank order tp-cp-ep-dp-pp.",
                             FLAGS, NFLAGS);
        return 0;
    }
    if (s == MOE_OK && a.world == 0)
        s = moe_error_set(&err, MOE_ERR_FLAG,
                          "--world-size is required: the number of ranks (e.g. --world-size 16)");
    moe_grid g = {.world = a.world, .tp = a.tp, .cp = a.cp, .ep = a.ep,
                  .etp = a.etp ? a.etp : a.tp, .pp = a.pp};
    if (s == MOE_OK)
        s = moe_grid_resolve(&g, &err);
    if (s == MOE_OK && (a.rank < -1 || a.rank >= g.world))
        s = moe_error_set(&err, MOE_ERR_FLAG, "--rank %d is not a rank of the %d: use 0 .. %d",
                          a.rank, g.world, g.world - 1);
    if (s != MOE_OK) {
        moe_log_error("%s", err.msg);
        return 2;
    }
    printf("%d ranks in the rank order tp-cp-ep-dp-pp (fastest first)\n", g.world);
    printf("  attention/dense grid: TP %d x CP %d x DP %d x PP %d\n", g.tp, g.cp, g.dp, g.pp);
    printf("  expert grid:          ETP %d x EP %d x EDP %d x PP %d\n\n", g.etp, g.ep, g.edp,
           g.pp);
    if (a.rank >= 0)
        moe_grid_print_rank(stdout, &g, a.rank);
    else
        moe_grid_print_all(stdout, &g);
    return 0;
}
