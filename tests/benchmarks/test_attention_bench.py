"""benchmarks/attention.py on a small geometry: a record per cache type, prefetch distance and position, through
codegen/attn_tune.py's harness (numbers are not asserted: a benchmark)."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
attention = pytest.importorskip("attention")


def test_records_per_kv_prefetch_and_position(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(attention, "measure_read_bandwidth", lambda threads, nbytes: 10.0)  # not what is tested
    monkeypatch.setattr(attention, "fma_rate", lambda reps=5: 1e11)
    monkeypatch.setattr(attention, "bf16_rate", lambda reps=5: 5e10)
    out = tmp_path / "a.json"
    attention.main(["--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--max-seq", "64", "--contexts", "8,40",
                    "--kv", "f16,bf16", "--prefetch", "0,4096", "--reps", "1", "--layers", "3", "--json", str(out)])
    recs = json.loads(out.read_text())
    assert [(r["kv"], r["kv_prefetch"], r["pos"]) for r in recs] == [
        (kv, pf, p) for kv in ("f16", "bf16") for pf in (0, 4096) for p in (8, 40)]
    assert all(r["us"] > 0 and r["kv_bytes"] == 2 * (r["pos"] + 1) * 2 * 16 * 2 for r in recs)
    assert "FMA floor" in capsys.readouterr().out
