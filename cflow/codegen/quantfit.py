"""The weighted quantisers' trial searches as JIT loops: layout/quantize_blocks.py's fit_symmetric, fit_affine and
fit_codebook, bit for bit, sixteen blocks at a time.

    symmetric(x, w, nmax, ntry)          -> (d, l)      x ~ d * l, l in [-nmax, nmax - 1]
    affine(x, w, nmax, rmin, rdelta, nstep) -> (d, m, l) x ~ d * l + m, l in [0, nmax]
    codebook(x, w, ntry)                 -> d           x ~ d * v[l], v the IQ4 code book

x, w: float32 [N, n] blocks (n = 16 or 32) and their element weights, as the NumPy fitters take them.

Why: NumPy runs each trial scale as a dozen passes over every block (round, clip, three products, three sums, the
refit), 19 to 38 trials a block: a 4-bit K-quant cost about 0.6 us a weight, so `cflowc --quant auto`, which fits
every matrix at every type on a sample and then the whole matrix at its chosen type, took 20 minutes on a 1.5B
model. Here a trial is one pass over the block in registers.

Bit for bit: every operation is the NumPy fitter's, in float32, in its order (no FMA: LLVM fuses nothing without
the `contract` flag). The sums follow NumPy's reduction along a row of n elements: eight accumulators over every
eighth element, combined ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)), then added to the reduction's 0.0 (so
a sum of -0.0 is +0.0). Blocks are independent lanes, so the bits are the same on every ISA path
(tests/codegen/test_quantfit.py compares with the NumPy fitters on each).

The blocks reach the kernels as groups of LANES, element-major ([G, n, LANES]: element e of 16 blocks is one
vector load); the wrapper pads N and transposes in and out. layout/ imports nothing from the rest of cflow, so this
module plugs itself in when imported (quantize_blocks.NATIVE_FITTERS); without it the NumPy fitters run.
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np
from llvmlite import ir

from ..layout import quantize_blocks as QB
from ..passes import gptq as GPTQ
from .cgutils import Loop, V, c64, const_vec, f32, i64, intrinsic, splat
from .library import utility_functions

LANES = 16
SIZES = (16, 32)  # the block widths the fitters see: Q2_K/Q3_K/Q6_K sub-blocks of 16, every other block 32
VF = V(f32, LANES)


class _Emit:
    """IR helpers over <n x float> (n = LANES) or float (n = 1) values for one kernel."""

    def __init__(self, b: ir.IRBuilder, n: int = LANES):
        self.b, self.n = b, n
        self.ty = V(f32, n) if n > 1 else f32

    def k(self, v: float):
        v = float(np.float32(v))
        return const_vec(f32, self.n, v) if self.n > 1 else ir.Constant(f32, v)

    def lanes(self, s):
        """A scalar (float or i1) on every lane."""
        return splat(self.b, s, self.n) if self.n > 1 else s

    def load(self, base, off):
        return self.b.load(self.b.bitcast(self.b.gep(base, [off]), self.ty.as_pointer()), align=4)

    def store(self, v, base, off):
        self.b.store(v, self.b.bitcast(self.b.gep(base, [off]), self.ty.as_pointer()), align=4)

    def splat(self, p, i):
        """float p[i] on every lane."""
        return self.lanes(self.b.load(self.b.gep(p, [i])))

    def call(self, name, *args):
        nm = f"llvm.{name}.v{self.n}f32" if self.n > 1 else f"llvm.{name}.f32"
        return self.b.call(intrinsic(self.b.module, nm, self.ty, [self.ty] * len(args)), list(args))

    def iq4(self, v):
        """quantize_blocks.iq4_index of v and the code-book value there: each doubled midpoint below ceil(2v)
        moves one value up (as a float index, the value)."""
        b = self.b
        k2 = self.call("ceil", b.fadd(v, v))
        idx, val = self.k(0.0), self.k(QB._IQ4[0])
        for i, m2 in enumerate(QB._IQ4_M2.astype(np.float32)):
            up = b.fcmp_ordered(">", k2, self.k(m2))
            idx, val = b.select(up, self.k(i + 1), idx), b.select(up, self.k(QB._IQ4[i + 1]), val)
        return idx, val

    def rint(self, v):  # np.rint: to nearest, ties to even
        return self.call("rint", v)

    def clip(self, v, lo, hi):  # np.clip on floats: below lo -> lo, above hi -> hi (a -0.0 at lo 0 stays -0.0)
        b = self.b
        v = b.select(b.fcmp_ordered("<", v, lo), lo, v)
        return b.select(b.fcmp_ordered(">", v, hi), hi, v)

    def where(self, c, a, z):
        return self.b.select(c, a, z)

    def safe_div(self, a, d):  # quantize_blocks._safe_div: a / d, 0 where d == 0 (NaN != 0, as NumPy's where)
        b = self.b
        return b.select(b.fcmp_unordered("!=", d, self.k(0.0)), b.fdiv(a, d), self.k(0.0))

    def total(self, vals):
        """NumPy's float32 sum along a contiguous row of len(vals) (module docstring)."""
        b = self.b
        n = len(vals)
        assert n >= 8 and n % 8 == 0
        r = list(vals[:8])
        for i in range(8, n, 8):
            r = [b.fadd(r[j], vals[i + j]) for j in range(8)]
        s = b.fadd(b.fadd(b.fadd(r[0], r[1]), b.fadd(r[2], r[3])), b.fadd(b.fadd(r[4], r[5]), b.fadd(r[6], r[7])))
        return b.fadd(self.k(0.0), s)

    def peak(self, x):
        """quantize_blocks._peak: each lane's value of largest magnitude (the first such), 1 where it is below
        EPS, and whether it is above."""
        b = self.b
        mx, ma = x[0], self.call("fabs", x[0])
        for v in x[1:]:
            a = self.call("fabs", v)
            up = b.fcmp_ordered(">", a, ma)
            mx, ma = b.select(up, v, mx), b.select(up, a, ma)
        live = b.fcmp_ordered(">=", self.call("fabs", mx), self.k(QB.EPS))
        return b.select(live, mx, self.k(1.0)), live


def _function(mod: ir.Module, name: str, n_out: int, scalar: bool) -> ir.Function:
    """void NAME(float* x, float* w, i64 groups, float* c, i64 nc[, float nmax], float* out * n_out)."""
    fp = f32.as_pointer()
    args = [fp, fp, i64, fp, i64] + ([f32] if scalar else []) + [fp] * n_out
    return ir.Function(mod, ir.FunctionType(ir.VoidType(), args), name)


def _blocks(e: _Emit, x_p, w_p, base, n: int):
    """The group's x and w vectors [n] (element j of its LANES blocks each) and their products w x."""
    x = [e.load(x_p, e.b.add(base, c64(j * LANES))) for j in range(n)]
    w = [e.load(w_p, e.b.add(base, c64(j * LANES))) for j in range(n)]
    return x, w, [e.b.fmul(w[j], x[j]) for j in range(n)]


def _build_symmetric(mod: ir.Module, n: int) -> None:
    """void symN(x, w, groups, c, nc, float nmax, float* d, float* l): fit_symmetric with trial inverse scales
    c[t] / mx (c[0] = -nmax: the trial always taken first)."""
    fn = _function(mod, f"sym{n}", 2, scalar=True)
    x_p, w_p, groups, c_p, nc, nmax_s, d_p, l_p = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    e = _Emit(b)
    best_p, d_s, inv_s = (b.alloca(VF) for _ in range(3))
    with Loop(b, c64(0), groups, "g") as g:
        base = b.mul(g, c64(n * LANES))
        x, w, wx = _blocks(e, x_p, w_p, base, n)
        hi = b.fsub(e.lanes(nmax_s), e.k(1.0))  # codes in [-nmax, nmax - 1]
        lo = b.fneg(e.lanes(nmax_s))
        mx, live = e.peak(x)
        for p, v in ((best_p, -np.inf), (d_s, 0.0), (inv_s, 0.0)):
            b.store(e.k(v), p)
        with Loop(b, c64(0), nc, "t") as t:
            iscale = b.fdiv(e.splat(c_p, t), mx)
            ls = [e.clip(e.rint(b.fmul(iscale, x[j])), lo, hi) for j in range(n)]
            sumlx = e.total([b.fmul(wx[j], ls[j]) for j in range(n)])
            suml2 = e.total([b.fmul(b.fmul(w[j], ls[j]), ls[j]) for j in range(n)])
            scale = e.safe_div(sumlx, suml2)
            score = b.fmul(scale, sumlx)
            best = b.load(best_p)
            take = b.and_(b.fcmp_ordered(">", suml2, e.k(0.0)), b.fcmp_ordered(">", score, best))
            take = b.or_(take, e.lanes(b.icmp_signed("==", t, c64(0))))
            b.store(e.where(take, score, best), best_p)
            b.store(e.where(take, scale, b.load(d_s)), d_s)
            b.store(e.where(take, iscale, b.load(inv_s)), inv_s)
        inv = b.load(inv_s)
        for j in range(n):  # the codes of the winning trial
            lj = e.clip(e.rint(b.fmul(inv, x[j])), lo, hi)
            e.store(e.where(live, lj, e.k(0.0)), l_p, b.add(base, c64(j * LANES)))
        e.store(e.where(live, b.load(d_s), e.k(0.0)), d_p, b.mul(g, c64(LANES)))
    b.ret_void()


def _build_affine(mod: ir.Module, n: int) -> None:
    """void affN(x, w, groups, c, nc, float nmax, float* d, float* m, float* l): fit_affine with trial inverse
    scales c[t] / span (c[t] = rmin + rdelta t + nmax)."""
    fn = _function(mod, f"aff{n}", 3, scalar=True)
    x_p, w_p, groups, c_p, nc, nmax_s, d_p, m_p, l_p = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    e = _Emit(b)
    zero = e.k(0.0)
    best_p, inv_s, d_s, m_s = (b.alloca(VF) for _ in range(4))
    with Loop(b, c64(0), groups, "g") as g:
        base = b.mul(g, c64(n * LANES))
        x, w, wx = _blocks(e, x_p, w_p, base, n)
        nmax = e.lanes(nmax_s)
        mn, hi = x[0], x[0]
        for v in x[1:]:  # the block's min and max (which zero a tie keeps does not matter below)
            mn = b.select(b.fcmp_ordered("<", v, mn), v, mn)
            hi = b.select(b.fcmp_ordered(">", v, hi), v, hi)
        lo = b.select(b.fcmp_ordered("<", mn, zero), mn, zero)  # np.minimum(min, 0): +0.0 unless below
        live = b.fcmp_ordered(">", hi, lo)
        span = b.select(live, b.fsub(hi, lo), e.k(1.0))
        sw, sx, sx2 = e.total(w), e.total(wx), e.total([b.fmul(wx[j], x[j]) for j in range(n)])
        xm = [b.fsub(x[j], lo) for j in range(n)]

        def err_of(d, m, sl, sl2, sxl):  # fit_affine's sum w (d l + m - x)^2, in its order
            two = e.k(2.0)
            r = b.fadd(sx2, b.fmul(b.fmul(d, d), sl2))
            r = b.fadd(r, b.fmul(b.fmul(m, m), sw))
            r = b.fsub(r, b.fmul(b.fmul(two, d), sxl))
            r = b.fsub(r, b.fmul(b.fmul(two, m), sx))
            return b.fadd(r, b.fmul(b.fmul(b.fmul(two, d), m), sl))

        def sums(inv):
            ls = [e.clip(e.rint(b.fmul(inv, xm[j])), zero, nmax) for j in range(n)]
            wl = [b.fmul(w[j], ls[j]) for j in range(n)]
            return (e.total(wl), e.total([b.fmul(wl[j], ls[j]) for j in range(n)]),
                    e.total([b.fmul(wx[j], ls[j]) for j in range(n)]))

        iscale = b.fdiv(nmax, span)
        d0 = b.fdiv(e.k(1.0), iscale)
        for p, v in ((best_p, err_of(d0, lo, *sums(iscale))), (inv_s, iscale), (d_s, d0), (m_s, lo)):
            b.store(v, p)
        with Loop(b, c64(0), nc, "t") as t:
            inv = b.fdiv(e.splat(c_p, t), span)
            sl, sl2, sxl = sums(inv)
            D = b.fsub(b.fmul(sw, sl2), b.fmul(sl, sl))
            dd = e.safe_div(b.fsub(b.fmul(sw, sxl), b.fmul(sx, sl)), D)
            mm = e.safe_div(b.fsub(b.fmul(sl2, sx), b.fmul(sl, sxl)), D)
            pos = b.fcmp_ordered(">", mm, zero)  # a positive minimum: the codes start at 0, refit the scale alone
            dd, mm = e.where(pos, e.safe_div(sxl, sl2), dd), e.where(pos, zero, mm)
            err = err_of(dd, mm, sl, sl2, sxl)
            best = b.load(best_p)
            take = b.and_(b.fcmp_ordered(">", D, zero), b.fcmp_ordered("<", err, best))
            b.store(e.where(take, err, best), best_p)
            b.store(e.where(take, inv, b.load(inv_s)), inv_s)
            b.store(e.where(take, dd, b.load(d_s)), d_s)
            b.store(e.where(take, mm, b.load(m_s)), m_s)
        inv = b.load(inv_s)
        for j in range(n):  # the codes of the winning trial
            lj = e.clip(e.rint(b.fmul(inv, xm[j])), zero, nmax)
            e.store(e.where(live, lj, zero), l_p, b.add(base, c64(j * LANES)))
        at = b.mul(g, c64(LANES))
        e.store(e.where(live, b.load(d_s), zero), d_p, at)
        e.store(e.where(live, b.load(m_s), lo), m_p, at)
    b.ret_void()


def _build_codebook(mod: ir.Module, n: int) -> None:
    """void cbN(x, w, groups, c, nc, float* d): fit_codebook with trial inverse scales c[t] / mx (c[0] = -v[0],
    the trial taken wherever it fits at all)."""
    fn = _function(mod, f"cb{n}", 1, scalar=False)
    x_p, w_p, groups, c_p, nc, d_p = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    e = _Emit(b)
    zero = e.k(0.0)
    best_p, d_s = b.alloca(VF), b.alloca(VF)

    with Loop(b, c64(0), groups, "g") as g:
        x, w, wx = _blocks(e, x_p, w_p, b.mul(g, c64(n * LANES)), n)
        mx, live = e.peak(x)
        b.store(e.k(-np.inf), best_p)
        b.store(zero, d_s)
        with Loop(b, c64(0), nc, "t") as t:
            inv = b.fdiv(e.splat(c_p, t), mx)
            q = [e.iq4(b.fmul(inv, x[j]))[1] for j in range(n)]
            sqx = e.total([b.fmul(wx[j], q[j]) for j in range(n)])
            sq2 = e.total([b.fmul(b.fmul(w[j], q[j]), q[j]) for j in range(n)])
            scale = e.safe_div(sqx, sq2)
            score = b.fmul(scale, sqx)
            best = b.load(best_p)
            better = b.or_(b.fcmp_ordered(">", score, best), e.lanes(b.icmp_signed("==", t, c64(0))))
            take = b.and_(b.fcmp_ordered(">", sq2, zero), better)
            b.store(e.where(take, score, best), best_p)
            b.store(e.where(take, scale, b.load(d_s)), d_s)
        e.store(e.where(live, b.load(d_s), zero), d_p, b.mul(g, c64(LANES)))
    b.ret_void()


def _build_codes(mod: ir.Module) -> None:
    """void gptq_codes(float* w, float* S, float* M, float* inv, float* u, i64 rows, i64 qk, float lo, float hi,
    float bias, i64 book, float* codes, float* err): gptq._by_input over one block, inputs-major ([qk, rows] each:
    input k of every row contiguous; M null for the types without a min; u the block's [qk, qk] of U). Input k's
    code is the nearest on its row's grid to its corrected weight, its scaled error (x - q) / u[k, k] is stored and
    taken off the block's later inputs (w[k2] -= e u[k, k2]), LANES rows a step, then the rows left one by one."""
    fp = f32.as_pointer()
    fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [fp] * 5 + [i64, i64, f32, f32, f32, i64, fp, fp]),
                     "gptq_codes")
    w_p, s_p, m_p, inv_p, u_p, rows, qk, lo_s, hi_s, bias_s, book, c_p, e_p = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    has_m = b.icmp_unsigned("!=", b.ptrtoint(m_p, i64), c64(0))
    has_book = b.icmp_signed("!=", book, c64(0))

    def step(k, r, n):
        """Input k of rows r .. r + n (n = LANES or 1)."""
        e = _Emit(b, n)
        ld, st, sp = e.load, e.store, e.lanes

        at = b.add(b.mul(k, rows), r)
        x = ld(w_p, at)
        x = b.select(has_m, b.fsub(x, ld(b.select(has_m, m_p, w_p), at)), x)
        S = ld(s_p, at)
        v = b.fmul(x, ld(inv_p, at))
        # the integer grid: clip(rint(v) + bias, lo, hi), q = S (c - bias)
        c = b.fadd(e.call("rint", v), sp(bias_s))
        c = b.select(b.fcmp_ordered("<", c, sp(lo_s)), sp(lo_s), c)
        c = b.select(b.fcmp_ordered(">", c, sp(hi_s)), sp(hi_s), c)
        q = b.fmul(S, b.fsub(c, sp(bias_s)))
        idx, val = e.iq4(v)  # the IQ4 code book: the nearest value's index and q = S book[index]
        c = b.select(has_book, idx, c)
        q = b.select(has_book, b.fmul(S, val), q)
        st(c, c_p, at)
        ukk = b.load(b.gep(u_p, [b.add(b.mul(k, qk), k)]))
        err = b.fdiv(b.fsub(x, q), sp(ukk))
        st(err, e_p, at)
        with Loop(b, b.add(k, c64(1)), qk, "k2") as k2i:  # the block's later inputs
            a2 = b.add(b.mul(k2i, rows), r)
            ukj = b.load(b.gep(u_p, [b.add(b.mul(k, qk), k2i)]))
            st(b.fsub(ld(w_p, a2), b.fmul(err, sp(ukj))), w_p, a2)

    with Loop(b, c64(0), qk, "k") as k:
        full = b.mul(b.udiv(rows, c64(LANES)), c64(LANES))
        with Loop(b, c64(0), b.udiv(rows, c64(LANES)), "g") as g:
            step(k, b.mul(g, c64(LANES)), LANES)
        with Loop(b, full, rows, "r") as r:
            step(k, r, 1)
    b.ret_void()


def kernel_module() -> ir.Module:
    """sym, aff and cb for each block width in SIZES."""
    mod = ir.Module(name="quantfit")
    for n in SIZES:
        _build_symmetric(mod, n)
        _build_affine(mod, n)
        _build_codebook(mod, n)
    _build_codes(mod)
    return mod


def _fns():
    p, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    sigs = {}
    for n in SIZES:
        sigs[f"sym{n}"] = (None, p, p, i, p, i, f, p, p)
        sigs[f"aff{n}"] = (None, p, p, i, p, i, f, p, p, p)
        sigs[f"cb{n}"] = (None, p, p, i, p, i, p)
    sigs["gptq_codes"] = (None, p, p, p, p, p, i, i, f, f, f, i, p, p)
    return utility_functions("quantfit", kernel_module, sigs)


def _lanes_in(x: np.ndarray, w: np.ndarray):
    """[N, n] float32 blocks -> ([G, n, LANES] x, w, G), N padded to G * LANES with zero blocks."""
    N, n = x.shape
    if n not in SIZES:
        raise ValueError(f"native fitters take blocks of {SIZES} inputs, not {n}")
    G = -(-N // LANES)
    out = []
    for a in (x, w):
        t = np.zeros((G * LANES, n), np.float32)
        t[:N] = a
        out.append(np.ascontiguousarray(t.reshape(G, LANES, n).transpose(0, 2, 1)))
    return out[0], out[1], G


def _lanes_out(l: np.ndarray, N: int) -> np.ndarray:
    """[G, n, LANES] -> [N, n]."""
    G, n, _ = l.shape
    return np.ascontiguousarray(l.transpose(0, 2, 1).reshape(G * LANES, n)[:N])


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def symmetric(x: np.ndarray, w: np.ndarray, nmax: int, ntry: int = 9) -> tuple[np.ndarray, np.ndarray]:
    """fit_symmetric(x, w, nmax, ntry), bit for bit."""
    N = x.shape[0]
    xt, wt, G = _lanes_in(x, w)
    c = np.array([-(nmax + 0.1 * k) for k in [0] + [i for i in range(-ntry, ntry + 1) if i]], np.float32)
    d, lt = np.empty(G * LANES, np.float32), np.empty_like(xt)
    _fns()[f"sym{x.shape[1]}"](_ptr(xt), _ptr(wt), G, _ptr(c), c.size, float(nmax), _ptr(d), _ptr(lt))
    return d[:N], _lanes_out(lt, N)


def affine(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float = -0.9, rdelta: float = 0.05, nstep: int = 36
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """fit_affine(x, w, nmax, rmin, rdelta, nstep), bit for bit."""
    N = x.shape[0]
    xt, wt, G = _lanes_in(x, w)
    c = np.array([rmin + rdelta * k + nmax for k in range(nstep + 1)], np.float32)
    d, m, lt = np.empty(G * LANES, np.float32), np.empty(G * LANES, np.float32), np.empty_like(xt)
    _fns()[f"aff{x.shape[1]}"](_ptr(xt), _ptr(wt), G, _ptr(c), c.size, float(nmax), _ptr(d), _ptr(m), _ptr(lt))
    return d[:N], m[:N], _lanes_out(lt, N)


def codebook(x: np.ndarray, w: np.ndarray, ntry: int = 7) -> np.ndarray:
    """fit_codebook(x, w, ntry), bit for bit."""
    N = x.shape[0]
    xt, wt, G = _lanes_in(x, w)
    v0 = QB._IQ4[0]
    c = np.array([-v0] + [t + v0 for t in range(-ntry, ntry + 1)], np.float32)
    d = np.empty(G * LANES, np.float32)
    _fns()[f"cb{x.shape[1]}"](_ptr(xt), _ptr(wt), G, _ptr(c), c.size, _ptr(d))
    return d[:N]


def gptq_codes(w: np.ndarray, S: np.ndarray, M: np.ndarray | None, inv: np.ndarray, u: np.ndarray, lo: int,
               hi: int, bias: int, book: bool) -> tuple[np.ndarray, np.ndarray]:
    """passes/gptq.py's input-by-input codes of one block, bit for bit: w, S, M, inv [rows, qk] float32 (w, the
    block's corrected weights, updated in place as gptq._by_input updates them), u [qk, qk] float32 (U's block).
    Returns (codes int32, scaled errors float32) [rows, qk]."""
    rows, qk = w.shape
    if (w.dtype != np.float32 or S.shape != w.shape or inv.shape != w.shape
            or (M is not None and M.shape != w.shape) or u.shape != (qk, qk)):  # checked before any pointer is passed
        raise ValueError(f"gptq_codes: a float32 block [rows, qk] {w.shape} {w.dtype} with S, inv (and M) of its "
                         f"shape and u [qk, qk], not S {S.shape}, inv {inv.shape}, u {u.shape}")
    wt = np.ascontiguousarray(w.T)
    st, it = np.ascontiguousarray(S.T, np.float32), np.ascontiguousarray(inv.T, np.float32)
    mt = None if M is None else np.ascontiguousarray(M.T, np.float32)
    ub = np.ascontiguousarray(u, np.float32)
    c, e = np.empty((qk, rows), np.float32), np.empty((qk, rows), np.float32)
    _fns()["gptq_codes"](_ptr(wt), _ptr(st), None if mt is None else _ptr(mt), _ptr(it), _ptr(ub), rows, qk,
                         float(lo), float(hi), float(bias), int(book), _ptr(c), _ptr(e))
    w[...] = wt.T
    return np.ascontiguousarray(c.T).astype(np.int32), np.ascontiguousarray(e.T)


QB.NATIVE_FITTERS = sys.modules[__name__]
GPTQ.NATIVE_CODES = gptq_codes
