"""benchmarks.tune_threads runs end to end on a tiny buffer (numbers not asserted: a benchmark)."""

import json

import pytest

from benchmarks import tune_threads
from cflow.codegen import tune


@pytest.fixture(autouse=True)
def small_space(monkeypatch):
    """The candidates cut to two prefetch distances and both loop kinds (tests/codegen/test_tune.py's small_space):
    the script's flow is what is tested here, and each candidate's JIT is most of a run's time."""
    from tests.codegen.test_tune import small_space

    monkeypatch.setattr(tune, "space", small_space)


def test_runs_and_splits_exactly(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("CFLOW_CACHE_DIR", str(tmp_path))  # no cached choice: the recorded one
    cands = tune_threads.main(["--shape", "q8:512:plain", "--threads", "2", "--rounds", "1", "--mb", "1",
                               "--json", str(tmp_path / "t.json")])
    out = capsys.readouterr().out
    assert cands[0] == tune.DEFAULT and len(cands) >= 2  # the default and the choice's neighbours
    assert "2 threads" in out and "scaling" in out and "<- 1-thread choice" in out
    recs = json.loads((tmp_path / "t.json").read_text())["records"]
    assert [(r["threads"], r["variant"]) for r in recs] == [(n, tune.label(c)) for c in cands for n in (1, 2)]
    assert all(r["read_gbs"] > 0 and r["extra"]["gbps"] > 0 for r in recs)


def test_round_robin_chunks_cover_every_tile_row_once():
    for n, nth, chunk in ((37, 2, 4), (8, 2, 0), (5, 3, 1), (100, 2, 16)):
        got = sorted(r for t in range(nth) for lo, hi in tune_threads.ranges(n, nth, t, chunk) for r in range(lo, hi))
        assert got == list(range(n))


def test_file_backed_weights(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("CFLOW_CACHE_DIR", str(tmp_path))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    tune_threads.main(["--shape", "q8:512:plain", "--threads", "2", "--rounds", "1", "--mb", "1", "--backing", "file"])
    assert "a memory-mapped file" in capsys.readouterr().out
    assert not list((tmp_path / "tmp").iterdir())  # the temporary weights file is gone


def test_extra_knob_variants(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("CFLOW_CACHE_DIR", str(tmp_path))
    cands = tune_threads.main(["--shape", "q8:512:plain", "--threads", "2", "--rounds", "1", "--mb", "1",
                               "--knobs", "unroll=1,max_groups=4"])
    assert cands[-1]["unroll"] == 1 and cands[-1]["max_groups"] == 4
    assert "g4" in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["nope=1", "unroll=x", "vector_bits=128", "unpack=1"])  # unpack: Q4 only
def test_bad_knobs_are_refused(bad, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("CFLOW_CACHE_DIR", str(tmp_path))
    with pytest.raises(SystemExit):
        tune_threads.main(["--shape", "q8:512:plain", "--knobs", bad])
    assert "--knobs" in capsys.readouterr().err
