"""The multi-token mat-mat kernel: every token's output bit-identical to the decode mat-vec of it alone."""

import ctypes

import numpy as np
import pytest
from llvmlite import ir

from cflow.codegen import kernels as K
from cflow.codegen.library import Library
from cflow.codegen.target import ISA
from cflow.layout import tile as T
from cflow.layout.tile import TileLayout
from tests._isa import isa_target as _target


def _p(a):
    return ctypes.c_void_p(a.ctypes.data)


def _kernels(mod, target):
    """mod JIT-compiled: its library and the quantiser q, mat-vec mv and mat-mat mm as C functions."""
    lib = Library(name="t", target=target, cache=False)
    lib.add_ir(mod)
    lib.finalize()
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    return lib, (lib.get_cfunc("q", None, vp, vp, vp, vp), lib.get_cfunc("mv", None, vp, vp, vp, vp, vp, vp, i64, i64),
                 lib.get_cfunc("mm", None, vp, vp, vp, vp, vp, vp, i64, i64, i64, i64, i64))


ACTS = [(False, "silu"), (True, "silu"), (True, "gelu_tanh")]


def _act_ref(g, act):
    g = g.astype(np.float64)
    if act == "silu":
        return g / (1 + np.exp(-g))
    return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))


CASES = [(isa, dt, gu, act, 1, {}) for isa in ISA for dt in ("q4", "q8", "f16", "f32") for gu, act in ACTS]
# two-plane activations (q8x2): the strides and a gate on the vector paths (portable: tests/codegen/test_kernels.py)
CASES += [(ISA.AVX512VNNI, "q4", False, "silu", 2, {}), (ISA.AVX512VNNI, "q8", True, "gelu_tanh", 2, {}),
          (ISA.AVXVNNI, "q8", False, "silu", 2, {}), (ISA.AVX2, "q4", True, "silu", 2, {})]
# the VNNI paths' Q4 / Q8 units the way their built-in does not take them (kernels.matmat_q_units: AVX-VNNI chunk-major,
# AVX-512 token by token), and chunk-major with several row groups a pass
OTHER_WAY = {ISA.AVXVNNI: {"q_units": 0}, ISA.AVX512VNNI: {"q_units": 1}}
CASES += [(isa, dt, False, "silu", 1, knobs) for isa in OTHER_WAY for dt in ("q4", "q8")
          for knobs in (OTHER_WAY[isa], {"q_units": 1, "max_groups": 16})]
CASES += [(ISA.AVXVNNI, "q4", True, "silu", 2, {"q_units": 0}),
          (ISA.AVX512VNNI, "q4", False, "silu", 2, {"q_units": 1}),
          (ISA.AVXVNNI, "q8", True, "silu", 1, {"group_calls": False})]  # chunk-major inline, not as a call


@pytest.mark.parametrize("isa, dtype, gate_up, act, planes, knobs", CASES,
                         ids=[f"{i}-{d}-{a if g else 'matrix'}" + "-x2" * (p == 2)
                              + "".join(f"-{k}{v}" for k, v in kn.items()) for i, d, g, a, p, kn in CASES])
def test_matmat_equals_matvec_per_token(isa, dtype, gate_up, act, planes, knobs):
    """Every token of the multi-token kernel (full token groups of 8 or 4 and a tail) equals the decode kernel on
    it alone, and a gate kernel's output is its activation of the gate times the up projection: gate values of
    order 1 (where SiLU and tanh-GELU differ by up to 0.2), so a kernel computing the wrong one fails by far.
    planes 2: two-plane activations, their stride (2 x the one-plane's) apart from the scales' (blocks). knobs:
    emit_matmat's, over its built-ins."""
    target = _target(isa)
    if target is None:
        pytest.skip(f"host lacks {isa}")
    rng = np.random.default_rng(0)
    # Tiles of 32 rows (two 16-row groups, one pass like the default 128-row tile's eight): the same code with a
    # quarter of the mat-vec IR to JIT; two full tile-rows and a partial one. Whole models run these kernels at the
    # 128x256 tile (tests/runtime/test_prefill.py; on every ISA path test_activations.py, and every test with the
    # path forced by CFLOW_FEATURES).
    M, Kd, tile = 80, 200, (32, 256)
    L = TileLayout(dtype, M, Kd, tile)
    W = (rng.standard_normal((M, Kd)) / np.sqrt(Kd)).astype(np.float32)  # outputs of order 1
    w = T.pack_gate_up(W, W[::-1].copy(), dtype, tile) if gate_up else T.pack(W, dtype, tile)
    stride, ys = L.cols_p + 64, L.rows_p + 16  # strides wider than the rows: the kernel must honour them
    mod = ir.Module("t")
    K.emit_quantize_act(mod, "q", Kd, L.cols_p, planes=planes)
    # the mat-mat's tail tokens go through the mat-vec it is compared with, as a step pairs them
    # (step_context.matmat_fn)
    mv_fn = K.emit_matvec(mod, "mv", L, isa, gate_up=gate_up, act=act, planes=planes)
    K.emit_matmat(mod, "mm", L, isa, planes * stride, gate_up=gate_up, act=act, act_blocks=stride // 32,
                  planes=planes, tail=mv_fn, **knobs)
    if gate_up:
        K.emit_matvec(mod, "plain", L, isa, planes=planes)  # W x alone: the gate and up projections for the reference
    lib, (q, mv, mm) = _kernels(mod, target)
    n = 11  # a full group of 8 (or two of 4) and a tail
    X = np.zeros((n, stride), np.float32)
    X[:, :Kd] = rng.standard_normal((n, Kd))
    XQ = np.zeros((n, planes * stride), np.int8)
    XD = np.zeros((n, stride // 32), np.float32)
    XS = np.zeros((n, stride // 32), np.int32)
    for t in range(n):
        q(_p(X[t]), _p(XQ[t]), _p(XD[t]), _p(XS[t]))
    got = np.full((n, ys), 7.0, np.float32)
    want = np.full((n, ys), 7.0, np.float32)
    r0, r1 = 1, L.n_tile_rows  # a thread's share: tile-rows [1, 3)
    mm(_p(w), _p(X), _p(XQ), _p(XD), _p(XS), _p(got), r0, r1, n, stride, ys)
    for t in range(n):
        mv(_p(w), _p(X[t]), _p(XQ[t]), _p(XD[t]), _p(XS[t]), _p(want[t]), r0, r1)
    assert np.array_equal(got, want)
    assert (got[:, : r0 * L.tr] == 7.0).all()  # rows of other threads untouched
    if gate_up:  # act(gate x) * (up x), with gate x and up x from the plain kernel on each half of the stream
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        plain = lib.get_cfunc("plain", None, vp, vp, vp, vp, vp, vp, i64, i64)
        pairs = w.reshape(L.n_tile_rows, 2, L.tile_row_nbytes)
        halves = [np.ascontiguousarray(pairs[:, h]).reshape(-1) for h in range(2)]
        rows = slice(r0 * L.tr, r1 * L.tr)
        for t in range(n):
            g, u = (np.zeros(L.rows_p, np.float32) for _ in range(2))
            plain(_p(halves[0]), _p(X[t]), _p(XQ[t]), _p(XD[t]), _p(XS[t]), _p(g), 0, L.n_tile_rows)
            plain(_p(halves[1]), _p(X[t]), _p(XQ[t]), _p(XD[t]), _p(XS[t]), _p(u), 0, L.n_tile_rows)
            assert np.abs(g[rows]).max() > 1.0  # the activations differ where the test looks
            ref = _act_ref(g, act) * u
            np.testing.assert_allclose(got[t, rows], ref[rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["q4", "q8", "f16", "f32", "Q4_K", "Q3_K", "Q5_K", "IQ4_XS"])
def test_next_row_prefetch_asks_for_every_line_of_a_unit(dtype):
    """While a tile-row's last token group runs, each pass asks for its groups' lines of the next tile-row
    (kernels._pass_lines): over the passes of one token group every 64-byte line of a unit is asked for, codes and
    scales (Q3_K's 16-row group is 1,760 bytes, not whole lines), also where a unit is not line-aligned (80-row
    tiles: 1,440-byte Q4 units) or a pass's first group is odd (passes of three)."""
    from cflow.layout.quant import DType
    for tr in (128, 80):
        L = TileLayout(DType.parse(dtype), 256, 2048, (tr, 256))
        for gp in ((2, 3, 4) if L.dtype in (DType.Q4, DType.Q8) else (1,)):  # row groups a pass (emit_matmat)
            for u in range(2):  # a unit's lines, at u x its size (line-aligned or not)
                base = u * L.unit_nbytes
                offs = [base + off for g0 in range(0, L.groups_per_tile, gp)
                        for off in K._pass_lines(None, L, list(range(g0, min(g0 + gp, L.groups_per_tile))), 0)]
                want = set(range(base // 64, (base + L.unit_nbytes - 1) // 64 + 1))
                assert {off // 64 for off in offs} == want, (dtype, tr, gp, u)
                assert all(base <= off < base + L.unit_nbytes for off in offs)


@pytest.mark.parametrize("next_row", [0, 1])
def test_a_matmat_asks_for_the_next_tile_row_in_its_last_token_group(next_row):
    """The mat-mat's pass over a tile-row asks for its groups' lines of the next tile-row into L2 (locality 2), under
    the last token group's branch; next_row=0 leaves them out (the decode mat-vec never has them)."""
    L = TileLayout("q4", 256, 512, (128, 256))
    mod = ir.Module("k")
    K.emit_matmat(mod, "k", L, ISA.AVX2, 1024, next_row=next_row, tail=K.emit_matvec(mod, "mv", L, ISA.AVX2))
    mm = str(mod).split('define external void @"k"(')[1].split("define ")[0]  # the mat-mat's body, not its tail's
    l2 = [line for line in mm.splitlines() if "llvm.prefetch" in line and "i32 0, i32 2, i32 1" in line]
    gp = K.MATMAT_GROUPS // 4  # AVX2: 4 tokens a group, 4 row groups a pass
    pass_lines = len(K._pass_lines(None, L, list(range(gp)), 0))
    assert len(l2) == next_row * pass_lines
    # the in-row prefetch (into L1) also asks for the pass's lines only, not the whole unit in each pass
    l1 = [line for line in mm.splitlines() if "llvm.prefetch" in line and "i32 0, i32 3, i32 1" in line]
    assert len(l1) == pass_lines < L.unit_nbytes // 64


BLOCK_GU = [(isa, dt) for isa in ISA for dt in ("Q4_K", "IQ4_XS")]


@pytest.mark.parametrize("isa, dtype", BLOCK_GU, ids=[f"{i}-{d}" for i, d in BLOCK_GU])
def test_a_block_types_gate_up_matmat_equals_its_matvec(isa, dtype):
    """A GGUF block type's fused gate+up mat-mat (both halves through kernels._units_at_once, every token of a pass
    dotted with each decoded chunk) gives each token the bits of the fused mat-vec on it alone; a thread's share
    of the tile-rows, and tokens past the token groups through the tail."""
    from cflow.layout.blocks import random_blocks
    from cflow.layout.quant import DType

    target = _target(isa)
    if target is None:
        pytest.skip(f"host lacks {isa}")
    rng = np.random.default_rng(1)
    M, Kd, tile = 96, 512, (32, 256)
    dt = DType.parse(dtype)
    L = TileLayout(dt, M, Kd, tile)
    w = T.pack_gate_up(random_blocks(dt, M, Kd, rng, Kd**-0.5), random_blocks(dt, M, Kd, rng, Kd**-0.5), dt, tile)
    stride, ys = L.cols_p + 64, L.rows_p + 16
    mod = ir.Module("t")
    K.emit_quantize_act(mod, "q", Kd, L.cols_p)
    mv_fn = K.emit_matvec(mod, "mv", L, isa, gate_up=True)
    K.emit_matmat(mod, "mm", L, isa, stride, gate_up=True, act_blocks=stride // 32, tail=mv_fn)
    lib, (q, mv, mm) = _kernels(mod, target)
    n = 11
    X = np.zeros((n, stride), np.float32)
    X[:, :Kd] = rng.standard_normal((n, Kd))
    XQ, XD, XS = np.zeros((n, stride), np.int8), np.zeros((n, stride // 32), np.float32), np.zeros((n, stride // 32),
                                                                                                  np.int32)
    for t in range(n):
        q(_p(X[t]), _p(XQ[t]), _p(XD[t]), _p(XS[t]))
    got, want = np.full((n, ys), 7.0, np.float32), np.full((n, ys), 7.0, np.float32)
    mm(_p(w), _p(X), _p(XQ), _p(XD), _p(XS), _p(got), 1, L.n_tile_rows, n, stride, ys)
    for t in range(n):
        mv(_p(w), _p(X[t]), _p(XQ[t]), _p(XD[t]), _p(XS[t]), _p(want[t]), 1, L.n_tile_rows)
    assert np.array_equal(got, want)
    assert np.abs(got[:, L.tr : L.rows]).max() > 0


def test_q_units_is_refused_where_it_does_not_apply():
    """The chunk-major knob names Q4 / Q8 on a VNNI path; asked for elsewhere it is an error, not a silent no-op (a
    benchmark variant would time the token-by-token kernel under its name). 0 or None is the built-in anywhere."""
    from cflow.errors import CodegenError

    q4, q4k = TileLayout("q4", 64, 256, (32, 256)), TileLayout("Q4_K", 64, 256, (32, 256))
    assert K.matmat_q_units(q4, ISA.AVXVNNI) and not K.matmat_q_units(q4, ISA.AVX512VNNI)
    assert K.matmat_groups(q4, ISA.AVXVNNI) == (4, 1) and K.matmat_groups(q4, ISA.AVXVNNI, q_units=0) == (4, 4)
    assert K.matmat_groups(q4, ISA.AVX512VNNI) == (8, 2) and K.matmat_groups(q4, ISA.AVX512VNNI, q_units=1) == (8, 1)
    assert not K.matmat_q_units(q4, ISA.AVX2, 0) and not K.matmat_q_units(q4k, ISA.AVXVNNI)
    for L, isa in ((q4, ISA.AVX2), (q4, ISA.GENERIC), (q4k, ISA.AVXVNNI)):
        with pytest.raises(CodegenError, match="q_units"):
            K.matmat_q_units(L, isa, 1)
