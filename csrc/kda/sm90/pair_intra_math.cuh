// The pair form (KernelPass::kFusedPair): one (sequence, value head) tile on a cluster of two CTAs,
// for launches with few tiles (2 x tiles <= SMs, safe gates, index order).
//
// Why: with one CTA per tile the intra-chunk warpgroup's chain (A products, masks, inverse, step 6)
// sets the fused kernel's pace (docs/perf-notes.md, "Where it stands (1cf332c)"), and most SMs are
// idle when tiles are few. Here both CTAs of a cluster run the whole pipeline of the tile, each on
// 64 of the 128 value columns (the state's columns never mix), and split the intra-chunk chain by
// matrix:
//
//   rank 0  A_kk -> beta, mask -> (I + A_kk)^-1 -> M - I: its own M tile, and a bulk copy into
//           rank 1's M tile -> step 6 (QG, KG)
//   rank 1  A_qk -> mask -> its own A_qk slot, and a bulk copy into rank 0's -> step 6
//
// Each hand-off is one 8 KB bulk copy (shared memory to the peer's shared memory) that completes on
// the receiver's `ready` barrier as transaction bytes, so a CTA's state warpgroup starts chunk c
// once its own intra-chunk warpgroup and the peer's copy are both done. Where a copy lands must
// be free:
//   * rank 1's M tile: rank 1's state warpgroup has read the previous M (its arrive on rank 0's
//     m_tile_empty_bar, which rank 0's intra-chunk warpgroup waits for before it writes M - I,
//     counts one arrive per CTA);
//   * rank 0's A_qk slot of the stage: it is rank 0's prep scratch for the chunk until rank 0's
//     prep is done (rank 0's prep warpgroup arrives on rank 1's peer_prepped_bar).
// Per CTA the two state warpgroups take other roles than in the fused kernel: the warpgroup of the
// CTA's value half (2 + rank) runs the recurrence (state_math.cuh, kPair), the other one the prep
// ahead (steps 1-3 of every chunk, chunk_prep.cuh with 128 threads), so that neither waits for the
// other. Both CTAs prepare the same chunks (the same code on the same data: the same operands).
#pragma once

#include "chunk_prep.cuh"
#include "intra_chunk_math.cuh"
#include "kernel_params.cuh"
#include "shared_storage.cuh"
#include "sm90_primitives.cuh"
#include "tile_scheduler.cuh"
#include "timeline.cuh"

namespace cula::kda::sm90 {

constexpr uint32_t kPairCopyBytes = kChunk * kChunk * 2;  // A_qk or M - I: one 64 x 64 16-bit box
static_assert(kPairCopyBytes == sizeof(StageStorage::aqk) && kPairCopyBytes <= sizeof(SharedStorage::intra_scratch),
              "a hand-off is one box");

// One chunk of either rank, through one call site and one copy of the A products and of step 6:
// the two SMs of a cluster then fetch mostly the same code (with a copy per rank, ncu showed the
// pair form's warps stalled on instruction fetch 3.1 cycles per issued instruction at 64 tiles,
// against 0.3 in the fused kernel). Rank 0: A_kk, its mask, the inverse, M - I (kept and copied to
// rank 1); rank 1: A_qk, its mask (kept and copied to rank 0); then step 6.
template <bool kL2Norm>
__device__ __forceinline__ void pair_intra_chunk(SharedStorage& smem, StageStorage& st, const IntraScratch& ws,
                                                 int stage, uint32_t phase, int rank, int tid, PhaseTimer& timer,
                                                 uint32_t m_tile_phase) {
  constexpr bool kAqkHalf = aqk_is_half(true, kL2Norm, false);
  const int warp = tid >> 5, lane = tid & 31;
  const int g4 = lane >> 2, t4 = lane & 3;
  // The A products' scale pairs once per chunk (block_scale_pairs), in the inverse's operand tile:
  // free until the inverse (rank 0) below.
  uint32_t* const scale_pairs = reinterpret_cast<uint32_t*>(ws.inverse_operand);
  block_scale_pairs(st, scale_pairs, tid);
  named_barrier_sync(ws.bar, 128);
  // A_kk (rank 0: KE against KT) or A_qk (rank 1: QE against KT), in `a`.
  float a[kNumSubBlocks][8], unused[kNumSubBlocks][8];
  intra_attention_matrices<false, false, /*kOneOperand=*/true, /*kScaleTable=*/true>(
      st, ws.a_ref, warp, lane, a, unused, rank == 0 ? st.k : st.q, scale_pairs);
  timer.mark(2);
  if (rank == 0) {
    // The diagonal blocks' scratch lies in value half 1's v_new tile, which rank 0 never uses (its
    // state warpgroup is half 0's), not over the M tile as in the fused kernels: so the mask and
    // the inverse run while the state warpgroups still read the previous chunk's M, and only
    // M - I's store and copy below wait for their release (m_tile_empty_bar).
    float* diag = reinterpret_cast<float*>(smem.v_new[1]);
    static_assert(sizeof(SharedStorage::v_new[1]) >= kNumSubBlocks * kDiagBlockFloats * sizeof(float),
                  "the diagonal blocks fit in one v_new tile");
    // Step 5 for A_kk as in intra_chunk: A = beta_i A_kk, strictly lower; its blocks below the
    // diagonal stay in registers (a_off), its diagonal blocks go to the scratch, transposed.
    float a_off[8 * (kNumSubBlocks - 1)];
    const float beta_lo = st.beta[kSubBlock * warp + g4];
    const float beta_hi = st.beta[kSubBlock * warp + g4 + 8];
    for_each_entry_pair(warp, g4, t4, [&](int bj, int n8, int h2, int i, int j, int r) {
      mask_akk_pair(diag, a_off, bj, n8, h2, i, j, r, warp, g4, t4, h2 ? beta_hi : beta_lo, a[bj][r], a[bj][r + 1]);
    });
    timer.mark(3);
    named_barrier_sync(ws.bar, 128);  // every warp done reading KE (step 4) and writing its diagonal block
    float m[32];
    if constexpr (half_inverse(kL2Norm)) {
      invert_unit_lower_half(a_off, diag, ws.inverse_operand, ws.bar, tid, m, timer);
    } else {
      invert_unit_lower(a_off, diag, ws.inverse_operand, ws.bar, tid, m, timer);
    }
    timer.mark(5);
    // Step 8: M - I into the M tile, then to rank 1's M tile, completing on rank 1's `ready` of
    // this stage: both CTAs' state warpgroups have read their copy of the previous chunk's M.
    cutlass::arch::ClusterBarrier::wait(&smem.m_tile_empty_bar, m_tile_phase);
    timer.mark(1);
    store_m_minus_identity(ws.scratch + kMTileOffset, m, warp, g4, t4);
    fence_smem_to_async_proxy();
    named_barrier_sync(ws.bar, 128);
    if (tid == 0) {
      const uint32_t tile = smem_u32(ws.scratch + kMTileOffset);
      bulk_copy_to_peer(cluster_smem_addr(tile, 1), tile, kPairCopyBytes,
                        cluster_smem_addr(smem_u32(&smem.ready_bar[stage]), 1));
    }
  } else {
    // Step 5 for A_qk as in intra_chunk: strictly lower (its diagonal is st.aqk_diag) -> the slot.
    for_each_entry_pair(warp, g4, t4, [&](int bj, int, int, int i, int j, int r) {
      store_masked_aqk_pair<kAqkHalf>(st, i, j, a[bj][r], a[bj][r + 1]);
    });
    fence_smem_to_async_proxy();
    timer.mark(3);
    named_barrier_sync(ws.bar, 128);  // A_qk is written, and every warp is done reading QE (step 4)
    if (tid == 0) {
      // Rank 0's A_qk slot is its prep's scratch until that prep is done.
      cutlass::arch::ClusterBarrier::wait(&smem.peer_prepped_bar[stage], phase);
      const uint32_t slot = smem_u32(st.aqk);
      bulk_copy_to_peer(cluster_smem_addr(slot, 0), slot, kPairCopyBytes,
                        cluster_smem_addr(smem_u32(&smem.ready_bar[stage]), 0));
    }
    timer.mark(1);
  }
  // Step 6 last: rank 1's chain waits for M, rank 0's for everything.
  form_qg_kg<false, false, false, false, /*kRolled=*/true>(st, ws.a_ref, tid);
  timer.mark(4);
}

// The intra-chunk warpgroup of the pair form: per chunk, wait for its own prep (`prepped`), its
// rank's half of the chain, then `ready` with the peer's copy counted in (one thread's
// arrive.expect_tx: the copy may land before or after it).
template <bool kGateInKernel, bool kL2Norm>
__device__ __forceinline__ void run_pair_intra(const KdaKernelParams& kp, SharedStorage& smem, int rank) {
  const int tid = threadIdx.x % kWarpgroupThreads;
  const IntraScratch ws = intra_scratch_of(smem, 0);
  PipelineState pipe;
  PhaseTimer timer;
  timer.start();
  TileCursor cursor;
  uint32_t m_tile_phase = 1u;  // chunk n waits for the arrivals of chunk n - 1 (the first passes)
  [[maybe_unused]] int n = 0;  // the CTA's chunk count (timeline builds)
  for (WorkTile tile; next_tile<false, /*kIsProducer=*/false, false, /*kPair=*/true>(kp, smem, cursor, tile);) {
    for (int c = 0; c < tile.num_chunks(); ++c, pipe.advance(), ++n) {
      StageStorage& st = smem.stage[pipe.stage];
      cutlass::arch::ClusterBarrier::wait(&smem.prepped_bar[pipe.stage], pipe.phase);
      timer.mark(0);
      pair_intra_chunk<kL2Norm>(smem, st, ws, pipe.stage, pipe.phase, rank, tid, timer, m_tile_phase);
      m_tile_phase ^= 1u;  // (rank 0's barrier; rank 1 never waits on its own)
      // Step 9: hand the stage to the state warpgroup (QG, KG: generic stores read by WGMMA).
      fence_smem_to_async_proxy();
      if (tid == 0) {
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&smem.ready_bar[pipe.stage], kPairCopyBytes);
      } else {
        cutlass::arch::ClusterBarrier::arrive(&smem.ready_bar[pipe.stage]);
      }
      if (tid == 0) pair_timeline_mark(kp.coop.timeline, TimelineEvent::kPairIntraDone, n);
      timer.mark(6);
    }
  }
  timer.report(rank == 0 ? "pair intra rank0: wait m-wait akk mask M+copy+qg+kg inv:M arrive inv:D inv:N inv:N2,Y"
                         : "pair intra rank1: wait copy aqk mask qg+kg - arrive - - -",
               tid);
}

// The prep warpgroup of the pair form (warpgroup 3 - rank): steps 1-3 of every chunk of the CTA's
// tiles as soon as its stage is loaded, two stages ahead at most (the ring), then `prepped`; rank
// 0 also tells rank 1 that its A_qk slot is free (peer_prepped_bar).
template <bool kGateInKernel, bool kL2Norm>
__device__ __forceinline__ void run_pair_prep(const KdaKernelParams& kp, SharedStorage& smem, int rank) {
  const KdaPrefillParams& p = kp.problem;
  const int tid = threadIdx.x % kWarpgroupThreads;
  PipelineState pipe;
  PhaseTimer timer;
  timer.start();
  GateConstants gc(p, 1.f, make_float2(0.f, 0.f));
  TileCursor cursor;
  [[maybe_unused]] int n = 0;  // the CTA's chunk count (timeline builds)
  for (WorkTile tile; next_tile<false, /*kIsProducer=*/false, false, /*kPair=*/true>(kp, smem, cursor, tile);) {
    float gate_scale;
    float2 gate_bias;
    gate_parameters<kGateInKernel>(p, tile.v_head, tid, gate_scale, gate_bias);
    gc = GateConstants(p, gate_scale, gate_bias);
    for (int c = 0; c < tile.num_chunks(); ++c, pipe.advance(), ++n) {
      StageStorage& st = smem.stage[pipe.stage];
      cutlass::arch::ClusterTransactionBarrier::wait(&smem.full_bar[pipe.stage], pipe.phase);
      if (tid == 0) pair_timeline_mark(kp.coop.timeline, TimelineEvent::kPairLoaded, n);
      timer.mark(0);
      prep_chunk_ahead<kGateInKernel, kL2Norm, Decays::kSafe, kWarpgroupThreads>(st, smem.state_bf16[0],
                                                                                  tile.chunk_rows(c), gc, tid, timer);
      cutlass::arch::ClusterBarrier::arrive(&smem.prepped_bar[pipe.stage]);
      if (tid == 0) pair_timeline_mark(kp.coop.timeline, TimelineEvent::kPairPrepped, n);
      if (rank == 0) {
        named_barrier_sync(NamedBarrierId::kStatePrep, kWarpgroupThreads);  // every thread is done with the scratch
        if (tid == 0) mbarrier_arrive_cluster(cluster_smem_addr(smem_u32(&smem.peer_prepped_bar[pipe.stage]), 1));
      }
      timer.mark(1);
    }
  }
  timer.report("pair prep: wait(full) rest - - - - - - ops -", tid);
}

}  // namespace cula::kda::sm90
