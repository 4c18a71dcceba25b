// What the four TMA descriptors of a launch cost on the host: every eager call encodes q, k, v and
// g's maps (csrc/kda/sm90/tensor_map.cu: make_token_head_feature_map) before its launch, and
// B1 T1024 H64's eager time is ~9 us of host work, the launch and the kernel (docs/perf-notes.md).
//
// Times, on this machine's CPU (median of 21 rounds of 20000 calls each, ns per call):
//   encode      one make_token_head_feature_map of B1 T1024 H64's shape
//   encode4     the launch's four (q, k, v, g at four addresses)
//   copy        copying one ready 128-byte CUtensorMap (what a cache hit would cost, at least)
//
//   nvcc -O3 -std=c++17 -I csrc -I csrc/kda/sm90 -o tensor_map_encode_cost \
//        benchmarks/microbench/tensor_map_encode_cost.cu csrc/kda/sm90/tensor_map.cu && ./tensor_map_encode_cost
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#include "cuda_check.h"  // CHECK
#include "tensor_map.h"

namespace {
template <typename F>
double median_ns(F&& f, int calls) {
  std::vector<double> rounds;
  for (int r = 0; r < 21; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) f(i);
    const auto t1 = std::chrono::steady_clock::now();
    rounds.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count() / calls);
  }
  std::sort(rounds.begin(), rounds.end());
  return rounds[rounds.size() / 2];
}
}  // namespace

int main() {
  const int64_t tokens = 1024;
  const int heads = 64;
  void* buf = nullptr;
  CHECK(cudaMalloc(&buf, size_t(4) * tokens * heads * 128 * 2));
  char* base = static_cast<char*>(buf);
  const size_t tensor = size_t(tokens) * heads * 128 * 2;
  CUtensorMap maps[4];
  volatile int sink = 0;
  CHECK(cula::kda::sm90::make_token_head_feature_map(&maps[0], base, tokens, heads, 0, 0));
  const double one = median_ns(
      [&](int) { sink += int(cula::kda::sm90::make_token_head_feature_map(&maps[0], base, tokens, heads, 0, 0)); },
      20000);
  const double four = median_ns(
      [&](int) {
        for (int t = 0; t < 4; ++t)
          sink += int(cula::kda::sm90::make_token_head_feature_map(&maps[t], base + t * tensor, tokens, heads, 0, 0));
      },
      20000);
  CUtensorMap copy;
  const double copied = median_ns(
      [&](int i) {
        std::memcpy(&copy, &maps[i & 3], sizeof(copy));
        sink += int(reinterpret_cast<const unsigned char*>(&copy)[i & 127]);
      },
      20000);
  std::printf("tensor map encode cost (B1 T1024 H64 maps), ns per call, median of 21 x 20000:\n");
  std::printf("  encode   %8.1f\n  encode4  %8.1f\n  copy     %8.1f\n", one, four, copied);
  CHECK(cudaFree(buf));
  return sink == 12345 ? 2 : 0;
}
