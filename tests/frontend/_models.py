"""Tiny models for frontend tests: Hugging Face families built from configs (random weights, never a hub)
and pipeline-native models, with weights scaled so logits are O(1) and routing is not degenerate."""

from __future__ import annotations

import numpy as np
import torch

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)


def randomize(model, seed: int = 0):
    """Every weight ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norm weights ~ 1 + N(0, 0.1^2), biases small."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                base = 1.0 if "norm" in name else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model.eval()


def hf_model(family: str, seed: int = 0, **over):
    """A tiny transformers causal LM of `family` with random weights."""
    import transformers as tf

    torch.manual_seed(seed)
    if family == "llama":
        cfg = tf.LlamaConfig(**{**COMMON, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                                "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, **over})
        m = tf.LlamaForCausalLM(cfg)
    elif family == "mistral":
        cfg = tf.MistralConfig(**{**COMMON, "sliding_window": 4096, **over})  # a window longer than the context
        m = tf.MistralForCausalLM(cfg)
    elif family == "mixtral":
        cfg = tf.MixtralConfig(**{**COMMON, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None,
                                  **over})
        m = tf.MixtralForCausalLM(cfg)
    elif family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**{**COMMON, "moe_intermediate_size": 48, "shared_expert_intermediate_size": 80,
                                   "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [1], **over})
        m = tf.Qwen2MoeForCausalLM(cfg)
    elif family == "qwen3":
        m = tf.Qwen3ForCausalLM(tf.Qwen3Config(**{**COMMON, **over}))
    elif family in FAMILIES:
        cfg_cls, model_cls, kw = FAMILIES[family]
        cfg = getattr(tf, cfg_cls)(**{**COMMON, **SPECIAL_IDS, **kw, **over})
        m = getattr(tf, model_cls)(cfg)
    else:
        raise ValueError(family)
    return randomize(m, seed)


SPECIAL_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
# family -> (config class, model class, config overrides): the families beyond the first four, each built from
# its own config class with random weights. Chosen so every variant bites within a 24-token test sequence:
# a sliding window of 8, llama3 frequencies in all three bands, longrope with an attention factor and a
# partial rotary embedding, Granite multipliers far from 1.
FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=_LLAMA3_ROPE)),
    "llama_linear": ("LlamaConfig", "LlamaForCausalLM",
                     dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})),
    "llama_dynamic": ("LlamaConfig", "LlamaForCausalLM",
                      dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})),
    "qwen2_yarn": ("Qwen2Config", "Qwen2ForCausalLM",
                   dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                         "original_max_position_embeddings": 32})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                       mlp_only_layers=[1], head_dim=16)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(partial_rotary_factor=0.5, rope_parameters={
                 "rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0,
                 "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 3.0, 4.0, 6.0],
                 "original_max_position_embeddings": 128})),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=32, attn_logit_softcapping=5.0,
                    final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=16, sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=32,
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625,
                     logits_scaling=8.0, tie_word_embeddings=True)),
}


def custom_pipeline_native(seed: int = 0):
    """A pipeline-native model using every knob at once: arch5-style sharing (2 layers run 1 block),
    pre-dense routing, dense and expert delays (with a flush), q/k/v biases, tied embeddings, a gated
    shared expert, no top-k renormalisation. Two layers keep its ONNX export quick."""
    from cflow.models import ModelConfig, PipelineNativeLM

    c = ModelConfig(name="knobs", vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                    n_experts=4, top_k=2, expert_dim=48, max_seq_len=128, dense_delay=1, expert_delay=1,
                    routing="pre", n_blocks=1, shared_expert_dim=32, shared_expert_gate=True, norm_topk=False,
                    attn_bias=True, tie_embeddings=True, rope_theta=500000.0, norm_eps=1e-6)
    torch.manual_seed(seed)
    return randomize(PipelineNativeLM(c), seed)


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(np.asarray(ids))[None]).logits[0].float().numpy()


def ort_logits(path, ids) -> np.ndarray:
    import onnxruntime as ort

    opts = ort.SessionOptions()  # one thread (tests/conftest.py: one xdist worker per core, no pools beside it)
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    s = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    return s.run(None, {"input_ids": np.asarray(ids, dtype=np.int64)[None]})[0][0]


def incremental(graph, ids, k: int) -> np.ndarray:
    from cflow.ir import Interpreter

    it = Interpreter(graph)
    return np.concatenate([it.prefill(ids[:k])] + [it.step(int(t))[None] for t in ids[k:]])


# What the session exports (tests/frontend/conftest.py): HF models with few layers, since export costs ~3 s a
# layer. The exported Mistral has a sliding window of 64 < its 128 positions: it imports only for a
# context of at most 64 tokens (CONTEXT), which also tests that the window is found in the ONNX mask.
EXPORT_LAYERS = {"llama": 1, "mistral": 1, "mixtral": 1, "qwen2_moe": 2, "qwen2": 1, "llama3": 1}
CONTEXT = {"mistral": 64}


def exported_hf_model(family: str):
    """The HF model whose ONNX export the session fixture writes as {family}.onnx."""
    if family == "mistral":
        return hf_model("mistral", sliding_window=64, num_hidden_layers=1)
    return hf_model(family, num_hidden_layers=EXPORT_LAYERS[family])


def export_task(key: str, outdir: str) -> str:
    """Export one test model (runs in a worker process too: everything is rebuilt from seeds)."""
    from pathlib import Path

    from cflow.frontend.export import export_onnx

    out = Path(outdir) / f"{key}.onnx"  # (the arch2_4_combined preset: tests/_shared.py, through the CLI)
    if key == "knobs":  # weights in knobs.onnx.data: the > 2 GB path, on a small file
        export_onnx(custom_pipeline_native(), out, external_data=True)
    else:
        export_onnx(exported_hf_model(key), out)
    return str(out)
