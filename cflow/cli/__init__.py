"""Command lines: `cflowc` (the compiler, gcc-like; cflowc.py) and `cflow` (run / inspect / bench / demo / train ...).

Each `cflow` sub-command is one module here, named in COMMANDS, that defines HELP, add_args(parser) and
run(args). Command modules import heavy things (torch, numpy, cflow.api) only inside run(), so that
building the parser (`cflow --help`) stays fast.

Every failure is one line `error: ...` naming the option, field or file offset at fault; a traceback only with
--debug. Exit status: 0 done, 1 bad input (usage errors too: `Parser`), 2 an internal error (a bug), 130 Ctrl-C.
Options are checked before any work starts: numbers by their argparse type (`whole`, `number`), output paths
by `cflow.util.check_output_path` (directories created, writability probed).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType

from .. import __version__
from ..errors import CflowError

# `cflow NAME` runs cflow/cli/NAME.py (dashes become underscores: export-onnx -> export_onnx.py).
COMMANDS = ("bench", "demo", "export-onnx", "inspect", "perplexity", "run", "serve", "train", "tune")

VERSION = f"cflow {__version__}"
# --kv of run / bench / serve: "auto" and the keys of codegen.abi.KV_BYTES, spelled out here because importing
# that pulls in numpy and --help stays light (tests/runtime/test_kv_cache.py checks the two agree)
KV_CHOICES = ("auto", "f32", "f16", "bf16")
# --activations of run / bench / perplexity / serve: layout.quant.ACT_FORMATS, spelled out for the same reason
ACT_CHOICES = ("q8", "q8x2")


def add_activations_argument(p) -> None:
    p.add_argument("--activations", choices=ACT_CHOICES, default="q8",
                   help="the activation entering a quantised matrix: q8 (int8 blocks of 32) or q8x2 (two int8 planes "
                   "on one scale, about 15 bits, for the 32-input block types Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/IQ4_NL: "
                   "closer to the weights' exact function, slower) (default q8)")


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


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line `error: argument X: ...` and exit 1, like every other error
    (argparse's default prints the whole usage and exits 2, which here means an internal error)."""

    def error(self, message: str):
        self.exit(1, f"error: {message} (see {self.prog} --help)\n")


def whole(lo: int, hi: int | None = None):
    """An argparse type: a whole number in lo..hi (hi None: no upper bound)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(
                f"expected a whole number {f'in {lo}..{hi}' if hi is not None else f'>= {lo}'}, not {text!r}")
        return v

    return parse


def number(lo: float, hi: float | None = None, *, lo_open: bool = False):
    """An argparse type: a finite number >= lo (> lo if lo_open) and <= hi."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = float("nan")
        ok = v == v and v not in (float("inf"), float("-inf")) and (v > lo if lo_open else v >= lo) \
            and (hi is None or v <= hi)
        if not ok:
            rng = f"{'>' if lo_open else '>='} {lo:g}" + (f" and <= {hi:g}" if hi is not None else "")
            raise argparse.ArgumentTypeError(f"expected a finite number {rng}, not {text!r}")
        return v

    return parse


_SIZE_UNITS = {"k": 2**-10, "m": 1, "g": 2**10, "t": 2**20}


def size_mb(text: str) -> float:
    """An argparse type: a memory size, '8G' / '8GiB' / '512M' / '512MB' (binary units) or a number of MiB."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = _SIZE_UNITS.get(t[-1:], None) if t else None
    try:
        v = float(t[:-1] if unit is not None else t) * (unit or 1)
    except ValueError:
        v = float("nan")
    if not (v == v and 0 < v < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a size such as 8G, 512M or a number of MiB > 0, not {text!r}")
    return v


MAX_THREADS = 1024  # as cflow.runtime.session.MAX_THREADS (not imported: the parser stays light)


COMPILED_SUFFIXES = (".vflow", ".cflow")


def compiled_file(path: str) -> str:
    """The compiled model a FILE argument names: the file itself, or the one .vflow/.cflow file inside a directory.

    A directory holding none or several, or a model directory not yet compiled, is one error saying what to give
    instead. Anything else goes to cflow.load as it is (a missing file is its error)."""
    import os

    if not os.path.isdir(path):
        return path
    found = sorted(e.name for e in os.scandir(path) if e.is_file() and e.name.endswith(COMPILED_SUFFIXES))
    if len(found) == 1:
        return os.path.join(path, found[0])
    if found:
        raise CflowError(f"{path}: a directory with {len(found)} compiled models ({', '.join(found)}): "
                         "give one of them")
    if os.path.isfile(os.path.join(path, "config.json")):
        raise CflowError(f"{path}: a model directory, not a compiled model: compile it first with "
                         f"`cflowc {path} -o model.vflow`, then give model.vflow")
    raise CflowError(f"{path}: a directory without a compiled model: give a .vflow or .cflow file written by cflowc "
                     "(or a directory holding exactly one)")


def add_version(p: argparse.ArgumentParser) -> None:
    p.add_argument("--version", action="version", version=VERSION, help="print the version and exit")


# --- cflowc ------------------------------------------------------------------------------
def cflowc_parser() -> argparse.ArgumentParser:
    from .cflowc import cflowc_parser

    return cflowc_parser()


def cflowc_main(argv: Sequence[str] | None = None) -> int:
    from .cflowc import _cflowc, cflowc_parser

    args = cflowc_parser().parse_args(argv)
    return _guard(_cflowc, args)


# --- cflow -------------------------------------------------------------------------------
def command_module(name: str) -> ModuleType:
    """The module of `cflow NAME` (imported on first use)."""
    if name not in COMMANDS:
        raise KeyError(name)
    return importlib.import_module(f".{name.replace('-', '_')}", __name__)


def cflow_parser() -> argparse.ArgumentParser:
    p = Parser(prog="cflow", description="Run, inspect and benchmark compiled cflow models.")
    add_version(p)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for name in COMMANDS:
        mod = command_module(name)
        sp = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_args(sp)
        sp.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def cflow_main(argv: Sequence[str] | None = None) -> int:
    args = cflow_parser().parse_args(argv)
    return _guard(command_module(args.cmd).run, args)
