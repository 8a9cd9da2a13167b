#!/usr/bin/env bash
# Chapter 05 benchmark, in one device call (on the GPU machine):
#   chapters/05-fp8-nvfp4/bench.sh          # writes ${OUT:-/tmp}/ch05_fp8_gemm.txt
#   SHAPE=fc1 REPEATS=5 chapters/05-fp8-nvfp4/bench.sh
#   SHAPE=moe chapters/05-fp8-nvfp4/bench.sh   # the MoE expert GEMMs only (grouped)
# 1. bin/ch05_fp8_gemm_bench: bf16 cuBLAS vs our FP8 tensorwise / blockwise GEMMs (with and
#    without the quantizers) and the emulated MXFP8 / NVFP4 GEMMs, outputs checked first;
# 2. torch_fp8_gemm.py: torch.mm and torch._scaled_mm (tensorwise, rowwise, blockwise) on the
#    same shapes and GPU, then ours vs PyTorch side by side. The MoE shapes (Qwen3-30B-A3B,
#    Mixtral-8x7B expert forwards): our FP8 and bf16 grouped kernels vs the dense FP8
#    ceiling, then torch._grouped_mm (bf16) and torch._scaled_grouped_mm (rowwise FP8).
# 3. the MoE layer, forward + backward, in FP8 blockwise (native on Hopper: forward, dgrad and
#    wgrad in our FP8 grouped kernels; MOE_FP8_WGRAD=0 for a bf16 wgrad) vs our bf16 layer, on
#    the Qwen3-30B-A3B, Mixtral-8x7B and Qwen3-235B-A22B shapes, with the ratio (bin/ch01_moe_layer_bench --precision
#    bf16,fp8, our grouped kernel; each checked against the CPU first): writes
#    ${OUT:-/tmp}/ch05_fp8_layer.txt; then the same layer in PyTorch (torch_fp8_layer.py:
#    forward and dgrad on torch._scaled_grouped_mm with rowwise FP8, wgrad bf16, eager and
#    torch.compile, and bf16 torch._grouped_mm compiled) and the comparison table, written to
#    ${OUT:-/tmp}/ch05_fp8_layer_torch.txt.
#   PART=layer chapters/05-fp8-nvfp4/bench.sh   # step 3 only; PART=gemm: steps 1 and 2
# Needs bin/ch05_fp8_gemm_bench and bin/ch01_moe_layer_bench (make, with CUDA) and python3
# with PyTorch for step 2.
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${OUT:-/tmp}
shape=${SHAPE:-all}
repeats=${REPEATS:-15}
part=${PART:-all}
out=$dir/ch05_fp8_gemm.txt
tsv=$dir/ch05_fp8_gemm.tsv
if [ "$part" = all ] || [ "$part" = layer ]; then
    for s in qwen3 mixtral qwen3-235b; do
        ./bin/ch01_moe_layer_bench --shape "$s" --impl grouped --precision bf16,fp8 \
            --repeats "${LAYER_REPEATS:-9}"
        echo
    done 2>&1 | tee "$dir/ch05_fp8_layer.txt"
    if python3 -c "import torch" 2>/dev/null; then
        PYTHONUNBUFFERED=1 python3 chapters/05-fp8-nvfp4/torch_fp8_layer.py \
            --repeats "${LAYER_REPEATS:-9}" --ours "$dir/ch05_fp8_layer.txt" 2>&1 |
            tee "$dir/ch05_fp8_layer_torch.txt"
    else
        echo "PyTorch FP8 layer baseline: skipped (python3 has no torch)"
    fi
fi
[ "$part" = layer ] && exit 0
{
    ./bin/ch05_fp8_gemm_bench --shape "$shape" --repeats "$repeats" --tsv "$tsv"
    echo
    if python3 -c "import torch" 2>/dev/null; then
        PYTHONUNBUFFERED=1 python3 chapters/05-fp8-nvfp4/torch_fp8_gemm.py --shape "$shape" \
            --repeats "$repeats" --ours "$tsv"
    else
        echo "PyTorch baselines: skipped (python3 has no torch)"
    fi
} 2>&1 | tee "$out"
