"""The model shipped inside the package: a small arch2_4_combined trained on TinyStories.

`cflow/data/default/` is a cflow checkpoint directory (config.json, model.safetensors in f16,
tokenizer.json) with the CDLA-Sharing-1.0 notice of its training data (NOTICE, README.md); see
docs/architectures.md for how it was trained. No torch needed to locate it.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CflowError


def default_model_dir() -> Path:
    """Path of the bundled checkpoint directory (what `cflowc` compiles, `load_checkpoint` loads)."""
    p = Path(__file__).resolve().parent.parent / "data" / "default"
    if not (p / "config.json").is_file():
        raise CflowError(f"{p}: the bundled default model is missing from this installation")
    return p
