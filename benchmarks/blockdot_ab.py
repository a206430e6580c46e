"""Two versions of the block types' decoder (codegen/blockdot.py) against each other, in one process.

    python -m benchmarks.blockdot_ab OLD.py [NEW.py] [--types Q4_0,Q3_K] [--threads 1,2] [--rounds 5]
                                     [--set-gb 0.5] [--json [FILE]]

A kernel change worth a few percent is within this VM's run-to-run spread when two trees are timed one after the
other. Here each GGUF block type's decode mat-vec (benchmarks.gguf_types.Case: its matrix, copies past the
last-level cache, the built-in knobs) is compiled from each version of blockdot.py (OLD, e.g. `git show
HEAD~1:cflow/codegen/blockdot.py > old.py`; NEW by default the tree's own) by swapping the module the kernel
emitter calls, and the two are timed in the same rounds, alternating their order, the read loop measured in each
round; printed: GB/s, the fraction of read and NEW / OLD per type and thread count (best of --rounds). Types that
do not use blockdot (Q4_0, Q8_0) time the same kernel twice: the noise floor.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys

from benchmarks.common.bandwidth import measure_read_bandwidth
from benchmarks.common.record import Run, add_json_argument
from benchmarks.gguf_types import Case
from cflow.codegen import blockdot
from cflow.codegen import kernels as K
from cflow.codegen.target import cpu_model, host_target
from cflow.layout.quant import DType


def load_version(path: str, name: str):
    """blockdot.py at `path` as a module of the cflow.codegen package (its relative imports resolve there)."""
    spec = importlib.util.spec_from_file_location(f"cflow.codegen.{name}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"blockdot_ab: cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def using(mod):
    """The kernel emitter (codegen/kernels.py) calls `mod` as its blockdot while the block runs."""
    K.blockdot = mod
    try:
        yield
    finally:
        K.blockdot = blockdot


def build(types, versions: dict, set_gb: float, threads: int) -> list:
    """[(type, version label, Case)]: each type's kernel compiled from each version of blockdot."""
    cases = []
    for dt in types:
        twin = None  # the versions stream the same copies
        for label, mod in versions.items():
            with using(mod):
                c = twin = Case(dt, (128, 256), set_gb * 1e9, {}, twin=twin, kind=label)
            c.run(threads)  # page in, warm the code
            cases.append((dt, label, c))
    return cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", help="a version of cflow/codegen/blockdot.py (a file)")
    ap.add_argument("new", nargs="?", default=None, help="another version (default: the tree's own)")
    ap.add_argument("--types", default="Q4_0,Q4_K,Q6_K,IQ4_XS,IQ4_192",
                    help="block types to time (default Q4_0,Q4_K,Q6_K,IQ4_XS,IQ4_192)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, the best kept (default 5)")
    ap.add_argument("--set-gb", type=float, default=0.5, help="bytes streamed per kernel and pass, GB (default 0.5)")
    add_json_argument(ap, "write one record per type, version and thread count")
    args = ap.parse_args(argv)
    run = Run("blockdot_ab", argv)
    try:
        types = [DType.parse(t) for t in args.types.split(",") if t]
    except (KeyError, ValueError) as e:
        ap.error(f"--types: {e}")
    versions = {"old": load_version(args.old, "blockdot_old"),
                "new": load_version(args.new, "blockdot_new") if args.new else blockdot}
    print(f"cpu: {cpu_model()}  isa: {host_target().isa}  best of {args.rounds} rounds, {args.set_gb} GB a kernel")
    records = []
    for n in (int(t) for t in args.threads.split(",")):
        cases = build(types, versions, args.set_gb, n)
        best: dict = {}
        for r in range(args.rounds):
            best["read"] = max(best.get("read", 0.0), measure_read_bandwidth(n))
            for _, _, c in (cases if r % 2 else cases[::-1]):
                best[c.label] = max(best.get(c.label, 0.0), c.run(n))
        print(f"\n{n} thread(s): read bandwidth {best['read']:.2f} GB/s")
        print(f"{'type':10} {'old GB/s':>9} {'new GB/s':>9} {'new of read':>12} {'new / old':>10}")
        for dt in types:
            old, new = (best[c.label] for t, _, c in cases if t == dt)
            print(f"{dt.gguf_name:10} {old:9.2f} {new:9.2f} {new / best['read']:12.1%} {new / old:10.3f}")
            for label, gbps in (("old", old), ("new", new)):
                records.append(run.record(engine="mat-vec", quant=dt.gguf_name, threads=n, variant=f"blockdot {label}",
                                          read_gbs=best["read"], gbps=gbps, of_read=gbps / best["read"],
                                          new_over_old=new / old))
        del cases
    run.write(args.json, records, {"old": args.old, "new": args.new or "the tree's", "set_gb": args.set_gb})
    return 0


if __name__ == "__main__":
    sys.exit(main())
