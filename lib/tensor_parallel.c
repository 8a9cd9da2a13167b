/* Megatron's tensor-parallel operators f and g and their sequence-parallel versions: see
 * tensor_parallel.h. Each is one collective of comm.h on the TP group, or nothing when the
 * group is one rank. */
#include "tensor_parallel.h"

#include "comm.h"

moe_tp moe_tp_none(void) {
    moe_tp t = {NULL, 1, 0, 0};
    return t;
}

/* a group with something to communicate */
static int split(const moe_tp *tp) { return tp && tp->comm && tp->size > 1; }
static int seq(const moe_tp *tp) { return split(tp) && tp->sp; }

int moe_tp_local_rows(const moe_tp *tp, int N) {
    if (!seq(tp))
        return N;
    MOE_ASSERT(N % tp->size == 0);
    return N / tp->size;
}

int moe_tp_first_row(const moe_tp *tp, int N) {
    return seq(tp) ? tp->rank * moe_tp_local_rows(tp, N) : 0;
}

const void *moe_tp_f_forward(const moe_tp *tp, const void *x) {
    (void)tp;
    return x;
}

void moe_tp_f_backward(const moe_backend *be, const moe_tp *tp, void *dx, size_t n) {
    if (split(tp))
        moe_comm_all_reduce_sum(tp->comm, dx, n, moe_dtype_act(be));
}

void moe_tp_g_forward(const moe_backend *be, const moe_tp *tp, void *y, size_t n) {
    if (split(tp))
        moe_comm_all_reduce_sum(tp->comm, y, n, moe_dtype_act(be));
}

const void *moe_tp_g_backward(const moe_tp *tp, const void *dy) {
    (void)tp;
    return dy;
}

void moe_tp_sp_gather_forward(const moe_backend *be, const moe_tp *tp, void *full,
                              const void *shard, int rows, int C) {
    moe_comm_all_gather(tp->comm, shard, full, (size_t)rows * C, moe_dtype_act(be));
}

void moe_tp_sp_gather_backward(const moe_backend *be, const moe_tp *tp, void *dshard,
                               const void *dfull, int rows, int C) {
    moe_comm_reduce_scatter_sum(tp->comm, dfull, dshard, (size_t)rows * C, moe_dtype_act(be));
}

void moe_tp_sp_scatter_forward(const moe_backend *be, const moe_tp *tp, void *shard,
                               const void *full, int rows, int C) {
    moe_comm_reduce_scatter_sum(tp->comm, full, shard, (size_t)rows * C, moe_dtype_act(be));
}

void moe_tp_sp_scatter_backward(const moe_backend *be, const moe_tp *tp, void *dfull,
                                const void *dshard, int rows, int C) {
    moe_comm_all_gather(tp->comm, dshard, dfull, (size_t)rows * C, moe_dtype_act(be));
}

const void *moe_tp_enter_forward(const moe_backend *be, const moe_tp *tp, void *full,
                                 const void *x, int N, int C) {
    if (!seq(tp))
        return moe_tp_f_forward(tp, x);
    moe_tp_sp_gather_forward(be, tp, full, x, moe_tp_local_rows(tp, N), C);
    return full;
}

void moe_tp_enter_backward(const moe_backend *be, const moe_tp *tp, void *dx, void *dfull,
                           int N, int C) {
    if (seq(tp)) {
        moe_tp_sp_gather_backward(be, tp, dx, dfull, moe_tp_local_rows(tp, N), C);
        return;
    }
    MOE_ASSERT(dx == dfull);
    moe_tp_f_backward(be, tp, dx, (size_t)N * C);
}

void moe_tp_exit_forward(const moe_backend *be, const moe_tp *tp, void *y, void *partial, int N,
                         int C) {
    if (seq(tp)) {
        moe_tp_sp_scatter_forward(be, tp, y, partial, moe_tp_local_rows(tp, N), C);
        return;
    }
    MOE_ASSERT(y == partial);
    moe_tp_g_forward(be, tp, y, (size_t)N * C);
}

const void *moe_tp_exit_backward(const moe_backend *be, const moe_tp *tp, void *full,
                                 const void *dy, int N, int C) {
    if (!seq(tp))
        return moe_tp_g_backward(tp, dy);
    moe_tp_sp_scatter_backward(be, tp, full, dy, moe_tp_local_rows(tp, N), C);
    return full;
}
