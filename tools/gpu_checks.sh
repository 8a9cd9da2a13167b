#!/usr/bin/env bash
# Every single-GPU check and measurement of the course, in one call on one GPU machine.
#
#   tools/gpu_checks.sh [--check-dir DIR] [SECTION ...]
#
# Sections (default: tests ladder bench03 fine fused):
#   tests    build/tests/gpu (every CUDA op against its CPU twin, every backend of the
#            model against chapter 01's loop), the MPI suites on one GPU rank over NCCL,
#            and 60 steps of the GPU preset (its loss at step 60 is a regression check)
#   ladder   chapter 03's kernel ladder: bin/ch03_versions, v1 SIMT .. v4 our kernel, each
#            checked on every element, then timed
#   bench03  chapter 03's benchmark (chapters/03-grouped-gemm/bench.sh, SHAPE=big unless
#            SHAPE is set): the six expert GEMMs per backend and the layer against PyTorch
#            eager and torch.compile
#   fine     the fine-grained regime: forward and dgrad under both tile schedules
#            (bin/ch03_grouped_gemm_bench --shape fine)
#   fused    the fused permutation against the separate passes (layer fwd+bwd): gather
#            only, scatter only, both
#   pending  the measurements of the paths that are off by default (not in the default
#            list), in three parts that each fit one 600 s device call (pending07,
#            pending03, pending05; `pending` runs all three): the attention benchmark (the
#            portable backward and the Hopper modes 1-7 side by side: 6 the default, 4, 5
#            and 7 non-deterministic); the grouped GEMM's swapped-tail schedules around the
#            128- and 256-row cliffs, the wgrad at 512 rows per expert with its L2 prefetch
#            (MOE_WGRAD_PREFETCH=1, 2), the ping-pong kernel
#            (MOE_GROUPED_WGRAD_PINGPONG=1) and the adding tiles read, added and written
#            from registers (MOE_WGRAD_EPI=rmw, auto); the FP8 wgrad's GEMMs (both loops, both
#            scale paths, both tile widths, the fp32 epilogues; the RMW one also with dW
#            prefetched into L2), the FP8 layer with it
#            (the default) and with the bf16 wgrad in one process (--precision
#            bf16,fp8-bf16wgrad,fp8) on Mixtral and Qwen3-235B, the layer with the tiled
#            SwiGLU forward keeping the token-wise copy (MOE_FP8_SAVE_T, the default) and
#            without, with the tiled SwiGLU backward (MOE_FP8_FUSED_T=1) and without,
#            alternating, and the GPU preset in FP8 with and without the native dense
#            linears (MOE_FP8_NATIVE_DENSE=1)
#   step05   chapter 05's whole training step on the larger model (8 layers of hidden 1024,
#            16 experts of 1024, top-4): bf16 against FP8 blockwise kernel by kernel
#            (chapter 06's CUPTI trace, ch06_graphs_bench --flags), FP8 also with the former
#            weight kernels (MOE_QUANT_WEIGHT=0), then 100 steps of each, alternating twice
#            (tokens/s over the run; not in the default list)
#   profile  Nsight Compute (ncu, metrics only) on the kernels that hold back the unmet
#            targets: the bf16 grouped GEMMs at 512 rows per expert (sweep512: the wgrad
#            adding into and storing fp32 dW), the FP8 wgrad on the Mixtral layer, and the
#            SwiGLU backward in both forms with the token-wise quantizer: per launch, time,
#            DRAM bytes read and written and DRAM / L2 throughput (% of peak), L2
#            reduction sectors and tensor-pipe activity (not in the default list)
#
# Run from the repository root. It builds first (make -j$(nproc); --check-dir DIR or
# CHECK_DIR=DIR for Check as static libraries, see tools/README.md). Each section writes
# ${OUT:-/tmp}/gpu_checks/<section>.txt and adds a line to the summary printed last. Exit
# status: non-zero if the build or any correctness check failed.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
check_dir=${CHECK_DIR:-}
sections=()
while [ $# -gt 0 ]; do
    case "$1" in
    --check-dir) check_dir="$2"; shift 2 ;;
    -h | --help) usage 0 ;;
    tests | ladder | bench03 | fine | fused | pending07 | pending03 | pending05 | step05 | profile)
        sections+=("$1"); shift ;;
    pending) sections+=(pending07 pending03 pending05); shift ;;
    *) echo "tools/gpu_checks.sh: unknown argument '$1' (sections: tests ladder bench03 fine fused pending[07|03|05] step05 profile; --help)" >&2
       exit 2 ;;
    esac
done
[ ${#sections[@]} -gt 0 ] || sections=(tests ladder bench03 fine fused)
if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "tools/gpu_checks.sh: no GPU here (nvidia-smi finds none): run it on a GPU machine" >&2
    exit 2
fi

out=${OUT:-/tmp}/gpu_checks
mkdir -p "$out"
export MOE_GIT_COMMIT=${MOE_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
status=0
summary=()
note() { summary+=("$1"); }
fail() { status=1; summary+=("$1"); }

echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)," \
    "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $MOE_GIT_COMMIT"
t0=$(date +%s)
if make -j"$(nproc)" ${check_dir:+CHECK_DIR="$check_dir"} all build/tests/gpu build/tests/mpi \
    >"$out/build.txt" 2>&1; then
    note "build: ok ($(($(date +%s) - t0)) s)"
else
    tail -30 "$out/build.txt"
    echo "tools/gpu_checks.sh: the build failed (log: $out/build.txt)"
    exit 1
fi

# run SECTION SECONDS COMMAND...: the command's output to <section>.txt, its verdict to the summary
run() {
    local name=$1 limit=$2
    shift 2
    local t=$(date +%s) rc=0
    timeout "$limit" "$@" >>"$out/$name.txt" 2>&1 || rc=$?
    if [ $rc = 0 ]; then
        note "$name: $* -- ok ($(($(date +%s) - t)) s)"
    else
        fail "$name: $* -- FAILED, exit $rc$([ $rc = 124 ] && echo ' (time limit)') (see $name.txt)"
    fi
}

for s in "${sections[@]}"; do
    rm -f "$out/$s.txt"
    echo "== $s"
    case "$s" in
    tests)
        run tests 300 build/tests/gpu
        run tests 200 env MOE_TEST_DEVICE=cuda CK_FORK=no mpirun -np 1 build/tests/mpi
        run tests 120 bin/moe-train --preset gpu --train-iters 60 --eval-interval 1000 \
            --sample-length 0 --seed 1
        grep -E "^[0-9]+%:|^step +60/|^done" "$out/tests.txt"
        ;;
    ladder)
        run ladder 200 bin/ch03_versions
        grep -E "^dense|^\| v[0-9]|^\| cuBLAS|fc1 forward:|^ch03_versions" "$out/ladder.txt"
        ;;
    bench03)
        run bench03 400 env SHAPE="${SHAPE:-big}" REPEATS="${REPEATS:-5}" OUT="$out" \
            chapters/03-grouped-gemm/bench.sh
        grep -E "^[a-z0-9-]+: T=|all six" "$out/ch03_bench.txt" 2>/dev/null
        sed -n '/^Layer forward+backward/,$p' "$out/ch03_bench.txt" 2>/dev/null
        ;;
    fine)
        run fine 200 bin/ch03_grouped_gemm_bench --shape fine --warmup 3 --repeats 9
        grep -E "^fine, |all four" "$out/fine.txt"
        ;;
    pending07)
        run pending07 300 bin/ch07_attention_bench \
            --seqs 4096,16384,65536 --dims 128,64
        grep -E "^== |^\| [0-9]" "$out/pending07.txt"
        ;;
    pending03)
        run pending03 200 bin/ch03_grouped_gemm_bench --shape fine --warmup 3 --repeats 9 \
            --schedules static,dynamic,static-swaptail,dynamic-swaptail \
            --rows 128,129,130,136,256,257,258,260
        for v in "" MOE_WGRAD_PREFETCH=1 MOE_WGRAD_PREFETCH=2 MOE_GROUPED_WGRAD_PINGPONG=1 \
            MOE_WGRAD_EPI=rmw MOE_WGRAD_EPI=auto; do
            echo "== sweep512 ${v:-(default)}" >>"$out/pending03.txt"
            run pending03 100 env $v bin/ch03_grouped_gemm_bench --shape sweep512
        done
        grep -E "^== |wgrad|^fine, |all four" "$out/pending03.txt"
        ;;
    pending05)
        run pending05 200 bin/ch05_fp8_gemm_bench --shape moe
        # the RMW epilogue's reads of dW with dW prefetched into L2 during the tile's main loop
        # (the producer's TMA prefetch): do its waits shrink? (the rows "+=, rmw" and "+=,
        # auto epilogue" against the call above)
        for sh in qwen3-235b-fc1 qwen3-235b-fc2; do
            echo "== $sh MOE_WGRAD_PREFETCH=1" >>"$out/pending05.txt"
            run pending05 100 env MOE_WGRAD_PREFETCH=1 bin/ch05_fp8_gemm_bench --shape "$sh"
        done
        # the FP8 layer with the FP8 wgrad (the default, its 128 x 256 tile) and with the bf16
        # wgrad (MOE_FP8_WGRAD=0) in one process. (The wgrad's direct epilogue and its
        # promotion by quarters, measured slower: their GEMM rows are in the benchmark above.)
        for shape in mixtral qwen3-235b; do
            run pending05 200 bin/ch01_moe_layer_bench --shape "$shape" \
                --impl grouped --precision bf16,fp8-bf16wgrad,fp8 --repeats 7
        done
        # the tiled SwiGLU forward keeping the token-wise copy (MOE_FP8_SAVE_T, the default)
        # against the row-wise one keeping the bf16 output, alternating processes twice
        for v in MOE_FP8_SAVE_T=0 MOE_FP8_SAVE_T=1 MOE_FP8_SAVE_T=0 MOE_FP8_SAVE_T=1; do
            echo "== Mixtral FP8 wgrad $v" >>"$out/pending05.txt"
            run pending05 100 env $v bin/ch01_moe_layer_bench --shape mixtral \
                --impl grouped --precision fp8 --repeats 7
        done
        # the tiled SwiGLU backward of the FP8 wgrad (MOE_FP8_FUSED_T=1) against the row-wise
        # one, alternating processes twice (the switch is read when a context is made)
        for v in MOE_FP8_FUSED_T=0 MOE_FP8_FUSED_T=1 MOE_FP8_FUSED_T=0 MOE_FP8_FUSED_T=1; do
            echo "== Mixtral FP8 wgrad $v" >>"$out/pending05.txt"
            run pending05 100 env $v bin/ch01_moe_layer_bench --shape mixtral \
                --impl grouped --precision fp8 --repeats 7
        done
        for v in "" MOE_FP8_NATIVE_DENSE=1; do
            echo "== FP8 preset ${v:-(dense linears emulated)}" >>"$out/pending05.txt"
            run pending05 60 env $v bin/moe-train --device cuda --preset gpu --train-iters 60 \
                --eval-interval 1000 --sample-length 0 --seed 1 --fp8-format e4m3 --fp8-recipe blockwise
        done
        grep -E "^== |wgrad|^\| (mixtral|qwen3-235b)|^done" "$out/pending05.txt"
        ;;
    step05)
        large="--num-layers 8 --hidden-size 1024 --num-attention-heads 8 --num-query-groups 4"
        large+=" --ffn-hidden-size 4096 --num-experts 16 --moe-ffn-hidden-size 1024"
        large+=" --moe-router-topk 4 --seq-length 512 --micro-batch-size 16 --global-batch-size 16"
        f8="--fp8-format e4m3 --fp8-recipe blockwise"
        # (ch06_graphs_bench's "large" sets a hidden size, heads and experts of its own;
        # --flags comes after them, so the same model as moe-train's below)
        for v in "bf16|" "fp8|$f8" "fp8, former weight kernels|$f8"; do
            echo "== kernels per step: ${v%%|*}" >>"$out/step05.txt"
            run step05 100 env $([ "${v%%|*}" = "fp8, former weight kernels" ] &&
                echo MOE_QUANT_WEIGHT=0) bin/ch06_graphs_bench --only large --scopes none \
                --top 40 --flags "$large ${v#*|}"
        done
        for round in 1 2; do
            for v in "bf16|" "fp8|$f8"; do
                echo "== round $round: ${v%%|*}, 100 steps" >>"$out/step05.txt"
                run step05 60 bin/moe-train --device cuda --preset gpu $large \
                    --eval-interval 1000 --train-iters 100 --sample-length 0 \
                    --log-interval 50 ${v#*|}
            done
        done
        grep -E "^== |all .* kernel names|^\| large|^done" "$out/step05.txt"
        ;;
    profile)
        ncu_bin=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null ||
            ls -d /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
        if [ -z "$ncu_bin" ]; then
            fail "profile: no ncu (Nsight Compute) on this machine"
            continue
        fi
        metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum
        metrics+=,dram__throughput.avg.pct_of_peak_sustained_elapsed
        metrics+=,lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_op_red.sum
        metrics+=,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed
        prof() { # prof SECONDS KERNEL-REGEX LAUNCHES COMMAND...
            local limit=$1 k=$2 n=$3
            shift 3
            echo "== ncu -k regex:$k --launch-count $n: $*" >>"$out/profile.txt"
            run profile "$limit" "$ncu_bin" --clock-control none --metrics "$metrics" \
                --kernel-name "regex:$k" --launch-count "$n" "$@"
        }
        prof 200 grouped_gemm_kernel 40 bin/ch03_grouped_gemm_bench --shape sweep512 \
            --warmup 0 --repeats 1
        prof 200 fp8_wgrad_kernel 4 bin/ch01_moe_layer_bench \
            --shape mixtral --impl grouped --precision fp8 --repeats 1 --warmup 0
        for v in MOE_FP8_FUSED_T=0 MOE_FP8_FUSED_T=1; do
            prof 200 "swiglu_quant_bwd|group_t_kernel" 12 env $v \
                bin/ch01_moe_layer_bench --shape mixtral --impl grouped --precision fp8 \
                --repeats 1 --warmup 0
        done
        grep -E "^== ncu|^  [a-zA-Z_<>:, ()0-9*-]+\(|gpu__time|dram__|lts__|sm__pipe" \
            "$out/profile.txt" | cut -c1-160
        ;;
    fused)
        for shape in qwen3 qwen3-235b; do
            run fused 200 bin/ch01_moe_layer_bench --shape "$shape" --impl grouped \
                --permute-fusion off,gather,scatter,on
        done
        # layer forward+backward: the separate passes, each half of the fused permutation
        # alone (gather: fc1 reads the tokens; scatter: fc2 stores into the token slots), both
        awk '/^RESULT layer/ { split($3, s, "="); split($4, i, "="); split($6, m, "=");
               ms[s[2] " " i[2]] = m[2]; shapes[s[2]] = 1 }
             END { for (sh in shapes) if ((sh " grouped") in ms) {
                     b = ms[sh " grouped"]
                     printf "   %-11s separate passes %8.3f ms", sh, b
                     n = split("gather scatter fused", v, " ")
                     for (j = 1; j <= n; j++) if ((sh " grouped-" v[j]) in ms)
                       printf "   %s %8.3f ms %.2fx", (v[j] == "fused" ? "both" : v[j]),
                              ms[sh " grouped-" v[j]], b / ms[sh " grouped-" v[j]]
                     printf "\n" } }' "$out/fused.txt"
        ;;
    esac
done

echo
echo "== summary (logs in $out)"
for l in "${summary[@]}"; do echo "   $l"; done
exit $status
