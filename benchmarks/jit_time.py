"""JIT time of the compiled step against depth, weight sharing and tile rows (issue 14: "JIT time bounded").

    python -m benchmarks.jit_time                    # the table in docs/reliability.md ("Limits")
    python -m benchmarks.jit_time --json
    python -m benchmarks.jit_time --stages           # stage functions vs stages and emit time, no JIT

Each row compiles a tiny model (the presets' `tiny` geometry: d_model 64, 4 heads, 4 experts of 64, vocab 256,
random weights, q4) with cflowc's lowering, then loads it in a fresh subprocess with an empty program and object
cache (CFLOW_CACHE_DIR in a new temporary directory), so the whole JIT runs: emitting the step (codegen/step.py),
LLVM's optimisation and its code generation (codegen/library.py stats). Reported: the IR size of the emitted
step (lines of LLVM IR), the distinct stage functions against the stages the schedule runs (decode body; the
multi-token body's are the same count), the seconds of each part and the whole cflow.load. One process at a
time (run under the CPU lock on a shared machine).

--files A.vflow,B.vflow: the same load (fresh subprocess, empty caches) of compiled files, --rounds times each (the
bundled model: `cflowc cflow/data/default -o bundled.vflow` first); --baseline DIR: each load also with another
cflow tree's package (e.g. `git worktree add DIR OLD_COMMIT`), in turns.

--kernels: the tile kernels alone (kernels.emit_matvec / emit_matmat) over every ISA path x 9 weight types x mat-vec,
gate+up, group loop, two planes, mat-mat, gate+up mat-mat: IR bytes, Python's seconds (emission and printing) and
LLVM's (parse, optimisation, code generation) in all; --asm DIR also writes each kernel's optimised assembly to
DIR/<path>_<type>_<kind>.s, so that two trees' code can be compared with `diff -r` (an emission change that should
not change the code).

    python -m benchmarks.jit_time --files /tmp/bundled.vflow --rounds 3 --baseline /tmp/cflow_old
    python -m benchmarks.jit_time --kernels --asm /tmp/asm_new     # and PYTHONPATH=OLD_TREE ... --asm /tmp/asm_old
    python -m benchmarks.jit_time --kernels --inline --asm /tmp/asm_inline   # the in-tree twin, then diff -r

--stages: no JIT and no weights; for presets and geometries at several depths, the lowered plan's stages, the
distinct stage functions codegen/step.py keeps for both bodies, the IR lines and the seconds build_step takes
(Python emission, which still emits every stage to compare its text), per executed layer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common.process import child_env, module_command
from benchmarks.common.record import Run, add_json_argument
from cflow.codegen.target import cpu_model

# (label, preset, n_layers, n_blocks or None = unshared, tile)
ROWS = [
    ("depth", "arch2_4_combined", 4, None, (32, 64)),
    ("depth", "arch2_4_combined", 8, None, (32, 64)),
    ("depth", "arch2_4_combined", 16, None, (32, 64)),
    ("depth", "arch2_4_combined", 32, None, (32, 64)),
    ("depth", "arch2_4_combined", 64, None, (32, 64)),
    ("depth", "arch2_4_combined", 128, None, (32, 64)),
    ("sharing", "arch5_shared", 8, 4, (32, 64)),
    ("sharing", "arch5_shared", 64, 32, (32, 64)),
    ("tile rows", "arch2_4_combined", 4, None, (16, 64)),
    ("tile rows", "arch2_4_combined", 4, None, (128, 64)),
    ("tile rows", "arch2_4_combined", 4, None, (512, 64)),
]



def write_model(path: str, preset: str, n_layers: int, n_blocks: int | None, tile) -> None:
    import numpy as np

    from cflow.compiler import compile_file
    from cflow.ir import build_graph
    from cflow.ir.build import weight_shapes
    from cflow.models.presets import get_preset

    c = get_preset(preset, "tiny").evolve(n_layers=n_layers, n_blocks=n_blocks or n_layers)
    rng = np.random.default_rng(0)
    w = {n: (0.1 * rng.standard_normal(s)).astype(np.float32) for n, s in weight_shapes(c).items()}
    compile_file(build_graph(c, w, name=c.name), path, "q4", tuple(tile))


def measure_one(path: str, prefill_block: int) -> dict:
    """In this (fresh) process: cflow.load with an empty cache; the step's IR size and the JIT's parts."""
    import cflow
    from cflow.codegen import step as step_mod

    emit = []
    build = step_mod.build_step

    def timed_build(*a, **k):  # the session imports build_step from the module at call time
        t = time.perf_counter()
        p = build(*a, **k)
        emit.append(time.perf_counter() - t)
        return p

    step_mod.build_step = timed_build
    t0 = time.perf_counter()
    m = cflow.load(path, threads=1, prefill_block=prefill_block)
    total = time.perf_counter() - t0
    prog = m.session.program.module
    text = prog if isinstance(prog, str) else str(prog)
    ir_lines = text.count("\n")
    stages, distinct = getattr(m.session.program, "stage_functions", {}).get("stage", (None, None))  # (older cflow)
    st = m.session.library.stats
    m.generate([1, 2], max_new_tokens=1)  # the step runs
    m.close()
    return {"ir_lines": ir_lines, "ir_bytes": len(text), "stages": stages, "stage_functions": distinct,
            "emit_s": round(sum(emit), 2), "optimise_s": round(st["optimise_s"], 2),
            "codegen_s": round(st["codegen_s"], 2), "load_s": round(total, 2), "cache_hit": st["cache_hit"]}


# (preset or geometry, size, depths): --stages
STAGE_ROWS = [(p, size, (4, 8, 32, 128)) for p in ("arch1", "arch2_4_combined", "arch5_shared")
              for size in ("tiny", "114m")] + [("tinyllama", None, (22, 88)), ("arch2_4_combined", "tiny", (1024,))]


def stage_config(preset: str, size: str | None, n_layers: int):
    from cflow.models.presets import get_preset

    if size is None:  # a decode geometry (benchmarks/common/models.py)
        from benchmarks.common.models import MODELS

        return MODELS[preset].evolve(n_layers=n_layers)
    c = get_preset(preset, size)
    return c.evolve(n_layers=n_layers, n_blocks=n_layers // 2 if c.n_blocks < c.n_layers else n_layers)


def stages_table(prefill_block: int, json_path: str | None, run: Run) -> int:
    from cflow.codegen.step import build_step
    from cflow.codegen.target import host_target
    from cflow.compiler import lower
    from cflow.ir import build_graph

    isa = host_target().isa
    print(f"# {cpu_model()}; prefill block {prefill_block}; q4, max_seq 512; emit = build_step (both bodies)")
    print(f"{'model':<17} {'size':<9} {'layers':>6} {'stages':>6} {'decode fns':>10} {'multi fns':>9} "
          f"{'IR lines':>9} {'emit s':>7} {'ms/layer':>8}")
    rows = []
    for preset, size, depths in STAGE_ROWS:
        for n_layers in depths:
            c = stage_config(preset, size, n_layers)
            state = lower(build_graph(c, None, name=c.name), "q4")
            t0 = time.perf_counter()
            prog = build_step(state, isa, 512, tmax=prefill_block)
            emit = time.perf_counter() - t0
            lines = str(prog.module).count("\n")
            (stages, dec), (_, multi) = prog.stage_functions["stage"], prog.stage_functions.get("multi_stage", (0, 0))
            r = {"model": preset, "size": size or "geometry", "n_layers": n_layers, "stages": stages,
                 "decode_functions": dec, "multi_functions": multi, "ir_lines": lines, "emit_s": round(emit, 2),
                 "emit_ms_per_layer": round(1000 * emit / n_layers, 1)}
            rows.append(r)
            print(f"{preset:<17} {r['size']:<9} {n_layers:>6} {stages:>6} {dec:>10} {multi:>9} {lines:>9} "
                  f"{r['emit_s']:>7} {r['emit_ms_per_layer']:>8}", flush=True)
    run.write(json_path, [run.record(engine="cflow", model=f"{r['model']}@{r['size']}", quant="q4",
                                     variant=f"{r['n_layers']} layers", prefill_block=prefill_block,
                                     **{k: v for k, v in r.items() if k != "model"}) for r in rows])
    return 0


KERNEL_TYPES = ("q4", "q8", "f16", "f32", "q4_k", "q6_k", "iq4_xs", "q5_0", "q2_k")
KERNEL_KINDS = ("mv", "mvgu", "mvgl", "mv2", "mm", "mmgu")  # mat-vec, gate+up, group loop, two planes, mat-mats


def kernels_table(asm_dir: str | None, json_path: str | None, run: Run, inline: bool = False) -> int:
    """--kernels: emit, print and JIT the kernel set in this process; totals (and each kernel's assembly). inline:
    every group emitted inline (group_calls=False, the twin of the always-inlined group function)."""
    from llvmlite import ir

    from cflow.codegen import kernels as K
    from cflow.codegen.library import Library
    from cflow.codegen.target import ISA, forced_target
    from cflow.layout.tile import TileLayout

    # each path built for the target that forcing it gives (what a host of that kind runs)
    targets = {i: forced_target(i) for i in (ISA.AVX512VNNI, ISA.AVXVNNI, ISA.AVX2, ISA.GENERIC)}
    isas = [i for i, t in targets.items() if t is not None]
    if asm_dir:
        os.makedirs(asm_dir, exist_ok=True)
    py = llvm = 0.0
    size = count = 0
    for isa in isas:
        target = targets[isa]
        for dt in KERNEL_TYPES:
            L = TileLayout(dt, 256, 512 if dt in ("q4_k", "q6_k", "iq4_xs", "q2_k") else 256, (128, 256))
            for kind in KERNEL_KINDS:
                if kind == "mv2" and dt not in ("q4", "q8", "q5_0"):
                    continue  # two-plane activations: the 32-input types only
                t0 = time.perf_counter()
                m = ir.Module(name="k")
                if kind.startswith("mv"):
                    K.emit_matvec(m, "k", L, isa, gate_up=kind == "mvgu", group_loop=1 if kind == "mvgl" else None,
                                  planes=2 if kind == "mv2" else 1, group_calls=not inline)
                else:
                    K.emit_matmat(m, "k", L, isa, 2 * L.cols_p, gate_up=kind == "mmgu", group_calls=not inline)
                text = str(m)
                t1 = time.perf_counter()
                lib = Library(name="k", target=target, cache=False)
                lib.add_ir(text)
                lib.finalize()
                t2 = time.perf_counter()
                py, llvm, size, count = py + t1 - t0, llvm + t2 - t1, size + len(text), count + 1
                if asm_dir:
                    with open(os.path.join(asm_dir, f"{isa}_{dt}_{kind}.s"), "w") as f:
                        f.write(lib.get_asm_str())
    what = f"{count} kernels{' (every group inline)' if inline else ''} on {', '.join(map(str, isas))}"
    print(f"# {cpu_model()}; {what}: {size / 1e6:.1f} MB of IR text, "
          f"{py:.1f} s emitting and printing it (Python), {llvm:.1f} s in LLVM (parse, optimise, codegen)"
          + (f"; assembly in {asm_dir}" if asm_dir else ""))
    run.write(json_path, [run.record(engine="cflow", model="kernels", quant="all", threads=1, variant="kernel set",
                                     kernels=count, ir_bytes=size, python_s=round(py, 2), llvm_s=round(llvm, 2))])
    return 0


def files_table(paths: list[str], rounds: int, prefill_block: int, baseline: str | None, json_path: str | None,
                run: Run) -> int:
    """--files: measure_one on each file in a fresh subprocess with empty caches, `rounds` times, in turns (and with
    the `baseline` tree's cflow)."""
    print(f"# {cpu_model()}; prefill block {prefill_block}; 1 thread, empty caches, "
          f"CFLOW_TUNE={os.environ.get('CFLOW_TUNE', 'off')}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="cflow-jit-") as tmp:
        trees = (None, baseline) if baseline else (None,)
        for r, path, tree in ((r, p, t) for r in range(rounds) for p in paths for t in trees):
            env = child_env(tree, CFLOW_CACHE_DIR=tempfile.mkdtemp(dir=tmp),
                            CFLOW_TUNE=os.environ.get("CFLOW_TUNE", "off"))
            out = subprocess.run(module_command("benchmarks.jit_time", "--one", path, prefill_block),
                                 capture_output=True, text=True, env=env, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row.update(file=path, round=r, tree=tree or "this")
            rows.append(row)
            print(f"{os.path.basename(path):<20} {row['tree']:<20} IR {row['ir_bytes'] / 1e6:6.2f} MB, emit "
                  f"{row['emit_s']:5.2f} s, optimise {row['optimise_s']:5.2f} s, codegen {row['codegen_s']:5.2f} s, "
                  f"load {row['load_s']:5.2f} s", flush=True)
    run.write(json_path, [run.record(engine="cflow", model=os.path.basename(r["file"]), quant="file", threads=1,
                                     variant=f"load on empty caches, round {r['round']}", prefill_block=prefill_block,
                                     **{k: v for k, v in r.items() if k != "file"}) for r in rows])
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill-block", type=int, default=64,
                    help="tokens per prefill call: 1 = the decode body only; > 1 adds the multi-token body "
                    "(default 64, what cflow.load uses)")
    add_json_argument(ap, "also write one record per row")
    ap.add_argument("--stages", action="store_true", help="stage functions and emit time only (no JIT)")
    ap.add_argument("--files", default=None, help="comma-separated compiled files: their load on empty caches")
    ap.add_argument("--rounds", type=int, default=1, help="--files: loads of each file, in turns (default 1)")
    ap.add_argument("--baseline", default=None, metavar="DIR", help="--files: also load with DIR's cflow, in turns")
    ap.add_argument("--kernels", action="store_true", help="the tile kernel set: IR size, Python and LLVM seconds")
    ap.add_argument("--asm", default=None, metavar="DIR", help="--kernels: write each kernel's assembly to DIR")
    ap.add_argument("--inline", action="store_true",
                    help="--kernels: every group emitted inline (the group function's twin; diff -r its --asm)")
    ap.add_argument("--one", nargs=2, metavar=("FILE", "PREFILL_BLOCK"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(args.one[0], int(args.one[1]))))
        return 0
    run = Run("jit_time", argv)
    if args.stages:
        return stages_table(args.prefill_block, args.json, run)
    if args.kernels:
        return kernels_table(args.asm, args.json, run, args.inline)
    if args.files:
        return files_table(args.files.split(","), args.rounds, args.prefill_block, args.baseline, args.json, run)
    print(f"# {cpu_model()}; prefill block {args.prefill_block}; tiny geometry, q4, 1 thread, empty caches, "
          f"CFLOW_TUNE={os.environ.get('CFLOW_TUNE', 'off')}")
    print(f"{'what':<10} {'preset':<17} {'layers':>6} {'blocks':>6} {'tile':>7} {'fns/stages':>10} {'IR lines':>9} "
          f"{'emit s':>7} {'opt s':>6} {'codegen s':>9} {'load s':>7}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="cflow-jit-") as tmp:
        for label, preset, n_layers, n_blocks, tile in ROWS:
            path = os.path.join(tmp, f"{preset}-{n_layers}-{n_blocks}-{tile[0]}x{tile[1]}.vflow")
            write_model(path, preset, n_layers, n_blocks, tile)
            # CFLOW_TUNE=off: the per-host kernel search (codegen/tune.py) is a one-time cost per CPU and kernel
            # shape, cached apart from the program; with an empty cache it would run in every row
            env = child_env(CFLOW_CACHE_DIR=tempfile.mkdtemp(dir=tmp), CFLOW_TUNE=os.environ.get("CFLOW_TUNE", "off"))
            out = subprocess.run(module_command("benchmarks.jit_time", "--one", path, args.prefill_block),
                                 capture_output=True, text=True, env=env, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            assert not r["cache_hit"], "the cache directory was not empty"
            r.update(what=label, preset=preset, n_layers=n_layers, n_blocks=n_blocks or n_layers, tile=list(tile))
            rows.append(r)
            fs = f"{r['stage_functions']}/{r['stages']}"
            print(f"{label:<10} {preset:<17} {n_layers:>6} {r['n_blocks']:>6} {tile[0]:>3}x{tile[1]:<3} {fs:>10} "
                  f"{r['ir_lines']:>9} {r['emit_s']:>7} {r['optimise_s']:>6} {r['codegen_s']:>9} {r['load_s']:>7}",
                  flush=True)
    run.write(args.json, [run.record(engine="cflow", model=f"{r['preset']}@tiny", quant="q4", threads=1,
                                     variant=f"{r['what']}: {r['n_layers']} layers, {r['n_blocks']} blocks, tile "
                                             f"{r['tile'][0]}x{r['tile'][1]}", prefill_block=args.prefill_block, **r)
                          for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
