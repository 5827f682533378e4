// torch binding of sk90_decode_fwd (decode_sm90.cu). CPU-only torch headers (sm90_torch.h): the CUDA stream comes
// from Python as an integer, so this file compiles without CUDA torch.
#include "sm90_torch.h"

#include "sm90_selection_host.h"

extern "C" int sk90_decode_fwd(const void* q, const void* k, const void* v, void* out, float* lse, float* o_part,
                               float* l_part, int* counters, int B, int Hq, int Hkv, int S, int is_bf16, int pattern,
                               int window, int sinks, float scale, const int* sel_idx, const int* sel_cnt,
                               const float* sel_w, const long long* first, const long long* strides, int NB, int K,
                               int QB, int nsplit, int chunk, int cluster, void* stream, char* err, int errlen);

// q (B, Hq, 1, 128) and k/v (B, Hkv, S, 128) with unit last stride and 16-byte aligned rows; out
// (B, Hq, 1, 128) and lse (B, Hq, 1) float32 contiguous; o_part (B*Hkv*nsplit*G*128) and l_part
// (B*Hkv*nsplit*G) float32 workspaces (unused when cluster: 2..8 splits merge in a thread-block
// cluster); counters int32 (>= B*Hkv, zero) or an empty tensor (second
// merge kernel); idx (B, Hkv, NB, K) int32 and w (same shape, float32, or empty: no weights) with unit
// last stride; cnt (B, Hkv, NB) int32; first (B,) int64 contiguous. The Python wrapper
// (attention/cuda/decode.py) validates; these checks guard the raw pointers.
static void decode_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
                       at::Tensor& o_part, at::Tensor& l_part, at::Tensor& counters, const at::Tensor& idx,
                       const at::Tensor& cnt, const at::Tensor& w, const at::Tensor& first, int64_t query_block,
                       int64_t pattern, int64_t window, int64_t sinks, double scale, int64_t nsplit, int64_t chunk,
                       bool cluster, int64_t stream) {
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda() && out.is_cuda() && lse.is_cuda() && o_part.is_cuda() &&
                  l_part.is_cuda() && idx.is_cuda() && cnt.is_cuda() && first.is_cuda(),
              "CUDA tensors expected");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be 4-D (B, H, S, D)");
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kHalf, "q must be bf16 or fp16, got ", dt);
  TORCH_CHECK(k.scalar_type() == dt && v.scalar_type() == dt && out.scalar_type() == dt, "dtypes differ");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(q.size(2) == 1 && D == 128, "q must be (B, Hq, 1, 128)");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(3) == D && Hkv >= 1 && Hq % Hkv == 0,
              "k/v shape mismatch");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "unit last stride expected");
  TORCH_CHECK(k.stride(2) % 8 == 0 && v.stride(2) % 8 == 0 && k.stride(1) % 8 == 0 && v.stride(1) % 8 == 0 &&
                  k.stride(0) % 8 == 0 && v.stride(0) % 8 == 0,
              "k/v rows must be 16-byte aligned");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(k.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(v.data_ptr()) % 16 == 0,
              "k/v data must be 16-byte aligned");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous like q");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.numel() == B * Hq, "lse (B, Hq, 1) float32");
  const int64_t G = Hq / Hkv;
  TORCH_CHECK(o_part.scalar_type() == at::kFloat && o_part.is_contiguous() && o_part.numel() == B * Hkv * nsplit * G * D,
              "o_part workspace size");
  TORCH_CHECK(l_part.scalar_type() == at::kFloat && l_part.is_contiguous() && l_part.numel() == B * Hkv * nsplit * G,
              "l_part workspace size");
  const bool fused = counters.numel() > 0;
  if (fused) {
    TORCH_CHECK(counters.is_cuda() && counters.scalar_type() == at::kInt && counters.numel() >= B * Hkv,
                "counters must be int32 with at least B * Hkv entries");
  }
  TORCH_CHECK(S < (1LL << 31) && B * Hq < (1LL << 31), "sizes too large");
  long long strides[17] = {q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
                           v.stride(0), v.stride(1), v.stride(2)};
  const bool has_w = sk90h::check_selection(idx, cnt, w, first, B, Hkv, strides + 8);
  char err[512] = {0};
  const int rc = sk90_decode_fwd(
      q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr<float>(), o_part.data_ptr<float>(),
      l_part.data_ptr<float>(), fused ? counters.data_ptr<int>() : nullptr, static_cast<int>(B), static_cast<int>(Hq),
      static_cast<int>(Hkv), static_cast<int>(S), dt == at::kBFloat16 ? 1 : 0, static_cast<int>(pattern),
      static_cast<int>(window), static_cast<int>(sinks), static_cast<float>(scale), idx.data_ptr<int>(),
      cnt.data_ptr<int>(), has_w ? w.data_ptr<float>() : nullptr,
      reinterpret_cast<const long long*>(first.data_ptr<int64_t>()), strides, static_cast<int>(idx.size(2)),
      static_cast<int>(idx.size(3)), static_cast<int>(query_block), static_cast<int>(nsplit), static_cast<int>(chunk),
      cluster ? 1 : 0, reinterpret_cast<void*>(stream), err, sizeof(err));
  TORCH_CHECK(rc == 0, "sk90_decode_fwd: ", err);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_fwd", &decode_fwd, "Hopper token-layout decode forward (selection + sliding_window/streaming)");
}
