// What a launch of the pair form's shape costs before its kernel runs, by launch API (docs/perf-notes.md,
// "Where it stands (a2d3845)"): an eager call pays the host time up to the launch plus the launch's own
// latency, and the pair form is launched with cudaLaunchKernelEx and a cluster-dimension attribute.
// Three forms of one empty kernel of the fused kernel's shape (512 threads, kSharedBytes of dynamic
// shared memory, 128 CTAs):
//
//   ex_attr   cudaLaunchKernelEx with cudaLaunchAttributeClusterDimension {2, 1, 1} (the pair form today)
//   static    a kernel compiled with __cluster_dims__(2, 1, 1), launched with <<<>>>
//   plain     no cluster, <<<>>> (the fused kernel's launch)
//
// For each: the host time of one launch call (median of 2000; each launch is timed alone, after a
// synchronisation, so this is the API call's own time), and
// the time from a start event to the end of the empty kernel on an idle GPU (CUDA events, median of 2000),
// which holds the API call and the launch latency.
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -I csrc/kda/sm90 \
//        -o cluster_launch_cost benchmarks/microbench/cluster_launch_cost.cu && ./cluster_launch_cost
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "shared_storage.cuh"  // kSharedBytes: the fused kernel's dynamic shared memory

#include "cluster_launch.h"  // launch_in_clusters_of_two
#include "cuda_check.h"  // CHECK

struct Params {
  int* out;
  char pad[1024];  // about the size of KdaKernelParams (four tensor maps and the problem)
};

__global__ void empty_plain(Params p) {
  if (threadIdx.x == 0 && p.out != nullptr) p.out[blockIdx.x] = 1;
}
__global__ void __cluster_dims__(2, 1, 1) empty_static(Params p) {
  if (threadIdx.x == 0 && p.out != nullptr) p.out[blockIdx.x] = 1;
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main() {
  constexpr int kGrid = 128, kThreads = 512, kReps = 2000;
  const int smem = cula::kda::sm90::kSharedBytes;
  int* out = nullptr;
  CHECK(cudaMalloc(&out, kGrid * sizeof(int)));
  Params p{};
  p.out = out;
  CHECK(cudaFuncSetAttribute(empty_plain, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CHECK(cudaFuncSetAttribute(empty_static, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  const auto launch = [&](int form) -> cudaError_t {
    if (form == 0) return launch_in_clusters_of_two(empty_plain, p, kGrid, kThreads, smem, stream);
    if (form == 1) {
      empty_static<<<kGrid, kThreads, smem, stream>>>(p);
    } else {
      empty_plain<<<kGrid, kThreads, smem, stream>>>(p);
    }
    return cudaGetLastError();
  };
  const char* names[3] = {"ex_attr", "static", "plain"};
  cudaEvent_t start, end;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&end));
  for (int form = 0; form < 3; ++form) {
    for (int i = 0; i < 50; ++i) CHECK(launch(form));
    CHECK(cudaStreamSynchronize(stream));
  }
  // Interleaved by rep, so that clock and machine drifts hit the three forms alike.
  std::vector<double> host[3], idle[3];
  for (int i = 0; i < kReps; ++i) {
    for (int form = 0; form < 3; ++form) {
      CHECK(cudaStreamSynchronize(stream));
      const auto t0 = std::chrono::steady_clock::now();
      CHECK(launch(form));
      const auto t1 = std::chrono::steady_clock::now();
      host[form].push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      CHECK(cudaStreamSynchronize(stream));
      CHECK(cudaEventRecord(start, stream));
      CHECK(launch(form));
      CHECK(cudaEventRecord(end, stream));
      CHECK(cudaEventSynchronize(end));
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, start, end));
      idle[form].push_back(1e3 * ms);
    }
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s: %d CTAs x %d threads, %d B dynamic shared memory, %d reps interleaved\n", prop.name, kGrid,
              kThreads, smem, kReps);
  for (int form = 0; form < 3; ++form)
    std::printf("  %-8s launch call %.2f us (host), start event -> kernel end %.2f us (idle GPU)\n", names[form],
                median(host[form]), median(idle[form]));
  return 0;
}
