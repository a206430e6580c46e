"""IR node types: one attrs class per op of the layer dependency DAG.

Each node produces one value named after it (`%attn.3`); `inputs` names the values it reads, so
the edges say exactly which residual-stream version an op consumes (`%ffn_norm.3` reading `%a.2`
is a dense delay of 1). Weights are referenced by name prefix into `Graph.weights`.
Layers are 1-based; global ops (embedding, final norm, head) have layer 0 / n_layers + 1.
"""

from __future__ import annotations

from typing import ClassVar

import attrs


@attrs.frozen(kw_only=True)
class Node:
    kind: ClassVar[str] = "node"
    name: str
    inputs: tuple[str, ...] = attrs.field(converter=tuple)
    layer: int = 0

    def attrs_for_print(self) -> dict:
        """Op attributes shown inside [...] by the printer (sorted, no weights)."""
        skip = {"name", "inputs", "layer", "prefix", "weight"}
        return {f.name: getattr(self, f.name) for f in attrs.fields(type(self)) if f.name not in skip}

    def weight_names(self) -> tuple[str, ...]:
        """Names of the weight tensors in Graph.weights this op reads (all experts for a bank)."""
        return ()

    def with_inputs(self, *inputs: str) -> Node:
        return attrs.evolve(self, inputs=inputs)


@attrs.frozen(kw_only=True)
class Embedding(Node):
    kind: ClassVar[str] = "embedding"
    weight: str
    vocab: int
    dim: int

    def weight_names(self):
        return (self.weight,)


@attrs.frozen(kw_only=True)
class RMSNorm(Node):
    kind: ClassVar[str] = "rmsnorm"
    weight: str
    dim: int
    eps: float

    def weight_names(self):
        return (self.weight,)


@attrs.frozen(kw_only=True)
class Attention(Node):
    """Q/K/V projections (+ biases), RoPE, causal GQA over the KV cache, output projection.

    Weights: {prefix}.wq [H*hd, d], .wk/.wv [KV*hd, d], .wo [d, H*hd], and .bq/.bk/.bv if bias.
    Variants (ModelConfig documents each): rope_scaling / rope_dim (ir/rope.py), qk_norm ('head':
    {prefix}.q_norm/.k_norm [hd]; 'proj': [H*hd] / [KV*hd]; RMSNorm before RoPE, eps), softcap on the
    scores, window (sliding, 0 = none), post_norm ({prefix}.post_norm [d]: the output RMS-normalised, eps).
    """

    kind: ClassVar[str] = "attention"
    prefix: str
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float
    bias: bool = False
    rope_scaling: tuple | None = None
    rope_dim: int = 0  # 0: head_dim
    qk_norm: str = ""
    softcap: float = 0.0
    window: int = 0
    post_norm: bool = False
    eps: float = 1e-6  # of the q/k and post norms

    def weight_names(self):
        names = tuple(f"{self.prefix}.{w}" for w in ("wq", "wk", "wv", "wo"))
        if self.bias:
            names += tuple(f"{self.prefix}.{b}" for b in ("bq", "bk", "bv"))
        if self.qk_norm:
            names += (f"{self.prefix}.q_norm", f"{self.prefix}.k_norm")
        if self.post_norm:
            names += (f"{self.prefix}.post_norm",)
        return names


@attrs.frozen(kw_only=True)
class DenseFFN(Node):
    """SwiGLU: down(act(gate x) * up x), act = silu (or gelu_tanh: GeGLU).
    Weights {prefix}.w_gate/.w_up [hidden, d], .w_down [d, hidden]; post_norm: output RMS-normalised with
    {prefix}.post_norm [d] (eps)."""

    kind: ClassVar[str] = "dense_ffn"
    prefix: str
    dim: int
    hidden: int
    act: str = "silu"
    post_norm: bool = False
    eps: float = 1e-6

    def weight_names(self):
        names = tuple(f"{self.prefix}.{w}" for w in ("w_gate", "w_up", "w_down"))
        return names + ((f"{self.prefix}.post_norm",) if self.post_norm else ())


@attrs.frozen(kw_only=True)
class Router(Node):
    """logits = W h; softmax; top-k; optional renormalisation. Produces (weights[k], indices[k]).

    Weight {weight} [n_experts, d], kept in f32.
    """

    kind: ClassVar[str] = "router"
    weight: str
    dim: int
    n_experts: int
    top_k: int
    normalize: bool

    def weight_names(self):
        return (self.weight,)


@attrs.frozen(kw_only=True)
class ExpertBank(Node):
    """Sum over the routed top-k of weight * SwiGLU_e(h), plus an optional shared expert.

    inputs = (h, route). Expert e's weights: {prefix}.experts.{e}.w_gate/.w_up/.w_down.
    Shared expert: {prefix}.shared.w_gate/... gated by sigmoid({prefix}.shared_gate · h) if gated.
    """

    kind: ClassVar[str] = "experts"
    prefix: str
    dim: int
    hidden: int
    n_experts: int
    top_k: int
    shared_hidden: int = 0
    shared_gate: bool = False
    act: str = "silu"

    def expert_weight_names(self, e: int) -> tuple[str, ...]:
        return tuple(f"{self.prefix}.experts.{e}.{w}" for w in ("w_gate", "w_up", "w_down"))

    def shared_weight_names(self) -> tuple[str, ...]:
        if not self.shared_hidden:
            return ()
        names = tuple(f"{self.prefix}.shared.{w}" for w in ("w_gate", "w_up", "w_down"))
        return names + ((f"{self.prefix}.shared_gate",) if self.shared_gate else ())

    def weight_names(self):
        out: tuple[str, ...] = ()
        for e in range(self.n_experts):
            out += self.expert_weight_names(e)
        return out + self.shared_weight_names()


@attrs.frozen(kw_only=True)
class Add(Node):
    """Residual add. role: 'residual' (a_l, b_l), 'inject' (x_l = b_l + e_{l-de}), 'flush' (pending e's)."""

    kind: ClassVar[str] = "add"
    dim: int
    role: str = "residual"


@attrs.frozen(kw_only=True)
class LMHead(Node):
    """logits = W h; softcap > 0: logits -> softcap * tanh(logits / softcap)."""

    kind: ClassVar[str] = "lm_head"
    weight: str
    dim: int
    vocab: int
    softcap: float = 0.0

    def weight_names(self):
        return (self.weight,)


NODE_TYPES: dict[str, type[Node]] = {
    t.kind: t for t in (Embedding, RMSNorm, Attention, DenseFFN, Router, ExpertBank, Add, LMHead)
}
