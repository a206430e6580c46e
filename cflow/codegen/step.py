"""The compiled decode step: one native function that runs a whole token, stage by stage.

Input: a lowered model (compiler.Compiled: IR, packed tensors, schedule) and an ISA. Output: an
llvmlite module with `cflow_step(ptrs, params, tid, nthreads, barrier)`. Every worker thread calls
it once per token; threads split each step's tile-rows (kv heads for attention), and meet at a
barrier in generated code after every stage. Shapes are constants; every address comes from the
pointer table `ptrs` (filled by the runtime after it validated the file), so the IR text - and the
cached object code - depends only on the model's shapes and schedule, not on where things live.

Per-thread scratch: the normalised activation, its int8 blocks, a temp vector, attention scores,
router probabilities and each layer's top-k choice (private: every thread routes for itself, the
same way, so no barrier is needed between routing and the expert mat-vecs).
"""

from __future__ import annotations

import math

import attrs
from llvmlite import ir

from ..errors import CodegenError
from ..ir import Attention, DenseFFN, ExpertBank
from ..ir.quant import BLOCK, DType, padded
from ..passes.tile import TileLayout
from . import kernels as K
from .kernels import _intrinsic, _Loop, _ptr

i8, i32, i64, f32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
P = ir.PointerType
STEP_ARGS = (P(P(i8)), P(i64), i64, i64, P(i32))
PARAM_TOKEN, PARAM_POS = 0, 1
SPINS = 4000  # pause rounds before a waiting thread starts yielding its core
BARRIER_INTS = 32  # count at [0], generation at [16]: separate cache lines


def alloca(b: ir.IRBuilder, ty, name: str = ""):
    """An alloca in the entry block (never inside a loop: the stack would grow every iteration)."""
    cur = b.block
    b.position_at_start(b.function.entry_basic_block)
    a = b.alloca(ty, name=name)
    b.position_at_end(cur)
    return a


def c64(v: int) -> ir.Constant:
    return ir.Constant(i64, int(v))


def cf(v: float) -> ir.Constant:
    return ir.Constant(f32, float(v))


@attrs.define
class ScratchLayout:
    """Byte offsets inside one thread's scratch area."""

    kmax: int
    dp: int
    max_seq: int
    n_experts: int
    top_k: int
    n_layers: int
    xn: int = 0
    xq: int = 0
    xd: int = 0
    xs: int = 0
    tmp: int = 0
    scores: int = 0
    probs: int = 0
    route: int = 0
    nbytes: int = 0

    def __attrs_post_init__(self):
        off = 0

        def take(n):
            nonlocal off
            start = off
            off = padded(off + n, 64)
            return start

        self.xn = take(4 * self.kmax)
        self.xq = take(self.kmax)
        self.xd = take(4 * (self.kmax // BLOCK))
        self.xs = take(4 * (self.kmax // BLOCK))
        self.tmp = take(4 * self.dp)
        self.scores = take(4 * self.max_seq)
        self.probs = take(4 * max(self.n_experts, 1))
        self.route = take(self.route_stride * (self.n_layers + 1))
        self.nbytes = padded(off, 4096)

    @property
    def route_stride(self) -> int:
        """Per layer: i32 idx[k], f32 w[k], f32 shared gate."""
        return padded(4 * (2 * self.top_k + 1), 16)


@attrs.frozen
class StepProgram:
    module: ir.Module
    bindings: tuple  # ptr-table index -> key: ("tensor", name) | ("pool", pool) | ("kv",) | ("cos",) | ("sin",) | ("scratch",)
    pool_strides: dict  # pool -> floats per slot (padded)
    pool_slots: dict  # pool -> slots
    scratch: ScratchLayout
    kv_floats_per_layer: int  # K (or V) cache floats for one layer
    max_seq: int
    isa: str


class _Emitter:
    def __init__(self, compiled, isa: str, max_seq: int):
        self.c = compiled
        self.g = compiled.graph
        self.cfg = self.g.config
        self.sched = compiled.schedule
        self.tensors = compiled.tensors
        self.isa = isa
        self.max_seq = max_seq
        self.m = ir.Module(name="cflow_step")
        self.bindings: list[tuple] = []
        self.index: dict[tuple, int] = {}
        self.fns: dict[tuple, ir.Function] = {}
        tile = next(iter(t.tile for t in self.tensors.values()))
        self.tr, self.tc = tile
        self.unit = math.lcm(self.tr, self.tc)
        cfg = self.cfg
        self.d, self.dp = cfg.d_model, padded(cfg.d_model, self.unit)
        kmax = self.dp
        for t in self.tensors.values():
            if t.form in ("tiled", "concat", "gate_up"):
                kmax = max(kmax, t.layout.cols_p, padded(t.layout.cols, self.unit))
        self.scratch = ScratchLayout(kmax=kmax, dp=self.dp, max_seq=max_seq, n_experts=cfg.n_experts,
                                     top_k=cfg.top_k, n_layers=cfg.n_layers)
        self.strides = self._pool_strides()

    # --- binding table ---------------------------------------------------------------------
    def slot(self, key: tuple) -> int:
        if key not in self.index:
            self.index[key] = len(self.bindings)
            self.bindings.append(key)
        return self.index[key]

    def pointer(self, b, key: tuple, ty=f32):
        p = b.load(b.gep(self.ptrs, [c64(self.slot(key))]), align=8)
        return b.bitcast(p, P(ty))

    def _pool_strides(self) -> dict:
        cfg, u = self.cfg, self.unit
        qkv = sum(t.concat.layout.rows_p for t in self.tensors.values() if t.form == "concat") and max(
            t.concat.layout.rows_p for t in self.tensors.values() if t.form == "concat")
        return {
            "stream": self.dp, "expert": self.dp, "qkv": padded(qkv, u),
            "attn": padded(cfg.n_heads * cfg.head_dim, u), "ffn_h": padded(max(cfg.ffn_dim, 1), u),
            "moe_h": cfg.top_k * padded(max(cfg.expert_dim, 1), u) + padded(max(cfg.shared_expert_dim, 1), u),
            "logits": padded(cfg.vocab_size, u),
        }

    def value_ptr(self, b, value: str):
        buf = self.sched.buffers[value]
        base = self.pointer(b, ("pool", buf.pool))
        return b.gep(base, [c64(buf.slot * self.strides[buf.pool])])

    def scratch_ptr(self, b, field: str, ty=f32):
        off = getattr(self.scratch, field)
        return b.bitcast(b.gep(self.my_scratch, [c64(off)]), P(ty))

    # --- helper functions (emitted once per specialisation) -------------------------------
    def _fn(self, key, args, build, ret=ir.VoidType()):
        fn = self.fns.get(key)
        if fn is None:
            name = "_".join(str(k) for k in key)
            fn = ir.Function(self.m, ir.FunctionType(ret, list(args)), name)
            fn.linkage = "internal"
            fn.attributes.add("nounwind")
            fn.attributes.add("noinline")
            self.fns[key] = fn
            b = ir.IRBuilder(fn.append_basic_block("entry"))
            build(b, *fn.args)
        return fn

    def matvec_fn(self, layout: TileLayout, gate_up: bool = False):
        key = ("mv", layout.dtype.label, layout.rows, layout.cols, layout.tr, layout.tc, int(gate_up))
        fn = self.fns.get(key)
        if fn is None:
            fn = K.emit_matvec(self.m, "_".join(map(str, key)), layout, self.isa, linkage="internal", gate_up=gate_up)
            self.fns[key] = fn
        return fn

    def quant_fn(self, cols: int, cols_p: int):
        key = ("quant", cols, cols_p)
        fn = self.fns.get(key)
        if fn is None:
            fn = K.emit_quantize_act(self.m, "_".join(map(str, key)), cols, cols_p, linkage="internal")
            self.fns[key] = fn
        return fn

    def rmsnorm_fn(self, n: int, n_pad: int, eps: float):
        def build(b, x, w, out):
            acc = alloca(b, f32)
            b.store(cf(0.0), acc)
            with _Loop(b, c64(0), c64(n), "ss") as i:
                v = b.load(b.gep(x, [i]))
                b.store(b.fadd(b.load(acc), b.fmul(v, v)), acc)
            sqrt = _intrinsic(self.m, "llvm.sqrt.f32", f32, [f32])
            ms = b.fadd(b.fdiv(b.load(acc), cf(n)), cf(eps))
            inv = b.fdiv(cf(1.0), b.call(sqrt, [ms]))
            with _Loop(b, c64(0), c64(n), "nx") as i:
                b.store(b.fmul(b.fmul(b.load(b.gep(x, [i])), inv), b.load(b.gep(w, [i]))), b.gep(out, [i]))
            with _Loop(b, c64(n), c64(n_pad), "nz") as i:
                b.store(cf(0.0), b.gep(out, [i]))
            b.ret_void()

        return self._fn(("rmsnorm", n, n_pad, repr(eps).replace(".", "p").replace("-", "m")), (P(f32),) * 3, build)

    def add_fn(self, arity: int):
        def build(b, out, *rest):
            ins, lo, hi = rest[:arity], rest[arity], rest[arity + 1]
            with _Loop(b, lo, hi, "r") as i:
                s = b.load(b.gep(ins[0], [i]))
                for p in ins[1:]:
                    s = b.fadd(s, b.load(b.gep(p, [i])))
                b.store(s, b.gep(out, [i]))
            b.ret_void()

        return self._fn(("add", arity), (P(f32),) * (arity + 1) + (i64, i64), build)

    def axpy_fn(self):
        """out[i] = (first ? 0 : out[i]) + a * x[i] over [lo, hi)."""

        def build(b, out, x, a, first, lo, hi):
            with _Loop(b, lo, hi, "r") as i:
                prev = b.select(b.icmp_signed("!=", first, c64(0)), cf(0.0), b.load(b.gep(out, [i])))
                b.store(b.fadd(prev, b.fmul(a, b.load(b.gep(x, [i])))), b.gep(out, [i]))
            b.ret_void()

        return self._fn(("axpy",), (P(f32), P(f32), f32, i64, i64, i64), build)

    def embed_fn(self, dtype: DType):
        d = self.d

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

        return self._fn(("embed", dtype.label, d), (P(i8), i64, P(f32), i64, i64), build)

    def barrier_fn(self):
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
            if self.isa != "generic":
                b.call(_intrinsic(self.m, "llvm.x86.sse2.pause", ir.VoidType(), []), [])
            n = b.add(b.load(spins), c64(1))
            b.store(n, spins)
            yield_bb = b.append_basic_block("yield")
            check = b.append_basic_block("check")
            b.cbranch(b.icmp_signed(">", n, c64(SPINS)), yield_bb, check)
            b.position_at_end(yield_bb)
            b.call(_sched_yield(self.m), [])
            b.branch(check)
            b.position_at_end(check)
            now = b.load_atomic(gen_p, "acquire", 4)
            b.cbranch(b.icmp_signed("==", now, gen), poll, done)
            b.position_at_end(done)
            b.ret_void()

        return self._fn(("barrier",), (P(i32), i64), build)

    def router_fn(self, n_experts: int, top_k: int, normalize: bool):
        d = self.d

        def build(b, x, w, probs, route):
            expf = _intrinsic(self.m, "llvm.exp.f32", f32, [f32])
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

        return self._fn(("router", n_experts, top_k, int(normalize), d), (P(f32), P(f32), P(f32), P(i8)), build)

    def sigmoid_dot_fn(self):
        d = self.d

        def build(b, w, x, out):
            s = alloca(b, f32)
            b.store(cf(0.0), s)
            with _Loop(b, c64(0), c64(d), "sg") as i:
                b.store(b.fadd(b.load(s), b.fmul(b.load(b.gep(w, [i])), b.load(b.gep(x, [i])))), s)
            expf = _intrinsic(self.m, "llvm.exp.f32", f32, [f32])
            g = b.fdiv(cf(1.0), b.fadd(cf(1.0), b.call(expf, [b.fsub(cf(0.0), b.load(s))])))
            b.store(g, out)
            b.ret_void()

        return self._fn(("sigmoid_dot", d), (P(f32), P(f32), P(f32)), build)

    def attention_fn(self, n: Attention, offsets: tuple[int, int, int]):
        """Single-token GQA over the cache for kv heads [g0, g1): bias, RoPE, cache write, softmax(qK)V."""
        H, KV, hd = n.n_heads, n.n_kv_heads, n.head_dim
        rep, half = H // KV, hd // 2
        qo, ko, vo = offsets
        scale = 1.0 / math.sqrt(hd)
        bias = n.bias

        def build(b, qkv, bq, bk, bv, kc, vc, cos, sin, att, scores, pos, g0, g1):
            expf = _intrinsic(self.m, "llvm.exp.f32", f32, [f32])
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
        return self._fn(key, (P(f32),) * 10 + (i64, i64, i64), build)

    # --- the step function --------------------------------------------------------------------
    def rows(self, b, n_tile_rows: int):
        """This thread's tile-row range [lo, hi) of a matrix with n_tile_rows tile-rows."""
        lo = b.udiv(b.mul(c64(n_tile_rows), self.tid), self.nth)
        hi = b.udiv(b.mul(c64(n_tile_rows), b.add(self.tid, c64(1))), self.nth)
        return lo, hi

    def d_rows(self, b):
        # NOTE: the same tile-row split as every mat-vec with d outputs (Wo, down, experts): a thread's
        # residual adds then touch only rows it produced itself, so they need no barrier.
        lo, hi = self.rows(b, padded(self.d, self.tr) // self.tr)
        return b.mul(lo, c64(self.tr)), b.mul(hi, c64(self.tr))

    def prologue(self, b, step, layout_cols: int, quantised: bool):
        """Normalise (or copy) the step's input into this thread's xn, then int8-quantise it if needed."""
        src = step.full_reads[0]
        xn = self.scratch_ptr(b, "xn")
        cols_p = padded(layout_cols, self.tc)
        if step.norm:
            norm_w = self.pointer(b, ("tensor", step.norm))
            b.call(self.rmsnorm_fn(self.d, max(cols_p, self.dp), self.cfg.norm_eps), [self.value_ptr(b, src), norm_w, xn])
        if quantised:
            b.call(self.quant_fn(layout_cols, cols_p),
                   [xn, self.scratch_ptr(b, "xq", i8), self.scratch_ptr(b, "xd"), self.scratch_ptr(b, "xs", i32)])
        return xn

    def call_mv(self, b, layout, w, x, out, lo, hi, gate_up=False):
        b.call(self.matvec_fn(layout, gate_up),
               [w, x, self.scratch_ptr(b, "xq", i8), self.scratch_ptr(b, "xd"), self.scratch_ptr(b, "xs", i32), out, lo, hi])

    def quantise_input(self, b, x, cols: int, dtype: DType):
        if dtype in (DType.Q4, DType.Q8):
            b.call(self.quant_fn(cols, padded(cols, self.tc)),
                   [x, self.scratch_ptr(b, "xq", i8), self.scratch_ptr(b, "xd"), self.scratch_ptr(b, "xs", i32)])

    def emit(self) -> StepProgram:
        fn = ir.Function(self.m, ir.FunctionType(ir.VoidType(), list(STEP_ARGS)), "cflow_step")
        fn.attributes.add("nounwind")
        self.ptrs, self.params, self.tid, self.nth, self.bar = fn.args
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        self.my_scratch = b.gep(b.load(b.gep(self.ptrs, [c64(self.slot(("scratch",)))])),
                                [b.mul(self.tid, c64(self.scratch.nbytes))])
        self.token = b.load(b.gep(self.params, [c64(PARAM_TOKEN)]))
        self.pos = b.load(b.gep(self.params, [c64(PARAM_POS)]))
        for si, stage in enumerate(self.sched.stages):
            for step in stage:
                getattr(self, f"step_{step.phase}")(b, step)
            if si + 1 < len(self.sched.stages):
                b.call(self.barrier_fn(), [self.bar, self.nth])
        b.ret_void()
        return StepProgram(module=self.m, bindings=tuple(self.bindings), pool_strides=self.strides,
                           pool_slots={p: n for p, (n, _) in self.sched.pools.items()}, scratch=self.scratch,
                           kv_floats_per_layer=self.max_seq * self.cfg.n_kv_heads * self.cfg.head_dim,
                           max_seq=self.max_seq, isa=self.isa)

    # one method per step phase ------------------------------------------------------------------
    def step_embed(self, b, step):
        t = self.tensors[step.tensors[0]]
        lo, hi = self.d_rows(b)
        b.call(self.embed_fn(t.dtype), [self.pointer(b, ("tensor", t.name), i8), self.token, self.value_ptr(b, step.writes[0]), lo, hi])

    def step_add(self, b, step):
        lo, hi = self.d_rows(b)
        b.call(self.add_fn(len(step.row_reads)), [self.value_ptr(b, step.writes[0])] + [self.value_ptr(b, v) for v in step.row_reads] + [lo, hi])

    def step_qkv(self, b, step):
        t = self.tensors[step.tensors[0]]
        L = t.concat.layout
        x = self.prologue(b, step, L.cols, t.dtype in (DType.Q4, DType.Q8))
        lo, hi = self.rows(b, L.n_tile_rows)
        self.call_mv(b, L, self.pointer(b, ("tensor", t.name), i8), x, self.value_ptr(b, step.writes[0]), lo, hi)

    def step_core(self, b, step):
        n = self.g[step.op]
        t = self.tensors[f"{n.prefix}.wqkv"]
        offs = t.concat.row_offsets
        layer = n.layer
        kv = self.pointer(b, ("kv",))
        per = self.max_seq * n.n_kv_heads * n.head_dim
        kc = b.gep(kv, [c64((layer - 1) * 2 * per)])
        vc = b.gep(kv, [c64(((layer - 1) * 2 + 1) * per)])
        null = ir.Constant(P(f32), None)
        bq, bk, bv = ((self.pointer(b, ("tensor", f"{n.prefix}.{x}")) for x in ("bq", "bk", "bv")) if n.bias
                      else (null, null, null))
        g0 = b.udiv(b.mul(c64(n.n_kv_heads), self.tid), self.nth)
        g1 = b.udiv(b.mul(c64(n.n_kv_heads), b.add(self.tid, c64(1))), self.nth)
        b.call(self.attention_fn(n, tuple(offs)),
               [self.value_ptr(b, step.full_reads[0]), bq, bk, bv, kc, vc, self.pointer(b, ("cos",)),
                self.pointer(b, ("sin",)), self.value_ptr(b, step.writes[0]), self.scratch_ptr(b, "scores"),
                self.pos, g0, g1])

    def _down(self, b, t, x_value_ptr, cols: int, out, lo=None, hi=None):
        L = t.layout
        self.quantise_input(b, x_value_ptr, cols, t.dtype)
        if lo is None:
            lo, hi = self.rows(b, L.n_tile_rows)
        self.call_mv(b, L, self.pointer(b, ("tensor", t.name), i8), x_value_ptr, out, lo, hi)

    def step_o(self, b, step):
        n = self.g[step.op]
        self._down(b, self.tensors[step.tensors[0]], self.value_ptr(b, step.full_reads[0]), n.n_heads * n.head_dim,
                   self.value_ptr(b, step.writes[0]))

    def step_up(self, b, step):
        n = self.g[step.op]
        if isinstance(n, DenseFFN):
            t = self.tensors[step.tensors[0]]
            L = t.layout
            x = self.prologue(b, step, L.cols, t.dtype in (DType.Q4, DType.Q8))
            lo, hi = self.rows(b, L.n_tile_rows)
            self.call_mv(b, L, self.pointer(b, ("tensor", t.name), i8), x, self.value_ptr(b, step.writes[0]), lo, hi, gate_up=True)
            return
        assert isinstance(n, ExpertBank)
        router = self.g[n.inputs[1]]
        gu0 = self.tensors[f"{n.prefix}.experts.0.w_gate_up"]
        L = gu0.layout
        x = self.prologue(b, step, L.cols, False)
        route = b.gep(self.scratch_ptr(b, "route", i8), [c64(n.layer * self.scratch.route_stride)])
        b.call(self.router_fn(n.n_experts, n.top_k, router.normalize),
               [x, self.pointer(b, ("tensor", router.weight)), self.scratch_ptr(b, "probs"), route])
        self.quantise_input(b, x, L.cols, gu0.dtype)
        h = self.value_ptr(b, step.writes[0])
        ip = padded(n.hidden, self.unit)
        lo, hi = self.rows(b, L.n_tile_rows)
        idx = b.bitcast(route, P(i32))
        for j in range(n.top_k):
            e = b.sext(b.load(b.gep(idx, [c64(j)])), i64)
            w = self.expert_pointer(b, n, "w_gate_up", e)
            self.call_mv(b, L, w, x, b.gep(h, [c64(j * ip)]), lo, hi, gate_up=True)
        if n.shared_hidden:
            st = self.tensors[f"{n.prefix}.shared.w_gate_up"]
            lo_s, hi_s = self.rows(b, st.layout.n_tile_rows)
            self.call_mv(b, st.layout, self.pointer(b, ("tensor", st.name), i8), x, b.gep(h, [c64(n.top_k * ip)]),
                         lo_s, hi_s, gate_up=True)
            gate_out = b.gep(b.bitcast(route, P(f32)), [c64(2 * n.top_k)])
            if n.shared_gate:
                b.call(self.sigmoid_dot_fn(), [self.pointer(b, ("tensor", f"{n.prefix}.shared_gate")), x, gate_out])
            else:
                b.store(cf(1.0), gate_out)

    def expert_pointer(self, b, n: ExpertBank, which: str, e):
        """Pointer to expert e's tensor: one table entry per expert, so only the chosen ones are touched."""
        base = self.slot(("tensor", f"{n.prefix}.experts.0.{which}"))
        for k in range(1, n.n_experts):
            if self.slot(("tensor", f"{n.prefix}.experts.{k}.{which}")) != base + k:
                raise CodegenError("expert pointer table is not contiguous")
        p = b.load(b.gep(self.ptrs, [b.add(c64(base), e)]), align=8)
        return p

    def step_down(self, b, step):
        n = self.g[step.op]
        out = self.value_ptr(b, step.writes[0])
        h = self.value_ptr(b, step.full_reads[0])
        if isinstance(n, DenseFFN):
            self._down(b, self.tensors[step.tensors[0]], h, n.hidden, out)
            return
        assert isinstance(n, ExpertBank)
        # reserve contiguous pointer-table entries for every expert's down matrix, in order
        for k in range(n.n_experts):
            self.slot(("tensor", f"{n.prefix}.experts.{k}.w_down"))
        t0 = self.tensors[f"{n.prefix}.experts.0.w_down"]
        L = t0.layout
        route = b.gep(self.scratch_ptr(b, "route", i8), [c64(n.layer * self.scratch.route_stride)])
        idx, wts = b.bitcast(route, P(i32)), b.gep(b.bitcast(route, P(f32)), [c64(n.top_k)])
        tmp = self.scratch_ptr(b, "tmp")
        lo, hi = self.rows(b, L.n_tile_rows)
        rlo, rhi = b.mul(lo, c64(self.tr)), b.mul(hi, c64(self.tr))
        ip = padded(n.hidden, self.unit)
        for j in range(n.top_k):
            e = b.sext(b.load(b.gep(idx, [c64(j)])), i64)
            x = b.gep(h, [c64(j * ip)])
            self.quantise_input(b, x, n.hidden, t0.dtype)
            self.call_mv(b, L, self.expert_pointer(b, n, "w_down", e), x, tmp, lo, hi)
            b.call(self.axpy_fn(), [out, tmp, b.load(b.gep(wts, [c64(j)])), c64(1 if j == 0 else 0), rlo, rhi])
        if n.shared_hidden:
            st = self.tensors[f"{n.prefix}.shared.w_down"]
            x = b.gep(h, [c64(n.top_k * ip)])
            self.quantise_input(b, x, n.shared_hidden, st.dtype)
            self.call_mv(b, st.layout, self.pointer(b, ("tensor", st.name), i8), x, tmp, lo, hi)
            gate = b.load(b.gep(b.bitcast(route, P(f32)), [c64(2 * n.top_k)]))
            b.call(self.axpy_fn(), [out, tmp, gate, c64(0), rlo, rhi])

    def step_head(self, b, step):
        t = self.tensors[step.tensors[0]]
        L = t.layout
        x = self.prologue(b, step, L.cols, t.dtype in (DType.Q4, DType.Q8))
        lo, hi = self.rows(b, L.n_tile_rows)
        self.call_mv(b, L, self.pointer(b, ("tensor", t.name), i8), x, self.value_ptr(b, step.writes[0]), lo, hi)


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


def emit_step(compiled, isa: str, max_seq: int) -> StepProgram:
    """Build the decode-step module for a lowered model (see module docstring)."""
    if max_seq < 1:
        raise CodegenError(f"max_seq must be >= 1, got {max_seq}")
    em = _Emitter(compiled, isa, max_seq)
    # Expert tables first, so each bank's pointers are contiguous whatever order steps use them in.
    for n in compiled.graph.nodes():
        if isinstance(n, ExpertBank):
            for which in ("w_gate_up", "w_down"):
                for e in range(n.n_experts):
                    em.slot(("tensor", f"{n.prefix}.experts.{e}.{which}"))
    return em.emit()


def emit_step_ir(compiled, isa: str | None = None, max_seq: int | None = None) -> str:
    """The LLVM IR text of the decode step (`cflowc --emit llvm`)."""
    from .target import host_target

    isa = isa or host_target().isa
    return str(emit_step(compiled, isa, max_seq or compiled.graph.config.max_seq_len).module)
