"""cflow tune FILE: measure this host's mat-vec kernel variants for a compiled model's kernel shapes and the
attention core's prefetch distance for its attention geometry, in a time budget, cache the choices (later loads
read them; without them a load uses the choices shipped for its microarchitecture) and print the tables."""

# printed under the opening paragraph, above the tables
LEGEND = """\
Each table is one kernel shape, TYPE:COLUMNS:TILE:KIND (q4:5632:128x256:plain), with the search's wall time.
  pass     which step timed the variant: s1, s2, ... the descent from the start, o1, ... from the other loop kind,
           final the start, the default and each descent's end head to head
  variant  the kernel's knobs: uN block units per loop iteration with gN row groups per pass, or gloop (one row
           group per iteration); pfN software prefetch N bytes ahead (pf0 none; /S one every S bytes); L0-L3 the
           prefetch's locality hint (L3 = prefetcht0, L0 = prefetchnta); v256 256-bit integer dots; shift the
           shift unpack of Q4 nibbles
  GB/s     packed weights streamed per second by one thread, median of the rounds (higher is faster)
  <- chosen  the variant cached for this CPU and used by later loads
attn:HEADSxKV_HEADSxHEAD_DIM:KV tables time the attention core's prefetch distance (kv_prefetch N: N bytes ahead,
0 none), in GB/s of K/V cache read."""

HELP = ("measure and cache this CPU's fastest mat-vec kernel variant for each kernel shape of a compiled model, "
        "and the attention core's prefetch distance")


def add_args(p):
    from . import whole

    p.add_argument("file", help="compiled model (.vflow or .cflow), or a directory holding exactly one")
    p.add_argument("--force", action="store_true",
                   help="measure again even where this CPU's cache has a choice (default: reuse cached choices)")
    # the default is codegen.tune.ROUNDS, resolved in run(): --help must not import numpy/llvmlite
    p.add_argument("--rounds", type=whole(1, 100), default=None,
                   help="timed rounds per variant, interleaved; the median counts (default: 9)")
    p.add_argument("--passes", type=whole(1, 10), default=None,
                   help="coordinate-descent passes at most (default: 3; 1: only one-knob changes of the start, a "
                        "quicker and rougher search)")
    p.add_argument("--budget", type=whole(0, 36000), default=None,
                   help="seconds for the whole model's searches, shared by its kernel shapes; a descent stops "
                        "starting passes at its share (default: 15; 0: no limit, every descent runs to its end)")
    p.add_argument("--mb", type=whole(1, 4096), default=64,
                   help="MiB of packed weights each timed call streams, past the caches (default: 64)")
    p.add_argument("--kv", choices=("auto", "f32", "f16", "bf16"), default="auto",
                   help="the KV cache type whose attention core is measured (default: auto, as cflow run)")
    p.add_argument("--json", metavar="PATH", help="also write the records as JSON (default: none)")


def run(args) -> int:
    import json
    import time

    from ..codegen import attn_tune, tune
    from ..codegen.target import cpu_model, host_target
    from ..passes.pipeline import plan_from_header
    from ..runtime.format import FileReader
    from ..util import atomic_write_text, check_output_path
    from . import compiled_file

    if args.rounds is None:
        args.rounds = tune.ROUNDS
    if args.passes is None:
        args.passes = tune.PASSES
    budget = tune.BUDGET if args.budget is None else (args.budget or None)

    if args.json:
        check_output_path(args.json, "--json")
    path = compiled_file(args.file)
    from ..runtime.session import resolve_kv

    with FileReader(path) as r:
        plan = plan_from_header(r.header, r.path)
        tensors = plan.tensors.values()
        kv = resolve_kv(args.kv, r.header["quant"])
        context = plan.graph.config.max_seq_len  # a default load's cache positions
    target = host_target()
    span = tune.stream_span(args.mb * 2**20)
    from ..codegen.tune_defaults import host_family, shipped_family

    family = host_family() + ("" if shipped_family() else ", no shipped choices for this CPU: the built-in ones")
    print(f"{cpu_model()} ({target.isa}; family {family}); one thread, {args.mb} MiB of weights per call "
          f"(page-aligned, the next window of a {span / 2**20:.0f} MiB set each call, past the last-level cache), "
          f"median of {args.rounds} rounds; coordinate descent from the start (this family's shipped choice, else "
          f"the default: passes s1, s2, ...), then from the other loop kind (o1, ...), <= {args.passes} passes "
          f"each (pass N: the choice so far and each one-knob change; a variant must beat it by "
          f"{tune.MARGIN:.0%}), then the start against the default and each descent's end ('final'); "
          + (f"{budget:.0f} s for the model's searches in all" if budget else "no time limit"))
    print(LEGEND)
    if not tune.enabled():
        print("note: CFLOW_TUNE=off: cflow.load uses the defaults and ignores this table while it is set")
    records = {}

    def show(key, rec):
        records[key] = rec
        if rec.get("shipped"):
            print(f"\n{key}\n  shipped for this CPU family: {tune.label(rec['choice'])}")
            return
        took = f" ({rec['seconds']:.1f} s)" if isinstance(rec.get("seconds"), (int, float)) else ""
        print(f"\n{key}{took}")
        print(f"  {'pass':>5} {'variant':<32} {'GB/s':>7}")
        results = _shown(rec)
        final = max((i for i, v in enumerate(results) if v["knobs"] == rec.get("choice")), default=-1)
        for i, v in enumerate(results):
            step = "final" if v.get("pass") == 0 else f"{'so'[min(v.get('seed', 0), 1)]}{v.get('pass', 1)}"
            mark = "  <- chosen" if i == final else ""
            print(f"  {step:>5} {v['variant']:<32} {v['gbps']:>7.2f}{mark}")

    # cached choices are shown as stored, missing ones measured and cached (also under CFLOW_TUNE=off)
    t0 = time.perf_counter()
    geoms = attn_tune.geometries(plan.graph.nodes())
    tune.choices(tensors, target, search=True, force=args.force, rounds=args.rounds, nbytes=args.mb * 2**20,
                 passes=args.passes, on_result=show, ignore_env=True, budget=tune.kernel_budget(budget, len(geoms)))

    def show_attention(key, rec):
        records[key] = rec
        print(f"\n{key} (the attention core at position {rec.get('position', '?')}, "
              f"{rec.get('layers_per_call', '?')} layers' {kv} caches per call; GB/s of K/V read)")
        for v in _shown(rec):
            mark = "  <- chosen" if v["knobs"] == rec.get("choice") else ""
            print(f"  {v['variant']:<32} {v['gbps']:>7.2f}{mark}")

    attn_tune.choices(geoms, kv, target, search=True, force=args.force,
                      rounds=args.rounds, on_result=show_attention, ignore_env=True, max_seq=context)
    print(f"\n{time.perf_counter() - t0:.1f} s")
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
