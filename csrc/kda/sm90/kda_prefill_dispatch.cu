// Runtime options -> kernel instantiation. Cheap options (state layout, dtype, pool and slots,
// beta dtype and sigmoid, varlen, strides) are runtime flags; the ones that change the intra-chunk inner loops (gate
// activation, l2norm) and the tile schedule are template parameters, one instantiation per .cu
// under instantiations/. Also builds the TMA descriptors and picks the schedule and grid.
#include "kda_prefill_sm90.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

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

// The longest-first schedule's workspace (sm90::ScheduleWorkspace, 16 KB) for launches on
// `stream` of the current device: allocated and zeroed the first time, then kept for the life of
// the process. Launches on one stream run one after another and each leaves the counters at zero,
// so they share it; streams that may run concurrently get their own. The first use on a stream
// may be inside a CUDA graph capture (torch.cuda.graph captures on a stream of its own), where
// cudaMalloc is not allowed by default and a memset on the stream would only run at replay: the
// allocation is made in relaxed capture mode and zeroed on a private stream, waited for here,
// once per stream.
cudaError_t schedule_workspace(int device, cudaStream_t stream, sm90::ScheduleWorkspace** out) {
  static std::mutex mutex;
  static std::map<std::pair<int, cudaStream_t>, sm90::ScheduleWorkspace*> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  auto& ws = cache[{device, stream}];
  if (ws == nullptr) {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaError_t err = cudaThreadExchangeStreamCaptureMode(&mode);
    if (err != cudaSuccess) return err;
    void* ptr = nullptr;
    cudaStream_t zeroing = nullptr;
    err = cudaMalloc(&ptr, sizeof(sm90::ScheduleWorkspace));
    if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&zeroing, cudaStreamNonBlocking);
    if (err == cudaSuccess) err = cudaMemsetAsync(ptr, 0, sizeof(sm90::ScheduleWorkspace), zeroing);
    if (err == cudaSuccess) err = cudaStreamSynchronize(zeroing);
    if (zeroing != nullptr) cudaStreamDestroy(zeroing);
    if (err != cudaSuccess && ptr != nullptr) cudaFree(ptr);
    cudaThreadExchangeStreamCaptureMode(&mode);  // back to the caller's mode
    if (err != cudaSuccess) return err;
    ws = static_cast<sm90::ScheduleWorkspace*>(ptr);
  }
  *out = ws;
  return cudaSuccess;
}
// How a call runs (kernel_params.cuh: KernelPass). With few (sequence, value head) tiles, the fused
// kernel keeps at most that many SMs busy, and each tile takes its chunk count times the
// intra-chunk warpgroup's time per chunk, although none of that work depends on the state:
//   * cooperative (default from half the SMs' tiles down): one CTA per SM; the tile owners run
//     the fused kernel and the other CTAs compute chunks for them (chunk_workspace.cuh);
//   * split (two launches: all chunks in parallel, then the recurrence per tile): kept for
//     comparison, CULA_KDA_SPLIT=1;
//   * fused otherwise. CULA_KDA_SPLIT=0 / 1 / 2 (read per call) forces fused / split /
//     cooperative.
// Only shapes and the SM count go in, never a value of cu_seqlens.
enum class Mode { kFused, kSplit, kCooperative };

struct Plan {
  Mode mode = Mode::kFused;
  sm90::SplitPlan split;
  size_t sync_bytes = 0;   // cooperative: flags and claim counters, zeroed per call
  size_t stage_bytes = 0;  // finished stages
};

Plan plan_call(const KdaPrefillParams& p, int sm_count) {
  Plan plan;
  const int64_t tokens = int64_t(p.batch) * p.seqlen;
  const int64_t num_tiles = int64_t(p.num_seqs) * p.num_v_heads;
  const char* env = std::getenv("CULA_KDA_SPLIT");
  if (num_tiles * 2 <= sm_count && tokens >= 4 * sm90::kChunk) plan.mode = Mode::kCooperative;
  if (env != nullptr && std::strcmp(env, "0") == 0) plan.mode = Mode::kFused;
  if (env != nullptr && std::strcmp(env, "1") == 0) plan.mode = Mode::kSplit;
  if (env != nullptr && std::strcmp(env, "2") == 0) plan.mode = Mode::kCooperative;
  // Cooperative needs helpers besides the owners (one CTA per SM).
  if (plan.mode == Mode::kCooperative && num_tiles >= sm_count) plan.mode = Mode::kFused;
  if (plan.mode == Mode::kFused || tokens == 0) return Plan{};

  sm90::SplitPlan& sp = plan.split;
  sp.slots_per_head = (tokens + sm90::kChunk - 1) / sm90::kChunk + p.num_seqs;
  if (sp.slots_per_head > INT_MAX || sp.slots_per_head * p.num_v_heads > (int64_t(1) << 40)) return Plan{};
  plan.stage_bytes = size_t(sp.slots_per_head) * size_t(p.num_v_heads) * size_t(sm90::kWorkspaceStageBytes);
  if (plan.mode == Mode::kSplit) {
    const int64_t parts = std::max<int64_t>(1, sm_count / p.num_v_heads);  // CTAs per value head
    const int64_t per_cta = (sp.slots_per_head + parts - 1) / parts;
    sp.slots_per_cta = int(per_cta);
    sp.ctas_per_head = int((sp.slots_per_head + per_cta - 1) / per_cta);
  } else {
    sp.owners = int(num_tiles);
    // With fewer than three helpers per tile the owners' state warpgroups keep up with their own
    // intra-chunk work too, so the owners claim chunks as well.
    sp.owner_claims = sm_count - num_tiles < 3 * num_tiles;
    const size_t ints = size_t(sp.slots_per_head) * size_t(p.num_v_heads) + size_t(num_tiles);
    plan.sync_bytes = (ints * sizeof(int) + 1023) / 1024 * 1024;
  }
  return plan;
}

cudaError_t device_sm_count(int* sm_count) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(sm_count, cudaDevAttrMultiProcessorCount, device);
  return err;
}
}  // namespace

const char* kda_prefill_sm90_last_error() { return g_last_error; }

size_t kda_prefill_sm90_workspace_bytes(const KdaPrefillParams& p) {
  int sm_count = 0;
  if (device_sm_count(&sm_count) != cudaSuccess) return 0;
  const Plan plan = plan_call(p, sm_count);
  return plan.sync_bytes + plan.stage_bytes;
}

cudaError_t kda_prefill_sm90(const KdaPrefillParams& p, cudaStream_t stream) {
  g_last_error = "";
  if (p.head_dim != 128) return invalid("head_dim must be 128");
  if (p.num_qk_heads <= 0 || p.num_v_heads < p.num_qk_heads || p.num_v_heads % p.num_qk_heads != 0)
    return invalid("num_v_heads must be a positive multiple of num_qk_heads");
  if (p.batch <= 0 || p.seqlen < 0 || p.num_seqs <= 0) return invalid("batch, seqlen, num_seqs out of range");
  if (p.cu_seqlens != nullptr && p.batch != 1) return invalid("cu_seqlens requires batch == 1");
  if (p.cu_seqlens == nullptr && p.num_seqs != p.batch) return invalid("num_seqs must equal batch without cu_seqlens");
  if (p.state_indices != nullptr && p.num_state_slots < 0) return invalid("num_state_slots must be >= 0");
  if (p.state_slot_stride < 0 || p.beta_token_stride < 0) return invalid("negative stride");

  const int64_t tokens = int64_t(p.batch) * p.seqlen;
  // o, beta, q, k, v, g have no element when there is no token: an empty tensor's data pointer
  // may be null (torch's allocators return null for 0 bytes), and none of them is touched then.
  if (tokens > 0 && (p.o == nullptr || p.beta == nullptr)) return invalid("null output or beta");
  if (tokens > 0 && (p.q == nullptr || p.k == nullptr || p.v == nullptr || p.g == nullptr))
    return invalid("null input");

  sm90::KdaKernelParams kp;
  kp.problem = p;
  // Defaults resolved here, so the kernel reads every stride straight from parameter space.
  if (kp.problem.beta_token_stride == 0) kp.problem.beta_token_stride = p.num_v_heads;
  if (kp.problem.state_slot_stride == 0) kp.problem.state_slot_stride = int64_t(p.num_v_heads) * 128 * 128;
  // [tokens, heads, 128] bf16 tensors, loaded as 64 x 64 boxes with 128B swizzle. With no token
  // at all (every sequence empty) there is nothing to load: the kernel only moves the states
  // (initial -> final per slot) and never touches the descriptors.
  cudaError_t err = cudaSuccess;
  if (tokens > 0) {
    if ((err = sm90::make_token_head_feature_map(&kp.tma_q, p.q, tokens, p.num_qk_heads, p.q_token_stride,
                                                 p.q_head_stride)) != cudaSuccess)
      return err;
    if ((err = sm90::make_token_head_feature_map(&kp.tma_k, p.k, tokens, p.num_qk_heads, p.k_token_stride,
                                                 p.k_head_stride)) != cudaSuccess)
      return err;
    if ((err = sm90::make_token_head_feature_map(&kp.tma_v, p.v, tokens, p.num_v_heads, p.v_token_stride,
                                                 p.v_head_stride)) != cudaSuccess)
      return err;
    if ((err = sm90::make_token_head_feature_map(&kp.tma_g, p.g, tokens, p.num_v_heads, p.g_token_stride,
                                                 p.g_head_stride)) != cudaSuccess)
      return err;
  }

  const int64_t num_tiles = int64_t(p.num_seqs) * p.num_v_heads;
  int device = 0;
  if ((err = cudaGetDevice(&device)) != cudaSuccess) return err;
  int sm_count = 0;
  if ((err = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess) return err;

  const Plan plan = plan_call(p, sm_count);
  kp.split = plan.split;
  if (plan.mode != Mode::kFused) {
    if (p.workspace == nullptr) return invalid("the split modes need a workspace (kda_prefill_sm90_workspace_bytes)");
    if (num_tiles > INT_MAX || int64_t(kp.split.ctas_per_head) * p.num_v_heads > INT_MAX)
      return invalid("too many tiles for the split modes");
    uint8_t* ws = static_cast<uint8_t*>(p.workspace);
    kp.problem.workspace = ws + plan.sync_bytes;  // the stages
  }
  if (plan.mode == Mode::kCooperative) {
    kp.split.sync = reinterpret_cast<int*>(p.workspace);
    if ((err = cudaMemsetAsync(p.workspace, 0, plan.sync_bytes, stream)) != cudaSuccess) return err;
    if (p.use_gate_in_kernel)
      return p.use_qk_l2norm
                 ? sm90::launch_kda_prefill_kernel<true, true, false, sm90::KernelPass::kCooperative>(kp, sm_count, stream)
                 : sm90::launch_kda_prefill_kernel<true, false, false, sm90::KernelPass::kCooperative>(kp, sm_count, stream);
    return p.use_qk_l2norm
               ? sm90::launch_kda_prefill_kernel<false, true, false, sm90::KernelPass::kCooperative>(kp, sm_count, stream)
               : sm90::launch_kda_prefill_kernel<false, false, false, sm90::KernelPass::kCooperative>(kp, sm_count, stream);
  }
  if (plan.mode == Mode::kSplit) {
    const int chunk_grid = kp.split.ctas_per_head * p.num_v_heads;
    if (p.use_gate_in_kernel)
      err = p.use_qk_l2norm
                ? sm90::launch_kda_prefill_kernel<true, true, false, sm90::KernelPass::kChunkLocal>(kp, chunk_grid, stream)
                : sm90::launch_kda_prefill_kernel<true, false, false, sm90::KernelPass::kChunkLocal>(kp, chunk_grid, stream);
    else
      err = p.use_qk_l2norm
                ? sm90::launch_kda_prefill_kernel<false, true, false, sm90::KernelPass::kChunkLocal>(kp, chunk_grid, stream)
                : sm90::launch_kda_prefill_kernel<false, false, false, sm90::KernelPass::kChunkLocal>(kp, chunk_grid, stream);
    if (err != cudaSuccess) return err;
    return sm90::launch_kda_prefill_kernel<false, false, false, sm90::KernelPass::kRecurrence>(kp, int(num_tiles), stream);
  }

  // Tile schedule (tile_scheduler.cuh). Longest first on one persistent CTA per SM pays off where
  // tiles are short (sequences of a few chunks: a CTA per tile spends a large share of its time
  // starting up, and a persistent CTA overlaps one tile's start with the last one's end) and where
  // lengths are uneven. With long tiles, index order is as well balanced by the hardware and its
  // instantiation runs ~10% faster per chunk (register allocation; docs/perf-notes.md). So:
  // longest first when there is more than one wave of tiles and the mean sequence is shorter than
  // kLongestFirstMaxMeanTokens tokens, else index order. CULA_KDA_SCHEDULE=index or
  // =longest_first (read per call) forces one, where it applies.
  const char* schedule = std::getenv("CULA_KDA_SCHEDULE");
  const bool force_index = schedule != nullptr && std::strcmp(schedule, "index") == 0;
  const bool force_longest_first = schedule != nullptr && std::strcmp(schedule, "longest_first") == 0;
  const bool short_sequences = tokens < int64_t(sm90::kLongestFirstMaxMeanTokens) * p.num_seqs;
  const bool longest_first = !force_index && num_tiles > sm_count && num_tiles <= INT_MAX &&
                             p.num_seqs <= sm90::kSortMaxSeqs && (short_sequences || force_longest_first);
  if (longest_first) {
    if ((err = schedule_workspace(device, stream, &kp.schedule)) != cudaSuccess) return err;
    if (p.use_gate_in_kernel)
      return p.use_qk_l2norm ? sm90::launch_kda_prefill_kernel<true, true, true, sm90::KernelPass::kFused>(kp, sm_count, stream)
                             : sm90::launch_kda_prefill_kernel<true, false, true, sm90::KernelPass::kFused>(kp, sm_count, stream);
    return p.use_qk_l2norm ? sm90::launch_kda_prefill_kernel<false, true, true, sm90::KernelPass::kFused>(kp, sm_count, stream)
                           : sm90::launch_kda_prefill_kernel<false, false, true, sm90::KernelPass::kFused>(kp, sm_count, stream);
  }
  const int grid = int(std::min<int64_t>(num_tiles, INT_MAX));
  if (p.use_gate_in_kernel)
    return p.use_qk_l2norm ? sm90::launch_kda_prefill_kernel<true, true, false, sm90::KernelPass::kFused>(kp, grid, stream)
                           : sm90::launch_kda_prefill_kernel<true, false, false, sm90::KernelPass::kFused>(kp, grid, stream);
  return p.use_qk_l2norm ? sm90::launch_kda_prefill_kernel<false, true, false, sm90::KernelPass::kFused>(kp, grid, stream)
                         : sm90::launch_kda_prefill_kernel<false, false, false, sm90::KernelPass::kFused>(kp, grid, stream);
}

}  // namespace cula::kda
