// How fast an SM issues straight-line code, by the code's size and by how many SMs run it at once:
// the instruction cache's capacity and what a miss costs when many SMs miss together.
//
// Why: the pair form's chunk (docs/perf-notes.md, "Where it stands (6588db9)") runs ~73 KB of hot
// code per SM, mostly without loops, and slows by ~10 % from 8 to 64 tiles (16 to 128 busy SMs)
// with ncu's no_instruction stall growing; its slowest SMs sit at fixed places of each SM group.
// This probe isolates that: one CTA per SM (its dynamic shared memory asks for most of the SM),
// every warp loops over a body of `kKB` KB of FFMAs (64 per KB, 16 bytes each; 8 independent
// chains, or one dependent chain for a quarter of the issue demand; no loads, no branches inside the
// body), the first pass untimed (cold code), then `iters` passes timed with clock64 per warp. With
// `copies` 4 the four warpgroups run four different copies of the body (as the kernel's roles do:
// every warp scheduler holds one warp of each), so the SM's hot code is four times the body. A
// `mode` other than 0 makes only chosen SMs work (the other CTAs of a full grid return at once):
// even ids, ids below 66, every fourth id, odd ids.
//
// Output per (copies, threads, chains, body KB, grid, mode): cycles per FFMA per warp (median and
// max over warps, and the median over SMs of each SM's slowest warp; with per_sm, each working SM's
// slowest warp by SM id). One warp per scheduler issues at most one FFMA a cycle (1.0); four warps
// per scheduler share it (4.0). Results on an H100: docs/perf-notes.md, "Where it stands (e1a6c7a)".
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -o icache_probe \
//        benchmarks/microbench/icache_probe.cu && ./icache_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "cuda_check.h"  // CHECK

namespace {

constexpr int kSmemBytes = 160 * 1024;  // one CTA per SM

#define FMA8                                                                                             \
  asm volatile(                                                                                          \
      "fma.rn.f32 %0, %0, %8, %9;\n\tfma.rn.f32 %1, %1, %8, %9;\n\tfma.rn.f32 %2, %2, %8, %9;\n\t"      \
      "fma.rn.f32 %3, %3, %8, %9;\n\tfma.rn.f32 %4, %4, %8, %9;\n\tfma.rn.f32 %5, %5, %8, %9;\n\t"      \
      "fma.rn.f32 %6, %6, %8, %9;\n\tfma.rn.f32 %7, %7, %8, %9;"                                          \
      : "+f"(a[0]), "+f"(a[1]), "+f"(a[2]), "+f"(a[3]), "+f"(a[4]), "+f"(a[5]), "+f"(a[6]), "+f"(a[7]) \
      : "f"(b), "f"(c))

// One dependent chain: each FFMA waits for the one before (~4 cycles), a quarter of the issue rate.
#define FMA8_CHAIN                                                                                      \
  asm volatile(                                                                                         \
      "fma.rn.f32 %0, %0, %1, %2;\n\tfma.rn.f32 %0, %0, %1, %2;\n\tfma.rn.f32 %0, %0, %1, %2;\n\t"     \
      "fma.rn.f32 %0, %0, %1, %2;\n\tfma.rn.f32 %0, %0, %1, %2;\n\tfma.rn.f32 %0, %0, %1, %2;\n\t"     \
      "fma.rn.f32 %0, %0, %1, %2;\n\tfma.rn.f32 %0, %0, %1, %2;"                                         \
      : "+f"(a[0])                                                                                      \
      : "f"(b), "f"(c))

// kKB KB of FFMAs in a row (64 per KB) (8 independent chains, or one with kChain1); kCopy only makes each
// copy's constant (and so its code) its own.
template <int kCopy, int kKB, bool kChain1>
__device__ __forceinline__ void body(float (&a)[8], float b, float c0) {
  const float c = c0 + float(kCopy);
#pragma unroll
  for (int i = 0; i < kKB * 8; ++i) {
    if constexpr (kChain1) FMA8_CHAIN; else FMA8;
  }
}

// active_mode: which SMs work (the others' CTAs return at once): 0 every CTA, 1 even SM ids (one
// SM of each pair), 2 SM ids below 66, 3 SM ids divisible by 4, 4 odd SM ids.
__device__ __forceinline__ bool active(int mode, unsigned sm) {
  switch (mode) {
    case 1: return sm % 2 == 0;
    case 2: return sm < 66;
    case 3: return sm % 4 == 0;
    case 4: return sm % 2 == 1;
    default: return true;
  }
}

template <int kKB, int kCopies, bool kChain1>
__global__ void __launch_bounds__(512, 1) probe(float* out, long long* cycles, int iters, float b, float c, int mode) {
  extern __shared__ char smem[];
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  if (threadIdx.x == 0) cycles[gridDim.x * (blockDim.x / 32) + blockIdx.x] = sm;
  if (!active(mode, sm)) {
    cycles[blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32] = -1;
    return;
  }
  float a[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) a[j] = float(threadIdx.x + j);
  const int warp = threadIdx.x / 32;
  const int copy = (warp / 4) % kCopies;
  long long t0 = 0;
#pragma unroll 1
  for (int it = 0; it <= iters; ++it) {
    if (it == 1) t0 = clock64();
    switch (copy) {
      case 0: body<0, kKB, kChain1>(a, b, c); break;
      case 1: if constexpr (kCopies > 1) body<1, kKB, kChain1>(a, b, c); break;
      case 2: if constexpr (kCopies > 2) body<2, kKB, kChain1>(a, b, c); break;
      default: if constexpr (kCopies > 3) body<3, kKB, kChain1>(a, b, c); break;
    }
  }
  const long long t1 = clock64();
  if (threadIdx.x % 32 == 0) cycles[blockIdx.x * (blockDim.x / 32) + warp] = t1 - t0;
  float s = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) s += a[j];
  if (s == 12345.f) out[threadIdx.x] = s + float(smem[threadIdx.x]);  // keeps the FFMAs
}

const char* kModeName[] = {"every SM", "even SMs", "SMs < 66", "SMs % 4 == 0", "odd SMs"};

// One line per grid (mode 0) or per mode (grid = every SM): cycles per FFMA per warp over the
// working CTAs; with `per_sm`, each working SM's slowest warp by SM id too.
template <int kKB, int kCopies, bool kChain1 = false>
int run(int threads, std::initializer_list<int> grids, std::initializer_list<int> modes, bool per_sm = false) {
  static float* out = nullptr;
  static long long* d_cycles = nullptr;
  if (out == nullptr) {
    CHECK(cudaMalloc(&out, 4096));
    CHECK(cudaMalloc(&d_cycles, 132 * 17 * sizeof(long long) * 2));
  }
  auto kernel = probe<kKB, kCopies, kChain1>;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int iters = 20;
  const double ffma = double(iters) * kKB * 64;
  for (int mode : modes) {
    for (int grid : grids) {
      if (grid <= 0 || grid > sms) grid = sms;
      const int warps = threads / 32;
      std::vector<long long> h(size_t(grid) * (warps + 1));
      kernel<<<grid, threads, kSmemBytes>>>(out, d_cycles, iters, 1.0001f, 0.5f, mode);  // warm-up launch
      CHECK(cudaGetLastError());
      kernel<<<grid, threads, kSmemBytes>>>(out, d_cycles, iters, 1.0001f, 0.5f, mode);
      CHECK(cudaDeviceSynchronize());
      CHECK(cudaMemcpy(h.data(), d_cycles, h.size() * sizeof(long long), cudaMemcpyDeviceToHost));
      std::vector<double> per, slowest;
      std::vector<std::pair<long long, double>> by_sm;
      for (int g = 0; g < grid; ++g) {
        if (h[size_t(g) * warps] < 0) continue;
        double worst = 0;
        for (int w = 0; w < warps; ++w) {
          per.push_back(double(h[size_t(g) * warps + w]) / ffma);
          worst = std::max(worst, per.back());
        }
        slowest.push_back(worst);
        by_sm.emplace_back(h[size_t(grid) * warps + g], worst);
      }
      std::sort(per.begin(), per.end());
      std::sort(slowest.begin(), slowest.end());
      std::printf("copies %d threads %3d chains %d body %3d KB (SM hot %4d KB) grid %3d %-13s working %3zu: "
                  "cycles/FFMA/warp median %.2f max %.2f, SM's slowest warp median %.2f\n",
                  kCopies, threads, kChain1 ? 1 : 8, kKB, kKB * kCopies, grid, kModeName[mode], slowest.size(),
                  per[per.size() / 2], per.back(), slowest[slowest.size() / 2]);
      if (per_sm) {
        std::sort(by_sm.begin(), by_sm.end());
        std::printf("  per SM (id:cycles):");
        for (auto [sm, c] : by_sm) std::printf(" %lld:%.1f", sm, c);
        std::printf("\n");
      }
    }
  }
  return 0;
}

}  // namespace

int main() {
  // One copy, one warp per scheduler: the body's size against the cache.
  for (int ok : {run<8, 1>(128, {1, 132}, {0}), run<32, 1>(128, {1, 132}, {0}), run<64, 1>(128, {1, 132}, {0}),
                 run<128, 1>(128, {1, 132}, {0}), run<192, 1>(128, {1, 132}, {0})})
    if (ok) return 1;
  // Four copies, four warps per scheduler (the kernel's shape): SM hot code 4x the body. Where the
  // slowdown with many SMs starts.
  for (int ok : {run<8, 4>(512, {8, 64, 132}, {0}), run<10, 4>(512, {8, 64, 132}, {0}), run<12, 4>(512, {8, 64, 132}, {0}),
                 run<14, 4>(512, {8, 64, 132}, {0}), run<16, 4>(512, {8, 16, 32, 64, 132}, {0}, true),
                 run<20, 4>(512, {8, 64, 132}, {0})})
    if (ok) return 1;
  // Which SMs share what: 64 KB hot on chosen SMs of a full grid.
  if (run<16, 4>(512, {132}, {1, 2, 3, 4}, true)) return 1;
  // Less issue demand: one dependent chain per warp (a quarter of the rate), and two copies.
  for (int ok : {run<16, 4, true>(512, {8, 132}, {0}), run<32, 2>(256, {8, 132}, {0}), run<32, 2, true>(256, {8, 132}, {0})})
    if (ok) return 1;
  return 0;
}
