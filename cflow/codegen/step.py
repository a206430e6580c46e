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

The emission is in three parts: _Emitter here (stages, bodies, the dense steps), on a StepContext
(codegen/step_context.py: pointer table, values, scratch, token loop, kernels) that MoEEmitter
(codegen/moe.py: routing and the experts) shares; the ops it calls are in ops.py, attention.py,
threads.py and kernels.py.
"""

from __future__ import annotations

import contextlib

import attrs
from llvmlite import ir

from ..errors import CodegenError
from ..ir import DenseFFN, ExpertBank
from ..layout.packed import Form
from ..layout.quant import ACT_FORMATS
from ..passes.manager import Pass, state_pass
from ..passes.pack import post_norm_tensor, qkv_tensor
from ..passes.schedule import Phase, Pool
from . import attention as A
from . import blockdot, threads
from . import ops as O
from .abi import (
    JOIN_SYMBOL,
    KICK_SYMBOL,
    KV_BYTES,
    STEP_SYMBOL,
    WORKER_SYMBOL,
    BarrierWord,
    Binding,
    BindingKey,
    Mode,
    Param,
    ScratchLayout,
    kv_floats_per_layer,
)
from .attn_tune import attention_key
from .cgutils import Loop, P, c32, c64, f32, i8, i16, i32, i64, intrinsic, opaque, void
from .moe import MoEEmitter
from .step_context import StepContext, tensor_key
from .target import ISA

STEP_ARGS = (P(P(i8)), P(i64), i64, i64, P(i32))  # see abi.py: ptrs, params, tid, nthreads, barrier
STAGE_ARGS = STEP_ARGS + (P(i64),)  # a stage function's: the step's, then its descriptor (emit_body)


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


class _Emitter(StepContext):
    """The step module: one function per distinct stage, the bodies that run them (the decode step and the
    multi-token call), the exported entry and the workers. The dense steps are emitted here, an expert bank's
    by MoEEmitter; both on the StepContext this is."""

    def __init__(self, compiled, isa: ISA, max_seq: int, profile: bool = False, segmented: bool = False,
                 tmax: int = 1, kv: str = "f32", tuning: dict | None = None, bf16_unit: str = "",
                 activations: str = "q8"):
        super().__init__(compiled, isa, max_seq, profile, tmax, kv, tuning, bf16_unit, activations)
        self.segmented = segmented
        self.stage_counts: dict[str, tuple[int, int]] = {}  # body -> (stages, distinct stage functions)
        self.moe = MoEEmitter(self)

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
                      Phase.CORE: self.step_core, Phase.O: self.step_o, Phase.ROUTE: self.moe.route,
                      Phase.UP: self.step_up, Phase.DOWN: self.step_down, Phase.HEAD: self.step_head}
        for step in stage:
            emit_phase[step.phase](b, step)
        b.ret_void()
        self.desc_b.position_at_end(entry)
        self.desc_b.branch(body)
        desc, self.desc, self.desc_b, self.desc_arg = self.desc, None, None, None
        return fn, desc

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
            i = opaque(b, si, name="si.opaque")
            call = b.load(b.gep(table, [c64(0), i]), name="stage_fn")
            desc = b.gep(desc_all, [c64(0), b.load(b.gep(offs, [c64(0), i]), name="desc_off")], name="desc")
            b.call(call, [self.ptrs, self.params, self.tid, self.nth, self.bar, desc])
            self.arrive(b, si, n)
            # The last stage ends with a barrier too: when thread 0 returns, every thread's work is done.
            b.call(threads.barrier(self.m, self.isa), [self.bar, self.nth])
            # A one-thread step the host has given up on (BarrierWord.ABORT) stops here: with more threads they
            # could not all agree on where, so those run to the end
            with b.if_then(b.icmp_signed("==", self.nth, c64(1))):  # (more threads never read the word)
                asked = b.load_atomic(b.gep(self.bar, [c32(BarrierWord.ABORT)]), "monotonic", 4)
                with b.if_then(b.icmp_signed("!=", asked, ir.Constant(i32, 0)), likely=False):
                    b.ret_void()
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
        threads.emit_workers(self.m, body, self.isa, WORKER_SYMBOL, KICK_SYMBOL, JOIN_SYMBOL)
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
        planes = self.planes(*(p.dtype for p in parts)) if parts else self.planes(L.dtype)
        with self.each_token(b, first):
            x = self.prologue(b, step, L.cols, quantised, cols_p=cols_p, planes=planes)
        if self.multi:
            x = self.scratch_ptr(b, "xn")  # token 0's row: the mat-mat walks the rows itself
        out = step.writes[0]
        w = self.pointer(b, tensor_key(t.name), i8)
        for Lp, row0, byte0 in (zip(parts, t.concat.row_offsets, t.concat.byte_offsets) if parts else [(L, 0, 0)]):
            lo, hi = self.rows(b, Lp.n_tile_rows)
            y = self.value_ptr(b, out)
            self.call_mv(b, Lp, b.gep(w, [c64(byte0)]) if byte0 else w, x, b.gep(y, [c64(row0)]) if row0 else y,
                         lo, hi, gate_up=gate_up, x_stride=self.scratch.kmax, y_stride=self.out_stride(out),
                         first=first, planes=planes)

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
        planes = self.planes(t.dtype)
        with self.each_token(b):
            self.quantise_input(b, self.value_ptr(b, value), cols, t.dtype, planes)
        lo, hi = self.rows(b, L.n_tile_rows)
        self.call_mv(b, L, self.pointer(b, tensor_key(t.name), i8), self.value_ptr(b, value), self.value_ptr(b, out),
                     lo, hi, x_stride=self.out_stride(value), y_stride=self.out_stride(out), planes=planes)

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
        self.moe.up(b, step, n)

    def step_down(self, b, step):
        n = self.g[step.op]
        if isinstance(n, DenseFFN):
            self._down(b, self.tensors[step.tensors[0]], step.full_reads[0], n.hidden, step.writes[0])
            return
        assert isinstance(n, ExpertBank)
        self.moe.down(b, step, n)

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
               bf16_unit: str = "", activations: str = "q8") -> StepProgram:
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
    activations: the quantised activations, 'q8' (int8) or 'q8x2' (two int8 planes where every reader of an
        activation is a 32-input block type: layout.quant.act_planes).
    """
    if kv not in KV_BYTES:
        raise CodegenError(f"KV cache type must be one of {', '.join(KV_BYTES)}, not {kv!r}")
    if max_seq < 1:
        raise CodegenError(f"max_seq must be >= 1, got {max_seq}")
    if tmax < 1:
        raise CodegenError(f"tokens per call must be >= 1, got {tmax}")
    if activations not in ACT_FORMATS:
        raise CodegenError(f"activations must be one of {', '.join(ACT_FORMATS)}, not {activations!r}")
    em = _Emitter(state, isa, max_seq, profile, segmented, tmax, kv, tuning, bf16_unit, activations)
    em.moe.reserve_tables(state.graph.nodes())  # expert tables first: contiguous whatever order steps use them in
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
