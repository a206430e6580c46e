"""The peer engines, opened and timed the same way by every benchmark: llama.cpp (llama-cpp-python) and ONNX
Runtime GenAI. Both are optional (pip install 'cflow[peers]'): each function imports its engine when called."""

from __future__ import annotations

import json
import os
import time

import numpy as np

from . import OUT

# --- llama.cpp -------------------------------------------------------------------------------------------------


def llama_open(path: str, threads: int, extra_bufts: bool = True, **kw):
    """llama.cpp on `path` with `threads` threads (kw: Llama's own arguments, e.g. n_ctx (512 unless given),
    n_batch, logits_all (False unless given)); extra_bufts=False turns off llama.cpp's extra buffer types (its
    AMX path, which in llama-cpp-python 0.3.36 crashes on the first decode of a K-quant file, and in a
    512-token Q4_0 prompt, on the AMX Xeon VM)."""
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp import llama as _ll

    orig = llama_cpp.llama_model_default_params

    def params():
        p = orig()
        p.use_extra_bufts = extra_bufts
        return p

    _ll.llama_cpp.llama_model_default_params = params
    try:
        return Llama(model_path=str(path), **{"n_threads": threads, "n_threads_batch": threads, "logits_all": False,
                                              "verbose": False, "n_ctx": 512, **kw})
    finally:
        _ll.llama_cpp.llama_model_default_params = orig


def llama_last_logits(llm) -> np.ndarray:
    """Logits of the last evaluated token (with logits_all=False, Llama.eval no longer fills llm.scores)."""
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float32, copy=True)


def llama_next(llm) -> int:
    """The greedy next token after what llm evaluated last."""
    return int(np.argmax(llama_last_logits(llm)))


def llama_greedy(llm, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after the prompt."""
    llm.reset()
    llm.eval(prompt)
    out = []
    for _ in range(n):
        out.append(llama_next(llm))
        llm.eval([out[-1]])
    return out


def llama_time_decode(llm, prompt: list[int], tokens: int, reps: int = 3) -> float:
    """Best-of-reps greedy decode tok/s: eval the prompt, then `tokens` single-token evals."""
    best = 0.0
    for _ in range(reps):
        llm.reset()
        llm.eval(prompt)
        t0 = time.perf_counter()
        for _ in range(tokens):
            llm.eval([llama_next(llm)])
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


def gguf_file(key: str, c, rebuild: bool = False, quant: str = "q4") -> str:
    """The GGUF export of the benchmark model MODELS[key]'s lowered plan `c` (quantised as `quant`: q4 -> Q4_0,
    q8 -> Q8_0, the same blocks bit for bit), written once into out/bench/."""
    from cflow.runtime.format.gguf import export_gguf

    from .models import MODELS

    path = os.path.join(OUT, f"{MODELS[key].name}_{quant}.gguf")
    if rebuild or not os.path.exists(path):
        os.makedirs(OUT, exist_ok=True)
        info = export_gguf(c.graph, path)
        print(f"# exported {path}: {info['file_bytes'] / 1e9:.2f} GB, {info['tensors']} tensors, "
              f"{info['file_type']}, {info['seconds']:.1f} s", flush=True)
    return path


# --- ONNX Runtime GenAI ----------------------------------------------------------------------------------------


def ort_genai_open(model_dir: str, threads: int):
    """og.Model with the CPU provider and `threads` intra-op threads (Config.overlay onto the decoder's
    session options; intra_op_num_threads is an integer session option of genai_config.json in 0.18)."""
    import onnxruntime_genai as og

    cfg = og.Config(model_dir)
    cfg.clear_providers()
    cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": int(threads)}}}}))
    return og.Model(cfg)


def ort_genai_greedy(model, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    """(tok/s, generated ids) of one greedy run: the prompt appended, then `tokens` generate_next_token calls."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + tokens + 1)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    t0 = time.perf_counter()
    for _ in range(tokens):
        gen.generate_next_token()
    dt = time.perf_counter() - t0
    seq = [int(t) for t in gen.get_sequence(0)]
    return tokens / dt, seq[len(prompt):]


def ort_genai_forced(model, prompt: list[int], ids: list[int]) -> list[int]:
    """ORT GenAI's argmax at each step when fed `ids` (teacher-forced: the prompt, then one id per step)."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + len(ids) + 1)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    out = []
    for t in ids:
        lg = np.asarray(gen.get_logits())
        out.append(int(np.argmax(lg.reshape(-1, lg.shape[-1])[-1])))
        gen.append_tokens([int(t)])
    return out


def ort_genai_time_decode(model, prompt: list[int], tokens: int, reps: int = 3) -> float:
    """Best-of-reps greedy tok/s with the Generator API (model from ort_genai_open)."""
    return max(ort_genai_greedy(model, prompt, tokens)[0] for _ in range(reps))
