// Producer warp: fills the shared-memory ring with one chunk at a time.
//
// q and k come from the tile's query/key head, v and g from its value head, each as two TMA boxes
// of 64 tokens x 64 features (128B swizzle) completing on the stage's `full` mbarrier. Past the
// end of the token axis TMA zero-fills; inside it, a chunk that straddles the end of a sequence
// also reads the next sequence's first rows: harmless, because the intra-chunk pass masks every
// row at or past `chunk_rows` out of every product, state and output. beta is strided by HV in
// memory (no 16-byte box), so the warp's lanes load it with plain loads, zero past the sequence
// end, and each lane arrives on the barrier after its stores (with beta_sigmoid it holds logits
// and the sigmoid is applied here, in fp32).
#pragma once

#include <cuda.h>

#include "kernel_params.cuh"
#include "shared_storage.cuh"
#include "sm90_primitives.cuh"
#include "tile_scheduler.cuh"

namespace cula::kda::sm90 {

constexpr uint32_t kStageTxBytes = 4 * kTileBytes;  // q, k, v, g

__device__ __forceinline__ void tma_load_tile(const CUtensorMap* map, uint64_t* bar, uint8_t* dst, int head,
                                              int64_t token) {
  // Two 64-column boxes: features [0, 64) and [64, 128).
#pragma unroll
  for (int box = 0; box < 2; ++box) {
    cute::SM90_TMA_LOAD_3D::copy(map, bar, /*cache_hint=*/0, dst + box * kBoxBytes, box * 64, head, int32_t(token));
  }
}

// beta of row r of the chunk (0 past the sequence end).
__device__ __forceinline__ float read_beta_row(const KdaPrefillParams& p, int v_head, int64_t token, int rows, int r) {
  float b = 0.f;
  if (r < rows) {
    // beta_token_stride: set by the host (never 0 here), read from parameter space.
    const int64_t idx = (token + r) * p.beta_token_stride + v_head;
    b = p.beta_is_bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(p.beta)[idx])
                       : static_cast<const float*>(p.beta)[idx];
    // Logits in: sigmoid in fp32. __fdividef (MUFU.RCP + FMUL), not __frcp_rn, whose IEEE
    // slow path spilled in this 24-register warp (40 -> 52 spill bytes, longest first).
    // b < -87: 1 + e^-b overflows, the quotient is 0 (sigmoid ~ 0).
    if (p.beta_sigmoid) b = __fdividef(1.f, 1.f + __expf(-b));
  }
  return b;
}

// beta of rows lane and lane + 32 into registers (the fused kernel's producer reads them before its
// wait for a free stage), and their store into the stage.
__device__ __forceinline__ float2 read_beta(const KdaPrefillParams& p, int v_head, int64_t token, int rows, int lane) {
  static_assert(kChunk == 64, "two rows per lane");
  return make_float2(read_beta_row(p, v_head, token, rows, lane), read_beta_row(p, v_head, token, rows, lane + 32));
}
__device__ __forceinline__ void store_beta(StageStorage& st, float2 b, int lane) {
  st.beta[lane] = b.x;
  st.beta[lane + 32] = b.y;
}

// The eight TMA boxes of a chunk (q, k from the qk head, v, g from the value head) on `bar`.
__device__ __forceinline__ void issue_tma_boxes(const KdaKernelParams& kp, uint64_t* bar, StageStorage& st,
                                                const TileInfo& tile, int64_t token) {
  tma_load_tile(&kp.tma_q, bar, st.q, tile.qk_head, token);
  tma_load_tile(&kp.tma_k, bar, st.k, tile.qk_head, token);
  tma_load_tile(&kp.tma_v, bar, st.v, tile.v_head, token);
  tma_load_tile(&kp.tma_g, bar, st.g, tile.v_head, token);
}

// A cooperative helper's producer (chunk_workspace.cuh): every lane arrives on `full` after its
// own beta stores (release), so the consumers' wait orders each store directly; lane 0 also sets
// the TMA byte count and issues the loads of q, k, v, g. (The fused producer below issues the
// boxes before storing beta, with the byte count set by expect_tx ahead of every arrival.)
__device__ __forceinline__ void issue_stage_loads(const KdaKernelParams& kp, uint64_t& full_bar, StageStorage& st,
                                                  const TileInfo& tile, int64_t token, int lane) {
  uint64_t* bar = &full_bar;
  if (lane == 0) {
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(bar, kStageTxBytes);
    issue_tma_boxes(kp, bar, st, tile, token);
  } else {
    cutlass::arch::ClusterBarrier::arrive(bar);
  }
  __syncwarp();
}

// The fused kernels' producer. Their state warpgroups prepare each chunk as soon as `full`
// completes (chunk_prep.cuh), so v goes on a barrier of its own (SharedStorage::v_full_bar),
// issued after q, k and g: the prep's wait ends once those 48 KB have landed. kEarlySlots: k and
// q first, each once its slot is free (shared_storage.cuh: early_slot_release).
//
// kPair (the pair form, pair_intra_math.cuh): the CTA of cluster rank `rank` works on value columns
// [64 rank, 64 rank + 64) only, so it loads that one box of v (into its place in the v slot).
template <bool kLongestFirst, bool kEarlySlots, bool kPair = false>
__device__ __forceinline__ void run_load_producer(const KdaKernelParams& kp, SharedStorage& smem, int rank = 0) {
  const KdaPrefillParams& p = kp.problem;
  const int lane = threadIdx.x & 31;
  PipelineState pipe;

  if (lane == 0 && int64_t(p.batch) * p.seqlen > 0) {  // no token: no descriptor was built
    cute::prefetch_tma_descriptor(&kp.tma_q);
    cute::prefetch_tma_descriptor(&kp.tma_k);
    cute::prefetch_tma_descriptor(&kp.tma_v);
    cute::prefetch_tma_descriptor(&kp.tma_g);
  }

  TileCursor cursor;
  for (WorkTile tile; next_tile<kLongestFirst, /*kIsProducer=*/true, false, kPair>(kp, smem, cursor, tile);) {
    for (int c = 0; c < tile.num_chunks(); ++c, pipe.advance()) {
      StageStorage& st = smem.stage[pipe.stage];
      const int rows = tile.chunk_rows(c);
      const int64_t token = tile.token0 + int64_t(c) * kChunk;
      // With prep ahead (chunk_prep.cuh) the reload of a released stage lies on the state
      // warpgroups' path (they prepare the stage as soon as it is full), so nothing but the TMA
      // boxes' own latency is left between the release and `full`: beta is read into registers
      // before the wait (its global-load latency runs under it), the boxes go out right after
      // it, and beta's stores follow them. `full` completes once the boxes have landed
      // (expect_tx) and every lane has arrived after its own beta stores.
      const float2 beta = read_beta(p, tile.v_head, token, rows, lane);
      uint64_t* bar = &smem.full_bar[pipe.stage];
      uint64_t* v_bar = &smem.v_full_bar[pipe.stage];
      if constexpr (kEarlySlots) {
        // The slots in the order the state warpgroups free them (first pass: all free): k after
        // their first product, q after the output product, the rest with `empty`. The byte count
        // of all three goes on `full` with the first, so the phase cannot complete early.
        cutlass::arch::ClusterBarrier::wait(&smem.k_empty_bar[pipe.stage], pipe.phase ^ 1u);
        if (lane == 0) {
          cutlass::arch::ClusterTransactionBarrier::expect_transaction(bar, kStageTxBytes - kTileBytes);
          tma_load_tile(&kp.tma_k, bar, st.k, tile.qk_head, token);
        }
        cutlass::arch::ClusterBarrier::wait(&smem.q_empty_bar[pipe.stage], pipe.phase ^ 1u);
        if (lane == 0) tma_load_tile(&kp.tma_q, bar, st.q, tile.qk_head, token);
      }
      // Wait until both state warpgroups have released this stage (first pass: free).
      cutlass::arch::ClusterBarrier::wait(&smem.empty_bar[pipe.stage], pipe.phase ^ 1u);
      if (lane == 0) {
        if constexpr (!kEarlySlots) cutlass::arch::ClusterTransactionBarrier::expect_transaction(bar, kStageTxBytes - kTileBytes);
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(v_bar, kPair ? kBoxBytes : kTileBytes);
        if constexpr (!kEarlySlots) {
          tma_load_tile(&kp.tma_q, bar, st.q, tile.qk_head, token);
          tma_load_tile(&kp.tma_k, bar, st.k, tile.qk_head, token);
        }
        tma_load_tile(&kp.tma_g, bar, st.g, tile.v_head, token);
        if constexpr (kPair) {
          cute::SM90_TMA_LOAD_3D::copy(&kp.tma_v, v_bar, /*cache_hint=*/0, st.v + rank * kBoxBytes, rank * 64, tile.v_head,
                                       int32_t(token));
        } else {
          tma_load_tile(&kp.tma_v, v_bar, st.v, tile.v_head, token);
        }
      }
      store_beta(st, beta, lane);
      // cutlass's arrive asm has no "memory" clobber: keep the compiler from moving the stores
      // past it (the arrive's release semantics order them in hardware).
      asm volatile("" ::: "memory");
      cutlass::arch::ClusterBarrier::arrive(bar);
      __syncwarp();
    }
  }
}

}  // namespace cula::kda::sm90
