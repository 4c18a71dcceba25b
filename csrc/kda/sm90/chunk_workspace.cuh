// Cooperative mode (kernel_params.cuh: KernelPass, CooperativePlan): the roles that move finished
// stages between shared memory and the global workspace.
//
// With few (sequence, value head) tiles, one CTA per tile leaves most SMs idle, and each tile
// takes its chunk count times its intra-chunk warpgroup's time per chunk (~12 us), although none
// of that work depends on the recurrent state. In the cooperative mode one CTA runs per SM:
//   * owner b (b < tiles): its producer warp waits for each chunk of tile b to be published, in
//     chunk order, and reads the finished stage into the ring with one bulk copy; its state
//     warpgroups run the recurrence as in the fused kernel (waiting on `full`). Its intra-chunk
//     warpgroup has nothing to do.
//   * helper (every other CTA: cooperative_role): its producer warp claims chunks (one atomic
//     counter per tile: every chunk is claimed exactly once, in order; the tile drawn in
//     proportion to the chunks each (tile, segment) unit has left, pick_helper_unit) and loads them; the intra-chunk warpgroup turns
//     each into a finished stage exactly as in the fused kernel; the storer thread copies the
//     stage (kWorkspaceStageBytes, in its shared-memory layout) to the chunk's workspace slot and
//     then sets the chunk's flag.
// Progress: helpers never wait on another CTA, and a claimed chunk is always being worked on (a
// helper claims only with a stage's head free for it; its tail then waits only on this CTA's own
// intra-chunk warpgroup), but an owner waits for each chunk until some
// helper claims and publishes it, so at least one helper must be resident while owners spin.
// That holds when the process has the GPU's SMs (one CTA per SM, owners <= 0.4 x SMs); under an
// SM limit that leaves no room beside the owners (MPS thread percentage, green contexts) the
// launch would not finish: CULA_KDA_COOPERATIVE=0 turns the mode off (a cooperative launch,
// which guarantees co-residency or fails, is the planned fix). Both sides find a chunk's slot
// from the (clamped) cu_seqlens on the device: no host synchronisation. With valid cu_seqlens
// sequences never share a slot; with overlapping ranges (decreasing values) they may, which
// stays memory-safe but makes those sequences' results undefined, as their overlapping output
// rows already are in the fused kernel.
#pragma once

#include <climits>

#include <cute/arch/copy_sm90_tma.hpp>

#include "kernel_params.cuh"
#include "load_producer.cuh"
#include "shared_storage.cuh"
#include "sm90_primitives.cuh"
#include "tile_scheduler.cuh"
#include "timeline.cuh"

namespace cula::kda::sm90 {

// First slot of a tile's chunks within its value head (CooperativePlan).
__device__ __forceinline__ int64_t first_chunk_slot(const TileInfo& tile) { return tile.token0 / kChunk + tile.seq; }

__device__ __forceinline__ uint8_t* workspace_stage(const KdaKernelParams& kp, int v_head, int64_t slot) {
  return static_cast<uint8_t*>(kp.problem.workspace) +
         (int64_t(v_head) * kp.coop.slots_per_head + slot) * int64_t(kWorkspaceStageBytes);
}
__device__ __forceinline__ int* published_flag(const KdaKernelParams& kp, int v_head, int64_t slot) {
  return kp.coop.sync + int64_t(v_head) * kp.coop.slots_per_head + slot;
}
// Work units: (tile, segment) pairs, unit = tile x G + segment (without segments, G = 1: the
// tiles). sync holds, after the published flags, a claim counter per unit, then (segments) a P
// flag per unit (the P halves published, 0..2) and an S_out flag per (unit, value half).
__device__ __forceinline__ int num_units(const KdaKernelParams& kp) { return kp.coop.tiles * kp.coop.segments; }
__device__ __forceinline__ int* claim_counter(const KdaKernelParams& kp, int unit) {
  return kp.coop.sync + int64_t(kp.problem.num_v_heads) * kp.coop.slots_per_head + unit;
}
__device__ __forceinline__ int* p_flag(const KdaKernelParams& kp, int unit) {
  return claim_counter(kp, num_units(kp)) + unit;
}
__device__ __forceinline__ int* s_out_flag(const KdaKernelParams& kp, int unit, int half) {
  return claim_counter(kp, 2 * num_units(kp)) + 2 * unit + half;
}
// P^T [k' = the chain's value rows, k] and S_out^T [v, k] of a unit: 128 x 128 fp32, rows of 128.
constexpr int kMatrixFloats = kHeadDim * kHeadDim;
__device__ __forceinline__ float* p_matrix(const KdaKernelParams& kp, int unit) {
  return kp.coop.matrices + int64_t(unit) * 2 * kMatrixFloats;
}
__device__ __forceinline__ float* s_out_matrix(const KdaKernelParams& kp, int unit) {
  return p_matrix(kp, unit) + kMatrixFloats;
}

__device__ __forceinline__ WorkTile unit_tile(const KdaKernelParams& kp, int unit) {
  const KdaPrefillParams& p = kp.problem;
  const int t = unit / kp.coop.segments;
  WorkTile tile;
  static_cast<TileInfo&>(tile) = make_tile(p, t / p.num_v_heads, t % p.num_v_heads);
  return tile;
}

// Unclaimed chunks of a unit (claim counters only grow, and pass the unit's chunk count by one
// per helper that found it empty). A relaxed read: a stale value only makes a helper's choice of
// unit less apt; the claim itself (atomicAdd) is what hands out chunks.
__device__ __forceinline__ int unclaimed_chunks(const KdaKernelParams& kp, int unit) {
  const WorkTile tile = unit_tile(kp, unit);
  const ChunkRange r = segment_chunks(kp.coop.segments, tile.num_chunks(), unit % kp.coop.segments);
  int claimed;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(claimed) : "l"(claim_counter(kp, unit)) : "memory");
  return max(r.end - r.begin - claimed, 0);
}

// The round of a unit: with several tiles per owner (CooperativePlan::tiles_per_owner), tile /
// owners (the owner's first tile is round 0, ...); else 0.
__device__ __forceinline__ int unit_round(const KdaKernelParams& kp, int unit) {
  return kp.coop.tiles_per_owner > 1 ? unit / kp.coop.owners : 0;
}

// The next unit a helper works on (one warp; every lane returns it), or -1 when no unit has an
// unclaimed chunk: a unit drawn with probability proportional to its unclaimed chunks, so helpers
// spread over the tiles as the work left does (one long prompt among short ones gets most of
// them whenever a helper's tile runs out; moving on to the next tile in index order instead piled
// the helpers onto one long tile after another while the other long tiles' owners waited). The
// draw is a golden-ratio sequence over (CTA, pick), so the helpers of one launch take well-spread
// units; which helper computes a chunk never changes the results. Only the units of the lowest
// round with unclaimed chunks are drawn, so that each owner's current tile is computed first.
// With CooperativePlan::pick_most the helper takes instead the unit with the most unclaimed
// chunks (of that round; one of the tied units by the same sequence): on long tiles the random
// draw leaves some tiles with few helpers for a long time, whose owners then end last (timelines:
// docs/perf-notes.md); on tiles of 16 chunks the draw measured faster.
__device__ __forceinline__ int pick_helper_unit(const KdaKernelParams& kp, int pick) {
  const int lane = threadIdx.x & 31;
  const int units = num_units(kp);
  for (;; ++pick) {
    int round = INT_MAX;
    for (int base = 0; base < units; base += 32) {
      const int u = base + lane;
      round = min(round, __reduce_min_sync(0xffffffffu, u < units && unclaimed_chunks(kp, u) > 0 ? unit_round(kp, u) : INT_MAX));
    }
    if (round == INT_MAX) return -1;
    auto eligible = [&](int u) { return u < units && unit_round(kp, u) == round ? unclaimed_chunks(kp, u) : 0; };
    const uint32_t x = uint32_t(blockIdx.x) * 2654435769u + uint32_t(pick) * 3242174889u;
    if (kp.coop.pick_most) {
      // The unit with the most unclaimed chunks (of the lowest round), one of the tied ones by the
      // same sequence: helpers that run out go where the most work is left. On fresh counts (they
      // only fall): the units still at the most; if none is, pick again.
      int most = 0;
      for (int base = 0; base < units; base += 32)
        most = max(most, int(__reduce_max_sync(0xffffffffu, uint32_t(eligible(base + lane)))));
      if (most == 0) continue;
      int count = 0;
      for (int base = 0; base < units; base += 32) count += __popc(__ballot_sync(0xffffffffu, eligible(base + lane) >= most));
      if (count == 0) continue;
      int r = int((uint64_t(x) * uint64_t(count)) >> 32);  // in [0, count)
      for (int base = 0; base < units; base += 32) {
        uint32_t hit = __ballot_sync(0xffffffffu, eligible(base + lane) >= most);
        if (r < __popc(hit)) {
          for (; r > 0; --r) hit &= hit - 1;  // the r-th of them
          return base + __ffs(hit) - 1;
        }
        r -= __popc(hit);
      }
      continue;
    }
    int64_t total = 0;
    for (int base = 0; base < units; base += 32) total += __reduce_add_sync(0xffffffffu, eligible(base + lane));
    if (total == 0) continue;  // taken since the first pass: draw again
    const int64_t r = int64_t((uint64_t(x) * uint64_t(total)) >> 32);  // in [0, total)
    // Second pass on fresh counts (they only fall): the unit where the running sum passes r. If
    // claims in between took the chunks past r, draw again.
    int64_t before = 0;
    for (int base = 0; base < units; base += 32) {
      const int rem = eligible(base + lane);
      int incl = rem;  // inclusive warp scan
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += y;
      }
      const uint32_t hit = __ballot_sync(0xffffffffu, rem > 0 && before + incl > r);
      if (hit != 0u) return base + __ffs(hit) - 1;
      before += __shfl_sync(0xffffffffu, incl, 31);
    }
  }
}

// Helper producer (one warp per intra-chunk warpgroup, on that warpgroup's stages: `which`, then
// every kp.coop.helper_intra-th stage of the ring, so that a warp waiting for one stage's tail
// never holds back the other stage's head). Starts on unit (helper index mod units), or, a CTA of the owner
// region that helps, on its own tile: an exact round robin, so equal tiles start with equal help
// (a first draw in proportion spreads 100 helpers over 32 equal tiles 2 to 5 per tile, where the
// round robin gives 3 or 4; measured 2-6 % slower on such rows, docs/perf-notes.md). When its
// unit has no chunk left it takes the unit pick_helper_unit draws. A chunk is claimed only once a
// stage's head is free for it (claiming a whole stage ahead, with an L2 prefetch of its boxes,
// measured no faster and 7 % slower at B1 T8192 H16: docs/perf-notes.md).
__device__ __forceinline__ void run_chunk_claim_producer(const KdaKernelParams& kp, SharedStorage& smem, int which = 0) {
  const KdaPrefillParams& p = kp.problem;
  const int lane = threadIdx.x & 31;
  const int G = kp.coop.segments;
  const int step = kp.coop.helper_intra;
  PipelineState pipe;
  pipe.advance(which);
  if (lane == 0) {  // the mode runs only with tokens, so the descriptors exist
    cute::prefetch_tma_descriptor(&kp.tma_q);
    cute::prefetch_tma_descriptor(&kp.tma_k);
    cute::prefetch_tma_descriptor(&kp.tma_v);
    cute::prefetch_tma_descriptor(&kp.tma_g);
  }
  const int b = int(blockIdx.x);
  int u = b >= kp.coop.owners ? (b - kp.coop.owners) % (kp.coop.tiles_per_owner > 1 ? kp.coop.owners : num_units(kp))
          : G > 1             ? b / (4 * G) * G + (b % (4 * G)) / 4
                              : b / kp.coop.value_split;
  // The warps' draws interleave (pick_helper_unit's sequence), so they spread over the units too.
  for (int pick = which; u >= 0; u = pick_helper_unit(kp, pick), pick += step) {
    const WorkTile tile = unit_tile(kp, u);
    const int64_t first = first_chunk_slot(tile);
    const ChunkRange range = segment_chunks(G, tile.num_chunks(), u % G);
    for (;; pipe.advance(step)) {
      StageStorage& st = smem.stage[pipe.stage];
      uint64_t* full = &smem.full_bar[pipe.stage];
      // The stage in two halves (SharedStorage::head_ready_bar): once the storer has copied the
      // head of the stage's last chunk (QG, KT', A_qk), claim the next chunk and load its q and g
      // while that chunk's inverse and W / U products still run; its k and v, beta and the stage's
      // metadata follow once the tail (W, U, r_block, beta, A_qk's diagonal) is copied too.
      cutlass::arch::ClusterBarrier::wait(&smem.head_empty_bar[pipe.stage], pipe.phase ^ 1u);
      int c = 0;
      if (lane == 0) c = range.begin + atomicAdd(claim_counter(kp, u), 1);
      c = __shfl_sync(0xffffffffu, c, 0);
      if (c >= range.end) break;  // this stage stays free (its phases are done) for the next unit's chunk
      if (lane == 0) timeline_mark(kp.coop.timeline, TimelineEvent::kClaim, tile.v_head, first + c, which);
      const int rows = tile.chunk_rows(c);
      const int64_t token = tile.token0 + int64_t(c) * kChunk;
      if (lane == 0) {
        // The previous phase of `full` completed before the head was released (the intra-chunk
        // warpgroup waited for it), so these bytes count toward the next one, which also needs
        // the 32 arrivals below.
        cutlass::arch::ClusterTransactionBarrier::expect_transaction(full, 2 * kTileBytes);
        tma_load_tile(&kp.tma_q, full, st.q, tile.qk_head, token);
        tma_load_tile(&kp.tma_g, full, st.g, tile.v_head, token);
      }
      const float2 beta = read_beta(p, tile.v_head, token, rows, lane);  // its latency under the wait
      cutlass::arch::ClusterBarrier::wait(&smem.empty_bar[pipe.stage], pipe.phase ^ 1u);
      // (beta is in registers already: keep the compiler from hoisting its stores above the wait,
      // whose asm has no "memory" clobber.)
      asm volatile("" ::: "memory");
      store_beta(st, beta, lane);
      if (lane == 0) {
        st.rows = rows;
        st.ws_slot = int(first + c);
        st.ws_head = tile.v_head;
      }
      // The storer's bulk copy (async proxy) reads beta: order these generic stores before it.
      fence_smem_to_async_proxy();
      if (lane == 0) {
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(full, 2 * kTileBytes);
        tma_load_tile(&kp.tma_k, full, st.k, tile.qk_head, token);
        tma_load_tile(&kp.tma_v, full, st.v, tile.v_head, token);
      } else {
        cutlass::arch::ClusterBarrier::arrive(full);
      }
      __syncwarp();
    }
  }
  // No chunk left: an end mark (rows = -1) in this warp's next stage, for its intra-chunk
  // warpgroup and storer thread.
  StageStorage& st = smem.stage[pipe.stage];
  cutlass::arch::ClusterBarrier::wait(&smem.head_empty_bar[pipe.stage], pipe.phase ^ 1u);
  cutlass::arch::ClusterBarrier::wait(&smem.empty_bar[pipe.stage], pipe.phase ^ 1u);
  if (lane == 0) st.rows = -1;
  cutlass::arch::ClusterBarrier::arrive(&smem.full_bar[pipe.stage]);
}

// Helper storer (one thread per intra-chunk warpgroup, on that warpgroup's stages: `which`, then
// every kp.coop.helper_intra-th stage of the ring; of warpgroup 3 in the helpers' kernel, of
// warpgroup 2 in the one-kernel form): each finished stage goes to its workspace slot in two parts
// with the byte layout of the stage (so the owners read it back as one bulk copy). The head (q and
// g slots, A_qk) is final after step 6 (SharedStorage::head_ready_bar) and goes back to the
// producer as soon as its copies have read it; the tail (k and v slots, r_block, beta, A_qk's
// diagonal) after step 8. The owner reads the slot once the flag is set, so both parts must have
// landed first: wait for the writes, order them (async proxy) before the flag (generic), and set
// the flag with release semantics. The tail goes back to the producer once read
// (kp.coop.early_release; `wait_group.read`), before the writes land; otherwise after the flag.
__device__ __forceinline__ void run_workspace_storer(const KdaKernelParams& kp, SharedStorage& smem, int which = 0) {
  const bool early = kp.coop.early_release;
  const int step = kp.coop.helper_intra;
  constexpr int kTailOffset = int(offsetof(StageStorage, r_block));
  static_assert(offsetof(StageStorage, q) == 0 && offsetof(StageStorage, aqk) == 4 * kTileBytes &&
                    kTailOffset == offsetof(StageStorage, aqk) + kChunk * kChunk * 2 && kTailOffset % 16 == 0,
                "the stage's parts as the workspace copies them");
  PipelineState pipe;
  pipe.advance(which);
  for (;; pipe.advance(step)) {
    StageStorage& st = smem.stage[pipe.stage];
    cutlass::arch::ClusterBarrier::wait(&smem.head_ready_bar[pipe.stage], pipe.phase);
    if (st.rows < 0) break;
    const int v_head = st.ws_head, slot = st.ws_slot;
    timeline_mark(kp.coop.timeline, TimelineEvent::kHeadReady, v_head, slot, which);
    uint8_t* dst = reinterpret_cast<uint8_t*>(workspace_stage(kp, v_head, slot));
    uint8_t* src = reinterpret_cast<uint8_t*>(&st);
    cute::SM90_BULK_COPY_S2G::copy(st.q, dst + offsetof(StageStorage, q), kTileBytes);
    cute::SM90_BULK_COPY_S2G::copy(st.g, dst + offsetof(StageStorage, g), kTileBytes);
    cute::SM90_BULK_COPY_S2G::copy(st.aqk, dst + offsetof(StageStorage, aqk), kChunk * kChunk * 2);
    cute::tma_store_arrive();
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    cutlass::arch::ClusterBarrier::arrive(&smem.head_empty_bar[pipe.stage]);
    cutlass::arch::ClusterBarrier::wait(&smem.ready_bar[pipe.stage], pipe.phase);
    timeline_mark(kp.coop.timeline, TimelineEvent::kTailReady, v_head, slot, which);
    cute::SM90_BULK_COPY_S2G::copy(st.k, dst + offsetof(StageStorage, k), kTileBytes);
    cute::SM90_BULK_COPY_S2G::copy(st.v, dst + offsetof(StageStorage, v), kTileBytes);
    cute::SM90_BULK_COPY_S2G::copy(src + kTailOffset, dst + kTailOffset, kWorkspaceStageBytes - kTailOffset);
    cute::tma_store_arrive();
    if (early) {
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      cutlass::arch::ClusterBarrier::arrive(&smem.empty_bar[pipe.stage]);
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
    asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(published_flag(kp, v_head, slot)), "r"(1) : "memory");
    timeline_mark(kp.coop.timeline, TimelineEvent::kPublished, v_head, slot, which);
    if (!early) cutlass::arch::ClusterBarrier::arrive(&smem.empty_bar[pipe.stage]);
  }
  timeline_mark(kp.coop.timeline, TimelineEvent::kHelperCtaEnd, -1, -1, which);
}

// Owner producer (one warp): the tile's finished stages, in chunk order, into the ring, each once
// its flag is set (acquire; then a proxy fence, since the bulk copy reads in the async proxy).
// With a value split both owners of a tile read every stage whole. With segments: the owner's
// segment only, twice for the Q-owners of the middle segments (the chain from S = 0, then the
// rerun from the true S_in). The state warpgroups wait on `full` directly.
__device__ __forceinline__ void run_workspace_loader(const KdaKernelParams& kp, SharedStorage& smem) {
  const int lane = threadIdx.x & 31;
  const int G = kp.coop.segments;
  const CooperativeRole role = cooperative_role(kp);
  PipelineState pipe;
  TileCursor cursor;
  for (WorkTile tile; next_tile</*kLongestFirst=*/false, /*kIsProducer=*/true, /*kOwner=*/true>(kp, smem, cursor, tile);) {
    const int64_t first = first_chunk_slot(tile);
    const ChunkRange range = segment_chunks(G, tile.num_chunks(), role.segment);
    const int passes = !role.p_chain && role.segment > 0 && role.segment < G - 1 ? 2 : 1;
    for (int pass = 0; pass < passes; ++pass) {
      for (int c = range.begin; c < range.end; ++c, pipe.advance()) {
        StageStorage& st = smem.stage[pipe.stage];
        cutlass::arch::ClusterBarrier::wait(&smem.empty_bar[pipe.stage], pipe.phase ^ 1u);
        uint64_t* bar = &smem.full_bar[pipe.stage];
        if (lane == 0) {
          timeline_mark(kp.coop.timeline, TimelineEvent::kOwnerStageFree, tile.v_head, first + c);
          const int* flag = published_flag(kp, tile.v_head, first + c);
          for (int ready = 0;;) {
            asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(ready) : "l"(flag) : "memory");
            if (ready) break;
            __nanosleep(100);
          }
          timeline_mark(kp.coop.timeline, TimelineEvent::kOwnerFlagSeen, tile.v_head, first + c);
          asm volatile("fence.proxy.async.global;" ::: "memory");
          cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(bar, kWorkspaceStageBytes);
          cute::SM90_BULK_COPY_G2S::copy(workspace_stage(kp, tile.v_head, first + c), bar, &st, kWorkspaceStageBytes);
        }
        __syncwarp();
        if (lane != 0) cutlass::arch::ClusterBarrier::arrive(bar);
      }
    }
  }
}

}  // namespace cula::kda::sm90
