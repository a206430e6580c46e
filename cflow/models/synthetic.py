"""Deterministic random weights generated per tensor, quantised at birth: a model of any size without its floats.

    SyntheticWeights(config, seed=0)[name] -> QTensor (Q4) | float16 array (the embedding) | float32 array

A Mapping over the IR weight names of `config` (ir.build.weight_shapes), for `build_graph(config, weights)`:
compile_file and export_gguf then stream it one tensor at a time (nothing is cached here), so a 30 B-parameter
MoE is written without ever being in memory. Every tensor is a pure function of (seed, its name): any one can be
regenerated alone, in any order, and the .vflow and the GGUF of the same seed hold the same values.

What each weight is:
  matrices   Q4 (GGUF Q4_0) blocks drawn directly: codes q uniform on 0..15 (the weight is d * (q - 8), so -8..7),
      each block's fp16 scale d of a random sign and a magnitude d0 * (0.5 + v), v uniform on [0, 1): the sign makes
      every weight's distribution symmetric (mean 0; Q4_0 scales take either sign), d0 gives the standard deviation
      (weight_std). A Q4 source is what the file stores, so quantize_weights passes it through untouched, and no
      float copy of a matrix is ever made.
        attention (q, k, v, o)   0.02, the presets' nn.Linear init (models/reference.py)
        experts                  unit gain: 1/sqrt(fan_in) for gate and up, sqrt(top_k / fan_in) for down, so the
                                 normalised top-k mix adds about as much to the residual as attention does
                                 (measured RMS of the branches' outputs: attention 0.58-0.95, experts 0.56-0.76).
                                 The presets' U(+-1/sqrt(fan_in)) makes the expert branch 1/20 of the attention
                                 branch: a wrong expert would then move the logits by less than two engines' int8
                                 activation rounding does, and no check could see it.
        LM head                  0.2 (as the benchmark models: logits of std 9)
  tok_embeddings   float16, row t = CHAIN_GAIN (10) x the LM head's row t + 1 (mod vocab): the token's embedding
      points at the next id's head row, so the model counts (prompt ... 250 -> 251, 252, ...) with a top-2 logit
      margin of 181 (10 layers) or 75 (48 layers) against a logit std of 9, while the attention and experts still run on
      the whole context (the routing is the layers' own). Random heads give Gaussian logits whose top-2 gaps are
      ~0.2 std: two engines that round int8 activations differently (1-2% of the logits apart) then part at the
      first near-tie (cflow and llama.cpp on the 10-layer sibling with a random head and a small embedding: at
      the second greedy token, top-2 gap 0.09), and "the same tokens as llama.cpp" could not be asked.
      The residual stream starts at RMS 2 (the embedding) and grows to 3.7 after 10 layers, 7.6 after 48.
      (A tied-embedding config has no head to point at: its embedding is its own Q4 draw (std 0.02) as float16.)
  the router       float32 N(0, 0.02) (routers stay f32)
  norm weights     float32 1 + 0.01 N(0, 1)
Rows are drawn in chunks of ROW_CHUNK_WEIGHTS weights, chunk k from its own generator seeded by
(seed, blake2b(name), k), so generating a tensor holds one chunk's temporaries besides the result.

Speed: the codes come from the bit generator's raw 64-bit words (no per-weight float math). With NumPy's steps
(the default) an expert's matrix is drawn at ~1.6 GB/s of Q4 bytes on one core of this machine and the embedding
at ~0.5 GB/s (NumPy's float16 conversion, ~2 ns a value); with the native loops (Steps: codegen/pcg64.py draws
four PCG64 sequences at once, ~1 ns a word against random_raw's 1.8, codegen/half.py converts to float16 at ~10x
NumPy's speed; benchmarks/make_moe.py uses them) at ~3 GB/s and ~1.1 GB/s, the same values.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

import numpy as np

from ..ir.build import weight_shapes
from ..ir.config import ModelConfig
from ..layout.quant import BLOCK, DType, QTensor, dequantize
from ..util import prefetch_map, usable_cpus

ROW_CHUNK_WEIGHTS = 1 << 22  # weights per row chunk (its own generator): part of the definition of the values
STD = 0.02  # attention, router: the presets' N(0, 0.02) (nn.Linear)
HEAD_STD = 0.2  # the LM head
CHAIN_GAIN = 10.0  # the embedding of token t: CHAIN_GAIN x the LM head's row t + 1 (module docstring)
EMBED_WORKERS = 2  # threads filling the chain embedding's row chunks (independent: each its rows of `out`)
NORM_NOISE = 0.01  # norm weights: 1 + NORM_NOISE * N(0, 1)
CODE_VAR = 21.5  # E[(q - 8)^2] with q uniform on 0..15: (64 + 2 * (1 + 4 + ... + 49)) / 16
SCALE_MEAN_SQ = 13 / 12  # E[(0.5 + u)^2], u uniform on [0, 1)
_LOW_NIBBLES = 0x0F0F0F0F0F0F0F0F


def _numpy_to_half(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    if out is None:
        return np.asarray(x, np.float32).astype(np.float16)
    out[...] = x
    return out


def _numpy_raw_masked(bit_generator, n: int, mask: int) -> np.ndarray:
    q = bit_generator.random_raw(n)
    q &= np.uint64(mask)
    return q


class Steps(NamedTuple):
    """The generator's primitive steps, each a pure function of its inputs: NumPy's (NUMPY_STEPS, the default), or
    the same values from native loops (benchmarks/make_moe.py passes codegen/pcg64.py's and codegen/half.py's: a
    few times faster; models/ imports nothing above ir, so it does not pick them itself)."""

    uniform_f32: Callable  # (bit_generator, n) -> float32[n]: Generator.random(n, dtype=np.float32)
    raw_masked: Callable  # (bit_generator, n, mask) -> uint64[n]: random_raw(n) & mask
    to_half: Callable  # (float32 array, out=None) -> float16 array (into `out`): astype(np.float16)


NUMPY_STEPS = Steps(lambda bg, n: np.random.Generator(bg).random(n, dtype=np.float32), _numpy_raw_masked,
                    _numpy_to_half)


def name_seed(name: str) -> int:
    """A stable 64-bit seed of a weight name (blake2b: the same in every process, unlike hash())."""
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "little")


def weight_std(name: str, shape: tuple[int, ...], top_k: int = 1) -> float:
    """The standard deviation a matrix of this name and [out, in] shape is drawn with (module docstring)."""
    if name == "lm_head":
        return HEAD_STD
    if ".moe.experts." in name:  # unit gain; the down projection x sqrt(top_k) against the top-k mix's averaging
        return math.sqrt((top_k if name.endswith(".w_down") else 1) / shape[1])
    return STD


def _rng(seed: int, name: str, chunk: int) -> np.random.Generator:
    return np.random.default_rng([seed, name_seed(name), chunk])


def _row_chunks(rows: int, cols: int) -> Iterator[tuple[int, int, int]]:
    """(chunk index, first row, end row) of a [rows, cols] matrix."""
    step = max(1, ROW_CHUNK_WEIGHTS // max(cols, 1))
    for k, r0 in enumerate(range(0, rows, step)):
        yield k, r0, min(r0 + step, rows)


def q4_chunk(rng: np.random.Generator, rows: int, cols: int, std: float,
             steps: Steps = NUMPY_STEPS) -> tuple[np.ndarray, np.ndarray]:
    """One chunk of Q4 blocks: (fp16 scales [rows, nblk], codes u8 [rows, nblk, 32]), drawn from `rng`.

    Scales first, from one float32 u per block: d = d0 * copysign(0.5 + 2|u - 1/2|, u - 1/2) (the magnitude and
    the sign independent); then the codes: code j of a block is the low nibble of byte j of its four raw 64-bit
    words."""
    if cols % BLOCK:
        raise ValueError(f"synthetic Q4 weights need whole blocks of {BLOCK} inputs per row, got {cols}")
    nblk = cols // BLOCK
    d0 = np.float32(std / math.sqrt(CODE_VAR * SCALE_MEAN_SQ))
    u = steps.uniform_f32(rng.bit_generator, rows * nblk).reshape(rows, nblk)
    u -= np.float32(0.5)
    half = np.copysign(np.float32(0.5), u)
    u *= np.float32(2)
    u += half
    u *= d0
    scales = steps.to_half(u)
    q = steps.raw_masked(rng.bit_generator, rows * nblk * 4, _LOW_NIBBLES)  # 32 bytes per block, one code in
    # each byte's low nibble
    return scales, q.view(np.uint8).reshape(rows, nblk, BLOCK)


def synthetic_q4(seed: int, name: str, rows: int, cols: int, std: float, steps: Steps = NUMPY_STEPS) -> QTensor:
    """The Q4 matrix `name` of shape [rows, cols]: row chunks, each from its own generator."""
    chunks = list(_row_chunks(rows, cols))
    if len(chunks) == 1:  # an expert's matrix: one chunk, no copy
        scales, q = q4_chunk(_rng(seed, name, 0), rows, cols, std, steps)
        return QTensor(dtype=DType.Q4, rows=rows, cols=cols, scales=scales, q=q)
    nblk = cols // BLOCK
    scales = np.empty((rows, nblk), np.float16)
    q = np.empty((rows, nblk, BLOCK), np.uint8)
    for k, r0, r1 in chunks:
        scales[r0:r1], q[r0:r1] = q4_chunk(_rng(seed, name, k), r1 - r0, cols, std, steps)
    return QTensor(dtype=DType.Q4, rows=rows, cols=cols, scales=scales, q=q)


def chain_embedding(seed: int, rows: int, cols: int, steps: Steps = NUMPY_STEPS) -> np.ndarray:
    """The embedding, float16 [rows, cols]: row t = CHAIN_GAIN * the dequantised LM head's row (t + 1) mod rows,
    built from the head's own draws chunk by chunk, each chunk's rows landing one row up (the head's row 0 wraps
    to the last): the chunks are independent, so EMBED_WORKERS threads fill them (numpy releases the GIL)."""
    chunks = list(_row_chunks(rows, cols))
    out = np.empty((rows, cols), np.float16)

    def fill(k: int) -> None:  # CHAIN_GAIN x the dequantised rows of head chunk k, float32, then into `out`
        _, r0, r1 = chunks[k]
        s, q = q4_chunk(_rng(seed, "lm_head", k), r1 - r0, cols, HEAD_STD, steps)
        # (q - 8) x (d x CHAIN_GAIN) in float32 is exact, as (q - 8) x d x CHAIN_GAIN was: d has 11 significant
        # bits, so d x 10 has at most 15 and (q - 8) x d x 10 at most 19: one rounding, the f16 conversion's
        x = np.subtract(q, np.float32(8), dtype=np.float32)
        gain = s.astype(np.float32)
        gain *= np.float32(CHAIN_GAIN)
        x *= gain[..., None]
        x = x.reshape(r1 - r0, cols)
        if r0:
            steps.to_half(x, out[r0 - 1 : r1 - 1])
        else:
            steps.to_half(x[1:], out[: r1 - 1])
            steps.to_half(x[0], out[rows - 1])

    for _ in prefetch_map(fill, range(len(chunks)), workers=min(EMBED_WORKERS, usable_cpus()), name="cflow-embed"):
        pass
    return out


class GeneratedWeights(Mapping):
    """The weights of `config` by name, each generated by __getitem__ when looked up (subclasses) and never kept:
    the names and shapes answer membership, iteration and length without generating anything."""

    def __init__(self, config: ModelConfig, seed: int = 0):
        self.config, self.seed = config, int(seed)
        self.shapes: dict[str, tuple[int, ...]] = weight_shapes(config)

    def __contains__(self, name) -> bool:  # Mapping's default would generate the tensor to find out
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


class SyntheticWeights(GeneratedWeights):
    """Deterministic random weights of `config`, generated when looked up and never kept (module docstring); the
    values do not depend on `steps` (NumPy's or native loops: Steps), only the time they take."""

    def __init__(self, config: ModelConfig, seed: int = 0, steps: Steps = NUMPY_STEPS):
        super().__init__(config, seed)
        self.steps = steps

    def __getitem__(self, name: str):
        shape = self.shapes[name]  # KeyError for a name the model does not have
        if len(shape) == 1:
            w = _rng(self.seed, name, 0).standard_normal(shape, dtype=np.float32)
            w *= np.float32(NORM_NOISE)
            w += np.float32(1)
            return w
        rows, cols = shape
        if name.endswith(".router") or name.endswith(".shared_gate"):
            w = _rng(self.seed, name, 0).standard_normal(shape, dtype=np.float32)
            w *= np.float32(STD)
            return w
        if name == "tok_embeddings" and "lm_head" in self.shapes:
            return chain_embedding(self.seed, rows, cols, self.steps)
        q = synthetic_q4(self.seed, name, rows, cols, weight_std(name, shape, self.config.top_k), self.steps)
        return dequantize(q).astype(np.float16) if name == "tok_embeddings" else q  # a tied embedding: f16 too
