/* The parallel grid and its process groups: see parallel.h. */
#include "parallel.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"

/* The axes of both grids, in Megatron's rank order: fastest first. */
enum { AX_TP, AX_CP, AX_EP, AX_DP, AX_PP, AX_COUNT };
#define AX(a) (1u << (a))

/* Each kind: its name, its grid, and the axes its groups span. On the expert grid the TP
 * axis holds ETP and the DP axis EDP. */
static const struct {
    const char *name;
    int expert;
    unsigned axes;
    const char *about; /* what the kind is for (moe_grid_print_all) */
} KINDS[MOE_GROUP_COUNT] = {
    [MOE_GROUP_TP] = {"tp", 0, AX(AX_TP), "split each attention/dense matrix"},
    [MOE_GROUP_CP] = {"cp", 0, AX(AX_CP), "split each sequence (attention exchanges keys/values)"},
    [MOE_GROUP_DP] = {"dp", 0, AX(AX_DP), "same dense weights, different batches"},
    [MOE_GROUP_PP] = {"pp", 0, AX(AX_PP), "the stages of one model copy"},
    [MOE_GROUP_DP_CP] = {"dp-cp", 0, AX(AX_DP) | AX(AX_CP), "dense gradients are summed here"},
    [MOE_GROUP_TP_CP] = {"tp-cp", 0, AX(AX_TP) | AX(AX_CP),
                         "together compute one layer's attention on one sequence"},
    [MOE_GROUP_ETP] = {"etp", 1, AX(AX_TP), "split each expert's matrices"},
    [MOE_GROUP_EP] = {"ep", 1, AX(AX_EP), "split the experts; tokens travel between them"},
    [MOE_GROUP_EDP] = {"edp", 1, AX(AX_DP), "same expert shard; expert gradients are summed here"},
    [MOE_GROUP_ETP_EP] = {"etp-ep", 1, AX(AX_TP) | AX(AX_EP),
                          "together hold one copy of a layer's experts"},
};

const char *moe_group_name(moe_group_kind kind) {
    return kind < MOE_GROUP_COUNT ? KINDS[kind].name : "none";
}

int moe_group_in_expert_grid(moe_group_kind kind) {
    return kind < MOE_GROUP_COUNT && KINDS[kind].expert;
}

/* The axis sizes of one grid and their strides (product of the faster axes' sizes). */
static void axes(const moe_grid *g, int expert, int size[AX_COUNT], int stride[AX_COUNT]) {
    size[AX_TP] = expert ? g->etp : g->tp;
    size[AX_CP] = expert ? 1 : g->cp;
    size[AX_EP] = expert ? g->ep : 1;
    size[AX_DP] = expert ? g->edp : g->dp;
    size[AX_PP] = g->pp;
    int d = 1;
    for (int a = 0; a < AX_COUNT; a++) {
        stride[a] = d;
        d *= size[a];
    }
}

/* --------------------------------------------------------------------- validation */

/* a·b·c, stopping once the running product passes the world (so it cannot overflow: the
 * product before each multiplication is at most the world, an int) */
static long long capped_product(int a, int b, int c, int world) {
    long long p = a;
    if (p <= world)
        p *= b;
    if (p <= world)
        p *= c;
    return p;
}

/* "--flag-a A x --flag-b B": the factors of a product, leaving out those equal to 1 (the
 * trainer, which has no flag for them yet, then names only what the user set) */
static void describe(char *out, size_t cap, const char *const names[3], const int v[3]) {
    size_t n = 0;
    out[0] = '\0';
    for (int i = 0; i < 3; i++)
        if (v[i] != 1 && n < cap)
            n += (size_t)snprintf(out + n, cap - n, "%s--%s %d", n ? " x " : "", names[i], v[i]);
    if (!n)
        snprintf(out, cap, "--%s %d", names[0], v[0]);
}

/* One grid's product must divide the world. */
static moe_status check_grid(int world, const char *grid, const char *const names[3],
                             const int v[3], long long *quotient, moe_error *err) {
    char what[320];
    describe(what, sizeof what, names, v);
    long long p = capped_product(v[0], v[1], v[2], world);
    if (p > world)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "%s needs more than the %d rank(s) of this run (the %s grid): run "
                             "with more ranks or choose smaller sizes",
                             what, world, grid);
    if (world % p != 0)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "the %d rank(s) of this run do not split into %s = %lld (the %s "
                             "grid): run with a multiple of %lld ranks (mpirun -np %lld ...) or "
                             "change the sizes",
                             world, what, p, grid, p, p);
    *quotient = world / p;
    return MOE_OK;
}

moe_status moe_grid_resolve(moe_grid *g, moe_error *err) {
    if (g->world < 1)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "a world of %d ranks: a run has at least 1 rank", g->world);
    const char *const flags[5] = {"tensor-model-parallel-size", "context-parallel-size",
                                  "expert-model-parallel-size", "expert-tensor-parallel-size",
                                  "pipeline-model-parallel-size"};
    const int sizes[5] = {g->tp, g->cp, g->ep, g->etp, g->pp};
    for (int i = 0; i < 5; i++)
        if (sizes[i] < 1)
            return moe_error_set(err, MOE_ERR_CONFIG,
                                 "--%s %d: a parallel size is at least 1 (1 = not split)",
                                 flags[i], sizes[i]);
    const char *const dense[3] = {flags[0], flags[1], flags[4]};
    const char *const expert[3] = {flags[3], flags[2], flags[4]};
    const int dv[3] = {g->tp, g->cp, g->pp}, ev[3] = {g->etp, g->ep, g->pp};
    long long dp, edp;
    MOE_TRY(check_grid(g->world, "attention/dense", dense, dv, &dp, err));
    MOE_TRY(check_grid(g->world, "expert", expert, ev, &edp, err));
    g->dp = (int)dp;
    g->edp = (int)edp;
    return MOE_OK;
}

/* --------------------------------------------------------------------- groups */

void moe_grid_group(const moe_grid *g, moe_group_kind kind, int rank, moe_group *out,
                    int *members) {
    int size[AX_COUNT], stride[AX_COUNT], coord[AX_COUNT];
    axes(g, KINDS[kind].expert, size, stride);
    const unsigned in = KINDS[kind].axes;
    /* the rank's coordinates; its position is its coordinates on the kind's axes read as a
     * mixed-radix number (fastest axis first), the group's number those outside the kind */
    out->kind = kind;
    out->size = 1;
    out->rank = 0;
    out->index = 0;
    out->count = 1;
    for (int a = 0; a < AX_COUNT; a++) {
        coord[a] = rank / stride[a] % size[a];
        if (in & AX(a)) {
            out->rank += coord[a] * out->size;
            out->size *= size[a];
        } else {
            out->index += coord[a] * out->count;
            out->count *= size[a];
        }
    }
    if (!members)
        return;
    /* member i: the rank with the coordinates of i on the kind's axes and ours elsewhere */
    for (int i = 0; i < out->size; i++) {
        int r = rank, rest = i;
        for (int a = 0; a < AX_COUNT; a++)
            if (in & AX(a)) {
                r += (rest % size[a] - coord[a]) * stride[a];
                rest /= size[a];
            }
        members[i] = r;
    }
}

/* The (stride, size) of each axis of the kind that has more than one rank. Two kinds with
 * the same list have the same groups, in the same order (a member is the rank moved along
 * exactly these axes), so they can share one communicator. Returns the list's length. */
static int signature(const moe_grid *g, moe_group_kind kind, int sig[2 * AX_COUNT]) {
    int size[AX_COUNT], stride[AX_COUNT], n = 0;
    axes(g, KINDS[kind].expert, size, stride);
    for (int a = 0; a < AX_COUNT; a++)
        if ((KINDS[kind].axes & AX(a)) && size[a] > 1) {
            sig[n++] = stride[a];
            sig[n++] = size[a];
        }
    return n;
}

/* An earlier kind whose communicator this kind can share, or -1. */
static int same_groups(const moe_parallel *p, moe_group_kind kind) {
    int a[2 * AX_COUNT], b[2 * AX_COUNT];
    int n = signature(&p->grid, kind, a);
    for (int k = 0; k < (int)kind; k++)
        if (p->comm[k] && signature(&p->grid, (moe_group_kind)k, b) == n &&
            !memcmp(a, b, sizeof(int) * (size_t)n))
            return k;
    return -1;
}

moe_status moe_parallel_create(moe_parallel *p, struct moe_comm *world, const moe_grid *g,
                               moe_error *err) {
    memset(p, 0, sizeof *p);
    const int W = world ? moe_comm_size(world) : 1;
    if (g->world != W)
        return moe_error_set(err, MOE_ERR_CONFIG,
                             "a parallel grid of %d ranks for a run of %d (internal: set "
                             "moe_grid.world to the world's size)",
                             g->world, W);
    p->grid = *g;
    MOE_TRY(moe_grid_resolve(&p->grid, err));
    p->world = world;
    p->rank = world ? moe_comm_rank(world) : 0;
    /* Every rank walks the kinds in the same order and takes the same branch for each (the
     * branches depend on the grid only), so the collective splits line up. */
    for (int k = 0; k < MOE_GROUP_COUNT; k++) {
        moe_group grp;
        moe_grid_group(&p->grid, (moe_group_kind)k, p->rank, &grp, NULL);
        if (grp.size == 1)
            continue; /* nothing to communicate */
        if (grp.size == W) {
            p->comm[k] = world; /* every rank, in world order */
            continue;
        }
        int same = same_groups(p, (moe_group_kind)k);
        if (same >= 0) {
            p->comm[k] = p->comm[same];
            continue;
        }
        moe_status s = moe_comm_split(world, grp.index, grp.rank, &p->comm[k], err);
        if (s != MOE_OK) {
            moe_parallel_free(p);
            return s;
        }
        p->owned[k] = 1;
    }
    return MOE_OK;
}

struct moe_comm *moe_parallel_group(const moe_parallel *p, moe_group_kind kind) {
    return p->comm[kind];
}

void moe_parallel_free(moe_parallel *p) {
    for (int k = 0; k < MOE_GROUP_COUNT; k++)
        if (p->owned[k])
            moe_comm_free(p->comm[k]);
    memset(p, 0, sizeof *p);
}

/* ------------------------------------------------------------------ printing */

/* The kinds of a rank's coordinates: one axis each, attention grid then expert grid. */
static const moe_group_kind AXES[] = {MOE_GROUP_TP, MOE_GROUP_CP, MOE_GROUP_DP, MOE_GROUP_PP,
                                      MOE_GROUP_ETP, MOE_GROUP_EP, MOE_GROUP_EDP};
#define N_AXES ((int)(sizeof AXES / sizeof AXES[0]))

/* " [a b c]" into buf (snprintf's contract); returns the length it needs. */
static int format_members(char *buf, size_t size, const int *members, int n) {
    int len = snprintf(buf, size, " [");
    for (int i = 0; i < n; i++)
        len += snprintf(buf + ((size_t)len < size ? (size_t)len : size),
                        (size_t)len < size ? size - (size_t)len : 0, i ? " %d" : "%d",
                        members[i]);
    len += snprintf(buf + ((size_t)len < size ? (size_t)len : size),
                    (size_t)len < size ? size - (size_t)len : 0, "]");
    return len;
}

int moe_grid_print_group(FILE *f, const int *members, int n, int column) {
    char buf[32];
    const int width = format_members(buf, sizeof buf, members, n);
    if (column > 26 && column + width > 100) {
        fprintf(f, "\n%26s", "");
        column = 26;
    }
    fprintf(f, " [");
    for (int i = 0; i < n; i++)
        fprintf(f, i ? " %d" : "%d", members[i]);
    fprintf(f, "]");
    return column + width;
}

void moe_grid_print_all(FILE *f, const moe_grid *g) {
    int *members = malloc(sizeof(int) * (size_t)g->world);
    int *printed = malloc(sizeof(int) * (size_t)g->world);
    if (!members || !printed) {
        free(members);
        free(printed);
        return;
    }
    fprintf(f, "  %-6s %5s %6s  (what it is for), then each group's ranks in group order\n",
            "group", "size", "groups");
    for (int k = 0; k < MOE_GROUP_COUNT; k++) {
        if (k == MOE_GROUP_ETP)
            fprintf(f, "expert grid:\n");
        else if (k == 0)
            fprintf(f, "attention/dense grid:\n");
        moe_group grp;
        moe_grid_group(g, (moe_group_kind)k, 0, &grp, NULL);
        fprintf(f, "  %-6s %5d %6d  (%s)\n%26s", KINDS[k].name, grp.size, grp.count,
                KINDS[k].about, "");
        for (int i = 0; i < grp.count; i++)
            printed[i] = 0;
        int column = 26;
        /* each group once, printed by the first rank that is in it */
        for (int r = 0; r < g->world; r++) {
            moe_grid_group(g, (moe_group_kind)k, r, &grp, members);
            if (!printed[grp.index]) {
                printed[grp.index] = 1;
                column = moe_grid_print_group(f, members, grp.size, column);
            }
        }
        fprintf(f, "\n");
    }
    /* each rank's coordinates: its position in the group of each axis */
    fprintf(f, "\nrank    tp   cp   dp   pp |  etp   ep  edp   (its position in each group)\n");
    for (int r = 0; r < g->world; r++) {
        fprintf(f, "%4d ", r);
        for (int a = 0; a < N_AXES; a++) {
            moe_group grp;
            moe_grid_group(g, AXES[a], r, &grp, NULL);
            fprintf(f, "%s%4d", AXES[a] == MOE_GROUP_ETP ? " | " : " ", grp.rank);
        }
        fprintf(f, "\n");
    }
    free(members);
    free(printed);
}

void moe_grid_print_rank(FILE *f, const moe_grid *g, int rank) {
    int *members = malloc(sizeof(int) * (size_t)g->world);
    if (!members)
        return;
    fprintf(f, "rank %d:\n", rank);
    for (int k = 0; k < MOE_GROUP_COUNT; k++) {
        moe_group grp;
        moe_grid_group(g, (moe_group_kind)k, rank, &grp, members);
        fprintf(f, "  %-6s group %3d of %3d, position %3d:", KINDS[k].name, grp.index, grp.count,
                grp.rank);
        moe_grid_print_group(f, members, grp.size, 40);
        fprintf(f, "\n");
    }
    free(members);
}

int moe_grid_print_rank_line(const moe_grid *g, int rank, char *buf, size_t size) {
    int *members = malloc(sizeof(int) * (size_t)g->world);
    if (!members)
        return snprintf(buf, size, "rank %d: (out of memory)", rank);
    size_t len = (size_t)snprintf(buf, size, "rank %d:", rank);
    for (int a = 0; a < N_AXES; a++) {
        moe_group grp;
        moe_grid_group(g, AXES[a], rank, &grp, members);
        const size_t at = len < size ? len : size;
        len += (size_t)snprintf(buf + at, size - at, "%s %s", AXES[a] == MOE_GROUP_ETP ? " |" : "",
                                KINDS[AXES[a]].name);
        const size_t at2 = len < size ? len : size;
        len += (size_t)format_members(buf + at2, size - at2, members, grp.size);
    }
    free(members);
    return (int)len;
}
