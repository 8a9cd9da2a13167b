#!/bin/bash
# Resume under MPI reproduces the loss curve bit for bit, through bin/moe-train on 2 CPU
# ranks, at expert-parallel size 2 and then at context-parallel size 2 x expert-parallel
# size 2 (chapter 07: the CP ranks hold the same weights; make test-mpi runs it):
#   1. the reference: 12 steps without interruption;
#   2. the same run saving every 3 steps, whose last rank dies by SIGKILL before step 8
#      (MOE_TEST_KILL_AT_STEP, a test hook of moe-train): the job must fail, and the latest
#      checkpoint must be the one of step 6;
#   3. resume from it to step 12: steps 7..12 must log the reference's losses exactly
#      (metrics numbers carry the digits that read back as the same double).
# MPIRUN: the mpirun command line (the Makefile's). Exits non-zero with a message on failure.
set -u
MPIRUN=${MPIRUN:-mpirun}
dir=$(mktemp -d "${TMPDIR:-/tmp}/moe_ckpt_mpi.XXXXXX")
trap 'rm -rf "$dir"' EXIT
flags="--num-layers 2 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2
  --seq-length 16 --micro-batch-size 2 --global-batch-size 8 --num-experts 8
  --moe-ffn-hidden-size 16 --ffn-hidden-size 32 --moe-layer-freq 0,1
  --moe-router-score-function sigmoid --moe-router-enable-expert-bias --lr 3e-3
  --lr-warmup-iters 2 --lr-decay-iters 12 --eval-iters 1 --sample-length 0 --device cpu
  --expert-model-parallel-size 2"
layouts=("" "--context-parallel-size 2")
run() { timeout 120 $MPIRUN -x OMP_NUM_THREADS=1 -x MOE_NO_DOWNLOAD=1 "$@" >> "$dir/log" 2>&1; }
fail() { echo "FAIL: $*"; cat "$dir/log"; exit 1; }
losses() { grep '"event":"train"' "$1" | sed -E 's/.*"step":([0-9]+),"loss":([^,}]*).*/\1 \2/'; }
export OMP_NUM_THREADS=1 MOE_NO_DOWNLOAD=1

for i in "${!layouts[@]}"; do
  layout=${layouts[$i]}
  run -np 2 ./bin/moe-train $flags $layout --train-iters 12 --metrics-file "$dir/ref$i.jsonl" ||
    fail "the reference run failed"
  run -x MOE_TEST_KILL_AT_STEP=7 -np 2 ./bin/moe-train $flags $layout --train-iters 12 \
    --save "$dir/ckpt$i" --save-interval 3 && fail "the job whose rank was killed succeeded"
  [ "$(cat "$dir/ckpt$i/latest_checkpointed_iteration.txt" 2>/dev/null)" = 6 ] ||
    fail "after the kill the latest checkpoint is not the one of step 6"
  run -np 2 ./bin/moe-train $flags $layout --train-iters 12 --load "$dir/ckpt$i" --save "$dir/ckpt$i" \
    --metrics-file "$dir/resumed$i.jsonl" || fail "the resumed run failed"
  want=$(losses "$dir/ref$i.jsonl" | awk '$1 > 6')
  got=$(losses "$dir/resumed$i.jsonl")
  [ -n "$got" ] && [ "$got" = "$want" ] ||
    fail "resumed losses differ from the uninterrupted run's (step loss):
resumed:
$got
uninterrupted:
$want"
  echo "ok (${layout:-EP 2}): killed at step 7, resumed from step 6: steps 7-12 match the uninterrupted run bit for bit"
done
