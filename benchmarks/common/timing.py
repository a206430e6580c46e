"""Timing on a shared machine: the CPU share other processes used meanwhile, quiet rounds, best-of decode.

Every figure carries the share of all CPU time that processes other than the benchmark used while it was taken
(0..1 of all cores, from /proc): on a shared host a figure taken under load is noise, and the benchmarks either
retry it (measure_quiet, measure_rounds) or record the share beside it.
"""

from __future__ import annotations

import time

import numpy as np


def cpu_ticks(pids=()) -> tuple[int, int, int]:
    """(all CPU ticks, idle + iowait ticks, ticks of this process and `pids`) from /proc."""
    with open("/proc/stat") as f:
        v = list(map(int, f.readline().split()[1:]))
    mine = 0
    for pid in ["self", *pids]:
        try:
            with open(f"/proc/{pid}/stat") as f:
                s = f.read().rsplit(")", 1)[1].split()
            mine += int(s[11]) + int(s[12])
        except OSError:
            pass
    return sum(v), v[3] + v[4], mine


def other_load(before: tuple[int, int, int], after: tuple[int, int, int]) -> float:
    """The share of all CPU time (0..1) that processes other than the ones cpu_ticks counted used between two
    cpu_ticks() readings."""
    total, idle, mine = (after[i] - before[i] for i in range(3))
    return max(0.0, (total - idle - mine) / max(total, 1))


def busy_fraction(fn, pids=()):
    """Run fn; return (its result, share of CPU time other processes (not this one or `pids`) used meanwhile)."""
    a = cpu_ticks(pids)
    out = fn()
    return out, other_load(a, cpu_ticks(pids))


def measure_quiet(fn, threshold: float = 0.10, retries: int = 2):
    """(value, other load, attempts): fn() measured with the CPU share other processes used meanwhile; repeated
    (up to `retries` more times) while that share exceeds `threshold`. The attempt with the least other load is
    kept (the faster one on a tie)."""
    tries = []
    for _ in range(1 + retries):
        v, busy = busy_fraction(fn)
        tries.append((v, busy))
        if busy <= threshold:
            break
    v, busy = min(tries, key=lambda t: (t[1], -t[0]))
    return v, busy, len(tries)


class Rounds:
    """Samples of one measurement, each tagged with the CPU share other processes used meanwhile.

    Quiet samples (other load <= threshold) are preferred; on a shared machine that never goes
    quiet, all samples are used and the result says so.
    """

    def __init__(self, threshold: float = 0.05):
        self.threshold = threshold
        self.samples: list[tuple[tuple, float]] = []

    @property
    def n_quiet(self) -> int:
        return sum(busy <= self.threshold for _, busy in self.samples)

    @property
    def worst(self) -> float:
        return max((busy for _, busy in self.samples), default=0.0)

    def used(self) -> list[tuple]:
        """The samples the results come from: the quiet ones, or all when none was quiet."""
        quiet = [v for v, busy in self.samples if busy <= self.threshold]
        return quiet or [v for v, _ in self.samples]

    def best(self) -> tuple:
        """Elementwise maximum (best throughput) over the samples used."""
        return tuple(map(max, *self.used())) if len(self.used()) > 1 else self.used()[0]

    def median_ratio(self, i: int, j: int) -> float:
        """Median over samples of v[i] / v[j]: both measured back to back, so noise mostly cancels."""
        return float(np.median([v[i] / v[j] for v in self.used()]))

    def describe(self) -> str:
        if self.n_quiet:
            return f"best of {self.n_quiet} quiet rounds"
        return f"NOISY: {len(self.samples)} rounds, other processes used up to {self.worst:.0%} CPU"


def measure_rounds(measure, rounds: int, max_wait: float, threshold: float = 0.05) -> Rounds:
    """Call measure() (returning a tuple of numbers) until `rounds` quiet samples were taken, or
    `max_wait` seconds passed with at least `rounds` samples of any kind."""
    res, t_end = Rounds(threshold), time.monotonic() + max_wait
    while res.n_quiet < rounds:
        res.samples.append(busy_fraction(measure))
        if time.monotonic() > t_end and len(res.samples) >= rounds:
            break
    return res


def time_decode(m, prompt, tokens: int, reps: int = 3, prompt_logits: list | None = None) -> float:
    """Best-of-reps greedy decode tok/s of a loaded cflow model over `tokens` steps after the prompt
    (prompt_logits: a list that gets a copy of the first repetition's prompt logits, for callers that compare
    them)."""
    s = m.session
    best = 0.0
    for rep in range(reps):
        s.reset()
        logits = s.prefill(prompt)
        if prompt_logits is not None and rep == 0:
            prompt_logits.append(logits.copy())
        t0 = time.perf_counter()
        for _ in range(tokens):
            logits = s.step(int(np.argmax(logits)))
        best = max(best, tokens / (time.perf_counter() - t0))
    return best
