"""The five pipeline-native candidates of the paper (our reading, docs/DESIGN.md) at every size.

All presets share one geometry per size, so they differ only in the DAG (delays, routing point,
weight sharing). `114m` approximates the paper's 114M screening model (d_model 512, 6 layers,
8 experts top-2); `tiny` is for tests; `small` is the size trained on this 2-core machine.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..ir.config import ModelConfig

# Geometry per size. 114m: vocab 12288 (untied head) with MHA 8x64, dense FFN 2048 and 8 experts of
# width 1024 gives 113.3M stored parameters (see docs/analysis.md; `ModelConfig.n_params`).
SIZES: dict[str, dict] = {
    "tiny": dict(vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=96,
                 n_experts=4, top_k=2, expert_dim=64, max_seq_len=128),
    # small: trained on the 2-core machine in ~10 min and bundled (3.3M params, 6.6 MB in f16); vocab 2048
    # = the byte-level BPE trained on TinyStories (docs/architectures.md).
    "small": dict(vocab_size=2048, d_model=128, n_layers=6, n_heads=4, n_kv_heads=4, ffn_dim=256,
                  n_experts=4, top_k=2, expert_dim=192, max_seq_len=256),
    "114m": dict(vocab_size=12288, d_model=512, n_layers=6, n_heads=8, n_kv_heads=8, ffn_dim=2048,
                 n_experts=8, top_k=2, expert_dim=1024, max_seq_len=1024),
}

# Preset -> what distinguishes it (docs/DESIGN.md's table).
ARCHS: dict[str, dict] = {
    "arch1": dict(dense_delay=0, expert_delay=0, routing="post"),
    "arch2_4_combined": dict(dense_delay=1, expert_delay=2, routing="post"),
    "arch3": dict(dense_delay=0, expert_delay=0, routing="pre"),
    "arch4_async_experts": dict(dense_delay=0, expert_delay=2, routing="pre"),
    "arch5_shared": dict(dense_delay=1, expert_delay=2, routing="post", share=2),
}


def _make(arch: str, size: str) -> ModelConfig:
    spec = dict(ARCHS[arch])
    share = spec.pop("share", 1)
    geo = SIZES[size]
    return ModelConfig(name=arch, n_blocks=geo["n_layers"] // share, **geo, **spec)


PRESETS: dict[str, dict[str, ModelConfig]] = {a: {s: _make(a, s) for s in SIZES} for a in ARCHS}


def get_preset(name: str, size: str = "tiny") -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}: expected one of {', '.join(PRESETS)}")
    if size not in PRESETS[name]:
        raise ConfigError(f"unknown size {size!r} for preset {name}: expected one of {', '.join(PRESETS[name])}")
    return PRESETS[name][size]


def parse_preset_spec(spec: str, default_size: str = "114m") -> tuple[str, str]:
    """'preset:NAME[@SIZE]' or 'NAME[@SIZE]' -> (name, size)."""
    body = spec.split(":", 1)[1] if spec.startswith("preset:") else spec
    name, _, size = body.partition("@")
    get_preset(name, size or default_size)
    return name, size or default_size
