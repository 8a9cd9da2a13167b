/**
 * @file fd.h
 * @brief Finite-difference gradient checking (built with moe_real = double).
 *
 * A test defines a scalar loss L(θ) — usually Σ r ⊙ f(x) with a fixed random r,
 * which makes every output element matter — computes the analytic gradient with
 * the op's backward, and asks fd_check() to compare it with the central
 * difference (L(θ+ε) − L(θ−ε)) / 2ε on a spread of elements.
 */
#ifndef MOE_TEST_FD_H
#define MOE_TEST_FD_H

#include <stddef.h>

#include "real.h"

/** A scalar loss of whatever state @p ctx points to. */
typedef double (*fd_loss_fn)(void *ctx);

/**
 * Compare @p grad (analytic ∂L/∂x) with central differences, perturbing x in place
 * (restored afterwards). Checks every element when n ≤ max_checks, else max_checks
 * elements spread evenly. Error per element: |a − b| / max(|b|, floor) with
 * floor = 1e-3 · max|grad| (so near-zero entries are judged against the tensor's scale).
 * Prints the worst element when it exceeds @p tol. Returns the worst error.
 */
double fd_check(const char *what, fd_loss_fn loss, void *ctx, moe_real *x, const moe_real *grad,
                size_t n, int max_checks, double tol);

/** Σ r ⊙ y over n elements (r is the fixed random projection). */
double fd_dot(const moe_real *r, const moe_real *y, size_t n);

#endif
