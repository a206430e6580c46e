"""cflow checkpoint directory -> Graph, tensor by tensor from the safetensors file (no torch model built).

tokenizer.json beside config.json goes to graph.meta["tokenizer"], eos ids to graph.meta["eos_token_ids"].
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import CflowError
from ..ir import Graph, build_graph, verify
from ..models.checkpoint import WEIGHTS, read_config


def checkpoint_weights(path: Path, config) -> dict[str, np.ndarray]:
    """Map PipelineNativeLM state-dict names to IR weight names, reading one tensor at a time."""
    from safetensors import safe_open

    wpath = Path(path) / WEIGHTS
    out: dict[str, np.ndarray] = {}
    try:
        with safe_open(str(wpath), framework="numpy") as f:
            keys = list(f.keys())
            for k in keys:
                try:
                    t = f.get_tensor(k)
                except TypeError:  # bf16 has no numpy dtype: go through torch
                    with safe_open(str(wpath), framework="pt") as ft:
                        t = ft.get_tensor(k).float().numpy()
                t = np.ascontiguousarray(t, dtype=np.float32)
                name = k[: -len(".weight")] if k.endswith(".weight") else k
                if ".attn.w" in name and k.endswith(".bias"):
                    name = k.replace(".attn.w", ".attn.b").replace(".bias", "")
                if ".moe.w_" in name and t.ndim == 3:  # stacked experts [E, out, in]
                    prefix, wname = name.rsplit(".", 1)
                    for e in range(t.shape[0]):
                        out[f"{prefix}.experts.{e}.{wname}"] = t[e]
                    continue
                out[name] = t
    except CflowError:
        raise
    except Exception as e:
        raise CflowError(f"{wpath}: cannot read weights ({type(e).__name__}: {e})") from None
    return out


def from_checkpoint(path) -> Graph:
    config = read_config(path)
    weights = checkpoint_weights(Path(path), config)
    g = build_graph(config, weights, name=config.name)
    for name, shape in g.meta["shapes"].items():
        w = weights.get(name)
        if w is None:
            raise CflowError(f"{path}: weight {name!r} missing from {WEIGHTS}")
        if tuple(w.shape) != tuple(shape):
            raise CflowError(f"{path}: weight {name!r} has shape {tuple(w.shape)}, config says {tuple(shape)}")
    from .hf_weights import eos_token_ids, read_tokenizer

    g.meta["tokenizer"] = read_tokenizer(path)
    g.meta["eos_token_ids"] = eos_token_ids(path)
    return verify(g)
