"""Decode speed against the machine's read bandwidth, measured in the same run.

    python -m benchmarks.decode [--threads 1,2] [--tokens 32] [--json [FILE]] [--model tinyllama]
    python -m benchmarks.decode --variants default,tune-off --rounds 5      # load options A/B, interleaved

Model: TinyLlama-1.1B geometry (hidden 2048, 22 layers, 32/4 heads, FFN 5632, vocab 32000) with
fixed random weights (seed 0, std 0.02; LM head 0.2; benchmarks/common/models.py), compiled to Q4 (~0.6 GB
streamed per token) once and kept in out/bench/. For each thread count: the read bandwidth (STREAM-like llvmlite
loop over 1 GiB, same thread count, before and after), then cflow's greedy decode tok/s, bytes per token,
effective GB/s and the fraction of the read bandwidth. Before timing, the first 8 greedy tokens must equal the
NumPy interpreter's on the same Q4 weights (int8 activation emulation), compared while the reference's top-2
margin is clear.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

import cflow
from benchmarks.common.bandwidth import around, read_gbs
from benchmarks.common.models import LAZY_MODELS, MODELS, compiled_model
from benchmarks.common.profile import profile
from benchmarks.common.record import Run, add_json_argument
from benchmarks.common.timing import busy_fraction, time_decode
from cflow.errors import CflowError
from cflow.ir import Interpreter


def reference_tokens(c, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens of the Q4 interpreter and each step's top-2 logit margin."""
    it = Interpreter(c.graph, act_quant="q8", cache_weights=False)
    logits = it.prefill(prompt)[-1]
    toks, margins = [], []
    for _ in range(n):
        top2 = np.sort(logits)[-2:]
        toks.append(int(np.argmax(logits)))
        margins.append(float(top2[1] - top2[0]))
        logits = it.step(toks[-1])
    return toks, margins


def check_tokens(m, c, prompt, n=8, tol=1e-2) -> str:
    ref, margins = reference_tokens(c, prompt, n)
    got = m.generate(prompt, max_new_tokens=n, stop=False)
    for i, (a, b) in enumerate(zip(got, ref)):
        if margins[i] < tol:
            return f"first {i} greedy tokens equal the interpreter's (step {i}: top-2 margin {margins[i]:.2e} < {tol})"
        if a != b:
            raise SystemExit(f"FAIL: token {i}: runtime {a} != interpreter {b} (margin {margins[i]:.3f})")
    return f"first {n} greedy tokens equal the interpreter's"


# --variants: load options compared side by side (A/B) in interleaved rounds of one run
VARIANTS = {
    "default": ({}, {}),  # what cflow.load gives: tuned kernels (this host's cached choice), kv="auto"
    "tune-off": ({"CFLOW_TUNE": "off"}, {}),  # the kernels' built-in defaults
    "kv-f32": ({}, {"kv": "f32"}),
    "kv-f16": ({}, {"kv": "f16"}),
    "kv-bf16": ({}, {"kv": "bf16"}),
}


def variant(name: str):
    """(env, load kwargs) of a --variants name: VARIANTS, cache=DIR (CFLOW_CACHE_DIR=DIR: another tuning table,
    e.g. an older search's choices, against this host's own), isa=PATH (that ISA's kernels forced on this host:
    target.forced_env), or several joined by '+' (isa=avx2+tune-off)."""
    from cflow.codegen.target import forced_env

    if "+" in name:
        env, kw = {}, {}
        for part in name.split("+"):
            e, k = variant(part)
            env, kw = {**env, **e}, {**kw, **k}
        return env, kw
    if name.startswith("cache="):
        return {"CFLOW_CACHE_DIR": name[len("cache="):]}, {}
    if name.startswith("isa="):
        return forced_env(name[len("isa="):]), {}
    return VARIANTS[name]


def load_variant(path: str, name: str, threads: int):
    env, kw = variant(name)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return cflow.load(path, threads=threads, **kw)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def compare_variants(path: str, c, prompt, names: list[str], threads_list: list[int], rounds: int, tokens: int,
                     gib: float, run: Run | None = None) -> list[dict]:
    """Each variant loaded once per thread count, then `rounds` rounds: the read bandwidth, then every variant's
    decode (best of 1 over `tokens` steps, the order rotated per round), each with the CPU share other processes
    used meanwhile. Medians per variant, and each variant's per-round ratio to the first: one record each."""
    run = run or Run("decode", [])
    records = []
    for threads in threads_list:
        models = {n: load_variant(path, n, threads) for n in names}
        for m in models.values():
            time_decode(m, prompt, 4, 1)  # warm: page cache, first-touch of buffers
        per = {n: [] for n in names}
        loads = {n: [] for n in names}
        reads = []
        for r in range(rounds):
            reads.append(read_gbs(threads, gib))
            order = names[r % len(names):] + names[: r % len(names)]
            for n in order:
                tps, other = busy_fraction(lambda m=models[n]: time_decode(m, prompt, tokens, 1))
                per[n].append(tps)
                loads[n].append(other)
        read = float(np.median(reads))
        print(f"threads={threads}  read {read:6.2f} GB/s (median of {rounds}: "
              f"{', '.join(f'{x:.1f}' for x in reads)})  CPU {run.cpu_model}", flush=True)
        base = per[names[0]]
        for n in names:
            m = models[n]
            tps = float(np.median(per[n]))
            eff = m.bytes_per_token * tps / 1e9
            ratios = [a / b for a, b in zip(per[n], base)]
            # the round's decode over the round's own read bandwidth: a 2-thread read bandwidth that swings 1.5x
            # within minutes (shared hosts) then moves numerator and denominator together
            per_round = float(np.median([m.bytes_per_token * t / 1e9 / rd for t, rd in zip(per[n], reads)]))
            print(f"  {n:<9} {tps:7.2f} tok/s  {100 * eff / read:5.1f}% of read (per round: {100 * per_round:.1f}%)"
                  f"  / {names[0]}: median "
                  f"{np.median(ratios):.3f} (rounds {', '.join(f'{x:.2f}' for x in ratios)})  other load "
                  f"{100 * max(loads[n]):.0f}% max", flush=True)
            records.append(run.record(
                engine="cflow", model=c.graph.config.name, quant=m.session.header["quant"],
                isa_path=m.session.program.isa, threads=threads, variant=n, tok_s=round(tps, 3),
                bytes_per_token=m.bytes_per_token, read_gbs=round(read, 3), tok_s_rounds=per[n], read_rounds=reads,
                fraction=round(eff / read, 4), fraction_per_round=round(per_round, 4),
                ratio_to_first=round(float(np.median(ratios)), 4), other_load=round(max(loads[n]), 3), kv=m.kv))
        for m in models.values():
            m.close()
    return records


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tinyllama", choices=list(MODELS))
    ap.add_argument("--quant", default="q4", choices=("q4", "q8"), help="weight type (default q4)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gib", type=float, default=1.0, help="read-bandwidth buffer")
    ap.add_argument("--no-check", action="store_true", help="skip the interpreter token check")
    add_json_argument(ap, "write one record per thread count (per variant and thread count with --variants)")
    ap.add_argument("--profile", action="store_true", help="also print where the time goes (per-stage cycle stamps)")
    ap.add_argument("--variants", help=f"compare load options side by side in interleaved rounds, e.g. "
                    f"default,tune-off (any of {', '.join(VARIANTS)}; cache=DIR: CFLOW_CACHE_DIR=DIR; isa=PATH: "
                    f"that ISA path's kernels forced on this host (avxvnni, avx2, generic); several joined by '+', "
                    f"e.g. isa=avx2+tune-off)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of --variants (default: 5)")
    ap.add_argument("--context", type=int, default=8,
                    help="prompt tokens before the timed steps (default 8; e.g. --model tinyllama_4k --context 4064 "
                    "--variants kv-f16,kv-bf16: fractions then count the weights only, the ratios are the A/B)")
    args = ap.parse_args(argv)
    run = Run("decode", argv)
    names = args.variants.split(",") if args.variants else []
    bad = []
    for n in names:
        try:
            variant(n)
        except (KeyError, ValueError, CflowError):
            bad.append(n)
    if bad:
        ap.error(f"--variants: unknown {', '.join(bad)} (known: {', '.join(VARIANTS)}, cache=DIR, isa=PATH, "
                 "joined by '+')")

    path, c = compiled_model(args.model, args.quant)
    if args.context + args.tokens > c.graph.config.max_seq_len:
        ap.error(f"--context {args.context} + --tokens {args.tokens} exceed {args.model}'s "
                 f"{c.graph.config.max_seq_len}-token context")
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, c.graph.config.vocab_size, args.context)]
    if names:
        records = compare_variants(path, c, prompt, names, [int(t) for t in args.threads.split(",")], args.rounds,
                                   args.tokens, args.gib, run)
        run.write(args.json, records)
        return
    records = []
    for threads in (int(t) for t in args.threads.split(",")):
        m = cflow.load(path, threads=threads)
        if not args.no_check and not records:
            print(f"# interpreter token check skipped for {args.model}: the NumPy interpreter would regenerate "
                  "every weight each step (benchmarks.peers checks it against llama.cpp instead)"
                  if args.model in LAZY_MODELS else f"# {check_tokens(m, c, prompt)}", flush=True)
        # the machine's best read bandwidth around the decode, in this run: the honest denominator
        tps, read = around(threads, args.gib, lambda m=m: time_decode(m, prompt, args.tokens, args.reps))
        bpt = m.bytes_per_token
        eff = bpt * tps / 1e9
        records.append(run.record(engine="cflow", model=c.graph.config.name, quant=args.quant, threads=threads,
                                  tok_s=round(tps, 3), bytes_per_token=bpt, read_gbs=round(read, 3),
                                  effective_gbs=round(eff, 3), fraction=round(eff / read, 4),
                                  context=args.context, tokens=args.tokens, reps=args.reps))
        print(f"threads={threads}  read {read:6.2f} GB/s | cflow {tps:6.2f} tok/s x {bpt / 1e6:7.1f} MB/token = "
              f"{eff:6.2f} GB/s = {100 * eff / read:5.1f}% of read bandwidth", flush=True)
        m.close()
        if args.profile:
            print(profile(path, threads, prompt, args.tokens), flush=True)
    run.write(args.json, records)


if __name__ == "__main__":
    main()
