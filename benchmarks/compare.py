"""Two benchmark runs side by side, as llama.cpp's compare-llama-bench: a figure of A, of B, and B / A per record.

    python -m benchmarks.compare A.json B.json                                 # two result files
    python -m benchmarks.compare --commits REV1 REV2 -- decode --model small --threads 1
    python -m benchmarks.compare --commits HEAD~1 HEAD --rounds 3 -- bandwidth --gib 0.25
    python -m benchmarks.compare A.json B.json --metric extra.gbps             # another figure than tok/s

Records are paired on (engine, model, quant, isa_path, threads, variant) (benchmarks/common/record.py); the
records of one key in one file (rounds, repeats) count as their median, and columns that are the same in every
row are printed once above the table. Files written before the record schema are read as far as their keys
allow (record.load_results).

--commits checks both revisions out as git worktrees in a temporary directory and runs `python -m
benchmarks.NAME ARGS --json FILE` in each (its own cflow and benchmarks, its own out/bench models: the first
run of a decode benchmark compiles them), A and B alternating --rounds times so that a drifting machine hits
both alike; then compares what they wrote (--save DIR keeps the files). A revision from before the benchmarks
were a package runs its script as `python benchmarks/NAME.py` instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from benchmarks.common import ROOT
from benchmarks.common.record import KEY, load_results

LABELS = {"engine": "engine", "model": "model", "quant": "quant", "isa_path": "ISA path", "threads": "threads",
          "variant": "variant"}


def metric_of(record: dict, metric: str):
    """A record's figure: a schema field ("tok_s", "read_gbs") or one of its extra's ("extra.gbps")."""
    if metric.startswith("extra."):
        return (record.get("extra") or {}).get(metric[len("extra."):])
    return record.get(metric)


def of_read(record: dict) -> float | None:
    """The fraction of the read bandwidth the record's decode reached (None without the figures)."""
    t, b, r = record.get("tok_s"), record.get("bytes_per_token"), record.get("read_gbs")
    return t * b / 1e9 / r if t and b and r else None


def _hashable(v):
    """A key field as it can be compared (an older file may hold a list or an object where the schema has text)."""
    return v if v is None or isinstance(v, (str, int, float)) else json.dumps(v, sort_keys=True)


def by_key(records: list[dict], metric: str) -> dict[tuple, dict]:
    """key -> {"value": median of the metric, "of_read": median fraction of read, "n": records}."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if isinstance(metric_of(r, metric), (int, float)) and not isinstance(metric_of(r, metric), bool):
            groups.setdefault(tuple(_hashable(r.get(k)) for k in KEY), []).append(r)
    out = {}
    for key, rs in groups.items():
        fr = [f for f in map(of_read, rs) if f is not None]
        out[key] = {"value": statistics.median(metric_of(r, metric) for r in rs),
                    "of_read": statistics.median(fr) if fr else None, "n": len(rs)}
    return out


def _fmt(x, digits: int = 2) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def table(a: list[dict], b: list[dict], metric: str = "tok_s") -> str:
    """The markdown table of the pairs (and a line per key found in one run only)."""
    ka, kb = by_key(a, metric), by_key(b, metric)
    keys = [k for k in ka if k in kb]
    only = []
    for label, ks in (("A", [k for k in ka if k not in kb]), ("B", [k for k in kb if k not in ka])):
        if ks:
            only.append(f"only in {label}: " + "; ".join(", ".join(_fmt(x) for x in k if x is not None) for k in ks))
    if not keys:
        return "\n".join([f"no records with {metric} in both runs share (engine, model, quant, isa_path, threads, "
                          "variant)", *only])
    varying = [i for i in range(len(KEY)) if len({k[i] for k in keys}) > 1]
    same = [f"{LABELS[KEY[i]]} {keys[0][i]}" for i in range(len(KEY)) if i not in varying and keys[0][i] is not None]
    reads = any(ka[k]["of_read"] is not None and kb[k]["of_read"] is not None for k in keys)
    name = metric.removeprefix("extra.").replace("tok_s", "tok/s")
    head = [LABELS[KEY[i]] for i in varying] + [f"{name} A", f"{name} B", "B/A"]
    head += ["of read A", "of read B"] if reads else []
    rows = []
    for k in keys:
        va, vb = ka[k]["value"], kb[k]["value"]
        row = [_fmt(k[i]) for i in varying] + [_fmt(float(va)), _fmt(float(vb)), _fmt(vb / va, 3) if va else "-"]
        if reads:
            row += [f"{100 * x:.1f}%" if x is not None else "-" for x in (ka[k]["of_read"], kb[k]["of_read"])]
        rows.append(row)
    lines = ([f"same in every row: {', '.join(same)}", ""] if same else []) + [
        "| " + " | ".join(head) + " |", "|" + "|".join("---" if i < len(varying) else "---:" for i in range(len(head)))
        + "|"] + ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines + only)


def describe(label: str, path: str, records: list[dict]) -> str:
    """A: the file, and the commit, date and CPU of its records (when they name them)."""
    def seen(field):
        return sorted({str(r[field]) for r in records if r.get(field)})

    parts = [", ".join(v) for v in (seen("commit"), seen("date"), seen("cpu_model")) if v]
    return f"{label}: {path}" + (f" ({'; '.join(parts)})" if parts else "")


def run_commits(rev_a: str, rev_b: str, bench: list[str], rounds: int, save: str | None) -> tuple[list, list]:
    """Run `bench` (a benchmark name and its arguments) at both revisions, alternating; (records A, records B)."""
    if not bench:
        raise SystemExit("--commits: give the benchmark after --, e.g. -- decode --model small --threads 1")
    name, args = bench[0], bench[1:]
    tmp = tempfile.mkdtemp(prefix="cflow-compare-")
    trees = {}
    try:
        for label, rev in (("A", rev_a), ("B", rev_b)):
            trees[label] = os.path.join(tmp, label)
            subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", trees[label], rev], check=True,
                           capture_output=True, text=True)
        out = {"A": [], "B": []}
        for r in range(rounds):
            for label in ("A", "B") if r % 2 == 0 else ("B", "A"):
                tree, path = trees[label], os.path.join(tmp, f"{label}{r}.json")
                script = ["-m", f"benchmarks.{name}"] if os.path.exists(os.path.join(tree, "benchmarks",
                                                                                    "__init__.py")) \
                    else [os.path.join("benchmarks", f"{name}.py")]
                cmd = [sys.executable, *script, *args, "--json", path]
                print(f"# {label} ({rev_a if label == 'A' else rev_b}), round {r + 1}: {' '.join(cmd[1:])}",
                      file=sys.stderr, flush=True)
                # the other tree alone on the path (not process.child_env, which adds this checkout: an older
                # tree would then import this tree's benchmarks)
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH"))
                                                                  if p))
                subprocess.run(cmd, cwd=tree, env=env, check=True)
                out[label] += load_results(path)[0]
                if save:
                    os.makedirs(save, exist_ok=True)
                    shutil.copy(path, os.path.join(save, f"{name}-{label}{r}.json"))
        return out["A"], out["B"]
    finally:
        for tree in trees.values():
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench = []
    if "--" in argv:
        at = argv.index("--")
        argv, bench = argv[:at], argv[at + 1:]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 usage="%(prog)s A.json B.json | --commits REV1 REV2 -- NAME [ARGS]")
    ap.add_argument("files", nargs="*", metavar="FILE", help="two result files (A, then B)")
    ap.add_argument("--commits", nargs=2, metavar=("REV1", "REV2"), help="run the benchmark after -- at both")
    ap.add_argument("--rounds", type=int, default=1, help="--commits: runs of each revision, alternating (default 1)")
    ap.add_argument("--save", metavar="DIR", help="--commits: keep each run's result file here")
    ap.add_argument("--metric", default="tok_s", help="the figure compared: a record field or extra.NAME "
                    "(default tok_s)")
    args = ap.parse_args(argv)
    if args.commits:
        if args.files:
            ap.error("give either two files or --commits, not both")
        a, b = run_commits(*args.commits, bench, args.rounds, args.save)
        print(describe("A", args.commits[0], a))
        print(describe("B", args.commits[1], b))
    else:
        if len(args.files) != 2 or bench:
            ap.error("give two result files (or --commits REV1 REV2 -- NAME [ARGS])")
        a, b = load_results(args.files[0])[0], load_results(args.files[1])[0]
        print(describe("A", args.files[0], a))
        print(describe("B", args.files[1], b))
    print()
    print(table(a, b, args.metric))
    return 0


if __name__ == "__main__":
    sys.exit(main())
