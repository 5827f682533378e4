// Hopper (sm_90a) forward for a token layout (learned top-k key lists per query block) fused with
// its sliding_window / streaming static part: the inference prefill of the sparse_k pattern.
//
// Contract (``triton.fwd._selection_loop`` with a plain self-attention geometry, q_start = k_start =
// 0, k_end = S): q (B, Hq, S, D), k/v (B, Hkv, S, D), D 64 or 128, bf16 or fp16, views with unit last stride
// and strides of 16-byte multiples (4-D TMA maps; gathered rows by their row stride); query head h
// reads KV head h / (Hq / Hkv). Query i sees key j when j <= i and
//   static part     i - j < W  (streaming: or j < sinks)
//   selection       j is in slot c < min(count, K) of the list indices[b, kvh, blk(i), :], 0 <= j < S,
//                   the weight (if any) w > 0, and the static part does not already allow j
//                   (i - j >= W and j >= sinks; this implies j <= i); log2(w) is added to its logit.
// blk(i) = i / query_block - first_block[b]; rows whose block lies outside [0, NB) see no selected
// key (as the Triton loop). query_block is a multiple of 128, so one 128-row tile has one block.
// Outputs: out (B, Hq, S, D) in q's dtype, a view with its own strides (16-byte multiples, unit
// last), lse (B, Hq, S) float32 contiguous, natural log.
//
// The consumers and the tile arithmetic are sm90_fwd_mainloop.cuh's (shared with
// structured_fwd_sm90.cu) with a second kind of key tile in front of the window tiles: a gathered
// tile of 128 selected slots. All 128 producer threads take part in
// every tile: for a gathered tile thread t reads slot t's key index, copies the K row (then the V
// row) with cp.async of 16 bytes into the 128-byte-swizzled layout that TMA writes (chunk c of
// row r at r * 128 + 16 * (c ^ (r & 7)) inside each 64-column half; invalid slots copy key row 0,
// finite values whose probability is 0; a warp copies two whole rows (D = 64: four) per instruction, the keys
// passed by shuffles), and writes per slot a logit bias (log2 w / scale_log2, or
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

#include "sm90_fwd_mainloop.cuh"

namespace sk90t {

using namespace sk90f;

// Barrier area at the start of dynamic shared memory: mbarriers (128 bytes), then per stage the
// gathered tile's 128 float biases and 128 byte row thresholds.
constexpr int kBiasOff = 128;
constexpr int kThrOff = kBiasOff + kStages * kBlockN * 4;
constexpr int kBarBytes = 2048;
static_assert(kThrOff + kStages * kBlockN <= kBarBytes, "barrier area too small");
template <int D>
using Smem = FwdSmem<kBarBytes, kStages, 1, D>;

struct Params : FwdParams {  // pattern: 1 sliding_window or 2 streaming
  const void* k;
  const void* v;
  long long ksb, ksh, kss;  // element strides (b, h, s) of k and v
  long long vsb, vsh, vss;
  const int* sel_idx;      // (B, Hkv, NB, K), unit last stride
  const int* sel_cnt;      // (B, Hkv, NB)
  const float* sel_w;      // (B, Hkv, NB, K) or nullptr
  const long long* first;  // (B,)
  long long sib, sih, sin;  // index strides (elements)
  long long scb, sch, scn;  // count strides
  long long swb, swh, swn;  // weight strides
  int NB, K, QB;
};

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

// The 128 gathered rows of a tile (2 D bytes each at base + row_bytes * key) into a 128-byte-swizzled tile
// at dst. Thread t holds the (safe) key of slot t; warp w copies rows 32 w .. 32 w + 31, 512 bytes of whole
// rows per instruction (D = 128: two rows, lane l: row 2 i + l / 16, 16-byte chunk l % 16; D = 64: four rows, row
// 4 i + l / 8, chunk l % 8), so each instruction reads four whole 128-byte lines instead of one sector of 32 rows.
template <int D>
__device__ __forceinline__ void gather_tile(uint32_t dst, const uint8_t* base, long long row_bytes, int key, int t) {
  constexpr int kChunks = D / 8;           // 16-byte chunks a row
  constexpr int kRows = 32 / kChunks;      // rows an instruction copies
  const int lane = t & 31;
  const int c = lane % kChunks;
  const uint32_t col = (c >> 3) * kHalfBytes;
#pragma unroll
  for (int i = 0; i < 32 / kRows; ++i) {
    const int src = kRows * i + lane / kChunks;
    const int kr = __shfl_sync(0xffffffffu, key, src);
    const int r = (t & ~31) + src;
    cp_async16(dst + col + r * 128 + (((c & 7) ^ (r & 7)) << 4), base + kr * row_bytes + 16 * c);
  }
}

template <bool BF16, int D>
__global__ void __launch_bounds__(kThreads, 1)
    token_fwd_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                     const __grid_constant__ CUtensorMap tm_v, const Params p) {
  using Sm = Smem<D>;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* const gbase = smem_raw + (base - raw);  // generic pointer to base
  const Sm sm(base);
  float* const sbias = reinterpret_cast<float*>(gbase + kBiasOff);  // [kStages][128]
  uint8_t* const sthr = gbase + kThrOff;                             // [kStages][128]
  if (threadIdx.x == 0) sm.init(128);  // every producer thread arrives
  __syncthreads();

  if (threadIdx.x / 128 == 0) {
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
      const TileRange tr = tile_range<false>(p, m, bh);
      long long ioff, woff;
      const int nslots = sel_slots(p, m, b, hk, ioff, woff);
      const int nsel = cdiv(nslots, kBlockN);
      const int qlo = m * kBlockM;
      if (t == 0) sm.load_q(&tm_q, local, m, bh % p.Hq, b);
      const uint8_t* kbase = static_cast<const uint8_t*>(p.k) + 2 * (b * p.ksb + hk * p.ksh);
      const uint8_t* vbase = static_cast<const uint8_t*>(p.v) + 2 * (b * p.vsb + hk * p.vsh);
      for (int it = 0; it < nsel + tr.count; ++it, ++cnt) {
        const int s = cnt % kStages;
        const uint32_t ph = ((cnt / kStages) & 1) ^ 1;
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
          if (cnt >= kStages) mbar_wait(sm.bar_kempty + 8 * s, ph);
          sbias[s * kBlockN + t] = bias;
          sthr[s * kBlockN + t] = static_cast<uint8_t>(thr);
          gather_tile<D>(sm.sk + s * Sm::kTile, kbase, 2 * p.kss, safe, t);
          cp_async_arrive(sm.bar_kfull + 8 * s);
          mbar_arrive(sm.bar_kfull + 8 * s);
          if (cnt >= kStages) mbar_wait(sm.bar_vempty + 8 * s, ph);
          gather_tile<D>(sm.sv + s * Sm::kTile, vbase, 2 * p.vss, safe, t);
          cp_async_arrive(sm.bar_vfull + 8 * s);
          mbar_arrive(sm.bar_vfull + 8 * s);
        } else {
          // a window tile: thread 0 issues the TMA copies, the others arrive
          const int row = tr.tile(it - nsel) * kBlockN;
          if (cnt >= kStages) mbar_wait(sm.bar_kempty + 8 * s, ph);
          if (t == 0)
            Sm::load_tile(sm.sk + s * Sm::kTile, &tm_k, sm.bar_kfull + 8 * s, row, hk, b);
          else
            mbar_arrive(sm.bar_kfull + 8 * s);
          if (cnt >= kStages) mbar_wait(sm.bar_vempty + 8 * s, ph);
          if (t == 0)
            Sm::load_tile(sm.sv + s * Sm::kTile, &tm_v, sm.bar_vfull + 8 * s, row, hk, b);
          else
            mbar_arrive(sm.bar_vfull + 8 * s);
        }
      }
    }
    cp_async_wait_all();
    return;
  }

  // ---------------- consumers
  asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n" ::: "memory");
  fwd_consumer<BF16, true, false, true, false>(p, sm, sbias, sthr, [&](int m, int bh) {
    long long ioff, woff;
    const int b = p.div_hq.div(bh);
    return cdiv(sel_slots(p, m, b, p.div_group.div(bh - b * p.Hq), ioff, woff), kBlockN);
  });
}

template <int D>
int launch_token(bool bf16, int grid, void* stream, char* err, int errlen, const CUtensorMap& tq, const CUtensorMap& tk,
                 const CUtensorMap& tv, const Params& p) {
  return launch_kernel(bf16 ? token_fwd_kernel<true, D> : token_fwd_kernel<false, D>, grid, kThreads, Smem<D>::kBytes,
                       stream, err, errlen, tq, tk, tv, p);
}

}  // namespace sk90t

// Host entry point; sel_* as Params (strides in elements, the index / weight lists with unit last
// stride; sel_w may be null); strides: the element strides (b, h, s) of the index, count and weight
// lists (9 values), then of q, k, v and out (12); D the head dim, 64 or 128. Returns 0 on success, else writes a
// message to err.
extern "C" int sk90_token_fwd(const void* q, const void* k, const void* v, void* out, float* lse, int B, int Hq,
                              int Hkv, int S, int D, int is_bf16, int pattern, int window, int sinks, float scale,
                              const int* sel_idx, const int* sel_cnt, const float* sel_w, const long long* first,
                              const long long* strides, int NB, int K, int QB, void* stream, char* err, int errlen) {
  using namespace sk90t;
  if (B < 1 || Hq < 1 || Hkv < 1 || Hq % Hkv != 0 || S < 1 || (D != 64 && D != 128) ||
      (pattern != 1 && pattern != 2) || window < 1 || sinks < 0 || !(scale > 0.f) || NB < 1 || K < 1 || QB < kBlockM ||
      QB % kBlockM != 0) {
    snprintf(err, errlen,
             "bad arguments: B=%d Hq=%d Hkv=%d S=%d D=%d pattern=%d window=%d sinks=%d scale=%g NB=%d K=%d QB=%d",
             B, Hq, Hkv, S, D, pattern, window, sinks, static_cast<double>(scale), NB, K, QB);
    return 1;
  }
  Params p;
  CUtensorMap tq, tk, tv;
  int grid = 0;
  const bool bf16 = is_bf16 != 0;
  const long long* const vs = strides + 9;  // q, k, v, out: (b, h, s) each
  if (!prepare_fwd(p, tq, tk, tv, grid, q, k, v, out, lse, vs, B, Hq, Hkv, S, bf16, pattern, window, sinks, scale, err,
                   errlen, D))
    return 1;
  p.k = k;
  p.v = v;
  p.ksb = vs[3];
  p.ksh = vs[4];
  p.kss = vs[5];
  p.vsb = vs[6];
  p.vsh = vs[7];
  p.vss = vs[8];
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
  return D == 128 ? launch_token<128>(bf16, grid, stream, err, errlen, tq, tk, tv, p)
                  : launch_token<64>(bf16, grid, stream, err, errlen, tq, tk, tv, p);
}
