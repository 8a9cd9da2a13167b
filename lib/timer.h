/**
 * @file timer.h
 * @brief Wall-clock timers for the host (monotonic clock).
 *
 * CPU work is timed with these; GPU work (later chapters) is timed with CUDA
 * events, because the host returns from a kernel launch long before the
 * kernel finishes.
 */
#ifndef MOE_TIMER_H
#define MOE_TIMER_H

/** @brief Seconds since an arbitrary fixed point (CLOCK_MONOTONIC). @return seconds */
double moe_time_now(void);

/** A stopwatch: start it, read elapsed seconds. */
typedef struct moe_timer {
    double t0; /**< start time in seconds */
} moe_timer;

/** @brief Start (or restart) @p t. @param t the timer */
void moe_timer_start(moe_timer *t);

/** @brief Seconds since moe_timer_start(@p t). @param t the timer @return seconds */
double moe_timer_elapsed(const moe_timer *t);

#endif /* MOE_TIMER_H */
