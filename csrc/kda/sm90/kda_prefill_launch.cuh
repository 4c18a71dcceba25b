// Launch of one kernel instantiation (gate form x l2norm x tile schedule); the host-side setup
// (argument checks, TMA descriptors, the schedule and grid) is in kda_prefill_dispatch.cu.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>

#include "kda_prefill_kernel.cuh"
#include "kda_prefill_sm90.h"

namespace cula::kda::sm90 {

template <bool kGateInKernel, bool kL2Norm, bool kLongestFirst, KernelPass kPass, Decays kDecays>
cudaError_t launch_kda_prefill_kernel(const KdaKernelParams& kp, int grid, cudaStream_t stream) {
  auto kernel = kda_prefill_sm90_kernel<kGateInKernel, kL2Norm, kLongestFirst, kPass, kDecays>;
  // The shared-memory opt-in is per device: remember it per device ordinal (idempotent, so two
  // threads racing to set it is harmless).
  static std::atomic<uint64_t> attribute_set_mask{0};
  int device = 0;
  cudaError_t err = cudaSuccess;
  if ((err = cudaGetDevice(&device)) != cudaSuccess) return err;
  const uint64_t bit = uint64_t(1) << (device & 63);
  if ((attribute_set_mask.load(std::memory_order_relaxed) & bit) == 0) {
    if ((err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes)) != cudaSuccess)
      return err;
    attribute_set_mask.fetch_or(bit, std::memory_order_relaxed);
  }
  kernel<<<grid, kThreads, kSharedBytes, stream>>>(kp);
  return cudaGetLastError();
}

}  // namespace cula::kda::sm90
