"""GGUF block types kept as stored: their fields, the NumPy twin of what a kernel computes, and the tile layout.

Stage: layout. A GGUF tensor of one of these types is a matrix whose rows are runs of blocks of QK inputs
(32 for the legacy types, 256 for the K-quants and IQ4_XS), each block the bytes llama.cpp's ggml-common.h
declares. `BlockTensor` holds those bytes untouched; `decompose` is the twin every kernel is checked against:

    x[r, k] = S[r, s] * (u[r, k] - bias) + M[r, s]        s = k // sub   (sub = 16 or 32 inputs)

with u the integer code (unsigned, or the signed IQ4 code-book value), S and M float32 per sub-block, computed
from the block's fields the way gguf.quants (and ggml) dequantise it: tests/layout/test_blocks.py checks
S * (u - bias) + M against gguf.quants.dequantize for every type. A kernel computes, per 32-input activation block
(int8 codes qa, float scale da, llama.cpp's Q8_0 activations with the scale kept in float32),

    sum_s da * (S_s * sum_k (u_k - bias) qa_k + M_s * sum_k qa_k)

with exact integer sums per sub-block: the same arithmetic for every type, one code extraction per type.

cflow's own types (no GGUF counterpart: written by cflow's quantiser, read by cflow only) are for the widths the
K-quants cannot take (576, 640, 896, 960 divide by 64 and 128 or 192, not by 256). IQ4_128 and IQ4_192 are IQ4_XS on
super-blocks of 128 and 192 inputs instead of 256, at its 4.25 bits per weight: the IQ4 code book on 32-input
sub-blocks, a signed 6-bit scale per sub-block (l - 32 stored), and the super-block scale D as an 8-bit float
(E5M3: S_s = D * l_s) so that it and the sub-block scales fill whole words. Q3_128 and Q3_192 (3.25 bpw) hold 3-bit
codes u (value u - 4) under the same scales:

    IQ4_128  scales u32: bits 4s..4s+3 the low 4 bits of sub-block s's scale (s < 4), bits 16+2s..17+2s its high 2,
                         bits 24..31 D;  qs 64 bytes: sub-block s at 16s, as IQ4_NL's qs (68 bytes = 4.25 bpw)
    IQ4_192  scales u32: bits 4s..4s+3 the low 4 bits (s < 6), bits 24..31 D;  scales_h u16: bits 2s..2s+1 the high
                         2;  qs 96 bytes (102 bytes = 4.25 bpw)
    Q3_128   scales as IQ4_128;  qh 16 bytes, qs 32 bytes (52 bytes = 3.25 bpw)
    Q3_192   scales, scales_h as IQ4_192;  qh 24 bytes, qs 48 bytes (78 bytes = 3.25 bpw)
             sub-block s's low 2 bits in qs[8s .. 8s+7]: byte b, bits 2k..2k+1 = input b + 8k; its third bit in
             qh[4s .. 4s+3]: byte b, bit k = input b + 4k (so 4 consecutive inputs sit at one shift of one word)
    D        byte b = 8e + m: D = (1 + m/8) 2^(e - 29) for e = 1..31 (2^-28 .. 7.5), 0 for e = 0; the float32 with
             bits (b << 20) + (98 << 23), so a kernel decodes it with a shift and an add. Its range holds
             |x| up to 7.5 * 32 * 127 = 30,480 at IQ4 and 7.5 * 32 * 4 = 960 at Q3; beyond, the quantiser refuses

Tile layout. As for Q4/Q8 (layout/tile.py), a tile-row of TR rows is a run of units, each unit one block of QK
inputs for all TR rows, in NG = TR/16 groups of 16 rows. A group holds its 16 rows' blocks field by field
(`BlockFormat.fields`, words fields first): a field of n bytes (n a multiple of 4) as n/4 chunks of 64 bytes,
chunk c byte 4*i + j = byte 4c + j of row i's field (so one 64-byte vector holds 4 bytes of every row, the form
vpdpbusd takes); a 2-byte field (an fp16 scale) as 16 little-endian values, row i at 2*i. So a group is 16 x the
block's bytes, a unit TR/QK x the matrix's bytes per QK inputs: bytes per weight are exactly the GGUF file's.
"""

from __future__ import annotations

import attrs
import numpy as np

from .quant import DType

GROUP = 16  # rows of a group (tile.GROUP_ROWS)

# llama.cpp's IQ4_NL / IQ4_XS code book (ggml-common.h kvalues_iq4nl)
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


@attrs.frozen
class BlockFormat:
    """One GGUF block type: inputs per block, its fields in GGUF byte order, and how its codes are read."""

    dtype: DType
    qk: int  # inputs per block
    fields: tuple[tuple[str, int], ...]  # (name, bytes) in GGUF order
    sub: int  # inputs per scale (sub-block): 16 or 32
    bias: int  # subtracted from every code (Q5_0: 16, Q3_K: 4, Q6_K: 32), 0 where a min (M) or sign does the job
    signed: bool = False  # codes are signed int8 values (IQ4: the code book) rather than small unsigned integers
    umax: int = 15  # largest unsigned code (the AVX2 kernel's i16 headroom)
    f16_scales: tuple[str, ...] = ("d",)  # fp16 fields that scale the whole block (a folded multiplier scales these)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.fields)

    @property
    def ggml_name(self) -> str:
        return self.dtype.name

    def field_slices(self) -> dict[str, slice]:
        """Byte range of each field inside one GGUF block."""
        out, off = {}, 0
        for name, n in self.fields:
            out[name] = slice(off, off + n)
            off += n
        return out

    @property
    def group_fields(self) -> tuple[tuple[str, int], ...]:
        """Fields in group order: word fields (multiples of 4 bytes) by size, largest first, then the fp16 ones
        (every field then starts 32-byte aligned within the group)."""
        words = sorted((f for f in self.fields if f[1] % 4 == 0), key=lambda f: -f[1])
        return tuple(words) + tuple(f for f in self.fields if f[1] % 4)

    def group_offsets(self) -> dict[str, int]:
        """Byte offset of each field inside one 16-row group."""
        out, off = {}, 0
        for name, n in self.group_fields:
            out[name] = off
            off += GROUP * n
        return out

    @property
    def group_nbytes(self) -> int:
        return GROUP * self.nbytes


def _fmt(dtype, qk, fields, sub, bias, **kw) -> BlockFormat:
    return BlockFormat(dtype=dtype, qk=qk, fields=tuple(fields), sub=sub, bias=bias, **kw)


FORMATS: dict[DType, BlockFormat] = {f.dtype: f for f in (
    _fmt(DType.Q4_1, 32, [("d", 2), ("m", 2), ("qs", 16)], 32, 0, f16_scales=("d", "m")),
    _fmt(DType.Q5_0, 32, [("d", 2), ("qh", 4), ("qs", 16)], 32, 16, umax=31),
    _fmt(DType.Q5_1, 32, [("d", 2), ("m", 2), ("qh", 4), ("qs", 16)], 32, 0, umax=31, f16_scales=("d", "m")),
    _fmt(DType.IQ4_NL, 32, [("d", 2), ("qs", 16)], 32, 0, signed=True),
    _fmt(DType.Q2_K, 256, [("scales", 16), ("qs", 64), ("d", 2), ("dmin", 2)], 16, 0, umax=3,
         f16_scales=("d", "dmin")),
    _fmt(DType.Q3_K, 256, [("hmask", 32), ("qs", 64), ("scales", 12), ("d", 2)], 16, 4, umax=7),
    _fmt(DType.Q4_K, 256, [("d", 2), ("dmin", 2), ("scales", 12), ("qs", 128)], 32, 0, f16_scales=("d", "dmin")),
    _fmt(DType.Q5_K, 256, [("d", 2), ("dmin", 2), ("scales", 12), ("qh", 32), ("qs", 128)], 32, 0, umax=31,
         f16_scales=("d", "dmin")),
    _fmt(DType.Q6_K, 256, [("ql", 128), ("qh", 64), ("scales", 16), ("d", 2)], 16, 32, umax=63),
    _fmt(DType.IQ4_XS, 256, [("d", 2), ("scales_h", 2), ("scales_l", 4), ("qs", 128)], 32, 0, signed=True),
    _fmt(DType.IQ4_128, 128, [("scales", 4), ("qs", 64)], 32, 0, signed=True, f16_scales=()),
    _fmt(DType.IQ4_192, 192, [("scales", 4), ("scales_h", 2), ("qs", 96)], 32, 0, signed=True, f16_scales=()),
    _fmt(DType.Q3_128, 128, [("scales", 4), ("qh", 16), ("qs", 32)], 32, 4, umax=7, f16_scales=()),
    _fmt(DType.Q3_192, 192, [("scales", 4), ("scales_h", 2), ("qh", 24), ("qs", 48)], 32, 4, umax=7,
         f16_scales=()),
)}
BLOCK_TYPES = tuple(FORMATS)
# cflow's own block types (module docstring): no GGUF counterpart
OWN_TYPES = (DType.IQ4_128, DType.IQ4_192, DType.Q3_128, DType.Q3_192)
E5M3_EXP = 98  # float32 exponent field of an E5M3 super-block scale at e = 0 (module docstring)
E5M3_MAX = 7.5  # its largest value, byte 255


def e5m3_value(b: np.ndarray) -> np.ndarray:
    """E5M3 bytes -> float32 (module docstring)."""
    b = np.asarray(b).astype(np.uint32)
    v = ((b << 20) + np.uint32(E5M3_EXP << 23)).view(np.float32)
    return np.where(b >= 8, v, np.float32(0))


def e5m3_ceil(d: np.ndarray) -> np.ndarray:
    """The E5M3 byte of the smallest value >= d (d >= 0 float32; 0 -> 0; beyond the range: its ends)."""
    d = np.asarray(d, np.float32)
    bits = np.ascontiguousarray(d).view(np.uint32).astype(np.int64)
    b = np.clip(((bits + (1 << 20) - 1) >> 20) - (E5M3_EXP << 3), 8, 255)  # rounding the float's bits up
    return np.where(d > 0, b, 0).astype(np.uint8)


def is_block_type(dtype) -> bool:
    return dtype in FORMATS


@attrs.frozen(eq=False)
class BlockTensor:
    """A [rows, cols] matrix of one GGUF block type: raw u8[rows, cols/qk * block bytes], the file's bytes."""

    dtype: DType
    rows: int
    cols: int
    raw: np.ndarray

    def __attrs_post_init__(self):
        fmt = FORMATS[self.dtype]
        if self.cols % fmt.qk:
            raise ValueError(f"{self.dtype.label}: {self.cols} inputs per row is not a whole number of {fmt.qk}-input "
                             "blocks")
        want = (self.rows, self.cols // fmt.qk * fmt.nbytes)
        if tuple(self.raw.shape) != want or self.raw.dtype != np.uint8:
            raise ValueError(f"{self.dtype.label} bytes of shape {self.raw.shape}, expected uint8 {want}")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def format(self) -> BlockFormat:
        return FORMATS[self.dtype]

    @property
    def nbytes(self) -> int:
        return int(self.raw.size)

    def dequantize(self) -> np.ndarray:
        return dequantize_blocks(self)

    def take_rows(self, rows) -> BlockTensor:
        raw = np.ascontiguousarray(self.raw[rows])
        return BlockTensor(self.dtype, raw.shape[0], self.cols, raw)

    def scaled(self, s: float) -> BlockTensor:
        """The same codes with every block's fp16 scale fields multiplied by s (a multiplier folded into the
        weights: exact up to the rounding of each scale to fp16, 2^-11 relative, far below the codes' step).
        Raises ValueError where a scale would overflow fp16, or for a type without fp16 scales (cflow's own: its
        8-bit super-block scale cannot take an arbitrary factor)."""
        fmt = self.format
        if not fmt.f16_scales:
            raise ValueError(f"{self.dtype.label} has no fp16 scale to fold a multiplier of {s} into")
        nb = self.cols // fmt.qk
        blocks = self.raw.reshape(self.rows, nb, fmt.nbytes).copy()
        sl = fmt.field_slices()
        for name in fmt.f16_scales:
            v = np.ascontiguousarray(blocks[..., sl[name]]).view(np.float16).astype(np.float32) * np.float32(s)
            with np.errstate(over="ignore"):
                h = v.astype(np.float16)
            if not np.isfinite(h[np.isfinite(v)]).all():
                raise ValueError(f"{self.dtype.label}: scaling by {s} overflows an fp16 '{name}' field")
            blocks[..., sl[name]] = h.view(np.uint8).reshape(blocks[..., sl[name]].shape)
        return BlockTensor(self.dtype, self.rows, self.cols, blocks.reshape(self.rows, -1))


def random_blocks(dtype: DType, rows: int, cols: int, rng, scale: float = 1e-3, jitter: float = 0.0) -> BlockTensor:
    """Random block bytes (every code pattern) whose whole-block scales are about `scale`: the fp16 ones `scale`
    times uniform(1 - jitter, 1 + jitter), an own type's E5M3 super-block scale scale / 32 (its 6-bit sub-block
    scales random). The weights of the tuner's and the benchmarks' timed kernels, whose values never matter but
    whose magnitudes must stay finite and ordinary."""
    fmt = FORMATS[dtype]
    nb = cols // fmt.qk
    raw = rng.integers(0, 256, (rows, nb, fmt.nbytes), dtype=np.uint8)
    sl = fmt.field_slices()
    for name in fmt.f16_scales:
        v = scale * (rng.uniform(1 - jitter, 1 + jitter, (rows, nb)) if jitter else np.ones((rows, nb)))
        raw[..., sl[name]] = v.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    if dtype in OWN_TYPES:  # the scales word's top byte
        raw[..., sl["scales"].stop - 1] = e5m3_ceil(np.float32(scale / 32))
    return BlockTensor(dtype, rows, cols, raw.reshape(rows, -1))


# --- the NumPy twin ------------------------------------------------------------------------------------------
def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _k4_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml get_scale_min_k4)."""
    s = sc.astype(np.int32)
    scales = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mins = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return scales, mins


def _q3_scales(sc: np.ndarray) -> np.ndarray:
    """Q3_K: 12 bytes -> 16 six-bit signed scales (ggml's kmask unpacking, minus 32)."""
    w = np.ascontiguousarray(sc).view("<u4").astype(np.uint32)  # [..., 3]
    a0, a1, a2 = w[..., 0], w[..., 1], w[..., 2]
    k1, k2 = np.uint32(0x03030303), np.uint32(0x0F0F0F0F)
    aux = np.stack([(a0 & k2) | ((a2 & k1) << 4), (a1 & k2) | (((a2 >> 2) & k1) << 4),
                    ((a0 >> 4) & k2) | (((a2 >> 4) & k1) << 4), ((a1 >> 4) & k2) | (((a2 >> 6) & k1) << 4)], -1)
    return aux.astype("<u4").view(np.int8).reshape(sc.shape[:-1] + (16,)).astype(np.int32) - 32


def decompose(t: BlockTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(u int16 [rows, cols], S f32 [rows, cols/sub], M f32 [rows, cols/sub] or None): x = S * (u - bias) + M."""
    fmt = t.format
    nb = t.cols // fmt.qk
    blk = t.raw.reshape(t.rows, nb, fmt.nbytes)
    f = {name: blk[..., s] for name, s in fmt.field_slices().items()}
    d = _f16(f["d"])[..., None] if "d" in f else None  # [rows, nb, 1]
    dt = fmt.dtype
    M = None
    if dt in (DType.Q4_1, DType.Q5_0, DType.Q5_1, DType.IQ4_NL):
        qs = f["qs"]
        u = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)  # [rows, nb, 32]
        if dt in (DType.Q5_0, DType.Q5_1):
            qh = np.ascontiguousarray(f["qh"]).view("<u4")[..., 0].astype(np.uint32)
            bits = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1
            u = u | (bits.astype(np.int16) << 4)
        if dt == DType.IQ4_NL:
            u = IQ4_VALUES[u].astype(np.int16)
        S = d
        if dt in (DType.Q4_1, DType.Q5_1):
            M = _f16(f["m"])[..., None]
    elif dt in (DType.Q4_K, DType.Q5_K):
        qs = f["qs"].reshape(t.rows, nb, 4, 1, 32)
        u = ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F).reshape(t.rows, nb, 8, 32)
        u = u.astype(np.int16)
        if dt == DType.Q5_K:
            qh = f["qh"].reshape(t.rows, nb, 1, 32)
            hb = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
            u = u | (hb.astype(np.int16) << 4)
        sc, mn = _k4_scales(f["scales"])
        S = d * sc.astype(np.float32)  # [rows, nb, 8]
        M = -(_f16(f["dmin"])[..., None] * mn.astype(np.float32))
    elif dt == DType.Q6_K:
        ql = f["ql"].reshape(t.rows, nb, 2, 2, 32)  # [.., n, half (ql offset 0 / 32), l]
        qh = f["qh"].reshape(t.rows, nb, 2, 1, 32)
        lo = (ql[:, :, :, None] >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1, 1)) & 0x0F  # [.., n, nib, half, l]
        hi = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 3  # [.., n, jj, l]
        lo = lo.reshape(t.rows, nb, 2, 4, 32)  # jj = 2 * nib + half
        u = (lo.astype(np.int16) | (hi.astype(np.int16) << 4)).reshape(t.rows, nb, 256)
        S = d * f["scales"].view(np.int8).astype(np.float32)
    elif dt == DType.Q2_K:
        qs = f["qs"].reshape(t.rows, nb, 2, 1, 32)
        u = ((qs >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 3).astype(np.int16)
        sc = f["scales"].astype(np.int32)
        S = d * (sc & 0xF).astype(np.float32)
        M = -(_f16(f["dmin"])[..., None] * (sc >> 4).astype(np.float32))
    elif dt == DType.Q3_K:
        qs = f["qs"].reshape(t.rows, nb, 2, 1, 32)
        u = ((qs >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 3).reshape(t.rows, nb, 8, 32)
        hm = f["hmask"].reshape(t.rows, nb, 1, 32)
        hb = (hm >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
        u = (u.astype(np.int16) | (hb.astype(np.int16) << 2))
        S = d * _q3_scales(f["scales"]).astype(np.float32)
    elif dt == DType.IQ4_XS:
        qs = f["qs"].reshape(t.rows, nb, 8, 16)
        u = IQ4_VALUES[np.concatenate([qs & 0x0F, qs >> 4], axis=-1)].astype(np.int16)
        sh = np.ascontiguousarray(f["scales_h"]).view("<u2")[..., 0].astype(np.int32)
        sl = f["scales_l"].astype(np.int32)
        j = np.arange(8)
        ls = ((sl[..., j // 2] >> (4 * (j % 2))) & 0xF) | (((sh[..., None] >> (2 * j)) & 3) << 4)
        S = d * (ls - 32).astype(np.float32)
    elif dt in OWN_TYPES:
        ns = fmt.qk // 32
        if fmt.signed:  # IQ4_128 / IQ4_192
            qs = f["qs"].reshape(t.rows, nb, ns, 16)
            u = IQ4_VALUES[np.concatenate([qs & 0x0F, qs >> 4], axis=-1)].astype(np.int16)
        else:  # Q3_128 / Q3_192: input b + 8k in bits 2k of qs byte b, input b + 4k in bit k of qh byte b
            qs = f["qs"].reshape(t.rows, nb, ns, 1, 8)
            qh = f["qh"].reshape(t.rows, nb, ns, 1, 4)
            lo = (qs >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3  # [.., ns, k, b]
            hb = (qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
            u = (lo.reshape(t.rows, nb, ns, 32) | (hb.reshape(t.rows, nb, ns, 32) << 2)).astype(np.int16)
        w = np.ascontiguousarray(f["scales"]).view("<u4")[..., 0].astype(np.int64)  # [rows, nb]
        if "scales_h" not in f:  # four sub-blocks: their high 2 bits above the low nibbles
            hi = w[..., None] >> (16 + 2 * np.arange(ns))
        else:
            sh = np.ascontiguousarray(f["scales_h"]).view("<u2")[..., 0].astype(np.int64)
            hi = sh[..., None] >> (2 * np.arange(ns))
        ls = ((w[..., None] >> (4 * np.arange(ns))) & 0xF) | ((hi & 3) << 4)
        S = e5m3_value(w >> 24)[..., None] * (ls - 32).astype(np.float32)
    else:  # pragma: no cover -- FORMATS and this table name the same types
        raise ValueError(f"no decomposition for {dt.label}")
    u = u.reshape(t.rows, t.cols)
    S = np.ascontiguousarray(S, np.float32).reshape(t.rows, -1)
    if M is not None:
        M = np.ascontiguousarray(np.broadcast_to(M, (t.rows, nb, fmt.qk // fmt.sub)), np.float32).reshape(t.rows, -1)
    return u, S, M


def dequantize_blocks(t: BlockTensor) -> np.ndarray:
    """float32 [rows, cols]: S * (u - bias) + M, computed as ggml does (one multiply, one add, in float32)."""
    fmt = t.format
    u, S, M = decompose(t)
    codes = (u.astype(np.int32) - fmt.bias).astype(np.float32).reshape(t.rows, -1, fmt.sub)
    x = S[..., None] * codes
    if M is not None:
        x = x + M[..., None]
    return np.ascontiguousarray(x.reshape(t.rows, t.cols), np.float32)


def matvec_twin(t: BlockTensor, x: np.ndarray, cache: dict | None = None, planes: int = 1) -> np.ndarray:
    """x [T, cols] @ W.T the way the kernels compute it: x quantised to int8 blocks of 32 (quant.act_codes: one
    plane, or planes=2: two on one scale, the codes 256 q1 + q2), exact integer sums per sub-block, float scales after
    (float64 here: the kernels' float32 accumulation differs from it by rounding only)."""
    from .quant import act_codes

    fmt = t.format
    if planes != 1 and fmt.qk != 32:
        raise ValueError(f"{fmt.ggml_name} reads one-plane activations only")
    if cache is not None and "codes" in cache:
        c, S, M = cache["codes"]
    else:
        u, S, M = decompose(t)
        c = (u.astype(np.float32) - fmt.bias).reshape(t.rows, -1, fmt.sub)  # [rows, nsub, sub]
        c = np.ascontiguousarray(c.transpose(1, 2, 0))  # [nsub, sub, rows]
        if cache is not None:
            cache["codes"] = (c, S, M)
    qa, da = act_codes(x, planes)  # [T, cols/32, 32], [T, cols/32]
    T = qa.shape[0]
    per = 32 // fmt.sub  # sub-blocks per activation block
    # exact integer sums: in float32 for int8 codes (|sum| < 2^24), float64 for the two-plane codes
    ft = np.float32 if planes == 1 else np.float64
    qa = qa.astype(ft).reshape(T, -1, fmt.sub)  # [T, nsub, sub]
    dsub = np.repeat(da, per, axis=1).astype(np.float64)  # [T, nsub]
    isum = np.matmul(qa.transpose(1, 0, 2), c.astype(ft, copy=False)).astype(np.float64)  # [nsub, T, rows]
    out = np.einsum("stR,Rs,ts->tR", isum, S.astype(np.float64), dsub, optimize=True)
    if M is not None:
        asum = qa.sum(axis=2).astype(np.float64)  # [T, nsub]
        out += np.einsum("Rs,ts->tR", M.astype(np.float64), asum * dsub, optimize=True)
    return out.astype(np.float32)


# --- the tile layout -----------------------------------------------------------------------------------------
def _interleave(fmt: BlockFormat, blocks: np.ndarray) -> np.ndarray:
    """blocks u8 [..., 16 rows, nbytes] -> u8 [..., group_nbytes] (module docstring)."""
    sl = fmt.field_slices()
    lead = blocks.shape[:-2]
    parts = []
    for name, n in fmt.group_fields:
        f = blocks[..., sl[name]]  # [..., 16, n]
        if n % 4 == 0:
            f = f.reshape(lead + (GROUP, n // 4, 4)).swapaxes(-3, -2)  # [..., words, 16, 4]
        parts.append(np.ascontiguousarray(f).reshape(lead + (GROUP * n,)))
    return np.concatenate(parts, axis=-1)


def _deinterleave(fmt: BlockFormat, group: np.ndarray) -> np.ndarray:
    """Inverse of _interleave: u8 [..., group_nbytes] -> u8 [..., 16, nbytes] (GGUF block bytes per row)."""
    lead = group.shape[:-1]
    offs = fmt.group_offsets()
    out = np.empty(lead + (GROUP, fmt.nbytes), np.uint8)
    sl = fmt.field_slices()
    for name, n in fmt.group_fields:
        f = group[..., offs[name] : offs[name] + GROUP * n]
        if n % 4 == 0:
            f = f.reshape(lead + (n // 4, GROUP, 4)).swapaxes(-3, -2)
        out[..., sl[name]] = f.reshape(lead + (GROUP, n))
    return out


def pack_blocks(t: BlockTensor, rows_p: int, cols_p: int, tr: int, tc: int) -> np.ndarray:
    """The tile stream of `t` padded to rows_p x cols_p (zero bytes: every field 0, so every weight 0):
    u8[rows_p / tr, cols_p / qk, tr / 16, group_nbytes] flattened."""
    fmt = t.format
    nbk, nbk_p = t.cols // fmt.qk, cols_p // fmt.qk
    full = np.zeros((rows_p, nbk_p, fmt.nbytes), np.uint8)
    full[: t.rows, :nbk] = t.raw.reshape(t.rows, nbk, fmt.nbytes)
    # [tile-row, group, i, unit, bytes] -> [tile-row, unit, group, i, bytes]
    g = full.reshape(rows_p // tr, tr // GROUP, GROUP, nbk_p, fmt.nbytes).transpose(0, 3, 1, 2, 4)
    return _interleave(fmt, g).reshape(-1)


def unpack_blocks(buf: np.ndarray, dtype: DType, rows: int, cols: int, rows_p: int, cols_p: int, tr: int
                  ) -> BlockTensor:
    """Inverse of pack_blocks: the GGUF bytes of the logical [rows, cols] (padding dropped)."""
    fmt = FORMATS[dtype]
    nbk_p = cols_p // fmt.qk
    g = np.asarray(buf, np.uint8).reshape(rows_p // tr, nbk_p, tr // GROUP, fmt.group_nbytes)
    blocks = _deinterleave(fmt, g)  # [tile-row, unit, group, i, bytes]
    full = blocks.transpose(0, 2, 3, 1, 4).reshape(rows_p, nbk_p, fmt.nbytes)
    raw = np.ascontiguousarray(full[:rows, : cols // fmt.qk]).reshape(rows, -1)
    return BlockTensor(dtype, rows, cols, raw)
