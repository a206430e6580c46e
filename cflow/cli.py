"""Command lines: `cflowc` (the compiler, gcc-like) and `cflow` (run / inspect / bench / demo / train ...).

Every failure is one line `error: ...` and a non-zero exit; a traceback only with --debug.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Callable, Sequence

from .errors import CflowError

EMITS = ("ir", "analysis", "schedule", "dot", "llvm", "cflow", "vflow")


def _guard(main: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a command: CflowError -> one line + exit 1; Ctrl-C -> exit 130; anything else -> exit 2."""
    debug = getattr(args, "debug", False)
    if not debug:
        warnings.formatwarning = lambda msg, cat, *a, **k: f"warning: {msg}\n"
    try:
        return main(args) or 0
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except CflowError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0
    except Exception as e:  # a bug, not bad input: still no traceback unless asked
        if debug:
            raise
        print(f"internal error: {type(e).__name__}: {e} (run again with --debug for a traceback)", file=sys.stderr)
        return 2


def _delays(text: str) -> tuple[int, int]:
    try:
        dd, de = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--delays expects DD,DE (two integers), not {text!r}") from None
    return dd, de


def _tile(text: str) -> tuple[int, int]:
    try:
        r, c = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tile expects ROWSxCOLS (e.g. 128x256), not {text!r}") from None
    return r, c


# --- cflowc ------------------------------------------------------------------------------
def cflowc_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cflowc",
        description="Compile a transformer (preset:NAME[@SIZE], checkpoint or Hugging Face directory, or .onnx) "
        "to a tile-native .vflow/.cflow file, or print its IR, schedule or analysis.",
    )
    p.add_argument("model", help="preset:NAME[@SIZE] | model directory | model.onnx")
    p.add_argument("-o", "--output", help="output file (.vflow stage-major or .cflow layer-major; text emits: a file)")
    p.add_argument("--emit", choices=EMITS, help="what to produce (default: the file named by -o)")
    p.add_argument("--json", action="store_true", help="machine-readable --emit analysis")
    p.add_argument("--quant", default="q4", choices=("q4", "q8", "f16", "f32"), help="weight type (default q4)")
    p.add_argument("--tile", type=_tile, default=(128, 256), help="tile shape ROWSxCOLS (default 128x256)")
    p.add_argument("--delays", type=_delays, help="DD,DE: rewrite the DAG to these delays (changes the function!)")
    p.add_argument("--tokenizer", help="tokenizer.json to store in the compiled file")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--debug", action="store_true", help="show tracebacks; verify the IR after every pass")
    return p


def _cflowc(args: argparse.Namespace) -> int:
    from .frontend.load import load_graph
    from .passes.delays import set_delays
    from .passes.manager import Pipeline

    emit = args.emit
    if emit is None:
        if not args.output:
            raise CflowError("nothing to do: give -o OUT.vflow|OUT.cflow or --emit ir|schedule|analysis|dot|llvm")
        emit = "cflow" if args.output.endswith(".cflow") else "vflow"
    needs_weights = emit in ("cflow", "vflow")
    g = load_graph(args.model, weights=needs_weights)
    if emit in ("ir", "analysis", "dot"):
        if args.delays:
            g = Pipeline(set_delays(*args.delays), name="delays")(g)
        if emit == "ir":
            return _write_text(args.output, str(g))
        if emit == "dot":
            from .ir.printer import format_dot

            return _write_text(args.output, format_dot(g))
        from .passes.analysis import analyze

        a = analyze(g, args.quant)
        return _write_text(args.output, a.to_json() + "\n" if args.json else a.table() + "\n")
    from .compiler import lower, write_file

    layout = emit if emit in ("cflow", "vflow") else "vflow"
    c = lower(g, args.quant, args.tile, args.delays, layout=layout)
    if emit == "schedule":
        from .passes.analysis import analyze

        return _write_text(args.output, str(c.schedule) + "\n" + analyze(c.graph, args.quant).table() + "\n")
    if emit == "llvm":
        from .codegen.step import emit_step_ir

        return _write_text(args.output, emit_step_ir(c))
    if not args.output:
        raise CflowError(f"--emit {emit} writes a binary file: give -o OUT.{emit}")
    tokenizer = g.meta.get("tokenizer")
    if args.tokenizer:
        from pathlib import Path

        try:
            tokenizer = Path(args.tokenizer).read_text()
        except OSError as e:
            raise CflowError(f"--tokenizer {args.tokenizer}: {e.strerror}") from None
    info = write_file(c, args.output, args.tile, tokenizer, g.meta.get("eos_token_ids"), progress=_progress_bar(args))
    print(f"wrote {args.output}: {info['file_bytes'] / 1e6:.1f} MB, {info['tensors']} tensors, "
          f"{info['bytes_per_token'] / 1e6:.2f} MB/token, {c.schedule.n_stages} stages, {info['seconds']:.1f} s",
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
        from .util import atomic_write_text

        atomic_write_text(path, text)
    else:
        sys.stdout.write(text)
    return 0


def cflowc_main(argv: Sequence[str] | None = None) -> int:
    args = cflowc_parser().parse_args(argv)
    return _guard(_cflowc, args)


# --- cflow -------------------------------------------------------------------------------
def cflow_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cflow", description="Run, inspect and benchmark compiled cflow models.")
    sub = p.add_subparsers(dest="cmd", required=True)
    from .commands import load_commands

    for name, (help_, add_args, _) in load_commands().items():
        sp = sub.add_parser(name, help=help_)
        add_args(sp)
        sp.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def cflow_main(argv: Sequence[str] | None = None) -> int:
    from .commands import load_commands

    args = cflow_parser().parse_args(argv)
    return _guard(load_commands()[args.cmd][2], args)


if __name__ == "__main__":
    sys.exit(cflowc_main())
