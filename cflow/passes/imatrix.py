"""Importance matrices: per weight matrix, the mean square of each input column over calibration text.

    collect(graph, ids, n_ctx)        run the reference interpreter (float32, exact) over chunks of n_ctx tokens,
                                      each from an empty cache, and accumulate sum x_j^2 per matrix input column
    write_dat(im, path) / read(path)  llama.cpp's imatrix files: the legacy binary .dat (written and read) and the
                                      GGUF imatrix (read), tensors named as GGUF names them (ir/gguf_names.py)
    im.for_graph(graph, path)         the matrix by IR weight name, checked against the model (names and widths)

What llama-imatrix holds is the same quantity: for a matrix W [out, in] read as W x, the mean over its input
rows of x_j^2 (experts: over the tokens routed to each). The quantisers (layout/quantize_blocks.py) weigh each
weight's squared error by it: sum_j imatrix_j (w_j - w'_j)^2 is the expected squared output error.
"""

from __future__ import annotations

import re
import struct

import attrs
import numpy as np

from ..errors import CflowError
from ..ir.gguf_names import BLOCK_TENSORS, EXPERT_TENSORS, GLOBAL_TENSORS
from ..ir.interp import Interpreter

GGUF_MAGIC = b"GGUF"
_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_EXPERT = re.compile(r"moe\.experts\.(\d+)\.(w_gate|w_up|w_down)")


@attrs.define
class ImportanceMatrix:
    """IR weight name -> mean x_j^2 per input column (float32 [cols]); counts: the input rows each saw."""

    values: dict[str, np.ndarray]
    counts: dict[str, int]
    chunks: int = 0
    dataset: str = ""
    # name -> mean x x^T [cols, cols] float64 (collect(grams=True) only; not in the files): one array per input,
    # shared by the matrices that read it (q, k, v; gate, up). What passes/gptq.py feeds errors forward with.
    grams: dict[str, np.ndarray] = attrs.field(factory=dict)

    def for_graph(self, graph, source: str = "the importance matrix") -> dict[str, np.ndarray]:
        """The values of every matrix of `graph` the file covers; CflowError if it names a tensor the model does not
        have, or one of another width (a matrix of another model)."""
        shapes = graph.meta.shapes
        out = {}
        for name, v in self.values.items():
            shape = shapes.get(name)
            if shape is None or len(shape) != 2:
                raise CflowError(f"{source}: tensor {gguf_name(name)[0]!r} is not a matrix of {graph.name} "
                                 "(an importance matrix of another model?)")
            if v.shape != (shape[1],):
                raise CflowError(f"{source}: tensor {gguf_name(name)[0]!r} has {v.size} values, {graph.name}'s has "
                                 f"{shape[1]} inputs (an importance matrix of another model?)")
            out[name] = v
        if not out:
            raise CflowError(f"{source}: no tensor of {graph.name} in it")
        return out


class _Collector(Interpreter):
    """The interpreter, summing x^2 per input column of every matrix it multiplies."""

    def __init__(self, graph, max_seq_len: int, gram_bytes: int = 0):
        super().__init__(graph, max_seq_len=max_seq_len)
        self.sums: dict[str, np.ndarray] = {}
        self.rows: dict[str, int] = {}
        self.grams: dict[str, np.ndarray] | None = {} if gram_bytes else None
        self.gram_room = gram_bytes  # bytes left for new grams; a matrix that finds none keeps its diagonal only
        self.no_gram = _without_gram(graph, gram_bytes)
        self._last = (None, None)  # (the input array last multiplied, its gram's owner): q, k, v share one x

    def matvec(self, x, name, point=()):
        x64 = np.asarray(x, np.float64)
        s = self.sums.get(name)
        sq = (x64 * x64).sum(0)
        self.sums[name] = sq if s is None else s + sq
        self.rows[name] = self.rows.get(name, 0) + x.shape[0]
        if self.grams is not None and x.ndim == 2 and x.shape[0] and name not in self.no_gram:
            last, owner = self._last
            if last is x and owner is not None:  # the input of the matrix before (q, k, v): its gram serves both
                self.grams.setdefault(name, self.grams[owner])
            else:
                owner, g = None, self.grams.get(name)
                if g is None and 8 * x.shape[1] ** 2 > self.gram_room:
                    self.no_gram.add(name)
                else:
                    if g is None:
                        g = self.grams[name] = np.zeros((x.shape[1], x.shape[1]))
                        self.gram_room -= g.nbytes
                    g += x64.T @ x64
                    owner = name
                self._last = (x, owner)
        return super().matvec(x, name, point)


def _without_gram(graph, budget: int) -> set[str]:
    """The matrices left without a second moment: the narrowest inputs get one first (most matrices per byte), each
    counted whole as if none shared its input (q, k, v do: the budget is then not all used)."""
    shapes = sorted((s[1], n) for n, s in graph.meta.shapes.items() if len(s) == 2)
    out = set()
    for cols, name in shapes:
        if 8 * cols * cols <= budget:
            budget -= 8 * cols * cols
        else:
            out.add(name)
    return out


def min_tokens(n_ctx: int) -> int:
    return n_ctx


def collect(graph, ids, n_ctx: int, n_chunks: int | None = None, bos: int | None = None, dataset: str = "",
            progress=None, gram_bytes: int = 0) -> ImportanceMatrix:
    """Importance matrix of `graph` over token ids, in chunks of n_ctx tokens from an empty cache (bos: put first in
    each chunk, as llama-imatrix does); gram_bytes > 0: also each matrix's mean x x^T, in graph order while they fit
    in that many bytes (float64, one per distinct input). CflowError when the text holds no whole chunk."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    if n_ctx < 2 or n_ctx > graph.config.max_seq_len:
        raise CflowError(f"--imatrix-ctx {n_ctx}: must be 2..{graph.config.max_seq_len} (the model's context)")
    if ids.size < min_tokens(n_ctx):
        raise CflowError(f"calibration text {dataset or ''}: {ids.size} tokens, an importance matrix needs at least "
                         f"{min_tokens(n_ctx)} (one chunk of --imatrix-ctx {n_ctx}): give more text")
    total = ids.size // n_ctx if n_chunks is None else min(n_chunks, ids.size // n_ctx)
    run = _Collector(graph, n_ctx, gram_bytes)
    for c in range(total):
        chunk = ids[c * n_ctx : (c + 1) * n_ctx].copy()
        if bos is not None:
            chunk[0] = bos
        run.reset()
        run.run(chunk)
        if progress is not None:
            progress(c + 1, total)
    values = {n: (s / max(run.rows[n], 1)).astype(np.float32) for n, s in run.sums.items()}
    means: dict[int, np.ndarray] = {}  # one mean per shared sum
    for n, g in (run.grams or {}).items():
        if id(g) not in means:
            means[id(g)] = g / max(run.rows[n], 1)
    gram_means = {n: means[id(g)] for n, g in (run.grams or {}).items()}
    return ImportanceMatrix(values=values, counts=dict(run.rows), chunks=total, dataset=dataset, grams=gram_means)


# --- names ------------------------------------------------------------------------------------------------------
def gguf_name(name: str) -> tuple[str, int | None]:
    """IR weight -> (its GGUF tensor name, expert index within a stacked _exps tensor or None)."""
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name], None
    m = _BLOCK.fullmatch(name)
    if m:
        layer, rest = m.groups()
        if rest in BLOCK_TENSORS:
            return f"blk.{layer}.{BLOCK_TENSORS[rest]}", None
        e = _EXPERT.fullmatch(rest)
        if e:
            return f"blk.{layer}.{EXPERT_TENSORS[e.group(2)]}", int(e.group(1))
    return name, None


def _ir_names(graph) -> dict[str, list[str]]:
    """GGUF tensor name -> the IR matrices it holds (one, or every expert in order)."""
    out: dict[str, list[tuple[int, str]]] = {}
    for n, s in graph.meta.shapes.items():
        if len(s) == 2:
            g, e = gguf_name(n)
            out.setdefault(g, []).append((e or 0, n))
    return {g: [n for _, n in sorted(v)] for g, v in out.items()}


# --- files ------------------------------------------------------------------------------------------------------
def write_dat(im: ImportanceMatrix, path) -> None:
    """llama.cpp's legacy imatrix file: count; per tensor name, ncall, nval, float32 values (mean x^2 * ncall, so
    llama-quantize's division by ncall gives the mean); then the chunk count and the dataset name."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for n in im.values:
        g, e = gguf_name(n)
        groups.setdefault(g, []).append((e or 0, n))
    ncall = max(im.chunks, 1)
    with open(path, "wb") as f:
        f.write(struct.pack("<i", len(groups)))
        for g, members in groups.items():
            vals = np.concatenate([np.where(im.counts.get(n, 1) > 0, im.values[n], 1.0) for _, n in sorted(members)])
            name = g.encode()
            f.write(struct.pack("<i", len(name)) + name + struct.pack("<ii", ncall, vals.size))
            f.write((vals.astype(np.float32) * ncall).astype("<f4").tobytes())
        ds = im.dataset.encode()
        f.write(struct.pack("<i", im.chunks) + struct.pack("<i", len(ds)) + ds)


def _read_dat(data: bytes, path) -> tuple[dict[str, np.ndarray], dict[str, int], int, str]:
    def bad(what):
        return CflowError(f"{path}: not an importance matrix file ({what})")

    off = 0

    def take(n):
        nonlocal off
        if off + n > len(data):
            raise bad("truncated")
        b = data[off : off + n]
        off += n
        return b

    (count,) = struct.unpack("<i", take(4))
    if not 0 < count < 1 << 20:
        raise bad(f"{count} entries")
    values, counts = {}, {}
    for _ in range(count):
        (ln,) = struct.unpack("<i", take(4))
        if not 0 < ln < 4096:
            raise bad(f"a name of {ln} bytes")
        name = take(ln).decode("utf-8", "replace")
        ncall, nval = struct.unpack("<ii", take(8))
        if nval < 0:
            raise bad(f"{nval} values for {name}")
        v = np.frombuffer(take(4 * nval), "<f4").astype(np.float32)
        values[name] = v / ncall if ncall > 0 else v
        counts[name] = ncall
    chunks, dataset = 0, ""
    if off + 4 <= len(data):
        (chunks,) = struct.unpack("<i", take(4))
        if off + 4 <= len(data):
            (ln,) = struct.unpack("<i", take(4))
            dataset = data[off : off + max(ln, 0)].decode("utf-8", "replace")
    return values, counts, chunks, dataset


def _read_gguf(path) -> tuple[dict[str, np.ndarray], dict[str, int], int, str]:
    try:
        from gguf import GGUFReader
    except ImportError:
        raise CflowError(f"{path}: a GGUF imatrix file needs the gguf package (pip install gguf)") from None
    r = GGUFReader(path)
    t = {x.name: np.asarray(x.data, np.float32).reshape(-1) for x in r.tensors}
    values, counts = {}, {}
    for name, s2 in t.items():
        if not name.endswith(".in_sum2"):
            continue
        base = name.removesuffix(".in_sum2")
        c = t.get(base + ".counts")
        if c is None or c.size == 0 or s2.size % c.size:
            raise CflowError(f"{path}: tensor {base} has no matching .counts")
        per = s2.size // c.size
        values[base] = (s2.reshape(c.size, per) / np.maximum(c, 1)[:, None]).reshape(-1).astype(np.float32)
        counts[base] = int(c.max())
    if not values:
        raise CflowError(f"--imatrix {path}: a GGUF file without importance-matrix tensors (*.in_sum2): not an "
                         "imatrix file")
    fields = {f.name: f for f in r.fields.values()}
    chunks = int(fields["imatrix.chunk_count"].contents()) if "imatrix.chunk_count" in fields else 0
    return values, counts, chunks, ""


def read(path, graph) -> ImportanceMatrix:
    """An imatrix file (legacy .dat or GGUF) as the IR weights of `graph`; CflowError if it is not one of its
    matrices (names or widths)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CflowError(f"--imatrix {path}: cannot read ({e.strerror})") from None
    values, counts, chunks, dataset = _read_gguf(path) if data[:4] == GGUF_MAGIC else _read_dat(data, path)
    names = _ir_names(graph)
    out_v, out_c = {}, {}
    for g, v in values.items():
        members = names.get(g)
        if members is None:
            raise CflowError(f"--imatrix {path}: tensor {g!r} is not in {graph.name} (an importance matrix of another "
                             "model?)")
        if v.size % len(members):
            raise CflowError(f"--imatrix {path}: tensor {g!r} has {v.size} values, {graph.name}'s has "
                             f"{graph.meta.shapes[members[0]][1]} inputs (an importance matrix of another model?)")
        for n, part in zip(members, np.split(v, len(members))):
            out_v[n], out_c[n] = part, counts[g]
    im = ImportanceMatrix(values=out_v, counts=out_c, chunks=chunks, dataset=dataset)
    im.for_graph(graph, f"--imatrix {path}")  # widths
    return im
