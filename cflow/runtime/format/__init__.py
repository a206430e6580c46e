"""The .cflow/.vflow container format (docs/FORMAT.md) and its GGUF export.

    spec     constants, on-disk structs, size rules (MAGIC, VERSION, ALIGN, expected_nbytes, ...)
    writer   FileWriter: streams tensors into a container, publishes it atomically
    reader   FileReader: maps a container, validates it, hands out zero-copy views
    folios   the page cache under a mapping: 2 MiB folios asked for, a file cached in small ones mended at load
    summary  the text `cflow inspect` prints
    header   the header's schema: every field checked and bounded, the plan's size against the file, versions
    gguf     export_gguf: a graph's weights, bit-identical, as a GGUF file for llama.cpp
             (needs the optional `gguf` package; import cflow.runtime.format.gguf explicitly)
"""

from .reader import FileReader
from .spec import (
    ALIGN,
    BLOCK_SIZES,
    CRC_CHUNK,
    DTYPE_IDS,
    EXPERT_ENTRY,
    FLAG_VFLOW,
    FORMAT_NAME,
    KNOWN_FLAGS,
    LAYOUTS,
    MAGIC,
    MAX_DIM,
    MAX_ELEMENTS,
    MAX_ID,
    MAX_NAME,
    MAX_NDIM,
    MAX_TILE,
    MAX_TILE_COLS,
    MAX_TILE_ROWS,
    PLAN_VERSION,
    PREAMBLE,
    PREAMBLE_FIELDS,
    RANGE_ENTRY,
    TENSOR_ENTRY,
    TENSOR_FIELDS,
    VERSION,
    DType,
    NbytesHook,
    Range,
    TensorEntry,
    expected_nbytes,
    layout_flags,
    pad,
)
from .writer import FileWriter

__all__ = [
    "ALIGN", "BLOCK_SIZES", "CRC_CHUNK", "DTYPE_IDS", "EXPERT_ENTRY", "FLAG_VFLOW", "FORMAT_NAME",
    "KNOWN_FLAGS", "LAYOUTS", "MAGIC", "MAX_DIM", "MAX_ELEMENTS", "MAX_ID", "MAX_NAME", "MAX_NDIM", "MAX_TILE",
    "MAX_TILE_COLS", "MAX_TILE_ROWS", "PLAN_VERSION", "PREAMBLE", "PREAMBLE_FIELDS", "RANGE_ENTRY", "TENSOR_ENTRY",
    "TENSOR_FIELDS", "VERSION", "DType",
    "FileReader", "FileWriter", "NbytesHook", "Range", "TensorEntry", "expected_nbytes", "layout_flags", "pad",
]
