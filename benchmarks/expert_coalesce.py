"""Expert reads coalesced or not: the adjacent ranges of a layer's misses read as one request (ExpertTier.coalesce).

    python -m benchmarks.expert_coalesce --json            # the wide geometry (.cflow) and the ~4 GB sibling (.vflow)
    python -m benchmarks.expert_coalesce --files a.vflow --rounds 9 --tokens 32

For each file, coalescing on and off alternate (the shared disk drifts from minute to minute); medians:
  reads   the tier alone, no compute, one load, the modes alternating round by round (seconds apart): per
          round, `--layers` layers of top_k experts of a random block (uniform routes, as these random-weight
          models route; each mode and round experts of its own) issued together, waited for, released and dropped
          (every expert a miss); GB/s of expert bytes and read requests per expert;
  decode  tok/s of a greedy decode with the experts on disk (async reads, route guesses on, a quarter of the
          experts cached), each run its own load and prompt, the modes alternating run by run.
A .cflow file stores an expert's ranges next to each other (a miss is one request instead of two or three), a
.vflow file each kind of matrix of a layer's experts together (only experts with adjacent ids merge).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from benchmarks.common.record import Run, add_json_argument

MODES = ("off", "expert", "layer")  # ExpertTier.coalesce


def default_files(out_dir: str) -> list[str]:
    from benchmarks.expert_tier import build

    files = [build("wide", 2, out_dir)]
    sibling = os.path.join(os.environ.get("CFLOW_MODELS") or os.path.expanduser("~/.cache/cflow/models"),
                           "bigmoe", "qwen3_moe_sibling_4g.vflow")
    if os.path.exists(sibling):
        files.append(sibling)
    return files


def reads(path: str, rounds: int, layers: int) -> dict[str, dict[str, list]]:
    """The tier alone, one load, coalescing on and off alternating round by round (seconds apart): per mode and
    round, GB/s and read requests per expert."""
    import cflow

    calls = [0]
    real = os.preadv

    def counting(fd, bufs, offset, *a):
        calls[0] += 1
        return real(fd, bufs, offset, *a)

    out: dict[str, dict[str, list]] = {mode: {} for mode in MODES}
    with cflow.load(path, threads=1, experts="disk", max_seq=16) as m:
        tier, cfg = m.session.tier, m.config
        blocks = sorted({k[0] for k in tier.layout})
        os.preadv = counting
        try:
            for r in range(rounds):
                for coalesce in (MODES if r % 2 == 0 else MODES[::-1]):
                    tier.coalesce = coalesce
                    # experts of their own: re-reading what another mode just read can come from a cache below
                    # the VM (on this host 4 MiB O_DIRECT re-reads came back 1.16-1.47x faster)
                    rng = np.random.default_rng(1000 * r + MODES.index(coalesce))
                    calls[0], b0, misses0, t0 = 0, tier.stats.bytes_read, tier.stats.misses, time.perf_counter()
                    for _ in range(layers):
                        b = int(rng.choice(blocks))
                        chosen = rng.choice(cfg.n_experts, cfg.top_k, replace=False)
                        tier.issue(b, chosen)
                        tier.wait(b, chosen)
                        tier.release(b, chosen)
                        for e in chosen:  # dropped at once: every expert of every round is a miss
                            tier._forget((b, int(e)))
                    dt = time.perf_counter() - t0
                    misses = tier.stats.misses - misses0
                    for k, v in (("gbs", (tier.stats.bytes_read - b0) / dt / 1e9),
                                 ("requests_per_expert", calls[0] / max(1, misses)), ("direct", tier.direct)):
                        out[coalesce].setdefault(k, []).append(v)
        finally:
            os.preadv = real
    return out


def decode(path: str, coalesce: str, tokens: int, threads: int, seed: int) -> dict:
    import cflow

    with cflow.load(path, threads=threads, experts="disk", max_seq=tokens + 16) as m:
        s = m.session
        s.tier.coalesce = coalesce
        # a prompt of its own (so its experts are not the ones the run before just read)
        logits = s.prefill([int(t) for t in np.random.default_rng(seed).integers(0, m.config.vocab_size, 4)])
        t0 = time.perf_counter()
        for _ in range(tokens):
            logits = s.step(int(np.argmax(logits)))
        dt = time.perf_counter() - t0
        return {"tok_s": tokens / dt, "hit_rate": m.expert_stats.hit_rate}


def main(argv=None) -> None:
    from cflow.codegen.target import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", default=None, help="comma-separated model files (default: the wide geometry at de 2, "
                    "compiled into --out-dir, and the ~4 GB sibling if built)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds per mode, alternating (default 7)")
    ap.add_argument("--layers", type=int, default=48, help="layers of reads per round (default 48)")
    ap.add_argument("--tokens", type=int, default=24, help="decode tokens per run; 0: no decode (default 24)")
    ap.add_argument("--threads", type=int, default=2, help="decode threads (default 2)")
    ap.add_argument("--out-dir", default=os.environ.get("CFLOW_BENCH_DIR", "/tmp/cflow-bench"))
    add_json_argument(ap, "write one record per file and mode")
    args = ap.parse_args(argv)
    run = Run("expert_coalesce", argv)
    os.makedirs(args.out_dir, exist_ok=True)
    files = args.files.split(",") if args.files else default_files(args.out_dir)
    print(f"# {cpu_model()}; {args.rounds} rounds per mode, alternating; reads: {args.layers} layers of uniform "
          f"routes per round; decode: {args.tokens} tokens, {args.threads} threads, a quarter of the experts cached")
    records = []
    for path in files:
        res = reads(path, args.rounds, args.layers)
        for r in range(args.rounds if args.tokens else 0):
            for coalesce in (MODES if r % 2 == 0 else MODES[::-1]):
                for k, v in decode(path, coalesce, args.tokens, args.threads, 1000 * r + MODES.index(coalesce)).items():
                    res[coalesce].setdefault(k, []).append(v)
        name = os.path.basename(path)
        for coalesce in MODES:
            x = res[coalesce]
            med = {k: statistics.median(v) for k, v in x.items() if k != "direct"}
            # each round's rate over the same round's "off" rate: the pairs share the disk's drift
            rel = statistics.median(a / b for a, b in zip(x["gbs"], res["off"]["gbs"]))
            print(f"{name:<36} coalesce {coalesce:<6}: reads {med['gbs']:.2f} GB/s, {rel:.3f}x off's in the same "
                  f"round ({' '.join(f'{g:.2f}' for g in x['gbs'])}), {med['requests_per_expert']:.2f} requests per "
                  "expert" + (f"; decode {med['tok_s']:.2f} tok/s ({' '.join(f'{t:.2f}' for t in x['tok_s'])})"
                              if "tok_s" in med else "") + ("" if all(x["direct"]) else "; buffered reads"), flush=True)
            records.append(run.record(engine="cflow", model=name, quant="q4", threads=args.threads,
                                      variant=f"coalesce {coalesce}", tok_s=med.get("tok_s"), read_gbs=med["gbs"],
                                      runs=x, reads_vs_off=rel,
                                      **{k: v for k, v in med.items() if k not in ("tok_s", "gbs")}))
    run.write(args.json, records)


if __name__ == "__main__":
    main()
