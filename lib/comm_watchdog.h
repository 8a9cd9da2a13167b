/**
 * @file comm_watchdog.h
 * @brief Private to the communication layer: one thread that ends the job when a
 *        communication operation fails or does not complete in time.
 *
 * A *watch* is a queue of the operations in flight on one channel, each with its name and
 * the time it entered the queue: the collectives an NCCL communicator enqueued on the CUDA
 * stream, or the blocking MPI call the main thread is in. One background thread polls
 * every watch a few times a second. When the oldest operation of a watch has been in
 * flight longer than its deadline (moe_comm_timeout_s(): 5 minutes unless
 * --distributed-timeout-minutes or MOE_COMM_TIMEOUT says otherwise), or the channel reports an
 * error, it prints
 *
 *     [rank r] fatal: <op> did not complete within N s (MOE_COMM_TIMEOUT): ...
 *
 * (naming --distributed-timeout-minutes instead when the deadline came from there)
 *
 * releases what the peers may be blocked on (ncclCommAbort), and ends the process with
 * exit status 1 (see comm_watchdog.c for why that ends the whole job).
 *
 * Two ways to use a watch:
 *  - **asynchronous** operations (NCCL): moe_comm_watch_slot() gives the slot of the next
 *    operation, the transport records a completion marker there (a CUDA event), then
 *    moe_comm_watch_begin(). The hooks' `done` says when a slot's operation completed.
 *  - **blocking** calls (MPI): moe_comm_watch_begin() before the call,
 *    moe_comm_watch_end() after it; `done` is NULL.
 */
#ifndef MOE_COMM_WATCHDOG_H
#define MOE_COMM_WATCHDOG_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" { /* kernels/comm_nccl.cu is C++ */
#endif

/** A queue of operations in flight, watched by the watchdog thread (opaque). */
typedef struct moe_comm_watch moe_comm_watch;

/** What the watchdog asks a channel. Each hook may be NULL. Hooks run with the watchdog's
 *  lock held, on the watchdog thread or on the thread that calls moe_comm_watch_slot(). */
typedef struct moe_comm_watch_hooks {
    /** 1 when operation @p op in @p slot has completed, 0 while it runs, -1 when it failed
     *  (the reason in @p msg). NULL: moe_comm_watch_end() ends operations. */
    int (*done)(void *ctx, int slot, const char *op, char *msg, size_t cap);
    /** -1 when the channel failed while @p op was in flight (the reason in @p msg), else 0 */
    int (*failed)(void *ctx, const char *op, char *msg, size_t cap);
    /** before the process ends: release what the peers may be waiting on */
    void (*abort)(void *ctx);
} moe_comm_watch_hooks;

/**
 * @brief Start watching a channel (and, with the first watch, the watchdog thread).
 * @param hooks the channel's hooks (copied) @param ctx passed to the hooks
 * @param world_rank this process's rank, for the message
 * @param depth most operations in flight at once (slots 0 .. depth−1)
 * @return the watch (the process ends with a message if it cannot be made)
 */
moe_comm_watch *moe_comm_watch_open(const moe_comm_watch_hooks *hooks, void *ctx, int world_rank,
                                    int depth);

/** @brief Stop watching (and, with the last watch, stop the thread). Operations still in
 *  flight are forgotten. @param w watch (NULL: no-op) */
void moe_comm_watch_close(moe_comm_watch *w);

/** @brief The slot the next operation will use; waits while all slots are in flight (the
 *  watchdog still bounds that wait). @param w watch @return slot in [0, depth) */
int moe_comm_watch_slot(moe_comm_watch *w);

/** @brief Operation @p op is in flight from now, in the slot moe_comm_watch_slot() gave.
 *  @param w watch @param op its name (a string literal: it is kept) */
void moe_comm_watch_begin(moe_comm_watch *w, const char *op);

/** @brief The newest operation completed (blocking calls). @param w watch */
void moe_comm_watch_end(moe_comm_watch *w);

/** @brief Forget every operation in flight: the caller waited for all of them.
 *  @param w watch */
void moe_comm_watch_clear(moe_comm_watch *w);

/** @brief The deadline of one operation in seconds: MOE_COMM_TIMEOUT when it is set to a
 *  positive number, else what moe_comm_set_timeout_s() (comm.h) set, else 300 (5 minutes).
 *  @return the deadline of one operation */
double moe_comm_timeout_s(void);

#ifdef __cplusplus
}
#endif

#endif /* MOE_COMM_WATCHDOG_H */
