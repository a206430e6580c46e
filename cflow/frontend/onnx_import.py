"""ONNX frontend: a decoder graph (as torch.onnx.export writes it) -> IR Graph.

Steps: load (external data checked, never trusted) -> segment into embedding, RMSNorms, residual
adds and branches (onnx_patterns) -> classify branches and extract weights (onnx_blocks) -> read
the layer structure off the residual chain: which stream version a dense FFN normalises (dense
delay), at which layer each expert output is added (expert delay), whether the router sees the
stream before or after the dense FFN (routing), which layers share initializers (arch5) ->
ModelConfig + weights -> build_graph -> check that build_graph's chain is the one we read ->
check every block numerically against the IR op on random input, and the causal mask and RoPE
tables at the full context -> verify.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import CflowError, UnsupportedModelError
from ..ir import Graph, build_graph, verify
from ..ir.config import ModelConfig
from .onnx_blocks import aux_inputs, classify, describe, reference, snap_float
from .onnx_graph import OnnxModel, load_model_proto
from .onnx_patterns import Decoder, segment, unsupported

DEFAULT_CONTEXT = 2048  # max_seq_len of an ONNX file that does not say (our exports record theirs)
PROBE_T = 7  # tokens in the numeric block checks
PROBE_BYTES = 1 << 28  # HF's gathered experts copy k expert matrices per token: bound the probe's memory


def from_onnx(path_or_proto, name: str | None = None, max_seq_len: int | None = None, check: bool = True) -> Graph:
    """An ONNX decoder (input_ids [1, T] -> logits [1, T, V]) -> verified IR Graph with float32 weights.

    name: graph name (default: the file's cflow.name metadata, else its stem). max_seq_len: the
    context to compile for (default: cflow.max_seq_len metadata, else 2048); the attention mask is
    checked to be exactly causal up to it. check: run the numeric block checks (on by default).
    """
    proto, base, where = load_model_proto(path_or_proto)
    om = OnnxModel(proto, base, where)
    meta = {p.key: p.value for p in proto.metadata_props}
    dec = segment(om)
    layers = _assemble(om, dec)
    config, weights, structure = _config(om, dec, layers, meta, name, max_seq_len, where)
    g = build_graph(config, weights, name=config.name, trained_delays=config.delays)
    _check_structure(g, structure, where)
    if check:
        _check_blocks(om, dec, layers)
        _check_positions(om, [l["attn"] for l in layers], config.max_seq_len, config.head_dim, config.rope_theta)
    g.meta.tokenizer, g.meta.eos_token_ids = None, []  # ONNX files carry none (cflowc --tokenizer)
    g.meta.source = f"onnx:{Path(where).name}"
    return verify(g)


# --- layers from the residual chain -------------------------------------------------------
def _assemble(om: OnnxModel, dec: Decoder) -> list[dict]:
    """Walk the residual chain: each attention opens a layer; record what each branch reads and where it lands."""
    role = {dec.x0: ("x0", 0)}  # stream value -> (a|b|x|x0, layer): which version of the stream it is
    layers: list[dict] = []
    for add, s_in, br, s_out in dec.chain:
        l = len(layers)
        reads = dec.norms[br.norm_out].input
        opens = any(n.op_type == "Softmax" for n in br.nodes) and not any(n.op_type == "TopK" for n in br.nodes)
        classify(om, br, f"layer {l + 1 if opens else l}")
        if br.kind == "attention":
            if reads != s_in:
                raise unsupported(add, f"attention of layer {l + 1} normalises {reads!r}, "
                                       f"not the stream {s_in!r} it adds to")
            layers.append(dict(attn=br, dense=None, moe=None, injects=[], reads={}))
            role[s_out] = ("a", l + 1)
            continue
        if not layers:
            raise unsupported(add, f"{br.kind} block before the first attention; expected attention first")
        cur = layers[-1]
        if reads not in role:
            raise unsupported(add, f"{describe(br)} normalises {reads!r}, which is not a residual stream version")
        if br.kind == "dense":
            if cur["dense"] is not None or cur["injects"]:
                raise unsupported(add, f"second dense FFN (or dense after an expert add) in layer {l}")
            cur["dense"], cur["reads"]["dense"] = br, role[reads]
            role[s_out] = ("b", l)
        elif br.kind == "moe":
            src_kind, j = role[reads]
            if src_kind not in ("a", "b") or layers[j - 1]["moe"] is not None:
                raise unsupported(add, f"MoE normalises {reads!r} ({src_kind}{j}); expected a layer's a_l or b_l "
                                       "(one MoE per layer)")
            layers[j - 1]["moe"], layers[j - 1]["reads"]["moe"] = br, (src_kind, j)
            cur["injects"].append(j)
            role[s_out] = ("x", l)
        else:
            raise unsupported(add, f"unexpected {br.kind} block on the residual chain")
    if not layers:
        raise UnsupportedModelError(f"{om.where}: no attention block found")
    classify(om, dec.head, "after the last layer")
    return layers


def _same(values, what: str, node) -> object:
    vals = {v if not isinstance(v, float) else round(v, 12) for v in values}
    if len(vals) > 1:
        raise unsupported(node, f"{what} differs between layers ({sorted(map(str, vals))}); the IR has one per model")
    return next(iter(values))


def _config(om: OnnxModel, dec: Decoder, layers: list[dict], meta: dict, name, max_seq_len, where):
    L = len(layers)
    attn = [l["attn"].info for l in layers]
    first = layers[0]["attn"].first
    hd = _same([a["head_dim"] for a in attn], "head_dim", first)
    H = _same([a["n_heads"] for a in attn], "n_heads", first)
    KV = _same([a["n_kv_heads"] for a in attn], "n_kv_heads", first)
    theta = _same([a["rope_theta"] for a in attn], "rope_theta", first)
    bias = _same([a["bias"] for a in attn], "attention bias", first)
    eps = snap_float(_same([n.eps for n in dec.norms.values()], "RMSNorm epsilon", first))
    dense = [i + 1 for i, l in enumerate(layers) if l["dense"] is not None]
    moe = [i + 1 for i, l in enumerate(layers) if l["moe"] is not None]
    kw: dict = {}
    if dense:
        kw["ffn_dim"] = _same([layers[i - 1]["dense"].info["hidden"] for i in dense], "dense FFN width", first)
        kw["dense_layers"] = None if len(dense) == L else dense
        reads = {i: layers[i - 1]["reads"]["dense"] for i in dense}
        bad = [i for i, r in reads.items() if r[0] not in ("a", "x0")]
        if bad:
            raise unsupported(layers[bad[0] - 1]["dense"].first, f"dense FFN of layer {bad[0]} normalises a stream "
                                                                 "version other than a post-attention stream a_j")
        # Dense delay: layer l reads a_{l-dd} (x0 when l - dd < 1); _check_structure checks every layer.
        from_a = [i - r[1] for i, r in reads.items() if r[0] == "a"]
        dd = max(from_a) if from_a else max(dense)
    else:
        dd = 0
    de, routing = 0, "post"
    if moe:
        m = [layers[i - 1]["moe"].info for i in moe]
        kw.update(n_experts=_same([x["n_experts"] for x in m], "n_experts", first),
                  top_k=_same([x["top_k"] for x in m], "top_k", first),
                  expert_dim=_same([x["expert_dim"] for x in m], "expert width", first),
                  norm_topk=_same([x["normalize"] for x in m], "top-k renormalisation", first),
                  shared_expert_dim=_same([x.get("shared_hidden", 0) for x in m], "shared expert width", first),
                  shared_expert_gate=_same(["shared_gate" in x for x in m], "shared expert gate", first))
        kw["moe_layers"] = None if len(moe) == L else moe
        # Expert delay: the largest (add layer - source layer); smaller gaps are the final flush.
        de = max(l_add - j for l_add, lay in enumerate(layers, 1) for j in lay["injects"])
        pre = {j for j in moe if layers[j - 1]["dense"] is not None and layers[j - 1]["reads"]["moe"][0] == "a"}
        post = {j for j in moe if layers[j - 1]["dense"] is not None and layers[j - 1]["reads"]["moe"][0] == "b"}
        if pre and post:
            raise unsupported(layers[min(pre) - 1]["moe"].first, "routing point (before/after the dense FFN) differs "
                                                                 "between layers")
        routing = "pre" if pre else "post"
    head = dec.head.info["w"]
    emb = np.asarray(om.const(dec.emb_weight), dtype=np.float32)
    tie = head.shape == emb.shape and np.array_equal(head, emb)
    n_blocks = _sharing(om, layers, dec, L) if not (kw.get("dense_layers") or kw.get("moe_layers")) else L
    ctx = int(max_seq_len or int(meta.get("cflow.max_seq_len", 0) or 0) or DEFAULT_CONTEXT)
    name = name or meta.get("cflow.name") or (Path(where).stem if where != "<ModelProto>" else "onnx")
    try:
        config = ModelConfig(name=name, vocab_size=dec.vocab, d_model=dec.d, n_layers=L, n_heads=H, n_kv_heads=KV,
                             head_dim=hd, rope_theta=theta, norm_eps=eps, max_seq_len=ctx, dense_delay=dd,
                             expert_delay=de, routing=routing, n_blocks=n_blocks, tie_embeddings=tie,
                             attn_bias=bias, **kw)
    except CflowError as e:
        raise UnsupportedModelError(f"{where}: the recognised structure is not a valid model: {e}") from None
    return config, _weights(config, om, dec, layers, emb, head), layers


_SHARED_KEYS = {"attention": ("wq", "wk", "wv", "wo", "bq", "bk", "bv"), "dense": ("w_gate", "w_up", "w_down"),
                "moe": ("router", "e_gate", "e_up", "e_down", "shared_w_gate", "shared_w_up", "shared_w_down",
                        "shared_gate")}


def _sharing(om: OnnxModel, layers: list[dict], dec: Decoder, L: int) -> int:
    """Smallest period p (dividing L) such that layer l's weights are layer (l - p)'s (arch5).

    The exporter keeps one initializer per shared 3-D or multiply-used weight but folds a transposed
    copy per use of a 2-D one, so shared weights are recognised by identical values (same initializer
    or bit-identical data); sharing identical weights cannot change the function."""
    def arrays(lay):
        for kind in ("attn", "dense", "moe"):
            b = lay[kind]
            if b is None:
                yield kind, None
                continue
            yield f"{kind}.norm", dec.norms[b.norm_out].weight
            for k in _SHARED_KEYS[b.kind]:
                if k in b.info:
                    yield f"{kind}.{k}", b.info[k]

    def same(x, y) -> bool:
        if x is None or y is None:
            return x is y
        if isinstance(x, str) and x == y:
            return True
        a, b = (om.const(v) if isinstance(v, str) else v for v in (x, y))
        return a.shape == b.shape and np.array_equal(a, b)

    per_layer = [list(arrays(l)) for l in layers]
    for p in range(1, L):
        if L % p == 0 and all(len(per_layer[i]) == len(per_layer[i - p]) and
                              all(k1 == k2 and same(v1, v2)
                                  for (k1, v1), (k2, v2) in zip(per_layer[i], per_layer[i - p]))
                              for i in range(p, L)):
            return p
    return L


def _weights(c: ModelConfig, om: OnnxModel, dec: Decoder, layers: list[dict], emb: np.ndarray,
             head: np.ndarray) -> dict:
    f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)  # noqa: E731
    norm_w = lambda br: f32(om.const(dec.norms[br.norm_out].weight))  # noqa: E731
    w = {"tok_embeddings": f32(emb), "norm": norm_w(dec.head)}
    if not c.tie_embeddings:
        w["lm_head"] = f32(head)
    for i in range(c.n_blocks):
        lay, p = layers[i], f"blocks.{i}"
        a = lay["attn"].info
        w[f"{p}.attn_norm"] = norm_w(lay["attn"])
        for n in ("wq", "wk", "wv", "wo"):
            w[f"{p}.attn.{n}"] = f32(a[n])
        if c.attn_bias:
            for n in ("bq", "bk", "bv"):
                w[f"{p}.attn.{n}"] = f32(a[n])
        if lay["dense"] is not None:
            w[f"{p}.ffn_norm"] = norm_w(lay["dense"])
            for n in ("w_gate", "w_up", "w_down"):
                w[f"{p}.ffn.{n}"] = f32(lay["dense"].info[n])
        if lay["moe"] is not None:
            m = lay["moe"].info
            w[f"{p}.moe_norm"] = norm_w(lay["moe"])
            w[f"{p}.moe.router"] = f32(m["router"])
            for e in range(c.n_experts):
                w[f"{p}.moe.experts.{e}.w_gate"] = f32(m["e_gate"][e])
                w[f"{p}.moe.experts.{e}.w_up"] = f32(m["e_up"][e])
                w[f"{p}.moe.experts.{e}.w_down"] = f32(m["e_down"][e])
            if c.shared_expert_dim:
                for n in ("w_gate", "w_up", "w_down"):
                    w[f"{p}.moe.shared.{n}"] = f32(m[f"shared_{n}"])
                if c.shared_expert_gate:
                    w[f"{p}.moe.shared_gate"] = f32(m["shared_gate"])
    return w


# --- checks -------------------------------------------------------------------------------
def _check_structure(g: Graph, layers: list[dict], where: str) -> None:
    """The chain build_graph made from our config must be the chain we read (delays, routing, flush)."""
    c = g.config
    for l, lay in enumerate(layers, 1):
        if lay["dense"] is not None:
            kind, j = lay["reads"]["dense"]
            got, want = "x0" if kind == "x0" else f"a.{j}", g[f"ffn_norm.{l}"].inputs[0]
            if got != want:
                raise unsupported(lay["dense"].first, f"dense FFN of layer {l} reads %{got}; with one dense delay "
                                                      f"dd={c.dense_delay} for the model it would read %{want}")
        if lay["moe"] is not None:
            kind, j = lay["reads"]["moe"]
            got, want = f"{kind}.{j}", g[f"moe_norm.{l}"].inputs[0]
            if got != want:
                raise unsupported(lay["moe"].first, f"MoE of layer {l} reads %{got}; with routing={c.routing} "
                                                    f"it would read %{want}")
    de = c.expert_delay
    for l, lay in enumerate(layers, 1):
        inj = list(lay["injects"])
        want = [l - de] if g.get(f"x.{l}") is not None else []
        flush = [int(i.split(".")[1]) for i in g["flush"].inputs[1:]] if l == len(layers) and g.get("flush") else []
        if inj[: len(want)] != want or sorted(inj[len(want):]) != sorted(flush):
            raise UnsupportedModelError(f"{where}: layer {l} adds expert outputs of layers {inj}; "
                                        f"with one expert delay de={de} it would add {want + flush}")


def _probe_tokens(b) -> int:
    if b.kind != "moe":
        return PROBE_T
    i = b.info
    per_token = i["top_k"] * 4 * 3 * i["e_gate"].shape[1] * i["e_gate"].shape[2]
    return int(max(1, min(PROBE_T, PROBE_BYTES // per_token)))


def _check_blocks(om: OnnxModel, dec: Decoder, layers: list[dict]) -> None:
    """Each block, run by onnx.reference on random input, must equal the IR op with the extracted weights."""
    rng = np.random.default_rng(0)
    blocks = [(l, b) for l, lay in enumerate(layers, 1)
              for b in (lay["attn"], lay["dense"], lay["moe"]) if b is not None]
    blocks.append((len(layers) + 1, dec.head))
    for l, b in blocks:
        T = _probe_tokens(b)
        h = rng.standard_normal((T, dec.d)).astype(np.float32)
        try:
            got, = om.evaluate([b.output], {b.norm_out: h[None], om.inputs[0].name: np.zeros((1, T), np.int64)})
        except CflowError:
            raise
        except Exception as e:
            first_line = str(e).splitlines()[0] if str(e) else ""
            raise unsupported(b.nodes[-1], f"cannot evaluate the {b.kind} block of layer {l} "
                                           f"({type(e).__name__}: {first_line})") from None
        got = np.asarray(got, dtype=np.float32).reshape(T, -1)
        ref = reference(b, h.astype(np.float64)).astype(np.float32)
        err = float(np.abs(got - ref).max()) if got.shape == ref.shape else float("inf")
        if not np.isfinite(err) or err > 1e-6 + 2e-3 * float(np.abs(ref).max()):
            raise unsupported(b.nodes[-1], f"the {b.kind} block of layer {l} does not compute what its pattern says "
                                           f"(max |difference| {err:.3g} on random input); "
                                           f"expected {_EXPECT[b.kind]}")


_EXPECT = {
    "attention": "causal RoPE (rotate-half) grouped-query softmax attention with 1/sqrt(head_dim) scaling",
    "dense": "SwiGLU down(silu(gate x) * up x)",
    "moe": "softmax -> top-k (-> renormalise) -> weighted SwiGLU experts (+ shared expert)",
    "head": "logits = x @ W",
}


def _check_positions(om: OnnxModel, attns: list, T: int, hd: int, theta: float) -> None:
    """At the full context, every [T, T] value an attention reads must be the causal mask and every
    [T, head_dim] value a RoPE table: sliding windows and position-dependent RoPE scaling are rejected."""
    done = set()
    pos = np.arange(T, dtype=np.float32)[:, None]
    inv = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    ang = np.concatenate([pos * inv, pos * inv], axis=-1)
    tables = (np.cos(ang), np.sin(ang))
    causal = np.tril(np.ones((T, T), dtype=bool))
    for b in attns:
        aux = tuple(aux_inputs(om, b))
        if aux in done:
            continue
        done.add(aux)
        feeds = {b.norm_out: np.zeros((1, T, _width(b)), np.float32), om.inputs[0].name: np.zeros((1, T), np.int64)}
        try:
            vals = om.evaluate(list(aux), feeds)
        except Exception as e:
            raise unsupported(b.first, f"cannot evaluate the attention's mask/RoPE inputs at T={T} "
                                       f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        for name, v in zip(aux, vals):
            v = np.asarray(v)
            members = set(b.nodes)
            user = next(u for u in om.users(name) if u in members)
            if v.ndim >= 2 and v.shape[-2:] == (T, T) and T > 1:
                m = v.reshape(-1, T, T)
                ok = all((x == causal).all() or (x == ~causal).all() for x in m) if m.dtype == bool else \
                    all(((x == 0) == causal).all() and (x[~causal] <= -1e4).all() for x in m)
                if not ok:
                    raise unsupported(user, f"the attention mask {name!r} is not causal at T={T} "
                                            "(a sliding window or another mask is not modelled)")
            elif v.ndim >= 2 and v.shape[-2:] == (T, hd) and v.dtype.kind == "f":
                m = v.reshape(-1, T, hd)
                if not all(any(np.allclose(x, t, atol=1e-3 + 2e-7 * T) for t in tables) for x in m):
                    raise unsupported(user, f"the RoPE table {name!r} differs from default RoPE (theta={theta:g}) "
                                            f"at T={T} (rope scaling is not modelled)")


def _width(b) -> int:
    return int(b.info["wq"].shape[1])

