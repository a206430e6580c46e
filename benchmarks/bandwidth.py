"""Machine read bandwidth, measured the way the kernels read: a STREAM-like loop generated with llvmlite.

Every decode benchmark divides its effective bandwidth by this number, measured in the same run at
the same thread count (benchmarks/common/bandwidth.py; the loop is cflow.codegen.bandwidth's). NumPy's a.sum()
is compute-bound near 9 GB/s here, so it cannot measure it. The loop XORs 64-byte loads into 8 independent
accumulators; threads are Python threads, each calling the native function on its own contiguous slice (ctypes
releases the GIL); best of `reps`, in quiet rounds (benchmarks/common/timing.py).

    python -m benchmarks.bandwidth [--gib 1] [--threads 1,2] [--reps 5] [--json [FILE]]
    python -m benchmarks.bandwidth --gib 0.25 --threads 1 --reps 1 --max-wait 0    # a quick look
"""

from __future__ import annotations

import argparse

from benchmarks.common.bandwidth import read_gbs
from benchmarks.common.record import Run, add_json_argument
from benchmarks.common.timing import measure_rounds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=5, help="quiet rounds, best kept (default 5)")
    ap.add_argument("--max-wait", type=float, default=60.0, help="seconds to wait for a quiet machine")
    add_json_argument(ap, "write one record per thread count")
    args = ap.parse_args(argv)
    run = Run("bandwidth", argv)
    res, records = {}, []
    for t in (int(v) for v in args.threads.split(",")):
        r = measure_rounds(lambda t=t: (read_gbs(t, args.gib, reps=1),), args.reps, args.max_wait)
        res[t] = r.best()[0]
        print(f"read bandwidth  threads={t}  {res[t]:6.2f} GB/s   ({args.gib:.2f} GiB, {r.describe()})")
        records.append(run.record(engine="read loop", threads=t, read_gbs=round(res[t], 3), gib=args.gib,
                                  rounds=[v[0] for v in r.used()], quality=r.describe(),
                                  other_load_max=round(r.worst, 3)))
    if 1 in res:
        for t, bw in res.items():
            if t != 1:
                print(f"scaling {t} threads / 1 thread = {bw / res[1]:.2f}x")
    run.write(args.json, records)


if __name__ == "__main__":
    main()
