/**
 * @file provenance.h
 * @brief Where a measurement came from: the commit and the date, for benchmark tables.
 */
#ifndef MOE_PROVENANCE_H
#define MOE_PROVENANCE_H

#include <stddef.h>

/**
 * @brief The short commit hash of the working tree: the environment variable
 *        MOE_GIT_COMMIT when set (on a machine the sources were copied to, whose .git may be
 *        missing or stale), else `git rev-parse --short HEAD`, else "unknown".
 * @param buf receives the hash  @param cap its capacity
 */
void moe_git_commit(char *buf, size_t cap);

/** @brief The current UTC date and time as "YYYY-MM-DD HH:MM UTC". @param buf receives it @param cap its capacity */
void moe_utc_date(char *buf, size_t cap);

#endif /* MOE_PROVENANCE_H */
