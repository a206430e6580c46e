"""The Q4 tile packer as one JIT loop: layout/tile.py's NumPy band packer, bit for bit, in one pass.

    pack_q4_band(units, q, scales, L) fills tile-rows of a Q4 stream (the arguments of tile._pack_q_band)

Why: NumPy packs a Q4 band in four passes (gather the nibble halves of every block apart, shift, merge, gather
the scales), each a strided copy of 4-byte words: 0.4 CPU-s per GB of file, the largest cost of writing a Q4
file once the weights are at hand (docs/expert-tier.md, the writer). This loop reads each block's 32 codes as
four 64-bit words, merges the nibble halves in registers (word h of the high half << 4 | word h of the low half:
chunks 2h, 2h + 1) and stores the four 4-byte chunks and the scale where the tile layout puts them
(layout/tile.py's module docstring), one block after the other.

layout/ imports nothing from the rest of cflow, so this module plugs itself in when imported
(tile.Q4_BAND_PACKER): the writer (runtime/emit.py) imports it; without it the NumPy packer runs, the oracle the
tests compare it with (tests/codegen/test_writer_kernels.py).
"""

from __future__ import annotations

import ctypes

import numpy as np
from llvmlite import ir

from ..layout import tile as T
from .cgutils import Loop, c64, i64
from .library import utility_functions


def kernel_module() -> ir.Module:
    """void q4_pack(i64* q, i16* s, i8* dst, i64 tile_rows, i64 nblk, i64 tr, i64 row_stride): tile-row t's unit k
    at dst + t * row_stride + k * unit (unit = tr * 18 bytes); row r = 16 g + i of it gets its block k's chunk c at
    g * 256 + c * 64 + 4 i of the unit and its scale at tr * 16 + g * 32 + 2 i (q: [rows, nblk] blocks of four
    64-bit words, s: [rows, nblk] fp16 bits)."""
    i8, i16, i32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
    mod = ir.Module(name="q4pack")
    fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [i64.as_pointer(), i16.as_pointer(), i8.as_pointer(), i64,
                                                          i64, i64, i64]), "q4_pack")
    q, s, dst, tile_rows, nblk, tr, row_stride = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    unit_bytes = b.mul(tr, c64(18))
    scale_area = b.mul(tr, c64(16))

    def store(value, at, ty) -> None:
        b.store(value, b.bitcast(b.gep(dst, [at]), ty.as_pointer()), align=1)

    with Loop(b, c64(0), b.mul(tile_rows, tr), "row") as row:  # rows in order: the codes are read front to back
        t, rr = b.udiv(row, tr), b.urem(row, tr)
        g, i = b.lshr(rr, c64(4)), b.and_(rr, c64(15))
        at = b.add(b.mul(t, row_stride), b.add(b.mul(g, c64(256)), b.mul(i, c64(4))))
        sat = b.add(b.mul(t, row_stride), b.add(scale_area, b.add(b.mul(g, c64(32)), b.mul(i, c64(2)))))
        with Loop(b, c64(0), nblk, "k") as k:
            blk = b.add(b.mul(row, nblk), k)
            unit = b.mul(k, unit_bytes)
            w = [b.load(b.gep(q, [b.add(b.mul(blk, c64(4)), c64(h))]), align=1) for h in range(4)]
            for h in (0, 1):
                m = b.or_(w[h], b.shl(w[h + 2], c64(4)))
                store(b.trunc(m, i32), b.add(unit, b.add(at, c64(128 * h))), i32)
                store(b.trunc(b.lshr(m, c64(32)), i32), b.add(unit, b.add(at, c64(128 * h + 64))), i32)
            store(b.load(b.gep(s, [blk]), align=1), b.add(unit, sat), i16)
    b.ret_void()
    return mod


def _fn():
    """The compiled kernel (once per process)."""
    return utility_functions("q4pack", kernel_module,
                             {"q4_pack": (None, *[ctypes.c_void_p] * 3, *[ctypes.c_int64] * 4)})["q4_pack"]


def pack_q4_band(units: np.ndarray, q: np.ndarray, scales: np.ndarray, L: T.TileLayout) -> None:
    """Fill `units` ([tile-rows, n_tile_cols, blocks_per_tile, unit_nbytes] uint8; its tile-rows may lie apart, as
    gate+up's do, each one contiguous) from the padded codes q ([tile-rows x TR, nblk, 32] uint8, each < 16) and
    fp16 scales ([tile-rows x TR, nblk]) of a Q4 band."""
    n = units.shape[0]
    if units.dtype != np.uint8 or units.strides[1:] != (L.tile_nbytes, L.unit_nbytes, 1):
        raise ValueError("pack_q4_band writes uint8 tile-rows that are each contiguous")
    q = np.ascontiguousarray(q, dtype=np.uint8)
    scales = np.ascontiguousarray(scales, dtype=np.float16)
    nblk = q.shape[1]
    if q.shape != (n * L.tr, nblk, T.BLOCK) or scales.shape != q.shape[:2] or nblk * T.BLOCK != L.cols_p:
        raise ValueError(f"codes {q.shape} and scales {scales.shape} do not fill {n} tile-rows of {L}")
    _fn()(q.ctypes.data, scales.ctypes.data, units.ctypes.data, n, nblk, L.tr, units.strides[0])


T.Q4_BAND_PACKER = pack_q4_band
