// Standalone check/benchmark of the SM90 KDA prefill kernel without torch (CUDA runtime only).
// Random inputs drawn like a real model's (normalised q/k, raw gates with a lower bound, sigmoid
// beta); checks that every output element is written and finite and that two runs are
// bit-identical, then times the kernel with CUDA events.
//   usage: kda_standalone [B T H HV [iters]]
// CULA_STANDALONE_SEED=n: fixed inputs and a checksum of the outputs (builds compared bit for bit).
// CULA_STANDALONE_GATE=softplus: Kimi-Linear's softplus gate on the general-gate path instead,
// drawn as the benchmark draws it (A_log ~ N(0, 1), g ~ 2 N(0, 1)), no lower bound.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "kda_capi.h"

#define CHECK_CUDA(x)                                                                       \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

// Standard normal bf16 values drawn on the device: a counter-based hash of (seed, index)
// (splitmix64) gives two uniforms, Box-Muller one normal. Drawing q, k, v, g on the host with
// std::mt19937 took most of a minute at B=8 T=8192 H=64 (4 x 537M values) before any launch.
__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
__global__ void fill_normal_bf16(__nv_bfloat16* out, size_t n, uint64_t seed, float sigma) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint64_t h = splitmix64(seed ^ splitmix64(i));
    const float u1 = float((h >> 40) + 1) * 0x1p-24f;  // (0, 1]
    const float u2 = float(h & 0xffffffull) * 0x1p-24f;  // [0, 1)
    out[i] = __float2bfloat16(sigma * sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));
  }
}
static void* random_bf16(size_t n, uint64_t seed, float sigma = 1.f) {
  void* d;
  CHECK_CUDA(cudaMalloc(&d, n * 2));
  fill_normal_bf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(d), n, seed, sigma);
  CHECK_CUDA(cudaGetLastError());
  return d;
}

int main(int argc, char** argv) {
  const int B = argc > 4 ? std::atoi(argv[1]) : 2, T = argc > 4 ? std::atoi(argv[2]) : 8192;
  const int H = argc > 4 ? std::atoi(argv[3]) : 64, HV = argc > 4 ? std::atoi(argv[4]) : 64;
  const int iters = argc > 5 ? std::atoi(argv[5]) : 20;
  const int D = 128;
  // The C API takes each call's cooperative workspace from the device's default memory pool
  // (cudaMallocAsync / cudaFreeAsync on the call's stream). With the pool's default release
  // threshold (0) every synchronisation hands its memory back, so each timed call mapped its
  // workspace anew: on an H100 of 2026-11-27 B1 T8192 H64 (cooperative) timed 1.29-1.63 ms that way
  // and 0.71-0.73 ms with the memory kept, B1 T32768 H8 0.99-1.06 / 0.67 (the kernels' own CTAs
  // ended on time). Keep the pool's memory, as torch's caching allocator does on the extension's
  // path.
  {
    int device = 0;
    cudaMemPool_t pool;
    CHECK_CUDA(cudaGetDevice(&device));
    CHECK_CUDA(cudaDeviceGetDefaultMemPool(&pool, device));
    uint64_t keep = UINT64_MAX;
    CHECK_CUDA(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  }
  const char* gate_env = std::getenv("CULA_STANDALONE_GATE");
  const bool softplus = gate_env != nullptr && std::strcmp(gate_env, "softplus") == 0;
  const size_t nqk = size_t(B) * T * H * D, nv = size_t(B) * T * HV * D, nb = size_t(B) * T * HV;
  // CULA_STANDALONE_SEED=n: the same inputs in every run (and a checksum of the outputs printed),
  // so that two builds of the kernels can be compared bit for bit.
  const char* seed_env = std::getenv("CULA_STANDALONE_SEED");
  std::mt19937_64 rng(seed_env != nullptr ? std::strtoull(seed_env, nullptr, 10) : std::random_device{}());
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> beta(nb), dt(HV * D), alog(HV);
  for (auto& x : beta) x = 1.f / (1.f + std::exp(-normal(rng)));
  for (auto& x : dt) x = 0.1f * normal(rng);
  for (auto& x : alog) x = (softplus ? 1.f : 0.1f) * normal(rng);

  void *dq = random_bf16(nqk, rng()), *dk = random_bf16(nqk, rng()), *dv = random_bf16(nv, rng()),
       *dg = random_bf16(nv, rng(), softplus ? 2.f : 1.f);
  float *dbeta, *ddt, *dalog, *dstate;
  void* o;
  CHECK_CUDA(cudaMalloc(&dbeta, nb * 4));
  CHECK_CUDA(cudaMalloc(&ddt, dt.size() * 4));
  CHECK_CUDA(cudaMalloc(&dalog, alog.size() * 4));
  CHECK_CUDA(cudaMalloc(&dstate, size_t(B) * HV * D * D * 4));
  CHECK_CUDA(cudaMalloc(&o, nv * 2));
  CHECK_CUDA(cudaMemcpy(dbeta, beta.data(), nb * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(ddt, dt.data(), dt.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dalog, alog.data(), alog.size() * 4, cudaMemcpyHostToDevice));

  const int flags = CULA_KDA_GATE_IN_KERNEL | CULA_KDA_QK_L2NORM | (softplus ? CULA_KDA_GATE_SOFTPLUS : 0);
  auto run = [&] {
    int e = cula_kda_prefill_sm90(dq, dk, dv, dg, dbeta, dalog, ddt, nullptr, nullptr, o, dstate, B, T, B, H, HV,
                                  1.f / std::sqrt(float(D)), -5.f, flags, nullptr);
    if (e != 0) {
      std::fprintf(stderr, "launch failed: %s %s\n", cudaGetErrorString(cudaError_t(e)), cula_kda_last_error());
      std::exit(1);
    }
  };
  std::vector<uint16_t> out1(nv), out2(nv);
  CHECK_CUDA(cudaMemset(o, 0xFF, nv * 2));  // NaN poison
  run();
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaMemcpy(out1.data(), o, nv * 2, cudaMemcpyDeviceToHost));
  run();
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaMemcpy(out2.data(), o, nv * 2, cudaMemcpyDeviceToHost));
  size_t bad = 0;
  for (size_t i = 0; i < nv; ++i) {
    __nv_bfloat16_raw raw;
    raw.x = out1[i];
    if (!std::isfinite(__bfloat162float(__nv_bfloat16(raw)))) ++bad;
  }
  const bool same = std::memcmp(out1.data(), out2.data(), nv * 2) == 0;

  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  std::vector<float> ms(iters);
  for (int i = 0; i < iters; ++i) {
    CHECK_CUDA(cudaEventRecord(a));
    run();
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    CHECK_CUDA(cudaEventElapsedTime(&ms[i], a, b));
  }
  std::sort(ms.begin(), ms.end());
  if (seed_env != nullptr) {  // FNV-1a over o's bits and the final state's
    std::vector<float> state(size_t(B) * HV * D * D);
    CHECK_CUDA(cudaMemcpy(state.data(), dstate, state.size() * 4, cudaMemcpyDeviceToHost));
    const auto fnv = [](const void* data, size_t bytes) {
      uint64_t h = 0xcbf29ce484222325ull;
      for (size_t i = 0; i < bytes; ++i) h = (h ^ static_cast<const uint8_t*>(data)[i]) * 0x100000001b3ull;
      return h;
    };
    std::printf("checksum (seed %s): o %016llx final state %016llx\n", seed_env,
                (unsigned long long)fnv(out1.data(), nv * 2), (unsigned long long)fnv(state.data(), state.size() * 4));
  }
  std::printf("%sB=%d T=%d H=%d HV=%d: non-finite or unwritten outputs %zu, deterministic %s, median %.3f ms\n",
              softplus ? "softplus gate: " : "", B, T,
              H, HV, bad, same ? "yes" : "NO", ms[iters / 2]);
  return (bad == 0 && same) ? 0 : 1;
}
