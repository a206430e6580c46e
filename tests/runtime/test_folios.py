"""The page-cache survey and mend (runtime/format/folios.py): what they report, that the survey reads nothing from
disk, that a load mends a file written in small folios where the host can (and leaves it where it cannot), and
that CFLOW_FOLIOS=keep leaves the cache alone. Hosts differ (file system, THP settings, tmpfs): each test accepts
the outcomes the module documents and checks they are consistent, never a host-specific number."""

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


def _mapped(path) -> mmap.mmap:
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    advise_huge_pages(mm)
    return mm


def test_runs_group_consecutive_chunks():
    assert list(_runs(())) == []
    assert list(_runs((3,))) == [(3, 1)]
    assert list(_runs((0, 1, 2, 5, 7, 8))) == [(0, 3), (5, 1), (7, 2)]


def test_survey_str_and_share():
    s = Survey(chunks=10, huge=(0, 1, 2), small=(5,))
    assert s.share_huge == 0.75
    assert str(s) == "6 MiB in 2 MiB folios, 2 MiB in small folios, 12 MiB not cached"
    assert Survey(chunks=4, huge=(), small=()).share_huge == 1.0
    assert "not surveyed" in str(Mended(None, reason="x"))
    assert "dropped 4 MiB" in str(Mended(s, dropped=2))


def test_file_smaller_than_a_chunk_is_not_surveyed(tmp_path):
    p = tmp_path / "small.bin"
    p.write_bytes(b"x" * 100_000)
    mm = _mapped(p)
    assert survey(mm) is None
    m = mend(mm, p)
    assert m.before is None and m.dropped == 0 and m.reason


def test_survey_reads_nothing_from_disk(tmp_path):
    p = tmp_path / "cold.bin"
    _written(p, 4)
    drop_cached(p)
    mm = _mapped(p)
    before = cached_pages(mm)
    if before is None or before.any():
        pytest.skip("mincore unavailable, or this file system keeps dropped pages (tmpfs)")
    s = survey(mm)
    if s is None:
        pytest.skip("no pagemap or an unaligned mapping here")
    assert s.huge == () and s.small == () and s.chunks == 4
    assert not cached_pages(mm).any(), "the survey must not fault uncached chunks in"


def test_written_file_is_small_then_mended_or_kept(tmp_path):
    p = tmp_path / "written.bin"
    _written(p, 4)
    mm = _mapped(p)
    m = mend(mm, p)
    if m.before is None:
        pytest.skip(m.reason)
    assert m.before.chunks == 4
    if not m.before.small:  # a file system that caches written pages in large folios: nothing to mend
        assert m.dropped == 0
        return
    assert len(m.before.huge) + len(m.before.small) == 4
    buf = np.frombuffer(mm, np.uint8)
    int(buf[::4096].sum())  # decode's first pass: read back what was dropped
    after = survey(mm)
    if m.dropped == 4:  # the probe came back in a 2 MiB folio: all of it should
        assert len(after.huge) >= 3, f"mended, yet {after}"
    else:  # the host cannot: one chunk tried, the rest kept, and said why
        assert m.dropped == 1 and "small folios" in m.reason
        assert after.huge == ()
    with open(p, "rb") as f:
        assert f.read() == buf.tobytes(), "the bytes are the file's, whatever the folios"


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
    kept = cflow.load(copy, threads=1)
    assert kept.session.folios is None
    ref = [kept.session.step(t).copy() for t in (1, 2, 3)]
    kept.close()
    monkeypatch.delenv("CFLOW_FOLIOS")
    m = cflow.load(copy, threads=1)
    mended = m.session.folios
    assert isinstance(mended, Mended)
    if mended.before is not None and mended.before.small:
        assert mended.dropped in (1, len(mended.before.small))
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
