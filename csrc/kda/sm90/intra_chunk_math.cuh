// Intra-chunk warpgroup: everything of a chunk that does not depend on the recurrent state.
//
// For chunk c it runs while the state warpgroups work on chunk c-1 (the stages of the ring are
// the hand-off). Per chunk (64 rows i, 128 features, one value head), in log2 units:
//
//   1. per row: l2 norms of q and k (optional), q.k in fp32 -> rnorm, A_qk[i,i]
//   2. gate activation and per-feature cumsum G_i over the chunk, one feature per thread;
//      rows past the sequence end hold q = k = 0 and a no-decay gate (written over the loaded
//      values first, last chunk only), so G stops there                   -> r_b = G at block ends
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
//      of WGMMA products (unit_lower_inverse.cuh: fp16 operands with l2norm, except in the
//      one-kernel cooperative form's helpers, tf32 otherwise; see step 7 below); M ends up in
//      accumulator registers
//   8. fused kernels: M - I -> the M tile (bf16); the state warpgroups fold M into their chain,
//      v_new = M (beta v - KG S), so KG and v stay in their slots (state_math.cuh).
//      cooperative helpers: W = M KG -> k slot,  U = ((M - I) diag(beta)) v + beta v -> v slot
//      (WGMMA, A operands from the inverse's registers; the diagonal term in fp32: beta v is
//      never rounded to bf16)
//   9. arrive on the stage's `ready` barrier.
#pragma once

#include "kda_prefill_sm90.h"
#include "kernel_params.cuh"
#include "shared_storage.cuh"
#include "sm90_primitives.cuh"
#include "tile_scheduler.cuh"
#include "unit_lower_inverse.cuh"

namespace cula::kda::sm90 {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kL2NormEps = 1e-6f;
// General gates (safe_gate=False: decays unbounded below), docs/kernel.md "General gates":
// log2 decays are floored here (a -inf channel still resets: exp2(-200) is 0 in float32, while
// every difference of cumulative sums stays finite), and a (16-row block, feature) whose decay
// over the block exceeds kWideSpanLog2 is "wide": its diagonal-block terms are computed exactly
// (wide_diagonal_terms: each pair factored through its own split row, on the tensor cores)
// instead of through the block-end factorisation (whose e = exp2(G - r_b) would overflow). Same
// floor as cula/kda/reference.py (GATE_FLOOR_LOG2).
constexpr float kGateFloorLog2 = -200.f;
constexpr float kWideSpanLog2 = 100.f;
// General gates with l2-normalised q and k (half_operands): the A products take fp16 operands,
// 3 more mantissa bits than bf16. With slowly decaying heads the off-diagonal A_qk terms carry the
// output, and their bf16 operands QE, KT set o's error (scripts/error_budget.py --draw softplus:
// o ~3.1e-3 with bf16, ~2.0e-3 with fp16 on heads with exp(A_log) = 0.05-0.2). fp16's range is
// the price: a (block, feature) whose decay span exceeds kHalfSpanLog2 is wide (exact diagonal
// terms, every factor <= 1), and the others store QE = q e 2^-7, KE = k e 2^-7, KT = k f 2^7:
// with |q|, |k| <= 1 (l2norm) and e, f within [2^-14, 2^14] all three lie within [|x| 2^-7, 2^7],
// fp16's normal range for all but tiny elements, and the scale pairs exp2(r_w - r_bj) of adjacent
// blocks stay >= 2^-14 (normal). Products QE KT^T are unchanged by the 2^-7 / 2^7 split; step 6
// undoes it for QG, KG (from exp2(ref + 7)) and leaves KT in fp16: the fused kernels' state update
// takes it so, with the fp16 v_new' of A_qk v_new and S scaled by the power of two that cancels
// both shifts (state_math.cuh, step (e); scripts/error_budget.py: kt_s, vnew_s), and the
// cooperative helpers turn it into KT' (fp16 too). The type is fixed per instantiation (the
// safe-gate and no-l2norm kernels keep bf16 and the 100-log2 threshold): a per-chunk type choice
// cost the safe-gate rows 2-10 % (docs/perf-notes.md, "narrow chunks").
constexpr float kHalfSpanLog2 = 14.f;
constexpr float kHalfShiftLog2 = 7.f;
constexpr bool half_operands(Decays decays, bool l2norm) { return decays != Decays::kSafe && l2norm; }
constexpr float wide_span_log2(bool half) { return half ? kHalfSpanLog2 : kWideSpanLog2; }

// The shared memory one intra-chunk warpgroup works in besides its stage. The fused kernel and a
// cooperative helper's first intra warpgroup use SharedStorage's intra fields; a helper's second
// intra warpgroup (kp.coop.helper_intra == 2) uses the state warpgroups' tiles, which a helper
// never touches (its state warpgroups only host the storer thread). The named barrier is the
// warpgroup's own, so two intra warpgroups never wait for each other.
struct IntraScratch {
  uint8_t* inverse_operand;   // kTileBytes, 1024-aligned: the inverse's B operands (and the wide corrections)
  float (*a_ref)[kHeadDim];   // [kNumSubBlocks][kHeadDim]: general gates' factor references
  uint8_t* scratch;           // 8 KB: kRnormOffset, kRowStatsOffset, kDiagOffset, the wide staging
  NamedBarrierId bar;
};
static_assert(sizeof(SharedStorage::state_bf16[0]) >= kTileBytes && sizeof(SharedStorage::state_bf16[1]) >= 8192 &&
                  sizeof(SharedStorage::v_new[0]) >= kNumSubBlocks * kHeadDim * sizeof(float) &&
                  sizeof(SharedStorage::intra_scratch) == 8192,
              "a helper's second intra warpgroup works in the state warpgroups' tiles");
// which = 0: the intra fields (every kernel); 1: the second intra warpgroup of a cooperative helper.
__device__ __forceinline__ IntraScratch intra_scratch_of(SharedStorage& smem, int which) {
  if (which == 0) return {smem.inverse_operand, smem.a_ref, smem.intra_scratch, NamedBarrierId::kIntra};
  return {smem.state_bf16[0], reinterpret_cast<float (*)[kHeadDim]>(smem.v_new[0]), smem.state_bf16[1],
          NamedBarrierId::kHelperIntra1};
}

// Exact diagonal-block terms of wide features (general gates), per (block, warp of the pair that
// holds the block's rows, which: 0 A_qk, 1 A_kk): the warp's partial sum over its 64 features,
// float [4 blocks][2 warps][2][16 i][16 j] = 16 KB in the inverse's operand buffer (the
// intra-chunk warpgroup's own prep; prep ahead: chunk_prep.cuh), which is free from the prep until step 7 (its last reader, the previous chunk's inverse, waited for its
// WGMMAs). Step 5 adds the two partials in a fixed order (no atomics: deterministic). Every
// entry j < i is written for every chunk (zeros where the warp has no wide pair); entries j >= i
// are never written and step 5 discards them by select.
__device__ __forceinline__ float* wide_corrections(const IntraScratch& ws, int block, int warp_of_half, int which) {
  return reinterpret_cast<float*>(ws.inverse_operand) + ((block * 2 + warp_of_half) * 2 + which) * 256;
}
static_assert(4 * 2 * 2 * 256 * 4 == kTileBytes, "the corrections fill the inverse's operand buffer");


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

// Staging of the exact pass's tensor-core operands, per warp: 24 rows of the warp's 64 features
// (bf16, 128 bytes per row, 16-byte chunks XOR-swizzled by row so that ldmatrix is conflict-free):
// rows 0-7 KX of a level's upper rows, 8-15 QX of the same rows, 16-23 KX of its lower rows.
// In the intra-chunk warpgroup's own prep (prep ahead: chunk_prep.cuh) warps 0, 1 use the stage's
// A_qk tile and warps 2, 3 the intra scratch past the l2-norm
// reciprocals: both are free during the prep (A_qk is written in step 5; the row statistics
// there are dead once the reciprocals exist).
constexpr int kWideStagingBytes = 24 * 128;
constexpr int kWideStagingOffset = 1024;  // in intra_scratch, past rnorm (float[128])
static_assert(2 * kWideStagingBytes <= kChunk * kChunk * 2, "staging of warps 0, 1 must fit in the A_qk tile");
static_assert(kWideStagingOffset >= 128 * 4 && kWideStagingOffset + 2 * kWideStagingBytes <= 8192,
              "staging of warps 2, 3 must fit in the intra scratch past rnorm");
__device__ __forceinline__ uint32_t wide_staging(const IntraScratch& ws, StageStorage& st, int warp) {
  return warp < 2 ? smem_u32(st.aqk + warp * kWideStagingBytes)
                  : smem_u32(ws.scratch + kWideStagingOffset + (warp - 2) * kWideStagingBytes);
}
__device__ __forceinline__ uint32_t wide_staging_offset(int row, int chunk) {
  return uint32_t(row * 128 + ((chunk ^ (row & 7)) << 4));
}

// Exact diagonal-block terms of the wide features of one 16-row block, on the tensor cores.
// For j < i inside the block the term is q_i k_j exp2(G_i - G_j) (and k_i k_j ...), which the
// block-end factorisation cannot carry when the block's decay span exceeds the exponent range.
// Split the block's rows recursively in halves (levels of 8, 4, 2, 1 rows): every pair j < i is
// split at exactly one level, with j in the lower half and i in the upper half of one group, and
// there it factors through the group's boundary row m (the lower half's last row):
//   exp2(G_i - G_j) = exp2(G_i - G_m) * exp2(G_m - G_j),   both factors <= 1 for any decays,
// so nothing overflows and an underflow to 0 only drops a term below 2^-126. Per level one
// m16n8k16 product per 16 features gives both matrices: A = [KX; QX] of the 8 upper rows
// (scaled by exp2(G_i - G_m)), B = KX of the 8 lower rows (scaled by exp2(G_m - G_j)); entries
// of pairs from different groups are dropped. The factors are running products of the per-token
// decays d_t = exp2(G_t - G_{t-1}) (one exp2 per element, not one per level). Non-wide features
// are masked to 0 here: the main A products carry them.
// Lane: features 2 cp, 2 cp + 1 (cp = tid % 64) of the block's 16 rows (G0/G1: cumulative log2
// decays from any origin, qx/kx: raw bf16 pairs). Writes the warp's partials to corr_qk and
// corr_kk = corr_qk + 256 (wide_corrections), staging its operands at `stg` (kWideStagingBytes).
template <bool kL2Norm>
__device__ __forceinline__ void wide_diagonal_terms(float* corr_qk, uint32_t stg, const float (&G0)[kSubBlock],
                                                    const float (&G1)[kSubBlock], const uint32_t (&qx)[kSubBlock],
                                                    const uint32_t (&kx)[kSubBlock], bool w0, bool w1,
                                                    const float* rnorm, int block, int tid) {
  const int lane = tid & 31, g4 = lane >> 2, t4 = lane & 3;
  float* corr_kk = corr_qk + 256;
  static_assert(kSubBlock == 16, "the exact pass splits 16-row blocks");
  if (!__any_sync(0xffffffffu, w0 || w1)) {  // no wide pair in the warp: its partials are 0
    float4* z = reinterpret_cast<float4*>(corr_qk);  // corr_kk follows corr_qk (512 floats)
#pragma unroll
    for (int x = 0; x < 4; ++x) z[lane + 32 * x] = make_float4(0.f, 0.f, 0.f, 0.f);
    return;
  }
  const uint32_t keep = (w0 ? 0x0000ffffu : 0u) | (w1 ? 0xffff0000u : 0u);  // the wide features
  float d0[kSubBlock], d1[kSubBlock];
#pragma unroll
  for (int t = 1; t < kSubBlock; ++t) {
    d0[t] = fast_exp2(G0[t] - G0[t - 1]);
    d1[t] = fast_exp2(G1[t] - G1[t - 1]);
  }
  const int lm_row = lane & 7, lm_sel = lane >> 3;     // ldmatrix: row within a matrix, matrix
  // The four levels unrolled: with the level known at compile time the row bookkeeping below
  // (which rows are upper, their staging rows, where a running product restarts) folds away;
  // as a runtime loop it cost ~1.2k instructions per level instead of ~0.2k (ncu). The caller's
  // loop over blocks is not unrolled, so this code exists once.
  // Software-pipelined: a level's products are written out only after the next level's staging,
  // so that the staging's ~100 instructions run while the products' MMA chain completes (the
  // pass is latency-bound: ~1k cycles per level at ~0.15k instructions, docs/perf-notes.md), and
  // each level's four products form two chains of two (two accumulators, added at the write).
  float acc_lo[4], acc_hi[4];  // the last level's partial products (k-steps 0 and 1 of each pair)
  const auto write_level = [&](int lv) {
    const int lh = 3 - lv, half = 1 << lh;
    // Lane (g4, t4): upper row u = g4 against lower rows c = 2 t4, 2 t4 + 1; a pair from two
    // different groups of this level belongs to an earlier level and is dropped.
    const int i = ((g4 >> lh) << (lh + 1)) + half + (g4 & (half - 1));
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int c = 2 * t4 + e;
      if ((g4 >> lh) == (c >> lh)) {
        const int j = ((c >> lh) << (lh + 1)) + (c & (half - 1));
        float sq = 1.f, sk = 1.f;
        if constexpr (kL2Norm) {
          const float rkj = rnorm[kChunk + kSubBlock * block + j];
          sq = rnorm[kSubBlock * block + i] * rkj;
          sk = rnorm[kChunk + kSubBlock * block + i] * rkj;
        }
        corr_kk[i * kSubBlock + j] = (acc_lo[e] + acc_hi[e]) * sk;
        corr_qk[i * kSubBlock + j] = (acc_lo[2 + e] + acc_hi[2 + e]) * sq;
      }
    }
  };
#pragma unroll
  for (int level = 0; level < 4; ++level) {
    const int lh = 3 - level, half = 1 << lh;  // rows per half-group: 8, 4, 2, 1
    __syncwarp();  // the previous level's ldmatrix reads are done before the staging is rewritten
    float run0 = 1.f, run1 = 1.f;
    // Staged four rows at a time by stmatrix (.trans): lane (g4, t4)'s pair of a row, features
    // 2 p and 2 p + 1 (p = lane), lands in 16-byte chunks 2 t4 and 2 t4 + 1 of that row as element
    // g4, so chunk j holds features 8 e + j (e = 0..7): the same permutation of the 64 features for
    // A and B, so the products are the same sums over features (in another fp32 order: the two
    // accumulators now take features {0, 1, 8, 9, ...} and the rest, deterministic but not
    // bitwise the same as the 4-byte staging's). One STSM per four rows instead
    // of four 4-byte stores; lane 8 m + j gives the address of chunk j of the m-th row.
    uint32_t up_k[8], up_q[8], low_k[8];
    const auto stage4 = [&](int row0, uint32_t v0, uint32_t v1, uint32_t v2, uint32_t v3) {
      stmatrix_x4_trans(stg + wide_staging_offset(row0 + (lane >> 3), lane & 7), v0, v1, v2, v3);
    };
#pragma unroll
    for (int ii = 1; ii < kSubBlock; ++ii) {  // upper rows (row 0 is always a lower row)
      const bool first = (ii & (half - 1)) == 0;
      run0 = (first ? 1.f : run0) * d0[ii];
      run1 = (first ? 1.f : run1) * d1[ii];
      if (ii & half) {
        const int u = ((ii >> (lh + 1)) << lh) + (ii & (half - 1));  // 0..7 in order of ii
        // Packed: the factor pair rounded to bf16 once, then one bf16x2 multiply per operand (one
        // more 2^-9 rounding of these terms; fewer instructions and registers in this pass).
        const uint32_t r = float2_to_bf16x2(run0, run1);
        up_k[u] = bf16x2_mul(kx[ii] & keep, r);
        up_q[u] = bf16x2_mul(qx[ii] & keep, r);
        if ((u & 3) == 3) {
          stage4(u - 3, up_k[u - 3], up_k[u - 2], up_k[u - 1], up_k[u]);
          stage4(8 + u - 3, up_q[u - 3], up_q[u - 2], up_q[u - 1], up_q[u]);
        }
      }
    }
#pragma unroll
    for (int ii = kSubBlock - 1; ii >= 0; --ii) {  // lower rows (row 15 is always an upper row)
      const bool last = (ii & (half - 1)) == half - 1;  // the boundary row m itself
      if (ii < kSubBlock - 1) {
        run0 = last ? 1.f : run0 * d0[ii + 1];
        run1 = last ? 1.f : run1 * d1[ii + 1];
      }
      if (!(ii & half)) {
        const int u = ((ii >> (lh + 1)) << lh) + (ii & (half - 1));  // 7..0 in order of ii
        low_k[u] = bf16x2_mul(kx[ii] & keep, float2_to_bf16x2(run0, run1));
        if ((u & 3) == 0) stage4(16 + u, low_k[u], low_k[u + 1], low_k[u + 2], low_k[u + 3]);
      }
    }
    if (level > 0) write_level(level - 1);  // the previous level's products, done by now
    __syncwarp();
#pragma unroll
    for (int x = 0; x < 4; ++x) acc_lo[x] = acc_hi[x] = 0.f;  // rows 0-7: A_kk, 8-15: A_qk; columns: lower rows
#pragma unroll
    for (int ks = 0; ks < 4; ks += 2) {  // 16 features per k-step, B for two k-steps per ldmatrix
      uint32_t bf[4], af[4];
      ldmatrix_x4(stg + wide_staging_offset(16 + lm_row, 2 * ks + lm_sel), bf);
      ldmatrix_x4(stg + wide_staging_offset((lm_sel & 1) * 8 + lm_row, 2 * ks + (lm_sel >> 1)), af);
      mma_m16n8k16_bf16(af, bf[0], bf[1], acc_lo);
      ldmatrix_x4(stg + wide_staging_offset((lm_sel & 1) * 8 + lm_row, 2 * ks + 2 + (lm_sel >> 1)), af);
      mma_m16n8k16_bf16(af, bf[2], bf[3], acc_hi);
    }
  }
  write_level(3);
}

// The gate's constants for one value head and the thread's feature pair (tid % 64), folded once
// per chunk: for the lower-bound form exp2(-scale (g + b) log2 e) = exp2(fma(g, slope, icpt)).
struct GateConstants {
  float scale;      // exp(A_log) (1 without A_log)
  float2 bias;      // dt_bias of the pair (0 without it)
  float slope;      // -scale log2(e)
  float2 icpt;      // slope * bias
  float lb_log2;    // lower_bound in log2 units
  __device__ __forceinline__ GateConstants(const KdaPrefillParams& p, float gate_scale, float2 gate_bias)
      : scale(gate_scale), bias(gate_bias), slope(-gate_scale * kLog2e),
        icpt(make_float2(slope * gate_bias.x, slope * gate_bias.y)), lb_log2(p.lower_bound * kLog2e) {}
};

// Log2 decays of one row's feature pair from the loaded raw gate pair (bf16x2): the gate
// activation in kernel, or the given log decays; floored for general gates.
template <bool kGateInKernel, Decays kDecays>
__device__ __forceinline__ void log2_decay_pair(uint32_t graw, const GateConstants& gc, float& g0, float& g1) {
  const float2 x = bf16x2_to_float2(graw);
  if constexpr (kGateInKernel) {
    if constexpr (kDecays == Decays::kGeneralSoftplus) {
      // -exp(A_log) softplus(g + dt_bias), in log2 units: softplus(y) log2(e) =
      // max(y, 0) log2(e) + log2(1 + exp2(-|y| log2(e))). A raw -inf (a row past the end)
      // gives softplus = 0: no decay.
      const float y0 = x.x + gc.bias.x, y1 = x.y + gc.bias.y;
      g0 = -gc.scale * (fmaxf(y0, 0.f) * kLog2e + __log2f(1.f + fast_exp2(-fabsf(y0) * kLog2e)));
      g1 = -gc.scale * (fmaxf(y1, 0.f) * kLog2e + __log2f(1.f + fast_exp2(-fabsf(y1) * kLog2e)));
    } else {
      // lower_bound * sigmoid(scale * (g + b)) in log2 units, with the constants folded. A raw
      // -inf (a row past the end) gives exp2(+inf) = inf and a decay of 0.
      g0 = __fdividef(gc.lb_log2, 1.f + fast_exp2(fmaf(x.x, gc.slope, gc.icpt.x)));
      g1 = __fdividef(gc.lb_log2, 1.f + fast_exp2(fmaf(x.y, gc.slope, gc.icpt.y)));
    }
  } else {
    g0 = x.x * kLog2e;
    g1 = x.y * kLog2e;
  }
  if constexpr (kDecays != Decays::kSafe) {  // -inf (and anything below) -> the floor; NaN stays NaN
    g0 = max_nan(g0, kGateFloorLog2);
    g1 = max_nan(g1, kGateFloorLog2);
  }
}

// Step 2 (the cumsum) for one 16-row block and the thread's feature pair: loads the rows'
// raw q, k and gate pairs (all loads first: with one warp per scheduler only independent loads hide
// latency) and accumulates the log2 decays onto cum0 / cum1, recording G after each row.
template <bool kGateInKernel, Decays kDecays>
__device__ __forceinline__ void load_block_cumsum(const StageStorage& st, const PairColumn& addr, int row0,
                                                  const GateConstants& gc, float& cum0, float& cum1,
                                                  uint32_t (&qx)[kSubBlock], uint32_t (&kx)[kSubBlock],
                                                  float (&G0)[kSubBlock], float (&G1)[kSubBlock]) {
  uint32_t gx[kSubBlock];
#pragma unroll
  for (int ii = 0; ii < kSubBlock; ++ii) {
    const uint32_t off = addr(row0 + ii);
    gx[ii] = ld_bf16x2(st.g, off);
    qx[ii] = ld_bf16x2(st.q, off);
    kx[ii] = ld_bf16x2(st.k, off);
  }
#pragma unroll
  for (int ii = 0; ii < kSubBlock; ++ii) {
    float g0, g1;
    log2_decay_pair<kGateInKernel, kDecays>(gx[ii], gc, g0, g1);
    cum0 += g0;
    cum1 += g1;
    G0[ii] = cum0;
    G1[ii] = cum1;
  }
}

// Step 3 for one 16-row block and the thread's feature pair: QE = q e, KE = k e, KT = k f in
// place over q, k, g, with e = exp2(G - ref) and f = exp2(cum - G). G0/G1: cumulative log2 decays
// of the block's rows and cum0/cum1 the block end's, both from the same origin; ref = cum unless
// the feature is wide (general gates). rnorm: the l2-norm reciprocals (q rows, then k rows).
// kHalf (half_operands): QE, KE, KT in fp16, split by 2^-7 / 2^7 (kHalfSpanLog2 above).
template <bool kGeneral, bool kL2Norm, bool kHalf = false>
__device__ __forceinline__ void store_block_operands(StageStorage& st, const PairColumn& addr, int row0,
                                                     const float (&G0)[kSubBlock], const float (&G1)[kSubBlock],
                                                     float cum0, float cum1, float ref0, float ref1,
                                                     const uint32_t (&qx)[kSubBlock], const uint32_t (&kx)[kSubBlock],
                                                     const float* rnorm) {
  // The l2-norm reciprocals of four rows at a time as one 16-byte load: the stores below could
  // alias them as far as the compiler knows, so each load waits for the stores before it.
  float4 rq4 = make_float4(1.f, 1.f, 1.f, 1.f), rk4 = rq4;
#pragma unroll
  for (int ii = 0; ii < kSubBlock; ++ii) {
    const int i = row0 + ii;
    const float d0 = G0[ii] - cum0, d1 = G1[ii] - cum1;  // >= 0
    // kHalf: e 2^-7 and f 2^7 (exact power-of-two shifts folded into the exponents)
    // (written so that without kHalf the expressions are the bf16 kernels' own: x + 0.f is not x)
    float e0 = kGeneral ? G0[ii] - ref0 : d0, e1 = kGeneral ? G1[ii] - ref1 : d1, f0 = -d0, f1 = -d1;
    if constexpr (kHalf) e0 -= kHalfShiftLog2, e1 -= kHalfShiftLog2, f0 += kHalfShiftLog2, f1 += kHalfShiftLog2;
    e0 = fast_exp2(e0), e1 = fast_exp2(e1), f0 = fast_exp2(f0), f1 = fast_exp2(f1);
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
    const uint32_t off = addr(i);
    if constexpr (kHalf) {
      *reinterpret_cast<uint32_t*>(st.q + off) = float2_to_half2(qv.x * e0, qv.y * e1);
      *reinterpret_cast<uint32_t*>(st.k + off) = float2_to_half2(kv.x * e0, kv.y * e1);
      *reinterpret_cast<uint32_t*>(st.g + off) = float2_to_half2(kv.x * f0, kv.y * f1);
    } else {
      st_bf16x2(st.q, off, qv.x * e0, qv.y * e1);
      st_bf16x2(st.k, off, kv.x * e0, kv.y * e1);
      st_bf16x2(st.g, off, kv.x * f0, kv.y * f1);
    }
  }
}

// Rows past the sequence end (the last chunk of a sequence only; `rows` is the same for the whole
// warpgroup): q = k = 0 and a raw gate that means "no decay" (-inf before the sigmoid of the
// lower-bound form or the softplus form, 0 for given log decays), written over what TMA loaded
// there. Then every pass after it treats all 64 rows alike, without a per-row validity select.
// kThreads threads (tid < kThreads) under named barrier `bar`.
template <bool kGateInKernel, int kThreads>
__device__ __forceinline__ void fill_rows_past_end(StageStorage& st, int rows, NamedBarrierId bar, int tid) {
  if (rows < kChunk) {
    const uint32_t g_fill = kGateInKernel ? 0xff80ff80u : 0u;  // bf16x2 (-inf, -inf) or (0, 0)
    for (int x = tid; x < (kChunk - rows) * 16; x += kThreads) {
      const int row = rows + (x >> 4), chunk = x & 15;  // 16-byte chunk: box chunk / 8
      const uint32_t off = uint32_t((chunk >> 3) * kBoxBytes) + sw128_chunk_offset(row, chunk & 7);
      *reinterpret_cast<uint4*>(st.q + off) = make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4*>(st.k + off) = make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4*>(st.g + off) = make_uint4(g_fill, g_fill, g_fill, g_fill);
    }
    named_barrier_sync(bar, kThreads);
  }
}

// Row statistics (step 1): thread (part, r), part = tid / 64, sums q.q, k.k and q.k of row r over
// features [128 / kParts * part, ...) of q and k; row_stats holds [3][kParts][64] partial sums,
// added in part order by threads 0..63, which write the l2-norm reciprocals (rnorm: q rows, then
// k rows) and A_qk's diagonal into the stage. (v stays as loaded: beta enters U in step 8.)
// kParts (default: one per 64 threads) may be twice that: each thread then sums two parts in
// turn, in the same order as twice the threads would (the pair form's prep warpgroup takes the
// fused kernel's four parts: bitwise its statistics).
template <bool kL2Norm, int kThreads, int kParts = kThreads / kChunk>
__device__ __forceinline__ void row_statistics(StageStorage& st, float* rnorm, float* row_stats, int rows,
                                               NamedBarrierId bar, int tid) {
  constexpr int kChunksPerPart = 16 / kParts;  // 16-byte chunks of a row per part
  constexpr int kPartsPerThread = kParts * kChunk / kThreads;
  static_assert(kParts == 2 || kParts == 4, "two or four parts");
  static_assert(kPartsPerThread == 1 || kPartsPerThread == 2, "128 or 256 threads");
  const int r = tid & 63;
  const auto sum_part = [&](const int part) {
    const int box = (part * kChunksPerPart) >> 3, chunk0 = (part * kChunksPerPart) & 7;
    const uint8_t* q_row = st.q + box * kBoxBytes;
    const uint8_t* k_row = st.k + box * kBoxBytes;
    uint4 qraw[kChunksPerPart], kraw[kChunksPerPart];
#pragma unroll
    for (int x = 0; x < kChunksPerPart; ++x) {
      qraw[x] = *reinterpret_cast<const uint4*>(q_row + sw128_chunk_offset(r, chunk0 + x));
      kraw[x] = *reinterpret_cast<const uint4*>(k_row + sw128_chunk_offset(r, chunk0 + x));
    }
    float qq = 0.f, kk = 0.f, qk = 0.f;
#pragma unroll
    for (int x = 0; x < kChunksPerPart; ++x) {
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
    row_stats[(0 * kParts + part) * kChunk + r] = qq;
    row_stats[(1 * kParts + part) * kChunk + r] = kk;
    row_stats[(2 * kParts + part) * kChunk + r] = qk;
  };
  if constexpr (kPartsPerThread == 2) {
    // Two parts per thread (the pair form's prep): one copy of the part's code, in a loop. With
    // most SMs fetching, more than ~32-40 KB of hot code per SM halves the instruction supply
    // (docs/perf-notes.md, "Where it stands (e1a6c7a)"): less of it is faster.
#pragma unroll 1
    for (int x = 0; x < 2; ++x) sum_part((tid >> 6) + x * (kThreads / kChunk));
  } else {
    sum_part(tid >> 6);
  }
  named_barrier_sync(bar, kThreads);
  if (tid < kChunk) {
    const auto sum = [&](int stat) {
      float x = row_stats[(stat * kParts) * kChunk + r];
#pragma unroll
      for (int q = 1; q < kParts; ++q) x += row_stats[(stat * kParts + q) * kChunk + r];
      return x;
    };
    float rq = 1.f, rk = 1.f;
    if constexpr (kL2Norm) {
      rq = rsqrtf(sum(0) + kL2NormEps);
      rk = rsqrtf(sum(1) + kL2NormEps);
      rnorm[r] = rq;
      rnorm[kChunk + r] = rk;
    }
    // A_qk[i, i] = q_i . k_i exactly (the decays cancel), in fp32 from the loaded rows; the state
    // warpgroups apply it in fp32 (see state_math.cuh). From the rescaled bf16 operands it would
    // carry their rounding, amplified by the cancellation in a dot product of two unit vectors,
    // and stored as bf16 it would scale a whole output row by one rounding error: for a
    // one-token sequence that term is the whole output.
    st.aqk_diag[r] = r < rows ? sum(2) * rq * rk : 0.f;
  }
  named_barrier_sync(bar, kThreads);
}

// Steps 1-3: l2 norms, gates, cumsum, rescaled operands.
// Thread (h = tid / 64, cp = tid % 64) owns features 2 cp and 2 cp + 1 of rows [32 h, 32 h + 32):
// two 16-row blocks, so e and f (which only depend on G inside a block) need nothing from the other
// half; only the block-end values r_b of the second half get the first half's total added.
//
// kGeneral (general gates): the gate may be the softplus form, decays are floored, and wide
// (block, feature) pairs store q and k against the block's start instead of its end (both
// factors <= 1), get their diagonal-block terms exactly (wide_corrections), and record their
// reference in a_ref (r_{b-1} instead of r_b) for the A products and step 6.
template <bool kGateInKernel, bool kL2Norm, Decays kDecays = Decays::kSafe>
__device__ __forceinline__ void intra_prepare_operands(const KdaPrefillParams& p, const IntraScratch& ws,
                                                       StageStorage& st, float* rnorm, float* row_stats,
                                                       float (*a_ref)[kHeadDim], int rows, float gate_scale,
                                                       float2 gate_bias, int tid) {
  constexpr bool kGeneral = kDecays != Decays::kSafe;
  constexpr bool kHalf = half_operands(kDecays, kL2Norm);
  fill_rows_past_end<kGateInKernel, 128>(st, rows, ws.bar, tid);
  row_statistics<kL2Norm, 128>(st, rnorm, row_stats, rows, ws.bar, tid);

  const int h = tid >> 6, cp = tid & 63, col = 2 * cp;
  const PairColumn addr(cp);
  const GateConstants gc(p, gate_scale, gate_bias);
  float cum0 = 0.f, cum1 = 0.f;
  float rb_local[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
  bool wide[2][2] = {{false, false}, {false, false}};  // general gates: [block of the half][feature]
  // The two blocks of the thread's half in turn. General gates: not unrolled, the body (with the
  // exact pass) is ~2k instructions and that kernel's code exceeded the instruction cache (ncu:
  // instruction-fetch stalls; with the exact pass's levels unrolled inside it, the softplus rows
  // went from ~2.0x to ~1.3x the safe-gate time: docs/perf-notes.md). The safe-gate kernels keep it
  // unrolled, as measured before. rb_local / wide keep compile-time indices (selects on bb).
#pragma unroll(kGeneral ? 1 : 2)
  for (int bb = 0; bb < 2; ++bb) {
    const int row0 = 32 * h + kSubBlock * bb;
    const float start0 = cum0, start1 = cum1;  // cumulative decay before the block (half-local)
    uint32_t qx[kSubBlock], kx[kSubBlock];
    float G0[kSubBlock], G1[kSubBlock];
    load_block_cumsum<kGateInKernel, kDecays>(st, addr, row0, gc, cum0, cum1, qx, kx, G0, G1);
    rb_local[0][0] = bb == 0 ? cum0 : rb_local[0][0];
    rb_local[0][1] = bb == 0 ? cum1 : rb_local[0][1];
    rb_local[1][0] = cum0;  // the last iteration's values stay
    rb_local[1][1] = cum1;
    // Reference of each feature's factors: the block's end (e = exp2(G - r_b) >= 1, as with safe
    // gates) or, for a wide feature, its start (exp2(G - r_{b-1}) <= 1).
    float ref0 = cum0, ref1 = cum1;
    bool wide0 = false, wide1 = false;
    if constexpr (kGeneral) {
      wide0 = start0 - cum0 > wide_span_log2(kHalf);
      wide1 = start1 - cum1 > wide_span_log2(kHalf);
      if (wide0) ref0 = start0;
      if (wide1) ref1 = start1;
      wide[0][0] = bb == 0 ? wide0 : wide[0][0];
      wide[0][1] = bb == 0 ? wide1 : wide[0][1];
      wide[1][0] = wide0;
      wide[1][1] = wide1;
    }
    store_block_operands<kGeneral, kL2Norm, kHalf>(st, addr, row0, G0, G1, cum0, cum1, ref0, ref1, qx, kx, rnorm);
    if constexpr (kGeneral) {
      const int warp = tid >> 5;
      wide_diagonal_terms<kL2Norm>(wide_corrections(ws, 2 * h + bb, warp & 1, 0), wide_staging(ws, st, warp), G0, G1,
                                   qx, kx, wide0, wide1, rnorm, 2 * h + bb, tid);
    }
  }
  // Block-end cumulative decays: the second half adds the first half's total (r_1). General
  // gates: a_ref (the reference of each block's factors, see above) in absolute terms.
  if (h == 0) {
#pragma unroll
    for (int bb = 0; bb < 2; ++bb) *reinterpret_cast<float2*>(&st.r_block[bb][col]) = make_float2(rb_local[bb][0], rb_local[bb][1]);
    if constexpr (kGeneral) {
#pragma unroll
      for (int bb = 0; bb < 2; ++bb) {
        const float s0 = bb ? rb_local[0][0] : 0.f, s1 = bb ? rb_local[0][1] : 0.f;  // the block's start
        *reinterpret_cast<float2*>(&a_ref[bb][col]) =
            make_float2(wide[bb][0] ? s0 : rb_local[bb][0], wide[bb][1] ? s1 : rb_local[bb][1]);
      }
    }
  }
  named_barrier_sync(ws.bar, 128);
  if (h == 1) {
    const float2 off = *reinterpret_cast<const float2*>(&st.r_block[1][col]);
#pragma unroll
    for (int bb = 0; bb < 2; ++bb)
      *reinterpret_cast<float2*>(&st.r_block[2 + bb][col]) = make_float2(rb_local[bb][0] + off.x, rb_local[bb][1] + off.y);
    if constexpr (kGeneral) {
#pragma unroll
      for (int bb = 0; bb < 2; ++bb) {
        const float s0 = bb ? rb_local[0][0] + off.x : off.x, s1 = bb ? rb_local[0][1] + off.y : off.y;
        *reinterpret_cast<float2*>(&a_ref[2 + bb][col]) = make_float2(wide[bb][0] ? s0 : rb_local[bb][0] + off.x,
                                                                      wide[bb][1] ? s1 : rb_local[bb][1] + off.y);
      }
    }
  }
  fence_smem_to_async_proxy();
  named_barrier_sync(ws.bar, 128);
}

// The A products' scale pairs of a chunk, bf16x2 exp2(r_w - r_bj) for feature pair cp, at
// [w][bj][cp] (uint32 [4][4][64], 4 KB; only bj < w is written and read), by the 128 threads of a
// warpgroup: 384 entries, three a thread. The same expression as intra_attention_matrices forms
// per k-step (safe gates: the references are r_block), so the products are bitwise the same; each
// pair is formed once instead of by the 8 threads of a warp that share it, in every k-step.
__device__ __forceinline__ void block_scale_pairs(const StageStorage& st, uint32_t* scale_pairs, int tid) {
#pragma unroll
  for (int x = tid; x < 6 * 64; x += 128) {
    const int combo = x >> 6, cp = x & 63, c = 2 * cp;
    // combo 0..5 -> (w, bj) = (1,0) (2,0) (2,1) (3,0) (3,1) (3,2)
    const int w = combo == 0 ? 1 : combo < 3 ? 2 : 3;
    const int bj = combo == 0 ? 0 : combo < 3 ? combo - 1 : combo - 3;
    const float s0 = fast_exp2(st.r_block[w][c] - st.r_block[bj][c]);
    const float s1 = fast_exp2(st.r_block[w][c + 1] - st.r_block[bj][c + 1]);
    scale_pairs[(w * kNumSubBlocks + bj) * 64 + cp] = float2_to_bf16x2(s0, s1);
  }
}

// Step 4: A_qk and A_kk accumulators, [bj][8] each (m64n16 fragments).
// kGeneral: the row block's reference comes from a_ref (r_w, or r_{w-1} for a wide feature, whose
// factor for an earlier block bj is then exp2(r_{w-1} - r_bj) <= 1 and whose diagonal-block
// terms are left to the exact pass: factor 0).
// kHalf (half_operands): QE, KE, KT are fp16, and so are the scale pairs and the products.
// kOneOperand (the pair form, pair_intra_math.cuh): one product only, of `one_operand` (the stage's
// q slot for A_qk or its k slot for A_kk, chosen at run time so that both CTAs of a cluster run
// this same code) into `aqk`; `akk` stays zero.
// kScaleTable (safe gates: the references are r_block; the pair form): the scale pairs come from
// `scale_pairs` (block_scale_pairs above: formed once per chunk by the whole warpgroup) instead of
// each thread forming its own with exp2 in every k-step: B1 T1024 H64 -3..-5 %, 8-16 tiles -7 %
// (docs/perf-notes.md, "Where it stands (sixteenth session)"). The fused kernels keep the
// per-thread form: with the table their rows measured +0.5..+1 % (their intra-chunk warpgroup
// forms both products, so its k-step waits on more WGMMAs than on the exp2s).
template <bool kGeneral = false, bool kHalf = false, bool kOneOperand = false, bool kScaleTable = false>
__device__ __forceinline__ void intra_attention_matrices(const StageStorage& st, const float (*a_ref)[kHeadDim],
                                                         int warp, int lane, float (&aqk)[kNumSubBlocks][8],
                                                         float (&akk)[kNumSubBlocks][8],
                                                         const uint8_t* one_operand = nullptr,
                                                         const uint32_t* scale_pairs = nullptr) {
  constexpr bool kWantQ = true, kWantK = !kOneOperand;
  const uint32_t q_base = smem_u32(kOneOperand ? one_operand : st.q), k_base = smem_u32(st.k),
                 kt_base = smem_u32(st.g);
  const int lm_row = kSubBlock * warp + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int lm_hi = (lane >> 4) & 1;
  const int t4 = lane & 3;

#pragma unroll
  for (int bj = 0; bj < kNumSubBlocks; ++bj) {
#pragma unroll
    for (int r = 0; r < 8; ++r) aqk[bj][r] = akk[bj][r] = 0.f;
  }

  // Operands of k-step ks: the q and k fragments (ldmatrix) and, per column block bj, the packed
  // bf16 scale pairs exp2(r_w - r_bj) (<= 1 for bj < warp, 1 on the diagonal block, 0 above it).
  // They are fetched for k-step ks + 1 while k-step ks's WGMMAs run (software pipelining over the
  // k-steps): each k-step then waits for its products only, not also for the next k-step's shared
  // loads and exp2 chain. The fragments in flight (qa, ka) and the accumulators are not touched
  // between commit and wait, so ptxas keeps the products asynchronous.
  const float (*ref)[kHeadDim] = kGeneral ? a_ref : st.r_block;
  const auto fetch = [&](int ks, uint32_t (&qf)[4], uint32_t (&kf)[4], uint32_t (&sc_lo)[kNumSubBlocks],
                         uint32_t (&sc_hi)[kNumSubBlocks]) {
    const uint32_t lm_off = (ks >> 2) * kBoxBytes + sw128_chunk_offset(lm_row, (ks & 3) * 2 + lm_hi);
    if constexpr (kWantQ) ldmatrix_x4(q_base + lm_off, qf);
    if constexpr (kWantK) ldmatrix_x4(k_base + lm_off, kf);
    if constexpr (kScaleTable) {
      static_assert(!kGeneral && !kHalf, "the scale table holds bf16 pairs of the block-end references");
      // Feature pairs (c0, c0 + 1) = ks * 8 + t4 and (c0 + 8, c0 + 9) = that + 4, c0 = 16 ks + 2 t4.
      const uint32_t* row = scale_pairs + warp * kNumSubBlocks * 64 + ks * 8 + t4;
#pragma unroll
      for (int bj = 0; bj < kNumSubBlocks; ++bj) {
        const uint32_t fixed = bj == warp ? 0x3f803f80u : 0u;  // bf16x2 (1, 1) on the diagonal, 0 above it
        sc_lo[bj] = bj < warp ? row[bj * 64] : fixed;
        sc_hi[bj] = bj < warp ? row[bj * 64 + 4] : fixed;
      }
      return;
    }
    // Features of this thread's fragment: c0, c0+1 (regs 0, 1) and c0+8, c0+9 (regs 2, 3).
    const int c0 = ks * 16 + 2 * t4;
    const float rw0 = ref[warp][c0], rw1 = ref[warp][c0 + 1];
    const float rw8 = ref[warp][c0 + 8], rw9 = ref[warp][c0 + 9];
#pragma unroll
    for (int bj = 0; bj < kNumSubBlocks; ++bj) {
      float s0 = 0.f, s1 = 0.f, s8 = 0.f, s9 = 0.f;
      if (bj < warp) {
        s0 = fast_exp2(rw0 - st.r_block[bj][c0]);
        s1 = fast_exp2(rw1 - st.r_block[bj][c0 + 1]);
        s8 = fast_exp2(rw8 - st.r_block[bj][c0 + 8]);
        s9 = fast_exp2(rw9 - st.r_block[bj][c0 + 9]);
      } else if (bj == warp) {
        if constexpr (kGeneral) {
          // Wide features: their reference is not the block's end. Exact float equality is the
          // test: a_ref and r_block are written from the same expression for a non-wide pair, and
          // differ by the span (> wide_span_log2) for a wide one (intra_prepare_operands keeps them so; with
          // prep ahead intra_chunk rebuilds a_ref from r_block and the wide flags alike).
          s0 = rw0 == st.r_block[warp][c0] ? 1.f : 0.f;
          s1 = rw1 == st.r_block[warp][c0 + 1] ? 1.f : 0.f;
          s8 = rw8 == st.r_block[warp][c0 + 8] ? 1.f : 0.f;
          s9 = rw9 == st.r_block[warp][c0 + 9] ? 1.f : 0.f;
        } else {
          s0 = s1 = s8 = s9 = 1.f;
        }
      }
      sc_lo[bj] = kHalf ? float2_to_half2(s0, s1) : float2_to_bf16x2(s0, s1);
      sc_hi[bj] = kHalf ? float2_to_half2(s8, s9) : float2_to_bf16x2(s8, s9);
    }
  };
  uint32_t qf[4], kf[4], sc_lo[kNumSubBlocks], sc_hi[kNumSubBlocks];
  fetch(0, qf, kf, sc_lo, sc_hi);

#pragma unroll 1
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    const uint32_t box_off = (ks >> 2) * kBoxBytes;
    // A operands per column block bj: rescaled by exp2(r_w - r_bj) <= 1 for bj < warp, as loaded
    // for bj == warp, zero for bj > warp. The rescale is one packed bf16x2 multiply per register
    // (the scale pair rounded to bf16 first: one extra rounding of 2^-9 relative on these
    // entries), instead of unpacking to fp32, two FMUL and a repack.
    uint32_t qa[kNumSubBlocks][4], ka[kNumSubBlocks][4];
#pragma unroll
    for (int bj = 0; bj < kNumSubBlocks; ++bj) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const uint32_t sc = r < 2 ? sc_lo[bj] : sc_hi[bj];
        if constexpr (kWantQ) qa[bj][r] = kHalf ? half2_mul(qf[r], sc) : bf16x2_mul(qf[r], sc);
        if constexpr (kWantK) ka[bj][r] = kHalf ? half2_mul(kf[r], sc) : bf16x2_mul(kf[r], sc);
      }
    }

#pragma unroll
    for (int bj = 0; bj < kNumSubBlocks; ++bj) {
      if constexpr (kWantQ) fence_accumulators(aqk[bj]);
      if constexpr (kWantK) fence_accumulators(akk[bj]);
    }
    wgmma_fence();
#pragma unroll
    for (int bj = 0; bj < kNumSubBlocks; ++bj) {
      const uint64_t db = desc_advance(desc_k_major(kt_base), box_off + bj * (kSubBlock * 128) + (ks & 3) * 32);
      if constexpr (kHalf) {
        if constexpr (kWantQ) wgmma_rs_f16<16, Major::K>(qa[bj], db, aqk[bj], true);
        if constexpr (kWantK) wgmma_rs_f16<16, Major::K>(ka[bj], db, akk[bj], true);
      } else {
        if constexpr (kWantQ) wgmma_rs_n16(qa[bj], db, aqk[bj], true);
        if constexpr (kWantK) wgmma_rs_n16(ka[bj], db, akk[bj], true);
      }
    }
    wgmma_commit();
    // The next k-step's operands (the last k-step fetches its own again: a harmless reload that
    // keeps the loop free of a branch).
    fetch(min(ks + 1, kHeadDim / 16 - 1), qf, kf, sc_lo, sc_hi);
    wgmma_wait<0>();
#pragma unroll
    for (int bj = 0; bj < kNumSubBlocks; ++bj) {
      if constexpr (kWantQ) fence_fragment(qa[bj]);
      if constexpr (kWantK) fence_fragment(ka[bj]);
      if constexpr (kWantQ) fence_accumulators(aqk[bj]);
      if constexpr (kWantK) fence_accumulators(akk[bj]);
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

// Step 5 per entry pair. The thread's entries of the A products' accumulators [bj][8] (m64n16 per
// column block bj), visited as pairs (i, j), (i, j + 1) at registers r, r + 1: f(bj, n8, h2, i, j, r).
template <typename F>
__device__ __forceinline__ void for_each_entry_pair(int warp, int g4, int t4, F&& f) {
#pragma unroll
  for (int bj = 0; bj < kNumSubBlocks; ++bj) {
#pragma unroll
    for (int n8 = 0; n8 < 2; ++n8) {
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const int i = kSubBlock * warp + g4 + 8 * h2;
        const int j = kSubBlock * bj + 8 * n8 + 2 * t4;
        f(bj, n8, h2, i, j, n8 * 4 + h2 * 2);
      }
    }
  }
}
// A_qk's pair, strictly lower (its diagonal is st.aqk_diag), into the stage (bf16, or fp16).
template <bool kAqkHalf>
__device__ __forceinline__ void store_masked_aqk_pair(StageStorage& st, int i, int j, float x0, float x1) {
  const float q0 = (j < i) ? x0 : 0.f;
  const float q1 = (j + 1 < i) ? x1 : 0.f;
  *reinterpret_cast<uint32_t*>(st.aqk + sw128_offset(i, j, kChunk)) =
      kAqkHalf ? float2_to_half2(q0, q1) : float2_to_bf16x2(q0, q1);
}
// A = beta_i A_kk's pair, strictly lower: the blocks below the diagonal into registers (a_off,
// m64n64 accumulator layout), the diagonal block into the inverse's scratch, transposed (row j of
// the scratch block is column j of A_d).
__device__ __forceinline__ void mask_akk_pair(float* diag, float (&a_off)[8 * (kNumSubBlocks - 1)], int bj, int n8,
                                              int h2, int i, int j, int r, int warp, int g4, int t4, float bi,
                                              float x0, float x1) {
  const float a0 = (j < i) ? x0 * bi : 0.f;
  const float a1 = (j + 1 < i) ? x1 * bi : 0.f;
  if (bj == warp) {
    float* dblock = diag + warp * kDiagBlockFloats + (g4 + 8 * h2);
    dblock[(8 * n8 + 2 * t4) * kDiagLd] = a0;
    dblock[(8 * n8 + 2 * t4 + 1) * kDiagLd] = a1;
  }
  if (bj < kNumSubBlocks - 1) {
    a_off[bj * 8 + r] = bj < warp ? a0 : 0.f;
    a_off[bj * 8 + r + 1] = bj < warp ? a1 : 0.f;
  }
}

// Step 6 on the stage: QG = QE exp2(r_b) = q exp2(G) in the q slot, KG = beta KE exp2(r_b) in the k
// slot (in place; kFoldDecay: KT' in the g slot too); thread (h, cp) = (tid / 64, tid % 64) owns
// features 2 cp, 2 cp + 1 of rows [32 h, 32 h + 32). For W, beta goes into the right-hand operand
// KG row by row (rounded per element) rather than into the columns of M, whose unit diagonal would
// then carry one bf16 rounding of beta_j into everything row j contributes; U takes it
// differently (step 8). (Fused kernels: KG is the state warpgroups' operand of X = KG S, same
// rounding.)
// kRolled (the pair form): the two blocks in a loop, one copy of the block's code (instruction
// fetch, as in row_statistics).
template <bool kGeneral, bool kHalf, bool kFoldDecay, bool kAqkHalf, bool kRolled = false>
__device__ __forceinline__ void form_qg_kg(StageStorage& st, const float (*a_ref)[kHeadDim], int tid) {
  const int h = tid >> 6, cp = tid & 63;
  const PairColumn addr(cp);
  constexpr int kBlockUnroll = kRolled ? 1 : 2;
#pragma unroll kBlockUnroll
  for (int bb = 0; bb < 2; ++bb) {
    const int b = 2 * h + bb, row0 = kSubBlock * b;
    // exp2 of the block's reference: r_b, or r_{b-1} for a wide feature (general gates).
    const float2 rb = *reinterpret_cast<const float2*>(kGeneral ? &a_ref[b][2 * cp] : &st.r_block[b][2 * cp]);
    // kHalf: QE, KE carry 2^-7, KT 2^7 (store_block_operands)
    const float s0 = fast_exp2(kHalf ? rb.x + kHalfShiftLog2 : rb.x);
    const float s1 = fast_exp2(kHalf ? rb.y + kHalfShiftLog2 : rb.y);
    uint32_t qx[kSubBlock], kx[kSubBlock];
    float betas[kSubBlock];  // loaded before the stores (see intra_prepare_operands)
#pragma unroll
    for (int ii = 0; ii < kSubBlock; ++ii) {
      qx[ii] = ld_bf16x2(st.q, addr(row0 + ii));
      kx[ii] = ld_bf16x2(st.k, addr(row0 + ii));
    }
    // The cooperative helpers' KT' = KT exp2(r_3 - r_b) in place (both factors <= 1; KT is
    // referenced to the block end r_b for every feature, also a wide one under general gates,
    // whose QG/KG reference `rb` above is r_{b-1}: so r_b from r_block here; kHalf: times
    // 2^-7 as well). The fused kernels leave KT as the prep stored it.
    if constexpr (kFoldDecay) {
      const float2 r3 = *reinterpret_cast<const float2*>(&st.r_block[kNumSubBlocks - 1][2 * cp]);
      const float2 rend = *reinterpret_cast<const float2*>(&st.r_block[b][2 * cp]);
      const float f0 = fast_exp2(kHalf ? r3.x - rend.x - kHalfShiftLog2 : r3.x - rend.x);
      const float f1 = fast_exp2(kHalf ? r3.y - rend.y - kHalfShiftLog2 : r3.y - rend.y);
      uint32_t gx[kSubBlock];
#pragma unroll
      for (int ii = 0; ii < kSubBlock; ++ii) gx[ii] = ld_bf16x2(st.g, addr(row0 + ii));
#pragma unroll
      for (int ii = 0; ii < kSubBlock; ++ii) {
        const float2 kt = kHalf ? half2_to_float2(gx[ii]) : bf16x2_to_float2(gx[ii]);
        // kAqkHalf: the owners take the state update in fp16 (owner_state_math.cuh); KT' <= 1
        if constexpr (kFoldDecay && kAqkHalf)
          *reinterpret_cast<uint32_t*>(st.g + addr(row0 + ii)) = float2_to_half2(kt.x * f0, kt.y * f1);
        else
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
      const float2 qv = kHalf ? half2_to_float2(qx[ii]) : bf16x2_to_float2(qx[ii]);
      const float2 kv = kHalf ? half2_to_float2(kx[ii]) : bf16x2_to_float2(kx[ii]);
      st_bf16x2(st.q, addr(row0 + ii), qv.x * s0, qv.y * s1);
      st_bf16x2(st.k, addr(row0 + ii), kv.x * (s0 * beta), kv.y * (s1 * beta));
    }
  }
}

// Step 8 of the fused kernels: M - I (bf16, K-major SW128 A operand: one 64 x 64 box) from the
// inverse's accumulator fragment. M's diagonal is exactly 1 (unit diagonal blocks, strictly
// block-lower N), so M - I is 0 there.
__device__ __forceinline__ void store_m_minus_identity(uint8_t* tile, const float (&m)[32], int warp, int g4, int t4) {
#pragma unroll
  for (int n8 = 0; n8 < 8; ++n8)
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const int i = kSubBlock * warp + g4 + 8 * h2, j = 8 * n8 + 2 * t4;
      const float m0 = i == j ? 0.f : m[n8 * 4 + h2 * 2], m1 = i == j + 1 ? 0.f : m[n8 * 4 + h2 * 2 + 1];
      *reinterpret_cast<uint32_t*>(tile + sw128_offset(i, j, kChunk)) = float2_to_bf16x2(m0, m1);
    }
}

// Steps 1-8 on the stage of one chunk with `rows` valid rows (kGeneral: general gates).
// kFoldDecay (cooperative helpers): step 6 also rescales KT to KT' = k exp2(G_last - G) =
// KT exp2(r_3 - r_b) (both factors <= 1, for general gates too: KT is referenced to the block end
// either way), so that the owner's state update is one batch of products instead of four Horner
// steps (state_math.cuh).
//
// kPrepped (the fused kernel): steps 1-3 are done already, by the state warpgroups
// (chunk_prep.cuh); the chain starts at the A products (general gates: after rebuilding a_ref).
//
// kAqkHalf (shared_storage.cuh: aqk_is_half, coop_aqk_is_half): A_qk goes to the stage in fp16
// (with kFoldDecay KT' too: the cooperative owners' operands of A_qk v_new and the state update).
//
// kHelperHalfInverse (cooperative helpers, kFoldDecay): the inverse with fp16 operands too; only the
// helpers' kernel takes it (kda_prefill_kernel.cuh: kHelperIntraRegs).
//
// warm_from (the cooperative helpers' chain: CooperativePlan::warm_entries): > 0 runs the chain
// without data from that step on (1: everything; 4, 5, 6, 7, 8: from the A products, the masks,
// step 6, the inverse, the W / U products), for nothing but fetching its code; the steps skipped
// leave their register results at 0, and nothing leaves the warpgroup (no head_ready). 0: a real
// chunk.
template <bool kGateInKernel, bool kL2Norm, Decays kDecays = Decays::kSafe, bool kFoldDecay = false,
          bool kPrepped = false, bool kAqkHalf = false, bool kFoldM = false, bool kHelperHalfInverse = false>
__device__ __forceinline__ void intra_chunk(const KdaPrefillParams& p, const IntraScratch& ws, StageStorage& st, int rows,
                                            float gate_scale, float2 gate_bias, int tid, PhaseTimer& timer,
                                            uint64_t* m_tile_empty = nullptr, uint32_t m_tile_phase = 0,
                                            uint64_t* head_ready = nullptr, int warm_from = 0) {
  // Steps 1-3 of the warpgroup's own prep write the scratch before the wait for the M tile.
  static_assert(!kFoldM || kPrepped, "the folded M tile needs the prep done ahead");
  const int warp = tid >> 5, lane = tid & 31;
  const int g4 = lane >> 2, t4 = lane & 3;
  float* rnorm = reinterpret_cast<float*>(ws.scratch + kRnormOffset);
  float* row_stats = reinterpret_cast<float*>(ws.scratch + kRowStatsOffset);
  float* diag = reinterpret_cast<float*>(ws.scratch + kDiagOffset);
    constexpr bool kGeneral = kDecays != Decays::kSafe;
    constexpr bool kHalf = half_operands(kDecays, kL2Norm);  // QE, KE, KT in fp16 (kHalfSpanLog2)
    // An fp16 KT goes on only to a state side that takes it in fp16: the cooperative owners (KT')
    // or the fused kernels' state warpgroups, whose A_qk v_new and state update are fp16.
    static_assert(!kHalf || kFoldDecay || kAqkHalf, "fp16 KT needs an fp16 state update");
    if constexpr (!kPrepped) {
      if (warm_from <= 1)
        intra_prepare_operands<kGateInKernel, kL2Norm, kDecays>(p, ws, st, rnorm, row_stats, ws.a_ref, rows,
                                                                 gate_scale, gate_bias, tid);
    } else if constexpr (kGeneral) {
      // Prepped general gates: each (block, feature)'s factor reference from the block ends and
      // the wide flags (chunk_prep.cuh): r_b, or r_{b-1} (0 for block 0) for a wide feature.
#pragma unroll
      for (int x = tid; x < kNumSubBlocks * kHeadDim / 2; x += 128) {
        const int b = x >> 6, cp2 = 2 * (x & 63);
        const uint32_t w = st.wide_pair[b][x & 63];
        const float2 r = *reinterpret_cast<const float2*>(&st.r_block[b][cp2]);
        const float2 s0 = b ? *reinterpret_cast<const float2*>(&st.r_block[b - 1][cp2]) : make_float2(0.f, 0.f);
        *reinterpret_cast<float2*>(&ws.a_ref[b][cp2]) = make_float2(w & 1 ? s0.x : r.x, w & 2 ? s0.y : r.y);
      }
      named_barrier_sync(ws.bar, 128);
    }
    timer.mark(1);

    float aqk[kNumSubBlocks][8], akk[kNumSubBlocks][8];
    if (warm_from <= 4) {
      intra_attention_matrices<kGeneral, kHalf>(st, ws.a_ref, warp, lane, aqk, akk);
    } else {
#pragma unroll
      for (int bj = 0; bj < kNumSubBlocks; ++bj)
#pragma unroll
        for (int r = 0; r < 8; ++r) aqk[bj][r] = akk[bj][r] = 0.f;
    }
    timer.mark(2);
    // kFoldM: the M tile of the previous chunk lies over the diagonal-block scratch that step 5
    // writes; wait until both state warpgroups have read it (early in their chain: after S's tile,
    // X = KG S and Y; the wait is counted in the profile's "mask" phase, which fell from 0.10M to
    // 0.08M cycles per 128 chunks at B2 with the fold, so it rarely waits long).
    if constexpr (kFoldM) cutlass::arch::ClusterBarrier::wait(m_tile_empty, m_tile_phase);

    // Step 5: masks and beta. A_qk -> stage (bf16, strictly lower: its diagonal is st.aqk_diag);
    // A = beta_i A_kk: its blocks below the diagonal stay in registers (a_off, m64n64
    // accumulator layout) and its diagonal blocks go to the scratch for the forward substitution.
    float a_off[8 * (kNumSubBlocks - 1)];
    if (warm_from > 5) {
#pragma unroll
      for (int x = 0; x < 8 * (kNumSubBlocks - 1); ++x) a_off[x] = 0.f;
    } else {
      const float beta_lo = st.beta[kSubBlock * warp + g4];
      const float beta_hi = st.beta[kSubBlock * warp + g4 + 8];
      // General gates: the exact diagonal-block terms of the wide features (prep), the two warp
      // partials added in a fixed order.
      float corr_qk[2][2][2] = {}, corr_kk[2][2][2] = {};  // [n8][h2][element]
      if constexpr (kGeneral) {
#pragma unroll
        for (int n8 = 0; n8 < 2; ++n8)
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int at = (g4 + 8 * h2) * kSubBlock + 8 * n8 + 2 * t4 + e;
              if constexpr (kPrepped) {  // summed by the prep, in the A_qk tile (chunk_prep.cuh)
                const float* corr = reinterpret_cast<const float*>(st.aqk);
                corr_qk[n8][h2][e] = corr[(warp * 2 + 0) * 256 + at];
                corr_kk[n8][h2][e] = corr[(warp * 2 + 1) * 256 + at];
              } else {
                corr_qk[n8][h2][e] = wide_corrections(ws, warp, 0, 0)[at] + wide_corrections(ws, warp, 1, 0)[at];
                corr_kk[n8][h2][e] = wide_corrections(ws, warp, 0, 1)[at] + wide_corrections(ws, warp, 1, 1)[at];
              }
            }
        // Every warp has read the corrections before A_qk is written over them.
        if constexpr (kPrepped) named_barrier_sync(ws.bar, 128);
      }
      for_each_entry_pair(warp, g4, t4, [&](int bj, int n8, int h2, int i, int j, int r) {
        if constexpr (kGeneral) {
          if (bj == warp) {
            aqk[bj][r] += corr_qk[n8][h2][0];
            aqk[bj][r + 1] += corr_qk[n8][h2][1];
            akk[bj][r] += corr_kk[n8][h2][0];
            akk[bj][r + 1] += corr_kk[n8][h2][1];
          }
        }
        store_masked_aqk_pair<kAqkHalf>(st, i, j, aqk[bj][r], aqk[bj][r + 1]);
        mask_akk_pair(diag, a_off, bj, n8, h2, i, j, r, warp, g4, t4, h2 ? beta_hi : beta_lo, akk[bj][r],
                      akk[bj][r + 1]);
      });
    }
    timer.mark(3);

    named_barrier_sync(ws.bar, 128);  // every warp done reading QE/KE (step 4)
    // Step 6: QG = QE * exp2(r_b), KG = beta * KE * exp2(r_b) (form_qg_kg).
    if (warm_from <= 6) form_qg_kg<kGeneral, kHalf, kFoldDecay, kAqkHalf>(st, ws.a_ref, tid);
    if constexpr (kFoldDecay) {
      // Cooperative helpers: the stage's head (QG, KT', A_qk) is final; the storer copies it out
      // while the inverse runs, and the producer then loads the next chunk's q and g over it
      // (SharedStorage::head_ready_bar). Nothing below reads the q or g slot or A_qk.
      // (cutlass's fence and arrive asm have no "memory" clobber: keep the compiler from moving
      // step 6's stores past them.)
      asm volatile("" ::: "memory");
      fence_smem_to_async_proxy();
      if (warm_from == 0) cutlass::arch::ClusterBarrier::arrive(head_ready);
    }
    timer.mark(4);
    // Step 7: M = (I + A)^-1 (unit_lower_inverse.cuh), all products on the tensor cores. Its first
    // proxy fence and barrier also publish QG/KG to the W/U products below (cooperative helpers;
    // in the fused kernels the fence before `ready` publishes them to the state warpgroups).
    float m[32];
    // fp16 operands where |k| = 1 bounds M (unit_lower_inverse.cuh): in the fused kernels, and in
    // the helpers' kernel with kHelperIntraRegs (kda_prefill_kernel.cuh; at kIntraRegs its
    // fragments made ptxas serialise every WGMMA of that kernel, C7512). The one-kernel form's
    // helpers keep tf32: with the fp16 inverse its chain-bound row B1 T32768 H8 ran 10 % slower on H100.
    if (warm_from > 7) {
#pragma unroll
      for (int x = 0; x < 32; ++x) m[x] = 0.f;
    } else if constexpr (half_inverse(kL2Norm) && (!kFoldDecay || kHelperHalfInverse)) {
      invert_unit_lower_half(a_off, diag, ws.inverse_operand, ws.bar, tid, m, timer);
    } else {
      invert_unit_lower(a_off, diag, ws.inverse_operand, ws.bar, tid, m, timer);
    }
    timer.mark(5);

    if constexpr (kFoldM) {
      // Step 8 (fused kernels): M - I -> the M tile (bf16, K-major A operand, over the intra
      // scratch, whose diagonal blocks the inverse has finished reading). The state warpgroups
      // fold M into their chain, v_new = M (beta v - KG S) = Y + (M - I) Y (state_math.cuh), so
      // W and U are never formed: KG stays in the k slot and v in the v slot. M's diagonal is
      // exactly 1 (unit diagonal blocks, strictly block-lower N), so M - I is 0 there.
      store_m_minus_identity(ws.scratch + kMTileOffset, m, warp, g4, t4);
    } else {
      // Step 8: W = M KG -> k slot (the cooperative helpers: -W), U = ((M - I) diag(beta)) v + beta v -> v slot. The A operands
      // come straight from the inverse's accumulator (the bf16 m64k16 fragment of k-step ks is
      // accumulator columns 16 ks .. 16 ks + 15 of the thread's two rows). For U the unit diagonal
      // is left out of the bf16 operand and its term beta_i v_i added in fp32 below: rounding
      // beta v (or beta_j on the diagonal) to bf16 was the largest single share of the kernel's
      // error (scripts/error_budget.py: o 3.5e-3 -> 3.1e-3, state 2.9e-3 -> 2.4e-3 without it).
      // Thread element r of k-step ks: row 16 warp + g4 + 8 ((r >> 0) & 1), column
      // 16 ks + 8 (r >> 1) + 2 t4 (+1).
      uint32_t mw_frag[kChunk / 16][4], mu_frag[kChunk / 16][4];
#pragma unroll
      for (int ks = 0; ks < kChunk / 16; ++ks)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float m0 = m[8 * ks + 2 * r], m1 = m[8 * ks + 2 * r + 1];
          const int i = kSubBlock * warp + g4 + 8 * (r & 1);
          const int j = 16 * ks + 8 * (r >> 1) + 2 * t4;
          const float2 bj = *reinterpret_cast<const float2*>(&st.beta[j]);
          // kFoldDecay (the cooperative owners' operands): W' = -W (exact in bf16), so that the
          // owners' product U^T + S^T W'^T is v_new^T itself (owner_state_math.cuh (b)).
          mw_frag[ks][r] = kFoldDecay ? float2_to_bf16x2(-m0, -m1) : float2_to_bf16x2(m0, m1);
          mu_frag[ks][r] = float2_to_bf16x2(i == j ? 0.f : m0 * bj.x, i == j + 1 ? 0.f : m1 * bj.y);
        }
      // One product into a 64 x 128 slot (k: W, v: U), stored as bf16 in place; with_beta_v adds
      // beta_i v_i in fp32 from the slot's bf16 v at the thread's own elements before the store.
      const auto product = [&](const uint32_t (&a)[kChunk / 16][4], uint8_t* slot, bool with_beta_v) {
        const uint32_t b_base = smem_u32(slot);
        float acc[64];
#pragma unroll
        for (int r = 0; r < 64; ++r) acc[r] = 0.f;
        fence_accumulators(acc);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kChunk / 16; ++ks)
          wgmma_rs<128, Major::MN>(a[ks], desc_advance(desc_mn_major(b_base, kBoxBytes), ks * 16 * 128), acc, true);
        wgmma_commit();
        wgmma_wait<0>();
        fence_accumulators(acc);
        named_barrier_sync(ws.bar, 128);  // whole warpgroup done reading the slot
        if (with_beta_v) {
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {
            const int i = kSubBlock * warp + g4 + 8 * h2;
            const float bi = st.beta[i];
#pragma unroll
            for (int n8 = 0; n8 < 16; ++n8) {
              const float2 vi = bf16x2_to_float2(*reinterpret_cast<const uint32_t*>(
                  slot + (n8 >> 3) * kBoxBytes + sw128_fragment_offset(i, n8 & 7, g4, t4)));
              acc[n8 * 4 + h2 * 2] = fmaf(bi, vi.x, acc[n8 * 4 + h2 * 2]);
              acc[n8 * 4 + h2 * 2 + 1] = fmaf(bi, vi.y, acc[n8 * 4 + h2 * 2 + 1]);
            }
          }
        }
        store_accumulator_bf16<128>(slot, acc, warp, lane, 0);
      };
      product(mw_frag, st.k, false);
      if constexpr (kFoldDecay) {
        // The owners' decay of S over the chunk, exp2(G_last) per feature, over the last block's
        // r_b (which they read for nothing else): one MUFU per feature here instead of 32 per
        // owner thread and chunk on their chain. Every read of r_block (step 6) lies before the
        // inverse's first barrier, and the storer copies the stage after the fence below.
        if (tid < kHeadDim / 2) {
          float2* r3 = reinterpret_cast<float2*>(&st.r_block[kNumSubBlocks - 1][2 * tid]);
          const float2 r = *r3;
          *r3 = make_float2(fast_exp2(r.x), fast_exp2(r.y));
        }
      }
      product(mu_frag, st.v, true);
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
// walking tiles, and the storer takes the finished stage. A helper may run two intra warpgroups
// (kp.coop.helper_intra == 2; `which` 0 and 1), each on every other stage of the ring: the work
// of one is a latency-bound chain on one warp per scheduler, and a second chain beside it fills
// the issue slots the first leaves idle. The fused kernel runs one (which = 0).
//
// kPrepAhead (fused kernel): the state warpgroups prepared each stage (steps 1-3,
// chunk_prep.cuh); the warpgroup waits for that (`prepped`) instead of the load (`full`).
//
// warm_from > 0 (kChunkSlots: an owner-region CTA of the helpers' kernel, CooperativePlan::
// warm_entries): one pass of the chunk's code from step warm_from on, on whatever the stage holds,
// through the same call site as the real chunks (the code to bring into L2 is that copy), then
// return; no barrier but the warpgroup's own.
template <bool kGateInKernel, bool kL2Norm, bool kLongestFirst, bool kChunkSlots, Decays kDecays = Decays::kSafe,
          bool kPrepAhead = false, bool kHelperHalfInverse = false>
__device__ __forceinline__ void run_intra_chunk(const KdaKernelParams& kp, SharedStorage& smem, int which = 0,
                                                int warm_from = 0) {
  const KdaPrefillParams& p = kp.problem;
  // The thread's index in its warpgroup (1 or, for a helper's second intra warpgroup, 2), the same
  // expression for both: see the kernel's helper branch (C7518).
  const int tid = threadIdx.x % kWarpgroupThreads;
  const IntraScratch ws = intra_scratch_of(smem, which);
  PipelineState pipe;
  PhaseTimer timer;
  timer.start();

  if constexpr (kChunkSlots) {
    const int step = kp.coop.helper_intra;  // ring steps between this warpgroup's stages
    for (int s = 0; s < which; ++s) pipe.advance();
    float gate_scale = 1.f;
    float2 gate_bias = make_float2(0.f, 0.f);
    int gate_head = -1;
    for (;;) {
      StageStorage& st = smem.stage[pipe.stage];
      int rows = kChunk;  // warm pass: a full chunk's code
      if (warm_from == 0) {
        cutlass::arch::ClusterTransactionBarrier::wait(&smem.full_bar[pipe.stage], pipe.phase);
        rows = warp_uniform(st.rows);
      }
      if (rows >= 0) {
        if (warm_from == 0) {
          const int v_head = warp_uniform(st.ws_head);
          if (v_head != gate_head) {
            gate_parameters<kGateInKernel>(p, v_head, tid, gate_scale, gate_bias);
            gate_head = v_head;
          }
        }
        timer.mark(0);
        intra_chunk<kGateInKernel, kL2Norm, kDecays, /*kFoldDecay=*/true, /*kPrepped=*/false, coop_aqk_is_half(kL2Norm),
                    /*kFoldM=*/false, kHelperHalfInverse>(p, ws, st, rows, gate_scale, gate_bias, tid, timer, nullptr, 0,
                                                          &smem.head_ready_bar[pipe.stage], warm_from);
        fence_smem_to_async_proxy();  // the storer's bulk copy reads the stage
      } else {
        cutlass::arch::ClusterBarrier::arrive(&smem.head_ready_bar[pipe.stage]);  // the end mark, to the storer
      }
      if (warm_from > 0) break;
      cutlass::arch::ClusterBarrier::arrive(&smem.ready_bar[pipe.stage]);  // to the storer
      if (rows < 0) break;
      timer.mark(6);
      for (int s = 0; s < step; ++s) pipe.advance();
    }
  } else {
    TileCursor cursor;
    // Fused kernels: phase of m_tile_empty_bar to wait for (chunk n waits for the state
    // warpgroups' arrivals of chunk n - 1; the first wait, on the phase before the first, passes).
    [[maybe_unused]] uint32_t m_tile_phase = 1u;
    for (WorkTile tile; next_tile<kLongestFirst, /*kIsProducer=*/false>(kp, smem, cursor, tile);) {
      float gate_scale = 1.f;
      float2 gate_bias = make_float2(0.f, 0.f);
      if constexpr (!kPrepAhead) gate_parameters<kGateInKernel>(p, tile.v_head, tid, gate_scale, gate_bias);
      for (int c = 0; c < tile.num_chunks(); ++c, pipe.advance()) {
        StageStorage& st = smem.stage[pipe.stage];
        const int rows = tile.chunk_rows(c);
        if constexpr (kPrepAhead) {
          cutlass::arch::ClusterBarrier::wait(&smem.prepped_bar[pipe.stage], pipe.phase);
        } else {
          cutlass::arch::ClusterTransactionBarrier::wait(&smem.full_bar[pipe.stage], pipe.phase);
        }
        timer.mark(0);
        intra_chunk<kGateInKernel, kL2Norm, kDecays, false, kPrepAhead,
                    aqk_is_half(kPrepAhead, kL2Norm, kLongestFirst), fold_m(kPrepAhead)>(
            p, ws, st, rows, gate_scale, gate_bias, tid, timer, &smem.m_tile_empty_bar, m_tile_phase);
        m_tile_phase ^= 1u;
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
