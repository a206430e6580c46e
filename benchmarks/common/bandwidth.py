"""The machine's read bandwidth: the denominator of every decode figure, measured in the same run.

The measurement itself lives in the package (cflow.codegen.bandwidth: a STREAM-like llvmlite loop, the way the
kernels read; `cflow bench` uses it too). A decode figure is judged against the best of a measurement before
and one after it at the same thread count (around): the machine's best in that run is the honest denominator.
"""

from __future__ import annotations

from cflow.codegen.bandwidth import measure_read_bandwidth, run_threads

__all__ = ["GIB", "around", "measure_read_bandwidth", "read_gbs", "run_threads"]

GIB = 1 << 30


def read_gbs(threads: int, gib: float = 1.0, reps: int = 5) -> float:
    """Read bandwidth in GB/s (10^9 B/s) with `threads` threads over a buffer of `gib` GiB (best of reps)."""
    return measure_read_bandwidth(threads, int(gib * GIB), reps)


def around(threads: int, gib: float, fn):
    """(fn(), the read bandwidth: the better of a measurement before fn and one after it)."""
    before = read_gbs(threads, gib)
    out = fn()
    return out, max(before, read_gbs(threads, gib))
