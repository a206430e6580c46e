"""Recognise a decoder in an ONNX graph: embedding, RMSNorms, residual adds and the blocks between them.

Segmentation: the residual stream starts at the embedding Gather; an RMSNorm reading a stream value
opens a branch; an Add of a stream value and a branch value is a residual add (its output is the
next stream value). Every other node reading hidden values belongs to a branch; branches are the
connected components of those nodes (a norm output may feed several branches: the exporter merges
identical norms on one stream). Each branch is then classified (attention, dense SwiGLU, MoE, head)
and its weights extracted by data-flow role; onnx_import checks each one numerically afterwards.
Any node outside these patterns is an UnsupportedModelError naming it.
"""

from __future__ import annotations

from collections import defaultdict

import attrs
import numpy as np
from networkx.utils import UnionFind

from ..errors import UnsupportedModelError
from .onnx_graph import Node, OnnxModel, label

LAYOUT = {"Reshape", "Transpose", "Unsqueeze", "Squeeze", "Cast", "Identity", "Expand", "Flatten"}
ATTN_OPS = LAYOUT | {"MatMul", "Gemm", "Add", "Mul", "Div", "Sub", "Neg", "Slice", "Concat", "Split", "Softmax",
                     "Where", "IsNaN"}
DENSE_OPS = LAYOUT | {"MatMul", "Gemm", "Sigmoid", "Mul"}
MOE_OPS = LAYOUT | {"MatMul", "Gemm", "Sigmoid", "Mul", "Add", "Div", "Softmax", "TopK", "ReduceSum", "Gather",
                    "GatherND", "GatherElements", "ScatterElements", "ScatterND", "Split", "Slice", "Concat", "Tile",
                    "Where", "ConstantOfShape"}
HEAD_OPS = LAYOUT | {"MatMul", "Gemm"}
_HINT = {"Pow": "q/k norms (an RMSNorm inside the block)", "ReduceMean": "q/k norms (an RMSNorm inside the block)",
         "Tanh": "logit soft-capping", "Gelu": "a GELU activation (only SiLU is modelled)",
         "Erf": "a GELU activation (only SiLU is modelled)", "Relu": "a ReLU activation (only SiLU is modelled)",
         "LayerNormalization": "LayerNorm (only RMSNorm is modelled)"}


def unsupported(node, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{label(node)}: {what}")


@attrs.define
class Norm:
    input: str
    output: str
    weight: str
    eps: float
    nodes: list


@attrs.define
class Linear:
    node: object
    act: str  # the activation operand
    weight: str
    w: np.ndarray  # [out, in]
    bias: np.ndarray | None
    output: str  # after the bias add, if any
    bias_node: object = None


@attrs.define
class Branch:
    nodes: list
    norm_out: str
    output: str
    kind: str = ""
    info: dict = attrs.Factory(dict)

    @property
    def first(self):
        return self.nodes[0]


@attrs.define
class Decoder:
    """What segmentation found: embedding, norms, branches and the residual chain."""

    embedding: object
    emb_weight: str
    d: int
    vocab: int
    norms: dict  # norm output -> Norm
    branches: list
    chain: list  # [(add node, stream_in, branch, stream_out)] from x0 to the final stream
    x0: str
    final: str  # the stream value the head's norm reads
    head: Branch


# --- embedding and norms ------------------------------------------------------------------
def find_embedding(om: OnnxModel) -> tuple[object, str]:
    ids = {i.name for i in om.inputs}
    gathers = []
    for n in om.nodes:
        if n.op_type == "Gather" and len(n.input) == 2 and om.is_const(n.input[0]):
            src, seen = n.input[1], 0
            while src not in ids and src in om.producer and om.producer[src].op_type in LAYOUT and seen < 8:
                src, seen = om.producer[src].input[0], seen + 1
            if src in ids and len(om.const_shape(n.input[0]) or ()) == 2:
                gathers.append(n)
    if len(gathers) != 1:
        raise UnsupportedModelError(f"{om.where}: expected one token-embedding Gather of a [vocab, d] initializer "
                                    f"by the input ids, found {len(gathers)}")
    return gathers[0], gathers[0].input[0]


def _through(om: OnnxModel, v: str, ops=("Cast", "Identity")):
    """Skip producers of `v` that do not change values (casts)."""
    n = om.producer.get(v)
    while n is not None and n.op_type in ops:
        v = n.input[0]
        n = om.producer.get(v)
    return v, n


def _scalar(om: OnnxModel, v: str) -> float | None:
    c = om.const(v) if om.is_const(v) else None
    return float(c.reshape(-1)[0]) if c is not None and c.size == 1 else None


def match_norm(om: OnnxModel, mul, d: int) -> Norm | None:
    """Mul(w, x * 1/sqrt(mean(x^2) + eps)) with w [d] constant (or RMSNormalization / SimplifiedLayerNormalization)."""
    if mul.op_type in ("RMSNormalization", "SimplifiedLayerNormalization"):
        if len(mul.input) < 2 or not om.is_const(mul.input[1]) or om.attr(mul, "axis", -1) not in (-1, 2):
            return None
        return Norm(mul.input[0], mul.output[0], mul.input[1], float(om.attr(mul, "epsilon", 1e-5)), [mul])
    if mul.op_type != "Mul" or len(mul.input) != 2:
        return None
    for wi in (0, 1):
        w, y = mul.input[wi], mul.input[1 - wi]
        if om.const_shape(w) != (d,):
            continue
        y, yn = _through(om, y)
        nodes = [mul]
        if yn is None or yn.op_type not in ("Mul", "Div"):
            continue
        nodes.append(yn)
        for xi in ((0, 1) if yn.op_type == "Mul" else (0,)):
            x, r = yn.input[xi], yn.input[1 - xi]
            rv, rn = _through(om, r)
            chain = []
            if yn.op_type == "Div":  # x / sqrt(...)
                sq = rn
            elif rn is not None and rn.op_type == "Reciprocal":
                chain.append(rn)
                sq = om.producer.get(rn.input[0])
            elif rn is not None and rn.op_type == "Div" and _scalar(om, rn.input[0]) == 1.0:
                chain.append(rn)
                sq = om.producer.get(rn.input[1])
            else:
                continue
            if sq is None or sq.op_type != "Sqrt":
                continue
            add = om.producer.get(sq.input[0])
            if add is None or add.op_type != "Add":
                continue
            for ei in (0, 1):
                eps = _scalar(om, add.input[ei])
                mean = om.producer.get(add.input[1 - ei])
                if eps is None or mean is None or mean.op_type != "ReduceMean":
                    continue
                axes = om.const(mean.input[1]) if len(mean.input) > 1 and mean.input[1] else om.attr(mean, "axes")
                if (axes is None or list(np.asarray(axes).reshape(-1)) not in ([-1], [2])
                        or om.attr(mean, "keepdims", 1) != 1):
                    continue
                sqn = om.producer.get(mean.input[0])
                if sqn is None:
                    continue
                if sqn.op_type == "Pow" and _scalar(om, sqn.input[1]) == 2.0:
                    src = sqn.input[0]
                elif sqn.op_type == "Mul" and sqn.input[0] == sqn.input[1]:
                    src = sqn.input[0]
                else:
                    continue
                if _through(om, src)[0] != _through(om, x)[0]:
                    continue
                return Norm(_through(om, x)[0], mul.output[0], w, eps, nodes + chain + [sq, add, mean, sqn])
    return None


# --- segmentation -------------------------------------------------------------------------
STREAM, BRANCH = "stream", "branch"


def segment(om: OnnxModel) -> Decoder:
    if len(om.inputs) != 1:
        extra = [i.name for i in om.inputs][1:]
        raise UnsupportedModelError(f"{om.where}: graph input {extra[0]!r}: only input_ids [1, T] is supported "
                                    "(export the full-sequence forward without KV cache, "
                                    "attention_mask or position_ids)")
    if len(om.outputs) != 1:
        raise UnsupportedModelError(f"{om.where}: graph output {om.outputs[1]!r}: only logits [1, T, V] is supported "
                                    "(export without KV-cache outputs)")
    emb, emb_w = find_embedding(om)
    vocab, d = om.const_shape(emb_w)
    norms_by_node: dict[Node, list[Norm]] = defaultdict(list)
    finals: dict[Node, Norm] = {}
    for n in om.nodes:
        nm = match_norm(om, n, d)
        if nm is not None:
            finals[n] = nm
            for m in nm.nodes:
                norms_by_node[m].append(nm)
    kind: dict[str, str] = {emb.output[0]: STREAM}
    norms: dict[str, Norm] = {}
    adds, bnodes = [], []
    for n in om.nodes:
        if n is emb or not any(o in om.hidden for o in n.output):
            continue
        nm = finals.get(n)
        if nm is not None and kind.get(nm.input) == STREAM:
            norms[nm.output] = nm
            kind[nm.output] = BRANCH
            continue
        if any(kind.get(x.input) == STREAM for x in norms_by_node.get(n, [])):
            continue  # inside an RMSNorm of the stream
        hin = [v for v in n.input if v in om.hidden]
        kinds = [kind.get(v) for v in hin]
        if None in kinds:
            v = hin[kinds.index(None)]
            raise unsupported(n, f"reads {v!r}, an intermediate value of an RMSNorm or of an unrecognised op; "
                                 "expected the normalised output")
        if n.op_type == "Add" and sorted(kinds) == [BRANCH, STREAM]:
            adds.append(n)
            for o in n.output:
                kind[o] = STREAM
            continue
        if STREAM in kinds:
            v = hin[kinds.index(STREAM)]
            other = [x for x in n.input if x != v]
            c = om.const(other[0]) if n.op_type in ("Mul", "Div") and len(other) == 1 else None
            if c is not None and np.asarray(c).size == 1:  # Gemma's sqrt(d), Granite's embedding_multiplier
                what = "the embedding" if v == emb.output[0] else "the residual stream"
                raise unsupported(n, f"scales {what} ({v!r}) by the constant {float(np.asarray(c).reshape(-1)[0]):g}: "
                                     "an embedding scale (Gemma's sqrt(d), Granite's embedding_multiplier) is not read "
                                     "from ONNX; compile the PyTorch module or Hugging Face directory")
            raise unsupported(n, f"reads the residual stream {v!r} directly; expected an RMSNorm "
                                 "(Pow, ReduceMean, Add eps, Sqrt, Reciprocal, Mul weight) or a residual Add there")
        for o in n.output:
            kind[o] = BRANCH
        bnodes.append(n)
    branches = _components(om, bnodes, norms)
    by_value = {b.output: b for b in branches}
    chain, nxt = [], {}
    for a in adds:
        s = a.input[0] if kind[a.input[0]] == STREAM else a.input[1]
        b = a.input[1] if s == a.input[0] else a.input[0]
        if s in nxt:
            raise unsupported(a, f"the residual stream {s!r} is read by two residual adds; expected one chain")
        if b not in by_value:
            raise unsupported(a, f"adds {b!r}, which is not the output of a recognised block")
        nxt[s] = (a, b)
    s = emb.output[0]
    while s in nxt:
        a, b = nxt.pop(s)
        chain.append((a, s, by_value[b], a.output[0]))
        s = a.output[0]
    if nxt:
        a = next(iter(nxt.values()))[0]
        raise unsupported(a, "residual add off the main residual chain")
    heads = [b for b in branches if b.output in om.outputs]
    if len(heads) != 1 or norms[heads[0].norm_out].input != s:
        raise UnsupportedModelError(f"{om.where}: the logits must be computed by an RMSNorm of the last residual "
                                    f"stream value {s!r} and a [d, vocab] MatMul")
    for b in branches:
        if b is not heads[0] and b.output not in {c[2].output for c in chain}:
            raise unsupported(b.nodes[-1], "block output never reaches the residual stream")
    return Decoder(emb, emb_w, int(d), int(vocab), norms, branches, chain, emb.output[0], s, heads[0])


def _components(om: OnnxModel, bnodes: list, norms: dict) -> list[Branch]:
    """Connected components of branch nodes (linked through branch values that are not norm outputs)."""
    uf = UnionFind(bnodes)  # a Node hashes by identity; its OnnxModel owns it
    for n in bnodes:
        for v in n.input:
            p = om.producer.get(v)
            if p is not None and p in uf.parents and v not in norms:
                uf.union(p, n)
    groups: dict[Node, list] = defaultdict(list)
    for n in bnodes:  # in node order: the components come out in the order of their first node
        groups[uf[n]].append(n)
    out = []
    for nodes in groups.values():
        nodes.sort(key=om.order)
        members = set(nodes)
        ins = sorted({v for n in nodes for v in n.input if v in norms})
        if len(ins) != 1:
            raise unsupported(nodes[0], f"block reads {len(ins)} normalised streams {ins}; "
                                        "expected exactly one RMSNorm output")
        # Outputs: values read outside the block (by a residual add; Shape reads do not count) or by the graph.
        outs = sorted({o for n in nodes for o in n.output
                       if o in om.outputs or any(u not in members and not _shape_only(u) for u in om.users(o))})
        if len(outs) != 1:
            raise unsupported(nodes[-1], f"block has {len(outs)} outputs {outs}; "
                                         "expected one, added to the residual stream")
        out.append(Branch(nodes, ins[0], outs[0]))
    return out


def _shape_only(node) -> bool:
    return node.op_type in ("Shape", "Size")


# --- weights ------------------------------------------------------------------------------
def linears(om: OnnxModel, b: Branch) -> list[Linear]:
    """MatMul/Gemm nodes of a branch with a constant 2-D weight, with a following constant bias Add."""
    out = []
    for n in b.nodes:
        if n.op_type == "MatMul":
            if om.is_const(n.input[1]) and len(om.const_shape(n.input[1])) == 2:
                w = np.asarray(om.const(n.input[1]), dtype=np.float32).T
                act, wname = n.input[0], n.input[1]
            elif om.is_const(n.input[0]) and len(om.const_shape(n.input[0])) == 2:
                raise unsupported(n, "weight-on-the-left MatMul with a 2-D constant; expected x @ W")
            else:
                continue
            bias = None
        elif n.op_type == "Gemm":
            if not om.is_const(n.input[1]):
                continue
            if om.attr(n, "transA", 0) or om.attr(n, "alpha", 1.0) != 1.0 or om.attr(n, "beta", 1.0) != 1.0:
                raise unsupported(n, "Gemm with transA/alpha/beta; expected x @ W^T (+ b)")
            w = np.asarray(om.const(n.input[1]), dtype=np.float32)
            w = w if om.attr(n, "transB", 0) else w.T
            act, wname = n.input[0], n.input[1]
            bias = np.asarray(om.const(n.input[2]), dtype=np.float32) if len(n.input) > 2 and n.input[2] else None
        else:
            continue
        lin = Linear(n, act, wname, w, bias, n.output[0])
        users = om.users(n.output[0])
        if bias is None and len(users) == 1 and users[0].op_type == "Add":
            a = users[0]
            other = a.input[1] if a.input[0] == n.output[0] else a.input[0]
            if om.is_const(other) and om.const_shape(other) == (w.shape[0],):
                lin.bias, lin.output, lin.bias_node = np.asarray(om.const(other), dtype=np.float32), a.output[0], a
        out.append(lin)
    return out


def descendants(om: OnnxModel, b: Branch, start: str) -> set[str]:
    """Values of branch `b` computed from `start` (inclusive)."""
    members = set(b.nodes)
    seen, todo = {start}, [start]
    while todo:
        v = todo.pop()
        for u in om.users(v):
            if u in members:
                for o in u.output:
                    if o not in seen:
                        seen.add(o)
                        todo.append(o)
    return seen


def check_ops(b: Branch, allowed: set, what: str, where: str) -> None:
    """Every op of the branch must belong to the pattern; reports the most telling offender (one we know)."""
    bad = [n for n in b.nodes if n.op_type not in allowed or n.domain not in ("", "ai.onnx")]
    if not bad:
        return
    n = next((x for x in bad if x.op_type in _HINT), bad[0])
    hint = _HINT.get(n.op_type, f"op {n.op_type} is not part of {what}")
    raise unsupported(n, f"in the {what} ({where}): {hint}; expected only {', '.join(sorted(allowed - LAYOUT))} "
                         "(and layout ops)")
