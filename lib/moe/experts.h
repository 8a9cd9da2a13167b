/**
 * @file experts.h
 * @brief Step 4 of the MoE layer: the local experts on their rows, with the expert
 *        compute backend as a switch (chapters 01 and 03).
 *
 * The rows are expert-contiguous: local expert e (weights e of fc1/fc2) owns rows
 * [off[e], off[e+1]). Where they are is the dispatcher's business (dispatch.h): the
 * permuted rows themselves on one rank, or the expert-side rows the dispatcher filled.
 * How they run (--moe-expert-backend, ::moe_expert_impl):
 *  - the loop (chapter 01): one SwiGLU MLP per expert, each GEMM sized by a host count —
 *    2·E small GEMMs forward and 4·E backward;
 *  - cuBLAS's grouped GEMM (chapter 03): one call per Linear for all experts;
 *  - our grouped kernel (chapter 03): one launch per GEMM, reading the group offsets on
 *    the device.
 */
#ifndef MOE_EXPERTS_H
#define MOE_EXPERTS_H

#include "moe/layer.h"

/**
 * @brief The expert backend the configuration asks for (--moe-expert-backend): `auto` is
 *        our grouped kernel on a GPU and chapter 01's loop on the CPU, where
 *        --moe-grouped-gemm turns it into the grouped path (on the CPU, the same loop
 *        over groups behind the grouped op).
 * @param c configuration (validated: c->expert_backend resolved)  @param be the backend
 *        the model runs on
 * @return the implementation step 4 of the layer uses
 */
moe_expert_impl moe_expert_impl_from_config(const moe_config *c, const moe_backend *be);

/**
 * @brief Size the expert-side buffers of @p a and @p ws for @p rows rows (this rank's
 *        R_recv + 1; grow-only). With the fused dispatcher (pl->fused) the buffers peers
 *        store into or load from are symmetric memory sized for the largest rank
 *        (collective: every rank grows them at the same call); the rest stay local.
 * @param be backend @param d dims @param a saved state @param ws workspace
 * @param pl the plan, or NULL (no symmetric buffers) @param rows rows to hold
 */
void moe_expert_rows_reserve(const moe_backend *be, const moe_layer_dims *d, moe_layer_acts *a,
                             moe_layer_workspace *ws, const moe_dispatch_plan *pl, size_t rows);

/**
 * @brief Forward of the local experts: their SwiGLU MLPs, the routing weight applied
 *        after the activation, on the rows the dispatcher filled. Outputs land in ws->yp
 *        (permuted rows) or ws->ye (expert-side rows); a->gu/act or a->gue/acte are saved.
 * @param be backend @param d dims @param a saved state (a->plan's offsets; a->dev_offset
 *        receives them for our grouped kernel) @param ws workspace @param w weights
 * @param x the layer's input tokens [N,H]: fc1 gathers its rows from them by
 *        a->perm_src under d->permute_fusion (then a->xp is never written); else unused
 * @param expert_side the dispatcher's moe_dispatcher::expert_side
 */
void moe_experts_forward(const moe_backend *be, const moe_layer_dims *d, moe_layer_acts *a,
                         moe_layer_workspace *ws, const moe_layer_weights *w, const void *x,
                         int expert_side);

/**
 * @brief Backward of the local experts: weight gradients accumulate into @p g; input
 *        gradients land in ws->dxp (permuted rows) or ws->ye (expert-side rows), and
 *        routing-weight gradients in ws->dwp or ws->dwe (both overwritten).
 * @param be backend @param d dims @param a the forward's saved state @param ws workspace
 *        (output gradients in ws->dyp or ws->dye) @param w weights @param g gradients
 * @param x the forward's input tokens (read under d->permute_fusion, as in the forward)
 * @param expert_side the dispatcher's moe_dispatcher::expert_side
 */
void moe_experts_backward(const moe_backend *be, const moe_layer_dims *d, const moe_layer_acts *a,
                          moe_layer_workspace *ws, const moe_layer_weights *w,
                          const moe_layer_grads *g, const void *x, int expert_side);

#endif /* MOE_EXPERTS_H */
