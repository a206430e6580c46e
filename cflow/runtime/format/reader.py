"""FileReader: maps a .cflow/.vflow container and validates its whole structure before any use.

Input: a path. Output: header dict, tensor table, zero-copy NumPy views of tensors and experts.
Every offset is checked against the mapped length first; any lie is a FormatError naming where.
"""

from __future__ import annotations

import bisect
import itertools
import json
import mmap
import os
import re
import struct
from typing import Self

import numpy as np

from cflow.errors import FormatError

from ...util import crc32
from . import spec as F
from .folios import Mended, advise_huge_pages, mend
from .spec import DType
from .summary import summarize


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON (strict JSON has no NaN or Infinity)")


def _finite_float(text: str) -> float:
    v = float(text)
    if v in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:40]} is out of the range of a double")
    return v


def strict_json(text: str):
    """json.loads as the writer's json.dumps(allow_nan=False) would accept: NaN, Infinity and numbers that
    overflow a double are errors (ValueError), not floats that break every range check downstream."""
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)


def _field_offsets(names: list[str], fmt: str) -> dict[str, int]:
    # Byte offset of each named field inside a struct, for error messages.
    out, pos = {}, 0
    codes = re.findall(r"\d*[a-zA-Z]", fmt.lstrip("<"))
    assert len(codes) == len(names)
    for name, code in zip(names, codes):
        out[name] = pos
        pos += struct.calcsize("<" + code)
    return out


_PRE_AT = _field_offsets(F.PREAMBLE_FIELDS, F.PREAMBLE.format)
_TEN_AT = _field_offsets(F.TENSOR_FIELDS, F.TENSOR_ENTRY.format)


class FileReader:
    """Read-only view of a container. Opening validates everything but data checksums (verify())."""

    def __init__(self, path, *, expected_nbytes: F.NbytesHook = F.expected_nbytes):
        self.path = os.fspath(path)
        self._expected_nbytes = expected_nbytes
        self.verified: str | None = None  # None = not run, "ok", or the first failure's message
        try:
            size = os.stat(self.path).st_size
        except OSError as e:
            raise FormatError(f"{self.path}: cannot open: {e.strerror}") from None
        if size < F.PREAMBLE.size:
            raise FormatError(f"{self.path}: preamble: file is {size} bytes, shorter than the "
                              f"{F.PREAMBLE.size}-byte preamble (truncated or not a cflow file)")
        try:
            with open(self.path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                st = os.fstat(f.fileno())
        except (OSError, ValueError) as e:
            raise FormatError(f"{self.path}: cannot map: {e}") from None
        advise_huge_pages(mm)
        self._mm, self._ident = mm, (st.st_dev, st.st_ino)  # the file mapped, whatever `path` names later
        # Plain ndarray views keep the mapping alive after close(); nothing is read yet.
        self._buf: np.ndarray | None = np.frombuffer(mm, np.uint8)
        self.file_size = len(self._buf)
        self._validate()

    # -- errors ----------------------------------------------------------------------------
    def _err(self, where: str, msg: str, at: int) -> FormatError:
        return FormatError(f"{self.path}: {where}: {msg} (file offset 0x{at:x})")

    def _bytes(self, off: int, n: int) -> bytes:
        # Only for already bounds-checked metadata regions.
        return self._buf[off : off + n].tobytes()

    # -- structural validation -------------------------------------------------------------
    def _validate(self) -> None:
        p = self._preamble()
        self.header = self._header(p)
        self.tensors = self._tensor_table(p)
        self._by_name = {t.name: t for t in self.tensors}
        self._experts = self._expert_table(p)

    def _preamble(self) -> dict:
        raw = self._bytes(0, F.PREAMBLE.size)
        p = dict(zip(F.PREAMBLE_FIELDS, F.PREAMBLE.unpack(raw)))

        def bad(field, msg):
            return self._err("preamble", f"{field}: {msg}", _PRE_AT[field])

        if p["magic"] != F.MAGIC:
            raise bad("magic", f"{p['magic']!r} is not {F.MAGIC!r}: not a .cflow/.vflow file")
        if p["version"] != F.VERSION:
            from cflow import __version__

            raise bad("version", f"compiled by a cflow of format {p['version']}; this is cflow {__version__} "
                                 f"(format {F.VERSION}): recompile with cflowc")
        if crc32(raw[:-4]) != p["preamble_crc"]:
            raise bad("preamble_crc", f"checksum 0x{p['preamble_crc']:08x} does not match the preamble "
                                      f"(0x{crc32(raw[:-4]):08x}): corrupt")
        if p["flags"] & ~F.KNOWN_FLAGS:
            raise bad("flags", f"unknown flag bits 0x{p['flags'] & ~F.KNOWN_FLAGS:x}")
        if p["align"] != F.ALIGN:
            raise bad("align", f"{p['align']} is not {F.ALIGN}")
        if p["preamble_size"] != F.PREAMBLE.size:
            raise bad("preamble_size", f"{p['preamble_size']} is not {F.PREAMBLE.size}")
        if p["reserved"] != bytes(len(p["reserved"])):
            raise bad("reserved", "not zero")
        if p["file_len"] != self.file_size:
            raise bad("file_len", f"0x{p['file_len']:x}, but the file is 0x{self.file_size:x} bytes "
                                  f"({'truncated' if self.file_size < p['file_len'] else 'trailing bytes'})")
        # Each check bounds the next: all offsets end up inside [0, file_size].
        if p["header_len"] > self.file_size - F.PREAMBLE.size:
            raise bad("header_len", f"{p['header_len']} exceeds the file size 0x{self.file_size:x}")
        if p["data_offset"] != F.pad(F.PREAMBLE.size + p["header_len"]):
            raise bad("data_offset", f"0x{p['data_offset']:x} is not pad(preamble + header_len) = "
                                     f"0x{F.pad(F.PREAMBLE.size + p['header_len']):x}")
        if p["data_len"] % F.ALIGN:
            raise bad("data_len", f"0x{p['data_len']:x} is not a multiple of {F.ALIGN}")
        if p["index_offset"] != p["data_offset"] + p["data_len"]:
            raise bad("index_offset", f"0x{p['index_offset']:x} is not data_offset + data_len = "
                                      f"0x{p['data_offset'] + p['data_len']:x}")
        if p["index_offset"] + p["index_len"] != self.file_size:
            raise bad("index_len", f"index 0x{p['index_offset']:x} + {p['index_len']} does not end at "
                                   f"the file size 0x{self.file_size:x}")
        want = (p["n_tensors"] * F.TENSOR_ENTRY.size + p["n_experts"] * F.EXPERT_ENTRY.size
                + p["n_ranges"] * F.RANGE_ENTRY.size + p["names_len"])
        if want != p["index_len"]:
            raise bad("index_len", f"{p['index_len']} does not match the counts (n_tensors {p['n_tensors']}, "
                                   f"n_experts {p['n_experts']}, n_ranges {p['n_ranges']}, "
                                   f"names_len {p['names_len']}: {want} bytes)")
        index = self._bytes(p["index_offset"], p["index_len"])
        if crc32(index) != p["index_crc"]:
            raise self._err("index", f"checksum mismatch: stored 0x{p['index_crc']:08x}, computed "
                                     f"0x{crc32(index):08x}", p["index_offset"])
        self.layout = "vflow" if p["flags"] & F.FLAG_VFLOW else "cflow"
        self.version = p["version"]
        self.data_offset, self.data_len = p["data_offset"], p["data_len"]
        self.index_offset, self.index_len = p["index_offset"], p["index_len"]
        self._index = index
        return p

    def _header(self, p: dict) -> dict:
        at, n = F.PREAMBLE.size, p["header_len"]
        raw = self._bytes(at, n)
        if crc32(raw) != p["header_crc"]:
            raise self._err("header", f"checksum mismatch: stored 0x{p['header_crc']:08x}, computed "
                                      f"0x{crc32(raw):08x}", at)
        try:
            header = strict_json(raw.decode("utf-8"))
        except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise self._err("header", f"not valid UTF-8 JSON: {str(e)[:200]}", at) from None
        if not isinstance(header, dict):
            raise self._err("header", f"must be a JSON object, got {type(header).__name__}", at)
        gap = self._buf[at + n : p["data_offset"]]
        if gap.any():
            raise self._err("header padding", "non-zero byte", at + n + int(np.flatnonzero(gap)[0]))
        return header

    def _tensor_table(self, p: dict) -> list[F.TensorEntry]:
        n, sz = p["n_tensors"], F.TENSOR_ENTRY.size
        names_at = n * sz + p["n_experts"] * F.EXPERT_ENTRY.size + p["n_ranges"] * F.RANGE_ENTRY.size
        pool = self._index[names_at:]
        out: list[F.TensorEntry] = []
        seen: dict[str, int] = {}
        prev_end = 0  # end of the previous tensor's padded slot, data-relative
        for i in range(n):
            eo = p["index_offset"] + i * sz
            v = F.TENSOR_ENTRY.unpack_from(self._index, i * sz)
            r = dict(zip(F.TENSOR_FIELDS, (v[0], v[1], v[2], v[3], v[4:8], v[8:10], *v[10:])))
            where = f"tensor table entry {i}"

            def bad(field, msg, where=where, eo=eo):  # `where` gains the name once it is known
                return self._err(where, f"{field} {msg}", eo + _TEN_AT[field])

            if not 1 <= r["name_len"] <= F.MAX_NAME or r["name_off"] + r["name_len"] > len(pool):
                raise bad("name_len", f"[{r['name_off']}, +{r['name_len']}) is outside the names pool "
                                      f"({len(pool)} bytes) or longer than {F.MAX_NAME}")
            try:
                name = pool[r["name_off"] : r["name_off"] + r["name_len"]].decode("utf-8")
            except UnicodeDecodeError:
                raise bad("name_off", "points at invalid UTF-8") from None
            if "\0" in name:
                raise bad("name_off", f"name {name!r} contains NUL")
            where = f"tensor table entry {i} ({name!r})"
            if name in seen:
                raise bad("name_off", f"duplicate name (also entry {seen[name]})", where)
            seen[name] = i
            if r["dtype"] not in F.DTYPE_IDS:
                raise bad("dtype", f"{r['dtype']} is not a known dtype id {sorted(F.DTYPE_IDS)}", where)
            dtype = DType(r["dtype"])
            if not 1 <= r["ndim"] <= F.MAX_NDIM:
                raise bad("ndim", f"{r['ndim']} not in 1..{F.MAX_NDIM}", where)
            shape, tile = r["shape"][: r["ndim"]], r["tile"]
            if any(r["shape"][r["ndim"] :]):
                raise bad("shape", f"{list(r['shape'])} has non-zero dims beyond ndim {r['ndim']}", where)
            try:
                want = self._expected_nbytes(dtype, shape, tile)
            except (ValueError, TypeError, OverflowError, KeyError) as e:
                raise bad("shape", f"{list(shape)} tile {tile} at {dtype.label}: {e}", where) from None
            if want >= 0 and r["nbytes"] != want:  # -1: a MIXED tensor, sized by the header's plan (check_plan)
                raise bad("nbytes", f"{r['nbytes']} is inconsistent with {dtype.label}{list(shape)} "
                                    f"tile {tile}: expected {want}", where)
            off, nb = r["offset"], r["nbytes"]
            if off % F.ALIGN:
                raise bad("offset", f"0x{off:x} is not a multiple of {F.ALIGN}", where)
            if off < prev_end:
                raise bad("offset", f"0x{off:x} overlaps the previous tensor's slot, which ends at "
                                    f"0x{prev_end:x} (entries must be in data order)", where)
            if off + F.pad(nb) > p["data_len"]:  # Python ints: no wrap-around
                raise bad("offset", f"0x{off:x} + nbytes {nb} (padded to 0x{F.pad(nb):x}) exceeds the "
                                    f"data section size 0x{p['data_len']:x}", where)
            prev_end = off + F.pad(nb)
            for field in ("stage", "layer", "expert"):
                if r[field] < -1:
                    raise bad(field, f"{r[field]} is negative (only -1 means none)", where)
            if r["expert"] >= 0 and r["layer"] < 0:
                raise bad("expert", f"{r['expert']} is set but layer is -1", where)
            out.append(F.TensorEntry(index=i, name=name, dtype=dtype, shape=tuple(shape), tile=tuple(tile),
                                     offset=off, nbytes=nb, stage=r["stage"], layer=r["layer"],
                                     expert=r["expert"], crc=r["crc"], file_offset=p["data_offset"] + off))
        return out

    def _expert_table(self, p: dict) -> dict[tuple[int, int], list[F.Range]]:
        base = p["n_tensors"] * F.TENSOR_ENTRY.size
        rbase = base + p["n_experts"] * F.EXPERT_ENTRY.size
        starts = [t.offset for t in self.tensors]  # ascending (checked above)
        experts: dict[tuple[int, int], list[F.Range]] = {}
        self._subranges: list[tuple[tuple[int, int], int, F.Range]] = []  # need their own verify pass
        used = 0
        prev = None
        for j in range(p["n_experts"]):
            eo = p["index_offset"] + base + j * F.EXPERT_ENTRY.size
            layer, expert, first, count = F.EXPERT_ENTRY.unpack_from(self._index, base + j * F.EXPERT_ENTRY.size)
            where = f"expert table entry {j} (layer {layer}, expert {expert})"
            if layer < 0 or expert < 0:
                raise self._err(where, "layer and expert must be >= 0", eo)
            if prev is not None and (layer, expert) <= prev:
                raise self._err(where, f"not after {prev}: entries must be sorted by (layer, expert), "
                                       "no duplicates", eo)
            prev = (layer, expert)
            if first != used or count < 1 or first + count > p["n_ranges"]:
                raise self._err(where, f"ranges [{first}, +{count}) must continue at {used} and stay within "
                                       f"the {p['n_ranges']} ranges", eo + 8)
            used += count
            ranges = []
            for k in range(first, first + count):
                ro = rbase + k * F.RANGE_ENTRY.size
                off, nb, crc, res = F.RANGE_ENTRY.unpack_from(self._index, ro)
                rwhere, rat = f"{where} range {k - first}", p["index_offset"] + ro
                if res:
                    raise self._err(rwhere, "reserved field is not zero", rat + 20)
                if off % F.ALIGN or nb < 1:
                    raise self._err(rwhere, f"offset 0x{off:x} must be a multiple of {F.ALIGN}, nbytes {nb} >= 1", rat)
                ti = bisect.bisect_right(starts, off) - 1
                t = self.tensors[ti] if ti >= 0 else None
                if t is None or off + nb > t.offset + t.nbytes:
                    raise self._err(rwhere, f"data bytes [0x{off:x}, +{nb}) are not inside one tensor", rat)
                if (t.layer, t.expert) != (layer, expert):
                    raise self._err(rwhere, f"lies in tensor {t.name!r} of layer {t.layer}, expert {t.expert}", rat)
                whole = off == t.offset and nb == t.nbytes
                if whole and crc != t.crc:
                    raise self._err(rwhere, f"crc 0x{crc:08x} differs from tensor {t.name!r}'s "
                                            f"0x{t.crc:08x}", rat + 16)
                rng = F.Range(p["data_offset"] + off, nb, crc)
                if not whole:
                    self._subranges.append(((layer, expert), k - first, rng))
                ranges.append(rng)
            experts[(layer, expert)] = ranges
        if used != p["n_ranges"]:
            raise self._err("expert table", f"{p['n_ranges'] - used} ranges belong to no expert",
                            p["index_offset"] + rbase + used * F.RANGE_ENTRY.size)
        flat = sorted(r for rs in experts.values() for r in rs)
        for a, b in itertools.pairwise(flat):
            if b.file_offset < a.file_offset + a.nbytes:
                raise self._err("expert table", f"ranges overlap at 0x{b.file_offset:x}", p["index_offset"] + rbase)
        tagged = {(t.layer, t.expert) for t in self.tensors if t.expert >= 0}
        missing = sorted(tagged - experts.keys())
        if missing:
            raise self._err("expert table", f"no entry for (layer, expert) {missing[0]} of the tensor table",
                            p["index_offset"] + base)
        return experts

    # -- access ----------------------------------------------------------------------------
    def _view(self, file_offset: int, nbytes: int) -> np.ndarray:
        """The single gate to data bytes (tests wrap it to see exactly what is touched)."""
        if self._buf is None:
            raise FormatError(f"{self.path}: reader is closed")
        return self._buf[file_offset : file_offset + nbytes]

    def entry(self, name: str) -> F.TensorEntry:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def tensor(self, name: str) -> np.ndarray:
        """Zero-copy read-only view: float32[n] for 1-D f32 vectors, else the stored bytes uint8[nbytes]."""
        t = self.entry(name)
        v = self._view(t.file_offset, t.nbytes)
        return v.view("<f4") if len(t.shape) == 1 else v

    @property
    def experts(self) -> list[tuple[int, int]]:
        """(layer, expert) pairs present in the expert table, sorted."""
        return list(self._experts)

    def expert_ranges(self, layer: int, expert: int) -> list[F.Range]:
        """Byte ranges of one expert: absolute file offsets (multiples of ALIGN), lengths, crc32s.
        For O_DIRECT, reading pad(nbytes) bytes from file_offset stays inside the expert's slot."""
        try:
            return list(self._experts[(layer, expert)])
        except KeyError:
            raise KeyError(f"{self.path}: no expert {expert} in layer {layer}") from None

    def read_expert(self, layer: int, expert: int, verify: bool = False) -> list[np.ndarray]:
        """Zero-copy views of exactly the expert's ranges; with verify, check each range's crc32."""
        out = []
        for k, r in enumerate(self.expert_ranges(layer, expert)):
            v = self._view(r.file_offset, r.nbytes)
            if verify:
                crc = _crc(v)
                if crc != r.crc:
                    raise self._err(f"layer {layer} expert {expert} range {k}",
                                    f"checksum mismatch: stored 0x{r.crc:08x}, computed 0x{crc:08x}", r.file_offset)
            out.append(v)
        return out

    def verify(self, progress=None) -> None:
        """Checksum every data byte: each tensor's crc32, zero padding, expert sub-ranges.

        progress(done_bytes, total_bytes) is called as it goes. Raises FormatError at the first fault.
        """
        total = self.data_len + sum(r.nbytes for _, _, r in self._subranges)
        done = 0

        def tick(n):
            nonlocal done
            done += n
            if progress is not None:
                progress(done, total)

        try:
            pos = self.data_offset  # absolute; everything in [pos, next tensor) must be zero
            prev = "data section start"
            for t in self.tensors:
                self._check_zero(pos, t.file_offset, prev)
                tick(t.file_offset - pos)
                crc = _crc(self._view(t.file_offset, t.nbytes), tick)
                if crc != t.crc:
                    raise self._err(f"tensor {t.index} ({t.name!r})", f"data checksum mismatch: stored "
                                    f"0x{t.crc:08x}, computed 0x{crc:08x} over {t.nbytes} bytes", t.file_offset)
                pos, prev = t.file_offset + t.nbytes, f"tensor {t.index} ({t.name!r})"
            self._check_zero(pos, self.index_offset, prev)
            tick(self.index_offset - pos)
            for (layer, expert), k, r in self._subranges:
                crc = _crc(self._view(r.file_offset, r.nbytes), tick)
                if crc != r.crc:
                    raise self._err(f"layer {layer} expert {expert} range {k}", f"checksum mismatch: stored "
                                    f"0x{r.crc:08x}, computed 0x{crc:08x}", r.file_offset)
        except FormatError as e:
            self.verified = str(e)
            raise
        self.verified = "ok"

    def _check_zero(self, start: int, end: int, after: str) -> None:
        for a in range(start, end, F.CRC_CHUNK):
            v = self._view(a, min(F.CRC_CHUNK, end - a))
            if v.any():
                raise self._err(f"data padding after {after}", "non-zero byte (padding must be zero)",
                                a + int(np.flatnonzero(v)[0]))

    def summary(self, table: bool = True) -> str:
        """Text for `cflow inspect`: layout, header, sizes per dtype/stage/layer, experts, checksums."""
        return summarize(self, table=table)

    def mend_folios(self) -> Mended:
        """Drop the parts of the file the page cache holds in small folios, to be read back in 2 MiB ones
        (folios.mend). For a file decode maps and reads whole; Session calls it at load."""
        if self._buf is None:
            raise FormatError(f"{self.path}: reader is closed")
        return mend(self._mm, self.path, self._ident)

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Drop the mapping; views handed out earlier stay valid until they are freed."""
        self._buf = None
        self._mm = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _crc(v: np.ndarray, tick=None) -> int:
    crc = 0
    for i in range(0, len(v), F.CRC_CHUNK):
        chunk = v[i : i + F.CRC_CHUNK]
        crc = crc32(chunk, crc)
        if tick is not None:
            tick(len(chunk))
    return crc
