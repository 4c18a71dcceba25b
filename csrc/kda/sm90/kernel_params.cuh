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

struct KdaKernelParams {
  CUtensorMap tma_q;  // [tokens, H, K]  box 64 x 1 x 64, 128B swizzle
  CUtensorMap tma_k;  // [tokens, H, K]
  CUtensorMap tma_v;  // [tokens, HV, V]
  CUtensorMap tma_g;  // [tokens, HV, K]
  KdaPrefillParams problem;
  ScheduleWorkspace* schedule = nullptr;  // longest-first schedule only
};

}  // namespace cula::kda::sm90
