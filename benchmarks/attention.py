"""The attention core alone (codegen/attention.py:attention): one decode token's attention over a long KV cache.

    python -m benchmarks.attention --contexts 16,1024,2048,4064 --kv f16,f32,bf16 [--json [FILE]]

TinyLlama-1.1B's attention geometry by default (32 query heads, 4 KV heads of 64, max_seq 4096): the compiled
function runs for every kv head on one thread at position P, over a cache filled with random K/V, and is timed
(best of --reps calls after a warm-up; --layers N calls N caches in turn, so that with TinyLlama's 22 they stream
from DRAM as in decode, and reports the time per call). Reported: microseconds per call (one layer of one token),
the K/V bytes the call reads and the rate it reads them at, next to the read bandwidth measured in the same run,
and the call's arithmetic floor: its multiply-adds at the rate one core reaches on registers with the instruction
the core uses (fma_rate; for bf16 on an AVX512_BF16 host, VDPBF16PS's rate: bf16_rate). bf16 uses VDPBF16PS where
the host has AVX512_BF16; CFLOW_FEATURES=-avx512bf16 times its FMA emulation instead. --prefetch times the K/V
scans at other prefetch distances (codegen/attn_tune.py, whose harness this is).
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np

from benchmarks.common.bandwidth import read_gbs
from benchmarks.common.record import Run, add_json_argument
from cflow.codegen.attention import KV_PREFETCH
from cflow.codegen.attn_tune import AttentionBench
from cflow.codegen.cgutils import P, f32, i64
from cflow.codegen.library import Library
from cflow.codegen.target import cpu_model, host_target


def _peak(name: str, step, reps: int) -> float:
    """Instructions per second one core issues on registers: 12 independent <16 x float> chains of step(b, acc, x,
    y) in a loop (no memory), best of reps."""
    from llvmlite import ir

    from cflow.codegen.cgutils import Loop, V, c64, const_vec

    t = host_target()
    m = ir.Module(name=name)
    vt = V(f32, 16)
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), [P(f32), i64]), name)
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    x = b.load(b.bitcast(fn.args[0], P(vt)), align=4)
    y = b.fadd(x, const_vec(f32, 16, 1e-7))
    accs = [b.alloca(vt) for _ in range(12)]
    for k, a in enumerate(accs):
        b.store(const_vec(f32, 16, float(k)), a)
    with Loop(b, c64(0), fn.args[1], "i"):
        for a in accs:
            b.store(step(b, b.load(a), x, y), a)
    tot = b.load(accs[0])
    for a in accs[1:]:
        tot = b.fadd(tot, b.load(a))
    b.store(tot, b.bitcast(fn.args[0], P(vt)), align=4)
    b.ret_void()
    lib = Library(name=name, target=t, cache=None)
    lib.add_ir(m)
    lib.finalize()
    f = lib.get_cfunc(name, None, ctypes.c_void_p, ctypes.c_int64)
    buf = np.ones(16, np.float32) * 0.999
    n = 2_000_000
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f(buf.ctypes.data, n)
        best = min(best, time.perf_counter() - t0)
    return 12 * n / best


def fma_rate(reps: int = 5) -> float:
    """Multiply-adds per second one core issues on registers (f32 FMA, 16 lanes). The arithmetic floor of a call is
    its multiply-adds / this rate."""
    from cflow.codegen.cgutils import V, intrinsic

    vt = V(f32, 16)

    def fma(b, acc, x, y):
        return b.call(intrinsic(b.module, "llvm.fma.v16f32", vt, [vt] * 3), [x, y, acc])

    return 16 * _peak("fma_peak", fma, reps)


def bf16_rate(reps: int = 5) -> float:
    """Multiply-adds per second of VDPBF16PS on registers (two per lane, 16 lanes; cgutils.bf16_dot). On the AMX
    Xeon VM this was half the f32 FMA rate, not twice it (docs/journal/performance.md, "Long contexts")."""
    from cflow.codegen.cgutils import V, bf16_dot, i32

    def dot(b, acc, x, y):
        return bf16_dot(b, acc, b.bitcast(x, V(i32, 16)), b.bitcast(y, V(i32, 16)), True)

    return 32 * _peak("bf16_peak", dot, reps)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--max-seq", type=int, default=4096)
    ap.add_argument("--contexts", default="16,1024,2048,4064", help="positions P (the token attends to P + 1)")
    ap.add_argument("--kv", default="f16,f32", help="cache types")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--prefetch", default=str(KV_PREFETCH),
                    help="the K/V scans' prefetch distances to time, bytes (default: the built-in default; this "
                         "host's tuned choice is in `cflow tune`)")
    ap.add_argument("--layers", type=int, default=1, help="caches called in turn (22: TinyLlama's, from DRAM)")
    ap.add_argument("--softcap", type=float, default=0.0,
                    help="Gemma 2's attention score cap, cap * tanh(s / cap) before the softmax (default 0: none)")
    add_json_argument(ap, "write one record per cache type, prefetch distance and position")
    a = ap.parse_args(argv)
    run = Run("attention", argv)
    H, KV, hd, S = a.heads, a.kv_heads, a.head_dim, a.max_seq
    bw = read_gbs(1)
    peak = fma_rate()
    bf_peak = bf16_rate() if host_target().has_avx512_bf16 else 0.0
    bf = f", {bf_peak / 1e9:.1f} G with VDPBF16PS (bf16's floor)" if bf_peak else ""
    print(f"# {cpu_model()}, 1 thread, read bandwidth {bw:.2f} GB/s, {peak / 1e9:.1f} G multiply-adds/s (f32 FMA on "
          f"registers){bf}; H={H} KV={KV} hd={hd} max_seq={S}" + (f" softcap={a.softcap:g}" if a.softcap else ""))
    print(f"  {'kv / unit':<11} {'pf':>6} {'P':>5} {'us/call':>9} {'K/V MB':>7} {'GB/s':>6} {'% read':>7} "
          f"{'FMA floor us':>12} {'% of FMA peak':>13}")
    recs = []
    for kv in a.kv.split(","):
        for pf in (int(x) for x in a.prefetch.split(",")):
            bench = AttentionBench(H, KV, hd, kv, S, host_target(), distances=(pf,), n_caches=a.layers,
                                   softcap=a.softcap)
            for pos in (int(x) for x in a.contexts.split(",")):
                for c in range(a.layers):
                    bench.call(0, c, pos)
                best = float("inf")
                for _ in range(a.reps):
                    t0 = time.perf_counter()
                    for c in range(a.layers):
                        bench.call(0, c, pos)
                    best = min(best, (time.perf_counter() - t0) / a.layers)
                nbytes = bench.kv_bytes(pos)
                rate = nbytes / best / 1e9
                # q.k and p.v: one multiply-add per query head, dim, position, at the rate of the instruction used
                # (the tile unit's own rate is not measured: for bf16/amx this is VDPBF16PS's floor, a reference)
                floor = 2 * H * hd * (pos + 1) / (bf_peak if kv == "bf16" and bf_peak else peak)
                label = kv + (f"/{bench.unit}" if bench.unit else "")  # bf16: amx, dpbf16 or the emulation
                print(f"  {label:<11} {pf:>6} {pos:>5} {1e6 * best:9.1f} {nbytes / 1e6:7.2f} {rate:6.2f} "
                      f"{100 * rate / bw:6.1f}% {1e6 * floor:12.1f} {100 * floor / best:12.1f}%", flush=True)
                recs.append(run.record(
                    engine="attention core", model=f"heads {H}/{KV} of {hd}, max_seq {S}", threads=1,
                    variant=f"{label} pf {pf} pos {pos}", read_gbs=round(bw, 3), kv=kv, bf16_unit=bench.unit,
                    kv_prefetch=pf, pos=pos, us=round(1e6 * best, 2), kv_bytes=nbytes, gbps=round(rate, 3),
                    layers=a.layers, fma_per_s=round(peak), bf16_dot_per_s=round(bf_peak),
                    fma_floor_us=round(1e6 * floor, 2), heads=H, kv_heads=KV, head_dim=hd, softcap=a.softcap))
            del bench
    run.write(a.json, recs)


if __name__ == "__main__":
    main()
