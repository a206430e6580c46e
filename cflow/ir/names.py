"""Value names of the layer DAG, in one place: the builder makes them, passes and the schedule find them.

Each node's value is named `<role>.<layer>` (layers 1-based); global values have no layer. The role
stems also fix the canonical print order inside a layer (graph.ROLE_RANK).
"""

from __future__ import annotations

EMBED = "x0"  # x_0: token embedding
FLUSH = "flush"  # x_L plus the expert outputs still pending after the last layer
FINAL_NORM = "final_norm"


def attn_norm(l: int) -> str:  # noqa: E743 (layer index, as in docs/DESIGN.md's equations)
    return f"attn_norm.{l}"


def attn(l: int) -> str:  # noqa: E743
    return f"attn.{l}"


def a(l: int) -> str:  # noqa: E743
    """a_l: the stream after attention; a_j for j <= 0 is x_0."""
    return f"a.{l}" if l >= 1 else EMBED


def ffn_norm(l: int) -> str:  # noqa: E743
    return f"ffn_norm.{l}"


def ffn(l: int) -> str:  # noqa: E743
    return f"ffn.{l}"


def b(l: int) -> str:  # noqa: E743
    """b_l: the stream after the dense FFN (exists only in layers with one)."""
    return f"b.{l}"


def moe_norm(l: int) -> str:  # noqa: E743
    return f"moe_norm.{l}"


def route(l: int) -> str:  # noqa: E743
    return f"route.{l}"


def moe(l: int) -> str:  # noqa: E743
    """e_l: the expert bank's output."""
    return f"moe.{l}"


def x(l: int) -> str:  # noqa: E743
    """x_l = b_l + e_{l-de}: the stream after an expert injection."""
    return f"x.{l}"


def role(name: str) -> str:
    """The role stem of a value name ('ffn_norm.3' -> 'ffn_norm')."""
    return name.split(".", 1)[0]
