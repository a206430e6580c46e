"""Tensors of a model directory, read lazily: one safetensors file or shards listed by an index.

Shared by Hugging Face directories (hf.py) and cflow checkpoints (cflow_dir.py): shapes come from
the file headers, and a tensor (or one expert's slice of a stacked tensor) is read only when asked.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from ..errors import CflowError


class SafetensorsDir:
    """Tensors of a HF directory: model.safetensors or shards listed by model.safetensors.index.json."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                wmap = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CflowError(f"{index}: cannot read the shard index ({e})") from None
            files = sorted(set(wmap.values()))
        elif (path / "model.safetensors").is_file():
            wmap, files = None, ["model.safetensors"]
        else:
            raise CflowError(f"{path}: no model.safetensors or model.safetensors.index.json")
        self.handles, self.where = {}, {}
        for f in files:
            fp = path / f
            if not fp.is_file():
                raise CflowError(f"{fp}: shard listed in the index is missing")
            try:
                h = safe_open(str(fp), framework="pt")
                keys = list(h.keys())
            except Exception as e:  # safetensors raises its own types for corrupt headers
                raise CflowError(f"{fp}: cannot read safetensors ({type(e).__name__}: {e})") from None
            self.handles[f] = h
            for k in keys:
                self.where[k] = f
        if wmap is not None:
            missing = [k for k, f in wmap.items() if self.where.get(k) != f]
            if missing:
                raise CflowError(f"{index}: tensor {missing[0]!r} is not in {wmap[missing[0]]}")

    def keys(self):
        return set(self.where)

    def shape(self, key):
        return tuple(self.handles[self.where[key]].get_slice(key).get_shape())

    def load(self, key, index=None) -> np.ndarray:
        f = self.where[key]
        try:
            h = self.handles[f]
            t = h.get_slice(key)[index] if index is not None else h.get_tensor(key)
        except Exception as e:
            raise CflowError(f"{self.path / f}: cannot read tensor {key!r} ({type(e).__name__}: {e})") from None
        return np.ascontiguousarray(t.float().numpy())


class LazyWeights(Mapping):
    """IR weight name -> float32 array, read from disk on every access (nothing cached: a model far
    larger than RAM streams through the compiler one tensor at a time)."""

    def __init__(self, plan: dict[str, Callable[[], np.ndarray]]):
        self.plan = plan

    def __getitem__(self, name: str) -> np.ndarray:
        return self.plan[name]()

    def __contains__(self, name) -> bool:
        return name in self.plan

    def __iter__(self):
        return iter(self.plan)

    def __len__(self) -> int:
        return len(self.plan)
