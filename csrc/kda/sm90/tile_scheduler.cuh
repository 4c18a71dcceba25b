// Tile scheduler: a work tile is one (sequence n, value head hv) pair; its query/key head is
// hv / (HV / H) (grouped value attention). Sequence bounds are read from cu_seqlens on the
// device, so nothing here needs a host synchronisation.
//
// Two schedules, chosen on the host (kda_prefill_dispatch.cu), each its own kernel instantiation:
//
//   * index order: one CTA per tile, tile rank b = blockIdx.x; the hardware hands CTAs to SMs as
//     they free up, a dynamic greedy schedule in index order. Every role of the CTA derives the
//     same tile from blockIdx without talking to the others.
//   * longest first: one persistent CTA per SM takes tiles from a global atomic counter over the
//     tiles sorted by chunk count (most first, ties by index), so the longest sequences start
//     first and every CTA takes its next tile when it finishes the last one: greedy longest
//     processing time first. At start every CTA sorts the sequences (bitonic sort in the not yet
//     used stage buffers; a total order, so all CTAs get the same result) and writes the order
//     to the global workspace, which it alone reads back (other CTAs write the same values). The
//     producer warp fetches each tile and announces it to the math warpgroups through a ring of
//     kTileSlots shared-memory slots with full/empty mbarriers; it runs into the next tile's
//     chunks while the state warpgroups finish the current one, so there is no gap between tiles.
//     The last CTA to find no tile left resets the counters for the next launch.
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

struct WorkTile : TileInfo {
  __device__ int num_chunks() const { return (length + kChunk - 1) / kChunk; }
  // Valid rows of chunk c (1..64).
  __device__ int chunk_rows(int c) const { return min(kChunk, length - c * kChunk); }
};

// CUTLASS's idiom: a value broadcast from lane 0 is one the compiler knows is the same in every
// lane of the warp. Tile fields read from shared memory go through it; without it the math
// warpgroups' register allocation spilled more inside the chunk loop (docs/perf-notes.md).
__device__ __forceinline__ int warp_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }

static_assert(kSortMaxSeqs * 8 <= 2 * kTileBytes, "sort keys must fit in stage 0's q and k tiles");

__device__ __forceinline__ int64_t cu_seqlens_at(const KdaPrefillParams& p, int n) {
  return p.cu_seqlens_is_int64 ? static_cast<const int64_t*>(p.cu_seqlens)[n]
                               : int64_t(static_cast<const int32_t*>(p.cu_seqlens)[n]);
}

// Token range [begin, end) of sequence n, clamped to the token axis [0, T]: whatever values a GPU
// cu_seqlens holds (decreasing, negative, past the end: a bad batch or a padded graph bucket), the
// kernel reads and writes only rows of its tensors. A range that is empty after clamping is an
// empty sequence (zero chunks; its final state is its initial state).
struct SeqRange {
  int64_t begin, end;
};
__device__ __forceinline__ SeqRange seq_range(const KdaPrefillParams& p, int n) {
  const int64_t total = p.seqlen;  // B == 1 with cu_seqlens
  const int64_t b = min(max(cu_seqlens_at(p, n), int64_t(0)), total);
  const int64_t e = min(max(cu_seqlens_at(p, n + 1), b), total);
  return {b, e};
}

__device__ __forceinline__ TileInfo make_tile(const KdaPrefillParams& p, int seq, int v_head) {
  TileInfo w;
  w.seq = seq;
  w.v_head = v_head;
  w.qk_head = v_head / (p.num_v_heads / p.num_qk_heads);
  if (p.cu_seqlens == nullptr) {
    w.token0 = int64_t(seq) * p.seqlen;
    w.length = p.seqlen;
  } else {
    const SeqRange r = seq_range(p, seq);
    w.token0 = r.begin;
    w.length = int(r.end - r.begin);
  }
  return w;
}

// Cooperative mode: what CTA blockIdx.x does (kernel_params.cuh: CooperativePlan). A tile's
// owner runs both halves of the value columns (half == -1) or, with two owners, the half given by
// its CTA's parity; every other CTA is a helper.
struct CooperativeRole {
  bool helper = false;
  int tile = -1;         // owner: its tile
  int half = -1;         // owner: -1 both halves, else 0 or 1
  int segment = 0;       // owner with segments: its segment
  bool p_chain = false;  // owner with segments: chains P (U = 0, from S = I) instead of the state
};

// The value split decided per tile on the device (CooperativePlan::split_on_device), by
// value_split_pays (kernel_params.cuh) with this tile's and all tiles' chunks: for one long prompt
// batched with short ones, the long one's heads split and the short ones' second CTAs help. Every
// thread of every CTA evaluates the same function of the clamped cu_seqlens, so they all agree;
// the reads (N + 1 values, N <= 0.4 x SMs / HV in this mode) happen once per launch.
__device__ __forceinline__ int64_t chunks_of(int64_t tokens) { return (tokens + kChunk - 1) / kChunk; }

__device__ __forceinline__ bool tile_has_two_owners(const KdaKernelParams& kp, int t) {
  const CooperativePlan& c = kp.coop;
  if (c.value_split != 2) return false;
  if (!c.split_on_device) return true;
  const KdaPrefillParams& p = kp.problem;
  const int64_t helpers = int64_t(gridDim.x) - c.owners;
  int64_t mine = 0, total = 0;
  if (p.cu_seqlens == nullptr) {
    mine = chunks_of(p.seqlen);
    total = mine * c.tiles;
  } else {
    const int own_seq = t / p.num_v_heads;
    for (int n = 0; n < p.num_seqs; ++n) {
      const SeqRange r = seq_range(p, n);
      const int64_t chunks = chunks_of(r.end - r.begin);
      total += chunks;
      if (n == own_seq) mine = chunks;
    }
    total *= p.num_v_heads;
  }
  return value_split_pays(mine, total, helpers, p.general_gates);
}

__device__ __forceinline__ CooperativeRole cooperative_role(const KdaKernelParams& kp) {
  const CooperativePlan& c = kp.coop;
  const int b = int(blockIdx.x);
  CooperativeRole role;
  if (b >= c.owners) {
    role.helper = true;
  } else if (c.segments > 1) {  // [Q half 0, Q half 1, P half 0, P half 1] per segment
    const int r = b % (4 * c.segments), q = r % 4;
    role.segment = r / 4;
    role.p_chain = q >= 2;
    if (role.p_chain && (role.segment == 0 || role.segment == c.segments - 1)) {
      role.helper = true;  // the first segment starts from the true state, the last has no successor: no P
    } else {
      role.tile = b / (4 * c.segments);
      role.half = q % 2;
    }
  } else if (c.value_split == 1) {
    role.tile = b;
  } else if (tile_has_two_owners(kp, b / 2)) {
    role.tile = b / 2;
    role.half = b % 2;
  } else if (b % 2 == 0) {
    role.tile = b / 2;
  } else {
    role.helper = true;  // the second CTA of a tile with one owner
  }
  return role;
}

// Longest-first schedule: the producer's warpgroup (128 threads, before the roles start; the
// caller's __syncthreads follows) sorts the sequences by chunk count and writes the order to
// `sorted_seq` (global). `keys` (room for kSortMaxSeqs) lies in stage memory that is free until
// the producer's first TMA load. Fixed-length batches need no sort (all sequences are equally
// long: index order is longest first).
__device__ __forceinline__ void sort_sequences_longest_first(const KdaPrefillParams& p, uint64_t* keys,
                                                             int* sorted_seq) {
  if (p.cu_seqlens == nullptr) return;
  constexpr uint32_t kSortThreads = 128;
  const int tid = int(threadIdx.x);  // 0..127
  const int n = p.num_seqs;
  int padded = 2;
  while (padded < n) padded <<= 1;
  // key = (~chunks, index): ascending order is "most chunks first, then lower index".
  for (int i = tid; i < padded; i += kSortThreads) {
    uint64_t key = ~uint64_t(0);
    if (i < n) {
      const SeqRange r = seq_range(p, i);
      const int64_t chunks = (r.end - r.begin + kChunk - 1) / kChunk;
      key = (uint64_t(0xffffffffu - uint32_t(chunks)) << 32) | uint32_t(i);
    }
    keys[i] = key;
  }
  named_barrier_sync(NamedBarrierId::kScheduleSort, kSortThreads);
  for (int size = 2; size <= padded; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = tid; i < padded; i += kSortThreads) {
        const int j = i ^ stride;
        if (j > i) {
          const uint64_t a = keys[i], b = keys[j];
          if ((a > b) == ((i & size) == 0)) {
            keys[i] = b;
            keys[j] = a;
          }
        }
      }
      named_barrier_sync(NamedBarrierId::kScheduleSort, kSortThreads);
    }
  }
  for (int i = tid; i < n; i += kSortThreads) sorted_seq[i] = int(uint32_t(keys[i]));
  // The stage buffers are next written by TMA (async proxy). The producer reads sorted_seq after
  // the caller's barrier, which orders the CTA's global stores before its loads.
  fence_smem_to_async_proxy();
}

// The tile walk of every role:
//   TileCursor cursor;
//   for (WorkTile tile; next_tile<kLongestFirst, kIsProducer>(kp, smem, cursor, tile);) { ... }
// The producer warp (all 32 lanes) fetches and announces; the math warpgroups (every thread)
// receive. The schedule is a template
// parameter (two instantiations of the kernel) so that the index-order kernel compiles exactly
// as without the other schedule.
struct TileCursor {
  int k = 0;  // tiles of this CTA so far
};

// kOwner: a tile owner of the cooperative mode, whose tile is its CTA index divided by the CTAs
// per tile of the owner region (cooperative_role); it has that one tile.
// kPair: the pair form (KernelPass::kFusedPair, index order): both CTAs of cluster b walk the
// tiles of CTA b of the fused kernel (CTA indices 2 b and 2 b + 1).
template <bool kLongestFirst, bool kIsProducer, bool kOwner = false, bool kPair = false>
__device__ __forceinline__ bool next_tile(const KdaKernelParams& kp, SharedStorage& smem, TileCursor& cursor,
                                          WorkTile& tile) {
  const KdaPrefillParams& p = kp.problem;
  const int num_tiles = p.num_seqs * p.num_v_heads;
  if constexpr (!kLongestFirst) {
    static_assert(!(kOwner && kPair), "the pair form is fused");
    const int first = kPair     ? int(blockIdx.x >> 1)
                      : !kOwner ? int(blockIdx.x)
                      : kp.coop.segments > 1 ? int(blockIdx.x) / (4 * kp.coop.segments)
                                             : int(blockIdx.x) / kp.coop.value_split;
    // Owners: one tile each, or (tiles_per_owner > 1) every owners-th tile from their first.
    const int stride = kPair     ? int(gridDim.x >> 1)
                       : !kOwner ? int(gridDim.x)
                       : kp.coop.tiles_per_owner > 1 ? kp.coop.owners : num_tiles;
    const int r = first + cursor.k++ * stride;
    if (r >= num_tiles) return false;
    const int seq = r / p.num_v_heads;
    static_cast<TileInfo&>(tile) = make_tile(p, seq, r - seq * p.num_v_heads);
    return true;
  } else {
    const int slot = cursor.k % kTileSlots;
    const uint32_t phase = uint32_t(cursor.k / kTileSlots) & 1u;
    ++cursor.k;
    if constexpr (kIsProducer) {
      if ((threadIdx.x & 31) == 0) {
        ScheduleWorkspace* ws = kp.schedule;
        const int r = atomicAdd(&ws->next_tile, 1);
        TileInfo info{-1, 0, 0, 0, 0};
        if (r < num_tiles) {
          const int j = r / p.num_v_heads;
          info = make_tile(p, p.cu_seqlens != nullptr ? ws->sorted_seq[j] : j, r - j * p.num_v_heads);
        }
        cutlass::arch::ClusterBarrier::wait(&smem.tile_empty_bar[slot], phase ^ 1u);
        smem.tile_slot[slot] = info;
        cutlass::arch::ClusterBarrier::arrive(&smem.tile_full_bar[slot]);
        if (info.seq < 0) {
          // This CTA's last fetch is done; the last CTA to get here resets the counters. The fence
          // orders this CTA's fetches before its count, so the reset follows every fetch.
          __threadfence();
          if (atomicAdd(&ws->ctas_done, 1) == int(gridDim.x) - 1) {
            __threadfence();
            atomicExch(&ws->next_tile, 0);
            atomicExch(&ws->ctas_done, 0);
          }
        }
      }
      __syncwarp();
    } else {
      cutlass::arch::ClusterBarrier::wait(&smem.tile_full_bar[slot], phase);
    }
    // Every lane (producer warp) or thread (math warpgroups) copies the announced tile.
    const TileInfo& info = smem.tile_slot[slot];
    tile.seq = warp_uniform(info.seq);
    tile.v_head = warp_uniform(info.v_head);
    tile.qk_head = warp_uniform(info.qk_head);
    tile.length = warp_uniform(info.length);
    const uint32_t token0_lo = uint32_t(warp_uniform(int(info.token0)));
    const uint32_t token0_hi = uint32_t(warp_uniform(int(info.token0 >> 32)));
    tile.token0 = int64_t((uint64_t(token0_hi) << 32) | token0_lo);
    if constexpr (!kIsProducer)  // the slot may take a new tile once every math thread has it
      cutlass::arch::ClusterBarrier::arrive(&smem.tile_empty_bar[slot]);
    return tile.seq >= 0;
  }
}

// Chunks [begin, end) of segment `seg` of a tile (CooperativePlan: segments of ceil(chunks / G)
// chunks; the last ones of a short sequence may be empty).
struct ChunkRange {
  int begin, end;
};
__device__ __forceinline__ ChunkRange segment_chunks(int segments, int tile_chunks, int seg) {
  const int per = (tile_chunks + segments - 1) / segments;
  const int b = min(tile_chunks, seg * per);
  return {b, min(tile_chunks, b + per)};
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
  __device__ void advance(int n) {
    for (int i = 0; i < n; ++i) advance();
  }
};

}  // namespace cula::kda::sm90
