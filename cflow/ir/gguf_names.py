"""The IR's weights as llama.cpp's GGUF files name and order them: one table for the importer and the exporter.

    GLOBAL_TENSORS    IR weight -> GGUF tensor outside the blocks
    BLOCK_TENSORS     IR weight in blocks.N -> GGUF tensor in blk.N
    EXPERT_TENSORS    expert matrix -> the GGUF tensor in blk.N stacking it for every expert ([E, rows, cols])
    rope_row_permutation(n_heads, head_dim)   Hugging Face q/k rows -> llama.cpp's adjacent-pair RoPE order
    rope_row_unpermutation(n_heads, head_dim) its inverse

frontend/gguf.py reads a GGUF through these names, runtime/format/gguf.py writes one; neither imports the
other (frontend and runtime are separate stages), so the names live with the weights they name.
"""

from __future__ import annotations

import numpy as np

GLOBAL_TENSORS = {"tok_embeddings": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}

BLOCK_TENSORS = {
    "attn_norm": "attn_norm.weight",
    "attn.wq": "attn_q.weight",
    "attn.wk": "attn_k.weight",
    "attn.wv": "attn_v.weight",
    "attn.wo": "attn_output.weight",
    "attn.bq": "attn_q.bias",
    "attn.bk": "attn_k.bias",
    "attn.bv": "attn_v.bias",
    "attn.q_norm": "attn_q_norm.weight",
    "attn.k_norm": "attn_k_norm.weight",
    "ffn_norm": "ffn_norm.weight",
    "moe_norm": "ffn_norm.weight",  # layers with experts: the norm before the router (llama.cpp has one name)
    "ffn.w_gate": "ffn_gate.weight",
    "ffn.w_up": "ffn_up.weight",
    "ffn.w_down": "ffn_down.weight",
    "moe.router": "ffn_gate_inp.weight",
    "moe.shared.w_gate": "ffn_gate_shexp.weight",
    "moe.shared.w_up": "ffn_up_shexp.weight",
    "moe.shared.w_down": "ffn_down_shexp.weight",
    "moe.shared_gate": "ffn_gate_inp_shexp.weight",
    "attn.post_norm": "post_attention_norm.weight",  # Gemma 2/3 sandwich norms
    "ffn.post_norm": "post_ffw_norm.weight",
}
# the norm a layer's FFN or expert bank reads: one GGUF name for two IR weights, told apart by the layer's kind
FFN_NORMS = ("ffn_norm", "moe_norm")

EXPERT_TENSORS = {"w_gate": "ffn_gate_exps.weight", "w_up": "ffn_up_exps.weight", "w_down": "ffn_down_exps.weight"}


def rope_row_permutation(n_heads: int, head_dim: int) -> np.ndarray:
    """Row order that turns Hugging Face's rotate-half q/k projections into llama.cpp's adjacent-pair layout (as
    convert_hf_to_gguf.py reorders the `llama` architecture's rows): output row h*head_dim + 2i + j is input row
    h*head_dim + j*(head_dim/2) + i (j in {0, 1}). Only whole rows move, so quantised blocks keep their bytes."""
    half = head_dim // 2
    h, i, j = np.meshgrid(np.arange(n_heads), np.arange(half), np.arange(2), indexing="ij")
    return (h * head_dim + j * half + i).reshape(-1)


def rope_row_unpermutation(n_heads: int, head_dim: int) -> np.ndarray:
    """The inverse of rope_row_permutation: llama.cpp's adjacent-pair rows back to Hugging Face's rotate-half."""
    return np.argsort(rope_row_permutation(n_heads, head_dim))
