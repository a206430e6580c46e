"""cflow bench FILE: decode tok/s of a compiled model against the read bandwidth measured in the same run."""

HELP = "measure decode tok/s, bytes/token and the fraction of the machine's read bandwidth"


def add_args(p):
    p.add_argument("file", help="compiled model (.vflow or .cflow)")
    p.add_argument("--threads", default=None, help="comma-separated thread counts (default: 1 and all cores)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", help="write one record per thread count to this file")


def run(args) -> int:
    import json
    import os
    import time

    import numpy as np

    import cflow
    from ..codegen.bandwidth import measure_read_bandwidth

    cores = len(os.sched_getaffinity(0))
    counts = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, cores})
    records = []
    for threads in counts:
        m = cflow.load(args.file, threads=threads)
        s = m.session
        prompt = [1, 2, 3, 4]
        best = 0.0
        for _ in range(args.reps):
            s.reset()
            logits = s.prefill(prompt)
            t0 = time.perf_counter()
            for _ in range(args.tokens):
                logits = s.step(int(np.argmax(logits)))
            best = max(best, args.tokens / (time.perf_counter() - t0))
        read = measure_read_bandwidth(threads)
        bpt = m.bytes_per_token
        eff = bpt * best / 1e9
        records.append({"threads": threads, "read_gbps": round(read, 3), "bytes_per_token": bpt, "tok_s": round(best, 3)})
        print(f"threads={threads}  {best:7.2f} tok/s  {bpt / 1e6:8.2f} MB/token  {eff:6.2f} GB/s  "
              f"read {read:6.2f} GB/s  {100 * eff / read:5.1f}%")
        m.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=2)
    return 0
