#!/usr/bin/env bash
# Chapter 04 (parallel folding) on one H100/H200, from the repository root, with the static
# Check in gpu_tmp/chk (carried):
#
#   MOE_GIT_COMMIT=<sha> chapters/04-parallel-folding/device_ch04.sh
#
# 1. builds (make -j16: build/tests/gpu, build/tests/mpi);
# 2. the GPU dense suite (CK_RUN_SUITE=gpu_dense): every dense CUDA op against its CPU twin,
#    including the vocabulary-parallel cross-entropy's three new ops ("ce shard fwd",
#    "ce shard merge loss/lse", "ce shard bwd", "ce shard bwd mean"), outputs poisoned first;
# 3. the GPU model suite (CK_RUN_SUITE=gpu-model): the whole model CUDA vs CPU (TP 1 path);
# 3b. the GPU MoE suite (CK_RUN_SUITE=gpu_moe): the router, permutation and load-balancing
#    ops against their CPU twins, including the aux loss split over shards as TP ranks hold
#    them (lines "aux fn=... over S shard(s)": counts CUDA = CPU exactly, the shards' parts
#    sum to the one-rank loss, CUDA forward rel <= 1e-5, backward err <= 1e-2);
# 4. the MPI suites on ONE GPU rank over NCCL (MOE_TEST_DEVICE=cuda, mpirun -np 1): the
#    TP/SP operators in a world of one and the TP folding tests (which skip TP > 1 there).
# Logs: $OUT/build.txt, $OUT/gpu_dense.txt, $OUT/gpu_model.txt, $OUT/gpu_moe.txt,
# $OUT/mpi_1gpu.txt.
# A summary is printed last. Budget: well under 6 minutes (build ~20 s, suites ~1-2 min).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp}
export OUT
status=0
chk=$PWD/gpu_tmp/chk
echo "== build" | tee "$OUT/build.txt"
if ! make -j16 CHECK_DIR="$chk" \
    all build/tests/gpu build/tests/mpi >>"$OUT/build.txt" 2>&1; then
    tail -30 "$OUT/build.txt"
    echo "SUMMARY: build FAILED (see build.txt)"
    exit 1
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/build.txt"

run_suite() { # name log command...
    local name=$1 log=$2
    shift 2
    local t0=$(date +%s)
    if "$@" >"$OUT/$log" 2>&1; then r=PASS; else r=FAIL; status=1; fi
    echo "$name: $r in $(( $(date +%s) - t0 )) s"
    eval "res_${log%.txt}=$r"
}
run_suite "GPU dense suite" gpu_dense.txt env CK_RUN_SUITE=gpu_dense CK_DEFAULT_TIMEOUT=300 \
    timeout 200 build/tests/gpu
run_suite "GPU model suite" gpu_model.txt env CK_RUN_SUITE=gpu-model CK_DEFAULT_TIMEOUT=300 \
    timeout 200 build/tests/gpu
run_suite "GPU MoE suite" gpu_moe.txt env CK_RUN_SUITE=gpu_moe CK_DEFAULT_TIMEOUT=300 \
    timeout 200 build/tests/gpu
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
run_suite "MPI suites, 1 GPU rank (NCCL)" mpi_1gpu.txt env MOE_TEST_DEVICE=cuda CK_FORK=no \
    CK_RUN_SUITE=mpi_tp timeout 120 mpirun -np 1 build/tests/mpi

echo
echo "================ SUMMARY ================"
echo "GPU dense suite: $res_gpu_dense   (vocabulary-parallel cross-entropy lines: 'ce shard')"
grep -E "ce shard|cross-entropy|Checks|Failure|Error" "$OUT/gpu_dense.txt" | tail -30
echo "GPU model suite: $res_gpu_model"
grep -E "Checks|Failure|Error" "$OUT/gpu_model.txt" | tail -5
echo "GPU MoE suite: $res_gpu_moe   (aux loss over TP-like shards: 'shard(s)')"
grep -E "shard\(s\)|Checks|Failure|Error" "$OUT/gpu_moe.txt" | tail -30
echo "MPI tp suite on 1 GPU rank: $res_mpi_1gpu"
grep -E "Checks|Failure|Error|TP " "$OUT/mpi_1gpu.txt" | tail -10
exit $status
