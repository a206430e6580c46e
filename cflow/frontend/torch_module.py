"""PyTorch frontend: nn.Module -> IR Graph with float32 weights.

Handles cflow's own PipelineNativeLM (its config is exact, its weights map 1:1); other
families are recognised by hf.py.
"""

from __future__ import annotations

import numpy as np

from ..errors import UnsupportedModelError
from ..ir import Graph, build_graph, verify


def _np(t) -> np.ndarray:
    return np.ascontiguousarray(t.detach().to("cpu").float().numpy())


def pipeline_native_weights(model) -> dict[str, np.ndarray]:
    """PipelineNativeLM state -> IR weight names (experts split one tensor per expert)."""
    c = model.config
    w: dict[str, np.ndarray] = {"tok_embeddings": _np(model.tok_embeddings.weight), "norm": _np(model.norm.weight)}
    if model.lm_head is not None:
        w["lm_head"] = _np(model.lm_head.weight)
    for i, blk in enumerate(model.blocks):
        p = f"blocks.{i}"
        w[f"{p}.attn_norm"] = _np(blk.attn_norm.weight)
        for n in ("wq", "wk", "wv", "wo"):
            lin = getattr(blk.attn, n)
            w[f"{p}.attn.{n}"] = _np(lin.weight)
            if lin.bias is not None:
                w[f"{p}.attn.b{n[1]}"] = _np(lin.bias)
        if blk.ffn is not None:
            w[f"{p}.ffn_norm"] = _np(blk.ffn_norm.weight)
            for n in ("w_gate", "w_up", "w_down"):
                w[f"{p}.ffn.{n}"] = _np(getattr(blk.ffn, n).weight)
        if blk.moe is not None:
            m = blk.moe
            w[f"{p}.moe_norm"] = _np(blk.moe_norm.weight)
            w[f"{p}.moe.router"] = _np(m.router.weight)
            for n in ("w_gate", "w_up", "w_down"):
                stacked = _np(getattr(m, n))
                for e in range(c.n_experts):
                    w[f"{p}.moe.experts.{e}.{n}"] = stacked[e]
            if m.shared is not None:
                for n in ("w_gate", "w_up", "w_down"):
                    w[f"{p}.moe.shared.{n}"] = _np(getattr(m.shared, n).weight)
            if m.shared_gate is not None:
                w[f"{p}.moe.shared_gate"] = _np(m.shared_gate.weight)
    return w


def from_torch(module, name: str | None = None) -> Graph:
    """A PyTorch model -> verified IR Graph carrying its float32 weights and its own delays."""
    from ..models.reference import PipelineNativeLM

    if isinstance(module, PipelineNativeLM):
        g = build_graph(module.config, pipeline_native_weights(module), name=name)
        return verify(g)
    try:
        from .hf import from_hf_module
    except ImportError:  # the Hugging Face frontend is optional
        from_hf_module = None
    if from_hf_module is not None:
        g = from_hf_module(module, name=name)
        if g is not None:
            return verify(g)
    raise UnsupportedModelError(
        f"unsupported model class {type(module).__module__}.{type(module).__qualname__}: expected "
        "cflow.models.PipelineNativeLM or a supported Hugging Face causal LM"
    )
