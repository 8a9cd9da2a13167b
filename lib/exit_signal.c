/* The exit signal handler: see exit_signal.h. */
#include "exit_signal.h"

#include <errno.h>
#include <signal.h>
#include <string.h>

/* sig_atomic_t is the one type a handler may write that the program then reads safely */
static volatile sig_atomic_t g_caught;

static void on_signal(int sig) { g_caught = sig; }

moe_status moe_exit_signal_install(moe_error *err) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESETHAND; /* one-shot: the second signal kills */
    if (sigaction(SIGINT, &sa, NULL) != 0 || sigaction(SIGTERM, &sa, NULL) != 0)
        return moe_error_set(err, MOE_ERR_IO, "--exit-signal-handler: cannot install the "
                             "SIGINT/SIGTERM handler: %s", strerror(errno));
    return MOE_OK;
}

int moe_exit_signal_caught(void) { return (int)g_caught; }

int moe_exit_signal_agreed(moe_comm *world) {
    int any = g_caught != 0;
    if (world && moe_comm_size(world) > 1)
        moe_comm_host_all_reduce_sum(world, &any, 1, MOE_DTYPE_I32);
    return any > 0;
}
