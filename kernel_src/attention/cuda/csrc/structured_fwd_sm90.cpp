// torch binding of sk90_structured_fwd (structured_fwd_sm90.cu). CPU-only torch headers (sm90_torch.h): the CUDA
// stream comes from Python as an integer, so this file compiles without CUDA torch.
#include "sm90_torch.h"

#include "sm90_view_host.h"

extern "C" int sk90_structured_fwd(const void* q, const void* k, const void* v, void* out, float* lse,
                                   const long long* strides, int B, int Hq, int Hkv, int S, int is_bf16, int pattern,
                                   int window, int sinks, float scale, void* stream, char* err, int errlen);

// q (B, Hq, S, 128), k/v (B, Hkv, S, 128) bf16/fp16 views on one CUDA device (unit last stride, strides
// of 16-byte multiples: sm90_view_host.h); out shaped like q, non-overlapping and dense, any such
// strides; lse (B, Hq, S) float32 contiguous. The Python wrapper (attention/cuda/structured.py) validates;
// these checks guard the raw pointers.
static void structured_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                           at::Tensor& lse, int64_t pattern, int64_t window, int64_t sinks, double scale,
                           int64_t stream) {
  long long strides[12];
  const bool bf16 = sk90h::check_fwd_views(q, k, v, out, lse, strides);
  char err[512] = {0};
  const int rc = sk90_structured_fwd(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr<float>(),
                                     strides, static_cast<int>(q.size(0)), static_cast<int>(q.size(1)),
                                     static_cast<int>(k.size(1)), static_cast<int>(q.size(2)), bf16 ? 1 : 0,
                                     static_cast<int>(pattern), static_cast<int>(window), static_cast<int>(sinks),
                                     static_cast<float>(scale), reinterpret_cast<void*>(stream), err, sizeof(err));
  TORCH_CHECK(rc == 0, "sk90_structured_fwd: ", err);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("structured_fwd", &structured_fwd, "Hopper structured attention forward (dense/sliding_window/streaming)");
}
