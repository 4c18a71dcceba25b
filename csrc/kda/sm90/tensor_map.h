// TMA descriptor construction (host). The driver entry point is fetched through the runtime,
// so nothing links against libcuda directly.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace cula::kda::sm90 {

// Describes a contiguous bf16 tensor [tokens, heads, 128] as a 3-D TMA map (feature, head, token)
// with a 64 x 1 x 64 box and 128-byte swizzle; rows past `tokens` are zero-filled.
cudaError_t make_token_head_feature_map(CUtensorMap* map, const void* base, int64_t tokens, int heads);

}  // namespace cula::kda::sm90
