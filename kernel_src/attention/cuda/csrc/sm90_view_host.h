// Checks of the (B, H, S, D) views that the torch bindings of the structured and token-layout kernels
// hand on (q, k, v, dO read through 4-D TMA maps; out, dk, dv written by stride): the Python wrappers
// (cuda.contract.tma_view_ok) validate; these guard the raw pointers.
#pragma once

#include "sm90_torch.h"

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

// The forwards' tensors: q (B, Hq, S, D), k/v (B, Hkv, S, D) views of one 16-bit dtype (check_view), D 128
// (or 64 where head_dim64), out shaped like q (also non-overlapping and dense), lse (B, Hq, S) float32
// contiguous. Writes the strides (b, h, s) of q, k, v and out (12 values) to st; returns whether the dtype is bf16.
inline bool check_fwd_views(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                            const at::Tensor& lse, long long* st, bool head_dim64 = false) {
  TORCH_CHECK(lse.is_cuda() && lse.is_contiguous(), "lse must be a contiguous CUDA tensor");
  check_view(q, "q", false, st);
  check_view(k, "k", false, st + 3);
  check_view(v, "v", false, st + 6);
  check_view(out, "out", true, st + 9);
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kHalf, "q must be bf16 or fp16, got ", dt);
  TORCH_CHECK(k.scalar_type() == dt && v.scalar_type() == dt && out.scalar_type() == dt, "dtypes differ");
  TORCH_CHECK(lse.scalar_type() == at::kFloat, "lse must be float32");
  const int64_t B = q.size(0), Hq = q.size(1), S = q.size(2), D = q.size(3);
  TORCH_CHECK(D == 128 || (head_dim64 && D == 64), "head dim ", head_dim64 ? "64 or 128" : "128", " expected, got ",
              D);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(2) == S && k.size(3) == D, "k/v shape mismatch");
  TORCH_CHECK(out.sizes() == q.sizes(), "out shape mismatch");
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == B && lse.size(1) == Hq && lse.size(2) == S, "lse shape mismatch");
  TORCH_CHECK(S < (1LL << 31) && B * Hq < (1LL << 31), "sizes too large");
  return dt == at::kBFloat16;
}

}  // namespace sk90h
