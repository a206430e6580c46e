"""cflow against peers on identical weights: llama.cpp (same Q4_0 bytes via GGUF) and PyTorch eager (f32).

    python benchmarks/peers.py [--model tinyllama] [--threads 1,2] [--tokens 32] [--reps 3]
                               [--no-torch] [--no-llama] [--json out.json]

Weights: benchmarks/decode.py's fixed random model (TinyLlama-1.1B geometry, seed 0), lowered to Q4 once.
The Q4 graph is exported to GGUF (cflow.runtime.format.gguf; Q4_0 blocks copied bit-identically, Q/K
rows permuted for llama.cpp's RoPE layout) into out/bench/ once. Then, for each thread count:
  - the machine's read bandwidth (llvmlite STREAM-like loop, same thread count), before and after;
  - cflow: greedy decode tok/s (decode.py's time_decode: best of reps over `tokens` steps);
  - llama.cpp (llama-cpp-python): the same greedy loop with single-token evals after the prompt;
  - PyTorch eager: the same weights at f32 in cflow's reference model (KV cache), greedy steps.
Effective GB/s = bytes per token x tok/s. cflow and llama.cpp stream the same Q4 bytes, so both use
cflow's `m.bytes_per_token`; torch streams the f32 matrices (its own bytes per token is printed).
Correctness: llama.cpp's logits at the first prompt positions against cflow's on the same ids (max abs
difference, argmax agreement). They differ a little: llama.cpp quantises activations to Q8_0 blocks with
fp16 scales and keeps an f16 KV cache; cflow keeps f32 activation scales and an f32 cache. --f32-check adds
the strict check: the same weights exported at F32, llama.cpp against cflow's NumPy interpreter.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bandwidth import measure_read_bandwidth  # noqa: E402
from decode import MODELS, OUT, compiled_model, random_weights, time_decode  # noqa: E402

import cflow  # noqa: E402
from cflow.runtime.format.gguf import export_gguf  # noqa: E402

try:  # optional: the share of CPU other processes used while measuring (bandwidth.py, if it has it)
    from bandwidth import busy_fraction  # noqa: E402
except ImportError:  # pragma: no cover
    busy_fraction = None


def measured(fn):
    """(fn(), share of CPU other processes used meanwhile or None)."""
    if busy_fraction is None:
        return fn(), None
    return busy_fraction(fn)


# --- llama.cpp -----------------------------------------------------------------------------------

def llama_open(path: str, threads: int):
    from llama_cpp import Llama

    return Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, logits_all=False,
                 verbose=False)


def llama_last_logits(llm) -> np.ndarray:
    """Logits of the last evaluated token (with logits_all=False, Llama.eval no longer fills llm.scores)."""
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float32, copy=True)


def _llama_next(llm) -> int:
    import llama_cpp

    return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))))


def llama_time_decode(llm, prompt: list[int], tokens: int, reps: int = 3) -> float:
    """Best-of-reps greedy decode tok/s: eval the prompt, then `tokens` single-token evals."""
    best = 0.0
    for _ in range(reps):
        llm.reset()
        llm.eval(prompt)
        t0 = time.perf_counter()
        for _ in range(tokens):
            llm.eval([_llama_next(llm)])
        best = max(best, tokens / (time.perf_counter() - t0))
    return best


def llama_position_logits(llm, ids: list[int]) -> np.ndarray:
    """Logits [len(ids), vocab] after each prefix, one token per eval (the decode path)."""
    llm.reset()
    out = []
    for t in ids:
        llm.eval([int(t)])
        out.append(llama_last_logits(llm))
    return np.stack(out)


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



# --- ONNX Runtime GenAI int4 (not yet run end to end; see docs/peers.md) ------------------------

def save_hf_llama(config, weights: dict, out_dir: str) -> str:
    """The same float weights as a Hugging Face LlamaForCausalLM directory (config.json + model.safetensors).
    HF Llama rotates halves like cflow, so wq/wk rows are copied unpermuted."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.d_model, intermediate_size=config.ffn_dim,
                     num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
                     num_key_value_heads=config.n_kv_heads, max_position_embeddings=config.max_seq_len,
                     rms_norm_eps=config.norm_eps, rope_theta=config.rope_theta, tie_word_embeddings=False)
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


def ort_genai_time_decode(model_dir: str, prompt: list[int], tokens: int, threads: int, reps: int = 3) -> float:
    """Best-of-reps greedy tok/s with the Generator API (threads via the config's session options)."""
    import onnxruntime_genai as og

    cfg = og.Config(model_dir)
    cfg.clear_providers()
    model = og.Model(cfg)
    best = 0.0
    for _ in range(reps):
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(prompt) + tokens + 1)
        gen = og.Generator(model, params)
        gen.append_tokens(prompt)
        t0 = time.perf_counter()
        for _ in range(tokens):
            gen.generate_next_token()
        best = max(best, tokens / (time.perf_counter() - t0))
    return best


def record(engine: str, geometry: str, quant: str, threads: int, tok_s: float, bpt: int, read: float,
           other_load) -> dict:
    """One --json record with the keys of issue 10, item 4."""
    return {"engine": engine, "geometry": geometry, "quant": quant, "threads": threads, "tok_s": round(tok_s, 3),
            "bytes_per_token": int(bpt), "read_gbps": round(read, 3),
            "other_load": None if other_load is None else round(other_load, 3)}


# --- main ----------------------------------------------------------------------------------------

def gguf_file(key: str, c, rebuild: bool = False, quant: str = "q4") -> str:
    """The GGUF export of lowered plan `c` (quantised as `quant`: q4 -> Q4_0, q8 -> Q8_0), written once."""
    path = os.path.join(OUT, f"{MODELS[key].name}_{quant}.gguf")
    if rebuild or not os.path.exists(path):
        info = export_gguf(c.graph, path)
        print(f"# exported {path}: {info['file_bytes'] / 1e9:.2f} GB, {info['tensors']} tensors, "
              f"{info['file_type']}, {info['seconds']:.1f} s", flush=True)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tinyllama", choices=list(MODELS))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--torch-tokens", type=int, default=8, help="greedy steps timed for PyTorch eager (f32 is slow)")
    ap.add_argument("--gib", type=float, default=1.0, help="read-bandwidth buffer")
    ap.add_argument("--check-positions", type=int, default=8, help="prompt positions compared with llama.cpp")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--rebuild-gguf", action="store_true", help="export the GGUF file(s) again")
    ap.add_argument("--f32-check", action="store_true",
                    help="also export the weights at F32 and compare llama.cpp with cflow's interpreter without any "
                         "quantisation (strict check of the export; the file is 4 B/weight, 4.4 GB for tinyllama)")
    ap.add_argument("--json", help="write the records and the cross-check")
    args = ap.parse_args(argv)

    path, c = compiled_model(args.model)
    config = c.graph.config
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, config.vocab_size, 8)]
    check_ids = (prompt * (args.check_positions // len(prompt) + 1))[: args.check_positions]
    have_llama = not args.no_llama
    if have_llama:
        try:
            import llama_cpp
        except ImportError:
            print("# llama-cpp-python is not installed: pip install 'cflow[peers]' (skipping llama.cpp)", flush=True)
            have_llama = False
    gguf_path = gguf_file(args.model, c, args.rebuild_gguf) if have_llama else None
    if have_llama:
        print(f"# llama-cpp-python {llama_cpp.__version__}; {llama_cpp.llama_print_system_info().decode().strip()}",
              flush=True)

    tweights = tmodel = None
    if not args.no_torch:
        try:
            import torch

            # the f32 source of the same Q4 weights (the lowered graph quantises it lazily; no second copy)
            tweights = getattr(c.graph.weights, "source", None) or random_weights(config)
            tmodel = torch_model(config, tweights)
            print(f"# torch {torch.__version__} eager, f32, cflow's reference model with KV cache", flush=True)
        except ImportError:
            print("# torch is not installed: skipping PyTorch eager", flush=True)

    check32 = None
    if args.f32_check and have_llama:
        source = getattr(c.graph.weights, "source", None) or random_weights(config)
        check32 = f32_check(args.model, source, check_ids, max(int(t) for t in args.threads.split(",")),
                            args.rebuild_gguf)
        print(describe_check("cross-check F32, llama.cpp vs cflow interpreter logits", check32), flush=True)

    records, check = [], None
    read_bytes = int(args.gib * (1 << 30))
    for threads in (int(t) for t in args.threads.split(",")):
        bw, busy_bw = measured(lambda threads=threads: measure_read_bandwidth(threads, read_bytes))
        m = cflow.load(path, threads=threads)
        bpt = m.bytes_per_token
        rows = []
        tps, busy = measured(lambda m=m: time_decode(m, prompt, args.tokens, args.reps))
        rows.append(("cflow", tps, bpt, busy))
        llm = None
        if have_llama:
            llm = llama_open(gguf_path, threads)
            if check is None:
                check = cross_check(m, llm, check_ids)
                print(describe_check("cross-check Q4, llama.cpp vs cflow runtime logits", check), flush=True)
            tps_l, busy = measured(lambda llm=llm: llama_time_decode(llm, prompt, args.tokens, args.reps))
            rows.append(("llama.cpp", tps_l, bpt, busy))
            del llm
            gc.collect()
        m.close()
        if tmodel is not None:
            tps_t, busy = measured(
                lambda threads=threads: torch_time_decode(tmodel, prompt, args.torch_tokens, threads))
            rows.append(("torch eager f32", tps_t, torch_bytes_per_token(tweights), busy))
        bw_after, busy_bw2 = measured(lambda threads=threads: measure_read_bandwidth(threads, read_bytes))
        read = max(bw, bw_after)  # the machine's best in this run: the honest denominator
        print(f"threads={threads}  read bandwidth {read:6.2f} GB/s (before {bw:.2f}, after {bw_after:.2f})", flush=True)
        print(f"  {'runtime':16s} {'tok/s':>8s} {'MB/token':>9s} {'GB/s':>7s} {'% read':>7s}  other-load", flush=True)
        for name, t, b, busy in rows:
            eff = b * t / 1e9
            load = "" if busy is None else f"{100 * busy:4.0f}%"
            print(f"  {name:16s} {t:8.2f} {b / 1e6:9.1f} {eff:7.2f} {100 * eff / read:6.1f}%  {load}", flush=True)
            records.append({"threads": threads, "runtime": name, "tok_s": round(t, 3), "bytes_per_token": b,
                            "effective_gbps": round(eff, 3), "fraction": round(eff / read, 4),
                            "read_gbps": round(read, 3), "other_load": None if busy is None else round(busy, 3),
                            "model": config.name})
        by = {name: t for name, t, _, _ in rows}
        if "llama.cpp" in by:
            print(f"  cflow / llama.cpp = {by['cflow'] / by['llama.cpp']:.2f}x", flush=True)
        if "torch eager f32" in by:
            print(f"  cflow / torch eager f32 = {by['cflow'] / by['torch eager f32']:.2f}x", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"records": records, "cross_check_q4": check, "cross_check_f32": check32}, f, indent=2)


if __name__ == "__main__":
    main()
