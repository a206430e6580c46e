"""What two-plane activations cost on whole models: decode and prompt tok/s, q8 against q8x2, in one run.

    python -m benchmarks.act_cost [--models gemma3-270m,smollm2-135m] [--threads 1,2] [--rounds 5]
                                  [--tokens 64] [--prompt 512] [--json [FILE]]

Each file (benchmarks/conformance.py's MODELS or DERIVED, from $CFLOW_MODELS) compiled as stored (`cflowc
model.gguf`), loaded once per activation format (cflow.load(activations='q8' | 'q8x2'), both in memory) and thread
count, and measured in rounds that alternate which format goes first: greedy decode tok/s over --tokens tokens
after an 8-token prompt, then the prefill tok/s of a --prompt-token prompt (the first tokens of
benchmarks/data/tinystories_excerpt.txt; prompt blocks of 64, load's default). Per figure: the best of the rounds,
and the median over rounds of the ratio q8x2 / q8 (both taken back to back: slow swings of a shared host cancel);
each sample's share of the CPU other processes used meanwhile (benchmarks/common/timing) and the load average
are recorded beside it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common.record import Run, add_json_argument
from benchmarks.common.timing import busy_fraction, time_decode
from benchmarks.conformance import DERIVED, MODELS, TEXT, cache_dir, cflow_compile, derive, fetch

FORMATS = ("q8", "q8x2")


def prefill_tok_s(m, ids) -> float:
    s = m.session
    s.reset()
    t0 = time.perf_counter()
    s.prefill(ids)
    return len(ids) / (time.perf_counter() - t0)


def measure(name: str, path: Path, args, work: Path, run: Run) -> list[dict]:
    import cflow

    cflow_compile(path, None, work / "stored.vflow")
    records = []
    for n in args.threads:
        ms = {a: cflow.load(str(work / "stored.vflow"), threads=n, max_seq=args.prompt + args.tokens + 16,
                            activations=a) for a in FORMATS}
        ids = ms["q8"].tokenizer.encode(TEXT.read_text(encoding="utf-8"))[: args.prompt]
        short = ids[:8]
        for m in ms.values():  # page in, warm the code
            time_decode(m, short, 4, reps=1)
            prefill_tok_s(m, ids[:64])
        samples = {(k, a): [] for k in ("decode", "prefill") for a in FORMATS}
        figures = {"decode": lambda m, short=short: time_decode(m, short, args.tokens, reps=1),
                   "prefill": lambda m, ids=ids: prefill_tok_s(m, ids)}
        load0 = os.getloadavg()
        for r in range(args.rounds):
            order = FORMATS if r % 2 == 0 else FORMATS[::-1]
            for kind, fn in figures.items():
                for a in order:
                    samples[kind, a].append(busy_fraction(lambda fn=fn, m=ms[a]: fn(m)))
        load1 = os.getloadavg()
        for m in ms.values():
            m.close()
        print(f"\n{name}, {n} thread(s), {args.rounds} rounds, load average {load0[0]:.1f} -> {load1[0]:.1f}")
        for kind in ("decode", "prefill"):
            vals = {a: np.array([v for v, _ in samples[kind, a]]) for a in FORMATS}
            ratio = float(np.median(vals["q8x2"] / vals["q8"]))
            busy = max(b for a in FORMATS for _, b in samples[kind, a])
            what = f"decode ({args.tokens} tokens)" if kind == "decode" else f"prompt {len(ids)}"
            print(f"  {what:22s} q8 {vals['q8'].max():8.1f} tok/s   q8x2 {vals['q8x2'].max():8.1f} tok/s   "
                  f"best/best {vals['q8x2'].max() / vals['q8'].max():.3f}   median ratio {ratio:.3f}   "
                  f"(other load up to {busy:.0%})")
            for a in FORMATS:
                records.append(run.record(
                    engine="cflow", model=name, quant="stored", threads=n, variant=f"{what}, activations {a}",
                    tok_s=float(vals[a].max()), activations=a, samples=vals[a].tolist(),
                    other_load=[b for _, b in samples[kind, a]], median_ratio_q8x2_over_q8=ratio,
                    loadavg=[load0[0], load1[0]]))
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gemma3-270m,smollm2-135m", help="comma list of conformance MODELS or DERIVED")
    p.add_argument("--threads", default="1,2", help="comma list of thread counts (default 1,2)")
    p.add_argument("--rounds", type=int, default=5, help="rounds per thread count (default 5)")
    p.add_argument("--tokens", type=int, default=64, help="decoded tokens per sample (default 64)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens of the prefill sample (default 512)")
    p.add_argument("--cache", default=None, help="where the models live (default $CFLOW_MODELS)")
    add_json_argument(p, "one record per model, thread count, figure and activation format")
    args = p.parse_args(argv)
    args.threads = [int(t) for t in args.threads.split(",") if t]
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS and n not in DERIVED]
    if unknown:
        p.error(f"--models: unknown {', '.join(unknown)} (known: {', '.join([*MODELS, *DERIVED])})")
    run = Run("act_cost", argv)
    cache = cache_dir(args.cache)
    records = []
    for name in names:
        path = fetch(name, cache) if name in MODELS else derive(name, cache)
        with tempfile.TemporaryDirectory(prefix="cflow-actc-") as work:
            records += measure(name, path, args, Path(work), run)
        run.write(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
