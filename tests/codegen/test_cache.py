"""codegen.cache: a second load of the same IR skips LLVM; any key change or corruption is a miss."""

import ctypes

import pytest
from llvmlite import ir

import cflow
from cflow.codegen.cache import ObjectCache, make_key
from cflow.codegen.library import Library
from cflow.codegen.target import host_target

HOST = host_target(env=False)


def tiny_module(k=3):
    i64 = ir.IntType(64)
    mod = ir.Module(name="tiny")
    fn = ir.Function(mod, ir.FunctionType(i64, [i64]), "f")
    b = ir.IRBuilder(fn.append_basic_block())
    b.ret(b.mul(fn.args[0], ir.Constant(i64, k)))
    return mod


def build(cache, target=HOST, k=3, opt=3):
    lib = Library(name="tiny", target=target, cache=cache, opt=opt)
    lib.add_ir(tiny_module(k))
    lib.finalize()
    return lib, lib.get_cfunc("f", ctypes.c_int64, ctypes.c_int64)


def test_second_load_hits_and_skips_llvm(tmp_path):
    cache = ObjectCache(tmp_path)
    lib1, f1 = build(cache)
    assert not lib1.stats["cache_hit"] and f1(5) == 15
    assert len(list(tmp_path.glob("*.o"))) == 1
    lib2, f2 = build(ObjectCache(tmp_path))
    assert lib2.stats["cache_hit"] and f2(7) == 21
    assert lib2.stats["optimise_s"] < 1e-3  # the optimisation pipeline did not run
    assert lib2.object_code == lib1.object_code
    assert "mul" in lib2.get_llvm_str() or "shl" in lib2.get_llvm_str()  # dumps still work on a hit
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # temps renamed into place


def test_miss_on_feature_ir_opt_or_version_change(tmp_path, monkeypatch):
    cache = ObjectCache(tmp_path)
    build(cache)
    other = HOST.with_features("-avx512vnni" if HOST.has("avx512vnni") else "-sse4.2")
    assert build(ObjectCache(tmp_path), target=other)[0].stats["cache_hit"] is False
    assert build(ObjectCache(tmp_path), k=4)[0].stats["cache_hit"] is False  # other IR
    assert build(ObjectCache(tmp_path), opt=2)[0].stats["cache_hit"] is False
    monkeypatch.setattr(cflow, "__version__", "0.0.0-test")
    lib, f = build(ObjectCache(tmp_path))
    assert lib.stats["cache_hit"] is False and f(2) == 6


def test_key_covers_every_field():
    base = make_key("ir", HOST, 3)
    assert make_key("ir", HOST, 3) == base
    assert make_key("ir2", HOST, 3) != base
    assert make_key("ir", HOST, 2) != base
    assert make_key("ir", HOST.with_features("-avx2"), 3) != base
    assert set(base.stamp) >= {"ir_sha256", "triple", "cpu", "features", "opt", "llvmlite", "cflow"}


@pytest.mark.parametrize("damage", ["garbage", "truncate", "flip", "empty", "stale_stamp"])
def test_corrupt_entry_is_ignored(tmp_path, damage):
    cache = ObjectCache(tmp_path)
    lib, _ = build(cache)
    (path,) = tmp_path.glob("*.o")
    data = bytearray(path.read_bytes())
    if damage == "garbage":
        data = bytearray(b"not an object file" * 10)
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[-10] ^= 0xFF
    elif damage == "empty":
        data = bytearray()
    else:  # a valid entry written for other versions under this name
        old = f'"cflow": "{cflow.__version__}"'.encode()
        assert old in data
        data = data.replace(old, b'"cflow": "other"')
    path.write_bytes(bytes(data))
    lib2, f = build(ObjectCache(tmp_path))
    assert lib2.stats["cache_hit"] is False and f(3) == 9
    lib3, _ = build(ObjectCache(tmp_path))  # the miss rewrote a good entry
    assert lib3.stats["cache_hit"] is True


def test_unwritable_cache_dir_still_compiles(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    lib, f = build(ObjectCache(blocker / "sub"))  # cannot mkdir under a regular file
    assert f(4) == 12


def test_default_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("CFLOW_CACHE_DIR", str(tmp_path / "c"))
    assert ObjectCache().directory == tmp_path / "c"
    monkeypatch.delenv("CFLOW_CACHE_DIR")
    assert ObjectCache().directory.parts[-2:] == (".cache", "cflow")


def test_disabled_cache(tmp_path):
    lib, f = build(False)
    assert lib.cache is None and f(1) == 3
