// Launch of one instantiation (gate form x l2norm x tile schedule or cooperative mode); the host-side setup
// (argument checks, TMA descriptors, the schedule and grid) is in kda_prefill_dispatch.cu.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>

#include "kda_prefill_kernel.cuh"
#include "kda_prefill_sm90.h"

namespace cula::kda::sm90 {

// The shared-memory opt-in is per device and kernel: remember it per device ordinal (idempotent,
// so two threads racing to set it is harmless).
template <typename Kernel>
cudaError_t opt_in_shared_memory(Kernel kernel, std::atomic<uint64_t>& set_mask) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const uint64_t bit = uint64_t(1) << (device & 63);
  if ((set_mask.load(std::memory_order_relaxed) & bit) == 0) {
    if ((err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes)) != cudaSuccess)
      return err;
    set_mask.fetch_or(bit, std::memory_order_relaxed);
  }
  return cudaSuccess;
}

// A launch of `kernel` over `grid` CTAs of the kernel's shape with launch attributes.
template <typename Kernel>
cudaError_t launch_with_attributes(Kernel kernel, const KdaKernelParams& kp, int grid, cudaStream_t stream,
                                   cudaLaunchAttribute* attributes, unsigned num_attributes) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(grid));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kSharedBytes;
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = num_attributes;
  return cudaLaunchKernelEx(&config, kernel, kp);
}

// Two-kernel form of the cooperative mode: the helpers' kernel, then the owners' (`owners`, the
// kCooperative kernel) by programmatic dependent launch (kernel_params.cuh: CooperativePlan).
template <bool kGateInKernel, bool kL2Norm, Decays kDecays, typename Kernel>
cudaError_t launch_helpers_then_owners(Kernel owners, const KdaKernelParams& kp, int grid, cudaStream_t stream) {
  auto helpers = kda_prefill_sm90_kernel<kGateInKernel, kL2Norm, false, KernelPass::kCoopHelpers, kDecays>;
  cudaError_t err = cudaSuccess;
  static std::atomic<uint64_t> helpers_mask{0};
  if ((err = opt_in_shared_memory(helpers, helpers_mask)) != cudaSuccess) return err;
  helpers<<<grid, kThreads, kSharedBytes, stream>>>(kp);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  return launch_with_attributes(owners, kp, grid, stream, attribute, kp.coop.overlap_owners ? 1 : 0);
}

// kFused: one kernel. kCooperative: one kernel, or (kp.coop.helper_kernel) the helpers' kernel and
// then the owners' (kernel_params.cuh: KernelPass), both over `grid` CTAs (one per SM).
// kFusedPair: `grid` CTAs in clusters of two (two per tile).
template <bool kGateInKernel, bool kL2Norm, bool kLongestFirst, KernelPass kPass, Decays kDecays>
cudaError_t launch_kda_prefill_kernel(const KdaKernelParams& kp, int grid, cudaStream_t stream) {
  static_assert(kPass == KernelPass::kFused || kPass == KernelPass::kCooperative || kPass == KernelPass::kFusedPair,
                "a launch is of a mode");
  auto kernel = kda_prefill_sm90_kernel<kGateInKernel, kL2Norm, kLongestFirst, kPass, kDecays>;
  static std::atomic<uint64_t> set_mask{0};
  cudaError_t err = opt_in_shared_memory(kernel, set_mask);
  if (err != cudaSuccess) return err;
  if constexpr (kPass == KernelPass::kFusedPair) {
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeClusterDimension;
    attribute[0].val.clusterDim.x = 2;
    attribute[0].val.clusterDim.y = 1;
    attribute[0].val.clusterDim.z = 1;
    return launch_with_attributes(kernel, kp, grid, stream, attribute, 1);
  }
  if (kPass == KernelPass::kFused || !kp.coop.helper_kernel) {
    kernel<<<grid, kThreads, kSharedBytes, stream>>>(kp);
    return cudaGetLastError();
  }
  if constexpr (kPass == KernelPass::kCooperative)
    return launch_helpers_then_owners<kGateInKernel, kL2Norm, kDecays>(kernel, kp, grid, stream);
  return cudaErrorInvalidValue;  // not reached: a fused launch returned above
}

}  // namespace cula::kda::sm90
