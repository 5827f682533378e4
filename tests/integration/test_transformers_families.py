"""Every causal-LM model type of the installed Transformers works with sparse_k or is refused at load.

For each type (a tiny random model from its own config class, CPU, float32; see
``tests/integration/model_families.py``): either loading with ``attn_implementation="sparse_k"`` raises
``ModelNotSupportedError`` naming the type, or, with a covering ``sliding_window`` pattern, a
left-padded batch equals the model's own attention (sdpa, or eager where sdpa is unsupported) on
every real token, greedy cached decode equals it, and cached decode equals recomputation under a
narrow ``streaming`` pattern with sinks. Types that cannot be built tiny are listed in
``NOT_BUILDABLE`` with the reason; a new type that fails to build fails here until it is listed.
Marker ``families`` (about 3 minutes on 2 cores): ``pytest -m families``.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import model_families as mf  # (tests/ is on sys.path under pytest)
from helpers import one_thread  # noqa: F401  (autouse fixture)

pytestmark = pytest.mark.families


@pytest.mark.parametrize("model_type", mf.causal_lm_types())
def test_family_works_or_is_refused(model_type):
    if model_type in mf.NOT_BUILDABLE:
        pytest.skip(f"{model_type} not buildable tiny: {mf.NOT_BUILDABLE[model_type]}")
    try:
        result = mf.check_family(model_type)
    except mf.NotBuildable as err:
        pytest.fail(f"{err}\n-> make it build in tests/integration/model_families.py or list it in NOT_BUILDABLE with the reason")
    if result["status"] == "refused":
        assert repr(model_type) in result["reason"] and "sdpa" in result["reason"]
        return
    if model_type in mf.NO_ATTENTION:
        assert result["calls"] == 0, f"{model_type} is listed without attention layers but called sparse_k"
    else:
        assert result["calls"] > 0, f"{model_type}: the tiny model never called the sparse_k attention function"


def test_refusal_happens_at_load_with_a_clear_message():
    from hf_sparse_attention import ModelNotSupportedError

    cfg = mf.tiny_config("bloom")
    with pytest.raises(ModelNotSupportedError, match=r"'bloom'.*own code.*sdpa"):
        transformers.BloomForCausalLM._from_config(cfg, attn_implementation="sparse_k")
    model = transformers.BloomForCausalLM._from_config(cfg, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    with pytest.raises(ModelNotSupportedError, match="'deepseek_v32'.*indexer"):
        mf.build("deepseek_v32", "sparse_k")
