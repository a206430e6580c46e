"""Decode at long contexts: tok/s after a prompt of P tokens, against (weight + KV bytes read) / read bandwidth.

    python -m benchmarks.long_context                     # contexts 16,1024,2048,4064; f32 and f16 KV; 1,2 threads
    python -m benchmarks.long_context --quick             # contexts 16,4064; 2 threads
    python -m benchmarks.long_context --json

TinyLlama-1.1B geometry (benchmarks/common/models.py's random weights) with a 4096-token context, Q4. For each
KV cache type, thread count and context P: prefill P random tokens (the multi-token path), then time --tokens
greedy decode steps; the bytes one step reads (a record's bytes_per_token) are the weights plus the K and V rows
of every layer up to its position (2 x layers x kv_heads x head_dim x positions x 2 or 4 bytes, averaged over the
timed steps). The bound is those bytes at the read bandwidth measured in the same run at the same thread count
(best of a measurement before and after), and each record has the fraction of it reached.

Quality of the f16 cache: random weights amplify any rounding (the largest logit difference to the f32 cache is
printed, but a random network's logits move as much from int8 activation rounding alone), so --text FILE also
measures what matters on a trained model: the bundled TinyStories model's perplexity over FILE's text in
full-context windows, teacher-forced token by token, with each cache type and each weight type.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

import cflow
from benchmarks.common.bandwidth import read_gbs
from benchmarks.common.models import compiled_model
from benchmarks.common.record import Run, add_json_argument
from benchmarks.common.timing import time_decode
from cflow.codegen.abi import KV_BYTES
from cflow.codegen.attn_tune import host_unit
from cflow.codegen.target import cpu_model, host_target


def kv_bytes_read(cfg, first_pos: int, steps: int, kv: str) -> float:
    """K and V bytes one decode step reads, averaged over positions first_pos .. first_pos + steps - 1."""
    row = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * KV_BYTES[kv]
    return row * (first_pos + (steps + 1) / 2)  # a step at position p reads p + 1 rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="16,1024,2048,4064", help="prompt lengths before the timed steps")
    ap.add_argument("--kv", default="f32,f16", help="KV cache types (default f32,f16)")
    ap.add_argument("--threads", default="1,2", help="thread counts (default 1,2)")
    ap.add_argument("--tokens", type=int, default=32, help="timed decode steps (default 32)")
    ap.add_argument("--reps", type=int, default=2, help="repetitions, best kept (default 2)")
    ap.add_argument("--gib", type=float, default=1.0, help="read-bandwidth buffer (GiB)")
    ap.add_argument("--quick", action="store_true", help="contexts 16,4064, 2 threads, one rep")
    ap.add_argument("--text", help="also the bundled model's perplexity over this text, f32 vs f16 KV cache")
    ap.add_argument("--windows", type=int, default=16, help="context windows of --text evaluated (default 16)")
    add_json_argument(ap, "write one record per thread count, cache type and context")
    args = ap.parse_args(argv)
    run = Run("long_context", argv)
    if args.quick:
        args.contexts, args.threads, args.reps = "16,4064", "2", 1
    path, c = compiled_model("tinyllama_4k")
    cfg = c.graph.config
    contexts = [int(x) for x in args.contexts.split(",")]
    if max(contexts) + args.tokens > cfg.max_seq_len:
        raise SystemExit(f"--contexts {max(contexts)} + --tokens {args.tokens} exceed the "
                         f"{cfg.max_seq_len}-token context")
    rng = np.random.default_rng(1)
    prompts = {p: [int(t) for t in rng.integers(0, cfg.vocab_size, p)] for p in contexts}
    print(f"# {cpu_model()}; {cfg.name}, q4, context {cfg.max_seq_len}", flush=True)
    records, first_logits = [], {}
    for threads in (int(t) for t in args.threads.split(",")):
        bw = read_gbs(threads, args.gib)
        rows = []
        for kv in args.kv.split(","):
            with cflow.load(path, threads=threads, kv=kv) as m:
                weights = m.bytes_per_token
                # what the bf16 core's dot products ran on (amx, dpbf16 or the emulation; '' for f16 / f32)
                unit = host_unit((cfg.n_heads, cfg.n_kv_heads, cfg.head_dim), kv, host_target(), m.session.max_seq)
                for p in contexts:
                    logits = []
                    tps = time_decode(m, prompts[p], args.tokens, args.reps, prompt_logits=logits)
                    first_logits.setdefault((kv, p), logits[0])
                    rows.append((kv, p, tps, weights + kv_bytes_read(cfg, p, args.tokens, kv), unit))
        read = max(bw, read_gbs(threads, args.gib))
        print(f"## {threads} thread(s): read bandwidth {read:.2f} GB/s; weights {weights / 1e6:.0f} MB per token",
              flush=True)
        for kv, p, tps, nbytes, unit in rows:
            bound = read * 1e9 / nbytes
            records.append(run.record(engine="cflow", model=cfg.name, quant="q4", threads=threads,
                                      variant=f"kv {kv} context {p}", tok_s=round(tps, 3), bytes_per_token=nbytes,
                                      read_gbs=round(read, 3), kv=kv, bf16_unit=unit, context=p,
                                      weight_bytes_per_token=weights, bound_tok_s=round(bound, 3),
                                      fraction=round(tps / bound, 4)))
            label = kv + (f"/{unit}" if unit else "")
            print(f"   kv {label}  context {p:5d}: {tps:7.2f} tok/s, {nbytes / 1e6:7.1f} MB/token read -> bound "
                  f"{bound:6.2f} tok/s: {100 * tps / bound:5.1f}%", flush=True)
    quality = {}  # {kv: {context: ...}} against the f32 cache, for every other type measured
    for kv in (k for k in args.kv.split(",") if k != "f32"):
        for p in contexts:
            if ("f32", p) in first_logits:
                d = float(np.abs(first_logits[kv, p] - first_logits["f32", p]).max())
                same = int(np.argmax(first_logits[kv, p])) == int(np.argmax(first_logits["f32", p]))
                quality.setdefault(kv, {})[p] = {"max_abs_logit_diff": round(d, 5), "same_argmax": same}
                print(f"# {kv} vs f32 KV after {p} tokens: max |logit diff| {d:.4f}, same argmax: {same}")
    ppl = perplexities(args.text, args.windows, args.kv.split(",")) if args.text else {}
    run.write(args.json, records, {"vs_f32": quality, "perplexity": ppl})


def perplexities(text_path: str, windows: int, kvs: list[str]) -> dict:
    """{quant: {kv: perplexity}} of the bundled model over `windows` full-context windows of the text."""
    import tempfile

    from cflow.compiler import compile_file
    from cflow.frontend.load import load_graph
    from cflow.models.bundled import default_model_dir
    from cflow.runtime.tokenizer import Tokenizer

    src = default_model_dir()
    tok = Tokenizer((src / "tokenizer.json").read_text(encoding="utf-8"))
    with open(text_path, encoding="utf-8") as f:
        ids = tok.encode(f.read())
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for quant in ("q8", "q4"):
            path = os.path.join(d, f"bundled_{quant}.vflow")
            compile_file(load_graph(str(src)), path, quant)
            out[quant] = {}
            for kv in kvs:
                with cflow.load(path, threads=1, kv=kv) as m:
                    S = m.session.max_seq
                    nll, n = 0.0, 0
                    for w in range(min(windows, len(ids) // S)):
                        seq = ids[w * S: (w + 1) * S]
                        m.session.reset()
                        logits = m.session.prefill(seq[:1])
                        for t in seq[1:]:
                            z = logits.astype(np.float64)
                            nll += float(np.log(np.exp(z - z.max()).sum()) + z.max() - z[t])
                            n += 1
                            logits = m.session.step(t)
                out[quant][kv] = round(float(np.exp(nll / n)), 4)
            print(f"# bundled model, {quant} weights, perplexity over {n} tokens: "
                  + ", ".join(f"kv {kv} {p:.4f}" for kv, p in out[quant].items()), flush=True)
    return out


if __name__ == "__main__":
    main()
