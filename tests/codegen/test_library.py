"""codegen.library: add (parse + verify), finalize, lookup, dumps; the ISA really reaches the machine code."""

import ctypes

import pytest
from llvmlite import ir

from cflow.codegen import kernels as K
from cflow.codegen.library import Library, compile_ir
from cflow.codegen.target import ISA, generic_target, host_target
from cflow.errors import CodegenError
from cflow.layout.tile import TileLayout
from tests._isa import isa_target

HOST = host_target(env=False)


def add_module(name="add"):
    i32 = ir.IntType(32)
    mod = ir.Module(name=name)
    fn = ir.Function(mod, ir.FunctionType(i32, [i32, i32]), name)
    b = ir.IRBuilder(fn.append_basic_block())
    b.ret(b.add(*fn.args))
    return mod


def test_lifecycle_and_linking():
    lib = Library(name="t", target=HOST, cache=False)
    lib.add_ir(add_module("add"))
    lib.add_ir(str(add_module("add2")))  # IR text works too; modules are linked into one
    f = lib.get_cfunc("add", ctypes.c_int32, ctypes.c_int32, ctypes.c_int32)  # finalizes on demand
    assert lib.finalized and f(2, 3) == 5
    assert lib.get_cfunc("add2", ctypes.c_int32, ctypes.c_int32, ctypes.c_int32)(4, 5) == 9
    with pytest.raises(CodegenError, match="after finalize"):
        lib.add_ir(add_module("late"))
    with pytest.raises(CodegenError, match="no function"):
        lib.get_function_address("missing")
    assert "define" in lib.get_llvm_str() and "add2" in lib.get_asm_str()


def test_invalid_ir_is_a_codegen_error():
    lib = Library(name="bad", target=HOST, cache=False)
    with pytest.raises(CodegenError, match="invalid LLVM IR"):
        lib.add_ir("define i32 @f() { ret i64 0 }")
    with pytest.raises(CodegenError, match="no IR"):
        lib.finalize()


def test_isa_reaches_machine_code():
    L = TileLayout("q4", 32, 64, (32, 64))
    asm = {}
    for isa in ISA:
        target = isa_target(isa)
        if target is None:
            continue
        mod = ir.Module(name=isa)
        K.emit_matvec(mod, "mv", L, isa)
        asm[isa] = compile_ir(mod, target=target, cache=False).get_asm_str()
    if "avx512vnni" in asm:
        assert "vpdpbusd" in asm["avx512vnni"] and "zmm" in asm["avx512vnni"]
    if "avxvnni" in asm:  # the VEX form: "{vex} vpdpbusd" on ymm
        assert "vpdpbusd" in asm["avxvnni"] and "ymm" in asm["avxvnni"] and "zmm" not in asm["avxvnni"]
        assert "vpmaddubsw" not in asm["avxvnni"]
    if "avx2" in asm:
        assert "vpmaddubsw" in asm["avx2"] and "zmm" not in asm["avx2"] and "vpdpbusd" not in asm["avx2"]
    assert "ymm" not in asm["generic"] and "zmm" not in asm["generic"]


def test_features_the_host_lacks_are_refused():
    lacking = next(f for f, on in HOST.feature_map.items() if not on)
    with pytest.raises(CodegenError, match="lacks"):
        Library(target=HOST.with_features("+" + lacking), cache=False)


def test_kernel_isa_above_target_is_refused():
    with pytest.raises(CodegenError, match="lacks"):
        K.MatVec(TileLayout("q4", 16, 32, (16, 32)), target=generic_target(), isa="avx2", cache=False)


def test_concurrent_lookups_finalize_once():
    import threading

    lib = Library(name="conc", target=HOST, cache=False)
    lib.add_ir(add_module("add"))
    addrs, errors = [], []

    def look():
        try:
            addrs.append(lib.get_function_address("add"))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=look) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors and len(set(addrs)) == 1
