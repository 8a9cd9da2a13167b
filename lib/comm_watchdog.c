/*
 * The communication watchdog (comm_watchdog.h): one thread that ends the job when a
 * communication operation fails or does not complete within MOE_COMM_TIMEOUT seconds.
 *
 * Why a thread. A collective is a promise that every rank takes part. If a peer never
 * arrives (it crashed, it hangs, it passed different counts), the operation never
 * completes, and whoever waits for it waits forever: the classic distributed hang. The
 * NCCL transport enqueues collectives on the CUDA stream and returns (so communication
 * can overlap compute, and later be captured in a CUDA graph); the host may block much
 * later, in any cudaStreamSynchronize, with no idea which collective it is stuck
 * behind. MPI's blocking calls have no deadline at all. So nobody on the main thread can
 * be trusted to notice; a thread of its own that looks at "operation X in flight since
 * t" can. This is what PyTorch's ProcessGroupNCCL watchdog does.
 *
 * The record. Each watch is a ring of `depth` slots; the operations in flight are the
 * slots [head, tail), oldest first (a stream and the main thread both complete their
 * operations in order). The main thread appends at the tail; `done` (or
 * moe_comm_watch_end) retires from the head. Only the oldest operation can be late, so
 * the deadline check looks at the head alone. Note that an operation enqueued on a
 * stream also waits for all the work queued before it, so for NCCL the deadline bounds
 * "compute + communication" — which is why the default is a generous 600 s.
 *
 * How the job ends. The watchdog prints the rank's message, calls the watch's `abort`
 * hook (ncclCommAbort, which frees the peers blocked in the same communicator), and
 * ends the process with _exit(1). It does not call MPI_Abort: MPI was started
 * MPI_THREAD_FUNNELED (only the main thread calls MPI), and the main thread may be inside
 * MPI right now. mpirun treats a rank that exits with a non-zero status without
 * MPI_Finalize as a failed job and kills every other rank (Open MPI's default, the
 * message "mpirun has detected that one or more processes exited with non-zero
 * status"); under Slurm's srun, pass --kill-on-bad-exit=1 for the same. _exit rather than
 * exit: exit would run atexit handlers (MPI's among them) from this thread, while the
 * main thread is still running.
 */
#include "comm_watchdog.h"
#include "comm.h"

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

struct moe_comm_watch {
    moe_comm_watch_hooks hooks;
    void *ctx;
    int world_rank, depth;
    const char **op;        /* [depth] what each slot's operation is */
    double *since;          /* [depth] when it entered the ring */
    unsigned long head, tail; /* in flight: [head, tail), slot = index % depth */
    moe_comm_watch *next;   /* the next watch of the process */
};

/* Everything below is shared by the main thread and the watchdog thread. */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_wake = PTHREAD_COND_INITIALIZER; /* "stop" for the thread */
static moe_comm_watch *g_watches;
static pthread_t g_thread;
static int g_running, g_stop;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The program's deadline (--distributed-timeout-minutes); MOE_COMM_TIMEOUT, read once, wins
 * over it so that tests can shorten the deadline of any program. */
static double g_timeout_s = 300.0;

void moe_comm_set_timeout_s(double seconds) {
    if (seconds > 0 && isfinite(seconds))
        g_timeout_s = seconds;
}

static double g_env_s = -1; /* MOE_COMM_TIMEOUT: -1 not read yet, 0 not set */

double moe_comm_timeout_s(void) {
    double env = g_env_s;
    if (env < 0) {
        const char *s = getenv("MOE_COMM_TIMEOUT");
        char *end = NULL;
        double v = s ? strtod(s, &end) : 0;
        env = g_env_s = (s && end != s && *end == '\0' && v > 0 && isfinite(v)) ? v : 0;
    }
    return env > 0 ? env : g_timeout_s;
}

/* Which setting the deadline came from, for the message. */
static const char *moe_comm_timeout_source(void) {
    return g_env_s > 0 ? "MOE_COMM_TIMEOUT" : "--distributed-timeout-minutes";
}

/* The end: the message, the channel released, the process gone (see the top). */
static void fail(moe_comm_watch *w, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3), noreturn))
#endif
    ;
static void fail(moe_comm_watch *w, const char *fmt, ...) {
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "[rank %d] %s\n", w->world_rank, msg);
    fflush(stdout);
    fflush(stderr);
    if (w->hooks.abort)
        w->hooks.abort(w->ctx);
    _exit(1);
}

/* Retire the operations that completed, oldest first; then fail on an error or on the
 * deadline. Called with g_lock held. */
static void check(moe_comm_watch *w, double now) {
    char msg[512];
    while (w->head < w->tail && w->hooks.done) {
        const int slot = (int)(w->head % (unsigned long)w->depth);
        int r = w->hooks.done(w->ctx, slot, w->op[slot], msg, sizeof msg);
        if (r < 0)
            fail(w, "%s", msg);
        if (r == 0)
            break;
        w->head++;
    }
    if (w->head == w->tail)
        return;
    const int slot = (int)(w->head % (unsigned long)w->depth);
    if (w->hooks.failed && w->hooks.failed(w->ctx, w->op[slot], msg, sizeof msg) < 0)
        fail(w, "%s", msg);
    const double limit = moe_comm_timeout_s();
    if (now - w->since[slot] > limit)
        fail(w,
             "fatal: %s did not complete within %.0f s (%s): a peer rank is "
             "missing or passed different counts",
             w->op[slot], limit, moe_comm_timeout_source());
}

static void *watchdog_main(void *arg) {
    (void)arg;
    /* a few looks per deadline, at most 10 a second: the cost is nothing */
    double period = moe_comm_timeout_s() / 20;
    if (period > 0.1)
        period = 0.1;
    pthread_mutex_lock(&g_lock);
    while (!g_stop) {
        for (moe_comm_watch *w = g_watches; w; w = w->next)
            check(w, now_s());
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until); /* the condition variable's clock */
        long ns = until.tv_nsec + (long)(period * 1e9);
        until.tv_sec += ns / 1000000000L;
        until.tv_nsec = ns % 1000000000L;
        pthread_cond_timedwait(&g_wake, &g_lock, &until);
    }
    pthread_mutex_unlock(&g_lock);
    return NULL;
}

moe_comm_watch *moe_comm_watch_open(const moe_comm_watch_hooks *hooks, void *ctx, int world_rank,
                                    int depth) {
    moe_comm_watch *w = calloc(1, sizeof *w);
    if (w) {
        w->op = calloc((size_t)depth, sizeof *w->op);
        w->since = calloc((size_t)depth, sizeof *w->since);
    }
    if (!w || !w->op || !w->since) {
        fprintf(stderr, "[rank %d] fatal: out of host memory for the communication watchdog\n",
                world_rank);
        exit(1);
    }
    w->hooks = *hooks;
    w->ctx = ctx;
    w->world_rank = world_rank;
    w->depth = depth;
    (void)moe_comm_timeout_s(); /* read the environment here, on the main thread */
    pthread_mutex_lock(&g_lock);
    w->next = g_watches;
    g_watches = w;
    if (!g_running) {
        /* signals (Ctrl-C, mpirun's SIGTERM) stay with the main thread: the new thread
         * starts with all of them blocked */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        g_stop = 0;
        int rc = pthread_create(&g_thread, NULL, watchdog_main, NULL);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (rc != 0) {
            fprintf(stderr, "[rank %d] fatal: cannot start the communication watchdog thread\n",
                    world_rank);
            exit(1);
        }
        g_running = 1;
    }
    pthread_mutex_unlock(&g_lock);
    return w;
}

void moe_comm_watch_close(moe_comm_watch *w) {
    if (!w)
        return;
    pthread_mutex_lock(&g_lock);
    for (moe_comm_watch **p = &g_watches; *p; p = &(*p)->next)
        if (*p == w) {
            *p = w->next;
            break;
        }
    const int last = g_running && !g_watches;
    if (last) {
        g_stop = 1;
        g_running = 0;
        pthread_cond_signal(&g_wake);
    }
    pthread_mutex_unlock(&g_lock);
    if (last)
        pthread_join(g_thread, NULL);
    free(w->op);
    free(w->since);
    free(w);
}

int moe_comm_watch_slot(moe_comm_watch *w) {
    pthread_mutex_lock(&g_lock);
    /* all slots in flight: retire what completed; if nothing did, let the GPU (or the
     * peers) catch up. The watchdog keeps checking the deadline meanwhile. */
    while (w->tail - w->head >= (unsigned long)w->depth) {
        check(w, now_s());
        if (w->tail - w->head < (unsigned long)w->depth)
            break;
        pthread_mutex_unlock(&g_lock);
        sched_yield();
        pthread_mutex_lock(&g_lock);
    }
    const int slot = (int)(w->tail % (unsigned long)w->depth);
    pthread_mutex_unlock(&g_lock);
    return slot;
}

void moe_comm_watch_begin(moe_comm_watch *w, const char *op) {
    const int slot = moe_comm_watch_slot(w); /* the same slot, when the caller asked first */
    const double t = now_s();
    pthread_mutex_lock(&g_lock);
    w->op[slot] = op;
    w->since[slot] = t;
    w->tail++;
    pthread_mutex_unlock(&g_lock);
}

void moe_comm_watch_end(moe_comm_watch *w) {
    pthread_mutex_lock(&g_lock);
    if (w->tail > w->head)
        w->tail--;
    pthread_mutex_unlock(&g_lock);
}

void moe_comm_watch_clear(moe_comm_watch *w) {
    pthread_mutex_lock(&g_lock);
    w->head = w->tail;
    pthread_mutex_unlock(&g_lock);
}
