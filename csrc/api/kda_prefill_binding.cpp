// torch binding of the SM90 KDA prefill kernel: the CUDA implementation behind the custom op
// cula::kda_prefill (cula/kda/op.py). Every user-facing rule is checked once, in Python
// (cula/kda/prefill.py), before the op runs; this file decides which tensors the kernel reads
// and writes in place (Layouts, below), asserts the invariants the kernel relies on to stay
// inside its tensors (devices, layouts, dtypes, shapes), fills KdaPrefillParams and launches on
// the current stream of the inputs' device.
//
// The arguments are keyword-only and carry the names of the op's schema; the outputs o,
// final_state and state_pool are caller-owned and written in place.
//
// Layouts: the kernel reads q, k, v, g, beta, the states and the small tensors in place where
// their layout allows it, and this file is where that is decided (once, in C++, where a check
// costs nanoseconds instead of the microseconds of Python attribute reads per call). What the
// kernel cannot read is copied once to a dense tensor (inputs), and an output it cannot write in
// place gets a dense buffer that is copied into the caller's after the launch; the copies run on
// the current stream. The rules for reading in place are the tma_readable / state_readable
// predicates below; the assertions after them are the kernel's invariants.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kda/sm90/kda_prefill_sm90.h"

// An internal invariant: cula.kda.kda_prefill has validated the arguments, so a failure here is a
// bug in cula or a direct call of the op with arguments the Python API rejects.
#define CULA_ASSERT(cond, ...)                                                                   \
  TORCH_CHECK(cond, "kda_prefill_sm90: ", __VA_ARGS__,                                           \
              " (internal invariant; call cula.kda.kda_prefill, which validates its arguments)")

namespace {

void assert_on(const at::Tensor& t, const char* name, const at::Device& device) {
  CULA_ASSERT(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
  CULA_ASSERT(t.device() == device, name, " must be on q's device ", device, ", got ", t.device());
}

void assert_dense_on(const at::Tensor& t, const char* name, const at::Device& device) {
  assert_on(t, name, device);
  CULA_ASSERT(t.is_contiguous(), name, " must be contiguous");
  CULA_ASSERT(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must start on a 16-byte boundary");
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// A copy of `t` in a new allocation with the canonical contiguous strides, on the current stream.
// (`t.contiguous()` may return `t` itself, which is contiguous by torch's rule but may carry any
// stride on a dimension of size 1, e.g. [B, 1, H, 128] from a transpose: the stride rules below
// need the canonical ones.)
at::Tensor fresh(const at::Tensor& t) { return at::empty(t.sizes(), t.options()).copy_(t); }

// `t` contiguous and 16-byte aligned (A_log, dt_bias, cu_seqlens, state_indices,
// has_initial_state), else a dense copy.
at::Tensor dense(const at::Tensor& t) { return t.is_contiguous() && aligned16(t) ? t : fresh(t); }
std::optional<at::Tensor> dense(const std::optional<at::Tensor>& t) {
  return t.has_value() ? std::optional<at::Tensor>(dense(*t)) : std::nullopt;
}

// q, k, v, g [B, T, heads, 128] as the kernel's TMA reads them in place: features contiguous,
// token and head strides positive multiples of 8 elements (16 bytes), a 16-byte aligned start,
// batch rows T token strides apart (the kernel flattens B and T). Column slices of one fused
// projection qualify. With no token (B*T == 0) nothing is read: any layout qualifies.
bool tma_readable(const at::Tensor& t) {
  if (t.size(0) * t.size(1) == 0) return true;
  const auto s = t.strides();
  return s[3] == 1 && s[1] > 0 && s[2] > 0 && s[1] % 8 == 0 && s[2] % 8 == 0 &&
         (t.size(0) == 1 || s[0] == t.size(1) * s[1]) && aligned16(t);
}

// beta [B, T, HV]: heads contiguous, batch rows T token strides apart (a column slice of a fused
// projection qualifies); with no token any layout.
bool beta_readable(const at::Tensor& t) {
  if (t.size(0) * t.size(1) == 0) return true;
  const auto s = t.strides();
  return s[2] == 1 && s[1] > 0 && (t.size(0) == 1 || s[0] == t.size(1) * s[1]);
}

// A state [rows, HV, a, b] the kernel reads and writes in place: each row dense, rows a multiple
// of 4 elements and at least a row apart, a 16-byte aligned start.
bool state_readable(const at::Tensor& t) {
  if (t.dim() != 4) return true;  // the shape assertion names it
  const auto s = t.strides();
  return s[3] == 1 && s[2] == t.size(3) && s[1] == t.size(2) * t.size(3) && s[0] >= t.size(1) * t.size(2) * t.size(3) &&
         s[0] % 4 == 0 && aligned16(t);
}

// q, k, v, g: their {token stride, head stride} for the TMA descriptors (the layout asserted:
// tma_readable after the copy above). With no token, {0, 0} (dense) and no descriptor is built.
std::pair<int64_t, int64_t> tma_strides(const at::Tensor& t, const char* name, const at::Device& device) {
  assert_on(t, name, device);
  if (t.size(0) * t.size(1) == 0) return {0, 0};
  CULA_ASSERT(t.stride(3) == 1, name, " must have its last dimension contiguous");
  CULA_ASSERT(t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0 && t.stride(1) > 0 && t.stride(2) > 0, name,
              " must have token and head strides that are positive multiples of 8 elements, got ", t.strides());
  CULA_ASSERT(t.size(0) == 1 || t.stride(0) == t.size(1) * t.stride(1), name,
              " must have batch rows T token strides apart, got ", t.strides());
  CULA_ASSERT(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must start on a 16-byte boundary");
  return {t.stride(1), t.stride(2)};
}

void kda_prefill_sm90(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g_in,
                      const at::Tensor& beta_in, const std::optional<at::Tensor>& A_log_in,
                      const std::optional<at::Tensor>& dt_bias_in, const std::optional<at::Tensor>& initial_state_in,
                      const std::optional<at::Tensor>& cu_seqlens_in, const std::optional<at::Tensor>& state_indices_in,
                      const std::optional<at::Tensor>& has_initial_state_in, const at::Tensor& o_out,
                      const std::optional<at::Tensor>& final_state_out, const std::optional<at::Tensor>& state_pool,
                      double scale, std::optional<double> lower_bound, bool use_gate_in_kernel,
                      bool use_qk_l2norm_in_kernel, bool use_beta_sigmoid_in_kernel, bool state_v_first,
                      bool general_gates) {
  const at::Device device = q_in.device();
  // The copies below and the launch run on the current stream of the inputs' device.
  const c10::cuda::CUDAGuard guard(device);

  // What the kernel cannot read in place, copied once (see the top of this file).
  auto tma_input = [](const at::Tensor& t) { return t.dim() == 4 && !tma_readable(t) ? fresh(t) : t; };
  const at::Tensor q = tma_input(q_in), k = tma_input(k_in), v = tma_input(v_in), g = tma_input(g_in);
  const at::Tensor beta = beta_in.dim() == 3 && !beta_readable(beta_in) ? fresh(beta_in) : beta_in;
  const std::optional<at::Tensor> A_log = dense(A_log_in), dt_bias = dense(dt_bias_in),
                                  cu_seqlens = dense(cu_seqlens_in), state_indices = dense(state_indices_in),
                                  has_initial_state = dense(has_initial_state_in);
  std::optional<at::Tensor> initial_state = initial_state_in;
  if (initial_state.has_value() && !state_readable(*initial_state)) initial_state = fresh(*initial_state);
  // Outputs the kernel cannot write in place: a dense buffer, copied into the caller's after the launch.
  const at::Tensor o = o_out.is_contiguous() && aligned16(o_out) ? o_out : at::empty(o_out.sizes(), o_out.options());
  std::optional<at::Tensor> final_state = final_state_out;
  if (final_state.has_value() && !state_readable(*final_state))
    final_state = at::empty(final_state->sizes(), final_state->options());
  if (!state_indices.has_value() && initial_state.has_value() && final_state.has_value() &&
      initial_state->dim() == 4 && final_state->dim() == 4 && initial_state->stride(0) != final_state->stride(0)) {
    // One row stride for both in the kernel: dense rows for both.
    const int64_t row = initial_state->size(1) * initial_state->size(2) * initial_state->size(3);
    if (initial_state->stride(0) != row) initial_state = fresh(*initial_state);
    if (final_state->stride(0) != row) final_state = at::empty(final_state->sizes(), final_state->options());
  }

  assert_dense_on(o, "o", device);
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
  std::tie(p.q_token_stride, p.q_head_stride) = tma_strides(q, "q", device);
  std::tie(p.k_token_stride, p.k_head_stride) = tma_strides(k, "k", device);
  std::tie(p.v_token_stride, p.v_head_stride) = tma_strides(v, "v", device);
  std::tie(p.g_token_stride, p.g_head_stride) = tma_strides(g, "g", device);
  assert_on(beta, "beta", device);
  if (B * T > 0) {  // no token: beta is never read (beta_readable agrees)
    CULA_ASSERT(beta.stride(2) == 1 && beta.stride(1) > 0 && (B == 1 || beta.stride(0) == T * beta.stride(1)),
                "beta must have its heads contiguous and batch rows T token strides apart, got ", beta.strides());
    p.beta_token_stride = beta.stride(1);
  }

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

  // States: fp32 or bf16, one (slot, head) state per K*V block with the heads dense. Without
  // state_indices the slots are the sequences ([N, HV, ...] tensors); with it, initial_state (read
  // only) or state_pool (read and written in place) is a pool [S, HV, ...] whose rows may be
  // further apart than HV*K*V.
  const std::vector<int64_t> head_shape = state_v_first ? std::vector<int64_t>{HV, V, K} : std::vector<int64_t>{HV, K, V};
  auto check_state = [&](const at::Tensor& t, const char* name, int64_t rows) {
    assert_on(t, name, device);
    CULA_ASSERT(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
                " must be float32 or bfloat16, got ", t.scalar_type());
    CULA_ASSERT(t.dim() == 4 && t.size(1) == head_shape[0] && t.size(2) == head_shape[1] && t.size(3) == head_shape[2] &&
                    (rows < 0 || t.size(0) == rows),
                name, " must be [", rows < 0 ? "S" : std::to_string(rows), ", ", at::IntArrayRef(head_shape), "], got ",
                t.sizes());
    CULA_ASSERT(t.stride(3) == 1 && t.stride(2) == head_shape[2] && t.stride(1) == head_shape[1] * head_shape[2] &&
                    t.stride(0) >= HV * K * V && t.stride(0) % 4 == 0,
                name, " must have dense rows (stride(0) >= HV*K*V, a multiple of 4), got ", t.strides());
    CULA_ASSERT(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must start on a 16-byte boundary");
  };
  if (state_indices.has_value()) {
    const at::Tensor& idx = *state_indices;
    assert_dense_on(idx, "state_indices", device);
    CULA_ASSERT(idx.dim() == 1 && idx.size(0) == N && (idx.scalar_type() == at::kInt || idx.scalar_type() == at::kLong),
                "state_indices must be int32 or int64 [N], got ", idx.scalar_type(), " ", idx.sizes());
    CULA_ASSERT(state_pool.has_value() != initial_state.has_value(),
                "with state_indices, the pool is state_pool (written) or initial_state (read only)");
    CULA_ASSERT(!final_state.has_value(), "with state_indices, final states go into the pool");
    const at::Tensor& pool = state_pool.has_value() ? *state_pool : *initial_state;
    check_state(pool, state_pool.has_value() ? "state_pool" : "initial_state", -1);
    p.state_indices = idx.data_ptr();
    p.state_indices_is_int64 = idx.scalar_type() == at::kLong;
    p.num_state_slots = int(pool.size(0));
    p.state_slot_stride = pool.stride(0);
    p.initial_state = pool.data_ptr();
    p.initial_state_is_bf16 = pool.scalar_type() == at::kBFloat16;
    if (state_pool.has_value()) {
      p.final_state = pool.data_ptr();
      p.final_state_is_bf16 = p.initial_state_is_bf16;
    }
  } else {
    CULA_ASSERT(!state_pool.has_value(), "state_pool needs state_indices");
    int64_t stride = 0;
    if (initial_state.has_value()) {
      check_state(*initial_state, "initial_state", N);
      p.initial_state = initial_state->data_ptr();
      p.initial_state_is_bf16 = initial_state->scalar_type() == at::kBFloat16;
      stride = initial_state->stride(0);
    }
    if (final_state.has_value()) {
      check_state(*final_state, "final_state", N);
      p.final_state = final_state->data_ptr();
      p.final_state_is_bf16 = final_state->scalar_type() == at::kBFloat16;
      CULA_ASSERT(stride == 0 || final_state->stride(0) == stride,
                  "initial_state and final_state must have the same row stride");
      stride = final_state->stride(0);
    }
    p.state_slot_stride = stride;
  }
  if (has_initial_state.has_value()) {
    const at::Tensor& h = *has_initial_state;
    assert_dense_on(h, "has_initial_state", device);
    CULA_ASSERT(h.scalar_type() == at::kBool && h.dim() == 1 && h.size(0) == N, "has_initial_state must be bool [N]");
    p.has_initial_state = h.data_ptr<bool>();
  }

  if (use_gate_in_kernel) {
    // The lower-bound form (its range is the Python API's rule), or on the general-gate path the
    // softplus form without lower_bound, which needs A_log.
    CULA_ASSERT(lower_bound.has_value() || (general_gates && A_log.has_value()),
                "use_gate_in_kernel needs lower_bound, or general_gates and A_log (softplus form)");
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
    p.lower_bound = lower_bound.has_value() ? float(*lower_bound) : 0.f;
    p.gate_softplus = !lower_bound.has_value();
  } else {
    CULA_ASSERT(!A_log.has_value() && !dt_bias.has_value(), "A_log/dt_bias need use_gate_in_kernel=True");
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
  p.use_gate_in_kernel = use_gate_in_kernel;
  p.use_qk_l2norm = use_qk_l2norm_in_kernel;
  p.beta_is_bf16 = beta.scalar_type() == at::kBFloat16;
  p.beta_sigmoid = use_beta_sigmoid_in_kernel;
  p.state_vk = state_v_first;
  p.general_gates = general_gates;

  // Cooperative mode (few tiles): its workspace comes from torch's caching allocator, stream-ordered
  // (freed here, reusable by later work on this stream only) and inside a CUDA graph capture from
  // the graph's pool. The current device is the inputs' (guard above).
  // The dispatch plans the launch once and asks for the workspace only where it needs one; an
  // allocation error (torch's out-of-memory) is carried across the dispatch and rethrown here.
  struct WorkspaceRequest {
    at::TensorOptions options;
    at::Tensor tensor;
    std::exception_ptr error;
  } request{q.options().dtype(at::kByte), {}, nullptr};
  auto allocate = [](size_t bytes, void* ctx) -> void* {
    auto* r = static_cast<WorkspaceRequest*>(ctx);
    try {
      r->tensor = at::empty({int64_t(bytes)}, r->options);
      return r->tensor.data_ptr();
    } catch (...) {
      r->error = std::current_exception();
      return nullptr;
    }
  };
  const cudaError_t err = cula::kda::kda_prefill_sm90(p, at::cuda::getCurrentCUDAStream(device.index()), allocate, &request);
  if (request.error) std::rethrow_exception(request.error);
  TORCH_CHECK(err == cudaSuccess, "kda_prefill_sm90 failed: ", cudaGetErrorString(err), " ",
              cula::kda::kda_prefill_sm90_last_error());
  if (!o.is_same(o_out)) o_out.copy_(o);
  if (final_state.has_value() && !final_state->is_same(*final_state_out)) final_state_out->copy_(*final_state);
}

// ---------------------------------------------------------------------------------------------
// The eager fast path (cula.kda.prefill.kda_prefill): a call whose signature passed the Python
// rules and chose the sm90 kernel before runs from here without the Python layers.
//
// cula.kda.prefill remembers the result of its argument rules per call signature (_VALIDATED:
// each tensor argument's shape, dtype and device, a state pool's strides and alignment, each
// option's type and value). On the GPU machine's CPU those layers cost ~20-50 us per eager call,
// which the benchmark's eager time (one call from an idle GPU) pays in full before the first
// launch. kda_prefill_fast computes the same signature here, from the public function's 23
// arguments in their order, and when it was registered (kda_prefill_fast_register, after the
// Python path accepted it and chose sm90) does what kda_prefill does after its rules: allocates o
// and the final state, runs kda_prefill_sm90 and bumps the version counters of the caller's
// buffers; otherwise it returns None and the Python path runs. The Python side calls it only in
// plain eager mode (no compiler, dispatch or torch-function mode, tracer or functorch transform)
// and clears this memo whenever it clears _VALIDATED, so a hit here is always a call the Python
// memo would have let through. Everything runs under the GIL (pybind holds it), so the memo needs
// no lock.
// ---------------------------------------------------------------------------------------------

// The arguments of cula.kda.kda_prefill, in its order.
enum Arg : int {
  kQ, kK, kV, kG, kBeta, kScale, kInitialState, kOutputFinalState, kCuSeqlens, kL2Norm, kGateInKernel,
  kALog, kDtBias, kSafeGate, kLowerBound, kStateLayout, kBackend, kStateIndices, kHasInitialState, kOut,
  kFinalState, kBetaSigmoid, kCheckInputs, kNumArgs
};
// The tensor arguments and the options of the Python signature (_signature), in its order.
constexpr Arg kTensorArgs[] = {kQ, kK, kV, kG, kBeta, kCuSeqlens, kInitialState, kALog, kStateIndices,
                               kDtBias, kHasInitialState, kOut, kFinalState};
constexpr Arg kOptionArgs[] = {kScale, kOutputFinalState, kL2Norm, kGateInKernel, kSafeGate, kLowerBound,
                               kStateLayout, kBackend, kBetaSigmoid, kCheckInputs};

// The public function's 23 arguments, borrowed (kda_prefill_fast takes them as a vectorcall, without
// a tuple; kda_prefill_fast_register from pybind's args tuple).
struct CallArgs {
  PyObject* const* items;
  Py_ssize_t size;
  PyObject* operator[](int i) const { return items[i]; }
};
CallArgs call_args(const py::args& a) { return {PySequence_Fast_ITEMS(a.ptr()), PyTuple_GET_SIZE(a.ptr())}; }

struct FastPlan {
  double scale = 0;
  std::optional<double> lower_bound;
  int64_t num_seqs = 0;
  at::ScalarType state_dtype = at::kFloat;
  bool bounded_decays = false;
};
struct KeyHash {
  size_t operator()(const std::vector<int64_t>& key) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t x : key) h = (h ^ uint64_t(x)) * 1099511628211ull;
    return size_t(h);
  }
};
std::unordered_map<std::vector<int64_t>, FastPlan, KeyHash>& fast_memo() {
  static auto* memo = new std::unordered_map<std::vector<int64_t>, FastPlan, KeyHash>();
  return *memo;
}

// torch.Tensor or torch.nn.Parameter exactly (the Python memo's tensor types): no subclass.
bool plain_tensor(PyObject* obj) {
  static PyObject* parameter = py::object(py::module_::import("torch.nn").attr("Parameter")).release().ptr();
  return THPVariable_CheckExact(obj) || Py_TYPE(obj) == reinterpret_cast<PyTypeObject*>(parameter);
}

// The signature of a call, as _signature in cula/kda/prefill.py builds it, or false where that
// returns None (a tensor or option of another type, q..beta missing, index values checked).
bool fast_key(const CallArgs& a, std::vector<int64_t>& key) {
  key.clear();
  key.reserve(96);
  for (Arg i : kTensorArgs) {
    PyObject* obj = a[i];
    if (obj == Py_None) {
      if (i <= kBeta) return false;
      key.push_back(-1);
      continue;
    }
    if (!plain_tensor(obj)) return false;
    const at::Tensor& t = THPVariable_Unpack(obj);
    key.push_back(t.dim());
    for (int64_t d : t.sizes()) key.push_back(d);
    key.push_back(int64_t(t.scalar_type()));
    key.push_back(int64_t(t.device().type()) * 1024 + t.device().index());
  }
  // Options: exactly bool, int, float, str or None, with their type (True == 1 hash alike).
  for (Arg i : kOptionArgs) {
    PyObject* obj = a[i];
    if (obj == Py_None) {
      key.push_back(0);
    } else if (PyBool_Check(obj)) {
      key.push_back(obj == Py_True ? 2 : 1);
    } else if (PyLong_CheckExact(obj)) {
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
      if (overflow != 0) return false;
      key.push_back(3);
      key.push_back(v);
    } else if (PyFloat_CheckExact(obj)) {
      const double v = PyFloat_AS_DOUBLE(obj);
      int64_t bits;
      std::memcpy(&bits, &v, sizeof bits);
      key.push_back(4);
      key.push_back(bits);
    } else if (PyUnicode_CheckExact(obj)) {
      Py_ssize_t n = 0;
      const char* text = PyUnicode_AsUTF8AndSize(obj, &n);
      if (text == nullptr) {
        PyErr_Clear();
        return false;
      }
      key.push_back(5);
      key.push_back(n);
      for (Py_ssize_t j = 0; j < n; ++j) key.push_back(text[j]);
    } else {
      return false;
    }
  }
  // Calls whose rules read index values (cu_seqlens / state_indices checked on the host:
  // _check_index_values) are never remembered; a state pool's strides and alignment are read.
  if (a[kCuSeqlens] != Py_None || a[kStateIndices] != Py_None) {
    PyObject* check = a[kCheckInputs];
    bool checked;
    if (check != Py_None) {
      checked = PyObject_IsTrue(check) == 1;
    } else {
      const char* env = std::getenv("CULA_CHECK_CU_SEQLENS");
      checked = THPVariable_Unpack(a[kQ]).device().is_cpu() || (env != nullptr && std::strcmp(env, "1") == 0);
    }
    if (checked) return false;
    if (a[kStateIndices] != Py_None && a[kInitialState] != Py_None) {
      const at::Tensor& pool = THPVariable_Unpack(a[kInitialState]);
      key.push_back(-2);
      for (int64_t s : pool.strides()) key.push_back(s);
      key.push_back(int64_t(reinterpret_cast<uintptr_t>(pool.data_ptr()) % 16));
    }
  }
  return true;
}

std::optional<at::Tensor> optional_tensor(PyObject* obj) {
  if (obj == Py_None) return std::nullopt;
  return THPVariable_Unpack(obj);
}

// The 23 arguments of kda_prefill, then what its rules resolved: the scale, the lower bound, N,
// the dtype of a final state it allocates, whether the decays are bounded. Returns whether the
// signature was remembered (false: one the Python memo does not remember either).
bool kda_prefill_fast_register(const py::args& a) {
  TORCH_CHECK(a.size() == kNumArgs + 5, "kda_prefill_fast_register: expected ", kNumArgs + 5, " arguments");
  std::vector<int64_t> key;
  if (!fast_key(call_args(a), key)) return false;
  FastPlan plan;
  plan.scale = a[kNumArgs].cast<double>();
  if (a[kNumArgs + 1].ptr() != Py_None) plan.lower_bound = a[kNumArgs + 1].cast<double>();
  plan.num_seqs = a[kNumArgs + 2].cast<int64_t>();
  plan.state_dtype = a[kNumArgs + 3].cast<bool>() ? at::kBFloat16 : at::kFloat;
  plan.bounded_decays = a[kNumArgs + 4].cast<bool>();
  // Bounded on its own too (the Python side clears it with _VALIDATED, which holds at most 256).
  if (fast_memo().size() >= 1024) fast_memo().clear();
  fast_memo()[std::move(key)] = plan;
  return true;
}

void kda_prefill_fast_clear() { fast_memo().clear(); }

// (o, final state) of a remembered call, or None. A vectorcall function (METH_FASTCALL, registered
// below): pybind's dispatch of *args would first copy the 23 arguments into a tuple and run its
// overload resolution, 0.43 us per call on the CI machine's CPU against 0.02 (~1 us on the GPU
// machines' CPUs, all of it before the launch). Errors reach Python as torch's own functions raise
// them (HANDLE_TH_ERRORS: c10::Error as RuntimeError, out of memory as torch.OutOfMemoryError).
PyObject* kda_prefill_fast(PyObject* /*module*/, PyObject* const* items, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const CallArgs a{items, nargs};
  if (nargs != kNumArgs || fast_memo().empty()) Py_RETURN_NONE;
  thread_local std::vector<int64_t> key;
  if (!fast_key(a, key)) Py_RETURN_NONE;
  const auto hit = fast_memo().find(key);
  if (hit == fast_memo().end()) Py_RETURN_NONE;
  const FastPlan plan = hit->second;
  // Autograd would want to see a tensor that requires grad: the op path (_plain_eager).
  if (at::GradMode::is_enabled()) {
    for (Arg i : kTensorArgs)
      if (a[i] != Py_None && THPVariable_Unpack(a[i]).requires_grad()) Py_RETURN_NONE;
  }
  const at::Tensor& q = THPVariable_Unpack(a[kQ]);
  const at::Tensor& v = THPVariable_Unpack(a[kV]);
  const std::optional<at::Tensor> out = optional_tensor(a[kOut]), caller_final_state = optional_tensor(a[kFinalState]);
  std::optional<at::Tensor> initial_state = optional_tensor(a[kInitialState]), dt_bias = optional_tensor(a[kDtBias]);
  const bool output_final_state = PyObject_IsTrue(a[kOutputFinalState]) == 1;
  const bool pooled = a[kStateIndices] != Py_None;
  const bool state_vk = PyUnicode_Check(a[kStateLayout]) && PyUnicode_CompareWithASCIIString(a[kStateLayout], "vk") == 0;

  // As kda_prefill after its rules (on sm90 v's dtype is q's: o is v's contiguous sibling).
  const at::Tensor o = out.has_value() ? *out : at::empty(v.sizes(), v.options().memory_format(at::MemoryFormat::Contiguous));
  std::optional<at::Tensor> final_state = caller_final_state, state_pool;
  std::optional<at::Tensor> result_state;
  if (pooled) {
    if (output_final_state) {
      state_pool = initial_state;
      initial_state = std::nullopt;
    }
    result_state = state_pool;
  } else {
    if (output_final_state && !final_state.has_value()) {
      const int64_t HV = v.size(2), K = q.size(3), V = v.size(3);
      const std::vector<int64_t> shape = state_vk ? std::vector<int64_t>{plan.num_seqs, HV, V, K}
                                                  : std::vector<int64_t>{plan.num_seqs, HV, K, V};
      final_state = at::empty(shape, q.options().dtype(plan.state_dtype));
    }
    result_state = final_state;
  }
  if (dt_bias.has_value() && dt_bias->dim() != 1) dt_bias = dt_bias->reshape(-1);
  kda_prefill_sm90(q, THPVariable_Unpack(a[kK]), v, THPVariable_Unpack(a[kG]),
                   THPVariable_Unpack(a[kBeta]), optional_tensor(a[kALog]), dt_bias, initial_state,
                   optional_tensor(a[kCuSeqlens]), optional_tensor(a[kStateIndices]),
                   optional_tensor(a[kHasInitialState]), o, final_state, state_pool, plan.scale, plan.lower_bound,
                   PyObject_IsTrue(a[kGateInKernel]) == 1, PyObject_IsTrue(a[kL2Norm]) == 1,
                   PyObject_IsTrue(a[kBetaSigmoid]) == 1, state_vk, !plan.bounded_decays);
  // The caller's buffers were written: their version counters move, as the op's dispatch does.
  for (const std::optional<at::Tensor>* t : std::initializer_list<const std::optional<at::Tensor>*>{&out, &caller_final_state, &state_pool})
    if (t->has_value() && !(*t)->is_inference()) torch::autograd::impl::bump_version(**t);
  return py::make_tuple(o, result_state.has_value() ? py::cast(*result_state) : py::none()).release().ptr();
  END_HANDLE_TH_ERRORS
}
PyMethodDef kda_prefill_fast_def = {
    "kda_prefill_fast", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&kda_prefill_fast)), METH_FASTCALL,
    "cula.kda.kda_prefill's eager fast path: its 23 arguments, positional, in its order; (o, final_state) when the "
    "call's signature was registered, else None (then the Python path runs). Internal."};

// The launch kda_prefill_sm90 makes for a problem of this shape on a GPU of `sm_count` SMs
// (kda_prefill_sm90_launch_name): the benchmark records it with each row. Host only.
std::string kda_prefill_sm90_launch_name(int64_t batch, int64_t seqlen, int64_t num_seqs, int64_t num_qk_heads,
                                         int64_t num_v_heads, bool varlen, bool general_gates, int64_t sm_count) {
  TORCH_CHECK(batch >= 1 && seqlen >= 0 && num_seqs >= 1 && num_qk_heads >= 1 && num_v_heads >= 1 && sm_count >= 1,
              "kda_prefill_sm90_launch_name: batch, num_seqs, heads and sm_count must be >= 1 and seqlen >= 0");
  TORCH_CHECK(!varlen || batch == 1, "kda_prefill_sm90_launch_name: varlen needs batch == 1");
  TORCH_CHECK(varlen || num_seqs == batch, "kda_prefill_sm90_launch_name: num_seqs must equal batch without varlen");
  TORCH_CHECK(batch * seqlen <= INT32_MAX && num_seqs <= INT32_MAX && num_v_heads <= INT32_MAX && sm_count <= INT32_MAX,
              "kda_prefill_sm90_launch_name: sizes beyond int32");
  cula::kda::KdaPrefillParams p;
  static const int64_t kNotRead = 0;  // the rule only asks whether cu_seqlens is given
  p.cu_seqlens = varlen ? &kNotRead : nullptr;
  p.batch = int(batch);
  p.seqlen = int(seqlen);
  p.num_seqs = int(num_seqs);
  p.num_qk_heads = int(num_qk_heads);
  p.num_v_heads = int(num_v_heads);
  p.general_gates = general_gates;
  return cula::kda::kda_prefill_sm90_launch_name(p, int(sm_count));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cula fused kernels (SM90)";
  m.def("kda_prefill_sm90", &kda_prefill_sm90,
        "Fused KDA prefill forward on SM90 into caller-owned o / final_state: the CUDA implementation "
        "of the op cula::kda_prefill (call cula.kda.kda_prefill). Keyword arguments only.",
        py::kw_only(), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("A_log"),
        py::arg("dt_bias"), py::arg("initial_state"), py::arg("cu_seqlens"), py::arg("state_indices"),
        py::arg("has_initial_state"), py::arg("o"), py::arg("final_state"), py::arg("state_pool"), py::arg("scale"),
        py::arg("lower_bound"), py::arg("use_gate_in_kernel"), py::arg("use_qk_l2norm_in_kernel"),
        py::arg("use_beta_sigmoid_in_kernel"), py::arg("state_v_first"), py::arg("general_gates") = false);
  m.add_object("kda_prefill_fast", py::reinterpret_steal<py::object>(
                                      PyCFunction_NewEx(&kda_prefill_fast_def, nullptr, m.attr("__name__").ptr())));
  m.def("kda_prefill_fast_register", &kda_prefill_fast_register,
        "Remember a signature that passed kda_prefill's rules and chose sm90: its 23 arguments, then scale, "
        "lower_bound, N, state_is_bf16, bounded_decays. Returns whether it was remembered. Internal.");
  m.def("kda_prefill_fast_clear", &kda_prefill_fast_clear, "Forget every registered signature. Internal.");
  m.def("kda_prefill_sm90_launch_name", &kda_prefill_sm90_launch_name,
        "The launch kda_prefill_sm90 makes for this shape on a GPU of sm_count SMs: 'index', 'longest-first' or "
        "'cooperative-...' (the CULA_KDA_* variables apply). Host only. Keyword arguments only.",
        py::kw_only(), py::arg("batch"), py::arg("seqlen"), py::arg("num_seqs"), py::arg("num_qk_heads"),
        py::arg("num_v_heads"), py::arg("varlen"), py::arg("general_gates"), py::arg("sm_count"));
}
