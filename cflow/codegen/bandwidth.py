"""The machine's read bandwidth, measured the way the kernels read: a STREAM-like loop built with llvmlite.

Decode speed is judged against this number, measured in the same run at the same thread count
(`cflow bench`, benchmarks/decode.py). NumPy's a.sum() is compute-bound near 9 GB/s here, so it
cannot measure it. The loop XORs 64-byte loads into 8 independent accumulators; threads are Python
threads, each calling the native function on its own contiguous slice (ctypes releases the GIL).
"""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
from llvmlite import ir

from ..layout.tile import aligned_empty
from .library import utility_functions

CHUNK = 512  # bytes per loop iteration: 8 accumulators x 64 B
# The reference is the faster of a plain loop and one with the kernels' software prefetch (2304 B
# ahead, prefetcht0; ~5% faster here): the mat-vec must not be flattered by a weaker read loop.
PREFETCH_VARIANTS = (0, 2304)
_buffers: dict[int, np.ndarray] = {}


def read_kernel_module(accumulators: int = CHUNK // 64, prefetch: int = 0, work=None,
                       chunk: int = CHUNK) -> ir.Module:
    """i64 read_xor(i8* p, i64 nbytes): XOR of all 64-byte vectors in p[0:nbytes] (nbytes % chunk == 0).

    accumulators: independent 64-byte XOR chains per iteration (must divide chunk / 64); prefetch: optional
    software-prefetch distance in bytes (0 = hardware prefetchers only, the default). work(builder, acc, v, at): the
    accumulator's next value from a loaded <8 x i64> vector (at: its i64 byte offset) instead of acc ^ v; chunk:
    bytes per loop iteration (benchmarks/stream_work.py: the same loop with more work per line, in longer
    iterations)."""
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
        for j in range(0, chunk, 64):
            b.call(pf, [b.gep(p, [b.add(off, ir.Constant(i64, prefetch + j))]), ir.Constant(i32, 0),
                        ir.Constant(i32, 3), ir.Constant(i32, 1)])
    new = list(accs)
    for j in range(chunk // 64):
        at = b.add(off, ir.Constant(i64, 64 * j))
        v = b.load(b.bitcast(b.gep(p, [at]), vt.as_pointer()), align=64)
        acc = new[j % accumulators]
        new[j % accumulators] = work(b, acc, v, at) if work else b.xor(acc, v)
    nxt = b.add(off, ir.Constant(i64, chunk))
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
    return utility_functions(f"bandwidth-pf{prefetch}", lambda: read_kernel_module(prefetch=prefetch),
                             {"read_xor": (ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64)})["read_xor"]


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
