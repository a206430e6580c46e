"""FileWriter: streams tensors into a .cflow/.vflow container and publishes it atomically.

Input: a JSON-able header dict, then tensors (name, dtype, shape, bytes) in data order.
Output: one file at `path` (docs/FORMAT.md), or nothing at all if anything fails. The temp file,
fsyncs and the rename are cflow.util.atomic_path's, driven by open/close/abort instead of `with`.
The tensors' bytes go to the disk with O_DIRECT where the file system takes it (direct.DirectAppender);
the header, index and preamble, small, through the ordinary buffered file.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
from typing import Self

import numpy as np

from cflow.errors import FormatError
from cflow.layout.packed import FileLayout
from cflow.layout.tile import DEFAULT_TILE
from cflow.util import atomic_path

from ...util import crc32
from . import spec as F
from .direct import DirectAppender
from .folios import drop_cached
from .spec import DType


class _State(enum.Enum):
    NEW = "new"  # nothing on disk yet
    TENSORS = "tensors"  # temp file open, preamble reserved, header written; accepting tensors
    DONE = "done"  # published at path
    FAILED = "failed"  # aborted; temp file removed


def _layout_from_path(path: str) -> str:
    try:
        return str(FileLayout.from_path(path))
    except ValueError:
        raise FormatError(f"{path}: cannot infer the layout from the extension; "
                          "pass layout='cflow' or 'vflow'") from None


def _as_bytes(data, name: str) -> memoryview:
    # Zero-copy byte view; non-contiguous input is a tile-packer bug, not something to copy over.
    if isinstance(data, (bytes, bytearray, memoryview)):
        return memoryview(data).cast("B")
    arr = np.asarray(data)
    if not arr.flags.c_contiguous:
        raise FormatError(f"tensor {name!r}: data must be C-contiguous")
    return memoryview(arr.reshape(-1).view(np.uint8))


class FileWriter:
    """Write a container: header at open, tensors as they arrive, tables and preamble at close.

    with FileWriter("m.vflow", header) as w:
        w.add_tensor("layers.0.attn.wqkv", DType.Q4, (3072, 1024), packed, tile=(128, 256), layer=0, stage=0)

    State machine: NEW -> (open) TENSORS -> (close) DONE, or -> FAILED on any error/abort.
    Tensor data is written to the temp file as it is added; only the small tables stay in RAM.
    """

    def __init__(self, path, header: dict, layout: str | None = None, *,
                 expected_nbytes: F.NbytesHook = F.expected_nbytes, direct: bool = True):
        self.path = os.fspath(path)
        self.direct = direct  # tensors written with O_DIRECT where the file system takes it
        self.layout = layout if layout is not None else _layout_from_path(self.path)
        try:
            self._flags = F.layout_flags(self.layout)
        except ValueError as e:
            raise FormatError(f"{self.path}: {e}") from None
        if not isinstance(header, dict):
            raise FormatError(f"{self.path}: header must be a dict, got {type(header).__name__}")
        from .header import written_by

        header = {**written_by(), **header}  # every file says who wrote it (a header may carry its own stamp)
        try:
            self._header = json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
        except (TypeError, ValueError) as e:
            raise FormatError(f"{self.path}: header is not JSON-serialisable: {e}") from None
        self._expected_nbytes = expected_nbytes
        self._state = _State.NEW
        self._file = None
        self._atomic = atomic_path(self.path)
        self._rows: list[tuple] = []  # packed tensor-table fields, in data order
        self._names: dict[str, int] = {}  # name -> table index
        self._pool = bytearray()  # names pool
        self._experts: dict[tuple[int, int], list[int]] = {}  # (layer, expert) -> tensor indices
        self._pos = 0  # current end of the temp file
        self._direct: DirectAppender | None = None  # the data section's O_DIRECT writes, while tensors stream

    # -- state machine ---------------------------------------------------------------------
    def _require(self, *states: _State, action: str) -> None:
        if self._state not in states:
            raise FormatError(f"{self.path}: cannot {action} in writer state {self._state.value!r}")

    def open(self) -> Self:
        """Create the temp file beside `path`, reserve the preamble, write the header."""
        self._require(_State.NEW, action="open")
        try:
            self._state = _State.TENSORS
            self._file = open(self._atomic.open(), "wb")  # noqa: SIM115 -- closed by close()/abort()
            self._write(bytes(F.PREAMBLE.size))  # placeholder, rewritten at close
            self._write(self._header)
            self._pad_to(F.pad(self._pos))
            self._file.flush()
            if self.direct:
                self._direct = DirectAppender.open(self._atomic.tmp, self._pos)
        except BaseException:
            self.abort()
            raise
        self._data_offset = self._pos
        return self

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self._state is _State.TENSORS:
            self.close()

    def __del__(self):
        # A writer dropped without close() leaves no temp file behind.
        with contextlib.suppress(Exception):  # e.g. __init__ failed, or interpreter shutdown
            if self._state is _State.TENSORS:
                self.abort()

    # -- tensors ---------------------------------------------------------------------------
    def add_tensor(self, name: str, dtype, shape, data, tile=DEFAULT_TILE, *, layer: int = -1,
                   expert: int = -1, stage: int = -1) -> int:
        """Append one tensor; returns its table index. `data` is the exact stored bytes
        (any C-contiguous array or bytes-like); 1-D tensors are f32 vectors and ignore `tile`."""
        self._require(_State.TENSORS, action=f"add tensor {name!r}")
        try:
            row = self._check(name, dtype, shape, data, tile, layer, expert, stage)
            self._append(*row)
        except FormatError:
            raise  # a rejected tensor leaves the writer usable (nothing was written)
        except BaseException:
            self.abort()
            raise
        return len(self._rows) - 1

    def _check(self, name, dtype, shape, data, tile, layer, expert, stage):
        where = f"{self.path}: tensor {name!r}"
        if not isinstance(name, str) or not name or "\0" in name:
            raise FormatError(f"{self.path}: tensor name must be a non-empty string without NUL, got {name!r}")
        try:
            bname = name.encode("utf-8")
        except UnicodeEncodeError:
            raise FormatError(f"{self.path}: tensor name {name!r} is not valid UTF-8 text") from None
        if len(bname) > F.MAX_NAME:
            raise FormatError(f"{where}: name longer than {F.MAX_NAME} bytes")
        if name in self._names:
            raise FormatError(f"{where}: duplicate name (first added as entry {self._names[name]})")
        try:
            dtype = DType.parse(dtype) if isinstance(dtype, str) else DType(dtype)
            shape = tuple(int(d) for d in shape)
            tile = (0, 0) if len(shape) == 1 else tuple(int(t) for t in tile)
            if len(tile) != 2:
                raise ValueError(f"tile must be (rows, cols), got {tile}")
            want = self._expected_nbytes(dtype, shape, tile)
        except (TypeError, ValueError) as e:
            raise FormatError(f"{where}: {e}") from None
        for field, v in (("layer", layer), ("expert", expert), ("stage", stage)):
            if not isinstance(v, (int, np.integer)) or not -1 <= v <= F.MAX_ID:
                raise FormatError(f"{where}: {field} {v!r} not in -1..{F.MAX_ID}")
        if expert >= 0 and layer < 0:
            raise FormatError(f"{where}: expert {expert} needs a layer")
        buf = _as_bytes(data, name)
        if want >= 0 and buf.nbytes != want:  # -1: a MIXED tensor (its size is the packing plan's)
            raise FormatError(
                f"{where}: {buf.nbytes} data bytes, but {dtype.label}{list(shape)} tile {tile} needs {want}")
        return name, bname, dtype, shape, tile, buf, int(layer), int(expert), int(stage)

    def _append(self, name, bname, dtype, shape, tile, buf, layer, expert, stage) -> None:
        offset = self._pos - self._data_offset
        crc = 0
        for i in range(0, buf.nbytes, F.CRC_CHUNK):  # write + checksum chunk by chunk (cache-warm)
            chunk = buf[i : i + F.CRC_CHUNK]
            crc = crc32(chunk, crc)
            self._write(chunk)
        self._pad_to(F.pad(self._pos))
        idx = len(self._rows)
        self._names[name] = idx
        self._rows.append((len(self._pool), len(bname), int(dtype), len(shape),
                           *(shape + (0,) * (F.MAX_NDIM - len(shape))), *tile,
                           offset, buf.nbytes, stage, layer, expert, crc))
        self._pool += bname
        if expert >= 0:
            self._experts.setdefault((layer, expert), []).append(idx)

    # -- publish ---------------------------------------------------------------------------
    def close(self) -> None:
        """Write the index and preamble, fsync, and atomically replace `path`."""
        if self._state is _State.DONE:
            return
        self._require(_State.TENSORS, action="close")
        try:
            data_len = self._pos - self._data_offset
            if self._direct is not None:  # the data section on the disk, then the rest through the file
                direct, self._direct = self._direct, None
                direct.close()
                self._file.seek(self._pos)
            index = self._index()
            index_offset = self._pos
            self._write(index)
            self._file.truncate(self._pos)  # past the end: the O_DIRECT probe's block when no tensor came
            header_len = len(self._header)
            fields = (F.MAGIC, F.VERSION, self._flags, F.ALIGN, F.PREAMBLE.size, header_len,
                      self._data_offset, data_len, index_offset, len(index), self._pos,
                      len(self._rows), len(self._experts), sum(map(len, self._experts.values())),
                      len(self._pool), crc32(self._header), crc32(index), bytes(28), 0)
            pre = F.PREAMBLE.pack(*fields)
            pre = pre[:-4] + crc32(pre[:-4]).to_bytes(4, "little")
            self._file.seek(0)
            self._file.write(pre)
            self._file.close()
            self._atomic.commit()  # fsync, rename onto path, fsync the directory
            self._state = _State.DONE
            drop_cached(self.path)
        except BaseException:
            self.abort()
            raise

    def _index(self) -> bytes:
        out = bytearray()
        for row in self._rows:
            out += F.TENSOR_ENTRY.pack(*row)
        ranges = []
        for (layer, expert) in sorted(self._experts):  # sorted: the reader requires it
            idxs = self._experts[(layer, expert)]
            out += F.EXPERT_ENTRY.pack(layer, expert, len(ranges), len(idxs))
            ranges += idxs
        for i in ranges:  # whole-tensor ranges: offset, nbytes, crc are the tensor's own
            row = self._rows[i]
            out += F.RANGE_ENTRY.pack(row[10], row[11], row[15], 0)
        return bytes(out + self._pool)

    def abort(self) -> None:
        """Discard everything: close and remove the temp file; `path` is never touched."""
        if self._state is _State.DONE:
            return
        self._state = _State.FAILED
        if self._direct is not None:
            direct, self._direct = self._direct, None
            with contextlib.suppress(OSError):
                direct.abort()
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
        self._atomic.abort()

    # -- low level -------------------------------------------------------------------------
    def _write(self, b) -> None:
        if self._direct is not None:
            self._direct.write(b)
        else:
            self._file.write(b)
        self._pos += memoryview(b).nbytes

    def _pad_to(self, end: int) -> None:
        if end > self._pos:
            self._write(bytes(end - self._pos))

