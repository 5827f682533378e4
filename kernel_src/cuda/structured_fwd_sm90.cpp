// torch binding of sk90_structured_fwd (structured_fwd_sm90.cu). CPU-only torch headers: the CUDA
// stream comes from Python as an integer, so this file compiles without CUDA torch.
#include <torch/extension.h>

#include "sm90_view_host.h"

extern "C" int sk90_structured_fwd(const void* q, const void* k, const void* v, void* out, float* lse,
                                   const long long* strides, int B, int Hq, int Hkv, int S, int is_bf16, int pattern,
                                   int window, int sinks, float scale, int variant, void* stream, char* err,
                                   int errlen);

// q (B, Hq, S, 128), k/v (B, Hkv, S, 128) bf16/fp16 views on one CUDA device (unit last stride, strides
// of 16-byte multiples: sm90_view_host.h); out shaped like q, non-overlapping and dense, any such
// strides; lse (B, Hq, S) float32 contiguous. The Python wrapper (cuda_structured.py) validates;
// these checks guard the raw pointers.
static void structured_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                           at::Tensor& lse, int64_t pattern, int64_t window, int64_t sinks, double scale,
                           int64_t variant, int64_t stream) {
  TORCH_CHECK(lse.is_cuda() && lse.is_contiguous(), "lse must be a contiguous CUDA tensor");
  long long strides[12];
  sk90h::check_view(q, "q", false, strides);
  sk90h::check_view(k, "k", false, strides + 3);
  sk90h::check_view(v, "v", false, strides + 6);
  sk90h::check_view(out, "out", true, strides + 9);
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
  char err[512] = {0};
  const int rc = sk90_structured_fwd(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                     lse.data_ptr<float>(), strides, static_cast<int>(B), static_cast<int>(Hq),
                                     static_cast<int>(k.size(1)), static_cast<int>(S), dt == at::kBFloat16 ? 1 : 0,
                                     static_cast<int>(pattern), static_cast<int>(window), static_cast<int>(sinks),
                                     static_cast<float>(scale), static_cast<int>(variant),
                                     reinterpret_cast<void*>(stream), err, sizeof(err));
  TORCH_CHECK(rc == 0, "sk90_structured_fwd: ", err);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("structured_fwd", &structured_fwd, "Hopper structured attention forward (dense/sliding_window/streaming)");
}
