"""The families people run, read by structure: every HF family in FAMILIES (plus Qwen3 and a Llama-like decoder
under a made-up class name and model_type) as a live module and as a directory, to within 1e-4 of transformers'
f32 logits (prefill and token-by-token decode) through the NumPy interpreter; native_gaps (what the native runtime
cannot run yet) is empty for every one of them: their runtime parity is tests/runtime/test_families.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cflow.errors import UnsupportedModelError
from cflow.frontend import from_torch
from cflow.frontend.load import load_graph
from cflow.ir import interpret
from cflow.passes.pipeline import check_native, native_gaps

from ._models import hf_logits, hf_model, incremental

IDS = np.random.default_rng(3).integers(0, 256, 24)

EXPECT = {  # family -> what the IR must say about it, and whether the native runtime runs it
    "llama3": (dict(rope_scaling="llama3"), True),
    "llama_linear": (dict(rope_scaling="linear"), True),
    "llama_dynamic": (dict(rope_scaling="dynamic"), True),
    "qwen2_yarn": (dict(rope_scaling="yarn", attn_bias=True), True),
    "qwen2": (dict(attn_bias=True, tie_embeddings=True, ffn_dim=96), True),
    "qwen3": (dict(qk_norm="head", attn_bias=False), True),
    "qwen3_moe": (dict(qk_norm="head", n_experts=4, top_k=2, expert_dim=48, norm_topk=True, dense_layers=(2,),
                       moe_layers=(1,)), True),
    "olmoe": (dict(qk_norm="proj", n_experts=4, top_k=2, norm_topk=False, ffn_dim=0), True),
    "phi3": (dict(rope_dim=8, rope_scaling="longrope", ffn_dim=96), True),
    "gemma": (dict(activation="gelu_tanh", tie_embeddings=True, post_norms=False), True),
    "gemma2": (dict(activation="gelu_tanh", post_norms=True, attn_softcap=5.0, final_softcap=3.0, sliding_window=8,
                    sliding_layers=(1,)), True),
    "gemma3": (dict(qk_norm="head", post_norms=True, rope_theta=1e6, local_rope_theta=1e4, rope_scaling="linear",
                    sliding_window=8, sliding_layers=(1,)), True),
    "granite": (dict(tie_embeddings=True, ffn_dim=96), True),
}


def _check_config(c, expect: dict) -> None:
    for k, v in expect.items():
        got = getattr(c, k)
        if k == "rope_scaling":
            got = dict(got)["rope_type"]
        assert got == v, (k, got, v)


@pytest.mark.parametrize("family", list(EXPECT))
def test_module_parity_prefill_and_decode(family):
    m = hf_model(family)
    g = from_torch(m)
    expect, native = EXPECT[family]
    _check_config(g.config, expect)
    assert (not native_gaps(g.config)) == native
    ref = hf_logits(m, IDS)
    assert np.abs(interpret(g, IDS) - ref).max() <= 1e-4
    assert np.abs(incremental(g, IDS, 9) - ref).max() <= 1e-4


@pytest.mark.parametrize("family", list(EXPECT))
def test_directory_equals_module(family, tmp_path):
    m = hf_model(family)
    m.save_pretrained(tmp_path / "d")
    g = load_graph(tmp_path / "d")
    assert str(g).splitlines()[1:] == str(from_torch(m)).splitlines()[1:]  # the same IR (names differ)
    assert np.abs(interpret(g, IDS) - hf_logits(m, IDS)).max() <= 1e-4


def test_printed_ir_shows_the_variants():
    text = str(from_torch(hf_model("gemma2")))
    assert "attention[eps=1e-06, head_dim=16, heads=4/2, post_norm=true, rope_theta=10000, softcap=5, window=8]" \
        in text
    assert "dense_ffn[act=gelu_tanh, eps=1e-06, hidden=96, post_norm=true]" in text
    assert "lm_head[softcap=3]" in text
    text = str(from_torch(hf_model("phi3")))
    assert "rope_dim=8, rope_scaling=longrope(orig=4096, attn_factor=1.08012)" in text
    assert "qk_norm=proj" in str(from_torch(hf_model("olmoe")))
    assert "rope_scaling" not in str(from_torch(hf_model("llama")))  # plain Llama prints as before


def test_mistral_short_window_is_modelled():
    m = hf_model("mistral", sliding_window=8)
    g = from_torch(m)
    assert g.config.sliding_window == 8 and g.config.sliding_layers is None
    assert np.abs(interpret(g, IDS) - hf_logits(m, IDS)).max() <= 1e-4
    check_native(g)  # the native runtime runs the window too (tests/runtime/test_families.py: gemma2/3, windowed)


# --- by structure, not by class name ---------------------------------------------------------------
def _renamed_llama():
    import transformers as tf

    class MyDecoderConfig(tf.LlamaConfig):
        model_type = "my_decoder"

    class MyDecoderForCausalLM(tf.LlamaForCausalLM):
        config_class = MyDecoderConfig

    from ._models import COMMON, randomize

    cfg = MyDecoderConfig(**{**COMMON, "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 32}})
    return randomize(MyDecoderForCausalLM(cfg))


def test_an_unknown_class_and_model_type_built_from_llamas_parts_compiles(tmp_path):
    m = _renamed_llama()
    g = from_torch(m)
    assert g.meta.source == "transformers:MyDecoderForCausalLM"
    ref = hf_logits(m, IDS)
    assert np.abs(interpret(g, IDS) - ref).max() <= 1e-4
    m.save_pretrained(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["model_type"] == "my_decoder" and cfg["architectures"] == ["MyDecoderForCausalLM"]
    d = load_graph(tmp_path / "d")  # transformers does not know my_decoder: config.json read as plain JSON
    assert d.meta.source == "hf-dir:my_decoder"
    assert np.abs(interpret(d, IDS) - ref).max() <= 1e-4


def test_what_does_not_fit_is_named_not_the_class(tmp_path):
    import torch

    m = _renamed_llama()
    m.model.layers[1].mlp.extra = torch.nn.Linear(4, 4)
    with pytest.raises(UnsupportedModelError, match=r"^model\.layers\.1\.mlp\.extra: Linear \(Linear\) not modelled"):
        from_torch(m)
    m = _renamed_llama()

    class Doubled(torch.nn.Module):  # an RMSNorm look-alike computing something else
        def __init__(self, inner):
            super().__init__()
            self.weight, self.variance_epsilon = inner.weight, inner.variance_epsilon

        def forward(self, x):
            return 2 * x

    m.model.layers[0].input_layernorm = Doubled(m.model.layers[0].input_layernorm)
    with pytest.raises(UnsupportedModelError, match="model.layers.0.input_layernorm: Doubled does not compute"):
        from_torch(m)
    m = _renamed_llama()
    m.save_pretrained(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "d" / "config.json").write_text(json.dumps({**cfg, "hidden_act": "relu2"}))
    with pytest.raises(UnsupportedModelError, match="hidden_act='relu2'"):
        load_graph(tmp_path / "d")
