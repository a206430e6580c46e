"""Explicit software prefetch in the Q4 mat-vec against none, same run, same weights.

    python -m benchmarks.claims_prefetch [--layers 8] [--threads 1,2] [--rounds 7] [--json [FILE]]

The paper found that an explicit PREFETCHT0 gave no gain and up to 4% loss; cflow's kernel prefetches one Q4
unit (2304 B) ahead into L1 (kernels.DEFAULT_PREFETCH, DEFAULT_PREFETCH_LOCALITY = 3, tuned on an Intel host).
emit_matvec has the knob (prefetch=0 turns it off), so the variants here are the shipped kernel with only
`prefetch` / `prefetch_locality` changed: off, t0 (the default), t1 (into L2, locality 2).

Weights and driver are benchmarks.matvec's (TinyLlama-1.1B layer shapes, `--layers` distinct copies, far
past the L3). Each round measures the read bandwidth and then every variant, in an order that rotates per
round, so all see the same machine state (each the best of --passes passes); reported per variant: the
median GB/s, and the median of the per-round ratios to the no-prefetch kernel (the figure to quote: same-run
ratios), with their range and the share of CPU time other processes used (other_load).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile

import numpy as np

from benchmarks import matvec
from benchmarks.common.bandwidth import measure_read_bandwidth, run_threads
from benchmarks.common.record import Run, add_json_argument
from benchmarks.common.timing import cpu_ticks, other_load
from cflow.codegen import kernels as K
from cflow.codegen.cache import ObjectCache
from cflow.codegen.library import Library
from cflow.codegen.target import cpu_model, host_target
from cflow.layout.quant import DType
from cflow.layout.tile import TileLayout

VARIANTS = {"off": dict(prefetch=0), "t0": dict(prefetch=K.DEFAULT_PREFETCH, prefetch_locality=3),
            "t1": dict(prefetch=K.DEFAULT_PREFETCH, prefetch_locality=2)}



def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--passes", type=int, default=4, help="passes over all layers per measurement")
    add_json_argument(ap, "write one record per thread count, round and variant, the summary in the run's extra")
    args = ap.parse_args(argv)
    run = Run("claims_prefetch", argv)
    tile = (128, 256)
    target = host_target()
    isa = target.isa
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    drives = {}
    with tempfile.TemporaryDirectory() as d:
        for name, tuning in VARIANTS.items():
            lib = Library(name=f"claims_prefetch_{name}", target=target, cache=ObjectCache(d))
            lib.add_ir(matvec.build(tile, isa, dict(max_groups=K.MAX_GROUPS, unroll=K.DEFAULT_UNROLL,
                                                    **{"prefetch_locality": K.DEFAULT_PREFETCH_LOCALITY, **tuning})))
            lib.finalize()
            drives[name] = lib.get_cfunc("drive", None, vp, i64, vp, vp, vp, vp, vp, vp, vp, vp)
    mats, one, bufs = matvec.make_weights(tile, args.layers)
    nbytes = sum(v.size for layer in bufs for v in layer.values())
    table = (ctypes.c_void_p * (4 * args.layers))(*[layer[k].ctypes.data for layer in bufs for k in matvec.ORDER])
    act = [K.Activation(matvec.D, matvec.D), K.Activation(matvec.FF, matvec.FF)]
    for a in act:
        a.xq[:] = np.random.default_rng(2).integers(-127, 128, a.xq.size)
        a.xd[:] = 0.01
    y = np.zeros(2 * matvec.FF + 512, np.float32)

    def ranges(tid, nt):
        out = []
        for name in matvec.ORDER:
            n = TileLayout(DType.Q4, *matvec.SHAPES[name], tile).n_tile_rows
            out += [n * tid // nt, n * (tid + 1) // nt]
        return (ctypes.c_int64 * 8)(*out)

    def rate(drive, nt):
        rs = [ranges(t, nt) for t in range(nt)]
        a0, a1 = act
        calls = [lambda r=r: drive(table, args.layers, r, vp(a0.xq.ctypes.data), vp(a0.xd.ctypes.data),
                                   vp(a0.xs.ctypes.data), vp(a1.xq.ctypes.data), vp(a1.xd.ctypes.data),
                                   vp(a1.xs.ctypes.data), vp(y.ctypes.data)) for r in rs]
        return nbytes / min(run_threads(calls) for _ in range(args.passes)) / 1e9  # best pass

    outs = {}
    for name, drive in drives.items():  # warm up, and the outputs must not depend on the prefetch
        rate(drive, 1)
        outs[name] = y.copy()
    assert all(np.array_equal(outs[n], outs["off"]) for n in outs), "prefetch changed the numbers"
    print(f"# {cpu_model()}; {target.describe()}; {args.layers} layers x {nbytes / args.layers / 1e6:.1f} MB Q4; "
          f"{args.rounds} rounds; outputs bit-identical across variants")
    names = list(drives)
    records = []
    summary = {}
    for nt in [int(t) for t in args.threads.split(",")]:
        rows = []
        for rnd in range(args.rounds):
            a = cpu_ticks()
            bw = measure_read_bandwidth(nt, reps=1)
            order = names[rnd % len(names):] + names[: rnd % len(names)]
            gbps = {n: rate(drives[n], nt) for n in order}
            load = other_load(a, cpu_ticks())
            rows.append((bw, gbps, load))
            records += [run.record(engine="q4 mat-vec", model=f"TinyLlama-1.1B layer shapes x {args.layers}",
                                   quant="q4", threads=nt, variant=f"prefetch {n}", read_gbs=bw, round=rnd,
                                   gbps=gbps[n], other_load=load, tuning=VARIANTS[n]) for n in names]
        s = {"read_gbps": statistics.median(r[0] for r in rows)}
        for n in names:
            s[n] = {"gbps": statistics.median(r[1][n] for r in rows),
                    "of_read_bw": statistics.median(r[1][n] / r[0] for r in rows),
                    "vs_off": statistics.median(r[1][n] / r[1]["off"] for r in rows)}
        ratios = [r[1]["t0"] / r[1]["off"] for r in rows]
        s["t0_vs_off_range"] = [min(ratios), max(ratios)]
        s["other_load_max"] = max(r[2] for r in rows)
        summary[nt] = s
        print(f"threads={nt}  read {s['read_gbps']:6.2f} GB/s  " + "  ".join(
            f"{n}: {s[n]['gbps']:6.2f} GB/s ({s[n]['of_read_bw']:.1%}, {s[n]['vs_off']:.3f}x off)" for n in names)
            + f"  t0/off per round {min(ratios):.2f}..{max(ratios):.2f}; other load up to {s['other_load_max']:.0%}")
    run.write(args.json, records, {"target": target.describe(), "layers": args.layers, "variants": VARIANTS,
                                   "summary": summary})


if __name__ == "__main__":
    main()
