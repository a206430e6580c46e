"""Hugging Face tensor names -> IR weight names, shared by live modules and model directories.

Handles transformers 5's fused expert layout (experts.gate_up_proj [E, 2I, H]: gate rows then up
rows; experts.down_proj [E, H, I]) and the per-expert layout checkpoints are saved in (Mixtral's
block_sparse_moe.experts.{e}.w1/w3/w2, Qwen2-MoE's mlp.experts.{e}.gate_proj/up_proj/down_proj).
Every tensor must be used: one we do not map (say a q_norm) is an UnsupportedModelError naming it.
Also: tokenizer.json, the chat template and eos ids of a model directory.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import attrs
import numpy as np

from ..errors import CflowError, UnsupportedModelError
from ..ir import weight_shapes
from ..ir.config import ModelConfig
from ..ir.meta import special_tokens

IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_LEGACY = {  # per-expert checkpoint names -> role
    "w1": "w_gate", "w3": "w_up", "w2": "w_down",
    "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down",
}


def _norm_key(k: str) -> str:
    return k.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's checkpoint name for the MoE block


@attrs.frozen
class Folds:
    """Scalar factors and row orders folded into the weights, so the IR needs no op for them (exact up to
    float rounding):

      norm_offset     every RMSNorm weight + offset (Gemma's x / rms * (1 + w))
      embed_scale     tok_embeddings * s (Gemma's sqrt(d), Granite's embedding_multiplier); with tied
                      embeddings the final norm weight / s keeps the head's logits
      logit_scale     final norm weight * s (Granite's 1 / logits_scaling)
      residual_scale  every branch's output projection (wo, w_down, experts, shared expert) * r (Granite)
      q_scale         attention scaling relative to 1/sqrt(head_dim) (Gemma's query_pre_attn_scalar,
                      Granite's attention_multiplier): wq and bq * s, or the q norm * s when q is normalised
      rope_dim        rotated dimensions per head: q/k rows (and q/k norm weights) reordered so the rotated
                      pairs come first in each half (ir/rope.py's partial rotary convention)
    """

    norm_offset: float = 0.0
    embed_scale: float = 1.0
    logit_scale: float = 1.0
    residual_scale: float = 1.0
    q_scale: float = 1.0
    rope_dim: int = 0


def partial_rotary_permutation(head_dim: int, rope_dim: int) -> np.ndarray:
    """Row order of one head: new row i reads old row perm[i]. Hugging Face rotates pairs (j, j + r/2) of the
    first r = rope_dim rows; ir/rope.py rotates (i, i + head_dim/2) with zero frequency past r/2."""
    r = rope_dim
    p = (head_dim - r) // 2
    return np.concatenate([np.arange(0, r // 2), np.arange(r, r + p), np.arange(r // 2, r),
                           np.arange(r + p, head_dim)])


def layer_kinds_from_names(keys, n_layers: int, where: str) -> list[dict]:
    """Per-layer block kinds of a checkpoint, from its tensor names."""
    names = {_norm_key(k) for k in keys}
    kinds = []
    for i in range(n_layers):
        p = f"model.layers.{i}"
        fused_qkv = f"{p}.self_attn.qkv_proj.weight" in names
        if f"{p}.self_attn.q_proj.weight" not in names and not fused_qkv:
            raise CflowError(f"{where}: layer {i} has no {p}.self_attn.q_proj.weight (nor a fused qkv_proj)")
        if f"{p}.mlp.gate.weight" in names:
            mlp = "moe"
        elif f"{p}.mlp.gate_proj.weight" in names or f"{p}.mlp.gate_up_proj.weight" in names:
            mlp = "dense"
        else:
            raise UnsupportedModelError(f"{where}: {p}.mlp: neither a SwiGLU MLP (gate_proj) nor a routed MoE (gate)")
        qk = ""
        if f"{p}.self_attn.q_norm.weight" in names or f"{p}.self_attn.k_norm.weight" in names:
            qk = "qk"  # per head or whole projection: decided from the shape (hf_weight_plan)
        kinds.append(dict(attn_bias=f"{p}.self_attn.q_proj.bias" in names, mlp=mlp, fused_qkv=fused_qkv,
                          fused_gate_up=f"{p}.mlp.gate_up_proj.weight" in names,
                          shared=f"{p}.mlp.shared_expert.gate_proj.weight" in names, qk_norm=qk,
                          post_norms=f"{p}.pre_feedforward_layernorm.weight" in names
                          or f"{p}.post_feedforward_layernorm.weight" in names))
    extra = sorted(k for k in names if re.match(r"model\.layers\.(\d+)\.", k) and int(k.split(".")[2]) >= n_layers)
    if extra:
        raise CflowError(f"{where}: tensor {extra[0]!r} belongs to a layer beyond num_hidden_layers={n_layers}")
    return kinds


def resolve_qk_norm(kinds: list[dict], src, head_dim: int, where: str) -> None:
    """'qk' -> 'head' ([head_dim] weights: Qwen3, Gemma 3) or 'proj' (the whole projection: OLMoE)."""
    keys = {_norm_key(k): k for k in src.keys()}
    for i, k in enumerate(kinds):
        if k["qk_norm"] != "qk":
            continue
        key = keys.get(f"model.layers.{i}.self_attn.q_norm.weight")
        if key is None or f"model.layers.{i}.self_attn.k_norm.weight" not in keys:
            raise UnsupportedModelError(f"{where}: model.layers.{i}.self_attn: a q norm without a k norm "
                                        "(or vice versa) is not modelled")
        k["qk_norm"] = "head" if tuple(src.shape(key)) == (head_dim,) else "proj"


def hf_weight_plan(c: ModelConfig, kinds: list[dict], src, where: str, folds: Folds | None = None
                   ) -> dict[str, Callable]:
    """IR weight name -> loader returning float32 [out, in]; checks shapes against the config first, folds
    scalars and row orders into the weights (Folds)."""
    f = folds or Folds()
    orig = {_norm_key(k): k for k in src.keys()}
    used: set[str] = set()
    plan: dict[str, Callable] = {}
    shapes = weight_shapes(c)
    hd, H, KV = c.head_dim, c.n_heads, c.n_kv_heads
    rope_dim = f.rope_dim or c.rope_dim
    head_perm = partial_rotary_permutation(hd, rope_dim) if rope_dim != hd else None

    def rows(n_heads):  # the row order of a q/k projection (None: unchanged)
        return None if head_perm is None else (np.arange(n_heads)[:, None] * hd + head_perm[None, :]).reshape(-1)

    def one(x: float) -> bool:
        return abs(x - 1.0) < 1e-9

    def take(ir: str, key: str, index=None, shape=None, offset=0.0, scale=1.0, perm=None) -> None:
        k = orig.get(key)
        if k is None:
            raise CflowError(f"{where}: tensor {key!r} missing (needed for {ir})")
        used.add(key)
        got = tuple(shape if shape is not None else src.shape(k))
        if got != tuple(shapes[ir]):
            raise CflowError(f"{where}: tensor {key!r} has shape {got}, the config implies {tuple(shapes[ir])}")

        def load(k=k, index=index, offset=offset, scale=scale, perm=perm):
            w = src.load(k, index)
            if offset:
                w = w + np.float32(offset)
            if not one(scale):
                w = w * np.float32(scale)
            if perm is not None:
                w = w[perm]
            return np.ascontiguousarray(w, dtype=np.float32)

        plan[ir] = load

    norm = f.norm_offset
    final_scale = f.logit_scale / (f.embed_scale if c.tie_embeddings else 1.0)
    take("tok_embeddings", "model.embed_tokens.weight", scale=f.embed_scale)
    take("norm", "model.norm.weight", offset=norm, scale=final_scale)
    if not c.tie_embeddings:
        take("lm_head", "lm_head.weight")
    elif "lm_head.weight" in orig:
        used.add("lm_head.weight")  # a tied copy
    r = f.residual_scale
    qs = 1.0 if c.qk_norm else f.q_scale  # with q normalised, the scale goes on the q norm
    for i, kind in enumerate(kinds):
        hp, ip = f"model.layers.{i}", f"blocks.{i}"
        a = f"{hp}.self_attn"
        take(f"{ip}.attn_norm", f"{hp}.input_layernorm.weight", offset=norm)
        if kind["fused_qkv"]:
            q_rows, kv_rows = H * hd, KV * hd
            fused = f"{a}.qkv_proj.weight"
            k0 = orig.get(fused)
            if k0 is not None and tuple(src.shape(k0)) != (q_rows + 2 * kv_rows, c.d_model):
                raise CflowError(f"{where}: tensor {fused!r} has shape {tuple(src.shape(k0))}, the config implies "
                                 f"{(q_rows + 2 * kv_rows, c.d_model)}")
            take(f"{ip}.attn.wq", fused, slice(0, q_rows), (q_rows, c.d_model), scale=qs, perm=rows(H))
            take(f"{ip}.attn.wk", fused, slice(q_rows, q_rows + kv_rows), (kv_rows, c.d_model), perm=rows(KV))
            take(f"{ip}.attn.wv", fused, slice(q_rows + kv_rows, q_rows + 2 * kv_rows), (kv_rows, c.d_model))
        else:
            take(f"{ip}.attn.wq", f"{a}.q_proj.weight", scale=qs, perm=rows(H))
            take(f"{ip}.attn.wk", f"{a}.k_proj.weight", perm=rows(KV))
            take(f"{ip}.attn.wv", f"{a}.v_proj.weight")
            if c.attn_bias:
                take(f"{ip}.attn.bq", f"{a}.q_proj.bias", scale=qs, perm=rows(H))
                take(f"{ip}.attn.bk", f"{a}.k_proj.bias", perm=rows(KV))
                take(f"{ip}.attn.bv", f"{a}.v_proj.bias")
        take(f"{ip}.attn.wo", f"{a}.o_proj.weight", scale=r)
        if c.qk_norm:
            qperm, kperm = (head_perm, head_perm) if c.qk_norm == "head" else (rows(H), rows(KV))
            take(f"{ip}.attn.q_norm", f"{a}.q_norm.weight", offset=norm, scale=f.q_scale, perm=qperm)
            take(f"{ip}.attn.k_norm", f"{a}.k_norm.weight", offset=norm, perm=kperm)
        if c.post_norms:
            take(f"{ip}.attn.post_norm", f"{hp}.post_attention_layernorm.weight", offset=norm)
            ffn_in = f"{hp}.pre_feedforward_layernorm.weight"
        else:
            ffn_in = f"{hp}.post_attention_layernorm.weight"
        if kind["mlp"] == "dense":
            take(f"{ip}.ffn_norm", ffn_in, offset=norm)
            if kind["fused_gate_up"]:
                I, gu = c.ffn_dim, f"{hp}.mlp.gate_up_proj.weight"
                k0 = orig.get(gu)
                if k0 is not None and tuple(src.shape(k0)) != (2 * I, c.d_model):
                    raise CflowError(f"{where}: tensor {gu!r} has shape {tuple(src.shape(k0))}, the config implies "
                                     f"{(2 * I, c.d_model)}")
                take(f"{ip}.ffn.w_gate", gu, slice(0, I), (I, c.d_model))  # gate rows first (Phi-3's chunk(2))
                take(f"{ip}.ffn.w_up", gu, slice(I, 2 * I), (I, c.d_model))
            else:
                take(f"{ip}.ffn.w_gate", f"{hp}.mlp.gate_proj.weight")
                take(f"{ip}.ffn.w_up", f"{hp}.mlp.up_proj.weight")
            take(f"{ip}.ffn.w_down", f"{hp}.mlp.down_proj.weight", scale=r)
            if c.post_norms:
                take(f"{ip}.ffn.post_norm", f"{hp}.post_feedforward_layernorm.weight", offset=norm)
            continue
        if c.post_norms:
            raise UnsupportedModelError(f"{where}: {hp}.mlp: post-feed-forward norms around experts are not modelled")
        take(f"{ip}.moe_norm", ffn_in, offset=norm)
        take(f"{ip}.moe.router", f"{hp}.mlp.gate.weight")
        _experts(c, hp, ip, orig, src, take, where, r)
        if kind.get("shared"):
            for w in ("gate", "up", "down"):
                take(f"{ip}.moe.shared.w_{w}", f"{hp}.mlp.shared_expert.{w}_proj.weight",
                     scale=r if w == "down" else 1.0)
            take(f"{ip}.moe.shared_gate", f"{hp}.mlp.shared_expert_gate.weight")
    left = sorted(k for k in orig if k not in used and not IGNORED.search(k))
    if left:
        raise UnsupportedModelError(f"{where}: tensor {orig[left[0]]!r} is not modelled by the IR "
                                    f"({len(left)} unused tensor{'s' if len(left) > 1 else ''})")
    return plan


def _experts(c: ModelConfig, hp: str, ip: str, orig: dict, src, take, where: str, r: float = 1.0) -> None:
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
            take(f"{ip}.moe.experts.{e}.w_down", f"{hp}.mlp.experts.down_proj", (e,), (d, I), scale=r)
        return
    for e in range(E):
        found = False
        for legacy, role in _LEGACY.items():
            key = f"{hp}.mlp.experts.{e}.{legacy}.weight"
            if key in orig:
                take(f"{ip}.moe.experts.{e}.{role}", key, scale=r if role == "w_down" else 1.0)
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


def _token_text(v) -> str | None:
    if isinstance(v, dict):  # a serialised AddedToken
        v = v.get("content")
    return v if isinstance(v, str) else None


def read_chat_template(path) -> dict | None:
    """{'template', 'bos_token', 'eos_token'} of a model directory, or None: the Jinja chat template from
    chat_template.jinja (transformers >= 4.43 saves it there), else tokenizer_config.json's chat_template
    (a string, or a list of named templates: 'default' or the first), with its bos/eos token texts."""
    path = Path(path)
    tc: dict = {}
    p = path / "tokenizer_config.json"
    if p.is_file():
        try:
            tc = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise CflowError(f"{p}: cannot read ({e})") from None
        if not isinstance(tc, dict):
            raise CflowError(f"{p}: expected a JSON object")
    template = None
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        try:
            template = jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CflowError(f"{jinja}: cannot read ({e})") from None
    else:
        t = tc.get("chat_template")
        if isinstance(t, list):
            named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
            t = named.get("default", next(iter(named.values()), None))
        if t is not None and not isinstance(t, str):
            raise CflowError(f"{p}: chat_template is not a string or a list of named templates")
        template = t
    if not template:
        return None
    return {"template": template, "bos_token": _token_text(tc.get("bos_token")),
            "eos_token": _token_text(tc.get("eos_token"))}


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


def specials_from_post_processor(json_text: str, source: str = "tokenizer.json post-processor") -> dict | None:
    """What a tokenizer.json's post-processor adds around a single sequence (BOS in front, EOS behind), found by
    encoding one piece of text with and without it; None when it adds nothing or is not a BOS/EOS rule."""
    try:
        from tokenizers import Tokenizer as HFTokenizer

        tk = HFTokenizer.from_str(json_text)
        plain = tk.encode("a", add_special_tokens=False).ids
        full = tk.encode("a", add_special_tokens=True).ids
    except BaseException as e:  # noqa: BLE001 -- pyo3 panics on odd input
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return None
    if full == plain or not plain:
        return None
    at = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), None)
    if at is None:
        return None
    head, tail = full[:at], full[at + len(plain):]
    if len(head) > 1 or len(tail) > 1:
        return None  # not a single BOS / EOS (e.g. an encoder's pair template): left alone
    return special_tokens(bos=head[0] if head else None, eos=tail[0] if tail else None, add_bos=bool(head),
                          add_eos=bool(tail), source=source)


def read_special_tokens(path, tokenizer_text: str | None) -> dict | None:
    """BOS / EOS a model directory's prompts carry (runtime/tokenizer.py): what its tokenizer.json post-processor
    adds around one sequence, overridden by tokenizer_config.json's add_bos_token / add_eos_token (transformers
    rebuilds the post-processor from them), with bos_token / eos_token naming the tokens; None without a tokenizer."""
    if not tokenizer_text:
        return None
    path = Path(path)
    found = specials_from_post_processor(tokenizer_text) or special_tokens(source="tokenizer.json post-processor")
    p = path / "tokenizer_config.json"
    tc: dict = {}
    if p.is_file():
        try:
            tc = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise CflowError(f"{p}: cannot read ({e})") from None
        if not isinstance(tc, dict):
            raise CflowError(f"{p}: expected a JSON object")
    if not any(k in tc for k in ("add_bos_token", "add_eos_token")):
        return found
    vocab = {}
    try:
        tj = json.loads(tokenizer_text)
        vocab = dict((tj.get("model") or {}).get("vocab") or {})
        vocab.update({t["content"]: int(t["id"]) for t in tj.get("added_tokens") or [] if "content" in t})
    except (ValueError, TypeError, KeyError, AttributeError):
        pass
    out = dict(found)
    for key, name in (("bos", "bos_token"), ("eos", "eos_token")):
        flag = tc.get(f"add_{key}_token")
        if flag is None:
            continue
        if not isinstance(flag, bool):
            raise CflowError(f"{p}: add_{key}_token={flag!r}: expected true or false")
        text = _token_text(tc.get(name))
        tid = vocab.get(text) if text is not None else None
        out[key] = tid if tid is not None else out[key]
        out[f"add_{key}"] = flag
    return special_tokens(out["bos"], out["eos"], out["add_bos"], out["add_eos"],
                          source=f"{p.name} add_bos_token/add_eos_token")
