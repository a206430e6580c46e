"""Write GGUF files the way llama.cpp's converter does, with the PyPI `gguf` package (GGUFWriter), from an IR
graph: the test's own files (no downloads). Shared by the GGUF import tests and the fuzz test."""

from __future__ import annotations

import numpy as np

from cflow.layout.quant import QTensor, to_gguf_bytes
from cflow.runtime.format.gguf import rope_row_permutation

_BLOCK = {"attn_norm": "attn_norm.weight", "attn.wq": "attn_q.weight", "attn.wk": "attn_k.weight",
          "attn.wv": "attn_v.weight", "attn.wo": "attn_output.weight", "attn.bq": "attn_q.bias",
          "attn.bk": "attn_k.bias", "attn.bv": "attn_v.bias", "attn.q_norm": "attn_q_norm.weight",
          "attn.k_norm": "attn_k_norm.weight", "ffn_norm": "ffn_norm.weight", "moe_norm": "ffn_norm.weight",
          "ffn.w_gate": "ffn_gate.weight", "ffn.w_up": "ffn_up.weight", "ffn.w_down": "ffn_down.weight",
          "moe.router": "ffn_gate_inp.weight", "moe.shared.w_gate": "ffn_gate_shexp.weight",
          "moe.shared.w_up": "ffn_up_shexp.weight", "moe.shared.w_down": "ffn_down_shexp.weight",
          "moe.shared_gate": "ffn_gate_inp_shexp.weight"}


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
               metadata=None, drop=()):
    """Write `graph` (float or quantised weights) as an `arch` GGUF. qtype: a GGMLQuantizationType for every
    matrix (None: as stored). llama arch: q/k rows permuted as convert_hf_to_gguf does. extra_tensors: name ->
    (array, raw type or None). tokenizer: (model, tokens, scores, types, merges) or None."""
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
            w.add_tokenizer_pre("default")
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
        for ir, gname in _BLOCK.items():
            if p + ir in graph.weights:
                x = graph.weights[p + ir]
                if ir in perm:
                    x = x[perm[ir]] if not isinstance(x, QTensor) else QTensor(
                        dtype=x.dtype, rows=x.rows, cols=x.cols, scales=x.scales[perm[ir]], q=x.q[perm[ir]])
                if ir == "moe.shared_gate":
                    x = np.asarray(x).reshape(-1)
                tensors.append((f"blk.{i}.{gname}", x))
        if c.has_moe(i + 1):
            for role, gname in (("w_gate", "ffn_gate_exps"), ("w_up", "ffn_up_exps"), ("w_down", "ffn_down_exps")):
                tensors.append((f"blk.{i}.{gname}.weight",
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
