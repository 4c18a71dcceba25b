// Host side of one kernel instantiation: TMA descriptors, launch configuration, launch.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>

#include "kda_prefill_kernel.cuh"
#include "kda_prefill_sm90.h"
#include "tensor_map.h"

namespace cula::kda::sm90 {

template <bool kGateInKernel, bool kL2Norm>
cudaError_t launch_kda_prefill(const KdaPrefillParams& params, cudaStream_t stream) {
  KdaKernelParams kp;
  kp.problem = params;
  const int64_t tokens = int64_t(params.batch) * params.seqlen;
  cudaError_t err = cudaSuccess;
  // [tokens, heads, 128] bf16 tensors, loaded as 64 x 64 boxes with 128B swizzle.
  if ((err = make_token_head_feature_map(&kp.tma_q, params.q, tokens, params.num_qk_heads)) != cudaSuccess) return err;
  if ((err = make_token_head_feature_map(&kp.tma_k, params.k, tokens, params.num_qk_heads)) != cudaSuccess) return err;
  if ((err = make_token_head_feature_map(&kp.tma_v, params.v, tokens, params.num_v_heads)) != cudaSuccess) return err;
  if ((err = make_token_head_feature_map(&kp.tma_g, params.g, tokens, params.num_v_heads)) != cudaSuccess) return err;

  auto kernel = kda_prefill_sm90_kernel<kGateInKernel, kL2Norm>;
  // The shared-memory opt-in is per device: remember it per device ordinal (idempotent, so two
  // threads racing to set it is harmless).
  static std::atomic<uint64_t> attribute_set_mask{0};
  int device = 0;
  if ((err = cudaGetDevice(&device)) != cudaSuccess) return err;
  const uint64_t bit = uint64_t(1) << (device & 63);
  if ((attribute_set_mask.load(std::memory_order_relaxed) & bit) == 0) {
    if ((err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes)) != cudaSuccess)
      return err;
    attribute_set_mask.fetch_or(bit, std::memory_order_relaxed);
  }
  const int64_t num_tiles = int64_t(params.num_seqs) * params.num_v_heads;
  const int grid = int(std::min<int64_t>(num_tiles, INT_MAX));
  kernel<<<grid, kThreads, kSharedBytes, stream>>>(kp);
  return cudaGetLastError();
}

}  // namespace cula::kda::sm90
