"""Hugging Face tensor names -> IR weight names, shared by live modules and model directories.

Handles transformers 5's fused expert layout (experts.gate_up_proj [E, 2I, H]: gate rows then up
rows; experts.down_proj [E, H, I]) and the per-expert layout checkpoints are saved in (Mixtral's
block_sparse_moe.experts.{e}.w1/w3/w2, Qwen2-MoE's mlp.experts.{e}.gate_proj/up_proj/down_proj).
Every tensor must be used: one we do not map (say a q_norm) is an UnsupportedModelError naming it.
Also: tokenizer.json and eos ids of a model directory.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from ..errors import CflowError, UnsupportedModelError
from ..ir import weight_shapes
from ..ir.config import ModelConfig

IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_LEGACY = {  # per-expert checkpoint names -> role
    "w1": "w_gate", "w3": "w_up", "w2": "w_down",
    "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down",
}


def _norm_key(k: str) -> str:
    return k.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's checkpoint name for the MoE block


def layer_kinds_from_names(keys, n_layers: int, where: str) -> list[dict]:
    """Per-layer block kinds of a checkpoint, from its tensor names."""
    names = {_norm_key(k) for k in keys}
    kinds = []
    for i in range(n_layers):
        p = f"model.layers.{i}"
        if f"{p}.self_attn.q_proj.weight" not in names:
            raise CflowError(f"{where}: layer {i} has no {p}.self_attn.q_proj.weight")
        if f"{p}.mlp.gate.weight" in names:
            mlp = "moe"
        elif f"{p}.mlp.gate_proj.weight" in names:
            mlp = "dense"
        else:
            raise UnsupportedModelError(f"{where}: {p}.mlp: neither a SwiGLU MLP (gate_proj) nor a routed MoE (gate)")
        kinds.append(dict(attn_bias=f"{p}.self_attn.q_proj.bias" in names, mlp=mlp,
                          shared=f"{p}.mlp.shared_expert.gate_proj.weight" in names))
    extra = sorted(k for k in names if re.match(r"model\.layers\.(\d+)\.", k) and int(k.split(".")[2]) >= n_layers)
    if extra:
        raise CflowError(f"{where}: tensor {extra[0]!r} belongs to a layer beyond num_hidden_layers={n_layers}")
    return kinds


def hf_weight_plan(c: ModelConfig, kinds: list[dict], src, where: str) -> dict[str, Callable]:
    """IR weight name -> loader returning float32 [out, in]; checks shapes against the config first."""
    orig = {_norm_key(k): k for k in src.keys()}
    used: set[str] = set()
    plan: dict[str, Callable] = {}
    shapes = weight_shapes(c)

    def take(ir: str, key: str, index=None, shape=None) -> None:
        k = orig.get(key)
        if k is None:
            raise CflowError(f"{where}: tensor {key!r} missing (needed for {ir})")
        used.add(key)
        got = tuple(shape if shape is not None else src.shape(k))
        if got != tuple(shapes[ir]):
            raise CflowError(f"{where}: tensor {key!r} has shape {got}, the config implies {tuple(shapes[ir])}")
        plan[ir] = (lambda k=k, index=index: src.load(k, index))

    take("tok_embeddings", "model.embed_tokens.weight")
    take("norm", "model.norm.weight")
    if not c.tie_embeddings:
        take("lm_head", "lm_head.weight")
    elif "lm_head.weight" in orig:
        used.add("lm_head.weight")  # a tied copy
    for i, kind in enumerate(kinds):
        hp, ip = f"model.layers.{i}", f"blocks.{i}"
        take(f"{ip}.attn_norm", f"{hp}.input_layernorm.weight")
        for w, n in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            take(f"{ip}.attn.{w}", f"{hp}.self_attn.{n}.weight")
            if c.attn_bias and w != "wo":
                take(f"{ip}.attn.b{w[1]}", f"{hp}.self_attn.{n}.bias")
        if kind["mlp"] == "dense":
            take(f"{ip}.ffn_norm", f"{hp}.post_attention_layernorm.weight")
            for w in ("gate", "up", "down"):
                take(f"{ip}.ffn.w_{w}", f"{hp}.mlp.{w}_proj.weight")
            continue
        take(f"{ip}.moe_norm", f"{hp}.post_attention_layernorm.weight")
        take(f"{ip}.moe.router", f"{hp}.mlp.gate.weight")
        _experts(c, hp, ip, orig, src, take, where)
        if kind.get("shared"):
            for w in ("gate", "up", "down"):
                take(f"{ip}.moe.shared.w_{w}", f"{hp}.mlp.shared_expert.{w}_proj.weight")
            take(f"{ip}.moe.shared_gate", f"{hp}.mlp.shared_expert_gate.weight")
    left = sorted(k for k in orig if k not in used and not IGNORED.search(k))
    if left:
        raise UnsupportedModelError(f"{where}: tensor {orig[left[0]]!r} is not modelled by the IR "
                                    f"({len(left)} unused tensor{'s' if len(left) > 1 else ''})")
    return plan


def _experts(c: ModelConfig, hp: str, ip: str, orig: dict, src, take, where: str) -> None:
    E, I, d = c.n_experts, c.expert_dim, c.d_model
    fused = f"{hp}.mlp.experts.gate_up_proj"
    if fused in orig:
        gu, dn = src.shape(orig[fused]), src.shape(orig.get(f"{hp}.mlp.experts.down_proj", fused))
        if tuple(gu) != (E, 2 * I, d) or tuple(dn) != (E, d, I):
            raise CflowError(f"{where}: {fused} {tuple(gu)} / down_proj {tuple(dn)}: "
                             f"expected ({E}, {2 * I}, {d}) / ({E}, {d}, {I})")
        for e in range(E):  # gate rows first, then up rows (transformers' concatenated layout)
            take(f"{ip}.moe.experts.{e}.w_gate", fused, (e, slice(0, I)), (I, d))
            take(f"{ip}.moe.experts.{e}.w_up", fused, (e, slice(I, 2 * I)), (I, d))
            take(f"{ip}.moe.experts.{e}.w_down", f"{hp}.mlp.experts.down_proj", (e,), (d, I))
        return
    for e in range(E):
        found = False
        for legacy, role in _LEGACY.items():
            key = f"{hp}.mlp.experts.{e}.{legacy}.weight"
            if key in orig:
                take(f"{ip}.moe.experts.{e}.{role}", key)
                found = True
        if not found:
            raise CflowError(f"{where}: no weights for expert {e} of {hp}.mlp (expected experts.gate_up_proj "
                             f"or experts.{e}.w1/w2/w3 or experts.{e}.gate_proj/up_proj/down_proj)")


# --- tokenizer and eos ----------------------------------------------------------------------
def read_tokenizer(path) -> str | None:
    """tokenizer.json text beside config.json, or None."""
    p = Path(path) / "tokenizer.json"
    if not p.is_file():
        return None
    try:
        text = p.read_text(encoding="utf-8")
        json.loads(text)
    except (OSError, ValueError) as e:
        raise CflowError(f"{p}: not a valid tokenizer.json ({e})") from None
    return text


_EOS_NAMES = ("</s>", "<|endoftext|>", "<eos>", "<|eot_id|>", "<|im_end|>", "<|end_of_text|>")


def eos_token_ids(path, config=None) -> list[int]:
    """eos ids: generation_config.json, else config(.json)'s eos_token_id, else the tokenizer's
    special end token (one of the usual names), else []."""
    path = Path(path)
    sources = []
    for fname in ("generation_config.json", "config.json"):
        p = path / fname
        if p.is_file():
            try:
                sources.append(json.loads(p.read_text()))
            except (OSError, ValueError) as e:
                raise CflowError(f"{p}: cannot read ({e})") from None
    if config is not None:
        sources.append({"eos_token_id": getattr(config, "eos_token_id", None)})
    for s in sources:
        v = s.get("eos_token_id") if isinstance(s, dict) else None
        if v is not None:
            vals = v if isinstance(v, list) else [v]
            try:
                return [int(x) for x in vals]
            except (TypeError, ValueError):
                raise CflowError(f"{path}: eos_token_id {v!r} is not an integer or a list of integers") from None
    text = read_tokenizer(path)
    if text:
        added = json.loads(text).get("added_tokens") or []
        ids = [int(t["id"]) for t in added if t.get("special") and t.get("content") in _EOS_NAMES]
        return ids[:1]
    return []
