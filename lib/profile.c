/* The opt-in stage timer of the MoE layer: see profile.h. */
#include "profile.h"

#include <string.h>

const char *const moe_prof_stage_names[MOE_PROF_STAGES] = {
    "router", "permute", "expert GEMMs", "expert element-wise", "unpermute", "other"};

static const moe_backend *g_be; /* NULL: off */
static double g_ms[MOE_PROF_STAGES];

void moe_prof_start(const moe_backend *be) {
    g_be = be;
    if (be) {
        memset(g_ms, 0, sizeof g_ms);
        be->timer_begin();
    }
}

void moe_prof_mark(moe_prof_stage stage) {
    if (!g_be)
        return;
    g_ms[stage] += g_be->timer_end_ms();
    g_be->timer_begin();
}

const double *moe_prof_ms(void) { return g_ms; }
