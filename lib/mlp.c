/* The SwiGLU MLP, one or a group of them: see mlp.h. */
#include "mlp.h"

void moe_mlp_forward_grouped(const moe_backend *be, void *out, void *gu, void *act, void *h,
                             const void *x, const moe_real *row_scale, const void *w1,
                             const void *w2, const int *off, int G, int H, int F) {
    const int N = off[G];
    if (N == 0)
        return;
    be->grouped_matmul_forward(gu, x, w1, off, G, H, 2 * F);
    be->swiglu_forward(act, gu, N, F);
    const void *fc2_in = act;
    if (row_scale) {
        be->copy(h, act, be->act_size * (size_t)N * F);
        be->scale_rows(h, row_scale, N, F);
        fc2_in = h;
    }
    be->grouped_matmul_forward(out, fc2_in, w2, off, G, F, H);
}

void moe_mlp_backward_grouped(const moe_backend *be, void *dx, moe_real *dw1, moe_real *dw2,
                              moe_real *drow_scale, const void *dout, const void *x,
                              const void *gu, const void *act, const moe_real *row_scale,
                              const void *w1, const void *w2, void *ws_h, void *ws_dh,
                              void *ws_dgu, const int *off, int G, int H, int F) {
    const int N = off[G];
    if (N == 0)
        return;
    const size_t nf = (size_t)N * F;
    /* fc2: its input was act (dense) or act ⊙ row_scale (routed expert) */
    const void *fc2_in = act;
    if (row_scale) {
        be->copy(ws_h, act, be->act_size * nf);
        be->scale_rows(ws_h, row_scale, N, F);
        fc2_in = ws_h;
    }
    be->zero(ws_dh, be->act_size * nf);
    be->grouped_matmul_backward(ws_dh, dw2, dout, fc2_in, w2, off, G, F, H);
    /* through the row scale: d(scale) = Σ dh ⊙ act, d(act) = dh ⊙ scale */
    if (row_scale) {
        be->row_dot(drow_scale, ws_dh, act, N, F);
        be->scale_rows(ws_dh, row_scale, N, F);
    }
    be->zero(ws_dgu, be->act_size * 2 * nf);
    be->swiglu_backward(ws_dgu, ws_dh, gu, N, F);
    be->grouped_matmul_backward(dx, dw1, ws_dgu, x, w1, off, G, H, 2 * F);
}

void moe_mlp_forward(const moe_backend *be, void *out, void *gu, void *act, void *h, const void *x,
                     const moe_real *row_scale, const void *w1, const void *w2, int N, int H,
                     int F) {
    const int off[2] = {0, N};
    moe_mlp_forward_grouped(be, out, gu, act, h, x, row_scale, w1, w2, off, 1, H, F);
}

void moe_mlp_backward(const moe_backend *be, void *dx, moe_real *dw1, moe_real *dw2,
                      moe_real *drow_scale, const void *dout, const void *x, const void *gu,
                      const void *act, const moe_real *row_scale, const void *w1, const void *w2,
                      void *ws_h, void *ws_dh, void *ws_dgu, int N, int H, int F) {
    const int off[2] = {0, N};
    moe_mlp_backward_grouped(be, dx, dw1, dw2, drow_scale, dout, x, gu, act, row_scale, w1, w2,
                             ws_h, ws_dh, ws_dgu, off, 1, H, F);
}
