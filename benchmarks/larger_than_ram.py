"""A model larger than its memory budget: each engine in its own memory cgroup, the page cache dropped first.

    python -m benchmarks.larger_than_ram --quick       # the ~4 GB sibling at 2 GiB against llama.cpp, minutes
    python -m benchmarks.larger_than_ram --vflow M.vflow --gguf M.gguf --budget 2G
    python -m benchmarks.larger_than_ram --vflow M.vflow --gguf M.gguf --budget 8G --engines cflow,llama

Each run is a fresh process started inside a memory cgroup limited to the budget (benchmarks/common/cgroup.py:
the limit counts the page cache the process fills, mapped file pages included, as a container's does), with
the model files' pages dropped from the page cache before it starts. Every engine reads the same prompt (token
ids) and decodes the same number of greedy tokens:

    cflow          cflow.load(max_ram_mb=budget): the weights stay mapped if they fit, else the experts go to disk
                   (O_DIRECT) with a cache of what the budget leaves, else the big matrices are streamed too
    cflow-noguess  the same without the next layer's reads started on a guess of its route (expert_guess=False)
    cflow-lru      the same with the expert cache evicting the least recently used (the default: least often chosen)
    cflow-mmap     cflow.load() as by default: the file mapped, the kernel's page cache decides what stays
    llama          llama.cpp (llama-cpp-python) on the GGUF, as by default: the file mapped
    llama-nommap   llama.cpp with use_mmap=False: the file read into memory (only where it fits the budget)
    cflow-ram      cflow with no budget: the reference tokens (run outside any cgroup, where RAM allows)

Reported per run: load seconds, decode tok/s, the cgroup's peak (page cache included) and limit hits, the
process's peak RSS, bytes read from the disk per token (/proc/self/io), major faults, cflow's expert-cache hit
rate and its wait for reads; and the disk's own O_DIRECT read rate (reads of one expert's size, one at a time
and two in flight) measured in the same run before the engines.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from benchmarks.common.cgroup import MemoryGroup, cached_bytes, drop_page_cache
from benchmarks.common.overlap import OverlapProbe, predict, read_params
from benchmarks.common.process import child_env, module_command
from benchmarks.common.record import Run, add_json_argument

ENGINES = ("cflow", "cflow-noguess", "cflow-lru", "cflow-mmap", "llama", "llama-nommap", "cflow-ram")
PROMPT = [1, 17, 42, 99, 7, 123, 5, 250]


def _io_read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("read_bytes:"))


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))


def _cflow(path: str, engine: str, budget_mb: float, prompt: list[int], tokens: int, threads: int) -> dict:
    import numpy as np

    import cflow

    budgeted = ("cflow", "cflow-noguess", "cflow-lru")
    kw = {"max_ram_mb": budget_mb, "expert_guess": engine != "cflow-noguess"} if engine in budgeted else {}
    t0 = time.perf_counter()
    with cflow.load(path, threads=threads, max_seq=len(prompt) + tokens + 8, **kw) as m:
        s = m.session
        if engine == "cflow-lru" and s.tier is not None:
            s.tier.policy = "lru"
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        logits = s.prefill(prompt)
        prompt_s = time.perf_counter() - t0
        st = m.expert_stats if s.tier is not None else None
        base = (st.hits, st.misses, st.bytes_read, st.wait_seconds, st.read_seconds, st.guessed,
                st.guessed_used) if st else None
        io0, flt0 = _io_read_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        out, routes, probe = [], [], None
        if st:  # the route of every layer, for replaying cache policies (policy_hits); the reads and waits, the
            # compute per segment and the reads per layer per token, for the overlap model (OverlapProbe)
            probe = OverlapProbe(s)
            real = s._route
            s._route = lambda layer: routes.append([s.config.block_of(layer), *map(int, r := real(layer))]) or r
        t0 = time.perf_counter()
        for _ in range(tokens):
            out.append(int(np.argmax(logits)))
            logits = s.step(out[-1])
            if probe:
                probe.token()
        dt = time.perf_counter() - t0
        rec = {"load_s": load_s, "prompt_s": prompt_s, "tok_s": tokens / dt, "tokens": out,
               "placement": f"experts {s.experts}, weights {s.weights}", "reads": _read_mode(s),
               "disk_bytes_per_token": (_io_read_bytes() - io0) / tokens,
               "major_faults_per_token": (resource.getrusage(resource.RUSAGE_SELF).ru_majflt - flt0) / tokens}
        if st:
            hits, misses = st.hits - base[0], st.misses - base[1]
            read = st.bytes_read - base[2]
            rec.update(hit_rate=hits / max(1, hits + misses), expert_bytes_per_token=read / tokens,
                       wait_s_per_token=(st.wait_seconds - base[3]) / tokens,
                       read_s_per_token=(st.read_seconds - base[4]) / tokens,
                       guessed_per_token=(st.guessed - base[5]) / tokens,
                       guessed_used_per_token=(st.guessed_used - base[6]) / tokens,
                       # every byte read over the time spent waiting (an upper bound of the rate while waiting:
                       # reads that overlapped compute count too; disk_while_waiting has the real one)
                       gbs_read_per_wait=read / max(1e-9, st.wait_seconds - base[3]) / 1e9,
                       cache_mb=len(s.tier.slots) * s.tier.slot_bytes / 2**20, cached_experts=len(s.tier.slots),
                       routes=routes, **disk_while_waiting(probe.trace, s.tier),
                       direct=s.tier.direct, **overlap_prediction(probe.result(tokens, dt), s))
        return rec


def overlap_prediction(run: dict, session) -> dict:
    """The overlap model (benchmarks/common/overlap.py) on a run's own misses, guessed reads, compute per segment,
    host time and read costs (from its trace): predicted tok/s and wait per token, next to the measured wait.
    The compute and host time are the run's, so the two differ only by the waits the model predicts. Not for
    weights streamed from disk (the model has no streamer)."""
    rp = read_params(run)
    seconds = predict(run, rp, session.expert_io)
    compute = sum(run["segment_s"]) + run["host_s_per_token"]
    return {"overlap": run, "read_params_ms": {k: 1e3 * v for k, v in rp.items()},
            "predicted_tok_s": 1 / seconds if session.weights != "disk" else None,
            "predicted_wait_ms_per_token": 1e3 * (seconds - compute),
            "wait_ms_per_token": run["trace"]["wait_ms_per_token"], "compute_ms_per_token": 1e3 * compute}


def _read_mode(s) -> str:
    """How a cflow run read its weights: 'direct' (O_DIRECT), 'buffered' (O_DIRECT refused: the page cache, each
    read dropped after it), or 'mapped' (no disk tier)."""
    tiers = [t for t in (s.tier, s.streamer) if t is not None]
    return "mapped" if not tiers else "direct" if all(t.direct for t in tiers) else "buffered"


def _llama(path: str, engine: str, prompt: list[int], tokens: int, threads: int) -> dict:
    from benchmarks.common.peers import llama_next, llama_open

    t0 = time.perf_counter()
    # extra buffer types off: this VM's llama.cpp build crashes with them on these files (peers.llama_open)
    llm = llama_open(path, threads, extra_bufts=False, n_ctx=len(prompt) + tokens + 8,
                     use_mmap=engine != "llama-nommap")
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.eval(prompt)
    prompt_s = time.perf_counter() - t0
    io0, flt0 = _io_read_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    out = []
    t0 = time.perf_counter()
    for _ in range(tokens):
        out.append(llama_next(llm))
        llm.eval([out[-1]])
    dt = time.perf_counter() - t0
    return {"load_s": load_s, "prompt_s": prompt_s, "tok_s": tokens / dt, "tokens": out,
            "placement": "mapped" if engine == "llama" else "read into memory",
            "reads": "mapped" if engine == "llama" else "read",
            "disk_bytes_per_token": (_io_read_bytes() - io0) / tokens,
            "major_faults_per_token": (resource.getrusage(resource.RUSAGE_SELF).ru_majflt - flt0) / tokens}


def worker(engine: str, path: str, budget_mb: float, tokens: int, threads: int) -> dict:
    run = (_llama(path, engine, PROMPT, tokens, threads) if engine.startswith("llama")
           else _cflow(path, engine, budget_mb, PROMPT, tokens, threads))
    return {**run, "peak_rss": _peak_rss()}


def run_engine(engine: str, path: str, budget: int | None, tokens: int, threads: int, timeout: float,
               parent: tuple[str, str] | None = None) -> dict:
    """One engine in a fresh process: in a cgroup of `budget` bytes (None: no cgroup; parent: where to make it,
    MemoryGroup's), `path` out of the page cache."""
    drop_page_cache([path])
    cmd = module_command("benchmarks.larger_than_ram", "--worker", engine, path, (budget or 0) / 2**20, tokens,
                         threads)
    group = MemoryGroup(f"cflow-ltr-{os.getpid()}-{engine}", budget, parent) if budget else None
    t0 = time.perf_counter()
    try:
        p = (group.popen if group else subprocess.Popen)(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                         text=True, env=child_env())
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            err += f"\n(killed after {timeout:.0f} s)"
        rec = {"wall_s": time.perf_counter() - t0, "returncode": p.returncode}
        if group:
            rec["cgroup"] = group.stats()
    finally:
        if group:
            group.close()
    if p.returncode == 0:
        rec.update(json.loads(out.strip().splitlines()[-1]))
    else:  # an OOM kill or a crash is a result too: say what happened
        rec["error"] = (err.strip().splitlines() or ["(no output)"])[-1][-300:]
    return rec


def disk_while_waiting(trace: list, tier) -> dict:
    """From the tier's trace of reads and waits: the disk's rate while the step waited (each read's bytes spread
    over its time on the disk, the part inside wait intervals summed, over the summed wait time), and the share
    of the wait with no read on the disk at all (time lost to the checksum, the queue or the host)."""
    from cflow.runtime.format.spec import pad

    waits = [(a, b) for kind, _, a, b in (t[:4] for t in trace if t[0] == "wait") if b > a]
    reads = [(t[5], t[6], sum(pad(r.nbytes) for _, _, r in tier.layout[(t[1], t[2])]))
             for t in trace if t[0] == "read"]
    total = sum(b - a for a, b in waits)
    if not waits or total <= 0:
        return {"wait_s_traced": 0.0}
    inside = sum(n * max(0.0, min(d1, w1) - max(d0, w0)) / max(d1 - d0, 1e-9)
                 for d0, d1, n in reads for w0, w1 in waits)
    busy = 0.0  # wait time with at least one read on the disk (the union of the reads' disk intervals)
    spans = sorted((d0, d1) for d0, d1, _ in reads)
    for w0, w1 in waits:
        edge = w0
        for d0, d1 in spans:
            if d1 <= edge or d0 >= w1:
                continue
            lo, hi = max(d0, edge), min(d1, w1)
            if hi > lo:
                busy += hi - lo
                edge = hi
    return {"wait_s_traced": total, "gbs_disk_while_waiting": inside / total / 1e9,
            "wait_share_disk_idle": 1 - busy / total}


def policy_hits(routes: list[list[int]], slots: int) -> dict[str, float]:
    """Hit rates of cache policies replayed on a run's routes ([block, expert...] per routed layer, in order) with
    `slots` experts cached, over the second half of the run (the first warms the cache): LRU (the tier's),
    LFU (most chosen so far stays), LRU with the half of the slots pinned to the experts chosen most in the
    first half, and Belady's MIN (evict the expert needed furthest ahead: no policy can do better)."""
    import collections

    seq = [(r[0], e) for r in routes for e in r[1:]]
    half = len(seq) // 2
    if not seq or slots < 1:
        return {}
    out = {}
    for policy in ("lru", "lfu", "lru+pinned", "min"):
        cache: collections.OrderedDict = collections.OrderedDict()
        counts = collections.Counter()
        pinned = set()
        if policy == "lru+pinned":
            pinned = {k for k, _ in collections.Counter(seq[:half]).most_common(slots // 2)}
        nxt = {}
        if policy == "min":  # for each access, where its key comes next
            at: dict = {}
            nxt = [0] * len(seq)
            for i in range(len(seq) - 1, -1, -1):
                nxt[i] = at.get(seq[i], len(seq))
                at[seq[i]] = i
        hits = 0
        for i, k in enumerate(seq):
            counts[k] += 1
            if k in pinned or k in cache:
                hits += i >= half
                if k in cache:
                    cache.move_to_end(k)
                    if policy == "min":
                        cache[k] = nxt[i]
                continue
            if len(cache) >= slots - len(pinned):
                if policy == "lfu":
                    victim = min(cache, key=lambda c: counts[c])  # ties: the least recent (dict order)
                elif policy == "min":
                    victim = max(cache, key=cache.get)
                else:
                    victim = next(iter(cache))
                del cache[victim]
            cache[k] = nxt[i] if policy == "min" else None
        out[policy] = hits / max(1, len(seq) - half)
    return out


def disk_peak(path: str, chunk: int) -> tuple[float, float]:
    """The disk's O_DIRECT read rate in GB/s for reads of `chunk` bytes: one at a time, two in flight."""
    from benchmarks.read_ahead import disk_rate

    return disk_rate(path, chunk)


def _expert_bytes(vflow: str) -> int:
    """One expert's bytes in the file (all its matrices): the size of one expert read."""
    from cflow.runtime.format import FileReader

    per: dict[tuple[int, int], int] = {}
    for t in FileReader(vflow).tensors:
        if t.expert >= 0:
            per[(t.layer, t.expert)] = per.get((t.layer, t.expert), 0) + t.nbytes
    return max(per.values(), default=4 << 20)


def _print_run(engine: str, r: dict) -> None:
    if "error" in r:
        print(f"{engine:<13} failed (exit {r['returncode']}): {r['error']}", flush=True)
        return
    gbs = r["disk_bytes_per_token"] * r["tok_s"] / 1e9
    print(f"{engine:<13} {r['placement']:<26} {r.get('reads', '-'):<8} {r['tok_s']:7.2f} "
          f"{r.get('predicted_tok_s') or float('nan'):7.2f} {r['load_s']:7.1f} "
          f"{r['disk_bytes_per_token'] / 1e6:11.1f} {gbs:9.2f} "
          f"{r.get('gbs_disk_while_waiting', float('nan')):12.2f} "
          f"{r.get('wait_share_disk_idle', float('nan')):5.0%} {r.get('hit_rate', float('nan')):8.1%} "
          f"{((r.get('cgroup') or {}).get('peak') or 0) / 2**20:9.0f} "
          f"{r['peak_rss'] / 2**20:8.0f} {' '.join(map(str, r['tokens'][:3]))}..", flush=True)


def sibling_files(models: str | None) -> tuple[str, str]:
    """The ~4 GB sibling's .vflow and GGUF twin (benchmarks/make_moe.py), built there on first use."""
    from pathlib import Path

    from benchmarks import make_moe

    d = Path(models or os.environ.get("CFLOW_MODELS") or Path.home() / ".cache" / "cflow" / "models") / "bigmoe"
    name = make_moe.geometry("sibling-4g").name
    vflow, gguf = d / f"{name}.vflow", d / f"{name}.gguf"
    if not (vflow.exists() and gguf.exists()):
        print(f"# building the sibling in {d} (4.3 GB .vflow + 4.3 GB GGUF, a few minutes)", flush=True)
        make_moe.main(["--geometry", "sibling-4g", "--out", str(d), "--gguf", "--no-dd"])
    return str(vflow), str(gguf)


def summary(records: list[dict]) -> None:
    """The last line: cflow against llama.cpp in the same budget, and whether their greedy tokens agree."""
    by = {r["engine"]: r for r in records}
    c, ll = by.get("cflow"), by.get("llama")
    if c and ll and c["tok_s"] and ll["tok_s"]:
        same = c["extra"].get("tokens") == ll["extra"].get("tokens")
        print(f"cflow / llama.cpp = {c['tok_s'] / ll['tok_s']:.2f}x, tokens identical: {'yes' if same else 'no'}")


def main(argv=None) -> None:
    from cflow.cli import size_mb
    from cflow.codegen.target import cpu_model, isa_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vflow", help="the model compiled by cflow")
    ap.add_argument("--gguf", help="the same weights as a GGUF file, for llama.cpp")
    ap.add_argument("--budget", type=size_mb, default=8192, metavar="SIZE",
                    help="the memory cgroup's limit for each engine (8G, 2G, ...; default 8G)")
    ap.add_argument("--engines", default="cflow,cflow-noguess,cflow-lru,cflow-mmap,llama,llama-nommap,cflow-ram",
                    help=f"engines to run, in this order (of {', '.join(ENGINES)})")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens decoded (default 64)")
    ap.add_argument("--threads", type=int, default=2, help="threads of every engine (default 2)")
    ap.add_argument("--reps", type=int, default=1, help="runs of each engine, alternating; the median is recorded "
                    "(default 1)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds before a run is killed (default 1800)")
    add_json_argument(ap, "write one record per engine")
    ap.add_argument("--quick", action="store_true", help="the ~4 GB sibling of the Qwen3-30B-A3B geometry at a 2 GiB "
                    "budget: cflow, llama.cpp and cflow in RAM (the files built on first use, ~9 GB)")
    ap.add_argument("--models", default=None, help="where --quick finds or builds the sibling (default "
                    "$CFLOW_MODELS/bigmoe or ~/.cache/cflow/models/bigmoe)")
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    ap.add_argument("--cgroup-parent", nargs=2, metavar=("KIND", "DIR"), help=argparse.SUPPRESS)  # tests
    args = ap.parse_args(argv)
    if args.quick:
        args.vflow, args.gguf = sibling_files(args.models)
        args.budget, args.engines = 2048, "cflow,llama,cflow-ram"
    if args.worker:
        engine, path, budget, tokens, threads = args.worker
        print(json.dumps(worker(engine, path, float(budget), int(tokens), int(threads))))
        return
    engines = args.engines.split(",")
    bad = [e for e in engines if e not in ENGINES]
    if bad or not args.vflow and any(not e.startswith("llama") for e in engines) or \
            not args.gguf and any(e.startswith("llama") for e in engines):
        raise SystemExit(f"unknown engines {bad}" if bad else "give --vflow for cflow and --gguf for llama.cpp")
    run = Run("larger_than_ram", argv)
    budget = int(args.budget * 2**20)
    sizes = {k: os.path.getsize(p) for k, p in (("vflow", args.vflow), ("gguf", args.gguf)) if p}
    one = _expert_bytes(args.vflow) if args.vflow else 4 << 20
    d1, d2 = disk_peak(args.vflow or args.gguf, one)
    print(f"# {cpu_model()} ({isa_path()}); budget {budget / 2**30:.2f} GiB per engine (memory cgroup, page cache "
          f"counted); files: " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in sizes.items()))
    print(f"# disk, O_DIRECT reads of one expert ({one / 2**20:.2f} MiB): {d1:.2f} GB/s one at a time, "
          f"{d2:.2f} GB/s two in flight; {args.tokens} greedy tokens after {len(PROMPT)} prompt tokens, "
          f"{args.threads} threads")
    print(f"{'engine':<13} {'placement':<26} {'reads':<8} {'tok/s':>7} {'model':>7} {'load s':>7} {'disk MB/tok':>11} "
          f"{'disk GB/s':>9} {'waiting GB/s':>12} {'idle':>5} {'hit rate':>8} {'peak MiB':>9} {'RSS MiB':>8} "
          f"{'tokens':>8}")
    records: list[dict] = []
    ref = None
    runs: dict[str, list[dict]] = {}
    for rep in range(args.reps):  # the engines alternate, in reverse order every other round (drifting load)
        for engine in engines if rep % 2 == 0 else engines[::-1]:
            path = args.gguf if engine.startswith("llama") else args.vflow
            if engine == "llama-nommap" and sizes["gguf"] > budget:
                if rep == 0:
                    print(f"{engine:<13} skipped: the GGUF ({sizes['gguf'] / 2**30:.2f} GiB) does not fit the budget")
                continue
            r = run_engine(engine, path, None if engine == "cflow-ram" else budget, args.tokens, args.threads,
                           args.timeout, tuple(args.cgroup_parent) if args.cgroup_parent else None)
            r["page_cache_after"] = cached_bytes(path)
            runs.setdefault(engine, []).append(r)
            _print_run(engine, r)
    for engine, rs in runs.items():  # one record per engine: its median run by tok/s, every run's tok/s with it
        ok = sorted((r for r in rs if "error" not in r), key=lambda r: r["tok_s"])
        r = ok[len(ok) // 2] if ok else rs[0]
        r["tok_s_runs"] = [x.get("tok_s") for x in rs]
        if engine == "cflow-ram" and "tokens" in r:
            ref = r["tokens"]
        path = args.gguf if engine.startswith("llama") else args.vflow
        records.append(run.record(engine=engine, model=os.path.basename(path), quant="Q4_0", threads=args.threads,
                                  variant=f"budget {budget / 2**30:g} GiB" if engine != "cflow-ram" else "no budget",
                                  tok_s=r.pop("tok_s", None), **r))
    if args.reps > 1:
        each = {rec["engine"]: " ".join(f"{t:.2f}" for t in rec["extra"]["tok_s_runs"] if t) for rec in records}
        print("# medians of the runs: " + ", ".join(f"{rec['engine']} {rec['tok_s']:.2f} tok/s ({each[rec['engine']]})"
                                                    for rec in records if rec["tok_s"]))
    for rec in records:  # the overlap model on each median run: what its waits should have been
        ex = rec["extra"]
        if ex.get("predicted_tok_s"):
            rp = ex["read_params_ms"]
            print(f"# {rec['engine']}: overlap model {ex['predicted_tok_s']:.2f} tok/s against {rec['tok_s']:.2f} "
                  f"measured ({ex['predicted_tok_s'] / rec['tok_s']:.2f}x); wait "
                  f"{ex['predicted_wait_ms_per_token']:.0f} ms/token predicted, {ex['wait_ms_per_token']:.0f} "
                  f"measured, compute + host {ex['compute_ms_per_token']:.0f}; a read: queue {rp['q']:.2f} + disk "
                  f"{rp['d1']:.2f} (+{rp['s']:.2f} per read in flight) + checksum {rp['c']:.2f} ms")
    for rec in records:  # cache policies replayed on what each disk run chose (hit rates: second half)
        ex = rec["extra"]
        if ex.get("routes"):
            ex["policy_hits"] = policy_hits(ex["routes"], ex["cached_experts"])
            print(f"# {rec['engine']}: cache policies on its routes, {ex['cached_experts']} slots: " +
                  ", ".join(f"{k} {v:.1%}" for k, v in ex["policy_hits"].items()))
    if ref is not None:
        for rec in records:
            toks = rec["extra"].get("tokens")
            if toks is not None:
                same = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), len(ref))
                rec["extra"]["tokens_equal_to_ram"] = same
                print(f"# {rec['engine']}: {'all ' + str(same) if same == len(ref) else same} greedy tokens equal "
                      f"to cflow in RAM")
    summary(records)
    run.write(args.json, records, {"budget": budget, "disk_gbs_one": d1, "disk_gbs_two": d2, "expert_bytes": one,
                                   "file_bytes": sizes, "prompt": PROMPT})


if __name__ == "__main__":
    sys.exit(main())
