"""ir.verify(graph): structural checks run at stage boundaries; errors name the node and show its neighbourhood."""

from __future__ import annotations

from ..errors import VerifyError
from .graph import INPUT, OUTPUT, Graph
from .nodes import Add, Attention, ExpertBank, LMHead, Node, Router
from .printer import format_node

STREAM_KINDS = ("embedding", "rmsnorm", "attention", "dense_ffn", "experts", "add")


def _fail(g: Graph, node: Node | None, msg: str) -> None:
    where = f"%{node.name} ({node.kind}, layer {node.layer})" if node else f"graph {g.name}"
    lines = [f"verify: {where}: {msg}"]
    if node is not None:
        around = [g[i] for i in node.inputs if i in g] + [node] + [g[u] for u in g.users(node.name)]
        lines += [format_node(g, n) for n in around]
    raise VerifyError("\n".join(lines))


def verify(g: Graph) -> Graph:
    """Acyclic, every read defined and typed right, head counts, delays consistent, weights present."""
    for n in g.insertion_order():  # undefined reads first: ordering needs defined nodes
        for i in n.inputs:
            if i != INPUT and i not in g:
                _fail(g, n, f"reads undefined value %{i}")
    order = list(g.nodes())  # raises on a cycle
    if OUTPUT not in g or not isinstance(g[OUTPUT], LMHead):
        _fail(g, None, f"no %{OUTPUT} lm_head node")
    dd, de = g.meta.delays
    if dd < 0 or de < 0:
        _fail(g, None, f"negative delays dd={dd}, de={de}")
    shapes = g.meta.shapes
    for n in order:
        if n.kind == "embedding" and n.inputs != (INPUT,):
            _fail(g, n, f"embedding must read %{INPUT}")
        if n.kind != "embedding" and INPUT in n.inputs:
            _fail(g, n, f"only the embedding reads %{INPUT}")
        ins = [g[i] for i in n.inputs if i != INPUT]
        if isinstance(n, ExpertBank):
            if len(ins) != 2 or ins[0].kind not in STREAM_KINDS or not isinstance(ins[1], Router):
                _fail(g, n, "experts read (hidden stream, route)")
            if ins[1].top_k != n.top_k or ins[1].n_experts != n.n_experts:
                _fail(g, n, f"router %{ins[1].name} routes {ins[1].top_k}/{ins[1].n_experts}, "
                            f"bank expects {n.top_k}/{n.n_experts}")
        else:
            for src in ins:
                if src.kind not in STREAM_KINDS:
                    _fail(g, n, f"reads %{src.name} of kind {src.kind}, expected a stream value")
                if getattr(src, "dim", None) != getattr(n, "dim", None):
                    _fail(g, n, f"reads %{src.name} of width {src.dim}, expected {n.dim}")
        if isinstance(n, Add) and len(n.inputs) < 2:
            _fail(g, n, "add needs at least two inputs")
        if isinstance(n, Attention) and n.n_heads % n.n_kv_heads:
            _fail(g, n, f"n_kv_heads={n.n_kv_heads} does not divide n_heads={n.n_heads}")
        if n.kind == "rmsnorm" and n.inputs and n.name.startswith("ffn_norm.") and dd is not None:
            want = f"a.{n.layer - dd}" if n.layer - dd >= 1 else "x0"
            if n.inputs[0] != want:
                _fail(g, n, f"dense delay {dd} means reading %{want}, not %{n.inputs[0]}")
        if isinstance(n, Add) and n.role == "inject":
            src = [i for i in n.inputs if i.startswith("moe.")]
            if len(src) != 1 or n.layer - int(src[0].split(".")[1]) != de:
                _fail(g, n, f"expert delay {de} means injecting %moe.{n.layer - de}")
        for w in n.weight_names():
            if w not in shapes and w not in g.weights:
                _fail(g, n, f"weight {w!r} is not defined")
    return g
