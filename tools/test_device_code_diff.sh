#!/usr/bin/env bash
# The test of tools/device_code_diff.py (make test): two small trees whose kernels differ in
# one of three entries, one template gaining a parameter that is 0 in the old instantiation.
# Needs nvcc; without it the test says so and passes.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
NVCC=${NVCC:-nvcc}
if ! command -v "$NVCC" >/dev/null; then
    echo "skipped: no nvcc (tools/device_code_diff.py compiles to PTX)"
    exit 0
fi
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
mkdir -p "$t/old/kernels" "$t/new/kernels"
cat >"$t/old/kernels/k.cu" <<'CU'
namespace {
template <int A> __global__ void scale(float *x, float s) { x[threadIdx.x] *= s + A; }
}
__global__ void add(float *x, float s) { x[threadIdx.x] += s; }
__global__ void sub(float *x, float s) { x[threadIdx.x] -= s; }
void launch(float *x) { scale<1><<<1, 32>>>(x, 2.0f); }
CU
# the same add, scale<1> with a new parameter at 0 (the same code), sub changed, mul new
cat >"$t/new/kernels/k.cu" <<'CU'
namespace {
template <int A, int B> __global__ void scale(float *x, float s) { x[threadIdx.x] *= B ? s : s + A; }
}
__global__ void add(float *x, float s) { x[threadIdx.x] += s; }
__global__ void sub(float *x, float s) { x[threadIdx.x] -= 2.0f * s; }
__global__ void mul(float *x, float s) { x[threadIdx.x] *= s; }
void launch(float *x) { scale<1, 0><<<1, 32>>>(x, 2.0f); }
CU
cd "$t/new"
set +e
out=$(NVCC=$NVCC python3 "$root/tools/device_code_diff.py" "$t/old" 2>&1)
rc=$?
set -e
echo "$out" | grep -q '^same     kernels/k.cu: _Z3addPff$'
echo "$out" | grep -q '^CHANGED  kernels/k.cu: _Z3subPff$'
echo "$out" | grep -q '^new      kernels/k.cu: _Z3mulPff$'
echo "$out" | grep -Eq '^same     kernels/k.cu: .*5scaleILi1EEEvPff$'
echo "$out" | grep -q '1 kernel(s) of the base tree changed'
[ "$rc" = 1 ]
same=$(NVCC=$NVCC python3 "$root/tools/device_code_diff.py" "$t/new" | tail -1)
[ "$same" = "device_code_diff: 0 kernel(s) of the base tree changed" ]
echo "device_code_diff: an unchanged kernel, one changed, one new, a template that gained a 0 parameter; exit status 1, and 0 against itself"
