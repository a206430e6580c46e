"""Quantisation pass: choose each weight's storage type and give the graph quantised weights.

Policy (documented in docs/FORMAT.md): every matrix an op streams (attention, dense FFN, experts,
shared expert, LM head) takes the requested type; norm vectors, biases, the router and the shared
expert's gate stay f32 (tiny, and routing decisions are sensitive); the token embedding is f16 for
q4/q8/f16 (one row is read per token, f16 keeps it exact enough) and f32 for f32.
Weights are quantised lazily on access, so a big model never sits in memory twice.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from ..ir import Graph
from ..layout.quant import DType, QTensor, dequantize, quantize
from .manager import Pass, graph_pass

F32_SUFFIXES = (".router", ".shared_gate")


def weight_dtype(name: str, shape: tuple[int, ...], quant: DType) -> DType:
    """Storage type of IR weight `name` under the requested quantisation."""
    if len(shape) == 1 or name.endswith(F32_SUFFIXES):
        return DType.F32
    if name == "tok_embeddings":
        return DType.F32 if quant == DType.F32 else DType.F16
    return quant


class QuantizedWeights(Mapping):
    """A read-only view of `source` weights stored at `dtypes[name]`: quantised on access.

    Values are QTensor (Q4/Q8) or float arrays (F16 kept as float16, F32). Nothing is cached,
    so streaming every weight once (the compiler) holds one tensor at a time.
    """

    def __init__(self, source: Mapping, dtypes: Mapping[str, DType], aliases: Mapping[str, str] | None = None):
        self.source, self.dtypes, self.aliases = source, dtypes, dict(aliases or {})

    def __getitem__(self, name: str):
        w = self.source[self.aliases.get(name, name)]
        dt = self.dtypes.get(name, DType.F32)
        if isinstance(w, QTensor):
            if w.dtype == dt:
                return w
            w = dequantize(w)
        return quantize(w, dt) if getattr(w, "ndim", 2) == 2 or dt != DType.F32 else w

    def __iter__(self):
        yield from self.source
        yield from (a for a in self.aliases if a not in self.source)

    def __len__(self) -> int:
        return len(self.source) + sum(a not in self.source for a in self.aliases)


def quantize_weights(quant: str | DType) -> Pass:
    """Give every weight its storage type (see module docstring); meta.quant records the choice."""
    q = DType.parse(quant) if isinstance(quant, str) else DType(quant)

    @graph_pass(name="quantize_weights")
    def run(g: Graph, ctx) -> Graph:
        g = g.copy()
        head = g["logits"]
        aliases = {}
        if head.weight != "lm_head":
            # Tied embeddings: the head streams its own quantised copy (the embedding row stays f16).
            g.meta.shapes = {**g.meta.shapes, "lm_head": g.meta.shapes[head.weight]}
            aliases["lm_head"] = head.weight
            g.replace(attrs.evolve(head, weight="lm_head"))
        dtypes = {name: weight_dtype(name, shape, q) for name, shape in g.meta.shapes.items()}
        g.meta.quant = q
        g.meta.weight_dtypes = dtypes
        if g.weights:
            g.weights = QuantizedWeights(g.weights, dtypes, aliases)
        return g

    return run
