"""cflow.util.atomic_path and its one-liners: all or nothing, clear errors, nothing left behind."""

import os
import re
import tempfile

import pytest

from cflow.errors import CflowError
from cflow.util import atomic_copy, atomic_path, atomic_write_bytes, atomic_write_text, recover_atomic


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


# -- the three errors a user can cause ---------------------------------------------------------
def test_missing_parent_directory_is_named(tmp_path):
    target = tmp_path / "nope" / "m.gguf"
    want = f"cannot write {target}: directory {target.parent} does not exist"
    with pytest.raises(CflowError, match=f"^{re.escape(want)}$"):
        atomic_write_bytes(target, b"x")
    assert list(tmp_path.iterdir()) == []


def test_directory_as_target(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(CflowError, match=f"^{re.escape(str(tmp_path / 'd'))} is a directory$"):
        atomic_write_text(tmp_path / "d", "x")
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_permission_denied_names_the_path(tmp_path, monkeypatch):
    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", denied)
    with pytest.raises(CflowError, match=f"^cannot write {re.escape(str(tmp_path / 'm.txt'))}: permission denied$"):
        atomic_write_text(tmp_path / "m.txt", "x")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(CflowError, match=f"cannot write {re.escape(str(ro / 'm.txt'))}: permission denied"):
            atomic_write_text(ro / "m.txt", "x")
    finally:
        ro.chmod(0o755)


# -- files -------------------------------------------------------------------------------------
def test_write_replace_and_mode(tmp_path):
    p = tmp_path / "m.txt"
    atomic_write_text(p, "old")
    atomic_write_text(p, "new ✓")
    assert p.read_text(encoding="utf-8") == "new ✓"
    atomic_write_bytes(p, b"\x00\x01", durable=False)
    assert p.read_bytes() == b"\x00\x01"
    atomic_copy(p, tmp_path / "c.bin")
    assert (tmp_path / "c.bin").read_bytes() == b"\x00\x01"
    assert os.stat(p).st_mode & 0o777 == 0o666 & ~_umask()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["c.bin", "m.txt"]


def test_exception_keeps_old_file_and_leaves_no_temp(tmp_path):
    p = tmp_path / "m.txt"
    p.write_text("precious")
    with pytest.raises(RuntimeError), atomic_path(p) as tmp:
        tmp.write_text("half")
        raise RuntimeError("boom")
    assert p.read_text() == "precious"
    assert [x.name for x in tmp_path.iterdir()] == ["m.txt"]


def test_temp_keeps_the_name_and_companions_are_published(tmp_path):
    p = tmp_path / "m.onnx"
    with atomic_path(p) as tmp:
        assert tmp.name == "m.onnx" and tmp.parent.parent == tmp_path and tmp.parent.name.startswith(".m.onnx.")
        tmp.write_text("model")
        (tmp.parent / "m.onnx.data").write_text("weights")
        assert not p.exists()
    assert p.read_text() == "model" and (tmp_path / "m.onnx.data").read_text() == "weights"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]


def test_nothing_written_is_an_error(tmp_path):
    with pytest.raises(CflowError, match="nothing was written"), atomic_path(tmp_path / "m.txt"):
        pass
    assert list(tmp_path.iterdir()) == []


def test_open_commit_abort_without_with(tmp_path):
    a = atomic_path(tmp_path / "m.txt")
    a.open().write_text("x")
    a.abort()
    a.abort()
    assert list(tmp_path.iterdir()) == []
    a = atomic_path(tmp_path / "m.txt")
    a.open().write_text("y")
    a.commit()
    a.commit()  # idempotent
    assert (tmp_path / "m.txt").read_text() == "y"


# -- directories -------------------------------------------------------------------------------
def test_directory_replaces_old_version(tmp_path):
    out = tmp_path / "run"
    with atomic_path(out, directory=True) as d:
        (d / "a").write_text("1")
    with atomic_path(out, directory=True) as d:
        (d / "b").write_text("2")
    assert sorted(x.name for x in out.iterdir()) == ["b"]
    assert [x.name for x in tmp_path.iterdir()] == ["run"]
    with pytest.raises(RuntimeError), atomic_path(out, directory=True) as d:
        (d / "c").write_text("3")
        raise RuntimeError("boom")
    assert sorted(x.name for x in out.iterdir()) == ["b"]
    assert [x.name for x in tmp_path.iterdir()] == ["run"]


def test_directory_over_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(CflowError, match="exists and is not a directory"):
        atomic_path(tmp_path / "f", directory=True).open()


def test_recover_interrupted_swap(tmp_path):
    out, old = tmp_path / "run", tmp_path / ".run.old"
    old.mkdir()
    (old / "config.json").write_text("{}")
    (tmp_path / ".run.k3j2h1.tmp").mkdir()
    recover_atomic(out)
    assert (out / "config.json").is_file() and [x.name for x in tmp_path.iterdir()] == ["run"]
    old.mkdir()  # a stale previous version beside a complete one is dropped
    recover_atomic(out)
    assert [x.name for x in tmp_path.iterdir()] == ["run"]


def test_available_memory_sees_the_address_space_limit():
    import subprocess
    import sys

    code = ("import resource; from cflow.util import available_memory as a; before = a(); "
            "resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.RLIM_INFINITY)); after = a(); "
            "print(before is None or before > 0, after is not None and 0 < after < 4 << 30)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.split() == ["True", "True"]


def test_check_output_path(tmp_path):
    import pytest

    from cflow.errors import CflowError
    from cflow.util import check_output_dir, check_output_path

    assert check_output_path(tmp_path / "a" / "b" / "m.vflow", "-o").parent.is_dir()  # directories created
    assert not list((tmp_path / "a" / "b").iterdir())  # the probe leaves nothing behind
    with pytest.raises(CflowError, match="-o .*is a directory"):
        check_output_path(tmp_path / "a", "-o")
    (tmp_path / "f").write_text("x")
    with pytest.raises(CflowError, match="is not a directory"):
        check_output_path(tmp_path / "f" / "m.vflow", "-o")
    with pytest.raises(CflowError, match="--out .*not a directory"):
        check_output_dir(tmp_path / "f", "--out")
    assert not (tmp_path / "run").exists() and check_output_dir(tmp_path / "run", "--out") == tmp_path / "run"


def test_prefetch_map_order_errors_and_early_stop():
    import threading
    import time

    import pytest

    from cflow.util import prefetch_map

    for workers in (1, 2, 3):
        assert list(prefetch_map(lambda x: x * x, iter(range(50)), workers=workers)) == [x * x for x in range(50)]
    assert list(prefetch_map(str, [])) == []
    made = []

    def slow(i):  # later items finish first: the order is still the input's
        time.sleep(0.002 * (i % 3))
        made.append(i)
        return i

    assert list(prefetch_map(slow, range(20), workers=3)) == list(range(20))
    made.clear()
    it = prefetch_map(slow, range(100), workers=2)
    assert [next(it), next(it)] == [0, 1]
    time.sleep(0.05)
    assert len(made) <= 4  # one with the consumer, two made ahead (bounded look-ahead)
    it.close()  # the consumer stops: the threads are joined
    assert not [t for t in threading.enumerate() if t.name.startswith("cflow-prefetch")]
    assert len(made) <= 4

    def failing(i):
        if i == 1:
            raise ValueError("boom")
        return i

    got = []
    with pytest.raises(ValueError, match="boom"):
        for x in prefetch_map(failing, range(5), workers=2):
            got.append(x)
    assert got == [0]

    # ahead_bytes: items queued beyond the workers while the unconsumed results hold less than it
    made.clear()
    it = prefetch_map(slow, range(100), workers=1, size=lambda i: 10, ahead_bytes=35)
    assert next(it) == 0
    time.sleep(0.05)
    assert 3 <= len(made) <= 6  # 0 consumed, 1..4 queued (40 bytes reach the 35), then one more once 0 leaves
    assert list(it) == list(range(1, 100))


def test_crc32_is_zlibs():
    import zlib

    import numpy as np

    from cflow.util import crc32

    rng = np.random.default_rng(0)
    for n in (0, 1, 31, 4096, 1 << 20):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        assert crc32(memoryview(data)) == zlib.crc32(memoryview(data))
        assert crc32(data[n // 2 :], crc32(data[: n // 2])) == zlib.crc32(data)  # continued, as the writer does
