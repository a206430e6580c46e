"""Quality per bit: cflow's calibrated quantiser against llama.cpp's on the same source, scored by KL divergence.

    python -m benchmarks.quantization --quick [--json]

Per model (the bundled f32 model; the real GGUF stand-in, see below), from one source:

  base       the source's own function (cflow, f32 weights): `cflow perplexity --kl-divergence-base` on held-out
             text (the second half of benchmarks/data/tinystories_excerpt.txt; the first half calibrates)
  cflow      cflowc's calibrated quantiser (imatrix and input second moments collected on the calibration half,
             errors fed forward: passes/gptq.py): the type mix of --bpw 4.25 and --bpw 4.5; plain Q4_0 (--quant
             q4), calibrated Q4_0, and importance-weighted Q4_0 without the feedback (--no-gptq) for reference
  llama.cpp  llama_model_quantize on the source GGUF: Q4_K_M, IQ4_XS, Q4_0; and Q4_K_M with the importance
             matrix (ggml_quantize_chunk with it, tensor by tensor, on llama.cpp's own Q4_K_M type choice: what
             llama-quantize --imatrix does; its imatrix is cflow's, the same quantity llama-imatrix collects)

Every file is scored by `cflow perplexity FILE --kl-divergence` (llama.cpp's files run as stored, their bytes
untouched): perplexity, mean / 99th-percentile KLD, top-1 agreement; bits per weight over every matrix the file
stores; cflow's decode tok/s on it (best of 3), and llama.cpp's on its own Q4_K_M file. The last line compares the
largest real model's cflow mix at the lowest budget with llama.cpp's Q4_K_M with imatrix.

No real f16/bf16/f32 language model was found in a registry package (docs/quantization.md): the real model is
SmolLM2-135M's Q8_0 (conformance.py's derived file), its dequantised weights standing in for the float source.
The bundled model's architecture (a dense FFN and an expert bank per layer) has no llama.cpp counterpart. The float
source both quantisers can take is a small Llama trained here (benchmarks/reference_llama.py, its f32 GGUF; every
width a multiple of 256, so every K-quant applies): --reference DIR, by default $CFLOW_MODELS/tinyllama-ts when it
exists. Its line is printed before the last one (the largest real model's, as the issue asks).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from benchmarks.common import ROOT
from benchmarks.common.record import Run, add_json_argument
from benchmarks.quant_speed import llama_round

TEXT = Path(ROOT) / "benchmarks" / "data" / "tinystories_excerpt.txt"
BUNDLED = Path(ROOT) / "cflow" / "data" / "default"
BUDGETS = (4.25, 4.5)
LLAMA_TYPES = {"Q4_K_M": 15, "IQ4_XS": 30, "Q4_0": 2}  # llama.cpp's ftype ids


def texts() -> tuple[str, str]:
    """(calibration, held-out): the two halves of the excerpt, split at a line break."""
    t = TEXT.read_text(encoding="utf-8")
    cut = t.index("\n", len(t) // 2) + 1
    return t[:cut], t[cut:]


# --- cflow's side -------------------------------------------------------------------------------------------
def cflow_files(src: str, calib: str, work: Path, ctx: int, quick: bool, budgets=BUDGETS
                ) -> list[tuple[str, Path, dict]]:
    """The cflow variants of `src`: (label, file, extra) each, sharing one imatrix, one measurement, one probe."""
    from cflow.cli.calibrate import gram_budget
    from cflow.compiler import compile_file
    from cflow.frontend.load import load_graph
    from cflow.layout import DEFAULT_TILE
    from cflow.layout.quant import DType
    from cflow.passes import imatrix as I
    from cflow.passes import mix as M
    from cflow.passes.quantize import fit_tile
    from cflow.runtime.tokenizer import Tokenizer

    g = load_graph(src)
    tok = Tokenizer(g.meta.tokenizer, g.meta.eos_token_ids, g.meta.special_tokens)
    ids = tok.encode(calib, add_special=False)
    t0 = time.perf_counter()
    im = I.collect(g, ids, ctx, 8 if quick else None, tok.bos_id if tok.add_bos else None, "calibration half",
                   gram_bytes=gram_budget())
    I.write_dat(im, work / "imatrix.dat")
    weights = M.column_weights(g, im.values)
    curv = M.curvatures(im.grams)  # what cflowc --imatrix TEXT does by default (error feedback, passes/gptq.py)
    errors = M.measure(g, weights, sample_rows=64 if quick else 256, curv=curv)
    sens = M.sensitivities(g, weights, errors, ids[: 64 if quick else 128], curv=curv)
    calib_s = time.perf_counter() - t0
    print(f"  imatrix + measurement + probe: {calib_s:.0f} s", file=sys.stderr)
    out = []

    def emit(label, graph, quant, tile):
        tile = tile or fit_tile(graph)
        path = work / f"cflow-{label}.vflow"
        t = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # --quant q4 of a GGUF stand-in warns that it requantises its Q8_0
            compile_file(graph, path, quant, tile, tokenizer=graph.meta.tokenizer, eos=graph.meta.eos_token_ids)
        return path, time.perf_counter() - t

    for b in budgets:
        try:
            plan = M.plan_mix(g, M.predicted(errors, sens), b, "calibration half")
        except Exception as e:  # a budget no mix of this model meets: recorded, not fatal
            print(f"  --bpw {b}: {e}", file=sys.stderr)
            continue
        g2 = M.apply_types(g, plan.types, weights, plan.to_json(), curv)
        path, s = emit(f"bpw{b}", g2, "stored", fit_tile(g2))
        counts = {}
        for dt in plan.types.values():
            counts[dt.gguf_name] = counts.get(dt.gguf_name, 0) + 1
        out.append((f"cflow --bpw {b}", path, {"types": counts, "compile_s": s, "calibrate_s": calib_s}))
    path, s = emit("q4", g, "q4", DEFAULT_TILE)
    out.append(("cflow --quant q4", path, {"compile_s": s}))
    auto, _ = M.auto_mix(g, sample_rows=64 if quick else 256)  # cflowc --quant auto without a text
    path, s = emit("auto", auto, "stored", None)
    out.append(("cflow --quant auto (no text)", path, {"compile_s": s}))
    for label, cv in (("", curv), (" --no-gptq", None)):
        gw = M.apply_types(g, M.uniform(g, DType.Q4), weights, {"type": "Q4_0", "imatrix": "calibration half"}, cv)
        path, s = emit(f"q4-imatrix{label.replace(' ', '')}", gw, "stored", fit_tile(gw))
        out.append((f"cflow --quant q4 --imatrix{label}", path, {"compile_s": s}))
    return out, im


# --- llama.cpp's side ---------------------------------------------------------------------------------------
def llama_quantize(src: Path, dst: Path, ftype: int) -> Path:
    """llama_model_quantize (its per-tensor log goes to DST.log, not the console)."""
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.allow_requantize, p.nthread = ftype, True, 2
    sys.stderr.flush()
    saved = os.dup(2)
    with open(str(dst) + ".log", "wb") as log:
        os.dup2(log.fileno(), 2)
        try:
            rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), p)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize {src} -> ftype {ftype} failed (log: {dst}.log)")
    return dst


def _ggml():
    import llama_cpp

    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    return lib


def llama_with_imatrix(src: Path, typed: Path, dst: Path, im) -> Path:
    """`typed` (llama.cpp's quantisation of `src`) with every quantised tensor requantised from src's weights by
    ggml_quantize_chunk with the importance matrix: same types, same offsets, the bytes patched in place."""
    import gguf

    from cflow.passes.imatrix import gguf_name

    cols = {}
    for n, v in im.values.items():
        g, e = gguf_name(n)
        cols.setdefault(g, []).append((e or 0, v))
    imat = {g: np.concatenate([v for _, v in sorted(parts, key=lambda p: p[0])]) for g, parts in cols.items()}
    lib = _ggml()
    shutil.copyfile(typed, dst)
    source = {t.name: t for t in gguf.GGUFReader(src).tensors}
    with open(dst, "r+b") as f:
        for t in gguf.GGUFReader(typed).tensors:
            if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                continue
            s = source[t.name]
            x = np.ascontiguousarray(gguf.quants.dequantize(s.data, s.tensor_type), np.float32)
            rows, n = x.shape[0] if x.ndim == 2 else 1, x.shape[-1]
            tid = int(t.tensor_type)
            lib.ggml_quantize_init(tid)
            buf = np.zeros(rows * lib.ggml_row_size(tid, n), np.uint8)
            q = imat.get(t.name)
            q = None if q is None or q.size != n else np.ascontiguousarray(q, np.float32)
            lib.ggml_quantize_chunk(tid, x.ctypes.data, buf.ctypes.data, 0, rows, n,
                                    None if q is None else q.ctypes.data)
            if buf.size != t.n_bytes:
                raise SystemExit(f"{t.name}: {buf.size} bytes requantised, the file holds {t.n_bytes}")
            f.seek(t.data_offset)
            f.write(buf.tobytes())
    return dst


# --- scoring --------------------------------------------------------------------------------------------------
def perplexity(model, base: Path, threads: int, text: Path | None = None, ctx: int = 256) -> dict:
    """`cflow perplexity` as a user runs it: writes the base file (text given) or scores against it."""
    cmd = ["cflow", "perplexity", str(model)] + ([str(text), "-c", str(ctx)] if text is not None else [])
    cmd += ["--threads", str(threads), "--json", "--kl-divergence-base", str(base)]
    cmd += [] if text is not None else ["--kl-divergence"]
    argv = [sys.executable, "-c", "import sys; from cflow.cli import cflow_main; sys.exit(cflow_main())"] + cmd[1:]
    r = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    return {"command": " ".join(cmd), **json.loads(r.stdout.strip().splitlines()[-1])}


def file_bpw(path: Path) -> tuple[float, dict]:
    """Bits per weight over every matrix the file stores (its types and shapes), and the type counts."""
    from cflow.layout.quant import DType, matrix_bytes

    if str(path).endswith(".gguf"):
        import gguf

        bits = elems = 0
        counts = {}
        for t in gguf.GGUFReader(path).tensors:
            if len(t.shape) >= 2 and t.name != "rope_freqs.weight":
                bits += 8 * int(t.n_bytes)
                elems += int(t.n_elements)
                counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        return bits / elems, counts
    from cflow.runtime.format import FileReader

    with FileReader(str(path)) as r:
        h = r.header
    bits = elems = 0
    counts = {}
    for t in h["packing"].values():
        for shape, dt in zip(t["part_shapes"], t.get("part_dtypes") or [t["dtype"]] * len(t["part_shapes"])):
            if len(shape) == 2:
                d = DType.parse(dt) if isinstance(dt, str) else DType(dt)
                bits += 8 * matrix_bytes(shape[0], shape[1], d)
                elems += shape[0] * shape[1]
                counts[d.gguf_name] = counts.get(d.gguf_name, 0) + 1
    return bits / elems, counts


def cflow_decode_tok_s(path: Path, threads: int, tokens: int) -> float:
    import cflow
    from benchmarks.common.timing import time_decode

    with cflow.load(str(path), threads=threads) as m:
        return time_decode(m, [1, 2, 3, 4], tokens, reps=3)


def run_model(name: str, src: str, work: Path, args, llama: bool) -> list[dict]:
    calib, held = texts()
    (work / "held.txt").write_text(held, encoding="utf-8")
    print(f"{name}: source {src}", file=sys.stderr)
    rows = []
    base = work / "base.kld"
    ref = work / "f32.vflow"
    from cflow.compiler import compile_file
    from cflow.frontend.load import load_graph
    from cflow.layout import DEFAULT_TILE

    g = load_graph(src)
    ctx = min(256, g.config.max_seq_len)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # f32 requantises a GGUF stand-in's Q8_0: that is the point here
        compile_file(g, ref, "f32", DEFAULT_TILE, tokenizer=g.meta.tokenizer, eos=g.meta.eos_token_ids)
    b = perplexity(ref, base, args.threads, work / "held.txt", ctx)
    rows.append({"variant": "f32 (base)", "file": str(ref), **b})
    files, im = cflow_files(src, calib, work, ctx, args.quick, args.budgets)
    variants = [(label, path, extra) for label, path, extra in files]
    if llama:
        for label, ftype in LLAMA_TYPES.items():
            variants.append((f"llama.cpp {label}", llama_quantize(Path(src), work / f"llama-{label}.gguf", ftype), {}))
        imat = llama_with_imatrix(Path(src), work / "llama-Q4_K_M.gguf", work / "llama-Q4_K_M-imat.gguf", im)
        variants.append(("llama.cpp Q4_K_M --imatrix", imat, {}))
    for label, path, extra in variants:
        if path.suffix == ".gguf":  # cflowc's compile as stored: llama.cpp's bytes, tile by tile
            from benchmarks.conformance import cflow_compile

            extra = {**extra, "gguf": str(path)}
            cflow_compile(path, None, path.with_suffix(".vflow"))
            path = path.with_suffix(".vflow")
        r = perplexity(path, base, args.threads)
        bpw, counts = file_bpw(Path(extra.get("gguf", path)))
        tok_s = cflow_decode_tok_s(path, args.threads, args.tokens)
        rows.append({"variant": label, "file": str(path), "bpw": bpw, "types": counts, "cflow_tok_s": tok_s,
                     **extra, **r})
        print(f"  {label:<28} bpw {bpw:5.2f}  PPL {r['ppl']:8.3f}  KLD {r['kl_kld_mean']:.5f}  p99 "
              f"{r['kl_kld_p99']:.4f}  top-1 {100 * r['kl_same_top']:5.1f}%  cflow {tok_s:6.1f} tok/s", file=sys.stderr)
    if llama:
        rows.append({"variant": "llama.cpp decode on its Q4_K_M", "file": str(work / "llama-Q4_K_M.gguf"),
                     "llama_tok_s": llama_round(str(work / "llama-Q4_K_M.gguf"), args.threads, args.tokens)["tok_s"]})
    for r in rows:
        r["model"] = name
    return rows


def summary_line(rows: list[dict]) -> str | None:
    mixes = [r for r in rows if r["variant"].startswith("cflow --bpw")]
    ref = next((r for r in rows if r["variant"] == "llama.cpp Q4_K_M --imatrix"), None)
    if not mixes or ref is None:
        return None
    c = min(mixes, key=lambda r: r["bpw"])
    return (f"cflow {c['bpw']:.2f} bpw KLD {c['kl_kld_mean']:.4g} vs llama.cpp Q4_K_M KLD {ref['kl_kld_mean']:.4g} "
            f"= {c['kl_kld_mean'] / ref['kl_kld_mean']:.2f}x")


def reference_source(arg: str | None, cache: Path) -> Path | None:
    """The trained reference's f32 GGUF (benchmarks/reference_llama.py), or None (asked for none, or not made)."""
    if arg == "none":
        return None
    d = Path(arg) if arg else cache / "tinyllama-ts"
    f = d / "model-f32.gguf"
    if not f.exists():
        if arg:
            raise SystemExit(f"--reference {arg}: no model-f32.gguf (make it: python -m benchmarks.reference_llama "
                             f"--out {arg})")
        print(f"no reference model in {d} (python -m benchmarks.reference_llama --out {d}): skipped",
              file=sys.stderr)
        return None
    return f


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quantization", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="8 calibration chunks, a 64-token probe, errors on 64 rows "
                   "per matrix (default: every chunk, 128 tokens, 256 rows)")
    p.add_argument("--budgets", type=lambda t: tuple(float(v) for v in t.split(",")), default=BUDGETS,
                   metavar="B1,B2", help="cflow's --bpw budgets (default 4.25,4.5)")
    p.add_argument("--threads", type=int, default=2, help="threads for every engine (default 2)")
    p.add_argument("--tokens", type=int, default=32, help="decode tokens timed per file (default 32)")
    p.add_argument("--cache", default=None, help="where downloaded models live (default $CFLOW_MODELS or "
                   "~/.cache/cflow/models)")
    p.add_argument("--no-real", action="store_true", help="the bundled model only (default: and the real one)")
    p.add_argument("--reference", default=None, metavar="DIR",
                   help="benchmarks/reference_llama.py's output directory, or 'none' (default: "
                   "$CFLOW_MODELS/tinyllama-ts when it exists)")
    add_json_argument(p, "write one record per model and variant")
    args = p.parse_args(argv)
    run = Run("quantization", argv)
    work = Path(tempfile.mkdtemp(prefix="cflow-quant-"))
    rows = []
    try:
        d = work / "bundled"
        d.mkdir()
        rows += run_model("bundled (f32)", str(BUNDLED), d, args, llama=False)
        if not args.no_real:
            from benchmarks.conformance import cache_dir, derive

            ref = reference_source(args.reference, cache_dir(args.cache))
            if ref is not None:
                d = work / "reference"
                d.mkdir()
                rows += run_model("tinyllama-ts (f32, trained here)", str(ref), d, args, llama=True)

            src = derive("smollm2-135m.Q8_0", cache_dir(args.cache))  # llama.cpp's log, the first time only
            d = work / "smollm2"
            d.mkdir()
            rows += run_model("smollm2-135m (Q8_0 stand-in)", str(src), d, args, llama=True)
    finally:
        records = [run.record(engine="llama.cpp" if r["variant"].startswith("llama") else "cflow", model=r["model"],
                              quant=r["variant"], threads=args.threads, variant=None,
                              tok_s=r.get("cflow_tok_s") or r.get("llama_tok_s"),
                              **{k: v for k, v in r.items() if k not in ("model", "variant")}) for r in rows]
        written = run.write(args.json, records) if records else None
        if written:
            print(f"wrote {written}", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)
    ref_line = summary_line([r for r in rows if r["model"].startswith("tinyllama")])
    if ref_line:
        print(f"float source (trained here): {ref_line}")
    line = summary_line([r for r in rows if r["model"].startswith("smollm2")]) or summary_line(rows)
    print(line or "no cflow mix and llama.cpp Q4_K_M --imatrix pair to compare")
    return 0


if __name__ == "__main__":
    sys.exit(main())
