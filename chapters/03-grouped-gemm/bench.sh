#!/usr/bin/env bash
# Chapter 03 benchmark, in one device call (on the GPU machine):
#   chapters/03-grouped-gemm/bench.sh          # writes ${OUT:-/tmp}/ch03_bench.txt
# 1. the six expert GEMMs alone, per backend, with the dense cuBLAS bf16 ceiling;
# 2. chapter 01's layer benchmark (it also writes ch01_bench.txt): the whole MoE layer,
#    forward + backward, per backend with the time share of each stage (one extra,
#    profiled step), and PyTorch's loop and torch._grouped_mm on the same layer shapes.
# Needs bin/ch03_grouped_gemm_bench and bin/ch01_moe_layer_bench (make), and python3 with
# PyTorch for the baselines.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}/ch03_bench.txt
{
    ./bin/ch03_grouped_gemm_bench "$@"
    echo
    chapters/01-naive-moe/bench.sh --impl loop,cublas-grouped,grouped --breakdown "$@"
} 2>&1 | tee "$out"
