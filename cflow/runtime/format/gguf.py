"""Export a Llama-family or Qwen3 graph (dense, or Mixtral / Qwen3-MoE style) to GGUF, so llama.cpp can run the very
same weights.

    export_gguf(graph, "model.gguf", tokenizer_json=None) -> info dict

For the peer benchmark (benchmarks/peers.py): cflow's Q4/Q8 have exactly GGUF Q4_0/Q8_0 numerics, so
each quantised matrix is written block for block from its QTensor (`to_gguf_bytes`): llama.cpp and
cflow then stream bit-identical weights. Only the PyPI `gguf` package is needed (GGUFWriter).

What is written (architecture "llama", the tensor names llama.cpp's llama arch loads: ir/gguf_names.py):
  token_embd.weight          tok_embeddings at its stored type (F16 for q4/q8/f16 graphs, F32 for f32)
  blk.N.attn_norm/ffn_norm   F32
  blk.N.attn_q/k/v/output    Q4_0 / Q8_0 / F16 / F32 as stored in the graph (attn_q/k rows permuted, below)
  blk.N.attn_q/k/v.bias      F32, if the model has attention biases (q/k permuted too)
  blk.N.ffn_gate/up/down     as stored
  output_norm.weight         F32

A mixture-of-experts graph whose every layer is an expert bank and none a dense FFN (Mixtral's shape)
is written like llama.cpp's convert_hf_to_gguf.py writes Mixtral, still as the llama arch:
  blk.N.ffn_norm.weight      the MoE norm (moe_norm), F32
  blk.N.ffn_gate_inp.weight  the router [n_experts, d_model], as stored (F32)
  blk.N.ffn_gate_exps/ffn_up_exps/ffn_down_exps   the experts' matrices stacked on a third axis
                             [n_experts, rows, cols], each expert's blocks copied bit-identically
  llama.expert_count / expert_used_count = n_experts / top_k; feed_forward_length = expert_dim.
llama.cpp's llama arch routes as cflow does (softmax over all experts, the top k, their weights
renormalised to sum to 1), so only configs with norm_topk, no shared expert and SiLU experts export.
  output.weight              the head as stored (omitted when the graph's head reads tok_embeddings)

RoPE layout: cflow (like Hugging Face) rotates halves: dimension i of a head pairs with i + head_dim/2.
llama.cpp's llama arch rotates adjacent pairs (2i, 2i+1). Like llama.cpp's convert_hf_to_gguf.py,
the rows of attn_q (per query head) and attn_k (per kv head) are reordered so that row 2i + j of a
head is HF row j * head_dim/2 + i (ir/gguf_names.py's rope_row_permutation, whose inverse the GGUF importer
applies). Only whole rows move, so every Q4_0/Q8_0 block stays bit-identical.

Qwen3 (per-head q/k RMS norms, `qk_norm="head"`) exports as llama.cpp's "qwen3" arch, or "qwen3moe" with experts:
the same tensors plus blk.N.attn_q_norm / attn_k_norm.weight (F32, [head_dim]), no row permutation (both archs
rotate halves, as cflow does), and for qwen3moe the experts' width under qwen3moe.expert_feed_forward_length.
llama.cpp's qwen3moe routes as cflow does too (softmax over all experts, the top k renormalised).

Streaming: tensor infos come from the graph's plan (shapes and storage types), then the data is written one
tensor at a time, a stacked expert tensor one expert at a time (`_Payload`), with O_DIRECT where the file system
takes it (`_direct_data`, as the .vflow writer), the next payloads made in
PAYLOAD_WORKERS background threads while one is written (util.prefetch_map, in file order): a graph whose
weights are generated or quantised on access (cflow.models.synthetic.SyntheticWeights) is never in memory as a
whole.

Metadata: context/embedding/feed-forward length, block count, head counts, key/value length, rope
dimension count and base, RMS eps, vocab size, file type (MOSTLY_Q4_0 etc.) and a tokenizer:
  - tokenizer_json (a tokenizer.json path, a directory holding one, or the JSON text): a byte-level
    BPE becomes a "gpt2" vocabulary with merges; a SentencePiece-style model (Unigram, or BPE with
    byte_fallback, e.g. Llama-2/TinyLlama) becomes a "llama" vocabulary;
  - none: a synthetic "llama" (SPM) vocabulary of vocab_size tokens: <unk>, <s>, </s>, the 256 byte
    tokens <0x00>..<0xFF> (llama.cpp's SPM loader needs every byte token), then unique filler pieces.
    Enough for llama.cpp to load the model and run token ids; text tokenisation is meaningless.
Anything the llama arch cannot express is refused with UnsupportedModelError: MoE mixed with dense FFNs
(arch1-4 style) or with shared experts or unnormalised top-k weights, weight sharing (arch5), dense/expert
delays other than (0, 0), layers without an FFN of either kind, and Q4/Q8 rows whose length is not a
multiple of 32 (GGUF blocks cannot be padded).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from ...errors import CflowError, UnsupportedModelError
from ...ir.gguf_names import BLOCK_TENSORS, EXPERT_TENSORS, GLOBAL_TENSORS, rope_row_permutation
from ...layout.blocks import OWN_TYPES, BlockTensor, is_block_type
from ...layout.quant import BLOCK, BLOCK_SIZES, DType, QTensor, to_gguf_bytes
from ...util import atomic_path, prefetch_map, small_pages, usable_cpus
from .direct import DirectFile

ARCH = "llama"
PAYLOAD_WORKERS = 2  # threads making payloads ahead of the writer (fewer on a machine with fewer CPUs)

def _gguf():
    try:
        import gguf
    except ImportError:
        raise CflowError("GGUF export needs the 'gguf' package: pip install 'cflow[peers]' (or gguf>=0.17)") from None
    return gguf


def gguf_tensor_names(config) -> dict[str, str]:
    """IR weight name -> GGUF tensor name for a Llama-family config (head: see export_gguf). Every expert's
    w_gate of block N maps to the one stacked blk.N.ffn_gate_exps.weight (likewise up, down)."""
    from ...ir.build import weight_shapes

    out = dict(GLOBAL_TENSORS)
    for name in weight_shapes(config):
        if name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            parts = rest.split(".")
            if len(parts) == 4 and parts[:2] == ["moe", "experts"] and parts[3] in EXPERT_TENSORS:
                out[name] = f"blk.{int(i)}.{EXPERT_TENSORS[parts[3]]}"
                continue
            if rest not in BLOCK_TENSORS:
                raise UnsupportedModelError(f"GGUF export: weight {name} has no llama.cpp counterpart")
            out[name] = f"blk.{int(i)}.{BLOCK_TENSORS[rest]}"
    return out


def check_exportable(graph) -> None:
    """Raise UnsupportedModelError unless the graph is a plain Llama-family decoder: every layer a dense SwiGLU
    FFN, or every layer a Mixtral-style expert bank (no dense FFN, no shared expert, normalised top-k)."""
    c = graph.config
    kinds = {n.kind for n in graph.nodes()}
    layers = range(1, c.n_layers + 1)
    types = {**(graph.meta.source_dtypes or {}), **(graph.meta.weight_dtypes or {})}
    own = sorted(n for n, dt in types.items() if DType(dt) in OWN_TYPES)
    if own:
        _block_ggml(own[0], DType(types[own[0]]))
    if c.n_experts or kinds & {"router", "experts"}:
        if any(c.has_dense(i) for i in layers) or not all(c.has_moe(i) for i in layers):
            raise UnsupportedModelError(
                f"GGUF export of {graph.name}: mixture-of-experts layers mixed with dense FFN layers (n_experts="
                f"{c.n_experts}, ffn_dim={c.ffn_dim}) have no llama-arch equivalent; only Mixtral-style models "
                "(every layer an expert bank, no dense FFN) export")
        if c.shared_expert_dim:
            raise UnsupportedModelError(f"GGUF export of {graph.name}: shared experts (shared_expert_dim="
                                        f"{c.shared_expert_dim}) are not in llama.cpp's llama arch")
        if not c.norm_topk:
            raise UnsupportedModelError(f"GGUF export of {graph.name}: llama.cpp's llama arch renormalises the top-k "
                                        "expert weights; this model does not (norm_topk=False)")
    if c.n_blocks != c.n_layers:
        raise UnsupportedModelError(f"GGUF export of {graph.name}: weight sharing (n_blocks={c.n_blocks} < "
                                    f"n_layers={c.n_layers}) has no llama.cpp equivalent")
    delays = tuple(graph.meta.delays)
    if delays != (0, 0):
        raise UnsupportedModelError(f"GGUF export of {graph.name}: delays (dd, de)={delays} change the function; "
                                    "llama.cpp's llama arch computes delays (0, 0) only")
    if not c.n_experts and (c.ffn_dim <= 0 or (c.dense_layers is not None and sorted(c.dense_layers) != list(layers))):
        raise UnsupportedModelError(f"GGUF export of {graph.name}: every layer needs a dense SwiGLU FFN")
    if c.head_dim % 2:
        raise UnsupportedModelError(f"GGUF export of {graph.name}: head_dim={c.head_dim} is odd")
    variants = {"rope scaling": c.rope_scaling, "partial rotary": c.rope_dim != c.head_dim,
                "whole-projection q/k norms": c.qk_norm not in ("", "head"),
                "a non-SiLU activation": c.activation != "silu", "post norms": c.post_norms,
                "soft-capping": c.attn_softcap or c.final_softcap, "a sliding window": c.sliding_window}
    for what, present in variants.items():
        if present:
            raise UnsupportedModelError(f"GGUF export of {graph.name}: {what} is not written to the llama arch yet")


# --- tokenizer ---------------------------------------------------------------------------------

def synthetic_spm_vocab(vocab_size: int) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types) of a placeholder SentencePiece vocabulary with vocab_size entries."""
    gguf = _gguf()
    TT = gguf.TokenType
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TT.UNKNOWN, TT.CONTROL, TT.CONTROL] + [TT.BYTE] * 256
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = 0
    while len(toks) < vocab_size:
        # unique pieces "▁a".."▁z", "▁ba".. (base-26 words): llama.cpp requires unique token strings
        n, word = i, ""
        while True:
            word = letters[n % 26] + word
            n = n // 26 - 1
            if n < 0:
                break
        toks.append("\u2581" + word)
        types.append(TT.NORMAL)
        i += 1
    toks, types = toks[:vocab_size], types[:vocab_size]
    scores = [0.0] * min(3, vocab_size) + [-float(k) for k in range(3, vocab_size)]
    return toks, scores, [int(t) for t in types]


def _read_tokenizer_json(tokenizer_json) -> dict:
    text = str(tokenizer_json)
    if not text.lstrip().startswith("{"):
        p = Path(text)
        if p.is_dir():
            p = p / "tokenizer.json"
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise CflowError(f"{p}: cannot read tokenizer.json ({e.strerror})") from None
    try:
        tj = json.loads(text)
        tj["model"]["type"]
    except (ValueError, KeyError, TypeError):
        raise CflowError("tokenizer for GGUF export is not a valid tokenizer.json") from None
    return tj


def _write_tokenizer(w, tokenizer_json, vocab_size: int, specials: dict | None = None) -> None:
    """The tokenizer.ggml.* metadata; `specials` (GraphMeta.special_tokens) decides BOS/EOS where the model says."""
    gguf = _gguf()
    TT = gguf.TokenType
    if tokenizer_json is None:
        toks, scores, types = synthetic_spm_vocab(vocab_size)
        w.add_tokenizer_model("llama")
        w.add_token_list(toks)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        return
    tj = _read_tokenizer_json(tokenizer_json)
    model = tj["model"]
    kind = model["type"]
    added = {int(t["id"]): t for t in tj.get("added_tokens", [])}
    if kind == "Unigram":
        pieces = [(str(p), float(s)) for p, s in model["vocab"]]
        id_to_tok = {i: p for i, (p, _) in enumerate(pieces)}
        id_score = {i: s for i, (_, s) in enumerate(pieces)}
        spm = True
    elif kind == "BPE":
        id_to_tok = {int(i): str(t) for t, i in model["vocab"].items()}
        id_score = {i: -float(i) for i in id_to_tok}  # BPE ids follow merge order: earlier = preferred
        spm = bool(model.get("byte_fallback"))
    else:
        raise UnsupportedModelError(f"GGUF export: tokenizer model type {kind!r} is not supported (BPE, Unigram)")
    for i, t in added.items():
        id_to_tok[i] = str(t["content"])
    n = max(id_to_tok) + 1 if id_to_tok else 0
    if n > vocab_size:
        raise UnsupportedModelError(
            f"GGUF export: the tokenizer has {n} tokens, more than the model's vocab_size={vocab_size}")
    toks, scores, types = [], [], []
    used = set(id_to_tok.values())
    pad = 0
    for i in range(vocab_size):
        t = id_to_tok.get(i)
        if t is None:  # holes and the tail up to vocab_size: unique unused placeholders
            while f"[PAD{pad}]" in used:
                pad += 1
            t = f"[PAD{pad}]"
            used.add(t)
            typ = TT.UNUSED
        elif i in added:
            typ = TT.CONTROL if added[i].get("special", True) else TT.USER_DEFINED
        elif spm and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            typ = TT.BYTE
        elif t == model.get("unk_token") or i == model.get("unk_id"):
            typ = TT.UNKNOWN
        else:
            typ = TT.NORMAL
        toks.append(t)
        scores.append(float(id_score.get(i, 0.0)))
        types.append(int(typ))
    by_text = {t: i for i, t in enumerate(toks)}
    if len(by_text) != len(toks):  # llama.cpp asserts unique token strings (an abort, not an error)
        dup = next(t for i, t in enumerate(toks) if by_text[t] != i)
        raise UnsupportedModelError(f"GGUF export: token {dup!r} appears twice in the tokenizer")

    def special(*names):
        return next((by_text[s] for s in names if s in by_text), None)

    bos = special("<s>", "<|begin_of_text|>", "<bos>", "<|endoftext|>")
    eos = special("</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>", "<|im_end|>")
    add_bos, add_eos = bool(spm and bos is not None), False
    if specials:  # the model's own rule (tokenizer_config.json, the post-processor, the source GGUF)
        bos = specials["bos"] if specials.get("bos") is not None else bos
        eos = specials["eos"] if specials.get("eos") is not None else eos
        add_bos, add_eos = bool(specials.get("add_bos")), bool(specials.get("add_eos"))
    unk_id = model.get("unk_id")
    if isinstance(unk_id, int) and 0 <= unk_id < vocab_size:
        unk = unk_id
    else:
        unk = special(str(model.get("unk_token")), "<unk>")
    if spm:
        w.add_tokenizer_model("llama")
        w.add_token_list(toks)
        w.add_token_scores(scores)
        w.add_token_types(types)
    else:
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
        w.add_tokenizer_model("gpt2")
        # GPT-2's regex, which a ByteLevel pre-tokenizer with use_regex applies (llama.cpp's "default" splits
        # digits apart: " 3" would become two tokens)
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(toks)
        w.add_token_types(types)
        w.add_token_merges(merges)
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)
    if unk is not None:
        w.add_unk_token_id(unk)
    w.add_add_bos_token(add_bos and bos is not None)
    w.add_add_eos_token(add_eos and eos is not None)


# --- tensors -----------------------------------------------------------------------------------

def _tensor_payload(name: str, w, perm: np.ndarray | None):
    """(array to write, raw GGML type or None) for one graph weight, rows permuted by `perm`."""
    gguf = _gguf()
    Q = gguf.GGMLQuantizationType
    if isinstance(w, BlockTensor):  # a GGUF block type's bytes as they are; cflow's own types have no GGML id
        raw = _block_ggml(name, w.dtype)
        data = w.raw
        if perm is not None:  # whole rows of blocks move with their rows
            data = data[perm]
        return np.ascontiguousarray(data), raw
    if isinstance(w, QTensor):
        if w.cols % BLOCK:
            raise UnsupportedModelError(f"GGUF export: {name} has rows of {w.cols} inputs; {w.dtype.label} rows in "
                                        f"GGUF must be whole blocks of {BLOCK}")
        data = to_gguf_bytes(w)
        raw = Q.Q4_0 if w.dtype == DType.Q4 else Q.Q8_0
    else:
        data = np.asarray(w)
        if data.dtype != np.float16:
            data = data.astype(np.float32, copy=False)
        raw = None
    if perm is not None:
        data = data[perm]
    return np.ascontiguousarray(data), raw


def _block_ggml(name: str, dt: DType):
    """The GGML type id of a GGUF block type; cflow's own types (layout/blocks.py) are refused by name."""
    if dt in OWN_TYPES:
        raise UnsupportedModelError(f"GGUF export: {name} is {dt.gguf_name}, a block type of cflow's own that "
                                    "llama.cpp cannot read; compile the model with llama.cpp's types to export it "
                                    "(cflowc --mix-types gguf for a mix, or --quant q4 / q8)")
    return getattr(_gguf().GGMLQuantizationType, dt.gguf_name)


def _planned(graph, name: str):
    """(byte shape, numpy dtype, raw GGML type) of a quantised graph's weight from its metadata, without
    quantising it; (None, None, None) for a graph that records no storage types."""
    dtypes, shapes = graph.meta.weight_dtypes, graph.meta.shapes
    if not dtypes or name not in dtypes or name not in shapes:
        return None, None, None
    Q = _gguf().GGMLQuantizationType
    dt, shape = DType(dtypes[name]), tuple(shapes[name])
    if dt in (DType.Q4, DType.Q8):
        if len(shape) != 2 or shape[1] % BLOCK:
            raise UnsupportedModelError(f"GGUF export: {name} has shape {shape}; {dt.label} rows in GGUF must be "
                                        f"whole blocks of {BLOCK} inputs")
        per = BLOCK_SIZES[dt][1]
        return (shape[0], shape[1] // BLOCK * per), np.dtype(np.uint8), (Q.Q4_0 if dt == DType.Q4 else Q.Q8_0)
    if is_block_type(dt):
        qk, per = BLOCK_SIZES[dt]
        return (shape[0], shape[1] // qk * per), np.dtype(np.uint8), _block_ggml(name, dt)
    return shape, np.dtype(np.float16 if dt == DType.F16 else np.float32), None


def _planned_stack(graph, names: list[str]):
    """_planned for several same-shaped matrices written as one [len(names), rows, cols] tensor."""
    plans = [_planned(graph, n) for n in names]
    shape, dt, raw = plans[0]
    if shape is None or any(p != plans[0] for p in plans):
        return None, None, None
    return (len(names), *shape), dt, raw


def _file_type(graph):
    LFT = _gguf().LlamaFileType
    q = graph.meta.quant or DType.F32
    known = {DType.Q4: LFT.MOSTLY_Q4_0, DType.Q8: LFT.MOSTLY_Q8_0, DType.F16: LFT.MOSTLY_F16, DType.F32: LFT.ALL_F32}
    # a mix's most common type where llama.cpp has a file type of that one type; else "guessed" (its readers infer)
    return known[q] if q in known else getattr(LFT, f"MOSTLY_{q.gguf_name}", LFT.GUESSED)


def gguf_arch(config) -> str:
    """The llama.cpp architecture a config exports as: qwen3moe / qwen3 for per-head q/k norms (Qwen3's shape,
    with or without experts), else llama (Llama, Mistral, Mixtral)."""
    if config.qk_norm == "head":
        return "qwen3moe" if config.n_experts else "qwen3"
    return ARCH


def _tensor_order(c, head: str) -> list:
    """The file's tensors in order: one IR weight name each, or a list of the experts' matrices that are stacked
    into one GGUF tensor."""
    order: list = ["tok_embeddings"]
    for i in range(c.n_layers):
        p = f"blocks.{i}"
        order += [f"{p}.attn_norm", f"{p}.attn.wq", f"{p}.attn.wk", f"{p}.attn.wv"]
        if c.attn_bias:
            order += [f"{p}.attn.bq", f"{p}.attn.bk", f"{p}.attn.bv"]
        if c.qk_norm:
            order += [f"{p}.attn.q_norm", f"{p}.attn.k_norm"]
        order.append(f"{p}.attn.wo")
        if c.n_experts:
            order += [f"{p}.moe_norm", f"{p}.moe.router"]
            order += [[f"{p}.moe.experts.{e}.{m}" for e in range(c.n_experts)] for m in ("w_gate", "w_up", "w_down")]
        else:
            order += [f"{p}.ffn_norm", f"{p}.ffn.w_gate", f"{p}.ffn.w_up", f"{p}.ffn.w_down"]
    order.append("norm")
    if head != "tok_embeddings":
        order.append(head)
    return order


def _write_metadata(w, graph, arch: str, tokenizer_json) -> None:
    gguf = _gguf()
    c = graph.config
    moe = bool(c.n_experts)
    w.add_name(graph.name)
    w.add_vocab_size(c.vocab_size)
    w.add_context_length(c.max_seq_len)
    w.add_embedding_length(c.d_model)
    w.add_block_count(c.n_layers)
    w.add_feed_forward_length(c.expert_dim if moe else c.ffn_dim)
    if moe:
        w.add_expert_count(c.n_experts)
        w.add_expert_used_count(c.top_k)
        if arch != ARCH:  # qwen3moe reads the experts' width from its own key
            w.add_expert_feed_forward_length(c.expert_dim)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(float(c.rope_theta))
    w.add_layer_norm_rms_eps(float(c.norm_eps))
    w.add_file_type(int(_file_type(graph)))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _write_tokenizer(w, tokenizer_json, c.vocab_size, graph.meta.special_tokens)


class _Payload:
    """The payload of one GGUF tensor, taken from `stream` one array per name: the experts' matrices of a stacked
    tensor one after the other, or a single tensor's. GGUFWriter.write_tensor_data checks `.nbytes` and calls
    `.tofile(file)`, which writes each through file.write (a DirectFile has no file descriptor for numpy's
    tofile)."""

    def __init__(self, names: list[str], stream, dtype, nbytes: int):
        self.names, self.stream, self.dtype, self.nbytes = names, stream, dtype, nbytes

    def tofile(self, f) -> None:
        per = self.nbytes // len(self.names)
        for name in self.names:
            data = next(self.stream)
            if data.dtype != self.dtype or data.nbytes != per:
                raise CflowError(f"GGUF export: {name} is {data.dtype}, {data.nbytes} B; its metadata said "
                                 f"{self.dtype}, {per} B" + (" per expert" if len(self.names) > 1 else ""))
            f.write(memoryview(data).cast("B"))
            del data


def _direct_data(w, path: str) -> DirectFile | None:
    """Swap the GGUF writer's file for a DirectFile from the data section on (its header written and flushed), as
    the .vflow's tensors are written (runtime/format/direct.py: no copy into the page cache, ~0.3 CPU-s/GB less);
    None (the buffered file kept) where O_DIRECT is unavailable."""
    if len(w.fout) != 1:
        return None
    f = w.fout[0]
    f.flush()
    direct = DirectFile.open(path, f.tell())
    if direct is not None:
        f.close()
        w.fout[0] = direct
    return direct


def export_gguf(graph, path, tokenizer_json=None) -> dict:
    """Write `graph` (a Llama-family or Qwen3 cflow Graph, quantised or not) as a llama.cpp GGUF file.

    Q4/Q8 matrices are copied bit-identically from the graph's QTensors (for the llama arch, rows of attn_q/attn_k
    reordered for llama.cpp's RoPE layout, see the module docstring). Tensors are written one at a time (a stack
    of experts one expert at a time), so a graph whose weights are generated or quantised on access is never in
    memory. The file is written to a temporary name beside `path` and renamed, so `path` is either complete or
    untouched. Returns {"path", "file_bytes", "tensors", "seconds", "file_type", "arch"}.
    """
    gguf = _gguf()
    check_exportable(graph)
    c = graph.config
    arch = gguf_arch(c)
    t0 = time.perf_counter()
    names = gguf_tensor_names(c)
    head = graph["logits"].weight  # "lm_head" (quantised graphs, also when tied) or "tok_embeddings"
    order = _tensor_order(c, head)
    perms = {}
    if arch == ARCH:  # llama.cpp's llama arch rotates adjacent pairs; qwen3 / qwen3moe rotate halves as cflow does
        perm_q = rope_row_permutation(c.n_heads, c.head_dim)
        perm_k = rope_row_permutation(c.n_kv_heads, c.head_dim)
        for i in range(c.n_layers):
            for s, pm in (("wq", perm_q), ("bq", perm_q), ("wk", perm_k), ("bk", perm_k)):
                perms[f"blocks.{i}.attn.{s}"] = pm

    def payload(name):
        try:
            w = graph.weights[name]
        except KeyError:
            raise CflowError(
                f"GGUF export: graph {graph.name} has no weight {name!r} (a graph without weights?)") from None
        return _tensor_payload(name, w, perms.get(name))

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        w = gguf.GGUFWriter(str(tmp), arch)
        _write_metadata(w, graph, arch, tokenizer_json)
        # Tensor infos first (from the plan, or one pass over the payloads of an unquantised graph), then the data
        # one tensor at a time.
        infos = []
        for name in order:
            if isinstance(name, list):
                gname = names[name[0]]
                shape, dt, raw = _planned_stack(graph, name)
                if shape is None:
                    data, raw = payload(name[0])
                    shape, dt = (len(name), *data.shape), data.dtype
                    del data
            else:
                gname = "output.weight" if name == head != "tok_embeddings" else names[name]
                shape, dt, raw = _planned(graph, name)
                if shape is None:  # an unquantised graph: look at the array itself (no quantisation cost)
                    data, raw = payload(name)
                    shape, dt = data.shape, data.dtype
                    del data
            nb = int(np.prod(shape)) * dt.itemsize
            w.add_tensor_info(gname, shape, dt, nb, raw_dtype=raw)
            infos.append((dt, nb))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        # the payloads in file order (a stack expert by expert), the next ones made while one is written
        stream = prefetch_map(lambda n: payload(n)[0],
                              (n for entry in order for n in (entry if isinstance(entry, list) else [entry])),
                              workers=min(PAYLOAD_WORKERS, usable_cpus()), name="cflow-gguf")
        direct = _direct_data(w, str(tmp))
        with small_pages():  # as the .vflow writer (util.small_pages)
            try:
                for name, (dt, nb) in zip(order, infos):
                    w.write_tensor_data(_Payload(name if isinstance(name, list) else [name], stream, dt, nb))
            except BaseException:
                if direct is not None:
                    direct.abort()
                raise
            finally:
                stream.close()
        w.close()
    return {"path": str(path), "file_bytes": path.stat().st_size, "tensors": len(order),
            "seconds": time.perf_counter() - t0, "file_type": _file_type(graph).name, "arch": arch}
