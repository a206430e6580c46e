"""The README's test command, timed on each ISA path, on idle cores and with another process busy (issue 36: within
10 minutes on 2 cores on every host kind, each path forced, the other core busy as CI may have it).

    python -m benchmarks.suite_time                              # own path and AVX2 forced, idle and loaded
    python -m benchmarks.suite_time --paths avx2 --load spin     # the hardest case alone
    python -m benchmarks.suite_time --paths own,avxvnni,avx2,generic --load none,spin --json

Each run is `python -m pytest -q` in a child process from the repository root, with the path forced the way users
force it (CFLOW_FEATURES / CFLOW_CPU: cflow.codegen.target.forced_env) and, for `--load spin`, benchmarks/load.py's
spinner (`python -c 'while True: pass'`) running from before the suite starts to its end. Reported per run: wall
time, the suite's CPU time (user + system of the child and everything under it: the xdist workers and the
subprocesses tests start), its summary line (passed / failed / skipped), and the share of the cores other
processes used meanwhile (the spinner left out). The runs go one after another in the order given; a failed
suite is reported and the next one runs. --jit: the tests' JIT libraries recorded too (benchmarks/common/jit_stats.py,
a pytest plugin): how many were compiled (object-cache misses), LLVM's seconds on them and their IR text, against the
suite's CPU time (the Python that emits the IR is not in it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

from benchmarks.common import ROOT
from benchmarks.common.record import Run, add_json_argument
from benchmarks.common.timing import cpu_ticks, other_load
from benchmarks.load import start_load, stop_load

PATHS = ("own", "avx512vnni", "avxvnni", "avx2", "generic")
SUMMARY = re.compile(r"^=*\s*(.*\b(?:passed|failed|error)\b.*?) in [\d.]+s", re.M)


def path_env(path: str) -> dict[str, str]:
    """The environment that makes the suite build `path`'s kernels (own: the host's best, nothing forced)."""
    from cflow.codegen.target import forced_env

    env = dict(os.environ)
    for k in ("CFLOW_CPU", "CFLOW_FEATURES"):
        env.pop(k, None)
    if path != "own":
        env.update({k: v for k, v in forced_env(path).items() if v})
    return env


def jit_totals(path: str) -> dict:
    """jit_stats' lines summed: libraries compiled (cache misses) and found in the object cache, LLVM's seconds on
    the compiled ones, their IR text in MB."""
    rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    miss = [r for r in rows if not r["hit"]]
    return {"jit_compiled": len(miss), "jit_cached": len(rows) - len(miss),
            "jit_llvm_s": round(sum(r["llvm_s"] for r in miss), 1),
            "jit_ir_mb": round(sum(r["ir_bytes"] for r in miss) / 1e6, 1)}


def run_suite(path: str, load: str, pytest_args: list[str], jit: bool = False) -> dict:
    """One run of the suite: wall and CPU seconds, the summary line, the other processes' share of the cores (and
    with `jit`, jit_totals)."""
    env = path_env(path)
    stats = None
    if jit:
        fd, stats = tempfile.mkstemp(prefix="cflow-jit-stats-", suffix=".jsonl")
        os.close(fd)
        env["CFLOW_JIT_STATS"] = stats
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)  # the workers' plugin
        pytest_args = ["-p", "benchmarks.common.jit_stats", *pytest_args]
    spinner = start_load(load)
    try:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        ticks = cpu_ticks((spinner.pid,) if spinner else ())
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", *pytest_args], cwd=ROOT, env=env,
                             capture_output=True, text=True)
        wall = time.perf_counter() - t0
        ticks_after = cpu_ticks((spinner.pid,) if spinner else ())
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    finally:
        stop_load(spinner)
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    # the suite's processes are this one's children (counted by rusage once waited for), not in cpu_ticks' "mine"
    suite = (user + system) * os.sysconf("SC_CLK_TCK")
    total = max(ticks_after[0] - ticks[0], 1)
    busy = max(0.0, other_load(ticks, ticks_after) - suite / total)
    found = SUMMARY.findall(out.stdout)
    r = {"path": path, "load": load, "wall_s": round(wall, 1), "returncode": out.returncode,
         "user_s": round(user, 1), "system_s": round(system, 1),
         "summary": found[-1] if found else out.stdout.strip().splitlines()[-1:], "other_load": round(busy, 3)}
    if stats:
        r.update(jit_totals(stats))
        os.unlink(stats)
    return r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paths", default="own,avx2", help=f"comma-separated, from {', '.join(PATHS)} (default own,avx2)")
    p.add_argument("--load", default="none,spin", help="comma-separated: none, spin, spin-pinned (default none,spin)")
    p.add_argument("--pytest-args", default="", help="extra pytest arguments, one string (default none)")
    p.add_argument("--jit", action="store_true", help="also record the tests' JIT libraries (default off)")
    add_json_argument(p)
    args = p.parse_args(argv)
    paths = args.paths.split(",")
    bad = [x for x in paths if x not in PATHS]
    if bad:
        raise SystemExit(f"unknown path(s) {', '.join(bad)}: expected some of {', '.join(PATHS)}")
    from cflow.codegen.target import cpu_model, host_target

    run = Run("suite_time", argv)
    own = host_target(env=False).isa
    print(f"# {cpu_model()}; own path {own}; {len(os.sched_getaffinity(0))} usable cores", flush=True)
    print(f"{'path':<12} {'load':<12} {'wall':>7} {'user s':>7} {'sys s':>6} {'other':>6}  summary", flush=True)
    records = []
    for path in paths:
        for load in args.load.split(","):
            r = run_suite(path, load, args.pytest_args.split(), args.jit)
            m, s = divmod(r["wall_s"], 60)
            print(f"{path:<12} {load:<12} {int(m):>4}:{s:02.0f} {r['user_s']:>7} {r['system_s']:>6} "
                  f"{r['other_load']:>6.0%}  {r['summary']}", flush=True)
            if args.jit:
                print(f"{'':>12} JIT: {r['jit_compiled']} libraries compiled ({r['jit_ir_mb']} MB of IR), "
                      f"{r['jit_llvm_s']} s in LLVM = {r['jit_llvm_s'] / (r['user_s'] + r['system_s']):.0%} of the "
                      f"suite's CPU time; {r['jit_cached']} from the object cache", flush=True)
            isa = own if path == "own" else f"{path} (forced)"
            records.append(run.record(engine="pytest", model="the test suite", quant=None, threads=None,
                                      variant=f"{path}, load {load}", isa_path=isa,
                                      **{k: v for k, v in r.items() if k != "path"}))
    run.write(args.json, records)
    return 0 if all(r["extra"]["returncode"] == 0 for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
