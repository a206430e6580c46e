"""Graph: the layer dependency DAG (networkx) of typed nodes, with its weights and model metadata.

Edits keep the networkx graph and each value's users in sync (torch.fx style): add, replace,
remove, replace_all_uses. Order is canonical (layer, role, name), so two graphs with the same
structure print identically however they were built or rewritten.
"""

from __future__ import annotations

from collections.abc import Iterator

import networkx as nx

from ..errors import VerifyError
from .meta import GraphMeta
from .nodes import Node

INPUT = "ids"  # the graph input: token ids
OUTPUT = "logits"

# Print/execution order inside one layer; the stem is the node name before the first dot.
ROLE_RANK = {
    "x0": 0, "attn_norm": 1, "attn": 2, "a": 3, "ffn_norm": 4, "ffn": 5, "b": 6,
    "moe_norm": 7, "route": 8, "moe": 9, "x": 10, "flush": 11, "final_norm": 12, "logits": 13,
}


def stem(name: str) -> str:
    return name.split(".", 1)[0]


def sort_key(node: Node) -> tuple:
    return (node.layer, ROLE_RANK.get(stem(node.name), 99), node.name)


class Graph:
    """Nodes by name, the DAG of their data dependencies, weights by name, and metadata (ir/meta.py)."""

    def __init__(self, name: str, meta: GraphMeta, weights=None):
        self.name = name
        self.meta: GraphMeta = meta
        self.weights = weights if weights is not None else {}  # a Mapping: name -> array or QTensor
        self._nodes: dict[str, Node] = {}
        self._dag = nx.DiGraph()

    # --- construction and edits ----------------------------------------------------------
    def add(self, node: Node) -> Node:
        if node.name in self._nodes or node.name == INPUT:
            raise VerifyError(f"duplicate node name %{node.name}")
        self._nodes[node.name] = node
        self._dag.add_node(node.name)
        self._link(node)
        return node

    def _link(self, node: Node) -> None:
        for i in node.inputs:
            if i != INPUT:
                self._dag.add_edge(i, node.name)  # an undefined input becomes a phantom node: verify names it

    def _unlink(self, node: Node) -> None:
        for i in node.inputs:
            if i != INPUT and self._dag.has_edge(i, node.name):
                self._dag.remove_edge(i, node.name)
                if i not in self._nodes and self._dag.degree(i) == 0:
                    self._dag.remove_node(i)

    def replace(self, node: Node) -> Node:
        """Swap the node of the same name (new inputs or attributes); users are unchanged."""
        self._unlink(self[node.name])
        self._nodes[node.name] = node
        self._link(node)
        return node

    def remove(self, name: str) -> None:
        users = self.users(name)
        if users:
            raise VerifyError(f"cannot remove %{name}: still used by {', '.join('%' + u for u in users)}")
        self._unlink(self._nodes.pop(name))
        self._dag.remove_node(name)

    def replace_all_uses(self, old: str, new: str) -> int:
        """Make every reader of %old read %new instead. Returns how many nodes changed."""
        n = 0
        for u in self.users(old):
            node = self._nodes[u]
            self.replace(node.with_inputs(*(new if i == old else i for i in node.inputs)))
            n += 1
        return n

    # --- queries -------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Node:
        try:
            return self._nodes[name]
        except KeyError:
            raise VerifyError(f"no node %{name} in graph {self.name}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def get(self, name: str) -> Node | None:
        return self._nodes.get(name)

    def users(self, name: str) -> list[str]:
        if name not in self._dag:
            return []
        return sorted(self._dag.successors(name), key=lambda n: sort_key(self._nodes[n]))

    def _key(self, name: str) -> tuple:
        node = self._nodes.get(name)
        return sort_key(node) if node is not None else (-1, -1, name)

    def nodes(self) -> Iterator[Node]:
        """Nodes in canonical topological order (stable: same structure, same order)."""
        try:
            order = nx.lexicographical_topological_sort(self._dag, key=self._key)
            for name in order:
                if name in self._nodes:
                    yield self._nodes[name]
        except nx.NetworkXUnfeasible:
            raise VerifyError(f"graph {self.name} has a cycle: {nx.find_cycle(self._dag)}") from None

    def insertion_order(self) -> list[Node]:
        """Nodes as added (no ordering guarantee beyond that; works on malformed graphs)."""
        return list(self._nodes.values())

    def of_kind(self, kind: str) -> list[Node]:
        return [n for n in self.nodes() if n.kind == kind]

    def lookup_weights(self) -> frozenset[str]:
        """Weights only embedding nodes read: a step touches one row of them per token, not the whole tensor (an
        untied embedding; a tied one is also the head's matrix, read whole every step)."""
        rows = {n.weight for n in self.insertion_order() if n.kind == "embedding"}
        for n in self.insertion_order():
            if n.kind != "embedding":
                rows.difference_update(n.weight_names())
        return frozenset(rows)

    @property
    def dag(self) -> nx.DiGraph:
        """The dependency DAG (node names); read-only by convention."""
        return self._dag

    @property
    def config(self):
        return self.meta.config

    def copy(self) -> Graph:
        """A new graph with the same nodes and meta; weights are shared (passes never mutate arrays)."""
        g = Graph(self.name, self.meta.copy(), self.weights)
        for n in self._nodes.values():
            g._nodes[n.name] = n
        g._dag = self._dag.copy()
        return g

    def weight(self, name: str):
        try:
            return self.weights[name]
        except KeyError:
            raise VerifyError(f"graph {self.name} has no weight {name!r}") from None

    def __str__(self) -> str:
        from .printer import format_graph

        return format_graph(self)

    def __repr__(self) -> str:
        return f"<Graph {self.name}: {len(self)} nodes, {len(self.weights)} weights>"
