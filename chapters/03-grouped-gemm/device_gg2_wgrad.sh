#!/usr/bin/env bash
# Grouped GEMM II, the wgrad wall (issue 13, parts 1, 3, 5 and 6), in one device call on
# one H100/H200, from the repository root, with the static Check in gpu_tmp/chk (carried):
#
#   MOE_GIT_COMMIT=<sha> chapters/03-grouped-gemm/device_gg2_wgrad.sh
#
# 1. builds (make -j16, sm_90a + sm_100a);
# 2. the GPU grouped suite (CK_RUN_SUITE=gpu-grouped): forward, dgrad and wgrad of the
#    cuBLAS grouped backend and of our kernel against the CPU twin on ragged groups, our
#    wgrad in its three modes (add / store / bf16) with split-K, 256 fine-grained groups,
#    then the whole model per backend against the loop. All must pass;
# 3. the benchmark, chapters/03-grouped-gemm/bench.sh (SHAPE=big: the four model shapes and
#    the rows-per-expert sweep), which ends with the comparison against PyTorch eager and
#    torch.compile in both modes.
# Logs: $OUT/build.txt, $OUT/gpu_grouped.txt, $OUT/ch03_bench.txt (+ ch03_layer.txt).
# A summary is printed last. Budget: under 6 minutes (build ~15 s, suite ~30 s, bench ~4 min).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp}
export OUT
status=0
chk=$PWD/gpu_tmp/chk
echo "== build" | tee "$OUT/build.txt"
if ! make -j16 CHECK_DIR="$chk" \
    bin/ch03_grouped_gemm_bench bin/ch01_moe_layer_bench build/tests/gpu >>"$OUT/build.txt" 2>&1; then
    tail -30 "$OUT/build.txt"
    echo "SUMMARY: build FAILED (see build.txt)"
    exit 1
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/build.txt"

echo "== GPU grouped suite"
t0=$(date +%s)
if CK_RUN_SUITE=gpu-grouped CK_DEFAULT_TIMEOUT=300 timeout 150 build/tests/gpu >"$OUT/gpu_grouped.txt" 2>&1; then
    suite="PASS"
else
    suite="FAIL"
    status=1
fi
echo "suite: $suite in $(( $(date +%s) - t0 )) s"

echo "== benchmark"
t0=$(date +%s)
SHAPE=${SHAPE:-big} REPEATS=${REPEATS:-5} timeout 280 chapters/03-grouped-gemm/bench.sh \
    >"$OUT/bench_console.txt" 2>&1 || { echo "bench: exit status $? (see bench_console.txt)"; status=1; }
echo "bench: $(( $(date +%s) - t0 )) s"

echo
echo "================ SUMMARY ================"
echo "GPU grouped suite: $suite (lines with 'store'/'bf16'/'split' are the new wgrad modes):"
grep -E "kernel G=|Checks|whole model|Failure|Error" "$OUT/gpu_grouped.txt" | tail -25
echo
echo "Expert GEMMs, all six (per shape; columns: loop, cublas-grouped, grouped ms and TFLOP/s):"
grep -E "^dense GEMM|rows,|splits|all six|wgrad" "$OUT/ch03_bench.txt" 2>/dev/null | head -80
echo
echo "Layer comparison (ratio = PyTorch ms / ours):"
sed -n '/^Layer forward+backward/,$p' "$OUT/ch03_bench.txt" 2>/dev/null
exit $status
