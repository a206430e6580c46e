"""Small op kernels of the decode step, as llvmlite builders: norms, adds, embedding, router, attention, barrier.

Stage: codegen. Each function emits (once per module and specialisation, found again by name) an
internal function with constant shapes; codegen/step.py calls them from the compiled schedule.
The mat-vec kernels themselves are in kernels.py.
"""

from __future__ import annotations

import math

from llvmlite import ir

from ..ir import Attention
from ..ir.quant import DType
from .kernels import _intrinsic, _Loop

i8, i32, i64, f32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
P = ir.PointerType
SPINS = 4000  # pause rounds before a thread waiting at a barrier starts yielding its core


def c64(v: int) -> ir.Constant:
    return ir.Constant(i64, int(v))


def cf(v: float) -> ir.Constant:
    return ir.Constant(f32, float(v))


def alloca(b: ir.IRBuilder, ty, name: str = ""):
    """An alloca in the entry block (never inside a loop: the stack would grow every iteration)."""
    cur = b.block
    b.position_at_start(b.function.entry_basic_block)
    a = b.alloca(ty, name=name)
    b.position_at_end(cur)
    return a


def _internal(m: ir.Module, key: tuple, args, build, ret=ir.VoidType()) -> ir.Function:
    """Get or emit the internal function named after `key` (its specialisation)."""
    name = "_".join(str(k) for k in key)
    fn = m.globals.get(name)
    if fn is None:
        fn = ir.Function(m, ir.FunctionType(ret, list(args)), name)
        fn.linkage = "internal"
        fn.attributes.add("nounwind")
        fn.attributes.add("noinline")
        build(ir.IRBuilder(fn.append_basic_block("entry")), *fn.args)
    return fn


def rmsnorm(m: ir.Module, n: int, n_pad: int, eps: float):
    def build(b, x, w, out):
        acc = alloca(b, f32)
        b.store(cf(0.0), acc)
        with _Loop(b, c64(0), c64(n), "ss") as i:
            v = b.load(b.gep(x, [i]))
            b.store(b.fadd(b.load(acc), b.fmul(v, v)), acc)
        sqrt = _intrinsic(m, "llvm.sqrt.f32", f32, [f32])
        ms = b.fadd(b.fdiv(b.load(acc), cf(n)), cf(eps))
        inv = b.fdiv(cf(1.0), b.call(sqrt, [ms]))
        with _Loop(b, c64(0), c64(n), "nx") as i:
            b.store(b.fmul(b.fmul(b.load(b.gep(x, [i])), inv), b.load(b.gep(w, [i]))), b.gep(out, [i]))
        with _Loop(b, c64(n), c64(n_pad), "nz") as i:
            b.store(cf(0.0), b.gep(out, [i]))
        b.ret_void()

    return _internal(m, ("rmsnorm", n, n_pad, repr(eps).replace(".", "p").replace("-", "m")), (P(f32),) * 3, build)

def add_rows(m: ir.Module, arity: int):
    def build(b, out, *rest):
        ins, lo, hi = rest[:arity], rest[arity], rest[arity + 1]
        with _Loop(b, lo, hi, "r") as i:
            s = b.load(b.gep(ins[0], [i]))
            for p in ins[1:]:
                s = b.fadd(s, b.load(b.gep(p, [i])))
            b.store(s, b.gep(out, [i]))
        b.ret_void()

    return _internal(m, ("add", arity), (P(f32),) * (arity + 1) + (i64, i64), build)

def axpy(m: ir.Module):
    """out[i] = (first ? 0 : out[i]) + a * x[i] over [lo, hi)."""

    def build(b, out, x, a, first, lo, hi):
        with _Loop(b, lo, hi, "r") as i:
            prev = b.select(b.icmp_signed("!=", first, c64(0)), cf(0.0), b.load(b.gep(out, [i])))
            b.store(b.fadd(prev, b.fmul(a, b.load(b.gep(x, [i])))), b.gep(out, [i]))
        b.ret_void()

    return _internal(m, ("axpy",), (P(f32), P(f32), f32, i64, i64, i64), build)

def embed(m: ir.Module, dtype: DType, d: int):

    def build(b, table, token, out, lo, hi):
        hi = b.select(b.icmp_signed("<", hi, c64(d)), hi, c64(d))
        with _Loop(b, lo, hi, "e") as i:
            idx = b.add(b.mul(token, c64(d)), i)
            if dtype == DType.F16:
                v = _half_bits_to_float(b, b.load(b.gep(b.bitcast(table, P(ir.IntType(16))), [idx])))
            else:
                v = b.load(b.gep(b.bitcast(table, P(f32)), [idx]))
            b.store(v, b.gep(out, [i]))
        b.ret_void()

    return _internal(m, ("embed", dtype.label, d), (P(i8), i64, P(f32), i64, i64), build)

def barrier(m: ir.Module, isa: str):
    def build(b, state, nth):
        done = b.append_basic_block("done")
        wait = b.append_basic_block("wait")
        last = b.append_basic_block("last")
        spin = b.append_basic_block("spin")
        poll = b.append_basic_block("poll")
        cnt = state
        gen_p = b.gep(state, [ir.Constant(i32, 16)])
        b.cbranch(b.icmp_signed("<=", nth, c64(1)), done, wait)
        b.position_at_end(wait)
        gen = b.load_atomic(gen_p, "acquire", 4)
        arrived = b.atomic_rmw("add", cnt, ir.Constant(i32, 1), "acq_rel")
        is_last = b.icmp_signed("==", b.sext(arrived, i64), b.sub(nth, c64(1)))
        b.cbranch(is_last, last, spin)
        b.position_at_end(last)
        b.store_atomic(ir.Constant(i32, 0), cnt, "monotonic", 4)
        b.atomic_rmw("add", gen_p, ir.Constant(i32, 1), "release")
        b.branch(done)
        b.position_at_end(spin)
        # Spin with pause; after SPINS rounds yield the core (a shared or oversubscribed machine
        # must not burn the time slice of the thread everyone is waiting for).
        spins = alloca(b, i64)
        b.store(c64(0), spins)
        b.branch(poll)
        b.position_at_end(poll)
        if isa != "generic":
            b.call(_intrinsic(m, "llvm.x86.sse2.pause", ir.VoidType(), []), [])
        n = b.add(b.load(spins), c64(1))
        b.store(n, spins)
        yield_bb = b.append_basic_block("yield")
        check = b.append_basic_block("check")
        b.cbranch(b.icmp_signed(">", n, c64(SPINS)), yield_bb, check)
        b.position_at_end(yield_bb)
        b.call(_sched_yield(m), [])
        b.branch(check)
        b.position_at_end(check)
        now = b.load_atomic(gen_p, "acquire", 4)
        b.cbranch(b.icmp_signed("==", now, gen), poll, done)
        b.position_at_end(done)
        b.ret_void()

    return _internal(m, ("barrier",), (P(i32), i64), build)

def router(m: ir.Module, d: int, n_experts: int, top_k: int, normalize: bool):

    def build(b, x, w, probs, route):
        expf = _intrinsic(m, "llvm.exp.f32", f32, [f32])
        mx = alloca(b, f32)
        b.store(cf(-math.inf), mx)
        with _Loop(b, c64(0), c64(n_experts), "lg") as e:
            s = alloca(b, f32)
            b.store(cf(0.0), s)
            with _Loop(b, c64(0), c64(d), "dot") as i:
                wv = b.load(b.gep(w, [b.add(b.mul(e, c64(d)), i)]))
                b.store(b.fadd(b.load(s), b.fmul(wv, b.load(b.gep(x, [i])))), s)
            v = b.load(s)
            b.store(v, b.gep(probs, [e]))
            b.store(b.select(b.fcmp_ordered(">", v, b.load(mx)), v, b.load(mx)), mx)
        tot = alloca(b, f32)
        b.store(cf(0.0), tot)
        with _Loop(b, c64(0), c64(n_experts), "sm") as e:
            p = b.call(expf, [b.fsub(b.load(b.gep(probs, [e])), b.load(mx))])
            b.store(p, b.gep(probs, [e]))
            b.store(b.fadd(b.load(tot), p), tot)
        with _Loop(b, c64(0), c64(n_experts), "nm") as e:
            b.store(b.fdiv(b.load(b.gep(probs, [e])), b.load(tot)), b.gep(probs, [e]))
        # top-k by repeated arg-max; strict '>' keeps the lowest index on ties (= a stable sort).
        idx = b.bitcast(route, P(i32))
        wts = b.gep(b.bitcast(route, P(f32)), [c64(top_k)])
        taken = alloca(b, ir.ArrayType(i8, max(n_experts, 1)))
        tk = b.bitcast(taken, P(i8))
        with _Loop(b, c64(0), c64(n_experts), "z") as e:
            b.store(ir.Constant(i8, 0), b.gep(tk, [e]))
        wsum = alloca(b, f32)
        b.store(cf(0.0), wsum)
        for j in range(top_k):
            best, bv = alloca(b, i64), alloca(b, f32)
            b.store(c64(0), best)
            b.store(cf(-1.0), bv)
            with _Loop(b, c64(0), c64(n_experts), f"tk{j}") as e:
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

    return _internal(m, ("router", n_experts, top_k, int(normalize), d), (P(f32), P(f32), P(f32), P(i8)), build)

def sigmoid_dot(m: ir.Module, d: int):

    def build(b, w, x, out):
        s = alloca(b, f32)
        b.store(cf(0.0), s)
        with _Loop(b, c64(0), c64(d), "sg") as i:
            b.store(b.fadd(b.load(s), b.fmul(b.load(b.gep(w, [i])), b.load(b.gep(x, [i])))), s)
        expf = _intrinsic(m, "llvm.exp.f32", f32, [f32])
        g = b.fdiv(cf(1.0), b.fadd(cf(1.0), b.call(expf, [b.fsub(cf(0.0), b.load(s))])))
        b.store(g, out)
        b.ret_void()

    return _internal(m, ("sigmoid_dot", d), (P(f32), P(f32), P(f32)), build)

def attention(m: ir.Module, n: Attention, offsets: tuple[int, int, int]):
    """Single-token GQA over the cache for kv heads [g0, g1): bias, RoPE, cache write, softmax(qK)V."""
    H, KV, hd = n.n_heads, n.n_kv_heads, n.head_dim
    rep, half = H // KV, hd // 2
    qo, ko, vo = offsets
    scale = 1.0 / math.sqrt(hd)
    bias = n.bias

    def build(b, qkv, bq, bk, bv, kc, vc, cos, sin, att, scores, pos, g0, g1):
        expf = _intrinsic(m, "llvm.exp.f32", f32, [f32])
        qr = b.bitcast(alloca(b, ir.ArrayType(f32, hd)), P(f32))
        row = b.mul(pos, c64(half))

        def rope_into(src, bsrc, dst):  # dst[i] = rotate-half RoPE of (src + bias) at position pos
            with _Loop(b, c64(0), c64(half), "rp") as i:
                ih = b.add(i, c64(half))
                x1, x2 = b.load(b.gep(src, [i])), b.load(b.gep(src, [ih]))
                if bias:
                    x1 = b.fadd(x1, b.load(b.gep(bsrc, [i])))
                    x2 = b.fadd(x2, b.load(b.gep(bsrc, [ih])))
                cs, sn = b.load(b.gep(cos, [b.add(row, i)])), b.load(b.gep(sin, [b.add(row, i)]))
                b.store(b.fadd(b.fmul(x1, cs), b.fmul(b.fsub(cf(0.0), x2), sn)), b.gep(dst, [i]))
                b.store(b.fadd(b.fmul(x2, cs), b.fmul(x1, sn)), b.gep(dst, [ih]))

        with _Loop(b, g0, g1, "g") as g:
            goff = b.mul(g, c64(hd))
            cache_off = b.add(b.mul(pos, c64(KV * hd)), goff)
            rope_into(b.gep(qkv, [b.add(c64(ko), goff)]), b.gep(bk, [goff]) if bias else None, b.gep(kc, [cache_off]))
            with _Loop(b, c64(0), c64(hd), "vv") as i:
                v = b.load(b.gep(qkv, [b.add(c64(vo), b.add(goff, i))]))
                if bias:
                    v = b.fadd(v, b.load(b.gep(bv, [b.add(goff, i)])))
                b.store(v, b.gep(vc, [b.add(cache_off, i)]))
            with _Loop(b, c64(0), c64(rep), "h") as r:
                h = b.add(b.mul(g, c64(rep)), r)
                hoff = b.mul(h, c64(hd))
                rope_into(b.gep(qkv, [b.add(c64(qo), hoff)]), b.gep(bq, [hoff]) if bias else None, qr)
                mx = alloca(b, f32)
                b.store(cf(-math.inf), mx)
                npos = b.add(pos, c64(1))
                with _Loop(b, c64(0), npos, "s") as s:
                    kp = b.gep(kc, [b.add(b.mul(s, c64(KV * hd)), goff)])
                    acc = alloca(b, f32)
                    b.store(cf(0.0), acc)
                    with _Loop(b, c64(0), c64(hd), "qk") as i:
                        b.store(b.fadd(b.load(acc), b.fmul(b.load(b.gep(qr, [i])), b.load(b.gep(kp, [i])))), acc)
                    sc = b.fmul(b.load(acc), cf(scale))
                    b.store(sc, b.gep(scores, [s]))
                    b.store(b.select(b.fcmp_ordered(">", sc, b.load(mx)), sc, b.load(mx)), mx)
                tot = alloca(b, f32)
                b.store(cf(0.0), tot)
                with _Loop(b, c64(0), npos, "ex") as s:
                    p = b.call(expf, [b.fsub(b.load(b.gep(scores, [s])), b.load(mx))])
                    b.store(p, b.gep(scores, [s]))
                    b.store(b.fadd(b.load(tot), p), tot)
                out = b.gep(att, [hoff])
                with _Loop(b, c64(0), c64(hd), "oz") as i:
                    b.store(cf(0.0), b.gep(out, [i]))
                with _Loop(b, c64(0), npos, "pv") as s:
                    p = b.load(b.gep(scores, [s]))
                    vp = b.gep(vc, [b.add(b.mul(s, c64(KV * hd)), goff)])
                    with _Loop(b, c64(0), c64(hd), "ov") as i:
                        o = b.gep(out, [i])
                        b.store(b.fadd(b.load(o), b.fmul(p, b.load(b.gep(vp, [i])))), o)
                inv = b.fdiv(cf(1.0), b.load(tot))
                with _Loop(b, c64(0), c64(hd), "on") as i:
                    o = b.gep(out, [i])
                    b.store(b.fmul(b.load(o), inv), o)
        b.ret_void()

    key = ("attn", H, KV, hd, qo, ko, vo, int(bias))
    return _internal(m, key, (P(f32),) * 10 + (i64, i64, i64), build)


def _sched_yield(module: ir.Module) -> ir.Function:
    """libc's sched_yield (resolved by the JIT from the process)."""
    fn = module.globals.get("sched_yield")
    if fn is None:
        fn = ir.Function(module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
    return fn


def _half_bits_to_float(b, h):
    """IEEE half bits (i16) -> float with integer ops only (no libcall): normals, zeros, subnormals, inf/nan."""
    w = b.zext(h, i32)
    mag = b.shl(b.and_(w, ir.Constant(i32, 0x7FFF)), ir.Constant(i32, 13))
    f = b.fmul(b.bitcast(mag, f32), cf(2.0**112))
    inf = b.icmp_unsigned(">=", mag, ir.Constant(i32, 0x7C00 << 13))
    fb = b.select(inf, b.or_(mag, ir.Constant(i32, 0x7F800000)), b.bitcast(f, i32))
    sign = b.shl(b.and_(w, ir.Constant(i32, 0x8000)), ir.Constant(i32, 16))
    return b.bitcast(b.or_(fb, sign), f32)


# --- persistent workers: woken per token by a futex, no Python in between ------------------------
SYS_FUTEX, FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE = 202, 128, 129  # x86-64 Linux
CTL_GO, CTL_STOP = 0, 16  # i32 words of the control block: token generation, stop flag


def _syscall(m: ir.Module) -> ir.Function:
    fn = m.globals.get("syscall")
    if fn is None:
        fn = ir.Function(m, ir.FunctionType(i64, [i64], var_arg=True), "syscall")
    return fn


def emit_workers(m: ir.Module, step: ir.Function, isa: str) -> None:
    """cflow_worker(ptrs, params, tid, nth, barrier, ctl): loop { wait until ctl.go changes; run the step }
    until ctl.stop; cflow_kick(ctl): start the next token (go += 1, wake the sleepers).

    A waiting worker spins briefly (the next token usually follows within microseconds), then sleeps
    in futex_wait, so an idle loaded model costs no CPU.
    """
    args = [a.type for a in step.args]
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), args + [P(i32)]), "cflow_worker")
    fn.attributes.add("nounwind")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    *step_args, ctl = fn.args
    go_p, stop_p = b.gep(ctl, [ir.Constant(i32, CTL_GO)]), b.gep(ctl, [ir.Constant(i32, CTL_STOP)])
    seen = alloca(b, i32)
    spins = alloca(b, i64)
    # NOTE: start from generation 0, the value ctl.go has when the workers are created, not from
    # whatever it is when this thread gets going: a kick may already have happened by then.
    b.store(ir.Constant(i32, 0), seen)
    wait, poll, sleep, run, out = (b.append_basic_block(n) for n in ("wait", "poll", "sleep", "run", "out"))
    b.branch(wait)
    b.position_at_end(wait)
    b.store(c64(0), spins)
    b.branch(poll)
    b.position_at_end(poll)
    now = b.load_atomic(go_p, "acquire", 4)
    changed = b.icmp_signed("!=", now, b.load(seen))
    check_spin = b.append_basic_block("check_spin")
    b.cbranch(changed, run, check_spin)
    b.position_at_end(check_spin)
    if isa != "generic":
        b.call(_intrinsic(m, "llvm.x86.sse2.pause", ir.VoidType(), []), [])
    n = b.add(b.load(spins), c64(1))
    b.store(n, spins)
    b.cbranch(b.icmp_signed(">", n, c64(SPINS)), sleep, poll)
    b.position_at_end(sleep)  # futex_wait returns at once if go already moved on: no lost wake-up
    b.call(_syscall(m), [c64(SYS_FUTEX), b.ptrtoint(go_p, i64), c64(FUTEX_WAIT_PRIVATE), b.sext(b.load(seen), i64), c64(0)])
    b.branch(poll)
    b.position_at_end(run)
    b.store(now, seen)
    stop = b.load_atomic(stop_p, "acquire", 4)
    go_on = b.append_basic_block("go_on")
    b.cbranch(b.icmp_signed("!=", stop, ir.Constant(i32, 0)), out, go_on)
    b.position_at_end(go_on)
    b.call(step, step_args)
    b.branch(wait)
    b.position_at_end(out)
    b.ret_void()

    kick = ir.Function(m, ir.FunctionType(ir.VoidType(), [P(i32)]), "cflow_kick")
    kick.attributes.add("nounwind")
    b = ir.IRBuilder(kick.append_basic_block("entry"))
    go_p = b.gep(kick.args[0], [ir.Constant(i32, CTL_GO)])
    b.atomic_rmw("add", go_p, ir.Constant(i32, 1), "acq_rel")
    b.call(_syscall(m), [c64(SYS_FUTEX), b.ptrtoint(go_p, i64), c64(FUTEX_WAKE_PRIVATE), c64(1 << 30)])
    b.ret_void()
