"""The families the ONNX importer refuses (docs/frontends.md: Phi-3, Gemma 1/2/3, Granite, OLMoE, Qwen3, Qwen3-MoE),
each exported from a tiny random model exactly as the Llama exports of test_onnx.py are (cflow.frontend.export,
the dynamo exporter), and refused with one UnsupportedModelError naming the node and the reason. onnxruntime runs
each file to transformers' logits first, so the refusal is the importer's, not a broken export.

One layer per model: an export costs ~3-5 s here, so each file is exported once for this module."""

from __future__ import annotations

import numpy as np
import pytest

from cflow.errors import UnsupportedModelError
from cflow.frontend import from_onnx

from ._models import hf_logits, hf_model, ort_logits

pytest.importorskip("onnxscript")

# family -> (model overrides, what the one error must say): the reasons docs/frontends.md gives
QK_NORMS = r"in the attention \(layer 1\): q/k norms \(an RMSNorm inside the block\)"
EMBED_SCALE = r"scales the embedding .* by the constant {}: an embedding scale .* is not read from ONNX"
CASES = {
    "phi3": ({}, r"attention of layer 1: one fused q/k/v projection \(as Phi-3's qkv_proj\) is not read from ONNX"),
    "gemma": ({}, EMBED_SCALE.format("8")),  # sqrt(64)
    "gemma2": ({}, EMBED_SCALE.format("8")),
    "gemma3": ({}, EMBED_SCALE.format("8")),
    "granite": ({}, EMBED_SCALE.format("12")),  # embedding_multiplier
    "olmoe": ({}, QK_NORMS),
    "qwen3": ({}, QK_NORMS),
    "qwen3_moe": ({"mlp_only_layers": []}, QK_NORMS),
}


def _model(family: str):
    return hf_model(family, num_hidden_layers=1, **CASES[family][0])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """family -> its .onnx, exported on first use."""
    from cflow.frontend.export import export_onnx

    out, done = tmp_path_factory.mktemp("refused_onnx"), {}

    def get(family: str):
        if family not in done:
            done[family] = export_onnx(_model(family), out / f"{family}.onnx")
        return done[family]

    return get


@pytest.mark.parametrize("family", list(CASES))
def test_family_exported_to_onnx_is_refused_by_node_and_reason(exported, family):
    path = exported(family)
    ids = np.random.default_rng(3).integers(0, 256, 9)
    assert np.abs(ort_logits(path, ids) - hf_logits(_model(family), ids)).max() <= 1e-3  # a faithful export
    with pytest.raises(UnsupportedModelError, match=CASES[family][1]) as e:
        from_onnx(path)
    msg = str(e.value)
    assert msg.startswith("node '") and "\n" not in msg, msg
