"""The compiled step: one native function that runs a whole token (or a block of tokens), stage by stage.

Input: a lowered model (passes.state.CompileState: IR, packed tensors, schedule) and an ISA. Output:
an llvmlite module with `cflow_step(ptrs, params, tid, nthreads, barrier)` (the ABI: codegen/abi.py).
Every worker thread calls it once per token (or per block of prompt tokens: params[MODE] = PREFILL);
threads split each step's tile-rows (kv heads for attention), and meet at a barrier in generated code
after every stage. Shapes are constants; every address comes from the pointer table `ptrs` (filled by
the runtime after it validated the file), so the IR text - and the cached object code - depends only
on the model's shapes and schedule, not on where things live.

Per-thread scratch: the normalised activation, its int8 blocks, a temp vector, attention scores,
router probabilities and each layer's top-k choice (private: every thread routes for itself, the
same way, so no barrier is needed between routing and the expert mat-vecs). The multi-token body
keeps a copy of the per-token fields for every token of the block (abi.ScratchLayout).
"""

from __future__ import annotations

import contextlib
import math

import attrs
from llvmlite import ir

from ..errors import CodegenError
from ..ir import DenseFFN, ExpertBank
from ..layout.packed import Form
from ..layout.quant import BLOCK, DType, padded
from ..layout.tile import TileLayout
from ..passes.manager import Pass, state_pass
from ..passes.pack import expert_tensor, qkv_tensor, shared_tensor
from ..passes.schedule import Phase, Pool
from . import kernels as K
from . import ops as O
from .abi import KICK_SYMBOL, STEP_SYMBOL, WORKER_SYMBOL, Binding, BindingKey, Mode, Param, ScratchLayout
from .cgutils import Loop, P, c64, cf, f32, i8, i32, i64, intrinsic, void
from .target import ISA

STEP_ARGS = (P(P(i8)), P(i64), i64, i64, P(i32))  # see abi.py: ptrs, params, tid, nthreads, barrier


def tensor_key(name: str) -> BindingKey:
    return BindingKey(Binding.TENSOR, name)


@attrs.frozen
class StepProgram:
    module: object  # ir.Module when freshly emitted, or the IR text read back from the program cache
    bindings: tuple[BindingKey, ...]  # pointer-table index -> what it points at
    pool_strides: dict[Pool, int]  # floats per slot (padded)
    pool_slots: dict[Pool, int]  # slots per pool
    scratch: ScratchLayout
    kv_floats_per_layer: int  # K (or V) cache floats for one layer
    max_seq: int
    isa: ISA

    def meta(self) -> dict:
        """Everything but the module, JSON-able (the program cache stores it beside the IR text)."""
        return {"bindings": [k.to_json() for k in self.bindings],
                "pool_strides": {str(p): n for p, n in self.pool_strides.items()},
                "pool_slots": {str(p): n for p, n in self.pool_slots.items()}, "scratch": self.scratch.to_json(),
                "kv_floats_per_layer": self.kv_floats_per_layer, "max_seq": self.max_seq, "isa": str(self.isa)}

    @classmethod
    def from_meta(cls, ir_text: str, m: dict) -> StepProgram:
        return cls(module=ir_text, bindings=tuple(BindingKey.from_json(b) for b in m["bindings"]),
                   pool_strides={Pool(p): n for p, n in m["pool_strides"].items()},
                   pool_slots={Pool(p): n for p, n in m["pool_slots"].items()},
                   scratch=ScratchLayout.from_json(m["scratch"]), kv_floats_per_layer=m["kv_floats_per_layer"],
                   max_seq=m["max_seq"], isa=ISA(m["isa"]))


class _Emitter:
    def __init__(self, compiled, isa: ISA, max_seq: int, profile: bool = False, segmented: bool = False,
                 tmax: int = 1):
        self.profile = profile
        self.tmax = tmax  # tokens per prefill call (1: a decode-only program)
        self.multi = False  # emitting the multi-token body (prefill) rather than the decode step
        self.t = None  # the token index inside a multi-token loop (an IR value), else None: token 0
        self.c = compiled
        self.g = compiled.graph
        self.cfg = self.g.config
        self.sched = compiled.schedule
        self.tensors = compiled.tensors
        self.isa = ISA.parse(isa)
        self.max_seq = max_seq
        self.m = ir.Module(name="cflow_step")
        self.bindings: list[BindingKey] = []
        self.index: dict[BindingKey, int] = {}
        self.fns: dict[tuple, ir.Function] = {}
        tile = next(iter(t.tile for t in self.tensors.values()))
        self.tr, self.tc = tile
        self.unit = math.lcm(self.tr, self.tc)
        cfg = self.cfg
        self.d, self.dp = cfg.d_model, padded(cfg.d_model, self.unit)
        kmax = self.dp
        for t in self.tensors.values():
            if t.form.is_tiled:
                kmax = max(kmax, t.layout.cols_p, padded(t.layout.cols, self.unit))
        self.scratch = ScratchLayout(kmax=kmax, dp=self.dp, max_seq=max_seq, n_experts=cfg.n_experts,
                                     top_k=cfg.top_k, n_layers=cfg.n_layers, tmax=tmax)
        self.strides = self._pool_strides()
        self.routed_apart = {st.op for st in self.sched.steps() if st.phase == Phase.ROUTE}
        self.segmented = segmented

    # --- binding table ---------------------------------------------------------------------
    def slot(self, key: BindingKey) -> int:
        if key not in self.index:
            self.index[key] = len(self.bindings)
            self.bindings.append(key)
        return self.index[key]

    def pointer(self, b, key: BindingKey, ty=f32):
        p = b.load(b.gep(self.ptrs, [c64(self.slot(key))]), align=8)
        return b.bitcast(p, P(ty))

    def _pool_strides(self) -> dict:
        cfg, u = self.cfg, self.unit
        qkv = max((t.concat.layout.rows_p for t in self.tensors.values() if t.form == Form.CONCAT), default=0)
        return {
            Pool.STREAM: self.dp, Pool.EXPERT: self.dp, Pool.QKV: padded(qkv, u),
            Pool.ATTN: padded(cfg.n_heads * cfg.head_dim, u), Pool.FFN_H: padded(max(cfg.ffn_dim, 1), u),
            Pool.MOE_H: cfg.top_k * padded(max(cfg.expert_dim, 1), u) + padded(max(cfg.shared_expert_dim, 1), u),
            Pool.LOGITS: padded(cfg.vocab_size, u),
        }

    def value_ptr(self, b, value: str):
        """Token self.t's row of a value (a pool slot holds tmax rows of its stride)."""
        buf = self.sched.buffers[value]
        base = self.pointer(b, BindingKey(Binding.POOL, buf.pool))
        stride = self.strides[buf.pool]
        p = b.gep(base, [c64(buf.slot * self.tmax * stride)])
        return p if self.t is None else b.gep(p, [b.mul(self.t, c64(stride))])

    def scratch_ptr(self, b, field: str, ty=f32):
        """This thread's scratch field; the per-token fields (xn, xq, xd, xs, route) at token self.t."""
        off = getattr(self.scratch, field)
        p = b.gep(self.my_scratch, [c64(off)])
        if self.t is not None and field in ScratchLayout.PER_TOKEN:
            p = b.gep(p, [b.mul(self.t, c64(self.scratch.token_bytes(field)))])
        return b.bitcast(p, P(ty))

    @contextlib.contextmanager
    def each_token(self, b, first=None):
        """Emit the body once per token [first, ntok) of a multi-token call (self.t = the token), or once."""
        if not self.multi:
            yield
            return
        with Loop(b, first if first is not None else c64(0), self.ntok, "tok") as t:
            self.t = t
            try:
                yield
            finally:
                self.t = None

    # --- kernels (emitted once per specialisation) ---------------------------------------
    def matmat_fn(self, layout: TileLayout, gate_up: bool = False):
        # NOTE: keyed without the row count: one mat-mat serves every matrix of a width (JIT time).
        key = ("mm", layout.dtype.label, layout.cols, layout.tr, layout.tc, int(gate_up))
        fn = self.fns.get(key)
        if fn is None:
            fn = K.emit_matmat(self.m, "_".join(map(str, key)), layout, self.isa, self.scratch.kmax,
                               tail=self.matvec_fn(layout, gate_up), linkage="internal", gate_up=gate_up)
            self.fns[key] = fn
        return fn

    def matvec_fn(self, layout: TileLayout, gate_up: bool = False):
        key = ("mv", layout.dtype.label, layout.cols, layout.tr, layout.tc, int(gate_up))  # rows: no matter
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
            norm_w = self.pointer(b, tensor_key(step.norm))
            b.call(O.rmsnorm(self.m, self.d, max(cols_p, self.dp), self.cfg.norm_eps),
                   [self.value_ptr(b, src), norm_w, xn])
        if quantised:
            b.call(self.quant_fn(layout_cols, cols_p),
                   [xn, self.scratch_ptr(b, "xq", i8), self.scratch_ptr(b, "xd"), self.scratch_ptr(b, "xs", i32)])
        return xn

    def call_mv(self, b, layout, w, x, out, lo, hi, gate_up=False, x_stride=None, y_stride=None, first=None):
        """out = W x for this thread's tile-rows: one token (decode, or inside a token loop), or, in a
        multi-token body outside a token loop, every token [first, ntok) through the mat-mat kernel
        (x and out then point at token 0's row; x_stride, y_stride: floats between tokens' rows)."""
        xq, xd, xs = self.scratch_ptr(b, "xq", i8), self.scratch_ptr(b, "xd"), self.scratch_ptr(b, "xs", i32)
        if not self.multi or self.t is not None:
            b.call(self.matvec_fn(layout, gate_up), [w, x, xq, xd, xs, out, lo, hi])
            return
        kmax = self.scratch.kmax
        n = self.ntok
        if first is not None:
            x, out = b.gep(x, [b.mul(first, c64(x_stride))]), b.gep(out, [b.mul(first, c64(y_stride))])
            xq, xd, xs = (b.gep(xq, [b.mul(first, c64(kmax))]), b.gep(xd, [b.mul(first, c64(kmax // BLOCK))]),
                          b.gep(xs, [b.mul(first, c64(kmax // BLOCK))]))
            n = b.sub(n, first)
        b.call(self.matmat_fn(layout, gate_up), [w, x, xq, xd, xs, out, lo, hi, n, c64(x_stride), c64(y_stride)])

    def out_stride(self, value: str) -> int:
        return self.strides[self.sched.buffers[value].pool]

    def quantise_input(self, b, x, cols: int, dtype: DType):
        if dtype in (DType.Q4, DType.Q8):
            b.call(self.quant_fn(cols, padded(cols, self.tc)),
                   [x, self.scratch_ptr(b, "xq", i8), self.scratch_ptr(b, "xd"), self.scratch_ptr(b, "xs", i32)])

    def emit_body(self, name: str, multi: bool) -> ir.Function:
        """One internal function running the whole schedule: the decode step, or (multi) the multi-token call."""
        fn = ir.Function(self.m, ir.FunctionType(void, list(STEP_ARGS)), name)
        fn.linkage = "internal"
        fn.attributes.add("nounwind")
        self.multi = multi
        self.ptrs, self.params, self.tid, self.nth, self.bar = fn.args
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        self.my_scratch = b.gep(b.load(b.gep(self.ptrs, [c64(self.slot(BindingKey(Binding.SCRATCH)))])),
                                [b.mul(self.tid, c64(self.scratch.nbytes))])
        self.token = b.load(b.gep(self.params, [c64(Param.TOKEN)]))
        self.pos = b.load(b.gep(self.params, [c64(Param.POS)]))
        if multi:
            self.ntok = b.load(b.gep(self.params, [c64(Param.NTOK)]))
            self.logits_from = b.load(b.gep(self.params, [c64(Param.LOGITS_FROM)]))
            self.tokens = self.pointer(b, BindingKey(Binding.TOKENS), i64)
            self.positions = self.pointer(b, BindingKey(Binding.POSITIONS), i64)
            self.slots = self.pointer(b, BindingKey(Binding.SLOTS), i64)
        emit_phase = {Phase.EMBED: self.step_embed, Phase.ADD: self.step_add, Phase.QKV: self.step_qkv,
                      Phase.CORE: self.step_core, Phase.O: self.step_o, Phase.ROUTE: self.step_route,
                      Phase.UP: self.step_up, Phase.DOWN: self.step_down, Phase.HEAD: self.step_head}
        if self.segmented:  # run only stages [lo, hi): the host reads routes and loads experts in between
            lo = b.load(b.gep(self.params, [c64(Param.STAGE_LO)]))
            hi = b.load(b.gep(self.params, [c64(Param.STAGE_HI)]))
        self.stamp(b, 0)
        for si, stage in enumerate(self.sched.stages):
            if self.segmented:
                inside = b.and_(b.icmp_signed("<=", lo, c64(si)), b.icmp_signed(">", hi, c64(si)))
                guard = b.if_then(inside)
                guard.__enter__()
            for step in stage:
                emit_phase[step.phase](b, step)
            # The last stage ends with a barrier too: when worker 0 returns, every worker is done.
            b.call(O.barrier(self.m, self.isa), [self.bar, self.nth])
            self.stamp(b, si + 1)
            if self.segmented:
                guard.__exit__(None, None, None)
        b.ret_void()
        self.multi = False
        return fn

    def emit(self) -> StepProgram:
        # NOTE: the bodies are internal: several loaded models share one process, and MCJIT resolves
        # external symbols by name across engines, so a call to an external "cflow_step" from this
        # module's worker loop could land in another model's step. Only thin wrappers are exported.
        body = self.emit_body(f"{STEP_SYMBOL}_body", multi=False)
        if self.tmax > 1:  # one entry for both: params[MODE] chooses (workers run whatever the host asked)
            multi = self.emit_body(f"{STEP_SYMBOL}_multi", multi=True)
            body = self.emit_dispatch(body, multi)
        entry = ir.Function(self.m, ir.FunctionType(void, list(STEP_ARGS)), STEP_SYMBOL)
        entry.attributes.add("nounwind")
        eb = ir.IRBuilder(entry.append_basic_block("entry"))
        eb.call(body, list(entry.args))
        eb.ret_void()
        O.emit_workers(self.m, body, self.isa, WORKER_SYMBOL, KICK_SYMBOL)
        return StepProgram(module=self.m, bindings=tuple(self.bindings), pool_strides=self.strides,
                           pool_slots={p: n for p, (n, _) in self.sched.pools.items()}, scratch=self.scratch,
                           kv_floats_per_layer=self.max_seq * self.cfg.n_kv_heads * self.cfg.head_dim,
                           max_seq=self.max_seq, isa=self.isa)

    def emit_dispatch(self, decode: ir.Function, multi: ir.Function) -> ir.Function:
        fn = ir.Function(self.m, ir.FunctionType(void, list(STEP_ARGS)), f"{STEP_SYMBOL}_dispatch")
        fn.linkage = "internal"
        fn.attributes.add("nounwind")
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        mode = b.load(b.gep(fn.args[1], [c64(Param.MODE)]))
        with b.if_else(b.icmp_signed("==", mode, c64(Mode.PREFILL))) as (then, otherwise):
            with then:
                b.call(multi, list(fn.args))
            with otherwise:
                b.call(decode, list(fn.args))
        b.ret_void()
        return fn

    def stamp(self, b, i: int) -> None:
        """Profiling builds: worker 0 records the cycle counter after stage i-1's barrier in prof[i]."""
        if not self.profile:
            return
        prof = self.pointer(b, BindingKey(Binding.PROF), i64)
        now = b.call(intrinsic(self.m, "llvm.readcyclecounter", i64, []), [])
        with b.if_then(b.icmp_signed("==", self.tid, c64(0))):  # only worker 0 writes: no race
            b.store(now, b.gep(prof, [c64(i)]))

    # one method per step phase ------------------------------------------------------------------
    # Each runs for one token (decode) or for every token of a multi-token call: per-token work (norm
    # prologues, quantisation, attention, routing, experts, adds) inside each_token, the mat-muls of
    # dense weights once for all tokens (call_mv outside the loop), so each tile is read once per call.
    def step_embed(self, b, step):
        t = self.tensors[step.tensors[0]]
        lo, hi = self.d_rows(b)
        with self.each_token(b):
            tok = self.token if self.t is None else b.load(b.gep(self.tokens, [self.t]))
            b.call(O.embed(self.m, t.dtype, self.d),
                   [self.pointer(b, tensor_key(t.name), i8), tok, self.value_ptr(b, step.writes[0]), lo, hi])

    def step_add(self, b, step):
        lo, hi = self.d_rows(b)
        with self.each_token(b):
            b.call(O.add_rows(self.m, len(step.row_reads)),
                   [self.value_ptr(b, step.writes[0])] + [self.value_ptr(b, v) for v in step.row_reads] + [lo, hi])

    def dense_mv(self, b, step, t, L, quantised: bool, gate_up: bool = False, first=None):
        """A step that normalises its input (prologue) and multiplies one dense matrix, for every token."""
        with self.each_token(b, first):
            x = self.prologue(b, step, L.cols, quantised)
        if self.multi:
            x = self.scratch_ptr(b, "xn")  # token 0's row: the mat-mat walks the rows itself
        lo, hi = self.rows(b, L.n_tile_rows)
        out = step.writes[0]
        self.call_mv(b, L, self.pointer(b, tensor_key(t.name), i8), x, self.value_ptr(b, out), lo, hi,
                     gate_up=gate_up, x_stride=self.scratch.kmax, y_stride=self.out_stride(out), first=first)

    def step_qkv(self, b, step):
        t = self.tensors[step.tensors[0]]
        self.dense_mv(b, step, t, t.concat.layout, t.dtype in (DType.Q4, DType.Q8))

    def step_core(self, b, step):
        n = self.g[step.op]
        t = self.tensors[qkv_tensor(n.prefix)]
        offs = t.concat.row_offsets
        layer = n.layer
        kv = self.pointer(b, BindingKey(Binding.KV))
        per = self.max_seq * n.n_kv_heads * n.head_dim
        kc = b.gep(kv, [c64((layer - 1) * 2 * per)])
        vc = b.gep(kv, [c64(((layer - 1) * 2 + 1) * per)])
        null = ir.Constant(P(f32), None)
        bq, bk, bv = ((self.pointer(b, tensor_key(f"{n.prefix}.{x}")) for x in ("bq", "bk", "bv")) if n.bias
                      else (null, null, null))
        g0 = b.udiv(b.mul(c64(n.n_kv_heads), self.tid), self.nth)
        g1 = b.udiv(b.mul(c64(n.n_kv_heads), b.add(self.tid, c64(1))), self.nth)
        # NOTE: tokens in order: token t writes its K/V row at its position, then attends over rows 0 .. that
        # position of its own slot, exactly what decode steps do (in a prompt block later tokens see earlier
        # ones); each thread owns its kv heads for every token, so no barrier is needed.
        with self.each_token(b):
            pos = self.pos
            if self.t is not None:
                pos = b.load(b.gep(self.positions, [self.t]))
                slot_off = b.mul(b.load(b.gep(self.slots, [self.t])), c64(2 * self.cfg.n_layers * per))
                kc, vc = b.gep(kv, [b.add(slot_off, c64((layer - 1) * 2 * per))]), \
                    b.gep(kv, [b.add(slot_off, c64(((layer - 1) * 2 + 1) * per))])
            b.call(O.attention(self.m, n, tuple(offs)),
                   [self.value_ptr(b, step.full_reads[0]), bq, bk, bv, kc, vc, self.pointer(b, BindingKey(Binding.COS)),
                    self.pointer(b, BindingKey(Binding.SIN)), self.value_ptr(b, step.writes[0]),
                    self.scratch_ptr(b, "scores"), pos, g0, g1])

    def _down(self, b, t, value: str, cols: int, out: str):
        """A step whose input is a whole internal value (attention output, FFN hidden): quantise, multiply."""
        L = t.layout
        with self.each_token(b):
            self.quantise_input(b, self.value_ptr(b, value), cols, t.dtype)
        lo, hi = self.rows(b, L.n_tile_rows)
        self.call_mv(b, L, self.pointer(b, tensor_key(t.name), i8), self.value_ptr(b, value), self.value_ptr(b, out),
                     lo, hi, x_stride=self.out_stride(value), y_stride=self.out_stride(out))

    def step_o(self, b, step):
        n = self.g[step.op]
        self._down(b, self.tensors[step.tensors[0]], step.full_reads[0], n.n_heads * n.head_dim, step.writes[0])

    def step_up(self, b, step):
        n = self.g[step.op]
        if isinstance(n, DenseFFN):
            t = self.tensors[step.tensors[0]]
            self.dense_mv(b, step, t, t.layout, t.dtype in (DType.Q4, DType.Q8), gate_up=True)
            return
        assert isinstance(n, ExpertBank)
        with self.each_token(b):  # experts: each token its own choice (per-token mat-vecs)
            self.experts_up(b, step, n)

    def experts_up(self, b, step, n: ExpertBank):
        router = self.g[n.inputs[1]]
        gu0 = self.tensors[expert_tensor(n.prefix, 0, "w_gate_up")]
        L = gu0.layout
        x = self.prologue(b, step, L.cols, False)
        route = b.gep(self.scratch_ptr(b, "route", i8), [c64(n.layer * self.scratch.route_stride)])
        if router.name not in self.routed_apart:  # else a ROUTE step chose the experts stages ago
            self.call_router(b, router, x, route)
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
            st = self.tensors[shared_tensor(n.prefix, "w_gate_up")]
            lo_s, hi_s = self.rows(b, st.layout.n_tile_rows)
            self.call_mv(b, st.layout, self.pointer(b, tensor_key(st.name), i8), x, b.gep(h, [c64(n.top_k * ip)]),
                         lo_s, hi_s, gate_up=True)
            gate_out = b.gep(b.bitcast(route, P(f32)), [c64(2 * n.top_k)])
            if n.shared_gate:
                b.call(O.sigmoid_dot(self.m, self.d),
                       [self.pointer(b, tensor_key(f"{n.prefix}.shared_gate")), x, gate_out])
            else:
                b.store(cf(1.0), gate_out)

    def call_router(self, b, router, x, route):
        b.call(O.router(self.m, self.d, router.n_experts, router.top_k, router.normalize),
               [x, self.pointer(b, tensor_key(router.weight)), self.scratch_ptr(b, "probs"), route])

    def step_route(self, b, step):
        """The router alone: route[layer] = (top-k ids, weights) in every thread's scratch (all route alike)."""
        router = self.g[step.op]
        with self.each_token(b):
            x = self.prologue(b, step, self.d, False)
            self.call_router(b, router, x, b.gep(self.scratch_ptr(b, "route", i8),
                                                 [c64(router.layer * self.scratch.route_stride)]))

    def expert_pointer(self, b, n: ExpertBank, which: str, e):
        """Pointer to expert e's tensor: one table entry per expert, so only the chosen ones are touched."""
        base = self.slot(tensor_key(expert_tensor(n.prefix, 0, which)))
        for k in range(1, n.n_experts):
            if self.slot(tensor_key(expert_tensor(n.prefix, k, which))) != base + k:
                raise CodegenError("expert pointer table is not contiguous")
        p = b.load(b.gep(self.ptrs, [b.add(c64(base), e)]), align=8)
        return p

    def step_down(self, b, step):
        n = self.g[step.op]
        if isinstance(n, DenseFFN):
            self._down(b, self.tensors[step.tensors[0]], step.full_reads[0], n.hidden, step.writes[0])
            return
        assert isinstance(n, ExpertBank)
        # reserve contiguous pointer-table entries for every expert's down matrix, in order
        for k in range(n.n_experts):
            self.slot(tensor_key(expert_tensor(n.prefix, k, "w_down")))
        with self.each_token(b):
            self.experts_down(b, step, n)

    def experts_down(self, b, step, n: ExpertBank):
        out = self.value_ptr(b, step.writes[0])
        h = self.value_ptr(b, step.full_reads[0])
        t0 = self.tensors[expert_tensor(n.prefix, 0, "w_down")]
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
            st = self.tensors[shared_tensor(n.prefix, "w_down")]
            x = b.gep(h, [c64(n.top_k * ip)])
            self.quantise_input(b, x, n.shared_hidden, st.dtype)
            self.call_mv(b, st.layout, self.pointer(b, tensor_key(st.name), i8), x, tmp, lo, hi)
            gate = b.load(b.gep(b.bitcast(route, P(f32)), [c64(2 * n.top_k)]))
            b.call(O.axpy(self.m), [out, tmp, gate, c64(0), rlo, rhi])

    def step_head(self, b, step):
        t = self.tensors[step.tensors[0]]
        # a prompt needs the last token's logits only: the head runs for tokens [LOGITS_FROM, NTOK)
        self.dense_mv(b, step, t, t.layout, t.dtype in (DType.Q4, DType.Q8),
                      first=self.logits_from if self.multi else None)


def build_step(state, isa: ISA | str, max_seq: int, profile: bool = False, segmented: bool = False,
               tmax: int = 1) -> StepProgram:
    """Build the decode-step module for a lowered state (see module docstring).

    profile: also record a cycle-counter stamp after every stage (binding PROF: i64[n_stages + 1]).
    segmented: each call runs only stages [params[STAGE_LO], params[STAGE_HI]) (the disk expert tier).
    tmax > 1: also the multi-token body (params[MODE] = PREFILL), up to tmax tokens per call.
    """
    if max_seq < 1:
        raise CodegenError(f"max_seq must be >= 1, got {max_seq}")
    if tmax < 1:
        raise CodegenError(f"tokens per call must be >= 1, got {tmax}")
    em = _Emitter(state, isa, max_seq, profile, segmented, tmax)
    # Expert tables first, so each bank's pointers are contiguous whatever order steps use them in.
    for n in state.graph.nodes():
        if isinstance(n, ExpertBank):
            for which in ("w_gate_up", "w_down"):
                for e in range(n.n_experts):
                    em.slot(tensor_key(expert_tensor(n.prefix, e, which)))
    return em.emit()


def emit_step(isa: ISA | str, max_seq: int | None = None, profile: bool = False) -> Pass:
    """The lowering's native pass: the decode step for `isa` (max_seq: the config's context by default)."""

    @state_pass(name="emit_step", requires=("schedule_stages",))
    def run(state, ctx):
        return state.evolve(program=build_step(state, isa, max_seq or state.graph.config.max_seq_len, profile))

    return run


def step_ir_text(state, triple: str) -> str:
    """The LLVM IR text of an emitted step, for `cflowc --emit llvm` (the triple it was built for)."""
    mod = state.program.module
    mod.triple = triple
    return str(mod)
