"""Weight dtypes and their NumPy reference quantisers: the oracle every fast kernel is tested against.

Q4 and Q8 have exactly the numerics of GGUF's Q4_0 and Q8_0, so weights we write can be exported
bit-identically to GGUF for side-by-side runs with llama.cpp. Blocks run along the input (last) axis.

    Q4 (Q4_0): 32 weights -> fp16 d + 16 bytes of nibbles = 18 B (4.5 bits/weight)
               d = (element of largest magnitude) / -8;  q = clip(trunc(x/d + 8.5), 0, 15);  x' = (q - 8) * d
    Q8 (Q8_0): 32 weights -> fp16 d + 32 int8 = 34 B (8.5 bits/weight)
               d = amax / 127;  q = round-half-away(x/d);  x' = q * d
    F16: 2 B/weight.  F32: 4 B/weight.

NOTE: as in ggml, q is computed with the float32 d; only the stored (and dequantised) d is fp16.
The in-memory form of a quantised matrix here is (scales f16[rows, nblk], q[rows, nblk, 32]) with
q unsigned 0..15 for Q4 and int8 for Q8: the tile packer rearranges it, the interpreter dequantises it.
"""

from __future__ import annotations

import enum

import attrs
import numpy as np

from . import QUANTS, STORED

BLOCK = 32  # inputs per quantisation block (Q4_0 / Q8_0)


class DType(enum.IntEnum):
    """Weight storage types. Values are file-format ids: never reuse a removed id.

    F32, F16, Q4 (GGUF's Q4_0) and Q8 (Q8_0) are the types cflow quantises to (--quant); the others are GGUF block
    types kept as a GGUF file stores them (layout/blocks.py), id 100 + the type's ggml id; IQ4_128, IQ4_192, Q3_128
    and Q3_192 are cflow's own block types (ids from 200; layout/blocks.py says what they hold), written by its
    quantiser only."""

    F32 = 0
    F16 = 1
    Q8 = 8
    Q4 = 4
    Q4_1 = 103
    Q5_0 = 106
    Q5_1 = 107
    Q2_K = 110
    Q3_K = 111
    Q4_K = 112
    Q5_K = 113
    Q6_K = 114
    IQ4_NL = 120
    IQ4_XS = 123
    IQ4_128 = 200
    IQ4_192 = 201
    Q3_128 = 202
    Q3_192 = 203
    MIXED = 255  # a file's tensor-table type of a stream whose parts differ in type (its packing entry says each)

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def quantised(self) -> bool:
        """Read through int8 activation blocks (every weight type but F32 / F16)."""
        return self not in (DType.F32, DType.F16, DType.MIXED)

    @property
    def gguf_name(self) -> str:
        """llama.cpp's name of the type (Q4_0 for Q4, Q8_0 for Q8)."""
        return {DType.Q4: "Q4_0", DType.Q8: "Q8_0"}.get(self, self.name)

    @classmethod
    def parse(cls, text: str) -> DType:
        key = str(text).upper()
        key = {"Q4_0": "Q4", "Q8_0": "Q8"}.get(key, key)
        try:
            return cls[key]
        except KeyError:
            raise ValueError(f"unknown quantisation {text!r} (expected one of "
                             f"{', '.join(d.label for d in QUANT_TARGETS)})") from None


QUANT_TARGETS = tuple(DType.parse(q) for q in QUANTS if q != STORED)  # what quantize() (and cflowc --quant) produce


# dtype -> (elements per block, bytes per block); sizes written as field sums.
BLOCK_SIZES: dict[DType, tuple[int, int]] = {
    DType.F32: (1, 4),
    DType.F16: (1, 2),
    DType.Q8: (BLOCK, 2 + BLOCK),  # fp16 d + 32 x int8
    DType.Q4: (BLOCK, 2 + BLOCK // 2),  # fp16 d + 32 x 4-bit
}
BLOCK_SIZES.update({DType.Q4_1: (32, 20), DType.Q5_0: (32, 22), DType.Q5_1: (32, 24), DType.IQ4_NL: (32, 18),
                    DType.Q2_K: (256, 84), DType.Q3_K: (256, 110), DType.Q4_K: (256, 144), DType.Q5_K: (256, 176),
                    DType.Q6_K: (256, 210), DType.IQ4_XS: (256, 136),  # ggml-common.h's block structs
                    DType.IQ4_128: (128, 68), DType.IQ4_192: (192, 102),  # cflow's own (layout/blocks.py)
                    DType.Q3_128: (128, 52), DType.Q3_192: (192, 78)})
assert BLOCK_SIZES[DType.Q4][1] == 18 and BLOCK_SIZES[DType.Q8][1] == 34


def padded(n: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= n (shapes are zero-padded, never rejected)."""
    return -(-n // multiple) * multiple


def matrix_bytes(rows: int, cols: int, dtype: DType) -> int:
    """Bytes of a [rows, cols] matrix stored at `dtype` (input axis padded to whole blocks)."""
    n, b = BLOCK_SIZES[dtype]
    return rows * (padded(cols, n) // n) * b


@attrs.frozen(eq=False)
class QTensor:
    """A quantised 2-D weight [rows, cols]: per-block fp16 scales and the integer codes.

    scales: f16[rows, nblk]; q: u8[rows, nblk, 32] (Q4, 0..15) or i8[rows, nblk, 32] (Q8).
    cols is the logical width; the last block is zero-padded.
    """

    dtype: DType
    rows: int
    cols: int
    scales: np.ndarray
    q: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return matrix_bytes(self.rows, self.cols, self.dtype)

    def dequantize(self) -> np.ndarray:
        return dequantize(self)


def _blocks(x: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> float32 [rows, nblk, 32], zero-padded along cols."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"quantise expects a 2-D matrix, got shape {x.shape}")
    rows, cols = x.shape
    pc = padded(cols, BLOCK)
    if pc != cols:
        x = np.concatenate([x, np.zeros((rows, pc - cols), np.float32)], axis=1)
    return x.reshape(rows, pc // BLOCK, BLOCK)


def _round_half_away(x: np.ndarray) -> np.ndarray:
    # ggml's roundf: halves round away from zero (np.round would round to even).
    a = np.abs(x)
    f = np.floor(a)
    return np.sign(x) * (f + np.floor(2 * (a - f)))


CHUNK_ELEMS = 1 << 22  # quantise ~4M weights at a time: temporaries stay ~16 MB whatever the matrix


def quantize(x: np.ndarray, dtype: DType | str) -> QTensor | np.ndarray:
    """Quantise a 2-D float matrix. F32/F16 return plain arrays; Q4/Q8 return a QTensor."""
    dtype = DType.parse(dtype) if isinstance(dtype, str) else DType(dtype)
    if dtype not in QUANT_TARGETS:
        raise ValueError(f"cflow does not quantise to {dtype.gguf_name}: a {dtype.gguf_name} tensor is kept as a GGUF "
                         "stores it, or requantised to q4 / q8 / f16 / f32")
    if dtype == DType.F32:
        return np.ascontiguousarray(x, dtype=np.float32)
    if dtype == DType.F16:
        return np.ascontiguousarray(x, dtype=np.float16)
    rows, cols = np.shape(x)
    step = max(1, CHUNK_ELEMS // max(cols, 1))
    if rows > step:  # row chunks: blocks never span rows, so this changes nothing but peak memory
        parts = [_quantize_rows(x[r : r + step], dtype) for r in range(0, rows, step)]
        return QTensor(dtype=dtype, rows=rows, cols=cols, scales=np.concatenate([p.scales for p in parts]),
                       q=np.concatenate([p.q for p in parts]))
    return _quantize_rows(x, dtype)


def _quantize_rows(x: np.ndarray, dtype: DType) -> QTensor:
    rows, cols = np.shape(x)
    b = _blocks(x)
    if dtype == DType.Q4:
        imax = np.abs(b).argmax(axis=-1)[..., None]
        d = np.take_along_axis(b, imax, axis=-1) / np.float32(-8)
        with np.errstate(divide="ignore"):
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
        q = np.trunc(b * inv + np.float32(8.5)).astype(np.float32)
        q = np.clip(q.astype(np.uint8), 0, 15).astype(np.uint8)
    else:
        d = np.abs(b).max(axis=-1, keepdims=True) / np.float32(127)
        with np.errstate(divide="ignore"):
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
        q = _round_half_away(b * inv).astype(np.int8)
    return QTensor(dtype=dtype, rows=rows, cols=cols, scales=d[..., 0].astype(np.float16), q=q)


def dequantize(t) -> np.ndarray:
    """float32 [rows, cols] from any stored weight (a float array, a QTensor or a blocks.BlockTensor)."""
    if hasattr(t, "raw") and hasattr(t, "format"):  # a BlockTensor (layout/blocks.py imports this module)
        return t.dequantize()
    if not isinstance(t, QTensor):
        return np.asarray(t, dtype=np.float32)
    codes = t.q.astype(np.float32)
    if t.dtype == DType.Q4:
        codes -= 8.0
    x = codes * t.scales.astype(np.float32)[..., None]
    return x.reshape(t.rows, -1)[:, : t.cols]


def dequantize_rows(t, rows) -> np.ndarray:
    """dequantize(t)[rows], dequantising only those rows (each row is its own blocks)."""
    if hasattr(t, "take_rows"):
        return t.take_rows(rows).dequantize()
    if isinstance(t, QTensor):
        rows = np.asarray(rows)
        return dequantize(QTensor(dtype=t.dtype, rows=rows.size, cols=t.cols, scales=t.scales[rows], q=t.q[rows]))
    return np.asarray(np.asarray(t)[rows], dtype=np.float32)


def to_gguf_bytes(t: QTensor) -> np.ndarray:
    """The GGUF block bytes of a Q4/Q8 tensor, u8[rows, nblk * block_bytes] (for export and tests).

    Each field is written as one long strided copy over all blocks (the fp16 scale, then each 8 bytes of codes),
    not per block: NumPy's loops over a block's 2 + 16 bytes cost more per call than the copy itself."""
    nblk = t.scales.shape[1]
    n, per = t.rows * nblk, BLOCK_SIZES[t.dtype][1]
    out = np.empty(n * per, np.uint8)

    def field(dtype, offset: int) -> np.ndarray:  # one field of every block: a strided view into `out`
        return np.ndarray((n,), dtype, out, offset, (per,))

    field(np.uint16, 0)[...] = np.ascontiguousarray(t.scales).view(np.uint16).reshape(n)
    q64 = np.ascontiguousarray(t.q).view(np.uint64).reshape(n, BLOCK // 8)
    if t.dtype == DType.Q4:  # byte j = code j | code 16 + j << 4; codes < 16, so 8 bytes combine per operation
        m = np.empty(n, np.uint64)
        for h in (0, 1):
            np.left_shift(q64[:, 2 + h], np.uint64(4), out=m)
            np.bitwise_or(m, q64[:, h], out=m)
            field(np.uint64, 2 + 8 * h)[...] = m
    else:
        for h in range(BLOCK // 8):
            field(np.uint64, 2 + 8 * h)[...] = q64[:, h]
    return out.reshape(t.rows, nblk * per)


def quantize_activation_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Emulate the kernels' int8 activation blocks: x f32[..., n] -> (q int8[..., nblk, 32], d f32[..., nblk]).

    Like llama.cpp's Q8 activations (d = amax/127, round half away), but d is kept in float32:
    the kernels hold the activation scale in a register, never round it to fp16.
    """
    x = np.asarray(x, dtype=np.float32)
    n = x.shape[-1]
    pn = padded(n, BLOCK)
    if pn != n:
        x = np.concatenate([x, np.zeros(x.shape[:-1] + (pn - n,), np.float32)], axis=-1)
    b = x.reshape(x.shape[:-1] + (pn // BLOCK, BLOCK))
    d = np.abs(b).max(axis=-1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    q = _round_half_away(b * inv[..., None]).astype(np.int8)
    return q, d.astype(np.float32)


# The activation entering a quantised matrix, a load-time choice (cflow.load(activations=...)):
#   q8    one int8 plane per block of 32 (quantize_activation_q8): llama.cpp's Q8_0 pairing, scale in f32
#   q8x2  two int8 planes on one scale for the 32-input block types (TWO_PLANE_TYPES), x ~ d (q1 + q2 / 256)
#         (quantize_activation_q8x2): about 15 bits, two integer dots per weight chunk; the K-quants and IQ4_XS
#         keep one plane
ACT_FORMATS = ("q8", "q8x2")
TWO_PLANE_TYPES = frozenset({DType.Q4, DType.Q8, DType.Q4_1, DType.Q5_0, DType.Q5_1, DType.IQ4_NL})


def check_activations(activations: str) -> str:
    if activations not in ACT_FORMATS:
        raise ValueError(f"activations must be one of {', '.join(ACT_FORMATS)}, not {activations!r}")
    return activations


def act_planes(activations: str, dtypes) -> int:
    """Int8 planes of one quantised activation read by matrices of `dtypes` (every reader of that one quantisation:
    a QKV stream's parts, experts and the shared expert): 2 under activations='q8x2' when every quantised reader
    is a 32-input block type, else 1 (a K-quant reader keeps the whole activation at one plane)."""
    q = [DType(d) for d in dtypes if DType(d).quantised]
    return 2 if check_activations(activations) == "q8x2" and q and all(d in TWO_PLANE_TYPES for d in q) else 1


def quantize_activation_q8x2(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' two-plane activation: x f32[..., n] -> (q int8[..., nblk, 2, 32], d f32[..., nblk]).

    d = amax/127 (f32), t = x * (1/d), q1 = round-half-away(t), q2 = clip(round-half-away((t - q1) * 256), +-127);
    the block's value d * (q1 + q2/256) = (d/256) * (256 q1 + q2). t - q1 and the * 256 are exact in f32, so the
    kernel's quantiser gives the same bits. Kernel buffers hold [q1 x 32][q2 x 32] per block (64 bytes), xd = d/256
    and xs = sum(256 q1 + q2) (act_buffers_q8x2), so every kernel's float arithmetic is the one-plane kernel's.
    """
    x = np.asarray(x, dtype=np.float32)
    n = x.shape[-1]
    pn = padded(n, BLOCK)
    if pn != n:
        x = np.concatenate([x, np.zeros(x.shape[:-1] + (pn - n,), np.float32)], axis=-1)
    b = x.reshape(x.shape[:-1] + (pn // BLOCK, BLOCK))
    d = np.abs(b).max(axis=-1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    t = (b * inv[..., None]).astype(np.float32)
    q1 = _round_half_away(t).astype(np.float32)
    q2 = np.clip(_round_half_away((t - q1) * np.float32(256)), -127, 127)
    return np.stack([q1, q2], axis=-2).astype(np.int8), d.astype(np.float32)


def act_codes(x: np.ndarray, planes: int) -> tuple[np.ndarray, np.ndarray]:
    """The activation as the kernels' integer sums see it: (codes int32[..., nblk, 32], scale f32[..., nblk]) with
    x ~ codes * scale: int8 codes and d (planes 1), or 256 q1 + q2 and d/256 (planes 2)."""
    if planes == 1:
        q, d = quantize_activation_q8(x)
        return q.astype(np.int32), d
    q, d = quantize_activation_q8x2(x)
    return 256 * q[..., 0, :].astype(np.int32) + q[..., 1, :], (d / np.float32(256)).astype(np.float32)


def act_buffers(x: np.ndarray, planes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What the kernels' quantiser writes for x f32[n]: (xq int8[nblk * 32 * planes], xd f32[nblk], xs i32[nblk])."""
    if planes == 1:
        q, d = quantize_activation_q8(x)
    else:
        q, d = quantize_activation_q8x2(x)
    codes, scale = act_codes(x, planes)
    return q.reshape(-1), (d if planes == 1 else scale), codes.sum(-1).astype(np.int32)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16): the top half, rounded to nearest even, NaN kept quiet (the twin of
    codegen.cgutils.float_to_bf16, which the bf16 KV cache and attention use)."""
    w = np.ascontiguousarray(x, np.float32).view(np.uint32)
    r = (w + np.uint32(0x7FFF) + ((w >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (w & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, (w >> np.uint32(16)) | np.uint32(0x40), r).astype(np.uint16)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16, any shape) -> float32, exactly (the top half of the float)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (as float32)."""
    return bf16_to_f32(bf16_bits(x))
