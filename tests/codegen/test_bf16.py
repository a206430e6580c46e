"""The bf16 helpers of the kv='bf16' attention core (codegen/cgutils.py): float_to_bf16 equals its NumPy twin
(layout.quant.bf16_bits) on ties, specials and random floats, and bf16_dot's instruction and emulation both equal
the exact pair sum in VDPBF16PS's order, on every lane count the core uses."""

import ctypes

import numpy as np
import pytest
from llvmlite import ir

from cflow.codegen.cgutils import P, V, bf16_dot, f32, float_to_bf16, i16, i32
from cflow.codegen.library import compile_ir
from cflow.codegen.target import host_target
from cflow.layout.quant import bf16_bits, bf16_to_f32, round_bf16


def _convert_fn(hw=False, n=16):
    m = ir.Module(name=f"bf{n}{hw}")
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), [P(f32), P(i16)]), "conv")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    x, y = fn.args
    b.store(float_to_bf16(b, b.load(b.bitcast(x, P(V(f32, n))), align=4), hw), b.bitcast(y, P(V(i16, n))), align=2)
    b.ret_void()
    lib = compile_ir(m, target=host_target(env=False), cache=False)
    return lib, lib.get_cfunc("conv", None, ctypes.c_void_p, ctypes.c_void_p)


def test_float_to_bf16_equals_numpy():
    lib, f = _convert_fn()
    special = np.array([0.0, -0.0, 1.0, 1.00390625, 1.01171875, -1.01171875, np.inf, -np.inf, np.nan, 3.4e38,
                        -3.4e38, 1e-40, -1e-40, 1.1754944e-38, 65504.0, 0.1], np.float32)
    rnd = np.random.default_rng(0).standard_normal(16 * 64).astype(np.float32) * 10.0 ** np.repeat(
        np.arange(-8, 8), 64).astype(np.float32)
    for chunk in [special, *rnd.reshape(-1, 16)]:
        out = np.zeros(16, np.uint16)
        f(chunk.ctypes.data, out.ctypes.data)
        np.testing.assert_array_equal(out, bf16_bits(chunk))
    np.testing.assert_array_equal(round_bf16(special[:4]), [0.0, -0.0, 1.0, 1.0])  # 1 + 2^-8 ties to even


@pytest.mark.parametrize("n", [8, 16])
def test_float_to_bf16_instruction_equals_numpy_on_normal_floats(n):
    """VCVTNEPS2BF16 (hw=True, what the attention core rounds its softmax weights with): the twin's bits for zeros,
    normal floats, infinities and ties; subnormals flushed to zero (the documented difference)."""
    if not host_target(env=False).has_avx512_bf16:
        pytest.skip("no AVX512_BF16 on this host")
    lib, f = _convert_fn(hw=True, n=n)
    special = np.array([0.0, -0.0, 1.0, 1.00390625, 1.01171875, -1.01171875, np.inf, -np.inf, 3.4e38, -3.4e38,
                        1.1754944e-38, 65504.0, 0.1, 0.5, 0.99999994, 2.0 ** -126], np.float32)
    rnd = np.random.default_rng(1).standard_normal(16 * 64).astype(np.float32) * 10.0 ** np.repeat(
        np.arange(-8, 8), 64).astype(np.float32)
    for chunk in [*special.reshape(-1, n), *rnd.reshape(-1, n)]:
        out = np.zeros(n, np.uint16)
        f(chunk.ctypes.data, out.ctypes.data)
        np.testing.assert_array_equal(out, bf16_bits(chunk))
    sub = np.full(n, 1e-40, np.float32)
    out = np.ones(n, np.uint16)
    f(sub.ctypes.data, out.ctypes.data)
    np.testing.assert_array_equal(out, 0)


def _dot_fn(n, hw):
    m = ir.Module(name=f"dot{n}{hw}")
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), [P(f32), P(i32), P(i32), P(f32)]), "dot")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    acc, x, y, out = fn.args

    def ld(p, t):
        return b.load(b.bitcast(p, P(V(t, n))), align=4)

    b.store(bf16_dot(b, ld(acc, f32), ld(x, i32), ld(y, i32), hw), b.bitcast(out, P(V(f32, n))), align=4)
    b.ret_void()
    lib = compile_ir(m, target=host_target(env=False), cache=False)
    return lib, lib.get_cfunc("dot", None, *([ctypes.c_void_p] * 4))


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_bf16_dot_is_the_ordered_exact_pair_sum(n):
    hws = [False] + ([True] if host_target(env=False).has_avx512_bf16 else [])
    rng = np.random.default_rng(n)
    for hw in hws:
        lib, f = _dot_fn(n, hw)
        for _ in range(50):
            acc = rng.standard_normal(n).astype(np.float32)
            xb, yb = (bf16_bits(rng.standard_normal(2 * n).astype(np.float32) * 4) for _ in range(2))
            out = np.zeros(n, np.float32)
            f(acc.ctypes.data, xb.view(np.int32).ctypes.data, yb.view(np.int32).ctypes.data, out.ctypes.data)
            xf, yf = bf16_to_f32(xb), bf16_to_f32(yb)
            want = (acc + xf[1::2] * yf[1::2]) + xf[0::2] * yf[0::2]  # each product exact in f32
            np.testing.assert_array_equal(out, want.astype(np.float32), err_msg=f"hw={hw}")
