"""Build the IR of a pipeline-native model from its ModelConfig (and weights, if any).

Frontends call `build_graph` once they have a config and named weights; a graph without weights
(`weights=None`) still knows every weight's shape, which is all the critical-path analysis needs.
IR weight names: tok_embeddings, blocks.{i}.attn.wq ..., blocks.{i}.moe.experts.{e}.w_gate, norm, lm_head.
"""

from __future__ import annotations

from . import names as N
from .config import ModelConfig
from .graph import INPUT, OUTPUT, Graph
from .meta import GraphMeta
from .nodes import Add, Attention, DenseFFN, Embedding, ExpertBank, LMHead, RMSNorm, Router
from .rope import layer_rope


def weight_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every IR weight name -> shape ([out, in] for matrices, [d] for norms and biases)."""
    d, hd = c.d_model, c.head_dim
    s: dict[str, tuple[int, ...]] = {"tok_embeddings": (c.vocab_size, d), "norm": (d,)}
    if not c.tie_embeddings:
        s["lm_head"] = (c.vocab_size, d)
    for i in range(c.n_blocks):
        p = f"blocks.{i}"
        s[f"{p}.attn_norm"] = (d,)
        s[f"{p}.attn.wq"] = (c.n_heads * hd, d)
        s[f"{p}.attn.wk"] = (c.n_kv_heads * hd, d)
        s[f"{p}.attn.wv"] = (c.n_kv_heads * hd, d)
        s[f"{p}.attn.wo"] = (d, c.n_heads * hd)
        if c.attn_bias:
            s[f"{p}.attn.bq"] = (c.n_heads * hd,)
            s[f"{p}.attn.bk"] = (c.n_kv_heads * hd,)
            s[f"{p}.attn.bv"] = (c.n_kv_heads * hd,)
        if c.qk_norm:
            s[f"{p}.attn.q_norm"] = (hd,) if c.qk_norm == "head" else (c.n_heads * hd,)
            s[f"{p}.attn.k_norm"] = (hd,) if c.qk_norm == "head" else (c.n_kv_heads * hd,)
        if c.post_norms:
            s[f"{p}.attn.post_norm"] = (d,)
        if c.has_dense(i + 1) or any(c.has_dense(l) for l in range(i + 1, c.n_layers + 1, c.n_blocks)):
            s[f"{p}.ffn_norm"] = (d,)
            s[f"{p}.ffn.w_gate"] = (c.ffn_dim, d)
            s[f"{p}.ffn.w_up"] = (c.ffn_dim, d)
            s[f"{p}.ffn.w_down"] = (d, c.ffn_dim)
            if c.post_norms:
                s[f"{p}.ffn.post_norm"] = (d,)
        if c.has_moe(i + 1) or any(c.has_moe(l) for l in range(i + 1, c.n_layers + 1, c.n_blocks)):
            s[f"{p}.moe_norm"] = (d,)
            s[f"{p}.moe.router"] = (c.n_experts, d)
            for e in range(c.n_experts):
                s[f"{p}.moe.experts.{e}.w_gate"] = (c.expert_dim, d)
                s[f"{p}.moe.experts.{e}.w_up"] = (c.expert_dim, d)
                s[f"{p}.moe.experts.{e}.w_down"] = (d, c.expert_dim)
            if c.shared_expert_dim:
                s[f"{p}.moe.shared.w_gate"] = (c.shared_expert_dim, d)
                s[f"{p}.moe.shared.w_up"] = (c.shared_expert_dim, d)
                s[f"{p}.moe.shared.w_down"] = (d, c.shared_expert_dim)
                if c.shared_expert_gate:
                    s[f"{p}.moe.shared_gate"] = (1, d)
    return s


def build_graph(
    c: ModelConfig,
    weights: dict | None = None,
    name: str | None = None,
    trained_delays: tuple[int, int] | None = None,
) -> Graph:
    """The layer DAG of docs/DESIGN.md's equations for config `c` (its delays and routing point).

    trained_delays: the delays the weights were trained with (default: the config's own).
    """
    dd, de = c.dense_delay, c.expert_delay
    meta = GraphMeta(config=c, trained_delays=tuple(trained_delays or (dd, de)), trained_routing=c.routing,
                     shapes=weight_shapes(c))
    g = Graph(name or c.name, meta, weights)
    d, L = c.d_model, c.n_layers
    g.add(Embedding(name=N.EMBED, inputs=(INPUT,), weight="tok_embeddings", vocab=c.vocab_size, dim=d))
    stream = N.EMBED  # the residual stream x_{l-1} entering the next layer
    experts: dict[int, str] = {}  # e_l by layer
    for l in range(1, L + 1):  # noqa: E741 (layer index, as in docs/DESIGN.md's equations)
        p = f"blocks.{c.block_of(l)}"
        g.add(RMSNorm(name=N.attn_norm(l), inputs=(stream,), layer=l, weight=f"{p}.attn_norm", dim=d,
                      eps=c.norm_eps))
        theta, scaling = layer_rope(c, l)
        g.add(Attention(name=N.attn(l), inputs=(N.attn_norm(l),), layer=l, prefix=f"{p}.attn", dim=d,
                        n_heads=c.n_heads, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                        rope_theta=theta, bias=c.attn_bias, rope_scaling=scaling,
                        rope_dim=c.rope_dim if c.rope_dim != c.head_dim else 0, qk_norm=c.qk_norm,
                        softcap=float(c.attn_softcap), window=c.window(l), post_norm=c.post_norms,
                        eps=float(c.norm_eps)))
        g.add(Add(name=N.a(l), inputs=(stream, N.attn(l)), layer=l, dim=d))
        b = N.a(l)
        if c.has_dense(l):
            g.add(RMSNorm(name=N.ffn_norm(l), inputs=(N.a(l - dd),), layer=l, weight=f"{p}.ffn_norm", dim=d,
                          eps=c.norm_eps))
            g.add(DenseFFN(name=N.ffn(l), inputs=(N.ffn_norm(l),), layer=l, prefix=f"{p}.ffn", dim=d,
                           hidden=c.ffn_dim, act=c.activation, post_norm=c.post_norms, eps=float(c.norm_eps)))
            g.add(Add(name=N.b(l), inputs=(N.a(l), N.ffn(l)), layer=l, dim=d))
            b = N.b(l)
        if c.has_moe(l):
            src = b if c.routing == "post" else N.a(l)
            g.add(RMSNorm(name=N.moe_norm(l), inputs=(src,), layer=l, weight=f"{p}.moe_norm", dim=d, eps=c.norm_eps))
            g.add(Router(name=N.route(l), inputs=(N.moe_norm(l),), layer=l, weight=f"{p}.moe.router", dim=d,
                         n_experts=c.n_experts, top_k=c.top_k, normalize=c.norm_topk))
            g.add(ExpertBank(name=N.moe(l), inputs=(N.moe_norm(l), N.route(l)), layer=l, prefix=f"{p}.moe",
                             dim=d, hidden=c.expert_dim, n_experts=c.n_experts, top_k=c.top_k,
                             shared_hidden=c.shared_expert_dim, shared_gate=c.shared_expert_gate,
                             act=c.activation))
            experts[l] = N.moe(l)
        stream = b
        if l - de in experts:
            g.add(Add(name=N.x(l), inputs=(b, experts[l - de]), layer=l, dim=d, role="inject" if de else "residual"))
            stream = N.x(l)
    pending = [experts[j] for j in range(L - de + 1, L + 1) if de and j in experts]
    if pending:
        g.add(Add(name=N.FLUSH, inputs=(stream, *pending), layer=L + 1, dim=d, role="flush"))
        stream = N.FLUSH
    g.add(RMSNorm(name=N.FINAL_NORM, inputs=(stream,), layer=L + 1, weight="norm", dim=d, eps=c.norm_eps))
    head = "tok_embeddings" if c.tie_embeddings else "lm_head"
    g.add(LMHead(name=OUTPUT, inputs=(N.FINAL_NORM,), layer=L + 1, weight=head, dim=d, vocab=c.vocab_size,
                 softcap=float(c.final_softcap)))
    return g
