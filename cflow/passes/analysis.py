"""Critical-path analysis: weight bytes streamed per token, sequentially and along the heaviest DAG path.

Weighted ops: attention (QKV + O), dense FFN, router, the top-k experts (+ shared expert) and the
LM head, at the chosen weight dtype (norms and the router stay f32; arch5's shared blocks count once
per execution). The ratio sequential / critical measures how much weight traffic may overlap (more
cores, sockets, a disk tier); it does not change the total bytes a single socket must stream.
"""

from __future__ import annotations

import json

import attrs

from ..ir import Graph, Node
from ..layout.quant import DType, matrix_bytes

F32_KINDS = ("router",)  # router weights stay f32 whatever the quantisation


def _tensor_bytes(shape: tuple[int, ...], dtype: DType) -> int:
    if len(shape) == 1:
        return 4 * shape[0]  # biases and norm vectors: f32
    return matrix_bytes(shape[0], shape[1], dtype)


def op_bytes(g: Graph, n: Node, dtype: DType) -> int:
    """Weight bytes op `n` streams for one token (0 for ops without matrices)."""
    shapes = g.meta.shapes
    if n.kind in ("embedding", "rmsnorm", "add"):
        return 0  # one embedding row and norm vectors: negligible, not streamed as matrices
    dt = DType.F32 if n.kind in F32_KINDS else dtype
    if n.kind == "experts":
        per_expert = sum(_tensor_bytes(shapes[w], dt) for w in n.expert_weight_names(0))
        return n.top_k * per_expert + sum(_tensor_bytes(shapes[w], dt) for w in n.shared_weight_names())
    return sum(_tensor_bytes(shapes[w], dt) for w in n.weight_names())


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
            f"routing={self.routing}, weights {self.quant})",
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
        return "\n".join(lines)


def analyze(g: Graph, quant: str | DType = "q4") -> Analysis:
    """Sequential and critical-path weight bytes per token of graph `g` at weight dtype `quant`."""
    dtype = DType.parse(quant) if isinstance(quant, str) else DType(quant)
    order = list(g.nodes())
    w = {n.name: op_bytes(g, n, dtype) for n in order}
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
        name=g.name, quant=dtype.label, delays=g.meta.delays, routing=g.meta.routing, ops=ops,
        sequential_bytes=sum(w.values()), critical_bytes=best[end], critical_path=[p for p in path if w[p]],
    )
