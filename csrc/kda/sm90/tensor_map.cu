#include "tensor_map.h"

#include <cudaTypedefs.h>

#include <mutex>

namespace cula::kda::sm90 {

namespace {
PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status) ==
            cudaSuccess &&
        status == cudaDriverEntryPointSuccess) {
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
    }
  });
  return fn;
}
}  // namespace

cudaError_t make_token_head_feature_map(CUtensorMap* map, const void* base, int64_t tokens, int heads,
                                        int64_t token_stride, int64_t head_stride) {
  auto encode = encode_fn();
  if (encode == nullptr) return cudaErrorNotSupported;
  if (token_stride == 0) token_stride = int64_t(heads) * 128;
  if (head_stride == 0) head_stride = 128;
  // TMA: base 16-byte aligned, strides multiples of 16 bytes (8 bf16).
  if (tokens <= 0 || heads <= 0 || (reinterpret_cast<uintptr_t>(base) & 15) != 0 || token_stride % 8 != 0 ||
      head_stride % 8 != 0 || token_stride <= 0 || head_stride <= 0)
    return cudaErrorInvalidValue;
  const cuuint64_t dims[3] = {128, cuuint64_t(heads), cuuint64_t(tokens)};
  const cuuint64_t strides[2] = {cuuint64_t(head_stride) * 2, cuuint64_t(token_stride) * 2};  // bytes, dims 1, 2
  const cuuint32_t box[3] = {64, 1, 64};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(base), dims, strides, box,
                            elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace cula::kda::sm90
