// Intra-chunk warpgroup: everything of a chunk that does not depend on the recurrent state.
//
// For chunk c it runs while the state warpgroups work on chunk c-1 (the stages of the ring are
// the hand-off). Per chunk (64 rows i, 128 features, one value head), in log2 units:
//
//   1. per row: l2 norms of q and k (optional), q.k in fp32, v <- beta v -> rnorm, A_qk[i,i]
//   2. gate activation and per-feature cumsum G_i over the chunk, one feature per thread;
//      rows past the sequence end get a zero decay, so G stops there     -> r_b = G at block ends
//   3. per element e = exp2(G_i - r_b) (>= 1) and f = exp2(r_b - G_i) (<= 1), b = block of i:
//      QE = q e, KE = k e, KT = k f (rows past the end are zero)         (in place over q, k, g)
//   4. A_qk and A_kk by WGMMA, one 16-column block bj at a time: A = QE (or KE) from registers,
//      rescaled per feature by exp2(r_w - r_bj) <= 1 for the warp's row block w > bj, B = KT.
//      The factors of exp2(G_i - G_j) never exceed the span of one 16-row block (<= 2^116 with
//      safe gates), so nothing overflows.
//   5. masks (A_qk: j < i, its diagonal from step 1; A_kk: j < i, times beta_i); A_qk -> stage
//      (bf16); A_kk stays in registers (its diagonal blocks also go to the scratch)
//   6. QG = QE exp2(r_b) = q exp2(G), KG = beta KE exp2(r_b) = beta k exp2(G)   (in place)
//   7. M = (I + A_kk)^-1: 16x16 diagonal blocks by forward substitution, the rest as three rounds
//      of tf32 WGMMA products (unit_lower_inverse.cuh); M ends up in accumulator registers
//   8. W = M KG -> k slot,  U = M (beta v) -> v slot  (WGMMA, M from registers)
//   9. arrive on the stage's `ready` barrier.
#pragma once

#include "kernel_params.cuh"
#include "shared_storage.cuh"
#include "sm90_primitives.cuh"
#include "tile_scheduler.cuh"
#include "unit_lower_inverse.cuh"

namespace cula::kda::sm90 {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kL2NormEps = 1e-6f;

// Addressing of the feature pair (2 cp, 2 cp + 1) of a 64x128 bf16 tile, for the passes that give
// each thread two adjacent features of one half of the chunk's rows.
struct PairColumn {
  uint32_t base;  // box offset + byte offset inside the 16-byte chunk
  int chunk;      // 16-byte chunk index before the swizzle
  __device__ __forceinline__ explicit PairColumn(int cp) {
    const int c = (2 * cp) & 63;
    base = uint32_t((cp >> 5) * kBoxBytes + ((c & 7) << 1));
    chunk = c >> 3;
  }
  __device__ __forceinline__ uint32_t operator()(int row) const {
    return base + uint32_t(row * 128 + (((chunk ^ row) & 7) << 4));
  }
};

__device__ __forceinline__ uint32_t ld_bf16x2(const uint8_t* base, uint32_t off) {
  return *reinterpret_cast<const uint32_t*>(base + off);
}
__device__ __forceinline__ void st_bf16x2(uint8_t* base, uint32_t off, float lo, float hi) {
  *reinterpret_cast<uint32_t*>(base + off) = float2_to_bf16x2(lo, hi);
}

// Steps 1-3: l2 norms, gates, cumsum, rescaled operands.
// Thread (h = tid / 64, cp = tid % 64) owns features 2 cp and 2 cp + 1 of rows [32 h, 32 h + 32):
// two 16-row blocks, so e and f (which only depend on G inside a block) need nothing from the other
// half; only the block-end values r_b of the second half get the first half's total added.
template <bool kGateInKernel, bool kL2Norm>
__device__ __forceinline__ void intra_prepare_operands(const KdaPrefillParams& p, StageStorage& st, float* rnorm,
                                                       float* row_stats,
                                                       int rows, float gate_scale, float2 gate_bias, int tid) {
  // Row statistics: thread (half, r) reads features [64 half, 64 half + 64) of row r of q and of k
  // and sums q.q, k.k and q.k over them; the halves are added through shared memory. The same
  // pass scales row r of v by beta_r.
  {
    const int r = tid & 63, half = tid >> 6;
    const uint8_t* q_row = st.q + half * kBoxBytes;
    const uint8_t* k_row = st.k + half * kBoxBytes;
    uint8_t* v_row = st.v + half * kBoxBytes;
    const float beta = st.beta[r];
    // Every load of the row first: the stores of beta*v below could alias later loads as far as
    // the compiler knows, so loads interleaved with them would each wait for the previous store.
    uint4 qraw[8], kraw[8], vraw[8];
#pragma unroll
    for (int x = 0; x < 8; ++x) {
      qraw[x] = *reinterpret_cast<const uint4*>(q_row + sw128_chunk_offset(r, x));
      kraw[x] = *reinterpret_cast<const uint4*>(k_row + sw128_chunk_offset(r, x));
      vraw[x] = *reinterpret_cast<const uint4*>(v_row + sw128_chunk_offset(r, x));
    }
    float qq = 0.f, kk = 0.f, qk = 0.f;
#pragma unroll
    for (int x = 0; x < 8; ++x) {
      // v <- beta v (the right-hand operand of U = M (beta v)), 16 bytes at a time.
      uint32_t* vw = reinterpret_cast<uint32_t*>(&vraw[x]);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float2 f = bf16x2_to_float2(vw[u]);
        vw[u] = float2_to_bf16x2(f.x * beta, f.y * beta);
      }
      *reinterpret_cast<uint4*>(v_row + sw128_chunk_offset(r, x)) = vraw[x];
      const uint32_t qw[4] = {qraw[x].x, qraw[x].y, qraw[x].z, qraw[x].w};
      const uint32_t kw[4] = {kraw[x].x, kraw[x].y, kraw[x].z, kraw[x].w};
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float2 a = bf16x2_to_float2(qw[u]), b = bf16x2_to_float2(kw[u]);
        qk = fmaf(a.x, b.x, fmaf(a.y, b.y, qk));
        if constexpr (kL2Norm) {
          qq = fmaf(a.x, a.x, fmaf(a.y, a.y, qq));
          kk = fmaf(b.x, b.x, fmaf(b.y, b.y, kk));
        }
      }
    }
    row_stats[(0 * 2 + half) * kChunk + r] = qq;
    row_stats[(1 * 2 + half) * kChunk + r] = kk;
    row_stats[(2 * 2 + half) * kChunk + r] = qk;
    named_barrier_sync(NamedBarrierId::kIntra, 128);
    if (tid < kChunk) {
      float rq = 1.f, rk = 1.f;
      if constexpr (kL2Norm) {
        rq = rsqrtf(row_stats[0 * kChunk + r] + row_stats[1 * kChunk + r] + kL2NormEps);
        rk = rsqrtf(row_stats[2 * kChunk + r] + row_stats[3 * kChunk + r] + kL2NormEps);
        rnorm[r] = rq;
        rnorm[kChunk + r] = rk;
      }
      // A_qk[i, i] = q_i . k_i exactly (the decays cancel), in fp32 from the loaded rows; the state
      // warpgroups apply it in fp32 (see state_math.cuh). From the rescaled bf16 operands it would
      // carry their rounding, amplified by the cancellation in a dot product of two unit vectors,
      // and stored as bf16 it would scale a whole output row by one rounding error: for a
      // one-token sequence that term is the whole output.
      st.aqk_diag[r] = r < rows ? (row_stats[4 * kChunk + r] + row_stats[5 * kChunk + r]) * rq * rk : 0.f;
    }
    named_barrier_sync(NamedBarrierId::kIntra, 128);
  }

  const int h = tid >> 6, cp = tid & 63, col = 2 * cp;
  const PairColumn addr(cp);
  float cum0 = 0.f, cum1 = 0.f;
  float rb_local[2][2];
#pragma unroll
  for (int bb = 0; bb < 2; ++bb) {
    const int row0 = 32 * h + kSubBlock * bb;
    // All loads of the block first (one warp per scheduler: only independent loads hide latency).
    uint32_t gx[kSubBlock], qx[kSubBlock], kx[kSubBlock];
#pragma unroll
    for (int ii = 0; ii < kSubBlock; ++ii) {
      const uint32_t off = addr(row0 + ii);
      gx[ii] = ld_bf16x2(st.g, off);
      qx[ii] = ld_bf16x2(st.q, off);
      kx[ii] = ld_bf16x2(st.k, off);
    }
    float G0[kSubBlock], G1[kSubBlock];
#pragma unroll
    for (int ii = 0; ii < kSubBlock; ++ii) {
      const float2 x = bf16x2_to_float2(gx[ii]);
      float g0, g1;
      if constexpr (kGateInKernel) {  // lower_bound * sigmoid(scale * (g + dt_bias))
        const float y0 = (x.x + gate_bias.x) * gate_scale, y1 = (x.y + gate_bias.y) * gate_scale;
        g0 = __fdividef(p.lower_bound * kLog2e, 1.f + fast_exp2(-y0 * kLog2e));
        g1 = __fdividef(p.lower_bound * kLog2e, 1.f + fast_exp2(-y1 * kLog2e));
      } else {
        g0 = x.x * kLog2e;
        g1 = x.y * kLog2e;
      }
      const bool valid = row0 + ii < rows;
      cum0 += valid ? g0 : 0.f;
      cum1 += valid ? g1 : 0.f;
      G0[ii] = cum0;
      G1[ii] = cum1;
    }
    rb_local[bb][0] = cum0;
    rb_local[bb][1] = cum1;
    // The l2-norm reciprocals of four rows at a time as one 16-byte load: the stores below could
    // alias them as far as the compiler knows, so each load waits for the stores before it.
    float4 rq4 = make_float4(1.f, 1.f, 1.f, 1.f), rk4 = rq4;
#pragma unroll
    for (int ii = 0; ii < kSubBlock; ++ii) {
      const int i = row0 + ii;
      const float d0 = G0[ii] - cum0, d1 = G1[ii] - cum1;  // >= 0
      const float e0 = fast_exp2(d0), e1 = fast_exp2(d1);
      const float f0 = fast_exp2(-d0), f1 = fast_exp2(-d1);
      float2 qv = bf16x2_to_float2(qx[ii]), kv = bf16x2_to_float2(kx[ii]);
      if constexpr (kL2Norm) {
        if (ii % 4 == 0) {
          rq4 = *reinterpret_cast<const float4*>(rnorm + i);
          rk4 = *reinterpret_cast<const float4*>(rnorm + kChunk + i);
        }
        const float rq = ii % 4 == 0 ? rq4.x : ii % 4 == 1 ? rq4.y : ii % 4 == 2 ? rq4.z : rq4.w;
        const float rk = ii % 4 == 0 ? rk4.x : ii % 4 == 1 ? rk4.y : ii % 4 == 2 ? rk4.z : rk4.w;
        qv = make_float2(qv.x * rq, qv.y * rq);
        kv = make_float2(kv.x * rk, kv.y * rk);
      }
      if (i >= rows) qv = kv = make_float2(0.f, 0.f);
      const uint32_t off = addr(i);
      st_bf16x2(st.q, off, qv.x * e0, qv.y * e1);
      st_bf16x2(st.k, off, kv.x * e0, kv.y * e1);
      st_bf16x2(st.g, off, kv.x * f0, kv.y * f1);
    }
  }
  // Block-end cumulative decays: the second half adds the first half's total (r_1).
  if (h == 0) {
#pragma unroll
    for (int bb = 0; bb < 2; ++bb) *reinterpret_cast<float2*>(&st.r_block[bb][col]) = make_float2(rb_local[bb][0], rb_local[bb][1]);
  }
  named_barrier_sync(NamedBarrierId::kIntra, 128);
  if (h == 1) {
    const float2 off = *reinterpret_cast<const float2*>(&st.r_block[1][col]);
#pragma unroll
    for (int bb = 0; bb < 2; ++bb)
      *reinterpret_cast<float2*>(&st.r_block[2 + bb][col]) = make_float2(rb_local[bb][0] + off.x, rb_local[bb][1] + off.y);
  }
  fence_smem_to_async_proxy();
  named_barrier_sync(NamedBarrierId::kIntra, 128);
}

// Step 4: A_qk and A_kk accumulators, [bj][8] each (m64n16 fragments).
__device__ __forceinline__ void intra_attention_matrices(const StageStorage& st, int warp, int lane,
                                                         float (&aqk)[kNumSubBlocks][8],
                                                         float (&akk)[kNumSubBlocks][8]) {
  const uint32_t q_base = smem_u32(st.q), k_base = smem_u32(st.k), kt_base = smem_u32(st.g);
  const int lm_row = kSubBlock * warp + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int lm_hi = (lane >> 4) & 1;
  const int t4 = lane & 3;

#pragma unroll
  for (int bj = 0; bj < kNumSubBlocks; ++bj) {
#pragma unroll
    for (int r = 0; r < 8; ++r) aqk[bj][r] = akk[bj][r] = 0.f;
  }

#pragma unroll 1
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    const uint32_t box_off = (ks >> 2) * kBoxBytes;
    const uint32_t lm_off = box_off + sw128_chunk_offset(lm_row, (ks & 3) * 2 + lm_hi);
    uint32_t qf[4], kf[4];
    ldmatrix_x4(q_base + lm_off, qf);
    ldmatrix_x4(k_base + lm_off, kf);

    // Features of this thread's fragment: c0, c0+1 (regs 0, 1) and c0+8, c0+9 (regs 2, 3).
    const int c0 = ks * 16 + 2 * t4;
    const float rw0 = st.r_block[warp][c0], rw1 = st.r_block[warp][c0 + 1];
    const float rw8 = st.r_block[warp][c0 + 8], rw9 = st.r_block[warp][c0 + 9];

    uint32_t qa[kNumSubBlocks][4], ka[kNumSubBlocks][4];
#pragma unroll
    for (int bj = 0; bj < kNumSubBlocks; ++bj) {
      // Column block bj < warp: rescale by exp2(r_w - r_bj); bj == warp: as is; bj > warp: zero.
      float s0 = 0.f, s1 = 0.f, s8 = 0.f, s9 = 0.f;
      if (bj < warp) {
        s0 = fast_exp2(rw0 - st.r_block[bj][c0]);
        s1 = fast_exp2(rw1 - st.r_block[bj][c0 + 1]);
        s8 = fast_exp2(rw8 - st.r_block[bj][c0 + 8]);
        s9 = fast_exp2(rw9 - st.r_block[bj][c0 + 9]);
      } else if (bj == warp) {
        s0 = s1 = s8 = s9 = 1.f;
      }
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float sa = r < 2 ? s0 : s8, sb = r < 2 ? s1 : s9;
        const float2 qv = bf16x2_to_float2(qf[r]);
        const float2 kv = bf16x2_to_float2(kf[r]);
        qa[bj][r] = float2_to_bf16x2(qv.x * sa, qv.y * sb);
        ka[bj][r] = float2_to_bf16x2(kv.x * sa, kv.y * sb);
      }
    }

#pragma unroll
    for (int bj = 0; bj < kNumSubBlocks; ++bj) {
      fence_accumulators(aqk[bj]);
      fence_accumulators(akk[bj]);
    }
    wgmma_fence();
#pragma unroll
    for (int bj = 0; bj < kNumSubBlocks; ++bj) {
      const uint64_t db = desc_k_major(kt_base + box_off + bj * (kSubBlock * 128) + (ks & 3) * 32);
      wgmma_rs_n16(qa[bj], db, aqk[bj], true);
      wgmma_rs_n16(ka[bj], db, akk[bj], true);
    }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int bj = 0; bj < kNumSubBlocks; ++bj) {
      fence_fragment(qa[bj]);
      fence_fragment(ka[bj]);
      fence_accumulators(aqk[bj]);
      fence_accumulators(akk[bj]);
    }
  }
}

// Writes a 64 x N fp32 accumulator (m64nN fragment) as bf16 into a SW128 tile.
template <int N>
__device__ __forceinline__ void store_accumulator_bf16(uint8_t* tile, const float (&acc)[N / 2], int warp, int lane,
                                                       int col_offset) {
  const int g4 = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int n8 = 0; n8 < N / 8; ++n8) {
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const int i = kSubBlock * warp + g4 + 8 * h2;
      const int n = col_offset / 8 + n8;  // 8-column group across the two boxes
      *reinterpret_cast<uint32_t*>(tile + (n >> 3) * kBoxBytes + sw128_fragment_offset(i, n & 7, g4, t4)) =
          float2_to_bf16x2(acc[n8 * 4 + h2 * 2], acc[n8 * 4 + h2 * 2 + 1]);
    }
  }
}

// Steps 1-8 on the stage of one chunk with `rows` valid rows. kFoldDecay (cooperative helpers):
// step 6 also rescales KT to KT' = k exp2(G_last - G) = KT exp2(r_3 - r_b) (<= 1), so that the
// owner's state update is one batch of products instead of four Horner steps (state_math.cuh).
template <bool kGateInKernel, bool kL2Norm, bool kFoldDecay = false>
__device__ __forceinline__ void intra_chunk(const KdaPrefillParams& p, SharedStorage& smem, StageStorage& st, int rows,
                                            float gate_scale, float2 gate_bias, int tid, PhaseTimer& timer) {
  const int warp = tid >> 5, lane = tid & 31;
  const int g4 = lane >> 2, t4 = lane & 3;
  float* rnorm = reinterpret_cast<float*>(smem.intra_scratch + kRnormOffset);
  float* row_stats = reinterpret_cast<float*>(smem.intra_scratch + kRowStatsOffset);
  float* diag = reinterpret_cast<float*>(smem.intra_scratch + kDiagOffset);
    intra_prepare_operands<kGateInKernel, kL2Norm>(p, st, rnorm, row_stats, rows, gate_scale, gate_bias, tid);
    timer.mark(1);

    float aqk[kNumSubBlocks][8], akk[kNumSubBlocks][8];
    intra_attention_matrices(st, warp, lane, aqk, akk);
    timer.mark(2);

    // Step 5: masks and beta. A_qk -> stage (bf16, strictly lower: its diagonal is st.aqk_diag);
    // A = beta_i A_kk: its blocks below the diagonal stay in registers (a_off, m64n64
    // accumulator layout) and its diagonal blocks go to the scratch for the forward substitution.
    const float beta_lo = st.beta[kSubBlock * warp + g4];
    const float beta_hi = st.beta[kSubBlock * warp + g4 + 8];
    float a_off[8 * (kNumSubBlocks - 1)];
#pragma unroll
    for (int bj = 0; bj < kNumSubBlocks; ++bj) {
#pragma unroll
      for (int n8 = 0; n8 < 2; ++n8) {
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          const int i = kSubBlock * warp + g4 + 8 * h2;
          const int j = kSubBlock * bj + 8 * n8 + 2 * t4;
          const int r = n8 * 4 + h2 * 2;
          const float bi = h2 ? beta_hi : beta_lo;
          const float q0 = (j < i) ? aqk[bj][r] : 0.f;
          const float q1 = (j + 1 < i) ? aqk[bj][r + 1] : 0.f;
          *reinterpret_cast<uint32_t*>(st.aqk + sw128_offset(i, j, kChunk)) = float2_to_bf16x2(q0, q1);
          const float a0 = (j < i) ? akk[bj][r] * bi : 0.f;
          const float a1 = (j + 1 < i) ? akk[bj][r + 1] * bi : 0.f;
          if (bj == warp) {  // transposed: row j of the scratch block is column j of A_d
            float* dblock = diag + warp * kDiagBlockFloats + (g4 + 8 * h2);
            dblock[(8 * n8 + 2 * t4) * kDiagLd] = a0;
            dblock[(8 * n8 + 2 * t4 + 1) * kDiagLd] = a1;
          }
          if (bj < kNumSubBlocks - 1) {
            a_off[bj * 8 + r] = bj < warp ? a0 : 0.f;
            a_off[bj * 8 + r + 1] = bj < warp ? a1 : 0.f;
          }
        }
      }
    }
    timer.mark(3);

    named_barrier_sync(NamedBarrierId::kIntra, 128);  // every warp done reading QE/KE (step 4)
    // Step 6: QG = QE * exp2(r_b), KG = beta * KE * exp2(r_b) (v was scaled in step 1); thread
    // owns 2 features x 32 rows. beta goes into the right-hand operands of W and U row by row (rounded
    // per element) rather than into the columns of M (where one bf16 rounding of beta_j would
    // scale everything row j contributes).
    {
      const int h = tid >> 6, cp = tid & 63;
      const PairColumn addr(cp);
#pragma unroll
      for (int bb = 0; bb < 2; ++bb) {
        const int b = 2 * h + bb, row0 = kSubBlock * b;
        const float2 rb = *reinterpret_cast<const float2*>(&st.r_block[b][2 * cp]);
        const float s0 = fast_exp2(rb.x), s1 = fast_exp2(rb.y);
        uint32_t qx[kSubBlock], kx[kSubBlock];
        float betas[kSubBlock];  // loaded before the stores (see intra_prepare_operands)
#pragma unroll
        for (int ii = 0; ii < kSubBlock; ++ii) {
          qx[ii] = ld_bf16x2(st.q, addr(row0 + ii));
          kx[ii] = ld_bf16x2(st.k, addr(row0 + ii));
        }
        if constexpr (kFoldDecay) {  // KT' = KT exp2(r_3 - r_b): both factors <= 1
          const float2 r3 = *reinterpret_cast<const float2*>(&st.r_block[kNumSubBlocks - 1][2 * cp]);
          const float f0 = fast_exp2(r3.x - rb.x), f1 = fast_exp2(r3.y - rb.y);
          uint32_t gx[kSubBlock];
#pragma unroll
          for (int ii = 0; ii < kSubBlock; ++ii) gx[ii] = ld_bf16x2(st.g, addr(row0 + ii));
#pragma unroll
          for (int ii = 0; ii < kSubBlock; ++ii) {
            const float2 kt = bf16x2_to_float2(gx[ii]);
            st_bf16x2(st.g, addr(row0 + ii), kt.x * f0, kt.y * f1);
          }
        }
#pragma unroll
        for (int x = 0; x < kSubBlock / 4; ++x) {
          const float4 b4 = *reinterpret_cast<const float4*>(&st.beta[row0 + 4 * x]);
          betas[4 * x] = b4.x, betas[4 * x + 1] = b4.y, betas[4 * x + 2] = b4.z, betas[4 * x + 3] = b4.w;
        }
#pragma unroll
        for (int ii = 0; ii < kSubBlock; ++ii) {
          const float beta = betas[ii];
          const float2 qv = bf16x2_to_float2(qx[ii]), kv = bf16x2_to_float2(kx[ii]);
          st_bf16x2(st.q, addr(row0 + ii), qv.x * s0, qv.y * s1);
          st_bf16x2(st.k, addr(row0 + ii), kv.x * (s0 * beta), kv.y * (s1 * beta));
        }
      }
    }
    timer.mark(4);
    // Step 7: M = (I + A)^-1 (unit_lower_inverse.cuh), all products on the tensor cores. Its first
    // proxy fence and barrier also publish QG/KG to the W/U products below.
    float m[32];
    invert_unit_lower(a_off, diag, smem.inverse_operand, tid, m, timer);
    timer.mark(5);

    // Step 8: W = M KG -> k slot, U = M (beta v) -> v slot; M is the A operand straight from the
    // inverse's accumulator (the bf16 m64k16 fragment of k-step ks is accumulator columns
    // 16 ks .. 16 ks + 15 of the thread's two rows).
    uint32_t m_frag[kChunk / 16][4];
#pragma unroll
    for (int ks = 0; ks < kChunk / 16; ++ks)
#pragma unroll
      for (int r = 0; r < 4; ++r) m_frag[ks][r] = float2_to_bf16x2(m[8 * ks + 2 * r], m[8 * ks + 2 * r + 1]);
#pragma unroll 1
    for (int which = 0; which < 2; ++which) {
      uint8_t* slot = which == 0 ? st.k : st.v;
      const uint32_t b_base = smem_u32(slot);
      float acc[64];
#pragma unroll
      for (int r = 0; r < 64; ++r) acc[r] = 0.f;
      fence_accumulators(acc);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kChunk / 16; ++ks)
        wgmma_rs<128, Major::MN>(m_frag[ks], desc_mn_major(b_base + ks * 16 * 128, kBoxBytes), acc, true);
      wgmma_commit();
      wgmma_wait<0>();
      fence_accumulators(acc);
      named_barrier_sync(NamedBarrierId::kIntra, 128);  // whole warpgroup done reading the slot
      store_accumulator_bf16<128>(slot, acc, warp, lane, 0);
    }
}

// Gate parameters of value head hv (gate in kernel): scale exp(A_log[hv]), bias dt_bias[hv] of the
// thread's feature pair (tid % 64).
template <bool kGateInKernel>
__device__ __forceinline__ void gate_parameters(const KdaPrefillParams& p, int v_head, int tid, float& gate_scale,
                                                float2& gate_bias) {
  gate_scale = 1.f;
  gate_bias = make_float2(0.f, 0.f);
  if constexpr (kGateInKernel) {
    if (p.A_log != nullptr) gate_scale = expf(p.A_log[v_head]);
    if (p.dt_bias != nullptr) gate_bias = *reinterpret_cast<const float2*>(p.dt_bias + v_head * kHeadDim + 2 * (tid & 63));
  }
}

// kChunkSlots: a helper of the cooperative mode (chunk_workspace.cuh): the producer announces each
// chunk's row count and value head in its stage (rows -1: none left) instead of the warpgroup
// walking tiles, and the storer takes the finished stage.
template <bool kGateInKernel, bool kL2Norm, bool kLongestFirst, bool kChunkSlots>
__device__ __forceinline__ void run_intra_chunk(const KdaKernelParams& kp, SharedStorage& smem) {
  const KdaPrefillParams& p = kp.problem;
  const int tid = threadIdx.x - first_thread(WarpgroupRole::kIntra);
  PipelineState pipe;
  PhaseTimer timer;
  timer.start();

  if constexpr (kChunkSlots) {
    float gate_scale;
    float2 gate_bias;
    int gate_head = -1;
    for (;; pipe.advance()) {
      StageStorage& st = smem.stage[pipe.stage];
      cutlass::arch::ClusterTransactionBarrier::wait(&smem.full_bar[pipe.stage], pipe.phase);
      const int rows = warp_uniform(st.rows);
      if (rows >= 0) {
        const int v_head = warp_uniform(st.ws_head);
        if (v_head != gate_head) {
          gate_parameters<kGateInKernel>(p, v_head, tid, gate_scale, gate_bias);
          gate_head = v_head;
        }
        timer.mark(0);
        intra_chunk<kGateInKernel, kL2Norm, true>(p, smem, st, rows, gate_scale, gate_bias, tid, timer);
        fence_smem_to_async_proxy();  // the storer's bulk copy reads the stage
      }
      cutlass::arch::ClusterBarrier::arrive(&smem.ready_bar[pipe.stage]);  // to the storer (also the end mark)
      if (rows < 0) break;
      timer.mark(6);
    }
  } else {
    TileCursor cursor;
    for (WorkTile tile; next_tile<kLongestFirst, /*kIsProducer=*/false>(kp, smem, cursor, tile);) {
      float gate_scale;
      float2 gate_bias;
      gate_parameters<kGateInKernel>(p, tile.v_head, tid, gate_scale, gate_bias);
      for (int c = 0; c < tile.num_chunks(); ++c, pipe.advance()) {
        StageStorage& st = smem.stage[pipe.stage];
        const int rows = tile.chunk_rows(c);
        cutlass::arch::ClusterTransactionBarrier::wait(&smem.full_bar[pipe.stage], pipe.phase);
        timer.mark(0);
        intra_chunk<kGateInKernel, kL2Norm>(p, smem, st, rows, gate_scale, gate_bias, tid, timer);
        // Step 9: hand the stage to the state warpgroups.
        fence_smem_to_async_proxy();
        cutlass::arch::ClusterBarrier::arrive(&smem.ready_bar[pipe.stage]);
        timer.mark(6);
      }
    }
  }
  timer.report("intra: wait prep attn mask qg+kg inv:M wu inv:D inv:N inv:N2,Y", tid);
}

}  // namespace cula::kda::sm90
