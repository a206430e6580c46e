"""codegen.kernels: every mat-vec path against the NumPy oracle built from ir.quant."""

import ctypes

import numpy as np
import pytest
from llvmlite import ir

from cflow.codegen import kernels as K
from cflow.codegen.library import Library
from cflow.codegen.target import ISA, generic_target, host_target
from cflow.layout import tile as T
from cflow.layout.quant import DType, QTensor, act_buffers, act_codes, dequantize, quantize, quantize_activation_q8
from tests._isa import isa_target as _isa_target

HOST = host_target(env=False)


def isa_target(isa):
    """A target whose auto-selected ISA is `isa` (the paths below the host's best forced through features)."""
    t = _isa_target(isa)
    if t is None:
        pytest.skip(f"this host cannot run the {isa} kernels")
    return t


def oracle(w, dtype, x):
    """float64 reference with the kernels' arithmetic: exact int block dots, then the two scales."""
    t = quantize(w, dtype)
    if dtype in ("q4", "q8"):
        aq, ad = quantize_activation_q8(x)
        codes = t.q.astype(np.int64) - (8 if dtype == "q4" else 0)
        nb = codes.shape[1]
        isum = (codes * aq[None, :nb].astype(np.int64)).sum(-1)
        return (isum * t.scales.astype(np.float64) * ad[None, :nb].astype(np.float64)).sum(-1)
    return dequantize(t).astype(np.float64) @ x.astype(np.float64)


def check(y, ref, dtype):
    tol = 1e-5 if dtype in ("q4", "q8") else 1e-4
    assert np.abs(y - ref).max() <= tol * np.abs(ref).max(), np.abs(y - ref).max() / np.abs(ref).max()


@pytest.mark.parametrize("isa", list(ISA))
@pytest.mark.parametrize("dtype", ["q4", "q8", "f16", "f32"])
@pytest.mark.parametrize("rows,cols,tile", [(100, 70, (32, 64)), (48, 96, (16, 32)), (64, 512, (32, 256))])
def test_matvec_vs_oracle(rng, isa, dtype, rows, cols, tile):
    target = isa_target(isa)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    x = rng.standard_normal(cols).astype(np.float32)
    mv = K.MatVec(T.TileLayout(dtype, rows, cols, tile), target=target, cache=False)
    assert mv.isa == isa
    y = mv(T.pack(w, dtype, tile), mv.activation(x))
    check(y[:rows], oracle(w, dtype, x), dtype)
    assert not y[rows:].any()  # padded rows come out exactly zero


@pytest.mark.parametrize("cols", [32, 70, 256, 33])
def test_quantize_act_bit_exact(rng, cols):
    x = rng.standard_normal(cols).astype(np.float32) * 3
    x[:4] = [0.5, -0.5, 2.5, -1.5]  # ties after scaling are likely in this block
    if cols > 40:
        x[32:40] = 0.0
    mv = K.MatVec(T.TileLayout("q4", 16, cols, (16, 64)), cache=False)
    act = mv.activation(x)
    q, d = quantize_activation_q8(x)
    nb = q.shape[0]
    np.testing.assert_array_equal(act.xq.reshape(-1, 32)[:nb], q)
    np.testing.assert_array_equal(act.xd[:nb], d)
    np.testing.assert_array_equal(act.xs[:nb], q.astype(np.int32).sum(-1))
    assert not act.xq.reshape(-1, 32)[nb:].any() and not act.xd[nb:].any()  # padding blocks are zero


def test_quantize_act_rounds_half_away_from_zero():
    x = np.zeros(32, np.float32)
    x[0] = 127.0  # d = 1 exactly, so x/d is exact and 2.5 must become 3, -0.5 -> -1
    x[1:5] = [2.5, -0.5, 0.5, -2.5]
    mv = K.MatVec(T.TileLayout("q8", 16, 32, (16, 32)), cache=False)
    act = mv.activation(x)
    assert list(act.xq[:5]) == [127, 3, -1, 1, -3]


@pytest.mark.parametrize("dtype", ["q4", "f32"])
def test_row_ranges_touch_only_their_rows(rng, dtype):
    tile = (16, 32)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    x = rng.standard_normal(64).astype(np.float32)
    mv = K.MatVec(T.TileLayout(dtype, 64, 64, tile), cache=False)
    buf, act, ref = T.pack(w, dtype, tile), mv.activation(x), oracle(w, dtype, x)
    y = np.full(64, np.nan, np.float32)
    mv(buf, act, y, 1, 3)  # tile-rows 1 and 2 = rows 16..47
    assert np.isnan(y[:16]).all() and np.isnan(y[48:]).all()
    check(y[16:48], ref[16:48], dtype)
    mv(buf, act, y, 0, 1)
    mv(buf, act, y, 3, 4)  # two threads' worth of ranges compose into the whole vector
    check(y, ref, dtype)


@pytest.mark.parametrize("isa", ["avx512vnni", "generic"])
@pytest.mark.parametrize("dtype", ["q4", "q8", "f16"])
def test_gate_up_fused_silu(rng, isa, dtype):
    target = isa_target(isa)
    g, u = (rng.standard_normal((40, 96)).astype(np.float32) for _ in range(2))
    x = rng.standard_normal(96).astype(np.float32)
    tile = (16, 64)
    mv = K.MatVec(T.gate_up_layout(40, 96, dtype, tile), target=target, cache=False, gate_up=True)
    h = mv(T.pack_gate_up(g, u, dtype, tile), mv.activation(x))
    gr, ur = oracle(g, dtype, x), oracle(u, dtype, x)
    check(h[:40], gr / (1 + np.exp(-gr)) * ur, dtype)


@pytest.mark.parametrize("tuning", [
    dict(unroll=1, prefetch=0), dict(max_groups=2), dict(prefetch=512, prefetch_locality=2),
    dict(max_groups=1, unroll=4),
])
def test_tuning_knobs_keep_results(rng, tuning):
    w = rng.standard_normal((96, 256)).astype(np.float32)
    x = rng.standard_normal(256).astype(np.float32)
    L = T.TileLayout("q4", 96, 256, (96, 128))
    mv = K.MatVec(L, cache=False, **tuning)
    check(mv(T.pack(w, "q4", L.tile), mv.activation(x))[:96], oracle(w, "q4", x), "q4")


@pytest.mark.parametrize("isa", list(ISA))
@pytest.mark.parametrize("dtype", ["q4", "q8", "f16", "f32"])
@pytest.mark.parametrize("tile,gate_up", [((128, 64), False), ((48, 64), False), ((32, 64), True)])
def test_group_loop_is_bit_identical(rng, isa, dtype, tile, gate_up):
    """group_loop=1 (one 16-row group per loop iteration) does each row's arithmetic in the same order as the
    unrolled unit loop: the same bits, for every ISA, dtype, a tile with an odd number of groups, gate+up and
    a row range."""
    target = isa_target(isa)
    rows, cols = 300, 200
    w, w2 = (rng.standard_normal((rows, cols)).astype(np.float32) for _ in range(2))
    x = rng.standard_normal(cols).astype(np.float32)
    L = T.gate_up_layout(rows, cols, dtype, tile) if gate_up else T.TileLayout(dtype, rows, cols, tile)
    buf = T.pack_gate_up(w, w2, dtype, tile) if gate_up else T.pack(w, dtype, tile)
    ys = []
    knob_sets = [dict(), dict(group_loop=1), dict(group_loop=1, prefetch=0)]
    if isa == "avx512vnni" and dtype in ("q4", "q8"):  # with the 256-bit dot and (Q4) the shift unpack
        knob_sets += [dict(group_loop=1, vector_bits=256)] + ([dict(group_loop=1, unpack=1)] if dtype == "q4" else [])
    for knobs in knob_sets:
        mv = K.MatVec(L, target=target, cache=False, gate_up=gate_up, **knobs)
        y = np.full(L.rows_p, np.nan, np.float32)
        mv(buf, mv.activation(x), y, 1, L.n_tile_rows)
        ys.append(y)
    assert np.isnan(ys[0][: L.tr]).all() and not np.isnan(ys[0][L.tr:]).any()
    for y in ys[1:]:
        np.testing.assert_array_equal(y, ys[0])


def test_concat_qkv_row_offsets(rng):
    parts = [rng.standard_normal((r, 64)).astype(np.float32) for r in (32, 8, 8)]
    x = rng.standard_normal(64).astype(np.float32)
    buf, cl = T.pack_concat(parts, "q4", (16, 32))
    mv = K.MatVec(cl.layout, cache=False)
    y = mv(buf, mv.activation(x))
    for p, r in zip(parts, cl.row_offsets):
        check(y[r : r + len(p)], oracle(p, "q4", x), "q4")


def test_internal_kernel_called_from_generated_code(rng):
    """The schedule emits kernels with internal linkage into its own module and calls them."""
    L = T.TileLayout("q4", 32, 64, (16, 32))
    mod = ir.Module(name="sched")
    q = K.emit_quantize_act(mod, "k_quant", L.cols, L.cols_p, linkage="internal")
    mv = K.emit_matvec(mod, "k_mv", L, HOST.isa, linkage="internal")
    vp = ir.IntType(8).as_pointer()
    f32p, i8p, i32p = ir.FloatType().as_pointer(), vp, ir.IntType(32).as_pointer()
    step = ir.Function(mod, ir.FunctionType(ir.VoidType(), [vp, f32p, i8p, f32p, i32p, f32p]), "step")
    b = ir.IRBuilder(step.append_basic_block())
    w, x, xq, xd, xs, y = step.args
    b.call(q, [x, xq, xd, xs])
    i64 = ir.IntType(64)
    b.call(mv, [w, x, xq, xd, xs, y, ir.Constant(i64, 0), ir.Constant(i64, L.n_tile_rows)])
    b.ret_void()
    lib = Library(name="sched", target=HOST, cache=False)
    lib.add_ir(mod)
    fn = lib.get_cfunc("step", None, *([ctypes.c_void_p] * 6))
    wts = rng.standard_normal((32, 64)).astype(np.float32)
    xv = rng.standard_normal(64).astype(np.float32)
    act = K.Activation(L.cols, L.cols_p)
    act.x[:] = xv
    y = np.zeros(L.rows_p, np.float32)
    buf = T.pack(wts, "q4", L.tile)
    fn(*(ctypes.c_void_p(a.ctypes.data) for a in (buf, act.x, act.xq, act.xd, act.xs, y)))
    check(y, oracle(wts, "q4", xv), "q4")
    assert "k_mv" not in [f.name for f in lib._final.functions if not f.is_declaration and f.linkage == 0]


def test_bad_arguments_raise():
    from cflow.errors import CodegenError

    L = T.TileLayout("q4", 16, 32, (16, 32))
    with pytest.raises(CodegenError):
        K.emit_matvec(ir.Module(), "m", L, "neon")
    mv = K.MatVec(L, cache=False)
    act = mv.activation(np.ones(32, np.float32))
    with pytest.raises(CodegenError):
        mv(np.zeros(10, np.uint8), act)
    with pytest.raises(CodegenError):
        mv(T.pack(np.ones((16, 32)), "q4", (16, 32)), act, r0=0, r1=2)


@pytest.mark.parametrize("k,w", [(1, 16), (3, 16), (5, 4), (8, 16), (12, 8)])
@pytest.mark.parametrize("gen", [False, True])
def test_hsum_many_is_each_vectors_halving_tree(k, w, gen):
    """Attention reduces a kv group's query heads side by side (cgutils.hsum_many): lane i must be bit for bit
    hsum(vecs[i]), the halving tree the one-head-at-a-time order and the interpreter use."""
    from cflow.codegen.cgutils import P, V, f32, hsum_many
    from cflow.codegen.library import compile_ir

    target = generic_target() if gen else HOST
    m = ir.Module(name="hm")
    m.triple = target.triple
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), [P(f32), P(f32)]), "f")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    x, y = fn.args
    vecs = [b.load(b.bitcast(b.gep(x, [ir.Constant(ir.IntType(64), i * w)]), P(V(f32, w))), align=4) for i in range(k)]
    b.store(hsum_many(b, vecs), b.bitcast(y, P(V(f32, k))), align=4)
    b.ret_void()
    lib = compile_ir(m, target=target, cache=False)
    f = lib.get_cfunc("f", None, ctypes.c_void_p, ctypes.c_void_p)
    rng = np.random.default_rng(k * w)
    v = (rng.standard_normal(k * w) * 10.0 ** rng.integers(-4, 8, k * w)).astype(np.float32)
    out = np.empty(k, np.float32)
    f(v.ctypes.data, out.ctypes.data)
    want = v.reshape(k, w)
    while want.shape[1] > 1:
        h = want.shape[1] // 2
        want = (want[:, :h] + want[:, h:]).astype(np.float32)
    assert out.tobytes() == want[:, 0].tobytes()


def _two_plane_oracle(w, dtype, x):
    """float64 twin of activations='q8x2' (quant.act_codes: 256 q1 + q2 on d/256): exact sums, then the scales."""
    t = quantize(w, dtype) if not isinstance(w, QTensor) else w
    c, s = act_codes(x, 2)
    codes = t.q.astype(np.int64) - (8 if t.dtype == DType.Q4 else 0)
    isum = (codes * c[None].astype(np.int64)).sum(-1)
    return (isum * t.scales.astype(np.float64) * s[None].astype(np.float64)).sum(-1)


@pytest.mark.parametrize("isa", list(ISA))
@pytest.mark.parametrize("dtype", ["q4", "q8"])
def test_two_plane_activations(rng, isa, dtype):
    """planes=2 (activations='q8x2'): the kernel's quantiser writes quant.act_buffers bit for bit on every path (a
    partial block, a zero block, padding blocks, ties, second codes clipped at +-127), and the mat-vec equals the
    float64 twin of the two-plane codes, also at the extremes: every activation at +-amax against every weight code
    at its largest magnitude (Q8 +-127 with the activation's sign, Q4 code 0 = -8) for the integer ranges; the group
    loop gives the same bits."""
    target = isa_target(isa)
    rows, cols, tile = 40, 166, (16, 64)  # 6 blocks: 5 full, a partial one (6 inputs), 2 of padding
    L = T.TileLayout(dtype, rows, cols, tile)
    mv = K.MatVec(L, target=target, cache=False, planes=2)
    x = rng.standard_normal(cols).astype(np.float32) * 3
    x[64:96] = 0.0
    x[96:104] = [127.0, 3.498046875, -3.498046875, 2.5, -2.5, 0.5, -0.5, 126.50195]  # d = 1: t exact
    act = mv.activation(x)
    xq, xd, xs = act_buffers(x, 2)
    assert xq.reshape(-1, 2, 32)[3, 1, 1:3].tolist() == [127, -127]  # 256 * 0.498046875 = 127.5 -> 128, clipped
    np.testing.assert_array_equal(act.xq[: xq.size], xq)
    np.testing.assert_array_equal(act.xd[: xd.size], xd)
    np.testing.assert_array_equal(act.xs[: xs.size], xs)
    assert not act.xq[xq.size :].any() and not act.xd[xd.size :].any() and not act.xs[xs.size :].any()
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    check(mv(T.pack(w, dtype, tile), act)[:rows], _two_plane_oracle(w, dtype, x), dtype)
    sign = np.where(rng.random(cols) < 0.5, -1.0, 1.0).astype(np.float32) if dtype == "q8" else np.ones(cols)
    xe = (sign * 5.0).astype(np.float32)  # |t| = 127: |256 q1 + q2| = 32512, the weights' codes with its sign
    we = np.broadcast_to(sign if dtype == "q8" else np.float32(-1.0), (rows, cols)).astype(np.float32)
    ye = mv(T.pack(we, dtype, tile), mv.activation(xe))[:rows]
    check(ye, _two_plane_oracle(we, dtype, xe), dtype)
    assert np.abs(ye).min() > 0.99 * 5 * cols  # every block's sum at its largest: 127 (or 8) x 32512 x 32
    if isa == HOST.isa:
        gl = K.MatVec(L, target=target, cache=False, planes=2, group_loop=1)
        np.testing.assert_array_equal(gl(T.pack(w, dtype, tile), gl.activation(x)), mv(T.pack(w, dtype, tile), act))


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", ["q4", "q4_k"])
def test_gate_up_kernel_calls_nothing(dtype, act):
    """The fused gate+up's activation is vector ops (cgutils.exp_vec), not llvm.exp: that lowered to 16 libm calls a
    vector, 128 a tile-row, and every vector register live across them was spilled (Q4_K's gate+up 1.07-1.18x
    faster without them, docs/journal/performance.md "The gate's exp")."""
    L = T.gate_up_layout(256, 512, dtype, (128, 256))
    mod = ir.Module("gu")
    K.emit_matvec(mod, "mv", L, HOST.isa, gate_up=True, act=act)
    lib = Library(name="gu", target=HOST, cache=False)
    lib.add_ir(mod)
    lib.finalize()
    assert "call" not in lib.get_asm_str()


@pytest.mark.parametrize("kind", ["mv", "mm"])
@pytest.mark.parametrize("dtype", ["q4", "q8", "q4_k", "f16"])
def test_a_groups_code_is_emitted_once_and_inlined(dtype, kind):
    """The tile-row loop calls one always-inlined function per kernel for each group x unrolled unit (x token), so
    the IR text holds a group's code once (kernels._group_function); after optimisation nothing of it is left as a
    function or a call. F16 / F32 units stay inline (their groups interleave input by input)."""
    L = T.TileLayout(dtype, 256, 512, (128, 256))
    mod = ir.Module("k")
    if kind == "mv":
        K.emit_matvec(mod, "k", L, HOST.isa, unroll=2)
    else:
        K.emit_matmat(mod, "k", L, HOST.isa, 1024)
    text = str(mod)
    groups = [line for line in text.splitlines() if line.startswith("define") and ".group" in line]
    if dtype == "f16":
        assert groups == []
        return
    assert len(groups) == (1 if kind == "mv" else 2)  # a mat-mat's own, and its one-token tail's
    assert all("alwaysinline" in line for line in groups)
    calls = text.count('@"k.group"(') + text.count('@"k_tail.group"(') + text.count('@"k.group.mm"(')
    assert calls >= L.groups_per_tile  # every group of a tile-row is a call
    lib = Library(name="k", target=HOST, cache=False)
    lib.add_ir(mod)
    lib.finalize()
    assert ".group" not in lib.get_llvm_str()


@pytest.mark.parametrize("dtype", ["q4_k", "q4_1"])
def test_a_fused_unit_loop_holds_its_tile_row_code_once(dtype):
    """A block type's unit loop in the fused gate+up kernel runs its two halves through one loop (kernels.
    emit_matvec): as many calls of the group's code as the plain kernel, not twice as many. Q4 / Q8 keep two
    copies (3-7% faster on AVX2)."""
    def group_calls(gate_up, dt=dtype):
        mod = ir.Module("k")
        K.emit_matvec(mod, "k", T.TileLayout(dt, 256, 512, (128, 256)), "avx512vnni", gate_up=gate_up, group_loop=0)
        return sum('call' in line and '@"k.group"(' in line for line in str(mod).splitlines())

    assert group_calls(True) == group_calls(False) > 0
    assert group_calls(True, "q4") == 2 * group_calls(False, "q4")


@pytest.mark.parametrize("isa", ["avx512vnni", "avx2"])
@pytest.mark.parametrize("dtype", ["q4", "q4_k"])
def test_group_calls_give_the_inline_code(dtype, isa):
    """The group function (kernels._group_function) is an emission change, not a code change: inlined by LLVM, it
    gives the assembly of the same kernel emitted with every group inline (benchmarks/jit_time.py --kernels
    compares 192 kernels this way against the tree before it)."""
    target = isa_target(isa)
    L = T.TileLayout(dtype, 256, 512, (128, 256))
    asm = {}
    for calls in (True, False):
        mod = ir.Module("k")
        K.emit_matvec(mod, "k", L, isa, unroll=2, group_calls=calls)
        lib = Library(name="k", target=target, cache=False)
        lib.add_ir(mod)
        lib.finalize()
        asm[calls] = lib.get_asm_str()
    assert asm[True] == asm[False]
