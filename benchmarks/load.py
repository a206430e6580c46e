"""Decode speed with the machine quiet and with another process busy: the default thread count against 1 and 2.

    python -m benchmarks.load                                   # tiny and 114m (arch1, Q4), 3 rounds
    python -m benchmarks.load --models small --spins 0,2000000000   # the futex barrier vs one that never sleeps
    python -m benchmarks.load --models 114m --rounds 5 --json
    python -m benchmarks.load --baseline /tmp/cflow_old         # the same runs with another cflow tree, interleaved
    python -m benchmarks.load --spins 0,100,1000,10000 --threads 2   # tune the barrier's spin budget

The load generator (`start_load`): `spin` is one process running `python -c 'while True: pass'`, placed by
the scheduler; `spin-pinned` is the same process pinned to the last CPU this process may run on. On a
2-core machine either one takes a core's worth of CPU time from decode; `--load none,spin,spin-pinned`
picks the conditions.

Every measurement runs in a fresh child process (`--worker`), so that `--baseline DIR` can run another cflow
tree (PYTHONPATH=DIR and its own CFLOW_CACHE_DIR; e.g. `git archive HEAD | tar -x -C DIR` before a change)
in the same run as this one, interleaved. A child loads the model (threads as asked; `default` passes
none, so cflow picks), decodes one untimed warm-up sequence, then greedy sequences (reset, a 4-token
prompt, up to --tokens steps) until --seconds of decode time have passed: tok/s = tokens / decode time.
It also reports the share of the machine's CPU time that processes other than itself and the load generator
used meanwhile (`other_load`, 0..1 of all cores): on a shared machine, figures with a high share are noise.

Reported per (model, load): tok/s of each thread setting (median over rounds), and the ratios that matter:
default / 1 thread (the target: >= 0.9 under load) and 2 / 1 threads. With --baseline, new / baseline for
each setting. --spins sets the barrier's spin budget (BarrierWord.SPIN, pause rounds before a waiter
sleeps; 0 = the compiled-in default) in the children, one setting per value; a budget of 2000000000 rounds
never sleeps, which is the spin-only barrier cflow had before (the same code otherwise). `naps_per_token` is
how many barrier waits per token ended in futex_wait (Session.barrier_naps); `solo_share` the share of
decode steps the default thread count ran on one thread because workers were descheduled (Session.solo_calls).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.common import OUT
from benchmarks.common.process import child_env, module_command
from benchmarks.common.record import Run, add_json_argument
from benchmarks.common.timing import cpu_ticks, other_load

MODELS = {"tiny": "preset:arch1@tiny", "small": "preset:arch1@small", "114m": "preset:arch1@114m"}
PROMPT = [1, 2, 3, 4]


# --- the load generator ----------------------------------------------------------------------------------------
def start_load(kind: str) -> subprocess.Popen | None:
    """Start the background load `kind` (none, spin, spin-pinned); stop it with stop_load."""
    if kind == "none":
        return None
    if kind not in ("spin", "spin-pinned"):
        raise SystemExit(f"unknown load {kind!r}: expected none, spin or spin-pinned")
    cpu = max(os.sched_getaffinity(0))
    pin = (lambda: os.sched_setaffinity(0, {cpu})) if kind == "spin-pinned" else None
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin)
    time.sleep(0.3)  # let it get going (and the scheduler place it) before anything is timed
    return p


def stop_load(p: subprocess.Popen | None) -> None:
    if p is not None:
        p.kill()
        p.wait()



# --- one measurement, in a child process -----------------------------------------------------------------------
def worker(path: str, threads: int, tokens: int, seconds: float, spin: int, exclude: list[int]) -> dict:
    import numpy as np

    import cflow

    m = cflow.load(path, threads=threads or None)
    s = m.session
    if spin:
        from cflow.codegen.abi import BarrierWord

        s.barrier[BarrierWord.SPIN] = spin
    n = min(tokens, s.max_seq - len(PROMPT))

    def sequence() -> float:
        s.reset()
        logits = s.prefill(PROMPT)
        t0 = time.perf_counter()
        for _ in range(n):
            logits = s.step(int(np.argmax(logits)))
        return time.perf_counter() - t0

    sequence()  # warm-up: page in the weights, start the workers
    a = cpu_ticks(exclude)
    naps = getattr(s, "barrier_naps", 0)  # an older --baseline tree has no counter
    solo = getattr(s, "solo_calls", 0)
    spent, done = 0.0, 0
    while spent < seconds:
        spent += sequence()
        done += n
    z = cpu_ticks(exclude)
    naps = getattr(s, "barrier_naps", 0) - naps  # barrier waits that ended in futex_wait, in the timed part
    solo = getattr(s, "solo_calls", 0) - solo  # calls the default thread count ran on one thread (backed off)
    out = {"threads": m.threads, "tok_s": done / spent, "tokens": done, "seconds": spent,
           "other_load": other_load(a, z), "naps_per_token": naps / max(done, 1),
           "solo_share": solo / max(done, 1),
           "cflow": os.path.dirname(os.path.realpath(cflow.__file__))}
    m.close()
    return out


def run_child(path: str, threads: int, args, spin: int, tree: str | None, exclude: list[int]) -> dict:
    env = child_env(tree, **({"CFLOW_CACHE_DIR": os.path.join(tree, ".cflow-cache")} if tree else {}))
    cmd = module_command("benchmarks.load", "--worker", path, threads, args.tokens, args.seconds, spin,
                         ",".join(map(str, exclude)))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"worker failed ({' '.join(cmd)}):\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def compiled(name: str) -> str:
    """The model's compiled file in out/bench/ (built once)."""
    source = MODELS.get(name, name)
    if os.path.exists(source):
        return source
    path = os.path.join(OUT, f"load_{source.split(':', 1)[-1].replace('@', '_')}_q4.vflow")
    if not os.path.exists(path):
        from cflow.compiler import compile_file
        from cflow.frontend.load import load_graph

        os.makedirs(OUT, exist_ok=True)
        compile_file(load_graph(source), path, "q4")
    return path


# --- the run ----------------------------------------------------------------------------------------------------
def main(argv=None) -> None:
    from cflow.codegen.target import cpu_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,114m", help=f"comma-separated: {', '.join(MODELS)} or .vflow paths")
    p.add_argument("--load", default="none,spin", help="comma-separated: none, spin, spin-pinned")
    p.add_argument("--threads", default="default,1,2", help="comma-separated thread settings (default = cflow's)")
    p.add_argument("--rounds", type=int, default=3, help="repeats of the whole grid, interleaved; medians reported")
    p.add_argument("--tokens", type=int, default=124, help="decode steps per sequence (capped by the context)")
    p.add_argument("--seconds", type=float, default=1.0, help="decode time per measurement")
    p.add_argument("--spins", default="0", help="barrier spin budgets to measure (0 = compiled-in default)")
    p.add_argument("--baseline", metavar="DIR", help="another cflow tree to measure in the same run")
    add_json_argument(p, "write one record per measurement, the summary in the run's extra")
    p.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        path, threads, tokens, seconds, spin, exclude = args.worker
        args.tokens = int(tokens)
        rec = worker(path, int(threads), int(tokens), float(seconds), int(spin),
                     [int(x) for x in exclude.split(",") if x])
        print(json.dumps(rec))
        return

    run = Run("load", argv)
    settings = [0 if t == "default" else int(t) for t in args.threads.split(",")]
    loads = args.load.split(",")
    spins = [int(x) for x in args.spins.split(",")]
    trees = [("new", None)] + ([("baseline", os.path.abspath(args.baseline))] if args.baseline else [])
    paths = {name: compiled(name) for name in args.models.split(",")}
    print(f"# {cpu_model()}, {os.cpu_count()} CPUs, {len(os.sched_getaffinity(0))} usable; "
          f"{args.rounds} rounds x {args.seconds:g} s per measurement", flush=True)
    records = []
    for rnd in range(args.rounds):
        for name, path in paths.items():
            for load in loads:
                gen = start_load(load)
                try:
                    exclude = [gen.pid] if gen else []
                    for spin in spins:
                        for th in settings:
                            for tree, tdir in trees:
                                if spin and tree == "baseline":
                                    continue  # an older tree has no spin word
                                r = run_child(path, th, args, spin, tdir, exclude)
                                r.update(round=rnd, model=name, load=load, spin=spin, tree=tree,
                                         setting="default" if th == 0 else str(th))
                                records.append(r)
                                print(f"  round {rnd} {name:5} load={load:11} spin={spin:<6} {tree:8} "
                                      f"threads={r['setting']:7} ({r['threads']}) {r['tok_s']:10.1f} tok/s  "
                                      f"naps/token {r['naps_per_token']:6.2f}  solo {r.get('solo_share', 0):4.0%}  "
                                      f"other load {r['other_load']:.0%}",
                                      flush=True)
                finally:
                    stop_load(gen)

    def med(**key) -> float | None:
        v = [r["tok_s"] for r in records if all(r[k] == x for k, x in key.items())]
        return statistics.median(v) if v else None

    def fmt(x: float | None) -> str:
        return f"{x:5.2f}" if x is not None else "    -"

    summary = []
    print(f"\n{'model':6} {'load':11} {'spin':>6} {'tree':8} " + " ".join(f"{s:>9}" for s in args.threads.split(","))
          + "  default/1  2/1  other load (max)")
    for name in paths:
        for load in loads:
            for spin in spins:
                for tree, _ in trees:
                    if spin and tree == "baseline":
                        continue
                    row = {s: med(model=name, load=load, spin=spin, tree=tree, setting=s)
                           for s in args.threads.split(",")}
                    other = max(r["other_load"] for r in records
                                if (r["model"], r["load"], r["spin"], r["tree"]) == (name, load, spin, tree))
                    ratio = {k: (row[a] / row[b] if row.get(a) and row.get(b) else None)
                             for k, a, b in (("default/1", "default", "1"), ("2/1", "2", "1"))}
                    rec = {"model": name, "load": load, "spin": spin, "tree": tree, "tok_s": row,
                           "ratios": ratio, "other_load_max": round(other, 3)}
                    if tree == "baseline":
                        rec["new/baseline"] = {s: row[s] and med(model=name, load=load, spin=spin, tree="new",
                                                                 setting=s) / row[s] for s in row}
                    summary.append(rec)
                    print(f"{name:6} {load:11} {spin:>6} {tree:8} "
                          + " ".join(f"{row[s]:9.1f}" for s in row)
                          + f"  {fmt(ratio['default/1'])}  {fmt(ratio['2/1'])}  {other:.0%}")
                    if tree == "baseline":
                        print(f"{'':35}new/baseline: " + ", ".join(f"{s} {v:.2f}" for s, v in
                                                                   rec["new/baseline"].items() if v))
    run.write(args.json, [
        run.record(engine="cflow", model=MODELS.get(r["model"], r["model"]), quant="q4", threads=r["threads"],
                   variant=f"{r['setting']} threads, load {r['load']}" + (f", spin {r['spin']}" if r["spin"] else "")
                   + (", baseline" if r["tree"] == "baseline" else ""), tok_s=r["tok_s"],
                   **{k: v for k, v in r.items() if k not in ("threads", "tok_s", "model")}) for r in records],
        {"cpus": os.cpu_count(), "summary": summary})


if __name__ == "__main__":
    main()
