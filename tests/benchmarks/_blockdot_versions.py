"""Another version of codegen/blockdot.py for the benchmarks that compare two: the tree's, without Q3_K's integer
combine of its sub-blocks (other IR for Q3_K, the same for every other type)."""

from pathlib import Path

from cflow.codegen import blockdot

_Q3K = "    int_combine = True\n\n    def chunk(self, j, c):\n        n, q = divmod(j, 4)\n        b = self.b\n"


def without_q3k_combine(path: Path) -> Path:
    src = Path(blockdot.__file__).read_text()
    assert src.count(_Q3K) == 1  # the Q3_K decoder's integer combine, as the tree writes it
    path.write_text(src.replace(_Q3K, _Q3K.replace("True", "False")))
    return path
