"""The import proves itself (frontend/probe.py): families matched by their parts but computing something else are
refused with the first layer that differs; the supported families pass; a wrong weight is caught at its layer; a
model directory is probed through the directory path."""

import numpy as np
import pytest
import torch

from cflow.errors import UnsupportedModelError
from cflow.frontend import from_torch
from cflow.frontend.hf import from_hf_dir, from_hf_module
from cflow.frontend.probe import compare
from tests.frontend._models import hf_model, randomize

tf = pytest.importorskip("transformers")
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)


@pytest.mark.parametrize("family", ["Helium", "Ernie4_5"])
def test_families_that_compute_something_else_are_refused(family, tmp_path):
    """Both are imported as llama-like decoders by their parts; at default init their logits differ by 3-6e-3 (under
    a 1e-2 tolerance) and by ~8 on logits of 6 with activations of order 1: a different function."""
    cfg = getattr(tf, f"{family}Config")(**SMALL)
    m = getattr(tf, f"{family}ForCausalLM")(cfg).eval()  # default init: the probe builds its own O(1) model
    with pytest.raises(UnsupportedModelError, match=rf"{family}ForCausalLM: the import does not reproduce the "
                                                    r"module's own forward: layer 1's output differs"):
        from_torch(m)
    m.save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(UnsupportedModelError, match=rf"{family}ForCausalLM: the import does not reproduce"):
        from_hf_dir(tmp_path)


@pytest.mark.parametrize("family", ["llama", "qwen2_moe", "qwen3", "phi3", "gemma2", "gemma3", "granite"])
def test_supported_families_pass_the_probe_through_both_paths(family, tmp_path):
    m = hf_model(family)
    g = from_torch(m)
    assert g.config.n_layers == 2
    m.save_pretrained(tmp_path, safe_serialization=True)
    from_hf_dir(tmp_path)  # the directory path's probe: no error


def test_a_wrong_weight_is_named_by_its_layer():
    m = randomize(tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL)))
    g = from_hf_module(m, probe=False)
    good = dict(g.weights)
    compare(m, g, "llama")  # the faithful import passes
    g.weights = {**good, "blocks.1.ffn.w_down": good["blocks.1.ffn.w_down"] * np.float32(1.01)}
    with pytest.raises(UnsupportedModelError, match="llama: .* layer 2's output differs|llama: .* logits differ"):
        compare(m, g, "llama")
    g.weights = {**good, "blocks.0.attn.wq": good["blocks.0.attn.wq"][::-1].copy()}
    with pytest.raises(UnsupportedModelError, match="llama: .* layer 1's output differs"):
        compare(m, g, "llama")


def test_the_probe_uses_activations_of_order_one():
    """At default init (std 0.02) a Helium model's logits are nearly flat; the probe's own model is not."""
    from cflow.frontend.probe import _build, _shrunk

    cfg = tf.HeliumConfig(**SMALL)
    p = _build(tf.HeliumForCausalLM, _shrunk(cfg))
    with torch.no_grad():
        logits = p(input_ids=torch.arange(9)[None]).logits[0]
    assert float(logits.std()) > 1.0
