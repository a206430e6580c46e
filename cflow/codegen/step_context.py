"""What every part of the step's emission shares: the module, the pointer table, the stage descriptor, where
values and scratch live, the token loop, the kernels and each thread's rows.

Stage: codegen. StepContext is the state codegen/step.py's emitter (the stages, the dense steps) and
codegen/moe.py's (the experts) both build on; which steps a stage holds, and how each phase is emitted,
is theirs.
"""

from __future__ import annotations

import contextlib
import math

from llvmlite import ir

from ..layout.packed import Form
from ..layout.quant import BLOCK, DType, act_planes, padded
from ..layout.tile import TileLayout
from ..passes.schedule import Pool
from . import kernels as K
from . import ops as O
from .abi import Binding, BindingKey, Param, ScratchLayout, scratch_layout
from .cgutils import Loop, P, c64, f32, i8, i32, i64
from .target import ISA
from .tune import kernel_key


def tensor_key(name: str) -> BindingKey:
    return BindingKey(Binding.TENSOR, name)


def _pl(planes: int) -> tuple:
    """A kernel name's suffix for its activation planes (none for one: the names predate two)."""
    return () if planes == 1 else (f"p{planes}",)


class StepContext:
    """The emission state of one step module. The pointer table (slot, pointer) and, inside a stage function, its
    descriptor (k); pool values and scratch fields at the current token (value_ptr, scratch_ptr, each_token);
    kernels emitted once per specialisation (matvec_fn, matmat_fn, quant_fn); a thread's share of a matrix
    (rows) and the calls every step makes (prologue, call_mv, quantise_input). open_function sets the values a
    stage function reads (ptrs, tid, nth, the scratch, token, position; multi: the call's token tables)."""

    def __init__(self, compiled, isa: ISA, max_seq: int, profile: bool = False, tmax: int = 1, kv: str = "f32",
                 tuning: dict | None = None, bf16_unit: str = "", activations: str = "q8"):
        self.profile = profile
        self.activations = activations  # quant.ACT_FORMATS: the int8 activation's planes per point (planes())
        # this host's measured choices: {codegen.tune.kernel_key: mat-vec knobs, attn_tune.attention_key: the
        # attention core's {"kv_prefetch": bytes}}
        self.tuning = tuning or {}
        self.kv = kv
        self.bf16_unit = bf16_unit if kv == "bf16" else ""  # kv='bf16': the dot products' unit (Target.bf16_unit)
        self.tmax = tmax  # tokens per prefill call (1: a decode-only program)
        self.multi = False  # emitting the multi-token body (prefill) rather than the decode step
        self.t = None  # the token index inside a multi-token loop (an IR value), else None: token 0
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
        self.scratch = scratch_layout(cfg, self.tensors, max_seq, tmax, activations)  # the memory check's
        self.strides = self._pool_strides()
        self.desc: list[int] | None = None  # the descriptor of the stage function being emitted (self.k)
        self.desc_b = self.desc_arg = None

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

    def planes(self, *dtypes) -> int:
        """The int8 planes of one quantised activation that matrices of `dtypes` read (quant.act_planes): every
        quantisation and every kernel reading it are emitted for that many."""
        return act_planes(self.activations, dtypes)

    def matmat_fn(self, layout: TileLayout, gate_up: bool = False, planes: int = 1):
        # NOTE: keyed without the row count: one mat-mat serves every matrix of a width (JIT time).
        act, suffix = self.gate_act(gate_up)
        key = ("mm", layout.dtype.label, layout.cols, layout.tr, layout.tc, int(gate_up)) + suffix + _pl(planes)
        fn = self.fns.get(key)
        if fn is None:
            fn = K.emit_matmat(self.m, "_".join(map(str, key)), layout, self.isa, self.scratch.token_bytes("xq"),
                               tail=self.matvec_fn(layout, gate_up, planes), linkage="internal", gate_up=gate_up,
                               act=act, act_blocks=self.scratch.kmax // BLOCK, planes=planes)
            self.fns[key] = fn
        return fn

    def matvec_fn(self, layout: TileLayout, gate_up: bool = False, planes: int = 1):
        act, suffix = self.gate_act(gate_up)
        key = ("mv", layout.dtype.label, layout.cols, layout.tr, layout.tc, int(gate_up)) + suffix + _pl(planes)
        fn = self.fns.get(key)  # (rows: no matter)
        if fn is None:
            # the knobs tuned for the one-plane kernel: schedule-only, its second dot per chunk changes no offset
            knobs = self.tuning.get(kernel_key(layout, gate_up), {})
            fn = K.emit_matvec(self.m, "_".join(map(str, key)), layout, self.isa, linkage="internal", gate_up=gate_up,
                               act=act, planes=planes, **knobs)
            self.fns[key] = fn
        return fn

    def quant_fn(self, cols: int, cols_p: int, planes: int = 1):
        key = ("quant", cols, cols_p) + _pl(planes)
        fn = self.fns.get(key)
        if fn is None:
            fn = K.emit_quantize_act(self.m, "_".join(map(str, key)), cols, cols_p, linkage="internal", planes=planes)
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

    def prologue(self, b, step, layout_cols: int, quantised: bool, dtype: DType | None = None, cols_p=None,
                 planes: int = 1):
        """Normalise (or copy) the step's input into this thread's xn, then int8-quantise it if needed (padded to
        what `dtype`'s kernels read, or to cols_p; `planes` int8 planes)."""
        src = step.full_reads[0]
        xn = self.scratch_ptr(b, "xn")
        if cols_p is None:
            cols_p = self.cols_p(layout_cols, dtype) if dtype is not None else padded(layout_cols, self.tc)
        if step.norm:
            norm_w = self.pointer(b, tensor_key(step.norm))
            b.call(O.rmsnorm(self.m, self.d, max(cols_p, self.dp), self.cfg.norm_eps),
                   [self.value_ptr(b, src), norm_w, xn])
        if quantised:
            b.call(self.quant_fn(layout_cols, cols_p, planes),
                   [xn, self.scratch_ptr(b, "xq", i8), self.scratch_ptr(b, "xd"), self.scratch_ptr(b, "xs", i32)])
        return xn

    def call_mv(self, b, layout, w, x, out, lo, hi, gate_up=False, x_stride=None, y_stride=None, first=None,
                planes: int = 1):
        """out = W x for this thread's tile-rows: one token (decode, or inside a token loop), or, in a
        multi-token body outside a token loop, every token [first, ntok) through the mat-mat kernel
        (x and out then point at token 0's row; x_stride, y_stride: floats between tokens' rows); the quantised
        activation in `planes` int8 planes (as its quantiser wrote it)."""
        xq, xd, xs = self.scratch_ptr(b, "xq", i8), self.scratch_ptr(b, "xd"), self.scratch_ptr(b, "xs", i32)
        if not self.multi or self.t is not None:
            b.call(self.matvec_fn(layout, gate_up, planes), [w, x, xq, xd, xs, out, lo, hi])
            return
        kb = self.scratch.kmax // BLOCK
        n = self.ntok
        if first is not None:
            x, out = b.gep(x, [b.mul(first, c64(x_stride))]), b.gep(out, [b.mul(first, c64(y_stride))])
            xq, xd, xs = (b.gep(xq, [b.mul(first, c64(self.scratch.token_bytes("xq")))]),
                          b.gep(xd, [b.mul(first, c64(kb))]), b.gep(xs, [b.mul(first, c64(kb))]))
            n = b.sub(n, first)
        b.call(self.matmat_fn(layout, gate_up, planes),
               [w, x, xq, xd, xs, out, lo, hi, n, c64(x_stride), c64(y_stride)])

    def out_stride(self, value: str) -> int:
        return self.strides[self.sched.buffers[value].pool]

    def quantise_input(self, b, x, cols: int, dtype: DType, planes: int = 1):
        if dtype.quantised:
            b.call(self.quant_fn(cols, self.cols_p(cols, dtype), planes),
                   [x, self.scratch_ptr(b, "xq", i8), self.scratch_ptr(b, "xd"), self.scratch_ptr(b, "xs", i32)])

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
