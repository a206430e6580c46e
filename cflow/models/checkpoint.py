"""Checkpoint directories: config.json + model.safetensors (+ tokenizer.json and tokenizer_config.json), what
`cflowc DIR` compiles."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import CflowError, ConfigError
from ..ir.config import ModelConfig
from ..util import atomic_path
from .data import EOT

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


def is_checkpoint_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    if not (p.is_dir() and (p / CONFIG).is_file()):
        return False
    try:
        return json.loads((p / CONFIG).read_text()).get("format") == "cflow"
    except (OSError, ValueError):
        return False


def read_config(path: str | os.PathLike) -> ModelConfig:
    p = Path(path) / CONFIG
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{p}: cannot read config ({e})") from None
    d.pop("format", None)
    return ModelConfig.from_dict(d)


def save_checkpoint(model, path: str | os.PathLike, tokenizer_json: str | None = None, dtype=None) -> Path:
    """Write `model` (a PipelineNativeLM) as a checkpoint directory, atomically: a complete new
    directory replaces any old one at `path` (cflow.util.atomic_path)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path, directory=True) as tmp:
        write_checkpoint(model, tmp, tokenizer_json, dtype)
    return path


def write_checkpoint(model, directory: Path, tokenizer_json: str | None = None, dtype=None) -> None:
    """The checkpoint files, written into an existing (private, unpublished) `directory`."""
    from safetensors.torch import save_file

    cfg = {"format": "cflow", **model.config.to_dict()}
    (directory / CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    if model.config.tie_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, str(directory / WEIGHTS), metadata={"format": "pt"})
    if tokenizer_json is not None:
        (directory / TOKENIZER).write_text(tokenizer_json)
        if EOT in tokenizer_json:  # models trained here saw EOT before every story (data.encode_stories): prompts
            # start with it, as transformers and the frontends read tokenizer_config.json (runtime/tokenizer.py)
            (directory / TOKENIZER_CONFIG).write_text(json.dumps(
                {"bos_token": EOT, "eos_token": EOT, "add_bos_token": True, "add_eos_token": False}, indent=2) + "\n")


def load_checkpoint(path: str | os.PathLike):
    """Checkpoint directory -> PipelineNativeLM (float32) with its weights."""
    import torch
    from safetensors.torch import load_file

    from .reference import PipelineNativeLM

    config = read_config(path)
    model = PipelineNativeLM(config)
    wpath = Path(path) / WEIGHTS
    try:
        sd = load_file(str(wpath))
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types for corrupt headers
        raise CflowError(f"{wpath}: cannot read weights ({e})") from None
    sd = {k: v.to(torch.float32) for k, v in sd.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise CflowError(f"{wpath}: weights do not match config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model.eval()


def tokenizer_json(path: str | os.PathLike) -> str | None:
    p = Path(path) / TOKENIZER
    return p.read_text() if p.is_file() else None
