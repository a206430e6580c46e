"""Remember emitted step programs: plan fingerprint -> (LLVM IR text, binding table), beside the object cache.

Emitting the step with llvmlite.ir and printing it costs ~0.1 s per layer; a second load of the same
model reads the IR text back instead, so the object cache (keyed by that text, as always) is reached
in milliseconds. The fingerprint covers everything the emitted text depends on: the model's packing,
schedule and config, ISA, context length, profiling, and the source of the code generators.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from .cache import _versions, default_cache_dir

GENERATORS = ("step.py", "ops.py", "kernels.py")  # their source is part of the fingerprint


def _source_digest() -> str:
    h = hashlib.sha256()
    here = Path(__file__).parent
    for name in GENERATORS:
        h.update((here / name).read_bytes())
    h.update((here.parent / "passes" / "tile.py").read_bytes())
    return h.hexdigest()


def fingerprint(header: dict, isa: str, max_seq: int, profile: bool) -> str:
    plan = {k: header.get(k) for k in ("config", "packing", "schedule", "tile", "quant")}
    blob = json.dumps([plan, isa, max_seq, profile, _versions(), _source_digest()], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _path(fp: str) -> Path:
    return default_cache_dir() / "programs" / f"{fp}.json"


def load(fp: str) -> dict | None:
    """The stored {"ir": text, "meta": {...}} or None (missing or unreadable entries are misses)."""
    try:
        d = json.loads(_path(fp).read_text())
        return d if isinstance(d, dict) and d.get("fingerprint") == fp and isinstance(d.get("ir"), str) else None
    except (OSError, ValueError):
        return None


def save(fp: str, ir_text: str, meta: dict) -> None:
    p = _path(fp)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"fingerprint": fp, "ir": ir_text, "meta": meta}, f)
        os.replace(tmp, p)
    except OSError:
        pass  # a read-only cache directory only costs speed
