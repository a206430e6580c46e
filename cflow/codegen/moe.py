"""The MoE part of the step: routing, the experts' mat-vecs per token, and in a multi-token call the experts
grouped by the tokens that chose them.

Stage: codegen. MoEEmitter emits the ROUTE, UP and DOWN steps of an ExpertBank for codegen/step.py's emitter;
everything else it needs (the pointer table, values, scratch, token loop, kernels, row split) comes from the
StepContext it is given.
"""

from __future__ import annotations

from ..errors import CodegenError
from ..ir import ExpertBank
from ..layout.quant import BLOCK, DType, padded
from ..layout.tile import TileLayout
from ..passes.pack import expert_tensor, shared_tensor
from ..passes.schedule import Phase
from . import ops as O
from .abi import Binding, BindingKey
from .cgutils import Loop, P, alloca_once, c64, cf, f32, i8, i32, i64
from .step_context import StepContext, tensor_key

EXPERT_MATRICES = ("w_gate_up", "w_down")


class MoEEmitter:
    """The expert banks' steps, emitted into the StepContext cx: its pointer table (slot, pointer, k, ptrs), values
    and scratch (value_ptr, out_stride, scratch_ptr, scratch), token loop (each_token, multi, t, tmax), kernels
    and calls (prologue, quantise_input, call_mv, matmat_fn, quant_fn, cols_p, rows) and shapes (g, tensors, cfg,
    m, d, dp, unit, tr, profile)."""

    def __init__(self, cx: StepContext):
        self.cx = cx
        # routers a ROUTE step runs stages ahead of their experts (the UP step then reads the choice)
        self.routed_apart = {st.op for st in cx.sched.steps() if st.phase == Phase.ROUTE}

    def reserve_tables(self, nodes) -> None:
        """One contiguous run of pointer-table entries per bank and matrix, expert by expert (expert_pointer indexes
        it by the chosen expert), taken before any step so that steps may use the banks in any order."""
        for n in nodes:
            if isinstance(n, ExpertBank):
                for which in EXPERT_MATRICES:
                    for e in range(n.n_experts):
                        self.cx.slot(tensor_key(expert_tensor(n.prefix, e, which)))

    def up(self, b, step, n: ExpertBank):
        """The UP step: route (unless a ROUTE step did), then each chosen expert's gate_up mat-vec (and the shared
        expert's), per token, or grouped by expert in a multi-token call."""
        if self.grouped(n):
            self.experts_up_grouped(b, step, n)
            return
        with self.cx.each_token(b):  # experts: each token its own choice (per-token mat-vecs)
            self.experts_up(b, step, n)

    def down(self, b, step, n: ExpertBank):
        """The DOWN step: each chosen expert's down mat-vec and the weighted sum (plus the gated shared expert)."""
        # reserve contiguous pointer-table entries for every expert's down matrix, in order
        for k in range(n.n_experts):
            self.cx.slot(tensor_key(expert_tensor(n.prefix, k, "w_down")))
        if self.grouped(n):
            self.experts_down_grouped(b, step, n)
            return
        with self.cx.each_token(b):
            self.experts_down(b, step, n)

    def route(self, b, step):
        """A ROUTE step, the router alone: route[layer] = (top-k ids, weights) in every thread's scratch (all
        route alike)."""
        cx = self.cx
        router = cx.g[step.op]
        with cx.each_token(b):
            x = cx.prologue(b, step, cx.d, False)
            self.call_router(b, router, x, self.route_ptr(b, router.layer))

    def call_router(self, b, router, x, route):
        cx = self.cx
        b.call(O.router(cx.m, cx.d, router.n_experts, router.top_k, router.normalize),
               [x, cx.pointer(b, tensor_key(router.weight)), cx.scratch_ptr(b, "probs"), route])

    def experts_up(self, b, step, n: ExpertBank):
        cx = self.cx
        router = cx.g[n.inputs[1]]
        gu0 = cx.tensors[expert_tensor(n.prefix, 0, "w_gate_up")]
        L = gu0.layout
        x = cx.prologue(b, step, L.cols, False)
        route = self.route_ptr(b, n.layer)
        if router.name not in self.routed_apart:  # else a ROUTE step chose the experts stages ago
            self.call_router(b, router, x, route)
        planes = self.up_planes(n)
        cx.quantise_input(b, x, L.cols, gu0.dtype, planes)
        h = cx.value_ptr(b, step.writes[0])
        ip = padded(n.hidden, cx.unit)
        lo, hi = cx.rows(b, L.n_tile_rows)
        idx = b.bitcast(route, P(i32))
        for j in range(n.top_k):
            e = b.sext(b.load(b.gep(idx, [c64(j)])), i64)
            w = self.expert_pointer(b, n, "w_gate_up", e)
            cx.call_mv(b, L, w, x, b.gep(h, [c64(j * ip)]), lo, hi, gate_up=True, planes=planes)
            self.count_expert_rows(b, n, e, 0, lo, hi)
        if n.shared_hidden:
            st = cx.tensors[shared_tensor(n.prefix, "w_gate_up")]
            lo_s, hi_s = cx.rows(b, st.layout.n_tile_rows)
            cx.call_mv(b, st.layout, cx.pointer(b, tensor_key(st.name), i8), x, b.gep(h, [c64(n.top_k * ip)]),
                       lo_s, hi_s, gate_up=True, planes=planes)
            gate_out = b.gep(b.bitcast(route, P(f32)), [c64(2 * n.top_k)])
            if n.shared_gate:
                b.call(O.sigmoid_dot(cx.m, cx.d),
                       [cx.pointer(b, tensor_key(f"{n.prefix}.shared_gate")), x, gate_out])
            else:
                b.store(cf(1.0), gate_out)

    def experts_down(self, b, step, n: ExpertBank):
        cx = self.cx
        out = cx.value_ptr(b, step.writes[0])
        h = cx.value_ptr(b, step.full_reads[0])
        t0 = cx.tensors[expert_tensor(n.prefix, 0, "w_down")]
        L = t0.layout
        route = self.route_ptr(b, n.layer)
        idx, wts = b.bitcast(route, P(i32)), b.gep(b.bitcast(route, P(f32)), [c64(n.top_k)])
        tmp = cx.scratch_ptr(b, "tmp")
        lo, hi = cx.rows(b, L.n_tile_rows)
        rlo, rhi = b.mul(lo, c64(cx.tr)), b.mul(hi, c64(cx.tr))
        ip = padded(n.hidden, cx.unit)
        for j in range(n.top_k):
            e = b.sext(b.load(b.gep(idx, [c64(j)])), i64)
            x = b.gep(h, [c64(j * ip)])
            cx.quantise_input(b, x, n.hidden, t0.dtype, cx.planes(t0.dtype))
            cx.call_mv(b, L, self.expert_pointer(b, n, "w_down", e), x, tmp, lo, hi, planes=cx.planes(t0.dtype))
            self.count_expert_rows(b, n, e, 1, lo, hi)
            b.call(O.axpy(cx.m), [out, tmp, b.load(b.gep(wts, [c64(j)])), c64(1 if j == 0 else 0), rlo, rhi])
        if n.shared_hidden:
            st = cx.tensors[shared_tensor(n.prefix, "w_down")]
            x = b.gep(h, [c64(n.top_k * ip)])
            cx.quantise_input(b, x, n.shared_hidden, st.dtype, cx.planes(st.dtype))
            cx.call_mv(b, st.layout, cx.pointer(b, tensor_key(st.name), i8), x, tmp, lo, hi, planes=cx.planes(st.dtype))
            gate = b.load(b.gep(b.bitcast(route, P(f32)), [c64(2 * n.top_k)]))
            b.call(O.axpy(cx.m), [out, tmp, gate, c64(0), rlo, rhi])

    def count_expert_rows(self, b, n: ExpertBank, e, which: int, lo, hi) -> None:
        """Profiling builds: expert_rows[layer][e][which] += this thread's tile-rows of one pass over the matrix
        (which: 0 gate_up, 1 down; atomic, every thread adds its share), so a test can count passes."""
        cx = self.cx
        if not cx.profile:
            return
        rows = cx.pointer(b, BindingKey(Binding.EXPERT_ROWS), i64)
        idx = b.add(cx.k(2 * n.layer * cx.cfg.n_experts, "rows_off"), b.add(b.mul(e, c64(2)), c64(which)))
        b.atomic_rmw("add", b.gep(rows, [idx]), b.sub(hi, lo), "monotonic")

    def expert_pointer(self, b, n: ExpertBank, which: str, e):
        """Pointer to expert e's tensor: one table entry per expert, so only the chosen ones are touched."""
        cx = self.cx
        base = cx.slot(tensor_key(expert_tensor(n.prefix, 0, which)))
        for k in range(1, n.n_experts):
            if cx.slot(tensor_key(expert_tensor(n.prefix, k, which))) != base + k:
                raise CodegenError("expert pointer table is not contiguous")
        p = b.load(b.gep(cx.ptrs, [b.add(cx.k(base, "experts"), e)]), align=8)
        return p

    # --- experts in a multi-token call: tokens grouped by the expert they chose --------------------
    # Each expert with at least one token of the block is multiplied once, by the mat-mat, against the
    # int8 inputs of exactly its tokens (gathered into scratch gq/gd/gs), so its tiles are read once per
    # call however many tokens chose it, and an expert nobody chose is not touched. Every thread routes
    # alike, so every thread builds the same groups in the same order and needs no barrier for them.
    # Per output the arithmetic is the per-token path's (the mat-mat equals the mat-vec bit for bit; the
    # weighted sum of a token's experts is still taken in its top-k order), so results are bit-identical.
    def grouped(self, n: ExpertBank) -> bool:
        cx = self.cx
        if not (cx.multi and cx.t is None and cx.scratch.grouped):
            return False
        # float experts read float inputs, which are not gathered: they keep the per-token mat-vecs
        return all(cx.tensors[expert_tensor(n.prefix, 0, w)].dtype.quantised
                   for w in ("w_gate_up", "w_down"))

    def route_ptr(self, b, layer: int):
        """Token t's route record of a layer: i32 idx[k], f32 w[k], f32 shared gate."""
        cx = self.cx
        return b.gep(cx.scratch_ptr(b, "route", i8), [cx.k(layer * cx.scratch.route_stride, "route_off")])

    def group_tokens(self, b, n: ExpertBank, e):
        """Fill gtok/gj with the block's tokens that chose expert e (token order) and return their count."""
        cx = self.cx
        count = alloca_once(b, i64, "group.n")
        b.store(c64(0), count)
        gtok, gj = cx.scratch_ptr(b, "gtok", i64), cx.scratch_ptr(b, "gj", i64)
        with cx.each_token(b):
            idx = b.bitcast(self.route_ptr(b, n.layer), P(i32))
            for j in range(n.top_k):
                with b.if_then(b.icmp_signed("==", b.sext(b.load(b.gep(idx, [c64(j)])), i64), e)):
                    k = b.load(count)
                    b.store(cx.t, b.gep(gtok, [k]))
                    b.store(c64(j), b.gep(gj, [k]))
                    b.store(b.add(k, c64(1)), count)
        return b.load(count)

    def group_matmat(self, b, layout: TileLayout, w, n_tok, out, y_stride: int, gate_up: bool = False,
                     planes: int = 1):
        """out[k] = W x_k for the gathered inputs k < n_tok (`planes` int8 planes), this thread's tile-rows."""
        cx = self.cx
        lo, hi = cx.rows(b, layout.n_tile_rows)
        gq, gd, gs = cx.scratch_ptr(b, "gq", i8), cx.scratch_ptr(b, "gd"), cx.scratch_ptr(b, "gs", i32)
        b.call(cx.matmat_fn(layout, gate_up, planes), [w, cx.scratch_ptr(b, "gy"), gq, gd, gs, out, lo, hi, n_tok,
                                                       c64(cx.scratch.kmax), c64(y_stride)])

    def up_planes(self, n: ExpertBank) -> int:
        """The planes of the experts' gate+up input: one quantisation read by every expert and the shared expert."""
        cx = self.cx
        dts = [cx.tensors[expert_tensor(n.prefix, 0, "w_gate_up")].dtype]
        if n.shared_hidden:
            dts.append(cx.tensors[shared_tensor(n.prefix, "w_gate_up")].dtype)
        return cx.planes(*dts)

    def gather_row(self, b, t, k):
        """Copy token t's quantised input (xq, xd, xs; every plane) into gathered row k."""
        cx = self.cx
        kb = cx.scratch.kmax // BLOCK
        for field, g, words in (("xq", "gq", cx.scratch.token_bytes("xq") // 4), ("xd", "gd", kb),
                                ("xs", "gs", kb)):  # 4-byte words
            src = b.gep(cx.scratch_ptr(b, field, i8), [b.mul(t, c64(cx.scratch.token_bytes(field)))])
            dst = b.gep(cx.scratch_ptr(b, g, i8), [b.mul(k, c64(cx.scratch.token_bytes(field)))])
            b.call(O.copy_words(cx.m), [b.bitcast(dst, P(i32)), b.bitcast(src, P(i32)), c64(0), c64(words)])

    def quantise_row(self, b, x, k, cols: int, dtype: DType, planes: int = 1):
        """Quantise x into gathered row k (the per-token quantisation, written where the mat-mat reads it)."""
        cx = self.cx
        kb = cx.scratch.kmax // BLOCK
        b.call(cx.quant_fn(cols, cx.cols_p(cols, dtype), planes),
               [x, b.gep(cx.scratch_ptr(b, "gq", i8), [b.mul(k, c64(cx.scratch.token_bytes("xq")))]),
                b.gep(cx.scratch_ptr(b, "gd"), [b.mul(k, c64(kb))]),
                b.gep(cx.scratch_ptr(b, "gs", i32), [b.mul(k, c64(kb))])])

    def experts_up_grouped(self, b, step, n: ExpertBank):
        cx = self.cx
        router = cx.g[n.inputs[1]]
        gu0 = cx.tensors[expert_tensor(n.prefix, 0, "w_gate_up")]
        L = gu0.layout
        planes = self.up_planes(n)
        with cx.each_token(b):  # every token: norm, route (unless a ROUTE step did), int8 input
            x = cx.prologue(b, step, L.cols, False)
            if router.name not in self.routed_apart:
                self.call_router(b, router, x, self.route_ptr(b, n.layer))
            cx.quantise_input(b, x, L.cols, gu0.dtype, planes)
        ip = padded(n.hidden, cx.unit)
        h, hs = cx.value_ptr(b, step.writes[0]), cx.out_stride(step.writes[0])
        gy, gtok, gj = cx.scratch_ptr(b, "gy"), cx.scratch_ptr(b, "gtok", i64), cx.scratch_ptr(b, "gj", i64)
        lo, hi = cx.rows(b, L.n_tile_rows)
        rlo, rhi = b.mul(lo, c64(cx.tr)), b.mul(hi, c64(cx.tr))
        with Loop(b, c64(0), c64(n.n_experts), "e") as e:
            cnt = self.group_tokens(b, n, e)
            with b.if_then(b.icmp_signed(">", cnt, c64(0))):
                with Loop(b, c64(0), cnt, "g") as k:
                    self.gather_row(b, b.load(b.gep(gtok, [k])), k)
                self.group_matmat(b, L, self.expert_pointer(b, n, "w_gate_up", e), cnt, gy, ip, gate_up=True,
                                  planes=planes)
                self.count_expert_rows(b, n, e, 0, lo, hi)
                with Loop(b, c64(0), cnt, "g") as k:  # this thread's rows into h[t][j]
                    t, j = b.load(b.gep(gtok, [k])), b.load(b.gep(gj, [k]))
                    dst = b.gep(h, [b.add(b.mul(t, c64(hs)), b.mul(j, c64(ip)))])
                    b.call(O.copy_rows(cx.m), [dst, b.gep(gy, [b.mul(k, c64(ip))]), rlo, rhi])
        if n.shared_hidden:  # the shared expert is a dense matrix: one mat-mat over every token
            st = cx.tensors[shared_tensor(n.prefix, "w_gate_up")]
            lo_s, hi_s = cx.rows(b, st.layout.n_tile_rows)
            cx.call_mv(b, st.layout, cx.pointer(b, tensor_key(st.name), i8), cx.scratch_ptr(b, "xn"),
                       b.gep(h, [c64(n.top_k * ip)]), lo_s, hi_s, gate_up=True, x_stride=cx.scratch.kmax,
                       y_stride=hs, planes=planes)
            with cx.each_token(b):
                gate_out = b.gep(b.bitcast(self.route_ptr(b, n.layer), P(f32)), [c64(2 * n.top_k)])
                if n.shared_gate:
                    b.call(O.sigmoid_dot(cx.m, cx.d), [cx.pointer(b, tensor_key(f"{n.prefix}.shared_gate")),
                                                       cx.scratch_ptr(b, "xn"), gate_out])
                else:
                    b.store(cf(1.0), gate_out)

    def experts_down_grouped(self, b, step, n: ExpertBank):
        cx = self.cx
        out, os_ = cx.value_ptr(b, step.writes[0]), cx.out_stride(step.writes[0])
        h, hs = cx.value_ptr(b, step.full_reads[0]), cx.out_stride(step.full_reads[0])
        t0 = cx.tensors[expert_tensor(n.prefix, 0, "w_down")]
        L = t0.layout
        ip, dp, K = padded(n.hidden, cx.unit), cx.dp, n.top_k
        gy, gtok, gj = cx.scratch_ptr(b, "gy"), cx.scratch_ptr(b, "gtok", i64), cx.scratch_ptr(b, "gj", i64)
        gpos = cx.scratch_ptr(b, "gpos", i64)
        lo, hi = cx.rows(b, L.n_tile_rows)
        rlo, rhi = b.mul(lo, c64(cx.tr)), b.mul(hi, c64(cx.tr))
        used = alloca_once(b, i64, "group.rows")  # gy rows taken by the experts done so far
        b.store(c64(0), used)
        with Loop(b, c64(0), c64(n.n_experts), "e") as e:
            cnt = self.group_tokens(b, n, e)
            with b.if_then(b.icmp_signed(">", cnt, c64(0))):
                first = b.load(used)
                with Loop(b, c64(0), cnt, "g") as k:
                    t, j = b.load(b.gep(gtok, [k])), b.load(b.gep(gj, [k]))
                    self.quantise_row(b, b.gep(h, [b.add(b.mul(t, c64(hs)), b.mul(j, c64(ip)))]), k, n.hidden,
                                      t0.dtype, cx.planes(t0.dtype))
                    b.store(b.add(first, k), b.gep(gpos, [b.add(b.mul(t, c64(K)), j)]))
                self.group_matmat(b, L, self.expert_pointer(b, n, "w_down", e), cnt,
                                  b.gep(gy, [b.mul(first, c64(dp))]), dp, planes=cx.planes(t0.dtype))
                self.count_expert_rows(b, n, e, 1, lo, hi)
                b.store(b.add(first, cnt), used)
        shared = b.gep(gy, [c64(cx.tmax * K * dp)])  # token t's shared-expert output at row tmax*K + t
        if n.shared_hidden:
            st = cx.tensors[shared_tensor(n.prefix, "w_down")]
            with cx.each_token(b):
                cx.quantise_input(b, b.gep(cx.value_ptr(b, step.full_reads[0]), [c64(K * ip)]), n.shared_hidden,
                                  st.dtype, cx.planes(st.dtype))
            cx.call_mv(b, st.layout, cx.pointer(b, tensor_key(st.name), i8), b.gep(h, [c64(K * ip)]), shared,
                       lo, hi, x_stride=hs, y_stride=dp, planes=cx.planes(st.dtype))
        with cx.each_token(b):  # each token's weighted sum, in its top-k order (as the per-token path)
            route = self.route_ptr(b, n.layer)
            wts = b.gep(b.bitcast(route, P(f32)), [c64(K)])
            o = b.gep(out, [b.mul(cx.t, c64(os_))])
            for j in range(K):
                row = b.load(b.gep(gpos, [b.add(b.mul(cx.t, c64(K)), c64(j))]))
                b.call(O.axpy(cx.m), [o, b.gep(gy, [b.mul(row, c64(dp))]), b.load(b.gep(wts, [c64(j)])),
                                      c64(1 if j == 0 else 0), rlo, rhi])
            if n.shared_hidden:
                gate = b.load(b.gep(b.bitcast(route, P(f32)), [c64(2 * K)]))
                b.call(O.axpy(cx.m), [o, b.gep(shared, [b.mul(cx.t, c64(dp))]), gate, c64(0), rlo, rhi])
