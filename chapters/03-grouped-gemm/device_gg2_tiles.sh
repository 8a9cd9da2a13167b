#!/usr/bin/env bash
# Issue 13, fine-grained groups (forward and dgrad of the sm_90a grouped GEMM), in one call
# on one Hopper GPU (H100 or H200), from the repository root, carrying gpu_tmp (the static
# Check library in gpu_tmp/chk, see /work/shared/device/README.md):
#
#   chapters/03-grouped-gemm/device_gg2_tiles.sh
#
# 1. builds the GPU test binary and the chapter 03 benchmark (make -j16, sm_90a + sm_100a);
# 2. the gpu-grouped suite: cuBLAS grouped and our kernel under BOTH forward/dgrad tile
#    schedules (64-row tiles for a group's last <= 64 rows, and the old 128-row-only one)
#    vs the CPU per-expert loop, on group sizes 0, 1-8, 63/64/65 ... 255/256/257, 256
#    groups; forward, dgrad accumulating and into a poisoned fresh buffer, wgrad, and the
#    whole model. MUST pass;
# 3. ch03_grouped_gemm_bench --shape fine: forward and dgrad at H=4096, F=1536 (uniform
#    top-k at T=8192, k=8, E=64/128/256; then exactly r rows per expert at E=128, r = 64,
#    65, 128, 130, 192, 193, 256, 260), the cuBLAS per-expert loop vs our kernel (new
#    schedule) vs our kernel (old schedule), each output checked against the loop;
# 4. if time is left (the whole script stays under 6 minutes), every GPU suite, as a
#    regression check (the layer and the model use the kernel).
# Logs: $OUT/gg2_build.txt, gg2_test_grouped.txt, gg2_bench_fine.txt, gg2_test_gpu_all.txt.
# The summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
mkdir -p "$out"
export MOE_GIT_COMMIT=${MOE_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
status=0
summary=()
start=$(date +%s)
left() { echo $((345 - ($(date +%s) - start))); } # seconds left of the 6-minute budget

echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)," \
    "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $MOE_GIT_COMMIT"

# 1. build
chk=$PWD/gpu_tmp/chk
if [ ! -f "$chk/lib/libcheck.a" ]; then
    echo "device_gg2_tiles.sh: $chk/lib/libcheck.a is missing: carry gpu_tmp (static Check)" >&2
    exit 2
fi
t0=$(date +%s)
if make -j16 CHECK_DIR="$chk" \
    bin/ch03_grouped_gemm_bench build/tests/gpu >"$out/gg2_build.txt" 2>&1; then
    summary+=("build: ok ($(($(date +%s) - t0)) s)")
else
    tail -30 "$out/gg2_build.txt"
    echo "== build FAILED (log: gg2_build.txt)"
    exit 1
fi

# 2. the grouped suite (the correctness gate for everything below)
t0=$(date +%s)
if CK_RUN_SUITE=gpu-grouped timeout 150 build/tests/gpu >"$out/gg2_test_grouped.txt" 2>&1; then
    summary+=("gpu-grouped suite: PASSED ($(($(date +%s) - t0)) s)")
else
    status=1
    summary+=("gpu-grouped suite: FAILED (see gg2_test_grouped.txt)")
fi
grep -E "kernel|cublas|whole model|%:|Checks|FAIL|Error" "$out/gg2_test_grouped.txt" | tail -40

# 3. the microbenchmark
t0=$(date +%s)
if timeout $(( $(left) > 20 ? $(left) - 10 : 10 )) ./bin/ch03_grouped_gemm_bench --shape fine --warmup 3 --repeats 9 \
    >"$out/gg2_bench_fine.txt" 2>&1; then
    summary+=("bench --shape fine: ok, every output matched the loop ($(($(date +%s) - t0)) s)")
else
    status=1
    summary+=("bench --shape fine: FAILED or WRONG output (see gg2_bench_fine.txt)")
fi

# 4. every GPU suite (regression; the layer and model use the kernel), if time is left
t0=$(date +%s)
if [ "$(left)" -lt 60 ]; then
    summary+=("all GPU suites: NOT RUN (less than 60 s of the 6-minute budget left)")
elif timeout $(($(left) - 5)) build/tests/gpu >"$out/gg2_test_gpu_all.txt" 2>&1; then
    summary+=("all GPU suites: PASSED ($(($(date +%s) - t0)) s)")
    grep -E "^[0-9]+%:" "$out/gg2_test_gpu_all.txt" | tail -3
else
    rc=$?
    [ $rc = 124 ] && summary+=("all GPU suites: cut off by the time budget (rc 124; not a failure of the kernel by itself, see gg2_test_gpu_all.txt)") \
        || { status=1; summary+=("all GPU suites: FAILED, rc $rc (see gg2_test_gpu_all.txt)"); }
fi

echo
echo "== ch03_grouped_gemm_bench --shape fine (gg2_bench_fine.txt)"
echo "   columns: per-expert cuBLAS loop | our kernel, new schedule | our kernel, old 128-row"
echo "   tiles | new vs loop | new vs old | worst relative error of new and old vs the loop"
grep -E "^dense|^fine|^\| (fc|all)|WRONG|error" "$out/gg2_bench_fine.txt"
echo
echo "== summary"
for l in "${summary[@]}"; do echo "   $l"; done
exit $status
