"""THE tile layout: how a weight matrix is laid out as the stream of bytes the mat-vec kernels read.

Stage: layout (below ir; imported by passes, codegen and runtime alike). Input: a float matrix or a
quant.QTensor. Output: a contiguous uint8 tile stream. The packer, the file writer, the kernels
(codegen/kernels.py) and the file's weights view (runtime/weights.py) take every offset from `TileLayout`.

Matrix W[M, K] (M output rows, K inputs), tile shape TR x TC (default 128 x 256; TR a multiple
of 16, TC a multiple of 32). W is zero-padded to M' = ceil(M/TR)*TR rows and K' = ceil(K/TC)*TC
inputs; a padded Q4/Q8 block is exactly quant.quantize of zeros (Q4: codes 8, scale -0.0, as
d = amax / -8; Q8: codes 0, scale +0.0), so pack(W) == pack(quantize(W)) == pack(zero-padded W),
and padding contributes exactly 0 to every output.

Tile order (tile-row-major): for tr in range(M'/TR): for tc in range(K'/TC): tile(tr, tc), each
tile TILE_BYTES long, so tile(tr, tc) starts at (tr * K'/TC + tc) * TILE_BYTES. A thread that owns
tile-rows [r0, r1) streams one contiguous byte range, keeps its TR row sums in registers across
the tc loop (TR <= 128; a taller tile is swept in passes of 128 rows), and reuses each activation
block for all TR rows.

Inside a tile: NB = TC/32 block units, one after the other; unit b holds inputs 32b .. 32b+31 of
the tile for all TR rows (so a tile-row is simply K'/32 consecutive units, read front to back by
a kernel whose loop runs over blocks outside and 16-row groups inside, the 32 activation bytes
of a block shared by all groups in registers). A unit holds NG = TR/16 row groups; a group
interleaves its 16 rows so one 64-byte vector holds 4 consecutive inputs of all 16 rows
(byte 4*i + j = row 16g + i, input 4c + j: one `vpdpbusd` advances 16 row sums). With
g = group, i = row in group (0..15), k = input in the block (0..31), offsets within the unit:

  Q4  unit = NG*256 B codes, then NG*32 B scales  (NG*288 B; 2304 B for TR=128)
        code byte  g*256 + c*64 + 4*i + j  (c, j in 0..3)  = q[16g+i, 4c+j] | q[16g+i, 16+4c+j] << 4
        scale      NG*256 + g*32 + 2*i                      = fp16 d[16g+i]
      (low nibbles of chunk c = inputs 4c..4c+3 of the block, high nibbles = inputs 16+4c..; the
       codes and fp16 scales are GGUF Q4_0's, only rearranged: 18 B per 32 weights exactly)
  Q8  unit = NG*512 B codes, then NG*32 B scales  (NG*544 B)
        code byte  g*512 + c*64 + 4*i + j  (c in 0..7)     = int8 q[16g+i, 4c+j]
        scale      NG*512 + g*32 + 2*i                      = fp16 d[16g+i]
  F32 unit = NG*2048 B:  g*2048 + k*64 + 4*i = f32 W[16g+i, k]
  F16 unit = NG*1024 B:  g*1024 + k*32 + 2*i = f16 W[16g+i, k]

Every code/scale chunk is 32-byte aligned; with TR a multiple of 32 (NG even) every unit, tile
and tile-row starts 64-byte aligned too. All multi-byte values are little-endian.

GGUF block types (layout/blocks.py: Q4_1, Q5_0, Q5_1, IQ4_NL with 32-input blocks; the K-quants and IQ4_XS with
256): a unit is one block of QK inputs for all TR rows, NG groups of 16 rows, each group its rows' GGUF block
bytes interleaved field by field (blocks.py). A tile is then lcm(TC, QK) inputs wide (tile_cols), so a
K-quant matrix's inputs pad to whole 256-input blocks; a GGUF stores no partial block, so with a TC that divides
the matrix widths nothing is padded and the stream holds exactly the file's bytes.

Fused streams: QKV = several matrices sharing the input, each padded to whole tile-rows and
concatenated (the output vector holds each part at its row offset); gate+up = tile-rows
interleaved (gate tile-row t, then up tile-row t) so one thread computes silu(gate) * up for its
rows right after producing both.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from ..errors import ConfigError
from . import DEFAULT_TILE
from . import blocks as B
from .quant import BLOCK, BLOCK_SIZES, DType, QTensor, dequantize, padded, quantize

GROUP_ROWS = 16  # rows interleaved per 64-byte vector (16 x int32 lanes)
ALIGN = 64  # byte alignment of buffers returned by pack (cache line, zmm width)
# A model's tile shape (header "tile", cflowc --tile): the kernels sweep tall tiles in unrolled passes, so JIT
# time grows with the rows (1024-row tiles take ~15 s for a tiny model); these bounds keep it seconds.
MAX_TILE_ROWS = 512
MAX_TILE_COLS = 4096


def check_tile(tile) -> tuple[int, int]:
    """(rows, cols) of a valid tile, or ConfigError (a CflowError and a ValueError) naming the bad dim."""
    try:
        tr, tc = (int(t) for t in tile)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"tile must be two integers (rows, cols), got {tile!r}") from None
    if tr <= 0 or tr % GROUP_ROWS:
        raise ConfigError(f"tile rows must be a positive multiple of {GROUP_ROWS}, got {tr}")
    if tc <= 0 or tc % BLOCK:
        raise ConfigError(f"tile cols must be a positive multiple of {BLOCK}, got {tc}")
    return tr, tc


def tile_problem(tile) -> str | None:
    """Why a tile shape cannot be compiled or loaded, or None (cflowc --tile and the file header share the rule)."""
    tr, tc = tile
    if not (1 <= tr <= MAX_TILE_ROWS and tr % GROUP_ROWS == 0):
        return f"rows {tr}: expected a multiple of {GROUP_ROWS} in {GROUP_ROWS}..{MAX_TILE_ROWS}"
    if not (1 <= tc <= MAX_TILE_COLS and tc % BLOCK == 0):
        return f"cols {tc}: expected a multiple of {BLOCK} in {BLOCK}..{MAX_TILE_COLS}"
    return None


@attrs.frozen
class TileLayout:
    """Geometry of one tiled matrix: every byte offset the packer and the kernels use."""

    dtype: DType = attrs.field(converter=lambda d: DType.parse(d) if isinstance(d, str) else DType(d))
    rows: int  # logical M (outputs)
    cols: int  # logical K (inputs)
    tile: tuple[int, int] = attrs.field(default=DEFAULT_TILE, converter=check_tile)

    def __attrs_post_init__(self):
        if self.rows <= 0 or self.cols <= 0:
            raise ValueError(f"matrix shape must be positive, got {self.rows}x{self.cols}")

    @property
    def tr(self) -> int:
        return self.tile[0]

    @property
    def tc(self) -> int:
        return self.tile[1]

    @property
    def rows_p(self) -> int:
        """M': rows padded to whole tile-rows."""
        return padded(self.rows, self.tr)

    @property
    def unit_cols(self) -> int:
        """Inputs of one unit: 32, or a GGUF block type's QK (256 for the K-quants and IQ4_XS)."""
        return max(BLOCK, BLOCK_SIZES[self.dtype][0])

    @property
    def tile_cols(self) -> int:
        """Inputs of one tile: TC, widened to whole units (lcm(TC, unit_cols))."""
        return math.lcm(self.tc, self.unit_cols)

    @property
    def is_block_type(self) -> bool:
        return B.is_block_type(self.dtype)

    @property
    def format(self) -> B.BlockFormat:
        """The GGUF block type's format (block types only)."""
        return B.FORMATS[self.dtype]

    @property
    def cols_p(self) -> int:
        """K': inputs padded to whole tiles."""
        return padded(self.cols, self.tile_cols)

    @property
    def n_tile_rows(self) -> int:
        return self.rows_p // self.tr

    @property
    def n_tile_cols(self) -> int:
        return self.cols_p // self.tile_cols

    @property
    def groups_per_tile(self) -> int:
        return self.tr // GROUP_ROWS

    @property
    def blocks_per_tile(self) -> int:
        """NB: units per tile row (32-input blocks for Q4/Q8/F16/F32, QK-input blocks for a GGUF block type)."""
        return self.tile_cols // self.unit_cols

    @property
    def n_units(self) -> int:
        """Units in one tile-row."""
        return self.cols_p // self.unit_cols

    @property
    def code_nbytes(self) -> int:
        """Bytes of one block's codes in a 16-row group (Q4 256, Q8 512); 0 for F16/F32."""
        return {DType.Q4: 256, DType.Q8: 512}.get(self.dtype, 0)

    @property
    def unit_nbytes(self) -> int:
        """Bytes of one unit: all TR rows x unit_cols inputs."""
        n, b = BLOCK_SIZES[self.dtype]
        return self.tr * (self.unit_cols // n) * b

    @property
    def group_nbytes(self) -> int:
        """Bytes of one 16-row group's codes (Q4/Q8) or values (F16/F32) inside a unit."""
        return self.code_nbytes if self.code_nbytes else self.unit_nbytes // self.groups_per_tile

    @property
    def scales_offset(self) -> int:
        """Offset of the fp16 scale area inside a unit (Q4/Q8)."""
        return self.groups_per_tile * self.code_nbytes

    @property
    def tile_nbytes(self) -> int:
        return self.blocks_per_tile * self.unit_nbytes

    @property
    def tile_row_nbytes(self) -> int:
        return self.n_tile_cols * self.tile_nbytes

    @property
    def nbytes(self) -> int:
        return self.n_tile_rows * self.tile_row_nbytes

    @property
    def alignment(self) -> int:
        """Largest power of two (<= 64) dividing every unit offset (given a 64-B aligned stream)."""
        a = ALIGN
        while self.unit_nbytes % a:
            a //= 2
        return a

    def unit_offset(self, tr: int, kb: int) -> int:
        """Byte offset of the unit of tile-row tr holding inputs unit_cols*kb .. unit_cols*(kb+1) - 1."""
        return tr * self.tile_row_nbytes + kb * self.unit_nbytes

    def tile_offset(self, tr: int, tc: int) -> int:
        """Byte offset of tile(tr, tc) in the stream (tile-row-major)."""
        if not (0 <= tr < self.n_tile_rows and 0 <= tc < self.n_tile_cols):
            raise IndexError(f"tile ({tr}, {tc}) outside {self.n_tile_rows}x{self.n_tile_cols}")
        return (tr * self.n_tile_cols + tc) * self.tile_nbytes


def packed_nbytes(dtype, rows: int, cols: int, tile=DEFAULT_TILE) -> int:
    """Bytes of the tile stream of a [rows, cols] matrix."""
    return TileLayout(dtype, rows, cols, tile).nbytes


def aligned_empty(nbytes: int, align: int = ALIGN, zero: bool = False) -> np.ndarray:
    """uint8[nbytes] whose data pointer is `align`-byte aligned (NumPy only guarantees 16); zeroed if asked."""
    raw = (np.zeros if zero else np.empty)(nbytes + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off : off + nbytes]


def _as_stored(w, dtype: DType):
    """A float matrix, QTensor or BlockTensor -> QTensor (Q4/Q8), BlockTensor (a GGUF block type, kept as it is:
    nothing is quantised to one here) or a plain f32/f16 array."""
    if B.is_block_type(dtype):
        if isinstance(w, B.BlockTensor) and w.dtype == dtype:
            return w
        raise ValueError(f"a {dtype.gguf_name} stream is packed from {dtype.gguf_name} blocks, not from "
                         f"{getattr(getattr(w, 'dtype', None), 'label', type(w).__name__)}")
    if isinstance(w, B.BlockTensor):
        w = w.dequantize()
    if isinstance(w, QTensor):
        if w.dtype == dtype:
            return w
        w = w.dequantize()
    return quantize(np.asarray(w, dtype=np.float32) if dtype != DType.F16 else np.asarray(w), dtype)


def _pad_q(t: QTensor, r0: int, r1: int, nblk_p: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows r0..r1 of the codes and scales, padded (rows past the matrix, blocks past its width) with quant.quantize
    of a zero block (Q4: 8 and -0.0; Q8: 0 and +0.0); the QTensor's own arrays when nothing needs padding."""
    q, s = t.q[r0:r1], t.scales[r0:r1]
    if q.shape[0] == r1 - r0 and q.shape[1] == nblk_p:
        return q, s
    zero = quantize(np.zeros((1, BLOCK), np.float32), t.dtype)
    qp = np.full((r1 - r0, nblk_p, BLOCK), zero.q[0, 0, 0], dtype=t.q.dtype)
    sp = np.full((r1 - r0, nblk_p), zero.scales[0, 0], np.float16)
    qp[: q.shape[0], : q.shape[1]] = q
    sp[: s.shape[0], : s.shape[1]] = s
    return qp, sp


def pack(w, dtype, tile=DEFAULT_TILE) -> np.ndarray:
    """The tile stream of one matrix: uint8[packed_nbytes], 64-byte aligned.

    Args:
        w: float [rows, cols] (quantised here with quant.quantize) or a QTensor.
        dtype: DType or 'q4' / 'q8' / 'f16' / 'f32'.
        tile: (TR, TC).
    """
    dtype = DType.parse(dtype) if isinstance(dtype, str) else DType(dtype)
    st = _as_stored(w, dtype)
    L = TileLayout(dtype, *_stored_shape(st), tile)
    out = aligned_empty(L.nbytes)
    pack_rows(out.reshape(L.n_tile_rows, L.tile_row_nbytes), st, L)
    return out


PACK_BAND_BYTES = 1 << 21  # output bytes packed per step: one band's temporaries stay small and cache-warm
# A native Q4 band packer, f(units, q, scales, L), with _pack_q_band's bytes in one pass: codegen/q4pack.py sets it
# when imported (layout imports nothing from the rest of cflow); None: the NumPy packer below, its oracle.
Q4_BAND_PACKER = None


def _stored_shape(st) -> tuple[int, int]:
    return (st.rows, st.cols) if isinstance(st, (QTensor, B.BlockTensor)) else tuple(np.shape(st))


def pack_rows(dst: np.ndarray, st, L: TileLayout) -> None:
    """Pack stored weight `st` (a QTensor, BlockTensor or f16/f32 array of L's shape and type) into `dst`, a
    uint8 [n_tile_rows, tile_row_nbytes] view whose rows may lie apart (gate+up's interleaved tile-rows), one band
    of tile-rows at a time: no copy of the whole matrix is made besides `dst` itself."""
    if L.is_block_type:
        dst[...] = B.pack_blocks(st, L.rows_p, L.cols_p, L.tr, L.tc).reshape(L.n_tile_rows, -1)
        return
    step = max(1, PACK_BAND_BYTES // L.tile_row_nbytes)
    for t0 in range(0, L.n_tile_rows, step):
        t1 = min(t0 + step, L.n_tile_rows)
        units = dst[t0:t1].reshape(t1 - t0, L.n_tile_cols, L.blocks_per_tile, L.unit_nbytes)
        if L.dtype in (DType.Q4, DType.Q8):
            _pack_q_band(units, st, L, t0, t1)
        else:
            _pack_float_band(units, st, L, t0, t1)


def _pack_q_band(units: np.ndarray, st: QTensor, L: TileLayout, t0: int, t1: int) -> None:
    """Tile-rows t0..t1 of a Q4/Q8 stream: per unit the codes of every group (4-byte chunks of 16 rows), then the
    groups' fp16 scales (module docstring)."""
    n, nC, ng, nb = t1 - t0, L.n_tile_cols, L.groups_per_tile, L.blocks_per_tile
    q, s = _pad_q(st, t0 * L.tr, t1 * L.tr, L.cols_p // BLOCK)
    if L.dtype == DType.Q4 and Q4_BAND_PACKER is not None:
        Q4_BAND_PACKER(units, q, s, L)
        return
    chunks = L.code_nbytes // 64
    codes = units[..., : L.scales_offset].view(np.uint32).reshape(n, nC, nb, ng, chunks, GROUP_ROWS)
    # word w of a block (inputs 4w .. 4w + 3) of row 16g + i: [.., g, i, C, b, w] -> [.., C, b, g, w, i]
    words = q.reshape(n, ng, GROUP_ROWS, nC, nb, BLOCK).view(np.uint32)
    if L.dtype == DType.Q4:  # chunk c: inputs 4c + j in the low nibbles, 16 + 4c + j in the high (codes < 16, so
        # the shift never carries into the next byte). The halves are gathered apart first (h outermost), so the
        # nibble merge runs over two contiguous arrays: on the strided view it costs more than the gather itself.
        halves = np.empty((2, n, nC, nb, ng, 4, GROUP_ROWS), np.uint32)
        halves[...] = words.reshape(n, ng, GROUP_ROWS, nC, nb, 2, 4).transpose(5, 0, 3, 4, 1, 6, 2)
        np.left_shift(halves[1], np.uint32(4), out=halves[1])
        np.bitwise_or(halves[1], halves[0], out=codes)
    else:
        codes[...] = words.transpose(0, 3, 4, 1, 5, 2)
    scales = units[..., L.scales_offset :].view(np.float16).reshape(n, nC, nb, ng, GROUP_ROWS)
    scales[...] = s.reshape(n, ng, GROUP_ROWS, nC, nb).transpose(0, 3, 4, 1, 2)


def _pack_float_band(units: np.ndarray, st: np.ndarray, L: TileLayout, t0: int, t1: int) -> None:
    n, nC, ng, nb = t1 - t0, L.n_tile_cols, L.groups_per_tile, L.blocks_per_tile
    npdt = np.float32 if L.dtype == DType.F32 else np.float16
    r0, r1 = t0 * L.tr, min(t1 * L.tr, L.rows)
    full = np.zeros((n * L.tr, L.cols_p), npdt)
    full[: r1 - r0, : L.cols] = st[r0:r1]
    v = full.reshape(n, ng, GROUP_ROWS, nC, nb, BLOCK).transpose(0, 3, 4, 1, 5, 2)  # [.., g, k, i]
    units.view(npdt).reshape(n, nC, nb, ng, BLOCK, GROUP_ROWS)[...] = v


def unpack_q(buf: np.ndarray, dtype, rows: int, cols: int, tile=DEFAULT_TILE) -> QTensor:
    """Inverse of pack for Q4/Q8: the stored codes and fp16 scales as a QTensor (padding dropped)."""
    dtype = DType.parse(dtype) if isinstance(dtype, str) else DType(dtype)
    L = TileLayout(dtype, rows, cols, tile)
    buf = np.asarray(buf, np.uint8)
    if buf.size != L.nbytes:
        raise ValueError(f"tile stream has {buf.size} bytes, layout needs {L.nbytes}")
    if dtype not in (DType.Q4, DType.Q8):
        raise ValueError(f"unpack_q reads Q4/Q8 streams, not {dtype.label}")
    nT, nC, ng, nb = L.n_tile_rows, L.n_tile_cols, L.groups_per_tile, L.blocks_per_tile
    u = buf.reshape(nT, nC, nb, L.unit_nbytes)
    codes = u[..., : L.scales_offset]
    sc = np.ascontiguousarray(u[..., L.scales_offset :]).view(np.float16).reshape(nT, nC, nb, ng, GROUP_ROWS)
    sc = sc.transpose(0, 3, 4, 1, 2).reshape(L.rows_p, L.cols_p // BLOCK)
    if dtype == DType.Q4:
        c = codes.reshape(nT, nC, nb, ng, 4, GROUP_ROWS, 4)
        q = np.concatenate([c & np.uint8(15), c >> np.uint8(4)], axis=4)  # [.., g, 8 (lo c, hi c), i, j]
    else:
        q = np.ascontiguousarray(codes).view(np.int8).reshape(nT, nC, nb, ng, 8, GROUP_ROWS, 4)
    q = q.transpose(0, 3, 5, 1, 2, 4, 6).reshape(L.rows_p, L.cols_p // BLOCK, BLOCK)  # [T, g, i, C, b, 8, 4]
    nblk = -(-cols // BLOCK)
    return QTensor(dtype=dtype, rows=rows, cols=cols, scales=np.ascontiguousarray(sc[:rows, :nblk]),
                   q=np.ascontiguousarray(q[:rows, :nblk]))


def unpack_blocks(buf: np.ndarray, dtype, rows: int, cols: int, tile=DEFAULT_TILE) -> B.BlockTensor:
    """Inverse of pack for a GGUF block type: the GGUF bytes as a BlockTensor (padding dropped)."""
    dtype = DType.parse(dtype) if isinstance(dtype, str) else DType(dtype)
    L = TileLayout(dtype, rows, cols, tile)
    buf = np.asarray(buf, np.uint8)
    if buf.size != L.nbytes:
        raise ValueError(f"tile stream has {buf.size} bytes, layout needs {L.nbytes}")
    return B.unpack_blocks(buf, dtype, rows, cols, L.rows_p, L.cols_p, L.tr)


def unpack(buf: np.ndarray, dtype, rows: int, cols: int, tile=DEFAULT_TILE) -> np.ndarray:
    """Inverse of pack: float32 [rows, cols] (dequantised values, padding dropped)."""
    dtype = DType.parse(dtype) if isinstance(dtype, str) else DType(dtype)
    if B.is_block_type(dtype):
        return unpack_blocks(buf, dtype, rows, cols, tile).dequantize()
    if dtype in (DType.Q4, DType.Q8):
        return np.ascontiguousarray(dequantize(unpack_q(buf, dtype, rows, cols, tile)))
    L = TileLayout(dtype, rows, cols, tile)
    buf = np.asarray(buf, np.uint8)
    if buf.size != L.nbytes:
        raise ValueError(f"tile stream has {buf.size} bytes, layout needs {L.nbytes}")
    nT, nC, ng, nb = L.n_tile_rows, L.n_tile_cols, L.groups_per_tile, L.blocks_per_tile
    npdt = np.float32 if dtype == DType.F32 else np.float16
    v = np.ascontiguousarray(buf.reshape(nT, nC, nb, L.unit_nbytes)).view(npdt).reshape(nT, nC, nb, ng, BLOCK,
                                                                                          GROUP_ROWS)
    full = v.transpose(0, 3, 5, 1, 2, 4).reshape(L.rows_p, L.cols_p).astype(np.float32)
    return np.ascontiguousarray(full[:rows, :cols])


# -- fused streams --------------------------------------------------------------------------


@attrs.frozen
class ConcatLayout:
    """Row-concatenated matrices sharing one input (e.g. QKV): one stream, one output vector.

    parts[i] is the layout of part i; row_offsets[i] is where its rows start in the output
    vector (a multiple of TR); byte_offsets[i] where its tile-rows start in the stream.
    """

    parts: tuple[TileLayout, ...]
    row_offsets: tuple[int, ...]
    byte_offsets: tuple[int, ...]

    @property
    def mixed(self) -> bool:
        """Parts of different types (a GGUF's Q4_K q/k beside a Q6_K v): one kernel per part, not one for all."""
        return len({p.dtype for p in self.parts}) > 1

    @property
    def layout(self) -> TileLayout:
        """The whole stream seen as one matrix (rows = padded total), for the mat-vec kernel; for mixed parts the
        first part's type (its geometry only: each part has its own kernel, parts[i])."""
        p0 = self.parts[0]
        return TileLayout(p0.dtype, sum(p.rows_p for p in self.parts), p0.cols, p0.tile)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def _per_part(dtype, n: int) -> list:
    return list(dtype) if isinstance(dtype, (list, tuple)) else [dtype] * n


def concat_layout(shapes, dtype, tile=DEFAULT_TILE) -> ConcatLayout:
    """Layout of row-concatenated parts; shapes = [(rows, cols), ...] with one shared cols; dtype one for all or
    one per part."""
    parts = tuple(TileLayout(dt, r, c, tile) for (r, c), dt in zip(shapes, _per_part(dtype, len(shapes))))
    if len({p.cols for p in parts}) != 1:
        raise ValueError(f"concatenated parts must share their input width, got {[tuple(s) for s in shapes]}")
    rows = np.cumsum([0] + [p.rows_p for p in parts])[:-1]
    offs = np.cumsum([0] + [p.nbytes for p in parts])[:-1]
    return ConcatLayout(parts, tuple(int(r) for r in rows), tuple(int(o) for o in offs))


def pack_concat(ws, dtype, tile=DEFAULT_TILE) -> tuple[np.ndarray, ConcatLayout]:
    """QKV-style fusion: each part padded to whole tile-rows, streams concatenated.

    Returns (stream, layout); layout.row_offsets gives each part's first row in the output.
    """
    sts = [_as_stored(w, DType.parse(dt) if isinstance(dt, str) else DType(dt))
           for w, dt in zip(ws, _per_part(dtype, len(ws)))]
    cl = concat_layout([_stored_shape(st) for st in sts], dtype, tile)
    out = aligned_empty(cl.nbytes)
    for st, part, off in zip(sts, cl.parts, cl.byte_offsets):
        pack_rows(out[off : off + part.nbytes].reshape(part.n_tile_rows, part.tile_row_nbytes), st, part)
    return out, cl


def gate_up_layout(rows: int, cols: int, dtype, tile=DEFAULT_TILE) -> TileLayout:
    """Layout of ONE of gate/up; the fused stream holds 2 * its nbytes (tile-row pairs)."""
    return TileLayout(dtype, rows, cols, tile)


def pack_gate_up(gate, up, dtype, tile=DEFAULT_TILE) -> np.ndarray:
    """gate+up fusion: tile-row t of gate, then tile-row t of up, for t = 0 .. M'/TR - 1."""
    dtype = DType.parse(dtype) if isinstance(dtype, str) else DType(dtype)
    g, u = _as_stored(gate, dtype), _as_stored(up, dtype)
    if _stored_shape(g) != _stored_shape(u):
        raise ValueError("gate and up must have the same shape")
    L = TileLayout(dtype, *_stored_shape(g), tile)
    out = aligned_empty(2 * L.nbytes)
    pairs = out.reshape(L.n_tile_rows, 2, L.tile_row_nbytes)
    pack_rows(pairs[:, 0], g, L)
    pack_rows(pairs[:, 1], u, L)
    return out


def unpack_gate_up(buf, dtype, rows: int, cols: int, tile=DEFAULT_TILE) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of pack_gate_up (tests): (gate, up) float32 [rows, cols]."""
    L = TileLayout(dtype, rows, cols, tile)
    pairs = np.asarray(buf, np.uint8).reshape(L.n_tile_rows, 2, L.tile_row_nbytes)
    return (unpack(np.ascontiguousarray(pairs[:, 0]).reshape(-1), dtype, rows, cols, tile),
            unpack(np.ascontiguousarray(pairs[:, 1]).reshape(-1), dtype, rows, cols, tile))
