// torch binding of sk90_token_fwd (token_fwd_sm90.cu). CPU-only torch headers: the CUDA stream comes
// from Python as an integer, so this file compiles without CUDA torch.
#include <torch/extension.h>

#include "sm90_selection_host.h"
#include "sm90_view_host.h"

extern "C" int sk90_token_fwd(const void* q, const void* k, const void* v, void* out, float* lse, int B, int Hq,
                              int Hkv, int S, int is_bf16, int pattern, int window, int sinks, float scale,
                              const int* sel_idx, const int* sel_cnt, const float* sel_w, const long long* first,
                              const long long* strides, int NB, int K, int QB, void* stream, char* err, int errlen);

// q (B, Hq, S, 128), k/v (B, Hkv, S, 128) bf16/fp16 views (unit last stride, strides of 16-byte
// multiples: sm90_view_host.h); out shaped like q, non-overlapping and dense, any such strides; lse
// (B, Hq, S) float32 contiguous;
// idx (B, Hkv, NB, K) int32 and w (same shape, float32, or an empty tensor: no weights) with unit last
// stride; cnt (B, Hkv, NB) int32; first (B,) int64 contiguous. The Python wrapper (cuda_token.py)
// validates; these checks guard the raw pointers.
static void token_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
                      const at::Tensor& idx, const at::Tensor& cnt, const at::Tensor& w, const at::Tensor& first,
                      int64_t query_block, int64_t pattern, int64_t window, int64_t sinks, double scale,
                      int64_t stream) {
  TORCH_CHECK(lse.is_cuda() && lse.is_contiguous() && idx.is_cuda() && cnt.is_cuda() && first.is_cuda(),
              "CUDA tensors expected (lse contiguous)");
  long long strides[21];  // the selection's 9, then q, k, v, out: (b, h, s) each
  sk90h::check_view(q, "q", false, strides + 9);
  sk90h::check_view(k, "k", false, strides + 12);
  sk90h::check_view(v, "v", false, strides + 15);
  sk90h::check_view(out, "out", true, strides + 18);
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kHalf, "q must be bf16 or fp16, got ", dt);
  TORCH_CHECK(k.scalar_type() == dt && v.scalar_type() == dt && out.scalar_type() == dt, "dtypes differ");
  TORCH_CHECK(lse.scalar_type() == at::kFloat, "lse must be float32");
  const int64_t B = q.size(0), Hq = q.size(1), S = q.size(2), D = q.size(3);
  TORCH_CHECK(D == 128, "head dim 128 expected, got ", D);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(2) == S && k.size(3) == D, "k/v shape mismatch");
  TORCH_CHECK(out.sizes() == q.sizes(), "out shape mismatch");
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == B && lse.size(1) == Hq && lse.size(2) == S, "lse shape mismatch");
  TORCH_CHECK(S < (1LL << 31) && B * Hq < (1LL << 31), "sizes too large");
  const bool has_w = sk90h::check_selection(idx, cnt, w, first, B, k.size(1), strides);
  char err[512] = {0};
  const int rc = sk90_token_fwd(
      q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr<float>(), static_cast<int>(B),
      static_cast<int>(Hq), static_cast<int>(k.size(1)), static_cast<int>(S), dt == at::kBFloat16 ? 1 : 0,
      static_cast<int>(pattern), static_cast<int>(window), static_cast<int>(sinks), static_cast<float>(scale),
      idx.data_ptr<int>(), cnt.data_ptr<int>(), has_w ? w.data_ptr<float>() : nullptr,
      reinterpret_cast<const long long*>(first.data_ptr<int64_t>()), strides, static_cast<int>(idx.size(2)),
      static_cast<int>(idx.size(3)), static_cast<int>(query_block), reinterpret_cast<void*>(stream), err,
      sizeof(err));
  TORCH_CHECK(rc == 0, "sk90_token_fwd: ", err);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("token_fwd", &token_fwd, "Hopper token-layout attention forward (selection + sliding_window/streaming)");
}
