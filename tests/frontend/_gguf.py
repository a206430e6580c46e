"""Write GGUF files the way llama.cpp's converter does, with the PyPI `gguf` package (GGUFWriter), from an IR
graph: the test's own files (no downloads). Shared by the GGUF import tests and the fuzz test."""

from __future__ import annotations

import math

import numpy as np

from cflow.ir.gguf_names import BLOCK_TENSORS, EXPERT_TENSORS, rope_row_permutation
from cflow.layout.quant import QTensor, to_gguf_bytes


def _payload(w, qtype):
    import gguf

    Q = gguf.GGMLQuantizationType
    if isinstance(w, QTensor):
        return to_gguf_bytes(w), (Q.Q4_0 if w.dtype.label == "q4" else Q.Q8_0)
    w = np.asarray(w, np.float32)
    if qtype is None or w.ndim == 1 or qtype == Q.F32:
        return w, None
    if qtype == Q.F16:
        return w.astype(np.float16), None
    return gguf.quants.quantize(w, qtype), qtype


def write_gguf(graph, path, arch: str, qtype=None, extra_tensors=None, tokenizer=None, chat_template=None,
               metadata=None, drop=(), pre="default"):
    """Write `graph` (float or quantised weights) as an `arch` GGUF. qtype: a GGMLQuantizationType for every
    matrix (None: as stored). llama arch: q/k rows permuted as convert_hf_to_gguf does. extra_tensors: name ->
    (array, raw type or None). tokenizer: (model, tokens, scores, types, merges) or None; pre: the
    tokenizer.ggml.pre written with merges (None: none)."""
    import gguf

    c = graph.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(graph.name)
    w.add_context_length(c.max_seq_len)
    w.add_embedding_length(c.d_model)
    w.add_block_count(c.n_layers)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(float(c.rope_theta))
    w.add_layer_norm_rms_eps(float(c.norm_eps))
    mixtral = arch == "llama" and c.n_experts  # convert_hf_to_gguf: the experts' width as feed_forward_length
    if c.ffn_dim or mixtral:
        w.add_feed_forward_length(c.expert_dim if mixtral else c.ffn_dim)
    if c.n_experts:
        w.add_expert_count(c.n_experts)
        w.add_expert_used_count(c.top_k)
        if not mixtral:
            w.add_expert_feed_forward_length(c.expert_dim)
        if c.shared_expert_dim:
            w.add_expert_shared_feed_forward_length(c.shared_expert_dim)
    for k, v in (metadata or {}).items():
        getattr(w, k)(*v) if isinstance(v, tuple) else getattr(w, k)(v)
    if tokenizer is not None:
        model, tokens, scores, types, merges = tokenizer
        w.add_tokenizer_model(model)
        w.add_token_list(tokens)
        if scores is not None:
            w.add_token_scores(scores)
        w.add_token_types(types)
        if merges is not None:
            if pre is not None:
                w.add_tokenizer_pre(pre)
            w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    if chat_template:
        w.add_chat_template(chat_template)
    perm = {}
    if arch == "llama":
        pq, pk = rope_row_permutation(c.n_heads, c.head_dim), rope_row_permutation(c.n_kv_heads, c.head_dim)
        perm = {"attn.wq": pq, "attn.bq": pq, "attn.wk": pk, "attn.bk": pk}
    head = graph["logits"].weight
    tensors = [("token_embd.weight", graph.weights["tok_embeddings"])]
    for i in range(c.n_layers):
        p = f"blocks.{i}."
        for ir, gname in BLOCK_TENSORS.items():
            if p + ir in graph.weights:
                x = graph.weights[p + ir]
                if ir in perm:
                    x = x[perm[ir]] if not isinstance(x, QTensor) else QTensor(
                        dtype=x.dtype, rows=x.rows, cols=x.cols, scales=x.scales[perm[ir]], q=x.q[perm[ir]])
                if ir == "moe.shared_gate":
                    x = np.asarray(x).reshape(-1)
                tensors.append((f"blk.{i}.{gname}", x))
        if c.has_moe(i + 1):
            for role, gname in EXPERT_TENSORS.items():
                tensors.append((f"blk.{i}.{gname}",
                                np.stack([graph.weights[f"{p}moe.experts.{e}.{role}"] for e in range(c.n_experts)])))
    tensors.append(("output_norm.weight", graph.weights["norm"]))
    if head != "tok_embeddings" and not c.tie_embeddings:
        tensors.append(("output.weight", graph.weights[head]))
    tensors = [(n, x) for n, x in tensors if n not in drop]
    for name, (arr, raw) in (extra_tensors or {}).items():
        tensors.append((name, (arr, raw)))
    for name, x in tensors:
        if isinstance(x, tuple):
            data, raw = x
        elif isinstance(x, np.ndarray) and x.ndim == 3:  # stacked experts
            parts = [_payload(x[e], qtype) for e in range(x.shape[0])]
            data, raw = np.stack([p[0] for p in parts]), parts[0][1]
        else:
            data, raw = _payload(x, qtype if not name.endswith(("norm.weight", ".bias", "inp_shexp.weight",
                                                                 "ffn_gate_inp.weight")) else None)
        w.add_tensor(name, np.ascontiguousarray(data), raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- Hugging Face model -> GGUF, as convert_hf_to_gguf.py writes each architecture ---------------------------
_ARCH_ENUM = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "gemma": "GEMMA", "gemma2": "GEMMA2",
              "gemma3": "GEMMA3", "phi3": "PHI3", "olmoe": "OLMOE", "granite": "GRANITE"}


def _rope_of(cfg) -> dict:
    rp = getattr(cfg, "rope_parameters", None) or {}
    if "full_attention" in rp:  # Gemma 3: the global layers' parameters go in the file
        rp = rp["full_attention"]
    return dict(rp)


def write_hf_gguf(model, path, arch: str, metadata=None, qtype=None, drop=()):
    """Write a transformers causal LM as llama.cpp's converter would for `arch` (names from gguf's TensorNameMap,
    q/k rows permuted for llama/granite, Gemma norms stored as 1 + w, OLMoE's experts stacked, Phi-3's fused
    tensors renamed and its longrope factors as rope_factors_long/short tensors, Granite's multipliers as *_scale
    metadata). metadata: extra GGUFWriter calls (name -> value or args tuple). qtype: a type for every matrix."""
    import gguf

    cfg = model.config
    L, d, H = cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads
    KV = getattr(cfg, "num_key_value_heads", None) or H
    hd = getattr(cfg, "head_dim", None) or d // H
    rp = _rope_of(cfg)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(d)
    w.add_block_count(L)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    if arch.startswith("gemma"):
        w.add_key_length(hd)
        w.add_value_length(hd)
    if arch not in ("gemma", "gemma2"):  # Gemma 1/2's converter writes no freq_base (llama.cpp: 10000)
        w.add_rope_freq_base(float(rp.get("rope_theta", 10000.0)))
    rot = hd
    if arch == "phi3":  # the converter: int(partial_rotary_factor * hidden_size) // heads
        rot = int(float(rp.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0) or 1.0)) * d) // H
    w.add_rope_dimension_count(rot)
    kind = rp.get("rope_type", "default")
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rp["factor"]))
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rp["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rp["original_max_position_embeddings"]))
    extra = []
    if arch == "phi3":
        orig = int(getattr(cfg, "original_max_position_embeddings", None) or rp["original_max_position_embeddings"])
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_sliding_window(getattr(cfg, "sliding_window", None) or 0)
        if kind == "longrope":
            scale = cfg.max_position_embeddings / orig
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
            extra = [("rope_factors_long.weight", np.asarray(rp["long_factor"], np.float32)),
                     ("rope_factors_short.weight", np.asarray(rp["short_factor"], np.float32))]
    if arch == "gemma2":
        w.add_attn_logit_softcapping(float(cfg.attn_logit_softcapping))
        w.add_final_logit_softcapping(float(cfg.final_logit_softcapping))
        w.add_sliding_window(int(cfg.sliding_window))
    if arch == "gemma3":
        if getattr(cfg, "final_logit_softcapping", None):
            w.add_final_logit_softcapping(float(cfg.final_logit_softcapping))
        w.add_sliding_window(int(cfg.sliding_window))
    if arch == "granite":
        w.add_attention_scale(float(cfg.attention_multiplier))
        w.add_embedding_scale(float(cfg.embedding_multiplier))
        w.add_residual_scale(float(cfg.residual_multiplier))
        w.add_logit_scale(float(cfg.logits_scaling))
    if arch == "olmoe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    for k, v in (metadata or {}).items():
        getattr(w, k)(*v) if isinstance(v, tuple) else getattr(w, k)(v)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, _ARCH_ENUM[arch]), L)
    permute = arch in ("llama", "granite")
    pq, pk = rope_row_permutation(H, hd), rope_row_permutation(KV, hd)
    tensors = []
    for name, t in model.state_dict().items():
        x = t.detach().float().numpy()
        if name == "lm_head.weight" and (cfg.tie_word_embeddings or arch in ("gemma", "gemma2")):
            continue
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            x = x + 1  # convert_hf_to_gguf: Gemma's RMSNorm computes x * (1 + w)
        if permute and name.endswith("q_proj.weight"):
            x = x[pq]
        if permute and name.endswith("k_proj.weight"):
            x = x[pk]
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, d]: gate rows, then up rows
            i = int(name.split(".")[2])
            half = x.shape[1] // 2
            tensors += [(f"blk.{i}.ffn_gate_exps.weight", x[:, :half]), (f"blk.{i}.ffn_up_exps.weight", x[:, half:])]
            continue
        if name.endswith("mlp.experts.down_proj"):
            tensors.append((f"blk.{name.split('.')[2]}.ffn_down_exps.weight", x))
            continue
        g = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert g is not None, name
        tensors.append((g, x))
    for name, x in tensors + extra:
        if name in drop:
            continue
        data, raw = (x, None) if x.ndim == 1 or name.endswith("ffn_gate_inp.weight") else _payload(x, qtype) \
            if x.ndim == 2 else (np.stack([_payload(e, qtype)[0] for e in x]), _payload(x[0], qtype)[1])
        w.add_tensor(name, np.ascontiguousarray(data), raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
