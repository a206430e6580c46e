"""Hugging Face causal LMs -> IR, by structure: live modules (`from_hf_module`) and directories (`from_hf_dir`).

No list of classes: a model is read from what it is made of. A live module's tree is walked (every
child must be one the IR models, or it is named) and its numerics are probed (each norm is checked
to be x / rms(x) * w or * (1 + w), each activation to be SiLU or tanh-GELU, the embedding for a
scale, the RoPE buffers against ir/rope.py); a directory's blocks come from its tensor names and
shapes, its numbers from config.json (read with transformers when it knows the model_type, else as
plain JSON with Llama's defaults). So a Llama-like decoder under any class name or model_type
compiles; what does not fit is refused by the module path, tensor or config field.

Covered (transformers 5.23): Llama 1-3.x (rope scaling llama3 / linear / dynamic / yarn), Mistral,
Mixtral, Qwen2 / Qwen2.5, Qwen2-MoE, Qwen3, Qwen3-MoE, OLMoE, Phi-3 (fused qkv / gate_up, longrope,
partial rotary), Gemma 1/2/3 (text), Granite. Multipliers and (1 + w) norms are folded into the
weights (`Folds`); the variants the IR models as attributes are listed in ir/config.py.
A directory is converted tensor by tensor from its safetensors shards, without building the torch
model: `graph.weights` is a lazy mapping that reads one tensor per access.
"""

from __future__ import annotations

import json
import math
import types
import warnings
from pathlib import Path

import numpy as np

from ..errors import CflowError, UnsupportedModelError
from ..ir import Graph, build_graph, verify, weight_shapes
from ..ir.config import ModelConfig
from ..ir.rope import inv_freq, longrope_attention_factor, scaling_dict, scaling_label, yarn_attention_factor
from .hf_weights import (
    Folds,
    eos_token_ids,
    hf_weight_plan,
    layer_kinds_from_names,
    read_chat_template,
    read_special_tokens,
    read_tokenizer,
    resolve_qk_norm,
)
from .tensors import LazyWeights, SafetensorsDir

MAX_CONTEXT = 4096  # max_seq_len cap: the KV cache is sized by it (override with max_seq_len=)

# What a directory cannot show but its model_type implies (a live module shows it: probed instead).
_DIR_QUIRKS = {
    "gemma": {"norm_offset": 1.0, "embed_scale": "sqrt_d"},
    "gemma2": {"norm_offset": 1.0, "embed_scale": "sqrt_d"},
    "gemma3_text": {"norm_offset": 1.0, "embed_scale": "sqrt_d"},
}
# model_types refused by name, with the reason (their checkpoints may look Llama-like but are not).
_REFUSED_TYPES = {
    "gemma3": "a multimodal Gemma 3 checkpoint (language_model.* tensors): export its text model "
              "(Gemma3ForCausalLM, model_type gemma3_text)",
    "gemma3n": "Gemma 3n's per-layer embeddings and AltUp are not modelled",
    "gemma4": "Gemma 4 is not modelled",
    "llama4": "Llama 4's chunked attention, NoPE layers and interleaved MoE are not modelled",
    "deepseek_v2": "multi-head latent attention is not modelled",
    "deepseek_v3": "multi-head latent attention is not modelled",
    "phimoe": "PhiMoE's sparsemixer router is not modelled",
    "qwen3_next": "Qwen3-Next's linear attention is not modelled",
    "smollm3": "SmolLM3's NoPE layers are not modelled",
}
# Config fields that change the function and are not modelled: refused when set to a non-neutral value.
_UNMODELLED_FIELDS = {
    "clip_qkv": "q/k/v clipping",
    "scale_emb": "embedding scaling (MiniCPM)",
    "scale_depth": "depth-scaled residuals (MiniCPM)",
    "use_bidirectional_attention": "bidirectional attention",
    "attention_chunk_size": "chunked attention",
    "logit_softcapping": "logit soft-capping under this name",
}
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                "gelu_fast": "gelu_tanh", "gelu_python_tanh": "gelu_tanh"}


def _unsupported(where: str, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{where}: {what}")


def _get(cfg, name: str, default=None):
    v = getattr(cfg, name, default)
    return default if v is None else v


# --- config: RoPE, context, activation -------------------------------------------------------
def rope_of(cfg, where: str) -> dict:
    """{'theta', 'scaling' (resolved dict or None), 'partial', 'local_theta'} from rope_parameters (transformers 5)
    or the legacy rope_theta / rope_scaling / partial_rotary_factor fields."""
    rp = getattr(cfg, "rope_parameters", None)
    mpe = int(_get(cfg, "max_position_embeddings", MAX_CONTEXT))
    local_theta = 0.0
    if rp is None:  # legacy config.json
        rp = dict(_get(cfg, "rope_scaling", {}) or {})
        rp.setdefault("rope_theta", _get(cfg, "rope_theta", 10000.0))
        if _get(cfg, "rope_local_base_freq"):
            local_theta = float(cfg.rope_local_base_freq)
    if not isinstance(rp, dict):
        raise CflowError(f"{where}.rope_parameters={rp!r}: expected a dict")
    nested = {k: v for k, v in rp.items() if isinstance(v, dict)}
    if nested:
        odd = sorted(set(nested) - {"full_attention", "sliding_attention"})
        if odd:
            raise _unsupported(f"{where}.rope_parameters.{odd[0]}",
                               "RoPE parameters of this layer type are not modelled")
        local = nested.get("sliding_attention")
        full = nested.get("full_attention") or local
        if local is not None and local is not full:
            lt = local.get("rope_type", local.get("type", "default"))
            if lt != "default" or local.get("partial_rotary_factor", 1.0) not in (None, 1, 1.0):
                raise _unsupported(f"{where}.rope_parameters.sliding_attention.rope_type={lt!r}",
                                   "only default RoPE is modelled on the sliding-window layers")
            local_theta = float(local["rope_theta"])
        rp = full
    kind = rp.get("rope_type", rp.get("type", "default")) or "default"
    theta = rp.get("rope_theta", _get(cfg, "rope_theta"))
    if theta is None:
        raise _unsupported(f"{where}.rope_parameters", "has no rope_theta")
    partial = rp.get("partial_rotary_factor", _get(cfg, "partial_rotary_factor", 1.0))
    field = f"{where}.rope_parameters.rope_type={kind!r}"
    orig = rp.get("original_max_position_embeddings", _get(cfg, "original_max_position_embeddings"))
    if kind == "default":
        scaling = None
    elif kind == "linear":
        scaling = {"rope_type": kind, "factor": float(rp["factor"])}
    elif kind == "dynamic":
        scaling = {"rope_type": kind, "factor": float(rp["factor"]), "original_max_position_embeddings": mpe}
    elif kind == "llama3":
        scaling = {"rope_type": kind, "factor": float(rp["factor"]), "low_freq_factor": float(rp["low_freq_factor"]),
                   "high_freq_factor": float(rp["high_freq_factor"]),
                   "original_max_position_embeddings": int(orig or mpe)}
    elif kind == "yarn":
        orig = int(orig or mpe)
        factor = float(rp.get("factor") or mpe / orig)
        af = rp.get("attention_factor")
        if af is None:
            af = yarn_attention_factor(factor, rp.get("mscale"), rp.get("mscale_all_dim"))
        scaling = {"rope_type": kind, "factor": factor, "original_max_position_embeddings": orig,
                   "attention_factor": float(af), "beta_fast": float(rp.get("beta_fast") or 32),
                   "beta_slow": float(rp.get("beta_slow") or 1), "truncate": bool(rp.get("truncate", True))}
    elif kind in ("longrope", "su"):
        orig = int(_get(cfg, "original_max_position_embeddings") or orig or mpe)
        factor = rp.get("factor") or mpe / orig
        af = rp.get("attention_factor")
        if af is None:
            af = longrope_attention_factor(float(factor), orig)
        scaling = {"rope_type": "longrope", "short_factor": [float(x) for x in rp["short_factor"]],
                   "long_factor": [float(x) for x in rp["long_factor"]], "original_max_position_embeddings": orig,
                   "attention_factor": float(af)}
    else:
        raise _unsupported(field, "this RoPE type is not modelled (default, linear, dynamic, llama3, yarn, longrope)")
    return {"theta": float(theta), "scaling": scaling, "partial": float(partial or 1.0), "local_theta": local_theta}


def sliding_windows(cfg, n_layers: int, where: str) -> list[int]:
    """Per-layer attention window (0 = none), as transformers builds its masks: layer_types marks the
    sliding layers (Gemma 2/3, Qwen2/3 with use_sliding_window); without layer_types a sliding_window
    applies to every layer (Mistral, Mixtral)."""
    window = _get(cfg, "sliding_window")
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return [0] * n_layers
    types_ = getattr(cfg, "layer_types", None)
    if types_ is None:
        return [int(window)] * n_layers
    if len(types_) != n_layers:
        raise CflowError(f"{where}.layer_types has {len(types_)} entries for {n_layers} layers")
    odd = sorted(set(types_) - {"full_attention", "sliding_attention"})
    if odd:
        raise _unsupported(f"{where}.layer_types", f"layer type {odd[0]!r} is not modelled")
    return [int(window) if t == "sliding_attention" else 0 for t in types_]


def context_length(cfg, where: str = "config", max_seq_len: int | None = None) -> int:
    """Our context: max_position_embeddings capped at MAX_CONTEXT (or max_seq_len)."""
    return int(max_seq_len or min(int(_get(cfg, "max_position_embeddings", MAX_CONTEXT)), MAX_CONTEXT))


def activation_of(cfg, where: str) -> str:
    name = _get(cfg, "hidden_activation") or _get(cfg, "hidden_act", "silu")
    act = _ACTIVATIONS.get(str(name))
    if act is None:
        raise _unsupported(f"{where}.hidden_act={name!r}",
                           "only SiLU (SwiGLU) and tanh-GELU (GeGLU) gates are modelled")
    return act


def check_hf_config(cfg, where: str = "config") -> None:
    """Reject config-level features the IR lacks (the structure is checked from modules or tensors)."""
    mt = _get(cfg, "model_type")
    if mt in _REFUSED_TYPES:
        raise _unsupported(f"{where}: model_type={mt!r}", _REFUSED_TYPES[mt])
    for field, what in _UNMODELLED_FIELDS.items():
        v = getattr(cfg, field, None)
        if v not in (None, 0, 1, 1.0, False):
            raise _unsupported(f"{where}.{field}={v!r}", f"{what} is not modelled by the IR")
    nr = getattr(cfg, "no_rope_layers", None)
    if nr and not all(nr):
        raise _unsupported(f"{where}.no_rope_layers", "layers without RoPE are not modelled")
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        raise _unsupported(f"{where}.pretraining_tp={cfg.pretraining_tp}", "tensor-parallel slicing is not modelled")
    if _get(cfg, "is_encoder_decoder", False):
        raise _unsupported(where, "encoder-decoder models are not modelled")


def hf_model_config(cfg, kinds: list[dict], values: dict, *, name: str, where: str = "config",
                    max_seq_len: int | None = None) -> tuple[ModelConfig, Folds]:
    """ModelConfig of a decoder built from Llama's parts, and the folds its weights need.

    kinds: per layer {'attn_bias', 'mlp': 'dense'|'moe', 'shared', 'qk_norm', 'post_norms', ...} (tensor names);
    values: what the modules or the config say (eps, norm_offset, act, embed_scale, attn_scale, attn_softcap,
    windows, tied, top_k, norm_topk, dims)."""
    check_hf_config(cfg, where)
    L = int(cfg.num_hidden_layers)
    if len(kinds) != L:
        raise CflowError(f"{where}.num_hidden_layers={L}, but the weights hold {len(kinds)} layers")
    d = int(cfg.hidden_size)
    n_heads = int(cfg.num_attention_heads)
    n_kv = int(_get(cfg, "num_key_value_heads", n_heads))
    hd = int(values.get("head_dim") or _get(cfg, "head_dim") or d // n_heads)
    for key, what in (("attn_bias", "q/k/v biases"), ("qk_norm", "q/k norms"),
                      ("post_norms", "post-attention / post-feed-forward norms")):
        seen = {k[key] for k in kinds}
        if len(seen) > 1:
            raise _unsupported(where, f"{what} on some layers only are not modelled")
    rope = rope_of(cfg, where)
    rope_dim = int(hd * rope["partial"])
    if rope_dim % 2 or not 2 <= rope_dim <= hd:
        raise _unsupported(f"{where}.partial_rotary_factor={rope['partial']}",
                           f"{rope_dim} rotated dimensions of {hd} is not modelled (needs an even count)")
    ctx = context_length(cfg, where, max_seq_len)
    sc = rope["scaling"]
    if sc and sc["rope_type"] == "dynamic" and ctx > sc["original_max_position_embeddings"]:
        warnings.warn(f"{where}: dynamic RoPE is computed for the compiled context of {ctx} tokens (transformers "
                      "recomputes it per sequence length past max_position_embeddings)", stacklevel=3)
    if sc and sc["rope_type"] == "longrope" and ctx > sc["original_max_position_embeddings"]:
        warnings.warn(f"{where}: longrope uses its long factors at every position for a context of {ctx} > "
                      f"{sc['original_max_position_embeddings']} tokens (transformers uses the short ones for "
                      "shorter sequences; compile with max_seq_len <= "
                      f"{sc['original_max_position_embeddings']} for them)", stacklevel=3)
    windows = values["windows"]
    wset = {w for w in windows if w}
    if len(wset) > 1:
        raise _unsupported(f"{where}.sliding_window", "different window sizes per layer are not modelled")
    window = wset.pop() if wset else 0
    sliding = [l + 1 for l, w in enumerate(windows) if w]
    kw: dict = {}
    if window and window < ctx:
        kw.update(sliding_window=window, sliding_layers=None if len(sliding) == L else sliding)
    if rope["local_theta"] and kw.get("sliding_window") and rope["local_theta"] != rope["theta"]:
        kw["local_rope_theta"] = rope["local_theta"]
    elif rope["local_theta"] and rope["local_theta"] != rope["theta"] and sliding and not kw:
        # the window does not bite at this context, but the sliding layers still use their own RoPE base
        kw.update(sliding_window=window, sliding_layers=None if len(sliding) == L else sliding,
                  local_rope_theta=rope["local_theta"])
    dense = [l + 1 for l, k in enumerate(kinds) if k["mlp"] == "dense"]
    moe = [l + 1 for l, k in enumerate(kinds) if k["mlp"] == "moe"]
    shared = {bool(k.get("shared")) for k in kinds if k["mlp"] == "moe"}
    dims = values.get("dims", {})
    if moe:
        n_exp = int(dims.get("n_experts") or _get(cfg, "num_local_experts") or _get(cfg, "num_experts"))
        e_dim = int(dims.get("expert_dim") or _get(cfg, "moe_intermediate_size") or cfg.intermediate_size)
        norm_topk = values.get("norm_topk")
        if norm_topk is None:
            norm_topk = bool(getattr(cfg, "norm_topk_prob", True))  # Mixtral-style routers always renormalise
        top_k = int(values.get("top_k") or cfg.num_experts_per_tok)
        kw.update(n_experts=n_exp, top_k=top_k, expert_dim=e_dim, norm_topk=bool(norm_topk))
        if True in shared:
            kw.update(shared_expert_dim=int(dims.get("shared_dim") or cfg.shared_expert_intermediate_size),
                      shared_expert_gate=True)
        if dense:  # dense-only layers (Qwen2-MoE / Qwen3-MoE mlp_only_layers, decoder_sparse_step)
            kw.update(ffn_dim=int(dims.get("ffn_dim") or cfg.intermediate_size), dense_layers=dense, moe_layers=moe)
    else:
        kw.update(ffn_dim=int(dims.get("ffn_dim") or cfg.intermediate_size))
    softcap = float(values.get("attn_softcap") or 0.0)
    final_cap = float(_get(cfg, "final_logit_softcapping", 0.0) or 0.0)
    embed_mult = float(_get(cfg, "embedding_multiplier", 1.0))
    logit_div = float(_get(cfg, "logits_scaling", 1.0))
    folds = Folds(norm_offset=float(values.get("norm_offset", 0.0)),
                  embed_scale=float(values.get("embed_scale", 1.0)) * embed_mult,
                  logit_scale=1.0 / logit_div, residual_scale=float(_get(cfg, "residual_multiplier", 1.0)),
                  q_scale=float(values.get("attn_scale", hd ** -0.5)) * math.sqrt(hd), rope_dim=rope_dim)
    c = ModelConfig(
        name=name, vocab_size=int(cfg.vocab_size), d_model=d, n_layers=L, n_heads=n_heads, n_kv_heads=n_kv,
        head_dim=hd, rope_theta=rope["theta"], norm_eps=float(values["eps"]), max_seq_len=ctx,
        tie_embeddings=bool(values["tied"]), attn_bias=kinds[0]["attn_bias"] if kinds else False,
        rope_scaling=sc, rope_dim=rope_dim, qk_norm=kinds[0]["qk_norm"] if kinds else "",
        activation=values["act"], post_norms=bool(kinds and kinds[0]["post_norms"]), attn_softcap=softcap,
        final_softcap=final_cap, **kw)
    return c, folds


# --- live modules: structure walked, numerics probed ---------------------------------------------
_EXPECTED = {
    "": {"model", "lm_head"},
    "model": {"embed_tokens", "layers", "norm", "rotary_emb"},
    "layer": {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
              "post_feedforward_layernorm"},
    "self_attn": {"q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "q_norm", "k_norm"},
    "dense": {"gate_proj", "up_proj", "down_proj", "gate_up_proj", "act_fn", "activation_fn"},
    "moe": {"gate", "experts", "shared_expert", "shared_expert_gate"},
}
_HINTS = {"sinks": "attention sinks", "router": "a router under another name",
          "rotary_emb_local": "a second RoPE module", "vision_tower": "a vision tower"}


def _children(mod, path: str, kind: str) -> dict:
    import torch

    kids = {}
    for k, child in mod.named_children():
        if isinstance(child, torch.nn.Dropout):  # identity in eval mode (Phi-3's residual dropouts)
            continue
        if k not in _EXPECTED[kind]:
            hint = _HINTS.get(k, type(child).__name__)
            where = f"{path}.{k}" if path else k
            raise _unsupported(where, f"{hint} ({type(child).__name__}) not modelled by the IR "
                                      f"(expected only {', '.join(sorted(_EXPECTED[kind]))} in {path or 'the model'})")
        kids[k] = child
    return kids


def _need(kids: dict, path: str, *names: str) -> None:
    missing = [n for n in names if n not in kids]
    if missing:
        raise _unsupported(path, f"has no {missing[0]} (it has {', '.join(sorted(kids)) or 'no children'})")


def probe_norm(mod, path: str, dim: int) -> tuple[float, float]:
    """(eps, offset) of an RMSNorm-like module, by running it: y = x / sqrt(mean(x^2) + eps) * (offset + w)."""
    import torch

    w = getattr(mod, "weight", None)
    eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
    if w is None or eps is None or tuple(w.shape) != (dim,) or getattr(mod, "bias", None) is not None:
        raise _unsupported(path, f"{type(mod).__name__} is not an RMSNorm with a weight of shape ({dim},) "
                                 "and no bias")
    x = torch.randn(3, dim, generator=torch.Generator().manual_seed(0)) * 3 + 0.5
    with torch.no_grad():
        y = mod(x.to(w.dtype)).float()
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + float(eps))
        wf = w.detach().float()
        for offset in (0.0, 1.0):
            if torch.allclose(y, n * (offset + wf), rtol=2e-3 if w.dtype != torch.float32 else 1e-5, atol=1e-5):
                return float(eps), offset
    raise _unsupported(path, f"{type(mod).__name__} does not compute x / rms(x) * w nor x / rms(x) * (1 + w) "
                             "(only RMSNorm is modelled)")


def probe_activation(act, path: str) -> str:
    import torch

    if act is None:
        raise _unsupported(path, "no activation module")
    x = torch.linspace(-6, 6, 97)
    with torch.no_grad():
        try:
            y = act(x)
        except Exception as e:  # noqa: BLE001 -- whatever the module raises, it is not a pointwise activation
            raise _unsupported(path, f"activation {type(act).__name__} cannot be probed ({type(e).__name__})") from None
        refs = {"silu": torch.nn.functional.silu(x),
                "gelu_tanh": torch.nn.functional.gelu(x, approximate="tanh")}
        for name, ref in refs.items():
            if torch.allclose(y, ref, atol=1e-6, rtol=1e-5):
                return name
    raise _unsupported(path, f"activation {type(act).__name__} is not modelled (only SiLU and tanh-GELU)")


def _probe_embedding(emb, path: str) -> float:
    import torch

    if not isinstance(emb, torch.nn.Embedding):
        raise _unsupported(path, f"{type(emb).__name__} is not an embedding table")
    ids = torch.arange(min(8, emb.num_embeddings))
    with torch.no_grad():
        y, w = emb(ids).float(), emb.weight[ids].float()
    nz = w.abs() > 1e-6
    if not bool(nz.any()):
        return 1.0
    ratio = (y[nz] / w[nz])
    s = float(ratio.median())
    if not torch.allclose(y, w * s, rtol=1e-2 if emb.weight.dtype != torch.float32 else 1e-5, atol=1e-6):
        raise _unsupported(path, f"{type(emb).__name__} is not a (scaled) embedding lookup")
    return 1.0 if abs(s - 1.0) < 1e-6 else s


def _check_linear(mod, path: str, bias_ok: bool) -> bool:
    import torch

    if not isinstance(mod, torch.nn.Linear):
        raise _unsupported(path, f"{type(mod).__name__} is not a Linear")
    if mod.bias is not None and not bias_ok:
        raise _unsupported(f"{path}.bias", "this projection's bias is not modelled by the IR")
    return mod.bias is not None


def _walk(module, cfg) -> dict:
    """Check every block of the module tree against the parts the IR models and read the values the
    modules hold (probed norms, activation, embedding scale, attention scaling / soft-cap / window,
    tying, routers). Returns `values` for hf_model_config."""
    top = _children(module, "", "")
    _need(top, type(module).__name__, "model", "lm_head")
    model = _children(top["model"], "model", "model")
    _need(model, "model", "embed_tokens", "layers", "norm")
    d = int(cfg.hidden_size)
    eps, offset = probe_norm(model["norm"], "model.norm", d)
    eps_set, offsets = {eps}, {offset}
    _check_linear(top["lm_head"], "lm_head", bias_ok=False)
    embed_scale = _probe_embedding(model["embed_tokens"], "model.embed_tokens")
    acts, scales, caps, windows, head_dims, topks, norms = set(), set(), set(), [], set(), set(), set()
    n_layers = len(model["layers"])
    cfg_windows = sliding_windows(cfg, n_layers, "config")
    for i, layer in enumerate(model["layers"]):
        p = f"model.layers.{i}"
        kids = _children(layer, p, "layer")
        _need(kids, p, "self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
        sandwich = "pre_feedforward_layernorm" in kids or "post_feedforward_layernorm" in kids
        if sandwich:
            _need(kids, p, "pre_feedforward_layernorm", "post_feedforward_layernorm")
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            if n in kids:
                e, o = probe_norm(kids[n], f"{p}.{n}", d)
                eps_set.add(e)
                offsets.add(o)
        attn = kids["self_attn"]
        a = _children(attn, f"{p}.self_attn", "self_attn")
        if "qkv_proj" in a:
            _need(a, f"{p}.self_attn", "qkv_proj", "o_proj")
            _check_linear(a["qkv_proj"], f"{p}.self_attn.qkv_proj", bias_ok=False)
        else:
            _need(a, f"{p}.self_attn", "q_proj", "k_proj", "v_proj", "o_proj")
            bias = {_check_linear(a[n], f"{p}.self_attn.{n}", bias_ok=True) for n in ("q_proj", "k_proj", "v_proj")}
            if len(bias) > 1:
                raise _unsupported(f"{p}.self_attn", "biases on only some of q/k/v are not modelled")
        _check_linear(a["o_proj"], f"{p}.self_attn.o_proj", bias_ok=False)
        hd = int(getattr(attn, "head_dim", 0) or _get(cfg, "head_dim") or d // int(cfg.num_attention_heads))
        head_dims.add(hd)
        if ("q_norm" in a) != ("k_norm" in a):
            raise _unsupported(f"{p}.self_attn", "a q norm without a k norm (or vice versa) is not modelled")
        for n in ("q_norm", "k_norm"):
            if n in a:
                w = getattr(a[n], "weight", None)
                dim = int(w.shape[0]) if w is not None and w.ndim == 1 else hd
                e, o = probe_norm(a[n], f"{p}.self_attn.{n}", dim)
                eps_set.add(e)
                offsets.add(o)
        scales.add(float(getattr(attn, "scaling", hd ** -0.5)))
        caps.add(float(getattr(attn, "attn_logit_softcapping", None) or 0.0))
        w = getattr(attn, "sliding_window", cfg_windows[i])
        windows.append(int(w or 0))
        mlp = kids["mlp"]
        if hasattr(mlp, "experts"):
            m = _children(mlp, f"{p}.mlp", "moe")
            _need(m, f"{p}.mlp", "gate", "experts")
            ex = m["experts"]
            if (getattr(ex, "has_bias", False) or not getattr(ex, "has_gate", True)
                    or getattr(ex, "is_transposed", False) or not getattr(ex, "is_concatenated", True)
                    or getattr(ex, "has_post_expert_norm", False)):
                raise _unsupported(f"{p}.mlp.experts", "expert layout other than fused [gate; up] SwiGLU without bias")
            acts.add(probe_activation(getattr(ex, "act_fn", None), f"{p}.mlp.experts.act_fn"))
            for n, child in ex.named_children():
                if n != "act_fn":
                    raise _unsupported(f"{p}.mlp.experts.{n}", f"{type(child).__name__} not modelled")
            gate = m["gate"]
            if getattr(gate, "bias", None) is not None or hasattr(gate, "e_score_correction_bias"):
                raise _unsupported(f"{p}.mlp.gate", "router biases are not modelled")
            topks.add(int(gate.top_k))
            norms.add(bool(getattr(gate, "norm_topk_prob", True)))
            if ("shared_expert" in m) != ("shared_expert_gate" in m):
                raise _unsupported(f"{p}.mlp", "a shared expert without its sigmoid gate (or vice versa) is not "
                                               "modelled")
            if "shared_expert" in m:
                s = _children(m["shared_expert"], f"{p}.mlp.shared_expert", "dense")
                for n in ("gate_proj", "up_proj", "down_proj"):
                    _need(s, f"{p}.mlp.shared_expert", n)
                    _check_linear(s[n], f"{p}.mlp.shared_expert.{n}", bias_ok=False)
                acts.add(probe_activation(s.get("act_fn"), f"{p}.mlp.shared_expert.act_fn"))
                _check_linear(m["shared_expert_gate"], f"{p}.mlp.shared_expert_gate", bias_ok=False)
        else:
            m = _children(mlp, f"{p}.mlp", "dense")
            projs = ("gate_up_proj", "down_proj") if "gate_up_proj" in m else ("gate_proj", "up_proj", "down_proj")
            for n in projs:
                _need(m, f"{p}.mlp", n)
                _check_linear(m[n], f"{p}.mlp.{n}", bias_ok=False)
            act_name = "activation_fn" if "activation_fn" in m else "act_fn"
            acts.add(probe_activation(m.get(act_name), f"{p}.mlp.{act_name}"))
    if len(eps_set) > 1:
        raise _unsupported("model", f"RMSNorm epsilons differ between norms ({sorted(eps_set)}); one eps is modelled")
    if len(offsets) > 1:
        raise _unsupported("model", "norms of both forms (w and 1 + w) in one model are not modelled")
    if len(acts) > 1:
        raise _unsupported("model", f"different activations per block ({sorted(acts)}) are not modelled")
    if len(head_dims) > 1 or len(topks) > 1 or len(norms) > 1 or len(scales) > 1 or len(caps) > 1:
        raise _unsupported("model.layers", "per-layer head_dim / top_k / router normalisation / attention scaling "
                                           "differ")
    tied = top["lm_head"].weight.data_ptr() == model["embed_tokens"].weight.data_ptr()
    return dict(eps=eps_set.pop(), norm_offset=offsets.pop(), act=acts.pop() if acts else "silu",
                embed_scale=embed_scale, head_dim=head_dims.pop() if head_dims else None,
                attn_scale=scales.pop() if scales else None, attn_softcap=caps.pop() if caps else 0.0,
                windows=windows, tied=tied, top_k=topks.pop() if topks else None,
                norm_topk=norms.pop() if norms else None, rotary=model.get("rotary_emb"))


def _check_rotary(rot, c: ModelConfig) -> None:
    """The module's RoPE buffers must be what ir/rope.py computes for the config (the frequencies and the
    attention factor; per layer type for Gemma 3)."""
    if rot is None:
        return
    for lt, theta, scaling in (("", c.rope_theta, c.rope_scaling),
                               ("full_attention_", c.rope_theta, c.rope_scaling),
                               ("sliding_attention_", c.local_rope_theta or c.rope_theta,
                                None if c.local_rope_theta else c.rope_scaling)):
        buf = getattr(rot, f"{lt}inv_freq", None)
        if buf is None:
            continue
        mine, factor = inv_freq(c.head_dim, theta, scaling, c.rope_dim, c.max_seq_len)
        got = buf.detach().float().numpy()
        wanted = [mine[: c.rope_dim // 2]]
        sd = scaling_dict(scaling) or {}
        if sd.get("rope_type") == "longrope":
            # transformers swaps the buffer between longrope's short and long sets by the length of the last
            # forward call, so a module holds either; cflow's choice (by the compiled context) is checked by the
            # frequencies of both sets being the config's
            short, _ = inv_freq(c.head_dim, theta, scaling, c.rope_dim, int(sd["original_max_position_embeddings"]))
            wanted.append(short[: c.rope_dim // 2])
        if not any(got.shape == w.shape and np.allclose(got, w, rtol=1e-5, atol=0) for w in wanted):
            what = scaling_label(scaling) or "default RoPE"
            raise _unsupported(f"model.rotary_emb.{lt}inv_freq",
                               f"does not match {what} with rope_theta={theta:g} over {c.rope_dim} dimensions")
        att = getattr(rot, f"{lt}attention_scaling", 1.0)
        if not math.isclose(float(att), factor, rel_tol=1e-6):
            raise _unsupported(f"model.rotary_emb.{lt}attention_scaling={att}", f"expected {factor:g} for the config's "
                                                                              "RoPE scaling")


class _ModuleSource:
    """HF tensor names -> tensors of a live module (the state dict)."""

    def __init__(self, module):
        self.sd = {k: v for k, v in module.state_dict().items()}

    def keys(self):
        return set(self.sd)

    def shape(self, key):
        return tuple(self.sd[key].shape)

    def load(self, key, index=None) -> np.ndarray:
        t = self.sd[key].detach()
        if index is not None:
            t = t[index]
        return np.ascontiguousarray(t.to("cpu").float().numpy())


def from_hf_module(module, name: str | None = None, max_seq_len: int | None = None, probe: bool = True
                   ) -> Graph | None:
    """A transformers causal LM (any class built from Llama's parts) -> Graph; None if `module` is not a
    transformers model at all. probe: first check that the import reproduces this class's own forward
    (frontend/probe.py)."""
    cfg = getattr(module, "config", None)
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    if cfg is None or not isinstance(module, PreTrainedModel):
        return None
    cls = type(module).__name__
    if not (hasattr(module, "lm_head") and hasattr(getattr(module, "model", None), "layers")):
        raise _unsupported(cls, "unsupported model class: expected a decoder-only causal LM with .model.layers "
                                "and .lm_head (a *ForCausalLM built from Llama's parts)")
    check_hf_config(cfg, "config")
    values = _walk(module, cfg)  # names the first unmodelled block
    src = _ModuleSource(module)
    kinds = layer_kinds_from_names(src.keys(), int(cfg.num_hidden_layers), where=cls)
    resolve_qk_norm(kinds, src, int(values["head_dim"] or cfg.hidden_size // cfg.num_attention_heads), cls)
    values["dims"] = _dims(src, kinds)
    name = name or Path(str(getattr(cfg, "name_or_path", "") or "")).name or _get(cfg, "model_type", cls)
    config, folds = hf_model_config(cfg, kinds, values, name=name, max_seq_len=max_seq_len)
    _check_rotary(values["rotary"], config)
    plan = hf_weight_plan(config, kinds, src, where=cls, folds=folds)
    g = build_graph(config, {k: load() for k, load in plan.items()}, name=name)
    g.meta.eos_token_ids = _eos_from(getattr(module, "generation_config", None), cfg)
    g.meta.source = f"transformers:{cls}"
    if probe:
        from .probe import probe_context, probe_module_class

        ctx = probe_context(config)
        probe_module_class(type(module), cfg, lambda m: from_hf_module(m, probe=False, max_seq_len=ctx), cls)
    return verify(g)


def _dims(src, kinds) -> dict:
    """Expert count and widths from the tensor shapes (the config's names for them vary by family)."""
    keys = {k.replace(".block_sparse_moe.", ".mlp."): k for k in src.keys()}
    out: dict = {}
    for i, k in enumerate(kinds):
        p = f"model.layers.{i}.mlp"
        if k["mlp"] == "moe" and "n_experts" not in out:
            out["n_experts"] = src.shape(keys[f"{p}.gate.weight"])[0]
            fused = keys.get(f"{p}.experts.gate_up_proj")
            if fused is not None:
                out["expert_dim"] = src.shape(fused)[1] // 2
            else:
                for leg in ("w1", "gate_proj"):
                    if f"{p}.experts.0.{leg}.weight" in keys:
                        out["expert_dim"] = src.shape(keys[f"{p}.experts.0.{leg}.weight"])[0]
            if f"{p}.shared_expert.gate_proj.weight" in keys:
                out["shared_dim"] = src.shape(keys[f"{p}.shared_expert.gate_proj.weight"])[0]
        if k["mlp"] == "dense" and "ffn_dim" not in out:
            if f"{p}.gate_up_proj.weight" in keys:
                out["ffn_dim"] = src.shape(keys[f"{p}.gate_up_proj.weight"])[0] // 2
            elif f"{p}.gate_proj.weight" in keys:
                out["ffn_dim"] = src.shape(keys[f"{p}.gate_proj.weight"])[0]
    return out


def _eos_from(*objs) -> list[int]:
    for o in objs:
        v = getattr(o, "eos_token_id", None) if o is not None else None
        if v is not None:
            return [int(x) for x in (v if isinstance(v, (list, tuple)) else [v])]
    return []


# --- model directories ----------------------------------------------------------------------
def _read_hf_config(path: Path):
    """config.json through transformers when it knows the model_type (its defaults and normalisations),
    else as plain JSON (a Llama-like decoder under another name)."""
    p = path / "config.json"
    try:
        raw = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise CflowError(f"{p}: cannot read config ({e})") from None
    if not isinstance(raw, dict):
        raise CflowError(f"{p}: expected a JSON object")
    mt = raw.get("model_type")
    if mt in _REFUSED_TYPES:
        raise _unsupported(f"{p}: model_type={mt!r}", _REFUSED_TYPES[mt])
    if "text_config" in raw and "num_hidden_layers" not in raw:
        raise _unsupported(f"{p}: model_type={mt!r}", "a multimodal checkpoint (text_config): not a causal LM")
    try:
        from transformers import CONFIG_MAPPING, AutoConfig
    except ImportError:
        CONFIG_MAPPING = {}
    if mt in CONFIG_MAPPING:
        try:
            return AutoConfig.from_pretrained(str(path), local_files_only=True)
        except Exception as e:  # transformers validates fields strictly
            raise CflowError(f"{p}: invalid {mt} config ({type(e).__name__}: {e})") from None
    for f in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        v = raw.get(f)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise CflowError(f"{p}: field {f}={v!r}: expected a positive integer (a Llama-like config)")
    return types.SimpleNamespace(**raw)


def _dir_values(cfg, kinds, where: str) -> dict:
    quirks = _DIR_QUIRKS.get(_get(cfg, "model_type"), {})
    d = int(cfg.hidden_size)
    hd = int(_get(cfg, "head_dim") or d // int(cfg.num_attention_heads))
    if _get(cfg, "query_pre_attn_scalar"):
        scale = float(cfg.query_pre_attn_scalar) ** -0.5
    elif _get(cfg, "attention_multiplier"):
        scale = float(cfg.attention_multiplier)
    else:
        scale = hd ** -0.5
    eps = _get(cfg, "rms_norm_eps")
    if eps is None:
        raise _unsupported(f"{where}.rms_norm_eps", "missing (only RMSNorm models are read)")
    return dict(eps=float(eps), norm_offset=quirks.get("norm_offset", 0.0), act=activation_of(cfg, where),
                embed_scale=math.sqrt(d) if quirks.get("embed_scale") == "sqrt_d" else 1.0, head_dim=hd,
                attn_scale=scale, attn_softcap=float(_get(cfg, "attn_logit_softcapping", 0.0) or 0.0),
                windows=sliding_windows(cfg, int(cfg.num_hidden_layers), where),
                tied=bool(_get(cfg, "tie_word_embeddings", False)), top_k=_get(cfg, "num_experts_per_tok"),
                norm_topk=getattr(cfg, "norm_topk_prob", None))


def from_hf_dir(path, name: str | None = None, max_seq_len: int | None = None, probe: bool = True) -> Graph:
    """A Hugging Face model directory -> Graph with lazily read float32 weights, tokenizer, chat template, eos ids.
    probe: first check, on a small model of the directory's class saved the same way, that this import reproduces
    the class's own forward (frontend/probe.py; skipped where transformers does not know the class)."""
    path = Path(path)
    cfg = _read_hf_config(path)
    where = f"{path / 'config.json'}"
    check_hf_config(cfg, where)
    src = SafetensorsDir(path)
    kinds = layer_kinds_from_names(src.keys(), int(cfg.num_hidden_layers), where=str(path))
    values = _dir_values(cfg, kinds, where)
    resolve_qk_norm(kinds, src, values["head_dim"], str(path))
    values["dims"] = _dims(src, kinds)
    config, folds = hf_model_config(cfg, kinds, values, name=name or path.resolve().name, where=where,
                                    max_seq_len=max_seq_len)
    plan = hf_weight_plan(config, kinds, src, where=str(path), folds=folds)
    shapes = weight_shapes(config)
    g = build_graph(config, None, name=config.name)
    g.weights = LazyWeights(plan)
    missing = sorted(set(shapes) - set(plan))  # shapes were checked against the headers: nothing read yet
    if missing:
        raise CflowError(f"{path}: no tensor for weight {missing[0]!r}")
    g.meta.tokenizer = read_tokenizer(path)
    g.meta.chat_template = read_chat_template(path)
    g.meta.eos_token_ids = eos_token_ids(path, cfg)
    g.meta.special_tokens = read_special_tokens(path, g.meta.tokenizer)
    g.meta.source = f"hf-dir:{_get(cfg, 'model_type', 'unknown')}"
    if probe:
        _probe_dir(cfg, path, g.config)
    return verify(g)


def _probe_dir(cfg, path: Path, config: ModelConfig) -> None:
    """The directory import checked against its class's forward (frontend/probe.py): a probe model saved with
    save_pretrained to a temporary directory and read back by from_hf_dir, the path the user's files take."""
    import tempfile

    try:
        import transformers
    except ImportError:
        return
    archs = list(_get(cfg, "architectures", []) or [])
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None or not hasattr(cfg, "to_json_string"):
        return  # a Llama-like config transformers does not know: nothing to compare against

    from .probe import probe_context, probe_module_class

    ctx = probe_context(config)

    def importer(module):
        with tempfile.TemporaryDirectory(prefix="cflow-probe-") as tmp:
            module.save_pretrained(tmp, safe_serialization=True)
            g = from_hf_dir(tmp, probe=False, max_seq_len=ctx)
            g.weights = {k: g.weights[k] for k in g.meta.shapes}  # read before the directory goes
            return g

    probe_module_class(cls, cfg, importer, f"{path}: {archs[0]}")


__all__ = ["from_hf_module", "from_hf_dir", "hf_model_config", "check_hf_config", "rope_of", "Folds",
           "probe_norm", "probe_activation"]
