#!/usr/bin/env bash
# Chapter 03 benchmark, in one device call (on the GPU machine):
#   chapters/03-grouped-gemm/bench.sh          # writes ${OUT:-/tmp}/ch03_bench.txt
# 1. the six expert GEMMs alone, per backend, with the dense cuBLAS bf16 ceiling;
# 2. the whole MoE layer (forward + backward) per backend, with the time share of each
#    stage (one extra, profiled step);
# 3. PyTorch's loop and torch._grouped_mm on the same layer shapes.
# Needs bin/ch03_grouped_gemm_bench and bin/ch01_moe_layer_bench (make), and python3 with
# PyTorch for the baselines.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}/ch03_bench.txt
{
    ./bin/ch03_grouped_gemm_bench "$@"
    echo
    ./bin/ch01_moe_layer_bench --impl loop,cublas-grouped,grouped --breakdown "$@"
    echo
    if python3 -c "import torch" 2>/dev/null; then
        PYTHONUNBUFFERED=1 python3 chapters/01-naive-moe/torch_moe_layer.py
    else
        echo "PyTorch baselines: skipped (python3 has no torch)"
    fi
} 2>&1 | tee "$out"
