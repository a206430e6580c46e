"""cflowc's calibrated quantisation: --imatrix TEXT|FILE, --imatrix-out, --bpw, --quant auto.

    cflowc MODEL --imatrix calib.txt --imatrix-out model.imatrix.dat        collect and save (no -o needed)
    cflowc MODEL --imatrix calib.txt --bpw 4.25 -o model.vflow              a type mix under the budget
    cflowc MODEL --imatrix model.imatrix.dat --quant q4 -o model.vflow      importance-weighted Q4_0 throughout

The imatrix (passes/imatrix.py) comes from running the model's float weights over the text; the mix
(passes/mix.py) measures every matrix at every type it can take and allocates the budget. From a text, the same
run collects each matrix's input second moment, and every block's rounding error is fed forward onto the inputs
not yet quantised (passes/gptq.py; --no-gptq rounds each block alone, as a saved imatrix file must).
"""

from __future__ import annotations

import sys

from ..errors import CflowError

IMATRIX_SUFFIXES = (".dat", ".imatrix", ".gguf")
PROBE_TOKENS = 128  # tokens of the sensitivity probe (one float forward pass per matrix)
GRAM_MAX = 4 << 30  # bytes of input second moments kept at most (a quarter of the RAM if less): the rest, diagonal


def add_args(p) -> None:
    from . import whole

    p.add_argument("--bpw", type=_bpw, default=None, metavar="BITS",
                   help="bits-per-weight budget: choose each matrix's type (every block type cflow runs; without "
                   "--imatrix TEXT all but its own 3-bit ones) to minimise the importance-weighted error within it; "
                   "implies --quant auto (default: none; auto's is 4.5)")
    p.add_argument("--imatrix", metavar="TEXT|FILE", default=None,
                   help="importance matrix: a text file to collect it from, or a saved one (llama.cpp's .dat or "
                   "GGUF imatrix, by suffix .dat/.imatrix/.gguf); weighs every block's fit (default: none, "
                   "unweighted)")
    p.add_argument("--imatrix-out", metavar="FILE.dat", default=None,
                   help="write the collected importance matrix in llama.cpp's .dat format (default: not written)")
    p.add_argument("--imatrix-ctx", type=whole(2), default=None, metavar="N",
                   help="tokens per calibration chunk (default: 512, or the model's context if shorter)")
    p.add_argument("--imatrix-chunks", type=whole(1), default=None, metavar="N",
                   help="calibration chunks to run at most (default: every whole chunk of the text)")
    p.add_argument("--mix-types", choices=("all", "gguf"), default="all",
                   help="the block types a mix (--bpw, --quant auto) chooses from: every type cflow runs, its own "
                   "128/192-input ones included (without a calibration text, all but its own 3-bit ones), or "
                   "llama.cpp's only, so that the file can be exported as a GGUF (default: all)")
    p.add_argument("--no-gptq", action="store_true",
                   help="fit each block alone, importance-weighted (default: with --imatrix TEXT, each block's "
                   "error is fed forward onto the inputs not yet quantised, GPTQ)")


def _bpw(text: str) -> float:
    import argparse

    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of bits per weight, not {text!r}") from None
    if not 1 <= v <= 32:
        raise argparse.ArgumentTypeError(f"{v:g} bits per weight: give 1 to 32")
    return v


def mix_types(args) -> tuple:
    """The block types --mix-types lets a mix choose from."""
    from ..passes import mix as M

    return M.GGUF_CANDIDATES if getattr(args, "mix_types", "all") == "gguf" else M.CANDIDATES


def auto_default(model, g, types=None) -> bool:
    """Whether cflowc compiles `g` as --quant auto when no --quant is given: a float model file (not a preset: random
    weights) with a type mix (of `types`, default every type) within the default budget."""
    from ..frontend.load import is_preset_spec
    from ..passes import mix as M
    from ..passes.quantize import float_source

    if is_preset_spec(model) or not float_source(g):
        return False
    floor = M.smallest_bpw(g, M.auto_types(types))
    return floor is not None and floor <= M.DEFAULT_BPW


def wanted(args) -> bool:
    return args.quant == "auto" or args.bpw is not None or args.imatrix is not None or args.imatrix_out is not None


def _progress(what: str):
    """A one-line counter on a terminal's stderr; a single line at the end otherwise."""
    tty = sys.stderr.isatty()

    def tick(i, n, name=""):
        if tty:
            print(f"\r{what} {i}/{n} {name:<40}", end="\n" if i == n else "", file=sys.stderr, flush=True)
        elif i == n:
            print(f"{what}: {n} done", file=sys.stderr)

    return tick


def _is_imatrix_file(path: str) -> bool:
    if path.lower().endswith(IMATRIX_SUFFIXES):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def importance(args, g):
    """(the ImportanceMatrix --imatrix names, collected from text or read, or None; the calibration ids or None)."""
    from ..passes import imatrix as I

    if args.imatrix is None:
        if args.imatrix_out:
            raise CflowError("--imatrix-out needs --imatrix TEXT (the calibration text to collect it from)")
        return None, None
    if _is_imatrix_file(args.imatrix):
        if args.imatrix_out:
            raise CflowError("--imatrix-out writes a collected matrix: --imatrix names a saved one already")
        return I.read(args.imatrix, g), None
    try:
        with open(args.imatrix, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise CflowError(f"--imatrix {args.imatrix}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    if g.meta.tokenizer is None:
        raise CflowError("--imatrix TEXT: this model has no tokenizer to read the text with (give --tokenizer, or a "
                         "saved imatrix file)")
    from ..runtime.tokenizer import Tokenizer

    tok = Tokenizer(g.meta.tokenizer, g.meta.eos_token_ids, g.meta.special_tokens)
    ids = tok.encode(text, add_special=False)
    n_ctx = args.imatrix_ctx or min(512, g.config.max_seq_len)
    print(f"imatrix: {len(ids)} tokens of {args.imatrix}, chunks of {n_ctx}", file=sys.stderr)
    im = I.collect(g, ids, n_ctx, args.imatrix_chunks, tok.bos_id if tok.add_bos else None, args.imatrix,
                   progress=_progress("imatrix chunks"), gram_bytes=0 if args.no_gptq else gram_budget())
    if args.imatrix_out:
        from ..util import check_output_path

        check_output_path(args.imatrix_out, "--imatrix-out")
        I.write_dat(im, args.imatrix_out)
        print(f"wrote {args.imatrix_out}: {len(im.values)} matrices, {im.chunks} chunks", file=sys.stderr)
    return im, ids[:n_ctx]


def gram_budget() -> int:
    import os

    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 4 * GRAM_MAX
    return min(GRAM_MAX, ram // 4)


def calibrate(args, g):
    """The graph to compile as stored: every matrix at its type (the mix under --bpw, or --quant's), importance-
    weighted; or None when only --imatrix-out was asked for."""
    from ..codegen import quantfit  # noqa: F401  (sets layout.quantize_blocks.NATIVE_FITTERS: the native fitters)
    from ..layout.quant import DType
    from ..passes import mix as M

    if args.bpw is not None and args.quant not in (None, "auto"):
        raise CflowError(f"--bpw chooses the types: it does not combine with --quant {args.quant} (use --quant auto)")
    if args.quant == "stored":
        raise CflowError("--imatrix requantises: it does not combine with --quant stored")
    im, ids = importance(args, g)
    if args.output is None:
        return None
    mixed = args.quant == "auto" or args.bpw is not None
    budget = args.bpw if args.bpw is not None else M.DEFAULT_BPW
    types = mix_types(args)
    if mixed and im is None:  # no importance matrix: each matrix's unweighted error (auto_mix weighs the columns)
        low, full = M.smallest_bpw(g, M.auto_types(types)), M.smallest_bpw(g, types)
        if low is not None and full is not None and full <= budget < low:
            raise CflowError(f"--bpw {budget:g}: without a calibration text the smallest type mix of {g.name} is "
                             f"{low:.3f} bits per weight (cflow's 3-bit types are left out: with no probe their "
                             f"placement is a guess); with --imatrix TEXT it is {full:.3f}")
        out, plan = M.auto_mix(g, budget, progress=_progress("measuring"), types=types)
        _print_plan(plan, g, budget, getattr(args, "auto_default", False))
        return out
    values = im.for_graph(g, args.imatrix) if im is not None else {}
    weights = M.column_weights(g, values)
    curv = M.curvatures(im.grams) if im is not None and im.grams else None
    if curv:
        print(f"error feedback (GPTQ) on {len(curv)} of {len(M.matrices(g))} matrices", file=sys.stderr)
    if mixed:
        errors = M.measure(g, weights, types, progress=_progress("measuring"), curv=curv)
        sens = None
        if ids is not None:  # a KLD probe on the first calibration chunk makes the errors comparable across tensors
            sens = M.sensitivities(g, weights, errors, ids[:PROBE_TOKENS], progress=_progress("probing"), curv=curv)
        else:
            print("no calibration text: types chosen by the raw weighted errors (no KLD probe)",
                  file=sys.stderr)
        plan = M.plan_mix(g, M.predicted(errors, sens) if sens else errors, budget, args.imatrix or "")
        _print_plan(plan, g, budget, False)
        return M.apply_types(g, plan.types, weights, {**plan.to_json(), "gptq": bool(curv)}, curv)
    q = DType.parse(args.quant or "q4")
    return M.apply_types(g, M.uniform(g, q), weights, {"imatrix": args.imatrix or "", "type": q.gguf_name,
                                                       "gptq": bool(curv)}, curv)


def _print_plan(plan, g, budget: float, default: bool) -> None:
    """The mix's table; for the default of a float model (not asked for), its summary and how to choose otherwise."""
    table = plan.table(g.meta.shapes)
    if default:
        table = (f"{table.splitlines()[-1]} (a float model without --quant: its matrices' types chosen within "
                 f"{budget:g} bits per weight, as --quant auto; --quant q4 for Q4_0 throughout)")
    print(table, file=sys.stderr)
