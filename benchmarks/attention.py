"""The attention core alone (codegen/ops.py:attention): one decode token's attention over a long KV cache.

    python benchmarks/attention.py --contexts 16,1024,2048,4064 --kv f16,f32,bf16 --json out.json

TinyLlama-1.1B's attention geometry by default (32 query heads, 4 KV heads of 64, max_seq 4096): the compiled
function runs for every kv head on one thread at position P, over a cache filled with random K/V, and is timed
(best of --reps calls after a warm-up; --layers N calls N caches in turn, so that with TinyLlama's 22 they stream
from DRAM as in decode, and reports the time per call). Reported: microseconds per call (one layer of one token),
the K/V bytes the call reads and the rate it reads them at, next to the read bandwidth measured in the same run,
and the call's arithmetic floor: its multiply-adds at the FMA rate one core reaches on registers (fma_rate; for
bf16, whose dot-product instruction does two multiply-adds per lane, half that time). bf16 uses VDPBF16PS where
the host has AVX512_BF16; CFLOW_FEATURES=-avx512bf16 times its FMA emulation instead.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bandwidth import measure_read_bandwidth  # noqa: E402

from cflow.codegen import ops as O  # noqa: E402
from cflow.codegen.abi import KV_BYTES, kv_floats_per_layer  # noqa: E402
from cflow.codegen.cgutils import P, f32, i16, i64  # noqa: E402
from cflow.codegen.library import Library  # noqa: E402
from cflow.codegen.target import cpu_model, host_target  # noqa: E402
from cflow.ir import Attention  # noqa: E402
from cflow.layout.quant import bf16_bits  # noqa: E402


def build(H: int, KV: int, hd: int, kv: str, max_seq: int):
    from llvmlite import ir

    t = host_target()
    n = Attention(name="attn.1", inputs=("x",), prefix="layers.1.attn", dim=H * hd, n_heads=H, n_kv_heads=KV,
                  head_dim=hd, rope_theta=10000.0)
    m = ir.Module(name="attn_bench")
    offs = (0, H * hd, H * hd + KV * hd)
    import inspect

    # (an older cflow's attention took no max_seq: PYTHONPATH=<old checkout> runs this script against it)
    extra = (max_seq,) if "max_seq" in inspect.signature(O.attention).parameters else ()
    extra += (t.has_avx512_bf16,) if kv == "bf16" else ()
    fn = O.attention(m, n, offs, t.isa, kv, *extra)
    kvp = P(i16) if KV_BYTES[kv] == 2 else P(f32)
    args = [P(f32)] * 6 + [kvp, kvp] + [P(f32)] * 4 + [i64, i64, i64]
    w = ir.Function(m, ir.FunctionType(ir.VoidType(), args), "attn_entry")
    b = ir.IRBuilder(w.append_basic_block("entry"))
    b.call(fn, list(w.args))
    b.ret_void()
    lib = Library(name="attn_bench", target=t, cache=None)
    lib.add_ir(m)
    lib.finalize()
    vp = ctypes.c_void_p
    return lib, lib.get_cfunc("attn_entry", None, *([vp] * 12), ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)


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
    ap.add_argument("--layers", type=int, default=1, help="caches called in turn (22: TinyLlama's, from DRAM)")
    ap.add_argument("--json", help="write the records here")
    a = ap.parse_args(argv)
    H, KV, hd, S = a.heads, a.kv_heads, a.head_dim, a.max_seq
    rng = np.random.default_rng(0)
    ang = rng.random((S, hd // 2)).astype(np.float32)  # any angles: the timing does not depend on them
    cos, sin = np.cos(ang), np.sin(ang)
    qkv = rng.standard_normal((H + 2 * KV) * hd).astype(np.float32)
    att = np.zeros(H * hd, np.float32)
    scores = np.zeros((H // KV) * (S + 32), np.float32)
    bw = measure_read_bandwidth(1, 1 << 30)
    peak = fma_rate()
    print(f"# {cpu_model()}, 1 thread, read bandwidth {bw:.2f} GB/s, {peak / 1e9:.1f} G multiply-adds/s (f32 FMA on "
          f"registers); H={H} KV={KV} hd={hd} max_seq={S}")
    print(f"  {'kv':<4} {'P':>5} {'us/call':>9} {'K/V MB':>7} {'GB/s':>6} {'% read':>7} {'FMA floor us':>12} "
          f"{'% of FMA peak':>13}")
    recs = []
    for kv in a.kv.split(","):
        lib, fn = build(H, KV, hd, kv, S)
        esz = KV_BYTES[kv]
        per = kv_floats_per_layer(SimpleNamespace(n_kv_heads=KV, head_dim=hd), S)  # K (or V) entries
        one = rng.standard_normal(2 * per).astype(np.float32)
        one = one.astype(np.float16).view(np.int16) if kv == "f16" else bf16_bits(one) if kv == "bf16" else one
        caches = [one.copy() for _ in range(a.layers)]  # one per layer: with many, they stream from DRAM
        ps = [[qkv.ctypes.data] + [None] * 5 + [c[:per].ctypes.data, c[per:].ctypes.data,
                                                  cos.ctypes.data, sin.ctypes.data, att.ctypes.data,
                                                  scores.ctypes.data] for c in caches]
        for pos in (int(x) for x in a.contexts.split(",")):
            for p in ps:
                fn(*p, pos, 0, KV)
            best = float("inf")
            for _ in range(a.reps):
                t0 = time.perf_counter()
                for p in ps:
                    fn(*p, pos, 0, KV)
                best = min(best, (time.perf_counter() - t0) / len(ps))
            nbytes = 2 * (pos + 1) * KV * hd * esz
            rate = nbytes / best / 1e9
            floor = 2 * H * hd * (pos + 1) / peak  # q.k and p.v: one multiply-add per query head, dim, position
            floor /= 2 if kv == "bf16" else 1  # two per lane per instruction
            print(f"  {kv:<4} {pos:>5} {1e6 * best:9.1f} {nbytes / 1e6:7.2f} {rate:6.2f} {100 * rate / bw:6.1f}% "
                  f"{1e6 * floor:12.1f} {100 * floor / best:12.1f}%", flush=True)
            recs.append({"kv": kv, "pos": pos, "us": round(1e6 * best, 2), "kv_bytes": nbytes, "gbps": round(rate, 3),
                         "layers": a.layers, "read_gbps": round(bw, 3), "fma_per_s": round(peak),
                         "fma_floor_us": round(1e6 * floor, 2),
                         "cpu": cpu_model(), "heads": H, "kv_heads": KV, "head_dim": hd})
        del lib
    if a.json:
        with open(a.json, "w") as f:
            json.dump(recs, f, indent=2)


if __name__ == "__main__":
    main()
