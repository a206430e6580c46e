"""The attention core alone (codegen/ops.py:attention): one decode token's attention over a long KV cache.

    python benchmarks/attention.py --contexts 16,1024,2048,4064 --kv f16,f32,bf16 --json out.json

TinyLlama-1.1B's attention geometry by default (32 query heads, 4 KV heads of 64, max_seq 4096): the compiled
function runs for every kv head on one thread at position P, over a cache filled with random K/V, and is timed
(best of --reps calls after a warm-up; --layers N calls N caches in turn, so that with TinyLlama's 22 they stream
from DRAM as in decode, and reports the time per call). Reported: microseconds per call (one layer of one token),
the K/V bytes the call reads and the rate it reads them at, next to the read bandwidth measured in the same run,
and the call's arithmetic floor: its multiply-adds at the FMA rate one core reaches on registers (fma_rate; for
bf16, whose dot-product instruction does two multiply-adds per lane, half that time). bf16 uses VDPBF16PS where
the host has AVX512_BF16; CFLOW_FEATURES=-avx512bf16 times its FMA emulation instead. --prefetch times the K/V
scans at other prefetch distances (codegen/attn_tune.py, whose harness this is).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bandwidth import measure_read_bandwidth  # noqa: E402

from cflow.codegen.attn_tune import AttentionBench  # noqa: E402
from cflow.codegen.cgutils import P, f32, i64  # noqa: E402
from cflow.codegen.library import Library  # noqa: E402
from cflow.codegen.ops import KV_PREFETCH  # noqa: E402
from cflow.codegen.target import cpu_model, host_target  # noqa: E402


def fma_rate(reps: int = 5) -> float:
    """Multiply-adds per second one core issues on registers: 12 independent <16 x float> FMA chains in a loop
    (no memory), best of reps. The arithmetic floor of a call is its multiply-adds / this rate."""
    from llvmlite import ir

    from cflow.codegen.cgutils import Loop, V, c64, const_vec, intrinsic

    t = host_target()
    m = ir.Module(name="fma_peak")
    vt = V(f32, 16)
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), [P(f32), i64]), "fma_peak")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    fma = intrinsic(m, "llvm.fma.v16f32", vt, [vt, vt, vt])
    x = b.load(b.bitcast(fn.args[0], P(vt)), align=4)
    y = b.fadd(x, const_vec(f32, 16, 1e-7))
    accs = [b.alloca(vt) for _ in range(12)]
    for k, a in enumerate(accs):
        b.store(const_vec(f32, 16, float(k)), a)
    with Loop(b, c64(0), fn.args[1], "i"):
        for a in accs:
            b.store(b.call(fma, [b.load(a), x, y]), a)
    tot = b.load(accs[0])
    for a in accs[1:]:
        tot = b.fadd(tot, b.load(a))
    b.store(tot, b.bitcast(fn.args[0], P(vt)), align=4)
    b.ret_void()
    lib = Library(name="fma_peak", target=t, cache=None)
    lib.add_ir(m)
    lib.finalize()
    f = lib.get_cfunc("fma_peak", None, ctypes.c_void_p, ctypes.c_int64)
    buf = np.ones(16, np.float32) * 0.999
    n = 2_000_000
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f(buf.ctypes.data, n)
        best = min(best, time.perf_counter() - t0)
    return 12 * 16 * n / best


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
    ap.add_argument("--json", help="write the records here")
    a = ap.parse_args(argv)
    H, KV, hd, S = a.heads, a.kv_heads, a.head_dim, a.max_seq
    bw = measure_read_bandwidth(1, 1 << 30)
    peak = fma_rate()
    print(f"# {cpu_model()}, 1 thread, read bandwidth {bw:.2f} GB/s, {peak / 1e9:.1f} G multiply-adds/s (f32 FMA on "
          f"registers); H={H} KV={KV} hd={hd} max_seq={S}")
    print(f"  {'kv':<4} {'pf':>6} {'P':>5} {'us/call':>9} {'K/V MB':>7} {'GB/s':>6} {'% read':>7} {'FMA floor us':>12} "
          f"{'% of FMA peak':>13}")
    recs = []
    for kv in a.kv.split(","):
        for pf in (int(x) for x in a.prefetch.split(",")):
            bench = AttentionBench(H, KV, hd, kv, S, host_target(), distances=(pf,), n_caches=a.layers)
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
                floor = 2 * H * hd * (pos + 1) / peak  # q.k and p.v: one multiply-add per query head, dim, position
                floor /= 2 if kv == "bf16" else 1  # two per lane per instruction
                print(f"  {kv:<4} {pf:>6} {pos:>5} {1e6 * best:9.1f} {nbytes / 1e6:7.2f} {rate:6.2f} "
                      f"{100 * rate / bw:6.1f}% {1e6 * floor:12.1f} {100 * floor / best:12.1f}%", flush=True)
                recs.append({"kv": kv, "kv_prefetch": pf, "pos": pos, "us": round(1e6 * best, 2), "kv_bytes": nbytes,
                             "gbps": round(rate, 3), "layers": a.layers, "read_gbps": round(bw, 3),
                             "fma_per_s": round(peak), "fma_floor_us": round(1e6 * floor, 2),
                             "cpu": cpu_model(), "heads": H, "kv_heads": KV, "head_dim": hd})
            del bench
    if a.json:
        with open(a.json, "w") as f:
            json.dump(recs, f, indent=2)


if __name__ == "__main__":
    main()
