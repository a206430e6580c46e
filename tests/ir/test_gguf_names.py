"""The one table of llama.cpp's GGUF tensor names and the one q/k RoPE row order, which the GGUF importer
(frontend/gguf.py) and exporter (runtime/format/gguf.py) both read."""

import numpy as np

from cflow.ir.build import weight_shapes
from cflow.ir.config import ModelConfig
from cflow.ir.gguf_names import BLOCK_TENSORS, EXPERT_TENSORS, FFN_NORMS, rope_row_permutation, rope_row_unpermutation


def test_rope_row_permutation_pairs_halves():
    perm = rope_row_permutation(2, 8)
    # head 0: rows (0, 4), (1, 5), (2, 6), (3, 7) become adjacent pairs; head 1 likewise, offset by 8
    assert perm.tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]


def test_rope_row_unpermutation_is_the_inverse():
    for heads, hd in ((1, 2), (2, 8), (3, 64)):
        fwd, inv = rope_row_permutation(heads, hd), rope_row_unpermutation(heads, hd)
        rows = np.arange(heads * hd)
        assert (rows[fwd][inv] == rows).all() and (rows[inv][fwd] == rows).all()


def test_every_gguf_name_but_the_ffn_norm_names_one_weight():
    names = [g for ir, g in BLOCK_TENSORS.items() if ir not in FFN_NORMS]
    assert len(names) == len(set(names))
    assert {BLOCK_TENSORS[n] for n in FFN_NORMS} == {"ffn_norm.weight"}


def test_every_block_weight_of_a_moe_model_has_a_name():
    c = ModelConfig(name="t", vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64,
                    n_experts=4, top_k=2, expert_dim=32, shared_expert_dim=32, shared_expert_gate=True,
                    dense_layers=[1], moe_layers=[2], qk_norm="head", max_seq_len=16)
    for name in weight_shapes(c):
        if name.startswith("blocks."):
            rest = name.split(".", 2)[2]
            assert rest in BLOCK_TENSORS or rest.split(".")[-1] in EXPERT_TENSORS, name
