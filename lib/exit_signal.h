/**
 * @file exit_signal.h
 * @brief `--exit-signal-handler`: turn SIGINT/SIGTERM into "save and stop at the next step".
 *
 * A scheduler preempts a job with SIGTERM (Slurm, Kubernetes), a person with Ctrl-C. Dying
 * at once loses every step since the last checkpoint; the handler instead only records
 * that the signal came (a signal handler may do almost nothing else safely), and the
 * training loop asks at each step boundary, saves a checkpoint and exits 0. Under MPI the
 * signal may reach the ranks at different moments, so they agree on it with a host
 * all-reduce: every rank stops after the same step. The handler is one-shot: a second
 * signal has the default effect, so a second Ctrl-C still kills a run that is stuck.
 */
#ifndef MOE_EXIT_SIGNAL_H
#define MOE_EXIT_SIGNAL_H

#include "comm.h"
#include "error.h"

/**
 * @brief Catch SIGINT and SIGTERM from now on (once each: the next one has its default
 *        effect again).
 * @param err receives the reason on failure
 * @return ::MOE_OK, or ::MOE_ERR_IO when the handler cannot be installed
 */
moe_status moe_exit_signal_install(moe_error *err);

/** @brief The signal caught on this rank since moe_exit_signal_install(), or 0.
 *  @return SIGINT, SIGTERM or 0 */
int moe_exit_signal_caught(void);

/**
 * @brief Whether any rank caught a signal: every rank calls this at the same step boundary
 *        and gets the same answer (a host all-reduce over @p world).
 * @param world all ranks, or NULL for a single process
 * @return 1 when the run should save and stop
 */
int moe_exit_signal_agreed(moe_comm *world);

#endif /* MOE_EXIT_SIGNAL_H */
