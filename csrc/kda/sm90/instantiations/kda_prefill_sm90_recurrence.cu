// One instantiation per file so the kernel variants compile in parallel. The recurrence pass of the
// split mode does no gate or l2-norm work (the chunk-local pass did it), so one instantiation serves
// every option.
#include "../kda_prefill_launch.cuh"

namespace cula::kda::sm90 {
template cudaError_t launch_kda_prefill_kernel<false, false, false, KernelPass::kRecurrence>(const KdaKernelParams&, int, cudaStream_t);
}  // namespace cula::kda::sm90
