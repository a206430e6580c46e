"""The .cflow/.vflow container: constants, on-disk structs and size rules shared by writer and reader.

Input: nothing (pure definitions). Output: MAGIC, VERSION, ALIGN, struct layouts, `expected_nbytes`.
The spec in prose is docs/FORMAT.md; keep the two in step. Imports nothing of reader/writer (no cycle).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import NamedTuple

import attrs

from cflow.layout.blocks import is_block_type

# dtype ids are DType's values and block sizes BLOCK_SIZES' (elems, bytes): re-exported so every
# format constant is reachable from this one module.
from cflow.layout.packed import FileLayout
from cflow.layout.quant import BLOCK, BLOCK_SIZES, DType, matrix_bytes, padded  # noqa: F401
from cflow.layout.tile import MAX_TILE_COLS, MAX_TILE_ROWS  # noqa: F401  (a model's tile bounds: tile_problem)

# PNG-style magic: the high-bit first byte catches 7-bit transfers, "\r\n" catches newline
# translation. Both layouts share it; the layout is a preamble flag.
MAGIC = b"\x89CFLOW\r\n"
VERSION = 1  # bumped only for a structural change; readers reject any other version
# The version of the plan a config implies (packing forms, schedule, file order: passes/pack.py, schedule.py,
# order.py). Bump it with any change that makes the plan re-derived from an existing file's config differ from
# the one in its header: such files then fail with "compiled by cflow X (format N, plan P); recompile with
# cflowc" rather than a bare mismatch (tests/runtime/test_golden.py notices the change).
PLAN_VERSION = 1
FORMAT_NAME = "cflow"  # the header's "format" field
ALIGN = 4096  # every tensor starts at a multiple of this (data-relative and absolute): O_DIRECT
assert ALIGN & (ALIGN - 1) == 0, "ALIGN must be a power of two"

LAYOUTS = tuple(str(x) for x in FileLayout)  # flag bit 0: 0 = cflow (layer-major), 1 = vflow (stage-major)
FLAG_VFLOW = 1
KNOWN_FLAGS = FLAG_VFLOW

# Limits a well-formed file never reaches; they keep every product far below 2**63 so sizes
# stay valid int64 in native code.
MAX_NDIM = 4
MAX_DIM = 2**31 - 1
MAX_ELEMENTS = 2**48
MAX_TILE = 2**20
MAX_NAME = 1024  # bytes of UTF-8
MAX_ID = 2**31 - 1  # layer, expert, stage: -1 (none) .. MAX_ID
DTYPE_IDS = {int(d) for d in DType}

# NOTE: "<" everywhere: little-endian, no implicit padding. Sizes are asserted below.
PREAMBLE = struct.Struct(
    "<8s"  # magic
    "I"  # version
    "I"  # flags (bit 0: vflow)
    "I"  # align (== ALIGN)
    "I"  # preamble_size (== PREAMBLE.size)
    "Q"  # header_len: bytes of UTF-8 JSON at [PREAMBLE.size, PREAMBLE.size + header_len)
    "Q"  # data_offset == pad(PREAMBLE.size + header_len)
    "Q"  # data_len: multiple of ALIGN
    "Q"  # index_offset == data_offset + data_len
    "Q"  # index_len == the sum of the four index arrays
    "Q"  # file_len == index_offset + index_len == the file's size
    "I"  # n_tensors
    "I"  # n_experts
    "I"  # n_ranges
    "I"  # names_len
    "I"  # header_crc: crc32 of the header bytes
    "I"  # index_crc: crc32 of the whole index
    "28s"  # reserved, zero
    "I"  # preamble_crc: crc32 of the 124 bytes before it
)
assert PREAMBLE.size == 128
PREAMBLE_FIELDS = [
    "magic", "version", "flags", "align", "preamble_size", "header_len", "data_offset", "data_len", "index_offset",
    "index_len", "file_len", "n_tensors", "n_experts", "n_ranges", "names_len", "header_crc", "index_crc", "reserved",
    "preamble_crc",
]

TENSOR_ENTRY = struct.Struct(
    "<I"  # name_off: into the names pool
    "I"  # name_len
    "I"  # dtype (DType id)
    "I"  # ndim 1..4
    "4Q"  # shape, unused dims 0
    "2I"  # tile rows, tile cols; (0, 0) for 1-D
    "Q"  # offset, relative to the data section
    "Q"  # nbytes
    "i"  # stage (-1 = none)
    "i"  # layer (-1 = none)
    "i"  # expert (-1 = dense)
    "I"  # crc32 of the nbytes data bytes
)
assert TENSOR_ENTRY.size == 4 * 4 + 4 * 8 + 2 * 4 + 2 * 8 + 4 * 4 == 88
TENSOR_FIELDS = [
    "name_off", "name_len", "dtype", "ndim", "shape", "tile", "offset", "nbytes", "stage", "layer", "expert", "crc",
]

EXPERT_ENTRY = struct.Struct("<iiII")  # layer, expert, first_range, n_ranges
assert EXPERT_ENTRY.size == 16

RANGE_ENTRY = struct.Struct("<QQII")  # offset (data-relative), nbytes, crc32, reserved (0)
assert RANGE_ENTRY.size == 24

CRC_CHUNK = 64 << 20  # checksum in 64 MiB steps: bounded latency per call, progress reports


def pad(n: int, align: int = ALIGN) -> int:
    """Smallest multiple of `align` >= n (the padding formula of every section)."""
    return -(-n // align) * align


def layout_flags(layout: str) -> int:
    """The preamble flags of a layout (FileLayout.parse raises ValueError for anything else)."""
    return FLAG_VFLOW if FileLayout.parse(layout) == FileLayout.VFLOW else 0


def expected_nbytes(dtype: DType, shape: tuple[int, ...], tile: tuple[int, int]) -> int:
    """Stored bytes of a tensor. Raises ValueError for a combination the format does not allow.

    1-D tensors (norm weights, biases) are plain f32 vectors, tile (0, 0). Tensors of >= 2 dims are
    tiled matrices: the last two dims padded to whole tiles (rows to tile rows, cols to tile cols),
    then blocks of `dtype`; leading dims (stacked matrices) multiply.
    """
    dtype = DType(dtype)
    if not 1 <= len(shape) <= MAX_NDIM:
        raise ValueError(f"ndim {len(shape)} not in 1..{MAX_NDIM}")
    if any(not 1 <= d <= MAX_DIM for d in shape):
        raise ValueError(f"shape {tuple(shape)} has a dim outside 1..{MAX_DIM}")
    if math.prod(shape) > MAX_ELEMENTS:
        raise ValueError(f"shape {tuple(shape)} has more than 2**48 elements")
    tr, tc = tile
    if len(shape) == 1:
        if dtype != DType.F32:
            raise ValueError(f"1-D tensors are f32 vectors, got {dtype.label}")
        if (tr, tc) != (0, 0):
            raise ValueError(f"1-D tensors have tile (0, 0), got ({tr}, {tc})")
        return 4 * shape[0]
    if not (1 <= tr <= MAX_TILE and 1 <= tc <= MAX_TILE):
        raise ValueError(f"tile ({tr}, {tc}) has a dim outside 1..{MAX_TILE}")
    *lead, rows, cols = shape
    if dtype == DType.MIXED:
        return -1  # parts of different types: sized by the header's packing plan (check_plan), not here
    qk = BLOCK_SIZES[dtype][0]
    if qk > BLOCK or is_block_type(dtype):  # a GGUF block type: tiles widen to whole blocks (layout/tile.py)
        tc = math.lcm(tc, qk)
    return math.prod(lead) * matrix_bytes(padded(rows, tr), padded(cols, tc), dtype)


NbytesHook = Callable[[DType, tuple, tuple], int]


@attrs.frozen
class TensorEntry:
    """One row of the tensor table. `offset` is data-relative; `file_offset` is absolute."""

    index: int
    name: str
    dtype: DType
    shape: tuple[int, ...]
    tile: tuple[int, int]
    offset: int
    nbytes: int
    stage: int
    layer: int
    expert: int
    crc: int
    file_offset: int


class Range(NamedTuple):
    """One byte range of an expert: absolute file offset (multiple of ALIGN), length, crc32."""

    file_offset: int
    nbytes: int
    crc: int

