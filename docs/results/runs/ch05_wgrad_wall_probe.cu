// What an H100's HBM gives a plain kernel, for docs/results/05-fp8-nvfp4.md ("The wgrad wall
// under FP8"): streaming memset / store / read / += over 6 GB, then the wgrad epilogue's own
// pattern (dW [128][3072][4096] fp32 written in 128 x 256 tiles by persistent CTAs, in the
// kernel's banded order and n-fastest, storing or adding, 256 or 1024 threads a CTA).
// Not part of the build: nvcc -O3 -arch=sm_90 -o probe ch05_wgrad_wall_probe.cu && ./probe
#include <cstdio>
#include <cuda_runtime.h>
__global__ void store(float4 *p, size_t n) { for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = make_float4(1, 2, 3, 4); }
__global__ void addk(float4 *p, const float4 *q, size_t n) { for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) { float4 a = p[i], b = q[i % 1024]; a.x += b.x; a.y += b.y; a.z += b.z; a.w += b.w; p[i] = a; } }
__global__ void readk(const float4 *p, size_t n, float *out) { float s = 0; for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) { float4 a = p[i]; s += a.x + a.y + a.z + a.w; } if (s == 12345.f) *out = s; }
static void streaming() {
  size_t bytes = 6442450944ull, n = bytes / 16; float4 *p, *q; float *o;
  cudaMalloc(&p, bytes); cudaMalloc(&q, 1 << 20); cudaMalloc(&o, 4); cudaMemset(q, 0, 1 << 20);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b); float ms;
  for (int rep = 0; rep < 3; rep++) {
    cudaEventRecord(a); cudaMemsetAsync(p, 0, bytes); cudaEventRecord(b); cudaEventSynchronize(b); cudaEventElapsedTime(&ms, a, b);
    printf("memset   %.3f ms %.2f TB/s\n", ms, bytes / ms / 1e9);
    cudaEventRecord(a); store<<<132 * 8, 256>>>(p, n); cudaEventRecord(b); cudaEventSynchronize(b); cudaEventElapsedTime(&ms, a, b);
    printf("store    %.3f ms %.2f TB/s (write)\n", ms, bytes / ms / 1e9);
    cudaEventRecord(a); readk<<<132 * 8, 256>>>(p, n, o); cudaEventRecord(b); cudaEventSynchronize(b); cudaEventElapsedTime(&ms, a, b);
    printf("read     %.3f ms %.2f TB/s\n", ms, bytes / ms / 1e9);
    cudaEventRecord(a); addk<<<132 * 8, 256>>>(p, q, n); cudaEventRecord(b); cudaEventSynchronize(b); cudaEventElapsedTime(&ms, a, b);
    printf("add (+=) %.3f ms %.2f TB/s (read + write)\n", ms, 2 * bytes / ms / 1e9);
  }
}

constexpr int TM = 128, TN = 256;
template <int ORDER, int ADD>
__global__ void tiles(float *dw, int G, int M, int N) {
  const int mt = M / TM, nt = N / TN, per = mt * nt, total = G * per;
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    const int g = t / per, r = t % per;
    int mi, ni;
    if (ORDER == 0) { const int band = 8, b = r / (band * nt), in = r % (band * nt); const int rows = min(band, mt - b * band); mi = b * band + in % rows; ni = in / rows; }
    else { mi = r / nt; ni = r % nt; }
    float *base = dw + ((size_t)g * M + (size_t)mi * TM) * N + (size_t)ni * TN;
    for (int i = threadIdx.x; i < TM * TN / 4; i += blockDim.x) {
      const int row = i / (TN / 4), c4 = i % (TN / 4);
      float4 *p = (float4 *)(base + (size_t)row * N) + c4;
      if (ADD) { float4 v = *p; v.x += 1; v.y += 1; v.z += 1; v.w += 1; *p = v; }
      else *p = make_float4(1, 2, 3, 4);
    }
  }
}
static void tile_pattern() {
  const int G = 128, M = 3072, N = 4096; size_t bytes = (size_t)G * M * N * 4;
  float *p; cudaMalloc(&p, bytes); cudaMemset(p, 0, bytes);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b); float ms;
  for (int rep = 0; rep < 2; rep++) {
#define RUN(O, A, T) cudaEventRecord(a); tiles<O, A><<<132, T>>>(p, G, M, N); cudaEventRecord(b); cudaEventSynchronize(b); cudaEventElapsedTime(&ms, a, b); \
    printf("order %s %s threads %d: %.3f ms, %.2f TB/s\n", O ? "n-fastest" : "band8", A ? "add  " : "store", T, ms, (A ? 2 : 1) * bytes / ms / 1e9);
    RUN(0, 0, 256) RUN(1, 0, 256) RUN(0, 1, 256) RUN(1, 1, 256) RUN(0, 0, 1024) RUN(0, 1, 1024)
  }
}

int main() {
  streaming();
  tile_pattern();
  return 0;
}
