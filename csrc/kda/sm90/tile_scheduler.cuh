// Tile scheduler: a work tile is one (sequence n, value head hv) pair; its query/key head is
// hv / (HV / H) (grouped value attention). Every role of a CTA walks the same tile sequence, so
// each derives the same (tile, chunk) order without talking to the others.
//
// Tiles are numbered head-fastest (t = n * HV + hv), so the value heads of one sequence, which
// share q/k loads within a group, run at the same time and hit in L2. The grid is
// min(num_tiles, grid_limit) CTAs striding over the tiles: with grid_limit >= num_tiles that is one
// tile per CTA and the hardware hands CTAs to SMs as they free up (dynamic balance for varlen);
// a smaller grid makes the CTAs persistent. Sequence bounds are read from cu_seqlens on the
// device, so building the tile list needs no host synchronisation.
#pragma once

#include <cstdint>

#include "kda_params.h"
#include "shared_storage.cuh"

namespace cula::kda::sm90 {

struct WorkTile {
  int seq;        // sequence index n
  int v_head;     // hv
  int qk_head;    // hv / (HV / H)
  int64_t token0; // first token of the sequence in the flattened [B*T] token axis
  int length;     // tokens in the sequence (may be 0)
  __device__ int num_chunks() const { return (length + kChunk - 1) / kChunk; }
  // Valid rows of chunk c (1..64).
  __device__ int chunk_rows(int c) const { return min(kChunk, length - c * kChunk); }
};

struct TileScheduler {
  const KdaPrefillParams* p;
  int num_tiles;
  int heads_per_group;

  __device__ explicit TileScheduler(const KdaPrefillParams& params)
      : p(&params),
        num_tiles(params.num_seqs * params.num_v_heads),
        heads_per_group(params.num_v_heads / params.num_qk_heads) {}

  __device__ int first() const { return blockIdx.x; }
  __device__ int next(int t) const { return t + gridDim.x; }
  __device__ bool valid(int t) const { return t < num_tiles; }

  __device__ WorkTile decode(int t) const {
    WorkTile w;
    w.seq = t / p->num_v_heads;
    w.v_head = t - w.seq * p->num_v_heads;
    w.qk_head = w.v_head / heads_per_group;
    if (p->cu_seqlens == nullptr) {
      w.token0 = int64_t(w.seq) * p->seqlen;
      w.length = p->seqlen;
    } else if (p->cu_seqlens_is_int64) {
      const int64_t* cu = static_cast<const int64_t*>(p->cu_seqlens);
      w.token0 = cu[w.seq];
      w.length = int(cu[w.seq + 1] - cu[w.seq]);
    } else {
      const int32_t* cu = static_cast<const int32_t*>(p->cu_seqlens);
      w.token0 = cu[w.seq];
      w.length = cu[w.seq + 1] - cu[w.seq];
    }
    return w;
  }
};

// (stage, phase) iterator over the shared-memory ring, advanced once per chunk by every role.
struct PipelineState {
  int stage = 0;
  uint32_t phase = 0;
  __device__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

}  // namespace cula::kda::sm90
