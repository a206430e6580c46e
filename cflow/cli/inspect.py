"""cflow inspect FILE: summarise a .vflow/.cflow file and verify every checksum (exit 1 on failure, like gzip -t)."""

HELP = "summarise a compiled file and check its integrity (exit 1 if any check fails)"


def add_args(p):
    p.add_argument("file", help="compiled model (.vflow or .cflow)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the full-read checksum pass (default: verify every checksum)")
    p.add_argument("--plot", metavar="PNG",
                   help="draw the stage timeline (bytes per stage and op) to a PNG (default: no plot)")


def run(args) -> int:
    from ..errors import FormatError
    from ..runtime.format import FileReader

    with FileReader(args.file) as r:
        failure = None
        if not args.no_verify:
            try:
                r.verify()
            except FormatError as e:
                failure = e
        print(r.summary())
        if args.plot:
            from ..passes.plot import plot_schedule

            plot_schedule(r.header, args.plot)
            print(f"wrote {args.plot}")
        if failure is not None:
            raise failure
    return 0
