// torch binding of sk90_structured_bwd (structured_bwd_sm90.cu). CPU-only torch headers (sm90_torch.h): the CUDA
// stream comes from Python as an integer, so this file compiles without CUDA torch.
#include "sm90_torch.h"

#include "sm90_view_host.h"

extern "C" int sk90_structured_bwd(const void* q, const void* k, const void* v, const void* dout,
                                   const float* lse2, const float* delta, float* dq_acc, void* dk, void* dv,
                                   const long long* strides, int B, int Hq, int Hkv, int S, int S_pad, int D,
                                   int is_bf16, int pattern, int window, int sinks, float scale, void* stream,
                                   char* err, int errlen);

// q, dout (B, Hq, S, D), k, v (B, Hkv, S, D), D 64 or 128, bf16/fp16 views on one CUDA device (unit last stride,
// strides of 16-byte multiples: sm90_view_host.h); lse2, delta (B, Hq, S_pad) float32 contiguous; dq_acc
// (B, Hq, S_pad, D) float32 contiguous (zeroed); dk, dv shaped like k, non-overlapping and dense, any
// such strides. The Python wrapper (attention/cuda/structured_bwd.py) validates; these checks guard the raw pointers.
static void structured_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout,
                           const at::Tensor& lse2, const at::Tensor& delta, at::Tensor& dq_acc, at::Tensor& dk,
                           at::Tensor& dv, int64_t pattern, int64_t window, int64_t sinks, double scale,
                           int64_t stream) {
  const at::Tensor* fp32[] = {&lse2, &delta, &dq_acc};
  for (const at::Tensor* t : fp32) {
    TORCH_CHECK(t->is_cuda() && t->is_contiguous(), "lse2, delta, dq_acc must be contiguous CUDA tensors");
  }
  long long strides[18];
  sk90h::check_view(q, "q", false, strides);
  sk90h::check_view(k, "k", false, strides + 3);
  sk90h::check_view(v, "v", false, strides + 6);
  sk90h::check_view(dout, "dout", false, strides + 9);
  sk90h::check_view(dk, "dk", true, strides + 12);
  sk90h::check_view(dv, "dv", true, strides + 15);
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kHalf, "q must be bf16 or fp16, got ", dt);
  TORCH_CHECK(k.scalar_type() == dt && v.scalar_type() == dt && dout.scalar_type() == dt && dk.scalar_type() == dt &&
                  dv.scalar_type() == dt,
              "dtypes differ");
  TORCH_CHECK(lse2.scalar_type() == at::kFloat && delta.scalar_type() == at::kFloat &&
                  dq_acc.scalar_type() == at::kFloat,
              "lse2, delta, dq_acc must be float32");
  const int64_t B = q.size(0), Hq = q.size(1), S = q.size(2), D = q.size(3);
  TORCH_CHECK(D == 64 || D == 128, "head dim 64 or 128 expected, got ", D);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(2) == S && k.size(3) == D, "k/v shape mismatch");
  TORCH_CHECK(dout.sizes() == q.sizes() && dk.sizes() == k.sizes() && dv.sizes() == k.sizes(), "shape mismatch");
  TORCH_CHECK(lse2.dim() == 3 && lse2.size(0) == B && lse2.size(1) == Hq && lse2.sizes() == delta.sizes(),
              "lse2/delta shape mismatch");
  const int64_t S_pad = lse2.size(2);
  TORCH_CHECK(S_pad >= S && S_pad % 64 == 0, "lse2 rows must be S rounded up to 64");
  TORCH_CHECK(dq_acc.dim() == 4 && dq_acc.size(0) == B && dq_acc.size(1) == Hq && dq_acc.size(2) == S_pad &&
                  dq_acc.size(3) == D,
              "dq_acc shape mismatch");
  TORCH_CHECK(S_pad < (1LL << 31) && B * Hq < (1LL << 31), "sizes too large");
  char err[512] = {0};
  const int rc = sk90_structured_bwd(
      q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr(), lse2.data_ptr<float>(), delta.data_ptr<float>(),
      dq_acc.data_ptr<float>(), dk.data_ptr(), dv.data_ptr(), strides, static_cast<int>(B), static_cast<int>(Hq),
      static_cast<int>(k.size(1)), static_cast<int>(S), static_cast<int>(S_pad), static_cast<int>(D),
      dt == at::kBFloat16 ? 1 : 0,
      static_cast<int>(pattern), static_cast<int>(window), static_cast<int>(sinks), static_cast<float>(scale),
      reinterpret_cast<void*>(stream), err, sizeof(err));
  TORCH_CHECK(rc == 0, "sk90_structured_bwd: ", err);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("structured_bwd", &structured_bwd, "Hopper structured attention backward (dense/sliding_window/streaming)");
}
