"""IR-building helpers every emitter shares (kernels.py, ops.py, attention.py, step.py): types, constants, loops,
allocas, intrinsics and libc/syscall declarations, vector idioms. Pure llvmlite.ir; no target state.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from llvmlite import ir

from .target import ISA

i1, i8, i16, i32, i64 = (ir.IntType(n) for n in (1, 8, 16, 32, 64))
f16, f32 = ir.HalfType(), ir.FloatType()
void = ir.VoidType()
V = ir.VectorType


class BFloatType(ir.types._BaseFloatType):
    """LLVM's `bfloat` (llvmlite has no class for it): only the operand type of the BF16 dot-product
    intrinsic, reached by bitcasting integer vectors; no constants of it are ever emitted."""

    null = "0.0"
    intrinsic_name = "bf16"

    def __str__(self):
        return "bfloat"

    def format_constant(self, value):
        raise TypeError("bfloat constants are not emitted")


BFloatType._create_instance()
bf16 = BFloatType()
P = ir.PointerType


# -- constants ---------------------------------------------------------------------------------
def c64(v: int) -> ir.Constant:
    return ir.Constant(i64, int(v))


def c32(v: int) -> ir.Constant:
    return ir.Constant(i32, int(v))


def cf(v: float) -> ir.Constant:
    return ir.Constant(f32, float(v))


def const_vec(ty, n: int, value) -> ir.Constant:
    return ir.Constant(V(ty, n), [value] * n)


# -- declarations ------------------------------------------------------------------------------
def get_or_declare(module: ir.Module, name: str, ret, args, var_arg: bool = False) -> ir.Function:
    """The module's function `name`, declared on first use (intrinsics, libc, syscall)."""
    fn = module.globals.get(name)
    if fn is None:
        fn = ir.Function(module, ir.FunctionType(ret, list(args), var_arg=var_arg), name)
    return fn


def intrinsic(module: ir.Module, name: str, ret, args) -> ir.Function:
    """An LLVM intrinsic, e.g. intrinsic(m, "llvm.exp.f32", f32, [f32])."""
    return get_or_declare(module, name, ret, args)


def syscall(module: ir.Module) -> ir.Function:
    """libc's variadic syscall(number, ...) (resolved by the JIT from the process)."""
    return get_or_declare(module, "syscall", i64, [i64], var_arg=True)


def sched_yield(module: ir.Module) -> ir.Function:
    """libc's sched_yield."""
    return get_or_declare(module, "sched_yield", i32, [])


def pause(b: ir.IRBuilder, isa: str) -> None:
    """The spin-wait hint (x86 PAUSE); nothing on the generic path."""
    if isa != ISA.GENERIC:
        b.call(intrinsic(b.module, "llvm.x86.sse2.pause", void, []), [])


# -- functions -----------------------------------------------------------------------------------
def new_function(module: ir.Module, name: str, args, linkage: str = "external", arg_names=(), ret=void,
                 noalias: bool = True) -> ir.Function:
    """A nounwind function with named args (pointer args noalias unless told otherwise)."""
    fn = ir.Function(module, ir.FunctionType(ret, list(args)), name)
    fn.linkage = linkage
    fn.attributes.add("nounwind")
    for a, n in zip(fn.args, arg_names):
        a.name = n
        if noalias and isinstance(a.type, ir.PointerType):
            a.add_attribute("noalias")
    return fn


def internal_function(m: ir.Module, key: tuple, args, build: Callable, ret=void) -> ir.Function:
    """Get or emit the internal, never-inlined function named after `key` (its specialisation);
    build(builder, *args) emits the body on first use."""
    name = "_".join(str(k) for k in key)
    fn = m.globals.get(name)
    if fn is None:
        fn = ir.Function(m, ir.FunctionType(ret, list(args)), name)
        fn.linkage = "internal"
        fn.attributes.add("nounwind")
        fn.attributes.add("noinline")
        build(ir.IRBuilder(fn.append_basic_block("entry")), *fn.args)
    return fn


# -- memory --------------------------------------------------------------------------------------
def alloca_once(b: ir.IRBuilder, ty, name: str = ""):
    """An alloca in the entry block (never inside a loop: the stack would grow every iteration)."""
    cur = b.block
    b.position_at_start(b.function.entry_basic_block)
    a = b.alloca(ty, name=name)
    b.position_at_end(cur)
    return a


def ptr(b: ir.IRBuilder, base, offset, ty=None):
    """base (any pointer) + offset *elements of base* -> pointer to ty."""
    p = b.gep(base, [offset if isinstance(offset, ir.Value) else c64(offset)])
    return b.bitcast(p, P(ty)) if ty is not None and p.type.pointee != ty else p


def opaque(b: ir.IRBuilder, v, name: str = ""):
    """v through an empty asm: the same value at run time, one LLVM cannot prove equal to v (or to another opaque
    copy of it), so it neither folds what is loaded through it nor merges those loads with others."""
    return b.call(ir.InlineAsm(ir.FunctionType(v.type, [v.type]), "", "=r,0"), [v], name=name)


def prefetch_lines(b: ir.IRBuilder, base, offsets, locality: int = 3) -> None:
    """llvm.prefetch (read, `locality`, data) of base + each offset (ints or IR values, elements of base; never
    faults, so a prefetch past the end of a buffer is harmless)."""
    pf = intrinsic(b.module, "llvm.prefetch.p0", ir.VoidType(), [P(i8), i32, i32, i32])
    for off in offsets:
        b.call(pf, [ptr(b, base, off)] + [ir.Constant(i32, v) for v in (0, locality, 1)])


def muladd(b: ir.IRBuilder, x, y, acc, fma: bool):
    """acc + x * y for <n x float> (or float) values: llvm.fma (one rounding) where fma is set, i.e. on an ISA with
    the instruction; otherwise a multiply then an add (two roundings, the same bits on every ISA)."""
    if not fma:
        return b.fadd(b.fmul(x, y), acc)
    n = _lanes(x)
    ty = V(f32, n) if n else f32
    return b.call(intrinsic(b.module, f"llvm.fma.v{n}f32" if n else "llvm.fma.f32", ty, [ty] * 3), [x, y, acc])


def load(b: ir.IRBuilder, base, offset, ty, align: int = 1):
    return b.load(ptr(b, base, offset, ty), align=align)


# -- vectors -------------------------------------------------------------------------------------
def splat(b: ir.IRBuilder, scalar, n: int):
    vt = V(scalar.type, n)
    v = b.insert_element(ir.Constant(vt, ir.Undefined), scalar, c32(0))
    return b.shuffle_vector(v, ir.Constant(vt, ir.Undefined), ir.Constant(V(i32, n), [0] * n))


def shuffle(b: ir.IRBuilder, v, idx):
    return b.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), ir.Constant(V(i32, len(idx)), list(idx)))


def _lanes(v) -> int | None:
    """Lanes of a vector value, None for a scalar (the conversions below take either)."""
    return v.type.count if isinstance(v.type, ir.VectorType) else None


def _lit(ty, n: int | None, v):
    """A constant of ty, splat over n lanes (None: a scalar)."""
    return const_vec(ty, n, v) if n else ir.Constant(ty, v)


def half_to_float(b: ir.IRBuilder, h, isa: str):
    """IEEE half bits (i16, or <n x i16>) -> float (or <n x float>).

    F16C (every non-generic ISA) converts in one instruction; the generic path uses integer ops only
    (no libcall): exponent rebias by a multiply, normals, zeros, subnormals, inf/nan.
    """
    n = _lanes(h)

    def k(ty, v):
        return _lit(ty, n, v)

    fty = V(f32, n) if n else f32
    if isa != ISA.GENERIC:
        return b.fpext(b.bitcast(h, V(f16, n) if n else f16), fty)
    if n:  # one small function per width, called: inlined at every use, an f16 kernel's IR grew 4.5x and its JIT
        # took 10x the F16C path's (5.8 s for one gate+up kernel)
        name = f"cflow_half_to_float_v{n}"
        mod = b.module
        fn = mod.globals.get(name)
        if fn is None:
            fn = ir.Function(mod, ir.FunctionType(fty, [h.type]), name)
            fn.linkage = "internal"
            fn.attributes.add("noinline")
            fb = ir.IRBuilder(fn.append_basic_block("entry"))
            fb.ret(_half_to_float_int(fb, fn.args[0], n))
        return b.call(fn, [h])
    return _half_to_float_int(b, h, n)


def _half_to_float_int(b: ir.IRBuilder, h, n: int | None):
    """half_to_float's integer-only conversion (the generic path)."""

    def k(ty, v):
        return _lit(ty, n, v)

    fty = V(f32, n) if n else f32
    ity = V(i32, n) if n else i32
    w = b.zext(h, ity)
    mag = b.shl(b.and_(w, k(i32, 0x7FFF)), k(i32, 13))
    f = b.fmul(b.bitcast(mag, fty), k(f32, 2.0**112))
    inf = b.icmp_unsigned(">=", mag, k(i32, 0x7C00 << 13))
    fb = b.select(inf, b.or_(mag, k(i32, 0x7F800000)), b.bitcast(f, ity))
    sign = b.shl(b.and_(w, k(i32, 0x8000)), k(i32, 16))
    return b.bitcast(b.or_(fb, sign), fty)


def float_to_half(b: ir.IRBuilder, x, isa: str):
    """float (or <n x float>) -> IEEE half bits (i16 / <n x i16>), rounded to nearest even (numpy's astype).

    F16C converts in one instruction; the generic path uses integer and float ops only (no libcall): the
    exponent rebias with the round-to-nearest-even carry, the half subnormals by adding 0.5 (whose ulp is the
    smallest half subnormal, so the FPU rounds), overflow to inf, NaN kept quiet.
    """
    n = _lanes(x)

    def k(ty, v):
        return _lit(ty, n, v)

    hty = V(i16, n) if n else i16
    if isa != ISA.GENERIC:
        return b.bitcast(b.fptrunc(x, V(f16, n) if n else f16), hty)
    ity, fty = (V(i32, n), V(f32, n)) if n else (i32, f32)
    w = b.bitcast(x, ity)
    sign = b.and_(b.lshr(w, k(i32, 16)), k(i32, 0x8000))
    a = b.and_(w, k(i32, 0x7FFFFFFF))
    odd = b.and_(b.lshr(a, k(i32, 13)), k(i32, 1))
    normal = b.lshr(b.add(b.sub(a, k(i32, 0x38000000)), b.add(odd, k(i32, 0xFFF))), k(i32, 13))
    sub = b.sub(b.bitcast(b.fadd(b.bitcast(a, fty), k(f32, 0.5)), ity), k(i32, 0x3F000000))
    h = b.select(b.icmp_unsigned("<", a, k(i32, 0x38800000)), sub, normal)
    h = b.select(b.icmp_unsigned(">=", a, k(i32, 0x477FF000)), k(i32, 0x7C00), h)
    h = b.select(b.icmp_unsigned(">", a, k(i32, 0x7F800000)), k(i32, 0x7E00), h)
    return b.trunc(b.or_(h, sign), hty)


def float_to_bf16(b: ir.IRBuilder, x, hw: bool = False):
    """float (or <n x float>) -> bfloat16 bits (i16 / <n x i16>): the top half of the float, rounded to nearest
    even (layout.quant.round_bf16 is the NumPy twin), NaN kept quiet. Integer ops, on every ISA; hw: AVX512_BF16's
    VCVTNEPS2BF16 for 8 or 16 lanes (one instruction for the integer sequence's ~10 ops), the same bits except that it
    flushes subnormal inputs and results to zero (as VDPBF16PS treats them), so only for values known to be
    normal or zero where bit-equality with the twin matters."""
    n = _lanes(x)
    if hw and n in (8, 16):
        fn = intrinsic(b.module, f"llvm.x86.avx512bf16.cvtneps2bf16.{32 * n}", V(bf16, n), [V(f32, n)])
        return b.bitcast(b.call(fn, [x]), V(i16, n))

    def k(ty, v):
        return _lit(ty, n, v)

    w = b.bitcast(x, V(i32, n) if n else i32)
    r = b.lshr(b.add(w, b.add(k(i32, 0x7FFF), b.and_(b.lshr(w, k(i32, 16)), k(i32, 1)))), k(i32, 16))
    nan = b.icmp_unsigned(">", b.and_(w, k(i32, 0x7FFFFFFF)), k(i32, 0x7F800000))
    r = b.select(nan, b.or_(b.lshr(w, k(i32, 16)), k(i32, 0x0040)), r)
    return b.trunc(r, V(i16, n) if n else i16)


def bf16_dot(b: ir.IRBuilder, acc, x, y, hw: bool, fma: bool = True):
    """acc + x . y over bf16 pairs: acc <n x float>; x, y <n x i32>, each lane a pair of bf16 (element 2i in the
    low half). Lane i gets acc + x_hi * y_hi, then + x_lo * y_lo, each product exact in f32 (8-bit mantissas), so
    one rounding per add: the order VDPBF16PS defines. hw: use that instruction (AVX512_BF16, n in 4, 8, 16);
    otherwise both halves are widened by shifts and added by FMA (fma=False: multiply then add, the same
    result since the product is exact). The instruction treats subnormal inputs and results as zero; the
    emulation does not (the only difference: values below 1.2e-38)."""
    n = x.type.count
    if hw and n in (4, 8, 16):
        fn = intrinsic(b.module, f"llvm.x86.avx512bf16.dpbf16ps.{32 * n}", V(f32, n),
                       [V(f32, n), V(bf16, 2 * n), V(bf16, 2 * n)])
        return b.call(fn, [acc, b.bitcast(x, V(bf16, 2 * n)), b.bitcast(y, V(bf16, 2 * n))])
    hi_m, sh = const_vec(i32, n, -65536), const_vec(i32, n, 16)
    fty = V(f32, n)
    acc = muladd(b, b.bitcast(b.and_(x, hi_m), fty), b.bitcast(b.and_(y, hi_m), fty), acc, fma)
    return muladd(b, b.bitcast(b.shl(x, sh), fty), b.bitcast(b.shl(y, sh), fty), acc, fma)


# -- math ------------------------------------------------------------------------------------------
def softcap(b: ir.IRBuilder, x, cap: float):
    """cap * tanh(x / cap) for an f32 or a <n x float> (Gemma 2's soft-caps), tanh(y) = 1 - 2 / (exp(2y) + 1) with
    exp_vec: no libm call (a call per lane spilled the attention core's registers around it), saturating to +-1 where
    exp overflows or underflows; absolute error ~1e-7 * cap near 0."""
    scalar = not isinstance(x.type, ir.VectorType)
    v = b.insert_element(ir.Constant(V(f32, 1), [0.0]), x, c32(0)) if scalar else x
    n = v.type.count

    def k(c):
        return const_vec(f32, n, c)

    e = exp_vec(b, b.fmul(v, k(2.0 / cap)))
    y = b.fmul(k(cap), b.fsub(k(1.0), b.fdiv(k(2.0), b.fadd(e, k(1.0)))))
    return b.extract_element(y, c32(0)) if scalar else y


def exp_vec(b: ir.IRBuilder, x, fma: bool = False):
    """exp(x) for a <n x float>, in plain IEEE ops (no libm call). fma: the reduction and the polynomial's
    multiply-adds as FMA (one rounding each; only on an ISA with the instruction, as the attention core's own
    multiply-adds): ~40% fewer vector ops, the core 4-7% faster at 4,064 positions on an AMX Xeon; without it
    separate multiplies and adds, the same bits on every ISA.

    Cody-Waite: x = k ln2 + r, |r| <= ln2/2, k rounded to nearest by the 1.5 * 2^23 trick; exp(r) by Cephes'
    polynomial for expf (max error ~1 ulp on [-ln2/2, ln2/2]); 2^k built in the exponent field. Accurate for
    -87.33 <= x <= 88 (the softmax passes x <= 0); below, and -inf (masked lanes), exactly 0; above 88, +inf
    once 2^k overflows; NaN stays NaN.
    """
    n = x.type.count
    fv, iv = V(f32, n), V(i32, n)

    def k(v):
        return const_vec(f32, n, v)

    xc = b.select(b.fcmp_ordered(">", x, k(88.72283)), k(88.72283), x)
    xc = b.select(b.fcmp_ordered("<", xc, k(-87.33654)), k(-87.33654), xc)
    magic = k(12582912.0)  # 1.5 * 2^23: adding it rounds to an integer in the low mantissa bits
    kf = b.fsub(muladd(b, xc, k(1.44269504088896341), magic, fma), magic)
    # r = xc - kf ln2 in two parts (Cody-Waite); without FMA the same bits as (xc - kf C1) - kf (-C2): negating a
    # constant negates the rounded product exactly
    r = muladd(b, kf, k(2.12194440e-4), muladd(b, kf, k(-0.693359375), xc, fma), fma)
    z = b.fmul(r, r)
    p = k(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = muladd(b, p, r, k(c), fma)
    y = b.fadd(muladd(b, p, z, r, fma), k(1.0))
    scale = b.bitcast(b.shl(b.add(b.fptosi(kf, iv), const_vec(i32, n, 127)), const_vec(i32, n, 23)), fv)
    y = b.fmul(y, scale)
    y = b.select(b.fcmp_ordered("<", x, k(-87.33654)), k(0.0), y)
    y = b.select(b.fcmp_ordered(">", x, k(88.72283)), k(math.inf), y)
    return b.select(b.fcmp_unordered("uno", x, x), x, y)


def hsum(b: ir.IRBuilder, v):
    """The lanes of a <n x float> (n a power of two) summed by a fixed halving tree: (v[:n/2] + v[n/2:]) ..."""
    while v.type.count > 1:
        h = v.type.count // 2
        v = b.fadd(shuffle(b, v, range(h)), shuffle(b, v, range(h, 2 * h)))
    return b.extract_element(v, c32(0))


# -- control flow --------------------------------------------------------------------------------
class Loop:
    """for i in range(start, stop): a counted loop; `with Loop(b, lo, hi) as i:` emits the body."""

    def __init__(self, b: ir.IRBuilder, start, stop, name: str = "i"):
        self.b, self.start, self.stop, self.name = b, start, stop, name

    def __enter__(self):
        b = self.b
        pre = b.block
        self.head = b.append_basic_block(f"{self.name}.head")
        self.body = b.append_basic_block(f"{self.name}.body")
        self.end = b.append_basic_block(f"{self.name}.end")
        b.branch(self.head)
        b.position_at_end(self.head)
        self.i = b.phi(i64, name=self.name)
        self.i.add_incoming(self.start, pre)
        b.cbranch(b.icmp_signed("<", self.i, self.stop), self.body, self.end)
        b.position_at_end(self.body)
        return self.i

    def __exit__(self, *exc):
        if exc[0] is not None:
            return False
        b = self.b
        nxt = b.add(self.i, c64(1), name=f"{self.name}.next")
        self.i.add_incoming(nxt, b.block)
        b.branch(self.head)
        b.position_at_end(self.end)
        return False


def hsum_many(b: ir.IRBuilder, vecs: list):
    """<len(vecs) x float> whose lane i is hsum(vecs[i]), bit for bit (the same halving tree per vector), with
    the vectors' halves interleaved so each tree level is one add over several vectors (all <w x float>, w a
    power of two). Items are (vector, heads k, width h): vector lane j*h + i is lane i of vector j's level."""
    w = vecs[0].type.count
    items = [(v, 1, w) for v in vecs]
    while items[0][2] > 1:
        nxt, i = [], 0
        while i < len(items):
            v, k, h = items[i]
            hh = h // 2
            if i + 1 < len(items) and items[i + 1][1] == k and items[i + 1][2] == h:  # two items -> one of 2k
                u = items[i + 1][0]
                lo = [j * h + t for j in range(2 * k) for t in range(hh)]  # u's lanes follow v's
                hi = [x + hh for x in lo]
                s = b.fadd(b.shuffle_vector(v, u, ir.Constant(V(i32, 2 * k * hh), lo)),
                           b.shuffle_vector(v, u, ir.Constant(V(i32, 2 * k * hh), hi)))
                nxt.append((s, 2 * k, hh))
                i += 2
            else:  # halve alone
                lo = [j * h + t for j in range(k) for t in range(hh)]
                s = b.fadd(shuffle(b, v, lo), shuffle(b, v, [x + hh for x in lo]))
                nxt.append((s, k, hh))
                i += 1
        items = nxt
    if len(items) == 1:
        return items[0][0]
    lanes = [b.extract_element(v, c32(j)) for v, k, _ in items for j in range(k)]
    out = ir.Constant(V(f32, len(lanes)), ir.Undefined)
    for j, x in enumerate(lanes):
        out = b.insert_element(out, x, c32(j))
    return out
