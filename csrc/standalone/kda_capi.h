// C ABI of the SM90 KDA prefill kernel (see kda_capi.cu). Returns a cudaError_t value.
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

enum {
  CULA_KDA_GATE_IN_KERNEL = 1,
  CULA_KDA_QK_L2NORM = 2,
  CULA_KDA_BETA_BF16 = 4,
  CULA_KDA_CU_SEQLENS_INT64 = 8,
  CULA_KDA_STATE_VK = 16,
  CULA_KDA_BETA_SIGMOID = 32,  // beta holds logits: the kernel applies the sigmoid
  // With CULA_KDA_GATE_IN_KERNEL: the softplus gate -exp(A_log) softplus(g + dt_bias) on the
  // general-gate path (safe_gate=False; lower_bound is ignored).
  CULA_KDA_GATE_SOFTPLUS = 64,
};

int cula_kda_prefill_sm90(const void* q, const void* k, const void* v, const void* g, const void* beta,
                          const float* A_log, const float* dt_bias, const float* initial_state,
                          const void* cu_seqlens, void* o, float* final_state, int batch, int seqlen, int num_seqs,
                          int num_qk_heads, int num_v_heads, float scale, float lower_bound, int flags, void* stream);
const char* cula_kda_last_error(void);

#ifdef __cplusplus
}
#endif
