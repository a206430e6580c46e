"""benchmarks.decode --variants (compare_variants) on a tiny compiled model: one record per variant and thread
count, the per-round ratios to the first variant, and the per-round fraction of the read loop (numbers themselves
are not asserted: a benchmark)."""

from benchmarks import decode
from cflow.compiler import compile_file
from cflow.frontend.load import load_graph


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
        e = r["extra"]
        assert len(e["tok_s_rounds"]) == 2 and len(e["read_rounds"]) == 2 and r["tok_s"] > 0
        assert 0 < e["fraction_per_round"] and r["bytes_per_token"] > 0 and r["cpu_model"] and r["read_gbs"] > 0
        assert (r["engine"], r["quant"]) == ("cflow", "q4") and (r["variant"] != "kv-f32" or e["kv"] == "f32")
        if r["variant"] == "default":
            assert e["ratio_to_first"] == 1.0
    out = capsys.readouterr().out
    assert "per round:" in out and "threads=2" in out
