#!/usr/bin/env bash
# Chapter 01 benchmark, ours and PyTorch's in the same run (on the GPU machine):
#   chapters/01-naive-moe/bench.sh            # writes ${OUT:-/tmp}/ch01_bench.txt
# Needs bin/ch01_moe_layer_bench (make) and python3 with PyTorch for the baselines.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}/ch01_bench.txt
{
    ./bin/ch01_moe_layer_bench "$@"
    echo
    if python3 -c "import torch" 2>/dev/null; then
        PYTHONUNBUFFERED=1 python3 chapters/01-naive-moe/torch_moe_layer.py
    else
        echo "PyTorch baselines: skipped (python3 has no torch)"
    fi
} 2>&1 | tee "$out"
