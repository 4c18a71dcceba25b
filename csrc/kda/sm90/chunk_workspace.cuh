// Split mode (kernel_params.cuh: KernelPass, SplitPlan): the roles that move finished stages
// between shared memory and the global workspace.
//
// With fewer (sequence, value head) tiles than SMs, one CTA per tile leaves most SMs idle and
// each tile's time is its chunk count times the intra-chunk warpgroup's time per chunk, although
// nothing in the intra-chunk work depends on the recurrent state. So the work is split in two
// launches:
//   pass 1 (kChunkLocal)  CTA (value head hv, part) owns the chunk slots [part * spc, part * spc +
//                         spc) of head hv: its producer loads those chunks (whatever sequences
//                         they belong to), the intra-chunk warpgroup turns each into a finished
//                         stage exactly as in the fused kernel, and the storer thread copies the
//                         stage (kWorkspaceStageBytes, shared-memory layout) to the workspace.
//                         All chunks of all tiles run in parallel over the SMs.
//   pass 2 (kRecurrence)  one CTA per tile: the loader reads the tile's stages back in chunk
//                         order, the state warpgroups run the recurrence on them as in the fused
//                         kernel (full -> state, no intra-chunk warpgroup).
// Each chunk's slot is t0 / 64 + n + c (SplitPlan), computed the same way by both passes from the
// (clamped) cu_seqlens on the device: no host synchronisation, and any cu_seqlens values keep
// every slot inside the workspace.
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>

#include "kernel_params.cuh"
#include "load_producer.cuh"
#include "shared_storage.cuh"
#include "sm90_primitives.cuh"
#include "tile_scheduler.cuh"

namespace cula::kda::sm90 {

__device__ __forceinline__ uint8_t* workspace_stage(const KdaKernelParams& kp, int v_head, int64_t slot) {
  return static_cast<uint8_t*>(kp.problem.workspace) +
         (int64_t(v_head) * kp.split.slots_per_head + slot) * int64_t(kWorkspaceStageBytes);
}

// First slot of a tile's chunks within its value head.
__device__ __forceinline__ int64_t first_chunk_slot(const TileInfo& tile) { return tile.token0 / kChunk + tile.seq; }

// Pass 1 producer (one warp). Walks every sequence (the split mode runs with few tiles, so N is
// small) and loads the chunks whose slots fall in this CTA's range, announcing each chunk's row
// count and slot in the stage; ends with a stage whose row count is -1.
__device__ __forceinline__ void run_chunk_slot_producer(const KdaKernelParams& kp, SharedStorage& smem) {
  const KdaPrefillParams& p = kp.problem;
  const int lane = threadIdx.x & 31;
  const int v_head = int(blockIdx.x) % p.num_v_heads;
  const int64_t slot_begin = int64_t(int(blockIdx.x) / p.num_v_heads) * kp.split.slots_per_cta;
  const int64_t slot_end = min(slot_begin + kp.split.slots_per_cta, kp.split.slots_per_head);
  PipelineState pipe;
  if (lane == 0 && int64_t(p.batch) * p.seqlen > 0) {
    cute::prefetch_tma_descriptor(&kp.tma_q);
    cute::prefetch_tma_descriptor(&kp.tma_k);
    cute::prefetch_tma_descriptor(&kp.tma_v);
    cute::prefetch_tma_descriptor(&kp.tma_g);
  }
  for (int n = 0; n < p.num_seqs; ++n) {
    WorkTile tile;
    static_cast<TileInfo&>(tile) = make_tile(p, n, v_head);
    const int64_t first = first_chunk_slot(tile);
    const int c_begin = int(max(slot_begin - first, int64_t(0)));
    const int c_end = int(min(int64_t(tile.num_chunks()), slot_end - first));
    for (int c = c_begin; c < c_end; ++c, pipe.advance()) {
      StageStorage& st = smem.stage[pipe.stage];
      cutlass::arch::ClusterBarrier::wait(&smem.empty_bar[pipe.stage], pipe.phase ^ 1u);
      const int rows = tile.chunk_rows(c);
      const int64_t token = tile.token0 + int64_t(c) * kChunk;
      load_beta(p, st, tile.v_head, token, rows, lane);
      if (lane == 0) {
        st.rows = rows;
        st.ws_slot = int(first + c);
        st.ws_head = v_head;
      }
      // The storer's bulk copy (async proxy) reads beta: order these generic stores before it.
      fence_smem_to_async_proxy();
      issue_stage_loads(kp, smem.full_bar[pipe.stage], st, tile, token, lane);
    }
  }
  StageStorage& st = smem.stage[pipe.stage];
  cutlass::arch::ClusterBarrier::wait(&smem.empty_bar[pipe.stage], pipe.phase ^ 1u);
  if (lane == 0) st.rows = -1;  // no chunk left: the intra warpgroup and the storer stop
  cutlass::arch::ClusterBarrier::arrive(&smem.full_bar[pipe.stage]);
}

// Cooperative mode: the published flag of (value head, slot) and the claim counter of tile t.
__device__ __forceinline__ int* published_flag(const KdaKernelParams& kp, int v_head, int64_t slot) {
  return kp.split.sync + int64_t(v_head) * kp.split.slots_per_head + slot;
}
__device__ __forceinline__ int* claim_counter(const KdaKernelParams& kp, int tile) {
  return kp.split.sync + int64_t(kp.problem.num_v_heads) * kp.split.slots_per_head + tile;
}

// Storer (one thread of warpgroup 2) of the chunk-local pass and of the cooperative helpers: each
// stage the intra-chunk warpgroup finished goes to its workspace slot as one bulk copy; the stage
// is released once the copy has read it. kPublish (cooperative): the owner of the tile waits for
// the chunk's flag, so the copy must have landed first: wait for the writes, order them (async
// proxy) before the flag (generic), then set it with release semantics.
template <bool kPublish>
__device__ __forceinline__ void run_workspace_storer(const KdaKernelParams& kp, SharedStorage& smem) {
  PipelineState pipe;
  for (;; pipe.advance()) {
    StageStorage& st = smem.stage[pipe.stage];
    cutlass::arch::ClusterBarrier::wait(&smem.ready_bar[pipe.stage], pipe.phase);
    if (st.rows < 0) break;
    const int v_head = st.ws_head, slot = st.ws_slot;
    cute::SM90_BULK_COPY_S2G::copy(&st, workspace_stage(kp, v_head, slot), kWorkspaceStageBytes);
    cute::tma_store_arrive();
    if constexpr (kPublish) {
      asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // written, not only read
      asm volatile("fence.proxy.async.global;" ::: "memory");
      asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(published_flag(kp, v_head, slot)), "r"(1) : "memory");
    } else {
      cute::tma_store_wait<0>();  // the copy has read the stage
    }
    cutlass::arch::ClusterBarrier::arrive(&smem.empty_bar[pipe.stage]);
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // the writes themselves are done
}

// Cooperative helper producer (one warp): claims chunks of the tiles (one claim counter per tile,
// shared with the tile's owner and the other helpers), starting with tile (helper index mod
// tiles) and moving to the next tile when that one has no chunk left; loads each claimed chunk
// like the chunk-local producer. A chunk is claimed only once a stage is free for it, so a claimed
// chunk is always being worked on: the owner that waits for it never waits on an idle CTA.
__device__ __forceinline__ void run_chunk_claim_producer(const KdaKernelParams& kp, SharedStorage& smem) {
  const KdaPrefillParams& p = kp.problem;
  const int lane = threadIdx.x & 31;
  const int tiles = kp.split.owners;
  const int first_tile = (int(blockIdx.x) - tiles) % tiles;
  PipelineState pipe;
  if (lane == 0) {
    cute::prefetch_tma_descriptor(&kp.tma_q);
    cute::prefetch_tma_descriptor(&kp.tma_k);
    cute::prefetch_tma_descriptor(&kp.tma_v);
    cute::prefetch_tma_descriptor(&kp.tma_g);
  }
  for (int k = 0; k < tiles; ++k) {
    const int t = (first_tile + k) % tiles;
    WorkTile tile;
    static_cast<TileInfo&>(tile) = make_tile(p, t / p.num_v_heads, t % p.num_v_heads);
    const int64_t first = first_chunk_slot(tile);
    const int chunks = tile.num_chunks();
    for (;; pipe.advance()) {
      StageStorage& st = smem.stage[pipe.stage];
      cutlass::arch::ClusterBarrier::wait(&smem.empty_bar[pipe.stage], pipe.phase ^ 1u);
      int c = 0;
      if (lane == 0) c = atomicAdd(claim_counter(kp, t), 1);
      c = __shfl_sync(0xffffffffu, c, 0);
      if (c >= chunks) break;  // the stage stays free for the next tile's chunk
      const int rows = tile.chunk_rows(c);
      const int64_t token = tile.token0 + int64_t(c) * kChunk;
      load_beta(p, st, tile.v_head, token, rows, lane);
      if (lane == 0) {
        st.rows = rows;
        st.ws_slot = int(first + c);
        st.ws_head = tile.v_head;
      }
      fence_smem_to_async_proxy();
      issue_stage_loads(kp, smem.full_bar[pipe.stage], st, tile, token, lane);
    }
  }
  StageStorage& st = smem.stage[pipe.stage];
  cutlass::arch::ClusterBarrier::wait(&smem.empty_bar[pipe.stage], pipe.phase ^ 1u);
  if (lane == 0) st.rows = -1;
  cutlass::arch::ClusterBarrier::arrive(&smem.full_bar[pipe.stage]);
}

// Pass 2 loader (one warp): the tile's finished stages, in chunk order, into the ring; the state
// warpgroups wait on `full` directly.
__device__ __forceinline__ void run_workspace_loader(const KdaKernelParams& kp, SharedStorage& smem) {
  const int lane = threadIdx.x & 31;
  PipelineState pipe;
  TileCursor cursor;
  for (WorkTile tile; next_tile</*kLongestFirst=*/false, /*kIsProducer=*/true>(kp, smem, cursor, tile);) {
    const int64_t first = first_chunk_slot(tile);
    for (int c = 0; c < tile.num_chunks(); ++c, pipe.advance()) {
      StageStorage& st = smem.stage[pipe.stage];
      cutlass::arch::ClusterBarrier::wait(&smem.empty_bar[pipe.stage], pipe.phase ^ 1u);
      uint64_t* bar = &smem.full_bar[pipe.stage];
      if (lane == 0) {
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(bar, kWorkspaceStageBytes);
        cute::SM90_BULK_COPY_G2S::copy(workspace_stage(kp, tile.v_head, first + c), bar, &st, kWorkspaceStageBytes);
      } else {
        cutlass::arch::ClusterBarrier::arrive(bar);
      }
      __syncwarp();
    }
  }
}

}  // namespace cula::kda::sm90
