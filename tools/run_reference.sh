#!/usr/bin/env bash
# shellcheck disable=SC2034,SC2054  # CONFIG_*/DESC_* are read through namerefs; 0,1,1 is a value
# The whole-model check of moe.c against a PyTorch reference: one command, on a laptop
# (CPU only) or on the GPU machine (CPU, and CUDA when nvidia-smi sees a GPU).
#
#   tools/run_reference.sh            # after building bin/moe-reference (make, or make CUDA=0)
#
# For each of two small configurations (a third with CONFIGS="a b c") it runs
# bin/moe-reference (initial weights, batches, logits, gradients and 10 training steps of
# the C model) and tools/torch_reference.py (the same model in plain PyTorch), then prints
# a summary table. Builds nothing.
#
# Environment: OUT (where dumps and logs go; default /tmp), PYTHON (default python3),
# MOE_REFERENCE_BIN (default bin/moe-reference), STEPS (default 10),
# CONFIGS (default "a b"; "a b c" adds a third), DEVICES (default: "cpu", plus "cuda" when
# nvidia-smi works), TORCH_DEVICE (passed to
# torch_reference.py --device; default: cuda when torch sees a GPU, else cpu).
# Exit status: 0 when every comparison passes, 1 otherwise, 2 when nothing could run.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2

OUTDIR=${OUT:-/tmp}
PY=${PYTHON:-python3}
BIN=${MOE_REFERENCE_BIN:-bin/moe-reference}
STEPS=${STEPS:-10}
export PYTHONUNBUFFERED=1
export MOE_NO_DOWNLOAD=1   # the data file is in the repository; never reach for the network

if [ ! -x "$BIN" ]; then
    echo "run_reference.sh: $BIN not found. Build it first:"
    echo "  make CUDA=0 bin/moe-reference     # CPU only"
    echo "  make bin/moe-reference            # with the CUDA backend (nvcc found)"
    exit 2
fi
if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
    echo "run_reference.sh: $PY cannot import torch: pip install torch"
    exit 2
fi
mkdir -p "$OUTDIR" || exit 2

# Common to both: small enough that everything (CPU and CUDA, C and PyTorch) takes well
# under two minutes; two micro-batches per step so gradient accumulation is exercised,
# warmup then cosine decay inside the 10 steps so the schedule is too.
COMMON=(--hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 4
        --global-batch-size 8 --lr 3e-3 --lr-warmup-iters 2 --train-iters 10
        --weight-decay 0.1 --sample-length 0)

# a: softmax top-2 + shared expert + QK-norm + a dense first layer; clip below the
#    initial gradient norm so clipping is exercised.
CONFIG_a=(--num-layers 3 --moe-layer-freq 0,1,1 --num-query-groups 2 --ffn-hidden-size 96
          --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 32
          --moe-shared-expert-intermediate-size 32 --qk-layernorm
          --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
          --moe-z-loss-coeff 1e-3 --clip-grad 0.5)
DESC_a="softmax top-2, shared expert, qk-norm, dense layer 0"

# b: sigmoid + expert bias (aux-loss-free) + group-limited routing + per-sequence aux loss
#    + top-k scaling; multi-query attention (one KV head).
CONFIG_b=(--num-layers 2 --num-query-groups 1 --num-experts 16 --moe-router-topk 4
          --moe-ffn-hidden-size 16 --moe-router-score-function sigmoid
          --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-2
          --moe-router-num-groups 4 --moe-router-group-topk 2
          --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-2
          --moe-z-loss-coeff 1e-3 --moe-router-topk-scaling-factor 2.5 --clip-grad 1.0)
DESC_b="sigmoid + expert bias, group-limited 2/4, seq aux loss, scale 2.5"

# c (only with CONFIGS="a b c"): the remaining router variant, pre-softmax, group-limited
#    and scaled, every other layer MoE (Megatron's integer --moe-layer-freq), plain
#    multi-head attention, no gradient accumulation, linear decay without warmup.
CONFIG_c=(--num-layers 2 --moe-layer-freq 2 --num-query-groups 4 --ffn-hidden-size 64
          --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-router-pre-softmax
          --moe-router-num-groups 4 --moe-router-group-topk 2
          --moe-router-topk-scaling-factor 1.5 --global-batch-size 4
          --lr-warmup-iters 0 --lr-decay-style linear)
DESC_c="softmax pre-softmax, group-limited 2/4, scale 1.5, MoE every 2nd layer"

if [ -n "${DEVICES:-}" ]; then
    read -r -a devices <<< "$DEVICES"
else
    devices=(cpu)
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        devices+=(cuda)
    fi
fi
torch_dev=()
[ -n "${TORCH_DEVICE:-}" ] && torch_dev=(--device "$TORCH_DEVICE")

rows=()
fail=0
start=$(date +%s)
read -r -a configs <<< "${CONFIGS:-a b}"
for cfg in "${configs[@]}"; do
    if ! declare -p "CONFIG_$cfg" >/dev/null 2>&1; then
        echo "run_reference.sh: unknown config '$cfg' in CONFIGS (known: a b c)"
        exit 2
    fi
    declare -n flags="CONFIG_$cfg"
    declare -n desc="DESC_$cfg"
    for dev in "${devices[@]}"; do
        # the C CPU run is checked against fp64 and fp32 references, the CUDA run against fp32
        if [ "$dev" = cpu ]; then dtypes=(fp64 fp32); else dtypes=(fp32); fi
        dir="$OUTDIR/reference_${cfg}_${dev}"
        log="$OUTDIR/reference_${cfg}_${dev}.log"
        echo "== config $cfg ($desc), C on $dev -> $log"
        rm -rf "$dir"
        {
            echo "\$ $BIN --out $dir --steps $STEPS --device $dev ${COMMON[*]} ${flags[*]}"
            "$BIN" --out "$dir" --steps "$STEPS" --device "$dev" "${COMMON[@]}" "${flags[@]}"
        } > "$log" 2>&1
        rc=$?
        if [ $rc -ne 0 ]; then
            echo "   bin/moe-reference failed (exit $rc):"
            grep -v "^\$ " "$log" | tail -n 3 | sed "s/^/   | /"
            rows+=("$(printf '%-6s %-5s %-12s %-11s %-11s %-11s %s' "$cfg" "$dev" "-" "-" "-" "-" "FAIL (C run, exit $rc)")")
            fail=1
            continue
        fi
        for dt in "${dtypes[@]}"; do
            echo "\$ $PY tools/torch_reference.py $dir --dtype $dt ${torch_dev[*]}" >> "$log"
            "$PY" tools/torch_reference.py "$dir" --dtype "$dt" "${torch_dev[@]}" >> "$log" 2>&1
            prc=$?
            sum=$(grep '^SUMMARY' "$log" | tail -n 1)
            get() { sed -n "s/.*$1=\([^ ]*\).*/\1/p" <<< "$sum"; }
            if [ $prc -eq 0 ]; then
                verdict=PASS
            elif [ -n "$sum" ]; then
                verdict=FAIL; fail=1
            else
                verdict="FAIL (reference exit $prc)"; fail=1
                grep -v "^\$ " "$log" | tail -n 3 | sed "s/^/   | /"
            fi
            ref=$(get reference); ref=${ref:-$dt}
            rows+=("$(printf '%-6s %-5s %-12s %-11s %-11s %-11s %s' "$cfg" "$dev" "$ref" \
                "$(get logits_rel)" "$(get grad_rel)" "$(get train_abs)" "$verdict")")
            echo "   torch $ref: $verdict (logits rel $(get logits_rel), worst grad rel" \
                 "$(get grad_rel), worst loss diff $(get train_abs))"
            # keep the SUMMARY of the next reference run distinguishable
            echo "(end of $dt reference)" >> "$log"
        done
    done
done

echo
echo "moe.c vs PyTorch reference ($(( $(date +%s) - start )) s; logs: $OUTDIR/reference_*.log)"
for cfg in "${configs[@]}"; do
    declare -n desc="DESC_$cfg"
    echo "  $cfg: $desc"
done
echo "  tolerances: C on cpu  -> logits rel 1e-4, losses rel 1e-4, grads rel 1e-3, 10-step losses abs 1e-3"
echo "              C on cuda -> logits rel 2e-2, losses abs 2e-2, grads rel 5e-2, 10-step losses abs 5e-2"
printf '%-6s %-5s %-12s %-11s %-11s %-11s %s\n' config C torch "logits rel" "worst grad" "loss diff" result
for r in "${rows[@]}"; do
    echo "$r"
done
if [ $fail -eq 0 ]; then
    echo "ALL PASSED"
else
    echo "SOME FAILED (see the logs above)"
fi
exit $fail
