// Checks of a token layout's tensors in the torch bindings of the token-layout kernels (token_fwd,
// decode): the Python wrappers validate; these guard the raw pointers.
#pragma once

#include "sm90_torch.h"

namespace sk90h {

// idx (B, Hkv, NB, K) int32 and w (same shape, float32, or an empty tensor: no weights) with unit last
// stride; cnt (B, Hkv, NB) int32; first (B,) int64 contiguous. Writes the 9 strides the kernels read:
// idx, cnt, w (zeros without weights), each (b, h, n). Returns whether there are weights.
inline bool check_selection(const at::Tensor& idx, const at::Tensor& cnt, const at::Tensor& w,
                            const at::Tensor& first, int64_t B, int64_t Hkv, long long* strides) {
  TORCH_CHECK(idx.is_cuda() && cnt.is_cuda() && first.is_cuda(), "CUDA selection tensors expected");
  TORCH_CHECK(idx.scalar_type() == at::kInt && idx.dim() == 4 && idx.size(0) == B && idx.size(1) == Hkv &&
                  idx.stride(3) == 1,
              "indices must be int32 (B, Hkv, NB, K) with unit last stride");
  TORCH_CHECK(cnt.scalar_type() == at::kInt && cnt.dim() == 3 && cnt.size(0) == B && cnt.size(1) == Hkv &&
                  cnt.size(2) == idx.size(2),
              "counts must be int32 (B, Hkv, NB)");
  TORCH_CHECK(first.scalar_type() == at::kLong && first.dim() == 1 && first.size(0) == B && first.is_contiguous(),
              "first_block must be int64 (B,) contiguous");
  const bool has_w = w.numel() > 0;
  if (has_w) {
    TORCH_CHECK(w.is_cuda() && w.scalar_type() == at::kFloat && w.sizes() == idx.sizes() && w.stride(3) == 1,
                "weights must be float32 like indices with unit last stride");
  }
  TORCH_CHECK(idx.size(2) < (1LL << 31) && idx.size(3) < (1LL << 31), "selection too large");
  for (int d = 0; d < 3; ++d) {
    strides[d] = idx.stride(d);
    strides[3 + d] = cnt.stride(d);
    strides[6 + d] = has_w ? w.stride(d) : 0;
  }
  return has_w;
}

}  // namespace sk90h
