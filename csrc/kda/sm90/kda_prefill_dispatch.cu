// Runtime options -> kernel instantiation. Cheap options (state layout, initial/final state,
// beta dtype, varlen) are runtime flags; the ones that change the intra-chunk inner loops (gate
// activation, l2norm) and the tile schedule are template parameters, one instantiation per .cu
// under instantiations/. Also builds the TMA descriptors and picks the schedule and grid.
#include "kda_prefill_sm90.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "kernel_params.cuh"
#include "shared_storage.cuh"
#include "tensor_map.h"

namespace cula::kda {

namespace {
thread_local const char* g_last_error = "";

cudaError_t invalid(const char* why) {
  g_last_error = why;
  return cudaErrorInvalidValue;
}
}  // namespace

const char* kda_prefill_sm90_last_error() { return g_last_error; }

cudaError_t kda_prefill_sm90(const KdaPrefillParams& p, cudaStream_t stream) {
  g_last_error = "";
  if (p.head_dim != 128) return invalid("head_dim must be 128");
  if (p.num_qk_heads <= 0 || p.num_v_heads < p.num_qk_heads || p.num_v_heads % p.num_qk_heads != 0)
    return invalid("num_v_heads must be a positive multiple of num_qk_heads");
  if (p.batch <= 0 || p.seqlen < 0 || p.num_seqs <= 0) return invalid("batch, seqlen, num_seqs out of range");
  if (p.cu_seqlens != nullptr && p.batch != 1) return invalid("cu_seqlens requires batch == 1");
  if (p.cu_seqlens == nullptr && p.num_seqs != p.batch) return invalid("num_seqs must equal batch without cu_seqlens");
  if (!(p.scale > 0.f)) return invalid("scale must be > 0");
  if (p.use_gate_in_kernel && !(p.lower_bound < 0.f)) return invalid("lower_bound must be < 0");
  if (p.o == nullptr || p.beta == nullptr) return invalid("null output or beta");

  const int64_t tokens = int64_t(p.batch) * p.seqlen;
  if (tokens == 0) {
    // No token anywhere: every sequence is empty and its final state is its initial state.
    if (p.final_state == nullptr) return cudaSuccess;
    const size_t bytes = size_t(p.num_seqs) * p.num_v_heads * 128 * 128 * sizeof(float);
    return p.initial_state != nullptr
               ? cudaMemcpyAsync(p.final_state, p.initial_state, bytes, cudaMemcpyDeviceToDevice, stream)
               : cudaMemsetAsync(p.final_state, 0, bytes, stream);
  }
  if (p.q == nullptr || p.k == nullptr || p.v == nullptr || p.g == nullptr) return invalid("null input");

  sm90::KdaKernelParams kp;
  kp.problem = p;
  // [tokens, heads, 128] bf16 tensors, loaded as 64 x 64 boxes with 128B swizzle.
  cudaError_t err = cudaSuccess;
  if ((err = sm90::make_token_head_feature_map(&kp.tma_q, p.q, tokens, p.num_qk_heads)) != cudaSuccess) return err;
  if ((err = sm90::make_token_head_feature_map(&kp.tma_k, p.k, tokens, p.num_qk_heads)) != cudaSuccess) return err;
  if ((err = sm90::make_token_head_feature_map(&kp.tma_v, p.v, tokens, p.num_v_heads)) != cudaSuccess) return err;
  if ((err = sm90::make_token_head_feature_map(&kp.tma_g, p.g, tokens, p.num_v_heads)) != cudaSuccess) return err;

  // Tile schedule (tile_scheduler.cuh): one CTA per tile in index order, or, with
  // CULA_KDA_SCHEDULE=longest_first, longest first on one persistent CTA per SM for varlen
  // batches of more than one wave (within the limits of shared_storage.cuh). Index order is the
  // default: measured on H100 it is not slower on the benchmark's skewed batches, where the static
  // longest-first assignment loses up to 20% (docs/perf-notes.md).
  const int64_t num_tiles = int64_t(p.num_seqs) * p.num_v_heads;
  int sm_count = p.device_sm_count;
  if (sm_count <= 0) {
    int device = 0;
    if ((err = cudaGetDevice(&device)) != cudaSuccess) return err;
    if ((err = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess) return err;
  }
  const char* schedule = std::getenv("CULA_KDA_SCHEDULE");
  const bool want_longest_first = schedule != nullptr && std::strcmp(schedule, "longest_first") == 0;
  const bool longest_first = want_longest_first && p.cu_seqlens != nullptr && num_tiles > sm_count &&
                             p.num_seqs <= sm90::kSortMaxSeqs &&
                             (num_tiles + sm_count - 1) / sm_count <= sm90::kMaxTilesPerCta;
  if (longest_first) {
    if (p.use_gate_in_kernel)
      return p.use_qk_l2norm ? sm90::launch_kda_prefill_kernel<true, true, true>(kp, sm_count, stream)
                             : sm90::launch_kda_prefill_kernel<true, false, true>(kp, sm_count, stream);
    return p.use_qk_l2norm ? sm90::launch_kda_prefill_kernel<false, true, true>(kp, sm_count, stream)
                           : sm90::launch_kda_prefill_kernel<false, false, true>(kp, sm_count, stream);
  }
  const int grid = int(std::min<int64_t>(num_tiles, INT_MAX));
  if (p.use_gate_in_kernel)
    return p.use_qk_l2norm ? sm90::launch_kda_prefill_kernel<true, true, false>(kp, grid, stream)
                           : sm90::launch_kda_prefill_kernel<true, false, false>(kp, grid, stream);
  return p.use_qk_l2norm ? sm90::launch_kda_prefill_kernel<false, true, false>(kp, grid, stream)
                         : sm90::launch_kda_prefill_kernel<false, false, false>(kp, grid, stream);
}

}  // namespace cula::kda
