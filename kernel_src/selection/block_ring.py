"""The first queries of each row's last few query blocks, kept from one call of a generation to the next.

A learned selection scores a query block with the block's *first* query (``page_selection.block_queries``, the DSA
indexer's ``selectors._dsa_block_queries``); a call that starts inside a block needs that query from an earlier call.
Plain decoding only ever continues the latest block, but assisted and prompt-lookup decoding draft several tokens,
and when the model rejects some of them the cache is cut back, possibly into a block before the latest (a rejected
draft started a new one). So the memo keeps a *ring* of the last ``ring_blocks(query_block)`` blocks per row: block
``b`` in slot ``b % R``, with its id (``-1``: empty) next to the values. The ring spans at least ``SPAN`` tokens
(capped at ``MAX_BLOCKS`` blocks): a draft longer than that, rejected back past the ring, falls back to the call's
own first query with a warning (as a call without a memo does).

Entries of a memo dict (every one ``(B, ...)``, a buffer written in place: ``step_state``, CUDA-graph safe):
``"blocks" (B, R)`` int64 block ids, and per value name ``v`` (``"q"``, ``"w"``) ``(B, R, ...)``. The dict's
``"block" (B,)`` stays each row's latest block (``beam_rows`` fingerprints it). ``"blocks_host"``: the ring's block
ids per row on the host when the calls' offsets were host-known (None otherwise): with it, whether the ring holds
the block a call starts inside is known without a device read (``host_missing``).
"""

from __future__ import annotations

import torch

from ..layouts.geometry import host_rows
from .step_state import state_buffers

__all__ = ["MAX_BLOCKS", "SPAN", "host_has", "host_missing", "host_starts", "host_store", "lookup", "prepare",
           "ring_blocks", "ring_spec", "store", "store_from_host"]

#: Tokens the ring covers at least (a rejected draft up to this long continues exactly).
SPAN = 128

#: At most this many blocks per row (small query blocks: the ring covers ``MAX_BLOCKS * query_block`` tokens).
MAX_BLOCKS = 32


def ring_blocks(query_block: int) -> int:
    """Blocks kept per row: 1 for one-query blocks (a call never starts inside one), else ``ceil(SPAN / query_block)``
    capped at ``MAX_BLOCKS``."""
    if query_block <= 1:
        return 1
    return min(MAX_BLOCKS, -(-SPAN // query_block))


def ring_spec(batch: int, query_block: int, values: dict) -> dict:
    """``state_buffers`` spec of the ring: ``values`` maps a name to ``(shape of one entry, dtype)``."""
    R = ring_blocks(query_block)
    spec = {"block": ((batch,), torch.int64, -1), "blocks": ((batch, R), torch.int64, -1)}
    for name, (shape, dtype) in values.items():
        spec[name] = ((batch, R, *shape), dtype, 0.0)
    return spec


def prepare(memo: dict, batch: int, query_block: int, values: dict, device: torch.device) -> bool:
    """Make the ring's buffers (``ring_spec``); True when they were there already (they hold earlier calls' blocks)."""
    return state_buffers(memo, ring_spec(batch, query_block, values), device)


def lookup(memo: dict, block: torch.Tensor, names) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(found (B,), [value (B, ...) per name])``: the ring's entries of ``block (B,)`` in each row (found: the
    slot holds that block; elsewhere the values are meaningless)."""
    R = memo["blocks"].shape[1]
    slot = block.clamp_min(0) % R  # (B,)
    rows = torch.arange(block.shape[0], device=block.device)
    found = (memo["blocks"][rows, slot] == block) & (block >= 0)
    return found, [memo[name][rows, slot] for name in names]


def store(memo: dict, first: torch.Tensor, last: torch.Tensor, inside: torch.Tensor, values: dict) -> None:
    """Write the blocks of this call whose first query it holds into the ring (in place), the last ``R`` of them.

    ``first (B,)``: block id of the call's first block per row, ``last (B,)``: index (into the call's blocks) of
    each row's last block, ``inside (B, NB)``: the block's first query is in this call, ``values``: name ->
    ``(B, NB, ...)`` per-block values. Also sets ``memo["block"]`` to each row's last block where its first query was
    in the call.
    """
    blocks = memo["blocks"]
    B, R = blocks.shape
    s = torch.arange(R, device=first.device)
    top = first + last  # (B,) id of each row's last block
    j = last[:, None] - (top[:, None] - s[None]) % R  # (B, R) call block index that slot s gets
    ok = (j >= 0) & inside.gather(1, j.clamp_min(0))
    jc = j.clamp_min(0)
    restart = (first == 0) & inside[:, 0]  # a row's generation starts over: forget its older blocks
    blocks.copy_(torch.where(ok, first[:, None] + jc, torch.where(restart[:, None], -1, blocks)))
    for name, v in values.items():
        picked = v.gather(1, jc.view(B, R, *([1] * (v.dim() - 2))).expand(B, R, *v.shape[2:]))
        memo[name].copy_(torch.where(ok.view(B, R, *([1] * (v.dim() - 2))), picked.detach(), memo[name]))
    seen = inside.gather(1, last.clamp_min(0)[:, None]).squeeze(1) & (last >= 0)
    memo["block"].copy_(torch.where(seen, top, memo["block"]))


def store_from_host(memo: dict, p0: int, q_len: int, query_block: int, values: dict) -> None:
    """``store`` for a call whose rows all start at query position ``p0`` (host-known): which blocks go to which
    slots is known on the host, so the ring is written with a few slice copies (no per-slot index arithmetic on the
    device). ``values``: name -> ``(B, NB, ...)`` per-block values, block ``p0 // query_block + c`` at index ``c``."""
    blocks = memo["blocks"]
    R = blocks.shape[1]
    first, top = p0 // query_block, (p0 + q_len - 1) // query_block
    b = max(-(-p0 // query_block), top - R + 1)  # the last R blocks whose first query is in the call
    if p0 == 0:  # the row's generation starts over: forget its older blocks
        blocks.fill_(-1)
    if b <= top:
        memo["block"].fill_(top)
    while b <= top:  # at most two runs of consecutive slots (the ring wraps once)
        s = b % R
        n = min(top - b + 1, R - s)
        blocks[:, s:s + n].copy_(torch.arange(b, b + n, device=blocks.device))
        for name, v in values.items():
            memo[name][:, s:s + n].copy_(v[:, b - first:b - first + n].detach())
        b += n


def host_starts(host: tuple | None, batch: int) -> list[int] | None:
    """Each of the ``batch`` rows' first query position (0 for a row whose call starts in its padding) from
    ``host``, ``RowGeometry.host_offsets()``; None when only the device knows the offsets."""
    if host is None:
        return None
    p0 = [max(0, qs - ks) for qs, ks, _ in host_rows(host)]
    return p0 * batch if len(p0) == 1 else p0


def host_store(memo: dict, p0: list[int] | None, Sq: int, query_block: int, fresh: bool) -> None:
    """Mirror ``store`` on the host for host-known offsets: ``p0`` the call's first query position per row (or one
    for all rows; None: only the device knows them, and the mirror is dropped), ``fresh`` the buffers were just made
    (the ring was empty)."""
    if p0 is None:
        memo["blocks_host"] = None
        return
    R = memo["blocks"].shape[1]
    old = memo.get("blocks_host")
    rings = [list(r) for r in old] if old is not None and not fresh and len(old) == len(p0) else [[-1] * R for _ in p0]
    for i, p in enumerate(p0):
        ring = rings[i] = [-1] * R if p == 0 else rings[i]
        for b in range(max(-(-p // query_block), (p + Sq - 1) // query_block - R + 1), (p + Sq - 1) // query_block + 1):
            ring[b % R] = b
    memo["blocks_host"] = rings


def host_has(memo: dict, p0: list[int], query_block: int) -> bool:
    """Whether, by the host mirror, every row whose call starts inside a block holds that block's first query."""
    rings = memo.get("blocks_host")
    if rings is None or len(rings) != len(p0):
        return False
    R = len(rings[0])
    return all(p % query_block == 0 or rings[i][(p // query_block) % R] == p // query_block for i, p in enumerate(p0))


def host_missing(memo: dict | None, p0: list[int] | None, query_block: int, usable: bool) -> bool:
    """Whether a row's call starts inside a block whose first query the ring does not hold, judged on the host
    (``host_has``; no device read): ``p0`` from ``host_starts`` (None: not known, and False), ``usable`` the ring
    holds earlier calls' blocks (``prepare`` returned True)."""
    if p0 is None or not any(p % query_block for p in p0):
        return False
    return not (usable and memo is not None and host_has(memo, p0, query_block))
