"""Remember emitted step programs: plan fingerprint -> (LLVM IR text, binding table), beside the object cache.

Emitting the step with llvmlite.ir and printing it costs ~25-45 ms per executed layer (every stage is emitted
to compare its text with the shared stage functions, codegen/step.py); a second load of the same
model reads the IR text back instead, so the object cache (keyed by that text, as always) is reached
in milliseconds. The fingerprint covers everything the emitted text depends on: the model's packing,
schedule and config, ISA, context length, profiling, and the source of the code generators.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import CflowError
from ..util import atomic_write_text
from .cache import _versions, default_cache_dir

# Sources the emitted text depends on (relative to the cflow package): part of the fingerprint.
GENERATORS = ("codegen/step.py", "codegen/step_context.py", "codegen/moe.py", "codegen/ops.py", "codegen/attention.py",
              "codegen/threads.py", "codegen/kernels.py", "codegen/blockdot.py", "codegen/cgutils.py", "codegen/abi.py",
              "codegen/tune.py", "codegen/target.py", "layout/tile.py", "layout/packed.py", "layout/blocks.py",
              "layout/quant.py")


def _source_digest() -> str:
    h = hashlib.sha256()
    root = Path(__file__).parent.parent
    for name in GENERATORS:
        h.update((root / name).read_bytes())
    return h.hexdigest()


def fingerprint(header: dict, schedule: dict, isa: str, max_seq: int, profile: bool, segmented: bool = False,
                tmax: int = 1, kv: str = "f32", tuning: dict | None = None,
                bf16_unit: str = "", activations: str = "q8") -> str:
    """schedule: the one the step runs (the header's, or the disk tier's late one); segmented: stage-range calls;
    tmax: tokens per multi-token call (1: decode only); kv: the KV cache's element type; tuning: this host's
    tuned choices (codegen.tune's mat-vec knobs, codegen.attn_tune's attention prefetch), which change the emitted
    text;
    bf16_unit: what kv='bf16' attention's dot products were emitted for (Target.bf16_unit: the texts differ);
    activations: the quantised activations' format (layout.quant.ACT_FORMATS)."""
    plan = {k: header.get(k) for k in ("config", "packing", "tile", "quant")}
    blob = json.dumps([plan, schedule, isa, max_seq, profile, segmented, tmax, kv, tuning or {}, bf16_unit,
                       _versions(), _source_digest()] + ([activations] if activations != "q8" else []),
                      sort_keys=True)
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
        atomic_write_text(p, json.dumps({"fingerprint": fp, "ir": ir_text, "meta": meta}), durable=False)
    except (OSError, CflowError):
        pass  # a read-only cache directory only costs speed
