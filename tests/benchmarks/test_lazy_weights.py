"""benchmarks/common/models.py's LazyWeights (the per-tensor random weights of the >= 2 GB MoE geometry) and the
compile / GGUF paths streaming them one tensor at a time. Tiny configs only: no big allocation, no timing."""

import hashlib
import tracemalloc
from collections.abc import Mapping

import numpy as np
import pytest

from benchmarks.common import models
from cflow.ir.build import weight_shapes
from cflow.ir.config import ModelConfig

TINY = ModelConfig(name="tiny_lazy_moe", vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                   n_experts=4, top_k=2, expert_dim=256, max_seq_len=64)


class Counting(Mapping):
    """A view of `source` that counts lookups per name and records the bytes of each tensor handed out."""

    def __init__(self, source):
        self.source, self.calls = source, {}

    def __getitem__(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1
        return self.source[name]

    def __contains__(self, name):
        return name in self.source

    def __iter__(self):
        return iter(self.source)

    def __len__(self):
        return len(self.source)


def test_keys_shapes_dtype_and_distribution():
    w = models.LazyWeights(TINY)
    shapes = weight_shapes(TINY)
    assert list(w) == list(shapes) and len(w) == len(shapes)
    for name in ("norm", "blocks.1.moe.experts.3.w_down", "lm_head", "tok_embeddings", "blocks.0.moe.router"):
        a = w[name]
        assert a.shape == shapes[name] and a.dtype == np.float32 and a.flags.c_contiguous
    assert abs(float(w["norm"].mean()) - 1) < 0.01 and 0.005 < float(w["norm"].std()) < 0.02
    assert 0.18 < float(w["lm_head"].std()) < 0.22
    assert 0.018 < float(w["blocks.0.attn.wq"].std()) < 0.022
    assert w.nbytes() == 4 * sum(int(np.prod(s)) for s in shapes.values())
    with pytest.raises(KeyError):
        w["blocks.9.attn.wq"]
    assert "lm_head" in w and "nope" not in w


def test_deterministic_and_independent_of_order():
    a, b = models.LazyWeights(TINY), models.LazyWeights(TINY)
    x = a["blocks.1.attn.wk"]
    a["lm_head"], a["blocks.0.moe.experts.2.w_up"]  # other lookups in between change nothing
    assert np.array_equal(x, a["blocks.1.attn.wk"]) and np.array_equal(x, b["blocks.1.attn.wk"])
    assert a["blocks.1.attn.wk"] is not a["blocks.1.attn.wk"]  # nothing cached: a fresh array each time
    assert not np.array_equal(a["blocks.0.attn.wk"], x[: a["blocks.0.attn.wk"].shape[0]])  # per-name seeds
    assert not np.array_equal(models.LazyWeights(TINY, seed=1)["blocks.1.attn.wk"], x)
    # the seed is a stable hash of the name (blake2b), not Python's salted hash(): a fixed value
    assert models.name_seed("lm_head") == int.from_bytes(
        hashlib.blake2b(b"lm_head", digest_size=8).digest(), "little")


def test_one_lookup_materialises_one_tensor():
    w = models.LazyWeights(TINY)
    one = 4 * int(np.prod(weight_shapes(TINY)["lm_head"]))  # 128 KiB; the whole model is ~40x that
    tracemalloc.start()
    try:
        x = w["lm_head"]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert x.nbytes == one and peak < 2.5 * one < w.nbytes() / 8


def test_existing_geometries_keep_random_weights():
    assert models.LAZY_MODELS == {"moe2g"}
    for key in models.MODELS:
        if key not in models.LAZY_MODELS:
            assert models.MODELS[key].name != models.MODELS["moe2g"].name
    small = ModelConfig(name="s", vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64,
                        max_seq_len=16)
    r = models.random_weights(small)
    h = hashlib.sha256()
    for k, v in r.items():
        h.update(k.encode())
        h.update(v.tobytes())
    # the fingerprint of random_weights before LazyWeights was added (git show aaaa4a3:benchmarks/decode.py)
    assert isinstance(r, dict) and h.hexdigest()[:16] == "f730e5e13c2db7d8"


def test_moe2g_is_mixtral_like_and_2_to_2_5_gb_at_q4():
    from cflow.compiler import lower
    from cflow.ir import build_graph

    c = models.MODELS["moe2g"]
    assert (c.n_experts, c.top_k, c.vocab_size) == (8, 2, 32000)
    assert all(c.has_moe(layer) and not c.has_dense(layer) for layer in range(1, c.n_layers + 1))
    plan = lower(build_graph(c, None), "q4")
    file_bytes = sum(t.nbytes for t in plan.tensors.values())
    assert 2.0e9 <= file_bytes <= 2.5e9


def test_compile_and_gguf_export_stream_each_weight_once(tmp_path):
    """compile_file and export_gguf on LazyWeights look each weight up at most once per output tensor it feeds
    (no whole-model materialisation), and write the same bytes as from a dict of the same tensors."""
    from cflow.compiler import compile_file, lower
    from cflow.ir import build_graph

    lazy = Counting(models.LazyWeights(TINY))
    compile_file(build_graph(TINY, lazy, name=TINY.name), tmp_path / "lazy.vflow", "q4")
    assert set(lazy.calls) == set(weight_shapes(TINY)) and max(lazy.calls.values()) == 1
    eager = {k: models.LazyWeights(TINY)[k] for k in weight_shapes(TINY)}
    compile_file(build_graph(TINY, eager, name=TINY.name), tmp_path / "eager.vflow", "q4")
    assert (tmp_path / "lazy.vflow").read_bytes() == (tmp_path / "eager.vflow").read_bytes()

    pytest.importorskip("gguf")
    from cflow.runtime.format.gguf import export_gguf

    lazy.calls.clear()
    export_gguf(lower(build_graph(TINY, lazy, name=TINY.name), "q4").graph, tmp_path / "lazy.gguf")
    assert max(lazy.calls.values()) == 1
    export_gguf(lower(build_graph(TINY, eager, name=TINY.name), "q4").graph, tmp_path / "eager.gguf")
    assert (tmp_path / "lazy.gguf").read_bytes() == (tmp_path / "eager.gguf").read_bytes()
