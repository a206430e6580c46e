"""Shared helpers for the container-format tests: a small sample file and a field-level editor.

`write_sample(path)` writes a file with every kind of entry; `Container(blob)` parses one into
editable raw fields and `tobytes()` re-packs it with consistent lengths and fresh checksums, so a
test can plant one structured lie that gets past the checksums to the validator.
"""

from __future__ import annotations

import zlib
from typing import ClassVar

import numpy as np

from cflow.layout.quant import DType
from cflow.runtime.format import FileWriter
from cflow.runtime.format import spec as F

HEADER = {
    "config": {"d_model": 64, "n_layers": 2, "n_experts": 2, "top_k": 1},
    "delays": [1, 2],
    "quant": "q4",
    "tile": [32, 64],
    "schedule": [["attn", 0], ["ffn", 0]],
    "tokenizer": '{"model": {"vocab": {"a": 0, "b": 1}}}' * 50,
}


def sample_tensors(seed: int = 0):
    """(name, dtype, shape, data, kwargs) in data order: vectors, dense matrices, two experts per layer."""
    rng = np.random.default_rng(seed)

    def raw(dtype, shape, tile):
        return rng.integers(0, 256, F.expected_nbytes(dtype, shape, tile), dtype=np.uint8)

    out = [("tok_embeddings", DType.F16, (50, 64), raw(DType.F16, (50, 64), (1, 1)), {"tile": (1, 1)})]
    for layer in range(2):
        out.append((f"layers.{layer}.attn_norm", DType.F32, (64,), rng.standard_normal(64).astype(np.float32),
                    {"layer": layer, "stage": 2 * layer}))
        out.append((f"layers.{layer}.attn.wqkv", DType.Q4, (192, 64), raw(DType.Q4, (192, 64), (32, 64)),
                    {"tile": (32, 64), "layer": layer, "stage": 2 * layer}))
        for e in range(2):
            for part, shape in (("w13", (256, 64)), ("w2", (64, 128))):
                out.append((f"layers.{layer}.experts.{e}.{part}", DType.Q8, shape, raw(DType.Q8, shape, (32, 64)),
                            {"tile": (32, 64), "layer": layer, "expert": e, "stage": 2 * layer + 1}))
    out.append(("norm", DType.F32, (64,), np.ones(64, np.float32), {}))
    return out


def write_sample(path, layout=None, header=HEADER, seed: int = 0):
    tensors = sample_tensors(seed)
    with FileWriter(path, header, layout) as w:
        for name, dtype, shape, data, kw in tensors:
            w.add_tensor(name, dtype, shape, data, **kw)
    return tensors


class Container:
    """A container split into raw, editable fields (lists of ints), re-packable with valid crcs."""

    def __init__(self, blob: bytes):
        self.pre = dict(zip(F.PREAMBLE_FIELDS, F.PREAMBLE.unpack_from(blob)))
        p = self.pre
        self.header = blob[F.PREAMBLE.size : F.PREAMBLE.size + p["header_len"]]
        self.data = bytearray(blob[p["data_offset"] : p["index_offset"]])
        idx, pos = blob[p["index_offset"] :], 0
        self.tensors, self.experts, self.ranges = [], [], []
        for lst, st, n in ((self.tensors, F.TENSOR_ENTRY, p["n_tensors"]),
                           (self.experts, F.EXPERT_ENTRY, p["n_experts"]),
                           (self.ranges, F.RANGE_ENTRY, p["n_ranges"])):
            for _ in range(n):
                lst.append(list(st.unpack_from(idx, pos)))
                pos += st.size
        self.names = bytearray(idx[pos:])
        self.overrides: dict[str, object] = {}  # preamble fields forced after lengths are derived

    def tobytes(self, fix_crcs: bool = True) -> bytes:
        index = b"".join(
            [F.TENSOR_ENTRY.pack(*t) for t in self.tensors] + [F.EXPERT_ENTRY.pack(*e) for e in self.experts]
            + [F.RANGE_ENTRY.pack(*r) for r in self.ranges] + [bytes(self.names)])
        p = dict(self.pre)
        p.update(header_len=len(self.header), data_offset=F.pad(F.PREAMBLE.size + len(self.header)),
                 data_len=len(self.data), n_tensors=len(self.tensors), n_experts=len(self.experts),
                 n_ranges=len(self.ranges), names_len=len(self.names), index_len=len(index))
        p.update(index_offset=p["data_offset"] + p["data_len"])
        p.update(file_len=p["index_offset"] + len(index))
        if fix_crcs:
            p.update(header_crc=zlib.crc32(self.header), index_crc=zlib.crc32(index))
        p.update(self.overrides)
        pre = F.PREAMBLE.pack(*(p[f] for f in F.PREAMBLE_FIELDS))
        if fix_crcs and "preamble_crc" not in self.overrides:
            pre = pre[:-4] + zlib.crc32(pre[:-4]).to_bytes(4, "little")
        pad = bytes(F.pad(F.PREAMBLE.size + len(self.header)) - F.PREAMBLE.size - len(self.header))
        return pre + self.header + pad + bytes(self.data) + index

    # Column numbers of the raw tensor-entry list (shape and tile are flattened).
    T: ClassVar[dict[str, int]] = {
        "name_off": 0, "name_len": 1, "dtype": 2, "ndim": 3, "shape0": 4, "shape1": 5, "shape2": 6, "shape3": 7,
        "tile0": 8, "tile1": 9, "offset": 10, "nbytes": 11, "stage": 12, "layer": 13, "expert": 14, "crc": 15,
    }
