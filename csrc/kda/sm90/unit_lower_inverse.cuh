// M = (I + A)^-1 for the 64x64 strictly lower triangular A = beta * A_kk of one chunk, on the
// intra-chunk warpgroup, with every matrix product on the tensor cores (tf32 WGMMA).
//
// Split A by 16-row blocks into its diagonal blocks A_d and the blocks below them A_o. Then
//
//     I + A = (I + A_o D) D^-1,   D = (I + A_d)^-1 (block diagonal)
//     M     = D (I + N)^-1 = D (I - N) (I + N^2),   N = A_o D,
//
// exactly: N is strictly block lower with four blocks, so N^4 = 0. The four 16x16 blocks of D come
// from forward substitution in fp32 (one warp each); the rest is three rounds of 64x64 products,
// each with only the k-steps where both operands can be nonzero:
//
//     N   = A_o D                   k-blocks 0..2  (column block 3 of A_o is zero)
//     N^2 = N N,  Y = D - D N       k-blocks 1..2 and 1..3, one batch (both read N; scale-A = -1)
//     M   = Y + Y N^2               k-blocks 2..3  (N^2 has rows in blocks 2..3 only)
//
// Operands are tf32 (10-bit mantissa, rounded), accumulation fp32: each rounding is 4x smaller
// than the one bf16 rounding M gets at the end, so the result matches the fp32 substitution.
//
// Register A operands come straight from accumulators. A tf32 A fragment (m64k8) holds columns
// (t, t+4) of an 8-column group while an accumulator holds (2t, 2t+1). Since a product sums over
// k, any permutation of k applied to A's columns and B's rows alike leaves it unchanged: inside
// every 8-group, k-slot s < 4 holds column 2s and slot s >= 4 column 2(s-4)+1. Then fragment
// register r of k-step ks is accumulator register 4 ks + {0, 2, 1, 3}[r], and only the B operand,
// which this file writes itself (K-major, 128B swizzle, the permuted k order), needs to know.
#pragma once

#include "shared_storage.cuh"
#include "sm90_primitives.cuh"

namespace cula::kda::sm90 {

// fp32 diagonal blocks: A_d transposed, then D (row-major) in place (row stride kDiagLd floats).
constexpr int kDiagLd = 20;
constexpr int kDiagBlockFloats = kSubBlock * kDiagLd;

// Slot of row k inside its 8-group under the permutation above.
__device__ __forceinline__ int permuted_k_slot(int k) { return (k & ~7) | ((k & 7) >> 1) | ((k & 1) << 2); }

// Byte offset of B-operand element (k, n) in the tf32 K-major SW128 tile: row n holds the 64 k's
// as two 128-byte boxes of 32 slots.
__device__ __forceinline__ uint32_t inverse_operand_offset(int k, int n) {
  const int s = permuted_k_slot(k);
  return uint32_t((s >> 5) * kBoxBytes) + sw128_chunk_offset(n, (s & 31) >> 2) + uint32_t(s & 3) * 4;
}

// Rounds fp32 values to tf32 in place (kept as fp32 bit patterns, so the same registers serve
// as WGMMA A fragments, as values to store, and as fp32 addends).
template <int N>
__device__ __forceinline__ void round_to_tf32(float (&x)[N]) {
#pragma unroll
  for (int r = 0; r < N; ++r) x[r] = __uint_as_float(to_tf32(x[r]));
}

// Writes an m64n64 accumulator X (thread's elements X[16 warp + g + 8 h2][8 n8 + 2 t + e]),
// already rounded to tf32, as the B operand of a product with it on the right (B[k][n] = X[k][n]).
__device__ __forceinline__ void store_inverse_operand(uint8_t* tile, const float (&x)[32], int warp, int lane) {
  const int g4 = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int n8 = 0; n8 < 8; ++n8)
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int k = kSubBlock * warp + g4 + 8 * h2, n = 8 * n8 + 2 * t4 + e;
        *reinterpret_cast<float*>(tile + inverse_operand_offset(k, n)) = x[n8 * 4 + h2 * 2 + e];
      }
}

// Issues acc (+)= (+/-) X * B over k-steps [kBegin, kEnd), X an m64n64 accumulator-layout array
// of tf32 values: the A fragment of k-step ks is x[4 ks + {0, 2, 1, 3}] (see the permutation
// above). The caller fences, commits and waits.
template <ScaleIn kScaleA, int kBegin, int kEnd, int N>
__device__ __forceinline__ void issue_inverse_product(uint32_t b_base, const float (&x)[N], float (&acc)[32]) {
  static_assert(4 * kEnd <= N, "fragment source too short");
#pragma unroll
  for (int ks = kBegin; ks < kEnd; ++ks) {
    const uint32_t a[4] = {__float_as_uint(x[4 * ks]), __float_as_uint(x[4 * ks + 2]), __float_as_uint(x[4 * ks + 1]),
                           __float_as_uint(x[4 * ks + 3])};
    wgmma_rs_tf32_n64<kScaleA>(a, desc_advance(desc_k_major(b_base), (ks >> 2) * kBoxBytes + (ks & 3) * 32), acc);
  }
}

// In:  a_off  = A below the diagonal blocks, column blocks 0..2 (block 3 has nothing below the
//               diagonal) in m64n64 accumulator layout (a_off[8 bj + r] is register r of the
//               m64n16 accumulator of column block bj), zero on and above the diagonal blocks;
//               rounded to tf32 in place;
//      diag   = A_d transposed: block w at diag + w * kDiagBlockFloats, element (j, i) = A_d[i][j]
//               (strictly lower A_d: zero for i <= j);
//      tile   = 16 KB, 1024-byte aligned scratch for the B operands.
// Out: m[32] = M in the m64n64 accumulator layout.
__device__ __forceinline__ void invert_unit_lower(float (&a_off)[24], float* diag, uint8_t* tile, NamedBarrierId bar,
                                                  int tid, float (&m)[32], PhaseTimer& timer) {
  const int warp = tid >> 5, lane = tid & 31;
  const int g4 = lane >> 2, t4 = lane & 3;
  const uint32_t tile_base = smem_u32(tile);
  float* my_diag = diag + warp * kDiagBlockFloats;

  // D_w by forward substitution, right-looking: once x_j is final, every later row subtracts its
  // multiple of it (independent FMAs, a dependent chain of only 16). diag holds A_d transposed
  // (row j = column j of A_d), so step j reads one contiguous row. Lanes c and c + 16 both compute
  // column c (the second half of the warp then writes its own half of the B-operand rows).
  {
    const int c = lane & 15;
    float x[kSubBlock];
#pragma unroll
    for (int i = 0; i < kSubBlock; ++i) x[i] = (i == c) ? 1.f : 0.f;
#pragma unroll
    for (int j = 0; j + 1 < kSubBlock; ++j) {
      float col[kSubBlock];
#pragma unroll
      for (int i4 = (j + 1) & ~3; i4 < kSubBlock; i4 += 4) {
        const float4 v = *reinterpret_cast<const float4*>(my_diag + j * kDiagLd + i4);
        col[i4] = v.x;
        col[i4 + 1] = v.y;
        col[i4 + 2] = v.z;
        col[i4 + 3] = v.w;
      }
#pragma unroll
      for (int i = j + 1; i < kSubBlock; ++i) x[i] = fmaf(-col[i], x[j], x[i]);
    }
    __syncwarp();
    // D_w row-major over A_d^T (read back as the A operand of the last products).
    if (lane < kSubBlock) {
#pragma unroll
      for (int i = 0; i < kSubBlock; ++i) my_diag[i * kDiagLd + c] = x[i];
    }
    // B operand of N = A_o D: row n = 16 w + c, all 64 k (zero outside block w), 16 bytes at a
    // time. Lane half h writes the k-slots of box h; block w lies in box w / 2.
    const int n = kSubBlock * warp + c, h = lane >> 4;
#pragma unroll
    for (int xc = 0; xc < 8; ++xc) {
      const int s = 4 * h + (xc >> 1) - 2 * warp;  // 8-group of the chunk relative to block w
      const int odd = xc & 1;
      uint4 val = make_uint4(0u, 0u, 0u, 0u);
      if (s == 0) val = make_uint4(to_tf32(x[odd]), to_tf32(x[2 + odd]), to_tf32(x[4 + odd]), to_tf32(x[6 + odd]));
      if (s == 1)
        val = make_uint4(to_tf32(x[8 + odd]), to_tf32(x[10 + odd]), to_tf32(x[12 + odd]), to_tf32(x[14 + odd]));
      *reinterpret_cast<uint4*>(tile + h * kBoxBytes + sw128_chunk_offset(n, xc)) = val;
    }
  }
  fence_smem_to_async_proxy();
  round_to_tf32(a_off);
  named_barrier_sync(bar, 128);
  timer.mark(7);

  // N = A_o D.
  float nn[32];
#pragma unroll
  for (int r = 0; r < 32; ++r) nn[r] = 0.f;
  fence_accumulators(nn);
  wgmma_fence();
  issue_inverse_product<ScaleIn::One, 0, 6>(tile_base, a_off, nn);
  wgmma_commit();
  wgmma_wait<0>();
  fence_accumulators(nn);
  timer.mark(8);
  round_to_tf32(nn);
  named_barrier_sync(bar, 128);  // every warp's product has read D
  store_inverse_operand(tile, nn, warp, lane);
  fence_smem_to_async_proxy();

  // D as an m64n64 array (its block w, zero elsewhere): the accumulator of Y = D - D N, and
  // (rounded) its A operand. D's fragment: rows 16 w + g4 (+8), columns 16 w + 8 s + 2 t4 (+1).
  float y[32], dz[32];
#pragma unroll
  for (int s = 0; s < 2; ++s)
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const float2 v = *reinterpret_cast<const float2*>(my_diag + (g4 + 8 * h2) * kDiagLd + 8 * s + 2 * t4);
#pragma unroll
      for (int n8 = s; n8 < 8; n8 += 2) {
        const bool mine = (n8 >> 1) == warp;
        y[n8 * 4 + h2 * 2] = mine ? v.x : 0.f;
        y[n8 * 4 + h2 * 2 + 1] = mine ? v.y : 0.f;
      }
    }
#pragma unroll
  for (int r = 0; r < 32; ++r) dz[r] = y[r];
  round_to_tf32(dz);
  float n2[32];
#pragma unroll
  for (int r = 0; r < 32; ++r) n2[r] = 0.f;
  named_barrier_sync(bar, 128);

  // N^2 = N N and Y = D - D N in one batch (both read the N tile).
  fence_accumulators(n2);
  fence_accumulators(y);
  wgmma_fence();
  issue_inverse_product<ScaleIn::One, 2, 6>(tile_base, nn, n2);
  issue_inverse_product<ScaleIn::Neg, 2, 8>(tile_base, dz, y);
  wgmma_commit();
  wgmma_wait<0>();
  fence_accumulators(n2);
  fence_accumulators(y);
  timer.mark(9);
  round_to_tf32(n2);
  named_barrier_sync(bar, 128);
  store_inverse_operand(tile, n2, warp, lane);
  fence_smem_to_async_proxy();
  round_to_tf32(y);
#pragma unroll
  for (int r = 0; r < 32; ++r) m[r] = y[r];
  named_barrier_sync(bar, 128);

  // M = Y + Y N^2.
  fence_accumulators(m);
  wgmma_fence();
  issue_inverse_product<ScaleIn::One, 4, 8>(tile_base, y, m);
  wgmma_commit();
  wgmma_wait<0>();
  fence_accumulators(m);
}

}  // namespace cula::kda::sm90
