"""cflow bench FILE: decode tok/s of a compiled model against the read bandwidth measured in the same run."""

HELP = "measure decode tok/s, bytes/token and the fraction of the machine's read bandwidth"

# One line per thread count, then LEGEND (with the run's --reps and --tokens) and, where it applies, cache_note.
HEADER = f"{'threads':>7}  {'tok/s':>9}  {'MB/token':>8}  {'GB/s':>6}  {'read GB/s':>9}  {'% of read':>9}"
PROMPT = [1, 2, 3, 4]
LEGEND = ("threads: worker threads; tok/s: greedy decode tokens per second, the best of {runs} of {tokens} tokens "
          "after a {prompt}-token prompt;\nMB/token: weight bytes each decode step streams (1 MB = 1e6 B); GB/s: "
          "MB/token x tok/s;\nread GB/s: this machine's read bandwidth, a plain read loop over 1 GiB at the same "
          "thread count, measured right after;\n% of read: GB/s / read GB/s, how close decode comes to the memory's "
          "speed")


def _thread_counts(text: str) -> list[int]:
    import argparse

    from . import MAX_THREADS

    try:
        counts = [int(t) for t in text.split(",")]
    except ValueError:
        counts = []
    if not counts or any(not 1 <= c <= MAX_THREADS for c in counts):
        raise argparse.ArgumentTypeError(f"expected comma-separated thread counts in 1..{MAX_THREADS}, not {text!r}")
    return counts


def add_args(p):
    from . import KV_CHOICES, add_activations_argument, whole

    p.add_argument("file", help="compiled model (.vflow or .cflow), or a directory holding exactly one")
    p.add_argument("--threads", type=_thread_counts, default=None,
                   help="comma-separated thread counts to measure, e.g. 1,2,4 (default: 1 and all usable cores)")
    p.add_argument("--tokens", type=whole(1), default=32, help="tokens decoded per repetition (default 32)")
    p.add_argument("--reps", type=whole(1), default=3,
                   help="repetitions per thread count; the best is kept (default 3)")
    p.add_argument("--kv", choices=KV_CHOICES, default="auto",
                   help="KV cache element type (f32, f16, bf16); auto: f16 for q4/q8 weights, f32 for f16/f32 "
                   "(default auto)")
    add_activations_argument(p)
    p.add_argument("--json", metavar="FILE",
                   help="also write one record per thread count to this JSON file (default: no file)")


def run(args) -> int:
    import json
    import os
    import sys
    import time

    import numpy as np

    import cflow

    from ..codegen.bandwidth import measure_read_bandwidth
    from ..codegen.target import last_level_cache
    from ..errors import CflowError
    from ..util import atomic_write_text, check_output_path
    from . import compiled_file

    if args.json:  # checked before any work
        check_output_path(args.json, "--json")
    path = compiled_file(args.file)
    cores = len(os.sched_getaffinity(0))
    counts = args.threads or sorted({1, cores})
    records = []
    header_printed = False
    for threads in counts:
        m = cflow.load(path, threads=threads, kv=args.kv, activations=args.activations)
        try:
            room = m.session.max_seq - len(PROMPT)
            if args.tokens > room:
                raise CflowError(f"--tokens {args.tokens}: the model's context of {m.session.max_seq} tokens holds "
                                 f"at most {room} after the {len(PROMPT)}-token prompt")
            if not header_printed:
                print(f"{m.kv} KV cache", file=sys.stderr)
                print(HEADER, flush=True)
                header_printed = True
            s = m.session
            best = 0.0
            for _ in range(args.reps):
                s.reset()
                logits = s.prefill(PROMPT)
                t0 = time.perf_counter()
                for _ in range(args.tokens):
                    logits = s.step(int(np.argmax(logits)))
                best = max(best, args.tokens / (time.perf_counter() - t0))
            read = measure_read_bandwidth(threads)
            bpt, kv = m.bytes_per_token, m.kv
        finally:
            m.close()
        eff = bpt * best / 1e9
        records.append({"threads": threads, "read_gbps": round(read, 3), "bytes_per_token": bpt,
                        "tok_s": round(best, 3), "kv": kv})
        print(f"{threads:>7}  {best:9.2f}  {bpt / 1e6:8.2f}  {eff:6.2f}  {read:9.2f}  {100 * eff / read:9.1f}",
              flush=True)
    print()
    print(LEGEND.format(runs=f"{args.reps} run" + "s" * (args.reps != 1), tokens=args.tokens, prompt=len(PROMPT)))
    note = cache_note(records[0]["bytes_per_token"], max(r["tok_s"] * r["bytes_per_token"] / 1e9 / r["read_gbps"]
                                                         for r in records), last_level_cache())
    if note:
        print(note)
    if args.json:
        atomic_write_text(args.json, json.dumps(records, indent=2) + "\n")
    return 0


def cache_note(bytes_per_token: int, fraction: float, llc: tuple[str, int]) -> str | None:
    """Why "% of read" may pass 100: weights that fit in the last-level cache (llc: level, bytes) are read from it,
    not from DRAM. None when the step streams from DRAM."""
    level, size = llc
    if size and bytes_per_token <= size:
        return (f"note: the {bytes_per_token / 1e6:.1f} MB of weights each step reads fit in this CPU's {level} cache "
                f"({size / 2**20:.0f} MiB):\nthey are read from the cache, not DRAM, so decode is not bound by the "
                "DRAM read bandwidth and % of read can exceed 100\n(a model larger than the cache measures the memory)")
    if fraction > 1:
        where = f"this CPU's {level} cache ({size / 2**20:.0f} MiB)" if size else "the caches"
        return (f"note: above 100% of read: part of the {bytes_per_token / 1e6:.1f} MB each step reads is served by "
                f"{where},\nnot DRAM, so decode is not bound by the DRAM read bandwidth alone")
    return None
