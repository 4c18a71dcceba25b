// TMA descriptor construction (host). The driver entry point is fetched through the runtime,
// so nothing links against libcuda directly.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace cula::kda::sm90 {

// Describes a bf16 tensor [tokens, heads, 128] (features contiguous; token and head strides in
// elements, 0: dense) as a 3-D TMA map (feature, head, token) with a 64 x 1 x 64 box and 128-byte
// swizzle; rows past `tokens` are zero-filled. Strides must be multiples of 8 elements (16 bytes).
cudaError_t make_token_head_feature_map(CUtensorMap* map, const void* base, int64_t tokens, int heads,
                                        int64_t token_stride, int64_t head_stride);

}  // namespace cula::kda::sm90
