"""Mat-vec units of the GGUF block types (layout/blocks.py): one block of QK inputs for a 16-row group.

Stage: codegen (called by kernels._unit for the mat-vec and gate+up kernels, by kernels._units_at_once for the
mat-mat, and for the embedding row lookup).
Every type computes the same arithmetic (blocks.matvec_twin):

    acc += sum over 32-input activation blocks j, sub-blocks s of j:
               da_j * (S_s * (sum_k u_k a_k - bias_s * sum_k a_k) + M_s * sum_k a_k)

with a = the int8 activation codes (or, for the 32-input types under two-plane activations, 256 q1 + q2 summed as
two int8 dots: kernels.plane_dot), da their float32 scale, u the weight codes; the integer sums are exact
(vpdpbusd on AVX-512 VNNI, vpmaddubsw + vpmaddwd on AVX2, widening multiplies in portable IR) and each sub-block's
sum meets its float scale once. A `Decoder` per type says only where the codes and scales are in the group
(`chunk(j, c)`, c = 0..7: a <16 x i32> vector, lane i = the codes of inputs 4c .. 4c+3 of block j for row i, one
per byte, made where its dot first uses it; `scales(j)`: (S, M) per sub-block as <16 x float>). Codes are unsigned
(bias subtracted through the activation sum, as for Q4_0) or, for the IQ4 code book, signed bytes (looked up with
vpshufb).
"""

from __future__ import annotations

from llvmlite import ir

from ..errors import CodegenError
from ..layout.blocks import E5M3_EXP, IQ4_VALUES, BlockFormat
from ..layout.quant import BLOCK, DType
from .cgutils import (
    V,
    const_vec,
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
    opaque,
    ptr,
    shuffle,
    splat,
)
from .target import ISA

VI = V(i32, 16)
VF = V(f32, 16)


def _k(v: int):
    return const_vec(i32, 16, v)


def _ku(v: int):
    """A 32-bit mask as <16 x i32> (bit 31 set: its two's-complement value)."""
    v &= 0xFFFFFFFF
    return const_vec(i32, 16, v - (1 << 32) if v >= 1 << 31 else v)


def _kf(v: float):
    return const_vec(f32, 16, float(v))


class Decoder:
    """Where one type's codes and scales sit in a 16-row group (module docstring); subclasses per type."""

    int_combine = False  # two 16-input sub-blocks' integer sums scaled by their integer scales before the float
    # the order of a 32-input sub-block's eight chunks in its dot (None: 0..7); any order gives the same exact sum
    order = None
    shared = False  # blocks share words of a field (next_block)

    def __init__(self, b: ir.IRBuilder, fmt: BlockFormat, group, isa):
        self.b, self.fmt, self.g, self.isa = b, fmt, group, ISA.parse(isa)
        self.g0 = group
        self.offs = fmt.group_offsets()
        self._cache: dict = {}

    def next_block(self):
        """Before each block after the first: on the 256-bit paths a type whose blocks share fields (`shared`)
        loads them again for each block, through a pointer LLVM cannot prove equal to the last block's, so that
        it cannot merge the loads and keep 8-16 words live across blocks, which spills AVX2's 16 registers (a
        reload from L1 is cheaper than a spill and its reload)."""
        if not self.shared or not self.isa.narrow:
            return
        self._cache = {}
        self.g = opaque(self.b, self.g0)

    # field access
    def word(self, field: str, c: int):
        """Bytes 4c .. 4c+3 of `field` for the 16 rows: <16 x i32>."""
        key = (field, c)
        if key not in self._cache:
            self._cache[key] = load(self.b, self.g, self.offs[field] + 64 * c, VI)
        return self._cache[key]

    def f16(self, field: str):
        """A 2-byte fp16 field of the 16 rows as <16 x float>."""
        key = (field, "f16")
        if key not in self._cache:
            self._cache[key] = half_to_float(self.b, load(self.b, self.g, self.offs[field], V(i16, 16)), self.isa)
        return self._cache[key]

    def u16(self, field: str):
        """A 2-byte integer field of the 16 rows as <16 x i32>."""
        key = (field, "u16")
        if key not in self._cache:
            self._cache[key] = self.b.zext(load(self.b, self.g, self.offs[field], V(i16, 16)), VI)
        return self._cache[key]

    # small idioms on <16 x i32>
    def shr(self, v, n: int):
        return self.b.lshr(v, _k(n)) if n else v

    def mask(self, v, m: int):
        return self.b.and_(v, _k(m))

    def byte(self, w, k: int):
        """Byte k (0..3) of each lane, zero-extended."""
        return self.mask(self.shr(w, 8 * k), 0xFF)

    def nibbles(self, field: str, word: int, high: bool):
        w = self.word(field, word)
        if not high or not self.isa.narrow:
            return self.mask(self.shr(w, 4 if high else 0), 0x0F0F0F0F)
        # a byte shift, which clears the high bits itself: one vgf2p8affineqb where the CPU has GFNI (LLVM's
        # lowering), else the word shift and mask as before (AVX-512 keeps the word shift: Q6_K 0.95x with it)
        b = self.b
        return b.bitcast(b.lshr(b.bitcast(w, V(i8, 64)), const_vec(i8, 64, 4)), VI)

    def bits_to_bytes(self, w, shift: int, value: int):
        """Lanes whose bits shift .. shift+3 become bytes 0..3 of value or 0 (a 4-bit mask spread over 4 bytes:
        x * 0x00204081 places bit k at bit 8k + k ... and the mask keeps bit 8k)."""
        x = self.mask(self.shr(w, shift), 0xF)
        spread = self.mask(self.b.mul(x, _k(0x00204081)), 0x01010101)
        return self.b.mul(spread, _k(value))

    def to_float(self, v):
        return self.b.sitofp(v, VF)

    # per type
    def codes(self, j: int) -> list:
        """The eight chunks of block j (module docstring)."""
        return [self.chunk(j, c) for c in range(8)]

    def chunk(self, j: int, c: int):
        """Chunk c of block j's codes: <16 x i32>, lane i = the codes of inputs 4c .. 4c+3 for row i."""
        raise NotImplementedError

    def parts(self, j: int) -> list:
        """The codes of block j as a sum of masked fields: [(chunks, rshift, lshift)], the code of an input being
        sum (field >> rshift) << lshift; chunks made where first used, as chunk(). On VNNI each part is dotted as it
        lies in its bytes (vpdpbusd sums into i32: no intermediate saturation) and its sum shifted after: exact,
        since every masked byte is a multiple of 2^rshift, and the shifts and ORs of the field assembly move from
        every chunk to one per sub-block. Default: the assembled codes (one part). Q4_K overrides it (its high
        nibbles, 1.03-1.05x from DRAM on an AMX Xeon). A part per extra bit (Q5_K, Q3_K) costs a second dot per
        chunk, which measured 0.85-0.93x on AVX-512 (one 512-bit dot a cycle); on AVX-VNNI (two 256-bit dots a
        cycle) Q3_K, Q5_K and Q2_K (its 2-bit codes masked in place) take parts, 1.02-1.09x from DRAM, and Q6_K
        assembles its codes (0.97-1.00x as parts: benchmarks/blockdot_ab, docs/performance.md "Decode on each ISA
        path")."""
        return [(_Lazy(range(8), lambda c: self.chunk(j, c)), 0, 0)]

    @property
    def split_fields(self) -> bool:
        """Are a K-quant's extra bits dotted as parts of their own here (parts(): AVX-VNNI only)?"""
        return self.isa == ISA.AVXVNNI

    def field_part(self, field: str, word, mask: int, rshift: int, lshift: int = 0):
        """One part for parts(): chunk c is word word(c) of `field` masked in place by `mask`."""
        return (_Lazy(range(8), lambda c: self.b.and_(self.word(field, word(c)), _ku(mask))), rshift, lshift)

    def scales(self, j: int) -> list:
        """[(S, M or None)] per sub-block of activation block j (one for 32-input sub-blocks, two for 16); by default
        D * sc and Dmin * m of int_scales and supers."""
        D, Dm = self.supers()
        return [(self.b.fmul(D, self.to_float(sc)), None if m is None else self.b.fmul(Dm, self.to_float(m)))
                for sc, m in self.int_scales(j)]

    def int_scales(self, j: int) -> list:
        """Types whose sub-block scales are small integers times a block scale: [(sc, m or None)] as <16 x i32> per
        sub-block of activation block j, with S = D * sc and M = Dmin * m for (D, Dmin) = supers()."""
        raise NotImplementedError

    def supers(self):
        raise NotImplementedError


class _Legacy(Decoder):
    """Q4_1, Q5_0, Q5_1, IQ4_NL: one 32-input block per unit; qs low nibbles inputs 0..15, high 16..31."""

    # a qs word's two chunks (its low and high nibbles) one after the other: the 256-bit paths then keep the word in a
    # register instead of spilling it for four chunks (AVX2 IQ4_XS 1,398 -> 1,322 loop instructions, Q4_1 790 ->
    # 725; from DRAM 1.00-1.03x, at the noise floor: benchmarks/blockdot_ab)
    order = (0, 4, 1, 5, 2, 6, 3, 7)

    def chunk(self, j, c):
        v = self.nibbles("qs", c % 4, c >= 4)
        if "qh" in self.offs:  # Q5: bit k of qh is input k's fifth bit
            v = self.b.or_(v, self.bits_to_bytes(self.word("qh", 0), 4 * c, 16))
        return v

    def scales(self, j):
        return [(self.f16("d"), self.f16("m") if "m" in self.offs else None)]


class _Q4K(Decoder):
    """Q4_K / Q5_K: 8 blocks of 32; qs chunk n (32 bytes) low nibbles block 2n, high block 2n+1; 6-bit scales."""

    # blocks 2n and 2n+1 share their qs words, every block Q5_K's qh words and the scales: reloaded per block on
    # the 256-bit paths, 1.03-1.06x from DRAM (benchmarks/blockdot_ab; docs/quantization.md, "cflow's own block
    # types", the bullet on fields shared by blocks)
    shared = True

    def chunk(self, j, c):
        n, hi = divmod(j, 2)
        v = self.nibbles("qs", 8 * n + c, bool(hi))
        if "qh" in self.offs:  # Q5_K: bit j of qh[l] is input l's fifth bit in block j
            v = self.b.or_(v, self.b.shl(self.mask(self.shr(self.word("qh", c), j), 0x01010101), _k(4)))
        return v

    def parts(self, j):
        n, hi = divmod(j, 2)
        mask = 0xF0F0F0F0 if hi else 0x0F0F0F0F
        nib = self.field_part("qs", lambda c: 8 * n + c, mask, 4 * hi)
        if "qh" not in self.offs:
            return [nib]
        if not self.split_fields:  # Q5_K's fifth bit as a part costs a second dot per chunk (AVX-512: 0.91x)
            return super().parts(j)
        return [nib, self.field_part("qh", lambda c: c, 0x01010101 << j, j, 4)]

    def sbyte(self, k: int):
        return self.byte(self.word("scales", k // 4), k % 4)

    def scales(self, j):
        b = self.b
        if j < 4:
            sc, m = self.mask(self.sbyte(j), 63), self.mask(self.sbyte(j + 4), 63)
        else:
            sc = b.or_(self.mask(self.sbyte(j + 4), 0xF), b.shl(self.shr(self.sbyte(j - 4), 6), _k(4)))
            m = b.or_(self.shr(self.sbyte(j + 4), 4), b.shl(self.shr(self.sbyte(j), 6), _k(4)))
        S = b.fmul(self.f16("d"), self.to_float(sc))
        M = b.fmul(b.fneg(self.f16("dmin")), self.to_float(m))
        return [(S, M)]


class _Q6K(Decoder):
    """Q6_K: 8 blocks of 32 in two halves of 128; low 4 bits from ql, high 2 from qh; int8 scales per 16."""

    int_combine = True  # measured: 1.08x from L2 with it
    shared = True  # blocks q and q + 2 share ql words, a half's four blocks its qh words: 1.06-1.08x (as Q4_K's)

    def chunk(self, j, c):
        n, q = divmod(j, 4)
        return self.b.or_(self.nibbles("ql", 16 * n + 8 * (q % 2) + c, q >= 2),
                          self.b.shl(self.mask(self.shr(self.word("qh", 8 * n + c), 2 * q), 0x03030303), _k(4)))

    def int_scales(self, j):
        n, q = divmod(j, 4)
        out = []
        for h in range(2):
            s = 8 * n + 2 * q + h
            v = self.byte(self.word("scales", s // 4), s % 4)
            out.append((self.b.ashr(self.b.shl(v, _k(24)), _k(24)), None))  # int8
        return out

    def supers(self):
        return self.f16("d"), None


class _Q2K(Decoder):
    """Q2_K: 8 blocks of 32 in two halves of 128 (2-bit codes at shift 2q); a 4-bit scale and min per 16. Without
    the integer combine: no faster with it (0.96-1.01x from DRAM, benchmarks/blockdot_ab)."""

    def chunk(self, j, c):
        n, q = divmod(j, 4)
        return self.mask(self.shr(self.word("qs", 8 * n + c), 2 * q), 0x03030303)

    def parts(self, j):
        if not self.split_fields:
            return super().parts(j)
        n, q = divmod(j, 4)
        return [self.field_part("qs", lambda c: 8 * n + c, 0x03030303 << (2 * q), 2 * q)]

    def int_scales(self, j):
        n, q = divmod(j, 4)
        out = []
        for h in range(2):
            s = 8 * n + 2 * q + h
            v = self.byte(self.word("scales", s // 4), s % 4)
            out.append((self.mask(v, 0xF), self.shr(v, 4)))
        return out

    def supers(self):
        return self.f16("d"), self.b.fneg(self.f16("dmin"))


class _Q3K(Decoder):
    """Q3_K: 2-bit codes as Q2_K plus a third bit from hmask (bit j of hmask[l]); 16 six-bit scales minus 32."""

    # 0.8x from L2 when first tried (more spills); 1.10-1.11x from L3 and DRAM on AVX-512 since, 1.00-1.01x on the
    # 256-bit paths (benchmarks/blockdot_ab)
    int_combine = True

    def chunk(self, j, c):
        n, q = divmod(j, 4)
        b = self.b
        return b.or_(self.mask(self.shr(self.word("qs", 8 * n + c), 2 * q), 0x03030303),
                     b.shl(self.mask(self.shr(self.word("hmask", c), j), 0x01010101), _k(2)))

    def parts(self, j):
        if not self.split_fields:
            return super().parts(j)
        n, q = divmod(j, 4)
        return [self.field_part("qs", lambda c: 8 * n + c, 0x03030303 << (2 * q), 2 * q),
                self.field_part("hmask", lambda c: c, 0x01010101 << j, j, 2)]

    def aux(self, k: int):
        key = ("aux", k)
        if key not in self._cache:
            a0, a1, a2 = (self.word("scales", i) for i in range(3))
            b, k1, k2 = self.b, 0x03030303, 0x0F0F0F0F
            lo = (a0, a1, self.shr(a0, 4), self.shr(a1, 4))[k]
            self._cache[key] = b.or_(self.mask(lo, k2), b.shl(self.mask(self.shr(a2, 2 * k), k1), _k(4)))
        return self._cache[key]

    def int_scales(self, j):
        n, q = divmod(j, 4)
        return [(self.b.sub(self.byte(self.aux((8 * n + 2 * q + h) // 4), (8 * n + 2 * q + h) % 4), _k(32)), None)
                for h in range(2)]

    def supers(self):
        return self.f16("d"), None


class _IQ4XS(Decoder):
    """IQ4_XS: 8 blocks of 32, each laid out as IQ4_NL's qs; a 6-bit scale per block (4 bits in scales_l, 2 in
    scales_h), minus 32."""

    order = _Legacy.order

    def chunk(self, j, c):
        return self.nibbles("qs", 4 * j + c % 4, c >= 4)

    def scales(self, j):
        b = self.b
        lo = self.mask(self.shr(self.word("scales_l", 0), 4 * j), 0xF)
        hi = b.shl(self.mask(self.shr(self.u16("scales_h"), 2 * j), 3), _k(4))
        return [(b.fmul(self.f16("d"), self.to_float(b.sub(b.or_(lo, hi), _k(32)))), None)]


class _IQ4Super(_IQ4XS):
    """cflow's IQ4_128 / IQ4_192 (layout/blocks.py): IQ4_XS's sub-blocks under an E5M3 super-block scale in the top
    byte of the scales word, the sub-block scales' low nibbles below it, their high 2 bits above them (four
    sub-blocks) or in scales_h (six)."""

    def scales(self, j):
        b = self.b
        if ("D",) not in self._cache:  # the float32 whose bits are (byte << 20) + (E5M3_EXP << 23); 0 below e = 1
            byte = self.shr(self.word("scales", 0), 24)
            bits = b.add(b.shl(byte, _k(20)), _k(E5M3_EXP << 23))
            zero = b.icmp_unsigned("<", byte, _k(8))
            self._cache[("D",)] = b.select(zero, _kf(0.0), b.bitcast(bits, VF))
        w = self.word("scales", 0)
        lo = self.mask(self.shr(w, 4 * j), 0xF)
        if "scales_h" not in self.offs:  # four sub-blocks: the high 2 bits above the low nibbles
            hi = self.shr(w, 16 + 2 * j)
        else:
            hi = self.shr(self.u16("scales_h"), 2 * j)
        sc = b.sub(b.or_(lo, b.shl(self.mask(hi, 3), _k(4))), _k(32))
        return [(b.fmul(self._cache[("D",)], self.to_float(sc)), None)]


class _Q3Super(_IQ4Super):
    """cflow's Q3_128 / Q3_192 (layout/blocks.py): 3-bit codes under the IQ4_128 / IQ4_192 scales; chunk c of
    sub-block j is qs word 2j + c % 2 at shift 2 (c // 2) and qh word j at shift c."""

    order = None  # chunks in order: a qs word serves four chunks here (c % 2), not an IQ4 word's two (c, c + 4)

    def chunk(self, j, c):
        b = self.b
        return b.or_(self.mask(self.shr(self.word("qs", 2 * j + c % 2), 2 * (c // 2)), 0x03030303),
                     b.shl(self.mask(self.shr(self.word("qh", j), c), 0x01010101), _k(2)))


DECODERS = {DType.Q4_1: _Legacy, DType.Q5_0: _Legacy, DType.Q5_1: _Legacy, DType.IQ4_NL: _Legacy,
            DType.Q4_K: _Q4K, DType.Q5_K: _Q4K, DType.Q6_K: _Q6K, DType.Q2_K: _Q2K, DType.Q3_K: _Q3K,
            DType.IQ4_XS: _IQ4XS, DType.IQ4_128: _IQ4Super, DType.IQ4_192: _IQ4Super, DType.Q3_128: _Q3Super,
            DType.Q3_192: _Q3Super}


# -- integer dots ---------------------------------------------------------------------------------------------
def _act4(b, aptr, off, n_lanes):
    a = b.load(ptr(b, aptr, off, i32), align=1)
    return b.bitcast(splat(b, a, n_lanes), V(i8, 4 * n_lanes))


def _lookup(b, isa, codes_i8, table_values):
    """Bytes 0..15 -> table_values[byte] (a 16-entry code book), per byte lane."""
    vals = [int(v) for v in table_values]
    isa = ISA.parse(isa)
    if isa == ISA.AVX512VNNI:
        fn = intrinsic(b.module, "llvm.x86.avx512.pshuf.b.512", V(i8, 64), [V(i8, 64), V(i8, 64)])
        return b.call(fn, [ir.Constant(V(i8, 64), vals * 4), codes_i8])
    if isa.narrow:
        fn = intrinsic(b.module, "llvm.x86.avx2.pshuf.b", V(i8, 32), [V(i8, 32), V(i8, 32)])
        t = ir.Constant(V(i8, 32), vals * 2)
        halves = [b.call(fn, [t, shuffle(b, codes_i8, range(h * 32, h * 32 + 32))]) for h in range(2)]
        return b.shuffle_vector(halves[0], halves[1], ir.Constant(V(i32, 64), list(range(64))))
    # portable: a select tree on the four bits, in one small function the chunks call (inlined 64 times a unit, the
    # tree made LLVM take over a minute to compile a kernel for SSE2)
    from .cgutils import internal_function

    def build(fb, codes):
        level = [const_vec(i8, 64, v) for v in vals]
        for bit in range(4):
            on = fb.icmp_unsigned("!=", fb.and_(codes, const_vec(i8, 64, 1 << bit)), const_vec(i8, 64, 0))
            level = [fb.select(on, level[2 * i + 1], level[2 * i]) for i in range(len(level) // 2)]
        fb.ret(level[0])

    key = ("lookup16",) + tuple(v & 0xFF for v in vals)
    return b.call(internal_function(b.module, key, (V(i8, 64),), build, ret=V(i8, 64)), [codes_i8])


def _idot(b, isa, chunks, aptrs, cs, signed: bool, umax: int) -> list:
    """For each activation in aptrs: sum over chunks c in cs of chunks[c] (bytes) . its bytes 4c .. 4c+3, a
    <16 x i32>, exact. Unsigned codes on VNNI; signed codes are shifted by +128 there (the caller subtracts
    128 * sum(a)). Chunk by chunk, every activation in turn: a chunk is made once and used at once by each (a
    mat-mat's tokens; one activation is the mat-vec), each activation's sums in the same order as alone (the
    portable path, activation by activation)."""
    n = len(aptrs)
    if isa.vnni:
        from .kernels import Dots

        accs = [Dots(b, isa) for _ in range(n)]
        for c in cs:
            for acc, aptr in zip(accs, aptrs):
                acc.add(chunks[c], aptr, 4 * c)
        return [acc.total() for acc in accs]
    if isa == ISA.AVX2:
        mad = intrinsic(b.module, "llvm.x86.avx2.pmadd.ub.sw", V(i16, 16), [V(i8, 32), V(i8, 32)])
        wd = intrinsic(b.module, "llvm.x86.avx2.pmadd.wd", V(i32, 8), [V(i16, 16), V(i16, 16)])
        ones = const_vec(i16, 16, 1)
        if signed:
            sign = intrinsic(b.module, "llvm.x86.avx2.psign.b", V(i8, 32), [V(i8, 32), V(i8, 32)])
            absb = intrinsic(b.module, "llvm.abs.v32i8", V(i8, 32), [V(i8, 32), i1])
        # i16 pair sums stay exact while (chunks summed) * 2 * max|code| * 128 <= 32767
        per = 1 if signed else max(1, 32767 // (2 * umax * 128))
        r = [[None, None] for _ in range(n)]
        s16 = [[None, None] for _ in range(n)]
        k = 0

        def flush(t, h):
            v = b.call(wd, [s16[t][h], ones])
            r[t][h] = v if r[t][h] is None else b.add(r[t][h], v)
            s16[t][h] = None

        # chunk by chunk, both halves (rows 0-7, 8-15) of each: a chunk's codes are used as soon as they are made
        # (all of a block's chunks live at once spill AVX2's 16 registers)
        for c in cs:
            halves = [shuffle(b, chunks[c], range(h * 32, h * 32 + 32)) for h in range(2)]
            for t, aptr in enumerate(aptrs):
                a = _act4(b, aptr, 4 * c, 8)
                if signed:  # |a| . (w with a's sign): one abs a chunk for every row group of the unit. Exact: |a| <=
                    # 128 read unsigned (vpabsb(-128) = 0x80), w in [-127, 113] (the code book has no -128 to negate),
                    # so a pair sums to at most 2 * 128 * 127 = 32512, below vpmaddubsw's saturation
                    a_abs = b.call(absb, [a, ir.Constant(i1, 0)])
                for h, w in enumerate(halves):
                    p = b.call(mad, [a_abs, b.call(sign, [w, a])]) if signed else b.call(mad, [w, a])
                    s16[t][h] = p if s16[t][h] is None else b.add(s16[t][h], p)
            k += 1
            if k == per:
                for t in range(n):
                    flush(t, 0)
                    flush(t, 1)
                k = 0
        out = []
        for t in range(n):
            if s16[t][0] is not None:
                flush(t, 0)
                flush(t, 1)
            out.append(b.shuffle_vector(r[t][0], r[t][1], ir.Constant(V(i32, 16), list(range(16)))))
        return out
    # portable: byte products in i16 (|u8 x s8| <= 32640: exact, and SSE2 multiplies i16 lanes natively, not i32),
    # widened to i32 before they are summed
    out = []
    for aptr in aptrs:
        acc = None
        for c in cs:
            w = b.sext(chunks[c], V(i16, 64)) if signed else b.zext(chunks[c], V(i16, 64))
            p = b.sext(b.mul(w, b.sext(_act4(b, aptr, 4 * c, 16), V(i16, 64))), V(i32, 64))
            acc = p if acc is None else b.add(acc, p)
        s = b.add(shuffle(b, acc, range(0, 64, 2)), shuffle(b, acc, range(1, 64, 2)))
        out.append(b.add(shuffle(b, s, range(0, 32, 2)), shuffle(b, s, range(1, 32, 2))))
    return out


def _asum16(b, aptr, h: int):
    """Sum of activation bytes 16h .. 16h+15 (i32)."""
    v = b.sext(load(b, aptr, 16 * h, V(i8, 16)), V(i32, 16))
    return b.call(intrinsic(b.module, "llvm.vector.reduce.add.v16i32", i32, [V(i32, 16)]), [v])


def _asum16_psad(b, aptr, nblocks: int) -> list:
    """The sums of every 16 activation bytes of `nblocks` consecutive 32-byte blocks from aptr (i32, in order), by
    vpsadbw: the bytes + 128 (as unsigned) summed 8 at a time against zero, adjacent pairs added, 2 * 8 * 128 taken
    off; exact. A few instructions a unit where a reduction per 16 bytes took about ten each. 256-bit paths."""
    width, nq = 32, 4
    fn = intrinsic(b.module, "llvm.x86.avx2.psad.bw", V(i64, nq), [V(i8, width), V(i8, width)])
    zero, flip = ir.Constant(V(i8, width), [0] * width), const_vec(i8, width, -128)
    out = []
    for off in range(0, BLOCK * nblocks, width):
        q = b.call(fn, [b.xor(load(b, aptr, off, V(i8, width)), flip), zero])
        for k in range(0, nq, 2):
            pair = b.add(b.extract_element(q, ir.Constant(i32, k)), b.extract_element(q, ir.Constant(i32, k + 1)))
            out.append(b.sub(b.trunc(pair, i32), ir.Constant(i32, 2 * 8 * 128)))
    return out


class UnitActivation:
    """The activation of one unit (QK inputs), shared by its groups: per 32-block its bytes, scale and sums;
    `planes` int8 planes a block (kernels.plane_dot; two for the 32-input types only)."""

    def __init__(self, b, fmt: BlockFormat, kb, xq, xd, xs, planes: int = 1, isa=None):
        per = fmt.qk // BLOCK
        if planes != 1 and (per != 1 or fmt.sub != BLOCK):
            raise CodegenError(f"{fmt.ggml_name} reads one-plane activations only")
        self.planes = planes
        self.blocks = []
        k0 = b.mul(kb, ir.Constant(i64, per))
        # the 16-input types' sums per 16 activation bytes: vpsadbw on the 256-bit paths, whose group loop makes
        # them once per 16-row group (AVX2 / AVX-VNNI Q3_K 1.02-1.03x, Q2_K 1.01-1.02x, Q6_K 1.00-1.01x from DRAM;
        # on AVX-512, made once per unit there, no gain beyond its runs' spread: it keeps the reduction)
        sums16 = None
        if fmt.sub == 16 and isa is not None and ISA.parse(isa).narrow:
            sums16 = _asum16_psad(b, ptr(b, xq, b.mul(k0, ir.Constant(i64, BLOCK))), per)
        for j in range(per):
            k = b.add(k0, ir.Constant(i64, j))
            aptr = ptr(b, xq, b.mul(k, ir.Constant(i64, BLOCK * planes)))
            da = b.load(ptr(b, xd, k), align=4)
            if sums16 is not None:
                sums = sums16[2 * j : 2 * j + 2]
            else:
                sums = [_asum16(b, aptr, h) for h in range(2)] if fmt.sub == 16 else [b.load(ptr(b, xs, k), align=4)]
            self.blocks.append((aptr, da, sums))

    def values(self) -> list:
        """Its IR values in one flat list (block by block: bytes, scale, sums), for passing it as arguments."""
        return [v for aptr, da, sums in self.blocks for v in (aptr, da, *sums)]

    @classmethod
    def of_values(cls, fmt: BlockFormat, values, planes: int = 1) -> UnitActivation:
        """The activation values() gave, as received (the arguments of kernels._group_function's function)."""
        act = cls.__new__(cls)
        act.planes = planes
        n = len(values) // (fmt.qk // BLOCK)  # values per block: bytes, scale and one or two sums
        act.blocks = [(values[i], values[i + 1], list(values[i + 2: i + n])) for i in range(0, len(values), n)]
        return act


class _Lazy:
    """f(items[i]), made on first use and kept: a chunk's codes (its fields, its bitcast, its code-book lookup)
    emitted where its dot first uses it."""

    def __init__(self, items, f):
        self.items, self.f, self.done = items, f, {}

    def __getitem__(self, i):
        if i not in self.done:
            self.done[i] = self.f(self.items[i])
        return self.done[i]


def block_unit(b, isa, fmt: BlockFormat, group, act: UnitActivation, acc, blocks=None, vnni_signed_bias: int = 128,
               reload: bool = True):
    """acc (<16 x float>) + this group's share of W x over the unit's activation blocks `blocks` (default: all, QK
    inputs; module docstring): block_units of one activation."""
    return block_units(b, isa, fmt, group, [act], [acc], blocks, vnni_signed_bias, reload)[0]


def block_units(b, isa, fmt: BlockFormat, group, acts: list, accs: list, blocks=None, vnni_signed_bias: int = 128,
                reload: bool = True) -> list:
    """accs[t] + this group's share of W x_t for each activation acts[t] (a mat-mat's tokens; one is the mat-vec).
    The unit is decoded once, chunk by chunk, and each chunk dotted with every activation in turn (_idot); per
    activation the arithmetic and its order are those of the activation alone, so each result is bit-identical
    to a mat-vec of it. (Blocks outside and groups inside, so that each activation block is live for one sweep,
    measured no faster on an AMX Xeon: LLVM schedules the unrolled unit as one block either way.)
    reload: Decoder.next_block between blocks (a mat-vec). Off in the mat-mat kernel, where before block_units each
    token redid the unit's decode behind the reload's opaque pointers (on AVX2 the Q4_K / Q5_K / Q6_K mat-mat loop
    grew from 3,314 / 4,035 / 4,923 to 4,099 / 6,051 / 6,432 instructions); with the decode now made once for all
    tokens, a reload there would cost one load of the fields a block (not measured)."""
    isa = ISA.parse(isa)
    dec = DECODERS[fmt.dtype](b, fmt, group, isa)
    nsub = BLOCK // fmt.sub
    cper = 8 // nsub  # chunks per sub-block
    fma = isa != ISA.GENERIC
    by_parts = isa.vnni and not fmt.signed
    planes = acts[0].planes
    accs = list(accs)

    def dots(j, codes, aptrs, h):
        """The exact integer dots of sub-block h of block j with each activation (over both planes of a two-plane
        activation)."""
        from .kernels import plane_dots

        return plane_dots(b, lambda ps: dot1(j, codes, ps, h), aptrs, planes)

    def dot1(j, codes, aptrs, h):
        """... over one plane: of its parts (by_parts) or of its assembled codes."""
        cs = range(h * cper, (h + 1) * cper) if dec.order is None or nsub != 1 else dec.order
        if codes is not None:
            return _idot(b, isa, codes, aptrs, cs, fmt.signed and not isa.vnni, fmt.umax)
        total = None
        for chunks, rsh, lsh in parts:
            ps = _idot(b, isa, _Lazy(chunks, lambda v: b.bitcast(v, V(i8, 64))), aptrs, cs, False, 255)
            ps = [b.ashr(p, _k(rsh)) if rsh else p for p in ps]
            ps = [b.shl(p, _k(lsh)) if lsh else p for p in ps]
            total = ps if total is None else [b.add(x, p) for x, p in zip(total, ps)]
        return total

    for j in range(len(acts[0].blocks)):
        if blocks is not None and j not in blocks:
            continue
        if j and reload:
            dec.next_block()
        aptrs = [act.blocks[j][0] for act in acts]
        parts = dec.parts(j) if by_parts else None
        # each chunk made where its dot first uses it (a block's chunks all live at once spill AVX2's registers)
        codes = None if by_parts else _Lazy(range(8), lambda c, j=j: b.bitcast(dec.chunk(j, c), V(i8, 64)))
        if fmt.signed:
            table = [int(v) + 128 for v in IQ4_VALUES] if isa.vnni else [int(v) for v in IQ4_VALUES]
            table = [t - 256 if t > 127 else t for t in table]
            codes = _Lazy(codes, lambda c, table=table: _lookup(b, isa, c, table))
        bias = fmt.bias + (vnni_signed_bias if fmt.signed and isa.vnni else 0)
        if nsub == 2 and dec.int_combine:  # two 16-input sub-blocks share da: integer sums times integer scales
            (sc0, m0), (sc1, m1) = dec.int_scales(j)
            D, Dm = dec.supers()
            isum, msum = [None] * len(acts), [None] * len(acts)
            for h, (sc, m) in enumerate(((sc0, m0), (sc1, m1))):
                for t, part in enumerate(dots(j, codes, aptrs, h)):
                    sums = acts[t].blocks[j][2]
                    if bias:
                        part = b.sub(part, splat(b, b.mul(sums[h], ir.Constant(i32, bias)), 16))
                    part = b.mul(part, sc)
                    isum[t] = part if isum[t] is None else b.add(isum[t], part)
                    if m is not None:
                        mp = b.mul(m, splat(b, sums[h], 16))
                        msum[t] = mp if msum[t] is None else b.add(msum[t], mp)
            for t, act in enumerate(acts):
                ds = splat(b, act.blocks[j][1], 16)
                accs[t] = muladd(b, b.sitofp(isum[t], VF), b.fmul(D, ds), accs[t], fma)
                if msum[t] is not None:
                    accs[t] = muladd(b, b.sitofp(msum[t], VF), b.fmul(Dm, ds), accs[t], fma)
            continue
        for h, (S, M) in enumerate(dec.scales(j)):
            for t, isum in enumerate(dots(j, codes, aptrs, h)):
                _, da, sums = acts[t].blocks[j]
                asum = sums[h] if nsub == len(sums) else sums[0]
                if bias:
                    isum = b.sub(isum, splat(b, b.mul(asum, ir.Constant(i32, bias)), 16))
                accs[t] = muladd(b, b.sitofp(isum, VF), b.fmul(S, splat(b, da, 16)), accs[t], fma)
                if M is not None:
                    accs[t] = muladd(b, M, splat(b, b.fmul(da, b.sitofp(asum, f32)), 16), accs[t], fma)
    return accs



# -- one row out of the tile stream (a quantised embedding kept as stored) --------------------------------------
def emit_embed_row(module: ir.Module, layout, isa):
    """embed(w, token, out, lo, hi): out[k] = W[token, k] for k in [lo, hi), dequantised from the tile stream
    `layout` (Q4/Q8 or a GGUF block type): the embedding row of a model whose embedding is one quantised tile
    stream, shared with a tied head. The unit's codes are decoded for the whole 16-row group with the mat-vec's
    decoders and the token's lane taken out (d values per token: the 16x work is noise)."""
    from .cgutils import Loop, P, c64, internal_function

    isa = ISA.parse(isa)
    L = layout
    key = ("embed_tiled", L.dtype.label, L.cols, L.tr, L.tc, str(isa))

    def build(b, w, token, out, lo, hi):
        tr = c64(L.tr)
        t = b.udiv(token, tr)
        r = b.urem(token, tr)
        g, lane = b.udiv(r, c64(16)), b.trunc(b.urem(r, c64(16)), i32)
        row = b.gep(w, [b.mul(t, c64(L.tile_row_nbytes))])
        hi = b.select(b.icmp_signed("<", hi, c64(L.cols)), hi, c64(L.cols))
        uc = L.unit_cols
        with Loop(b, c64(0), c64(L.n_units), "u") as kb:
            unit = b.gep(row, [b.mul(kb, c64(L.unit_nbytes))])
            for j in range(uc // BLOCK):
                col0 = b.add(b.mul(kb, c64(uc)), c64(BLOCK * j))
                inside = b.and_(b.icmp_signed(">=", col0, lo), b.icmp_signed("<", col0, hi))
                with b.if_then(inside):
                    vals = _row_block(b, isa, L, unit, g, j)  # 8 chunks: (<64 x i8> codes, bias, S64, M64)
                    for c, (codes, signed, bias, S, M) in enumerate(vals):
                        for k in range(4):
                            e = b.add(b.mul(lane, ir.Constant(i32, 4)), ir.Constant(i32, k))
                            q = b.extract_element(codes, e)
                            q = b.sext(q, i32) if signed else b.zext(q, i32)
                            if bias:
                                q = b.sub(q, ir.Constant(i32, bias))
                            v = b.fmul(b.sitofp(q, f32), b.extract_element(S, lane))
                            if M is not None:
                                v = b.fadd(v, b.extract_element(M, lane))
                            b.store(v, b.gep(out, [b.add(col0, c64(4 * c + k))]))
        b.ret_void()

    return internal_function(module, key, (P(i8), i64, P(f32), i64, i64), build)


def _row_block(b, isa, L, unit, g, j: int) -> list:
    """Per chunk c of activation block j of the unit, for group g: (codes <64 x i8>, signed, bias, S, M) with
    S, M <16 x float> per row."""
    from .kernels import _goff

    if L.is_block_type:
        fmt = L.format
        dec = DECODERS[fmt.dtype](b, fmt, ptr(b, unit, _goff(b, g, L.group_nbytes)), isa)
        codes = [b.bitcast(v, V(i8, 64)) for v in dec.codes(j)]
        if fmt.signed:  # the code book itself (signed bytes), whatever the ISA
            codes = [_lookup(b, ISA.GENERIC if isa == ISA.GENERIC else isa, c, [int(v) for v in IQ4_VALUES])
                     for c in codes]
        subs = dec.scales(j)
        per = 8 // len(subs)
        return [(codes[c], fmt.signed, fmt.bias, *subs[c // per]) for c in range(8)]
    # Q4 / Q8 (layout/tile.py): codes of every group first, then the fp16 scales of every group
    S = half_to_float(b, load(b, unit, _goff(b, g, 32, L.scales_offset), V(i16, 16)), isa)
    base = ptr(b, unit, _goff(b, g, L.code_nbytes))
    out = []
    for c in range(8):
        if L.dtype == DType.Q4:
            v = load(b, base, 64 * (c % 4), V(i8, 64))
            v = b.and_(b.lshr(v, const_vec(i8, 64, 4)) if c >= 4 else v, const_vec(i8, 64, 0x0F))
            out.append((v, False, 8, S, None))
        else:
            out.append((load(b, base, 64 * c, V(i8, 64)), True, 0, S, None))
    return out
