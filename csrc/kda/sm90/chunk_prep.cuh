// Prep ahead: the state warpgroups of the fused kernel run steps 1-3 of the next chunk (l2 norms,
// gates, cumsum, QE / KE / KT in place; general gates: with the exact wide-pair terms) while the
// intra-chunk warpgroup runs steps 4-9 of the current one.
//
// Why: the intra-chunk warpgroup's chain (~23k cycles per chunk, docs/perf-notes.md) is the fused
// kernel's critical path, and the state warpgroups wait ~70 % of each chunk for it. The stage of
// chunk c + 1 is the one the state warpgroups released after chunk c - 1, so it is loaded while the
// intra-chunk warpgroup still works on chunk c: the state warpgroups prepare it there, in place,
// before they wait for chunk c. The intra-chunk warpgroup then starts chunk c + 1 at its A products
// (intra_chunk<..., kPrepped = true>), and its chain loses the prep (~7.7k cycles). Per chunk the
// state warpgroups run, in order:
//
//   wait full(c + 1) -> prep(c + 1) -> arrive prepped(c + 1) -> wait ready(c) -> state(c) -> release(c)
//
// The two state warpgroups (256 threads) share the work: thread (b, cp) = (tid / 64, tid % 64)
// takes feature pair cp of the 16-row block b, with its cumulative decays from the block's start;
// the block-end values r_b then add the earlier blocks' totals. With safe gates the scratch
// (l2-norm reciprocals, row statistics, block totals) lies in the stage's A_qk tile, which nothing
// reads between the state warpgroups' use of chunk c - 1 and the intra-chunk warpgroup's step 5
// for chunk c + 1; with general gates that tile takes the wide-pair terms and the scratch goes to
// the state warpgroups' own tiles (below).
#pragma once

#include <cstddef>

#include "intra_chunk_math.cuh"
#include "kernel_params.cuh"
#include "shared_storage.cuh"
#include "sm90_primitives.cuh"

namespace cula::kda::sm90 {

constexpr int kPrepThreads = 2 * kWarpgroupThreads;
// The stage of chunk c + 1 is the one released after chunk c - 1: with one stage the prep would
// wait for a release that only follows it; with more, the scheme works but wastes the extra ones.
static_assert(kStages == 2, "prep ahead assumes the two-stage ring");
// Safe gates: the prep's scratch lies in the stage's A_qk tile (bytes).
constexpr int kPrepRnormOffset = 0;         // float[128]: q rows, then k rows
constexpr int kPrepRowStatsOffset = 1024;   // float[3][4][64]
constexpr int kPrepTotalsOffset = 4096;     // float[4][128]: each block's decay total per feature
static_assert(kPrepRowStatsOffset >= 128 * 4 && kPrepRowStatsOffset + 3 * 4 * 64 * 4 <= kPrepTotalsOffset &&
                  kPrepTotalsOffset + kNumSubBlocks * kHeadDim * 4 <= kChunk * kChunk * 2,
              "the prep's scratch must fit in the stage's A_qk tile");
// General gates: the A_qk tile takes the exact wide-pair corrections (float [4 blocks][2][16][16],
// the two warps of each block summed: A_qk, then A_kk), which the intra-chunk warpgroup reads in
// step 5 before it writes A_qk there. The scratch, the per-warp partial corrections and the exact
// pass's per-warp operand staging go to the state warpgroups' own tiles (S and v_new, 48 KB in a
// row), free between their work on chunk c - 1 and on chunk c (the prep starts with a barrier of
// both warpgroups).
constexpr int kPrepPartialsOffset = 0;                                    // float [4][2 warps][2][256]
constexpr int kPrepStagingOffset = kPrepPartialsOffset + kTileBytes;      // 8 warps x kWideStagingBytes
constexpr int kPrepGeneralScratchOffset = kPrepStagingOffset + 8 * kWideStagingBytes;
static_assert(4 * 2 * 2 * 256 * 4 == kTileBytes && 4 * 2 * 256 * 4 == kChunk * kChunk * 2,
              "partials fill one tile, the summed corrections the A_qk tile");
static_assert(offsetof(SharedStorage, v_new) == offsetof(SharedStorage, state_bf16) + sizeof(SharedStorage::state_bf16) &&
                  kPrepGeneralScratchOffset + kPrepTotalsOffset + kNumSubBlocks * kHeadDim * 4 <=
                      int(sizeof(SharedStorage::state_bf16) + sizeof(SharedStorage::v_new)),
              "the general prep's scratch must fit in the state warpgroups' tiles");

// Steps 1-3 of one chunk with `rows` valid rows on its loaded stage, by the 256 threads of the two
// state warpgroups (tid 0..255). Same arithmetic per element as intra_prepare_operands; the
// cumulative decays start at each block (not each half) and r_b is the sum of the block totals,
// so the results agree with the intra-chunk warpgroup's prep to rounding. General gates also
// record which (block, feature) pairs are wide (st.wide_pair) and compute their exact
// diagonal-block terms (wide_diagonal_terms) into the A_qk tile; `state_tiles` is
// SharedStorage::state_bf16 (with v_new after it).
// `timer` (profile builds, -DCULA_KDA_PROFILE; a no-op otherwise): phase 8 = steps 1-3 up to the
// operands (row statistics, gates, cumulative sums, QE / KE / KT), phase 9 = the exact pass.
//
// kThreads = 128 (the pair form's prep warpgroup, pair_intra_math.cuh; safe gates): one warpgroup
// takes blocks b and b + 2 in two passes, with the same arithmetic per element.
template <bool kGateInKernel, bool kL2Norm, Decays kDecays, int kThreads = kPrepThreads>
__device__ __forceinline__ void prep_chunk_ahead(StageStorage& st, uint8_t* state_tiles, int rows,
                                                 const GateConstants& gc, int tid, PhaseTimer& timer) {
  constexpr bool kGeneral = kDecays != Decays::kSafe;
  static_assert(kThreads == kPrepThreads || (kThreads == kWarpgroupThreads && !kGeneral),
                "two state warpgroups, or one with safe gates");
  constexpr int kPasses = kPrepThreads / kThreads;
  constexpr bool kHalf = half_operands(kDecays, kL2Norm);  // fp16 A-product operands
  constexpr NamedBarrierId bar = NamedBarrierId::kStatePrep;
  uint8_t* const scratch = kGeneral ? state_tiles + kPrepGeneralScratchOffset : st.aqk;
  float* rnorm = reinterpret_cast<float*>(scratch + kPrepRnormOffset);
  float* row_stats = reinterpret_cast<float*>(scratch + kPrepRowStatsOffset);
  float (*totals)[kHeadDim] = reinterpret_cast<float (*)[kHeadDim]>(scratch + kPrepTotalsOffset);
  // General gates: the state tiles are shared by both warpgroups here; each may still be storing
  // the previous chunk's o through its own.
  if constexpr (kGeneral) named_barrier_sync(bar, kThreads);

  fill_rows_past_end<kGateInKernel, kThreads>(st, rows, bar, tid);
  // (four parts also with one warpgroup: the same sums as the two state warpgroups')
  row_statistics<kL2Norm, kThreads, kPrepThreads / kChunk>(st, rnorm, row_stats, rows, bar, tid);

  const int cp = tid & 63, col = 2 * cp;
  const PairColumn addr(cp);
  float cum0 = 0.f, cum1 = 0.f;  // from the block's start (of the last pass)
  // Two passes: one copy of the pass's code (a loop, not unrolled), as instruction fetch is the pair
  // form's largest stall (ncu). (One pass: the loop unrolled away, as the fused kernels had it.)
  constexpr int kPassUnroll = kPasses > 1 ? 1 : 4;
#pragma unroll kPassUnroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int b = (tid >> 6) + pass * (kThreads / 64), row0 = kSubBlock * b;
    uint32_t qx[kSubBlock], kx[kSubBlock];
    float G0[kSubBlock], G1[kSubBlock];
    cum0 = 0.f, cum1 = 0.f;
    load_block_cumsum<kGateInKernel, kDecays>(st, addr, row0, gc, cum0, cum1, qx, kx, G0, G1);
    *reinterpret_cast<float2*>(&totals[b][col]) = make_float2(cum0, cum1);
    // A wide feature (general gates: its decay over the block exceeds wide_span_log2, 14 with
    // fp16 operands) takes its factors against the block's start (0 here), so that e = exp2(G) <= 1.
    bool wide0 = false, wide1 = false;
    if constexpr (kGeneral) {
      wide0 = -cum0 > wide_span_log2(kHalf);
      wide1 = -cum1 > wide_span_log2(kHalf);
      st.wide_pair[b][cp] = uint8_t((wide0 ? 1 : 0) | (wide1 ? 2 : 0));
    }
    store_block_operands<kGeneral, kL2Norm, kHalf>(st, addr, row0, G0, G1, cum0, cum1, wide0 ? 0.f : cum0,
                                                   wide1 ? 0.f : cum1, qx, kx, rnorm);
    timer.mark(8);
    if constexpr (kGeneral) {
      const int warp = tid >> 5;
      float* partials = reinterpret_cast<float*>(state_tiles + kPrepPartialsOffset);
      wide_diagonal_terms<kL2Norm>(partials + ((b * 2 + (warp & 1)) * 2) * 256,
                                   smem_u32(state_tiles + kPrepStagingOffset + warp * kWideStagingBytes), G0, G1, qx,
                                   kx, wide0, wide1, rnorm, b, tid);
      timer.mark(9);
    }
  }
  named_barrier_sync(bar, kThreads);  // every block's total (and partial corrections) is written
#pragma unroll kPassUnroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int b = (tid >> 6) + pass * (kThreads / 64);
    if (kPasses > 1) {  // this block's sums again (the last pass's are still in cum0, cum1)
      const float2 t = *reinterpret_cast<const float2*>(&totals[b][col]);
      cum0 = t.x, cum1 = t.y;
    }
    float off0 = 0.f, off1 = 0.f;
#pragma unroll
    for (int e = 0; e < kNumSubBlocks - 1; ++e) {
      if (e < b) {
        const float2 t = *reinterpret_cast<const float2*>(&totals[e][col]);
        off0 += t.x;
        off1 += t.y;
      }
    }
    *reinterpret_cast<float2*>(&st.r_block[b][col]) = make_float2(off0 + cum0, off1 + cum1);
  }
  if constexpr (kGeneral) {
    // The two warps' partials of each block added in a fixed order (deterministic), as step 5 of
    // the intra-chunk warpgroup's own prep adds them. Entries j >= i hold whatever was there:
    // step 5 discards them.
    // Four floats at a time (the same sums in the same order).
    const float4* partials = reinterpret_cast<const float4*>(state_tiles + kPrepPartialsOffset);
    float4* corr = reinterpret_cast<float4*>(st.aqk);
#pragma unroll
    for (int x = tid; x < kNumSubBlocks * 2 * 64; x += kThreads) {
      const int blk = x >> 7, which = (x >> 6) & 1, e = x & 63;
      const float4 a = partials[((blk * 2 + 0) * 2 + which) * 64 + e];
      const float4 b = partials[((blk * 2 + 1) * 2 + which) * 64 + e];
      corr[x] = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
    }
  }
  // The intra-chunk warpgroup reads QE, KE by ldmatrix and KT by WGMMA (async proxy).
  fence_smem_to_async_proxy();
  // General gates: every thread is done reading the partials and totals in the state tiles before
  // either warpgroup writes its S and v_new tiles there for the next chunk.
  if constexpr (kGeneral) named_barrier_sync(bar, kThreads);
}

}  // namespace cula::kda::sm90
