/* Rank-aware logging: see log.h. */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>

static int g_rank = 0, g_world = 1, g_quiet = 0;

void moe_log_set_rank(int rank, int world_size) {
    g_rank = rank;
    g_world = world_size;
}

void moe_log_set_quiet(int quiet) { g_quiet = quiet; }

static void vlog(FILE *f, const char *level, const char *fmt, va_list ap) {
    if (g_world > 1)
        fprintf(f, "[rank %d] ", g_rank);
    if (level)
        fprintf(f, "%s: ", level);
    vfprintf(f, fmt, ap);
    fputc('\n', f);
    fflush(f);
}

void moe_log_info(const char *fmt, ...) {
    if (g_rank != 0 || g_quiet)
        return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stdout, fmt, ap);
    fputc('\n', stdout);
    fflush(stdout);
    va_end(ap);
}

void moe_log_warn(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vlog(stderr, "warning", fmt, ap);
    va_end(ap);
}

void moe_log_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vlog(stderr, "error", fmt, ap);
    va_end(ap);
}
