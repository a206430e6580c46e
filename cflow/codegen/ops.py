"""Small op kernels of the decode step, as llvmlite builders: norms, adds, embedding, router, attention, barrier.

Stage: codegen. Each function emits (once per module and specialisation, found again by name) an
internal function with constant shapes; codegen/step.py calls them from the compiled schedule.
The mat-vec kernels themselves are in kernels.py.
"""

from __future__ import annotations

import math

from llvmlite import ir

from ..ir import Attention
from ..layout.quant import DType
from .abi import FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE, KV_BYTES, BarrierWord, CtlWord, sys_futex
from .cgutils import (
    Loop,
    P,
    V,
    alloca_once,
    bf16_dot,
    c32,
    c64,
    cf,
    const_vec,
    exp_vec,
    f32,
    float_to_bf16,
    float_to_half,
    half_to_float,
    hsum,
    i8,
    i16,
    i32,
    i64,
    internal_function,
    intrinsic,
    muladd,
    pause,
    prefetch_lines,
    softcap,
    splat,
    syscall,
)
from .target import ISA

SPINS = 4000  # pause rounds before an idle worker sleeps until the next token (emit_workers)
BARRIER_SPINS = 4000  # pause rounds before a thread waiting at a barrier sleeps (BarrierWord.SPIN overrides)


def _flt(v: float) -> str:
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

    key = ("rmsnorm", n, n_pad, _flt(eps))
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

    key = ("add", arity) + (("norm", d, *(f"{j}e{_flt(eps)}" for j, eps in normed)) if normed else ())
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

def _futex(b: ir.IRBuilder, word, op: int, val) -> None:
    """futex(word, op, val) through libc's syscall(); the JIT runs the code in this process, hence its triple."""
    import llvmlite.binding as llvm

    nr = sys_futex(llvm.get_process_triple())
    b.call(syscall(b.module), [c64(nr), b.ptrtoint(word, i64), c64(op), val, c64(0)])


def barrier(m: ir.Module, isa: str):
    """barrier(state, nth): wait until all nth threads have arrived (BarrierWord explains the words).

    A waiter spins (with pause) for SPIN rounds, then sleeps in futex_wait on the generation word, so a
    thread waiting for a descheduled one hands its core back (possibly to that very thread) instead of
    burning it. The last arriver bumps the generation and calls FUTEX_WAKE only if SLEEPERS is non-zero:
    the uncontended path makes no system call. No lost wake-up: a sleeper increments SLEEPERS before it
    rechecks the generation, the last arriver bumps the generation before it reads SLEEPERS (both seq_cst,
    so one of them sees the other), and futex_wait itself returns at once if the generation has moved.
    """

    def build(b, state, nth):
        done = b.append_basic_block("done")
        wait = b.append_basic_block("wait")
        last = b.append_basic_block("last")
        spin = b.append_basic_block("spin")
        poll = b.append_basic_block("poll")
        sleep = b.append_basic_block("sleep")
        recheck = b.append_basic_block("recheck")
        nap = b.append_basic_block("nap")
        woke = b.append_basic_block("woke")
        cnt = b.gep(state, [c32(BarrierWord.COUNT)])
        gen_p = b.gep(state, [c32(BarrierWord.GENERATION)])
        sleepers = b.gep(state, [c32(BarrierWord.SLEEPERS)])
        b.cbranch(b.icmp_signed("<=", nth, c64(1)), done, wait)
        b.position_at_end(wait)
        gen = b.load_atomic(gen_p, "acquire", 4)
        arrived = b.atomic_rmw("add", cnt, ir.Constant(i32, 1), "acq_rel")
        is_last = b.icmp_signed("==", b.sext(arrived, i64), b.sub(nth, c64(1)))
        b.cbranch(is_last, last, spin)

        b.position_at_end(last)
        b.store_atomic(ir.Constant(i32, 0), cnt, "monotonic", 4)
        b.atomic_rmw("add", gen_p, ir.Constant(i32, 1), "seq_cst")
        anyone = b.icmp_signed("!=", b.load_atomic(sleepers, "seq_cst", 4), ir.Constant(i32, 0))
        with b.if_then(anyone, likely=False):
            _futex(b, gen_p, FUTEX_WAKE_PRIVATE, c64(1 << 30))
        b.branch(done)

        b.position_at_end(spin)
        budget = b.sext(b.load_atomic(b.gep(state, [c32(BarrierWord.SPIN)]), "monotonic", 4), i64)
        budget = b.select(b.icmp_signed("==", budget, c64(0)), c64(BARRIER_SPINS), budget)
        spins = alloca_once(b, i64)
        b.store(c64(0), spins)
        b.branch(poll)
        b.position_at_end(poll)
        moved = b.icmp_signed("!=", b.load_atomic(gen_p, "acquire", 4), gen)
        count = b.append_basic_block("count")
        b.cbranch(moved, done, count)
        b.position_at_end(count)
        pause(b, isa)
        n = b.add(b.load(spins), c64(1))
        b.store(n, spins)
        b.cbranch(b.icmp_signed(">", n, budget), sleep, poll)

        b.position_at_end(sleep)
        b.atomic_rmw("add", b.gep(state, [c32(BarrierWord.NAPS)]), ir.Constant(i32, 1), "monotonic")
        b.atomic_rmw("add", sleepers, ir.Constant(i32, 1), "seq_cst")
        b.branch(recheck)
        b.position_at_end(recheck)
        b.cbranch(b.icmp_signed("!=", b.load_atomic(gen_p, "seq_cst", 4), gen), woke, nap)
        b.position_at_end(nap)  # returns at once if the generation is no longer gen; spurious wake-ups recheck
        _futex(b, gen_p, FUTEX_WAIT_PRIVATE, b.sext(gen, i64))
        b.branch(recheck)
        b.position_at_end(woke)
        b.atomic_rmw("sub", sleepers, ir.Constant(i32, 1), "seq_cst")
        b.branch(done)

        b.position_at_end(done)
        b.ret_void()

    return internal_function(m, ("barrier",), (P(i32), i64), build)


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

ATT_LANES = 16  # scores are exponentiated 16 at a time: the scores scratch is padded by this much (abi.py)
# How far ahead the attention core's K and V scans prefetch by default (bytes, into L1; each host measures its own:
# codegen/attn_tune.py). Without it one scan per kv head left the cache's DRAM reads to the hardware prefetchers:
# on the AMX Xeon VM the f16 core took 474 us per layer at 4,064 positions from DRAM, 374 us 4 KiB ahead
# (docs/results/attention_core_prefetch_intel.json; docs/journal/performance.md, "Long contexts"). On Zen 5
# prefetching V ahead was measured slower (before this code: the default there is unmeasured, the tuner decides).
KV_PREFETCH = 4096


def kv_block(max_seq: int) -> int:
    """Positions per K block of the cache (the largest of 16, 8, 4, 2, 1 that divides max_seq)."""
    return next(B for B in (16, 8, 4, 2, 1) if max_seq % B == 0)


def kv_layout(max_seq: int, n_kv_heads: int, head_dim: int, kv: str = "f32"):
    """Where position s, kv head g, dimension d of one layer's K and V live (element offsets in each region of
    abi.kv_floats_per_layer entries): K in blocks of B = kv_block(max_seq) positions, dimension-major inside a
    block, so one load gives B positions' entries of a dimension; V position after position, each kv head's
    positions together. Both are read front to back by a kv head's scan. Works on ints and numpy arrays.

    kv='bf16' pairs the entries one BF16 dot-product lane takes (bf16_dot): in K the two dimensions 2m, 2m+1 of a
    position sit side by side (a block is pair-major: pair m holds B positions x 2 dimensions); in V the two
    positions 2t, 2t+1 of a dimension (a kv head's V is pair-row after pair-row, the position count rounded up
    to even)."""
    B = kv_block(max_seq)
    nb = max_seq // B
    if kv == "bf16":
        S2 = max_seq + max_seq % 2

        def k_at(s, g, d):
            return ((g * nb + s // B) * head_dim + d - d % 2) * B + 2 * (s % B) + d % 2

        def v_at(s, g, d):
            return (g * S2 + s - s % 2) * head_dim + 2 * d + s % 2

        return k_at, v_at

    def k_at(s, g, d):
        return ((g * nb + s // B) * head_dim + d) * B + s % B

    def v_at(s, g, d):
        return (g * max_seq + s) * head_dim + d

    return k_at, v_at


# The tile unit for kv='bf16' attention (bf16_unit 'amx'). Tiles: the queries (then the softmax weights) as A,
# one K or V tile as B, a block's scores, and one output accumulator per 16 dimensions.
T_Q, T_B, T_S, T_O = 0, 2, 3, 4


def amx_fits(rep: int, head_dim: int, kv_block: int) -> bool:
    """The geometries the tile core takes: K blocks of 16 positions (a B tile row is one dimension pair of the 16
    positions, 64 bytes), at most 16 query heads per kv head (the tiles' rows), head_dim 32 or 64 (one or two A
    tiles of queries and head_dim / 16 output tiles next to the other three: 8 tiles in all)."""
    return kv_block == 16 and 1 <= rep <= 16 and head_dim in (32, 64)


def core_unit(kv: str, bf16_unit: str, rep: int, head_dim: int, max_seq: int) -> str:
    """What one attention core's bf16 dot products run on, given the host's unit (Target.bf16_unit): 'amx' only
    where the geometry and cache fit the tiles (amx_fits), else VDPBF16PS ('dpbf16') where the host has it, else
    '' (the FMA emulation; also every kv other than 'bf16'). The one rule attention() and the tuning key share."""
    if kv != "bf16" or not bf16_unit:
        return ""
    if bf16_unit == "amx" and not amx_fits(rep, head_dim, kv_block(max_seq)):
        return "dpbf16"
    return bf16_unit


def _tile(b: ir.IRBuilder, op: str, *args) -> None:
    """llvm.x86.<op> of the tile unit: tile numbers (immediates), then a byte pointer and a stride in bytes."""
    sig = {"ldtilecfg": "p", "tilerelease": "", "tileloadd64": "tpl", "tilestored64": "tpl", "tilezero": "t",
           "tdpbf16ps": "ttt"}[op]
    tys = {"t": i8, "p": P(i8), "l": i64}
    vals = [b.bitcast(a, P(i8)) if k == "p" else a if isinstance(a, ir.Value) else ir.Constant(tys[k], a)
            for k, a in zip(sig, args)]
    b.call(intrinsic(b.module, "llvm.x86." + op, ir.VoidType(), [tys[k] for k in sig]), vals)


def _amx_config(b: ir.IRBuilder, rep: int, head_dim: int) -> None:
    """LDTILECFG (palette 1) for the tile core's tiles: queries / weights rep x 64 bytes (two query tiles where
    head_dim is 64), the B operand 16 x 64, the scores and the head_dim / 16 outputs rep x 64."""
    shapes = {T_Q: rep, T_B: 16, T_S: rep} | {T_O + c: rep for c in range(head_dim // 16)}
    if head_dim == 64:
        shapes[T_Q + 1] = rep
    cfg = [0] * 64
    cfg[0] = 1
    for t, rows in shapes.items():
        cfg[16 + 2 * t], cfg[48 + t] = 64, rows  # bytes per row (u16, < 256), rows
    at = alloca_once(b, ir.ArrayType(i8, 64))
    at.align = 64
    b.store(ir.Constant(ir.ArrayType(i8, 64), cfg), at)
    _tile(b, "ldtilecfg", at)


def attention(m: ir.Module, n: Attention, offsets: tuple[int, int, int], isa: str, kv: str = "f32",
              max_seq: int = 0, bf16_unit: str = "", kv_prefetch: int = KV_PREFETCH):
    """Single-token GQA over the cache for kv heads [g0, g1): bias, q/k norms, RoPE, cache write, softmax(qK)V.

    q/k norms (n.qk_norm) are RMSNorms of (projection + bias) before RoPE, weights qn/kn: 'head' normalises each
    head over head_dim (weights [hd]); 'proj' the whole projection (weights [H*hd] / [KV*hd]), whose sums every
    thread takes over all heads itself (the projection is whole after the QKV stage: no barrier).
    n.softcap caps the scores (Gemma 2); n.window > 0 attends to the last `window` positions only (the cache
    keeps every position: only the loops start later), the same function for decode, prefill and batches.

    The cache layout is kv_layout(max_seq, ...): K in blocks of B positions (dimension-major inside a block), V
    position after position per kv head, so a kv head's scan reads both front to back. The core is vectorised
    in a fixed order, so a token's output depends only on its inputs and position: the scores of B positions
    at once, q.k as NP interleaved multiply-add chains over the dimensions (dimension d into chain d mod NP,
    the chains then summed by a halving tree), no horizontal sum; exp over ATT_LANES scores of a head at a time
    (cgutils.exp_vec), their sum lane-wise then by the halving tree; the weighted V sum in W = gcd(head_dim,
    16)-lane accumulators, one position after another. The rep query heads of a kv group go together: each K
    and V entry is loaded (and widened) once per group. FMA where the ISA has it (one rounding per
    multiply-add, the exponential's polynomial included), separate multiply and add on the generic path.

    kv: the cache's element type, 'f32', 'f16' or 'bf16'. 'f16' (IEEE half, rounded to nearest even as numpy's
    astype does; the interpreter's kv='f16' rounds the same way): K and V rounded once when written, widened on read.
    'bf16' (rounded to nearest even, layout.quant.round_bf16) is also the arithmetic's type: the query is rounded
    to bf16 and q.k taken as bf16 pair dot products (cgutils.bf16_dot: exact products, f32 sums), and the
    weighted V sum takes bf16(exp(score - max)) in pairs of positions, divided by the f32 sum of the unrounded
    weights. bf16_unit (Target.bf16_unit) says what takes the dot products: 'dpbf16', AVX512_BF16's VDPBF16PS, two
    multiply-adds per lane (half the instructions per cache byte of f16; on the AMX Xeon VM it issues at a quarter
    of the FMA rate, so there it is slower than f16: docs/journal/performance.md); '', an FMA emulation in the same
    order (bit-identical, and slower than f16: two FMAs and four integer ops per pair); 'amx', the tile unit (TDPBF16PS
    for q.k and the weighted V sum: the same exact products and f32 sums, taken in the tile unit's order, so not
    bit-identical to the other two), where the geometry fits it (core_unit, amx_fits), else 'dpbf16'.

    kv_prefetch: how far ahead (bytes) the K and V scans prefetch, 0 for none; a schedule knob (this host's choice:
    codegen/attn_tune.py), the numbers do not change.
    """
    H, KV, hd = n.n_heads, n.n_kv_heads, n.head_dim
    rep, half = H // KV, hd // 2
    if max_seq < 1:
        raise ValueError(f"attention: max_seq must be >= 1, got {max_seq}")
    S, B = max_seq, kv_block(max_seq)
    nb = S // B
    SS = S + 2 * ATT_LANES  # floats per head in the scores scratch (abi.ScratchLayout.scores)
    NP = 1 if rep >= 4 else (2 if rep >= 2 else 4)  # q.k chains per head: >= 4 independent multiply-adds
    DU = math.gcd(hd, 8)  # dimensions per iteration of the q.k loop (unrolled)
    qo, ko, vo = offsets
    scale = 1.0 / math.sqrt(hd)
    bias = n.bias
    qk_norm = n.qk_norm
    window = n.window  # a sliding window (Gemma 2/3, Mistral): attend to positions [pos - window + 1, pos] only
    W = math.gcd(hd, 16)
    nc = hd // W
    vt, L = V(f32, W), ATT_LANES
    fma = isa != ISA.GENERIC
    if kv not in KV_BYTES:
        raise ValueError(f"KV cache type must be one of {', '.join(KV_BYTES)}, not {kv!r}")
    half_kv, bf = kv == "f16", kv == "bf16"
    unit = core_unit(kv, bf16_unit, rep, hd, S)
    amx, bf16_hw = unit == "amx", unit in ("dpbf16", "amx")
    S2 = S + S % 2 if bf else S  # positions per kv head in the V region (pairs of positions in bf16)

    def build(b, qkv, bq, bk, bv, qn, kn, kc, vc, cos, sin, att, scores, pos, g0, g1):
        sqrt = intrinsic(m, "llvm.sqrt.f32", f32, [f32])
        kr = b.bitcast(alloca_once(b, ir.ArrayType(f32, hd)), P(f32))
        row = b.mul(pos, c64(half))
        if amx:
            _amx_config(b, rep, hd)
            vtail = alloca_once(b, ir.ArrayType(i8, 16 * 4 * hd))  # the last V pair-rows, zero-padded to 16
            vtail.align = 64

        def madd(x, y, acc):  # acc + x * y
            return muladd(b, x, y, acc, fma)

        def vload(base, i):
            return b.load(b.bitcast(b.gep(base, [i]), P(vt)), align=4)

        def cload(base, i, lanes=W):  # `lanes` cache entries from element i, as floats (f32 / f16 caches)
            assert not bf, "bf16 entries are read in pairs (k_unit, v_chunks)"
            if not half_kv:
                return b.load(b.bitcast(b.gep(base, [i]), P(V(f32, lanes))), align=4)
            return half_to_float(b, b.load(b.bitcast(b.gep(base, [i]), P(V(i16, lanes))), align=2), isa)

        def cstore(v, base, i):  # W floats into the cache from element i (f32 / f16 caches)
            assert not bf, "bf16 entries are written in pairs (the cache write below)"
            if half_kv:
                b.store(float_to_half(b, v, isa), b.bitcast(b.gep(base, [i]), P(V(i16, W))), align=2)
            else:
                b.store(v, b.bitcast(b.gep(base, [i]), P(vt)), align=4)

        def biased(src, bsrc, i):
            x = b.load(b.gep(src, [i]))
            return b.fadd(x, b.load(b.gep(bsrc, [i]))) if bias else x

        def inv_rms(src, bsrc, count: int):  # 1 / sqrt(mean((src + bias)^2) + eps) over `count` values
            acc = alloca_once(b, f32)
            b.store(cf(0.0), acc)
            with Loop(b, c64(0), c64(count), "ms") as i:
                x = biased(src, bsrc, i)
                b.store(b.fadd(b.load(acc), b.fmul(x, x)), acc)
            return b.fdiv(cf(1.0), b.call(sqrt, [b.fadd(b.fdiv(b.load(acc), cf(count)), cf(n.eps))]))

        def rope_into(src, bsrc, dst, norm=None):
            """dst[i] = rotate-half RoPE of (src + bias) at position pos; norm = (weights, 1/rms): normalised first."""
            with Loop(b, c64(0), c64(half), "rp") as i:
                ih = b.add(i, c64(half))
                x1, x2 = biased(src, bsrc, i), biased(src, bsrc, ih)
                if norm is not None:
                    w, inv = norm
                    x1 = b.fmul(b.fmul(x1, inv), b.load(b.gep(w, [i])))
                    x2 = b.fmul(b.fmul(x2, inv), b.load(b.gep(w, [ih])))
                cs, sn = b.load(b.gep(cos, [b.add(row, i)])), b.load(b.gep(sin, [b.add(row, i)]))
                b.store(b.fadd(b.fmul(x1, cs), b.fmul(b.fsub(cf(0.0), x2), sn)), b.gep(dst, [i]))
                b.store(b.fadd(b.fmul(x2, cs), b.fmul(x1, sn)), b.gep(dst, [ih]))

        def norm_of(off, src, bsrc, w, proj_inv):
            """(weights, 1/rms) of the head at `off` of a projection (src: the head; None without q/k norms)."""
            if qk_norm == "head":
                return w, inv_rms(src, bsrc, hd)
            if qk_norm == "proj":
                return b.gep(w, [off]), proj_inv
            return None

        def tree(vals):  # pairwise sum of a list of vectors, a fixed shape
            while len(vals) > 1:
                vals = [b.fadd(vals[j], vals[j + 1]) if j + 1 < len(vals) else vals[j] for j in range(0, len(vals), 2)]
            return vals[0]

        q_inv = k_inv = None
        if qk_norm == "proj":
            q_inv = inv_rms(b.gep(qkv, [c64(qo)]), bq, H * hd)
            k_inv = inv_rms(b.gep(qkv, [c64(ko)]), bk, KV * hd)

        npos = b.add(pos, c64(1))
        start = c64(0)
        if window:  # max(0, pos + 1 - window): the oldest position still inside the window
            lo = b.sub(npos, c64(window))
            start = b.select(b.icmp_signed(">", lo, c64(0)), lo, c64(0))
        esz = KV_BYTES[kv]
        upair = 2 if bf else 1  # entries per unit of the scans (bf16: pairs)
        kc8, vc8 = b.bitcast(kc, P(i8)), b.bitcast(vc, P(i8))

        def ahead(base8, at, nbytes):  # every line of the `nbytes` read from byte `at`, kv_prefetch bytes on
            if kv_prefetch:
                prefetch_lines(b, base8, [b.add(at, c64(kv_prefetch + 64 * i)) for i in range(-(-nbytes // 64))])
        RB = 32  # positions per block of the weighted sum (their V rows stay in L1 across the head groups)
        # The weighted sum reads each V row whole (all nc chunks), front to back, for a group of heads whose
        # rep x nc accumulators fit the registers; the next group re-reads the block from L1. Reading chunk by
        # chunk instead (a 128-byte stride through each 4 KiB block, four times) streamed V from DRAM at 11 GB/s
        # against 18 for K on Zen 5 (docs/journal/performance.md). Each accumulator sums its positions in the same
        # order.
        HG = max(1, min(rep, (16 if isa == ISA.AVX512VNNI else 4) // nc))  # accumulators: half the registers
        head_groups = [range(h, min(rep, h + HG)) for h in range(0, rep, HG)]
        bt = V(f32, B)
        mx = [alloca_once(b, bt) for _ in range(rep)]
        qk = [[alloca_once(b, bt) for _ in range(NP)] for _ in range(rep)]
        accs = [[alloca_once(b, vt) for _ in range(nc)] for _ in range(rep)]
        esum = [alloca_once(b, V(f32, L)) for _ in range(rep)]
        qr = b.bitcast(alloca_once(b, ir.ArrayType(f32, rep * hd)), P(f32))
        qbf = b.bitcast(alloca_once(b, ir.ArrayType(i32, rep * hd // 2)), P(i16)) if bf else None  # read as i32
        sbf = b.bitcast(scores, P(i16)) if bf else None  # kv='bf16': the weights as bf16, over the scores
        lane_ids = ir.Constant(V(i64, B), list(range(B)))
        ninf_b = const_vec(f32, B, -math.inf)
        pos_blk, pos_lane = b.udiv(pos, c64(B)), b.urem(pos, c64(B))
        # The two scans' units, by cache type. q.k: a K block's unit u (a dimension; bf16: a pair of them) as B lanes,
        # head r's query there, one multiply-add step. V sum: unit u's row (a position; bf16: a pair-row) in nc
        # chunks, head r's weight for it, one step.
        if bf:
            qk_units, QU = half, math.gcd(half, 4)

            def k_unit(blk, u):  # B lanes of i32: dimensions 2u, 2u+1 of B positions
                return b.load(b.bitcast(b.gep(kc, [b.add(blk, b.mul(u, c64(2 * B)))]), P(V(i32, B))), align=4)

            def q_unit(r, u):
                qp = b.gep(qbf, [b.add(c64(r * hd), b.mul(u, c64(2)))])
                return splat(b, b.load(b.bitcast(qp, P(i32)), align=4), B)

            def qk_step(kd, q, acc):
                return bf16_dot(b, acc, kd, q, bf16_hw, fma)

            def v_chunks(base, u):  # pair-row u: positions 2u, 2u+1 of every dimension, W dimensions per chunk
                row = b.add(base, b.mul(u, c64(2 * hd)))
                return [b.load(b.bitcast(b.gep(vc, [b.add(row, c64(2 * c * W))]), P(V(i32, W))), align=4)
                        for c in range(nc)]

            def weight(r, u):  # bf16 weights of positions 2u, 2u+1
                pp = b.gep(sbf, [b.add(c64(2 * r * SS), b.mul(u, c64(2)))])
                return splat(b, b.load(b.bitcast(pp, P(i32)), align=4), W)

            def v_step(vv, p, acc):
                return bf16_dot(b, acc, vv, p, bf16_hw, fma)
        else:
            qk_units, QU = hd, DU

            def k_unit(blk, u):
                return cload(kc, b.add(blk, b.mul(u, c64(B))), B)

            def q_unit(r, u):
                return splat(b, b.load(b.gep(qr, [b.add(c64(r * hd), u)])), B)

            def qk_step(kd, q, acc):
                return madd(q, kd, acc)

            def v_chunks(base, u):
                row = b.add(base, b.mul(u, c64(hd)))
                return [cload(vc, b.add(row, c64(c * W))) for c in range(nc)]

            def weight(r, u):
                return splat(b, b.load(b.gep(scores, [b.add(c64(r * SS), u)])), W)

            def v_step(vv, p, acc):
                return madd(p, vv, acc)

        kstep, vstep = QU * B * upair * esz, hd * upair * esz  # bytes per q.k step / per V unit

        def v_units():  # the V units [v_lo, v_hi) a scan covers: positions; bf16: pairs of them
            return (b.udiv(start, c64(2)), b.udiv(b.add(npos, c64(1)), c64(2))) if bf else (start, npos)

        def vector_weighted_sum(g, vbase, inv):
            """out_r = (sum_s p_r(s) v_s) * inv_r in vector accumulators: VB units at a time, each V row read whole
            by the first head group and from L1 by the others (RB above)."""
            for ar in accs:
                for a in ar:
                    b.store(const_vec(f32, W, 0.0), a)
            v_lo, v_hi = v_units()
            VB = RB // 2 if bf else RB
            with Loop(b, c64(0), b.udiv(b.add(b.sub(v_hi, v_lo), c64(VB - 1)), c64(VB)), "pb") as j:
                u_lo = b.add(v_lo, b.mul(j, c64(VB)))
                u_end = b.add(u_lo, c64(VB))
                u_hi = b.select(b.icmp_signed("<", u_end, v_hi), u_end, v_hi)
                for k, heads in enumerate(head_groups):
                    with Loop(b, u_lo, u_hi, f"pv{k}") as u:
                        if k == 0:  # the first head group reads the rows from memory, the others from L1
                            vp = b.mul(b.add(vbase, b.mul(u, c64(hd * upair))), c64(esz))
                            ahead(vc8, vp, vstep)
                        vvs = v_chunks(vbase, u)
                        for r in heads:
                            p = weight(r, u)
                            for c, vv in enumerate(vvs):
                                b.store(v_step(vv, p, b.load(accs[r][c])), accs[r][c])
            for r in range(rep):
                out = b.gep(att, [b.mul(b.add(b.mul(g, c64(rep)), c64(r)), c64(hd))])
                iv = splat(b, inv[r], W)
                for c in range(nc):
                    b.store(b.fmul(b.load(accs[r][c]), iv), b.bitcast(b.gep(out, [c64(c * W)]), P(vt)), align=4)

        def amx_weighted_sum(g, vbase, inv):
            """out_r = (sum_s p_r(s) v_s) * inv_r on the tile unit: per 16 pair-rows (32 positions) of V,
            A = the heads' bf16 weights of those positions, B = 16 dimensions of the rows, one output tile per 16
            dimensions accumulating over the whole scan. The last rows (fewer than 16) are copied into a zeroed
            buffer first: the tile always loads 16 rows, and those past the scan are another head's or outside
            the cache (their weights are 0, but 0 x a stale inf is NaN)."""
            v_lo, v_hi = v_units()
            nu = b.sub(v_hi, v_lo)
            nfull = b.udiv(nu, c64(16))
            sbf8, row_b = b.bitcast(sbf, P(i8)), 4 * hd  # bytes per V pair-row
            for c in range(hd // 16):
                _tile(b, "tilezero", T_O + c)

            def chunk(u0, vsrc):  # 16 pair-rows from u0, B read from vsrc (bytes)
                _tile(b, "tileloadd64", T_Q, b.gep(sbf8, [b.mul(u0, c64(4))]), c64(4 * SS))
                for c in range(hd // 16):
                    _tile(b, "tileloadd64", T_B, b.gep(vsrc, [c64(64 * c)]), c64(row_b))
                    _tile(b, "tdpbf16ps", T_O + c, T_Q, T_B)

            with Loop(b, c64(0), nfull, "pv") as j:
                u0 = b.add(v_lo, b.mul(j, c64(16)))
                vp = b.mul(b.add(vbase, b.mul(u0, c64(2 * hd))), c64(esz))
                ahead(vc8, vp, 16 * row_b)
                chunk(u0, b.gep(vc8, [vp]))
            u0 = b.add(v_lo, b.mul(nfull, c64(16)))
            rest = b.sub(nu, b.mul(nfull, c64(16)))
            with b.if_then(b.icmp_unsigned(">", rest, c64(0))):
                tb = b.bitcast(vtail, P(V(i32, 16)))
                for k in range(16 * row_b // 64):
                    b.store(const_vec(i32, 16, 0), b.gep(tb, [c64(k)]), align=64)
                src = b.gep(vc8, [b.mul(b.add(vbase, b.mul(u0, c64(2 * hd))), c64(esz))])
                with Loop(b, c64(0), rest, "vt") as i:
                    for k in range(row_b // 64):
                        at = b.add(b.mul(i, c64(row_b)), c64(64 * k))
                        v = b.load(b.bitcast(b.gep(src, [at]), P(V(i32, 16))), align=1)
                        b.store(v, b.bitcast(b.gep(b.bitcast(vtail, P(i8)), [at]), P(V(i32, 16))), align=64)
                chunk(u0, b.bitcast(vtail, P(i8)))
            out0 = b.gep(att, [b.mul(b.mul(g, c64(rep)), c64(hd))])  # the group's heads, hd floats apart
            for c in range(hd // 16):
                _tile(b, "tilestored64", T_O + c, b.gep(out0, [c64(16 * c)]), c64(4 * hd))
            for r in range(rep):
                iv = splat(b, inv[r], 16)
                for c in range(hd // 16):
                    at = b.bitcast(b.gep(out0, [c64(r * hd + 16 * c)]), P(V(f32, 16)))
                    b.store(b.fmul(b.load(at, align=4), iv), at, align=4)

        with Loop(b, g0, g1, "g") as g:
            goff = b.mul(g, c64(hd))
            kbase = b.mul(g, c64(nb * hd * B))  # this kv head's K blocks
            vbase = b.mul(g, c64(S2 * hd))  # and its V rows
            ksrc, kb = b.gep(qkv, [b.add(c64(ko), goff)]), b.gep(bk, [goff]) if bias else None
            rope_into(ksrc, kb, kr, norm_of(goff, ksrc, kb, kn, k_inv))
            # this position's K (roped) into its block, dimension d at d * B (a strided store: hd entries per
            # token, against hd * (pos + 1) read below) ...
            kpos = b.add(b.add(kbase, b.mul(pos_blk, c64(hd * B))), b.mul(pos_lane, c64(2 if bf else 1)))
            for c in range(nc):
                kv_ = vload(kr, c64(c * W))
                hv = float_to_bf16(b, kv_) if bf else float_to_half(b, kv_, isa) if half_kv else kv_
                for t in range(W):
                    d = c * W + t
                    at = (d - d % 2) * B + d % 2 if bf else d * B  # bf16: dimension pairs side by side
                    b.store(b.extract_element(hv, c32(t)), b.gep(kc, [b.add(kpos, c64(at))]))
            # ... and its V (+ bias) row after the previous positions' (bf16: interleaved with its pair's)
            if bf:
                odd = b.urem(pos, c64(2))
                vrow = b.add(b.add(vbase, b.mul(b.udiv(pos, c64(2)), c64(2 * hd))), odd)
                # The pair scan reads pos's partner pos + 1 with weight 0 before it is written; 0 x NaN is NaN, and a
                # slot keeps an earlier sequence's entries (Session.reset does not clear it), so an even position
                # zeroes its partner's V first (an odd one zeroes its own entries, then overwrites them).
                part = b.add(vrow, b.sub(c64(1), odd))  # even: pos + 1's entries; odd: its own
                for d in range(hd):
                    b.store(ir.Constant(i16, 0), b.gep(vc, [b.add(part, c64(2 * d))]))
            else:
                vrow = b.add(vbase, b.mul(pos, c64(hd)))
            for c in range(nc):
                v = vload(qkv, b.add(c64(vo + c * W), goff))
                if bias:
                    v = b.fadd(v, vload(bv, b.add(goff, c64(c * W))))
                if bf:
                    hv = float_to_bf16(b, v)
                    for t in range(W):
                        b.store(b.extract_element(hv, c32(t)), b.gep(vc, [b.add(vrow, c64(2 * (c * W + t)))]))
                else:
                    cstore(v, vc, b.add(vrow, c64(c * W)))
            with Loop(b, c64(0), c64(rep), "h") as r:  # the group's query heads, roped, side by side in qr
                hoff = b.mul(b.add(b.mul(g, c64(rep)), r), c64(hd))
                qsrc, qb = b.gep(qkv, [b.add(c64(qo), hoff)]), b.gep(bq, [hoff]) if bias else None
                rope_into(qsrc, qb, b.gep(qr, [b.mul(r, c64(hd))]), norm_of(hoff, qsrc, qb, qn, q_inv))
            if bf:  # the group's queries as bf16, W at a time: pair m of head r is the i32 at qbf[r * hd + 2m]
                with Loop(b, c64(0), c64(rep * hd // W), "qbf") as i:
                    b.store(float_to_bf16(b, vload(qr, b.mul(i, c64(W)))),
                            b.bitcast(b.gep(qbf, [b.mul(i, c64(W))]), P(V(i16, W))), align=2)
            if amx:  # the A tiles: head r's dimensions 32t .. 32t + 31 in row r of tile T_Q + t
                for t in range(hd // 32):
                    _tile(b, "tileloadd64", T_Q + t, b.gep(b.bitcast(qbf, P(i8)), [c64(64 * t)]), c64(2 * hd))
            for r in range(rep):
                b.store(ninf_b, mx[r])
            # scores[r][s] = q_r.k_s * scale for the blocks holding [start, pos]; lanes outside it -inf
            with Loop(b, b.udiv(start, c64(B)), b.add(pos_blk, c64(1)), "kb") as j:
                blk = b.add(kbase, b.mul(j, c64(hd * B)))
                if amx:  # the block's 16 scores of every head: row r of T_S, stored where the scores go
                    ahead(kc8, b.mul(blk, c64(esz)), hd * B * esz)
                    _tile(b, "tilezero", T_S)
                    for t in range(hd // 32):  # B: dimension pairs 16t .. 16t + 15 of the 16 positions
                        _tile(b, "tileloadd64", T_B, b.gep(kc8, [b.mul(b.add(blk, c64(32 * t * B)), c64(esz))]),
                              c64(64))
                        _tile(b, "tdpbf16ps", T_S, T_Q + t, T_B)
                    _tile(b, "tilestored64", T_S, b.gep(scores, [b.mul(j, c64(B))]), c64(4 * SS))
                else:  # q.k as multiply-add chains over the units
                    for r in range(rep):
                        for a_ in qk[r]:
                            b.store(const_vec(f32, B, 0.0), a_)
                    with Loop(b, c64(0), c64(qk_units // QU), "kd") as dd:
                        u0 = b.mul(dd, c64(QU))
                        kp = b.mul(b.add(blk, b.mul(u0, c64(B * upair))), c64(esz))
                        ahead(kc8, kp, kstep)
                        chains = [[b.load(a_) for a_ in qk[r]] for r in range(rep)]
                        for u in range(QU):
                            uu = b.add(u0, c64(u))
                            kd = k_unit(blk, uu)
                            for r in range(rep):
                                chains[r][u % NP] = qk_step(kd, q_unit(r, uu), chains[r][u % NP])
                        for r in range(rep):
                            for a_, x in zip(qk[r], chains[r]):
                                b.store(x, a_)
                s_ids = b.add(splat(b, b.mul(j, c64(B)), B), lane_ids)
                live = b.and_(b.icmp_signed(">=", s_ids, splat(b, start, B)),
                              b.icmp_signed("<", s_ids, splat(b, npos, B)))
                for r in range(rep):
                    at_r = b.bitcast(b.gep(scores, [b.add(c64(r * SS), b.mul(j, c64(B)))]), P(bt))
                    raw = b.load(at_r, align=4) if amx else tree([b.load(a_) for a_ in qk[r]])
                    sc = b.fmul(raw, const_vec(f32, B, scale))
                    if n.softcap:  # Gemma 2: scores -> cap * tanh(scores / cap) before the softmax (per lane)
                        for t in range(B):
                            sc = b.insert_element(sc, softcap(b, b.extract_element(sc, c32(t)), n.softcap), c32(t))
                    sc = b.select(live, sc, ninf_b)
                    b.store(sc, b.bitcast(b.gep(scores, [b.add(c64(r * SS), b.mul(j, c64(B)))]), P(bt)), align=4)
                    m0 = b.load(mx[r])
                    b.store(b.select(b.fcmp_ordered(">", sc, m0), sc, m0), mx[r])
            # exp(scores - max) of each head, ATT_LANES positions at a time from start (positions past pos masked
            # to -inf: exp gives 0, stored into the scratch's slack), summed lane-wise, then by the halving tree
            nchunk = b.udiv(b.add(b.sub(npos, start), c64(L - 1)), c64(L))
            inv = []
            for r in range(rep):
                mv = b.load(mx[r])
                mr = b.extract_element(mv, c32(0))
                for t in range(1, B):  # the max of the lanes (order does not matter for a max)
                    x = b.extract_element(mv, c32(t))
                    mr = b.select(b.fcmp_ordered(">", x, mr), x, mr)
                m_v = splat(b, mr, L)
                b.store(const_vec(f32, L, 0.0), esum[r])
                with Loop(b, c64(0), nchunk, "ex") as j:
                    s0 = b.add(start, b.mul(j, c64(L)))
                    sp = b.bitcast(b.gep(scores, [b.add(c64(r * SS), s0)]), P(V(f32, L)))
                    live = b.icmp_signed("<", b.add(splat(b, s0, L), ir.Constant(V(i64, L), list(range(L)))),
                                         splat(b, npos, L))
                    x = b.select(live, b.fsub(b.load(sp, align=4), m_v), const_vec(f32, L, -math.inf))
                    p = exp_vec(b, x, fma)
                    if bf:  # bf16(p) at i16 index s of the head's scratch: below the floats not yet read (p is 0
                        # or normal: exp_vec gives exactly 0 below -87.33, so the instruction's flush changes nothing)
                        b.store(float_to_bf16(b, p, bf16_hw), b.bitcast(b.gep(sbf, [b.add(c64(2 * r * SS), s0)]),
                                                               P(V(i16, L))), align=2)
                    else:
                        b.store(p, sp, align=4)
                    b.store(b.fadd(b.load(esum[r]), p), esum[r])
                inv.append(b.fdiv(cf(1.0), hsum(b, b.load(esum[r]))))
                if bf:  # the pair scan reads the neighbours of an odd start / end: their weights are 0
                    odd_start = b.icmp_unsigned("!=", b.urem(start, c64(2)), c64(0))
                    for at in (npos, b.select(odd_start, b.sub(start, c64(1)), npos)):
                        b.store(ir.Constant(i16, 0), b.gep(sbf, [b.add(c64(2 * r * SS), at)]))
                if amx:  # the tile reads 32 weights at a time: those past pos are 0 (the slots hold older floats)
                    b.store(const_vec(i16, 32, 0), b.bitcast(b.gep(sbf, [b.add(c64(2 * r * SS), npos)]),
                                                             P(V(i16, 32))), align=2)
            (amx_weighted_sum if amx else vector_weighted_sum)(g, vbase, inv)
        if amx:
            _tile(b, "tilerelease")
        b.ret_void()

    key = ("attn", H, KV, hd, qo, ko, vo, int(bias), "fma" if fma else "mul", kv, f"S{S}", f"pf{kv_prefetch}") + (
        ("amx" if amx else "bfhw",) if bf16_hw else ()) + (
        (qk_norm, _flt(n.eps)) if qk_norm else ()) + (
        (f"cap{_flt(n.softcap)}",) if n.softcap else ()) + ((f"win{window}",) if window else ())
    kvp = P(i16) if KV_BYTES[kv] == 2 else P(f32)
    return internal_function(m, key, (P(f32),) * 6 + (kvp, kvp) + (P(f32),) * 4 + (i64, i64, i64), build)


# --- persistent workers: woken per token by a futex, no Python in between ------------------------
def emit_workers(m: ir.Module, step: ir.Function, isa: str, worker_name: str, kick_name: str) -> None:
    """cflow_worker(ptrs, params, tid, nth, barrier, ctl): loop { wait until ctl.go changes; run the step }
    until ctl.stop; cflow_kick(ctl): start the next token (go += 1, wake the sleepers).

    A waiting worker spins briefly (the next token usually follows within microseconds), then sleeps
    in futex_wait, so an idle loaded model costs no CPU.
    """
    args = [a.type for a in step.args]
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), args + [P(i32)]), worker_name)
    fn.attributes.add("nounwind")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    *step_args, ctl = fn.args
    go_p, stop_p = b.gep(ctl, [c32(CtlWord.GO)]), b.gep(ctl, [c32(CtlWord.STOP)])
    seen = alloca_once(b, i32)
    spins = alloca_once(b, i64)
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
    pause(b, isa)
    n = b.add(b.load(spins), c64(1))
    b.store(n, spins)
    b.cbranch(b.icmp_signed(">", n, c64(SPINS)), sleep, poll)
    b.position_at_end(sleep)  # futex_wait returns at once if go already moved on: no lost wake-up
    _futex(b, go_p, FUTEX_WAIT_PRIVATE, b.sext(b.load(seen), i64))
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

    kick = ir.Function(m, ir.FunctionType(ir.VoidType(), [P(i32)]), kick_name)
    kick.attributes.add("nounwind")
    b = ir.IRBuilder(kick.append_basic_block("entry"))
    go_p = b.gep(kick.args[0], [c32(CtlWord.GO)])
    b.atomic_rmw("add", go_p, ir.Constant(i32, 1), "acq_rel")
    _futex(b, go_p, FUTEX_WAKE_PRIVATE, c64(1 << 30))
    b.ret_void()
