/**
 * @file capacity.h
 * @brief Expert capacity and token dropping (chapter 02).
 *
 * With --moe-expert-capacity-factor each expert accepts at most
 * capacity = ceil(N·k/E · factor) of a rank's N tokens; the rest are dropped: their expert
 * output is zero and their routing weight gets no gradient. Policy "probs" keeps an
 * expert's highest-weight assignments, "position" the earliest. A dropped assignment keeps
 * its place but gets the expert id E (one past the last), so the permutation sorts it
 * into an extra bucket that is never sent.
 *
 * With --moe-pad-expert-input-to-capacity every expert receives exactly capacity rows from
 * every rank (zero rows fill the gap), so every split of the all-to-all is static: the
 * send layout is E·capacity rows, and two maps lead between it and the permuted rows.
 */
#ifndef MOE_CAPACITY_H
#define MOE_CAPACITY_H

#include "backend.h"

typedef struct moe_layer_dims moe_layer_dims;
typedef struct moe_layer_acts moe_layer_acts;

/**
 * @brief Capacity of one expert for @p N tokens: ceil(N·k/E · factor), at most @p N (an
 *        expert never receives more than N rows, so a larger capacity drops nothing; the
 *        bound also keeps the padded layout E·capacity rows from overflowing).
 * @param N tokens @param k top-k @param E experts @param factor capacity factor (> 0)
 * @return rows, in [0, N]
 */
int moe_expert_capacity(int N, int k, int E, double factor);

/**
 * @brief Apply a capacity to a routing (host arrays). Dropped assignments get the expert id
 *        @p E (one past the last), which the permutation sorts to the end.
 * @param dispatch_idx [N·k] receives the routing with drops  @param topk_idx [N·k] routing
 * @param topk_w [N·k] routing weights (for ::MOE_DROP_PROBS)  @param N tokens  @param k top-k
 * @param E experts  @param capacity rows per expert
 * @param policy which assignments an expert over capacity keeps: ::MOE_DROP_POSITION the
 *        earliest, ::MOE_DROP_PROBS the highest weights (ties: earliest)
 * @return the number of dropped assignments
 */
long long moe_apply_capacity(int *dispatch_idx, const int *topk_idx, const moe_real *topk_w, int N,
                             int k, int E, int capacity, moe_drop_policy policy);

/**
 * @brief A layer's routing on the host, where the dispatchers that send rows need it: the
 *        per-expert counts for the statistics (a->counts), and the capacity decision
 *        (a->dropped; @p didx = the routing with dropped assignments sent to expert E).
 * @param be backend @param d dims (capacity_factor, drop_policy) @param a the layer's
 *        saved state (topk_idx/topk_w read; host_idx, host_w, counts, dropped written)
 * @param didx host [N·k] receives the routing with drops
 * @return the capacity, or 0 when dropless
 */
int moe_capacity_route(const moe_backend *be, const moe_layer_dims *d, moe_layer_acts *a,
                       int *didx);

/**
 * @brief The padded send layout: expert e's slots are [e·cap, (e+1)·cap), its kept rows
 *        first, then zero rows.
 * @param send host [E·cap] receives send row → permuted row (−1: a zero row)
 * @param unpad host [Σ counts] receives permuted row → send row
 * @param counts host [E] kept rows per expert (each ≤ cap) @param E experts @param cap capacity
 */
void moe_capacity_pad_maps(int *send, int *unpad, const long long *counts, int E, int cap);

#endif /* MOE_CAPACITY_H */
