"""The sampler's draw from softmax(x / T) in one native call: what `runtime/sampling.py` does in NumPy (float64
weights exp((x - max) / T), their sums by blocks of BLOCK, the inverse CDF at u * total), without a dozen NumPy
calls of a microsecond each. On a small vocabulary those calls were the draw: 16 us a token for 2,048 logits,
a fifth of the bundled model's token; this takes 3.5 us (benchmarks/sampling.py).

    Draw()(x, temperature, u) -> index              -1: x holds NaN or +inf; -2: every logit is -inf
    Draw().masked(x, temperature, u, words) -> index  the same among the tokens a packed bit mask allows

x: float32 logits [n] (C-contiguous); the Draw keeps float64 scratch for the weights [n] and their sums by block
[ceil(n / BLOCK)]. The index is the first i whose running sum of weights passes u * total, walked in index order
(NumPy's cumulative sums over the same blocks); where rounding leaves u * total at the end, the last index with
weight. The weights are exp((x - max) * (1 / T)): a multiply where NumPy divides (a divide costs as much as all
the rest), so a weight e^y is within 2 (|y| + 2) ulp of NumPy's, a relative 4e-13 at the most.

exp is a polynomial in plain IEEE double operations (no libm call, no FMA): x = k ln2 + r, |r| <= ln2/2, exp(r) by
its Taylor series to r^13 (truncation < 1e-17 relative) in Estrin's scheme, 2^k built in the exponent field; within
2 ulp of NumPy's for the same y (tests/codegen/test_draw.py), the same bits on every ISA, so a seed gives the same
tokens on every host. Weights below exp(-708) (1e-308 of the best token's) are 0: no draw could ever pick them.
Sixteen tokens a step: two independent 8-wide chains keep the vector units busy.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
from llvmlite import ir

from .cgutils import Loop, V, c32, c64, const_vec, hsum, i1, i32, i64, splat
from .library import utility_functions

BLOCK = 256  # tokens a block sum covers (runtime/sampling.py's BLOCK: the same sums)
LANES = 16
f32, f64 = ir.FloatType(), ir.DoubleType()
MAGIC = 6755399441055744.0  # 1.5 * 2^52: adding it rounds a double to an integer in its low mantissa bits
LN2_HI, LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10  # fdlibm's split of ln 2
FLOOR = -708.0  # exp(FLOOR) is still a normal double; below it the weight is 0


def exp64(b: ir.IRBuilder, y):
    """exp(y) for a <n x double> y <= 0 (module docstring); -inf and y < FLOOR give 0."""
    n = y.type.count

    def k(v):
        return const_vec(f64, n, v)

    low = b.fcmp_ordered("<", y, k(FLOOR))
    yc = b.select(low, k(FLOOR), y)
    kf = b.fsub(b.fadd(b.fmul(yc, k(1.0 / math.log(2.0))), k(MAGIC)), k(MAGIC))
    r = b.fsub(b.fsub(yc, b.fmul(kf, k(LN2_HI))), b.fmul(kf, k(LN2_LO)))
    # the series by Estrin's scheme (pairs, then pairs of pairs by r^2, r^4, r^8): a chain of 4 multiply-adds
    # where Horner's is 13 deep, so the loop runs at the units' rate, not their latency
    terms = [b.fadd(k(1.0 / math.factorial(j)), b.fmul(k(1.0 / math.factorial(j + 1)), r)) for j in range(0, 14, 2)]
    power = r
    while len(terms) > 1:
        power = b.fmul(power, power)
        terms = [b.fadd(terms[j], b.fmul(terms[j + 1], power)) if j + 1 < len(terms) else terms[j]
                 for j in range(0, len(terms), 2)]
    p = terms[0]
    bits = b.shl(b.add(b.fptosi(kf, V(i64, n)), const_vec(i64, n, 1023)), const_vec(i64, n, 52))
    e = b.fmul(p, b.bitcast(bits, V(f64, n)))
    return b.select(b.fcmp_unordered("uno", y, y), y, b.select(low, k(0.0), e))


def _weights(b, x, w, top, inv_t, i, lanes, allowed=None):
    """w[i:i+lanes] = exp((x[i:i+lanes] - top) * inv_t), 0 where `allowed` (a <lanes x i1>) is false; returns
    them (a <lanes x double>)."""
    xv = b.load(b.bitcast(b.gep(x, [i]), V(f32, lanes).as_pointer()), align=4)
    y = b.fmul(b.fsub(b.fpext(xv, V(f64, lanes)), splat(b, top, lanes)), splat(b, inv_t, lanes))
    e = exp64(b, y)
    if allowed is not None:
        e = b.select(allowed, e, const_vec(f64, lanes, 0.0))
    b.store(e, b.bitcast(b.gep(w, [i]), V(f64, lanes).as_pointer()), align=8)
    return e


class _Mask:
    """The allowed lanes at index i of a packed bit mask (i32 words, bit i % 32 of word i / 32, llguidance's
    layout); tokens past the mask's words are not allowed."""

    def __init__(self, b, words, n_words):
        self.b, self.words, self.n_words = b, words, n_words

    def lanes(self, i, lanes: int):
        """(<lanes x i1> allowed, i1 whether any of them is) at index i (a multiple of `lanes`)."""
        b = self.b
        wi = b.lshr(i, c64(5))
        inside = b.icmp_signed("<", wi, self.n_words)
        word = b.load(b.gep(self.words, [b.select(inside, wi, c64(0))]))
        word = b.select(inside, word, c32(0))
        bits = b.lshr(word, b.trunc(b.and_(i, c64(31)), i32))  # the lanes' bits at the bottom (i % 8 == 0)
        shifts = ir.Constant(V(i32, lanes), list(range(lanes)))
        one = const_vec(i32, lanes, 1)
        some = b.icmp_unsigned("!=", b.and_(bits, c32((1 << lanes) - 1)), c32(0))
        return b.icmp_unsigned("!=", b.and_(b.lshr(splat(b, bits, lanes), shifts), one),
                               const_vec(i32, lanes, 0)), some


def _build(mod: ir.Module, name: str, masked: bool) -> None:
    """i64 NAME(float* x, i64 n, double temp, double u, double* w, double* blocks[, i32* mask, i64 mask_words,
    i64* stats]): the draw (module docstring); masked: only the tokens whose bit is set, and stats = (allowed
    tokens, whether the row's best token is among them)."""
    args = [f32.as_pointer(), i64, f64, f64, f64.as_pointer(), f64.as_pointer()]
    if masked:
        args += [i32.as_pointer(), i64, i64.as_pointer()]
    fn = ir.Function(mod, ir.FunctionType(i64, args), name)
    x, n, temp, u, w, blocks = fn.args[:6]
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    mask = _Mask(b, fn.args[6], fn.args[7]) if masked else None
    total_p, acc_p, s_p, run_p, j_p, k_p = (b.alloca(t) for t in (f64, V(f64, LANES), f64, f64, i64, i64))
    mx_p, bad_p, m1_p, bad_p1 = b.alloca(V(f32, LANES)), b.alloca(V(i1, LANES)), b.alloca(f32), b.alloca(i1)
    gmx_p, g1_p, cnt_p = b.alloca(V(f32, LANES)), b.alloca(f32), b.alloca(V(i64, LANES))

    def allowed(i, lanes):  # (the lanes allowed, whether any is); (None, None) without a mask
        return mask.lanes(i, lanes) if masked else (None, None)

    def max_step(xv, ok):  # the (allowed) lanes into the running max, NaN flags and count
        m, nan = b.load(mx_p), b.fcmp_unordered("uno", xv, xv)
        up = b.fcmp_ordered(">", xv, m)
        if ok is not None:
            up, nan = b.and_(up, ok), b.and_(nan, ok)
            b.store(b.add(b.load(cnt_p), b.zext(ok, V(i64, LANES))), cnt_p)
        b.store(b.select(up, xv, m), mx_p)
        b.store(b.or_(b.load(bad_p), nan), bad_p)

    # pass 0: the largest (allowed) logit; an allowed NaN or +inf, and the answer is -1 (the caller says why)
    for ptr_, v in ((mx_p, -math.inf), (gmx_p, -math.inf)):
        b.store(const_vec(f32, LANES, v), ptr_)
    b.store(ir.Constant(V(i1, LANES), [0] * LANES), bad_p)
    b.store(const_vec(i64, LANES, 0), cnt_p)
    groups = b.udiv(n, c64(LANES))
    with Loop(b, c64(0), groups, "max") as g:
        i = b.mul(g, c64(LANES))
        xv = b.load(b.bitcast(b.gep(x, [i]), V(f32, LANES).as_pointer()), align=4)
        if not masked:
            max_step(xv, None)
        else:  # the row's best, then the allowed lanes' (skipped where the mask allows none of them)
            gm = b.load(gmx_p)
            b.store(b.select(b.fcmp_ordered(">", xv, gm), xv, gm), gmx_p)
            ok, some = allowed(i, LANES)
            with b.if_then(some):
                max_step(xv, ok)
    b.store(_lanes_max(b, b.load(mx_p)), m1_p)
    b.store(_lanes_max(b, b.load(gmx_p)), g1_p)
    bad = b.load(bad_p)
    anyv = b.extract_element(bad, c32(0))
    for k in range(1, LANES):
        anyv = b.or_(anyv, b.extract_element(bad, c32(k)))
    b.store(anyv, bad_p1)
    cnt1_p = b.alloca(i64)
    cv = b.load(cnt_p)
    total_cnt = b.extract_element(cv, c32(0))
    for k in range(1, LANES):
        total_cnt = b.add(total_cnt, b.extract_element(cv, c32(k)))
    b.store(total_cnt, cnt1_p)
    with Loop(b, b.mul(groups, c64(LANES)), n, "maxt") as i:
        xi = b.load(b.gep(x, [i]))
        m1 = b.load(m1_p)
        up, nan = b.fcmp_ordered(">", xi, m1), b.fcmp_unordered("uno", xi, xi)
        if masked:
            ok = b.extract_element(allowed(i, 1)[0], c32(0))
            up, nan = b.and_(up, ok), b.and_(nan, ok)
            g1 = b.load(g1_p)
            b.store(b.select(b.fcmp_ordered(">", xi, g1), xi, g1), g1_p)
            b.store(b.add(b.load(cnt1_p), b.zext(ok, i64)), cnt1_p)
        b.store(b.select(up, xi, m1), m1_p)
        b.store(b.or_(b.load(bad_p1), nan), bad_p1)
    top32 = b.load(m1_p)
    if masked:
        stats = fn.args[8]
        b.store(b.load(cnt1_p), stats)
        b.store(b.zext(b.fcmp_ordered(">=", top32, b.load(g1_p)), i64), b.gep(stats, [c64(1)]))
    go, refuse, empty, chk = (fn.append_basic_block(s) for s in ("go", "refuse", "empty", "check"))
    b.cbranch(b.or_(b.load(bad_p1), b.fcmp_ordered("==", top32, ir.Constant(f32, math.inf))), refuse, chk)
    b.position_at_end(chk)  # -inf: no (allowed) token has weight
    b.cbranch(b.fcmp_ordered("==", top32, ir.Constant(f32, -math.inf)), empty, go)
    b.position_at_end(refuse)
    b.ret(c64(-1))
    b.position_at_end(empty)  # -inf: no (allowed) token has weight
    b.ret(c64(-2))
    b.position_at_end(go)
    top = b.fpext(top32, f64)
    inv_t = b.fdiv(ir.Constant(f64, 1.0), temp)  # a multiply per weight: a divide cost as much as the rest
    nb = b.udiv(b.add(n, c64(BLOCK - 1)), c64(BLOCK))
    b.store(ir.Constant(f64, 0.0), total_p)

    # pass 1: the weights and their sums by block (the lanes summed by a fixed tree, then the block's tail in order)
    with Loop(b, c64(0), nb, "blk") as j:
        lo = b.mul(j, c64(BLOCK))
        hi = _min(b, b.add(lo, c64(BLOCK)), n)
        groups = b.udiv(b.sub(hi, lo), c64(LANES))
        b.store(const_vec(f64, LANES, 0.0), acc_p)
        with Loop(b, c64(0), groups, "vec") as g:
            i = b.add(lo, b.mul(g, c64(LANES)))
            if not masked:
                b.store(b.fadd(b.load(acc_p), _weights(b, x, w, top, inv_t, i, LANES)), acc_p)
            else:  # lanes the mask leaves out weigh 0: no exp where it allows none of them
                ok, some = allowed(i, LANES)
                with b.if_else(some) as (any_allowed, none):
                    with any_allowed:
                        b.store(b.fadd(b.load(acc_p), _weights(b, x, w, top, inv_t, i, LANES, ok)), acc_p)
                    with none:
                        b.store(const_vec(f64, LANES, 0.0), b.bitcast(b.gep(w, [i]), V(f64, LANES).as_pointer()),
                                align=8)
        b.store(hsum(b, b.load(acc_p)), s_p)
        with Loop(b, b.add(lo, b.mul(groups, c64(LANES))), hi, "tail") as i:
            e1 = _weights(b, x, w, top, inv_t, i, 1, allowed(i, 1)[0])
            b.store(b.fadd(b.load(s_p), b.extract_element(e1, c32(0))), s_p)
        s = b.load(s_p)
        b.store(s, b.gep(blocks, [j]))
        b.store(b.fadd(b.load(total_p), s), total_p)
    _walk(b, fn, n, nb, u, w, blocks, total_p, run_p, j_p, k_p)


def _walk(b, fn, n, nb, u, w, blocks, total_p, run_p, j_p, k_p) -> None:
    """pass 2: the block where the running sum passes t = u * total (the last block is walked whatever its sum
    says), then token by token from its start; where rounding left t at the end, the last index with weight."""
    t = b.fmul(u, b.load(total_p))
    b.store(ir.Constant(f64, 0.0), run_p)
    b.store(c64(0), j_p)
    head, body, walk = (fn.append_basic_block(name) for name in ("find.head", "find.body", "walk"))
    b.branch(head)
    b.position_at_end(head)
    j = b.load(j_p)
    nxt = b.fadd(b.load(run_p), b.load(b.gep(blocks, [j])))
    b.cbranch(b.and_(b.icmp_signed("<", b.add(j, c64(1)), nb), b.fcmp_ordered("<=", nxt, t)), body, walk)
    b.position_at_end(body)
    b.store(nxt, run_p)
    b.store(b.add(j, c64(1)), j_p)
    b.branch(head)
    b.position_at_end(walk)
    with Loop(b, b.mul(b.load(j_p), c64(BLOCK)), n, "walk") as i:
        r = b.fadd(b.load(run_p), b.load(b.gep(w, [i])))
        b.store(r, run_p)
        ret, cont = fn.append_basic_block("ret"), fn.append_basic_block("walk.cont")
        b.cbranch(b.fcmp_ordered(">", r, t), ret, cont)
        b.position_at_end(ret)
        b.ret(i)
        b.position_at_end(cont)
    b.store(b.sub(n, c64(1)), k_p)
    head, body, done = (fn.append_basic_block(name) for name in ("last.head", "last.body", "last.done"))
    b.branch(head)
    b.position_at_end(head)
    k = b.load(k_p)
    zero = b.fcmp_ordered("==", b.load(b.gep(w, [k])), ir.Constant(f64, 0.0))
    b.cbranch(b.and_(b.icmp_signed(">", k, c64(0)), zero), body, done)
    b.position_at_end(body)
    b.store(b.sub(k, c64(1)), k_p)
    b.branch(head)
    b.position_at_end(done)
    b.ret(b.load(k_p))


def _lanes_max(b, m):
    """The largest lane of a <LANES x float> by halving."""
    h = LANES
    while h > 1:
        h //= 2
        hi = b.shuffle_vector(m, m, ir.Constant(V(i32, LANES), [i + h if i < h else i for i in range(LANES)]))
        m = b.select(b.fcmp_ordered(">", hi, m), hi, m)
    return b.extract_element(m, c32(0))


def kernel_module() -> ir.Module:
    """draw (every token) and draw_masked (the tokens a packed bit mask allows)."""
    mod = ir.Module(name="draw")
    _build(mod, "draw", masked=False)
    _build(mod, "draw_masked", masked=True)
    return mod


def _min(b, a, c):
    return b.select(b.icmp_signed("<", a, c), a, c)


def _fns():
    """The compiled kernels (once per process)."""
    sig = (ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_double, ctypes.c_void_p,
           ctypes.c_void_p)
    return utility_functions("draw", kernel_module, {
        "draw": sig, "draw_masked": sig + (ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)})


class Draw:
    """The draw of one sampler: its scratch (the weights, the block sums) kept between calls, and the address of
    the last row it read (a model hands over the same logits buffer every step; the row is kept referenced, so
    that its address cannot belong to another array). Not shared between threads (nor is a Sampler)."""

    def __init__(self):
        fns = _fns()
        self.fn, self.fn_masked = fns["draw"], fns["draw_masked"]
        self.n, self.row, self.at = 0, None, 0
        self.stats = np.zeros(2, np.int64)
        self.stats_at = self.stats.ctypes.data

    def _row(self, x) -> None:
        if x is not self.row:
            self.row, self.at = x, x.ctypes.data
        if x.size != self.n:
            self.n, self.w, self.blocks = x.size, np.empty(x.size), np.empty(-(-x.size // BLOCK))
            self.w_at, self.blocks_at = self.w.ctypes.data, self.blocks.ctypes.data

    def __call__(self, x, temperature: float, u: float) -> int:
        """The index uniform u selects from softmax(x / temperature); -1 if x holds NaN or +inf, -2 if every
        logit is -inf. x: float32, C-contiguous, one dimension, not empty (the caller checks)."""
        self._row(x)
        return self.fn(self.at, self.n, temperature, u, self.w_at, self.blocks_at)

    def masked(self, x, temperature: float, u: float, words) -> int:
        """The same draw among the tokens whose bit is set in `words` (int32, C-contiguous; tokens past them are
        out): -1 if an allowed logit is NaN or +inf, -2 if no allowed token has weight. Afterwards `stats` holds
        (the allowed tokens, 1 if the row's best logit is among them)."""
        if words.size == 0:
            self.stats[:] = 0
            return -2
        self._row(x)
        return self.fn_masked(self.at, self.n, temperature, u, self.w_at, self.blocks_at, words.ctypes.data,
                              words.size, self.stats_at)
