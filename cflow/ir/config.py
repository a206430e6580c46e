"""ModelConfig: every knob of a pipeline-native decoder, validated on construction.

Layers are numbered 1..n_layers in the IR and in error messages (docs/DESIGN.md's equations);
Python lists indexed from 0 hold layer l at index l - 1.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from ..errors import ConfigError

ROUTING = ("post", "pre")  # post-dense (router sees b_l) or pre-dense (router sees a_l, arch4)
ACTIVATIONS = ("silu", "gelu_tanh")  # the gate activation of every SwiGLU-style FFN (dense, experts, shared)
QK_NORMS = ("", "head", "proj")  # RMSNorm of q and k before RoPE: none, per head (Qwen3), whole projection (OLMoE)


def _positive(name: str, value: int, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"config field {name}={value!r} out of range: expected an integer >= {minimum}")


def _layer_tuple(v) -> tuple[int, ...] | None:
    """attrs converter of dense_layers / moe_layers / sliding_layers: an iterable of layer numbers becomes a tuple.

    Anything else is kept as it is for __attrs_post_init__ to refuse by name (a value from a file header may
    be anything JSON holds: only whole numbers are layer numbers, no bools, floats or strings)."""
    if v is None or isinstance(v, (str, bytes, dict)) or not hasattr(v, "__iter__"):
        return v
    return tuple(int(i) if _is_int(i) else i for i in v)


def _rope_scaling(v) -> tuple | None:
    """attrs converter of rope_scaling: a dict (or its canonical tuple) -> sorted (key, value) pairs, lists as
    tuples (hashable, so the config stays a value); None or {} -> None. Validated in __attrs_post_init__."""
    if v is None or (isinstance(v, (dict, tuple, list)) and not v):
        return None
    items = v.items() if isinstance(v, dict) else v
    try:
        return tuple(sorted((str(k), tuple(x) if isinstance(x, (list, tuple)) else x) for k, x in items))
    except (TypeError, ValueError):
        raise ConfigError(f"config field rope_scaling={v!r}: expected a dict of RoPE parameters") from None


# Upper bounds of the integer fields (sanity limits no real model comes near; they keep every loop over layers or
# experts, and every product of dims, small enough that nothing overflows int64 or hangs before the file-size and
# memory checks of the loader run). Fields not listed: MAX_INT_DEFAULT.
MAX_INT = {"n_layers": 2**12, "n_blocks": 2**12, "n_heads": 2**12, "n_kv_heads": 2**12, "head_dim": 2**12,
           "rope_dim": 2**12, "n_experts": 2**14, "top_k": 2**14, "d_model": 2**16, "max_seq_len": 2**24,
           "vocab_size": 2**24}
MAX_INT_DEFAULT = 2**20  # ffn_dim, expert_dim, shared_expert_dim, sliding_window, ...


def _is_int(v) -> bool:
    import numbers

    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_kinds(cfg) -> None:
    """Every field has the kind its annotation names, and numbers are finite and bounded.

    Runs first in __attrs_post_init__, so the range checks after it (and everything downstream) only ever see
    an int where an int is declared: a config read from a file header may hold any JSON value in any field.
    """
    import math

    for f in attrs.fields(type(cfg)):
        v, kind = getattr(cfg, f.name), str(f.type).replace(" ", "")
        if kind == "int":
            if not _is_int(v):
                raise ConfigError(f"config field {f.name}={_short(v)}: expected an integer")
            top = MAX_INT.get(f.name, MAX_INT_DEFAULT)
            if v > top:
                raise ConfigError(f"config field {f.name}={v} out of range: at most {top}")
        elif kind == "float":
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigError(f"config field {f.name}={_short(v)}: expected a number")
            if not math.isfinite(v):
                raise ConfigError(f"config field {f.name}={v!r}: expected a finite number")
        elif kind == "bool":
            if not isinstance(v, bool):
                raise ConfigError(f"config field {f.name}={_short(v)}: expected true or false")
        elif kind.startswith("tuple[int,...]"):
            if v is not None and (not isinstance(v, tuple) or not all(_is_int(i) for i in v)):
                raise ConfigError(f"config field {f.name}={_short(v)}: expected a list of layer numbers")
            if v is not None and len(v) > MAX_INT["n_layers"]:
                raise ConfigError(f"config field {f.name}: {len(v)} entries, more than {MAX_INT['n_layers']}")
        elif kind == "str":
            if not isinstance(v, str):
                raise ConfigError(f"config field {f.name}={_short(v)}: expected a string")
            if len(v) > 1024:
                raise ConfigError(f"config field {f.name}: a string of {len(v)} characters, at most 1024")


def _number(name: str, value, minimum: float = 0.0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= minimum \
            or value != value or value in (float("inf"),):
        raise ConfigError(f"config field {name}={value!r} out of range: expected a finite number >= {minimum}")


@attrs.frozen(kw_only=True)
class ModelConfig:
    """Geometry, delays and weight sharing of one model. Immutable; use `evolve` to change.

    ffn_dim = 0 means no dense FFN; n_experts = 0 means no MoE. dense_layers / moe_layers list the
    1-based layers that have that FFN (None = every layer): Qwen2-MoE's mlp_only_layers use them.
    n_blocks < n_layers shares weights across iterations (arch5): layer l runs block (l-1) % n_blocks.

    Attention and FFN variants of the families people run (defaults: plain Llama):
      rope_scaling      RoPE frequency scaling, static at compile time (ir/rope.py: linear, dynamic, llama3, yarn,
                        longrope), as a canonical tuple of (key, value) pairs; to_dict writes a dict
      rope_dim          rotated dimensions per head (partial rotary: the rest pass through); default head_dim
      local_rope_theta  RoPE base of the sliding-window layers (default RoPE there), 0 = rope_theta (Gemma 3)
      qk_norm           '' | 'head' (RMSNorm of each q/k head, weight [head_dim]: Qwen3, Gemma 3) |
                        'proj' (of the whole q/k projection, weights [H*hd] / [KV*hd]: OLMoE); before RoPE
      activation        gate activation: 'silu' (SwiGLU) | 'gelu_tanh' (GeGLU: Gemma)
      post_norms        attention and dense-FFN outputs RMS-normalised before their residual add (Gemma 2/3)
      attn_softcap      attention scores -> c * tanh(scores / c) before the softmax (Gemma 2); 0 = none
      final_softcap     logits -> c * tanh(logits / c) (Gemma 2); 0 = none
      sliding_window    a query attends to the last `sliding_window` positions (itself included); 0 = all
      sliding_layers    1-based layers that use the window (None = every layer when sliding_window > 0)
    Scalar multipliers (Gemma's embedding scale and query_pre_attn_scalar, Granite's embedding / residual /
    attention / logit multipliers) and Gemma's (1 + w) norms are folded into the weights by the frontends.
    """

    name: str = "custom"
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int = attrs.field(default=attrs.Factory(lambda s: s.d_model // max(s.n_heads, 1), takes_self=True))
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 512
    ffn_dim: int = 0
    n_experts: int = 0
    top_k: int = 0
    expert_dim: int = 0
    norm_topk: bool = True
    shared_expert_dim: int = 0
    shared_expert_gate: bool = False
    dense_delay: int = 0
    expert_delay: int = 0
    routing: str = "post"
    n_blocks: int = attrs.field(default=attrs.Factory(lambda s: s.n_layers, takes_self=True))
    tie_embeddings: bool = False
    attn_bias: bool = False
    dense_layers: tuple[int, ...] | None = attrs.field(default=None, converter=_layer_tuple)
    moe_layers: tuple[int, ...] | None = attrs.field(default=None, converter=_layer_tuple)
    rope_scaling: tuple | None = attrs.field(default=None, converter=_rope_scaling)
    rope_dim: int = attrs.field(default=attrs.Factory(lambda s: s.head_dim, takes_self=True))
    local_rope_theta: float = 0.0
    qk_norm: str = ""
    activation: str = "silu"
    post_norms: bool = False
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] | None = attrs.field(default=None, converter=_layer_tuple)

    def __attrs_post_init__(self) -> None:
        _check_kinds(self)
        for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "max_seq_len"):
            _positive(f, getattr(self, f))
        for f in ("ffn_dim", "n_experts", "top_k", "expert_dim", "shared_expert_dim"):
            _positive(f, getattr(self, f), minimum=0)
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"config field n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} "
                "(grouped-query attention)"
            )
        if self.head_dim % 2:
            raise ConfigError(f"config field head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if self.n_experts:
            if not 1 <= self.top_k <= self.n_experts:
                raise ConfigError(
                    f"config field top_k={self.top_k} out of range: expected 1..n_experts={self.n_experts}")
            if self.expert_dim < 1:
                raise ConfigError(
                    f"config field expert_dim={self.expert_dim} out of range: expected >= 1 when n_experts > 0")
        elif self.top_k or self.shared_expert_dim:
            raise ConfigError("config fields top_k / shared_expert_dim need n_experts >= 1")
        for f in ("dense_delay", "expert_delay"):
            v = getattr(self, f)
            if not isinstance(v, int) or not 0 <= v < self.n_layers:
                raise ConfigError(
                    f"config field {f}={v!r} out of range: expected 0..{self.n_layers - 1} (n_layers - 1)")
        if self.routing not in ROUTING:
            raise ConfigError(f"config field routing={self.routing!r}: expected one of {', '.join(ROUTING)}")
        if not 1 <= self.n_blocks <= self.n_layers or self.n_layers % self.n_blocks:
            raise ConfigError(
                f"config field n_blocks={self.n_blocks} out of range: expected a divisor of n_layers={self.n_layers}"
            )
        for f in ("dense_layers", "moe_layers", "sliding_layers"):
            v = getattr(self, f)
            if v is None:
                continue
            bad = [i for i in v if not 1 <= i <= self.n_layers]
            if bad:
                raise ConfigError(f"config field {f} has layer {bad[0]} out of range 1..{self.n_layers}")
            if self.n_blocks != self.n_layers and f != "sliding_layers":
                raise ConfigError(f"config field {f} cannot be combined with weight sharing (n_blocks={self.n_blocks})")
        self._check_variants()

    def _check_variants(self) -> None:
        from .rope import ROPE_KEYS

        _positive("rope_dim", self.rope_dim, minimum=2)
        if self.rope_dim % 2 or self.rope_dim > self.head_dim:
            raise ConfigError(f"config field rope_dim={self.rope_dim} must be even and <= head_dim={self.head_dim}")
        for f in ("rope_theta", "local_rope_theta", "attn_softcap", "final_softcap", "norm_eps"):
            _number(f, getattr(self, f))
        if not self.rope_theta > 0:
            raise ConfigError(f"config field rope_theta={self.rope_theta!r} out of range: expected > 0")
        if self.qk_norm not in QK_NORMS:
            raise ConfigError(f"config field qk_norm={self.qk_norm!r}: expected one of '', 'head', 'proj'")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"config field activation={self.activation!r}: expected one of {', '.join(ACTIVATIONS)}")
        if not isinstance(self.post_norms, bool):
            raise ConfigError(f"config field post_norms={self.post_norms!r}: expected true or false")
        _positive("sliding_window", self.sliding_window, minimum=0)
        if self.sliding_layers is not None and not self.sliding_window:
            raise ConfigError("config field sliding_layers needs sliding_window >= 1")
        if self.rope_scaling is None:
            return
        d = dict(self.rope_scaling)
        kind = d.pop("rope_type", None)
        if kind not in ROPE_KEYS:
            raise ConfigError(f"config field rope_scaling: rope_type={kind!r} is not one of {', '.join(ROPE_KEYS)}")
        required, optional = ROPE_KEYS[kind]
        missing = sorted(required - set(d))
        if missing:
            raise ConfigError(f"config field rope_scaling ({kind}) needs {missing[0]!r}")
        extra = sorted(set(d) - required - optional)
        if extra:
            raise ConfigError(f"config field rope_scaling ({kind}) has unknown parameter {extra[0]!r}")
        for k, v in d.items():
            if k in ("short_factor", "long_factor"):
                if len(v) != self.rope_dim // 2 or not all(isinstance(x, (int, float)) and x > 0 for x in v):
                    raise ConfigError(f"config field rope_scaling.{k}: expected {self.rope_dim // 2} positive numbers")
            elif k == "truncate":
                if not isinstance(v, bool):
                    raise ConfigError(f"config field rope_scaling.truncate={v!r}: expected true or false")
            elif v is not None:
                _number(f"rope_scaling.{k}", v)
        if kind in ("linear", "dynamic", "llama3", "yarn") and not d["factor"] > 0:
            raise ConfigError(f"config field rope_scaling.factor={d['factor']!r} out of range: expected > 0")
        if kind == "llama3" and d["high_freq_factor"] == d["low_freq_factor"]:
            raise ConfigError("config field rope_scaling: llama3 needs high_freq_factor != low_freq_factor")
        if d.get("original_max_position_embeddings", 1) < 1:
            raise ConfigError("config field rope_scaling.original_max_position_embeddings out of range: expected >= 1")

    # --- per-layer structure -------------------------------------------------------------
    def block_of(self, layer: int) -> int:
        """0-based weight block that 1-based `layer` runs."""
        return (layer - 1) % self.n_blocks

    def has_dense(self, layer: int) -> bool:
        return self.ffn_dim > 0 and (self.dense_layers is None or layer in self.dense_layers)

    def has_moe(self, layer: int) -> bool:
        return self.n_experts > 0 and (self.moe_layers is None or layer in self.moe_layers)

    def is_sliding(self, layer: int) -> bool:
        """Whether 1-based `layer` attends through the sliding window."""
        return self.sliding_window > 0 and (self.sliding_layers is None or layer in self.sliding_layers)

    def window(self, layer: int) -> int:
        """Attention window of 1-based `layer` in positions, 0 = the whole context."""
        return self.sliding_window if self.is_sliding(layer) else 0

    @property
    def delays(self) -> tuple[int, int]:
        return (self.dense_delay, self.expert_delay)

    # --- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self, recurse=False)
        for f in ("dense_layers", "moe_layers", "sliding_layers"):
            if d[f] is not None:
                d[f] = list(d[f])
        from .rope import scaling_dict

        d["rope_scaling"] = scaling_dict(self.rope_scaling)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        if not isinstance(d, dict):
            raise ConfigError(f"config must be an object of fields, got {type(d).__name__}")
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown config field {unknown[0]!r}")
        try:
            return cls(**d)
        except ConfigError:
            raise
        except (TypeError, ValueError, OverflowError, ArithmeticError) as e:  # a missing field, a wrong kind
            raise ConfigError(f"incomplete or malformed config: {e}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def evolve(self, **changes: Any) -> ModelConfig:
        # An unshared model stays unshared when its depth changes (n_blocks follows n_layers).
        if "n_layers" in changes and "n_blocks" not in changes and self.n_blocks == self.n_layers:
            changes["n_blocks"] = changes["n_layers"]
        # A fully rotated head stays fully rotated when its width changes (rope_dim follows head_dim).
        if "head_dim" in changes and "rope_dim" not in changes and self.rope_dim == self.head_dim:
            changes["rope_dim"] = changes["head_dim"]
        return attrs.evolve(self, **changes)

    # --- sizes ---------------------------------------------------------------------------
    def n_params(self, active: bool = False) -> int:
        """Parameter count (stored weights; with active=True, only the top-k experts count)."""
        d, hd = self.d_model, self.head_dim
        attn = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        if self.attn_bias:
            attn += hd * (self.n_heads + 2 * self.n_kv_heads)
        if self.qk_norm:
            attn += 2 * hd if self.qk_norm == "head" else hd * (self.n_heads + self.n_kv_heads)
        if self.post_norms:
            attn += d
        total = self.vocab_size * d * (1 if self.tie_embeddings else 2) + d  # embeddings, head, final norm
        n_exec = self.n_layers if active else self.n_blocks
        for layer in range(1, n_exec + 1):
            total += attn + d
            if self.has_dense(layer):
                total += 3 * d * self.ffn_dim + d + (d if self.post_norms else 0)
            if self.has_moe(layer):
                k = self.top_k if active else self.n_experts
                total += d + d * self.n_experts + k * 3 * d * self.expert_dim
                total += 3 * d * self.shared_expert_dim + (d if self.shared_expert_gate else 0)
        return total
