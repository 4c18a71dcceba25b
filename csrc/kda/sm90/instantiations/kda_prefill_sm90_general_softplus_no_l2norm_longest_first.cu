// One instantiation per file so the kernel variants compile in parallel. General gates
// (safe_gate=False) from Kimi-Linear's softplus gate -exp(A_log) softplus(g + dt_bias): the exact
// path for wide (block, feature) spans, and only the softplus form of the gate.
#include "../kda_prefill_launch.cuh"

namespace cula::kda::sm90 {
template cudaError_t launch_kda_prefill_kernel<true, false, true, KernelPass::kFused, Decays::kGeneralSoftplus>(const KdaKernelParams&, int, cudaStream_t);
}  // namespace cula::kda::sm90
