// Token-layout decode (one query token per row) for sm_90: split-KV over a virtual key list.
//
// Row b, KV head h, the query at position qpos = S - 1 (plain geometry, bottom-right). Its keys form
// one virtual list of `total` entries: the streaming sinks not inside the window ([0, n_sink)), the
// window [w_lo, qpos], then the K slots of the selection block sb = qpos / QB - first[b]. A selected
// slot c counts when 0 <= sb < NB, c < min(count, K), 0 <= j < S, the weight (if any) is positive and
// the static rule does not already allow j (qpos - j >= window and, streaming, j >= sinks): the
// semantics of triton_fwd._selection_loop. log2(w) joins the logit.
//
// Grid (nsplit, B * Hkv), 128 threads. CTA `split` takes virtual keys [split * chunk, + chunk)
// (chunk <= 64): their K and V rows are copied with cp.async (16 bytes a copy, 16 in flight per
// thread, invalid rows zero-filled) into shared memory, 16-byte chunk c of row r at c ^ (r & 7) so
// that reads of 8 rows at one chunk hit distinct banks. Scores: thread (key n, half) dots 64 dims of
// every one of the G query heads (q in shared memory, broadcast reads); softmax per head by a warp;
// P V: thread (dim pair, key half). The partial (normalised o, log2-sum-exp) goes to a workspace; the
// last CTA of (b, h) to arrive (atomic counter, reset by it) merges the splits, or a second kernel
// does when no counter buffer is given. The merge loads all splits' values at once (a first version
// looped over the splits one dependent load at a time: H100, B=8, 128K, top-2048 decode 50 us per
// call in a 10-call graph, against 35 for the Triton split-KV kernel).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>

namespace sk90d {

constexpr int kD = 128;
constexpr int kChunk = 64;
constexpr int kThreads = 128;
static_assert(kThreads == kD, "q is loaded one dimension a thread");

struct Params {
  const void* q;
  const void* k;
  const void* v;
  void* out;      // (B, Hq, 1, D) contiguous
  float* lse;     // (B, Hq, 1) contiguous
  float* o_part;  // (B * Hkv, nsplit, G, D)
  float* l_part;  // (B * Hkv, nsplit, G)
  int* counters;  // (B * Hkv,) zero between launches, or nullptr: separate merge kernel
  const int* idx;
  const int* cnt;
  const float* w;  // nullptr: no weights
  const long long* first;
  long long qb, qh, kb, kh, ks, vb, vh, vs;
  long long sib, sih, sin, scb, sch, scn, swb, swh, swn;
  int Hkv, S, NB, K, QB, window, sinks;
  int n_sink, w_lo, n_static, total, chunk, nsplit;
  float scale_log2;
};

template <typename T>
__device__ __forceinline__ float to_f(T x);
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }
template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ __half from_f<__half>(float x) { return __float2half(x); }

__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Merge the nsplit partial results of (b, h): thread t owns dimension t of each of the G heads.
// sW: >= kThreads * G floats and sMax: >= (kThreads / 32) * G floats of shared memory. Pass 1: the
// per-head maximum (block reduction); pass 2, per tile of kThreads splits: the weights into sW, then
// the weighted sum of the partial outputs (independent loads, unrolled: many in flight).
template <typename T, int G>
__device__ void merge_splits(const Params& p, int bh, int t, float* sW, float* sMax) {
  const int b = bh / p.Hkv, h = bh % p.Hkv;
  const int Hq = p.Hkv * G;
  const int warp = t >> 5, lane = t & 31;
  const float* lp = p.l_part + static_cast<long long>(bh) * p.nsplit * G;
  const float* op = p.o_part + static_cast<long long>(bh) * p.nsplit * G * kD;
  float m[G];
#pragma unroll
  for (int g = 0; g < G; ++g) m[g] = -INFINITY;
  for (int s = t; s < p.nsplit; s += kThreads) {
#pragma unroll
    for (int g = 0; g < G; ++g) m[g] = fmaxf(m[g], __ldcg(lp + s * G + g));
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m[g] = fmaxf(m[g], __shfl_xor_sync(0xffffffffu, m[g], o));
    if (lane == 0) sMax[warp * G + g] = m[g];
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = sMax[g];
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) m[g] = fmaxf(m[g], sMax[w * G + g]);
  }
  float sum[G], acc[G];
#pragma unroll
  for (int g = 0; g < G; ++g) sum[g] = acc[g] = 0.f;
  for (int s0 = 0; s0 < p.nsplit; s0 += kThreads) {
    __syncthreads();
    const int s = s0 + t;
#pragma unroll
    for (int g = 0; g < G; ++g)  // exp2(-inf) = 0 for an empty split
      sW[t * G + g] = (s < p.nsplit && m[g] != -INFINITY) ? exp2f(__ldcg(lp + s * G + g) - m[g]) : 0.f;
    __syncthreads();
    const int n = min(kThreads, p.nsplit - s0);
    const float* o0 = op + static_cast<long long>(s0) * G * kD + t;
    constexpr int kBatch = G >= 8 ? 4 : 32 / G;  // partial outputs loaded before any is used
    for (int i0 = 0; i0 < n; i0 += kBatch) {
      float ov[kBatch][G];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
#pragma unroll
        for (int g = 0; g < G; ++g) ov[u][g] = i0 + u < n ? __ldcg(o0 + ((i0 + u) * G + g) * kD) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float wgt = i0 + u < n ? sW[(i0 + u) * G + g] : 0.f;
          sum[g] += wgt;
          acc[g] += wgt * ov[u][g];
        }
      }
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const long long row = static_cast<long long>(b) * Hq + h * G + g;
    static_cast<T*>(p.out)[row * kD + t] = from_f<T>(sum[g] > 0.f ? acc[g] / sum[g] : 0.f);
    if (t == 0) p.lse[row] = sum[g] > 0.f ? (m[g] + log2f(sum[g])) * 0.69314718055994531f : -INFINITY;
  }
}

template <typename T, int G>
__global__ void __launch_bounds__(kThreads) decode_kernel(const Params p) {
  __shared__ __align__(128) uint8_t sK[kChunk * kD * 2];
  __shared__ __align__(128) uint8_t sV[kChunk * kD * 2];
  __shared__ __align__(16) float sQ[G][kD];
  __shared__ float sS[2][G][kChunk];
  __shared__ float sP[G][kChunk];
  __shared__ __align__(16) float sRed[G][kD];
  __shared__ long long sJ[kChunk];
  __shared__ float sBias[kChunk];
  __shared__ float sM[G], sL[G];
  __shared__ int sLast;

  const int t = threadIdx.x;
  const int split = blockIdx.x, bh = blockIdx.y;
  const int b = bh / p.Hkv, h = bh % p.Hkv;
  const int qpos = p.S - 1;

  // q (G values a thread) is loaded first, into registers: its round trip overlaps the index loads'.
  float qv[G];
  {
    const T* qrow = static_cast<const T*>(p.q) + b * p.qb + static_cast<long long>(h) * G * p.qh;
#pragma unroll
    for (int u = 0; u < G; ++u) qv[u] = to_f<T>(qrow[u * p.qh + t]);
  }
  if (t < kChunk) {
    const int vi = split * p.chunk + t;
    long long j = -1;
    float bias = 0.f;
    if (t < p.chunk && vi < p.total) {
      if (vi < p.n_sink) {
        j = vi;
      } else if (vi < p.n_static) {
        j = p.w_lo + (vi - p.n_sink);
      } else {
        const int c = vi - p.n_static;
        const long long sb = static_cast<long long>(qpos / p.QB) - p.first[b];
        if (sb >= 0 && sb < p.NB) {
          if (c < p.K) {  // count, index and weight loads issued together (one round trip)
            const int count = p.cnt[b * p.scb + h * p.sch + sb * p.scn];
            const long long jj = p.idx[b * p.sib + h * p.sih + sb * p.sin + c];
            const float wv = p.w != nullptr ? p.w[b * p.swb + h * p.swh + sb * p.swn + c] : 1.f;
            const bool ok = c < count && jj >= 0 && jj < p.S && qpos - jj >= p.window && jj >= p.sinks && wv > 0.f;
            if (ok) {
              j = jj;
              bias = p.w != nullptr ? log2f(wv) : 0.f;
            }
          }
        }
      }
    }
    sJ[t] = j;
    sBias[t] = bias;
  }
#pragma unroll
  for (int u = 0; u < G; ++u) sQ[u][t] = qv[u];
  __syncthreads();

  const T* kbase = static_cast<const T*>(p.k) + b * p.kb + h * p.kh;
  const T* vbase = static_cast<const T*>(p.v) + b * p.vb + h * p.vh;
  const uint32_t sk = static_cast<uint32_t>(__cvta_generic_to_shared(sK));
  const uint32_t sv = static_cast<uint32_t>(__cvta_generic_to_shared(sV));
#pragma unroll
  for (int i = 0; i < kChunk * 16 / kThreads; ++i) {
    const int e = t + kThreads * i, r = e >> 4, c = e & 15;
    const long long j = sJ[r];
    const bool ok = j >= 0;
    cp_async16_zfill(sk + r * 256 + ((c ^ (r & 7)) << 4), kbase + (ok ? j * p.ks : 0) + c * 8, ok);
  }
  cp_async_commit();
#pragma unroll
  for (int i = 0; i < kChunk * 16 / kThreads; ++i) {
    const int e = t + kThreads * i, r = e >> 4, c = e & 15;
    const long long j = sJ[r];
    const bool ok = j >= 0;
    cp_async16_zfill(sv + r * 256 + ((c ^ (r & 7)) << 4), vbase + (ok ? j * p.vs : 0) + c * 8, ok);
  }
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();

  {  // scores: thread (key n, half of the dimensions)
    const int n = t & (kChunk - 1), half = t >> 6;
    float acc[G];
#pragma unroll
    for (int g = 0; g < G; ++g) acc[g] = 0.f;
#pragma unroll
    for (int cc = 0; cc < 8; ++cc) {
      const int c = half * 8 + cc;
      const uint4 raw = *reinterpret_cast<const uint4*>(sK + n * 256 + ((c ^ (n & 7)) << 4));
      const T* kv = reinterpret_cast<const T*>(&raw);
      float kf[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) kf[e] = to_f<T>(kv[e]);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float4 q0 = *reinterpret_cast<const float4*>(&sQ[g][c * 8]);
        const float4 q1 = *reinterpret_cast<const float4*>(&sQ[g][c * 8 + 4]);
        acc[g] += q0.x * kf[0] + q0.y * kf[1] + q0.z * kf[2] + q0.w * kf[3] + q1.x * kf[4] + q1.y * kf[5] +
                  q1.z * kf[6] + q1.w * kf[7];
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) sS[half][g][n] = acc[g];
  }
  __syncthreads();

  {  // softmax of each head over this split's keys (log2 domain): warp w takes heads w, w + 4, ...
    const int warp = t >> 5, lane = t & 31;
    for (int g = warp; g < G; g += kThreads / 32) {
      float s[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int n = lane + 32 * u;
        s[u] = sJ[n] >= 0 ? (sS[0][g][n] + sS[1][g][n]) * p.scale_log2 + sBias[n] : -INFINITY;
      }
      float m = fmaxf(s[0], s[1]);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      const float m_safe = m == -INFINITY ? 0.f : m;
      float l = 0.f;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const float pv = exp2f(s[u] - m_safe);
        sP[g][lane + 32 * u] = pv;
        l += pv;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
      if (lane == 0) {
        sM[g] = m;
        sL[g] = l;
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  {  // P V: thread (dimension pair d0, half of the keys)
    const int d0 = (t & 63) * 2, kh = t >> 6;
    const int c = d0 >> 3, off = (d0 & 7) * 2;
    float acc[G][2];
#pragma unroll
    for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = 0.f;
#pragma unroll 8
    for (int i = 0; i < kChunk / 2; ++i) {
      const int n = kh * (kChunk / 2) + i;
      const T* vv = reinterpret_cast<const T*>(sV + n * 256 + ((c ^ (n & 7)) << 4) + off);
      const float v0 = to_f<T>(vv[0]), v1 = to_f<T>(vv[1]);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float pv = sP[g][n];
        acc[g][0] += pv * v0;
        acc[g][1] += pv * v1;
      }
    }
    if (kh == 1) {
#pragma unroll
      for (int g = 0; g < G; ++g) *reinterpret_cast<float2*>(&sRed[g][d0]) = make_float2(acc[g][0], acc[g][1]);
    }
    __syncthreads();
    if (kh == 0) {
      float* op = p.o_part + (static_cast<long long>(bh) * p.nsplit + split) * G * kD;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float l = sL[g];
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const float2 o2 = *reinterpret_cast<const float2*>(&sRed[g][d0]);
        *reinterpret_cast<float2*>(op + g * kD + d0) =
            make_float2((acc[g][0] + o2.x) * inv, (acc[g][1] + o2.y) * inv);
      }
    }
    if (t < G) {
      const float l = sL[t];
      p.l_part[(static_cast<long long>(bh) * p.nsplit + split) * G + t] = l > 0.f ? sM[t] + log2f(l) : -INFINITY;
    }
  }
  if (p.counters == nullptr) return;
  __threadfence();
  __syncthreads();
  if (t == 0) sLast = atomicAdd(p.counters + bh, 1) == p.nsplit - 1;
  __syncthreads();
  if (!sLast) return;
  __threadfence();
  if (t == 0) p.counters[bh] = 0;
  merge_splits<T, G>(p, bh, t, reinterpret_cast<float*>(sK), reinterpret_cast<float*>(sV));
}

template <typename T, int G>
__global__ void __launch_bounds__(kThreads) merge_kernel(const Params p) {
  __shared__ float sW[kThreads * G];
  __shared__ float sMax[(kThreads / 32) * G];
  merge_splits<T, G>(p, blockIdx.x, threadIdx.x, sW, sMax);
}

template <typename T, int G>
cudaError_t launch(const Params& p, int B, cudaStream_t stream) {
  const dim3 grid(p.nsplit, B * p.Hkv);
  decode_kernel<T, G><<<grid, kThreads, 0, stream>>>(p);
  if (p.counters == nullptr) merge_kernel<T, G><<<B * p.Hkv, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_g(const Params& p, int B, int G, cudaStream_t stream) {
  switch (G) {
    case 1: return launch<T, 1>(p, B, stream);
    case 2: return launch<T, 2>(p, B, stream);
    case 4: return launch<T, 4>(p, B, stream);
    case 8: return launch<T, 8>(p, B, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace sk90d

// strides: q (b, h); k (b, h, s); v (b, h, s); idx (b, h, n); cnt (b, h, n); w (b, h, n); all in elements.
extern "C" int sk90_decode_fwd(const void* q, const void* k, const void* v, void* out, float* lse, float* o_part,
                               float* l_part, int* counters, int B, int Hq, int Hkv, int S, int is_bf16, int pattern,
                               int window, int sinks, float scale, const int* sel_idx, const int* sel_cnt,
                               const float* sel_w, const long long* first, const long long* strides, int NB, int K,
                               int QB, int nsplit, int chunk, void* stream, char* err, int errlen) {
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
  const long long want_split = (total + kChunk - 1) / kChunk;
  const long long want_chunk = (total + want_split - 1) / want_split;
  if (total >= (1LL << 31) || nsplit != want_split || chunk != want_chunk || want_split > 65535 ||
      static_cast<long long>(B) * Hkv > 65535) {
    snprintf(err, errlen, "split plan mismatch or too large: total=%lld nsplit=%d (want %lld) chunk=%d (want %lld)",
             total, nsplit, want_split, chunk, want_chunk);
    return 1;
  }
  p.total = static_cast<int>(total);
  p.chunk = chunk;
  p.nsplit = nsplit;
  p.scale_log2 = scale * 1.4426950408889634f;
  const cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const cudaError_t e = is_bf16 ? launch_g<__nv_bfloat16>(p, B, G, st) : launch_g<__half>(p, B, G, st);
  if (e != cudaSuccess) {
    snprintf(err, errlen, "launch failed: %s", cudaGetErrorString(e));
    return 1;
  }
  return 0;
}
