// Tile scheduler: a work tile is one (sequence n, value head hv) pair; its query/key head is
// hv / (HV / H) (grouped value attention). Every role of a CTA walks the same tile sequence, so
// each derives the same (tile, chunk) order without talking to the others. Sequence bounds are
// read from cu_seqlens on the device, so nothing here needs a host synchronisation.
//
// Two schedules, chosen on the host (kda_prefill_dispatch.cu), each its own kernel instantiation:
//
//   * index order (default): one CTA per tile, tile rank b = blockIdx.x; the hardware hands CTAs
//     to SMs as they free up, a dynamic greedy schedule.
//   * longest first (opt-in, CULA_KDA_SCHEDULE=longest_first; varlen with more tiles than SMs):
//     one persistent CTA per SM. At start every CTA sorts the sequences by chunk count (most
//     first, ties by index: a total order, so every CTA gets the same result) with a bitonic sort
//     in the not yet used stage buffers, and keeps the sequences of its own tiles. CTA b takes
//     ranks b, 2G-1-b, 2G+b, 4G-1-b, ... (a snake over the sorted tiles, G CTAs). The producer
//     runs into the next tile's chunks while the state warpgroups finish the current one, so
//     there is no gap between tiles. The assignment is static: it wins on many similar
//     sequences (no CTA launch per tile) and loses where one sequence dominates (its CTAs still
//     take their share of the short tiles); see docs/perf-notes.md.
//
// In both, the value heads of one sequence have adjacent ranks, so heads that share a q/k head
// (GVA) run at the same time and their q/k loads hit in L2.
#pragma once

#include <cstdint>

#include "kda_params.h"
#include "kernel_params.cuh"
#include "shared_storage.cuh"
#include "sm90_primitives.cuh"

namespace cula::kda::sm90 {

struct WorkTile {
  int seq;        // sequence index n
  int v_head;     // hv
  int qk_head;    // hv / (HV / H)
  int64_t token0; // first token of the sequence in the flattened [B*T] token axis
  int length;     // tokens in the sequence (may be 0)
  __device__ int num_chunks() const { return (length + kChunk - 1) / kChunk; }
  // Valid rows of chunk c (1..64).
  __device__ int chunk_rows(int c) const { return min(kChunk, length - c * kChunk); }
};

static_assert(kSortMaxSeqs * 8 <= 2 * kTileBytes, "sort keys must fit in stage 0's q and k tiles");

__device__ __forceinline__ int64_t seq_start(const KdaPrefillParams& p, int n) {
  return p.cu_seqlens_is_int64 ? static_cast<const int64_t*>(p.cu_seqlens)[n]
                               : int64_t(static_cast<const int32_t*>(p.cu_seqlens)[n]);
}

// Rank of the k-th tile of this CTA: the snake above, or a plain grid stride in index order.
template <bool kLongestFirst>
__device__ __forceinline__ int tile_rank(int k) {
  if constexpr (kLongestFirst)
    return k * int(gridDim.x) + ((k & 1) ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x));
  else
    return int(blockIdx.x) + k * int(gridDim.x);
}

// Longest-first schedule: sorts the sequences and writes the sequence of each of this CTA's tiles
// to `tile_seq`. All threads of the CTA call it before the roles split; `keys` (room for
// kSortMaxSeqs) lies in stage memory that is free until the producer's first TMA load.
__device__ __forceinline__ void build_longest_first_list(const KdaPrefillParams& p, uint64_t* keys, int* tile_seq) {
  const int n = p.num_seqs;
  int padded = 2;
  while (padded < n) padded <<= 1;
  // key = (~chunks, index): ascending order is "most chunks first, then lower index".
  for (int i = threadIdx.x; i < padded; i += blockDim.x) {
    uint64_t key = ~uint64_t(0);
    if (i < n) {
      const int64_t chunks = (seq_start(p, i + 1) - seq_start(p, i) + kChunk - 1) / kChunk;
      key = (uint64_t(0xffffffffu - uint32_t(chunks)) << 32) | uint32_t(i);
    }
    keys[i] = key;
  }
  __syncthreads();
  for (int size = 2; size <= padded; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < padded; i += blockDim.x) {
        const int j = i ^ stride;
        if (j > i) {
          const uint64_t a = keys[i], b = keys[j];
          if ((a > b) == ((i & size) == 0)) {
            keys[i] = b;
            keys[j] = a;
          }
        }
      }
      __syncthreads();
    }
  }
  const int num_tiles = n * p.num_v_heads;
  for (int k = threadIdx.x; k < kMaxTilesPerCta; k += blockDim.x) {
    const int r = tile_rank<true>(k);
    tile_seq[k] = r < num_tiles ? int(uint32_t(keys[r / p.num_v_heads])) : 0;
  }
  // The stage buffers are next written by TMA (async proxy).
  fence_smem_to_async_proxy();
  __syncthreads();
}

// The tile walk of every role:
//   for (int k = 0; tile_valid<kLongestFirst>(kp, k); ++k) { WorkTile w = decode_tile<kLongestFirst>(kp, smem, k); ... }
// The schedule is a template parameter (two instantiations of the kernel) so that the index-order
// kernel, which every fixed-length batch uses, compiles exactly as without the other schedule.
template <bool kLongestFirst>
__device__ __forceinline__ bool tile_valid(const KdaKernelParams& kp, int k) {
  return tile_rank<kLongestFirst>(k) < kp.problem.num_seqs * kp.problem.num_v_heads;
}

template <bool kLongestFirst>
__device__ __forceinline__ WorkTile decode_tile(const KdaKernelParams& kp, const SharedStorage& smem, int k) {
  const KdaPrefillParams& p = kp.problem;
  const int r = tile_rank<kLongestFirst>(k);
  WorkTile w;
  if constexpr (kLongestFirst) {
    w.seq = smem.tile_seq[k];
    w.v_head = r % p.num_v_heads;
  } else {
    w.seq = r / p.num_v_heads;
    w.v_head = r - w.seq * p.num_v_heads;
  }
  w.qk_head = w.v_head / (p.num_v_heads / p.num_qk_heads);
  if (p.cu_seqlens == nullptr) {
    w.token0 = int64_t(w.seq) * p.seqlen;
    w.length = p.seqlen;
  } else {
    w.token0 = seq_start(p, w.seq);
    w.length = int(seq_start(p, w.seq + 1) - w.token0);
  }
  return w;
}

// (stage, phase) iterator over the shared-memory ring, advanced once per chunk by every role.
struct PipelineState {
  int stage = 0;
  uint32_t phase = 0;
  __device__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

}  // namespace cula::kda::sm90
