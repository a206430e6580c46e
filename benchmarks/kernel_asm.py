"""Instructions per 64-byte line of weights in the mat-vec kernel's inner loop, from the JIT's own assembly.

    python -m benchmarks.kernel_asm [--cols 5632] [--knobs unroll=1,prefetch=4608]

Builds the decode mat-vec (codegen.kernels.emit_matvec, this host's ISA) for Q4 and Q8 with the given knobs
through codegen.library.Library (the optimisation pipeline the runtime uses), takes the optimised module's
assembly, finds the loop over block units (the largest basic block that jumps back: one iteration = `unroll`
units, or with group_loop one 16-row group of one unit) and prints its instruction count, the count per
64-byte line of weights the iteration reads, and the most frequent opcodes. Next to it, the read loop of
codegen.bandwidth (the bandwidth reference) counted the same way.
A static count, not a timing: how many instructions the core must issue per line it streams.
"""

from __future__ import annotations

import argparse
import collections

from llvmlite import ir

from benchmarks.common.record import Run, add_json_argument
from cflow.codegen import kernels as K
from cflow.codegen import tune
from cflow.codegen.bandwidth import CHUNK, read_kernel_module
from cflow.codegen.library import Library
from cflow.codegen.target import cpu_model, host_target
from cflow.layout.quant import DType
from cflow.layout.tile import TileLayout


def loop_body(asm: str) -> list[str]:
    """Opcodes of the largest basic block that ends in a jump back to itself or to an earlier label (a loop's
    body) in an assembly listing."""
    blocks = []  # (label, opcodes, jump target of the last instruction)
    for ln in asm.splitlines():
        s = ln.split("#", 1)[0].strip()
        if not s:
            continue
        if s.endswith(":"):
            blocks.append([s[:-1], [], None])
        elif blocks and not s.startswith("."):
            parts = s.split()
            if blocks[-1][2] is not None or blocks[-1][1][-1:] in (["retq"], ["jmp"]):
                blocks.append(["", [], None])  # a jump ended the block: what follows is a new one
            blocks[-1][1].append(parts[0])
            if parts[0].startswith("j") and len(parts) > 1:
                blocks[-1][2] = parts[1]
    index = {label: i for i, (label, _, _) in enumerate(blocks)}
    loops = [ops for i, (_, ops, tgt) in enumerate(blocks) if tgt in index and index[tgt] <= i]
    return max(loops, key=len) if loops else []


def count(module: ir.Module, target) -> list[str]:
    lib = Library(name="cflow_asm", target=target, cache=None)
    lib.add_ir(module)
    return loop_body(lib.get_asm_str())


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cols", type=int, default=5632)
    ap.add_argument("--knobs", default="", help="K=V,... over codegen.tune.DEFAULT (e.g. unroll=1,prefetch=4608)")
    add_json_argument(ap, "write one record per kernel (a static count: tok_s is null)")
    args = ap.parse_args(argv)
    run = Run("kernel_asm", argv)
    knobs = dict(tune.DEFAULT)
    for kv in filter(None, args.knobs.split(",")):
        k, _, v = kv.partition("=")
        if k not in tune.KNOBS:
            ap.error(f"--knobs: {k!r} is not one of {', '.join(tune.KNOBS)}")
        knobs[k] = int(v)
    target = host_target()
    print(f"# {cpu_model()}; {target.isa}; knobs {tune.label(knobs)}; {args.cols} columns, 128x256 tiles")
    rows = []
    for dt in (DType.Q4, DType.Q8):
        L = TileLayout(dt, 128, args.cols)
        m = ir.Module(name="asm")
        K.emit_matvec(m, "mv", L, target.isa, **knobs)
        ops = count(m, target)
        unroll = K._pick_unroll(L.cols_p // 32, knobs["unroll"])
        # a group loop's iteration is one 16-row group of one unit; otherwise `unroll` whole units
        lines = (L.unit_nbytes / L.groups_per_tile if knobs["group_loop"] else unroll * L.unit_nbytes) / 64
        rows.append({"kernel": dt.label, "instructions": len(ops), "lines": lines, "per_line": len(ops) / lines,
                     "top": collections.Counter(ops).most_common(8)})
    ops = count(read_kernel_module(), target)
    n = CHUNK / 64
    rows.append({"kernel": "read loop", "instructions": len(ops), "lines": n, "per_line": len(ops) / n,
                 "top": collections.Counter(ops).most_common(8)})
    for r in rows:
        top = ", ".join(f"{op} {n}" for op, n in r["top"])
        print(f"{r['kernel']:<10} {r['instructions']:4d} instructions per iteration of {r['lines']:g} lines = "
              f"{r['per_line']:.1f} per 64-byte line   ({top})")
    loop = "read loop"
    run.write(args.json, [run.record(engine=loop if r["kernel"] == loop else "mat-vec", model=f"128x{args.cols}",
                                     quant=None if r["kernel"] == loop else r["kernel"], variant=tune.label(knobs),
                                     **r) for r in rows])
    return rows


if __name__ == "__main__":
    main()
