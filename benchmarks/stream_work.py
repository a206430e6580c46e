"""How work per cache line changes one core's streaming rate: the read loop with k extra vector ops per 64-byte line.

    python -m benchmarks.stream_work [--ops 0,2,4,8,16] [--kind alu,indep,dp] [--prefetch 0,4608] [--lines 8,36]
                                     [--rounds 2] [--json [FILE]]

Each variant is codegen.bandwidth's read loop itself (8 independent 64-byte loads per iteration) where every loaded
vector also goes through k ops before it is folded into its accumulator: `alu`, k alternating XOR / ADD with
constants (1-cycle integer ops, a chain of k per line); `indep`, the same k ops on a vector that does not depend on
any load (the line's offset, broadcast), folded into the accumulator by one XOR: about as many instructions (k + 3
per line against alu's k + 1), but they execute at once instead of waiting in the scheduler for the line; `dp`, k
VPDPBUSD into the line's accumulator (the Q4 and Q8 kernels' instruction, a loop-carried chain; AVX-512 VNNI hosts
only). `--prefetch D` adds the read loop's own software prefetch (prefetcht0 of every line D bytes ahead); `--lines
N` makes one loop iteration N lines long instead of 8 (the Q4 kernel's unit loop is 36 lines per iteration, its
group loop 4.5; gcd(8, N) accumulators). Each is timed over a 1 GiB buffer (streamed from DRAM) and over a 256 KiB
one (L2-resident: what the core issues when memory is not the limit), in the same round. The questions it answers:
does a loop that is far from instruction-bound in cache still lose DRAM rate as its work per line grows, and does
the length of its iterations matter (docs/journal/performance.md, "A second host kind", "Short loop bodies")?
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import math
import time

import numpy as np
from llvmlite import ir

from benchmarks.common.record import Run, add_json_argument
from cflow.codegen.bandwidth import read_kernel_module
from cflow.codegen.cgutils import intrinsic
from cflow.codegen.library import Library
from cflow.codegen.target import ISA, cpu_model, host_target
from cflow.layout.tile import aligned_empty


def work(kind: str, k: int):
    """The read loop's per-line step (codegen.bandwidth.read_kernel_module's `work`): acc' from acc and the line."""
    i32 = ir.IntType(32)
    vt, vi = ir.VectorType(ir.IntType(64), 8), ir.VectorType(i32, 16)
    def step(b, acc, t, at):
        if kind == "indep":  # k ops on the line's offset broadcast, per-lane constants so they stay vector ops
            x = b.shuffle_vector(b.insert_element(ir.Constant(vt, ir.Undefined), at, ir.Constant(i32, 0)),
                                ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(i32, 8), [0] * 8))
            for i in range(k):
                c = ir.Constant(vt, [(0x9E3779B97F4A7C15 * (i + 1) + e) % (1 << 63) for e in range(8)])
                x = b.xor(x, c) if i % 2 == 0 else b.add(x, c)
            return b.xor(b.xor(acc, t), x) if k else b.xor(acc, t)
        if kind == "dp":  # k VPDPBUSD into the accumulator (with k = 0: the plain XOR)
            if k == 0:
                return b.xor(acc, t)
            dp = intrinsic(b.module, "llvm.x86.avx512.vpdpbusd.512", vi, [vi, vi, vi])
            a, ti = b.bitcast(acc, vi), b.bitcast(t, vi)
            for i in range(k):
                a = b.call(dp, [a, ti, ir.Constant(vi, [0x01010101 * (i + 1)] * 16)])
            return b.bitcast(a, vt)
        for i in range(k):  # k alternating XOR / ADD with constants on the line, then into the accumulator
            c = ir.Constant(vt, [(0x9E3779B97F4A7C15 * (i + 1) + e) % (1 << 63) for e in range(8)])
            t = b.xor(t, c) if i % 2 == 0 else b.add(t, c)
        return b.xor(acc, t)

    return step


def build(kind: str, k: int, target, prefetch: int = 0, lines: int = 8):
    lib = Library(name=f"stream_{kind}{k}_pf{prefetch}_n{lines}", target=target, cache=None)
    lib.add_ir(read_kernel_module(accumulators=math.gcd(8, lines), prefetch=prefetch, work=work(kind, k),
                                  chunk=64 * lines))
    lib.finalize()
    f = lib.get_cfunc("read_xor", ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64)
    f.library = lib
    return f


def rate(f, buf: np.ndarray, total: int, reps: int) -> float:
    """GB/s over `total` bytes (passes over buf), best of reps."""
    passes = max(1, total // buf.size)
    f(buf.ctypes.data, buf.size)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(passes):
            f(buf.ctypes.data, buf.size)
        best = min(best, time.perf_counter() - t0)
    return passes * buf.size / best / 1e9


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="0,2,4,8,16", help="extra ops per line (comma list)")
    ap.add_argument("--kind", default="alu,indep,dp", help="alu, indep and/or dp (dp needs AVX-512 VNNI)")
    ap.add_argument("--prefetch", default="0", help="software prefetch distances in bytes (comma list; 0 = none)")
    ap.add_argument("--lines", default="8", help="64-byte lines per loop iteration (comma list)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dram-bytes", type=int, default=1 << 30)
    ap.add_argument("--l2-bytes", type=int, default=256 << 10)
    add_json_argument(ap, "write one record per round, loop kind, prefetch, line count and ops per line")
    a = ap.parse_args(argv)
    run = Run("stream_work", argv)
    target = host_target()
    kinds = [x for x in a.kind.split(",") if x != "dp" or target.isa == ISA.AVX512VNNI]
    ops = [int(x) for x in a.ops.split(",")]
    pfs = [int(x) for x in a.prefetch.split(",")]
    lines = [int(x) for x in a.lines.split(",")]
    if any(n <= 0 for n in lines):
        ap.error("--lines: positive line counts")
    fns = {(kd, k, pf, n): build(kd, k, target, pf, n) for kd in kinds for k in ops for pf in pfs for n in lines}
    step = 64 * math.lcm(*lines)  # every variant's loop needs whole iterations
    big, small = aligned_empty(a.dram_bytes // step * step), aligned_empty(max(step, a.l2_bytes // step * step))
    for buf in (big, small):
        buf.view(np.uint64)[:] = 0x0123456789ABCDEF  # written: untouched pages would all map the zero page
    print(f"# {cpu_model()}, 1 thread; GB/s over {big.size / 2**30:.2f} GiB (DRAM) and {small.size >> 10} KiB (L2)")
    recs = []
    for r in range(a.rounds):
        for kd, pf, n in itertools.product(kinds, pfs, lines):
            row = []
            for k in ops:
                f = fns[kd, k, pf, n]
                dram, l2 = rate(f, big, big.size, 3), rate(f, small, 1 << 30, 3)
                recs.append(run.record(engine="read loop", threads=1, variant=f"{kd} ops {k} pf {pf} lines {n}",
                                       round=r, kind=kd, ops_per_line=k, prefetch=pf, lines=n,
                                       dram_gbps=round(dram, 2), l2_gbps=round(l2, 2)))
                row.append(f"{k:2d}: {dram:5.1f} / {l2:5.1f}")
            print(f"round {r} {kd:5} pf {pf:5d} lines {n:3d}  ops: DRAM / L2 GB/s   " + "   ".join(row), flush=True)
    run.write(a.json, recs)
    return recs


if __name__ == "__main__":
    main()
