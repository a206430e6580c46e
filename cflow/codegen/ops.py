"""Small op kernels of the decode step, as llvmlite builders: norms, adds, embedding, router, soft-caps, copies.

Stage: codegen. Each function emits (once per module and specialisation, found again by name) an
internal function with constant shapes; codegen/step.py calls them from the compiled schedule.
The mat-vec kernels are in kernels.py, the attention core in attention.py, the barrier and the
workers in threads.py.
"""

from __future__ import annotations

import math

from llvmlite import ir

from ..layout.quant import DType
from .cgutils import (
    Loop,
    P,
    V,
    alloca_once,
    c64,
    cf,
    const_vec,
    f32,
    half_to_float,
    hsum,
    i8,
    i32,
    i64,
    internal_function,
    intrinsic,
    softcap,
)
from .target import ISA


def float_label(v: float) -> str:
    """A float for a function name: 1e-06 -> 1em06, 0.5 -> 0p5."""
    return repr(float(v)).replace(".", "p").replace("-", "m")


def rmsnorm(m: ir.Module, n: int, n_pad: int, eps: float):
    def build(b, x, w, out):
        acc = alloca_once(b, f32)
        b.store(cf(0.0), acc)
        with Loop(b, c64(0), c64(n), "ss") as i:
            v = b.load(b.gep(x, [i]))
            b.store(b.fadd(b.load(acc), b.fmul(v, v)), acc)
        sqrt = intrinsic(m, "llvm.sqrt.f32", f32, [f32])
        ms = b.fadd(b.fdiv(b.load(acc), cf(n)), cf(eps))
        inv = b.fdiv(cf(1.0), b.call(sqrt, [ms]))
        with Loop(b, c64(0), c64(n), "nx") as i:
            b.store(b.fmul(b.fmul(b.load(b.gep(x, [i])), inv), b.load(b.gep(w, [i]))), b.gep(out, [i]))
        with Loop(b, c64(n), c64(n_pad), "nz") as i:
            b.store(cf(0.0), b.gep(out, [i]))
        b.ret_void()

    key = ("rmsnorm", n, n_pad, float_label(eps))
    return internal_function(m, key, (P(f32),) * 3, build)

def add_rows(m: ir.Module, arity: int, normed: tuple[tuple[int, float], ...] = (), d: int = 0):
    """out[i] = in_0[i] + in_1[i] + ... over rows [lo, hi). normed: (j, eps) of the inputs RMS-normalised on the
    way in (post norms: in_j / rms(in_j) * w_j, one weight pointer each after the inputs); their RMS is over all
    d rows, which every thread reads itself (the add runs a stage after they were written), and rows past d
    (padding) are left alone, since the weights stop there."""

    def build(b, out, *rest):
        ins, ws, lo, hi = rest[:arity], rest[arity: arity + len(normed)], rest[-2], rest[-1]
        rms = {}
        if normed:
            sqrt = intrinsic(m, "llvm.sqrt.f32", f32, [f32])
            hi = b.select(b.icmp_signed("<", hi, c64(d)), hi, c64(d))
            for k, (j, eps) in enumerate(normed):
                acc = alloca_once(b, f32)
                b.store(cf(0.0), acc)
                with Loop(b, c64(0), c64(d), "ss") as i:
                    v = b.load(b.gep(ins[j], [i]))
                    b.store(b.fadd(b.load(acc), b.fmul(v, v)), acc)
                rms[j] = (b.call(sqrt, [b.fadd(b.fdiv(b.load(acc), cf(d)), cf(eps))]), ws[k])

        def term(j, i):
            v = b.load(b.gep(ins[j], [i]))
            if j not in rms:
                return v
            r, w = rms[j]
            return b.fmul(b.fdiv(v, r), b.load(b.gep(w, [i])))

        with Loop(b, lo, hi, "r") as i:
            s = term(0, i)
            for j in range(1, arity):
                s = b.fadd(s, term(j, i))
            b.store(s, b.gep(out, [i]))
        b.ret_void()

    key = ("add", arity) + (("norm", d, *(f"{j}e{float_label(eps)}" for j, eps in normed)) if normed else ())
    return internal_function(m, key, (P(f32),) * (arity + 1 + len(normed)) + (i64, i64), build)

def axpy(m: ir.Module):
    """out[i] = (first ? 0 : out[i]) + a * x[i] over [lo, hi)."""

    def build(b, out, x, a, first, lo, hi):
        with Loop(b, lo, hi, "r") as i:
            prev = b.select(b.icmp_signed("!=", first, c64(0)), cf(0.0), b.load(b.gep(out, [i])))
            b.store(b.fadd(prev, b.fmul(a, b.load(b.gep(x, [i])))), b.gep(out, [i]))
        b.ret_void()

    return internal_function(m, ("axpy",), (P(f32), P(f32), f32, i64, i64, i64), build)

def embed(m: ir.Module, dtype: DType, d: int):

    def build(b, table, token, out, lo, hi):
        hi = b.select(b.icmp_signed("<", hi, c64(d)), hi, c64(d))
        with Loop(b, lo, hi, "e") as i:
            idx = b.add(b.mul(token, c64(d)), i)
            if dtype == DType.F16:
                v = half_to_float(b, b.load(b.gep(b.bitcast(table, P(ir.IntType(16))), [idx])), ISA.GENERIC)
            else:
                v = b.load(b.gep(b.bitcast(table, P(f32)), [idx]))
            b.store(v, b.gep(out, [i]))
        b.ret_void()

    return internal_function(m, ("embed", dtype.label, d), (P(i8), i64, P(f32), i64, i64), build)

def router(m: ir.Module, d: int, n_experts: int, top_k: int, normalize: bool):

    # The logits: NA independent 16-lane multiply-add chains over the input (element i into chain (i // 16) % NA),
    # summed chain by chain then by the halving tree, then the tail past the last whole 16 one by one; a fixed
    # order, so decode and prefill route alike. (A single scalar chain took ~10 us per call at d = 2048: a
    # floating add's latency per element, the same on every thread.)
    NA, VL = 4, 16
    nvec = d // VL

    def build(b, x, w, probs, route):
        expf = intrinsic(m, "llvm.exp.f32", f32, [f32])
        mx = alloca_once(b, f32)
        b.store(cf(-math.inf), mx)
        vt = V(f32, VL)
        accs = [alloca_once(b, vt) for _ in range(NA)]
        with Loop(b, c64(0), c64(n_experts), "lg") as e:
            row = b.gep(w, [b.mul(e, c64(d))])
            for a in accs:
                b.store(const_vec(f32, VL, 0.0), a)
            with Loop(b, c64(0), c64(nvec // NA), "dotv") as j:
                for k, a in enumerate(accs):
                    off = b.mul(b.add(b.mul(j, c64(NA)), c64(k)), c64(VL))
                    wv = b.load(b.bitcast(b.gep(row, [off]), P(vt)), align=4)
                    xv = b.load(b.bitcast(b.gep(x, [off]), P(vt)), align=4)
                    b.store(b.fadd(b.load(a), b.fmul(wv, xv)), a)
            for k in range(nvec - nvec % NA, nvec):  # whole vectors left over, into their chains
                wv = b.load(b.bitcast(b.gep(row, [c64(k * VL)]), P(vt)), align=4)
                xv = b.load(b.bitcast(b.gep(x, [c64(k * VL)]), P(vt)), align=4)
                a = accs[k % NA]
                b.store(b.fadd(b.load(a), b.fmul(wv, xv)), a)
            tot_v = b.load(accs[0])
            for a in accs[1:]:
                tot_v = b.fadd(tot_v, b.load(a))
            s = alloca_once(b, f32)
            b.store(hsum(b, tot_v), s)
            for i in range(nvec * VL, d):  # the tail, element by element
                b.store(b.fadd(b.load(s), b.fmul(b.load(b.gep(row, [c64(i)])), b.load(b.gep(x, [c64(i)])))), s)
            v = b.load(s)
            b.store(v, b.gep(probs, [e]))
            b.store(b.select(b.fcmp_ordered(">", v, b.load(mx)), v, b.load(mx)), mx)
        tot = alloca_once(b, f32)
        b.store(cf(0.0), tot)
        with Loop(b, c64(0), c64(n_experts), "sm") as e:
            p = b.call(expf, [b.fsub(b.load(b.gep(probs, [e])), b.load(mx))])
            b.store(p, b.gep(probs, [e]))
            b.store(b.fadd(b.load(tot), p), tot)
        with Loop(b, c64(0), c64(n_experts), "nm") as e:
            b.store(b.fdiv(b.load(b.gep(probs, [e])), b.load(tot)), b.gep(probs, [e]))
        # top-k by repeated arg-max; strict '>' keeps the lowest index on ties (= a stable sort).
        idx = b.bitcast(route, P(i32))
        wts = b.gep(b.bitcast(route, P(f32)), [c64(top_k)])
        taken = alloca_once(b, ir.ArrayType(i8, max(n_experts, 1)))
        tk = b.bitcast(taken, P(i8))
        with Loop(b, c64(0), c64(n_experts), "z") as e:
            b.store(ir.Constant(i8, 0), b.gep(tk, [e]))
        wsum = alloca_once(b, f32)
        b.store(cf(0.0), wsum)
        for j in range(top_k):
            best, bv = alloca_once(b, i64), alloca_once(b, f32)
            b.store(c64(0), best)
            b.store(cf(-1.0), bv)
            with Loop(b, c64(0), c64(n_experts), f"tk{j}") as e:
                p = b.load(b.gep(probs, [e]))
                free = b.icmp_signed("==", b.load(b.gep(tk, [e])), ir.Constant(i8, 0))
                better = b.and_(free, b.fcmp_ordered(">", p, b.load(bv)))
                b.store(b.select(better, e, b.load(best)), best)
                b.store(b.select(better, p, b.load(bv)), bv)
            e_best = b.load(best)
            b.store(ir.Constant(i8, 1), b.gep(tk, [e_best]))
            b.store(b.trunc(e_best, i32), b.gep(idx, [c64(j)]))
            b.store(b.load(bv), b.gep(wts, [c64(j)]))
            b.store(b.fadd(b.load(wsum), b.load(bv)), wsum)
        if normalize:
            for j in range(top_k):
                pj = b.gep(wts, [c64(j)])
                b.store(b.fdiv(b.load(pj), b.load(wsum)), pj)
        b.ret_void()

    return internal_function(m, ("router", n_experts, top_k, int(normalize), d), (P(f32), P(f32), P(f32), P(i8)), build)

def sigmoid_dot(m: ir.Module, d: int):

    def build(b, w, x, out):
        s = alloca_once(b, f32)
        b.store(cf(0.0), s)
        with Loop(b, c64(0), c64(d), "sg") as i:
            b.store(b.fadd(b.load(s), b.fmul(b.load(b.gep(w, [i])), b.load(b.gep(x, [i])))), s)
        expf = intrinsic(m, "llvm.exp.f32", f32, [f32])
        g = b.fdiv(cf(1.0), b.fadd(cf(1.0), b.call(expf, [b.fsub(cf(0.0), b.load(s))])))
        b.store(g, out)
        b.ret_void()

    return internal_function(m, ("sigmoid_dot", d), (P(f32), P(f32), P(f32)), build)


def softcap_rows(m: ir.Module, cap: float):
    """x[i] = cap * tanh(x[i] / cap) for i in [lo, hi) (the final logit soft-cap): 16 logits at a time, the rest one
    by one (the same values: softcap is lane-wise)."""

    def build(b, x, lo, hi):
        whole = b.udiv(b.sub(hi, lo), c64(16))
        with Loop(b, c64(0), whole, "k") as k:
            p = b.bitcast(b.gep(x, [b.add(lo, b.mul(k, c64(16)))]), P(V(f32, 16)))
            b.store(softcap(b, b.load(p, align=4), cap), p, align=4)
        with Loop(b, b.add(lo, b.mul(whole, c64(16))), hi, "r") as i:
            p = b.gep(x, [i])
            b.store(softcap(b, b.load(p), cap), p)
        b.ret_void()

    return internal_function(m, ("softcap_rows", float_label(cap)), (P(f32), i64, i64), build)


def copy_words(m: ir.Module):
    """dst[i] = src[i] for i in [lo, hi): 4-byte words (a gathered activation row: kmax is a multiple of 32,
    so its int8 codes and its block scales are whole 4-byte words)."""

    def build(b, dst, src, lo, hi):
        with Loop(b, lo, hi, "w") as i:
            b.store(b.load(b.gep(src, [i])), b.gep(dst, [i]))
        b.ret_void()

    return internal_function(m, ("copy_words",), (P(i32), P(i32), i64, i64), build)


def copy_rows(m: ir.Module):
    """dst[i] = src[i] for i in [lo, hi): floats (a thread's rows of one expert output)."""

    def build(b, dst, src, lo, hi):
        with Loop(b, lo, hi, "r") as i:
            b.store(b.load(b.gep(src, [i])), b.gep(dst, [i]))
        b.ret_void()

    return internal_function(m, ("copy_rows",), (P(f32), P(f32), i64, i64), build)
