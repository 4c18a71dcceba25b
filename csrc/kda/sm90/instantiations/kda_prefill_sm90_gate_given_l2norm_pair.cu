// One instantiation per file so the kernel variants compile in parallel.
#include "../kda_prefill_launch.cuh"

namespace cula::kda::sm90 {
template cudaError_t launch_kda_prefill_kernel<false, true, false, KernelPass::kFusedPair>(const KdaKernelParams&, int, cudaStream_t);
}  // namespace cula::kda::sm90
