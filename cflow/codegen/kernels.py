"""Tile kernels as pure llvmlite.ir builders, specialised to one matrix shape, tile and ISA.

Stage: codegen. Input: a passes.tile.TileLayout (the byte layout is defined there) and an ISA
('avx512vnni' | 'avxvnni' | 'avx2' | 'generic', from Target.isa). Output: functions emitted into a caller's
ir.Module (external for ctypes, or internal for a compiled schedule in the same module).

Signatures (plain pointers + i64, callable from ctypes and from generated code):
  quantize_act(f32* x, i8* xq, f32* xd, i32* xs)            x[K] -> int8 blocks of K' inputs
  matvec(u8* w, f32* x, i8* xq, f32* xd, i32* xs, f32* y, i64 r0, i64 r1)
      y[r0*TR : r1*TR] = W x for tile-rows [r0, r1). Q4/Q8 read (xq, xd, xs); F16/F32 read x,
      which must hold K' floats with zero padding. y is indexed by the output row (M' long).
  gate_up(same args, y = h): h[rows of tile-rows r0..r1) = act(gate x) * (up x) on the
      interleaved gate+up stream (tile.pack_gate_up); h is M' long. act: SiLU, or tanh-GELU (GATE_ACTS).
Numerics (Q4/Q8): per 32-block the exact integer dot of weight codes and int8 activation, times
fp16 weight scale times f32 activation scale, summed in f32 (quant.quantize_activation_q8). With two-plane
activations (planes=2, activations='q8x2': quant.quantize_activation_q8x2) a block's codes are 64 bytes, [q1][q2],
its integer dot 256 (w . q1) + (w . q2) (plane_dot), xd = d/256 and xs = sum(256 q1 + q2): the float part is the
same.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
from llvmlite import ir

from ..errors import CodegenError
from ..layout.quant import BLOCK, TWO_PLANE_TYPES, DType
from ..layout.tile import TileLayout, aligned_empty
from . import blockdot
from .cgutils import (
    Loop,
    P,
    V,
    c32,
    const_vec,
    exp_vec,
    f32,
    half_to_float,
    i1,
    i8,
    i16,
    i32,
    i64,
    intrinsic,
    load,
    muladd,
    new_function,
    prefetch_lines,
    ptr,
    shuffle,
    splat,
)
from .target import ISA

MATVEC_ARGS = (P(i8), P(f32), P(i8), P(f32), P(i32), P(f32), i64, i64)
QUANT_ARGS = (P(f32), P(i8), P(f32), P(i32))


def _llvm_major() -> int:
    import llvmlite.binding as llvm

    return llvm.llvm_version_info[0]


def _fma(b, x, y, acc, isa):
    return muladd(b, x, y, acc, isa != ISA.GENERIC)


# -- activation quantiser -----------------------------------------------------------------


def emit_quantize_act(module: ir.Module, name: str, cols: int, cols_p: int | None = None,
                      linkage: str = "external", planes: int = 1) -> ir.Function:
    """quantize_act(x, xq, xd, xs): f32 x[cols] -> per 32-block int8 codes, f32 scale, i32 code sum.

    planes 1: bit-exact with quant.quantize_activation_q8 (d = amax/127 in f32, q = round-half-away(x/d)); 32 code
    bytes a block, xd = d, xs = sum(q). planes 2: with quant.quantize_activation_q8x2, 64 bytes a block ([q1 x 32]
    [q2 x 32]), xd = d/256, xs = sum(256 q1 + q2). Blocks past `cols` up to cols_p (K') are written as zeros.
    """
    cols_p = cols if cols_p is None else cols_p
    nfull, rem, nblk_p = cols // BLOCK, cols % BLOCK, cols_p // BLOCK
    if cols_p % BLOCK or cols_p < cols:
        raise CodegenError(f"quantize_act: padded width {cols_p} must be a multiple of {BLOCK} >= {cols}")
    _check_planes(planes)
    fn = new_function(module, name, QUANT_ARGS, linkage, ("x", "xq", "xd", "xs"))
    x, xq, xd, xs = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    vf, vi = V(f32, BLOCK), V(i32, BLOCK)
    fabs = intrinsic(module, "llvm.fabs.v32f32", vf, [vf])
    fmax = intrinsic(module, "llvm.vector.reduce.fmax.v32f32", f32, [vf])
    rnd = intrinsic(module, "llvm.round.v32f32", vf, [vf])
    radd = intrinsic(module, "llvm.vector.reduce.add.v32i32", i32, [vi])
    tmp = b.alloca(vf, name="tail")
    bb = BLOCK * planes  # code bytes a block

    def block(v, k):
        amax = b.call(fmax, [b.call(fabs, [v])])
        d = b.fdiv(amax, ir.Constant(f32, 127.0))
        inv = b.select(b.fcmp_ordered("==", d, ir.Constant(f32, 0.0)), ir.Constant(f32, 0.0),
                       b.fdiv(ir.Constant(f32, 1.0), d))
        t = b.fmul(v, splat(b, inv, BLOCK))
        r1 = b.call(rnd, [t])
        q = b.fptosi(r1, vi)
        at = b.mul(k, ir.Constant(i64, bb))
        b.store(b.trunc(q, V(i8, BLOCK)), ptr(b, xq, at, V(i8, BLOCK)), align=1)
        if planes == 2:  # t - q1 and its * 256 are exact: no rounding before the second code's own
            r2 = b.call(rnd, [b.fmul(b.fsub(t, r1), ir.Constant(vf, [256.0] * BLOCK))])
            q2 = b.fptosi(r2, vi)
            hi, lo = const_vec(i32, BLOCK, 127), const_vec(i32, BLOCK, -127)  # |256 (t - q1)| <= 128
            q2 = b.select(b.icmp_signed(">", q2, hi), hi, q2)
            q2 = b.select(b.icmp_signed("<", q2, lo), lo, q2)
            b.store(b.trunc(q2, V(i8, BLOCK)), ptr(b, xq, b.add(at, ir.Constant(i64, BLOCK)), V(i8, BLOCK)),
                    align=1)
            q = b.add(b.shl(q, const_vec(i32, BLOCK, 8)), q2)
            d = b.fmul(d, ir.Constant(f32, 1.0 / 256))  # exact: a power of two
        b.store(d, ptr(b, xd, k), align=4)
        b.store(b.call(radd, [q]), ptr(b, xs, k), align=4)

    with Loop(b, ir.Constant(i64, 0), ir.Constant(i64, nfull), "blk") as k:
        block(load(b, x, b.mul(k, ir.Constant(i64, BLOCK)), vf, align=4), k)
    if rem:  # partial last block: copy the valid inputs into a zeroed vector
        b.store(ir.Constant(vf, [0.0] * BLOCK), tmp)
        ftmp = b.bitcast(tmp, P(f32))
        for j in range(rem):
            b.store(b.load(ptr(b, x, nfull * BLOCK + j), align=4), ptr(b, ftmp, j), align=4)
        block(b.load(tmp), ir.Constant(i64, nfull))
    first_zero = nfull + (1 if rem else 0)
    if nblk_p > first_zero:
        with Loop(b, ir.Constant(i64, first_zero), ir.Constant(i64, nblk_p), "pad") as k:
            for h in range(planes):
                b.store(ir.Constant(V(i8, BLOCK), [0] * BLOCK),
                        ptr(b, xq, b.add(b.mul(k, ir.Constant(i64, bb)), ir.Constant(i64, h * BLOCK)),
                            V(i8, BLOCK)), align=1)
            b.store(ir.Constant(f32, 0.0), ptr(b, xd, k), align=4)
            b.store(ir.Constant(i32, 0), ptr(b, xs, k), align=4)
    b.ret_void()
    return fn


def _check_planes(planes: int) -> None:
    if planes not in (1, 2):
        raise CodegenError(f"activation planes must be 1 or 2, not {planes!r}")


def _check_layout_planes(L: TileLayout, planes: int) -> None:
    """Two-plane activations are read by the 32-input block types only (float layouts read x: any)."""
    _check_planes(planes)
    if planes == 2 and L.dtype.quantised and L.dtype not in TWO_PLANE_TYPES:
        raise CodegenError(f"{L.dtype.gguf_name} kernels read one-plane activations only")


def plane_dot(b, one, aptr, planes: int):
    """The exact integer dot of one activation block, <16 x i32>: one(aptr) over its int8 codes (planes 1), or
    256 one(q1) + one(q2) over the two planes of a two-plane block (quant.quantize_activation_q8x2). Each plane is
    one int8 vector as before (vpdpbusd, vpmaddubsw's i16 pair sums and the widening products keep their ranges);
    the combined sums stay below 2^31: 256 x (32 x 255 x 127) + 32 x 255 x 127 < 2.7e8."""
    return plane_dots(b, lambda aptrs: [one(aptrs[0])], [aptr], planes)[0]


def plane_dots(b, many, aptrs, planes: int) -> list:
    """plane_dot for several activation blocks at once: many(aptrs) gives each one's dot over one plane (a
    mat-mat's tokens, blockdot.block_units)."""
    if planes == 1:
        return many(aptrs)
    hi, lo = many(aptrs), many([ptr(b, a, BLOCK) for a in aptrs])
    return [b.add(b.shl(x, const_vec(i32, 16, 8)), y) for x, y in zip(hi, lo)]


# -- integer block dots: one 32-input block of one 16-row group -> <16 x i32> ----------------


def _vpdpbusd(b, acc, w_u8, a_s8):
    """acc[i] += sum_j w_u8[4i+j] * a_s8[4i+j] at acc's width: <16 x i32> (AVX-512 VNNI) or <8 x i32> (AVX-VNNI's
    VEX form, or AVX-512 VNNI's with VL: LLVM picks by target)."""
    n = acc.type.count
    name = f"llvm.x86.avx512.vpdpbusd.{32 * n}"
    if _llvm_major() >= 22:
        fn = intrinsic(b.module, name, V(i32, n), [V(i32, n), V(i8, 4 * n), V(i8, 4 * n)])
        return b.call(fn, [acc, w_u8, a_s8])
    fn = intrinsic(b.module, name, V(i32, n), [V(i32, n)] * 3)
    return b.call(fn, [acc, b.bitcast(w_u8, V(i32, n)), b.bitcast(a_s8, V(i32, n))])


class Dots:
    """Exact u8 x s8 dot products of 16-row groups at the ISA's vpdpbusd width: one <16 x i32> accumulator on
    AVX-512 VNNI, two <8 x i32> halves (rows 0-7, 8-15) on AVX-VNNI. add() takes 64 code bytes (16 rows x 4
    inputs) and the activation bytes they multiply; total() is the <16 x i32> sum. The one place the VNNI kernels
    (Q4/Q8 here, the GGUF block types in blockdot) choose a width."""

    def __init__(self, b, isa):
        self.b, self.wide = b, isa == ISA.AVX512VNNI
        self.acc = [const_vec(i32, 16, 0)] if self.wide else [const_vec(i32, 8, 0)] * 2

    def add(self, w64, aptr, off):
        b = self.b
        if self.wide:
            self.acc[0] = _vpdpbusd(b, self.acc[0], w64, _act4(b, aptr, off, 16))
        else:
            a = _act4(b, aptr, off, 8)
            self.acc = [_vpdpbusd(b, acc, w, a) for acc, w in zip(self.acc, _halves(b, w64))]
        return self

    def total(self):
        if self.wide:
            return self.acc[0]
        return self.b.shuffle_vector(self.acc[0], self.acc[1], ir.Constant(V(i32, 16), list(range(16))))


def _act4(b, aptr, off, n_lanes):
    """Activation bytes aptr[off .. off+3] repeated over n_lanes dwords (a broadcast load)."""
    a = b.load(ptr(b, aptr, off, i32), align=1)
    return b.bitcast(splat(b, a, n_lanes), V(i8, 4 * n_lanes))


def _avx2_dot(b, w32, a32):
    """<32 x u8> * <32 x s8>, adjacent pairs summed: <16 x i16> (vpmaddubsw)."""
    fn = intrinsic(b.module, "llvm.x86.avx2.pmadd.ub.sw", V(i16, 16), [V(i8, 32), V(i8, 32)])
    return b.call(fn, [w32, a32])


def _avx2_madd(b, v16):
    """<16 x i16> adjacent pairs summed into <8 x i32> (vpmaddwd with ones)."""
    fn = intrinsic(b.module, "llvm.x86.avx2.pmadd.wd", V(i32, 8), [V(i16, 16), V(i16, 16)])
    return b.call(fn, [v16, const_vec(i16, 16, 1)])


def _halves(b, v64):
    return shuffle(b, v64, range(32)), shuffle(b, v64, range(32, 64))


def _sum4(b, v64_i32):
    """<64 x i32> -> <16 x i32>: lane i = sum of lanes 4i..4i+3 (generic path)."""
    s = b.add(shuffle(b, v64_i32, range(0, 64, 2)), shuffle(b, v64_i32, range(1, 64, 2)))
    return b.add(shuffle(b, s, range(0, 32, 2)), shuffle(b, s, range(1, 32, 2)))


def _q4_block_int(b, isa, codes, aptr, unpack: int = 0):
    """Q4: 4 chunks of 64 B; low nibbles = inputs 4c.., high nibbles = inputs 16+4c..
    Returns sum_k q[i,k] * a[k] with unsigned codes 0..15 (the caller subtracts 8 * sum(a)).
    unpack (VNNI): 0 masks the high nibbles in place (16 * q) and shifts the block's sum once; 1 shifts every
    chunk's high nibbles down first (one more op per chunk, one fewer per block). Both sums are exact integers,
    so the result is the same; which issues faster is the host's (codegen.tune)."""
    lo_m, hi_m = const_vec(i8, 64, 0x0F), const_vec(i8, 64, 0xF0)
    chunks = [load(b, codes, 64 * c, V(i8, 64)) for c in range(4)]
    if isa.vnni:
        lo, hi = Dots(b, isa), Dots(b, isa)
        for c, v in enumerate(chunks):
            lo.add(b.and_(v, lo_m), aptr, 4 * c)
            hi.add(b.lshr(v, const_vec(i8, 64, 4)) if unpack else b.and_(v, hi_m), aptr, 16 + 4 * c)
        return b.add(lo.total(), hi.total() if unpack else b.ashr(hi.total(), const_vec(i32, 16, 4)))
    if isa == ISA.AVX2:
        # i16 partial sums stay exact: 8 pair sums of at most 2*15*128 = 3840 each, 30720 < 32767.
        s16 = [None, None]
        for c, v in enumerate(chunks):
            lo, hi = b.and_(v, lo_m), b.lshr(v, const_vec(i8, 64, 4))
            for part, off in ((lo, 4 * c), (hi, 16 + 4 * c)):
                a = _act4(b, aptr, off, 8)
                for h, w in enumerate(_halves(b, part)):
                    p = _avx2_dot(b, w, a)
                    s16[h] = p if s16[h] is None else b.add(s16[h], p)
        r = [_avx2_madd(b, s) for s in s16]
        return b.shuffle_vector(r[0], r[1], ir.Constant(V(i32, 16), list(range(16))))
    acc = None
    for c, v in enumerate(chunks):
        lo, hi = b.and_(v, lo_m), b.lshr(v, const_vec(i8, 64, 4))
        for part, off in ((lo, 4 * c), (hi, 16 + 4 * c)):
            p = b.mul(b.zext(part, V(i32, 64)), b.sext(_act4(b, aptr, off, 16), V(i32, 64)))
            acc = p if acc is None else b.add(acc, p)
    return _sum4(b, acc)


def _q_block_ints(b, L: TileLayout, isa, codes, aptrs) -> list:
    """Q4 / Q8 on the VNNI paths for several activations (a mat-mat's token group): _q4_block_int's (unpack 1) or
    _q8_block_int's exact integer sum for each of aptrs. Each 64-byte chunk is loaded and unpacked once and
    dotted with every activation in turn, each activation's sums in one accumulator (Q4's high nibbles shifted
    down, so both halves of a byte add into it): the same integers in another order. (The mat-vec keeps its own:
    two accumulators a token there, for the dot chain's latency, and Q4's tuned `unpack` knob.)"""
    dots = [Dots(b, isa) for _ in aptrs]
    lo_m, flip = const_vec(i8, 64, 0x0F), const_vec(i8, 64, 0x80)
    q4 = L.dtype == DType.Q4
    for c in range(4 if q4 else 8):
        v = load(b, codes, 64 * c, V(i8, 64))
        parts = ([(b.and_(v, lo_m), 4 * c), (b.lshr(v, const_vec(i8, 64, 4)), 16 + 4 * c)] if q4
                 else [(b.xor(v, flip), 4 * c)])
        for w, off in parts:
            for d, aptr in zip(dots, aptrs):
                d.add(w, aptr, off)
    return [d.total() for d in dots]


def _q8_block_int(b, isa, codes, aptr):
    """Q8: 8 chunks of 64 B of int8 codes (inputs 4c..4c+3). VNNI returns sum (q+128)*a (the
    caller subtracts 128 * sum(a)); the other paths return sum q*a exactly."""
    chunks = [load(b, codes, 64 * c, V(i8, 64)) for c in range(8)]
    if isa.vnni:
        flip = const_vec(i8, 64, 0x80)
        accs = [Dots(b, isa), Dots(b, isa)]  # two chains: each vpdpbusd waits on its accumulator's last
        for c, v in enumerate(chunks):
            accs[c % 2].add(b.xor(v, flip), aptr, 4 * c)
        return b.add(accs[0].total(), accs[1].total())
    if isa == ISA.AVX2:
        sign = intrinsic(b.module, "llvm.x86.avx2.psign.b", V(i8, 32), [V(i8, 32), V(i8, 32)])
        absb = intrinsic(b.module, "llvm.abs.v32i8", V(i8, 32), [V(i8, 32), i1])
        r = [None, None]
        for c, v in enumerate(chunks):
            a = _act4(b, aptr, 4 * c, 8)
            for h, w in enumerate(_halves(b, v)):
                # |w| * (a * sign(w)) = w * a, and 2 * 127 * 128 fits vpmaddubsw's i16.
                p = _avx2_madd(b, _avx2_dot(b, b.call(absb, [w, ir.Constant(i1, 0)]), b.call(sign, [a, w])))
                r[h] = p if r[h] is None else b.add(r[h], p)
        return b.shuffle_vector(r[0], r[1], ir.Constant(V(i32, 16), list(range(16))))
    acc = None
    for c, v in enumerate(chunks):
        p = b.mul(b.sext(v, V(i32, 64)), b.sext(_act4(b, aptr, 4 * c, 16), V(i32, 64)))
        acc = p if acc is None else b.add(acc, p)
    return _sum4(b, acc)


# -- mat-vec --------------------------------------------------------------------------------

MAX_GROUPS = 8  # 16-row accumulators held in registers per pass over a tile-row (TR = 128)
# Tuned on a 2-core Xeon (benchmarks/matvec.py): prefetching one Q4 unit (2304 B) ahead into L1
# and two units per loop iteration took 2 threads from ~81% to ~92% of the read bandwidth.
DEFAULT_UNROLL = 2
DEFAULT_PREFETCH = 2304  # bytes ahead of the unit being read
DEFAULT_PREFETCH_LOCALITY = 3  # prefetcht0


def default_prefetch(L: TileLayout, isa=None, gate_up: bool = False) -> int:
    """The built-in prefetch distance: one unit ahead, or the units BUILTIN_KNOBS gives the type on `isa`'s path.
    For Q4/Q8/F16/F32 the measured 2304 bytes (one Q4 unit of 128 rows); a GGUF block type's unit is a whole block
    (8x as many inputs for the K-quants), and 2304 bytes ahead of it fell inside the unit being read: the K-quants
    streamed at 0.6x Q4_0's rate from DRAM with it, at Q4_0's one unit ahead (benchmarks/gguf_types.py)."""
    units = _builtin(L, isa, gate_up).get("prefetch_units") if isa is not None else None
    if units:  # whole lines (a quarter unit of a 64-row tile is not)
        return max(64, int(units * L.unit_nbytes) // 64 * 64)
    return L.unit_nbytes if L.is_block_type else DEFAULT_PREFETCH


# The types whose built-in kernel differs per ISA path; every other type takes the unit loop with the kernel's
# defaults. Knobs: group_loop (one 16-row group of one unit per iteration), prefetch_locality (2: into L2 instead of
# L1), prefetch_units (the prefetch distance in the type's units; default_prefetch).
# - AVX-512: none. Group / unit 0.81-1.05 from DRAM at 1 thread (Q5_0 / Q5_1 at 1.04-1.05 within the runs' spread).
#   Q6_K took the group loop for a while (1.06-1.08x), measured before its chunks were made where used
#   (Decoder.parts, lazily); since then its unit loop is the faster, 1.12-1.13x from DRAM (docs/quantization.md
#   "Decode speed").
# - The 256-bit paths' loops, measured with those paths forced on an AMX Xeon, from DRAM at 1 and 2 threads (`python
#   -m benchmarks.gguf_types --loops unit,group,group-l2`, docs/quantization.md "Decode speed"): a unit of 192 or
#   256 inputs in eight 16-row groups does not fit the 16 vector registers, so the group loop gains 10-40% for the
#   K-quants; the L2 prefetch adds 3-22% to it where the kernel is the least arithmetic-bound (Q4_K, Q5_K, Q6_K,
#   IQ4_XS, IQ4_192) and costs up to 3% for Q2_K and the Q3 types (Q3_K gains 1-2%, within the runs' spread).
# - Q4 and Q8 on the 256-bit paths: two units ahead (4,608 / 8,704 bytes at 128-row tiles). With each path forced on
#   an AMX Xeon (model 207) `cflow tune` chose two units for every Q8 shape (1.12-1.26x over 2,304 bytes in its
#   timing) and for Q4 on AVX2 (1.07-1.09x; AVX-VNNI: its gate+up, a tie on the rest); end to end (TinyLlama
#   geometry) Q8 went from 78-85% to 99-104% of the read bandwidth (docs/journal/performance.md, "Decode on each
#   path, change by change").
#   Not measured on an AVX2-only CPU.
# - Q5_K and Q6_K on the 256-bit paths: a quarter unit ahead (their group loop prefetching into L2), 1.01-1.05x over
#   one unit from DRAM at 1 and 2 threads with each path forced on model 207; Q4_K 0.92-0.93x and IQ4_XS 0.93-0.99x
#   with it (`python -m benchmarks.gguf_types --prefetch-units 1,0.25`; docs/quantization.md, "cflow's own block
#   types", the bullet on the quarter unit).
# `cflow tune` tries both loop kinds, both localities and other distances.
_GL, _GL2, _PF2 = {"group_loop": 1}, {"group_loop": 1, "prefetch_locality": 2}, {"prefetch_units": 2}
_GL2Q = {**_GL2, "prefetch_units": 0.25}
BUILTIN_KNOBS = {
    ISA.AVX512VNNI: {},
    ISA.AVX2: {DType.Q2_K: _GL, DType.Q3_K: _GL, DType.Q3_192: _GL, DType.Q5_1: _GL, DType.Q4_K: _GL2,
               DType.Q5_K: _GL2Q, DType.Q6_K: _GL2Q, DType.IQ4_XS: _GL2, DType.IQ4_192: _GL2, DType.Q4: _PF2,
               DType.Q8: _PF2},
    ISA.AVXVNNI: {DType.Q2_K: _GL, DType.Q3_K: _GL, DType.Q3_128: _GL, DType.Q3_192: _GL, DType.Q4_K: _GL2,
                  DType.Q5_K: _GL2Q, DType.Q6_K: _GL2Q, DType.IQ4_XS: _GL2, DType.Q4: _PF2, DType.Q8: _PF2},
}
# The fused gate+up kernels where they differ from the type's (BUILTIN_KNOBS). AVX-512, Q5_K and Q3_K: the group
# loop with the L2 prefetch. Their unit loops are the largest kernels (a unit's 8 groups x 8 blocks of decode,
# 4,300-4,600 instructions with a third of them stack traffic, twice that for gate+up before the halves shared one
# loop, below). End to end on Qwen2.5-Coder-1.5B's files (model 207, with the halves loop, against the tree before,
# two rounds alternating): Q5_K_M 1.03-1.07x / 1.08-1.13x at 1 / 2 threads, Q3_K_M 1.01x / 1.06-1.08x; Q4_K and
# IQ4_XS lost 1-6% with the group loop in their gate+up and keep the unit loop (docs/performance.md, "The fused
# gate+up kernel"). Measured on model 207 only (Zen 4 / 5 not yet).
BUILTIN_GATE_UP_KNOBS = {
    ISA.AVX512VNNI: {DType.Q5_K: _GL2, DType.Q3_K: _GL2},
}


def _builtin(L: TileLayout, isa, gate_up: bool = False) -> dict:
    """The type's BUILTIN_KNOBS, with a fused kernel's BUILTIN_GATE_UP_KNOBS over them."""
    isa = _check_isa(isa)
    own = BUILTIN_KNOBS.get(isa, {}).get(L.dtype, {})
    return {**own, **BUILTIN_GATE_UP_KNOBS.get(isa, {}).get(L.dtype, {})} if gate_up else own


def builtin_knobs(L: TileLayout, isa, gate_up: bool = False) -> dict:
    """The loop knobs a layout's type takes by default on an ISA path beyond the kernel's own (BUILTIN_KNOBS, and
    for a fused gate+up kernel BUILTIN_GATE_UP_KNOBS): {} or group_loop and prefetch_locality (its prefetch
    distance: default_prefetch)."""
    return {k: v for k, v in _builtin(L, isa, gate_up).items() if k != "prefetch_units"}


def _check_isa(isa: str) -> ISA:
    return ISA.parse(isa)


def _goff(b, g, mult: int, add: int = 0):
    """g * mult + add for a group index that is a Python int or an IR value (a runtime group loop)."""
    if isinstance(g, int):
        return g * mult + add
    return b.add(b.mul(g, ir.Constant(i64, mult)), ir.Constant(i64, add))


def _q_act(b, L, isa, kb, xq, xd, xs, planes: int = 1) -> list:
    """What the groups of one Q4/Q8 unit share: its activation bytes, scale (splat) and, where the codes are
    unsigned, the bias correction bias * sum(a) (splat)."""
    aptr = ptr(b, xq, b.mul(kb, ir.Constant(i64, BLOCK * planes)))
    ad = splat(b, b.load(ptr(b, xd, kb), align=4), 16)
    asum = b.load(ptr(b, xs, kb), align=4)
    bias = 8 if L.dtype == DType.Q4 else (128 if isa.vnni else 0)
    return [aptr, ad] + ([splat(b, b.mul(asum, ir.Constant(i32, bias)), 16)] if bias else [])


def _q_group(b, L, isa, unit, g, shared, acc, unpack: int = 0, planes: int = 1):
    """One Q4/Q8 block unit (32 inputs) for group g: acc + (codes . a) * d_w * d_a (shared: _q_act's)."""
    aptr, ad, *corr = shared
    codes = ptr(b, unit, _goff(b, g, L.code_nbytes))
    isum = plane_dot(b, lambda ap: (_q4_block_int(b, isa, codes, ap, unpack) if L.dtype == DType.Q4
                                    else _q8_block_int(b, isa, codes, ap)), aptr, planes)
    ws = half_to_float(b, load(b, unit, _goff(b, g, 32, L.scales_offset), V(i16, 16)), isa)
    return _q_scaled(b, isa, isum, corr, ws, ad, acc)


def _q_scaled(b, isa, isum, corr, ws, ad, acc):
    """acc + (isum - corr) * ws * ad: a Q4 / Q8 group's float work on its exact integer sum, one token (the mat-vec's
    and the chunk-major mat-mat's, so that both give each token the same bits)."""
    if corr:  # unsigned-code trick: sum((q - bias) * a) = sum(q * a) - bias * sum(a)
        isum = b.sub(isum, corr[0])
    return _fma(b, b.sitofp(isum, V(f32, 16)), b.fmul(ws, ad), acc, isa)


def _f_unit(b, L, isa, unit, kb, groups, accs, x):
    """F32/F16 unit: input k of group g's 16 rows at g*GB + k*(16*esz); k outer so groups interleave."""
    esz = 4 if L.dtype == DType.F32 else 2
    xb = ptr(b, x, b.mul(kb, ir.Constant(i64, BLOCK)))
    for k in range(BLOCK):
        xk = splat(b, b.load(ptr(b, xb, k), align=4), 16)
        for g in groups:
            off = _goff(b, g, L.group_nbytes, k * 16 * esz)
            wv = (load(b, unit, off, V(f32, 16)) if esz == 4
                  else half_to_float(b, load(b, unit, off, V(i16, 16)), isa))
            accs[g] = _fma(b, wv, xk, accs[g], isa)


def _q_units_body(b, L: TileLayout, isa, unit, g, flat, sizes, accs, planes: int) -> list:
    """Q4 / Q8 group g of one unit for the activations whose _q_act values are `flat` (`sizes` each) on a VNNI
    path: _q_group's arithmetic per activation, the codes unpacked once for all (_q_block_ints)."""
    shared = _split(flat, sizes)
    codes = ptr(b, unit, _goff(b, g, L.code_nbytes))
    isums = plane_dots(b, lambda aptrs: _q_block_ints(b, L, isa, codes, aptrs), [s[0] for s in shared], planes)
    ws = half_to_float(b, load(b, unit, _goff(b, g, 32, L.scales_offset), V(i16, 16)), isa)
    return [_q_scaled(b, isa, isum, corr, ws, ad, acc) for (_, ad, *corr), isum, acc in zip(shared, isums, accs)]


def _split(flat: list, sizes: list) -> list:
    """flat cut into consecutive lists of `sizes` (several activations' shared values passed as one argument list)."""
    out, i = [], 0
    for n in sizes:
        out.append(flat[i : i + n])
        i += n
    return out


def _unit_shared(b, L, isa, kb, act, planes: int = 1) -> list:
    """The activation values the groups of one quantised unit share (Q4/Q8: _q_act; a GGUF block type: its
    UnitActivation's), made once per unit and activation."""
    x, xq, xd, xs = act
    if L.is_block_type:
        return blockdot.UnitActivation(b, L.format, kb, xq, xd, xs, planes, isa).values()
    return _q_act(b, L, isa, kb, xq, xd, xs, planes)


def _group(b, L, isa, unit, g, shared, acc, unpack: int = 0, planes: int = 1, one_token: bool = True):
    """acc + group g's share of W x over one quantised unit (shared: _unit_shared's)."""
    if L.is_block_type:
        ua = blockdot.UnitActivation.of_values(L.format, shared, planes)
        return blockdot.block_unit(b, isa, L.format, ptr(b, unit, _goff(b, g, L.group_nbytes)), ua, acc,
                                   reload=one_token)
    return _q_group(b, L, isa, unit, g, shared, acc, unpack, planes)


def _unit(b, L, isa, unit, kb, groups, accs, act, unpack: int = 0, planes: int = 1, one_token: bool = True,
          calls: bool = False) -> None:
    """One unit for `groups` of any dtype: _q_group (Q4/Q8), _f_unit (F16/F32) or a GGUF block type's
    (blockdot.block_unit, one block of QK inputs); act = (x, xq, xd, xs), xq of `planes` int8 planes. one_token:
    the unit is dotted with this activation only (a mat-vec), not with several in turn (a Q4/Q8 mat-mat, whose
    tokens share the unpacked codes through LLVM's common subexpressions; its group function is named apart; a
    block type's mat-mat, and a chunk-major Q4 / Q8 one, take _units_at_once instead). calls: a quantised type's
    groups as calls of _group_function's function."""
    if not L.dtype.quantised:
        _f_unit(b, L, isa, unit, kb, groups, accs, act[0])
        return
    shared = _unit_shared(b, L, isa, kb, act, planes)
    fn = _group_function(b.module, b.function.name, L, isa, [v.type for v in shared], unpack, planes,
                         one_token) if calls else None
    for g in groups:
        if fn is not None:
            accs[g] = b.call(fn, [unit, g if isinstance(g, ir.Value) else ir.Constant(i64, g), *shared, accs[g]])
        else:
            accs[g] = _group(b, L, isa, unit, g, shared, accs[g], unpack, planes, one_token)


def _units_at_once(b, L: TileLayout, isa, unit, kb, groups, accs, acts, planes: int, calls: bool) -> None:
    """One unit for `groups` and several activations (a mat-mat's token group): accs[k][a] += group k's share of
    W x_a. The unit is decoded once per group and each decoded chunk dotted with every token's activation at once
    (a GGUF block type's blockdot.block_units; Q4 / Q8 chunk-major, _q_units_body), instead of each token's group
    code in turn sharing the decode through LLVM's common subexpressions, which kept a whole unit's decoded chunks
    live and spilled them. calls: as one always-inlined function per kernel (_inline_function), returning the
    tokens' sums as a struct."""
    shared = [_unit_shared(b, L, isa, kb, act, planes) for act in acts]
    flat, sizes, n = [v for vs in shared for v in vs], [len(v) for v in shared], len(acts)
    body_fn = _block_units_body if L.is_block_type else _q_units_body
    fn = None
    if calls:
        rt = ir.LiteralStructType([V(f32, 16)] * n)

        def body(fb, funit, fg, *rest):
            agg = ir.Constant(rt, ir.Undefined)
            for a, v in enumerate(body_fn(fb, L, isa, funit, fg, rest[:-n], sizes, rest[-n:], planes)):
                agg = fb.insert_value(agg, v, a)
            fb.ret(agg)

        fn = _inline_function(b.module, f"{b.function.name}.group.mm{n}", rt,
                              [P(i8), i64, *[v.type for v in flat], *[V(f32, 16)] * n],
                              ["unit", "g", *(f"a{k}" for k in range(len(flat))), *(f"acc{a}" for a in range(n))],
                              body)
    for k, g in enumerate(groups):
        if fn is not None:
            gv = g if isinstance(g, ir.Value) else ir.Constant(i64, g)
            res = b.call(fn, [unit, gv, *flat, *accs[k]])
            accs[k] = [b.extract_value(res, a) for a in range(len(acts))]
        else:
            accs[k] = body_fn(b, L, isa, unit, g, flat, sizes, accs[k], planes)


def _block_units_body(b, L: TileLayout, isa, unit, g, flat, sizes, accs, planes: int) -> list:
    """blockdot.block_units of group g over the activations whose _unit_shared values are `flat` (`sizes` each)."""
    acts = [blockdot.UnitActivation.of_values(L.format, vs, planes) for vs in _split(flat, sizes)]
    return blockdot.block_units(b, isa, L.format, ptr(b, unit, _goff(b, g, L.group_nbytes)), acts, accs,
                                reload=False)


def _inline_function(m: ir.Module, name: str, ret, args: list, names: list, body) -> ir.Function:
    """An internal, always-inlined function `name` of m (ret <- args), its body emitted once by body(builder,
    *arguments); the existing one if m has it."""
    fn = m.globals.get(name)
    if fn is None:
        fn = ir.Function(m, ir.FunctionType(ret, args), name)
        fn.linkage = "internal"
        fn.attributes.add("nounwind")
        fn.attributes.add("alwaysinline")
        for a, n in zip(fn.args, names):
            a.name = n
        body(ir.IRBuilder(fn.append_basic_block("entry")), *fn.args)
    return fn


def _group_function(m: ir.Module, kernel: str, L: TileLayout, isa, shared_types, unpack: int, planes: int,
                    one_token: bool) -> ir.Function:
    """_group for a kernel as an internal, always-inlined function (unit, g, *shared, acc) -> acc, emitted once.

    The tile-row loop calls it for each of its groups x unrolled units (x tokens in a mat-mat): each kernel's
    group code is emitted and printed once instead of up to 64 times. The bundled model's step module on the AVX2
    path went from 5.4 to 1.2 MB of IR text and its load on empty caches from 2.77 to 2.10 s (the time outside
    LLVM from 1.0 to 0.35 s; benchmarks/jit_time.py --files). LLVM inlines it before any other pass,
    and the values a unit's groups share are still made once per unit by the caller, in the same order: of 192
    kernels compared against inline emission (4 paths x 9 types x mat-vec, gate+up, group loop, two planes,
    mat-mat, gate+up mat-mat), 186 gave the same assembly, the other six (AVX2 / generic Q8 and generic IQ4_XS
    mat-mats) the same instructions with other address registers and offsets (benchmarks/jit_time.py --kernels
    --asm, with and without --inline; tests/codegen/test_kernels.py checks Q4 and Q4_K mat-vecs)."""
    def body(b, unit, g, *rest):
        b.ret(_group(b, L, isa, unit, g, rest[:-1], rest[-1], unpack, planes, one_token))

    return _inline_function(m, f"{kernel}.group" + ("" if one_token else ".mm"), V(f32, 16),
                            [P(i8), i64, *shared_types, V(f32, 16)],
                            ["unit", "g", *(f"a{k}" for k in range(len(shared_types))), "acc"], body)


def _emit_group_loop(b, L: TileLayout, isa, w_row, act, arr, out, prefetch, pf_locality, unpack, pf_stride,
                     planes: int = 1):
    """out[0:TR] = (one tile-row of W) x, one 16-row group of one block unit per loop iteration.

    The same arithmetic as one pass of _emit_tile_row, group by group and unit by unit in the same order per
    row (so the same numbers), but the loop body is one group's 4.5 (Q4) or 8.5 (Q8) lines, codes and scales,
    instead of a whole unit's 36 or 68: streaming from DRAM, loops with short bodies keep more of one core's
    read bandwidth on Zen 5 (docs/journal/performance.md, "Short loop bodies stream faster"). The group sums live in
    `arr` (an entry-block [NG x <16 x float>] alloca indexed by the group: in L1, a load and a store per
    iteration), the unit's activation is re-read per group (L1). Prefetch: the group's code lines (one per
    `pf_stride` bytes of them) and its scales' line (shared by two groups, so each is asked for twice),
    `prefetch` bytes ahead."""
    ng, UB = L.groups_per_tile, L.unit_nbytes
    nunits = L.n_units
    zf = ir.Constant(V(f32, 16), [0.0] * 16)
    slot = [b.gep(arr, [c32(0), c32(g)]) for g in range(ng)]
    for s in slot:
        b.store(zf, s)
    with Loop(b, ir.Constant(i64, 0), ir.Constant(i64, nunits * ng), "ug") as i:
        kb, g = b.udiv(i, ir.Constant(i64, ng)), b.urem(i, ir.Constant(i64, ng))
        unit = ptr(b, w_row, b.mul(kb, ir.Constant(i64, UB)))
        if prefetch:  # this group's lines, `prefetch` bytes ahead
            offs = [_goff(b, g, L.group_nbytes, prefetch + off) for off in range(0, L.group_nbytes, pf_stride)]
            if L.dtype in (DType.Q4, DType.Q8):
                offs.append(_goff(b, g, 32, prefetch + L.scales_offset))
            prefetch_lines(b, unit, offs, pf_locality)
        sp = b.gep(arr, [c32(0), g])
        accs = {g: b.load(sp)}
        _unit(b, L, isa, unit, kb, [g], accs, act, unpack, planes)
        b.store(accs[g], sp)
    outv = b.bitcast(out, P(V(f32, 16)))
    for g in range(ng):
        b.store(b.load(slot[g]), ptr(b, outv, g), align=4)


def _emit_tile_row(b, L: TileLayout, isa, w_row, acts, slots, outs, unroll, prefetch, pf_locality=2, unpack=0,
                   pf_stride=64, planes: int = 1, group_calls: bool = True, row_ahead=None, q_units: bool = False):
    """outs[a][0:TR] = (one tile-row of W) x_a for every activation a, where w_row points at the tile-row's
    first unit and acts[a] = (x, xq, xd, xs).

    The tile-row is K'/32 consecutive block units. Groups go in passes of len(slots) // len(acts):
    each pass runs over all units with its group sums in registers (`slots` are entry-block
    allocas that SROA promotes), so the 32 activation bytes of a unit are loaded once per pass and each
    weight vector once per unit for all activations (the multi-token kernels: the tile stays in L1/L2).
    One activation is the decode mat-vec; per output the arithmetic is the same for any number of them.
    Several activations run the passes as a loop over their first group (one pass's code to JIT, not one per
    pass); for a GGUF block type, and Q4 / Q8 where q_units, they take each unit's groups together
    (_units_at_once). row_ahead = (bytes, i1): where the i1 holds, each unit also asks for its pass's lines
    `bytes` on (the next tile-row) into L2."""
    ng, UB = L.groups_per_tile, L.unit_nbytes
    nunits = L.n_units
    na = len(acts)
    gp = max(1, len(slots) // na)  # groups per pass
    zf = ir.Constant(V(f32, 16), [0.0] * 16)
    outvs = [b.bitcast(out, P(V(f32, 16))) for out in outs]

    def one_pass(groups, first):
        for s in slots[: na * gp]:
            b.store(zf, s)
        with Loop(b, ir.Constant(i64, 0), ir.Constant(i64, nunits // unroll), "kb") as it:
            for u in range(unroll):
                kb = b.add(b.mul(it, ir.Constant(i64, unroll)), ir.Constant(i64, u))
                unit = ptr(b, w_row, b.mul(kb, ir.Constant(i64, UB)))
                if prefetch and na > 1:  # this pass's lines, `prefetch` bytes ahead (not the whole unit each pass)
                    prefetch_lines(b, unit, _pass_lines(b, L, groups, prefetch), pf_locality)
                elif prefetch:  # one per `pf_stride` bytes of the unit, `prefetch` bytes ahead
                    prefetch_lines(b, unit, [prefetch + off for off in range(0, UB, pf_stride)], pf_locality)
                if row_ahead:  # this pass's lines of the next tile-row, into L2, in the row's last token group
                    with b.if_then(row_ahead[1]):
                        prefetch_lines(b, unit, _pass_lines(b, L, groups, row_ahead[0]), 2)
                if na > 1 and (L.is_block_type or q_units):  # each decoded chunk dotted with every token in turn
                    accs = [[b.load(slots[a * gp + k]) for a in range(na)] for k in range(len(groups))]
                    _units_at_once(b, L, isa, unit, kb, groups, accs, acts, planes, calls=group_calls)
                    for k in range(len(groups)):
                        for a in range(na):
                            b.store(accs[k][a], slots[a * gp + k])
                else:
                    for a, act in enumerate(acts):
                        accs = {g: b.load(slots[a * gp + k]) for k, g in enumerate(groups)}
                        _unit(b, L, isa, unit, kb, groups, accs, act, unpack, planes, one_token=na == 1,
                              calls=group_calls)
                        for k, g in enumerate(groups):
                            b.store(accs[g], slots[a * gp + k])
        for a in range(na):
            for k, g in enumerate(groups):
                b.store(b.load(slots[a * gp + k]), ptr(b, outvs[a], g), align=4)

    if na > 1 and ng > gp and ng % gp == 0:
        with Loop(b, ir.Constant(i64, 0), ir.Constant(i64, ng // gp), "grp") as p:
            g0 = b.mul(p, ir.Constant(i64, gp))
            one_pass([g0] + [b.add(g0, ir.Constant(i64, k)) for k in range(1, gp)], 0)
        return
    for g0 in range(0, ng, gp):
        one_pass(list(range(g0, min(ng, g0 + gp))), g0)


def _pass_lines(b, L: TileLayout, groups, ahead: int) -> list:
    """Offsets (from a unit, `ahead` bytes on) in each 64-byte line that `groups` read of it: their codes (one
    every 64 bytes, and the last byte where a group is not whole lines), and for Q4/Q8 each group's 32 bytes of
    scales (two groups share a line where the unit is line-aligned; asked for twice then, which costs little)."""
    gb = L.group_nbytes
    offs = [_goff(b, g, gb, ahead + off) for g in groups for off in [*range(0, gb, 64)] + ([gb - 1] if gb % 64 else [])]
    if L.code_nbytes:
        offs += [_goff(b, g, 32, ahead + L.scales_offset) for g in groups]
    return offs


def _pick_unroll(nunits: int, unroll: int) -> int:
    u = max(1, min(int(unroll), nunits))
    while nunits % u:
        u -= 1
    return u


def emit_matvec(module: ir.Module, name: str, layout: TileLayout, isa: str, *, linkage: str = "external",
                max_groups: int = MAX_GROUPS, unroll: int = DEFAULT_UNROLL, prefetch: int | None = None,
                prefetch_locality: int | None = None, gate_up: bool = False,
                act: str = "silu", vector_bits: int = 0, unpack: int = 0, prefetch_stride: int = 64,
                group_loop: int | None = None, planes: int = 1, group_calls: bool = True) -> ir.Function:
    """Emit `name`: y[r0*TR:r1*TR] = W x over tile-rows [r0, r1) of `layout` (see module docstring).

    Args:
        isa: 'avx512vnni' (needs AVX-512 VNNI), 'avxvnni' (AVX2+FMA+F16C and AVX-VNNI), 'avx2' (AVX2+FMA+F16C) or
            'generic'.
        max_groups: 16-row groups accumulated in registers per pass (TR/16 <= this: one pass).
        unroll: block units per loop iteration.
        prefetch: software-prefetch distance in bytes (0 = rely on the hardware prefetchers; None: default_prefetch).
        prefetch_locality: llvm.prefetch locality (3 = prefetcht0 into L1, 2 = prefetcht1 into L2); None:
            builtin_knobs' or DEFAULT_PREFETCH_LOCALITY.
        gate_up: the stream is pack_gate_up's; write act(gate x) * (up x) instead of W x.
        act: the gate activation (GATE_ACTS: 'silu' or 'gelu_tanh').
        vector_bits: 256 on an AVX-512 VNNI host: the AVX2 kernel's 256-bit integer dot (vpmaddubsw/vpmaddwd)
            instead of 512-bit vpdpbusd (hosts that execute 512-bit ops as two halves, such as Zen 4, may issue
            it as fast); 0: the ISA's own. The integer block sums are exact either way: same numbers.
        unpack: the Q4 nibble-unpack sequence of the VNNI kernel (_q4_block_int).
        prefetch_stride: bytes between the prefetched lines of a unit (64: every line; a unit's size or more:
            one line per unit, a hint to the hardware prefetchers rather than a fetch of every line).
        group_loop: 1 = one 16-row group of one unit per loop iteration (_emit_group_loop: a short loop body;
            max_groups and unroll do not apply, prefetch_stride counts within a group); 0 = every group of
            `unroll` units per iteration, groups in passes of max_groups; None: builtin_knobs' or 0 (the tuner
            tries both).
        planes: the activation's int8 planes (emit_quantize_act): 2 for quant.TWO_PLANE_TYPES only.
        group_calls: a quantised unit's groups as calls of one always-inlined function (_group_function); False
            emits each inline, the twin the tests compare its assembly with.
    """
    isa = _check_isa(isa)
    _check_act(act)
    _check_layout_planes(layout, planes)
    prefetch = default_prefetch(layout, isa, gate_up) if prefetch is None else prefetch
    builtin = builtin_knobs(layout, isa, gate_up)
    group_loop = builtin.get("group_loop", 0) if group_loop is None else group_loop
    if prefetch_locality is None:
        prefetch_locality = builtin.get("prefetch_locality", DEFAULT_PREFETCH_LOCALITY)
    if vector_bits not in (0, 256, 512):
        raise CodegenError(f"matvec: vector_bits must be 0, 256 or 512, not {vector_bits}")
    if vector_bits == 256 and isa == ISA.AVX512VNNI:
        isa = ISA.AVX2
    L = layout
    fn = new_function(module, name, MATVEC_ARGS, linkage, ("w", "x", "xq", "xd", "xs", "y", "r0", "r1"))
    w, x, xq, xd, xs, y, r0, r1 = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    # NOTE: allocas stay in the entry block, so SROA turns the accumulators into registers.
    slots = [b.alloca(V(f32, 16), name=f"acc{g}") for g in range(min(max(1, max_groups), L.groups_per_tile))]
    tmp = b.bitcast(b.alloca(ir.ArrayType(f32, L.tr), name="rows"), P(f32))
    up = b.bitcast(b.alloca(ir.ArrayType(f32, L.tr), name="up_rows"), P(f32)) if gate_up else None
    # a GGUF block type's unit is a whole block (256 inputs for the K-quants): one a loop iteration
    unroll = _pick_unroll(L.n_units, 1 if L.is_block_type else unroll)
    row_bytes = L.tile_row_nbytes * (2 if gate_up else 1)
    arr = b.alloca(ir.ArrayType(V(f32, 16), L.groups_per_tile), name="group_sums") if group_loop else None

    def tile_row(w_row, out):
        if group_loop:
            _emit_group_loop(b, L, isa, w_row, (x, xq, xd, xs), arr, out, prefetch, prefetch_locality, unpack,
                             prefetch_stride, planes)
        else:
            _emit_tile_row(b, L, isa, w_row, [(x, xq, xd, xs)], slots, [out], unroll, prefetch, prefetch_locality,
                           unpack, prefetch_stride, planes, group_calls)

    with Loop(b, r0, r1, "t") as t:
        w_row = ptr(b, w, b.mul(t, ir.Constant(i64, row_bytes)))
        if gate_up and not group_loop and L.is_block_type:
            # the up tile-row follows the gate tile-row: a block type's unit loop takes both halves in one loop,
            # not two copies of its code, which LLVM spilled more (on AVX-512 its unit loop, timed by `cflow tune`
            # over copies of one matrix in scratch runs: Q4_K 1.07-1.18x, Q5_K 1.11-1.17x, IQ4_XS 1.07-1.11x, Q3_K
            # 1.04-1.09x; end to end on Qwen2.5-Coder-1.5B's Q4_K_M / IQ4_XS files 0.96-1.04x at 1 thread,
            # 1.00-1.10x at 2; the legacy types, whose units are small, tie; Q4 / Q8, 3-7% slower on AVX2 with it,
            # keep two copies)
            with Loop(b, ir.Constant(i64, 0), ir.Constant(i64, 2), "half") as h:
                gate = b.icmp_signed("==", h, ir.Constant(i64, 0))
                tile_row(ptr(b, w_row, b.mul(h, ir.Constant(i64, L.tile_row_nbytes))), b.select(gate, tmp, up))
        else:
            tile_row(w_row, tmp)
            if gate_up:  # the up tile-row follows the gate tile-row
                tile_row(ptr(b, w_row, L.tile_row_nbytes), up)
        y_row = ptr(b, y, b.mul(t, ir.Constant(i64, L.tr)), V(f32, 16))
        for g in range(L.groups_per_tile):
            v = load(b, tmp, 16 * g, V(f32, 16), align=4)
            if gate_up:
                v = _gate_mul(b, v, load(b, up, 16 * g, V(f32, 16), align=4), act)
            b.store(v, ptr(b, y_row, g), align=4)
    b.ret_void()
    return fn


MATMAT_ARGS = MATVEC_ARGS + (i64, i64, i64)  # ..., r0, r1, ntok, x_stride, y_stride
MATMAT_GROUPS = 16  # token-by-token Q4 / Q8 mat-mat accumulators per pass (token groups x row groups): emit_matmat


def matmat_q_units(L: TileLayout, isa, q_units: int | None = None) -> bool:
    """Does emit_matmat's kernel for L on `isa` take Q4 / Q8 units chunk-major (_q_units_body; a VNNI path; None:
    the built-in, AVX-VNNI's)? With 16 registers, each token's units in turn shared the decoded chunks through
    LLVM's common subexpressions and spilled them (AVX-VNNI Q4: 14.2 instructions per 64-byte line and token, 11.7
    chunk-major; in cache 1.22x / 1.32x for Q4 / Q8 in scratch runs of benchmarks/matmat.py). AVX-512 keeps them
    token by token, its 32 registers holding two row groups' work: chunk-major was 1.01-1.08x in cache (scratch) but
    0.94-0.95x for batches of 8 end to end (docs/journal/performance.md, "Prompts and batches, kernel by kernel")."""
    isa = ISA.parse(isa)
    if L.dtype not in (DType.Q4, DType.Q8) or not isa.vnni:
        if q_units:
            raise CodegenError(f"q_units: Q4 / Q8 chunk-major is a VNNI path's ({L.dtype.label} on {isa} has none)")
        return False
    return isa == ISA.AVXVNNI if q_units is None else bool(q_units)


def matmat_groups(L: TileLayout, isa, token_group: int | None = None, max_groups: int | None = None,
                  q_units: int | None = None) -> tuple:
    """(tokens per token group, 16-row groups per pass) of emit_matmat's kernel for L on `isa` (None: built-in)."""
    isa = ISA.parse(isa)
    tg = token_group or (8 if isa == ISA.AVX512VNNI else 4)
    several = L.dtype in (DType.Q4, DType.Q8) and not matmat_q_units(L, isa, q_units)
    max_groups = max_groups or (MATMAT_GROUPS if several else tg)
    return tg, max(1, max_groups // tg)


def emit_matmat(module: ir.Module, name: str, layout: TileLayout, isa: str, act_stride: int, *,
                tail: ir.Function | None = None, linkage: str = "external", token_group: int | None = None,
                max_groups: int | None = None, unroll: int = 1, prefetch: int | None = None,
                prefetch_locality: int | None = None, gate_up: bool = False,
                act: str = "silu", act_blocks: int | None = None, planes: int = 1,
                group_calls: bool = True, next_row: int = 1, q_units: int | None = None) -> ir.Function:
    """Emit `name`: y[t][r0*TR : r1*TR] = W x_t for tokens t in [0, ntok) over tile-rows [r0, r1).

    The multi-token twin of emit_matvec (its arguments, plus ntok, x_stride, y_stride): token t's int8
    activation (`planes` planes) is at xq + t*act_stride bytes, its xd, xs at t*act_blocks elements (default
    act_stride/32), its float input (F16/F32 weights) at x + t*x_stride floats, its output at y + t*y_stride
    floats.
    Each tile-row is streamed from memory once and multiplied against every token while it sits in
    L1/L2, `token_group` tokens per pass; while its last token group runs, the lines of the next tile-row are
    asked for into L2 (`next_row`; not past r1), so that the first pass over a row does not wait for DRAM either
    (asked for in the first group instead, the next row would share L2 with the current one for the whole row: the
    same speed in A/Bs on AVX2, batches of 8 and 512-token prompts). The last ntok mod token_group tokens go
    through `tail` (the layout's mat-vec, one tile-row per call; emitted here if not given). Per output the per-block
    arithmetic and its order are the decode kernel's, so every token's result is bit-identical to a
    mat-vec of it alone. Nothing here depends on the number of rows: one kernel serves every matrix
    of a width.
    """
    _check_isa(isa)
    _check_act(act)
    L = layout
    _check_layout_planes(L, planes)
    prefetch = default_prefetch(L, isa, gate_up) if prefetch is None else prefetch
    nblk = act_stride // BLOCK if act_blocks is None else act_blocks
    if act_stride % BLOCK or act_stride < planes * L.cols_p or nblk < L.cols_p // BLOCK:
        raise CodegenError(f"matmat: activation stride {act_stride} must be a multiple of {BLOCK} >= "
                           f"{planes * L.cols_p}, and {nblk} blocks >= {L.cols_p // BLOCK}")
    if tail is None:  # None knobs: the mat-vec's built-ins (builtin_knobs)
        tail = emit_matvec(module, f"{name}_tail", layout, isa, linkage="internal", gate_up=gate_up, unroll=unroll,
                           prefetch=prefetch, prefetch_locality=prefetch_locality, act=act, planes=planes,
                           group_calls=group_calls)
    prefetch_locality = DEFAULT_PREFETCH_LOCALITY if prefetch_locality is None else prefetch_locality
    fn = new_function(module, name, MATMAT_ARGS, linkage,
                      ("w", "x", "xq", "xd", "xs", "y", "r0", "r1", "ntok", "x_stride", "y_stride"), noalias=False)
    w, x, xq, xd, xs, y, r0, r1, ntok, x_stride, y_stride = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    isa = ISA.parse(isa)
    # Tokens per group: 8 on AVX-512 (32 registers), 4 elsewhere (16 registers, each <16 x f32> two of them).
    # Row groups per pass: Q4 / Q8 take MATMAT_GROUPS // tg (2 or 4) 16-row groups per pass over a tile-row, the
    # GGUF block types one (their unit is up to 8x longer), and so do Q4 / Q8 where they run chunk-major
    # (matmat_q_units: AVX-VNNI). Token by token, in cache on an AMX Xeon, against one group per pass
    # (benchmarks/matmat.py, docs/results/intel-amx/matmat_groups_intel.txt): AVX2 Q4 / Q8 1.07x / 1.08x, AVX-VNNI
    # 1.10x / 1.57x, AVX-512 1.26x / 1.21x, the block types 0.98-1.03x (an earlier pick on a loaded Zen 4 had found
    # one group best, with passes unrolled).
    tg, per_tok = matmat_groups(L, isa, token_group, max_groups, q_units)
    q_units = matmat_q_units(L, isa, q_units)
    slots = [b.alloca(V(f32, 16), name=f"acc{g}") for g in range(tg * min(per_tok, L.groups_per_tile))]
    rows = [b.bitcast(b.alloca(ir.ArrayType(f32, L.tr), name=f"rows{t}"), P(f32)) for t in range(tg)]
    ups = [b.bitcast(b.alloca(ir.ArrayType(f32, L.tr), name=f"up{t}"), P(f32)) for t in range(tg)] if gate_up else []
    unroll = _pick_unroll(L.n_units, 1 if L.is_block_type else unroll)
    row_bytes = L.tile_row_nbytes * (2 if gate_up else 1)

    def token_act(t):
        return (ptr(b, x, b.mul(t, x_stride)), ptr(b, xq, b.mul(t, ir.Constant(i64, act_stride))),
                ptr(b, xd, b.mul(t, ir.Constant(i64, nblk))), ptr(b, xs, b.mul(t, ir.Constant(i64, nblk))))

    def tokens(r, t0, n, acc_slots, last=None):
        """Tile-row r for tokens t0 .. t0 + n - 1 (n a constant); `last` (i1): the row's last token group, which
        asks for the next tile-row's lines."""
        ts = [b.add(t0, ir.Constant(i64, k)) for k in range(n)]
        acts = [token_act(t) for t in ts]
        w_row = ptr(b, w, b.mul(r, ir.Constant(i64, row_bytes)))
        ahead = (row_bytes, last) if last is not None and next_row else None
        _emit_tile_row(b, L, isa, w_row, acts, acc_slots, rows[:n], unroll, prefetch, prefetch_locality,
                       planes=planes, group_calls=group_calls, row_ahead=ahead, q_units=q_units)
        if gate_up:
            _emit_tile_row(b, L, isa, ptr(b, w_row, L.tile_row_nbytes), acts, acc_slots, ups[:n], unroll, prefetch,
                           prefetch_locality, planes=planes, group_calls=group_calls, row_ahead=ahead,
                           q_units=q_units)
        for k, t in enumerate(ts):
            y_row = ptr(b, y, b.add(b.mul(t, y_stride), b.mul(r, ir.Constant(i64, L.tr))), V(f32, 16))
            for g in range(L.groups_per_tile):
                v = load(b, rows[k], 16 * g, V(f32, 16), align=4)
                if gate_up:
                    v = _gate_mul(b, v, load(b, ups[k], 16 * g, V(f32, 16), align=4), act)
                b.store(v, ptr(b, y_row, g), align=4)

    full = b.sdiv(ntok, ir.Constant(i64, tg))
    with Loop(b, r0, r1, "r") as r:  # NOTE: tile-rows outside, tokens inside: each tile-row is read from DRAM once
        with Loop(b, ir.Constant(i64, 0), full, "tg") as q:
            # the row's last token group, and a next row that is this call's (not another thread's, another matrix)
            last = b.and_(b.icmp_unsigned("==", q, b.sub(full, ir.Constant(i64, 1))),
                          b.icmp_signed("<", b.add(r, ir.Constant(i64, 1)), r1))
            tokens(r, b.mul(q, ir.Constant(i64, tg)), tg, slots, last)
        with Loop(b, b.mul(full, ir.Constant(i64, tg)), ntok, "t1") as t:
            xt, xqt, xdt, xst = token_act(t)
            b.call(tail, [w, xt, xqt, xdt, xst, ptr(b, y, b.mul(t, y_stride)), r, b.add(r, ir.Constant(i64, 1))])
    b.ret_void()
    return fn


GATE_ACTS = ("silu", "gelu_tanh")  # ModelConfig.activation: the gate activation of every gate_up kernel
_GELU_C = math.sqrt(2.0 / math.pi)


def _check_act(act: str) -> None:
    if act not in GATE_ACTS:
        raise CodegenError(f"gate activation {act!r} is not one of {', '.join(GATE_ACTS)}")


def _gate_mul(b, g, u, act: str = "silu"):
    """act(g) * u, both activations as g / (1 + exp(-z)) * u: silu z = g; tanh-GELU
    0.5 g (1 + tanh(y)) = g sigmoid(2y), so z = 2 sqrt(2/pi) (g + 0.044715 g^3) (overflow gives g / inf = 0)."""
    _check_act(act)  # NOTE: a non-string here once meant SiLU for every GELU model's prompt blocks
    vt = V(f32, 16)
    one = ir.Constant(vt, [1.0] * 16)
    z = g
    if act == "gelu_tanh":
        g3 = b.fmul(b.fmul(g, g), g)
        z = b.fmul(ir.Constant(vt, [2.0 * _GELU_C] * 16), b.fadd(g, b.fmul(ir.Constant(vt, [0.044715] * 16), g3)))
    # exp in vector ops (cgutils.exp_vec, ~1 ulp), not llvm.exp: without a vector math library LLVM lowers that
    # to 16 libm calls a vector, and the calls cost more than their time: every vector register live across them
    # is spilled, so the tile loop's constants came back from memory. With Q6_K's loop beside it, Qwen2.5-Coder-1.5B's
    # Q4_K_M file decoded 3-11% faster at 1 thread (docs/journal/performance.md, "The gate's exp").
    return b.fmul(b.fdiv(g, b.fadd(one, exp_vec(b, b.fsub(ir.Constant(vt, [0.0] * 16), z)))), u)


# -- ctypes convenience (tests, benchmarks) ------------------------------------------------------


class Activation:
    """Host buffers one activation vector lives in: x (f32, K' zero-padded), xq/xd/xs (int8 blocks, `planes`
    planes)."""

    def __init__(self, cols: int, cols_p: int, planes: int = 1):
        self.cols, self.cols_p, self.planes = cols, cols_p, planes
        self.x = np.zeros(cols_p, np.float32)
        self.xq = aligned_empty(cols_p * planes).view(np.int8)
        self.xd = np.zeros(cols_p // BLOCK, np.float32)
        self.xs = np.zeros(cols_p // BLOCK, np.int32)


def _p(a):
    return ctypes.c_void_p(a.ctypes.data)


class MatVec:
    """A compiled quantiser + mat-vec for one layout (a thin ctypes wrapper around a Library)."""

    def __init__(self, layout: TileLayout, target=None, isa: str | None = None, cache=None,
                 gate_up: bool = False, planes: int = 1, **tuning):
        from .library import Library
        from .target import host_target

        self.layout, self.gate_up, self.planes = layout, gate_up, planes
        target = target if target is not None else host_target()
        self.isa = _check_isa(isa or target.isa)
        if not self.isa.runs_on(target.isa):
            raise CodegenError(f"kernel ISA {self.isa} needs CPU features the target lacks ({target.describe()})")
        mod = ir.Module(name="matvec")
        emit_quantize_act(mod, "quantize_act", layout.cols, layout.cols_p, planes=planes)
        emit_matvec(mod, "matvec", layout, self.isa, gate_up=gate_up, planes=planes, **tuning)
        self.library = Library(name="matvec", target=target, cache=cache)
        self.library.add_ir(mod)
        self.library.finalize()
        vp = ctypes.c_void_p
        self._quant = self.library.get_cfunc("quantize_act", None, vp, vp, vp, vp)
        self._mv = self.library.get_cfunc("matvec", None, vp, vp, vp, vp, vp, vp, ctypes.c_int64, ctypes.c_int64)

    def activation(self, x) -> Activation:
        L = self.layout
        act = Activation(L.cols, L.cols_p, self.planes)
        act.x[: L.cols] = np.asarray(x, np.float32)
        self._quant(_p(act.x), _p(act.xq), _p(act.xd), _p(act.xs))
        return act

    def __call__(self, w: np.ndarray, act: Activation, y: np.ndarray | None = None, r0: int = 0,
                 r1: int | None = None) -> np.ndarray:
        L = self.layout
        need = L.nbytes * (2 if self.gate_up else 1)
        if w.dtype != np.uint8 or w.size < need or not w.flags.c_contiguous:
            raise CodegenError(f"matvec: weight stream must be contiguous uint8 of {need} bytes")
        r1 = L.n_tile_rows if r1 is None else r1
        if not 0 <= r0 <= r1 <= L.n_tile_rows:
            raise CodegenError(f"matvec: tile-row range [{r0}, {r1}) outside [0, {L.n_tile_rows})")
        if y is None:
            y = np.zeros(L.rows_p, np.float32)
        if y.dtype != np.float32 or y.size < L.rows_p or not y.flags.c_contiguous:
            raise CodegenError(f"matvec: output must be float32 with {L.rows_p} elements")
        self._mv(_p(w), _p(act.x), _p(act.xq), _p(act.xd), _p(act.xs), _p(y), r0, r1)
        return y
