// torch binding of the SM90 KDA prefill kernel: the CUDA implementation behind the custom op
// cula::kda_prefill (cula/kda/op.py). Every user-facing rule is checked once, in Python
// (cula/kda/prefill.py), before the op runs; this file only asserts the invariants the kernel
// relies on to stay inside its tensors (devices, layouts, dtypes, shapes), fills
// KdaPrefillParams and launches on the current stream of the inputs' device.
//
// The arguments are keyword-only and carry the names of the op's schema; the outputs o and
// final_state are caller-owned and written in place (nothing is allocated here).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <optional>
#include <vector>

#include "kda/sm90/kda_prefill_sm90.h"

// An internal invariant: cula.kda.kda_prefill has validated the arguments, so a failure here is a
// bug in cula or a direct call of the op with arguments the Python API rejects.
#define CULA_ASSERT(cond, ...)                                                                   \
  TORCH_CHECK(cond, "kda_prefill_sm90: ", __VA_ARGS__,                                           \
              " (internal invariant; call cula.kda.kda_prefill, which validates its arguments)")

namespace {

void assert_dense_on(const at::Tensor& t, const char* name, const at::Device& device) {
  CULA_ASSERT(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
  CULA_ASSERT(t.device() == device, name, " must be on q's device ", device, ", got ", t.device());
  CULA_ASSERT(t.is_contiguous(), name, " must be contiguous");
  CULA_ASSERT(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must start on a 16-byte boundary");
}

void kda_prefill_sm90(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                      const at::Tensor& beta, const std::optional<at::Tensor>& A_log,
                      const std::optional<at::Tensor>& dt_bias, const std::optional<at::Tensor>& initial_state,
                      const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& o,
                      const std::optional<at::Tensor>& final_state, double scale, std::optional<double> lower_bound,
                      bool use_gate_in_kernel, bool use_qk_l2norm_in_kernel, bool state_v_first) {
  const at::Device device = q.device();
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&g, "g"}, {&beta, "beta"}, {&o, "o"}})
    assert_dense_on(*t, name, device);
  CULA_ASSERT(q.dim() == 4 && k.sizes() == q.sizes(), "q and k must be [B, T, H, K], got ", q.sizes(), " and ",
              k.sizes());
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3);
  CULA_ASSERT(v.dim() == 4 && v.size(0) == B && v.size(1) == T, "v must be [B, T, HV, V], got ", v.sizes());
  const int64_t HV = v.size(2), V = v.size(3);
  CULA_ASSERT(K == 128 && V == 128, "K == V == 128, got K=", K, " V=", V);
  CULA_ASSERT(H > 0 && HV >= H && HV % H == 0, "HV must be a positive multiple of H, got H=", H, " HV=", HV);
  CULA_ASSERT(g.sizes() == at::IntArrayRef({B, T, HV, K}), "g must be [B, T, HV, K], got ", g.sizes());
  CULA_ASSERT(beta.sizes() == at::IntArrayRef({B, T, HV}), "beta must be [B, T, HV], got ", beta.sizes());
  CULA_ASSERT(o.sizes() == v.sizes(), "o must be [B, T, HV, V] = ", v.sizes(), ", got ", o.sizes());
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&g, "g"}, {&o, "o"}})
    CULA_ASSERT(t->scalar_type() == at::kBFloat16, name, " must be bfloat16, got ", t->scalar_type());
  CULA_ASSERT(beta.scalar_type() == at::kFloat || beta.scalar_type() == at::kBFloat16,
              "beta must be float32 or bfloat16, got ", beta.scalar_type());

  cula::kda::KdaPrefillParams p;
  int64_t N = B;
  if (cu_seqlens.has_value()) {
    const at::Tensor& cu = *cu_seqlens;
    assert_dense_on(cu, "cu_seqlens", device);
    CULA_ASSERT(cu.dim() == 1 && cu.size(0) >= 2, "cu_seqlens must be 1-D with >= 2 entries, got ", cu.sizes());
    CULA_ASSERT(cu.scalar_type() == at::kInt || cu.scalar_type() == at::kLong, "cu_seqlens must be int32 or int64");
    CULA_ASSERT(B == 1, "cu_seqlens needs B == 1, got B=", B);
    N = cu.size(0) - 1;
    p.cu_seqlens = cu.data_ptr();
    p.cu_seqlens_is_int64 = cu.scalar_type() == at::kLong;
  }
  const std::vector<int64_t> state_shape =
      state_v_first ? std::vector<int64_t>{N, HV, V, K} : std::vector<int64_t>{N, HV, K, V};
  for (auto [t, name] : {std::pair{&initial_state, "initial_state"}, {&final_state, "final_state"}}) {
    if (!t->has_value()) continue;
    assert_dense_on(**t, name, device);
    CULA_ASSERT((*t)->scalar_type() == at::kFloat && (*t)->sizes() == at::IntArrayRef(state_shape), name,
                " must be float32 ", at::IntArrayRef(state_shape), ", got ", (*t)->scalar_type(), " ",
                (*t)->sizes());
  }
  if (initial_state.has_value()) p.initial_state = initial_state->data_ptr<float>();
  if (final_state.has_value()) p.final_state = final_state->data_ptr<float>();
  if (use_gate_in_kernel) {
    // The kernel implements the lower-bound gate form only (its range is the Python API's rule).
    CULA_ASSERT(lower_bound.has_value(), "use_gate_in_kernel needs lower_bound");
    if (A_log.has_value()) {
      assert_dense_on(*A_log, "A_log", device);
      CULA_ASSERT(A_log->scalar_type() == at::kFloat && A_log->numel() == HV, "A_log must be float32 [HV]");
      p.A_log = A_log->data_ptr<float>();
    }
    if (dt_bias.has_value()) {
      assert_dense_on(*dt_bias, "dt_bias", device);
      CULA_ASSERT(dt_bias->scalar_type() == at::kFloat && dt_bias->numel() == HV * K, "dt_bias must be float32 [HV*K]");
      p.dt_bias = dt_bias->data_ptr<float>();
    }
    p.lower_bound = float(*lower_bound);
  } else {
    CULA_ASSERT(!A_log.has_value() && !dt_bias.has_value(), "A_log/dt_bias need use_gate_in_kernel=True");
  }

  const c10::cuda::CUDAGuard guard(device);
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.g = g.data_ptr();
  p.beta = beta.data_ptr();
  p.o = o.data_ptr();
  p.batch = int(B);
  p.seqlen = int(T);
  p.num_seqs = int(N);
  p.num_qk_heads = int(H);
  p.num_v_heads = int(HV);
  p.head_dim = int(K);
  p.scale = float(scale);
  p.use_gate_in_kernel = use_gate_in_kernel;
  p.use_qk_l2norm = use_qk_l2norm_in_kernel;
  p.beta_is_bf16 = beta.scalar_type() == at::kBFloat16;
  p.state_vk = state_v_first;

  const cudaError_t err = cula::kda::kda_prefill_sm90(p, at::cuda::getCurrentCUDAStream(device.index()));
  TORCH_CHECK(err == cudaSuccess, "kda_prefill_sm90 failed: ", cudaGetErrorString(err), " ",
              cula::kda::kda_prefill_sm90_last_error());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cula fused kernels (SM90)";
  m.def("kda_prefill_sm90", &kda_prefill_sm90,
        "Fused KDA prefill forward on SM90 into caller-owned o / final_state: the CUDA implementation "
        "of the op cula::kda_prefill (call cula.kda.kda_prefill). Keyword arguments only.",
        py::kw_only(), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("A_log"),
        py::arg("dt_bias"), py::arg("initial_state"), py::arg("cu_seqlens"), py::arg("o"), py::arg("final_state"),
        py::arg("scale"), py::arg("lower_bound"), py::arg("use_gate_in_kernel"), py::arg("use_qk_l2norm_in_kernel"),
        py::arg("state_v_first"));
}
