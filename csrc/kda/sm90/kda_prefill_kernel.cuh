// The fused KDA prefill kernel: one CTA of four warpgroups per (sequence, value head) tile.
//
//   warpgroup 0  producer   one warp issues the TMA loads of each chunk into a 2-stage ring
//   warpgroup 1  intra      A_qk, A_kk, (I + A_kk)^-1 of chunk c+1 (cooperative helpers: also
//                           gates, cumsum, l2norm, W and U)
//   warpgroup 2  state      value columns   0..63: v_new, o and the state update of chunk c
//   warpgroup 3  state      value columns 64..127
//
// Hand-offs are mbarriers per stage: full (TMA -> intra), ready (intra -> state), empty (state ->
// producer). setmaxnreg moves registers from the producer to the math warpgroups. With prep ahead
// (the fused kernels: chunk_prep.cuh) the state warpgroups also run steps 1-3 of chunk c+2 (full
// -> state, then prepped -> intra) before their work on chunk c+1, and (fold_m) take M - I from
// the intra-chunk warpgroup's scratch, releasing it on m_tile_empty_bar (state -> intra); v lands
// on a barrier of its own there (v_full, TMA -> state), as the prep does not read it.
//
// The cooperative mode (fewer tiles than SMs; kernel_params.cuh: KernelPass) runs one CTA per SM:
// in the tile owners (cooperative_role in tile_scheduler.cuh) warpgroup 0's producer reads finished
// stages from the workspace (full -> state directly), warpgroups 2 and 3 run the recurrence (with
// a value split, two owners per tile, each running only its half's warpgroup), and warpgroup 1
// exits at once; in the helpers, warpgroup 0's producer claims chunks, the intra-chunk
// warpgroup(s) turn them into finished stages, and one thread (the storer) publishes each to the
// workspace (chunk_workspace.cuh). Owners and helpers are one kernel (kCooperative), or two:
// the helpers' (kCoopHelpers, two intra-chunk warpgroups per CTA) and the owners' (kCooperative,
// its helper CTAs exiting at once); see the kernel below.
#pragma once

#include "chunk_workspace.cuh"
#include "intra_chunk_math.cuh"
#include "kernel_params.cuh"
#include "load_producer.cuh"
#include "owner_state_math.cuh"
#include "pair_intra_math.cuh"
#include "shared_storage.cuh"
#include "state_math.cuh"

namespace cula::kda::sm90 {

constexpr int kThreads = 512;
constexpr uint32_t kProducerRegs = 24;
constexpr uint32_t kIntraRegs = 168;
constexpr uint32_t kStateRegs = 160;
static_assert(kProducerRegs + kIntraRegs + 2 * kStateRegs <= 65536 / 128, "register budget of one SM");
// The helpers' kernel: no state warpgroups, so its claiming producer keeps more than
// kProducerRegs (at 24 it spilled 52 bytes).
constexpr uint32_t kHelperProducerRegs = 56;
// The helpers' kernel's intra-chunk warpgroups take more: it has no state warpgroups, so its
// budget allows it (producer 56, storer warpgroup 24, two intra warpgroups), and their chain (which
// also runs the prep and forms W and U) needs it for the fp16 inverse: at kIntraRegs ptxas
// serialises every WGMMA of the kernel (C7512). The one-kernel form's helpers keep kIntraRegs and
// the tf32 inverse (intra_chunk_math.cuh says why).
constexpr uint32_t kHelperIntraRegs = 208;
static_assert(kHelperProducerRegs + 2 * kHelperIntraRegs + kProducerRegs <= 65536 / 128, "register budget of a helper CTA");
// The step at which the k-th warm pass enters the helpers' intra-chunk code (intra_chunk:
// warm_from), with n entries in turn (CooperativePlan::warm_entries): the last n of the entry
// steps 1 (the whole chunk), 4 (the A products), 5, 6, 7, 8 (W and U).
__device__ __forceinline__ int warm_entry(int k, int n) {
  const int e = k + 6 - n;  // index into the six entry steps
  return e == 0 ? 1 : e + 3;
}
// Cooperative tile owners (owner_state_math.cuh): no intra-chunk work, so its warpgroup drops to
// kProducerRegs and the state warpgroups take the rest.
constexpr uint32_t kOwnerStateRegs = 232;
static_assert(2 * kProducerRegs + 2 * kOwnerStateRegs <= 65536 / 128, "register budget of an owner CTA");

// The kernel of one pass (kernel_params.cuh: KernelPass).
//   kFused        every role on its tile.
//   kCooperative  the cooperative mode's owners and, in the one-kernel form, its helpers (one
//                 intra-chunk warpgroup each). In the two-kernel form (kp.coop.helper_kernel) its
//                 helper CTAs exit at once and their SMs run:
//   kFusedPair    the fused kernel's roles on a cluster of two CTAs per tile (pair_intra_math.cuh):
//                 per CTA the producer, the intra-chunk warpgroup (its rank's half of the chain),
//                 the state warpgroup of its value half and a prep warpgroup.
//   kCoopHelpers  the helpers' kernel over the same CTA index space, launched first; its
//                 owner-region CTAs exit at once. Two intra-chunk warpgroups per helper on one
//                 copy of the intra code: one call site entered by warpgroups 1 and 2, which
//                 ptxas compiles with asynchronous WGMMAs only where no owner code shares the
//                 kernel (C7518 in docs/perf-notes.md). (An owners-only kernel, with the intra
//                 code removed, gets C7518 itself, so the owners stay in the kCooperative kernel.)
template <bool kGateInKernel, bool kL2Norm, bool kLongestFirst, KernelPass kPass, Decays kDecays>
__global__ void __launch_bounds__(kThreads, 1) kda_prefill_sm90_kernel(const __grid_constant__ KdaKernelParams kp) {
  static_assert(kPass == KernelPass::kFused || !kLongestFirst, "the cooperative mode uses index order for its owners");
  static_assert(kPass != KernelPass::kFusedPair || kDecays == Decays::kSafe, "the pair form has safe gates");
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool kCoop = kPass == KernelPass::kCooperative;
  constexpr bool kHelpers = kPass == KernelPass::kCoopHelpers;
  // Cooperative mode: owner of a tile (or of half of one) or helper (uniform per CTA). A CTA
  // whose role the other kernel runs exits here, leaving its SM to that kernel.
  CooperativeRole coop_role;
  if constexpr (kCoop) {
    coop_role = cooperative_role(kp);
    if (coop_role.helper && kp.coop.helper_kernel) return;
    if (threadIdx.x == 0)
      timeline_mark(kp.coop.timeline, coop_role.helper ? TimelineEvent::kHelperCtaStart : TimelineEvent::kOwnerCtaStart, -1, -1);
  }
  // The helpers' kernel's owner-region CTAs with warm entries: one pass of the intra-chunk code
  // without data, then exit (CooperativePlan::warm_entries).
  [[maybe_unused]] bool warm = false;
  if constexpr (kHelpers) {
    coop_role = cooperative_role(kp);
    warm = !coop_role.helper && kp.coop.warm_entries > 0;
    if (!coop_role.helper && !warm) return;
    if (threadIdx.x == 0 && !warm) timeline_mark(kp.coop.timeline, TimelineEvent::kHelperCtaStart, -1, -1, 1);
    // The owners' kernel may start now: once every helper CTA runs (or has exited), the owners'
    // waits on published chunks always end (chunk_workspace.cuh: progress).
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  }
  if constexpr (kPass == KernelPass::kFusedPair) {
    if (threadIdx.x == 0) pair_timeline_mark(kp.coop.timeline, TimelineEvent::kPairCtaStart, 0);
  }
  const bool helper = kHelpers || (kCoop && coop_role.helper);
  // Prep ahead (chunk_prep.cuh): in the fused kernels the state warpgroups run steps 1-3 of the
  // next chunk (general gates: with the exact wide-pair terms), across tile boundaries too.
  constexpr bool kPair = kPass == KernelPass::kFusedPair;
  constexpr bool kPrepAhead = kPass == KernelPass::kFused || kPair;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // 1024-byte alignment (128B-swizzled TMA boxes and WGMMA tiles) by pointer arithmetic on the
  // __shared__ array itself: a round trip through an integer would hide from the compiler that the
  // pointer is in shared memory, and every access would become a generic LD/ST (long-scoreboard
  // latency) instead of LDS/STS. The launch reserves the 1 KB of slack (kSharedBytes).
  const uint32_t align_pad = (1024u - (smem_u32(smem_raw) & 1023u)) & 1023u;
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw + align_pad);
  const auto role = WarpgroupRole(threadIdx.x / kWarpgroupThreads);

  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      cutlass::arch::ClusterTransactionBarrier::init(&smem.full_bar[s], 32);  // the producer warp's lanes
      // The pair form: plus the peer's copy as transaction bytes (pair_intra_math.cuh).
      cutlass::arch::ClusterBarrier::init(&smem.ready_bar[s], 128);
      // The pair form has one state warpgroup per CTA, and one prep warpgroup.
      constexpr uint32_t kStateThreads = kPair ? 128 : 2 * 128;
      if constexpr (kPrepAhead) {
        cutlass::arch::ClusterBarrier::init(&smem.prepped_bar[s], kStateThreads);  // the preparing WG(s)
        cutlass::arch::ClusterTransactionBarrier::init(&smem.v_full_bar[s], 1);  // the producer's lane 0
        if constexpr (early_slot_release(kPrepAhead, kLongestFirst, kDecays == Decays::kSafe)) {
          cutlass::arch::ClusterBarrier::init(&smem.k_empty_bar[s], kStateThreads);  // the state WG(s)
          cutlass::arch::ClusterBarrier::init(&smem.q_empty_bar[s], kStateThreads);
        }
      }
      // Released by both state warpgroups, in a cooperative helper by the storer thread, in an
      // owner of half a tile (value split) by its one state warpgroup; in the pair form by the
      // state warpgroup and, in rank 1, by rank 0's once the copy of A_qk has landed.
      cutlass::arch::ClusterBarrier::init(&smem.empty_bar[s], kPair ? 128 + (cluster_cta_rank() == 1 ? 1 : 0)
                                                              : helper ? 1 : (kCoop && coop_role.half >= 0) ? 128 : 256);
      if constexpr (kPair) cutlass::arch::ClusterBarrier::init(&smem.peer_prepped_bar[s], 1);  // rank 0's prep WG
      if (helper) {
        cutlass::arch::ClusterBarrier::init(&smem.head_ready_bar[s], 128);  // the intra-chunk warpgroup
        cutlass::arch::ClusterBarrier::init(&smem.head_empty_bar[s], 1);    // the storer thread
      }
    }
    // Fused kernels: both state warpgroups' threads release the M tile (state_math.cuh).
    // (the pair form: one arrive per CTA's state warpgroup, on rank 0's barrier)
    if constexpr (fold_m(kPrepAhead)) cutlass::arch::ClusterBarrier::init(&smem.m_tile_empty_bar, kPair ? 2 : 2 * 128);
    if constexpr (kLongestFirst) {
#pragma unroll
      for (int s = 0; s < kTileSlots; ++s) {
        cutlass::arch::ClusterBarrier::init(&smem.tile_full_bar[s], 1);           // the producer's lane 0
        cutlass::arch::ClusterBarrier::init(&smem.tile_empty_bar[s], 3 * 128);    // intra + state threads
      }
    }
    cutlass::arch::fence_barrier_init();
  }
  if constexpr (kPair) {
    // Both CTAs' barriers are initialised before either reaches the other's.
    __syncwarp();
    cluster_barrier_sync();
  } else {
    __syncthreads();
  }
  if constexpr (kLongestFirst) {
    // The producer's warpgroup sorts the sequences in stage 0 (free until the first load); the
    // barrier orders the sort's stores before anything the math warpgroups later do there (the
    // TMA loads in between are another proxy, which the sanitizer's race check does not follow).
    if (role == WarpgroupRole::kProducer)
      sort_sequences_longest_first(kp.problem, reinterpret_cast<uint64_t*>(smem.stage[0].q), kp.schedule->sorted_seq);
    __syncthreads();
  }

  if constexpr (kPair) {
    const int rank = int(cluster_cta_rank());
    if (role == WarpgroupRole::kProducer) {
      cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
      if (threadIdx.x < 32)
        run_load_producer<false, early_slot_release(kPrepAhead, false, true), /*kPair=*/true>(kp, smem, rank);
    } else if (role == WarpgroupRole::kIntra) {
      cutlass::arch::warpgroup_reg_alloc<kIntraRegs>();
      run_pair_intra<kGateInKernel, kL2Norm>(kp, smem, rank);
    } else {
      cutlass::arch::warpgroup_reg_alloc<kStateRegs>();
      const int wg = int(role) - int(WarpgroupRole::kState0);
      if (wg == rank) run_state_warpgroup<false, true, kGateInKernel, kL2Norm, Decays::kSafe, /*kPair=*/true>(kp, smem, rank);
      else run_pair_prep<kGateInKernel, kL2Norm>(kp, smem, rank);
    }
    // Neither CTA leaves while the other may still copy into or arrive on its shared memory.
    __syncwarp();
    cluster_barrier_sync();
    if (threadIdx.x == 0) pair_timeline_mark(kp.coop.timeline, TimelineEvent::kPairCtaEnd, 0);
    return;
  }
  if constexpr (kHelpers) {
    // The helpers' kernel: warpgroups 1 and 2 (kp.coop.helper_intra of them) run the intra-chunk
    // work, each on every other stage of the ring, the second in the state warpgroups' shared
    // memory (a helper has no state work); per intra-chunk warpgroup, one producer warp claims
    // and loads its stage's chunks and one thread of warpgroup 3 stores them. Both intra warpgroups enter the one call site below with the
    // same thread-index expression (run_intra_chunk).
    if (role == WarpgroupRole::kProducer) {
      cutlass::arch::warpgroup_reg_dealloc<kHelperProducerRegs>();
      if (!warm && threadIdx.x / 32 < kp.coop.helper_intra) run_chunk_claim_producer(kp, smem, threadIdx.x / 32);
    } else if (role == WarpgroupRole::kState1) {
      cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
      // One storer thread per intra-chunk warpgroup (each on its own stage, in its own warp), so
      // that one stage's head is copied out while the other stage waits for its tail.
      const int which = (threadIdx.x - first_thread(WarpgroupRole::kState1)) / 32;
      if (!warm && threadIdx.x % 32 == 0 && which < kp.coop.helper_intra) run_workspace_storer(kp, smem, which);
    } else {
      const int which = int(role) - int(WarpgroupRole::kIntra);  // 0 or 1
      if (which < kp.coop.helper_intra) {
        cutlass::arch::warpgroup_reg_alloc<kHelperIntraRegs>();
        // Warm passes enter at staggered steps, so that the code's lines are fetched from several
        // places at once (CooperativePlan::warm_entries).
        const int n = kp.coop.warm_entries;
        const int warm_from = warm ? warm_entry((2 * int(blockIdx.x) + which) % n, n) : 0;
        run_intra_chunk<kGateInKernel, kL2Norm, false, true, kDecays, false, /*kHelperHalfInverse=*/true>(kp, smem, which,
                                                                                                          warm_from);
      }
    }
    return;
  }
  // Fused: every role on its tile. Cooperative: owners and (one-kernel form) helpers as above (if
  // constexpr keeps the fused instantiations free of the cooperative code).
  if (role == WarpgroupRole::kProducer) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (threadIdx.x < 32) {  // one warp issues the loads
      if constexpr (kCoop) {
        if (helper) run_chunk_claim_producer(kp, smem);
        else run_workspace_loader(kp, smem);
      } else if constexpr (kPass == KernelPass::kFused) {  // (the helpers' and the pair kernels returned above)
        run_load_producer<kLongestFirst, early_slot_release(kPrepAhead, kLongestFirst, kDecays == Decays::kSafe)>(kp, smem);
      }
    }
  } else if (role == WarpgroupRole::kIntra) {
    if constexpr (kCoop) {
      if (helper) {
        cutlass::arch::warpgroup_reg_alloc<kIntraRegs>();  // tf32 inverse (intra_chunk_math.cuh)
        run_intra_chunk<kGateInKernel, kL2Norm, false, true, kDecays>(kp, smem, 0);
      } else {
        cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();  // for the owner's state warpgroups
      }
    } else if constexpr (kPass == KernelPass::kFused) {  // (the helpers' kernel returned above)
      cutlass::arch::warpgroup_reg_alloc<kIntraRegs>();
      run_intra_chunk<kGateInKernel, kL2Norm, kLongestFirst, false, kDecays, kPrepAhead>(kp, smem);
    }
  } else if (helper) {
    if constexpr (kCoop) {  // one-kernel form: one thread of warpgroup 2 is the storer
      if (threadIdx.x == first_thread(WarpgroupRole::kState0)) run_workspace_storer(kp, smem);
    }
  } else {  // kState0, kState1: one half of the value columns each
    const int half = int(role) - int(WarpgroupRole::kState0);
    // An owner of half a tile (value split: owners 2t and 2t + 1) runs only that half's warpgroup.
    if (kCoop && coop_role.half >= 0 && half != coop_role.half) return;
    if constexpr (kCoop) {
      cutlass::arch::warpgroup_reg_alloc<kOwnerStateRegs>();
      run_owner_state_warpgroup<coop_aqk_is_half(kL2Norm)>(kp, smem, half, coop_role);
      if (threadIdx.x % kWarpgroupThreads == 0) timeline_mark(kp.coop.timeline, TimelineEvent::kOwnerCtaEnd, -1, -1, half);
      // Two-kernel form: the launch's end (what the stream's next work waits for) must follow
      // the helpers' last writes too, so wait for the helpers' kernel to complete (at once by
      // now: every chunk was published, only the helpers' exits are left). Without a
      // programmatic dependency this returns at once.
      asm volatile("griddepcontrol.wait;" ::: "memory");
    } else if constexpr (kPass == KernelPass::kFused) {  // (the helpers' kernel returned above)
      cutlass::arch::warpgroup_reg_alloc<kStateRegs>();
      run_state_warpgroup<kLongestFirst, kPrepAhead, kGateInKernel, kL2Norm, kDecays>(kp, smem, half);
    }
  }
#endif
}

}  // namespace cula::kda::sm90
