"""Which kernel runs an attention call: the one place that decides.

A ``sparse_attention`` call asks ``plan_backend`` for its backend (the exact reference, the PyTorch
path, or a registered kernel backend such as ``"triton"``); the Triton backend asks ``plan_tiles`` for
its tiles; ``dispatch`` describes each kernel launch (a ``Launch``), asks ``plan_forward`` (a decode step:
``plan_decode``) or ``plan_backward``, and launches the kernel the returned ``Plan`` names. Benchmarks
and tests ask the same functions, or collect the plans of a run with ``recording()``. The CUDA
kernels' contracts are rules on shapes, strides and dtypes (``cuda.contract``); the device enters only
through a ``Capability``, so every decision can be asked for CPU or meta tensors.

Backend (``plan_backend``): ``"reference"`` / ``"torch"`` when requested; ``"auto"`` takes the first
registered kernel backend (auto order) that can run the call, else the PyTorch path; a requested
kernel backend that cannot run the call falls back to the PyTorch path (the API warns once, with the
plan's reason).

Tiles (``plan_tiles``): bigbird runs tiles that divide its block (``bigbird_tiles``); a decode step
(``Sq <= 16``, no gradient) packs the query heads of a KV group and splits the keys
(``decode_config``, ``split_count``); an inference prefill with a token layout packs heads too
(``selection_prefill_config``); every other call runs one query head per program (``tile_config``:
smaller tiles with gradients).

Forward (``plan_forward``), in this order:

1. *structured* launches: dense / sliding_window / streaming / block_diagonal (streaming causal only)
   without a token layout (``pattern_codes.structured_pattern``), one query head per program and one split (or
   ``Launch.structured`` forces it on / off). The Hopper CUDA kernel (``cuda_sm90_structured``) when
   CUDA may run (below), the output is the kernel's own (no caller view), the geometry is plain
   self-attention and ``cuda.contract.structured_call_ok`` holds; else ``triton_structured``.
   A causal bigbird launch over a block layout of 128 x 128 tiles (``bigbird_tiles`` picks them where
   ``bigbird_cuda`` holds), one query head per program and one split: the same CUDA kernel with the
   layout's key tiles listed (``cuda_sm90_listed``, ``cuda.contract.listed_call_ok``); else as 4.
2. a token-layout decode step (``Sq == 1``): the CUDA decode kernel (``cuda_sm90_decode``:
   ``decode_call_ok`` on a bottom-right geometry), else as 3 and 4. Every launch with ``Sq == 1`` is
   planned as a decode step (``plan_decode``, entry "decode") by these same rules.
3. a token-layout launch with one split: the CUDA token kernel (``cuda_sm90_token``:
   ``token_call_ok`` on a plain geometry).
4. the Triton layout kernel: ``triton_split_kv`` with ``num_splits > 1``, ``triton_token`` with a
   token layout, else ``triton_layout``.

Backward (``plan_backward``): structured launches (the same pattern rule) run the CUDA backward
(``cuda_sm90_structured_bwd``: ``structured_bwd_call_ok``, not block_diagonal) or ``triton_structured_bwd``;
the others ``triton_layout_bwd``.

CUDA may run a launch when the caller allows it (``Launch.cuda`` not False, no Triton tuning
argument; for the token and decode kernels no ``sel_fast`` either) and the ``Capability`` does:
``SPARSE_K_CUDA`` unset or ``1``, an sm_90 GPU with nvcc, the kernel's extension not failed to build
in this process (``mark_build_failed``).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..layouts.geometry import decode_geometry, plain_geometry
from .cuda.contract import (
    LISTED_CUDA_PATTERNS,
    decode_call_ok,
    listed_call_ok,
    structured_bwd_call_ok,
    structured_call_ok,
    token_call_ok,
)
from .pattern_codes import structured_pattern

__all__ = [
    "CUDA_ENV", "KERNELS", "Capability", "Launch", "Plan", "Tiles", "bigbird_cuda", "bigbird_tiles", "capability",
    "cuda_enabled",
    "TOKEN_DECODE_BLOCK_N", "decode_config", "mark_build_failed", "plan_backend", "plan_backward", "plan_decode", "plan_forward", "plan_tiles",
    "SMALL_BLOCK_MAX", "record", "recording", "selection_prefill_config", "split_count", "structured_launch", "tile_config",
]

#: Environment switch: "1" (default) lets the CUDA kernels take the calls they compute, "0" never.
CUDA_ENV = "SPARSE_K_CUDA"

#: Kernel name -> (what it computes, the CUDA extension it needs or None). ``plan_backend`` names a
#: backend (the first three, or another registered backend); the launch plans name the others.
KERNELS = {
    "reference": ("exact dense-mask attention, float64 inside (reference)", None),
    "torch": ("the PyTorch path, block by block (torch_path)", None),
    "triton": ("the kernel backend: plan_forward / plan_backward name each launch's kernel (triton.backend)", None),
    "cuda_sm90_structured": ("Hopper CUDA forward, dense / sliding_window / streaming / block_diagonal "
                             "(cuda.structured)", "forward"),
    "cuda_sm90_listed": ("Hopper CUDA forward over a block layout of 128x128 tiles, bigbird (cuda.structured)",
                         "forward"),
    "cuda_sm90_token": ("Hopper CUDA forward, token layout + static part (cuda.token)", "token"),
    "cuda_sm90_decode": ("Hopper CUDA decode step, token layout + static part (cuda.decode)", "decode"),
    "cuda_sm90_structured_bwd": ("Hopper CUDA backward, dense / sliding_window / streaming (cuda.structured_bwd)",
                                 "backward"),
    "triton_structured": ("Triton forward, arithmetic tile ranges (triton.structured)", None),
    "triton_layout": ("Triton forward over a block layout (triton.fwd)", None),
    "triton_token": ("Triton forward over a block layout plus a token layout (triton.fwd)", None),
    "triton_split_kv": ("Triton split-KV forward, splits merged in the kernel or by combine_splits (triton.fwd)",
                        None),
    "triton_structured_bwd": ("Triton backward, arithmetic tile ranges (triton.structured_bwd)", None),
    "triton_layout_bwd": ("Triton backward over a block layout (triton.bwd)", None),
}

_BUILD_FAILED: set[str] = set()  # CUDA extensions ("forward", "backward", "token", "decode") that failed to build


@dataclass(frozen=True, slots=True)
class Plan:
    """The decision for one launch: ``entry`` ("forward", "decode" or "backward"), ``kernel`` (a key of
    ``KERNELS``) and ``reason``, a sentence saying why this kernel and not the faster one."""

    entry: str
    kernel: str
    reason: str

    @property
    def cuda(self) -> bool:
        """Whether the kernel is a Hopper CUDA kernel."""
        return self.extension is not None

    @property
    def extension(self) -> str | None:
        """The CUDA extension the kernel needs built ("forward", "backward", "token", "decode"), or None."""
        return KERNELS.get(self.kernel, ("", None))[1]


@functools.lru_cache(maxsize=256)
def _plan(entry: str, kernel: str, reason: str) -> Plan:
    return Plan(entry, kernel, reason)  # a handful of distinct plans: made once each (decode calls are short)


@dataclass(frozen=True)
class Capability:
    """What the device offers the CUDA kernels: ``device_ok`` an sm_90 GPU with nvcc to build them
    (``device_note`` says why not), ``enabled`` the ``SPARSE_K_CUDA`` switch, ``failed`` the extensions
    that failed to build in this process."""

    device_ok: bool
    enabled: bool = True
    failed: frozenset = field(default_factory=frozenset)
    device_note: str = "not an sm_90 GPU with nvcc"

    def refusal(self, extension: str) -> str | None:
        """None when a kernel of ``extension`` may run here, else why not."""
        if extension in self.failed:
            return f"the CUDA {extension} extension failed to build in this process"
        if not self.enabled:
            return f"{CUDA_ENV}=0"
        if not self.device_ok:
            return self.device_note
        return None


def cuda_enabled() -> bool:
    """``SPARSE_K_CUDA``: unset or "1" -> True, "0" -> False; any other value is a ValueError."""
    value = os.environ.get(CUDA_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{CUDA_ENV}={value!r}: allowed are '1' (default: use the Hopper CUDA kernels where they "
                         "apply) and '0'")
    return value == "1"


def capability(device) -> Capability:
    """The ``Capability`` of ``device`` in this process (reads ``SPARSE_K_CUDA`` for CUDA devices)."""
    dev = torch.device(device)
    failed = frozenset(_BUILD_FAILED)
    if dev.type != "cuda":
        return Capability(device_ok=False, failed=failed, device_note=f"tensors on {dev.type} (the CUDA kernels need "
                                                                      "an sm_90 GPU)")
    from .cuda.build import sm90_available

    enabled = cuda_enabled()
    return Capability(device_ok=enabled and sm90_available(dev), enabled=enabled, failed=failed)


def mark_build_failed(extension: str) -> None:
    """Remember that ``extension`` failed to build: later plans keep its calls on Triton."""
    _BUILD_FAILED.add(extension)


class Launch(NamedTuple):
    """One attention launch as the plan reads it. Tensors are read for shapes, strides, dtypes and data
    pointers only (CPU and meta tensors answer too); ``geometry`` is a ``RowGeometry`` or the custom
    op's namespace, whose host offsets (``host``) say whether it is plain, never a device read.

    ``structured``: force (True) or forbid (False) the arithmetic-tile kernels (None: where the rule
    allows). ``cuda``: False keeps the launch off the CUDA kernels. ``triton_tuned``: a Triton tuning
    argument was given (the Triton kernel runs, as tuned). ``sel_fast``: the Triton token loop's option,
    given (not None) only to time that loop: the token and decode launches stay on Triton. ``layout``: the
    launch's block layout (``BlockLayout`` or the custom op's namespace), read by the listed CUDA forward."""

    q: Any
    k: Any
    v: Any
    geometry: Any
    pattern_id: int
    causal: bool
    selection: Any = None
    pack: int = 1
    num_splits: int = 1
    softcap: float | None = None
    sink_logits: Any = None
    key_mask: Any = None
    out: Any = None
    structured: bool | None = None
    cuda: bool | None = None
    triton_tuned: bool = False
    sel_fast: Any = None
    layout: Any = None


class _Cap:
    """The capability, read from the device on first use (only launches that reach a CUDA rule ask)."""

    def __init__(self, given: Capability | None, q):
        self.value, self.q = given, q

    def refusal(self, extension: str) -> str | None:
        if self.value is None:
            self.value = capability(self.q.device)
        return self.value.refusal(extension)


class _CudaRule(NamedTuple):
    """How a CUDA kernel refuses a launch: ``extension`` it needs built, ``token`` a token-layout kernel
    (``sel_fast`` keeps the launch on Triton), ``own_output`` it writes an output it allocates (no
    caller view), ``geometry`` the host rule on the row offsets it needs (``plain_geometry`` /
    ``decode_geometry``) passed to the contract check as ``geometry_arg``, and the two texts of a
    failed contract check: ``geometry_text`` when the geometry failed, ``contract`` otherwise."""

    extension: str
    token: bool
    own_output: bool
    geometry: Any
    geometry_arg: str
    geometry_text: str
    contract: str


_NOT_PLAIN = "geometry not plain self-attention"
_STRUCTURED_RULE = _CudaRule(
    "forward", False, True, plain_geometry, "plain_geometry",
    f"{_NOT_PLAIN} (padding, q_start, Sq != Skv, or offsets known on the device only)",
    "outside the CUDA kernel's contract (dense / sliding_window / streaming / block_diagonal, bf16 / fp16, D = 64 or "
    "128, Hq % Hkv == 0, q / k / v views with unit last stride and 16-byte multiple strides)")
_LISTED_RULE = _CudaRule(
    "forward", False, True, plain_geometry, "plain_geometry",
    f"{_NOT_PLAIN} (padding, q_start, Sq != Skv, or offsets known on the device only)",
    "outside the CUDA listed kernel's contract (causal bigbird over a block layout of 128x128 tiles, bf16 / fp16, "
    "D = 64 or 128, Hq % Hkv == 0, q / k / v views with unit last stride and 16-byte multiple strides)")
_DECODE_RULE = _CudaRule(
    "decode", True, True, decode_geometry, "decode_geometry",
    "not a plain decode step (query at key Skv - 1, every key valid, offsets known on the host)",
    "outside the CUDA decode kernel's contract (static part sliding_window / streaming, bf16 / fp16, D = 128, "
    "Hq / Hkv in 1, 2, 4, 8, 16-byte aligned k / v rows, int32 selection)")
_TOKEN_RULE = _CudaRule(
    "token", True, True, plain_geometry, "plain_geometry", _NOT_PLAIN,
    "outside the CUDA token kernel's contract (static part sliding_window / streaming, query_block a multiple of "
    "128, bf16 / fp16, D = 64 or 128, TMA views, int32 selection)")
_BACKWARD_RULE = _CudaRule(
    "backward", False, False, plain_geometry, "plain_geometry", _NOT_PLAIN,
    "outside the CUDA backward's contract (dense / sliding_window / streaming, bf16 / fp16, D = 64 or 128, TMA "
    "views of q / k / v / dO, lse (B, Hq, S) float32)")


def _caller_refusal(launch: Launch, token: bool) -> str | None:
    if launch.cuda is False:
        return "CUDA switched off for this launch (cuda=False)"
    if launch.triton_tuned:
        return "a Triton tuning argument was given"
    if token and launch.sel_fast is not None:
        return "sel_fast was given (a Triton token-loop option)"
    return None


def _call_refusal(launch: Launch, geometry_ok: bool, geometry_text: str) -> str | None:
    if not bool(launch.causal):
        return "not causal"
    if not geometry_ok:
        return geometry_text
    if launch.softcap is not None or launch.sink_logits is not None or launch.key_mask is not None:
        return "softcap, sink logits or a key mask"
    return None


def _cuda_refusal(launch: Launch, cap: _Cap, rule: _CudaRule, call_ok, *tensors) -> str | None:
    """None when the CUDA kernel of ``rule`` may take ``launch``, else why not, checked in this order:
    the caller's switches, the device's capability, a caller-provided output view, then the kernel's
    contract ``call_ok(*tensors, ...)`` (``cuda.contract``; asked last, it reads shapes and strides)."""
    why = _caller_refusal(launch, rule.token) or cap.refusal(rule.extension)
    if why is None and rule.own_output and launch.out is not None:
        why = "a caller-provided output view"
    if why is None:
        geometry_ok = rule.geometry(launch.geometry, launch.q.shape[2], launch.k.shape[2])
        if not call_ok(*tensors, pattern_id=launch.pattern_id, causal=bool(launch.causal), softcap=launch.softcap,
                       sink_logits=launch.sink_logits, key_mask=launch.key_mask, **{rule.geometry_arg: geometry_ok}):
            why = _call_refusal(launch, geometry_ok, rule.geometry_text) or rule.contract
    return why


def structured_launch(launch: Launch) -> bool:
    """Whether the forward runs on the arithmetic-tile (structured) kernels: ``Launch.structured`` when
    given, else the pattern rule (``pattern_codes.structured_pattern``) with one query head per
    program and one split."""
    if launch.structured is not None:
        return bool(launch.structured)
    return launch.pack == 1 and launch.num_splits == 1 and structured_pattern(launch.pattern_id, launch.causal,
                                                                              launch.selection)


def plan_forward(launch: Launch, cap: Capability | None = None) -> Plan:
    """The kernel of a forward launch (module docstring; a launch of one query per row is a decode
    step: ``plan_decode``). ``cap``: the device's capability (default: read from q's device)."""
    if launch.q.shape[2] == 1:
        return plan_decode(launch, cap)
    return _forward(launch, _Cap(cap, launch.q), "forward")


def plan_decode(launch: Launch, cap: Capability | None = None) -> Plan:
    """The kernel of a decode step (``Sq == 1``; entry "decode"): the rules of ``plan_forward``, where a
    token-layout step that is not a structured launch may take the CUDA decode kernel (any ``pack`` /
    ``num_splits``: it splits on its own). ValueError for a launch with ``Sq != 1``."""
    if launch.q.shape[2] != 1:
        raise ValueError(f"plan_decode: a decode step has one query per row (Sq == 1), got Sq={launch.q.shape[2]}")
    return _forward(launch, _Cap(cap, launch.q), "decode")


def _forward(launch: Launch, cap: _Cap, entry: str) -> Plan:
    if structured_launch(launch):
        why = _cuda_refusal(launch, cap, _STRUCTURED_RULE, structured_call_ok, launch.q, launch.k, launch.v)
        if why is None:
            return _plan(entry, "cuda_sm90_structured", "plain causal self-attention inside the CUDA contract")
        return _plan(entry, "triton_structured", f"structured pattern; not the CUDA kernel: {why}")
    prior = None
    if (launch.pattern_id in LISTED_CUDA_PATTERNS and launch.selection is None and launch.layout is not None
            and not getattr(launch.layout, "structured_decode", False)
            and launch.pack == 1 and launch.num_splits == 1 and launch.q.shape[2] > 1):
        why = _cuda_refusal(launch, cap, _LISTED_RULE, listed_call_ok, launch.q, launch.k, launch.v, launch.layout)
        if why is None:
            return _plan(entry, "cuda_sm90_listed", "bigbird over 128x128 tiles inside the CUDA contract")
        prior = f"not the CUDA listed kernel: {why}"
    if launch.selection is not None and launch.q.shape[2] == 1:
        why = _cuda_refusal(launch, cap, _DECODE_RULE, decode_call_ok, launch.q, launch.k, launch.v, launch.selection)
        if why is None:
            return _plan(entry, "cuda_sm90_decode", "token-layout decode step inside the CUDA contract")
        prior = f"not the CUDA decode kernel: {why}"
    return _token_or_layout(launch, cap, entry, prior)


def _token_or_layout(launch: Launch, cap: _Cap, entry: str, prior: str | None) -> Plan:
    sel = launch.selection
    if sel is not None and launch.num_splits == 1:
        why = _cuda_refusal(launch, cap, _TOKEN_RULE, token_call_ok, launch.q, launch.k, launch.v, sel)
        if why is None:
            return _plan(entry, "cuda_sm90_token", "token-layout prefill inside the CUDA contract")
        prior = f"{prior + '; ' if prior else ''}not the CUDA token kernel: {why}"
    if launch.num_splits > 1:
        kernel, what = "triton_split_kv", f"{launch.num_splits} key splits"
    elif sel is not None:
        kernel, what = "triton_token", "a token layout, one split"
    else:
        kernel, what = "triton_layout", "not a structured pattern launch (pattern, pack or splits)"
    return _plan(entry, kernel, f"{what}{'; ' + prior if prior else ''}")


def plan_backward(launch: Launch, do, out, lse, cap: Capability | None = None) -> Plan:
    """The kernel of a backward launch: ``do``, ``out`` ``(B, Hq, Sq, D)`` and the forward's ``lse``
    ``(B, Hq, Sq)`` float32 beside the forward's ``launch`` (``triton_tuned``: ``num_warps`` /
    ``num_stages`` given)."""
    if launch.structured if launch.structured is not None else structured_pattern(
            launch.pattern_id, launch.causal, launch.selection):
        why = _cuda_refusal(launch, _Cap(cap, launch.q), _BACKWARD_RULE, structured_bwd_call_ok, do, launch.q, launch.k,
                            launch.v, out, lse)
        if why is None:
            return _plan("backward", "cuda_sm90_structured_bwd", "plain causal self-attention inside the CUDA contract")
        return _plan("backward", "triton_structured_bwd", f"structured pattern; not the CUDA backward: {why}")
    return _plan("backward", "triton_layout_bwd", "not a structured pattern launch (pattern or token layout)")


def plan_backend(requested: str, auto_order, why) -> Plan:
    """The backend of a ``sparse_attention`` call (entry "backend"; module docstring).

    Args:
        requested: ``"auto"``, ``"reference"``, ``"torch"`` or a registered kernel backend.
        auto_order: the registered kernel backends in ``"auto"``'s order of preference.
        why: ``why(name)`` is None when backend ``name`` can run the call, else a short reason (asked
            lazily, in order: a backend's check may cost a host read).

    Runs inside ``torch.compile``d models (the API is traced): plain ``Plan`` objects, no cache.
    """
    if requested in ("reference", "torch"):
        return Plan("backend", requested, f"backend={requested!r} requested")
    if requested == "auto":
        reasons = []
        for name in auto_order:
            reason = why(name)
            if reason is None:
                return Plan("backend", name, "auto: the first kernel backend that runs the call")
            reasons.append(f"{name}: {reason}")
        return Plan("backend", "torch", f"auto: {'; '.join(reasons) or 'no kernel backend registered'}")
    reason = why(requested)
    if reason is not None:
        return Plan("backend", "torch", f"backend {requested!r} cannot run this call ({reason})")
    return Plan("backend", requested, f"backend={requested!r} requested")


@dataclass(frozen=True, slots=True)
class Tiles:
    """The tiles of the Triton backend's launch for a call: ``block_q`` query rows per head and
    ``block_k`` keys per tile (the layout's blocks), ``pack`` query heads per program (``BLOCK_M =
    block_q * pack``), ``decode`` a decode-style launch (split keys; a ``DecodeLayout`` where the
    pattern allows), ``bigbird_rule`` a bigbird launch over tiles that straddle its blocks (its rule
    evaluated in the partial tiles: ``bigbird_rule_tiles``), and ``reason``."""

    block_q: int
    block_k: int
    pack: int
    decode: bool
    reason: str
    bigbird_rule: bool = False


def plan_tiles(*, q_len: int, group: int, head_dim: int, device_type: str, need_grad: bool, selection: bool,
               bigbird_block: int | None = None, bigbird_cuda: bool = False, query_block: int | None = None) -> Tiles:
    """The tiles of a call (module docstring): ``group = Hq // Hkv``, ``need_grad`` whether autograd will
    ask for a backward, ``selection`` whether a token layout is fused (``query_block``: its selection block, None
    when unknown), ``bigbird_block`` bigbird's block (None for other patterns), ``bigbird_cuda`` whether the CUDA
    listed forward takes it (``bigbird_cuda``)."""
    if bigbird_block is not None:
        bq, bk = bigbird_tiles(bigbird_block, head_dim, device_type, need_grad, q_len, cuda=bigbird_cuda)
        why = "the CUDA listed forward's 128x128 tiles" if (bq, bk) == (128, 128) and bigbird_cuda else \
            "tiles that divide its block"
        return Tiles(bq, bk, 1, False, f"bigbird: {why}")
    if q_len <= 16 and not need_grad:
        rows, pack, bn = decode_config(q_len, group, device_type, head_dim, selection=selection)
        return Tiles(rows, bn, pack, True,
                     f"decode step ({q_len} queries, no gradient): {pack} heads packed, keys split")
    if selection and not need_grad:
        rows, pack, bn = selection_prefill_config(group, device_type, head_dim, query_block)
        return Tiles(rows, bn, pack, False, f"token-layout prefill without gradient: {pack} heads packed, {rows} rows "
                                            f"a head (query blocks of {query_block})")
    bm, bn = tile_config(head_dim, device_type, need_grad)
    return Tiles(bm, bn, 1, False, "prefill with gradients" if need_grad else "prefill")


def tile_config(head_dim: int, device_type: str, need_grad: bool) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)`` of the prefill / training kernels."""
    if device_type != "cuda":
        return 16, 16
    if need_grad:
        return (64, 64) if head_dim <= 128 else (32, 32)
    return (128, 128) if head_dim <= 128 else (64, 64)


#: Key tile of a decode step that gathers a token layout's keys on the GPU (``decode_config``). Compiled for
#: sm_90 (triton 3.6, 4 warps, D=128, BLOCK_M=16, SparseK weights, key mask, no index prefetch: the split-KV
#: default of ``triton.fwd.layout_forward``), the split-KV kernel with a token layout spills 104 bytes a thread
#: with 64-key tiles and nothing with 32-key tiles; still, on a model's StaticCache step the 64-key tiles are
#: faster (``scripts/tune_decode.py --part static``: B=1 23-25 against 34 us a launch, B=8 127 against 308 us;
#: docs/decode.md), since half the tiles mean half the dependent index loads. Set this to 32 to run the others.
TOKEN_DECODE_BLOCK_N = 64


def decode_config(q_len: int, group: int, device_type: str, head_dim: int, selection: bool = False
                  ) -> tuple[int, int, int]:
    """``(rows per head, heads packed, BLOCK_N)`` of the decode kernel (``BLOCK_M = rows * pack``);
    ``selection``: a token layout is fused (its gathered keys run ``TOKEN_DECODE_BLOCK_N``-key tiles)."""
    rows = _pow2_at_least(q_len)
    min_m = 16
    max_m = 128 if head_dim <= 128 else 64
    # Pack the largest power of two of heads that divides the group, so BLOCK_M = rows * pack stays a
    # power of two (tl.arange needs one); a group of 3 (SmolLM2: 9 query heads, 3 KV heads) packs 1.
    pack = 1
    while group % (pack * 2) == 0 and rows * pack * 2 <= max_m:
        pack *= 2
    if rows * pack < min_m:
        rows = min_m // pack
    # 64-key tiles (scripts/tune_decode.py; docs/history.md): with 4 warps and 3 stages a program needs
    # 70 KB of shared memory, so 2-3 programs share an SM; a window runs about as fast as with 128-key tiles.
    # Gathered (token-layout) keys: TOKEN_DECODE_BLOCK_N.
    block_n = 16 if device_type != "cuda" else (TOKEN_DECODE_BLOCK_N if selection else 64)
    return rows, pack, block_n


def selection_prefill_config(group: int, device_type: str, head_dim: int, query_block: int | None = None
                             ) -> tuple[int, int, int]:
    """``(rows per head, heads packed, BLOCK_N)`` of an inference prefill with a token layout.

    ``BLOCK_M = rows * pack = 128``: the query heads of a KV group share every gathered K/V tile
    (GQA packing) and 64-key tiles pipeline 3 stages deep, so the index loads of the gathered tiles
    run ahead too (faster on the H100 than one head per program with 128-key tiles and 2 stages;
    ``scripts/tune_decode.py --part token``; docs/history.md). Used at D = 128 and 64, where they were measured
    (docs/benchmarks.md, "the token-layout forward at D = 64"); other head dims keep the prefill tiles.

    A tile walks the key list of every selection block its rows touch with all its rows (the other blocks' rows
    masked): with selection blocks (``query_block``) shorter than ``SMALL_BLOCK_MAX`` queries, ``BLOCK_M`` is four
    blocks' rows (``4 * query_block * pack``) rounded up to a power of two, within [16, 64] (per-query selection,
    ``query_block`` 1, a group of 3: 16 rows, 2.5x faster than 128 on the H100; ``scripts/tune_decode.py --part
    token_blocks``, docs/selection.md)."""
    if device_type != "cuda" or head_dim not in (64, 128):
        bm, bn = tile_config(head_dim, device_type, False)
        return bm, 1, bn
    pack = 1
    while group % (pack * 2) == 0 and pack * 2 <= 4:
        pack *= 2
    if query_block is not None and query_block < SMALL_BLOCK_MAX:
        return min(64, max(16, _pow2_at_least(4 * query_block * pack))) // pack, pack, 64
    return 128 // pack, pack, 64


#: Selection blocks shorter than this many queries get query tiles of at most 64 rows, about four blocks tall
#: (``selection_prefill_config``); at 64 and above the 128-row tiles stay (docs/selection.md: at ``query_block`` 64
#: the 64-row tile was as fast or faster in the two head shapes timed, with a window of 256 only).
SMALL_BLOCK_MAX = 64


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def bigbird_tiles(block: int, head_dim: int, device_type: str, need_grad: bool, q_len: int,
                  cuda: bool = False) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)`` of bigbird on the layout path: tiles that divide the block (a tile then
    lies in one block pair, allowed or not as a whole). ``cuda`` (``bigbird_cuda`` holds): 128x128, the
    tiles of the CUDA listed forward. Prefill without gradients on the GPU with blocks of 128 or more runs
    64x64 tiles on Triton (two programs per SM; on the H100 at least as fast as 128x128 tiles and faster
    than packing the query heads of a KV group in one program; docs/history.md); otherwise the block itself."""
    if cuda and device_type == "cuda" and not need_grad and q_len > 16 and block % 128 == 0 and head_dim in (64, 128):
        return 128, 128
    if device_type == "cuda" and not need_grad and q_len > 16 and block >= 128 and block % 64 == 0 and head_dim <= 128:
        return 64, 64
    return block, block


def bigbird_rule_tiles(block: int, device_type: str) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)`` of a bigbird call whose block tiles cannot serve it (rows off its blocks, e.g. a
    left-padded batch, or a block that is no tile size; no gradient): powers of two no wider than the block (a
    query tile then spans at most two query blocks, a key tile at most two key blocks: what the kernel's rule,
    ``triton.fwd._bigbird_ok``, evaluates), at most 64 on a GPU (the layout path's bigbird prefill tiles) and 16
    elsewhere (the interpreter's)."""
    cap = min(block, 64 if device_type == "cuda" else 16)
    tile = 16
    while tile * 2 <= cap:
        tile *= 2
    return tile, tile


def bigbird_cuda(block: int, causal: bool, q, k, v, geometry, need_grad: bool, cap: Capability | None = None) -> bool:
    """Whether a bigbird call (``block``, ``causal``) should build its layout with the 128x128 tiles of the CUDA
    listed forward: an eager inference prefill (no gradient, more than 16 queries, not inside a ``torch.compile``
    trace), causal, blocks a multiple of 128, the plain geometry, bf16 / fp16 ``q, k, v`` alike with D = 64 or 128 and
    ``Sq == Skv``, CUDA allowed on the device (``cap``, default read from q's device). Shapes and dtypes only (no
    data pointer): the launch's plan checks the whole contract (``listed_call_ok``), and a launch it refuses runs
    the Triton layout kernel on the same tiles."""
    if need_grad or not causal or block % 128 or q.shape[2] <= 16 or torch.compiler.is_compiling():
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if q.shape[-1] not in (64, 128) or k.shape[-1] != q.shape[-1] or v.shape != k.shape:
        return False
    if k.shape[1] < 1 or q.shape[1] % k.shape[1]:
        return False
    if not plain_geometry(geometry, q.shape[2], k.shape[2]):
        return False
    return (cap if cap is not None else capability(q.device)).refusal("forward") is None


def split_count(programs: int, max_tiles: int, device, gathered: bool = False) -> int:
    """Split-KV factor of a decode launch of ``programs`` (batch x KV heads x packs x query tiles).

    One wave: ``SMs // programs`` splits for contiguous key tiles (longer runs per program win), twice
    that when selected keys are gathered (each gathered tile waits on its index load; more programs
    hide it). Swept on the H100 with ``scripts/tune_decode.py --part decode`` (B=8, 128K cache; numbers
    in docs/history.md)."""
    if device.type != "cuda":
        return max(1, min(max_tiles, 3))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    waves = 2 if gathered else 1
    return max(1, min(max_tiles, waves * sms // max(1, programs), 64))


_RECORDERS: list[list[Plan]] = []


@contextlib.contextmanager
def recording():
    """Collect the plans of what runs inside the ``with`` block, in order: each kernel launch
    (``dispatch``) and each call the API runs on the PyTorch path or the reference (``plan_backend``)."""
    seen: list[Plan] = []
    _RECORDERS.append(seen)
    try:
        yield seen
    finally:
        _RECORDERS.remove(seen)


def record(plan: Plan) -> None:
    """Called by ``dispatch`` for each launch and by the API for each reference / PyTorch-path call."""
    for seen in _RECORDERS:
        seen.append(plan)

