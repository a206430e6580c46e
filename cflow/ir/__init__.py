"""The layer dependency DAG: typed nodes, Graph, builder, verifier, printer and NumPy interpreter."""

from .build import build_graph, weight_shapes
from .graph import Graph
from .interp import Interpreter, interpret
from .nodes import NODE_TYPES, Add, Attention, DenseFFN, Embedding, ExpertBank, LMHead, Node, RMSNorm, Router
from .printer import format_graph
from .verify import verify

__all__ = [
    "Graph", "Node", "Embedding", "RMSNorm", "Attention", "DenseFFN", "Router", "ExpertBank", "Add", "LMHead",
    "NODE_TYPES", "build_graph", "weight_shapes", "verify", "interpret", "Interpreter", "format_graph",
]
