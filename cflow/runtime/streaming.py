"""Dense weights streamed from the file in stage order, with read-ahead: a model larger than RAM still decodes.

Input: an open FileReader and, per schedule stage, the names of the tensors that stage streams. Output:
before a stage runs, the addresses of its tensors in RAM. Reads use O_DIRECT (the page cache cannot
hold a model larger than RAM anyway, and a cold read is what is measured), coalesced into one request
per run of nearby tensors (small tensors between them, such as norms, are read through): one request
per stage in a stage-major .vflow file, several in a layer-major .cflow file, where a stage's tensors
belong to several layers.

    streamer.wait(stage)      -> {tensor name: address}; stages run in order, wrapping to the next token
    streamer.done(stage)      the stage ran: its buffer may take the next read-ahead

A ring of `depth + 1` buffers, each the size of the largest stage: stage k + 1 .. k + depth are read
while stage k computes.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import os
import threading
import time
import warnings

import attrs
import numpy as np

from ..errors import RuntimeFault
from ..layout.tile import aligned_empty
from ..util import crc32
from .experts import changed_since
from .format import spec as F

MAX_GAP = 64 << 10  # bytes of other tensors (norms, biases) a request reads through rather than split
IO_THREADS = 2  # reads in flight


class WeightReadError(RuntimeFault):
    """A streamed weight read failed, came back short, or did not match its checksum."""


@attrs.frozen
class Run:
    """One read request: [file_offset, +nbytes) into the stage buffer at buf_offset; the tensors in it."""

    file_offset: int
    nbytes: int
    buf_offset: int
    tensors: tuple[tuple[str, int, int, int], ...]  # (name, offset in run, nbytes, crc)


@attrs.define
class StreamStats:
    bytes_read: int = 0
    requests: int = 0
    read_seconds: float = 0.0
    wait_seconds: float = 0.0


class StageStreamer:
    def __init__(self, reader, stage_tensors: list[list[str]], depth: int = 2, direct: bool = True):
        if depth < 0:
            raise ValueError(f"read-ahead depth must be >= 0, not {depth}")
        self.path = reader.path
        self.stages = [k for k, names in enumerate(stage_tensors) if names]  # stages that stream anything
        self.runs: dict[int, list[Run]] = {}
        biggest = 0
        for k in self.stages:
            entries = sorted((reader.entry(n) for n in dict.fromkeys(stage_tensors[k])), key=lambda e: e.file_offset)
            runs, cur, off = [], None, 0
            for e in entries:
                gap = e.file_offset - (cur[0] + cur[1]) if cur is not None else -1
                if 0 <= gap <= MAX_GAP:  # adjacent, or a few small tensors between: read through, one request
                    cur[1] += gap + F.pad(e.nbytes)
                    cur[2].append((e.name, e.file_offset - cur[0], e.nbytes, e.crc))
                else:
                    if cur is not None:
                        runs.append(Run(cur[0], cur[1], cur[3], tuple(cur[2])))
                        off += cur[1]
                    cur = [e.file_offset, F.pad(e.nbytes), [(e.name, 0, e.nbytes, e.crc)], off]
            runs.append(Run(cur[0], cur[1], cur[3], tuple(cur[2])))
            off += cur[1]
            self.runs[k] = runs
            biggest = max(biggest, off)
        self.depth = min(depth, max(0, len(self.stages) - 1))
        self.buffers = [aligned_empty(max(biggest, F.ALIGN), F.ALIGN) for _ in range(self.depth + 1)]
        self.free: collections.deque[int] = collections.deque(range(len(self.buffers)))
        self.inflight: dict[int, tuple[int, cf.Future]] = {}  # stage -> (buffer, future)
        self.next_issue = 0  # index into self.stages of the next stage to read
        self.stats = StreamStats()
        self.direct = direct
        self.fd = self._open(direct)
        self.at_open = os.fstat(self.fd)
        self.pool = cf.ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="cflow-stream")
        self.lock = threading.Lock()
        self.fail_hook = None  # tests: called as fail_hook(stage, run index) before each read; may raise OSError

    def _open(self, direct: bool) -> int:
        if direct and hasattr(os, "O_DIRECT"):
            fd = None
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
                os.preadv(fd, [memoryview(aligned_empty(F.ALIGN, F.ALIGN))], 0)
                return fd
            except OSError as e:
                warnings.warn(f"{self.path}: O_DIRECT refused ({e.strerror}); streaming weights through the "
                              "page cache", stacklevel=3)
                if fd is not None:
                    os.close(fd)
        self.direct = False
        try:
            return os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise RuntimeFault(f"{self.path}: cannot open to stream weights: {e.strerror}") from None

    @property
    def bytes_per_token(self) -> int:
        return sum(r.nbytes for k in self.stages for r in self.runs[k])

    @property
    def requests_per_token(self) -> int:
        return sum(len(self.runs[k]) for k in self.stages)

    def _issue_ahead(self) -> None:
        """Fill free buffers with the next stages in order (wrapping around to the next token)."""
        while self.free:
            k = self.stages[self.next_issue % len(self.stages)]
            if k in self.inflight:
                return
            b = self.free.popleft()
            self.inflight[k] = (b, self.pool.submit(self._read, k, self.buffers[b]))
            self.next_issue += 1

    def wait(self, stage: int) -> dict[str, int]:
        """The stage's tensors, read and checksummed: name -> address."""
        if stage not in self.runs:
            return {}
        self._issue_ahead()
        if stage not in self.inflight:  # out of order (a reset): start over from this stage
            self.next_issue = self.stages.index(stage)
            self._issue_ahead()
        b, fut = self.inflight[stage]
        t0 = time.perf_counter()
        try:
            fut.result()
        except BaseException:
            self.reset()
            raise
        self.stats.wait_seconds += time.perf_counter() - t0
        base = self.buffers[b].ctypes.data
        return {name: base + r.buf_offset + off for r in self.runs[stage] for name, off, _, _ in r.tensors}

    def done(self, stage: int) -> None:
        if stage in self.inflight:
            b, _ = self.inflight.pop(stage)
            self.free.append(b)
            self._issue_ahead()

    def reset(self) -> None:
        """Drop the read-ahead (after a failure or an abandoned token); the next wait starts afresh."""
        for b, fut in self.inflight.values():
            try:
                fut.result()
            except BaseException:
                pass
            self.free.append(b)
        self.inflight.clear()
        self.next_issue = 0

    def _read(self, stage: int, buf: np.ndarray) -> None:
        t0 = time.perf_counter()
        n = 0
        for k, r in enumerate(self.runs[stage]):
            view = memoryview(buf[r.buf_offset : r.buf_offset + r.nbytes])
            names = [t[0] for t in r.tensors]
            what = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            where = f"{self.path}: stage {stage} weights ({what}) at file offset 0x{r.file_offset:x}"
            try:
                if self.fail_hook is not None:
                    self.fail_hook(stage, k)
                got = os.preadv(self.fd, [view], r.file_offset)
            except OSError as err:
                raise WeightReadError(f"{where}: read failed: {err.strerror or err}") from None
            last = max(off + nb for _, off, nb, _ in r.tensors)
            if got < last:
                raise WeightReadError(f"{where}: short read, {got} of {last} bytes (file truncated?)"
                                      f"{changed_since(self.fd, self.at_open)}")
            for name, off, nb, crc in r.tensors:
                if crc32(view[off : off + nb]) != crc:
                    raise WeightReadError(f"{where}: tensor {name!r} checksum mismatch (corrupt file)"
                                          f"{changed_since(self.fd, self.at_open)}")
            if not self.direct:
                os.posix_fadvise(self.fd, r.file_offset, r.nbytes, os.POSIX_FADV_DONTNEED)
            n += r.nbytes
        with self.lock:
            self.stats.bytes_read += n
            self.stats.requests += len(self.runs[stage])
            self.stats.read_seconds += time.perf_counter() - t0

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
