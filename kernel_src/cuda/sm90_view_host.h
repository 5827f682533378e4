// Checks of the (B, H, S, D) views that the torch bindings of the structured and token-layout kernels
// hand on (q, k, v, dO read through 4-D TMA maps; out, dk, dv written by stride): the Python wrappers
// (cuda_contract.tma_view_ok) validate; these guard the raw pointers.
#pragma once

#include <torch/extension.h>

namespace sk90h {

// t: a 4-D CUDA tensor of 16-bit elements with unit last stride, 16-byte aligned data, and each other
// stride a positive multiple of 8 elements below 2^39 (any stride where the size is 1); `output`:
// also non-overlapping and dense (every element written once). Writes its strides (b, h, s) to st.
inline void check_view(const at::Tensor& t, const char* what, bool output, long long* st) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 4 && t.element_size() == 2 && t.stride(3) == 1, what,
              " must be a 4-D CUDA bf16/fp16 tensor with unit last stride");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, what, ": data must be 16-byte aligned");
  TORCH_CHECK(!output || t.is_non_overlapping_and_dense(), what, " must be non-overlapping and dense");
  for (int d = 0; d < 3; ++d) {
    const int64_t s = t.stride(d);
    TORCH_CHECK(t.size(d) == 1 || (s > 0 && s % 8 == 0 && s < (1LL << 39)), what, ": stride ", s, " of dimension ",
                d, " must be a positive multiple of 8 elements (16 bytes)");
    st[d] = s;
  }
}

}  // namespace sk90h
