"""Machine read bandwidth, measured the way the kernels read: a STREAM-like loop generated with llvmlite.

Every decode benchmark divides its effective bandwidth by this number, measured in the same run at
the same thread count. (NumPy's a.sum() is compute-bound near 9 GB/s here, so it cannot measure it.)
The loop XORs 64-byte loads into 8 independent accumulators; threads are Python threads, each
calling the native function on its own contiguous slice (ctypes releases the GIL); best of `reps`.

    python benchmarks/bandwidth.py [--gib 1] [--threads 1,2] [--reps 5]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from llvmlite import ir  # noqa: E402

from cflow.codegen.library import Library  # noqa: E402
from cflow.passes.tile import aligned_empty  # noqa: E402

CHUNK = 512  # bytes per loop iteration: 8 accumulators x 64 B
# The reference is the faster of a plain loop and one with the kernels' software prefetch (2304 B
# ahead, prefetcht0; ~5% faster here): the mat-vec must not be flattered by a weaker read loop.
PREFETCH_VARIANTS = (0, 2304)
_kernels: dict[int, object] = {}
_buffers: dict[int, np.ndarray] = {}


def read_kernel_module(accumulators: int = CHUNK // 64, prefetch: int = 0) -> ir.Module:
    """i64 read_xor(i8* p, i64 nbytes): XOR of all 64-byte vectors in p[0:nbytes] (nbytes % 512 == 0).

    accumulators: independent 64-byte XOR chains per iteration (must divide 8); prefetch: optional
    software-prefetch distance in bytes (0 = hardware prefetchers only, the default)."""
    i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
    vt = ir.VectorType(i64, 8)
    mod = ir.Module(name="bandwidth")
    fn = ir.Function(mod, ir.FunctionType(i64, [i8.as_pointer(), i64]), "read_xor")
    p, n = fn.args
    entry = fn.append_basic_block("entry")
    head, body, done = (fn.append_basic_block(s) for s in ("head", "body", "done"))
    b = ir.IRBuilder(entry)
    b.branch(head)
    b.position_at_end(head)
    off = b.phi(i64)
    accs = [b.phi(vt) for _ in range(accumulators)]
    zero = ir.Constant(vt, [0] * 8)
    off.add_incoming(ir.Constant(i64, 0), entry)
    for a in accs:
        a.add_incoming(zero, entry)
    b.cbranch(b.icmp_signed("<", off, n), body, done)
    b.position_at_end(body)
    if prefetch:
        pf = ir.Function(mod, ir.FunctionType(ir.VoidType(), [i8.as_pointer(), i32, i32, i32]), "llvm.prefetch.p0")
        for j in range(0, CHUNK, 64):
            b.call(pf, [b.gep(p, [b.add(off, ir.Constant(i64, prefetch + j))]), ir.Constant(i32, 0),
                        ir.Constant(i32, 3), ir.Constant(i32, 1)])
    new = list(accs)
    for j in range(CHUNK // 64):
        ptr = b.bitcast(b.gep(p, [b.add(off, ir.Constant(i64, 64 * j))]), vt.as_pointer())
        new[j % accumulators] = b.xor(new[j % accumulators], b.load(ptr, align=64))
    nxt = b.add(off, ir.Constant(i64, CHUNK))
    off.add_incoming(nxt, body)
    for a, v in zip(accs, new):
        a.add_incoming(v, body)
    b.branch(head)
    b.position_at_end(done)
    tot = accs[0]
    for a in accs[1:]:
        tot = b.xor(tot, a)
    r = b.extract_element(tot, ir.Constant(ir.IntType(32), 0))
    for j in range(1, 8):
        r = b.xor(r, b.extract_element(tot, ir.Constant(ir.IntType(32), j)))
    b.ret(r)
    return mod


def read_kernel(prefetch: int = 0):
    if prefetch not in _kernels:
        lib = Library(name="bandwidth")
        lib.add_ir(read_kernel_module(prefetch=prefetch))
        _kernels[prefetch] = lib.get_cfunc("read_xor", ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64)
    return _kernels[prefetch]


def _buffer(nbytes: int) -> np.ndarray:
    """A 64-B aligned, fully written buffer (untouched pages would all map the shared zero page)."""
    if nbytes not in _buffers:
        buf = aligned_empty(nbytes)
        buf.view(np.uint64)[:] = np.uint64(0x0123456789ABCDEF)
        _buffers[nbytes] = buf
    return _buffers[nbytes]


def run_threads(calls) -> float:
    """Run each zero-argument callable on its own Python thread, started together; wall seconds."""
    start = threading.Barrier(len(calls) + 1)
    done = []

    def worker(fn):
        start.wait()
        fn()
        done.append(time.perf_counter())

    ts = [threading.Thread(target=worker, args=(c,)) for c in calls]
    for t in ts:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return max(done) - t0


def measure_read_bandwidth(threads: int = 1, nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Best-of-`reps` read bandwidth in GB/s (1e9 B/s) over `nbytes` split evenly across `threads`
    (best over the PREFETCH_VARIANTS of the read loop, too)."""
    per = (nbytes // threads) // CHUNK * CHUNK
    buf = _buffer(per * threads)
    base = buf.ctypes.data
    best = float("inf")
    for _ in range(reps):
        for pf in PREFETCH_VARIANTS:
            fn = read_kernel(pf)
            fn(base, min(per, 1 << 20))  # warm the code path
            best = min(best, run_threads([lambda o=t * per, fn=fn: fn(base + o, per) for t in range(threads)]))
    return per * threads / best / 1e9


def busy_fraction(fn):
    """Run fn; return (its result, share of CPU time other processes used meanwhile, 0..1)."""

    def snap():
        with open("/proc/stat") as f:
            v = list(map(int, f.readline().split()[1:]))
        with open("/proc/self/stat") as f:
            s = f.read().rsplit(")", 1)[1].split()
        return sum(v), v[3] + v[4], int(s[11]) + int(s[12])  # total, idle + iowait, this process

    a = snap()
    out = fn()
    z = snap()
    total, idle, mine = z[0] - a[0], z[1] - a[1], z[2] - a[2]
    return out, max(0.0, (total - idle - mine) / max(total, 1))


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

    def _used(self):
        quiet = [v for v, busy in self.samples if busy <= self.threshold]
        return quiet or [v for v, _ in self.samples]

    def best(self) -> tuple:
        """Elementwise maximum (best throughput) over the samples used."""
        return tuple(map(max, *self._used())) if len(self._used()) > 1 else self._used()[0]

    def median_ratio(self, i: int, j: int) -> float:
        """Median over samples of v[i] / v[j]: both measured back to back, so noise mostly cancels."""
        return float(np.median([v[i] / v[j] for v in self._used()]))

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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-wait", type=float, default=60.0, help="seconds to wait for a quiet machine")
    args = ap.parse_args(argv)
    nbytes = int(args.gib * (1 << 30))
    res = {}
    for t in (int(v) for v in args.threads.split(",")):
        r = measure_rounds(lambda: (measure_read_bandwidth(t, nbytes, 1),), args.reps, args.max_wait)
        res[t] = r.best()[0]
        print(f"read bandwidth  threads={t}  {res[t]:6.2f} GB/s   ({nbytes / 2**30:.2f} GiB, {r.describe()})")
    if 1 in res:
        for t, bw in res.items():
            if t != 1:
                print(f"scaling {t} threads / 1 thread = {bw / res[1]:.2f}x")


if __name__ == "__main__":
    main()
