// torch binding of sk90_structured_fwd (structured_fwd_sm90.cu). CPU-only torch headers (sm90_torch.h): the CUDA
// stream comes from Python as an integer, so this file compiles without CUDA torch.
#include "sm90_torch.h"

#include "sm90_view_host.h"

extern "C" int sk90_structured_fwd(const void* q, const void* k, const void* v, void* out, float* lse,
                                   const long long* strides, int B, int Hq, int Hkv, int S, int D, int is_bf16,
                                   int pattern, int window, int sinks, float scale, void* stream, char* err,
                                   int errlen);

// q (B, Hq, S, D), k/v (B, Hkv, S, D), D 64 or 128, bf16/fp16 views on one CUDA device (unit last stride, strides
// of 16-byte multiples: sm90_view_host.h); out shaped like q, non-overlapping and dense, any such
// strides; lse (B, Hq, S) float32 contiguous. The Python wrapper (attention/cuda/structured.py) validates;
// these checks guard the raw pointers.
static void structured_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                           at::Tensor& lse, int64_t pattern, int64_t window, int64_t sinks, double scale,
                           int64_t stream) {
  long long strides[12];
  const bool bf16 = sk90h::check_fwd_views(q, k, v, out, lse, strides, true);
  char err[512] = {0};
  const int rc = sk90_structured_fwd(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr<float>(),
                                     strides, static_cast<int>(q.size(0)), static_cast<int>(q.size(1)),
                                     static_cast<int>(k.size(1)), static_cast<int>(q.size(2)),
                                     static_cast<int>(q.size(3)), bf16 ? 1 : 0,
                                     static_cast<int>(pattern), static_cast<int>(window), static_cast<int>(sinks),
                                     static_cast<float>(scale), reinterpret_cast<void*>(stream), err, sizeof(err));
  TORCH_CHECK(rc == 0, "sk90_structured_fwd: ", err);
}

extern "C" int sk90_listed_fwd(const void* q, const void* k, const void* v, void* out, float* lse,
                               const long long* strides, int B, int Hq, int Hkv, int S, int D, int is_bf16,
                               const int* fnum, const int* fidx, int fw, const int* pnum, const int* pidx, int pw,
                               float scale, void* stream, char* err, int errlen);

// A block layout's tensors as the listed forward reads them: counts (B, Hkv, NQ) and tiles (B, Hkv, NQ, W),
// int32, contiguous, on q's device, NQ = ceil(S / 128).
static void check_tile_lists(const at::Tensor& num, const at::Tensor& idx, const at::Tensor& q, int64_t Hkv,
                             const char* what) {
  const int64_t nq = (q.size(2) + 127) / 128;
  TORCH_CHECK(num.device() == q.device() && idx.device() == q.device(), what, ": tile lists must be on q's device");
  TORCH_CHECK(num.scalar_type() == at::kInt && idx.scalar_type() == at::kInt, what, ": tile lists must be int32");
  TORCH_CHECK(num.is_contiguous() && idx.is_contiguous(), what, ": tile lists must be contiguous");
  TORCH_CHECK(num.dim() == 3 && num.size(0) == q.size(0) && num.size(1) == Hkv && num.size(2) == nq, what,
              ": counts must be (B, Hkv, ceil(S / 128))");
  TORCH_CHECK(idx.dim() == 4 && idx.size(0) == q.size(0) && idx.size(1) == Hkv && idx.size(2) == nq &&
                  idx.size(3) >= 1 && idx.size(3) < (1LL << 31),
              what, ": tiles must be (B, Hkv, ceil(S / 128), W) with W >= 1");
}

// As structured_fwd, with bigbird's block layout (128 x 128 tiles): full tiles fnum / fidx, partial tiles
// pnum / pidx (check_tile_lists).
static void listed_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
                       const at::Tensor& fnum, const at::Tensor& fidx, const at::Tensor& pnum, const at::Tensor& pidx,
                       double scale, int64_t stream) {
  long long strides[12];
  const bool bf16 = sk90h::check_fwd_views(q, k, v, out, lse, strides, true);
  check_tile_lists(fnum, fidx, q, k.size(1), "full");
  check_tile_lists(pnum, pidx, q, k.size(1), "partial");
  char err[512] = {0};
  const int rc = sk90_listed_fwd(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr<float>(),
                                 strides, static_cast<int>(q.size(0)), static_cast<int>(q.size(1)),
                                 static_cast<int>(k.size(1)), static_cast<int>(q.size(2)), static_cast<int>(q.size(3)),
                                 bf16 ? 1 : 0, fnum.data_ptr<int>(), fidx.data_ptr<int>(),
                                 static_cast<int>(fidx.size(3)),
                                 pnum.data_ptr<int>(), pidx.data_ptr<int>(), static_cast<int>(pidx.size(3)),
                                 static_cast<float>(scale), reinterpret_cast<void*>(stream), err, sizeof(err));
  TORCH_CHECK(rc == 0, "sk90_listed_fwd: ", err);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("structured_fwd", &structured_fwd,
        "Hopper structured attention forward (dense/sliding_window/streaming/block_diagonal)");
  m.def("listed_fwd", &listed_fwd, "Hopper attention forward over a 128x128 block layout (bigbird)");
}
