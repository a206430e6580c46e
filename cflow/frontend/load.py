"""Resolve what a user names as MODEL into an IR Graph: preset spec, checkpoint directory, ONNX file, module.

    preset:NAME[@SIZE]   random weights from_preset(NAME, SIZE, seed=0) (shapes only if weights=False)
    DIR                  a cflow checkpoint directory (config.json + model.safetensors)
    FILE.onnx            an ONNX decoder graph
    FILE.gguf            a llama.cpp GGUF file (by suffix or magic)
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import CflowError
from ..ir import Graph, build_graph, verify


def is_preset_spec(spec) -> bool:
    return isinstance(spec, str) and spec.startswith("preset:")


def load_graph(model, weights: bool = True, seed: int = 0) -> Graph:
    """Any supported model reference -> verified Graph (its own delays, float weights)."""
    from ..models import from_preset, get_preset, parse_preset_spec

    if isinstance(model, Graph):
        return model
    if is_preset_spec(model):
        name, size = parse_preset_spec(model)
        if not weights:
            return verify(build_graph(get_preset(name, size)))
        from .torch_module import from_torch

        return from_torch(from_preset(name, size, seed=seed))
    if isinstance(model, (str, os.PathLike)):
        p = Path(model)
        if not p.exists():
            raise CflowError(f"{p}: no such file or directory "
                             "(expected preset:NAME[@SIZE], a model directory, an .onnx or a .gguf file)")
        if p.is_dir():
            from ..models.checkpoint import is_checkpoint_dir

            if is_checkpoint_dir(p):
                from .cflow_dir import from_checkpoint

                return from_checkpoint(p)
            if (p / "config.json").is_file():
                from .hf import from_hf_dir

                return from_hf_dir(p)
            raise CflowError(f"{p}: not a model directory (no config.json)")
        from .gguf import from_gguf, is_gguf

        if is_gguf(p):
            return from_gguf(p)
        from . import from_onnx

        return from_onnx(p)
    if hasattr(model, "graph") and hasattr(model, "opset_import"):  # an onnx.ModelProto
        from . import from_onnx

        return from_onnx(model)
    from .torch_module import from_torch

    return from_torch(model)
