"""The page-cache survey and mend (runtime/format/folios.py): what they report, that the survey reads nothing from
disk, that a load mends a file written in small folios where the host can (and leaves it where it cannot), and
that CFLOW_FOLIOS=keep leaves the cache alone. Hosts differ (file system, THP settings, tmpfs): each test accepts
the outcomes the module documents and checks they are consistent, never a host-specific number."""

import gc
import mmap
import os
import shutil

import numpy as np
import pytest

import cflow
from cflow.compiler import compile_file
from cflow.frontend.load import load_graph
from cflow.runtime.format.folios import (
    HUGE,
    Mended,
    Survey,
    _runs,
    advise_huge_pages,
    cached_pages,
    drop_cached,
    mend,
    mend_folios_enabled,
    survey,
)


def _written(path, chunks: int) -> None:
    """A file written in 64 KiB writes (its cached pages in small folios: large writes may get large folios on
    ext4 since 6.16), fsynced so it can be dropped."""
    data = np.random.default_rng(0).integers(0, 256, chunks * HUGE, np.uint8).tobytes()
    with open(path, "wb") as f:
        for at in range(0, len(data), 64 << 10):
            f.write(data[at : at + (64 << 10)])
        f.write(b"tail")  # a partial chunk past the last whole one: never counted
        f.flush()
        os.fsync(f.fileno())


@pytest.fixture
def mapped():
    """mapped(path) -> (mmap with MADV_HUGEPAGE, (st_dev, st_ino)); every mapping closed after the test."""
    maps = []

    def open_map(path):
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            st = os.fstat(f.fileno())
        advise_huge_pages(mm)
        maps.append(mm)
        return mm, (st.st_dev, st.st_ino)

    yield open_map
    for mm in maps:
        try:
            mm.close()
        except BufferError:  # a NumPy view still alive: freed with it
            pass


def test_runs_group_consecutive_chunks():
    assert list(_runs(())) == []
    assert list(_runs((3,))) == [(3, 1)]
    assert list(_runs((0, 1, 2, 5, 7, 8))) == [(0, 3), (5, 1), (7, 2)]


def test_survey_and_mended_text():
    s = Survey(chunks=10, huge=(0, 1, 2), small=(5,))
    assert str(s) == "6 MiB in 2 MiB folios, 2 MiB in small folios, 12 MiB not cached"
    assert "not surveyed (x)" in str(Mended(None, reason="x"))
    assert "dropped 4 MiB" in str(Mended(s, dropped=2))
    kept = str(Mended(s, reason="kept: a dropped chunk came back in small folios"))
    assert "dropped" not in kept.split(";")[-2] and kept.endswith("came back in small folios")


@pytest.mark.parametrize("value,on", [("keep", False), ("off", False), ("0", False), ("No", False),
                                      ("false", False), ("mend", True), ("", True)])
def test_the_switch(monkeypatch, value, on):
    monkeypatch.setenv("CFLOW_FOLIOS", value)
    assert mend_folios_enabled() is on


def test_file_smaller_than_a_chunk_is_not_surveyed(tmp_path, mapped):
    p = tmp_path / "small.bin"
    p.write_bytes(b"x" * 100_000)
    mm, ident = mapped(p)
    assert survey(mm) is None
    m = mend(mm, p, ident)
    assert m.before is None and m.dropped == 0 and m.reason == "file shorter than one 2 MiB chunk"


def test_survey_reads_nothing_from_disk(tmp_path, mapped):
    p = tmp_path / "cold.bin"
    _written(p, 4)
    drop_cached(p)
    mm, _ = mapped(p)
    before = cached_pages(mm)
    if before is None or before.any():
        pytest.skip("mincore unavailable, or this file system keeps dropped pages (tmpfs)")
    s = survey(mm)
    if s is None:
        pytest.skip("no huge pages, pagemap or aligned mapping here")
    assert s.huge == () and s.small == () and s.chunks == 4
    assert not cached_pages(mm).any(), "the survey must not fault uncached chunks in"


def test_written_file_is_small_then_mended_or_kept(tmp_path, mapped):
    p = tmp_path / "written.bin"
    _written(p, 4)
    mm, ident = mapped(p)
    m = mend(mm, p, ident)
    if m.before is None:
        pytest.skip(m.reason)
    assert m.before.chunks == 4 and len(m.before.huge) + len(m.before.small) == 4
    if not m.before.small:  # a file system that caches written pages in large folios: nothing to mend
        assert m.dropped == 0
        return
    buf = np.frombuffer(mm, np.uint8)
    int(buf[::4096].sum())  # decode's first pass: read back what was dropped
    after = survey(mm)
    if m.dropped:  # large folios proven (by the probe or by chunks already huge): the dropped come back huge
        assert len(after.huge) > len(m.before.huge), f"mended, yet {after}"
    else:  # the host cannot: the rest kept, and said why
        assert "kept" in m.reason
        assert set(after.huge) == set(m.before.huge)
    with open(p, "rb") as f:
        assert f.read() == buf.tobytes(), "the bytes are the file's, whatever the folios"
    del buf


def test_a_replaced_file_keeps_its_cache(tmp_path, mapped):
    # mend drops by path: once the path names another file (a recompile's atomic rename), nothing is dropped
    p = tmp_path / "old.bin"
    _written(p, 2)
    mm, ident = mapped(p)
    _written(tmp_path / "new.bin", 2)
    os.replace(tmp_path / "new.bin", p)
    with open(p, "rb") as f:
        f.read()  # the new file cached
    new, _ = mapped(p)
    cached_new = cached_pages(new)
    m = mend(mm, p, ident)
    if m.before is None or cached_new is None:
        pytest.skip(m.reason or "mincore unavailable")
    assert np.array_equal(cached_pages(new), cached_new), "the new file's cache was dropped"


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    # f32 arch1@small: ~6 MB, three whole 2 MiB chunks
    path = tmp_path_factory.mktemp("folios") / "arch1_small_f32.vflow"
    compile_file(load_graph("preset:arch1@small"), path, "f32")
    return path


def _copy_in_small_folios(src, dst) -> None:
    with open(src, "rb") as a, open(dst, "wb") as b:
        shutil.copyfileobj(a, b, 64 << 10)
        b.flush()
        os.fsync(b.fileno())


def test_load_mends_a_copied_file_and_decodes_the_same(model_file, tmp_path, monkeypatch):
    copy = tmp_path / "copy.vflow"
    _copy_in_small_folios(model_file, copy)
    monkeypatch.setenv("CFLOW_FOLIOS", "keep")
    kept = cflow.load(copy, threads=1, prefill_block=1)  # decode-only programs: only steps run here
    assert kept.session.folios is None
    ref = [kept.session.step(t).copy() for t in (1, 2, 3)]
    kept.close()
    del kept
    gc.collect()  # its mapping gone: mapped pages cannot leave the page cache
    monkeypatch.delenv("CFLOW_FOLIOS")
    m = cflow.load(copy, threads=1, prefill_block=1)
    mended = m.session.folios
    assert isinstance(mended, Mended)
    if mended.before is not None and mended.before.small:  # all dropped, or kept with the reason
        assert mended.dropped == len(mended.before.small) or "kept" in mended.reason
    got = [m.session.step(t).copy() for t in (1, 2, 3)]
    m.close()
    assert all(np.array_equal(a, b) for a, b in zip(ref, got))


def test_disk_tiers_are_not_surveyed(tmp_path):
    path = tmp_path / "moe.vflow"
    compile_file(load_graph("preset:arch4_async_experts@tiny"), path, "q4")
    m = cflow.load(path, threads=1, experts="disk")
    try:
        assert m.session.folios is None  # experts read with O_DIRECT: the mapping is not decode's source
    finally:
        m.close()
