"""The disk tiers under stress: many short runs with experts and weights on disk, each checked against RAM.

    nice -n 10 python -m benchmarks.stress_tiers --minutes 60 --json     # docs/reliability.md, "The disk tiers"
    python -m benchmarks.stress_tiers --minutes 2                         # a quick look

Each run loads one of the tiny presets (the MoE geometry at expert delays 0-3, a shared-expert model, a dense
model) with experts on disk (--experts-on-disk) or every big matrix streamed (--weights-on-disk), a tiny expert
cache (down to 0.35 MiB, a few experts), sync or async reads, with or without route guesses, reads coalesced or
not, on 1 or 2 threads or the default count (which backs off to one thread while the other core is busy), then
feeds a random prompt and decodes a few greedy tokens; a tenth of the runs go through `cflow run` in a process
of their own, as tests/runtime/test_expert_tier.py::test_cli_experts_on_disk does. The prompt's logits must
equal the in-RAM run's bit for bit, the tokens too. Runs happen in child processes of --runs runs each, so a
crash (SIGSEGV) is counted and its faulthandler trace kept, not the end of the loop. Meant to run next to other
work: the point is a core taken away mid-token.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import warnings

from benchmarks.common.record import Run, add_json_argument

FILES = ("de0", "de1", "de2", "de3", "shared", "dense")
CACHE_MB = (0.35, 0.5, 0.5, 1.0, 2.0)  # 0.35: a few experts of the tiny MoE; below one window is refused


def build(d: str) -> None:
    """The tiny models (q4), written once into d."""
    from cflow.compiler import compile_file
    from cflow.frontend.load import load_graph

    with warnings.catch_warnings():  # de != 2 rewrites the trained model's delays: it warns, and that is fine
        warnings.simplefilter("ignore")
        for de in (0, 1, 2, 3):
            path = os.path.join(d, f"de{de}.cflow")
            if not os.path.exists(path):
                compile_file(load_graph("preset:arch2_4_combined@tiny"), path, "q4", delays=(1, de))
        if not os.path.exists(p := os.path.join(d, "shared.vflow")):
            compile_file(load_graph("preset:arch5_shared@tiny"), p, "q4")
        if not os.path.exists(p := os.path.join(d, "dense.vflow")):
            import torch

            from cflow.frontend import from_torch
            from cflow.models import PipelineNativeLM, get_preset

            torch.manual_seed(0)
            cfg = get_preset("arch2_4_combined", "tiny").evolve(n_experts=0, top_k=0, expert_dim=0, expert_delay=0)
            compile_file(from_torch(PipelineNativeLM(cfg).eval()), p, "q4")


def path_of(d: str, key: str) -> str:
    return os.path.join(d, f"{key}.cflow" if key[2:].isdigit() else f"{key}.vflow")


def pick(rng: random.Random) -> dict:
    """One run's configuration."""
    key = rng.choice(FILES)
    moe = key != "dense"
    tier = rng.choice(["experts", "experts", "weights"]) if moe else "weights"
    return {"file": key, "cli": rng.random() < 0.1,  # a tenth through `cflow run`, as the tests start it
            "experts": "disk" if moe else "ram", "weights": "disk" if tier == "weights" else "ram",
            "expert_cache_mb": rng.choice(CACHE_MB) if moe else None, "expert_io": rng.choice(["async", "sync"]),
            "expert_guess": rng.random() < 0.7, "read_ahead": rng.choice([0, 1, 2, 5]),
            "coalesce": rng.choice(["off", "expert", "layer"]),  # ExpertTier.coalesce (library runs)
            "threads": rng.choice([1, 2, None]), "prompt": [rng.randrange(256) for _ in range(rng.randint(1, 12))],
            "new": rng.randint(2, 12)}


def child(d: str, seed: int, runs: int) -> None:
    """Runs `runs` random runs; one JSON line each on stdout."""
    import faulthandler

    import numpy as np

    import cflow
    from cflow.errors import CflowError

    faulthandler.enable()
    warnings.simplefilter("ignore")
    rng = random.Random(seed)
    ram: dict[str, object] = {}
    try:
        for _ in range(runs):
            cfg = pick(rng)
            key, ids, new = cfg["file"], cfg["prompt"], cfg["new"]
            if key not in ram:  # the reference: decode-only, as the disk tiers run (bit-identical kernels)
                ram[key] = cflow.load(path_of(d, key), threads=2, prefill_block=1)
            ref = ram[key]
            vocab = ref.session.config.vocab_size
            ids = [i % vocab for i in ids]
            want_logits = ref.logits(ids).copy()
            want = ref.generate(ids, max_new_tokens=new, stop=False)
            kw = {k: cfg[k] for k in ("experts", "weights", "expert_cache_mb", "expert_io", "expert_guess",
                                      "read_ahead", "threads")}
            t0 = time.perf_counter()
            out = {"cfg": cfg, "ok": True}
            if cfg["cli"]:
                out.update(cli_run(path_of(d, key), cfg, ids, new, want))
                out["seconds"] = round(time.perf_counter() - t0, 3)
                print(json.dumps(out), flush=True)
                continue
            try:
                with cflow.load(path_of(d, key), **kw) as m:
                    if m.session.tier is not None:
                        m.session.tier.coalesce = cfg["coalesce"]
                    got_logits = m.logits(ids)
                    got = m.generate(ids, max_new_tokens=new, stop=False)
                    out["logits_equal"] = bool(np.array_equal(got_logits, want_logits))
                    out["tokens_equal"] = got == want
                    out["ok"] = out["logits_equal"] and out["tokens_equal"]
                    st = m.expert_stats
                    out["misses"] = st.misses if st is not None else 0
                    out["solo_calls"] = m.session.solo_calls
            except CflowError as e:  # a cache below one expert-delay window: refused at load, as it should be
                if "at once" not in str(e):
                    raise
                out["refused"] = True
            out["seconds"] = round(time.perf_counter() - t0, 3)
            print(json.dumps(out), flush=True)
    finally:
        for m in ram.values():
            m.close()


def cli_run(path: str, cfg: dict, ids: list[int], new: int, want: list[int]) -> dict:
    """The run through `cflow run` in a process of its own (default options where cfg says None): exit code 0 and
    the in-RAM greedy tokens, or what went wrong (a signal is a negative exit code)."""
    argv = ["run", path, "--prompt", " ".join(map(str, ids)), "-n", str(new), "--no-stop"]
    if cfg["experts"] == "disk":
        argv += ["--experts-on-disk", "--expert-io", cfg["expert_io"]]
    if cfg["weights"] == "disk":
        argv += ["--weights-on-disk", "--read-ahead", str(cfg["read_ahead"])]
    if cfg["expert_cache_mb"] is not None:
        argv += ["--expert-cache-mb", str(cfg["expert_cache_mb"])]
    if not cfg["expert_guess"]:
        argv += ["--no-expert-guess"]
    if cfg["threads"] is not None:
        argv += ["--threads", str(cfg["threads"])]
    code = "import sys, faulthandler; faulthandler.enable(); from cflow.cli import cflow_main; " \
           "sys.exit(cflow_main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    if r.returncode == 1 and "at once" in r.stderr:
        return {"refused": True}
    got = [int(t) for t in r.stdout.split()[len(ids):]] if r.returncode == 0 else None
    out = {"ok": r.returncode == 0 and got == want, "returncode": r.returncode, "tokens_equal": got == want}
    if not out["ok"]:
        out["stderr"] = r.stderr[-3000:]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=2.0, help="how long to keep starting runs")
    p.add_argument("--runs", type=int, default=40, help="runs per child process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="where the tiny models go (default: a temporary directory)")
    p.add_argument("--child", nargs=3, metavar=("DIR", "SEED", "RUNS"), help=argparse.SUPPRESS)
    add_json_argument(p)
    args = p.parse_args(argv)
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]))
        return 0
    run = Run("stress_tiers", argv)
    tmp = None
    if args.dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="cflow-stress-")
        args.dir = tmp.name
    os.makedirs(args.dir, exist_ok=True)
    build(args.dir)
    deadline = time.monotonic() + 60 * args.minutes
    counts = {"runs": 0, "ok": 0, "mismatch": 0, "refused": 0, "crashes": 0, "children": 0}
    by = {"experts": 0, "weights": 0, "sync": 0, "async": 0, "threads_1": 0, "threads_2": 0, "threads_default": 0,
          "cli": 0}
    failures = []
    seed = args.seed
    t0 = time.monotonic()
    while time.monotonic() < deadline:
        seed += 1
        cmd = [sys.executable, "-m", "benchmarks.stress_tiers", "--child", args.dir, str(seed), str(args.runs)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        counts["children"] += 1
        for line in r.stdout.splitlines():
            if not line.startswith("{"):
                continue
            rec = json.loads(line)
            counts["runs"] += 1
            cfg = rec["cfg"]
            if rec.get("refused"):
                counts["refused"] += 1
                continue
            by["weights" if cfg["weights"] == "disk" else "experts"] += 1
            by[cfg["expert_io"]] += 1
            by[f"threads_{cfg['threads'] or 'default'}"] += 1
            by["cli"] += bool(cfg.get("cli"))
            if rec["ok"]:
                counts["ok"] += 1
            elif rec.get("returncode", 0) != 0:  # `cflow run` failed or died (a negative code: a signal)
                counts["crashes"] += 1
                failures.append({"seed": seed, "kind": f"cflow run exit {rec['returncode']}", **rec})
                print(f"child seed {seed}: cflow run exit {rec['returncode']}\n{rec.get('stderr')}", file=sys.stderr,
                      flush=True)
            else:
                counts["mismatch"] += 1
                failures.append({"seed": seed, "kind": "mismatch", **rec})
        if r.returncode != 0:
            counts["crashes"] += 1
            failures.append({"seed": seed, "kind": f"exit {r.returncode}", "stderr": r.stderr[-4000:]})
            print(f"child seed {seed}: exit code {r.returncode}\n{r.stderr[-4000:]}", file=sys.stderr, flush=True)
        elapsed = time.monotonic() - t0
        print(f"{elapsed / 60:6.1f} min: {counts}", flush=True)
    result = {**counts, **by, "minutes": round((time.monotonic() - t0) / 60, 1), "failures": failures[:20]}
    print(f"stress_tiers: {counts['runs']} runs in {result['minutes']} min ({counts['children']} processes): "
          f"{counts['ok']} ok, {counts['mismatch']} mismatches, {counts['crashes']} crashes, "
          f"{counts['refused']} refused at load; {by}")
    run.write(args.json, [run.record(engine="cflow", model="tiny presets (q4)", quant="q4", variant="disk tiers",
                                     **result)])
    if tmp is not None:
        tmp.cleanup()
    return 0 if counts["mismatch"] == 0 and counts["crashes"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
