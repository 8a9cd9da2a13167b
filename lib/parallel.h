/**
 * @file parallel.h
 * @brief One parallel grid: every process group of a run, from (tp, cp, ep, etp, dp, pp).
 *
 * Megatron Core lays the ranks of a job out on a grid whose axes are the kinds of
 * parallelism, in the rank order **tp-cp-ep-dp-pp**, fastest first: ranks that differ
 * only in their tensor-parallel coordinate are neighbours (they exchange the most data,
 * so they should share a node), pipeline stages are the farthest apart.
 *
 * An MoE model lives on two such grids over the same ranks ("MoE parallel folding"):
 *  - the **attention/dense grid** (tp, cp, dp, pp): attention, norms, router, dense FFNs;
 *    dp = world / (tp·cp·pp);
 *  - the **expert grid** (etp, ep, edp, pp): the routed experts; edp = world / (etp·ep·pp).
 * Each grid leaves out the axis of the other (ep = 1 on the dense grid, cp = 1 on the expert
 * grid), so both use the same five-axis order. The pipeline axis is last in both, with the
 * same size, so the PP groups are identical: a pipeline stage holds the same layers whatever
 * part of a layer a rank computes.
 *
 * A rank's coordinate on an axis of size s and stride d (d = product of the sizes of the
 * faster axes) is (rank / d) mod s. A group of a kind is the set of ranks that agree on
 * every axis *outside* the kind: for the DP group, the ranks with the same tp, cp and pp
 * coordinates. Inside a group, members are ordered by their coordinates on the kind's axes,
 * fastest axis first, and groups are numbered by the coordinates outside the kind, fastest
 * first — Megatron's enumeration (`generate_masked_orthogonal_rank_groups`).
 *
 * Example (the MoE-parallel-folding example of Megatron's documentation): 16 ranks,
 * attention TP2·CP2·DP2·PP2, experts EP8·PP2 (ETP1, EDP1):
 *
 *     TP  [0,1] [2,3] ... [14,15]          EP  [0..7] [8..15]
 *     CP  [0,2] [1,3] [4,6] [5,7] ...      EDP [0] [1] ... [15]
 *     DP  [0,4] [1,5] [2,6] [3,7] ...      PP  [0,8] [1,9] ... [7,15] (both grids)
 *
 * Two layers: moe_grid_resolve() and moe_grid_group() are pure arithmetic (no MPI: what
 * the unit tests check and what `bin/moe-grid` prints); moe_parallel_create() turns them
 * into communicators.
 */
#ifndef MOE_PARALLEL_H
#define MOE_PARALLEL_H

#include <stddef.h>
#include <stdio.h>

#include "error.h"

struct moe_comm;

/** The kinds of process group. Each is one set of axes of one grid. */
typedef enum moe_group_kind {
    /* the attention/dense grid */
    MOE_GROUP_TP = 0,  /**< tensor parallel: ranks that split one layer's matrices */
    MOE_GROUP_CP,      /**< context parallel: ranks that split one sequence */
    MOE_GROUP_DP,      /**< data parallel: ranks with the same dense weights, different batches */
    MOE_GROUP_PP,      /**< pipeline parallel: the stages of one model copy (same in both grids) */
    MOE_GROUP_DP_CP,   /**< DP x CP: every rank holding the same dense shard; the dense
                            gradients are summed over it (CP ranks see other tokens) */
    MOE_GROUP_TP_CP,   /**< TP x CP: the ranks that together compute one layer's attention
                            on one sequence */
    /* the expert grid */
    MOE_GROUP_ETP,     /**< expert tensor parallel: ranks that split one expert's matrices */
    MOE_GROUP_EP,      /**< expert parallel: ranks that split the experts of a layer; tokens
                            travel between them (the dispatcher's group) */
    MOE_GROUP_EDP,     /**< expert data parallel: ranks with the same expert shard; the expert
                            gradients are summed over it */
    MOE_GROUP_ETP_EP,  /**< ETP x EP, "expert model parallel": all the ranks that together
                            hold one copy of a layer's experts */
    MOE_GROUP_COUNT,   /**< number of kinds */
    MOE_GROUP_NONE = MOE_GROUP_COUNT /**< no group (e.g. the split of a tensor that is whole) */
} moe_group_kind;

/**
 * The sizes of a run. Set world and the five chosen sizes, then moe_grid_resolve() checks
 * them and derives dp and edp.
 */
typedef struct moe_grid {
    int world; /**< ranks in the job */
    int tp;    /**< --tensor-model-parallel-size */
    int cp;    /**< --context-parallel-size */
    int ep;    /**< --expert-model-parallel-size */
    int etp;   /**< --expert-tensor-parallel-size */
    int pp;    /**< --pipeline-model-parallel-size */
    int dp;    /**< derived: world / (tp·cp·pp) */
    int edp;   /**< derived: world / (etp·ep·pp) */
} moe_grid;

/** Where one rank sits in the groups of one kind. */
typedef struct moe_group {
    moe_group_kind kind; /**< which kind */
    int index;           /**< which group of the kind, 0 .. count-1 (Megatron's numbering) */
    int count;           /**< groups of this kind (= world / size) */
    int size;            /**< ranks per group */
    int rank;            /**< this rank's position in its group, 0 .. size-1 */
} moe_group;

/**
 * @brief Check a grid and derive dp and edp. Every size must be at least 1, and the world
 *        must split evenly into both grids.
 * @param g grid with world, tp, cp, ep, etp and pp set; dp and edp are written
 * @param err receives the reason: ::MOE_ERR_CONFIG naming the flag and the fix (a size below
 *        1, a world that tp·cp·pp or etp·ep·pp does not divide, a product above the world)
 * @return ::MOE_OK or ::MOE_ERR_CONFIG
 */
moe_status moe_grid_resolve(moe_grid *g, moe_error *err);

/**
 * @brief The group of kind @p kind that holds @p rank (pure arithmetic, no communication).
 * @param g resolved grid  @param kind which kind  @param rank a world rank, 0 .. world-1
 * @param out receives the group's number, count, size and the rank's position in it
 * @param members NULL, or receives the group's world ranks in group order (out->size entries;
 *        at most g->world)
 */
void moe_grid_group(const moe_grid *g, moe_group_kind kind, int rank, moe_group *out,
                    int *members);

/** @brief Short name of a kind as Megatron writes it ("tp", "dp-cp", "etp-ep", ...; "none"
 *  for ::MOE_GROUP_NONE). @param kind the kind @return a static string */
const char *moe_group_name(moe_group_kind kind);

/** @brief 1 when @p kind belongs to the expert grid (its replicas are EDP groups), else 0.
 *  @param kind the kind @return 1 or 0 */
int moe_group_in_expert_grid(moe_group_kind kind);

/**
 * @brief Print one group's ranks as " [a b c]", first breaking the line (indented to column
 *        26) when a line already past column 26 would pass column 100.
 * @param f stream  @param members the group's world ranks  @param n how many
 * @param column the column the output starts at @return the column after it
 */
int moe_grid_print_group(FILE *f, const int *members, int n, int column);

/**
 * @brief Print every group of every kind of @p g, each once and with what it is for, then
 *        each rank's position on every axis (what `bin/moe-grid` shows).
 * @param f stream  @param g resolved grid
 */
void moe_grid_print_all(FILE *f, const moe_grid *g);

/**
 * @brief Print the groups of one rank, one kind a line: the group's number, the rank's
 *        position in it and its members.
 * @param f stream  @param g resolved grid  @param rank a world rank
 */
void moe_grid_print_rank(FILE *f, const moe_grid *g, int rank);

/**
 * @brief One rank's groups on one line, as snprintf() into @p buf: "rank 3: tp [2 3] cp [3]
 *        dp [1 3] pp [3] | etp [3] ep [2 3] edp [1 3]" (one axis each: the attention grid,
 *        then the expert grid). `bin/moe-train` prints it for every rank at start-up.
 * @param g resolved grid  @param rank a world rank
 * @param buf receives the line, cut to @p size with a terminating zero  @param size its size
 * @return the length the whole line needs (as snprintf)
 */
int moe_grid_print_rank_line(const moe_grid *g, int rank, char *buf, size_t size);

/**
 * The communicators of a run: one per kind, built from the grid. A group of one rank has
 * nothing to communicate and is NULL; a group of every rank is the world itself; kinds whose
 * groups coincide for this grid (e.g. EP and ETP x EP when etp = 1) share one communicator.
 */
typedef struct moe_parallel {
    moe_grid grid;                         /**< the resolved grid */
    int rank;                              /**< this rank in the world */
    struct moe_comm *world;                /**< all ranks (NULL: a single process) */
    struct moe_comm *comm[MOE_GROUP_COUNT]; /**< this rank's group of each kind, or NULL */
    int owned[MOE_GROUP_COUNT];            /**< 1 where comm[k] was created here (freed here) */
} moe_parallel;

/**
 * @brief Create this rank's communicator of every kind. Collective over @p world: every rank
 *        splits the world in the same order (kind by kind), with its group number as the color
 *        and its position as the key, so a communicator's ranks follow moe_grid_group().
 * @param p receives the groups  @param world all ranks, or NULL for a single process
 * @param g grid (resolved here; its world must be the size of @p world, 1 when NULL)
 * @param err receives the reason (an invalid grid, a failed split)
 * @return ::MOE_OK, ::MOE_ERR_CONFIG or ::MOE_ERR_BACKEND
 */
moe_status moe_parallel_create(moe_parallel *p, struct moe_comm *world, const moe_grid *g,
                               moe_error *err);

/** @brief This rank's group of kind @p kind: NULL when the group is this rank alone.
 *  @param p groups @param kind which kind @return the communicator or NULL */
struct moe_comm *moe_parallel_group(const moe_parallel *p, moe_group_kind kind);

/** @brief Free the communicators created by moe_parallel_create (not the world).
 *  @param p groups (zeroed: no-op) */
void moe_parallel_free(moe_parallel *p);

#endif /* MOE_PARALLEL_H */
