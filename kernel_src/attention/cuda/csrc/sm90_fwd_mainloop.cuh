// The Hopper (sm_90a) forward mainloop shared by structured_fwd_sm90.cu (key tiles from the
// structured block ranges) and token_fwd_sm90.cu (gathered tiles of selected keys in front of them).
//
// Work tile = 128 query rows of one (batch, query head); CTA = 3 warpgroups (384 threads):
//   warpgroup 0  producer (in each kernel's file): loads the Q tile once (into one of FwdSmem's QBUFS
//                buffers) and the K and V tiles into a ring of FwdSmem's STAGES slots, each slot guarded by a
//                "full" mbarrier and an "empty" mbarrier (consumer release); K and V have separate barriers so
//                a K slot is refilled as soon as Q K^T has read it.
//   warpgroups 1, 2  consumers (fwd_consumer below), 64 query rows each: S = Q K^T with wgmma
//                m64n128k16 (both operands in shared memory), online softmax in registers (log2
//                domain, ex2.approx, row max over the 4 threads of a quad by shuffles, the row sum kept
//                per thread and reduced once at the end), P converted to 16 bits in registers and
//                O += P V with the register-A form of wgmma (V read N-major through the descriptor's
//                transpose bit).
// The consumer loop is software-pipelined by one tile: iteration j issues Q K_j^T and P_{j-1} V_{j-1}
// back to back, waits for the first and runs the softmax of tile j while P_{j-1} V_{j-1} still runs;
// the wait for that product, the O rescale (skipped in a warp whose row maxima all stayed) and the
// conversion of P_j open iteration j+1 (written in one block after the softmax, ptxas hoists the wait
// above the softmax). The two consumer warpgroups take turns issuing their matrix products (ping-pong,
// two named barriers), so one warpgroup's softmax also overlaps the other's tensor-core work. The grid
// is persistent: one CTA per multiprocessor walks the work tiles (query tile, head), the producer loads
// the next tile's Q (into a second buffer where FwdSmem has one) and first K/V tiles while the consumers
// work on the current one, and the consumers issue the next tile's first Q K^T together with the current
// tile's last P V, so the tensor cores have work while the current tile's epilogue runs.
//
// Head dim (FwdSmem's HEAD_DIM): 128, or 64 for the structured kernels (a tile is one 64-column TMA box, Q K^T takes
// 4 k-steps and P V is m64n64k16 into 32 registers a thread; every other step as at 128).
//
// Key tiles of a work tile, in order: GATHER only, `nsel` gathered tiles (each with per-slot logit
// biases and first visible rows in the ring's side area, written by the producer with ordinary
// stores), then the static tiles by arithmetic (the table of triton.structured's docstring): the
// streaming sink tiles [s_lo, s_hi), then the window run [n_lo, n_hi) whose middle [f_lo, f_hi) is
// full (every row sees every key: no element mask); every other static tile evaluates the element
// rule per score. Listed patterns (bigbird, pattern 4) take their key tiles from a block layout of
// 128 x 128 tiles instead: the full tiles, then the partial ones, which only the causal rule masks.

#pragma once

#include <stdio.h>

#include <type_traits>

#include "sm90_common.cuh"
#include "sm90_tma_host.h"
#include "sm90_work_order.h"

namespace sk90f {

using namespace sk90c;

constexpr int kBlockM = 128;  // query rows per work tile
constexpr int kBlockN = 128;  // keys per tile
constexpr int kHeadDim = 128;              // the token forward's head dim; the structured kernels take 64 or 128
constexpr int kHalfBytes = 128 * 64 * 2;    // one TMA box: 128 rows x 64 columns x 2 bytes
constexpr int kThreads = 384;
constexpr int kStages = 3;  // K/V ring depth of the token forward (its side data sits in the barrier area)
constexpr float kLn2 = 0.6931471805599453f;

// A compile-time count of 8-column groups of the scores (16: a key tile; 2: fwd_consumer's sink step).
template <int J>
using Cols = std::integral_constant<int, J>;

// The score registers of a product of J column groups: s (a key tile), ss (the sink step).
template <int J>
__device__ __forceinline__ auto& pick_scores(float (&s)[64], float (&ss)[8]) {
  if constexpr (J == 16) {
    return s;
  } else {
    static_assert(J == 2, "a key tile or a sink step");
    return ss;
  }
}

// What both forwards' kernels read; the token forward's Params extends it.
struct FwdParams {
  void* out;
  long long osb, osh, oss;  // out's element strides (b, h, s)
  float* lse;
  int S;
  int Hq;
  int Hkv;
  int num_q_tiles;
  FastDiv div_hq, div_group, div_q_tiles, div_window;  // by Hq, Hq / Hkv, num_q_tiles, max(window, 1)
  int pattern;  // 0 dense, 1 sliding_window, 2 streaming, 3 block_diagonal, 4 listed (bigbird; all causal)
  int window;   // W, or block_diagonal's block (dense, listed: ignored)
  int sinks;    // streaming only
  float scale_log2;
  int total_work;  // num_q_tiles * B * Hq
  // the work order (set_work_order; listed, token: static): sm90_work_order.h's kOrder*, which the device reads as
  // blocks of `grid` work tiles counted from multiples of period, the odd ones that end inside span reversed
  int order;
  int period;      // one KV head's work tiles (head_snake), else all of them
  int span;        // period, or 0 (static: no block reversed)
  FastDiv div_grid, div_period;  // by the grid, by period
  // listed only (else null): a block layout of 128 x 128 tiles, rows (b * Hkv + kv head) * num_q_tiles + m;
  // fnum/pnum the full/partial key tile counts of a row, fidx/pidx its key tiles (fw/pw per row)
  const int* fnum;
  const int* fidx;
  const int* pnum;
  const int* pidx;
  int fw, pw;
};

// The static key tiles of one query tile: `count` tiles, the sinks first; listed: the layout row's
// n_sink full tiles (list `full`), then its partial ones (list `part`). A listed full tile past the
// `whole` key tiles inside S is masked too: its keys past S (zeros from TMA) must not join the softmax.
struct TileRange {
  int s_lo, n_sink, n_lo, f_lo, f_hi, count, whole;
  const int* full;
  const int* part;
  __device__ __forceinline__ int tile(int it) const {
    if (full) return it < n_sink ? full[it] : part[it - n_sink];
    return it < n_sink ? s_lo + it : n_lo + (it - n_sink);
  }
  __device__ __forceinline__ bool masked(int it) const {
    if (full) return it >= n_sink || full[it] >= whole;
    if (it < n_sink) return true;
    const int t = n_lo + (it - n_sink);
    return t < f_lo || t >= f_hi;
  }
};

// Work tile (query tile m, batch * Hq + head bh) -> its key tiles. LISTED: a kernel instantiated for
// pattern 4 (the other instantiations keep `full` a null constant, so their tile arithmetic is unchanged).
// SINK_STEP: streaming with 1 to 16 sinks, whose every work tile starts with key tile 0 as a sink step (fwd_consumer
// reads its first 16 keys only), also where the window run starts at tile 0 and holds the sinks itself (the step's
// keys are all masked then).
template <bool LISTED, bool SINK_STEP = false>
__device__ __forceinline__ TileRange tile_range(const FwdParams& p, int m, int bh) {
  TileRange r;
  r.full = nullptr;
  r.part = nullptr;
  r.whole = 0;
  if constexpr (LISTED) {
    const int b = p.div_hq.div(bh);
    const int kvh = p.div_group.div(bh - b * p.Hq);
    const long long row = (static_cast<long long>(b) * p.Hkv + kvh) * p.num_q_tiles + m;
    r.full = p.fidx + row * p.fw;
    r.part = p.pidx + row * p.pw;
    r.n_sink = p.fnum[row];
    r.count = r.n_sink + p.pnum[row];
    r.whole = p.S / kBlockN;
    r.s_lo = r.n_lo = r.f_lo = r.f_hi = 0;
    return r;
  }
  const int qlo = m * kBlockM;
  const int qhi = min(qlo + kBlockM, p.S) - 1;
  int a_lo = 0, w_lo = 0;
  int a_hi = min(p.S, qhi + 1);
  const int w_hi = min(p.S, qlo + 1);
  if (p.pattern == 1 || p.pattern == 2) {
    a_lo = max(0, qlo - p.window + 1);
    w_lo = max(0, qhi - p.window + 1);
  } else if (p.pattern == 3) {  // the blocks of the tile's first and last rows (causal: no right edge)
    a_lo = qlo - p.div_window.mod(qlo);
    w_lo = qhi - p.div_window.mod(qhi);
  }
  a_hi = max(a_hi, a_lo);
  r.n_lo = a_lo / kBlockN;
  const int n_hi = max(cdiv(a_hi, kBlockN), r.n_lo);
  r.f_lo = min(max(cdiv(w_lo, kBlockN), r.n_lo), n_hi);
  r.f_hi = min(max(w_hi / kBlockN, r.f_lo), n_hi);
  r.s_lo = 0;
  r.n_sink = 0;
  if (SINK_STEP) {
    r.n_sink = 1;
  } else if (p.pattern == 2) {
    const int s_end = min(min(p.sinks, p.S), qhi + 1);
    r.n_sink = max(min(cdiv(max(s_end, 0), kBlockN), r.n_lo), 0);
  }
  r.count = r.n_sink + (n_hi - r.n_lo);
  return r;
}

// The w-th work tile of the CTAs' turns (CTA c takes w = c, c + grid, ...) -> its tile in work_coords' natural order
// under the order set_work_order wrote into p: sm90_work_order.h's ordered_tile, without a branch on the order (static
// reverses no block: span 0) and with the divisions by multiply-high.
__device__ __forceinline__ int ordered_work(const FwdParams& p, int w) {
  const int base = p.div_period.div(w) * p.period;
  const int grid = static_cast<int>(p.div_grid.d);
  const int k = w - base;
  const int block = p.div_grid.div(k);
  return (block & 1) && (block + 1) * grid <= p.span ? base + block * grid + (grid - 1) - (k - block * grid) : w;
}

// Host: p's work-order fields for sm90_work_order.h's `order` (after prepare_fwd's total_work, num_q_tiles, Hq, Hkv).
inline void set_work_order(FwdParams& p, int order) {
  const sk90w::OrderBlocks blocks = sk90w::order_blocks(order, (p.Hq / p.Hkv) * p.num_q_tiles, p.total_work);
  p.order = order;
  p.period = blocks.period;
  p.span = blocks.span;
  p.div_period = FastDiv(p.period);
}

// Work tile -> (query tile, batch*Hq + head), after the work order: the query heads of one KV group on consecutive work
// tiles (CTAs running together share K/V tiles, and gathered rows, in L2), then query tiles; dense
// causal: longest query tiles first.
__device__ __forceinline__ void work_coords(const FwdParams& p, int w, int& m, int& bh) {
  const int lin = ordered_work(p, w);
  const int rest = p.div_group.div(lin);
  const int g = lin - rest * static_cast<int>(p.div_group.d);
  const int bk = p.div_q_tiles.div(rest);  // batch * Hkv + kv head
  m = rest - bk * p.num_q_tiles;
  bh = bk * static_cast<int>(p.div_group.d) + g;
  if (p.pattern == 0) m = p.num_q_tiles - 1 - m;
}

// Shared-memory addresses: kBarBytes of barriers (and side data) at the 1024-byte aligned base, then
// QBUFS Q tiles and the K and V rings of STAGES tiles each. With QBUFS = 2 the producer loads a work tile's Q
// while the consumers still read the previous one's, so a work tile's first Q K^T does not wait for it.
// HEAD_DIM 64 or 128: a tile is HEAD_DIM / 64 TMA boxes of 128 rows x 64 columns (kTile bytes).
template <int kBarBytes, int STAGES, int QBUFS, int HEAD_DIM = kHeadDim>
struct FwdSmem {
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head dim 64 or 128");
  static constexpr int kRing = STAGES;
  static constexpr int kQBufs = QBUFS;
  static constexpr int kHeadDim = HEAD_DIM;
  static constexpr int kTile = HEAD_DIM / 64 * kHalfBytes;
  uint32_t bar_q, bar_qempty, bar_kfull, bar_vfull, bar_kempty, bar_vempty, sq, sk, sv;
  static constexpr int kBytes = 1024 + kBarBytes + kTile * (QBUFS + 2 * STAGES);  // with alignment slack
  static_assert(16 * QBUFS + 32 * STAGES <= kBarBytes, "barrier area too small");
  __device__ __forceinline__ explicit FwdSmem(uint32_t base)
      : bar_q(base),                            // [QBUFS] Q loaded
        bar_qempty(base + 8 * QBUFS),           // [QBUFS] Q read by both consumers' last Q K^T
        bar_kfull(base + 16 * QBUFS),           // [STAGES]
        bar_vfull(bar_kfull + 8 * STAGES),      // [STAGES]
        bar_kempty(bar_vfull + 8 * STAGES),     // [STAGES]
        bar_vempty(bar_kempty + 8 * STAGES),    // [STAGES]
        sq(base + kBarBytes),                   // [QBUFS] tiles
        sk(sq + QBUFS * kTile),                 // [STAGES] tiles
        sv(sk + STAGES * kTile) {}              // [STAGES] tiles

  // Thread 0: the barriers; `full_count` arrivals complete a K or V slot.
  __device__ __forceinline__ void init(uint32_t full_count) const {
    for (int i = 0; i < QBUFS; ++i) {
      mbar_init(bar_q + 8 * i, 1);
      mbar_init(bar_qempty + 8 * i, 8);  // lane 0 of each of the 8 consumer warps
    }
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(bar_kfull + 8 * s, full_count);
      mbar_init(bar_vfull + 8 * s, full_count);
      mbar_init(bar_kempty + 8 * s, 8);
      mbar_init(bar_vempty + 8 * s, 8);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }

  // One thread: Q tile m of (b, h), the CTA's `local`-th work tile, into buffer local % QBUFS once both consumers
  // released that buffer's previous tile.
  __device__ __forceinline__ void load_q(const CUtensorMap* tm_q, int local, int m, int h, int b) const {
    const int qb = local % QBUFS, use = local / QBUFS;
    if (use > 0) mbar_wait(bar_qempty + 8 * qb, (use - 1) & 1);
    load_tile(sq + qb * kTile, tm_q, bar_q + 8 * qb, m * kBlockM, h, b);
  }

  // One thread: rows row .. row + 127 of (b, head) as a 128-byte-swizzled tile, completing on bar.
  __device__ __forceinline__ static void load_tile(uint32_t dst, const CUtensorMap* map, uint32_t bar, int row,
                                                   int head, int b) {
    mbar_expect_tx(bar, kTile);
    tma_load_4d(dst, map, bar, 0, row, head, b);
    if constexpr (HEAD_DIM == 128) tma_load_4d(dst + kHalfBytes, map, bar, 64, row, head, b);
  }
};

// The two consumer warpgroups' loop over the work tiles. GATHER: the first nsel_of(m, bh) key tiles
// of a work tile are gathered ones (the token forward): their ring slots carry per-slot logit biases
// (sbias[stage][128]) and first visible local rows (sthr[stage][128]) written with ordinary stores,
// so the consumers fence the async proxy after waiting for them and release their K slot only after
// the softmax has read the side data. Else every key tile is static (nsel = 0).
// WG_UNIFORM: the warpgroup index is read through a shuffle from lane 0, so the compiler knows it is warp-uniform
// and keeps every wgmma descriptor in uniform registers (else the Q descriptors are built in vector registers and
// moved over, R2UR, at each wgmma). Faster on long rows (dense 64K 2%, windows of 4096 1%, block_diagonal 4096 1%),
// slower on short ones (block_diagonal 512 5%; ptxas schedules the work tile's edges differently), so the structured
// launcher picks it by the mean row length; the token forward takes it (the other variant ran 0.5-1% slower there;
// docs/history.md).
// SINK_STEP (streaming with 1 to 16 sinks; tile_range's SINK_STEP): every work tile's first key tile is a sink step
// of 16 keys, Q K^T m64n16k16 into ss (8 registers) and P V over one k-step, about an eighth of a key tile's work.
// The step is always the tile's first, so its narrow products sit where the first Q K^T is issued (before the loop,
// in the previous tile's tail) and in the loop's first iteration, peeled: no wgmma depends on a branch.
template <bool BF16, bool GATHER, bool LISTED, bool WG_UNIFORM, bool SINK_STEP, class Smem, class NSel>
__device__ __forceinline__ void fwd_consumer(const FwdParams& p, const Smem& sm, const float* sbias,
                                             const uint8_t* sthr, NSel nsel_of) {
  const int lane = threadIdx.x % 32;
  // consumer warpgroup 0/1: query rows cw*64 .. cw*64+63 of the tile
  const int cw = (WG_UNIFORM ? __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0)
                             : static_cast<int>(threadIdx.x / 128)) - 1;
  const int wq = (threadIdx.x % 128) / 32;
  const int g = lane / 4;
  const int qd = lane % 4;
  const float sl2 = p.scale_log2;
  const int W = (p.pattern == 1 || p.pattern == 2) ? p.window : 0x7fffffff;
  const int sinks = p.pattern == 2 ? p.sinks : 0;
  const int block = p.pattern == 3 ? p.window : 0;  // block_diagonal: a row sees keys from its block's start
  const int bar_mine = 1 + cw, bar_other = 2 - cw;
  constexpr int kS = Smem::kRing, kQB = Smem::kQBufs, kTile = Smem::kTile;
  constexpr int D = Smem::kHeadDim;  // 64 or 128: O's columns, Q K^T's k-steps D / 16
  // this warpgroup's 64 rows inside each column half of the `local`-th work tile's Q buffer
  auto q_rows = [&](int local) { return sm.sq + (local % kQB) * kTile + cw * 64 * 128; };
  const int lrow0 = cw * 64 + wq * 16 + g;        // this thread's rows inside the tile: lrow0 and lrow0 + 8
  const uint32_t sk = sm.sk, sv = sm.sv;

  float o[D / 2];
  float s[64];
  float ss[8];  // SINK_STEP: the sink step's scores, keys 0..15 in wgmma's register order (else unused)
  auto scores = [&](auto cols) -> decltype(auto) { return pick_scores<decltype(cols)::value>(s, ss); };
  uint32_t pa[32];
  float m0, m1, l0, l1;
  int row0;
  int nsel = 0, nsel_next = 0;  // GATHER: the gathered tiles of this work tile and of the next (read in the tail)
  TileRange tr;
  auto gathered = [&](int it) { return GATHER && it < nsel; };

  // The online softmax of masked scores of J groups of 8 columns (J = 16: a key tile in s; 2: the sink step in
  // ss): updates m/l, leaves p in place.
  auto update = [&](auto cols, float& alpha0, float& alpha1) {
    constexpr int J = decltype(cols)::value;
    auto& sc = scores(cols);
    // row maxima as up to four independent chains per row (a chain of 16 dependent fmaxf is latency-bound)
    float c0[4], c1[4];
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const float a = fmaxf(sc[4 * j], sc[4 * j + 1]), b = fmaxf(sc[4 * j + 2], sc[4 * j + 3]);
      c0[j % 4] = j < 4 ? a : fmaxf(c0[j % 4], a);
      c1[j % 4] = j < 4 ? b : fmaxf(c1[j % 4], b);
    }
    float mx0, mx1;
    if constexpr (J >= 4) {
      mx0 = fmaxf(fmaxf(c0[0], c0[1]), fmaxf(c0[2], c0[3]));
      mx1 = fmaxf(fmaxf(c1[0], c1[1]), fmaxf(c1[2], c1[3]));
    } else {
      static_assert(J == 2, "a key tile or a sink step");
      mx0 = fmaxf(c0[0], c0[1]);
      mx1 = fmaxf(c1[0], c1[1]);
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
    for (int j = 0; j < J; ++j) {
      sc[4 * j] = ex2(fmaf(sc[4 * j], sl2, -ms0));
      sc[4 * j + 1] = ex2(fmaf(sc[4 * j + 1], sl2, -ms0));
      sc[4 * j + 2] = ex2(fmaf(sc[4 * j + 2], sl2, -ms1));
      sc[4 * j + 3] = ex2(fmaf(sc[4 * j + 3], sl2, -ms1));
      r0 += sc[4 * j] + sc[4 * j + 1];
      r1 += sc[4 * j + 2] + sc[4 * j + 3];
    }
    l0 = l0 * alpha0 + r0;
    l1 = l1 * alpha1 + r1;
    m0 = mn0;
    m1 = mn1;
  };

  // Softmax of the scores in s (tile `it`, ring stage st): masks, updates m/l, leaves p in s.
  auto softmax = [&](int it, int st, float& alpha0, float& alpha1) {
    if (gathered(it)) {
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
      const int first0 = block ? row0 - p.div_window.mod(row0) : 0;  // the first keys rows row0 and row0 + 8 see
      const int first1 = block ? (row0 + 8) - p.div_window.mod(row0 + 8) : 0;
      // the keys a row sees, as offsets d from key0: [lo, hi] (its window or block, up to the diagonal) and the sinks
      // below sk; d is a constant per element, so each test is two or three compares with no arithmetic
      const int hi0 = row0 - key0, hi1 = hi0 + 8, sk = sinks - key0;
      const int lo0 = max(first0, row0 - W + 1) - key0, lo1 = max(first1, row0 + 8 - W + 1) - key0;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int d = 8 * j + (e & 1);
          const bool ok = d <= ((e >> 1) ? hi1 : hi0) && (d >= ((e >> 1) ? lo1 : lo0) || d < sk);
          if (!ok) s[4 * j + e] = -INFINITY;
        }
      }
    }
    update(Cols<16>{}, alpha0, alpha1);
  };

  // The sink step's softmax: keys 0..15 of key tile 0 in ss, visible below the sinks unless the window run starts
  // at tile 0 (it holds the sinks then); the rows are past the sinks (the step's tile is never the diagonal's).
  auto softmax_sink = [&](float& alpha0, float& alpha1) {
    const int sk = tr.n_lo > 0 ? sinks : 0;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (8 * j + 2 * qd + (e & 1) >= sk) ss[4 * j + e] = -INFINITY;
      }
    }
    update(Cols<2>{}, alpha0, alpha1);
  };

  // S = Q K^T of ring slot st, Q at qa (this warpgroup's rows of a Q buffer): all 128 keys into s (J = 16), or the
  // first 16 into ss (J = 2, the sink step)
  auto issue_qk_cols = [&](auto cols, int st, uint32_t qa) {
    const uint64_t qd0 = make_desc(qa, 16, 1024), kd0 = make_desc(sk + st * kTile, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      // k-step kk: column half kk/4, 32 bytes per 16 columns inside the 128-byte swizzled row
      const uint32_t off = (kk >> 2) * kHalfBytes + (kk & 3) * 32;
      if constexpr (decltype(cols)::value == 16) {
        wgmma_ss<BF16>(s, desc_advance(qd0, off), desc_advance(kd0, off), kk > 0);
      } else {
        wgmma_ss16<BF16>(ss, desc_advance(qd0, off), desc_advance(kd0, off), kk > 0);
      }
    }
  };
  auto issue_qk = [&](int st, uint32_t qa) { issue_qk_cols(Cols<16>{}, st, qa); };
  // a work tile's first key tile: the sink step under SINK_STEP
  auto issue_qk_first = [&](int st, uint32_t qa) { issue_qk_cols(Cols<SINK_STEP ? 2 : 16>{}, st, qa); };
  // O += P V of ring slot st over the first J / 2 k-steps of 16 keys (the sink step: one)
  auto issue_pv_cols = [&](auto cols, int st) {
    const uint64_t vd0 = make_desc(sv + st * kTile, kHalfBytes, 1024);
#pragma unroll
    for (int kk = 0; kk < decltype(cols)::value / 2; ++kk) {
      // 16 keys per k-step (2 groups of 8 rows, SBO 1024); the two 64-column halves LBO apart; N = D (o's size)
      wgmma_rs<BF16>(o, pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3], desc_advance(vd0, kk * 2048));
    }
  };
  auto issue_pv = [&](int st) { issue_pv_cols(Cols<16>{}, st); };
  auto convert_p_cols = [&](auto cols) {
    auto& sc = scores(cols);
#pragma unroll
    for (int j = 0; j < decltype(cols)::value; ++j) {
      pa[2 * j] = pack2<BF16>(sc[4 * j], sc[4 * j + 1]);
      pa[2 * j + 1] = pack2<BF16>(sc[4 * j + 2], sc[4 * j + 3]);
    }
  };
  auto convert_p = [&]() { convert_p_cols(Cols<16>{}); };
  // reg_fence of the registers a product of J column groups uses (the sink step's leave the others free)
  auto fence_p = [&](auto cols) { reg_fence_first<2 * decltype(cols)::value>(pa); };
  auto fence_first_scores = [&]() { reg_fence(scores(Cols<SINK_STEP ? 2 : 16>{})); };
  auto release = [&](uint32_t bar) {
    if (lane == 0) mbar_arrive(bar);
  };
  // a gathered tile's K slot carries its bias / row bytes: released after the softmax has read them
  auto release_k_early = [&](int it, int st) {
    if (!gathered(it)) release(sm.bar_kempty + 8 * st);
  };
  auto release_k_late = [&](int it, int st) {
    if (gathered(it)) release(sm.bar_kempty + 8 * st);
  };
  // generic-proxy writes of a gathered tile (cp.async rows, side data) -> wgmma reads
  auto fence_gathered = [&](int it) {
    if (gathered(it)) fence_proxy_async();
  };

  if (cw == 1) named_arrive(bar_other, 256);  // consumer 0 issues first
  // A work tile's first Q K^T goes out with the previous tile's last P V (the tail below); the first tile's
  // here. Every CTA has a work tile (grid <= total_work), and no wgmma is issued under a branch (ptxas would
  // serialize every wgmma of the kernel).
  {
    int m, bh;
    work_coords(p, blockIdx.x, m, bh);
    if (GATHER) nsel = nsel_next = nsel_of(m, bh);
    mbar_wait(sm.bar_q, 0);
    mbar_wait(sm.bar_kfull, 0);
    fence_gathered(0);
    named_sync(bar_mine, 256);
    wg_fence();
    issue_qk_first(0, q_rows(0));
    wg_commit();
    named_arrive(bar_other, 256);
    wg_wait<0>();
    fence_first_scores();
  }
  int cnt = 0, local = 0;
  for (int w = blockIdx.x; w < p.total_work; w += gridDim.x, ++local) {
    int m, bh;
    work_coords(p, w, m, bh);
    tr = tile_range<LISTED, SINK_STEP>(p, m, bh);
    nsel = nsel_next;
    const int ntiles = nsel + tr.count;
    row0 = m * kBlockM + lrow0;
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    m0 = -INFINITY;
    m1 = -INFINITY;
    l0 = 0.f;
    l1 = 0.f;

    // O *= alpha, not in a warp whose 16 rows all kept their max (alpha == 1)
    auto rescale = [&](float a0, float a1) {
      if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) {
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
          o[4 * j] *= a0;
          o[4 * j + 1] *= a0;
          o[4 * j + 2] *= a1;
          o[4 * j + 3] *= a1;
        }
      }
    };

    const uint32_t bar_qempty = sm.bar_qempty + 8 * (local % kQB);
    // tile 0's scores (issued before the loop or in the previous tile's tail)
    float a0, a1;
    {
      const int st = cnt % kS;
      release_k_early(0, st);
      if (ntiles == 1) release(bar_qempty);
      if constexpr (SINK_STEP) {
        softmax_sink(a0, a1);
      } else {
        softmax(0, st, a0, a1);
      }
      release_k_late(0, st);
    }
    // Q K_it^T with P_{it-1} V_{it-1}; prev: tile it - 1's columns (Cols<2>: the sink step)
    auto step = [&](int it, auto prev) {
      const int c = cnt + it;
      const int st = c % kS, pst = (c - 1) % kS;
      // the previous iteration's tail: P_{it-2} V_{it-2} ran during the softmax of tile it-1
      wg_wait<0>();
      reg_fence(o);
      fence_p(prev);
      if (it >= 2) release(sm.bar_vempty + 8 * ((c - 2) % kS));
      rescale(a0, a1);
      convert_p_cols(prev);
      mbar_wait(sm.bar_kfull + 8 * st, (c / kS) & 1);
      mbar_wait(sm.bar_vfull + 8 * pst, ((c - 1) / kS) & 1);
      fence_gathered(it - 1);  // tile it is gathered only if tile it - 1 is
      named_sync(bar_mine, 256);
      reg_fence(o);
      fence_p(prev);
      wg_fence();
      if constexpr (decltype(prev)::value == 2) {
        // s has held no score since the last tile's P: a new definition here (no instruction) ends its live range
        // there, else it stays allocated across the epilogue and the sink step (ptxas then serializes wgmma)
#pragma unroll
        for (int i = 0; i < 64; ++i) asm volatile("" : "=f"(s[i]));
      }
      issue_qk(st, q_rows(local));
      wg_commit();
      issue_pv_cols(prev, pst);
      wg_commit();
      named_arrive(bar_other, 256);
      wg_wait<1>();
      reg_fence(s);
      release_k_early(it, st);
      if (it == ntiles - 1) release(bar_qempty);
      softmax(it, st, a0, a1);
      release_k_late(it, st);
    };
    // under SINK_STEP every work tile has the sink step and at least one window tile: the step after the sink step
    // is peeled, so the narrow P V is not behind a branch
    int it1 = 1;
    if constexpr (SINK_STEP) {
      step(1, Cols<2>{});
      it1 = 2;
    }
    for (int it = it1; it < ntiles; ++it) step(it, Cols<16>{});
    // ---------------- epilogue: O / l, lse of this work tile
    auto epilogue = [&]() {
      l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
      l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
      l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
      l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
      const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f;
      const float inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
      const size_t head_row = static_cast<size_t>(bh) * p.S;
      const int row1 = row0 + 8;
      // out row r of (b, h) starts at element b * osb + h * osh + r * oss; thread columns 8 j + 2 qd, +1
      const int b = p.div_hq.div(bh);
      uint16_t* const out_bh = static_cast<uint16_t*>(p.out) + b * p.osb + (bh - b * p.Hq) * p.osh + 2 * qd;
      if (row0 < p.S) {
        uint32_t* dst = reinterpret_cast<uint32_t*>(out_bh + row0 * p.oss);
#pragma unroll
        for (int j = 0; j < D / 8; ++j) dst[4 * j] = pack2<BF16>(o[4 * j] * inv0, o[4 * j + 1] * inv0);
        if (qd == 0) p.lse[head_row + row0] = l0 > 0.f ? (m0 + __log2f(l0)) * kLn2 : -INFINITY;
      }
      if (row1 < p.S) {
        uint32_t* dst = reinterpret_cast<uint32_t*>(out_bh + row1 * p.oss);
#pragma unroll
        for (int j = 0; j < D / 8; ++j) dst[4 * j] = pack2<BF16>(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1);
        if (qd == 0) p.lse[head_row + row1] = l1 > 0.f ? (m1 + __log2f(l1)) * kLn2 : -INFINITY;
      }
    };

    // tail: the last P V, and with it the next work tile's first Q K^T (its Q sits in the other buffer), so
    // the tensor cores have work while this tile's epilogue runs
    const int w_next = w + gridDim.x;
    const bool has_next = w_next < p.total_work;
    {
      const int c = cnt + ntiles - 1;
      const int pst = c % kS;
      const int c0 = c + 1, st0 = c0 % kS;  // the next tile's first key tile
      wg_wait<0>();
      reg_fence(o);
      reg_fence(pa);
      if (ntiles >= 2) release(sm.bar_vempty + 8 * ((c - 1) % kS));
      rescale(a0, a1);
      convert_p();
      mbar_wait(sm.bar_vfull + 8 * pst, (c / kS) & 1);
      fence_gathered(ntiles - 1);
      if (has_next) {
        mbar_wait(sm.bar_q + 8 * ((local + 1) % kQB), ((local + 1) / kQB) & 1);
        mbar_wait(sm.bar_kfull + 8 * st0, (c0 / kS) & 1);
        if (GATHER) {
          int mn, bhn;
          work_coords(p, w_next, mn, bhn);
          nsel_next = nsel_of(mn, bhn);
          if (nsel_next > 0) fence_proxy_async();
        }
      }
      named_sync(bar_mine, 256);
      reg_fence(o);
      reg_fence(pa);
      wg_fence();
      issue_pv(pst);
      wg_commit();
      // after the last work tile: a product whose scores nobody reads (slot st0 and this Q hold stale tiles)
      issue_qk_first(st0, q_rows(has_next ? local + 1 : local));
      wg_commit();
      named_arrive(bar_other, 256);
      wg_wait<1>();
      reg_fence(o);
      reg_fence(pa);
      release(sm.bar_vempty + 8 * pst);
      epilogue();
      wg_wait<0>();  // in the block that issued it: a wait past the loop edge serializes every wgmma
      fence_first_scores();
    }
    cnt += ntiles;
  }
  if (cw == 0) named_sync(bar_mine, 256);  // consumer 1's last arrive
}

// ------------------------------------------------------------------ host side
// The fields of FwdParams, the q/k/v tensor maps and the persistent grid (one CTA per multiprocessor,
// at most one per work tile). vs: the element strides (b, h, s) of q, k, v and out, 12 values; D the head dim
// (64 or 128). The caller has checked the arguments. Returns false after writing a message to err.
inline bool prepare_fwd(FwdParams& p, CUtensorMap& tq, CUtensorMap& tk, CUtensorMap& tv, int& grid, const void* q,
                        const void* k, const void* v, void* out, float* lse, const long long* vs, int B, int Hq,
                        int Hkv, int S, bool bf16, int pattern, int window, int sinks, float scale, char* err,
                        int errlen, int D = kHeadDim) {
  using namespace sk90h;
  EncodeTiledFn enc = get_encode_fn(err, errlen);
  if (!enc) return false;
  const ViewStrides st_q{vs[0], vs[1], vs[2]}, st_k{vs[3], vs[4], vs[5]}, st_v{vs[6], vs[7], vs[8]};
  if (!make_map_view(&tq, enc, q, bf16, D, S, Hq, B, st_q, kBlockM, "q", err, errlen) ||
      !make_map_view(&tk, enc, k, bf16, D, S, Hkv, B, st_k, kBlockN, "k", err, errlen) ||
      !make_map_view(&tv, enc, v, bf16, D, S, Hkv, B, st_v, kBlockN, "v", err, errlen))
    return false;
  p.out = out;
  p.osb = vs[9];
  p.osh = vs[10];
  p.oss = vs[11];
  p.lse = lse;
  p.S = S;
  p.Hq = Hq;
  p.Hkv = Hkv;
  p.num_q_tiles = (S + kBlockM - 1) / kBlockM;
  p.div_hq = FastDiv(Hq);
  p.div_group = FastDiv(Hq / Hkv);
  p.div_q_tiles = FastDiv(p.num_q_tiles);
  p.div_window = FastDiv(window > 1 ? window : 1);
  p.pattern = pattern;
  p.window = window;
  p.sinks = sinks;
  p.fnum = p.fidx = p.pnum = p.pidx = nullptr;
  p.fw = p.pw = 0;
  p.scale_log2 = scale * 1.4426950408889634f;
  const long long total = static_cast<long long>(p.num_q_tiles) * B * Hq;
  if (total > 0x7fffffffLL) {
    snprintf(err, errlen, "too many work tiles: %lld", total);
    return false;
  }
  p.total_work = static_cast<int>(total);
  int dev = 0, sms = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess || sms < 1) {
    snprintf(err, errlen, "multiprocessor count: %s", cudaGetErrorString(e));
    return false;
  }
  grid = p.total_work < sms ? p.total_work : sms;
  p.div_grid = FastDiv(grid);
  set_work_order(p, sk90w::kOrderStatic);
  return true;
}

}  // namespace sk90f
