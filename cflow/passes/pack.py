"""The packing plan: which tensors a compiled file holds and how each is built from IR weights.

Forms (layout/packed.py): TILED, CONCAT (QKV), GATE_UP, ROWS (embedding, router, shared gate), VECTOR
(norms, biases). A quantised embedding (a GGUF's, kept as stored) is TILED, and a tied head streams that same
tensor. A CONCAT's parts may differ in type (a GGUF's Q4_K q/k beside a Q6_K v: part_dtypes). Tensors are per
weight block, so arch5's shared blocks are stored once; `block` is the file's layer field.
"""

from __future__ import annotations

from ..errors import UnsupportedModelError
from ..ir import Attention, DenseFFN, Embedding, ExpertBank, Graph, LMHead, Node, RMSNorm, Router
from ..layout import tile as T
from ..layout.packed import Form, PackedTensor
from ..layout.quant import DType
from .manager import state_pass


def qkv_tensor(attn_prefix: str) -> str:
    """The fused QKV stream of an attention op."""
    return f"{attn_prefix}.wqkv"


def expert_tensor(bank_prefix: str, e: int, which: str) -> str:
    """Expert e's stream of a bank: which = 'w_gate_up' | 'w_down'."""
    return f"{bank_prefix}.experts.{e}.{which}"


def shared_tensor(bank_prefix: str, which: str) -> str:
    """The shared expert's stream: which = 'w_gate_up' | 'w_down'."""
    return f"{bank_prefix}.shared.{which}"


def post_norm_tensor(op: Node) -> str:
    """The post norm weight of an attention or dense FFN op with post_norm (read by the residual add)."""
    return f"{op.prefix}.post_norm"


def _block(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("blocks.") else -1


def node_tensors(g: Graph, n: Node, tile=T.DEFAULT_TILE) -> list[PackedTensor]:
    """The packed tensors op `n` reads, in the order its kernels stream them."""
    shapes, dts = g.meta.shapes, g.meta.weight_dtypes

    def dt(name):
        return dts.get(name, DType.F32)

    def mk(name, form, parts, expert=-1):
        kinds = tuple(dt(p) for p in parts)
        if form == Form.GATE_UP and kinds[0] != kinds[1]:
            raise UnsupportedModelError(f"{parts[0]} is {kinds[0].gguf_name} and {parts[1]} {kinds[1].gguf_name}: the "
                                        "fused gate+up kernel reads one type (compile with --quant q8 to requantise)")
        return PackedTensor(name=name, form=form, parts=tuple(parts), dtype=kinds[0],
                            part_shapes=tuple(tuple(shapes[p]) for p in parts), tile=tuple(tile),
                            block=_block(parts[0]), expert=expert,
                            part_dtypes=kinds if len(set(kinds)) > 1 else None)

    if isinstance(n, Embedding):  # a quantised embedding is a tile stream (kept as stored: a GGUF's own type)
        return [mk("tok_embeddings", Form.TILED if dt(n.weight).quantised else Form.ROWS, [n.weight])]
    if isinstance(n, RMSNorm):
        return [mk(n.weight, Form.VECTOR, [n.weight])]
    if isinstance(n, Attention):
        p = n.prefix
        out = [mk(qkv_tensor(p), Form.CONCAT, [f"{p}.wq", f"{p}.wk", f"{p}.wv"])]
        if n.bias:
            out += [mk(f"{p}.{b}", Form.VECTOR, [f"{p}.{b}"]) for b in ("bq", "bk", "bv")]
        if n.qk_norm:
            out += [mk(f"{p}.{w}", Form.VECTOR, [f"{p}.{w}"]) for w in ("q_norm", "k_norm")]
        out.append(mk(f"{p}.wo", Form.TILED, [f"{p}.wo"]))
        return out + ([mk(post_norm_tensor(n), Form.VECTOR, [post_norm_tensor(n)])] if n.post_norm else [])
    if isinstance(n, DenseFFN):
        p = n.prefix
        return [mk(f"{p}.w_gate_up", Form.GATE_UP, [f"{p}.w_gate", f"{p}.w_up"]),
                mk(f"{p}.w_down", Form.TILED, [f"{p}.w_down"])] + (
            [mk(post_norm_tensor(n), Form.VECTOR, [post_norm_tensor(n)])] if n.post_norm else [])
    if isinstance(n, Router):
        return [mk(n.weight, Form.ROWS, [n.weight])]
    if isinstance(n, ExpertBank):
        out = []
        for e in range(n.n_experts):
            p = f"{n.prefix}.experts.{e}"
            out += [mk(expert_tensor(n.prefix, e, "w_gate_up"), Form.GATE_UP, [f"{p}.w_gate", f"{p}.w_up"], e),
                    mk(expert_tensor(n.prefix, e, "w_down"), Form.TILED, [f"{p}.w_down"], e)]
        if n.shared_hidden:
            p = f"{n.prefix}.shared"
            out += [mk(shared_tensor(n.prefix, "w_gate_up"), Form.GATE_UP, [f"{p}.w_gate", f"{p}.w_up"]),
                    mk(shared_tensor(n.prefix, "w_down"), Form.TILED, [f"{p}.w_down"])]
            if n.shared_gate:
                out.append(mk(f"{n.prefix}.shared_gate", Form.ROWS, [f"{n.prefix}.shared_gate"]))
        return out
    if isinstance(n, LMHead):  # its own stream, or the embedding's when that is a tile stream it shares
        return [mk("lm_head" if n.weight == "lm_head" else n.weight, Form.TILED, [n.weight])]
    return []


def plan(g: Graph, tile=T.DEFAULT_TILE) -> dict[str, PackedTensor]:
    """Every packed tensor of the graph, once each, in first-use order of the canonical node order."""
    out: dict[str, PackedTensor] = {}
    for n in g.nodes():
        for t in node_tensors(g, n, tile):
            out.setdefault(t.name, t)
    return out


@state_pass(name="plan_packing", requires=("quantize_weights",))
def plan_packing(state, ctx):
    """Decide every stored tensor: form, parts, dtype, tile (no weights touched)."""
    return state.evolve(tensors=plan(state.graph, state.tile))
