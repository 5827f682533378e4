// Token-layout decode (one query token per row) for sm_90: split-KV over a virtual key list.
//
// Row b, KV head h, the query at position qpos = S - 1 (plain geometry, bottom-right). Its keys form
// one virtual list of `total` entries: the streaming sinks not inside the window ([0, n_sink)), the
// window [w_lo, qpos], then the K slots of the selection block sb = qpos / QB - first[b]. A selected
// slot c counts when 0 <= sb < NB, c < min(count, K), 0 <= j < S, the weight (if any) is positive and
// the static rule does not already allow j (qpos - j >= window and, streaming, j >= sinks): the
// semantics of triton.fwd._selection_loop. log2(w) joins the logit.
//
// Grid (nsplit, B * Hkv), 8 warps, one CTA an SM (about 214 KB of shared memory): the host picks
// nsplit = SMs // (B * Hkv) (at least 1, at most one split per 64 keys) so that the grid is one wave.
// CTA `split` takes virtual keys [split * chunk, + chunk), in batches of kMaxKeys. It resolves a
// batch (row index, log-weight bias; -1 for a dropped slot) into shared memory with one round of
// loads (with a one-block selection, beside the load of first[b]); then the batch's 16-key tiles are dealt to
// the warps in turn, each warp streaming its tiles through a private 3-stage cp.async ring (16-byte
// copies, dropped rows zero-filled, 16-byte chunk c of row r at c ^ (r & 7) so that ldmatrix reads
// hit distinct banks), with no CTA barrier in the loop. Per tile, tensor-core m16n8k16 products:
// S = Q K^T with the G query heads as rows (q held in registers as A fragments), an online softmax on
// the accumulator fragments (a row's four lanes reduce by shuffles), then O += P V with P reused from
// the S fragments (rounded to 16 bits, as FlashAttention does) and V read transposed by ldmatrix. The
// warps' results merge in shared memory. One split writes the output; 2..8 splits of a (b, h) form a
// thread-block cluster and CTA 0 merges the others' partials through distributed shared memory;
// otherwise the partials (normalised o, log2-sum-exp) go to a workspace that the last CTA of (b, h)
// to arrive merges (atomic counter, reset by it), or a second kernel when no counter buffer is given.
// H100, B=8, Hkv=8, G=4, top-2048, per call in a 10-call graph (the Triton split-KV kernel 34.6-35):
// this kernel 33.3-33.4 us; earlier versions: one CTA per 64 keys on CUDA cores (2112 CTAs) 39-50 us,
// one CTA an SM on CUDA cores with a CTA-wide 64-key ring 38.9 (per-stage compute and barriers), one
// 256-byte bulk copy (TMA) a row instead of cp.async 37.6, the merge through global memory 34.9.
//
// The kernels (templates on the element type, G = Hq / Hkv and clustering) and their launch; each
// element type is instantiated in its own file (decode_sm90_bf16.cu, decode_sm90_fp16.cu) so that the
// two compile in parallel; the host entry point is in decode_sm90.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>

#include <type_traits>

#include "sm90_common.cuh"

namespace sk90d {

// PTX wrappers shared with the other Hopper kernels (pack2, smem_u32, cp.async): sm90_common.cuh.
using namespace sk90c;

constexpr int kD = 128;
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kTile = 16;        // keys per warp tile (the k extent of P V's m16n8k16)
constexpr int kStages = 3;       // per-warp cp.async ring depth (two tiles in flight while one is used)
constexpr int kMaxKeys = 2048;   // virtual keys per batch of a CTA (their rows and biases live in shared memory)
constexpr int kMaxG = 8;         // query heads per KV head at most (rows of the m16 tiles)
constexpr int kMaxCluster = 8;   // splits merged through a thread-block cluster at most (the portable size)
constexpr int kTileBytes = kTile * kD * 2;

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
constexpr bool kBF16 = std::is_same<T, __nv_bfloat16>::value;  // sk90c::pack2's flag

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

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d (16x8 fp32) += a (16x16, rows 8-15 zero: a1 = a3 = 0) b (16x8), 16-bit inputs.
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&d)[4], uint32_t a0, uint32_t a2, uint32_t b0,
                                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float (&d)[4], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}

// Shared memory of the decode kernel (dynamic, 128-byte aligned).
struct Smem {
  uint8_t ring[kWarps][kStages][2][kTileBytes];  // per warp: [stage][K, V][16 rows x 256 bytes, swizzled]
  int key[kMaxKeys];                             // row index of each virtual key of the batch, -1: dropped
  float bias[kMaxKeys];                          // log2 of its weight (0 without weights)
  float wm[kWarps][kMaxG], wl[kWarps][kMaxG];    // each warp's running max / sum per head (log2 domain)
  int last;
};

// Merge the nsplit partial results of (b, h): thread t < kD owns dimension t of each of the G heads;
// every thread takes part in the barriers. sW: >= kD * G floats and sMax: >= (kD / 32) * G floats of
// shared memory. Pass 1: the per-head maximum (block reduction); pass 2, per tile of kD splits: the
// weights into sW, then the weighted sum of the partial outputs (independent loads, many in flight).
template <typename T, int G>
__device__ void merge_splits(const Params& p, int bh, int t, float* sW, float* sMax) {
  const int b = bh / p.Hkv, h = bh % p.Hkv;
  const int Hq = p.Hkv * G;
  const int warp = t >> 5, lane = t & 31;
  const bool worker = t < kD;
  const float* lp = p.l_part + static_cast<long long>(bh) * p.nsplit * G;
  const float* op = p.o_part + static_cast<long long>(bh) * p.nsplit * G * kD;
  float m[G];
#pragma unroll
  for (int g = 0; g < G; ++g) m[g] = -INFINITY;
  for (int s = t; worker && s < p.nsplit; s += kD) {
#pragma unroll
    for (int g = 0; g < G; ++g) m[g] = fmaxf(m[g], __ldcg(lp + s * G + g));
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m[g] = fmaxf(m[g], __shfl_xor_sync(0xffffffffu, m[g], o));
    if (worker && lane == 0) sMax[warp * G + g] = m[g];
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = sMax[g];
#pragma unroll
    for (int w = 1; w < kD / 32; ++w) m[g] = fmaxf(m[g], sMax[w * G + g]);
  }
  float sum[G], acc[G];
#pragma unroll
  for (int g = 0; g < G; ++g) sum[g] = acc[g] = 0.f;
  for (int s0 = 0; s0 < p.nsplit; s0 += kD) {
    __syncthreads();
    const int s = s0 + t;
    if (worker) {
#pragma unroll
      for (int g = 0; g < G; ++g)  // exp2(-inf) = 0 for an empty split
        sW[t * G + g] = (s < p.nsplit && m[g] != -INFINITY) ? exp2f(__ldcg(lp + s * G + g) - m[g]) : 0.f;
    }
    __syncthreads();
    if (!worker) continue;
    const int n = min(kD, p.nsplit - s0);
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
  if (!worker) return;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const long long row = static_cast<long long>(b) * Hq + h * G + g;
    static_cast<T*>(p.out)[row * kD + t] = from_f<T>(sum[g] > 0.f ? acc[g] / sum[g] : 0.f);
    if (t == 0) p.lse[row] = sum[g] > 0.f ? (m[g] + log2f(sum[g])) * 0.69314718055994531f : -INFINITY;
  }
}

// The slot of virtual key vi in the selection list (-1: a static key or no block), and its index and
// weight loaded without waiting for the count (one round trip for count, index and weight).
__device__ __forceinline__ int load_slot(const Params& p, int b, int h, int vi, int sb, int* j, float* w) {
  const int c = vi - p.n_static;
  *j = -1;
  *w = 1.f;
  if (c < 0 || sb < 0 || c >= p.K) return -1;
  *j = p.idx[b * p.sib + h * p.sih + static_cast<long long>(sb) * p.sin + c];
  if (p.w != nullptr) *w = p.w[b * p.swb + h * p.swh + static_cast<long long>(sb) * p.swn + c];
  return c;
}

// Row index of virtual key vi of (b, h) (-1: dropped) from its loaded slot values; *bias: log2 weight.
__device__ __forceinline__ int resolve_key(const Params& p, int vi, int c, int count, int jj, float wv, float* bias) {
  *bias = 0.f;
  if (vi < p.n_sink) return vi;
  if (vi < p.n_static) return p.w_lo + (vi - p.n_sink);
  const int qpos = p.S - 1;
  if (c < 0 || c >= count || jj < 0 || jj >= p.S || qpos - jj < p.window || jj < p.sinks || !(wv > 0.f)) return -1;
  if (p.w != nullptr) *bias = log2f(wv);
  return jj;
}

// Issue the cp.async copies of the warp's tile `st`, the CTA's tile warp + kWarps * st (keys
// [16 * that, + 16) of the CTA's n), into the warp's ring slot, committed as one group (empty past
// the end).
template <typename T>
__device__ __forceinline__ void issue_tile(Smem& sm, int warp, int lane, const T* kbase, const T* vbase,
                                           const Params& p, int st, int n) {
  const int k0 = (warp + kWarps * st) * kTile;
  if (k0 < n) {
    uint8_t* slot = sm.ring[warp][st % kStages][0];
    const uint32_t sk = smem_u32(slot);
    const uint32_t sv = sk + kTileBytes;
#pragma unroll
    for (int i = 0; i < kTile * 16 / 32; ++i) {
      const int e = lane + 32 * i, r = e >> 4, c = e & 15;
      const int j = k0 + r < n ? sm.key[k0 + r] : -1;
      const bool ok = j >= 0;
      const long long jr = ok ? j : 0;
      const uint32_t off = r * 256 + ((c ^ (r & 7)) << 4);
      cp_async16_zfill(sk + off, kbase + jr * p.ks + c * 8, ok);
      cp_async16_zfill(sv + off, vbase + jr * p.vs + c * 8, ok);
    }
  }
  cp_async_commit();
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Shared-memory float at `addr` of the cluster's CTA `rank`.
__device__ __forceinline__ float ld_cluster(uint32_t addr, int rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

// CLUSTER: the nsplit CTAs of (b, h) form one thread-block cluster and merge through distributed
// shared memory (CTA 0 reads the others' partials after a cluster barrier): no workspace round trip,
// fence or atomic. Otherwise the partials go through global memory and the last CTA to arrive merges.
template <typename T, int G, bool CLUSTER>
__global__ void __launch_bounds__(kThreads, 1) decode_kernel(const Params p) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);

  const int t = threadIdx.x;
  const int warp = t >> 5, lane = t & 31;
  const int split = blockIdx.x, bh = blockIdx.y;
  const int b = bh / p.Hkv, h = bh % p.Hkv;
  const int v0 = split * p.chunk;
  const int n = max(0, min(p.chunk, p.total - v0));  // keys of this CTA
  const int row = lane >> 2, quad = lane & 3;         // fragment row (query head) and column pair

  // q as m16n8k16 A fragments (row = head < G, the other rows zero): its loads overlap the index loads.
  uint32_t qa[kD / 16][2];
  {
    const T* qrow = static_cast<const T*>(p.q) + b * p.qb + static_cast<long long>(h * G + min(row, G - 1)) * p.qh;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const int c = kk * 16 + quad * 2;
      const bool live = row < G;
      qa[kk][0] = live ? pack2<kBF16<T>>(to_f<T>(qrow[c]), to_f<T>(qrow[c + 1])) : 0u;
      qa[kk][1] = live ? pack2<kBF16<T>>(to_f<T>(qrow[c + 8]), to_f<T>(qrow[c + 9])) : 0u;
    }
  }
  // The query's selection block sb = qpos / QB - first[b]. With one block (a decode step's layout) its
  // count and slots are loaded at once, beside first[b] (one round trip less), and dropped if the
  // query does not fall in it.
  const long long sb64 = static_cast<long long>((p.S - 1) / p.QB) - p.first[b];
  const int sb = p.NB == 1 ? 0 : ((sb64 >= 0 && sb64 < p.NB) ? static_cast<int>(sb64) : -1);
  const int count_raw = sb >= 0 ? p.cnt[b * p.scb + h * p.sch + static_cast<long long>(sb) * p.scn] : 0;
  const T* kbase = static_cast<const T*>(p.k) + b * p.kb + h * p.kh;
  const T* vbase = static_cast<const T*>(p.v) + b * p.vb + h * p.vh;
  float m_run = -INFINITY, l_run = 0.f;  // this lane's row: running max / sum (log2 domain)
  float o[kD / 8][4];                    // O fragments: n-tile d covers dims 8d..8d+7 (rows 8-15 unused)
#pragma unroll
  for (int d = 0; d < kD / 8; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;

  // The CTA's keys in batches of kMaxKeys (one batch unless a CTA takes more keys than the shared
  // index arrays hold); the ring is filled afresh for each batch.
  for (int kb0 = 0; kb0 < n; kb0 += kMaxKeys) {
    const int nb = min(kMaxKeys, n - kb0);
    if (kb0 > 0) __syncthreads();  // every warp is done with the previous batch's keys
    {  // every key of the batch resolved with one round of loads (all issued before any is used)
      constexpr int kPer = kMaxKeys / kThreads;
      int slot[kPer], jj[kPer];
      float wv[kPer];
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const int vi = v0 + kb0 + t + u * kThreads;
        slot[u] = t + u * kThreads < nb ? load_slot(p, b, h, vi, sb, &jj[u], &wv[u]) : -1;
      }
      const int count = (sb >= 0 && sb64 == sb) ? min(count_raw, p.K) : 0;
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const int i = t + u * kThreads;
        if (i < nb) {
          float bias;
          sm.key[i] = resolve_key(p, v0 + kb0 + i, slot[u], count, jj[u], wv[u], &bias);
          sm.bias[i] = bias;
        }
      }
    }
    __syncthreads();

    // The batch's 16-key tiles dealt to the warps in turn (tile i to warp i % kWarps): the warps'
    // tile counts differ by at most one, so all of them keep copies in flight until the end.
    const int n_tiles = max(0, ((nb + kTile - 1) / kTile - warp + kWarps - 1) / kWarps);
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) issue_tile<T>(sm, warp, lane, kbase, vbase, p, st, nb);

    for (int st = 0; st < n_tiles; ++st) {
      cp_async_wait<kStages - 2>();
      __syncwarp();  // tile st landed for every lane; the slot of tile st - 1 is free again
      issue_tile<T>(sm, warp, lane, kbase, vbase, p, st + kStages - 1, nb);
      const uint32_t sk = smem_u32(sm.ring[warp][st % kStages][0]);
      const uint32_t sv = sk + kTileBytes;

      float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};  // S: keys 0-7 and 8-15 of the tile
      {
        const int key = (lane & 7) + ((lane >> 4) << 3), half = (lane >> 3) & 1;
#pragma unroll
        for (int kk = 0; kk < kD / 16; ++kk) {
          uint32_t kb[4];
          const int c = kk * 2 + half;
          ldsm_x4(sk + key * 256 + ((c ^ (key & 7)) << 4), kb);
          mma16816<T>(s[0], qa[kk][0], qa[kk][1], kb[0], kb[1]);
          mma16816<T>(s[1], qa[kk][0], qa[kk][1], kb[2], kb[3]);
        }
      }
      const int kt0 = (warp + kWarps * st) * kTile;
      float x[2][2];
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int ki = kt0 + j * 8 + quad * 2 + e;
          const bool ok = ki < nb && sm.key[ki] >= 0;
          x[j][e] = ok ? s[j][e] * p.scale_log2 + sm.bias[ki] : -INFINITY;
          mx = fmaxf(mx, x[j][e]);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run, mx);
      const float m_safe = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = exp2f(m_run - m_safe);  // 0 while nothing was seen (m_run = -inf)
      float pr[2][2], ls = 0.f;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          pr[j][e] = exp2f(x[j][e] - m_safe);
          ls += pr[j][e];
        }
      }
      ls += __shfl_xor_sync(0xffffffffu, ls, 1);
      ls += __shfl_xor_sync(0xffffffffu, ls, 2);
      l_run = l_run * alpha + ls;
      m_run = m_new;
      const uint32_t pa0 = pack2<kBF16<T>>(pr[0][0], pr[0][1]), pa2 = pack2<kBF16<T>>(pr[1][0], pr[1][1]);
      {
        const int key = (lane & 7) + (((lane >> 3) & 1) << 3), half = lane >> 4;
#pragma unroll
        for (int dt = 0; dt < kD / 16; ++dt) {
          uint32_t vb[4];
          const int c = dt * 2 + half;
          ldsm_x4_trans(sv + key * 256 + ((c ^ (key & 7)) << 4), vb);
#pragma unroll
          for (int u = 0; u < 2; ++u) {
            o[2 * dt + u][0] *= alpha;
            o[2 * dt + u][1] *= alpha;
          }
          mma16816<T>(o[2 * dt], pa0, pa2, vb[0], vb[1]);
          mma16816<T>(o[2 * dt + 1], pa0, pa2, vb[2], vb[3]);
        }
      }
    }
    cp_async_wait<0>();  // only empty groups are left: the ring starts clean for the next batch
  }

  // Merge the warps: each writes its (max, sum) per head and its unnormalised O rows.
  __syncthreads();  // every warp is past its ring: it becomes the merge scratch
  float* ow = reinterpret_cast<float*>(sm.ring);  // [warp][G][kD]
  if (row < G) {
    if (quad == 0) {
      sm.wm[warp][row] = m_run;
      sm.wl[warp][row] = l_run;
    }
#pragma unroll
    for (int d = 0; d < kD / 8; ++d)
      *reinterpret_cast<float2*>(&ow[(warp * G + row) * kD + d * 8 + quad * 2]) = make_float2(o[d][0], o[d][1]);
  }
  __syncthreads();
  const int Hq = p.Hkv * G;
  float* cpart = ow + kWarps * kMaxG * kD;  // CLUSTER: this CTA's partial, [G] log2-sum-exp then [G][kD] o
  for (int e = t; e < G * kD; e += kThreads) {
    const int g = e / kD, d = e % kD;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm.wm[w][g]);
    const float M_safe = M == -INFINITY ? 0.f : M;
    float L = 0.f, O = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = exp2f(sm.wm[w][g] - M_safe);
      L += f * sm.wl[w][g];
      O += f * ow[(w * G + g) * kD + d];
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;
    const float lse2 = L > 0.f ? M_safe + log2f(L) : -INFINITY;
    if (p.nsplit == 1) {
      const long long orow = static_cast<long long>(b) * Hq + h * G + g;
      static_cast<T*>(p.out)[orow * kD + d] = from_f<T>(O * inv);
      if (d == 0) p.lse[orow] = lse2 * 0.69314718055994531f;
    } else if (CLUSTER) {
      cpart[G + e] = O * inv;
      if (d == 0) cpart[g] = lse2;
    } else {
      const long long prow = (static_cast<long long>(bh) * p.nsplit + split) * G + g;
      p.o_part[prow * kD + d] = O * inv;
      if (d == 0) p.l_part[prow] = lse2;
    }
  }
  if (p.nsplit == 1) return;
  if (CLUSTER) {
    cluster_sync();  // every CTA's partial is in its shared memory
    if (split == 0) {
      const uint32_t base = smem_u32(cpart);
      for (int e = t; e < G * kD; e += kThreads) {
        const int g = e / kD, d = e % kD;
        float lr[kMaxCluster], orr[kMaxCluster];  // every CTA's values loaded before any is used
#pragma unroll
        for (int r = 0; r < kMaxCluster; ++r) {
          lr[r] = r < p.nsplit ? ld_cluster(base + 4 * g, r) : -INFINITY;
          orr[r] = r < p.nsplit ? ld_cluster(base + 4 * (G + e), r) : 0.f;
        }
        float M = -INFINITY;
#pragma unroll
        for (int r = 0; r < kMaxCluster; ++r) M = fmaxf(M, lr[r]);
        const float M_safe = M == -INFINITY ? 0.f : M;
        float L = 0.f, O = 0.f;
#pragma unroll
        for (int r = 0; r < kMaxCluster; ++r) {
          const float f = exp2f(lr[r] - M_safe);
          L += f;
          O += f * orr[r];
        }
        const long long orow = static_cast<long long>(b) * Hq + h * G + g;
        static_cast<T*>(p.out)[orow * kD + d] = from_f<T>(L > 0.f ? O / L : 0.f);
        if (d == 0) p.lse[orow] = L > 0.f ? (M_safe + log2f(L)) * 0.69314718055994531f : -INFINITY;
      }
    }
    cluster_sync();  // the other CTAs' shared memory stays until CTA 0 has read it
    return;
  }
  if (p.counters == nullptr) return;
  __threadfence();
  __syncthreads();
  if (t == 0) sm.last = atomicAdd(p.counters + bh, 1) == p.nsplit - 1;
  __syncthreads();
  if (!sm.last) return;
  __threadfence();
  if (t == 0) p.counters[bh] = 0;
  float* scratch = ow + kWarps * kMaxG * kD;  // past the warps' rows
  merge_splits<T, G>(p, bh, t, scratch, scratch + kD * G);
}

template <typename T, int G>
__global__ void __launch_bounds__(kThreads) merge_kernel(const Params p) {
  __shared__ float sW[kD * G];
  __shared__ float sMax[(kD / 32) * G];
  merge_splits<T, G>(p, blockIdx.x, threadIdx.x, sW, sMax);
}

template <typename T, int G>
cudaError_t launch(const Params& p, int B, bool cluster, cudaStream_t stream) {
  const dim3 grid(p.nsplit, B * p.Hkv);
  const int smem = static_cast<int>(sizeof(Smem));
  if (cluster && p.nsplit > 1 && p.nsplit <= kMaxCluster) {
    cudaError_t e = cudaFuncSetAttribute(decode_kernel<T, G, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = p.nsplit;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, decode_kernel<T, G, true>, p);
  }
  cudaError_t e = cudaFuncSetAttribute(decode_kernel<T, G, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  decode_kernel<T, G, false><<<grid, kThreads, smem, stream>>>(p);
  if (p.nsplit > 1 && p.counters == nullptr) merge_kernel<T, G><<<B * p.Hkv, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_g(const Params& p, int B, int G, bool cluster, cudaStream_t stream) {
  switch (G) {
    case 1: return launch<T, 1>(p, B, cluster, stream);
    case 2: return launch<T, 2>(p, B, cluster, stream);
    case 4: return launch<T, 4>(p, B, cluster, stream);
    case 8: return launch<T, 8>(p, B, cluster, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace sk90d
