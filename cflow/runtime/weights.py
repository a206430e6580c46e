"""The weights of a compiled file seen as IR weights (lazy, read from the mapped tiles).

`CompiledModel.ir` uses this mapping, so the NumPy interpreter runs on exactly the stored numbers.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..layout.packed import PackedTensor


class FileWeights(Mapping):
    """IR weight name -> stored weight (QTensor for Q4/Q8, float array otherwise), unpacked on access."""

    def __init__(self, reader, tensors: dict[str, PackedTensor]):
        self.reader = reader
        self.where: dict[str, tuple[PackedTensor, int]] = {}
        for t in tensors.values():
            for i, part in enumerate(t.parts):
                self.where[part] = (t, i)

    def __iter__(self):
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)

    def __getitem__(self, name: str):
        t, i = self.where[name]
        return t.unpack_part(self.reader.tensor(t.name), i)
