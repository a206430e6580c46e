"""cflow inspect FILE: summarise a .vflow/.cflow file and check it (exit 1 on failure, like gzip -t): the
container's structure and checksums, and the model its header describes (every config field, the plan the
config implies against the header and the tensor table, the stored tokenizer) — everything `cflow run` checks
before it compiles anything."""

HELP = "summarise a compiled file and check its integrity and its model (exit 1 if any check fails)"


def add_args(p):
    p.add_argument("file", help="compiled model (.vflow or .cflow)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the full-read checksum pass (default: verify every checksum)")
    p.add_argument("--plot", metavar="PNG",
                   help="draw the stage timeline (bytes per stage and op) to a PNG (default: no plot)")


def check_model(reader) -> str:
    """What `cflow.load` checks before compiling, without compiling: the header's fields, the plan the config
    implies against the header and the tensor table, the tokenizer. Returns a one-line description; raises
    CflowError naming the first problem."""
    from ..passes.pipeline import plan_from_header
    from ..runtime.format.header import check_header, check_plan, stale_file_error

    h = reader.header
    try:
        cfg = check_header(reader)
        check_plan(reader, plan_from_header(h, reader.path))
    except Exception as e:
        from ..errors import FormatError

        if isinstance(e, FormatError):
            raise stale_file_error(h, reader.path, e) or e from None
        raise
    tok = "no tokenizer (prompts are token ids)"
    if h.get("tokenizer"):
        from ..runtime.tokenizer import Tokenizer

        tok = f"tokenizer of {Tokenizer(h['tokenizer'], h.get('eos_token_ids') or ()).vocab_size} tokens"
        sp = h.get("special_tokens") or {}
        adds = [f"{what} {sp[k]}" for k, what in (("bos", "starting with BOS"), ("eos", "ending with EOS"))
                if sp.get(f"add_{k}")]
        tok += f", prompts {' and '.join(adds)}" if adds else ", prompts without BOS"
    from ..runtime.session import resolve_kv

    return (f"model: ok ({h.get('name')}: {cfg.n_layers} layers x d_model {cfg.d_model}, {h['quant']}, "
            f"{resolve_kv('auto', h['quant'])} KV cache by default, tile {h['tile'][0]}x{h['tile'][1]}, "
            f"context {cfg.max_seq_len}; {tok})")


def run(args) -> int:
    from ..errors import CflowError, FormatError
    from ..runtime.format import FileReader

    if args.plot:  # checked before any work
        from ..util import check_output_path

        check_output_path(args.plot, "--plot")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CflowError("--plot needs matplotlib (pip install matplotlib)") from None
    with FileReader(args.file) as r:
        failure = None
        if not args.no_verify:
            try:
                r.verify()
            except FormatError as e:
                failure = e
        print(r.summary())
        try:
            print(check_model(r))
        except CflowError as e:
            print(f"model: FAILED: {e}")
            failure = failure or e
        if args.plot and failure is None:
            from ..passes.plot import plot_schedule

            plot_schedule(r.header, args.plot)
            print(f"wrote {args.plot}")
        if failure is not None:
            raise failure
    return 0
