"""Packed tensors: what a compiled file stores for a group of IR weights, and in which order.

A PackedTensor names the IR weights (`parts`) it is built from, its `Form` (how the parts become
one byte stream), dtype, shapes and tile; from those alone follow its declared shape, file tile and
byte size. The packing plan (passes/pack.py) decides which tensors exist; the writer materialises
them; the runtime checks the file against them and unpacks them for the interpreter.
"""

from __future__ import annotations

import enum
import os

import attrs
import numpy as np

from . import blocks as B
from . import tile as T
from .quant import DType, QTensor, dequantize


class Form(enum.StrEnum):
    """How a packed tensor's parts become one stream (the value is what the file header stores)."""

    TILED = "tiled"  # one matrix, tile stream
    CONCAT = "concat"  # QKV: parts row-concatenated, each padded to whole tile-rows
    GATE_UP = "gate_up"  # gate and up tile-rows interleaved
    ROWS = "rows"  # plain row-major 2-D (embedding, router, shared-expert gate); file tile (1, cols)
    VECTOR = "vector"  # f32 1-D (norms, biases); file tile (0, 0)

    @property
    def is_tiled(self) -> bool:
        """Streams a mat-vec kernel reads (tile layout inside)."""
        return self in (Form.TILED, Form.CONCAT, Form.GATE_UP)


class FileLayout(enum.StrEnum):
    """Order of tensors in a file: stage-major (.vflow) or layer-major (.cflow). One binary format."""

    VFLOW = "vflow"
    CFLOW = "cflow"

    @classmethod
    def from_path(cls, path: str | os.PathLike) -> FileLayout:
        """The layout a file name asks for: its extension."""
        ext = os.path.splitext(os.fspath(path))[1].lstrip(".").lower()
        try:
            return cls(ext)
        except ValueError:
            raise ValueError(f"{os.fspath(path)}: expected a .vflow or .cflow file name") from None

    @classmethod
    def parse(cls, value: str | FileLayout) -> FileLayout:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown layout {value!r} (expected vflow or cflow)") from None


@attrs.frozen
class PackedTensor:
    """One stored tensor: `parts` (IR weight names) packed as `form` at `dtype` with `tile`."""

    name: str
    form: Form = attrs.field(converter=Form)
    parts: tuple[str, ...]
    dtype: DType
    part_shapes: tuple[tuple[int, ...], ...]
    tile: tuple[int, int]
    block: int = -1  # weight block (the file's layer field); -1 for global tensors
    expert: int = -1
    part_dtypes: tuple[DType, ...] | None = None  # per part where they differ (a CONCAT of GGUF types); else None

    def part_dtype(self, i: int) -> DType:
        return self.part_dtypes[i] if self.part_dtypes else self.dtype

    @property
    def file_dtype(self) -> DType:
        """The type in the file's tensor table: MIXED for parts of different types (the header's packing entry
        lists them; the reader checks such a tensor's size against this plan, not the table's formula)."""
        return DType.MIXED if self.part_dtypes else self.dtype

    @property
    def layout(self) -> T.TileLayout:
        """Layout of the whole stream as one matrix (gate_up: of ONE of the pair)."""
        if self.form == Form.CONCAT:
            return self.concat.layout
        return T.TileLayout(self.dtype, *self.part_shapes[0], self.tile)

    @property
    def concat(self) -> T.ConcatLayout:
        return T.concat_layout(self.part_shapes, self.part_dtypes or self.dtype, self.tile)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape declared in the file (padded rows for fused streams)."""
        if self.form == Form.CONCAT:
            return (self.layout.rows_p, self.layout.cols)
        if self.form == Form.GATE_UP:
            return (2 * self.layout.rows_p, self.layout.cols)
        return self.part_shapes[0]

    @property
    def file_tile(self) -> tuple[int, int]:
        if self.form == Form.VECTOR:
            return (0, 0)
        if self.form == Form.ROWS:
            return (1, self.part_shapes[0][1])
        return self.tile

    @property
    def nbytes(self) -> int:
        if self.form == Form.VECTOR:
            return 4 * self.part_shapes[0][0]
        if self.form == Form.ROWS:
            r, c = self.part_shapes[0]
            return r * c * (2 if self.dtype == DType.F16 else 4)
        if self.form == Form.GATE_UP:
            return 2 * self.layout.nbytes
        return self.concat.nbytes if self.form == Form.CONCAT else self.layout.nbytes

    def to_json(self) -> dict:
        """The tensor's entry in the file header's 'packing' section."""
        out = {"form": str(self.form), "parts": list(self.parts), "part_shapes": [list(s) for s in self.part_shapes],
               "dtype": self.dtype.label}
        if self.part_dtypes:
            out["part_dtypes"] = [d.label for d in self.part_dtypes]
        return out

    def materialize(self, weights) -> np.ndarray:
        """The bytes to store (uint8, or f32 for vectors), built from the graph's (quantised) weights."""
        ws = [weights[p] for p in self.parts]
        if self.form == Form.VECTOR:
            return np.ascontiguousarray(dequantize(ws[0]), dtype=np.float32).reshape(-1)
        if self.form == Form.ROWS:
            npdt = np.float16 if self.dtype == DType.F16 else np.float32
            w = ws[0] if not isinstance(ws[0], (QTensor, B.BlockTensor)) else dequantize(ws[0])
            return np.ascontiguousarray(w, dtype=npdt).reshape(-1).view(np.uint8)
        if self.form == Form.CONCAT:
            return T.pack_concat(ws, self.part_dtypes or self.dtype, self.tile)[0]
        if self.form == Form.GATE_UP:
            return T.pack_gate_up(ws[0], ws[1], self.dtype, self.tile)
        return T.pack(ws[0], self.dtype, self.tile)

    def unpack_part(self, raw: np.ndarray, i: int):
        """Inverse of materialize for part i: a QTensor (Q4/Q8), a BlockTensor (a GGUF block type), else a float
        array (f16 kept as float16)."""
        shape = self.part_shapes[i]
        if self.form == Form.VECTOR:
            return np.array(raw, dtype=np.float32)
        if self.form == Form.ROWS:
            npdt = np.float16 if self.dtype == DType.F16 else np.float32
            return np.frombuffer(np.asarray(raw).tobytes(), npdt).reshape(shape).copy()
        rows, cols = shape
        if self.form == Form.CONCAT:
            cl = self.concat
            off, part = cl.byte_offsets[i], cl.parts[i]
            buf = raw[off : off + part.nbytes]
        elif self.form == Form.GATE_UP:
            L = self.layout
            buf = np.ascontiguousarray(raw.reshape(L.n_tile_rows, 2, L.tile_row_nbytes)[:, i]).reshape(-1)
        else:
            buf = raw
        dt = self.part_dtype(i)
        if B.is_block_type(dt):
            return T.unpack_blocks(buf, dt, rows, cols, self.tile)
        if dt in (DType.Q4, DType.Q8):
            return T.unpack_q(buf, dt, rows, cols, self.tile)
        out = T.unpack(buf, dt, rows, cols, self.tile)
        return out.astype(np.float16) if dt == DType.F16 else out
