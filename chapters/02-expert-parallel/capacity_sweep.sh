#!/usr/bin/env bash
# Chapter 02, exercise 1: dropped tokens and validation loss against the capacity factor,
# for both drop policies, on 2 CPU ranks (EP = 2). One --metrics-file per run:
#
#   chapters/02-expert-parallel/capacity_sweep.sh [OUTDIR] [STEPS]
#
# OUTDIR (default /tmp/ch02_capacity) gets dropless.jsonl and cf<F>_<policy>.jsonl, plus
# run.txt (machine, date, commit, the exact command of each run; appended to, so a sweep
# can be completed in several sittings). A run whose .jsonl is already in OUTDIR is kept,
# not run again: delete it to redo it. Then plot them:
#
#   /usr/bin/python3 tools/plot_metrics.py --figure dropped --out DIR OUTDIR/*.jsonl
#
# CF (default "1.0 1.25 2.0") and POLICIES (default "probs position") choose the runs.
# Each run is STEPS (default 200) steps of the default CPU model (global batch 32,
# validation every quarter of the run): about 0.2 s a step on 2 idle CPU cores.
# Needs Open MPI and `make` (bin/moe-train).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-/tmp/ch02_capacity}
steps=${2:-200}
CF=${CF:-"1.0 1.25 2.0"}
POLICIES=${POLICIES:-"probs position"}
mkdir -p "$out"
cores=$(nproc)   # before OMP_NUM_THREADS=1, which GNU nproc obeys
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    OMPI_MCA_rmaps_base_oversubscribe=1
common=(--device cpu --expert-model-parallel-size 2 --global-batch-size 32
        --train-iters "$steps" --log-interval $((steps / 4)) --eval-interval $((steps / 4)) --eval-iters 20
        --sample-length 0 --overwrite)
{
    echo "capacity sweep | $(uname -n) | $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //') x $cores cores | $(date -u '+%Y-%m-%d %H:%M UTC') | commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "mpirun -np 2 bin/moe-train ${common[*]} [--moe-expert-capacity-factor F --moe-token-drop-policy P] --metrics-file FILE"
} | tee -a "$out/run.txt"
run() {  # run NAME [flags...]
    local name=$1; shift
    if [ -s "$out/$name.jsonl" ]; then echo "$name: kept ($out/$name.jsonl exists)"; return; fi
    echo "$name: mpirun -np 2 bin/moe-train ${common[*]} $* --metrics-file $out/$name.jsonl" \
        | tee -a "$out/run.txt"
    mpirun -np 2 bin/moe-train "${common[@]}" "$@" --metrics-file "$out/$name.jsonl" \
        > "$out/$name.log" 2>&1 || { echo "$name failed: see $out/$name.log" >&2; exit 1; }
    grep -E '^(eval|done)' "$out/$name.log" | sed "s/^/  $name | /" | tee -a "$out/run.txt"
}
run dropless
for cf in $CF; do
    for p in $POLICIES; do
        run "cf${cf}_$p" --moe-expert-capacity-factor "$cf" --moe-token-drop-policy "$p"
    done
done
echo "finished $(date -u '+%Y-%m-%d %H:%M UTC')" | tee -a "$out/run.txt"
