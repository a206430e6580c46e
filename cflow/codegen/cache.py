"""On-disk cache of compiled object code, so a second load of the same IR skips LLVM opt + codegen.

Input: the emitted (unoptimised) LLVM IR text, the Target and the opt level. Output: object bytes.
Key = sha256 over (IR text, triple, cpu, features, opt level, llvmlite version, cflow version).

Entry file `<dir>/<key>.o` = b"CFLOWOBJ" | u32 stamp length | stamp JSON | object bytes.
The stamp repeats every key field plus the object's sha256: a stamp that does not match what
the caller asked for (other version, other features) is a miss; a corrupt or truncated entry is
ignored (and overwritten by the next save). Writes go through cflow.util.atomic_write_bytes (temp
file, then `os.replace`), so a concurrent reader sees either no entry or a whole one.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from pathlib import Path

import attrs

from ..errors import CflowError
from ..util import atomic_write_bytes
from .target import Target

ENTRY_MAGIC = b"CFLOWOBJ"
ENTRY_FORMAT = 1  # bump when the entry layout changes


def default_cache_dir() -> Path:
    """$CFLOW_CACHE_DIR, else ~/.cache/cflow."""
    env = os.environ.get("CFLOW_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "cflow"


def _versions() -> tuple[str, str]:
    import llvmlite

    import cflow

    return llvmlite.__version__, cflow.__version__


@attrs.frozen
class CacheKey:
    """digest names the entry file; stamp is stored in it and compared on load."""

    digest: str
    stamp: dict = attrs.field(eq=False)


def make_key(ir_text: str, target: Target, opt: int) -> CacheKey:
    llvmlite_version, cflow_version = _versions()
    stamp = {
        "format": ENTRY_FORMAT,
        "ir_sha256": hashlib.sha256(ir_text.encode()).hexdigest(),
        "triple": target.triple,
        "cpu": target.cpu,
        "features": target.features,
        "opt": int(opt),
        "llvmlite": llvmlite_version,
        "cflow": cflow_version,
    }
    digest = hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()
    return CacheKey(digest=digest, stamp=stamp)


class ObjectCache:
    """Best-effort object cache: I/O errors never fail a compile, they only cost a recompile."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()

    def path(self, key: CacheKey) -> Path:
        return self.directory / f"{key.digest}.o"

    def load(self, key: CacheKey) -> bytes | None:
        """The cached object for `key`, or None (absent, stale stamp, corrupt or unreadable)."""
        obj = self._read(self.path(key), key)
        with self._lock:
            if obj is None:
                self.misses += 1
            else:
                self.hits += 1
        return obj

    @staticmethod
    def _read(path: Path, key: CacheKey) -> bytes | None:
        try:
            data = path.read_bytes()
        except OSError:
            return None
        head = len(ENTRY_MAGIC) + 4
        if len(data) < head or data[: len(ENTRY_MAGIC)] != ENTRY_MAGIC:
            return None
        (n,) = struct.unpack_from("<I", data, len(ENTRY_MAGIC))
        if head + n > len(data):
            return None
        try:
            stamp = json.loads(data[head : head + n].decode())
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None
        obj = data[head + n :]
        if not isinstance(stamp, dict) or stamp.pop("obj_sha256", None) != hashlib.sha256(obj).hexdigest():
            return None
        # NOTE: any key field that differs (versions, features, ...) makes the entry stale.
        if stamp != key.stamp or not obj:
            return None
        return obj

    def save(self, key: CacheKey, obj: bytes) -> bool:
        """Store atomically; returns False if the cache directory is not writable."""
        stamp = dict(key.stamp, obj_sha256=hashlib.sha256(obj).hexdigest())
        blob = json.dumps(stamp, sort_keys=True).encode()
        payload = ENTRY_MAGIC + struct.pack("<I", len(blob)) + blob + bytes(obj)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self.path(key), payload, durable=False)  # a torn entry fails its sha256
            return True
        except (OSError, CflowError):
            return False
