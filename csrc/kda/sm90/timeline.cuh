// Optional event timeline of the cooperative mode and of the pair form (build with
// -DCULA_KDA_TIMELINE; no-ops otherwise): which helper chain claimed, finished and published each
// chunk when, and when each owner saw it and was through with it; in the pair form, when each
// role of each CTA was through with each chunk (pair_timeline_mark); in %globaltimer nanoseconds. The host side
// (kda_prefill_dispatch.cu) allocates the buffer, passes it in CooperativePlan::timeline and, with
// CULA_KDA_TIMELINE_FILE set, writes the last launch's events there as text
// (`scripts/coop_timeline.py` reads them). A chunk is named by (value head, workspace slot), the
// key both roles know. Instrumented builds are for measurement only: every mark is a global
// atomic and a 24-byte store.
#pragma once

#include <cstdint>

namespace cula::kda::sm90 {

enum class TimelineEvent : uint32_t {
  kHelperCtaStart = 0,   // a helper CTA begins (extra: 1 in the helpers' kernel, 0 in the one-kernel form)
  kOwnerCtaStart = 1,    // an owner CTA begins
  kClaim = 2,            // a helper chain claimed the chunk (extra: which chain of the CTA)
  kHeadReady = 3,        // its head (QG, KT', A_qk) is final: the storer starts copying it
  kTailReady = 4,        // its tail (W, U, ...) is final
  kPublished = 5,        // its flag is set
  kOwnerStageFree = 6,   // the owner's loader found the stage for the chunk free
  kOwnerFlagSeen = 7,    // ... and the chunk's flag set
  kOwnerChunkDone = 8,   // the owner's state warpgroup is through with the chunk (extra: half)
  kHelperCtaEnd = 9,
  kOwnerCtaEnd = 10,
  // The pair form (pair_intra_math.cuh), one record per CTA, kind and chunk (the CTA's chunk count;
  // its launch has one cluster per tile, so that is the tile's chunk index, which the state
  // warpgroup marks):
  kPairCtaStart = 11,   // the CTA begins (thread 0, first instruction)
  kPairLoaded = 12,     // its prep warpgroup's wait for `full` ended
  kPairPrepped = 13,    // its prep warpgroup arrived on `prepped`
  kPairIntraDone = 14,  // its intra-chunk warpgroup arrived on `ready`
  kPairReady = 15,      // its state warpgroup's wait for `ready` ended
  kPairReleased = 16,   // its state warpgroup released the stage (after the state update)
  kPairStored = 17,     // ... and stored the chunk's output
  kPairCtaEnd = 18,     // the CTA leaves (after the final cluster barrier)
};
constexpr int kPairTimelineKinds = 8;
constexpr int kPairTimelineChunks = 128;  // marks of later chunks are dropped

constexpr uint32_t kTimelineCapacity = 1u << 20;  // records

struct TimelineRecord {
  uint64_t ns;
  uint32_t event;  // TimelineEvent | extra << 8
  uint32_t cta;
  int32_t v_head;
  int32_t slot;
};
static_assert(sizeof(TimelineRecord) == 24, "records as the host reads them");

// buf: [count (u64), pad (u64), records...]
__device__ __forceinline__ void timeline_mark(void* buf, TimelineEvent event, int v_head, int64_t slot, int extra = 0) {
#ifdef CULA_KDA_TIMELINE
  if (buf == nullptr) return;
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  auto* count = static_cast<unsigned long long*>(buf);
  const unsigned long long i = atomicAdd(count, 1ull);
  if (i >= kTimelineCapacity) return;
  TimelineRecord* rec = reinterpret_cast<TimelineRecord*>(count + 2) + i;
  rec->ns = ns;
  rec->event = uint32_t(event) | (uint32_t(extra) << 8);
  rec->cta = blockIdx.x;
  rec->v_head = v_head;
  rec->slot = int32_t(slot);
#else
  (void)buf, (void)event, (void)v_head, (void)slot, (void)extra;
#endif
}

// The pair form's marks: no atomic (a thread on the critical path must not wait for one), each
// (CTA, kind, chunk) has its own record: [count = grid * kinds * chunks (set by the host), pad,
// records...], unwritten records zero; a record's v_head field holds the CTA's SM (%smid). Each
// mark reads %globaltimer, which costs the kernel ~20 % at 64 tiles with every kind on; with
// -DCULA_KDA_TIMELINE_ENDS_ONLY as well only the CTAs' starts and ends are marked.
__device__ __forceinline__ void pair_timeline_mark(void* buf, TimelineEvent event, int chunk) {
#ifdef CULA_KDA_TIMELINE
  if (buf == nullptr || chunk < 0 || chunk >= kPairTimelineChunks) return;
#ifdef CULA_KDA_TIMELINE_ENDS_ONLY  // the CTAs' start and end only (two marks per CTA: ~no perturbation)
  if (event != TimelineEvent::kPairCtaStart && event != TimelineEvent::kPairCtaEnd) return;
#endif
  uint32_t smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  const uint32_t kind = uint32_t(event) - uint32_t(TimelineEvent::kPairCtaStart);
  TimelineRecord* rec = reinterpret_cast<TimelineRecord*>(static_cast<unsigned long long*>(buf) + 2) +
                        (size_t(blockIdx.x) * kPairTimelineKinds + kind) * kPairTimelineChunks + chunk;
  rec->ns = ns;
  rec->event = uint32_t(event);
  rec->cta = blockIdx.x;
  rec->v_head = int32_t(smid);  // (the pair form's records carry the SM in this field)
  rec->slot = chunk;
#else
  (void)buf, (void)event, (void)chunk;
#endif
}

}  // namespace cula::kda::sm90
