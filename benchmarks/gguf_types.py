"""Each GGUF block type's decode mat-vec against the machine's read bandwidth, Q4_0 as the yardstick, one run.

    python -m benchmarks.gguf_types [--threads 1,2] [--rounds 3] [--set-gb 1.5] [--types Q4_0,Q4_K,...]
                                    [--tune] [--activations q8,q8x2] [--loops builtin|unit,group,group-l2]
                                    [--prefetch-units 1,0.25] [--json [FILE]]

For every type: TinyLlama's down projection shape (2048 outputs x 5632 inputs; IQ4_NL and the legacy types the
same; cflow's IQ4_192 5760 inputs in 192-column tiles, as a model of 576-wide rows compiles) of random
blocks (every code pattern, small finite scales), copied into distinct buffers until the set is
--set-gb (well past the last-level cache: 480 MiB on the AMX Xeon VM), and streamed by the decode kernel
(`codegen/kernels.emit_matvec`, this host's ISA, the built-in knobs or with --tune the host's tuned ones), each
thread its share of the tile-rows of every copy (Python threads; the kernel releases the GIL). Per round: the read
loop (codegen/bandwidth) and then each type, back to back, so all see the same machine; the best of --rounds.
Printed: GB/s, the fraction of read bandwidth, and that fraction over Q4_0's (the target: >= 1). --activations
q8,q8x2 times the 32-input types also with two-plane activations (load(activations='q8x2'): the same weights, the
kernel's two dots per chunk; in the same rounds), each as a fraction of read and over Q4_0's with int8.
--loops unit,group,group-l2 times every type with each loop kind of the kernel (emit_matvec's group_loop 0 and 1,
the software prefetch into L1; group-l2: the group loop prefetching into L2) in the same rounds, each ratio over
Q4_0's unit loop where it is timed (else Q4_0's first kernel; --loops builtin, the default: the built-in kernels).
--prefetch-units 1,0.25 times each kernel also with its software prefetch that many of its units ahead (in whole
lines; kernels.default_prefetch's rule), in the same rounds: how BUILTIN_KNOBS' prefetch_units are chosen.
"""

from __future__ import annotations

import argparse
import ctypes
import sys

import numpy as np

from benchmarks.common.bandwidth import measure_read_bandwidth, run_threads
from benchmarks.common.record import Run, add_json_argument
from cflow.codegen import kernels as K
from cflow.codegen.target import cpu_model, host_target
from cflow.layout import blocks as B
from cflow.layout.quant import BLOCK_SIZES, DType, act_planes, quantize
from cflow.layout.tile import TileLayout, aligned_empty, pack

ROWS, COLS = 2048, 5632
TYPES = [DType.Q4, DType.Q8, *B.FORMATS]
# the kernel's loop kinds (emit_matvec's group_loop) with the L1 prefetch, and the group loop with the L2 one
LOOPS = {"builtin": {}, "unit": {"group_loop": 0, "prefetch_locality": 3},
         "group": {"group_loop": 1, "prefetch_locality": 3}, "group-l2": {"group_loop": 1, "prefetch_locality": 2}}


def geometry(dt: DType, tile, cols: int = COLS) -> tuple[int, tuple[int, int]]:
    """(inputs, tile) of a type's matrix: `cols`, or for a block `cols` does not hold whole (IQ4_192) the next
    multiple of it in tiles one block wide."""
    qk = BLOCK_SIZES[dt][0]
    if cols % qk == 0:
        return cols, tile
    return -(-cols // qk) * qk, (tile[0], qk)


def _matrix(dt: DType, tile):
    rng = np.random.default_rng(0)
    cols, tile = geometry(dt, tile)
    if dt in B.FORMATS:
        w = B.random_blocks(dt, ROWS, cols, rng)
    else:
        w = quantize(rng.standard_normal((ROWS, cols)).astype(np.float32) * 0.05, dt)
    return pack(w, dt, tile)


class Case:
    def __init__(self, dt: DType, tile, set_bytes: float, knobs: dict, planes: int = 1, twin: Case | None = None,
                 kind: str = ""):
        """kind: what tells this kernel apart from others of the type in one run (a loop kind, a version)."""
        cols, tile = geometry(dt, tile)
        self.dt, self.layout, self.planes, self.kind = dt, TileLayout(dt, ROWS, cols, tile), planes, kind
        self.label = dt.gguf_name + (" q8x2" if planes == 2 else "") + (f" {kind}" if kind else "")
        self.mv = K.MatVec(self.layout, planes=planes, **knobs)
        if twin is not None:  # a two-plane case streams its one-plane twin's copies
            self.n, self.buf = twin.n, twin.buf
        else:
            one = _matrix(dt, tile)
            self.n = max(1, int(-(-set_bytes // one.size)))
            self.buf = aligned_empty(self.n * one.size, 4096)
            self.buf.reshape(self.n, one.size)[:] = one
        self.nbytes = self.buf.size
        self.act = self.mv.activation(np.random.default_rng(1).standard_normal(cols).astype(np.float32))
        self.y = [np.zeros(self.layout.rows_p, np.float32) for _ in range(4)]
        self.knobs = knobs

    def run(self, threads: int) -> float:
        """GB/s of one pass over every copy with `threads` threads (each its share of every copy's tile-rows)."""
        L, mv, a = self.layout, self.mv, self.act
        base, step = self.buf.ctypes.data, self.buf.size // self.n
        vp = ctypes.c_void_p
        args = [vp(p.ctypes.data) for p in (a.x, a.xq, a.xd, a.xs)]

        def work(t):
            r0, r1 = L.n_tile_rows * t // threads, L.n_tile_rows * (t + 1) // threads
            y = vp(self.y[t].ctypes.data)
            for i in range(self.n):
                mv._mv(vp(base + i * step), *args, y, r0, r1)

        return self.nbytes / run_threads([lambda t=t: work(t) for t in range(threads)]) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--set-gb", type=float, default=1.5, help="bytes streamed per type and pass (GB)")
    ap.add_argument("--types", default=",".join(d.gguf_name for d in TYPES))
    ap.add_argument("--tile", default="128x256")
    ap.add_argument("--tune", action="store_true",
                    help="each type with this host's tuned knobs (cflow tune's; measured now where not cached)")
    ap.add_argument("--activations", default="q8",
                    help="comma list of activation formats: q8 (int8), q8x2 (two planes: the 32-input types only) "
                    "(default q8)")
    ap.add_argument("--loops", default="builtin",
                    help="the kernels timed: builtin (each type's default on this ISA path), or any of unit, group "
                         "and group-l2 (the group loop prefetching into L2) to time each (default builtin)")
    ap.add_argument("--prefetch-units", default="",
                    help="comma list of prefetch distances in the type's units to time each kernel at (default: its "
                         "built-in distance only)")
    add_json_argument(ap, "write one record per thread count, block type, activation format and loop kind")
    args = ap.parse_args(argv)
    run = Run("gguf_types", argv)
    tile = tuple(int(v) for v in args.tile.split("x"))
    target = host_target()
    types = [DType.parse(t) for t in args.types.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    formats = [f for f in args.activations.split(",") if f]
    if not formats or any(f not in ("q8", "q8x2") for f in formats):
        ap.error(f"--activations: q8 and / or q8x2, not {args.activations!r}")
    try:
        units = [float(u) for u in args.prefetch_units.split(",") if u] or [None]
    except ValueError:
        ap.error(f"--prefetch-units: numbers, not {args.prefetch_units!r}")
    if any(u is not None and u < 0 for u in units):
        ap.error("--prefetch-units: distances >= 0")
    loops = [k for k in args.loops.split(",") if k]
    if not loops or any(k not in LOOPS for k in loops) or ("builtin" in loops and len(loops) > 1):
        ap.error(f"--loops: builtin, or any of unit, group, group-l2; not {args.loops!r}")
    cases = []
    for dt in types:
        knobs = {}
        if args.tune:
            from cflow.codegen import tune
            from cflow.layout.packed import Form, PackedTensor

            cols, t = geometry(dt, tile)
            pt = PackedTensor(name="w", form=Form.TILED, parts=("w",), dtype=dt, part_shapes=((ROWS, cols),), tile=t)
            knobs = tune.choices([pt], target, search=True, budget=tune.BUDGET).get(
                tune.kernel_key(TileLayout(dt, ROWS, cols, t), False), {})
        twin = None
        for f in formats:
            planes = act_planes(f, [dt])
            if f == "q8x2" and planes == 1:
                continue  # a K-quant: int8 under either format
            for kind in loops:
                for u in units:
                    kn = {**knobs, **LOOPS[kind]}
                    label = "" if kind == "builtin" else kind
                    if u is not None:  # whole lines, as kernels.default_prefetch takes a fraction of a unit
                        unit = TileLayout(dt, ROWS, *geometry(dt, tile)).unit_nbytes
                        kn["prefetch"] = max(64, int(u * unit) // 64 * 64) if u else 0
                        label = f"{label} pf{u:g}u".strip()
                    c = twin = Case(dt, tile, args.set_gb * 1e9, kn, planes, twin, label)
                    c.loop, c.pf_units = ("" if kind == "builtin" else kind), u
                    c.run(threads[0])  # page in, warm the code
                    cases.append(c)
                    print(f"{c.label:16s}: {c.n} copies, {c.nbytes / 1e9:.2f} GB, knobs {kn}", file=sys.stderr)
    records = []
    print(f"cpu: {cpu_model()}  isa: {target.isa}  {ROWS}x{COLS} per matrix (a 192-input type: {ROWS}x"
          f"{geometry(DType.IQ4_192, tile)[0]}), {args.set_gb} GB per type, best of "
          f"{args.rounds} rounds")
    for n in threads:
        best: dict = {}
        for _ in range(args.rounds):
            bw = measure_read_bandwidth(n)
            best["read"] = max(best.get("read", 0), bw)
            for c in cases:
                best[c.label] = max(best.get(c.label, 0), c.run(n))
        # the yardstick: Q4_0's built-in kernel, else its unit loop (its built-in on every path), else its first
        q4s = [c for c in cases if c.dt == DType.Q4 and c.planes == 1]
        q4_label = next((c.label for c in q4s if c.kind in ("", "unit")), q4s[0].label if q4s else None)
        q4 = best[q4_label] / best["read"] if q4_label in best else None
        print(f"\n{n} thread(s): read bandwidth {best['read']:.2f} GB/s")
        print(f"{'type':16} {'bits/w':>6} {'GB/s':>7} {'of read':>8} {'/ Q4_0':>7}"
              + (f"   (over {q4_label})" if q4_label not in (None, "Q4_0") else ""))
        for c in cases:
            frac = best[c.label] / best["read"]
            bits = 8 * c.layout.unit_nbytes / c.layout.tr / c.layout.unit_cols
            print(f"{c.label:16} {bits:6.2f} {best[c.label]:7.2f} {frac:8.1%} "
                  f"{frac / q4 if q4 else float('nan'):7.3f}")
            variant = ", ".join(v for v in ("activations q8x2" if c.planes == 2 else "",
                                            c.loop and f"{c.loop} loop",
                                            c.pf_units is not None and f"prefetch {c.pf_units:g} units") if v)
            records.append(run.record(engine="mat-vec", model=f"{ROWS}x{c.layout.cols}", quant=c.dt.gguf_name,
                                      threads=n, variant=variant or None,
                                      read_gbs=best["read"], gbps=best[c.label],
                                      of_read=frac, over_q4_0=frac / q4 if q4 else None, bits_per_weight=bits,
                                      knobs=c.knobs, copies=c.n))
    run.write(args.json, records, {"tile": list(tile), "set_gb": args.set_gb, "tuned": args.tune, "loops": loops})
    return 0


if __name__ == "__main__":
    sys.exit(main())
