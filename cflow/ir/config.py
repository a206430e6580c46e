"""ModelConfig: every knob of a pipeline-native decoder, validated on construction.

Layers are numbered 1..n_layers in the IR and in error messages (DESIGN.md's equations);
Python lists indexed from 0 hold layer l at index l - 1.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from ..errors import ConfigError

ROUTING = ("post", "pre")  # post-dense (router sees b_l) or pre-dense (router sees a_l, arch4)


def _positive(name: str, value: int, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"config field {name}={value!r} out of range: expected an integer >= {minimum}")


def _layer_tuple(v) -> tuple[int, ...] | None:
    """attrs converter of dense_layers / moe_layers: any iterable of layer numbers becomes a tuple of ints."""
    return None if v is None else tuple(int(i) for i in v)


@attrs.frozen(kw_only=True)
class ModelConfig:
    """Geometry, delays and weight sharing of one model. Immutable; use `evolve` to change.

    ffn_dim = 0 means no dense FFN; n_experts = 0 means no MoE. dense_layers / moe_layers list the
    1-based layers that have that FFN (None = every layer): Qwen2-MoE's mlp_only_layers use them.
    n_blocks < n_layers shares weights across iterations (arch5): layer l runs block (l-1) % n_blocks.
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

    def __attrs_post_init__(self) -> None:
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
        for f in ("dense_layers", "moe_layers"):
            v = getattr(self, f)
            if v is None:
                continue
            bad = [i for i in v if not 1 <= i <= self.n_layers]
            if bad:
                raise ConfigError(f"config field {f} has layer {bad[0]} out of range 1..{self.n_layers}")
            if self.n_blocks != self.n_layers:
                raise ConfigError(f"config field {f} cannot be combined with weight sharing (n_blocks={self.n_blocks})")

    # --- per-layer structure -------------------------------------------------------------
    def block_of(self, layer: int) -> int:
        """0-based weight block that 1-based `layer` runs."""
        return (layer - 1) % self.n_blocks

    def has_dense(self, layer: int) -> bool:
        return self.ffn_dim > 0 and (self.dense_layers is None or layer in self.dense_layers)

    def has_moe(self, layer: int) -> bool:
        return self.n_experts > 0 and (self.moe_layers is None or layer in self.moe_layers)

    @property
    def delays(self) -> tuple[int, int]:
        return (self.dense_delay, self.expert_delay)

    # --- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        for f in ("dense_layers", "moe_layers"):
            if d[f] is not None:
                d[f] = list(d[f])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown config field {unknown[0]!r}")
        try:
            return cls(**d)
        except TypeError as e:  # a missing required field
            raise ConfigError(f"incomplete config: {e}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def evolve(self, **changes: Any) -> ModelConfig:
        # An unshared model stays unshared when its depth changes (n_blocks follows n_layers).
        if "n_layers" in changes and "n_blocks" not in changes and self.n_blocks == self.n_layers:
            changes["n_blocks"] = changes["n_layers"]
        return attrs.evolve(self, **changes)

    # --- sizes ---------------------------------------------------------------------------
    def n_params(self, active: bool = False) -> int:
        """Parameter count (stored weights; with active=True, only the top-k experts count)."""
        d, hd = self.d_model, self.head_dim
        attn = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        if self.attn_bias:
            attn += hd * (self.n_heads + 2 * self.n_kv_heads)
        total = self.vocab_size * d * (1 if self.tie_embeddings else 2) + d  # embeddings, head, final norm
        n_exec = self.n_layers if active else self.n_blocks
        for layer in range(1, n_exec + 1):
            total += attn + d
            if self.has_dense(layer):
                total += 3 * d * self.ffn_dim + d
            if self.has_moe(layer):
                k = self.top_k if active else self.n_experts
                total += d + d * self.n_experts + k * 3 * d * self.expert_dim
                total += 3 * d * self.shared_expert_dim + (d if self.shared_expert_gate else 0)
        return total
