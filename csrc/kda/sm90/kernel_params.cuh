// Kernel arguments: the problem description plus the TMA descriptors built on the host.
// Passed as one __grid_constant__ parameter so the descriptors live in parameter space, where
// TMA can read them without a copy to global memory.
#pragma once

#include <cuda.h>

#include "kda_params.h"

namespace cula::kda::sm90 {

constexpr int kSortMaxSeqs = 4096;  // sequences the longest-first schedule sorts (tile_scheduler.cuh)

// Global workspace of the longest-first schedule, one per (device, stream), allocated and zeroed
// once by the host (kda_prefill_dispatch.cu). The kernel hands out tiles with an atomic counter
// and the last CTA to finish sets both counters back to zero, so the next launch on the stream
// (or the next replay of a CUDA graph) finds the workspace as the first one did.
struct ScheduleWorkspace {
  int next_tile;   // tiles handed out so far in this launch (+1 per CTA for the fetch that found none)
  int ctas_done;   // CTAs that found no tile left
  int pad[30];     // the counters get their own 128-byte line
  int sorted_seq[kSortMaxSeqs];  // sequences, most chunks first (every CTA writes the same values)
};

// How a launch divides the work (kda_prefill_kernel.cuh):
//   kFused        one CTA per (sequence, value head) tile runs everything (producer, intra-chunk,
//                 state warpgroups)
//   kCooperative  few tiles (kda_prefill_dispatch.cu): one CTA per SM. CTA b < tiles owns tile b
//                 and runs only its recurrence (producer + state warpgroups) on finished stages
//                 read from a workspace; the other CTAs, the helpers, claim chunks of the tiles,
//                 run the intra-chunk work on them and publish each finished stage there with a
//                 flag (chunk_workspace.cuh). The chunk-local work of a tile then runs on many
//                 SMs at once instead of on its owner's one intra-chunk warpgroup. Two forms
//                 (CooperativePlan::helper_kernel): one kernel with both roles, or two kernels
//                 over the same CTA index space (kda_prefill_kernel.cuh): the helpers' first
//   kCoopHelpers  (it never waits on an owner; two intra-chunk warpgroups per helper), then the
//                 kCooperative kernel for the owners, by programmatic dependent launch so that it
//                 starts while the helpers run (CooperativePlan::overlap_owners).
//   kFusedPair    few tiles (2 x tiles <= SMs), safe gates: one tile on a cluster of two CTAs,
//                 each on its 64 of the value columns, the intra-chunk chain split between them
//                 by matrix (pair_intra_math.cuh).
enum class KernelPass : int { kFused = 0, kCooperative = 1, kCoopHelpers = 2, kFusedPair = 3 };

// The value split's rule (CooperativePlan::value_split), one function for the host (fixed length:
// every tile alike, decided once per launch) and the device (varlen: tile_has_two_owners in
// tile_scheduler.cuh, per tile). A tile gets a second owner when its one-owner chain, 2.6 us per
// chunk, would outlast the helpers' share of all chunks, counting the fewest helpers the launch can
// have (every tile with two owners): mine x 2.6 x helpers > total x h, with the helpers at h =
// 7.5 us per chunk with safe gates (H100, each form in blocks of consecutive calls at 2e14148's
// kernels: a second owner measured faster up to 26 equal tiles of T4096-T16384 and slower from 28,
// docs/perf-notes.md) and 12 with general gates (not re-measured). In tenths of a microsecond, so
// that the comparison stays in integers on both sides.
__host__ __device__ constexpr bool value_split_pays(int64_t mine, int64_t total, int64_t helpers, bool general_gates) {
  return mine * 26 * helpers > total * (general_gates ? 120 : 75);
}

// Cooperative mode. The workspace holds one finished stage (kWorkspaceStageBytes) per chunk slot
// and value head. Chunk c of sequence n (first token t0) has slot t0 / 64 + n + c within its head:
// slots of consecutive sequences never overlap (floor(t0' / 64) + 1 >= floor(t0 / 64) +
// ceil(len / 64) for t0' = t0 + len), and every slot is below ceil(T / 64) + N whatever the
// (clamped) cu_seqlens values are. `sync` (zero when a launch starts: the stream's sync area, or the
// workspace's first bytes; kda_prefill_dispatch.cu: stream_sync_area) holds a published flag per
// (value head, slot), [HV][slots_per_head], then a claim counter per tile, [tiles].
//
// Value split: the state's value columns never mix, so a tile may have two owners, CTAs 2t and
// 2t + 1, each running one state warpgroup on its half of the columns (the other exits) on the
// same published stages. Each owner then issues half of the tile's tensor-core work per chunk, so
// the state chain, which sets the pace once a tile has enough helpers, gets shorter; the price is
// a second read of each stage (from L2) and one SM per tile fewer among the helpers.
//
// With value_split == 2 the CTAs [0, 2 tiles) are the owner region; with split_on_device the
// kernel decides per tile whether CTA 2t + 1 is tile t's second owner or a helper
// (tile_has_two_owners in tile_scheduler.cuh: a model of the launch's time from the sequence
// lengths, which only the device reads), so one long prompt batched with short ones gets two
// owners for its heads and the short ones give their second CTA to the helpers. Without it every
// tile of the region has two owners (CULA_KDA_VALUE_SPLIT=2).
//
// Segments (segments = G >= 3, for very few tiles): each tile's chunks are cut into G segments
// of ceil(chunks / G) chunks, and the state chain runs on all of them at once. A segment's effect
// on the state is affine, S_out = P S_in + Q, because each value column of S evolves on its own
// through the same K x K maps: Q is the chain from S = 0, P the chain with U = 0 from S = I (its
// "value columns" are the K columns of I). Segment 0 runs from the true initial state and
// publishes its final state (fp32). Each middle segment has four owner CTAs of one state
// warpgroup each: two chain Q over the value halves while two chain P over the halves of I's
// columns (publishing P^T in fp32); then, in segment order, the Q-owners take S_in = S_out of the
// segment before, publish S_out = P S_in + Q (fp32, CUDA cores) for the next, and rerun their
// segment from S_in for the outputs. The last segment waits for its S_in and runs once, giving
// the final state. Chain time ~ 2 chunks / G steps + (G - 2) fix-ups instead of chunks steps.
// The owner region is 4 G CTAs per tile ([Q half 0, Q half 1, P half 0, P half 1] per segment;
// the first and last segments' P CTAs help); claim counters, P^T and S_out^T are per (tile,
// segment) unit.
struct CooperativePlan {
  int64_t slots_per_head = 0;  // ceil(tokens / 64) + N
  int tiles = 0;               // (sequence, value head) tiles; 0 in the fused kernel
  int value_split = 1;         // CTAs per tile in the owner region: 1, or 2 (one state warpgroup each)
  bool split_on_device = false;  // value_split == 2: each tile's second CTA is an owner or a helper by the model
  int segments = 1;            // G: segments per tile (1: none; then owners = tiles x value_split)
  int owners = 0;              // CTAs [0, owners) are the owner region (tiles x 4 G with segments)
  // Tiles per owner CTA (value_split == 1 and segments == 1 only): owner b runs tiles b, b + owners,
  // b + 2 owners, ... one after another, where the helpers, not the owners' chains, bound the
  // launch (many tiles): fewer owners leave more SMs to the helpers. The helpers then take the
  // tiles of the first round (tile < owners) before those of the next (pick_helper_unit), so each
  // owner's current tile is the one being computed.
  int tiles_per_owner = 1;
  bool helper_kernel = true;   // the helpers in a kernel of their own (KernelPass::kCoopHelpers)
  int helper_intra = 2;        // intra-chunk warpgroups per helper CTA: 1, or 2 (helper_kernel only; warpgroups 1 and 2, one stage each)
  // Launch the owners' kernel with programmatic stream serialization, so that it starts once every
  // helper CTA runs; false: after the helpers' kernel ends (slower, same results).
  bool overlap_owners = true;
  // Helpers (chunk_workspace.cuh): release a stage once the storer's copy has read it.
  bool early_release = true;
  // Helpers whose unit ran out take the unit with the most unclaimed chunks (pick_helper_unit),
  // instead of one drawn in proportion to them (the host's rule: kda_prefill_dispatch.cu).
  bool pick_most = false;
  // Warm code (helper_kernel only): the helpers' kernel's owner-region CTAs, whose SMs the owners'
  // kernel takes only once they exit, first run the helpers' intra-chunk code once without data
  // (kda_prefill_kernel.cuh), each warpgroup from one of several steps, so that the code is in L2
  // when the helpers' chains reach it: their first chunk otherwise runs on code fetched from HBM
  // (~31 us claim to tail against ~18 us later, H100). The number of entry steps, taken in turn
  // (kda_prefill_kernel.cuh: warm_entry): 0 = off, 5 = steps 4-8, 6 = steps 1 and 4-8.
  int warm_entries = 0;
  int* sync = nullptr;         // flags and counters (zeroed per launch)
  float* matrices = nullptr;   // segments: P^T then S_out^T, [tiles x G][128 x 128] fp32 each
  void* timeline = nullptr;    // -DCULA_KDA_TIMELINE builds only (timeline.cuh); null otherwise
};

struct KdaKernelParams {
  CUtensorMap tma_q;  // [tokens, H, K]  box 64 x 1 x 64, 128B swizzle
  CUtensorMap tma_k;  // [tokens, H, K]
  CUtensorMap tma_v;  // [tokens, HV, V]
  CUtensorMap tma_g;  // [tokens, HV, K]
  KdaPrefillParams problem;
  ScheduleWorkspace* schedule = nullptr;  // longest-first schedule only
  CooperativePlan coop;                    // cooperative mode only (problem.workspace holds the stages)
};

}  // namespace cula::kda::sm90
