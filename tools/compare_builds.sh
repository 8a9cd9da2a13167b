#!/usr/bin/env bash
#
# usage (on a GPU machine): tools/compare_builds.sh BASE_TREE   -> logs and tables in $OUT
#   git archive <old-commit> | tar -x -C /tmp/base && tools/compare_builds.sh /tmp/base
# The restructuring of the Part II foundations was checked with it (docs/results/ii-foundations.md).
# Build the base tree ($BASE, e.g. a "git archive" of an older commit) and this tree, run the
# GPU suite and the MPI suite over NCCL (1 rank) on this tree, then the chapter 01/03
# benchmarks, moe-bench and 60 steps of the GPU preset on both, alternating.
set -uo pipefail
root=$PWD; BASE=${1:?usage: tools/compare_builds.sh BASE_TREE (a copy of the older tree)}; BASE=$(cd "$BASE" && pwd)
chk=${MOE_CHECK_DIR:-$root/gpu_tmp/chk}   # Check headers and static libs (tools/README.md, "Building on a GPU machine")
OUT=${OUT:-/tmp/compare}; mkdir -p "$OUT"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
build() { # dir label
  (cd $1 && MOE_GIT_COMMIT=$2 make -j16 JOBS=16 CHECK_DIR="$chk" \
    all build/tests/gpu build/tests/mpi > $OUT/$2-build.log 2>&1) || { echo "BUILD FAILED $2"; tail -30 $OUT/$2-build.log; exit 1; }
}
ln -sf $root/data/tinyshakespeare.txt $BASE/data/tinyshakespeare.txt
build $BASE base & build . new; wait
echo "== GPU suite (new)"; ./build/tests/gpu > $OUT/new-gpu.log 2>&1; echo "rc=$?"; grep -E "Checks|Fail|fail" $OUT/new-gpu.log | tail -5
echo "== MPI suite over NCCL, 1 rank (new)"; MOE_TEST_DEVICE=cuda CK_FORK=no mpirun --allow-run-as-root -np 1 ./build/tests/mpi > $OUT/new-mpi-nccl.log 2>&1; echo "rc=$?"; grep -E "Checks" $OUT/new-mpi-nccl.log
echo "== one-rank GPU training without mpirun (watchdog on)"; ./bin/moe-train --preset gpu --train-iters 3 --sample-length 0 > $OUT/new-train3.log 2>&1; echo "rc=$?"; tail -2 $OUT/new-train3.log
for round in 1 2; do for t in base new; do
  d=$root; [ $t = base ] && d=$BASE
  echo "== round $round: $t"
  (cd $d && MOE_GIT_COMMIT=$t ./bin/ch03_grouped_gemm_bench > $OUT/$t-ch03-$round.txt 2>&1; grep "all six" $OUT/$t-ch03-$round.txt)
  (cd $d && MOE_GIT_COMMIT=$t ./bin/ch01_moe_layer_bench --impl loop,grouped --check=$([ $round = 1 ] && echo true || echo false) > $OUT/$t-ch01-$round.txt 2>&1; grep "^| [qm]" $OUT/$t-ch01-$round.txt)
  (cd $d && ./bin/moe-bench > $OUT/$t-moebench-$round.txt 2>&1; tail -1 $OUT/$t-moebench-$round.txt)
  (cd $d && ./bin/moe-train --preset gpu --train-iters 60 --eval-interval 1000 --sample-length 0 --seed 1 > $OUT/$t-train-$round.log 2>&1; tail -3 $OUT/$t-train-$round.log)
done; done
