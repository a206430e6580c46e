"""Instructions per 64-byte line of weights in the mat-vec kernel's inner loop, from the JIT's own assembly.

    python -m benchmarks.kernel_asm [--cols 5632] [--knobs unroll=1,prefetch=4608] [--types q4,q8,Q4_K,IQ4_192]
                                    [--blockdot FILE] [--matmat]

Builds the decode mat-vec (codegen.kernels.emit_matvec, this host's ISA or the one CFLOW_FEATURES leaves) for
each type (default Q4 and Q8; GGUF block types and cflow's own by name, a block --cols does not hold whole in the
next multiple of its width, in tiles one block wide: benchmarks.gguf_types.geometry) with its built-in knobs on this
path (codegen.tune.default_for) and the given ones over them, through codegen.library.Library (the optimisation
pipeline the runtime uses), takes the optimised module's assembly, finds the loop over block units (the largest
basic block that jumps back: one iteration = `unroll` units, or with group_loop one 16-row group of one unit) and
prints its instruction count, the count per 64-byte line of weights the iteration reads, and the most frequent
opcodes. Next to it, the read loop of codegen.bandwidth (the bandwidth reference) counted the same way. --blockdot
builds the block types' kernels from another version of codegen/blockdot.py (a before / after of a decoder change).
A static count, not a timing: how many instructions the core must issue per line it streams.
--matmat counts the multi-token (mat-mat) kernel's unit loop instead (codegen.kernels.emit_matmat, built-in
knobs, without the next tile-row's prefetch, whose branch would split the loop's block, and with an empty tail, so
that the listing's largest loop is the mat-mat's and not its tail mat-vec's): one iteration is one unit of a pass's
row groups for each token of the path's token group (kernels.matmat_groups), counted per 64-byte line and token.
"""

from __future__ import annotations

import argparse
import collections

from llvmlite import ir

from benchmarks.blockdot_ab import load_version, using
from benchmarks.common.record import Run, add_json_argument
from benchmarks.gguf_types import geometry
from cflow.codegen import blockdot, tune
from cflow.codegen import kernels as K
from cflow.codegen.bandwidth import CHUNK, read_kernel_module
from cflow.codegen.cgutils import new_function
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
    ap.add_argument("--knobs", default="",
                    help="K=V,... over each type's built-in knobs (e.g. unroll=1,prefetch=4608; default none)")
    ap.add_argument("--types", default="q4,q8", help="kernels to count (default q4,q8)")
    ap.add_argument("--blockdot", default=None, metavar="FILE",
                    help="a version of cflow/codegen/blockdot.py to build the block types' kernels from, as "
                         "benchmarks/blockdot_ab.py takes it (default: the tree's)")
    ap.add_argument("--matmat", action="store_true",
                    help="count the multi-token (mat-mat) kernel's inner loop instead: instructions per 64-byte line "
                         "and token (one iteration: one unit's row groups of a pass x the path's token group)")
    add_json_argument(ap, "write one record per kernel (a static count: tok_s is null)")
    args = ap.parse_args(argv)
    if args.matmat and args.knobs:
        ap.error("--knobs: the mat-mat takes its built-in knobs only (--matmat)")
    run = Run("kernel_asm", argv)
    given = {}
    for kv in filter(None, args.knobs.split(",")):
        k, _, v = kv.partition("=")
        if k not in tune.KNOBS:
            ap.error(f"--knobs: {k!r} is not one of {', '.join(tune.KNOBS)}")
        given[k] = int(v)
    try:
        types = [DType.parse(t) for t in args.types.split(",") if t]
    except (KeyError, ValueError) as e:
        ap.error(f"--types: {e}")
    other = load_version(args.blockdot, "blockdot_asm") if args.blockdot else None
    target = host_target()
    print(f"# {cpu_model()}; {target.isa}; knobs {given or 'built-in'}; {args.cols} columns, 128x256 tiles"
          + (f"; blockdot.py from {args.blockdot}" if other else ""))
    rows = []
    for dt in types:
        L = TileLayout(dt, 128, *geometry(dt, (128, 256), args.cols))
        knobs = {**tune.default_for(L, target.isa), **given}
        m = ir.Module(name="asm")
        with using(other or blockdot):  # another version of the block types' decoder, where asked (--blockdot)
            if args.matmat:  # the mat-mat takes the built-in knobs only (step_context.matmat_fn)
                # an empty tail: the largest loop in the listing is then the mat-mat's, not its tail mat-vec's
                tail = new_function(m, "tail", K.MATVEC_ARGS, "internal",
                                    ("w", "x", "xq", "xd", "xs", "y", "r0", "r1"), noalias=False)
                ir.IRBuilder(tail.append_basic_block("entry")).ret_void()
                K.emit_matmat(m, "mm", L, target.isa, L.cols_p, next_row=0, tail=tail)
            else:
                K.emit_matvec(m, "mv", L, target.isa, **knobs)
        ops = count(m, target)
        if args.matmat:  # one iteration: one unit of a pass's row groups for each token of the token group
            tg, gp = K.matmat_groups(L, target.isa)
            knobs = {"tokens": tg, "row_groups": gp}
            lines = gp / L.groups_per_tile * L.unit_nbytes / 64 * tg
        else:
            unroll = K._pick_unroll(L.n_units, 1 if L.is_block_type else knobs["unroll"])
            # a group loop's iteration is one 16-row group of one unit; otherwise `unroll` whole units
            lines = (L.unit_nbytes / L.groups_per_tile if knobs["group_loop"] else unroll * L.unit_nbytes) / 64
        rows.append({"kernel": dt.gguf_name if L.is_block_type else dt.label,
                     "knobs": tune.label(knobs) if not args.matmat else ",".join(f"{k}={v}" for k, v in knobs.items()),
                     "instructions": len(ops), "lines": lines, "per_line": len(ops) / lines,
                     "top": collections.Counter(ops).most_common(8)})
    ops = count(read_kernel_module(), target)
    n = CHUNK / 64
    rows.append({"kernel": "read loop", "instructions": len(ops), "lines": n, "per_line": len(ops) / n,
                 "top": collections.Counter(ops).most_common(8)})
    for r in rows:
        top = ", ".join(f"{op} {n}" for op, n in r["top"])
        mm = args.matmat and r["kernel"] != "read loop"
        print(f"{r['kernel']:<10} {r['instructions']:4d} instructions per iteration of {r['lines']:g} "
              f"{'(line, token) pairs' if mm else 'lines'} = {r['per_line']:.1f} per 64-byte line"
              f"{' and token' if mm else ''}   [{r.get('knobs', '')}] ({top})")
    loop = "read loop"
    kind = "mat-mat" if args.matmat else "mat-vec"
    run.write(args.json, [run.record(engine=loop if r["kernel"] == loop else kind, model=f"128x{args.cols}",
                                     quant=None if r["kernel"] == loop else r["kernel"], variant=r.get("knobs"),
                                     **{k: v for k, v in r.items() if k != "knobs"})
                          for r in rows])
    return rows


if __name__ == "__main__":
    main()
