"""The overlap model of a decode step with its experts on disk (docs/expert-tier.md, "The overlap model"), and the
probe that collects what it reads from a run.

    probe = OverlapProbe(session)          # before the decode loop
    for _ in range(tokens):
        logits = session.step(...)
        probe.token()
    run = probe.result(tokens, seconds)    # segments, compute per segment, reads per layer per token, read trace
    seconds_per_token = predict(run, read_params(run), "async")

benchmarks/expert_tier.py (sync against async reads) and benchmarks/larger_than_ram.py (a model in a memory
budget: the prediction next to the measured tok/s) both use it.
"""

from __future__ import annotations

import collections
import time

import numpy as np


class OverlapProbe:
    """What the overlap model reads from a decode run, collected around the session's own loop: the compute of
    every segment (Session.segment_seconds), the reads started per layer per token (the misses, and the reads
    started on a guess of the next layer's route with how many of them its router then chose), and the tier's
    trace of reads and waits. Created right before the loop (it resets the segment clocks and starts the trace);
    `token()` after each step."""

    def __init__(self, session):
        s = self.session = session
        tier = s.tier
        s.segment_seconds[:] = 0
        tier.trace = self.trace = []
        self.t0 = time.perf_counter()
        self.last = s.misses_by_layer()
        self.misses: list[dict[str, int]] = []
        self.guessed: list[dict[str, int]] = []
        self.used: list[dict[str, int]] = []
        self._guessed: collections.Counter = collections.Counter()
        self._used: collections.Counter = collections.Counter()
        prefetch, issue = tier.prefetch, tier.issue

        def counted_prefetch(block, experts, layer=None):
            n = prefetch(block, experts, layer)
            self._guessed[layer] += n
            return n

        def counted_issue(block, experts, layer=None):
            before = tier.stats.guessed_used
            n = issue(block, experts, layer)
            self._used[layer] += tier.stats.guessed_used - before
            return n

        tier.prefetch, tier.issue = counted_prefetch, counted_issue  # this session's tier only, for this run

    def token(self) -> None:
        now = self.session.misses_by_layer()
        self.misses.append({str(k): now[k] - self.last[k] for k in now})
        self.last = now
        self.guessed.append({str(k): v for k, v in self._guessed.items() if v})
        self.used.append({str(k): v for k, v in self._used.items() if v})
        self._guessed.clear()
        self._used.clear()

    def result(self, tokens: int | None = None, seconds: float | None = None) -> dict:
        """The run as `predict` takes it. tokens, seconds: the decode loop's (default: the tokens seen by
        `token()` and the time since the probe was made); the host time per token is what the loop spent
        outside the native calls and the waits."""
        s = self.session
        tokens = tokens or len(self.misses)
        seconds = seconds if seconds is not None else time.perf_counter() - self.t0
        return {"segments": [[g.lo, g.hi, list(g.awaits), list(g.issues)] for g in s.segments],
                "segment_s": (s.segment_seconds / tokens).tolist(), "misses_by_token": self.misses,
                "guessed_by_token": self.guessed, "guessed_used_by_token": self.used,
                "host_s_per_token": (seconds - s.segment_seconds.sum() - wait_seconds(self.trace)) / tokens,
                **trace_summary(self.trace, tokens)}


def wait_seconds(trace: list) -> float:
    return sum(w[3] - w[2] for w in trace if w[0] == "wait")


def trace_summary(trace: list, tokens: int, io_threads: int | None = None) -> dict:
    """From the tier's trace: per read, the time it queued for an I/O thread (all reads, and the reads that found
    one free: the dispatch alone, as the model queues the others itself), its preadv time (split by how many
    other reads were on the disk meanwhile) and its checksum time; per token, the time the step waited."""
    if io_threads is None:
        from cflow.runtime.experts import IO_THREADS as io_threads
    reads = sorted((r for r in trace if r[0] == "read"), key=lambda r: r[4])  # by submission
    done = np.sort([r[7] for r in reads])  # an I/O thread holds a read until its checksum is done
    # the reads submitted before this one and not done when it was: fewer than the threads, one was free for it
    ahead = np.arange(len(reads)) - np.searchsorted(done, [r[4] for r in reads], "right")
    free = [r[5] - r[4] for r, n in zip(reads, ahead) if n < io_threads]
    disk = sorted((r[5], r[6]) for r in reads)
    starts = np.array([a for a, _ in disk])
    longest = max((b - a for a, b in disk), default=0.0)
    alone, shared, crowd = [], [], []
    for i, (a, b) in enumerate(disk):  # the reads on the disk during this one: started before it ends, and
        lo, hi = np.searchsorted(starts, [a - longest, b])  # no earlier than the longest read before it
        others = [(c, d) for j, (c, d) in enumerate(disk[lo:hi], lo) if j != i and c < b and d > a]
        if not others:
            alone.append(b - a)
            continue
        shared.append(b - a)
        if b > a:  # how many were on the disk, itself included, averaged over its time
            crowd.append(1 + sum(min(b, d) - max(a, c) for c, d in others) / (b - a))

    def mean(xs):
        return float(np.mean(xs)) if xs else 0.0

    return {"trace": {
        "reads": len(reads), "queue_ms": 1e3 * mean([r[5] - r[4] for r in reads]),
        "queue_ms_free": 1e3 * mean(free), "reads_free": len(free),
        "disk_ms": 1e3 * mean([b - a for a, b in disk]), "disk_ms_alone": 1e3 * mean(alone),
        "disk_ms_overlapped": 1e3 * mean(shared), "reads_alone": len(alone),
        "inflight_overlapped": mean(crowd),
        "crc_ms": 1e3 * mean([r[7] - r[6] for r in reads]),
        "wait_ms_per_token": 1e3 * wait_seconds(trace) / tokens}}


def read_params(run: dict) -> dict:
    """The disk model's parameters, from a run's own trace (seconds): q, the wait for an I/O thread; d1, one
    read's preadv alone on the disk; s, what each other read in flight adds (a read with k on the disk takes
    d1 + (k - 1) s: fitted to the overlapped reads' mean time and mean crowd, two when a trace predates the
    crowd's count); c, the checksum after the read (CPU, in the I/O thread). q is the wait of the reads that
    found an I/O thread free (Disk queues the others itself; every read's wait, in a trace without that count)."""
    tr = run["trace"]
    d1 = tr["disk_ms_alone"] or tr["disk_ms"]
    others = max(1.0, tr.get("inflight_overlapped", 2.0) - 1)
    q = tr["queue_ms_free"] if tr.get("reads_free") else tr["queue_ms"]
    return {"q": q / 1e3, "d1": d1 / 1e3,
            "s": min(d1, max(0.0, (tr["disk_ms_overlapped"] or d1) - d1) / others) / 1e3, "c": tr["crc_ms"] / 1e3}


class Disk:
    """The disk as the model sees it: a read waits q for an I/O thread (at most `threads` reads are in service,
    the rest queue in order), then a fixed latency d0, then its transfer, which shares the disk's bandwidth
    equally with the other transfers in flight (alone it takes x), then its checksum c. With d0 = d1 - s and
    x = s this reproduces the measured d1 for a read alone and d1 + s for two at once; a read issued early
    is slowed by the ones issued after it while it is still in flight (a FIFO disk would not do that)."""

    def __init__(self, rp: dict, threads: int = 4):
        self.d0, self.x, self.q, self.c, self.threads = rp["d1"] - rp["s"], rp["s"], rp["q"], rp["c"], threads
        self.now = 0.0
        self.queued: list[tuple[float, int]] = []  # (time it may start, read)
        self.latent: dict[int, float] = {}  # read -> when its transfer starts
        self.moving: dict[int, float] = {}  # read -> seconds of transfer left if it were alone
        self.checking: dict[int, float] = {}  # read -> when its checksum is done
        self.done: dict[int, float] = {}
        self.count = 0  # reads added so far (their ids)

    def add(self, at: float) -> int:
        """A read submitted at `at`; returns its id."""
        self.count += 1
        self.queued.append((at + self.q, self.count))
        self.queued.sort()
        return self.count

    def _in_service(self) -> int:
        return len(self.latent) + len(self.moving) + len(self.checking)

    def _next(self) -> float | None:
        ts = list(self.latent.values()) + list(self.checking.values())
        if self.queued and self._in_service() < self.threads:
            ts.append(max(self.now, self.queued[0][0]))
        if self.moving:
            ts.append(self.now + min(self.moving.values()) * len(self.moving))
        return min(ts) if ts else None

    def _advance(self, t: float) -> None:
        if self.moving and t > self.now:
            share = (t - self.now) / len(self.moving)
            for r in self.moving:
                self.moving[r] -= share
        self.now = max(self.now, t)
        eps, changed = 1e-12, True
        while changed:  # one event can free a thread for the next read: repeat until nothing moves
            changed = False
            while self.queued and self._in_service() < self.threads and self.queued[0][0] <= self.now + eps:
                self.latent[self.queued.pop(0)[1]] = self.now + self.d0
                changed = True
            for r in [r for r, at in self.latent.items() if at <= self.now + eps]:
                del self.latent[r]
                self.moving[r] = self.x
                changed = True
            for r in [r for r, left in self.moving.items() if left <= eps]:
                del self.moving[r]
                self.checking[r] = self.now + self.c
                changed = True
            for r in [r for r, at in self.checking.items() if at <= self.now + eps]:
                del self.checking[r]
                self.done[r] = self.now
                changed = True

    def run_until(self, t: float) -> None:
        while (nxt := self._next()) is not None and nxt <= t:
            self._advance(nxt)
        self._advance(t)

    def wait(self, reads: list[int], t: float) -> float:
        """When all `reads` are done (at least t)."""
        self.run_until(t)
        while not all(r in self.done for r in reads):
            self._advance(self._next())
        return max([t] + [self.done[r] for r in reads])


def predict(run: dict, rp: dict, mode: str, io_threads: int | None = None) -> float:
    """Seconds per token under the overlap model, token by token: walk the step's segments with their measured
    compute; each read of a layer is one read on the Disk above. Async reads are submitted after the segment
    where their layer's router chose, sync ones at the await; the reads a guess of a layer's route started
    (async only) are submitted where the previous routed layer chose, after its own reads, and the ones its
    router then chose are waited for with its misses. The step stalls at an await until its layer's reads are
    done (max of compute and reads over each window, not their sum). Plus the run's host time per token (the
    Python between the native calls)."""
    if io_threads is None:
        from cflow.runtime.experts import IO_THREADS as io_threads
    routed = sorted({layer for *_, issues in run["segments"] for layer in issues})
    prev = dict(zip(routed[1:], routed))  # routed layer -> the one whose route its guess was made from
    n = len(run["misses_by_token"])
    guessed_by_token = run.get("guessed_by_token") or [{}] * n
    used_by_token = run.get("guessed_used_by_token") or [{}] * n
    total = 0.0
    for miss, guessed, used in zip(run["misses_by_token"], guessed_by_token, used_by_token):
        disk, t, reads = Disk(rp, io_threads), 0.0, collections.defaultdict(list)
        guesses = {prev[int(k)]: (int(k), v) for k, v in guessed.items() if int(k) in prev}

        def submit(layer, at, miss=miss, disk=disk, reads=reads, guesses=guesses, used=used):
            reads[layer] += [disk.add(at) for _ in range(miss.get(str(layer), 0))]
            if layer in guesses:  # the next routed layer's guessed reads: the chosen ones first
                nxt, count = guesses[layer]
                ids = [disk.add(at) for _ in range(count)]
                reads[nxt] += ids[: used.get(str(nxt), 0)]

        for (_lo, _hi, awaits, issues), c in zip(run["segments"], run["segment_s"]):
            for layer in awaits:
                if mode == "sync":
                    submit(layer, t)
                t = disk.wait(reads.get(layer, []), t)
            t += c
            if mode == "async":
                disk.run_until(t)
                for layer in issues:
                    submit(layer, t)
        total += t
    return total / n + run["host_s_per_token"]
