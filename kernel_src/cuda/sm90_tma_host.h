// Host side of the TMA tensor maps of the sm_90 kernels: the driver's cuTensorMapEncodeTiled, reached
// through the runtime's entry-point query (no link against libcuda), and 3-D maps over contiguous
// (heads, S, D) tensors.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>

namespace sk90h {

typedef CUresult (*EncodeTiledFn)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                  const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                  CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled, or nullptr with the reason in err.
inline EncodeTiledFn get_encode_fn(char* err, int errlen) {
  static EncodeTiledFn fn = nullptr;
  if (fn) return fn;
  void* ptr = nullptr;
  cudaDriverEntryPointQueryResult q;
  cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q);
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || ptr == nullptr) {
    snprintf(err, errlen, "cuTensorMapEncodeTiled not found in the CUDA driver (%s)", cudaGetErrorString(e));
    return nullptr;
  }
  fn = reinterpret_cast<EncodeTiledFn>(ptr);
  return fn;
}

// 3-D map (D, S, heads) of a contiguous (heads, S, D) tensor of elem_bytes-byte elements, with a
// (box_cols, box_rows, 1) box and 128-byte swizzle; rows past S read as zeros. false with the reason
// (naming `what`) in err.
inline bool make_map_3d(CUtensorMap* map, EncodeTiledFn enc, const void* ptr, CUtensorMapDataType dtype,
                        int elem_bytes, int D, int S, int heads, int box_cols, int box_rows, const char* what,
                        char* err, int errlen) {
  cuuint64_t dims[3] = {static_cast<cuuint64_t>(D), static_cast<cuuint64_t>(S), static_cast<cuuint64_t>(heads)};
  cuuint64_t strides[2] = {static_cast<cuuint64_t>(D) * elem_bytes, static_cast<cuuint64_t>(S) * D * elem_bytes};
  cuuint32_t box[3] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows), 1};
  cuuint32_t estr[3] = {1, 1, 1};
  CUresult res = enc(map, dtype, 3, const_cast<void*>(ptr), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                     CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (res != CUDA_SUCCESS) {
    snprintf(err, errlen, "cuTensorMapEncodeTiled (%s) failed (CUresult %d)", what, static_cast<int>(res));
    return false;
  }
  return true;
}

// A bf16 / fp16 map of a (heads, S, D) tensor: (64, rows, 1) boxes (64 columns = 128 bytes).
inline bool make_map_16bit(CUtensorMap* map, EncodeTiledFn enc, const void* ptr, bool bf16, int D, int S, int heads,
                           int rows, const char* what, char* err, int errlen) {
  return make_map_3d(map, enc, ptr, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, D, S,
                     heads, 64, rows, what, err, errlen);
}

}  // namespace sk90h
