"""What the delays buy the schedule: barriers per token, critical path and expert bytes per preset, and decode
tok/s of arch1 against arch2_4_combined at equal bytes per token, with a per-stage profile of both.

    python -m benchmarks.claims_schedule --static                      # the tables only (no timing, seconds)
    python -m benchmarks.claims_schedule --size 114m --threads 1,2 --rounds 5 --json   # a record per measurement
    python -m benchmarks.claims_schedule --size 114m --scale 2 ...    # every width doubled: 4x the bytes per token

Static part (analytic, per preset at --size, Q4): stages per token (build_schedule: one barrier after each
stage, codegen/step.py), the critical-path reduction (passes/analysis.py, as docs/analysis.md), and the weight
bytes per token with the router's top-k experts against reading every expert (conditional expert loading).

Timed part: both presets compiled to Q4 .vflow (out/bench/), each measurement a fresh greedy decode of
--tokens steps after a 4-token prompt, best of 3 sequences; the two presets alternate within every round,
so their ratio is a same-run figure; medians over rounds. Each round first measures the read bandwidth
(benchmarks/common/bandwidth.py, over --gib), and each preset's bytes/token x tok/s is printed against it: a
token whose weights fit in the last-level cache (114m: 28.4 MB against Zen 5's 32 MiB L3) streams above the
DRAM read rate, so how much of it stays cached, which depends on the experts the generated tokens route to,
moves the comparison. --scale K multiplies d_model, the head counts (head_dim kept), the FFN and the expert
widths by K (K^2 the bytes per token, random weights of benchmarks/common/models.py, the same for both presets)
to compare them where every token comes from DRAM. Then one profiling build of each (per-stage cycle
stamps, benchmarks/common/profile.py) at each thread count, grouped by what the stages do.
"""

from __future__ import annotations

import argparse
import os
import statistics

import attrs

from benchmarks.common import OUT
from benchmarks.common.bandwidth import read_gbs
from benchmarks.common.models import random_weights
from benchmarks.common.record import Run, add_json_argument
from benchmarks.common.timing import cpu_ticks, other_load, time_decode
from cflow.codegen.target import cpu_model, last_level_cache
from cflow.ir import build_graph
from cflow.layout import DEFAULT_TILE
from cflow.layout.quant import DType
from cflow.models import PRESETS, get_preset
from cflow.passes.analysis import _tensor_bytes, analyze
from cflow.passes.pipeline import lower

PROMPT = [1, 2, 3, 4]



def config(name: str, size: str, scale: int = 1):
    """Preset `name` at `size`, every width times `scale` (head_dim, layers, vocab and experts kept)."""
    c = get_preset(name, size)
    if scale == 1:
        return c
    return attrs.evolve(c, d_model=c.d_model * scale, n_heads=c.n_heads * scale, n_kv_heads=c.n_kv_heads * scale,
                        ffn_dim=c.ffn_dim * scale, expert_dim=c.expert_dim * scale)


def last_level_cache_text() -> str:
    """The last-level cache as the kernel reports it for cpu 0, e.g. 'L3 32.0 MiB'; '?' where not exposed."""
    level, size = last_level_cache()
    return f"{level} {size / 2**20:.1f} MiB" if size else "?"


def static(size: str, scale: int = 1) -> list[dict]:
    rows = []
    for name in PRESETS:
        c = config(name, size, scale)
        g = build_graph(c)
        a = analyze(g, "q4", DEFAULT_TILE)
        sched = lower(g, "q4", DEFAULT_TILE).schedule  # the lowering passes (quantised sizes), no weights touched
        topk = sum(s.nbytes for s in sched.steps())
        extra = 0  # the experts the router did not choose, had every expert been read
        for n in g.nodes():
            if n.kind == "experts":
                per = sum(_tensor_bytes(w, g.meta.shapes[w], DType.Q4, DEFAULT_TILE) for w in n.expert_weight_names(0))
                extra += (c.n_experts - n.top_k) * per
        rows.append({"preset": name, "stages": sched.n_stages, "barriers_per_token": sched.n_stages,
                     "critical_path_reduction": a.reduction, "sequential_mb": a.sequential_bytes / 1e6,
                     "critical_mb": a.critical_bytes / 1e6, "bytes_per_token_topk": topk,
                     "bytes_per_token_all_experts": topk + extra, "n_experts": c.n_experts, "top_k": c.top_k})
    return rows


def compiled(name: str, size: str, scale: int = 1) -> str:
    tag = size if scale == 1 else f"{size}x{scale}"
    path = os.path.join(OUT, f"claims_{name}_{tag}_q4.vflow")
    if not os.path.exists(path):
        from cflow.compiler import compile_file
        from cflow.frontend.load import load_graph

        os.makedirs(OUT, exist_ok=True)
        if scale == 1:  # the preset's own (torch-initialised) weights, as cflowc preset:NAME@SIZE
            g = load_graph(f"preset:{name}@{size}")
        else:  # shapes depend on the geometry only: both presets get the same weights
            c = config(name, size, scale)
            g = build_graph(c, random_weights(c), name=f"{name}_{tag}")
        compile_file(g, path, "q4")  # writes to a temporary name and renames: never a half-written file
    return path


def tok_s(m, tokens: int) -> float:
    return time_decode(m, PROMPT, tokens, reps=3)  # the best-of-reps greedy decode (benchmarks/common/timing.py)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="114m")
    ap.add_argument("--scale", type=int, default=1, help="every width times this (bytes per token times its square)")
    ap.add_argument("--gib", type=float, default=1.0, help="read-bandwidth buffer per round")
    ap.add_argument("--static", action="store_true", help="print the analytic table only")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--no-profile", action="store_true")
    add_json_argument(ap, "write one record per round, thread count and preset, the tables in the run's extra")
    args = ap.parse_args(argv)
    run = Run("claims_schedule", argv)
    if args.scale < 1:
        ap.error("--scale must be >= 1")
    table = static(args.size, args.scale)
    geo = args.size if args.scale == 1 else f"{args.size} with every width x{args.scale}"
    print(f"# {geo}, Q4, tile {DEFAULT_TILE[0]}x{DEFAULT_TILE[1]}; last-level cache {last_level_cache_text()}")
    print("| preset | stages = barriers/token | critical-path reduction | MB/token (top-k experts) | "
          "MB/token (all experts) | all / top-k |")
    print("|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['preset']} | {r['stages']} | {r['critical_path_reduction']:.2f}x | "
              f"{r['bytes_per_token_topk'] / 1e6:.2f} | {r['bytes_per_token_all_experts'] / 1e6:.2f} | "
              f"{r['bytes_per_token_all_experts'] / r['bytes_per_token_topk']:.2f}x |")
    out = {"size": args.size, "scale": args.scale, "last_level_cache": last_level_cache_text()}
    tag = args.size if args.scale == 1 else f"{args.size}x{args.scale}"
    # the analytic rows: no timing, bytes per token with the router's top-k experts
    records = [run.record(engine="cflow", model=f"{r['preset']}@{tag}", quant="q4", isa_path=None,
                          variant="static", bytes_per_token=r["bytes_per_token_topk"],
                          **{k: v for k, v in r.items() if k != "preset"}) for r in table]
    if not args.static:
        import cflow
        from benchmarks.common.profile import profile

        names = ("arch1", "arch2_4_combined")
        paths = {n: compiled(n, args.size, args.scale) for n in names}
        threads = [int(t) for t in args.threads.split(",")]
        models = {(n, t): cflow.load(paths[n], threads=t) for n in names for t in threads}
        for m in models.values():
            tok_s(m, 4)  # warm-up: pages, workers
        bpt = {n: models[(n, threads[0])].bytes_per_token for n in names}
        rec, reads = [], {t: [] for t in threads}
        for rnd in range(args.rounds):
            for t in threads:
                reads[t].append(read_gbs(t, args.gib))
                order = names if rnd % 2 == 0 else names[::-1]
                for n in order:
                    a = cpu_ticks()
                    v = tok_s(models[(n, t)], args.tokens)
                    rec.append({"round": rnd, "preset": n, "threads": t, "tok_s": v, "read_gbps": reads[t][-1],
                                "other_load": other_load(a, cpu_ticks())})
        for m in models.values():
            m.close()
        summary = {}
        print(f"\n# {cpu_model()}; decode tok/s, {args.tokens} tokens, best of 3 per measurement, "
              f"median of {args.rounds} rounds; bytes/token: " + ", ".join(f"{n} {bpt[n] / 1e6:.2f} MB" for n in names))
        for t in threads:
            med = {n: statistics.median(r["tok_s"] for r in rec if r["preset"] == n and r["threads"] == t)
                   for n in names}
            per_round = [next(r["tok_s"] for r in rec if r["round"] == k and r["threads"] == t
                              and r["preset"] == "arch2_4_combined")
                         / next(r["tok_s"] for r in rec if r["round"] == k and r["threads"] == t
                                and r["preset"] == "arch1") for k in range(args.rounds)]
            other = max(r["other_load"] for r in rec if r["threads"] == t)
            read = statistics.median(reads[t])
            # each preset's streamed bytes per second over the same round's read bandwidth (median of rounds);
            # above 100% part of each token came from the cache
            frac = {n: statistics.median(bpt[n] * r["tok_s"] / 1e9 / r["read_gbps"] for r in rec
                                         if r["preset"] == n and r["threads"] == t) for n in names}
            summary[t] = {**med, "ratio_median_of_rounds": statistics.median(per_round),
                          "ratio_min": min(per_round), "ratio_max": max(per_round), "other_load_max": other,
                          "read_gbps": read, "fraction_of_read": frac}
            print(f"threads={t}: read {read:.2f} GB/s; arch1 {med['arch1']:8.1f} tok/s ({100 * frac['arch1']:.1f}% of "
                  f"read)   arch2_4_combined {med['arch2_4_combined']:8.1f} tok/s "
                  f"({100 * frac['arch2_4_combined']:.1f}%)   arch2_4 / arch1 = "
                  f"{summary[t]['ratio_median_of_rounds']:.3f} (median of per-round ratios, "
                  f"range {min(per_round):.2f}..{max(per_round):.2f}; other load up to {other:.0%})")
        out.update(bytes_per_token=bpt, summary=summary)
        records += [run.record(engine="cflow", model=f"{r['preset']}@{tag}", quant="q4", threads=r["threads"],
                               tok_s=r["tok_s"], bytes_per_token=bpt[r["preset"]],
                               read_gbs=r["read_gbps"], round=r["round"], other_load=r["other_load"]) for r in rec]
        if not args.no_profile:
            profiles = {}
            for t in threads:
                for n in names:
                    text = profile(paths[n], t, PROMPT, args.tokens)
                    profiles[f"{n}/{t}"] = text
                    print(f"\n## {n}, {t} thread(s)\n{text}")
            out["profiles"] = profiles
    run.write(args.json, records, out)


if __name__ == "__main__":
    main()
