// Tile owners of the cooperative mode: the recurrence on finished stages, in transposed form.
//
// An owner's chunk time is the state chain alone (the helpers have done the chunk-local work), so
// every step of it counts. The fused kernel's state warpgroups (state_math.cuh) keep S [K, V] as
// the accumulator and feed it to the tensor cores as a B operand, which costs per chunk a round
// trip of S through shared memory (a bf16 copy, a proxy fence, a barrier) and another of v_new.
// Here the warpgroup keeps the transpose, S^T [V = its 64 value columns, K = 128], as the
// accumulator of an m64n128 product. An accumulator's register layout is also the layout of a
// WGMMA A operand from registers (rows 16 w + g4 (+8), columns 2 t4 (+1) of each 8-column group),
// so every product of the chunk takes S^T or v_new^T straight from registers:
//
//   (a) S^T -> bf16 A fragments (8 k-steps over K); then S^T *= diag(exp2(G_last)) in place
//   (b) v_new^T = U^T - S^T W^T         [64 v x 64 c]   B = -W (K-major)        8 WGMMA, N = 64
//       (the accumulator starts at U^T, by ldmatrix.trans from the stage's U tile; the helpers
//       store -W, so the product itself yields v_new^T)
//   (c) v_new^T -> bf16 (fp16) A fragments
//   (d) O^T = S^T QG^T + v_new^T A_qk^T [64 v x 64 i]   B = QG, A_qk (K-major)  12 WGMMA, N = 64
//       (the S^T QG^T part issued right after (b), so it runs while v_new is formed; with l2norm
//       the v_new^T A_qk^T part in fp16, and (e) too: coop_aqk_is_half)
//   (e) S^T += v_new^T KT'             [64 v x 128 k]  B = KT' (MN-major)      4 WGMMA, N = 128
//       (KT' = k exp2(G_last - G) <= 1: the helper folded the block decays into KT)
//   (d') O^T += v_new^T diag(A_qk) in fp32, v_new unrounded (the A_qk tile has zeros on its diagonal)
//   (f) o = scale O -> staging by stmatrix.trans (rows i, columns v) -> 16-byte global stores
//
// The fused state warpgroups' operands except that W and U are formed here (they fold M into the
// chain instead) and, where l2norm bounds A_qk, the same fp16 A_qk v_new, so the results match
// the fused kernel's within the cooperative tests' tolerance; the one barrier per chunk left
// is the output staging's (two staging buffers alternate, so no second barrier is needed).
// Registers: S^T (64) + its fragments (32) + P^T (32) + O^T (32) + v_new^T fragments (16) live
// at once, more than the fused state warpgroups' 160; an owner CTA has no intra-chunk work, so its
// intra warpgroup gives its registers back and the state warpgroups take kOwnerStateRegs.
#pragma once

#include "chunk_workspace.cuh"
#include "kernel_params.cuh"
#include "shared_storage.cuh"
#include "sm90_primitives.cuh"
#include "store_epilogue.cuh"
#include "tile_scheduler.cuh"

namespace cula::kda::sm90 {

// S^T in registers: thread (warp w, lane) holds, for n8 in 0..15, h2 in {0, 1}, e in {0, 1},
//   St[n8 * 4 + h2 * 2 + e] = S[k = 8 n8 + 2 (lane % 4) + e][v = 64 half + 16 w + lane / 4 + 8 h2].
template <bool kLoad, typename Elem>
__device__ __forceinline__ void transposed_state_io(const KdaPrefillParams& p, Elem* gmem, float (&St)[64], int half,
                                                    int warp, int lane) {
  const int g4 = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int n8 = 0; n8 < 16; ++n8)
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const int vv = 64 * half + kSubBlock * warp + g4 + 8 * h2;
      const int kk = 8 * n8 + 2 * t4;
      // [V, K] ("vk"): (vv, kk) and (vv, kk + 1) are adjacent.
      state_pair_io<kLoad>(gmem, p.state_vk, vv, kk, St[n8 * 4 + h2 * 2], St[n8 * 4 + h2 * 2 + 1]);
    }
}

__device__ __forceinline__ void load_initial_state_transposed(const KdaPrefillParams& p, const StateSlot& slot,
                                                              float (&St)[64], int half, int warp, int lane) {
  if (!slot.read) {
#pragma unroll
    for (int r = 0; r < 64; ++r) St[r] = 0.f;
    return;
  }
  if (p.initial_state_is_bf16)
    transposed_state_io<true>(
        p, const_cast<__nv_bfloat16*>(static_cast<const __nv_bfloat16*>(p.initial_state)) + slot.offset, St, half,
        warp, lane);
  else
    transposed_state_io<true>(p, const_cast<float*>(static_cast<const float*>(p.initial_state)) + slot.offset, St,
                              half, warp, lane);
}

__device__ __forceinline__ void store_final_state_transposed(const KdaPrefillParams& p, const StateSlot& slot,
                                                             float (&St)[64], int half, int warp, int lane) {
  if (p.final_state == nullptr || slot.pad) return;
  if (p.final_state_is_bf16)
    transposed_state_io<false>(p, static_cast<__nv_bfloat16*>(p.final_state) + slot.offset, St, half, warp, lane);
  else
    transposed_state_io<false>(p, static_cast<float*>(p.final_state) + slot.offset, St, half, warp, lane);
}

// A fragment r (0..3) of k-step ks from an accumulator-layout array: elements 8 ks + 2 r (+1),
// i.e. row 16 w + g4 + 8 (r & 1), columns 16 ks + 8 (r >> 1) + 2 t4 (+1).
template <int N>
__device__ __forceinline__ void accumulator_to_fragments(const float (&acc)[N], uint32_t (&frag)[N / 8][4]) {
#pragma unroll
  for (int ks = 0; ks < N / 8; ++ks)
#pragma unroll
    for (int r = 0; r < 4; ++r) frag[ks][r] = float2_to_bf16x2(acc[8 * ks + 2 * r], acc[8 * ks + 2 * r + 1]);
}

// One chunk of the owner's chain (steps (a)-(f) above) on the stage `pipe` points at, which it
// waits for and releases. with_u: U from the stage (false: the P chain, U = 0); with_out: O^T and
// the output rows of chunk c (false: the chain alone, for a segment's Q or P).
// kAqkHalf (shared_storage.cuh: coop_aqk_is_half): the helpers wrote A_qk and KT' in fp16, and
// (d) and (e) take v_new^T as fp16 fragments (8x finer than bf16; range handling as the fused
// kernels' fp16 A_qk v_new in state_math.cuh: a warpgroup-uniform power-of-two scale where
// max |v_new| leaves [2^-10, 2^15)).
template <bool kAqkHalf>
__device__ __forceinline__ void owner_chunk_step(const KdaPrefillParams& p, SharedStorage& smem, const PipelineState& pipe,
                                                 float (&St)[64], const WorkTile& tile, int c, bool with_u,
                                                 bool with_out, uint8_t* staging, const OutputRowWriter& out_rows,
                                                 NamedBarrierId bar, int half, int tid, PhaseTimer& timer) {
  const int warp = tid >> 5, lane = tid & 31;
  const int t4 = lane & 3;
  StageStorage& st = smem.stage[pipe.stage];
  cutlass::arch::ClusterBarrier::wait(&smem.full_bar[pipe.stage], pipe.phase);
  timer.mark(0);

  // (c, first) U^T as the initial value of the P accumulator, so that (b) yields v_new^T itself:
  // the helpers store W' = -W (intra_chunk_math.cuh, step 8), and U^T + S^T W'^T = U^T - P^T is
  // v_new^T, with U added inside the fp32 accumulation instead of by 32 subtractions after it.
  // U is the stage's [64 c, 128 v] tile; this half's columns are box `half`. ldmatrix.trans of
  // the 8x8 block (rows c0.., columns v0..) gives the accumulator pair (v0 + g4, c0 + 2 t4 .. +1)
  // of U^T: for k-step ks and fragment r, v0 = 16 w + 8 (r & 1), c0 = 16 ks + 8 (r >> 1); lanes
  // 8 r .. 8 r + 7 address that block's rows. The P chain of a segment (with_u false) starts
  // from U = 0.
  float Pt[32];
  if (with_u) {
    const uint32_t u_base = smem_u32(st.v + half * kBoxBytes);
    const int r = lane >> 3;
    const int row_in = lane & 7;
#pragma unroll
    for (int ks = 0; ks < kChunk / 16; ++ks) {
      uint32_t u[4];
      const int c_row = 16 * ks + 8 * (r >> 1) + row_in;
      ldmatrix_x4_trans(u_base + sw128_chunk_offset(c_row, 2 * warp + (r & 1)), u);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 uf = bf16x2_to_float2(u[q]);
        Pt[8 * ks + 2 * q] = uf.x;
        Pt[8 * ks + 2 * q + 1] = uf.y;
      }
    }
  } else {
#pragma unroll
    for (int r = 0; r < 32; ++r) Pt[r] = 0.f;
  }

  // (a) S^T as bf16 A fragments, then (while (b) runs) the decay of the whole chunk applied
  // to the fp32 accumulator: column k of S^T times exp2(G_last[k]), which the helper left in the
  // stage's last r_block row (intra_chunk_math.cuh, step 8: no MUFU on the owner's chain).
  uint32_t sa[8][4];
  accumulator_to_fragments(St, sa);
  const uint64_t w_desc = desc_k_major(smem_u32(st.k)), qg_desc = desc_k_major(smem_u32(st.q));
  float Ot[32];
#pragma unroll
  for (int r = 0; r < 32; ++r) Ot[r] = 0.f;
  fence_accumulators(Pt);
  fence_accumulators(Ot);
  wgmma_fence();
  // (b) v_new^T = U^T + S^T W'^T: k-step ks covers features 16 ks .. 16 ks + 15 (box ks / 4 of
  // W's rows).
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks)
    wgmma_rs<64, Major::K>(sa[ks], desc_advance(w_desc, (ks >> 2) * kBoxBytes + (ks & 3) * 32), Pt, true);
  wgmma_commit();
  // (d, first part) O^T = S^T QG^T, its own batch: runs while v_new is formed.
  if (with_out) {
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks)
      wgmma_rs<64, Major::K>(sa[ks], desc_advance(qg_desc, (ks >> 2) * kBoxBytes + (ks & 3) * 32), Ot, true);
    wgmma_commit();
  }
#pragma unroll
  for (int n8 = 0; n8 < 16; ++n8) {
    const float2 f = *reinterpret_cast<const float2*>(&st.r_block[kNumSubBlocks - 1][8 * n8 + 2 * t4]);
    const float f0 = f.x, f1 = f.y;
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      St[n8 * 4 + h2 * 2] *= f0;
      St[n8 * 4 + h2 * 2 + 1] *= f1;
    }
  }
  if (with_out)
    wgmma_wait<1>();  // v_new^T done (the O^T batch may still run)
  else
    wgmma_wait<0>();
  fence_accumulators(Pt);
  timer.mark(1);

  // (c) v_new^T as A fragments va: bf16, or kAqkHalf fp16 (then A_qk and KT' are fp16 in the
  // stage too, so (d) and (e) both take fp16). fp16 has 3 more mantissa bits than bf16 but
  // overflows at 65504 and goes subnormal below 2^-14: each thread takes its max |v_new|, and
  // where any thread's lies outside [2^-10, 2^15) (rare; the test is warp-uniform, below) the
  // warp redoes va from the fp32 values times 2^-shift and scales the accumulators they feed
  // alike (its rows of S^T before (e), of O^T's first batch once it is done), and back after.
  uint32_t va[kChunk / 16][4];
  [[maybe_unused]] float vn_up = 1.f;
  const auto pack = [](float x, float y) { return kAqkHalf ? float2_to_half2(x, y) : float2_to_bf16x2(x, y); };
  // Pt now holds v_new^T.
#pragma unroll
  for (int ks = 0; ks < kChunk / 16; ++ks)
#pragma unroll
    for (int q = 0; q < 4; ++q) va[ks][q] = pack(Pt[8 * ks + 2 * q], Pt[8 * ks + 2 * q + 1]);
  if constexpr (kAqkHalf) {
    // Four independent running maxima, then two levels: the same max (fmaxf is exact), with a
    // dependent chain of 10 FMNMX on the chain's path instead of 32.
    float m4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int r = 0; r < 32; ++r) m4[r & 3] = fmaxf(m4[r & 3], fabsf(Pt[r]));
    float m = fmaxf(fmaxf(m4[0], m4[1]), fmaxf(m4[2], m4[3]));
    // Per warp: warp w's rows of v_new^T (rows 16 w .. 16 w + 15 of the A operand) feed only its
    // own rows of O^T and S^T in (d) and (e), so a warp-uniform scale is exact, and the common
    // path costs a vote instead of a barrier of the warpgroup on the chain.
    if (__any_sync(0xffffffffu, fp16_out_of_range(m))) {  // uniform over the warp
#pragma unroll
      for (int x = 16; x > 0; x >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, x));
      const int shift = fp16_shift_for_max(m);
      if (shift != 0) {
        const float down = __uint_as_float(uint32_t(127 - shift) << 23);
        vn_up = __uint_as_float(uint32_t(127 + shift) << 23);
#pragma unroll
        for (int ks = 0; ks < kChunk / 16; ++ks)
#pragma unroll
          for (int q = 0; q < 4; ++q) va[ks][q] = pack(Pt[8 * ks + 2 * q] * down, Pt[8 * ks + 2 * q + 1] * down);
#pragma unroll
        for (int r = 0; r < 64; ++r) St[r] *= down;
        if (with_out) {
          wgmma_wait<0>();  // this warp's S^T QG^T batch, before its accumulator is scaled
          fence_accumulators(Ot);
#pragma unroll
          for (int r = 0; r < 32; ++r) Ot[r] *= down;
        }
      }
    }
  }
  timer.mark(2);

  // (d) O^T += v_new^T A_qk^T and (e) S^T += v_new^T KT', one batch (after the O^T batch above
  // in the WGMMA queue, which orders the two accumulations into O^T).
  const uint64_t aqk_desc = desc_k_major(smem_u32(st.aqk)), kt_desc = desc_mn_major(smem_u32(st.g), kBoxBytes);
  // (d')'s diagonal of A_qk loaded before the products: written beside (d') the loads came after
  // the wait for (d)+(e) (the fences and products are asm with memory clobbers), and each FFMA
  // waited for its load.
  float2 diag[kChunk / 16][2];
#pragma unroll
  for (int ks = 0; ks < kChunk / 16; ++ks)
#pragma unroll
    for (int h = 0; h < 2; ++h) diag[ks][h] = *reinterpret_cast<const float2*>(&st.aqk_diag[16 * ks + 8 * h + 2 * t4]);
  fence_accumulators(St);
  wgmma_fence();
  if (with_out) {
#pragma unroll
    for (int ks = 0; ks < kChunk / 16; ++ks) {
      if constexpr (kAqkHalf)
        wgmma_rs_f16<64, Major::K>(va[ks], desc_advance(aqk_desc, ks * 32), Ot, true);
      else
        wgmma_rs<64, Major::K>(va[ks], desc_advance(aqk_desc, ks * 32), Ot, true);
    }
  }
#pragma unroll
  for (int ks = 0; ks < kChunk / 16; ++ks) {
    if constexpr (kAqkHalf)
      wgmma_rs_f16<128, Major::MN>(va[ks], desc_advance(kt_desc, ks * kSubBlock * 128), St, true);
    else
      wgmma_rs<128, Major::MN>(va[ks], desc_advance(kt_desc, ks * kSubBlock * 128), St, true);
  }
  wgmma_commit();
  wgmma_wait<0>();
  fence_accumulators(Ot);
  fence_accumulators(St);
  if (kAqkHalf && vn_up != 1.f) {
#pragma unroll
    for (int r = 0; r < 64; ++r) St[r] *= vn_up;
  }
  timer.mark(3);

  // (d') O^T[v, i] += A_qk[i, i] v_new^T[v, i] with v_new in fp32 (Pt: no unpacking of the
  // fragments, and one rounding less than the product's operand), after O^T is scaled back
  // (kAqkHalf); then the stage is no longer read: release it.
  if (with_out) {
    if (kAqkHalf && vn_up != 1.f) {
#pragma unroll
      for (int r = 0; r < 32; ++r) Ot[r] *= vn_up;
    }
#pragma unroll
    for (int ks = 0; ks < kChunk / 16; ++ks)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 d = diag[ks][q >> 1];
        Ot[8 * ks + 2 * q] = fmaf(d.x, Pt[8 * ks + 2 * q], Ot[8 * ks + 2 * q]);
        Ot[8 * ks + 2 * q + 1] = fmaf(d.y, Pt[8 * ks + 2 * q + 1], Ot[8 * ks + 2 * q + 1]);
      }
  }
  cutlass::arch::ClusterBarrier::arrive(&smem.empty_bar[pipe.stage]);
  if (!with_out) {
    timer.mark(4);
    return;
  }

  // (f) o = scale O: O^T's 8x8 blocks stored transposed, so the staging tile holds rows i,
  // columns v (SW128, as OutputRowWriter reads it). stmatrix call ks covers O^T columns
  // (= rows i) 16 ks .. 16 ks + 15; its matrix q is fragment q: rows i0 = 16 ks + 8 (q >> 1),
  // columns v0 = 16 w + 8 (q & 1), whose row addresses lanes 8 q .. 8 q + 7 give.
  uint8_t* const buf = staging + (c & 1) * kBoxBytes;
  {
    const uint32_t buf_base = smem_u32(buf);
    const int q = lane >> 3;
    const int row_in = lane & 7;
#pragma unroll
    for (int ks = 0; ks < kChunk / 16; ++ks) {
      uint32_t o[4];
#pragma unroll
      for (int f = 0; f < 4; ++f)
        o[f] = float2_to_bf16x2(Ot[8 * ks + 2 * f] * p.scale, Ot[8 * ks + 2 * f + 1] * p.scale);
      const int i_row = 16 * ks + 8 * (q >> 1) + row_in;
      stmatrix_x4_trans(buf_base + sw128_chunk_offset(i_row, 2 * warp + (q & 1)), o[0], o[1], o[2], o[3]);
    }
  }
  named_barrier_sync(bar, 128);
  out_rows.write(tile, c, buf);
  timer.mark(4);
}

// Segments (kernel_params.cuh: CooperativePlan): this half's rows of a 128 x 128 fp32 matrix
// [rows, 128 columns] in the workspace <-> the accumulator layout of St (rows 64 half + 16 w + g4
// (+8), columns 8 n8 + 2 t4 (+1)).
template <bool kLoad>
__device__ __forceinline__ void matrix_rows_io(float* m, float (&St)[64], int half, int warp, int lane) {
  const int g4 = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int n8 = 0; n8 < 16; ++n8)
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      float2* ptr = reinterpret_cast<float2*>(m + (64 * half + kSubBlock * warp + g4 + 8 * h2) * kHeadDim + 8 * n8 + 2 * t4);
      if constexpr (kLoad) {
        const float2 v = *ptr;
        St[n8 * 4 + h2 * 2] = v.x;
        St[n8 * 4 + h2 * 2 + 1] = v.y;
      } else {
        *ptr = make_float2(St[n8 * 4 + h2 * 2], St[n8 * 4 + h2 * 2 + 1]);
      }
    }
}

// Publish / wait for a segment result: the warpgroup's stores and fences, a barrier, then one
// thread's release (a count for P's two halves, a flag per half for S_out); the waiter's one thread
// acquires, and the barrier hands the order on to the warpgroup (the matrices are read with plain
// loads: this CTA never touched those lines before, so no stale L1 copy exists).
__device__ __forceinline__ void release_add(int* flag, NamedBarrierId bar, int tid) {
  __threadfence();  // each thread's stores, at GPU scope, before the barrier
  named_barrier_sync(bar, 128);
  if (tid == 0) asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(flag), "r"(1) : "memory");
}
__device__ __forceinline__ void acquire_at_least(const int* flag, int target, NamedBarrierId bar, int tid) {
  if (tid == 0) {
    for (int v = 0;;) {
      asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
      if (v >= target) break;
      __nanosleep(200);
    }
  }
  named_barrier_sync(bar, 128);
}

// S_out^T = S_in^T P^T + Q^T for this half's rows, in fp32 on the CUDA cores: St holds Q^T and
// receives S_out^T; S_in^T [v, k'] and P^T [k', k] are read from the workspace.
__device__ __forceinline__ void segment_fixup(const float* s_in, const float* pt, float (&St)[64], int half, int warp,
                                              int lane) {
  const int g4 = lane >> 2, t4 = lane & 3;
  const float* row0 = s_in + (64 * half + kSubBlock * warp + g4) * kHeadDim;
  const float* row1 = row0 + 8 * kHeadDim;
#pragma unroll 2
  for (int kk = 0; kk < kHeadDim; ++kk) {
    const float a0 = row0[kk], a1 = row1[kk];
    const float* prow = pt + kk * kHeadDim + 2 * t4;
#pragma unroll
    for (int n8 = 0; n8 < 16; ++n8) {
      const float2 pv = *reinterpret_cast<const float2*>(prow + 8 * n8);
      St[n8 * 4] = fmaf(a0, pv.x, St[n8 * 4]);
      St[n8 * 4 + 1] = fmaf(a0, pv.y, St[n8 * 4 + 1]);
      St[n8 * 4 + 2] = fmaf(a1, pv.x, St[n8 * 4 + 2]);
      St[n8 * 4 + 3] = fmaf(a1, pv.y, St[n8 * 4 + 3]);
    }
  }
}

template <bool kAqkHalf>
__device__ __forceinline__ void run_owner_state_warpgroup(const KdaKernelParams& kp, SharedStorage& smem, int half,
                                                          const CooperativeRole& role) {
  const KdaPrefillParams& p = kp.problem;
  const int tid = threadIdx.x - first_thread(WarpgroupRole::kState0) - kWarpgroupThreads * half;
  const int warp = tid >> 5, lane = tid & 31;
  const NamedBarrierId bar = half ? NamedBarrierId::kState1 : NamedBarrierId::kState0;
  // Two o staging buffers of 8 KB (64 rows x 64 columns, SW128), alternating by chunk.
  uint8_t* const staging = smem.state_bf16[half];
  static_assert(sizeof(SharedStorage::state_bf16[0]) >= 2 * kBoxBytes, "two staging buffers per warpgroup");
  const int G = kp.coop.segments;
  PipelineState pipe;
  PhaseTimer timer;
  timer.start();

  TileCursor cursor;
  for (WorkTile tile; next_tile</*kLongestFirst=*/false, /*kIsProducer=*/false, /*kOwner=*/true>(kp, smem, cursor, tile);) {
    const ChunkRange range = segment_chunks(G, tile.num_chunks(), role.segment);
    const int unit = (tile.seq * p.num_v_heads + tile.v_head) * G + role.segment;
    float St[64];
    const OutputRowWriter out_rows(p, tile, half, tid);
    auto chain = [&](bool with_u, bool with_out) {
      for (int c = range.begin; c < range.end; ++c, pipe.advance()) {
        owner_chunk_step<kAqkHalf>(p, smem, pipe, St, tile, c, with_u, with_out, staging, out_rows, bar, half, tid,
                                   timer);
        if (tid == 0)
          timeline_mark(kp.coop.timeline, TimelineEvent::kOwnerChunkDone, tile.v_head, first_chunk_slot(tile) + c, half);
      }
    };
    if (role.p_chain) {  // P^T of this segment, this half's rows: the chain from S^T = I with U = 0
      const int g4 = lane >> 2, t4 = lane & 3;
#pragma unroll
      for (int n8 = 0; n8 < 16; ++n8)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          St[n8 * 4 + r] = 64 * half + kSubBlock * warp + g4 + 8 * (r >> 1) == 8 * n8 + 2 * t4 + (r & 1) ? 1.f : 0.f;
      chain(false, false);
      matrix_rows_io<false>(p_matrix(kp, unit), St, half, warp, lane);
      release_add(p_flag(kp, unit), bar, tid);
      continue;
    }
    if (role.segment == 0) {
      load_initial_state_transposed(p, state_slot(p, tile), St, half, warp, lane);
    } else {
      // Middle segments: Q^T, the chain from S = 0; then S_out = P S_in + Q for the next segment,
      // once S_in (the previous segment's S_out) and both halves of P are published; then the
      // rerun from S_in. The last segment needs no S_out: it waits for S_in and runs once.
      if (role.segment < G - 1) {
#pragma unroll
        for (int r = 0; r < 64; ++r) St[r] = 0.f;
        chain(true, false);
      }
      acquire_at_least(s_out_flag(kp, unit - 1, half), 1, bar, tid);
      const float* s_in = s_out_matrix(kp, unit - 1);
      if (role.segment < G - 1) {
        acquire_at_least(p_flag(kp, unit), 2, bar, tid);
        segment_fixup(s_in, p_matrix(kp, unit), St, half, warp, lane);
        matrix_rows_io<false>(s_out_matrix(kp, unit), St, half, warp, lane);
        release_add(s_out_flag(kp, unit, half), bar, tid);
      }
      matrix_rows_io<true>(const_cast<float*>(s_in), St, half, warp, lane);
    }
    chain(true, true);
    if (role.segment == 0 && G > 1) {  // S_out of segment 0: its true final state
      matrix_rows_io<false>(s_out_matrix(kp, unit), St, half, warp, lane);
      release_add(s_out_flag(kp, unit, half), bar, tid);
    }
    if (role.segment == G - 1) store_final_state_transposed(p, state_slot(p, tile), St, half, warp, lane);
  }
  if (!role.p_chain && role.segment == 0)  // over the owners' first tiles: tiles, or the owner CTAs
    zero_uncovered_rows(p, role.tile, tid + 128 * half, kp.coop.tiles_per_owner > 1 ? kp.coop.owners : kp.coop.tiles);
  timer.report(half ? "owner1: wait P+decay vnew O+S store" : "owner0: wait P+decay vnew O+S store", tid);
}

}  // namespace cula::kda::sm90
