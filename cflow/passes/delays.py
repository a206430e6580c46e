"""DAG rewrites that make a model pipeline-native: dense delay, expert delay, routing point.

Each is a pure edge rewrite of the layer DAG (docs/DESIGN.md's equations). They change the function
the model computes: applied to weights not trained that way, they warn (DelayRewriteWarning).
"""

from __future__ import annotations

import warnings

from ..errors import PassError
from ..ir import Add, Graph, RMSNorm
from ..ir import names as N
from .manager import Pass, graph_pass


class DelayRewriteWarning(UserWarning):
    """A delay or routing rewrite changed what a trained model computes."""


def _check_layers(g: Graph, name: str, value: int) -> None:
    L = g.config.n_layers
    if not isinstance(value, int) or not 0 <= value < L:
        raise PassError(f"pass {name}: delay {value!r} out of range 0..{L - 1} (n_layers - 1)")


def _warn_if_changed(g: Graph, what: str) -> None:
    m = g.meta
    trained = (tuple(m.trained_delays), m.trained_routing)
    if (m.delays, m.routing) != trained:
        dd, de = m.delays
        warnings.warn(
            f"{what}: the DAG now has dd={dd}, de={de}, routing={m.routing} but the weights of {g.name} were "
            f"trained with dd={trained[0][0]}, de={trained[0][1]}, routing={trained[1]}; this changes the model's "
            "function (only models trained with these delays keep their quality)",
            DelayRewriteWarning,
            stacklevel=4,
        )


def _stream_after_ffn(g: Graph, layer: int) -> str:
    """b_l if the layer has a dense FFN, else a_l (b_l = a_l)."""
    return N.b(layer) if N.b(layer) in g else N.a(layer)


def _norms(g: Graph, role: str) -> list[RMSNorm]:
    """The norms of one role (ffn_norm, moe_norm) in every layer."""
    return [n for n in g.nodes() if isinstance(n, RMSNorm) and N.role(n.name) == role]


def dense_delay(dd: int) -> Pass:
    """Dense FFN of layer l reads a_{l-dd} (x_0 when l - dd <= 0)."""

    @graph_pass(name="dense_delay")
    def run(g: Graph, ctx) -> Graph:
        _check_layers(g, "dense_delay", dd)
        g = g.copy()
        for n in _norms(g, "ffn_norm"):
            g.replace(n.with_inputs(N.a(n.layer - dd)))
        g.meta.config = g.config.evolve(dense_delay=dd)  # the config always describes the DAG
        _warn_if_changed(g, "dense_delay")
        return g

    return run


def expert_delay(de: int) -> Pass:
    """MoE output of layer l joins the stream at layer l + de; outputs still pending are flushed before the
    final norm."""

    @graph_pass(name="expert_delay")
    def run(g: Graph, ctx) -> Graph:
        _check_layers(g, "expert_delay", de)
        g = g.copy()
        L = g.config.n_layers
        # 1. Take out the old injections: readers of x_l read the stream it extended.
        for n in reversed(list(g.nodes())):
            if N.role(n.name) in (N.role(N.x(1)), N.FLUSH):
                g.replace_all_uses(n.name, n.inputs[0])
                g.remove(n.name)
        # 2. Inject e_{l-de} at layer l; later layers read the new stream version.
        stream = None
        for layer in range(1, L + 1):
            stream = _stream_after_ffn(g, layer)
            src = N.moe(layer - de)
            if layer - de >= 1 and src in g:
                x = N.x(layer)
                g.add(Add(name=x, inputs=(stream, src), layer=layer, dim=g[stream].dim,
                          role="inject" if de else "residual"))
                for u in g.users(stream):
                    if g[u].layer > layer:
                        node = g[u]
                        g.replace(node.with_inputs(*(x if i == stream else i for i in node.inputs)))
                stream = x
        # 3. Flush what is still pending after the last layer.
        pending = [N.moe(j) for j in range(L - de + 1, L + 1) if de and N.moe(j) in g]
        if pending:
            final = g[N.FINAL_NORM]
            g.add(Add(name=N.FLUSH, inputs=(final.inputs[0], *pending), layer=L + 1, dim=final.dim, role="flush"))
            g.replace(final.with_inputs(N.FLUSH))
        g.meta.config = g.config.evolve(expert_delay=de)
        _warn_if_changed(g, "expert_delay")
        return g

    return run


def routing_point(where: str) -> Pass:
    """'post': the router sees b_l (after the dense FFN); 'pre': it sees a_l (arch3/arch4)."""
    if where not in ("post", "pre"):
        raise PassError(f"pass routing_point: expected 'post' or 'pre', not {where!r}")

    @graph_pass(name="routing_point")
    def run(g: Graph, ctx) -> Graph:
        g = g.copy()
        for n in _norms(g, "moe_norm"):
            g.replace(n.with_inputs(_stream_after_ffn(g, n.layer) if where == "post" else N.a(n.layer)))
        g.meta.config = g.config.evolve(routing=where)
        _warn_if_changed(g, "routing_point")
        return g

    return run


def set_delays(dd: int, de: int, routing: str | None = None) -> list[Pass]:
    """The passes that give a graph these delays (and routing point)."""
    out = [dense_delay(dd), expert_delay(de)]
    if routing is not None:
        out.append(routing_point(routing))
    return out
