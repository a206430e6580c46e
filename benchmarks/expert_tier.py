"""Experts on disk: synchronous vs asynchronous expert reads inside the expert-delay window, against the overlap model.

    python -m benchmarks.expert_tier --quick                 # about 1 minute
    python -m benchmarks.expert_tier --json

For each expert delay de in {0, 1, 2, 3}, an arch2_4_combined-geometry MoE (random weights, Q4) is compiled
with dd = 1 and that de, then decoded with its experts on disk (O_DIRECT: the page cache is bypassed) in a
cache of a quarter of all experts, once with blocking reads (sync) and once with reads started when the
router chooses (async). Each run is its own process (clean cache, its own peak RSS).

The overlap model (benchmarks/common/overlap.py's `predict`, see docs/expert-tier.md): per token, walk the step's
segments (the native calls between the host's expert actions) with their measured compute times; each miss is a
read that waits for an I/O thread, then shares the disk's bandwidth with the other reads in flight, then is
checksummed. The read costs come from the sync run's own trace of its reads (`ExpertTier.trace`: one alone, two
in flight), the compute and host time from each mode's own run. Sync reads start at the await, async ones when
the router has chosen; the step stalls at an await until its layer's reads are done. The predicted speed-up is
sync / async; the measured one is the ratio of the two runs' tok/s; both per pair of runs next to each other in
time (the disk's speed drifts), medians over the pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

import numpy as np

from benchmarks.common.memory import peak_rss, rss
from benchmarks.common.models import GEOMETRIES, compile_random, geometry_config
from benchmarks.common.overlap import OverlapProbe, predict, read_params
from benchmarks.common.process import child_env, module_command
from benchmarks.common.record import Run, add_json_argument


def build(geometry: str, de: int, out_dir: str) -> str:
    cfg = geometry_config(geometry, dense_delay=1, expert_delay=de)
    return compile_random(cfg, os.path.join(out_dir, f"expert_tier_{geometry}_de{de}.cflow"), seed=de)


def worker(path: str, mode: str, budget_mb: float, tokens: int, threads: int) -> dict:
    """One decode run in this process: tok/s, disk bytes per token, hit rate, segment times, the reads' and
    waits' trace summary (what the overlap model takes), peak RSS."""
    import cflow

    rss_base = peak_rss()  # the interpreter and the libraries (numpy, llvmlite), before the model
    with cflow.load(path, threads=threads, experts="disk", expert_cache_mb=budget_mb, expert_io=mode) as m:
        s = m.session
        rss_loaded = peak_rss()
        prompt = [1, 2, 3, 4]
        logits = s.prefill(prompt)
        rss_prefilled = rss()  # the KV cache and activation pools touched, the cache partly filled
        st = m.expert_stats
        base = (st.hits, st.misses, st.bytes_read, st.read_seconds)
        probe = OverlapProbe(s)
        t0 = time.perf_counter()
        for _ in range(tokens):
            logits = s.step(int(np.argmax(logits)))
            probe.token()
        dt = time.perf_counter() - t0
        hits, n_miss = st.hits - base[0], st.misses - base[1]
        dense = sum(e.nbytes for e in s.reader.tensors if e.expert < 0)
        return {
            "mode": mode, "tok_s": tokens / dt, "disk_bytes_per_token": (st.bytes_read - base[2]) / tokens,
            "hit_rate": hits / max(1, hits + n_miss), "misses_per_token": n_miss / tokens,
            "read_s_per_expert": (st.read_seconds - base[3]) / max(1, n_miss),
            "misses_per_layer": {str(k): v / tokens for k, v in s.misses_by_layer().items()},
            **probe.result(tokens, dt),
            "peak_rss": peak_rss(), "rss_base": rss_base, "rss_loaded": rss_loaded, "rss_prefilled": rss_prefilled,
            "rss_end": rss(), "kv_bytes": s.kv.nbytes,
            "dense_bytes": dense, "cache_bytes": s.tier.slot_bytes * len(s.tier.slots),
            "expert_bytes_total": sum(e.nbytes for e in s.reader.tensors if e.expert >= 0),
            "direct": s.tier.direct, "window_stages": {str(k): v for k, v in s.window_stages.items()},
        }


def score(runs: dict, sync: dict) -> dict:
    """Measured and predicted speed-ups per pair of runs next to each other in time (the disk's speed drifts),
    and their medians over the pairs."""
    pairs = []
    for s_run, a_run in zip(runs["sync"], runs["async"]):
        rp = read_params(s_run)
        t_sync, t_async = predict(s_run, rp, "sync"), predict(a_run, rp, "async")
        pairs.append((a_run["tok_s"] / s_run["tok_s"], t_sync / t_async, 1 / t_sync, 1 / t_async))
    med = [float(np.median([p[i] for p in pairs])) for i in range(4)]
    return {"measured_speedup": med[0], "predicted_speedup": med[1],
            "measured_speedup_pairs": [p[0] for p in pairs], "predicted_speedup_pairs": [p[1] for p in pairs],
            "predicted_sync_tok_s": med[2], "predicted_async_tok_s": med[3],
            "read_params_ms": {k: 1e3 * v for k, v in read_params(sync).items()}}


def run_one(path: str, mode: str, budget_mb: float, tokens: int, threads: int) -> dict:
    cmd = module_command("benchmarks.expert_tier", "--worker", path, mode, budget_mb, tokens, threads)
    r = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    if r.returncode:
        raise SystemExit(f"worker failed: {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    from cflow.codegen.target import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", choices=list(GEOMETRIES), default="wide", help="model geometry (default wide)")
    ap.add_argument("--delays", default="0,1,2,3", help="expert delays to compile and run (default 0,1,2,3)")
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens per run (default 64)")
    ap.add_argument("--threads", type=int, default=2, help="decode threads (default 2)")
    ap.add_argument("--cache-fraction", type=float, default=0.25,
                    help="expert cache budget as a fraction of all experts' bytes (default 0.25)")
    ap.add_argument("--reps", type=int, default=3, help="sync/async run pairs per delay; medians (default 3)")
    ap.add_argument("--quick", action="store_true", help="the 114m geometry, 64 tokens, 5 run pairs (~2 minutes)")
    ap.add_argument("--out-dir", default=os.environ.get("CFLOW_BENCH_DIR", "/tmp/cflow-bench"),
                    help="where the compiled models go (default /tmp/cflow-bench)")
    add_json_argument(ap, "write one record per delay")
    ap.add_argument("--rescore", metavar="JSON", help="recompute the model's predictions in a results file from "
                    "the runs it holds (no decoding)")
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rescore:
        with open(args.rescore) as f:
            doc = json.load(f)
        # a file of the record schema keeps the fields in each record's extra; an older one is a list of them
        for rec in (r["extra"] for r in doc["records"]) if isinstance(doc, dict) else doc:
            rec.update(score(rec["runs"], rec["sync_run"]))
            print(f"de={rec['delay']}: measured {rec['measured_speedup']:.2f}x, "
                  f"predicted {rec['predicted_speedup']:.2f}x")
        with open(args.rescore, "w") as f:
            json.dump(doc, f, indent=1)
        return
    if args.worker:
        path, mode, budget, tokens, threads = args.worker
        print(json.dumps(worker(path, mode, float(budget), int(tokens), int(threads))))
        return
    run = Run("expert_tier", argv)
    if args.quick:
        args.geometry, args.tokens, args.reps = "114m", 64, 5
    os.makedirs(args.out_dir, exist_ok=True)
    cpu = cpu_model()
    print(f"# {cpu}, {os.cpu_count()} cores; geometry {args.geometry}; {args.threads} threads; {args.tokens} tokens;"
          f" cache = {args.cache_fraction:.0%} of the experts; O_DIRECT reads; median of {args.reps} alternating runs")
    records = []
    head = (f"{'de':>3} {'window':>6} {'sync tok/s':>10} {'async tok/s':>11} {'measured':>9} {'predicted':>9} "
            f"{'predicted sync/async':>20} {'disk MB/tok':>11} {'hit rate':>8} {'peak RSS MB':>11} "
            f"{'of it model MB':>14} {'budget MB':>9}")
    for de in (int(d) for d in args.delays.split(",")):
        t0 = time.perf_counter()
        path = build(args.geometry, de, args.out_dir)
        probe = run_one(path, "sync", 1e6, 1, args.threads)  # a cache that holds everything: sizes only
        budget_mb = max(args.cache_fraction * probe["expert_bytes_total"] / 2**20, 0.0)
        # sync and async alternate, so drifting load on a shared machine hits both alike; each mode's median run
        runs = {"sync": [], "async": []}
        for _ in range(args.reps):
            for mode in runs:
                runs[mode].append(run_one(path, mode, budget_mb, args.tokens, args.threads))
        sync, asyn = (sorted(runs[mode], key=lambda r: r["tok_s"])[len(runs[mode]) // 2] for mode in runs)
        # The model's inputs: each mode's compute per segment and host time (the async run's compute includes
        # the CPU its I/O threads take from the decode threads), the disk's parameters from the sync run's reads.
        rec = {"delay": de, "sync_tok_s": sync["tok_s"], "async_tok_s": asyn["tok_s"], **score(runs, sync),
               "disk_bytes_per_token": asyn["disk_bytes_per_token"], "hit_rate": asyn["hit_rate"],
               "peak_rss": max(sync["peak_rss"], asyn["peak_rss"]),
               "rss_base": min(sync["rss_base"], asyn["rss_base"]),
               "rss_loaded": max(sync["rss_loaded"], asyn["rss_loaded"]),
               "rss_prefilled": max(sync["rss_prefilled"], asyn["rss_prefilled"]),
               "compute_ms_per_token": 1e3 * sum(sync["segment_s"]),
               "async_compute_ms_per_token": 1e3 * sum(asyn["segment_s"]),
               "host_ms_per_token": 1e3 * sync["host_s_per_token"],
               "rss_end": max(sync["rss_end"], asyn["rss_end"]), "kv_bytes": sync["kv_bytes"],
               "misses_per_token": sync["misses_per_token"], "dense_bytes": sync["dense_bytes"],
               "cache_bytes": sync["cache_bytes"], "expert_bytes_total": sync["expert_bytes_total"],
               "window_stages": asyn["window_stages"], "cpu": cpu, "geometry": args.geometry,
               "threads": args.threads, "tokens": args.tokens, "direct": asyn["direct"], "reps": args.reps,
               "sync_run": sync, "async_run": asyn,  # the median runs: everything the model reads
               "runs": runs,
               "sync_tok_s_runs": [r["tok_s"] for r in runs["sync"]],
               "async_tok_s_runs": [r["tok_s"] for r in runs["async"]]}
        records.append(rec)
        if len(records) == 1:
            print(f"# experts {rec['expert_bytes_total'] / 2**20:.0f} MiB in all, "
                  f"cache {rec['cache_bytes'] / 2**20:.1f} MiB, dense weights {rec['dense_bytes'] / 2**20:.1f} MiB, "
                  f"KV {rec['kv_bytes'] / 2**20:.1f} MiB; "
                  "window = most stages between a router's choice and its experts; peak RSS = VmHWM; of it model "
                  "= peak RSS - the RSS before load (interpreter and libraries); budget = dense + cache + KV")
            print(head)
        budget = rec["dense_bytes"] + rec["cache_bytes"] + rec["kv_bytes"]
        pred = f"{rec['predicted_sync_tok_s']:.0f} / {rec['predicted_async_tok_s']:.0f}"
        rp = rec["read_params_ms"]
        print(f"{de:>3} {max(map(int, rec['window_stages'].values())):>6} {rec['sync_tok_s']:>10.1f} "
              f"{rec['async_tok_s']:>11.1f} {rec['measured_speedup']:>8.2f}x {rec['predicted_speedup']:>8.2f}x "
              f"{pred:>20} {rec['disk_bytes_per_token'] / 1e6:>11.2f} {100 * rec['hit_rate']:>7.1f}% "
              f"{rec['peak_rss'] / 2**20:>11.0f} {(rec['peak_rss'] - rec['rss_base']) / 2**20:>14.0f} "
              f"{budget / 2**20:>9.0f}   (compute {rec['compute_ms_per_token']:.2f} ms/token sync, "
              f"{rec['async_compute_ms_per_token']:.2f} async; {rec['misses_per_token']:.1f} reads/token; read: "
              f"queue {rp['q']:.2f} + disk {rp['d1']:.2f} (+{rp['s']:.2f} per read in flight) + checksum "
              f"{rp['c']:.2f} ms; {time.perf_counter() - t0:.0f} s)", flush=True)
    model = f"arch2_4_combined {args.geometry}"
    run.write(args.json, [run.record(engine="cflow", model=model, quant="q4", threads=r["threads"],
                                     variant=f"de {r['delay']}, async reads", tok_s=r["async_tok_s"],
                                     **{k: v for k, v in r.items() if k not in ("threads", "cpu")}) for r in records])


if __name__ == "__main__":
    main()
