/**
 * @file log.h
 * @brief Rank-aware logging.
 *
 * In a distributed job every rank runs the same program; printing from all of
 * them turns the terminal into noise. `moe_log_info` prints on rank 0 only,
 * `moe_log_warn`/`moe_log_error` print on every rank with a `[rank r]` prefix
 * once the world has more than one rank, so a failing rank is always visible.
 */
#ifndef MOE_LOG_H
#define MOE_LOG_H

/** @brief Tell the logger who we are (call once after MPI init; defaults to rank 0 of 1).
 *  @param rank this process's rank
 *  @param world_size number of ranks */
void moe_log_set_rank(int rank, int world_size);

/** @brief Silence moe_log_info (tests use this); warnings and errors still print. @param quiet 1 to silence */
void moe_log_set_quiet(int quiet);

/** @brief Informational message to stdout, rank 0 only. @param fmt printf format */
void moe_log_info(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;

/** @brief Warning to stderr, every rank. @param fmt printf format */
void moe_log_warn(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;

/** @brief Error to stderr, every rank. @param fmt printf format */
void moe_log_error(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;

#endif /* MOE_LOG_H */
