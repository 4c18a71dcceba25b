// Host entry points of the SM90 KDA prefill kernel (no torch, CUDA runtime only).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "kda_params.h"

namespace cula::kda {

// Launches the kernel for `params` on `stream` (fused, or for few tiles the cooperative mode, whose
// flags and counters live in a sync area kept per stream and zeroed by a memset enqueued behind
// each launch; under a CUDA graph capture, or where that area is unavailable, in
// params.workspace, zeroed by a memset before the launch). The caller has validated the
// arguments (see csrc/api); this checks what the kernel itself relies on and returns an error
// otherwise. No host synchronisation; no allocation except, kept for the life of the process, the
// 16 KB schedule workspace of the first longest-first launch on a stream and the cooperative
// mode's sync area of a stream (allocated on its first use and when a call needs more).
cudaError_t kda_prefill_sm90(const KdaPrefillParams& params, cudaStream_t stream);

// The same launch for a caller that allocates the cooperative mode's workspace per call: the launch
// is planned once (kda_prefill_sm90_workspace_bytes and then kda_prefill_sm90 would plan it twice,
// each reading the CULA_KDA_* variables), and where it needs a workspace, `allocate(bytes, ctx)` is
// called once, before any launch, and must return 16-byte aligned device memory that stays valid
// for the work on `stream` (e.g. from a stream-ordered allocator), or null, which fails the call
// with cudaErrorMemoryAllocation. params.workspace is ignored.
using WorkspaceAllocator = void* (*)(size_t bytes, void* ctx);
cudaError_t kda_prefill_sm90(const KdaPrefillParams& params, cudaStream_t stream, WorkspaceAllocator allocate,
                             void* ctx);

// Bytes of device workspace that kda_prefill_sm90 needs for `params` on the current device: 0 when
// it runs the fused kernel, else the cooperative mode's finished stages and flags (the caller
// allocates them and sets params.workspace). Same decision as kda_prefill_sm90 (CULA_KDA_COOPERATIVE=0/1 forces it).
size_t kda_prefill_sm90_workspace_bytes(const KdaPrefillParams& params);

// The launch kda_prefill_sm90 makes for `params` on a GPU of `sm_count` SMs (host only: no CUDA
// call; the same CULA_KDA_* variables apply): "index" or "longest-first" (the fused kernel's tile
// schedules), or "cooperative-{one-kernel,two-kernels}" followed by how the tiles are owned:
// nothing (one owner CTA per tile), "-split" / "-split-on-device" (two per tile / one or two as
// the kernel's model decides), "-<k>-tiles-per-owner" or "-<G>-segments". Only the pointers'
// nullness matters (cu_seqlens: varlen); none is read.
std::string kda_prefill_sm90_launch_name(const KdaPrefillParams& params, int sm_count);

// Human-readable reason of the last cudaErrorInvalidValue returned by kda_prefill_sm90 (or "").
const char* kda_prefill_sm90_last_error();

namespace sm90 {
struct KdaKernelParams;
enum class KernelPass : int;
// Which decays an instantiation is built for (docs/kernel.md, "General gates"). The softplus gate
// has its own instantiations so that none carries the code of both gate forms: the kernel's code
// exceeds the instruction cache, and its size shows in the time (docs/perf-notes.md).
enum class Decays : int {
  kSafe = 0,             // every log decay known to lie in [-5, 0): the factorised path only
  kGeneral = 1,          // unbounded: given decays, or the lower-bound gate with lower_bound < -5
  kGeneralSoftplus = 2,  // unbounded: Kimi-Linear's gate -exp(A_log) softplus(g + dt_bias)
};
// One per file under instantiations/ (kda_prefill_launch.cuh). General decays: index order and
// cooperative mode only.
template <bool kGateInKernel, bool kL2Norm, bool kLongestFirst, KernelPass kPass, Decays kDecays = Decays::kSafe>
cudaError_t launch_kda_prefill_kernel(const KdaKernelParams& kp, int grid, cudaStream_t stream);
}  // namespace sm90

}  // namespace cula::kda
