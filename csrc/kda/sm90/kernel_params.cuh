// Kernel arguments: the problem description plus the TMA descriptors built on the host.
// Passed as one __grid_constant__ parameter so the descriptors live in parameter space, where
// TMA can read them without a copy to global memory.
#pragma once

#include <cuda.h>

#include "kda_params.h"

namespace cula::kda::sm90 {

struct KdaKernelParams {
  CUtensorMap tma_q;  // [tokens, H, K]  box 64 x 1 x 64, 128B swizzle
  CUtensorMap tma_k;  // [tokens, H, K]
  CUtensorMap tma_v;  // [tokens, HV, V]
  CUtensorMap tma_g;  // [tokens, HV, K]
  KdaPrefillParams problem;
};

}  // namespace cula::kda::sm90
