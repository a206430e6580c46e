"""benchmarks/decode.py --variants (compare_variants) on a tiny compiled model: one record per variant and thread
count, the per-round ratios to the first variant, and the per-round fraction of the read loop (numbers themselves
are not asserted: a benchmark)."""

import os
import sys

import pytest

from cflow.compiler import compile_file
from cflow.frontend.load import load_graph

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
decode = pytest.importorskip("decode")


def test_compare_variants_records(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CFLOW_TUNE", "off")  # no tuning search in a test
    monkeypatch.setenv("CFLOW_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "arch1.vflow"
    c = compile_file(load_graph("preset:arch1@tiny"), path, "q4")
    recs = decode.compare_variants(str(path), c, [1, 2, 3], ["default", "kv-f32"], [1, 2], rounds=2, tokens=4,
                                   gib=1 / 64)
    assert [(r["variant"], r["threads"]) for r in recs] == [("default", 1), ("kv-f32", 1), ("default", 2),
                                                            ("kv-f32", 2)]
    for r in recs:
        assert len(r["tok_s_rounds"]) == 2 and len(r["read_rounds"]) == 2 and r["tok_s"] > 0
        assert 0 < r["fraction_per_round"] and r["bytes_per_token"] > 0 and r["cpu"]
        if r["variant"] == "default":
            assert r["ratio_to_first"] == 1.0
    out = capsys.readouterr().out
    assert "per round:" in out and "threads=2" in out
