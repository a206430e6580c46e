"""benchmarks.attention on a small geometry: a record per cache type, prefetch distance and position, through
codegen/attn_tune.py's harness (numbers are not asserted: a benchmark)."""

import json

from benchmarks import attention


def test_records_per_kv_prefetch_and_position(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(attention, "read_gbs", lambda threads, gib=1.0, reps=5: 10.0)  # not what is tested
    monkeypatch.setattr(attention, "fma_rate", lambda reps=5: 1e11)
    monkeypatch.setattr(attention, "bf16_rate", lambda reps=5: 5e10)
    out = tmp_path / "a.json"
    attention.main(["--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--max-seq", "64", "--contexts", "8,40",
                    "--kv", "f16,bf16", "--prefetch", "0,4096", "--reps", "1", "--layers", "3", "--json", str(out)])
    recs = json.loads(out.read_text())["records"]
    ext = [r["extra"] for r in recs]
    assert [(e["kv"], e["kv_prefetch"], e["pos"]) for e in ext] == [
        (kv, pf, p) for kv in ("f16", "bf16") for pf in (0, 4096) for p in (8, 40)]
    assert all(e["us"] > 0 and e["kv_bytes"] == 2 * (e["pos"] + 1) * 2 * 16 * 2 for e in ext)
    assert all(r["read_gbs"] == 10.0 and r["threads"] == 1 and r["tok_s"] is None for r in recs)
    assert len({r["variant"] for r in recs}) == len(recs)  # each record its own (compare pairs on it)
    assert "FMA floor" in capsys.readouterr().out
