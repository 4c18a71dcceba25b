// Global-memory side of the state warpgroups: the recurrent state in and out (fp32, "kv" or "vk"
// layout) and the output tile o (bf16) through a shared-memory staging tile and 16-byte stores.
//
// Register layout of the state: a state warpgroup owns the 64 value columns [64 h, 64 h + 64) of
// S [K=128, V=128] as two m64n64 accumulators (rows 0..63 and 64..127 of K). Thread (warp w,
// lane) holds, for mh in {0,1}, n8 in 0..7, h2 in {0,1}, e in {0,1}:
//   S[mh][n8*4 + h2*2 + e] = S[64 mh + 16 w + lane/4 + 8 h2][64 h + 8 n8 + 2 (lane%4) + e].
#pragma once

#include "kernel_params.cuh"
#include "shared_storage.cuh"
#include "sm90_primitives.cuh"
#include "tile_scheduler.cuh"

namespace cula::kda::sm90 {

struct StateFragment {
  float acc[2][32];
};

__device__ __forceinline__ int64_t state_offset(const KdaPrefillParams& p, const WorkTile& tile) {
  return (int64_t(tile.seq) * p.num_v_heads + tile.v_head) * kHeadDim * kHeadDim;
}

template <bool kLoad>
__device__ __forceinline__ void state_io(const KdaPrefillParams& p, float* gmem, StateFragment& s, int half,
                                         int warp, int lane) {
  const int g4 = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int mh = 0; mh < 2; ++mh) {
#pragma unroll
    for (int n8 = 0; n8 < 8; ++n8) {
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const int kk = 64 * mh + kSubBlock * warp + g4 + 8 * h2;
        const int vv = 64 * half + 8 * n8 + 2 * t4;
        float& x0 = s.acc[mh][n8 * 4 + h2 * 2];
        float& x1 = s.acc[mh][n8 * 4 + h2 * 2 + 1];
        if (!p.state_vk) {  // [K, V]
          float2* ptr = reinterpret_cast<float2*>(gmem + kk * kHeadDim + vv);
          if constexpr (kLoad) {
            const float2 v = *ptr;
            x0 = v.x;
            x1 = v.y;
          } else {
            *ptr = make_float2(x0, x1);
          }
        } else {  // [V, K]
          float* p0 = gmem + vv * kHeadDim + kk;
          float* p1 = gmem + (vv + 1) * kHeadDim + kk;
          if constexpr (kLoad) {
            x0 = *p0;
            x1 = *p1;
          } else {
            *p0 = x0;
            *p1 = x1;
          }
        }
      }
    }
  }
}

__device__ __forceinline__ void load_initial_state(const KdaPrefillParams& p, const WorkTile& tile, StateFragment& s,
                                                   int half, int warp, int lane) {
  if (p.initial_state == nullptr) {
#pragma unroll
    for (int mh = 0; mh < 2; ++mh)
#pragma unroll
      for (int r = 0; r < 32; ++r) s.acc[mh][r] = 0.f;
    return;
  }
  state_io<true>(p, const_cast<float*>(p.initial_state) + state_offset(p, tile), s, half, warp, lane);
}

__device__ __forceinline__ void store_final_state(const KdaPrefillParams& p, const WorkTile& tile, StateFragment& s,
                                                  int half, int warp, int lane) {
  if (p.final_state == nullptr) return;
  state_io<false>(p, p.final_state + state_offset(p, tile), s, half, warp, lane);
}

// o tile [64 rows x 64 value columns of this half]: scale, round to bf16, stage in shared memory
// (SW128 layout, conflict-free), then 16-byte stores of the rows that belong to the sequence.
__device__ __forceinline__ void store_output_tile(const KdaPrefillParams& p, const WorkTile& tile, int chunk,
                                                  const float (&o)[32], uint8_t* staging, int half, int tid,
                                                  NamedBarrierId bar) {
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
  const int rows = tile.chunk_rows(chunk);
  const int64_t token0 = tile.token0 + int64_t(chunk) * kChunk;
  __nv_bfloat16* o_base = static_cast<__nv_bfloat16*>(p.o);
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const int q = tid + 128 * s;
    const int i = q >> 3, x = q & 7;
    if (i < rows) {
      const uint4 val = *reinterpret_cast<const uint4*>(staging + sw128_chunk_offset(i, x));
      const int64_t idx = ((token0 + i) * p.num_v_heads + tile.v_head) * kHeadDim + 64 * half + 8 * x;
      *reinterpret_cast<uint4*>(o_base + idx) = val;
    }
  }
  named_barrier_sync(bar, 128);  // staging is reused as the S operand of the next chunk
}

}  // namespace cula::kda::sm90
