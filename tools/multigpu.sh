#!/usr/bin/env bash
# Every multi-GPU measurement of the course, in one call on one multi-GPU host.
#
#   tools/multigpu.sh [--gpus N] [--steps S] [SECTION ...]
#
# Sections (default: all of them):
#   ch02       expert parallelism at EP = 2, 4, 8 (up to --gpus): the MPI suite over NCCL,
#              dispatcher + combine against a raw all-to-all (ch02_dispatch_bench), and weak
#              scaling of training (the GPU preset and a larger model; 8 experts per GPU,
#              32 sequences per GPU), fused and collective paths
#   ch04       parallel folding on 2, 4 and 8 GPUs (up to --gpus): ch04_folding_bench on a
#              model large enough for the difference to be real (hidden 1024, 16 experts,
#              2048 tokens per sequence): uniform TP (attention TP and experts ETP), pure
#              EP + DP, the folded layout (TP attention, EP experts), plain DP with and
#              without the distributed optimizer; step time, bytes per group (model ==
#              counts, or the run fails) and memory per rank. The invariance suites on GPU
#              ranks are the MPI suite of the ch02 section (every suite, foldings included).
#              CH04_MODEL='flags' and CH04_FOLDINGS='tp=4,ep=4;...' replace the model and
#              the foldings (e.g. a model that needs TP: docs/results/04-parallel-folding.md)
#   ch06       CUDA graphs under EP = 2 (chapter 06): the mpi-ep suite on 2 GPU ranks (its
#              sync_free case: the plan made on the device against the host's, the
#              overflow protocol, replay == eager at --cuda-graph-scope layer and
#              full_iteration), then the GPU preset with 16 experts, global batch 64, EP 2
#              on the fused path: eager against --cuda-graph-scope layer and full_iteration
#              (ms/step, tokens/s, the last loss, which must be the same), and the
#              collective path eager for reference
#   ch07       context parallelism on 2 and 4 GPUs (up to --gpus): the mpi_cp suite on GPU
#              ranks (the attention's four exchanges and the model under CP, against one
#              process on the same GPU), then 20 steps of the GPU preset with
#              --context-parallel-size 2 against one GPU (the losses agree to bf16 noise),
#              then bin/ch07_cp_bench on 2 and 4 GPUs: each comm type's attention at 8K-32K
#              tokens, the ring with and without its overlap, against one GPU
#   ch07long   long sequences under context parallelism: the GPU preset's model trains one
#              sequence of T tokens (CH07_SEQS, default 131072 262144 524288) on 1 GPU and
#              with --context-parallel-size 2 and 4 (each comm type that applies: p2p,
#              allgather, a2a where the KV groups divide by CP, a2a+p2p as 2 x 2), 3 steps
#              each; ms/step (median of steps 2-3), tokens/s, scaling efficiency against
#              one GPU at the same T, the largest GPU memory any of the run's GPUs reached
#              (nvidia-smi, 100 ms samples, CUDA context included) and the loss at step 3
#   multinode  the same with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1: NCCL moves everything
#              through its network transport, as between nodes; the fused NVLink path must
#              see that and fall back to the collective one, and say so
#
# Run from the repository root after `make` (bin/ and build/tests/mpi built with CUDA and
# MPI). Each section writes ${OUT:-/tmp}/multigpu_<section>.txt (the full logs) and prints
# a summary. NVLink multicast stays off (NCCL_NVLS_ENABLE=0). Exit status: non-zero if any
# correctness check failed; the measurements of the other sections still run.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,36p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
steps=120
sections=()
while [ $# -gt 0 ]; do
    case "$1" in
    --gpus) gpus="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    -h | --help) usage 0 ;;
    ch02 | ch04 | ch06 | ch07 | ch07long | multinode) sections+=("$1"); shift ;;
    *) echo "tools/multigpu.sh: unknown argument '$1' (sections: ch02 ch04 ch06 ch07 ch07long multinode; --help)" >&2; exit 2 ;;
    esac
done
[ ${#sections[@]} -gt 0 ] || sections=(ch02 ch04 ch06 ch07 ch07long multinode)
if ! [[ "$gpus" =~ ^[0-9]+$ ]] || [ "$gpus" -lt 2 ]; then
    echo "tools/multigpu.sh: needs a host with at least 2 GPUs (found ${gpus:-0}; --gpus N to say)" >&2
    exit 2
fi
if ! [[ "$steps" =~ ^[0-9]+$ ]] || [ "$steps" -lt 40 ]; then
    echo "tools/multigpu.sh: --steps must be an integer >= 40 (the first 40 steps are warm-up)" >&2
    exit 2
fi
for f in bin/moe-train bin/ch02_dispatch_bench bin/ch04_folding_bench bin/ch07_cp_bench build/tests/mpi; do
    [ -x "$f" ] || { echo "tools/multigpu.sh: $f is missing: run make first (with CUDA and MPI)" >&2; exit 2; }
done

out=${OUT:-/tmp}
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MPIRUN="mpirun --bind-to none -x NCCL_NVLS_ENABLE"
status=0
eps=()
for ep in 2 4 8; do [ "$ep" -le "$gpus" ] && eps+=("$ep"); done

topo() {
    echo "host: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $gpus," \
        "driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)," \
        "$(date -u '+%Y-%m-%d %H:%M UTC'), commit ${MOE_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
    nvidia-smi topo -m 2>/dev/null | sed -n '1,/^$/p'
}

# median step time (ms) and tokens/s of the steps after the first 40 of a metrics file,
# and the last logged loss: "ms tok/s loss"
steady() { python3 tools/metrics_summary.py "$1" --after 40 --print ms,tps,loss; }

# one training run: label, ranks, extra flags; appends a table row
train_row() {
    local label="$1" np="$2"; shift 2
    local m="$out/mg_$$_${np}_$RANDOM.jsonl" log
    if [ "$np" = 1 ]; then
        log=$(bin/moe-train --device cuda "$@" --train-iters "$steps" --log-interval 40 \
              --eval-interval 0 --sample-length 0 --metrics-file "$m" --overwrite 2>&1)
    else
        log=$($MPIRUN -np "$np" bin/moe-train --device cuda "$@" --train-iters "$steps" \
              --log-interval 40 --eval-interval 0 --sample-length 0 --metrics-file "$m" --overwrite 2>&1)
    fi
    local rc=$?
    echo "$log" >>"$LOG"
    if [ $rc != 0 ] || [ ! -s "$m" ]; then
        echo "| $label | $np | FAILED (rc $rc, see the log) | | | |"
        status=1
        return
    fi
    read -r ms tps loss < <(steady "$m")
    echo "| $label | $np | $(printf "%.1f" "$ms") | $(printf "%'d" "$tps") | $(printf "%'d" $((tps / np))) | $loss |"
    echo "$log" | grep -m1 "alltoall dispatcher" | sed 's/^/    /' >&2
    rm -f "$m"
}

mpi_suite() { # ranks, label
    echo "== MPI suite over NCCL, $1 GPUs$2" >>"$LOG"
    if MOE_TEST_DEVICE=cuda $MPIRUN -x MOE_TEST_DEVICE -np "$1" build/tests/mpi >>"$LOG" 2>&1; then
        echo "MPI suite over NCCL, $1 ranks$2: $(grep -E '^[0-9]+%: Checks' "$LOG" | tail -1)"
    else
        echo "MPI suite over NCCL, $1 ranks$2: FAILED (see $LOG)"
        status=1
    fi
}

# the models of the weak-scaling runs: 8 experts and 32 sequences per GPU
PRESET="--preset gpu"
LARGE="--preset gpu --num-layers 8 --hidden-size 1024 --num-attention-heads 8 --num-query-groups 4 \
--ffn-hidden-size 4096 --moe-ffn-hidden-size 1024 --seq-length 512 --micro-batch-size 16"

weak_scaling() { # extra env label
    echo "| run | GPUs | ms/step | tokens/s | tokens/s per GPU | loss at the last step |"
    echo "|---|---:|---:|---:|---:|---:|"
    for model in PRESET LARGE; do
        local flags=${!model}
        local gb=$([ $model = PRESET ] && echo 32 || echo 16)
        train_row "$model EP 1, 8 experts" 1 $flags --num-experts 8 --global-batch-size $gb
        for ep in "${eps[@]}"; do
            for path in fused collective; do
                train_row "$model EP $ep $path, $((8 * ep)) experts" "$ep" $flags \
                    --num-experts $((8 * ep)) --global-batch-size $((gb * ep)) \
                    --expert-model-parallel-size "$ep" --moe-alltoall-path "$path"
            done
        done
    done
}

# one long-sequence run of chapter 07: T, ranks, comm type ("-" on one GPU), extra flags;
# appends a table row. Globals: LONGDATA (a text file whose validation split holds T + 1
# tokens), ONE_GPU_TPS (tokens/s on one GPU at this T, set by the np = 1 run)
long_row() {
    local T="$1" np="$2" type="$3"; shift 3
    local m="$out/long_$$_${np}_$RANDOM.jsonl" mem="$out/long_mem_$$.csv" log rc
    local train="--device cuda --preset gpu --seq-length $T --micro-batch-size 1 --global-batch-size 1 \
--train-iters 3 --lr-warmup-iters 0 --eval-interval 0 --eval-iters 1 --sample-length 0 --seed 1 \
--data-path $LONGDATA --metrics-file $m --overwrite"
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 100 >"$mem" &
    local smi=$!
    if [ "$np" = 1 ]; then
        log=$(timeout 300 bin/moe-train $train "$@" 2>&1)
    else
        log=$(timeout 300 $MPIRUN -np "$np" bin/moe-train $train --context-parallel-size "$np" \
              --cp-comm-type "$type" "$@" 2>&1)
    fi
    rc=$?
    kill $smi; wait $smi 2>/dev/null
    { echo "== T $T, $np GPUs, $type $*"; echo "$log"; } >>"$LOG"
    local peak
    peak=$(awk -F', *' -v n="$np" '$1 < n && $2 > p { p = $2 } END { print p + 0 }' "$mem")
    if [ $rc != 0 ] || [ ! -s "$m" ]; then
        echo "| $T | $np | $type | FAILED (rc $rc: $(echo "$log" | grep -iE 'error|out of memory' | head -1)) | | | | $peak | |"
        status=1
        return
    fi
    read -r ms tps loss < <(python3 tools/metrics_summary.py "$m" --after 1 --tokens "$T")
    ms=$(printf "%.0f" "$ms")
    local speed="" eff=""
    if [ "$np" = 1 ]; then
        ONE_GPU_TPS=$tps
    elif [ -n "$ONE_GPU_TPS" ]; then
        speed=$(python3 -c "print(f'{$tps / $ONE_GPU_TPS:.2f}x')")
        eff=$(python3 -c "print(f'{100 * $tps / $ONE_GPU_TPS / $np:.0f}%')")
    fi
    echo "| $T | $np | $type | $ms | $(printf "%'d" "$tps") | $speed | $eff | $(printf "%'d" "$peak") | $loss |"
    rm -f "$m" "$mem"
}

for s in "${sections[@]}"; do
    LOG="$out/multigpu_$s.txt"
    : >"$LOG"
    echo
    echo "######## $s"
    topo | tee -a "$LOG"
    case "$s" in
    ch02)
        for ep in "${eps[@]}"; do mpi_suite "$ep" ""; done
        for ep in "${eps[@]}"; do
            $MPIRUN -np "$ep" bin/ch02_dispatch_bench --device cuda 2>&1 | tee -a "$LOG" | grep -v '^$'
        done
        for h in 1024 512; do # chapter 02's exercise 8: where the fused path's margin narrows
            $MPIRUN -np 2 bin/ch02_dispatch_bench --device cuda --hidden "$h" 2>&1 | tee -a "$LOG" |
                grep -E '^\||^H='
        done
        echo "weak scaling ($steps steps; median of the steps after the 40th):"
        weak_scaling
        ;;
    ch04)
        # appended to the bench's built-in model (later flags win): every size divides by 4
        # (heads 16, KV groups 8, experts 16, vocabulary padded to a multiple of 8)
        # CH04_MODEL and CH04_FOLDINGS (the bench's --foldings, for every GPU count) replace
        # the defaults, e.g. for a model that does not fit one GPU
        ch04_model=${CH04_MODEL:-"--num-layers 4 --hidden-size 1024 --num-attention-heads 16 \
--num-query-groups 8 --seq-length 2048 --num-experts 16 --moe-ffn-hidden-size 1024 \
--moe-shared-expert-intermediate-size 1024 --moe-router-topk 2"}
        for np in "${eps[@]}"; do
            h=$((np / 2))
            fold="tp=$np,ep=1,etp=$np;tp=1,ep=$np;tp=$np,ep=$np;tp=1,ep=1;tp=1,ep=1,zero=1"
            [ "$np" -gt 2 ] && fold="$fold;tp=$h,ep=$np;tp=$h,ep=$h,etp=2"
            fold=${CH04_FOLDINGS:-$fold}
            echo "== ch04_folding_bench, $np GPUs: $fold"
            f="$out/ch04_folding_${np}gpus.txt"
            if ! $MPIRUN -np "$np" bin/ch04_folding_bench --device cuda --model "$ch04_model" \
                --foldings "$fold" --repeats 10 --warmup 3 >"$f" 2>&1; then
                echo "ch04_folding_bench on $np GPUs: FAILED (see $f)"
                status=1
            fi
            cat "$f" >>"$LOG"
            grep -E "^folding|memory/rank|model .* the counts|not run|^FAIL|^OK" "$f"
        done
        ;;
    ch06)
        f="$out/ch06_mpi_ep_2gpus.txt"
        echo "== mpi-ep on 2 GPU ranks (chapter 06: the sync-free EP path and its graphs)"
        # (CH06_CASE=sync_free runs only chapter 06's case of the suite)
        if ! env MOE_TEST_DEVICE=cuda CK_RUN_SUITE=mpi-ep ${CH06_CASE:+CK_RUN_CASE=$CH06_CASE} \
            CK_FORK=no timeout 600 $MPIRUN -x MOE_TEST_DEVICE -x CK_RUN_SUITE \
            ${CH06_CASE:+-x CK_RUN_CASE} -x CK_FORK -np 2 build/tests/mpi >"$f" 2>&1; then
            echo "mpi-ep on 2 GPU ranks: FAILED (see $f)"
            status=1
        fi
        cat "$f" >>"$LOG"
        grep -E "^[0-9]+%|:F:|:E:|scope|device plan|CUDA graphs" "$f"
        echo "EP 2, the GPU preset with 16 experts and global batch 64 ($steps steps; median of"
        echo "the steps after the 40th):"
        echo "| run | GPUs | ms/step | tokens/s | tokens/s per GPU | loss at the last step |"
        echo "|---|---:|---:|---:|---:|---:|"
        CH06="--preset gpu --num-experts 16 --global-batch-size 64 --expert-model-parallel-size 2"
        train_row "collective, eager" 2 $CH06 --moe-alltoall-path collective
        for scope in none layer full_iteration; do
            train_row "fused (sync-free), --cuda-graph-scope $scope" 2 $CH06 \
                --moe-alltoall-path fused --cuda-graph-scope "$scope"
        done
        ;;
    ch07)
        MPIRUN7="$MPIRUN -x MOE_TEST_DEVICE"
        for np in 2 4; do
            [ "$np" -le "$gpus" ] || continue
            f="$out/ch07_mpi_cp_${np}gpus.txt"
            echo "== mpi_cp on $np GPU ranks"
            if ! MOE_TEST_DEVICE=cuda CK_RUN_SUITE=mpi_cp CK_FORK=no timeout 600 \
                $MPIRUN7 -np "$np" build/tests/mpi >"$f" 2>&1; then
                echo "mpi_cp on $np GPU ranks: FAILED (see $f)"
                status=1
            fi
            cat "$f" >>"$LOG"
            grep -E "^[0-9]+%|:F:|:E:" "$f"
        done
        train="--device cuda --preset gpu --train-iters 20 --sample-length 0 --eval-interval 1000 --log-interval 1 --seed 1"
        echo "== the GPU preset, 20 steps: one GPU, then --context-parallel-size 2 on 2 GPUs"
        bin/moe-train $train 2>&1 | tee -a "$LOG" | grep -E "^step +(1|10|20)/"
        if ! $MPIRUN7 -np 2 bin/moe-train $train --context-parallel-size 2 2>&1 | tee -a "$LOG" |
            grep -E "^step +(1|10|20)/|rror"; then
            echo "moe-train --context-parallel-size 2 on 2 GPUs: FAILED"
            status=1
        fi
        for np in 2 4; do
            [ "$np" -le "$gpus" ] || continue
            echo "== bin/ch07_cp_bench on $np GPUs"
            if ! $MPIRUN -np "$np" bin/ch07_cp_bench --device cuda 2>&1 | tee -a "$LOG" |
                grep -E "^\||rror"; then
                echo "ch07_cp_bench on $np GPUs: FAILED"
                status=1
            fi
        done
        ;;
    ch07long)
        # the validation split (the last tenth) must hold a whole sequence: repeat the text
        LONGDATA="$out/shakespeare_long.txt"
        for i in 1 2 3 4 5 6; do cat data/tinyshakespeare.txt; done >"$LONGDATA"
        echo "the GPU preset's model, one sequence of T tokens a step, 3 steps (ms: median of steps 2-3)"
        echo "| T | GPUs | CP comm type | ms/step | tokens/s | vs 1 GPU | efficiency | peak GPU memory (MiB) | loss at step 3 |"
        echo "|---:|---:|---|---:|---:|---:|---:|---:|---:|"
        for T in ${CH07_SEQS:-131072 262144 524288}; do
            ONE_GPU_TPS=""
            long_row "$T" 1 -
            [ "$gpus" -ge 2 ] || continue
            for type in p2p allgather a2a; do long_row "$T" 2 "$type"; done
            [ "$gpus" -ge 4 ] || continue
            for type in p2p allgather; do long_row "$T" 4 "$type"; done
            long_row "$T" 4 a2a+p2p --hierarchical-context-parallel-sizes 2,2
        done
        rm -f "$LONGDATA"
        ;;
    multinode)
        export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
        MPIRUN="$MPIRUN -x NCCL_P2P_DISABLE -x NCCL_SHM_DISABLE"
        echo "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 (NCCL's network transport, as between nodes)"
        # --moe-alltoall-path auto must fall back to the collective path and say why
        line=$($MPIRUN -np 2 bin/moe-train --device cuda --preset gpu --num-experts 16 \
               --global-batch-size 64 --expert-model-parallel-size 2 --train-iters 2 \
               --eval-interval 0 --sample-length 0 2>&1 | tee -a "$LOG" | grep -m1 "alltoall dispatcher")
        echo "fallback: ${line:-NO LOG LINE}"
        case "$line" in *collective*) ;; *) echo "FAIL: the fused path did not fall back"; status=1 ;; esac
        for ep in "${eps[@]}"; do mpi_suite "$ep" " (network transport)"; done
        for ep in "${eps[@]}"; do
            $MPIRUN -np "$ep" bin/ch02_dispatch_bench --device cuda 2>&1 | tee -a "$LOG" | grep -v '^$'
        done
        unset NCCL_P2P_DISABLE NCCL_SHM_DISABLE
        MPIRUN="mpirun --bind-to none -x NCCL_NVLS_ENABLE"
        ;;
    esac
done
exit $status
