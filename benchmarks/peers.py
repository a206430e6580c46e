"""cflow against peers on identical weights: llama.cpp, ONNX Runtime GenAI int4 and PyTorch eager.

    python -m benchmarks.peers [--model tinyllama] [--threads 1,2] [--tokens 32] [--reps 3] [--quick]
                               [--no-llama] [--no-ortgenai] [--no-torch] [--no-bf16] [--no-q8] [--json [FILE]]
    python -m benchmarks.peers --gguf FILE                # a real GGUF: cflow on its own types against llama.cpp

Weights: the fixed random model of benchmarks/common/models.py (TinyLlama-1.1B geometry, seed 0), generated once
at f32 and shared by every engine:
  - cflow Q4 and Q8: compiled once to out/bench/<name>_{q4,q8}.vflow;
  - llama.cpp (llama-cpp-python) Q4_0 and Q8_0: the lowered Q4/Q8 graphs exported to GGUF
    (cflow.runtime.format.gguf; blocks copied bit-identically, Q/K rows permuted for llama.cpp's RoPE layout);
  - ONNX Runtime GenAI int4: the float weights saved as a Hugging Face Llama directory, built by
    onnxruntime_genai.models.builder (int4 MatMulNBits, block 32, accuracy level 4 = int8 activations);
    its own quantisation of the same float weights (f32 scales, symmetric);
  - PyTorch eager: the float weights in cflow's reference model (KV cache), at f32 and bf16.
Then, for each thread count: the machine's read bandwidth (llvmlite STREAM-like loop, same thread count) before
and after; each engine's greedy decode tok/s (best of reps over `tokens` steps after an 8-token prompt). Every
measurement carries the CPU share other processes used meanwhile (benchmarks/common/timing.py) and is repeated,
up to --retries more times, while that share exceeds --max-load (10%); the least-loaded attempt is kept.
Effective GB/s = bytes per token x tok/s: cflow's m.bytes_per_token (llama.cpp streams the same blocks), the
built ONNX model's MatMulNBits weights + scales (+ zero points), torch's f32/bf16 matrices.
Correctness: llama.cpp's logits at the first prompt positions against cflow's on the same ids, at Q4 and Q8;
greedy-token agreement over --agree-steps (128) steps, cflow Q4 vs llama.cpp Q4_0 (and vs ORT GenAI int4).
--f32-check adds the strict check: the same weights exported at F32, llama.cpp against cflow's NumPy interpreter.
--model moe (the Mixtral-like geometry): cflow and llama.cpp only, bytes per token of the routed experts.
--model moe2g (the same shape of model at 2.26 GB at Q4, 3.84 G parameters): its weights are LazyWeights,
generated per tensor on access, so the compiles and GGUF exports hold one tensor at a time (15.4 GB if at f32);
--build-only writes the files and exits; the peak RSS of the setup (the builds) and of the run are printed and
recorded with the checks.
--json writes one record per engine, weight type and thread count (extra: other_load, attempts); the checks,
the prompt and the peak RSS go to the file's run-level extra.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import numpy as np

import cflow
from benchmarks.common import OUT
from benchmarks.common.bandwidth import read_gbs
from benchmarks.common.memory import peak_rss
from benchmarks.common.models import LAZY_MODELS, MODELS, compiled_model, model_weights
from benchmarks.common.peers import (
    gguf_file,
    llama_next,
    llama_open,
    llama_position_logits,
    llama_time_decode,
    ort_genai_forced,
    ort_genai_greedy,
    ort_genai_open,
    ort_genai_time_decode,
)
from benchmarks.common.record import Run, add_json_argument
from benchmarks.common.timing import measure_quiet, time_decode
from cflow.codegen.target import cpu_model, isa_path
from cflow.runtime.format.gguf import export_gguf

# --- checks against llama.cpp --------------------------------------------------------------------------------

def cflow_position_logits(m, ids: list[int]) -> np.ndarray:
    s = m.session
    s.reset()
    out = [np.array(s.prefill([int(ids[0])]), dtype=np.float32, copy=True)]
    for t in ids[1:]:
        out.append(np.array(s.step(int(t)), dtype=np.float32, copy=True))
    return np.stack(out)


def compare_logits(a: np.ndarray, b: np.ndarray) -> dict:
    """a: ours, b: llama.cpp's, both [positions, vocab]."""
    diff = np.abs(a - b)
    top_a, top_b = a.argmax(-1), b.argmax(-1)
    return {"positions": len(a), "max_abs_diff": float(diff.max()), "rms_diff": float(np.sqrt((diff ** 2).mean())),
            "max_abs_diff_per_pos": [round(float(d), 4) for d in diff.max(-1)],
            "logit_std": float(a.std()), "argmax_agree": int((top_a == top_b).sum()),
            "cflow_argmax": top_a.tolist(), "llama_argmax": top_b.tolist(),
            # where the argmax differs: how close our own top-2 were (a near-tie flips under tiny differences)
            "disagree_top2_margin": [round(float(np.diff(np.sort(a[i])[-2:])[0]), 4)
                                     for i in np.flatnonzero(top_a != top_b)]}


def cross_check(m, llm, ids: list[int]) -> dict:
    return compare_logits(cflow_position_logits(m, ids), llama_position_logits(llm, ids))


def describe_check(label: str, ck: dict) -> str:
    return (f"# {label} over {ck['positions']} positions: max |diff| {ck['max_abs_diff']:.4f}, "
            f"rms {ck['rms_diff']:.4f} "
            f"(logit std {ck['logit_std']:.3f}); argmax agrees at {ck['argmax_agree']}/{ck['positions']} positions; "
            f"max per position {ck['max_abs_diff_per_pos']}"
            + (f"; our top-2 margin where they differ: {ck['disagree_top2_margin']}"
               if ck["disagree_top2_margin"] else ""))


def f32_check(key: str, source: dict, ids: list[int], threads: int, rebuild: bool = False) -> dict:
    """The strict check of the export: the same weights at F32 (no weight or activation quantisation on either
    side), llama.cpp against cflow's NumPy interpreter. Remaining differences: llama.cpp's f16 KV cache and
    summation order. The F32 file is large (4 bytes per weight)."""
    from cflow.compiler import lower
    from cflow.ir import Interpreter, build_graph

    config = MODELS[key]
    if key in LAZY_MODELS:
        raise SystemExit(f"--f32-check: not for {key} (its F32 GGUF would be "
                         f"{source.nbytes() / 1e9:.1f} GB and the NumPy "
                         "interpreter regenerates every weight per step)")
    g = lower(build_graph(config, source, name=config.name), "f32").graph
    path = os.path.join(OUT, f"{config.name}_f32.gguf")
    if rebuild or not os.path.exists(path):
        info = export_gguf(g, path)
        print(f"# exported {path}: {info['file_bytes'] / 1e9:.2f} GB, {info['file_type']}, {info['seconds']:.1f} s",
              flush=True)
    it = Interpreter(g, cache_weights=False)
    ref = np.stack([it.step(int(t)) for t in ids])
    llm = llama_open(path, threads)
    got = llama_position_logits(llm, ids)
    del llm
    gc.collect()
    return compare_logits(ref, got)


def interp_check(m, c, ids: list[int]) -> dict:
    """cflow's runtime logits (one token per step) against the NumPy interpreter's on the same lowered Q4 graph
    (int8 activation emulation, cache_weights=False: each weight re-derived from the source when used, so a
    lazily generated model is held one tensor at a time), the interpreter running `ids` as one prefill."""
    from cflow.ir import Interpreter

    ref = Interpreter(c.graph, act_quant="q8", cache_weights=False).prefill(ids)
    return compare_logits(cflow_position_logits(m, ids), np.asarray(ref, dtype=np.float32))


# --- PyTorch eager -------------------------------------------------------------------------------

def torch_model(config, weights: dict):
    """cflow's PyTorch reference model holding `weights` (f32, shared with the NumPy arrays)."""
    import torch

    from cflow.models.reference import PipelineNativeLM

    with torch.device("meta"):
        model = PipelineNativeLM(config)
    sd = {f"{k}.weight": torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in weights.items()}
    model.load_state_dict(sd, strict=True, assign=True)
    return model.eval()


def peak_rss_mb() -> float:
    """This process's peak resident set so far (memory.peak_rss: VmHWM), in MB (10^6 B)."""
    return peak_rss() / 1e6


def torch_bytes_per_token(weights: dict) -> int:
    """f32 bytes streamed per token: every matrix but the embedding (one row), plus the norms."""
    total = 0
    for k, v in weights.items():
        total += v.shape[-1] * 4 if k == "tok_embeddings" else v.size * 4
    return total


def torch_time_decode(model, prompt: list[int], tokens: int, threads: int, reps: int = 2) -> float:
    import torch

    torch.set_num_threads(threads)
    best = 0.0
    with torch.inference_mode():
        for _ in range(reps):
            cache: list = []
            logits = model(torch.tensor(prompt), cache)[-1]
            t0 = time.perf_counter()
            for _ in range(tokens):
                logits = model(torch.tensor([int(logits.argmax())]), cache)[-1]
            best = max(best, tokens / (time.perf_counter() - t0))
    return best



# --- ONNX Runtime GenAI int4 ---------------------------------------------------------------------

def save_hf_llama(config, weights: dict, out_dir: str) -> str:
    """The same float weights as a Hugging Face LlamaForCausalLM directory (config.json + model.safetensors).
    HF Llama rotates halves like cflow, so wq/wk rows are copied unpermuted."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.d_model, intermediate_size=config.ffn_dim,
                     num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
                     num_key_value_heads=config.n_kv_heads, max_position_embeddings=config.max_seq_len,
                     rms_norm_eps=config.norm_eps, rope_theta=config.rope_theta, tie_word_embeddings=False,
                     bos_token_id=1, eos_token_id=2)
    names = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"}
    sub = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn.wq": "self_attn.q_proj",
           "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.o_proj",
           "ffn.w_gate": "mlp.gate_proj", "ffn.w_up": "mlp.up_proj", "ffn.w_down": "mlp.down_proj"}
    sd = {}
    for k, v in weights.items():
        if k in names:
            hk = names[k]
        else:
            _, i, rest = k.split(".", 2)
            hk = f"model.layers.{i}.{sub[rest]}"
        sd[f"{hk}.weight"] = torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32))
    with torch.device("meta"):
        model = LlamaForCausalLM(hf)
    model.load_state_dict(sd, strict=False, assign=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    # the builder saves a tokenizer too: a synthetic word-level vocabulary of vocab_size tokens (ids only)
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, config.vocab_size)}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                                  unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.save_pretrained(out_dir)
    return out_dir


def ort_genai_build(hf_dir: str, out_dir: str, block_size: int = 32, accuracy_level: int = 4) -> list[str]:
    """The model builder's command (0.18 option names: block_size, accuracy_level): int4 MatMulNBits weights,
    block 32, int8 activations (accuracy level 4)."""
    return [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", hf_dir, "-o", out_dir, "-p", "int4",
            "-e", "cpu", "--extra_options", f"block_size={block_size}", f"accuracy_level={accuracy_level}"]


def ort_genai_model_dir(config, weights: dict, rebuild: bool = False, root: str = OUT) -> str:
    """Save the float weights as a HF directory and run the builder on it, once per geometry (in `root`)."""
    import shutil
    import subprocess

    hf_dir = os.path.join(root, f"{config.name}_hf")
    out_dir = os.path.join(root, f"{config.name}_ortgenai_int4")
    if rebuild or not os.path.exists(os.path.join(out_dir, "genai_config.json")):
        t0 = time.perf_counter()
        shutil.rmtree(hf_dir, ignore_errors=True)
        save_hf_llama(config, weights, hf_dir)
        t1 = time.perf_counter()
        shutil.rmtree(out_dir, ignore_errors=True)
        r = subprocess.run(ort_genai_build(hf_dir, out_dir), capture_output=True, text=True)
        if r.returncode != 0 or not os.path.exists(os.path.join(out_dir, "genai_config.json")):
            raise RuntimeError(f"ONNX Runtime GenAI builder failed (rc {r.returncode}): {r.stderr[-2000:]}")
        shutil.rmtree(hf_dir, ignore_errors=True)  # the builder's output holds everything the run needs
        print(f"# built {out_dir} (int4, block 32, accuracy level 4): HF dir {t1 - t0:.1f} s, builder "
              f"{time.perf_counter() - t1:.1f} s", flush=True)
    return out_dir


_ONNX_BYTES = {1: 4, 2: 1, 3: 1, 10: 2, 11: 8, 16: 2, 6: 4, 7: 8}  # float, uint8, int8, float16, double, bf16, ...


def ort_genai_bytes_per_token(model_dir: str) -> dict:
    """Bytes of the built model's weights one decode step reads: every MatMulNBits node's packed int4 weight
    (B), its scales and zero points (if any), and every float MatMul/Gemm weight initializer, each once. Not
    counted (like cflow's figure): the embedding Gather (one row per token), norms and RoPE caches (small)."""
    import onnx

    m = onnx.load(os.path.join(model_dir, "model.onnx"), load_external_data=False)
    inits = {t.name: t for t in m.graph.initializer}

    def nbytes(name: str) -> int:
        t = inits.get(name)
        if t is None:
            return 0
        return int(np.prod(t.dims, dtype=np.int64)) * _ONNX_BYTES.get(t.data_type, 4)

    out = {"int4_weights": 0, "scales": 0, "zero_points": 0, "float_matmul_weights": 0, "matmulnbits_nodes": 0}
    for n in m.graph.node:
        if n.op_type == "MatMulNBits":
            out["matmulnbits_nodes"] += 1
            out["int4_weights"] += nbytes(n.input[1])
            out["scales"] += nbytes(n.input[2])
            if len(n.input) > 3 and n.input[3]:
                out["zero_points"] += nbytes(n.input[3])
        elif n.op_type in ("MatMul", "Gemm"):
            out["float_matmul_weights"] += sum(nbytes(x) for x in n.input)
    out["total"] = out["int4_weights"] + out["scales"] + out["zero_points"] + out["float_matmul_weights"]
    return out


# --- main ----------------------------------------------------------------------------------------

def active_bytes_per_token(graph, quant: str) -> int:
    """Bytes of the matrices one decode step reads when only the routed experts are read: every matrix but the
    embedding at `quant`'s block size (Q4_0 18 B / Q8_0 34 B per 32 weights), each expert bank scaled by
    top_k / n_experts (the expected share over tokens). Norms and routers are not counted (small)."""
    from cflow.ir.build import weight_shapes

    c = graph.config
    per = {"q4": 18 / 32, "q8": 34 / 32}[quant]
    total = 0.0
    for k, shape in weight_shapes(c).items():
        if len(shape) != 2 or k == "tok_embeddings" or k.endswith(".router"):
            continue
        n = float(np.prod(shape)) * per
        total += n * c.top_k / c.n_experts if ".experts." in k else n
    return int(total)


def greedy_agreement(m, llm, prompt: list[int], steps: int = 128) -> dict:
    """cflow's greedy tokens against llama.cpp's over `steps` steps after the same prompt: free-running (each
    runtime feeds its own tokens back: agreeing prefix, then positionwise agreement) and teacher-forced
    (llama.cpp fed cflow's tokens: its argmax against cflow's at every step). cflow's top-2 logit margin at
    each disagreement says whether it was a near-tie."""
    s = m.session
    s.reset()
    logits = s.prefill(prompt)
    ours, margins = [], []
    for _ in range(steps):
        top2 = np.sort(logits)[-2:]
        ours.append(int(np.argmax(logits)))
        margins.append(float(top2[1] - top2[0]))
        logits = s.step(ours[-1])
    llm.reset()
    llm.eval(prompt)
    theirs = []  # not common.peers.llama_greedy: this module's llama_next is the seam the tests replace
    for _ in range(steps):
        theirs.append(llama_next(llm))
        llm.eval([theirs[-1]])
    llm.reset()
    llm.eval(prompt)
    forced = []
    for t in ours:
        forced.append(llama_next(llm))
        llm.eval([t])
    prefix = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), steps)
    forced_off = [i for i in range(steps) if ours[i] != forced[i]]
    return {"steps": steps, "prefix_agree": prefix, "total_agree": sum(a == b for a, b in zip(ours, theirs)),
            "margin_at_divergence": None if prefix == steps else round(margins[prefix], 4),
            "forced_agree": steps - len(forced_off),
            "forced_disagree_margins": [round(margins[i], 4) for i in forced_off],
            "median_margin": round(float(np.median(margins)), 4), "cflow_tokens": ours, "llama_tokens": theirs,
            "cflow_margins": [round(x, 4) for x in margins]}


def describe_agreement(label: str, a: dict) -> str:
    div = ("no divergence" if a["margin_at_divergence"] is None
           else f"cflow's top-2 margin at the first divergence {a['margin_at_divergence']}")
    return (f"# {label}, {a['steps']} greedy steps: {a['prefix_agree']} equal before the first divergence, "
            f"{a['total_agree']}/{a['steps']} equal positionwise ({div}); the peer teacher-forced on cflow's tokens: "
            f"{a['forced_agree']}/{a['steps']} argmax equal"
            + (f", cflow's margins where not: {a['forced_disagree_margins']}" if a["forced_disagree_margins"] else "")
            + f" (median margin {a['median_margin']})")


def run_gguf(args, run: Run) -> None:
    """--gguf FILE: cflow on the file's own types (cflowc FILE) against llama.cpp on the same file, per thread count:
    the read bandwidth, each engine's greedy decode tok/s (best of reps, quiet attempts), bytes per token (cflow's:
    the same blocks llama.cpp streams) and the fraction of the read bandwidth that makes."""
    import tempfile

    from cflow.compiler import compile_file
    from cflow.frontend.load import load_graph
    from cflow.passes.quantize import STORED, fit_tile

    g = load_graph(args.gguf)
    work = tempfile.mkdtemp(prefix="cflow-peers-")
    path = os.path.join(work, "model.vflow")
    st = compile_file(g, path, STORED, fit_tile(g), tokenizer=g.meta.tokenizer)
    types = sorted({d.gguf_name for d in g.meta.weight_dtypes.values() if d.quantised} if g.meta.weight_dtypes else
                   {d.gguf_name for d in (g.meta.source_dtypes or {}).values() if d.quantised})
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, g.config.vocab_size, 8)]
    print(f"# {args.gguf}: {g.name}, types {'/'.join(types)}; compiled as stored: "
          f"{st.file['bytes_per_token'] / 1e6:.1f} MB per token; CPU {cpu_model()}, ISA path {isa_path()}",
          flush=True)
    quiet = dict(threshold=args.max_load, retries=args.retries)
    records = []
    for threads in (int(t) for t in args.threads.split(",")):
        bw, busy_bw, _ = measure_quiet(lambda threads=threads: read_gbs(threads, args.gib), **quiet)
        m = cflow.load(path, threads=threads)
        bpt = m.bytes_per_token
        tps, busy, n = measure_quiet(lambda m=m: time_decode(m, prompt, args.tokens, args.reps), **quiet)
        m.close()
        rows = [("cflow", tps, busy, n)]
        if not args.no_llama:
            llm = llama_open(args.gguf, threads, extra_bufts=False)
            ltps, lbusy, ln = measure_quiet(lambda llm=llm: llama_time_decode(llm, prompt, args.tokens, args.reps),
                                            **quiet)
            rows.append(("llama.cpp", ltps, lbusy, ln))
            del llm
        print(f"\n{threads} thread(s): read bandwidth {bw:.2f} GB/s (other load {busy_bw or 0:.0%})")
        print(f"{'engine':10} {'tok/s':>8} {'GB/s':>7} {'of read':>8}")
        for eng, t, b, attempts in rows:
            print(f"{eng:10} {t:8.2f} {t * bpt / 1e9:7.2f} {t * bpt / 1e9 / bw:8.1%}   (other load {b or 0:.0%})")
            records.append(run.record(engine=eng, model=os.path.basename(args.gguf), quant="/".join(types),
                                      threads=threads, tok_s=t, bytes_per_token=bpt, read_gbs=bw,
                                      other_load=round(b, 3), attempts=attempts, read_other_load=round(busy_bw, 3)))
        if len(rows) == 2:
            print(f"cflow / llama.cpp: {rows[0][1] / rows[1][1]:.2f}x")
    run.write(args.json, records)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None, metavar="FILE",
                    help="a real GGUF instead of --model: cflow on its own types against llama.cpp on the file")
    ap.add_argument("--model", default="tinyllama", choices=list(MODELS),
                    help="moe, moe2g: cflow and llama.cpp only (ORT GenAI's builder has no Mixtral; torch not timed)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--torch-tokens", type=int, default=8, help="greedy steps timed for PyTorch eager (f32 is slow)")
    ap.add_argument("--gib", type=float, default=1.0, help="read-bandwidth buffer")
    ap.add_argument("--check-positions", type=int, default=8, help="prompt positions compared with llama.cpp")
    ap.add_argument("--agree-steps", type=int, default=128, help="greedy steps compared with llama.cpp (0: skip)")
    ap.add_argument("--max-load", type=float, default=0.10,
                    help="repeat a measurement (up to --retries more times) while other processes used more CPU")
    ap.add_argument("--retries", type=int, default=2)
    ap.add_argument("--quick", action="store_true",
                    help="short runs (16 tokens, best of 2, torch 4 tokens, 0.5 GiB bandwidth buffer): under 10 "
                         "minutes on 2 cores once the model files exist")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-bf16", action="store_true", help="skip PyTorch eager bf16 (f32 only)")
    ap.add_argument("--no-ortgenai", action="store_true")
    ap.add_argument("--no-q8", action="store_true", help="skip cflow Q8 and llama.cpp Q8_0")
    ap.add_argument("--rebuild-gguf", action="store_true", help="export the GGUF file(s) again")
    ap.add_argument("--rebuild-ort", action="store_true", help="run the ONNX Runtime GenAI builder again")
    ap.add_argument("--f32-check", action="store_true",
                    help="also export the weights at F32 and compare llama.cpp with cflow's interpreter without any "
                         "quantisation (strict check of the export; the file is 4 B/weight, 4.4 GB for tinyllama)")
    add_json_argument(ap, "write one record per engine, weight type and thread count, the checks in the run's extra")
    ap.add_argument("--interp-check", action="store_true",
                    help="also compare cflow Q4's logits over --check-positions with the NumPy interpreter's on the "
                         "same Q4 weights (one prefill; minutes on the >= 2 GB geometry)")
    ap.add_argument("--build-only", action="store_true",
                    help="write the model files (cflow .vflow, GGUF) that do not exist yet, print the peak RSS, exit")
    args = ap.parse_args(argv)
    run = Run("peers", argv)
    if args.quick:
        args.tokens, args.reps, args.torch_tokens, args.gib = min(args.tokens, 16), min(args.reps, 2), \
            min(args.torch_tokens, 4), min(args.gib, 0.5)
    if args.gguf:
        run_gguf(args, run)
        return
    t_start = time.perf_counter()

    config = MODELS[args.model]
    t0 = time.perf_counter()
    weights = model_weights(args.model)
    if args.model in LAZY_MODELS:
        print(f"# random weights ({config.name}, seed 0): generated per tensor on access ({len(weights)} tensors, "
              f"{weights.nbytes() / 1e9:.1f} GB if at f32)", flush=True)
    else:
        print(f"# random weights ({config.name}, seed 0): {time.perf_counter() - t0:.1f} s", flush=True)
    quants = ["q4"] + ([] if args.no_q8 else ["q8"])
    plans = {q: compiled_model(args.model, q, weights) for q in quants}  # one set of weights for Q4 and Q8
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, config.vocab_size, 8)]
    check_ids = (prompt * (args.check_positions // len(prompt) + 1))[: args.check_positions]

    have_llama = not args.no_llama
    if have_llama:
        try:
            import llama_cpp
        except ImportError:
            print("# llama-cpp-python is not installed: pip install 'cflow[peers]' (skipping llama.cpp)", flush=True)
            have_llama = False
    gguf = {q: gguf_file(args.model, plans[q][1], args.rebuild_gguf, q) for q in quants} if have_llama else {}
    rss_build = peak_rss_mb()
    print(f"# peak RSS after the setup (weights, lowering, any compile / GGUF export): {rss_build:.0f} MB",
          flush=True)
    print(f"# CPU {cpu_model()}; cflow's ISA path {isa_path()}", flush=True)
    if args.build_only:
        return
    if have_llama:
        print(f"# llama-cpp-python {llama_cpp.__version__}; {llama_cpp.llama_print_system_info().decode().strip()}",
              flush=True)

    moe = bool(config.n_experts)
    if moe:
        print(f"# {config.name}: {config.n_experts} experts, top {config.top_k}; ONNX Runtime GenAI skipped (the 0.18 "
              "model builder has no MixtralForCausalLM), PyTorch eager skipped (dense reference timing only)",
              flush=True)
        args.no_ortgenai = args.no_torch = True
    ort_dir = ort_bpt = None
    if not args.no_ortgenai:
        try:
            import onnxruntime_genai as og

            ort_dir = ort_genai_model_dir(config, weights, args.rebuild_ort)
            ort_bpt = ort_genai_bytes_per_token(ort_dir)
            print(f"# onnxruntime-genai {og.__version__}: {ort_bpt['matmulnbits_nodes']} MatMulNBits, "
                  f"bytes per token {ort_bpt['total'] / 1e6:.1f} MB = int4 {ort_bpt['int4_weights'] / 1e6:.1f} + "
                  f"scales {ort_bpt['scales'] / 1e6:.1f} + zero points {ort_bpt['zero_points'] / 1e6:.1f} + float "
                  f"matmul weights {ort_bpt['float_matmul_weights'] / 1e6:.1f}", flush=True)
        except ImportError:
            print("# onnxruntime-genai is not installed: pip install 'cflow[peers]' (skipping ORT GenAI)", flush=True)

    tmodels = {}
    if not args.no_torch:
        try:
            import torch

            tmodels["f32"] = torch_model(config, weights)  # on the NumPy arrays, no copy
            if not args.no_bf16:
                tmodels["bf16"] = torch_model(config, weights).to(torch.bfloat16)  # a converted copy
            print(f"# torch {torch.__version__} eager, {'/'.join(tmodels)}, cflow's reference model with KV cache",
                  flush=True)
        except ImportError:
            print("# torch is not installed: skipping PyTorch eager", flush=True)
    tbytes = torch_bytes_per_token(weights) if tmodels else 0  # (on LazyWeights it would generate every tensor)

    meta = {"model": config.name, "prompt": prompt, "tokens": args.tokens, "reps": args.reps,
            "torch_tokens": args.torch_tokens, "max_load": args.max_load, "peak_rss_setup_mb": round(rss_build)}
    if args.f32_check and have_llama:
        meta["cross_check_f32"] = f32_check(args.model, weights, check_ids,
                                            max(int(t) for t in args.threads.split(",")), args.rebuild_gguf)
        print(describe_check("cross-check F32, llama.cpp vs cflow interpreter logits", meta["cross_check_f32"]),
              flush=True)
    if args.interp_check:
        t0 = time.perf_counter()
        m = cflow.load(plans["q4"][0], threads=max(int(t) for t in args.threads.split(",")))
        meta["interp_check_q4"] = interp_check(m, plans["q4"][1], check_ids)
        m.close()
        print(describe_check(f"interpreter check Q4, cflow runtime vs NumPy interpreter (int8 activations) logits "
                             f"[{time.perf_counter() - t0:.0f} s]", meta["interp_check_q4"]), flush=True)
    print(f"# setup {time.perf_counter() - t_start:.1f} s; cflow {run.commit}; CPU {run.cpu_model}", flush=True)

    records = []
    quiet = dict(threshold=args.max_load, retries=args.retries)
    for threads in (int(t) for t in args.threads.split(",")):
        t_thr = time.perf_counter()
        bw, busy_bw, _ = measure_quiet(lambda threads=threads: read_gbs(threads, args.gib), **quiet)
        rows = []  # (engine, quant, tok/s, bytes per token, other load, attempts)
        for q in quants:
            m = cflow.load(plans[q][0], threads=threads)
            print(f"# cflow {q} load, {threads} threads: {m.session.folios}", flush=True)
            tps, busy, n = measure_quiet(lambda m=m: time_decode(m, prompt, args.tokens, args.reps), **quiet)
            bpt = active_bytes_per_token(plans[q][1].graph, q) if moe else m.bytes_per_token
            if moe and threads == int(args.threads.split(",")[0]) and q == quants[0]:
                print(f"# MoE bytes per token: {bpt / 1e6:.1f} MB with top-{config.top_k} of {config.n_experts} "
                      f"experts (cflow's m.bytes_per_token: {m.bytes_per_token / 1e6:.1f} MB)", flush=True)
            rows.append(("cflow", q.upper(), tps, bpt, busy, n))
            if have_llama:
                llm = llama_open(gguf[q], threads)
                if f"cross_check_{q}" not in meta:
                    meta[f"cross_check_{q}"] = cross_check(m, llm, check_ids)
                    print(describe_check(f"cross-check {q.upper()}, llama.cpp vs cflow runtime logits",
                                         meta[f"cross_check_{q}"]), flush=True)
                if q == "q4" and args.agree_steps and "agreement_q4" not in meta:
                    meta["agreement_q4"] = greedy_agreement(m, llm, prompt, args.agree_steps)
                    print(describe_agreement("agreement cflow Q4 vs llama.cpp Q4_0", meta["agreement_q4"]), flush=True)
                tps, busy, n = measure_quiet(lambda llm=llm: llama_time_decode(llm, prompt, args.tokens, args.reps),
                                             **quiet)
                rows.append(("llama.cpp", f"{q.upper()}_0", tps, bpt, busy, n))
                del llm
                gc.collect()
            m.close()
        if ort_dir is not None:
            om = ort_genai_open(ort_dir, threads)
            if args.agree_steps and "agreement_ortgenai_int4" not in meta and "agreement_q4" in meta:
                a = meta["agreement_q4"]
                ours, margins = a["cflow_tokens"], a["cflow_margins"]
                theirs = ort_genai_greedy(om, prompt, len(ours))[1]
                forced = ort_genai_forced(om, prompt, ours)
                prefix = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), len(ours))
                off = [i for i in range(len(ours)) if ours[i] != forced[i]]
                meta["agreement_ortgenai_int4"] = ag = {
                    "steps": len(ours), "prefix_agree": prefix,
                    "total_agree": sum(x == y for x, y in zip(ours, theirs)),
                    "margin_at_divergence": None if prefix == len(ours) else margins[prefix],
                    "forced_agree": len(ours) - len(off), "forced_disagree_margins": [margins[i] for i in off],
                    "median_margin": a["median_margin"], "ort_tokens": theirs}
                print(describe_agreement("agreement cflow Q4 vs ORT GenAI int4 (its own block-32 quantisation of the "
                                         "float weights)", ag), flush=True)
            tps, busy, n = measure_quiet(lambda om=om: ort_genai_time_decode(om, prompt, args.tokens, args.reps),
                                         **quiet)
            rows.append(("ort-genai", "int4", tps, ort_bpt["total"], busy, n))
            del om
            gc.collect()
        for dt, tm in tmodels.items():
            tps, busy, n = measure_quiet(
                lambda tm=tm, threads=threads: torch_time_decode(tm, prompt, args.torch_tokens, threads), **quiet)
            rows.append(("torch-eager", dt, tps, tbytes // (2 if dt == "bf16" else 1), busy, n))
        bw_after, busy_bw2, _ = measure_quiet(lambda threads=threads: read_gbs(threads, args.gib), **quiet)
        read = max(bw, bw_after)  # the machine's best in this run: the honest denominator
        print(f"threads={threads}  read bandwidth {read:6.2f} GB/s (before {bw:.2f}, after {bw_after:.2f}; other load "
              f"{_pct(busy_bw)}, {_pct(busy_bw2)})   [{time.perf_counter() - t_thr:.0f} s]", flush=True)
        print(f"  {'engine':12s} {'quant':6s} {'tok/s':>8s} {'MB/token':>9s} {'GB/s':>7s} {'% read':>7s}  other-load",
              flush=True)
        for eng, q, t, b, busy, n in rows:
            eff = b * t / 1e9
            print(f"  {eng:12s} {q:6s} {t:8.2f} {b / 1e6:9.1f} {eff:7.2f} {100 * eff / read:6.1f}%  {_pct(busy)}"
                  + (f" ({n} attempts)" if n > 1 else ""), flush=True)
            records.append(run.record(engine=eng, model=config.name, quant=q, threads=threads, tok_s=round(t, 3),
                                      bytes_per_token=b, read_gbs=round(read, 3), other_load=round(busy, 3),
                                      attempts=n))
        by = {(eng, q): t for eng, q, t, *_ in rows}
        for a, b in ((("cflow", "Q4"), ("llama.cpp", "Q4_0")), (("cflow", "Q8"), ("llama.cpp", "Q8_0")),
                     (("cflow", "Q4"), ("ort-genai", "int4")), (("cflow", "Q4"), ("torch-eager", "f32")),
                     (("cflow", "Q4"), ("torch-eager", "bf16"))):
            if a in by and b in by:
                print(f"  {' '.join(a)} / {' '.join(b)} = {by[a] / by[b]:.2f}x", flush=True)
    meta["peak_rss_mb"] = round(peak_rss_mb())
    print(f"# total {time.perf_counter() - t_start:.0f} s; peak RSS {meta['peak_rss_mb']} MB (mapped model files "
          "count while resident)", flush=True)
    run.write(args.json, records, meta)


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


if __name__ == "__main__":
    main()
