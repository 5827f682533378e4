// Host entry point of the token-layout decode kernels (decode_sm90.cuh); their bf16 and fp16
// instantiations are compiled in decode_sm90_bf16.cu and decode_sm90_fp16.cu.
#include "decode_sm90.cuh"

namespace sk90d {
extern template cudaError_t launch_g<__nv_bfloat16>(const Params& p, int B, int G, bool cluster, cudaStream_t stream);
extern template cudaError_t launch_g<__half>(const Params& p, int B, int G, bool cluster, cudaStream_t stream);
}  // namespace sk90d

// strides: q (b, h); k (b, h, s); v (b, h, s); idx (b, h, n); cnt (b, h, n); w (b, h, n); all in elements.
extern "C" int sk90_decode_fwd(const void* q, const void* k, const void* v, void* out, float* lse, float* o_part,
                               float* l_part, int* counters, int B, int Hq, int Hkv, int S, int is_bf16, int pattern,
                               int window, int sinks, float scale, const int* sel_idx, const int* sel_cnt,
                               const float* sel_w, const long long* first, const long long* strides, int NB, int K,
                               int QB, int nsplit, int chunk, int cluster, void* stream, char* err, int errlen) {
  using namespace sk90d;
  const int G = Hkv > 0 ? Hq / Hkv : 0;
  if (B < 1 || Hkv < 1 || Hq % Hkv != 0 || (G != 1 && G != 2 && G != 4 && G != 8) || S < 1 ||
      (pattern != 1 && pattern != 2) || window < 1 || sinks < 0 || !(scale > 0.f) || NB < 1 || K < 1 || QB < 1) {
    snprintf(err, errlen, "bad arguments: B=%d Hq=%d Hkv=%d S=%d pattern=%d window=%d sinks=%d scale=%g NB=%d K=%d QB=%d",
             B, Hq, Hkv, S, pattern, window, sinks, static_cast<double>(scale), NB, K, QB);
    return 1;
  }
  Params p;
  p.q = q;
  p.k = k;
  p.v = v;
  p.out = out;
  p.lse = lse;
  p.o_part = o_part;
  p.l_part = l_part;
  p.counters = counters;
  p.idx = sel_idx;
  p.cnt = sel_cnt;
  p.w = sel_w;
  p.first = first;
  p.qb = strides[0];
  p.qh = strides[1];
  p.kb = strides[2];
  p.kh = strides[3];
  p.ks = strides[4];
  p.vb = strides[5];
  p.vh = strides[6];
  p.vs = strides[7];
  p.sib = strides[8];
  p.sih = strides[9];
  p.sin = strides[10];
  p.scb = strides[11];
  p.sch = strides[12];
  p.scn = strides[13];
  p.swb = strides[14];
  p.swh = strides[15];
  p.swn = strides[16];
  p.Hkv = Hkv;
  p.S = S;
  p.NB = NB;
  p.K = K;
  p.QB = QB;
  p.window = window;
  p.sinks = pattern == 2 ? sinks : 0;
  const long long qpos = S - 1;
  const long long w_lo = qpos - window + 1 > 0 ? qpos - window + 1 : 0;
  p.w_lo = static_cast<int>(w_lo);
  p.n_sink = pattern == 2 ? static_cast<int>(sinks < w_lo ? sinks : w_lo) : 0;
  p.n_static = p.n_sink + static_cast<int>(qpos - w_lo + 1);
  const long long total = static_cast<long long>(p.n_static) + K;
  const long long want_chunk = nsplit >= 1 ? (total + nsplit - 1) / nsplit : 0;
  if (total >= (1LL << 31) || nsplit < 1 || nsplit > 65535 || chunk != want_chunk ||
      (nsplit - 1LL) * chunk >= total || static_cast<long long>(B) * Hkv > 65535) {
    snprintf(err, errlen, "bad split plan: total=%lld nsplit=%d chunk=%d (want %lld, no empty split)", total, nsplit,
             chunk, want_chunk);
    return 1;
  }
  p.total = static_cast<int>(total);
  p.chunk = chunk;
  p.nsplit = nsplit;
  p.scale_log2 = scale * 1.4426950408889634f;
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const cudaError_t e = is_bf16 ? launch_g<__nv_bfloat16>(p, B, G, cluster != 0, st)
                                   : launch_g<__half>(p, B, G, cluster != 0, st);
  if (e != cudaSuccess) {
    snprintf(err, errlen, "launch failed: %s", cudaGetErrorString(e));
    return 1;
  }
  return 0;
}
