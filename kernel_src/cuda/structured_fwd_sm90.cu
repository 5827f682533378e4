// Hopper (sm_90a) forward for the structured causal patterns: dense, sliding_window, streaming.
//
// Contract (the same as ``triton_structured.structured_forward`` with a plain self-attention
// geometry, q_start = k_start = 0, k_end = S): q (B, Hq, S, 128), k/v (B, Hkv, S, 128), bf16 or fp16,
// views with unit last stride and strides of 16-byte multiples (read through 4-D TMA maps, e.g. the
// transposed (B, S, H, D) projections of a Transformers layer); query head h reads KV head
// h / (Hq / Hkv). Query i sees key j when j <= i and
//   dense           always
//   sliding_window  i - j < W
//   streaming       i - j < W  or  j < sinks
// Outputs: out (B, Hq, S, 128) in q's dtype, a view with its own strides (16-byte multiples, unit last),
// lse (B, Hq, S) float32 contiguous, natural log.
//
// Work tile = 128 query rows of one (batch, query head); CTA = 3 warpgroups (384 threads):
//   warpgroup 0  producer: one thread issues TMA bulk tensor copies (128-byte swizzle) of the
//                Q tile once and of the K and V tiles into a STAGES-deep ring, each slot guarded by
//                a "full" mbarrier (transaction bytes) and an "empty" mbarrier (consumer release);
//                K and V have separate barriers so a K slot is refilled as soon as Q K^T has read it.
//   warpgroups 1, 2  consumers, 64 query rows each: S = Q K^T with wgmma m64n128k16 (both operands
//                in shared memory), online softmax in registers (log2 domain, ex2.approx, row max over
//                the 4 threads of a quad by shuffles, the row sum kept per thread and reduced once at
//                the end), P converted to 16 bits in registers and O += P V with the register-A
//                form of wgmma (V read N-major through the descriptor's transpose bit).
// The consumer loop is software-pipelined by one tile: iteration j issues Q K_j^T and P_{j-1} V_{j-1}
// back to back, waits for the first and runs the softmax of tile j while P_{j-1} V_{j-1} still runs;
// the wait for that product, the O rescale (skipped in a warp whose row maxima all stayed) and the
// conversion of P_j open iteration j+1 (ROTATE: written in one block after the softmax, ptxas hoists
// the wait above the softmax, seen in the SASS; a never-taken trap after the softmax kept the order
// but made ptxas serialize the wgmmas for lack of registers, C7512). The two consumer warpgroups take
// turns issuing their matrix products (ping-pong, two named barriers), so one warpgroup's softmax also
// overlaps the other's tensor-core work. The grid is persistent: one CTA per multiprocessor walks the
// work tiles (query tile, head), and the producer loads the next tile's Q and first K/V tiles while
// the consumers finish the last.
//
// Key tiles per CTA, by arithmetic (the table of triton_structured's docstring): the streaming sink
// tiles [s_lo, s_hi), then the window run [n_lo, n_hi) whose middle [f_lo, f_hi) is full (every row
// sees every key: no element mask); every other tile evaluates the element rule per score.
//
// This file needs no torch headers: the host entry point sk90_structured_fwd takes raw pointers and a
// stream; torch's binding lives in structured_fwd_sm90.cpp.

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include "sm90_common.cuh"
#include "sm90_tma_host.h"

namespace sk90 {

constexpr int kBlockM = 128;        // query rows per CTA
constexpr int kBlockN = 128;        // keys per tile
constexpr int kHeadDim = 128;
constexpr int kHalfBytes = 128 * 64 * 2;    // one TMA box: 128 rows x 64 columns x 2 bytes
constexpr int kTileBytes = 2 * kHalfBytes;  // 128 rows x 128 columns
constexpr int kThreads = 384;
constexpr int kBarBytes = 1024;             // mbarriers at the start of dynamic shared memory
constexpr float kLn2 = 0.6931471805599453f;

// PTX wrappers (mbarrier, TMA, wgmma, named barriers, ex2, pack2, cdiv): sm90_common.cuh, shared with
// the backward.
using namespace sk90c;
using namespace sk90h;

// ------------------------------------------------------------------ tile ranges
struct Params {
  void* out;
  long long osb, osh, oss;  // out's element strides (b, h, s)
  float* lse;
  int S;
  int Hq;
  int Hkv;
  int num_q_tiles;
  int pattern;  // 0 dense, 1 sliding_window, 2 streaming (all causal)
  int window;   // W (dense: ignored)
  int sinks;    // streaming only
  float scale_log2;
  int total_work;  // num_q_tiles * B * Hq
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


__device__ __forceinline__ TileRange tile_range(const Params& p, int m) {
  const int qlo = m * kBlockM;
  const int qhi = min(qlo + kBlockM, p.S) - 1;
  int a_lo = 0, w_lo = 0;
  int a_hi = min(p.S, qhi + 1);
  const int w_hi = min(p.S, qlo + 1);
  if (p.pattern != 0) {
    a_lo = max(0, qlo - p.window + 1);
    w_lo = max(0, qhi - p.window + 1);
  }
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

// Work tile -> (query tile, batch*Hq + head): the query heads of one KV group on consecutive work
// tiles, then query tiles (CTAs running together share K/V tiles in L2); dense causal: longest
// query tiles first.
__device__ __forceinline__ void work_coords(const Params& p, int lin, int& m, int& bh) {
  const int group = p.Hq / p.Hkv;
  const int g = lin % group;
  const int rest = lin / group;
  m = rest % p.num_q_tiles;
  bh = (rest / p.num_q_tiles) * group + g;
  if (p.pattern == 0) m = p.num_q_tiles - 1 - m;
}

// ------------------------------------------------------------------ kernel
// Persistent: CTA c computes work tiles c, c + gridDim.x, ... The K/V ring and its barrier phases run
// on across work tiles (counter `cnt`), and the producer loads the next tile's Q (once both consumers
// have finished their last Q K^T) and first K/V tiles while the consumers finish the current one.
// SKIP_RESCALE: leave O as it is in a warp whose rows all kept their running max. ROTATE: the wait
// for P_{j-1} V_{j-1}, the O rescale and the P conversion move to the top of the next iteration, where
// ptxas cannot hoist the wait above the softmax of tile j (it does within one basic block).
template <bool BF16, int STAGES, bool PINGPONG, bool SKIP_RESCALE, bool ROTATE>
__global__ void __launch_bounds__(kThreads, 1)
    structured_fwd_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                          const __grid_constant__ CUtensorMap tm_v, const Params p) {
  extern __shared__ uint8_t smem_raw[];
  // 1024-byte alignment for the 128-byte swizzle atoms (TMA and wgmma agree on the pattern there)
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  const uint32_t bar_q = base;                          // Q loaded
  const uint32_t bar_qempty = base + 8;                 // Q read by both consumers' last Q K^T
  const uint32_t bar_kfull = base + 16;                 // [STAGES]
  const uint32_t bar_vfull = bar_kfull + 8 * STAGES;    // [STAGES]
  const uint32_t bar_kempty = bar_vfull + 8 * STAGES;   // [STAGES]
  const uint32_t bar_vempty = bar_kempty + 8 * STAGES;  // [STAGES]
  const uint32_t sq = base + kBarBytes;
  const uint32_t sk = sq + kTileBytes;                 // [STAGES] tiles
  const uint32_t sv = sk + STAGES * kTileBytes;        // [STAGES] tiles

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int wg = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    mbar_init(bar_q, 1);
    mbar_init(bar_qempty, 8);  // lane 0 of each of the 8 consumer warps
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(bar_kfull + 8 * s, 1);
      mbar_init(bar_vfull + 8 * s, 1);
      mbar_init(bar_kempty + 8 * s, 8);
      mbar_init(bar_vempty + 8 * s, 8);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {
    // ---------------- producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    if (warp == 0 && lane == 0) {
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tm_k)) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tm_v)) : "memory");
      int cnt = 0, local = 0;
      for (int w = blockIdx.x; w < p.total_work; w += gridDim.x, ++local) {
        int m, bh;
        work_coords(p, w, m, bh);
        const int b = bh / p.Hq, h = bh % p.Hq;
        const int kvh = h / (p.Hq / p.Hkv);
        const TileRange tr = tile_range(p, m);
        if (local > 0) mbar_wait(bar_qempty, (local - 1) & 1);
        mbar_expect_tx(bar_q, kTileBytes);
        tma_load_4d(sq, &tm_q, bar_q, 0, m * kBlockM, h, b);
        tma_load_4d(sq + kHalfBytes, &tm_q, bar_q, 64, m * kBlockM, h, b);
        for (int it = 0; it < tr.count; ++it, ++cnt) {
          const int s = cnt % STAGES;
          const uint32_t ph = ((cnt / STAGES) & 1) ^ 1;  // the release of the slot's previous tile
          const int row = tr.tile(it) * kBlockN;
          if (cnt >= STAGES) mbar_wait(bar_kempty + 8 * s, ph);
          mbar_expect_tx(bar_kfull + 8 * s, kTileBytes);
          tma_load_4d(sk + s * kTileBytes, &tm_k, bar_kfull + 8 * s, 0, row, kvh, b);
          tma_load_4d(sk + s * kTileBytes + kHalfBytes, &tm_k, bar_kfull + 8 * s, 64, row, kvh, b);
          if (cnt >= STAGES) mbar_wait(bar_vempty + 8 * s, ph);
          mbar_expect_tx(bar_vfull + 8 * s, kTileBytes);
          tma_load_4d(sv + s * kTileBytes, &tm_v, bar_vfull + 8 * s, 0, row, kvh, b);
          tma_load_4d(sv + s * kTileBytes + kHalfBytes, &tm_v, bar_vfull + 8 * s, 64, row, kvh, b);
        }
      }
    }
    return;
  }

  // ---------------- consumers
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
  const int cw = wg - 1;  // consumer warpgroup 0/1: query rows cw*64 .. cw*64+63 of the tile
  const int wq = (threadIdx.x % 128) / 32;
  const int g = lane / 4;
  const int qd = lane % 4;
  const float sl2 = p.scale_log2;
  const int W = p.pattern == 0 ? 0x7fffffff : p.window;
  const int sinks = p.pattern == 2 ? p.sinks : 0;
  const int bar_mine = 1 + cw, bar_other = 2 - cw;
  const uint32_t q_base = sq + cw * 64 * 128;  // this warpgroup's 64 rows inside each column half

  float o[64];
  float s[64];
  uint32_t pa[32];
  float m0, m1, l0, l1;
  int row0;
  TileRange tr;

  // Softmax of the scores in s (tile `it`): masks, updates m/l, leaves p in s, returns alpha.
  auto softmax = [&](int it, float& alpha0, float& alpha1) {
    if (tr.masked(it)) {
      const int key0 = tr.tile(it) * kBlockN + 2 * qd;
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
    const float mn0 = fmaxf(m0, mx0 * sl2);  // scale > 0: max(s) * scale == max(s * scale)
    const float mn1 = fmaxf(m1, mx1 * sl2);
    const float ms0 = mn0 == -INFINITY ? 0.f : mn0;
    const float ms1 = mn1 == -INFINITY ? 0.f : mn1;
    alpha0 = mn0 == m0 ? 1.f : ex2(m0 - ms0);  // exactly 1 when the row max did not change
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

  if (PINGPONG && cw == 1) named_arrive(bar_other, 256);  // consumer 0 issues first
  int cnt = 0, local = 0;
  for (int w = blockIdx.x; w < p.total_work; w += gridDim.x, ++local) {
    int m, bh;
    work_coords(p, w, m, bh);
    tr = tile_range(p, m);
    const int ntiles = tr.count;
    row0 = m * kBlockM + cw * 64 + wq * 16 + g;  // this thread's rows: row0 and row0 + 8
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
    m0 = -INFINITY;
    m1 = -INFINITY;
    l0 = 0.f;
    l1 = 0.f;

    // O *= alpha (SKIP_RESCALE: not in a warp whose 16 rows all kept their max, alpha == 1)
    auto rescale = [&](float a0, float a1) {
      if (!SKIP_RESCALE || __any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) {
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
    // prologue: tile 0's scores
    float a0, a1;
    {
      const int st = cnt % STAGES;
      mbar_wait(bar_kfull + 8 * st, (cnt / STAGES) & 1);
      if (PINGPONG) named_sync(bar_mine, 256);
      reg_fence(o);
      wg_fence();
      issue_qk(st);
      wg_commit();
      if (PINGPONG) named_arrive(bar_other, 256);
      wg_wait<0>();
      reg_fence(s);
      release(bar_kempty + 8 * st);
      if (ntiles == 1) release(bar_qempty);
      softmax(0, a0, a1);
      if (!ROTATE) convert_p();
    }
    for (int it = 1; it < ntiles; ++it) {
      const int c = cnt + it;
      const int st = c % STAGES, pst = (c - 1) % STAGES;
      if (ROTATE) {
        // the previous iteration's tail: P_{it-2} V_{it-2} ran during the softmax of tile it-1
        wg_wait<0>();
        reg_fence(o);
        reg_fence(pa);
        if (it >= 2) release(bar_vempty + 8 * ((c - 2) % STAGES));
        rescale(a0, a1);
        convert_p();
      }
      mbar_wait(bar_kfull + 8 * st, (c / STAGES) & 1);
      mbar_wait(bar_vfull + 8 * pst, ((c - 1) / STAGES) & 1);
      if (PINGPONG) named_sync(bar_mine, 256);
      reg_fence(o);
      reg_fence(pa);
      wg_fence();
      issue_qk(st);
      wg_commit();
      issue_pv(pst);
      wg_commit();
      if (PINGPONG) named_arrive(bar_other, 256);
      wg_wait<1>();
      reg_fence(s);
      release(bar_kempty + 8 * st);
      if (it == ntiles - 1) release(bar_qempty);
      softmax(it, a0, a1);
      if (!ROTATE) {
        wg_wait<0>();
        reg_fence(o);
        reg_fence(pa);
        release(bar_vempty + 8 * pst);
        rescale(a0, a1);
        convert_p();
      }
    }
    {
      const int c = cnt + ntiles - 1;
      const int pst = c % STAGES;
      if (ROTATE) {
        wg_wait<0>();
        reg_fence(o);
        reg_fence(pa);
        if (ntiles >= 2) release(bar_vempty + 8 * ((c - 1) % STAGES));
        rescale(a0, a1);
        convert_p();
      }
      mbar_wait(bar_vfull + 8 * pst, (c / STAGES) & 1);
      if (PINGPONG) named_sync(bar_mine, 256);
      reg_fence(o);
      reg_fence(pa);
      wg_fence();
      issue_pv(pst);
      wg_commit();
      if (PINGPONG) named_arrive(bar_other, 256);
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
  if (PINGPONG && cw == 0) named_sync(bar_mine, 256);  // consumer 1's last arrive
}

// ------------------------------------------------------------------ host side
template <bool BF16, int STAGES, bool PINGPONG, bool SKIP_RESCALE, bool ROTATE>
static int launch(const CUtensorMap& tq, const CUtensorMap& tk, const CUtensorMap& tv, const Params& p, int grid,
                  cudaStream_t stream, char* err, int errlen) {
  const int smem = 1024 + kBarBytes + kTileBytes * (1 + 2 * STAGES);
  auto kern = structured_fwd_kernel<BF16, STAGES, PINGPONG, SKIP_RESCALE, ROTATE>;
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

}  // namespace sk90

// Host entry point. variant (tuning only; 0 = the default: 3 K/V stages, ping-pong, SKIP_RESCALE,
// ROTATE, persistent grid): 2 = no ping-pong, 8 = not rotated, 16 = not rotated and O rescaled on
// every tile (the second device run's kernel); + 4 = one CTA per work tile instead of a persistent
// grid. (Two K/V stages, measured slower on the H100, is a template argument only.)
// Returns 0 on success, else writes a message to err.
// strides: the element strides (b, h, s) of q, k, v and out, 12 values.
extern "C" int sk90_structured_fwd(const void* q, const void* k, const void* v, void* out, float* lse,
                                   const long long* strides, int B, int Hq, int Hkv, int S, int is_bf16, int pattern,
                                   int window, int sinks, float scale, int variant, void* stream, char* err,
                                   int errlen) {
  using namespace sk90;
  if (B < 1 || Hq < 1 || Hkv < 1 || Hq % Hkv != 0 || S < 1 || pattern < 0 || pattern > 2 ||
      (pattern != 0 && window < 1) || (pattern == 2 && sinks < 0) || !(scale > 0.f)) {
    snprintf(err, errlen, "bad arguments: B=%d Hq=%d Hkv=%d S=%d pattern=%d window=%d sinks=%d scale=%g", B, Hq, Hkv,
             S, pattern, window, sinks, static_cast<double>(scale));
    return 1;
  }
  EncodeTiledFn enc = get_encode_fn(err, errlen);
  if (!enc) return 1;
  CUtensorMap tq, tk, tv;
  const bool bf16 = is_bf16 != 0;
  const ViewStrides st_q{strides[0], strides[1], strides[2]}, st_k{strides[3], strides[4], strides[5]},
      st_v{strides[6], strides[7], strides[8]};
  if (!make_map_view(&tq, enc, q, bf16, kHeadDim, S, Hq, B, st_q, kBlockM, "q", err, errlen) ||
      !make_map_view(&tk, enc, k, bf16, kHeadDim, S, Hkv, B, st_k, kBlockN, "k", err, errlen) ||
      !make_map_view(&tv, enc, v, bf16, kHeadDim, S, Hkv, B, st_v, kBlockN, "v", err, errlen))
    return 1;
  Params p;
  p.out = out;
  p.osb = strides[9];
  p.osh = strides[10];
  p.oss = strides[11];
  p.lse = lse;
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
  // one CTA per multiprocessor (persistent), or with bit 2 one CTA per work tile
  const int g = (variant & 4) ? p.total_work : (p.total_work < sms ? p.total_work : sms);
  switch (variant & ~4) {
    case 0:
      return bf16 ? launch<true, 3, true, true, true>(tq, tk, tv, p, g, st, err, errlen)
                  : launch<false, 3, true, true, true>(tq, tk, tv, p, g, st, err, errlen);
    case 2:  // no ping-pong
      return bf16 ? launch<true, 3, false, true, true>(tq, tk, tv, p, g, st, err, errlen)
                  : launch<false, 3, false, true, true>(tq, tk, tv, p, g, st, err, errlen);
    case 8:  // not rotated: the wait for P V ends up above the softmax
      return bf16 ? launch<true, 3, true, true, false>(tq, tk, tv, p, g, st, err, errlen)
                  : launch<false, 3, true, true, false>(tq, tk, tv, p, g, st, err, errlen);
    case 16:  // not rotated, O rescaled on every tile (the run-2 kernel)
      return bf16 ? launch<true, 3, true, false, false>(tq, tk, tv, p, g, st, err, errlen)
                  : launch<false, 3, true, false, false>(tq, tk, tv, p, g, st, err, errlen);
    default:
      snprintf(err, errlen, "variant %d not built (0, 2, 8, 16, each optionally + 4)", variant);
      return 1;
  }
}
