"""Experts on disk: synchronous vs asynchronous expert reads inside the expert-delay window, against the overlap model.

    python benchmarks/expert_tier.py --quick                 # < 5 minutes
    python benchmarks/expert_tier.py --json docs/results/expert_tier.json

For each expert delay de in {0, 1, 2, 3}, an arch2_4_combined-geometry MoE (random weights, Q4) is compiled
with dd = 1 and that de, then decoded with its experts on disk (O_DIRECT: the page cache is bypassed) in a
cache of a quarter of all experts, once with blocking reads (sync) and once with reads started when the
router chooses (async). Each run is its own process (clean cache, its own peak RSS).

The overlap model (the paper's, with one serial disk): from the sync run, the compute time of every segment of
the step (the native calls between the host's expert actions) and the time of one expert read (the sync run's
own, reads alone; several in flight take the ratio a probe of this file measures right after); per token, sync
= compute + every read; async = walk the segments, each layer's reads queue on the disk when its router has
chosen and are awaited where its experts run. The predicted speed-up is sync / async; the measured one is the
ratio of the two runs' tok/s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings

import numpy as np

GEOMETRIES = {
    # the paper's screening size: the arch2_4_combined 114m preset (experts 0.88 MB each at Q4)
    "114m": dict(preset="114m"),
    # dense compute and expert reads of the same order on this machine (~1 GB/s disk, ~20 GB/s DRAM)
    "wide": dict(preset="114m", d_model=1024, n_heads=16, n_kv_heads=16, head_dim=64, ffn_dim=8192,
                 expert_dim=1024, n_layers=8, n_blocks=8, vocab_size=16384),
}


def build(geometry: str, de: int, out_dir: str) -> str:
    from cflow.compiler import compile_file
    from cflow.ir import build_graph
    from cflow.models import get_preset

    g = dict(GEOMETRIES[geometry])
    cfg = get_preset("arch2_4_combined", g.pop("preset")).evolve(**g, dense_delay=1, expert_delay=de)
    path = os.path.join(out_dir, f"expert_tier_{geometry}_de{de}.cflow")
    if not os.path.exists(path):
        rng = np.random.default_rng(de)
        from cflow.ir.build import weight_shapes

        weights = {n: (rng.standard_normal(s).astype(np.float32) * (0.02 if len(s) == 2 else 1.0)
                       if len(s) == 2 else np.ones(s, np.float32)) for n, s in weight_shapes(cfg).items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile_file(build_graph(cfg, weights, name=cfg.name), path, "q4")
    return path


def _rss() -> int:
    """Resident set size now (bytes)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    """This process's peak resident set (VmHWM, bytes). Not getrusage's ru_maxrss: a child forked from a big
    parent (the one that compiled the model) inherits the parent's high-water mark across exec."""
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))


def worker(path: str, mode: str, budget_mb: float, tokens: int, threads: int) -> dict:
    """One decode run in this process: tok/s, disk bytes per token, hit rate, segment times, peak RSS."""
    import cflow

    with cflow.load(path, threads=threads, experts="disk", expert_cache_mb=budget_mb, expert_io=mode) as m:
        s = m.session
        rss_loaded = _peak_rss()
        prompt = [1, 2, 3, 4]
        logits = s.prefill(prompt)
        st = m.expert_stats
        base = (st.hits, st.misses, st.bytes_read, st.read_seconds)
        s.segment_seconds[:] = 0
        t0 = time.perf_counter()
        for _ in range(tokens):
            logits = s.step(int(np.argmax(logits)))
        dt = time.perf_counter() - t0
        hits, misses = st.hits - base[0], st.misses - base[1]
        dense = sum(e.nbytes for e in s.reader.tensors if e.expert < 0)
        return {
            "mode": mode, "tok_s": tokens / dt, "disk_bytes_per_token": (st.bytes_read - base[2]) / tokens,
            "hit_rate": hits / max(1, hits + misses), "misses_per_token": misses / tokens,
            "read_s_per_expert": (st.read_seconds - base[3]) / max(1, misses),
            "segment_s": (s.segment_seconds / tokens).tolist(),
            "segments": [[g.lo, g.hi, list(g.awaits), list(g.issues)] for g in s.segments],
            "misses_per_layer": {str(k): v / tokens for k, v in s.misses_by_layer().items()},
            "peak_rss": _peak_rss(), "rss_loaded": rss_loaded,
            "rss_end": _rss(), "kv_bytes": s.kv.nbytes,
            "dense_bytes": dense, "cache_bytes": s.tier.slot_bytes * len(s.tier.slots),
            "expert_bytes_total": sum(e.nbytes for e in s.reader.tensors if e.expert >= 0),
            "direct": s.tier.direct, "window_stages": {str(k): v for k, v in s.window_stages.items()},
        }


def disk_probe(path: str, n: int = 24) -> tuple[float, float]:
    """Seconds per expert read from this file with O_DIRECT: one at a time (latency t1), and with the tier's
    IO_THREADS requests in flight (t_par: wall time / reads). Random experts, distinct sets for the two."""
    import concurrent.futures as cf

    from cflow.layout.tile import aligned_empty
    from cflow.runtime.experts import IO_THREADS
    from cflow.runtime.format import FileReader
    from cflow.runtime.format.spec import ALIGN, pad

    with FileReader(path) as r:
        keys = r.experts
        rng = np.random.default_rng(0)
        pick = [keys[i] for i in rng.permutation(len(keys))[: 2 * n]]
        ranges = [r.expert_ranges(*k) for k in pick]
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    size = max(sum(pad(x.nbytes) for x in rs) for rs in ranges)

    def read(rs):
        buf = aligned_empty(size, ALIGN)
        off = 0
        for x in rs:
            os.preadv(fd, [memoryview(buf[off : off + pad(x.nbytes)])], x.file_offset)
            off += pad(x.nbytes)

    try:
        t0 = time.perf_counter()
        for rs in ranges[:n]:
            read(rs)
        t1 = (time.perf_counter() - t0) / n
        with cf.ThreadPoolExecutor(IO_THREADS) as pool:
            t0 = time.perf_counter()
            list(pool.map(read, ranges[n:]))
            t_par = (time.perf_counter() - t0) / len(ranges[n:])
    finally:
        os.close(fd)
    return t1, t_par


def predict(run: dict, t1: float, t_par: float, mode: str) -> float:
    """Per-token seconds under the overlap model (see the module docstring): the measured compute of every
    segment, and each layer's misses read as one batch on a disk that serves a batch of m reads in
    t1 + (m - 1) * t_par and is busy m * t_par; async batches start after the route's segment, sync ones at
    the await; the step waits where a layer's experts are used."""
    miss = {int(k): v for k, v in run["misses_per_layer"].items()}
    t, disk, done = 0.0, 0.0, {}

    def submit(layer, at):
        nonlocal disk
        m = miss.get(layer, 0.0)
        start = max(at, disk)
        disk = start + m * t_par
        done[layer] = start + (t1 + (m - 1) * t_par if m >= 1 else m * t1)

    for (_lo, _hi, awaits, issues), c in zip(run["segments"], run["segment_s"]):
        for layer in awaits:
            if mode == "sync":
                submit(layer, t)
            t = max(t, done.get(layer, t))
        t += c
        if mode == "async":
            for layer in issues:
                submit(layer, t)
    return t


def run_one(path: str, mode: str, budget_mb: float, tokens: int, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", path, mode, str(budget_mb), str(tokens), str(threads)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"worker failed: {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", choices=list(GEOMETRIES), default="wide", help="model geometry (default wide)")
    ap.add_argument("--delays", default="0,1,2,3", help="expert delays to compile and run (default 0,1,2,3)")
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens per run (default 64)")
    ap.add_argument("--threads", type=int, default=2, help="decode threads (default 2)")
    ap.add_argument("--cache-fraction", type=float, default=0.25,
                    help="expert cache budget as a fraction of all experts' bytes (default 0.25)")
    ap.add_argument("--reps", type=int, default=3, help="sync/async run pairs per delay; medians (default 3)")
    ap.add_argument("--quick", action="store_true", help="the 114m geometry, 48 tokens (under 5 minutes)")
    ap.add_argument("--out-dir", default=os.environ.get("CFLOW_BENCH_DIR", "/tmp/cflow-bench"),
                    help="where the compiled models go (default /tmp/cflow-bench)")
    ap.add_argument("--json", help="write one record per delay to this file")
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        path, mode, budget, tokens, threads = args.worker
        print(json.dumps(worker(path, mode, float(budget), int(tokens), int(threads))))
        return
    if args.quick:
        args.geometry, args.tokens = "114m", 48
    os.makedirs(args.out_dir, exist_ok=True)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"# {cpu}, {os.cpu_count()} cores; geometry {args.geometry}; {args.threads} threads; {args.tokens} tokens;"
          f" cache = {args.cache_fraction:.0%} of the experts; O_DIRECT reads; median of {args.reps} alternating runs")
    records = []
    head = (f"{'de':>3} {'sync tok/s':>10} {'async tok/s':>11} {'measured':>9} {'predicted':>9} "
            f"{'disk MB/tok':>11} {'hit rate':>8} {'RSS MB':>7} {'peak RSS MB':>11} {'dense+cache+KV MB':>17}")
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
        p1, p_par = disk_probe(path)
        # The disk's speed drifts from minute to minute (shared storage): one read's time is the sync run's own
        # (its reads are alone on the disk), and reads in flight keep the probe's ratio to it.
        t1 = sync["read_s_per_expert"] or p1
        t_par = t1 * p_par / p1
        # the model from each run's own compute (the async run's compute includes its I/O threads' CPU use)
        t_sync, t_async = predict(sync, t1, t_par, "sync"), predict(asyn, t1, t_par, "async")
        rec = {"delay": de, "sync_tok_s": sync["tok_s"], "async_tok_s": asyn["tok_s"],
               "predicted_speedup": t_sync / t_async, "measured_speedup": asyn["tok_s"] / sync["tok_s"],
               "disk_bytes_per_token": asyn["disk_bytes_per_token"], "hit_rate": asyn["hit_rate"],
               "peak_rss": max(sync["peak_rss"], asyn["peak_rss"]),
               "predicted_sync_tok_s": 1 / t_sync, "predicted_async_tok_s": 1 / t_async,
               "read_ms_per_expert": 1e3 * t1, "read_ms_per_expert_parallel": 1e3 * t_par,
               "probe_read_ms": 1e3 * p1, "probe_read_ms_parallel": 1e3 * p_par,
               "compute_ms_per_token": 1e3 * sum(sync["segment_s"]), "rss_end": max(sync["rss_end"], asyn["rss_end"]),
               "kv_bytes": sync["kv_bytes"],
               "misses_per_token": sync["misses_per_token"], "dense_bytes": sync["dense_bytes"],
               "cache_bytes": sync["cache_bytes"], "expert_bytes_total": sync["expert_bytes_total"],
               "window_stages": asyn["window_stages"], "cpu": cpu, "geometry": args.geometry,
               "threads": args.threads, "tokens": args.tokens, "direct": asyn["direct"], "reps": args.reps,
               "sync_tok_s_runs": [r["tok_s"] for r in runs["sync"]],
               "async_tok_s_runs": [r["tok_s"] for r in runs["async"]]}
        records.append(rec)
        if len(records) == 1:
            print(f"# experts {rec['expert_bytes_total'] / 1e6:.0f} MB in all, "
                  f"cache {rec['cache_bytes'] / 1e6:.0f} MB, dense weights {rec['dense_bytes'] / 1e6:.0f} MB")
            print(head)
        print(f"{de:>3} {rec['sync_tok_s']:>10.2f} {rec['async_tok_s']:>11.2f} {rec['measured_speedup']:>8.2f}x "
              f"{rec['predicted_speedup']:>8.2f}x {rec['disk_bytes_per_token'] / 1e6:>11.2f} "
              f"{100 * rec['hit_rate']:>7.1f}% {rec['rss_end'] / 2**20:>7.0f} {rec['peak_rss'] / 2**20:>11.0f} "
              f"{(rec['dense_bytes'] + rec['cache_bytes'] + rec['kv_bytes']) / 2**20:>17.0f}"
              f"   (compute {rec['compute_ms_per_token']:.1f} ms/token, {rec['misses_per_token']:.1f} reads/token, "
              f"{rec['read_ms_per_expert']:.2f} ms alone / {rec['read_ms_per_expert_parallel']:.2f} ms in parallel; "
              f"predicted {rec['predicted_sync_tok_s']:.0f} / {rec['predicted_async_tok_s']:.0f} tok/s; "
              f"{time.perf_counter() - t0:.0f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
