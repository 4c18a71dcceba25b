// One instantiation per file so the kernel variants compile in parallel. General gates
// (safe_gate=False) from the lower-bound gate with lower_bound < -5: the exact path for wide
// (block, feature) spans.
#include "../kda_prefill_launch.cuh"

namespace cula::kda::sm90 {
template cudaError_t launch_kda_prefill_kernel<true, true, true, KernelPass::kFused, Decays::kGeneral>(const KdaKernelParams&, int, cudaStream_t);
}  // namespace cula::kda::sm90
