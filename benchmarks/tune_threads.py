"""Does the 1-thread tuning choice stay the best with every core streaming? (issue 10, the 2-thread shortfall)

codegen/tune.py times kernel variants on one thread. This script times the same kind of candidates (the default,
this host's cached choice or the descent's recorded choice, and the one-knob prefetch/vector/loop-kind variants
of it) on
1 thread over the whole matrix and on N threads at once, each thread on its own contiguous tile-row range as the
decode step splits them (Python threads calling the JIT-compiled kernel through ctypes, which releases the GIL;
started together, until the last one finishes), interleaved round by round, medians printed
with the plain read loop's bandwidth of the same round. Numbers only: nothing is cached or chosen here.

    python -m benchmarks.tune_threads --shape q4:2048:plain --threads 2 --rounds 9 [--json [FILE]]
    python -m benchmarks.tune_threads --shape q4:5632:plain --knobs prefetch_stride=128 --knobs unroll=2,prefetch=2304

--knobs adds a candidate: the choice with those knobs changed (any of codegen.tune.KNOBS), e.g. to time a knob
the one-knob neighbours leave fixed (unroll, max_groups, unpack, group_loop).
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from benchmarks.common.bandwidth import measure_read_bandwidth, run_threads
from benchmarks.common.record import Run, add_json_argument
from cflow.codegen import kernels as K
from cflow.codegen import tune
from cflow.codegen.target import cpu_model, host_target
from cflow.layout.quant import DType
from cflow.layout.tile import TileLayout

# the descent's choice on the Zen 4 host (docs/results/tune_descent.json), used when this host has no cached one
RECORDED = {"q4:2048:plain": {"prefetch": 0, "vector_bits": 256},
            "q4:5632:plain": {"prefetch": 0, "vector_bits": 256},
            "q4:2048:gate_up": {"prefetch": 2304, "prefetch_locality": 2, "prefetch_stride": 2304}}


def ranges(n_tile_rows: int, nth: int, t: int, chunk: int = 0) -> list[tuple[int, int]]:
    """Thread t's tile-row ranges: one contiguous share (chunk 0, as the decode step splits), or chunks of `chunk`
    tile-rows dealt round robin (both threads then read neighbouring parts of the matrix at the same time)."""
    if not chunk:
        return [(n_tile_rows * t // nth, n_tile_rows * (t + 1) // nth)]
    return [(lo, min(lo + chunk, n_tile_rows)) for lo in range(t * chunk, n_tile_rows, nth * chunk)]


def split_call(bench, i: int, y, n_tile_rows: int, nth: int, chunk: int = 0) -> float:
    """Seconds of one call of variant i of bench (tune.Candidates) split over nth threads, started together
    (the read loop's own thread runner: the last thread's finish counts)."""
    def share(t):
        for lo, hi in ranges(n_tile_rows, nth, t, chunk):
            bench.call(i, y, lo, hi)

    return run_threads([lambda t=t: share(t) for t in range(nth)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="q4:2048:plain", help="dtype:cols:plain|gate_up (128x256 tiles)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--chunk", type=int, default=0,
                    help="N threads: deal chunks of this many tile-rows round robin (default 0: contiguous shares)")
    ap.add_argument("--backing", choices=("anon", "file"), default="anon",
                    help="anon: the weights in anonymous memory (transparent huge pages where the kernel gives them); "
                         "file: written to a file and np.memmap-ed, as a loaded model's weights are (page-cache pages)")
    ap.add_argument("--phase", type=int, default=0,
                    help="bytes past a page boundary where the weights start (default 0: as a loaded file's tensors)")
    ap.add_argument("--mb", type=int, default=0,
                    help="MiB of packed weights per call (default: 256 or twice the last-level cache, the larger)")
    ap.add_argument("--knobs", action="append", default=[], metavar="K=V[,K=V...]",
                    help="also time the choice with these knobs changed (repeatable)")
    add_json_argument(ap, "write one record per candidate and thread count")
    args = ap.parse_args(argv)
    run = Run("tune_threads", argv)
    dt, cols, kind = args.shape.split(":")
    gate_up = kind == "gate_up"
    layout = TileLayout(DType.parse(dt), 128, int(cols), (128, 256))
    target = host_target()
    isa = K._check_isa(target.isa)
    key = tune.kernel_key(layout, gate_up)
    rec = tune.read_table(target).get(key)
    chosen = (rec or {}).get("choice") or {**tune.DEFAULT, **RECORDED.get(args.shape, {})}
    # the choice's prefetch / vector / loop-kind neighbours (a group loop has no unroll or groups per pass to keep)
    cands = [dict(tune.DEFAULT)] + [c for c in tune.neighbours(chosen, layout, isa)
                                   if c != tune.DEFAULT and c["unpack"] == chosen["unpack"]
                                   and (c["group_loop"] != chosen["group_loop"]
                                        or all(c[k] == chosen[k] for k in ("unroll", "max_groups")))]
    for text in args.knobs:
        c = dict(chosen)
        for kv in text.split(","):
            k, _, v = kv.partition("=")
            if k.strip() not in tune.KNOBS or not v.strip().lstrip("-").isdigit():
                ap.error(f"--knobs {text!r}: give K=V pairs with K one of {', '.join(tune.KNOBS)} and V an integer")
            c[k.strip()] = int(v)
        sp = tune.space(layout, isa)
        off = [k for k in ("vector_bits", "unpack") if c[k] not in sp[k]]  # the ISA/dtype decide these
        if tune._valid_choice(c) is None or off:
            ap.error(f"--knobs {text!r}: not a kernel variant for {args.shape} on this host"
                     + (f" ({', '.join(f'{k} one of {sp[k]}' for k in off)})" if off else ""))
        c = tune._normal(c)
        if c not in cands:
            cands.append(c)
    args.mb = args.mb or tune.stream_span(256 << 20) >> 20  # past the last-level cache, like decode
    if not 0 <= args.phase < tune.PAGE or args.phase % 64:
        ap.error(f"--phase {args.phase}: a multiple of 64 below {tune.PAGE}")
    bench = tune.Candidates(layout, gate_up, cands, target, args.mb * 2**20, phase=args.phase)
    if args.backing == "file":
        import tempfile

        with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR", "/tmp"), delete=False) as f:
            f.write(bytes(args.phase) + np.ascontiguousarray(bench.weights).tobytes())
        bench.weights = np.memmap(f.name, dtype=np.uint8, mode="r")[args.phase:]
        os.unlink(f.name)  # the mapping keeps the pages; nothing left behind
    n_tile_rows = bench.layout.n_tile_rows
    y = np.zeros(bench.layout.rows_p, np.float32)
    counts = (1, args.threads)
    gbps = {(i, n): [] for i in range(len(cands)) for n in counts}
    read = {n: [] for n in counts}
    for i in range(len(cands)):  # warm-up (page faults, code); the split call must give the whole call's numbers
        bench.call(i, y)
        whole = y.copy()
        y[:] = 0
        split_call(bench, i, y, n_tile_rows, args.threads, args.chunk)
        if not np.array_equal(whole, y):
            raise SystemExit(f"FAIL: {tune.label(cands[i])} on {args.threads} threads differs from one thread")
    for r in range(args.rounds):
        for n in counts:
            read[n].append(measure_read_bandwidth(threads=n, nbytes=1 << 28, reps=2))
            order = range(len(cands)) if r % 2 == 0 else reversed(range(len(cands)))
            for i in order:
                gbps[(i, n)].append(bench.streamed / split_call(bench, i, y, n_tile_rows, n, args.chunk) / 1e9)
    print(f"{cpu_model()} ({isa}); {key}; {args.mb} MiB per call; medians of {args.rounds} interleaved rounds; "
          f"choice from {'this host cache' if rec else 'the recorded descent (docs/results/tune_descent.json)'}; "
          f"{'contiguous shares' if not args.chunk else f'chunks of {args.chunk} tile-rows round robin'}; "
          f"weights in {'anonymous memory' if args.backing == 'anon' else 'a memory-mapped file'}, "
          f"{args.phase} B past a page boundary")
    print(f"read loop: 1 thread {np.median(read[1]):.2f} GB/s, {args.threads} threads "
          f"{np.median(read[args.threads]):.2f} GB/s")
    print(f"  {'variant':<30} {'1 thread':>9} {str(args.threads) + ' threads':>10} {'scaling':>8} "
          f"{'of read, 1 / ' + str(args.threads):>14}")
    records = []
    for i, c in enumerate(cands):
        g1, gn = np.median(gbps[(i, 1)]), np.median(gbps[(i, args.threads)])
        # share of the read loop: the median of per-round ratios (each round measures both within a second)
        s1, sn = (np.median(np.array(gbps[(i, n)]) / np.array(read[n])) for n in counts)
        mark = " <- 1-thread choice" if c == chosen else (" (default)" if c == tune.DEFAULT else "")
        print(f"  {tune.label(c):<30} {g1:9.2f} {gn:10.2f} {gn / g1:7.2f}x {100 * s1:6.1f}% / {100 * sn:4.1f}%{mark}")
        records += [run.record(engine="mat-vec", model=key, quant=dt, threads=n, variant=tune.label(c),
                               read_gbs=float(np.median(read[n])), gbps=float(np.median(gbps[(i, n)])),
                               of_read=float(share), gbps_rounds=gbps[(i, n)], read_rounds=read[n], knobs=c,
                               chosen=c == chosen, default=c == tune.DEFAULT)
                    for n, share in zip(counts, (s1, sn))]
    run.write(args.json, records, {"mib_per_call": args.mb, "chunk": args.chunk, "backing": args.backing,
                                   "phase": args.phase, "choice_from": "host cache" if rec else "recorded"})
    return cands


if __name__ == "__main__":
    main()
