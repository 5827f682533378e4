// Hopper (sm_90a) forward for the structured causal patterns: dense, sliding_window, streaming, block_diagonal,
// and the listed one, bigbird (key tiles from a block layout of 128 x 128 tiles).
//
// Contract (the same as ``triton.structured.structured_forward`` with a plain self-attention
// geometry, q_start = k_start = 0, k_end = S): q (B, Hq, S, D), k/v (B, Hkv, S, D), D 64 or 128, bf16 or fp16,
// views with unit last stride and strides of 16-byte multiples (read through 4-D TMA maps, e.g. the
// transposed (B, S, H, D) projections of a Transformers layer); query head h reads KV head
// h / (Hq / Hkv). Query i sees key j when j <= i and
//   dense           always
//   sliding_window  i - j < W
//   streaming       i - j < W  or  j < sinks
//   block_diagonal  i / W == j / W  (W: the block)
//   listed          key tile j / 128 is one of query tile i / 128's full tiles, or one of its partial tiles
//                   (then j <= i): bigbird with blocks of a multiple of 128 (sk90_listed_fwd)
// Outputs: out (B, Hq, S, D) in q's dtype, a view with its own strides (16-byte multiples, unit last),
// lse (B, Hq, S) float32 contiguous, natural log.
//
// The consumers and the tile arithmetic are sm90_fwd_mainloop.cuh's (every key tile static). The
// producer warpgroup: one thread issues TMA bulk tensor copies (128-byte swizzle) of the Q tile once
// per work tile and of the K and V tiles into the ring.
//
// This file needs no torch headers: the host entry point sk90_structured_fwd takes raw pointers and a
// stream; torch's binding lives in structured_fwd_sm90.cpp.

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include "sm90_fwd_mainloop.cuh"

namespace sk90 {

using namespace sk90f;

constexpr int kBarBytes = 1024;  // mbarriers at the start of dynamic shared memory
// Two Q buffers and a K/V ring of two stages: at head dim 128 the shared memory's other fit, one Q buffer and three
// stages, ran 1-3% slower for every pattern and length measured; at head dim 64 (tiles of half the bytes) three or
// four stages ran 3-4.5% slower on windows (docs/history.md).
template <int D>
using Smem = FwdSmem<kBarBytes, 2, 2, D>;
// The mean keys per query row from which the kernel takes fwd_consumer's WG_UNIFORM variant: measured faster at
// 4,096-key windows (33 key tiles a row), dense 16K and block_diagonal 4096 (2,048 keys a row on average), slower at
// block_diagonal 512-1024 (256-512 keys).
constexpr long long kLongRowKeys = 2048;

// Persistent: CTA c computes work tiles c, c + gridDim.x, ... in the order the host chose (sm90_work_order.h:
// static, or blocks of gridDim.x tiles in alternating directions where that balances the CTAs' loads). The K/V
// ring and its barrier phases run on across work tiles (counter `cnt`), and the producer loads the next tile's Q
// (into the other Q buffer, once both consumers have finished the last Q K^T of the tile before) and first K/V
// tiles while the consumers work on the current one.
template <bool BF16, bool LISTED, bool WG_UNIFORM, int D, bool SINK_STEP = false>
__global__ void __launch_bounds__(kThreads, 1)
    structured_fwd_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                          const __grid_constant__ CUtensorMap tm_v, const FwdParams p) {
  using Sm = Smem<D>;
  extern __shared__ uint8_t smem_raw[];
  // 1024-byte alignment for the 128-byte swizzle atoms (TMA and wgmma agree on the pattern there)
  const Sm sm((smem_u32(smem_raw) + 1023u) & ~1023u);
  if (threadIdx.x == 0) sm.init(1);
  __syncthreads();

  if (threadIdx.x / 128 == 0) {
    // ---------------- producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    if (threadIdx.x == 0) {
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tm_k)) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tm_v)) : "memory");
      int cnt = 0, local = 0;
      for (int w = blockIdx.x; w < p.total_work; w += gridDim.x, ++local) {
        int m, bh;
        work_coords(p, w, m, bh);
        const int b = p.div_hq.div(bh), h = bh - b * p.Hq;
        const int kvh = p.div_group.div(h);
        const TileRange tr = tile_range<LISTED, SINK_STEP>(p, m, bh);
        sm.load_q(&tm_q, local, m, h, b);
        for (int it = 0; it < tr.count; ++it, ++cnt) {
          const int s = cnt % Sm::kRing;
          const uint32_t ph = ((cnt / Sm::kRing) & 1) ^ 1;  // the release of the slot's previous tile
          const int row = tr.tile(it) * kBlockN;
          if (cnt >= Sm::kRing) mbar_wait(sm.bar_kempty + 8 * s, ph);
          Sm::load_tile(sm.sk + s * Sm::kTile, &tm_k, sm.bar_kfull + 8 * s, row, kvh, b);
          if (cnt >= Sm::kRing) mbar_wait(sm.bar_vempty + 8 * s, ph);
          Sm::load_tile(sm.sv + s * Sm::kTile, &tm_v, sm.bar_vfull + 8 * s, row, kvh, b);
        }
      }
    }
    return;
  }

  // ---------------- consumers
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
  fwd_consumer<BF16, false, LISTED, WG_UNIFORM, SINK_STEP>(p, sm, nullptr, nullptr, [](int, int) { return 0; });
}

// The structured (not listed) kernel of head dim D and sink step SINK_STEP for a launch: WG_UNIFORM for rows of
// kLongRowKeys keys or more on average.
template <int D, bool SINK_STEP>
int launch_structured(bool bf16, bool uniform, int grid, void* stream, char* err, int errlen, const CUtensorMap& tq,
                      const CUtensorMap& tk, const CUtensorMap& tv, const FwdParams& p) {
  const auto kernel = uniform ? (bf16 ? structured_fwd_kernel<true, false, true, D, SINK_STEP>
                                      : structured_fwd_kernel<false, false, true, D, SINK_STEP>)
                              : (bf16 ? structured_fwd_kernel<true, false, false, D, SINK_STEP>
                                      : structured_fwd_kernel<false, false, false, D, SINK_STEP>);
  return launch_kernel(kernel, grid, kThreads, Smem<D>::kBytes, stream, err, errlen, tq, tk, tv, p);
}

// Streaming with up to this many sinks takes fwd_consumer's SINK_STEP kernels (one step of 16 keys for the sinks
// instead of a key tile of 128).
constexpr int kSinkStepMax = 16;

}  // namespace sk90

// Host entry point. Returns 0 on success, else writes a message to err.
// strides: the element strides (b, h, s) of q, k, v and out, 12 values; D: the head dim, 64 or 128.
extern "C" int sk90_structured_fwd(const void* q, const void* k, const void* v, void* out, float* lse,
                                   const long long* strides, int B, int Hq, int Hkv, int S, int D, int is_bf16,
                                   int pattern, int window, int sinks, float scale, void* stream, char* err,
                                   int errlen) {
  using namespace sk90;
  if (B < 1 || Hq < 1 || Hkv < 1 || Hq % Hkv != 0 || S < 1 || (D != 64 && D != 128) || pattern < 0 || pattern > 3 ||
      (pattern != 0 && window < 1) || (pattern == 2 && sinks < 0) || !(scale > 0.f)) {
    snprintf(err, errlen, "bad arguments: B=%d Hq=%d Hkv=%d S=%d D=%d pattern=%d window=%d sinks=%d scale=%g", B, Hq,
             Hkv, S, D, pattern, window, sinks, static_cast<double>(scale));
    return 1;
  }
  FwdParams p;
  CUtensorMap tq, tk, tv;
  int grid = 0;
  const bool bf16 = is_bf16 != 0;
  if (!prepare_fwd(p, tq, tk, tv, grid, q, k, v, out, lse, strides, B, Hq, Hkv, S, bf16, pattern, window, sinks, scale,
                   err, errlen, D))
    return 1;
  const int order = sk90w::choose_work_order(pattern, window, sinks, S, B, Hq, Hkv, grid);
  if (order < 0) {
    snprintf(err, errlen, "SPARSE_K_WORK_ORDER=%s: static, snake or head_snake (or unset) is allowed",
             getenv("SPARSE_K_WORK_ORDER"));
    return 1;
  }
  set_work_order(p, order);
  // rows of kLongRowKeys keys or more on average: fwd_consumer's WG_UNIFORM variant (sm90_fwd_mainloop.cuh)
  const long long span = window < S ? window : S;
  const long long row_keys = pattern == 0 ? S / 2 : pattern == 3 ? span / 2 : span;
  const bool uniform = row_keys >= kLongRowKeys;
  if (pattern == 2 && sinks >= 1 && sinks <= kSinkStepMax)
    return D == 64 ? launch_structured<64, true>(bf16, uniform, grid, stream, err, errlen, tq, tk, tv, p)
                   : launch_structured<128, true>(bf16, uniform, grid, stream, err, errlen, tq, tk, tv, p);
  return D == 64 ? launch_structured<64, false>(bf16, uniform, grid, stream, err, errlen, tq, tk, tv, p)
                 : launch_structured<128, false>(bf16, uniform, grid, stream, err, errlen, tq, tk, tv, p);
}

// Host entry point of the listed forward (bigbird): the block layout's full / partial key tile counts
// fnum, pnum (B, Hkv, num_q_tiles) and key tiles fidx (B, Hkv, num_q_tiles, fw), pidx (..., pw), int32
// contiguous on q's device, tiles of 128 x 128 (the caller has checked them). Returns 0 on success.
extern "C" int sk90_listed_fwd(const void* q, const void* k, const void* v, void* out, float* lse,
                               const long long* strides, int B, int Hq, int Hkv, int S, int D, int is_bf16,
                               const int* fnum, const int* fidx, int fw, const int* pnum, const int* pidx, int pw,
                               float scale, void* stream, char* err, int errlen) {
  using namespace sk90;
  if (B < 1 || Hq < 1 || Hkv < 1 || Hq % Hkv != 0 || S < 1 || (D != 64 && D != 128) || fw < 1 || pw < 1 || !fnum ||
      !fidx || !pnum || !pidx || !(scale > 0.f)) {
    snprintf(err, errlen, "bad arguments: B=%d Hq=%d Hkv=%d S=%d D=%d fw=%d pw=%d scale=%g", B, Hq, Hkv, S, D, fw, pw,
             static_cast<double>(scale));
    return 1;
  }
  FwdParams p;
  CUtensorMap tq, tk, tv;
  int grid = 0;
  const bool bf16 = is_bf16 != 0;
  if (!prepare_fwd(p, tq, tk, tv, grid, q, k, v, out, lse, strides, B, Hq, Hkv, S, bf16, 4, 0, 0, scale, err, errlen,
                   D))
    return 1;
  p.fnum = fnum;
  p.fidx = fidx;
  p.pnum = pnum;
  p.pidx = pidx;
  p.fw = fw;
  p.pw = pw;
  if (D == 64)
    return launch_kernel(bf16 ? structured_fwd_kernel<true, true, false, 64>
                              : structured_fwd_kernel<false, true, false, 64>,
                         grid, kThreads, Smem<64>::kBytes, stream, err, errlen, tq, tk, tv, p);
  return launch_kernel(bf16 ? structured_fwd_kernel<true, true, false, 128>
                            : structured_fwd_kernel<false, true, false, 128>,
                       grid, kThreads, Smem<128>::kBytes, stream, err, errlen, tq, tk, tv, p);
}
