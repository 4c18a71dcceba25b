// Does the host time of a launch call depend on the kernel's parameter size or on the launch API?
// (docs/perf-notes.md, "Where it stands (f0a6b09)"). The eager fast path's launch call of the pair
// form took ~5 us of its ~20 us of host time on the H100 machines' CPUs, with KdaKernelParams at
// 896 bytes (four tensor maps and the problem) passed by value.
//
// One empty kernel of the fused kernel's shape (128 CTAs x 512 threads, 231424 B of dynamic shared
// memory) with 16, 256, 896 and 2048 bytes of parameters, launched as
//
//   cluster   cudaLaunchKernelEx with a cluster-dimension attribute {2, 1, 1} (the pair form's launch)
//   plain     <<<>>>, no cluster (the fused kernel's launch)
//   driver    cuLaunchKernelEx (through cudaGetDriverEntryPointByVersion) on the kernel's CUfunction
//             (cudaGetFuncBySymbol, once), with the cluster attribute: the runtime's layer skipped
//
// each from an idle GPU (a synchronisation before every launch, as the benchmark's eager calls) and
// back to back (a synchronisation every 50 launches). Prints the median host time of the launch
// call over 500 launches (after 100 untimed), twice.
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O2 -std=c++17 \
//        -o launch_param_cost benchmarks/microbench/launch_param_cost.cu && ./launch_param_cost
//
// Measured on 2026-11-27 (two H100 machines, Intel Xeon CPUs; this file's run and an earlier draft of
// it): 2.8-4.2 us for every size and API.
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "cluster_launch.h"  // launch_in_clusters_of_two
#include "cuda_check.h"  // CHECK

template <int N>
struct Params {
  int* out;
  char pad[N];
};
template <int N>
__global__ void empty_kernel(Params<N> p) {
  if (threadIdx.x == 0 && p.out != nullptr) p.out[blockIdx.x] = p.pad[N - 1];
}

enum class Api { kCluster, kPlain, kDriver };
constexpr int kGrid = 128, kThreads = 512, kSharedBytes = 231424;

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

static PFN_cuLaunchKernelEx_v11060 driver_launch() {
  static PFN_cuLaunchKernelEx_v11060 fn = nullptr;
  if (fn == nullptr) {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuLaunchKernelEx", &ptr, 11060, cudaEnableDefault, &status) == cudaSuccess &&
        status == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuLaunchKernelEx_v11060>(ptr);
  }
  return fn;
}

template <int N>
static cudaError_t launch(Api api, Params<N>& p, cudaStream_t stream) {
  if (api == Api::kPlain) {
    empty_kernel<N><<<kGrid, kThreads, kSharedBytes, stream>>>(p);
    return cudaGetLastError();
  }
  if (api == Api::kCluster) return launch_in_clusters_of_two(empty_kernel<N>, p, kGrid, kThreads, kSharedBytes, stream);
  static cudaFunction_t fn = nullptr;
  if (fn == nullptr) {
    const cudaError_t err = cudaGetFuncBySymbol(&fn, reinterpret_cast<const void*>(empty_kernel<N>));
    if (err != cudaSuccess) return err;
  }
  if (driver_launch() == nullptr) return cudaErrorNotSupported;
  CUlaunchAttribute attr[1];
  attr[0].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
  attr[0].value.clusterDim.x = 2;
  attr[0].value.clusterDim.y = 1;
  attr[0].value.clusterDim.z = 1;
  CUlaunchConfig cfg = {};
  cfg.gridDimX = kGrid;
  cfg.gridDimY = cfg.gridDimZ = 1;
  cfg.blockDimX = kThreads;
  cfg.blockDimY = cfg.blockDimZ = 1;
  cfg.sharedMemBytes = kSharedBytes;
  cfg.hStream = reinterpret_cast<CUstream>(stream);
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  void* args[1] = {&p};
  return driver_launch()(&cfg, reinterpret_cast<CUfunction>(fn), args, nullptr) == CUDA_SUCCESS ? cudaSuccess
                                                                                               : cudaErrorLaunchFailure;
}

template <int N>
static int run(int* out, cudaStream_t stream, Api api, bool idle) {
  CHECK(cudaFuncSetAttribute(empty_kernel<N>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes));
  Params<N> p{};
  p.out = out;
  std::vector<double> us;
  for (int i = 0; i < 600; ++i) {
    if (idle || i % 50 == 0) CHECK(cudaStreamSynchronize(stream));
    const auto t0 = std::chrono::steady_clock::now();
    const cudaError_t err = launch<N>(api, p, stream);
    const auto t1 = std::chrono::steady_clock::now();
    CHECK(err);
    if (i >= 100) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  CHECK(cudaStreamSynchronize(stream));
  const char* name = api == Api::kCluster ? "cluster" : api == Api::kPlain ? "plain" : "driver";
  std::printf("params %5d B  %-8s %-13s launch call %.2f us (median of 500)\n", int(sizeof(Params<N>)), name,
              idle ? "idle GPU" : "back to back", median(us));
  return 0;
}

int main() {
  int* out = nullptr;
  CHECK(cudaMalloc(&out, kGrid * sizeof(int)));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int rep = 0; rep < 2; ++rep)
    for (bool idle : {true, false})
      for (Api api : {Api::kCluster, Api::kPlain, Api::kDriver})
        if (run<8>(out, stream, api, idle) || run<248>(out, stream, api, idle) || run<888>(out, stream, api, idle) ||
            run<2040>(out, stream, api, idle))
          return 1;
  CHECK(cudaDeviceSynchronize());
  return 0;
}
