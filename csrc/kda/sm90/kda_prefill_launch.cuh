// Host side of one kernel instantiation: TMA descriptors, launch configuration, launch.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
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
  static bool attribute_set = false;  // per instantiation; idempotent, so a race is harmless
  if (!attribute_set) {
    if ((err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes)) != cudaSuccess)
      return err;
    attribute_set = true;
  }
  const int64_t num_tiles = int64_t(params.num_seqs) * params.num_v_heads;
  const int grid = int(std::min<int64_t>(num_tiles, INT_MAX));
  kernel<<<grid, kThreads, kSharedBytes, stream>>>(kp);
  return cudaGetLastError();
}

}  // namespace cula::kda::sm90
