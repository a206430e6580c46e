"""Decode speed against the machine's read bandwidth, measured in the same run.

    python benchmarks/decode.py [--threads 1,2] [--tokens 32] [--json out.json] [--model tinyllama]

Model: TinyLlama-1.1B geometry (hidden 2048, 22 layers, 32/4 heads, FFN 5632, vocab 32000) with
fixed random weights (seed 0, std 0.02; LM head 0.2), compiled to Q4 (~0.6 GB streamed per token) once and kept
in out/bench/. For each thread count: the read bandwidth (STREAM-like llvmlite loop over 1 GiB, same
thread count), then cflow's greedy decode tok/s, bytes per token, effective GB/s and the fraction of
the read bandwidth. Before timing, the first 8 greedy tokens must equal the NumPy interpreter's on
the same Q4 weights (int8 activation emulation), compared while the reference's top-2 margin is clear.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Mapping

import attrs
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bandwidth import busy_fraction, measure_read_bandwidth  # noqa: E402

import cflow  # noqa: E402
from cflow.compiler import compile_file, lower  # noqa: E402
from cflow.errors import CflowError  # noqa: E402
from cflow.ir import Interpreter, build_graph  # noqa: E402
from cflow.ir.config import ModelConfig  # noqa: E402

MODELS = {
    "tinyllama": ModelConfig(name="tinyllama_geometry", vocab_size=32000, d_model=2048, n_layers=22, n_heads=32,
                             n_kv_heads=4, ffn_dim=5632, max_seq_len=2048),
    # a smaller stand-in for quick checks (still larger than the 48 MiB L3 at Q4)
    "small": ModelConfig(name="llama_small_geometry", vocab_size=32000, d_model=1024, n_layers=8, n_heads=16,
                         n_kv_heads=4, ffn_dim=2816, max_seq_len=512),
    # a Mixtral-like MoE (8 experts, top 2, every layer), small enough to run in minutes: 1.0 GB at Q4
    "moe": ModelConfig(name="moe_geometry", vocab_size=32000, d_model=1024, n_layers=16, n_heads=16, n_kv_heads=4,
                       n_experts=8, top_k=2, expert_dim=3584, max_seq_len=2048),
    # issue 10's Mixtral-like MoE at >= 2 GB at Q4 (8 experts of 3584, top 2, every layer; TinyLlama's d/heads):
    # 3.84 G parameters, 2.26 GB at Q4 (4.15 GB at Q8), 640 MB streamed per token at Q4 with 2 of 8 experts.
    # Its f32 weights would be 15.4 GB: they are generated per tensor on access (LazyWeights), never all at once.
    "moe2g": ModelConfig(name="moe2g_geometry", vocab_size=32000, d_model=2048, n_layers=20, n_heads=32,
                         n_kv_heads=4, n_experts=8, top_k=2, expert_dim=3584, max_seq_len=2048),
}
# TinyLlama's geometry with a 4096-token context (benchmarks/long_context.py; --context here)
MODELS["tinyllama_4k"] = attrs.evolve(MODELS["tinyllama"], name="tinyllama_geometry_4k", max_seq_len=4096)
LAZY_MODELS = {"moe2g"}  # geometries whose weights come from LazyWeights instead of random_weights
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "out", "bench")


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    from cflow.ir.build import weight_shapes

    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in weight_shapes(config).items():
        if len(shape) == 1:
            out[name] = np.ones(shape, np.float32) + np.float32(0.01) * rng.standard_normal(shape, dtype=np.float32)
        else:
            # std 0.02, but 0.2 for the head: logits then spread enough that the greedy check has margins
            std = np.float32(0.2 if name == "lm_head" else 0.02)
            out[name] = std * rng.standard_normal(shape, dtype=np.float32)
    return out


def _name_seed(name: str) -> int:
    """A stable 64-bit seed of a weight name (blake2b: the same in every process, unlike hash())."""
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "little")


class LazyWeights(Mapping):
    """Fixed random weights of `config`, each tensor generated when it is looked up (and not kept).

    Same names, shapes, dtype (f32) and distributions as random_weights (norms 1 + 0.01 N(0, 1), the LM head
    0.2 N(0, 1), every other matrix 0.02 N(0, 1)), but each tensor has its own generator seeded by
    (seed, blake2b of its name), so a tensor does not depend on the order or the others: a 3.8 G-parameter
    model is streamed one tensor at a time. Not the same values as random_weights (that one draws every
    tensor from one generator in order; the existing geometries keep it, their files and results depend on it).
    """

    def __init__(self, config: ModelConfig, seed: int = 0):
        from cflow.ir.build import weight_shapes

        self.config, self.seed = config, int(seed)
        self.shapes: dict[str, tuple[int, ...]] = weight_shapes(config)

    def __getitem__(self, name: str) -> np.ndarray:
        shape = self.shapes[name]  # KeyError for a name the model does not have
        rng = np.random.default_rng([self.seed, _name_seed(name)])
        if len(shape) == 1:
            return np.ones(shape, np.float32) + np.float32(0.01) * rng.standard_normal(shape, dtype=np.float32)
        std = np.float32(0.2 if name == "lm_head" else 0.02)
        out = rng.standard_normal(shape, dtype=np.float32)
        out *= std
        return out

    def __contains__(self, name) -> bool:  # Mapping's default would generate the tensor to find out
        return name in self.shapes

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def nbytes(self) -> int:
        """f32 bytes of all the tensors (were they materialised at once)."""
        return 4 * sum(int(np.prod(s)) for s in self.shapes.values())


def model_weights(key: str, seed: int = 0) -> Mapping:
    """The benchmark's fixed random weights of MODELS[key]: LazyWeights for LAZY_MODELS, else random_weights."""
    config = MODELS[key]
    return LazyWeights(config, seed) if key in LAZY_MODELS else random_weights(config, seed)


def compiled_model(key: str, quant: str = "q4"):
    """(path to the compiled file, lowered plan with the float source weights); builds the file once."""
    config = MODELS[key]
    path = os.path.join(OUT, f"{config.name}_{quant}.vflow")
    t0 = time.perf_counter()
    g = build_graph(config, model_weights(key), name=config.name)
    c = lower(g, quant)
    print(f"# random weights + lowering: {time.perf_counter() - t0:.1f} s", flush=True)
    if os.path.exists(path):  # built from another version of this config (e.g. a longer context): rebuild
        from cflow.runtime.format import FileReader

        with FileReader(path) as r:
            if r.header.get("config") != g.config.to_dict():
                os.remove(path)
    if not os.path.exists(path):
        os.makedirs(OUT, exist_ok=True)
        info = compile_file(g, path, quant).file
        print(f"# compiled {path}: {info['file_bytes'] / 1e9:.2f} GB in {info['seconds']:.1f} s", flush=True)
    return path, c


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


def time_decode(m, prompt, tokens: int, reps: int = 3, prompt_logits: list | None = None) -> float:
    """Best-of-reps decode tok/s over `tokens` greedy steps after the prompt (prompt_logits: a list that gets a
    copy of the first repetition's prompt logits, for callers that compare them)."""
    s = m.session
    best = 0.0
    for rep in range(reps):
        s.reset()
        logits = s.prefill(prompt)
        if prompt_logits is not None and rep == 0:
            prompt_logits.append(logits.copy())
        t0 = time.perf_counter()
        for _ in range(tokens):
            logits = s.step(int(np.argmax(logits)))
        best = max(best, tokens / (time.perf_counter() - t0))
    return best


def profile(path: str, threads: int, prompt, tokens: int) -> str:
    """Where the time goes: per-stage cycle stamps of a profiling build, grouped by what the stage does. Each
    stage's time (worker 0's stamps after consecutive barriers) is split into the threads' work (from the
    previous barrier's release, as worker 0 stamps it, to reaching this one; the mean over threads) and their
    wait (the rest): the wait for the slowest thread plus the barrier's own wake-up latency."""
    from cflow.runtime.session import Session

    s = Session(path, threads=threads, profile=True)
    logits = s.prefill(prompt)
    n = s.run_state.schedule.n_stages
    ticks, work = np.zeros(n), np.zeros(n)
    t0 = time.perf_counter()
    for _ in range(tokens):
        logits = s.step(int(np.argmax(logits)))
        ticks += np.diff(s.prof[0])
        # thread t reached stage i's barrier at prof[1 + t][i]; stage i began at worker 0's stamp prof[0][i]
        # (its release from barrier i - 1), stage 0 at the thread's own start, prof[1 + t][n]
        begin = np.repeat(s.prof[0:1, :n], s.threads, axis=0)
        begin[:, 0] = s.prof[1:, n]
        work += (s.prof[1:, :n] - begin).mean(axis=0)
    wall = (time.perf_counter() - t0) / tokens
    s.close()
    per_tick = wall / ticks.sum() * tokens  # seconds per cycle-counter tick, from the same run
    groups: dict[str, list] = {}
    for st, t, w in zip(s.run_state.schedule.stages, ticks, work):
        kinds = sorted({f"{x.op.split('.')[0]}/{x.phase}" for x in st if x.nbytes}) or ["no weights: " + ",".join(
            sorted({f"{x.op.split('.')[0]}/{x.phase}" for x in st}))]
        key = " + ".join(kinds)
        g = groups.setdefault(key, [0.0, 0, 0, 0.0])
        g[0] += t * per_tick / tokens
        g[1] += sum(x.nbytes for x in st)
        g[2] += 1
        g[3] += (t - w) * per_tick / tokens
    total_wait = sum(g[3] for g in groups.values())
    lines = [f"profile ({threads} threads, {tokens} tokens, {1e3 * wall:.2f} ms/token; stage times are cycle-counter "
             "stamps after each stage's barrier, scaled to the measured wall time; wait: the threads' mean time "
             f"at the stage's barrier, {100 * total_wait / wall:.1f}% of the token):",
             f"  {'stage kind':<44} {'stages':>6} {'ms/token':>9} {'share':>6} {'wait':>6} {'MB':>8} {'GB/s':>7}"
             f" {'w/o wait':>8}"]
    for k, (sec, nb, cnt, wt) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"  {k:<44} {cnt:>6} {1e3 * sec:9.3f} {100 * sec / wall:5.1f}% {100 * wt / sec:5.1f}% "
                     f"{nb / 1e6:8.1f} {(nb / sec / 1e9 if sec and nb else 0):7.2f} "
                     f"{(nb / (sec - wt) / 1e9 if sec > wt and nb else 0):8.2f}")
    return "\n".join(lines)


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
                     gib: float) -> list[dict]:
    """Each variant loaded once per thread count, then `rounds` rounds: the read bandwidth, then every variant's
    decode (best of 1 over `tokens` steps, the order rotated per round), each with the CPU share other processes
    used meanwhile. Medians per variant, and each variant's per-round ratio to the first."""
    from cflow.codegen.target import cpu_model

    records = []
    for threads in threads_list:
        models = {n: load_variant(path, n, threads) for n in names}
        for m in models.values():
            time_decode(m, prompt, 4, 1)  # warm: page cache, first-touch of buffers
        per = {n: [] for n in names}
        loads = {n: [] for n in names}
        reads = []
        for r in range(rounds):
            reads.append(measure_read_bandwidth(threads, int(gib * (1 << 30))))
            order = names[r % len(names):] + names[: r % len(names)]
            for n in order:
                tps, other = busy_fraction(lambda m=models[n]: time_decode(m, prompt, tokens, 1))
                per[n].append(tps)
                loads[n].append(other)
        read = float(np.median(reads))
        print(f"threads={threads}  read {read:6.2f} GB/s (median of {rounds}: "
              f"{', '.join(f'{x:.1f}' for x in reads)})  CPU {cpu_model()}", flush=True)
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
            records.append({"variant": n, "threads": threads, "tok_s": round(tps, 3), "tok_s_rounds": per[n],
                            "read_gbps": round(read, 3), "read_rounds": reads, "bytes_per_token": m.bytes_per_token,
                            "fraction": round(eff / read, 4),
                            "fraction_per_round": round(per_round, 4),
                            "ratio_to_first": round(float(np.median(ratios)), 4),
                            "other_load": round(max(loads[n]), 3), "kv": m.kv, "model": c.graph.config.name,
                            "cpu": cpu_model(), "isa": m.session.program.isa})
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
    ap.add_argument("--json", help="write one record per thread count")
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
                                   args.tokens, args.gib)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(records, f, indent=2)
        return
    records = []
    for threads in (int(t) for t in args.threads.split(",")):
        m = cflow.load(path, threads=threads)
        if not args.no_check and not records:
            print(f"# interpreter token check skipped for {args.model}: the NumPy interpreter would regenerate "
                  "every weight each step (benchmarks/peers.py checks it against llama.cpp instead)"
                  if args.model in LAZY_MODELS else f"# {check_tokens(m, c, prompt)}", flush=True)
        bw = measure_read_bandwidth(threads, int(args.gib * (1 << 30)))
        tps = time_decode(m, prompt, args.tokens, args.reps)
        bw_after = measure_read_bandwidth(threads, int(args.gib * (1 << 30)))
        read = max(bw, bw_after)  # the machine's best in this run: the honest denominator
        bpt = m.bytes_per_token
        eff = bpt * tps / 1e9
        rec = {"threads": threads, "read_gbps": round(read, 3), "bytes_per_token": bpt, "tok_s": round(tps, 3),
               "effective_gbps": round(eff, 3), "fraction": round(eff / read, 4), "model": c.graph.config.name,
               "quant": args.quant, "isa": m.session.program.isa}
        records.append(rec)
        print(f"threads={threads}  read {read:6.2f} GB/s | cflow {tps:6.2f} tok/s x {bpt / 1e6:7.1f} MB/token = "
              f"{eff:6.2f} GB/s = {100 * eff / read:5.1f}% of read bandwidth", flush=True)
        m.close()
        if args.profile:
            print(profile(path, threads, prompt, args.tokens), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=2)


if __name__ == "__main__":
    main()
