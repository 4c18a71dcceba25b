// Runtime options -> kernel instantiation. Cheap options (state layout, initial/final state,
// beta dtype, varlen) are runtime flags; the ones that change the intra-chunk inner loops (gate
// activation, l2norm) are template parameters, one instantiation per .cu under instantiations/.
#include "kda_prefill_sm90.h"

#include <cuda_runtime.h>

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

  if (p.use_gate_in_kernel) {
    return p.use_qk_l2norm ? sm90::launch_kda_prefill<true, true>(p, stream)
                           : sm90::launch_kda_prefill<true, false>(p, stream);
  }
  return p.use_qk_l2norm ? sm90::launch_kda_prefill<false, true>(p, stream)
                         : sm90::launch_kda_prefill<false, false>(p, stream);
}

}  // namespace cula::kda
