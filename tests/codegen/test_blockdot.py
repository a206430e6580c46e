"""The GGUF block types' kernels (codegen/blockdot.py) on every ISA path, against the NumPy twin.

Random blocks (every code and scale bit pattern), activations of order 1, a matrix wider than one block and taller
than one tile-row (a partial last tile-row): the mat-vec equals blocks.matvec_twin to float rounding; the
mat-mat's tokens (full token groups and a tail) equal the mat-vec's bit for bit; the gate+up kernel is its
activation of the twin's gate times the twin's up; the embedding row lookup is the dequantised row; the 32-input types
also with two-plane activations (activations='q8x2') against the twin of the two-plane codes. The decoders
(where each type's codes and scales are) are the same IR on every path; what differs per ISA is the integer dot
and the IQ4 code-book lookup, so the portable path runs for the types that reach each of its branches (a K-quant's
portable kernel takes 15-40 s to compile).
"""

import ctypes

import numpy as np
import pytest
from llvmlite import ir

from cflow.codegen import blockdot
from cflow.codegen import kernels as K
from cflow.codegen.library import Library
from cflow.codegen.target import ISA
from cflow.layout import blocks as B
from cflow.layout import tile as T
from cflow.layout.quant import TWO_PLANE_TYPES, DType
from tests._isa import isa_target as _target
from tests.runtime._gguf_blocks import random_blocks

GENERIC_TYPES = {DType.Q5_1, DType.IQ4_NL, DType.Q2_K}  # unsigned and signed dots, the lookup, a 16-input sub-block
# AVX-VNNI differs from AVX-512 VNNI in the dot's width, the code-book lookup (AVX2's) and the K-quants dotted as
# parts (Decoder.parts): the types that reach each of its branches (a legacy unsigned dot, Q4_K's dot of parts, Q6_K's
# integer combine of assembled codes, the signed code book, Q2_K's one part of a 16-input sub-block, Q3_K's two parts
# under the integer combine, Q5_K's two parts beside a min)
VNNI256_TYPES = {DType.Q5_1, DType.Q4_K, DType.Q6_K, DType.IQ4_XS, DType.Q2_K, DType.Q3_K, DType.Q5_K}
SUBSETS = {ISA.GENERIC: GENERIC_TYPES, ISA.AVXVNNI: VNNI256_TYPES}
CASES = [(dt, isa, 1) for dt in B.FORMATS for isa in ISA if dt in SUBSETS.get(isa, B.FORMATS)]
# two-plane activations (activations='q8x2', kernels.plane_dot: each plane the one-plane dot): the 32-input types on
# AVX-512 VNNI; elsewhere a bias and a signed code book on AVX2, a min on AVX-VNNI, the portable signed dot
TWO_PLANE = {ISA.AVX512VNNI: TWO_PLANE_TYPES, ISA.AVXVNNI: {DType.Q5_1}, ISA.AVX2: {DType.Q5_0, DType.IQ4_NL},
             ISA.GENERIC: {DType.IQ4_NL}}
CASES += [(dt, isa, 2) for dt, isa, _ in CASES if dt in TWO_PLANE[isa]]




def _p(a):
    return ctypes.c_void_p(a.ctypes.data)


def _gelu(g):
    g = g.astype(np.float64)
    return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))


@pytest.mark.parametrize("dt, isa, planes", CASES, ids=[f"{d.name}-{i}" + "-x2" * (p == 2) for d, i, p in CASES])
def test_block_kernels(dt, isa, planes):
    target = _target(isa)
    if target is None:
        pytest.skip(f"host lacks {isa}")
    rng = np.random.default_rng(int(dt))
    # a full tile-row and a partial one; two 256-input blocks. Tiles of 32 rows (two 16-row groups): the per-group
    # code is the 128-row tile's with a quarter of the IR to JIT (tests/runtime/test_gguf_types.py runs every type
    # through a whole model at the default 128x256 tile)
    M, Kd = 48, 512
    tile = (32, 256)
    if Kd % B.FORMATS[dt].qk:  # IQ4_192: three 192-input blocks in 192-column tiles
        Kd, tile = 576, (32, 192)
    W = random_blocks(dt, M, Kd, rng, Kd**-0.5)
    U = random_blocks(dt, M, Kd, rng, Kd**-0.5)
    if dt in B.OWN_TYPES:  # the E5M3 super-block scale's edges: 0 (e = 0: a zero block), its least and largest bytes
        top = W.raw.reshape(M, -1, B.FORMATS[dt].nbytes)[..., B.FORMATS[dt].field_slices()["scales"].stop - 1]
        top[0, 0], top[5, 1], top[17, 2], top[M - 1, 0] = 0, 8, 255, 7
    L = T.TileLayout(dt, M, Kd, tile)
    w = T.pack(W, dt, tile)
    gu = T.pack_gate_up(W, U, dt, tile)
    stride, ys = L.cols_p + 64, L.rows_p + 16
    mod = ir.Module("t")
    K.emit_quantize_act(mod, "q", Kd, L.cols_p, planes=planes)
    mv_fn = K.emit_matvec(mod, "mv", L, isa, planes=planes)
    # the other loop kind than the built-in one (kernels.BUILTIN_KNOBS) where the built-in differs per type
    other = isa in (ISA.AVX2, ISA.AVXVNNI) or (isa == ISA.AVX512VNNI and dt == DType.Q6_K)
    if other:
        gl = K.builtin_knobs(L, isa).get("group_loop", 0)
        K.emit_matvec(mod, "mv_other", L, isa, planes=planes, group_loop=1 - gl, prefetch_locality=3)
    # its tail tokens through the mat-vec, as in a step
    K.emit_matmat(mod, "mm", L, isa, planes * stride, act_blocks=stride // 32, planes=planes, tail=mv_fn)
    K.emit_matvec(mod, "gu", L, isa, gate_up=True, act="gelu_tanh", planes=planes)
    # and the other loop kind of the fused kernel (the unit loop takes its halves in one loop): the same bits. On
    # AVX-512, one plane (JIT time): there the built-in fused kernels are of both kinds (BUILTIN_GATE_UP_KNOBS), and
    # the other paths' built-ins run both kinds above
    fused_other = planes == 1 and isa == ISA.AVX512VNNI
    if fused_other:
        gl_gu = K.builtin_knobs(L, isa, gate_up=True).get("group_loop", 0)
        K.emit_matvec(mod, "gu_other", L, isa, gate_up=True, act="gelu_tanh", planes=planes, group_loop=1 - gl_gu)
    emb = blockdot.emit_embed_row(mod, L, isa)
    ext = ir.Function(mod, emb.function_type, "emb")
    eb = ir.IRBuilder(ext.append_basic_block())
    eb.call(emb, ext.args)
    eb.ret_void()
    lib = Library(name="t", target=target, cache=False)
    lib.add_ir(mod)
    lib.finalize()
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    q = lib.get_cfunc("q", None, vp, vp, vp, vp)
    mv = lib.get_cfunc("mv", None, vp, vp, vp, vp, vp, vp, i64, i64)
    mm = lib.get_cfunc("mm", None, vp, vp, vp, vp, vp, vp, i64, i64, i64, i64, i64)
    gfn = lib.get_cfunc("gu", None, vp, vp, vp, vp, vp, vp, i64, i64)
    efn = lib.get_cfunc("emb", None, vp, i64, vp, i64, i64)
    n = 11  # a full token group of 8 (or two of 4) and a tail
    X = np.zeros((n, stride), np.float32)
    X[:, :Kd] = rng.standard_normal((n, Kd))
    XQ, XD, XS = np.zeros((n, planes * stride), np.int8), np.zeros((n, stride // 32), np.float32), np.zeros(
        (n, stride // 32), np.int32)
    for t in range(n):
        q(_p(X[t]), _p(XQ[t]), _p(XD[t]), _p(XS[t]))
    want = np.zeros((n, ys), np.float32)
    for t in range(n):
        mv(_p(w), _p(X[t]), _p(XQ[t]), _p(XD[t]), _p(XS[t]), _p(want[t]), 0, L.n_tile_rows)
    ref = B.matvec_twin(W, X[:, :Kd], planes=planes)
    assert np.abs(want[:, :M] - ref).max() <= 2e-6 * np.abs(ref).max()
    if other:  # the same arithmetic in the same order: the same bits
        mv2, y2 = lib.get_cfunc("mv_other", None, vp, vp, vp, vp, vp, vp, i64, i64), np.zeros(ys, np.float32)
        mv2(_p(w), _p(X[0]), _p(XQ[0]), _p(XD[0]), _p(XS[0]), _p(y2), 0, L.n_tile_rows)
        assert np.array_equal(y2, want[0])
    got = np.zeros((n, ys), np.float32)
    mm(_p(w), _p(X), _p(XQ), _p(XD), _p(XS), _p(got), 0, L.n_tile_rows, n, stride, ys)
    assert np.array_equal(got, want)
    h = np.zeros(L.rows_p, np.float32)
    gfn(_p(gu), _p(X[0]), _p(XQ[0]), _p(XD[0]), _p(XS[0]), _p(h), 0, L.n_tile_rows)
    href = _gelu(ref[0]) * B.matvec_twin(U, X[:1, :Kd], planes=planes)[0]
    assert np.abs(h[:M] - href).max() <= 1e-5 * np.abs(href).max()
    if fused_other:
        h2 = np.zeros(L.rows_p, np.float32)
        gfn2 = lib.get_cfunc("gu_other", None, vp, vp, vp, vp, vp, vp, i64, i64)
        gfn2(_p(gu), _p(X[0]), _p(XQ[0]), _p(XD[0]), _p(XS[0]), _p(h2), 0, L.n_tile_rows)
        assert np.array_equal(h2, h)
    deq = W.dequantize()
    for row in (0, 17, M - 1):
        out = np.full(Kd, np.nan, np.float32)
        efn(_p(w), row, _p(out), 0, 256)  # two threads' shares
        efn(_p(w), row, _p(out), 256, 1 << 20)
        assert np.array_equal(out, deq[row]), row


@pytest.mark.parametrize("dt", list(B.FORMATS), ids=[d.name for d in B.FORMATS])
def test_every_path_gives_the_same_bits(dt):
    """A block type's mat-vec gives the same bits on every FMA path the host has (AVX-512 VNNI, its 256-bit dot
    as `cflow tune` tries it, AVX-VNNI, AVX2): the integer sums are exact and the float work (blockdot.block_unit,
    which the gate+up and mat-mat kernels share) is the same sequence on each, so a file's tokens do not depend
    on the CPU, and the tuner may offer the 256-bit kernel on an AVX-512 host (it refuses a candidate that changes
    the numbers). A per-path reordering of the float work (K-quant scales once a unit on the 256-bit paths only)
    broke both once."""
    rng = np.random.default_rng(int(dt) + 7)
    Kd, tile = (512, (32, 256)) if 512 % B.FORMATS[dt].qk == 0 else (576, (32, 192))
    W = random_blocks(dt, 48, Kd, rng, Kd**-0.5)
    x = rng.standard_normal(Kd).astype(np.float32) * 3
    paths = [(isa, kn) for isa, kn in ((ISA.AVX512VNNI, {}), (ISA.AVX512VNNI, {"vector_bits": 256}),
                                       (ISA.AVXVNNI, {}), (ISA.AVX2, {})) if _target(isa) is not None]
    if len(paths) < 2:
        pytest.skip("the host has one FMA path")
    L = T.TileLayout(dt, 48, Kd, tile)
    buf = T.pack(W, dt, tile)
    ys = []
    for isa, kn in paths:
        mv = K.MatVec(L, target=_target(isa), isa=isa, cache=False, **kn)
        ys.append(mv(buf, mv.activation(x)))
    for (isa, kn), y in zip(paths[1:], ys[1:]):
        np.testing.assert_array_equal(y, ys[0], err_msg=f"{dt.name} on {isa} {kn}")
