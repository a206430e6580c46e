"""Quantisation pass: choose each weight's storage type and give the graph quantised weights.

Policy (documented in docs/FORMAT.md): every matrix an op streams (attention, dense FFN, experts,
shared expert, LM head) takes the requested type; norm vectors, biases, the router and the shared
expert's gate stay f32 (tiny, and routing decisions are sensitive); the token embedding is f16 for
q4/q8/f16 (one row is read per token, f16 keeps it exact enough) and f32 for f32.

quant="stored" (the default for a GGUF): every weight keeps the type its file stores it in
(graph.meta.source_dtypes: Q4_0/Q8_0 as Q4/Q8, the K-quants and the other block types of layout/blocks.py
as themselves, F16 as F16, F32 and BF16 as F32), the token embedding included: a quantised embedding is
one tile stream that the embedding reads a row of and, for tied embeddings, the head streams too (no copy).
Weights are quantised lazily on access, so a big model never sits in memory twice.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from ..errors import CflowError, UnsupportedModelError
from ..ir import Graph
from ..layout import STORED  # quantize_weights(STORED): every weight at the type its source stores it in
from ..layout.blocks import BlockTensor, is_block_type
from ..layout.quant import BLOCK_SIZES, DType, QTensor, dequantize, quantize
from .manager import Pass, graph_pass

F32_SUFFIXES = (".router", ".shared_gate")


class RequantiseWarning(UserWarning):
    """--quant changed a GGUF's quantised matrices from the types its file stores."""


def weight_dtype(name: str, shape: tuple[int, ...], quant: DType, stored: DType | None = None) -> DType:
    """Storage type of IR weight `name` under the requested quantisation (quant None: as `stored`)."""
    if len(shape) == 1 or name.endswith(F32_SUFFIXES):
        return DType.F32
    if quant is None:
        if stored is None:
            raise CflowError(f"weight {name!r}: no stored type to keep (--quant stored needs a GGUF source)")
        return stored
    if name == "tok_embeddings":
        return DType.F32 if quant == DType.F32 else DType.F16
    return quant


def embedding_tiled(dtypes) -> bool:
    """A quantised token embedding is stored as a tile stream (rows looked up from it; a tied head streams it)."""
    return dtypes.get("tok_embeddings", DType.F32).quantised


def dominant(dtypes: dict, shapes: dict) -> DType:
    """The type holding the most matrix weights (meta.quant of a file compiled as stored)."""
    count: dict = {}
    for n, dt in dtypes.items():
        shape = shapes.get(n, ())
        if len(shape) == 2:
            count[dt] = count.get(dt, 0) + shape[0] * shape[1]
    return max(count, key=count.get) if count else DType.F32


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
        if isinstance(w, (QTensor, BlockTensor)):
            if w.dtype == dt:
                return w
            w = dequantize(w)
        return quantize(w, dt) if getattr(w, "ndim", 2) == 2 or dt != DType.F32 else w

    def __iter__(self):
        yield from self.source
        yield from (a for a in self.aliases if a not in self.source)

    def __len__(self) -> int:
        return len(self.source) + sum(a not in self.source for a in self.aliases)


def quantize_weights(quant: str | DType, dtypes: dict | None = None) -> Pass:
    """Give every weight its storage type (see module docstring); meta.quant records the choice.

    dtypes: an explicit type per IR weight (a file header's weight_dtypes, re-deriving the plan a file claims)."""
    q = None if quant == STORED else DType.parse(quant) if isinstance(quant, str) else DType(quant)

    @graph_pass(name="quantize_weights")
    def run(g: Graph, ctx) -> Graph:
        g = g.copy()
        head = g["logits"]
        aliases = {}
        shapes = dict(g.meta.shapes)
        stored = g.meta.source_dtypes or {}
        if dtypes is not None:
            types = {n: _check_type(n, shapes.get(n, ()), dtypes.get(n)) for n in shapes}
        elif q is None:
            if g.meta.source_dtypes is None:
                raise CflowError(f"{g.name}: --quant stored keeps a GGUF file's own types; this model comes from "
                                 f"{g.meta.source or 'a source'} with none (give --quant q4, q8, f16 or f32)")
            notes = g.meta.source_notes or {}
            missing = [n for n, shape in shapes.items() if len(shape) == 2 and n not in stored
                       and not n.endswith(F32_SUFFIXES)]
            if missing:
                n = missing[0]
                raise UnsupportedModelError(f"{notes.get(n, n)}, a type cflow does not execute as stored: compile "
                                            "with --quant q8 (or q4, f16, f32) to requantise it")
            types = {name: weight_dtype(name, shape, q, stored.get(name)) for name, shape in shapes.items()}
        else:
            types = {name: weight_dtype(name, shape, q, stored.get(name)) for name, shape in shapes.items()}
            _requantise_note(g, stored, types, q)
        if dtypes is not None:  # a header's plan: the head has its own copy iff the header lists one
            copy = "lm_head" in dtypes
        else:  # a tied head streams its own quantised copy (the embedding row stays f16), unless the embedding is
            copy = not (q is None and embedding_tiled(types))  # itself a tile stream kept as stored: then one
        if head.weight != "lm_head" and copy:
            g.meta.shapes = {**shapes, "lm_head": shapes[head.weight]}
            aliases["lm_head"] = head.weight
            g.replace(attrs.evolve(head, weight="lm_head"))
            types["lm_head"] = (_check_type("lm_head", shapes[head.weight], dtypes["lm_head"]) if dtypes is not None
                                else weight_dtype("lm_head", shapes[head.weight], q, stored.get(head.weight)))
        g.meta.quant = q if q is not None else dominant(types, g.meta.shapes)
        g.meta.stored = q is None
        g.meta.weight_dtypes = types
        if g.weights:
            g.weights = QuantizedWeights(g.weights, types, aliases)
        return g

    return run


def _requantise_note(g, stored: dict, types: dict, q: DType) -> None:
    """Warn once when --quant changes a GGUF's matrices from the types the file stores (compiling without --quant
    keeps them)."""
    changed = sorted({stored[n].gguf_name for n, dt in types.items() if n in stored and len(g.meta.shapes[n]) == 2
                      and stored[n] != dt and stored[n].quantised and n != "tok_embeddings"})
    if changed:
        import warnings

        warnings.warn(f"{g.name}: matrices the file stores as {'/'.join(changed)} are requantised to {q.label} "
                      "(compile without --quant to keep the file's types and bytes)", RequantiseWarning, stacklevel=2)


def _check_type(name: str, shape, dt) -> DType:
    """A type from a header's weight_dtypes, checked against the weight it is for."""
    if not isinstance(dt, DType):
        try:
            dt = DType.parse(dt)
        except (ValueError, TypeError, AttributeError):
            raise CflowError(f"weight_dtypes: weight {name!r} has no known type ({dt!r})") from None
    if len(shape) == 1 and dt != DType.F32:
        raise CflowError(f"weight_dtypes: vector {name!r} must be f32, not {dt.label}")
    qk = BLOCK_SIZES[dt][0]
    if len(shape) == 2 and is_block_type(dt) and shape[1] % qk:
        raise CflowError(f"weight_dtypes: {name!r} has {shape[1]} inputs per row, not a whole number of "
                         f"{dt.gguf_name} blocks of {qk}")
    return dt


def default_quant(g: Graph) -> str:
    """What a compile without --quant does: keep a GGUF's own types ("stored"), else q4. (cflowc chooses a type
    mix instead for a float model file: float_source.)"""
    return STORED if g.meta.source_dtypes is not None else "q4"


def float_source(g: Graph) -> bool:
    """Whether every matrix of the model is float at its source: a model directory's or an ONNX file's weights,
    a GGUF of F32/F16/BF16 matrices (not one whose matrices are quantised)."""
    stored = g.meta.source_dtypes
    if stored is None:
        return True
    mats = [n for n, s in g.meta.shapes.items() if len(s) == 2]  # (one cflow cannot execute is not in `stored`)
    return all(n in stored and stored[n] in (DType.F32, DType.F16) for n in mats)


def fit_tile(g: Graph, tile=None) -> tuple[int, int]:
    """The tile a compile without --tile uses: the default rows, and columns that divide every matrix's input
    width (the largest multiple of 32 up to the default that does), so no matrix is padded and the file's bytes
    per token are the model's own (a GGUF's Gemma 3 270M: 640 wide, 128-column tiles, not 256 with 20% padding)."""
    from math import gcd

    from ..layout import DEFAULT_TILE

    tr, tc = tile if tile is not None else DEFAULT_TILE
    widths = {s[1] for n, s in g.meta.shapes.items() if len(s) == 2 and not n.endswith(F32_SUFFIXES)}
    common = 0
    for w in widths:
        common = gcd(common, w)
    if not common or common % 32:
        return (tr, tc)
    best = 32
    for c in range(32, tc + 1, 32):
        if common % c == 0:
            best = c
    return (tr, best)
