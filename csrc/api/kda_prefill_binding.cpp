// torch binding of the SM90 KDA prefill kernel: cheap argument checks (the Python API checks
// the same things with friendlier messages first), output allocation, launch on the current
// stream of the inputs' device.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <optional>
#include <vector>

#include "kda/sm90/kda_prefill_sm90.h"

namespace {

void check_cuda_contiguous(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == device, name, " must be on ", device, ", got ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
              " must start on a 16-byte boundary (a view with an element offset: pass a copy)");
}

std::vector<at::Tensor> kda_prefill_sm90(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& g, const at::Tensor& beta,
                                         const std::optional<at::Tensor>& A_log,
                                         const std::optional<at::Tensor>& dt_bias,
                                         const std::optional<at::Tensor>& initial_state,
                                         const std::optional<at::Tensor>& cu_seqlens, double scale,
                                         double lower_bound, bool use_gate_in_kernel, bool use_qk_l2norm,
                                         bool state_vk, bool output_final_state) {
  const at::Device device = q.device();
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&g, "g"}, {&beta, "beta"}})
    check_cuda_contiguous(*t, name, device);
  TORCH_CHECK(q.dim() == 4, "q must be [B, T, H, K], got ", q.sizes());
  TORCH_CHECK(k.sizes() == q.sizes(), "k must have q's shape ", q.sizes(), ", got ", k.sizes());
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3);
  TORCH_CHECK(v.dim() == 4 && v.size(0) == B && v.size(1) == T, "v must be [B, T, HV, V], got ", v.sizes());
  const int64_t HV = v.size(2), V = v.size(3);
  TORCH_CHECK(K == 128 && V == 128, "the sm90 kernel needs K == V == 128, got K=", K, " V=", V);
  TORCH_CHECK(H > 0 && HV >= H && HV % H == 0, "HV must be a positive multiple of H, got H=", H, " HV=", HV);
  TORCH_CHECK(g.sizes() == at::IntArrayRef({B, T, HV, K}), "g must be [B, T, HV, K], got ", g.sizes());
  TORCH_CHECK(beta.sizes() == at::IntArrayRef({B, T, HV}), "beta must be [B, T, HV], got ", beta.sizes());
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&g, "g"}})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, name, " must be bfloat16, got ", t->scalar_type());
  TORCH_CHECK(beta.scalar_type() == at::kFloat || beta.scalar_type() == at::kBFloat16,
              "beta must be float32 or bfloat16, got ", beta.scalar_type());
  TORCH_CHECK(scale > 0.0 && std::isfinite(scale), "scale must be finite and > 0, got ", scale);

  cula::kda::KdaPrefillParams p;
  int64_t N = B;
  if (cu_seqlens.has_value()) {
    const at::Tensor& cu = *cu_seqlens;
    check_cuda_contiguous(cu, "cu_seqlens", device);
    TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 2, "cu_seqlens must be 1-D with >= 2 entries, got ", cu.sizes());
    TORCH_CHECK(cu.scalar_type() == at::kInt || cu.scalar_type() == at::kLong, "cu_seqlens must be int32 or int64");
    TORCH_CHECK(B == 1, "cu_seqlens requires B == 1, got B=", B);
    N = cu.size(0) - 1;
    p.cu_seqlens = cu.data_ptr();
    p.cu_seqlens_is_int64 = cu.scalar_type() == at::kLong;
  }
  const std::vector<int64_t> state_shape = state_vk ? std::vector<int64_t>{N, HV, V, K} : std::vector<int64_t>{N, HV, K, V};
  if (initial_state.has_value()) {
    check_cuda_contiguous(*initial_state, "initial_state", device);
    TORCH_CHECK(initial_state->scalar_type() == at::kFloat, "initial_state must be float32");
    TORCH_CHECK(initial_state->sizes() == at::IntArrayRef(state_shape), "initial_state must be ",
                at::IntArrayRef(state_shape), ", got ", initial_state->sizes());
    p.initial_state = initial_state->data_ptr<float>();
  }
  if (use_gate_in_kernel) {
    TORCH_CHECK(lower_bound < 0.0 && lower_bound >= -5.0, "lower_bound must be in [-5, 0), got ", lower_bound);
    if (A_log.has_value()) {
      check_cuda_contiguous(*A_log, "A_log", device);
      TORCH_CHECK(A_log->scalar_type() == at::kFloat && A_log->numel() == HV, "A_log must be float32 [HV]");
      p.A_log = A_log->data_ptr<float>();
    }
    if (dt_bias.has_value()) {
      check_cuda_contiguous(*dt_bias, "dt_bias", device);
      TORCH_CHECK(dt_bias->scalar_type() == at::kFloat && dt_bias->numel() == HV * K, "dt_bias must be float32 [HV*K]");
      p.dt_bias = dt_bias->data_ptr<float>();
    }
  } else {
    TORCH_CHECK(!A_log.has_value() && !dt_bias.has_value(), "A_log/dt_bias need use_gate_in_kernel=True");
  }

  const c10::cuda::CUDAGuard guard(device);
  at::Tensor o = at::empty({B, T, HV, V}, q.options());
  at::Tensor final_state;
  if (output_final_state) {
    final_state = at::empty(state_shape, q.options().dtype(at::kFloat));
    p.final_state = final_state.data_ptr<float>();
  }
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
  p.lower_bound = float(lower_bound);
  p.use_gate_in_kernel = use_gate_in_kernel;
  p.use_qk_l2norm = use_qk_l2norm;
  p.beta_is_bf16 = beta.scalar_type() == at::kBFloat16;
  p.state_vk = state_vk;

  const cudaError_t err = cula::kda::kda_prefill_sm90(p, at::cuda::getCurrentCUDAStream(device.index()));
  TORCH_CHECK(err == cudaSuccess, "kda_prefill_sm90 failed: ", cudaGetErrorString(err), " ",
              cula::kda::kda_prefill_sm90_last_error());
  if (output_final_state) return {o, final_state};
  return {o};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cula fused kernels (SM90)";
  m.def("kda_prefill_sm90", &kda_prefill_sm90, "Fused KDA prefill forward on SM90 (see cula.kda.kda_prefill)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("A_log"), py::arg("dt_bias"),
        py::arg("initial_state"), py::arg("cu_seqlens"), py::arg("scale"), py::arg("lower_bound"),
        py::arg("use_gate_in_kernel"), py::arg("use_qk_l2norm"), py::arg("state_vk"), py::arg("output_final_state"));
}
