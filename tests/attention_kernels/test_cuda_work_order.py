"""The structured forward's work orders (``csrc/sm90_work_order.h``), on the CPU: the header is plain C++, compiled
here with the machine's C++ compiler (skipped without one) into a small probe whose answers are checked against
definitions written in Python: every order is a bijection of the work tiles, the key tiles it counts per query
tile are those the pattern's rule makes visible, and the host picks the order the load model favours (the GPU
test of the kernel under each order is ``test_cuda_structured.py::test_work_orders_match_reference``)."""

import os
import shutil
import subprocess

import numpy as np
import pytest

CSRC = os.path.join(os.path.dirname(__file__), "..", "..", "kernel_src", "attention", "cuda", "csrc")
ORDERS = {"static": 0, "snake": 1, "head_snake": 2}

PROBE = r"""
#include "sm90_work_order.h"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
int main(int argc, char** argv) {
  using namespace sk90w;
  auto a = [&](int i) { return std::atoi(argv[i]); };
  if (!std::strcmp(argv[1], "map")) {  // order grid period total -> the tile of every w
    for (int w = 0; w < a(5); ++w) std::printf("%d\n", ordered_tile(a(2), w, a(3), a(4), a(5)));
  } else if (!std::strcmp(argv[1], "tiles")) {  // pattern window sinks S -> key tiles of every query tile
    for (int m = 0; m < (a(5) + 127) / 128; ++m) std::printf("%d\n", key_tiles(a(2), a(3), a(4), a(5), m));
  } else if (!std::strcmp(argv[1], "load")) {  // order pattern window sinks S B Hq Hkv grid
    std::printf("%.6f\n", busiest_load(a(2), a(3), a(4), a(5), a(6), a(7), a(8), a(9), a(10)));
  } else if (!std::strcmp(argv[1], "choose")) {  // pattern window sinks S B Hq Hkv grid
    std::printf("%d\n", choose_work_order(a(2), a(3), a(4), a(5), a(6), a(7), a(8), a(9)));
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    d = tmp_path_factory.mktemp("work_order")
    src, exe = d / "probe.cpp", d / "probe"
    src.write_text(PROBE)
    subprocess.run([cxx, "-std=c++17", "-O1", "-I", CSRC, str(src), "-o", str(exe)], check=True)

    def run(*args, env=None):
        e = {k: v for k, v in os.environ.items() if k != "SPARSE_K_WORK_ORDER"}
        e.update(env or {})
        out = subprocess.run([str(exe), *map(str, args)], check=True, capture_output=True, text=True, env=e).stdout
        return [float(x) if "." in x else int(x) for x in out.split()]

    return run


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("grid,period,total", [(132, 512, 4096), (132, 2048, 16384), (7, 30, 90), (5, 9, 27),
                                               (132, 100, 100), (114, 4 * 257, 8 * 4 * 257)])
def test_every_order_is_a_bijection(probe, order, grid, period, total):
    tiles = probe("map", ORDERS[order], grid, period, total)
    assert sorted(tiles) == list(range(total))
    if order != "static" and total >= 2 * grid and (order == "snake" or period >= 2 * grid):
        assert tiles != list(range(total))  # a complete odd block exists and is reversed


def test_snake_reverses_odd_blocks(probe):
    assert probe("map", ORDERS["snake"], 3, 9, 9) == [0, 1, 2, 5, 4, 3, 6, 7, 8]
    # blocks counted from each KV head's first tile; the head's incomplete last block stays in order
    assert probe("map", ORDERS["head_snake"], 2, 5, 10) == [0, 1, 3, 2, 4, 5, 6, 8, 7, 9]


def _visible_tiles(pattern, window, sinks, S, m):
    """Key tiles holding a key some row of query tile m sees (the pattern's definition, row by row)."""
    tiles = set()
    for i in range(128 * m, min(128 * m + 128, S)):
        j = np.arange(i + 1)
        if pattern == 1:
            ok = i - j < window
        elif pattern == 2:
            ok = (i - j < window) | (j < sinks)
        elif pattern == 3:
            ok = j >= i - i % window
        else:
            ok = np.ones_like(j, dtype=bool)
        tiles.update((j[ok] // 128).tolist())
    return len(tiles)


@pytest.mark.parametrize("pattern,window,sinks,S", [(0, 0, 0, 1000), (1, 300, 0, 1000), (1, 128, 0, 777),
                                                    (2, 200, 4, 1000), (2, 129, 300, 901), (3, 256, 0, 1000),
                                                    (3, 100, 0, 701), (1, 1, 0, 300)])
def test_key_tiles_are_the_visible_ones(probe, pattern, window, sinks, S):
    got = probe("tiles", pattern, window, sinks, S)
    assert got == [_visible_tiles(pattern, window, sinks, S, m) for m in range(-(-S // 128))]


def _busiest(order, pattern, window, sinks, S, B, Hq, Hkv, grid, probe):
    """The load model in Python: CTA w % grid takes the natural tile the probe's map gives for w."""
    nq, group = -(-S // 128), Hq // Hkv
    cost = np.array(probe("tiles", pattern, window, sinks, S), dtype=float) + 1.0
    lin = np.array(probe("map", order, grid, group * nq, group * nq * B * Hkv))
    m = lin // group % nq
    if pattern == 0:
        m = nq - 1 - m
    return np.bincount(np.arange(lin.size) % grid, weights=cost[m], minlength=grid).max()


@pytest.mark.parametrize("shape", [(0, 0, 0, 16384), (0, 0, 0, 65536), (1, 4096, 0, 16384), (3, 4096, 0, 65536),
                                   (3, 512, 0, 65536), (2, 4096, 128, 32768)])
def test_choice_follows_the_load_model(probe, shape):
    pattern, window, sinks, S = shape
    dims = (1, 32, 8, 132)
    loads = {o: probe("load", o, pattern, window, sinks, S, *dims)[0] for o in ORDERS.values()}
    for o, load in loads.items():
        assert load == pytest.approx(_busiest(o, pattern, window, sinks, S, *dims, probe), rel=1e-9)
    chosen = probe("choose", pattern, window, sinks, S, *dims)[0]
    best = min((o for o in (1, 2)), key=lambda o: loads[o])
    expected = best if loads[best] < loads[0] * 0.99 else 0
    assert chosen == expected


def test_choices_on_the_benchmark_shapes(probe):
    """What the model picks for the rows of ``cuda_build_and_time.py ab`` (B=1, Hq=32, Hkv=8, 132 SMs)."""
    dims = (1, 32, 8, 132)
    assert probe("choose", 0, 0, 0, 65536, *dims) == [ORDERS["head_snake"]]  # dense: lengths restart per KV head
    assert probe("choose", 0, 0, 0, 16384, *dims) == [ORDERS["head_snake"]]
    assert probe("choose", 1, 4096, 0, 65536, *dims) == [ORDERS["static"]]  # even tiles: nothing to balance
    assert probe("choose", 3, 4096, 0, 65536, *dims) == [ORDERS["snake"]]


def test_forced_order_and_bad_value(probe):
    args = ("choose", 1, 4096, 0, 65536, 1, 32, 8, 132)
    for name, value in ORDERS.items():
        assert probe(*args, env={"SPARSE_K_WORK_ORDER": name}) == [value]
    assert probe(*args, env={"SPARSE_K_WORK_ORDER": ""}) == [ORDERS["static"]]
    assert probe(*args, env={"SPARSE_K_WORK_ORDER": "fastest"}) == [-1]


def test_every_header_is_in_the_build_hash():
    """An edit to any header (this one included) must rebuild the extensions that include it."""
    from sparse_k.attention.cuda import build

    headers = {f for f in os.listdir(CSRC) if f.endswith((".h", ".cuh"))}
    assert headers == set(build._HEADERS)
