#!/usr/bin/env bash
# Chapter 03 benchmark, in one device call (on the GPU machine):
#   chapters/03-grouped-gemm/bench.sh                 # writes ${OUT:-/tmp}/ch03_bench.txt
#   SHAPE=qwen3 REPEATS=5 chapters/03-grouped-gemm/bench.sh
# SHAPE (default big) is a --shape of the benchmarks: big = the four model shapes
# (qwen3, mixtral, qwen3-235b, dsv2-lite) and the rows-per-expert sweep; models; sweep; or
# one shape's name.
# 1. the expert GEMMs alone, per backend, with the dense cuBLAS bf16 ceiling (and % of
#    it) and wgrad's bandwidth, our wgrad in its three modes (add, store, bf16);
# 2. chapter 01's layer benchmark, our grouped kernel, forward + backward, with the
#    expert weight gradients added into fp32, stored into fp32, and written in bf16;
# 3. PyTorch's torch._grouped_mm layer, eager and torch.compile'd, alone and with
#    main_grad += grad.float(), on the same shapes; it ends with the comparison table
#    (ours vs eager and compiled, both ways of comparing, ratio columns).
# Needs bin/ch03_grouped_gemm_bench and bin/ch01_moe_layer_bench (make), and python3 with
# PyTorch for the baselines.
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${OUT:-/tmp}
shape=${SHAPE:-big}
repeats=${REPEATS:-7}
out=$dir/ch03_bench.txt
layer=$dir/ch03_layer.txt
{
    ./bin/ch03_grouped_gemm_bench --shape "$shape" --repeats "$repeats"
    echo
    ./bin/ch01_moe_layer_bench --shape "$shape" --repeats "$repeats" --impl grouped \
        --expert-dw add,store,bf16 --no-check | tee "$layer"
    echo
    if python3 -c "import torch" 2>/dev/null; then
        PYTHONUNBUFFERED=1 python3 chapters/01-naive-moe/torch_moe_layer.py --shape "$shape" \
            --repeats "$repeats" --impl grouped_mm,grouped_mm_compiled --ours "$layer"
    else
        echo "PyTorch baselines: skipped (python3 has no torch)"
    fi
} 2>&1 | tee "$out"
