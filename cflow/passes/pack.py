"""The packing plan: which tensors a compiled file holds, how each is built from IR weights, and its bytes.

Forms: 'tiled' (one matrix, tile stream), 'concat' (QKV: parts row-concatenated, each padded to whole
tile-rows), 'gate_up' (gate and up tile-rows interleaved), 'rows' (plain row-major 2-D: embedding,
router, shared-expert gate; tile (1, cols)), 'vector' (f32 1-D: norms, biases).
Tensors are per weight block, so arch5's shared blocks are stored once; `block` is the file's layer field.
"""

from __future__ import annotations

import attrs
import numpy as np

from ..ir import Attention, DenseFFN, Embedding, ExpertBank, Graph, LMHead, Node, RMSNorm, Router
from ..ir.quant import DType, QTensor, dequantize
from . import tile as T


@attrs.frozen
class PackedTensor:
    name: str
    form: str
    parts: tuple[str, ...]
    dtype: DType
    part_shapes: tuple[tuple[int, ...], ...]
    tile: tuple[int, int]
    block: int = -1
    expert: int = -1

    @property
    def layout(self) -> T.TileLayout:
        """Layout of the whole stream as one matrix (gate_up: of ONE of the pair)."""
        if self.form == "concat":
            return T.concat_layout(self.part_shapes, self.dtype, self.tile).layout
        return T.TileLayout(self.dtype, *self.part_shapes[0], self.tile)

    @property
    def concat(self) -> T.ConcatLayout:
        return T.concat_layout(self.part_shapes, self.dtype, self.tile)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape declared in the file (padded rows for fused streams)."""
        if self.form == "vector":
            return self.part_shapes[0]
        if self.form == "concat":
            L = self.layout
            return (L.rows_p, L.cols)
        if self.form == "gate_up":
            L = self.layout
            return (2 * L.rows_p, L.cols)
        return self.part_shapes[0]

    @property
    def file_tile(self) -> tuple[int, int]:
        if self.form == "vector":
            return (0, 0)
        if self.form == "rows":
            return (1, self.part_shapes[0][1])
        return self.tile

    @property
    def nbytes(self) -> int:
        if self.form == "vector":
            return 4 * self.part_shapes[0][0]
        if self.form == "rows":
            r, c = self.part_shapes[0]
            return r * c * (2 if self.dtype == DType.F16 else 4)
        if self.form == "gate_up":
            return 2 * self.layout.nbytes
        return self.concat.nbytes if self.form == "concat" else self.layout.nbytes

    def materialize(self, weights) -> np.ndarray:
        """The bytes to store (uint8, or f32 for vectors), built from the graph's (quantised) weights."""
        ws = [weights[p] for p in self.parts]
        if self.form == "vector":
            return np.ascontiguousarray(dequantize(ws[0]), dtype=np.float32).reshape(-1)
        if self.form == "rows":
            npdt = np.float16 if self.dtype == DType.F16 else np.float32
            w = ws[0] if not isinstance(ws[0], QTensor) else dequantize(ws[0])
            return np.ascontiguousarray(w, dtype=npdt).reshape(-1).view(np.uint8)
        if self.form == "concat":
            return T.pack_concat(ws, self.dtype, self.tile)[0]
        if self.form == "gate_up":
            return T.pack_gate_up(ws[0], ws[1], self.dtype, self.tile)
        return T.pack(ws[0], self.dtype, self.tile)


def _block(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("blocks.") else -1


def node_tensors(g: Graph, n: Node, tile=T.DEFAULT_TILE) -> list[PackedTensor]:
    """The packed tensors op `n` reads, in the order its kernels stream them."""
    shapes = g.meta["shapes"]
    dts = {k: DType.parse(v) for k, v in g.meta.get("weight_dtypes", {}).items()}

    def dt(name):
        return dts.get(name, DType.F32)

    def mk(name, form, parts, expert=-1):
        return PackedTensor(name=name, form=form, parts=tuple(parts), dtype=dt(parts[0]),
                            part_shapes=tuple(tuple(shapes[p]) for p in parts), tile=tuple(tile),
                            block=_block(parts[0]), expert=expert)

    if isinstance(n, Embedding):
        return [mk("tok_embeddings", "rows", [n.weight])]
    if isinstance(n, RMSNorm):
        return [mk(n.weight, "vector", [n.weight])]
    if isinstance(n, Attention):
        p = n.prefix
        out = [mk(f"{p}.wqkv", "concat", [f"{p}.wq", f"{p}.wk", f"{p}.wv"])]
        if n.bias:
            out += [mk(f"{p}.{b}", "vector", [f"{p}.{b}"]) for b in ("bq", "bk", "bv")]
        return out + [mk(f"{p}.wo", "tiled", [f"{p}.wo"])]
    if isinstance(n, DenseFFN):
        p = n.prefix
        return [mk(f"{p}.w_gate_up", "gate_up", [f"{p}.w_gate", f"{p}.w_up"]), mk(f"{p}.w_down", "tiled", [f"{p}.w_down"])]
    if isinstance(n, Router):
        return [mk(n.weight, "rows", [n.weight])]
    if isinstance(n, ExpertBank):
        out = []
        for e in range(n.n_experts):
            p = f"{n.prefix}.experts.{e}"
            out += [mk(f"{p}.w_gate_up", "gate_up", [f"{p}.w_gate", f"{p}.w_up"], e),
                    mk(f"{p}.w_down", "tiled", [f"{p}.w_down"], e)]
        if n.shared_hidden:
            p = f"{n.prefix}.shared"
            out += [mk(f"{p}.w_gate_up", "gate_up", [f"{p}.w_gate", f"{p}.w_up"]), mk(f"{p}.w_down", "tiled", [f"{p}.w_down"])]
            if n.shared_gate:
                out.append(mk(f"{n.prefix}.shared_gate", "rows", [f"{n.prefix}.shared_gate"]))
        return out
    if isinstance(n, LMHead):
        return [mk("lm_head", "tiled", [n.weight])]
    return []


def plan(g: Graph, tile=T.DEFAULT_TILE) -> dict[str, PackedTensor]:
    """Every packed tensor of the graph, once each, in first-use order of the canonical node order."""
    out: dict[str, PackedTensor] = {}
    for n in g.nodes():
        for t in node_tensors(g, n, tile):
            out.setdefault(t.name, t)
    return out
