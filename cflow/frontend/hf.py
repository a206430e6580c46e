"""Hugging Face causal LMs -> IR: live modules (`from_hf_module`) and model directories (`from_hf_dir`).

Supported (transformers 5.23): LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM and
Qwen2MoeForCausalLM. Blocks are recognised from the module structure (or, for a directory, from
the tensor names), every numeric knob is read from the model, and anything the IR does not model
is rejected with UnsupportedModelError naming the module path, tensor or config field.
A directory is converted tensor by tensor from its safetensors shards, without building the
torch model: `graph.weights` is a lazy mapping that reads one tensor per access.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from ..errors import CflowError, UnsupportedModelError
from ..ir import Graph, build_graph, verify, weight_shapes
from ..ir.config import ModelConfig
from .hf_weights import eos_token_ids, hf_weight_plan, layer_kinds_from_names, read_tokenizer
from .tensors import LazyWeights, SafetensorsDir

# Architecture class -> model_type; the model_type names the family in config.json.
SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}
MAX_CONTEXT = 4096  # max_seq_len cap: the KV cache is sized by it (override with max_seq_len=)

# Config fields of other families that change the function; rejected when set (belt and braces).
_UNMODELLED_FIELDS = {
    "attn_logit_softcapping": "attention logit soft-capping",
    "final_logit_softcapping": "final logit soft-capping",
    "logit_softcapping": "logit soft-capping",
    "embedding_multiplier": "embedding scaling",
    "scale_emb": "embedding scaling",
    "logits_scaling": "logit scaling",
    "residual_multiplier": "residual scaling",
    "attention_multiplier": "attention scaling",
}


def _unsupported(where: str, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{where}: {what}")


# --- config checks shared by modules and directories ----------------------------------------
def check_hf_config(cfg, where: str = "config") -> str:
    """Reject config-level features the IR lacks; returns the model_type."""
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED.values():
        archs = getattr(cfg, "architectures", None) or [model_type]
        raise _unsupported(f"{where}.model_type={model_type!r}",
                           f"unsupported model family {archs[0]} (supported: {', '.join(SUPPORTED)})")
    for field, what in _UNMODELLED_FIELDS.items():
        v = getattr(cfg, field, None)
        if v not in (None, 0, 1, 1.0, False):
            raise _unsupported(f"{where}.{field}={v!r}", f"{what} is not modelled by the IR")
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise _unsupported(f"{where}.hidden_act={act!r}", "only SiLU (SwiGLU) feed-forwards are modelled")
    rp = getattr(cfg, "rope_parameters", None) or {}
    if "rope_type" not in rp and any(isinstance(v, dict) for v in rp.values()):
        raise _unsupported(f"{where}.rope_parameters", "per-layer-type RoPE parameters are not modelled")
    rope_type = rp.get("rope_type", "default")
    if rope_type != "default":
        raise _unsupported(f"{where}.rope_parameters.rope_type={rope_type!r}",
                           "only default RoPE is modelled (no rope scaling)")
    prf = rp.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        raise _unsupported(f"{where}.partial_rotary_factor={prf!r}", "partial rotary embeddings are not modelled")
    if "rope_theta" not in rp:
        raise _unsupported(f"{where}.rope_parameters", "has no rope_theta")
    if getattr(cfg, "mlp_bias", False):
        raise _unsupported(f"{where}.mlp_bias=True", "feed-forward biases are not modelled")
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        raise _unsupported(f"{where}.pretraining_tp={cfg.pretraining_tp}", "tensor-parallel slicing is not modelled")
    return model_type


def context_length(cfg, where: str = "config", max_seq_len: int | None = None) -> int:
    """Our context: max_position_embeddings capped at MAX_CONTEXT (or max_seq_len); rejects biting sliding windows."""
    ctx = int(max_seq_len or min(int(getattr(cfg, "max_position_embeddings", 0) or MAX_CONTEXT), MAX_CONTEXT))
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return ctx
    if getattr(cfg, "model_type", "") == "qwen2_moe":
        # Qwen2-MoE windows only the layers layer_types marks, and only with use_sliding_window.
        layer_types = getattr(cfg, "layer_types", None) or []
        bites = bool(getattr(cfg, "use_sliding_window", False)) and "sliding_attention" in layer_types
    else:
        bites = True  # Mistral / Mixtral: one window on every layer
    if bites and int(window) < ctx:
        raise _unsupported(f"{where}.sliding_window={window}",
                           f"a sliding window shorter than the context ({ctx} tokens) is not modelled "
                           f"(pass max_seq_len <= {window} to compile for a shorter context)")
    return ctx


def hf_model_config(cfg, kinds: list[dict], *, name: str, where: str = "config", head_dim: int | None = None,
                    norm_eps: float | None = None, top_k: int | None = None, norm_topk: bool | None = None,
                    tied: bool | None = None, max_seq_len: int | None = None) -> ModelConfig:
    """ModelConfig of a supported HF model. kinds: per layer {'attn_bias', 'mlp': 'dense'|'moe', 'shared'}.

    Keyword overrides carry values read from a live module (they win over the config)."""
    model_type = check_hf_config(cfg, where)
    L = int(cfg.num_hidden_layers)
    if len(kinds) != L:
        raise CflowError(f"{where}.num_hidden_layers={L}, but the weights hold {len(kinds)} layers")
    n_heads = int(cfg.num_attention_heads)
    n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
    hd = int(head_dim or getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads)
    biases = {bool(k["attn_bias"]) for k in kinds}
    if len(biases) > 1:
        raise _unsupported(f"{where}", "q/k/v biases on some layers only are not modelled")
    dense = [l + 1 for l, k in enumerate(kinds) if k["mlp"] == "dense"]
    moe = [l + 1 for l, k in enumerate(kinds) if k["mlp"] == "moe"]
    shared = {bool(k.get("shared")) for k in kinds if k["mlp"] == "moe"}
    kw: dict = {}
    if moe:
        if model_type not in ("mixtral", "qwen2_moe"):
            raise _unsupported(f"{where}.model_type={model_type!r}",
                               "has MoE layers, which this family does not define")
        n_exp = int(cfg.num_local_experts if model_type == "mixtral" else cfg.num_experts)
        e_dim = int(cfg.intermediate_size if model_type == "mixtral" else cfg.moe_intermediate_size)
        if norm_topk is None:
            # Mixtral's router always renormalises the top-k; Qwen2-MoE follows norm_topk_prob.
            norm_topk = True if model_type == "mixtral" else bool(cfg.norm_topk_prob)
        kw.update(n_experts=n_exp, top_k=int(top_k or cfg.num_experts_per_tok), expert_dim=e_dim, norm_topk=norm_topk)
        if True in shared:
            kw.update(shared_expert_dim=int(cfg.shared_expert_intermediate_size), shared_expert_gate=True)
        if dense:  # dense-only layers (Qwen2-MoE mlp_only_layers / decoder_sparse_step)
            kw.update(ffn_dim=int(cfg.intermediate_size), dense_layers=dense, moe_layers=moe)
    else:
        kw.update(ffn_dim=int(cfg.intermediate_size))
    rp = cfg.rope_parameters
    tie = bool(getattr(cfg, "tie_word_embeddings", False)) if tied is None else tied
    return ModelConfig(
        name=name, vocab_size=int(cfg.vocab_size), d_model=int(cfg.hidden_size), n_layers=L, n_heads=n_heads,
        n_kv_heads=n_kv, head_dim=hd, rope_theta=float(rp["rope_theta"]),
        norm_eps=float(norm_eps if norm_eps is not None else cfg.rms_norm_eps),
        max_seq_len=context_length(cfg, where, max_seq_len), tie_embeddings=tie, attn_bias=biases == {True}, **kw)


# --- live modules ---------------------------------------------------------------------------
_EXPECTED = {
    "": {"model", "lm_head"},
    "model": {"embed_tokens", "layers", "norm", "rotary_emb"},
    "layer": {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"},
    "self_attn": {"q_proj", "k_proj", "v_proj", "o_proj"},
    "dense": {"gate_proj", "up_proj", "down_proj", "act_fn"},
    "moe": {"gate", "experts", "shared_expert", "shared_expert_gate"},
}
_REQUIRED = {k: v - {"rotary_emb", "act_fn", "shared_expert", "shared_expert_gate"} for k, v in _EXPECTED.items()}
_HINTS = {"q_norm": "q/k norms", "k_norm": "q/k norms", "pre_feedforward_layernorm": "extra feed-forward norms",
          "post_feedforward_layernorm": "extra feed-forward norms", "sinks": "attention sinks"}


def _children(mod, path: str, kind: str) -> dict:
    kids = dict(mod.named_children())
    for k, child in kids.items():
        if k not in _EXPECTED[kind]:
            hint = _HINTS.get(k, f"{type(child).__name__}")
            where = f"{path}.{k}" if path else k
            raise _unsupported(where, f"{hint} ({type(child).__name__}) not modelled by the IR "
                                      f"(expected only {', '.join(sorted(_EXPECTED[kind]))} in {path or 'the model'})")
    missing = sorted(_REQUIRED[kind] - set(kids))
    if missing:
        raise _unsupported(path or type(mod).__name__,
                           f"has no {missing[0]} (expected {', '.join(sorted(_REQUIRED[kind]))})")
    return kids


def _check_rmsnorm(mod, path: str, d: int) -> float:
    if not type(mod).__name__.endswith("RMSNorm") or not hasattr(mod, "variance_epsilon"):
        raise _unsupported(path, f"{type(mod).__name__} is not an RMSNorm")
    if type(mod).__name__.startswith(("Gemma",)):
        raise _unsupported(path, "(1 + w) RMSNorm variants are not modelled")
    if tuple(mod.weight.shape) != (d,) or getattr(mod, "bias", None) is not None:
        raise _unsupported(path, f"expected an RMSNorm weight of shape ({d},) and no bias")
    return float(mod.variance_epsilon)


def _check_linear(mod, path: str, bias_ok: bool) -> bool:
    import torch

    if not isinstance(mod, torch.nn.Linear):
        raise _unsupported(path, f"{type(mod).__name__} is not a Linear")
    if mod.bias is not None and not bias_ok:
        raise _unsupported(f"{path}.bias", "this projection's bias is not modelled by the IR")
    return mod.bias is not None


def _check_silu(act, path: str) -> None:
    import torch

    if not (isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"):
        raise _unsupported(path, f"activation {type(act).__name__} is not modelled (only SiLU)")


def _walk(module, cfg) -> tuple[list[dict], dict, np.ndarray | None]:
    """Recognise every block of a Llama-layout causal LM: per-layer kinds, values read from the modules
    (eps, head_dim, tying, top-k, renormalisation) and the RoPE inv_freq buffer."""
    top = _children(module, "", "")
    if "model" not in top or "lm_head" not in top:
        raise _unsupported(type(module).__name__, "expected .model and .lm_head (a *ForCausalLM)")
    model = _children(top["model"], "model", "model")
    d = int(cfg.hidden_size)
    eps = {_check_rmsnorm(model["norm"], "model.norm", d)}
    _check_linear(top["lm_head"], "lm_head", bias_ok=False)
    rot = model.get("rotary_emb")
    if rot is not None and (getattr(rot, "rope_type", "default") != "default"
                            or getattr(rot, "attention_scaling", 1.0) != 1.0):
        raise _unsupported("model.rotary_emb",
                           f"rope_type={getattr(rot, 'rope_type', None)!r} is not modelled (default only)")
    kinds, head_dims, topks, norms = [], set(), set(), set()
    for i, layer in enumerate(model["layers"]):
        p = f"model.layers.{i}"
        kids = _children(layer, p, "layer")
        eps.add(_check_rmsnorm(kids["input_layernorm"], f"{p}.input_layernorm", d))
        eps.add(_check_rmsnorm(kids["post_attention_layernorm"], f"{p}.post_attention_layernorm", d))
        attn = kids["self_attn"]
        a = _children(attn, f"{p}.self_attn", "self_attn")
        bias = {_check_linear(a[n], f"{p}.self_attn.{n}", bias_ok=n != "o_proj")
                for n in ("q_proj", "k_proj", "v_proj")}
        _check_linear(a["o_proj"], f"{p}.self_attn.o_proj", bias_ok=False)
        if len(bias) > 1:
            raise _unsupported(f"{p}.self_attn", "biases on only some of q/k/v are not modelled")
        hd = int(getattr(attn, "head_dim", 0))
        if not hd or not math.isclose(float(getattr(attn, "scaling", hd ** -0.5)), hd ** -0.5, rel_tol=1e-6):
            raise _unsupported(f"{p}.self_attn.scaling",
                               "attention scaling other than 1/sqrt(head_dim) is not modelled")
        head_dims.add(hd)
        mlp = kids["mlp"]
        if hasattr(mlp, "experts"):
            m = _children(mlp, f"{p}.mlp", "moe")
            ex = m["experts"]
            if (getattr(ex, "has_bias", False) or not getattr(ex, "has_gate", True)
                    or getattr(ex, "is_transposed", False) or not getattr(ex, "is_concatenated", True)
                    or getattr(ex, "has_post_expert_norm", False)):
                raise _unsupported(f"{p}.mlp.experts", "expert layout other than fused [gate; up] SwiGLU without bias")
            _check_silu(getattr(ex, "act_fn", None), f"{p}.mlp.experts.act_fn")
            for n, child in ex.named_children():
                if n != "act_fn":
                    raise _unsupported(f"{p}.mlp.experts.{n}", f"{type(child).__name__} not modelled")
            gate = m["gate"]
            if getattr(gate, "bias", None) is not None or hasattr(gate, "e_score_correction_bias"):
                raise _unsupported(f"{p}.mlp.gate", "router biases are not modelled")
            topks.add(int(gate.top_k))
            norms.add(bool(getattr(gate, "norm_topk_prob", True)))
            has_shared = "shared_expert" in m
            if has_shared != ("shared_expert_gate" in m):
                raise _unsupported(f"{p}.mlp",
                                   "a shared expert without its sigmoid gate (or vice versa) is not modelled")
            if has_shared:
                s = _children(m["shared_expert"], f"{p}.mlp.shared_expert", "dense")
                for n in ("gate_proj", "up_proj", "down_proj"):
                    _check_linear(s[n], f"{p}.mlp.shared_expert.{n}", bias_ok=False)
                _check_silu(s.get("act_fn"), f"{p}.mlp.shared_expert.act_fn")
                _check_linear(m["shared_expert_gate"], f"{p}.mlp.shared_expert_gate", bias_ok=False)
            kinds.append(dict(attn_bias=True in bias, mlp="moe", shared=has_shared))
        else:
            m = _children(mlp, f"{p}.mlp", "dense")
            for n in ("gate_proj", "up_proj", "down_proj"):
                _check_linear(m[n], f"{p}.mlp.{n}", bias_ok=False)
            _check_silu(m.get("act_fn"), f"{p}.mlp.act_fn")
            kinds.append(dict(attn_bias=True in bias, mlp="dense", shared=False))
    if len(eps) > 1:
        raise _unsupported("model", f"RMSNorm epsilons differ between norms ({sorted(eps)}); one eps is modelled")
    if len(head_dims) > 1 or len(topks) > 1 or len(norms) > 1:
        raise _unsupported("model.layers", "per-layer head_dim / top_k / router normalisation differ")
    tied = top["lm_head"].weight.data_ptr() == model["embed_tokens"].weight.data_ptr()
    values = dict(norm_eps=eps.pop(), head_dim=head_dims.pop() if head_dims else None, tied=tied,
                  top_k=topks.pop() if topks else None, norm_topk=norms.pop() if norms else None)
    inv_freq = rot.inv_freq.detach().float().numpy() if rot is not None and hasattr(rot, "inv_freq") else None
    return kinds, values, inv_freq


def _check_inv_freq(inv: np.ndarray, theta: float, hd: int) -> None:
    want = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    if inv.shape != want.shape or not np.allclose(inv, want, rtol=1e-5, atol=0):
        raise _unsupported("model.rotary_emb.inv_freq", f"does not match default RoPE with rope_theta={theta:g}")


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


def from_hf_module(module, name: str | None = None, max_seq_len: int | None = None) -> Graph | None:
    """A transformers *ForCausalLM -> Graph; None if `module` is not a transformers model at all."""
    cfg = getattr(module, "config", None)
    if cfg is None or not type(module).__module__.startswith("transformers."):
        return None
    cls = type(module).__name__
    llama_layout = hasattr(module, "lm_head") and hasattr(getattr(module, "model", None), "layers")
    if cls not in SUPPORTED and not llama_layout:
        raise _unsupported(cls, f"unsupported model class (supported: {', '.join(SUPPORTED)})")
    kinds, values, inv_freq = _walk(module, cfg)  # names the first unmodelled block (e.g. a Qwen3 q_norm)
    if cls not in SUPPORTED:
        raise _unsupported(cls, f"unsupported model class (supported: {', '.join(SUPPORTED)})")
    check_hf_config(cfg, "config")
    if inv_freq is not None:
        _check_inv_freq(inv_freq, float(cfg.rope_parameters["rope_theta"]), values["head_dim"])
    name = name or Path(str(getattr(cfg, "name_or_path", "") or "")).name or cfg.model_type
    config = hf_model_config(cfg, kinds, name=name, max_seq_len=max_seq_len, **values)
    src = _ModuleSource(module)
    plan = hf_weight_plan(config, kinds, src, where=cls)
    g = build_graph(config, {k: load() for k, load in plan.items()}, name=name)
    g.meta.eos_token_ids = _eos_from(getattr(module, "generation_config", None), cfg)
    g.meta.source = f"transformers:{cls}"
    return verify(g)


def _eos_from(*objs) -> list[int]:
    for o in objs:
        v = getattr(o, "eos_token_id", None) if o is not None else None
        if v is not None:
            return [int(x) for x in (v if isinstance(v, (list, tuple)) else [v])]
    return []


# --- model directories ----------------------------------------------------------------------
def _read_hf_config(path: Path):
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CflowError(f"{path / 'config.json'}: cannot read config ({e})") from None
    if not isinstance(raw, dict):
        raise CflowError(f"{path / 'config.json'}: expected a JSON object")
    mt = raw.get("model_type")
    if mt not in SUPPORTED.values():
        archs = raw.get("architectures") or [mt]
        raise _unsupported(f"{path / 'config.json'}: model_type={mt!r}",
                           f"unsupported model family {archs[0]} (supported: {', '.join(SUPPORTED)})")
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers validates fields strictly
        raise CflowError(f"{path / 'config.json'}: invalid {mt} config ({type(e).__name__}: {e})") from None


def from_hf_dir(path, name: str | None = None, max_seq_len: int | None = None) -> Graph:
    """A Hugging Face model directory -> Graph with lazily read float32 weights, tokenizer and eos ids."""
    path = Path(path)
    cfg = _read_hf_config(path)
    where = f"{path / 'config.json'}"
    check_hf_config(cfg, where)
    src = SafetensorsDir(path)
    kinds = layer_kinds_from_names(src.keys(), int(cfg.num_hidden_layers), where=str(path))
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    config = hf_model_config(cfg, kinds, name=name or path.resolve().name, where=where, max_seq_len=max_seq_len,
                             tied=tied)
    plan = hf_weight_plan(config, kinds, src, where=str(path))
    shapes = weight_shapes(config)
    g = build_graph(config, None, name=config.name)
    g.weights = LazyWeights(plan)
    missing = sorted(set(shapes) - set(plan))  # shapes were checked against the headers: nothing read yet
    if missing:
        raise CflowError(f"{path}: no tensor for weight {missing[0]!r}")
    g.meta.tokenizer = read_tokenizer(path)
    g.meta.eos_token_ids = eos_token_ids(path, cfg)
    g.meta.source = f"hf-dir:{cfg.model_type}"
    return verify(g)

