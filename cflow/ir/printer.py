"""The printed IR: one line per node in canonical order, stable and diffable (`cflowc --emit ir`).

    %attn.3 = attention[heads=8/8, head_dim=64, rope_theta=10000](%attn_norm.3) : f32[512]  {blocks.2.attn}

Header: graph name, delays, routing, weight dtype. No addresses, no ids that change between runs.
"""

from __future__ import annotations

from .graph import INPUT, OUTPUT, Graph
from .nodes import Add, Attention, DenseFFN, ExpertBank, LMHead, Node, Router
from .rope import scaling_label


def _fmt_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _op_attrs(node: Node) -> str:
    a = dict(node.attrs_for_print())
    a.pop("dim", None)
    # Variant attributes are shown only when they differ from plain Llama (the printed IR of the
    # families that have none stays as it was).
    for k, plain in (("bias", False), ("rope_scaling", None), ("rope_dim", 0), ("qk_norm", ""), ("softcap", 0.0),
                     ("window", 0), ("post_norm", False), ("act", "silu")):
        if k in a and a[k] == plain:
            a.pop(k)
    if isinstance(node, (Attention, DenseFFN)) and not (a.get("qk_norm") or a.get("post_norm")):
        a.pop("eps", None)
    if isinstance(node, Attention):
        a["heads"] = f"{a.pop('n_heads')}/{a.pop('n_kv_heads')}"
        if "rope_scaling" in a:
            a["rope_scaling"] = scaling_label(a["rope_scaling"])
    if isinstance(node, ExpertBank):
        a["experts"] = f"{a.pop('top_k')}/{a.pop('n_experts')}"
        if not a["shared_hidden"]:
            a.pop("shared_hidden")
            a.pop("shared_gate")
    if isinstance(node, Router):
        a["experts"] = f"{a.pop('top_k')}/{a.pop('n_experts')}"
    if isinstance(node, Add) and a.get("role") == "residual":
        a.pop("role")
    if isinstance(node, LMHead):
        a.pop("vocab")
    body = ", ".join(f"{k}={_fmt_value(v)}" for k, v in sorted(a.items()))
    return f"[{body}]" if body else ""


def value_type(node: Node) -> str:
    if isinstance(node, Router):
        return f"route[{node.top_k}]"
    if isinstance(node, LMHead):
        return f"f32[{node.vocab}]"
    return f"f32[{node.dim}]"


def _weight_note(g: Graph, node: Node) -> str:
    names = node.weight_names()
    if not names:
        return ""
    ref = getattr(node, "weight", None) or getattr(node, "prefix", None)
    dtypes = g.meta.weight_dtypes
    dts = sorted({dtypes[n].label for n in names if n in dtypes})
    return f"  {{{ref}{': ' + '/'.join(dts) if dts else ''}}}"


def format_node(g: Graph, node: Node) -> str:
    args = ", ".join("%" + i for i in node.inputs)
    return f"  %{node.name} = {node.kind}{_op_attrs(node)}({args}) : {value_type(node)}{_weight_note(g, node)}"


def format_header(g: Graph) -> str:
    m = g.meta
    dd, de = m.delays
    parts = [f"dd={dd}", f"de={de}", f"routing={m.routing}"]
    if tuple(m.trained_delays) != (dd, de):
        parts.append("trained_delays={},{}".format(*m.trained_delays))
    if m.quant is not None:
        parts.append(f"quant={m.quant.label}")
    return f"graph {g.name}(%{INPUT}: i32[T]) {{{', '.join(parts)}}}"


def format_graph(g: Graph) -> str:
    lines = [format_header(g)]
    lines += [format_node(g, n) for n in g.nodes()]
    lines.append(f"  return %{OUTPUT}")
    return "\n".join(lines) + "\n"


def format_dot(g: Graph) -> str:
    """The DAG for Graphviz (`cflowc MODEL --emit dot | dot -Tpng`): one cluster per layer, delayed reads dashed."""
    lines = [f'digraph "{g.name}" {{', "  rankdir=TB; node [shape=box, fontsize=10];"]
    by_layer: dict[int, list[Node]] = {}
    for n in g.nodes():
        by_layer.setdefault(n.layer, []).append(n)
    for layer, nodes in sorted(by_layer.items()):
        lines.append(f'  subgraph cluster_{layer} {{ label="layer {layer}"; color=gray;')
        for n in nodes:
            shape = "ellipse" if n.kind == "add" else "box"
            lines.append(f'    "{n.name}" [label="{n.name}\\n{n.kind}", shape={shape}];')
        lines.append("  }")
    for n in g.nodes():
        for i in n.inputs:
            if i == INPUT:
                continue
            delayed = g[i].layer not in (n.layer, n.layer - 1) and g[i].layer > 0
            lines.append(f'  "{i}" -> "{n.name}"' + (" [style=dashed, color=blue];" if delayed else ";"))
    lines.append("}")
    return "\n".join(lines) + "\n"
