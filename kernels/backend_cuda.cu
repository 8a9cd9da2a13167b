/*
 * The CUDA backend: the op table of lib/backend.h filled with the launchers of
 * the kernels/ files (declared in cuda_ops.h). The model code calls through this table
 * and never knows that its buffers live on a GPU.
 *
 * Every pointer the table's ops receive is a device pointer; activations are bf16
 * (act_size = 2), full-precision buffers (moe_real) are fp32.
 */
#include "cuda_common.cuh"
#include "cuda_ops.h"

static_assert(sizeof(moe_real) == sizeof(float),
              "the CUDA backend needs moe_real == float (it is double only in the CPU-only "
              "gradient-check build)");
static_assert(sizeof(moe_bf16) == 2, "bf16 activations are 2 bytes");

extern "C" int moe_cuda_available(void) {
    int n = 0;
    /* With no driver or no GPU (CI) this returns an error instead of aborting. */
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        (void)cudaGetLastError(); /* clear it: the caller falls back to the CPU */
        return 0;
    }
    return n > 0;
}

/* Filled field by field (C++17 has no designated initializers); every slot is set. */
/* the emulation's token-wise QDQ (lib/fp8_wgrad.h): a shape the model checked at start-up */
static void qdq_group_t(void *dst, const void *src, const int *off, int G, int rows, int cols,
                        moe_fp8_format f, int pow2) {
    moe_error err;
    const moe_status st = moe_cuda_qdq_group_t_act(dst, src, off, G, rows, cols, f, pow2, &err);
    if (st != MOE_OK)
        fprintf(stderr, "token-wise QDQ: %s\n", err.msg);
    MOE_ASSERT(st == MOE_OK);
}

static moe_backend make_cuda_backend(void) {
    moe_backend b = {};
    b.name = "cuda";
    b.device = MOE_DEVICE_CUDA;
    b.act_size = sizeof(moe_bf16);

    b.alloc = moe_cuda_alloc;
    b.free = moe_cuda_free;
    b.zero = moe_cuda_zero;
    b.copy = moe_cuda_copy;
    b.to_host = moe_cuda_to_host;
    b.from_host = moe_cuda_from_host;
    b.copy_2d = moe_cuda_copy_2d;
    b.fill_real = moe_cuda_fill_real;
    b.read_act = moe_cuda_read_act;
    b.write_act = moe_cuda_write_act;
    b.cast_to_act = moe_cuda_cast_to_act;
    b.synchronize = moe_cuda_synchronize;
    b.device_name = moe_cuda_device_name;
    b.peak_tflops = moe_cuda_peak_tflops;
    b.memory_bytes = moe_cuda_memory_bytes;
    b.timer_begin = moe_cuda_timer_begin;
    b.timer_end_ms = moe_cuda_timer_end_ms;
    b.fill_normal = moe_cuda_fill_normal;
    b.graph_begin = moe_cuda_graph_begin;
    b.graph_end = moe_cuda_graph_end;
    b.graph_launch = moe_cuda_graph_launch;
    b.graph_free = moe_cuda_graph_free;
    b.graph_nodes = moe_cuda_graph_nodes;

    b.matmul_forward = moe_cuda_matmul_forward;
    b.matmul_backward = moe_cuda_matmul_backward;
    b.embedding_forward = moe_cuda_embedding_forward;
    b.embedding_backward = moe_cuda_embedding_backward;
    b.rmsnorm_forward = moe_cuda_rmsnorm_forward;
    b.rmsnorm_backward = moe_cuda_rmsnorm_backward;
    b.rope_forward = moe_cuda_rope_forward;
    b.rope_backward = moe_cuda_rope_backward;
    b.attention_workspace_bytes = moe_cuda_attention_workspace_bytes;
    b.attention_forward = moe_cuda_attention_forward;
    b.attention_backward = moe_cuda_attention_backward;
    b.cp_merge = moe_cuda_cp_merge;
    b.swiglu_forward = moe_cuda_swiglu_forward;
    b.swiglu_backward = moe_cuda_swiglu_backward;
    b.cross_entropy_forward = moe_cuda_cross_entropy_forward;
    b.cross_entropy_backward = moe_cuda_cross_entropy_backward;
    b.cross_entropy_shard_forward = moe_cuda_cross_entropy_shard_forward;
    b.cross_entropy_shard_merge = moe_cuda_cross_entropy_shard_merge;
    b.cross_entropy_shard_backward = moe_cuda_cross_entropy_shard_backward;
    b.qdq = moe_cuda_qdq;
    b.fp8_swiglu_forward_quant = moe_cuda_swiglu_forward_quant;
    b.fp8_swiglu_backward_quant = moe_cuda_swiglu_backward_quant;
    b.fp8_swiglu_backward_quant_t = moe_cuda_swiglu_backward_quant_t;
    b.fp8_swiglu_forward_quant_t = moe_cuda_swiglu_forward_quant_t;
    b.qdq_t = moe_cuda_qdq_t;
    b.fp8_grouped_native = moe_cuda_grouped_sm90_available;
    b.fp8_quant_act = moe_cuda_quant_blockwise_act;
    b.fp8_dequant_act = moe_cuda_dequant_blockwise_act;
    b.fp8_quant_t_act = moe_cuda_quant_blockwise_t_act;
    b.fp8_grouped_gemm = moe_cuda_fp8_grouped_gemm;
    b.fp8_gemm = moe_cuda_fp8_gemm_act;
    b.fp8_quant_group_t_act = moe_cuda_quant_group_t_act;
    b.fp8_grouped_wgrad = moe_cuda_fp8_grouped_wgrad;
    b.qdq_group_t = qdq_group_t;
    b.add = moe_cuda_add;
    b.scale = moe_cuda_scale;

    b.router_forward = moe_cuda_router_forward;
    b.router_backward = moe_cuda_router_backward;
    b.aux_loss_counts = moe_cuda_aux_loss_counts;
    b.aux_loss_forward = moe_cuda_aux_loss_forward;
    b.aux_loss_backward = moe_cuda_aux_loss_backward;
    b.z_loss_forward = moe_cuda_z_loss_forward;
    b.z_loss_backward = moe_cuda_z_loss_backward;
    b.permute_index = moe_cuda_permute_index;
    b.permute_index_budget = moe_cuda_permute_index_budget;
    b.fused_plan = moe_cuda_fused_plan;
    b.permute_tokens = moe_cuda_permute_tokens;
    b.permute_weights = moe_cuda_permute_weights;
    b.unpermute_sum = moe_cuda_unpermute_sum;
    b.unpermute_sum_slots = moe_cuda_unpermute_sum_slots;
    b.unpermute_weights = moe_cuda_unpermute_weights;
    b.grouped_matmul_forward = moe_cuda_grouped_matmul_forward;
    b.grouped_matmul_backward = moe_cuda_grouped_matmul_backward;
    b.grouped_matmul_forward_dev = moe_cuda_grouped_sm90_forward;
    b.grouped_matmul_backward_dev = moe_cuda_grouped_sm90_backward;
    b.grouped_matmul_forward_dev_gather = moe_cuda_grouped_sm90_forward_gather;
    b.grouped_matmul_backward_dev_gather = moe_cuda_grouped_sm90_backward_gather;
    b.grouped_matmul_forward_dev_scatter = moe_cuda_grouped_sm90_forward_scatter;
    b.gather_rows = moe_cuda_gather_rows;
    b.gather_reals = moe_cuda_gather_reals;

    b.sum_squares = moe_cuda_sum_squares;
    b.sum = moe_cuda_sum;
    b.add_f64 = moe_cuda_add_f64;
    b.scale_real = moe_cuda_scale_real;
    b.adamw = moe_cuda_adamw;

    b.loss_accumulate = moe_cuda_loss_accumulate;
    b.grad_norm_finalize = moe_cuda_grad_norm_finalize;
    b.expert_load_add = moe_cuda_expert_load_add;
    b.expert_bias_update = moe_cuda_expert_bias_update;
    b.host_alloc = moe_cuda_host_alloc;
    b.host_free = moe_cuda_host_free;
    b.to_host_async = moe_cuda_to_host_async;
    b.wait_to_host = moe_cuda_wait_to_host;
    b.from_host_async = moe_cuda_from_host_async;
    return b;
}

static const moe_backend g_cuda = make_cuda_backend();

extern "C" const moe_backend *moe_backend_cuda(void) { return &g_cuda; }
