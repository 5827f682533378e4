// Host side of the TMA tensor maps of the sm_90 kernels: the driver's cuTensorMapEncodeTiled, reached
// through the runtime's entry-point query (no link against libcuda), 3-D maps over contiguous
// (heads, S, D) tensors (the backward's float32 dQ buffer) and 4-D maps over strided (B, H, S, D)
// bf16 / fp16 views (q, k, v, dO).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>
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

// Element strides (b, h, s) of a (B, H, S, D) view with unit last stride, as the kernels take them.
struct ViewStrides {
  long long b, h, s;
};

// A bf16 / fp16 4-D map (D, S, H, B) of a (B, H, S, D) view with unit last stride and element strides
// st (each a multiple of 8 elements, i.e. 16 bytes, below 2^39; a dimension of size 1 may have any
// stride: the map gets the packed one): (64, rows, 1, 1) boxes, 128-byte swizzle, rows past S read as
// zeros. A transposed view of (B, S, H, D) projections has st = (S*H*D, D, H*D). false with the reason
// (naming `what`) in err.
inline bool make_map_view(CUtensorMap* map, EncodeTiledFn enc, const void* ptr, bool bf16, int D, int S, int H, int B,
                          ViewStrides st, int rows, const char* what, char* err, int errlen) {
  const long long sizes[4] = {D, S, H, B};
  long long el[4] = {1, st.s, st.h, st.b};
  for (int i = 1; i < 4; ++i) {
    if (sizes[i] == 1) el[i] = el[i - 1] * sizes[i - 1];  // never stepped: the packed value
    if (el[i] <= 0 || el[i] % 8 != 0 || el[i] >= (1LL << 39)) {
      snprintf(err, errlen, "%s: stride %lld of dimension %d (1 S, 2 H, 3 B) is not a positive multiple of 8 "
               "elements below 2^39", what, el[i], i);
      return false;
    }
  }
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) {
    snprintf(err, errlen, "%s: data not 16-byte aligned", what);
    return false;
  }
  cuuint64_t dims[4] = {static_cast<cuuint64_t>(D), static_cast<cuuint64_t>(S), static_cast<cuuint64_t>(H),
                        static_cast<cuuint64_t>(B)};
  cuuint64_t strides[3] = {static_cast<cuuint64_t>(el[1]) * 2, static_cast<cuuint64_t>(el[2]) * 2,
                           static_cast<cuuint64_t>(el[3]) * 2};
  cuuint32_t box[4] = {64, static_cast<cuuint32_t>(rows), 1, 1};
  cuuint32_t estr[4] = {1, 1, 1, 1};
  CUresult res = enc(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                     const_cast<void*>(ptr), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                     CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (res != CUDA_SUCCESS) {
    snprintf(err, errlen, "cuTensorMapEncodeTiled (%s, 4-D view) failed (CUresult %d)", what, static_cast<int>(res));
    return false;
  }
  return true;
}

}  // namespace sk90h
