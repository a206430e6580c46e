"""cflow bench FILE: decode tok/s of a compiled model against the read bandwidth measured in the same run."""

HELP = "measure decode tok/s, bytes/token and the fraction of the machine's read bandwidth"

# One line per thread count; GB/s = MB/token x tok/s (the weight bytes decode streams), "% of read" = GB/s / read GB/s.
HEADER = f"{'threads':>7}  {'tok/s':>9}  {'MB/token':>8}  {'GB/s':>6}  {'read GB/s':>9}  {'% of read':>9}"


def add_args(p):
    p.add_argument("file", help="compiled model (.vflow or .cflow)")
    p.add_argument("--threads", default=None,
                   help="comma-separated thread counts to measure, e.g. 1,2,4 (default: 1 and all usable cores)")
    p.add_argument("--tokens", type=int, default=32, help="tokens decoded per repetition (default 32)")
    p.add_argument("--reps", type=int, default=3, help="repetitions per thread count; the best is kept (default 3)")
    p.add_argument("--json", metavar="FILE",
                   help="also write one record per thread count to this JSON file (default: no file)")


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
    print(HEADER, flush=True)
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
        records.append({"threads": threads, "read_gbps": round(read, 3), "bytes_per_token": bpt,
                        "tok_s": round(best, 3)})
        print(f"{threads:>7}  {best:9.2f}  {bpt / 1e6:8.2f}  {eff:6.2f}  {read:9.2f}  {100 * eff / read:9.1f}",
              flush=True)
        m.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=2)
    return 0
