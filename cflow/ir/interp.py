"""The NumPy reference executor of the IR: float32, prefill and incremental decode.

`interpret(graph, ids)` -> logits [T, vocab]. `Interpreter(graph)` keeps the KV cache between
calls (`prefill`, `step`). On a quantised graph it uses the dequantised weights; with
act_quant="q8" it also quantises each activation entering a quantised mat-vec into int8 blocks the
way the kernels do, so it reproduces the runtime's arithmetic up to float summation order; act_quant="q8x2" the
same with the runtime's activations="q8x2" (two int8 planes where every reader of the activation is a 32-input
block type: quant.act_planes).
"""

from __future__ import annotations

import numpy as np

from ..errors import CflowError, VerifyError
from ..layout.blocks import BlockTensor, matvec_twin
from ..layout.quant import ACT_FORMATS, DType, QTensor, act_codes, act_planes, dequantize, round_bf16
from .graph import INPUT, OUTPUT, Graph
from .nodes import Add, Attention, DenseFFN, Embedding, ExpertBank, LMHead, Node, RMSNorm, Router
from .rope import inv_freq, tables


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (PyTorch's gelu(approximate='tanh'), Gemma's gelu_pytorch_tanh)."""
    x = x.astype(np.float32)
    c = np.float32(np.sqrt(2.0 / np.pi))
    return (np.float32(0.5) * x * (np.float32(1) + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))).astype(
        np.float32)


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    rms = np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(eps))
    return (x / rms * w).astype(np.float32)


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    return (np.float32(cap) * np.tanh(x / np.float32(cap))).astype(np.float32) if cap else x


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    z = np.exp(x - x.max(axis=axis, keepdims=True))  # subtract the max: never overflows
    return z / z.sum(axis=axis, keepdims=True)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities of float logits [..., vocab] (the largest subtracted first, as llama.cpp does)."""
    x = np.asarray(logits, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x: [T, heads, hd] in the rotate-half convention; cos/sin: [T, hd/2] (ir/rope.py tables)."""
    cos, sin = np.concatenate([cos, cos], -1)[:, None, :], np.concatenate([sin, sin], -1)[:, None, :]
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rot * sin).astype(np.float32)


def rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Default RoPE of x: [T, heads, hd] in the rotate-half convention (as reference.apply_rope)."""
    inv, f = inv_freq(x.shape[-1], theta)
    return apply_rope(x, *tables(inv, f, positions))


class Interpreter:
    """Runs the graph token block by token block; holds the KV cache of each attention node."""

    def __init__(self, graph: Graph, act_quant: str | None = None, max_seq_len: int | None = None,
                 cache_weights: bool = True, kv: str = "f32"):
        if act_quant is not None and act_quant not in ACT_FORMATS:
            raise ValueError(f"act_quant must be None or one of {', '.join(ACT_FORMATS)}, not {act_quant!r}")
        if kv not in ("f32", "f16", "bf16"):
            raise ValueError(f"kv must be 'f32', 'f16' or 'bf16', not {kv!r}")
        # 'f16': K and V rounded to half once when cached, as the runtime's kv='f16' does; 'bf16': to bfloat16,
        # and the query and the softmax weights too (codegen.attention.attention takes bf16 dot products)
        self.kv_dtype = kv
        if not graph.weights:
            raise CflowError(f"graph {graph.name} has no weights to interpret (built from shapes only)")
        self.g = graph
        self.act_quant = act_quant
        self.cache_weights = cache_weights  # False: re-derive float weights per use (models near RAM size)
        self.order: list[Node] = list(graph.nodes())
        self.max_seq_len = max_seq_len or graph.config.max_seq_len
        self._dense: dict[str, np.ndarray] = {}
        self._tables: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._codes: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._planes: dict[tuple, int] = {}  # (weight, its point) -> activation planes
        self.reset()

    def reset(self) -> None:
        self.pos = 0
        self.kv: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    # --- weights -------------------------------------------------------------------------
    def weight(self, name: str) -> np.ndarray:
        w = self._dense.get(name)
        if w is None:
            w = dequantize(self.g.weight(name))
            if self.cache_weights:
                self._dense[name] = w
        return w

    def matvec(self, x: np.ndarray, name: str, point: tuple[str, ...] = ()) -> np.ndarray:
        """x [T, in] @ W[out, in].T, emulating the kernels' quantised activation blocks if asked; `point`: every
        weight that reads the same quantised x in the runtime (a QKV stream's parts, gate and up, experts and the
        shared expert), whose types decide its planes (quant.act_planes)."""
        w = self.g.weight(name)
        if self.act_quant is not None and isinstance(w, (BlockTensor, QTensor)):
            planes = self._planes.get((name, point))
            if planes is None:
                ws = [self.g.weight(p) for p in point or (name,)]
                planes = self._planes[(name, point)] = act_planes(
                    self.act_quant, [v.dtype for v in ws if isinstance(v, (BlockTensor, QTensor))])
            if isinstance(w, BlockTensor):  # a GGUF block type: its twin (layout/blocks.py)
                cache = self._codes.setdefault(name, {}) if self.cache_weights else None
                return matvec_twin(w, x, cache, planes)
            return self._matvec_q8(x, name, w, planes)
        return (x @ self.weight(name).T).astype(np.float32)

    def _matvec_q8(self, x: np.ndarray, name: str, w: QTensor, planes: int = 1) -> np.ndarray:
        codes = self._codes.get(name)
        if codes is None:
            c = w.q.astype(np.float32) - (8.0 if w.dtype == DType.Q4 else 0.0)
            codes = (np.ascontiguousarray(c.transpose(1, 2, 0)), w.scales.astype(np.float32))
            if self.cache_weights:
                self._codes[name] = codes
        c, dw = codes  # c: [nblk, 32, rows]; dw: [rows, nblk]
        qa, da = act_codes(x, planes)  # qa: [T, nblk, 32]
        # Integer block dots, exact in float32 for int8 codes (|sum| <= 32 * 127 * 128 < 2^24), in float64 for the
        # two-plane codes (|sum| <= 32 * 128 * 32639)
        ft = np.float32 if planes == 1 else np.float64
        isum = np.matmul(qa.astype(ft).transpose(1, 0, 2), c.astype(ft, copy=False))  # [nblk, T, rows]
        return np.einsum("btr,rb,tb->tr", isum, dw, da, optimize=True).astype(np.float32)

    # --- execution -----------------------------------------------------------------------
    def run(self, ids) -> np.ndarray:
        """Feed T new tokens; returns logits [T, vocab] for them."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise CflowError("no tokens to run")
        if self.pos + ids.size > self.max_seq_len:
            raise CflowError(f"{self.pos + ids.size} tokens exceed the context of {self.max_seq_len}")
        vals: dict[str, object] = {INPUT: ids}
        for node in self.order:
            try:
                vals[node.name] = self._exec(node, vals)
            except (CflowError, VerifyError):
                raise
            except Exception as e:  # name the node, as torch.fx's Interpreter does
                raise CflowError(f"while executing %{node.name} ({node.kind}): {type(e).__name__}: {e}") from e
        self.pos += ids.size
        self.values = vals  # every node's value of the last call (e.g. which experts were routed)
        return vals[OUTPUT]

    prefill = run

    def step(self, token: int) -> np.ndarray:
        return self.run([token])[0]

    def _exec(self, n: Node, v: dict) -> np.ndarray:
        if isinstance(n, Embedding):
            ids = v[n.inputs[0]]
            if ids.min() < 0 or ids.max() >= n.vocab:
                raise CflowError(f"token id out of range 0..{n.vocab - 1} at %{n.name}")
            return self.weight(n.weight)[ids]
        if isinstance(n, RMSNorm):
            return rms_norm(v[n.inputs[0]], self.weight(n.weight), n.eps)
        if isinstance(n, Add):
            out = v[n.inputs[0]].copy()
            for i in n.inputs[1:]:
                out += v[i]
            return out
        if isinstance(n, Attention):
            return self._attention(n, v[n.inputs[0]])
        if isinstance(n, DenseFFN):
            out = self._swiglu(v[n.inputs[0]], n.prefix, n.act)
            return rms_norm(out, self.weight(f"{n.prefix}.post_norm"), n.eps) if n.post_norm else out
        if isinstance(n, Router):
            probs = softmax(self.matvec(v[n.inputs[0]], n.weight))
            idx = np.argsort(-probs, axis=-1, kind="stable")[:, : n.top_k]
            w = np.take_along_axis(probs, idx, axis=-1)
            if n.normalize:
                w = w / w.sum(-1, keepdims=True)
            return (w.astype(np.float32), idx)
        if isinstance(n, ExpertBank):
            return self._experts(n, v[n.inputs[0]], v[n.inputs[1]])
        if isinstance(n, LMHead):
            return softcap(self.matvec(v[n.inputs[0]], n.weight), n.softcap)
        raise CflowError(f"interpreter: unknown op {n.kind} at %{n.name}")

    def _swiglu(self, x: np.ndarray, prefix: str, act: str = "silu", point: tuple[str, ...] = ()) -> np.ndarray:
        point = point or (f"{prefix}.w_gate",)
        h = ACTIVATIONS[act](self.matvec(x, f"{prefix}.w_gate", point)) * self.matvec(x, f"{prefix}.w_up", point)
        return self.matvec(h.astype(np.float32), f"{prefix}.w_down")

    def _rope_tables(self, n: Attention) -> tuple[np.ndarray, np.ndarray]:
        """cos/sin of every position of the context for this node's RoPE (computed once per node kind)."""
        key = (n.head_dim, n.rope_theta, n.rope_scaling, n.rope_dim)
        t = self._tables.get(key)
        if t is None:
            inv, f = inv_freq(n.head_dim, n.rope_theta, n.rope_scaling, n.rope_dim or None, self.g.config.max_seq_len)
            t = self._tables[key] = tables(inv, f, np.arange(self.max_seq_len), (n.rope_dim or n.head_dim) // 2)
        return t

    def _attention(self, n: Attention, h: np.ndarray) -> np.ndarray:
        T, hd, H, KV = h.shape[0], n.head_dim, n.n_heads, n.n_kv_heads
        qkv = tuple(f"{n.prefix}.{w}" for w in ("wq", "wk", "wv"))
        q, k, vv = (self.matvec(h, w, qkv) for w in qkv)
        if n.bias:
            q, k, vv = (q + self.weight(f"{n.prefix}.bq"), k + self.weight(f"{n.prefix}.bk"),
                        vv + self.weight(f"{n.prefix}.bv"))
        if n.qk_norm == "proj":
            q = rms_norm(q, self.weight(f"{n.prefix}.q_norm"), n.eps)
            k = rms_norm(k, self.weight(f"{n.prefix}.k_norm"), n.eps)
        q, k = q.reshape(T, H, hd), k.reshape(T, KV, hd)
        if n.qk_norm == "head":
            q = rms_norm(q, self.weight(f"{n.prefix}.q_norm"), n.eps)
            k = rms_norm(k, self.weight(f"{n.prefix}.k_norm"), n.eps)
        cos, sin = self._rope_tables(n)
        q = apply_rope(q, cos[self.pos : self.pos + T], sin[self.pos : self.pos + T])
        k = apply_rope(k, cos[self.pos : self.pos + T], sin[self.pos : self.pos + T])
        vv = vv.reshape(T, KV, hd).astype(np.float32)
        if self.kv_dtype == "f16":
            k, vv = (a.astype(np.float32).astype(np.float16).astype(np.float32) for a in (k, vv))
        elif self.kv_dtype == "bf16":
            k, vv = round_bf16(k), round_bf16(vv)
        if n.name in self.kv:
            pk, pv = self.kv[n.name]
            k, vv = np.concatenate([pk, k]), np.concatenate([pv, vv])
        self.kv[n.name] = (k, vv)
        S, rep = k.shape[0], H // KV
        kk, vh = np.repeat(k, rep, axis=1), np.repeat(vv, rep, axis=1)  # [S, H, hd]
        bf = self.kv_dtype == "bf16"
        qd = round_bf16(q) if bf else q
        scores = softcap(np.einsum("thd,shd->hts", qd, kk) / np.float32(np.sqrt(hd)), n.softcap)
        qpos = (self.pos + np.arange(T))[:, None]
        causal = np.arange(S)[None, :] <= qpos
        if n.window:
            causal &= np.arange(S)[None, :] > qpos - n.window
        scores = np.where(causal[None], scores, -np.inf)
        if bf:  # the weights rounded to bf16 for the weighted sum, their unrounded sum the divisor
            z = np.exp(scores - scores.max(axis=-1, keepdims=True))
            out = np.einsum("hts,shd->thd", round_bf16(z.astype(np.float32)), vh) / z.sum(-1).T[..., None]
            out = out.reshape(T, H * hd).astype(np.float32)
        else:
            out = np.einsum("hts,shd->thd", softmax(scores), vh).reshape(T, H * hd).astype(np.float32)
        out = self.matvec(out, f"{n.prefix}.wo")
        return rms_norm(out, self.weight(f"{n.prefix}.post_norm"), n.eps) if n.post_norm else out

    def _experts(self, n: ExpertBank, x: np.ndarray, route) -> np.ndarray:
        w, idx = route
        out = np.zeros_like(x)
        # the experts' and the shared expert's gate+up read one quantised x in the runtime
        up = (f"{n.prefix}.experts.0.w_gate",) + ((f"{n.prefix}.shared.w_gate",) if n.shared_hidden else ())
        for e in np.unique(idx):
            tok, slot = np.nonzero(idx == e)
            out[tok] += w[tok, slot, None] * self._swiglu(x[tok], f"{n.prefix}.experts.{e}", n.act, up)
        if n.shared_hidden:
            s = self._swiglu(x, f"{n.prefix}.shared", n.act, up)
            if n.shared_gate:
                s = s * (1.0 / (1.0 + np.exp(-self.matvec(x, f"{n.prefix}.shared_gate"))))
            out += s
        return out.astype(np.float32)


def interpret(graph: Graph, ids, act_quant: str | None = None) -> np.ndarray:
    """float32 logits [T, vocab] for the whole sequence `ids`, from an empty cache."""
    return Interpreter(graph, act_quant=act_quant).run(ids)
