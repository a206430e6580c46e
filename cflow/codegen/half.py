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
import threading

import numpy as np
from llvmlite import ir

from .cgutils import float_to_half
from .library import Library
from .target import host_target

LANES = 16
_lock = threading.Lock()
_kernel: list = []


def kernel_module(isa) -> ir.Module:
    """void f32_to_f16(float* src, i16* dst, i64 n): LANES values per step, then one at a time."""
    i16, i64, f32 = ir.IntType(16), ir.IntType(64), ir.FloatType()
    vf, vh = ir.VectorType(f32, LANES), ir.VectorType(i16, LANES)
    mod = ir.Module(name="half")
    fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [f32.as_pointer(), i16.as_pointer(), i64]), "f32_to_f16")
    src, dst, n = fn.args
    entry = fn.append_basic_block("entry")
    b = ir.IRBuilder(entry)
    whole = b.mul(b.udiv(n, ir.Constant(i64, LANES)), ir.Constant(i64, LANES))

    def loop(name: str, start, stop, step: int, body) -> None:
        pre = b.block
        head, blk, done = (fn.append_basic_block(f"{name}_{s}") for s in ("head", "body", "done"))
        b.branch(head)
        b.position_at_end(head)
        i = b.phi(i64)
        i.add_incoming(start, pre)
        b.cbranch(b.icmp_unsigned("<", i, stop), blk, done)
        b.position_at_end(blk)
        body(i)
        i.add_incoming(b.add(i, ir.Constant(i64, step)), b.block)
        b.branch(head)
        b.position_at_end(done)

    def vec(i) -> None:
        x = b.load(b.bitcast(b.gep(src, [i]), vf.as_pointer()), align=4)
        b.store(float_to_half(b, x, isa), b.bitcast(b.gep(dst, [i]), vh.as_pointer()), align=2)

    def one(i) -> None:
        b.store(float_to_half(b, b.load(b.gep(src, [i])), isa), b.gep(dst, [i]))

    loop("vec", ir.Constant(i64, 0), whole, LANES, vec)
    loop("tail", whole, n, 1, one)
    b.ret_void()
    return mod


def _fn():
    """The compiled kernel (once per process; the Library kept alive with it)."""
    with _lock:
        if not _kernel:
            target = host_target()
            lib = Library(name="half", target=target)
            lib.add_ir(kernel_module(target.isa))
            _kernel.extend([lib, lib.get_cfunc("f32_to_f16", None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)])
        return _kernel[1]


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
