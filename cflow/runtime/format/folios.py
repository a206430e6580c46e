"""The page cache under a mapped model file: 2 MiB folios, and mending a file cached in small ones.

A file's cached pages come in 2 MiB folios when a mapping with MADV_HUGEPAGE faults them in from disk (ext4 keeps
large folios since Linux 6.16, XFS earlier), and such a folio is mapped by one PMD entry: one TLB entry per 2 MiB.
Pages cached any other way keep small folios for as long as they stay cached: pages written by a process (a copy,
or FileWriter before its drop), and, after memory pressure reclaimed part of a file, every page read back into
the holes (a 2 MiB folio needs its whole aligned range free). On an AMX Xeon TinyLlama Q4 decoded 1.07-1.08x
faster from a PMD-mapped file (benchmarks/pages.py) and a peers run fell from ~80% to 69-70% of the read bandwidth
with a quarter of its file back in small folios (docs/journal/performance.md, "A third host kind").

    advise_huge_pages(mm)   ask for 2 MiB folios on a mapping (FileReader does, for every file)
    drop_cached(path)       drop a file from the page cache (FileWriter does, after its commit)
    survey(mm)              which 2 MiB chunks of a mapping are cached, and in which folio size
    mend(mm, path, ident)   drop the chunks cached in small folios, once a probe shows they come back large
                            (Session does at load, unless CFLOW_FOLIOS=keep)

The survey reads only what the kernel already holds: mincore(2) says which pages are cached, and one byte touched
in each cached chunk maps a 2 MiB folio whole (a PMD) but a small one only around the touched page (fault-around,
64 KiB), so /proc/self/pagemap's present bit on the chunk's last page tells the two apart. No disk reads:
7-13 ms for a 680 MiB file here (benchmarks/pages.py --report). MADV_COLLAPSE, which would rebuild the folios in
place, returned EINVAL for a regular file on that host, hence dropping and reading back.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import itertools
import mmap
import os

import attrs
import numpy as np

from cflow.util import read_int, switched_off

HUGE = 2 << 20  # a PMD-mapped folio, x86-64 with 4 KiB pages (other sizes: not surveyed)
PAGE = mmap.PAGESIZE
THP = "/sys/kernel/mm/transparent_hugepage"
_no_large: set[int] = set()  # devices whose probe came back small: not probed again by this process
_PRESENT = 1 << 63  # /proc/PID/pagemap entry: the page is mapped (readable without privileges)


def advise_huge_pages(mm: mmap.mmap) -> None:
    """Ask for transparent huge pages on a file mapping (MADV_HUGEPAGE): where the file system keeps large folios,
    pages faulted in from disk then come in 2 MiB folios. Pages already cached keep their folio size (mend).
    Systems without the advice (no THP, not Linux) keep ordinary pages, which is harmless."""
    with contextlib.suppress(AttributeError, OSError, ValueError):
        mm.madvise(mmap.MADV_HUGEPAGE)


def drop_cached(path, offset: int = 0, length: int = 0, ident: tuple[int, int] | None = None) -> None:
    """Drop a file's clean, unmapped pages from the page cache (all of it by default). With ident (st_dev,
    st_ino), only if `path` is still that file (a file replaced since it was mapped keeps its cache). Best effort:
    a file system or platform without the advice keeps its cache."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        st = os.fstat(fd)
        if ident is None or (st.st_dev, st.st_ino) == tuple(ident):
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass
    finally:
        os.close(fd)


@attrs.frozen
class Survey:
    """Whole 2 MiB chunks of a mapping (the tail past the last whole chunk cannot be one folio) by cache state."""

    chunks: int
    huge: tuple[int, ...]  # cached, in one 2 MiB folio (PMD-mapped)
    small: tuple[int, ...]  # cached in part, or whole in small folios

    def __str__(self) -> str:
        mib = HUGE >> 20
        return (f"{len(self.huge) * mib} MiB in 2 MiB folios, {len(self.small) * mib} MiB in small folios, "
                f"{(self.chunks - len(self.huge) - len(self.small)) * mib} MiB not cached")


@attrs.frozen
class Mended:
    """What mend() found and did."""

    before: Survey | None  # None: not surveyed (reason says why)
    dropped: int = 0  # chunks that left the page cache, to be read back in 2 MiB folios
    reason: str = ""  # why small chunks were kept, or why nothing was surveyed

    def __str__(self) -> str:
        if self.before is None:
            return f"page cache not surveyed ({self.reason})"
        s = f"page cache: {self.before}"
        if self.dropped:
            s += f"; dropped {self.dropped * (HUGE >> 20)} MiB to read back in 2 MiB folios"
        if self.reason:
            s += f"; {self.reason}"
        return s


def mend_folios_enabled() -> bool:
    """False when CFLOW_FOLIOS is keep (or off, 0, no, false): loads leave the page cache as they find it
    (benchmarks/pages.py times such a file)."""
    return not switched_off("CFLOW_FOLIOS", "keep")


@functools.cache
def _mincore():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    f = getattr(libc, "mincore", None)
    if f is not None:
        f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        f.restype = ctypes.c_int
    return f


def _unsupported(mm: mmap.mmap) -> str:
    """Why no chunk of this mapping could be a PMD-mapped 2 MiB folio ('' when one could)."""
    if len(mm) < HUGE:
        return "file shorter than one 2 MiB chunk"
    if PAGE != 4096:
        return f"{PAGE}-byte pages"
    try:
        with open(f"{THP}/enabled") as f:
            if "[never]" in f.read():
                return "transparent huge pages off"
    except OSError:
        return "no transparent huge pages"
    if read_int(f"{THP}/hpage_pmd_size") != HUGE:
        return "huge pages not 2 MiB"
    if _address(mm) % HUGE:
        return "mapping not 2 MiB-aligned"
    return ""


def _address(mm: mmap.mmap) -> int:
    return np.frombuffer(mm, np.uint8).ctypes.data


def cached_pages(mm: mmap.mmap) -> np.ndarray | None:
    """bool per page of the mapping: in the page cache now (mincore). None where mincore is unavailable."""
    f = _mincore()
    if f is None or len(mm) == 0:
        return None
    n = -(-len(mm) // PAGE)
    vec = np.zeros(n, np.uint8)
    if f(_address(mm), len(mm), vec.ctypes.data) != 0:
        return None
    return (vec & 1).astype(bool)


def _cached_chunks(mm: mmap.mmap) -> tuple[np.ndarray, np.ndarray] | None:
    """(whole, some): per whole 2 MiB chunk of the mapping, every page / any page in the page cache (mincore)."""
    cached = cached_pages(mm)
    if cached is None:
        return None
    per_chunk = cached[: len(mm) // HUGE * (HUGE // PAGE)].reshape(-1, HUGE // PAGE)
    return per_chunk.all(axis=1), per_chunk.any(axis=1)


def _mapped_whole(fd: int, mm: mmap.mmap, c: int) -> bool:
    """Chunk c's last page is mapped (pagemap `fd`) after a touch of its first: the chunk is one PMD-mapped folio
    (a small folio is mapped only around the touched page)."""
    raw = os.pread(fd, 8, ((_address(mm) + (c + 1) * HUGE - PAGE) // PAGE) * 8)
    return len(raw) == 8 and bool(int.from_bytes(raw, "little") & _PRESENT)


def _zap(mm: mmap.mmap, start: int, length: int) -> None:
    # MADV_DONTNEED on a shared file mapping only removes this process's page-table entries; the page cache keeps
    # the pages (dropping them needs them unmapped, so drop_cached can take them).
    mm.madvise(mmap.MADV_DONTNEED, start, length)


def survey(mm: mmap.mmap) -> Survey | None:
    """Which whole 2 MiB chunks of a file mapping are cached in 2 MiB folios, which in small ones; reads nothing
    from disk (only cached chunks are touched). None where no chunk could be PMD-mapped (_unsupported) or the
    kernel's views (mincore, /proc/self/pagemap) are unavailable. Leaves the huge chunks mapped, the others not."""
    if _unsupported(mm):
        return None
    chunks = _cached_chunks(mm)
    if chunks is None:
        return None
    whole, some = chunks
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return None
    huge, small = [], [int(c) for c in np.flatnonzero(some & ~whole)]  # a 2 MiB folio is cached whole or not
    buf = np.frombuffer(mm, np.uint8)
    try:
        with contextlib.suppress(OSError, ValueError):
            _zap(mm, 0, len(whole) * HUGE)  # earlier faults (the header's) must not count as present
        for c in np.flatnonzero(whole):
            c = int(c)
            int(buf[c * HUGE])  # cached: a minor fault, no I/O
            (huge if _mapped_whole(fd, mm, c) else small).append(c)
        for c in small:
            _zap(mm, c * HUGE, HUGE)
    except OSError:
        return None
    finally:
        os.close(fd)
        del buf
    return Survey(chunks=len(whole), huge=tuple(huge), small=tuple(sorted(small)))


def _runs(chunks):
    """(first, count) of each run of consecutive chunk numbers (sorted)."""
    for _, run in itertools.groupby(enumerate(chunks), lambda ic: ic[1] - ic[0]):
        run = [c for _, c in run]
        yield run[0], len(run)


def mend(mm: mmap.mmap, path, ident: tuple[int, int] | None = None) -> Mended:
    """Drop the chunks of `path` (the mapped file: ident = its (st_dev, st_ino)) that the page cache holds in small
    folios, so that the mapping (MADV_HUGEPAGE) reads them back in 2 MiB ones when decode first touches them.
    Where no chunk of the file is cached in a 2 MiB folio yet, one small chunk is dropped and read back first: if
    it does not come back as a 2 MiB folio (a file system without large folios, no free 2 MiB of memory, another
    process mapping it), the rest is kept and this process does not probe that device again; such a host re-reads
    at most that one chunk per process. Costs the dropped bytes read again from disk when first touched."""
    before = survey(mm)
    if before is None:
        return Mended(None, reason=_unsupported(mm) or "mincore or /proc/self/pagemap unavailable")
    if not before.small:
        return Mended(before)
    dev = ident[0] if ident is not None else None
    rest = before.small
    if not before.huge:  # nothing shows this file system makes 2 MiB folios: probe one chunk
        if dev in _no_large:
            return Mended(before, reason="kept: this file system gave small folios to a dropped chunk before")
        probe, rest = before.small[0], before.small[1:]
        drop_cached(path, probe * HUGE, HUGE, ident)
        chunks = _cached_chunks(mm)
        if chunks is None or chunks[1][probe]:
            return Mended(before, reason="kept: the page cache did not let a chunk go (not yet written back, "
                                         "mapped elsewhere, or the file replaced)")
        if not _read_back_whole(mm, probe):
            with contextlib.suppress(OSError, ValueError):
                _zap(mm, probe * HUGE, HUGE)
            if dev is not None:
                _no_large.add(dev)
            return Mended(before, reason="kept: a dropped chunk came back in small folios")
    for first, count in _runs(rest):
        drop_cached(path, first * HUGE, count * HUGE, ident)
    chunks = _cached_chunks(mm)
    left = [c for c in rest if chunks is not None and chunks[1][c]]
    return Mended(before, dropped=len(before.small) - len(left),
                  reason=f"{len(left) * (HUGE >> 20)} MiB stayed cached (mapped elsewhere or dirty)" if left else "")


def _read_back_whole(mm: mmap.mmap, c: int) -> bool:
    """Touch chunk c (read from disk through the MADV_HUGEPAGE mapping): did it come back as one 2 MiB folio?"""
    buf = np.frombuffer(mm, np.uint8)
    try:
        int(buf[c * HUGE])
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
        try:
            return _mapped_whole(fd, mm, c)
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        del buf
