"""float32 -> float16 in a JIT loop: NumPy's `astype(np.float16)` bit for bit, at memory speed.

    to_half(x, out=None) -> float16 array of x's shape (out: a C-contiguous float16 array to fill)

Why: NumPy converts to float16 one value at a time in software (~2.3 ns a value here): it was most of the
synthetic embedding's cost (models/synthetic.py) and a third of drawing the Q4 scales. The loop converts 16
values per step with cgutils.float_to_half (F16C's VCVTPS2PH, or the integer-only path on a generic target),
which rounds to nearest even like NumPy, overflows to inf and keeps NaN quiet
(tests/codegen/test_writer_kernels.py compares every finite f16 boundary with NumPy's).
"""

from __future__ import annotations

import ctypes

import numpy as np
from llvmlite import ir

from .cgutils import Loop, c64, float_to_half
from .library import utility_functions
from .target import host_target

LANES = 16


def kernel_module(isa) -> ir.Module:
    """void f32_to_f16(float* src, i16* dst, i64 n): LANES values per step, then one at a time."""
    i16, i64, f32 = ir.IntType(16), ir.IntType(64), ir.FloatType()
    vf, vh = ir.VectorType(f32, LANES), ir.VectorType(i16, LANES)
    mod = ir.Module(name="half")
    fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [f32.as_pointer(), i16.as_pointer(), i64]), "f32_to_f16")
    src, dst, n = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    steps = b.udiv(n, c64(LANES))
    with Loop(b, c64(0), steps, "vec") as k:
        i = b.mul(k, c64(LANES))
        x = b.load(b.bitcast(b.gep(src, [i]), vf.as_pointer()), align=4)
        b.store(float_to_half(b, x, isa), b.bitcast(b.gep(dst, [i]), vh.as_pointer()), align=2)
    with Loop(b, b.mul(steps, c64(LANES)), n, "tail") as i:
        b.store(float_to_half(b, b.load(b.gep(src, [i])), isa), b.gep(dst, [i]))
    b.ret_void()
    return mod


def _fn():
    """The compiled kernel (once per process, for the host target)."""
    return utility_functions("half", lambda: kernel_module(host_target().isa),
                             {"f32_to_f16": (None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)})["f32_to_f16"]


def to_half(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x (float32) as float16, rounded as NumPy rounds; into `out` (C-contiguous, x's size) if given."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if out is None:
        out = np.empty(x.shape, np.float16)
    if out.dtype != np.float16 or out.size != x.size or not out.flags.c_contiguous:
        raise ValueError(f"to_half writes a C-contiguous float16 array of {x.size} values, got {out.dtype} "
                         f"{out.shape}")
    _fn()(x.ctypes.data, out.ctypes.data, x.size)  # ctypes releases the GIL while it runs
    return out
