"""Small shared helpers with no pipeline-stage meaning: atomic file writes."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def _atomic(path: str | os.PathLike, fill: Callable[[str], None]) -> None:
    """Let `fill(tmp)` write a temp file beside `path`, fsync it, rename it over `path`.

    `path` is either untouched or complete; on any failure the temp file is removed.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    os.close(fd)
    try:
        fill(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    _atomic(path, lambda tmp: Path(tmp).write_text(text))


def atomic_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    _atomic(dst, lambda tmp: shutil.copyfile(src, tmp))
