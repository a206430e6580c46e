"""Long runs stay flat: RSS, open file descriptors and threads over many requests and many load/unload cycles.

    python -m benchmarks.soak                          # 10,000 tokens over ~100 requests, then 200 load/unload cycles
    python -m benchmarks.soak --tokens 2000 --cycles 40 --json

Phase 1 loads the bundled model (q4, with its tokenizer) once and serves requests of 20..200 new tokens (text
prompts, greedy and sampled, streamed and whole) until --tokens tokens have been generated, in one process.
Phase 2 loads and closes the same file --cycles times, generating a few tokens each time. Each phase reports
RSS (VmRSS), open file descriptors and threads at its start (after one warm-up request or cycle, so caches
and the JIT's one-time allocations are in the baseline) and at its end, plus the largest RSS seen; the run
counts as flat when descriptors and threads end where they started and RSS grows by less than --rss-slack-mb.
docs/reliability.md records the last result.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import threading
import time

from benchmarks.common.record import Run, add_json_argument


def snapshot() -> dict:
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            status[key] = rest.split()
    return {"rss_mb": round(int(status["VmRSS"][0]) / 1024, 1), "fds": len(os.listdir("/proc/self/fd")),
            "threads": int(status["Threads"][0]), "py_threads": threading.active_count()}


PROMPTS = ["Once upon a time", "The little dog", "Tom and Lily went to the park.", "She was very happy because",
           "One day, a big", "The sun was", "Mom said", "They played all day and"]


def requests(m, total: int, rng: random.Random, log) -> tuple[int, int, dict, dict, float, float]:
    gc.collect()
    m.generate(PROMPTS[0], max_new_tokens=20, stop=False)  # warm-up: the baseline includes one-time allocations
    gc.collect()
    start, peak = snapshot(), 0.0
    done = n_req = 0
    t0 = time.perf_counter()
    while done < total:
        n = min(rng.randint(20, 200), total - done)
        prompt = rng.choice(PROMPTS)
        kw = {} if rng.random() < 0.5 else dict(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([0.9, 1.0]),
                                                top_k=rng.choice([0, 40]), seed=rng.randrange(2**31))
        room = m.session.max_seq - len(m.check_request(prompt)) + 1
        n = min(n, room)
        if rng.random() < 0.5:
            got = sum(1 for _ in m.stream(prompt, max_new_tokens=n, stop=False, **kw))
        else:
            m.generate(prompt, max_new_tokens=n, stop=False, **kw)
            got = n
        done += got
        n_req += 1
        peak = max(peak, snapshot()["rss_mb"])
        if n_req % 20 == 0:
            log(f"  {n_req} requests, {done} tokens: {snapshot()}")
    gc.collect()
    return n_req, done, start, snapshot(), peak, time.perf_counter() - t0


def cycles(path: str, n: int, threads: int, log) -> tuple[dict, dict, float, float]:
    import cflow

    def one():
        with cflow.load(path, threads=threads) as m:
            m.generate([1, 2, 3], max_new_tokens=4, stop=False)

    one()  # warm-up: the program and object caches are filled, one-time allocations made
    gc.collect()
    start, peak = snapshot(), 0.0
    t0 = time.perf_counter()
    for i in range(n):
        one()
        if i % 10 == 9:
            gc.collect()
            s = snapshot()
            peak = max(peak, s["rss_mb"])
            if (i + 1) % 50 == 0:
                log(f"  {i + 1} cycles: {s}")
    gc.collect()
    return start, snapshot(), peak, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=10_000, help="tokens generated in phase 1 (default 10000)")
    ap.add_argument("--cycles", type=int, default=200, help="load/unload cycles in phase 2 (default 200)")
    ap.add_argument("--threads", type=int, default=2, help="threads of the loaded model (default 2)")
    ap.add_argument("--seed", type=int, default=0, help="request mix seed (default 0)")
    ap.add_argument("--rss-slack-mb", type=float, default=16.0,
                    help="RSS growth from start to end still called flat (default 16)")
    add_json_argument(ap, "also write the result as one record (default: stdout only)")
    args = ap.parse_args(argv)
    run = Run("soak", argv)

    import cflow
    from cflow.compiler import compile_file
    from cflow.frontend.load import load_graph
    from cflow.models.bundled import default_model_dir

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    tmp = tempfile.mkdtemp(prefix="cflow-soak-")
    path = os.path.join(tmp, "bundled.vflow")
    g = load_graph(str(default_model_dir()))
    compile_file(g, path, "q4", tokenizer=g.meta.tokenizer, eos=g.meta.eos_token_ids)
    before = snapshot()
    log(f"phase 1: {args.tokens} tokens over many requests, {args.threads} threads")
    with cflow.load(path, threads=args.threads) as m:
        n_req, n_tok, s1, e1, p1, dt1 = requests(m, args.tokens, random.Random(args.seed), log)
    log(f"phase 2: {args.cycles} load/unload cycles")
    s2, e2, p2, dt2 = cycles(path, args.cycles, args.threads, log)

    def flat(s, e):
        return e["fds"] == s["fds"] and e["threads"] == s["threads"] and e["rss_mb"] - s["rss_mb"] < args.rss_slack_mb

    result = {
        "cflow_version": cflow.__version__,
        "process_before_loading": before,
        "requests": {"requests": n_req, "tokens": n_tok, "seconds": round(dt1, 1), "start": s1, "end": e1,
                     "peak_rss_mb": p1, "flat": flat(s1, e1)},
        "load_unload": {"cycles": args.cycles, "seconds": round(dt2, 1), "start": s2, "end": e2, "peak_rss_mb": p2,
                        "flat": flat(s2, e2)},
    }
    model = "bundled arch2_4_combined (small)"
    print(json.dumps({"command": run.command, "model": f"{model}, q4", "threads": args.threads, **result}, indent=2))
    run.write(args.json, [run.record(engine="cflow", model=model, quant="q4", threads=args.threads, **result)])
    os.remove(path)
    os.rmdir(tmp)
    return 0 if result["requests"]["flat"] and result["load_unload"]["flat"] else 1


if __name__ == "__main__":
    sys.exit(main())
