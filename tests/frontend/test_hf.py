"""Hugging Face frontend: live modules (from_torch) and model directories (load_graph / from_hf_dir)."""

import json

import numpy as np
import pytest
import torch

from cflow.errors import CflowError, UnsupportedModelError
from cflow.frontend import from_torch
from cflow.frontend.hf import from_hf_dir
from cflow.frontend.load import load_graph
from cflow.ir import interpret

from ._models import hf_logits, hf_model, incremental

IDS = np.random.default_rng(3).integers(0, 256, 24)

# family -> what the IR must say about it (docs/DESIGN.md, "Semantics of a layer")
EXPECT = {
    "llama": dict(ffn_dim=96, n_experts=0, tie_embeddings=True, rope_theta=500000.0, norm_eps=1e-5),
    "mistral": dict(ffn_dim=96, n_experts=0, tie_embeddings=False, max_seq_len=128),
    "mixtral": dict(ffn_dim=0, n_experts=4, top_k=2, expert_dim=96, norm_topk=True, shared_expert_dim=0),
    "qwen2_moe": dict(ffn_dim=96, n_experts=4, top_k=2, expert_dim=48, norm_topk=False, shared_expert_dim=80,
                      shared_expert_gate=True, attn_bias=True, dense_layers=(2,), moe_layers=(1,)),
}


@pytest.mark.parametrize("family", list(EXPECT))
def test_module_parity_prefill_and_decode(family):
    m = hf_model(family)
    g = from_torch(m)
    c = g.config
    for k, v in EXPECT[family].items():
        assert getattr(c, k) == v, k
    assert (c.dense_delay, c.expert_delay, c.routing) == (0, 0, "post")
    assert c.n_heads == 4 and c.n_kv_heads == 2 and c.head_dim == 16
    ref = hf_logits(m, IDS)
    assert np.abs(interpret(g, IDS) - ref).max() <= 1e-4
    assert np.abs(incremental(g, IDS, 9) - ref).max() <= 1e-4


def test_qwen2_moe_norm_topk_read_from_model():
    m = hf_model("qwen2_moe", norm_topk_prob=True, mlp_only_layers=[])
    g = from_torch(m)
    assert g.config.norm_topk and g.config.dense_layers is None and g.config.ffn_dim == 0
    assert np.abs(interpret(g, IDS) - hf_logits(m, IDS)).max() <= 1e-4


@pytest.mark.parametrize(
    "family, over, needle",
    [
        ("llama", {"hidden_act": "gelu"}, "model.layers.0.mlp.act_fn: activation GELUActivation is not modelled"),
        ("llama", {"attention_bias": True}, "model.layers.0.self_attn.o_proj.bias"),
        ("llama", {"mlp_bias": True}, "model.layers.0.mlp.gate_proj.bias"),
        ("olmoe", {"clip_qkv": 8.0}, "config.clip_qkv=8.0: q/k/v clipping is not modelled"),
        ("qwen2", {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4, "factor": 2.0}},
         "rope_type='proportional': this RoPE type is not modelled"),
        ("gemma2", {"sliding_window": 8, "layer_types": ["sliding_attention", "chunked_attention"]},
         "config.layer_types: layer type 'chunked_attention' is not modelled"),
    ],
)
def test_unmodelled_features_are_rejected_by_name(family, over, needle):
    with pytest.raises((UnsupportedModelError, ValueError)) as e:
        from_torch(hf_model(family, **over))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_unsupported_class_is_named():
    import transformers as tf

    m = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel: unsupported model class"):
        from_torch(m)


# --- directories ----------------------------------------------------------------------------
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(30)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])
    return tok.to_str()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "llama"])
def test_directory_sharded_f32_matches_model(family, tmp_path):
    m = hf_model(family)
    m.save_pretrained(tmp_path / "d", max_shard_size="100KB")
    assert (tmp_path / "d" / "model.safetensors.index.json").is_file()
    tok = _tokenizer_json()
    (tmp_path / "d" / "tokenizer.json").write_text(tok)
    g = load_graph(tmp_path / "d")
    assert str(g).splitlines()[1:] == str(from_torch(m)).splitlines()[1:]  # same IR (names differ)
    assert np.abs(interpret(g, IDS) - hf_logits(m, IDS)).max() <= 1e-4
    assert g.meta.tokenizer == tok
    assert isinstance(g.meta.eos_token_ids, list)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_directory_half_precision_and_eos_from_generation_config(dtype, tmp_path):
    import copy

    m = hf_model("mistral")
    with torch.no_grad():
        for p in m.parameters():  # the reference: rounded weights, f32 compute (and f32 RoPE buffers)
            p.copy_(p.to(dtype).float())
    b = copy.deepcopy(m).to(dtype)
    b.generation_config.eos_token_id = [2, 7]
    b.save_pretrained(tmp_path / "d")
    g = from_hf_dir(tmp_path / "d")
    assert g.meta.eos_token_ids == [2, 7] and g.meta.tokenizer is None
    assert np.abs(interpret(g, IDS) - hf_logits(m, IDS)).max() <= 1e-4


def test_directory_with_fused_expert_tensors(tmp_path):
    """transformers 5's in-memory layout (experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]) on disk."""
    from safetensors.torch import save_file

    m = hf_model("qwen2_moe")
    (tmp_path / "d").mkdir()
    m.config.to_json_file(str(tmp_path / "d" / "config.json"))
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(tmp_path / "d" / "model.safetensors"))
    g = from_hf_dir(tmp_path / "d")
    assert np.abs(interpret(g, IDS) - hf_logits(m, IDS)).max() <= 1e-4


def test_directory_weights_are_read_lazily(tmp_path):
    """No torch model is built and no tensor is read until the weight is used."""
    hf_model("llama").save_pretrained(tmp_path / "d")
    g = from_hf_dir(tmp_path / "d")
    assert not isinstance(g.weights, dict)
    w = g.weights["blocks.0.attn.wq"]
    assert w.dtype == np.float32 and w.shape == (64, 64)


def test_directory_rejections(tmp_path):
    hf_model("llama").save_pretrained(tmp_path / "l4")
    cfg = json.loads((tmp_path / "l4" / "config.json").read_text())
    (tmp_path / "l4" / "config.json").write_text(json.dumps({**cfg, "model_type": "llama4"}))
    with pytest.raises(UnsupportedModelError, match="model_type='llama4': Llama 4's chunked attention"):
        load_graph(tmp_path / "l4")
    # A llama directory carrying a tensor the IR has no place for: rejected by the tensor's name.
    from safetensors.torch import load_file, save_file

    hf_model("llama").save_pretrained(tmp_path / "l")
    sd = load_file(str(tmp_path / "l" / "model.safetensors"))
    sd["model.layers.0.self_attn.sinks"] = torch.ones(4)
    save_file(sd, str(tmp_path / "l" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="tensor 'model.layers.0.self_attn.sinks' is not modelled"):
        load_graph(tmp_path / "l")
    sd.pop("model.layers.0.self_attn.sinks")
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)  # a q norm without its k norm
    save_file(sd, str(tmp_path / "l" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="q norm without a k norm"):
        load_graph(tmp_path / "l")


def test_directory_corrupt_files_are_one_line_errors(tmp_path):
    hf_model("llama").save_pretrained(tmp_path / "d")
    w = tmp_path / "d" / "model.safetensors"
    w.write_bytes(w.read_bytes()[: 1000])
    with pytest.raises(CflowError) as e:
        load_graph(tmp_path / "d")
    assert "model.safetensors" in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "d" / "config.json").write_text("{not json")
    with pytest.raises(CflowError, match="config.json"):
        load_graph(tmp_path / "d")


def test_cflow_checkpoint_carries_tokenizer_and_eos(tmp_path):
    from cflow.models import from_preset
    from cflow.models.checkpoint import save_checkpoint

    tok = _tokenizer_json()
    save_checkpoint(from_preset("arch1", "tiny"), tmp_path / "ck", tokenizer_json=tok)
    g = load_graph(tmp_path / "ck")
    assert g.meta.tokenizer == tok and g.meta.eos_token_ids == [1]  # "</s>" in the tokenizer
    (tmp_path / "ck" / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert load_graph(tmp_path / "ck").meta.eos_token_ids == [5]
