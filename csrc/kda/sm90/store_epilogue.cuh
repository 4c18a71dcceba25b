// Global-memory side of the state warpgroups: the recurrent state in and out (fp32, "kv" or "vk"
// layout) and the output tile o (bf16) through a shared-memory staging tile and 16-byte stores.
//
// Register layout of the state: a state warpgroup owns the 64 value columns [64 h, 64 h + 64) of
// S [K=128, V=128] as two m64n64 accumulators (rows 0..63 and 64..127 of K). Thread (warp w,
// lane) holds, for mh in {0,1}, n8 in 0..7, h2 in {0,1}, e in {0,1}:
//   S[mh][n8*4 + h2*2 + e] = S[64 mh + 16 w + lane/4 + 8 h2][64 h + 8 n8 + 2 (lane%4) + e].
#pragma once

#include <type_traits>

#include "kernel_params.cuh"
#include "shared_storage.cuh"
#include "sm90_primitives.cuh"
#include "tile_scheduler.cuh"

namespace cula::kda::sm90 {

struct StateFragment {
  float acc[2][32];
};

// Where the states of a tile live: the slot of its sequence (n, or state_indices[n] for a state
// pool), or a pad (no state read, none written).
struct StateSlot {
  int64_t offset;  // elements from the state base to this (slot, value head)
  bool pad;        // slot outside [0, num_state_slots): zeros in, nothing out
  bool read;       // start from the stored state (else zeros)
};

__device__ __forceinline__ StateSlot state_slot(const KdaPrefillParams& p, const WorkTile& tile) {
  int64_t slot = tile.seq;
  bool pad = false;
  if (p.state_indices != nullptr) {
    slot = p.state_indices_is_int64 ? static_cast<const int64_t*>(p.state_indices)[tile.seq]
                                    : int64_t(static_cast<const int32_t*>(p.state_indices)[tile.seq]);
    pad = slot < 0 || slot >= p.num_state_slots;  // any index value stays inside the pool
  }
  StateSlot r;
  r.pad = pad;
  // state_slot_stride: set by the host (never 0 here).
  r.offset = pad ? 0 : slot * p.state_slot_stride + int64_t(tile.v_head) * kHeadDim * kHeadDim;
  r.read = !pad && p.initial_state != nullptr && (p.has_initial_state == nullptr || p.has_initial_state[tile.seq]);
  return r;
}

// Loads (kLoad) or stores one pair of a state's elements (fp32 or bf16 per Elem) at `gmem`:
// (a, b) and (a, b + 1) of a 128 x 128 matrix whose rows are a. `pair_contiguous`: stored as
// [a][b], so the pair is adjacent (one 8- or 4-byte access); else stored as [b][a].
template <bool kLoad, typename Elem>
__device__ __forceinline__ void state_pair_io(Elem* gmem, bool pair_contiguous, int a, int b, float& x0, float& x1) {
  if (pair_contiguous) {
    Elem* ptr = gmem + a * kHeadDim + b;
    if constexpr (std::is_same_v<Elem, float>) {
      if constexpr (kLoad) {
        const float2 v = *reinterpret_cast<const float2*>(ptr);
        x0 = v.x;
        x1 = v.y;
      } else {
        *reinterpret_cast<float2*>(ptr) = make_float2(x0, x1);
      }
    } else {
      if constexpr (kLoad) {
        const float2 v = bf16x2_to_float2(*reinterpret_cast<const uint32_t*>(ptr));
        x0 = v.x;
        x1 = v.y;
      } else {
        *reinterpret_cast<uint32_t*>(ptr) = float2_to_bf16x2(x0, x1);
      }
    }
  } else {
    Elem* p0 = gmem + b * kHeadDim + a;
    Elem* p1 = gmem + (b + 1) * kHeadDim + a;
    if constexpr (kLoad) {
      x0 = float(*p0);
      x1 = float(*p1);
    } else {
      *p0 = Elem(x0);
      *p1 = Elem(x1);
    }
  }
}

// Loads (kLoad) or stores the thread's state elements at `gmem` (one (slot, head) state, fp32 or
// bf16 per Elem, layout per p.state_vk).
template <bool kLoad, typename Elem>
__device__ __forceinline__ void state_io(const KdaPrefillParams& p, Elem* gmem, StateFragment& s, int half, int warp,
                                         int lane) {
  const int g4 = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int mh = 0; mh < 2; ++mh)
#pragma unroll
    for (int n8 = 0; n8 < 8; ++n8)
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const int kk = 64 * mh + kSubBlock * warp + g4 + 8 * h2;
        const int vv = 64 * half + 8 * n8 + 2 * t4;
        // [K, V] ("kv"): (kk, vv) and (kk, vv + 1) are adjacent.
        state_pair_io<kLoad>(gmem, !p.state_vk, kk, vv, s.acc[mh][n8 * 4 + h2 * 2], s.acc[mh][n8 * 4 + h2 * 2 + 1]);
      }
}

__device__ __forceinline__ void load_initial_state(const KdaPrefillParams& p, const StateSlot& slot,
                                                   StateFragment& s, int half, int warp, int lane) {
  if (!slot.read) {
#pragma unroll
    for (int mh = 0; mh < 2; ++mh)
#pragma unroll
      for (int r = 0; r < 32; ++r) s.acc[mh][r] = 0.f;
    return;
  }
  if (p.initial_state_is_bf16)
    state_io<true>(p, const_cast<__nv_bfloat16*>(static_cast<const __nv_bfloat16*>(p.initial_state)) + slot.offset,
                   s, half, warp, lane);
  else
    state_io<true>(p, const_cast<float*>(static_cast<const float*>(p.initial_state)) + slot.offset, s, half, warp,
                   lane);
}

__device__ __forceinline__ void store_final_state(const KdaPrefillParams& p, const StateSlot& slot, StateFragment& s,
                                                  int half, int warp, int lane) {
  if (p.final_state == nullptr || slot.pad) return;
  if (p.final_state_is_bf16)
    state_io<false>(p, static_cast<__nv_bfloat16*>(p.final_state) + slot.offset, s, half, warp, lane);
  else
    state_io<false>(p, static_cast<float*>(p.final_state) + slot.offset, s, half, warp, lane);
}

// Rows of o that no sequence covers (a padded CUDA-graph bucket: the token axis past
// cu_seqlens[N]) are written with zeros, so o never holds stale memory. Every sequence range
// (seq_range) lies inside [lo, hi), lo = min_n clamp(cu_seqlens[n], 0, T) and hi = max_n of the
// same, whatever the values: the rows outside are covered by no sequence, so these stores never
// race with another CTA's output stores. For valid cu_seqlens lo = cu[0] = 0 and hi = cu[N] (no
// scan: cu[0] <= 0 and cu[N] >= T leave nothing to zero, else each warp scans the N + 1 values;
// with garbage values, clamp(cu[N]) alone could be below rows that a sequence writes). Rows
// inside [lo, hi) that no sequence covers (non-monotone values only) are not zeroed. The state
// warpgroups of the first kZeroTailCtas CTAs share the stores after their last tile: 16-byte
// stores, `thread` in [0, 256), CTAs interleaved.
constexpr int kZeroTailCtas = 512;

// `state_ctas`: the CTAs whose state warpgroups run this, `cta` in [0, state_ctas): the grid, or
// in the cooperative mode the tiles (with a value split, the two owners of a tile are one `cta`,
// each bringing its warpgroup's 128 threads).
__device__ __forceinline__ void zero_uncovered_rows(const KdaPrefillParams& p, int cta, int thread, int state_ctas) {
  if (p.cu_seqlens == nullptr) return;
  const int ctas = min(state_ctas, kZeroTailCtas);
  if (cta >= ctas) return;
  const int total = p.seqlen;
  auto clamped = [&](int n) { return int(min(max(cu_seqlens_at(p, n), int64_t(0)), int64_t(total))); };
  const int first = clamped(0), last = clamped(p.num_seqs);
  if (first == 0 && last == total) return;  // the ranges run from 0 up to T: every row is covered
  int lo = min(first, last), hi = max(first, last);
  for (int n = (thread & 31) + 1; n < p.num_seqs; n += 32) {
    const int c = clamped(n);
    lo = min(lo, c);
    hi = max(hi, c);
  }
  lo = __reduce_min_sync(0xffffffffu, lo);
  hi = __reduce_max_sync(0xffffffffu, hi);
  const int64_t units_per_row = int64_t(p.num_v_heads) * kHeadDim / 8;  // uint4 = 8 bf16
  const int64_t head_units = int64_t(lo) * units_per_row;                // rows [0, lo)
  const int64_t units = head_units + int64_t(total - hi) * units_per_row; // + rows [hi, T)
  const int64_t skip = int64_t(hi - lo) * units_per_row;
  uint4* base = static_cast<uint4*>(p.o);
  for (int64_t u = int64_t(cta) * 256 + thread; u < units; u += int64_t(ctas) * 256)
    base[u < head_units ? u : u + skip] = make_uint4(0u, 0u, 0u, 0u);
}

// The staged o tile [64 rows x 64 value columns of this half, bf16, SW128] -> the rows of o that
// belong to the sequence, as 16-byte stores (after a barrier over the warpgroup's staging writes),
// addressed once per tile: a chunk's stores sit on a warpgroup's dependent path (the cooperative
// owners' chain, the fused state warpgroups' chunk), and computing each row's 64-bit element index
// and swizzled staging offset per store took ~24 integer instructions and a branch around each
// store in the owners' SASS; here one 64-bit add, a load and a predicated store. Thread tid stores
// 16-byte column x = tid % 8 of rows tid / 8 + 16 s (s = 0..3); the swizzle term (x ^ row) & 7 is
// the same for its four rows.
struct OutputRowWriter {
  char* row0;             // o at row tid / 8 of the tile's first chunk, this thread's 8 columns
  int64_t chunk_bytes;    // from a row of one chunk to the same row of the next
  int64_t rows16_bytes;   // from a row to the row 16 below
  uint32_t staging_off;   // byte offset of (row tid / 8, column x) in the staged SW128 tile
  int row;                // tid / 8
  __device__ OutputRowWriter(const KdaPrefillParams& p, const WorkTile& tile, int half, int tid) {
    row = tid >> 3;
    const int x = tid & 7;
    const int64_t row_bytes = int64_t(p.num_v_heads) * kHeadDim * 2;
    row0 = static_cast<char*>(p.o) + (tile.token0 + row) * row_bytes + (int64_t(tile.v_head) * kHeadDim + 64 * half + 8 * x) * 2;
    chunk_bytes = kChunk * row_bytes;
    rows16_bytes = 16 * row_bytes;
    staging_off = sw128_chunk_offset(row, x);
    // Opaque to the compiler from here on: otherwise it folds the addresses back into per-store
    // index products (rematerialisation), the cost this form removes.
    asm volatile("" : "+l"(row0), "+l"(chunk_bytes), "+l"(rows16_bytes));
  }
  // The rows of chunk `chunk` that belong to the sequence, from its staged tile (all four loads;
  // the stores predicated, without branches).
  __device__ __forceinline__ void write(const WorkTile& tile, int chunk, const uint8_t* staging) const {
    const int rows_below = tile.chunk_rows(chunk) - row;  // rows from this thread's first to the chunk's end
    char* dst = row0 + chunk * chunk_bytes;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const uint4 v = *reinterpret_cast<const uint4*>(staging + staging_off + s * 16 * 128);
      asm volatile(
          "{\n .reg .pred p;\n setp.lt.s32 p, %5, %6;\n @p st.global.v4.b32 [%0], {%1, %2, %3, %4};\n}\n" ::"l"(dst),
          "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(16 * s), "r"(rows_below)
          : "memory");
      dst += rows16_bytes;
    }
  }
};

// o tile [64 rows x 64 value columns of this half]: scale, round to bf16, stage in shared memory
// (SW128 layout, conflict-free), then 16-byte stores of the rows that belong to the sequence.
__device__ __forceinline__ void store_output_tile(const KdaPrefillParams& p, const OutputRowWriter& out_rows,
                                                  const WorkTile& tile, int chunk, const float (&o)[32], uint8_t* staging,
                                                  int tid, NamedBarrierId bar) {
  const int warp = tid >> 5, lane = tid & 31;
  const int g4 = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int n8 = 0; n8 < 8; ++n8) {
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const int i = kSubBlock * warp + g4 + 8 * h2;
      *reinterpret_cast<uint32_t*>(staging + sw128_fragment_offset(i, n8, g4, t4)) =
          float2_to_bf16x2(o[n8 * 4 + h2 * 2] * p.scale, o[n8 * 4 + h2 * 2 + 1] * p.scale);
    }
  }
  named_barrier_sync(bar, 128);
  out_rows.write(tile, chunk, staging);
  named_barrier_sync(bar, 128);  // staging is reused as the S operand of the next chunk
}

}  // namespace cula::kda::sm90
