// Plain-old-data description of one KDA prefill call, shared by the torch binding
// (csrc/api), the C ABI used by the standalone tools (csrc/standalone) and the kernel.
// Nothing in here depends on torch or on device code, so every front end fills the same struct.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cula::kda {

struct KdaPrefillParams {
  // ---- inputs (device pointers) ----------------------------------------------------------
  // q, k, v, g: bf16 with the feature dimension contiguous; token and head strides in elements
  // (0: dense). The batch and token axes are flattened into one token axis, so a batch row must
  // be `seqlen` token strides after the previous one. Strides and base are multiples of 16 bytes
  // (TMA).
  const void* q = nullptr;              // bf16 [B, T, H, K]
  const void* k = nullptr;              // bf16 [B, T, H, K]
  const void* v = nullptr;              // bf16 [B, T, HV, V]
  const void* g = nullptr;              // bf16 [B, T, HV, K]: raw gate or log decay (natural log)
  int64_t q_token_stride = 0, q_head_stride = 0;
  int64_t k_token_stride = 0, k_head_stride = 0;
  int64_t v_token_stride = 0, v_head_stride = 0;
  int64_t g_token_stride = 0, g_head_stride = 0;
  const void* beta = nullptr;           // fp32 or bf16 [B, T, HV]: beta, or its logits (beta_sigmoid)
  int64_t beta_token_stride = 0;        // elements between tokens (0: HV); heads are contiguous
  const float* A_log = nullptr;         // fp32 [HV] or null (gate in kernel only)
  const float* dt_bias = nullptr;       // fp32 [HV * K] or null (gate in kernel only)
  const void* cu_seqlens = nullptr;     // int32 or int64 [N + 1], or null (fixed-length batch)

  // ---- recurrent states ------------------------------------------------------------------
  // One state per (slot, value head): [K, V] ("kv") or [V, K] ("vk"), fp32 or bf16 each (fp32
  // inside the kernel). Slot of sequence n: n, or state_indices[n] (a state pool). A slot outside
  // [0, num_state_slots) is a pad: the sequence starts from zeros and writes no state.
  // initial_state and final_state may be the same pool (final states written in place).
  const void* initial_state = nullptr;  // null: zeros
  void* final_state = nullptr;          // null: not written
  int64_t state_slot_stride = 0;        // elements between slots (0: HV * K * V); heads dense
  bool initial_state_is_bf16 = false;
  bool final_state_is_bf16 = false;
  const void* state_indices = nullptr;  // int32 or int64 [N], or null (slot n for sequence n)
  bool state_indices_is_int64 = false;
  int num_state_slots = 0;              // S, the pool's rows (with state_indices)
  const bool* has_initial_state = nullptr;  // [N] or null: false starts from zeros (still writes)

  // ---- outputs -------------------------------------------------------------------------
  // o (dense): rows of the token axis that no sequence covers (past cu_seqlens[N], a padded
  // CUDA-graph bucket) are written with zeros.
  void* o = nullptr;                    // bf16 [B, T, HV, V]

  // ---- workspace -----------------------------------------------------------------------
  // Cooperative mode only (few tiles: kda_prefill_sm90_workspace_bytes(p) > 0): device memory of
  // that many bytes, 16-byte aligned, owned by the caller; its contents need no initialisation
  // (where the launch uses its first part for the flags, it zeroes that part on the stream).
  void* workspace = nullptr;
  size_t workspace_bytes = 0;           // its size (checked against what the launch needs)

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
  bool beta_sigmoid = false;       // beta holds logits: the kernel applies the sigmoid in fp32
  bool cu_seqlens_is_int64 = false;
  bool state_vk = false;           // state layout: [V, K] per head (true) or [K, V] (false)
  // General gates (safe_gate=False): log decays may be any value <= 0 (-inf included), so the
  // kernel checks every (16-row block, feature) span and computes the wide ones exactly.
  bool general_gates = false;
  bool gate_softplus = false;      // gate in kernel: -exp(A_log) softplus(g + dt_bias) (general gates only)
};

}  // namespace cula::kda
