// C ABI of the SM90 kernel for callers without torch: the standalone binary
// (kda_standalone_main.cu) and anything that loads libcula_kda_sm90.so (e.g. through ctypes).
// The caller validates its arguments (cula.kda.kda_prefill does for the torch path); the
// launcher checks only what the kernel relies on.
#include <cuda_runtime.h>

#include "kda/sm90/kda_prefill_sm90.h"
#include "kda_capi.h"

extern "C" int cula_kda_prefill_sm90(const void* q, const void* k, const void* v, const void* g, const void* beta,
                                     const float* A_log, const float* dt_bias, const float* initial_state,
                                     const void* cu_seqlens, void* o, float* final_state, int batch, int seqlen,
                                     int num_seqs, int num_qk_heads, int num_v_heads, float scale, float lower_bound,
                                     int flags, void* stream) {
  cula::kda::KdaPrefillParams p;
  p.q = q;
  p.k = k;
  p.v = v;
  p.g = g;
  p.beta = beta;
  p.A_log = A_log;
  p.dt_bias = dt_bias;
  p.initial_state = initial_state;
  p.cu_seqlens = cu_seqlens;
  p.o = o;
  p.final_state = final_state;
  p.batch = batch;
  p.seqlen = seqlen;
  p.num_seqs = num_seqs;
  p.num_qk_heads = num_qk_heads;
  p.num_v_heads = num_v_heads;
  p.scale = scale;
  p.lower_bound = lower_bound;
  p.use_gate_in_kernel = flags & CULA_KDA_GATE_IN_KERNEL;
  p.use_qk_l2norm = flags & CULA_KDA_QK_L2NORM;
  p.beta_is_bf16 = flags & CULA_KDA_BETA_BF16;
  p.cu_seqlens_is_int64 = flags & CULA_KDA_CU_SEQLENS_INT64;
  p.state_vk = flags & CULA_KDA_STATE_VK;
  p.beta_sigmoid = flags & CULA_KDA_BETA_SIGMOID;
  p.gate_softplus = (flags & CULA_KDA_GATE_SOFTPLUS) && p.use_gate_in_kernel;
  p.general_gates = p.gate_softplus;
  // Cooperative mode (few tiles): a stream-ordered workspace for this call.
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const size_t bytes = cula::kda::kda_prefill_sm90_workspace_bytes(p);
  if (bytes > 0) {
    const cudaError_t err = cudaMallocAsync(&p.workspace, bytes, s);
    if (err != cudaSuccess) return int(err);
    p.workspace_bytes = bytes;
  }
  const cudaError_t err = cula::kda::kda_prefill_sm90(p, s);
  if (p.workspace != nullptr) cudaFreeAsync(p.workspace, s);
  return int(err);
}

extern "C" const char* cula_kda_last_error() { return cula::kda::kda_prefill_sm90_last_error(); }
