"""Where the top-1 gap to the exact function comes from: each rounding of cflow's stored-type compile, one at a time.

    python -m benchmarks.act_precision [--models gemma3-270m,smollm2-135m,...] [--chunks 4] [--ctx 512]
                                       [--variants NAME,...] [--json FILE]
    python -m benchmarks.act_precision --report FILE      # the table of a saved run

The conformance protocol (benchmarks/conformance.py: TinyStories, chunks of --ctx tokens, BOS first where the model
adds it, the second half scored, 1,020 tokens at 4 chunks of 512), the file's exact function as the referee (cflow's
`--quant f32` compile, f32 KV cache), and against it, each variant's mean KLD and top-1 agreement (llama.cpp's KLD
statistics, its 16-bit base rounding included, as the conformance table):

  runtime variants (the compiled file, the JIT kernels):
    shipped          `cflowc model.gguf`, kv auto (f16 for stored types): the conformance table's cflow column
    shipped-kv32     the same file, kv='f32'
    shipped-q8x2[-kv32]  the same file loaded with activations='q8x2' (two int8 planes for the 32-input types)
  interpreter variants (cflow/ir/interp.py on the same graph, the GGUF's weights dequantised, f32 arithmetic; the
  activation entering each quantised matrix rounded by the variant's rule, then times the dequantised weights:
  in exact arithmetic the kernels' integer block sums are this product):
    NAME[-kv16]      NAME the activation rounding (below); -kv16: K and V rounded to f16 when cached
    rounding rules:  none (f32), q8 (the kernels' int8 blocks of 32, f32 scale: quant.quantize_activation_q8),
                     q8x2 (q8, then the residual x - q8(x) quantised again with its own block scale: ~15 bits),
                     q8x2f (the residual on a fixed grid d/256, codes clipped to +-127: one int16 = 256 q1 + q2),
                     q16 (int16 blocks of 32: d = amax/32767)
    on some matrices:  RULE-only-ROLES (RULE on the named matrices, f32 on the rest), RULE-but-ROLES (f32 on the
                     named ones, RULE on the rest), RULE-on-ROLES (RULE on the named ones, q8 on the rest); ROLES
                     a +-list of head, qkv, wo, gate_up, down, legacy (every matrix of a 32-input block type:
                     Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL; the K-quants and IQ4_XS not)

The emulation is checked against what it emulates: `none` against the exact function (its own row: top-1 100%),
q8-kv16 against shipped, q8 against shipped-kv32 and q8x2f-on-legacy-kv16 against shipped-q8x2 (top-1 and KLD
between the two, printed and recorded as emulation_vs_*). Those agree as two draws of the same noise, not bit for
bit: a 1-ulp difference in an input moves an int8 code across a rounding boundary. So a rounding no kernel has
yet is measured without writing the kernel.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common.record import Run, add_json_argument
from benchmarks.conformance import DERIVED, MODELS, TEXT, cache_dir, cflow_compile, derive, fetch

ROLES = {"head": ("tok_embeddings", "lm_head"), "qkv": ("attn.wq", "attn.wk", "attn.wv"), "wo": ("attn.wo",),
         "gate_up": ("ffn.w_gate", "ffn.w_up"), "down": ("ffn.w_down",), "legacy": ("legacy",)}
DEFAULT_VARIANTS = ("shipped", "shipped-kv32", "shipped-q8x2", "q8-kv16", "q8", "none-kv16", "none", "q8x2", "q8x2f",
                    "q8x2f-kv16", "q16", "q16-kv16", *(f"q8-but-{r}" for r in ROLES if r != "legacy"), "q8x2f-on-qkv",
                    "q8x2f-on-qkv+down", "q8x2f-on-qkv+gate_up", "q8x2f-on-qkv+wo+gate_up+down", "q8x2f-on-legacy")


# each emulation and the runtime it emulates (compared as two draws of the same noise)
TWINS = {"q8-kv16": "shipped", "q8": "shipped-kv32", "q8x2f-on-legacy-kv16": "shipped-q8x2"}
TWINS |= {v: k for k, v in TWINS.items()}


# --- activation rounding rules: x f32 [..., n] -> the value the kernel's integer sums would represent ----------------
def _blocks(x: np.ndarray) -> tuple[np.ndarray, int]:
    n = x.shape[-1]
    pn = -(-n // 32) * 32
    if pn != n:
        x = np.concatenate([x, np.zeros(x.shape[:-1] + (pn - n,), np.float32)], axis=-1)
    return x.reshape(x.shape[:-1] + (pn // 32, 32)), n


def _unblocks(b: np.ndarray, n: int) -> np.ndarray:
    return b.reshape(b.shape[:-2] + (-1,))[..., :n].astype(np.float32)


def _round_half_away(x):
    from cflow.layout.quant import _round_half_away

    return _round_half_away(x)


def _quant_blocks(b: np.ndarray, levels: int) -> np.ndarray:
    """Blocks quantised symmetrically to +-levels with d = amax / levels (f32), round half away; values q * d."""
    d = np.abs(b).max(axis=-1, keepdims=True) / np.float32(levels)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    return _round_half_away(b * inv) * d


def q8(x: np.ndarray) -> np.ndarray:
    """Exactly the kernels' rounding (quant.quantize_activation_q8), as values."""
    from cflow.layout.quant import quantize_activation_q8

    q, d = quantize_activation_q8(x)
    return _unblocks(q.astype(np.float32) * d[..., None], x.shape[-1])


def q8x2(x: np.ndarray) -> np.ndarray:
    b, n = _blocks(np.asarray(x, np.float32))
    first = _quant_blocks(b, 127)
    return _unblocks(first + _quant_blocks((b - first).astype(np.float32), 127), n)


def q8x2f(x: np.ndarray) -> np.ndarray:
    """x ~ d * (q1 + q2 / 256), d = amax / 127, q2 = clip(round(256 (x/d - q1)), -127, 127): an int16 code
    256 q1 + q2 whose two bytes are each a signed int8 (two vpdpbusd, the sums combined as 256 s1 + s2)."""
    b, n = _blocks(np.asarray(x, np.float32))
    d = np.abs(b).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    t = b * inv
    q1 = _round_half_away(t)
    q2 = np.clip(_round_half_away((t - q1) * np.float32(256)), -127, 127)
    return _unblocks((q1 + q2 / np.float32(256)) * d, n)


def q16(x: np.ndarray) -> np.ndarray:
    b, n = _blocks(np.asarray(x, np.float32))
    return _unblocks(_quant_blocks(b, 32767), n)


RULES = {"none": None, "q8": q8, "q8x2": q8x2, "q8x2f": q8x2f, "q16": q16}


def parse_variant(name: str) -> tuple[str, dict]:
    """'shipped[-q8x2][-kv32]' -> ('runtime', {kv, activations}); anything else -> ('interp', {rule, kv, roles,
    other})."""
    if name in ("shipped", "shipped-kv32", "shipped-q8x2", "shipped-q8x2-kv32"):
        return "runtime", {"kv": "f32" if name.endswith("kv32") else "auto",
                           "activations": "q8x2" if "-q8x2" in name else "q8"}
    kv = "f32"
    if name.endswith("-kv16"):
        name, kv = name[: -len("-kv16")], "f16"
    roles, other = None, None
    for sep in ("-only-", "-but-", "-on-"):
        if sep in name:
            name, listed = name.split(sep)
            roles = []
            for role in listed.split("+"):
                if role not in ROLES:
                    raise SystemExit(f"unknown role {role!r} (known: {', '.join(ROLES)})")
                roles += ROLES[role]
            # -only-: the rule on the roles, f32 elsewhere; -but-: f32 on the roles, the rule elsewhere;
            # -on-: the rule on the roles, the kernels' q8 elsewhere
            other = {"-only-": "none", "-but-": "swap", "-on-": "q8"}[sep]
    if name not in RULES:
        raise SystemExit(f"unknown rounding {name!r} (known: {', '.join(RULES)})")
    rule = RULES[name]
    if other == "swap":
        rule, other = None, name
    return "interp", {"rule": rule, "kv": kv, "roles": None if roles is None else tuple(roles),
                      "other": RULES[other] if other else rule}


def make_interpreter(graph, rule, kv: str, roles, other):
    from cflow.ir.interp import Interpreter
    from cflow.ir.nodes import LMHead
    from cflow.layout.blocks import BlockTensor
    from cflow.layout.quant import DType, QTensor

    legacy = (DType.Q4, DType.Q8, DType.Q4_1, DType.Q5_0, DType.Q5_1, DType.IQ4_NL)  # the 32-input block types

    class Emulator(Interpreter):
        """The interpreter with the activation entering each quantised matrix rounded by `rule` on the matrices of
        `roles` (all: None) and by `other` on the rest (None: not rounded), the head skipped on the unscored half
        of a chunk."""

        skip_head = False

        def matvec(self, x, name, point=()):
            w = self.g.weight(name)
            if isinstance(w, (BlockTensor, QTensor)):
                hit = roles is None or any(name.endswith(r) for r in roles) or ("legacy" in roles and w.dtype in legacy)
                f = rule if hit else other
                if f is not None:
                    x = f(x)
            return (np.asarray(x, np.float32) @ self.weight(name).T).astype(np.float32)

        def _exec(self, n, v):
            if isinstance(n, LMHead) and self.skip_head:
                return np.zeros((len(v[n.inputs[0]]), 1), np.float32)
            return super()._exec(n, v)

    return Emulator(graph, kv=kv, max_seq_len=4096)


def interp_chunk_logits(em, ids, first: int) -> np.ndarray:
    """As cli.perplexity.chunk_logits: the first `first` tokens without the head, then the rest with it."""
    em.reset()
    em.skip_head = True
    em.run(ids[:first])
    em.skip_head = False
    out = np.zeros((len(ids), em.g.config.vocab_size), np.float32)
    out[first:] = em.run(ids[first:])
    return out


def run_model(name: str, path: Path, args, work: Path) -> dict:
    import cflow
    from cflow.cli.perplexity import chunk_logits
    from cflow.frontend.load import load_graph
    from cflow.runtime import perplexity as P

    text = TEXT.read_text(encoding="utf-8")
    exact_file = cflow_compile(path, "f32", work / "exact.vflow")
    me = cflow.load(str(work / "exact.vflow"), threads=args.threads, max_seq=args.ctx + 16, kv="f32")
    tokens = me.tokenizer.encode(text)  # equal to llama.cpp's ids on these files (conformance.md, first column)
    bos = me.tokenizer.bos_id if me.tokenizer.add_bos else None
    n_chunk = min(args.chunks, len(tokens) // args.ctx)
    chunks = list(P.chunk_inputs(tokens, args.ctx, n_chunk, bos))
    first = P.first_scored(args.ctx)
    t0 = time.perf_counter()
    exact = [chunk_logits(me.session, ids) for _, ids in chunks]
    me.close()
    print(f"[{name}] exact function ({exact_file['file_bytes'] / 1e6:.0f} MB) scored {n_chunk} chunks in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    base = [P.quantise_log_probs(e[first : args.ctx - 1]) for e in exact]

    def score(logs) -> dict:
        kld = P.KLDivergence()
        for (start, _), lg, b in zip(chunks, logs, base):
            kld.add(lg, tokens[start : start + args.ctx], b)
        s = kld.summary()
        ppl = P.Perplexity()
        for (start, _), lg in zip(chunks, logs):
            ppl.add(lg, tokens[start : start + args.ctx])
        s["ppl_own"] = ppl.ppl
        return s

    out: dict = {"model": name, "file": path.name, "chunks": n_chunk, "ctx": args.ctx, "variants": {}}
    exact_ppl = P.Perplexity()
    for (start, _), lg in zip(chunks, exact):
        exact_ppl.add(lg, tokens[start : start + args.ctx])
    out["exact_ppl"] = exact_ppl.ppl
    kept: dict = {}  # logits of the variants the interpreter is checked against
    stored = None
    graph = None
    for v in args.variants:
        kind, opt = parse_variant(v)
        t0 = time.perf_counter()
        if kind == "runtime":
            if stored is None:
                stored = cflow_compile(path, None, work / "stored.vflow")
            m = cflow.load(str(work / "stored.vflow"), threads=args.threads, max_seq=args.ctx + 16, kv=opt["kv"],
                           activations=opt["activations"])
            kvused = m.kv
            logs = [chunk_logits(m.session, ids) for _, ids in chunks]
            m.close()
        else:
            if graph is None:
                graph = load_graph(str(path))
            em = make_interpreter(graph, opt["rule"], opt["kv"], opt["roles"], opt["other"])
            kvused = opt["kv"]
            logs = [interp_chunk_logits(em, ids, first) for _, ids in chunks]
            del em
        s = score(logs)
        s["kv"] = kvused
        s["seconds"] = time.perf_counter() - t0
        if v in TWINS or v == "none":
            kept[v] = logs
        # the emulator against the runtime it emulates
        twin = TWINS.get(v)
        if twin in kept and v in kept:
            a, b = (kept[twin], kept[v]) if kind == "interp" else (kept[v], kept[twin])
            kld = P.KLDivergence()  # the runtime as the base
            for (start, _), lg, rt in zip(chunks, b, a):
                kld.add(lg, tokens[start : start + args.ctx], P.quantise_log_probs(rt[first : args.ctx - 1]))
            pair = "emulation_vs_" + (twin if kind == "interp" else v)
            s[pair + "_top1"], s[pair + "_kld"] = kld.summary()["same_top"], kld.summary()["kld_mean"]
        out["variants"][v] = s
        print(f"[{name}] {v:>14}: kv {kvused}, KLD {s['kld_mean']:.6f} +- {s['kld_err']:.6f}, top-1 "
              f"{100 * s['same_top']:.2f}% +- {100 * s['same_top_err']:.2f}, PPL {s['ppl_own']:.4f} "
              f"({s['seconds']:.0f} s)" + "".join(f", {k} {val:.4f}" for k, val in s.items()
                                                   if k.startswith("emulation")), file=sys.stderr)
    return out


def table(results: list[dict]) -> str:
    names = list(dict.fromkeys(v for r in results for v in r["variants"]))
    head = "| variant | " + " | ".join(f"{r['model']} KLD | {r['model']} top-1" for r in results) + " |"
    lines = [head, "|---|" + "---|---|" * len(results)]
    for v in names:
        cells = []
        for r in results:
            s = r["variants"].get(v)
            cells += ["" if s is None else f"{s['kld_mean']:.5f}",
                      "" if s is None else f"{100 * s['same_top']:.1f}% (±{100 * s['same_top_err']:.1f})"]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gemma3-270m,smollm2-135m",
                   help="comma list of conformance MODELS or DERIVED")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma list (module docstring)")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache", default=None)
    p.add_argument("--report", default=None, metavar="JSON", help="print the table of a saved run and exit")
    add_json_argument(p, "the per-variant statistics of each model")
    args = p.parse_args(argv)
    if args.report:
        doc = json.loads(Path(args.report).read_text())
        print(table([{**r["extra"], "model": r["model"]} for r in doc["records"]]))
        return 0
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [n for n in args.models.split(",") if n and n not in MODELS and n not in DERIVED]
    if unknown:
        p.error(f"--models: unknown {', '.join(unknown)} (known: {', '.join([*MODELS, *DERIVED])})")
    for v in args.variants:
        parse_variant(v)
    run = Run("act_precision", argv)
    cache = cache_dir(args.cache)
    results, records = [], []
    for name in [n for n in args.models.split(",") if n]:
        with tempfile.TemporaryDirectory(prefix="cflow-actp-") as work:
            path = fetch(name, cache) if name in MODELS else derive(name, cache)
            results.append(run_model(name, path, args, Path(work)))
        extra = {k: v for k, v in results[-1].items() if k != "model"}
        records.append(run.record(engine="cflow", model=name, quant="stored", threads=args.threads, **extra))
        run.write(args.json, records)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
