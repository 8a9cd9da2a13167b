/* Wall-clock timers: see timer.h. */
#define _POSIX_C_SOURCE 200809L
#include "timer.h"

#include <time.h>

double moe_time_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void moe_timer_start(moe_timer *t) { t->t0 = moe_time_now(); }

double moe_timer_elapsed(const moe_timer *t) { return moe_time_now() - t->t0; }
