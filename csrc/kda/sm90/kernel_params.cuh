// Kernel arguments: the problem description plus the TMA descriptors built on the host.
// Passed as one __grid_constant__ parameter so the descriptors live in parameter space, where
// TMA can read them without a copy to global memory.
#pragma once

#include <cuda.h>

#include "kda_params.h"

namespace cula::kda::sm90 {

constexpr int kSortMaxSeqs = 4096;  // sequences the longest-first schedule sorts (tile_scheduler.cuh)
// The host picks the longest-first schedule for batches whose mean sequence is shorter than this
// (and that have more tiles than SMs); measured in docs/perf-notes.md.
constexpr int kLongestFirstMaxMeanTokens = 320;

// Global workspace of the longest-first schedule, one per (device, stream), allocated and zeroed
// once by the host (kda_prefill_dispatch.cu). The kernel hands out tiles with an atomic counter
// and the last CTA to finish sets both counters back to zero, so the next launch on the stream
// (or the next replay of a CUDA graph) finds the workspace as the first one did.
struct ScheduleWorkspace {
  int next_tile;   // tiles handed out so far in this launch (+1 per CTA for the fetch that found none)
  int ctas_done;   // CTAs that found no tile left
  int pad[30];     // the counters get their own 128-byte line
  int sorted_seq[kSortMaxSeqs];  // sequences, most chunks first (every CTA writes the same values)
};

// Which part of the work one launch does (kda_prefill_kernel.cuh). The split mode runs two
// launches for calls with fewer (sequence, value head) tiles than SMs (kda_prefill_dispatch.cu):
//   kFused       one CTA per tile does everything (producer, intra-chunk, state warpgroups)
//   kChunkLocal  split pass 1: CTAs over (value head, range of chunk slots) run the producer and
//                the intra-chunk warpgroup on every chunk of their range in parallel, and a
//                storer thread copies each finished stage to the workspace
//   kRecurrence  split pass 2: one CTA per tile runs the state warpgroups on the stages read
//                back from the workspace (no intra-chunk work left)
//   kCooperative one launch of one CTA per SM: CTA b < tiles owns tile b and runs the fused
//                kernel, except that each chunk it does not claim itself arrives finished from
//                the workspace; the other CTAs (helpers) claim chunks of the tiles, compute them
//                like the chunk-local pass and publish each with a flag (chunk_workspace.cuh)
enum class KernelPass : int { kFused = 0, kChunkLocal = 1, kRecurrence = 2, kCooperative = 3 };

// Split mode: the workspace holds one finished stage (kWorkspaceStageBytes) per chunk slot and
// value head. Chunk c of sequence n (first token t0) has slot t0 / 64 + n + c within its head:
// slots of consecutive sequences never overlap (floor(t0' / 64) + 1 >= floor(t0 / 64) +
// ceil(len / 64) for t0' = t0 + len), and every slot is below ceil(T / 64) + N whatever the
// (clamped) cu_seqlens values are.
struct SplitPlan {
  int64_t slots_per_head = 0;  // ceil(tokens / 64) + N
  int slots_per_cta = 0;       // chunk-local pass: consecutive slots of one CTA
  int ctas_per_head = 0;       // chunk-local pass: grid = ctas_per_head * HV
  // Cooperative mode: `sync` (zeroed before the launch) holds a published flag per (value head,
  // slot), [HV][slots_per_head], then a claim counter per tile, [owners].
  int owners = 0;              // tiles (CTAs [0, owners) own one each); 0: not cooperative
  bool owner_claims = false;   // owners also compute chunks (few helpers per tile)
  int* sync = nullptr;
};

struct KdaKernelParams {
  CUtensorMap tma_q;  // [tokens, H, K]  box 64 x 1 x 64, 128B swizzle
  CUtensorMap tma_k;  // [tokens, H, K]
  CUtensorMap tma_v;  // [tokens, HV, V]
  CUtensorMap tma_g;  // [tokens, HV, K]
  KdaPrefillParams problem;
  ScheduleWorkspace* schedule = nullptr;  // longest-first schedule only
  SplitPlan split;                         // split mode only (problem.workspace holds the stages)
};

}  // namespace cula::kda::sm90
