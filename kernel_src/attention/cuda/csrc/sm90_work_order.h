// The order in which the persistent structured forward's CTAs take their work tiles, and the host's choice of it.
// Plain C++ (no CUDA): the host code of structured_fwd_sm90.cu includes it, and the CPU tests compile it with a
// C++ compiler (tests/attention_kernels/test_cuda_work_order.py). The device mirror is sm90_fwd_mainloop.cuh's
// ordered_work.
//
// CTA c of a grid of `grid` takes the work tiles w = c, c + grid, c + 2 grid, ... . A work order maps w to the work
// tile of the kernel's natural order (work_coords: the query heads of one KV head on consecutive tiles, then query
// tiles, dense causal longest first; one KV head's `period` = (Hq / Hkv) * query tiles consecutive tiles):
//   kOrderStatic     w itself.
//   kOrderSnake      every odd block of `grid` consecutive tiles counted from 0 is taken in reverse, so a CTA that
//                    had one of a block's longer tiles takes one of the next block's shorter ones (balanced when
//                    tile lengths fall or rise steadily across blocks: block_diagonal, dense at 32K and more).
//   kOrderHeadSnake  the same with the blocks counted from each KV head's first tile (dense causal, whose lengths
//                    restart at every KV head: the plain snake then piles the longest tiles onto the same CTAs).
// A block that would run past the end of its span (all tiles, or the KV head) stays in order, so each is a
// bijection of [0, total). The CTAs of any order still work on about `grid` consecutive natural tiles at a time
// (one or two KV heads' K/V in L2).
#pragma once

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace sk90w {

enum : int { kOrderStatic = 0, kOrderSnake = 1, kOrderHeadSnake = 2 };

constexpr int kTileRows = 128;  // query rows of a work tile, keys of a key tile
// A work tile's fixed cost (Q load, epilogue, pipeline edges) in key tiles: about two before the cross-tile overlap
// hid part of it (docs/history.md, "Two Q buffers and a cross-tile overlap").
constexpr double kWorkTileCost = 1.0;
// A reordering is taken only when it brings the busiest CTA's simulated load down by more than this share: its index
// arithmetic and the tiles it moves cost a little that the model leaves out.
constexpr double kMinGain = 0.01;

// The blocks an order reverses, as the kernel reads them (FwdParams' period, span): blocks of `grid` work tiles
// counted from multiples of `period` (one KV head's `head_period` tiles for head_snake, else all `total`), the odd
// ones that end inside `span` reversed (static: span 0, none).
struct OrderBlocks {
  int period, span;
};
inline OrderBlocks order_blocks(int order, int head_period, int total) {
  const int period = order == kOrderHeadSnake ? head_period : total;
  return {period, order == kOrderStatic ? 0 : period};
}

// Work tile w -> the natural work tile under `order` (see above); the device's ordered_work with plain divisions.
inline int ordered_tile(int order, int w, int grid, int head_period, int total) {
  const OrderBlocks b = order_blocks(order, head_period, total);
  const int base = w / b.period * b.period;
  const int k = w - base;
  const int block = k / grid;
  if ((block & 1) && (block + 1) * grid <= b.span) return base + block * grid + (grid - 1) - (k - block * grid);
  return w;
}

// Key tiles of query tile m (pattern 0 dense, 1 sliding_window, 2 streaming, 3 block_diagonal with block `window`):
// the count of sm90_fwd_mainloop.cuh's tile_range, which the kernel walks (with 1 to 16 sinks the kernel takes a sink
// step of an eighth of a tile on every query tile instead: the model's loads then differ by less than a tile a row).
inline int key_tiles(int pattern, int window, int sinks, int S, int m) {
  const int qlo = m * kTileRows;
  const int qhi = std::min(qlo + kTileRows, S) - 1;
  int a_lo = 0;
  int a_hi = std::min(S, qhi + 1);
  if (pattern == 1 || pattern == 2) a_lo = std::max(0, qlo - window + 1);
  if (pattern == 3) a_lo = qlo - qlo % std::max(window, 1);
  a_hi = std::max(a_hi, a_lo);
  const int n_lo = a_lo / kTileRows;
  const int n_hi = std::max((a_hi + kTileRows - 1) / kTileRows, n_lo);
  int n_sink = 0;
  if (pattern == 2) {
    const int s_end = std::min(std::min(sinks, S), qhi + 1);
    n_sink = std::max(std::min((std::max(s_end, 0) + kTileRows - 1) / kTileRows, n_lo), 0);
  }
  return n_sink + (n_hi - n_lo);
}

// The busiest CTA's load (key tiles plus kWorkTileCost per work tile) under `order`, B * Hq * query tiles work tiles.
inline double busiest_load(int order, int pattern, int window, int sinks, int S, int B, int Hq, int Hkv, int grid) {
  const int nq = (S + kTileRows - 1) / kTileRows;
  const int group = Hq / Hkv;
  const int period = group * nq;
  const int total = period * B * Hkv;
  std::vector<double> tile_load(nq);
  for (int m = 0; m < nq; ++m) tile_load[m] = key_tiles(pattern, window, sinks, S, m) + kWorkTileCost;
  std::vector<double> load(grid, 0.0);
  for (int w = 0; w < total; ++w) {
    const int lin = ordered_tile(order, w, grid, period, total);
    int m = lin / group % nq;
    if (pattern == 0) m = nq - 1 - m;
    load[w % grid] += tile_load[m];
  }
  return *std::max_element(load.begin(), load.end());
}

// The order to launch with: SPARSE_K_WORK_ORDER=static|snake|head_snake forces one (tests, measurements; any other
// non-empty value: -1); else the order whose busiest CTA the simulation loads least, the static one unless another
// gains more than kMinGain.
inline int choose_work_order(int pattern, int window, int sinks, int S, int B, int Hq, int Hkv, int grid) {
  const char* forced = std::getenv("SPARSE_K_WORK_ORDER");
  if (forced && *forced) {
    if (!std::strcmp(forced, "static")) return kOrderStatic;
    if (!std::strcmp(forced, "snake")) return kOrderSnake;
    if (!std::strcmp(forced, "head_snake")) return kOrderHeadSnake;
    return -1;
  }
  struct Key {
    int pattern, window, sinks, S, B, Hq, Hkv, grid;
    bool operator==(const Key& o) const { return !std::memcmp(this, &o, sizeof(Key)); }
  };
  thread_local Key last{-1, 0, 0, 0, 0, 0, 0, 0};
  thread_local int last_order = kOrderStatic;
  const Key key{pattern, window, sinks, S, B, Hq, Hkv, grid};
  if (key == last) return last_order;
  const double base = busiest_load(kOrderStatic, pattern, window, sinks, S, B, Hq, Hkv, grid);
  int best = kOrderStatic;
  double best_load = base * (1.0 - kMinGain);
  for (int order : {kOrderSnake, kOrderHeadSnake}) {
    const double load = busiest_load(order, pattern, window, sinks, S, B, Hq, Hkv, grid);
    if (load < best_load) {
      best = order;
      best_load = load;
    }
  }
  last = key;
  last_order = best;
  return best;
}

}  // namespace sk90w
