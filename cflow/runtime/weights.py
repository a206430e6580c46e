"""The weights of a compiled file seen as IR weights (lazy, read from the mapped tiles).

`CompiledModel.ir` uses this mapping, so the NumPy interpreter runs on exactly the stored numbers.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..ir.quant import BLOCK, DType, QTensor
from ..passes import tile as T


def unpack_qtensor(buf: np.ndarray, dtype: DType, rows: int, cols: int, tile) -> QTensor:
    """Inverse of tile.pack for Q4/Q8: the stored codes and fp16 scales as a QTensor (padding dropped)."""
    L = T.TileLayout(dtype, rows, cols, tile)
    nT, nC, ng, nb = L.n_tile_rows, L.n_tile_cols, L.groups_per_tile, L.blocks_per_tile
    g = np.asarray(buf, np.uint8).reshape(nT, nC, ng, L.group_nbytes)
    sc = np.ascontiguousarray(g[..., L.scales_offset:]).view(np.float16).reshape(nT, nC, ng, nb, T.GROUP_ROWS)
    sc = sc.transpose(0, 2, 4, 1, 3).reshape(L.rows_p, L.cols_p // BLOCK)
    codes = g[..., : L.scales_offset]
    if dtype == DType.Q4:
        c = codes.reshape(nT, nC, ng, nb, 4, T.GROUP_ROWS, 4)
        q = np.concatenate([c & np.uint8(15), c >> np.uint8(4)], axis=4)  # [.., b, 8, i, j]
    else:
        q = np.ascontiguousarray(codes).view(np.int8).reshape(nT, nC, ng, nb, 8, T.GROUP_ROWS, 4)
    q = q.transpose(0, 2, 5, 1, 3, 4, 6).reshape(L.rows_p, L.cols_p // BLOCK, BLOCK)
    nblk = -(-cols // BLOCK)
    return QTensor(dtype=dtype, rows=rows, cols=cols, scales=np.ascontiguousarray(sc[:rows, :nblk]),
                   q=np.ascontiguousarray(q[:rows, :nblk]))


class FileWeights(Mapping):
    """IR weight name -> stored weight (QTensor for Q4/Q8, float array otherwise), unpacked on access."""

    def __init__(self, reader, tensors: dict):
        self.reader = reader
        self.where: dict[str, tuple] = {}
        for t in tensors.values():
            for i, part in enumerate(t.parts):
                self.where[part] = (t, i)

    def __iter__(self):
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)

    def __getitem__(self, name: str):
        t, i = self.where[name]
        raw = self.reader.tensor(t.name)
        shape = t.part_shapes[i]
        if t.form == "vector":
            return np.array(raw, dtype=np.float32)
        if t.form == "rows":
            npdt = np.float16 if t.dtype == DType.F16 else np.float32
            return np.frombuffer(raw.tobytes(), npdt).reshape(shape).copy()
        rows, cols = shape
        if t.form == "concat":
            cl = t.concat
            off, part = cl.byte_offsets[i], cl.parts[i]
            buf = raw[off: off + part.nbytes]
        elif t.form == "gate_up":
            L = t.layout
            buf = np.ascontiguousarray(raw.reshape(L.n_tile_rows, 2, L.tile_row_nbytes)[:, i]).reshape(-1)
        else:
            buf = raw
        if t.dtype in (DType.Q4, DType.Q8):
            return unpack_qtensor(buf, t.dtype, rows, cols, t.tile)
        out = T.unpack(buf, t.dtype, rows, cols, t.tile)
        return out.astype(np.float16) if t.dtype == DType.F16 else out
