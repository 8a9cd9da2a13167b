/* Commit and date for benchmark tables: see provenance.h. */
#include "provenance.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void moe_git_commit(char *buf, size_t cap) {
    /* an explicit MOE_GIT_COMMIT wins: a copied tree may carry a stale .git */
    const char *env = getenv("MOE_GIT_COMMIT");
    if (env && *env) {
        snprintf(buf, cap, "%s", env);
        return;
    }
    buf[0] = '\0';
    FILE *p = popen("git rev-parse --short HEAD 2>/dev/null", "r");
    if (p) {
        if (fgets(buf, (int)cap, p))
            buf[strcspn(buf, "\n")] = '\0';
        pclose(p);
    }
    if (!buf[0])
        snprintf(buf, cap, "unknown");
}

void moe_utc_date(char *buf, size_t cap) {
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(buf, cap, "%Y-%m-%d %H:%M UTC", &tm);
}
