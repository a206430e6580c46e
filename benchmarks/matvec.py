"""Q4 tile mat-vec throughput vs the machine's read bandwidth, both measured in this run.

Weights: TinyLlama-1.1B layer shapes (QKV 2560x2048, O 2048x2048, gate+up 2x5632x2048 fused,
down 2048x5632), Q4 tiles, `--layers` distinct copies (22 layers = 545 MB, far past the 48 MiB
L3). One generated driver per thread runs every layer's kernels over its half of the tile-rows
(no barriers: this measures streaming, not synchronisation). Each round runs the read loop and
then the mat-vec, so both see the same machine state; rounds during which other processes used
the CPU are discarded and retried (up to --max-wait); each number is the best quiet round.

    python benchmarks/matvec.py [--layers 22] [--threads 1,2] [--rounds 5] [--emit asm]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import bandwidth  # noqa: E402
from llvmlite import ir  # noqa: E402

from cflow.codegen import kernels as K  # noqa: E402
from cflow.codegen.cache import ObjectCache  # noqa: E402
from cflow.codegen.library import Library  # noqa: E402
from cflow.codegen.target import host_target  # noqa: E402
from cflow.layout.quant import DType, quantize, quantize_activation_q8  # noqa: E402
from cflow.layout.tile import TileLayout, pack, pack_concat, pack_gate_up  # noqa: E402

D, FF, KV = 2048, 5632, 256
SHAPES = {"qkv": (D + 2 * KV, D), "o": (D, D), "gate_up": (FF, D), "down": (D, FF)}
ORDER = ("qkv", "o", "gate_up", "down")


def build(tile, isa, tuning):
    """One module: the four kernels (internal linkage, as a schedule would hold them) + a driver.

    drive(i8** w, i64 layers, i64* ranges, i8* xq0, f32* xd0, i32* xs0, i8* xq1, f32* xd1, i32* xs1, f32* y)
    ranges = (r0, r1) per kernel for the calling thread.
    """
    mod = ir.Module(name="bench_matvec")
    fns = {}
    for name in ORDER:
        L = TileLayout(DType.Q4, *SHAPES[name], tile)
        fns[name] = K.emit_matvec(mod, f"mv_{name}", L, isa, linkage="internal", gate_up=(name == "gate_up"),
                                  **tuning)
    P, i8, i32, i64, f32 = ir.PointerType, ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
    args = [P(P(i8)), i64, P(i64), P(i8), P(f32), P(i32), P(i8), P(f32), P(i32), P(f32)]
    drv = ir.Function(mod, ir.FunctionType(ir.VoidType(), args), "drive")
    w, n, rng, xq0, xd0, xs0, xq1, xd1, xs1, y = drv.args
    b = ir.IRBuilder(drv.append_basic_block("entry"))
    with K._Loop(b, ir.Constant(i64, 0), n, "layer") as layer:
        for j, name in enumerate(ORDER):
            wp = b.load(b.gep(w, [b.add(b.mul(layer, ir.Constant(i64, 4)), ir.Constant(i64, j))]))
            r0 = b.load(b.gep(rng, [ir.Constant(i64, 2 * j)]))
            r1 = b.load(b.gep(rng, [ir.Constant(i64, 2 * j + 1)]))
            act = (xq1, xd1, xs1) if name == "down" else (xq0, xd0, xs0)
            b.call(fns[name], [wp, ir.Constant(P(f32), None), *act, y, r0, r1])
    b.ret_void()
    return mod


def make_weights(tile, layers, seed=0):
    """Real Q4 packing for one layer, copied into `layers` separate buffers."""
    rng = np.random.default_rng(seed)
    mats = {k: rng.standard_normal(s).astype(np.float32) * 0.05 for k, s in SHAPES.items()}
    one = {
        "qkv": pack_concat([mats["qkv"][:D], mats["qkv"][D : D + KV], mats["qkv"][D + KV :]], "q4", tile)[0],
        "o": pack(mats["o"], "q4", tile),
        "gate_up": pack_gate_up(mats["gate_up"], mats["gate_up"][::-1].copy(), "q4", tile),
        "down": pack(mats["down"], "q4", tile),
    }
    bufs = [{k: v.copy() if i else v for k, v in one.items()} for i in range(layers)]
    return mats, one, bufs


def check(lib, tile, mats, one, isa):
    """Max relative error of the O projection vs the NumPy oracle (int8 activation emulation)."""
    L = TileLayout(DType.Q4, *SHAPES["o"], tile)
    mod = ir.Module(name="bench_check")
    K.emit_quantize_act(mod, "q", L.cols, L.cols_p)
    K.emit_matvec(mod, "mv", L, isa)
    mv = K.MatVec.__new__(K.MatVec)
    chk = Library(name="bench_check", cache=lib.cache)
    chk.add_ir(mod)
    vp = ctypes.c_void_p
    mv.layout, mv.gate_up = L, False
    mv._quant = chk.get_cfunc("q", None, vp, vp, vp, vp)
    mv._mv = chk.get_cfunc("mv", None, vp, vp, vp, vp, vp, vp, ctypes.c_int64, ctypes.c_int64)
    x = np.random.default_rng(1).standard_normal(L.cols).astype(np.float32)
    y = mv(one["o"], mv.activation(x))[: L.rows]
    t = quantize(mats["o"], "q4")
    aq, ad = quantize_activation_q8(x)
    ref = (((t.q.astype(np.int64) - 8) * aq[None].astype(np.int64)).sum(-1) * t.scales.astype(np.float64) * ad).sum(-1)
    return float(np.abs(y - ref).max() / np.abs(ref).max())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-wait", type=float, default=120.0, help="seconds to wait for quiet rounds per thread count")
    ap.add_argument("--tile", default="128x256")
    ap.add_argument("--isa", default=None, help="avx512vnni | avx2 | generic (default: host)")
    ap.add_argument("--max-groups", type=int, default=K.MAX_GROUPS, help="16-row accumulators per pass")
    ap.add_argument("--unroll", type=int, default=K.DEFAULT_UNROLL, help="block units per loop iteration")
    ap.add_argument("--prefetch", type=int, default=K.DEFAULT_PREFETCH, help="prefetch distance (bytes, 0 = off)")
    ap.add_argument("--prefetch-locality", type=int, default=K.DEFAULT_PREFETCH_LOCALITY, help="3 = prefetcht0, 2 = t1")
    ap.add_argument("--emit", choices=["asm", "llvm"], default=None, help="print the driver module and exit")
    args = ap.parse_args(argv)
    tile = tuple(int(v) for v in args.tile.lower().split("x"))
    target = host_target()
    isa = args.isa or target.isa
    threads = [int(t) for t in args.threads.split(",")]

    t0 = time.perf_counter()
    mod = build(tile, isa, dict(max_groups=args.max_groups, unroll=args.unroll, prefetch=args.prefetch,
                          prefetch_locality=args.prefetch_locality))
    t_emit = time.perf_counter() - t0
    print(f"target {target.describe()}  kernels={isa}  tile={tile[0]}x{tile[1]}")
    # Compile twice into a fresh cache directory: cold (LLVM opt + codegen), then a cache hit.
    with tempfile.TemporaryDirectory() as d:
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            lib = Library(name="bench_matvec", target=target, cache=ObjectCache(d))
            lib.add_ir(mod)
            lib.finalize()
            times.append((time.perf_counter() - t0, lib.stats))
    (cold, st0), (warm, st1) = times
    assert not st0["cache_hit"] and st1["cache_hit"]
    print(f"compile: IR emission {t_emit:.3f}s; cold {cold:.3f}s (optimise {st0['optimise_s']:.3f}s, codegen "
          f"{st0['codegen_s']:.3f}s); cached {warm:.3f}s (optimise {st1['optimise_s']:.3f}s, load "
          f"{st1['codegen_s']:.3f}s) = {cold / warm:.0f}x faster")
    if args.emit:
        print(lib.get_asm_str() if args.emit == "asm" else lib.get_llvm_str())
        return
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    drive = lib.get_cfunc("drive", None, vp, i64, vp, vp, vp, vp, vp, vp, vp, vp)

    mats, one, bufs = make_weights(tile, args.layers)
    print(f"oracle check (O projection): max rel err {check(lib, tile, mats, one, isa):.1e}")
    nbytes = sum(v.size for layer in bufs for v in layer.values())
    table = (ctypes.c_void_p * (4 * args.layers))(*[layer[k].ctypes.data for layer in bufs for k in ORDER])
    act = [K.Activation(D, D), K.Activation(FF, FF)]
    for a in act:
        a.xq[:] = np.random.default_rng(2).integers(-127, 128, a.xq.size)
        a.xd[:] = 0.01
    y = np.zeros(2 * FF + 512, np.float32)
    print(f"weights: {args.layers} layers x {nbytes / args.layers / 1e6:.1f} MB = {nbytes / 1e6:.0f} MB Q4")

    def ranges(tid, nt):
        out = []
        for name in ORDER:
            n = TileLayout(DType.Q4, *SHAPES[name], tile).n_tile_rows
            out += [n * tid // nt, n * (tid + 1) // nt]
        return (ctypes.c_int64 * 8)(*out)

    def run_matvec(nt):
        rs = [ranges(t, nt) for t in range(nt)]
        calls = [lambda r=r: drive(table, args.layers, r, vp(act[0].xq.ctypes.data), vp(act[0].xd.ctypes.data),
                                   vp(act[0].xs.ctypes.data), vp(act[1].xq.ctypes.data), vp(act[1].xd.ctypes.data),
                                   vp(act[1].xs.ctypes.data), vp(y.ctypes.data)) for r in rs]
        return nbytes / bandwidth.run_threads(calls) / 1e9

    run_matvec(1)  # warm up: page in everything once
    for t in threads:
        # One round = read loop then mat-vec, back to back; rounds disturbed by other processes are retried.
        r = bandwidth.measure_rounds(lambda t=t: (bandwidth.measure_read_bandwidth(t, reps=1), run_matvec(t)),
                                     args.rounds, args.max_wait)
        bw, mv = r.best()
        print(f"threads={t}  read {bw:6.2f} GB/s   q4 matvec {mv:6.2f} GB/s   = {mv / bw:5.1%} of read bandwidth"
              f"   (median of per-round ratios {r.median_ratio(1, 0):.1%}; {r.describe()})")


if __name__ == "__main__":
    main()
