"""Kernel-hub packaging: build.toml, scripts/build_kernel.py, loading through ``kernels``,
and ``attn_implementation="<org>/sparse-k"`` against ``attn_implementation="sparse_k"``.

Everything is built into pytest's temporary directories and loaded offline (``LOCAL_KERNELS``,
``HF_HUB_OFFLINE=1``); nothing is written into the repository. Runs with kernels 0.16 and 0.17; the
Transformers route needs the kernels range of the installed Transformers (5.23+ want >= 0.18.2).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import sparse_k as sk
import torch

kernels = pytest.importorskip("kernels")

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]

#: Keys of kernel-builder's edition-5 build.toml schema, from huggingface/kernels
#: kernels-data/src/config/v5.rs (commit 8ac69fc542a4306eade0759ef7c45b4f2ae57df0): the structs
#: General, Hub, CudaGeneral, NeuronGeneral, TpuGeneral, XpuGeneral, Torch, TorchNoarch, TvmFfi and
#: Kernel, all `deny_unknown_fields`. TorchNoarch has no kebab-case renaming, hence its snake_case keys.
EDITION5_SCHEMA = {
    "general": {"name", "version", "edition", "license", "upstream", "source", "backends", "cuda", "hub",
                "kernel-depends", "neuron", "python-depends", "tpu", "xpu"},
    "general.hub": {"repo-id", "branch"},
    "general.cuda": {"minver", "maxver", "kernel-depends", "python-depends"},
    "general.neuron": {"kernel-depends", "python-depends"},
    "general.tpu": {"python-depends"},
    "general.xpu": {"kernel-depends", "python-depends"},
    "torch": {"include", "minver", "maxver", "pyext", "src", "stable-abi", "cxx-flags"},
    "torch-noarch": {"pyext", "cuda_capabilities", "rocm_archs"},
    "tvm-ffi": {"include", "pyext", "src", "cxx-flags"},
    "kernel.*": {"backend", "cxx-flags", "depends", "include", "src", "cuda-capabilities", "cuda-flags",
                 "cuda-minver", "rocm-archs", "hip-flags", "sycl-flags"},
}
EDITION5_BACKENDS = {"cann", "cpu", "cuda", "metal", "neuron", "rocm", "tpu", "xpu"}
FRAMEWORKS = ("torch", "torch-noarch", "tvm-ffi")


def schema_violations(cfg: dict) -> list[str]:
    """Every key of ``cfg`` outside ``EDITION5_SCHEMA`` (and a missing/duplicate framework table)."""
    problems = [f"unknown table [{k}]" for k in cfg if k not in {"general", "kernel", *FRAMEWORKS}]
    frameworks = [f for f in FRAMEWORKS if f in cfg]
    if len(frameworks) != 1:
        problems.append(f"needs exactly one framework table of {FRAMEWORKS}, has {frameworks}")
    general = cfg.get("general", {})
    problems += [f"unknown key general.{k}" for k in general if k not in EDITION5_SCHEMA["general"]]
    for sub in ("hub", "cuda", "neuron", "tpu", "xpu"):
        table = general.get(sub, {})
        problems += [f"unknown key general.{sub}.{k}" for k in table if k not in EDITION5_SCHEMA[f"general.{sub}"]]
    for fw in frameworks:
        problems += [f"unknown key {fw}.{k}" for k in cfg[fw] if k not in EDITION5_SCHEMA[fw]]
    for name, kernel in cfg.get("kernel", {}).items():
        problems += [f"unknown key kernel.{name}.{k}" for k in kernel if k not in EDITION5_SCHEMA["kernel.*"]]
    return problems


BUILD_SCRIPT = Path("scripts") / "build_kernel.py"


def run_builder(root: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
    """``python <root>/scripts/build_kernel.py --out <out> <flags>``: the builder builds the repository it
    sits in (``root``)."""
    return subprocess.run([sys.executable, str(root / BUILD_SCRIPT), "--out", str(out), *flags],
                          capture_output=True, text=True, timeout=60, check=False)


def repo_copy(tmp_path: Path, build_toml: str | None = None, sources: bool = True) -> Path:
    """``tmp_path/repo``: the builder, ``build.toml`` (or the text ``build_toml``) and, with ``sources``,
    ``kernel_src/`` of this checkout."""
    root = tmp_path / "repo"
    (root / BUILD_SCRIPT).parent.mkdir(parents=True)
    shutil.copy(REPO / BUILD_SCRIPT, root / BUILD_SCRIPT)
    (root / "build.toml").write_text((REPO / "build.toml").read_text() if build_toml is None else build_toml)
    if sources:
        shutil.copytree(REPO / "kernel_src", root / "kernel_src", ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.fixture(scope="module")
def build_cfg():
    with open(REPO / "build.toml", "rb") as f:
        return tomllib.load(f)


@pytest.fixture(scope="module")
def repo_id(build_cfg) -> str:
    return build_cfg["general"]["hub"]["repo-id"]


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory) -> Path:
    """The hub layout of this checkout, built by the CLI into a temporary directory."""
    out = tmp_path_factory.mktemp("hub") / "sparse-k"
    proc = run_builder(REPO, out)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def hub(hub_dir):
    """The hub module as ``kernels.get_local_kernel`` loads it (the torch-cpu variant on this machine)."""
    return kernels.get_local_kernel(hub_dir)


def _metadata(hub_dir: Path, variant: str) -> dict:
    return json.loads((hub_dir / "build" / variant / "metadata.json").read_text())


def test_build_toml_holds_only_edition5_keys(build_cfg):
    assert schema_violations(build_cfg) == []
    general = build_cfg["general"]
    assert general["edition"] == 5 and general["name"] == "sparse-k" and isinstance(general["version"], int)
    assert {"cpu", "cuda"} <= set(general["backends"]) <= EDITION5_BACKENDS
    assert "torch-noarch" in build_cfg and "kernel" not in build_cfg
    assert general["hub"]["repo-id"].endswith("/sparse-k")
    mutated = json.loads(json.dumps(build_cfg))
    mutated["general"]["triton"] = True
    mutated["torch-noarch"]["cuda-capabilities"] = ["9.0"]
    assert schema_violations(mutated) == ["unknown key general.triton", "unknown key torch-noarch.cuda-capabilities"]


def test_build_toml_parses_with_kernels_own_schema(build_cfg, tmp_path):
    rust = pytest.importorskip("kernels._rust")
    if not hasattr(rust, "Build"):
        pytest.skip("this kernels release has no build.toml parser (kernels >= 0.17 has kernels._rust.Build)")
    build = rust.Build.open(REPO)
    assert sorted(str(b).lower() for b in build.general.backends) == sorted(
        str(rust.Backend.from_str(b)).lower() for b in build_cfg["general"]["backends"]
    )
    (tmp_path / "build.toml").write_text((REPO / "build.toml").read_text() + "\nfoo = 1\n")
    with pytest.raises(ValueError, match="foo"):
        rust.Build.open(tmp_path)


def test_build_script_rejects_what_kernel_builder_rejects(tmp_path):
    """A build.toml outside the edition-5 schema or the kernels allow-list fails with a message naming it,
    before anything is written; so does an output directory that would overwrite the repository."""
    text = (REPO / "build.toml").read_text()
    assert text.count("[general]\n") == 1 and text.count("\nedition = 5\n") == 1
    cases = {"typo": text.replace("[general]\n", "[general]\ntypo = 1\n"),
             "allow-list": text.replace("[general]\n", '[general]\npython-depends = ["triton"]\n'),
             "edition": text.replace("\nedition = 5\n", "\nedition = 4\n")}
    for i, (message, bad) in enumerate(cases.items()):
        root = repo_copy(tmp_path / str(i), bad, sources=False)
        proc = run_builder(root, tmp_path / str(i) / "out")
        assert proc.returncode == 2 and message in proc.stderr, (message, proc.stderr)
        assert not (tmp_path / str(i) / "out").exists()
    root = repo_copy(tmp_path / "whole")
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    proc = run_builder(root, root)
    assert proc.returncode == 2 and "overwrite the repository" in proc.stderr, proc.stderr
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before


def test_build_script_never_overwrites_a_foreign_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("not a kernel build")
    proc = run_builder(REPO, tmp_path)
    assert proc.returncode == 2 and "not empty" in proc.stderr, proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def _files(folder: Path) -> set[Path]:
    """Files under ``folder`` (relative), bytecode caches left out."""
    return {p.relative_to(folder) for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def _kernels_python_depends() -> dict:
    """kernels' table of the Python packages a kernel may depend on (``python_depends.json``: in the package
    up to kernels 0.18, in ``kernels/_internals`` from 0.19)."""
    root = Path(kernels.__file__).parent
    for rel in ("python_depends.json", "_internals/python_depends.json"):
        if (root / rel).is_file():
            return json.loads((root / rel).read_text())
    pytest.fail(f"kernels {kernels.__version__}: no python_depends.json under {root}")


def test_layout_matches_kernel_builder_noarch(hub_dir, build_cfg):
    general = build_cfg["general"]
    # Shipped: every file of kernel_src/ with an extension of pyext, except _ops.py (each variant gets its own).
    pyext = build_cfg["torch-noarch"].get("pyext", ["py"])
    shipped = {rel for rel in _files(REPO / "kernel_src") if rel.suffix[1:] in pyext and rel != Path("_ops.py")}
    assert Path("__init__.py") in shipped and Path("integrations/hub_attention.py") in shipped
    sources = {p.name for p in (REPO / "kernel_src" / "attention" / "cuda" / "csrc").iterdir()}
    assert {"structured_fwd_sm90.cu", "sm90_common.cuh", "sm90_torch.h", "decode_sm90.cpp"} <= sources
    assert {Path("attention/cuda/csrc") / name for name in sources} <= shipped  # the CUDA sources ship
    assert _files(hub_dir / "torch-ext" / "sparse_k") == shipped
    allowed = _kernels_python_depends()
    ids = set()
    for backend in general["backends"]:
        variant = hub_dir / "build" / f"torch-{backend}"
        assert _files(variant) == shipped | {Path("_ops.py"), Path("metadata.json"), Path("sparse_k", "__init__.py")}
        for rel in shipped:
            assert (variant / rel).read_bytes() == (REPO / "kernel_src" / rel).read_bytes(), rel
            assert (hub_dir / "torch-ext" / "sparse_k" / rel).read_bytes() == (variant / rel).read_bytes(), rel
        assert (variant / "sparse_k" / "__init__.py").is_file()
        meta = _metadata(hub_dir, f"torch-{backend}")
        assert meta["name"] == general["name"] and meta["version"] == general["version"]
        assert meta["license"] == general["license"] and meta["backend"]["type"] == backend
        assert meta["id"].startswith(f"_sparse_k_{backend}_") and meta["id"].isidentifier()
        for dep in meta["python-depends"]:
            assert dep in allowed["general"] or dep in allowed["backends"].get(backend, {}), dep
        assert "triton" not in meta["python-depends"]
        parsed = kernels.Metadata.read_from_file(variant / "metadata.json")
        assert parsed.id == meta["id"] and parsed.version == general["version"]
        ops_src = (variant / "_ops.py").read_text()
        assert f'_OPS_NAMESPACE = "{meta["id"]}"' in ops_src and "def add_op_namespace_prefix" in ops_src
        ids.add(meta["id"])
    assert len(ids) == len(general["backends"])
    card = (hub_dir / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: kernels\n")
    for needle in (general["hub"]["repo-id"], "flash_attn_forward", "Supported shapes", "Validation", "trust_remote_code"):
        assert needle in card
    assert tomllib.loads((hub_dir / "build.toml").read_text())["general"] == general


def test_every_variant_imports_as_kernels_imports_it(hub, hub_dir, build_cfg):
    """Each variant is a package named by its metadata id (how kernels imports it), on any machine: the one kernels
    picks here through kernels (the ``hub`` fixture; kernels >= 0.19 refuses a kernel module it did not load), the
    others the same way by hand."""
    for backend in build_cfg["general"]["backends"]:
        variant = hub_dir / "build" / f"torch-{backend}"
        meta = _metadata(hub_dir, f"torch-{backend}")
        module = sys.modules.get(meta["id"])
        if module is None:
            spec = importlib.util.spec_from_file_location(meta["id"], variant / "__init__.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[meta["id"]] = module
            spec.loader.exec_module(module)
        assert Path(module.__file__) == variant / "__init__.py"
        assert importlib.import_module(f"{meta['id']}._ops").add_op_namespace_prefix("f") == f"{meta['id']}::f"
        assert callable(module.flash_attn_forward) and module.supports_flash_attn()


def test_unique_id_follows_the_shipped_content(tmp_path):
    root = repo_copy(tmp_path)
    for out in ("a", "b"):
        proc = run_builder(root, tmp_path / out)
        assert proc.returncode == 0, proc.stderr
    header = root / "kernel_src" / "attention" / "cuda" / "csrc" / "sm90_common.cuh"  # a subfolder's file counts too
    header.write_text(header.read_text() + "\n")
    proc = run_builder(root, tmp_path / "c", "--repo-id", "some-org/sparse-k")
    assert proc.returncode == 0, proc.stderr
    first, again, changed = (tmp_path / d for d in "abc")
    ids = [_metadata(d, "torch-cpu")["id"] for d in (first, again, changed)]
    assert ids[0] == ids[1] != ids[2]
    assert "some-org/sparse-k" in (changed / "README.md").read_text()
    assert 'repo-id = "some-org/sparse-k"' in (changed / "build.toml").read_text()


def test_ops_namespace_is_the_variant_id(hub, hub_dir):
    ops = importlib.import_module(f"{hub.__name__}._ops")
    meta = _metadata(hub_dir, "torch-cpu")
    assert hub.__name__ == meta["id"]
    assert ops.add_op_namespace_prefix("double") == f"{meta['id']}::double"
    lib = torch.library.Library(meta["id"], "FRAGMENT")
    lib.define("double(Tensor x) -> Tensor")
    lib.impl("double", lambda x: 2 * x, "CompositeExplicitAutograd")
    x = torch.randn(5)
    torch.testing.assert_close(ops.ops.double(x), 2 * x)
    assert importlib.import_module("sparse_k._ops").add_op_namespace_prefix("double") == "sparse_k::double"


def _custom_op_names(path: Path) -> tuple[list[str], list[str]]:
    """(names passed through ``add_op_namespace_prefix``, literal qualified names) of the
    ``torch.library`` registrations (``custom_op``, ``triton_op``, ``define``) in ``path``."""
    prefixed, literal = [], []
    for node in ast.walk(ast.parse(path.read_text())):
        func = getattr(node, "func", None)
        name = getattr(func, "attr", getattr(func, "id", None))
        if not isinstance(node, ast.Call) or name not in ("custom_op", "triton_op", "define") or not node.args:
            continue
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            literal.append(arg.value)
        elif isinstance(arg, ast.Call) and getattr(arg.func, "id", getattr(arg.func, "attr", None)) == "add_op_namespace_prefix":
            prefixed.append(arg.args[0].value)
    return prefixed, literal


def test_custom_ops_of_the_pip_package_and_the_hub_build_coexist(hub):
    """Ops registered under a fixed name (``"sparse_k::op"``) would clash as soon as the pip package
    and a hub build share a process; ``_ops.add_op_namespace_prefix`` gives each its own namespace."""
    registering = []
    for path in sorted((REPO / "kernel_src").rglob("*.py")):
        prefixed, literal = _custom_op_names(path)
        assert literal == [], f"{path.name} registers {literal}: use _ops.add_op_namespace_prefix(...)"
        if not prefixed:
            continue
        module = ".".join(path.relative_to(REPO / "kernel_src").with_suffix("").parts)
        registering.append(module)
        importlib.import_module(f"sparse_k.{module}")
        importlib.import_module(f"{hub.__name__}.{module}")
        for name in prefixed:
            assert hasattr(torch.ops.sparse_k, name) and hasattr(getattr(torch.ops, hub.__name__), name), name
    assert "attention.ops" in registering, registering  # the walk reaches the subpackages


def test_transformers_takes_the_flash_attn_forward_route(hub):
    """Transformers registers a hub kernel with ``flash_attn_varlen_func`` as a FlashAttention drop-in
    (its own wrapper, dense unless told a window) and only otherwise ``flash_attn_forward``."""
    assert hasattr(hub, "flash_attn_forward") and hasattr(hub, "supports_flash_attn")
    assert {"flash_attn_forward", "supports_flash_attn"} <= set(hub.__all__)
    for name in ("flash_attn_varlen_func", "sparse_atten_func"):
        assert not hasattr(hub, name), (
            f"the hub module exposes `{name}`: Transformers would register it instead of flash_attn_forward and "
            "ignore config.sparse_attention; keep FlashAttention-style functions in a submodule"
        )


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _left_padding(batch: int, kv_len: int) -> torch.Tensor:
    mask = torch.ones(batch, kv_len, dtype=torch.bool)
    for b in range(1, batch):
        mask[b, : int(torch.randint(1, kv_len // 2, (1,)))] = False
    return mask


PATTERNS = [
    {"pattern": "streaming", "sinks": 3, "window": 9},
    {"pattern": "bigbird", "block": 4, "window_blocks": 1, "global_blocks": 1, "random_blocks": 1, "seed": 7},
    {"pattern": "dilated", "window": 4, "scales": 3},
]


@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: p["pattern"])
@pytest.mark.parametrize("sq,skv", [(45, 45), (7, 45), (1, 38)])
def test_hub_sparse_attention_equals_reference(hub, pattern, sq, skv):
    B, Hq, Hkv, D = 3, 4, 2, 16
    q, k, v = torch.randn(B, Hq, sq, D), torch.randn(B, Hkv, skv, D), torch.randn(B, Hkv, skv, D)
    mask = _left_padding(B, skv)
    out = hub.sparse_attention(q, k, v, dict(pattern), attention_mask=mask)
    geo = sk.row_geometry(B, sq, skv, mask)
    ref, _ = sk.reference_attention(q, k, v, sk.get_pattern(dict(pattern)), geo, scale=D**-0.5)
    ref32, _ = sk.reference_attention(q, k, v, sk.get_pattern(dict(pattern)), geo, scale=D**-0.5, dtype=torch.float32)
    # Tolerance from PyTorch's own float32 error on the same dense computation (x4), floored at the
    # core's fp32 bar of 1e-5: both errors are ~1e-7 and their ratio varies with the random draw.
    assert _rel_err(out, ref) <= max(4 * _rel_err(ref32, ref), 1e-5)


class _Attention(torch.nn.Module):
    """Stands in for a Transformers attention layer: what the attention function reads from it."""

    is_causal = True

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx


def _sdpa_mask(pad: torch.Tensor, q_len: int, q_start: int, kv_len: int) -> torch.Tensor:
    """Transformers' sdpa mask for causal attention over a padded cache: (B, 1, Sq, Skv) bool."""
    i = torch.arange(q_len)[:, None] + q_start
    j = torch.arange(kv_len)[None, :]
    return ((j <= i)[None] & pad[:, None, :kv_len])[:, None]


@pytest.mark.parametrize(
    "sq,filled,kv_len",
    [(33, 33, 33), (6, 40, 40), (1, 29, 29), (12, 12, 50), (1, 21, 50)],
    ids=["prefill", "chunk", "decode", "static-prefill", "static-decode"],
)
def test_flash_attn_forward_reduces_the_sdpa_mask(hub, sq, filled, kv_len):
    """Left padding, chunked prefill, decode and a StaticCache (``kv_len`` slots, ``filled`` written)."""
    B, Hq, Hkv, D = 3, 4, 2, 16
    cfg = {"pattern": "streaming", "sinks": 2, "window": 7}
    config = type("Config", (), {"sparse_attention": cfg})()
    pad = torch.zeros(B, kv_len, dtype=torch.bool)
    pad[:, :filled] = _left_padding(B, filled)
    q = torch.randn(B, Hq, sq, D)
    k, v = torch.randn(B, Hkv, kv_len, D), torch.randn(B, Hkv, kv_len, D)
    mask = _sdpa_mask(pad, sq, filled - sq, kv_len)
    out, weights = hub.flash_attn_forward(_Attention(config, 0), q, k, v, mask, scaling=0.3, dropout=0.0)
    assert weights is None and out.shape == (B, sq, Hq, D)
    geo = sk.row_geometry(B, sq, kv_len, pad, q_start=filled - sq)
    ref, _ = sk.reference_attention(q, k, v, sk.get_pattern(cfg), geo, scale=0.3)
    ref32, _ = sk.reference_attention(q, k, v, sk.get_pattern(cfg), geo, scale=0.3, dtype=torch.float32)
    assert _rel_err(out.transpose(1, 2), ref) <= 4 * _rel_err(ref32, ref) + 1e-6


def test_flash_attn_forward_reduces_each_sdpa_mask_once(hub, monkeypatch):
    """Transformers builds one sdpa mask per forward and layer type and hands it to every layer: the hub route
    reduces it (host reads, ``(B, Sq, Skv)`` temporaries) once per mask tensor, not once per layer, also when two
    layer types take turns; a new mask, or the same tensor changed in place, is reduced again."""
    module = importlib.import_module(f"{hub.__name__}.integrations.hub_attention")
    reductions, check = [], module._check_mask
    monkeypatch.setattr(module, "_check_mask", lambda *a: reductions.append(1) or check(*a))
    B, Hq, Hkv, S, D = 2, 4, 2, 14, 16
    config = type("Config", (), {"sparse_attention": {"pattern": "streaming", "sinks": 2, "window": 5}})()
    layers = [_Attention(config, i) for i in range(6)]
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(B, Hq, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[1, :4] = False
    full = _sdpa_mask(pad, S, 0, S)
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    sliding = full & (i - j < 8)  # a second layer type's mask, with its window (as Transformers passes it)

    def call(layer, mask):
        window = {"sliding_window": 8} if mask is sliding else {}
        return hub.flash_attn_forward(layer, q, k, v, mask, scaling=0.3, **window)[0]

    outs = [call(layer, full) for layer in layers]
    assert len(reductions) == 1
    turns = [call(layer, (full, sliding)[layer.layer_idx % 2]) for layer in layers]
    assert len(reductions) == 2
    assert all(torch.equal(out, outs[0]) for out in outs + turns[::2])
    assert all(torch.equal(out, turns[1]) for out in turns[1::2])
    pad[0, :3] = False  # the same tensor, changed in place: reduced again, and the change is seen
    full[0, :, :, :3] = False
    moved = hub.flash_attn_forward(layers[0], q, k, v, full, scaling=0.3)[0]
    assert len(reductions) == 3
    fresh = hub.flash_attn_forward(layers[0], q, k, v, _sdpa_mask(pad, S, 0, S), scaling=0.3)[0]
    assert torch.equal(moved, fresh) and not torch.equal(moved, outs[0])


def test_flash_attn_forward_reduces_each_inference_mask_once(hub, monkeypatch):
    """Under ``torch.inference_mode()`` the sdpa mask is an inference tensor (no version counter): it is still reduced
    once per forward through the layers, not once per layer; the next forward, which starts again at the first layer,
    reduces it again, so a change made in place in between (inside inference mode) is seen."""
    module = importlib.import_module(f"{hub.__name__}.integrations.hub_attention")
    reductions, check = [], module._check_mask
    monkeypatch.setattr(module, "_check_mask", lambda *a: reductions.append(1) or check(*a))
    B, Hq, Hkv, S, D = 2, 4, 2, 14, 16
    config = type("Config", (), {"sparse_attention": {"pattern": "streaming", "sinks": 2, "window": 5}})()
    layers = [_Attention(config, i) for i in range(6)]
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (Hq, Hkv, Hkv))
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[1, :4] = False
    with torch.inference_mode():
        mask = _sdpa_mask(pad, S, 0, S)
        outs = [hub.flash_attn_forward(layer, q, k, v, mask, scaling=0.3)[0] for layer in layers]
        assert len(reductions) == 1 and all(torch.equal(out, outs[0]) for out in outs)
        pad[0, :3] = False
        mask[0, :, :, :3] = False
        moved = [hub.flash_attn_forward(layer, q, k, v, mask, scaling=0.3)[0] for layer in layers]
        assert len(reductions) == 2
        fresh = hub.flash_attn_forward(layers[0], q, k, v, _sdpa_mask(pad, S, 0, S), scaling=0.3)[0]
        assert torch.equal(moved[-1], fresh) and not torch.equal(moved[-1], outs[0])


def _expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def test_flash_attn_forward_refuses_per_query_structure(hub):
    """A 4-D mask with per-query structure the causal pattern would drop raises ValueError, as on
    ``attn_implementation="sparse_k"``, instead of giving another answer than sdpa: two packed documents in one row
    (sdpa keeps them apart) and queries that see later keys. Only the layer's own window is checked: a sliding
    layer's mask (``sliding_window=`` passed, as Transformers does) runs and equals sdpa; a global layer given it
    raises."""
    B, Hq, Hkv, S, D = 1, 4, 2, 12, 16
    config = type("Config", (), {"sparse_attention": {"pattern": "dense"}})()
    layer = _Attention(config, 0)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (Hq, Hkv, Hkv))
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    doc = torch.arange(S) >= 5
    causal = (j <= i)[None, None]
    packed = causal & (doc[:, None] == doc[None, :])

    def sdpa(mask):
        out = torch.nn.functional.scaled_dot_product_attention(q, _expand_heads(k, Hq), _expand_heads(v, Hq), mask)
        return out.transpose(1, 2)

    unmasked, _ = hub.flash_attn_forward(layer, q, k, v, None)
    assert (sdpa(packed) - unmasked).abs().max() > 1e-2  # the documents change the answer
    additive = torch.zeros(B, 1, S, S).masked_fill(~packed, torch.finfo(torch.float32).min)
    for mask in (packed, additive):
        with pytest.raises(ValueError, match="hides earlier keys from some queries"):
            hub.flash_attn_forward(layer, q, k, v, mask)
    with pytest.raises(ValueError, match="later keys"):
        hub.flash_attn_forward(layer, q, k, v, causal | ((i == 3) & (j == 8)))
    with pytest.raises(ValueError, match="later keys"):
        hub.flash_attn_forward(layer, q, k, v, torch.ones(B, 1, S, S, dtype=torch.bool))
    sliding = causal & (i - j < 4)
    out, _ = hub.flash_attn_forward(layer, q, k, v, sliding, sliding_window=4)
    torch.testing.assert_close(out, sdpa(sliding), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="hides earlier keys from some queries"):
        hub.flash_attn_forward(layer, q, k, v, sliding)
    with pytest.raises(ValueError, match="hides earlier keys from some queries"):
        hub.flash_attn_forward(layer, q, k, v, packed & sliding, sliding_window=4)


def test_flash_attn_forward_takes_transformers_packed_and_chunked_masks(hub):
    """Transformers' own masks keep running: a packed row (``position_ids`` restart at 0; its sdpa mask keeps the
    sequences apart, its sliding masks do not) runs the sequences apart, and a chunked layer's mask of a left-padded
    batch (chunks counted from each row's first real token) equals the 2-D padding mask's answer."""
    Hq, Hkv, S, D = 4, 2, 12, 16
    config = type("Config", (), {"sparse_attention": {"pattern": "streaming", "sinks": 1, "window": 3}})()
    layer = _Attention(config, 0)
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, h, S, D, generator=g) for h in (Hq, Hkv, Hkv))
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    doc = torch.arange(S) >= 5
    packed = ((j <= i) & (doc[:, None] == doc[None, :]))[None, None]
    position_ids = torch.cat([torch.arange(5), torch.arange(7)])[None]

    def apart(**window):
        return torch.cat([hub.flash_attn_forward(layer, q[:, :, s], k[:, :, s], v[:, :, s], None, **window)[0]
                          for s in (slice(0, 5), slice(5, S))], 1)

    out, _ = hub.flash_attn_forward(layer, q, k, v, packed, position_ids=position_ids)
    torch.testing.assert_close(out, apart())
    sliding = ((j <= i) & (i - j < 6))[None, None]
    out, _ = hub.flash_attn_forward(layer, q, k, v, sliding, position_ids=position_ids, sliding_window=6)
    torch.testing.assert_close(out, apart(sliding_window=6))

    B, chunk = 2, 4
    config.layer_types, config.attention_chunk_size = ["chunked_attention"], chunk
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (Hq, Hkv, Hkv))
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[1, :3] = False
    first = torch.tensor([0, 3])[:, None, None]
    chunked = _sdpa_mask(pad, S, 0, S) & ((i - first) // chunk == (j - first) // chunk)[:, None]
    out, _ = hub.flash_attn_forward(layer, q, k, v, chunked)
    adapter = importlib.import_module(f"{hub.__name__}.integrations.transformers_adapter")
    want, _ = adapter.attention_forward(layer, q, k, v, pad)  # the 2-D mask: what "sparse_k" runs
    assert torch.equal(out[pad], want[pad])


def test_flash_attn_forward_reads_unmasked_padding_queries_as_padding(hub):
    """Transformers' older sdpa masks let left-padding queries attend every slot (``_unmask_unattended``, against
    NaNs): those rows say nothing about which keys are real, so the padding keys stay out and the answer on the real
    queries equals the one of today's mask (padding rows attend nothing), also for a row with one real query."""
    B, Hq, Hkv, S, D = 3, 4, 2, 10, 16
    config = type("Config", (), {"sparse_attention": {"pattern": "streaming", "sinks": 2, "window": 3}})()
    layer = _Attention(config, 0)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (Hq, Hkv, Hkv))
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[1, :4] = False
    pad[2, :9] = False
    today = _sdpa_mask(pad, S, 0, S)
    older = today | ~today.any(-1, keepdim=True)
    want, _ = hub.flash_attn_forward(layer, q, k, v, today)
    got, _ = hub.flash_attn_forward(layer, q, k, v, older)
    assert torch.equal(got[pad], want[pad])


def test_sdpa_mask_reduction_cases(monkeypatch):
    reduce = sk.integrations.hub_attention.sdpa_mask_to_key_mask
    assert reduce(None, 2, 9, 9) == (None, None)
    assert reduce(None, 2, 1, 30) == (None, None)
    key_mask, q_start = reduce(None, 2, 5, 30)  # empty StaticCache prefill: sdpa aligns top-left
    assert q_start is None and key_mask.shape == (2, 5) and bool(key_mask.all())
    pad = torch.ones(2, 20, dtype=torch.bool)
    pad[1, :6] = False
    key_mask, q_start = reduce(_sdpa_mask(pad, 20, 0, 20), 2, 20, 20)
    assert q_start is None and torch.equal(key_mask, pad)
    assert reduce(_sdpa_mask(torch.ones(2, 20, dtype=torch.bool), 4, 16, 20), 2, 4, 20) == (None, None)
    right = torch.ones(2, 20, dtype=torch.bool)
    right[1, 15:] = False  # right padding: queries 15.. of row 1 stop at key 14
    key_mask, q_start = reduce(_sdpa_mask(right, 20, 0, 20), 2, 20, 20)
    assert q_start is None and torch.equal(key_mask, right)
    additive = torch.zeros(2, 1, 20, 20).masked_fill(~_sdpa_mask(pad, 20, 0, 20), torch.finfo(torch.float32).min)
    assert torch.equal(reduce(additive, 2, 20, 20)[0], pad)
    uneven = torch.cat([_sdpa_mask(pad[:1], 3, 10, 20), _sdpa_mask(pad[1:], 3, 15, 20)])
    key_mask, q_start = reduce(uneven, 2, 3, 20)
    assert q_start.tolist() == [10, 15] and key_mask.shape == (2, 20)
    monkeypatch.setattr(sk.integrations.hub_attention, "_CHUNK_ELEMENTS", 7)  # one query row per step
    chunked_mask, chunked_start = reduce(uneven, 2, 3, 20)
    assert torch.equal(chunked_mask, key_mask) and torch.equal(chunked_start, q_start)
    bidirectional = _sdpa_mask(pad, 20, 0, 20).clone()
    bidirectional[:, :, 12, 15] = True
    with pytest.raises(ValueError, match="later keys"):
        reduce(bidirectional, 2, 20, 20)
    i, j = torch.arange(20)[:, None], torch.arange(20)[None, :]
    sliding = _sdpa_mask(pad, 20, 0, 20) & (i - j < 8)
    key_mask, q_start = reduce(sliding, 2, 20, 20, 8)  # the layer's own window: the keys past it may be hidden
    assert q_start is None and torch.equal(key_mask, pad)
    with pytest.raises(ValueError, match="hides earlier keys"):
        reduce(sliding, 2, 20, 20, 9)
    doc = (torch.arange(20) >= 7).long()
    packed = ((j <= i) & (doc[:, None] == doc[None, :]))[None, None]
    assert reduce(packed, 1, 20, 20, sequence_starts=(0, 7, 20)) == (None, None)  # the adapter runs them apart
    with pytest.raises(ValueError, match="hides earlier keys"):
        reduce(packed, 1, 20, 20)
    with pytest.raises(ValueError, match="hides earlier keys"):
        reduce(packed, 1, 20, 20, sequence_starts=(0, 9, 20))
    # Transformers' sliding masks ignore the packing: the sequences are run apart all the same.
    assert reduce((j <= i)[None, None] & (i - j < 4), 1, 20, 20, 4, sequence_starts=(0, 7, 20)) == (None, None)
    with pytest.raises(ValueError, match="4-D"):
        reduce(pad, 2, 20, 20)
    with pytest.raises(ValueError, match="does not fit"):
        reduce(_sdpa_mask(pad, 20, 0, 20), 2, 19, 21)
    with pytest.raises(TypeError, match="tensor"):
        reduce([[True]], 1, 1, 1)
    with pytest.raises(ValueError, match=r"`window` must be None or an int >= 1, got 0"):
        reduce(sliding, 2, 20, 20, 0)
    with pytest.raises(ValueError, match=r"`chunk` must be None or an int >= 1, got 2.0"):
        reduce(sliding, 2, 20, 20, 8, 2.0)
    with pytest.raises(ValueError, match=r"`sequence_starts` must be .* from 0 to Skv=20 .*got \(0, 7\)"):
        reduce(packed, 1, 20, 20, sequence_starts=(0, 7))


def test_supports_flash_attn(hub):
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 9, 8)
    assert hub.supports_flash_attn() is True
    assert hub.supports_flash_attn(q, k, k, _sdpa_mask(torch.ones(2, 9, dtype=torch.bool), 5, 4, 9)) is True
    assert hub.supports_flash_attn(q, torch.randn(2, 3, 9, 8), torch.randn(2, 3, 9, 8)) is False
    assert hub.supports_flash_attn(q, k.half(), k.half()) is False
    assert hub.supports_flash_attn(q, k, k, torch.ones(2, 9, dtype=torch.bool)) is False
    assert hub.supports_flash_attn(q, k, k, is_causal=False) is False
    assert hub.supports_flash_attn(q, k, k, output_attentions=True) is False


def test_compat_subpackage_reexports_the_kernel(hub, hub_dir):
    """Older kernels releases import ``<variant>/sparse_k/__init__.py`` as the kernel module itself."""
    init = hub_dir / "build" / "torch-cpu" / "sparse_k" / "__init__.py"
    spec = importlib.util.spec_from_file_location("_sparse_k_compat_test", init)
    compat = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = compat
    try:
        spec.loader.exec_module(compat)
    finally:
        sys.modules.pop(spec.name, None)
    assert compat.__all__ == hub.__all__
    assert {"flash_attn_forward", "supports_flash_attn", "sparse_attention"} <= set(vars(compat))
    q, k, v = torch.randn(1, 2, 13, 8), torch.randn(1, 2, 13, 8), torch.randn(1, 2, 13, 8)
    pattern = {"pattern": "sliding_window", "window": 4}
    torch.testing.assert_close(compat.sparse_attention(q, k, v, pattern), hub.sparse_attention(q, k, v, pattern))
    sub = importlib.import_module(f"{hub.__name__}.sparse_k")
    assert sub.sparse_attention is hub.sparse_attention


def test_get_kernel_offline_in_a_fresh_interpreter(hub_dir, repo_id):
    """``kernels.get_kernel(repo, version=1)`` through LOCAL_KERNELS with HF_HUB_OFFLINE=1; the hub
    module needs neither hf_sparse_attention nor the pip module nor transformers, and importing the
    pip module ``sparse_k`` does not import the user layer either."""
    script = textwrap.dedent(
        f"""
        import json, sys
        import kernels
        hub = kernels.get_kernel({repo_id!r}, version=1)
        mods = set(sys.modules)
        import torch
        q, k, v = torch.randn(2, 4, 11, 8), torch.randn(2, 2, 11, 8), torch.randn(2, 2, 11, 8)
        geo = hub.row_geometry(2, 11, 11)
        pattern = hub.get_pattern({{"pattern": "streaming", "sinks": 1, "window": 3}})
        out = hub.sparse_attention(q, k, v, pattern)
        ref, _ = hub.reference_attention(q, k, v, pattern, geo, scale=8 ** -0.5)
        print(json.dumps({{
            "file": hub.__file__,
            "name": hub.__name__,
            "imported": sorted(m for m in ("hf_sparse_attention", "sparse_k", "transformers") if m in mods),
            "err": float((out.double() - ref).abs().max()),
        }}))
        import sparse_k
        print(json.dumps({{"user_layer_after_core": "hf_sparse_attention" in sys.modules}}))
        """
    )
    env = {**os.environ, "LOCAL_KERNELS": f"{repo_id}={hub_dir}", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120, cwd=hub_dir, check=False
    )
    assert proc.returncode == 0, proc.stderr
    result, core = (json.loads(line) for line in proc.stdout.strip().splitlines()[-2:])
    assert core == {"user_layer_after_core": False}
    assert Path(result["file"]) == hub_dir / "build" / "torch-cpu" / "__init__.py"
    assert result["name"] == _metadata(hub_dir, "torch-cpu")["id"]
    assert result["imported"] == []
    assert result["err"] < 1e-5  # float32 path vs float64 reference over <= 11 keys


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama saved to disk, with a sparse pattern that differs from dense at its length."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
    )
    config.sparse_attention = {
        "pattern": "streaming", "sinks": 2, "window": 5,
        "layers": {"1": {"pattern": "dilated", "window": 3, "scales": 2}},
    }
    path = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _transformers_takes_this_kernels() -> tuple[bool, str]:
    """(whether the installed Transformers accepts the installed ``kernels``, a sentence saying which it wants)."""
    from transformers.utils import import_utils

    lo = getattr(import_utils, "KERNELS_MIN_VERSION", "?")
    hi = getattr(import_utils, "KERNELS_MAX_VERSION", None)
    wants = f"kernels >= {lo}" + (f", < {hi}" if hi else "")
    import transformers

    note = f"transformers {transformers.__version__} wants {wants}; installed kernels {kernels.__version__}"
    return bool(import_utils.is_kernels_available()), note


def test_hub_route_refuses_clearly_when_kernels_does_not_fit(tiny_llama, repo_id, hub_dir, monkeypatch):
    """Where the installed kernels is outside the range Transformers wants (e.g. 5.23 / 5.24, which want kernels
    0.18, beside kernels 0.17), the hub route must fail with an ImportError that names ``kernels`` and the version
    it wants, never load something else. CI's legs install fitting pairs, so there it skips."""
    transformers = pytest.importorskip("transformers")
    fits, note = _transformers_takes_this_kernels()
    if fits:
        pytest.skip(f"the hub route is available here ({note})")
    import huggingface_hub.constants

    monkeypatch.setenv("LOCAL_KERNELS", f"{repo_id}={hub_dir}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ImportError, match=r"kernels.*version"):
        transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation=repo_id)


def test_llama_hub_route_matches_sparse_k_route(tiny_llama, hub, hub_dir, repo_id, monkeypatch):
    transformers = pytest.importorskip("transformers")
    fits, note = _transformers_takes_this_kernels()
    if not fits:
        pytest.skip(f"hub route unavailable: {note} (test_hub_route_refuses_clearly_when_kernels_does_not_fit)")
    import huggingface_hub.constants

    import hf_sparse_attention  # noqa: F401  (registers attn_implementation="sparse_k")

    monkeypatch.setenv("LOCAL_KERNELS", f"{repo_id}={hub_dir}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    load = transformers.AutoModelForCausalLM.from_pretrained
    via_hub = load(tiny_llama, attn_implementation=repo_id).eval()
    via_pip = load(tiny_llama, attn_implementation="sparse_k").eval()
    dense = load(tiny_llama, attn_implementation="sdpa").eval()
    assert transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS[repo_id] is hub.flash_attn_forward

    torch.manual_seed(1)
    ids = torch.randint(1, 96, (3, 23))
    padded = torch.ones_like(ids)
    padded[1, :8] = 0
    padded[2, :3] = 0
    ids = ids.masked_fill(padded == 0, 0)
    with torch.no_grad():
        for mask in (None, padded):
            a = via_hub(ids, attention_mask=mask).logits
            b = via_pip(ids, attention_mask=mask).logits
            valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
            # Same kernels on the same inputs: only the route to them differs.
            torch.testing.assert_close(a[valid], b[valid], rtol=1e-5, atol=1e-5)
            assert (a - dense(ids, attention_mask=mask).logits)[valid].abs().max() > 1e-2  # the pattern is in effect
        # Decode steps (DynamicCache) and a StaticCache, whose unpadded prefill comes without a mask.
        for cache in ({}, {"cache_implementation": "static"}):
            for batch, mask in ((ids, padded), (ids[:1], None)):
                gen_hub = via_hub.generate(batch, attention_mask=mask, max_new_tokens=4, do_sample=False, **cache)
                gen_pip = via_pip.generate(batch, attention_mask=mask, max_new_tokens=4, do_sample=False, **cache)
                assert torch.equal(gen_hub, gen_pip), cache
