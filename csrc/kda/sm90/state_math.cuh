// State warpgroups: the serial chain of the recurrence. Two warpgroups split the value dimension
// (columns never mix), each keeping its half of S [K=128, 64] in fp32 registers for the whole
// sequence. Per chunk, after the intra-chunk warpgroup has published the stage:
//
//   (a) S -> bf16 shared tile (the B operand of the two products below)
//   (b) X = KG S                                   (WGMMA, K = 128)
//   (c) Y = beta v - X -> bf16 shared tile; v_new = Y + (M - I) Y (WGMMA, K = 64, the accumulator
//       starting at Y: the identity term exact; M - I from the intra-chunk warpgroup's M tile,
//       released to it on m_tile_empty) -> bf16 shared tile (rows past the sequence end are
//       zero: beta and k are zero there). This is v_new = M (beta v - KG S) = U - W S with M
//       folded into the chain: the intra-chunk warpgroup, the critical path, forms neither W nor U.
//   (d) O = QG S + A_qk v_new                       (WGMMA, K = 128 + 64; overlaps (e)); the
//       diagonal of A_qk is added in fp32 after (e) (d')
//   (e) S <- diag(exp2(G_last)) S + (k exp2(G_last - G))^T v_new, block by block in Horner form:
//         S *= exp2(r_0);  for b: S += KT_b^T v_new_b;  S *= exp2(r_{b+1} - r_b)
//       (KT_b = k exp2(r_b - G) for the rows of block b, so every factor is <= 1)
//   (g) release the stage to the producer (nothing after it reads the stage), then
//   (f) o = scale * O -> global.
#pragma once

#include "kernel_params.cuh"
#include "shared_storage.cuh"
#include "sm90_primitives.cuh"
#include "chunk_prep.cuh"
#include "store_epilogue.cuh"
#include "tile_scheduler.cuh"
#include "timeline.cuh"

namespace cula::kda::sm90 {

__device__ __forceinline__ void scale_state_rows(StateFragment& s, const float (&f)[2][2]) {
#pragma unroll
  for (int mh = 0; mh < 2; ++mh)
#pragma unroll
    for (int n8 = 0; n8 < 8; ++n8)
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        s.acc[mh][n8 * 4 + h2 * 2] *= f[mh][h2];
        s.acc[mh][n8 * 4 + h2 * 2 + 1] *= f[mh][h2];
      }
}

// The fused kernel's state warpgroups (the cooperative mode's owners: owner_state_math.cuh).
// kPrepAhead: both warpgroups also run steps 1-3 of the next chunk (of this tile or,
// at its last chunk, of the next tile) before they wait for the current one (chunk_prep.cuh).
// kPair (the pair form, pair_intra_math.cuh): the CTA's one state warpgroup of the recurrence,
// warpgroup 2 + half for cluster rank `half` (its value columns); the other warpgroup runs the
// prep, so this one prepares nothing. It tells rank 0 that it has read the M tile (rank 0 copies
// the next one into rank 1's), and rank 0's tells rank 1 that A_qk has landed (rank 1's copy of it
// has read its source in rank 1's A_qk slot, which the stage's reload may then overwrite).
template <bool kLongestFirst, bool kPrepAhead, bool kGateInKernel = false, bool kL2Norm = false,
          Decays kDecays = Decays::kSafe, bool kPair = false>
__device__ __forceinline__ void run_state_warpgroup(const KdaKernelParams& kp, SharedStorage& smem, int half) {
  static_assert(!kPair || (kPrepAhead && !kLongestFirst && kDecays == Decays::kSafe), "the pair form: safe gates, index order");
  // The prep ahead on this warpgroup (and the other state warpgroup), or (kPair) on the prep warpgroup.
  constexpr bool kOwnPrep = kPrepAhead && !kPair;
  // A_qk v_new in fp16 (shared_storage.cuh).
  constexpr bool kAqkHalf = aqk_is_half(kPrepAhead, kL2Norm, kLongestFirst);
  // The state update in fp16 where the A products took fp16 operands (intra_chunk_math.cuh,
  // half_operands): KT times 2^7 as the prep stored it, and the fp16 v_new' = v_new 2^-vn_shift
  // of A_qk v_new from (c); S scaled by the power of two that cancels both shifts (step (e)).
  constexpr bool kHalfUpdate = half_operands(kDecays, kL2Norm);
  static_assert(!kHalfUpdate || kAqkHalf, "the fp16 update takes v_new' from A_qk v_new's fp16 copy");
  // S's bf16 tile for chunk c + 1 written right after chunk c's output store, before the wait for
  // the stage that the next prep reads: with safe gates, whose prep works in the stage's A_qk tile
  // (chunk_prep.cuh); the general gates' prep works in the state warpgroups' tiles, S's included.
  constexpr bool kStageSAhead = kPrepAhead && kDecays == Decays::kSafe;
  // M folded into the chain (the fused kernels: intra_chunk_math.cuh step 8): the stage holds KG
  // and v instead of W and U, and v_new = M (beta v - KG S).
  // The only caller, the fused kernel, has prep ahead, so M is always folded here (the W / U
  // hand-off is the cooperative owners', owner_state_math.cuh).
  static_assert(fold_m(kPrepAhead), "the fused state warpgroups take M folded into their chain");
  // k and q slots released as soon as they are read (load_producer.cuh: early_slot_release).
  constexpr bool kEarlySlots = early_slot_release(kPrepAhead, kLongestFirst, kDecays == Decays::kSafe);
  // The general gates' prep has one call site only (below).
  constexpr bool kOneSite = kDecays != Decays::kSafe;
  static_assert(!kStageSAhead || !kOneSite, "(a) is skipped for c > 0: the safe kernels' loop starts at c = 0");
  const KdaPrefillParams& p = kp.problem;
  const int tid = threadIdx.x - first_thread(WarpgroupRole::kState0) - kWarpgroupThreads * half;
  const int warp = tid >> 5, lane = tid & 31;
  const int g4 = lane >> 2, t4 = lane & 3;
  const NamedBarrierId bar = half ? NamedBarrierId::kState1 : NamedBarrierId::kState0;
  uint8_t* const s_tile = smem.state_bf16[half];
  uint8_t* const vn_tile = smem.v_new[half];
  const uint32_t s_base = smem_u32(s_tile), vn_base = smem_u32(vn_tile);
  PipelineState pipe;
  PhaseTimer timer;
  timer.start();

  // Prep ahead: steps 1-3 of chunk c of tile t on its stage (`at`), by both warpgroups, once it is
  // loaded. The gate constants follow the tile being prepared (the next tile's, at a tile's end).
  const int prep_tid = tid + kWarpgroupThreads * half;  // 0..255, feature pair prep_tid % 64
  [[maybe_unused]] GateConstants gc(p, 1.f, make_float2(0.f, 0.f));
  [[maybe_unused]] int gc_head = -1;
  // One call site (below): each inlined copy of the prep is ~20 KB of code, and the longest-first
  // kernels ran two of three copies every tile, which measured as instruction-cache misses
  // (docs/perf-notes.md). Its arguments are scalars chosen by selects, not a tile reference
  // (a reference chosen between two tiles put them in local memory).
  const auto prep = [&](const PipelineState& at, int v_head, int rows) {
    if (v_head != gc_head) {
      float gate_scale;
      float2 gate_bias;
      gate_parameters<kGateInKernel>(p, v_head, prep_tid, gate_scale, gate_bias);
      gc = GateConstants(p, gate_scale, gate_bias);
      gc_head = v_head;
    }
    StageStorage& st = smem.stage[at.stage];
    cutlass::arch::ClusterTransactionBarrier::wait(&smem.full_bar[at.stage], at.phase);
    timer.mark(7);  // the stage's load (and, at a tile's start, the tile change) waited for
    prep_chunk_ahead<kGateInKernel, kL2Norm, kDecays>(st, smem.state_bf16[0], rows, gc, prep_tid, timer);
    cutlass::arch::ClusterBarrier::arrive(&smem.prepped_bar[at.stage]);
  };
  // With prep ahead the warpgroups fetch the next tile at the current one's last chunk (`ahead`)
  // and prepare its first chunk there, so that a tile's start (many short tiles under the
  // longest-first schedule) does not wait for a prep. The producer announces that tile once it has
  // issued the loads of this tile's last chunk, which the prep of that chunk waited for.
  TileCursor cursor;
  [[maybe_unused]] WorkTile ahead;
  [[maybe_unused]] bool ahead_fetched = false, have_ahead = false, first_prepped = false;
  const auto take_tile = [&](WorkTile& tile) {
    if constexpr (kOwnPrep) {
      if (ahead_fetched) {
        ahead_fetched = false;
        tile = ahead;
        return have_ahead;
      }
    }
    return next_tile<kLongestFirst, /*kIsProducer=*/false, false, kPair>(kp, smem, cursor, tile);
  };
  for (WorkTile tile; take_tile(tile);) {
    StateFragment S;
    load_initial_state(p, state_slot(p, tile), S, half, warp, lane);
    const int num_chunks = tile.num_chunks();
    const OutputRowWriter out_rows(p, tile, half, tid);
    // (a)'s S -> bf16 [K=128 rows, 64 columns], the MN-major B operand of (b) and (d) (times
    // `scale`: 1, or a power of two in (c)'s rare rescale).
    const auto write_s_tile = [&](float scale) {
#pragma unroll
      for (int mh = 0; mh < 2; ++mh)
#pragma unroll
        for (int n8 = 0; n8 < 8; ++n8)
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {
            const int kk = 64 * mh + kSubBlock * warp + g4 + 8 * h2;
            *reinterpret_cast<uint32_t*>(s_tile + sw128_fragment_offset(kk, n8, g4, t4)) = float2_to_bf16x2(
                S.acc[mh][n8 * 4 + h2 * 2] * scale, S.acc[mh][n8 * 4 + h2 * 2 + 1] * scale);
          }
    };
    // (a) published to the warpgroup's products (async proxy).
    const auto stage_s_tile = [&]() {
      write_s_tile(1.f);
      fence_smem_to_async_proxy();
      named_barrier_sync(bar, 128);
    };
    // Prep ahead: iteration c prepares chunk c + 1 of this tile or, at the last chunk, the next
    // tile's chunk 0, on the stage after this chunk's (one hot call site). Chunk 0 of a tile whose
    // previous tile did not prepare it (the first tile, or after an empty next tile) is prepared
    // before the loop (a cold copy of the prep) or, with kOneSite, by an iteration c = -1 that
    // does nothing else: the general-gate kernels' prep is ~40 % larger, and one copy of it keeps
    // them nearer the instruction cache and spills less there, while in the safe-gate kernels the
    // extra iteration made ptxas spill in the chunk loop (+37 % time; docs/perf-notes.md).
    int c = 0;
    if constexpr (kOwnPrep) {
      const bool prep_first = num_chunks > 0 && !first_prepped;
      if constexpr (kOneSite) {
        if (prep_first) c = -1;
      } else {
        if (prep_first) prep(pipe, tile.v_head, tile.chunk_rows(0));
      }
      first_prepped = false;
    }
    for (; c < num_chunks; ++c) {
      if constexpr (kOwnPrep) {
        PipelineState at = pipe;  // c >= 0: the stage released after chunk c - 1
        if (!kOneSite || c >= 0) at.advance();
        const bool in_tile = c + 1 < num_chunks;
        bool do_prep = true;
        if (!in_tile) {
          have_ahead = next_tile<kLongestFirst, /*kIsProducer=*/false>(kp, smem, cursor, ahead);
          ahead_fetched = true;
          do_prep = have_ahead && ahead.num_chunks() > 0;
          first_prepped = do_prep;
        }
        const int prep_head = in_tile ? tile.v_head : ahead.v_head;
        const int prep_rows = in_tile ? tile.chunk_rows(c + 1) : ahead.chunk_rows(0);
        if (do_prep) prep(at, prep_head, prep_rows);
        if (kOneSite && c < 0) continue;
      }
      // The prep (its wait for the stage's load included; at a tile's start also the previous
      // tile's final state store, the next tile's fetch and its initial state load).
      if constexpr (kPrepAhead) timer.mark(6);
      StageStorage& st = smem.stage[pipe.stage];
      cutlass::arch::ClusterBarrier::wait(&smem.ready_bar[pipe.stage], pipe.phase);
      if (kPair && tid == 0) pair_timeline_mark(kp.coop.timeline, TimelineEvent::kPairReady, c);
      timer.mark(0);
      // kPair, rank 0: rank 1's copy of A_qk has landed, so it has read its source (rank 1's stage
      // reload waits for this too: its `empty` counts one more arrive).
      if constexpr (kPair) {
        if (half == 0 && tid == 0) mbarrier_arrive_cluster(cluster_smem_addr(smem_u32(&smem.empty_bar[pipe.stage]), 1));
      }

      // (a) S (fp32 registers) -> bf16 [K=128 rows, 64 columns], the MN-major B operand, unless
      // the previous chunk of the tile wrote it at its end (kStageSAhead; its kernels start the
      // chunk loop at c = 0, so that is every chunk but the first).
      if (!kStageSAhead || c == 0) stage_s_tile();

      timer.mark(1);
      // (b) P = X = KG S.
      const uint32_t w_base = smem_u32(st.k), qg_base = smem_u32(st.q);
      float P[32];
#pragma unroll
      for (int r = 0; r < 32; ++r) P[r] = 0.f;
      fence_accumulators(P);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) {
        const uint32_t a_off = (ks >> 2) * kBoxBytes + (ks & 3) * 32;
        wgmma_ss<64, Major::K, Major::MN>(desc_advance(desc_k_major(w_base), a_off),
                                          desc_advance(desc_mn_major(s_base, kBoxBytes), ks * 16 * 128), P, true);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_accumulators(P);
      // KG's last reader is done: the producer may reload the k slot (load_producer.cuh).
      if constexpr (kEarlySlots) cutlass::arch::ClusterBarrier::arrive(&smem.k_empty_bar[pipe.stage]);

      timer.mark(2);
      uint8_t* const vn_half = st.v + half * kBoxBytes;
      // v on its own barrier (load_producer.cuh: v_full): landed long ago, with the prep's q, k, g.
      if constexpr (kPrepAhead) cutlass::arch::ClusterTransactionBarrier::wait(&smem.v_full_bar[pipe.stage], pipe.phase);
      // (c0) Y = beta v - X (fp32 registers; X = KG S from (b)) -> bf16 in the v_new tile, the B
      // operand of v_new = Y + (M - I) Y: the accumulator starts at Y, so the identity term is
      // exact and Y's bf16 rounding enters only through M - I.
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const float bi = st.beta[kSubBlock * warp + g4 + 8 * h2];
#pragma unroll
        for (int n8 = 0; n8 < 8; ++n8) {
          const int r = n8 * 4 + h2 * 2;
          const uint32_t off = sw128_fragment_offset(kSubBlock * warp + g4 + 8 * h2, n8, g4, t4);
          const float2 v = bf16x2_to_float2(*reinterpret_cast<const uint32_t*>(vn_half + off));
          P[r] = fmaf(bi, v.x, -P[r]);
          P[r + 1] = fmaf(bi, v.y, -P[r + 1]);
          *reinterpret_cast<uint32_t*>(vn_tile + off) = float2_to_bf16x2(P[r], P[r + 1]);
        }
      }
      fence_smem_to_async_proxy();
      named_barrier_sync(bar, 128);
      const uint32_t m_base = smem_u32(smem.intra_scratch + kMTileOffset);
      fence_accumulators(P);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kChunk / 16; ++ks)
        wgmma_ss<64, Major::K, Major::MN>(desc_advance(desc_k_major(m_base), ks * 32),
                                          desc_advance(desc_mn_major(vn_base, kBoxBytes), ks * 16 * 128), P, true);
      wgmma_commit();
      wgmma_wait<0>();
      fence_accumulators(P);
      // The M tile is read: the intra-chunk warpgroup may write its scratch again. And every
      // thread of the warpgroup is done with the Y tile before v_new goes there.
      if constexpr (kPair) {  // one arrive per CTA, on rank 0's barrier (pair_intra_math.cuh)
        named_barrier_sync(bar, 128);
        if (tid == 0) mbarrier_arrive_cluster(cluster_smem_addr(smem_u32(&smem.m_tile_empty_bar), 0));
      } else {
        cutlass::arch::ClusterBarrier::arrive(&smem.m_tile_empty_bar);
        named_barrier_sync(bar, 128);
      }
      // (c) v_new (in P) -> bf16 tile [64 rows, 64 columns], MN-major B operand.
      // kAqkHalf: v_new also in fp16, for A_qk v_new with the fp16 A_qk, over this warpgroup's half
      // of v in the stage (each thread writes exactly the elements it read, so no
      // other thread's read is overtaken). fp16 has 3 more mantissa bits than bf16 but overflows at
      // 65504 and goes subnormal below 2^-14, and nothing bounds v: the copy is written unscaled, and the
      // barrier below also reports whether any thread saw a value it cannot hold well (a nonzero
      // max |v_new| of its own outside [2^-10, 2^15); zero rows past a sequence's end do not count).
      // Only then (rare) does the warpgroup take the chunk's exact max and, where it lies outside
      // that range, rewrite the copy scaled by 2^-vn_shift (a power of two, exact).
      [[maybe_unused]] float vn_up = 1.f;  // 2^vn_shift
      [[maybe_unused]] float m = 0.f;      // this thread's max |v_new|
#pragma unroll
      for (int r = 0; r < 32; r += 2) {
        const int n8 = r >> 2, h2 = (r >> 1) & 1;
        const uint32_t off = sw128_fragment_offset(kSubBlock * warp + g4 + 8 * h2, n8, g4, t4);
        *reinterpret_cast<uint32_t*>(vn_tile + off) = float2_to_bf16x2(P[r], P[r + 1]);
        if constexpr (kAqkHalf) {
          *reinterpret_cast<uint32_t*>(vn_half + off) = float2_to_half2(P[r], P[r + 1]);
          m = fmaxf(m, fmaxf(fabsf(P[r]), fabsf(P[r + 1])));
        }
      }
      fence_smem_to_async_proxy();
      if constexpr (kAqkHalf) {
        // fp16_out_of_range / fp16_shift_for_max (sm90_primitives.cuh) written out, warpgroup-wide:
        // through the helpers ptxas schedules this kernel differently (+64 SASS instructions, two
        // more spill pairs in the gate-in-kernel l2norm index kernel), so the hot path keeps the
        // measured code. The two must stay the same rule.
        const bool out_of_range = m >= 32768.f || (m > 0.f && m < 0x1p-10f);
        if (named_barrier_sync_any(bar, 128, out_of_range)) {  // uniform over the warpgroup
#pragma unroll
          for (int x = 16; x > 0; x >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, x));
          if (lane == 0) st.vnew_max[half][warp] = m;
          named_barrier_sync(bar, 128);
          const float mx = fmaxf(fmaxf(st.vnew_max[half][0], st.vnew_max[half][1]),
                                 fmaxf(st.vnew_max[half][2], st.vnew_max[half][3]));
          // mx in [2^e, 2^(e+1)): at or above 2^15 scale down by 2^(e - 14), so that the max lands
          // in [2^14, 2^15) (e is at most 128, inf: at most 2^114); below 2^-10, where v_new would
          // reach fp16's subnormals (2^-14) and lose digits, scale up by 2^24 (e - 14 <= -25
          // there, so the cap always applies: S's tile, scaled alike, stays far from bf16's range).
          const int e = int((__float_as_uint(mx) >> 23) & 0xffu) - 127;
          const int shift = (e > 14 || e < -10) ? max(e - 14, -24) : 0;
          if (shift != 0) {
            // O = QG S + A_qk v_new is computed as 2^-shift of itself, from S's tile scaled alike
            // ((b) has read it), and scaled back before the store. Each thread rewrites the
            // elements it wrote in (a) and above.
            const float down = __uint_as_float(uint32_t(127 - shift) << 23);
            vn_up = __uint_as_float(uint32_t(127 + shift) << 23);
#pragma unroll
            for (int r = 0; r < 32; r += 2) {
              const int n8 = r >> 2, h2 = (r >> 1) & 1;
              const uint32_t off = sw128_fragment_offset(kSubBlock * warp + g4 + 8 * h2, n8, g4, t4);
              *reinterpret_cast<uint32_t*>(vn_half + off) = float2_to_half2(P[r] * down, P[r + 1] * down);
            }
            write_s_tile(down);
            fence_smem_to_async_proxy();
          }
          // The rewrites are in, and every thread has read the maxima before the next chunk's.
          named_barrier_sync(bar, 128);
        }
      } else {
        named_barrier_sync(bar, 128);
      }

      timer.mark(3);
      // (d) O = QG S + A_qk v_new (runs while the state update below is issued).
      const uint32_t aqk_base = smem_u32(st.aqk);
      float O[32];
#pragma unroll
      for (int r = 0; r < 32; ++r) O[r] = 0.f;
      fence_accumulators(O);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) {
        const uint32_t a_off = (ks >> 2) * kBoxBytes + (ks & 3) * 32;
        wgmma_ss<64, Major::K, Major::MN>(desc_advance(desc_k_major(qg_base), a_off),
                                          desc_advance(desc_mn_major(s_base, kBoxBytes), ks * 16 * 128), O, true);
      }
      if constexpr (kAqkHalf) {  // fp16 A_qk and v_new (times 2^-vn_shift, as S's tile)
        const uint32_t vh_base = smem_u32(vn_half);
#pragma unroll
        for (int ks = 0; ks < kChunk / 16; ++ks)
          wgmma_ss_f16_n64<Major::K, Major::MN>(desc_advance(desc_k_major(aqk_base), ks * 32),
                                                desc_advance(desc_mn_major(vh_base, kBoxBytes), ks * 16 * 128), O, true);
      } else {
#pragma unroll
        for (int ks = 0; ks < kChunk / 16; ++ks) {
          wgmma_ss<64, Major::K, Major::MN>(desc_advance(desc_k_major(aqk_base), ks * 32),
                                            desc_advance(desc_mn_major(vn_base, kBoxBytes), ks * 16 * 128), O, true);
        }
      }
      wgmma_commit();

      // S += KT_b^T v_new_b for the 16-row block b (both 64-row halves of S).
      const uint32_t kt_base = smem_u32(st.g);
      const auto update_block = [&](int b) {
        if constexpr (kHalfUpdate) {  // fp16 KT (times 2^7) and v_new' (times 2^-vn_shift)
          const uint64_t db = desc_advance(desc_mn_major(smem_u32(vn_half), kBoxBytes), b * kSubBlock * 128);
#pragma unroll
          for (int mh = 0; mh < 2; ++mh) {
            const uint64_t da = desc_advance(desc_mn_major(kt_base, kBoxBytes), mh * kBoxBytes + b * kSubBlock * 128);
            wgmma_ss_f16_n64<Major::MN, Major::MN>(da, db, S.acc[mh], true);
          }
        } else {
          const uint64_t db = desc_advance(desc_mn_major(vn_base, kBoxBytes), b * kSubBlock * 128);
#pragma unroll
          for (int mh = 0; mh < 2; ++mh) {
            const uint64_t da = desc_advance(desc_mn_major(kt_base, kBoxBytes), mh * kBoxBytes + b * kSubBlock * 128);
            wgmma_ss<64, Major::MN, Major::MN>(da, db, S.acc[mh], true);
          }
        }
      };
      // kHalfUpdate: the products carry c = 2^7 / vn_up, so S is carried as c S through the
      // update (folded into the first row scale, a power of two: exact) and scaled back after it.
      [[maybe_unused]] const float c_up = kHalfUpdate ? 0x1p7f * __frcp_rn(vn_up) : 1.f;  // exact: vn_up = 2^k
      // (e) State update in Horner form over the four 16-row blocks.
      float r_prev[2][2], f[2][2];
#pragma unroll
      for (int mh = 0; mh < 2; ++mh)
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          const int kk = 64 * mh + kSubBlock * warp + g4 + 8 * h2;
          r_prev[mh][h2] = st.r_block[0][kk];
          f[mh][h2] = fast_exp2(r_prev[mh][h2]);
          if constexpr (kHalfUpdate) f[mh][h2] *= c_up;
        }
      scale_state_rows(S, f);
#pragma unroll
      for (int b = 0; b < kNumSubBlocks; ++b) {
        if (b > 0) {
          wgmma_wait<0>();
          fence_accumulators(S.acc[0]);
          fence_accumulators(S.acc[1]);
          // (d)'s products (QG S, A_qk v_new) are done with the first wait: the q slot is free.
          if (kEarlySlots && b == 1) cutlass::arch::ClusterBarrier::arrive(&smem.q_empty_bar[pipe.stage]);
#pragma unroll
          for (int mh = 0; mh < 2; ++mh)
#pragma unroll
            for (int h2 = 0; h2 < 2; ++h2) {
              const int kk = 64 * mh + kSubBlock * warp + g4 + 8 * h2;
              const float r = st.r_block[b][kk];
              f[mh][h2] = fast_exp2(r - r_prev[mh][h2]);
              r_prev[mh][h2] = r;
            }
          scale_state_rows(S, f);
        }
        fence_accumulators(S.acc[0]);
        fence_accumulators(S.acc[1]);
        wgmma_fence();
        update_block(b);
        wgmma_commit();
      }
      // (d')'s operands (below) loaded while the last block's update runs: written beside (d') the
      // loads came after the wait (the products' asm has memory clobbers), and each FFMA waited
      // for its load.
      uint32_t vn_bits[2][8];
      float diag[2];
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const int i = kSubBlock * warp + g4 + 8 * h2;
        diag[h2] = st.aqk_diag[i];
#pragma unroll
        for (int n8 = 0; n8 < 8; ++n8)
          vn_bits[h2][n8] = *reinterpret_cast<const uint32_t*>((kAqkHalf ? vn_half : vn_tile) +
                                                               sw128_fragment_offset(i, n8, g4, t4));
      }
      wgmma_wait<0>();
      fence_accumulators(S.acc[0]);
      fence_accumulators(S.acc[1]);
      fence_accumulators(O);
      if constexpr (kHalfUpdate) {  // c S -> S
        const float c_down = vn_up * 0x1p-7f;
        const float fd[2][2] = {{c_down, c_down}, {c_down, c_down}};
        scale_state_rows(S, fd);
      }

      // (d') O += diag(A_qk) v_new, the diagonal in fp32 (the A_qk tile has zeros there), from the
      // operand the product took (bf16 v_new, or kAqkHalf: the fp16 v_new', then O *= 2^vn_shift).
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const float d = diag[h2];
#pragma unroll
        for (int n8 = 0; n8 < 8; ++n8) {
          const float2 vn = kAqkHalf ? half2_to_float2(vn_bits[h2][n8]) : bf16x2_to_float2(vn_bits[h2][n8]);
          O[n8 * 4 + h2 * 2] = fmaf(d, vn.x, O[n8 * 4 + h2 * 2]);
          O[n8 * 4 + h2 * 2 + 1] = fmaf(d, vn.y, O[n8 * 4 + h2 * 2 + 1]);
        }
      }
      if (kAqkHalf && vn_up != 1.f) {
#pragma unroll
        for (int r = 0; r < 32; ++r) O[r] *= vn_up;
      }

      timer.mark(4);
      // (g) release the stage: nothing below reads it (o leaves from registers through the S
      // tile), so the producer's reload of this stage (with prep ahead: on this warpgroup's path,
      // chunk_prep.cuh) runs while the output is stored.
      cutlass::arch::ClusterBarrier::arrive(&smem.empty_bar[pipe.stage]);
      if (kPair && tid == 0) pair_timeline_mark(kp.coop.timeline, TimelineEvent::kPairReleased, c);
      // (f) o -> global (the S tile is free again and serves as staging).
      store_output_tile(p, out_rows, tile, c, O, s_tile, tid, bar);
      if (kPair && tid == 0) pair_timeline_mark(kp.coop.timeline, TimelineEvent::kPairStored, c);
      // kStageSAhead: (a) for the next chunk of this tile now, while the producer reloads the
      // stage just released: the next iteration's prep waits for that load first (~1.5k cycles a
      // chunk at B2, docs/perf-notes.md), and this takes (a) off the stretch after `ready`.
      if constexpr (kStageSAhead) {
        if (c + 1 < num_chunks) stage_s_tile();
      }
      timer.mark(5);
      pipe.advance();
    }
    // The slot again rather than kept in registers across the chunk loop.
    store_final_state(p, state_slot(p, tile), S, half, warp, lane);
  }
  if constexpr (kPair)  // 256 threads per cluster
    zero_uncovered_rows(p, int(blockIdx.x >> 1), tid + 128 * half, int(gridDim.x >> 1));
  else
    zero_uncovered_rows(p, int(blockIdx.x), tid + 128 * half, int(gridDim.x));
  timer.report(half ? "state1: wait s2smem P vnew O+S store prep-rest load-wait prep-ops exact"
                    : "state0: wait s2smem P vnew O+S store prep-rest load-wait prep-ops exact", tid);
}

}  // namespace cula::kda::sm90
