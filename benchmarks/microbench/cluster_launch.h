// The pair form's launch in the microbenchmarks: cudaLaunchKernelEx with a cluster-dimension
// attribute {2, 1, 1} (as csrc/kda/sm90/kda_prefill_launch.cuh launches kFusedPair), for an empty
// kernel of one by-value parameter struct.
#pragma once

#include <cuda_runtime.h>

template <typename Params>
cudaError_t launch_in_clusters_of_two(void (*kernel)(Params), const Params& p, int grid, int threads, int smem,
                                      cudaStream_t stream) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 2;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(grid));
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = size_t(smem);
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}
