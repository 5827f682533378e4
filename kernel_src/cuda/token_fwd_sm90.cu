// Hopper (sm_90a) forward for a token layout (learned top-k key lists per query block) fused with
// its sliding_window / streaming static part: the inference prefill of the sparse_k pattern.
//
// Contract (``triton_fwd._selection_loop`` with a plain self-attention geometry, q_start = k_start =
// 0, k_end = S): q (B, Hq, S, 128), k/v (B, Hkv, S, 128), bf16 or fp16, views with unit last stride
// and strides of 16-byte multiples (4-D TMA maps; gathered rows by their row stride); query head h
// reads KV head h / (Hq / Hkv). Query i sees key j when j <= i and
//   static part     i - j < W  (streaming: or j < sinks)
//   selection       j is in slot c < min(count, K) of the list indices[b, kvh, blk(i), :], 0 <= j < S,
//                   the weight (if any) w > 0, and the static part does not already allow j
//                   (i - j >= W and j >= sinks; this implies j <= i); log2(w) is added to its logit.
// blk(i) = i / query_block - first_block[b]; rows whose block lies outside [0, NB) see no selected
// key (as the Triton loop). query_block is a multiple of 128, so one 128-row tile has one block.
// Outputs: out (B, Hq, S, 128) in q's dtype, a view with its own strides (16-byte multiples, unit
// last), lse (B, Hq, S) float32 contiguous, natural log.
//
// The kernel is structured_fwd_sm90.cu's (TMA producer warpgroup, two wgmma consumer warpgroups with
// ping-pong, persistent grid, the rotated consumer loop) with a second kind of key tile in front of
// the window tiles: a gathered tile of 128 selected slots. All 128 producer threads take part in
// every tile: for a gathered tile thread t reads slot t's key index, copies the K row (then the V
// row) with cp.async of 16 bytes into the 128-byte-swizzled layout that TMA writes (chunk c of
// row r at r * 128 + 16 * (c ^ (r & 7)) inside each 64-column half; invalid slots copy key row 0,
// finite values whose probability is 0; a warp copies two whole rows per instruction, the keys passed
// by shuffles), and writes per slot a logit bias (log2 w / scale_log2, or
// -inf for an invalid slot) and the first tile row that may see the key (key + W - tile start,
// clamped to [0, 128]); completion on the stage's mbarrier through cp.async.mbarrier.arrive plus an
// ordinary arrive (release of the bias / row bytes). For a window tile thread 0 issues the TMA
// copies with the transaction count and the other 127 threads arrive. The consumers fence the async
// proxy after waiting for a gathered tile (generic-proxy writes read by wgmma), and release a
// gathered K slot after the softmax (its bias / row bytes share the slot).

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include "sm90_common.cuh"
#include "sm90_tma_host.h"

namespace sk90t {

constexpr int kBlockM = 128;  // query rows per CTA
constexpr int kBlockN = 128;  // keys per tile
constexpr int kHeadDim = 128;
constexpr int kHalfBytes = 128 * 64 * 2;    // 128 rows x 64 columns x 2 bytes
constexpr int kTileBytes = 2 * kHalfBytes;  // 128 rows x 128 columns
constexpr int kThreads = 384;
constexpr int kStages = 3;
// Barrier area at the start of dynamic shared memory: mbarriers (128 bytes), then per stage the
// gathered tile's 128 float biases and 128 byte row thresholds.
constexpr int kBiasOff = 128;
constexpr int kThrOff = kBiasOff + kStages * kBlockN * 4;
constexpr int kBarBytes = 2048;
static_assert(kThrOff + kStages * kBlockN <= kBarBytes, "barrier area too small");
constexpr float kLn2 = 0.6931471805599453f;

using namespace sk90c;
using namespace sk90h;

struct Params {
  const void* k;
  const void* v;
  void* out;
  long long ksb, ksh, kss;  // element strides (b, h, s) of k, v and out
  long long vsb, vsh, vss;
  long long osb, osh, oss;
  float* lse;
  const int* sel_idx;      // (B, Hkv, NB, K), unit last stride
  const int* sel_cnt;      // (B, Hkv, NB)
  const float* sel_w;      // (B, Hkv, NB, K) or nullptr
  const long long* first;  // (B,)
  long long sib, sih, sin;  // index strides (elements)
  long long scb, sch, scn;  // count strides
  long long swb, swh, swn;  // weight strides
  int NB, K, QB;
  int S;
  int Hq;
  int Hkv;
  int num_q_tiles;
  int pattern;  // 1 sliding_window, 2 streaming (causal)
  int window;
  int sinks;
  float scale_log2;
  int total_work;
};

struct TileRange {
  int s_lo, n_sink, n_lo, f_lo, f_hi, count;
  __device__ __forceinline__ int tile(int it) const { return it < n_sink ? s_lo + it : n_lo + (it - n_sink); }
  __device__ __forceinline__ bool masked(int it) const {
    if (it < n_sink) return true;
    const int t = n_lo + (it - n_sink);
    return t < f_lo || t >= f_hi;
  }
};

// The static part's key tiles of query tile m (structured_fwd_sm90.cu's tile_range, patterns 1 and 2).
__device__ __forceinline__ TileRange tile_range(const Params& p, int m) {
  const int qlo = m * kBlockM;
  const int qhi = min(qlo + kBlockM, p.S) - 1;
  int a_hi = min(p.S, qhi + 1);
  const int w_hi = min(p.S, qlo + 1);
  const int a_lo = max(0, qlo - p.window + 1);
  const int w_lo = max(0, qhi - p.window + 1);
  a_hi = max(a_hi, a_lo);
  TileRange r;
  r.n_lo = a_lo / kBlockN;
  const int n_hi = max(cdiv(a_hi, kBlockN), r.n_lo);
  r.f_lo = min(max(cdiv(w_lo, kBlockN), r.n_lo), n_hi);
  r.f_hi = min(max(w_hi / kBlockN, r.f_lo), n_hi);
  r.s_lo = 0;
  r.n_sink = 0;
  if (p.pattern == 2) {
    const int s_end = min(min(p.sinks, p.S), qhi + 1);
    r.n_sink = max(min(cdiv(max(s_end, 0), kBlockN), r.n_lo), 0);
  }
  r.count = r.n_sink + (n_hi - r.n_lo);
  return r;
}

// The selection block of query tile m for (batch b, KV head hk): its slot count (clamped to [0, K])
// and the element offsets of its index / weight lists; 0 slots when the block is outside [0, NB).
__device__ __forceinline__ int sel_slots(const Params& p, int m, int b, int hk, long long& ioff, long long& woff) {
  const long long sb = static_cast<long long>((m * kBlockM) / p.QB) - p.first[b];
  ioff = 0;
  woff = 0;
  if (sb < 0 || sb >= p.NB) return 0;
  ioff = b * p.sib + hk * p.sih + sb * p.sin;
  woff = b * p.swb + hk * p.swh + sb * p.swn;
  const int c = p.sel_cnt[b * p.scb + hk * p.sch + sb * p.scn];
  return min(max(c, 0), p.K);
}

// Work tile -> (query tile, batch*Hq + head): the query heads of one KV group on consecutive work
// tiles (their CTAs share the gathered rows in L2), then query tiles.
__device__ __forceinline__ void work_coords(const Params& p, int lin, int& m, int& bh) {
  const int group = p.Hq / p.Hkv;
  const int g = lin % group;
  const int rest = lin / group;
  m = rest % p.num_q_tiles;
  bh = (rest / p.num_q_tiles) * group + g;
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
// Arrive on bar once this thread's earlier cp.async copies complete (pending count +1 now, -1 then:
// the thread's own mbar_arrive is the counted arrival).
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

// The 128 gathered rows of a tile (256 bytes each at base + row_bytes * key) into a 128-byte-swizzled tile
// at dst. Thread t holds the (safe) key of slot t; warp w copies rows 32 w .. 32 w + 31, two rows per
// instruction (lane l: row 2 i + l / 16, 16-byte chunk l % 16), so each instruction reads 512
// contiguous-by-row bytes (four whole 128-byte lines) instead of one sector of 32 rows.
__device__ __forceinline__ void gather_tile(uint32_t dst, const uint8_t* base, long long row_bytes, int key, int t) {
  const int lane = t & 31;
  const int c = lane & 15;
  const uint32_t col = (c >> 3) * kHalfBytes;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int src = 2 * i + (lane >> 4);
    const int kr = __shfl_sync(0xffffffffu, key, src);
    const int r = (t & ~31) + src;
    cp_async16(dst + col + r * 128 + (((c & 7) ^ (r & 7)) << 4), base + kr * row_bytes + 16 * c);
  }
}

template <bool BF16>
__global__ void __launch_bounds__(kThreads, 1)
    token_fwd_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                     const __grid_constant__ CUtensorMap tm_v, const Params p) {
  constexpr int STAGES = kStages;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* const gbase = smem_raw + (base - raw);  // generic pointer to base
  const uint32_t bar_q = base;
  const uint32_t bar_qempty = base + 8;
  const uint32_t bar_kfull = base + 16;
  const uint32_t bar_vfull = bar_kfull + 8 * STAGES;
  const uint32_t bar_kempty = bar_vfull + 8 * STAGES;
  const uint32_t bar_vempty = bar_kempty + 8 * STAGES;
  float* const sbias = reinterpret_cast<float*>(gbase + kBiasOff);  // [STAGES][128]
  uint8_t* const sthr = gbase + kThrOff;                             // [STAGES][128]
  const uint32_t sq = base + kBarBytes;
  const uint32_t sk = sq + kTileBytes;
  const uint32_t sv = sk + STAGES * kTileBytes;

  const int lane = threadIdx.x % 32;
  const int wg = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    mbar_init(bar_q, 1);
    mbar_init(bar_qempty, 8);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(bar_kfull + 8 * s, 128);  // every producer thread arrives
      mbar_init(bar_vfull + 8 * s, 128);
      mbar_init(bar_kempty + 8 * s, 8);
      mbar_init(bar_vempty + 8 * s, 8);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {
    // ---------------- producer: 128 threads
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n" ::: "memory");
    const int t = threadIdx.x;
    const int W = p.window;
    const int sinks = p.pattern == 2 ? p.sinks : 0;
    int cnt = 0, local = 0;
    for (int w = blockIdx.x; w < p.total_work; w += gridDim.x, ++local) {
      int m, bh;
      work_coords(p, w, m, bh);
      const int b = bh / p.Hq;
      const int hk = (bh % p.Hq) / (p.Hq / p.Hkv);
      const TileRange tr = tile_range(p, m);
      long long ioff, woff;
      const int nslots = sel_slots(p, m, b, hk, ioff, woff);
      const int nsel = cdiv(nslots, kBlockN);
      const int qlo = m * kBlockM;
      if (t == 0) {
        if (local > 0) mbar_wait(bar_qempty, (local - 1) & 1);
        mbar_expect_tx(bar_q, kTileBytes);
        tma_load_4d(sq, &tm_q, bar_q, 0, qlo, bh % p.Hq, b);
        tma_load_4d(sq + kHalfBytes, &tm_q, bar_q, 64, qlo, bh % p.Hq, b);
      }
      const uint8_t* kbase = static_cast<const uint8_t*>(p.k) + 2 * (b * p.ksb + hk * p.ksh);
      const uint8_t* vbase = static_cast<const uint8_t*>(p.v) + 2 * (b * p.vsb + hk * p.vsh);
      for (int it = 0; it < nsel + tr.count; ++it, ++cnt) {
        const int s = cnt % STAGES;
        const uint32_t ph = ((cnt / STAGES) & 1) ^ 1;
        if (it < nsel) {
          const int slot = it * kBlockN + t;
          int key = -1;
          float bias = -INFINITY;
          int thr = kBlockM;
          if (slot < nslots) {
            key = p.sel_idx[ioff + slot];
            bool ok = key >= 0 && key < p.S && key >= sinks;
            float wv = 1.f;
            if (p.sel_w != nullptr) {
              wv = p.sel_w[woff + slot];
              ok = ok && wv > 0.f;
            }
            if (ok) {
              // rows i >= key + W see the key (i - key >= W; W >= 1 gives key <= i)
              const long long first_row = static_cast<long long>(key) + W - qlo;
              thr = static_cast<int>(min(max(first_row, 0LL), static_cast<long long>(kBlockM)));
              bias = p.sel_w != nullptr ? __log2f(wv) / p.scale_log2 : 0.f;
            } else {
              key = -1;
            }
          }
          const int safe = key >= 0 ? key : 0;
          if (cnt >= STAGES) mbar_wait(bar_kempty + 8 * s, ph);
          sbias[s * kBlockN + t] = bias;
          sthr[s * kBlockN + t] = static_cast<uint8_t>(thr);
          gather_tile(sk + s * kTileBytes, kbase, 2 * p.kss, safe, t);
          cp_async_arrive(bar_kfull + 8 * s);
          mbar_arrive(bar_kfull + 8 * s);
          if (cnt >= STAGES) mbar_wait(bar_vempty + 8 * s, ph);
          gather_tile(sv + s * kTileBytes, vbase, 2 * p.vss, safe, t);
          cp_async_arrive(bar_vfull + 8 * s);
          mbar_arrive(bar_vfull + 8 * s);
        } else {
          const int row = tr.tile(it - nsel) * kBlockN;
          if (cnt >= STAGES) mbar_wait(bar_kempty + 8 * s, ph);
          if (t == 0) {
            mbar_expect_tx(bar_kfull + 8 * s, kTileBytes);
            tma_load_4d(sk + s * kTileBytes, &tm_k, bar_kfull + 8 * s, 0, row, hk, b);
            tma_load_4d(sk + s * kTileBytes + kHalfBytes, &tm_k, bar_kfull + 8 * s, 64, row, hk, b);
          } else {
            mbar_arrive(bar_kfull + 8 * s);
          }
          if (cnt >= STAGES) mbar_wait(bar_vempty + 8 * s, ph);
          if (t == 0) {
            mbar_expect_tx(bar_vfull + 8 * s, kTileBytes);
            tma_load_4d(sv + s * kTileBytes, &tm_v, bar_vfull + 8 * s, 0, row, hk, b);
            tma_load_4d(sv + s * kTileBytes + kHalfBytes, &tm_v, bar_vfull + 8 * s, 64, row, hk, b);
          } else {
            mbar_arrive(bar_vfull + 8 * s);
          }
        }
      }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    return;
  }

  // ---------------- consumers
  asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n" ::: "memory");
  const int cw = wg - 1;
  const int wq = (threadIdx.x % 128) / 32;
  const int g = lane / 4;
  const int qd = lane % 4;
  const float sl2 = p.scale_log2;
  const int W = p.window;
  const int sinks = p.pattern == 2 ? p.sinks : 0;
  const int bar_mine = 1 + cw, bar_other = 2 - cw;
  const uint32_t q_base = sq + cw * 64 * 128;
  const int lrow0 = cw * 64 + wq * 16 + g;  // this thread's rows inside the tile: lrow0 and lrow0 + 8

  float o[64];
  float s[64];
  uint32_t pa[32];
  float m0, m1, l0, l1;
  int row0;
  int nsel;
  TileRange tr;

  // Softmax of the scores in s (tile `it`, ring stage st): masks, updates m/l, leaves p in s.
  auto softmax = [&](int it, int st, float& alpha0, float& alpha1) {
    if (it < nsel) {
      const float* bb = sbias + st * kBlockN + 2 * qd;
      const uint8_t* tt = sthr + st * kBlockN + 2 * qd;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float2 bj = *reinterpret_cast<const float2*>(bb + 8 * j);
        const uchar2 tj = *reinterpret_cast<const uchar2*>(tt + 8 * j);
        s[4 * j] = lrow0 >= tj.x ? s[4 * j] + bj.x : -INFINITY;
        s[4 * j + 1] = lrow0 >= tj.y ? s[4 * j + 1] + bj.y : -INFINITY;
        s[4 * j + 2] = lrow0 + 8 >= tj.x ? s[4 * j + 2] + bj.x : -INFINITY;
        s[4 * j + 3] = lrow0 + 8 >= tj.y ? s[4 * j + 3] + bj.y : -INFINITY;
      }
    } else if (tr.masked(it - nsel)) {
      const int key0 = tr.tile(it - nsel) * kBlockN + 2 * qd;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + 8 * j + (e & 1);
          const int row = row0 + ((e >> 1) << 3);
          const bool ok = key <= row && (row - key < W || key < sinks);
          if (!ok) s[4 * j + e] = -INFINITY;
        }
      }
    }
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      mx0 = fmaxf(mx0, fmaxf(s[4 * j], s[4 * j + 1]));
      mx1 = fmaxf(mx1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float mn0 = fmaxf(m0, mx0 * sl2);
    const float mn1 = fmaxf(m1, mx1 * sl2);
    const float ms0 = mn0 == -INFINITY ? 0.f : mn0;
    const float ms1 = mn1 == -INFINITY ? 0.f : mn1;
    alpha0 = mn0 == m0 ? 1.f : ex2(m0 - ms0);
    alpha1 = mn1 == m1 ? 1.f : ex2(m1 - ms1);
    float r0 = 0.f, r1 = 0.f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      s[4 * j] = ex2(fmaf(s[4 * j], sl2, -ms0));
      s[4 * j + 1] = ex2(fmaf(s[4 * j + 1], sl2, -ms0));
      s[4 * j + 2] = ex2(fmaf(s[4 * j + 2], sl2, -ms1));
      s[4 * j + 3] = ex2(fmaf(s[4 * j + 3], sl2, -ms1));
      r0 += s[4 * j] + s[4 * j + 1];
      r1 += s[4 * j + 2] + s[4 * j + 3];
    }
    l0 = l0 * alpha0 + r0;
    l1 = l1 * alpha1 + r1;
    m0 = mn0;
    m1 = mn1;
  };

  auto issue_qk = [&](int st) {
    const uint32_t kb = sk + st * kTileBytes;
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      // k-step kk: column half kk/4, 32 bytes per 16 columns inside the 128-byte swizzled row
      const uint32_t off = (kk >> 2) * kHalfBytes + (kk & 3) * 32;
      wgmma_ss<BF16>(s, make_desc(q_base + off, 16, 1024), make_desc(kb + off, 16, 1024), kk > 0);
    }
  };
  auto issue_pv = [&](int st) {
    const uint32_t vb = sv + st * kTileBytes;
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      // 16 keys per k-step (2 groups of 8 rows, SBO 1024); the two 64-column halves LBO apart
      wgmma_rs<BF16>(o, pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3],
                     make_desc(vb + kk * 2048, kHalfBytes, 1024));
    }
  };
  auto convert_p = [&]() {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      pa[2 * j] = pack2<BF16>(s[4 * j], s[4 * j + 1]);
      pa[2 * j + 1] = pack2<BF16>(s[4 * j + 2], s[4 * j + 3]);
    }
  };
  auto release = [&](uint32_t bar) {
    if (lane == 0) mbar_arrive(bar);
  };

  // a gathered tile's K slot carries its bias / row bytes: released after the softmax has read them
  auto release_k_early = [&](int it, int st) {
    if (it >= nsel) release(bar_kempty + 8 * st);
  };
  auto release_k_late = [&](int it, int st) {
    if (it < nsel) release(bar_kempty + 8 * st);
  };

  if (cw == 1) named_arrive(bar_other, 256);  // consumer 0 issues first
  int cnt = 0, local = 0;
  for (int w = blockIdx.x; w < p.total_work; w += gridDim.x, ++local) {
    int m, bh;
    work_coords(p, w, m, bh);
    tr = tile_range(p, m);
    {
      long long ioff, woff;
      const int b = bh / p.Hq;
      nsel = cdiv(sel_slots(p, m, b, (bh % p.Hq) / (p.Hq / p.Hkv), ioff, woff), kBlockN);
    }
    const int ntiles = nsel + tr.count;
    row0 = m * kBlockM + lrow0;
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
    m0 = -INFINITY;
    m1 = -INFINITY;
    l0 = 0.f;
    l1 = 0.f;

    auto rescale = [&](float a0, float a1) {
      if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          o[4 * j] *= a0;
          o[4 * j + 1] *= a0;
          o[4 * j + 2] *= a1;
          o[4 * j + 3] *= a1;
        }
      }
    };

    mbar_wait(bar_q, local & 1);
    float a0, a1;
    {
      const int st = cnt % STAGES;
      mbar_wait(bar_kfull + 8 * st, (cnt / STAGES) & 1);
      if (0 < nsel) fence_proxy_async();
      named_sync(bar_mine, 256);
      reg_fence(o);
      wg_fence();
      issue_qk(st);
      wg_commit();
      named_arrive(bar_other, 256);
      wg_wait<0>();
      reg_fence(s);
      release_k_early(0, st);
      if (ntiles == 1) release(bar_qempty);
      softmax(0, st, a0, a1);
      release_k_late(0, st);
    }
    for (int it = 1; it < ntiles; ++it) {
      const int c = cnt + it;
      const int st = c % STAGES, pst = (c - 1) % STAGES;
      wg_wait<0>();
      reg_fence(o);
      reg_fence(pa);
      if (it >= 2) release(bar_vempty + 8 * ((c - 2) % STAGES));
      rescale(a0, a1);
      convert_p();
      mbar_wait(bar_kfull + 8 * st, (c / STAGES) & 1);
      mbar_wait(bar_vfull + 8 * pst, ((c - 1) / STAGES) & 1);
      if (it - 1 < nsel) fence_proxy_async();
      named_sync(bar_mine, 256);
      reg_fence(o);
      reg_fence(pa);
      wg_fence();
      issue_qk(st);
      wg_commit();
      issue_pv(pst);
      wg_commit();
      named_arrive(bar_other, 256);
      wg_wait<1>();
      reg_fence(s);
      release_k_early(it, st);
      if (it == ntiles - 1) release(bar_qempty);
      softmax(it, st, a0, a1);
      release_k_late(it, st);
    }
    {
      const int c = cnt + ntiles - 1;
      const int pst = c % STAGES;
      wg_wait<0>();
      reg_fence(o);
      reg_fence(pa);
      if (ntiles >= 2) release(bar_vempty + 8 * ((c - 1) % STAGES));
      rescale(a0, a1);
      convert_p();
      mbar_wait(bar_vfull + 8 * pst, (c / STAGES) & 1);
      if (ntiles - 1 < nsel) fence_proxy_async();
      named_sync(bar_mine, 256);
      reg_fence(o);
      reg_fence(pa);
      wg_fence();
      issue_pv(pst);
      wg_commit();
      named_arrive(bar_other, 256);
      wg_wait<0>();
      reg_fence(o);
      reg_fence(pa);
      release(bar_vempty + 8 * pst);
    }
    cnt += ntiles;

    // ---------------- epilogue: O / l, lse
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f;
    const float inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
    const size_t head_row = static_cast<size_t>(bh) * p.S;
    const int row1 = row0 + 8;
    // out row r of (b, h) starts at element b * osb + h * osh + r * oss; thread columns 8 j + 2 qd, +1
    uint16_t* const out_bh = static_cast<uint16_t*>(p.out) + (bh / p.Hq) * p.osb + (bh % p.Hq) * p.osh + 2 * qd;
    if (row0 < p.S) {
      uint32_t* dst = reinterpret_cast<uint32_t*>(out_bh + row0 * p.oss);
#pragma unroll
      for (int j = 0; j < 16; ++j) dst[4 * j] = pack2<BF16>(o[4 * j] * inv0, o[4 * j + 1] * inv0);
      if (qd == 0) p.lse[head_row + row0] = l0 > 0.f ? (m0 + __log2f(l0)) * kLn2 : -INFINITY;
    }
    if (row1 < p.S) {
      uint32_t* dst = reinterpret_cast<uint32_t*>(out_bh + row1 * p.oss);
#pragma unroll
      for (int j = 0; j < 16; ++j) dst[4 * j] = pack2<BF16>(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1);
      if (qd == 0) p.lse[head_row + row1] = l1 > 0.f ? (m1 + __log2f(l1)) * kLn2 : -INFINITY;
    }
  }
  if (cw == 0) named_sync(bar_mine, 256);  // consumer 1's last arrive
}

// ------------------------------------------------------------------ host side
template <bool BF16>
static int launch(const CUtensorMap& tq, const CUtensorMap& tk, const CUtensorMap& tv, const Params& p, int grid,
                  cudaStream_t stream, char* err, int errlen) {
  const int smem = 1024 + kBarBytes + kTileBytes * (1 + 2 * kStages);
  auto kern = token_fwd_kernel<BF16>;
  cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) {
    snprintf(err, errlen, "cudaFuncSetAttribute(%d bytes): %s", smem, cudaGetErrorString(e));
    return 1;
  }
  kern<<<grid, kThreads, smem, stream>>>(tq, tk, tv, p);
  e = cudaGetLastError();
  if (e != cudaSuccess) {
    snprintf(err, errlen, "kernel launch: %s", cudaGetErrorString(e));
    return 1;
  }
  return 0;
}

}  // namespace sk90t

// Host entry point; sel_* as Params (strides in elements, the index / weight lists with unit last
// stride; sel_w may be null); strides: the element strides (b, h, s) of the index, count and weight
// lists (9 values), then of q, k, v and out (12). Returns 0 on success, else writes a message to err.
extern "C" int sk90_token_fwd(const void* q, const void* k, const void* v, void* out, float* lse, int B, int Hq,
                              int Hkv, int S, int is_bf16, int pattern, int window, int sinks, float scale,
                              const int* sel_idx, const int* sel_cnt, const float* sel_w, const long long* first,
                              const long long* strides, int NB, int K, int QB, void* stream, char* err, int errlen) {
  using namespace sk90t;
  if (B < 1 || Hq < 1 || Hkv < 1 || Hq % Hkv != 0 || S < 1 || (pattern != 1 && pattern != 2) || window < 1 ||
      sinks < 0 || !(scale > 0.f) || NB < 1 || K < 1 || QB < kBlockM || QB % kBlockM != 0) {
    snprintf(err, errlen, "bad arguments: B=%d Hq=%d Hkv=%d S=%d pattern=%d window=%d sinks=%d scale=%g NB=%d K=%d QB=%d",
             B, Hq, Hkv, S, pattern, window, sinks, static_cast<double>(scale), NB, K, QB);
    return 1;
  }
  EncodeTiledFn enc = get_encode_fn(err, errlen);
  if (!enc) return 1;
  CUtensorMap tq, tk, tv;
  const bool bf16 = is_bf16 != 0;
  const long long* const vs = strides + 9;  // q, k, v, out: (b, h, s) each
  const ViewStrides st_q{vs[0], vs[1], vs[2]}, st_k{vs[3], vs[4], vs[5]}, st_v{vs[6], vs[7], vs[8]};
  if (!make_map_view(&tq, enc, q, bf16, kHeadDim, S, Hq, B, st_q, kBlockM, "q", err, errlen) ||
      !make_map_view(&tk, enc, k, bf16, kHeadDim, S, Hkv, B, st_k, kBlockN, "k", err, errlen) ||
      !make_map_view(&tv, enc, v, bf16, kHeadDim, S, Hkv, B, st_v, kBlockN, "v", err, errlen))
    return 1;
  Params p;
  p.k = k;
  p.v = v;
  p.out = out;
  p.ksb = vs[3];
  p.ksh = vs[4];
  p.kss = vs[5];
  p.vsb = vs[6];
  p.vsh = vs[7];
  p.vss = vs[8];
  p.osb = vs[9];
  p.osh = vs[10];
  p.oss = vs[11];
  p.lse = lse;
  p.sel_idx = sel_idx;
  p.sel_cnt = sel_cnt;
  p.sel_w = sel_w;
  p.first = first;
  p.sib = strides[0];
  p.sih = strides[1];
  p.sin = strides[2];
  p.scb = strides[3];
  p.sch = strides[4];
  p.scn = strides[5];
  p.swb = strides[6];
  p.swh = strides[7];
  p.swn = strides[8];
  p.NB = NB;
  p.K = K;
  p.QB = QB;
  p.S = S;
  p.Hq = Hq;
  p.Hkv = Hkv;
  p.num_q_tiles = (S + kBlockM - 1) / kBlockM;
  p.pattern = pattern;
  p.window = window;
  p.sinks = sinks;
  p.scale_log2 = scale * 1.4426950408889634f;
  const long long total = static_cast<long long>(p.num_q_tiles) * B * Hq;
  if (total > 0x7fffffffLL) {
    snprintf(err, errlen, "too many work tiles: %lld", total);
    return 1;
  }
  p.total_work = static_cast<int>(total);
  int dev = 0, sms = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess || sms < 1) {
    snprintf(err, errlen, "multiprocessor count: %s", cudaGetErrorString(e));
    return 1;
  }
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int g = p.total_work < sms ? p.total_work : sms;
  return bf16 ? launch<true>(tq, tk, tv, p, g, st, err, errlen) : launch<false>(tq, tk, tv, p, g, st, err, errlen);
}
