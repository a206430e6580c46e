"""The vector math helpers the attention core is built from (codegen/cgutils.py): exp_vec against numpy over its
whole range and its edges, and hsum's fixed halving order, on the host and on the generic (SSE2) target."""

import ctypes

import numpy as np
import pytest
from llvmlite import ir

from cflow.codegen.cgutils import P, V, exp_vec, f32, hsum, i64
from cflow.codegen.library import compile_ir
from cflow.codegen.target import generic_target, host_target

TARGETS = {"host": host_target(env=False), "generic": generic_target()}


def _kernel(target, n=16, fma=False):
    """f(x, y, count): y[i*n:(i+1)*n] = exp_vec(x[...]) over count vectors; returns the last vector's hsum too."""
    m = ir.Module(name="cg")
    m.triple = target.triple
    fn = ir.Function(m, ir.FunctionType(f32, [P(f32), P(f32), i64]), "f")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    x, y, count = fn.args
    loop, done = fn.append_basic_block("loop"), fn.append_basic_block("done")
    b.branch(loop)
    b.position_at_end(loop)
    i = b.phi(i64)
    i.add_incoming(ir.Constant(i64, 0), fn.entry_basic_block)
    off = b.mul(i, ir.Constant(i64, n))
    v = b.load(b.bitcast(b.gep(x, [off]), P(V(f32, n))), align=4)
    b.store(exp_vec(b, v, fma), b.bitcast(b.gep(y, [off]), P(V(f32, n))), align=4)
    s = hsum(b, v)
    nxt = b.add(i, ir.Constant(i64, 1))
    i.add_incoming(nxt, loop)
    b.cbranch(b.icmp_signed("<", nxt, count), loop, done)
    b.position_at_end(done)
    b.ret(s)
    lib = compile_ir(m, target=target, cache=False)
    return lib, lib.get_cfunc("f", ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


CASES = {"host": ("host", False), "generic": ("generic", False), "host-fma": ("host", True)}  # FMA: not on generic


@pytest.mark.parametrize("name", CASES)
def test_exp_vec_matches_numpy(name):
    lib, f = _kernel(TARGETS[CASES[name][0]], fma=CASES[name][1])
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-87.3, 88.0, 16 * 4000), np.linspace(-20, 0, 16 * 100)]).astype(np.float32)
    y = np.empty_like(x)
    f(x.ctypes.data, y.ctypes.data, len(x) // 16)
    ref = np.exp(x.astype(np.float64))
    rel = np.abs(y - ref) / ref
    assert rel.max() < 3e-7  # ~2 ulp of f32


@pytest.mark.parametrize("name", CASES)
def test_exp_vec_edges(name):
    lib, f = _kernel(TARGETS[CASES[name][0]], fma=CASES[name][1])
    x = np.array([-np.inf, -1e30, -87.34, -87.33, 0.0, -0.0, 1.0, 88.0, 89.0, np.inf, np.nan, -np.nan,
                  -1e-30, 1e-30, -0.5, 0.5], np.float32)
    y = np.empty_like(x)
    f(x.ctypes.data, y.ctypes.data, 1)
    assert y[0] == 0.0 and y[1] == 0.0 and y[2] == 0.0  # below the smallest normal result: exactly 0
    assert y[3] > 0 and abs(y[3] / np.exp(np.float64(x[3])) - 1) < 3e-7
    assert y[4] == 1.0 and y[5] == 1.0 and y[12] == 1.0 and y[13] == 1.0
    assert abs(y[6] / np.e - 1) < 3e-7 and np.isfinite(y[7])
    assert y[8] == np.inf and y[9] == np.inf and np.isnan(y[10]) and np.isnan(y[11])


@pytest.mark.parametrize("name", TARGETS)
def test_hsum_is_a_fixed_halving_tree(name):
    lib, f = _kernel(TARGETS[name])
    v = np.array([1e8, 1.0, -1e8, 3.0, 0.25, 7.0, 1e-3, -2.0, 5.0, 1e7, 0.5, -1e7, 2.0, 1.5, -0.75, 9.0], np.float32)
    y = np.empty_like(v)
    want = v.copy()
    while len(want) > 1:
        h = len(want) // 2
        want = (want[:h] + want[h:]).astype(np.float32)
    assert f(v.ctypes.data, y.ctypes.data, 1) == want[0]


@pytest.mark.parametrize("name", TARGETS)
def test_float_to_half_rounds_as_numpy(name):
    """The KV cache's f16 store (F16C on the host, integer ops on the generic path) against numpy's astype."""
    from cflow.codegen.cgutils import float_to_half, half_to_float, i16

    target = TARGETS[name]
    m = ir.Module(name="fh")
    m.triple = target.triple
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), [P(f32), P(i16), P(f32), i64]), "f")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    x, h, back, count = fn.args
    isa = target.isa
    loop, done = fn.append_basic_block("loop"), fn.append_basic_block("done")
    b.branch(loop)
    b.position_at_end(loop)
    i = b.phi(i64)
    i.add_incoming(ir.Constant(i64, 0), fn.entry_basic_block)
    off = b.mul(i, ir.Constant(i64, 8))
    v = b.load(b.bitcast(b.gep(x, [off]), P(V(f32, 8))), align=4)
    hv = float_to_half(b, v, isa)
    b.store(hv, b.bitcast(b.gep(h, [off]), P(V(i16, 8))), align=2)
    b.store(half_to_float(b, hv, isa), b.bitcast(b.gep(back, [off]), P(V(f32, 8))), align=4)
    nxt = b.add(i, ir.Constant(i64, 1))
    i.add_incoming(nxt, loop)
    b.cbranch(b.icmp_signed("<", nxt, count), loop, done)
    b.position_at_end(done)
    b.ret_void()
    lib = compile_ir(m, target=target, cache=False)
    f = lib.get_cfunc("f", None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    rng = np.random.default_rng(1)
    edges = np.array([0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e6, -1e6, np.inf, -np.inf, 6.1e-5, 6.0e-8, 3.0e-8,
                      2.9e-8, 1e-10, 5.96e-8 * 1.5, 1.0 + 2**-11, 1.0 + 3 * 2**-11, -2.5e-6], np.float32)
    scaled = (rng.standard_normal(8000) * 10.0 ** rng.integers(-9, 6, 8000)).astype(np.float32)
    anybits = rng.integers(0, 2**32, 8000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([edges, scaled, anybits])
    x = np.concatenate([x, np.zeros(-len(x) % 8, np.float32)])
    h, back = np.empty(len(x), np.uint16), np.empty_like(x)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16)
    f(x.ctypes.data, h.ctypes.data, back.ctypes.data, len(x) // 8)
    nan = np.isnan(x)
    assert np.array_equal(h[~nan], want.view(np.uint16)[~nan])
    assert np.isnan(h[nan].view(np.float16)).all()
    assert np.array_equal(back[~nan], want[~nan].astype(np.float32))


def _softcap_kernel(target, cap: float, vector: bool):
    """f(x, y, count): y = softcap(x) over count vectors of 16, lane by lane (vector=False: one scalar call each)."""
    from cflow.codegen.cgutils import Loop, c64, softcap

    m = ir.Module(name="sc")
    m.triple = target.triple
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), [P(f32), P(f32), i64]), "f")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    x, y, count = fn.args
    if vector:
        with Loop(b, c64(0), count, "k") as k:
            off = b.mul(k, c64(16))
            v = b.load(b.bitcast(b.gep(x, [off]), P(V(f32, 16))), align=4)
            b.store(softcap(b, v, cap), b.bitcast(b.gep(y, [off]), P(V(f32, 16))), align=4)
    else:
        with Loop(b, c64(0), b.mul(count, c64(16)), "i") as i:
            b.store(softcap(b, b.load(b.gep(x, [i])), cap), b.gep(y, [i]))
    b.ret_void()
    lib = compile_ir(m, target=target, cache=False)
    return lib, lib.get_cfunc("f", None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


@pytest.mark.parametrize("vector", [True, False], ids=["vector", "scalar"])
@pytest.mark.parametrize("name", TARGETS)
def test_softcap_saturates_keeps_nan_and_matches_tanh(name, vector):
    """Gemma 2's cap * tanh(x / cap) without libm (exp_vec): +-cap at the extremes, NaN kept, tanh's values, and no
    call in the code (a libm call per lane spilled the attention core's registers)."""
    cap = 30.0
    lib, f = _softcap_kernel(TARGETS[name], cap, vector)
    edges = np.array([np.inf, -np.inf, 1e30, -1e30, 1e13, -1e13, np.nan, 0.0, -0.0, 1e-30, 3000.0, -3000.0,
                      29.0, -29.0, 0.5, -0.5], np.float32)
    rng = np.random.default_rng(1)
    x = np.concatenate([edges, rng.normal(0, 40, 16 * 200).astype(np.float32)])
    y = np.empty_like(x)
    f(x.ctypes.data, y.ctypes.data, len(x) // 16)
    assert y[0] == cap and y[1] == -cap and y[2] == cap and y[3] == -cap and y[4] == cap and y[5] == -cap
    assert np.isnan(y[6]) and y[7] == 0.0 and abs(y[9]) < 1e-6
    ref = cap * np.tanh(x[7:].astype(np.float64) / cap)
    assert np.abs(y[7:] - ref).max() < 3e-6 * cap
    assert "call" not in lib.get_asm_str()
