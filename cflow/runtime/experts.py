"""The disk expert tier: expert tiles read on demand from the file, into a bounded cache of aligned slots.

Input: an open FileReader (its expert offset table locates each expert's byte ranges) and a budget.
Output: for a chosen (block, expert), the addresses of its tensors in RAM, read with O_DIRECT and
checksummed on arrival, before any kernel may read them.

    tier.issue(block, experts)   start reading what is not cached (a small thread pool; preadv drops the GIL)
    tier.wait(block, experts)    -> {tensor name: address}; pins the experts until release()
    tier.release(block, experts) unpin: the slots may be reused (LRU) once nobody uses them

A slot holds one expert: its ranges one after the other, each at a 4096-byte boundary, so O_DIRECT
reads of pad(nbytes) land in it directly. Where the filesystem refuses O_DIRECT, reads are buffered and
followed by posix_fadvise(DONTNEED) (one warning), so the page cache does not hold the experts twice.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import heapq
import math
import os
import threading
import time
import warnings

import attrs
import numpy as np
from networkx.utils import UnionFind

from ..errors import CflowError, FormatError, RuntimeFault
from ..layout.tile import aligned_empty
from ..util import crc32
from .format import spec as F

IO_THREADS = 4  # requests in flight: one sequential reader gets ~0.7 GB/s here, several ~1.2 GB/s
MAX_COALESCE = 8 << 20  # bytes one coalesced read may span (adjacent ranges of the experts a layer misses)


class ExpertReadError(RuntimeFault):
    """A read of an expert's tiles failed, came back short, or did not match its checksum."""


def changed_since(fd: int, at_open: os.stat_result) -> str:
    """For a failed read: what happened to the open file since load ('' if nothing visible). A file renamed
    over the path is not here: the open descriptor keeps the file that was loaded, which stays consistent."""
    now = os.fstat(fd)
    if now.st_size < at_open.st_size:
        return f"; the file was truncated since it was loaded ({at_open.st_size} bytes then, {now.st_size} now)"
    if (now.st_mtime_ns, now.st_size) != (at_open.st_mtime_ns, at_open.st_size):
        return "; the file was modified since it was loaded"
    return ""


@attrs.define
class TierStats:
    hits: int = 0  # chosen experts found in the cache (or already in flight)
    misses: int = 0  # chosen experts read from disk
    bytes_read: int = 0  # bytes read from the file (padded to 4096)
    read_seconds: float = 0.0  # summed wall time of the reads (inside the I/O threads)
    wait_seconds: float = 0.0  # time the decode step waited for reads to finish
    guessed: int = 0  # reads started by a guess of the next layer's route (prefetch), before its router ran
    guessed_used: int = 0  # of them, experts the router then chose (counted as hits too)

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    def to_json(self) -> dict:
        return {**attrs.asdict(self), "hit_rate": self.hit_rate}


@attrs.define
class _Slot:
    buf: np.ndarray  # aligned bytes of one expert (all its ranges)
    key: tuple[int, int] | None = None  # (block, expert) held, or None
    pins: int = 0
    ready: bool = False  # read and checksummed
    future: cf.Future | None = None


class ExpertTier:
    """A bounded cache of experts read from `reader`'s file (see the module docstring).

    names: (block, expert) -> the tensor names of that expert, in the order of its ranges.
    layers: 0-based weight block -> the 1-based layers that run it (a shared-block model runs a block more
    than once), for error messages; by default block b is layer b + 1.
    """

    def __init__(self, reader, names: dict[tuple[int, int], list[str]], budget_bytes: int, min_slots: int,
                 direct: bool = True, io_threads: int = IO_THREADS, layers: dict[int, tuple[int, ...]] | None = None):
        self.path = reader.path
        self.names = names
        self.layers = layers or {}
        self.layout: dict[tuple[int, int], list[tuple[str, int, F.Range]]] = {}  # key -> (name, slot offset, range)
        slot_bytes = 0
        for key, tnames in names.items():
            ranges = reader.expert_ranges(*key)
            by_offset = {reader.entry(n).file_offset: n for n in tnames}
            parts, off = [], 0
            for r in ranges:
                name = by_offset.get(r.file_offset)
                if name is None or reader.entry(name).nbytes != r.nbytes:
                    raise FormatError(f"{self.path}: expert table: {self.describe(*key)} range at file "
                                      f"offset 0x{r.file_offset:x} is not one whole tensor of that expert")
                parts.append((name, off, r))
                off += F.pad(r.nbytes)
            if sorted(n for n, _, _ in parts) != sorted(tnames):
                raise FormatError(f"{self.path}: expert table: {self.describe(*key)} ranges do not cover "
                                  f"its tensors {sorted(tnames)}")
            self.layout[key] = parts
            slot_bytes = max(slot_bytes, off)
        self.slot_bytes = slot_bytes
        n_slots = min(budget_bytes // slot_bytes, len(names)) if slot_bytes else 0  # more would never be used
        if n_slots < min_slots:
            raise CflowError(f"expert cache of {budget_bytes / 2**20:.1f} MiB holds {n_slots} experts of "
                             f"{slot_bytes / 2**20:.2f} MiB, but decoding needs {min_slots} at once (the experts "
                             f"chosen inside one expert-delay window): give at least "
                             f"{math.ceil(10 * min_slots * slot_bytes / 2**20) / 10:.1f} MiB")
        self.slots = [_Slot(aligned_empty(slot_bytes, F.ALIGN)) for _ in range(n_slots)]
        self.where: dict[tuple[int, int], int] = {}  # key -> slot index
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict((i, None) for i in range(n_slots))
        # Which cached expert makes room: "lfu" (default) the one chosen least often since load, the least recently
        # used of those; "lru" the least recently used. Measured by replaying a model's routes through both
        # (benchmarks/larger_than_ram.py policy_hits; docs/expert-tier.md).
        self.policy = "lfu"
        self.freq: collections.Counter = collections.Counter()  # (block, expert) -> times chosen since load
        self._heap: list[tuple[int, int, int]] = []  # (freq, tick, slot): the LFU order, stale entries skipped
        self._stamp = [0] * n_slots  # slot -> tick of its live heap entry
        self._tick = 0
        for i in range(n_slots):
            self._rank(i)
        self.guesses: set[tuple[int, int]] = set()  # experts read on a guess and not chosen since
        self.stats = TierStats()
        self.direct = direct
        self.fd = self._open(direct)
        self.at_open = os.fstat(self.fd)
        self.pool = cf.ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="cflow-io")
        self.io_threads = io_threads
        self.in_flight = 0  # reads submitted and not finished (the I/O threads' queue), under self.lock
        self.lock = threading.Lock()
        # Ranges adjacent in the file read as one request (_plan): "expert" an expert's own ranges (one task per
        # expert, as many reads in flight), "layer" also those of experts the same layer misses (fewer, larger
        # requests, fewer in flight), "off" one request per range: the default, as neither paid on this host's
        # virtual disk (benchmarks/expert_coalesce.py; docs/expert-tier.md, "Reads coalesced")
        self.coalesce = "off"
        self.fail_hook = None  # tests: called as fail_hook(key, range index) before each read; may raise OSError
        # benchmarks: a list to append one record per read and per wait to (perf_counter seconds), or None:
        # ("read", block, expert, layer, submitted, started, disk done, checksummed) / ("wait", block, begin, end)
        self.trace: list | None = None

    def describe(self, block: int, expert: int, layer: int | None = None) -> str:
        """'layer 5 (weight block 1, also run as layer 2) expert 3': the executed layer a read was for, and the
        stored block it reads (one read serves every layer that runs the block)."""
        runs = self.layers.get(block, (block + 1,))
        if layer is None:
            if len(runs) == 1:
                return f"layer {runs[0]} (weight block {block}) expert {expert}"
            return f"weight block {block} (run as layers {', '.join(map(str, runs))}) expert {expert}"
        others = [x for x in runs if x != layer]
        also = f", also run as layer{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}" if others else ""
        return f"layer {layer} (weight block {block}{also}) expert {expert}"

    # --- file -------------------------------------------------------------------------------------
    def _open(self, direct: bool) -> int:
        if direct and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
                self._probe(fd)
                return fd
            except OSError as e:
                warnings.warn(f"{self.path}: O_DIRECT refused ({e.strerror}); reading experts through the page "
                              "cache and dropping them from it after each read", stacklevel=3)
                try:
                    os.close(fd)
                except (OSError, UnboundLocalError):
                    pass
        self.direct = False
        try:
            return os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise RuntimeFault(f"{self.path}: cannot open for expert reads: {e.strerror}") from None

    def _probe(self, fd: int) -> None:
        """Some filesystems accept O_DIRECT at open and fail the first read (EINVAL): find out now."""
        buf = aligned_empty(F.ALIGN, F.ALIGN)
        os.preadv(fd, [memoryview(buf)], 0)

    # --- cache ------------------------------------------------------------------------------------
    def _free(self, i: int, for_guess: bool) -> bool:
        """May slot i be reused now? Not while pinned or being read; a guess never evicts another guess not yet
        chosen."""
        s = self.slots[i]
        return s.pins == 0 and (s.future is None or s.future.done()) and not (for_guess and s.key in self.guesses)

    def _rank(self, i: int) -> None:
        """Slot i's place in the LFU order (after its expert was chosen, loaded or dropped)."""
        self._tick += 1
        self._stamp[i] = self._tick
        key = self.slots[i].key
        heapq.heappush(self._heap, (self.freq[key] if key is not None else -1, self._tick, i))
        if len(self._heap) > 4 * len(self.slots) + 64:  # drop the stale entries
            self._heap = [e for e in self._heap if self._stamp[e[2]] == e[1]]
            heapq.heapify(self._heap)

    def _lfu_victim(self, for_guess: bool) -> int | None:
        aside, found = [], None
        while self._heap:
            entry = heapq.heappop(self._heap)
            if self._stamp[entry[2]] != entry[1]:
                continue  # stale
            if self._free(entry[2], for_guess):
                found = entry[2]
                self._stamp[found] = -1  # its entry is gone: _start ranks it again
                break
            aside.append(entry)
        for entry in aside:
            heapq.heappush(self._heap, entry)
        return found

    def _victim(self, for_guess: bool = False) -> int:
        if self.policy == "lfu":
            i = self._lfu_victim(for_guess)
            if i is not None:
                return i
        else:
            for i in self.lru:  # least recently used first
                if self._free(i, for_guess):
                    return i
        if not for_guess:  # a chosen expert takes the slot of a guess still being read, once its read is done
            for i in self.lru:
                s = self.slots[i]
                if s.pins == 0 and s.key in self.guesses:
                    try:
                        s.future.result()
                    except BaseException:  # a failed guess is only a slot to reuse
                        pass
                    return i
        raise RuntimeFault("expert cache exhausted: every slot is pinned (a bug: the budget check should "
                           "have refused this model)")

    def _touch(self, i: int) -> None:
        self.lru.move_to_end(i)
        self._rank(i)

    def issue(self, block: int, experts, layer: int | None = None) -> int:
        """Start reading the experts of `block` that are not cached or in flight; returns how many.
        layer: the executed layer whose router chose them (named in a read error)."""
        keys = [(block, int(e)) for e in experts]
        misses = [key for key in keys if key not in self.where]
        for key in keys:
            self.freq[key] += 1
            i = self.where.get(key)
            if i is None:
                continue
            self.stats.hits += 1  # pinned before any miss makes room: a miss never evicts a chosen expert
            if key in self.guesses:
                self.guesses.discard(key)
                self.stats.guessed_used += 1
            self.slots[i].pins += 1
            self._touch(i)
        claims = []
        for key in misses:
            self.stats.misses += 1
            i = self._victim()
            self._claim(key, i, 1)
            claims.append((key, i))
        self._submit(claims, layer)
        return len(misses)

    def prefetch(self, block: int, experts, layer: int | None = None) -> int:
        """Start reading experts a guess expects (RouteGuess; most likely first) that are neither cached nor in
        flight, into slots nobody pins, unpinned themselves: a wrong guess is evicted like any other expert.
        Only I/O threads with nothing to do take a guess: when the chosen experts' reads keep the disk busy, a
        guess would only delay them (wrong guesses are a fifth to a quarter of the bytes). Returns the reads
        started."""
        started = 0
        with self.lock:
            room = self.io_threads - self.in_flight
        for e in experts:
            if started >= room:
                break
            key = (block, int(e))
            if key in self.where:
                continue
            try:
                i = self._victim(for_guess=True)
            except RuntimeFault:  # no free slot: a guess never waits
                break
            self._claim(key, i, 0)
            self._submit([(key, i)], layer)
            self.guesses.add(key)
            self.stats.guessed += 1
            started += 1
        return started

    def _claim(self, key: tuple[int, int], i: int, pins: int) -> None:
        """Give slot i to `key` (evicting what it held); _submit starts its read."""
        s = self.slots[i]
        if s.key is not None:
            del self.where[s.key]
            self.guesses.discard(s.key)
        s.key, s.ready, s.pins, s.future = key, False, pins, None
        self.where[key] = i
        self._touch(i)

    def _submit(self, claims: list[tuple[tuple[int, int], int]], layer: int | None) -> None:
        """Start the reads of the claimed (key, slot) pairs: one request per run of adjacent ranges (up to
        MAX_COALESCE bytes, scattered into the slots by one preadv), one task per set of experts that share a
        request; every slot of a task waits on its future."""
        now = time.perf_counter()
        for keys, runs in self._plan(claims):
            with self.lock:
                self.in_flight += 1
            future = self.pool.submit(self._read, keys, runs, layer, now)
            for key in keys:
                self.slots[self.where[key]].future = future

    def _plan(self, claims) -> list[tuple[list, list]]:
        """Group the claimed experts' ranges into requests: [(keys, runs)], a run [(key, range index, the
        range's piece of its slot, range)] of ranges each starting where the one before ends in the file (see
        self.coalesce; with it off, or ranges apart, a run is one range and each expert its own task)."""
        def pieces(key, i):
            return [(r.file_offset, key, k, memoryview(self.slots[i].buf[off : off + F.pad(r.nbytes)]), r)
                    for k, (_, off, r) in enumerate(self.layout[key])]

        if self.coalesce == "off":  # the default: no sorting, one task per expert, one request per range
            return [([key], [[p[1:]] for p in pieces(key, i)]) for key, i in claims]
        runs: list[list] = []
        end = size = -1
        for at, key, k, view, r in sorted((p for c, i in claims for p in pieces(c, i)), key=lambda p: p[0]):
            want = len(view)
            if at == end and size + want <= MAX_COALESCE and (self.coalesce == "layer" or key == runs[-1][-1][0]):
                runs[-1].append((key, k, view, r))
                size += want
            else:
                runs.append([(key, k, view, r)])
                size = want
            end = at + want
        uf = UnionFind(key for key, _ in claims)  # experts that share a run read in one task
        for run in runs:
            uf.union(*(key for key, *_ in run))
        tasks: dict[tuple[int, int], tuple[list, list]] = {}
        for key, _ in claims:
            tasks.setdefault(uf[key], ([], []))[0].append(key)
        for run in runs:
            tasks[uf[run[0][0]]][1].append(run)
        return list(tasks.values())

    def wait(self, block: int, experts) -> dict[str, int]:
        """Block until the experts are in RAM and verified; their tensors' addresses by name."""
        out: dict[str, int] = {}
        t0 = time.perf_counter()
        for e in experts:
            key = (block, int(e))
            s = self.slots[self.where[key]]
            if not s.ready:
                try:
                    s.future.result()
                except BaseException:
                    self._forget(key)
                    raise
                s.ready = True
            base = s.buf.ctypes.data
            for name, off, _ in self.layout[key]:
                out[name] = base + off
        t1 = time.perf_counter()
        self.stats.wait_seconds += t1 - t0
        if self.trace is not None:
            self.trace.append(("wait", block, t0, t1))
        return out

    def release(self, block: int, experts) -> None:
        for e in experts:
            i = self.where.get((block, int(e)))
            if i is not None and self.slots[i].pins > 0:
                self.slots[i].pins -= 1

    def _forget(self, key) -> None:
        self.guesses.discard(key)
        i = self.where.pop(key, None)
        if i is not None:
            s = self.slots[i]
            s.key, s.ready, s.pins, s.future = None, False, 0, None
            self._rank(i)  # an empty slot: first to be reused

    def reset(self) -> None:
        """After a failed or abandoned token: wait for reads in flight, drop every pin (cached data stays)."""
        for s in self.slots:
            if s.future is not None and not s.future.done():
                try:
                    s.future.result()
                except BaseException:
                    pass
            if s.future is not None and s.future.done() and s.future.exception() is not None:
                if s.key is not None:
                    self._forget(s.key)
                continue
            if s.key is not None and not s.ready and s.future is not None:
                s.ready = True  # completed cleanly
            s.pins = 0

    # --- I/O (in the pool's threads) ----------------------------------------------------------------
    def _read(self, keys: list, runs: list, layer: int | None = None, submitted: float = 0.0) -> None:
        try:
            self._read_runs(keys, runs, layer, submitted)
        finally:
            with self.lock:
                self.in_flight -= 1

    def _where(self, key, k: int, layer: int | None) -> str:
        name, _, r = self.layout[key][k]
        return f"{self.path}: {self.describe(*key, layer)} ({name}) at file offset 0x{r.file_offset:x}"

    def _read_runs(self, keys: list, runs: list, layer: int | None, submitted: float) -> None:
        """Each run with one preadv scattering into the slots' buffers (each piece 4096-aligned, as O_DIRECT
        needs), then every range checksummed."""
        t0 = time.perf_counter()
        nread, disk = 0, 0.0
        for run in runs:
            views = [view for _, _, view, _ in run]
            start = run[0][3].file_offset
            try:
                if self.fail_hook is not None:
                    for key, k, _, _ in run:
                        self.fail_hook(key, k)
                t_io = time.perf_counter()
                got = os.preadv(self.fd, views, start)
                disk += time.perf_counter() - t_io
            except OSError as err:
                raise ExpertReadError(f"{self._where(run[0][0], run[0][1], layer)}: read failed: "
                                      f"{err.strerror or err}") from None
            for key, k, view, r in run:
                mine = got - (r.file_offset - start)  # bytes of this range the request returned
                if mine < r.nbytes:
                    raise ExpertReadError(f"{self._where(key, k, layer)}: short read, {max(0, mine)} of {r.nbytes} "
                                          f"bytes (file truncated?){changed_since(self.fd, self.at_open)}")
                crc = crc32(view[: r.nbytes])
                if crc != r.crc:
                    raise ExpertReadError(f"{self._where(key, k, layer)}: checksum mismatch, stored "
                                          f"0x{r.crc:08x}, read 0x{crc:08x} (corrupt expert tile)"
                                          f"{changed_since(self.fd, self.at_open)}")
            want = sum(len(v) for v in views)
            if not self.direct:
                os.posix_fadvise(self.fd, start, want, os.POSIX_FADV_DONTNEED)
            nread += want
        t1 = time.perf_counter()
        with self.lock:
            self.stats.bytes_read += nread
            self.stats.read_seconds += t1 - t0
            if self.trace is not None:
                for key in keys:
                    self.trace.append(("read", *key, layer, submitted, t0, t0 + disk, t1))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
