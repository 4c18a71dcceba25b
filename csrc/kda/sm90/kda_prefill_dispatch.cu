// Runtime options -> kernel instantiation. Cheap options (state layout, dtype, pool and slots,
// beta dtype and sigmoid, varlen, strides) are runtime flags; the ones that change the intra-chunk inner loops (gate
// activation, l2norm) and the tile schedule are template parameters, one instantiation per .cu
// under instantiations/. Also builds the TMA descriptors and picks the schedule and grid.
#include "kda_prefill_sm90.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>
#include <cstdio>

#include "kernel_params.cuh"
#include "shared_storage.cuh"
#include "tensor_map.h"
#include "timeline.cuh"

extern char** environ;  // POSIX: the process environment (LaunchKnobs reads it in one pass)

namespace cula::kda {

namespace {
thread_local const char* g_last_error = "";

cudaError_t invalid(const char* why) {
  g_last_error = why;
  return cudaErrorInvalidValue;
}

// The launch knobs (CULA_KDA_*, docs/install.md), read per call: one pass over the environment
// collects the CULA_KDA_* entries (usually none), and the rules ask those. A getenv per knob scans
// the whole environment each time, and a cooperative launch asks ~20 knobs: with getenv the
// dispatch's device-and-plan step took 3.3-3.7 us of a cooperative call's host time on the GPU
// machine's CPU, against 0.6-0.95 us for the pair form's 4 knobs (host stamps); the plan alone
// (B1 T32768 H8), on the CI machine's CPU, 0.50-0.56 -> 0.16-0.26 us with 35 variables in the
// environment, 1.09-1.26 -> 0.22-0.23 us with 100 (docs/perf-notes.md, twenty-first session).
// Same values as getenv (the first entry of a name); past kMaxEntries such entries it asks getenv.
class LaunchKnobs {
 public:
  LaunchKnobs() {
    for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
      if ((*e)[0] != 'C' || std::strncmp(*e, "CULA_KDA_", 9) != 0) continue;  // one byte rejects most
      if (count_ == kMaxEntries) {
        overflow_ = true;
        break;
      }
      entries_[count_++] = *e;
    }
  }
  // The value of `name` (a full CULA_KDA_* name), or null when it is not set.
  const char* get(const char* name) const {
    if (overflow_) return std::getenv(name);
    const size_t len = std::strlen(name);
    for (int i = 0; i < count_; ++i)
      if (std::strncmp(entries_[i], name, len) == 0 && entries_[i][len] == '=') return entries_[i] + len + 1;
    return nullptr;
  }
  // Whether `name` is set to `value`; its integer value (0 when unset or empty).
  bool is(const char* name, const char* value) const {
    const char* v = get(name);
    return v != nullptr && std::strcmp(v, value) == 0;
  }
  int integer(const char* name) const {
    const char* v = get(name);
    return v != nullptr ? std::atoi(v) : 0;
  }

 private:
  static constexpr int kMaxEntries = 32;
  const char* entries_[kMaxEntries] = {};
  int count_ = 0;
  bool overflow_ = false;
};

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
// The cooperative mode's sync area (flags and claim counters, which must be zero when the launch
// starts) for launches on one stream of the current device, kept for the life of the process and
// zeroed *behind* each launch: the call that uses it enqueues the kernel and then a memset of the
// bytes it used, so the next launch on the stream finds them zero by stream order and no memset
// precedes it (an eager call's GPU work starts after all the host work before its first launch,
// and the memset's runtime call was 4-16 us of eager time). Areas are keyed by the stream's ID
// (cudaStreamGetId: unique for the process's life, and the real stream behind
// cudaStreamPerThread), not its handle, which a new stream may reuse while a destroyed one's
// memset is still pending. Allocated the first time and whenever a call needs more bytes; an
// outgrown area is not freed, since work in flight may still use it (areas grow by doubling, so
// all of them together are less than twice the largest). An area that is not known to be zero
// (new, or its trailing memset failed to enqueue) is zeroed on the stream before the launch. The
// caller holds g_sync_area_mutex from before this call until the trailing memset is enqueued, so
// that two host threads on one stream cannot put a launch between another's launch and its
// memset. In the two-kernel form the owners' kernel overlaps the helpers' (programmatic dependent
// launch) and a helper may still bump a claim counter after the owners' last chunk; the owners'
// state warpgroups end with griddepcontrol.wait (kda_prefill_kernel.cuh), so the owners' kernel,
// which the memset follows in stream order, ends after the helpers' kernel. Not used in a CUDA
// graph capture (the graph would hold the area's address, and its replays may run on other
// streams beside eager calls on this one): a capture, and any call for which this returns null
// (the stream's ID or the allocation unavailable), zeroes a sync area in its workspace before
// the launch instead.
struct SyncArea {
  int* ptr = nullptr;
  size_t bytes = 0;
  bool dirty = false;  // not known to be zero: zeroed before the next launch
};
std::mutex g_sync_area_mutex;
SyncArea* stream_sync_area(int device, cudaStream_t stream, size_t bytes) {
  unsigned long long id = 0;
  if (cudaStreamGetId(stream, &id) != cudaSuccess) {
    cudaGetLastError();  // (not sticky: cleared, so that the launch's error check does not see it)
    return nullptr;
  }
  static std::map<std::pair<int, unsigned long long>, SyncArea> areas;
  SyncArea& area = areas[{device, id}];
  if (area.bytes < bytes) {
    const size_t grown = std::max(bytes, 2 * area.bytes);
    void* ptr = nullptr;
    // (relaxed: another thread's capture in global mode would refuse the allocation)
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    if (cudaThreadExchangeStreamCaptureMode(&mode) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    const cudaError_t err = cudaMalloc(&ptr, grown);
    cudaThreadExchangeStreamCaptureMode(&mode);  // back to the caller's mode
    if (err != cudaSuccess) {
      cudaGetLastError();  // out of memory here: the call uses its workspace
      return nullptr;
    }
    area.ptr = static_cast<int*>(ptr);
    area.bytes = grown;
    area.dirty = true;
  }
  if (area.dirty) {
    if (cudaMemsetAsync(area.ptr, 0, area.bytes, stream) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    area.dirty = false;
  }
  return &area;
}

// Fused kernel or cooperative mode (kernel_params.cuh: KernelPass). With few (sequence, value
// head) tiles, the fused kernel keeps only that many SMs busy and each tile takes its chunk count
// times the kernel's time per chunk (~12 us when this rule was set; ~8 us since e94f895, see
// cooperative_beats_fused for the range above 0.4 x the SMs); in the cooperative mode the other SMs
// compute chunks for the tile owners, whose state chain (~4 us per chunk) then sets the pace. A
// helper computes a chunk in ~13 us, so it pays once a tile has more than about one helper;
// measured on an H100 (docs/perf-notes.md): B1 T8192 H32 (32 tiles, 3.1 helpers each) 1.62 ->
// 0.83 ms, B1 T8192 H64 (64 tiles, 1.06 helpers each) 1.58 -> 2.11 ms. So: cooperative when the
// helpers number at least 1.5 per tile (tiles <= 0.4 x SMs) and there are at least four chunks of
// tokens. CULA_KDA_COOPERATIVE=0 / =1 (read per call) forces either (1: with at least one helper).
// Only shapes and the SM count go in, never a value of cu_seqlens.
constexpr size_t kMaxCooperativeWorkspaceBytes = size_t(4) << 30;  // 4 GiB: e.g. T = 1.6M tokens at HV = 8

struct Plan {
  bool cooperative = false;
  bool pair = false;  // the pair form (fused, two CTAs per tile): pair_possible below
  sm90::CooperativePlan coop;
  size_t sync_bytes = 0;    // flags and claim counters, zeroed per call
  size_t matrix_bytes = 0;  // segments: P^T and S_out^T per (tile, segment), fp32
  size_t stage_bytes = 0;   // finished stages
};

// Segments (kernel_params.cuh: CooperativePlan) for very few tiles. Model per launch, in us, from
// what the host knows (mean chunks per tile C, tiles, SMs), fitted to H100 measurements
// (docs/perf-notes.md): the split owners' chain ~1.4 us per chunk, a helper ~7.5 us per chunk, a
// fix-up (S_out = P S_in + Q, fp32, L2-latency bound, with what else each segment boundary costs)
// ~45 us, ~60 us of start-up for the segment pipeline. Without segments: max(C x 1.4, all chunks
// x 7.5 / (SMs - 2 tiles)). With G >= 3 segments of c = ceil(C / G) chunks: the middle segments'
// P and Q chains end when both they and the helpers are through (max(c x 1.4, all chunks x 7.5 /
// helpers), helpers = SMs - tiles x (4 G - 4): the owner region holds 4 G CTAs per tile, 4 of
// which help), then G - 2 fix-ups in segment order, then the last segment's run (c x 1.4), + 60.
// The G with the least modelled time wins. The helper and fix-up constants are those that chose
// the fastest measured G on all 21 shapes of the twelfth session's sweeps (each G in blocks of
// consecutive calls, B1 T16384-T262144 at 1-8 heads); the earlier ones (12 and 20) lost 4-23 % on
// eight of them (e.g. B1 T131072 H2: G = 6 at 1.069 ms against G = 8 at 0.956; B1 T32768 H6: none
// at 0.679 against G = 3 at 0.572).
// CULA_KDA_SEGMENTS=G (read per call) forces G (1: none; G >= 3 while the owner region fits).
int choose_segments(int64_t tiles, int64_t chunks_per_tile, int64_t all_chunks, int sm_count,
                    const LaunchKnobs& knobs) {
  constexpr double kChainUs = 1.4, kHelperUs = 7.5, kFixUpUs = 45.0, kStartUs = 60.0;
  auto fits = [&](int g) { return tiles * 4 * g < sm_count; };
  int best = 1;
  double best_us = std::max(kChainUs * double(chunks_per_tile),
                            kHelperUs * double(all_chunks) / double(sm_count - 2 * tiles));
  for (int g = 3; fits(g); ++g) {
    const double helpers = double(sm_count - tiles * (4 * g - 4));
    const double seg = kChainUs * double((chunks_per_tile + g - 1) / g);
    const double us =
        std::max(seg, kHelperUs * double(all_chunks) / helpers) + kFixUpUs * double(g - 2) + seg + kStartUs;
    if (us < best_us) {
      best_us = us;
      best = g;
    }
  }
  const int forced = knobs.integer("CULA_KDA_SEGMENTS");
  if (forced == 1 || (forced >= 3 && fits(forced))) best = forced;
  return best;
}

// Tiles per owner CTA (CooperativePlan::tiles_per_owner) by a model of the launch, in us, from the
// mean chunks per tile C (exact for fixed-length batches): k tiles per owner take k x C x 2.6 us of
// one-owner chain, and all chunks take 10 us each on SMs - ceil(tiles / k) helpers (two
// intra-chunk warpgroups per helper; both constants measured on an H100, docs/perf-notes.md). The
// launch takes the longer of the two. Returns the best k in 1..4 and its time.
//
// Two kinds of helper constant, all from H100 sweeps (docs/perf-notes.md): k is chosen with 10 us
// per chunk, and the time that the fused-vs-cooperative rule compares (coop_us) takes the helpers'
// current cost at that k, per gate form: 8.5 us per chunk with safe gates, 11 with general gates
// (the softplus gate's helpers run the general prep and the exact pass). Those two are the values
// whose fits below chose right on every shape of the twelfth session's sweeps (least squares of
// each form's eager time, for helper constants from 8.5 to 12). For k itself a smaller constant
// would be worse: one tile per owner at 47-48 tiles measured 7 % slower on short tiles (B1 T1024
// H48, T2048 H47) and only 1-3 % faster on long ones, and the softplus gate's helpers keep 2 per
// owner there (11-14 % faster) and 3 at 76 tiles (2-4 %).
constexpr double kHelperUsPerChunkForK = 10.0;
constexpr double kHelperUsPerChunkSafe = 8.5;
constexpr double kHelperUsPerChunkGeneral = 11.0;
struct OwnerChoice {
  int tiles_per_owner = 1;
  double us = 0;       // the model's time with tiles_per_owner (kHelperUsPerChunkForK)
  double one_us = 0;   // and with one tile per owner
  double coop_us = 0;  // with tiles_per_owner and the gate form's helper constant: what cooperative_beats_fused takes
};
double owner_model_us(int64_t tiles, int64_t chunks_per_tile, int64_t all_chunks, int sm_count, int k,
                      double helper_us_per_chunk) {
  const int64_t helpers = int64_t(sm_count) - (tiles + k - 1) / k;
  return std::max(2.6 * double(k * chunks_per_tile), helper_us_per_chunk * double(all_chunks) / double(helpers));
}
OwnerChoice choose_tiles_per_owner(int64_t tiles, int64_t chunks_per_tile, int64_t all_chunks, int sm_count,
                                   bool general_gates) {
  OwnerChoice best;
  for (int k = 1; k <= 4; ++k) {
    if (int64_t(sm_count) - (tiles + k - 1) / k < 1) continue;  // no helper left
    const double us = owner_model_us(tiles, chunks_per_tile, all_chunks, sm_count, k, kHelperUsPerChunkForK);
    if (k == 1) best.one_us = us;
    if (k == 1 || us < best.us) {
      best.tiles_per_owner = k;
      best.us = us;
    }
  }
  if (int64_t(sm_count) - tiles >= 1)
    best.coop_us = owner_model_us(tiles, chunks_per_tile, all_chunks, sm_count, best.tiles_per_owner,
                                  general_gates ? kHelperUsPerChunkGeneral : kHelperUsPerChunkSafe);
  return best;
}

// Between 0.4 x and 1 x the SMs in tiles: the eager call's time in us by fits of H100 measurements
// (docs/perf-notes.md, "Where it stands (twelfth session)": CULA_KDA_COOPERATIVE=0/1 in blocks of
// ten consecutive calls, three input sets, over 22 safe-gate shapes of 53 to 96 tiles and 16 to 256
// chunks and 12 softplus ones, at 0d70888's kernels; an earlier fit from sweeps that interleaved
// the two forms call by call had the fused kernel's short tiles ~10 % slow, see there). Safe gates:
// the fused kernel (one wave) 7.12 us per chunk of a tile + 44, the cooperative mode 0.92 x the
// tiles-per-owner model + 87; general gates: 10.0 us per chunk + 28 and 0.85 x the model + 83.
// The cooperative mode runs where its estimate is 2 % below the fused one: with safe gates
// cooperative from 24 chunks a tile at 64 tiles (B1 T1536-T8192 H64), B1 T2048 H56-H64, B1 T4096 H72,
// B1 T8192 H53-H74, B2 T8192 H37, B1 T16384 H70; fused for tiles of 16 chunks from 53 tiles (B1
// T1024 H56-H96, B2 T1024 H32: 3-9 % faster fused, where the cooperative mode's second launch
// and its sync area cost more than its helpers save), B1 T2048 H70-H80, 80-112 tiles of T4096-T8192,
// B1 T16384 H75. General gates: cooperative up to 64 tiles of T1024 (softplus B1 T1024 H64: 13 %
// faster) and up to 96 tiles of T8192 (10 %), fused for 80-96 tiles of T1024 and 96 of T2048-T4096.
bool cooperative_beats_fused(double owner_model_us, int64_t chunks_per_tile, bool general_gates) {
  const double c = double(chunks_per_tile);
  if (general_gates) return 0.85 * owner_model_us + 83.0 < 0.98 * (10.0 * c + 28.0);
  return 0.92 * owner_model_us + 87.0 < 0.98 * (7.12 * c + 44.0);
}

// The pair form (kernel_params.cuh: KernelPass::kFusedPair; pair_intra_math.cuh): one tile on a
// cluster of two CTAs, each on half of the value columns, the intra-chunk chain split between
// them. It can run with safe gates where two CTAs per tile fit on the SMs, and then replaces the
// fused kernel (one CTA per tile): same-process A/Bs on H100s (docs/perf-notes.md, "Where it
// stands (71ba941)"), CUDA-graph ms fused / pair: B1 T1024 H64 0.128 / 0.121, T2048 H64 0.241 /
// 0.225, T8192 H64 0.907 / 0.812, T8192 H8-H32 0.90-0.94 / 0.80-0.83 (bitwise the same results).
// Not the cooperative mode, where the host chose it, except where pair_beats_cooperative (below)
// says so. CULA_KDA_PAIR=0 (read per call) runs the fused kernel instead; =1 takes the pair form wherever it
// can run, also over the cooperative mode.
bool pair_possible(const KdaPrefillParams& p, int sm_count, const LaunchKnobs& knobs) {
  const int64_t tokens = int64_t(p.batch) * p.seqlen;
  const int64_t num_tiles = int64_t(p.num_seqs) * p.num_v_heads;
  return !p.general_gates && tokens > 0 && 2 * num_tiles <= sm_count && !knobs.is("CULA_KDA_PAIR", "0");
}

// Where the launch rule below picks the cooperative mode and the pair form can run: the pair form
// instead for fixed-length tiles of at most 32 chunks from 48 tiles (0.36 x the SMs) on. Its time
// per tile does not depend on the tile count (~5.65 us per chunk + 28 at e1a6c7a), the mode's grows
// with it. Same process, blocks of calls, eager ms of the rule's cooperative launch / the pair form
// (H100, e1a6c7a's kernels; docs/perf-notes.md, "Where it stands (e1a6c7a)"): B1 T1536 H64 0.196 /
// 0.165, T2048 H64 0.229 / 0.209, T3072 H64 0.306 / 0.300, T4096 H64 0.388 / 0.390, T8192 H64
// 0.709 / 0.758, B1 T1024 H48 0.132 / 0.116, T2048 H48 0.205 / 0.207, T4096 H48 0.353 / 0.389,
// B1 T1024 H32 0.097 / 0.116, T2048 H32 0.138 / 0.207. Varlen batches keep the rule's choice (the
// helpers balance unequal tiles; not measured).
bool pair_beats_cooperative(const KdaPrefillParams& p, int64_t num_tiles, int64_t chunks_per_tile, int sm_count) {
  return p.cu_seqlens == nullptr && num_tiles * 11 >= int64_t(sm_count) * 4 && chunks_per_tile <= 32;
}

// can_pair: pair_possible, decided once per call by plan_call.
Plan plan_call_modes(const KdaPrefillParams& p, int sm_count, bool can_pair, const LaunchKnobs& knobs);
Plan plan_call(const KdaPrefillParams& p, int sm_count, const LaunchKnobs& knobs) {
  const bool can_pair = pair_possible(p, sm_count, knobs);
  Plan plan = plan_call_modes(p, sm_count, can_pair, knobs);
  plan.pair = !plan.cooperative && can_pair;
  return plan;
}

Plan plan_call_modes(const KdaPrefillParams& p, int sm_count, bool can_pair, const LaunchKnobs& knobs) {
  Plan plan;
  const int64_t tokens = int64_t(p.batch) * p.seqlen;
  const int64_t num_tiles = int64_t(p.num_seqs) * p.num_v_heads;
  const int64_t all_chunks = (tokens + sm90::kChunk - 1) / sm90::kChunk * p.num_v_heads;
  const int64_t chunks_per_tile = (tokens / p.num_seqs + sm90::kChunk - 1) / sm90::kChunk;
  // Cooperative for few tiles (<= 0.4 x SMs: the helpers outrun the chains), and up to the SM
  // count where the model above says the mode's call is the shorter one (cooperative_beats_fused).
  const OwnerChoice owner_choice =
      choose_tiles_per_owner(num_tiles, chunks_per_tile, all_chunks, sm_count, p.general_gates);
  const bool coop_by_model =
      num_tiles < sm_count && cooperative_beats_fused(owner_choice.coop_us, chunks_per_tile, p.general_gates);
  bool coop = (num_tiles * 5 <= int64_t(sm_count) * 2 || coop_by_model) && tokens >= 4 * sm90::kChunk;
  if (can_pair && (knobs.is("CULA_KDA_PAIR", "1") || pair_beats_cooperative(p, num_tiles, chunks_per_tile, sm_count)))
    coop = false;
  if (knobs.is("CULA_KDA_COOPERATIVE", "0")) coop = false;
  if (knobs.is("CULA_KDA_COOPERATIVE", "1")) coop = true;
  if (!coop || tokens == 0 || num_tiles >= sm_count) return plan;
  const int64_t slots = (tokens + sm90::kChunk - 1) / sm90::kChunk + p.num_seqs;
  if (slots > INT_MAX) return plan;
  // The workspace grows with T (one finished stage per chunk and value head, ~74 KB); past
  // kMaxCooperativeWorkspaceBytes the call runs fused instead (no workspace at all).
  if (double(slots) * double(p.num_v_heads) * sm90::kWorkspaceStageBytes > double(kMaxCooperativeWorkspaceBytes))
    return plan;
  plan.cooperative = true;
  plan.coop.slots_per_head = slots;
  plan.coop.tiles = int(num_tiles);
  // Helpers in a kernel of their own with two intra-chunk warpgroups per CTA (kernel_params.cuh),
  // each a latency-bound chain on one warp per scheduler: together they fill issue slots one
  // leaves idle. The owners' kernel starts while the helpers' runs (programmatic dependent
  // launch). Read per call: CULA_KDA_HELPER_KERNEL=0 runs the one-kernel form (one intra-chunk
  // warpgroup per helper), CULA_KDA_HELPER_INTRA=1 keeps one in the helpers' kernel,
  // CULA_KDA_OVERLAP_OWNERS=0 launches the owners' kernel after the helpers' ends.
  // The two-kernel form pays where the helpers bound the launch; where the owners' chains do (few
  // long tiles, e.g. B1 T32768 H8: ~512 x 1.4 us of chain against ~4096 x 12 us over 116
  // helpers), the one-kernel form measured 2-3 % faster (docs/perf-notes.md), so it runs there:
  // chain C x 1.4 us > all chunks x 12 us / (SMs - 2 tiles), without segments (set below).
  const bool chain_bound = 1.4 * double(chunks_per_tile) > 12.0 * double(all_chunks) / double(std::max<int64_t>(sm_count - 2 * num_tiles, 1));
  plan.coop.helper_kernel = !chain_bound;
  if (knobs.is("CULA_KDA_HELPER_KERNEL", "0")) plan.coop.helper_kernel = false;
  if (knobs.is("CULA_KDA_HELPER_KERNEL", "1")) plan.coop.helper_kernel = true;

  plan.coop.overlap_owners = !knobs.is("CULA_KDA_OVERLAP_OWNERS", "0");
  // The helpers' storer releases a stage once its copy has read it (=0: after the write has
  // landed; same results).
  plan.coop.early_release = !knobs.is("CULA_KDA_EARLY_RELEASE", "0");
  // The helpers' kernel's owner region warms the helpers' intra-chunk code (CooperativePlan::
  // warm_entries; same results). Same-process A/Bs on an H100 (docs/perf-notes.md), graph time
  // with 6 entries against none: B1 T1024 H64 -4..-6 %, T2048 H64 -3..-4 %, T8192 H64 -1..-2 %,
  // T65536 H4 and varlen 30000 + 3 -1..-2 %; 5 entries (not step 1) gained less.
  // CULA_KDA_HELPER_WARM=0 / 5 / 6 (read per call) sets the number of entry steps.
  plan.coop.warm_entries = 6;
  if (knobs.is("CULA_KDA_HELPER_WARM", "0")) plan.coop.warm_entries = 0;
  if (knobs.is("CULA_KDA_HELPER_WARM", "5")) plan.coop.warm_entries = 5;
  // How a helper whose unit ran out picks the next (chunk_workspace.cuh: pick_helper_unit): the
  // unit with the most chunks left where tiles are 32 chunks or longer, else one drawn in
  // proportion to the chunks left. Same-process A/Bs on an H100 (docs/perf-notes.md), graph time
  // most / draw: B1 T8192 H64 -7..-9 %, T4096 H64 -5 %, T2048 H64 -0.5..-4 %, T65536 H4 (segments)
  // -1 %, T32768 H8 and varlen 30000 + 3 within 1 %, but B1 T1024 H64 (16 chunks) +4..+5 %.
  // CULA_KDA_HELPER_PICK=most / =draw (read per call) forces either.
  plan.coop.pick_most = chunks_per_tile >= 32;
  if (knobs.is("CULA_KDA_HELPER_PICK", "most")) plan.coop.pick_most = true;
  if (knobs.is("CULA_KDA_HELPER_PICK", "draw")) plan.coop.pick_most = false;
  // Value split (kernel_params.cuh: CooperativePlan): two owners per tile halve the state chain's
  // tensor-core work per chunk, which pays once the helpers outrun the chain (value_split_pays:
  // the owner's chain ~2.6 us per chunk, a helper ~7.5 us per chunk with safe gates). With
  // varlen, which tiles those are depends on the sequence lengths, which only the device reads:
  // the owner region has two CTAs per tile and the kernel gives a tile its second owner by the
  // same rule (tile_scheduler.cuh: tile_has_two_owners); a tile with one owner lends its second
  // CTA to the helpers. With fixed length the host decides (below). CULA_KDA_VALUE_SPLIT=1 / =2
  // (read per call) forces one owner per tile / two for every tile (2: while two owners per tile
  // leave at least one helper).
  int split = 2;
  bool split_on_device = true;
  const bool split_forced = knobs.is("CULA_KDA_VALUE_SPLIT", "1") || knobs.is("CULA_KDA_VALUE_SPLIT", "2");
  if (knobs.is("CULA_KDA_VALUE_SPLIT", "1")) split = 1;
  if (knobs.is("CULA_KDA_VALUE_SPLIT", "2")) split_on_device = false;
  if (2 * num_tiles >= sm_count) split = 1;
  // Several tiles per owner where the model finds the helpers the limit (fixed-length batches,
  // whose tiles the host knows, and 5 % better than one tile per owner; not with
  // CULA_KDA_VALUE_SPLIT=1 or 2); then one owner per tile and no segments. CULA_KDA_TILES_PER_OWNER=k
  // (read per call) forces k (1..4).
  int tiles_per_owner = 1;
  if (!split_forced && p.cu_seqlens == nullptr && owner_choice.tiles_per_owner > 1 &&
      owner_choice.us < 0.95 * owner_choice.one_us)
    tiles_per_owner = owner_choice.tiles_per_owner;
  if (const int forced = knobs.integer("CULA_KDA_TILES_PER_OWNER");
      forced >= 1 && forced <= 4 && (num_tiles + forced - 1) / forced < sm_count)
    tiles_per_owner = forced;
  if (tiles_per_owner > 1) split = 1;
  // Fixed length: every tile has the same chunks, so the host takes the device's rule once. Where
  // it keeps one owner per tile the owner region is then one CTA per tile: the on-device form kept
  // each tile's second CTA as a helper that joins later, measured 0-6 % slower (B1 T8192 H28 0.393
  // against 0.370 ms, B1 T16384 H28 0.696 against 0.681; docs/perf-notes.md).
  if (split == 2 && split_on_device && !split_forced && p.cu_seqlens == nullptr) {
    if (sm90::value_split_pays(chunks_per_tile, chunks_per_tile * num_tiles, int64_t(sm_count) - 2 * num_tiles,
                               p.general_gates))
      split_on_device = false;
    else
      split = 1;
  }
  plan.coop.split_on_device = split == 2 && split_on_device;
  plan.coop.value_split = split;
  plan.coop.tiles_per_owner = tiles_per_owner;
  plan.coop.owners = tiles_per_owner > 1 ? int((num_tiles + tiles_per_owner - 1) / tiles_per_owner) : int(num_tiles) * split;
  const int segments = split == 2 ? choose_segments(num_tiles, chunks_per_tile, all_chunks, sm_count, knobs) : 1;
  if (segments > 1) {
    // Segments leave fewer helpers (the owner region is 4 G CTAs per tile): the two-kernel form,
    // unless forced (B1 T65536 H4, 4 segments: 0.925 vs 0.981 ms one-kernel).
    if (!knobs.is("CULA_KDA_HELPER_KERNEL", "0")) plan.coop.helper_kernel = true;
    plan.coop.segments = segments;
    plan.coop.split_on_device = false;
    plan.coop.owners = int(num_tiles) * 4 * segments;
  }
  plan.coop.helper_intra = plan.coop.helper_kernel && !knobs.is("CULA_KDA_HELPER_INTRA", "1") ? 2 : 1;
  const size_t units = size_t(num_tiles) * size_t(segments);
  plan.stage_bytes = size_t(slots) * size_t(p.num_v_heads) * size_t(sm90::kWorkspaceStageBytes);
  // published flags, then per unit: claim counter, P count, two S_out flags
  const size_t ints = size_t(slots) * size_t(p.num_v_heads) + (segments > 1 ? 4 : 1) * units;
  plan.sync_bytes = (ints * sizeof(int) + 1023) / 1024 * 1024;
  plan.matrix_bytes = segments > 1 ? units * 2 * sm90::kHeadDim * sm90::kHeadDim * sizeof(float) : 0;
  return plan;
}

// Tile schedule of the fused kernel (tile_scheduler.cuh): longest first on one persistent CTA per
// SM whenever there is more than one wave of tiles, else index order (one CTA per tile). Longest
// first pays off where tiles are short (a CTA per tile spends a large share of its time starting
// up; a persistent CTA overlaps one tile's start with the last one's end) and where lengths are
// uneven (greedy longest-processing-time order instead of the hardware's index order). Since the
// prep-ahead and fold kernels it is also as fast or faster on long uniform tiles: same-process
// sweep of 20 rows with 320 to 8192 tiles: -1.2 % (long uniform tiles) to -30 % (docs/perf-notes.md),
// so the earlier mean-length threshold (320 tokens) is gone. CULA_KDA_SCHEDULE=index (read per
// call) forces index order. General gates too (their own longest-first instantiations).
bool longest_first_schedule(const KdaPrefillParams& p, int sm_count, const LaunchKnobs& knobs) {
  const int64_t num_tiles = int64_t(p.num_seqs) * p.num_v_heads;
  const bool force_index = knobs.is("CULA_KDA_SCHEDULE", "index");
  return !force_index && num_tiles > sm_count && num_tiles <= INT_MAX && p.num_seqs <= sm90::kSortMaxSeqs;
}

// The instantiation for the call's gate form and l2norm (the instantiations/ files, one each):
// gate given or in the kernel x l2norm, for the decays `kDecays`; the softplus gate exists only in
// the kernel (the call's gate_softplus implies use_gate_in_kernel).
template <bool kLongestFirst, sm90::KernelPass kPass, sm90::Decays kDecays>
cudaError_t launch_for_gate(const KdaPrefillParams& p, const sm90::KdaKernelParams& kp, int grid, cudaStream_t stream) {
  if (p.use_gate_in_kernel || kDecays == sm90::Decays::kGeneralSoftplus)
    return p.use_qk_l2norm ? sm90::launch_kda_prefill_kernel<true, true, kLongestFirst, kPass, kDecays>(kp, grid, stream)
                           : sm90::launch_kda_prefill_kernel<true, false, kLongestFirst, kPass, kDecays>(kp, grid, stream);
  if constexpr (kDecays != sm90::Decays::kGeneralSoftplus)
    return p.use_qk_l2norm ? sm90::launch_kda_prefill_kernel<false, true, kLongestFirst, kPass, kDecays>(kp, grid, stream)
                           : sm90::launch_kda_prefill_kernel<false, false, kLongestFirst, kPass, kDecays>(kp, grid, stream);
  return cudaErrorInvalidValue;  // not reached: the softplus gate is in the kernel
}

// ... and for the call's decays: the safe-gate kernels, or (general_gates) the general-gate ones,
// with the softplus gate in instantiations of its own.
template <bool kLongestFirst, sm90::KernelPass kPass>
cudaError_t launch_instantiation(const KdaPrefillParams& p, const sm90::KdaKernelParams& kp, int grid,
                                 cudaStream_t stream) {
  if (!p.general_gates) return launch_for_gate<kLongestFirst, kPass, sm90::Decays::kSafe>(p, kp, grid, stream);
  if (p.use_gate_in_kernel && p.gate_softplus)
    return launch_for_gate<kLongestFirst, kPass, sm90::Decays::kGeneralSoftplus>(p, kp, grid, stream);
  return launch_for_gate<kLongestFirst, kPass, sm90::Decays::kGeneral>(p, kp, grid, stream);
}

// The SM count of `device`, asked of the runtime once per device (it does not change while the
// process runs): one runtime call less before every launch.
cudaError_t sm_count_of(int device, int* sm_count) {
  static std::atomic<int> known[64] = {};
  if (device >= 0 && device < 64) {
    if (const int n = known[device].load(std::memory_order_relaxed); n > 0) {
      *sm_count = n;
      return cudaSuccess;
    }
  }
  const cudaError_t err = cudaDeviceGetAttribute(sm_count, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess && device >= 0 && device < 64) known[device].store(*sm_count, std::memory_order_relaxed);
  return err;
}
cudaError_t device_sm_count(int* sm_count) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = sm_count_of(device, sm_count);
  return err;
}

cudaError_t launch(const KdaPrefillParams& p, cudaStream_t stream, WorkspaceAllocator allocate, void* ctx);

#ifdef CULA_KDA_TIMELINE
// Timeline builds (timeline.cuh): one event buffer per process, zeroed before each cooperative
// launch; with CULA_KDA_TIMELINE_FILE set, the launch is waited for and its events written there
// as text lines `ns event extra cta v_head slot` (overwritten by each launch: the file holds the last).
// fixed_records > 0 (the pair form: one record per CTA, kind and chunk, timeline.cuh:
// pair_timeline_mark): those records are zeroed and the count set to their number instead.
void* timeline_buffer(cudaStream_t stream, unsigned long long fixed_records = 0) {
  static void* buf = nullptr;
  static unsigned long long count = 0;  // the source of the count's copy (outlives the call)
  const size_t bytes = 16 + size_t(sm90::kTimelineCapacity) * sizeof(sm90::TimelineRecord);
  if (buf == nullptr && cudaMalloc(&buf, bytes) != cudaSuccess) return nullptr;
  count = std::min<unsigned long long>(fixed_records, sm90::kTimelineCapacity);
  if (count > 0) cudaMemsetAsync(static_cast<uint8_t*>(buf) + 16, 0, count * sizeof(sm90::TimelineRecord), stream);
  cudaMemcpyAsync(buf, &count, sizeof(count), cudaMemcpyHostToDevice, stream);
  return buf;
}
void timeline_write(void* buf, cudaStream_t stream) {
  const char* path = std::getenv("CULA_KDA_TIMELINE_FILE");
  if (buf == nullptr || path == nullptr || cudaStreamSynchronize(stream) != cudaSuccess) return;
  unsigned long long count = 0;
  cudaMemcpy(&count, buf, sizeof(count), cudaMemcpyDeviceToHost);
  count = std::min<unsigned long long>(count, sm90::kTimelineCapacity);
  std::vector<sm90::TimelineRecord> rec(count);
  cudaMemcpy(rec.data(), static_cast<uint8_t*>(buf) + 16, count * sizeof(sm90::TimelineRecord), cudaMemcpyDeviceToHost);
  if (FILE* f = std::fopen(path, "w")) {
    for (const auto& r : rec)
      std::fprintf(f, "%llu %u %u %u %d %d\n", (unsigned long long)r.ns, r.event & 0xffu, r.event >> 8, r.cta, r.v_head,
                   r.slot);
    std::fclose(f);
  }
}
// Writes the launch's events when it goes out of scope (after the launch below it).
struct TimelineWriteAfter {
  void* buf;
  cudaStream_t stream;
  ~TimelineWriteAfter() { timeline_write(buf, stream); }
};
#endif
}  // namespace

const char* kda_prefill_sm90_last_error() { return g_last_error; }

std::string kda_prefill_sm90_launch_name(const KdaPrefillParams& p, int sm_count) {
  const LaunchKnobs knobs;
  const Plan plan = plan_call(p, sm_count, knobs);
  if (plan.pair) return "pair";
  if (!plan.cooperative) return longest_first_schedule(p, sm_count, knobs) ? "longest-first" : "index";
  const sm90::CooperativePlan& c = plan.coop;
  std::string name = c.helper_kernel ? "cooperative-two-kernels" : "cooperative-one-kernel";
  if (c.segments > 1) return name + "-" + std::to_string(c.segments) + "-segments";
  if (c.tiles_per_owner > 1) return name + "-" + std::to_string(c.tiles_per_owner) + "-tiles-per-owner";
  if (c.value_split == 2) return name + (c.split_on_device ? "-split-on-device" : "-split");
  return name;
}

size_t kda_prefill_sm90_workspace_bytes(const KdaPrefillParams& p) {
  int sm_count = 0;
  if (device_sm_count(&sm_count) != cudaSuccess) return 0;
  const Plan plan = plan_call(p, sm_count, LaunchKnobs());
  if (plan.pair) return 0;
  return plan.sync_bytes + plan.matrix_bytes + plan.stage_bytes;
}

cudaError_t kda_prefill_sm90(const KdaPrefillParams& p, cudaStream_t stream) {
  return launch(p, stream, nullptr, nullptr);
}

cudaError_t kda_prefill_sm90(const KdaPrefillParams& p, cudaStream_t stream, WorkspaceAllocator allocate, void* ctx) {
  if (allocate == nullptr) return invalid("kda_prefill_sm90: null workspace allocator");
  return launch(p, stream, allocate, ctx);
}

namespace {
// kda_prefill_sm90 with the caller's workspace (allocate == nullptr: params.workspace) or one
// allocated here through `allocate` once the launch is planned.
cudaError_t launch(const KdaPrefillParams& p, cudaStream_t stream, WorkspaceAllocator allocate, void* ctx) {
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
  if ((err = sm_count_of(device, &sm_count)) != cudaSuccess) return err;

  const LaunchKnobs knobs;
  const Plan plan = plan_call(p, sm_count, knobs);
  if (plan.pair) {
#ifdef CULA_KDA_TIMELINE
    kp.coop.timeline = timeline_buffer(stream, 2ull * num_tiles * sm90::kPairTimelineKinds * sm90::kPairTimelineChunks);
    const TimelineWriteAfter write_after{kp.coop.timeline, stream};
#endif
    return launch_for_gate<false, sm90::KernelPass::kFusedPair, sm90::Decays::kSafe>(p, kp, int(2 * num_tiles), stream);
  }
  if (plan.cooperative) {
    const size_t needed = plan.sync_bytes + plan.matrix_bytes + plan.stage_bytes;
    void* workspace = p.workspace;
    size_t workspace_bytes = p.workspace_bytes;
    if (allocate != nullptr) {
      workspace = allocate(needed, ctx);
      workspace_bytes = needed;
      if (workspace == nullptr) {
        g_last_error = "the workspace allocator returned null";
        return cudaErrorMemoryAllocation;
      }
    }
    if (workspace == nullptr || workspace_bytes < needed)
      return invalid("the cooperative mode needs a workspace of kda_prefill_sm90_workspace_bytes() bytes");
    if (reinterpret_cast<uintptr_t>(workspace) % 16 != 0) return invalid("the workspace must be 16-byte aligned");
    kp.coop = plan.coop;
    kp.coop.sync = static_cast<int*>(workspace);
    kp.coop.matrices = reinterpret_cast<float*>(static_cast<uint8_t*>(workspace) + plan.sync_bytes);
    kp.problem.workspace = static_cast<uint8_t*>(workspace) + plan.sync_bytes + plan.matrix_bytes;  // the stages
#ifdef CULA_KDA_TIMELINE
    kp.coop.timeline = timeline_buffer(stream);
    const TimelineWriteAfter write_after{kp.coop.timeline, stream};
#endif
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if ((err = cudaStreamIsCapturing(stream, &capture)) != cudaSuccess) return err;
    if (capture == cudaStreamCaptureStatusNone && !knobs.is("CULA_KDA_SYNC_AREA", "workspace")) {
      // Not captured: the stream's sync area, zero already; zeroed again behind the launch.
      const std::lock_guard<std::mutex> lock(g_sync_area_mutex);
      if (SyncArea* area = stream_sync_area(device, stream, plan.sync_bytes)) {
        kp.coop.sync = area->ptr;
        err = launch_instantiation<false, sm90::KernelPass::kCooperative>(p, kp, sm_count, stream);
        if (cudaMemsetAsync(area->ptr, 0, plan.sync_bytes, stream) != cudaSuccess) {
          cudaGetLastError();
          area->dirty = true;  // zeroed before the next launch instead
        }
        return err;
      }
    }
    if ((err = cudaMemsetAsync(workspace, 0, plan.sync_bytes, stream)) != cudaSuccess) return err;
    return launch_instantiation<false, sm90::KernelPass::kCooperative>(p, kp, sm_count, stream);
  }
  if (longest_first_schedule(p, sm_count, knobs)) {
    if ((err = schedule_workspace(device, stream, &kp.schedule)) != cudaSuccess) return err;
    return launch_instantiation<true, sm90::KernelPass::kFused>(p, kp, sm_count, stream);
  }
  return launch_instantiation<false, sm90::KernelPass::kFused>(p, kp, int(std::min<int64_t>(num_tiles, INT_MAX)),
                                                               stream);
}
}  // namespace

}  // namespace cula::kda
