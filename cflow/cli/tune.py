"""cflow tune FILE: measure this host's mat-vec kernel variants for a compiled model's kernel shapes and the
attention core's prefetch distance for its attention geometry, cache the choices (the same searches `cflow.load`
runs the first time it meets a shape on this CPU) and print the tables."""

HELP = ("measure and cache this CPU's fastest mat-vec kernel variant for each kernel shape of a compiled model, "
        "and the attention core's prefetch distance")


def add_args(p):
    from . import whole

    p.add_argument("file", help="compiled model (.vflow or .cflow)")
    p.add_argument("--force", action="store_true",
                   help="measure again even where this CPU's cache has a choice (default: reuse cached choices)")
    # the default is codegen.tune.ROUNDS, resolved in run(): --help must not import numpy/llvmlite
    p.add_argument("--rounds", type=whole(1, 100), default=None,
                   help="timed rounds per variant, interleaved; the median counts "
                        "(default: the same as the search cflow.load runs)")
    p.add_argument("--passes", type=whole(1, 10), default=None,
                   help="coordinate-descent passes at most (default: the same as the search cflow.load runs; "
                        "1: only one-knob changes of the default, a quicker and rougher search)")
    p.add_argument("--mb", type=whole(1, 4096), default=64,
                   help="MiB of packed weights each timed call streams, past the caches (default: 64)")
    p.add_argument("--kv", choices=("auto", "f32", "f16", "bf16"), default="auto",
                   help="the KV cache type whose attention core is measured (default: auto, as cflow run)")
    p.add_argument("--json", metavar="PATH", help="also write the records as JSON (default: none)")


def run(args) -> int:
    import json

    from ..codegen import attn_tune, tune
    from ..codegen.target import cpu_model, host_target
    from ..passes.pipeline import plan_from_header
    from ..runtime.format import FileReader
    from ..util import atomic_write_text, check_output_path

    if args.rounds is None:
        args.rounds = tune.ROUNDS
    if args.passes is None:
        args.passes = tune.PASSES

    if args.json:
        check_output_path(args.json, "--json")
    from ..runtime.session import resolve_kv

    with FileReader(args.file) as r:
        plan = plan_from_header(r.header, r.path)
        tensors = plan.tensors.values()
        kv = resolve_kv(args.kv, r.header["quant"])
        context = plan.graph.config.max_seq_len  # a default load's cache positions
    target = host_target()
    span = tune.stream_span(args.mb * 2**20)
    print(f"{cpu_model()} ({target.isa}); one thread, {args.mb} MiB of weights per call (page-aligned, the next "
          f"window of a {span / 2**20:.0f} MiB set each call, past the last-level cache), median of "
          f"{args.rounds} rounds; coordinate descent from the default unit loop (passes u1, u2, ...) and from "
          f"the group loop (g1, ...), <= {args.passes} passes each (pass N: the choice so far and each one-knob "
          f"change; a variant must beat it by {tune.MARGIN:.0%}), then the default against each descent's end "
          f"('final')")
    if not tune.enabled():
        print("note: CFLOW_TUNE=off: cflow.load uses the defaults and ignores this table while it is set")
    records = {}

    def show(key, rec):
        records[key] = rec
        print(f"\n{key}")
        print(f"  {'pass':>5} {'variant':<32} {'GB/s':>7}")
        results = _shown(rec)
        final = max((i for i, v in enumerate(results) if v["knobs"] == rec.get("choice")), default=-1)
        for i, v in enumerate(results):
            step = "final" if v.get("pass") == 0 else f"{'ug'[v.get('seed', 0)]}{v.get('pass', 1)}"
            mark = "  <- chosen" if i == final else ""
            print(f"  {step:>5} {v['variant']:<32} {v['gbps']:>7.2f}{mark}")

    # cached choices are shown as stored, missing ones measured and cached (also under CFLOW_TUNE=off)
    tune.choices(tensors, target, force=args.force, rounds=args.rounds, nbytes=args.mb * 2**20,
                 passes=args.passes, on_result=show, ignore_env=True)

    def show_attention(key, rec):
        records[key] = rec
        print(f"\n{key} (the attention core at position {rec.get('position', '?')}, "
              f"{rec.get('layers_per_call', '?')} layers' {kv} caches per call; GB/s of K/V read)")
        for v in _shown(rec):
            mark = "  <- chosen" if v["knobs"] == rec.get("choice") else ""
            print(f"  {v['variant']:<32} {v['gbps']:>7.2f}{mark}")

    attn_tune.choices(attn_tune.geometries(plan.graph.nodes()), kv, target, force=args.force, rounds=args.rounds,
                      on_result=show_attention, ignore_env=True, max_seq=context)
    if args.json:
        atomic_write_text(args.json, json.dumps({"cpu": cpu_model(), "isa": target.isa, "kernels": records},
                                                indent=1))
    return 0


def _shown(rec: dict) -> list[dict]:
    """The printable timings of a cached record (a hand-edited or foreign table's malformed entries skipped: the
    choice itself was validated where it is used)."""
    res = rec.get("results")
    return [v for v in res if isinstance(v, dict) and {"knobs", "variant", "gbps"} <= set(v)
            and isinstance(v["variant"], str) and isinstance(v["gbps"], (int, float))] if isinstance(res, list) else []
