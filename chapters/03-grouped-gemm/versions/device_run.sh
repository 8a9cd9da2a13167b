#!/usr/bin/env bash
# Chapter 03's kernel ladder on one Hopper GPU (H100 or H200), in under 4 minutes.
#
# Run from the repository root on the GPU machine, carrying the static Check library in
# gpu_tmp/chk (see /work/shared/device/README.md, "build on the device"):
#   MOE_GIT_COMMIT=<commit> bash chapters/03-grouped-gemm/versions/device_run.sh
#
# It builds there, runs the GPU suite's grouped-GEMM tests (the library kernel against its
# CPU twin: the refactor of its PTX helpers into kernels/sm90_ptx.cuh and of its tile
# scheduler into lib/moe/tile_schedule.h must change nothing), then bin/ch03_versions:
# every version checked on every element against the cuBLAS loop and timed, on Qwen3 and
# Mixtral's fc1 forward. Logs in $OUT:
#   build.log, gpu_grouped.txt, ch03_versions.txt (the table for
#   docs/results/03-grouped-gemm-ladder.md), nvidia-smi.txt
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export MOE_GIT_COMMIT=${MOE_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
CHK=$PWD/gpu_tmp/chk
t0=$(date +%s)

echo "== build (make -j16, static Check from gpu_tmp/chk)"
if [ ! -f "$CHK/lib/libcheck.a" ]; then echo "FAIL: no $CHK/lib/libcheck.a: carry gpu_tmp"; exit 1; fi
if ! make -j16 MARCH=native CHECK_DIR="$CHK" \
    bin/ch03_versions build/tests/gpu > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; echo "FAIL: build (see build.log)"; exit 1
fi
echo "built in $(( $(date +%s) - t0 )) s"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1

echo "== GPU grouped-GEMM tests (CK_RUN_SUITE=gpu-grouped: cuBLAS grouped and the sm_90a kernel vs CPU)"
CK_RUN_SUITE=gpu-grouped CK_DEFAULT_TIMEOUT=150 timeout 160 build/tests/gpu > "$OUT/gpu_grouped.txt" 2>&1
gpu_rc=$?
tail -5 "$OUT/gpu_grouped.txt"

echo "== bin/ch03_versions (v1..v4, both shapes)"
timeout 150 bin/ch03_versions > "$OUT/ch03_versions.txt" 2>&1
v_rc=$?
cat "$OUT/ch03_versions.txt"

echo
echo "== summary ($(( $(date +%s) - t0 )) s, commit $MOE_GIT_COMMIT)"
echo "gpu-grouped tests: $([ $gpu_rc = 0 ] && echo PASS || echo "FAIL (rc $gpu_rc, see gpu_grouped.txt)")"
echo "ch03_versions:     $([ $v_rc = 0 ] && echo "PASS (every version checked on every element)" || echo "FAIL (rc $v_rc, see ch03_versions.txt)")"
grep -E '^\| v[0-9]|^\| cuBLAS|^dense|fc1 forward:' "$OUT/ch03_versions.txt"
[ $gpu_rc = 0 ] && [ $v_rc = 0 ]
