"""Q4 tile mat-vec throughput vs the machine's read bandwidth, both measured in this run.

Weights: TinyLlama-1.1B layer shapes (QKV 2560x2048, O 2048x2048, gate+up 2x5632x2048 fused,
down 2048x5632), Q4 tiles, `--layers` distinct copies (22 layers = 545 MB, far past the 48 MiB
L3). One generated driver per thread runs every layer's kernels over its half of the tile-rows
(no barriers: this measures streaming, not synchronisation). Each round runs the read loop and
then the mat-vec, so both see the same machine state; rounds during which other processes used
the CPU are discarded and retried (up to --max-wait); each number is the best quiet round.

    python -m benchmarks.matvec [--layers 22] [--threads 1,2] [--rounds 5] [--emit asm]

--l1-limit (1 thread) runs each decode kernel over the SAME cache-resident weights (one L1-sized tile-row,
and one tile-row of the TinyLlama gate+up and down matrices, which stays in L2) and over >= 1 GB of distinct
copies streamed from DRAM, and the read loop, back to back per round; prints medians and the ratios:

    python -m benchmarks.matvec --l1-limit --rounds 3 [--json [FILE]]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import tempfile
import time

import numpy as np
from llvmlite import ir

from benchmarks.common.bandwidth import measure_read_bandwidth, run_threads
from benchmarks.common.record import Run, add_json_argument
from benchmarks.common.timing import measure_rounds
from cflow.codegen import kernels as K
from cflow.codegen.cache import ObjectCache
from cflow.codegen.cgutils import Loop
from cflow.codegen.library import Library
from cflow.codegen.target import cpu_model, host_target
from cflow.layout.quant import DType, quantize, quantize_activation_q8
from cflow.layout.tile import TileLayout, aligned_empty, pack, pack_concat, pack_gate_up

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
    with Loop(b, ir.Constant(i64, 0), n, "layer") as layer:
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
    mv = K.MatVec(L, target=lib.target, isa=isa, cache=lib.cache)  # the quantiser and the kernel, default knobs
    x = np.random.default_rng(1).standard_normal(L.cols).astype(np.float32)
    y = mv(one["o"], mv.activation(x))[: L.rows]
    t = quantize(mats["o"], "q4")
    aq, ad = quantize_activation_q8(x)
    ref = (((t.q.astype(np.int64) - 8) * aq[None].astype(np.int64)).sum(-1) * t.scales.astype(np.float64) * ad).sum(-1)
    return float(np.abs(y - ref).max() / np.abs(ref).max())


# -- --l1-limit: the same kernel on cache-resident weights vs streamed from DRAM ---------------------------------
# Each case is one emitted decode kernel (emit_matvec; default tuning unless --prefetch etc.) and a driver calling it
# `reps` times over `nmats` weight copies: nmats = 1 with many reps keeps the weights in L1 or L2, so the
# time is what one core needs to issue the loop's instructions; nmats copies of >= 1 GB with reps = 1
# stream from DRAM. Same machine code in both; only the data set differs.
LIMIT_CASES = {
    # name: (rows, cols, gate_up, tile-rows used when cache-resident)
    "l1_128x256": (128, 256, False, 1),  # one tile-row of 8 block units, 18 KiB: fits the 32 KiB L1d
    "gate_up_2048_5632": (FF, D, True, 1),  # TinyLlama gate+up: one tile-row pair = 288 KiB (L2)
    "down_5632_2048": (D, FF, False, 1),  # TinyLlama down: one tile-row = 396 KiB (L2)
}



def build_repeat(tile, isa, tuning):
    """One module: for every case its kernel + rep_<case>(i8** w, i64 nmats, i64 reps, i64 r1, xq, xd, xs, y):
    for r in range(reps): for m in range(nmats): kernel(w[m], null, xq, xd, xs, y, 0, r1)."""
    mod = ir.Module(name="bench_matvec_limit")
    P, i8, i32, i64, f32 = ir.PointerType, ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
    for name, (rows, cols, gu, _) in LIMIT_CASES.items():
        L = TileLayout(DType.Q4, rows, cols, tile)
        fn = K.emit_matvec(mod, f"mv_{name}", L, isa, linkage="internal", gate_up=gu, **tuning)
        args = [P(P(i8)), i64, i64, i64, P(i8), P(f32), P(i32), P(f32)]
        drv = ir.Function(mod, ir.FunctionType(ir.VoidType(), args), f"rep_{name}")
        w, nmats, reps, r1, xq, xd, xs, y = drv.args
        b = ir.IRBuilder(drv.append_basic_block("entry"))
        with Loop(b, ir.Constant(i64, 0), reps, "rep"):
            with Loop(b, ir.Constant(i64, 0), nmats, "m") as m:
                b.call(fn, [b.load(b.gep(w, [m])), ir.Constant(P(f32), None), xq, xd, xs, y,
                            ir.Constant(i64, 0), r1])
        b.ret_void()
    return mod


def l1_limit(args, tile, target, isa, tuning, run: Run):
    """Cache-resident GB/s (the instruction-throughput limit of one core), DRAM-streaming GB/s of the
    same kernel and the read bandwidth, 1 thread, one round = all of them back to back; medians."""
    lib = Library(name="bench_matvec_limit", target=target)
    lib.add_ir(build_repeat(tile, isa, tuning))
    lib.finalize()
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    rng = np.random.default_rng(0)
    cases = {}
    for name, (rows, cols, gu, rows_hot) in LIMIT_CASES.items():
        L = TileLayout(DType.Q4, rows, cols, tile)
        m = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        w = pack_gate_up(m, m[::-1].copy(), "q4", tile) if gu else pack(m, "q4", tile)
        per_row = L.tile_row_nbytes * (2 if gu else 1)
        act = K.Activation(cols, L.cols_p)
        act.xq[:] = rng.integers(-127, 128, act.xq.size)
        act.xd[:] = 0.01
        act.xs[:] = act.xq.reshape(-1, 32).sum(1)
        n_copies = -(-args.stream_bytes // w.size)  # DRAM set: distinct copies, >= stream_bytes in all
        big = aligned_empty(n_copies * w.size)  # contiguous, 64-B aligned copies, as a model's weights are laid out
        big.reshape(n_copies, w.size)[:] = w
        cases[name] = dict(
            fn=lib.get_cfunc(f"rep_{name}", None, vp, i64, i64, i64, vp, vp, vp, vp),
            hot=(ctypes.c_void_p * 1)(big.ctypes.data), hot_rows=rows_hot, hot_bytes=rows_hot * per_row,
            cold=(ctypes.c_void_p * n_copies)(*[big.ctypes.data + i * w.size for i in range(n_copies)]),
            n_copies=n_copies, cold_bytes=big.size, rows=L.n_tile_rows, act=act, keep=big,
            y=np.zeros(L.rows_p, np.float32), layout=f"Q4 {rows}x{cols}{' gate+up' if gu else ''}",
        )
        cases[name]["reps"] = max(1, int(args.hot_bytes // cases[name]["hot_bytes"]))

    def call(c, table, nmats, reps, r1):
        a = c["act"]
        t0 = time.perf_counter()
        c["fn"](table, nmats, reps, r1, vp(a.xq.ctypes.data), vp(a.xd.ctypes.data), vp(a.xs.ctypes.data),
                vp(c["y"].ctypes.data))
        return time.perf_counter() - t0

    def one_round():
        out = [measure_read_bandwidth(1, reps=1)]
        for c in cases.values():
            out.append(c["hot_bytes"] * c["reps"] / call(c, c["hot"], 1, c["reps"], c["hot_rows"]) / 1e9)
            out.append(c["cold_bytes"] / call(c, c["cold"], c["n_copies"], 1, c["rows"]) / 1e9)
        return tuple(out)

    for c in cases.values():  # warm up: page in every copy, warm the code
        call(c, c["cold"], c["n_copies"], 1, c["rows"])
        call(c, c["hot"], 1, 10, c["hot_rows"])
    r = measure_rounds(one_round, args.rounds, args.max_wait)
    used = r.used()
    med = np.median(np.array(used), axis=0)
    bw = float(med[0])
    cpu = cpu_model()
    print(f"cpu: {cpu}  ({os.cpu_count()} cpus)  kernels={isa}  tile={tile[0]}x{tile[1]}  1 thread  "
          f"medians of {len(used)} rounds ({r.describe()})")
    print(f"read bandwidth (cflow.codegen.bandwidth, 1 GiB): {bw:6.2f} GB/s")
    print(f"kernel tuning: {tuning}")
    extra = dict(tile=list(tile), tuning=tuning, rounds=len(used), quality=r.describe(), other_load_max=r.worst,
                 read_gbps_rounds=[v[0] for v in used])
    records = []
    print(f"{'kernel':24} {'resident set':>12} {'resident GB/s':>13} {'DRAM set':>9} {'DRAM GB/s':>9} "
          f"{'DRAM/resident':>13} {'DRAM/read':>9}")
    for k, (name, c) in enumerate(cases.items()):
        hot, cold = float(med[1 + 2 * k]), float(med[2 + 2 * k])
        print(f"{name:24} {c['hot_bytes'] / 1024:9.0f} KiB {hot:13.2f} {c['cold_bytes'] / 1e9:7.2f} GB {cold:9.2f} "
              f"{cold / hot:13.1%} {cold / bw:9.1%}")
        records.append(run.record(
            engine="q4 mat-vec", model=c["layout"], quant="q4", isa_path=str(isa), threads=1, variant=name,
            read_gbs=bw, resident_bytes=c["hot_bytes"], resident_reps=c["reps"], dram_bytes=c["cold_bytes"],
            dram_copies=c["n_copies"], resident_gbps=hot, dram_gbps=cold, dram_over_resident=cold / hot,
            dram_over_read=cold / bw, resident_over_read=hot / bw,
            resident_gbps_rounds=[v[1 + 2 * k] for v in used], dram_gbps_rounds=[v[2 + 2 * k] for v in used]))
    run.write(args.json, records, extra)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-wait", type=float, default=120.0, help="seconds to wait for quiet rounds per thread count")
    ap.add_argument("--tile", default="128x256")
    ap.add_argument("--isa", default=None, help="avx512vnni | avxvnni | avx2 | generic (default: host)")
    ap.add_argument("--max-groups", type=int, default=K.MAX_GROUPS, help="16-row accumulators per pass")
    ap.add_argument("--unroll", type=int, default=K.DEFAULT_UNROLL, help="block units per loop iteration")
    ap.add_argument("--prefetch", type=int, default=K.DEFAULT_PREFETCH, help="prefetch distance (bytes, 0 = off)")
    ap.add_argument("--prefetch-locality", type=int, default=K.DEFAULT_PREFETCH_LOCALITY, help="3 = prefetcht0, 2 = t1")
    ap.add_argument("--group-loop", type=int, default=0, choices=(0, 1),
                    help="1 = one 16-row group per loop iteration (the group_loop knob)")
    ap.add_argument("--emit", choices=["asm", "llvm"], default=None, help="print the driver module and exit")
    ap.add_argument("--l1-limit", action="store_true",
                    help="1 thread: decode kernels on cache-resident weights vs streamed from DRAM vs read bandwidth")
    ap.add_argument("--stream-bytes", type=float, default=1.1e9, help="--l1-limit: DRAM set per kernel (bytes)")
    ap.add_argument("--hot-bytes", type=float, default=2e9, help="--l1-limit: bytes consumed per resident timing")
    add_json_argument(ap, "write one record per thread count (per kernel with --l1-limit)")
    args = ap.parse_args(argv)
    run = Run("matvec", argv)
    tile = tuple(int(v) for v in args.tile.lower().split("x"))
    target = host_target()
    isa = args.isa or target.isa
    tuning = dict(max_groups=args.max_groups, unroll=args.unroll, prefetch=args.prefetch,
                  prefetch_locality=args.prefetch_locality, group_loop=args.group_loop)
    if args.l1_limit:
        args.stream_bytes = int(args.stream_bytes)
        return l1_limit(args, tile, target, isa, tuning, run)
    threads = [int(t) for t in args.threads.split(",")]

    t0 = time.perf_counter()
    mod = build(tile, isa, tuning)
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
        return nbytes / run_threads(calls) / 1e9

    run_matvec(1)  # warm up: page in everything once
    records = []
    for t in threads:
        # One round = read loop then mat-vec, back to back; rounds disturbed by other processes are retried.
        r = measure_rounds(lambda t=t: (measure_read_bandwidth(t, reps=1), run_matvec(t)), args.rounds,
                           args.max_wait)
        bw, mv = r.best()
        print(f"threads={t}  read {bw:6.2f} GB/s   q4 matvec {mv:6.2f} GB/s   = {mv / bw:5.1%} of read bandwidth"
              f"   (median of per-round ratios {r.median_ratio(1, 0):.1%}; {r.describe()})")
        records.append(run.record(engine="q4 mat-vec", model=f"TinyLlama-1.1B layer shapes x {args.layers}",
                                  quant="q4", isa_path=str(isa), threads=t, read_gbs=bw, gbps=mv,
                                  of_read=mv / bw, median_ratio=r.median_ratio(1, 0), quality=r.describe(),
                                  tile=list(tile), tuning=tuning))
    run.write(args.json, records)


if __name__ == "__main__":
    main()
