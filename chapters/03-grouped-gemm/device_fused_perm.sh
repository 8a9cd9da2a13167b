#!/usr/bin/env bash
# Issue 13 part 4, the fused permutation, in one call on one Hopper GPU (H100 or H200), from
# the repository root, carrying gpu_tmp (the static Check library in gpu_tmp/chk, see
# /work/shared/device/README.md):
#
#   chapters/03-grouped-gemm/device_fused_perm.sh
#
# 1. builds the GPU test binary and the chapter 01 layer benchmark (make -j16);
# 2. the gpu-grouped suite (MUST pass): among the rest, test_gpu_grouped_gather — the
#    gathered fc1 forward and wgrad (cp.async into the swizzled tile) vs permute + GEMM
#    (equal up to a zero's sign) and vs the CPU gather variant, on ragged groups (empty,
#    one row, sizes around 64/128, 256 groups), outputs poisoned; and the whole model with
#    --moe-permute-fusion vs chapter 01's loop;
# 3. the gpu-moe suite (MUST pass: the layer, unchanged paths);
# 4. ch01_moe_layer_bench --impl grouped --permute-fusion off,on on qwen3 (Qwen3-30B-A3B)
#    and qwen3-235b (Qwen3-235B-A22B): layer forward+backward, each checked against the
#    CPU reference first; the fused/off ratio is printed in the summary.
# Logs: $OUT/fp_build.txt, fp_test_grouped.txt, fp_test_moe.txt, fp_bench.txt. Summary last.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
mkdir -p "$out"
export MOE_GIT_COMMIT=${MOE_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
status=0
summary=()
start=$(date +%s)
left() { echo $((290 - ($(date +%s) - start))); } # seconds left of a 5-minute budget

echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)," \
    "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $MOE_GIT_COMMIT"

chk=$PWD/gpu_tmp/chk
if [ ! -f "$chk/lib/libcheck.a" ]; then
    echo "device_fused_perm.sh: $chk/lib/libcheck.a is missing: carry gpu_tmp (static Check)" >&2
    exit 2
fi
t0=$(date +%s)
if make -j16 CHECK_DIR="$chk" \
    bin/ch01_moe_layer_bench build/tests/gpu >"$out/fp_build.txt" 2>&1; then
    summary+=("build: ok ($(($(date +%s) - t0)) s)")
else
    tail -30 "$out/fp_build.txt"
    echo "== build FAILED (log: fp_build.txt)"
    exit 1
fi

for suite in gpu-grouped gpu-moe; do
    t0=$(date +%s)
    log=$out/fp_test_${suite#gpu-}.txt
    if CK_RUN_SUITE=$suite timeout 120 build/tests/gpu >"$log" 2>&1; then
        summary+=("$suite suite: PASSED ($(($(date +%s) - t0)) s)")
    else
        status=1
        summary+=("$suite suite: FAILED, rc $? (see $(basename "$log"))")
    fi
done
grep -E "gather|whole model|%:|FAIL|Error" "$out/fp_test_grouped.txt" | tail -12

: >"$out/fp_bench.txt"
for shape in qwen3 qwen3-235b; do
    t0=$(date +%s)
    if [ "$(left)" -lt 30 ]; then
        summary+=("bench $shape: NOT RUN (under 30 s of the budget left)")
    elif timeout "$(left)" ./bin/ch01_moe_layer_bench --shape $shape --impl grouped \
        --permute-fusion off,on --warmup 3 --repeats 9 >>"$out/fp_bench.txt" 2>&1; then
        summary+=("bench $shape: ok, both layers matched the CPU reference ($(($(date +%s) - t0)) s)")
    else
        status=1
        summary+=("bench $shape: FAILED, cut off or a layer disagreed (see fp_bench.txt)")
    fi
done

echo
echo "== ch01_moe_layer_bench --impl grouped --permute-fusion off,on (fp_bench.txt)"
grep -E "^check|^\| (qwen3)" "$out/fp_bench.txt"
echo
echo "== fused permutation vs separate permute/unpermute passes (layer fwd+bwd, median ms)"
awk '/^RESULT layer/ { split($3, s, "="); split($4, i, "="); split($6, m, "=");
       ms[s[2] " " i[2]] = m[2]; shapes[s[2]] = 1 }
     END { for (sh in shapes) if ((sh " grouped") in ms && (sh " grouped-fused") in ms)
           printf "   %-11s off %8.3f ms   on %8.3f ms   on/off speed-up %.3fx\n", sh,
                  ms[sh " grouped"], ms[sh " grouped-fused"],
                  ms[sh " grouped"] / ms[sh " grouped-fused"] }' "$out/fp_bench.txt"
echo
echo "== summary"
for l in "${summary[@]}"; do echo "   $l"; done
exit $status
