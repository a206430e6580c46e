"""NumPy's PCG64 raw words, masked, from a JIT loop that runs LANES steps at once: synthetic Q4 codes at a few
times NumPy's speed, bit for bit the same words.

    raw_masked(bit_generator, n, mask) == bit_generator.random_raw(n) & mask   (and the same state afterwards)

Why: `BitGenerator.random_raw` calls the PCG64 step through a function pointer, one 128-bit multiply-add after
the other: each step waits on the last (~1.7 ns a word here), and drawing the codes of the synthetic writer's
Q4 blocks (models/synthetic.py, 32 bytes of raw words per 18-byte block) was a third of its CPU time. The state
sequence s(k+1) = a s(k) + c (mod 2^128) can be split into LANES interleaved sequences, each stepping by the
LANES-step map s(k+LANES) = A s(k) + C: their multiplies are independent, so the CPU overlaps them. The output
function (XSL-RR: rotr64(hi ^ lo, hi >> 58) of the new state) and the mask run in the same loop, so the codes are
written once. Exact integer arithmetic: the words are NumPy's (tests/codegen/test_writer_kernels.py).
"""

from __future__ import annotations

import ctypes

import numpy as np
from llvmlite import ir

from .library import utility_functions

LANES = 4  # interleaved PCG64 sequences: n must be a multiple (the synthetic codes draw 4 words per block)
MULT = (2549297995355413924 << 64) + 4865540595714422341  # PCG64's 128-bit LCG multiplier (NumPy's pcg64.h)
_M128 = (1 << 128) - 1


def advance(a: int, c: int, n: int) -> tuple[int, int]:
    """(A, C) of n steps of s -> a s + c (mod 2^128): s(k + n) = A s(k) + C (square-and-multiply)."""
    acc_a, acc_c = 1, 0
    while n:
        if n & 1:
            acc_a, acc_c = (acc_a * a) & _M128, (acc_c * a + c) & _M128
        c, a = ((a + 1) * c) & _M128, (a * a) & _M128
        n >>= 1
    return acc_a, acc_c


def _lcg_function(mod: ir.Module, name: str, out_ty, emit) -> None:
    """void name(i64* states, out_ty* out, i64 iters, i64 mask): states = LANES states (lo, hi), then the LANES-step
    map's A (lo, hi) and C (lo, hi). Iteration i hands word LANES i + j (xsl_rr of state j) to
    emit(b, word, mask, out, index) and steps every lane by (A, C); the lanes' states are stored back."""
    i64, i128 = ir.IntType(64), ir.IntType(128)
    fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [i64.as_pointer(), out_ty.as_pointer(), i64, i64]), name)
    states, out, iters, mask = fn.args
    fshr = mod.globals.get("llvm.fshr.i64") or ir.Function(mod, ir.FunctionType(i64, [i64, i64, i64]),
                                                          "llvm.fshr.i64")
    entry, head, body, done = (fn.append_basic_block(s) for s in ("entry", "head", "body", "done"))
    b = ir.IRBuilder(entry)

    def load128(k: int):
        lo, hi = (b.zext(b.load(b.gep(states, [ir.Constant(i64, 2 * k + h)])), i128) for h in (0, 1))
        return b.or_(lo, b.shl(hi, ir.Constant(i128, 64)))

    lanes0 = [load128(k) for k in range(LANES)]
    mul, add = load128(LANES), load128(LANES + 1)
    b.branch(head)
    b.position_at_end(head)
    i = b.phi(i64)
    i.add_incoming(ir.Constant(i64, 0), entry)
    lanes = [b.phi(i128) for _ in range(LANES)]
    for ph, s in zip(lanes, lanes0):
        ph.add_incoming(s, entry)
    b.cbranch(b.icmp_signed("<", i, iters), body, done)
    b.position_at_end(body)
    base = b.mul(i, ir.Constant(i64, LANES))
    nxt = []
    for j, s in enumerate(lanes):
        hi = b.trunc(b.lshr(s, ir.Constant(i128, 64)), i64)
        x = b.xor(hi, b.trunc(s, i64))
        emit(b, b.call(fshr, [x, x, b.lshr(hi, ir.Constant(i64, 58))]), mask, out, b.add(base, ir.Constant(i64, j)))
        nxt.append(b.add(b.mul(s, mul), add))
    i.add_incoming(b.add(i, ir.Constant(i64, 1)), body)
    for ph, s in zip(lanes, nxt):
        ph.add_incoming(s, body)
    b.branch(head)
    b.position_at_end(done)
    for k, s in enumerate(lanes):
        for h in (0, 1):
            part = b.trunc(b.lshr(s, ir.Constant(i128, 64 * h)), i64)
            b.store(part, b.gep(states, [ir.Constant(i64, 2 * k + h)]))
    b.ret_void()


def kernel_module() -> ir.Module:
    """pcg64_masked: out[k] = word k & mask (i64 out). pcg64_f32: NumPy's float32 draws, two a word (its low
    half first, as Generator.random's buffered next_uint32): (half >> 8) * 2^-24 (float out; mask unused)."""
    i64, i32, f32 = ir.IntType(64), ir.IntType(32), ir.FloatType()
    mod = ir.Module(name="pcg64")

    def masked(b, word, mask, out, k) -> None:
        b.store(b.and_(word, mask), b.gep(out, [k]))

    def floats(b, word, mask, out, k) -> None:
        for h in (0, 1):
            half = b.trunc(b.lshr(word, ir.Constant(i64, 32 * h)), i32)
            v = b.fmul(b.uitofp(b.lshr(half, ir.Constant(i32, 8)), f32), ir.Constant(f32, 2.0**-24))
            b.store(v, b.gep(out, [b.add(b.mul(k, ir.Constant(i64, 2)), ir.Constant(i64, h))]))

    _lcg_function(mod, "pcg64_masked", i64, masked)
    _lcg_function(mod, "pcg64_f32", f32, floats)
    return mod


def _fns() -> dict:
    """The compiled kernels by name (once per process)."""
    args = (None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64)
    return utility_functions("pcg64", kernel_module, {"pcg64_masked": args, "pcg64_f32": args})


def _draw(bit_generator, n: int, kernel: str, out: np.ndarray, mask: int = 0) -> np.ndarray:
    """Run `kernel` for the first n - n % LANES of the next n words (into `out`, its values per word), advance the
    generator past them and return the other n % LANES words from random_raw (the caller converts them)."""
    st = bit_generator.state
    if st.get("bit_generator") != "PCG64":
        raise TypeError(f"the PCG64 loops run PCG64, not {st.get('bit_generator')}")
    s, inc = st["state"]["state"], st["state"]["inc"]
    whole = n - n % LANES
    states = np.empty(2 * LANES + 4, np.uint64)
    values = [(s * MULT + inc) & _M128]  # lane j starts at the state of word j
    for _ in range(LANES - 1):
        values.append((values[-1] * MULT + inc) & _M128)
    values += advance(MULT, inc, LANES)
    for k, v in enumerate(values):
        states[2 * k], states[2 * k + 1] = v & (2**64 - 1), v >> 64
    if whole:
        _fns()[kernel](states.ctypes.data, out.ctypes.data, whole // LANES, mask)  # ctypes releases the GIL
    a, c = advance(MULT, inc, whole)
    st["state"]["state"] = (a * s + c) & _M128
    bit_generator.state = st
    return bit_generator.random_raw(n - whole)


def raw_masked(bit_generator, n: int, mask: int = (1 << 64) - 1) -> np.ndarray:
    """uint64[n]: `bit_generator.random_raw(n) & mask`, for a PCG64 generator, whose state then advances by n
    words as random_raw's would (its buffered 32-bit half, which random_raw ignores, is kept)."""
    out = np.empty(n, np.uint64)
    tail = _draw(bit_generator, n, "pcg64_masked", out, mask)
    out[n - tail.size :] = tail & np.uint64(mask)
    return out


def uniform_f32(bit_generator, n: int) -> np.ndarray:
    """float32[n]: `np.random.Generator(bit_generator).random(n, dtype=np.float32)` for a PCG64 generator, and its
    state afterwards. Each float is (32-bit half >> 8) * 2^-24, two a word, its low half first; a half kept from
    an earlier draw (has_uint32) goes first, and the last word's high half is kept when n leaves one over."""
    st = bit_generator.state
    out = np.empty(n, np.float32)
    first = int(bool(st["has_uint32"])) if n else 0
    if first:
        out[0] = np.float32((st["uinteger"] >> 8) * 2.0**-24)
    m = n - first
    words = (m + 1) // 2
    if not words:
        if first:
            st["has_uint32"] = 0
            bit_generator.state = st
        return out
    # the loop converts whole words; the last one comes from random_raw, its high half being the one kept
    tail = np.concatenate([_draw(bit_generator, words - 1, "pcg64_f32", out[first:]),
                           bit_generator.random_raw(1)])
    halves = tail.view(np.uint32)[: m - 2 * (words - tail.size)]
    out[n - halves.size :] = (halves >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)
    st = bit_generator.state
    st["has_uint32"], st["uinteger"] = m % 2, int(tail[-1] >> np.uint64(32))
    bit_generator.state = st
    return out
