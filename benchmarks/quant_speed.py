"""Decode speed of quantised files of one model: cflow on each (tok/s, bytes per token, the fraction of the read
bandwidth measured around it) and llama.cpp on its GGUF files, interleaved rounds in one run.

    python -m benchmarks.quant_speed MIX.vflow Q4_K_M.vflow Q4.vflow --gguf Q4_K_M.gguf [--threads 1,2]
        [--rounds 3] [--tokens 64] [--profile N] [--json OUT.json]

What the quality-per-bit issue asks of a type mix: decode at least at the fraction of the read bandwidth Q4_0
reaches on the same host, >= 1.1x the tok/s of the Q4_K_M file in cflow (fewer bytes), and ahead of llama.cpp on
its Q4_K_M file. Use a model larger than the last-level cache (Qwen2.5-Coder-1.5B: about 1 GB), or bytes per token
do not set the speed. Each round runs every file once per thread count (best of --reps inside), the read bandwidth
the better of a measurement before and after each cflow file; the table keeps each file's best round. --profile N:
then, per cflow file and thread count, where a decode step's time goes (N steps of a profiling build: per-stage
cycle stamps, benchmarks.prefill.profile_stages), each kind of stage in ms a token, its share and its weight bytes
over its time (GB/s), printed and in the JSON records (`extra.profile`); the profiling build's tok/s is its own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.common.bandwidth import around
from benchmarks.common.record import Run, add_json_argument
from benchmarks.common.timing import time_decode

PROMPT = [1, 2, 3, 4]


def cflow_round(path: str, threads: int, tokens: int, reps: int) -> dict:
    import cflow

    with cflow.load(path, threads=threads) as m:
        tok_s, read = around(threads, 1.0, lambda: time_decode(m, PROMPT, tokens, reps))
        bpt = m.bytes_per_token
    return {"tok_s": tok_s, "bytes_per_token": bpt, "read_gbs": read, "of_read": tok_s * bpt / 1e9 / read}


def llama_round(path: str, threads: int, tokens: int) -> dict:
    from benchmarks.common.peers import llama_open, llama_time_decode

    llm = llama_open(path, threads, extra_bufts=False)  # its AMX path crashed on this host kind (conformance.py)
    try:
        return {"tok_s": llama_time_decode(llm, PROMPT, tokens, reps=2)}
    finally:
        llm.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quant_speed", description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", help="compiled cflow files (.vflow/.cflow)")
    p.add_argument("--gguf", action="append", default=[], help="a GGUF file llama.cpp decodes (repeatable; "
                   "default: none)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--tokens", type=int, default=64, help="decode tokens timed (default 64)")
    p.add_argument("--reps", type=int, default=2, help="repetitions per file and round, the best kept (default 2)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="then N decode steps of a profiling build per cflow file and thread count (default 0: none)")
    add_json_argument(p, "one record per file and thread count")
    args = p.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    run = Run("quant_speed", argv)
    best: dict[tuple[str, int], dict] = {}
    for r in range(args.rounds):
        for t in threads:
            for f in args.files:
                res = cflow_round(f, t, args.tokens, args.reps)
                if res["tok_s"] > best.get((f, t), {}).get("tok_s", 0):
                    best[(f, t)] = res
            for g in args.gguf:
                res = llama_round(g, t, args.tokens)
                if res["tok_s"] > best.get((g, t), {}).get("tok_s", 0):
                    best[(g, t)] = res
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    profiles = {}
    if args.profile:
        from benchmarks.prefill import print_profile, profile_stages

        for f in args.files:
            for t in threads:
                profiles[(f, t)] = prof = profile_stages(f, t, args.profile, 64, decode=True)
                print_profile(prof, f"decode, {Path(f).name}")
    print(f"{'file':<40} {'engine':<9} {'thr':>3} {'tok/s':>8} {'MB/token':>9} {'GB/s':>6} {'read GB/s':>9} "
          f"{'of read':>7}")
    records = []
    for (f, t), res in best.items():
        engine = "llama.cpp" if f in args.gguf else "cflow"
        if engine == "cflow":
            gbs = res["tok_s"] * res["bytes_per_token"] / 1e9
            print(f"{Path(f).name:<40} {engine:<9} {t:>3} {res['tok_s']:8.2f} {res['bytes_per_token'] / 1e6:9.1f} "
                  f"{gbs:6.2f} {res['read_gbs']:9.2f} {100 * res['of_read']:6.1f}%")
        else:
            print(f"{Path(f).name:<40} {engine:<9} {t:>3} {res['tok_s']:8.2f}")
        records.append(run.record(engine=engine, model=Path(f).name, quant=None, threads=t, variant=None,
                                  tok_s=res["tok_s"], bytes_per_token=res.get("bytes_per_token"),
                                  read_gbs=res.get("read_gbs"), file=f,
                                  **({"profile": profiles[(f, t)]} if (f, t) in profiles else {})))
    written = run.write(args.json, records)
    if written:
        print(f"wrote {written}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
