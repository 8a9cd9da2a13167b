#!/bin/sh
# Chapter 05: training in FP8 / NVFP4, emulated, on the CPU: the same model and batches in
# fp32 and under each recipe; prints one line per run (first loss, mean of the last 10 steps,
# validation loss at the end). Usage: chapters/05-fp8-nvfp4/train_cpu.sh [steps]
# (from the repository root, after `make CUDA=0`; about a minute with 200 steps).
set -e
STEPS=${1:-200}
MODEL="--device cpu --num-layers 2 --hidden-size 128 --num-attention-heads 4 --num-query-groups 4
 --seq-length 32 --micro-batch-size 4 --global-batch-size 8 --num-experts 4
 --moe-ffn-hidden-size 128 --ffn-hidden-size 128 --moe-shared-expert-intermediate-size 128
 --moe-layer-freq 2 --lr 3e-3 --lr-warmup-iters 2 --train-iters $STEPS --log-interval 1
 --eval-interval $STEPS"
echo "chapter 05: emulated low-precision training on the CPU | $(date -u '+%Y-%m-%d %H:%M UTC') | commit $(git rev-parse --short HEAD) | OMP_NUM_THREADS=${OMP_NUM_THREADS:-default}"
echo "model: $(echo $MODEL | tr '\n' ' ')"
printf '%-44s %8s %12s %9s %9s %9s\n' run "step 1" "last-10 mean" "vs fp32" "val loss" "vs fp32"
REF=""
VREF=""
for R in "fp32" "--fp8-format e4m3 --fp8-recipe tensorwise" "--fp8-format hybrid --fp8-recipe tensorwise" \
         "--fp8-format e4m3 --fp8-recipe blockwise" "--fp8-format hybrid --fp8-recipe blockwise" \
         "--fp8-format e4m3 --fp8-recipe mxfp8" "--fp4-format e2m1 --fp4-recipe nvfp4"; do
    F=$R; [ "$R" = fp32 ] && F=""
    OUT=$(MOE_NO_DOWNLOAD=1 bin/moe-train $MODEL $F 2>&1)
    echo "$OUT" | awk -v run="$R" -v steps="$STEPS" -v ref="$REF" -v vref="$VREF" '
        /^step / { split($2, a, "/"); s = a[1] + 0; l = $5 + 0;
                   if (s == 1) first = l; if (s > steps - 10) tail += l / 10 }
        /^eval/ { for (i = 1; i <= NF; i++) if ($i == "val") val = $(i+2) }
        END { rel = ref == "" ? "" : sprintf("%+.2f %%", 100 * (tail - ref) / ref);
              vrel = vref == "" ? "" : sprintf("%+.2f %%", 100 * (val - vref) / vref);
              printf "%-44s %8.4f %12.4f %9s %9.4f %9s\n", run, first, tail, rel, val, vrel }'
    if [ -z "$REF" ]; then
        REF=$(echo "$OUT" | awk -v steps="$STEPS" '/^step / { split($2, a, "/"); if (a[1] > steps - 10) t += $5 / 10 } END { printf "%.6f", t }')
        VREF=$(echo "$OUT" | awk '/^eval/ { for (i = 1; i <= NF; i++) if ($i == "val") v = $(i+2) } END { print v }')
    fi
done
