// Plain-old-data description of one KDA prefill call, shared by the torch binding
// (csrc/api), the C ABI used by the standalone tools (csrc/standalone) and the kernel.
// Nothing in here depends on torch or on device code, so every front end fills the same struct.
#pragma once

#include <cstdint>

namespace cula::kda {

struct KdaPrefillParams {
  // ---- inputs (device pointers, all contiguous) ----------------------------------------
  const void* q = nullptr;              // bf16 [B, T, H, K]
  const void* k = nullptr;              // bf16 [B, T, H, K]
  const void* v = nullptr;              // bf16 [B, T, HV, V]
  const void* g = nullptr;              // bf16 [B, T, HV, K]: raw gate or log decay (natural log)
  const void* beta = nullptr;           // fp32 or bf16 [B, T, HV]
  const float* A_log = nullptr;         // fp32 [HV] or null (gate in kernel only)
  const float* dt_bias = nullptr;       // fp32 [HV * K] or null (gate in kernel only)
  const float* initial_state = nullptr; // fp32 [N, HV, K, V] ("kv") or [N, HV, V, K] ("vk"), or null
  const void* cu_seqlens = nullptr;     // int32 or int64 [N + 1], or null (fixed-length batch)

  // ---- outputs -------------------------------------------------------------------------
  void* o = nullptr;                    // bf16 [B, T, HV, V]
  float* final_state = nullptr;         // fp32, layout as initial_state; null: not written

  // ---- sizes ---------------------------------------------------------------------------
  int batch = 0;         // B (1 with cu_seqlens)
  int seqlen = 0;        // T: tokens per batch row (the token count with cu_seqlens)
  int num_seqs = 0;      // N: B without cu_seqlens, len(cu_seqlens) - 1 with it
  int num_qk_heads = 0;  // H
  int num_v_heads = 0;   // HV, a multiple of H
  int head_dim = 128;    // K == V (the sm90 kernel supports 128 only)

  // ---- options -------------------------------------------------------------------------
  float scale = 0.f;               // output scale (default 1/sqrt(K) is applied by the caller)
  float lower_bound = -5.f;        // gate in kernel: decay = lower_bound * sigmoid(...)
  bool use_gate_in_kernel = false; // g is raw: apply the lower-bound sigmoid gate on chip
  bool use_qk_l2norm = false;      // l2-normalise q and k rows on chip
  bool beta_is_bf16 = false;       // beta dtype: bf16 (true) or fp32 (false)
  bool cu_seqlens_is_int64 = false;
  bool state_vk = false;           // state layout: [V, K] per head (true) or [K, V] (false)
};

}  // namespace cula::kda
