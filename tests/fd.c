/* Finite-difference gradient checking: see fd.h. */
#include "fd.h"

#include <math.h>
#include <stdio.h>

double fd_dot(const moe_real *r, const moe_real *y, size_t n) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++)
        s += (double)r[i] * y[i];
    return s;
}

double fd_check(const char *what, fd_loss_fn loss, void *ctx, moe_real *x, const moe_real *grad,
                size_t n, int max_checks, double tol) {
    const double eps = 1e-5;
    double gmax = 0.0;
    for (size_t i = 0; i < n; i++)
        gmax = fmax(gmax, fabs((double)grad[i]));
    const double floor = fmax(1e-3 * gmax, 1e-12);
    size_t stride = n <= (size_t)max_checks ? 1 : n / (size_t)max_checks;
    double worst = 0.0;
    size_t worst_i = 0;
    double worst_a = 0, worst_b = 0;
    for (size_t i = 0; i < n; i += stride) {
        moe_real saved = x[i];
        x[i] = saved + eps;
        double lp = loss(ctx);
        x[i] = saved - eps;
        double lm = loss(ctx);
        x[i] = saved;
        double num = (lp - lm) / (2 * eps);
        double err = fabs(num - grad[i]) / fmax(fabs(num), floor);
        if (!(err <= worst)) { /* NaN also lands here */
            worst = isnan(err) ? INFINITY : err;
            worst_i = i;
            worst_a = grad[i];
            worst_b = num;
        }
    }
    if (!(worst <= tol))
        fprintf(stderr, "gradcheck %s: worst rel err %.3e at [%zu]: analytic %.10e vs numeric %.10e\n",
                what, worst, worst_i, worst_a, worst_b);
    return worst;
}
