// M = (I + A)^-1 for the 64x64 strictly lower triangular A = beta * A_kk of one chunk, on the
// intra-chunk warpgroup, with every matrix product on the tensor cores (tf32 WGMMA; fp16 with
// l2-normalised keys, half_inverse below, in the kernels that take it: intra_chunk_math.cuh, step 7).
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
// half_inverse (l2-normalised keys): the same three rounds with fp16 operands (10-bit mantissa,
// as tf32's, so the same rounding) and m64n64k16 products: 10 WGMMAs instead of 24 tf32 k8 steps
// at twice the tensor rate, half the operand bytes, and the B operands double-buffered in the
// 16 KB tile (3 barriers instead of 5). fp16's range holds every value: with |k| = 1 and
// beta <= 2 each step of the delta rule is a contraction, so |M[i][j]| <= beta_i, and D (the same
// problem on a block) likewise; N, N^2 and Y stay within a few units (tests/test_inverse_range.py:
// up to ~7 with beta = 2 on low-rank unit keys, <= 2 with beta <= 1). Entries below fp16's normal
// range (2^-14) keep an absolute error under 2^-25.
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

// D_w = (I + A_d)^-1 for warp w's diagonal block by forward substitution, right-looking: once x_j
// is final, every later row subtracts its multiple of it (independent FMAs, a dependent chain of
// only 16). my_diag holds A_d transposed (row j = column j of A_d), so step j reads one
// contiguous row. Lanes c and c + 16 both compute column c into x (x[i] = D_w[i][c]; the second
// half of the warp then writes its own half of the B-operand rows); D_w is written back row-major
// over A_d^T (read again as the A operand of Y = D - D N).
__device__ __forceinline__ void substitute_diag_block(float* my_diag, int lane, float (&x)[kSubBlock]) {
  const int c = lane & 15;
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
  if (lane < kSubBlock) {
#pragma unroll
    for (int i = 0; i < kSubBlock; ++i) my_diag[i * kDiagLd + c] = x[i];
  }
}

// D as an m64n64 accumulator-layout array (warp w's block, zero elsewhere), from D_w row-major in
// my_diag: rows 16 w + g4 (+8), columns 16 w + 8 s + 2 t4 (+1).
__device__ __forceinline__ void load_block_diagonal(const float* my_diag, int warp, int g4, int t4, float (&y)[32]) {
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

  {
    const int c = lane & 15;
    float x[kSubBlock];
    substitute_diag_block(my_diag, lane, x);
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
  // (rounded) its A operand.
  float y[32], dz[32];
  load_block_diagonal(my_diag, warp, g4, t4, y);
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


// ---------------------------------------------------------------------------------------------
// fp16 form (half_inverse).
// ---------------------------------------------------------------------------------------------

// The inverse may take fp16 operands where the keys are l2-normalised (see the top of this file);
// which kernels do is decided at the call (intra_chunk_math.cuh, step 7).
constexpr bool half_inverse(bool l2norm) { return l2norm; }

// The fp16 A fragment of k-step ks (columns 16 ks .. 16 ks + 15) of an m64nN accumulator-layout
// array: lane (g4, t4) gives rows g4 and g4 + 8, columns 2 t4 .. +1 and 8 + 2 t4 .. +1.
template <int N>
__device__ __forceinline__ void half_fragment(const float (&x)[N], int ks, uint32_t (&a)[4], float sign = 1.f) {
#pragma unroll
  for (int q = 0; q < 4; ++q) a[q] = float2_to_half2(sign * x[8 * ks + 2 * q], sign * x[8 * ks + 2 * q + 1]);
}

// Writes an m64n64 accumulator X as the fp16 MN-major B operand of a product with it on the
// right (B[k][n] = X[k][n]: row k of the SW128 tile holds the 64 n, 128 bytes). A warp's 16 rows
// by 64 columns are sixteen 8x8 fp16 matrices in accumulator layout, (n8, h2) holding rows
// 16 warp + 8 h2 .. +7 and columns 8 n8 .. +7: four stmatrix calls of four matrices each, (n8,
// h2) = (2 p + m / 2, m % 2) for matrix m of call p; each matrix row is one 16-byte chunk of the
// swizzled tile.
__device__ __forceinline__ void store_half_operand(uint8_t* tile, const float (&x)[32], int warp, int lane) {
  const int m = lane >> 3;
  const int row = kSubBlock * warp + 8 * (m & 1) + (lane & 7);
  const uint32_t base = smem_u32(tile);
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const int n8 = 2 * p;
    stmatrix_x4(base + sw128_chunk_offset(row, n8 + (m >> 1)), float2_to_half2(x[n8 * 4], x[n8 * 4 + 1]),
                float2_to_half2(x[n8 * 4 + 2], x[n8 * 4 + 3]), float2_to_half2(x[n8 * 4 + 4], x[n8 * 4 + 5]),
                float2_to_half2(x[n8 * 4 + 6], x[n8 * 4 + 7]));
  }
}

// The fp16 A fragments of k-steps [kBegin, kEnd) of X (times `sign`), formed before the
// products' fence (registers written after `wgmma.fence` make ptxas serialise the WGMMAs).
template <int kBegin, int kEnd, int N>
__device__ __forceinline__ void half_fragments(const float (&x)[N], uint32_t (&a)[kEnd - kBegin][4],
                                               float sign = 1.f) {
  static_assert(8 * kEnd <= N, "fragment source too short");
#pragma unroll
  for (int ks = kBegin; ks < kEnd; ++ks) {
    half_fragment(x, ks, a[ks - kBegin], sign);
    fence_fragment(a[ks - kBegin]);
  }
}

// acc += A * B over the fp16 k-steps [kBegin, kEnd) (A: half_fragments; B a tile at b_desc:
// K-major, 32 bytes per k-step, or MN-major, 16 rows of 128 bytes per k-step). The caller fences,
// commits and waits.
template <int kBegin, int kEnd, Major kMajorB>
__device__ __forceinline__ void issue_half_product(uint64_t b_desc, const uint32_t (&a)[kEnd - kBegin][4],
                                                   float (&acc)[32]) {
#pragma unroll
  for (int ks = kBegin; ks < kEnd; ++ks)
    wgmma_rs_f16<64, kMajorB>(a[ks - kBegin], desc_advance(b_desc, kMajorB == Major::K ? ks * 32 : ks * kSubBlock * 128),
                              acc, true);
}

// As invert_unit_lower, with fp16 operands (half_inverse). The 16 KB tile holds two 8 KB B
// operands (one box each): D (K-major) and then N^2 (MN-major) in the first, N (MN-major) in the second, so
// a round's operand is written while the other half may still be read.
__device__ __forceinline__ void invert_unit_lower_half(float (&a_off)[24], float* diag, uint8_t* tile,
                                                       NamedBarrierId bar, int tid, float (&m)[32],
                                                       PhaseTimer& timer) {
  const int warp = tid >> 5, lane = tid & 31;
  const int g4 = lane >> 2, t4 = lane & 3;
  uint8_t* const tile_d = tile;              // D, then N^2
  uint8_t* const tile_n = tile + kBoxBytes;  // N
  static_assert(kChunk * kChunk * 2 == kBoxBytes && 2 * kBoxBytes <= kTileBytes,
                "two fp16 64x64 operands fit the 16 KB tile");
  float* my_diag = diag + warp * kDiagBlockFloats;

  {
    const int c = lane & 15;
    float x[kSubBlock];
    substitute_diag_block(my_diag, lane, x);
    // B operand of N = A_o D, K-major: row n = 16 w + c holds the 64 k as eight 16-byte chunks,
    // block w's 16 in chunks 2 w and 2 w + 1 (x), zeros elsewhere; lane half h writes chunks
    // 4 h .. 4 h + 3.
    const int n = kSubBlock * warp + c, h = lane >> 4;
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int s = 4 * h + jj - 2 * warp;
      uint4 val = make_uint4(0u, 0u, 0u, 0u);
      if (s == 0)
        val = make_uint4(float2_to_half2(x[0], x[1]), float2_to_half2(x[2], x[3]), float2_to_half2(x[4], x[5]),
                         float2_to_half2(x[6], x[7]));
      if (s == 1)
        val = make_uint4(float2_to_half2(x[8], x[9]), float2_to_half2(x[10], x[11]), float2_to_half2(x[12], x[13]),
                         float2_to_half2(x[14], x[15]));
      *reinterpret_cast<uint4*>(tile_d + sw128_chunk_offset(n, 4 * h + jj)) = val;
    }
  }
  fence_smem_to_async_proxy();
  named_barrier_sync(bar, 128);
  timer.mark(7);

  // N = A_o D (A_o's column block 3 is zero: k-steps 0..2).
  float nn[32];
#pragma unroll
  for (int r = 0; r < 32; ++r) nn[r] = 0.f;
  uint32_t a_frag[3][4];
  half_fragments<0, 3>(a_off, a_frag);
  fence_accumulators(nn);
  wgmma_fence();
  issue_half_product<0, 3, Major::K>(desc_k_major(smem_u32(tile_d)), a_frag, nn);
  wgmma_commit();
  wgmma_wait<0>();
  fence_accumulators(nn);
  timer.mark(8);
  store_half_operand(tile_n, nn, warp, lane);  // the other half: D may still be read
  fence_smem_to_async_proxy();

  // D as an m64n64 array (its block w, zero elsewhere): the accumulator of Y = D - D N, and
  // (negated, fp16, before the products write y) its A operand.
  float y[32];
  load_block_diagonal(my_diag, warp, g4, t4, y);
  float n2[32];
#pragma unroll
  for (int r = 0; r < 32; ++r) n2[r] = 0.f;
  named_barrier_sync(bar, 128);  // N complete; every warp's N product has read D

  // N^2 = N N (k-steps 1..2: N's rows of block 0 and columns of block 3 are zero) and
  // Y = D - D N (k-steps 1..3), one batch: both read the N tile.
  const uint64_t n_desc = desc_mn_major(smem_u32(tile_n), kBoxBytes);
  uint32_t n_frag[2][4], d_frag[3][4];
  half_fragments<1, 3>(nn, n_frag);
  half_fragments<1, 4>(y, d_frag, -1.f);  // -D
  fence_accumulators(n2);
  fence_accumulators(y);
  wgmma_fence();
  issue_half_product<1, 3, Major::MN>(n_desc, n_frag, n2);
  issue_half_product<1, 4, Major::MN>(n_desc, d_frag, y);
  wgmma_commit();
  wgmma_wait<0>();
  fence_accumulators(n2);
  fence_accumulators(y);
  timer.mark(9);
  store_half_operand(tile_d, n2, warp, lane);  // over D: every warp's N product is complete
  fence_smem_to_async_proxy();
#pragma unroll
  for (int r = 0; r < 32; ++r) m[r] = y[r];
  named_barrier_sync(bar, 128);

  // M = Y + Y N^2 (N^2 has rows in blocks 2..3 only).
  uint32_t y_frag[2][4];
  half_fragments<2, 4>(y, y_frag);
  fence_accumulators(m);
  wgmma_fence();
  issue_half_product<2, 4, Major::MN>(desc_mn_major(smem_u32(tile_d), kBoxBytes), y_frag, m);
  wgmma_commit();
  wgmma_wait<0>();
  fence_accumulators(m);
}

}  // namespace cula::kda::sm90
