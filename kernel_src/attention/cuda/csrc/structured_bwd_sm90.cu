// Hopper (sm_90a) backward for the structured causal patterns: dense, sliding_window, streaming.
//
// Contract (that of ``triton.structured_bwd.structured_backward`` for a plain self-attention
// geometry): q, dO (B, Hq, S, D), k, v (B, Hkv, S, D), D 64 or 128, bf16/fp16, views with unit last stride and
// strides of 16-byte multiples (4-D TMA maps); query head h reads KV head h / (Hq / Hkv). Query i sees
// key j when j <= i and
//   dense           always
//   sliding_window  i - j < W
//   streaming       i - j < W  or  j < sinks
// Inputs from the preparation pass, padded to S_pad (a multiple of 64) rows per (batch, head):
// lse2 = lse * log2(e) (+inf on rows that see no key and on the padding) and delta = rowsum(dO * O)
// (0 on the padding), float32 (B, Hq, S_pad). Outputs: dk, dv (B, Hkv, S, D) in the input dtype, views
// with their own strides (16-byte multiples, unit last; scale applied to dk); dq_acc (B, Hq, S_pad, D)
// float32 contiguous, zeroed by the caller, receives scale * dS K by reduce-adds.
//
// One CTA = one 128-key tile of one (batch, KV head), 3 warpgroups (384 threads):
//   warpgroup 0  producer. Warp 0 (one thread) loads the K and V tiles once (TMA, 128-byte swizzle),
//                then for every (query head of the group, 64-row query tile that sees the keys) the Q
//                and dO tiles (TMA) and the 64 lse2 / delta values (1-D bulk copies) into a
//                kStages-deep ring ("full" mbarrier with transaction bytes, "empty" mbarrier released by
//                the consumers). Warp 1 (one thread) reduce-adds each consumer's dQ block from
//                shared memory into dq_acc (TMA cp.reduce.async.bulk.tensor, float32 add).
//   warpgroups 1, 2  consumers, 64 keys each, dK and dV (64 x D each) accumulated in registers:
//                S^T = K Q^T and dP^T = V dO^T (wgmma m64n64k16, both operands in shared memory),
//                P^T = exp2(S^T * scale * log2 e - lse2) (element rule on masked tiles only),
//                dV += P^T dO (register-A wgmma), dS^T = P^T (dP^T - delta), dK += dS^T Q (register
//                A); dS^T is also stored to shared memory (rows = keys, 64 queries per 128-byte
//                swizzled row, double-buffered). D = 128: after a named barrier over both consumers each
//                computes dQ[:, 64 c .. 64 c + 63] = dS K[:, 64 c ..] for the whole 128-key tile; D = 64:
//                after a barrier over its own 128 threads each computes all of dQ over its own 64 keys
//                (dS[:, keys of c] K[keys of c, :]) and the two partial sums are both reduce-added (wgmma,
//                A and B both MN-major from shared memory). scale * dQ goes to shared memory for the TMA
//                reduce-add.
//   Pipelining: the next tile's S^T is issued right after this tile's dQ product, so the tensor cores run
//                it while the consumer hands dQ over; dP^T is issued at the top of the iteration and
//                runs during the exponentials. Nothing is in flight across the loop's back edge (ptxas
//                serialises the wgmma pipeline otherwise).

// Query tiles per key tile, by arithmetic (the table of triton.structured_bwd's docstring): the
// queries that see some key of [kl, kh] are [kl, kh + W) (dense and sink tiles: [kl, S)); those that
// see every key are [kh, kl + W) (none for a tile holding sink keys or past S), and only query tiles
// outside that full run evaluate the element rule.
//
// The grid is (B * Hkv, key tiles): the longest CTAs (dense: early key tiles; streaming: the sink
// tiles, which every later query sees) start first.
//
// This file needs no torch headers: sk90_structured_bwd takes raw pointers and a stream; torch's
// binding lives in structured_bwd_sm90.cpp.

#include <stdio.h>

#include "sm90_common.cuh"
#include "sm90_tma_host.h"

namespace sk90b {
using namespace sk90c;
using namespace sk90h;

constexpr int kBlockN = 128;  // keys per CTA
constexpr int kBlockM = 64;   // query rows per step
constexpr int kThreads = 384;
constexpr int kStages = 3;  // Q/dO ring depth (two stages measured slower on the H100: docs/history.md)
constexpr int kKVHalf = 128 * 64 * 2;   // one K/V TMA box: 128 rows x 64 columns
constexpr int kQHalf = 64 * 64 * 2;     // one Q/dO TMA box: 64 rows x 64 columns
constexpr int kDSTile = 128 * 64 * 2;   // dS^T: 128 keys x 64 queries
constexpr int kStatBytes = 2 * kBlockM * 4;  // lse2 + delta of one stage
constexpr int kHeadBytes = 2048;             // mbarriers (first 256 bytes), then the lse2/delta ring
constexpr int kDQBox = 64 * 32 * 4;          // one dQ reduce box: 64 rows x 32 float32 columns
constexpr int kDQTile = 4 * kDQBox;          // warpgroup c's 64 x 64 block of dQ in boxes 2c, 2c + 1

// Tile bytes and shared memory of head dim D (64 or 128): a K/V or Q/dO tile is D / 64 TMA boxes.
template <int D>
struct BwdTiles {
  static_assert(D == 64 || D == 128, "head dim 64 or 128");
  static constexpr int kKVTile = D / 64 * kKVHalf;  // 16 or 32 KB
  static constexpr int kQTile = D / 64 * kQHalf;    // 8 or 16 KB
  // 1024 bytes of alignment slack; at D = 128 exactly the 227 KB a block may have
  static constexpr int kSmemBytes = 1024 + kHeadBytes + 2 * kKVTile + 2 * kStages * kQTile + 2 * kDSTile + kDQTile;
};

struct Params {
  void* dk;
  void* dv;
  long long dkb, dkh, dks;  // dk's element strides (b, h, s)
  long long dvb, dvh, dvs;  // dv's
  float* dq_acc;
  const float* lse2;
  const float* delta;
  int S;
  int S_pad;
  int Hq;
  int Hkv;
  int pattern;  // 0 dense, 1 sliding_window, 2 streaming (all causal)
  int window;
  int sinks;
  float scale;
  float scale_log2;
};

// Query tiles [m_lo, m_hi) see some key of key tile n; [fm_lo, fm_hi) see all of them.
struct QRange {
  int m_lo, m_hi, fm_lo, fm_hi;
};

__device__ __forceinline__ QRange q_range(const Params& p, int n) {
  const int kl = n * kBlockN;
  const int kh = min(kl + kBlockN - 1, p.S - 1);
  const bool whole = kl + kBlockN <= p.S;
  const int a_lo = kl;
  int a_hi = p.S, f_lo = kh, f_hi = p.S;
  if (p.pattern != 0) {
    a_hi = static_cast<int>(min(static_cast<long long>(kh) + p.window, static_cast<long long>(p.S)));
    f_hi = static_cast<int>(min(static_cast<long long>(kl) + p.window, static_cast<long long>(p.S)));
    if (p.pattern == 2 && kl < p.sinks) {
      a_hi = p.S;
      f_hi = f_lo;
    }
  }
  if (!whole) f_hi = f_lo;
  QRange r;
  r.m_lo = a_lo / kBlockM;
  r.m_hi = max(cdiv(max(a_hi, 0), kBlockM), r.m_lo);
  r.fm_lo = min(max(cdiv(f_lo, kBlockM), r.m_lo), r.m_hi);
  r.fm_hi = min(max(max(f_hi, 0) / kBlockM, r.fm_lo), r.m_hi);
  return r;
}

template <bool BF16, int D>
__global__ void __launch_bounds__(kThreads, 1)
    structured_bwd_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_do,
                          const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                          const __grid_constant__ CUtensorMap tm_dq, const Params p) {
  constexpr int kKVTile = BwdTiles<D>::kKVTile, kQTile = BwdTiles<D>::kQTile;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  const uint32_t bar_kv = base;
  const uint32_t bar_full = base + 8;                   // [kStages]
  const uint32_t bar_empty = bar_full + 8 * kStages;     // [kStages]
  const uint32_t bar_dqfull = bar_empty + 8 * kStages;   // [2] dQ block of warpgroup c written
  const uint32_t bar_dqempty = bar_dqfull + 16;         // [2] dQ block of warpgroup c read by TMA
  const uint32_t sstat = base + 256;                    // [kStages] x (lse2[64], delta[64])
  const uint32_t sk = base + kHeadBytes;
  const uint32_t sv = sk + kKVTile;
  const uint32_t sq = sv + kKVTile;                     // [kStages]
  const uint32_t sdo = sq + kStages * kQTile;            // [kStages]
  const uint32_t sds = sdo + kStages * kQTile;           // [2]
  const uint32_t sdq = sds + 2 * kDSTile;              // 4 boxes of float32 dQ
  const float* stat_ptr = reinterpret_cast<const float*>(smem_raw + (sstat - raw));

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  // warp-uniform through a shuffle from lane 0: the wgmma descriptors built from it stay in uniform registers
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  const int bkv = blockIdx.x;  // b * Hkv + kv head
  const int n = blockIdx.y;
  const int G = p.Hq / p.Hkv;
  const int b = bkv / p.Hkv, kvh = bkv % p.Hkv;
  const QRange r = q_range(p, n);
  const int nm = r.m_hi - r.m_lo;
  const int count = G * nm;

  if (threadIdx.x == 0) {
    mbar_init(bar_kv, 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bar_full + 8 * s, 1);
      mbar_init(bar_empty + 8 * s, 8);  // lane 0 of each of the 8 consumer warps
    }
    for (int c = 0; c < 2; ++c) {
      mbar_init(bar_dqfull + 8 * c, 128);  // every thread of consumer warpgroup c
      mbar_init(bar_dqempty + 8 * c, 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {
    // ---------------- producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    if (warp == 0 && lane == 0) {
      const int krow = n * kBlockN;
      mbar_expect_tx(bar_kv, 2 * kKVTile);
      for (int half = 0; half < D / 64; ++half)
        tma_load_4d(sk + half * kKVHalf, &tm_k, bar_kv, 64 * half, krow, kvh, b);
      for (int half = 0; half < D / 64; ++half)
        tma_load_4d(sv + half * kKVHalf, &tm_v, bar_kv, 64 * half, krow, kvh, b);
      for (int it = 0; it < count; ++it) {
        const int s = it % kStages;
        if (it >= kStages) mbar_wait(bar_empty + 8 * s, ((it / kStages) & 1) ^ 1);
        const int gi = it / nm;
        const int m = r.m_lo + (it - gi * nm);
        const int h = kvh * G + gi;
        const int bh = b * p.Hq + h;
        const uint32_t fb = bar_full + 8 * s;
        mbar_expect_tx(fb, 2 * kQTile + kStatBytes);
        for (int half = 0; half < D / 64; ++half)
          tma_load_4d(sq + s * kQTile + half * kQHalf, &tm_q, fb, 64 * half, m * kBlockM, h, b);
        for (int half = 0; half < D / 64; ++half)
          tma_load_4d(sdo + s * kQTile + half * kQHalf, &tm_do, fb, 64 * half, m * kBlockM, h, b);
        const size_t srow = static_cast<size_t>(bh) * p.S_pad + static_cast<size_t>(m) * kBlockM;
        bulk_load(sstat + s * kStatBytes, p.lse2 + srow, kBlockM * 4, fb);
        bulk_load(sstat + s * kStatBytes + kBlockM * 4, p.delta + srow, kBlockM * 4, fb);
      }
    } else if (warp == 1 && lane == 0) {
      // dQ writer: each consumer warpgroup's 64 x 64 float32 block -> dq_acc by TMA reduce-adds (D = 128: its own
      // columns 64 c .. 64 c + 63; D = 64: a partial sum over its keys of all 64 columns)
      for (int it = 0; it < count; ++it) {
        const int gi = it / nm;
        const int m = r.m_lo + (it - gi * nm);
        const int bh = b * p.Hq + kvh * G + gi;
        for (int c = 0; c < 2; ++c) {
          const int col = D == 128 ? 64 * c : 0;
          mbar_wait(bar_dqfull + 8 * c, it & 1);
          tma_reduce_add_3d(&tm_dq, sdq + (2 * c) * kDQBox, col, m * kBlockM, bh);
          tma_reduce_add_3d(&tm_dq, sdq + (2 * c + 1) * kDQBox, col + 32, m * kBlockM, bh);
          bulk_commit();
          bulk_wait_read0();
          mbar_arrive(bar_dqempty + 8 * c);
        }
      }
      bulk_wait0();
    }
    return;
  }

  // ---------------- consumers
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
  const int cw = wg - 1;  // keys cw*64 .. cw*64+63 of the tile
  const int wq = (threadIdx.x % 128) / 32;
  const int g = lane / 4;
  const int qd = lane % 4;
  const float sl2 = p.scale_log2;
  const int W = p.pattern == 0 ? 0x7fffffff : p.window;
  const int sinks = p.pattern == 2 ? p.sinks : 0;
  const int klocal = cw * 64 + wq * 16 + g;  // this thread's keys: klocal and klocal + 8 of the tile
  const int key0 = n * kBlockN + klocal;
  // the loop's it / nm by multiply-high (the backward 2-3% faster); the producer and the dQ writer keep the division:
  // with it there too the backward ran 1-7% slower, most at dense 64K (docs/history.md)
  const FastDiv div_nm(max(nm, 1));

  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) {
    dk[i] = 0.f;
    dv[i] = 0.f;
  }
  mbar_wait(bar_kv, 0);

  float sacc[32], dpacc[32], dq[32];
  uint32_t pa[16], da[16];
  // acc = X_c Y^T for this warpgroup's 64 rows c of a K or V tile (x_tile) and a Q or dO tile (y_tile)
  auto issue_rows_t = [&](float(&acc)[32], uint32_t x_tile, uint32_t y_tile) {
    const uint64_t xd = make_desc(x_tile + cw * 64 * 128, 16, 1024), yd = make_desc(y_tile, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint64_t a = desc_advance(xd, (kk >> 2) * kKVHalf + (kk & 3) * 32);
      const uint64_t b = desc_advance(yd, (kk >> 2) * kQHalf + (kk & 3) * 32);
      if (kk == 0)
        wgmma_ss64_first<BF16, 0, 0>(acc, a, b);
      else
        wgmma_ss64<BF16, 0, 0>(acc, a, b, 1);
    }
  };
  auto issue_s = [&](int st) { issue_rows_t(sacc, sk, sq + st * kQTile); };     // S^T = K_c Q^T
  auto issue_dp = [&](int st) { issue_rows_t(dpacc, sv, sdo + st * kQTile); };  // dP^T = V_c dO^T
  if (count > 0) {
    mbar_wait(bar_full, 0);
    wg_fence();
    issue_s(0);
    wg_commit();
    wg_wait<0>();
    reg_fence(sacc);
  }

  for (int it = 0; it < count; ++it) {
    const int s = it % kStages;
    const int gi = div_nm.div(it);
    const int m = r.m_lo + (it - gi * nm);
    const bool masked = m < r.fm_lo || m >= r.fm_hi;
    const uint32_t qs = sq + s * kQTile, dos = sdo + s * kQTile;
    const uint32_t dsb = sds + (it & 1) * kDSTile;

    // S^T of this tile done (previous iteration); dP^T runs during the exponentials
    wg_fence();
    issue_dp(s);
    wg_commit();

    const float* lse_s = stat_ptr + s * (kStatBytes / 4);
    const float* del_s = lse_s + kBlockM;
    // P^T: rows = keys key0 (+8), columns = queries m*64 + 8j + 2qd (+1)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float2 l = *reinterpret_cast<const float2*>(lse_s + 8 * j + 2 * qd);
#pragma unroll
      for (int e = 0; e < 4; ++e) sacc[4 * j + e] = ex2(fmaf(sacc[4 * j + e], sl2, -((e & 1) ? l.y : l.x)));
    }
    if (masked) {
      // query q0 + d (d = 8 j + (e & 1): a constant of the unrolled loop) sees key k when k - q0 <= d < k - q0 + W, or
      // k - q0 <= d for a sink key: per key a range [lo, hi) of offsets, tested with two compares and no arithmetic
      const int q0 = m * kBlockM + 2 * qd;
      const int span = min(W, p.S_pad);  // no query row lies S_pad or more past a key; no overflow at W = 2^31 - 1
      const int lo0 = key0 - q0, lo1 = lo0 + 8;
      const int hi0 = key0 < sinks ? 0x7fffffff : lo0 + span, hi1 = key0 + 8 < sinks ? 0x7fffffff : lo1 + span;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int d = 8 * j + (e & 1);
          const bool ok = d >= ((e >> 1) ? lo1 : lo0) && d < ((e >> 1) ? hi1 : hi0);
          if (!ok) sacc[4 * j + e] = 0.f;
        }
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      pa[2 * j] = pack2<BF16>(sacc[4 * j], sacc[4 * j + 1]);
      pa[2 * j + 1] = pack2<BF16>(sacc[4 * j + 2], sacc[4 * j + 3]);
    }
    reg_fence(pa);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)  // dV += P^T dO (dO MN-major: 16 query rows per k-step; N = D, dv's size)
      wgmma_rs<BF16>(dv, pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3],
                     desc_advance(make_desc(dos, kQHalf, 1024), kk * 2048));
    wg_commit();

    wg_wait<1>();
    reg_fence(dpacc);
    // dS^T = P^T (dP^T - delta), packed to 16 bits and stored to shared memory (rows = keys)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float2 dl = *reinterpret_cast<const float2*>(del_s + 8 * j + 2 * qd);
      da[2 * j] = pack2<BF16>(sacc[4 * j] * (dpacc[4 * j] - dl.x), sacc[4 * j + 1] * (dpacc[4 * j + 1] - dl.y));
      da[2 * j + 1] =
          pack2<BF16>(sacc[4 * j + 2] * (dpacc[4 * j + 2] - dl.x), sacc[4 * j + 3] * (dpacc[4 * j + 3] - dl.y));
    }
    {
      uint32_t* ds32 = reinterpret_cast<uint32_t*>(smem_raw + (dsb - raw));
      const int sw = klocal & 7;  // (klocal + 8) & 7 is the same
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int off = (((j ^ sw) << 4) + 4 * qd) / 4;
        ds32[klocal * 32 + off] = da[2 * j];
        ds32[(klocal + 8) * 32 + off] = da[2 * j + 1];
      }
    }
    fence_proxy_async();
    reg_fence(da);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)  // dK += dS^T Q
      wgmma_rs<BF16>(dk, da[4 * kk], da[4 * kk + 1], da[4 * kk + 2], da[4 * kk + 3],
                     desc_advance(make_desc(qs, kQHalf, 1024), kk * 2048));
    wg_commit();

    // D = 128: dQ[:, 64 cw ..] = dS K[:, 64 cw ..] over the 128 keys, once both halves of dS^T are stored;
    // D = 64: dQ's partial sum dS[:, keys of cw] K[keys of cw, :] over this warpgroup's 64 keys (16 keys a k-step,
    // 2048 bytes of dS^T and of K)
    if constexpr (D == 128)
      named_sync(1, 256);
    else
      named_sync(2 + cw, 128);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < (D == 128 ? 8 : 4); ++kk) {
      const uint64_t a = desc_advance(make_desc(D == 128 ? dsb : dsb + cw * 64 * 128, kQHalf, 1024), kk * 2048);
      const uint64_t bd =
          desc_advance(make_desc(sk + cw * (D == 128 ? kKVHalf : 64 * 128), kKVHalf, 1024), kk * 2048);
      if (kk == 0)
        wgmma_ss64_first<BF16, 1, 1>(dq, a, bd);
      else
        wgmma_ss64<BF16, 1, 1>(dq, a, bd, 1);
    }
    wg_commit();
    const bool next = it + 1 < count;
    const int s2 = (it + 1) % kStages;
    wg_wait<1>();  // dV and dK done: P^T and dS^T registers free
    reg_fence(dk);
    reg_fence(dv);
    reg_fence(pa);
    reg_fence(da);
    // The next tile's S^T runs on the tensor cores during this tile's dQ reduce-adds. After the last
    // tile it reads the slot's stale contents (no load is pending there) and its result is never
    // used: the same wgmma sequence on every path keeps ptxas from serialising the pipeline.
    if (next) mbar_wait(bar_full + 8 * s2, ((it + 1) / kStages) & 1);
    wg_fence();
    issue_s(s2);
    wg_commit();
    wg_wait<1>();
    reg_fence(dq);
    if (lane == 0) mbar_arrive(bar_empty + 8 * s);

    const float sc = p.scale;
    // scale * dQ to the warpgroup's two 64 x 32 boxes (128-byte swizzle: 16-byte chunk c of row r at
    // (c ^ (r & 7))), then the writer thread reduce-adds them into dq_acc
    if (it > 0) mbar_wait(bar_dqempty + 8 * cw, (it - 1) & 1);
    float* dqs = reinterpret_cast<float*>(smem_raw + (sdq - raw));
    const int r0 = wq * 16 + g;  // rows r0 and r0 + 8: the same swizzle phase
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int box = 2 * cw + (j >> 2);
      const int chunk = 2 * (j & 3) + (qd >> 1);
      const int off = box * (kDQBox / 4) + (((chunk ^ (r0 & 7)) << 4) + (qd & 1) * 8) / 4;
      *reinterpret_cast<float2*>(dqs + off + r0 * 32) = make_float2(dq[4 * j] * sc, dq[4 * j + 1] * sc);
      *reinterpret_cast<float2*>(dqs + off + (r0 + 8) * 32) = make_float2(dq[4 * j + 2] * sc, dq[4 * j + 3] * sc);
    }
    fence_proxy_async();
    mbar_arrive(bar_dqfull + 8 * cw);
    wg_wait<0>();  // nothing in flight across the loop's back edge
    reg_fence(sacc);
  }

  // ---------------- epilogue: dK * scale, dV
  // key row r of (b, kvh) starts at element b * dkb + kvh * dkh + r * dks (dv alike); thread columns
  // 8 j + 2 qd, +1
  uint16_t* const dk_row = static_cast<uint16_t*>(p.dk) + b * p.dkb + kvh * p.dkh + key0 * p.dks + 2 * qd;
  uint16_t* const dv_row = static_cast<uint16_t*>(p.dv) + b * p.dvb + kvh * p.dvh + key0 * p.dvs + 2 * qd;
  const float sc = p.scale;
  if (key0 < p.S) {
    uint32_t* const dk32 = reinterpret_cast<uint32_t*>(dk_row);
    uint32_t* const dv32 = reinterpret_cast<uint32_t*>(dv_row);
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      dk32[4 * j] = pack2<BF16>(dk[4 * j] * sc, dk[4 * j + 1] * sc);
      dv32[4 * j] = pack2<BF16>(dv[4 * j], dv[4 * j + 1]);
    }
  }
  if (key0 + 8 < p.S) {
    uint32_t* const dk32 = reinterpret_cast<uint32_t*>(dk_row + 8 * p.dks);
    uint32_t* const dv32 = reinterpret_cast<uint32_t*>(dv_row + 8 * p.dvs);
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      dk32[4 * j] = pack2<BF16>(dk[4 * j + 2] * sc, dk[4 * j + 3] * sc);
      dv32[4 * j] = pack2<BF16>(dv[4 * j + 2], dv[4 * j + 3]);
    }
  }
}

template <int D>
int launch_bwd(bool bf16, const dim3& grid, void* stream, char* err, int errlen, const CUtensorMap& tq,
               const CUtensorMap& tdo, const CUtensorMap& tk, const CUtensorMap& tv, const CUtensorMap& tdq,
               const Params& p) {
  return launch_kernel(bf16 ? structured_bwd_kernel<true, D> : structured_bwd_kernel<false, D>, grid, kThreads,
                       BwdTiles<D>::kSmemBytes, stream, err, errlen, tq, tdo, tk, tv, tdq, p);
}

}  // namespace sk90b

// Host entry point. Returns 0 on success, else writes a message to err.
// strides: the element strides (b, h, s) of q, k, v, dout, dk and dv, 18 values; D: the head dim, 64 or 128.
extern "C" int sk90_structured_bwd(const void* q, const void* k, const void* v, const void* dout,
                                   const float* lse2, const float* delta, float* dq_acc, void* dk, void* dv,
                                   const long long* strides, int B, int Hq, int Hkv, int S, int S_pad, int D,
                                   int is_bf16, int pattern, int window, int sinks, float scale, void* stream,
                                   char* err, int errlen) {
  using namespace sk90b;
  if (B < 1 || Hq < 1 || Hkv < 1 || Hq % Hkv != 0 || S < 1 || S_pad < S || S_pad % kBlockM != 0 ||
      (D != 64 && D != 128) || pattern < 0 || pattern > 2 || (pattern != 0 && window < 1) ||
      (pattern == 2 && sinks < 0) || !(scale > 0.f)) {
    snprintf(err, errlen,
             "bad arguments: B=%d Hq=%d Hkv=%d S=%d S_pad=%d D=%d pattern=%d window=%d sinks=%d scale=%g", B, Hq, Hkv,
             S, S_pad, D, pattern, window, sinks, static_cast<double>(scale));
    return 1;
  }
  const long long nk = (S + kBlockN - 1) / kBlockN;
  if (static_cast<long long>(B) * Hkv > 0x7fffffffLL || nk > 65535) {
    snprintf(err, errlen, "grid too large: B*Hkv=%lld key tiles=%lld", static_cast<long long>(B) * Hkv, nk);
    return 1;
  }
  EncodeTiledFn enc = get_encode_fn(err, errlen);
  if (!enc) return 1;
  CUtensorMap tq, tdo, tk, tv, tdq;
  const bool bf16 = is_bf16 != 0;
  // dq_acc: float32 (D, S_pad, heads) with (32, 64, 1) boxes (128 bytes wide) for the reduce-adds
  if (!make_map_3d(&tdq, enc, dq_acc, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, D, S_pad, B * Hq, 32, kBlockM, "dq", err,
                   errlen))
    return 1;
  const ViewStrides st_q{strides[0], strides[1], strides[2]}, st_k{strides[3], strides[4], strides[5]},
      st_v{strides[6], strides[7], strides[8]}, st_do{strides[9], strides[10], strides[11]};
  if (!make_map_view(&tq, enc, q, bf16, D, S, Hq, B, st_q, kBlockM, "q", err, errlen) ||
      !make_map_view(&tdo, enc, dout, bf16, D, S, Hq, B, st_do, kBlockM, "do", err, errlen) ||
      !make_map_view(&tk, enc, k, bf16, D, S, Hkv, B, st_k, kBlockN, "k", err, errlen) ||
      !make_map_view(&tv, enc, v, bf16, D, S, Hkv, B, st_v, kBlockN, "v", err, errlen))
    return 1;
  Params p;
  p.dk = dk;
  p.dv = dv;
  p.dkb = strides[12];
  p.dkh = strides[13];
  p.dks = strides[14];
  p.dvb = strides[15];
  p.dvh = strides[16];
  p.dvs = strides[17];
  p.dq_acc = dq_acc;
  p.lse2 = lse2;
  p.delta = delta;
  p.S = S;
  p.S_pad = S_pad;
  p.Hq = Hq;
  p.Hkv = Hkv;
  p.pattern = pattern;
  p.window = window;
  p.sinks = sinks;
  p.scale = scale;
  p.scale_log2 = scale * 1.4426950408889634f;
  const dim3 grid(B * Hkv, static_cast<unsigned>(nk));
  return D == 128 ? launch_bwd<128>(bf16, grid, stream, err, errlen, tq, tdo, tk, tv, tdq, p)
                  : launch_bwd<64>(bf16, grid, stream, err, errlen, tq, tdo, tk, tv, tdq, p);
}
