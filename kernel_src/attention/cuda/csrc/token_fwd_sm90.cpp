// torch binding of sk90_token_fwd (token_fwd_sm90.cu). CPU-only torch headers (sm90_torch.h): the CUDA stream comes
// from Python as an integer, so this file compiles without CUDA torch.
#include "sm90_torch.h"

#include "sm90_selection_host.h"
#include "sm90_view_host.h"

extern "C" int sk90_token_fwd(const void* q, const void* k, const void* v, void* out, float* lse, int B, int Hq,
                              int Hkv, int S, int D, int is_bf16, int pattern, int window, int sinks, float scale,
                              const int* sel_idx, const int* sel_cnt, const float* sel_w, const long long* first,
                              const long long* strides, int NB, int K, int QB, void* stream, char* err, int errlen);

// q (B, Hq, S, D), k/v (B, Hkv, S, D), D 64 or 128, bf16/fp16 views (unit last stride, strides of 16-byte
// multiples: sm90_view_host.h); out shaped like q, non-overlapping and dense, any such strides; lse
// (B, Hq, S) float32 contiguous;
// idx (B, Hkv, NB, K) int32 and w (same shape, float32, or an empty tensor: no weights) with unit last
// stride; cnt (B, Hkv, NB) int32; first (B,) int64 contiguous. The Python wrapper (attention/cuda/token.py)
// validates; these checks guard the raw pointers.
static void token_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
                      const at::Tensor& idx, const at::Tensor& cnt, const at::Tensor& w, const at::Tensor& first,
                      int64_t query_block, int64_t pattern, int64_t window, int64_t sinks, double scale,
                      int64_t stream) {
  long long strides[21];  // the selection's 9, then q, k, v, out: (b, h, s) each
  const bool bf16 = sk90h::check_fwd_views(q, k, v, out, lse, strides + 9, true);
  const bool has_w = sk90h::check_selection(idx, cnt, w, first, q.size(0), k.size(1), strides);
  char err[512] = {0};
  const int rc = sk90_token_fwd(
      q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr<float>(), static_cast<int>(q.size(0)),
      static_cast<int>(q.size(1)), static_cast<int>(k.size(1)), static_cast<int>(q.size(2)),
      static_cast<int>(q.size(3)), bf16 ? 1 : 0,
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
