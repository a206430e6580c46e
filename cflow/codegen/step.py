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
from ..passes.pack import expert_tensor, post_norm_tensor, qkv_tensor, shared_tensor
from ..passes.schedule import Phase, Pool
from . import attention as A
from . import blockdot, threads
from . import kernels as K
from . import ops as O
from .abi import (
    KICK_SYMBOL,
    KV_BYTES,
    STEP_SYMBOL,
    WORKER_SYMBOL,
    Binding,
    BindingKey,
    Mode,
    Param,
    ScratchLayout,
    kv_floats_per_layer,
    scratch_layout,
)
from .attn_tune import attention_key
from .cgutils import Loop, P, alloca_once, c64, cf, f32, i8, i16, i32, i64, intrinsic, void
from .target import ISA
from .tune import kernel_key

STEP_ARGS = (P(P(i8)), P(i64), i64, i64, P(i32))  # see abi.py: ptrs, params, tid, nthreads, barrier
STAGE_ARGS = STEP_ARGS + (P(i64),)  # a stage function's: the step's, then its descriptor (emit_body)


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
    kv: str = "f32"  # the KV cache's element type (abi.KV_BYTES)
    # per body ("stage": decode, "multi_stage": multi-token): [stages run, distinct stage functions emitted]
    stage_functions: dict = attrs.field(factory=dict)

    def meta(self) -> dict:
        """Everything but the module, JSON-able (the program cache stores it beside the IR text)."""
        return {"bindings": [k.to_json() for k in self.bindings],
                "pool_strides": {str(p): n for p, n in self.pool_strides.items()},
                "pool_slots": {str(p): n for p, n in self.pool_slots.items()}, "scratch": self.scratch.to_json(),
                "kv_floats_per_layer": self.kv_floats_per_layer, "max_seq": self.max_seq, "isa": str(self.isa),
                "kv": self.kv, "stage_functions": {k: list(v) for k, v in self.stage_functions.items()}}

    @classmethod
    def from_meta(cls, ir_text: str, m: dict) -> StepProgram:
        return cls(module=ir_text, bindings=tuple(BindingKey.from_json(b) for b in m["bindings"]),
                   pool_strides={Pool(p): n for p, n in m["pool_strides"].items()},
                   pool_slots={Pool(p): n for p, n in m["pool_slots"].items()},
                   scratch=ScratchLayout.from_json(m["scratch"]), kv_floats_per_layer=m["kv_floats_per_layer"],
                   max_seq=m["max_seq"], isa=ISA(m["isa"]), kv=m["kv"],
                   stage_functions={k: tuple(v) for k, v in m["stage_functions"].items()})


class _Emitter:
    def __init__(self, compiled, isa: ISA, max_seq: int, profile: bool = False, segmented: bool = False,
                 tmax: int = 1, kv: str = "f32", tuning: dict | None = None, bf16_unit: str = ""):
        self.profile = profile
        # this host's measured choices: {codegen.tune.kernel_key: mat-vec knobs, attn_tune.attention_key: the
        # attention core's {"kv_prefetch": bytes}}
        self.tuning = tuning or {}
        self.kv = kv
        self.bf16_unit = bf16_unit if kv == "bf16" else ""  # kv='bf16': the dot products' unit (Target.bf16_unit)
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
        self.scratch = scratch_layout(cfg, self.tensors, max_seq, tmax)  # the one the memory check sizes
        self.strides = self._pool_strides()
        self.routed_apart = {st.op for st in self.sched.steps() if st.phase == Phase.ROUTE}
        self.segmented = segmented
        self.desc: list[int] | None = None  # the descriptor of the stage function being emitted (self.k)
        self.desc_b = self.desc_arg = None
        self.stage_counts: dict[str, tuple[int, int]] = {}  # body -> (stages, distinct stage functions)

    # --- binding table ---------------------------------------------------------------------
    def slot(self, key: BindingKey) -> int:
        if key not in self.index:
            self.index[key] = len(self.bindings)
            self.bindings.append(key)
        return self.index[key]

    def k(self, v: int, name: str = "d"):
        """A layer-specific integer constant: in a stage function, the next entry of its descriptor (loaded in
        the function's entry block; v is appended to the descriptor), so stages that differ only in such
        constants print the same IR text and share one function (emit_body). Outside a stage: the constant."""
        if self.desc is None:
            return c64(v)
        self.desc.append(int(v))
        b = self.desc_b
        b.position_at_end(b.function.entry_basic_block)  # (allocas inserted at its start move the end)
        return b.load(b.gep(self.desc_arg, [c64(len(self.desc) - 1)]), name=name)

    # Bindings whose table index is the same for every layer (one pool, one KV cache ...): a plain constant.
    SHARED_BINDINGS = frozenset({Binding.POOL, Binding.KV, Binding.SCRATCH, Binding.PROF, Binding.EXPERT_ROWS,
                                 Binding.TOKENS, Binding.POSITIONS, Binding.SLOTS})

    def pointer(self, b, key: BindingKey, ty=f32):
        i = self.slot(key)
        p = b.load(b.gep(self.ptrs, [c64(i) if key.kind in self.SHARED_BINDINGS else self.k(i, "slot")]), align=8)
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
        p = b.gep(base, [self.k(buf.slot * self.tmax * stride, "pool_off")])
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
    def gate_act(self, gate_up: bool) -> tuple[str, tuple]:
        """The gate activation of a gate_up kernel (one per model: ModelConfig.activation covers the dense FFN,
        the experts and the shared expert) and its name suffix (none for SiLU: the names predate the choice)."""
        act = self.cfg.activation
        return act, ((act,) if gate_up and act != "silu" else ())

    def matmat_fn(self, layout: TileLayout, gate_up: bool = False):
        # NOTE: keyed without the row count: one mat-mat serves every matrix of a width (JIT time).
        act, suffix = self.gate_act(gate_up)
        key = ("mm", layout.dtype.label, layout.cols, layout.tr, layout.tc, int(gate_up)) + suffix
        fn = self.fns.get(key)
        if fn is None:
            fn = K.emit_matmat(self.m, "_".join(map(str, key)), layout, self.isa, self.scratch.kmax,
                               tail=self.matvec_fn(layout, gate_up), linkage="internal", gate_up=gate_up, act=act)
            self.fns[key] = fn
        return fn

    def matvec_fn(self, layout: TileLayout, gate_up: bool = False):
        act, suffix = self.gate_act(gate_up)
        key = ("mv", layout.dtype.label, layout.cols, layout.tr, layout.tc, int(gate_up)) + suffix  # rows: no matter
        fn = self.fns.get(key)
        if fn is None:
            knobs = self.tuning.get(kernel_key(layout, gate_up), {})
            fn = K.emit_matvec(self.m, "_".join(map(str, key)), layout, self.isa, linkage="internal", gate_up=gate_up,
                               act=act, **knobs)
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

    def cols_p(self, cols: int, dtype: DType) -> int:
        """The padded input width the kernels of `dtype` read (TileLayout.cols_p: whole tiles, whole blocks)."""
        return TileLayout(dtype, 1, cols, (self.tr, self.tc)).cols_p

    def prologue(self, b, step, layout_cols: int, quantised: bool, dtype: DType | None = None, cols_p=None):
        """Normalise (or copy) the step's input into this thread's xn, then int8-quantise it if needed (padded to
        what `dtype`'s kernels read, or to cols_p)."""
        src = step.full_reads[0]
        xn = self.scratch_ptr(b, "xn")
        if cols_p is None:
            cols_p = self.cols_p(layout_cols, dtype) if dtype is not None else padded(layout_cols, self.tc)
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
        if dtype.quantised:
            b.call(self.quant_fn(cols, self.cols_p(cols, dtype)),
                   [x, self.scratch_ptr(b, "xq", i8), self.scratch_ptr(b, "xd"), self.scratch_ptr(b, "xs", i32)])

    # --- the body: a loop over a table of stage functions --------------------------------------
    # Each stage (its steps, without the barrier) is emitted as its own function stage_k(ptrs, params, tid,
    # nthreads, barrier, desc); every integer that can differ between layers (pointer-table slots, pool
    # offsets, KV-cache and route offsets: self.k) is read from the stage's descriptor desc[] instead of being
    # a constant. A stage whose IR text equals an already kept one's (names aside) is dropped and the kept
    # function runs it with its own descriptor, so the module holds one function per distinct stage *kind*
    # (dense or MoE, sliding or global, the delays' ramp-up and ramp-down), not one per executed layer. The
    # comparison is on the whole text: a layer-specific constant that is not abstracted only makes two stages
    # differ (no sharing), never a wrong program. The body then walks constant tables (function, descriptor
    # offset) with the barrier and the per-stage hooks (profiling stamps, the segmented stage range) indexed
    # by the loop counter.
    def emit_stage(self, name: str, stage) -> tuple[ir.Function, list[int]]:
        """One stage as an internal function; returns it and its descriptor (the values of its self.k loads)."""
        fn = ir.Function(self.m, ir.FunctionType(void, list(STAGE_ARGS)), name)
        fn.linkage = "internal"
        fn.attributes.add("nounwind")
        fn.attributes.add("noinline")  # a stage stays one function however many stages run it
        for a, n in zip(fn.args, ("ptrs", "params", "tid", "nthreads", "barrier", "desc")):
            a.name = n
        self.desc_arg = fn.args[5]
        self.desc_arg.add_attribute("noalias")  # loaded once, in the entry block (self.k)
        entry, body = fn.append_basic_block("entry"), fn.append_basic_block("stage")
        self.desc_b, self.desc = ir.IRBuilder(entry), []
        b = ir.IRBuilder(body)
        self.open_function(b, fn.args)
        emit_phase = {Phase.EMBED: self.step_embed, Phase.ADD: self.step_add, Phase.QKV: self.step_qkv,
                      Phase.CORE: self.step_core, Phase.O: self.step_o, Phase.ROUTE: self.step_route,
                      Phase.UP: self.step_up, Phase.DOWN: self.step_down, Phase.HEAD: self.step_head}
        for step in stage:
            emit_phase[step.phase](b, step)
        b.ret_void()
        self.desc_b.position_at_end(entry)
        self.desc_b.branch(body)
        desc, self.desc, self.desc_b, self.desc_arg = self.desc, None, None, None
        return fn, desc

    def open_function(self, b, args) -> None:
        """The values every step reads: this thread's scratch, the token and position (multi: the call's)."""
        self.ptrs, self.params, self.tid, self.nth, self.bar = args[:5]
        self.my_scratch = b.gep(b.load(b.gep(self.ptrs, [c64(self.slot(BindingKey(Binding.SCRATCH)))])),
                                [b.mul(self.tid, c64(self.scratch.nbytes))], name="scratch")
        self.token = b.load(b.gep(self.params, [c64(Param.TOKEN)]), name="token")
        self.pos = b.load(b.gep(self.params, [c64(Param.POS)]), name="pos")
        if self.multi:
            self.ntok = b.load(b.gep(self.params, [c64(Param.NTOK)]), name="ntok")
            self.logits_from = b.load(b.gep(self.params, [c64(Param.LOGITS_FROM)]), name="logits_from")
            self.tokens = self.pointer(b, BindingKey(Binding.TOKENS), i64)
            self.positions = self.pointer(b, BindingKey(Binding.POSITIONS), i64)
            self.slots = self.pointer(b, BindingKey(Binding.SLOTS), i64)

    def emit_body(self, name: str, multi: bool) -> ir.Function:
        """The decode step, or (multi) the multi-token call: its stage functions, tables and loop."""
        self.multi = multi
        prefix = "multi_stage" if multi else "stage"
        kept: dict[str, ir.Function] = {}  # normalised IR text -> the stage function kept for it
        fns, offsets, descs = [], [], []
        stages = list(self.sched.stages)
        for stage in stages:
            name_k = f"{prefix}_{len(kept)}"
            fn, desc = self.emit_stage(name_k, stage)
            text = str(fn).replace(f'@"{name_k}"', "@STAGE", 1)
            if text in kept:
                _drop_function(self.m, fn)
                fn = kept[text]
            else:
                kept[text] = fn
            fns.append(fn)
            offsets.append(len(descs))
            descs.extend(desc)
        self.stage_counts[prefix] = (len(fns), len(kept))
        n = len(fns)
        stage_ty = P(ir.FunctionType(void, list(STAGE_ARGS)))
        table = _const_array(self.m, f"{prefix}_table", stage_ty, fns)
        offs = _const_array(self.m, f"{prefix}_desc_off", i64, [c64(o) for o in offsets])
        desc_all = _const_array(self.m, f"{prefix}_desc", i64, [c64(v) for v in descs] or [c64(0)])

        fn = ir.Function(self.m, ir.FunctionType(void, list(STEP_ARGS)), name)
        fn.linkage = "internal"
        fn.attributes.add("nounwind")
        for a, an in zip(fn.args, ("ptrs", "params", "tid", "nthreads", "barrier")):
            a.name = an
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        self.ptrs, self.params, self.tid, self.nth, self.bar = fn.args
        if self.segmented:  # run only stages [lo, hi): the host reads routes and loads experts in between
            lo = b.load(b.gep(self.params, [c64(Param.STAGE_LO)]), name="stage_lo")
            hi = b.load(b.gep(self.params, [c64(Param.STAGE_HI)]), name="stage_hi")
        # the token's start (segmented: the first segment's only) and each thread's, in its row's last column
        with (b.if_then(b.icmp_signed("==", lo, c64(0))) if self.segmented else contextlib.nullcontext()):
            self.stamp(b, c64(0))
            self.arrive(b, c64(n), n)
        with Loop(b, c64(0), c64(n), "si") as si:
            guard = None
            if self.segmented:
                guard = b.if_then(b.and_(b.icmp_signed("<=", lo, si), b.icmp_signed(">", hi, si)))
                guard.__enter__()
            # NOTE: the index passes through an empty asm, so LLVM cannot fold the table loads (after
            # unrolling the loop) into direct calls with constant descriptors, which it could then
            # specialise or inline back into one function per stage.
            i = b.call(ir.InlineAsm(ir.FunctionType(i64, [i64]), "", "=r,0"), [si], name="si.opaque")
            call = b.load(b.gep(table, [c64(0), i]), name="stage_fn")
            desc = b.gep(desc_all, [c64(0), b.load(b.gep(offs, [c64(0), i]), name="desc_off")], name="desc")
            b.call(call, [self.ptrs, self.params, self.tid, self.nth, self.bar, desc])
            self.arrive(b, si, n)
            # The last stage ends with a barrier too: when worker 0 returns, every worker is done.
            b.call(threads.barrier(self.m, self.isa), [self.bar, self.nth])
            self.stamp(b, b.add(si, c64(1)))
            if guard is not None:
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
        threads.emit_workers(self.m, body, self.isa, WORKER_SYMBOL, KICK_SYMBOL)
        return StepProgram(module=self.m, bindings=tuple(self.bindings), pool_strides=self.strides,
                           pool_slots={p: n for p, (n, _) in self.sched.pools.items()}, scratch=self.scratch,
                           kv_floats_per_layer=kv_floats_per_layer(self.cfg, self.max_seq),
                           max_seq=self.max_seq, isa=self.isa, kv=self.kv, stage_functions=dict(self.stage_counts))

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

    def stamp(self, b, i) -> None:
        """Profiling builds: worker 0 records the cycle counter after stage i-1's barrier in prof[0][i] (i: IR i64)."""
        if not self.profile:
            return
        prof = self.pointer(b, BindingKey(Binding.PROF), i64)
        now = b.call(intrinsic(self.m, "llvm.readcyclecounter", i64, []), [])
        with b.if_then(b.icmp_signed("==", self.tid, c64(0))):  # only worker 0 writes: no race
            b.store(now, b.gep(prof, [i]))

    def arrive(self, b, i, n_stages: int) -> None:
        """Profiling builds: thread t records the cycle counter as it reaches stage i's barrier in prof[1 + t][i]
        (rows of n_stages + 1 stamps; each thread its own row; i = n_stages: the thread's start of the call), so
        the host can tell a stage's work from the wait at its barrier."""
        if not self.profile:
            return
        prof = self.pointer(b, BindingKey(Binding.PROF), i64)
        now = b.call(intrinsic(self.m, "llvm.readcyclecounter", i64, []), [])
        b.store(now, b.gep(prof, [b.add(b.mul(b.add(self.tid, c64(1)), c64(n_stages + 1)), i)]))

    # one method per step phase ------------------------------------------------------------------
    # Each runs for one token (decode) or for every token of a multi-token call: per-token work (norm
    # prologues, quantisation, attention, routing, experts, adds) inside each_token, the mat-muls of
    # dense weights once for all tokens (call_mv outside the loop), so each tile is read once per call.
    def step_embed(self, b, step):
        t = self.tensors[step.tensors[0]]
        lo, hi = self.d_rows(b)
        # a quantised embedding (a GGUF's, kept as stored) is a tile stream: its row is decoded from the tiles
        fn = blockdot.emit_embed_row(self.m, t.layout, self.isa) if t.form == Form.TILED else \
            O.embed(self.m, t.dtype, self.d)
        with self.each_token(b):
            tok = self.token if self.t is None else b.load(b.gep(self.tokens, [self.t]))
            b.call(fn, [self.pointer(b, tensor_key(t.name), i8), tok, self.value_ptr(b, step.writes[0]), lo, hi])

    def step_add(self, b, step):
        lo, hi = self.d_rows(b)
        # inputs with a post norm (attention / dense FFN outputs of Gemma 2/3) are normalised here, on the way in
        post = [(j, self.g[v]) for j, v in enumerate(step.row_reads) if getattr(self.g.get(v), "post_norm", False)]
        fn = O.add_rows(self.m, len(step.row_reads), tuple((j, op.eps) for j, op in post), self.d)
        weights = [self.pointer(b, tensor_key(post_norm_tensor(op))) for _, op in post]
        with self.each_token(b):
            b.call(fn, [self.value_ptr(b, step.writes[0])] + [self.value_ptr(b, v) for v in step.row_reads]
                   + weights + [lo, hi])

    def dense_mv(self, b, step, t, L, quantised: bool, gate_up: bool = False, first=None):
        """A step that normalises its input (prologue) and multiplies one dense matrix, for every token. A CONCAT
        whose parts differ in type (a GGUF's) runs each part's kernel on its rows, the input quantised once."""
        parts = t.concat.parts if t.form == Form.CONCAT and t.concat.mixed else None
        cols_p = max(p.cols_p for p in parts) if parts else L.cols_p
        with self.each_token(b, first):
            x = self.prologue(b, step, L.cols, quantised, cols_p=cols_p)
        if self.multi:
            x = self.scratch_ptr(b, "xn")  # token 0's row: the mat-mat walks the rows itself
        out = step.writes[0]
        w = self.pointer(b, tensor_key(t.name), i8)
        for Lp, row0, byte0 in (zip(parts, t.concat.row_offsets, t.concat.byte_offsets) if parts else [(L, 0, 0)]):
            lo, hi = self.rows(b, Lp.n_tile_rows)
            y = self.value_ptr(b, out)
            self.call_mv(b, Lp, b.gep(w, [c64(byte0)]) if byte0 else w, x, b.gep(y, [c64(row0)]) if row0 else y,
                         lo, hi, gate_up=gate_up, x_stride=self.scratch.kmax, y_stride=self.out_stride(out),
                         first=first)

    def step_qkv(self, b, step):
        t = self.tensors[step.tensors[0]]
        self.dense_mv(b, step, t, t.concat.layout, t.dtype.quantised)

    def step_core(self, b, step):
        n = self.g[step.op]
        t = self.tensors[qkv_tensor(n.prefix)]
        offs = t.concat.row_offsets
        layer = n.layer
        kv = self.pointer(b, BindingKey(Binding.KV), i16 if KV_BYTES[self.kv] == 2 else f32)
        per = kv_floats_per_layer(self.cfg, self.max_seq)  # entries of one layer's K (or V), whatever their type
        k_off, v_off = self.k((layer - 1) * 2 * per, "k_off"), self.k(((layer - 1) * 2 + 1) * per, "v_off")
        kc, vc = b.gep(kv, [k_off]), b.gep(kv, [v_off])
        null = ir.Constant(P(f32), None)
        bq, bk, bv = ((self.pointer(b, tensor_key(f"{n.prefix}.{x}")) for x in ("bq", "bk", "bv")) if n.bias
                      else (null, null, null))
        qn, kn = ((self.pointer(b, tensor_key(f"{n.prefix}.{x}")) for x in ("q_norm", "k_norm")) if n.qk_norm
                  else (null, null))
        g0 = b.udiv(b.mul(c64(n.n_kv_heads), self.tid), self.nth)
        g1 = b.udiv(b.mul(c64(n.n_kv_heads), b.add(self.tid, c64(1))), self.nth)
        # Gemma 3's sliding-window layers rotate at their own base (ir/rope.py:layer_rope): a second table pair
        table = "local" if self.cfg.local_rope_theta and self.cfg.is_sliding(layer) else ""
        cos, sin = (self.pointer(b, BindingKey(k, table)) for k in (Binding.COS, Binding.SIN))
        # NOTE: tokens in order: token t writes its K/V row at its position, then attends over rows 0 .. that
        # position of its own slot, exactly what decode steps do (in a prompt block later tokens see earlier
        # ones); each thread owns its kv heads for every token, so no barrier is needed.
        with self.each_token(b):
            pos = self.pos
            if self.t is not None:
                pos = b.load(b.gep(self.positions, [self.t]))
                slot_off = b.mul(b.load(b.gep(self.slots, [self.t])), c64(2 * self.cfg.n_layers * per))
                kc, vc = b.gep(kv, [b.add(slot_off, k_off)]), b.gep(kv, [b.add(slot_off, v_off)])
            unit = A.core_unit(self.kv, self.bf16_unit, n.n_heads // n.n_kv_heads, n.head_dim, self.max_seq)
            pf = self.tuning.get(attention_key(n.n_heads, n.n_kv_heads, n.head_dim, self.kv, unit), {}).get(
                "kv_prefetch", A.KV_PREFETCH)
            b.call(A.attention(self.m, n, tuple(offs), self.isa, self.kv, self.max_seq, self.bf16_unit, pf),
                   [self.value_ptr(b, step.full_reads[0]), bq, bk, bv, qn, kn, kc, vc,
                    cos, sin, self.value_ptr(b, step.writes[0]),
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
            self.dense_mv(b, step, t, t.layout, t.dtype.quantised, gate_up=True)
            return
        assert isinstance(n, ExpertBank)
        if self.grouped(n):
            self.experts_up_grouped(b, step, n)
            return
        with self.each_token(b):  # experts: each token its own choice (per-token mat-vecs)
            self.experts_up(b, step, n)

    def experts_up(self, b, step, n: ExpertBank):
        router = self.g[n.inputs[1]]
        gu0 = self.tensors[expert_tensor(n.prefix, 0, "w_gate_up")]
        L = gu0.layout
        x = self.prologue(b, step, L.cols, False)
        route = b.gep(self.scratch_ptr(b, "route", i8), [self.k(n.layer * self.scratch.route_stride, "route_off")])
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
            self.count_expert_rows(b, n, e, 0, lo, hi)
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
                                                 [self.k(router.layer * self.scratch.route_stride, "route_off")]))

    def count_expert_rows(self, b, n: ExpertBank, e, which: int, lo, hi) -> None:
        """Profiling builds: expert_rows[layer][e][which] += this thread's tile-rows of one pass over the matrix
        (which: 0 gate_up, 1 down; atomic, every thread adds its share), so a test can count passes."""
        if not self.profile:
            return
        rows = self.pointer(b, BindingKey(Binding.EXPERT_ROWS), i64)
        idx = b.add(self.k(2 * n.layer * self.cfg.n_experts, "rows_off"), b.add(b.mul(e, c64(2)), c64(which)))
        b.atomic_rmw("add", b.gep(rows, [idx]), b.sub(hi, lo), "monotonic")

    def expert_pointer(self, b, n: ExpertBank, which: str, e):
        """Pointer to expert e's tensor: one table entry per expert, so only the chosen ones are touched."""
        base = self.slot(tensor_key(expert_tensor(n.prefix, 0, which)))
        for k in range(1, n.n_experts):
            if self.slot(tensor_key(expert_tensor(n.prefix, k, which))) != base + k:
                raise CodegenError("expert pointer table is not contiguous")
        p = b.load(b.gep(self.ptrs, [b.add(self.k(base, "experts"), e)]), align=8)
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
        if self.grouped(n):
            self.experts_down_grouped(b, step, n)
            return
        with self.each_token(b):
            self.experts_down(b, step, n)

    def experts_down(self, b, step, n: ExpertBank):
        out = self.value_ptr(b, step.writes[0])
        h = self.value_ptr(b, step.full_reads[0])
        t0 = self.tensors[expert_tensor(n.prefix, 0, "w_down")]
        L = t0.layout
        route = b.gep(self.scratch_ptr(b, "route", i8), [self.k(n.layer * self.scratch.route_stride, "route_off")])
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
            self.count_expert_rows(b, n, e, 1, lo, hi)
            b.call(O.axpy(self.m), [out, tmp, b.load(b.gep(wts, [c64(j)])), c64(1 if j == 0 else 0), rlo, rhi])
        if n.shared_hidden:
            st = self.tensors[shared_tensor(n.prefix, "w_down")]
            x = b.gep(h, [c64(n.top_k * ip)])
            self.quantise_input(b, x, n.shared_hidden, st.dtype)
            self.call_mv(b, st.layout, self.pointer(b, tensor_key(st.name), i8), x, tmp, lo, hi)
            gate = b.load(b.gep(b.bitcast(route, P(f32)), [c64(2 * n.top_k)]))
            b.call(O.axpy(self.m), [out, tmp, gate, c64(0), rlo, rhi])

    # --- experts in a multi-token call: tokens grouped by the expert they chose --------------------
    # Each expert with at least one token of the block is multiplied once, by the mat-mat, against the
    # int8 inputs of exactly its tokens (gathered into scratch gq/gd/gs), so its tiles are read once per
    # call however many tokens chose it, and an expert nobody chose is not touched. Every thread routes
    # alike, so every thread builds the same groups in the same order and needs no barrier for them.
    # Per output the arithmetic is the per-token path's (the mat-mat equals the mat-vec bit for bit; the
    # weighted sum of a token's experts is still taken in its top-k order), so results are bit-identical.
    def grouped(self, n: ExpertBank) -> bool:
        if not (self.multi and self.t is None and self.scratch.grouped):
            return False
        # float experts read float inputs, which are not gathered: they keep the per-token mat-vecs
        return all(self.tensors[expert_tensor(n.prefix, 0, w)].dtype.quantised
                   for w in ("w_gate_up", "w_down"))

    def route_ptr(self, b, layer: int):
        """Token self.t's route record of a layer: i32 idx[k], f32 w[k], f32 shared gate."""
        return b.gep(self.scratch_ptr(b, "route", i8), [self.k(layer * self.scratch.route_stride, "route_off")])

    def group_tokens(self, b, n: ExpertBank, e):
        """Fill gtok/gj with the block's tokens that chose expert e (token order) and return their count."""
        count = alloca_once(b, i64, "group.n")
        b.store(c64(0), count)
        gtok, gj = self.scratch_ptr(b, "gtok", i64), self.scratch_ptr(b, "gj", i64)
        with self.each_token(b):
            idx = b.bitcast(self.route_ptr(b, n.layer), P(i32))
            for j in range(n.top_k):
                with b.if_then(b.icmp_signed("==", b.sext(b.load(b.gep(idx, [c64(j)])), i64), e)):
                    k = b.load(count)
                    b.store(self.t, b.gep(gtok, [k]))
                    b.store(c64(j), b.gep(gj, [k]))
                    b.store(b.add(k, c64(1)), count)
        return b.load(count)

    def group_matmat(self, b, layout: TileLayout, w, n_tok, out, y_stride: int, gate_up: bool = False):
        """out[k] = W x_k for the gathered inputs k < n_tok, this thread's tile-rows."""
        lo, hi = self.rows(b, layout.n_tile_rows)
        gq, gd, gs = self.scratch_ptr(b, "gq", i8), self.scratch_ptr(b, "gd"), self.scratch_ptr(b, "gs", i32)
        b.call(self.matmat_fn(layout, gate_up), [w, self.scratch_ptr(b, "gy"), gq, gd, gs, out, lo, hi, n_tok,
                                                 c64(self.scratch.kmax), c64(y_stride)])

    def gather_row(self, b, t, k):
        """Copy token t's quantised input (xq, xd, xs) into gathered row k."""
        kmax, kb = self.scratch.kmax, self.scratch.kmax // BLOCK
        for field, g, words in (("xq", "gq", kmax // 4), ("xd", "gd", kb), ("xs", "gs", kb)):  # 4-byte words
            src = b.gep(self.scratch_ptr(b, field, i8), [b.mul(t, c64(self.scratch.token_bytes(field)))])
            dst = b.gep(self.scratch_ptr(b, g, i8), [b.mul(k, c64(self.scratch.token_bytes(field)))])
            b.call(O.copy_words(self.m), [b.bitcast(dst, P(i32)), b.bitcast(src, P(i32)), c64(0), c64(words)])

    def quantise_row(self, b, x, k, cols: int, dtype: DType):
        """Quantise x into gathered row k (the per-token quantisation, written where the mat-mat reads it)."""
        kb = self.scratch.kmax // BLOCK
        b.call(self.quant_fn(cols, self.cols_p(cols, dtype)),
               [x, b.gep(self.scratch_ptr(b, "gq", i8), [b.mul(k, c64(self.scratch.kmax))]),
                b.gep(self.scratch_ptr(b, "gd"), [b.mul(k, c64(kb))]),
                b.gep(self.scratch_ptr(b, "gs", i32), [b.mul(k, c64(kb))])])

    def experts_up_grouped(self, b, step, n: ExpertBank):
        router = self.g[n.inputs[1]]
        gu0 = self.tensors[expert_tensor(n.prefix, 0, "w_gate_up")]
        L = gu0.layout
        with self.each_token(b):  # every token: norm, route (unless a ROUTE step did), int8 input
            x = self.prologue(b, step, L.cols, False)
            if router.name not in self.routed_apart:
                self.call_router(b, router, x, self.route_ptr(b, n.layer))
            self.quantise_input(b, x, L.cols, gu0.dtype)
        ip = padded(n.hidden, self.unit)
        h, hs = self.value_ptr(b, step.writes[0]), self.out_stride(step.writes[0])
        gy, gtok, gj = self.scratch_ptr(b, "gy"), self.scratch_ptr(b, "gtok", i64), self.scratch_ptr(b, "gj", i64)
        lo, hi = self.rows(b, L.n_tile_rows)
        rlo, rhi = b.mul(lo, c64(self.tr)), b.mul(hi, c64(self.tr))
        with Loop(b, c64(0), c64(n.n_experts), "e") as e:
            cnt = self.group_tokens(b, n, e)
            with b.if_then(b.icmp_signed(">", cnt, c64(0))):
                with Loop(b, c64(0), cnt, "g") as k:
                    self.gather_row(b, b.load(b.gep(gtok, [k])), k)
                self.group_matmat(b, L, self.expert_pointer(b, n, "w_gate_up", e), cnt, gy, ip, gate_up=True)
                self.count_expert_rows(b, n, e, 0, lo, hi)
                with Loop(b, c64(0), cnt, "g") as k:  # this thread's rows into h[t][j]
                    t, j = b.load(b.gep(gtok, [k])), b.load(b.gep(gj, [k]))
                    dst = b.gep(h, [b.add(b.mul(t, c64(hs)), b.mul(j, c64(ip)))])
                    b.call(O.copy_rows(self.m), [dst, b.gep(gy, [b.mul(k, c64(ip))]), rlo, rhi])
        if n.shared_hidden:  # the shared expert is a dense matrix: one mat-mat over every token
            st = self.tensors[shared_tensor(n.prefix, "w_gate_up")]
            lo_s, hi_s = self.rows(b, st.layout.n_tile_rows)
            self.call_mv(b, st.layout, self.pointer(b, tensor_key(st.name), i8), self.scratch_ptr(b, "xn"),
                         b.gep(h, [c64(n.top_k * ip)]), lo_s, hi_s, gate_up=True, x_stride=self.scratch.kmax,
                         y_stride=hs)
            with self.each_token(b):
                gate_out = b.gep(b.bitcast(self.route_ptr(b, n.layer), P(f32)), [c64(2 * n.top_k)])
                if n.shared_gate:
                    b.call(O.sigmoid_dot(self.m, self.d), [self.pointer(b, tensor_key(f"{n.prefix}.shared_gate")),
                                                           self.scratch_ptr(b, "xn"), gate_out])
                else:
                    b.store(cf(1.0), gate_out)

    def experts_down_grouped(self, b, step, n: ExpertBank):
        out, os_ = self.value_ptr(b, step.writes[0]), self.out_stride(step.writes[0])
        h, hs = self.value_ptr(b, step.full_reads[0]), self.out_stride(step.full_reads[0])
        t0 = self.tensors[expert_tensor(n.prefix, 0, "w_down")]
        L = t0.layout
        ip, dp, K = padded(n.hidden, self.unit), self.dp, n.top_k
        gy, gtok, gj = self.scratch_ptr(b, "gy"), self.scratch_ptr(b, "gtok", i64), self.scratch_ptr(b, "gj", i64)
        gpos = self.scratch_ptr(b, "gpos", i64)
        lo, hi = self.rows(b, L.n_tile_rows)
        rlo, rhi = b.mul(lo, c64(self.tr)), b.mul(hi, c64(self.tr))
        used = alloca_once(b, i64, "group.rows")  # gy rows taken by the experts done so far
        b.store(c64(0), used)
        with Loop(b, c64(0), c64(n.n_experts), "e") as e:
            cnt = self.group_tokens(b, n, e)
            with b.if_then(b.icmp_signed(">", cnt, c64(0))):
                first = b.load(used)
                with Loop(b, c64(0), cnt, "g") as k:
                    t, j = b.load(b.gep(gtok, [k])), b.load(b.gep(gj, [k]))
                    self.quantise_row(b, b.gep(h, [b.add(b.mul(t, c64(hs)), b.mul(j, c64(ip)))]), k, n.hidden,
                                      t0.dtype)
                    b.store(b.add(first, k), b.gep(gpos, [b.add(b.mul(t, c64(K)), j)]))
                self.group_matmat(b, L, self.expert_pointer(b, n, "w_down", e), cnt,
                                  b.gep(gy, [b.mul(first, c64(dp))]), dp)
                self.count_expert_rows(b, n, e, 1, lo, hi)
                b.store(b.add(first, cnt), used)
        shared = b.gep(gy, [c64(self.tmax * K * dp)])  # token t's shared-expert output at row tmax*K + t
        if n.shared_hidden:
            st = self.tensors[shared_tensor(n.prefix, "w_down")]
            with self.each_token(b):
                self.quantise_input(b, b.gep(self.value_ptr(b, step.full_reads[0]), [c64(K * ip)]), n.shared_hidden,
                                    st.dtype)
            self.call_mv(b, st.layout, self.pointer(b, tensor_key(st.name), i8), b.gep(h, [c64(K * ip)]), shared,
                         lo, hi, x_stride=hs, y_stride=dp)
        with self.each_token(b):  # each token's weighted sum, in its top-k order (as the per-token path)
            route = self.route_ptr(b, n.layer)
            wts = b.gep(b.bitcast(route, P(f32)), [c64(K)])
            o = b.gep(out, [b.mul(self.t, c64(os_))])
            for j in range(K):
                row = b.load(b.gep(gpos, [b.add(b.mul(self.t, c64(K)), c64(j))]))
                b.call(O.axpy(self.m), [o, b.gep(gy, [b.mul(row, c64(dp))]), b.load(b.gep(wts, [c64(j)])),
                                        c64(1 if j == 0 else 0), rlo, rhi])
            if n.shared_hidden:
                gate = b.load(b.gep(b.bitcast(route, P(f32)), [c64(2 * K)]))
                b.call(O.axpy(self.m), [o, b.gep(shared, [b.mul(self.t, c64(dp))]), gate, c64(0), rlo, rhi])

    def step_head(self, b, step):
        t = self.tensors[step.tensors[0]]
        first = self.logits_from if self.multi else None
        # a prompt needs the last token's logits only: the head runs for tokens [LOGITS_FROM, NTOK)
        self.dense_mv(b, step, t, t.layout, t.dtype.quantised, first=first)
        cap = self.g[step.op].softcap
        if cap:  # Gemma 2's final soft-cap, on this thread's own logit rows (no barrier: it wrote them itself)
            lo, hi = self.rows(b, t.layout.n_tile_rows)
            vocab = c64(self.cfg.vocab_size)
            lo, hi = b.mul(lo, c64(self.tr)), b.mul(hi, c64(self.tr))
            hi = b.select(b.icmp_signed("<", hi, vocab), hi, vocab)
            with self.each_token(b, first):
                b.call(O.softcap_rows(self.m, float(cap)), [self.value_ptr(b, step.writes[0]), lo, hi])


def _drop_function(m: ir.Module, fn: ir.Function) -> None:
    """Remove a function nothing calls yet from the module (a stage that duplicated a kept one)."""
    del m.globals[fn.name]
    m.scope._useset.discard(fn.name)  # llvmlite has no public removal; the name is then free again


def _const_array(m: ir.Module, name: str, ty, values) -> ir.GlobalVariable:
    """An internal constant global array `name` of ty."""
    aty = ir.ArrayType(ty, len(values))
    g = ir.GlobalVariable(m, aty, name)
    g.linkage = "internal"
    g.global_constant = True
    g.initializer = ir.Constant(aty, values)
    return g


def build_step(state, isa: ISA | str, max_seq: int, profile: bool = False, segmented: bool = False,
               tmax: int = 1, kv: str = "f32", tuning: dict | None = None,
               bf16_unit: str = "") -> StepProgram:
    """Build the decode-step module for a lowered state (see module docstring).

    profile: also record cycle-counter stamps (binding PROF: i64[threads + 1][n_stages + 1]): worker 0's after
        every stage's barrier (row 0), each thread's on reaching every barrier and on starting (row 1 + tid).
    segmented: each call runs only stages [params[STAGE_LO], params[STAGE_HI]) (the disk expert tier).
    tmax > 1: also the multi-token body (params[MODE] = PREFILL), up to tmax tokens per call.
    kv: the KV cache's element type, 'f32', 'f16' or 'bf16' (attention.attention).
    bf16_unit: kv='bf16' attention's dot products on the tile unit ('amx'), AVX512_BF16's VDPBF16PS ('dpbf16') or
        an FMA emulation of it ('') (Target.bf16_unit).
    tuning: {kernel key: knobs} from codegen.tune (schedule knobs of the mat-vec kernels) and codegen.attn_tune (the
    attention core's prefetch distance); numerics unchanged.
    """
    if kv not in KV_BYTES:
        raise CodegenError(f"KV cache type must be one of {', '.join(KV_BYTES)}, not {kv!r}")
    if max_seq < 1:
        raise CodegenError(f"max_seq must be >= 1, got {max_seq}")
    if tmax < 1:
        raise CodegenError(f"tokens per call must be >= 1, got {tmax}")
    em = _Emitter(state, isa, max_seq, profile, segmented, tmax, kv, tuning, bf16_unit)
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
