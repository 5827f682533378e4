"""Assemble the Hugging Face kernel-hub layout of the compute core from ``build.toml`` and ``kernel_src/``.

The core is pure Python (PyTorch and Triton), so this does what kernel-builder's ``torch-noarch``
build does, without kernel-builder or Nix::

    python scripts/build_kernel.py [--out DIR] [--repo-id ORG/NAME] [--unique-id ID] [--backends cpu,cuda]

writes (``<module>`` is the kernel name with ``-`` replaced by ``_``, here ``sparse_k``)::

    DIR/README.md                       hub card: usage, supported shapes, validation
    DIR/build.toml                      the configuration (with ``--repo-id`` applied)
    DIR/torch-ext/<module>/             kernel-builder source layout (the shipped kernel_src/ files)
    DIR/build/torch-<backend>/          one noarch build variant per backend of build.toml:
        __init__.py, api.py, ...        the kernel_src/ tree's files whose extension is in ``pyext`` (its
        layouts/, attention/, ...       subpackages and the CUDA sources in attention/cuda/csrc/ included)
        _ops.py                         torch op namespace ``_<module>_<backend>_<unique id>`` and
                                        ``add_op_namespace_prefix``
        metadata.json                   name, id, version, license, backend, python-depends
        <module>/__init__.py            compat sub-package for ``kernels`` releases that import it

``DIR`` (default ``build/sparse-k``) is a local kernel repository: ``kernels.get_local_kernel(DIR)``
loads it, and so does ``kernels.get_kernel("<org>/sparse-k", version=1)`` with
``LOCAL_KERNELS="<org>/sparse-k=DIR"``. Uploading ``DIR`` to a ``kernel`` repository on the Hub
(branch ``v<version>``) publishes it. The unique id defaults to a hash of everything shipped, so two
different sources never share an op namespace while identical sources always do.

Only the standard library is used (``tomllib``; ``tomli`` on Python 3.10).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import shutil
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO_ROOT = Path(__file__).resolve().parent.parent

#: Keys of kernel-builder's edition-5 ``build.toml`` schema that this noarch builder accepts
#: (huggingface/kernels, kernels-data/src/config/v5.rs: ``General``, ``Hub``, per-backend general
#: tables and ``TorchNoarch``). Note the snake_case keys of ``[torch-noarch]``: that struct has no
#: kebab-case renaming, whatever kernel-builder's documentation says.
GENERAL_KEYS = frozenset(
    {"name", "version", "edition", "license", "upstream", "source", "backends", "cuda", "hub",
     "kernel-depends", "neuron", "python-depends", "tpu", "xpu"}
)
HUB_KEYS = frozenset({"repo-id", "branch"})
BACKEND_GENERAL_KEYS = {
    "cuda": frozenset({"minver", "maxver", "kernel-depends", "python-depends"}),
    "neuron": frozenset({"kernel-depends", "python-depends"}),
    "tpu": frozenset({"python-depends"}),
    "xpu": frozenset({"kernel-depends", "python-depends"}),
}
TORCH_NOARCH_KEYS = frozenset({"pyext", "cuda_capabilities", "rocm_archs"})
BACKENDS = ("cann", "cpu", "cuda", "metal", "neuron", "rocm", "tpu", "xpu")
FRAMEWORKS = ("torch", "torch-noarch", "tvm-ffi")
DEFAULT_PYEXT = ("py", "pyi")

#: Python dependencies that both ``kernels`` 0.16 and 0.17 accept (their ``python_depends.json``);
#: any other name makes ``get_kernel`` refuse the kernel. Triton is not on it: kernels import it
#: where they need it and fall back when it is missing.
ALLOWED_PYTHON_DEPENDS = {
    "general": frozenset({"einops", "tvm-ffi"}),
    "cuda": frozenset({"nvidia-cutlass-dsl"}),
    "neuron": frozenset({"nki"}),
    "xpu": frozenset({"onednn"}),
}

_NAME_RE = re.compile(r"^[a-z][-a-z0-9]*[a-z0-9]$")
_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*$")
_UNIQUE_ID_RE = re.compile(r"^[A-Za-z0-9_]+$")


class BuildConfigError(ValueError):
    """``build.toml`` does not follow the edition-5 schema or asks for something this builder cannot do."""


def _check_keys(table: dict, allowed: frozenset, where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise BuildConfigError(f"unknown key(s) {unknown} in {where}; edition 5 allows {sorted(allowed)}")


def validate_build_config(cfg: dict) -> dict:
    """Check a parsed ``build.toml`` against the edition-5 schema (for a noarch build) and return it.

    Raises ``BuildConfigError`` naming the offending key or value.
    """
    unknown_top = sorted(set(cfg) - {"general", "kernel", *FRAMEWORKS})
    if unknown_top:
        raise BuildConfigError(f"unknown table(s) {unknown_top}; edition 5 has general, kernel.<name> and one of {FRAMEWORKS}")
    general = cfg.get("general")
    if not isinstance(general, dict):
        raise BuildConfigError("build.toml needs a [general] table")
    _check_keys(general, GENERAL_KEYS, "[general]")
    for key in ("name", "version", "edition", "license", "backends"):
        if key not in general:
            raise BuildConfigError(f"[general] needs `{key}`")
    if general["edition"] != 5:
        raise BuildConfigError(f"[general] edition must be 5, got {general['edition']!r}")
    name = general["name"]
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise BuildConfigError(f"[general] name must match {_NAME_RE.pattern}, got {name!r}")
    version = general["version"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise BuildConfigError(f"[general] version must be a non-negative integer, got {version!r}")
    if not isinstance(general["license"], str) or not general["license"]:
        raise BuildConfigError(f"[general] license must be a non-empty string, got {general['license']!r}")
    backends = general["backends"]
    if not isinstance(backends, list) or not backends or any(b not in BACKENDS for b in backends):
        raise BuildConfigError(f"[general] backends must be a non-empty list from {BACKENDS}, got {backends!r}")
    if len(set(backends)) != len(backends):
        raise BuildConfigError(f"[general] backends lists a backend twice: {backends!r}")
    hub = general.get("hub", {})
    if not isinstance(hub, dict):
        raise BuildConfigError("[general.hub] must be a table")
    _check_keys(hub, HUB_KEYS, "[general.hub]")
    if "repo-id" in hub and not _REPO_ID_RE.match(str(hub["repo-id"])):
        raise BuildConfigError(f"[general.hub] repo-id must look like <org>/<name>, got {hub['repo-id']!r}")
    for backend, keys in BACKEND_GENERAL_KEYS.items():
        table = general.get(backend, {})
        if not isinstance(table, dict):
            raise BuildConfigError(f"[general.{backend}] must be a table")
        _check_keys(table, keys, f"[general.{backend}]")
    for where, table in [("[general]", general)] + [(f"[general.{b}]", general.get(b, {})) for b in BACKEND_GENERAL_KEYS]:
        if table.get("kernel-depends"):
            raise BuildConfigError(f"{where} kernel-depends is not supported by this builder (use kernel-builder)")
        allowed = ALLOWED_PYTHON_DEPENDS["general"] if where == "[general]" else ALLOWED_PYTHON_DEPENDS.get(where[9:-1], frozenset())
        deps = table.get("python-depends", [])
        bad = [d for d in deps if d not in allowed]
        if bad:
            raise BuildConfigError(
                f"{where} python-depends {bad} are not on the kernels allow-list {sorted(allowed)}; "
                "kernels 0.16/0.17 refuse to load such a kernel"
            )
    frameworks = [f for f in FRAMEWORKS if f in cfg]
    if frameworks != ["torch-noarch"]:
        raise BuildConfigError(
            f"this builder assembles [torch-noarch] kernels only, build.toml has {frameworks or 'no framework table'}; "
            "kernels with CUDA sources ([torch] + [kernel.<name>]) are built with kernel-builder"
        )
    if cfg.get("kernel"):
        raise BuildConfigError("[kernel.<name>] sections need kernel-builder (compiled sources); this builder is noarch only")
    noarch = cfg["torch-noarch"]
    _check_keys(noarch, TORCH_NOARCH_KEYS, "[torch-noarch]")
    pyext = noarch.get("pyext", list(DEFAULT_PYEXT))
    if not isinstance(pyext, list) or not pyext or not all(isinstance(e, str) and re.fullmatch(r"[A-Za-z0-9]+", e) for e in pyext):
        raise BuildConfigError(f"[torch-noarch] pyext must be a list of file extensions without dots, got {pyext!r}")
    if "py" not in pyext:
        raise BuildConfigError(f"[torch-noarch] pyext must include 'py', got {pyext!r}")
    return cfg


def load_build_config(path: Path) -> dict:
    """Parse and validate ``build.toml`` at ``path``."""
    with open(path, "rb") as f:
        cfg = tomllib.load(f)
    return validate_build_config(cfg)


def python_name(name: str) -> str:
    """Module name of kernel ``name`` (dashes become underscores), as kernel-builder and kernels derive it."""
    return name.replace("-", "_")


def variant_name(backend: str) -> str:
    """Noarch build-variant directory of ``backend`` (kernels calls the CANN noarch backend ``npu``)."""
    return "torch-" + ("npu" if backend == "cann" else backend)


def shipped_files(src_dir: Path, pyext: list[str], module: str) -> list[Path]:
    """The files of ``src_dir`` that go into every variant, relative to it, sorted.

    Files with an extension in ``pyext``, outside ``__pycache__``; ``_ops.py`` is left out because each
    variant gets a generated one.
    """
    if not (src_dir / "__init__.py").is_file():
        raise FileNotFoundError(f"{src_dir} has no __init__.py: not the kernel package")
    if (src_dir / module).exists():
        raise BuildConfigError(f"{src_dir / module} exists but that name is reserved for the compat sub-package")
    files = []
    for path in sorted(src_dir.rglob("*")):
        rel = path.relative_to(src_dir)
        if not path.is_file() or "__pycache__" in rel.parts or path.suffix[1:] not in pyext:
            continue
        if rel == Path("_ops.py"):
            continue
        files.append(rel)
    return files


def content_unique_id(build_toml: Path, src_dir: Path, files: list[Path]) -> str:
    """10 hex digits of a SHA-256 over ``build.toml`` and every shipped file (path and bytes)."""
    h = hashlib.sha256()
    h.update(build_toml.read_bytes())
    for rel in files:
        h.update(rel.as_posix().encode() + b"\0")
        h.update((src_dir / rel).read_bytes() + b"\0")
    return h.hexdigest()[:10]


def public_names(init_file: Path) -> list[str]:
    """The names in ``__all__`` of ``init_file`` (assignments and ``+=`` of string lists), read without importing."""
    names: list[str] = []
    tree = ast.parse(init_file.read_text(), filename=str(init_file))
    for node in tree.body:
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign):
            targets = [node.target]
        if not any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            continue
        if isinstance(node.value, (ast.List, ast.Tuple)):
            values = [e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            names = values if isinstance(node, ast.Assign) else names + values
    return names


def metadata_for_backend(cfg: dict, backend: str, ops_id: str) -> dict:
    """``metadata.json`` of one variant: the fields kernels 0.16/0.17 read (kernel-builder's ``Metadata``)."""
    general = cfg["general"]
    depends = list(general.get("python-depends", [])) + list(general.get(backend, {}).get("python-depends", []))
    meta = {
        "name": general["name"],
        "id": ops_id,
        "version": general["version"],
        "license": general["license"],
        "python-depends": depends,
        "backend": {"type": backend},
    }
    archs = {"cuda": "cuda_capabilities", "rocm": "rocm_archs"}.get(backend)
    if archs and cfg["torch-noarch"].get(archs):
        meta["backend"]["archs"] = list(cfg["torch-noarch"][archs])
    for key in ("upstream", "source"):
        if key in general:
            meta[key] = general[key]
    return meta


def ops_py(ops_id: str) -> str:
    """Source of a variant's ``_ops.py``: the op namespace is the variant's metadata id."""
    return f'''"""Torch op namespace of this build variant (generated by scripts/build_kernel.py).

Ops this kernel registers with ``torch.library`` go into ``{ops_id}``, a namespace unique to the
kernel's name, backend and source, so that several builds (and the pip package) can share a process.
"""

import torch

_OPS_NAMESPACE = "{ops_id}"

ops = getattr(torch.ops, _OPS_NAMESPACE)


def add_op_namespace_prefix(op_name: str) -> str:
    """``"<namespace>::<op_name>"``: the qualified name to register or look up ``op_name`` under."""
    return f"{{_OPS_NAMESPACE}}::{{op_name}}"
'''


COMPAT_INIT = '''"""Compatibility entry point: older ``kernels`` releases import ``<variant>/{module}/__init__.py``.

Re-exports the public names of the kernel package one directory up. When this file is imported as
a sub-package of that package, the loaded package is reused; otherwise the package is loaded once
under a module name derived from its path (so its relative imports work and it cannot collide).
"""

import hashlib
import importlib.util
import sys
from pathlib import Path


def _kernel_package():
    parent = __name__.rpartition(".")[0]
    if parent and parent in sys.modules:
        return sys.modules[parent]
    init = Path(__file__).resolve().parent.parent / "__init__.py"
    name = "_{module}_compat_" + hashlib.sha256(str(init).encode()).hexdigest()[:16]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


_package = _kernel_package()
__all__ = list(_package.__all__)
globals().update({{name: getattr(_package, name) for name in __all__}})
'''


def card(cfg: dict, repo_id: str, functions: list[str], backends: list[str]) -> str:
    """The hub card (``README.md``): usage, Transformers route, supported shapes, validation."""
    general = cfg["general"]
    module = python_name(general["name"])
    version = general["version"]
    variants = ", ".join(f"`{variant_name(b)}`" for b in backends)
    fn_list = "\n".join(f"- `{f}`" for f in functions)
    return f"""---
library_name: kernels
license: {general["license"].lower()}
tags:
- kernels
- attention
- sparse-attention
---

# {general["name"]}: sparse attention for Hugging Face Transformers

The compute core of [hf_sparse_attention](https://github.com/hf-sparse-attention/hf_sparse_attention)
(`{module}`) packaged for the [`kernels`](https://github.com/huggingface/kernels) library: sparse
attention patterns (sliding window, StreamingLLM sinks + window, block-diagonal, BigBird, dilated,
L2-aligned, SparseK and DSA-style learned top-k), compiled to block and token layouts, run by Triton
kernels on GPUs and by an exact, memory-linear PyTorch path everywhere else (CPU included).
Build variants: {variants} (no compiled code; the same Python on every backend).

## How to use

```python
import torch
from kernels import get_kernel

# Organisations outside the kernels trusted publishers need trust_remote_code=True.
sparse_k = get_kernel("{repo_id}", version={version}, trust_remote_code=True)

q = torch.randn(2, 8, 1000, 64)                       # (B, Hq, Sq, D)
k = torch.randn(2, 2, 1000, 64)                       # (B, Hkv, Skv, D), GQA
v = torch.randn(2, 2, 1000, 64)
out = sparse_k.sparse_attention(q, k, v, sparse_k.Streaming(sinks=4, window=256))
```

### Transformers

```python
from transformers import AutoConfig, AutoModelForCausalLM

config = AutoConfig.from_pretrained(model_id)
config.sparse_attention = {{"pattern": "streaming", "sinks": 4, "window": 1024}}
model = AutoModelForCausalLM.from_pretrained(
    model_id, config=config, attn_implementation="{repo_id}", allow_all_kernels=True
)
```

Transformers finds `flash_attn_forward` and `supports_flash_attn` in this kernel and registers
`flash_attn_forward` as the attention function with its sdpa mask. `flash_attn_forward` reduces that
4-D mask to key validity and query offsets (left padding and static caches included) and runs the
pattern that `config.sparse_attention` gives each layer (the same schema as
`attn_implementation="sparse_k"` of the pip package; without it the default SparseK configuration).
`allow_all_kernels=True` is needed while `{repo_id.split("/")[0]}` is not a trusted kernel publisher.

## Available functions

{fn_list}

## Supported shapes

- `q (B, Hq, Sq, D)`, `k, v (B, Hkv, Skv, D)` with `Hq % Hkv == 0` (GQA, K/V never repeated);
  float16, bfloat16, float32, float64; any `Sq` and `Skv` (prefill, chunked prefill, decode `Sq == 1`).
- `attention_mask (B, Skv)`, True/1 = the key takes part (left padding shifts each row's positions);
  packed sequences through `cu_seqlens_q` / `cu_seqlens_k`.
- `softcap`, per-head `sink_logits (Hq,)` (gpt-oss `s_aux`), explicit `q_start` for static caches.
- Fast paths run where they support the call and fall back to the exact PyTorch path with a one-time
  warning otherwise.

## Validation

Every pattern and path is tested against `reference_attention`, an exact float64 dense-mask
implementation, with fresh random inputs, odd lengths, GQA ratios and decode shapes. The packaging
itself is tested offline on CPU: this layout is built into a temporary directory, loaded with
`kernels.get_local_kernel` and with `kernels.get_kernel` through `LOCAL_KERNELS`, its attention equals
the reference, and a tiny random Llama gives the same logits with `attn_implementation="{repo_id}"`
as with the pip package's `attn_implementation="sparse_k"`, unpadded and left-padded.

## Source

Built by `scripts/build_kernel.py` of hf_sparse_attention from `build.toml` and `kernel_src/`
(kernel-builder source layout in `torch-ext/{module}/`).
"""


def _is_earlier_build(out: Path, name: str) -> bool:
    """Whether ``out`` holds an earlier output of this script for kernel ``name`` (safe to replace)."""
    try:
        with open(out / "build.toml", "rb") as f:
            return tomllib.load(f)["general"]["name"] == name and (out / "build").is_dir()
    except (OSError, KeyError, TypeError, tomllib.TOMLDecodeError):
        return False


def build_hub_layout(
    out: Path,
    *,
    repo_root: Path = REPO_ROOT,
    repo_id: str | None = None,
    unique_id: str | None = None,
    backends: list[str] | None = None,
) -> Path:
    """Write the hub layout of ``repo_root``'s ``build.toml`` + ``kernel_src/`` to ``out``; return ``out``.

    ``repo_id`` overrides ``[general.hub] repo-id`` (written to the output's ``build.toml`` and card);
    ``unique_id`` overrides the content hash in the op namespace; ``backends`` restricts the variants
    to a subset of ``[general] backends``. ``out`` must be new, empty or an earlier output (whose
    ``build/`` and ``torch-ext/`` are replaced).
    """
    repo_root = Path(repo_root).resolve()
    out = Path(out).resolve()
    if out == repo_root or out in repo_root.parents or (repo_root / "kernel_src") in (out, *out.parents):
        raise ValueError(f"--out {out} would overwrite the repository; pick a directory below it or elsewhere")
    build_toml = repo_root / "build.toml"
    cfg = load_build_config(build_toml)
    general = cfg["general"]
    if repo_id is not None:
        if not _REPO_ID_RE.match(repo_id):
            raise ValueError(f"repo_id must look like <org>/<name>, got {repo_id!r}")
        general.setdefault("hub", {})["repo-id"] = repo_id
    repo_id = general.get("hub", {}).get("repo-id", f"<org>/{general['name']}")
    if unique_id is not None and not _UNIQUE_ID_RE.match(unique_id):
        raise ValueError(f"unique_id may hold letters, digits and '_' only, got {unique_id!r}")
    if backends is None:
        backends = list(general["backends"])
    elif not backends or any(b not in general["backends"] for b in backends):
        raise ValueError(f"backends must be a non-empty subset of build.toml's {general['backends']}, got {backends!r}")

    module = python_name(general["name"])
    src_dir = repo_root / "kernel_src"
    files = shipped_files(src_dir, cfg["torch-noarch"].get("pyext", list(DEFAULT_PYEXT)), module)
    uid = unique_id if unique_id is not None else content_unique_id(build_toml, src_dir, files)

    if out.exists() and any(out.iterdir()) and not _is_earlier_build(out, general["name"]):
        raise ValueError(f"{out} is not empty and holds no earlier build of {general['name']}; pick a new or empty directory")
    out.mkdir(parents=True, exist_ok=True)
    for generated in ("build", "torch-ext"):
        if (out / generated).exists():
            shutil.rmtree(out / generated)
    ext_dir = out / "torch-ext" / module
    for backend in backends:
        variant = out / "build" / variant_name(backend)
        for rel in files:
            for dest_root in (variant, ext_dir):
                dest = dest_root / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src_dir / rel, dest)
        ops_id = f"_{module}_{backend}_{uid}"
        (variant / "_ops.py").write_text(ops_py(ops_id))
        (variant / "metadata.json").write_text(json.dumps(metadata_for_backend(cfg, backend, ops_id), indent=2) + "\n")
        (variant / module).mkdir()
        (variant / module / "__init__.py").write_text(COMPAT_INIT.format(module=module))

    text = build_toml.read_text()
    if "hub" in general:
        text = re.sub(r'(?m)^repo-id\s*=\s*"[^"]*"', f'repo-id = "{repo_id}"', text)
    (out / "build.toml").write_text(text)
    (out / "README.md").write_text(card(cfg, repo_id, public_names(src_dir / "__init__.py"), backends))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "sparse-k", help="output directory (default: build/sparse-k)")
    parser.add_argument("--repo-id", help="hub repository <org>/<name> (default: [general.hub] repo-id of build.toml)")
    parser.add_argument("--unique-id", help="op-namespace suffix (default: hash of the shipped files)")
    parser.add_argument("--backends", help="comma-separated subset of build.toml's backends (default: all)")
    args = parser.parse_args(argv)
    try:
        out = build_hub_layout(
            args.out, repo_id=args.repo_id, unique_id=args.unique_id,
            backends=args.backends.split(",") if args.backends else None,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"build_kernel.py: error: {e}", file=sys.stderr)
        return 2
    variants = sorted(p.name for p in (out / "build").iterdir())
    print(f"wrote {out}: build/{{{','.join(variants)}}}, README.md, build.toml, torch-ext/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
