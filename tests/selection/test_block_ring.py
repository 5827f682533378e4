"""block_ring: the first queries of each row's last blocks, written in place and found by block id."""

from __future__ import annotations

import torch

from sparse_k.selection import block_ring


def _call(memo, p0: list[int], Sq: int, qb: int, values: torch.Tensor):
    """One call whose rows start at positions ``p0``; ``values (B, Sq, E)`` stand for each position's first query."""
    B = len(p0)
    first = torch.tensor([p // qb for p in p0])
    NB = max((p + Sq - 1) // qb - p // qb + 1 for p in p0)
    starts = (first[:, None] + torch.arange(NB)) * qb  # (B, NB) first position of each block
    qi = starts - torch.tensor(p0)[:, None]
    inside = (qi >= 0) & (qi < Sq)
    last = torch.tensor([(p + Sq - 1) // qb - p // qb for p in p0])
    per_block = values.gather(1, qi.clamp(0, Sq - 1)[..., None].expand(B, NB, values.shape[-1]))
    fresh = not block_ring.prepare(memo, B, qb, {"q": ((values.shape[-1],), values.dtype)}, torch.device("cpu"))
    block_ring.store(memo, first, last, inside, {"q": per_block})
    block_ring.host_store(memo, p0, Sq, qb, fresh)


def test_a_call_back_inside_an_older_block_finds_its_first_query():
    qb, B, E = 4, 2, 3
    R = block_ring.ring_blocks(qb)
    seq = torch.randn(B, 200, E)
    memo = {}
    _call(memo, [0, 0], 10, qb, seq[:, :10])  # prefill: blocks 0-2
    _call(memo, [10, 10], 7, qb, seq[:, 10:17])  # drafts: blocks 2 (inside), 3 and 4 start
    for block in (0, 1, 2, 3, 4):
        found, (q,) = block_ring.lookup(memo, torch.full((B,), block), ["q"])
        assert found.all(), block
        assert torch.equal(q, seq[:, block * qb]), block
    assert memo["block"].tolist() == [4, 4]
    assert block_ring.host_has(memo, [13, 13], qb) and block_ring.host_has(memo, [5, 5], qb)
    found, _ = block_ring.lookup(memo, torch.full((B,), 5), ["q"])
    assert not found.any()  # block 5 was never started
    _call(memo, [17, 17], 4 * (R + 1), qb, seq[:, 17:17 + 4 * (R + 1)])  # R + 1 more blocks: block 4 leaves the ring
    found, _ = block_ring.lookup(memo, torch.full((B,), 4), ["q"])
    assert not found.any() and not block_ring.host_has(memo, [17, 17], qb)


def test_a_new_generation_forgets_the_old_blocks():
    qb, E = 8, 2
    memo = {}
    _call(memo, [0], 40, qb, torch.randn(1, 40, E))  # blocks 0-4
    _call(memo, [0], 3, qb, torch.randn(1, 3, E))  # a new prompt: block 0 only
    found, _ = block_ring.lookup(memo, torch.tensor([2]), ["q"])
    assert not found.any() and not block_ring.host_has(memo, [17], qb)


def test_ring_sizes():
    assert block_ring.ring_blocks(1) == 1
    assert block_ring.ring_blocks(64) * 64 >= block_ring.SPAN
    assert block_ring.ring_blocks(2) == block_ring.MAX_BLOCKS


def test_host_starts_and_missing():
    """``host_starts``: each row's first query position from host offsets (0 in the padding); ``host_missing``: a row
    starts inside a block the mirror lacks (False when the offsets are device-only or no row starts inside one)."""
    qb = 8
    assert block_ring.host_starts(None, 2) is None
    assert block_ring.host_starts(([37], [0], [38]), 3) == [37, 37, 37]
    assert block_ring.host_starts(([37, 37], [0, 3], [38, 38]), 2) == [37, 34]
    assert block_ring.host_starts(([0, 0], [0, 5], [9, 9]), 2) == [0, 0]
    memo = {}
    assert not block_ring.host_missing(memo, None, qb, usable=False)
    assert not block_ring.host_missing(memo, [16, 8], qb, usable=False)
    assert block_ring.host_missing(None, [17, 8], qb, usable=False)
    _call(memo, [0, 0], 20, qb, torch.randn(2, 20, 3))  # blocks 0-2
    assert not block_ring.host_missing(memo, [20, 17], qb, usable=True)
    assert block_ring.host_missing(memo, [20, 17], qb, usable=False)  # the buffers were just made: an empty ring
    assert block_ring.host_missing(memo, [20, 25], qb, usable=True)  # block 3 was never started
    block_ring.host_store(memo, None, 1, qb, fresh=False)  # a call with device-only offsets: the mirror is dropped
    assert block_ring.host_missing(memo, [20, 17], qb, usable=True)


def test_store_from_host_writes_what_store_writes():
    """Calls whose rows share their start: ``store_from_host`` (slices chosen on the host) leaves the ring exactly as
    ``store`` (per-slot index arithmetic on the device) does, through prefills, decode steps, drafts cut back into
    older blocks, ring wraps and restarts."""
    torch.manual_seed(0)
    for qb in (1, 4, 16):
        B, E = 2, 3
        seq = torch.randn(B, 400, E)
        by_device, by_host = {}, {}
        calls = [(0, 37), (37, 1), (38, 1), (39, 9), (44, 3), (47, 70), (30, 2), (0, 5), (5, 1), (6, 130)]
        for p, Sq in calls:
            _call(by_device, [p] * B, Sq, qb, seq[:, p:p + Sq])
            first = p // qb
            NB = (p + Sq - 1) // qb - first + 1
            qi = ((first + torch.arange(NB)) * qb - p).clamp(0, Sq - 1)
            block_ring.prepare(by_host, B, qb, {"q": ((E,), seq.dtype)}, torch.device("cpu"))
            block_ring.store_from_host(by_host, p, Sq, qb, {"q": seq[:, p:p + Sq][:, qi]})
            for name in ("blocks", "block", "q"):
                written = by_device[name] if name != "q" else torch.where(by_device["blocks"][..., None] >= 0,
                                                                          by_device["q"], 0.0)
                mine = by_host[name] if name != "q" else torch.where(by_host["blocks"][..., None] >= 0, by_host["q"], 0.0)
                assert torch.equal(written, mine), (qb, p, Sq, name)
