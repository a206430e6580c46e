"""The benchmark models: known geometries with fixed random weights, compiled once into out/bench/.

MODELS are the decode geometries (TinyLlama-1.1B's and smaller or MoE stand-ins): the same weights for every
engine and every run (seed 0, std 0.02; LM head 0.2, so that greedy tokens have clear margins; norms 1 + 0.01
N(0, 1)). GEOMETRIES are the arch2_4_combined MoE shapes of the disk-tier benchmarks (expert_tier, read_ahead).
"""

from __future__ import annotations

import hashlib
import os
import time
import warnings
from collections.abc import Mapping

import attrs
import numpy as np

from cflow.ir.config import ModelConfig
from cflow.models.synthetic import GeneratedWeights

from . import OUT

MODELS = {
    "tinyllama": ModelConfig(name="tinyllama_geometry", vocab_size=32000, d_model=2048, n_layers=22, n_heads=32,
                             n_kv_heads=4, ffn_dim=5632, max_seq_len=2048),
    # a smaller stand-in for quick checks (still larger than the 48 MiB L3 at Q4)
    "small": ModelConfig(name="llama_small_geometry", vocab_size=32000, d_model=1024, n_layers=8, n_heads=16,
                         n_kv_heads=4, ffn_dim=2816, max_seq_len=512),
    # a Mixtral-like MoE (8 experts, top 2, every layer), small enough to run in minutes: 1.0 GB at Q4
    "moe": ModelConfig(name="moe_geometry", vocab_size=32000, d_model=1024, n_layers=16, n_heads=16, n_kv_heads=4,
                       n_experts=8, top_k=2, expert_dim=3584, max_seq_len=2048),
    # a Mixtral-like MoE at >= 2 GB at Q4 (8 experts of 3584, top 2, every layer; TinyLlama's d/heads):
    # 3.84 G parameters, 2.26 GB at Q4 (4.15 GB at Q8), 640 MB streamed per token at Q4 with 2 of 8 experts.
    # Its f32 weights would be 15.4 GB: they are generated per tensor on access (LazyWeights), never all at once.
    "moe2g": ModelConfig(name="moe2g_geometry", vocab_size=32000, d_model=2048, n_layers=20, n_heads=32,
                         n_kv_heads=4, n_experts=8, top_k=2, expert_dim=3584, max_seq_len=2048),
}
# TinyLlama's geometry with a 4096-token context (benchmarks.long_context; benchmarks.decode --context)
MODELS["tinyllama_4k"] = attrs.evolve(MODELS["tinyllama"], name="tinyllama_geometry_4k", max_seq_len=4096)
LAZY_MODELS = {"moe2g"}  # geometries whose weights come from LazyWeights instead of random_weights


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    from cflow.ir.build import weight_shapes

    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in weight_shapes(config).items():
        if len(shape) == 1:
            out[name] = np.ones(shape, np.float32) + np.float32(0.01) * rng.standard_normal(shape, dtype=np.float32)
        else:
            # std 0.02, but 0.2 for the head: logits then spread enough that the greedy check has margins
            std = np.float32(0.2 if name == "lm_head" else 0.02)
            out[name] = std * rng.standard_normal(shape, dtype=np.float32)
    return out


def name_seed(name: str) -> int:
    """A stable 64-bit seed of a weight name (blake2b: the same in every process, unlike hash())."""
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "little")


class LazyWeights(GeneratedWeights):
    """Fixed random weights of `config`, each tensor generated when it is looked up (and not kept).

    Same names, shapes, dtype (f32) and distributions as random_weights (norms 1 + 0.01 N(0, 1), the LM head
    0.2 N(0, 1), every other matrix 0.02 N(0, 1)), but each tensor has its own generator seeded by
    (seed, blake2b of its name), so a tensor does not depend on the order or the others: a 3.8 G-parameter
    model is streamed one tensor at a time. Not the same values as random_weights (that one draws every
    tensor from one generator in order; the existing geometries keep it, their files and results depend on it).
    """

    def __getitem__(self, name: str) -> np.ndarray:
        shape = self.shapes[name]  # KeyError for a name the model does not have
        rng = np.random.default_rng([self.seed, name_seed(name)])
        if len(shape) == 1:
            return np.ones(shape, np.float32) + np.float32(0.01) * rng.standard_normal(shape, dtype=np.float32)
        std = np.float32(0.2 if name == "lm_head" else 0.02)
        out = rng.standard_normal(shape, dtype=np.float32)
        out *= std
        return out

    def nbytes(self) -> int:
        """f32 bytes of all the tensors (were they materialised at once)."""
        return 4 * sum(int(np.prod(s)) for s in self.shapes.values())


def model_weights(key: str, seed: int = 0) -> Mapping:
    """The benchmark's fixed random weights of MODELS[key]: LazyWeights for LAZY_MODELS, else random_weights."""
    config = MODELS[key]
    return LazyWeights(config, seed) if key in LAZY_MODELS else random_weights(config, seed)


def compiled_model(key: str, quant: str = "q4", weights: Mapping | None = None):
    """(path to the compiled file, lowered plan with the float source weights); builds the file once. `weights`:
    the float weights to use (default model_weights(key)), so that Q4 and Q8 files can share one set."""
    from cflow.compiler import compile_file, lower
    from cflow.ir import build_graph

    config = MODELS[key]
    path = os.path.join(OUT, f"{config.name}_{quant}.vflow")
    t0 = time.perf_counter()
    g = build_graph(config, model_weights(key) if weights is None else weights, name=config.name)
    c = lower(g, quant)
    print(f"# random weights + lowering: {time.perf_counter() - t0:.1f} s", flush=True)
    if os.path.exists(path):  # built from another version of this config (e.g. a longer context): rebuild
        from cflow.runtime.format import FileReader

        with FileReader(path) as r:
            if r.header.get("config") != g.config.to_dict():
                os.remove(path)
    if not os.path.exists(path):
        os.makedirs(OUT, exist_ok=True)
        info = compile_file(g, path, quant).file
        print(f"# compiled {path}: {info['file_bytes'] / 1e9:.2f} GB in {info['seconds']:.1f} s", flush=True)
    return path, c


# --- the disk-tier geometries (arch2_4_combined MoE) -----------------------------------------------------------
GEOMETRIES = {
    # the paper's screening size: the arch2_4_combined 114m preset (experts 0.88 MB each at Q4)
    "114m": dict(preset="114m"),
    # dense compute and expert reads of the same order on this machine (~1 GB/s disk, ~20 GB/s DRAM)
    "wide": dict(preset="114m", d_model=1024, n_heads=16, n_kv_heads=16, head_dim=64, ffn_dim=8192,
                 expert_dim=1024, n_layers=8, n_blocks=8, vocab_size=16384),
}


def compile_random(cfg, path: str, seed: int) -> str:
    """Compile cfg with fixed random weights (matrices N(0, 0.02), norms 1) to path at Q4, unless it exists."""
    if not os.path.exists(path):
        from cflow.compiler import compile_file
        from cflow.ir import build_graph
        from cflow.ir.build import weight_shapes

        rng = np.random.default_rng(seed)
        weights = {n: (rng.standard_normal(s).astype(np.float32) * 0.02 if len(s) == 2 else np.ones(s, np.float32))
                   for n, s in weight_shapes(cfg).items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile_file(build_graph(cfg, weights, name=cfg.name), path, "q4")
    return path


def geometry_config(geometry: str, **edits):
    """The arch2_4_combined config of a GEOMETRIES entry, with further config edits."""
    from cflow.models import get_preset

    g = dict(GEOMETRIES[geometry])
    return get_preset("arch2_4_combined", g.pop("preset")).evolve(**g, **edits)
