"""Classify the branches onnx_patterns found and pull out their weights by data-flow role.

attention: 4 projections (q, k reach the score MatMul's left and right operands, v its value
operand, o reads the result), one Softmax, RoPE frequencies from the inv_freq constant.
dense: SwiGLU (the projection feeding a Sigmoid is the gate). moe: router -> Softmax -> TopK
(-> ReduceSum/Div renormalisation), 3-D expert weights (gathered per token, HF batched_mm, or
applied densely and masked, our export), optional shared expert with a sigmoid gate. head: one
[d, vocab] projection of the final norm.
"""

from __future__ import annotations

import numpy as np

from ..ir.interp import rope, silu, softmax
from .onnx_graph import OnnxModel, label
from .onnx_patterns import ATTN_OPS, DENSE_OPS, HEAD_OPS, MOE_OPS, Branch, check_ops, descendants, linears, unsupported


def classify(om: OnnxModel, b: Branch, where: str) -> None:
    ops = {n.op_type for n in b.nodes}
    if b.output in om.outputs:
        b.kind = "head"
        extract_head(om, b, where)
    elif "TopK" in ops:
        b.kind = "moe"
        extract_moe(om, b, where)
    elif "Softmax" in ops:
        b.kind = "attention"
        extract_attention(om, b, where)
    else:
        b.kind = "dense"
        extract_dense(om, b, where)


def _reaches(om: OnnxModel, b: Branch, start: str, target: str) -> bool:
    return target in descendants(om, b, start)


def _sigmoid_inputs(b: Branch) -> list[str]:
    return [n.input[0] for n in b.nodes if n.op_type == "Sigmoid"]


# --- attention ----------------------------------------------------------------------------
def extract_attention(om: OnnxModel, b: Branch, where: str) -> None:
    check_ops(b, ATTN_OPS, "attention", where)
    lins = linears(om, b)
    sm = [n for n in b.nodes if n.op_type == "Softmax"]
    if len(sm) != 1:
        raise unsupported(sm[1], f"attention of {where} has {len(sm)} Softmax ops; expected one")
    sm = sm[0]
    after = descendants(om, b, sm.output[0])
    mms = [n for n in b.nodes if n.op_type == "MatMul" and not any(om.is_const(v) for v in n.input)]
    scores = [n for n in mms if _reaches(om, b, n.output[0], sm.input[0])]
    pv = [n for n in mms if n.input[0] in after]
    if len(scores) != 1 or len(pv) != 1:
        raise unsupported(sm, f"attention of {where}: expected softmax(q @ k^T) @ v around this Softmax")
    scores, pv = scores[0], pv[0]
    o = [l for l in lins if l.act in descendants(om, b, pv.output[0])]
    ins = [l for l in lins if l not in o]
    if len(lins) == 2 and len(o) == 1:  # one projection feeding q, k and v (Phi-3's qkv_proj), then sliced
        fused = [l for l in lins if l not in o][0]
        raise unsupported(fused.node, f"attention of {where}: one fused q/k/v projection (as Phi-3's qkv_proj) is not "
                                      "read from ONNX (expected separate q, k, v projections); compile the PyTorch "
                                      "module or Hugging Face directory")
    if len(lins) != 4 or len(o) != 1:
        raise unsupported(lins[0].node if lins else sm,
                          f"attention of {where} has {len(lins)} projections; expected q, k, v and o")
    role = {}
    for l in ins:
        r = [name for name, tgt in (("q", scores.input[0]), ("k", scores.input[1]), ("v", pv.input[1]))
             if _reaches(om, b, l.output, tgt)]
        if len(r) != 1 or r[0] in role:
            raise unsupported(l.node, f"attention of {where}: cannot tell whether this projection is q, k or v")
        role[r[0]] = l
    if o[0].bias is not None:
        raise unsupported(o[0].bias_node, f"attention of {where}: an output-projection bias is not modelled")
    biases = [role[r].bias is not None for r in "qkv"]
    if any(biases) and not all(biases):
        raise unsupported(role["q"].node, f"attention of {where}: biases on only some of q/k/v are not modelled")
    inv, theta = rope_frequencies(om, b, where)
    hd = 2 * inv.size
    q, k, v = role["q"].w, role["k"].w, role["v"].w
    if q.shape[0] % hd or k.shape[0] % hd or k.shape != v.shape or o[0].w.shape[1] != q.shape[0]:
        raise unsupported(role["q"].node, f"attention of {where}: projection shapes q {q.shape}, k {k.shape}, "
                                          f"v {v.shape}, o {o[0].w.shape} do not fit head_dim {hd}")
    b.info = dict(wq=q, wk=k, wv=v, wo=o[0].w, bias=all(biases), head_dim=hd, n_heads=q.shape[0] // hd,
                  n_kv_heads=k.shape[0] // hd, rope_theta=theta, names=(role["q"].weight, role["k"].weight,
                                                                        role["v"].weight, o[0].weight))
    if all(biases):
        b.info.update(bq=role["q"].bias, bk=role["k"].bias, bv=role["v"].bias)


def aux_inputs(om: OnnxModel, b: Branch) -> list[str]:
    """Position-only values a branch reads (mask, RoPE tables, shapes): neither hidden nor constant."""
    return sorted({v for n in b.nodes for v in n.input if v and v not in om.hidden and not om.is_const(v)})


def rope_frequencies(om: OnnxModel, b: Branch, where: str) -> tuple[np.ndarray, float]:
    """The inverse-frequency constant the RoPE tables are computed from, and the theta it implies."""
    cands = {}
    for n in om.backward_slice(aux_inputs(om, b), stop=set()):
        for v in n.input:
            if v in cands or not om.is_const(v):
                continue
            c = om.const(v)
            if c is None or c.dtype.kind != "f" or c.size < 1 or c.size > 4096:
                continue
            f = np.asarray(c, dtype=np.float64).reshape(-1)
            if f[0] == 1.0 and (f.size == 1 or (np.all(np.diff(f) < 0) and f[-1] > 0)):
                cands[v] = f
    if len(cands) != 1:
        raise unsupported(b.first, f"attention of {where}: expected one RoPE inverse-frequency constant "
                                   f"(1, theta^(-2/hd), ...), found {len(cands)} {sorted(cands)[:3]}")
    f = next(iter(cands.values()))
    hd = 2 * f.size
    if f.size == 1:
        return f.astype(np.float32), 10000.0  # hd = 2: theta does not change the table
    i = np.arange(f.size, dtype=np.float64)
    x = 2.0 * i[1:] / hd
    log_theta = float(-(x * np.log(f[1:])).sum() / (x * x).sum())
    theta = snap_float(np.exp(log_theta), lambda t: 1.0 / (t ** (np.arange(0, hd, 2, dtype=np.float32) / hd)), f)
    want = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    if not np.allclose(f, want, rtol=1e-5, atol=0):
        raise unsupported(b.first, f"attention of {where}: RoPE frequencies are not theta^(-2i/head_dim) "
                                   "(rope scaling is not modelled)")
    return f.astype(np.float32), theta


def snap_float(x: float, table=None, target=None) -> float:
    """The shortest decimal that reproduces `x` (or `table(x)` == target to float32 precision)."""
    for digits in range(1, 17):
        c = float(f"{x:.{digits}g}")
        if table is None:
            if np.float32(c) == np.float32(x):
                return c
        elif np.allclose(np.asarray(table(c), np.float64), target, rtol=3e-7, atol=0):
            return c
    return float(x)


# --- dense SwiGLU -------------------------------------------------------------------------
def _swiglu_roles(om: OnnxModel, b: Branch, lins: list, where: str, what: str) -> dict:
    sig = _sigmoid_inputs(b)
    gate = [l for l in lins if any(_reaches(om, b, l.output, s) for s in sig)]
    down = [l for l in lins if any(l.act in descendants(om, b, g.output) for g in gate)]
    up = [l for l in lins if l not in gate and l not in down]
    if len(gate) != 1 or len(down) != 1 or len(up) != 1:
        raise unsupported(lins[0].node if lins else b.first,
                          f"{what} of {where}: expected SwiGLU down(silu(gate x) * up x): three projections, "
                          "the gate one through Sigmoid * x")
    for l in (gate[0], up[0], down[0]):
        if l.bias is not None:
            raise unsupported(l.bias_node or l.node, f"{what} of {where}: feed-forward biases are not modelled")
    return dict(w_gate=gate[0].w, w_up=up[0].w, w_down=down[0].w,
                names=(gate[0].weight, up[0].weight, down[0].weight))


def extract_dense(om: OnnxModel, b: Branch, where: str) -> None:
    check_ops(b, DENSE_OPS, "dense feed-forward", where)
    lins = linears(om, b)
    if len(lins) != 3:
        raise unsupported(lins[0].node if lins else b.first,
                          f"dense feed-forward of {where} has {len(lins)} projections; expected SwiGLU (3)")
    b.info = _swiglu_roles(om, b, lins, where, "dense feed-forward")
    b.info["hidden"] = b.info["w_gate"].shape[0]


# --- MoE ----------------------------------------------------------------------------------
def extract_moe(om: OnnxModel, b: Branch, where: str) -> None:
    check_ops(b, MOE_OPS, "MoE", where)
    topk = [n for n in b.nodes if n.op_type == "TopK"]
    if len(topk) != 1:
        raise unsupported(topk[1], f"MoE of {where} has {len(topk)} TopK ops; expected one")
    topk = topk[0]
    k = om.const(topk.input[1]) if om.is_const(topk.input[1]) else None
    if k is None or om.attr(topk, "largest", 1) != 1 or om.attr(topk, "axis", -1) not in (-1, 1):
        raise unsupported(topk, f"MoE of {where}: expected TopK(largest=1, axis=-1) with a constant k")
    top_k = int(np.asarray(k).reshape(-1)[0])
    sm = om.producer.get(topk.input[0])
    while sm is not None and sm.op_type in ("Cast", "Identity"):
        sm = om.producer.get(sm.input[0])
    if sm is None or sm.op_type != "Softmax" or om.attr(sm, "axis", -1) not in (-1, 1):
        raise unsupported(topk, f"MoE of {where}: expected TopK over softmax(router logits) (softmax -> top-k)")
    lins = linears(om, b)
    router = [l for l in lins if _reaches(om, b, l.output, sm.input[0])]
    if len(router) != 1 or router[0].bias is not None:
        raise unsupported(sm, f"MoE of {where}: expected one bias-free router projection feeding this Softmax")
    router = router[0]
    E = router.w.shape[0]
    vals = descendants(om, b, topk.output[0])
    normalize = any(n.op_type == "Div" and n.input[0] in vals and om.producer.get(n.input[1]) is not None
                    and om.producer[n.input[1]].op_type == "ReduceSum" and om.producer[n.input[1]].input[0] in vals
                    for n in b.nodes)
    experts = _expert_weights(om, b, E, where)
    shared = [l for l in lins if l is not router]
    info = dict(router=router.w, n_experts=E, top_k=top_k, normalize=normalize, router_name=router.weight, **experts)
    if shared:
        gate = [l for l in shared if l.w.shape[0] == 1]
        rest = [l for l in shared if l.w.shape[0] != 1]
        if len(rest) != 3 or len(gate) > 1:
            raise unsupported(shared[0].node, f"MoE of {where}: the projections besides the router should form "
                                              "one SwiGLU shared expert (and optionally its [1, d] sigmoid gate)")
        sw = _swiglu_roles(om, b, rest, where, "shared expert")
        info.update(shared_w_gate=sw["w_gate"], shared_w_up=sw["w_up"], shared_w_down=sw["w_down"],
                    shared_hidden=sw["w_gate"].shape[0], shared_names=sw["names"])
        if gate:
            if not any(_reaches(om, b, gate[0].output, s) for s in _sigmoid_inputs(b)):
                raise unsupported(gate[0].node, f"MoE of {where}: the shared expert's gate must pass through a Sigmoid")
            info.update(shared_gate=gate[0].w, shared_gate_name=gate[0].weight)
    if not 1 <= top_k <= E:
        raise unsupported(topk, f"MoE of {where}: k={top_k} out of range 1..{E}")
    b.info = info


def _expert_weights(om: OnnxModel, b: Branch, E: int, where: str) -> dict:
    """3-D expert tensors -> per-expert [out, in] gate/up/down, from how the MatMuls use them."""
    members = set(b.nodes)
    uses = []  # (const name, matmul node, weight operand position)
    for n in b.nodes:
        for v in n.input:
            if om.is_const(v) and len(om.const_shape(v) or ()) == 3:
                mm, cur = n, n
                while mm is not None and mm.op_type != "MatMul":
                    if mm.op_type not in ("Gather", "GatherND", "Cast", "Identity", "Reshape"):
                        raise unsupported(mm, f"MoE of {where}: expert weights {v!r} reach a {mm.op_type}; "
                                              "expected Gather/GatherND then MatMul")
                    cur = mm
                    nxt = [u for u in om.users(mm.output[0]) if u in members]
                    mm = nxt[0] if len(nxt) == 1 else None
                if mm is None:
                    raise unsupported(n, f"MoE of {where}: expert weights {v!r} do not reach a MatMul")
                src = cur.output[0] if cur is not n or n.op_type != "MatMul" else v
                uses.append((v, mm, list(mm.input).index(src)))
    if not uses:
        raise unsupported(b.first, f"MoE of {where}: no 3-D expert weight tensors found")
    sig = _sigmoid_inputs(b)
    prods = set()
    for s in sig:
        prods |= descendants(om, b, s)
    ins, downs = [], []
    for v, mm, pos in uses:
        other = mm.input[1 - pos]
        w = np.asarray(om.const(v), dtype=np.float32)
        if w.shape[0] != E:
            raise unsupported(mm, f"MoE of {where}: expert tensor {v!r} has {w.shape[0]} experts, the router {E}")
        mats = w if pos == 0 else w.transpose(0, 2, 1)  # per expert [out, in]
        (downs if other in prods else ins).append((v, mm, mats))
    if len(downs) != 1 or len(ins) not in (1, 2):
        raise unsupported(uses[0][1], f"MoE of {where}: expected expert gate/up projections and one down projection")
    dname, dmm, down = downs[0]
    I = down.shape[2]
    if len(ins) == 1:
        name, mm, gu = ins[0]
        if gu.shape[1] != 2 * I:
            raise unsupported(mm, f"MoE of {where}: fused expert projection {gu.shape[1:]} is not [2 x {I}, d]")
        gate_first = _gate_half_first(om, b, mm, sig, where)
        g, u = (gu[:, :I], gu[:, I:]) if gate_first else (gu[:, I:], gu[:, :I])
        names = (name, name, dname)
    else:
        gate = [x for x in ins if any(_reaches(om, b, x[1].output[0], s) for s in sig)]
        if len(gate) != 1:
            raise unsupported(ins[0][1], f"MoE of {where}: cannot tell the expert gate projection from the up one")
        up = [x for x in ins if x is not gate[0]][0]
        g, u, names = gate[0][2], up[2], (gate[0][0], up[0], dname)
    if g.shape != u.shape or g.shape[1] != down.shape[2] or g.shape[2] != down.shape[1]:
        raise unsupported(dmm,
                          f"MoE of {where}: expert shapes gate {g.shape}, up {u.shape}, down {down.shape} disagree")
    return dict(e_gate=g, e_up=u, e_down=down, expert_dim=I, expert_names=names)


def _gate_half_first(om: OnnxModel, b: Branch, mm, sig: list[str], where: str) -> bool:
    """Which half of a fused [gate; up] projection output feeds the Sigmoid."""
    desc = descendants(om, b, mm.output[0])
    for n in b.nodes:
        if n.op_type == "Split" and n.input[0] in desc and len(n.output) == 2:
            first = [any(_reaches(om, b, o, s) for s in sig) for o in n.output]
            if first == [True, False]:
                return True
            if first == [False, True]:
                return False
        if n.op_type == "Slice" and n.input[0] in desc and any(_reaches(om, b, n.output[0], s) for s in sig):
            start = om.const(n.input[1]) if om.is_const(n.input[1]) else None
            if start is not None:
                return int(np.asarray(start).reshape(-1)[0]) == 0
    raise unsupported(mm, f"MoE of {where}: cannot find how the fused gate/up output is split")


# --- head ---------------------------------------------------------------------------------
def extract_head(om: OnnxModel, b: Branch, where: str) -> None:
    check_ops(b, HEAD_OPS, "LM head", where)
    lins = linears(om, b)
    if len(lins) != 1 or lins[0].bias is not None:
        raise unsupported(lins[0].node if lins else b.first, "LM head: expected one bias-free [d, vocab] projection")
    b.info = dict(w=lins[0].w, name=lins[0].weight)


# --- numeric semantics (the check that the pattern computes what the IR op computes) --------
def reference(b: Branch, h: np.ndarray, eps: float | None = None) -> np.ndarray:
    """What the IR computes for branch `b` on normalised input h [T, d] (positions 0..T-1)."""
    i = b.info
    if b.kind == "attention":
        T, hd, H, KV = h.shape[0], i["head_dim"], i["n_heads"], i["n_kv_heads"]
        q, k, v = h @ i["wq"].T, h @ i["wk"].T, h @ i["wv"].T
        if i["bias"]:
            q, k, v = q + i["bq"], k + i["bk"], v + i["bv"]
        pos = np.arange(T)
        q = rope(q.reshape(T, H, hd).astype(np.float32), pos, i["rope_theta"])
        k = np.repeat(rope(k.reshape(T, KV, hd).astype(np.float32), pos, i["rope_theta"]), H // KV, axis=1)
        v = np.repeat(v.reshape(T, KV, hd), H // KV, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.float32(np.sqrt(hd))
        s = np.where(np.tril(np.ones((T, T), bool))[None], s, -np.inf)
        return np.einsum("hts,shd->thd", softmax(s), v).reshape(T, H * hd) @ i["wo"].T
    if b.kind == "dense":
        return (silu(h @ i["w_gate"].T) * (h @ i["w_up"].T)) @ i["w_down"].T
    if b.kind == "moe":
        p = softmax(h @ i["router"].T)
        idx = np.argsort(-p, axis=-1, kind="stable")[:, : i["top_k"]]
        w = np.take_along_axis(p, idx, -1)
        if i["normalize"]:
            w = w / w.sum(-1, keepdims=True)
        out = np.zeros_like(h)
        for t in range(h.shape[0]):
            for j, e in enumerate(idx[t]):
                y = (silu(h[t] @ i["e_gate"][e].T) * (h[t] @ i["e_up"][e].T)) @ i["e_down"][e].T
                out[t] += w[t, j] * y
        if "shared_w_gate" in i:
            s = (silu(h @ i["shared_w_gate"].T) * (h @ i["shared_w_up"].T)) @ i["shared_w_down"].T
            if "shared_gate" in i:
                s = s / (1.0 + np.exp(-(h @ i["shared_gate"].T)))
            out += s
        return out
    return h @ i["w"].T


def describe(b: Branch) -> str:
    return f"{b.kind} block ending at {label(b.nodes[-1])}"

