"""Critical-path analysis: weight bytes streamed per token, sequentially and along the heaviest DAG path.

Weighted ops: attention (QKV + O), dense FFN, router, the top-k experts (+ shared expert) and the
LM head, each weight at its storage type (passes/quantize.py: matrices at the chosen dtype, norms,
biases, the router and the shared-expert gate f32; arch5's shared blocks count once per execution).
The ratio sequential / critical measures how much weight traffic may overlap (more cores, sockets, a
disk tier); it does not change the total bytes a single socket must stream.

Two byte counts: without a tile, the logical bytes of the weights (the model's own size, what the
paper's numbers count); with a tile (`cflowc --emit analysis` passes its --tile), every matrix padded to
whole tiles as the compiled file stores and the step streams it, so the total equals the schedule's
bytes/token that `cflowc -o` and `cflow run` report. They differ when a matrix dimension is not a
multiple of the tile (d_model 128 under 256-column tiles streams twice its logical bytes).
"""

from __future__ import annotations

import json
import math

import attrs

from ..ir import Graph, Node
from ..layout.quant import BLOCK_SIZES, DType, matrix_bytes, padded
from .quantize import weight_dtype

ROWS_SUFFIXES = (".router", ".shared_gate")  # matrices stored as plain rows (never tiled, never padded)


def _tensor_bytes(name: str, shape: tuple[int, ...], quant: DType | None, tile: tuple[int, int] | None,
                  stored: dict | None = None) -> int:
    dt = weight_dtype(name, shape, quant, (stored or {}).get(name))
    if len(shape) == 1:
        return 4 * shape[0]  # biases and norm vectors: f32
    rows, cols = shape
    if name.endswith(ROWS_SUFFIXES):
        return rows * cols * (2 if dt == DType.F16 else 4)
    if tile is not None:
        rows, cols = padded(rows, tile[0]), padded(cols, math.lcm(tile[1], BLOCK_SIZES[dt][0]))
    return matrix_bytes(rows, cols, dt)


def op_bytes(g: Graph, n: Node, dtype: DType | None, tile: tuple[int, int] | None = None) -> int:
    """Weight bytes op `n` streams for one token (0 for ops without matrices); with `tile`, padded to it. dtype None:
    each weight at the type its source stores it in (a GGUF compiled as stored)."""
    shapes = g.meta.shapes
    stored = g.meta.source_dtypes or g.meta.weight_dtypes  # a GGUF's graph, or a compiled file's (from its header)
    if n.kind in ("embedding", "rmsnorm", "add"):
        return 0  # one embedding row and norm vectors: negligible, not streamed as matrices

    def size(w: str) -> int:  # a tied head streams its own quantised copy (named lm_head once quantised)
        name = "lm_head" if n.kind == "lm_head" and dtype is not None else w
        return _tensor_bytes(name, shapes[w], dtype, tile, stored)

    if n.kind == "experts":
        per_expert = sum(size(w) for w in n.expert_weight_names(0))
        return n.top_k * per_expert + sum(size(w) for w in n.shared_weight_names())
    return sum(size(w) for w in n.weight_names())


@attrs.frozen
class Analysis:
    name: str
    quant: str
    delays: tuple[int, int]
    routing: str
    ops: list[dict]  # every op: name, layer, kind, bytes, inputs (the DAG edges)
    sequential_bytes: int
    critical_bytes: int
    critical_path: list[str]  # weighted ops on the heaviest path, in order
    tile: tuple[int, int] | None = None  # matrices padded to this tile (None: logical bytes)
    logical_bytes: int = 0  # sequential bytes without tile padding

    @property
    def reduction(self) -> float:
        return self.sequential_bytes / self.critical_bytes if self.critical_bytes else 1.0

    def to_json(self) -> str:
        d = attrs.asdict(self)
        d["reduction"] = round(self.reduction, 6)
        return json.dumps(d, indent=2)

    def table(self) -> str:
        mb = 1e6
        lines = [
            f"critical-path analysis of {self.name} (dd={self.delays[0]}, de={self.delays[1]}, "
            f"routing={self.routing}, weights {self.quant}"
            + (f", tile {self.tile[0]}x{self.tile[1]}: matrices padded to whole tiles, as compiled)" if self.tile
               else ", logical bytes: no tile padding)"),
            "",
            f"{'op':<14} {'layer':>5} {'kind':<10} {'bytes/token':>14} {'critical':>8}",
        ]
        crit = set(self.critical_path)
        for op in self.ops:
            if op["bytes"]:
                mark = "*" if op["name"] in crit else ""
                lines.append(f"{op['name']:<14} {op['layer']:>5} {op['kind']:<10} {op['bytes']:>14,} {mark:>8}")
        lines += [
            "",
            f"sequential bytes/token:    {self.sequential_bytes:>14,} ({self.sequential_bytes / mb:.2f} MB)",
            f"critical-path bytes/token: {self.critical_bytes:>14,} ({self.critical_bytes / mb:.2f} MB)",
            f"critical path: {' -> '.join(self.critical_path)}",
            f"critical-path reduction: {self.reduction:.2f}x",
        ]
        if self.tile and self.logical_bytes != self.sequential_bytes:
            lines.insert(-3, f"  (logical bytes without tile padding: {self.logical_bytes:,} "
                             f"({self.logical_bytes / mb:.2f} MB))")
        return "\n".join(lines)


def analyze(g: Graph, quant: str | DType = "q4", tile: tuple[int, int] | None = None) -> Analysis:
    """Sequential and critical-path weight bytes per token of graph `g` at weight dtype `quant`; with `tile`,
    every matrix padded to whole tiles (the compiled file's bytes/token), else logical bytes."""
    from .quantize import STORED

    dtype = None if quant == STORED else DType.parse(quant) if isinstance(quant, str) else DType(quant)
    tile = tuple(int(t) for t in tile) if tile is not None else None
    order = list(g.nodes())
    w = {n.name: op_bytes(g, n, dtype, tile) for n in order}
    logical = sum(op_bytes(g, n, dtype) for n in order) if tile else sum(w.values())
    # Heaviest path by dynamic programming over the topological order (ties: first predecessor).
    best: dict[str, int] = {}
    prev: dict[str, str | None] = {}
    for n in order:
        preds = [i for i in n.inputs if i in best]
        p = max(preds, key=lambda i: best[i], default=None)
        best[n.name] = w[n.name] + (best[p] if p else 0)
        prev[n.name] = p
    end = max(best, key=best.get)
    path: list[str] = []
    cur: str | None = end
    while cur is not None:
        path.append(cur)
        cur = prev[cur]
    path.reverse()
    ops = [dict(name=n.name, layer=n.layer, kind=n.kind, bytes=w[n.name], inputs=list(n.inputs)) for n in order]
    return Analysis(
        name=g.name, quant=dtype.label if dtype is not None else STORED, delays=g.meta.delays,
        routing=g.meta.routing, ops=ops,
        sequential_bytes=sum(w.values()), critical_bytes=best[end], critical_path=[p for p in path if w[p]],
        tile=tile, logical_bytes=logical,
    )
