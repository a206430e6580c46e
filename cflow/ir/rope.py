"""RoPE frequencies: the one function every consumer of RoPE tables uses (interpreter, runtime session).

    inv_freq(head_dim, theta, scaling, rope_dim, context) -> (f32[head_dim / 2], attention_factor)
    rope_tables(config, n_pos) -> (cos, sin) f32[n_pos, head_dim / 2], attention factor folded in

Convention: rotate-half (as Hugging Face): dimension i of a head pairs with i + head_dim/2 and turns by
position * inv_freq[i]. A partial rotary embedding (rope_dim < head_dim) is expressed with zero
frequencies for the pairs past rope_dim/2 (cos 1, sin 0: those dimensions pass through); frontends
reorder the q/k rows so that the rotated dimensions are the first rope_dim/2 of each half.

Scaling (`ModelConfig.rope_scaling`, a canonical tuple of (key, value) pairs; `scaling_dict` reads it),
all static at compile time, computed as transformers 5 does in float32:
  linear    inv /= factor
  dynamic   NTK base for the compiled context: base * (factor * L / orig - (factor - 1)) ** (d / (d - 2)),
            L = max(context, orig); for context <= orig (the usual case) this is default RoPE, exactly
  llama3    wavelength-dependent: low frequencies / factor, high kept, a smooth ramp between
  yarn      per-dimension blend of interpolation and extrapolation, and an attention factor on cos/sin
  longrope  inv /= short_factor (or long_factor when the compiled context exceeds the original one, as
            llama.cpp chooses by context), and an attention factor on cos/sin
The attention factor multiplies cos and sin (so q.k scores by its square), as transformers does.
"""

from __future__ import annotations

import math

import numpy as np

ROPE_TYPES = ("linear", "dynamic", "llama3", "yarn", "longrope")
# rope_type -> (required keys, optional keys) of its parameters
ROPE_KEYS: dict[str, tuple[frozenset, frozenset]] = {
    "linear": (frozenset({"factor"}), frozenset()),
    "dynamic": (frozenset({"factor", "original_max_position_embeddings"}), frozenset()),
    "llama3": (frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
               frozenset()),
    "yarn": (frozenset({"factor", "original_max_position_embeddings"}),
             frozenset({"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"})),
    "longrope": (frozenset({"short_factor", "long_factor", "original_max_position_embeddings"}),
                 frozenset({"factor", "attention_factor"})),
}


def scaling_dict(scaling) -> dict | None:
    """The canonical tuple of a config/node back to a dict (lists for the longrope factors)."""
    if not scaling:
        return None
    return {k: list(v) if isinstance(v, tuple) else v for k, v in scaling}


def scaling_label(scaling) -> str:
    """Short text for the printed IR: 'llama3(factor=8)', 'longrope(short, orig=4096)'."""
    d = scaling_dict(scaling)
    if d is None:
        return ""
    parts = [f"factor={d['factor']:g}"] if isinstance(d.get("factor"), (int, float)) else []
    if "original_max_position_embeddings" in d:
        parts.append(f"orig={d['original_max_position_embeddings']}")
    if "attention_factor" in d:
        parts.append(f"attn_factor={d['attention_factor']:.6g}")
    return f"{d['rope_type']}({', '.join(parts)})"


def _default(theta: float, dim: int) -> np.ndarray:
    # float32 as transformers: 1 / base ** (arange(0, dim, 2).float() / dim)
    return (1.0 / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))).astype(np.float32)


def yarn_attention_factor(factor: float, mscale=None, mscale_all_dim=None) -> float:
    def get(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return float(get(factor, mscale) / get(factor, mscale_all_dim))
    return get(factor)


def longrope_attention_factor(factor: float, original: int) -> float:
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def inv_freq(head_dim: int, theta: float, scaling=None, rope_dim: int | None = None,
             context: int | None = None) -> tuple[np.ndarray, float]:
    """(inverse frequencies f32[head_dim / 2], attention factor) of one attention layer."""
    rd = int(rope_dim or head_dim)
    d = scaling_dict(scaling) or {"rope_type": "default"}
    kind = d["rope_type"]
    factor_attn = 1.0
    if kind == "default":
        inv = _default(theta, rd)
    elif kind == "linear":
        inv = (_default(theta, rd) / np.float32(d["factor"])).astype(np.float32)
    elif kind == "dynamic":
        orig, f = int(d["original_max_position_embeddings"]), float(d["factor"])
        L = max(int(context or orig), orig)
        base = theta * ((f * L / orig) - (f - 1)) ** (rd / (rd - 2))
        inv = _default(base, rd)
    elif kind == "llama3":
        inv = _default(theta, rd)
        f, lo, hi = float(d["factor"]), float(d["low_freq_factor"]), float(d["high_freq_factor"])
        old = float(d["original_max_position_embeddings"])
        wavelen = (2 * math.pi / inv).astype(np.float32)
        scaled = np.where(wavelen > old / lo, inv / np.float32(f), inv).astype(np.float32)
        smooth = ((old / wavelen - lo) / (hi - lo)).astype(np.float32)
        smoothed = ((1 - smooth) * scaled / np.float32(f) + smooth * scaled).astype(np.float32)
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    elif kind == "yarn":
        f, orig = float(d["factor"]), int(d["original_max_position_embeddings"])
        factor_attn = d.get("attention_factor")
        if factor_attn is None:
            factor_attn = yarn_attention_factor(f, d.get("mscale"), d.get("mscale_all_dim"))
        beta_fast, beta_slow = d.get("beta_fast") or 32, d.get("beta_slow") or 1

        def corr_dim(rot):
            return (rd * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

        low, high = corr_dim(beta_fast), corr_dim(beta_slow)
        if d.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rd - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(rd // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
        pos_freqs = (np.float32(theta) ** (np.arange(0, rd, 2, dtype=np.float32) / np.float32(rd))).astype(np.float32)
        extra, inter = (1.0 / pos_freqs).astype(np.float32), (1.0 / (np.float32(f) * pos_freqs)).astype(np.float32)
        keep = (1 - ramp).astype(np.float32)
        inv = (inter * (1 - keep) + extra * keep).astype(np.float32)
    elif kind == "longrope":
        orig = int(d["original_max_position_embeddings"])
        long = context is not None and int(context) > orig
        ext = np.asarray(d["long_factor"] if long else d["short_factor"], dtype=np.float32)
        shape = np.arange(0, rd, 2, dtype=np.float32) / np.float32(rd)
        inv = (1.0 / (ext * np.float32(theta) ** shape)).astype(np.float32)
        factor_attn = d.get("attention_factor")
        if factor_attn is None:
            factor_attn = longrope_attention_factor(float(d.get("factor") or 1.0), orig)
    else:
        raise ValueError(f"unknown rope_type {kind!r}")
    out = np.zeros(head_dim // 2, np.float32)
    out[: rd // 2] = inv[: rd // 2]
    return out, float(factor_attn)


def tables(inv: np.ndarray, attention_factor: float, positions, rotated: int | None = None) -> tuple[np.ndarray,
                                                                                                   np.ndarray]:
    """cos, sin f32[len(positions), len(inv)]; the first `rotated` pairs (default all) times the attention
    factor (pass-through pairs of a partial rotary embedding stay cos 1, sin 0, as transformers leaves them)."""
    ang = np.asarray(positions, dtype=np.float32)[:, None] * inv[None, :].astype(np.float32)
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    if attention_factor != 1.0:
        r = len(inv) if rotated is None else rotated
        f = np.float32(attention_factor)
        cos[:, :r] *= f
        sin[:, :r] *= f
    return cos, sin


def layer_rope(config, layer: int) -> tuple[float, tuple | None]:
    """(theta, scaling) of 1-based `layer`: sliding-window layers of a model with local_rope_theta use
    default RoPE at that base (Gemma 3), every other layer the model's RoPE."""
    if config.local_rope_theta and config.is_sliding(layer):
        return float(config.local_rope_theta), None
    return float(config.rope_theta), config.rope_scaling


ROPE_CHUNK = 1 << 16  # positions computed at once by rope_tables: its temporaries stay a few MiB


def rope_tables(config, n_pos: int, layer: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin f32[n_pos, head_dim / 2] of the model's RoPE (the runtime's tables; layer picks local RoPE).
    Filled ROPE_CHUNK positions at a time, so a long context needs the two tables and little more (computed
    whole, the angles and the float copies took about 2.5 times the tables' size at once)."""
    theta, scaling = layer_rope(config, layer)
    inv, f = inv_freq(config.head_dim, theta, scaling, config.rope_dim, config.max_seq_len)
    cos, sin = np.empty((n_pos, inv.size), np.float32), np.empty((n_pos, inv.size), np.float32)
    for lo in range(0, n_pos, ROPE_CHUNK):
        hi = min(n_pos, lo + ROPE_CHUNK)
        cos[lo:hi], sin[lo:hi] = tables(inv, f, np.arange(lo, hi), config.rope_dim // 2)
    return cos, sin
