"""`cflowc`: compile a transformer to a tile-native .vflow/.cflow file, or print its IR, schedule or analysis."""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import CflowError
from ..layout import DEFAULT_TILE, QUANTS

EMITS = ("ir", "analysis", "schedule", "dot", "llvm", "cflow", "vflow")


def _delays(text: str) -> tuple[int, int]:
    try:
        dd, de = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--delays expects DD,DE (two integers), not {text!r}") from None
    return dd, de


def _tile(text: str) -> tuple[int, int]:
    from ..layout.tile import tile_problem

    try:
        r, c = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ROWSxCOLS (e.g. 128x256), not {text!r}") from None
    problem = tile_problem((r, c))  # the rule a loaded file's tile must follow too
    if problem:
        raise argparse.ArgumentTypeError(f"tile {problem}")
    return r, c


def cflowc_parser() -> argparse.ArgumentParser:
    from . import Parser, add_version

    p = Parser(
        prog="cflowc",
        description="Compile a transformer (preset:NAME[@SIZE], checkpoint or Hugging Face directory, or .onnx) "
        "to a tile-native .vflow/.cflow file, or print its IR, schedule or analysis.",
    )
    add_version(p)
    p.add_argument("model", help="preset:NAME[@SIZE] | model directory | model.onnx")
    p.add_argument("-o", "--output", help="output file: .vflow (stage-major) or .cflow (layer-major), or the file "
                   "for a text --emit (default: text emits go to standard output)")
    p.add_argument("--emit", choices=EMITS, help="what to produce (default: cflow or vflow, from the suffix of -o)")
    p.add_argument("--json", action="store_true", help="machine-readable --emit analysis (default: a table)")
    p.add_argument("--quant", default=None, choices=QUANTS + ("auto",),
                   help="weight type; stored keeps a GGUF's own types, tensor by tensor; auto chooses each matrix's "
                   "type under --bpw (default: auto for a float model (a directory, .onnx, an F32/F16/BF16 .gguf) "
                   "written with -o, if a mix fits 4.5 bits per weight; else stored for a .gguf, q4 otherwise)")
    from .calibrate import add_args as add_calibration

    add_calibration(p)
    p.add_argument("--tile", type=_tile, default=None, metavar="ROWSxCOLS",
                   help="tile shape: rows a multiple of 16 up to 512, cols a multiple of 32 up to 4096 "
                   "(default {}x{}; for a .gguf kept as stored, columns that divide every matrix width, so nothing "
                   "is padded)".format(*DEFAULT_TILE))
    p.add_argument("--delays", type=_delays, metavar="DD,DE",
                   help="rewrite the DAG to these delays (changes the function!) (default: keep the model's own)")
    p.add_argument("--tokenizer", help="tokenizer.json to store in the compiled file "
                   "(default: the model's own, if it has one)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show the packing progress bar even when stderr is not a terminal")
    p.add_argument("--print-after", action="append", metavar="PASS",
                   help="print the IR (and schedule, once planned) after this pass to stderr; repeatable; 'all' for "
                   "every pass (default: none)")
    p.add_argument("--time-passes", action="store_true", help="print the time each pass took to stderr")
    p.add_argument("--debug", action="store_true", help="show tracebacks; verify the IR after every pass")
    return p


def _cflowc(args: argparse.Namespace) -> int:
    from ..layout.packed import FileLayout
    from ..passes.manager import PassContext, PrintAfter, Timing
    from ..passes.pipeline import PASS_NAMES

    emit = args.emit
    if emit is None and not args.output and args.imatrix_out:  # collect and save an importance matrix only
        from ..frontend.load import load_graph
        from .calibrate import calibrate

        calibrate(args, load_graph(args.model))
        return 0
    if emit is None:
        if not args.output:
            raise CflowError("nothing to do: give -o OUT.vflow|OUT.cflow or --emit ir|schedule|analysis|dot|llvm")
        try:
            emit = str(FileLayout.from_path(args.output))
        except ValueError as e:
            raise CflowError(f"-o {e} (or give --emit)") from None
    binary = emit in ("cflow", "vflow")
    if binary and not args.output:
        raise CflowError(f"--emit {emit} writes a binary file: give -o OUT.{emit}")
    unknown = [n for n in args.print_after or () if n != "all" and n not in PASS_NAMES]
    if unknown:
        raise CflowError(f"--print-after {unknown[0]}: no such pass (passes: {', '.join(PASS_NAMES)}, or all)")
    if args.output:  # checked before any work: the directory is created, the file must be writable
        from ..util import check_output_path

        check_output_path(args.output, "-o")
    tokenizer = None
    if args.tokenizer:  # checked before any work
        from ..runtime.tokenizer import read_tokenizer_file

        tokenizer = read_tokenizer_file(args.tokenizer)
    instruments: list = []
    if args.print_after:
        names = () if "all" in args.print_after else tuple(args.print_after)
        instruments.append(PrintAfter(names, write=lambda text: print(text, file=sys.stderr)))
    timing = Timing() if args.time_passes else None
    if timing is not None:
        instruments.append(timing)
    ctx = PassContext(instruments=tuple(instruments), verify_each=args.debug)
    try:
        return _run(args, emit, binary, tokenizer, ctx)
    finally:
        if timing is not None:
            print(timing.table(), file=sys.stderr)


def _run(args, emit: str, binary: bool, tokenizer: str | None, ctx) -> int:
    """Load the model, run the passes the emit needs, write what it asked for."""
    from ..frontend.load import load_graph
    from ..passes.delays import set_delays
    from ..passes.manager import Pipeline

    g = load_graph(args.model, weights=binary)
    from ..passes.quantize import STORED, default_quant, fit_tile
    from .calibrate import auto_default, calibrate, mix_types, wanted

    unasked = args.quant is None and args.bpw is None and args.imatrix is None
    if unasked and auto_default(args.model, g, mix_types(args)):
        # a float model (f32/f16/bf16): each matrix's type chosen within 4.5 bits per weight, the measured best at
        # that size (docs/quantization.md, "The default"); presets are random weights, kept at q4
        if binary:
            args.quant, args.auto_default = "auto", True
        else:
            print("note: -o FILE compiles this float model as --quant auto (a type mix within 4.5 bits per "
                  f"weight); this shows {default_quant(g)}", file=sys.stderr)
    if wanted(args):
        if not binary:
            raise CflowError("--bpw, --imatrix and --quant auto quantise the weights: give -o OUT.vflow|OUT.cflow")
        g = calibrate(args, g)
        args.quant = STORED
    if args.quant is None:
        args.quant = default_quant(g)
    if args.tile is None:
        args.tile = fit_tile(g) if args.quant == STORED else DEFAULT_TILE
    if tokenizer is not None:  # --tokenizer FILE: its BOS/EOS rule too (and its directory's tokenizer_config.json)
        from ..frontend.hf_weights import read_special_tokens

        g.meta.special_tokens = read_special_tokens(os.path.dirname(os.path.abspath(args.tokenizer)), tokenizer)
    if emit in ("ir", "analysis", "dot"):
        if args.delays:
            g = Pipeline(set_delays(*args.delays), name="delays")(g, ctx)
        if emit == "ir":
            return _write_text(args.output, str(g))
        if emit == "dot":
            from ..ir.printer import format_dot

            return _write_text(args.output, format_dot(g))
        from ..passes.analysis import analyze

        a = analyze(g, args.quant, args.tile)  # padded to the tile: the bytes/token `cflowc -o` reports
        return _write_text(args.output, a.to_json() + "\n" if args.json else a.table() + "\n")
    from ..compiler import compile_file

    target = None
    if emit == "llvm":
        from ..codegen.target import host_target

        target = host_target()
    # the lowering (refusing first what the native runtime cannot run), then the step or the file the emit asks for
    state = compile_file(g, args.output if binary else None, args.quant, args.tile, args.delays,
                         emit if binary else None, tokenizer or g.meta.tokenizer, g.meta.eos_token_ids,
                         progress=_progress_bar(args) if binary else None, ctx=ctx,
                         isa=target.isa if target is not None else None)
    if emit == "schedule":
        from ..passes.analysis import analyze

        table = analyze(state.graph, args.quant, args.tile).table()
        return _write_text(args.output, str(state.schedule) + "\n" + table + "\n")
    if emit == "llvm":
        from ..codegen.step import step_ir_text

        return _write_text(args.output, step_ir_text(state, target.triple))
    info = state.file
    print(f"wrote {args.output}: {info['file_bytes'] / 1e6:.1f} MB, {info['tensors']} tensors, "
          f"{info['bytes_per_token'] / 1e6:.2f} MB/token, {state.schedule.n_stages} stages, {info['seconds']:.1f} s",
          file=sys.stderr)
    return 0


def _progress_bar(args):
    """A tqdm bar on stderr for models worth waiting for (quiet for tiny ones and non-terminals)."""
    if not sys.stderr.isatty() and not args.verbose:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    bar = None

    def tick(done, total, name):
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, unit="B", unit_scale=True, desc="packing", file=sys.stderr, leave=False)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return tick


def _write_text(path: str | None, text: str) -> int:
    if path:
        from ..util import atomic_write_text

        atomic_write_text(path, text)
    else:
        sys.stdout.write(text)
    return 0
