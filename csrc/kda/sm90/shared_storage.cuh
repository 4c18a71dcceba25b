// Shared-memory plan of the fused KDA prefill kernel (one CTA, 227 KB budget).
//
// A "stage" holds one chunk (64 tokens) of one (sequence, value head) tile. TMA fills q, k, v, g;
// the intra-chunk warpgroup then rewrites the stage in place into what the state warpgroups
// consume, so the stage itself is the hand-off buffer and no second copy is needed:
//
//   slot   loaded by TMA      after the intra-chunk pass            read by
//   q      q (bf16)           QE = q*e      -> QG = q*exp2(G)        A_qk (intra) -> q~·S (state)
//   k      k (bf16)           KE = k*e      -> KG (-> -W = -M·KG)    A_kk (intra) -> KG·S (state; W·S)
//   g      g (bf16)           KT = k*f                               A_qk/A_kk (intra), S update (state)
//   v      v (bf16)           v             (-> U = ((M-I)·β)·v + β·v) β·v (state; U: v_new)
//   (parenthesised: the cooperative helpers only; the fused kernels hand M - I over in the intra
//   scratch instead, kMTileOffset, and the state warpgroups form v_new = M (β·v - KG·S))
//   aqk    -                  A_qk (bf16, masked)                    o (state)
//          (prep ahead: the prep's scratch until the intra-chunk warpgroup writes A_qk, chunk_prep.cuh)
//   R      -                  r_b = G at the end of each 16-row block (fp32 [4][128]; the
//                             cooperative helpers replace the last row by exp2(r_3), the owners'
//                             decay of S over the chunk)
//   beta   beta (fp32, 0 past the sequence end), written by the producer warp
//
// (e = exp2(G - r_b) >= 1, f = exp2(r_b - G) <= 1 per element; see docs/kernel.md.)
#pragma once

#include <cstddef>
#include <cstdint>

namespace cula::kda::sm90 {

// The four warpgroups of a CTA, by role (warpgroup index = threadIdx.x / 128).
enum class WarpgroupRole : int {
  kProducer = 0,  // one warp: TMA loads of q, k, v, g and the beta stores (load_producer.cuh)
  kIntra = 1,     // everything chunk-local: gates, A matrices, inverse (and W, U in the cooperative helpers)
  kState0 = 2,    // the recurrence for value columns 0..63 (state_math.cuh)
  kState1 = 3,    // the recurrence for value columns 64..127
};
constexpr int kWarpgroupThreads = 128;
// First thread of a role's warpgroup.
constexpr int first_thread(WarpgroupRole role) { return int(role) * kWarpgroupThreads; }

constexpr int kChunk = 64;           // tokens per chunk
constexpr int kHeadDim = 128;        // K == V
constexpr int kSubBlock = 16;        // rows per sub-block (one warp of a warpgroup)
constexpr int kNumSubBlocks = kChunk / kSubBlock;
constexpr int kStages = 2;
// One work tile: a (sequence, value head) pair and where its sequence lies (tile_scheduler.cuh).
struct TileInfo {
  int seq;         // sequence index n (-1: no tile left)
  int v_head;      // hv
  int qk_head;     // hv / (HV / H)
  int length;      // tokens in the sequence (may be 0)
  int64_t token0;  // first token of the sequence in the flattened [B*T] token axis
};

constexpr int kTileSlots = 4;        // longest-first schedule: tiles the producer may announce ahead

constexpr int kTileBytes = kChunk * kHeadDim * 2;  // one 64x128 bf16 tile = 16 KB (two 64x64 boxes)
constexpr int kBoxBytes = kChunk * 64 * 2;         // 8 KB

struct alignas(1024) StageStorage {
  alignas(1024) uint8_t q[kTileBytes];
  alignas(1024) uint8_t k[kTileBytes];
  alignas(1024) uint8_t g[kTileBytes];
  alignas(1024) uint8_t v[kTileBytes];
  alignas(1024) uint8_t aqk[kChunk * kChunk * 2];  // 64x64 bf16, one box
  float r_block[kNumSubBlocks][kHeadDim];          // log2 cumulative decay at each block end
  float beta[kChunk];
  float aqk_diag[kChunk];  // A_qk[i, i] = q_i . k_i in fp32 (0 past the end); applied by the state WGs
  // Cooperative helpers only (chunk_workspace.cuh): what the producer announces with each chunk.
  // Past the workspace copy (kWorkspaceStageBytes), so never written to global memory.
  int rows;     // valid rows of the chunk (1..64), or -1: no chunk left for this CTA
  int ws_slot;  // the chunk's workspace slot within its value head
  int ws_head;  // and that value head
  // Prep ahead with general gates (chunk_prep.cuh): bit 0 / 1 set where feature 2 cp / 2 cp + 1 of
  // block b is wide (its factors referenced to the block's start, not its end).
  uint8_t wide_pair[kNumSubBlocks][kHeadDim / 2];
  // Fused kernels with the fp16 A_qk (aqk_is_half): each state warpgroup's per-warp max |v_new|.
  float vnew_max[2][4];
};

// A_qk in fp16 instead of bf16 (8x finer rounding; o error 3.1 -> 2.9e-3 with v_new's fp16 copy in
// its product: scripts/error_budget.py, and measured on the index rows of the benchmark) where its
// range is known: with l2-normalised q and k every |A_qk[i, j]| <= |q_i| |k_j| <= 1. The fused
// kernels (index order and longest first): their state warpgroups take A_qk v_new in fp16
// (state_math.cuh). The cooperative owners keep bf16. (The longest-first kernels measured 12-19 %
// slower with fp16 while their code was past ~172 KB, most likely instruction-cache misses; with
// one hot call site of the prep, state_math.cuh, they are ~150 KB: docs/perf-notes.md.)
// M folded into the state chain (intra_chunk_math.cuh step 8, state_math.cuh (c)): the fused
// kernels (prep ahead). The one switch for the intra-chunk warpgroup (it writes M - I instead of
// W and U), the state warpgroups (v_new = M (beta v - KG S)) and the kernel (m_tile_empty_bar).
constexpr bool fold_m(bool prep_ahead) { return prep_ahead; }

constexpr bool aqk_is_half(bool prep_ahead, bool l2norm, bool longest_first) {
  (void)longest_first;
  return prep_ahead && l2norm;
}
// The cooperative mode (helpers write the stage, owners take A_qk v_new with v_new^T from registers,
// owner_state_math.cuh): the same fp16 A_qk where l2norm bounds it. The one switch for both sides.
constexpr bool coop_aqk_is_half(bool l2norm) { return l2norm; }

// Early slot release (the fused kernels; load_producer.cuh, state_math.cuh): the producer reloads a stage's k
// and q slots as soon as the state warpgroups free them (SharedStorage::k_empty_bar,
// q_empty_bar), not with the rest of the stage at the end of their chunk, so that only g's box
// is left to land when the next prep waits for the stage (`full`). Measured in same-call
// standalone A/Bs on an H100 (docs/perf-notes.md, "Where it stands (tenth session)"): safe gates
// B2 T8192 H64 -2..-3 %, B8 -2..-3 %, GVA -1.5..-2.5 %, softplus (index order) B2 -2.5..-3 %;
// the general-gate longest-first kernels measured +2..+5 % with it (B8), so they keep the
// one release. The one switch for the producer, the state warpgroups and the kernel.
constexpr bool early_slot_release(bool prep_ahead, bool longest_first, bool safe_gate) {
  return prep_ahead && (safe_gate || !longest_first);
}

// Cooperative mode: the part of a finished stage that the state warpgroups need (q..aqk_diag
// above, in shared-memory byte layout, swizzle included), copied to and from global memory as
// one bulk copy per chunk.
constexpr int kWorkspaceStageBytes = 4 * kTileBytes + kChunk * kChunk * 2 + kNumSubBlocks * kHeadDim * 4 + 2 * kChunk * 4;
static_assert(kWorkspaceStageBytes % 16 == 0, "bulk copies move multiples of 16 bytes");

static_assert(offsetof(StageStorage, aqk_diag) + sizeof(StageStorage::aqk_diag) == kWorkspaceStageBytes,
              "the workspace copy of a stage is q, k, g, v, aqk, r_block, beta, aqk_diag, in that order");

struct alignas(1024) SharedStorage {
  StageStorage stage[kStages];

  // Intra-chunk scratch (single-buffered; the state warpgroups read only the M tile there, fold_m).
  alignas(1024) uint8_t inverse_operand[kTileBytes];  // B operands of the inverse's products (tf32 or fp16)
  // General gates: each (block, feature)'s factor reference, r_b or r_{b-1} (intra_chunk_math.cuh).
  float a_ref[kNumSubBlocks][kHeadDim];
  alignas(1024) uint8_t intra_scratch[8192];           // see the offsets below

  // State warpgroups: one half of the value dimension each.
  alignas(1024) uint8_t state_bf16[2][kHeadDim * 64 * 2];  // S (bf16) as WGMMA B operand; o staging
  alignas(1024) uint8_t v_new[2][kChunk * 64 * 2];         // v_new (bf16) as WGMMA B operand

  // Longest-first schedule: the producer announces each tile it fetched (TileInfo) to the math warpgroups through a small ring (tile_scheduler.cuh).
  TileInfo tile_slot[kTileSlots];
  uint64_t tile_full_bar[kTileSlots];   // producer -> math warpgroups
  uint64_t tile_empty_bar[kTileSlots];  // math warpgroups -> producer

  uint64_t full_bar[kStages];   // TMA -> intra (prep ahead: TMA -> state, chunk_prep.cuh)
  uint64_t prepped_bar[kStages];  // prep ahead: state (steps 1-3 of the stage's chunk) -> intra
  uint64_t ready_bar[kStages];  // intra -> state
  uint64_t empty_bar[kStages];  // state -> producer
  // Cooperative helpers (chunk_workspace.cuh): the stage in two halves. The head (QG in the q slot,
  // KT' in the g slot, A_qk) is final after step 6; the storer copies it while the intra-chunk
  // warpgroup inverts, and the producer loads the next chunk's q and g into the freed slots.
  uint64_t head_ready_bar[kStages];  // intra (after step 6) -> storer
  uint64_t head_empty_bar[kStages];  // storer (head copied out) -> producer
  // Fused kernels: the state warpgroups have read the M tile (kMTileOffset) of the intra-chunk
  // warpgroup's last chunk, which may write its scratch again (state -> intra).
  uint64_t m_tile_empty_bar;
  // Fused kernels: v alone (TMA -> state). `full` carries q, k, g and beta, all that the prep
  // ahead reads (chunk_prep.cuh), so the prep waits for 48 KB of the stage's reload, not 64; v
  // is read only by the chunk's state work, an intra-chunk pass later (load_producer.cuh).
  uint64_t v_full_bar[kStages];
  // Fused kernels: the stage's k slot (KG: read by the state warpgroups' first product only) and
  // its q slot (QG: read by the output product) are free before the rest of the stage, and the
  // producer reloads each as soon as it is (state -> producer; load_producer.cuh). `empty` then
  // frees g, v and the small arrays.
  uint64_t k_empty_bar[kStages];
  uint64_t q_empty_bar[kStages];
  // The pair form (pair_intra_math.cuh), rank 1 only: rank 0's prep of the stage's chunk is done
  // with its scratch in rank 0's A_qk slot, so rank 1 may copy its A_qk there (rank 0's prep
  // warpgroup -> rank 1's intra-chunk warpgroup, a remote arrive).
  uint64_t peer_prepped_bar[kStages];
};

// Intra scratch: the l2-norm reciprocals and the row statistics (steps 1-3), then the fp32
// diagonal blocks of A_kk / of the inverse (steps 5-7) over them, both dead by then; in the fused
// kernels the M tile (step 8) over those.
constexpr int kRnormOffset = 0;                 // float[128]: q rows 0..63, k rows 64..127
constexpr int kRowStatsOffset = 4096;           // float[3][2][64]: q.q, k.k, q.k per row and half
constexpr int kDiagOffset = 0;                  // float[4][16][20]
// Fused kernels (prep ahead): M - I of the chunk last handed to the state warpgroups, bf16 64x64,
// K-major SW128 (one box) over the whole scratch, from the end of the inverse until the state
// warpgroups arrive on m_tile_empty_bar (intra_chunk_math.cuh step 8, state_math.cuh (c)).
constexpr int kMTileOffset = 0;
static_assert(kMTileOffset + kChunk * kChunk * 2 <= 8192, "the M tile must fit in the intra scratch");
static_assert(kRowStatsOffset >= 128 * 4 && kRowStatsOffset + 6 * 64 * 4 <= 8192 && 4 * 16 * 20 * 4 <= 8192,
              "intra scratch must fit");

constexpr int kSharedBytes = int(sizeof(SharedStorage)) + 1024;  // + alignment slack
static_assert(kSharedBytes <= 232448, "shared memory plan exceeds the 227 KB of an SM90 CTA");
// desc_advance (sm90_primitives.cuh) adds offsets to a WGMMA descriptor's 14-bit start-address
// field (16-byte units), exact only below 2^18 bytes of shared memory.
static_assert(kSharedBytes <= (1 << 18), "WGMMA descriptors address at most 256 KB of shared memory");

}  // namespace cula::kda::sm90
