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
from ..ir import DenseFFN, ExpertBank
from ..ir.quant import BLOCK, DType, padded
from ..passes.tile import TileLayout
from . import kernels as K
from . import ops as O
from .ops import c64, cf

i8, i32, i64, f32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
P = ir.PointerType
STEP_ARGS = (P(P(i8)), P(i64), i64, i64, P(i32))
PARAM_TOKEN, PARAM_POS = 0, 1
BARRIER_INTS = 32  # count at [0], generation at [16]: separate cache lines


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
    module: object  # ir.Module when freshly emitted, or the IR text read back from the program cache
    bindings: tuple  # ptr-table index -> key: ("tensor", name) | ("pool", pool) | ("kv",) | ("cos",) | ("sin",) | ("scratch",) | ("prof",)
    pool_strides: dict  # pool -> floats per slot (padded)
    pool_slots: dict  # pool -> slots
    scratch: ScratchLayout
    kv_floats_per_layer: int  # K (or V) cache floats for one layer
    max_seq: int
    isa: str

    def meta(self) -> dict:
        """Everything but the module, JSON-able (the program cache stores it beside the IR text)."""
        return {"bindings": [list(b) for b in self.bindings], "pool_strides": self.pool_strides,
                "pool_slots": self.pool_slots, "scratch": attrs.asdict(self.scratch),
                "kv_floats_per_layer": self.kv_floats_per_layer, "max_seq": self.max_seq, "isa": self.isa}

    @classmethod
    def from_meta(cls, ir_text: str, m: dict) -> "StepProgram":
        sc = m["scratch"]
        scratch = ScratchLayout(**{k: sc[k] for k in ("kmax", "dp", "max_seq", "n_experts", "top_k", "n_layers")})
        if attrs.asdict(scratch) != sc:
            raise ValueError("stored scratch layout does not match this version")
        return cls(module=ir_text, bindings=tuple(tuple(b) for b in m["bindings"]), pool_strides=m["pool_strides"],
                   pool_slots=m["pool_slots"], scratch=scratch, kv_floats_per_layer=m["kv_floats_per_layer"],
                   max_seq=m["max_seq"], isa=m["isa"])


class _Emitter:
    def __init__(self, compiled, isa: str, max_seq: int, profile: bool = False):
        self.profile = profile
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

    # --- kernels (emitted once per specialisation) ---------------------------------------
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
            b.call(O.rmsnorm(self.m, self.d, max(cols_p, self.dp), self.cfg.norm_eps), [self.value_ptr(b, src), norm_w, xn])
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
        # NOTE: the body is internal: several loaded models share one process, and MCJIT resolves
        # external symbols by name across engines, so a call to an external "cflow_step" from this
        # module's worker loop could land in another model's step. Only thin wrappers are exported.
        fn = ir.Function(self.m, ir.FunctionType(ir.VoidType(), list(STEP_ARGS)), "cflow_step_body")
        fn.linkage = "internal"
        fn.attributes.add("nounwind")
        self.ptrs, self.params, self.tid, self.nth, self.bar = fn.args
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        self.my_scratch = b.gep(b.load(b.gep(self.ptrs, [c64(self.slot(("scratch",)))])),
                                [b.mul(self.tid, c64(self.scratch.nbytes))])
        self.token = b.load(b.gep(self.params, [c64(PARAM_TOKEN)]))
        self.pos = b.load(b.gep(self.params, [c64(PARAM_POS)]))
        n = len(self.sched.stages)
        self.stamp(b, 0)
        for si, stage in enumerate(self.sched.stages):
            for step in stage:
                getattr(self, f"step_{step.phase}")(b, step)
            # The last stage ends with a barrier too: when worker 0 returns, every worker is done.
            b.call(O.barrier(self.m, self.isa), [self.bar, self.nth])
            self.stamp(b, si + 1)
        b.ret_void()
        entry = ir.Function(self.m, ir.FunctionType(ir.VoidType(), list(STEP_ARGS)), "cflow_step")
        entry.attributes.add("nounwind")
        eb = ir.IRBuilder(entry.append_basic_block("entry"))
        eb.call(fn, list(entry.args))
        eb.ret_void()
        O.emit_workers(self.m, fn, self.isa)
        return StepProgram(module=self.m, bindings=tuple(self.bindings), pool_strides=self.strides,
                           pool_slots={p: n for p, (n, _) in self.sched.pools.items()}, scratch=self.scratch,
                           kv_floats_per_layer=self.max_seq * self.cfg.n_kv_heads * self.cfg.head_dim,
                           max_seq=self.max_seq, isa=self.isa)

    def stamp(self, b, i: int) -> None:
        """Profiling builds: worker 0 records the cycle counter after stage i-1's barrier in prof[i]."""
        if not self.profile:
            return
        prof = self.pointer(b, ("prof",), i64)
        now = b.call(O._intrinsic(self.m, "llvm.readcyclecounter", i64, []), [])
        with b.if_then(b.icmp_signed("==", self.tid, c64(0))):  # only worker 0 writes: no race
            b.store(now, b.gep(prof, [c64(i)]))

    # one method per step phase ------------------------------------------------------------------
    def step_embed(self, b, step):
        t = self.tensors[step.tensors[0]]
        lo, hi = self.d_rows(b)
        b.call(O.embed(self.m, t.dtype, self.d), [self.pointer(b, ("tensor", t.name), i8), self.token, self.value_ptr(b, step.writes[0]), lo, hi])

    def step_add(self, b, step):
        lo, hi = self.d_rows(b)
        b.call(O.add_rows(self.m, len(step.row_reads)), [self.value_ptr(b, step.writes[0])] + [self.value_ptr(b, v) for v in step.row_reads] + [lo, hi])

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
        b.call(O.attention(self.m, n, tuple(offs)),
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
        b.call(O.router(self.m, self.d, n.n_experts, n.top_k, router.normalize),
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
                b.call(O.sigmoid_dot(self.m, self.d), [self.pointer(b, ("tensor", f"{n.prefix}.shared_gate")), x, gate_out])
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
            b.call(O.axpy(self.m), [out, tmp, b.load(b.gep(wts, [c64(j)])), c64(1 if j == 0 else 0), rlo, rhi])
        if n.shared_hidden:
            st = self.tensors[f"{n.prefix}.shared.w_down"]
            x = b.gep(h, [c64(n.top_k * ip)])
            self.quantise_input(b, x, n.shared_hidden, st.dtype)
            self.call_mv(b, st.layout, self.pointer(b, ("tensor", st.name), i8), x, tmp, lo, hi)
            gate = b.load(b.gep(b.bitcast(route, P(f32)), [c64(2 * n.top_k)]))
            b.call(O.axpy(self.m), [out, tmp, gate, c64(0), rlo, rhi])

    def step_head(self, b, step):
        t = self.tensors[step.tensors[0]]
        L = t.layout
        x = self.prologue(b, step, L.cols, t.dtype in (DType.Q4, DType.Q8))
        lo, hi = self.rows(b, L.n_tile_rows)
        self.call_mv(b, L, self.pointer(b, ("tensor", t.name), i8), x, self.value_ptr(b, step.writes[0]), lo, hi)


def emit_step(compiled, isa: str, max_seq: int, profile: bool = False) -> StepProgram:
    """Build the decode-step module for a lowered model (see module docstring).

    profile: also record a cycle-counter stamp after every stage (binding ("prof",): i64[n_stages + 1]).
    """
    if max_seq < 1:
        raise CodegenError(f"max_seq must be >= 1, got {max_seq}")
    em = _Emitter(compiled, isa, max_seq, profile)
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

    target = host_target()
    mod = emit_step(compiled, isa or target.isa, max_seq or compiled.graph.config.max_seq_len).module
    mod.triple = target.triple
    return str(mod)
